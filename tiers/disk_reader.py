"""A disk tier reader process: reads block records from the tier's LMDB store, verifies them and copies their
payloads into shared host memory (tiers/shared_memory.py) that the engine's process copies to the device.

Why a process: a read in the engine's process needs Python's interpreter lock between its copy and its checksum,
several times per block, and shares it with the step thread; beside a busy step loop a thread's reads wait for
the lock more than they copy (benchmarks/results/disk_promotion.md). A reader process has its own interpreter:
what it reads costs the engine's process one message per batch. LMDB is made for this: every process that opens
the store reads the snapshot it began, beside the one writer.

Run as `python -m kvstrata.tiers.disk_reader FD` by the disk tier (tiers/reader_pool.py), FD one end of a Unix
stream socket. Imports neither torch nor the engine: it starts in a tenth of a second. It exits when the socket
closes (also when the engine's process dies).

Messages are msgpack maps, each framed by its length (u32 LE); a segment's descriptor travels with its message.
From the engine's process:

    {"op": "segment", "id": N, "nbytes": B}   + a descriptor: map it; reply {"mapped": N} once mapped
    {"op": "forget", "ids": [N, ...]}           unmap them (their memory is freed once nobody maps it)
    {"op": "open", "path": P, "file": [dev, ino]}   open the store now; reply {"opened": bool}
    {"op": "read", "path": P, "file": [dev, ino], "fixed": b, "padding": b, "token_bytes": T,
     "header": H, "record": R, "keys": [k, ...], "tokens": b, "places": [[segment, offset], ...]}

A read's reply: {"codes": bytes, one per key (ABSENT, SERVED, CORRUPT), "error": None or [kind, message]}, kind
"damaged" (the store's file is damaged: the tier replaces it), "stale" (the path names another store than the
tier's now) or "failed" (anything else). Block k's record must be `fixed + tokens[k*T:(k+1)*T] + padding`, a
checksum and the payload (tiers/record.py); its payload goes to `places[k]`, verified there.
"""
from __future__ import annotations

import mmap
import os
import socket
import struct
import sys

import lmdb
import msgpack
import numpy as np

from kvstrata.tiers.lmdb_store import DAMAGE_ERRORS, SUBDBS, LmdbStore, StoreDamaged, data_file, file_id
from kvstrata.tiers.record_check import RecordError, checked_payload, copy_checked

ABSENT, SERVED, CORRUPT = 0, 1, 2
_LENGTH = struct.Struct("<I")
MAX_FDS = 4  # descriptors one message may carry


# -- the wire, both sides --------------------------------------------------------------------------------------


