"""vLLM's KV event structs as msgspec declares them, mirrored field for field (written from reading
vllm/distributed/kv_events.py of vLLM 0.32; no vLLM needed): what a router built on vLLM's classes
decodes our events with. tests/vllm_compat_check.py decodes with the real classes where vLLM is installed."""
from __future__ import annotations

from typing import Any

import msgspec


# vLLM 0.32's structs (vllm/distributed/kv_events.py), mirrored field for field: the batch a positional
# array (array_like) whose rank is left out when unset; each event a map tagged by its class name, the
# fields after `lora_name` optional and left out when unset (omit_defaults). A decoder typed this way
# rejects a batch sent as a map ("Expected `array`, got `object`") and events sent as arrays.
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):  # vLLM tags by class name
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


# The form vLLM sent before 0.26, which routers that have not moved (kthena's, llm-d-kv-cache before
# 0.9) still decode: every struct array_like, the events too.
class LegacyKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class LegacyBlockStored(LegacyKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class LegacyBlockRemoved(LegacyKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class LegacyAllBlocksCleared(LegacyKVCacheEvent, tag="AllBlocksCleared"):
    pass


class LegacyEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared]
    data_parallel_rank: int | None = None
