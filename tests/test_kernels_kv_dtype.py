"""A KV cache kept narrower than the model computes in (`cache.kv_cache_dtype`: fp8, float16, int8): K and V
are saturated into it (int8: scaled per row) on the way in and cast up on the way out, by the torch
references and the Triton kernels alike (conftest runs Triton through its CPU interpreter)."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import make_paged_problem, naive_attention, narrow_cache_problem

from kvstrata.kernels.kv_format import row_width
from kvstrata.kernels.kv_store import dequantize_rows, quantize_rows, reference_store_kv, store_kv
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


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_prefill_over_an_fp8_cache_matches_dense_attention_and_the_reference(cache_dtype, num_splits):
    problem = narrow_cache_problem(make_paged_problem(MIXED_BATCH, num_heads=9, num_kv_heads=3, head_dim=64,
                                                      block_size=8, dtype=torch.float32), cache_dtype)
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


# ---------------------------------------------------------------------------------------------- int8, scaled rows

def test_an_int8_row_is_its_values_to_half_a_step_of_its_own_scale():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, 64, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[None, :, None]
    x[2, 1] = 0.0
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (6, 3, row_width(64, "int8")) == (6, 3, 68)
    held = dequantize_rows(rows)
    step = x.abs().amax(dim=-1, keepdim=True) / 127  # each row's own scale: a small head loses no more
    assert (held - x).abs().le(step / 2 * 1.0001).all()
    assert held[2, 1].eq(0).all()  # an all-zero row stays zeros (scale 0), not NaN
    assert rows[..., :64].abs().amax() == 127


def test_a_scaled_cache_needs_room_for_the_scale_in_each_row():
    with pytest.raises(ValueError, match="head_dim a multiple of 4"):
        row_width(62, "int8")
    key, value, slots = kv_and_slots()
    unscaled_width = torch.zeros(5, 2, 2, 8, 3, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="does not hold 3 kv heads of dim 64 as torch.int8"):
        store_kv(key, value, unscaled_width, 1, slots)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_triton_store_into_an_int8_cache_matches_the_reference_bit_for_bit(model_dtype):
    key, value, slots = kv_and_slots()
    key, value = key.to(model_dtype), value.to(model_dtype)
    value[4, 2] = 0.0
    kv_cache = torch.zeros(5, 2, 2, 8, 3, 68, dtype=torch.int8)
    expected = kv_cache.clone()
    store_kv(key, value, kv_cache, 1, slots)
    reference_store_kv(key, value, expected, 1, slots)
    assert torch.equal(kv_cache, expected)
    assert kv_cache[:, 0].eq(0).all() and kv_cache[0, 1, :, 1].eq(0).all()  # other layer, the padding's slot
    # slot 0 holds token 2's K, as `quantize_rows` gives it
    assert torch.equal(kv_cache[0, 1, 0, 0], quantize_rows(key[2]))


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_over_an_int8_cache_matches_dense_attention_and_the_reference(num_splits, head_dim):
    problem = narrow_cache_problem(make_paged_problem(MIXED_BATCH, num_heads=9, num_kv_heads=3, head_dim=head_dim,
                                                      block_size=8, dtype=torch.float32), torch.int8)
    dense = naive_attention(problem)
    out = prefix_prefill(*problem.args(), num_splits=num_splits)
    torch.testing.assert_close(out.double(), dense, atol=2e-5, rtol=2e-5)
    for batch_invariant in (False, True):
        reference = reference_prefix_prefill(*problem.args(), batch_invariant=batch_invariant)
        torch.testing.assert_close(reference.double(), dense, atol=2e-5, rtol=2e-5)


def test_prefill_over_an_int8_cache_in_bfloat16_matches_the_reference():
    problem = narrow_cache_problem(make_paged_problem(MIXED_BATCH, num_heads=4, num_kv_heads=2, head_dim=64,
                                                      block_size=16, dtype=torch.bfloat16), torch.int8)
    out = prefix_prefill(*problem.args())
    torch.testing.assert_close(out.float(), reference_prefix_prefill(*problem.args()).float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), naive_attention(problem), atol=2e-2, rtol=2e-2)
