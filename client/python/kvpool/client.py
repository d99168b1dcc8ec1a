# SPDX-License-Identifier: Apache-2.0
"""Client: one libkvpool handle (one connection, one session of one namespace)."""
import builtins
import ctypes
import dataclasses
import os
import struct
import threading
from typing import (Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple,
                    Union)

import numpy as np

from . import _lib
from ._types import Array, IntArray, Salts, Stream, TokenIds
from .errors import KVP_EPRECOND, error

DTYPE_NAMES = {1: "fp8_e4m3", 2: "fp8_e5m2", 3: "fp16", 4: "bf16", 5: "fp32"}
# The NumPy dtype of a view. NumPy has no bf16 or fp8: those pools are shown raw, as unsigned
# integers of the element size (reinterpret with ml_dtypes or torch if needed).
NUMPY_DTYPES = {1: np.uint8, 2: np.uint8, 3: np.float16, 4: np.uint16, 5: np.float32}
LAYOUT_NAMES = {0: "nhd", 1: "hnd"}
STORAGE_NAMES = {0: "combined", 1: "split"}
BACKEND_NAMES = {0: "host", 1: "cuda"}


@dataclasses.dataclass(frozen=True)
class PoolInfo:
    """kvp_pool_info_t (the daemon's PoolInfo). Strides are in elements; sizes in bytes, for
    one device's share of heads_per_device heads."""

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: int
    layout: int
    storage: int
    num_devices: int
    backend: int
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
        return DTYPE_NAMES.get(self.dtype, "unknown")

    @property
    def layout_name(self) -> str:
        return LAYOUT_NAMES.get(self.layout, "unknown")

    @property
    def storage_name(self) -> str:
        return STORAGE_NAMES.get(self.storage, "unknown")

    @property
    def backend_name(self) -> str:
        return BACKEND_NAMES.get(self.backend, "unknown")

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(NUMPY_DTYPES[self.dtype])

    @classmethod
    def _from_c(cls, p):
        vals = {f.name: getattr(p, f.name) for f in dataclasses.fields(cls) if f.name != "device_ids"}
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


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """The prefix cache's counters (kvp_cache_stats_t, Stats.cache)."""

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


class _Memory:
    """Exposes raw memory to NumPy (__array_interface__) and keeps its owner alive as long as an
    array over it exists."""

    def __init__(self, addr, nbytes, owner, readonly=False):
        self.owner = owner
        self.__array_interface__ = {
            "shape": (int(nbytes),),
            "typestr": "|u1",
            "data": (int(addr), bool(readonly)),
            "version": 3,
        }


def _u64_array(x, name):
    a = np.ascontiguousarray(np.atleast_1d(np.asarray(x)), dtype=np.uint64)
    if a.ndim != 1:
        raise ValueError("%s must be 1-D" % name)
    return a


def _num_tokens(num_tokens, n):
    t = np.asarray(num_tokens)
    if t.ndim == 0:
        t = np.full(n, int(t))
    t = np.ascontiguousarray(t, dtype=np.uint32)
    if t.shape != (n,):
        raise ValueError("num_tokens has %d entries for %d sequences" % (t.size, n))
    return t


def _ptr(a, ctype):
    return a.ctypes.data_as(ctypes.POINTER(ctype))


def _token_array(tokens, what):
    """One sequence of token ids as a contiguous int32 array."""
    a = np.ascontiguousarray(np.asarray(tokens).reshape(-1))
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError("%s must be integers, not %s" % (what, a.dtype))
    if a.size and (a.min() < -2**31 or a.max() >= 2**31):
        raise ValueError("%s do not fit in int32" % what)
    return a.astype(np.int32, copy=False)


def _prompts(prompts):
    """A list of token-id sequences -> (their int32 concatenation, uint32 lengths)."""
    arrs = [_token_array(p, "token ids") for p in prompts]
    lens = np.array([a.size for a in arrs], dtype=np.uint32)
    flat = np.concatenate(arrs) if arrs else np.zeros(0, np.int32)
    return np.ascontiguousarray(flat, dtype=np.int32), lens


def _salts(salts, n):
    """None -> (None, None); one bytes-like -> the same salt for all n; a list of n bytes-like
    (None: no salt) -> (uint8 concatenation, uint32 lengths)."""
    if salts is None:
        return None, None
    if isinstance(salts, (bytes, bytearray, memoryview)):
        salts = [bytes(salts)] * n
    salts = [b"" if x is None else bytes(x) for x in salts]
    if len(salts) != n:
        raise ValueError("%d salts for %d sequences" % (len(salts), n))
    lens = np.array([len(x) for x in salts], dtype=np.uint32)
    data = np.frombuffer(b"".join(salts) or b"\0", dtype=np.uint8).copy()
    return data, lens


# Cap on the kv_indices array prepared for a reply (entries, 4 bytes each; np.empty only
# reserves address space): beyond it a page_table read that overflows is repeated exactly.
_INDICES_CAP = 1 << 24


