# SPDX-License-Identifier: Apache-2.0
"""kvpool's kernels on PyTorch tensors: FlashInfer's paged-KV helpers (get_seq_lens,
get_batch_indices_positions, the checked append) and libkvpool's fused append
(kvp_client_cuda_append_fused), reached through ctypes (kernels/kvp_kernels_cuda.h, kvpool.h).

The fused append and the page-table helpers are also PyTorch custom operators (torch.library,
namespace "kvpool": torch.ops.kvpool.append_paged_kv_cache_fused, .get_seq_lens,
.get_batch_indices_positions), each with a fake implementation that gives the shapes without
running anything: torch.compile traces through them without a graph break, and a CUDA graph
captures their one launch. The functions below call the operators; FusedAppend, prepared once
a step for a model's layers, is the eager path with the least Python a layer and calls the C
entry itself. The helpers' operators also run on CPU tensors (the NumPy code of kvpool.paged).

Imported only when a torch tensor or a cuda pool is used: `import kvpool` never needs PyTorch.
"""
import ctypes
from typing import Optional, Tuple

import torch

from . import _lib
from .errors import KVP_EPRECOND, error


def stream_of(ordinal, stream=None):
    """A cudaStream_t (int) for libkvpool: `stream` (a torch.cuda.Stream or a raw handle) or
    the current stream of the device."""
    if stream is None:
        stream = torch.cuda.current_stream(torch.device("cuda", ordinal))
    return int(getattr(stream, "cuda_stream", stream))


# ---- FlashInfer's helpers on CUDA tensors -------------------------------------------------

_preloaded = set()
_err_words = {}


def _kernels(device):
    lib = _lib.load()
    if not _lib.has_symbol("kvp_append_paged_kv_cache_cuda"):
        raise error(KVP_EPRECOND, "this libkvpool was built without CUDA kernels")
    if device.index not in _preloaded:
        with torch.cuda.device(device):
            rc = lib.kvp_cuda_kernels_preload()
        if rc:
            raise error(rc, "loading the kvpool kernels on %s failed" % device)
        _preloaded.add(device.index)
    return lib


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def _i32(t, name, device):
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.dim() != 1:
        raise ValueError("%s must be 1-D, got shape %s" % (name, tuple(t.shape)))
    return t.to(device=device, dtype=torch.int32).contiguous()


def _split_cache(paged_kv_cache, kv_layout):
    from .paged import _split_cache as split  # the FlashInfer argument forms, in one place

    return split(paged_kv_cache, kv_layout)


def _check(rc, what):
    if rc:
        raise error(rc, what)


def _index_args(a, a_name, b, b_name):
    """A helper's two index arrays as its operator takes them: int32 on a's device for CUDA;
    CPU tensors as they are (the NumPy code checks and converts them, as it does arrays)."""
    dev = a.device
    if not a.is_cuda:
        return a, torch.as_tensor(b)
    return _i32(a, a_name, dev), _i32(b, b_name, dev)


def get_seq_lens(kv_indptr, kv_last_page_len, page_size):
    """paged.get_seq_lens on torch tensors (torch.ops.kvpool.get_seq_lens): on kv_indptr's
    device, int32."""
    ip, last = _index_args(kv_indptr, "kv_indptr", kv_last_page_len, "kv_last_page_len")
    if ip.is_cuda and ip.numel() != last.numel() + 1:
        raise ValueError("kv_indptr has %d entries, kv_last_page_len %d (want B+1 and B)"
                         % (ip.numel(), last.numel()))
    return torch.ops.kvpool.get_seq_lens(ip, last, int(page_size))


def _seq_lens_cuda(ip, last, page_size):
    dev = ip.device
    lib = _kernels(dev)
    out = torch.empty(last.numel(), dtype=torch.int32, device=dev)
    with torch.cuda.device(dev):
        _check(lib.kvp_get_seq_lens_cuda(_ptr(ip), _ptr(last), last.numel(), int(page_size),
                                         _ptr(out), ctypes.c_void_p(stream_of(dev.index))),
               "get_seq_lens")
    return out


