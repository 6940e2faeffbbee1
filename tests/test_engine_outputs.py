"""Model-level guarantees on the embedded model (CPU, float32): caching never changes outputs.

Every test compares against an engine with prefix caching off: greedy tokens must be identical and
the first token's logits within 1e-4 relative, whichever tier served the prefix.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvstrata import LLM, SamplingParams, load_config
from kvstrata.engine import llm_engine
from kvstrata.engine.async_engine import EngineSnapshot
from kvstrata.engine.model_loader import EMBEDDED_MODEL, load_model, resolve_model
from kvstrata.serving.metrics import ServingMetrics
from kvstrata.tiers.names import TIER_NAMES
from server_process import metric_value

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def document(name: str, chars: int = 1100) -> str:
    """A real long document from the development set's source (cut so the CPU prefills it quickly)."""
    from pydoc_data.topics import topics
    return topics[name][:chars]


def chat(doc: str, question: str) -> list[dict]:
    return [{"role": "user", "content": f"{doc}\n\nAnswer briefly. {question}"}]


DOCS = {name: document(name) for name in ("try", "import", "execmodel")}
QUESTIONS = ["What is this section about?", "Name one keyword it explains."]


@pytest.fixture(scope="module")
def loaded():
    return load_model(resolve_model(EMBEDDED_MODEL), torch.float32, "cpu")