def _table_arrays(n, cap_indices):
    """The answer arrays of a table call for n sequences (kv_indices of cap_indices entries)
    and the kvp_page_table_t pointing at them."""
    cap = max(int(cap_indices), 1)
    arrs = dict(
        kv_indptr=np.empty(n + 1, np.int32),
        kv_indices=np.empty(cap, np.int32),
        kv_last_page_len=np.empty(max(n, 1), np.int32),
        append_indptr=np.empty(n + 1, np.int32),
        seq_lens=np.empty(max(n, 1), np.int32),
        copies=np.empty((max(n, 1), 2), np.uint32),
        cached_tokens=np.empty(n + 1, np.uint32),
    )
    t = _lib.kvp_page_table_t()
    for k, a in arrs.items():
        u32 = k in ("copies", "cached_tokens")
        setattr(t, k, _ptr(a, ctypes.c_uint32 if u32 else ctypes.c_int32))
    t.cap_batch, t.cap_indices, t.cap_copies = n + 1, cap, max(n, 1)
    return arrs, t


class StepReserve:
    """Client.reserve() for the same sequences again and again, with the least Python a call:
    the sequence ids, the salts, the argument structs and the answer's arrays are made once;
    run() copies the step's token counts (and token ids) in, makes the one C call and answers a
    PageTable whose arrays are VIEWS into this object's, valid until the next run() (copy what
    you keep longer). Not thread-safe (the Client's lock serialises the call itself)."""

    def __init__(self, client: "Client", seq_ids: IntArray, salts: Optional[Salts] = None,
                 max_indices: Optional[int] = None) -> None:
        self._client = client
        lib = client._lib
        self._seq = _u64_array(seq_ids, "seq_ids")
        n = self._seq.size
        if n == 0:
            raise ValueError("step_reserve needs at least one sequence")
        info = client._info
        cap = max_indices if max_indices is not None else min(n * info.num_pages, _INDICES_CAP)
        self._tok = np.zeros(n, np.uint32)
        self._arrs, self._t = _table_arrays(n, cap)
        self._opts = _lib.kvp_cache_opts_t()
        self._opts.priority = -1
        sdata, slens = _salts(salts, n)
        self._salts = (sdata, slens)  # alive while this object is
        self._ids = np.zeros(max(4 * n, 16), np.int32)
        self._ids_ptr = _ptr(self._ids, ctypes.c_int32)
        self._plain = (lib.kvp_client_reserve, _ptr(self._seq, ctypes.c_uint64),
                       _ptr(self._tok, ctypes.c_uint32), n)
        self._keyed = (lib.kvp_client_reserve_cached, _ptr(self._seq, ctypes.c_uint64),
                       _ptr(self._tok, ctypes.c_uint32), n, ctypes.byref(self._opts))
        self._salted = slens is not None
        if self._salted:
            self._salt_ptrs = (_ptr(sdata, ctypes.c_uint8), _ptr(slens, ctypes.c_uint32))

    def run(self, num_tokens: IntArray, token_ids: Optional[IntArray] = None) -> "PageTable":
        """The step's Reserve: num_tokens per sequence (an int for all), token_ids the ids of
        the tokens appended (sum(num_tokens) integers in batch order; None: the pages are not
        keyed, as reserve() without token ids)."""
        tok = self._tok
        tok[:] = num_tokens
        if token_ids is None:
            fn, *args = self._plain
        else:
            ids = np.asarray(token_ids).reshape(-1)
            total = int(tok.sum(dtype=np.uint64))
            if ids.size != total:
                raise ValueError("%d token ids for %d tokens appended" % (ids.size, total))
            if ids.size and not np.issubdtype(ids.dtype, np.integer):
                raise TypeError("token_ids must be integers, not %s" % ids.dtype)
            if ids.size and (ids.min() < -2**31 or ids.max() >= 2**31):
                raise ValueError("token_ids do not fit in int32")
            if ids.size > self._ids.size:
                self._ids = np.zeros(2 * ids.size, np.int32)
                self._ids_ptr = _ptr(self._ids, ctypes.c_int32)
            self._ids[: ids.size] = ids
            o = self._opts
            o.token_ids = self._ids_ptr
            if self._salted:
                o.salts, o.salt_lens = self._salt_ptrs
            fn, *args = self._keyed
        t = self._t
        self._client._call(fn, *args, ctypes.byref(t))
        a, B = self._arrs, t.batch_size
        return PageTable(kv_indptr=a["kv_indptr"][: B + 1], kv_indices=a["kv_indices"][:t.num_indices],
                         kv_last_page_len=a["kv_last_page_len"][:B],
                         append_indptr=a["append_indptr"][: B + 1], seq_lens=a["seq_lens"][:B],
                         copies=a["copies"][: t.num_copies], cached_tokens=a["cached_tokens"][:B])


