"""The startup benchmark (`benchmarks/host.py startup`): one round of a first start (it converts the GGUF) and a
later one (it reads the copy), each in a process of its own, that name the same model, and a report with a row for
each. The third kind, a GGUF load that keeps no copy, is the first start's load without the save."""
import json

import pytest

from benchmarks import host
from benchmarks.suites.host import startup


@pytest.mark.slow
def test_one_round_times_a_first_and_a_later_start(tmp_path):
    assert host.main(["startup", "--rounds", "1", "--kinds", "first,later", "--out-dir", str(tmp_path)]) == 0
    report = (tmp_path / "startup.md").read_text()
    assert "| first start / this (load_model) |" in report
    for kind in ("first", "later"):
        assert f"| {startup.KINDS[kind]} |" in report
    assert startup.KINDS["gguf"] not in report
    runs = json.loads((tmp_path / "startup.json").read_text())["runs"]
    first, later = runs["first"][0], runs["later"][0]
    assert first["identity"] == later["identity"]
    # a first start reads back the copy it wrote: it runs the weight modules every later start runs
    assert first["weights_in"] == later["weights_in"] == "CausalLM"


def test_unknown_kinds_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        host.main(["startup", "--kinds", "first,warm"])
    assert exit_.value.code == 2
    assert "--kinds: expected some of gguf, first, later, got 'first,warm'" in capsys.readouterr().err
