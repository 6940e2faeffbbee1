"""The fused parts of a decoder layer (kernels/layer_ops.py): each torch reference computes transformers' own bits
(the CPU path runs it in place of transformers' modules), and each Triton kernel, run through the interpreter
(conftest sets TRITON_INTERPRET=1), agrees with its reference on the shapes the decoder gives it: strided views of
the qkv product, rows that are not a power of two wide, and each dtype."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import TOLERANCE
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvstrata.kernels.layer_ops import (reference_rms_norm, reference_rotary, reference_silu_and_mul, rms_norm,
                                        rotary, silu_and_mul)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def rotary_tables(num_tokens: int, head_dim: int, dtype: torch.dtype, rope_scaling: dict | None = None):
    """cos and sin `[T, head_dim]` as transformers' rotary module gives them, at scattered positions."""
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=8192, rope_scaling=rope_scaling)
    positions = torch.randperm(8000, generator=torch.Generator().manual_seed(3))[:num_tokens]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=dtype), positions[None])
    return cos[0], sin[0]


# -- the references are transformers' code --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reference_gives_transformers_bits_with_and_without_the_residual_add(dtype):
    norm = LlamaRMSNorm(96, eps=EPS).to(dtype)
    norm.weight.data = randn(96, dtype=dtype, seed=1)
    x, residual = randn(7, 96, dtype=dtype, seed=2), randn(7, 96, dtype=dtype, seed=3, scale=4.0)
    out, summed = reference_rms_norm(x, norm.weight, EPS)
    assert torch.equal(out, norm(x)) and summed is x
    out, summed = reference_rms_norm(x, norm.weight, EPS, residual)
    assert torch.equal(summed, residual + x)  # transformers adds the residual first: `residual + hidden_states`
    assert torch.equal(out, norm(residual + x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_reference_gives_transformers_bits(dtype):
    num_tokens, heads, kv_heads, head_dim = 5, 4, 2, 64
    cos, sin = rotary_tables(num_tokens, head_dim, dtype, {"rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 1024})
    q, k = randn(num_tokens, heads, head_dim, dtype=dtype, seed=4), randn(num_tokens, kv_heads, head_dim, dtype=dtype)
    # transformers' layout: [batch, heads, tokens, head_dim], cos/sin [batch, tokens, head_dim]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(reference_rotary(q, cos, sin), q_hf[0].transpose(0, 1))
    assert torch.equal(reference_rotary(k, cos, sin), k_hf[0].transpose(0, 1))


def test_silu_and_mul_reference_is_the_gated_mlps_activation():
    gate, up = randn(6, 40, dtype=torch.bfloat16, seed=5, scale=3.0), randn(6, 40, dtype=torch.bfloat16, seed=6)
    act = torch.nn.SiLU()  # transformers' ACT2FN["silu"]
    assert torch.equal(reference_silu_and_mul(torch.cat([gate, up], dim=1)), act(gate) * up)


# -- the Triton kernels match the references ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 72])
def test_rms_norm_kernel_matches_reference(dtype, width):
    x, residual = randn(9, width, dtype=dtype, seed=7), randn(9, width, dtype=dtype, seed=8, scale=10.0)
    weight = randn(width, dtype=dtype, seed=9)
    out, summed = rms_norm(x, weight, EPS)
    expected, _ = reference_rms_norm(x, weight, EPS)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    assert summed is x
    out, summed = rms_norm(x, weight, EPS, residual)
    expected, expected_summed = reference_rms_norm(x, weight, EPS, residual)
    torch.testing.assert_close(summed, expected_summed, **TOLERANCE[dtype])
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    assert out.is_contiguous() and summed.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_normalises_each_head_of_a_strided_view(dtype):
    """Qwen3's q and k norms: an RMSNorm over each head's dims, read from the q heads of the qkv product."""
    num_tokens, heads, kv_heads, head_dim = 6, 3, 1, 32
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=10)
    q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
    weight = randn(head_dim, dtype=dtype, seed=11)
    out, _ = rms_norm(q, weight, EPS)
    torch.testing.assert_close(out, reference_rms_norm(q, weight, EPS)[0], **TOLERANCE[dtype])


def test_rms_norm_kernel_gives_a_row_the_same_bits_whatever_else_is_in_the_call():
    """The batch-invariant mode relies on it: a token's norm must not depend on the step it is computed in."""
    x, residual, weight = randn(40, 96, seed=12), randn(40, 96, seed=13), randn(96, seed=14)
    whole, _ = rms_norm(x, weight, EPS, residual)
    for rows in (slice(0, 1), slice(5, 8), slice(13, 40)):
        assert torch.equal(rms_norm(x[rows], weight, EPS, residual[rows])[0], whole[rows])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_kernel_matches_reference_on_q_and_k_heads_read_from_the_qkv_product(dtype, head_dim):
    num_tokens, heads, kv_heads = 7, 9, 3  # SmolLM2's heads: 12 rotated side by side, not a power of two
    qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=15, scale=2.0)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim)
    cos, sin = rotary_tables(num_tokens, head_dim, dtype)
    out = rotary(qk, cos, sin)
    torch.testing.assert_close(out, reference_rotary(qk, cos, sin), **TOLERANCE[dtype])
    assert out.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_kernel_matches_reference_over_several_column_programs(dtype):
    x = randn(3, 2 * 1500, dtype=dtype, seed=16, scale=4.0)  # 1500 outputs per token: two programs of 1024
    torch.testing.assert_close(silu_and_mul(x), reference_silu_and_mul(x), **TOLERANCE[dtype])


def test_kernels_take_no_tokens():
    empty = torch.zeros(0, 64)
    assert rms_norm(empty, torch.ones(64), EPS, torch.zeros(0, 64))[0].shape == (0, 64)
    assert rotary(torch.zeros(0, 2, 64), torch.zeros(0, 64), torch.zeros(0, 64)).shape == (0, 2, 64)
    assert silu_and_mul(torch.zeros(0, 128)).shape == (0, 64)


@pytest.mark.parametrize("call, message", [
    (lambda: rms_norm(torch.zeros(2, 64), torch.ones(32), EPS), "rms_norm: x"),
    (lambda: rms_norm(torch.zeros(2, 64), torch.ones(64), EPS, torch.zeros(3, 64)), "rms_norm: residual"),
    (lambda: rms_norm(torch.zeros(2, 64), torch.ones(64, dtype=torch.bfloat16), EPS), "rms_norm: x"),
    (lambda: rotary(torch.zeros(2, 2, 63), torch.zeros(2, 63), torch.zeros(2, 63)), "rotary: x"),
    (lambda: rotary(torch.zeros(2, 2, 64), torch.zeros(3, 64), torch.zeros(2, 64)), "rotary: cos"),
    (lambda: rotary(torch.zeros(2, 2, 64), torch.zeros(2, 64), torch.zeros(2, 64, dtype=torch.float16)),
     "rotary: sin"),
    (lambda: silu_and_mul(torch.zeros(2, 63)), "silu_and_mul: x"),
])
def test_kernels_reject_shapes_they_cannot_run_in_one_line(call, message):
    with pytest.raises(ValueError, match=message):
        call()
