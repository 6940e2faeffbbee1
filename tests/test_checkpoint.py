"""A checkpoint read without transformers' model classes (engine/checkpoint.py) holds the bits transformers loads:
every parameter by name and dtype, tied weights as one, and the RoPE tables at every position, for each supported
family, Llama 3's scaled RoPE, older configs and sharded files; a checkpoint outside what it reads exactly is loaded
by transformers instead; and such a start never imports transformers' model code (the seconds it saves)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_families import _families, save_tiny_model

from kvstrata.engine.checkpoint import CausalLM
from kvstrata.engine.model_loader import load_model, resolve_model

pytestmark = pytest.mark.slow

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


def llama3_scaled():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=49152, max_position_embeddings=1024, tie_word_embeddings=True,
                       rope_parameters=dict(LLAMA3_ROPE), initializer_range=0.2)


def both_ways(model_dir, dtype):
    source = resolve_model(str(model_dir))
    return load_model(source, dtype, "cpu"), load_model(source, dtype, "cpu", transformers_modules=True)


def assert_same_bits(ours, theirs, dtype):
    assert isinstance(ours.model, CausalLM) and not isinstance(theirs.model, CausalLM)
    assert ours.model_config == theirs.model_config
    params = dict(ours.model.named_parameters())
    for name, expected in theirs.model.named_parameters():
        got = params.pop(name)
        assert got.dtype == expected.dtype == dtype and torch.equal(got, expected), name
    assert not params, sorted(params)
    tied = theirs.model.get_output_embeddings().weight is theirs.model.get_input_embeddings().weight
    assert (ours.model.get_output_embeddings().weight is ours.model.get_input_embeddings().weight) == tied
    positions = torch.arange(4096)[None]
    x = torch.ones(1, dtype=dtype)
    for got, expected in zip(ours.model.get_decoder().rotary_emb(x, positions),
                             theirs.model.get_decoder().rotary_emb(x, positions), strict=True):
        assert got.dtype == expected.dtype == dtype and torch.equal(got, expected)
    assert ours.model.generation_config.eos_token_id == theirs.model.generation_config.eos_token_id


@pytest.mark.parametrize("family", ["llama_gqa_head_dim_128", "mistral", "qwen2_attention_bias", "qwen3_qk_norm",
                                    "llama3_scaled_rope"])
def test_a_checkpoint_reads_to_the_bits_transformers_loads(family, tmp_path):
    config = llama3_scaled() if family == "llama3_scaled_rope" else _families()[family]
    model_dir = save_tiny_model(tmp_path / family, config)
    for dtype in (torch.float32, torch.bfloat16):  # saved in float32: bfloat16 is a cast on load, as transformers'
        assert_same_bits(*both_ways(model_dir, dtype), dtype)


def test_an_older_config_and_sharded_weights_read_the_same(tmp_path):
    """`rope_theta` and `rope_scaling` at the top of config.json (as checkpoints saved before transformers 5 have
    them), and weights in several safetensors files named by an index."""
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_model(tmp_path / "model", llama3_scaled())
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.save_pretrained(model_dir, max_shard_size="1MB")
    (model_dir / "model.safetensors").unlink(missing_ok=True)
    assert (model_dir / "model.safetensors.index.json").is_file()
    config = json.loads((model_dir / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (model_dir / "config.json").write_text(json.dumps(config))
    assert_same_bits(*both_ways(model_dir, torch.float32), torch.float32)


@pytest.mark.parametrize("change", ["yarn_rope", "no_norm_epsilon", "an_extra_tensor", "a_missing_tensor"])
def test_a_checkpoint_outside_what_it_reads_exactly_is_loaded_by_transformers(change, tmp_path):
    model_dir = save_tiny_model(tmp_path / "model", _families()["mistral"])
    config = json.loads((model_dir / "config.json").read_text())
    if change == "yarn_rope":
        config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                     "original_max_position_embeddings": 512}
    elif change == "no_norm_epsilon":
        del config["rms_norm_eps"]  # the family's default is transformers' to decide
    else:
        state = load_file(str(model_dir / "model.safetensors"))
        if change == "an_extra_tensor":
            state["model.layers.0.self_attn.sinks"] = torch.zeros(4)
        else:
            del state["model.layers.1.mlp.up_proj.weight"]
        save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(config))
    loaded = load_model(resolve_model(str(model_dir)), torch.float32, "cpu")
    assert not isinstance(loaded.model, CausalLM)
    assert type(loaded.model).__name__ == "MistralForCausalLM"


def test_reading_a_checkpoint_imports_no_transformers_model_code(tmp_path):
    """transformers' modeling code imports torch's compiler and distributed packages: seconds of every start."""
    model_dir = save_tiny_model(tmp_path / "model", _families()["qwen3_qk_norm"])
    script = ("import sys, torch\n"
              "from kvstrata.engine.model_loader import load_model, resolve_model\n"
              f"loaded = load_model(resolve_model({str(model_dir)!r}), torch.float32, 'cpu')\n"
              "print(type(loaded.model).__name__, sorted(m for m in sys.modules if m.startswith("
              "('transformers.models.qwen3.modeling', 'transformers.modeling_utils', 'torch._dynamo', "
              "'torch.distributed.tensor'))))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["CausalLM", "[]"]


def test_a_truncated_weights_file_is_one_line_naming_the_model(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model", _families()["llama_gqa_head_dim_128"])
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    with pytest.raises(ValueError) as info:
        load_model(resolve_model(str(model_dir)), torch.float32, "cpu")
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"model.name: cannot load {model_dir}")
    assert "not readable safetensors" in message
