"""The Triton kernels compiled for a real GPU, on realistic shapes (`pytest -m cuda`; skipped without CUDA).

The tests' process runs kernels through the interpreter (conftest sets TRITON_INTERPRET=1 before they are defined),
so the compiled kernels run in one child process, gpu_kernel_check.py, which checks every case of
kernel_cases.CUDA_CASES against dense float64 attention and the torch reference, the narrow caches, and the fused
layer parts against their references; each test reads one case's result."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_cases import CUDA_CASES, CUDA_LONG_CONTEXT_BATCHES, KV_DTYPE_CASES, LAYER_OPS_CASES

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def gpu_results() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("gpu_kernel_check.py")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {line["case"]: line for line in lines if "case" in line}


@pytest.mark.parametrize("case", [c.name for c in CUDA_CASES])
def test_compiled_prefill_matches_dense_attention_on_realistic_shapes(gpu_results, case):
    assert case in gpu_results, f"{case} did not run"
    assert gpu_results[case]["error"] is None, gpu_results[case]["error"]


@pytest.mark.parametrize("case", [c.name for c in CUDA_CASES
                                  if c.batch in CUDA_LONG_CONTEXT_BATCHES and c.splits == "auto"])
def test_a_short_question_over_a_long_context_is_split_across_the_gpu(gpu_results, case):
    assert gpu_results[case]["num_splits"] > 1


@pytest.mark.parametrize("case", list(KV_DTYPE_CASES))
def test_compiled_kernels_store_into_and_read_a_narrow_cache(gpu_results, case):
    assert case in gpu_results, f"{case} did not run"
    assert gpu_results[case]["error"] is None, gpu_results[case]["error"]


@pytest.mark.parametrize("case", LAYER_OPS_CASES)
def test_compiled_layer_parts_match_their_torch_references(gpu_results, case):
    assert case in gpu_results, f"{case} did not run"
    assert gpu_results[case]["error"] is None, gpu_results[case]["error"]
