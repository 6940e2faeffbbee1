"""Asynchronous admission, without a model: a request whose prefix is below the device waits in the
loading state while the others keep running, its hits stay held from lookup until the load lands,
a failed read ends the prefix where it failed, and every counter counts what its name says.

The fake "model step" of test_hierarchy fills each computed block with bytes derived from its chain
hash, and every served prefix is checked byte for byte.
"""
from __future__ import annotations

import threading

import pytest
import torch
from test_hierarchy import BS, HASHER, computed_blocks, content_for, doc, make_stack, run_request

from kvstrata.engine.request import Request, RequestStatus
from kvstrata.engine.sampling import SamplingParams
from kvstrata.engine.scheduler import Scheduler
from kvstrata.tiers.base import TIER_NAMES, as_bytes


def hashes_of(tokens: list[int]) -> list[bytes]:
    return HASHER.hash(tokens)


def put_below(kv, tokens: list[int], num_blocks: int) -> None:
    """Store the first `num_blocks` blocks of `tokens` in the CPU tier only (as if long evicted)."""
    hashes = hashes_of(tokens)[:num_blocks]
    kv.hierarchy.cpu.put(hashes, [tokens[i * BS:(i + 1) * BS] for i in range(num_blocks)],
                         [content_for(h) for h in hashes])


def assert_prefix_bytes(kv, blocks, hashes) -> None:
    for block, h in zip(blocks, hashes):
        assert torch.equal(as_bytes(kv.hierarchy.kv_cache[block.block_id]), content_for(h)), "wrong bytes served"


def new_request(tokens: list[int], max_tokens: int = 1) -> Request:
    return Request(f"q{len(tokens)}-{tokens[0]}", list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0))


def fake_step(kv, scheduler: Scheduler) -> list[Request]:
    """One engine step without a model: schedule, 'compute' the new blocks, sample token 1."""
    out = scheduler.schedule()
    for s in out.scheduled:
        req = s.request
        for block, h in zip(kv.states[req.request_id].blocks, req.block_hashes):
            if block.block_hash == h:
                as_bytes(kv.hierarchy.kv_cache[block.block_id]).copy_(content_for(h))
    scheduler.update_after_step(out)
    sampled = [s.request for s in out.scheduled if s.samples]
    for req in sampled:
        req.output_token_ids.append(1)
    kv.hierarchy.flush_pending()
    return sampled


def a_document_below_and_a_request_decoding(kv, scheduler: Scheduler, seed: int) -> tuple[list[int], Request]:
    """A document whose 6 blocks only the CPU tier holds, and a request past its prefill, decoding."""
    document = doc(seed, 6 * BS + 1)
    put_below(kv, document, 6)
    decoding = new_request(doc(seed + 1, 2 * BS), max_tokens=10)
    scheduler.add_request(decoding)
    fake_step(kv, scheduler)  # its prefill
    return document, decoding


@pytest.mark.parametrize("offload", ["write_through", "on_evict"])
def test_a_loading_request_waits_while_another_keeps_decoding(offload):
    kv = make_stack(device_blocks=32, cpu_blocks=16, offload=offload, gate_cpu=True)
    scheduler = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=4)
    document, decoding = a_document_below_and_a_request_decoding(kv, scheduler, 1)

    kv.hierarchy.cpu.gate.clear()  # the CPU tier's reads now wait: the load stays in flight
    loading = new_request(document)
    scheduler.add_request(loading)
    for _ in range(3):
        sampled = fake_step(kv, scheduler)
        assert sampled == [decoding]  # the other request decodes a token every step
        assert loading.status == RequestStatus.LOADING and loading.num_computed_tokens == 0
    kv.hierarchy.cpu.gate.set()
    kv.wait_for_loads(timeout=10)
    sampled = fake_step(kv, scheduler)
    assert loading in sampled and decoding in sampled
    assert loading.cached_tokens_by_tier == {"device": 0, "cpu": 6 * BS, "disk": 0, "remote": 0}
    assert_prefix_bytes(kv, kv.states[loading.request_id].blocks[:6], loading.block_hashes)


@pytest.mark.parametrize("offload", ["write_through", "on_evict"])
def test_hits_stay_held_from_lookup_until_the_load_lands(offload):
    """While the load waits, other requests write down twice the CPU tier's free room: without
    holds the LRU would evict the very blocks being promoted."""
    kv = make_stack(device_blocks=24, cpu_blocks=10, offload=offload, gate_cpu=True)
    document = doc(3, 6 * BS + 1)
    put_below(kv, document, 6)
    kv.hierarchy.cpu.gate.clear()
    req = new_request(document)
    assert kv.get_computed_blocks(req) is None and kv.is_loading(req)
    for seed in range(10, 14):  # four other documents pass through the device and down
        run_request(kv, doc(seed, 6 * BS + 1))
    assert kv.hierarchy.cpu.stats().evictions > 0 or kv.hierarchy.cpu.stats().extra["rejected_puts"] > 0
    kv.hierarchy.cpu.gate.set()
    blocks, num_cached, by_tier = computed_blocks(kv, req)
    assert num_cached == 6 * BS and by_tier["cpu"] == 6 * BS
    assert_prefix_bytes(kv, blocks, req.block_hashes)


