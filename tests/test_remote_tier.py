"""The remote tier, against real valkey-server processes on loopback ports: what one replica puts another
serves back byte-exact, on a single node and on a 3-node cluster; every fault (a killed or hung
server, a damaged or foreign value, a full server) is a counted miss or a counted dropped write,
never an exception; a restarted server is used again by the same tier; tenants never share blocks;
and the URL's password never shows."""
from __future__ import annotations

import logging
import signal
import time

import pytest
import torch
from tier_cases import BF16, FP32, get_blocks, key, payload, put_blocks, tokens
from valkey_server import ValkeyServer, valkey_cluster

from kvstrata import load_config
from kvstrata.engine.config import ConfigError
from kvstrata.engine.hashing import BlockHasher, make_namespace
from kvstrata.tiers.base import BlockLayout
from kvstrata.tiers.record import RecordCodec
from kvstrata.tiers.remote import RemoteTier

PASSWORD = "pa55-w0rd-never-shown"


def wait_until(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture
def server():
    with ValkeyServer() as s:
        yield s


def tier_on(url: str, layout: BlockLayout = BF16, **options) -> RemoteTier:
    options.setdefault("timeout", 0.5)  # generous on a busy 2-core machine; faults still end as misses
    return RemoteTier(layout, url, **options)


def written(tier: RemoteTier, ids, layout: BlockLayout = BF16) -> None:
    put_blocks(tier, ids, layout)
    tier.flush()


def test_blocks_one_replica_puts_are_served_to_another(server):
    a, b = tier_on(server.url), tier_on(server.url)
    written(a, range(6))
    assert b.count_prefix([key(i) for i in range(6)]) == 6
    assert b.count_prefix([key(0), key(1), key(99), key(2)]) == 2  # stops at the first block not held
    assert b.held([key(0), key(99), key(2)]) == [True, False, True]  # each, past a gap
    assert get_blocks(b, range(6)) == [True] * 6
    assert get_blocks(b, [7]) == [False]
    stats = b.stats()
    assert (stats.hits, stats.misses, a.stats().puts) == (6, 1, 6)
    a.close()
    b.close()


def test_writes_deletes_and_clears_are_reported_as_block_events_with_the_remote_medium(server):
    from kvstrata.tiers.block_events import AllBlocksCleared, BlockRemoved, BlockStored

    events = []
    tier = tier_on(server.url)
    tier.event_listener = events.append
    chain = [key(i) for i in range(3)]
    tier.put(chain, [tokens(i) for i in range(3)], [payload(BF16, i) for i in range(3)], [None, *chain[:2]])
    tier.flush()
    assert [type(e) for e in events] == [BlockStored]  # one run of a chain, one event, once the server took it
    assert events[0].medium == "remote" and events[0].block_hashes == chain and events[0].parent_block_hash is None
    assert events[0].token_ids == [t for i in range(3) for t in tokens(i)]
    assert tier.discard(key(1)) and not tier.discard(key(1))  # a key already gone is no event
    tier.clear()
    assert events[1:] == [BlockRemoved([key(1)], "remote"), AllBlocksCleared("remote")]
    tier.close()


def test_cluster_spreads_blocks_over_its_nodes_and_serves_them_all():
    with valkey_cluster(3) as nodes:
        a, b = tier_on(nodes[0].url, cluster=True), tier_on(nodes[2].url, cluster=True)
        written(a, range(24))
        assert all(n.client().dbsize() > 0 for n in nodes), "every node holds some of the blocks"
        assert b.count_prefix([key(i) for i in range(24)]) == 24
        assert b.count_prefixes([[key(i) for i in range(24)], [key(0), key(99), key(1)], []]) == [24, 1, 0]
        assert b.held([key(i) for i in range(30)]) == [True] * 24 + [False] * 6
        assert get_blocks(b, range(24)) == [True] * 24

        nodes[1].kill()  # a node gone: the pipelined read that needs it fails whole, as misses
        assert get_blocks(b, range(24)) == [False] * 24
        assert b.count_prefix([key(i) for i in range(24)]) == 0
        assert b.held([key(i) for i in range(24)]) == [False] * 24
        assert b.stats().extra["faults"] >= 1
        nodes[1].start()  # back on its port with its nodes.conf: the cluster and the tier take it again
        wait_until(lambda: b"cluster_state:ok" in nodes[1].client().execute_command("CLUSTER", "INFO"))
        written(a, range(24))
        wait_until(lambda: b.count_prefix([key(i) for i in range(24)]) == 24)
        assert get_blocks(b, range(24)) == [True] * 24
        a.close()
        b.close()

        for node in nodes:
            node.kill()  # the whole cluster down, even before a tier first connects: misses, drops
        late = tier_on(nodes[0].url, cluster=True, timeout=0.2)
        assert late.count_prefix([key(0)]) == 0 and get_blocks(late, [0]) == [False]
        written(late, [0])
        assert late.stats().extra["faults"] >= 1 and late.stats().extra["dropped_puts"] == 1
        late.close()


def test_a_cluster_that_fails_over_from_the_node_in_the_url_is_served_again_without_it():
    """Replicas name one node of a cluster in their URL. When that primary dies and its replica takes
    its slots, the tier must find the cluster through the nodes it learned, not wait for the dead one."""
    with valkey_cluster(3, replicas=1) as nodes:
        tier = tier_on(nodes[0].url, cluster=True)
        written(tier, range(24))
        nodes[0].client().execute_command("WAIT", 1, 5000)  # its replica has every block before it dies
        nodes[0].kill()
        start = time.monotonic()
        assert get_blocks(tier, range(24)) == [False] * 24  # a dead primary: misses, at once
        assert time.monotonic() - start < 5 * tier.timeout
        wait_until(lambda: b"cluster_state:ok" in nodes[1].client().execute_command("CLUSTER", "INFO"), timeout=30)
        wait_until(lambda: tier.count_prefix([key(i) for i in range(24)]) == 24, timeout=30)
        assert get_blocks(tier, range(24)) == [True] * 24
        written(tier, range(24, 30))  # and writes go to the new primary
        # another tier finds them through the new primary (its first lookup may time out on a busy machine:
        # a miss, then its backoff, then it asks again)
        fresh = tier_on(nodes[1].url, cluster=True)
        wait_until(lambda: fresh.count_prefix([key(i) for i in range(24, 30)]) == 6, timeout=30)
        tier.close()


def test_a_tier_idle_while_the_cluster_failed_over_is_served_at_once_afterwards():
    """A replica that did not touch the remote tier while a primary died and its replica took over still
    holds the old slot map. Its first lookup after the failover must find the new primary, not count a
    fault and serve misses then: the cluster's own recovery bounds the misses, not when traffic returns."""
    with valkey_cluster(3, replicas=1) as nodes:
        tier = tier_on(nodes[0].url, cluster=True)
        written(tier, range(24))
        nodes[1].client().execute_command("WAIT", 1, 5000)  # its replica has every block before it dies
        nodes[1].kill()
        wait_until(lambda: nodes[4].client().info("replication")["role"] == "master", timeout=30)
        wait_until(lambda: all(b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO")
                               for n in nodes if n is not nodes[1]), timeout=30)
        assert tier.count_prefix([key(i) for i in range(24)]) == 24
        assert get_blocks(tier, range(24)) == [True] * 24
        assert tier.stats().extra["faults"] == 0
        tier.close()


def test_killed_server_gives_misses_and_a_restarted_one_is_used_again(server, caplog):
    tier = tier_on(server.url, timeout=0.2)
    written(tier, range(4))
    server.kill()
    with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.remote"):
        for _ in range(3):
            assert tier.count_prefix([key(i) for i in range(4)]) == 0
            assert get_blocks(tier, range(4)) == [False] * 4
            put_blocks(tier, [10])
        tier.flush()
    stats = tier.stats()
    assert stats.extra["faults"] >= 1 and stats.extra["outages"] == 1 and not stats.extra["reachable"]
    assert stats.extra["dropped_puts"] >= 1
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1, "an outage is logged once"

    server.start()  # an empty server on the same port: the same tier object reconnects after its backoff
    wait_until(lambda: (put_blocks(tier, range(4)), tier.flush(), tier.count_prefix([key(0)]))[-1] == 1)
    assert get_blocks(tier, range(4)) == [True] * 4
    assert tier.stats().extra["reachable"]
    tier.close()


def test_hung_server_lookup_is_abandoned_as_a_miss(server):
    tier = tier_on(server.url, timeout=0.1)
    written(tier, range(2))
    server.process.send_signal(signal.SIGSTOP)  # accepts connections, never answers
    try:
        assert tier.count_prefix([key(0), key(1)]) == 0
        assert tier.stats().extra["faults"] >= 1
        fresh = tier_on(server.url, timeout=0.1)  # not backing off: it asks, and gives up at its timeout
        start = time.monotonic()
        assert fresh.held([key(0), key(1)]) == [False, False]
        assert time.monotonic() - start < 5 * fresh.timeout and fresh.stats().extra["faults"] == 1
    finally:
        server.process.send_signal(signal.SIGCONT)
    tier.close()
    fresh.close()


def test_full_write_queue_drops_puts_and_close_gives_up_on_a_hung_server(server, caplog):
    record_nbytes = RecordCodec(BF16).record_nbytes
    tier = tier_on(server.url, timeout=1.0, queue_bytes=3 * record_nbytes - 1)  # room for two records
    server.process.send_signal(signal.SIGSTOP)  # the writer's first batch now waits for its timeout
    try:
        put_blocks(tier, [0])
        time.sleep(0.2)  # the writer has taken block 0 and is waiting on the server
        with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.remote"):
            put_blocks(tier, range(1, 11))
        assert tier.stats().extra["dropped_puts"] >= 8  # beyond the queue's 2: dropped, not waited for
        assert [r.getMessage() for r in caplog.records if "write queue" in r.getMessage()] == [
            f"remote tier: the write queue for {server.url} is full (2 blocks waiting); dropping writes, counted in "
            "dropped_puts (cache.tiers.remote.queue_size bounds it)"]  # once, however many are dropped
        tier.close()  # the server never answers: close() ends anyway, counting what it could not send
        stats = tier.stats()
        assert stats.puts == 0 and stats.extra["dropped_puts"] == 11
    finally:
        server.process.send_signal(signal.SIGCONT)


def put_chain(tier: RemoteTier, ids) -> None:
    """Blocks `ids` as one chain: each one's parent is the block before it (block ids[0]'s, ids[0] - 1)."""
    ids = list(ids)
    tier.put([key(i) for i in ids], [tokens(i) for i in ids], [payload(BF16, i) for i in ids],
             [key(i - 1) for i in ids])


def test_a_chain_broken_by_a_dropped_block_is_not_sent_past_it_until_that_block_is(server):
    record_nbytes = RecordCodec(BF16).record_nbytes
    tier = tier_on(server.url, timeout=2.0, queue_bytes=2 * record_nbytes)  # room for two records
    server.process.send_signal(signal.SIGSTOP)  # the writer falls behind: blocks 3 and 4 are dropped for room
    try:
        put_chain(tier, range(1, 5))
    finally:
        server.process.send_signal(signal.SIGCONT)
    tier.flush()
    assert tier.stats().extra["dropped_puts"] == 2
    put_chain(tier, range(5, 7))  # room again, but their chain broke at block 3: no replica could reach them
    put_chain(tier, [20, 21])     # another chain is sent
    tier.flush()
    assert tier.stats().extra["dropped_puts"] == 4
    assert [tier.count_prefix([key(i)]) for i in (1, 2, 3, 5, 6, 20, 21)] == [1, 1, 0, 0, 0, 1, 1]
    for ids in (range(3, 5), range(5, 7)):  # the chain written again from where it broke: all of it is sent
        put_chain(tier, ids)
        tier.flush()
    assert tier.count_prefix([key(i) for i in range(1, 7)]) == 6
    assert get_blocks(tier, range(1, 7)) == [True] * 6
    tier.close()


def damage_blocks_1_and_2(server: ValkeyServer, tier: RemoteTier):
    """Block 1's record on the server with one payload bit flipped, block 2's replaced by bytes that are no
    record at all; returns a client of the server."""
    raw = server.client()
    stored = bytearray(raw.get(tier._key(key(1))))
    stored[-1] ^= 0xFF
    raw.set(tier._key(key(1)), bytes(stored))
    raw.set(tier._key(key(2)), b"not a block record at all")
    return raw


def test_damaged_value_is_a_counted_miss_and_is_deleted(server):
    tier = tier_on(server.url)
    written(tier, range(3))
    raw = damage_blocks_1_and_2(server, tier)
    assert get_blocks(tier, range(3)) == [True, False, False]
    tier.flush()
    assert tier.stats().corrupt == 2
    assert raw.exists(tier._key(key(1)), tier._key(key(2))) == 0
    tier.close()


def test_value_written_for_another_layout_or_tokens_is_a_miss(server):
    fp32, bf16 = tier_on(server.url, FP32), tier_on(server.url, BF16)
    written(fp32, [0], FP32)
    assert get_blocks(bf16, [0]) == [False]
    written(bf16, [1])
    assert get_blocks(bf16, [1], toks=[tokens(2)]) == [False]  # the same key, other token ids
    assert bf16.stats().corrupt == 2
    fp32.close()
    bf16.close()


def test_full_server_refuses_writes_which_are_counted_not_raised():
    with ValkeyServer("--maxmemory-policy", "noeviction") as server:
        raw = server.client()
        raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) + 64 * 1024)
        big = BlockLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)  # 32 KiB
        tier = tier_on(server.url, big)
        written(tier, range(12), big)
        stats = tier.stats()
        assert stats.extra["write_errors"] > 0 and stats.puts == 12 - stats.extra["write_errors"]
        served = get_blocks(tier, range(12), big)
        assert sum(served) == stats.puts
        tier.close()


