"""The PyTorch side of the kvpool package (kvpool._torch) against real kvpoold processes.

Needs PyTorch: skipped without it (CI has none: PyTorch's wheels are CUDA builds of about a
gigabyte). The cuda tests need a GPU too and are skipped without one; on the H200 they run
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
    event on cuda) and computing only the rest, equal to a full contiguous run.
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
