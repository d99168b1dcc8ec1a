# SPDX-License-Identifier: Apache-2.0
"""Client: one libkvpool handle (one connection, one session of one namespace), its calls, and
the pool object of its backend (kvpool._host / kvpool._cuda_pool) that shows the pool and the
staging buffers. The records it answers with are in kvpool.records (re-exported here), the
argument conversions in kvpool._args, the prepared per-step Reserve in kvpool.step."""
import ctypes
import dataclasses
import os
import threading
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _lib
from ._args import (_INDICES_CAP, _num_tokens, _prompts, _ptr, _salts,  # noqa: F401
                    _table_arrays, _token_array, _u64_array, cache_opts, table_answer)
from ._args import source as source_of
from ._host import HostPool
from ._types import Array, IntArray, Salts, Stream, TokenIds
from .codes import Backend, BufferKind
from .errors import KVP_EPRECOND, error
from .records import (CachedBlock, CacheSnapshot, CacheStats, Commit,  # noqa: F401
                      Load, PageTable, Pin, PoolInfo, Stats, TierHit, Ticket, TransferInfo)
from .step import StepReserve


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
        self._staging: Dict[int, Any] = {}  # buffer id -> its array or tensor (kept alive)
        self._pool_obj: Optional[Any] = None  # HostPool or CudaPool, made on first use
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

    # ---- handle --------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the connection, unmaps the pool and the staging buffers. Idempotent."""
        with self._lock:
            if self._h is not None:
                self._lib.kvp_client_close(self._h)
                self._h = None
                if self._pool_obj is not None:
                    self._pool_obj.close()
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

    def _pool(self):
        """This connection's pool object, of its backend's kind (kvpool._host.HostPool, or
        kvpool._cuda_pool.CudaPool: PyTorch is imported only then), made on first use."""
        if self._pool_obj is None:
            if self._info.backend == Backend.CUDA:
                try:
                    from ._cuda_pool import CudaPool
                except ImportError as e:
                    raise ImportError("a cuda-backend pool is shown as PyTorch tensors: install "
                                      "torch (%s)" % e) from e
                self._pool_obj = CudaPool(self)
            else:
                self._pool_obj = HostPool(self)
        return self._pool_obj

    def _check_layer(self, layer):
        if not 0 <= layer < self._info.num_layers:
            raise IndexError("layer %d out of range (the pool has %d)" % (layer,
                                                                          self._info.num_layers))

    def pool_bytes_view(self, device: int = 0) -> Array:
        """The whole mapped pool of a device as a writable uint8 array (no copy); on the cuda
        backend a uint8 CUDA tensor."""
        return self._pool().bytes_view(int(device))

    def k_view(self, layer: int, device: int = 0) -> Array:
        """Layer `layer`'s K cache as a writable NumPy array over the mapped pool (no copy):
        [num_pages, page_size, H, D] (NHD) or [num_pages, H, page_size, D] (HND), dtype
        float16/float32, or uint16 (bf16) / uint8 (fp8) raw. With combined storage the page
        stride is 2 * page elements (K and V of a page side by side). On the cuda backend: a
        CUDA tensor of the pool's dtype (bf16 and fp8 too) on device_ids[device], aliasing the
        daemon's pool (kvp_client_cuda_map_pool on first use)."""
        self._check_layer(layer)
        return self._pool().kv_view(layer, 0, int(device))

    def v_view(self, layer: int, device: int = 0) -> Array:
        """Layer `layer`'s V cache; see k_view."""
        self._check_layer(layer)
        return self._pool().kv_view(layer, 1, int(device))

    def paged_kv_cache(self, layer: int,
                       device: int = 0) -> Union[Array, Tuple[Array, Array]]:
        """Layer `layer` as FlashInfer's paged_kv_cache argument: combined storage -> one array
        [num_pages, 2, ...] ([:, 0] K, [:, 1] V); split storage -> the tuple (k, v)."""
        self._check_layer(layer)
        return self._pool().paged_kv_cache(layer, int(device))

    def apply_copies(self, table: PageTable, device: int = 0, stream: Stream = None) -> None:
        """Runs a Reserve answer's copy-on-write copies on the mapped pool (K and V, every
        layer), as the Reserve caller must before its own appends. cuda backend: queued on
        `stream` (default: the current torch stream of the device)."""
        self._pool().apply_copies(table, int(device), stream)

    # ---- staging buffers -----------------------------------------------------------------

    def alloc_staging(self, nbytes: int, device: int = 0) -> Tuple[Array, int]:
        """Creates and registers a staging buffer of nbytes; returns (a writable uint8 array
        over it, its buffer id). Host backend: a sealed memfd, as a NumPy array. cuda backend:
        GPU memory of device_ids[device] (CUDA VMM, shared with the daemon by fd, with
        interprocess events), as a uint8 CUDA tensor; append() then orders the daemon's copy
        after the work queued on the current stream. Freed by unregister_buffer / close."""
        arr, bid = self._pool().alloc_staging(int(nbytes), int(device))
        self._staging[bid] = arr
        return arr, bid

    def register_tensor(self, tensor: Any, device: int = 0) -> int:
        """cuda backend: registers a contiguous CUDA tensor (PyTorch's cudaMalloc'd memory;
        not expandable segments) as a staging buffer through a legacy IPC handle, with
        events; source offsets are then relative to tensor.data_ptr(). The tensor must
        outlive the registration (unregister_buffer). Returns the buffer id."""
        bid = self._pool().register_tensor(tensor, int(device))
        self._staging[bid] = tensor
        return bid

    def register_fd(self, fd: int, size_bytes: int, kind: int = BufferKind.MEMFD) -> int:
        """Registers a buffer given as an fd (kind BufferKind.MEMFD: a memfd sealed against
        shrinking; BufferKind.CUDA_VMM_FD); the fd stays the caller's. Returns the buffer
        id."""
        bid = ctypes.c_uint32()
        self._call(self._lib.kvp_client_register_fd, int(fd), int(kind), int(size_bytes),
                   ctypes.byref(bid))
        return int(bid.value)

    def unregister_buffer(self, buffer_id: int) -> None:
        """Unregisters a buffer (and unmaps it if alloc_staging made it: its array must not be
        used afterwards)."""
        bid = int(buffer_id)
        # a buffer the pool object made itself (CUDA staging) is freed by it; no pool object
        # yet: no such buffer either
        if self._pool_obj is None or not self._pool_obj.free_buffer(bid):
            self._call(self._lib.kvp_client_unregister_buffer, bid)
        self._staging.pop(bid, None)

    # ---- sequences -----------------------------------------------------------------------

    def _table_call(self, fn, seq, extra, n_indices=None):
        n = seq.size
        info = self._info
        cap_idx = n_indices if n_indices is not None else min(n * info.num_pages, _INDICES_CAP)
        arrs, t = _table_arrays(n, cap_idx)
        self._call(fn, _ptr(seq, ctypes.c_uint64), *extra, ctypes.byref(t))
        return table_answer(arrs, t)

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
        src = source_of(source, self._info)
        opts, _keep = cache_opts(tok, token_ids, salts, reuse, leave_last, priority,
                                       retention_ms, skip_tokens)
        # a staging buffer of the pool object (CUDA) has its own call: the daemon waits on an
        # event; no pool object made yet: no such buffer either
        fn = None if self._pool_obj is None else self._pool_obj.append_call(src.buffer_id, opts,
                                                                             stream)
        if fn is not None:
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
        opts, _keep = cache_opts(tok, token_ids, salts, reuse, leave_last, priority,
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
        self._pool().commit(_ptr(seq, ctypes.c_uint64), seq.size, stream, ctypes.byref(pages),
                            ctypes.byref(published))
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

    def lookup_tiers(self, prompts: Iterable[Union[Sequence[int], np.ndarray]],
                     salts: Optional[Salts] = None) -> List[TierHit]:
        """lookup() over both tiers of the cache (issue #28): for each prompt a TierHit of
        gpu_tokens (its leading tokens cached in the GPU pool: what lookup() answers) and
        host_tokens (the tokens after them found in host memory, 0 when the daemon has no host
        tier), both whole pages. No side effect; a reserve()/append() with reuse, or a load(),
        then restores the host ones to the GPU."""
        prompts = list(prompts)
        ids, lens = _prompts(prompts)
        sdata, slens = _salts(salts, len(prompts))
        gpu = np.zeros(max(len(prompts), 1), np.uint32)
        host = np.zeros(max(len(prompts), 1), np.uint32)
        self._call(self._lib.kvp_client_lookup_tiers, _ptr(ids, ctypes.c_int32),
                   _ptr(lens, ctypes.c_uint32), len(prompts),
                   None if sdata is None else _ptr(sdata, ctypes.c_uint8),
                   None if slens is None else _ptr(slens, ctypes.c_uint32),
                   _ptr(gpu, ctypes.c_uint32), _ptr(host, ctypes.c_uint32))
        return [TierHit(int(g), int(h))
                for g, h in zip(gpu[: len(prompts)], host[: len(prompts)])]

    def load(self, token_ids: Union[Sequence[int], np.ndarray],
             dest: Union[Mapping[str, int], "_lib.kvp_source_t"],
             salt: Optional[bytes] = None, max_tokens: int = 0) -> Load:
        """Load (issue #28): copies the cached full pages of the prompt token_ids' prefix
        (with salt; from the GPU pool or the host tier, which is restored to the GPU first) into
        a registered buffer of this connection that the daemon can write (alloc_staging's), laid
        out where an append() with dest as its source would read them: dest is taken exactly
        as append()'s source (a dict with buffer_id, k_offset, v_offset and optionally the
        strides, layer_stride, layer_begin, layer_end; default: contiguous [tokens, H, D] rows
        of the pool's dtype), so token t, head h, layer l of K lands at k_offset + (l -
        layer_begin) * layer_stride + t * k_stride_n + h * k_stride_h (V likewise).
        max_tokens > 0 caps the tokens copied (whole pages; 0: every cached one). Returns once
        the bytes are in the buffer, with a Load record. NotFound when no page of the prefix is
        cached (or no such buffer); InvalidArgument for a layout outside the buffer;
        FailedPrecondition for a buffer the daemon cannot write. On any error nothing is
        written."""
        ids = _token_array(token_ids, "token_ids")
        salt = bytes(salt or b"")
        d = source_of(dest, self._info)
        out = _lib.kvp_load_t()
        self._call(self._lib.kvp_client_load, _ptr(ids, ctypes.c_int32), ids.size,
                   salt if salt else None, len(salt), ctypes.byref(d), int(max_tokens),
                   ctypes.byref(out))
        return Load(int(out.loaded_tokens), int(out.host_tokens), bool(out.completed))

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

    def cache_dump(self, page_blocks: int = 0) -> CacheSnapshot:
        """Every findable block of the prefix cache (CacheDump, issue #29: every scope for an
        operator, this namespace's scope otherwise), read a page at a time (page_blocks blocks
        a call; 0: as many as fit), with the snapshot's next_seq (the first page's): a KV-event
        consumer loads the blocks, then applies event batches from next_seq on."""
        recs = ctypes.create_string_buffer(_lib.KVP_CACHE_DUMP_MAX_BYTES)
        names = ctypes.create_string_buffer(_lib.KVP_CACHE_DUMP_MAX_BYTES)
        d = _lib.kvp_cache_dump_t(records=ctypes.cast(recs, ctypes.c_void_p),
                                  records_cap=len(recs),
                                  names=ctypes.cast(names, ctypes.c_void_p),
                                  names_cap=len(names))
        blocks: List[CachedBlock] = []
        cursor, first = 0, None
        while True:
            self._call(self._lib.kvp_client_cache_dump, cursor, page_blocks, ctypes.byref(d))
            if first is None:
                first = (int(d.next_seq), bool(d.events), int(d.block_size))
            raw = recs.raw[:d.num_blocks * d.record_bytes]
            nm = names.raw[:d.names_len]
            bs = int(d.block_size)
            for i in range(d.num_blocks):
                r = raw[i * d.record_bytes:(i + 1) * d.record_bytes]
                off = int.from_bytes(r[32:36], "little")
                scope = nm[off:nm.index(b"\0", off)].decode()
                toks = np.frombuffer(r, dtype="<i4", count=bs, offset=40)
                blocks.append(CachedBlock(bytes(r[:16]), bytes(r[16:32]) if r[37] else None,
                                          scope, "CPU" if r[36] == 1 else "GPU",
                                          tuple(int(t) for t in toks)))
            cursor = int(d.next_cursor)
            if cursor == 0:
                break
        return CacheSnapshot(first[0], first[1], first[2], blocks)

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


def default_socket() -> Optional[str]:
    """kvp_client_default_socket: $KVPOOL_SOCKET, else the per-user default path."""
    buf = ctypes.create_string_buffer(4096)
    r = _lib.load().kvp_client_default_socket(buf, len(buf))
    return os.fsdecode(r) if r else None