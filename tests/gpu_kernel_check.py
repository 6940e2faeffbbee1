"""Run the Triton prefix-prefill compiled for this machine's GPU over the grid of realistic shapes in
kernel_cases.CUDA_CASES (SmolLM2 and Llama-3-8B heads, contexts to 8k, bf16/fp16/fp32, split-KV chosen, off and
forced) and check each case as the interpreter tests do (`check_prefill`). Prints one JSON line per case:
`{"case", "num_splits", "error"}`, where num_splits is the automatic choice for this GPU and error is None or the
first lines of the failure. Needs CUDA and TRITON_INTERPRET unset; tests/test_kernels_cuda.py runs it:

    python tests/gpu_kernel_check.py
"""
from __future__ import annotations

import json
import os

import torch
from kernel_cases import (CUDA_BATCHES, CUDA_CASES, CUDA_DTYPES, CUDA_HEAD_SHAPES, CUDA_SPLITS, CudaCase,
                          check_prefill, make_paged_problem)

from kvstrata.kernels.prefix_prefill import choose_num_splits, sm_count

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


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET to run compiled kernels"
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    device = torch.device("cuda")
    print(json.dumps({"device": torch.cuda.get_device_name(device), "sms": sm_count(device)}), flush=True)
    for case in CUDA_CASES:
        print(json.dumps(run_case(case, device)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
