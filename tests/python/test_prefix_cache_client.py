# SPDX-License-Identifier: Apache-2.0
"""The Python side of the prefix cache's client API (issue #16), without a daemon: how the
keyword arguments of reserve() / append() / lookup() become libkvpool's kvp_cache_opts_t and
arrays, and what is refused before anything is sent. The calls against a real kvpoold live
with the daemon's tests."""
import ctypes

import numpy as np
import pytest

import kvpool
from kvpool import _lib
from kvpool._args import _prompts, _salts, cache_opts


def _read(ptr, n, ctype):
    return [ptr[i] for i in range(n)] if n else []


def test_no_cache_argument_means_the_plain_call():
    tok = np.array([3, 4], np.uint32)
    assert cache_opts(tok, None, None, False, False, None, 0) == (None, None)


def test_token_ids_flat_or_per_row_and_salts_per_row_or_shared():
    tok = np.array([2, 0, 3], np.uint32)
    o, keep = cache_opts(tok, [7, 8, -1, 2**31 - 1, -2**31], None, True, False, None, 0)
    assert _read(o.token_ids, 5, ctypes.c_int32) == [7, 8, -1, 2**31 - 1, -2**31]
    assert not o.salt_lens and not o.salts
    assert (o.reuse, o.leave_last, o.priority, o.retention_ms) == (1, 0, -1, 0)

    o, keep = cache_opts(tok, [[1, 2], [], [3, 4, 5]], [b"ab", None, b"c"], False, True,
                                 0, 9)
    assert _read(o.token_ids, 5, ctypes.c_int32) == [1, 2, 3, 4, 5]
    assert _read(o.salt_lens, 3, ctypes.c_uint32) == [2, 0, 1]
    assert bytes(_read(o.salts, 3, ctypes.c_uint8)) == b"abc"
    assert (o.reuse, o.leave_last, o.priority, o.retention_ms) == (0, 1, 0, 9)

    o, keep = cache_opts(tok, None, b"lora-3", False, False, 100, 0)
    assert not o.token_ids
    assert _read(o.salt_lens, 3, ctypes.c_uint32) == [6, 6, 6]
    assert bytes(_read(o.salts, 18, ctypes.c_uint8)) == b"lora-3" * 3
    assert o.priority == 100


def test_bad_cache_arguments_are_refused_locally():
    tok = np.array([2, 3], np.uint32)
    with pytest.raises(ValueError, match="4 token ids for 5 tokens"):
        cache_opts(tok, [1, 2, 3, 4], None, False, False, None, 0)
    with pytest.raises(ValueError, match="rows have"):
        cache_opts(tok, [[1, 2, 3], [4, 5]], None, False, False, None, 0)
    with pytest.raises(ValueError, match="1 salts for 2 sequences"):
        cache_opts(tok, None, [b"x"], False, False, None, 0)
    for p in (-1, 101):
        with pytest.raises(ValueError, match="priority"):
            cache_opts(tok, None, None, False, False, p, 0)
    with pytest.raises(ValueError, match="int32"):
        cache_opts(tok, [0, 0, 0, 0, 2**31], None, False, False, None, 0)
    with pytest.raises(TypeError, match="integers"):
        cache_opts(tok, [0.5] * 5, None, False, False, None, 0)


def test_lookup_prompts_and_salts_become_flat_arrays():
    ids, lens = _prompts([[1, 2, 3], [], range(4, 8)])
    assert ids.dtype == np.int32 and ids.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert lens.dtype == np.uint32 and lens.tolist() == [3, 0, 4]
    ids, lens = _prompts([])
    assert ids.size == 0 and lens.size == 0
    assert _salts(None, 3) == (None, None)
    data, lens = _salts([b"", b""], 2)
    assert lens.tolist() == [0, 0] and data.size >= 1  # a valid pointer even when empty


def test_page_table_reads_cached_tokens_as_zeros_by_default():
    t = kvpool.PageTable(*(np.zeros(1, np.int32) for _ in range(5)), np.zeros((0, 2), np.uint32))
    assert t.cached_tokens.dtype == np.uint32 and t.cached_tokens.size == 0
    assert kvpool.Pin(1, 32, 2, 1000).pinned_pages == 2
    assert kvpool.Commit(4, 0).published == 0


def test_new_structs_mirror_the_library():
    lib = _lib.load()
    for name in ("kvp_cache_opts_t", "kvp_pin_t", "kvp_cache_stats_t", "kvp_client_opts_t",
                 "kvp_page_table_t"):
        assert lib.kvp_client_sizeof(name.encode()) == ctypes.sizeof(getattr(_lib, name)), name
    for name in ("kvp_client_reserve_cached", "kvp_client_append_cached", "kvp_client_commit",
                 "kvp_client_lookup", "kvp_client_pin", "kvp_client_unpin",
                 "kvp_client_cache_flush", "kvp_client_cache_stats", "kvp_client_cuda_commit",
                 "kvp_client_cuda_commit_ex", "kvp_client_cuda_append_async_cached"):
        assert _lib.has_symbol(name), name
