# SPDX-License-Identifier: Apache-2.0
"""client/python/examples/worker_loop.py against a real kvpoold (host backend): a small GQA
attention stack keeping its KV only in kvpool (Reserve + in-process append, daemon Append every
4th step, fork, truncate) matches a contiguous-cache reference. Its shared system prompt
(issue #16): two worker processes in one cache scope, the second linking exactly the system
prompt's full pages that the first wrote and computing only the rest, equal to the reference.

The daemon fixture `start` comes from conftest.py.
"""
import importlib.util
import os

import numpy as np
import pytest

from conftest import ROOT  # noqa: E402

EXAMPLE = os.path.join(ROOT, "client", "python", "examples", "worker_loop.py")


def load_example():
    spec = importlib.util.spec_from_file_location("kvpool_worker_loop", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


wl = load_example()


def geometry(num_layers=wl.NUM_LAYERS, layout="nhd"):
    return ["--num-layers", str(num_layers), "--num-kv-heads", str(wl.NUM_KV_HEADS),
            "--head-dim", str(wl.HEAD_DIM), "--dtype", "fp32", "--page-size", "4",
            "--num-pages", "256", "--layout", layout]


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_worker_loop_matches_contiguous_reference(start, layout):
    d = start(*geometry(layout=layout))
    with d.client("worker-loop", lease_ms=0) as c:
        st = wl.run(c, steps=24, seed=0)
        assert st["max_err"] <= 1e-5
        assert st["steps"] == 24
        assert st["forks"] >= 1 and st["truncates"] >= 1
        assert st["daemon_appends"] >= 1 and st["reserve_steps"] >= 1
        assert st["daemon_appends"] + st["reserve_steps"] == 25  # prefill + 24 decode steps
        assert st["cow_copies"] >= 1  # the fork's shared partial page was copied
        c.audit()
        s = c.stats()
        assert s.num_seqs == len(st["seqs"]) == len(wl.PROMPT_LENS) + 1
        assert s.num_tokens == st["tokens"]
        # prompts + 24 decoded tokens each; the child shares its parent's tokens before the
        # fork; the truncated sequence lost 3
        lens = st["lens"]
        base = 1000
        assert lens[base + 1] == wl.PROMPT_LENS[1] + 24
        assert lens[base + 2] == wl.PROMPT_LENS[2] + 24 - 3
        assert lens[base] == wl.PROMPT_LENS[0] + 24
        assert lens[base + 3] == lens[base]  # the child decoded every step after the fork
        assert s.shared_pages >= 1  # parent and child still share the pages before the fork
        # run() again in the same namespace: it releases its leftovers first
        st2 = wl.run(c, steps=6, seed=1)
        assert st2["max_err"] <= 1e-5 and st2["daemon_appends"] >= 1
        assert c.release(st2["seqs"]) == len(st2["seqs"])
        c.audit()
        s = c.stats()
        assert s.num_seqs == 0 and s.num_tokens == 0 and s.used_pages == 0


def test_worker_loop_main_prints_ok(start, capsys):
    d = start(*geometry())
    assert wl.main(["--socket", d.sock, "--namespace", "wl-main", "--steps", "8"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("ok") and "max err" in out
    with d.client("wl-main") as c:
        c.audit()
        assert c.stats().num_seqs == 0  # main releases its sequences


def test_worker_loop_refuses_a_mismatched_pool(start):
    d = start("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "32", "--dtype", "fp32",
              "--page-size", "4", "--num-pages", "64")
    with d.client("wl-bad") as c:
        with pytest.raises(wl.GeometryMismatch, match="head_dim is 32"):
            wl.run(c, steps=2)
    assert wl.main(["--socket", d.sock, "--namespace", "wl-bad2", "--steps", "2"]) == 2


# ---- the shared system prompt (issue #16): two worker processes, one prefix cache -----------

def shared_geometry(page_size, layout):
    return ["--num-layers", str(wl.NUM_LAYERS), "--num-kv-heads", str(wl.NUM_KV_HEADS),
            "--head-dim", str(wl.HEAD_DIM), "--dtype", "fp32", "--page-size", str(page_size),
            "--num-pages", "256", "--layout", layout]


# page 4: the 38-token system prompt has 9 full pages (36 tokens), the 44-token prompts 11, and
# prompt + 4 decoded tokens 12; page 16: 2 (32 tokens), 2 and 3
@pytest.mark.parametrize("page_size,layout,cached,prompt_pages,seq_pages", [
    (4, "nhd", 36, 11, 12), (16, "hnd", 32, 2, 3)])
def test_shared_prompt_two_worker_processes(start, page_size, layout, cached, prompt_pages,
                                            seq_pages):
    d = start(*shared_geometry(page_size, layout))
    assert wl.SYSTEM_LEN == 38 and wl.QUESTION_LEN == 6 and wl.SHARED_DECODE_STEPS == 4
    r1, r2 = wl.shared_prompt(d.sock, seed=0)
    # worker 1 found nothing (a fresh scope) and computed its whole prompt
    assert (r1["prompt_len"], r1["cached"], r1["computed"]) == (44, 0, 44)
    # worker 2 found exactly the system prompt's full pages, and computed only the rest
    assert cached == (wl.SYSTEM_LEN // page_size) * page_size
    assert (r2["prompt_len"], r2["cached"], r2["computed"]) == (44, cached, 44 - cached)
    k = cached // page_size
    assert len(r2["cached_digests"]) == k and len(r1["prompt_digests"]) == prompt_pages
    assert r2["page_ids"][:k] == r1["page_ids"][:k]  # linked: worker 1's very pages
    assert r2["cached_digests"] == r1["prompt_digests"][:k]  # and worker 1's bytes
    # the pages after the shared prefix are each worker's own
    assert not set(r2["page_ids"][k:]) & set(r1["page_ids"])
    assert len(set(r2["prompt_digests"][k:]) | set(r1["prompt_digests"][k:])) == \
        2 * (prompt_pages - k)
    for r in (r1, r2):
        assert r["max_err"] <= wl.TOL and len(r["decoded"]) == 4
        assert r["commit_published"] == r["commit_pages"]  # host backend: published at once
    system, (q1, q2) = wl.shared_prompt_tokens(0)
    assert q1[0] != q2[0]
    seq1 = list(system) + list(q1) + r1["decoded"]
    seq2 = list(system) + list(q2) + r2["decoded"]
    # both released: every full page stays cached, the shared ones once
    with d.client("wl-shared-probe", cache_scope=wl.SHARED_SCOPE) as c:
        cs = c.cache_stats()
        assert cs.cached_pages == cs.indexed_pages == 2 * seq_pages - k
        assert cs.pinned_pages == 0
        assert c.lookup([seq1, seq2, system]) == [seq_pages * page_size] * 2 + [cached]
        st = c.stats()  # cached pages are neither used (nobody holds them) nor free
        assert st.used_pages == 0 and st.free_pages == 256 - (2 * seq_pages - k)
        c.audit()
    with d.client("wl-other-scope", cache_scope="another-model") as c:
        assert c.lookup([seq1, seq2, system]) == [0, 0, 0]
    with d.client("wl-no-scope") as c:
        assert c.lookup([seq1]) == [0]


def test_shared_prompt_leave_last_other_scope_and_flush(start):
    d = start(*shared_geometry(4, "nhd"))
    system, (q1, q2) = wl.shared_prompt_tokens(0)
    r1, _ = wl.spawn_worker(d.sock, "wl-a", system, q1, flush=True)
    assert (r1["cached"], r1["computed"]) == (0, 44)
    # the same 44-token prompt again: all 11 pages are cached, but leave_last leaves the last
    # page to compute (its logits give the first decoded token)
    r, _ = wl.spawn_worker(d.sock, "wl-b", system, q1)
    assert (r["cached"], r["computed"]) == (40, 4)
    assert r["page_ids"][:10] == r1["page_ids"][:10]
    assert r["cached_digests"] == r1["prompt_digests"][:10]
    assert r["decoded"] == r1["decoded"] and r["max_err"] <= wl.TOL  # the same request
    # another scope finds nothing and computes everything, still equal to the reference
    r, _ = wl.spawn_worker(d.sock, "wl-c", system, q2, scope="another-model")
    assert (r["cached"], r["computed"]) == (0, 44) and r["max_err"] <= wl.TOL
    assert not set(r["page_ids"]) & set(r1["page_ids"])
    # after a flush of the scope, nothing is found
    r, _ = wl.spawn_worker(d.sock, "wl-d", system, q2, flush=True)
    assert (r["cached"], r["computed"]) == (0, 44) and r["max_err"] <= wl.TOL
    assert wl.expected_cached(np.concatenate([system, q1]), [np.concatenate([system, q1])],
                              4) == 40
    assert wl.expected_cached(np.concatenate([system, q2]), [np.concatenate([system, q1])],
                              16) == 32


def test_shared_prompt_main_prints_each_worker(start, capsys):
    d = start(*shared_geometry(4, "nhd"))
    assert wl.main(["--socket", d.sock, "--shared-prompt"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("ok")
    assert "worker 1 (wl-shared-1): prompt 44 tokens, 0 from the cache, computed 44" in out
    assert "worker 2 (wl-shared-2): prompt 44 tokens, 36 from the cache, computed 8" in out


def test_shared_prompt_refuses_a_mismatched_pool(start):
    d = start("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "32", "--dtype", "fp32",
              "--page-size", "4", "--num-pages", "64")
    with pytest.raises(wl.GeometryMismatch, match="head_dim is 32"):
        wl.shared_prompt(d.sock)
    assert wl.main(["--socket", d.sock, "--shared-prompt"]) == 2