def test_cpu_tier_hit_under_on_evict_without_disk_survives_its_own_promotion():
    """The promotion's allocation evicts device blocks, which on_evict writes into a full CPU tier,
    whose least recently used blocks are the ones being promoted: they must not be the ones to go."""
    kv = make_stack(device_blocks=8, cpu_blocks=6, offload="on_evict")
    a, b = doc(4, 6 * BS + 1), doc(5, 6 * BS + 1)
    run_request(kv, a)
    run_request(kv, b)  # a's blocks leave the device for the CPU tier; b's stay cached on the device
    again = run_request(kv, a)  # run_request checks every served block's bytes
    assert again.cached_tokens_by_tier["cpu"] > 0
    assert again.num_cached_tokens == 6 * BS
    assert kv.hierarchy.counters.promotion_failures == 0


def test_a_block_gone_mid_transfer_ends_the_prefix_there_and_the_rest_is_recomputed():
    kv = make_stack(device_blocks=24, cpu_blocks=16, gate_cpu=True)
    document = doc(6, 6 * BS + 1)
    put_below(kv, document, 6)
    kv.hierarchy.cpu.gate.clear()
    req = new_request(document)
    assert kv.get_computed_blocks(req) is None
    kv.hierarchy.cpu.inner.discard(req.block_hashes[3])  # dropped while the load waits
    kv.hierarchy.cpu.gate.set()
    blocks, num_cached, by_tier = computed_blocks(kv, req)
    assert num_cached == 3 * BS and by_tier["cpu"] == 3 * BS
    assert_prefix_bytes(kv, blocks, req.block_hashes)
    assert kv.hierarchy.counters.promotion_failures == 1  # in blocks
    # the blocks that did arrive after the gap are cached on the device for the next request
    assert all(kv.pool.get_cached_block(h) is not None for h in req.block_hashes[4:6])


def test_a_tier_failing_mid_transfer_is_a_miss_not_a_crash():
    kv = make_stack(device_blocks=24, cpu_blocks=16, gate_cpu=True)
    document = doc(7, 6 * BS + 1)
    put_below(kv, document, 6)
    kv.hierarchy.cpu.fail_reads = True
    scheduler = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=4)
    req = new_request(document)
    scheduler.add_request(req)
    while not fake_step(kv, scheduler):
        kv.wait_for_loads(timeout=10)
    assert req.cached_tokens_by_tier == {"device": 0, "cpu": 0, "disk": 0, "remote": 0}  # recomputed whole
    assert kv.hierarchy.counters.promotion_failures == 6
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - len(kv.states[req.request_id].blocks)


def an_aborted_load(device_blocks: int) -> tuple:
    """A stack whose CPU tier holds a 6-block document, and a request for it aborted while its load is held at the
    CPU tier's closed gate: (kv, scheduler, the aborted request)."""
    kv = make_stack(device_blocks=device_blocks, cpu_blocks=16, gate_cpu=True)
    document = doc(8, 6 * BS + 1)
    put_below(kv, document, 6)
    scheduler = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=4)
    kv.hierarchy.cpu.gate.clear()
    req = new_request(document)
    scheduler.add_request(req)
    assert fake_step(kv, scheduler) == [] and req.status == RequestStatus.LOADING
    scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
    return kv, scheduler, req


def test_a_request_aborted_while_loading_releases_its_blocks_once_the_load_lands():
    kv, scheduler, req = an_aborted_load(device_blocks=24)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 6  # still being written into: not reusable
    kv.hierarchy.cpu.gate.set()
    kv.wait_for_loads(timeout=10)
    kv.hierarchy.transfers.wait_idle()
    kv.release_abandoned()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert all(kv.pool.get_cached_block(h) is not None for h in req.block_hashes[:6])


def test_a_step_with_nothing_to_run_waits_for_an_aborted_load_whose_blocks_a_waiting_request_needs():
    """The only room a waiting request can get is the blocks an aborted request's load still writes into: a step
    with nothing to run waits for that load (and lets its blocks go) instead of coming straight back, which spun the
    step thread beside the copy it waited on."""
    kv, scheduler, _ = an_aborted_load(device_blocks=8)
    waiting = new_request(doc(9, 4 * BS + 1))  # 5 blocks: 2 are free while the load holds 6
    scheduler.add_request(waiting)
    assert fake_step(kv, scheduler) == [] and waiting.status == RequestStatus.WAITING
    threading.Timer(0.2, kv.hierarchy.cpu.gate.set).start()
    assert kv.wait_for_loads(timeout=30)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert fake_step(kv, scheduler) == [waiting]


# ------------------------------------------------------------------ the next step's admission work, beside a step


def test_a_lower_tier_hit_arriving_during_a_step_starts_loading_and_lands_before_the_next_step():
    """The engine has the scheduler prepare the next step while the device computes one: a question arriving
    during a decode step is looked up and its load started then, and once the load is in, its blocks are
    cached on the device during the following step; the step after admits it, served right and counted once."""
    kv = make_stack(device_blocks=32, cpu_blocks=16, gate_cpu=True)
    scheduler = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=4)
    document, decoding = a_document_below_and_a_request_decoding(kv, scheduler, 20)
    kv.hierarchy.cpu.gate.clear()

    out = scheduler.schedule()  # a decode step runs...
    question = new_request(document)
    scheduler.add_request(question)  # ...when the question arrives
    scheduler.update_after_step(out)
    scheduler.prepare_next_step()
    decoding.output_token_ids.append(1)  # the step's token, read back
    assert question.status == RequestStatus.LOADING and kv.is_loading(question) and question.phases.phase == "load"

    out = scheduler.schedule()
    assert [s.request for s in out.scheduled] == [decoding]  # the question's load is in flight
    kv.hierarchy.cpu.gate.set()
    kv.wait_for_loads(timeout=10)
    scheduler.update_after_step(out)
    scheduler.prepare_next_step()  # the load is in: its blocks are cached on the device now, not at admission
    decoding.output_token_ids.append(1)
    assert all(kv.pool.get_cached_block(h) is not None for h in question.block_hashes[:6])
    assert not kv.hierarchy.cpu.inner._holds
    assert question.status == RequestStatus.LOADING and question.num_computed_tokens == 0

    out = scheduler.schedule()
    assert [s.request for s in out.scheduled] == [decoding, question]
    assert question.num_computed_tokens == 6 * BS and question.cached_tokens_by_tier["cpu"] == 6 * BS
    assert_prefix_bytes(kv, kv.states[question.request_id].blocks[:6], question.block_hashes)
    assert kv.stats().queries == 2 and kv.stats().hit_blocks["cpu"] == 6