def send_message(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = msgpack.packb(message, use_bin_type=True)
    frame = memoryview(_LENGTH.pack(len(data)) + data)
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else sock.send(frame)
    if sent < len(frame):
        sock.sendall(frame[sent:])


def recv_message(sock: socket.socket) -> tuple[dict, list[int]]:
    """The next message and the descriptors that came with it. Raises EOFError when the peer has closed."""
    fds: list[int] = []
    header = _recv_exactly(sock, _LENGTH.size, fds)
    body = _recv_exactly(sock, _LENGTH.unpack(header)[0], fds)
    return msgpack.unpackb(body, raw=False), fds


def _recv_exactly(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    chunks, got = [], 0
    while got < n:
        data, more_fds, _, _ = socket.recv_fds(sock, n - got, MAX_FDS)
        if not data:
            for fd in [*fds, *more_fds]:
                os.close(fd)
            raise EOFError("the peer closed the socket")
        fds += more_fds
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


# -- the reader ------------------------------------------------------------------------------------------------


class Reader:
    """One reader's state: the shared segments it maps and the store it has open."""

    def __init__(self) -> None:
        self.segments: dict[int, np.ndarray] = {}
        self.store: LmdbStore | None = None

    def handle(self, message: dict, fds: list[int]) -> dict | None:
        op = message["op"]
        if op == "segment":
            try:
                self.segments[message["id"]] = _map(fds[0], message["nbytes"])
            finally:
                for fd in fds:
                    os.close(fd)
            return {"mapped": message["id"]}
        if op == "forget":
            for segment_id in message["ids"]:
                self.segments.pop(segment_id, None)
            return None
        if op == "open":  # ahead of the first read, so that it does not pay for the opening
            try:
                opened = self._open(message["path"], tuple(message["file"])) is not None
            except Exception:  # the first read then says what is wrong
                opened = False
            return {"opened": opened}
        if op == "read":
            return self.read(message)
        raise ValueError(f"unknown message {op!r}")

    def read(self, request: dict) -> dict:
        codes = bytearray(len(request["keys"]))
        try:
            store = self._open(request["path"], tuple(request["file"]))
            if store is None:
                return {"codes": bytes(codes), "error": ["stale", "the path names another store now"]}
            todo = list(range(len(codes)))
            for attempt in range(2):
                try:
                    while todo:
                        todo = self._read_snapshot(store, request, todo, codes)
                    break
                except lmdb.MapResizedError:  # the writer grew the map: take its size, once
                    if attempt:
                        raise
                    store.adopt_map_size()
        except (StoreDamaged, *DAMAGE_ERRORS) as e:
            self.close()
            return {"codes": bytes(codes), "error": ["damaged", f"{type(e).__name__}: {e}"]}
        except Exception as e:  # anything else is a miss for what is left, never a dead reader
            return {"codes": bytes(codes), "error": ["failed", f"{type(e).__name__}: {e}"]}
        return {"codes": bytes(codes), "error": None}

    def _read_snapshot(self, store: LmdbStore, request: dict, todo: list[int], codes: bytearray) -> list[int]:
        """Serve blocks `todo` from one read snapshot; returns those still to try. An LMDB error on one key (a
        damaged page on its path) marks it corrupt and ends the transaction: the rest go to a fresh one."""
        fixed, padding, t = request["fixed"], request["padding"], request["token_bytes"]
        tokens, keys, places = request["tokens"], request["keys"], request["places"]
        header, record_nbytes = request["header"], request["record"]
        payload_nbytes = record_nbytes - header
        with store.begin(db=store.blocks) as txn:
            for n, k in enumerate(todo):
                try:
                    record = txn.get(keys[k])
                except lmdb.Error:
                    codes[k] = CORRUPT
                    return todo[n + 1:]
                if record is None:
                    continue
                segment, offset = places[k]
                dest = self.segments[segment][offset:offset + payload_nbytes]
                try:
                    head = fixed + tokens[k * t:(k + 1) * t] + padding
                    copy_checked(*checked_payload(record, head, header, record_nbytes), dest)
                    codes[k] = SERVED
                except RecordError:
                    codes[k] = CORRUPT
        return []

    def _open(self, path: str, wanted: tuple[int, int]) -> LmdbStore | None:
        """The store at `path` if its data file is `wanted` (the tier's), opened once and kept; None if the
        path names another file now (the tier replaced its store, or is about to)."""
        if self.store is not None and self.store.file_id() == wanted and self.store.path == path:
            return self.store
        self.close()
        if file_id(data_file(path)) != wanted:
            return None
        # lock=True: this process's snapshots enter the store's reader table, so the writer never reuses a page
        # they read. Read-only: nothing here writes (a read's LRU touch is the tier's, in the engine's process).
        env = lmdb.open(path, readonly=True, lock=True, max_dbs=len(SUBDBS), subdir=True, map_size=0)
        try:
            self.store = LmdbStore(path, env, create=False)
        except BaseException:
            env.close()
            raise
        if self.store.file_id() != wanted:  # replaced between the look and the opening
            self.close()
            return None
        return self.store

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


def _map(fd: int, nbytes: int) -> np.ndarray:
    # Populated at once: every page this process writes for the first time costs it a fault, and which device
    # blocks a promotion fills changes from one to the next (a 7000-token promotion by one reader into a host
    # KV cache: 43 ms faulting pages in as it went, 23 ms populated).
    return np.frombuffer(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE), dtype=np.uint8)


def serve(sock: socket.socket) -> None:
    reader = Reader()
    try:
        while True:
            try:
                message, fds = recv_message(sock)
            except EOFError:
                return
            reply = reader.handle(message, fds)
            if reply is not None:
                send_message(sock, reply)
    finally:
        reader.close()


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
