"""Mooncake-format request traces (the FAST'25 release of kvcache-ai/Mooncake): one JSON object a line,

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 2353]}

`timestamp` in milliseconds from the trace's start, `hash_ids` one id per `block_tokens` (512) prompt
tokens, equal ids naming equal prefixes (an id names its whole prefix, as a chain hash does). A trace
holds no token ids and no text: `kvstrata plan` replays one, `server.trace_log` writes one.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

TRACE_BLOCK_TOKENS = 512  # the tokens one hash id stands for in the Mooncake traces
_ID_BYTES = 7             # an id is the first 53 bits of a chain hash: exact as a JSON number in any reader


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | os.PathLike, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a trace file, in file order (at most `limit`). ValueError, one line naming the file
    and line, for anything that is not a Mooncake-format request."""
    return list(iter_trace(path, limit))


def iter_trace(path: str | os.PathLike, limit: int | None = None) -> Iterator[TraceRequest]:
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the trace: {exc.strerror or exc}") from None
    with handle:
        count = 0
        try:
            for number, line in enumerate(handle, 1):
                if limit is not None and count >= limit:
                    return
                if not line.strip():
                    continue
                yield _parse(line, f"{path}:{number}")
                count += 1
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a trace (not UTF-8 text)") from None


def _parse(line: str, where: str) -> TraceRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not a JSON object ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in ("timestamp", "input_length", "hash_ids"):
        if key not in record:
            raise ValueError(f"{where}: missing {key!r}")
    timestamp, input_length = record["timestamp"], record["input_length"]
    output_length, ids = record.get("output_length", 0), record["hash_ids"]
    if not _number(timestamp) or timestamp < 0:
        raise ValueError(f"{where}: timestamp must be a number of milliseconds >= 0, got {timestamp!r}")
    for key, value in (("input_length", input_length), ("output_length", output_length)):
        if not _integer(value) or value < 0:
            raise ValueError(f"{where}: {key} must be an integer >= 0, got {value!r}")
    if not isinstance(ids, list) or not all(_integer(i) for i in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers")
    if input_length < 1:
        raise ValueError(f"{where}: input_length must be at least 1")
    return TraceRequest(float(timestamp), input_length, output_length, tuple(ids))


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def trace_ids(block_hashes: Sequence[bytes], block_size: int, num_tokens: int,
              block_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """The trace's ids of a prompt whose full blocks have `block_hashes` (chain hashes of `block_size`-token
    blocks): one per `block_tokens` tokens, the chain hash of the last full block in that span, cut to 53 bits.
    A chain hash names its whole prefix, so equal ids are equal prefixes, and nothing of the tokens is in it.
    A last span shorter than a block has no id."""
    per_id = max(block_tokens // block_size, 1)
    spans = -(-min(num_tokens // block_size, len(block_hashes)) // per_id)
    ids = []
    for k in range(spans):
        last = min((k + 1) * per_id, len(block_hashes)) - 1
        ids.append(int.from_bytes(block_hashes[last][:_ID_BYTES], "big") >> 3)
    return ids


class TraceWriter:
    """Appends requests to a trace file, private to its owner (mode 0600: the ids are the server's chain
    hashes, which name prompts to whoever can compute them). Timestamps are milliseconds since the first
    request this writer logged; appending to an existing trace continues after its last timestamp."""

    def __init__(self, path: str | os.PathLike, block_size: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> None:
        self.path = Path(path)
        self.block_size = block_size
        self.block_tokens = block_tokens
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)  # an existing file too: the trace must not stay readable by others
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._offset_ms = _last_timestamp(self.path)
        self._start = time.monotonic()

    def log(self, block_hashes: Sequence[bytes], num_tokens: int, output_length: int, ago_s: float = 0.0) -> None:
        """One request that arrived `ago_s` seconds ago (it is logged when it ends, its timestamp its arrival)."""
        elapsed_ms = max((time.monotonic() - self._start - ago_s) * 1000.0, 0.0)
        record = {"timestamp": round(self._offset_ms + elapsed_ms),
                  "input_length": int(num_tokens), "output_length": int(output_length),
                  "hash_ids": trace_ids(block_hashes, self.block_size, num_tokens, self.block_tokens)}
        line = json.dumps(record, separators=(", ", ": ")) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _last_timestamp(path: Path) -> float:
    """The last request's timestamp in an existing trace plus a millisecond, 0 for a new or empty one."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.seek(max(0, handle.tell() - 65536))
            tail = handle.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return 0.0
    for line in reversed(tail[1:] if size else tail):
        try:
            return float(json.loads(line)["timestamp"]) + 1.0
        except (ValueError, KeyError, TypeError):
            continue
    return 0.0


class TraceLog:
    """A request listener (engine/async_engine.py `RequestListener`) that passes every event on to `inner` and
    appends each finished request to `writer`: its arrival, its lengths and its prompt's ids. Runs on the engine
    thread: one short buffered write per request."""

    def __init__(self, inner, writer: TraceWriter) -> None:
        self.inner = inner
        self.writer = writer

    def on_first_token(self, receipt, num_prompt_tokens: int) -> None:
        self.inner.on_first_token(receipt, num_prompt_tokens)

    def on_token_gap(self, gap_s: float) -> None:
        self.inner.on_token_gap(gap_s)

    def on_step(self, num_tokens: int, num_generated_tokens: int) -> None:
        self.inner.on_step(num_tokens, num_generated_tokens)

    def on_finished(self, finished) -> None:
        self.inner.on_finished(finished)
        if finished.num_prompt_tokens > 0:
            self.writer.log(finished.block_hashes, finished.num_prompt_tokens, finished.num_generated_tokens,
                            ago_s=finished.e2e_s)
