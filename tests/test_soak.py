"""The randomized soak of the engine core (benchmarks/soak.py): a few hundred seeds, each a workload of
arrivals, aborts and preemptions in every phase, resets, pins, failing and slow reads, with the
invariants checked after every step."""
from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest

from benchmarks import soak


@pytest.mark.parametrize("first_seed", range(0, 300, 50))
def test_random_workloads_keep_every_invariant_and_end_every_request_once(first_seed):
    stats = soak.SoakStats()
    failures = {seed: soak.run_seed(seed, 30, stats) for seed in range(first_seed, first_seed + 50)}
    assert {seed: f for seed, f in failures.items() if f is not None} == {}
    assert stats.steps >= 50 * 30 and stats.requests > 50 * 5 and sum(stats.faults.values()) > 50


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
