# SPDX-License-Identifier: Apache-2.0
"""FlashInfer's paged-KV helpers (DESIGN.md §1), for the Reserve path: append_paged_kv_cache,
get_batch_indices_positions, get_seq_lens.

NumPy arrays (the host backend's views) are handled here in vectorised NumPy with the same
meaning and the same guards as the C kernel (libkvpool.so does not export the CPU kernel): nnz
= 0 is a no-op, batch_indices[i] < 0 is padding, and every position must lie inside its
request's sequence (pos < seq_len); every check runs before the first element is written. The
copy is a pure copy: the cache's dtype, no conversion.

PyTorch tensors are accepted too: CUDA tensors (the cuda backend's views) go to the CUDA
kernels libkvpool exports (kvpool._torch: the checked append, which writes nothing when an
entry is out of range, queued on the current stream; pass check=True to wait and raise); CPU
tensors by the same NumPy code on their memory (bf16/fp8 as raw integers); the two index
helpers reach both through their PyTorch custom operators (torch.ops.kvpool.*), which
torch.compile traces.
"""
from typing import Sequence, Tuple, Union

import numpy as np

from ._types import Array

__all__ = ["append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens"]


def _i32(a, name):
    a = np.asarray(a)
    if a.ndim != 1:
        raise ValueError("%s must be 1-D, got shape %s" % (name, a.shape))
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError("%s must be an integer array, got %s" % (name, a.dtype))
    return a.astype(np.int64, copy=False)


def _is_torch(x):
    return type(x).__module__.split(".")[0] == "torch"


def _torch_cuda(x):
    return _is_torch(x) and x.is_cuda


def _np(x):
    """A NumPy view of a CPU torch tensor (same memory; bf16/fp8 as unsigned integers)."""
    if not _is_torch(x):
        return x
    import torch

    if x.dtype == torch.bfloat16:
        x = x.view(torch.int16)
    elif x.element_size() == 1 and x.is_floating_point():
        x = x.view(torch.uint8)
    return x.numpy()


def get_seq_lens(kv_indptr: Array, kv_last_page_len: Array, page_size: int) -> Array:
    """seq_len[b] = (kv_indptr[b+1] - kv_indptr[b] - 1) * page_size + kv_last_page_len[b],
    0 for a request without pages. int32."""
    if _is_torch(kv_indptr):  # the custom operator (kvpool._torch), CPU or CUDA
        from . import _torch

        return _torch.get_seq_lens(kv_indptr, kv_last_page_len, page_size)
    indptr = _i32(kv_indptr, "kv_indptr")
    last = _i32(kv_last_page_len, "kv_last_page_len")
    if indptr.size != last.size + 1:
        raise ValueError("kv_indptr has %d entries, kv_last_page_len %d (want B+1 and B)"
                         % (indptr.size, last.size))
    pages = np.diff(indptr)
    out = np.where(pages > 0, (pages - 1) * int(page_size) + last, 0)
    return out.astype(np.int32)


def get_batch_indices_positions(append_indptr: Array, seq_lens: Array,
                                nnz: int) -> Tuple[Array, Array]:
    """(batch_indices, positions), int32 arrays of nnz entries: the j-th appended token of
    request b gets batch index b and position seq_lens[b] - append_len[b] + j (seq_lens already
    count the appended tokens). Entries past append_indptr[-1] are padding: batch index -1,
    position 0."""
    if _is_torch(append_indptr):  # the custom operator (kvpool._torch), CPU or CUDA
        from . import _torch

        return _torch.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    indptr = _i32(append_indptr, "append_indptr")
    lens = _i32(seq_lens, "seq_lens")
    nnz = int(nnz)
    if indptr.size != lens.size + 1:
        raise ValueError("append_indptr has %d entries, seq_lens %d (want B+1 and B)"
                         % (indptr.size, lens.size))
    alen = np.diff(indptr)
    if indptr.size and indptr[0] != 0:
        raise ValueError("append_indptr[0] must be 0")
    if np.any(alen < 0):
        raise ValueError("append_indptr must be non-decreasing")
    if np.any(alen > lens):
        raise ValueError("a request appends more tokens than its sequence length")
    total = int(indptr[-1]) if indptr.size else 0
    if total > nnz:
        raise ValueError("append_indptr[-1] = %d exceeds nnz = %d" % (total, nnz))
    b = np.repeat(np.arange(lens.size, dtype=np.int64), alen)
    j = np.arange(total, dtype=np.int64) - np.repeat(indptr[:-1], alen)
    pos = np.repeat(lens - alen, alen) + j
    batch_indices = np.full(nnz, -1, dtype=np.int32)
    positions = np.zeros(nnz, dtype=np.int32)
    batch_indices[:total] = b
    positions[:total] = pos
    return batch_indices, positions


def _split_cache(paged_kv_cache, kv_layout):
    """(k, v, page_size) from a combined [P, 2, ...] array or a (k, v) pair."""
    layout = kv_layout.upper()
    if layout not in ("NHD", "HND"):
        raise ValueError("kv_layout must be 'NHD' or 'HND', got %r" % (kv_layout,))
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError("paged_kv_cache as a tuple must be (k_cache, v_cache)")
        k, v = paged_kv_cache
        if tuple(k.shape) != tuple(v.shape) or k.dtype != v.dtype:
            raise ValueError("k_cache and v_cache differ: %s %s / %s %s"
                             % (k.shape, k.dtype, v.shape, v.dtype))
    else:
        c = paged_kv_cache
        if len(c.shape) != 5 or c.shape[1] != 2:
            raise ValueError("combined paged_kv_cache must be [num_pages, 2, ...], got %s"
                             % (c.shape,))
        k, v = c[:, 0], c[:, 1]
    if len(k.shape) != 4:
        raise ValueError("a K/V cache must be 4-D, got shape %s" % (tuple(k.shape),))
    page_size = k.shape[1] if layout == "NHD" else k.shape[2]
    return k, v, page_size, layout


