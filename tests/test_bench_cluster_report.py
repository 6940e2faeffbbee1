"""The cluster suite's report explains its TTFT ratio: each request is filed under where most of its prompt came
from, so a reader sees whether the median request of each policy was a local hit, a remote or disk hit, or
computed."""
from __future__ import annotations

import logging

from benchmarks.lib.cluster_stack import health_changes
from benchmarks.lib.cluster_workload import Outcome, main_source, summary
from kvstrata.cli import LOG_FORMAT
from kvstrata.engine.config import ReplicaConfig
from kvstrata.serving.router import Replica, set_health


def outcome(prompt_tokens: int, ttft_s: float, **cached) -> Outcome:
    return Outcome(doc="d", question="q", sent_s=0.0, status=200, ttft_s=ttft_s, done=True, verdict="correct",
                   prompt_tokens=prompt_tokens, cached_by_tier=cached)


def test_a_request_is_filed_under_the_source_of_most_of_its_prompt():
    assert main_source(outcome(100, 0.1, device=48, cpu=32)) == "local"  # device and CPU together
    assert main_source(outcome(100, 0.1, device=16, remote=80)) == "remote"
    assert main_source(outcome(100, 0.1, disk=64)) == "disk"
    assert main_source(outcome(100, 0.1, device=16)) == "computed"  # a shared chat-template block is no hit
    assert main_source(outcome(100, 0.1)) == "computed"


def test_the_summary_gives_each_source_its_requests_and_median_ttft():
    outcomes = [outcome(100, 0.1, device=96), outcome(100, 0.3, device=96), outcome(100, 0.2, cpu=96),
                outcome(100, 0.5, remote=96), outcome(100, 4.0)]
    by_source = summary(outcomes, wall_s=10.0)["ttft_by_source"]
    assert by_source["local"] == {"requests": 3, "ttft_p50_s": 0.2}
    assert by_source["remote"] == {"requests": 1, "ttft_p50_s": 0.5}
    assert by_source["disk"] == {"requests": 0, "ttft_p50_s": None}
    assert by_source["computed"] == {"requests": 1, "ttft_p50_s": 4.0}


def test_the_routers_own_log_says_to_the_millisecond_when_it_took_a_replica_out_and_back(caplog):
    # The suite's samples come a second apart, coarser than the health interval the recovery is judged against.
    replica = Replica(ReplicaConfig(url="http://127.0.0.1:8001"), subscriber=None)
    with caplog.at_level(logging.WARNING, logger="kvstrata"):
        set_health(replica, False)
        set_health(replica, False)  # no change, no line
        set_health(replica, True)
    lines = ["noise", *(logging.Formatter(LOG_FORMAT).format(r) for r in caplog.records)]
    wall0 = caplog.records[0].created - 2.0
    changes = health_changes(lines, wall0)
    assert [(url, state) for _, url, state in changes] == [(replica.url, "out"), (replica.url, "back")]
    assert abs(changes[0][0] - 2.0) < 0.002


def test_a_replica_the_router_took_out_within_the_logs_millisecond_of_its_kill_is_timed_not_missed():
    from benchmarks.suites.cluster.run import recovery_times

    url = "http://127.0.0.1:8001"
    events = [(35.2, "kvstrata replica killed"), (50.0, "replica listening")]
    # an in-flight stream reset at once: the log's time, cut to the millisecond, reads a little before the kill
    router_health = [(35.1995, url, "out"), (50.25, url, "back")]
    found = recovery_times([], router_health, events, [], url, "http://127.0.0.1:8002")
    assert found["router_takes_replica_out_s"] == 0.0
    assert abs(found["router_routes_to_it_again_s"] - 0.25) < 1e-9
