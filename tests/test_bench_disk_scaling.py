"""The disk read scaling benchmark on a small store: every process reads its whole share through the readers' record
checks (a record that failed them would raise) and the figures are positive."""
from benchmarks.lib import disk_read_scaling


def test_disk_read_scaling_reads_every_share_through_the_record_checks(tmp_path):
    store = disk_read_scaling.build_store(str(tmp_path / "store"), "SmolLM2-135M", 24 * 368640)
    disk_read_scaling.warm(str(tmp_path / "store"))
    assert len(store["keys"]) == 24
    row = disk_read_scaling.measure(str(tmp_path / "store"), store, processes=2)
    assert row["processes"] == 2
    assert min(row["first_pass_gbps"], row["second_pass_gbps"], row["memory_gbps"]) > 0
    report = disk_read_scaling.report({"command": "c", "machine": "m", "source": {"commit": "x", "engine_sources_modified": []},
                                       "cpus": 2, "gib": 0.01, "rows": [{"layout": "SmolLM2-135M", **row}]})
    assert report[-1].startswith("| SmolLM2-135M | 2 |")


def test_a_record_that_fails_the_checks_fails_the_run_in_one_line_without_waiting(tmp_path):
    import pytest

    store = disk_read_scaling.build_store(str(tmp_path / "store"), "SmolLM2-135M", 8 * 368640)
    store["heads"][5] = bytes(len(store["heads"][5]))  # block 5 is expected to be another block
    with pytest.raises(RuntimeError, match="^a reader process failed: RecordError"):
        disk_read_scaling.measure(str(tmp_path / "store"), store, processes=2)