def test_preparing_the_next_step_neither_refuses_for_room_nor_touches_device_hits():
    """Room is judged by the next step, after this one's finished requests have freed theirs: looking ahead,
    a load the device has no room for yet is not started, and the request is not remembered as refused. A
    request whose prefix is on the device is left to the next step too (it computes, which takes its budget)."""
    kv = make_stack(device_blocks=10, cpu_blocks=16)
    scheduler = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=4)
    on_device = run_request(kv, doc(22, 3 * BS + 1))
    document = doc(23, 6 * BS + 1)
    put_below(kv, document, 6)
    hog = new_request(doc(24, 5 * BS), max_tokens=10)
    scheduler.add_request(hog)
    fake_step(kv, scheduler)  # 6 blocks taken: no room for the document's 7
    question, device_hit = new_request(document), new_request(on_device.prompt_token_ids)
    scheduler.add_request(question)
    scheduler.add_request(device_hit)
    scheduler.prepare_next_step()
    for request in (question, device_hit):
        assert request.status == RequestStatus.WAITING and not kv.holds_prefix(request)
        assert not kv.is_refused(request)
    scheduler.finish(hog, RequestStatus.FINISHED_ABORTED)
    scheduler.prepare_next_step()
    assert question.status == RequestStatus.LOADING and device_hit.status == RequestStatus.WAITING


def test_a_load_that_failed_whole_and_found_no_room_at_admission_leaves_no_block_held():
    """A request's load fails whole (nothing served: its prefix is empty) and, at its admission, the device has no
    room for the prompt it must now compute: it goes back to the queue holding nothing, its blocks set aside for
    the rest of its prompt released too, so that looking it up again reserves afresh and nothing is lost."""
    kv = make_stack(device_blocks=16, cpu_blocks=16, gate_cpu=True)
    pool = kv.pool
    document = doc(31, 6 * BS + 1)
    put_below(kv, document, 6)
    cpu = kv.hierarchy.cpu
    cpu.gate.clear()
    request = new_request(document)
    assert kv.get_computed_blocks(request) is None and kv.states[request.request_id].reserved
    cpu.fail_reads = True
    cpu.gate.set()
    blocks, num_cached, _ = computed_blocks(kv, request)
    assert (blocks, num_cached) == ([], 0)
    hog = pool.get_new_blocks(pool.num_free_blocks - 2)  # room for 3 blocks with the reserved one, not for 7
    assert kv.allocate_slots(request, request.num_tokens, blocks) is None
    assert not kv.states[request.request_id].reserved
    pool.free_blocks(hog)
    cpu.fail_reads = False
    blocks, num_cached, _ = computed_blocks(kv, request)  # looked up again: loads, and reserves again
    assert num_cached == 6 * BS and kv.allocate_slots(request, 1, blocks) is not None
    kv.free(request)
    assert pool.num_free_blocks == pool.num_blocks


# ---------------------------------------------------------------------------------------- counters


def test_hit_counters_count_each_admitted_request_once_even_when_its_admission_is_retried():
    kv = make_stack(device_blocks=10)
    scheduler = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=4)
    shared = doc(9, 4 * BS)
    first = new_request(shared + [5], max_tokens=1)
    scheduler.add_request(first)
    fake_step(kv, scheduler)
    hog = new_request(doc(10, 5 * BS), max_tokens=3)  # takes the free blocks and keeps them a while
    scheduler.add_request(hog)
    fake_step(kv, scheduler)
    second = new_request(shared + [6, 7, 8] + doc(11, 3 * BS), max_tokens=1)
    scheduler.add_request(second)
    admissions_tried = 0
    while second.status != RequestStatus.RUNNING and not second.is_finished:
        admissions_tried += second.cached_tokens_by_tier is None
        for req in fake_step(kv, scheduler):
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
    assert admissions_tried >= 2, "the scenario must retry the admission"
    stats = kv.stats()
    assert stats.queries == 3
    assert stats.hit_blocks == {"device": 4, "cpu": 0, "disk": 0, "remote": 0}  # second's 4 shared blocks, once
    assert stats.query_tokens == sum(r.num_prompt_tokens for r in (first, hog, second))
    assert second.cached_tokens_by_tier["device"] == 4 * BS


