"""A remote tier reader process: reads block records from the Valkey/Redis server (or cluster), verifies them and
copies their payloads into shared host memory (tiers/shared_memory.py) that the engine's process copies to the
device. Also what the tier's own process shares with it: how a client connects and how a batch is read.

Why a process (tiers/reader_process.py has the wire and the rest): a read in the engine's process takes the
interpreter lock for the client's socket reads, for each reply's parsing into a bytes object and for each record's
check and copy; beside decoding sequences a hit read in-process took several times its time alone, and the step
thread waited for it while it was admitted. Each reader has its own client and
connection.

Run as `python -m kvstrata.tiers.remote_reader FD` by the remote tier (tiers/reader_pool.py). The remote tier's
fields, in `open` and in every `read` (a reader started in place of a dead one learns them there):

    {"url": U, "cluster": bool, "timeout": seconds, "ttl_ms": milliseconds or None}

The URL may carry a password: it travels over the private socket only, and every error a reader reports has it
masked. A read's error kinds: "fault" (the server did not answer: the tier counts a fault and backs off; the reader
drops its connection and makes a new one at the next read) or "failed" (anything else).
"""
from __future__ import annotations

import socket
import sys
from typing import Sequence

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.retry import Retry

from kvstrata.tiers.reader_process import SharedMemoryReader, serve
from kvstrata.tiers.remote_url import scrub

# What the client raises for a server that cannot answer now (down, timeout, reset, failover,
# loading, a cluster without a slot's owner): every one is a miss, never an error for a request.
# Where a round trip runs (lookup, read, write), anything else the client raises is taken as one too.
FAULTS = (redis.RedisError, redis.exceptions.RedisClusterException, OSError)

Client = redis.Redis | redis.RedisCluster


def connect(url: str, cluster: bool, timeout: float,
            known_nodes: Sequence[tuple[str, int]] = ()) -> tuple[Client, list[tuple[str, int]]]:
    """A client of the server at `url`, every round trip bounded by `timeout` seconds and never retried by the
    client (the tier has its own backoff), and the nodes it knows (a cluster's; none for one server). A cluster
    connects now, to learn which node serves which slots, through the URL's node or any of `known_nodes`, the
    nodes an earlier client had learned: the URL's may be dead. Raises what the client raises (FAULTS)."""
    # A cluster's client tries once more after a node fails, having relearned the slot map: a primary that
    # failed over while this client was idle (its map still names the dead node) costs no fault then. One
    # server has nothing to relearn: the tier's own backoff handles it.
    options = dict(socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 1 if cluster else 0))
    if cluster:
        client = redis.RedisCluster.from_url(url, startup_nodes=[ClusterNode(h, p) for h, p in known_nodes],
                                             **options)
        return client, nodes_of(client)
    return redis.Redis.from_url(url, health_check_interval=0, **options), []


def nodes_of(client: Client) -> list[tuple[str, int]]:
    """The nodes a cluster's client knows now, failed-over ones included (none for one server)."""
    if isinstance(client, redis.RedisCluster):
        return [(n.host, n.port) for n in client.get_nodes()]
    return []


def pipeline(client: Client):
    return client.pipeline(transaction=False)  # a cluster splits it by node; no MULTI across slots


def read_values(client: Client, keys: Sequence[bytes], ttl_ms: int | None) -> list[bytes | None]:
    """The values of `keys` (None where absent), in one pipelined round trip; with `ttl_ms`, GETEX, which restarts
    each key's time to live. Raises what the client raises on a fault."""
    pipe = pipeline(client)
    for key in keys:
        if ttl_ms:
            pipe.getex(key, px=ttl_ms)
        else:
            pipe.get(key)
    return [v if isinstance(v, bytes) else None for v in pipe.execute(raise_on_error=False)]


class RemoteReader(SharedMemoryReader):
    """A remote tier reader's state: the shared segments it maps and its client."""

    def __init__(self) -> None:
        super().__init__()
        self.client: Client | None = None
        self.server: tuple[str, bool, float] | None = None  # (url, cluster, timeout) the client was made for
        self.known_nodes: list[tuple[str, int]] = []

    def open(self, message: dict) -> bool:
        self._client(message).ping()
        return True

    def read(self, request: dict) -> dict:
        codes = bytearray(len(request["keys"]))
        try:
            values = read_values(self._client(request), request["keys"], request["ttl_ms"])
        except Exception as e:  # every failed round trip is a fault: misses, and the tier backs off
            self.close()
            return {"codes": bytes(codes), "error": ["fault", scrub(f"{type(e).__name__}: {e}", request["url"])]}
        try:
            for k, value in enumerate(values):
                if value is not None:
                    codes[k] = self.copy_record(request, k, value)
        except Exception as e:  # anything else is a miss for what is left, never a dead reader
            return {"codes": bytes(codes), "error": ["failed", scrub(f"{type(e).__name__}: {e}", request["url"])]}
        return {"codes": bytes(codes), "error": None}

    def _client(self, fields: dict) -> Client:
        server = (fields["url"], bool(fields["cluster"]), float(fields["timeout"]))
        if self.client is None or server != self.server:
            self.close()
            self.client, nodes = connect(*server, known_nodes=self.known_nodes)
            self.server, self.known_nodes = server, nodes or self.known_nodes
        return self.client

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            self.known_nodes = nodes_of(client) or self.known_nodes
            try:
                client.close()
            except FAULTS:
                pass


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), RemoteReader())
