"""Model families beyond SmolLM2, on tiny random checkpoints built here from transformers configs and
saved with the embedded model's tokenizer: greedy float32 outputs with every tier on equal those with
caching off and transformers' own `generate`. Also: a model re-saved with new weights never gets the
old weights' blocks, and random-weight models (`load_format: dummy`) for benchmarks.
"""
from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

import pytest
import torch

from kvstrata import LLM, SamplingParams, load_config
from kvstrata.engine.checkpoint import CausalLM
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.model_loader import build_dummy_model, embedded_tokenizer, load_model, resolve_model
from kvstrata.kernels.backends import cpu_kernel_available, resolve_batch_invariant

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _families():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    # Tiny but with each family's own parts: hidden sizes of 64-128, two layers, grouped-query
    # attention everywhere. Weights are drawn wider than transformers' default (std 0.02), so that
    # greedy choices are clear-cut rather than near-ties decided by rounding.
    common = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 49152, "max_position_embeddings": 1024, "initializer_range": 0.2}
    return {
        "llama_gqa_head_dim_128": LlamaConfig(hidden_size=128, head_dim=128, tie_word_embeddings=False, **common),
        "mistral": MistralConfig(hidden_size=64, sliding_window=None, **common),
        "qwen2_attention_bias": Qwen2Config(hidden_size=64, tie_word_embeddings=True, **common),
        "qwen3_qk_norm": Qwen3Config(hidden_size=64, head_dim=32, **common),
    }


def save_tiny_model(directory: Path, config, seed: int = 0) -> Path:
    """A random checkpoint of `config` (weights drawn from `seed`) with the embedded tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    embedded_tokenizer().save_pretrained(directory)
    return directory


def chat(question: str) -> list[dict]:
    from pydoc_data.topics import topics
    return [{"role": "user", "content": f"{topics['try'][:600]}\n\nQuestion: {question}"}]


def engine_config(model_dir: Path, disk: Path | None = None, caching: bool = True) -> dict:
    tiers = {"device": {"size": 64}}
    if disk is not None:
        tiers.update(cpu={"size": 64}, disk={"path": str(disk), "size": "64MiB"})
    # always_load: which tier serves a hit must not depend on how fast a tiny model computes on a busy machine
    return {"model": {"name": str(model_dir), "dtype": "float32", "device": "cpu"},
            "cache": {"enable_prefix_caching": caching, "tiers": tiers, "load_policy": "always_load"}}


def transformers_generate(loaded, prompt_ids: list[int]) -> list[int]:
    """transformers' own greedy `generate` on the same weights (SDPA attention, its own KV cache)."""
    with torch.inference_mode():
        out = loaded.model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("family", ["llama_gqa_head_dim_128", "mistral", "qwen2_attention_bias", "qwen3_qk_norm"])
def test_family_outputs_with_every_tier_equal_caching_off_and_transformers(family, tmp_path):
    model_dir = save_tiny_model(tmp_path / family, _families()[family])
    loaded = load_model(resolve_model(str(model_dir)), torch.float32, "cpu")
    assert isinstance(loaded.model, CausalLM)  # read without transformers' model classes (engine/checkpoint.py)

    uncached = LLM(engine_config(model_dir, caching=False), loaded_model=loaded)
    reference = uncached.chat(chat("When is the finally clause executed?"), GREEDY)[0]
    uncached.close()
    in_transformers = load_model(resolve_model(str(model_dir)), torch.float32, "cpu", transformers_modules=True)
    assert reference.token_ids == transformers_generate(in_transformers, reference.prompt_token_ids)

    def ask(llm):
        out = llm.chat(chat("When is the finally clause executed?"), GREEDY)[0]
        assert out.token_ids == reference.token_ids, out.cached_tokens_by_tier
        return out.cached_tokens_by_tier

    cached = LLM(engine_config(model_dir, tmp_path / "kv"), loaded_model=loaded)
    assert sum(ask(cached).values()) == 0
    assert ask(cached)["device"] > 0
    assert cached.engine.hierarchy.clear_device_cache()
    assert ask(cached)["cpu"] > 0
    cached.close()  # writes everything down to the disk tier
    restarted = LLM(engine_config(model_dir, tmp_path / "kv"), loaded_model=loaded)
    assert ask(restarted)["disk"] > 0
    restarted.close()


