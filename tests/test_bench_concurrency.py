"""The TTFT-under-concurrency benchmark: its goals (fast), and one tiny end-to-end run through
`kvstrata bench concurrency` that must measure both policies, the hits alone, and write its report (slow)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.suites.ttft.concurrency import Driver, goals, mark_joined, run_poisson  # noqa: E402
from server_process import run_bench_on_a_tiny_model  # noqa: E402


def policy(hit_p50: float, hit_p90: float, miss_p50: float, throughput: float) -> dict:
    return {"hit": {"n": 4, "p50": hit_p50, "p90": hit_p90}, "miss": {"n": 2, "p50": miss_p50},
            "throughput_tok_s": throughput}


def test_goals_compare_hits_with_hits_alone_and_misses_and_throughput_with_fcfs():
    results = {"fcfs": policy(9.0, 12.0, 10.0, 100.0), "uncached_first": policy(0.3, 1.0, 12.0, 95.0)}
    alone = {"p50": 0.2, "p90": 0.3}
    rows = dict(goals(results, alone))
    assert rows["uncached_first hit p50 / alone hit p50, at most 2x"] == "1.50x (PASS)"
    assert rows["uncached_first hit p90 / alone hit p90, at most 4x"] == "3.33x (PASS)"
    assert rows["uncached_first miss p50 / fcfs miss p50, at most 1.25x"] == "1.20x (PASS)"
    assert rows["uncached_first throughput / fcfs throughput, at least 0.9x"] == "0.95x (PASS)"
    results["uncached_first"] = policy(0.5, 1.5, 13.0, 80.0)
    assert [status.endswith("(MISS)") for _, status in goals(results, alone)] == [True, True, True, True]


def test_a_question_that_arrived_while_its_document_was_being_read_is_neither_hit_nor_miss():
    def record(doc, tier, arrival_s, ttft_s):
        return {"doc": doc, "hit_tier": tier, "arrival_s": arrival_s, "ttft_s": ttft_s}

    records = mark_joined([record(0, "miss", 0.0, 6.0),     # reads document 0 from 0 s to 6 s
                           record(0, "device", 1.0, 5.5),   # came while it was read: joined it
                           record(0, "device", 7.0, 0.2),   # came once it was cached: a hit
                           record(1, "device", 2.0, 0.2),   # another document, cached already: a hit
                           record(1, "miss", 0.5, 1.0)])
    assert [r["joined"] for r in records] == [False, True, False, False, False]


class SlowStepEngine:
    """An engine stand-in whose every step takes 0.2 s, takes its arrivals halfway (`LLMEngine.take_arrivals`)
    and finishes what it was given."""

    def __init__(self):
        self.arrivals: dict[str, float] = {}
        self.pending: list[str] = []
        self.take_arrivals = None
        self.added_mid_step: list[str] = []
        self.stepping = False

    def add_request(self, request_id, token_ids, params, arrival_time):
        self.arrivals[request_id] = arrival_time
        self.pending.append(request_id)
        if self.stepping:
            self.added_mid_step.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self):
        self.stepping = True
        time.sleep(0.1)
        if self.take_arrivals is not None:
            self.take_arrivals()
        time.sleep(0.1)
        self.stepping = False
        self.pending.clear()
        return []


def test_a_poisson_arrival_due_during_a_step_is_taken_within_it_its_ttft_counted_from_when_it_was_due():
    engine = SlowStepEngine()
    specs = [{"index": i, "doc": 0, "token_ids": [1, 2, 3]} for i in range(2)]
    run_poisson(Driver(engine, params=None), specs, plan=[0.0, 0.05])  # the second is due mid-step
    first, second = engine.arrivals["c0"], engine.arrivals["c1"]
    assert second - first == pytest.approx(0.05, abs=0.01)  # not the 0.2 s step it was sent after
    assert engine.added_mid_step == ["c1"]  # as a server takes it: in the step's shadow, not after the step


class StreamingEngine:
    """An engine stand-in: one request, a token every step, steps of 0.05 s and then one of 0.3 s."""

    def __init__(self, step_seconds: list[float]):
        self.step_seconds = list(step_seconds)
        self.request = None

    def add_request(self, request_id, token_ids, params, arrival_time):
        self.request = SimpleNamespace(request_id=request_id, is_finished=False, cached_tokens_by_tier={},
                                       ttft_s=0.0, num_prompt_tokens=len(token_ids), output_token_ids=[],
                                       receipt=None)

    def step(self):
        time.sleep(self.step_seconds.pop(0))
        self.request.output_token_ids.append(1)
        self.request.is_finished = not self.step_seconds
        return [self.request]

    def release(self, request_id):
        pass


def test_the_driver_records_how_long_each_streaming_answer_stalled_between_tokens():
    driver = Driver(StreamingEngine([0.0, 0.05, 0.3]), params=None)
    request_id = driver.submit({"index": 0, "doc": 0, "token_ids": [1, 2, 3]})
    while not driver.step():
        pass
    gaps = driver.records[request_id]["token_gaps_s"]
    assert len(gaps) == 2 and gaps[0] < 0.25 <= gaps[1]  # the long step shows as a stall


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_concurrency_cli_measures_both_policies_and_the_hits_alone(tmp_path):
    out_dir = tmp_path / "results"
    done = run_bench_on_a_tiny_model("concurrency", "configs/pressure.yaml", "--docs", "2", "--doc-tokens", "120",
                                     "--requests", "6", "--streams", "2", "--max-tokens", "2", "--threads", "1",
                                     "--out-dir", str(out_dir))
    assert done.returncode == 0, done.stderr[-3000:]

    result = json.loads((out_dir / "ttft_concurrency.json").read_text())
    assert set(result["policies"]) == {"fcfs", "uncached_first"}
    for name, records in result["records"].items():
        assert len(records) == 6, name
        assert sorted(r["index"] for r in records) == list(range(6)), name
        hits = [r for r in records if r["hit_tier"] != "miss"]
        assert 0 < len(hits) < 6, name  # the first question on each document computes it, later ones hit
        for r in records:  # where each TTFT went: the receipt's parts add up to it
            parts = sum(r["receipt"][k] for k in ("queue_ms", "lookup_ms", "load_ms", "prefill_ms"))
            assert parts == pytest.approx(1000 * r["ttft_s"], rel=0.05), (name, r)
            assert len(r["token_gaps_s"]) == r["output_tokens"] - 1  # how long the answer stalled between tokens
    assert result["outputs_equal"] is True  # reordering admissions never changes a greedy float32 answer
    assert result["hits_alone"]["n"] > 0
    assert len(result["goals"]) == 4
    report = (out_dir / "ttft_concurrency.md").read_text()
    assert "| uncached_first |" in report and "| fcfs |" in report
    assert "Machine:" in report and "Code: commit" in report and "float32" in report
