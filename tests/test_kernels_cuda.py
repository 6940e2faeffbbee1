"""The Triton kernels compiled for a real GPU, on realistic shapes (`pytest -m cuda`; skipped without CUDA).

The tests' process runs kernels through the interpreter (conftest sets TRITON_INTERPRET=1 before they are defined),
so the compiled kernels run in one child process, gpu_kernel_check.py, which checks every case of
kernel_cases.CUDA_CASES against dense float64 attention and the torch reference, the narrow caches, and the fused
layer parts against their references; each test reads one case's result."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from kernel_cases import CUDA_CASES, CUDA_LONG_CONTEXT_BATCHES, KV_DTYPE_CASES, LAYER_OPS_CASES

pytestmark = pytest.mark.cuda
ALL_CASES = [c.name for c in CUDA_CASES] + list(KV_DTYPE_CASES) + LAYER_OPS_CASES


# A time.time() by which the check stops (the GPU report sets it from its tests section's limit): the cases run
# by then are reported, the others fail as not reached, where a check killed with pytest reported none.
CHECK_DEADLINE_ENV = "KVSTRATA_CUDA_CHECK_DEADLINE"
CHECK_TIMEOUT_S = 1800


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("gpu_kernel_check.py")
    deadline = float(os.environ.get(CHECK_DEADLINE_ENV, time.time() + CHECK_TIMEOUT_S))
    lines, stopped = lines_until([sys.executable, str(script)], env, deadline,
                                 tmp_path_factory.mktemp("gpu-check") / "stderr")
    results = {line["case"]: line for line in map(json.loads, (ln for ln in lines if ln.startswith("{")))
               if "case" in line}
    for case in ALL_CASES:
        results.setdefault(case, {"case": case, "num_splits": None,
                                  "error": "not reached: the check stopped at its deadline" if stopped else
                                  "not reached: the check ended before it"})
    return results


def lines_until(command: list[str], env: dict, deadline: float, stderr_path: Path) -> tuple[list[str], bool]:
    """The command's stdout lines until it ends or `deadline` (a time.time()) passes, when it is killed; and
    whether it was stopped. A command that fails on its own fails the fixture, with the end of its stderr."""
    lines: list[str] = []
    with open(stderr_path, "w+") as stderr, subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                                             stderr=stderr, text=True) as child:
        timer = threading.Timer(max(0.0, deadline - time.time()), child.kill)
        timer.start()
        try:
            lines = [line.rstrip("\n") for line in child.stdout]
            returncode = child.wait()
        finally:
            timer.cancel()
        stopped = returncode == -signal.SIGKILL and time.time() >= deadline
        stderr.seek(0)
        assert returncode == 0 or stopped, stderr.read()[-3000:]
    return lines, stopped


@pytest.mark.parametrize("case", [c.name for c in CUDA_CASES])
def test_compiled_prefill_matches_dense_attention_on_realistic_shapes(gpu_results, case):
    assert gpu_results[case]["error"] is None, gpu_results[case]["error"]


@pytest.mark.parametrize("case", [c.name for c in CUDA_CASES
                                  if c.batch in CUDA_LONG_CONTEXT_BATCHES and c.splits == "auto"])
def test_a_short_question_over_a_long_context_is_split_across_the_gpu(gpu_results, case):
    chosen = gpu_results[case]["num_splits"]
    assert chosen is not None, gpu_results[case]["error"]
    assert chosen > 1


@pytest.mark.parametrize("case", list(KV_DTYPE_CASES))
def test_compiled_kernels_store_into_and_read_a_narrow_cache(gpu_results, case):
    assert gpu_results[case]["error"] is None, gpu_results[case]["error"]


@pytest.mark.parametrize("case", LAYER_OPS_CASES)
def test_compiled_layer_parts_match_their_torch_references(gpu_results, case):
    assert gpu_results[case]["error"] is None, gpu_results[case]["error"]
