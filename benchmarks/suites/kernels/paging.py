"""Cost of paging, and what split-KV buys: our prefix-prefill on the paged KV cache against SDPA on the same problem
laid out contiguously, and the Triton kernel with split-KV against itself without.

A problem is one layer of one batch: `num_seqs` sequences, each with `context` cached tokens and `new` new tokens,
their K/V spread over shuffled cache blocks (block size 16). The baseline gets the same K/V already contiguous as
`[num_seqs, kv_heads, context + new, head_dim]`, the same queries and the same causal mask (the new tokens sit at
the end, so the mask is aligned bottom-right), and so pays neither the block-table gather nor GQA broadcasting.
Figures are reported as ratios `ours / SDPA` (1.0 = paging costs nothing).

- On CUDA: the Triton kernel (`prefix_prefill`) against `F.scaled_dot_product_attention`, timed with
  `triton.testing.do_bench` (median), for SmolLM2-135M (9/3 heads, d64) and Llama-3-8B (32/8 heads, d128) shapes:
  8k context + 512 new tokens, and a decode batch (32 sequences x 1 token over 8k). Then split-KV on the shape of
  a question over a cached document (one sequence, 4k and 7k cached tokens, 16 new tokens or 1): the kernel with
  its automatic choice of splits, the same kernel forced to a single pass (`num_splits=1`), and SDPA.
- On a CPU: the compiled CPU kernel (`kernels/cpu_attention.py`, the CPU engine path where it builds) and the
  torch reference (`reference_prefix_prefill`) against SDPA, at a smaller size and on the question shapes, one
  thread, best of `--repeats` by process CPU time (a busy machine's other processes do not count). The Triton
  figures need a GPU.

Every timed function is first checked to give the baseline's output on the very problem it is timed on.

    python benchmarks/kernels.py paging                 # prints markdown tables
    python benchmarks/kernels.py paging --out benchmarks/results/paging.md   # writes them too (figures: paging.json)
    python benchmarks/kernels.py paging --baseline-kernel ../old/kernels/cpu_attention.c   # CPU: another checkout's kernel beside this one
    python benchmarks/kernels.py paging --baseline-kernel ../old/kernels/cpu_attention.c --bits 500   # its bits, instead

`--bits N` times nothing: it compares the two kernels' outputs bit for bit on N random calls (cache and query dtypes,
GQA groups, head_dim, block sizes, batches of short and long queries, 1 and 2 threads), each built twice, with AVX2
and FMA where this CPU has them and portable, and stops at the first difference.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[3]

from benchmarks.lib.cpu_timing import best_cpu_times  # noqa: E402
from benchmarks.lib.kernel_builds import wrapper_over  # noqa: E402
from benchmarks.lib.machine import machine_line  # noqa: E402
from kvstrata.kernels import cpu_attention, cpu_build  # noqa: E402
from kvstrata.kernels.prefix_prefill import (choose_num_splits, prefix_prefill, reference_prefix_prefill,  # noqa: E402
                                             sm_count)
from benchmarks.lib import options, results  # noqa: E402

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    model: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Case:
    shape: Shape
    num_seqs: int
    context: int
    new: int

    def describe(self) -> str:
        kind = "decode" if self.new == 1 else "prefill"
        return f"{self.shape.model} {kind}: {self.num_seqs} x ({self.context} cached + {self.new} new)"


SMOLLM2 = Shape("SmolLM2-135M", 9, 3, 64)
LLAMA_8B = Shape("Llama-3-8B", 32, 8, 128)
# A question over a cached document: the shape split-KV is for (few query tiles, a long context).
QUESTION_CASES = [Case(shape, 1, context, new) for shape in (SMOLLM2, LLAMA_8B) for context in (4096, 7087)
                  for new in (16, 1)]
# On CUDA: a long prefill over a long context, and a decode batch over long contexts.
CUDA_CASES = [Case(SMOLLM2, 1, 8192, 512), Case(LLAMA_8B, 1, 8192, 512),
              Case(SMOLLM2, 32, 8192, 1), Case(LLAMA_8B, 32, 8192, 1)]
CUDA_DTYPES = [torch.bfloat16, torch.float16]


@dataclass
class Problem:
    paged_args: tuple            # the arguments of prefix_prefill, minus `scale`
    query_dense: torch.Tensor    # [num_seqs, heads, new, head_dim]
    key_dense: torch.Tensor      # [num_seqs, kv_heads, context + new, head_dim]
    value_dense: torch.Tensor
    mask: torch.Tensor | None    # [new, context + new] bool; None for decode and for prompts with no context
    is_causal: bool              # no context: SDPA's own causal mask is the right one
    scale: float


def make_problem(case: Case, dtype: torch.dtype, device: torch.device) -> Problem:
    shape, seq_len = case.shape, case.context + case.new
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = case.num_seqs * blocks_per_seq
    kv_cache = torch.zeros(num_blocks, 1, 2, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim, dtype=dtype,
                           device=device)
    key = torch.randn(case.num_seqs, seq_len, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device)
    value = torch.randn_like(key)
    block_tables = torch.randperm(num_blocks, device=device).view(case.num_seqs, blocks_per_seq).int()
    pad = blocks_per_seq * BLOCK_SIZE - seq_len
    for seq in range(case.num_seqs):
        table = block_tables[seq].long()
        kv_cache[table, 0, 0] = F.pad(key[seq], (0, 0, 0, 0, 0, pad)).view(blocks_per_seq, BLOCK_SIZE,
                                                                             *key.shape[2:])
        kv_cache[table, 0, 1] = F.pad(value[seq], (0, 0, 0, 0, 0, pad)).view(blocks_per_seq, BLOCK_SIZE,
                                                                               *key.shape[2:])
    query = torch.randn(case.num_seqs * case.new, shape.num_heads, shape.head_dim, dtype=dtype, device=device)
    query_start_loc = torch.arange(0, case.num_seqs + 1, device=device, dtype=torch.int32) * case.new
    seq_lens = torch.full((case.num_seqs,), seq_len, device=device, dtype=torch.int32)
    mask = None
    if case.new > 1 and case.context > 0:
        mask = torch.arange(seq_len, device=device)[None, :] <= torch.arange(case.context, seq_len,
                                                                              device=device)[:, None]
    return Problem(
        paged_args=(query, kv_cache, 0, block_tables, query_start_loc, seq_lens),
        query_dense=query.view(case.num_seqs, case.new, *query.shape[1:]).transpose(1, 2).contiguous(),
        key_dense=key.transpose(1, 2).contiguous(), value_dense=value.transpose(1, 2).contiguous(),
        mask=mask, is_causal=case.context == 0 and case.new > 1, scale=shape.head_dim ** -0.5)


def sdpa_baseline(problem: Problem) -> Callable[[], torch.Tensor]:
    """SDPA on the contiguous problem. KV heads are broadcast to the query heads beforehand (not timed), since
    the CUDA flash/efficient backends take equal head counts."""
    group = problem.query_dense.shape[1] // problem.key_dense.shape[1]
    key = problem.key_dense.repeat_interleave(group, dim=1)
    value = problem.value_dense.repeat_interleave(group, dim=1)
    return lambda: F.scaled_dot_product_attention(problem.query_dense, key, value, attn_mask=problem.mask,
                                                  is_causal=problem.is_causal, scale=problem.scale)


def check_agreement(problem: Problem, ours: Callable[..., torch.Tensor]) -> None:
    """Time nothing that computes something else: ours must match the baseline on this very problem."""
    paged = ours(*problem.paged_args, problem.scale)
    dense = sdpa_baseline(problem)()  # [num_seqs, heads, new, head_dim]
    torch.testing.assert_close(paged.float(), dense.transpose(1, 2).reshape(paged.shape).float(),
                               atol=3e-2, rtol=3e-2)


def time_cpu(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each side's best of `repeats` calls, in seconds of this process's CPU time (one thread), in turn."""
    return best_cpu_times(fns, repeats)