def get_batch_indices_positions(append_indptr, seq_lens, nnz):
    """paged.get_batch_indices_positions on torch tensors
    (torch.ops.kvpool.get_batch_indices_positions): on append_indptr's device, int32."""
    ip, lens = _index_args(append_indptr, "append_indptr", seq_lens, "seq_lens")
    if ip.is_cuda and ip.numel() != lens.numel() + 1:
        raise ValueError("append_indptr has %d entries, seq_lens %d (want B+1 and B)"
                         % (ip.numel(), lens.numel()))
    return torch.ops.kvpool.get_batch_indices_positions(ip, lens, int(nnz))


def _batch_indices_positions_cuda(ip, lens, nnz):
    dev = ip.device
    lib = _kernels(dev)
    bi = torch.full((nnz,), -1, dtype=torch.int32, device=dev)  # padding: -1, position 0
    pos = torch.zeros(nnz, dtype=torch.int32, device=dev)
    with torch.cuda.device(dev):
        _check(lib.kvp_get_batch_indices_positions_cuda(
            _ptr(ip), _ptr(lens), lens.numel(), nnz, _ptr(bi), _ptr(pos),
            ctypes.c_void_p(stream_of(dev.index))), "get_batch_indices_positions")
    return bi, pos


def _check_rows(key, value, k_cache, v_cache, layout, dev):
    """The checks both appends make of their rows against the cache: [nnz, H, D] sources of
    the cache's dtype and device, contiguous rows, K and V caches of one shape. Returns the
    cache's (heads, dim, token stride, head stride) in elements."""
    if key.dim() != 3 or tuple(value.shape) != tuple(key.shape):
        raise ValueError("append_key and append_value must both be [nnz, H, D], got %s and %s"
                         % (tuple(key.shape), tuple(value.shape)))
    for name, t in (("append_key", key), ("append_value", value), ("v_cache", v_cache)):
        if t.device != dev:
            raise ValueError("%s is on %s, the cache on %s" % (name, t.device, dev))
        if t.dtype != k_cache.dtype:
            raise TypeError("%s is %s, the cache is %s (a pure copy: no conversion)"
                            % (name, t.dtype, k_cache.dtype))
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or key.stride(2) != 1 \
            or value.stride(2) != 1:
        raise ValueError("rows must be contiguous and K/V caches share their strides")
    if layout == "NHD":
        heads, dim = k_cache.shape[2], k_cache.shape[3]
        s_n, s_h = k_cache.stride(1), k_cache.stride(2)
    else:
        heads, dim = k_cache.shape[1], k_cache.shape[3]
        s_n, s_h = k_cache.stride(2), k_cache.stride(1)
    if tuple(key.shape[1:]) != (heads, dim):
        raise ValueError("append rows are [H, D] = %s, the cache holds %s"
                         % (tuple(key.shape[1:]), (heads, dim)))
    return heads, dim, s_n, s_h


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, k_cache, v_cache,
                          page_size, layout, kv_indices, kv_indptr, kv_last_page_len, check):
    """The CUDA append on torch tensors (see paged.append_paged_kv_cache): the checked kernel
    pair, so an out-of-range position, batch index or page id writes nothing. Queued on the
    current stream; check=True waits for it and raises OutOfRange/InvalidArgument then."""
    dev = k_cache.device
    lib = _kernels(dev)
    key, value = append_key, append_value
    heads, dim, s_n, s_h = _check_rows(key, value, k_cache, v_cache, layout, dev)
    nnz = key.shape[0]
    bi = _i32(batch_indices, "batch_indices", dev)
    pos = _i32(positions, "positions", dev)
    if bi.numel() != nnz or pos.numel() != nnz:
        raise ValueError("batch_indices and positions need nnz = %d entries, got %d and %d"
                         % (nnz, bi.numel(), pos.numel()))
    indices = _i32(kv_indices, "kv_indices", dev)
    indptr = _i32(kv_indptr, "kv_indptr", dev)
    last = _i32(kv_last_page_len, "kv_last_page_len", dev)
    if indptr.numel() < 1 or last.numel() != indptr.numel() - 1:
        raise ValueError("kv_indptr must have B+1 entries and kv_last_page_len B")
    if nnz == 0:
        return
    kv = _lib.kvp_paged_kv_t(
        k_data=k_cache.data_ptr(), v_data=v_cache.data_ptr(), elem_bytes=k_cache.element_size(),
        num_pages=k_cache.shape[0], page_size=int(page_size), num_heads=heads, head_dim=dim,
        stride_page=k_cache.stride(0), stride_n=s_n, stride_h=s_h, batch_size=last.numel(),
        kv_indptr=indptr.data_ptr(), kv_indices=indices.data_ptr(),
        kv_last_page_len=last.data_ptr())
    src = _lib.kvp_append_src_t(key=key.data_ptr(), value=value.data_ptr(),
                                k_stride_n=key.stride(0), k_stride_h=key.stride(1),
                                v_stride_n=value.stride(0), v_stride_h=value.stride(1))
    err = _err_words.get(dev.index)
    if err is None:
        err = _err_words[dev.index] = torch.zeros(1, dtype=torch.int32, device=dev)
    with torch.cuda.device(dev):
        s = stream_of(dev.index)
        _check(lib.kvp_append_paged_kv_cache_cuda(ctypes.byref(kv), ctypes.byref(src), _ptr(bi),
                                                  _ptr(pos), nnz, _ptr(err), ctypes.c_void_p(s)),
               "append_paged_kv_cache")
        # temporaries made here are freed to the caching allocator, which hands their memory
        # only to later work of this same stream: ordered after these kernels
        if check:
            torch.cuda.current_stream(dev).synchronize()
    if check:
        code = int(err.item())
        if code:
            raise error(code, "append_paged_kv_cache: a position, batch index or page id is out "
                        "of range; nothing was written")