def test_unsupported_architecture_is_one_line_naming_it_before_any_weight_is_read(tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                               "model_type": "gpt2"}))
    (tmp_path / "gpt2" / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ValueError) as info:
        load_model(resolve_model(str(tmp_path / "gpt2")), torch.float32, "cpu")
    message = str(info.value)
    assert "\n" not in message and message.startswith("model.name: ")
    assert "architecture GPT2LMHeadModel is not supported" in message


def test_model_resaved_with_new_weights_of_the_same_sizes_gets_no_blocks_of_the_old(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "digests"))
    config = _families()["llama_gqa_head_dim_128"]
    model_dir = save_tiny_model(tmp_path / "model", config, seed=0)
    sizes = {p.name: p.stat().st_size for p in model_dir.iterdir()}
    cfg = load_config(engine_config(model_dir, tmp_path / "kv"))
    question = chat("What does the else clause do?")

    with LLM(cfg) as first:
        assert first.chat(question, GREEDY)[0].cached_tokens == 0
    with LLM(cfg) as same_weights:  # the control: unchanged weights are found on disk after a restart
        assert same_weights.chat(question, GREEDY)[0].cached_tokens_by_tier["disk"] > 0

    save_tiny_model(model_dir, config, seed=1)  # a fine-tune written over its base: same files, same sizes
    assert {p.name: p.stat().st_size for p in model_dir.iterdir()} == sizes
    with LLM(load_config(engine_config(model_dir, caching=False))) as uncached:
        expected = uncached.chat(question, GREEDY)[0].token_ids
    with LLM(cfg) as new_weights:
        out = new_weights.chat(question, GREEDY)[0]
    assert out.cached_tokens == 0, out.cached_tokens_by_tier
    assert out.token_ids == expected


# ---------------------------------------------------------------------------------- random weights


def test_dummy_preset_builds_a_deterministic_model_with_the_embedded_tokenizer():
    config = load_config({"model": {"name": "tiny-llama", "load_format": "dummy", "dtype": "float32",
                                    "device": "cpu"}, "cache": {"tiers": {"device": {"size": 64}}}})
    outputs = []
    for _ in range(2):
        with LLM(config) as llm:
            out = llm.generate("The capital of France is", GREEDY)[0]
            outputs.append(out.token_ids)
            shape = llm.engine.loaded.model_config
    assert outputs[0] == outputs[1] and len(outputs[0]) == MAX_TOKENS
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, 2, 16)
    assert llm.tokenizer.convert_tokens_to_ids("<|im_end|>") in shape.eos_token_ids


def test_dummy_model_has_a_namespace_apart_from_the_real_model_of_the_same_config(tmp_path):
    model_dir = save_tiny_model(tmp_path / "real", _families()["mistral"], seed=7)
    real = load_model(resolve_model(str(model_dir)), torch.float32, "cpu")
    dummy = load_model(resolve_model(str(model_dir), "dummy"), torch.float32, "cpu")
    assert dummy.model_config.identity != real.model_config.identity
    assert "@dummy-seed0-cpu:" in dummy.model_config.identity and "@xxh3_128:" in real.model_config.identity
    # the same architecture and shape, other weights
    assert type(dummy.model).__name__ == real.model.config.to_dict()["architectures"][0]
    assert dummy.model.lm_head.weight.shape == real.model.lm_head.weight.shape
    assert not torch.equal(dummy.model.lm_head.weight, real.model.lm_head.weight)


