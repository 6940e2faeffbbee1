"""Load or recompute (`cache.load_policy`): a prefix found below the device is loaded only as far as
loading beats recomputing at the measured speeds; `always_load` and `always_recompute` do what they
say; whatever is recomputed instead of loaded is counted per tier; and outputs never change.

The unit tests fix the estimates (a tier's read cost, the engine's step cost) so every choice is
deterministic; the model-level tests slow a tier down with a test wrapper (`GatedTier`) and let the
engine measure it.
"""
from __future__ import annotations

import time

import pytest
import torch
from pydoc_data.topics import topics
from test_admission import hashes_of
from test_hierarchy import BS, HASHER, computed_blocks, content_for, doc, make_stack
from tier_cases import GatedTier

from kvstrata.engine.costs import ReadCost, StepCost
from kvstrata.engine.kv_manager import KVCacheManager
from kvstrata.engine.load_policy import LoadPlan, choose_plan
from kvstrata.engine.request import Request
from kvstrata.engine.sampling import SamplingParams
from kvstrata.tiers.base import BlockLayout
from kvstrata.tiers.block_pool import BlockPool
from kvstrata.tiers.cpu import CpuTier
from kvstrata.tiers.hierarchy import TierHierarchy
from kvstrata.tiers.transfer import TransferEngine



def fast() -> ReadCost:
    return ReadCost(1024, latency_s=1e-4, per_block_s=1e-5)  # 400x faster than computing a block


def slow() -> ReadCost:
    return ReadCost(1024, latency_s=0.05, per_block_s=1.0)   # 250x slower than computing a block


def compute() -> StepCost:
    return StepCost(per_token_s=1e-3, per_pair_s=1e-7)      # ~4 ms a block of BS=4 tokens


def cut(policy: str, found_in: list[str], cpu: ReadCost | None = None, disk: ReadCost | None = None) -> int:
    return plan(policy, found_in, cpu, disk).cut


def plan(policy: str, found_in: list[str], cpu: ReadCost | None = None, disk: ReadCost | None = None) -> LoadPlan:
    num_tokens = len(found_in) * BS + 1
    return choose_plan(policy, found_in, num_tokens, BS, compute(), {"cpu": cpu or fast(), "disk": disk or fast()})


def test_auto_loads_from_a_fast_tier_and_recomputes_from_a_slow_one():
    found = ["device"] * 2 + ["cpu"] * 6
    assert cut("auto", found, cpu=fast()) == 8
    assert cut("auto", found, cpu=slow()) == 2  # the device hits are kept either way


def test_auto_splits_a_prefix_at_the_boundary_between_a_fast_and_a_slow_tier():
    found = ["cpu"] * 4 + ["disk"] * 4
    assert cut("auto", found, cpu=fast(), disk=slow()) == 4
    # a slow tier first: its blocks are recomputed while the fast tier's after them load
    assert plan("auto", found, cpu=slow(), disk=fast()) == LoadPlan(0, 4, 8)


def test_auto_weighs_a_tier_latency_against_the_compute_it_saves():
    high_latency = ReadCost(1024, latency_s=0.5, per_block_s=1e-5)
    assert cut("auto", ["cpu"] * 4, cpu=high_latency) == 0      # 4 blocks compute in ~20 ms
    assert cut("auto", ["cpu"] * 256, cpu=high_latency) == 256  # 256 blocks in ~1 s


def test_always_load_and_always_recompute_ignore_the_estimates():
    found = ["device"] + ["cpu"] * 3 + ["device"] * 2
    assert cut("always_load", found, cpu=slow()) == 6
    assert cut("always_recompute", found, cpu=fast()) == 1
    assert cut("always_recompute", ["device"] * 3) == 3


