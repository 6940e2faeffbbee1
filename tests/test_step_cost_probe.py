"""The engine's start-up probe of its step cost: on a GPU a fresh engine prices its first steps from timed
runs of its own model (not the CPU-sized guess the cost starts from, 100x off there), and the probe
leaves the device pool as it found it. A CPU is spared the probe (the guess fits it); the tests turn it
on for the CPU to run the same code a GPU runs."""
from __future__ import annotations

import pytest
import torch

from kvstrata import SamplingParams, load_config
from kvstrata.engine import llm_engine
from kvstrata.engine.llm_engine import LLMEngine


@pytest.fixture
def probe_on_cpu(monkeypatch):
    monkeypatch.setitem(llm_engine.PROBE_TOKENS, "cpu", 64)


def tiny_engine(tmp_path, **scheduler) -> LLMEngine:
    return LLMEngine(load_config({"model": {"name": "tiny-llama", "load_format": "dummy", "device": "cpu",
                                            "dtype": "float32"},
                                  "cache": {"tiers": {"device": {"size": 256}, "cpu": {"size": 0},
                                                      "disk": {"path": str(tmp_path / "kv"), "size": 0}}},
                                  "scheduler": scheduler}))


def test_on_a_cpu_the_engine_starts_from_the_guess_without_a_probe(tmp_path):
    engine = tiny_engine(tmp_path)
    try:
        assert engine.kv_manager.step_cost.fit.num_observations == 0
    finally:
        engine.close()


def test_a_fresh_engine_has_timed_its_model_and_left_the_pool_as_it_was(tmp_path, probe_on_cpu):
    engine = tiny_engine(tmp_path)
    try:
        cost = engine.kv_manager.step_cost
        assert cost.fit.num_observations == 4  # two prefills, a decode over the longer, a short prefill
        assert cost.fit.coef != cost.fit.prior  # the runs priced the steps, not the guess
        pool = engine.hierarchy.pool
        assert pool.num_free_blocks == pool.num_blocks and pool.num_cached_blocks == 0  # nothing kept
    finally:
        engine.close()


def test_a_long_prompt_alone_on_a_fresh_engine_is_prefilled_in_one_step_when_the_speed_allows(tmp_path,
                                                                                             probe_on_cpu):
    engine = tiny_engine(tmp_path, max_num_batched_tokens=2048)
    try:
        prompt = [int(t) for t in torch.randint(100, 40000, (1500,), generator=torch.Generator().manual_seed(0))]
        engine.add_request("long", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        # priced by the CPU-sized guess (2 ms a token) the step cap would have cut it into ~8 steps
        assert steps == 1
    finally:
        engine.close()


def greedy_tokens(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request("q", prompt, SamplingParams(max_tokens=8, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.requests["q"].output_token_ids


def test_what_the_probe_wrote_into_free_blocks_never_reaches_an_answer(tmp_path, monkeypatch):
    prompt = list(range(300, 700))
    unprobed = tiny_engine(tmp_path / "a")
    try:
        expected = greedy_tokens(unprobed, prompt)
    finally:
        unprobed.close()
    monkeypatch.setitem(llm_engine.PROBE_TOKENS, "cpu", 64)
    probed = tiny_engine(tmp_path / "b")
    try:
        assert probed.kv_manager.step_cost.fit.num_observations == 4
        assert greedy_tokens(probed, prompt) == expected
    finally:
        probed.close()