def test_cache_salt_keeps_tenants_apart(server):
    namespace = make_namespace("some-model", "bfloat16", BF16.block_size, 1, "xxh3_128")
    hasher = BlockHasher(BF16.block_size, namespace, "xxh3_128")
    prompt = list(range(3 * BF16.block_size))
    tenant = {salt: hasher.hash(prompt, cache_salt=salt) for salt in ("alice", "bob", None)}
    tier = tier_on(server.url)
    blocks = [prompt[k * BF16.block_size:(k + 1) * BF16.block_size] for k in range(3)]
    tier.put(tenant["alice"], blocks, [payload(BF16, k) for k in range(3)])
    tier.flush()
    assert tier.count_prefix(tenant["alice"]) == 3
    assert tier.count_prefix(tenant["bob"]) == 0 and tier.count_prefix(tenant[None]) == 0
    other_model = BlockHasher(BF16.block_size, make_namespace("other-model", "bfloat16", BF16.block_size, 1,
                                                              "xxh3_128"), "xxh3_128")
    assert tier.count_prefix(other_model.hash(prompt, cache_salt="alice")) == 0
    tier.close()


def test_password_is_used_but_never_shown(caplog, capsys):
    with ValkeyServer(password=PASSWORD) as server:
        tier = tier_on(server.url, timeout=0.2)
        written(tier, range(2))
        assert get_blocks(tier, range(2)) == [True, True]
        wrong = tier_on(server.url.replace(PASSWORD, PASSWORD + "x"), timeout=0.2)
        with caplog.at_level(logging.DEBUG):
            assert wrong.count_prefix([key(0)]) == 0  # refused: a fault, logged without the password
            server.kill()
            assert get_blocks(tier, range(2)) == [False, False]
        assert any("remote tier" in r.getMessage() for r in caplog.records)
        shown = [r.getMessage() for r in caplog.records] + [str(tier.stats()), str(wrong.stats())]
        config = load_config({"cache": {"tiers": {"remote": {"url": server.url}}}})
        shown += [config.to_yaml(), repr(config), str(config.cache.tiers)]
        with pytest.raises(ConfigError) as bad:
            load_config({"cache": {"tiers": {"remote": {"url": server.url.replace("redis:", "http:")}}}})
        shown.append(str(bad.value))
        assert all(PASSWORD not in text for text in shown)
        assert "********" in config.to_yaml()
        tier.close()
        wrong.close()


