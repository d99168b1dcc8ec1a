#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""flashinfer_warmup.py - builds FlashInfer's JIT modules that kvpool's transformers integration
uses (the paged decode and the causal paged prefill wrappers, as KvpoolCache plans them) before
the tests and benchmarks need them: FlashInfer compiles each module with nvcc on first use
(~20 s a module, per machine, cached under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer).
Run one process per dtype in the background at the start of a GPU run:

    python3 tests/gpu/flashinfer_warmup.py fp16 & python3 tests/gpu/flashinfer_warmup.py bf16 &

Each plans and runs a tiny batch on both wrappers (head_dim 128 unless --head-dim) and prints
the seconds the modules took (the prefill's backend: $KVPOOL_FLASHINFER_BACKEND, as
KvpoolCache reads it); exits 0 when every call ran, 1 (with the error) otherwise.
"""
import argparse
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dtype", choices=["fp16", "bf16"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    args = ap.parse_args()
    import torch
    import flashinfer

    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    dev = torch.device("cuda", 0)
    D, Hq, Hkv, ps, pages = args.head_dim, args.q_heads, args.kv_heads, 16, 8
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    k = torch.randn(pages, ps, Hkv, D, dtype=dt, device=dev)
    v = torch.randn_like(k)
    i32 = dict(dtype=torch.int32)
    indptr = torch.tensor([0, 3, 8], **i32)
    indices = torch.arange(8, **i32).to(dev)
    last = torch.tensor([5, 16], **i32)
    common = dict(pos_encoding_mode="NONE", sm_scale=D ** -0.5, logits_soft_cap=None,
                  q_data_type=dt, kv_data_type=dt)
    t0 = time.perf_counter()
    dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    dec.plan(indptr, indices, last, Hq, Hkv, D, ps, **common)
    dec.run(torch.randn(2, Hq, D, dtype=dt, device=dev), (k, v))
    t1 = time.perf_counter()
    backend = os.environ.get("KVPOOL_FLASHINFER_BACKEND", "auto")  # KvpoolCache's choice too
    pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    pre.plan(torch.tensor([0, 4, 9], **i32), indptr, indices, last, Hq, Hkv, D, ps,
             causal=True, **common)
    pre.run(torch.randn(9, Hq, D, dtype=dt, device=dev), (k, v))
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print("flashinfer %s warm: decode %.1f s, prefill (%s) %.1f s" % (args.dtype, t1 - t0, backend,
                                                                     t2 - t1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # the log says what failed
        print("flashinfer warm-up failed: %r" % (e,))
        sys.exit(1)