def test_auto_recomputes_the_head_of_a_run_while_its_tail_loads_when_both_take_about_as_long():
    # 64 blocks of 4 tokens: computing all takes ~0.28 s, loading all 0.64 s; each alone is slower than
    # computing the first blocks while the later ones load
    found = ["device"] * 2 + ["cpu"] * 64
    medium = ReadCost(1024, latency_s=0.0, per_block_s=0.01)
    p = plan("auto", found, cpu=medium)
    assert p.overlaps and p.device_run == 2 and p.cut == 66 and 2 < p.head_end < 66
    head_s = compute().prefill_s((p.head_end - 2) * BS, 2 * BS)
    tail_s = medium.load_s(66 - p.head_end)
    assert abs(head_s - tail_s) <= compute().prefill_s(BS, p.head_end * BS) + medium.load_s(1)  # they meet
    assert plan("auto", found, cpu=fast()) == LoadPlan(2, 2, 66)   # loading is far faster: no head
    assert plan("auto", found, cpu=slow()) == LoadPlan(2, 2, 2)    # loading is far slower: no tail
    assert plan("always_load", found, cpu=medium) == LoadPlan(2, 2, 66)
    assert plan("always_recompute", found, cpu=medium) == LoadPlan(2, 2, 2)


def test_auto_computes_no_head_where_a_step_of_its_own_costs_more_than_the_load():
    """A head is computed in a step before the one that computes the rest: on a machine whose steps
    have a fixed cost above the whole load (a CPU, ~40 ms, against a few ms from a local disk), the
    head only adds that cost, so everything found is loaded."""
    found = ["device"] + ["disk"] * 125
    disk = ReadCost(1024, latency_s=1e-5, per_block_s=1e-4)                # 125 blocks in ~13 ms
    no_overhead = StepCost(per_token_s=1e-4, per_pair_s=1e-6)
    with_overhead = StepCost(per_token_s=1e-4, per_pair_s=1e-6, overhead_s=0.04)

    def auto(step_cost: StepCost) -> LoadPlan:
        return choose_plan("auto", found, len(found) * BS + 1, BS, step_cost, {"disk": disk})
    assert auto(no_overhead).overlaps  # priced as free, the first blocks (little context) look worth computing
    assert auto(with_overhead) == LoadPlan(1, 1, 126)
    slow_disk = ReadCost(1024, latency_s=1e-5, per_block_s=1e-3)           # 125 blocks in ~125 ms
    overlapped = choose_plan("auto", found, len(found) * BS + 1, BS, with_overhead, {"disk": slow_disk})
    assert overlapped.overlaps  # a load longer than a step: computing the head while it loads still pays


def test_auto_prices_a_head_as_the_eager_step_it_is_on_a_gpu():
    """Measured on one H200 (SmolLM2, a 7024-token document on disk after a restart): a replayed step cost 1-2 ms
    and an eager one 25-35 ms, while loading all 439 blocks took 33 ms. With one fixed cost fitted mostly from
    replayed steps, `auto` recomputed 2256 tokens as an eager head beside the load (71 ms against 39 ms for
    loading everything). Priced as eager, the head stays short enough for its step to end before the rest loads."""
    bs = 16
    found = ["disk"] * 439
    disk = ReadCost(1024, latency_s=1.5e-3, per_block_s=72e-6)                 # 439 blocks in ~33 ms
    gpu = StepCost(per_token_s=5e-6, overhead_s=0.025, replayed_overhead_s=0.0015, replay_tokens=511)
    p = choose_plan("auto", found, 439 * bs + 17, bs, gpu, {"disk": disk})
    head_tokens = (p.head_end - p.device_run) * bs
    assert p.cut == 439 and head_tokens <= 1024
    assert gpu.step_s(head_tokens, 0) <= disk.load_s(439 - p.head_end)  # the head's step ends before the tail lands
    # one fixed cost, as before: the same speeds but for the eager steps' made a head of thousands look cheap
    blended = StepCost(per_token_s=5e-6, overhead_s=0.0015)
    assert choose_plan("auto", found, 439 * bs + 17, bs, blended, {"disk": disk}).head_end * bs > 3000
    # a load far slower than computing everything in an eager step: most of the document is computed (its
    # last blocks at most load while the rest computes)
    slow_disk = ReadCost(1024, latency_s=1.5e-3, per_block_s=1e-3)             # 439 blocks in ~440 ms
    slow = choose_plan("auto", found, 439 * bs + 17, bs, gpu, {"disk": slow_disk})
    assert slow.cut == 0 or slow.head_end >= 0.8 * 439


