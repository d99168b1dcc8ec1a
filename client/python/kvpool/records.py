# SPDX-License-Identifier: Apache-2.0
"""The records a Client answers with: PoolInfo, PageTable, Stats, Pin, Commit, CacheStats,
TierHit, Load, Ticket, TransferInfo. Plain values (frozen dataclasses and named tuples) that own their data
and hold no handle; each one that mirrors a libkvpool struct says which, and converts from it
(_from_c) here, next to its fields."""
import builtins
import ctypes
import dataclasses
import enum
import struct
from typing import List, NamedTuple, Optional, Tuple, Union

import numpy as np

from . import _lib
from .codes import DTYPES, Backend, DType, Layout, Storage, code

# PoolInfo's fields that carry a code of kvpool.h, and the enum of each
_CODES = {"dtype": DType, "layout": Layout, "storage": Storage, "backend": Backend}


def _name(value) -> str:
    """An enum member's lower-case name ("hnd", "cuda"), "unknown" for a plain int."""
    return value.name.lower() if isinstance(value, enum.IntEnum) else "unknown"

@dataclasses.dataclass(frozen=True)
class PoolInfo:
    """kvp_pool_info_t (the daemon's PoolInfo). Strides are in elements; sizes in bytes, for
    one device's share of heads_per_device heads."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: Union[DType, int]  # an int only for a code this package does not know
    layout: Union[Layout, int]
    storage: Union[Storage, int]
    num_devices: int
    backend: Union[Backend, int]
    elem_bytes: int
    heads_per_device: int
    pool_bytes: int
    layer_bytes: int
    v_offset_bytes: int
    stride_page: int
    stride_n: int
    stride_h: int
    map_granularity: int
    device_ids: Tuple[int, ...]

    @property
    def dtype_name(self) -> str:
        return DTYPES[self.dtype].name if self.dtype in DTYPES else "unknown"

    @property
    def layout_name(self) -> str:
        return _name(self.layout)

    @property
    def storage_name(self) -> str:
        return _name(self.storage)

    @property
    def backend_name(self) -> str:
        return _name(self.backend)

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype].numpy)

    @classmethod
    def _from_c(cls, p):
        vals = {f.name: getattr(p, f.name) for f in dataclasses.fields(cls) if f.name != "device_ids"}
        for name, enum_type in _CODES.items():
            vals[name] = code(enum_type, vals[name])
        n = min(p.num_devices, _lib.KVP_CLIENT_MAX_DEVICES)
        return cls(device_ids=tuple(p.device_ids[i] for i in range(n)), **vals)


_NO_CACHED = np.zeros(0, np.uint32)
_NO_CACHED.flags.writeable = False


class PageTable(NamedTuple):
    """A batch's page table, laid out as FlashInfer's plan() / append_paged_kv_cache take it:
    int32 kv_indptr [B+1], kv_indices [kv_indptr[B]], kv_last_page_len [B], append_indptr
    [B+1], seq_lens [B]; copies: uint32 [n, 2] (src, dst) page pairs to copy (K and V, every
    layer) before appending (Reserve; the daemon already ran them for Append); cached_tokens:
    uint32 [B], the tokens each row linked from the prefix cache (reuse=True; zeros when the
    answer has none), a multiple of the page size."""

    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    append_indptr: np.ndarray
    seq_lens: np.ndarray
    copies: np.ndarray
    cached_tokens: np.ndarray = _NO_CACHED

    @property
    def batch_size(self) -> int:
        return int(self.kv_last_page_len.size)

    @property
    def nnz(self) -> int:
        """Tokens appended by the call (append_indptr[-1]; 0 for page_table)."""
        return int(self.append_indptr[-1]) if self.append_indptr.size else 0


@dataclasses.dataclass(frozen=True)
class Stats:
    """kvp_stats_summary_t."""

    num_pages: int
    free_pages: int
    used_pages: int
    shared_pages: int
    num_seqs: int
    num_clients: int
    num_tokens: int
    page_refs: int
    page_bytes: int
    uptime_ms: int
    requests_total: int
    append_bytes_total: int


class Pin(NamedTuple):
    """A pin of a cached prefix (kvp_pin_t): unpin(pin_id) drops it."""

    pin_id: int
    pinned_tokens: int
    pinned_pages: int
    expires_in_ms: int


class Commit(NamedTuple):
    """A Commit's answer: the keyed pages it covered, and how many of them were findable when
    the daemon answered (all without an event; with one, usually 0: they follow when the
    event completes)."""

    pages: int
    published: int


class TierHit(NamedTuple):
    """One prompt of lookup_tiers(): gpu_tokens, its leading tokens cached in the GPU pool (what
    lookup() answers), and host_tokens, the tokens after them found in the host tier (0 without
    one); both whole pages. A reserve()/append() with reuse, or a load(), links all
    gpu_tokens + host_tokens, restoring the host ones to the GPU first."""

    gpu_tokens: int
    host_tokens: int

    @property
    def total(self) -> int:
        """Tokens cached in either tier: gpu_tokens + host_tokens."""
        return self.gpu_tokens + self.host_tokens


class Load(NamedTuple):
    """A load()'s answer (kvp_load_t): loaded_tokens copied into the buffer (a multiple of the
    page size), host_tokens of them restored from the host tier first, completed: the bytes are
    in the buffer (always True from current daemons: the call waits for the copy)."""

    loaded_tokens: int
    host_tokens: int
    completed: bool


class CachedBlock(NamedTuple):
    """A block of cache_dump() (issue #29): hash and parent (None for a chain's first block) as
    the KV events name them (16 bytes), scope as their extra_keys carry it, medium "GPU" or
    "CPU" (the host tier), token_ids the block's tokens (zeros when events are off)."""

    hash: bytes
    parent: Optional[bytes]
    scope: str
    medium: str
    token_ids: Tuple[int, ...]


class CacheSnapshot(NamedTuple):
    """cache_dump()'s answer: every findable block, and next_seq, the first KV-event batch the
    snapshot does not reflect (-1: events off): load the blocks, then apply batches from
    next_seq on."""

    next_seq: int
    events: bool
    block_size: int
    blocks: List[CachedBlock]


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """The prefix cache's counters (kvp_cache_stats_t, Stats.cache). hit_tokens_total counts the
    tokens found in the GPU pool; the host_* figures and those after them are the host tier's
    (issue #28; all 0 when the daemon has none, cache.host_bytes 0): host_pages entries kept,
    host_slots slots usable now of host_slot_bytes each, host_bytes_ready of host_bytes_total
    allocated and pinned so far, host_hit_tokens_total tokens found there, pages demoted
    (GPU -> host), promoted (host -> GPU) and evicted from it for good, the copies' bytes and
    summed time (us, worker threads), and the pages being demoted / restored now."""

    cached_pages: int
    pinned_pages: int
    indexed_pages: int
    pins: int
    query_tokens_total: int
    hit_tokens_total: int
    evictions_pressure_total: int
    evictions_flush_total: int
    evictions_rewrite_total: int
    bytes: int
    host_pages: int = 0
    host_slots: int = 0
    host_bytes_total: int = 0
    host_bytes_ready: int = 0
    host_hit_tokens_total: int = 0
    demotions_total: int = 0
    promotions_total: int = 0
    host_evictions_total: int = 0
    offload_bytes_total: int = 0
    restore_bytes_total: int = 0
    offload_us_total: int = 0
    restore_us_total: int = 0
    demoting: int = 0
    restoring: int = 0
    host_slot_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Ticket:
    """What ExportBegin answers and Import needs (kvp_transfer_ticket_t): the sending engine hands
    it to the receiving one over its own channel, unchanged (to_bytes / from_bytes)."""

    nccl_id: bytes  # the communicator's ncclUniqueId, 128 bytes
    transfer_id: int
    num_tokens: int  # of the whole set
    num_layers: int
    bytes: int  # of the packed stream
    seq_tokens: Tuple[int, ...]  # each sequence's tokens, in stream order
    chunk_bytes: int
    flags: int

    _MAGIC = b"KVPT"
    _HEAD = struct.Struct("<4sI128sQIIQIII")  # magic, version, then the fields, num_seqs

    @property
    def num_seqs(self) -> int:
        return len(self.seq_tokens)

    def to_bytes(self) -> builtins.bytes:  # `bytes` is a field here
        """A portable form (little-endian, versioned) to carry between engines."""
        n = len(self.seq_tokens)
        return self._HEAD.pack(self._MAGIC, 1, self.nccl_id, self.transfer_id, self.num_tokens,
                               self.num_layers, self.bytes, self.chunk_bytes, self.flags,
                               n) + struct.pack("<%dI" % n, *self.seq_tokens)

    @classmethod
    def from_bytes(cls, b: Union[builtins.bytes, bytearray, memoryview]) -> "Ticket":
        b = bytes(b)
        h = cls._HEAD
        if len(b) < h.size:
            raise ValueError("a ticket is at least %d bytes, got %d" % (h.size, len(b)))
        magic, version, nid, tid, tokens, layers, nbytes, chunk, flags, n = h.unpack_from(b)
        if magic != cls._MAGIC or version != 1:
            raise ValueError("not a kvpool ticket (magic %r, version %d)" % (magic, version))
        if not 1 <= n <= _lib.KVP_TRANSFER_MAX_SEQS or len(b) != h.size + 4 * n:
            raise ValueError("a ticket of %d bytes naming %d sequences" % (len(b), n))
        return cls(nid, tid, tokens, layers, nbytes, struct.unpack_from("<%dI" % n, b, h.size),
                   chunk, flags)

    @classmethod
    def _from_c(cls, t):
        n = int(t.num_seqs)
        return cls(bytes(t.nccl_id), int(t.transfer_id), int(t.num_tokens), int(t.num_layers),
                   int(t.bytes), tuple(int(x) for x in t.seq_tokens[:n]), int(t.chunk_bytes),
                   int(t.flags))

    def _to_c(self):
        if len(self.nccl_id) != _lib.KVP_TRANSFER_ID_BYTES:
            raise ValueError("nccl_id has %d bytes, must be %d" %
                             (len(self.nccl_id), _lib.KVP_TRANSFER_ID_BYTES))
        if not 1 <= len(self.seq_tokens) <= _lib.KVP_TRANSFER_MAX_SEQS:
            raise ValueError("a ticket names 1..%d sequences, not %d" %
                             (_lib.KVP_TRANSFER_MAX_SEQS, len(self.seq_tokens)))
        t = _lib.kvp_transfer_ticket_t()
        ctypes.memmove(t.nccl_id, self.nccl_id, len(self.nccl_id))
        t.transfer_id, t.num_tokens, t.num_layers = self.transfer_id, self.num_tokens, \
            self.num_layers
        t.bytes, t.chunk_bytes, t.flags = self.bytes, self.chunk_bytes, self.flags
        t.num_seqs = len(self.seq_tokens)
        for i, v in enumerate(self.seq_tokens):
            t.seq_tokens[i] = v
        return t


@dataclasses.dataclass(frozen=True)
class TransferInfo:
    """One transfer as ListTransfers reports it (kvp_transfer_info_t)."""

    transfer_id: int
    direction: str  # "export" | "import"
    state: str  # "running" | "ok" | "failed"
    peer: str
    namespace: str
    seq_id: int  # a set's first
    num_seqs: int
    num_tokens: int
    bytes: int
    elapsed_ms: int
    message: str

