"""The compiled CPU layer ops (kernels/cpu_layer_ops.py, backend "cpu"): RMSNorm, rotary, SiLU-and-mul and the K/V
store must compute what their torch references do (rotary and the store bit for bit; the norm and SiLU to an ulp or
a few), on the strided views the decoder passes; give a row the same bits however its call is made up (alone, at
any offset, beside other rows, on more threads) and in either build (AVX2 or portable); reject bad input with a
ValueError before writing anything; and fall back to the references where the kernel cannot be built."""
from __future__ import annotations

import logging

import pytest
import torch

from kvstrata.engine.batch_invariant import BatchInvariantMode
from kvstrata.kernels import cpu_build, cpu_features, cpu_layer_ops
from kvstrata.kernels.backends import get_ops
from kvstrata.kernels.kv_store import reference_store_kv
from kvstrata.kernels.layer_ops import reference_rms_norm, reference_rotary, reference_silu_and_mul

pytestmark = pytest.mark.skipif(not cpu_layer_ops.available(), reason="no C compiler to build the CPU kernels")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5
# an ulp of each dtype, relative: what a float32 intermediate one ulp apart can move a rounded result by
ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def qkv_views(num_tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, seed=0):
    """q+k, k and v as the decoder takes them: strided views of one qkv product's rows."""
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed, scale=3.0)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim)
    value = qkv[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
    return qk, qk[:, heads:], value


def tables(num_tokens: int, head_dim: int, dtype, seed=1):
    angles = randn(num_tokens, head_dim // 2, seed=seed, scale=40.0).repeat(1, 2)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# -- against the references ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 100, 7])
def test_rms_norm_matches_the_reference_with_and_without_the_residual(dtype, width):
    """Rows of any width (a multiple of 8 or not); the sum with the residual is the reference's bits, the normalised
    rows within an ulp of the dtype (the squares are summed in another order than torch's)."""
    x, residual = randn(13, width, dtype=dtype, seed=2), randn(13, width, dtype=dtype, seed=3, scale=4.0)
    weight = randn(width, dtype=dtype, seed=4)
    out, summed = cpu_layer_ops.rms_norm(x, weight, EPS, residual)
    expected, expected_summed = reference_rms_norm(x, weight, EPS, residual)
    assert torch.equal(summed, expected_summed) and summed.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=2 * ULP[dtype], atol=1e-6)
    out, summed = cpu_layer_ops.rms_norm(x, weight, EPS)
    assert summed is x
    torch.testing.assert_close(out, reference_rms_norm(x, weight, EPS)[0], rtol=2 * ULP[dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_over_each_head_of_a_strided_view(dtype):
    """Qwen3's q and k norms: `[T, heads, head_dim]` views of the qkv product, one norm per head."""
    qk, key, _ = qkv_views(5, 4, 2, 64, dtype)
    weight = randn(64, dtype=dtype, seed=5)
    for x in (qk[:, :4], key):
        assert not x.is_contiguous()
        out, _ = cpu_layer_ops.rms_norm(x, weight, EPS)
        assert out.shape == x.shape and out.is_contiguous()
        torch.testing.assert_close(out, reference_rms_norm(x, weight, EPS)[0], rtol=2 * ULP[dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 6])
def test_rotary_gives_the_reference_bits_on_qkv_views(dtype, head_dim):
    qk, key, _ = qkv_views(11, 9, 3, head_dim, dtype)
    cos, sin = tables(11, head_dim, dtype)
    for x in (qk, key):
        out = cpu_layer_ops.rotary(x, cos, sin)
        assert out.is_contiguous() and torch.equal(out, reference_rotary(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_reference_to_a_few_ulp(dtype):
    """Its exp is the C file's, not torch's: float32 results within 4 ulp (the measured worst), rounded dtypes
    within one of theirs; the edge values (overflowing exp, infinities, NaN, zeros) as the reference's."""
    gate_up = randn(9, 2 * 1001, dtype=dtype, seed=6, scale=6.0)  # an odd width: the scalar tail too
    edges = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.5, -88.5, 89.0, -89.0, float("inf"), -float("inf"),
                          float("nan"), 1e-30])
    gate_up[0, :len(edges)] = edges.to(dtype)
    strided = torch.cat([gate_up, gate_up[:, :6]], dim=1)[:, :2 * 1001]  # rows further apart than their width
    for x in (gate_up, strided):
        out, expected = cpu_layer_ops.silu_and_mul(x), reference_silu_and_mul(x)
        torch.testing.assert_close(out, expected, rtol=(4 if dtype == torch.float32 else 1) * ULP[dtype], atol=0,
                                   equal_nan=True)
        assert torch.equal(out[0, :len(edges)].isnan(), expected[0, :len(edges)].isnan())
        assert torch.equal(out[0, :len(edges)].nan_to_num().view(torch.uint8),
                           expected[0, :len(edges)].nan_to_num().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_writes_the_reference_bytes(dtype, cache_dtype, slot_dtype):
    """Each model dtype into each cache dtype (a narrower cache saturated, as the reference does), padding slots
    skipped, K and V strided views of the qkv product, nothing else of the cache touched."""
    _, key, value = qkv_views(7, 4, 2, 64, dtype, seed=7)
    key = key * 1e5  # beyond float16's range: saturated where the cache is float16
    slots = torch.tensor([5, 6, -1, 22, 0, -1, 13], dtype=slot_dtype)
    kv_cache = randn(6, 3, 2, 4, 2, 64, dtype=cache_dtype, seed=8)
    expected = kv_cache.clone()
    cpu_layer_ops.store_kv(key, value, kv_cache, 1, slots)
    reference_store_kv(key, value, expected, 1, slots)
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_int8_and_fp8_caches_take_the_reference(cache_dtype):
    _, key, value = qkv_views(5, 4, 2, 64, torch.float32)
    slots = torch.tensor([3, -1, 9, 0, 14])
    row = 68 if cache_dtype == torch.int8 else 64  # an int8 row ends with its scale
    kv_cache = torch.zeros(4, 2, 2, 4, 2, row, dtype=cache_dtype)
    expected = kv_cache.clone()
    cpu_layer_ops.store_kv(key, value, kv_cache, 1, slots)
    reference_store_kv(key, value, expected, 1, slots)
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))


# -- invariance ------------------------------------------------------------------------------------------------------


def all_ops(dtype, num_tokens: int = 160, seed: int = 0):
    """Each op's inputs for `num_tokens` tokens (enough values that two threads share the work; rows of the norm and
    SiLU not a multiple of 8 wide, so the vector loops' scalar tails run too) and a function computing every op on
    tokens [a, b): their outputs, in a list."""
    x, residual = randn(num_tokens, 580, dtype=dtype, seed=seed), randn(num_tokens, 580, dtype=dtype, seed=seed + 1)
    weight, head_weight = randn(580, dtype=dtype, seed=seed + 2), randn(64, dtype=dtype, seed=seed + 3)
    qk, _, _ = qkv_views(num_tokens, 9, 3, 64, dtype, seed=seed)
    cos, sin = tables(num_tokens, 64, dtype)
    gate_up = randn(num_tokens, 2 * 1540, dtype=dtype, seed=seed + 4, scale=4.0)

    def compute(a: int, b: int) -> list[torch.Tensor]:
        return [*cpu_layer_ops.rms_norm(x[a:b], weight, EPS, residual[a:b]),
                cpu_layer_ops.rms_norm(qk[a:b], head_weight, EPS)[0], cpu_layer_ops.rotary(qk[a:b], cos[a:b], sin[a:b]),
                cpu_layer_ops.silu_and_mul(gate_up[a:b])]
    return compute


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_alone_at_any_offset_or_on_more_threads(dtype, threads):
    threads(1)
    compute = all_ops(dtype)
    whole = compute(0, 160)
    for a, b in ((0, 1), (7, 8), (159, 160), (3, 40), (100, 160)):
        for part, full in zip(compute(a, b), whole):
            assert torch.equal(part, full[a:b]), f"rows {a}..{b} alone differ from the whole call's"
    for num_threads in (2, 3):
        threads(num_threads)
        assert all(torch.equal(a, b) for a, b in zip(compute(0, 160), whole)), f"{num_threads} threads changed bits"


def test_batch_invariant_mode_intercepts_nothing_of_the_norm():
    """The mode routes a last-axis mean to its invariant kernel; the compiled norm has none to route and gives
    the same bits inside the mode as outside."""
    x, residual, weight = randn(5, 576, seed=1), randn(5, 576, seed=2), randn(576, seed=3)
    outside = cpu_layer_ops.rms_norm(x, weight, EPS, residual)
    calls = []
    ops = get_ops("cpu", batch_invariant=True)
    mode = BatchInvariantMode(ops)
    mode.ops = type("Spy", (), {"mean_last_dim": lambda *a, **k: calls.append(a) or ops.mean_last_dim(*a, **k),
                                "linear": ops.linear})()
    with mode:
        inside = ops.rms_norm(x, weight, EPS, residual)
    assert calls == [] and all(torch.equal(a, b) for a, b in zip(inside, outside))


def test_the_cpu_backend_serves_the_compiled_ops():
    for invariant in (False, True):
        ops = get_ops("cpu", batch_invariant=invariant)
        assert (ops.rms_norm, ops.rotary, ops.silu_and_mul, ops.store_kv) == (
            cpu_layer_ops.rms_norm, cpu_layer_ops.rotary, cpu_layer_ops.silu_and_mul, cpu_layer_ops.store_kv)


# -- bad input -------------------------------------------------------------------------------------------------------


def bad_calls():
    """(what is wrong, a call doing it, the message's start) for each kind of bad input."""
    x, weight = randn(3, 64), randn(64)
    qk, key, value = qkv_views(3, 4, 2, 64, torch.float32)
    cos, sin = tables(3, 64, torch.float32)
    cache = torch.zeros(4, 2, 2, 4, 2, 64)
    slots = torch.tensor([0, 5, 15])
    ops = cpu_layer_ops
    return {
        "norm weight of another width": (lambda: ops.rms_norm(x, weight[:32], EPS), "rms_norm"),
        "norm over a 4-D x": (lambda: ops.rms_norm(x.view(3, 2, 2, 16), weight[:16], EPS), "rms_norm"),
        "norm of a strided last axis": (lambda: ops.rms_norm(randn(3, 128)[:, ::2], weight, EPS), "rms_norm"),
        "norm residual of another shape": (lambda: ops.rms_norm(x, weight, EPS, x[:2]), "rms_norm"),
        "norm residual beside a 3-D x": (lambda: ops.rms_norm(key, weight, EPS, key), "rms_norm"),
        "rotary of an odd head_dim": (lambda: ops.rotary(randn(3, 2, 5), cos[:, :5], sin[:, :5]), "rotary"),
        "rotary tables of other tokens": (lambda: ops.rotary(qk, cos[:2], sin[:2]), "rotary"),
        "rotary of a 2-D x": (lambda: ops.rotary(x, cos, sin), "rotary"),
        "silu of an odd width": (lambda: ops.silu_and_mul(randn(3, 7)), "silu_and_mul"),
        "silu of a 3-D x": (lambda: ops.silu_and_mul(randn(3, 2, 8)), "silu_and_mul"),
        "store of value another shape": (lambda: ops.store_kv(key, value[:2], cache, 0, slots), "store_kv"),
        "store into a cache of other heads": (lambda: ops.store_kv(key, value, cache[..., :1, :], 0, slots),
                                              "store_kv"),
        "store into a layer past the cache": (lambda: ops.store_kv(key, value, cache, 2, slots), "store_kv"),
        "store with float slots": (lambda: ops.store_kv(key, value, cache, 0, slots.float()), "store_kv"),
        "store with too few slots": (lambda: ops.store_kv(key, value, cache, 0, slots[:2]), "store_kv"),
        "store into a slot past the cache": (lambda: ops.store_kv(key, value, cache, 0, torch.tensor([0, 16, 1])),
                                             "store_kv: token 1's slot 16 is outside the cache's 16 slots"),
    }


@pytest.mark.parametrize("case", list(bad_calls()))
def test_bad_input_is_a_one_line_value_error(case):
    call, message = bad_calls()[case]
    with pytest.raises(ValueError, match=f"^{message}") as error:
        call()
    assert "\n" not in str(error.value)


def test_a_bad_slot_writes_nothing_not_even_the_good_slots_before_it():
    _, key, value = qkv_views(3, 4, 2, 64, torch.float32)
    kv_cache = torch.zeros(4, 2, 2, 4, 2, 64)
    with pytest.raises(ValueError, match="slot 99 is outside"):
        cpu_layer_ops.store_kv(key, value, kv_cache, 1, torch.tensor([2, 7, 99]))
    assert not kv_cache.any()


# -- builds ----------------------------------------------------------------------------------------------------------




def test_a_failing_build_says_so_once_and_every_op_runs_its_reference(rebuilt, monkeypatch, caplog, broken_compiler):
    x, residual, weight = randn(4, 96, seed=1), randn(4, 96, seed=2), randn(96, seed=3)
    qk, key, value = qkv_views(4, 4, 2, 64, torch.float32)
    cos, sin = tables(4, 64, torch.float32)
    kv_cache, expected = torch.zeros(4, 2, 2, 4, 2, 64), torch.zeros(4, 2, 2, 4, 2, 64)
    slots = torch.tensor([3, -1, 9, 0])
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(cpu_layer_ops.rms_norm(x, weight, EPS, residual),
                                                         reference_rms_norm(x, weight, EPS, residual)))
            assert torch.equal(cpu_layer_ops.rotary(qk, cos, sin), reference_rotary(qk, cos, sin))
            assert torch.equal(cpu_layer_ops.silu_and_mul(x), reference_silu_and_mul(x))
            cpu_layer_ops.store_kv(key, value, kv_cache, 1, slots)
        reference_store_kv(key, value, expected, 1, slots)
        assert torch.equal(kv_cache, expected) and not cpu_layer_ops.available()
    (record,) = caplog.records
    assert "layer ops kernel could not be built (broken-cc exited with 4: cc1: internal compiler error)" in \
        record.getMessage()
    assert list(rebuilt.iterdir()) == [], "a failed build left a file behind"


def test_the_portable_build_gives_the_vector_build_bits(rebuilt, monkeypatch):
    """Built without AVX2 (plain C loops, the same operations on each value), every op gives the same bits as the
    vector build, in every dtype: nothing of a row's arithmetic depends on the build."""
    if not cpu_features.has_avx2_fma():
        pytest.skip("this CPU has no AVX2: the build here is the portable one already")
    computes = {dtype: all_ops(dtype, num_tokens=9, seed=3) for dtype in DTYPES}
    vector = {dtype: compute(0, 9) for dtype, compute in computes.items()}
    cpu_layer_ops.library.cache_clear()
    monkeypatch.setattr(cpu_features, "has_avx2_fma", lambda flags=None: False)
    assert "-mavx2" not in cpu_build.compile_flags()
    for dtype, compute in computes.items():
        assert all(torch.equal(a, b) for a, b in zip(compute(0, 9), vector[dtype])), dtype
    assert len(list(rebuilt.iterdir())) == 2  # the vector build and the portable one
