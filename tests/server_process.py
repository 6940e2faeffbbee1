"""`kvstrata serve` in a child process, for the HTTP tests: fp32 (so caching changes no token), small
tiers, a private disk tier, an OS-chosen loopback port read back from the startup banner."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

if __package__:  # imported as tests.server_process, by the benchmarks
    from tests.valkey_server import PortTaken, free_port
else:  # by the tests, from their own folder
    from valkey_server import PortTaken, free_port

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "configs" / "default.yaml"
STARTUP_TIMEOUT_S = 300  # loading the model on a busy CPU
LISTENING = re.compile(r"listening on (http://\S+)")


def serve_command(*overrides: str, port: int | str = 0, kvstrata: list[str] | None = None,
                  config: Path = DEFAULT_CONFIG) -> list[str]:
    """`kvstrata serve` with `overrides`; `kvstrata`: how to start the command (default: this interpreter's
    `python -m kvstrata`)."""
    command = [*(kvstrata or [sys.executable, "-m", "kvstrata"]), "serve", "--config", str(config), "--port", str(port)]
    for override in overrides:
        command += ["--set", override]
    return command


def server_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_bench_on_a_tiny_model(benchmark: str, config: str, *args: str) -> subprocess.CompletedProcess:
    """`kvstrata bench BENCHMARK --config CONFIG ARGS` on random weights of a tiny shape: a benchmark's
    logic does not depend on the model."""
    command = [sys.executable, "-c", "from kvstrata.cli import main; raise SystemExit(main())",
               "bench", benchmark, "--config", config, "--set", "model.load_format=dummy",
               "--set", "model.name=tiny-llama", "--set", "model.dtype=float32", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


def free_ports(n: int) -> list[int]:
    """`n` loopback ports free at the time of asking, none handed out before by this process."""
    return [free_port() for _ in range(n)]


class ServerProcess:
    """A running `kvstrata serve`; `lines` collects its stdout and stderr as they come."""

    def __init__(self, disk_path: Path, *overrides: str, env: dict[str, str] | None = None, port: int = 0,
                 kvstrata: list[str] | None = None, config: Path = DEFAULT_CONFIG, cwd: Path = REPO):
        """`port` 0: one the OS chooses; a given port lets a restarted server take its predecessor's address.
        `kvstrata`, `config`, `cwd`: another install's command, config and working folder (the user-install test)."""
        self.disk_path = disk_path
        settings = ("model.dtype=float32", "cache.tiers.device.size=128", "cache.tiers.cpu.size=256",
                    f"cache.tiers.disk.path={disk_path}", "cache.tiers.disk.size=256MiB", *overrides)
        self.process = subprocess.Popen(serve_command(*settings, port=port, kvstrata=kvstrata, config=config),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**server_env(), **(env or {})}, cwd=cwd)
        self.lines: list[str] = []
        self.listening_at: float | None = None  # time.monotonic() when its banner came
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()
        self.base_url = self._wait_until_listening()
        self._wait_until_healthy()

    def _read_output(self) -> None:
        for line in self.process.stdout:
            if self.listening_at is None and LISTENING.search(line):
                self.listening_at = time.monotonic()  # it listens before it prints the banner
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def _wait_until_listening(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            for line in list(self.lines):
                match = LISTENING.search(line)
                if match:
                    return match.group(1)
            if self.process.poll() is not None:
                raise self._exited()
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"kvstrata serve did not start in {STARTUP_TIMEOUT_S} s:\n{self.output}")

    def _exited(self) -> RuntimeError:
        """What to raise once it has exited while starting: PortTaken where one of its ports was in use."""
        self._reader.join(5)
        error = PortTaken if "already in use" in self.output else RuntimeError
        return error(f"kvstrata serve exited with {self.process.returncode}:\n{self.output}")

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._exited()
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"kvstrata serve never became healthy:\n{self.output}")

    def terminate(self, timeout: float = 120) -> int:
        """SIGTERM, then the exit code (the server drains and writes its cache down first)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float = 120) -> int:
        """The exit code, once the server has exited and all its output is in `lines`."""
        try:
            return self.process.wait(timeout)
        finally:
            self._reader.join(5)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


def metric_value(metrics_text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text, e.g. metric_value(text, "x_total", 'tier="cpu"')."""
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
    match = re.search(r"^" + pattern + r"$", metrics_text, re.MULTILINE)
    if match is None:
        raise AssertionError(f"no sample {name}{{{labels}}} in /metrics")
    return float(match.group(1))


def aborted_requests(metrics_text: str) -> float:
    try:
        return metric_value(metrics_text, "kvstrata_requests_finished_total", 'finish_reason="abort"')
    except AssertionError:  # no request has been aborted yet: the labelled sample does not exist
        return 0.0


def raw_post(base_url: str, path: str, body: bytes, headers: dict[str, str] | None = None,
             content_length: int | None = None) -> socket.socket:
    """Send a POST on a plain socket and return the socket (to read the answer, or to hang up):
    what an HTTP client library will not do, e.g. declare a Content-Length it never sends."""
    url = urlsplit(base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=300)
    head = [f"POST {path} HTTP/1.1", f"Host: {url.netloc}", "Content-Type: application/json",
            f"Content-Length: {len(body) if content_length is None else content_length}"]
    head += [f"{name}: {value}" for name, value in (headers or {}).items()]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one plain (not chunked) HTTP response read from `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += _receive(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
    while len(body) < length:
        body += _receive(sock)
    return int(lines[0].split()[1]), body


def _receive(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise ConnectionError("the server closed the connection before its answer was complete")
    return chunk
