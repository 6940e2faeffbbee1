"""KV events: what the tiers report, and the wire a router reads (vLLM's: ZMQ PUB + replay, msgpack)."""
from __future__ import annotations

import time

import msgpack
import msgspec
import pytest
import torch
import zmq

from kvstrata.cli import main
from kvstrata.engine.config import ConfigError, load_config
from kvstrata.serving.events import (BlockIndex, KVEventPublisher, KVEventSubscriber, ReceivedBatch, WireFormat,
                                     decode_batch, encode_batch)
from kvstrata.tiers.block_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvstrata.tiers.cpu import CpuTier
from kvstrata.tiers import lmdb_store
from kvstrata.tiers.disk import DiskTier
from server_process import free_ports
from tier_cases import BF16, key, payload, tokens
from vllm_wire import LegacyEventBatch, VllmKVEventBatch


def events_config(**extra):
    pub, replay = free_ports(2)
    return load_config({"events": {"endpoint": f"tcp://127.0.0.1:{pub}",
                                   "replay_endpoint": f"tcp://127.0.0.1:{replay}", **extra}}).events


def put(tier, ids, parents=True):
    """Blocks 1, 2, 3, ... of one chain (each the parent of the next), or with `parents=False` blocks
    whose parents the tier is not told."""
    chain = [key(i - 1) if i > 1 else None for i in ids] if parents else None
    tier.put([key(i) for i in ids], [tokens(i) for i in ids], [payload(BF16, i) for i in ids], chain)


# -- what the lower tiers report ----------------------------------------------------------------

def test_cpu_tier_reports_puts_evictions_drops_and_clear_in_order():
    seen = []
    tier = CpuTier(BF16, capacity_blocks=2)
    tier.event_listener = seen.append
    put(tier, [1, 2])
    put(tier, [3])         # evicts 1
    tier.discard(key(2))
    tier.clear()
    assert seen == [BlockStored([key(1), key(2)], None, tokens(1) + tokens(2), BF16.block_size, "cpu"),
                    BlockRemoved([key(1)], "cpu"), BlockStored([key(3)], key(2), tokens(3), BF16.block_size, "cpu"),
                    BlockRemoved([key(2)], "cpu"), AllBlocksCleared("cpu")]


def test_a_stored_event_holds_one_run_of_a_chain_and_blocks_of_unknown_parent_alone():
    """As vLLM's: a BlockStored's blocks are each the parent of the next, so a consumer that rebuilds
    chains from events (a radix-tree router) never links blocks that are not linked."""
    seen = []
    tier = CpuTier(BF16, capacity_blocks=8)
    tier.event_listener = seen.append
    put(tier, [5, 7], parents=False)
    tier.put([key(1), key(2), key(4)], [tokens(1), tokens(2), tokens(4)], [payload(BF16, i) for i in (1, 2, 4)],
             [None, key(1), key(3)])  # 4's parent is not 2: a second run
    assert seen == [BlockStored([key(5)], None, tokens(5), BF16.block_size, "cpu"),
                    BlockStored([key(7)], None, tokens(7), BF16.block_size, "cpu"),
                    BlockStored([key(1), key(2)], None, tokens(1) + tokens(2), BF16.block_size, "cpu"),
                    BlockStored([key(4)], key(3), tokens(4), BF16.block_size, "cpu")]


def test_disk_tier_reports_what_it_committed_and_what_its_lru_evicted(tmp_path):
    seen = []
    record_nbytes = DiskTier(BF16, str(tmp_path / "probe"), 1 << 20).codec.record_nbytes
    tier = DiskTier(BF16, str(tmp_path / "kv"), 2 * record_nbytes, check_integrity=False)
    tier.event_listener = seen.append
    put(tier, [1, 2])
    tier.flush()
    put(tier, [3])
    tier.flush()
    tier.clear()
    tier.close()
    assert seen == [BlockStored([key(1), key(2)], None, tokens(1) + tokens(2), BF16.block_size, "disk"),
                    BlockRemoved([key(1)], "disk"), BlockStored([key(3)], key(2), tokens(3), BF16.block_size, "disk"),
                    AllBlocksCleared("disk")]