def append_paged_kv_cache(append_key: Array, append_value: Array, batch_indices: Array,
                          positions: Array,
                          paged_kv_cache: Union[Array, Tuple[Array, Array], Sequence[Array]],
                          kv_indices: Array, kv_indptr: Array, kv_last_page_len: Array,
                          kv_layout: str = "NHD", *, check: bool = False) -> None:
    """FlashInfer's append_paged_kv_cache on NumPy arrays, in place.

    append_key, append_value: [nnz, H, D] (any row strides). batch_indices, positions: [nnz]
    (get_batch_indices_positions). paged_kv_cache: one array [P, 2, page_size, H, D] (NHD) /
    [P, 2, H, page_size, D] (HND), or a tuple (k_cache, v_cache) of [P, page_size, H, D] /
    [P, H, page_size, D] — e.g. Client.paged_kv_cache(layer), whose arrays alias the daemon's
    pool. kv_indices, kv_indptr, kv_last_page_len: the page table (already grown to include the
    appended tokens). Token i, head h goes to page kv_indices[kv_indptr[b] + pos // page_size],
    slot pos % page_size, with b = batch_indices[i], pos = positions[i].

    CUDA tensors: the same on the device, queued on the current stream; an out-of-range entry
    makes the whole call write nothing, and check=True waits and raises (the NumPy path always
    raises before writing).
    """
    k_cache, v_cache, page_size, layout = _split_cache(paged_kv_cache, kv_layout)
    if _torch_cuda(k_cache):
        from . import _torch

        return _torch.append_paged_kv_cache(append_key, append_value, batch_indices, positions,
                                            k_cache, v_cache, page_size, layout, kv_indices,
                                            kv_indptr, kv_last_page_len, check)
    if _is_torch(k_cache):
        k_cache, v_cache = _np(k_cache), _np(v_cache)
        append_key, append_value = _np(append_key), _np(append_value)
        batch_indices, positions = _np(batch_indices), _np(positions)
        kv_indices, kv_indptr, kv_last_page_len = _np(kv_indices), _np(kv_indptr), _np(
            kv_last_page_len)
    if not (k_cache.flags.writeable and v_cache.flags.writeable):
        raise ValueError("paged_kv_cache is read-only")
    key = np.asarray(append_key)
    value = np.asarray(append_value)
    bidx = _i32(batch_indices, "batch_indices")
    pos = _i32(positions, "positions")
    indices = _i32(kv_indices, "kv_indices")
    indptr = _i32(kv_indptr, "kv_indptr")
    last = _i32(kv_last_page_len, "kv_last_page_len")
    nnz = key.shape[0] if key.ndim else 0
    if key.ndim != 3 or value.shape != key.shape:
        raise ValueError("append_key and append_value must both be [nnz, H, D], got %s and %s"
                         % (key.shape, value.shape))
    if layout == "NHD":
        heads, dim = k_cache.shape[2], k_cache.shape[3]
    else:
        heads, dim = k_cache.shape[1], k_cache.shape[3]
    if key.shape[1:] != (heads, dim):
        raise ValueError("append rows are [H, D] = %s, the cache holds %s"
                         % (key.shape[1:], (heads, dim)))
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise TypeError("append_key/append_value are %s/%s, the cache is %s (a pure copy: no "
                        "conversion)" % (key.dtype, value.dtype, k_cache.dtype))
    if bidx.size != nnz or pos.size != nnz:
        raise ValueError("batch_indices and positions need nnz = %d entries, got %d and %d"
                         % (nnz, bidx.size, pos.size))
    if indptr.size < 1 or last.size != indptr.size - 1:
        raise ValueError("kv_indptr must have B+1 entries and kv_last_page_len B")
    if nnz == 0:
        return
    nb = last.size
    if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] > indices.size:
        raise ValueError("kv_indptr is not a valid CSR pointer over kv_indices")
    num_pages = k_cache.shape[0]
    seq_lens = get_seq_lens(indptr, last, page_size).astype(np.int64)

    live = bidx >= 0  # negative batch index: padding, skipped
    b, p = bidx[live], pos[live]
    if np.any(b >= nb):
        raise IndexError("batch_indices[%d] = %d, batch size is %d"
                         % (int(np.flatnonzero(live)[np.argmax(b >= nb)]), int(b.max()), nb))
    bad = (p < 0) | (p >= seq_lens[b])
    if np.any(bad):
        i = int(np.argmax(bad))
        raise IndexError("position %d of batch entry %d lies outside its sequence (length %d)"
                         % (int(p[i]), int(b[i]), int(seq_lens[b[i]])))
    page = indices[indptr[b] + p // page_size]
    if np.any((page < 0) | (page >= num_pages)):
        raise IndexError("a page id of kv_indices lies outside the cache's %d pages" % num_pages)
    slot = p % page_size
    if layout == "NHD":
        k_cache[page, slot] = key[live]
        v_cache[page, slot] = value[live]
    else:  # [P, H, page_size, D]: the advanced axes go first, giving [m, H, D]
        k_cache[page, :, slot] = key[live]
        v_cache[page, :, slot] = value[live]
