"""The decoder (engine/decoder.py) computes, on the torch path, the bits transformers' own modules compute on the
same weights over the same paged KV cache (benchmarks/suites/kernels/decoder_step.py runs them so, as the engine did before the
decoder), for every supported family's parts; and packing a model's projections holds its weights once."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_model_families import _families

from benchmarks.suites.kernels.decoder_step import CASES, Paths, register_transformers_attention, step_input, TRANSFORMERS_ATTENTION
from kvstrata.engine.decoder import Decoder
from kvstrata.engine.model_loader import LoadedModel
from kvstrata.engine.model_runner import ModelRunner
from kvstrata.kernels.backends import get_ops
from kvstrata.tiers.base import BlockLayout


def loaded_tiny(config, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    from kvstrata.engine.model_loader import _summarise, embedded_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().requires_grad_(False)
    return LoadedModel(model, None, _summarise(model, embedded_tokenizer(), "tiny"), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama_gqa_head_dim_128", "mistral", "qwen2_attention_bias", "qwen3_qk_norm"])
def test_decoder_gives_the_bits_of_transformers_modules_on_the_paged_cache(family, dtype):
    loaded = loaded_tiny(_families()[family], dtype)
    cfg = loaded.model_config
    register_transformers_attention()
    loaded.model.set_attn_implementation(TRANSFORMERS_ATTENTION)
    for case in CASES[:3]:  # a decode, a question after a cached context, a batch of decodes
        step, num_blocks = step_input(case, 40, cfg.vocab_size)
        layout = BlockLayout(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, dtype)
        caches = [layout.allocate(num_blocks, "cpu").normal_(generator=torch.Generator().manual_seed(1))
                  for _ in range(2)]
        decoder = Paths(ModelRunner(loaded, caches[0], get_ops("torch"))).decoder(step)
        transformers = Paths(ModelRunner(loaded, caches[1], get_ops("torch"))).transformers(step)
        assert torch.equal(decoder, transformers), case.name
        assert torch.equal(caches[0], caches[1]), f"{case.name}: the stored K/V differ"


def test_packing_holds_each_weight_once_and_a_second_decoder_copies_nothing():
    loaded = loaded_tiny(_families()["qwen2_attention_bias"], torch.float32)
    attn = loaded.model.get_decoder().layers[0].self_attn
    q_weight = attn.q_proj.weight.clone()
    first = Decoder(loaded.model, get_ops("torch"))
    second = Decoder(loaded.model, get_ops("torch"))
    packed = first.layers[0].qkv
    assert second.layers[0].qkv.data_ptr() == packed.data_ptr()
    assert attn.q_proj.weight.data_ptr() == packed.data_ptr()  # the module's weight is a view of the pack
    assert attn.k_proj.weight.data_ptr() == packed[attn.q_proj.weight.shape[0]:].data_ptr()
    assert torch.equal(attn.q_proj.weight, q_weight)
    assert first.layers[0].qkv_bias is not None  # Qwen2's q, k and v biases, packed the same way
    assert torch.equal(first.layers[0].qkv_bias[:q_weight.shape[0]], attn.q_proj.bias)
    # on the CPU's torch path the pack is stored [in, out] (MKL's plain product, no copy of the weight per call)
    assert packed.t().is_contiguous() and attn.q_proj.weight.shape == q_weight.shape


def test_a_pack_in_the_other_layout_is_made_anew_and_the_modules_follow_it():
    """A Triton decoder after a torch one on the same model (tests do this) packs its rows row-major again: the
    modules' weights are then views of the new pack, with the same values, and the torch decoder keeps its own."""
    loaded = loaded_tiny(_families()["mistral"], torch.float32)
    attn = loaded.model.get_decoder().layers[0].self_attn
    q_weight = attn.q_proj.weight.clone()
    torch_pack = Decoder(loaded.model, get_ops("torch")).layers[0].qkv
    row_major = dataclasses.replace(get_ops("torch"), name="triton")  # the layout follows the backend's name
    pack = Decoder(loaded.model, row_major).layers[0].qkv
    assert pack.is_contiguous() and attn.q_proj.weight.data_ptr() == pack.data_ptr()
    assert torch.equal(attn.q_proj.weight, q_weight) and torch.equal(torch_pack, pack)


def test_the_step_benchmark_asserts_agreement_in_float32_and_measures_it_in_bf16():
    from benchmarks.suites.kernels.decoder_step import check_agreement

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    off = logits.clone()
    off[0] = -off[0]  # the first row's top token moves; half the logits' norm is off by twice itself
    runs = {"decoder": lambda step: logits, "transformers": lambda step: off}
    with pytest.raises(AssertionError, match="transformers"):
        check_agreement(runs, None, torch.float32)
    measured = check_agreement(runs, None, torch.bfloat16)
    assert measured["decoder"] == {"relative_error": 0.0, "same_top_token": 1.0}
    assert measured["transformers"]["same_top_token"] == 0.5
    expected = (2 * logits[0].double().norm() / logits.double().norm()).item()
    assert measured["transformers"]["relative_error"] == pytest.approx(expected)
