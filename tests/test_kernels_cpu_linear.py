"""The compiled CPU linear layer (kernels/cpu_linear.py, the "cpu" backend's `linear`): it must compute what
`F.linear` does, give a row the same bits however many rows share its call, wherever it sits and on any number of
threads (batch-invariant by construction, no padding), reject bad input with a ValueError, and fall back, saying so
once, where it cannot be built."""
from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn.functional as F

from kvstrata.kernels import batch_invariant, cpu_build, cpu_features, cpu_linear
from kvstrata.kernels.backends import cpu_kernel_available, get_ops

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no C compiler to build the CPU kernel")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Against a float64 product: float32 sums of K products; 16-bit results are rounded once to their dtype.
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
             torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.fixture
def threads():
    """Set torch's thread count for one test (the kernel splits its work over that many), restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def problem(M: int, K: int, N: int, dtype: torch.dtype, bias: bool = True, seed: int = 0):
    """x [M, K], a weight stored [in, out] seen as [N, K] (the CPU decoder's layout), and a bias."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    weight = (torch.randn(K, N, generator=gen) / K ** 0.5).to(dtype).t()
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    return x, weight, b


def exact(x, weight, bias):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, K, N", [(1, 64, 96), (5, 37, 45), (13, 576, 200), (70, 300, 333), (130, 129, 17),
                                     (3, 1, 20), (2, 260, 1000), (10, 100, 77), (29, 129, 100), (61, 300, 45)])
