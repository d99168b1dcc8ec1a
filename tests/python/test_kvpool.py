# SPDX-License-Identifier: Apache-2.0
"""The Python package kvpool (client/python) against real kvpoold processes on the host backend.

Needs numpy and pytest. The daemon is $KVPOOLD, else $BUILD_DIR/server/kvpoold, else
build/server/kvpoold of this source tree; libkvpool is found by the package ($KVPOOL_LIB, ...).
tests/python/run.sh sets everything up.
"""
import ctypes
import dataclasses
import os
import socket as pysocket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, kvpool  # noqa: E402  (conftest puts the package on sys.path)
from kvpool import errors as E  # noqa: E402

# The small pool of the view tests: 2 layers x 64 pages x 4 tokens x 2 heads x 16 dims, fp32.
SMALL = ["--num-pages", "64", "--page-size", "4", "--num-layers", "2", "--num-kv-heads", "2",
         "--head-dim", "16", "--dtype", "fp32"]


@pytest.fixture
def small(start):
    return start(*SMALL)


def nsname(request):
    return request.node.name.replace("[", "-").replace("]", "")


# ---- library, connect, info ---------------------------------------------------------------

def test_library_exports_and_error_names():
    assert kvpool.library_path().endswith(".so") or ".so." in kvpool.library_path()
    # every KVP_E* code of the Python table has libkvpool's own name
    for name, code in E.CODES.items():
        assert E.errname(code) == name
        assert kvpool.exception_class(code).__mro__[0] is not None
    assert kvpool.exception_class(E.KVP_ENOENT) is kvpool.NotFound
    assert kvpool.exception_class(E.KVP_ENOSPC) is kvpool.ResourceExhausted
    assert kvpool.exception_class(E.KVP_EINVAL) is kvpool.InvalidArgument
    assert kvpool.exception_class(E.KVP_EPERM) is kvpool.PermissionDenied
    assert kvpool.exception_class(E.KVP_EUNAVAIL) is kvpool.Unavailable
    assert kvpool.exception_class(E.KVP_ECLOSED) is kvpool.ConnectionClosed
    assert kvpool.exception_class(E.KVP_EGEOM_DTYPE) is kvpool.GeometryError
    assert kvpool.exception_class(-111) is kvpool.DaemonUnreachable
    for code in list(E.CODES.values()) + [-2, -111]:
        e = E.error(code, "msg")
        assert isinstance(e, kvpool.KvpoolError) and e.code == code and e.message == "msg"
        assert e.name in str(e)


def test_ctypes_mirrors_have_the_c_sizes():
    # every struct the package mirrors is the size libkvpool compiled (a field added on one
    # side only would shift what the other reads)
    from kvpool import _lib
    lib = _lib.load()
    names = ["kvp_client_opts_t", "kvp_pool_info_t", "kvp_page_table_t", "kvp_source_t",
             "kvp_stats_summary_t", "kvp_transfer_ticket_t", "kvp_transfer_info_t",
             "kvp_cache_opts_t", "kvp_pin_t", "kvp_cache_stats_t"]
    for name in names:
        assert lib.kvp_client_sizeof(name.encode()) == ctypes.sizeof(getattr(_lib, name)), name
    assert lib.kvp_client_sizeof(b"no_such_t") == 0


def test_pool_info_and_handle(small, request):
    with small.client(nsname(request)) as c:
        i = c.pool_info
        assert (i.num_layers, i.num_pages, i.page_size, i.num_kv_heads, i.head_dim) == \
            (2, 64, 4, 2, 16)
        assert (i.dtype_name, i.layout_name, i.storage_name, i.backend_name) == \
            ("fp32", "nhd", "combined", "host")
        assert (i.num_devices, i.elem_bytes, i.heads_per_device) == (1, 4, 2)
        page = 4 * 2 * 16  # elements of one page's K
        assert (i.stride_page, i.stride_n, i.stride_h) == (2 * page, 32, 16)
        assert i.v_offset_bytes == page * 4
        assert i.layer_bytes == 64 * 2 * page * 4 and i.pool_bytes == 2 * i.layer_bytes
        assert i.map_granularity == 0 and i.device_ids == (0,)
        assert i.numpy_dtype == np.float32
        assert c.session_id > 0
        assert c.server_version
        assert c.ping() > 0
        c.audit()
        assert not c.closed
    assert c.closed
    c.close()  # idempotent
    with pytest.raises(kvpool.FailedPrecondition):
        c.ping()


