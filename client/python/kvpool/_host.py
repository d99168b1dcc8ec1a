# SPDX-License-Identifier: Apache-2.0
"""The host backend's pool object: the daemon's memfd pool and the staging buffers as NumPy
arrays over libkvpool's mappings (no copy), and the host-side Reserve chores (copy-on-write
copies, Commit without an event). Client keeps one pool object per connection, of its
backend's kind (this one, or kvpool._cuda_pool.CudaPool): the methods below are the whole
interface a backend provides, so Client never asks which backend it talks to.
Arrays keep the Client alive; Client.close() unmaps them, after which they must not be used.
"""
import ctypes

import numpy as np

from .codes import Layout, Storage
from .errors import KVP_EPRECOND, error


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


class HostPool:
    """The pool of a host-backend Client (borrowed: the Client owns this object)."""

    def __init__(self, client):
        self._client = client
        self._arrays = {}  # device -> the whole pool as a uint8 array

    def close(self):
        """Forgets the arrays (the Client unmaps the memory)."""
        self._arrays.clear()

    def _pool(self, device):
        if device in self._arrays:
            return self._arrays[device]
        c = self._client
        with c._lock:
            base = c._lib.kvp_client_pool_base(c._handle(), int(device))
        if not base:
            raise error(KVP_EPRECOND, "the pool of device %d is not mapped (connect with "
                        "map_pool=True)" % device)
        arr = np.asarray(_Memory(base, c.pool_info.pool_bytes, c))
        self._arrays[device] = arr
        return arr

    def bytes_view(self, device):
        return self._pool(device)

    def kv_view(self, layer, kv, device):
        """Layer `layer`'s K (kv 0) or V (kv 1) as a NumPy array over the pool."""
        info = self._client.pool_info
        pool = self._pool(device)
        dt = info.numpy_dtype
        e = dt.itemsize
        H = info.heads_per_device
        off = layer * info.layer_bytes + (info.v_offset_bytes if kv else 0)
        if info.layout == Layout.NHD:  # [P, page_size, H, D]
            shape = (info.num_pages, info.page_size, H, info.head_dim)
            strides = (info.stride_page * e, info.stride_n * e, info.stride_h * e, e)
        else:  # HND: [P, H, page_size, D]
            shape = (info.num_pages, H, info.page_size, info.head_dim)
            strides = (info.stride_page * e, info.stride_h * e, info.stride_n * e, e)
        return np.ndarray(shape, dtype=dt, buffer=pool, offset=off, strides=strides)

    def paged_kv_cache(self, layer, device):
        k = self.kv_view(layer, 0, device)
        if self._client.pool_info.storage == Storage.SPLIT:
            return k, self.kv_view(layer, 1, device)
        vstride = self._client.pool_info.v_offset_bytes
        return np.lib.stride_tricks.as_strided(
            k, shape=(k.shape[0], 2) + k.shape[1:],
            strides=(k.strides[0], vstride) + k.strides[1:], writeable=True)

    def apply_copies(self, table, device, stream):
        """The copy-on-write copies, done here and now (stream: unused)."""
        c = np.asarray(table.copies)
        if c.size == 0:
            return
        src, dst = c[:, 0].astype(np.int64), c[:, 1].astype(np.int64)
        for layer in range(self._client.pool_info.num_layers):
            for kv in (0, 1):
                v = self.kv_view(layer, kv, device)
                v[dst] = v[src]

    def alloc_staging(self, nbytes, device):
        """A sealed memfd staging buffer: (uint8 array, buffer id)."""
        c = self._client
        ptr = ctypes.c_void_p()
        bid = ctypes.c_uint32()
        c._call(c._lib.kvp_client_alloc_host_buffer, int(nbytes), ctypes.byref(ptr),
                ctypes.byref(bid))
        return np.asarray(_Memory(ptr.value, nbytes, c)), int(bid.value)

    def register_tensor(self, tensor, device):
        raise error(KVP_EPRECOND, "register_tensor needs the cuda backend")

    def append_call(self, buffer_id, opts, stream):
        """The C call of an append from buffer_id when this pool must make it itself: never
        (the daemon reads host buffers): None."""
        return None

    def free_buffer(self, buffer_id):
        """Frees buffer_id if this pool made it in a way Client's unregister cannot undo:
        never here (False)."""
        return False

    def commit(self, seq_ptr, n, stream, pages, published):
        """Commit: the writes are complete when this is called. A stream given asks for an
        interprocess event after the work queued on it (a torch stream: the cuda path)."""
        c = self._client
        if stream is not None:
            from . import _cuda_pool

            return _cuda_pool.commit_on_stream(c, seq_ptr, n, stream, pages, published)
        c._call(c._lib.kvp_client_commit, seq_ptr, n, None, pages, published)
        return None
