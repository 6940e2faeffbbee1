"""KV events on the wire, as vLLM publishes them, so that routers written for vLLM can read ours.

The engine's tiers report BlockStored / BlockRemoved / AllBlocksCleared (tiers/block_events.py) to a
listener; `KVEventPublisher` is that listener. It only queues (a bounded queue: when it is full the
event is dropped and counted, and the step thread never waits), and its own thread batches what is
queued, encodes it and sends it:

- PUB socket, bound at `events.endpoint`: one multipart message per batch,
  `[topic, sequence number as 8-byte big-endian unsigned, msgpack payload]`; sequence numbers start
  at 0 and grow by 1, so a subscriber sees a gap when it missed some.
- ROUTER socket, bound at `events.replay_endpoint`: a client (REQ or DEALER) sends a start sequence
  number (8 bytes, big-endian); it gets back, one message each, `[seq, payload]` for every batch
  still kept (the last `events.replay_buffer`) from that number on, then `[-1 as 8 signed bytes, b""]`.

The payload is vLLM's `KVEventBatch` (vllm/distributed/kv_events.py), in one of two forms
(`events.format`). In both the batch is a positional array, `[ts, [event, ...], data_parallel_rank]`
(`ts` the batch's wall-clock time in seconds since the epoch; the rank always 0: one engine, as a vLLM
without data parallelism sends):

- `vllm` (the default; vLLM 0.26 and later): each event a map tagged by its `type`, its optional
  fields left out when unset, as msgspec's `omit_defaults` encodes them:

      {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h, "token_ids": [...],
       "block_size": n, "lora_id": nil, "medium": "GPU", "lora_name": nil, "group_idx": 0,
       "kv_cache_spec_kind": "full_attention"[, "locality": "LOCAL" | "REMOTE"]}
      {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": 0[, "locality": ...]}
      {"type": "AllBlocksCleared", "medium": "GPU"[, "locality": ...]}

- `vllm_legacy` (vLLM before 0.26, and the routers that still decode only its form): each event a
  positional array led by its tag:

      ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
      ["BlockRemoved", block_hashes, medium]
      ["AllBlocksCleared", medium]

Media (`events.medium_names`): with `vllm` (the default) vLLM's own names, `GPU` for the device
tier, `CPU` for pinned CPU and `STORAGE` for both disk and remote, told apart as vLLM's storage
tiers tell theirs, by `locality` (`LOCAL`: disk, `REMOTE`: the remote tier other replicas share);
with `kvstrata`, `DISK` and `REMOTE` as media of their own. Block hashes are the engine's chain hashes
as raw bytes (msgpack bin: 16 bytes with xxh3_128, 32 with sha256), or with `events.int_hashes` their
last 8 bytes as a 64-bit unsigned integer, as vLLM sends them under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.
`lora_id` and `lora_name` are always nil (no adapters); every layer shares one block table, so
`group_idx` is always 0 and the kind full attention. vLLM's AllBlocksCleared has no fields: a decoder
typed after it ignores the medium (maps: unknown keys; arrays: trailing elements).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgpack
import zmq

from kvstrata.engine.config import EventsConfig
from kvstrata.tiers.block_events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored

logger = logging.getLogger("kvstrata")

MAX_BATCH_EVENTS = 1024        # events per published batch, at most
IDLE_POLL_S = 0.02             # how often an idle publisher looks for replay requests
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
CLOSE_TIMEOUT_S = 2.0


# Our tiers as media on the wire: (medium, locality). vLLM names three media (GPU, CPU, STORAGE) and
# says of a storage tier whether it is LOCAL or REMOTE to the publisher; `kvstrata` names keep a medium
# for each of our tiers. Locality is only sent where vLLM's own tiers send one (storage).
MEDIA_BY_NAMES = {
    "vllm": {"device": ("GPU", None), "cpu": ("CPU", None), "disk": ("STORAGE", "LOCAL"),
             "remote": ("STORAGE", "REMOTE")},
    "kvstrata": {"device": ("GPU", None), "cpu": ("CPU", None), "disk": ("DISK", "LOCAL"),
                 "remote": ("REMOTE", "REMOTE")},
}
TIER_OF_MEDIUM = {"GPU": "device", "CPU": "cpu", "DISK": "disk", "REMOTE": "remote"}
GROUP_IDX = 0                            # one KV cache group: every layer shares the block table
KV_CACHE_SPEC_KIND = "full_attention"    # every layer attends to every earlier token
DATA_PARALLEL_RANK = 0


def tier_medium(medium: str | None, locality: str | None = None) -> str | None:
    """A medium read off the wire as our tier's name (vLLM's names or ours; unknown ones as sent).
    vLLM's STORAGE is the disk tier unless its locality says REMOTE."""
    if medium is None:
        return None
    upper = medium.upper()
    if upper == "STORAGE":
        return "remote" if (locality or "").upper() == "REMOTE" else "disk"
    return TIER_OF_MEDIUM.get(upper, medium)


