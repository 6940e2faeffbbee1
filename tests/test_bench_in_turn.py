"""A baseline checkout lends the benchmarks its `kvstrata` and nothing else (benchmarks/lib/in_turn.py), whether
its kvstrata/ links the engine, tiers and kernels folders into itself (as this tree does) or not (older commits):
the first kind once failed with "File exists" before anything was timed."""
import os
import subprocess
import sys

import pytest

from benchmarks.lib.in_turn import import_root_of

PYPROJECT = """[tool.setuptools.package-dir]
"kvstrata" = "kvstrata"
"kvstrata.engine" = "engine"
"""


@pytest.mark.parametrize("linked", [True, False])
def test_a_baseline_checkout_lends_its_kvstrata_alone(tmp_path, linked):
    tree = tmp_path / "checkout"
    (tree / "kvstrata").mkdir(parents=True)
    (tree / "engine").mkdir()
    (tree / "benchmarks").mkdir()
    (tree / "pyproject.toml").write_text(PYPROJECT)
    (tree / "kvstrata" / "__init__.py").write_text("")
    (tree / "engine" / "__init__.py").write_text("WHERE = 'the baseline'\n")
    (tree / "benchmarks" / "__init__.py").write_text("")
    if linked:
        (tree / "kvstrata" / "engine").symlink_to("../engine")
    root = import_root_of(tree, tmp_path / "root")
    assert sorted(p.name for p in root.iterdir()) == ["kvstrata"], "the baseline's benchmarks would shadow this tree's"
    done = subprocess.run([sys.executable, "-c", "import kvstrata.engine as e; print(e.WHERE)"], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "the baseline"
