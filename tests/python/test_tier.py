# SPDX-License-Identifier: Apache-2.0
"""The prefix cache's host tier (issue #28) through the Python package, against real kvpoold
processes on the host backend: lookup_tiers() and load() round trips (a prompt appended with
its token ids from a registered memfd, the pool filled until the demoter moves its pages to
host memory, then found there and loaded back into a writable buffer byte for byte), the
cache's host figures in cache_stats() and in kvpoolctl's `cache` and `status`, and what bad
input gets (the error type, and nothing written or changed). Needs numpy and pytest;
tests/python/run.sh sets everything up."""
import ctypes
import dataclasses
import fcntl
import json
import os
import subprocess

import numpy as np
import pytest

from conftest import BUILD, kvpool, wait_for  # noqa: E402  (conftest puts the package on sys.path)

# 2 layers x 64 pages x 4 tokens x 2 heads x 16 dims, fp32: a page (every layer, K and V) is
# 2 * 2 * 4 * 2 * 16 * 4 = 2048 bytes, the size of one host slot.
GEOM = ["--num-pages", "64", "--page-size", "4", "--num-layers", "2", "--num-kv-heads", "2",
        "--head-dim", "16", "--dtype", "fp32"]
SLOT_BYTES = 2048
HOST_BYTES = 32 * SLOT_BYTES  # 32 host slots
# the demoter keeps half the pool's pages (32) free once the pool is under pressure
TIER = ["--set", "cache.host_bytes=%d" % HOST_BYTES, "--set", "cache.demote_free_pct=50"]
KVPOOLCTL = os.path.join(BUILD, "client", "kvpoolctl")

PROMPT = list(range(5000, 5032))  # 32 token ids: 8 full pages
OTHER = list(range(7000, 7032))  # never appended



def staging_rows(c, nnz, seed):
    """A staging buffer holding K and V for every layer, [L][2][nnz][H][D] of the pool's dtype
    (random values), and the source dict that describes it (test_kvpool.py's layout)."""
    i = c.pool_info
    rows = np.random.default_rng(seed).standard_normal(
        (i.num_layers, 2, nnz, i.heads_per_device, i.head_dim)).astype(i.numpy_dtype)
    buf, bid = c.alloc_staging(rows.nbytes)
    buf[:] = rows.reshape(-1).view(np.uint8)
    return rows, layout_of(rows, bid)


def layout_of(rows, bid):
    kv_bytes = rows[0, 0].nbytes
    return dict(buffer_id=bid, k_offset=0, v_offset=kv_bytes, layer_stride=2 * kv_bytes)


def sentinel_buffer(c, nbytes):
    """A writable staging buffer filled with 0xA5 bytes, and its id."""
    buf, bid = c.alloc_staging(nbytes)
    buf[:] = 0xA5
    return buf, bid


def fill_and_demote(c, rows_seed=1):
    """Appends PROMPT (token ids, from a registered memfd) as sequence 1 and releases it (its 8
    pages cached on the GPU), then reserves 50 pages as sequence 2 so the pool's free pages fall
    to 6, under the demoter's 32: it moves the 8 cached pages to host memory. Returns the rows
    appended."""
    rows, src = staging_rows(c, len(PROMPT), seed=rows_seed)
    t = c.append([1], [len(PROMPT)], source=src, token_ids=PROMPT)
    assert t.seq_lens.tolist() == [32]
    assert c.release([1]) == 1
    assert c.lookup_tiers([PROMPT]) == [kvpool.TierHit(32, 0)]  # 56 pages free: no pressure
    c.reserve([2], [200])  # 50 pages, no token ids
    wait_for("8 pages demoted", lambda: (lambda s: s.host_pages == 8 and s.demoting == 0)(
        c.cache_stats()))
    return rows


@pytest.fixture
def tier(start):
    d = start(*GEOM, *TIER)
    with d.client("tier", lease_ms=0) as c:
        # the tier is allocated in the background, and the cache takes the slots ready on the
        # daemon's next tick: every slot before the pressure
        wait_for("the host tier ready", lambda: (lambda s: (s.host_bytes_ready, s.host_slots))(
            c.cache_stats()) == (HOST_BYTES, 32))
    return d