def config(tmp_path: Path, **cache_overrides) -> dict:
    cache = {
        "enable_prefix_caching": True,
        "block_size": 16,
        "tiers": {"device": {"size": 48}, "cpu": {"size": 24}, "disk": {"path": str(tmp_path / "kv"), "size": "256MiB"}},
        "offload": "write_through",
    }
    cache.update(cache_overrides)
    return {"model": {"dtype": "float32", "device": "cpu"}, "cache": cache,
            "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 8}}


class FirstTokenLogits:
    """Records the logits each `generate` call sampled its first token from (one request per call)."""

    def __init__(self, monkeypatch):
        self.rows: list[torch.Tensor] = []
        original = llm_engine.sample

        def recording_sample(logits, params, generators):
            self.rows.append(logits.detach().clone())
            return original(logits, params, generators)

        monkeypatch.setattr(llm_engine, "sample", recording_sample)

    def run(self, llm: LLM, messages) -> tuple[list[int], torch.Tensor]:
        start = len(self.rows)
        out = llm.chat(messages, GREEDY)[0]
        return out, self.rows[start][0]


@pytest.fixture(scope="module")
def reference(loaded, tmp_path_factory):
    """Greedy outputs and first-token logits with prefix caching off."""
    llm = LLM(load_config(config(tmp_path_factory.mktemp("ref"), enable_prefix_caching=False)), loaded_model=loaded)
    results = {}
    mp = pytest.MonkeyPatch()
    rec = FirstTokenLogits(mp)
    for name, doc in DOCS.items():
        for q in QUESTIONS:
            out, logits = rec.run(llm, chat(doc, q))
            assert out.cached_tokens == 0
            results[(name, q)] = (out.token_ids, logits)
    mp.undo()
    llm.close()
    return results


def assert_same_as_reference(reference, key, out, logits):
    ref_tokens, ref_logits = reference[key]
    assert out.token_ids == ref_tokens, f"{key}: tokens differ with cache hits {out.cached_tokens_by_tier}"
    rel = (logits - ref_logits).norm() / ref_logits.norm()
    assert rel < 1e-4, f"{key}: first-token logits differ by {rel:.2e} relative"


def test_hits_from_device_cpu_and_disk_give_the_uncached_outputs(loaded, reference, tmp_path, monkeypatch):
    llm = LLM(load_config(config(tmp_path)), loaded_model=loaded)
    rec = FirstTokenLogits(monkeypatch)
    hierarchy = llm.engine.hierarchy
    outs = []
    run = rec.run

    def recorded_run(llm_, messages):
        out_, logits_ = run(llm_, messages)
        outs.append(out_)
        return out_, logits_

    rec.run = recorded_run
    key = ("try", QUESTIONS[0])
    out, logits = rec.run(llm, chat(DOCS["try"], key[1]))
    assert out.cached_tokens == 0
    assert_same_as_reference(reference, key, out, logits)

    # 1. device: the document is still in the device pool
    out, logits = rec.run(llm, chat(DOCS["try"], key[1]))
    assert out.cached_tokens_by_tier["device"] > 0 and out.cached_tokens_by_tier["cpu"] == 0
    assert_same_as_reference(reference, key, out, logits)

    # 2. cpu: drop the device's cached blocks; write-through put them in the CPU tier
    assert hierarchy.clear_device_cache()
    out, logits = rec.run(llm, chat(DOCS["try"], key[1]))
    assert out.cached_tokens_by_tier["cpu"] > 0 and out.cached_tokens_by_tier["device"] == 0
    assert_same_as_reference(reference, key, out, logits)

    # 3. disk: the CPU tier (24 blocks) spills the document to disk while others are asked
    for name in ("import", "execmodel"):
        rec.run(llm, chat(DOCS[name], QUESTIONS[0]))
    hierarchy.cpu.clear()
    assert hierarchy.clear_device_cache()
    out, logits = rec.run(llm, chat(DOCS["try"], key[1]))
    assert out.cached_tokens_by_tier["disk"] > 0, out.cached_tokens_by_tier
    assert_same_as_reference(reference, key, out, logits)
    # every counter counts what the requests were told, once per request, in its unit
    stats = llm.stats()
    served = {t: sum(o.cached_tokens_by_tier[t] for o in outs) for t in TIER_NAMES}
    assert stats["prefix_cache"]["hit_tokens"] == served
    assert stats["prefix_cache"]["query_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    assert stats["tiers"]["device"]["hits"] == served["device"] // 16
    assert stats["promotions"] == {"cpu": served["cpu"] // 16, "disk": served["disk"] // 16, "remote": 0}
    assert stats["promotions"]["disk"] > 0 and stats["promotions"]["cpu"] > 0
    assert stats["promotion_failures"] == 0
    # the disk hit was read by the disk tier's reader processes, into the host KV cache they share
    disk = stats["tiers"]["disk"]
    assert 0 < disk["extra"]["blocks_read_by_processes"] <= disk["hits"]
    llm.close()


def test_interleaved_documents_under_pressure_match_uncached_outputs(loaded, reference, tmp_path, monkeypatch):
    """A device tier far smaller than the working set, both write-down policies."""
    for offload in ("write_through", "on_evict"):
        llm = LLM(load_config(config(tmp_path / offload, offload=offload)), loaded_model=loaded)
        rec = FirstTokenLogits(monkeypatch)
        seen_tiers = set()
        for q in QUESTIONS:
            for name, doc in DOCS.items():
                out, logits = rec.run(llm, chat(doc, q))
                assert_same_as_reference(reference, (name, q), out, logits)
                seen_tiers |= {t for t, n in out.cached_tokens_by_tier.items() if n}
        assert "cpu" in seen_tiers or "disk" in seen_tiers, f"{offload}: no lower-tier hit under pressure"
        llm.close()


def test_requests_sharing_a_document_in_one_call_compute_it_once(loaded, reference, tmp_path, monkeypatch):
    llm = LLM(load_config(config(tmp_path, tiers={"device": {"size": 200}})), loaded_model=loaded)
    computed = []
    original = llm.engine.runner.execute

    def counting_execute(step):
        computed.append(len(step.input_ids))
        return original(step)

    monkeypatch.setattr(llm.engine.runner, "execute", counting_execute)
    outs = llm.chat([chat(DOCS["import"], q) for q in QUESTIONS], GREEDY)
    for q, out in zip(QUESTIONS, outs):
        assert out.token_ids == reference[("import", q)][0]
    assert outs[0].cached_tokens == 0
    assert outs[1].cached_tokens >= 16 * 10, "the second request did not share the document's blocks"
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    decode_tokens = sum(len(o.token_ids) - 1 for o in outs)
    assert sum(computed) == prompt_tokens - outs[1].cached_tokens + decode_tokens
    llm.close()


def test_chunked_prefill_and_preemption_do_not_change_outputs(loaded, reference, tmp_path):
    # chunks of 64 tokens, and a pool so small that three running requests must preempt each other
    cfg = config(tmp_path, tiers={"device": {"size": 30}})
    cfg["scheduler"] = {"max_num_batched_tokens": 64, "max_num_seqs": 3}
    llm = LLM(load_config(cfg), loaded_model=loaded)
    keys = [(name, QUESTIONS[1]) for name in DOCS]
    outs = llm.chat([chat(DOCS[n], q) for n, q in keys], GREEDY)
    for key, out in zip(keys, outs):
        assert out.token_ids == reference[key][0], key
    assert any(o.num_preemptions for o in outs), "the pool was meant to be too small for all three at once"
    assert llm.engine.hierarchy.pool.num_free_blocks == llm.engine.hierarchy.pool.num_blocks
    # the server's scrape counts every preemption the requests went through, as vLLM's counter does
    scrape = ServingMetrics(lambda: EngineSnapshot(llm.stats(), 0, 0), model_name="m",
                            max_model_len=llm.engine.max_model_len).render().decode()
    labels = 'engine="0",model_name="m"'
    assert metric_value(scrape, "vllm:num_preemptions_total", labels) == sum(o.num_preemptions for o in outs)
    llm.close()


def test_bad_requests_fail_before_any_work(loaded, tmp_path):
    llm = LLM(load_config(config(tmp_path)), loaded_model=loaded)
    pool = llm.engine.hierarchy.pool
    free_before = pool.num_free_blocks
    too_long = list(range(1, 100)) * 83  # 8217 tokens > 8192
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1, 2, 3], too_long], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"role": "user"}], GREEDY)
    assert pool.num_free_blocks == free_before
    assert not llm.engine.has_unfinished_requests()
    # and the engine still serves
    assert llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0))[0].token_ids
    llm.close()