def int_block_hash(block_hash: bytes) -> int:
    """vLLM's 64-bit form of a block hash: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True)
class WireFormat:
    """How events are put on the wire (`events.format`, `events.medium_names`, `events.int_hashes`)."""
    maps: bool = True          # vLLM's current tagged maps; False: the legacy arrays
    int_hashes: bool = False
    medium_names: str = "vllm"

    @classmethod
    def of(cls, config: EventsConfig) -> WireFormat:
        return cls(maps=config.format == "vllm", int_hashes=config.int_hashes, medium_names=config.medium_names)

    def hashes(self, hashes: list[bytes]) -> list:
        return [int_block_hash(h) for h in hashes] if self.int_hashes else list(hashes)

    def parent(self, block_hash: bytes | None):
        return int_block_hash(block_hash) if self.int_hashes and block_hash is not None else block_hash

    def medium(self, tier: str | None) -> tuple[str | None, str | None]:
        if tier is None:
            return None, None
        return MEDIA_BY_NAMES[self.medium_names].get(tier, (tier, None))


DEFAULT_FORMAT = WireFormat()


def encode_event(event: BlockEvent, fmt: WireFormat = DEFAULT_FORMAT) -> list | dict:
    """One event in vLLM's tagged form: a map with its `type` or, legacy, an array led by its tag."""
    medium, locality = fmt.medium(event.medium)
    tag = type(event).__name__
    if isinstance(event, BlockStored):
        required = {"block_hashes": fmt.hashes(event.block_hashes),
                    "parent_block_hash": fmt.parent(event.parent_block_hash), "token_ids": list(event.token_ids),
                    "block_size": event.block_size, "lora_id": None, "medium": medium, "lora_name": None}
        optional = {"group_idx": GROUP_IDX, "kv_cache_spec_kind": KV_CACHE_SPEC_KIND}
    elif isinstance(event, BlockRemoved):
        required = {"block_hashes": fmt.hashes(event.block_hashes), "medium": medium}
        optional = {"group_idx": GROUP_IDX}
    elif isinstance(event, AllBlocksCleared):
        required, optional = {"medium": medium}, {}
    else:
        raise TypeError(f"not a block event: {event!r}")
    if not fmt.maps:  # the legacy arrays end at the fields every reader of them knows
        return [tag, *required.values()]
    if locality is not None:
        optional["locality"] = locality
    return {"type": tag, **required, **optional}


def encode_batch(events: list[BlockEvent], ts: float, fmt: WireFormat = DEFAULT_FORMAT) -> bytes:
    return msgpack.packb([ts, [encode_event(e, fmt) for e in events], DATA_PARALLEL_RANK], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[BlockEvent]]:
    """A batch in any form (ours, any vLLM's, or an older kvstrata's map batch), media as our tiers'
    names; ValueError on anything else."""
    try:
        batch = msgpack.unpackb(payload, raw=False)
        ts, raw_events = (batch["ts"], batch["events"]) if isinstance(batch, dict) else batch[:2]
        return float(ts), [e for e in map(_decode_event, raw_events) if e is not None]
    except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException) as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None


