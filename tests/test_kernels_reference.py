"""The torch references are the CPU engine path: each must equal an obviously correct computation."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kernel_cases import TOLERANCE, make_paged_problem, naive_attention, random_batch

from kvstrata.kernels.backends import cpu_kernel_available, get_ops, resolve_backend
from kvstrata.kernels.block_copy import reference_gather_blocks, reference_scatter_blocks
from kvstrata.kernels.kv_store import reference_store_kv
from kvstrata.kernels.prefix_prefill import reference_prefix_prefill

MIXED_BATCH = [(0, 7), (13, 1), (30, 5), (0, 1), (47, 17), (16, 16)]  # (context, new tokens): prefill and decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2)])
def test_reference_prefill_matches_dense_attention_on_mixed_batch(dtype, heads):
    problem = make_paged_problem(MIXED_BATCH, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64,
                                 block_size=8, dtype=dtype)
    out = torch.full_like(problem.query, float("nan"))
    result = reference_prefix_prefill(*problem.args(), out=out)
    assert result is out
    torch.testing.assert_close(out.double(), naive_attention(problem), **TOLERANCE[dtype])


@pytest.mark.parametrize("block_size", [16, 64])
def test_reference_prefill_handles_long_context_head_dim_128(block_size):
    problem = make_paged_problem([(100, 3), (0, 70), (129, 1)], num_heads=8, num_kv_heads=2, head_dim=128,
                                 block_size=block_size, dtype=torch.float32, seed=1)
    torch.testing.assert_close(reference_prefix_prefill(*problem.args()).double(), naive_attention(problem),
                               **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_prefill_is_exact_for_short_long_and_no_context(dtype):
    """Each way the CPU path aligns the causal diagonal: no context, a context shorter than the new
    tokens (queries padded at the front), and a longer one (explicit mask)."""
    problem = make_paged_problem([(0, 33), (3, 40), (1, 50), (20, 20), (40, 3), (47, 17)], num_heads=9,
                                 num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype, seed=7)
    out = torch.full_like(problem.query, float("nan"))
    reference_prefix_prefill(*problem.args(), out=out)
    torch.testing.assert_close(out.double(), naive_attention(problem), **TOLERANCE[dtype])


@pytest.mark.parametrize("seed", range(4))
def test_reference_prefill_matches_dense_attention_on_random_batches(seed):
    problem = make_paged_problem(random_batch(seed), num_heads=6, num_kv_heads=2, head_dim=64,
                                 block_size=[8, 16, 32][seed % 3], dtype=torch.float32, seed=seed)
    torch.testing.assert_close(reference_prefix_prefill(*problem.args()).double(), naive_attention(problem),
                               **TOLERANCE[torch.float32])


def test_store_kv_writes_each_slot_and_skips_padding():
    num_blocks, layers, block_size, kv_heads, head_dim = 6, 3, 4, 2, 8
    kv_cache = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim)
    before = kv_cache.clone()
    slots = torch.tensor([5, 6, -1, 22, 0, -1, 13])
    key = torch.randn(len(slots), kv_heads, head_dim)
    value = torch.randn(len(slots), kv_heads, head_dim)
    reference_store_kv(key, value, kv_cache, 1, slots)
    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, 1, 0, slot % block_size] = key[t]
            expected[slot // block_size, 1, 1, slot % block_size] = value[t]
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=0)


def test_gather_then_scatter_blocks_round_trips_whole_blocks():
    kv_cache = torch.randn(7, 2, 2, 4, 3, 8, dtype=torch.bfloat16)
    block_ids = torch.tensor([5, 0, 3])
    staged = reference_gather_blocks(kv_cache, block_ids, torch.empty(3, *kv_cache.shape[1:], dtype=torch.bfloat16))
    assert torch.equal(staged, kv_cache[[5, 0, 3]])
    target = torch.zeros_like(kv_cache)
    reference_scatter_blocks(staged, target, torch.tensor([1, 6, 2]))
    assert torch.equal(target[[1, 6, 2]], staged)
    assert not target[[0, 3, 4, 5]].any()


def test_torch_backend_serves_the_references_and_unknown_backends_are_rejected():
    ops = get_ops("torch")
    assert ops.name == "torch" and ops.prefix_prefill is reference_prefix_prefill
    with pytest.raises(ValueError, match="model.attention_backend"):
        get_ops("flash")
    with pytest.raises(ValueError, match="model.attention_backend"):
        resolve_backend("flash", "cpu")


def test_auto_backend_is_the_cpu_kernel_or_torch_on_cpu_and_triton_on_cuda():
    on_cpu = "cpu" if cpu_kernel_available() else "torch"
    assert resolve_backend("auto", "cpu") == on_cpu
    assert resolve_backend("auto", torch.device("cpu")) == on_cpu
    assert resolve_backend("auto", "cuda:0") == "triton"
    assert resolve_backend("torch", "cuda") == "torch"


def test_kernels_import_and_torch_path_work_without_triton():
    script = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
import torch
from kvstrata.kernels.backends import get_ops, resolve_backend
assert resolve_backend("auto", "cuda") == "torch"
ops = get_ops("torch")
q = torch.randn(3, 2, 8); cache = torch.randn(2, 1, 2, 4, 1, 8)
ops.prefix_prefill(q, cache, 0, torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
                   torch.tensor([5], dtype=torch.int32), 0.3)
try:
    get_ops("triton")
except ValueError as err:
    assert "model.attention_backend" in str(err), err
else:
    raise AssertionError("get_ops('triton') worked without triton")
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


@pytest.mark.parametrize("kv_len", [1, 16, 37])
def test_decode_reading_values_in_place_matches_the_gathered_decode(kv_len):
    """The CPU decode weighs V's rows where the paged cache holds them (no gathered copy): same values as the
    gathered decode, on blocks out of order, in a layer other than the first."""
    from kvstrata.kernels.prefix_prefill import (decode_attention, decode_attention_in_place, gather_sequence_kv,
                                                 reads_values_in_place)

    gen = torch.Generator().manual_seed(kv_len)
    num_layers, block_size, kv_heads, head_dim, heads = 3, 16, 2, 32, 6
    kv_cache = torch.randn(9, num_layers, 2, block_size, kv_heads, head_dim, generator=gen)
    block_table = torch.tensor([7, 2, 5, 0], dtype=torch.int32)
    query = torch.randn(heads, head_dim, generator=gen)
    assert reads_values_in_place(kv_cache, query) and not reads_values_in_place(kv_cache.bfloat16(), query)
    key, value = gather_sequence_kv(kv_cache, 1, block_table, kv_len)
    in_place = decode_attention_in_place(query, key, kv_cache, 1, block_table, kv_len, 0.2)
    torch.testing.assert_close(in_place, decode_attention(query, key, value, 0.2), rtol=1e-5, atol=1e-6)