def ctl(d, *args):
    out = subprocess.run([KVPOOLCTL, "-s", d.sock] + list(args), capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


# ---- no daemon -------------------------------------------------------------------------------

def test_the_mirrors_have_the_c_sizes_and_the_records_their_fields():
    from kvpool import _lib
    lib = _lib.load()
    for name in ("kvp_load_t", "kvp_cache_stats_t"):
        assert lib.kvp_client_sizeof(name.encode()) == ctypes.sizeof(getattr(_lib, name)), name
    assert ctypes.sizeof(_lib.kvp_load_t) == 12
    # every member of the C struct reaches the record, the host tier's last
    names = [f[0] for f in _lib.kvp_cache_stats_t._fields_]
    assert names[-15:] == [
        "host_pages", "host_slots", "host_bytes_total", "host_bytes_ready",
        "host_hit_tokens_total", "demotions_total", "promotions_total", "host_evictions_total",
        "offload_bytes_total", "restore_bytes_total", "offload_us_total", "restore_us_total",
        "demoting", "restoring", "host_slot_bytes"]
    assert [f.name for f in dataclasses.fields(kvpool.CacheStats)] == names
    assert kvpool.TierHit(16, 8).total == 24
    assert kvpool.Load(8, 4, True) == (8, 4, True)


# ---- against a daemon with a host tier -------------------------------------------------------

def test_pages_demoted_under_pressure_are_found_and_loaded_back_exactly(tier):
    with tier.client("tier") as c:
        s0 = c.cache_stats()
        assert (s0.host_bytes_total, s0.host_slot_bytes, s0.host_slots) == \
            (HOST_BYTES, SLOT_BYTES, 32)
        assert (s0.host_pages, s0.demotions_total, s0.promotions_total) == (0, 0, 0)
        rows = fill_and_demote(c)

        # found in host memory only; the plain lookup sees the GPU part (none)
        assert c.lookup_tiers([PROMPT, OTHER, PROMPT[:10]]) == [
            kvpool.TierHit(0, 32), kvpool.TierHit(0, 0), kvpool.TierHit(0, 8)]
        assert c.lookup([PROMPT]) == [0]
        s1 = c.cache_stats()
        assert (s1.host_pages, s1.demotions_total, s1.offload_bytes_total) == \
            (8, 8, 8 * SLOT_BYTES)
        assert s1.promotions_total == 0

        # no more pressure; load() restores the pages and copies them out where an append with
        # the same layout reads: every byte of the buffer is the rows appended
        assert c.release([2]) == 1
        buf, bid = sentinel_buffer(c, rows.nbytes)
        got = c.load(PROMPT, layout_of(rows, bid))
        assert got == kvpool.Load(32, 32, True)
        np.testing.assert_array_equal(buf, rows.reshape(-1).view(np.uint8))
        s2 = c.cache_stats()
        assert (s2.promotions_total, s2.restore_bytes_total) == (8, 8 * SLOT_BYTES)
        assert c.stats().num_seqs == 0  # the load's transient sequence is gone

        # hot again: on the GPU; a capped load of the same prompt copies 2 pages, from there
        assert c.lookup_tiers([PROMPT]) == [kvpool.TierHit(32, 0)]
        buf2, bid2 = sentinel_buffer(c, rows.nbytes)
        assert c.load(PROMPT, layout_of(rows, bid2), max_tokens=10) == kvpool.Load(8, 0, True)
        # [L][K|V][token][bytes of a row]: tokens 0..7 written, the rest untouched
        want = np.full(rows.nbytes, 0xA5, np.uint8).reshape(rows.shape[:3] + (-1,))
        want[:, :, :8] = np.ascontiguousarray(rows[:, :, :8]).view(np.uint8).reshape(
            rows.shape[:2] + (8, -1))
        np.testing.assert_array_equal(buf2, want.reshape(-1))
        c.audit()


def test_kvpoolctl_shows_the_host_tier(tier):
    with tier.client("tier") as c:
        fill_and_demote(c)
        s = c.cache_stats()
        out = ctl(tier, "status")
        assert "\nhost tier    64.0 KiB of 64.0 KiB pinned, 8 pages\n" in out
        st = json.loads(ctl(tier, "status", "--json"))["host_tier"]
        assert st == {"enabled": True, "bytes_total": HOST_BYTES, "bytes_ready": HOST_BYTES,
                      "pages": 8, "slots": 32}
        text = ctl(tier, "cache")
        assert "\nhost tier    8 pages in 32 usable slots of 2.0 KiB; 64.0 KiB of 64.0 KiB " \
               "ready\n" in text
        assert "\nhost moves   8 demoted, 0 promoted, 0 evicted; 0 demoting, 0 restoring\n" in text
        assert "\noffload      0.000 GB at " in text
        h = json.loads(ctl(tier, "cache", "--json"))["host"]
        assert {k: h[k] for k in ("enabled", "pages", "slots", "slot_bytes", "bytes_total",
                                  "bytes_ready", "demotions_total", "promotions_total",
                                  "evictions_total", "demoting", "restoring")} == {
            "enabled": True, "pages": 8, "slots": 32, "slot_bytes": SLOT_BYTES,
            "bytes_total": HOST_BYTES, "bytes_ready": HOST_BYTES, "demotions_total": 8,
            "promotions_total": 0, "evictions_total": 0, "demoting": 0, "restoring": 0}
        assert h["offload"]["bytes_total"] == 8 * SLOT_BYTES == s.offload_bytes_total
        assert h["offload"]["us_total"] == s.offload_us_total
        assert h["restore"] == {"bytes_total": 0, "us_total": 0, "gb_total": 0.0,
                                "gb_per_s": None}
        assert h["hit_tokens_total"] == s.host_hit_tokens_total


def test_bad_loads_are_refused_and_change_nothing(tier):
    with tier.client("tier") as c:
        rows = fill_and_demote(c)
        before = c.cache_stats()
        used = c.stats().used_pages
        nbytes = rows.nbytes
        buf, bid = sentinel_buffer(c, nbytes)
        dest = layout_of(rows, bid)

        def unchanged():
            assert (buf == 0xA5).all()
            s = c.cache_stats()
            assert (s.host_pages, s.demotions_total, s.promotions_total) == \
                (before.host_pages, before.demotions_total, before.promotions_total)
            assert c.stats().used_pages == used
            assert c.stats().num_seqs == 1  # sequence 2 only
            assert c.lookup_tiers([PROMPT]) == [kvpool.TierHit(0, 32)]

        # a prompt nothing of which is cached; a salt makes another prompt
        with pytest.raises(kvpool.NotFound, match="no page of the prompt is cached"):
            c.load(OTHER, dest)
        with pytest.raises(kvpool.NotFound):
            c.load(PROMPT, dest, salt=b"tenant-2")
        unchanged()
        # a buffer too small for the 32 tokens: refused before anything is restored
        small, sbid = sentinel_buffer(c, nbytes - 4)
        with pytest.raises(kvpool.InvalidArgument):
            c.load(PROMPT, layout_of(rows, sbid))
        assert (small == 0xA5).all()
        unchanged()
        # a buffer the daemon cannot write: a memfd sealed against writes
        fd = os.memfd_create("kvpool-ro", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            os.pwrite(fd, b"\xa5" * nbytes, 0)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
            ro = c.register_fd(fd, nbytes)
            with pytest.raises(kvpool.FailedPrecondition, match="read-only"):
                c.load(PROMPT, layout_of(rows, ro))
            assert os.pread(fd, nbytes, 0) == b"\xa5" * nbytes
        finally:
            os.close(fd)
        # a buffer this connection did not register
        with pytest.raises(kvpool.NotFound, match="no buffer"):
            c.load(PROMPT, dict(dest, buffer_id=999))
        # refused by the package or libkvpool before anything is sent
        with pytest.raises(ValueError, match="source needs"):
            c.load(PROMPT, dict(buffer_id=bid))
        with pytest.raises(kvpool.InvalidArgument, match="salt of 257 bytes"):
            c.load(PROMPT, dest, salt=b"s" * 257)
        unchanged()
        # and the prompt still loads whole afterwards
        assert c.load(PROMPT, dest) == kvpool.Load(32, 32, True)
        np.testing.assert_array_equal(buf, rows.reshape(-1).view(np.uint8))


# ---- a daemon without one --------------------------------------------------------------------

def test_without_a_host_tier_lookup_tiers_answers_zeros_and_load_reads_the_gpu(start):
    d = start(*GEOM)
    with d.client("plain") as c:
        s = c.cache_stats()
        assert (s.host_bytes_total, s.host_slots, s.host_slot_bytes, s.host_pages) == (0, 0, 0, 0)
        rows, src = staging_rows(c, len(PROMPT), seed=3)
        c.append([1], [len(PROMPT)], source=src, token_ids=PROMPT)
        assert c.lookup_tiers([PROMPT, OTHER]) == [kvpool.TierHit(32, 0), kvpool.TierHit(0, 0)]
        buf, bid = sentinel_buffer(c, rows.nbytes)
        assert c.load(PROMPT, layout_of(rows, bid)) == kvpool.Load(32, 0, True)
        np.testing.assert_array_equal(buf, rows.reshape(-1).view(np.uint8))
        assert "host tier    none (cache.host_bytes is 0)\n" in ctl(d, "cache")
        assert "host tier" not in ctl(d, "status")
        assert json.loads(ctl(d, "status", "--json"))["host_tier"]["enabled"] is False
