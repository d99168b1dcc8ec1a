#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""worker_loop_torch.py - worker_loop.py on PyTorch: a tiny decoder whose KV lives only in kvpool.

The same model and step logic as worker_loop.py (read its docstring): L layers, hidden 64, 4
query heads, 2 KV heads (GQA), head_dim 16, random weights; prefill of prompts of different
lengths, then decode steps with one fork (copy-on-write) and one truncation (rollback), each
step checked against the same model run on a plain contiguous cache. Here the arithmetic is
PyTorch in the pool's dtype (attention scores and softmax in float32), and:

  * on the cuda backend the pool views are CUDA tensors over the daemon's pool mapped in this
    process (Client.k_view / paged_kv_cache); the hot path is Reserve + Client.apply_copies +
    per layer kvpool.append_paged_kv_cache (the CUDA kernel libkvpool exports), on the current
    stream; every 4th step is a daemon-run Append from a CUDA staging buffer
    (Client.alloc_staging: VMM memory shared by fd; the daemon waits on an interprocess event
    recorded on our stream after the staging copy);
  * on the host backend the views are CPU tensors over the mapped memfd pool (float32 only).

--shared-prompt (shared_prompt()) is worker_loop.py's shared system prompt on these pieces:
two worker processes running this file, the second reusing the first's system-prompt pages
from the prefix cache (on the cuda backend commit() records an interprocess event after the
in-process appends; the daemon publishes the pages once it completes) and computing only the
rest, checked against a contiguous run of the whole request.

Attention reads K/V only through the daemon's page table. Half-precision runs are compared
with a tolerance (TOLERANCES); the daemon Append's pages must hold the staged rows bit for bit.

    kvpoold --backend cuda --num-layers 2 --num-kv-heads 2 --head-dim 16 --dtype fp16 \\
            --page-size 4 --num-pages 256
    python3 worker_loop_torch.py [--socket PATH] [--steps 24] [--seed 0]
    python3 worker_loop_torch.py [--socket PATH] --shared-prompt
"""
import argparse
import hashlib
import os
import sys

import numpy as np
import torch

try:
    import kvpool
except ImportError:  # run from the source tree without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import kvpool

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import worker_loop  # noqa: E402  (the step logic, shared: worker_loop.drive)

HIDDEN, NUM_Q_HEADS = worker_loop.HIDDEN, worker_loop.NUM_Q_HEADS
NUM_KV_HEADS, HEAD_DIM = worker_loop.NUM_KV_HEADS, worker_loop.HEAD_DIM
VOCAB, PROMPT_LENS = worker_loop.VOCAB, worker_loop.PROMPT_LENS
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# largest |paged - contiguous| allowed per dtype (the two runs do the same arithmetic on the
# same values, so any difference is a bug; the bounds are the usual half-precision ones)
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


class GeometryMismatch(RuntimeError):
    """The daemon's pool does not have the model's geometry."""


class Model:
    def __init__(self, num_layers, dtype, device, seed=0):
        g = torch.Generator().manual_seed(seed)
        s = 1.0 / HIDDEN ** 0.5

        def w(*shape, scale=s):
            return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

        self.L, self.dtype, self.device = num_layers, dtype, device
        self.embed = w(VOCAB, HIDDEN, scale=1.0)
        self.wq = [w(HIDDEN, NUM_Q_HEADS * HEAD_DIM) for _ in range(num_layers)]
        self.wk = [w(HIDDEN, NUM_KV_HEADS * HEAD_DIM) for _ in range(num_layers)]
        self.wv = [w(HIDDEN, NUM_KV_HEADS * HEAD_DIM) for _ in range(num_layers)]
        self.wo = [w(NUM_Q_HEADS * HEAD_DIM, HIDDEN) for _ in range(num_layers)]
        pos = torch.arange(4096, dtype=torch.float64)[:, None]
        i = torch.arange(HIDDEN)[None, :]
        ang = pos / torch.pow(10000.0, (2 * (i // 2)).double() / HIDDEN)
        pe = torch.where(i % 2 == 0, torch.sin(ang), torch.cos(ang)) * 0.1
        self.pos_emb = pe.to(device=device, dtype=dtype)

    def forward(self, store, tokens, starts):
        """Per-layer outputs [L][nnz, HIDDEN] and each entry's next token (argmax)."""
        dev = self.device
        counts = [len(t) for t in tokens]
        ind = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        flat = torch.tensor(np.concatenate([np.asarray(t, np.int64) for t in tokens]),
                            device=dev)
        posn = torch.tensor(np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)]),
                            device=dev)
        x = self.embed[flat] + self.pos_emb[posn]
        nnz = x.shape[0]
        group = NUM_Q_HEADS // NUM_KV_HEADS
        scale = 1.0 / HEAD_DIM ** 0.5
        outs = []
        for layer in range(self.L):
            q = (x @ self.wq[layer]).view(nnz, NUM_Q_HEADS, HEAD_DIM)
            k = (x @ self.wk[layer]).view(nnz, NUM_KV_HEADS, HEAD_DIM).contiguous()
            v = (x @ self.wv[layer]).view(nnz, NUM_KV_HEADS, HEAD_DIM).contiguous()
            store.write(layer, k, v)
            attn = torch.empty(nnz, NUM_Q_HEADS * HEAD_DIM, dtype=self.dtype, device=dev)
            for b in range(len(tokens)):
                K, V = store.read(layer, b)  # [S, Hkv, D]
                S, n = K.shape[0], counts[b]
                assert S == starts[b] + n, (S, starts[b], n)
                qb = q[ind[b]:ind[b + 1]].permute(1, 0, 2).float()  # [Hq, n, D]
                Kh = K.repeat_interleave(group, dim=1).permute(1, 2, 0).float()  # [Hq, D, S]
                Vh = V.repeat_interleave(group, dim=1).permute(1, 0, 2).float()  # [Hq, S, D]
                sc = (qb @ Kh) * scale
                qpos = starts[b] + torch.arange(n, device=dev)[:, None]
                sc = sc.masked_fill(torch.arange(S, device=dev)[None, :] > qpos, float("-inf"))
                o = torch.softmax(sc, dim=-1) @ Vh  # [Hq, n, D]
                attn[ind[b]:ind[b + 1]] = o.permute(1, 0, 2).reshape(n, -1).to(self.dtype)
            x = attn @ self.wo[layer] + x
            outs.append(x)
        last = x[torch.tensor(ind[1:] - 1, device=dev)]
        logits = last.float() @ self.embed.float().T
        return outs, [int(t) for t in torch.argmax(logits, dim=-1).tolist()]


