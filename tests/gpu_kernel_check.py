"""Run the Triton prefix-prefill compiled for this machine's GPU over the grid of realistic shapes in
kernel_cases.CUDA_CASES (SmolLM2 and Llama-3-8B heads, contexts to 8k, bf16/fp16/fp32, split-KV chosen, off and
forced) and check each case as the interpreter tests do (`check_prefill`); then a KV cache kept in fp8 or int8
(KV_DTYPE_CASES: stores rounded as torch rounds, bit for bit, and prefill over it); then the fused layer parts
against their torch references on each model's widths (LAYER_OPS_CASES). Prints one JSON line per case:
`{"case", "num_splits", "error"}`, where num_splits is the automatic choice for this GPU and error is None or the
first lines of the failure. Needs CUDA and TRITON_INTERPRET unset; tests/test_kernels_cuda.py runs it:

    python tests/gpu_kernel_check.py
"""
from __future__ import annotations

import json
import os

import torch
from kernel_cases import (CUDA_BATCHES, CUDA_CASES, CUDA_DTYPES, CUDA_HEAD_SHAPES, CUDA_SPLITS, KV_DTYPE_CASES,
                          LAYER_OPS_CASES, LAYER_WIDTHS, TOLERANCE, CudaCase, check_prefill, make_paged_problem,
                          naive_attention, narrow_cache_problem)

from kvstrata.kernels import layer_ops
from kvstrata.kernels.kv_format import row_width
from kvstrata.kernels.kv_store import reference_store_kv, store_kv
from kvstrata.kernels.prefix_prefill import choose_num_splits, prefix_prefill, sm_count

BLOCK_SIZE = 16


def run_case(case: CudaCase, device: torch.device) -> dict:
    num_heads, num_kv_heads, head_dim = CUDA_HEAD_SHAPES[case.heads]
    dtype = CUDA_DTYPES[case.dtype]
    problem = make_paged_problem(CUDA_BATCHES[case.batch], num_heads=num_heads, num_kv_heads=num_kv_heads,
                                 head_dim=head_dim, block_size=BLOCK_SIZE, dtype=dtype).to(device)
    num_tokens, num_seqs = problem.query.shape[0], problem.seq_lens.shape[0]
    chosen = choose_num_splits(num_tokens, num_seqs, num_heads, num_kv_heads,
                               problem.block_tables.shape[1] * BLOCK_SIZE, sm_count(device))
    error = None
    try:
        check_prefill(problem, dtype, num_splits=CUDA_SPLITS[case.splits])
        torch.cuda.synchronize(device)
    except Exception as exc:  # reported per case, so one failure does not hide the others
        error = f"{type(exc).__name__}: " + "\n".join(str(exc).splitlines()[:6])
    return {"case": case.name, "num_splits": chosen, "error": error}


def run_kv_dtype_case(name: str, device: torch.device) -> dict:
    """`store-<dtype>`: random bf16 K/V (and values beyond fp8's range) stored bit for bit as the torch
    reference stores them (fp8: torch's cast; int8: the same float32 operations, divisions IEEE-rounded);
    `prefill-<dtype>`: SmolLM2's heads over a 7k-token context held in it, against dense attention."""
    cache_dtype = KV_DTYPE_CASES[name]
    error = None
    try:
        if name.startswith("store"):
            gen = torch.Generator().manual_seed(0)
            key = (torch.randn(4096, 8, 128, generator=gen) * 8).to(torch.bfloat16).to(device)
            value = torch.randn(4096, 8, 128, generator=gen).to(torch.bfloat16).to(device)
            key[0, 0, :2] = torch.tensor([1e6, -1e6])
            slots = torch.randperm(256 * 16, generator=gen)[:4096].to(device)
            kv_cache = torch.zeros(256, 2, 2, 16, 8, row_width(128, str(cache_dtype)), dtype=cache_dtype,
                                   device=device)
            expected = kv_cache.clone()
            store_kv(key, value, kv_cache, 1, slots)
            reference_store_kv(key, value, expected, 1, slots)
            assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8)), "differs from the torch reference"
        else:
            num_heads, num_kv_heads, head_dim = CUDA_HEAD_SHAPES["smollm2"]
            problem = make_paged_problem(CUDA_BATCHES["question-7k"], num_heads=num_heads, num_kv_heads=num_kv_heads,
                                         head_dim=head_dim, block_size=BLOCK_SIZE, dtype=torch.bfloat16)
            problem = narrow_cache_problem(problem, cache_dtype).to(device)
            out = prefix_prefill(*problem.args())
            torch.testing.assert_close(out.double(), naive_attention(problem), atol=1.6e-2, rtol=1.6e-2)
        torch.cuda.synchronize(device)
    except Exception as exc:
        error = f"{type(exc).__name__}: " + "\n".join(str(exc).splitlines()[:6])
    return {"case": name, "error": error}


