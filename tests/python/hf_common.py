# SPDX-License-Identifier: Apache-2.0
"""What the transformers tests share (test_hf_integration.py on a CPU, test_hf_gpu.py on a
GPU): seeded prompts, left padding as generate() takes it, and the test file run again as a
worker PROCESS (a RESULT line back, or a worker killed mid-generation)."""
import json
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def prompts_of(lens, vocab, seed=1):
    """Token-id lists of the given lengths, seeded, ids in [2, vocab)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


def left_pad(prompts, device="cpu"):
    """(input_ids, attention_mask) [B, L] of the prompts, left padded with 0."""
    L = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        mask[b, L - len(p):] = 1
    return ids.to(device), mask.to(device)


def worker_env():
    """The environment of a worker process: the package and this folder on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "client", "python"),
                                         os.path.dirname(os.path.abspath(__file__)),
                                         env.get("PYTHONPATH", "")])
    return env


def run_worker(script, args, what, timeout=300):
    """`python script *args` to its end; returns the JSON of its one "RESULT " line."""
    cmd = [sys.executable, os.path.abspath(script)] + [str(a) for a in args]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=timeout, env=worker_env())
    res = [ln[7:] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and len(res) == 1, "worker %s exited with %d:\n%s%s" % (
        what, p.returncode, p.stdout, p.stderr[-4000:])
    return json.loads(res[0])


def start_doomed(script, args):
    """`python script *args` in the background, waited for until it prints READY (it is then
    generating); returns the Popen, to be killed. Its stderr goes to a file, not a pipe: a pipe
    nobody reads could fill and block it."""
    errf = tempfile.TemporaryFile("w+")
    p = subprocess.Popen([sys.executable, os.path.abspath(script)] + [str(a) for a in args],
                         stdout=subprocess.PIPE, stderr=errf, text=True, env=worker_env())
    line = p.stdout.readline()
    if line.strip() != "READY":
        p.wait(60)
        errf.seek(0)
        pytest.fail("the worker did not start generating:\n" + line + errf.read()[-4000:])
    return p


def wait_for(cond, timeout_s, what):
    """Polls cond() every 10 ms until it is true; fails the test naming `what` when timeout_s
    pass first. The way these tests order events with another process (never a fixed
    sleep)."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            pytest.fail("still not %s after %.1f s" % (what, timeout_s))
        time.sleep(0.01)


def wait_generating(d, scope, min_pages, timeout_s=60):
    """Waits until the one worker sequence of daemon `d` holds more than min_pages pages (it
    went on decoding past its prompt)."""
    with d.client("hf-probe", cache_scope=scope) as c:
        def grown():
            st = c.stats()
            assert st.num_seqs == 1, "the worker's sequence is gone: %r" % (st,)
            return st.used_pages > min_pages
        wait_for(grown, timeout_s, "more than %d pages held" % min_pages)


def check_after_kill(d, prompt, scope, page_size, lease_ms=300):
    """After a doomed worker (lease lease_ms) was killed: once its lease ran out the daemon `d`
    has released its sequence, is healthy, its audit clean, nothing is held (its pages free,
    or cached when keyed) and the prompt it committed after its prefill is still findable, in
    whole pages. The release is waited for (lease plus a margin for a loaded machine)."""
    with d.client("hf-probe", cache_scope=scope) as c:
        wait_for(lambda: c.stats().num_seqs == 0, lease_ms / 1e3 + 10,
                 "released (the killed worker's lease is %d ms)" % lease_ms)
        c.ping()
        c.audit()
        st = c.stats()
        assert st.num_seqs == 0 and st.used_pages == 0
        assert c.lookup([prompt]) == [(len(prompt) - 1) // page_size * page_size]
