"""A KV cache kept narrower than the model computes in (`cache.kv_cache_dtype`: fp8, float16): K and V are
saturated into it on the way in and cast up on the way out, by the torch references and the Triton kernels
alike (conftest runs Triton through its CPU interpreter)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_cases import make_paged_problem, naive_attention

from kvstrata.kernels.kv_store import reference_store_kv, store_kv
from kvstrata.kernels.prefix_prefill import prefix_prefill, reference_prefix_prefill

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
MIXED_BATCH = [(0, 7), (13, 1), (30, 5), (47, 17), (62, 4)]


def kv_and_slots(num_tokens: int = 9):
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(num_tokens, 3, 64, generator=gen) * 4
    value = torch.randn(num_tokens, 3, 64, generator=gen)
    key[0, 0, :4] = torch.tensor([1e6, -1e6, 1e30, -3e38])  # far beyond any narrow format's range
    slots = torch.tensor([9, -1, 0, 39, 17, 3, 8, 20, 31])[:num_tokens]
    return key, value, slots


@pytest.mark.parametrize("cache_dtype", [*FP8, torch.float16])
def test_values_beyond_the_cache_dtype_saturate_to_its_largest_finite_value(cache_dtype):
    key, value, slots = kv_and_slots()
    kv_cache = torch.zeros(5, 2, 2, 8, 3, 64, dtype=cache_dtype)
    reference_store_kv(key, value, kv_cache, 1, slots)
    stored = kv_cache[1, 1, 0, 1, 0, :4].float()  # slot 9: block 1, offset 1
    bound = torch.finfo(cache_dtype).max
    assert stored.tolist() == [bound, -bound, bound, -bound]
    assert torch.isfinite(kv_cache.float()).all()
    # in range, a value is its nearest in the cache dtype, as a plain cast gives it
    assert torch.equal(kv_cache[1, 1, 1, 1].float(), value[0].to(cache_dtype).float())


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_triton_store_into_an_fp8_cache_matches_the_reference_bit_for_bit(cache_dtype, model_dtype):
    """Values the cache holds exactly, and values beyond its range. Rounding the others is the GPU's
    conversion (round to nearest even, as torch's), checked compiled by tests/gpu_kernel_check.py: Triton's
    interpreter loses the carry when an fp32 value rounds up into the next binade (1.97 -> 1.0, not 2.0)."""
    key, value, slots = kv_and_slots()
    held_key, held_value = key.to(cache_dtype).to(model_dtype), value.to(cache_dtype).to(model_dtype)
    held_key[0, 0, :4] = key[0, 0, :4].to(model_dtype)  # the out-of-range ones stay, to be saturated
    kv_cache = torch.zeros(5, 2, 2, 8, 3, 64, dtype=cache_dtype)
    expected = kv_cache.clone()
    store_kv(held_key, held_value, kv_cache, 1, slots)
    reference_store_kv(held_key, held_value, expected, 1, slots)
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))
    assert kv_cache[1, 1, 0, 1, 0, :4].float().tolist() == [torch.finfo(cache_dtype).max, -torch.finfo(cache_dtype).max] * 2


def quantized(problem, cache_dtype):
    """The same problem with its cache kept in `cache_dtype`; the oracle attends to the values it holds."""
    def held(t):
        return t.to(cache_dtype).to(t.dtype)

    return dataclasses.replace(problem, kv_cache=problem.kv_cache.to(cache_dtype),
                               keys=[held(k) for k in problem.keys], values=[held(v) for v in problem.values])


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_prefill_over_an_fp8_cache_matches_dense_attention_and_the_reference(cache_dtype, num_splits):
    problem = quantized(make_paged_problem(MIXED_BATCH, num_heads=9, num_kv_heads=3, head_dim=64, block_size=8,
                                           dtype=torch.float32), cache_dtype)
    dense = naive_attention(problem)
    out = prefix_prefill(*problem.args(), num_splits=num_splits)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), dense, atol=2e-5, rtol=2e-5)
    for batch_invariant in (False, True):
        reference = reference_prefix_prefill(*problem.args(), batch_invariant=batch_invariant)
        torch.testing.assert_close(reference.double(), dense, atol=2e-5, rtol=2e-5)


def test_prefill_refuses_a_query_dtype_it_cannot_compute_in():
    problem = make_paged_problem([(4, 4)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8,
                                 dtype=torch.float32)
    with pytest.raises(ValueError, match="query torch.float8_e4m3fn must be one of"):
        prefix_prefill(problem.query.to(torch.float8_e4m3fn), *problem.args()[1:])
