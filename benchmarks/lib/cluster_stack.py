"""Everything the cluster benchmark runs, on this machine's loopback: a Valkey cluster (tests/valkey_server.py's,
primaries with a replica each), `kvstrata serve` replicas whose remote tier is that cluster, and `kvstrata route`
in front of them, its event feed from each replica passing through a `FeedProxy` that can be cut and restored.
The measuring is benchmarks/suites/cluster/run.py's."""
from __future__ import annotations

import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import yaml

from tests.server_process import DEFAULT_CONFIG, REPO, ServerProcess, server_env
from tests.valkey_server import ValkeyServer, free_port, start_on_free_ports

ROUTING = re.compile(r"routing on (http://\S+)")
# the router's log line when it takes a replica out or back (kvstrata/serving/router.py `set_health`), with the log
# format's time (kvstrata/cli.py)
HEALTH_CHANGE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \S+ router: replica (\S+) is (out|back)\b")
START_TIMEOUT_S = 300


@dataclass(frozen=True)
class ReplicaSizes:
    device_blocks: int
    cpu_blocks: int
    threads: int = 1
    remote_timeout: str = "500ms"
    remote: bool = True  # False: no remote tier, the cluster unused


class FeedProxy:
    """A TCP relay between the router's subscriber and one replica's KV event publisher: `cut()` drops every
    connection and turns new ones away (the feed is gone as after a network fault, both ends alive), `restore()`
    lets them through again. ZMQ reconnects by itself; what was published meanwhile is lost on the way."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.is_cut = False
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._closing:
            try:
                down, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            if self.is_cut:
                down.close()
                continue
            try:
                up = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
            except OSError:  # the replica is not there (killed): the subscriber will try again
                down.close()
                continue
            with self._lock:
                self._pairs.append((down, up))
            threading.Thread(target=self._relay, args=(down, up), daemon=True).start()

    def _relay(self, down: socket.socket, up: socket.socket) -> None:
        sockets = [down, up]
        try:
            while not self.is_cut and not self._closing:
                ready, _, _ = select.select(sockets, [], [], 0.2)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    (up if s is down else down).sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                if (down, up) in self._pairs:
                    self._pairs.remove((down, up))
            for s in sockets:
                s.close()

    def cut(self) -> None:
        self.is_cut = True
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def restore(self) -> None:
        self.is_cut = False

    def close(self) -> None:
        self._closing = True
        self.cut()
        self.listener.close()


class ServeReplica:
    """One `kvstrata serve` on fixed ports (HTTP, KV events, replay) and a disk tier of its own, so that a restart
    comes back at the same address on the same disk store."""

    def __init__(self, work_dir: Path, remote_url: str, sizes: ReplicaSizes, index: int):
        self.index = index
        self.disk = work_dir / f"kvstore-{index}"
        self.sizes, self.remote_url = sizes, remote_url
        self.process: ServerProcess | None = None
        self.feed = FeedProxy(target_port=0)  # relays to the events port, chosen next
        self._choose_ports()

    def _choose_ports(self) -> None:
        self.port, self.events_port, self.replay_port = free_port(), free_port(), free_port()
        self.feed.target_port = self.events_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start, or restart at the same address. A first start whose port another process took between our look
        and the server's listen tries fresh ports: nobody knows this replica's address yet."""
        if self.process is not None:  # a restart
            self._start()
        else:
            start_on_free_ports(self._start, self._choose_ports)

    def _start(self) -> None:
        s = self.sizes
        remote = (f"cache.tiers.remote.url={self.remote_url}", "cache.tiers.remote.cluster=true",
                  f"cache.tiers.remote.timeout={s.remote_timeout}") if s.remote else ()
        self.process = ServerProcess(
            self.disk, f"cache.tiers.device.size={s.device_blocks}", f"cache.tiers.cpu.size={s.cpu_blocks}",
            f"model.threads={s.threads}", *remote,
            f"events.endpoint=tcp://127.0.0.1:{self.events_port}",
            f"events.replay_endpoint=tcp://127.0.0.1:{self.replay_port}", port=self.port)

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is drained or written down."""
        if self.process is not None:
            self.process.kill()

    def stop(self) -> None:
        """SIGTERM, without waiting: the server drains and writes its cache down (`wait` for it)."""
        if self.process is not None and self.process.process.poll() is None:
            self.process.process.terminate()

    def wait(self) -> None:
        if self.process is not None:
            self.process.wait(60)

    def config(self) -> dict:
        return {"url": self.url, "events": self.feed.endpoint, "replay": f"tcp://127.0.0.1:{self.replay_port}"}


@dataclass(frozen=True)
class RouterSettings:
    policy: str
    health_interval: str = "500ms"
    max_load_gap: int | None = None


class RouterProcess:
    """`kvstrata route` in a child process, with the replicas' model and cache settings and `settings`; started
    once it listens (`wait_healthy` waits for a replica it can route to)."""

    def __init__(self, work_dir: Path, replicas: list[dict], settings: RouterSettings):
        config = yaml.safe_load(DEFAULT_CONFIG.read_text())
        config["model"] = {**config.get("model", {}), "dtype": "float32"}
        config.pop("events", None)
        config["router"] = {"host": "127.0.0.1", "port": 0, "policy": settings.policy,
                            "health_interval": settings.health_interval, "request_timeout": "300s",
                            "replicas": replicas}
        if settings.max_load_gap is not None:
            config["router"]["max_load_gap"] = settings.max_load_gap
        path = work_dir / f"router-{settings.policy}.yaml"
        path.write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "kvstrata", "route", "--config", str(path)]
        self.settings, self.replicas = settings, replicas
        self.lines: list[str] = []
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=server_env(), cwd=REPO)
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.url = self._wait_for_banner()
        except BaseException:
            self.close()
            raise

    def wait_healthy(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvstrata route never became healthy:\n" + "\n".join(self.lines))
            time.sleep(0.2)

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def _wait_for_banner(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := ROUTING.search(line):
                    return match.group(1)
            if self.process.poll() is not None:
                raise RuntimeError("kvstrata route exited:\n" + "\n".join(self.lines))
            time.sleep(0.1)
        raise RuntimeError("kvstrata route did not start:\n" + "\n".join(self.lines))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def health_changes(lines: list[str], wall0: float) -> list[tuple[float, str, str]]:
    """(seconds after the wall-clock time `wall0`, replica URL, "out" or "back") for each change of a replica's
    health in the router's log `lines`: the moment it stopped or began again to send that replica requests."""
    changes = []
    for line in lines:
        if match := HEALTH_CHANGE.search(line):
            stamp, url, state = match.groups()
            at = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            changes.append((at - wall0, url, state))
    return changes


