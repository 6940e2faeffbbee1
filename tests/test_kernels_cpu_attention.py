"""The compiled CPU attention (kernels/cpu_attention.py, backend "cpu"): it must compute what the torch reference
does, give a row the same bits however its call is made up (whole, after a cached prefix, in chunks, batched, on
any number of threads), reject bad input with a ValueError, and fall back to the reference, saying so once, where
it cannot be built."""
from __future__ import annotations

import ctypes
import logging
import stat
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from kernel_cases import GUARD_ROWS, TOLERANCE, make_paged_problem, naive_attention, narrow_cache_problem, random_batch

from kvstrata import LLM, SamplingParams, load_config
from kvstrata.engine import llm_engine
from kvstrata.kernels import cpu_attention, cpu_build, cpu_features
from kvstrata.kernels.backends import cpu_kernel_available, get_ops, resolve_backend
from kvstrata.kernels.prefix_prefill import reference_prefix_prefill

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler to build the CPU kernel")

MIXED_BATCH = [(0, 7), (13, 1), (30, 5), (0, 1), (47, 17), (16, 16), (150, 3), (0, 90)]  # (context, new tokens)


@pytest.fixture(autouse=True)
def compiled_kernel_only(monkeypatch):
    """This file's checks are the compiled kernel's, bit for bit: on an AVX-512 or AMX CPU the default mode would
    send long prefills to ATen's flash attention, which the tests at the end cover with the CPU family patched."""
    monkeypatch.setattr(cpu_attention, "flash_here", lambda: False)


@pytest.fixture
def threads():
    """Set torch's thread count for one test (the kernel splits its work over that many), restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def run(problem, query=None, **kwargs) -> torch.Tensor:
    return cpu_attention.prefix_prefill(problem.query if query is None else query, *problem.args()[1:], **kwargs)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_dense_attention_and_the_reference(dtype, heads, num_threads, threads):
    """Prefill, decode rows and chunks after a context, shuffled block tables with NaN in every slot no sequence
    owns; the query a strided view as the decoder passes it; nothing written past the output's rows."""
    threads(num_threads)
    problem = make_paged_problem(MIXED_BATCH, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64,
                                 block_size=16, dtype=dtype, seed=len(heads) + heads[0])
    wide = torch.cat([problem.query, torch.randn_like(problem.query[:, :2])], dim=1)  # [T, heads + 2, dim]
    query = wide[:, :heads[0]]
    assert not query.is_contiguous()
    buffer = torch.full((query.shape[0] + GUARD_ROWS, *query.shape[1:]), float("nan"), dtype=dtype)
    out = buffer[:query.shape[0]]
    assert run(problem, query, out=out) is out
    torch.testing.assert_close(out.double(), naive_attention(problem), **TOLERANCE[dtype])
    reference = reference_prefix_prefill(*problem.args())
    torch.testing.assert_close(out.double(), reference.double(), atol=2 * TOLERANCE[dtype]["atol"],
                               rtol=2 * TOLERANCE[dtype]["rtol"])
    assert buffer[query.shape[0]:].isnan().all(), "wrote past its output rows"


@pytest.mark.parametrize("seed", range(3))
def test_matches_the_reference_on_random_batches_and_block_sizes(seed):
    problem = make_paged_problem(random_batch(seed, max_context=300), num_heads=6, num_kv_heads=2,
                                 head_dim=[64, 128, 32][seed], block_size=[8, 32, 64][seed], dtype=torch.float32,
                                 seed=seed)
    torch.testing.assert_close(run(problem).double(), naive_attention(problem), **TOLERANCE[torch.float32])


def test_a_bfloat16_cache_under_a_float32_model_is_read_as_its_values():
    """`cache.kv_cache_dtype` narrower than the model: the kernel converts each row on the fly."""
    problem = narrow_cache_problem(make_paged_problem(MIXED_BATCH, num_heads=9, num_kv_heads=3, head_dim=64,
                                                      block_size=16, dtype=torch.float32), torch.bfloat16)
    torch.testing.assert_close(run(problem).double(), naive_attention(problem), **TOLERANCE[torch.float32])


