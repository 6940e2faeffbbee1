"""The startup benchmark (`benchmarks/host.py startup`): one round of its three kinds of start, each in a process of its own, that name the same
model, and a report with a row for each."""
import pytest

from benchmarks import host
from benchmarks.lib import startup

pytestmark = pytest.mark.slow


def test_one_round_times_every_kind_of_start(tmp_path):
    assert host.main(["startup", "--rounds", "1", "--out-dir", str(tmp_path)]) == 0
    report = (tmp_path / "startup.md").read_text()
    for label in startup.KINDS.values():
        assert f"| {label} |" in report