def test_dummy_model_is_built_in_the_asked_dtype_with_the_tokenizers_vocabulary(tmp_path, caplog):
    shape_only = tmp_path / "llama-3-8b-shape"
    shape_only.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192}
    (shape_only / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        loaded = build_dummy_model(resolve_model(str(shape_only), "dummy"), torch.bfloat16, "cpu")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model_config.vocab_size == 49152 == loaded.model.lm_head.weight.shape[0]
    assert "vocabulary of 49152 tokens (the config says 128256)" in caplog.text


def tiny_dummy(tmp_path: Path, **model) -> dict:
    return {"model": {"name": "tiny-llama", "load_format": "dummy", "device": "cpu", **model},
            "cache": {"tiers": {"device": {"size": 64}, "disk": {"path": str(tmp_path / "kv"), "size": "16MiB"}}}}


def test_auto_dtype_is_what_stats_and_metrics_report_and_what_the_cache_is_keyed_by(tmp_path, monkeypatch):
    """`auto` resolves before anything is hashed: an engine asked for float32 by name finds the
    blocks an `auto` engine (a CPU without AMX) wrote, and stats and /metrics say float32."""
    from kvstrata.engine.config import probes
    from kvstrata.engine.async_engine import EngineSnapshot
    from kvstrata.serving.metrics import ServingMetrics

    monkeypatch.setattr(probes, "cpu_has_amx", lambda: False)
    prompt = "The library opens at nine and closes at six. " * 8
    with LLM(load_config(tiny_dummy(tmp_path, dtype="auto", threads=1))) as auto:
        assert auto.generate(prompt, GREEDY)[0].cached_tokens == 0
        stats = auto.stats()
    assert (stats["dtype"], stats["device"], stats["threads"], stats["model"]) == ("float32", "cpu", 1, "tiny-llama")
    metrics = ServingMetrics(lambda: EngineSnapshot(stats=stats, num_running=0, num_waiting=0))
    backend = "cpu" if cpu_kernel_available() else "torch"  # auto's CPU attention: the compiled kernel where it builds
    invariant = str(resolve_batch_invariant("auto", backend)).lower()  # on with the compiled kernels on AVX2
    assert stats["batch_invariant"] is (invariant == "true")
    assert (f'kvstrata_engine_info{{attention_backend="{backend}",batch_invariant="{invariant}",device="cpu",'
            'dtype="float32",kv_cache_dtype="float32",model="tiny-llama",threads="1"} 1.0') in metrics.render().decode()
    with LLM(load_config(tiny_dummy(tmp_path, dtype="float32"))) as explicit:
        assert explicit.generate(prompt, GREEDY)[0].cached_tokens_by_tier["disk"] > 0
    with LLM(load_config(tiny_dummy(tmp_path, dtype="bfloat16"))) as other_dtype:
        assert other_dtype.generate(prompt, GREEDY)[0].cached_tokens == 0


def test_memory_gone_between_config_check_and_start_is_one_line_naming_the_tier(tmp_path, monkeypatch):
    from kvstrata.tiers.base import BlockLayout

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 68719476736 bytes.\n"
                           "Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(BlockLayout, "allocate", out_of_memory)
    with pytest.raises(ValueError) as info:
        LLM(load_config(tiny_dummy(tmp_path)))
    message = str(info.value)
    assert message.startswith("cache.tiers.device.size: cannot allocate 64 blocks of ") and "\n" not in message


def test_a_device_tier_smaller_than_the_context_is_said_at_start_and_longer_prompts_are_refused(tmp_path, caplog):
    """64 blocks of 16 tokens hold 1024 tokens of tiny-llama's 2048: the start says so in one line,
    with the size that would hold a full context; a prompt beyond the device is a clear error."""
    with caplog.at_level(logging.WARNING, logger="kvstrata"), LLM(load_config(tiny_dummy(tmp_path))) as llm:
        warnings = [r.getMessage() for r in caplog.records if "device tier holds" in r.getMessage()]
        assert warnings == [f"kvstrata: {llm.engine.device_capacity_warning}"]
        assert "holds 1024 tokens, less than the 2048-token context" in warnings[0] and "\n" not in warnings[0]
        assert "cache.tiers.device.size of at least" in warnings[0]
        with pytest.raises(ValueError, match="needs 65 blocks but the device tier holds 64"):
            llm.generate([list(range(1030))], GREEDY)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstrata"), \
            LLM(load_config(tiny_dummy(tmp_path, max_model_len=1024))) as fits:
        assert fits.engine.device_capacity_warning is None
    assert "device tier holds" not in caplog.text


def test_an_engines_long_lived_objects_are_left_out_of_full_garbage_collections_until_it_closes():
    """A full collection walked the model's modules, the tokenizer and the tiers (some 400,000 objects for the
    embedded model) and paused the step it fell in for up to 230 ms: frozen at start-up, they are not walked; the
    engine's close gives them back to the collector."""
    config = load_config({"model": {"name": "tiny-llama", "load_format": "dummy", "dtype": "float32",
                                    "device": "cpu"}, "cache": {"tiers": {"device": {"size": 64}}}})
    engine = LLMEngine(config)
    try:
        walked = gc.get_objects()
        assert gc.get_freeze_count() > 0
        assert not any(o is engine.hierarchy or o is engine.loaded.model for o in walked)
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0 and any(o is engine.hierarchy for o in gc.get_objects())
