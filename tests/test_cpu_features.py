"""One CPU probe (kernels/cpu_features.py) for the engine's `dtype: auto` and the kernels' batch-invariant tiles:
they agree on every CPU, one override forces both, and the kernels read it without importing the engine."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvstrata.engine.config import load_config, probes
from kvstrata.kernels import batch_invariant, cpu_features


@pytest.mark.parametrize("forced, family, dtype", [("1", "amx", "bfloat16"), ("0", None, "float32")])
def test_the_amx_override_moves_the_engines_dtype_and_the_kernels_tile_together(monkeypatch, forced, family, dtype):
    monkeypatch.setenv(cpu_features.AMX_OVERRIDE_VARIABLE, forced)
    assert load_config({"model": {"device": "cpu"}}).resolved_dtype() == dtype
    isa = batch_invariant.cpu_matrix_isa()
    assert isa == family if family else isa in ("avx512", "avx2")
    assert batch_invariant.linear_tile_rows(torch.bfloat16) == batch_invariant.LINEAR_TILE_ROWS[(isa, torch.bfloat16)]


def test_without_the_override_both_read_the_same_flags(monkeypatch):
    monkeypatch.delenv(cpu_features.AMX_OVERRIDE_VARIABLE, raising=False)
    assert (batch_invariant.cpu_matrix_isa() == "amx") == probes.cpu_has_amx()


@pytest.mark.parametrize("flags, amx, family", [
    ({"avx2", "fma"}, False, "avx2"),
    ({"avx512f", "avx512_bf16"}, False, "avx512"),
    ({"avx512f", "amx_tile", "amx_bf16"}, True, "amx"),
    ({"avx512f", "amx_tile", "amx_bf16"}, False, "avx512"),  # a kernel that refuses the tile state, or forced off
    (None, False, "avx2"),                                   # no /proc/cpuinfo
])
def test_the_matrix_family_follows_the_flags_and_the_amx_answer(flags, amx, family):
    assert cpu_features.matrix_family(flags, amx) == family
    assert cpu_features.amx_usable(flags, kernel_grants=True) == (flags is not None and cpu_features.AMX_FLAGS <= flags)


def test_the_kernels_probe_the_cpu_without_importing_the_engine():
    probe = ("import sys\nfrom kvstrata.kernels import batch_invariant\nbatch_invariant.cpu_matrix_isa()\n"
             "assert not [m for m in sys.modules if m.startswith('kvstrata.engine')]\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