def test_default_socket_follows_env(monkeypatch):
    monkeypatch.setenv("KVPOOL_SOCKET", "/tmp/x/kvpool.sock")
    assert kvpool.default_socket() == "/tmp/x/kvpool.sock"


# ---- sequences and page tables ---------------------------------------------------------------

def test_seed_example_page_table(start):
    d = start("--num-pages", "64", "--page-size", "16", "--num-layers", "1",
              "--num-kv-heads", "2", "--head-dim", "16", "--dtype", "fp16")
    with d.client("seed") as c:
        t = c.reserve([10, 11, 12, 13], [45, 8, 25, 22])
        assert t.kv_indptr.dtype == np.int32 and t.kv_indices.dtype == np.int32
        assert t.kv_last_page_len.dtype == np.int32 and t.copies.dtype == np.uint32
        assert t.kv_indptr.tolist() == [0, 3, 4, 6, 8]
        assert t.kv_last_page_len.tolist() == [13, 8, 9, 6]
        assert sorted(t.kv_indices.tolist()) == list(range(8))  # a fresh pool: pages 0..7
        assert t.append_indptr.tolist() == [0, 45, 53, 78, 100]
        assert t.seq_lens.tolist() == [45, 8, 25, 22]
        assert t.copies.shape == (0, 2) and t.nnz == 100 and t.batch_size == 4
        bi, pos = kvpool.get_batch_indices_positions(t.append_indptr, t.seq_lens, 100)
        assert bi.tolist() == [0] * 45 + [1] * 8 + [2] * 25 + [3] * 22
        assert pos.tolist() == (list(range(45)) + list(range(8)) + list(range(25))
                                + list(range(22)))
        assert kvpool.get_seq_lens(t.kv_indptr, t.kv_last_page_len, 16).tolist() == \
            [45, 8, 25, 22]
        # page_table reads the same table back, nothing appended
        p = c.page_table([10, 11, 12, 13])
        for f in ("kv_indptr", "kv_indices", "kv_last_page_len", "seq_lens"):
            assert getattr(p, f).tolist() == getattr(t, f).tolist()
        assert p.append_indptr.tolist() == [0, 0, 0, 0, 0]


def test_fork_truncate_release_stats(small, request):
    with small.client(nsname(request)) as c:
        s0 = c.stats()
        assert (s0.num_pages, s0.free_pages, s0.used_pages, s0.num_seqs) == (64, 64, 0, 0)
        t = c.reserve([1, 2], [5, 3])  # page size 4: 2 pages + 1 page
        assert t.kv_indptr.tolist() == [0, 2, 3] and t.kv_last_page_len.tolist() == [1, 3]
        s = c.stats()
        assert (s.free_pages, s.used_pages, s.num_seqs, s.num_tokens) == (61, 3, 2, 8)
        c.fork(1, 3)
        p = c.page_table([1, 3])
        assert p.kv_indices[0:2].tolist() == p.kv_indices[2:4].tolist()
        s = c.stats()
        assert (s.used_pages, s.shared_pages, s.page_refs, s.num_seqs) == (3, 2, 5, 3)
        # appending to both holders of the shared partial last page: one copy-on-write copy
        t = c.reserve([1, 3], [1, 1])
        assert t.copies.shape == (1, 2)
        src, dst = t.copies[0].tolist()
        assert src == p.kv_indices[1]
        assert dst in t.kv_indices.tolist() and src in t.kv_indices.tolist()
        assert t.seq_lens.tolist() == [6, 6] and t.kv_last_page_len.tolist() == [2, 2]
        c.truncate(1, 4)
        p = c.page_table([1])
        assert p.kv_indptr.tolist() == [0, 1] and p.kv_last_page_len.tolist() == [4]
        assert p.seq_lens.tolist() == [4]
        c.truncate(1, 0)
        assert c.page_table([1]).kv_indptr.tolist() == [0, 0]
        assert c.release([1, 2, 3, 99]) == 3
        s = c.stats()
        assert (s.free_pages, s.used_pages, s.num_seqs, s.page_refs) == (64, 0, 0, 0)
        c.audit()
        with pytest.raises(kvpool.InvalidArgument, match="empty batch"):
            c.page_table([])


