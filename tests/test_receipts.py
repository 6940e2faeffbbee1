"""Cache receipts: queue + lookup + load + prefill is the measured TTFT, whichever tier served the prefix,
however the prefill was chunked, shared or sent back (real requests on the embedded model, fp32, CPU)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvstrata import LLM, SamplingParams, load_config
from kvstrata.engine.receipt import CacheReceipt, PhaseTimes

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def document(name: str, chars: int = 900) -> str:
    from pydoc_data.topics import topics
    return topics[name][:chars]


def config(tmp_path: Path, **scheduler) -> dict:
    return {"model": {"dtype": "float32", "device": "cpu"},
            "cache": {"block_size": 16, "tiers": {"device": {"size": 64}, "cpu": {"size": 64},
                                                 "disk": {"path": str(tmp_path / "kv"), "size": "64MiB"}}},
            "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 8, **scheduler}}


def assert_adds_up(out) -> None:
    receipt = out.receipt
    assert receipt is not None
    assert receipt.ttft_ms == pytest.approx(out.ttft_s * 1e3)
    parts = (receipt.queue_ms, receipt.lookup_ms, *receipt.load_ms_by_tier.values(), receipt.prefill_ms)
    assert all(p >= 0 for p in parts), receipt
    assert abs(receipt.parts_ms - receipt.ttft_ms) <= 0.05 * receipt.ttft_ms, receipt
    assert receipt.prefill_ms > 0, "the last prompt token is always computed"
    assert receipt.cached_tokens_by_tier == out.cached_tokens_by_tier


@pytest.mark.slow
def test_a_request_sent_back_adds_up_its_phases_over_every_pass_and_splits_its_loads_by_tier():
    phases, arrival = PhaseTimes(), 100.0
    phases.enter("lookup", 101.0, arrival)         # queued 1 s
    phases.enter("load", 101.5, arrival)           # the walk: 0.5 s
    phases.load_split = {"cpu": 1.0, "disk": 3.0}  # the worker read disk three times as long
    phases.enter("queue", 103.5, arrival)          # landed, but the device was full: 2 s of load
    phases.enter("lookup", 104.0, arrival)
    phases.enter("prefill", 104.25, arrival)       # on the device now: admitted
    phases.finish(106.0, arrival)
    phases.enter("queue", 107.0, arrival)          # a preemption after the first token changes nothing
    receipt = CacheReceipt.measured(6.0, phases, {"device": 32, "cpu": 0, "disk": 0}, {"cpu": 16}, 0.5)
    assert (receipt.queue_ms, receipt.lookup_ms, receipt.prefill_ms) == pytest.approx((1500, 750, 1750))
    assert receipt.load_ms_by_tier == pytest.approx({"cpu": 500, "disk": 1500, "remote": 0})
    assert receipt.parts_ms == pytest.approx(receipt.ttft_ms) and receipt.prefill_saved_ms_estimate == 500
    assert receipt.to_dict(decimals=0)["load_ms_by_tier"] == {"cpu": 500, "disk": 1500, "remote": 0}


def test_receipts_add_up_for_a_miss_and_device_cpu_and_disk_hits(embedded_model_fp32, tmp_path):
    llm = LLM(load_config(config(tmp_path)), loaded_model=embedded_model_fp32)
    hierarchy = llm.engine.hierarchy
    prompt = document("try") + "\n\nWhat is this section about?"

    def ask():
        out = llm.generate(prompt, ONE_TOKEN)[0]
        assert_adds_up(out)
        return out, out.receipt

    _, miss = ask()
    assert miss.lookup_ms > 0 and miss.load_ms == 0 and miss.prefill_saved_ms_estimate == 0
    _, device_hit = ask()
    assert device_hit.cached_tokens_by_tier["device"] > 0 and device_hit.load_ms == 0
    assert device_hit.prefill_saved_ms_estimate > 0

    assert hierarchy.clear_device_cache()  # write-through put the blocks in the CPU tier
    _, cpu_hit = ask()
    assert cpu_hit.cached_tokens_by_tier["cpu"] > 0
    assert cpu_hit.load_ms_by_tier["cpu"] > 0 and cpu_hit.load_ms_by_tier["disk"] == 0

    hierarchy.persist()  # everything on disk, then nothing above it
    hierarchy.cpu.clear()
    assert hierarchy.clear_device_cache()
    _, disk_hit = ask()
    assert disk_hit.cached_tokens_by_tier["disk"] > 0
    assert disk_hit.load_ms_by_tier["disk"] > 0 and disk_hit.load_ms_by_tier["cpu"] == 0
    assert disk_hit.prefill_saved_ms_estimate > 0
    llm.close()


@pytest.mark.slow
def test_receipts_add_up_for_a_chunked_prefill_and_concurrent_preempted_requests(embedded_model_fp32, tmp_path):
    # 64-token chunks, and a device pool so small that three running requests preempt each other
    cfg = config(tmp_path, max_num_batched_tokens=64, max_num_seqs=3)
    cfg["cache"]["tiers"]["device"]["size"] = 30
    llm = LLM(load_config(cfg), loaded_model=embedded_model_fp32)
    long_prompt = document("import", 1400)
    (alone,) = llm.generate(long_prompt, ONE_TOKEN)
    assert len(alone.prompt_token_ids) > 4 * 64, "meant to take several chunks"
    assert_adds_up(alone)

    # three at once, in a pool too small for all three: they share steps and preempt each other (as in
    # test_engine_outputs), each receipt still partitions its own TTFT
    prompts = [document(n, 1100) + "\n\nWhy?" for n in ("try", "import", "execmodel")]
    concurrent = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), cache_salt="concurrent")
    assert any(o.num_preemptions for o in concurrent), "the pool was meant to be too small for all three at once"
    for out in concurrent:
        assert_adds_up(out)
    llm.close()


class _IdsReadLate(torch.Tensor):
    """Sampled ids whose read-back takes a while, as on a GPU, where `tolist` waits for the step's kernels."""

    read_at: list[float] = []

    def tolist(self):
        time.sleep(0.05)
        _IdsReadLate.read_at.append(time.perf_counter())
        return super().tolist()


def test_a_token_is_timed_when_its_id_is_read_back_not_when_its_step_was_launched(tmp_path, monkeypatch):
    """On a GPU the host queues a step's kernels long before the device has run them (an 8B model's 7000-token
    prefill is launched in ~25 ms and computed in over 100): a first token stamped before its id is read back
    would report the launch, and every TTFT on a GPU would be the host's time alone."""
    from kvstrata.engine import llm_engine

    real_sample = llm_engine.sample
    monkeypatch.setattr(llm_engine, "sample", lambda *args: real_sample(*args).as_subclass(_IdsReadLate))
    _IdsReadLate.read_at.clear()
    engine = llm_engine.LLMEngine(load_config({
        "model": {"name": "tiny-llama", "load_format": "dummy", "device": "cpu", "dtype": "float32"},
        "cache": {"tiers": {"device": {"size": 64}, "cpu": {"size": 0},
                            "disk": {"path": str(tmp_path / "kv"), "size": 0}}}}))
    try:
        request = engine.add_request("r", list(range(100, 140)), SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.close()
    assert len(_IdsReadLate.read_at) == 2
    assert request.first_token_time >= _IdsReadLate.read_at[0]