def test_without_overlap_a_head_is_computed_only_where_that_beats_loading_it():
    """On a GPU a head's step is not counted on to run while its tail loads (on one H200 no head chosen beside a
    load paid for itself; engine/load_policy.py): priced one after the other, the head that meets its tail's load
    halfway is not worth its step, but recomputing the blocks a slow tier holds before a fast one still is."""
    def auto(found: list[str], cpu: ReadCost, disk: ReadCost, overlap: bool) -> LoadPlan:
        return choose_plan("auto", found, len(found) * BS + 1, BS, compute(), {"cpu": cpu, "disk": disk},
                           overlap=overlap)

    found = ["device"] * 2 + ["cpu"] * 64
    medium = ReadCost(1024, latency_s=0.0, per_block_s=0.01)  # as in the overlapping case above
    assert auto(found, medium, fast(), overlap=True).overlaps
    no_overlap = auto(found, medium, fast(), overlap=False)
    assert not no_overlap.overlaps and no_overlap in (LoadPlan(2, 2, 66), LoadPlan(2, 2, 2))
    split = ["disk"] * 16 + ["cpu"] * 16  # a slow tier's blocks first, a fast one's after
    assert auto(split, fast(), slow(), overlap=False) == LoadPlan(0, 16, 32)
    assert auto(found, fast(), fast(), overlap=False) == LoadPlan(2, 2, 66)  # loading is far faster: all loaded
    assert auto(found, slow(), fast(), overlap=False) == LoadPlan(2, 2, 2)   # far slower: all computed


def test_the_kv_manager_prices_heads_as_overlapping_their_loads_on_a_cpu():
    assert make_stack(device_blocks=8, cpu_blocks=8).heads_overlap_loads  # on a GPU it is False


def new_request(tokens: list[int]) -> Request:
    return Request(f"lp-{tokens[0]}-{len(tokens)}", list(tokens), SamplingParams(max_tokens=1, temperature=0))


def put_in(tier, tokens: list[int], first: int, stop: int) -> None:
    """Store blocks `first..stop-1` of `tokens` in `tier` only (as if long evicted from the device)."""
    hashes = hashes_of(tokens)[first:stop]
    tier.put(hashes, [tokens[i * BS:(i + 1) * BS] for i in range(first, stop)], [content_for(h) for h in hashes])
    tier.flush()


def admit(kv, request: Request):
    blocks, num_cached, by_tier = computed_blocks(kv, request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, blocks) is not None  # its admission
    return blocks, num_cached, by_tier


@pytest.mark.parametrize("policy,cpu,cached_cpu,recomputed_cpu", [
    ("auto", fast, 6, 0), ("auto", slow, 0, 6), ("always_load", slow, 6, 0), ("always_recompute", fast, 0, 6)])
def test_the_policy_decides_what_a_request_loads_and_reports_and_counts_the_rest(policy, cpu, cached_cpu,
                                                                                 recomputed_cpu):
    kv = make_stack(device_blocks=32, cpu_blocks=16)
    kv.load_policy, kv.read_costs["cpu"], kv.step_cost = policy, cpu(), compute()
    document = doc(1, 6 * BS + 1)
    put_in(kv.hierarchy.cpu, document, 0, 6)
    request = new_request(document)
    blocks, num_cached, by_tier = admit(kv, request)
    assert by_tier == {"device": 0, "cpu": cached_cpu * BS, "disk": 0, "remote": 0} and num_cached == len(blocks) * BS
    assert request.recomputed_tokens_by_tier == {"device": 0, "cpu": recomputed_cpu * BS, "disk": 0, "remote": 0}
    assert kv.stats().recomputed_blocks == {"device": 0, "cpu": recomputed_cpu, "disk": 0, "remote": 0}
    assert kv.hierarchy.counters.promotions["cpu"] == cached_cpu  # nothing past the cut was read
    assert kv.hierarchy.cpu.stats().hits == cached_cpu


