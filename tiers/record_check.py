"""A block record's checks, without torch: what a reader needs to verify a record (tiers/record.py has the
format) and copy its payload out. The disk tier's reader processes (tiers/disk_reader.py) import this alone,
so that they start quickly."""
from __future__ import annotations

import struct
from typing import Union

import numpy as np
import xxhash

CHECKSUM = struct.Struct("<Q")  # xxh3_64 of the payload, stored just before it

# What a tier hands to the checks: LMDB buffers, `bytes` from a server, bytearrays.
Buffer = Union[bytes, bytearray, memoryview]


class RecordError(Exception):
    """A record that does not verify against what the reader expects; the message says why."""


def checked_payload(record: Buffer, head: bytes, header_nbytes: int, record_nbytes: int) -> tuple[int, memoryview]:
    """The stored checksum and a view of the payload of `record`, once its length is `record_nbytes` and its
    bytes before the checksum are exactly `head` (the layout's and the expected token ids'). Raises
    RecordError otherwise."""
    record = memoryview(record)
    if record.format != "B" or record.ndim != 1:
        record = record.cast("B")
    if len(record) != record_nbytes or record[:len(head)] != head:
        raise RecordError("not the expected block's record (its header differs)")
    (checksum,) = CHECKSUM.unpack_from(record, len(head))
    return checksum, record[header_nbytes:]


def copy_checked(checksum: int, payload: Buffer, dest: np.ndarray) -> None:
    """Copy `payload` into `dest` (uint8, host memory) and check the copy against `checksum`: taken of `dest`
    right after the copy, while it is still in cache, it is one pass over the stored bytes and checks exactly
    the bytes the caller will use. Raises RecordError on a mismatch (`dest` is then undefined)."""
    np.copyto(dest, np.frombuffer(payload, dtype=np.uint8))
    if xxhash.xxh3_64_intdigest(dest) != checksum:
        raise RecordError("payload checksum mismatch")