# ---- the fused append (kvp_client_cuda_append_fused) -------------------------------------

def _dev_i32(t, name, dev, n=None):
    """t itself when it is a 1-D contiguous int32 tensor on dev (of n entries when given): the
    fused path converts nothing, so that a captured graph reads the caller's very tensors."""
    if not isinstance(t, torch.Tensor):
        raise TypeError("%s must be a torch tensor (int32, on %s), got %s"
                        % (name, dev, type(t).__name__))
    if t.device != dev:
        raise ValueError("%s is on %s, the cache on %s" % (name, t.device, dev))
    if t.dtype != torch.int32:
        raise TypeError("%s must be int32, got %s" % (name, t.dtype))
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError("%s must be 1-D and contiguous, got shape %s strides %s"
                         % (name, tuple(t.shape), t.stride()))
    if n is not None and t.numel() != n:
        raise ValueError("%s has %d entries, want %d" % (name, t.numel(), n))
    return t


def _fused_fail(rc, lib):
    raise error(rc, "append_paged_kv_cache_fused: "
                + (lib.kvp_last_cuda_error() or b"").decode(errors="replace"))


class FusedAppend:
    """append_paged_kv_cache_fused prepared once for one page table and any number of caches of
    one geometry (a model's layers): the page-table tensors, the cache geometry, the stream and
    the C argument structs are checked and built here once; each call checks only what can
    differ per layer (the sources, and that the cache has the geometry prepared) and launches.
    One FusedAppend per forward step, one call per layer. states() takes a model's [B, H, T, D]
    K/V states as they are (no transpose, reshape or gather: the row strides go to the kernel),
    the least Python a layer.

    paged_kv_cache: one of the caches (its shape, strides, dtype and device are the geometry
    every call must have); the other arguments as append_paged_kv_cache_fused's, but stream
    None means the current stream of the cache's device when this object is made (a step's
    layers run on one stream). The index tensors are kept (not copied): update them in place
    for a CUDA graph's replay.
    """

    __slots__ = ("_lib", "_kv", "_src", "_aip", "_err", "_flags", "_stream", "_dev", "_geom",
                 "_row", "_heads", "_dim", "_layout", "_tensors", "_args", "_nnz", "_dtype",
                 "_index", "_kptr", "_vptr")

    def __init__(self, paged_kv_cache, append_indptr, kv_indices, kv_indptr, kv_last_page_len,
                 kv_layout="NHD", *, err=None, stream=None, pdl=False):
        k_cache, v_cache, page_size, layout = _split_cache(paged_kv_cache, kv_layout)
        if not (isinstance(k_cache, torch.Tensor) and k_cache.is_cuda):
            raise TypeError("append_paged_kv_cache_fused needs CUDA tensors as the cache")
        dev = k_cache.device
        if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
            raise ValueError("rows must be contiguous and K/V caches share their strides")
        if layout == "NHD":
            heads, dim, s_n, s_h = k_cache.shape[2], k_cache.shape[3], k_cache.stride(1), \
                k_cache.stride(2)
        else:
            heads, dim, s_n, s_h = k_cache.shape[1], k_cache.shape[3], k_cache.stride(2), \
                k_cache.stride(1)
        last = _dev_i32(kv_last_page_len, "kv_last_page_len", dev)
        batch = last.numel()
        indptr = _dev_i32(kv_indptr, "kv_indptr", dev, batch + 1)
        aip = _dev_i32(append_indptr, "append_indptr", dev, batch + 1)
        indices = _dev_i32(kv_indices, "kv_indices", dev)
        if err is not None and not (isinstance(err, torch.Tensor) and err.device == dev and
                                    err.dtype == torch.int32 and err.numel() >= 1):
            raise TypeError("err must be an int32 tensor of at least one element on %s" % dev)
        self._lib = _kernels(dev)
        self._dev, self._layout, self._heads, self._dim = dev, layout, heads, dim
        self._geom = (tuple(k_cache.shape), k_cache.stride(), k_cache.dtype)
        self._row = (heads, dim)
        self._kv = _lib.kvp_paged_kv_t(
            k_data=0, v_data=0, elem_bytes=k_cache.element_size(), num_pages=k_cache.shape[0],
            page_size=int(page_size), num_heads=heads, head_dim=dim,
            stride_page=k_cache.stride(0), stride_n=s_n, stride_h=s_h, batch_size=batch,
            kv_indptr=indptr.data_ptr(), kv_indices=indices.data_ptr(),
            kv_last_page_len=last.data_ptr())
        self._src = _lib.kvp_append_src_t()
        self._aip = ctypes.c_void_p(aip.data_ptr())
        self._err = ctypes.c_void_p(err.data_ptr() if err is not None else None)
        self._flags = _lib.KVP_CLIENT_CUDA_APPEND_PDL if pdl else 0
        self._stream = ctypes.c_void_p(stream_of(dev.index, stream))
        self._tensors = (last, indptr, aip, indices, err)  # alive while this object is
        self._dtype, self._index, self._nnz = k_cache.dtype, dev.index, None
        self._kptr = self._vptr = None  # the cache of the previous states() call
        self._args = (ctypes.byref(self._kv), ctypes.byref(self._src), self._aip)

    def __call__(self, append_key, append_value, paged_kv_cache):
        """Appends [nnz, H, D] rows to paged_kv_cache ((k, v) or combined) of the prepared
        geometry, queued on the prepared stream (None: the device's current stream)."""
        if isinstance(paged_kv_cache, (tuple, list)):
            k_cache, v_cache = paged_kv_cache
        else:
            k_cache, v_cache, _, _ = _split_cache(paged_kv_cache, self._layout)
        key, value, dev = append_key, append_value, self._dev
        self._check_cache(k_cache, v_cache)
        _check_rows(key, value, k_cache, v_cache, self._layout, dev)
        nnz = key.shape[0]
        if nnz == 0:
            return
        if self._kv.batch_size == 0:
            raise ValueError("%d tokens to append to a batch of 0 requests" % nnz)
        kv, src = self._kv, self._src
        kv.k_data, kv.v_data = k_cache.data_ptr(), v_cache.data_ptr()
        src.key, src.value = key.data_ptr(), value.data_ptr()
        src.k_stride_n, src.k_stride_h = key.stride(0), key.stride(1)
        src.v_stride_n, src.v_stride_h = value.stride(0), value.stride(1)
        self._kptr = None  # states() re-checks its cache next time
        self._launch(nnz)

    def _check_cache(self, k_cache, v_cache):
        if (tuple(k_cache.shape), k_cache.stride(), k_cache.dtype) != self._geom or \
                v_cache.stride() != k_cache.stride() or tuple(v_cache.shape) != self._geom[0] or \
                k_cache.get_device() != self._index or v_cache.get_device() != self._index:
            raise ValueError("the cache's geometry is not the one this append was prepared for")

    def _launch(self, nnz):
        # the C call launches on the calling thread's current device, which must be the stream's
        prev = torch.cuda.current_device()
        if prev != self._index:
            torch.cuda.set_device(self._dev)
        try:
            rc = self._lib.kvp_client_cuda_append_fused(*self._args, nnz, self._err, self._flags,
                                                        self._stream)
        finally:
            if prev != self._index:
                torch.cuda.set_device(prev)
        if rc:
            _fused_fail(rc, self._lib)

    def states(self, key_states, value_states, k_cache, v_cache):
        """Appends a model layer's new K/V states, [B, H, T, D] tensors whose B * T tokens are
        all new (a step with no padding), in batch order (token b * T + t), to (k_cache,
        v_cache) of the prepared geometry. The states' tokens must lie at one stride (T == 1,
        B == 1, or stride(0) == T * stride(2): what a [B, T, H, D] projection transposed to
        [B, H, T, D] is); anything else raises ValueError (gather the rows and call the
        object)."""
        key, value = key_states, value_states
        if key.dim() != 4 or key.shape != value.shape:
            raise ValueError("states must both be [B, H, T, D], got %s and %s"
                             % (tuple(key.shape), tuple(value.shape)))
        B, H, T, D = key.shape
        nnz = B * T
        if self._nnz is None:  # the step's first layer: the rows' count against the table
            self._nnz = nnz
        if nnz != self._nnz or (H, D) != self._row or key.dtype != self._dtype or \
                value.dtype != self._dtype or key.get_device() != self._index or \
                value.get_device() != self._index:
            raise ValueError("states %s %s on %s do not fit the step (%d rows of %s, %s on %s)"
                             % (tuple(key.shape), key.dtype, key.device, self._nnz, self._row,
                                self._dtype, self._dev))
        ks, vs = key.stride(), value.stride()
        # token b * T + t lies at b * stride(0) + t * stride(2): one stride when T == 1
        # (stride(0); a size-1 dimension's stride means nothing), B == 1 (stride(2)), or
        # stride(0) == T * stride(2)
        if T == 1:
            kn, vn = ks[0], vs[0]
        elif B == 1 or (ks[0] == T * ks[2] and vs[0] == T * vs[2]):
            kn, vn = ks[2], vs[2]
        else:
            kn = None
        if ks[3] != 1 or vs[3] != 1 or kn is None:
            raise ValueError("states with strides %s / %s: their tokens are not at one stride"
                             % (ks, vs))
        kp, vp = k_cache.data_ptr(), v_cache.data_ptr()
        if kp != self._kptr or vp != self._vptr:  # a layer's cache: its geometry, once
            self._check_cache(k_cache, v_cache)
            self._kv.k_data, self._kv.v_data = kp, vp
            self._kptr, self._vptr = kp, vp
        if nnz == 0:
            return
        src = self._src
        src.key, src.value = key.data_ptr(), value.data_ptr()
        src.k_stride_n, src.k_stride_h = kn, ks[1]
        src.v_stride_n, src.v_stride_h = vn, vs[1]
        self._launch(nnz)


