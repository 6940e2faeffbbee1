"""Random paged-attention problems for the kernel tests, and a naive float64 dense attention to check them
against (small and obviously correct: one softmax per query over exactly the keys it may see)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvstrata.kernels.kv_store import dequantize_rows, quantize_rows
from kvstrata.kernels.prefix_prefill import prefix_prefill, reference_prefix_prefill

# Unused block-table entries: a block id far out of range, so a kernel that reads one fails or goes wrong.
UNUSED_BLOCK_ID = 1 << 20


@dataclass
class PagedProblem:
    query: torch.Tensor          # [T, num_heads, head_dim]
    kv_cache: torch.Tensor       # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer: int
    block_tables: torch.Tensor   # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor       # [B] int32
    keys: list[torch.Tensor]     # per sequence, the dense K written into the cache, [seq_len, kv_heads, head_dim]
    values: list[torch.Tensor]
    scale: float

    def args(self) -> tuple:
        return (self.query, self.kv_cache, self.layer, self.block_tables, self.query_start_loc, self.seq_lens,
                self.scale)

    def to(self, device: torch.device | str) -> PagedProblem:
        return dataclasses.replace(
            self, query=self.query.to(device), kv_cache=self.kv_cache.to(device),
            block_tables=self.block_tables.to(device), query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device), keys=[k.to(device) for k in self.keys],
            values=[v.to(device) for v in self.values])


def make_paged_problem(seqs: list[tuple[int, int]], *, num_heads: int, num_kv_heads: int, head_dim: int,
                       block_size: int, dtype: torch.dtype, num_layers: int = 2, layer: int = 1,
                       seed: int = 0) -> PagedProblem:
    """`seqs` lists (context_len, q_len) per sequence. Blocks are spread over a shuffled pool with spare blocks;
    every cache slot no sequence owns (other blocks, the tail of partial blocks) holds NaN, so reading one shows."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(ctx + q) // block_size) for ctx, q in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    kv_cache = torch.full((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), float("nan"),
                          dtype=dtype)
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(seqs), max(blocks_per_seq) + 1), UNUSED_BLOCK_ID, dtype=torch.int32)
    keys, values, queries = [], [], []
    for seq, ((ctx, q_len), n_blocks) in enumerate(zip(seqs, blocks_per_seq)):
        seq_len = ctx + q_len
        key = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        value = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        own, pool = pool[:n_blocks], pool[n_blocks:]
        block_tables[seq, :n_blocks] = torch.tensor(own, dtype=torch.int32)
        for j, block_id in enumerate(own):
            rows = slice(j * block_size, min((j + 1) * block_size, seq_len))
            n = rows.stop - rows.start
            kv_cache[block_id, layer, 0, :n] = key[rows]
            kv_cache[block_id, layer, 1, :n] = value[rows]
        keys.append(key)
        values.append(value)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
    q_lens = torch.tensor([q for _, q in seqs], dtype=torch.int32)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    seq_lens = torch.tensor([ctx + q for ctx, q in seqs], dtype=torch.int32)
    return PagedProblem(torch.cat(queries), kv_cache, layer, block_tables, query_start_loc, seq_lens, keys, values,
                        scale=head_dim ** -0.5)


def kept_in(t: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`t [..., head_dim]` as a cache of `cache_dtype` keeps it (int8: scaled rows, kernels/kv_format.py)."""
    return quantize_rows(t) if cache_dtype == torch.int8 else t.to(cache_dtype)


def held_in(t: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """The values of `t` a cache of `cache_dtype` gives back, in t's dtype."""
    kept = kept_in(t, cache_dtype)
    return (dequantize_rows(kept) if cache_dtype == torch.int8 else kept).to(t.dtype)


def narrow_cache_problem(problem: PagedProblem, cache_dtype: torch.dtype) -> PagedProblem:
    """The problem with its cache kept in `cache_dtype` (`cache.kv_cache_dtype`); the oracle attends to the values
    that cache holds."""
    return dataclasses.replace(problem, kv_cache=kept_in(problem.kv_cache, cache_dtype),
                               keys=[held_in(k, cache_dtype) for k in problem.keys],
                               values=[held_in(v, cache_dtype) for v in problem.values])


def random_batch(seed: int, max_seqs: int = 6, max_context: int = 80, max_new: int = 40) -> list[tuple[int, int]]:
    """A batch of (context, new tokens) of random sizes: prefill chunks, fresh prompts and decode rows mixed."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = int(torch.randint(1, max_seqs + 1, (1,), generator=gen))
    contexts = torch.randint(0, max_context, (num_seqs,), generator=gen).tolist()
    new_tokens = torch.randint(-max_new // 4, max_new, (num_seqs,), generator=gen).clamp(min=1).tolist()
    return list(zip(contexts, new_tokens))


def naive_attention(problem: PagedProblem) -> torch.Tensor:
    """Dense float64 causal attention over each sequence's own K/V, the oracle for every prefill kernel."""
    num_heads = problem.query.shape[1]
    outputs = []
    starts = problem.query_start_loc.tolist()
    for seq, (key, value) in enumerate(zip(problem.keys, problem.values)):
        q = problem.query[starts[seq]:starts[seq + 1]].double()
        seq_len, q_len = key.shape[0], q.shape[0]
        group = num_heads // key.shape[1]
        k = key.double().repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = value.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * problem.scale
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len, device=q.device)[None, :] > query_pos, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outputs)