def _decode_event(raw: list | dict) -> BlockEvent | None:
    if isinstance(raw, dict):
        tag = raw["type"]
        medium = tier_medium(raw.get("medium"), raw.get("locality"))
        if tag == "BlockStored":
            return BlockStored(list(raw["block_hashes"]), raw["parent_block_hash"], list(raw["token_ids"]),
                               int(raw["block_size"]), medium)
        if tag == "BlockRemoved":
            return BlockRemoved(list(raw["block_hashes"]), medium)
        if tag == "AllBlocksCleared":
            return AllBlocksCleared(medium)
        return None  # a kind of event newer than this reader: skipped, as vLLM's readers skip unknown tags
    tag = raw[0]
    if tag == "BlockStored":
        return BlockStored(list(raw[1]), raw[2], list(raw[3]), int(raw[4]),
                           tier_medium(raw[6]) if len(raw) > 6 else None)
    if tag == "BlockRemoved":
        return BlockRemoved(list(raw[1]), tier_medium(raw[2]) if len(raw) > 2 else None)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(tier_medium(raw[1]) if len(raw) > 1 else None)
    return None


class KVEventPublisher:
    """Publishes block events over ZMQ on its own thread; call it with an event (the engine's
    `block_events` listener). `close()` sends what is queued (for at most CLOSE_TIMEOUT_S) and unbinds.

    Both sockets are bound here, in the caller's thread, so that an endpoint in use is one line at
    start-up; from then on only the publisher thread touches them (ZMQ sockets are not thread-safe).
    """

    def __init__(self, config: EventsConfig, context: zmq.Context | None = None):
        self.config = config
        self._context = context or zmq.Context.instance()
        self._topic = config.topic.encode()
        self._format = WireFormat.of(config)
        self._queue: queue.Queue[BlockEvent] = queue.Queue(maxsize=config.queue_size)
        self._drop_lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.replay_buffer)
        self.published_batches = 0
        self.dropped_events = 0
        self._overflowing = False
        self._pub = self._bind(zmq.PUB, config.endpoint, "events.endpoint")
        try:
            self._replay = self._bind(zmq.ROUTER, config.replay_endpoint, "events.replay_endpoint")
        except ValueError:
            self._pub.close(linger=0)
            raise
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, kind: int, endpoint: str, key: str) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUB:  # a subscriber further behind than the replay buffer could not catch up anyway
            sock.setsockopt(zmq.SNDHWM, self.config.replay_buffer)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            reason = os.strerror(exc.errno) if exc.errno else str(exc)  # pyzmq's strerror repeats the address
            raise ValueError(f"{key}: cannot bind {endpoint}: {reason}") from None
        return sock

    # -- the listener side: any thread, never blocks ----------------------------------------

    def __call__(self, event: BlockEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            with self._drop_lock:
                self.dropped_events += 1
                if self._overflowing:
                    return
                self._overflowing = True
            logger.warning("KV events: the publisher's queue is full (%d events); dropping events until it "
                           "drains (counted in kvstrata_kv_events_dropped_total)", self.config.queue_size)

    # -- the publisher thread ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay.poll(0):
                self._serve_replay()
            events = self._take_batch()
            if events:
                self._publish(events)
            elif self._stopping.is_set():
                return

    def _take_batch(self) -> list[BlockEvent]:
        try:
            events = [self._queue.get(timeout=IDLE_POLL_S)]
        except queue.Empty:
            return []
        while len(events) < MAX_BATCH_EVENTS:
            try:
                events.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if self._overflowing and self._queue.empty():
            with self._drop_lock:
                self._overflowing = False
        return events

    def _publish(self, events: list[BlockEvent]) -> None:
        seq = self.published_batches
        payload = encode_batch(events, time.time(), self._format)
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # no subscriber can keep up: the batch stays in the replay buffer
        self._buffer.append((seq, payload))
        self.published_batches += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        # From a REQ client: [identity, b"", start]; from a DEALER: [identity, start].
        if len(frames) not in (2, 3) or len(frames[-1]) != 8:
            logger.debug("KV events: ignoring a malformed replay request of %d frames", len(frames))
            return
        identity, envelope, start = frames[0], frames[1:-1], int.from_bytes(frames[-1], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((identity, *envelope, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, *envelope, END_OF_REPLAY, b""))

    # -- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Publish what is queued, then stop and unbind. Safe to call twice."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._pub.close(linger=0)
            self._replay.close(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- the reading side (what `kvstrata route` uses) ----------------------------------------------

REPLAY_TIMEOUT_MS = 1000


@dataclass
class ReceivedBatch:
    seq: int
    ts: float
    events: list[BlockEvent]


class KVEventSubscriber:
    """Reads one publisher's batches in sequence order, recovering missed ones through its replay socket.

    `poll` returns the batches that arrived, in order and without gaps where the replay buffer
    still had them (a subscriber that starts late asks for everything still buffered); a batch seen
    twice is returned once. A publisher that restarted (a new process numbers from 0 again) cannot
    be told from duplicates by sequence numbers alone: whoever knows it restarted (`kvstrata route`
    does, from its health checks) calls `resync`, which starts over from what it still buffers.
    """

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "", context: zmq.Context | None = None):
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._context = context or zmq.Context.instance()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self.next_seq = 0
        self.missed_batches = 0  # batches neither received nor still buffered for replay

    @property
    def socket(self) -> zmq.Socket:
        """The SUB socket, for a poller that waits on several subscribers."""
        return self._sub

    def poll(self, timeout_ms: int = 0) -> list[ReceivedBatch]:
        batches: list[ReceivedBatch] = []
        wait = timeout_ms
        while self._sub.poll(wait):
            wait = 0
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            seq = int.from_bytes(frames[1], "big")
            if seq < self.next_seq:
                continue  # already had it (through replay)
            if seq > self.next_seq:
                replayed = self._replay(self.next_seq, seq)
                self.missed_batches += (replayed[0].seq if replayed else seq) - self.next_seq
                batches += replayed
            batches += self._decoded(seq, frames[2])
            self.next_seq = seq + 1
        return batches

    def resync(self) -> list[ReceivedBatch]:
        """Every batch the publisher still buffers, from the first; later `poll`s continue from there."""
        batches = self._replay(0, None)
        self.next_seq = batches[-1].seq + 1 if batches else 0
        return batches

    def _replay(self, start: int, stop: int | None) -> list[ReceivedBatch]:
        """Batches start..stop-1 (None: to the last) from the replay socket, in order, where the
        publisher still has them. A fresh DEALER each time, so that a reply to an abandoned request
        can never be taken for the answer to this one."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        got: list[ReceivedBatch] = []
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(REPLAY_TIMEOUT_MS):
                frames = dealer.recv_multipart()
                if len(frames) != 3 or frames[1] == END_OF_REPLAY:
                    break
                seq = int.from_bytes(frames[1], "big")
                if seq >= start and (stop is None or seq < stop) and (not got or seq > got[-1].seq):
                    got += self._decoded(seq, frames[2])
        finally:
            dealer.close(linger=0)
        return got

    @staticmethod
    def _decoded(seq: int, payload: bytes) -> list[ReceivedBatch]:
        try:
            ts, events = decode_batch(payload)
        except ValueError as exc:
            logger.warning("KV events: skipping batch %d: %s", seq, exc)
            return []
        return [ReceivedBatch(seq, ts, events)]

    def close(self) -> None:
        self._sub.close(linger=0)


class BlockIndex:
    """Which blocks one publisher holds, per medium, as its events tell."""

    def __init__(self) -> None:
        self.by_medium: dict[str, set[bytes]] = {}

    def apply(self, event: BlockEvent) -> None:
        if isinstance(event, BlockStored):
            self.by_medium.setdefault(event.medium, set()).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.by_medium.get(event.medium, set()).difference_update(event.block_hashes)
        elif event.medium is None:  # AllBlocksCleared from a publisher that does not say which tier
            self.by_medium.clear()
        else:
            self.by_medium.pop(event.medium, None)

    def clear(self) -> None:
        self.by_medium.clear()

    def prefix_length(self, block_hashes: list[bytes], media: tuple[str, ...]) -> int:
        """How many leading blocks of a chain are held in any of `media`."""
        held = [self.by_medium.get(m, ()) for m in media]
        n = 0
        for h in block_hashes:  # a publisher with `events.int_hashes` holds vLLM's 64-bit form of each
            if not any(h in s or int_block_hash(h) in s for s in held):
                break
            n += 1
        return n