def test_a_disk_store_reopened_by_a_new_process_reports_every_block_it_holds_in_runs_of_its_chains(tmp_path):
    """A replica restarted on its disk store tells its new listener (the router, through the replay buffer) what
    the store holds, so that the prompts on those blocks are sent to it again: in runs of one chain, each with
    the parent its put named, as the events of the puts did. A block whose parent the store does not know (one
    stored before it kept parents) and a record of another layout (every read of it misses) are left out."""
    tier = DiskTier(BF16, str(tmp_path / "kv"), 1 << 24, check_integrity=False)
    put(tier, [1, 2, 3])
    put(tier, [5], parents=False)
    tier.flush()
    tier.close()
    store = lmdb_store.LmdbStore.open(str(tmp_path / "kv"), 1 << 26, 1 << 24, check_integrity=False)
    with store.begin(write=True) as txn:
        txn.put(key(8), tier.codec.encode(tokens(8), payload(BF16, 8)), db=store.blocks)  # no parent kept
        txn.put(key(9), bytes(tier.codec.record_nbytes), db=store.blocks)                  # not a record
        txn.put(key(9), b"", db=store.parents)
    store.close()
    seen = []
    reopened = DiskTier(BF16, str(tmp_path / "kv"), 1 << 24, check_integrity=False)
    reopened.event_listener = seen.append
    reopened.report_contents()
    reopened.close()
    assert sorted(seen, key=lambda e: e.block_hashes[0]) == sorted([
        BlockStored([key(1), key(2), key(3)], None, tokens(1) + tokens(2) + tokens(3), BF16.block_size, "disk"),
        BlockStored([key(5)], None, tokens(5), BF16.block_size, "disk")], key=lambda e: e.block_hashes[0])


def test_the_reported_chains_run_parent_first_with_evicted_parents_named():
    from kvstrata.tiers.disk import parents_first

    blocks = {b"c": (b"b", ()), b"a": (None, ()), b"b": (b"a", ()), b"x": (b"gone", ()), b"y": (b"x", ()),
              b"b2": (b"a", ())}
    order = parents_first(blocks)
    assert sorted(order) == sorted(blocks)
    assert all(order.index(parent) < order.index(h) for h, (parent, _) in blocks.items() if parent in blocks)
    # depth first: a chain's blocks follow one another, so each chain is one event's run
    assert order.index(b"c") == order.index(b"b") + 1 and order.index(b"y") == order.index(b"x") + 1
    assert parents_first({b"p": (b"q", ()), b"q": (b"p", ())}) == []  # a loop (damage) has no first block


def test_a_hierarchy_has_its_disk_tier_report_what_it_holds_once_a_listener_is_attached(tmp_path):
    from kvstrata.tiers.block_pool import BlockPool
    from kvstrata.tiers.hierarchy import TierHierarchy

    tier = DiskTier(BF16, str(tmp_path / "kv"), 1 << 24, check_integrity=False)
    put(tier, [1, 2])
    tier.flush()
    seen = []
    pool = BlockPool(4, enable_caching=True)
    hierarchy = TierHierarchy(pool, torch.zeros(4, *BF16.block_shape, dtype=BF16.dtype), disk=tier,
                              event_listener=seen.append)
    hierarchy.close()
    assert {h for e in seen if isinstance(e, BlockStored) and e.medium == "disk" for h in e.block_hashes} == \
        {key(1), key(2)}


def test_a_tier_without_a_listener_builds_no_event():
    tier = CpuTier(BF16, capacity_blocks=1)
    assert tier.event_listener is None and tier._events() is None
    put(tier, [1, 2])  # nothing to report to, nothing fails


# -- the wire -----------------------------------------------------------------------------------

def subscribe(config) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(config.endpoint)
    return sub


def publish_until_heard(publisher, sub, event) -> list[bytes]:
    """PUB drops what it sends before a subscriber's connection is up: send until one arrives."""
    for _ in range(100):
        publisher(event)
        if sub.poll(100):
            return sub.recv_multipart()
    raise AssertionError("no batch reached the subscriber")


def published_payload(config, event) -> bytes:
    with KVEventPublisher(config) as publisher:
        sub = subscribe(publisher.config)
        topic, seq, payload = publish_until_heard(publisher, sub, event)
        sub.close()
    assert topic == b"" and len(seq) == 8
    return payload


