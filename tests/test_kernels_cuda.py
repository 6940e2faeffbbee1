"""The Triton kernels compiled for a real GPU, on realistic shapes (`pytest -m cuda`; skipped without CUDA).

The tests' process runs kernels through the interpreter (conftest sets TRITON_INTERPRET=1 before they are defined),
so the compiled kernels run in one child process, gpu_kernel_check.py, which checks every case of
kernel_cases.CUDA_CASES against dense float64 attention and the torch reference, the narrow caches, and the fused
layer parts against their references; each test reads one case's result."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from kernel_cases import CUDA_CASES, CUDA_LONG_CONTEXT_BATCHES, KV_DTYPE_CASES, LAYER_OPS_CASES

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.lib.child_runs import run_until  # noqa: E402
from benchmarks.suites.gpu.report import CUDA_CHECK_DEADLINE_ENV  # noqa: E402

pytestmark = pytest.mark.cuda
ALL_CASES = [c.name for c in CUDA_CASES] + list(KV_DTYPE_CASES) + LAYER_OPS_CASES


# By default the check stops after this long; the GPU report sets its deadline (CUDA_CHECK_DEADLINE_ENV) from its
# tests section's limit: the cases run by then are reported, the others fail as not reached, where a check killed
# with pytest reported none.
CHECK_TIMEOUT_S = 1800


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("gpu_kernel_check.py")
    deadline = float(os.environ.get(CUDA_CHECK_DEADLINE_ENV, time.time() + CHECK_TIMEOUT_S))
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
    with open(stderr_path, "w+") as stderr:
        run = run_until(command, env, deadline, stderr=stderr)
        stderr.seek(0)
        assert run.returncode == 0 or run.stopped, stderr.read()[-3000:]
    return run.lines, run.stopped


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