def test_promotion_write_down_and_eviction_counters_count_blocks():
    kv = make_stack(device_blocks=8, cpu_blocks=32)
    h = kv.hierarchy
    a, b = doc(12, 6 * BS + 1), doc(13, 6 * BS + 1)
    run_request(kv, a)
    assert h.counters.write_downs == {"cpu": 6, "disk": 0, "remote": 0}
    run_request(kv, b)
    assert h.counters.write_downs == {"cpu": 12, "disk": 0, "remote": 0}
    # b's 7 blocks took the one never used, a's uncached tail and 5 of a's 6 cached blocks
    assert h.counters.device_evictions == 5
    again = run_request(kv, a)
    assert again.cached_tokens_by_tier == {"device": BS, "cpu": 5 * BS, "disk": 0, "remote": 0}
    assert h.counters.promotions == {"cpu": 5, "disk": 0, "remote": 0}
    assert h.counters.promotion_failures == 0


def test_a_load_waits_until_the_device_can_hold_the_whole_prompt_and_holds_nothing_meanwhile():
    """Laid out cpu, cpu, cpu, device, device plus one block to compute, with room for two blocks
    beside the two free device hits: nothing is loaded or held until requests free enough blocks
    for the load and the rest of the prompt; then the whole prefix is loaded."""
    kv = make_stack(device_blocks=12, cpu_blocks=32)
    pool = kv.pool
    document = doc(14, 5 * BS + 1)
    first = run_request(kv, document)
    for h in first.block_hashes[:3]:  # blocks 0-2 leave the device; the CPU tier still has them
        pool.cached_block_hash_to_block.pop(h).block_hash = None
    hog = pool.get_new_blocks(7)  # the never-used blocks and the partial last one
    hits = [pool.get_cached_block(h) for h in first.block_hashes[3:5]]
    pool.touch(hits)
    pool.free_blocks(hits)  # now last in the free queue: the next allocation takes an empty block
    pool.get_new_blocks(1)
    assert pool.num_free_blocks == 4 and kv.hierarchy.locate(first.block_hashes[:5]) == ["cpu"] * 3 + ["device"] * 2
    request = new_request(document)
    assert kv.get_computed_blocks(request) is None and not kv.holds_prefix(request)
    assert pool.num_free_blocks == 4 and kv.hierarchy.locate(first.block_hashes[:5]) == ["cpu"] * 3 + ["device"] * 2
    pool.free_blocks(hog)
    blocks, num_cached, by_tier = computed_blocks(kv, request)
    assert num_cached == 5 * BS and by_tier == {"device": 2 * BS, "cpu": 3 * BS, "disk": 0, "remote": 0}
    assert_prefix_bytes(kv, blocks, first.block_hashes)
    assert kv.allocate_slots(request, 1, blocks) is not None  # its last block was reserved with the load
    kv.free(request)
    assert pool.num_free_blocks == pool.num_blocks - 1


# ---------------------------------------------------------------------------------------- progress


@pytest.mark.parametrize("policy", ["fcfs", "uncached_first"])
def test_concurrent_lower_tier_hits_larger_together_than_the_device_all_finish(policy):
    """Four documents found only in the CPU tier arrive at once; the device pool holds two of them with
    their outputs, not four. Loads hold device blocks while their request is not running, so without a
    rule they can take the room each other's prefill needs and evict each other's landed prefixes
    for ever. Every request must finish, each with its document loaded, not recomputed."""
    kv = make_stack(device_blocks=24, cpu_blocks=64)
    scheduler = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=8, policy=policy)
    documents = [doc(20 + d, 9 * BS + 3) for d in range(4)]
    for document in documents:
        put_below(kv, document, 9)
    requests = [new_request(document, max_tokens=6) for document in documents]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        sampled = fake_step(kv, scheduler)
        if not sampled:
            kv.wait_for_loads(timeout=5.0)
        for request in sampled:
            if len(request.output_token_ids) >= request.sampling_params.max_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests), [r.status for r in requests]
    assert all(r.cached_tokens_by_tier["cpu"] == 9 * BS for r in requests)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


# ---------------------------------------------------------------------------------------- overlap


def overlapping_stack(policy: str = "uncached_first"):
    """A CPU tier whose reads cost about twice a block's compute (as measured): `auto` recomputes the
    head of a CPU-tier prefix while its tail loads. The tier is gated: its reads wait for the test."""
    from kvstrata.engine.costs import ReadCost, StepCost

    kv = make_stack(device_blocks=64, cpu_blocks=64, gate_cpu=True)
    kv.step_cost = StepCost(per_token_s=1e-3)
    kv.read_costs["cpu"] = ReadCost(1024, latency_s=0.0, per_block_s=8e-3)
    scheduler = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=4, policy=policy)
    document = doc(40, 12 * BS + 1)
    put_below(kv, document, 12)
    kv.hierarchy.cpu.gate.clear()
    request = new_request(document)
    scheduler.add_request(request)
    return kv, scheduler, request


@pytest.mark.parametrize("policy", ["fcfs", "uncached_first"])
def test_the_head_of_a_lower_tier_prefix_is_computed_while_its_tail_loads(policy):
    kv, scheduler, request = overlapping_stack(policy)
    assert fake_step(kv, scheduler) == []  # it computed its head at once, without waiting for the load
    head = kv.barrier(request) // BS
    assert 0 < head < 12 and request.num_computed_tokens == head * BS
    assert request.status == RequestStatus.RUNNING and not kv.states[request.request_id].tail.load.ready
    assert fake_step(kv, scheduler) == [] and request.phases.phase == "load"  # the head is done: it waits
    kv.hierarchy.cpu.gate.set()
    kv.wait_for_loads(timeout=10)
    assert fake_step(kv, scheduler) == [request]  # the tail joined and the last token was computed
    assert kv.barrier(request) is None
    assert request.cached_tokens_by_tier == {"device": 0, "cpu": (12 - head) * BS, "disk": 0, "remote": 0}
    assert request.recomputed_tokens_by_tier["cpu"] == head * BS
    assert_prefix_bytes(kv, kv.states[request.request_id].blocks[:12], request.block_hashes)
    assert all(kv.pool.get_cached_block(h) is not None for h in request.block_hashes[:12])  # head cached too
    scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    stats = kv.stats()
    assert stats.hit_blocks["cpu"] == 12 - head and stats.recomputed_blocks["cpu"] == head