WIRE_EVENTS = [BlockStored([b"\x01" * 16, b"\x02" * 16], b"\x09" * 16, list(range(32)), 16, "cpu"),
               BlockRemoved([b"\x01" * 16], "device"), AllBlocksCleared("disk")]


FORMATS = [("vllm", VllmKVEventBatch), ("vllm_legacy", LegacyEventBatch)]


@pytest.mark.parametrize("fmt, batch_type", FORMATS)
def test_a_router_reading_vllm_events_decodes_ours(fmt, batch_type):
    payload = published_payload(events_config(format=fmt), WIRE_EVENTS[0])
    batch = msgspec.msgpack.Decoder(batch_type).decode(payload)
    assert batch.ts == pytest.approx(time.time(), abs=60) and batch.data_parallel_rank == 0
    stored = batch.events[0]
    assert type(stored).__name__.endswith("BlockStored")
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size, stored.lora_id,
            stored.medium, stored.lora_name) == ([b"\x01" * 16, b"\x02" * 16], b"\x09" * 16, list(range(32)), 16,
                                                 None, "CPU", None)
    if fmt == "vllm":  # one group, full attention, no extra keys told
        assert (stored.group_idx, stored.kv_cache_spec_kind, stored.extra_keys) == (0, "full_attention", None)


def test_a_vllm_decoder_rejects_what_it_cannot_read_so_the_mirror_can_fail():
    """The mirrored structs are as strict as vLLM's: a batch sent as a map, or current events read as
    legacy arrays, do not decode."""
    as_map = msgpack.packb({"ts": 1.0, "events": []})
    with pytest.raises(msgspec.ValidationError, match="Expected `array`, got `object`"):
        msgspec.msgpack.Decoder(VllmKVEventBatch).decode(as_map)
    with pytest.raises(msgspec.ValidationError, match="Expected `object`, got `array`"):
        msgspec.msgpack.Decoder(VllmKVEventBatch).decode(encode_batch(WIRE_EVENTS, 1.5, WireFormat(maps=False)))


@pytest.mark.parametrize("fmt, batch_type", FORMATS)
@pytest.mark.parametrize("int_hashes", [False, True])
def test_every_event_kind_decodes_in_both_formats_with_vllm_media_and_hashes(fmt, batch_type, int_hashes):
    fmt_ = WireFormat(maps=fmt == "vllm", int_hashes=int_hashes)
    batch = msgspec.msgpack.Decoder(batch_type).decode(encode_batch(WIRE_EVENTS, 1.5, fmt_))
    stored, removed, cleared = batch.events
    h1 = int.from_bytes(b"\x01" * 8, "big") if int_hashes else b"\x01" * 16
    assert stored.block_hashes[0] == h1 and removed.block_hashes == [h1]
    assert stored.parent_block_hash == (int.from_bytes(b"\x09" * 8, "big") if int_hashes else b"\x09" * 16)
    assert (stored.medium, removed.medium) == ("CPU", "GPU")
    assert type(cleared).__name__.endswith("AllBlocksCleared")
    # Our own reader gives back our tiers' names, whichever form it reads.
    _, ours = decode_batch(encode_batch(WIRE_EVENTS, 1.5, fmt_))
    assert [e.medium for e in ours] == ["cpu", "device", "disk"]


LOWER_TIER_EVENTS = [BlockStored([b"\x01" * 16], None, list(range(16)), 16, "disk"),
                     BlockStored([b"\x02" * 16], None, list(range(16)), 16, "remote"),
                     BlockRemoved([b"\x01" * 16], "disk"), BlockRemoved([b"\x02" * 16], "remote")]


@pytest.mark.parametrize("names, media", [("vllm", [("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")] * 2),
                                          ("kvstrata", [("DISK", "LOCAL"), ("REMOTE", "REMOTE")] * 2)])