def test_step_reserve_answers_what_reserve_answers(small, request):
    """Client.step_reserve: the same steps through the prepared Reserve and through reserve()
    on twin sequences give the same tables (page ids aside); its keyed steps are findable after
    commit like reserve()'s; a token-id count that differs is refused before any call."""
    with small.client(nsname(request), cache_scope="steps") as c:
        ids = list(range(100, 111))
        r = c.step_reserve([11, 12], salts=b"m")
        steps = [([5, 3], ids[:8]), ([1, 1], ids[8:10]), ([0, 1], ids[10:11])]
        for counts, tokens in steps:
            a = c.reserve([21, 22], counts, token_ids=tokens, salts=b"m")
            t = r.run(counts, tokens)
            for f in ("kv_indptr", "kv_last_page_len", "append_indptr", "seq_lens"):
                assert getattr(t, f).tolist() == getattr(a, f).tolist(), f
            assert t.kv_indices.size == a.kv_indices.size and t.copies.shape == a.copies.shape
        assert t.seq_lens.tolist() == [6, 5]
        with pytest.raises(ValueError, match="3 token ids for 2 tokens"):
            r.run([1, 1], [1, 2, 3])
        assert c.page_table([11, 12]).seq_lens.tolist() == [6, 5]  # nothing changed
        plain = r.run(1)  # no token ids: not keyed, both rows grow by one
        assert plain.seq_lens.tolist() == [7, 6]
        c.commit([11, 12])
        # row 0 holds ids[0:5] + ids[8:9] + one unkeyed token: its first full page (4 tokens)
        # is findable under the salt
        assert c.lookup([ids[:5] + ids[8:9]], salts=b"m") == [4]
        assert c.lookup([ids[:5] + ids[8:9]]) == [0]  # the salt went with the step's ids
        assert c.release([11, 12, 21, 22]) == 4
        c.audit()


def test_lease_zero_releases_on_close(small, request):
    with small.client(nsname(request), lease_ms=0) as c:
        c.reserve([1], [9])
    with small.client("observer", lease_ms=None) as o:  # KVP_LEASE_DEFAULT: no lease asked
        end = time.time() + 5
        while o.stats().num_seqs and time.time() < end:
            time.sleep(0.01)
        s = o.stats()
        assert (s.num_seqs, s.free_pages) == (0, 64)


# ---- errors ----------------------------------------------------------------------------------

def test_errors_surface_as_exceptions(small, request):
    with small.client(nsname(request)) as c:
        with pytest.raises(kvpool.NotFound) as ei:
            c.truncate(42, 1)
        assert ei.value.code == E.KVP_ENOENT and ei.value.name == "KVP_ENOENT"
        assert "42" in ei.value.message
        with pytest.raises(kvpool.NotFound):
            c.page_table([42])
        with pytest.raises(kvpool.NotFound):
            c.fork(42, 43)
        c.reserve([1], [6])
        with pytest.raises(kvpool.InvalidArgument) as ei:
            c.truncate(1, 7)  # longer than the sequence
        assert ei.value.code == E.KVP_EINVAL and isinstance(ei.value, ValueError)
        with pytest.raises(kvpool.InvalidArgument):
            c.reserve([2, 2], [1, 1])  # a sequence twice in one batch
        c.fork(1, 2)
        with pytest.raises(kvpool.AlreadyExists) as ei:
            c.fork(1, 2)
        assert ei.value.code == E.KVP_EEXIST
        with pytest.raises(kvpool.ResourceExhausted) as ei:
            c.reserve([5], [64 * 4])  # 62 pages free
        assert ei.value.code == E.KVP_ENOSPC
        assert c.stats().free_pages == 62  # nothing taken by the refused call
        c.reserve([5], [62 * 4])  # exactly enough
        with pytest.raises(kvpool.ResourceExhausted):
            c.reserve([6], [1])
        with pytest.raises(kvpool.NotFound):
            c.unregister_buffer(12345)
        with pytest.raises(ValueError):
            c.append([1], [1], source=dict(buffer_id=1))  # no offsets
        c.audit()