def append_paged_kv_cache_fused(append_key, append_value, append_indptr, paged_kv_cache,
                                kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD", *,
                                err=None, stream=None, pdl=False, check=False):
    """FlashInfer's append_paged_kv_cache with the batch indices and positions computed inside
    the one launch from the page table (kvpool.h: kvp_client_cuda_append_fused), in place.

    append_key, append_value: [nnz, H, D] CUDA tensors of the cache's dtype (rows contiguous,
    any row/head strides that are 16-byte multiples); nnz = append_key.shape[0]. append_indptr:
    [B+1], token i belongs to request b with append_indptr[b] <= i < append_indptr[b+1], and
    append_indptr[B] must equal nnz (no padding: a token past it is skipped and reported).
    paged_kv_cache, kv_indices, kv_indptr, kv_last_page_len, kv_layout: as in
    kvpool.append_paged_kv_cache, the page table already counting the appended tokens (a
    Reserve answer): token i goes to position seq_len[b] - append_len[b] + (i -
    append_indptr[b]). Every index tensor must already be int32, contiguous and on the cache's
    device: nothing is converted or copied here, and nothing on the device is read on the host.

    err: None (a row skipped for a bad page id or a token outside every request is not
    reported; nothing is ever written out of bounds) or an int32 CUDA tensor whose first
    element receives KVP_ERANGE (first failure wins); never reset here: zero it yourself.
    stream: a torch.cuda.Stream or a raw cudaStream_t (int); None: the current stream of the
    cache's device. pdl: programmatic dependent launch (sm_90+; kvpool.h
    KVP_CLIENT_CUDA_APPEND_PDL): the page-table tensors must be complete before the stream's
    previous kernel starts, the sources may come from that kernel.

    Capturable in a CUDA graph (torch.cuda.graph): one kernel, no allocation, no sync; the
    graph keeps the tensors' addresses, so replay with new page tables by updating the same
    tensors in place (copy_). Call it once outside the capture first (PyTorch's warm-up),
    which loads the kernels. check=True (not while capturing): synchronize `stream` and raise
    OutOfRange if a row was skipped (err, or a temporary word when err is None).
    """
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError("%s must be a CUDA tensor" % name)
    if check and torch.cuda.is_current_stream_capturing():
        raise ValueError("check=True synchronizes: not while capturing a CUDA graph")
    k_cache, v_cache, _, layout = _split_cache(paged_kv_cache, kv_layout)
    if not (isinstance(k_cache, torch.Tensor) and k_cache.is_cuda):
        raise TypeError("append_paged_kv_cache_fused needs CUDA tensors as the cache")
    dev = k_cache.device
    word = err
    if check and word is None:
        word = torch.zeros(1, dtype=torch.int32, device=dev)
    op = torch.ops.kvpool.append_paged_kv_cache_fused
    args = (append_key, append_value, k_cache, v_cache, append_indptr, kv_indices, kv_indptr,
            kv_last_page_len, layout, word, bool(pdl))
    if stream is None:
        op(*args)
    else:  # the operator launches on the current stream: make `stream` current around it
        s = stream if isinstance(stream, torch.cuda.Stream) else \
            torch.cuda.ExternalStream(int(stream), device=dev)
        with torch.cuda.stream(s):
            op(*args)
    if check:
        torch.cuda.synchronize(dev)  # whatever stream it ran on
        code = int(word[0].item())
        if code:
            raise error(code, "append_paged_kv_cache_fused: a token lies outside every request "
                        "or a page id outside the cache; those rows were skipped")


