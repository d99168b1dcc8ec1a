# SPDX-License-Identifier: Apache-2.0
"""The cuda backend's pool object, on PyTorch: the mapped pool as device tensors (no copy),
staging buffers the daemon reads (CUDA VMM, or a registered tensor through legacy IPC), the
copy-on-write copies and the Commit event queued on a stream. The same interface as
kvpool._host.HostPool (see there); Client makes it on first use of the pool, so `import kvpool`
and a Client that only talks to the daemon never import torch.

Pool tensors come from `__cuda_array_interface__` over the pointer libkvpool mapped
(kvp_client_cuda_map_pool); the interface object keeps the Client alive, so a view never
outlives the mapping while the Client is open (close() unmaps: views must not be used after).
bf16 and fp8 pools are built as integer tensors of the element size and reinterpreted with
Tensor.view(dtype): the array interface has no type strings for them.
"""
import ctypes

import numpy as np
import torch

from . import _lib
from ._torch import stream_of
from .codes import Layout, Storage, torch_dtype
from .errors import KVP_EINVAL, KVP_EPRECOND, error


class _CudaMemory:
    """A device range as __cuda_array_interface__ (uint8), keeping `owner` alive."""

    def __init__(self, ptr, nbytes, owner):
        self.__cuda_array_interface__ = {
            "shape": (int(nbytes),), "typestr": "|u1", "data": (int(ptr), False),
            "strides": None, "version": 3}
        self._owner = owner


def device_bytes(ptr, nbytes, ordinal, owner):
    """A uint8 CUDA tensor over [ptr, ptr + nbytes) on device `ordinal`, without a copy."""
    return torch.as_tensor(_CudaMemory(ptr, nbytes, owner), device=torch.device("cuda", ordinal))


def _table_struct(table):
    """A kvp_page_table_t over a PageTable's NumPy arrays (host memory, read by libkvpool), and
    the arrays it points at (alive while the struct is used)."""
    t = _lib.kvp_page_table_t()
    keep = {}
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "append_indptr", "seq_lens"):
        a = np.ascontiguousarray(getattr(table, name), dtype=np.int32)
        keep[name] = a
        setattr(t, name, a.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)))
    c = np.ascontiguousarray(table.copies, dtype=np.uint32).reshape(-1, 2)
    keep["copies"] = c
    t.copies = c.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32))
    t.batch_size = t.cap_batch = keep["kv_last_page_len"].size
    t.num_indices = t.cap_indices = keep["kv_indices"].size
    t.num_copies = t.cap_copies = c.shape[0]
    t.nnz = int(keep["append_indptr"][-1]) if keep["append_indptr"].size else 0
    return t, keep


def commit_on_stream(client, seq_ptr, n, stream, pages, published):
    """kvp_client_cuda_commit_ex: an interprocess event recorded on `stream` (None: the current
    torch stream of the pool's first device) after the caller's appends; the daemon publishes
    the pages once it completes."""
    dev = getattr(stream, "device", None)
    ordinal = dev.index if dev is not None and dev.index is not None \
        else client.pool_info.device_ids[0]
    s = ctypes.c_void_p(stream_of(ordinal, stream))

    def fn(h, *args):
        with torch.cuda.device(ordinal):
            return client._lib.kvp_client_cuda_commit_ex(h, *args)
    client._call(fn, seq_ptr, n, s, pages, published)