def sub_call(problem, rows: list[tuple[int, int, int]]):
    """A call over the same cache for some rows of the problem's sequences: (sequence, first new token, end) each,
    computed as new tokens [first, end) of a sequence whose length is then its context + end."""
    starts = problem.query_start_loc.tolist()
    contexts = [int(n) - (starts[s + 1] - starts[s]) for s, n in enumerate(problem.seq_lens.tolist())]
    query = torch.cat([problem.query[starts[s] + a:starts[s] + b] for s, a, b in rows])
    q_lens = torch.tensor([b - a for _, a, b in rows])
    query_start = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    seq_lens = torch.tensor([contexts[s] + b for s, _, b in rows])
    tables = problem.block_tables[[s for s, _, _ in rows]]
    out = cpu_attention.prefix_prefill(query, problem.kv_cache, problem.layer, tables, query_start, seq_lens,
                                       problem.scale)
    return torch.split(out, q_lens.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_whole_cached_chunked_batched_or_on_more_threads(dtype, threads):
    """The batch-invariance the mode relies on, by construction: sequence 0 (300 new tokens, several key tiles)
    computed whole, as decode rows, in chunks after a cached prefix, batched with other sequences in either
    order, and on 1, 2 and 3 threads: each row's output bit for bit the same."""
    threads(1)
    problem = make_paged_problem([(0, 300), (37, 40), (200, 1), (5, 130)], num_heads=9, num_kv_heads=3,
                                 head_dim=64, block_size=16, dtype=dtype, seed=5)
    (whole,) = sub_call(problem, [(0, 0, 300)])
    # (a question's rows after a cached prefix: up to SHORT_QUERY of them take one item for all their tokens and
    # heads, more take items of a few tokens and one head; both sides of that limit here)
    for a, b in ((0, 1), (63, 64), (64, 65), (299, 300), (0, 64), (1, 129), (100, 300), (130, 131), (10, 27),
                 (200, 264), (200, 265)):
        (part,) = sub_call(problem, [(0, a, b)])
        assert torch.equal(part, whole[a:b]), f"rows {a}..{b} alone differ from the whole prompt's"
    chunks = sub_call(problem, [(0, 0, 24)]) + sub_call(problem, [(0, 24, 100)]) + sub_call(problem, [(0, 100, 300)])
    assert torch.equal(torch.cat(chunks), whole)
    batched = sub_call(problem, [(1, 0, 40), (0, 150, 300), (2, 0, 1), (0, 0, 150), (3, 0, 130)])
    assert torch.equal(torch.cat([batched[3], batched[1]]), whole)
    full = run(problem)
    assert torch.equal(full[:300], whole)
    for num_threads in (2, 3):
        threads(num_threads)
        assert torch.equal(run(problem), full), f"{num_threads} threads changed the bits"


def test_other_cache_dtypes_take_the_reference_with_its_mode():
    """int8 rows (a scale per row) are not the kernel's: the torch reference computes them, in the mode asked."""
    problem = narrow_cache_problem(make_paged_problem([(20, 5), (0, 9)], num_heads=4, num_kv_heads=2, head_dim=64,
                                                      block_size=8, dtype=torch.float32), torch.int8)
    for invariant in (False, True):
        assert torch.equal(run(problem, batch_invariant=invariant),
                           reference_prefix_prefill(*problem.args(), batch_invariant=invariant))


def bad_inputs(problem):
    """(what is wrong, the call's arguments changed that way) for each kind of bad input."""
    q, cache, layer, tables, starts, lens, scale = problem.args()
    out_of_range = tables.clone()
    out_of_range[1, 0] = cache.shape[0]
    negative = tables.clone()
    negative[0, 1] = -1
    return {
        "block id past the cache": (q, cache, layer, out_of_range, starts, lens, scale),
        "negative block id": (q, cache, layer, negative, starts, lens, scale),
        "block table too short": (q, cache, layer, tables[:, :1], starts, lens, scale),
        "fewer block table rows": (q, cache, layer, tables[:1], starts, lens, scale),
        "float block table": (q, cache, layer, tables.float(), starts, lens, scale),
        "layer out of range": (q, cache, 2, tables, starts, lens, scale),
        "query_start_loc not ending at the tokens": (q[:-1], cache, layer, tables, starts, lens, scale),
        "more new tokens than the sequence": (q, cache, layer, tables, starts, lens - torch.tensor([0, 10]), scale),
        "decreasing query_start_loc": (q, cache, layer, tables, torch.tensor([0, 12, 10]), lens, scale),
        "cache rows of another head_dim": (q[..., :32], cache, layer, tables, starts, lens, scale),
        "2-D query": (q[:, 0], cache, layer, tables, starts, lens, scale),
        "heads not a multiple of the kv heads": (q[:, :3], cache, layer, tables, starts, lens, scale),
    }


@pytest.mark.parametrize("case", list(bad_inputs(make_paged_problem([(20, 5), (9, 5)], num_heads=4, num_kv_heads=2,
                                                                     head_dim=64, block_size=8,
                                                                     dtype=torch.float32))))
def test_bad_input_is_a_value_error(case):
    problem = make_paged_problem([(20, 5), (9, 5)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
                                 dtype=torch.float32)
    with pytest.raises(ValueError, match="^prefix_prefill: "):
        cpu_attention.prefix_prefill(*bad_inputs(problem)[case])




def test_without_a_compiler_it_says_so_once_and_runs_the_reference(rebuilt, monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "find_compiler", lambda: None)
    problem = make_paged_problem([(20, 5), (0, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
                                 dtype=torch.float32)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert torch.equal(run(problem), reference_prefix_prefill(*problem.args()))
        assert resolve_backend("auto", "cpu") == "torch"
        with pytest.raises(ValueError, match="^model.attention_backend: 'cpu' needs a C compiler"):
            resolve_backend("cpu", "cpu")
    assert [r.getMessage() for r in caplog.records] == [
        "kvstrata: no C compiler (cc or gcc) found; CPU attention runs the torch reference"]


def test_a_failing_build_says_so_once_and_runs_the_reference(rebuilt, monkeypatch, caplog, broken_compiler):
    problem = make_paged_problem([(3, 4)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8,
                                 dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(run(problem), reference_prefix_prefill(*problem.args()))
        assert not cpu_attention.available()
    (record,) = caplog.records
    assert "could not be built (broken-cc exited with 4: cc1: internal compiler error)" in record.getMessage()
    assert list(rebuilt.iterdir()) == [], "a failed build left a file behind"


def test_builds_running_at_once_each_load_a_whole_library(rebuilt):
    """Three builds start at once with an empty build dir (as parallel test workers or engines do): each compiles
    under a temporary name and renames it into place, so none loads a half-written file; one library is left,
    in a dir private to the user."""
    compiler, flags = cpu_build.find_compiler(), cpu_build.compile_flags()
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: cpu_build.build(cpu_attention.SOURCE, compiler, flags), range(3)))
    for path in paths:
        assert ctypes.CDLL(str(path)).kvs_prefix_prefill
    assert [f.suffix for f in rebuilt.iterdir()] == [".so"]
    assert stat.S_IMODE(rebuilt.stat().st_mode) == 0o700


def test_the_portable_build_for_cpus_without_avx2_computes_the_same_attention(rebuilt, monkeypatch, threads):
    """Where the CPU lacks AVX2 or FMA the kernel is built without them (plain C loops, the same formulas): it
    must be as right, and as invariant, as the vector build."""
    monkeypatch.setattr(cpu_features, "has_avx2_fma", lambda flags=None: False)
    assert "-mavx2" not in cpu_build.compile_flags()
    problem = make_paged_problem([(0, 70), (40, 1), (9, 33)], num_heads=9, num_kv_heads=3, head_dim=64,
                                 block_size=16, dtype=torch.bfloat16, seed=2)
    threads(1)
    whole = run(problem)
    torch.testing.assert_close(whole.double(), naive_attention(problem), **TOLERANCE[torch.bfloat16])
    (alone,) = sub_call(problem, [(0, 35, 70)])
    assert torch.equal(alone, whole[35:70])
    threads(2)
    assert torch.equal(run(problem), whole)
    assert [f.suffix for f in rebuilt.iterdir()] == [".so"]


def test_backends_auto_is_cpu_here_and_cpu_ops_are_the_torch_ops_but_attention():
    assert resolve_backend("auto", "cpu") == "cpu" and resolve_backend("cpu", torch.device("cpu")) == "cpu"
    assert resolve_backend("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="^model.attention_backend: 'cpu' runs on a CPU device, got 'cuda'"):
        resolve_backend("cpu", "cuda:0")
    torch_ops = get_ops("torch")
    for invariant in (False, True):
        ops, reference = get_ops("cpu", batch_invariant=invariant), get_ops("torch", batch_invariant=invariant)
        assert ops.name == "cpu" and ops.batch_invariant is invariant
        attention = getattr(ops.prefix_prefill, "func", ops.prefix_prefill)
        assert attention is cpu_attention.prefix_prefill
        assert ops.mean_last_dim == reference.mean_last_dim  # linear: test_kernels_cpu_linear.py; the layer ops:
        # test_kernels_cpu_layer_ops.py
    assert torch_ops.prefix_prefill is reference_prefix_prefill


DOC = ("The harbour office opens at seven. Ferries to the north island leave every ninety minutes until dusk; the "
       "last boat back departs at eight. Bicycles travel free, cars need a booking, and dogs must stay on deck.")


@pytest.mark.slow
def test_the_cpu_engine_uses_the_kernel_and_invariant_hits_give_the_uncached_bits(embedded_model_fp32, tmp_path,
                                                                                   monkeypatch):
    """The default CPU engine picks the kernel; in batch-invariant mode (compiled attention, products and layer
    ops, nothing intercepted) a device hit and a prompt prefilled in chunks give the uncached greedy tokens and
    first-token logits, bit for bit."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    chats = [[{"role": "user", "content": f"{DOC}\n\n{q}"}] for q in ("When is the last boat?", "Do dogs ride?")]
    first_logits = []
    sample = llm_engine.sample
    monkeypatch.setattr(llm_engine, "sample", lambda logits, *args: first_logits.append(logits.clone()) or
                        sample(logits, *args))

    def engine(caching: bool, batched_tokens: int = 2048) -> LLM:
        return LLM(load_config({"model": {"dtype": "float32", "device": "cpu", "batch_invariant": True},
                                "cache": {"enable_prefix_caching": caching, "block_size": 16,
                                          "tiers": {"device": {"size": 16}}},
                                "scheduler": {"max_num_batched_tokens": batched_tokens}}),
                   loaded_model=embedded_model_fp32)

    def answer(llm: LLM, chat) -> tuple:
        start = len(first_logits)
        out = llm.chat(chat, greedy)[0]
        return out, first_logits[start][0]

    with engine(caching=False) as llm:
        assert llm.engine.attention_backend == "cpu" and not llm.engine.runner.ops.intercept
        uncached = [answer(llm, c) for c in chats]
    with engine(caching=True, batched_tokens=20) as llm:
        first, second = answer(llm, chats[0]), answer(llm, chats[1])
    assert first[0].cached_tokens == 0 and second[0].cached_tokens > 0
    assert [first[0].token_ids, second[0].token_ids] == [out.token_ids for out, _ in uncached]
    assert torch.equal(first[1], uncached[0][1]) and torch.equal(second[1], uncached[1][1])


# ---------------------------------------------------------------------------------------------- ATen flash attention

FLASH_HERE = cpu_attention.flash_here.__wrapped__  # its answer asked afresh at every call
LONG_BATCH = [(0, 300), (37, 1), (200, 150), (5, 20), (0, 128), (130, 2)]  # (context, new tokens)


@pytest.fixture
def family(monkeypatch):
    """Set the CPU family the kernels see (kernels/cpu_features.py), the flash choice forgotten before and after."""
    monkeypatch.setattr(cpu_attention, "flash_here", FLASH_HERE)

    def set_family(name: str) -> None:
        monkeypatch.setattr(cpu_features, "cpu_matrix_family", lambda: name)
    return set_family


@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx512_and_amx_take_long_prefills_to_flash_attention_with_the_same_results(family, monkeypatch, dtype,
                                                                                     heads):
    """The default mode on AVX-512 and AMX CPUs: sequences of 128 new tokens or more (with or without a cached
    prefix, batched between short ones) by ATen's flash attention, the others by the compiled kernel, every row
    right and nothing written past the output."""
    problem = make_paged_problem(LONG_BATCH, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64, block_size=16,
                                 dtype=dtype, seed=heads[0])
    compiled = run(problem, batch_invariant=True)
    flashed = []
    original = cpu_attention.flash_prefix_prefill
    monkeypatch.setattr(cpu_attention, "flash_prefix_prefill",
                        lambda query, *args: flashed.append(query.shape[0]) or original(query, *args))
    for name in ("avx512", "amx"):
        family(name)
        flashed.clear()
        buffer = torch.full((problem.query.shape[0] + GUARD_ROWS, *problem.query.shape[1:]), float("nan"),
                            dtype=dtype)
        out = buffer[:problem.query.shape[0]]
        assert run(problem, out=out) is out
        assert flashed == [300, 150, 128], name
        torch.testing.assert_close(out.double(), naive_attention(problem), **TOLERANCE[dtype])
        assert buffer[problem.query.shape[0]:].isnan().all(), "wrote past its output rows"
        starts = problem.query_start_loc.tolist()
        for seq, (_, new) in enumerate(LONG_BATCH):  # the short sequences' rows are the compiled kernel's bits
            if new < cpu_attention.FLASH_MIN_NEW_TOKENS:
                assert torch.equal(out[starts[seq]:starts[seq + 1]], compiled[starts[seq]:starts[seq + 1]])
        assert torch.equal(run(problem, batch_invariant=True), compiled), "the invariant mode left its kernel"
    family("avx2")
    flashed.clear()
    assert torch.equal(run(problem), compiled) and flashed == []


def test_flash_attention_refuses_a_block_outside_the_cache(family):
    family("avx512")
    problem = make_paged_problem([(10, 200)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                                 dtype=torch.float32)
    for bad in (problem.kv_cache.shape[0], -1):
        tables = problem.block_tables.clone()
        tables[0, 3] = bad
        with pytest.raises(ValueError, match="outside the cache"):
            cpu_attention.prefix_prefill(problem.query, problem.kv_cache, problem.layer, tables,
                                         problem.query_start_loc, problem.seq_lens, problem.scale)