def test_limit_exceeded(start, request):
    d = start(*SMALL, "--set", "limits.max_batch=2")
    with d.client(nsname(request)) as c:
        # the daemon answers RESOURCE_EXHAUSTED, which the wire maps to KVP_ENOSPC
        with pytest.raises(kvpool.ResourceExhausted, match="max_batch") as ei:
            c.reserve([1, 2, 3], [1, 1, 1])
        assert ei.value.code == E.KVP_ENOSPC
        c.reserve([1, 2], [1, 1])


def test_connect_errors(tmp_path):
    with pytest.raises(kvpool.DaemonUnreachable) as ei:
        kvpool.Client(str(tmp_path / "none.sock"))
    assert ei.value.code == -2 and ei.value.name == "ENOENT"  # no socket file
    assert isinstance(ei.value, ConnectionError)
    # a socket file nobody listens on: ECONNREFUSED
    path = str(tmp_path / "dead.sock")
    s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    s.bind(path)
    s.close()
    with pytest.raises(kvpool.DaemonUnreachable) as ei:
        kvpool.Client(path)
    assert ei.value.name == "ECONNREFUSED" and ei.value.message


def test_connection_closed_when_daemon_dies(small, request):
    c = small.client(nsname(request))
    c.ping()
    small.proc.kill()
    small.proc.wait()
    with pytest.raises(kvpool.ConnectionClosed) as ei:
        c.ping()
    assert ei.value.code == E.KVP_ECLOSED and isinstance(ei.value, ConnectionError)
    c.close()


