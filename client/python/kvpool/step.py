# SPDX-License-Identifier: Apache-2.0
"""StepReserve: a Reserve prepared once for the repeated steps of one batch of sequences (a
model's forward steps), made by Client.step_reserve. Its own file because it is the hot path's
one Python object: everything that does not change between steps is built in __init__."""
import ctypes
from typing import TYPE_CHECKING, Optional

import numpy as np

from . import _lib
from ._args import _INDICES_CAP, _ptr, _salts, _table_arrays, _u64_array
from ._types import IntArray, Salts
from .records import PageTable

if TYPE_CHECKING:
    from .client import Client


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