def test_matches_f_linear_in_float64(M, K, N, dtype):
    """Odd K and N (no multiple of 8 or 16), one row to several row blocks, K across several K blocks (10 rows:
    two groups of 5 over K blocks of 48, the last one short, and a last partial strip of columns; 29 and 61 rows:
    a question's suffix, the weights read in place by 5 and 11 row groups in float32, 29 in bfloat16 too)."""
    for bias in (True, False):
        x, weight, b = problem(M, K, N, dtype, bias)
        out = cpu_linear.linear(x, weight, b)
        assert out.dtype == dtype and out.shape == (M, N)
        torch.testing.assert_close(out.double(), exact(x, weight, b), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_empty_sum_gives_the_bias_for_any_leading_shape(dtype):
    x = torch.randn(2, 3, 0).to(dtype)
    weight = torch.randn(0, 5).to(dtype).t()
    b = torch.randn(5).to(dtype)
    assert torch.equal(cpu_linear.linear(x, weight, b), F.linear(x, weight, b))
    assert torch.equal(cpu_linear.linear(x, weight), torch.zeros(2, 3, 5, dtype=dtype))


def test_a_16_bit_result_is_the_float32_sum_rounded_to_nearest_even():
    x, weight, b = problem(9, 100, 70, torch.bfloat16)
    as_float = cpu_linear.linear(x.float(), weight.float().t().contiguous().t(), b.float())
    assert torch.equal(cpu_linear.linear(x, weight, b), as_float.to(torch.bfloat16))


def test_leading_axes_and_strided_rows_are_what_f_linear_takes():
    x, weight, b = problem(24, 48, 40, torch.float32)
    batched = x.view(2, 3, 4, 48)
    assert torch.equal(cpu_linear.linear(batched, weight, b), cpu_linear.linear(x, weight, b).view(2, 3, 4, 40))
    wide = torch.randn(24, 100)
    wide[:, 10:58] = x
    assert torch.equal(cpu_linear.linear(wide[:, 10:58], weight, b), cpu_linear.linear(x, weight, b))
    assert torch.equal(cpu_linear.linear(x.t().contiguous().t(), weight, b), cpu_linear.linear(x, weight, b))
    assert cpu_linear.linear(x[:0], weight, b).shape == (0, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_a_row_has_the_same_bits_in_any_call_at_any_place_on_any_thread_count(dtype, bias, threads):
    """Every row count 1..70, at several offsets of the same rows, on 1-3 threads: each row's bits are those it
    gets alone, on one thread. (Rows of 1..3 read the weight in place 8 rows of K at a time, 4..64 a strip at a time
    (4..32 in bfloat16), more are packed: all three paths and the rows where one gives way to the next.)"""
    x, weight, b = problem(75, 200, 300, dtype, bias, seed=1)
    threads(1)
    alone = torch.cat([cpu_linear.linear(x[i:i + 1], weight, b) for i in range(75)])
    for n in (1, 2, 3):
        threads(n)
        for rows in range(1, 71):
            start = (rows * 7) % (75 - rows + 1)
            assert torch.equal(cpu_linear.linear(x[start:start + rows], weight, b), alone[start:start + rows]), \
                (n, rows, start)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefill_chunk_has_each_row_s_bits_on_any_thread_count(dtype, threads):
    """A prefill's many rows: each item packs its columns of the weight once, K block by K block (K of 600: three
    blocks, the last short), and reuses them for all its row blocks (300 rows: four of up to 96); the rows are
    split into as many parts as the thread count needs (N of 700: three column chunks of 240, 240 and 220 columns,
    so 2 and 4 threads split the rows, 3 do not). Every row keeps the bits it gets alone, and the sums are right."""
    x, weight, b = problem(300, 600, 700, dtype, seed=3)
    threads(1)
    alone = torch.cat([cpu_linear.linear(x[i:i + 1], weight, b) for i in range(300)])
    torch.testing.assert_close(alone.double(), exact(x, weight, b), **TOLERANCE[dtype])
    for n in (1, 2, 3, 4):
        threads(n)
        assert torch.equal(cpu_linear.linear(x, weight, b), alone), n
        assert torch.equal(cpu_linear.linear(x[5:205], weight, b), alone[5:205]), n


def test_big_calls_split_over_threads_give_the_same_bits(threads):
    """A call large enough to start threads, with row blocks and column chunks over them."""
    x, weight, b = problem(200, 160, 700, torch.float32, seed=2)
    threads(1)
    one = cpu_linear.linear(x, weight, b)
    threads(3)
    assert torch.equal(cpu_linear.linear(x, weight, b), one)
    assert torch.equal(cpu_linear.linear(x[37:38], weight, b), one[37:38])


def test_other_layouts_and_dtypes_take_the_fallback():
    x, weight, b = problem(6, 32, 24, torch.float32)
    stored_out_in = weight.contiguous()
    calls = []
    fallback = functools.partial(lambda *args: calls.append(args) or F.linear(*args))
    torch.testing.assert_close(cpu_linear.linear(x, stored_out_in, b, fallback=fallback), F.linear(x, weight, b))
    x64, w64, b64 = problem(6, 32, 24, torch.float64)
    assert torch.equal(cpu_linear.linear(x64, w64, b64, fallback=fallback), F.linear(x64, w64, b64))
    assert len(calls) == 2
    assert not cpu_linear.supports(x, stored_out_in) and cpu_linear.supports(x, weight)


def bad_inputs():
    x, weight, b = problem(4, 16, 8, torch.float32)
    return {
        "K differs": (x[:, :15], weight, b),
        "weight not 2-D": (x, weight[None], b),
        "dtypes differ": (x.to(torch.bfloat16), weight, b),
        "integer x": (x.long(), weight.long(), None),
        "bias of another length": (x, weight, b[:7]),
        "bias not a vector": (x, weight, b[None]),
        "x a scalar": (torch.tensor(1.0), weight, b),
    }


@pytest.mark.parametrize("case", list(bad_inputs()))
def test_bad_input_is_a_value_error(case):
    with pytest.raises(ValueError, match="^linear: "):
        cpu_linear.linear(*bad_inputs()[case])




def test_without_a_compiler_it_says_so_once_and_runs_the_fallback(rebuilt, monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "find_compiler", lambda: None)
    x, weight, b = problem(5, 32, 24, torch.float32)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert torch.equal(cpu_linear.linear(x, weight, b), F.linear(x, weight, b))
        assert not cpu_linear.available()
    assert [r.getMessage() for r in caplog.records] == [
        "kvstrata: no C compiler (cc or gcc) found; CPU linear runs the torch reference"]


def test_a_failing_build_says_so_once_and_runs_the_fallback(rebuilt, monkeypatch, caplog, broken_compiler):
    x, weight, b = problem(3, 16, 8, torch.bfloat16)
    reference = functools.partial(batch_invariant.reference_linear)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(cpu_linear.linear(x, weight, b, fallback=reference), reference(x, weight, b))
    (record,) = caplog.records
    assert "could not be built (broken-cc exited with 4: cc1: internal compiler error)" in record.getMessage()
    assert list(rebuilt.iterdir()) == [], "a failed build left a file behind"


def test_the_portable_build_for_cpus_without_avx2_computes_the_same_products(rebuilt, monkeypatch, threads):
    """Where the CPU lacks AVX2 or FMA the kernel is built without them (plain C loops, the same order): it must be
    as right, and as invariant, as the vector build."""
    monkeypatch.setattr(cpu_features, "has_avx2_fma", lambda flags=None: False)
    assert "-mavx2" not in cpu_build.compile_flags()
    for dtype in (torch.float32, torch.bfloat16):
        x, weight, b = problem(40, 150, 70, dtype, seed=3)
        threads(1)
        whole = cpu_linear.linear(x, weight, b)
        torch.testing.assert_close(whole.double(), exact(x, weight, b), **TOLERANCE[dtype])
        assert torch.equal(cpu_linear.linear(x[11:12], weight, b), whole[11:12])
        threads(2)
        assert torch.equal(cpu_linear.linear(x[3:30], weight, b), whole[3:30])
    assert [f.suffix for f in rebuilt.iterdir()] == [".so"]


def test_the_cpu_backend_computes_its_products_here_in_both_modes():
    """Backend "cpu": `linear` is this kernel (the invariant mode's products), with the invariant torch reference
    as its fallback, never `F.linear` (which the mode intercepts); backend "torch" keeps the reference. The default
    mode's products (`model_linear`) are this kernel's only for the dtypes it computes faster on this CPU family;
    in the invariant mode they are `linear` itself, with nothing intercepted (every op of the backend is invariant
    by itself), while backend "torch" intercepts the decoder's `F.linear` and means."""
    assert cpu_kernel_available()
    x, weight, b = problem(7, 64, 40, torch.float32)
    for invariant in (False, True):
        ops = get_ops("cpu", batch_invariant=invariant)
        assert torch.equal(ops.linear(x, weight, b), cpu_linear.linear(x, weight, b))
        assert ops.linear.keywords["fallback"] is batch_invariant.reference_linear
        assert get_ops("torch", batch_invariant=invariant).linear is batch_invariant.reference_linear
        assert get_ops("torch", batch_invariant=invariant).model_linear is None
    assert get_ops("cpu").model_linear is cpu_linear.model_linear
    invariant_ops = get_ops("cpu", batch_invariant=True)
    assert invariant_ops.model_linear is invariant_ops.linear and not invariant_ops.intercept
    assert get_ops("torch", batch_invariant=True).intercept and not get_ops("cpu").intercept


@pytest.mark.parametrize("family, kernel_rows", [("avx2", {torch.bfloat16: (1, 5, 16, 17, 40)}),
                                                 ("avx512", {torch.bfloat16: (1, 5, 16)}),
                                                 ("amx", {torch.bfloat16: (1, 5, 16)})])
def test_the_default_mode_takes_the_kernel_only_where_it_is_faster(monkeypatch, family, kernel_rows):
    """`model_linear`: on AVX2 bfloat16 products of any row count are this kernel's (torch has no fast bfloat16 GEMM
    there), float32 stays MKL's `F.linear`; on AVX-512 and AMX a decode's or a short question's bfloat16 rows (up to
    FEW_ROWS, however the rows are shaped) are this kernel's, a prefill's many rows torch's own bfloat16 GEMM."""
    monkeypatch.setattr(cpu_features, "cpu_matrix_family", lambda: family)
    cpu_linear._model_dtypes.cache_clear()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            assert cpu_linear.takes_default_products(dtype) == (family == "avx2" and dtype == torch.bfloat16)
            for rows in (1, 5, 16, 17, 40):
                x, weight, b = problem(rows, 48, 24, dtype)
                expected = (cpu_linear.linear(x, weight, b) if rows in kernel_rows.get(dtype, ())
                            else F.linear(x, weight, b))
                assert torch.equal(cpu_linear.model_linear(x, weight, b), expected), (dtype, rows)
                batched = x.reshape(1, rows, 48)  # [batch, tokens, K]: the rows are what count
                assert torch.equal(cpu_linear.model_linear(batched, weight, b), expected.reshape(1, rows, 24))
    finally:
        cpu_linear._model_dtypes.cache_clear()