class ContiguousKV(worker_loop.ContiguousKV):
    """The reference: one contiguous [len, Hkv, D] tensor per sequence and layer."""

    def __init__(self, num_layers, dtype, device):
        super().__init__(num_layers)
        self.dtype, self.device = dtype, device

    def _empty(self):
        return torch.zeros(0, NUM_KV_HEADS, HEAD_DIM, dtype=self.dtype, device=self.device)

    def _cat(self, parts):
        return torch.cat(parts)

    def _copy(self, a):
        return a.clone()


def _tensor(a):
    """A pool view as a tensor: the cuda backend's already are; host NumPy views are wrapped."""
    if isinstance(a, tuple):
        return tuple(_tensor(x) for x in a)
    return a if isinstance(a, torch.Tensor) else torch.from_numpy(a)


class PagedKV:
    """The step's K/V on the daemon's pool: "reserve" (Reserve + copies + per-layer in-process
    append) or "append" (layer by layer into a local staging copy, one daemon Append)."""

    def __init__(self, client, dtype, device, staging_tokens=64):
        self.c, self.dtype, self.device = client, dtype, device
        info = client.pool_info
        self.L, self.ps = info.num_layers, info.page_size
        self.hnd = info.layout == kvpool.Layout.HND
        self.layout = "HND" if self.hnd else "NHD"
        self.kview = [_tensor(client.k_view(l)) for l in range(self.L)]
        self.vview = [_tensor(client.v_view(l)) for l in range(self.L)]
        self.cache = [_tensor(client.paged_kv_cache(l)) for l in range(self.L)]
        self.row = NUM_KV_HEADS * HEAD_DIM * info.elem_bytes
        self.staging_tokens = staging_tokens
        self.buf, self.bid = client.alloc_staging(self.L * 2 * staging_tokens * self.row)
        self.cow_copies = 0

    def _dev_table(self, t):
        return {k: torch.from_numpy(np.ascontiguousarray(getattr(t, k))).to(self.device)
                for k in ("kv_indptr", "kv_indices", "kv_last_page_len", "append_indptr",
                          "seq_lens")}

    def begin_step(self, seqs, ntoks, old_lens, mode, table=None):
        """table: as in worker_loop.PagedKV.begin_step (a Reserve the caller made)."""
        self.seqs = np.asarray(seqs, np.uint64)
        self.ntoks = np.asarray(ntoks, np.uint32)
        self.old_lens = list(old_lens)
        self.mode = mode
        self.ind = np.concatenate([[0], np.cumsum(ntoks)]).astype(np.int64)
        nnz = int(self.ind[-1])
        if mode == "reserve":
            # the step's one RPC
            t = self.c.reserve(self.seqs, self.ntoks) if table is None else table
            self.c.apply_copies(t)  # copy-on-write, queued on the current stream
            self.cow_copies += int(t.copies.shape[0])
            self.table, self.td = t, self._dev_table(t)
            self.bi, self.pos = kvpool.get_batch_indices_positions(
                self.td["append_indptr"], self.td["seq_lens"], nnz)
        else:
            if nnz > self.staging_tokens:
                raise ValueError("step of %d tokens exceeds the staging buffer" % nnz)
            self.table = self.c.page_table(self.seqs) if any(self.old_lens) else None
            self.stage = torch.zeros(self.L, 2, nnz, NUM_KV_HEADS, HEAD_DIM, dtype=self.dtype,
                                     device=self.device)

    def write(self, layer, k, v):
        if self.mode == "reserve":
            td = self.td
            kvpool.append_paged_kv_cache(k, v, self.bi, self.pos, self.cache[layer],
                                         td["kv_indices"], td["kv_indptr"],
                                         td["kv_last_page_len"], kv_layout=self.layout)
        else:
            self.stage[layer, 0] = k
            self.stage[layer, 1] = v

    def _gather(self, view, table, b, length):
        pos = torch.arange(length)
        ip = int(table.kv_indptr[b])
        pages = torch.from_numpy(table.kv_indices[ip:ip + (length + self.ps - 1) // self.ps])
        pages = pages.long()[pos // self.ps].to(view.device)
        slots = (pos % self.ps).to(view.device)
        return view[pages, :, slots] if self.hnd else view[pages, slots]

    def read(self, layer, b):
        if self.mode == "reserve":
            S = int(self.table.seq_lens[b])
            return (self._gather(self.kview[layer], self.table, b, S),
                    self._gather(self.vview[layer], self.table, b, S))
        old, lo, hi = self.old_lens[b], self.ind[b], self.ind[b + 1]
        if old == 0:
            return self.stage[layer, 0, lo:hi], self.stage[layer, 1, lo:hi]
        return (torch.cat([self._gather(self.kview[layer], self.table, b, old),
                           self.stage[layer, 0, lo:hi]]),
                torch.cat([self._gather(self.vview[layer], self.table, b, old),
                           self.stage[layer, 1, lo:hi]]))

    def page_digest(self, table, b, p):
        """SHA-256 of the bytes of page p of request b (K and V, every layer) in the pool."""
        h = hashlib.sha256()
        page = int(table.kv_indices[table.kv_indptr[b] + p])
        for layer in range(self.L):
            for view in (self.kview[layer], self.vview[layer]):
                h.update(view[page].contiguous().view(torch.uint8).cpu().numpy().tobytes())
        return h.hexdigest()

    def end_step(self):
        if self.mode == "reserve":
            return
        nnz = int(self.ind[-1])
        raw = self.stage.reshape(-1).view(torch.uint8)
        if isinstance(self.buf, torch.Tensor):  # CUDA staging: a copy on the current stream
            self.buf[:raw.numel()].copy_(raw)
        else:
            self.buf[:raw.numel()] = raw.cpu().numpy()
        kv_bytes = nnz * self.row
        src = dict(buffer_id=self.bid, k_offset=0, v_offset=kv_bytes, layer_stride=2 * kv_bytes)
        t = self.c.append(self.seqs, self.ntoks, source=src)  # waits for our stream's copy
        want = [o + int(n) for o, n in zip(self.old_lens, self.ntoks)]
        if t.seq_lens.tolist() != want:
            raise AssertionError("daemon Append: seq_lens %s, expected %s"
                                 % (t.seq_lens.tolist(), want))
        for b in range(len(self.seqs)):  # the pages hold exactly the staged rows, bit for bit
            lo, hi = self.ind[b], self.ind[b + 1]
            for layer in range(self.L):
                for kv, view in ((0, self.kview[layer]), (1, self.vview[layer])):
                    got = self._gather(view, t, b, want[b])[self.old_lens[b]:]
                    exp = self.stage[layer, kv, lo:hi]
                    if not torch.equal(got.reshape(-1).view(torch.uint8),
                                       exp.reshape(-1).view(torch.uint8)):
                        raise AssertionError("daemon Append: layer %d %s of sequence %d differs "
                                             "from the staging data"
                                             % (layer, "KV"[kv], int(self.seqs[b])))
        self.table = t


def check_geometry(info, dtype_name):
    bad = worker_loop.geometry_problems(info, heads_per_device=NUM_KV_HEADS, head_dim=HEAD_DIM,
                                        dtype_name=dtype_name)
    if info.backend_name == "host" and dtype_name != "fp32":
        bad.append("a host pool runs this example in fp32 only")
    if bad:
        raise GeometryMismatch(
            "the daemon's pool does not match the model (%s); start it with: kvpoold --backend "
            "cuda --num-layers 2 --num-kv-heads %d --head-dim %d --dtype %s --page-size 4 "
            "--num-pages 256" % ("; ".join(bad), NUM_KV_HEADS, HEAD_DIM, dtype_name))


def run(client, steps=24, seed=0, seq_base=1000, prompt_lens=PROMPT_LENS, daemon_every=4,
        log=None):
    """As worker_loop.run (the same step logic: worker_loop.drive), on PyTorch in the pool's
    dtype. Returns the stats, with dtype and backend."""
    info = client.pool_info
    dtype_name = info.dtype_name
    check_geometry(info, dtype_name)
    dtype = DTYPES[dtype_name]
    device = torch.device("cuda", info.device_ids[0]) if info.backend_name == "cuda" else \
        torch.device("cpu")
    L = info.num_layers
    return worker_loop.drive(
        client, Model(L, dtype, device, seed=seed), ContiguousKV(L, dtype, device),
        PagedKV(client, dtype, device),
        lambda a, r: float((a.float() - r.float()).abs().max()), TOLERANCES[dtype],
        steps=steps, seed=seed, seq_base=seq_base, prompt_lens=prompt_lens,
        daemon_every=daemon_every, log=log, stats=dict(dtype=dtype_name,
                                                       backend=info.backend_name))


def _setup(client):
    info = client.pool_info
    dtype_name = info.dtype_name
    check_geometry(info, dtype_name)
    device = torch.device("cuda", info.device_ids[0]) if info.backend_name == "cuda" else \
        torch.device("cpu")
    return info, DTYPES[dtype_name], device


def serve(client, system, question, seed=0, decode_steps=worker_loop.SHARED_DECODE_STEPS,
          log=None):
    """worker_loop.serve_request (one request "system + question" on the prefix cache: reuse
    the cached prefix, compute the rest, commit) on PyTorch in the pool's dtype. On the cuda
    backend commit() records an interprocess event after the in-process appends, and the
    daemon publishes the pages once it completes."""
    info, dtype, device = _setup(client)
    L = info.num_layers
    paged = PagedKV(client, dtype, device)
    try:
        r = worker_loop.serve_request(
            client, Model(L, dtype, device, seed=seed), ContiguousKV(L, dtype, device), paged,
            lambda a, r: float((a.float() - r.float()).abs().max()), TOLERANCES[dtype], system,
            question, decode_steps=decode_steps, log=log)
    finally:
        client.unregister_buffer(paged.bid)
    return dict(r, dtype=info.dtype_name, backend=info.backend_name)


def shared_prompt(socket=None, seed=0, decode_steps=worker_loop.SHARED_DECODE_STEPS,
                  scope=worker_loop.SHARED_SCOPE, namespaces=("wlt-shared-1", "wlt-shared-2"),
                  log=None):
    """worker_loop.shared_prompt with worker processes running this file (PyTorch)."""
    try:
        return worker_loop.shared_prompt(socket, seed=seed, decode_steps=decode_steps,
                                         scope=scope, namespaces=namespaces,
                                         script=os.path.abspath(__file__), log=log)
    except worker_loop.GeometryMismatch as e:
        raise GeometryMismatch(str(e)) from None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socket", help="kvpoold socket (default: $KVPOOL_SOCKET or the default)")
    ap.add_argument("--namespace", default="worker-loop-torch")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    worker_loop.add_shared_args(ap)
    a = ap.parse_args(argv)
    if a.serve:
        return worker_loop.serve_main(a, serve, "worker_loop_torch", GeometryMismatch)
    if a.shared_prompt:
        try:
            shared_prompt(a.socket, seed=a.seed, decode_steps=a.decode_steps,
                          scope=a.cache_scope, log=print)
        except GeometryMismatch as e:
            print("worker_loop_torch: %s" % e, file=sys.stderr)
            return 2
        print("ok")
        return 0
    try:
        with kvpool.Client(a.socket, a.namespace) as c:
            st = run(c, steps=a.steps, seed=a.seed, log=print)
            c.release(st["seqs"])
            c.audit()
    except GeometryMismatch as e:
        print("worker_loop_torch: %s" % e, file=sys.stderr)
        return 2
    print("%s %s: max err %.3g over %d steps (%d reserve, %d daemon Append), %d fork, %d "
          "truncate, %d copy-on-write copies" % (st["backend"], st["dtype"], st["max_err"],
                                                st["steps"], st["reserve_steps"],
                                                st["daemon_appends"], st["forks"],
                                                st["truncates"], st["cow_copies"]))
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
