"""The block record: one block as one self-verifying byte string, the same in every tier that keeps bytes.

The disk tier stores records as LMDB values; a remote tier stores the same records as values of a
key-value server. A record holds, little-endian:

    offset       size   field
    0            8      magic b"KVSBLOCK"
    8            2      record version (u16)
    10           2      length L of the layout description (u16)
    12           4      number N of token ids (u32)
    16           L      layout description, ASCII, e.g. b"kv1 bfloat16 30x2x16x3x64"
    16+L         8N     token ids (i64)
    ...                 zero padding, so that the payload starts at a multiple of 64 bytes
    H-8          8      xxh3_64 of the payload (u64)
    H            P      payload: the block's bytes, `layout.block_nbytes` of them

Everything before the checksum is a function of the layout and the token ids alone, so a reader
that knows what it expects builds those bytes itself and compares: a record written for another
layout, another format version or other token ids is refused by one comparison, and the checksum
covers the rest. Nothing in a record is trusted before it is verified, so a damaged, truncated or
foreign record is a `RecordError` (a miss for the tier), never wrong output.
"""
from __future__ import annotations

import struct
import warnings
from typing import Sequence

import numpy as np
import torch
import xxhash

from kvstrata.tiers.base import KV_LAYOUT_VERSION, BlockLayout, token_tuple
from kvstrata.tiers.record_check import CHECKSUM as _CHECKSUM
from kvstrata.tiers.record_check import Buffer, RecordError, checked_payload, copy_checked

MAGIC = b"KVSBLOCK"
RECORD_VERSION = 1
_PREFIX = struct.Struct("<8sHHI")     # magic, version, layout description length, token count
_TOKEN_ID_BYTES = 8                   # i64
_PAYLOAD_ALIGN = 64

def layout_description(layout: BlockLayout) -> bytes:
    """The layout a record was written for, as stored in it: KV layout version, dtype and block shape."""
    dtype = str(layout.dtype).removeprefix("torch.")
    return f"kv{KV_LAYOUT_VERSION} {dtype} {'x'.join(map(str, layout.block_shape))}".encode("ascii")