class CudaPool:
    """The pool of a cuda-backend Client (borrowed: the Client owns this object)."""

    def __init__(self, client):
        self._client = client
        self._tensors = {}  # group device -> the whole pool as a tensor of its dtype
        self._buffers = {}  # buffer id -> group device, for CUDA staging buffers

    def close(self):
        self._tensors.clear()
        self._buffers.clear()

    def _pool(self, g):
        """The whole pool of group device g as a 1-D tensor of the pool's dtype (cached)."""
        c = self._client
        info = c.pool_info
        if not 0 <= g < info.num_devices:
            raise IndexError("device %d out of range (the pool spans %d)" % (g, info.num_devices))
        if g in self._tensors:
            return self._tensors[g]
        lib = c._lib
        with c._lock:
            h = c._handle()
            rc = lib.kvp_client_cuda_map_pool(h)
            if rc:
                raise error(rc, (lib.kvp_client_last_error(h) or b"").decode(errors="replace"))
            base = lib.kvp_client_pool_base(h, int(g))
        if not base:
            raise error(KVP_EPRECOND, "the pool of device %d is not mapped (connect with "
                        "map_pool=True)" % g)
        raw = device_bytes(base, info.pool_bytes, info.device_ids[g], c)
        t = raw.view(torch_dtype(info.dtype))
        self._tensors[g] = t
        return t

    def bytes_view(self, g):
        return self._pool(g).view(torch.uint8)

    def kv_view(self, layer, kv, g):
        """Layer `layer`'s K (kv 0) or V (kv 1) share of device g: [P, page_size, H, D] (NHD) or
        [P, H, page_size, D] (HND), strides of the pool (page stride covers K and V when
        combined)."""
        info = self._client.pool_info
        pool = self._pool(g)
        e = info.elem_bytes
        H = info.heads_per_device
        off = (layer * info.layer_bytes + (info.v_offset_bytes if kv else 0)) // e
        if info.layout == Layout.NHD:
            shape = (info.num_pages, info.page_size, H, info.head_dim)
            strides = (info.stride_page, info.stride_n, info.stride_h, 1)
        else:
            shape = (info.num_pages, H, info.page_size, info.head_dim)
            strides = (info.stride_page, info.stride_h, info.stride_n, 1)
        return pool.as_strided(shape, strides, off)

    def paged_kv_cache(self, layer, g):
        """FlashInfer's paged_kv_cache argument of a layer: combined -> [P, 2, ...] (K at
        [:, 0], V at [:, 1]); split -> the tuple (k, v)."""
        info = self._client.pool_info
        k = self.kv_view(layer, 0, g)
        if info.storage == Storage.SPLIT:
            return k, self.kv_view(layer, 1, g)
        v_elems = info.v_offset_bytes // info.elem_bytes
        return k.as_strided((k.shape[0], 2) + tuple(k.shape[1:]),
                            (k.stride(0), v_elems) + tuple(k.stride()[1:]), k.storage_offset())

    def apply_copies(self, table, g, stream):
        """Queues a Reserve answer's copy-on-write copies on `stream` of device g (every
        layer)."""
        if len(table.copies) == 0:
            return
        c = self._client
        info = c.pool_info
        self._pool(g)  # mapped
        t, keep = _table_struct(table)
        with torch.cuda.device(info.device_ids[g]):
            c._call(c._lib.kvp_client_cuda_copy_pages, ctypes.byref(t),
                    ctypes.c_void_p(stream_of(info.device_ids[g], stream)))
        del keep

    def alloc_staging(self, nbytes, g):
        """A VMM staging buffer on device g registered with events: (uint8 tensor, buffer
        id)."""
        c = self._client
        info = c.pool_info
        ptr = ctypes.c_void_p()
        bid = ctypes.c_uint32()
        c._call(c._lib.kvp_client_cuda_alloc_buffer, int(nbytes), int(info.device_ids[g]),
                ctypes.byref(ptr), ctypes.byref(bid), 1)
        self._buffers[int(bid.value)] = int(g)
        return device_bytes(ptr.value, nbytes, info.device_ids[g], c), int(bid.value)

    def register_tensor(self, tensor, g):
        """Registers a CUDA tensor's bytes (cudaMalloc'd: PyTorch's caching allocator without
        expandable segments) as a legacy-IPC staging buffer with events; returns the buffer
        id."""
        if not (isinstance(tensor, torch.Tensor) and tensor.is_cuda and tensor.is_contiguous()):
            raise error(KVP_EINVAL, "register_tensor needs a contiguous CUDA tensor")
        c = self._client
        bid = ctypes.c_uint32()
        nbytes = tensor.numel() * tensor.element_size()
        with torch.cuda.device(tensor.device):
            c._call(c._lib.kvp_client_cuda_register_ipc, ctypes.c_void_p(tensor.data_ptr()),
                    int(nbytes), ctypes.byref(bid))
        self._buffers[int(bid.value)] = int(g)
        return int(bid.value)

    def append_call(self, buffer_id, opts, stream):
        """The C call of an append from one of this pool's staging buffers
        (kvp_client_cuda_append_async_cached: the daemon waits on an interprocess event
        recorded after the work queued on `stream`), or None for any other buffer."""
        g = self._buffers.get(int(buffer_id))
        if g is None:
            return None
        c = self._client
        ordinal = c.pool_info.device_ids[g]
        s = ctypes.c_void_p(stream_of(ordinal, stream))
        o = ctypes.byref(opts) if opts is not None else None

        def fn(h, seq_p, tok_p, n, src_p, table_p):
            with torch.cuda.device(ordinal):
                return c._lib.kvp_client_cuda_append_async_cached(h, seq_p, tok_p, n, src_p, o,
                                                                  table_p, s)
        return fn

    def free_buffer(self, buffer_id):
        """Frees one of this pool's staging buffers (True), or says it is not one (False)."""
        bid = int(buffer_id)
        if bid not in self._buffers:
            return False
        c = self._client
        c._call(c._lib.kvp_client_cuda_free_buffer, bid)
        del self._buffers[bid]
        return True

    def commit(self, seq_ptr, n, stream, pages, published):
        commit_on_stream(self._client, seq_ptr, n, stream, pages, published)
