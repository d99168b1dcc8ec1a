# SPDX-License-Identifier: Apache-2.0
"""vllm_events.py - vLLM 0.33.0's KV-event wire schema (vllm/distributed/kv_events.py) as msgspec
Structs, for tests that decode kvpoold's events the way a vLLM consumer does (issue #29).

Only the schema: class names (the tags), field names, order, types, defaults and the Struct
options, which together fix the msgpack bytes. Declared here so a test needs msgspec alone, not
vLLM. Decode a payload with msgspec.msgpack.Decoder(KVEventBatch, strict=True).
"""

from typing import Any

import msgspec

# vllm.v1.core.kv_cache_utils.ExternalBlockHash
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
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
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def decode(payload: bytes) -> KVEventBatch:
    """A payload as vLLM's consumers read it (strict: no type coercion)."""
    return msgspec.msgpack.Decoder(KVEventBatch, strict=True).decode(payload)


def encode(batch: KVEventBatch) -> bytes:
    """A batch as vLLM's publisher writes it."""
    return msgspec.msgpack.Encoder().encode(batch)
