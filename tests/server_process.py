"""`kvstrata serve` in a child process, for the HTTP tests: fp32 (so caching changes no token), small
tiers, a private disk tier, an OS-chosen loopback port read back from the startup banner."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "configs" / "default.yaml"
STARTUP_TIMEOUT_S = 300  # loading the model on a busy CPU
LISTENING = re.compile(r"listening on (http://\S+)")


def serve_command(*overrides: str, port: int | str = 0) -> list[str]:
    command = [sys.executable, "-m", "kvstrata", "serve", "--config", str(DEFAULT_CONFIG), "--port", str(port)]
    for override in overrides:
        command += ["--set", override]
    return command


def server_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class ServerProcess:
    """A running `kvstrata serve`; `lines` collects its stdout and stderr as they come."""

    def __init__(self, disk_path: Path, *overrides: str):
        self.disk_path = disk_path
        settings = ("model.dtype=float32", "cache.tiers.device.size=128", "cache.tiers.cpu.size=256",
                    f"cache.tiers.disk.path={disk_path}", "cache.tiers.disk.size=256MiB", *overrides)
        self.process = subprocess.Popen(serve_command(*settings), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=server_env(), cwd=REPO)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()
        self.base_url = self._wait_until_listening()
        self._wait_until_healthy()

    def _read_output(self) -> None:
        for line in self.process.stdout:
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
                raise RuntimeError(f"kvstrata serve exited with {self.process.returncode}:\n{self.output}")
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"kvstrata serve did not start in {STARTUP_TIMEOUT_S} s:\n{self.output}")

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
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
