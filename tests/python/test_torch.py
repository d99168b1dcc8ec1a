# SPDX-License-Identifier: Apache-2.0
"""The PyTorch side of the kvpool package (kvpool._torch) against real kvpoold processes.

Needs PyTorch: skipped without it (CI installs it: tests/python/run.sh --torch runs the tests
here that need no GPU). The cuda tests need a GPU and are skipped without one; on the H200 they run
from tests/gpu/run_device.sh (python), like the other GPU tests:
  - client/python/examples/worker_loop_torch.py on the cuda backend in fp16 and bf16, NHD/HND,
    combined/split: Reserve + the CUDA in-process append, daemon Appends from a CUDA staging
    buffer with interprocess events, a fork (copy-on-write) and a truncation, every step
    matching a contiguous-cache run within the half-precision tolerance;
  - pool views are CUDA tensors aliasing the daemon's pool (a daemon Append is visible in
    them), a registered torch tensor (legacy IPC) as the source of a daemon Append, the CUDA
    append's refusal of an out-of-range entry (OutOfRange, nothing written), the page-table
    helpers on the GPU equal to NumPy's;
  - the same worker loop on the host backend in float32 with CPU tensors (1e-5);
  - its shared system prompt (issue #16) on both backends: two worker processes in one cache
    scope, the second reusing the first's system-prompt pages (commit with an interprocess
    event on cuda) and computing only the rest, equal to a full contiguous run;
  - the fused append (kvp_client_cuda_append_fused, kvpool._torch.append_paged_kv_cache_fused)
    byte for byte equal to the checked append and to NumPy's (decode and prefill, NHD/HND,
    fp16/bf16, page sizes 16 and 1, combined/split, with and without PDL, on an explicit
    stream), captured in a CUDA graph and replayed with new page tables (also on a daemon's
    pool with a Reserve a step), its refusals and its err word. Two of its tests (the C
    entry's argument checks through ctypes, the refusal of CPU tensors) need no GPU.
"""
import importlib.util
import os

import numpy as np
import pytest

from conftest import ROOT, kvpool  # noqa: E402

torch = pytest.importorskip("torch")

EXAMPLE = os.path.join(ROOT, "client", "python", "examples", "worker_loop_torch.py")
spec = importlib.util.spec_from_file_location("kvpool_worker_loop_torch", EXAMPLE)
wlt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wlt)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


def geometry(dtype, layout="nhd", storage="combined", backend="cuda"):
    return ["--backend", backend, "--num-layers", "2", "--num-kv-heads", str(wlt.NUM_KV_HEADS),
            "--head-dim", str(wlt.HEAD_DIM), "--dtype", dtype, "--page-size", "4",
            "--num-pages", "256", "--layout", layout, "--storage", storage]


def check_run(c, st, steps):
    assert st["steps"] == steps and st["forks"] == 1 and st["truncates"] == 1
    assert st["daemon_appends"] == steps // 4 and st["reserve_steps"] == steps + 1 - steps // 4
    assert st["cow_copies"] >= 1
    assert st["max_err"] <= wlt.TOLERANCES[wlt.DTYPES[st["dtype"]]]
    c.audit()
    s = c.stats()
    assert s.num_seqs == len(st["seqs"]) and s.num_tokens == st["tokens"]
    assert c.release(st["seqs"]) == len(st["seqs"])
    c.audit()
    assert c.stats().used_pages == 0


@needs_gpu
@pytest.mark.parametrize("dtype,layout,storage", [
    ("fp16", "nhd", "combined"), ("bf16", "hnd", "split"), ("fp16", "hnd", "split"),
    ("bf16", "nhd", "combined")])
def test_worker_loop_torch_cuda(start, dtype, layout, storage):
    d = start(*geometry(dtype, layout, storage))
    with d.client("wlt-%s-%s-%s" % (dtype, layout, storage)) as c:
        assert c.pool_info.backend_name == "cuda"
        st = wlt.run(c, steps=24, seed=0)
        assert st["backend"] == "cuda" and st["dtype"] == dtype
        print("\nworker_loop_torch cuda %s %s %s: max err %.3g over %d steps, %d daemon Appends, "
              "%d copy-on-write copies" % (dtype, layout, storage, st["max_err"], st["steps"],
                                           st["daemon_appends"], st["cow_copies"]))
        check_run(c, st, 24)


