#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""worker_loop.py - a tiny decoder worker that keeps its KV cache ONLY in kvpool.

A small attention stack (no MLP): L layers, hidden 64, 4 query heads, 2 KV heads (GQA), head_dim
16, random float32 weights from a seeded RNG. Per layer: x -> q, k, v projections -> causal
attention over the cached K/V -> output projection + residual. It prefills a few prompts of
different lengths and decodes a number of steps; mid-way it forks one sequence (the child is fed
different tokens, so copy-on-write must keep the two apart) and truncates another
(speculative-decoding rollback). Every step is compared against the same model run with a plain
contiguous per-sequence cache (NumPy lists): every layer's output of every token.

Two ways to put a step's K/V into the pool (DESIGN.md §4):
  * hot path (most steps): one Reserve RPC per step (Client.reserve: pages + page table, no
    copy), Client.apply_copies for the copy-on-write copies, then per layer
    kvpool.append_paged_kv_cache on the mapped pool, in this process, before that layer's
    attention reads it back through the page table.
  * daemon-run Append (every 4th decode step): a daemon Append allocates and copies all layers at
    once, but layer l+1's K/V depends on layer l's attention. So the step runs layer by layer
    with its new K/V kept in a local staging copy: attention of layer l reads positions
    0..old_len-1 from the pool (through the current page table, Client.page_table) and the
    not-yet-appended current tokens from the staging copy. After the last layer the staging copy
    goes to a registered memfd buffer and one Client.append (layer stride) sends every layer;
    the pages it names are then checked to hold exactly the staged rows.