def test_permission_denied(small, request):
    """A namespace belongs to the uid that created it: another (non-root) uid is refused."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a client under a second uid")
    with small.client("owned", lease_ms=60000) as c:
        c.reserve([1], [1])
        os.chmod(small.dir, 0o755)
        os.chmod(small.sock, 0o777)
        code = ("import sys; sys.path.insert(0, %r); import kvpool\n"
                "try:\n    kvpool.Client(%r, 'owned', 0)\n    print('connected')\n"
                "except kvpool.KvpoolError as e:\n"
                "    print(type(e).__name__, e.code, e.name)\n"
                % (os.path.join(ROOT, "client", "python"), small.sock))
        out = subprocess.run([sys.executable, "-c", code], user=65534, capture_output=True,
                             text=True, timeout=20, env=dict(os.environ))
        assert out.stdout.split() == ["PermissionDenied", str(E.KVP_EPERM), "KVP_EPERM"], \
            out.stdout + out.stderr


def test_register_fd(small, request):
    with small.client(nsname(request)) as c:
        fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 4096)
            with pytest.raises(kvpool.InvalidArgument, match="F_SEAL_SHRINK"):
                c.register_fd(fd, 4096)  # a memfd must be sealed against shrinking
            import fcntl
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            bid = c.register_fd(fd, 4096)
            c.unregister_buffer(bid)
        finally:
            os.close(fd)


# ---- views aliasing the daemon's pool --------------------------------------------------------

def staging_rows(c, nnz, seed):
    """A staging buffer holding K and V for every layer: [L][2][nnz][H][D] of the pool's dtype,
    and the source dict that describes it."""
    i = c.pool_info
    rows = np.random.default_rng(seed).standard_normal(
        (i.num_layers, 2, nnz, i.heads_per_device, i.head_dim)).astype(i.numpy_dtype)
    buf, bid = c.alloc_staging(rows.nbytes)
    assert buf.dtype == np.uint8 and buf.flags.writeable and buf.size == rows.nbytes
    buf[:] = rows.reshape(-1).view(np.uint8)
    kv_bytes = rows[0, 0].nbytes
    src = dict(buffer_id=bid, k_offset=0, v_offset=kv_bytes, layer_stride=2 * kv_bytes)
    return rows, src


def slot_of(t, b, pos, page_size):
    return int(t.kv_indices[t.kv_indptr[b] + pos // page_size]), pos % page_size


def read_row(view, layout, page, slot):
    return view[page, slot] if layout == "nhd" else view[page, :, slot]


@pytest.mark.parametrize("layout,storage", [("nhd", "combined"), ("hnd", "combined"),
                                            ("nhd", "split"), ("hnd", "split")])
def test_views_alias_the_pool(start, request, layout, storage):
    d = start(*SMALL, "--layout", layout, "--storage", storage)
    with d.client(nsname(request)) as c:
        i = c.pool_info
        assert (i.layout_name, i.storage_name) == (layout, storage)
        k0 = c.k_view(0)
        shape = (64, 4, 2, 16) if layout == "nhd" else (64, 2, 4, 16)
        assert k0.shape == shape and k0.dtype == np.float32 and k0.flags.writeable
        if storage == "combined":
            assert k0.strides[0] == 2 * 4 * 2 * 16 * 4  # K and V of a page side by side
        seqs, ntok = [7, 8], [5, 2]
        rows, src = staging_rows(c, 7, seed=1)
        t = c.append(seqs, ntok, source=src)
        assert t.append_indptr.tolist() == [0, 5, 7] and t.seq_lens.tolist() == [5, 2]
        # every appended row is in the views at the page and slot the page table names
        for layer in range(2):
            k, v = c.k_view(layer), c.v_view(layer)
            tok = 0
            for b, n in enumerate(ntok):
                for pos in range(n):
                    page, slot = slot_of(t, b, pos, 4)
                    np.testing.assert_array_equal(read_row(k, layout, page, slot),
                                                  rows[layer, 0, tok])
                    np.testing.assert_array_equal(read_row(v, layout, page, slot),
                                                  rows[layer, 1, tok])
                    tok += 1
        # the views are the daemon's memory: a second append shows up in the same arrays
        rows2, src2 = staging_rows(c, 1, seed=2)
        t2 = c.append([8], [1], source=src2)
        page, slot = slot_of(t2, 0, 2, 4)
        np.testing.assert_array_equal(read_row(k0, layout, page, slot), rows2[0, 0, 0])
        np.testing.assert_array_equal(read_row(c.v_view(1), layout, page, slot), rows2[1, 1, 0])
        # paged_kv_cache(layer) is FlashInfer's argument: combined [P, 2, ...] or (k, v)
        kv = c.paged_kv_cache(1)
        if storage == "combined":
            assert kv.shape == (64, 2) + shape[1:]
            np.testing.assert_array_equal(kv[:, 1], c.v_view(1))
        else:
            assert isinstance(kv, tuple) and kv[0].shape == shape
        with pytest.raises(IndexError):
            c.k_view(2)
        c.audit()


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_reserve_then_local_append_equals_daemon_append(start, request, layout):
    d = start(*SMALL, "--layout", layout)
    with d.client(nsname(request)) as c:
        L = c.pool_info.num_layers
        # a shared prefix so the Reserve path has a copy-on-write copy to run
        prefix, _ = staging_rows(c, 3, seed=3)
        _, srcp = staging_rows(c, 3, seed=3)
        for s in (100, 200):
            c.append([s], [3], source=srcp)
        c.fork(200, 201)
        rows, src = staging_rows(c, 6, seed=4)
        # the daemon appends to sequence 100, the worker reserves for 201 and appends itself
        ta = c.append([100], [6], source=src)
        tr = c.reserve([201], [6])
        assert tr.copies.shape == (1, 2)  # the shared partial page of the fork
        c.apply_copies(tr)
        bi, pos = kvpool.get_batch_indices_positions(tr.append_indptr, tr.seq_lens, tr.nnz)
        assert pos.tolist() == [3, 4, 5, 6, 7, 8]
        for layer in range(L):
            kvpool.append_paged_kv_cache(rows[layer, 0], rows[layer, 1], bi, pos,
                                         c.paged_kv_cache(layer), tr.kv_indices, tr.kv_indptr,
                                         tr.kv_last_page_len, kv_layout=layout.upper())
        assert ta.seq_lens.tolist() == tr.seq_lens.tolist() == [9]
        assert ta.kv_last_page_len.tolist() == tr.kv_last_page_len.tolist()
        for layer in range(L):
            for view in (c.k_view(layer), c.v_view(layer)):
                a = view[ta.kv_indices].tobytes()
                r = view[tr.kv_indices].tobytes()
                assert a == r
        # the parent 200 kept its own last page untouched by 201's appends
        p200 = c.page_table([200])
        src_page = int(tr.copies[0, 0])
        assert src_page == int(p200.kv_indices[-1])
        np.testing.assert_array_equal(read_row(c.k_view(0), layout, src_page, 2), prefix[0, 0, 2])
        c.audit()


def test_staging_and_release_frees_pages(small, request):
    with small.client(nsname(request)) as c:
        rows, src = staging_rows(c, 9, seed=5)
        free0 = c.stats().free_pages
        t = c.append([1, 2, 3], [4, 4, 1], source=src)
        assert t.kv_indptr.tolist() == [0, 1, 2, 3]
        s = c.stats()
        assert s.free_pages == free0 - 3 and s.num_tokens == 9
        assert s.append_bytes_total == rows.nbytes
        assert c.release([1, 2, 3]) == 3
        assert c.stats().free_pages == free0
        c.unregister_buffer(src["buffer_id"])
        with pytest.raises(kvpool.NotFound):
            c.append([1], [1], source=src)
        bufs = [c.alloc_staging(4096) for _ in range(3)]
        assert len({b for _, b in bufs}) == 3


def test_no_map_pool_and_cuda_views(small, request):
    with small.client(nsname(request), map_pool=False) as c:
        assert c.pool_info.num_pages == 64
        with pytest.raises(kvpool.FailedPrecondition):
            c.k_view(0)
    with small.client(nsname(request)) as c:
        object.__setattr__(c._info, "backend", 1)  # as a cuda pool would describe itself
        try:
            import torch  # noqa: F401
        except ImportError:  # CI: the cuda pool's views need PyTorch, said plainly
            with pytest.raises(ImportError, match="install torch"):
                c.k_view(0)
        else:  # the daemon's pool is a host pool: libkvpool refuses to map it as CUDA memory
            with pytest.raises(kvpool.FailedPrecondition):
                c.k_view(0)


# ---- the NumPy append (no daemon) ------------------------------------------------------------

@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_paged_kv_cache_numpy(layout):
    P, ps, H, D = 8, 4, 2, 3
    shape = (P, ps, H, D) if layout == "NHD" else (P, H, ps, D)
    comb = np.zeros((P, 2) + shape[1:], np.float16)
    k, v = np.zeros(shape, np.float16), np.zeros(shape, np.float16)
    # two requests: 5 tokens on pages [3, 6] (all new), 2 tokens appended after 3 old on [1, 4]
    kv_indptr, kv_indices, last = [0, 2, 4], [3, 6, 1, 4], [1, 1]
    seq_lens = kvpool.get_seq_lens(kv_indptr, last, ps)
    assert seq_lens.tolist() == [5, 5]
    bi, pos = kvpool.get_batch_indices_positions([0, 5, 7], seq_lens, 8)  # one padding entry
    assert bi.tolist() == [0] * 5 + [1] * 2 + [-1] and pos.tolist() == [0, 1, 2, 3, 4, 3, 4, 0]
    key = np.arange(8 * H * D, dtype=np.float16).reshape(8, H, D)
    val = -key
    kvpool.append_paged_kv_cache(key, val, bi, pos, comb, kv_indices, kv_indptr, last, layout)
    kvpool.append_paged_kv_cache(key, val, bi, pos, (k, v), kv_indices, kv_indptr, last, layout)
    np.testing.assert_array_equal(comb[:, 0], k)
    np.testing.assert_array_equal(comb[:, 1], v)

    def row(a, page, slot):
        return a[page, slot] if layout == "NHD" else a[page, :, slot]

    np.testing.assert_array_equal(row(k, 3, 0), key[0])
    np.testing.assert_array_equal(row(k, 6, 0), key[4])
    np.testing.assert_array_equal(row(v, 1, 3), val[5])
    np.testing.assert_array_equal(row(v, 4, 0), val[6])
    assert np.count_nonzero(k) == 7 * H * D - 1  # 7 rows written (key[0] has one zero)
    # guards: all checks before any write
    before = k.copy()
    bad = pos.copy()
    bad[1] = 5  # outside request 0's 5 tokens
    with pytest.raises(IndexError):
        kvpool.append_paged_kv_cache(key + 1, val, bi, bad, (k, v), kv_indices, kv_indptr, last,
                                     layout)
    np.testing.assert_array_equal(k, before)
    with pytest.raises(TypeError):
        kvpool.append_paged_kv_cache(key.astype(np.float32), val, bi, pos, (k, v), kv_indices,
                                     kv_indptr, last, layout)
    kvpool.append_paged_kv_cache(key[:0], val[:0], bi[:0], pos[:0], (k, v), kv_indices,
                                 kv_indptr, last, layout)  # nnz 0: no-op
    np.testing.assert_array_equal(k, before)


# ---- transfers (the cuda backend moves the data; here every check before that) -------------

def test_transfers_validated_then_unavailable_on_the_host_backend(small, request):
    c = small.client(nsname(request))
    assert c.list_transfers() == []
    c.reserve([1, 2], [5, 3])
    before = c.stats()
    with pytest.raises(kvpool.Unavailable, match="cuda backend"):
        c.export_begin(1, "decode-0")
    with pytest.raises(kvpool.Unavailable, match="cuda backend"):
        c.export_begin([1, 2], "decode-0")  # a set: validated, then refused here
    with pytest.raises(kvpool.InvalidArgument, match="named twice"):
        c.export_begin([1, 1], "decode-0")
    with pytest.raises(kvpool.NotFound, match="no sequence 9"):
        c.export_begin([1, 9], "decode-0")
    with pytest.raises(kvpool.InvalidArgument, match="a set of 65"):
        c.export_begin(list(range(100, 165)), "decode-0")
    per_token = 2 * 2 * 2 * 16 * 4  # layers x K,V x heads x head_dim x fp32
    t = kvpool.Ticket(nccl_id=bytes(128), transfer_id=99, num_tokens=8, num_layers=2,
                      bytes=8 * per_token, seq_tokens=(5, 3), chunk_bytes=1024, flags=0)
    assert t.num_seqs == 2
    with pytest.raises(kvpool.Unavailable, match="cuda backend"):
        c.import_transfer(t, [20, 21])  # every field passed the daemon's checks
    with pytest.raises(kvpool.Unavailable, match="cuda backend"):
        c.import_transfer(t.to_bytes(), [20, 21])  # as carried between engines
    with pytest.raises(kvpool.InvalidArgument, match="named twice"):
        c.import_transfer(t, [20, 20])
    with pytest.raises(kvpool.AlreadyExists, match="sequence 2 already exists"):
        c.import_transfer(t, [20, 2])
    with pytest.raises(ValueError, match="1 seq_ids for a ticket of 2"):
        c.import_transfer(t, [20])
    bad = dataclasses.replace(t, chunk_bytes=100)
    with pytest.raises(kvpool.InvalidArgument, match="chunk_bytes 100"):
        c.import_transfer(bad, [20, 21])
    bad = dataclasses.replace(t, seq_tokens=(5, 4))  # 9, not num_tokens 8
    with pytest.raises(kvpool.InvalidArgument, match="seq_tokens"):
        c.import_transfer(bad, [20, 21])
    bad = dataclasses.replace(t, num_layers=3)
    with pytest.raises(kvpool.InvalidArgument, match="num_layers 3"):
        c.import_transfer(bad, [20, 21])
    one = dataclasses.replace(t, num_tokens=5, bytes=5 * per_token, seq_tokens=(5,))
    with pytest.raises(kvpool.Unavailable, match="cuda backend"):
        c.import_transfer(one, 30)
    with pytest.raises(kvpool.AlreadyExists):
        c.import_transfer(one, 1)
    after = c.stats()  # nothing changed
    assert (after.used_pages, after.num_seqs, after.num_tokens) == \
        (before.used_pages, before.num_seqs, before.num_tokens)
    assert c.list_transfers() == []
    c.audit()
    c.close()


def test_ticket_bytes_round_trip():
    t = kvpool.Ticket(nccl_id=bytes(range(128)), transfer_id=2**63 + 5, num_tokens=300,
                      num_layers=32, bytes=123456789012, seq_tokens=(100, 1, 199),
                      chunk_bytes=256 << 20, flags=1)
    b = t.to_bytes()
    assert len(b) == 4 + 4 + 128 + 8 + 4 + 4 + 8 + 4 + 4 + 4 + 3 * 4
    assert kvpool.Ticket.from_bytes(b) == t
    with pytest.raises(ValueError, match="not a kvpool ticket"):
        kvpool.Ticket.from_bytes(b"XXXX" + b[4:])
    with pytest.raises(ValueError, match="naming 3 sequences"):
        kvpool.Ticket.from_bytes(b[:-1])
    with pytest.raises(ValueError, match="at least"):
        kvpool.Ticket.from_bytes(b[:10])