def test_a_fast_cpu_tier_is_loaded_and_a_slow_disk_past_it_is_recomputed(tmp_path):
    kv = make_stack(device_blocks=32, cpu_blocks=16, disk_path=tmp_path / "kv", disk_blocks=16)
    kv.read_costs["cpu"], kv.read_costs["disk"], kv.step_cost = fast(), slow(), compute()
    document = doc(2, 8 * BS + 1)
    put_in(kv.hierarchy.cpu, document, 0, 4)
    put_in(kv.hierarchy.disk, document, 4, 8)
    request = new_request(document)
    # priced as admitted
    estimate = kv.estimate_uncached(request)
    assert (estimate.tokens, estimate.hit_blocks) == (4 * BS + 1, {"device": 0, "cpu": 4, "disk": 0, "remote": 0})
    _, num_cached, by_tier = admit(kv, request)
    assert by_tier == {"device": 0, "cpu": 4 * BS, "disk": 0, "remote": 0}
    assert request.recomputed_tokens_by_tier == {"device": 0, "cpu": 0, "disk": 4 * BS, "remote": 0}
    assert kv.hierarchy.disk.stats().hits == 0
    kv.hierarchy.close()


def test_read_costs_are_probed_at_start_up_and_refined_by_promotions():
    kv = make_stack(device_blocks=32, cpu_blocks=16, gate_cpu=True)
    cpu = kv.hierarchy.cpu
    cpu.read_s_per_block = 0.01
    kv.probe_lower_tiers()
    probed_s = kv.read_costs["cpu"].load_s(6)
    assert probed_s >= 0.9 * 6 * 0.01 and kv.read_costs["cpu"].bytes_per_s > 0
    assert cpu.stats().used_blocks == 0 and kv.pool.num_free_blocks == 32  # the probe leaves nothing behind
    cpu.read_s_per_block = 0.05  # the tier slows down: the next promotion shows it
    kv.load_policy = "always_load"  # (auto would recompute rather than promote from a tier this slow)
    document = doc(3, 6 * BS + 1)
    put_in(cpu, document, 0, 6)
    admit(kv, new_request(document))
    assert kv.read_costs["cpu"].load_s(6) > 2 * probed_s


def big_block_stack(cpu_blocks: int, fill_threads: int) -> KVCacheManager:
    """A KV manager over 1 MiB blocks (a load of 4 is one part read by one fill thread) and a CPU tier
    whose reads sleep per block (as a slow copy would, but without the GIL: the threads do overlap)."""
    layout = BlockLayout(num_layers=16, block_size=BS, num_kv_heads=32, head_dim=64, dtype=torch.float32)
    kv_cache = layout.allocate(40)
    cpu = GatedTier(CpuTier(layout, cpu_blocks))
    cpu.read_s_per_block = 0.02
    transfers = TransferEngine(kv_cache, fill_threads=fill_threads)
    return KVCacheManager(TierHierarchy(BlockPool(40), kv_cache, cpu, transfers=transfers), HASHER, BS)


def test_the_probe_prices_a_large_load_at_the_rate_of_the_fill_threads_that_read_it():
    one, four = big_block_stack(64, fill_threads=1), big_block_stack(64, fill_threads=4)
    one.probe_lower_tiers()
    four.probe_lower_tiers()
    # a document's load of 64 blocks: 1.28 s read by one thread, a quarter of that by four (the line
    # through small and large loads prices it a little under that: it is a line)
    assert one.read_costs["cpu"].load_s(64) >= 0.9 * 64 * 0.02
    assert 0.7 * 64 * 0.02 / 4 <= four.read_costs["cpu"].load_s(64) <= 0.6 * 64 * 0.02
    small_tier = big_block_stack(20, fill_threads=4)  # no room for the largest load: the others are timed
    small_tier.probe_lower_tiers()
    assert small_tier.read_costs["cpu"].fit.num_observations == 3
    for kv in (one, four, small_tier):
        assert kv.hierarchy.cpu.stats().used_blocks == 0 and kv.pool.num_free_blocks == 40
        kv.hierarchy.close()


def test_the_probe_never_evicts_a_block_and_is_no_block_event():
    kv = make_stack(device_blocks=32, cpu_blocks=8, gate_cpu=True)
    cpu, events = kv.hierarchy.cpu, []
    cpu.event_listener = events.append
    kv.probe_lower_tiers()
    assert events == [] and cpu.stats().evictions == 0
    assert kv.read_costs["cpu"].fit.num_observations > 0  # an empty tier with room is probed
    full = doc(4, 8 * BS + 1)
    put_in(cpu, full, 0, 8)
    events.clear()
    before = kv.read_costs["cpu"].fit.num_observations
    kv.probe_lower_tiers()  # a full tier is not: the probe would push out the user's blocks
    assert kv.read_costs["cpu"].fit.num_observations == before
    assert cpu.stats().used_blocks == 8 and cpu.stats().evictions == 0 and events == []


