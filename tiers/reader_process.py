"""What every reader process shares (tiers/disk_reader.py, tiers/remote_reader.py): the wire to the engine's
process, the shared host memory it maps (tiers/shared_memory.py) and the copy of one verified record into it.

Why processes: a read in the engine's process needs Python's interpreter lock between its copy and its checksum
(and, from a server, per reply), several times per block, and shares it with the step thread; beside a busy step
loop a thread's reads wait for the lock more than they copy. A reader process has its own interpreter: what it
reads costs the engine's process one message per batch.

A reader imports neither torch nor the engine, so it starts quickly. It exits when its socket closes
(also when the engine's process dies).

Messages are msgpack maps, each framed by its length (u32 LE); a segment's descriptor travels with its message.
From the engine's process, to every reader:

    {"op": "segment", "id": N, "nbytes": B}   + a descriptor: map it; reply {"mapped": N} once mapped
    {"op": "forget", "ids": [N, ...]}           unmap them (their memory is freed once nobody maps it)
    {"op": "open", ...}                         open the tier's store now; reply {"opened": bool}
    {"op": "read", "fixed": b, "padding": b, "token_bytes": T, "header": H, "record": R, "keys": [k, ...],
     "tokens": b, "places": [[segment, offset], ...], ...}

`open` and `read` carry the tier's own fields besides (its reader's module says which). A read's reply:
{"codes": bytes, one per key (ABSENT, SERVED, CORRUPT), "error": None or [kind, message]}. Block k's record must be
`fixed + tokens[k*T:(k+1)*T] + padding`, a checksum and the payload (tiers/record.py); its payload goes to
`places[k]`, verified there.
"""
from __future__ import annotations

import mmap
import os
import socket
import struct
from typing import Optional

import msgpack
import numpy as np

from kvstrata.tiers.record_check import Buffer, RecordError, checked_payload, copy_checked

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


# -- a reader --------------------------------------------------------------------------------------------------


class SharedMemoryReader:
    """A reader's state common to every tier: the shared segments it maps. A tier's reader adds `open` (its
    store, ahead of the first read), `read` and `close`."""

    def __init__(self) -> None:
        self.segments: dict[int, np.ndarray] = {}

    def handle(self, message: dict, fds: list[int]) -> Optional[dict]:
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
                opened = self.open(message)
            except Exception:  # the first read then says what is wrong
                opened = False
            return {"opened": opened}
        if op == "read":
            return self.read(message)
        raise ValueError(f"unknown message {op!r}")

    def open(self, message: dict) -> bool:
        raise NotImplementedError

    def read(self, request: dict) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def copy_record(self, request: dict, k: int, record: Buffer) -> int:
        """Verify `record` as block k of `request` and copy its payload to the block's place: SERVED, or
        CORRUPT (it is not that block's record, or its payload does not match its checksum)."""
        t = request["token_bytes"]
        head = request["fixed"] + request["tokens"][k * t:(k + 1) * t] + request["padding"]
        segment, offset = request["places"][k]
        dest = self.segments[segment][offset:offset + request["record"] - request["header"]]
        try:
            copy_checked(*checked_payload(record, head, request["header"], request["record"]), dest)
        except RecordError:
            return CORRUPT
        return SERVED


def _map(fd: int, nbytes: int) -> np.ndarray:
    # Populated at once: every page this process writes for the first time costs it a fault, and which device
    # blocks a promotion fills changes from one to the next (a promotion that faulted pages in as it went took
    # much longer than one into a populated mapping).
    return np.frombuffer(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE), dtype=np.uint8)


def serve(sock: socket.socket, reader: SharedMemoryReader) -> None:
    """Answer the engine's process until it closes the socket."""
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