def test_a_landed_tail_is_reported_as_the_continuation_of_its_head():
    """A router rebuilds chains from BlockStored events: the tail's first block names the head's last
    block as its parent, as if the whole prefix had been computed in one pass."""
    from kvstrata.tiers.block_events import BlockStored

    kv, scheduler, request = overlapping_stack()
    events: list = []
    kv.hierarchy.event_listener = events.append
    fake_step(kv, scheduler)
    kv.hierarchy.cpu.gate.set()
    kv.wait_for_loads(timeout=10)
    fake_step(kv, scheduler)
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "device"]
    parents = {}
    for event in stored:
        for k, h in enumerate(event.block_hashes):
            parents[h] = event.parent_block_hash if k == 0 else event.block_hashes[k - 1]
    hashes = request.block_hashes[:12]
    assert kv.barrier(request) is None and set(hashes) <= set(parents)  # the tail has landed
    assert [parents[h] for h in hashes] == [None, *hashes[:-1]]


def test_a_request_aborted_while_its_tail_loads_releases_everything_once_the_tail_lands():
    kv, scheduler, request = overlapping_stack()
    fake_step(kv, scheduler)
    assert kv.barrier(request) is not None
    scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    kv.hierarchy.cpu.gate.set()
    kv.wait_for_loads(timeout=10)
    kv.hierarchy.transfers.wait_idle()
    kv.release_abandoned()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert not kv.hierarchy.cpu.inner._holds  # the tail's blocks are no longer held in the CPU tier


@pytest.mark.parametrize("policy", ["fcfs", "uncached_first"])
def test_two_questions_on_a_document_below_the_device_load_it_once(policy):
    """The second question waits for the first one's load instead of loading the same blocks again
    (into device blocks of its own), then finds them on the device."""
    kv = make_stack(device_blocks=48, cpu_blocks=16, gate_cpu=True)
    scheduler = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=4, policy=policy)
    document = doc(6, 6 * BS)
    put_below(kv, document, 6)
    kv.hierarchy.cpu.gate.clear()
    first, second = new_request(document + [7, 8]), new_request(document + [9, 10, 11])  # ids differ by length
    scheduler.add_request(first)
    scheduler.add_request(second)
    fake_step(kv, scheduler)
    assert first.status == RequestStatus.LOADING
    assert second.status == RequestStatus.WAITING and not kv.holds_prefix(second)  # no load of its own
    kv.hierarchy.cpu.gate.set()
    kv.wait_for_loads(timeout=10)
    sampled = fake_step(kv, scheduler)
    assert first in sampled and second in sampled
    assert first.cached_tokens_by_tier["cpu"] == 6 * BS
    assert second.cached_tokens_by_tier["device"] == 6 * BS  # the blocks the first one loaded
    assert kv.hierarchy.counters.promotions["cpu"] == 6
    assert_prefix_bytes(kv, kv.states[second.request_id].blocks[:6], second.block_hashes)


def test_a_tail_preempted_before_it_landed_is_counted_at_the_retried_admission():
    """Hits are counted once per request: the tail's blocks, which never landed for the first
    admission, count where the retried admission finds them (the abandoned load cached them on the
    device), so the request reports each prompt block once, as cached or as recomputed."""
    kv, scheduler, request = overlapping_stack()
    fake_step(kv, scheduler)
    head = kv.barrier(request) // BS
    scheduler._preempt(scheduler.running.pop())  # as when the device runs out of room for another step
    kv.hierarchy.cpu.gate.set()
    kv.wait_for_loads(timeout=10)
    kv.hierarchy.transfers.wait_idle()
    kv.release_abandoned()
    for _ in range(3):
        if fake_step(kv, scheduler) == [request]:
            break
        kv.wait_for_loads(timeout=10)
    assert request.num_preemptions == 1 and len(request.output_token_ids) == 1
    assert request.recomputed_tokens_by_tier["cpu"] == head * BS
    assert request.num_cached_tokens == (12 - head) * BS
    assert request.cached_tokens_by_tier == {"device": (12 - head) * BS, "cpu": 0, "disk": 0, "remote": 0}
    stats = kv.stats()
    assert stats.hit_blocks == {"device": 12 - head, "cpu": 0, "disk": 0, "remote": 0}
    assert stats.recomputed_blocks["cpu"] == head
    assert_prefix_bytes(kv, kv.states[request.request_id].blocks[:12], request.block_hashes)


def test_a_tail_preempted_after_it_landed_is_not_counted_again():
    kv, scheduler, request = overlapping_stack()
    fake_step(kv, scheduler)
    head = kv.barrier(request) // BS
    kv.hierarchy.cpu.gate.set()
    kv.wait_for_loads(timeout=10)
    kv.land_tail(request)
    assert kv.barrier(request) is None
    scheduler._preempt(scheduler.running.pop())
    while fake_step(kv, scheduler) != [request]:
        kv.wait_for_loads(timeout=10)
    assert request.cached_tokens_by_tier == {"device": 0, "cpu": (12 - head) * BS, "disk": 0, "remote": 0}
    assert kv.stats().hit_blocks == {"device": 0, "cpu": 12 - head, "disk": 0, "remote": 0}


