"""The block record: what a tier stores for a block (disk values, remote values) decodes back to exactly
the payload it was made from, and only for the block it was made for: another layout, other token
ids, a truncated, extended or damaged record are refused (a miss), never decoded into wrong bytes."""
import struct

import pytest
import torch
from tier_cases import BF16, FP32, payload, tokens

from kvstrata.tiers.base import BlockLayout
from kvstrata.tiers.record import MAGIC, RecordCodec, RecordError

CODEC = RecordCodec(BF16)


def decoded(codec: RecordCodec, record, token_ids) -> torch.Tensor:
    dest = torch.empty(codec.payload_nbytes, dtype=torch.uint8)
    codec.decode_into(record, token_ids, dest)
    return dest


@pytest.mark.parametrize("as_buffer", [bytearray, bytes, memoryview], ids=["bytearray", "bytes", "memoryview"])
@pytest.mark.parametrize("layout", [BF16, FP32], ids=["bf16", "fp32"])
def test_a_record_decodes_to_the_payload_it_was_made_from(layout, as_buffer):
    codec = RecordCodec(layout)
    record = codec.encode(tokens(1, layout), payload(layout, 1))
    assert len(record) == codec.record_nbytes and codec.header_nbytes % 64 == 0
    assert torch.equal(decoded(codec, as_buffer(record), tokens(1, layout)), payload(layout, 1))
    assert bytes(codec.verify(as_buffer(record), tokens(1, layout))) == payload(layout, 1).numpy().tobytes()


def test_token_ids_may_come_as_a_tuple_or_a_tensor():
    record = CODEC.encode(torch.tensor(tokens(2)), payload(BF16, 2))
    assert torch.equal(decoded(CODEC, record, tuple(tokens(2))), payload(BF16, 2))


def test_a_record_for_other_token_ids_is_refused():
    record = CODEC.encode(tokens(1), payload(BF16, 1))
    other = tokens(1)
    other[-1] += 1
    with pytest.raises(RecordError, match="token ids differ"):
        decoded(CODEC, record, other)


def test_a_record_for_another_layout_of_the_same_size_is_refused():
    other = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    assert other.block_nbytes == BF16.block_nbytes  # same size, different meaning
    record = RecordCodec(other).encode(tokens(1), payload(BF16, 1))
    with pytest.raises(RecordError, match="written for layout 'kv1 float32 2x2x4x2x4'"):
        decoded(CODEC, record, tokens(1))


def test_a_record_of_another_version_is_refused():
    record = CODEC.encode(tokens(1), payload(BF16, 1))
    struct.pack_into("<H", record, len(MAGIC), 99)
    with pytest.raises(RecordError, match="record version 99"):
        decoded(CODEC, record, tokens(1))


@pytest.mark.parametrize("cut", [lambda r: r[:-1], lambda r: r[:CODEC.header_nbytes], lambda r: r[:10],
                                 lambda r: b"", lambda r: r + b"\0"],
                         ids=["last-byte", "header-only", "ten-bytes", "empty", "one-byte-more"])
def test_a_truncated_or_extended_record_is_refused(cut):
    record = bytes(CODEC.encode(tokens(1), payload(BF16, 1)))
    with pytest.raises(RecordError):
        decoded(CODEC, cut(record), tokens(1))


def test_any_damaged_byte_is_refused_never_decoded():
    record = CODEC.encode(tokens(1), payload(BF16, 1))
    for offset in range(len(record)):  # every byte of the header, checksum and payload
        damaged = bytearray(record)
        damaged[offset] ^= 0x5A
        with pytest.raises(RecordError):
            decoded(CODEC, damaged, tokens(1))
        with pytest.raises(RecordError):
            CODEC.verify(damaged, tokens(1))


def test_decoding_for_a_device_destination_verifies_before_copying():
    # No accelerator here: a meta-device tensor takes the same branch a CUDA destination does.
    record = CODEC.encode(tokens(1), payload(BF16, 1))
    dest = torch.empty(CODEC.payload_nbytes, dtype=torch.uint8, device="meta")
    CODEC.decode_into(bytes(record), tokens(1), dest)
    record[-1] ^= 1
    with pytest.raises(RecordError, match="checksum"):
        CODEC.decode_into(bytes(record), tokens(1), dest)