def _start(replica: ServeReplica, failed: list[BaseException]) -> None:
    try:
        replica.start()
    except BaseException as exc:  # noqa: BLE001 (raised again by the caller's thread)
        failed.append(exc)


class Stack:
    """The Valkey cluster's nodes (`nodes[:primaries]` the primaries), the replicas, and a scratch directory.
    `first_router`: the settings of the first router asked for, started beside the replicas (it loads its
    tokenizer while they load the model, and takes each in once it answers)."""

    def __init__(self, nodes: list[ValkeyServer], primaries: int, num_replicas: int, sizes: ReplicaSizes,
                 first_router: RouterSettings | None = None):
        self.nodes, self.primaries = nodes, primaries
        self.work_dir = Path(tempfile.mkdtemp(prefix="kvstrata-cluster-"))
        remote_url = f"redis://127.0.0.1:{nodes[0].port}/0"
        self.replicas = [ServeReplica(self.work_dir, remote_url, sizes, i) for i in range(num_replicas)]
        self._early: list[RouterProcess] = []
        try:  # side by side: each loads the model
            failed = []
            threads = [threading.Thread(target=_start, args=(r, failed)) for r in self.replicas]
            if first_router is not None:
                threads.append(threading.Thread(target=self._start_router, args=(first_router, failed)))
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if failed:
                raise failed[0]
        except BaseException:
            self.close()
            raise

    def _start_router(self, settings: RouterSettings, failed: list[BaseException]) -> None:
        try:
            self._early.append(RouterProcess(self.work_dir, [r.config() for r in self.replicas], settings))
        except BaseException as exc:  # noqa: BLE001 (raised again by the caller's thread)
            failed.append(exc)

    def router(self, policy: str, health_interval: str = "500ms", max_load_gap: int | None = None) -> RouterProcess:
        """A router in front of the replicas, routing to at least one: the one started beside them if it has these
        settings (and the replicas kept the addresses it was given: a port taken meanwhile moves a replica)."""
        settings, replicas = RouterSettings(policy, health_interval, max_load_gap), [r.config() for r in self.replicas]
        early = self._early.pop() if self._early else None
        if early is not None and (early.settings, early.replicas) != (settings, replicas):
            early.close()
            early = None
        router = early or RouterProcess(self.work_dir, replicas, settings)
        try:
            router.wait_healthy()
        except BaseException:
            router.close()
            raise
        return router

    def close(self) -> None:
        for router in self._early:
            router.close()
        for replica in self.replicas:  # all at once: each writes its cache down
            replica.stop()
        for replica in self.replicas:
            replica.wait()
            replica.feed.close()
        shutil.rmtree(self.work_dir, ignore_errors=True)