def time_cuda(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    import triton.testing

    return {side: triton.testing.do_bench(fn, warmup=25, rep=max(100, 20 * repeats), return_mode="median") / 1e3
            for side, fn in fns.items()}


def chosen_splits(case: Case, problem: Problem) -> int:
    """The number of splits `prefix_prefill` chooses for this problem on its device."""
    query, _, _, block_tables, _, _ = problem.paged_args
    return choose_num_splits(query.shape[0], case.num_seqs, case.shape.num_heads, case.shape.num_kv_heads,
                             block_tables.shape[1] * BLOCK_SIZE, sm_count(query.device))


SDPA = "SDPA contiguous"


def timing_table(cases: list[Case], dtypes: list[torch.dtype], kernels: dict[str, Callable[..., torch.Tensor]],
                 ratios: list[tuple[str, str, str]], timer, repeats: int, device: torch.device,
                 splits_column: bool = False, figures: list[dict] | None = None) -> list[str]:
    """One markdown row per case and dtype: the time of each of `kernels` (paged arguments, then scale) and
    of SDPA on the contiguous problem, then each ratio (label, numerator, denominator) of those times; with
    `splits_column`, the number of splits the Triton kernel chooses there. Each line is printed as it is
    measured; the table's lines are returned, and each row's seconds a call per side appended to `figures`."""
    header = ["case", "dtype", *(["splits"] if splits_column else []), *(f"{name} (ms)" for name in [*kernels, SDPA]),
              *(label for label, _, _ in ratios)]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    print("\n".join(lines), flush=True)
    for case in cases:
        for dtype in dtypes:
            problem = make_problem(case, dtype, device)
            for kernel in kernels.values():
                check_agreement(problem, kernel)
            seconds = timer({**{name: functools.partial(kernel, *problem.paged_args, problem.scale)
                                for name, kernel in kernels.items()}, SDPA: sdpa_baseline(problem)}, repeats)
            cells = [case.describe(), str(dtype).removeprefix("torch."),
                     *([str(chosen_splits(case, problem))] if splits_column else []),
                     *(f"{seconds[name] * 1e3:.3f}" for name in [*kernels, SDPA]),
                     *(f"{seconds[a] / seconds[b]:.2f}" for _, a, b in ratios)]
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
            if figures is not None:
                figures.append({"case": case.describe(), "dtype": cells[1], "seconds_per_call": seconds})
            del problem
            free_cached_memory(device)
    return lines


def paging_table(cases: list[Case], dtypes: list[torch.dtype], ours: Callable[..., torch.Tensor], timer,
                 repeats: int, device: torch.device, figures: list[dict] | None = None) -> list[str]:
    """The cost of paging: `ours` on the paged problem against SDPA on the contiguous one."""
    return timing_table(cases, dtypes, {"ours": ours}, [("ours / SDPA", "ours", SDPA)], timer, repeats, device,
                        figures=figures)


def split_kv_table(cases: list[Case], dtypes: list[torch.dtype], timer, repeats: int,
                   device: torch.device, figures: list[dict] | None = None) -> list[str]:
    """What split-KV buys: the Triton kernel with its choice of splits against itself in one pass, and SDPA."""
    return timing_table(cases, dtypes,
                        {"split-KV": prefix_prefill, "single pass": functools.partial(prefix_prefill, num_splits=1)},
                        [("single pass / split-KV", "single pass", "split-KV"), ("split-KV / SDPA", "split-KV", SDPA)],
                        timer, repeats, device, splits_column=True, figures=figures)


# The compiled kernel alone: in the default mode an AVX-512 or AMX CPU sends long prefills to ATen's flash attention
# (kernels/cpu_attention.py `FLASH_FAMILIES`); the invariant mode's calls are always the kernel's.
compiled_kernel = functools.partial(cpu_attention.prefix_prefill, batch_invariant=True)


def kernel_built_from(source: Path, flags: tuple[str, ...] | None = None) -> Callable[..., torch.Tensor]:
    """The compiled kernel (`compiled_kernel`) built from `source` (the same interface) with `flags`."""
    return wrapper_over(cpu_attention, compiled_kernel, source, cpu_attention.declare, flags)


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def random_call(rng: random.Random) -> tuple[tuple, int]:
    """A random call of prefix_prefill (its arguments, and a thread count): 1-4 sequences of decode rows, short
    queries (up to 16 new tokens, the kernel's SHORT_QUERY) and long ones after 0-200 cached tokens; GQA groups 1-64;
    head_dim a multiple of 8 up to 512; cache and query of any of the three dtypes, unused cache slots NaN; queries
    scaled up to 30x, so that scores spread far (softmax weights underflowing to zero)."""
    kv_heads, group = rng.choice([1, 2, 3, 4]), rng.choice([1, 1, 2, 3, 3, 4, 5, 7, 8, 16, 64])
    head_dim = rng.choice([64, 64, 128, 8 * rng.randint(1, 64)])
    block_size = rng.choice([1, 3, 8, 16, 16, 32])
    seqs = [(rng.choice([0, rng.randint(1, 200)]), rng.choice([1, rng.randint(2, 16), rng.randint(17, 70)]))
            for _ in range(rng.randint(1, 4))]
    cache_dtype, query_dtype = rng.choice(DTYPES), rng.choice(DTYPES)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    blocks = [-(-(ctx + new) // block_size) for ctx, new in seqs]
    kv_cache = torch.full((sum(blocks) + 2, 2, 2, block_size, kv_heads, head_dim), float("nan"), dtype=cache_dtype)
    pool = torch.randperm(kv_cache.shape[0], generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(blocks), dtype=rng.choice([torch.int32, torch.int64]))
    for seq, ((ctx, new), n) in enumerate(zip(seqs, blocks)):
        own, pool = pool[:n], pool[n:]
        tables[seq, :n] = torch.tensor(own)
        kv = torch.randn(2, n * block_size, kv_heads, head_dim, generator=gen)[:, :ctx + new]
        for j, block in enumerate(own):
            rows = kv[:, j * block_size:(j + 1) * block_size]
            kv_cache[block, 1, :, :rows.shape[1]] = rows.to(cache_dtype)
    tokens = sum(new for _, new in seqs)
    scale = rng.choice([1.0, 1.0, 4.0, 30.0])
    wide = (torch.randn(tokens, kv_heads * group + 1, head_dim, generator=gen) * scale).to(query_dtype)
    query = wide[:, :kv_heads * group]   # a strided view, as the decoder passes it
    starts = torch.tensor([0] + [new for _, new in seqs]).cumsum(0)
    lens = torch.tensor([ctx + new for ctx, new in seqs])
    return (query, kv_cache, 1, tables, starts, lens, head_dim ** -0.5), rng.choice([1, 2])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN included)."""
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


def compare_bits(baseline: Path, calls: int, seed: int = 0) -> bool:
    """This tree's kernel against `baseline`'s on `calls` random calls, each build pair (this CPU's flags, and
    portable where those add AVX2) compared bit for bit; prints what it compared, and the first difference."""
    builds = {"this CPU's flags": cpu_build.compile_flags()}
    if builds["this CPU's flags"] != cpu_build.BASE_FLAGS:
        builds["portable"] = cpu_build.BASE_FLAGS
    pairs = {name: (kernel_built_from(cpu_attention.SOURCE, flags), kernel_built_from(baseline, flags))
             for name, flags in builds.items()}
    rng, threads = random.Random(seed), torch.get_num_threads()
    try:
        for i in range(calls):
            args, num_threads = random_call(rng)
            torch.set_num_threads(num_threads)
            for name, (ours, theirs) in pairs.items():
                if not same_bits(ours(*args), theirs(*args)):
                    query, cache, _, tables, starts, lens, _ = args
                    print(f"call {i} ({name}): bits differ; query {tuple(query.shape)} {query.dtype}, cache "
                          f"{tuple(cache.shape)} {cache.dtype}, query_start_loc {starts.tolist()}, seq_lens "
                          f"{lens.tolist()}, {num_threads} threads")
                    return False
    finally:
        torch.set_num_threads(threads)
    print(f"{calls} random calls (seed {seed}), builds: {', '.join(builds)}: every output bit equal to {baseline}'s")
    return True


def free_cached_memory(device: torch.device) -> None:
    """Hand the last problem's memory back, so that the next (larger) one fits."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int | None:
    parser = options.parser(__doc__)
    options.repeats(parser, 5)
    options.device(parser, "cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--baseline-kernel", type=Path,
                        help="CPU: another cpu_attention.c (e.g. from a checkout of an earlier commit) "
                             "timed beside this tree's kernel instead of the torch reference")
    parser.add_argument("--bits", type=int, metavar="N",
                        help="CPU, with --baseline-kernel: compare the two kernels' outputs bit for bit on N random "
                             "calls instead of timing")
    options.seed(parser, help="--bits: the random calls' seed")
    options.quick(parser, help="one small case in float32: every kernel checked against SDPA, timings not worth "
                               "keeping")
    options.out(parser, help="also write the tables here (markdown), every figure in the JSON beside it")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if args.bits is not None:
        if on_cuda or not args.baseline_kernel or not cpu_attention.available():
            parser.error("--bits compares the compiled CPU kernel with --baseline-kernel's, on a CPU with a compiler")
        return 0 if compare_bits(args.baseline_kernel, args.bits, args.seed) else 1
    if on_cuda:
        cases, dtypes, ours, timer, name = CUDA_CASES, CUDA_DTYPES, prefix_prefill, time_cuda, "Triton prefix_prefill"
        machine = f"{machine_line()}; {sm_count(device)} SMs"
    else:
        torch.set_num_threads(1)
        # (48 cached + 2000 new): a shared system prompt cached before a new document, the common miss
        cases = [Case(SMOLLM2, 1, 2048, 512), Case(SMOLLM2, 1, 0, 512), Case(SMOLLM2, 1, 48, 2000),
                 Case(SMOLLM2, 16, 2048, 1), Case(SMOLLM2, 1, 2048, 1), Case(SMOLLM2, 1, 2048, 10),
                 Case(SMOLLM2, 1, 2048, 24), Case(SMOLLM2, 1, 2048, 48), *QUESTION_CASES]
        dtypes, ours, timer, name = [torch.float32, torch.bfloat16], reference_prefix_prefill, time_cpu, \
            "torch reference_prefix_prefill"
        machine = machine_line()
        if cpu_attention.available():
            ours, name = compiled_kernel, "the compiled CPU kernel, beside the torch reference"
    if args.quick:
        cases, dtypes = [Case(SMOLLM2, 2, 64, 16)], [torch.float32]
    head = [f"machine: {machine}; ours = {name}; block size {BLOCK_SIZE}",
            *([] if on_cuda else ["(CPU run: the Triton kernel's figures, split-KV among them, need a GPU)"]), ""]
    print("\n".join(head))
    figures: list[dict] = []
    if ours is compiled_kernel and args.baseline_kernel:
        table = timing_table(cases, dtypes, {"cpu kernel": ours,
                                             "baseline kernel": kernel_built_from(args.baseline_kernel)},
                             [("baseline / kernel", "baseline kernel", "cpu kernel"),
                              ("kernel / SDPA", "cpu kernel", SDPA)], timer, args.repeats, device, figures=figures)
    elif ours is compiled_kernel:
        table = timing_table(cases, dtypes, {"cpu kernel": ours, "torch reference": reference_prefix_prefill},
                             [("reference / kernel", "torch reference", "cpu kernel"),
                              ("kernel / SDPA", "cpu kernel", SDPA)], timer, args.repeats, device, figures=figures)
    else:
        table = paging_table(cases, dtypes, ours, timer, args.repeats, device, figures=figures)
    split: list[str] = []
    split_figures: list[dict] = []
    if on_cuda:
        split = ["", "Split-KV: a question over a cached document", ""]
        print("\n".join(split))
        split += split_kv_table(cases if args.quick else QUESTION_CASES, [torch.bfloat16], timer, args.repeats,
                                device, figures=split_figures)
    if args.out:
        out = Path(args.out)
        report = ["# Cost of paging: the paged prefix-prefill against SDPA on the contiguous problem", "", *head,
                  *table, *split]
        results.write(out.parent, results.record(out.stem, repeats=args.repeats, device=args.device,
                                                 baseline_kernel=args.baseline_kernel, timings=figures,
                                                 split_kv=split_figures),
                      report, out.stem)