# ---- the custom operators (torch.library) ----------------------------------------------------
# Each has a real implementation (the kernels above; the helpers' CPU halves are kvpool.paged's
# NumPy code) and a fake one (shapes and dtypes only: what torch.compile traces with). The fused
# append returns nothing and declares what it writes (mutates_args), so a compiled graph orders
# later reads of the cache after it.

@torch.library.custom_op("kvpool::append_paged_kv_cache_fused",
                         mutates_args=("k_cache", "v_cache", "err"))
def _fused_op(append_key: torch.Tensor, append_value: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, append_indptr: torch.Tensor, kv_indices: torch.Tensor,
              kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, kv_layout: str,
              err: Optional[torch.Tensor], pdl: bool) -> None:
    """append_paged_kv_cache_fused on (k_cache, v_cache), on the current stream."""
    FusedAppend((k_cache, v_cache), append_indptr, kv_indices, kv_indptr, kv_last_page_len,
                kv_layout, err=err, pdl=pdl)(append_key, append_value, (k_cache, v_cache))


@_fused_op.register_fake
def _fused_fake(append_key, append_value, k_cache, v_cache, append_indptr, kv_indices,
                kv_indptr, kv_last_page_len, kv_layout, err, pdl):
    return None


@torch.library.custom_op("kvpool::get_seq_lens", mutates_args=())
def _seq_lens_op(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor,
                 page_size: int) -> torch.Tensor:
    if kv_indptr.is_cuda:
        return _seq_lens_cuda(kv_indptr, kv_last_page_len, page_size)
    from . import paged

    return torch.from_numpy(paged.get_seq_lens(kv_indptr.numpy(), kv_last_page_len.numpy(),
                                               page_size))


@_seq_lens_op.register_fake
def _seq_lens_fake(kv_indptr, kv_last_page_len, page_size):
    return kv_last_page_len.new_empty(kv_last_page_len.shape, dtype=torch.int32)


@torch.library.custom_op("kvpool::get_batch_indices_positions", mutates_args=())
def _batch_op(append_indptr: torch.Tensor, seq_lens: torch.Tensor,
              nnz: int) -> Tuple[torch.Tensor, torch.Tensor]:
    if append_indptr.is_cuda:
        return _batch_indices_positions_cuda(append_indptr, seq_lens, nnz)
    from . import paged

    bi, pos = paged.get_batch_indices_positions(append_indptr.numpy(), seq_lens.numpy(), nnz)
    return torch.from_numpy(bi), torch.from_numpy(pos)


@_batch_op.register_fake
def _batch_fake(append_indptr, seq_lens, nnz):
    return (append_indptr.new_empty((nnz,), dtype=torch.int32),
            append_indptr.new_empty((nnz,), dtype=torch.int32))
