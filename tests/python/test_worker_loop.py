"""client/python/examples/worker_loop.py against a real kvpoold (host backend): a small GQA
attention stack keeping its KV only in kvpool (Reserve + in-process append, daemon Append every
4th step, fork, truncate) matches a contiguous-cache reference.

The daemon fixture `start` comes from conftest.py.
"""
import importlib.util
import os

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