# Tolerances against the float64 oracle: the result is rounded to `dtype` once (bf16 has 8 bits of mantissa).
TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


GUARD_ROWS = 3


def check_prefill(problem: PagedProblem, dtype: torch.dtype, **kwargs) -> None:
    """Run the Triton prefix-prefill (keyword options `kwargs`) into a NaN-poisoned output followed by guard rows:
    it must match dense float64 attention and the torch reference, fill every row and write nothing past them."""
    num_tokens = problem.query.shape[0]
    buffer = torch.full((num_tokens + GUARD_ROWS, *problem.query.shape[1:]), float("nan"), dtype=dtype,
                        device=problem.query.device)
    out = buffer[:num_tokens]
    assert prefix_prefill(*problem.args(), out=out, **kwargs) is out
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), naive_attention(problem), **tolerance)
    reference = reference_prefix_prefill(*problem.args())
    torch.testing.assert_close(out.double(), reference.double(), atol=2 * tolerance["atol"],
                               rtol=2 * tolerance["rtol"])
    assert buffer[num_tokens:].isnan().all(), "prefix_prefill wrote past its output rows"


# The GPU check's grid (tests/gpu_kernel_check.py): real models' head shapes, contexts to 8k, block size 16.
CUDA_HEAD_SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # (heads, kv heads, head dim)
CUDA_BATCHES = {  # (context, new tokens) per sequence
    "question-4k": [(4000, 16)],
    "question-7k": [(7087, 16)],
    "decode-8k": [(8191, 1)],
    "decode-batch": [(8000, 1), (17, 1), (4095, 1), (1, 1), (2047, 1), (600, 1), (7000, 1), (33, 1)],
    "mixed": [(7087, 16), (0, 300), (5, 0), (1200, 1), (64, 64)],
    "chunk-512": [(2048, 512)],
}
CUDA_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CUDA_SPLITS = {"auto": None, "single": 1, "split7": 7}  # the `num_splits` argument
# Shapes whose automatic choice splits on any GPU of 16 SMs or more: few query tiles over a long context.
CUDA_LONG_CONTEXT_BATCHES = ("question-4k", "question-7k", "decode-8k")


@dataclass(frozen=True)
class CudaCase:
    heads: str
    batch: str
    dtype: str
    splits: str

    @property
    def name(self) -> str:
        return f"{self.heads}-{self.batch}-{self.dtype}-{self.splits}"


CUDA_CASES = [CudaCase(heads, batch, dtype, splits) for heads in CUDA_HEAD_SHAPES for batch in CUDA_BATCHES
              for dtype in CUDA_DTYPES for splits in CUDA_SPLITS]

# A cache kept in fp8 or int8 (`cache.kv_cache_dtype`), compiled: stores and a prefill over it (gpu_kernel_check.py).
KV_DTYPE_CASES = {f"{what}-{name}": dtype for what in ("store", "prefill")
                  for name, dtype in (("fp8-e4m3", torch.float8_e4m3fn), ("fp8-e5m2", torch.float8_e5m2),
                                      ("int8", torch.int8))}

# The fused layer parts (kernels/layer_ops.py), compiled, on each model's widths: (hidden, intermediate) and the
# head shape; a decode row and a 512-token chunk; each dtype (gpu_kernel_check.py).
LAYER_WIDTHS = {"smollm2": (576, 1536), "llama3-8b": (4096, 14336)}
LAYER_OPS_CASES = [f"layer-ops-{model}-{dtype}-{tokens}" for model in LAYER_WIDTHS for dtype in CUDA_DTYPES
                   for tokens in (1, 512)]