def test_worker_loop_torch_host_fp32(start):
    d = start(*geometry("fp32", backend="host"))
    with d.client("wlt-host") as c:
        st = wlt.run(c, steps=12, seed=3)
        assert st["backend"] == "host" and st["max_err"] <= 1e-5
        check_run(c, st, 12)


def check_shared_prompt(d, dtype, backend, page_size):
    """worker_loop_torch's shared system prompt: two worker processes (one scope, two
    namespaces); the second links exactly the system prompt's full pages, the first's very
    pages and bytes, and computes only the rest, matching a full contiguous run."""
    r1, r2 = wlt.shared_prompt(d.sock, seed=0, namespaces=("wlt-s1", "wlt-s2"))
    S = wlt.worker_loop.SYSTEM_LEN
    cached = S // page_size * page_size
    k = cached // page_size
    assert (r1["prompt_len"], r1["cached"], r1["computed"]) == (44, 0, 44)
    assert (r2["prompt_len"], r2["cached"], r2["computed"]) == (44, cached, 44 - cached)
    assert r2["page_ids"][:k] == r1["page_ids"][:k]
    assert r2["cached_digests"] == r1["prompt_digests"][:k]
    for r in (r1, r2):
        assert (r["backend"], r["dtype"]) == (backend, dtype)
        assert r["max_err"] <= wlt.TOLERANCES[wlt.DTYPES[dtype]] and len(r["decoded"]) == 4
    print("\nworker_loop_torch shared prompt %s %s: worker 1 computed %d tokens, worker 2 "
          "%d (%d cached); max err %.3g, %.3g" % (backend, dtype, r1["computed"],
                                                  r2["computed"], r2["cached"], r1["max_err"],
                                                  r2["max_err"]))
    with d.client("wlt-probe", cache_scope=wlt.worker_loop.SHARED_SCOPE) as c:
        c.audit()
        cs = c.cache_stats()
        assert cs.cached_pages == cs.indexed_pages == 2 * (48 // page_size) - k


def test_worker_loop_torch_shared_prompt_host_fp32(start):
    d = start(*geometry("fp32", backend="host"))
    check_shared_prompt(d, "fp32", "host", 4)


@needs_gpu
@pytest.mark.parametrize("dtype,layout", [("fp16", "nhd"), ("bf16", "hnd")])
def test_worker_loop_torch_shared_prompt_cuda(start, dtype, layout):
    d = start(*geometry(dtype, layout))
    check_shared_prompt(d, dtype, "cuda", 4)


@needs_gpu
def test_cuda_views_ipc_tensor_and_refusals(start):
    d = start(*geometry("fp16"))
    with d.client("views") as c:
        info = c.pool_info
        k0 = c.k_view(0)
        assert k0.is_cuda and k0.dtype == torch.float16
        assert tuple(k0.shape) == (info.num_pages, info.page_size, info.heads_per_device,
                                   info.head_dim)
        pool = c.pool_bytes_view()
        assert pool.numel() == info.pool_bytes and pool.data_ptr() == k0.data_ptr()
        assert c.v_view(1).data_ptr() == pool.data_ptr() + info.layer_bytes + info.v_offset_bytes
        comb = c.paged_kv_cache(1)
        assert tuple(comb.shape)[:2] == (info.num_pages, 2)
        assert torch.equal(comb[:, 1], c.v_view(1)) and torch.equal(comb[:, 0], c.k_view(1))

        # a torch tensor registered through a legacy IPC handle feeds a daemon Append
        H, D = info.heads_per_device, info.head_dim
        n = 3
        src = (torch.arange(2 * n * H * D, device="cuda", dtype=torch.float32) % 251 - 125) \
            .to(torch.float16).view(2, n, H, D).contiguous()
        bid = c.register_tensor(src)
        row = H * D * 2
        t = c.append([1, 2, 3], 1, source=dict(buffer_id=bid, k_offset=0, v_offset=n * row,
                                                layer_begin=0, layer_end=1))
        assert t.seq_lens.tolist() == [1, 1, 1] and t.kv_last_page_len.tolist() == [1, 1, 1]
        for b in range(n):  # visible through the views: they alias the daemon's pool
            page = int(t.kv_indices[t.kv_indptr[b]])
            assert torch.equal(c.k_view(0)[page, 0], src[0, b])
            assert torch.equal(c.v_view(0)[page, 0], src[1, b])
        c.unregister_buffer(bid)

        # the page-table helpers on the GPU equal NumPy's
        ip = torch.tensor([0, 2, 3, 3], dtype=torch.int32, device="cuda")
        last = torch.tensor([3, 4, 1], dtype=torch.int32, device="cuda")
        lens = kvpool.get_seq_lens(ip, last, 4)
        assert lens.is_cuda and lens.tolist() == kvpool.get_seq_lens(
            ip.cpu().numpy(), last.cpu().numpy(), 4).tolist() == [7, 4, 0]
        aip = torch.tensor([0, 2, 3, 3], dtype=torch.int32, device="cuda")
        bi, pos = kvpool.get_batch_indices_positions(aip, lens, 4)
        nbi, npos = kvpool.get_batch_indices_positions(aip.cpu().numpy(), lens.cpu().numpy(), 4)
        assert bi.tolist() == nbi.tolist() == [0, 0, 1, -1]
        assert pos.tolist() == npos.tolist() == [5, 6, 3, 0]

        # the CUDA append refuses an out-of-range position and writes nothing at all
        tr = c.reserve([7, 8], [2, 1])
        td = {k: torch.from_numpy(getattr(tr, k)).cuda()
              for k in ("kv_indptr", "kv_indices", "kv_last_page_len", "append_indptr",
                        "seq_lens")}
        key = torch.ones(3, H, D, dtype=torch.float16, device="cuda")
        bi, pos = kvpool.get_batch_indices_positions(td["append_indptr"], td["seq_lens"], 3)
        before = c.pool_bytes_view().clone()
        bad = pos.clone()
        bad[2] = 5  # sequence 8 has 1 token
        with pytest.raises(kvpool.OutOfRange):
            kvpool.append_paged_kv_cache(key, key, bi, bad, c.paged_kv_cache(0), td["kv_indices"],
                                         td["kv_indptr"], td["kv_last_page_len"], check=True)
        assert torch.equal(c.pool_bytes_view(), before)
        kvpool.append_paged_kv_cache(key, -key, bi, pos, c.paged_kv_cache(0), td["kv_indices"],
                                     td["kv_indptr"], td["kv_last_page_len"], check=True)
        for b, p in ((0, 0), (0, 1), (1, 0)):
            page = int(tr.kv_indices[tr.kv_indptr[b] + p // info.page_size])
            assert torch.equal(c.k_view(0)[page, p % info.page_size], key[0])
            assert torch.equal(c.v_view(0)[page, p % info.page_size], -key[0])
        with pytest.raises(TypeError):  # a pure copy: no conversion
            kvpool.append_paged_kv_cache(key.float(), key.float(), bi, pos, c.paged_kv_cache(0),
                                         td["kv_indices"], td["kv_indptr"],
                                         td["kv_last_page_len"])
        c.release([1, 2, 3, 7, 8])
        c.audit()
        del k0, pool, comb


# ---- the fused append (kvp_client_cuda_append_fused) from PyTorch ---------------------------
# Compared byte for byte with the checked append on the GPU and with the NumPy append on the
# CPU, on plain torch caches (no daemon) and on a daemon's pool; captured in a CUDA graph and
# replayed with new page tables written into the same tensors.

import ctypes  # noqa: E402

from kvpool import _lib as kvp_lib  # noqa: E402
from kvpool import _torch as kvp_torch  # noqa: E402
from kvpool.errors import KVP_EINVAL, KVP_ERANGE  # noqa: E402

FUSED_HEADS, FUSED_DIM = 4, 64


def make_table(before, append, page_size, num_pages, gen):
    """A random page table (int32 NumPy arrays) for requests of `before` tokens growing by
    `append`: distinct random pages, the table counting the appended tokens."""
    seq = [b + a for b, a in zip(before, append)]
    npages = [(s + page_size - 1) // page_size for s in seq]
    perm = gen.permutation(num_pages)[:sum(npages)]
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.array([s - (n - 1) * page_size if n else 0 for s, n in zip(seq, npages)],
                    dtype=np.int32)
    aip = np.concatenate([[0], np.cumsum(append)]).astype(np.int32)
    return dict(kv_indices=perm.astype(np.int32), kv_indptr=indptr, kv_last_page_len=last,
                append_indptr=aip, seq_lens=np.array(seq, dtype=np.int32))


def rows(n, dtype, device, heads=FUSED_HEADS, dim=FUSED_DIM):
    """[n, heads, dim] of values that are never zero (so written rows can be counted)."""
    x = torch.randint(1, 200, (n, heads, dim), device=device).float() / 8
    sign = torch.randint(0, 2, (n, heads, dim), device=device).float() * 2 - 1
    return (x * sign).to(dtype)


def make_cache(num_pages, page_size, layout, dtype, device, split):
    shape = (num_pages, page_size, FUSED_HEADS, FUSED_DIM) if layout == "NHD" else \
        (num_pages, FUSED_HEADS, page_size, FUSED_DIM)
    if split:
        return (torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device))
    return torch.zeros((num_pages, 2) + shape[1:], dtype=dtype, device=device)


def cache_bytes(cache):
    """The cache's raw bits (int16: no NaN comparisons), K and V side by side."""
    parts = cache if isinstance(cache, tuple) else (cache,)
    return torch.cat([p.reshape(-1).view(torch.int16).cpu() for p in parts])


def checked_reference(key, value, tab, cache, layout):
    """The checked GPU append and the NumPy append of the same rows (both must agree)."""
    dev = key.device
    td = {k: torch.from_numpy(v).to(dev) for k, v in tab.items()}
    bi, pos = kvpool.get_batch_indices_positions(td["append_indptr"], td["seq_lens"],
                                                 key.shape[0])
    kvpool.append_paged_kv_cache(key, value, bi, pos, cache, td["kv_indices"], td["kv_indptr"],
                                 td["kv_last_page_len"], kv_layout=layout, check=True)
    cpu = tuple(c.cpu() for c in cache) if isinstance(cache, tuple) else cache.cpu()
    nbi, npos = kvpool.get_batch_indices_positions(tab["append_indptr"], tab["seq_lens"],
                                                   key.shape[0])
    return cpu, (key.cpu(), value.cpu(), nbi, npos, tab["kv_indices"], tab["kv_indptr"],
                 tab["kv_last_page_len"])


BATCHES = {
    "decode": ([0, 3, 15, 16, 17, 40, 1, 100], [1] * 8),
    "prefill": ([0, 5, 0, 17], [7, 33, 100, 1]),
}


@needs_gpu
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("pdl", [False, True])
def test_fused_append_equals_checked_and_numpy(batch, layout, dtype, page_size, pdl):
    dev = torch.device("cuda", 0)
    gen = np.random.default_rng(page_size * 7 + len(batch))
    before, append = BATCHES[batch]
    num_pages = 400 if page_size == 1 else 64
    tab = make_table(before, append, page_size, num_pages, gen)
    nnz = sum(append)
    torch.manual_seed(0)
    x = torch.stack([rows(nnz, torch.float32, dev), rows(nnz, torch.float32, dev)])
    for split in (False, True):
        ref = make_cache(num_pages, page_size, layout, dtype, dev, split)
        out = make_cache(num_pages, page_size, layout, dtype, dev, split)
        key, value = (x[0] * 3).to(dtype), (-x[1]).to(dtype)
        ref_cpu, np_args = checked_reference(key, value, tab, ref, layout)
        td = {k: torch.from_numpy(v).to(dev) for k, v in tab.items()}
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):  # the sources made by the kernel just before (PDL's case)
            k2, v2 = (x[0] * 3).to(dtype), (-x[1]).to(dtype)
        err = torch.zeros(1, dtype=torch.int32, device=dev)
        kvp_torch.append_paged_kv_cache_fused(k2, v2, td["append_indptr"], out, td["kv_indices"],
                                              td["kv_indptr"], td["kv_last_page_len"],
                                              kv_layout=layout, err=err, stream=s, pdl=pdl)
        s.synchronize()
        assert int(err.item()) == 0
        assert torch.equal(cache_bytes(out), cache_bytes(ref))
        # the NumPy append on the CPU writes the same bytes
        cpu = make_cache(num_pages, page_size, layout, dtype, "cpu", split)
        kv_, vv_, nbi, npos, ind, ip, last = np_args
        kvpool.append_paged_kv_cache(kv_, vv_, nbi, npos, cpu, ind, ip, last, kv_layout=layout)
        assert torch.equal(cache_bytes(cpu), cache_bytes(ref_cpu))
        assert torch.count_nonzero(cache_bytes(out)) == 2 * nnz * FUSED_HEADS * FUSED_DIM
        # token 0 of request 1 (position before[1]) is where the page table says
        b, p = 1, before[1]
        page = int(tab["kv_indices"][tab["kv_indptr"][b] + p // page_size])
        kc = out[0] if split else out[:, 0]
        row = kc[page, p % page_size] if layout == "NHD" else kc[page, :, p % page_size]
        assert torch.equal(row, key[int(tab["append_indptr"][b])])


@needs_gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_fused_append_in_a_cuda_graph_replays_new_page_tables(pdl):
    """Captured once, replayed with new tables copied into the same tensors: each replay
    writes exactly what the checked append writes for that table."""
    dev = torch.device("cuda", 0)
    gen = np.random.default_rng(11)
    page_size, num_pages, layout, dtype = 16, 128, "NHD", torch.float16
    B = 8
    nnz = B  # decode
    cap = 64  # kv_indices capacity
    key = torch.zeros(nnz, FUSED_HEADS, FUSED_DIM, dtype=dtype, device=dev)
    value = torch.zeros_like(key)
    st = dict(kv_indices=torch.zeros(cap, dtype=torch.int32, device=dev),
              kv_indptr=torch.zeros(B + 1, dtype=torch.int32, device=dev),
              kv_last_page_len=torch.ones(B, dtype=torch.int32, device=dev),
              append_indptr=torch.arange(B + 1, dtype=torch.int32, device=dev))
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    out = make_cache(num_pages, page_size, layout, dtype, dev, False)

    def step():
        kvp_torch.append_paged_kv_cache_fused(key, value, st["append_indptr"], out,
                                              st["kv_indices"], st["kv_indptr"],
                                              st["kv_last_page_len"], kv_layout=layout, err=err,
                                              pdl=pdl)

    def load(tab):
        n = tab["kv_indices"].size
        st["kv_indices"][:n].copy_(torch.from_numpy(tab["kv_indices"]))
        st["kv_indptr"].copy_(torch.from_numpy(tab["kv_indptr"]))
        st["kv_last_page_len"].copy_(torch.from_numpy(tab["kv_last_page_len"]))

    warm = torch.cuda.Stream(dev)  # PyTorch's warm-up before capture (loads the kernels)
    warm.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(warm):
        load(make_table([0] * B, [1] * B, page_size, num_pages, gen))
        step()
    torch.cuda.current_stream(dev).wait_stream(warm)
    torch.cuda.synchronize(dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for it in range(4):
        before = [int(v) for v in gen.integers(0, 60, size=B)]
        tab = make_table(before, [1] * B, page_size, num_pages, gen)
        assert tab["kv_indices"].size <= cap
        out.zero_()
        load(tab)
        key.copy_(rows(nnz, dtype, dev))
        value.copy_(-key)
        g.replay()
        torch.cuda.synchronize(dev)
        ref = make_cache(num_pages, page_size, layout, dtype, dev, False)
        checked_reference(key, value, tab, ref, layout)
        assert int(err.item()) == 0
        assert torch.equal(cache_bytes(out), cache_bytes(ref)), "replay %d" % it
        assert torch.count_nonzero(cache_bytes(out)) == 2 * nnz * FUSED_HEADS * FUSED_DIM
    # a replay with a page id outside the cache skips that row and reports it in err
    tab = make_table([0] * B, [1] * B, page_size, num_pages, gen)
    tab["kv_indices"][tab["kv_indptr"][3]] = num_pages  # request 3's only page
    out.zero_()
    load(tab)
    g.replay()
    torch.cuda.synchronize(dev)
    assert int(err.item()) == KVP_ERANGE
    assert torch.count_nonzero(cache_bytes(out)) == 2 * (nnz - 1) * FUSED_HEADS * FUSED_DIM


@needs_gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fused_append_states_takes_model_layout(layout):
    """FusedAppend.states: a model's [B, H, T, D] states (a [B, T, H, D] projection transposed)
    appended as they are write what the one-shot fused append writes for the same rows
    gathered to [B * T, H, D]; states whose tokens are not at one stride are refused, nothing
    written."""
    dev = torch.device("cuda", 0)
    gen = np.random.default_rng(21)
    B, T, ps, num_pages, dtype = 3, 5, 16, 64, torch.bfloat16
    tab = make_table([0, 17, 3], [T] * B, ps, num_pages, gen)
    td = {k: torch.from_numpy(v).to(dev) for k, v in tab.items()}
    proj = rows(B * T * 2, dtype, dev).view(2, B, T, FUSED_HEADS, FUSED_DIM)
    ks, vs = proj[0].transpose(1, 2), proj[1].transpose(1, 2)  # [B, H, T, D], not contiguous
    ref = make_cache(num_pages, ps, layout, dtype, dev, True)
    out = make_cache(num_pages, ps, layout, dtype, dev, True)
    kvp_torch.append_paged_kv_cache_fused(
        ks.transpose(1, 2).reshape(B * T, FUSED_HEADS, FUSED_DIM),
        vs.transpose(1, 2).reshape(B * T, FUSED_HEADS, FUSED_DIM), td["append_indptr"], ref,
        td["kv_indices"], td["kv_indptr"], td["kv_last_page_len"], kv_layout=layout,
        check=True)
    op = kvp_torch.FusedAppend(out, td["append_indptr"], td["kv_indices"], td["kv_indptr"],
                               td["kv_last_page_len"], kv_layout=layout)
    with pytest.raises(ValueError):  # [B, H, T, D] contiguous: tokens b*T+t not at one stride
        op.states(ks.contiguous(), vs.contiguous(), *out)
    torch.cuda.synchronize(dev)
    assert torch.count_nonzero(cache_bytes(out)) == 0
    op.states(ks, vs, *out)
    torch.cuda.synchronize(dev)
    assert torch.equal(cache_bytes(out), cache_bytes(ref))
    assert torch.count_nonzero(cache_bytes(out)) == 2 * B * T * FUSED_HEADS * FUSED_DIM
    # a decode step (T == 1) of [B, H, 1, D] contiguous states: stride(2) says nothing there,
    # the tokens lie at stride(0)
    tab = make_table([5, 16, 40], [1] * B, ps, num_pages, gen)
    td = {k: torch.from_numpy(v).to(dev) for k, v in tab.items()}
    kd = rows(B, dtype, dev).view(B, FUSED_HEADS, 1, FUSED_DIM).contiguous()
    vd = (-kd).contiguous()
    ref = make_cache(num_pages, ps, layout, dtype, dev, True)
    out = make_cache(num_pages, ps, layout, dtype, dev, True)
    kvp_torch.append_paged_kv_cache_fused(kd[:, :, 0], vd[:, :, 0], td["append_indptr"], ref,
                                          td["kv_indices"], td["kv_indptr"],
                                          td["kv_last_page_len"], kv_layout=layout, check=True)
    kvp_torch.FusedAppend(out, td["append_indptr"], td["kv_indices"], td["kv_indptr"],
                          td["kv_last_page_len"], kv_layout=layout).states(kd, vd, *out)
    torch.cuda.synchronize(dev)
    assert torch.equal(cache_bytes(out), cache_bytes(ref))
    assert torch.count_nonzero(cache_bytes(out)) == 2 * B * FUSED_HEADS * FUSED_DIM


@needs_gpu
def test_fused_append_refusals_and_check():
    dev = torch.device("cuda", 0)
    gen = np.random.default_rng(5)
    tab = make_table([3, 0], [1, 2], 16, 8, gen)
    td = {k: torch.from_numpy(v).to(dev) for k, v in tab.items()}
    out = make_cache(8, 16, "NHD", torch.float16, dev, False)
    key = torch.ones(3, FUSED_HEADS, FUSED_DIM, dtype=torch.float16, device=dev)
    args = (td["append_indptr"], out, td["kv_indices"], td["kv_indptr"], td["kv_last_page_len"])
    with pytest.raises(TypeError):  # a pure copy: no conversion
        kvp_torch.append_paged_kv_cache_fused(key.float(), key.float(), *args)
    with pytest.raises(TypeError):  # index tensors are never converted
        kvp_torch.append_paged_kv_cache_fused(key, key, td["append_indptr"].long(), *args[1:])
    with pytest.raises(ValueError):  # nor copied to the device
        kvp_torch.append_paged_kv_cache_fused(key, key, td["append_indptr"].cpu(), *args[1:])
    with pytest.raises(ValueError):  # append_indptr must have B+1 entries
        kvp_torch.append_paged_kv_cache_fused(key, key, td["append_indptr"][:2], *args[1:])
    with pytest.raises(kvpool.InvalidArgument) as ei:  # a misaligned source (C's check)
        odd = torch.ones(3 * FUSED_HEADS * FUSED_DIM + 1, dtype=torch.float16, device=dev)
        k_odd = odd[1:].view(3, FUSED_HEADS, FUSED_DIM)
        kvp_torch.append_paged_kv_cache_fused(k_odd, k_odd, *args)
    assert "16-byte aligned" in str(ei.value)
    assert torch.count_nonzero(cache_bytes(out)) == 0
    kvp_torch.append_paged_kv_cache_fused(key, -key, *args, check=True)
    assert torch.count_nonzero(cache_bytes(out)) == 2 * 3 * FUSED_HEADS * FUSED_DIM
    bad = td["kv_indices"].clone()
    bad[0] = 8  # request 0's page outside the cache
    with pytest.raises(kvpool.OutOfRange):
        kvp_torch.append_paged_kv_cache_fused(key, key, td["append_indptr"], out, bad,
                                              td["kv_indptr"], td["kv_last_page_len"],
                                              check=True)


@needs_gpu
def test_fused_append_on_the_daemon_pool_in_a_graph(start):
    """Decode steps on a daemon's pool: one Reserve a step, its table copied into the captured
    graph's tensors, replayed; every appended row lands where the page table says."""
    d = start(*geometry("bf16", "hnd", "split"))
    with d.client("fused-graph") as c:
        info = c.pool_info
        dev = torch.device("cuda", info.device_ids[0])
        H, D, ps = info.heads_per_device, info.head_dim, info.page_size
        seqs = [11, 12, 13]
        B = len(seqs)
        t0 = c.reserve(seqs, [5, 1, 9])  # prompts, appended by the fused call eagerly
        td = {k: torch.from_numpy(getattr(t0, k)).to(dev)
              for k in ("kv_indptr", "kv_indices", "kv_last_page_len", "append_indptr")}
        caches = [c.paged_kv_cache(layer) for layer in range(info.num_layers)]
        prompt = rows(15, torch.bfloat16, dev, H, D)
        for cache in caches:
            kvp_torch.append_paged_kv_cache_fused(prompt, -prompt, td["append_indptr"], cache,
                                                  td["kv_indices"], td["kv_indptr"],
                                                  td["kv_last_page_len"], kv_layout="HND",
                                                  check=True)
        cap = info.num_pages
        st = dict(kv_indices=torch.zeros(cap, dtype=torch.int32, device=dev),
                  kv_indptr=torch.zeros(B + 1, dtype=torch.int32, device=dev),
                  kv_last_page_len=torch.ones(B, dtype=torch.int32, device=dev),
                  append_indptr=torch.arange(B + 1, dtype=torch.int32, device=dev))
        key = torch.zeros(B, H, D, dtype=torch.bfloat16, device=dev)
        err = torch.zeros(1, dtype=torch.int32, device=dev)

        def load(t):
            st["kv_indices"][:t.kv_indices.size].copy_(torch.from_numpy(t.kv_indices))
            st["kv_indptr"].copy_(torch.from_numpy(t.kv_indptr))
            st["kv_last_page_len"].copy_(torch.from_numpy(t.kv_last_page_len))

        def step():
            for cache in caches:
                kvp_torch.append_paged_kv_cache_fused(key, -key, st["append_indptr"], cache,
                                                      st["kv_indices"], st["kv_indptr"],
                                                      st["kv_last_page_len"], kv_layout="HND",
                                                      err=err, pdl=True)

        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        lens = [5, 1, 9]
        for it in range(20):  # crosses page boundaries (page size 4)
            t = c.reserve(seqs, [1] * B)
            assert len(t.copies) == 0
            load(t)
            key.copy_(rows(B, torch.bfloat16, dev, H, D))
            g.replay()
            torch.cuda.synchronize(dev)
            assert int(err.item()) == 0
            for b in range(B):
                p = lens[b]
                page = int(t.kv_indices[t.kv_indptr[b] + p // ps])
                for layer in range(info.num_layers):
                    k, v = caches[layer]
                    assert torch.equal(k[page, :, p % ps], key[b]), (it, b, layer)
                    assert torch.equal(v[page, :, p % ps], -key[b])
                lens[b] += 1
        # the prompts are still in place
        for b, (start_, n) in enumerate(((0, 5), (5, 1), (6, 9))):
            for p in range(n):
                page = int(t0.kv_indices[t0.kv_indptr[b] + p // ps])
                assert torch.equal(caches[1][0][page, :, p % ps], prompt[start_ + p])
        del caches
        assert c.release(seqs) == B
        c.audit()


def test_fused_c_entry_is_declared_and_checks_its_arguments():
    """Runs without a GPU (and without CUDA in libkvpool): the prototype binds, a NULL kv is
    KVP_EINVAL with its reason recorded for the calling thread."""
    lib = kvp_lib.load()
    lib.kvp_clear_cuda_error()
    src = kvp_lib.kvp_append_src_t()
    rc = lib.kvp_client_cuda_append_fused(None, ctypes.byref(src), None, 1, None, 0, None)
    assert rc == KVP_EINVAL
    assert lib.kvp_last_cuda_error().endswith(b" kvp_client_cuda_append_fused: NULL kv or src")
    kv = kvp_lib.kvp_paged_kv_t()
    assert lib.kvp_client_cuda_append_fused(ctypes.byref(kv), ctypes.byref(src), None, 0, None,
                                            4, None) == KVP_EINVAL
    assert lib.kvp_last_cuda_error().endswith(b" kvp_client_cuda_append_fused: unknown flag")
    lib.kvp_clear_cuda_error()
    assert lib.kvp_last_cuda_error() == b""


def test_fused_append_refuses_cpu_tensors():
    cache = torch.zeros(4, 2, 16, FUSED_HEADS, FUSED_DIM, dtype=torch.float16)
    key = torch.zeros(1, FUSED_HEADS, FUSED_DIM, dtype=torch.float16)
    i = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(TypeError):
        kvp_torch.append_paged_kv_cache_fused(key, key, i, cache, i, i, i[:1])