@pytest.mark.parametrize("retry_loads", [True, False], ids=["retry loads the tail", "retry recomputes some"])
def test_a_request_preempted_while_it_waits_for_its_tail_counts_the_wait_as_load_from_the_tail_s_tier(retry_loads):
    """It goes back to the queue, its wait counted as load; each prompt block is then reported once,
    as cached (where the retry found it) or as recomputed (the first lookup's or the retry's choice)."""
    from kvstrata.engine.costs import ReadCost

    kv, scheduler, request = overlapping_stack()
    fake_step(kv, scheduler)
    assert fake_step(kv, scheduler) == [] and request.phases.phase == "load"  # the head is done: it waits
    scheduler._preempt(scheduler.running.pop())
    assert request.phases.phase == "queue" and request.phases.load_s_by_tier["cpu"] > 0
    if retry_loads:
        kv.read_costs["cpu"] = ReadCost(1024, latency_s=0.0, per_block_s=1e-6)
    kv.hierarchy.cpu.gate.set()
    while fake_step(kv, scheduler) != [request]:
        kv.wait_for_loads(timeout=10)
    assert request.num_cached_tokens + request.recomputed_tokens_by_tier["cpu"] == 12 * BS  # each block once
    stats = kv.stats()
    assert sum(stats.hit_blocks.values()) + stats.recomputed_blocks["cpu"] == 12


