"""The Triton kernels, run through Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1): each must agree with
its torch reference and with dense float64 attention. Shapes stay small: the interpreter runs tiles in numpy.

In the interpreter, fp32 -> bf16 casts truncate where a GPU rounds to nearest, so bf16 outputs may sit one bf16 ulp
from the reference's; TOLERANCE covers that."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import TOLERANCE, check_prefill, make_paged_problem, naive_attention, random_batch

from kvstrata.kernels.backends import get_ops
from kvstrata.kernels.block_copy import (gather_blocks, reference_gather_blocks, reference_scatter_blocks,
                                         scatter_blocks)
from kvstrata.kernels.kv_store import reference_store_kv, store_kv
from kvstrata.kernels.prefix_prefill import prefix_prefill

# (context, new tokens): fresh prompts, chunked prefill over cached blocks, decode rows, block-aligned edges, and a
# first query at position 62 (the last key of a 64-key tile is then visible to it but not to the row after).
MIXED_BATCH = [(0, 7), (13, 1), (30, 5), (0, 1), (47, 17), (16, 16), (62, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_mixed_batch_with_gqa_matches_reference(dtype):
    problem = make_paged_problem(MIXED_BATCH, num_heads=9, num_kv_heads=3, head_dim=64, block_size=8, dtype=dtype)
    check_prefill(problem, dtype)


def test_prefill_over_many_key_tiles_writes_nothing_for_sequences_without_new_tokens():
    """At head_dim 128 a key tile holds 32 keys: the first sequence spans 4. The last sequence has no new tokens,
    so a program that wrote for it would write past the output, into check_prefill's guard rows."""
    problem = make_paged_problem([(100, 3), (5, 0), (0, 70), (30, 40), (9, 0)], num_heads=8, num_kv_heads=2,
                                 head_dim=128, block_size=16, dtype=torch.float32, seed=1)
    check_prefill(problem, torch.float32)


def test_decode_batch_with_large_blocks_matches_reference():
    problem = make_paged_problem([(90, 1), (0, 1), (63, 1), (64, 1), (5, 1)], num_heads=8, num_kv_heads=2,
                                 head_dim=64, block_size=64, dtype=torch.bfloat16, seed=2)
    check_prefill(problem, torch.bfloat16)


@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_random_batches_match_reference(seed):
    problem = make_paged_problem(random_batch(seed + 100), num_heads=9, num_kv_heads=3, head_dim=64,
                                 block_size=[16, 32][seed], dtype=torch.bfloat16, seed=seed)
    check_prefill(problem, torch.bfloat16)


def test_prefill_reads_strided_query_and_allocates_output():
    problem = make_paged_problem([(20, 9), (3, 1)], num_heads=4, num_kv_heads=4, head_dim=64, block_size=16,
                                 dtype=torch.float16, seed=3)
    fused_qkv = torch.zeros(problem.query.shape[0], 3 * 4, 64, dtype=torch.float16)
    fused_qkv[:, :4] = problem.query
    problem.query = fused_qkv[:, :4]  # a view into a fused projection, token stride 3x the heads
    out = prefix_prefill(*problem.args())
    torch.testing.assert_close(out.double(), naive_attention(problem), **TOLERANCE[torch.float16])


def test_prefill_rejects_mismatched_metadata():
    problem = make_paged_problem([(4, 4)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8,
                                 dtype=torch.float32)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        prefix_prefill(problem.query, problem.kv_cache, problem.layer, problem.block_tables,
                       problem.query_start_loc, problem.seq_lens.long(), problem.scale)
    with pytest.raises(ValueError, match="query_start_loc"):
        prefix_prefill(problem.query, problem.kv_cache, problem.layer, problem.block_tables,
                       problem.query_start_loc[:1], problem.seq_lens, problem.scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference_and_skips_padding(dtype):
    pool = torch.randn(7, 3, 2, 8, 3, 64).to(dtype)
    kv_cache = pool[1:6]  # blocks 0 and 6 of the pool guard the cache's ends
    before = pool.clone()
    expected = kv_cache.clone()
    slots = torch.tensor([9, -1, 0, 39, 17, -1, 8])
    fused = torch.randn(len(slots), 2, 3, 64).to(dtype)  # K and V as strided views of one tensor
    key, value = fused[:, 0], fused[:, 1]
    store_kv(key, value, kv_cache, 2, slots)
    reference_store_kv(key, value, expected, 2, slots)
    assert torch.equal(kv_cache, expected)
    # padding (slot -1) is written nowhere: neither inside the cache nor just before it
    assert torch.equal(pool[[0, 6]], before[[0, 6]])
    assert not torch.equal(kv_cache, before[1:6])  # the real slots were written


def test_gather_and_scatter_blocks_match_reference():
    kv_cache = torch.randn(9, 2, 2, 16, 3, 64, dtype=torch.bfloat16)
    block_ids = torch.tensor([7, 2, 5, 0])
    staged = torch.full((4, *kv_cache.shape[1:]), float("nan"), dtype=torch.bfloat16)
    gather_blocks(kv_cache, block_ids, staged)
    assert torch.equal(staged, reference_gather_blocks(kv_cache, block_ids, torch.empty_like(staged)))
    target, expected = torch.zeros_like(kv_cache), torch.zeros_like(kv_cache)
    destination = torch.tensor([1, 8, 3, 4])
    scatter_blocks(staged, target, destination)
    reference_scatter_blocks(staged, expected, destination)
    assert torch.equal(target, expected)


def test_triton_backend_serves_the_triton_kernels():
    ops = get_ops("triton")
    assert ops.name == "triton"
    assert (ops.store_kv, ops.prefix_prefill, ops.gather_blocks, ops.scatter_blocks) == (
        store_kv, prefix_prefill, gather_blocks, scatter_blocks)


def test_triton_kernels_refuse_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    problem = make_paged_problem([(4, 4)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8,
                                 dtype=torch.float32)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        prefix_prefill(*problem.args())
    with pytest.raises(ValueError, match="need CUDA tensors"):
        store_kv(problem.query[:, :1], problem.query[:, :1], problem.kv_cache, 0, torch.zeros(4, dtype=torch.long))
