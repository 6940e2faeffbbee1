"""The presence benchmark end to end, quickly: every tier answers `held` and `count_prefix` for the whole
document (the benchmark asserts it) and the table has a row per lower tier."""
from benchmarks import presence


def test_presence_benchmark_measures_every_lower_tier(capsys):
    assert presence.main(["--repeats", "1", "--no-write"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "tier" not in line]
    assert [row.split(" | ")[0] for row in rows] == ["| cpu", "| disk", "| remote"]
