"""An engine on a GPU (`pytest -m cuda`; skipped without CUDA): caching never changes fp32 greedy outputs there either.

The tests' process runs Triton kernels through the interpreter (conftest sets TRITON_INTERPRET=1), so the engine runs
in one child process, gpu_engine_check.py, with the compiled kernels; each test reads its result."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


@pytest.fixture(scope="module")
def gpu_outputs() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("gpu_engine_check.py")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_engine_on_cuda_runs_the_compiled_triton_kernels(gpu_outputs):
    assert gpu_outputs["attention_backend"] == "triton"


@pytest.mark.parametrize("tier", ["device", "cpu"])
def test_fp32_greedy_output_with_a_hit_on_cuda_equals_caching_off(gpu_outputs, tier):
    cached, uncached = gpu_outputs[tier]["cached"], gpu_outputs[tier]["uncached"]
    assert cached["cached_tokens_by_tier"][tier] > 0, cached["cached_tokens_by_tier"]
    assert cached["token_ids"] == uncached["token_ids"]


def test_questions_and_decodes_replayed_as_cuda_graphs_give_the_eager_steps_tokens(gpu_outputs):
    graphs = gpu_outputs["cuda_graphs"]
    sizes = [tuple(size) for size in graphs["true"]["recorded_sizes"]]  # (tokens, sequences)
    assert not graphs["false"]["recorded_sizes"]
    assert any(tokens == seqs for tokens, seqs in sizes)  # decodes
    assert any(tokens > seqs for tokens, seqs in sizes)   # the step of the three questions
    assert graphs["true"]["token_ids"] == graphs["false"]["token_ids"]
