"""The disk read scaling benchmark (`benchmarks/tiers.py disk-readers`; its run end to end is in
test_bench_suites.py): a record that fails the readers' checks fails the run."""
from benchmarks.suites.tiers import disk_readers as disk_read_scaling


def test_a_record_that_fails_the_checks_fails_the_run_in_one_line_without_waiting(tmp_path):
    import pytest

    store = disk_read_scaling.build_store(str(tmp_path / "store"), "SmolLM2-135M", 8 * 368640)
    store["heads"][5] = bytes(len(store["heads"][5]))  # block 5 is expected to be another block
    with pytest.raises(RuntimeError, match="^a reader process failed: RecordError"):
        disk_read_scaling.measure(str(tmp_path / "store"), store, processes=2)