def _compute_step(kv, scheduler: Scheduler, prepare: bool = False) -> list[Request]:
    """One engine step without a model, as `fake_step`, but 'computing' only the blocks the step's new
    tokens fall in (a served block keeps the bytes its tier gave it, so a wrong promotion shows);
    `prepare`: the next step's admission work done before the tokens are sampled, as the engine does."""
    out = scheduler.schedule()
    for s in out.scheduled:
        req, blocks = s.request, kv.states[s.request.request_id].blocks
        for k in range(s.context // BS, -(-(s.context + s.num_new_tokens) // BS)):
            if k < len(req.block_hashes):
                as_bytes(kv.hierarchy.kv_cache[blocks[k].block_id]).copy_(content_for(req.block_hashes[k]))
    scheduler.update_after_step(out)
    if prepare:
        scheduler.prepare_next_step()
    sampled = [s.request for s in out.scheduled if s.samples]
    for req in sampled:
        if not req.output_token_ids:  # its first token: the prompt's blocks hold what they should
            full = req.num_prompt_tokens // BS
            assert_prefix_bytes(kv, kv.states[req.request_id].blocks[:full], req.block_hashes[:full])
        req.output_token_ids.append(1)
    kv.hierarchy.flush_pending()
    return sampled


@pytest.mark.parametrize("prepare", [False, True], ids=["admitting-in-schedule", "preparing-beside-steps"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["fcfs", "uncached_first"])
def test_random_admissions_preemptions_aborts_and_resets_serve_right_bytes_count_once_and_leak_nothing(
        policy, seed, prepare, tmp_path):
    """Requests on shared documents under a small device, a gated CPU tier and a disk tier, with
    loads left in flight, preemptions, aborts, device resets, failing reads, blocks put below and
    taken away, documents pinned and unpinned at random: every first token sees its prompt's right
    bytes, each prompt block is reported once (cached or recomputed) and counted as reported, and
    once all are done every device block is free and nothing is held in the CPU tier. With `prepare`,
    the next step's lookups, loads and landings are started during each step, as the engine does."""
    import random

    from kvstrata.engine.costs import ReadCost, StepCost

    rng = random.Random(seed)
    kv = make_stack(device_blocks=40, cpu_blocks=16, gate_cpu=True, offload=rng.choice(["write_through", "on_evict"]),
                    disk_path=tmp_path / "kv", disk_blocks=24)
    kv.step_cost = StepCost(per_token_s=1e-3)
    kv.read_costs["cpu"] = ReadCost(1024, latency_s=0.0, per_block_s=rng.choice([1e-4, 8e-3]))  # load or overlap
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, policy=policy)
    documents = [doc(100 + d, rng.randint(3, 12) * BS) for d in range(4)]
    gate, done, aborted, live = kv.hierarchy.cpu.gate, [], [], []
    for n in range(300):
        op = rng.random()
        if op < 0.15 and len(live) < 8:
            request = Request(f"r{n}", rng.choice(documents) + doc(1000 + n, rng.randint(1, 20)),
                              SamplingParams(max_tokens=rng.randint(1, 4), temperature=0))
            scheduler.add_request(request)
            live.append(request)
        elif op < 0.2 and scheduler.running:
            scheduler._preempt(scheduler.running.pop(rng.randrange(len(scheduler.running))))
        elif op < 0.23 and live:
            aborted.append(live.pop(rng.randrange(len(live))))
            scheduler.finish(aborted[-1], RequestStatus.FINISHED_ABORTED)
        elif op < 0.3:
            gate.clear() if gate.is_set() else gate.set()
        elif op < 0.33:
            kv.hierarchy.clear_device_cache()  # refused while a block is in use
        elif op < 0.36:
            put_below(kv, rng.choice(documents), rng.randint(1, 3))
        elif op < 0.38:  # a read fails (the rest of its prefix is recomputed), or a block leaves mid-load
            cpu = kv.hierarchy.cpu
            cpu.fail_reads = not cpu.fail_reads
        elif op < 0.40:
            kv.hierarchy.cpu.inner.discard(hashes_of(rng.choice(documents))[rng.randrange(3)])
        elif op < 0.42 and gate.is_set() and not kv.hierarchy.cpu.fail_reads:
            # a document pinned (its blocks copied down from wherever they are, on this thread), or unpinned
            d = rng.randrange(len(documents))
            if kv.hierarchy.cpu.unpin(f"doc{d}") is False:
                blocks = len(documents[d]) // BS
                kv.hierarchy.pin(f"doc{d}", hashes_of(documents[d]), [documents[d][k * BS:(k + 1) * BS]
                                                                      for k in range(blocks)], {})
        else:
            for request in _compute_step(kv, scheduler, prepare):
                if len(request.output_token_ids) == request.sampling_params.max_tokens:
                    scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
                    live.remove(request)
                    done.append(request)
            kv.wait_for_loads(timeout=0.001)
    gate.set()
    kv.hierarchy.cpu.fail_reads = False
    while live:
        kv.wait_for_loads(timeout=1)
        for request in _compute_step(kv, scheduler, prepare):
            if len(request.output_token_ids) == request.sampling_params.max_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
                live.remove(request)
                done.append(request)
    kv.hierarchy.transfers.wait_idle()
    kv.release_abandoned()
    assert len(done) > 20 and any(r.num_preemptions for r in done + aborted)  # the seeds exercise both
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert not kv.hierarchy.cpu.inner._holds
    for request in done:
        hittable = (request.num_prompt_tokens - 1) // BS * BS
        cached, recomputed = request.cached_tokens_by_tier, request.recomputed_tokens_by_tier
        assert sum(cached.values()) + sum(recomputed.values()) <= hittable
    admitted = done + [r for r in aborted if r.cached_tokens_by_tier is not None]
    reported = {t: sum(r.cached_tokens_by_tier[t] for r in admitted) // BS for t in TIER_NAMES}
    recomputed = {t: sum(r.recomputed_tokens_by_tier[t] for r in admitted) // BS for t in TIER_NAMES}
    assert kv.stats().hit_blocks == reported and kv.stats().queries == len(admitted)
    assert kv.stats().recomputed_blocks == recomputed


def test_a_span_of_a_requests_tokens_reads_across_its_prompt_and_its_output():
    request = new_request([10, 11, 12, 13], max_tokens=8)
    request.output_token_ids += [20, 21, 22]
    for start in range(8):
        for stop in range(start, 8):
            assert request.token_ids(start, stop) == request.all_token_ids[start:stop]


# ------------------------------------------------------------------ the engine: arrivals during a step


def test_a_question_arriving_during_a_step_is_looked_up_in_it_and_answered_as_without_a_cache(tmp_path):
    """The engine takes arrivals while the device computes a step (`LLMEngine.take_arrivals`, which the server's
    loop sets) and does the next step's admission work then: a question on a document the CPU tier holds is
    loading when the step it arrived in returns, the decoding request beside it goes on, and both get what
    they get from an engine without a cache."""
    from kvstrata import load_config
    from kvstrata.engine.llm_engine import LLMEngine

    def engine(caching: bool) -> LLMEngine:
        return LLMEngine(load_config({
            "model": {"name": "tiny-llama", "load_format": "dummy", "device": "cpu", "dtype": "float32"},
            "cache": {"enable_prefix_caching": caching, "offload": "write_through", "load_policy": "always_load",
                      "tiers": {"device": {"size": 256}, "cpu": {"size": 256 if caching else 0},
                                "disk": {"path": str(tmp_path / f"kv-{caching}"), "size": 0}}}}))

    document, question = list(range(100, 100 + 20 * BS)), [7, 8, 9]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    cached = engine(True)
    try:
        cached.add_request("document", document + [5], SamplingParams(max_tokens=1))
        while cached.has_unfinished_requests():
            cached.step()
        cached.hierarchy.wait_for_write_downs()
        assert cached.hierarchy.clear_device_cache()
        stream = cached.add_request("stream", list(range(300, 340)), SamplingParams(max_tokens=12, temperature=0.0))
        while len(stream.output_token_ids) < 2:
            cached.step()
        arrived = []
        cached.take_arrivals = lambda: arrived.append(cached.add_request("question", document + question, greedy))
        cached.step()
        assert len(arrived) == 1 and arrived[0].status == RequestStatus.LOADING
        cached.take_arrivals = None
        while cached.has_unfinished_requests():
            cached.step()
        answers = {r.request_id: r.output_token_ids for r in (stream, arrived[0])}
        assert arrived[0].cached_tokens_by_tier["cpu"] == 20 * BS
    finally:
        cached.close()
    uncached = engine(False)
    try:
        alone = [uncached.add_request("stream", list(range(300, 340)), SamplingParams(max_tokens=12, temperature=0.0)),
                 uncached.add_request("question", document + question, greedy)]
        while uncached.has_unfinished_requests():
            uncached.step()
        assert answers == {r.request_id: r.output_token_ids for r in alone}
    finally:
        uncached.close()


def test_no_block_a_step_computes_is_free_while_the_step_runs_so_a_load_started_then_cannot_overwrite_it():
    """Loads started in a step's shadow (`LLMEngine.take_arrivals`, `Scheduler.prepare_next_step`) copy into
    free blocks at once, beside the step on a GPU (tiers/transfer.py): so no block of the step may be free
    until the step has been read back. A document sent to be cached (prefill only) is the case: it finishes
    in the step that computes its last blocks."""
    from kvstrata import load_config
    from kvstrata.engine.llm_engine import LLMEngine

    engine = LLMEngine(load_config({
        "model": {"name": "tiny-llama", "load_format": "dummy", "device": "cpu", "dtype": "float32"},
        "cache": {"tiers": {"device": {"size": 256}, "cpu": {"size": 0}, "disk": {"size": 0}}}}))
    try:
        stream = engine.add_request("stream", list(range(300, 340)), SamplingParams(max_tokens=8, temperature=0.0))
        engine.step()
        document = engine.add_request("document", list(range(100, 100 + 4 * BS)), SamplingParams(max_tokens=1),
                                      prefill_only=True)
        in_shadow = []

        def look():  # what a load started now could be given, against what the step computes
            free = {b.block_id for b in engine.kv_manager.pool.free_block_queue.get_all_free_blocks()}
            in_step = {b for r in (stream, document) for b in engine.kv_manager.get_block_ids(r)}
            in_shadow.append((free & in_step, document.is_finished))

        engine.take_arrivals = look
        finished = engine.step()
        assert in_shadow == [(set(), False)], "a block the step computes was free during the step"
        assert document in finished and document.is_finished
        assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks - len(
            engine.kv_manager.get_block_ids(stream)), "the document's blocks were not freed after the step"
    finally:
        engine.close()


def test_a_head_recomputed_before_a_tail_the_device_holds_waits_for_room_instead_of_raising():
    """A prefix whose first block only the CPU tier holds and whose next ones are cached on the device:
    `auto` computes the first while the rest "loads" (from the device: nothing is read). Its prompt's
    other blocks are reserved as for any load, so it must wait when the device cannot hold them
    (found 1 time in 40: `cannot allocate 5 blocks: only 4 free`, raised on the step path)."""
    from kvstrata.engine.costs import ReadCost, StepCost

    kv = make_stack(device_blocks=16, cpu_blocks=16)
    kv.step_cost = StepCost(per_token_s=1e-3)
    kv.read_costs["cpu"] = ReadCost(1024, latency_s=0.0, per_block_s=8e-3)  # a block loads slower than it computes
    document = doc(41, 6 * BS + 1)
    run_request(kv, document)  # cached on the device and written through to the CPU tier
    hits = computed_blocks(kv, new_request(document))[0]
    kv.pool.free_blocks(hits[:1])  # to the free queue's tail, block 0 first: evicted before the others
    kv.pool.free_blocks(list(reversed(hits[1:])))
    others = kv.pool.get_new_blocks(kv.pool.num_free_blocks - 5)  # evicts block 0: 5 blocks left, all cached
    assert [kv.pool.get_cached_block(h) is not None for h in hashes_of(document)] == [False] + [True] * 5
    request = new_request(document + doc(42, 3 * BS))  # 10 blocks: 1 found in the CPU tier, 5 on the device
    scheduler = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=4)
    scheduler.add_request(request)
    assert fake_step(kv, scheduler) == [] and request.status == RequestStatus.WAITING  # no room: it waits
    assert not any(s.reserved for s in kv.states.values()) and kv.pool.num_free_blocks == 5
    kv.pool.free_blocks(others)
    while fake_step(kv, scheduler) != [request]:
        kv.wait_for_loads(timeout=10)
    assert request.num_cached_tokens + request.recomputed_tokens_by_tier["cpu"] == 6 * BS
    assert request.cached_tokens_by_tier["device"] == 5 * BS


@pytest.mark.parametrize("policy", ["fcfs", "uncached_first"])
def test_landed_loads_are_admitted_before_a_preempted_request_the_device_has_no_room_for(policy):
    """First come first served too: two loads land while the request preempted before them waits at the
    head of the queue for room that their blocks hold. Admitted first, they finish and make that room
    (behind it, all three waited for ever)."""
    kv = make_stack(device_blocks=23, cpu_blocks=32, gate_cpu=True)
    scheduler = Scheduler(kv, max_num_batched_tokens=256, max_num_seqs=4, policy=policy)
    big = new_request(doc(50, 12 * BS + 3), max_tokens=4)
    scheduler.add_request(big)
    fake_step(kv, scheduler)  # its prefill: 13 blocks
    documents = [doc(51 + d, 4 * BS + 1) for d in range(2)]
    for document in documents:
        put_below(kv, document, 4)
    kv.hierarchy.cpu.gate.clear()
    loading = [new_request(document) for document in documents]
    for request in loading:
        scheduler.add_request(request)
    fake_step(kv, scheduler)
    assert all(r.status == RequestStatus.LOADING for r in loading)  # 5 blocks each, held while they load
    assert kv.pool.num_free_blocks == 0
    scheduler._preempt(scheduler.running.pop())  # to the head of the queue: it needs 14 blocks, 13 are free
    kv.hierarchy.cpu.gate.set()
    kv.hierarchy.transfers.wait_idle()
    finished = []
    for _ in range(20):
        for request in fake_step(kv, scheduler):
            if len(request.output_token_ids) == request.sampling_params.max_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
                finished.append(request)
        if not scheduler.has_unfinished_requests():
            break
    assert finished[:2] == loading and finished[2:] == [big]
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
