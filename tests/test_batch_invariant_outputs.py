"""`model.batch_invariant: true`: caching, chunking and batching never change an output's bits.

Model-level checks on the embedded model: greedy tokens identical and first-token logits bitwise equal to an engine
with prefix caching off, with the prefix served from the device, CPU and disk tiers, the prompt prefilled in small
chunks, and requests batched together; on the compiled CPU kernels in bfloat16 (what `auto` runs on an AVX2 CPU) and
on the torch references in float32 (their fallback where no kernel can be built; their bfloat16 products are too
slow on a CPU without a fast bfloat16 kernel for the suite, and their row invariance is checked op by op above).
Plus the mode's edges: the config key, its hash namespace, and the Triton row kernels under the interpreter (conftest
sets TRITON_INTERPRET=1).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata import LLM, SamplingParams, load_config
from kvstrata.engine import llm_engine
from kvstrata.engine.config import ConfigError
from kvstrata.engine.hashing import make_namespace
from kvstrata.engine.model_loader import EMBEDDED_MODEL, load_model, resolve_model
from kvstrata.kernels import batch_invariant, cpu_features
from kvstrata.kernels.backends import cpu_kernel_available, resolve_batch_invariant
from kvstrata.kernels.batch_invariant import (LINEAR_BLOCK_M, linear, mean_last_dim, reference_linear,
                                              reference_mean_last_dim)

DOC = ("The harbour office opens at seven. Ferries to the north island leave every ninety minutes until dusk; the "
       "last boat back departs at eight. Bicycles travel free, cars need a booking, and dogs must stay on deck.")
QUESTIONS = ["When does the last boat come back?", "Do bicycles cost extra?"]
OTHER = "Write two lines about a lighthouse keeper who collects shells."


def test_batch_invariant_is_a_validated_model_key():
    assert load_config({"model": {"batch_invariant": True}}).model.batch_invariant is True
    assert load_config({"model": {"batch_invariant": False}}).model.batch_invariant is False
    assert load_config(None).model.batch_invariant == "auto"
    for bad in ("yes", "on", 1):
        with pytest.raises(ConfigError, match=r"^model\.batch_invariant: "):
            load_config({"model": {"batch_invariant": bad}})


@pytest.mark.parametrize("family", ["avx2", "avx512", "amx"])
def test_auto_turns_the_mode_on_only_where_it_was_measured_to_cost_at_most_1_1x(monkeypatch, family):
    """`auto`: on for the compiled CPU kernels on AVX2 (measured 0.89-1.06x the default there), off for the torch
    and Triton backends and for AVX-512 and AMX CPUs (not measured); true and false are what they say."""
    monkeypatch.setattr(cpu_features, "cpu_matrix_family", lambda: family)
    for backend in ("cpu", "torch", "triton"):
        assert resolve_batch_invariant("auto", backend) is (backend == "cpu" and family == "avx2")
        assert resolve_batch_invariant(True, backend) is True and resolve_batch_invariant(False, backend) is False


def test_batch_invariant_kv_get_their_own_namespace_and_the_default_keeps_the_old_one():
    args = ("smollm2@xxh3_128:00", "bfloat16", 16, 1, "xxh3_128")
    assert make_namespace(*args, batch_invariant=False) == make_namespace(*args)
    assert make_namespace(*args, batch_invariant=True) != make_namespace(*args)
    # each attention backend sums in its own order: in the invariant mode their blocks never mix (an engine whose
    # compiled CPU kernel could not be built runs the torch reference); the default mode names no backend
    by_backend = {b: make_namespace(*args, batch_invariant=True, attention=b) for b in ("cpu", "torch", "triton")}
    assert len(set(by_backend.values())) == 3
    assert make_namespace(*args, attention="cpu") == make_namespace(*args, attention="torch") == make_namespace(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_give_a_row_the_same_bits_whatever_the_number_of_rows(dtype):
    """Triton under the interpreter and the torch references. The interpreter's dot is numpy's matmul, whose bits
    depend on a row's place in the tile (on a GPU every element of an MMA takes the same path), so the Triton rows
    are compared at the same place: calls of different heights whose rows start at a multiple of the tile."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3 * LINEAR_BLOCK_M, 96, generator=gen).to(dtype)
    weight = (torch.randn(80, 96, generator=gen) / 10).to(dtype)
    bias = torch.randn(80, generator=gen).to(dtype)
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    for kernel in (linear, reference_linear):
        whole = kernel(x, weight, bias)
        torch.testing.assert_close(whole.double(), expected, atol=2e-2 if dtype == torch.bfloat16 else 1e-4,
                                   rtol=2e-2 if dtype == torch.bfloat16 else 1e-4)
        assert torch.equal(kernel(x[LINEAR_BLOCK_M:LINEAR_BLOCK_M + 5], weight, bias),
                           whole[LINEAR_BLOCK_M:LINEAR_BLOCK_M + 5])
    for start, rows in ((7, 1), (0, 3), (100, 60)):
        assert torch.equal(reference_linear(x[start:start + rows], weight, bias), reference_linear(x, weight, bias)
                           [start:start + rows])
    squares = x.float().pow(2)
    for kernel in (mean_last_dim, reference_mean_last_dim):
        whole = kernel(squares, keepdim=True)
        torch.testing.assert_close(whole, squares.mean(-1, keepdim=True))
        assert torch.equal(kernel(squares[9:10], keepdim=True), whole[9:10])
        assert torch.equal(kernel(squares[5:50]), whole[5:50, 0])


