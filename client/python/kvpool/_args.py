# SPDX-License-Identifier: Apache-2.0
"""Python arguments to libkvpool's C arguments: seq ids, token counts, token ids, salts, the
prefix cache's options, a source's defaults, and the arrays a page table is answered into.
Pure conversions with their checks (ValueError / TypeError before any call is made); the
arrays returned are the caller's and must stay alive while a C struct points at them."""
import ctypes

import numpy as np

from . import _lib
from .records import PageTable

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


def table_answer(arrs, t) -> PageTable:
    """The PageTable of a table call's answer: copies of the filled part of its arrays."""
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


def cache_opts(tok, token_ids, salts, reuse, leave_last, priority, retention_ms, skip_tokens=0):
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


def source(src, info):
    """A kvp_source_t: src itself, or one from a dict (buffer_id, k_offset, v_offset required;
    the strides default to contiguous [nnz, H, D] rows of the pool's dtype, info a PoolInfo)."""
    if isinstance(src, _lib.kvp_source_t):
        return src
    s = dict(src)
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
    out = _lib.kvp_source_t()
    for k, v in {**defaults, **s}.items():
        setattr(out, k, int(v))
    return out