def run_layer_ops_case(name: str, device: torch.device) -> dict:
    """`layer-ops-<model>-<dtype>-<tokens>`: the residual add and RMSNorm, rotary over the q and k heads of a qkv
    product, and SiLU-and-multiply, compiled, against their torch references on the same GPU."""
    model, dtype_name, tokens = name.removeprefix("layer-ops-").rsplit("-", 2)
    dtype, num_tokens = CUDA_DTYPES[dtype_name], int(tokens)
    hidden, intermediate = LAYER_WIDTHS[model]
    heads, kv_heads, head_dim = CUDA_HEAD_SHAPES[model]
    error = None
    try:
        gen = torch.Generator().manual_seed(0)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

        x, residual, weight = randn(num_tokens, hidden), randn(num_tokens, hidden, scale=8.0), randn(hidden)
        for got, want in zip(layer_ops.rms_norm(x, weight, 1e-5, residual),
                             layer_ops.reference_rms_norm(x, weight, 1e-5, residual)):
            torch.testing.assert_close(got, want, **TOLERANCE[dtype])
        qkv = randn(num_tokens, (heads + 2 * kv_heads) * head_dim, scale=2.0)
        qk = qkv[:, :(heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim)
        angles = torch.rand(num_tokens, head_dim // 2, generator=gen).repeat(1, 2) * 1000
        cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
        torch.testing.assert_close(layer_ops.rotary(qk, cos, sin), layer_ops.reference_rotary(qk, cos, sin),
                                   **TOLERANCE[dtype])
        gate_up = randn(num_tokens, 2 * intermediate, scale=4.0)
        torch.testing.assert_close(layer_ops.silu_and_mul(gate_up), layer_ops.reference_silu_and_mul(gate_up),
                                   **TOLERANCE[dtype])
        torch.cuda.synchronize(device)
    except Exception as exc:
        error = f"{type(exc).__name__}: " + "\n".join(str(exc).splitlines()[:6])
    return {"case": name, "error": error}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET to run compiled kernels"
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    device = torch.device("cuda")
    print(json.dumps({"device": torch.cuda.get_device_name(device), "sms": sm_count(device)}), flush=True)
    # What the engine runs first (its own choice of splits, bf16 before the rest), then the layer parts and the
    # narrow caches, then the splits forced: a check stopped at its deadline has covered the most used.
    chosen = sorted((c for c in CUDA_CASES if c.splits == "auto"), key=lambda c: c.dtype != "bf16")
    for case in chosen:
        print(json.dumps(run_case(case, device)), flush=True)
        torch.cuda.empty_cache()
    for name in LAYER_OPS_CASES:
        print(json.dumps(run_layer_ops_case(name, device)), flush=True)
    for name in KV_DTYPE_CASES:
        print(json.dumps(run_kv_dtype_case(name, device)), flush=True)
    for case in (c for c in CUDA_CASES if c.splits != "auto"):
        print(json.dumps(run_case(case, device)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