@pytest.mark.parametrize("isa", ["avx2", "avx512", "amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_tiles_chosen_for_each_cpu_give_a_row_the_same_bits_whatever_shares_the_call(monkeypatch, isa, dtype):
    """With detection patched to each CPU family, the torch linear uses that family's tile (the table's entry), and
    a row's bits do not change with the call's height or its place in it (the last tile padded or full)."""
    monkeypatch.setattr(batch_invariant, "cpu_matrix_isa", lambda: isa)
    tile = batch_invariant.linear_tile_rows(dtype)
    assert tile == batch_invariant.LINEAR_TILE_ROWS[(isa, dtype)]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2 * tile + 37, 64, generator=gen).to(dtype)
    weight = (torch.randn(48, 64, generator=gen) / 8).to(dtype)
    whole = reference_linear(x, weight)
    for start, rows in ((0, 1), (3, 1), (1, tile), (tile - 1, tile + 2), (5, x.shape[0] - 5)):
        assert torch.equal(reference_linear(x[start:start + rows], weight), whole[start:start + rows])


@pytest.mark.parametrize("library_keeps_rows_alike", [True, False])
def test_where_the_blas_keeps_rows_alike_a_product_is_padded_to_the_row_multiple_else_tiled(monkeypatch,
                                                                                            library_keeps_rows_alike):
    """AVX2 float32: one product with the rows padded to a multiple of 4, trusted only where this process's BLAS
    passed the check for the shape (else the family's tiles). The check's verdict is patched here to take each
    branch; invariance is asserted only where it holds whatever the CPU (the tiles) or where this CPU's library
    passed the real check."""
    monkeypatch.setattr(batch_invariant, "cpu_matrix_isa", lambda: "avx2")
    real_verdict = batch_invariant._library_keeps_rows_alike(64, 48, torch.float32, 4, True, torch.get_num_threads())
    monkeypatch.setattr(batch_invariant, "_library_keeps_rows_alike", lambda *args: library_keeps_rows_alike)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(45, 64, generator=gen)
    weight_in_out = (torch.randn(64, 48, generator=gen) / 8).contiguous()
    weight = weight_in_out.t()  # the engine's CPU layout: stored [in, out], seen as [out, in]
    for start, rows in ((0, 1), (3, 5), (8, 12), (2, 43)):
        got = reference_linear(x[start:start + rows], weight)
        if library_keeps_rows_alike:
            padded = torch.cat([x[start:start + rows], x.new_zeros(-rows % 4, 64)])
            assert torch.equal(got, (padded @ weight_in_out)[:rows])
        else:
            tile = batch_invariant.LINEAR_TILE_ROWS[("avx2", torch.float32)]
            assert torch.equal(got, reference_linear(x[start:start + rows], weight, tile_rows=tile))
    if library_keeps_rows_alike == real_verdict:
        whole = reference_linear(x, weight)
        for start, rows in ((0, 1), (3, 5), (8, 12), (2, 43)):
            assert torch.equal(reference_linear(x[start:start + rows], weight), whole[start:start + rows])


# ---------------------------------------------------------------------------------------------------------------
# Model level (short prompts, few tokens).

GREEDY = 4  # tokens per request

# (attention backend, dtype): the compiled kernels, and the torch references they fall back to
MODES = [pytest.param(("cpu", "bfloat16"), id="cpu-bfloat16"), pytest.param(("torch", "float32"), id="torch-float32")]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """On a busy 2-core machine, two OpenMP threads made these runs many times slower than one (their barriers spin
    against other processes). The bits do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=MODES)
def mode(request):
    backend, dtype = request.param
    if backend == "cpu" and not cpu_kernel_available():
        pytest.skip("no C compiler to build the CPU kernels")
    return backend, dtype


@pytest.fixture(scope="module")
def loaded(mode):
    return load_model(resolve_model(EMBEDDED_MODEL), getattr(torch, mode[1]), "cpu")


def config(tmp_path: Path, mode: tuple[str, str], caching: bool, batched_tokens: int = 2048) -> dict:
    backend, dtype = mode
    tiers = {"device": {"size": 24}, "cpu": {"size": 24}, "disk": {"path": str(tmp_path / "kv"), "size": "64MiB"}}
    return {"model": {"dtype": dtype, "device": "cpu", "attention_backend": backend, "batch_invariant": True},
            # always_load: a hit below the device is what these tests are about, however `auto` would price it
            # on a loaded machine (it recomputed a CPU hit once beside three other test processes)
            "cache": {"enable_prefix_caching": caching, "block_size": 16, "tiers": tiers, "load_policy": "always_load"},
            "scheduler": {"max_num_batched_tokens": batched_tokens, "max_num_seqs": 4}}


class FirstTokenLogits:
    """Runs `llm.chat` over several conversations at once and returns, per conversation, its greedy tokens, the
    logits its first token was sampled from, and its cached tokens by tier. Each conversation gets its own
    SamplingParams object, which is how its rows are told apart in the engine's `sample` calls."""

    def __init__(self, monkeypatch):
        self.first_rows: dict[int, torch.Tensor] = {}
        original = llm_engine.sample

        def recording_sample(logits, params, generators):
            for row, p in zip(logits, params):
                self.first_rows.setdefault(id(p), row.detach().clone())
            return original(logits, params, generators)

        monkeypatch.setattr(llm_engine, "sample", recording_sample)

    def run(self, llm: LLM, conversations) -> list[tuple[list[int], torch.Tensor, dict]]:
        params = [SamplingParams(max_tokens=GREEDY, temperature=0.0, ignore_eos=True) for _ in conversations]
        outs = llm.chat(conversations, params)
        return [(o.token_ids, self.first_rows.pop(id(p)), o.cached_tokens_by_tier) for o, p in zip(outs, params)]


def chat(question: str, doc: str = DOC) -> list[dict]:
    return [{"role": "user", "content": f"{doc}\n\n{question}"}]


@pytest.fixture(scope="module")
def uncached(mode, loaded, tmp_path_factory):
    """Each question alone, prefix caching off: the outputs every other run must reproduce bit for bit."""
    mp = pytest.MonkeyPatch()
    recorder = FirstTokenLogits(mp)
    with LLM(load_config(config(tmp_path_factory.mktemp("ref"), mode, caching=False)), loaded_model=loaded) as llm:
        results = {q: recorder.run(llm, [chat(q)])[0][:2] for q in QUESTIONS}
    mp.undo()
    return results


def assert_bitwise_as_uncached(uncached, question, result):
    tokens, logits, by_tier = result
    ref_tokens, ref_logits = uncached[question]
    assert tokens == ref_tokens, f"{question!r}: tokens differ with cache hits {by_tier}"
    assert torch.equal(logits, ref_logits), f"{question!r}: first-token logits differ with cache hits {by_tier}"


@pytest.mark.slow
def test_hits_from_every_tier_chunked_and_batched_give_the_uncached_bits(mode, loaded, uncached, tmp_path,
                                                                         monkeypatch):
    recorder = FirstTokenLogits(monkeypatch)
    # 24-token steps: every prompt is prefilled in several chunks, cut where the uncached run was not
    with LLM(load_config(config(tmp_path, mode, caching=True, batched_tokens=24)), loaded_model=loaded) as llm:
        assert llm.engine.attention_backend == mode[0]
        hierarchy = llm.engine.hierarchy
        first, second = QUESTIONS
        result = recorder.run(llm, [chat(first)])[0]
        assert sum(result[2].values()) == 0
        assert_bitwise_as_uncached(uncached, first, result)

        result = recorder.run(llm, [chat(second)])[0]  # the document's blocks from the device
        assert result[2]["device"] > 0
        assert_bitwise_as_uncached(uncached, second, result)

        assert hierarchy.clear_device_cache()
        result = recorder.run(llm, [chat(first)])[0]
        assert result[2]["cpu"] > 0 and result[2]["device"] == 0
        assert_bitwise_as_uncached(uncached, first, result)

        hierarchy.persist()
        hierarchy.cpu.clear()
        assert hierarchy.clear_device_cache()
        result = recorder.run(llm, [chat(second)])[0]
        assert result[2]["disk"] > 0, result[2]
        assert_bitwise_as_uncached(uncached, second, result)

        # batched: a new prompt's chunks share the steps with both questions' suffixes and decodes
        _, *questions = recorder.run(llm, [[{"role": "user", "content": OTHER}]] + [chat(q) for q in QUESTIONS])
        for question, result in zip(QUESTIONS, questions):
            assert sum(result[2].values()) > 0
            assert_bitwise_as_uncached(uncached, question, result)