class Client:
    """A connection to kvpoold (libkvpool handle).

    socket: the socket path (None: $KVPOOL_SOCKET or the default path, kvp_client_default_socket).
    namespace: None or "" -> "default". lease_ms: None leaves the lease to the daemon
    (KVP_LEASE_DEFAULT: a new namespace takes limits.default_lease_ms, an existing one keeps its
    lease); 0 releases the namespace's sequences when its last session goes. timeout_ms: per
    call, 0 -> 10000. map_pool: ask for the pool fds and map the pool (needed for the views).
    observer: attach to no namespace (read-only calls: stats, list calls, ping); namespace and
    lease_ms must be None, and the pool is not mapped. cache_scope: the prefix cache's scope of
    the namespace (None or "": its own private scope; a shared name: namespaces naming it find
    each other's pages, as the daemon's [access] section allows).

    A handle is not thread-safe in C; this class serialises its calls with a lock. Views and
    staging arrays point into mappings the handle owns: they keep the Client object alive, but
    close() unmaps them, after which they must not be touched.
    """

    def __init__(self, socket: Optional[Union[str, "os.PathLike[str]"]] = None,
                 namespace: Optional[str] = None, lease_ms: Optional[int] = None, *,
                 client_name: Optional[str] = None, timeout_ms: int = 0, map_pool: bool = True,
                 observer: bool = False, cache_scope: Optional[str] = None) -> None:
        self._lib = _lib.load()
        self._h = None
        self._lock = threading.Lock()
        self._staging: Dict[int, Any] = {}  # buffer id -> its array or tensor
        opts = _lib.kvp_client_opts_t()
        enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
        opts.socket_path = enc(socket)
        opts.ns = enc(namespace)
        opts.client_name = enc(client_name)
        opts.lease_ms = _lib.KVP_LEASE_DEFAULT if lease_ms is None else int(lease_ms)
        opts.timeout_ms = int(timeout_ms)
        opts.map_pool = 1 if map_pool and not observer else 0
        opts.observer = 1 if observer else 0
        opts.cache_scope = enc(cache_scope)
        h = ctypes.c_void_p()
        err = ctypes.create_string_buffer(512)
        rc = self._lib.kvp_client_connect(ctypes.byref(opts), ctypes.byref(h), err, len(err))
        if rc != 0:
            raise error(rc, err.value.decode(errors="replace"))
        self._h = h
        self.socket = socket
        self.namespace = namespace or "default"
        self._info = PoolInfo._from_c(self._lib.kvp_client_pool_info(h).contents)
        self._pool_arrays: Dict[int, np.ndarray] = {}
        # buffer id -> group device, for CUDA staging buffers
        self._cuda_buffers: Dict[int, int] = {}

    # ---- handle --------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the connection, unmaps the pool and the staging buffers. Idempotent."""
        with self._lock:
            if self._h is not None:
                self._lib.kvp_client_close(self._h)
                self._h = None
                self._pool_arrays.clear()
                self._staging.clear()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    @property
    def closed(self) -> bool:
        return self._h is None

    def _handle(self):
        if self._h is None:
            raise error(KVP_EPRECOND, "the client is closed")
        return self._h

    def _call(self, fn, *args):
        """Runs a kvp_client_* call under the lock; raises the code's exception on failure."""
        with self._lock:
            h = self._handle()
            rc = fn(h, *args)
            if rc != 0:
                msg = self._lib.kvp_client_last_error(h)
                raise error(rc, msg.decode(errors="replace") if msg else "")

    @property
    def pool_info(self) -> PoolInfo:
        return self._info

    @property
    def session_id(self) -> int:
        return int(self._lib.kvp_client_session_id(self._handle()))

    @property
    def server_version(self) -> str:
        return self._lib.kvp_client_server_version(self._handle()).decode()

    def ping(self) -> int:
        """Round trip; returns the round-trip time in ns."""
        rtt = ctypes.c_uint64()
        self._call(self._lib.kvp_client_ping, ctypes.byref(rtt))
        return int(rtt.value)

    def audit(self) -> None:
        """Runs the daemon's audit; raises AuditFailed (KVP_EAUDIT) with the violation."""
        self._call(self._lib.kvp_client_audit)

    def stats(self) -> Stats:
        s = _lib.kvp_stats_summary_t()
        self._call(self._lib.kvp_client_stats, ctypes.byref(s))
        return Stats(**{f.name: getattr(s, f.name) for f in dataclasses.fields(Stats)})

    # ---- pool views ----------------------------------------------------------------------

    def _cuda(self):
        """The PyTorch side (kvpool._torch), for a cuda pool."""
        try:
            from . import _torch
        except ImportError as e:
            raise ImportError("a cuda-backend pool is shown as PyTorch tensors: install torch "
                              "(%s)" % e) from e
        return _torch

    def _pool(self, device=0):
        info = self._info
        if info.backend == 1:
            return self._cuda().pool_tensor(self, int(device))
        if device in self._pool_arrays:
            return self._pool_arrays[device]
        with self._lock:
            base = self._lib.kvp_client_pool_base(self._handle(), int(device))
        if not base:
            raise error(KVP_EPRECOND, "the pool of device %d is not mapped (connect with "
                        "map_pool=True)" % device)
        arr = np.asarray(_Memory(base, info.pool_bytes, self))
        self._pool_arrays[device] = arr
        return arr

    def pool_bytes_view(self, device: int = 0) -> Array:
        """The whole mapped pool of a device as a writable uint8 array (no copy); on the cuda
        backend a uint8 CUDA tensor."""
        p = self._pool(device)
        if self._info.backend == 1:
            import torch

            return p.view(torch.uint8)
        return p

    def _kv_view(self, layer, kv, device):
        info = self._info
        if not 0 <= layer < info.num_layers:
            raise IndexError("layer %d out of range (the pool has %d)" % (layer, info.num_layers))
        if info.backend == 1:
            return self._cuda().kv_view(self, layer, kv, int(device))
        pool = self._pool(device)
        dt = info.numpy_dtype
        e = dt.itemsize
        H = info.heads_per_device
        off = layer * info.layer_bytes + (info.v_offset_bytes if kv else 0)
        if info.layout == 0:  # NHD: [P, page_size, H, D]
            shape = (info.num_pages, info.page_size, H, info.head_dim)
            strides = (info.stride_page * e, info.stride_n * e, info.stride_h * e, e)
        else:  # HND: [P, H, page_size, D]
            shape = (info.num_pages, H, info.page_size, info.head_dim)
            strides = (info.stride_page * e, info.stride_h * e, info.stride_n * e, e)
        return np.ndarray(shape, dtype=dt, buffer=pool, offset=off, strides=strides)

    def k_view(self, layer: int, device: int = 0) -> Array:
        """Layer `layer`'s K cache as a writable NumPy array over the mapped pool (no copy):
        [num_pages, page_size, H, D] (NHD) or [num_pages, H, page_size, D] (HND), dtype
        float16/float32, or uint16 (bf16) / uint8 (fp8) raw. With combined storage the page
        stride is 2 * page elements (K and V of a page side by side). On the cuda backend: a
        CUDA tensor of the pool's dtype (bf16 and fp8 too) on device_ids[device], aliasing the
        daemon's pool (kvp_client_cuda_map_pool on first use)."""
        return self._kv_view(layer, 0, device)

    def v_view(self, layer: int, device: int = 0) -> Array:
        """Layer `layer`'s V cache; see k_view."""
        return self._kv_view(layer, 1, device)

    def paged_kv_cache(self, layer: int,
                       device: int = 0) -> Union[Array, Tuple[Array, Array]]:
        """Layer `layer` as FlashInfer's paged_kv_cache argument: combined storage -> one array
        [num_pages, 2, ...] ([:, 0] K, [:, 1] V); split storage -> the tuple (k, v)."""
        if self._info.backend == 1:
            if not 0 <= layer < self._info.num_layers:
                raise IndexError("layer %d out of range (the pool has %d)"
                                 % (layer, self._info.num_layers))
            return self._cuda().paged_kv_cache(self, layer, int(device))
        k = self.k_view(layer, device)
        if self._info.storage == 1:
            return k, self.v_view(layer, device)
        vstride = self._info.v_offset_bytes
        return np.lib.stride_tricks.as_strided(
            k, shape=(k.shape[0], 2) + k.shape[1:],
            strides=(k.strides[0], vstride) + k.strides[1:], writeable=True)

    def apply_copies(self, table: PageTable, device: int = 0, stream: Stream = None) -> None:
        """Runs a Reserve answer's copy-on-write copies on the mapped pool (K and V, every
        layer), as the Reserve caller must before its own appends. cuda backend: queued on
        `stream` (default: the current torch stream of the device)."""
        if self._info.backend == 1:
            return self._cuda().copy_pages(self, table, int(device), stream)
        c = np.asarray(table.copies)
        if c.size == 0:
            return
        src, dst = c[:, 0].astype(np.int64), c[:, 1].astype(np.int64)
        for layer in range(self._info.num_layers):
            for kv in (0, 1):
                v = self._kv_view(layer, kv, device)
                v[dst] = v[src]

    # ---- staging buffers -----------------------------------------------------------------

    def alloc_staging(self, nbytes: int, device: int = 0) -> Tuple[Array, int]:
        """Creates and registers a staging buffer of nbytes; returns (a writable uint8 array
        over it, its buffer id). Host backend: a sealed memfd, as a NumPy array. cuda backend:
        GPU memory of device_ids[device] (CUDA VMM, shared with the daemon by fd, with
        interprocess events), as a uint8 CUDA tensor; append() then orders the daemon's copy
        after the work queued on the current stream. Freed by unregister_buffer / close."""
        if self._info.backend == 1:
            t, bid = self._cuda().alloc_staging(self, nbytes, int(device))
            self._staging[bid] = t
            self._cuda_buffers[bid] = int(device)
            return t, bid
        ptr = ctypes.c_void_p()
        bid = ctypes.c_uint32()
        self._call(self._lib.kvp_client_alloc_host_buffer, int(nbytes), ctypes.byref(ptr),
                   ctypes.byref(bid))
        arr = np.asarray(_Memory(ptr.value, nbytes, self))
        self._staging[bid.value] = arr
        return arr, int(bid.value)

    def register_tensor(self, tensor: Any, device: int = 0) -> int:
        """cuda backend: registers a contiguous CUDA tensor (PyTorch's cudaMalloc'd memory;
        not expandable segments) as a staging buffer through a legacy IPC handle, with
        events; source offsets are then relative to tensor.data_ptr(). The tensor must
        outlive the registration (unregister_buffer). Returns the buffer id."""
        if self._info.backend != 1:
            raise error(KVP_EPRECOND, "register_tensor needs the cuda backend")
        bid = self._cuda().register_tensor(self, tensor)
        self._staging[bid] = tensor
        self._cuda_buffers[bid] = int(device)
        return bid

    def register_fd(self, fd: int, size_bytes: int, kind: int = 0) -> int:
        """Registers a buffer given as an fd (kind 0: memfd sealed against shrinking); the fd
        stays the caller's. Returns the buffer id."""
        bid = ctypes.c_uint32()
        self._call(self._lib.kvp_client_register_fd, int(fd), int(kind), int(size_bytes),
                   ctypes.byref(bid))
        return int(bid.value)

    def unregister_buffer(self, buffer_id: int) -> None:
        """Unregisters a buffer (and unmaps it if alloc_staging made it: its array must not be
        used afterwards)."""
        bid = int(buffer_id)
        if bid in self._cuda_buffers:
            self._call(self._lib.kvp_client_cuda_free_buffer, bid)
            del self._cuda_buffers[bid]
        else:
            self._call(self._lib.kvp_client_unregister_buffer, bid)
        self._staging.pop(bid, None)

    # ---- sequences -----------------------------------------------------------------------

    def _table_call(self, fn, seq, extra, n_indices=None):
        n = seq.size
        info = self._info
        cap_idx = n_indices if n_indices is not None else min(n * info.num_pages, _INDICES_CAP)
        arrs, t = _table_arrays(n, cap_idx)
        self._call(fn, _ptr(seq, ctypes.c_uint64), *extra, ctypes.byref(t))
        B = t.batch_size
        out = PageTable(
            kv_indptr=arrs["kv_indptr"][: B + 1].copy(),
            kv_indices=arrs["kv_indices"][: t.num_indices].copy(),
            kv_last_page_len=arrs["kv_last_page_len"][:B].copy(),
            append_indptr=arrs["append_indptr"][: B + 1].copy(),
            seq_lens=arrs["seq_lens"][:B].copy(),
            copies=arrs["copies"][: t.num_copies].copy(),
            cached_tokens=arrs["cached_tokens"][:B].copy(),
        )
        if B == 0:  # the daemon may leave an empty batch's arrays out: kv_indptr = [0]
            out = out._replace(kv_indptr=np.zeros(1, np.int32), append_indptr=np.zeros(1, np.int32))
        return out

    @staticmethod
    def _cache_opts(tok, token_ids, salts, reuse, leave_last, priority, retention_ms,
                    skip_tokens=0):
        """A kvp_cache_opts_t and the arrays it points at (kept alive by the caller), or
        (None, None) when no prefix-cache argument is given."""
        if (token_ids is None and salts is None and not reuse and not leave_last
                and priority is None and not retention_ms and not skip_tokens):
            return None, None
        n = tok.size
        o = _lib.kvp_cache_opts_t()
        keep = []
        if token_ids is not None:
            if (isinstance(token_ids, (list, tuple)) and len(token_ids) == n and n
                    and all(np.ndim(x) == 1 for x in token_ids)):
                ids, lens = _prompts(token_ids)  # one sequence of ids per row
                if not np.array_equal(lens, tok):
                    raise ValueError("token_ids rows have %s tokens, num_tokens %s"
                                     % (lens.tolist(), tok.tolist()))
            else:
                ids = _token_array(token_ids, "token_ids")
            if ids.size != int(tok.sum(dtype=np.uint64)):
                raise ValueError("%d token ids for %d tokens appended"
                                 % (ids.size, int(tok.sum(dtype=np.uint64))))
            keep.append(ids)
            o.token_ids = _ptr(ids, ctypes.c_int32)
        sdata, slens = _salts(salts, n)
        if slens is not None:
            keep += [sdata, slens]
            o.salts = _ptr(sdata, ctypes.c_uint8)
            o.salt_lens = _ptr(slens, ctypes.c_uint32)
        o.reuse = 1 if reuse else 0
        o.leave_last = 1 if leave_last else 0
        if priority is not None and not 0 <= int(priority) <= 100:
            raise ValueError("priority must be 0..100 or None, not %r" % (priority,))
        o.priority = -1 if priority is None else int(priority)
        o.retention_ms = int(retention_ms)
        o.skip_tokens = int(skip_tokens)
        return o, keep

    def append(self, seq_ids: IntArray, num_tokens: IntArray,
               source: Union[Mapping[str, int], "_lib.kvp_source_t"], stream: Stream = None, *,
               token_ids: Optional[TokenIds] = None, salts: Optional[Salts] = None,
               reuse: bool = False, leave_last: bool = False, priority: Optional[int] = None,
               retention_ms: int = 0, skip_tokens: int = 0) -> PageTable:
        """Daemon-run append: grows each sequence by num_tokens[i] tokens (an int applies to
        all), the daemon copies K/V from a registered buffer and answers once the data is in
        the pool. source: dict with buffer_id, k_offset, v_offset (bytes) and optionally
        k_stride_n, k_stride_h, v_stride_n, v_stride_h (default: contiguous [nnz, H, D] rows of
        this pool's dtype), layer_stride (default 0), layer_begin, layer_end (0 = all layers).
        Token t (batch order), head h, layer l reads K at k_offset + (l - layer_begin) *
        layer_stride + t * k_stride_n + h * k_stride_h. Returns the batch's PageTable.
        A buffer of alloc_staging / register_tensor on the cuda backend goes through
        kvp_client_cuda_append_async: the daemon waits (on an interprocess event) for the work
        queued on `stream` (default: the device's current torch stream) before it copies.
        The prefix cache (keywords as in reserve()): pages filled over every layer are findable
        once this returns. With reuse (one sequence), skip_tokens: the source holds the rows of
        tokens [skip_tokens, num_tokens) only, since a lookup() said the first skip_tokens are
        cached; fewer cached by then raises (FAILED_PRECONDITION) and changes nothing."""
        seq = _u64_array(seq_ids, "seq_ids")
        tok = _num_tokens(num_tokens, seq.size)
        src = self._source(source)
        opts, _keep = self._cache_opts(tok, token_ids, salts, reuse, leave_last, priority,
                                       retention_ms, skip_tokens)
        g = self._cuda_buffers.get(int(src.buffer_id))
        if g is not None:
            cuda = self._cuda()
            ordinal = self._info.device_ids[g]
            s = ctypes.c_void_p(cuda.stream_of(ordinal, stream))
            o = ctypes.byref(opts) if opts is not None else None

            def fn(h, seq_p, tok_p, n, src_p, table_p):
                with cuda.torch.cuda.device(ordinal):
                    return self._lib.kvp_client_cuda_append_async_cached(
                        h, seq_p, tok_p, n, src_p, o, table_p, s)
            return self._table_call(fn, seq,
                                    (_ptr(tok, ctypes.c_uint32), seq.size, ctypes.byref(src)))
        if opts is not None:
            return self._table_call(self._lib.kvp_client_append_cached, seq,
                                    (_ptr(tok, ctypes.c_uint32), seq.size, ctypes.byref(src),
                                     ctypes.byref(opts)))
        return self._table_call(self._lib.kvp_client_append, seq,
                                (_ptr(tok, ctypes.c_uint32), seq.size, ctypes.byref(src)))

    def reserve(self, seq_ids: IntArray, num_tokens: IntArray,
                token_ids: Optional[TokenIds] = None, salts: Optional[Salts] = None,
                reuse: bool = False, leave_last: bool = False, priority: Optional[int] = None,
                retention_ms: int = 0) -> PageTable:
        """Reserve: the allocation and page table of an append, without the copy. Run
        apply_copies(table) and then append_paged_kv_cache on the views yourself.

        The prefix cache: token_ids, the ids of the tokens appended (sum(num_tokens) ints in
        batch order, or one sequence per row), key the full pages; salts (one bytes for all
        rows, or one per row, None/b"" for none) separate what must never share KV. reuse:
        start each new (empty) row with its longest cached full-page prefix: the table's
        cached_tokens says how many tokens each row found, append_indptr counts only the rest
        (append those, then commit()). leave_last: with reuse, leave at least one token to
        compute. priority: retention priority 0..100 of the pages once released (None: the
        daemon's default, 35); retention_ms: how long it holds (0: while cached). Keyed pages
        become findable only after commit()."""
        seq = _u64_array(seq_ids, "seq_ids")
        tok = _num_tokens(num_tokens, seq.size)
        opts, _keep = self._cache_opts(tok, token_ids, salts, reuse, leave_last, priority,
                                       retention_ms)
        if opts is not None:
            return self._table_call(self._lib.kvp_client_reserve_cached, seq,
                                    (_ptr(tok, ctypes.c_uint32), seq.size, ctypes.byref(opts)))
        return self._table_call(self._lib.kvp_client_reserve, seq,
                                (_ptr(tok, ctypes.c_uint32), seq.size))

    def step_reserve(self, seq_ids: IntArray, salts: Optional[Salts] = None,
                     max_indices: Optional[int] = None) -> "StepReserve":
        """A Reserve prepared for the repeated steps of one batch of sequences (a model's
        forward steps): see StepReserve. salts: as reserve()'s, sent with the token ids of
        every step that has them. max_indices: the page-table capacity (default: what
        reserve() uses)."""
        return StepReserve(self, seq_ids, salts, max_indices)

    # ---- the prefix cache ------------------------------------------------------------------

    def commit(self, seq_ids: IntArray, stream: Stream = None) -> Commit:
        """Makes the keyed pages of the sequences findable (after a reserve() whose tokens you
        appended yourself, every layer). Host backend (stream None): the writes are taken as
        complete. cuda backend, or a stream given (a torch.cuda.Stream or a raw cudaStream_t;
        None: the current torch stream of the pool's first device): an interprocess event is
        recorded on the stream after your appends, and the daemon publishes the pages once it
        completes; this returns at once, without waiting for the GPU."""
        seq = _u64_array(seq_ids, "seq_ids")
        pages, published = ctypes.c_uint32(), ctypes.c_uint32()
        if stream is not None or self._info.backend == 1:
            cuda = self._cuda()
            dev = getattr(stream, "device", None)
            ordinal = dev.index if dev is not None and dev.index is not None \
                else self._info.device_ids[0]
            s = ctypes.c_void_p(cuda.stream_of(ordinal, stream))

            def fn(h, *args):
                with cuda.torch.cuda.device(ordinal):
                    return self._lib.kvp_client_cuda_commit_ex(h, *args)
            self._call(fn, _ptr(seq, ctypes.c_uint64), seq.size, s, ctypes.byref(pages),
                       ctypes.byref(published))
        else:
            self._call(self._lib.kvp_client_commit, _ptr(seq, ctypes.c_uint64), seq.size, None,
                       ctypes.byref(pages), ctypes.byref(published))
        return Commit(int(pages.value), int(published.value))

    def lookup(self, prompts: Iterable[Union[Sequence[int], np.ndarray]],
               salts: Optional[Salts] = None) -> List[int]:
        """How many leading tokens of each prompt (a list of sequences of token ids) are
        cached in this namespace's scope, with no side effect; salts as in reserve(). Returns
        a list of ints (whole pages: multiples of the page size)."""
        prompts = list(prompts)
        ids, lens = _prompts(prompts)
        sdata, slens = _salts(salts, len(prompts))
        out = np.zeros(max(len(prompts), 1), np.uint32)
        self._call(self._lib.kvp_client_lookup, _ptr(ids, ctypes.c_int32),
                   _ptr(lens, ctypes.c_uint32), len(prompts),
                   None if sdata is None else _ptr(sdata, ctypes.c_uint8),
                   None if slens is None else _ptr(slens, ctypes.c_uint32),
                   _ptr(out, ctypes.c_uint32))
        return [int(x) for x in out[: len(prompts)]]

    def pin(self, token_ids: Union[Sequence[int], np.ndarray], salt: Optional[bytes] = b"",
            ttl_ms: int = 0) -> Pin:
        """Keeps the cached prefix of the prompt token_ids (with salt) resident for ttl_ms (0:
        the daemon's limits.pin_max_ttl_ms), counted against the namespace's pinned-page
        quota (ResourceExhausted over it; NotFound when nothing of it is cached)."""
        ids = _token_array(token_ids, "token_ids")
        salt = bytes(salt or b"")
        out = _lib.kvp_pin_t()
        self._call(self._lib.kvp_client_pin, _ptr(ids, ctypes.c_int32), ids.size,
                   salt if salt else None, len(salt), int(ttl_ms), ctypes.byref(out))
        return Pin(int(out.pin_id), int(out.pinned_tokens), int(out.pinned_pages),
                   int(out.expires_in_ms))

    def unpin(self, pin_id: Union[int, Pin]) -> int:
        """Drops a pin of this namespace; returns the pages it held."""
        pages = ctypes.c_uint32()
        self._call(self._lib.kvp_client_unpin,
                   int(getattr(pin_id, "pin_id", pin_id)),  # type: ignore[arg-type]
                   ctypes.byref(pages))
        return int(pages.value)

    def cache_flush(self, scope: Optional[str] = None, all: bool = False) -> int:
        """Drops every cached page nobody holds in this namespace's scope (an operator may name
        another scope, or all=True for every scope); pinned and held pages stay. Returns the
        pages dropped."""
        pages = ctypes.c_uint32()
        self._call(self._lib.kvp_client_cache_flush, None if scope is None else scope.encode(),
                   1 if all else 0, ctypes.byref(pages))
        return int(pages.value)

    def cache_stats(self) -> CacheStats:
        """The prefix cache's counters (Stats.cache)."""
        st = _lib.kvp_cache_stats_t()
        self._call(self._lib.kvp_client_cache_stats, ctypes.byref(st))
        return CacheStats(**{f.name: int(getattr(st, f.name))
                             for f in dataclasses.fields(CacheStats)})

    def page_table(self, seq_ids: IntArray) -> PageTable:
        """The current page table of the sequences (append_indptr all zeros: nothing appended)."""
        seq = _u64_array(seq_ids, "seq_ids")
        try:
            return self._table_call(self._lib.kvp_client_page_table, seq, (seq.size,))
        except Exception as e:
            from .errors import LimitExceeded

            exact = seq.size * self._info.num_pages
            if isinstance(e, LimitExceeded) and exact > _INDICES_CAP:
                return self._table_call(self._lib.kvp_client_page_table, seq, (seq.size,),
                                        n_indices=exact)
            raise

    def fork(self, parent: int, child: int) -> None:
        """Creates `child` sharing all of `parent`'s pages (copy-on-write)."""
        self._call(self._lib.kvp_client_fork, int(parent), int(child))

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Shortens a sequence to num_tokens tokens."""
        self._call(self._lib.kvp_client_truncate, int(seq_id), int(num_tokens))

    def release(self, seq_ids: IntArray) -> int:
        """Releases sequences; returns how many of them existed."""
        seq = _u64_array(seq_ids, "seq_ids")
        released = ctypes.c_uint32()
        self._call(self._lib.kvp_client_release, _ptr(seq, ctypes.c_uint64), seq.size,
                   ctypes.byref(released))
        return int(released.value)

    # ---- transfers between daemons (ExportBegin / Import, over NCCL) -----------------------

    def export_begin(self, seq_ids: IntArray, peer: str, timeout_ms: int = 0) -> Ticket:
        """Starts sending seq_ids (one id, or a set: a list of up to 64 distinct ids, moved as
        one stream) to the daemon named `peer`; returns the ticket at once. The outcome is in
        list_transfers(). Needs the cuda backend and NCCL on both daemons."""
        if not isinstance(peer, str):
            raise TypeError("peer must be a str")
        t = _lib.kvp_transfer_ticket_t()
        if np.ndim(seq_ids) == 0:
            self._call(self._lib.kvp_client_export_begin, int(seq_ids),  # type: ignore[arg-type]
                       peer.encode(),
                       int(timeout_ms), ctypes.byref(t))
        else:
            seq = _u64_array(seq_ids, "seq_ids")
            self._call(self._lib.kvp_client_export_begin_set, _ptr(seq, ctypes.c_uint64),
                       seq.size, peer.encode(), int(timeout_ms), ctypes.byref(t))
        return Ticket._from_c(t)

    def import_transfer(self, ticket: Union[Ticket, bytes, bytearray, memoryview],
                        seq_ids: IntArray, timeout_ms: int = 0) -> int:
        """Receives the ticket's sequences as the new seq_ids of this namespace (one id, or a
        list in the exporter's order, one per ticket sequence), all or none; returns once the
        data is in the pool, with the number of pages they took."""
        if isinstance(ticket, (bytes, bytearray, memoryview)):
            ticket = Ticket.from_bytes(ticket)
        t = ticket._to_c()
        pages = ctypes.c_uint32()
        if np.ndim(seq_ids) == 0 and ticket.num_seqs == 1:
            self._call(self._lib.kvp_client_import, ctypes.byref(t),
                       int(seq_ids),  # type: ignore[arg-type]
                       int(timeout_ms), ctypes.byref(pages))
        else:
            seq = _u64_array(seq_ids, "seq_ids")
            if seq.size != ticket.num_seqs:
                raise ValueError("%d seq_ids for a ticket of %d sequences" %
                                 (seq.size, ticket.num_seqs))
            self._call(self._lib.kvp_client_import_set, ctypes.byref(t),
                       _ptr(seq, ctypes.c_uint64), int(timeout_ms), ctypes.byref(pages))
        return int(pages.value)

    def list_transfers(self) -> List[TransferInfo]:
        """Transfers in flight, then the newest finished ones (at most 32)."""
        out = (_lib.kvp_transfer_info_t * 32)()
        n = ctypes.c_uint32()
        self._call(self._lib.kvp_client_list_transfers, out, 32, ctypes.byref(n))
        dec = lambda b: b.decode(errors="replace")  # noqa: E731
        return [TransferInfo(int(i.transfer_id), dec(i.direction), dec(i.state), dec(i.peer),
                             dec(i.ns), int(i.seq_id), int(i.num_seqs), int(i.num_tokens),
                             int(i.bytes), int(i.elapsed_ms), dec(i.message))
                for i in out[:n.value]]

    def _source(self, source):
        if isinstance(source, _lib.kvp_source_t):
            return source
        s = dict(source)
        info = self._info
        row = info.head_dim * info.elem_bytes
        defaults = dict(k_stride_h=row, k_stride_n=row * info.heads_per_device,
                        v_stride_h=row, v_stride_n=row * info.heads_per_device,
                        layer_stride=0, layer_begin=0, layer_end=0)
        for k in ("buffer_id", "k_offset", "v_offset"):
            if k not in s:
                raise ValueError("source needs %r" % k)
        unknown = set(s) - set(defaults) - {"buffer_id", "k_offset", "v_offset"}
        if unknown:
            raise ValueError("unknown source fields: %s" % sorted(unknown))
        src = _lib.kvp_source_t()
        for k, v in {**defaults, **s}.items():
            setattr(src, k, int(v))
        return src


def default_socket() -> Optional[str]:
    """kvp_client_default_socket: $KVPOOL_SOCKET, else the per-user default path."""
    buf = ctypes.create_string_buffer(4096)
    r = _lib.load().kvp_client_default_socket(buf, len(buf))
    return os.fsdecode(r) if r else None
