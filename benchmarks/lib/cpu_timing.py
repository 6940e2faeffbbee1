"""Timing sides against each other on a CPU, in one process: each side's best time, the sides taking turns within
every round, so that a load that comes and goes falls on all of them alike rather than on whichever ran while it
lasted; and each round begins with the next side, so that none always runs first, in caches the others filled with
their own data.

One thread is timed by process CPU time: a shared machine's other processes slow a run, never speed it. Several
threads are timed by the wall clock (`clock_for`): process CPU time adds up every thread's, a thread waiting for
the others at a call's end included, so it would not say how long the caller waited."""
from __future__ import annotations

import time
from typing import Callable


def clock_for(threads: int) -> Callable[[], float]:
    """The clock to time a call on `threads` threads by: process CPU time for one, the wall clock for more."""
    return time.process_time if threads <= 1 else time.perf_counter


def best_cpu_times(fns: dict[str, Callable[[], object]], repeats: int, calls: int = 1,
                   clock: Callable[[], float] = time.process_time) -> dict[str, float]:
    """Each side's least time by `clock` (process CPU time unless told) of `calls` calls, over `repeats` rounds, in
    seconds per call (one untimed call of each first)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    sides = list(fns.items())
    for round_index in range(repeats):
        turn = round_index % len(sides)
        for side, fn in sides[turn:] + sides[:turn]:
            start = clock()
            for _ in range(calls):
                fn()
            best[side] = min(best[side], (clock() - start) / calls)
    return best
