"""The remote tier's reader processes, against real valkey-server processes: blocks read into shared host memory
are read by another process, with its own connection, verified there, and come out byte-exact; what does not
verify is a counted miss, deleted from the server; a dead server is a run of misses and one logged outage, and the
readers use it again once it is back; a cluster that fails over is found again; a reader that dies costs no block;
the password never shows."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from test_remote_tier import PASSWORD, damage_blocks_1_and_2, tier_on, wait_until, written
from tier_cases import BF16, FP32, by_processes, get_blocks, key, kill_a_reader_and_read_on, read_shared, tokens
from valkey_server import ValkeyServer, valkey_cluster



@pytest.fixture
def server():
    with ValkeyServer() as s:
        yield s


@pytest.mark.parametrize("layout", [BF16, FP32], ids=["bf16", "fp32"])
def test_blocks_read_by_reader_processes_are_the_stored_bytes(server, layout):
    tier = tier_on(server.url, layout, read_processes=2)
    written(tier, range(12), layout)
    assert read_shared(tier, [*range(12), 99], layout) == [True] * 12 + [False]
    stats = tier.stats()
    assert (stats.hits, stats.misses, by_processes(tier)) == (12, 1, 12)
    assert stats.extra["read_processes"] == 2
    assert get_blocks(tier, range(3), layout) == [True] * 3  # private memory: read in this process
    assert by_processes(tier) == 12 and tier.stats().hits == 15
    tier.close()


def test_a_damaged_or_foreign_value_read_by_a_reader_is_a_counted_miss_and_is_deleted(server):
    tier = tier_on(server.url, read_processes=1)
    written(tier, range(4))
    raw = damage_blocks_1_and_2(server, tier)
    assert read_shared(tier, range(4), toks=[tokens(0), tokens(1), tokens(2), tokens(9)]) == [True, False, False,
                                                                                              False]
    tier.flush()
    assert tier.stats().corrupt == 3 and by_processes(tier) == 1
    assert raw.exists(*(tier._key(key(i)) for i in (1, 2, 3))) == 0  # the other tokens' record went too
    tier.close()


def test_a_ttl_is_restarted_by_a_readers_read(server):
    tier = tier_on(server.url, ttl=60.0, read_processes=1)
    written(tier, [0])
    raw = server.client()
    raw.pexpire(tier._key(key(0)), 5000)
    assert read_shared(tier, [0]) == [True] and by_processes(tier) == 1
    assert raw.pttl(tier._key(key(0))) > 50_000
    tier.close()


def test_a_dead_server_is_misses_through_the_readers_and_a_restarted_one_is_read_again(server, caplog):
    tier = tier_on(server.url, timeout=0.2, read_processes=1)
    written(tier, range(4))
    assert read_shared(tier, range(4)) == [True] * 4
    server.kill()
    with caplog.at_level(logging.WARNING, logger="kvstrata.tiers.remote"):
        for _ in range(3):
            assert read_shared(tier, range(4)) == [False] * 4
    stats = tier.stats()
    assert stats.extra["faults"] >= 1 and stats.extra["outages"] == 1 and not stats.extra["reachable"]
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1, "an outage is logged once"

    server.start()  # an empty server on the same port: the reader connects again after the tier's backoff
    wait_until(lambda: (written(tier, range(4)), read_shared(tier, range(4)))[-1] == [True] * 4)
    before = by_processes(tier)
    assert read_shared(tier, range(4)) == [True] * 4 and by_processes(tier) == before + 4
    assert tier.stats().extra["reachable"]
    tier.close()


def test_a_killed_reader_costs_no_block_and_is_replaced(server, caplog):
    tier = tier_on(server.url, read_processes=1)
    written(tier, range(4))
    kill_a_reader_and_read_on(tier, caplog)
    pids = tier._readers.pids
    tier.close()
    for pid in pids:  # closing the tier ends them
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_cluster_is_read_by_the_readers_and_found_again_after_a_failover():
    with valkey_cluster(3, replicas=1) as nodes:
        tier = tier_on(nodes[0].url, cluster=True, read_processes=1)
        written(tier, range(24))
        assert read_shared(tier, range(24)) == [True] * 24 and by_processes(tier) == 24
        nodes[0].client().execute_command("WAIT", 1, 5000)  # its replica has every block before it dies
        nodes[0].kill()  # the node in the URL: the reader must find the cluster through the nodes it learned
        assert read_shared(tier, range(24)) == [False] * 24
        wait_until(lambda: b"cluster_state:ok" in nodes[1].client().execute_command("CLUSTER", "INFO"), timeout=30)
        wait_until(lambda: read_shared(tier, range(24)) == [True] * 24, timeout=30)
        before = by_processes(tier)  # (a read while the cluster settled may have been served in part)
        assert read_shared(tier, range(24)) == [True] * 24 and by_processes(tier) == before + 24
        tier.close()


def test_the_password_reaches_the_readers_but_never_a_log(caplog):
    with ValkeyServer(password=PASSWORD) as server:
        tier = tier_on(server.url, timeout=0.2, read_processes=1)
        written(tier, range(2))
        wrong = tier_on(server.url.replace(PASSWORD, PASSWORD + "x"), timeout=0.2, read_processes=1)
        with caplog.at_level(logging.DEBUG):
            assert read_shared(tier, range(2)) == [True, True] and by_processes(tier) == 2
            wait_until(lambda: wrong.stats().extra["faults"] == 1 and wrong.health.usable())  # its connecting
            assert read_shared(wrong, range(2)) == [False, False]  # refused: a fault, said by the reader
            assert wrong.stats().extra["faults"] == 2
            server.kill()
            assert read_shared(tier, range(2)) == [False, False]
        assert tier.stats().extra["faults"] >= 1
        assert any("remote tier" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)
        shown = [r.getMessage() for r in caplog.records] + [str(tier.stats()), str(wrong.stats())]
        assert all(PASSWORD not in text for text in shown)
        tier.close()
        wrong.close()


def remote_hit(llm, prompt: list[int]) -> int:
    """The remote-tier tokens the prompt is served once its blocks are on the server only; its greedy answer is
    the one computed before."""
    from kvstrata import SamplingParams
    greedy = SamplingParams(max_tokens=4, temperature=0)
    first = llm.generate(prompt, greedy)[0]
    llm.engine.hierarchy.wait_for_write_downs()
    llm.engine.hierarchy.remote.flush()
    assert llm.engine.hierarchy.clear_device_cache()
    again = llm.generate(prompt, greedy)[0]
    assert again.token_ids == first.token_ids
    return again.cached_tokens_by_tier["remote"]


@pytest.mark.parametrize("read_processes", [None, 0], ids=["default", "none"])
def test_an_engines_remote_hits_are_read_by_its_readers_unless_none_are_asked_for(server, read_processes):
    from kvstrata import LLM, load_config
    remote = {"url": server.url, "timeout": "1s"}
    if read_processes is not None:
        remote["read_processes"] = read_processes
    config = {"model": {"name": "tiny-llama", "load_format": "dummy", "dtype": "float32", "device": "cpu"},
              # always_load: with a model this small, recomputing a document may cost less than reading it
              "cache": {"load_policy": "always_load", "offload": "write_through",
                        "tiers": {"device": {"size": 64}, "remote": remote}}}
    with LLM(load_config(config)) as llm:
        remote_tokens = remote_hit(llm, [100 + i for i in range(200)])
        extra = llm.stats()["tiers"]["remote"]["extra"]
    assert remote_tokens >= 192
    if read_processes is None:
        assert extra["read_processes"] >= 1 and extra["blocks_read_by_processes"] >= 12
    else:
        assert (extra["read_processes"], extra["blocks_read_by_processes"]) == (0, 0)


def test_reader_processes_import_neither_torch_nor_the_engine():
    """A reader starts in a tenth of a second, in place of a dead one too: it must not pay for torch."""
    code = ("import sys, kvstrata.tiers.disk_reader, kvstrata.tiers.remote_reader; "
            "print(sorted(m for m in ('torch', 'kvstrata.engine', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"
