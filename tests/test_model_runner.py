"""The model on the paged KV cache gives the logits transformers gives on its own.

Model-level tests share one float32 CPU load of the embedded model (torch kernels); the reference is
the same files loaded into transformers' own model classes, run with its SDPA attention and no KV cache at all.
"""
import functools
import json
from dataclasses import dataclass

import pytest
import torch

from kvstrata.engine.checkpoint import CausalLM
from kvstrata.engine.model_loader import (EMBEDDED_MODEL, ModelSource, load_model, model_identity,
                                          resolve_model)
from kvstrata.engine.model_runner import ModelRunner, StepInput
from kvstrata.engine.model_spec import EMBEDDED_SHAPE
from kvstrata.kernels.backends import get_ops, resolve_backend
from kvstrata.tiers.base import BlockLayout

BLOCK_SIZE = 16
NUM_BLOCKS = 48
RTOL = 1e-4  # relative to the largest logit magnitude

PROMPT_A = ("The library opens at nine in the morning and closes at six in the evening. Members may borrow up "
            "to five books at a time for three weeks; reference works stay in the reading room. Late returns "
            "cost ten cents a day. The children's section hosts a story hour every Saturday, and the basement "
            "archive can be visited by appointment. Printing costs five cents a page and the wireless network is "
            "free for everyone. Question: until what time can I borrow a book on a weekday?")
PROMPT_B = "Write a haiku about the sea in autumn, then explain its imagery in one sentence."


@pytest.fixture(scope="session")
def loaded():
    return load_model(resolve_model(EMBEDDED_MODEL), torch.float32, "cpu")


@pytest.fixture(scope="session")
def ops():
    return get_ops(resolve_backend("torch", "cpu"))


