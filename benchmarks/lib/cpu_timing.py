"""Timing sides against each other on a CPU, in one process: each side's best time by process CPU time (a shared
machine's other processes slow a run, never speed it), the sides taking turns within every round, so that a load
that comes and goes falls on all of them alike rather than on whichever ran while it lasted; and each round begins
with the next side, so that none always runs first, in caches the others filled with their own data."""
from __future__ import annotations

import time
from typing import Callable


def best_cpu_times(fns: dict[str, Callable[[], object]], repeats: int, calls: int = 1) -> dict[str, float]:
    """Each side's least process CPU time of `calls` calls, over `repeats` rounds, in seconds per call (one untimed
    call of each first)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    sides = list(fns.items())
    for round_index in range(repeats):
        turn = round_index % len(sides)
        for side, fn in sides[turn:] + sides[:turn]:
            start = time.process_time()
            for _ in range(calls):
                fn()
            best[side] = min(best[side], (time.process_time() - start) / calls)
    return best