def test_a_second_process_gets_disk_hits_for_a_document_the_first_saw(loaded, reference, tmp_path):
    cfg = config(tmp_path)
    key = ("execmodel", QUESTIONS[0])
    llm = LLM(load_config(cfg), loaded_model=loaded)
    first = llm.chat(chat(DOCS[key[0]], key[1]), GREEDY)[0]
    assert first.cached_tokens == 0
    llm.close()  # writes the cache down to disk

    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from test_engine_outputs import DOCS, GREEDY, chat
        from kvstrata import LLM, load_config
        llm = LLM(load_config(json.loads({json.dumps(json.dumps(cfg))})))
        out = llm.chat(chat(DOCS[{key[0]!r}], {key[1]!r}), GREEDY)[0]
        print(json.dumps({{"tiers": out.cached_tokens_by_tier, "tokens": out.token_ids}}))
        llm.close()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tiers"]["disk"] >= 16 * (len(first.prompt_token_ids) // 16 - 1)
    assert result["tokens"] == reference[key][0]


def test_stop_strings_and_seeds_behave_like_openai(loaded, tmp_path):
    llm = LLM(load_config(config(tmp_path)), loaded_model=loaded)
    messages = chat(DOCS["try"], QUESTIONS[0])
    full = llm.chat(messages, SamplingParams(max_tokens=16, temperature=0))[0]
    assert full.finish_reason in ("length", "stop") and full.text
    # stop at the second word of the greedy answer: text ends before it, finish_reason "stop"
    words = full.text.split()
    assert len(words) >= 2
    stop = words[1]
    cut = llm.chat(messages, SamplingParams(max_tokens=16, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]
    # a seeded sampled request is reproducible, also when batched with others
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=1234)
    alone = llm.chat(messages, seeded)[0].token_ids
    batch = llm.chat([chat(DOCS["import"], QUESTIONS[0]), messages],
                     [SamplingParams(max_tokens=6, temperature=1.0), seeded])
    assert batch[1].token_ids == alone
    llm.close()