@pytest.fixture
def runner(loaded, ops):
    cfg = loaded.model_config
    layout = BlockLayout(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    return ModelRunner(loaded, layout.allocate(NUM_BLOCKS, "cpu"), ops)


@pytest.fixture(scope="session")
def tokens(loaded):
    encode = loaded.tokenizer.encode
    return {"a": encode(PROMPT_A), "b": encode(PROMPT_B)}


@dataclass
class Chunk:
    """New tokens of one sequence in one step: `tokens` at positions `start ...`, KV in `block_table`."""

    tokens: list[int]
    start: int
    block_table: list[int]


def build_step(chunks: list[Chunk], want_logits: bool = True) -> StepInput:
    """Pack chunks into one step, asking for the logits of each chunk's last token (or of none)."""
    input_ids, positions, slots, query_start_loc, seq_lens, last_rows = [], [], [], [0], [], []
    for chunk in chunks:
        chunk_positions = list(range(chunk.start, chunk.start + len(chunk.tokens)))
        assert len(chunk.block_table) * BLOCK_SIZE >= chunk_positions[-1] + 1, "block table too short"
        input_ids += chunk.tokens
        positions += chunk_positions
        slots += [chunk.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in chunk_positions]
        query_start_loc.append(len(input_ids))
        seq_lens.append(chunk_positions[-1] + 1)
        last_rows.append(len(input_ids) - 1)
    width = max(len(c.block_table) for c in chunks)
    block_tables = [c.block_table + [0] * (width - len(c.block_table)) for c in chunks]
    return StepInput(input_ids, positions, slots, block_tables, query_start_loc, seq_lens,
                     last_rows if want_logits else [])


def blocks_for(num_tokens: int, first: int = 0) -> list[int]:
    return list(range(first, first + -(-num_tokens // BLOCK_SIZE)))


_reference_logits: dict[tuple[int, ...], torch.Tensor] = {}


@functools.lru_cache(maxsize=1)
def transformers_model() -> torch.nn.Module:
    """The same files loaded into transformers' own model classes."""
    return load_model(resolve_model(EMBEDDED_MODEL), torch.float32, "cpu", transformers_modules=True).model


def transformers_last_logits(token_ids: list[int]) -> torch.Tensor:
    """The reference: transformers' own forward with SDPA over the whole sequence, no paged cache
    (memoised: several tests compare against the same prompt)."""
    key = tuple(token_ids)
    if key not in _reference_logits:
        _reference_logits[key] = _transformers_forward(transformers_model(), token_ids)
    return _reference_logits[key]


def _transformers_forward(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0, -1].float()


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    assert err <= RTOL * scale, f"max |diff| {err:.3g} exceeds {RTOL} x max |logit| {scale:.3g}"


# -- model-level ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_prefill_logits_match_transformers(loaded, runner, tokens):
    prompt = tokens["a"]
    assert 80 <= len(prompt) <= 128
    logits = runner.execute(build_step([Chunk(prompt, 0, blocks_for(len(prompt)))]))
    assert logits.shape == (1, loaded.model_config.vocab_size) and logits.dtype == torch.float32
    assert_logits_close(logits[0], transformers_last_logits(prompt))


@pytest.mark.slow
def test_chunked_prefill_matches_one_shot(loaded, ops, runner, tokens):
    prompt = tokens["a"]
    table = blocks_for(len(prompt))
    one_shot = runner.execute(build_step([Chunk(prompt, 0, table)]))[0]

    cfg = loaded.model_config
    fresh_cache = BlockLayout(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    chunked_runner = ModelRunner(loaded, fresh_cache.allocate(NUM_BLOCKS, "cpu"), ops)
    split = 37  # mid-block: the second chunk starts inside a partly written block
    first = chunked_runner.execute(build_step([Chunk(prompt[:split], 0, table)], want_logits=False))
    assert first.shape == (0, cfg.vocab_size)  # a chunk short of the prompt's end samples nothing
    chunked = chunked_runner.execute(build_step([Chunk(prompt[split:], split, table)]))[0]
    assert_logits_close(chunked, one_shot)


@pytest.mark.slow
def test_decode_step_matches_transformers_on_the_extended_sequence(loaded, runner, tokens):
    prompt = tokens["a"]
    table = blocks_for(len(prompt) + 2)
    next_token = runner.execute(build_step([Chunk(prompt, 0, table)]))[0].argmax().item()
    logits = runner.execute(build_step([Chunk([next_token], len(prompt), table)]))[0]
    assert_logits_close(logits, transformers_last_logits(prompt + [next_token]))


@pytest.mark.slow
def test_packed_sequences_match_each_alone(loaded, runner, tokens):
    a, b = tokens["a"], tokens["b"]
    table_a, table_b = blocks_for(len(a) + 1), blocks_for(len(b) + 1, first=20)
    packed = runner.execute(build_step([Chunk(a, 0, table_a), Chunk(b, 0, table_b)]))
    assert_logits_close(packed[0], transformers_last_logits(a))
    assert_logits_close(packed[1], transformers_last_logits(b))

    # then one decode step for both, packed again: each still reads only its own blocks
    next_a, next_b = packed.argmax(-1).tolist()
    decoded = runner.execute(build_step([Chunk([next_a], len(a), table_a), Chunk([next_b], len(b), table_b)]))
    assert_logits_close(decoded[1], transformers_last_logits(b + [next_b]))
    assert_logits_close(decoded[0], transformers_last_logits(a + [next_a]))


@pytest.mark.slow
def test_shuffled_non_contiguous_blocks_give_the_same_logits(loaded, runner, tokens):
    prompt = tokens["a"]
    generator = torch.Generator().manual_seed(0)
    table = torch.randperm(NUM_BLOCKS, generator=generator)[: len(blocks_for(len(prompt)))].tolist()
    assert table != sorted(table)
    logits = runner.execute(build_step([Chunk(prompt, 0, table)]))[0]
    assert_logits_close(logits, transformers_last_logits(prompt))


@pytest.mark.slow
def test_triton_kernels_through_the_whole_model_match_transformers(loaded, tokens):
    """The Triton backend (run by its interpreter here: small shapes) in every layer, on a chunked
    prefill over out-of-order blocks."""
    cfg = loaded.model_config
    layout = BlockLayout(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    triton_runner = ModelRunner(loaded, layout.allocate(4, "cpu"), get_ops(resolve_backend("triton", "cpu")))
    prompt, table = tokens["b"], [3, 1]
    assert len(prompt) <= len(table) * BLOCK_SIZE
    triton_runner.execute(build_step([Chunk(prompt[:9], 0, table)], want_logits=False))
    logits = triton_runner.execute(build_step([Chunk(prompt[9:], 9, table)]))[0]
    assert_logits_close(logits, transformers_last_logits(prompt))


@pytest.mark.slow
def test_loaded_model_summary(loaded):
    cfg = loaded.model_config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.max_model_len == 8192
    # config validation sizes tiers from the shape it knows without loading: the same as loaded
    shape = EMBEDDED_SHAPE
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.vocab_size,
            shape.max_model_len) == (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size,
                                     cfg.max_model_len)
    assert loaded.tokenizer.convert_tokens_to_ids("<|im_end|>") in cfg.eos_token_ids
    assert not loaded.model.training and not any(p.requires_grad for p in loaded.model.parameters())
    # the GGUF is dequantised into plain weights of the asked dtype (no packed-weight modules), read without
    # transformers' model classes from the converted copy
    assert isinstance(loaded.model, CausalLM)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}


@pytest.mark.slow
def test_model_identity_is_the_same_when_recomputed(loaded, tmp_path, monkeypatch):
    """Identity names the weights file only (it takes no dtype: the hash namespace adds dtype
    itself): digesting the file again from scratch (an empty digest cache) gives the same string."""
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path))
    again = model_identity(resolve_model(EMBEDDED_MODEL))
    assert again == loaded.model_config.identity
    assert again.startswith(f"{EMBEDDED_MODEL}@xxh3_128:")


# -- fast: resolving names and identities ----------------------------------------------------------


def test_unknown_model_name_is_a_value_error_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="model.name"):
        resolve_model("meta-llama/Llama-3-8B")
    with pytest.raises(ValueError, match="model.name"):
        resolve_model(str(tmp_path))  # a directory without config.json


def test_embedded_model_resolves_to_the_packaged_gguf():
    source = resolve_model(EMBEDDED_MODEL)
    assert source.gguf_file and (source.directory / source.gguf_file).is_file()
    assert source.display_name == EMBEDDED_MODEL


def test_local_directory_resolves_to_itself(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    source = resolve_model(str(tmp_path))
    assert source == ModelSource(tmp_path.resolve(), None, tmp_path.name)
