"""Sides timed against each other take turns within every round (a load that comes and goes then falls on all of
them alike), each round beginning with the next side (none always runs first, in caches the others filled): the
kernel suites once timed every round of one side before the other's."""
import time

from benchmarks.lib.cpu_timing import best_cpu_times, clock_for


def test_the_sides_take_turns_every_round_each_round_led_by_the_next_after_one_untimed_call_each():
    calls = []
    times = best_cpu_times({"this": lambda: calls.append("this"), "baseline": lambda: calls.append("baseline")},
                           repeats=3, calls=2)
    assert calls == ["this", "baseline"] + ["this", "this", "baseline", "baseline"] + \
        ["baseline", "baseline", "this", "this"] + ["this", "this", "baseline", "baseline"]
    assert set(times) == {"this", "baseline"} and all(t >= 0 for t in times.values())


def test_several_threads_are_timed_by_the_wall_clock_where_waiting_for_the_others_counts():
    """Process CPU time adds up the threads' time and leaves out a wait: a call of several threads that ends
    waiting for one of them would read shorter than the caller waited."""
    def wait():
        time.sleep(0.02)

    assert clock_for(1) is time.process_time
    assert best_cpu_times({"wait": wait}, repeats=2, clock=clock_for(2))["wait"] >= 0.015
    assert best_cpu_times({"wait": wait}, repeats=2, clock=clock_for(1))["wait"] < 0.01