def commands_run(server: ValkeyServer) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): stats["calls"]
            for name, stats in server.client().info("commandstats").items()}


def test_a_lookup_is_one_command_on_the_server_however_long_the_chain(server):
    tier = tier_on(server.url)
    written(tier, range(200))
    server.client().config_resetstat()
    chain = [key(i) for i in range(200)]
    assert tier.count_prefix(chain) == 200
    assert tier.count_prefix(chain[:150] + [key(999)] + chain[150:]) == 150  # stops at the first block not held
    assert tier.count_prefix([key(999), *chain]) == 0
    server.client().script_flush()  # a restarted server has forgotten the script: the lookup sends it again
    assert tier.count_prefix(chain) == 200
    run = commands_run(server)
    # a command per lookup, and a retry after the script was sent: by the first lookup on this new server, and by
    assert run["evalsha"] == 4 + 2 and run["script|load"] == 2  # the first after the flush
    assert run["exists"] == 200 + 151 + 1 + 200  # the script's own calls: each walk ends at the first block missing
    # many chains at once (a burst of requests): one round trip, the same answers as one at a time
    chains = [chain[:30], [key(999), *chain], [], chain[:5] + [key(998)] + chain[5:]]
    assert tier.count_prefixes(chains) == [tier.count_prefix(c) for c in chains] == [30, 0, 0, 5]
    assert tier.stats().extra["faults"] == 0
    tier.close()


def test_a_server_that_refuses_scripts_is_looked_up_one_exists_per_hash_with_the_same_answers(server, caplog):
    server.client().execute_command("ACL", "SETUSER", "no-scripts", "on", ">secret", "~*", "+@all", "-@scripting")
    tier = tier_on(server.url.replace("redis://", "redis://no-scripts:secret@"))
    written(tier, range(20))
    with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.remote"):
        assert tier.count_prefix([key(i) for i in range(20)]) == 20
        assert tier.count_prefix([key(0), key(1), key(99), key(2)]) == 2
        assert tier.contains(key(5)) and not tier.contains(key(99))
        chains = [[key(i) for i in range(20)], [key(99)], [], [key(0), key(98), key(1)]]
        assert tier.count_prefixes(chains) == [tier.count_prefix(c) for c in chains] == [20, 0, 0, 1]
    refusals = [r.getMessage() for r in caplog.records if "refused the lookup script" in r.getMessage()]
    assert len(refusals) == 1 and "secret" not in refusals[0]  # logged once, the password masked
    assert commands_run(server)["exists"] >= 20 + 3 + 2 + 2 * (20 + 1 + 3)
    assert tier.stats().extra["faults"] == 0 and not tier.health.down
    tier.close()