def test_disk_and_remote_go_out_under_vllm_media_names_or_ours_and_come_back_apart(names, media):
    """vLLM names every offloading tier STORAGE and tells local from shared storage by `locality`."""
    fmt = WireFormat.of(events_config(medium_names=names))
    payload = encode_batch(LOWER_TIER_EVENTS, 1.5, fmt)
    batch = msgspec.msgpack.Decoder(VllmKVEventBatch).decode(payload)
    assert [(e.medium, e.locality) for e in batch.events] == media
    _, ours = decode_batch(payload)
    assert ours == LOWER_TIER_EVENTS


def test_vllm_media_names_are_the_default_and_a_bad_name_is_a_one_line_error():
    assert events_config().medium_names == "vllm"
    with pytest.raises(ConfigError) as error:
        events_config(medium_names="gpu")
    assert str(error.value) == "events.medium_names: unknown value 'gpu' (expected 'vllm' or 'kvstrata')"


def test_batches_of_an_older_kvstrata_publisher_still_decode():
    """Before it matched vLLM's array batch, kvstrata sent the batch as a map: `kvstrata route` in front
    of replicas not yet upgraded keeps reading them."""
    old = msgpack.packb({"ts": 2.0, "events": [{"type": "BlockRemoved", "block_hashes": [b"a"], "medium": "DISK"}]})
    assert decode_batch(old) == (2.0, [BlockRemoved([b"a"], "disk")])


def test_the_router_index_matches_a_publisher_sending_int_hashes():
    index = BlockIndex()
    _, events = decode_batch(encode_batch([BlockStored([b"\x01" * 16, b"\x02" * 16], None, [], 1, "device")], 0.0,
                                          WireFormat(int_hashes=True)))
    for event in events:
        index.apply(event)
    assert index.prefix_length([b"\x01" * 16, b"\x02" * 16, b"\x03" * 16], ("device",)) == 2


def test_vllm_kv_events_config_names_are_accepted():
    config = events_config(buffer_steps=7, max_queue_size=9, publisher="zmq")
    assert (config.replay_buffer, config.queue_size, config.format, config.int_hashes) == (7, 9, "vllm", False)


def test_a_subscriber_that_missed_batches_recovers_them_through_replay():
    with KVEventPublisher(events_config()) as publisher:
        probe = subscribe(publisher.config)
        publish_until_heard(publisher, probe, BlockRemoved([b"warm-up"], "device"))  # the sockets are up
        probe.close()
        subscriber = KVEventSubscriber(publisher.config.endpoint, publisher.config.replay_endpoint)
        first = []
        while not first:  # joins late: everything published so far comes through replay
            publisher(BlockStored([b"a"], None, [1], 1, "device"))
            first = subscriber.poll(200)
        assert [b.seq for b in first] == list(range(len(first)))
        lost = []
        for n in range(2):  # the network loses the next two batches
            publisher(BlockStored([bytes([n])], None, [n], 1, "cpu"))
            assert subscriber._sub.poll(2000)
            lost.append(subscriber._sub.recv_multipart())
        publisher(AllBlocksCleared("cpu"))
        recovered = subscriber.poll(2000)
        subscriber.close()
    assert [b.seq for b in recovered] == [int.from_bytes(m[1], "big") for m in lost] + [lost[-1][1][-1] + 1]
    assert [b.events for b in recovered] == [[BlockStored([b"\x00"], None, [0], 1, "cpu")],
                                             [BlockStored([b"\x01"], None, [1], 1, "cpu")],
                                             [AllBlocksCleared("cpu")]]
    assert subscriber.missed_batches == 0


def test_a_full_queue_drops_events_and_counts_them_without_blocking():
    publisher = KVEventPublisher(events_config(queue_size=1))
    publisher._stopping.set()  # the thread stops taking: the queue fills
    publisher._thread.join()
    for _ in range(3):
        publisher(BlockRemoved([b"x"], "device"))
    assert publisher.dropped_events >= 2
    publisher._pub.close(linger=0)
    publisher._replay.close(linger=0)


def test_block_index_follows_stored_removed_and_cleared_per_medium():
    index = BlockIndex()
    for event in (BlockStored([b"a", b"b", b"c"], None, [], 1, "device"), BlockStored([b"a", b"b"], None, [], 1, "cpu"),
                  BlockRemoved([b"b"], "device")):
        index.apply(event)
    assert index.prefix_length([b"a", b"b", b"c"], ("device",)) == 1
    assert index.prefix_length([b"a", b"b", b"c"], ("device", "cpu")) == 3
    index.apply(AllBlocksCleared("cpu"))
    assert index.prefix_length([b"a", b"b", b"c"], ("device", "cpu")) == 1