def test_both_scheduling_policies_give_the_uncached_outputs(loaded, reference, tmp_path):
    """Reordering never changes an answer: two documents and a second question on one of them, sent
    at once, in steps small enough that their prefills interleave and are reordered."""
    keys = [("try", QUESTIONS[0]), ("import", QUESTIONS[0]), ("try", QUESTIONS[1])]
    for policy in ("fcfs", "uncached_first"):
        cfg = config(tmp_path / policy)
        cfg["scheduler"] = {"max_num_batched_tokens": 128, "max_num_seqs": 8, "policy": policy}
        llm = LLM(load_config(cfg), loaded_model=loaded)
        outs = llm.chat([chat(DOCS[name], q) for name, q in keys], GREEDY)
        for key, out in zip(keys, outs):
            assert out.token_ids == reference[key][0], (policy, key)
        assert outs[2].cached_tokens > 0, f"{policy}: the second question did not reuse its document"
        llm.close()


@pytest.mark.parametrize("kv_cache_dtype, kept_as, share_of_fp32", [
    ("fp8", "float8_e4m3fn", 1 / 4),
    ("int8", "int8", 68 / 256),  # a row of 64 one-byte values and its 4-byte scale, against 64 x 4 bytes
])
def test_a_narrow_cache_holds_fewer_bytes_and_in_batch_invariant_mode_gives_the_uncached_outputs(
        loaded, tmp_path, kv_cache_dtype, kept_as, share_of_fp32):
    """fp8 and int8 K/V are lossy against the model's own (benchmarks/results/kv_cache_dtype.md), but the
    same bytes whichever tier serves them: with batch-invariant reductions (the K/V of a document do not
    depend on the prefill that computed them) a hit from the device, the CPU or the disk gives the
    uncached narrow engine's answer, log-probabilities bit for bit (int8: the scales travel with the rows)."""
    greedy = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)
    narrow = {"kv_cache_dtype": kv_cache_dtype}
    engines = [LLM(load_config(config(tmp_path / name, enable_prefix_caching=caching, **narrow),
                               {"model.batch_invariant": True}), loaded_model=loaded)
               for name, caching in (("cached", True), ("uncached", False))]
    llm, uncached = engines
    assert llm.stats()["block_bytes"] == share_of_fp32 * LLM(load_config(config(tmp_path / "fp32")),
                                                             loaded_model=loaded).stats()["block_bytes"]
    assert llm.stats()["kv_cache_dtype"] == kept_as
    messages = chat(DOCS["try"], QUESTIONS[1])
    expected = uncached.chat(messages, greedy)[0]
    assert llm.chat(chat(DOCS["try"], QUESTIONS[0]), greedy)[0].cached_tokens == 0
    hierarchy = llm.engine.hierarchy
    for tier in ("device", "cpu", "disk"):
        if tier == "cpu":
            assert hierarchy.clear_device_cache()
        if tier == "disk":  # the CPU tier (24 blocks) spills the document to disk while others are asked
            for name in ("import", "execmodel"):
                llm.chat(chat(DOCS[name], QUESTIONS[0]), SamplingParams(max_tokens=1))
            hierarchy.cpu.clear()
            assert hierarchy.clear_device_cache()
        out = llm.chat(messages, greedy)[0]
        assert out.cached_tokens_by_tier[tier] > 0, (tier, out.cached_tokens_by_tier)
        assert out.token_ids == expected.token_ids
        assert [e.logprob for e in out.logprobs] == [e.logprob for e in expected.logprobs]
    for engine in engines:
        engine.close()