Attention reads K/V only through the daemon's page table: position pos of request b lives at
page kv_indices[kv_indptr[b] + pos // page_size], slot pos % page_size.

NumPy/host backend only. The model's arithmetic goes through the small `NumpyOps` class and the
pool accesses through `PagedKV`; a PyTorch/CUDA version swaps in a torch-ops class (same
methods, on device tensors) and a PagedKV whose views are torch tensors over the mapped cuda
pool (kvp_client_cuda_map_pool) with FlashInfer's append_paged_kv_cache / attention taking the
same page tables; the step logic (reserve, copies, per-layer append, daemon Append) is unchanged.

A shared system prompt from the prefix cache (--shared-prompt, shared_prompt(); issue #16):
two worker PROCESSES (this script with --serve), one after the other, each its own Client in
its own namespace but the same cache_scope, serve "a 38-token system prompt + a different
6-token question". Each does what a worker with a prefix cache does: one Reserve with the
prompt's token ids, reuse=True and leave_last=True; the model runs only over the tokens after
PageTable.cached_tokens (positions from there on, attention over the cached K/V read through
the page table), appends their K/V in-process, every layer, and commit() makes the full pages
findable; a few decode steps the same way (Reserve with the token's id, append, commit); then
a release, after which the keyed pages stay in the pool as cached. Worker 1 finds nothing and
computes all 44 tokens; worker 2 finds exactly floor(38 / page_size) * page_size tokens (36 at
page 4), worker 1's very pages and bytes, and computes only the rest. Each worker checks every
layer's output of every token it computed, and its decoded tokens, against the same model run
on the contiguous cache over the whole request; that only holds because both workers compute
the same K/V for the same tokens at the same positions (same seeded weights).

The daemon must have the model's geometry:
    kvpoold --backend host --num-layers 2 --num-kv-heads 2 --head-dim 16 --dtype fp32 \
            --page-size 4 --num-pages 256
Run:  python3 worker_loop.py [--socket PATH] [--namespace NS] [--steps 24] [--seed 0]
      python3 worker_loop.py [--socket PATH] --shared-prompt [--cache-scope S] [--seed 0]
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys

import numpy as np

try:
    import kvpool
except ImportError:  # run from the source tree without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import kvpool

HIDDEN = 64
NUM_Q_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
NUM_LAYERS = 2
VOCAB = 97
PROMPT_LENS = (5, 9, 13)
TOL = 1e-5


class GeometryMismatch(RuntimeError):
    """The daemon's pool does not have the model's geometry."""


# ---- the model's arithmetic (swap this class for a torch one) --------------------------------

class NumpyOps:
    dtype = np.float32

    @staticmethod
    def matmul(a, b):
        return a @ b

    @staticmethod
    def concat(parts, axis=0):
        return np.concatenate(parts, axis=axis)

    @staticmethod
    def softmax(x, axis=-1):
        m = np.max(x, axis=axis, keepdims=True)
        e = np.exp(x - m)
        return e / np.sum(e, axis=axis, keepdims=True)


class Model:
    """Weights and the per-layer math. forward() takes a KV store (paged or contiguous)."""

    def __init__(self, num_layers=NUM_LAYERS, seed=0, ops=NumpyOps):
        self.ops = ops
        self.L = num_layers
        rng = np.random.default_rng(seed)
        f = ops.dtype
        s = 1.0 / np.sqrt(HIDDEN)

        def w(*shape, scale=s):
            return (rng.standard_normal(shape) * scale).astype(f)

        self.embed = w(VOCAB, HIDDEN, scale=1.0)
        self.wq = [w(HIDDEN, NUM_Q_HEADS * HEAD_DIM) for _ in range(num_layers)]
        self.wk = [w(HIDDEN, NUM_KV_HEADS * HEAD_DIM) for _ in range(num_layers)]
        self.wv = [w(HIDDEN, NUM_KV_HEADS * HEAD_DIM) for _ in range(num_layers)]
        self.wo = [w(NUM_Q_HEADS * HEAD_DIM, HIDDEN) for _ in range(num_layers)]
        # a fixed sinusoidal position signal, so attention is not permutation invariant
        pos = np.arange(4096)[:, None]
        i = np.arange(HIDDEN)[None, :]
        ang = pos / np.power(10000.0, (2 * (i // 2)) / HIDDEN)
        self.pos_emb = np.where(i % 2 == 0, np.sin(ang), np.cos(ang)).astype(f) * 0.1

    def forward(self, store, tokens, starts):
        """tokens: list (one per batch entry) of int arrays of new tokens; starts: each entry's
        length before them. store.begin_step has been called. Returns (per-layer outputs
        [L][nnz, HIDDEN], the next token of each entry: argmax of the tied-embedding logits at
        its last token)."""
        ops = self.ops
        counts = [len(t) for t in tokens]
        ind = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        flat = np.concatenate([np.asarray(t, np.int64) for t in tokens])
        posn = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])
        x = self.embed[flat] + self.pos_emb[posn]
        nnz = x.shape[0]
        group = NUM_Q_HEADS // NUM_KV_HEADS
        scale = np.float32(1.0 / np.sqrt(HEAD_DIM))
        outs = []
        for layer in range(self.L):
            q = ops.matmul(x, self.wq[layer]).reshape(nnz, NUM_Q_HEADS, HEAD_DIM)
            k = ops.matmul(x, self.wk[layer]).reshape(nnz, NUM_KV_HEADS, HEAD_DIM)
            v = ops.matmul(x, self.wv[layer]).reshape(nnz, NUM_KV_HEADS, HEAD_DIM)
            store.write(layer, np.ascontiguousarray(k), np.ascontiguousarray(v))
            attn = np.empty((nnz, NUM_Q_HEADS * HEAD_DIM), dtype=ops.dtype)
            for b in range(len(tokens)):
                K, V = store.read(layer, b)  # [S, Hkv, D], S = starts[b] + counts[b]
                S, n = K.shape[0], counts[b]
                assert S == starts[b] + n, (S, starts[b], n)
                qb = q[ind[b]:ind[b + 1]]  # [n, Hq, D]
                Kh = np.repeat(K, group, axis=1).transpose(1, 2, 0)  # [Hq, D, S]
                Vh = np.repeat(V, group, axis=1).transpose(1, 0, 2)  # [Hq, S, D]
                sc = ops.matmul(qb.transpose(1, 0, 2), Kh) * scale  # [Hq, n, S]
                qpos = starts[b] + np.arange(n)[:, None]
                sc = np.where(np.arange(S)[None, :] <= qpos, sc, np.float32(-1e30))
                p = ops.softmax(sc, axis=-1)
                o = ops.matmul(p, Vh)  # [Hq, n, D]
                attn[ind[b]:ind[b + 1]] = o.transpose(1, 0, 2).reshape(n, -1)
            x = (ops.matmul(attn, self.wo[layer]) + x).astype(ops.dtype)
            outs.append(x)
        last = x[ind[1:] - 1]
        logits = ops.matmul(last, self.embed.T)
        return outs, [int(t) for t in np.argmax(logits, axis=-1)]


# ---- the reference: a contiguous per-sequence cache ------------------------------------------

class ContiguousKV:
    """One contiguous [len, Hkv, D] array per sequence and layer. The array operations are the
    three methods below; worker_loop_torch.ContiguousKV overrides them for torch tensors."""

    def __init__(self, num_layers):
        self.L = num_layers
        self.k = {}  # seq -> [L] arrays [len, Hkv, D]
        self.v = {}

    def _empty(self):
        return np.zeros((0, NUM_KV_HEADS, HEAD_DIM), np.float32)

    def _cat(self, parts):
        return np.concatenate(parts)

    def _copy(self, a):
        return a.copy()

    def begin_step(self, seqs, ntoks):
        self.seqs = list(seqs)
        self.ind = np.concatenate([[0], np.cumsum(ntoks)]).astype(np.int64)
        for s in self.seqs:
            if s not in self.k:
                empty = self._empty()
                self.k[s] = [empty] * self.L
                self.v[s] = [empty] * self.L

    def write(self, layer, k, v):
        for b, s in enumerate(self.seqs):
            lo, hi = self.ind[b], self.ind[b + 1]
            self.k[s][layer] = self._cat([self.k[s][layer], k[lo:hi]])
            self.v[s][layer] = self._cat([self.v[s][layer], v[lo:hi]])

    def read(self, layer, b):
        s = self.seqs[b]
        return self.k[s][layer], self.v[s][layer]

    def end_step(self):
        pass

    def length(self, s):
        return self.k[s][0].shape[0]

    def fork(self, parent, child):
        self.k[child] = [self._copy(a) for a in self.k[parent]]
        self.v[child] = [self._copy(a) for a in self.v[parent]]

    def truncate(self, s, n):
        self.k[s] = [a[:n] for a in self.k[s]]
        self.v[s] = [a[:n] for a in self.v[s]]


# ---- the kvpool-backed cache -------------------------------------------------------------------

def _gather(view, layout_hnd, table, b, length):
    """Rows 0..length-1 of request b of a page table from a K or V view: [length, H, D]."""
    ps = view.shape[2] if layout_hnd else view.shape[1]
    pos = np.arange(length)
    pages = table.kv_indices[table.kv_indptr[b] + pos // ps]
    slots = pos % ps
    if layout_hnd:  # [P, H, ps, D]: advanced indices separated by a slice go first -> [n, H, D]
        return view[pages, :, slots]
    return view[pages, slots]


class PagedKV:
    """The step's K/V store on the daemon's pool. mode "reserve": Reserve + apply_copies + a
    per-layer in-process append; mode "append": layer by layer into a local staging copy, one
    daemon Append after the last layer."""

    def __init__(self, client, staging_tokens=64):
        self.c = client
        info = client.pool_info
        self.L = info.num_layers
        self.hnd = info.layout == kvpool.Layout.HND
        self.layout = "HND" if self.hnd else "NHD"
        self.kview = [client.k_view(l) for l in range(self.L)]
        self.vview = [client.v_view(l) for l in range(self.L)]
        self.cache = [client.paged_kv_cache(l) for l in range(self.L)]
        row = NUM_KV_HEADS * HEAD_DIM * 4
        self.staging_tokens = staging_tokens
        self.buf, self.bid = client.alloc_staging(self.L * 2 * staging_tokens * row)
        self.cow_copies = 0

    def begin_step(self, seqs, ntoks, old_lens, mode, table=None):
        """table: (mode "reserve") the step's Reserve answer when the caller made the call
        itself (the prefix cache's reuse: ntoks are then the tokens after the cached ones)."""
        self.seqs = np.asarray(seqs, np.uint64)
        self.ntoks = np.asarray(ntoks, np.uint32)
        self.old_lens = list(old_lens)
        self.mode = mode
        self.ind = np.concatenate([[0], np.cumsum(ntoks)]).astype(np.int64)
        nnz = int(self.ind[-1])
        if mode == "reserve":
            # the hot path's one RPC of the step
            t = self.c.reserve(self.seqs, self.ntoks) if table is None else table
            self.c.apply_copies(t)
            self.cow_copies += int(t.copies.shape[0])
            self.bi, self.pos = kvpool.get_batch_indices_positions(t.append_indptr,
                                                                   t.seq_lens, t.nnz)
            self.table = t
        else:
            if nnz > self.staging_tokens:
                raise ValueError("step of %d tokens exceeds the staging buffer" % nnz)
            # the current (pre-append) table: attention reads old positions from the pool
            self.table = self.c.page_table(self.seqs) if any(self.old_lens) else None
            self.stage = np.zeros((self.L, 2, nnz, NUM_KV_HEADS, HEAD_DIM), np.float32)

    def write(self, layer, k, v):
        if self.mode == "reserve":
            t = self.table
            kvpool.append_paged_kv_cache(k, v, self.bi, self.pos, self.cache[layer],
                                         t.kv_indices, t.kv_indptr, t.kv_last_page_len,
                                         kv_layout=self.layout)
        else:
            self.stage[layer, 0] = k
            self.stage[layer, 1] = v

    def read(self, layer, b):
        n = int(self.ntoks[b])
        if self.mode == "reserve":
            S = int(self.table.seq_lens[b])
            return (_gather(self.kview[layer], self.hnd, self.table, b, S),
                    _gather(self.vview[layer], self.hnd, self.table, b, S))
        old = self.old_lens[b]
        lo, hi = self.ind[b], self.ind[b + 1]
        assert hi - lo == n
        if old == 0:
            return self.stage[layer, 0, lo:hi].copy(), self.stage[layer, 1, lo:hi].copy()
        K = _gather(self.kview[layer], self.hnd, self.table, b, old)
        V = _gather(self.vview[layer], self.hnd, self.table, b, old)
        return (np.concatenate([K, self.stage[layer, 0, lo:hi]]),
                np.concatenate([V, self.stage[layer, 1, lo:hi]]))

    def page_digest(self, table, b, p):
        """SHA-256 of the bytes of page p of request b (its K and V, every layer) in the pool."""
        h = hashlib.sha256()
        page = int(table.kv_indices[table.kv_indptr[b] + p])
        for layer in range(self.L):
            for view in (self.kview[layer], self.vview[layer]):
                h.update(np.ascontiguousarray(view[page]).tobytes())
        return h.hexdigest()

    def end_step(self):
        if self.mode == "reserve":
            return
        nnz = int(self.ind[-1])
        raw = self.stage.reshape(-1).view(np.uint8)
        self.buf[:raw.size] = raw
        kv_bytes = nnz * NUM_KV_HEADS * HEAD_DIM * 4
        src = dict(buffer_id=self.bid, k_offset=0, v_offset=kv_bytes, layer_stride=2 * kv_bytes)
        t = self.c.append(self.seqs, self.ntoks, source=src)
        want = [o + int(n) for o, n in zip(self.old_lens, self.ntoks)]
        if t.seq_lens.tolist() != want:
            raise AssertionError("daemon Append: seq_lens %s, expected %s"
                                 % (t.seq_lens.tolist(), want))
        # the pages the daemon wrote hold exactly the staged rows (bitwise)
        for b in range(len(self.seqs)):
            lo, hi = self.ind[b], self.ind[b + 1]
            pos = np.arange(self.old_lens[b], want[b])
            for layer in range(self.L):
                for kv, view in ((0, self.kview[layer]), (1, self.vview[layer])):
                    got = _gather(view, self.hnd, t, b, want[b])[pos]
                    if got.tobytes() != self.stage[layer, kv, lo:hi].tobytes():
                        raise AssertionError("daemon Append: layer %d %s of sequence %d differs "
                                             "from the staging data" % (layer, "KV"[kv],
                                                                        int(self.seqs[b])))
        self.table = t


# ---- the loop ----------------------------------------------------------------------------------

def geometry_problems(info, **want):
    """The PoolInfo fields that differ from what the model needs, as sentences."""
    return ["%s is %r, the model needs %r" % (k, getattr(info, k), v)
            for k, v in want.items() if getattr(info, k) != v]


def check_geometry(info, num_layers):
    bad = geometry_problems(info, num_layers=num_layers, heads_per_device=NUM_KV_HEADS,
                            head_dim=HEAD_DIM, dtype_name="fp32", backend_name="host")
    if bad:
        raise GeometryMismatch(
            "the daemon's pool does not match the model (%s); start it with: kvpoold --backend "
            "host --num-layers %d --num-kv-heads %d --head-dim %d --dtype fp32 --page-size 4 "
            "--num-pages 256" % ("; ".join(bad), num_layers, NUM_KV_HEADS, HEAD_DIM))


def run(client, steps=24, seed=0, seq_base=1000, prompt_lens=PROMPT_LENS, daemon_every=4,
        log=None):
    """Prefills len(prompt_lens) sequences, decodes `steps` steps with a fork and a truncate,
    comparing against the contiguous reference every step. Raises on a mismatch above TOL.
    Returns stats: max_err, steps, forks, truncates, daemon_appends, reserve_steps, cow_copies,
    seqs (live sequence ids), tokens (their total length), lens (id -> length)."""
    info = client.pool_info
    L = info.num_layers
    check_geometry(info, L)
    return drive(client, Model(L, seed=seed), ContiguousKV(L), PagedKV(client),
                 lambda a, r: float(np.max(np.abs(a - r))), TOL, steps=steps, seed=seed,
                 seq_base=seq_base, prompt_lens=prompt_lens, daemon_every=daemon_every, log=log)


def drive(client, model, ref, paged, max_abs_diff, tol, steps, seed, seq_base, prompt_lens,
          daemon_every, log, stats=None):
    """The step logic, whatever the arrays (worker_loop_torch.py drives PyTorch pieces with
    it): model.forward over the reference `ref` and over `paged` each step, compared with
    max_abs_diff(out, ref_out) <= tol; one fork mid-way (where the parent's last page is
    partial, so copy-on-write must happen) and one truncation. Returns `stats` filled."""
    info = client.pool_info
    rng = np.random.default_rng(seed + 1)
    seqs = [seq_base + i for i in range(len(prompt_lens))]
    client.release(seqs + [seq_base + len(prompt_lens)])  # leftovers of an earlier run
    stats = dict(stats or {}, max_err=0.0, steps=0, forks=0, truncates=0, daemon_appends=0,
                 reserve_steps=0)
    fork_parent, child = seqs[0], seq_base + len(prompt_lens)
    trunc_seq, trunc_by = seqs[-1], 3
    fork_at = max(1, steps // 3)
    trunc_at = max(2, (2 * steps) // 3)

    def step(tokens, mode):
        lens = [ref.length(s) if s in ref.k else 0 for s in seqs]
        ntoks = [len(t) for t in tokens]
        ref.begin_step(seqs, ntoks)
        ref_outs, ref_next = model.forward(ref, tokens, lens)
        paged.begin_step(seqs, ntoks, lens, mode)
        outs, nxt = model.forward(paged, tokens, lens)
        paged.end_step()
        err = max(max_abs_diff(a, r) for a, r in zip(outs, ref_outs))
        stats["max_err"] = max(stats["max_err"], err)
        stats["daemon_appends" if mode == "append" else "reserve_steps"] += 1
        if not err <= tol:
            raise AssertionError("step %d (%s): max abs error %g > %g"
                                 % (stats["steps"], mode, err, tol))
        return err, ref_next

    prompts = [rng.integers(0, VOCAB, n) for n in prompt_lens]
    err, nxt = step(prompts, "reserve")
    if log:
        log("prefill %s: max err %.3g" % (list(prompt_lens), err))
    for i in range(steps):
        if (not stats["forks"] and i >= fork_at
                and ref.length(fork_parent) % info.page_size != 0):
            # fork where the parent's last page is partial, so copy-on-write must happen
            client.fork(fork_parent, child)
            ref.fork(fork_parent, child)
            seqs.append(child)
            b = seqs.index(fork_parent)
            nxt.append((nxt[b] + 1) % VOCAB)  # the child continues with a different token
            stats["forks"] += 1
        if i == trunc_at:
            b = seqs.index(trunc_seq)
            n = ref.length(trunc_seq) - trunc_by
            client.truncate(trunc_seq, n)
            ref.truncate(trunc_seq, n)
            nxt[b] = (nxt[b] + 7) % VOCAB  # the corrected token after the rollback
            stats["truncates"] += 1
        mode = "append" if (i + 1) % daemon_every == 0 else "reserve"
        err, nxt = step([[t] for t in nxt], mode)
        stats["steps"] += 1
        if log:
            log("step %2d %-7s batch %d: max err %.3g" % (i, mode, len(seqs), err))
    # the daemon's page tables agree with the reference lengths
    t = client.page_table(seqs)
    lens = {s: ref.length(s) for s in seqs}
    if t.seq_lens.tolist() != [lens[s] for s in seqs]:
        raise AssertionError("page table lengths %s, reference %s" % (t.seq_lens.tolist(), lens))
    stats.update(cow_copies=paged.cow_copies, seqs=list(seqs), tokens=sum(lens.values()),
                 lens=lens)
    client.unregister_buffer(paged.bid)
    return stats


# ---- a shared system prompt served from the prefix cache by two worker processes ------------

SHARED_SCOPE = "worker-loop-shared"
SYSTEM_LEN = 38  # not a multiple of the page size (4 or 16): the page holding its end is private
QUESTION_LEN = 6  # 38 + 6 = 44: a whole number of pages of 4, so leave_last shows on a repeat
SHARED_DECODE_STEPS = 4
SHARED_SEQ = 2000


def serve_request(client, model, ref, paged, max_abs_diff, tol, system, question,
                  decode_steps=SHARED_DECODE_STEPS, seq_id=SHARED_SEQ, reuse=True, log=None):
    """Serves one request "system + question" the way a worker with a prefix cache does: one
    Reserve with the prompt's token ids and reuse (leave_last), so the daemon links the longest
    cached full-page prefix; the model runs only over the tokens after the cached ones
    (positions from cached_tokens on, attention over the cached K/V read from the pool through
    the page table), appends their K/V in-process, every layer, then commit() makes the new
    full pages findable; then decode_steps decode steps (Reserve with the token's id, append,
    commit) and a release, after which the keyed pages stay cached for the next worker.

    Checked against `ref` (the contiguous cache) running the whole request from position 0:
    every layer's output of every computed token within tol, and the same decoded tokens.
    Raises AssertionError otherwise. Returns a JSON-able dict: prompt_len, cached, computed,
    page_size, page_ids (the prompt's pages), prompt_digests (SHA-256 of each full prompt
    page's bytes after the prefill), cached_digests (of the cached pages, read before anything
    was written), decoded, max_err, commit_pages, commit_published."""
    ps = client.pool_info.page_size
    prompt = np.concatenate([np.asarray(system, np.int64), np.asarray(question, np.int64)])
    P = int(prompt.size)
    client.release([seq_id])  # a leftover of an earlier run
    ref.begin_step([seq_id], [P])
    ref_outs, ref_next = model.forward(ref, [prompt], [0])

    t = client.reserve([seq_id], [P], token_ids=prompt, reuse=reuse, leave_last=True)
    cached = int(t.cached_tokens[0]) if t.cached_tokens.size else 0
    n = P - cached
    if t.seq_lens.tolist() != [P] or t.nnz != n or cached % ps or not 0 <= cached < P:
        raise AssertionError("Reserve with reuse: seq_lens %s, append_indptr %s, cached %d "
                             "(prompt %d, page %d)" % (t.seq_lens.tolist(),
                                                       t.append_indptr.tolist(), cached, P, ps))
    cached_digests = [paged.page_digest(t, 0, p) for p in range(cached // ps)]
    paged.begin_step([seq_id], [n], [cached], "reserve", table=t)
    outs, nxt = model.forward(paged, [prompt[cached:]], [cached])
    paged.end_step()
    cm = client.commit([seq_id])
    err = max(max_abs_diff(a, r[cached:]) for a, r in zip(outs, ref_outs))
    if not err <= tol or nxt != ref_next:
        raise AssertionError("prefill after %d cached tokens: max abs error %g (tol %g), next "
                             "token %s, reference %s" % (cached, err, tol, nxt, ref_next))
    prompt_digests = [paged.page_digest(t, 0, p) for p in range(P // ps)]
    if prompt_digests[:len(cached_digests)] != cached_digests:
        raise AssertionError("the cached pages changed while the request was computed")
    page_ids = [int(x) for x in t.kv_indices[t.kv_indptr[0]:t.kv_indptr[1]]]
    if log:
        log("prefill: prompt %d tokens, %d cached, computed %d; max err %.3g"
            % (P, cached, n, err))

    decoded, length, tok, max_err = [], P, nxt[0], err
    for i in range(decode_steps):
        decoded.append(int(tok))
        ref.begin_step([seq_id], [1])
        ref_outs, ref_next = model.forward(ref, [[tok]], [length])
        t = client.reserve([seq_id], [1], token_ids=[tok])
        paged.begin_step([seq_id], [1], [length], "reserve", table=t)
        outs, nxt = model.forward(paged, [[tok]], [length])
        paged.end_step()
        client.commit([seq_id])
        err = max(max_abs_diff(a, r) for a, r in zip(outs, ref_outs))
        max_err = max(max_err, err)
        if not err <= tol or nxt != ref_next:
            raise AssertionError("decode step %d: max abs error %g (tol %g), next token %s, "
                                 "reference %s" % (i, err, tol, nxt, ref_next))
        length, tok = length + 1, nxt[0]
    if log:
        log("decoded %s; max err %.3g" % (decoded, max_err))
    if client.release([seq_id]) != 1:
        raise AssertionError("release of sequence %d" % seq_id)
    return dict(prompt_len=P, cached=cached, computed=n, page_size=ps, page_ids=page_ids,
                prompt_digests=prompt_digests, cached_digests=cached_digests, decoded=decoded,
                max_err=float(max_err), commit_pages=cm.pages, commit_published=cm.published)


def serve(client, system, question, seed=0, decode_steps=SHARED_DECODE_STEPS, log=None):
    """serve_request with this file's NumPy model (seeded weights: every worker computes the
    same K/V for the same tokens at the same positions, which is what makes reuse right)."""
    info = client.pool_info
    check_geometry(info, info.num_layers)
    paged = PagedKV(client)
    try:
        return serve_request(client, Model(info.num_layers, seed=seed),
                             ContiguousKV(info.num_layers), paged,
                             lambda a, r: float(np.max(np.abs(a - r))), TOL, system, question,
                             decode_steps=decode_steps, log=log)
    finally:
        client.unregister_buffer(paged.bid)


def expected_cached(prompt, earlier, ps, leave_last=True):
    """The tokens a Reserve with reuse finds for `prompt` after the token lists `earlier` were
    appended (with their ids) and committed in the same scope: the longest common prefix with
    any of them, in whole pages, and with leave_last one page less when that is the whole
    prompt."""
    best = 0
    for e in earlier:
        m = min(len(prompt), len(e))
        neq = np.nonzero(np.asarray(prompt[:m]) != np.asarray(e[:m]))[0]
        best = max(best, int(neq[0]) if neq.size else m)
    best -= best % ps
    if leave_last and best == len(prompt):
        best -= ps
    return max(best, 0)


def shared_prompt_tokens(seed=0, system_len=SYSTEM_LEN, question_len=QUESTION_LEN, n=2):
    """The system prompt and n questions (each starting with a different token)."""
    rng = np.random.default_rng(seed + 7)
    system = rng.integers(0, VOCAB, system_len)
    qs = []
    for _ in range(n):
        q = rng.integers(0, VOCAB, question_len)
        while any(q[0] == p[0] for p in qs):
            q[0] = (q[0] + 1) % VOCAB
        qs.append(q)
    return system, qs


def spawn_worker(socket, namespace, system, question, scope=SHARED_SCOPE, seed=0,
                 decode_steps=SHARED_DECODE_STEPS, flush=False, script=None, timeout=300):
    """Runs one worker PROCESS (this script, --serve): its own Client in `namespace` and cache
    scope `scope`, serving "system + question". Returns (its result dict, its log lines)."""
    cmd = [sys.executable, script or os.path.abspath(__file__), "--serve",
           "--namespace", namespace, "--cache-scope", scope, "--seed", str(seed),
           "--decode-steps", str(decode_steps),
           "--system", ",".join(str(int(x)) for x in system),
           "--question", ",".join(str(int(x)) for x in question)]
    if socket:
        cmd += ["--socket", socket]
    if flush:
        cmd.append("--flush")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=timeout)
    lines = p.stdout.splitlines()
    res = [ln[len("RESULT "):] for ln in lines if ln.startswith("RESULT ")]
    if p.returncode == 2 and not res:
        raise GeometryMismatch(p.stderr.strip())
    if p.returncode != 0 or len(res) != 1:
        raise AssertionError("worker %s exited with %d:\n%s%s"
                             % (namespace, p.returncode, p.stdout, p.stderr))
    return json.loads(res[0]), [ln for ln in lines if not ln.startswith("RESULT ")]


def shared_prompt(socket=None, seed=0, system_len=SYSTEM_LEN, question_len=QUESTION_LEN,
                  decode_steps=SHARED_DECODE_STEPS, scope=SHARED_SCOPE,
                  namespaces=("wl-shared-1", "wl-shared-2"), script=None, log=None):
    """Two worker processes, one after the other, in different namespaces of one cache scope,
    serve "system prompt + a different question" each. Worker 1 (after flushing the scope's
    cached pages) finds nothing and computes its whole prompt; worker 2 then finds the system
    prompt's full pages in the cache: exactly floor(system_len / page_size) * page_size tokens,
    the very pages worker 1 wrote (same ids, same bytes), and computes only the rest, its
    outputs equal to a full contiguous run. Raises AssertionError otherwise; returns both
    workers' result dicts."""
    system, (q1, q2) = shared_prompt_tokens(seed, system_len, question_len)
    out = []
    for i, (ns, q) in enumerate(zip(namespaces, (q1, q2))):
        r, lines = spawn_worker(socket, ns, system, q, scope=scope, seed=seed,
                                decode_steps=decode_steps, flush=(i == 0), script=script)
        for ln in lines if log else ():
            log("[worker %d] %s" % (i + 1, ln))
        out.append(r)
    r1, r2 = out
    ps = r1["page_size"]
    p1 = np.concatenate([system, q1])
    want = [0, expected_cached(np.concatenate([system, q2]), [p1], ps)]
    assert want[1] == system_len - system_len % ps, want  # the questions differ at once
    for i, r in enumerate(out):
        if r["cached"] != want[i] or r["computed"] != r["prompt_len"] - want[i]:
            raise AssertionError("worker %d: %d cached tokens, %d computed, expected %d cached"
                                 % (i + 1, r["cached"], r["computed"], want[i]))
    k = want[1] // ps
    if r2["page_ids"][:k] != r1["page_ids"][:k]:
        raise AssertionError("worker 2's cached pages %s are not worker 1's %s"
                             % (r2["page_ids"][:k], r1["page_ids"][:k]))
    if r2["cached_digests"] != r1["prompt_digests"][:k]:
        raise AssertionError("worker 2 read other bytes in the cached pages than worker 1 wrote")
    if log:
        for i, r in enumerate(out):
            log("worker %d (%s): prompt %d tokens, %d from the cache, computed %d; decoded %s; "
                "max err %.3g" % (i + 1, namespaces[i], r["prompt_len"], r["cached"],
                                  r["computed"], r["decoded"], r["max_err"]))
    return out


def _tokens_arg(s):
    return np.array([int(x) for x in s.split(",") if x], np.int64)


def serve_main(a, serve_fn, name, mismatch=GeometryMismatch):
    """The --serve worker process: prints its log, then one line "RESULT <json>"; exits with
    2 when serve_fn raises `mismatch` (the pool does not fit the model)."""
    try:
        with kvpool.Client(a.socket, a.namespace, 0, cache_scope=a.cache_scope) as c:
            if a.flush:
                c.cache_flush()
            r = serve_fn(c, _tokens_arg(a.system), _tokens_arg(a.question), seed=a.seed,
                         decode_steps=a.decode_steps, log=print)
            c.audit()
    except mismatch as e:
        print("%s: %s" % (name, e), file=sys.stderr)
        return 2
    print("RESULT " + json.dumps(r))
    return 0


def add_shared_args(ap):
    ap.add_argument("--shared-prompt", action="store_true",
                    help="two worker processes serve a shared system prompt from the cache")
    ap.add_argument("--cache-scope", default=SHARED_SCOPE)
    ap.add_argument("--decode-steps", type=int, default=SHARED_DECODE_STEPS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a worker process
    ap.add_argument("--system", default="", help=argparse.SUPPRESS)
    ap.add_argument("--question", default="", help=argparse.SUPPRESS)
    ap.add_argument("--flush", action="store_true", help=argparse.SUPPRESS)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socket", help="kvpoold socket (default: $KVPOOL_SOCKET or the default)")
    ap.add_argument("--namespace", default="worker-loop")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="leave the sequences in the pool")
    add_shared_args(ap)
    a = ap.parse_args(argv)
    if a.serve:
        return serve_main(a, serve, "worker_loop")
    if a.shared_prompt:
        try:
            shared_prompt(a.socket, seed=a.seed, decode_steps=a.decode_steps,
                          scope=a.cache_scope, log=print)
        except GeometryMismatch as e:
            print("worker_loop: %s" % e, file=sys.stderr)
            return 2
        print("ok")
        return 0
    try:
        with kvpool.Client(a.socket, a.namespace) as c:
            st = run(c, steps=a.steps, seed=a.seed, log=print)
            if not a.keep:
                c.release(st["seqs"])
            c.audit()
    except GeometryMismatch as e:
        print("worker_loop: %s" % e, file=sys.stderr)
        return 2
    print("max err %.3g over %d steps (%d reserve, %d daemon Append), %d fork, %d truncate, "
          "%d copy-on-write copies" % (st["max_err"], st["steps"], st["reserve_steps"],
                                       st["daemon_appends"], st["forks"], st["truncates"],
                                       st["cow_copies"]))
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