# -- configuration ------------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint, message", [
    ("udp://127.0.0.1:5557", "events.endpoint: expected tcp://host:port or ipc://path, got 'udp://127.0.0.1:5557'"),
    ("tcp://127.0.0.1:99999", "events.endpoint: port must be in 1..65535, got 99999"),
    ("tcp://*:65535", "events.replay_endpoint: tcp://*:65535 leaves no next port for replay: set "
                      "events.replay_endpoint"),
])
def test_a_bad_events_endpoint_is_a_one_line_config_error(endpoint, message):
    with pytest.raises(ConfigError) as error:
        load_config({"events": {"endpoint": endpoint}})
    assert str(error.value) == message


def test_the_replay_endpoint_defaults_to_the_next_port():
    assert load_config({"events": {"endpoint": "tcp://127.0.0.1:5557"}}).events.replay_endpoint == "tcp://127.0.0.1:5558"


def test_serve_with_an_events_endpoint_in_use_says_so_in_one_line(capsys):
    busy = zmq.Context.instance().socket(zmq.PUB)
    port = busy.bind_to_random_port("tcp://127.0.0.1")
    try:
        code = main(["serve", "--port", "0", "--set", f"events.endpoint=tcp://127.0.0.1:{port}"])
    finally:
        busy.close(linger=0)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == f"kvstrata: error: events.endpoint: cannot bind tcp://127.0.0.1:{port}: Address already in use"


# -- the engine's events, end to end ------------------------------------------------------------

def collect_until(subscriber: KVEventSubscriber, done, timeout: float = 60.0) -> list:
    events, deadline = [], time.monotonic() + timeout
    while not (events and done(events)):
        assert time.monotonic() < deadline, f"events so far: {events}"
        for batch in subscriber.poll(100):
            events += batch.events
    return events


@pytest.mark.slow
def test_a_subscriber_sees_device_cpu_and_disk_blocks_come_and_go(tmp_path, embedded_model_fp32):
    from kvstrata import LLM, SamplingParams

    config = {"model": {"dtype": "float32", "device": "cpu"},
              "cache": {"tiers": {"device": {"size": 4}, "cpu": {"size": 4},
                                  "disk": {"path": str(tmp_path / "kv"), "size": "64MiB"}}}}
    publisher = KVEventPublisher(events_config())
    subscriber = KVEventSubscriber(publisher.config.endpoint, publisher.config.replay_endpoint)
    llm = LLM(load_config(config), loaded_model=embedded_model_fp32, events=publisher)
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    doc_a, doc_b = list(range(1000, 1050)), list(range(2000, 2050))  # 3 full blocks each, 4 device blocks a request
    hashes_a, hashes_b = (llm.engine.kv_manager.hasher.hash(doc)[:3] for doc in (doc_a, doc_b))
    llm.generate(doc_a, one_token)
    llm.generate(doc_b, one_token)  # reuses A's device slots; B's blocks push two of A's out of the CPU tier to disk
    llm.engine.hierarchy.wait_for_write_downs()
    llm.engine.hierarchy.disk.flush()
    assert llm.reset_prefix_cache()
    events = collect_until(subscriber, lambda seen: isinstance(seen[-1], AllBlocksCleared))
    llm.close()
    publisher.close()
    subscriber.close()

    def where(kind, medium):
        return [(k, h) for k, e in enumerate(events) if isinstance(e, kind) and e.medium == medium
                for h in e.block_hashes]

    assert events[0] == BlockStored(hashes_a, None, doc_a[:48], 16, "device")
    device_stored_b = next(k for k, e in enumerate(events) if e == BlockStored(hashes_b, None, doc_b[:48], 16, "device"))
    assert sorted(h for _, h in where(BlockRemoved, "device")) == sorted(hashes_a)
    assert all(k < device_stored_b for k, _ in where(BlockRemoved, "device"))
    assert [h for _, h in where(BlockStored, "cpu")] == hashes_a + hashes_b  # write-through, in order
    cascaded = [h for _, h in where(BlockStored, "disk")]
    assert cascaded and set(cascaded) <= set(hashes_a)
    removed_from_cpu = dict((h, k) for k, h in where(BlockRemoved, "cpu"))
    assert set(removed_from_cpu) == set(cascaded)
    assert events[-1] == AllBlocksCleared("device")
    # Every BlockStored, in every medium, is a run of one chain and names the parent of its first block.
    parent_of = {h: (chain[k - 1] if k else None) for chain in (hashes_a, hashes_b) for k, h in enumerate(chain)}
    for event in events:
        if isinstance(event, BlockStored):
            assert event.parent_block_hash == parent_of[event.block_hashes[0]], event
            assert all(parent_of[b] == a for a, b in zip(event.block_hashes, event.block_hashes[1:])), event
    index = BlockIndex()
    for event in events:
        index.apply(event)
    assert index.prefix_length(hashes_b, ("device",)) == 0 and index.prefix_length(hashes_b, ("cpu",)) == 3