class RecordCodec:
    """Encodes and verifies the records of blocks of one layout (and `layout.block_size` tokens each)."""

    def __init__(self, layout: BlockLayout):
        self.layout = layout
        self.payload_nbytes = layout.block_nbytes
        description = layout_description(layout)
        self._fixed = _PREFIX.pack(MAGIC, RECORD_VERSION, len(description), layout.block_size) + description
        self._token_ids = struct.Struct(f"<{layout.block_size}q")
        unpadded = len(self._fixed) + self._token_ids.size + _CHECKSUM.size
        self.header_nbytes = -(-unpadded // _PAYLOAD_ALIGN) * _PAYLOAD_ALIGN
        self._padding = bytes(self.header_nbytes - unpadded)
        self.record_nbytes = self.header_nbytes + self.payload_nbytes

    # -- writing -----------------------------------------------------------------------------

    def encode(self, token_ids: Sequence[int], payload: torch.Tensor) -> bytearray:
        """The record of one block: its token ids and a copy of `payload` (flat uint8, any device)."""
        assert payload.dtype == torch.uint8 and payload.numel() == self.payload_nbytes, \
            "a payload is a flat uint8 tensor of layout.block_nbytes bytes"
        head = self.head(token_ids)
        record = bytearray(self.record_nbytes)
        record[:len(head)] = head
        body = np.frombuffer(record, dtype=np.uint8, offset=self.header_nbytes)
        if payload.device.type == "cpu":
            np.copyto(body, payload.detach().contiguous().numpy())
        else:
            torch.from_numpy(body).copy_(payload)
        # Hashed from the copy just made, while it is still in cache: one pass over the source.
        _CHECKSUM.pack_into(record, len(head), xxhash.xxh3_64_intdigest(body))
        return record

    # -- reading -----------------------------------------------------------------------------

    def decode_into(self, record: Buffer, token_ids: Sequence[int], dest: torch.Tensor) -> None:
        """Verify `record` as the block of `token_ids` and copy its payload into `dest`.

        `dest` is a flat uint8 tensor of `payload_nbytes` (host, pinned or device memory). Raises
        RecordError if anything differs; `dest` is then undefined (a miss). Into host memory the
        checksum is taken of `dest` right after the copy, while it is still in cache: one pass over
        the stored bytes, and it checks exactly the bytes the caller will use.
        """
        if dest.device.type == "cpu":
            copy_checked(*self._checked_header(record, token_ids), dest.numpy())
            return
        payload = self.verify(record, token_ids)
        # A read-only source (an LMDB buffer, bytes) makes torch warn; the copy from pageable memory
        # is synchronous, so it is done before the caller's buffer (an LMDB transaction) goes away.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dest.copy_(torch.frombuffer(payload, dtype=torch.uint8))

    def verify(self, record: Buffer, token_ids: Sequence[int]) -> memoryview:
        """Verify `record` as the block of `token_ids` without copying it; returns its payload (a view
        of `record`). Raises RecordError if anything differs."""
        checksum, payload = self._checked_header(record, token_ids)
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            raise RecordError("payload checksum mismatch")
        return payload

    @property
    def reader_fields(self) -> dict:
        """What a reader process needs to build and check the records of this layout (tiers/disk_reader.py)."""
        return {"fixed": self._fixed, "padding": self._padding, "token_bytes": self._token_ids.size,
                "header": self.header_nbytes, "record": self.record_nbytes}

    def pack_token_ids(self, blocks: Sequence[Sequence[int]]) -> bytes | None:
        """The token ids of `blocks` as their records hold them, one block after another; None if one of them
        does not fill a block (the in-process read then says why)."""
        try:
            packed = np.array([token_tuple(ids) for ids in blocks], dtype="<i8")
        except (ValueError, OverflowError):
            return None
        if packed.shape != (len(blocks), self.layout.block_size):
            return None
        return packed.tobytes()

    def head(self, token_ids: Sequence[int]) -> bytes:
        """The bytes before the checksum of the record of `token_ids`: what a reader compares."""
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        try:
            return self._fixed + self._token_ids.pack(*token_ids) + self._padding
        except struct.error:
            raise RecordError(f"token ids {token_ids!r} do not fill a block of {self.layout.block_size} "
                              "as 64-bit integers") from None

    def token_ids(self, record: Buffer) -> tuple[int, ...] | None:
        """The token ids a record of this layout names, read from its header alone (the payload is not
        verified: a reader verifies it before serving it). None for a record of another layout or size."""
        view = memoryview(record).cast("B")
        if len(view) != self.record_nbytes or view[:len(self._fixed)] != self._fixed:
            return None
        return self._token_ids.unpack_from(view, len(self._fixed))

    def _checked_header(self, record: Buffer, token_ids: Sequence[int]) -> tuple[int, memoryview]:
        """The stored checksum and the payload view, once the header is exactly the expected one."""
        head = self.head(token_ids)
        try:
            return checked_payload(record, head, self.header_nbytes, self.record_nbytes)
        except RecordError:
            raise RecordError(self._why_not(memoryview(record).cast("B"), head)) from None

    def _why_not(self, record: memoryview, head: bytes) -> str:
        """Why a record's header is not the expected one (for logs; only called on a mismatch)."""
        if len(record) < _PREFIX.size or bytes(record[:len(MAGIC)]) != MAGIC:
            return "not a block record"
        _, version, description_len, _ = _PREFIX.unpack_from(record)
        if version != RECORD_VERSION:
            return f"record version {version}, expected {RECORD_VERSION}"
        description = bytes(record[_PREFIX.size:_PREFIX.size + description_len])
        if description != self._fixed[_PREFIX.size:]:
            return f"written for layout {description.decode('ascii', 'replace')!r}, not {layout_description(self.layout).decode()!r}"
        if len(record) != self.record_nbytes:
            return f"record is {len(record)} bytes, expected {self.record_nbytes}"
        return "token ids differ from the expected ones"
