"""A disk tier reader process: reads block records from the tier's LMDB store, verifies them and copies their
payloads into shared host memory (tiers/shared_memory.py) that the engine's process copies to the device.

Run as `python -m kvstrata.tiers.disk_reader FD` by the disk tier (tiers/reader_pool.py), FD one end of a Unix
stream socket; the wire and the messages every reader shares are in tiers/reader_process.py. LMDB is made for
this: every process that opens the store reads the snapshot it began, beside the one writer. The disk tier's
fields:

    {"op": "open", "path": P, "file": [dev, ino]}   open the store now
    {"op": "read", "path": P, "file": [dev, ino], ...}   read from the store at P, if its data file is that one

A read's error kinds: "damaged" (the store's file is damaged: the tier replaces it), "stale" (the path names
another store than the tier's now) or "failed" (anything else).
"""
from __future__ import annotations

import socket
import sys

import lmdb

from kvstrata.tiers.lmdb_store import DAMAGE_ERRORS, SUBDBS, LmdbStore, StoreDamaged, data_file, file_id
from kvstrata.tiers.reader_process import CORRUPT, SharedMemoryReader, serve


class DiskReader(SharedMemoryReader):
    """A disk tier reader's state: the shared segments it maps and the store it has open."""

    def __init__(self) -> None:
        super().__init__()
        self.store: LmdbStore | None = None

    def open(self, message: dict) -> bool:
        return self._open(message["path"], tuple(message["file"])) is not None

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
        keys = request["keys"]
        with store.begin(db=store.blocks) as txn:
            for n, k in enumerate(todo):
                try:
                    record = txn.get(keys[k])
                except lmdb.Error:
                    codes[k] = CORRUPT
                    return todo[n + 1:]
                if record is not None:
                    codes[k] = self.copy_record(request, k, record)
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


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), DiskReader())