@pytest.mark.slow
def test_the_python_api_publishes_when_its_config_has_events(embedded_model_fp32):
    from kvstrata import LLM, SamplingParams

    pub, replay = free_ports(2)
    config = load_config({"model": {"dtype": "float32", "device": "cpu"},
                          "events": {"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}})
    subscriber = KVEventSubscriber(config.events.endpoint, config.events.replay_endpoint)
    with LLM(config, loaded_model=embedded_model_fp32) as llm:
        llm.generate(list(range(1000, 1050)), SamplingParams(max_tokens=1, temperature=0.0))
        events = collect_until(subscriber, lambda seen: any(isinstance(e, BlockStored) for e in seen))
    subscriber.close()
    assert next(e for e in events if isinstance(e, BlockStored)).medium == "device"


def test_drain_timeout_fits_kubernetes_grace_and_write_back_means_on_evict():
    config = load_config({"cache": {"offload": "write_back"}})
    assert config.cache.offload == "on_evict"
    assert 0 < config.server.drain_timeout < 30
    assert load_config(None, ["server.drain_timeout=5s"]).server.drain_timeout == 5.0


@pytest.mark.slow
def test_an_engine_restarted_on_its_disk_store_names_its_blocks_and_the_router_sends_their_prompts_back(
        tmp_path, embedded_model_fp32):
    """The first engine caches a document and exits; the second opens the same disk store with a publisher: its
    first events name the document's blocks on disk, so a router that follows them places the document's next
    question on this replica rather than on one that would load it from the remote tier or compute it."""
    from kvstrata import LLM, SamplingParams
    from kvstrata.engine.config import ReplicaConfig
    from kvstrata.serving.router import Replica, ReplicaSet

    config = load_config({"model": {"dtype": "float32", "device": "cpu"},
                          "cache": {"tiers": {"device": {"size": 16}, "cpu": {"size": 16},
                                              "disk": {"path": str(tmp_path / "kv"), "size": "64MiB"}}}})
    doc = list(range(1000, 1050))  # 3 full blocks
    with LLM(config, loaded_model=embedded_model_fp32) as first:
        first.generate(doc, SamplingParams(max_tokens=1, temperature=0.0))
        hashes = first.engine.kv_manager.hasher.hash(doc)[:3]
    publisher = KVEventPublisher(events_config())
    subscriber = KVEventSubscriber(publisher.config.endpoint, publisher.config.replay_endpoint)
    try:
        with LLM(config, loaded_model=embedded_model_fp32, events=publisher):
            events = collect_until(subscriber, lambda seen: sum(
                len(e.block_hashes) for e in seen if isinstance(e, BlockStored) and e.medium == "disk") >= 3)
    finally:
        publisher.close()
        subscriber.close()
    restarted, other = (Replica(ReplicaConfig(url=f"http://127.0.0.1:{port}"), None) for port in (1, 2))
    restarted.in_flight = 1  # busier than the other: only what it holds can draw the request
    replicas = ReplicaSet([restarted, other])
    replicas.apply(restarted, [ReceivedBatch(0, 0.0, events)])
    assert replicas.choose(dict.fromkeys(replicas.replicas, hashes), set()) == (restarted, 3)  # both name blocks alike
