"""`kvstrata plan`: the replay against an independent LRU, its command line, sweeps, replicas, and the
server's own trace (`server.trace_log`)."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from benchmarks.planner import lru_hit_ratio
from kvstrata.cli import main
from kvstrata.engine.async_engine import FinishedRequest
from kvstrata.engine.config import ConfigError, load_config
from kvstrata.engine.hashing import BlockHasher
from kvstrata.planner import DEFAULT_SPEEDS, Planner
from kvstrata.tiers.lru import LruIndex
from kvstrata.trace import TraceLog, TraceWriter, read_trace

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "benchmarks" / "data" / "traces" / "sample_trace.jsonl"
# Llama-3-8B's block shape (no weights), 16-token blocks; sizes below are block counts.
BASE = {"model": {"name": "llama-3-8b", "load_format": "dummy", "dtype": "bfloat16"},
        "cache": {"block_size": 16, "offload": "on_evict", "tiers": {"device": {"size": 300}}}}


def _config(**tiers):
    raw = json.loads(json.dumps(BASE))
    for name, size in tiers.items():
        raw["cache"]["tiers"][name] = {"size": size}
    return load_config(raw, for_machine=False)


@pytest.fixture(scope="module")
def sample():
    return read_trace(SAMPLE)


def _replay(sample, trace_block_tokens=16, **tiers):
    return Planner(_config(**tiers), DEFAULT_SPEEDS, trace_block_tokens=trace_block_tokens).replay(sample)


def test_device_tier_hit_ratio_matches_an_lru_of_its_size(sample):
    result = _replay(sample)
    assert result["hit_ratio"] == pytest.approx(lru_hit_ratio(sample, 300, 16), abs=0.03)
    assert result["by_tier"]["cpu"] == 0 and result["hit_ratio"] > 0.3


def test_device_and_cpu_on_evict_match_an_lru_of_their_sum(sample):
    device_only = _replay(sample)
    result = _replay(sample, cpu=600)
    assert result["hit_ratio"] == pytest.approx(lru_hit_ratio(sample, 900, 16), abs=0.03)
    assert result["by_tier"]["cpu"] > 0.05  # the CPU tier serves what the device evicted
    assert result["evictions"]["device"] > 0 and result["written_down_bytes"]["cpu"] > 0
    assert result["hit_ratio"] > device_only["hit_ratio"] + 0.05


def test_whole_trace_blocks_of_512_tokens_match_the_lru(sample):
    # each id 32 blocks of 16 tokens: a device of 1200 ids' worth against an LRU of 1200 ids
    result = _replay(sample, trace_block_tokens=512, device=1200 * 32)
    assert result["hit_ratio"] == pytest.approx(lru_hit_ratio(sample, 1200, 512), abs=0.03)


def test_disk_tier_catches_what_the_cpu_tier_evicts(sample):
    without = _replay(sample, cpu=200)
    result = _replay(sample, cpu=200, disk=1000)
    assert result["by_tier"]["disk"] > 0
    assert result["hit_ratio"] > without["hit_ratio"]
    assert result["written_down_bytes"]["disk"] > 0


def test_plan_json_is_the_last_line(capsys):
    code = main(["plan", "--trace", str(SAMPLE), "--trace-block-tokens", "16", "--json",
                 *_sets(BASE, "cache.tiers.cpu.size=600")])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    result = json.loads(out[-1])
    assert set(result["by_tier"]) == {"device", "cpu", "disk", "remote"}
    assert result["hit_ratio"] == pytest.approx(sum(result["by_tier"].values()))
    assert result["requests"] == 400 and result["ttft_ms"]["mean"] > 0
    assert any(line.startswith("hit ratio:") for line in out[:-1])


def test_sweep_prints_a_table_writes_the_plot_and_names_the_smallest_good_config(tmp_path, capsys):
    plot = tmp_path / "sweep.png"
    code = main(["plan", "--trace", str(SAMPLE), "--trace-block-tokens", "16", "--json", "--target", "0.9",
                 "--sweep", "cache.tiers.cpu.size=0,150,600,2400", "--sweep", "cache.tiers.device.size=300,600",
                 "--plot", str(plot), *_sets(BASE)])
    out = capsys.readouterr().out
    assert code == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads(out.strip().splitlines()[-1])
    points = result["points"]
    assert len(points) == 8
    assert "cache.tiers.cpu.size" in out.splitlines()[0]  # the table's header
    best = max(p["hit_ratio"] for p in points)
    good = [p for p in points if p["hit_ratio"] >= 0.9 * best]
    cost = lambda p: int(p["settings"]["cache.tiers.cpu.size"]) + int(p["settings"]["cache.tiers.device.size"])  # noqa: E731
    assert cost({"settings": result["recommended"]}) == min(cost(p) for p in good)
    assert "recommended" in out and "  tiers:\n    device:\n" in out  # the YAML to copy


def test_prefix_routing_keeps_conversations_on_the_replica_holding_them(sample):
    config = _config(device=150)
    spread = Planner(config, DEFAULT_SPEEDS, 16, replicas=4, route="round_robin").replay(sample)
    routed = Planner(config, DEFAULT_SPEEDS, 16, replicas=4, route="prefix").replay(sample)
    assert routed["hit_ratio"] > spread["hit_ratio"] + 0.1
    assert routed["replicas"] == 4


def test_the_planners_router_sees_each_replicas_disk_as_the_router_does():
    """`--route prefix` replays the router's own placement, which counts a replica's disk where no replica holds
    the prompt in memory: the replayed index must answer for the disk too, and never for the remote tier."""
    from kvstrata.planner import ReplayEngine, Tally
    from kvstrata.serving.router import LOCAL_MEDIA, MEMORY_MEDIA

    disk, remote = LruIndex("disk", 8, keeps_holds=False), LruIndex("remote", None, keeps_holds=False)
    engine = ReplayEngine(4, LruIndex("cpu", 4), disk, remote, "write_through", Tally())
    disk.put(["a", "b"])
    remote.put(["a", "b", "c"])
    assert engine.held_prefix(["a", "b", "c"], LOCAL_MEDIA) == 2
    assert engine.held_prefix(["a", "b", "c"], MEMORY_MEDIA) == 0


def test_replicas_share_the_remote_tier(sample):
    raw = json.loads(json.dumps(BASE))
    raw["cache"]["tiers"]["device"]["size"] = 100
    raw["cache"]["tiers"]["remote"] = {"url": "redis://127.0.0.1:6379/0"}
    config = load_config(raw, for_machine=False)
    result = Planner(config, DEFAULT_SPEEDS, 16, replicas=3).replay(sample)
    assert result["by_tier"]["remote"] > 0.1  # a turn often lands on another replica than its previous turn
    assert result["capacity_blocks"]["remote"] is None
    bounded = Planner(config, DEFAULT_SPEEDS, 16, replicas=3, remote_size=200).replay(sample)
    assert bounded["evictions"]["remote"] > 0 and bounded["by_tier"]["remote"] < result["by_tier"]["remote"]


def test_lru_index_never_evicts_a_held_block():
    evicted = []
    tier = LruIndex("cpu", 2, on_evict=evicted.append)
    tier.put(["a", "b"])
    tier.hold(["a"])
    tier.put(["c"])
    assert evicted == ["b"] and tier.contains("a")
    tier.release(["a"])
    tier.put(["d"])
    assert evicted == ["b", "a"]


def test_trace_log_is_private_and_holds_no_tokens(tmp_path):
    path = tmp_path / "logs" / "trace.jsonl"
    hasher = BlockHasher.for_model("tiny", "float32", 16, "xxh3_128")
    document = [987_654 + (i % 7) for i in range(1100)]
    heard = []

    class Inner:
        def on_finished(self, finished):
            heard.append(finished)

    writer = TraceWriter(path, 16)
    log = TraceLog(Inner(), writer)
    for question in ([11, 12, 13] * 10, [21, 22] * 40):
        tokens = document + question
        log.on_finished(FinishedRequest("stop", 0.01, len(tokens), 7, tuple(hasher.hash(tokens))))
    writer.close()
    assert len(heard) == 2
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert "987654" not in text and "98765" not in text
    first, second = read_trace(path)
    assert first.input_length == 1130 and first.output_length == 7 and len(first.hash_ids) == 3
    assert first.hash_ids[:2] == second.hash_ids[:2]  # the shared 1024-token prefix: the same ids
    assert first.hash_ids[2] != second.hash_ids[2]
    assert set(json.loads(text.splitlines()[0])) == {"timestamp", "input_length", "output_length", "hash_ids"}


@pytest.mark.slow
def test_served_requests_land_in_the_trace_log_and_plan(tmp_path, capsys):
    import httpx

    from tests.server_process import ServerProcess

    path = tmp_path / "served.jsonl"
    server = ServerProcess(tmp_path / "kvstore", f"server.trace_log={path}")
    document = [1000 + (i * 37) % 20000 for i in range(600)]
    try:
        for question in ([5, 6, 7], [8, 9]):
            answer = httpx.post(f"{server.base_url}/v1/completions", timeout=300,
                                json={"prompt": document + question, "max_tokens": 3, "temperature": 0.0})
            assert answer.status_code == 200
    finally:
        assert server.terminate() == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    first, second = read_trace(path)
    assert (first.input_length, second.input_length) == (603, 602)
    assert first.hash_ids[0] == second.hash_ids[0] and second.timestamp_ms >= first.timestamp_ms
    for line in path.read_text().splitlines():  # lengths and ids, no token ids
        record = json.loads(line)
        assert set(record) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert not set(record["hash_ids"]) & set(document)
    assert main(["plan", "--trace", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["requests"] == 2


@pytest.mark.slow
def test_measured_profile_prices_the_plan(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    tiny = ["--set", "model.name=tiny-llama", "--set", "model.load_format=dummy", "--set", "model.dtype=float32",
            "--set", "cache.tiers.device.size=256", "--set", "cache.tiers.cpu.size=256"]
    assert main(["plan", "--measure", str(profile), *tiny]) == 0
    measured = json.loads(profile.read_text())
    assert measured["step"]["per_token_s"] > 0 and measured["decode_s_per_token"] > 0
    assert set(measured["reads"]) == {"cpu"}  # the CPU tier's load probe; no disk or remote tier here
    assert measured["reads"]["cpu"]["latency_s"] + measured["reads"]["cpu"]["bytes_per_s"] > 0
    capsys.readouterr()
    assert main(["plan", "--trace", str(SAMPLE), "--profile", str(profile), "--json", *tiny]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["speeds"].startswith("measured:") and result["ttft_ms"]["mean"] > 0


def test_trace_log_key_is_a_path(tmp_path):
    config = load_config({"server": {"trace_log": "t.jsonl"}}, for_machine=False)
    assert config.server.trace_log.is_absolute() and config.server.trace_log.name == "t.jsonl"
    assert load_config({}, for_machine=False).server.trace_log is None


def test_planning_does_not_check_this_machine():
    raw = {**BASE, "cache": {**BASE["cache"], "tiers": {"device": {"size": "900TiB"}, "cpu": {"size": "900TiB"}}}}
    with pytest.raises(ConfigError):
        load_config(raw)
    assert load_config(raw, for_machine=False).cache.tiers.cpu.size.nbytes == 900 << 40
    gpu = {**raw, "model": {**BASE["model"], "device": "cuda:15", "dtype": "auto"}}  # a GPU this machine lacks
    with pytest.raises(ConfigError, match="model.device"):
        load_config(gpu)
    planned = Planner(load_config(gpu, for_machine=False), DEFAULT_SPEEDS)
    assert planned.block_nbytes == 32 * 2 * 16 * 8 * 128 * 2  # Llama-3-8B's block in bfloat16, a GPU's auto dtype


@pytest.mark.parametrize("bad, message", [
    ('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"timestamp": 1, "input_length": "x", "hash_ids": []}\n',
     ":2: input_length must be an integer"),
    ("not json\n", ":1: not a JSON object"),
])
def test_a_malformed_trace_is_one_line_and_exit_2(tmp_path, capsys, bad, message):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(bad)
    assert main(["plan", "--trace", str(trace), *_sets(BASE)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("more", [(), ("--replicas", "2")], ids=["one", "replicas"])
def test_a_remote_size_that_is_none_is_refused_whether_or_not_the_config_has_a_remote_tier(capsys, more):
    for remote in ({}, {"cache.tiers.remote.url": "redis://127.0.0.1:1/0"}):
        sets = _sets(BASE, *(f"{key}={value}" for key, value in remote.items()))
        assert main(["plan", "--trace", str(SAMPLE), "--remote-size", "abc", *more, *sets]) == 2
        out, err = capsys.readouterr()
        assert err.startswith("kvstrata: error: --remote-size: bad size 'abc'") and err.count("\n") == 1
        assert out == ""


def test_a_limit_below_one_is_refused_as_an_argument(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--trace", str(SAMPLE), "--limit", "-1", *_sets(BASE)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "kvstrata plan: error: argument --limit: must be a positive integer, got -1"


def test_a_binary_trace_is_one_line_naming_the_file(tmp_path, capsys):
    trace = tmp_path / "trace.png"
    trace.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    assert main(["plan", "--trace", str(trace), *_sets(BASE)]) == 2
    assert capsys.readouterr().err == f"kvstrata: error: {trace}: not a trace (not UTF-8 text)\n"


def test_a_plot_with_no_folder_to_go_to_is_refused_before_the_sweep(tmp_path, capsys):
    plot = tmp_path / "no" / "such" / "p.png"
    assert main(["plan", "--trace", str(SAMPLE), "--sweep", "cache.tiers.cpu.size=0,150", "--plot", str(plot),
                 *_sets(BASE)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing replayed
    assert err == f"kvstrata: error: --plot: no folder '{plot.parent}' to write 'p.png' in\n"


def test_an_unknown_sweep_key_is_one_line_and_exit_2(capsys):
    assert main(["plan", "--trace", str(SAMPLE), "--sweep", "scheduler.max_seqs=1,2", *_sets(BASE)]) == 2
    err = capsys.readouterr().err.strip()
    assert "scheduler.max_seqs: unknown key" in err and "unknown key" in err and len(err.splitlines()) == 1


def _sets(raw: dict, *more: str) -> list[str]:
    """A config dict as --set arguments (no file needed)."""
    flat = []

    def walk(prefix, node):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            else:
                flat.append(f"{prefix}{k}={v}")

    walk("", raw)
    return [a for s in [*flat, *more] for a in ("--set", s)]


def test_the_long_document_trace_reuses_a_few_documents_most_with_a_question_of_its_own_each():
    from collections import Counter

    from benchmarks.planner import make_longdoc

    records = make_longdoc(num_docs=10, num_requests=500, zipf=0.9, doc_ids=4, seed=3)
    assert records == make_longdoc(num_docs=10, num_requests=500, zipf=0.9, doc_ids=4, seed=3)
    docs = Counter(r["hash_ids"][0] // 4 for r in records)
    assert set(docs) <= set(range(10)) and docs.most_common(1)[0][0] == 0 and docs[0] > 2 * docs[9]
    for r in records:
        doc = r["hash_ids"][0] // 4
        assert r["hash_ids"][:4] == list(range(4 * doc, 4 * doc + 4))
        assert r["input_length"] <= len(r["hash_ids"]) * 512
    questions = [r["hash_ids"][4] for r in records]
    assert len(set(questions)) == len(questions) and min(questions) >= 40


def test_answers_written_down_take_the_room_of_the_documents_asked_about_again(tmp_path):
    """The planner replays the engine's answer policy (`cache.offload_answers`): kept on the device, a request's
    generated blocks leave the CPU and disk tiers to the documents; written down, each answer (asked for once)
    pushes a document's blocks out of them."""
    from benchmarks.planner import make_longdoc

    trace = tmp_path / "longdoc.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in make_longdoc(num_docs=20, num_requests=300,
                                                                       answer_tokens=256)))
    requests = read_trace(trace)

    def replay(offload_answers: bool) -> dict:
        raw = json.loads(json.dumps(BASE))
        raw["cache"].update(offload="write_through", offload_answers=offload_answers,
                            tiers={"device": {"size": 256}, "cpu": {"size": 1024}, "disk": {"size": 2048}})
        return Planner(load_config(raw, for_machine=False), DEFAULT_SPEEDS).replay(requests)

    kept, written = replay(False), replay(True)
    assert written["written_down_bytes"]["cpu"] > kept["written_down_bytes"]["cpu"]
    assert written["written_down_bytes"]["disk"] > kept["written_down_bytes"]["disk"]
    assert kept["by_tier"]["cpu"] + kept["by_tier"]["disk"] > written["by_tier"]["cpu"] + written["by_tier"]["disk"]
    assert kept["hit_ratio"] > written["hit_ratio"]