# ---------------------------------------------------------------------------------------- the model


def engine_config(tmp_path, policy: str) -> dict:
    return {"model": {"dtype": "float32", "device": "cpu"},
            "cache": {"tiers": {"device": {"size": 48}, "cpu": {"size": 48}}, "load_policy": policy},
            "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 4}}


PROMPT = [{"role": "user", "content": topics["try"][:900] + "\n\nAnswer briefly. What is this section about?"}]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def uncached(embedded_model_fp32, tmp_path_factory):
    from kvstrata import LLM, load_config
    config = engine_config(tmp_path_factory.mktemp("off"), "auto")
    config["cache"]["enable_prefix_caching"] = False
    with LLM(load_config(config), loaded_model=embedded_model_fp32) as llm:
        return llm.chat(PROMPT, GREEDY)[0].token_ids


def ask_twice(llm):
    """Ask, drop the device's cached blocks (the CPU tier holds them), ask again: the second one's output."""
    first = llm.chat(PROMPT, GREEDY)[0]
    assert first.cached_tokens == 0
    assert llm.engine.hierarchy.clear_device_cache()
    return llm.chat(PROMPT, GREEDY)[0]


@pytest.mark.slow
@pytest.mark.parametrize("policy,loads", [("auto", True), ("always_load", True), ("always_recompute", False)])
def test_every_policy_gives_the_uncached_outputs_and_a_fast_cpu_tier_is_loaded(policy, loads, embedded_model_fp32,
                                                                               uncached, tmp_path):
    from kvstrata import LLM, load_config
    with LLM(load_config(engine_config(tmp_path, policy)), loaded_model=embedded_model_fp32) as llm:
        out = ask_twice(llm)
        found = out.cached_tokens_by_tier["cpu"] + out.recomputed_tokens_by_tier["cpu"]
        assert found > 0 and out.token_ids == uncached
        assert out.cached_tokens_by_tier["cpu"] == (found if loads else 0)
        assert llm.stats()["prefix_cache"]["recomputed_tokens"]["cpu"] == (0 if loads else found)
        assert out.receipt.recomputed_tokens_by_tier == out.recomputed_tokens_by_tier  # the user is told


SHORT_PROMPT = [{"role": "user", "content": topics["try"][:120] + "\n\nWhat is this about?"}]  # 4-5 blocks


@pytest.fixture(scope="module")
def short_uncached(embedded_model_fp32, tmp_path_factory):
    """SHORT_PROMPT's output with caching off, and how long asking took on this machine (now)."""
    from kvstrata import LLM, load_config
    config = engine_config(tmp_path_factory.mktemp("short"), "auto")
    config["cache"]["enable_prefix_caching"] = False
    with LLM(load_config(config), loaded_model=embedded_model_fp32) as llm:
        llm.chat(SHORT_PROMPT, GREEDY)  # warm: the first call pays for what is built once
        started = time.perf_counter()
        token_ids = llm.chat(SHORT_PROMPT, GREEDY)[0].token_ids
        return token_ids, time.perf_counter() - started


@pytest.mark.slow
def test_auto_recomputes_what_a_slow_tier_holds_and_counts_it(embedded_model_fp32, short_uncached, tmp_path,
                                                              monkeypatch):
    """The CPU tier is made slower to read one block than computing the whole prompt takes on this machine
    (three times the uncached answer's time, measured just before): the engine's probe and its first prefill
    measure both, and the repeated prompt is recomputed, not loaded, and counted.

    The delay is relative because `auto` recomputes a head *while* the tail loads: with a fixed 1 s a block
    against a 17-block prompt, a machine computing a block in 0.18 s (AVX2, fp32, loaded) rightly loaded the
    last 3 blocks beside a 14-block head, hidden behind its compute. Only a tier slower per block than the
    whole prompt's compute is recomputed whatever the machine. (A prompt of 4-5 blocks and a tier of 8 keep
    the start-up probe to loads of 1 and 4 blocks, a few delays.)"""
    from kvstrata import LLM, load_config
    from kvstrata.engine import llm_engine
    from kvstrata.serving.metrics import _cache_metrics

    uncached_ids, uncached_s = short_uncached
    read_s_per_block = max(0.5, 3 * uncached_s)
    real_cpu_tier = llm_engine.CpuTier

    def slow_cpu_tier(*args, **kwargs):
        tier = GatedTier(real_cpu_tier(*args, **kwargs))
        tier.read_s_per_block = read_s_per_block
        return tier

    monkeypatch.setattr(llm_engine, "CpuTier", slow_cpu_tier)
    config = engine_config(tmp_path, "auto")
    config["cache"]["tiers"]["cpu"]["size"] = 8
    with LLM(load_config(config), loaded_model=embedded_model_fp32) as llm:
        assert llm.stats()["load_policy"]["read_bytes_per_s"]["cpu"] > 0  # probed at start-up
        assert llm.engine.kv_manager.read_costs["cpu"].load_s(1) >= 0.9 * read_s_per_block
        first = llm.chat(SHORT_PROMPT, GREEDY)[0]
        assert first.cached_tokens == 0
        assert llm.engine.hierarchy.clear_device_cache()
        out = llm.chat(SHORT_PROMPT, GREEDY)[0]
        assert out.token_ids == uncached_ids
        assert out.cached_tokens_by_tier["cpu"] == 0 and out.recomputed_tokens_by_tier["cpu"] >= 3 * llm.engine.block_size
        stats = llm.stats()
        assert stats["prefix_cache"]["recomputed_tokens"]["cpu"] == out.recomputed_tokens_by_tier["cpu"]
        assert stats["promotions"]["cpu"] == 0
        exported = {m.name: m for m in _cache_metrics(stats)}["kvstrata_prefix_cache_recomputed_tokens"]
        assert {s.labels["tier"]: s.value for s in exported.samples if s.name.endswith("_total")}["cpu"] == \
            out.recomputed_tokens_by_tier["cpu"]


@pytest.mark.slow
def test_a_head_recomputed_while_the_tail_loads_gives_the_uncached_outputs(embedded_model_fp32, uncached, tmp_path,
                                                                           monkeypatch):
    """Prices fixed so that `auto` recomputes the first third of the prompt while the rest loads from a
    slowed CPU tier: the answer is the uncached one, and the receipt says what was loaded and recomputed."""
    from kvstrata import LLM, load_config
    from kvstrata.engine import llm_engine

    real_cpu_tier = llm_engine.CpuTier

    def slowed_cpu_tier(*args, **kwargs):
        tier = GatedTier(real_cpu_tier(*args, **kwargs))
        tier.read_s_per_block = 0.02  # the tail is still loading when the head's step ends
        return tier

    monkeypatch.setattr(llm_engine, "CpuTier", slowed_cpu_tier)
    with LLM(load_config(engine_config(tmp_path, "auto")), loaded_model=embedded_model_fp32) as llm:
        first = llm.chat(PROMPT, GREEDY)[0]
        assert first.cached_tokens == 0
        assert llm.engine.hierarchy.clear_device_cache()
        kv = llm.engine.kv_manager
        kv.step_cost = StepCost(per_token_s=1e-3)  # a block (16 tokens) computes in 16 ms, loads in 8 ms
        kv.read_costs["cpu"] = ReadCost(kv.read_costs["cpu"].block_nbytes, latency_s=0.0, per_block_s=8e-3)
        out = llm.chat(PROMPT, GREEDY)[0]
        assert out.token_ids == uncached
        loaded, recomputed = out.cached_tokens_by_tier["cpu"], out.recomputed_tokens_by_tier["cpu"]
        assert loaded > 0 and recomputed > 0 and loaded > recomputed  # the head is about a third
        assert out.receipt.cached_tokens_by_tier["cpu"] == loaded
        assert abs(out.receipt.ttft_ms - sum((out.receipt.queue_ms, out.receipt.lookup_ms, out.receipt.load_ms,
                                              out.receipt.prefill_ms))) <= 0.05 * out.receipt.ttft_ms
