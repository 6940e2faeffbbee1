"""`benchmarks/invariance.py kv-dtype` end to end on a tiny random-weight model: every KV dtype answers every
question, a narrower block is smaller, and each format's error on the model's own K/V is measured."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_kv_cache_dtype_benchmark_compares_answers_bytes_and_kv_errors(tmp_path):
    command = [sys.executable, "benchmarks/invariance.py", "kv-dtype", "--set", "model.load_format=dummy",
               "--set", "model.name=tiny-llama", "--set", "model.dtype=float32", "--kv-dtypes", "auto,int8,fp8",
               "--docs", "1", "--doc-tokens", "200", "--max-tokens", "4", "--out-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "kv_cache_dtype.json").read_text())
    by_kv_dtype = result["by_kv_dtype"]
    assert list(by_kv_dtype) == ["auto", "int8", "fp8"]
    assert all(m["total"] > 0 for m in by_kv_dtype.values())
    auto_bytes = by_kv_dtype["auto"]["block_bytes"]
    assert by_kv_dtype["fp8"]["block_bytes"] * 4 == auto_bytes < 4 * by_kv_dtype["int8"]["block_bytes"]
    assert by_kv_dtype["auto"]["against_reference"]["same_answers"] == by_kv_dtype["auto"]["total"]
    errors = result["kv_errors"]["errors"]
    assert result["kv_errors"]["blocks"] > 0
    # bfloat16 keeps 8 mantissa bits, int8 about 7 per row, fp8 3: on any K/V their errors rank so
    for part in ("key", "value"):
        assert errors["bfloat16"][part]["mean"] < errors["int8"][part]["mean"] < errors["fp8"][part]["mean"]
    assert "| int8 |" in (tmp_path / "kv_cache_dtype.md").read_text()
