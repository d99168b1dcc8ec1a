#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""bench_multiturn.py - issue #28's multi-turn benchmark: many conversations whose KV is about
4x the GPU pool, revisited in random order, on bench_hf.py's random Llama-architecture model
(default Llama-3.1-8B's geometry) through kvpool_generate and KvpoolCache, three ways in one
run, each against a daemon of its own ($KVPOOLD or --kvpoold):

  tier       a pool of P pages with a host tier of 4P pages (--tier-factor), the demoter
             keeping --demote-free-pct of the pool free (default: room for 1.25 conversations)
  notier     the same pool, no tier: what leaves the GPU is computed again
  unbounded  a pool with pages for every conversation: the ceiling

Each conversation starts with --first-tokens tokens of its own; a turn is the conversation so
far (its earlier turns' generated tokens included) + --turn-tokens new ones, generating
--new-tokens greedily (eos off, so every run has the same lengths). All conversations are
visited once in order, then revisited --turns - 1 times each in one seeded random order (the
same for the three ways). Figures over the revisits, as key=value lines last:
multiturn_<way>_hit_rate ((hit_tokens_total + host_hit_tokens_total) / query_tokens_total of
cache_stats(), deltas over the revisits), multiturn_<way>_ttft_p50_ms / _p99_ms (a turn's time
to its first token, a synchronize before and after), and the ratios multiturn_tier_over_notier_*
and multiturn_tier_over_unbounded_* of the three.

On the H200 (under 3 minutes for the three ways with the defaults: 32 conversations of ~3,300
tokens, P = 1,640 pages of 16 tokens):

    KVPOOLD=... python3 tests/bench/bench_multiturn.py --device cuda --dtype bfloat16 \\
        --vocab 128256

--smoke (or KVPOOL_HF_GPU_SMOKE=1) runs the same code on a CPU: the host backend, bench_hf.py's
tiny model, 16 short conversations; a check of the code, not figures. Not run by CI.
"""
import argparse
import math
import os
import random
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_hf  # noqa: E402  (its ROOT puts client/python on sys.path)
from bench_hf import (Daemon, StepClock, kv_generate, kvpool, kvpoold_path,  # noqa: E402
                      tier_settings, wait_tier_ready)

WAYS = ("tier", "notier", "unbounded")
DTYPE = {"float32": ("fp32", 4), "float16": ("fp16", 2), "bfloat16": ("bf16", 2)}
# (H200 default, smoke) of the size flags left unset
SIZES = {"conversations": (32, 16), "turns": (5, 3), "first_tokens": (3000, 96),
         "turn_tokens": (64, 16), "new_tokens": (4, 2)}


class Plan:
    """The workload, the same for every way: each conversation's first tokens and each turn's
    new tokens (seeded), and the revisit order [(conversation, turn)]."""

    def __init__(self, args, vocab):
        rng = np.random.default_rng(args.seed + 5)
        N, T = args.conversations, args.turns
        self.first = [rng.integers(3, vocab, args.first_tokens).tolist() for _ in range(N)]
        self.user = [[rng.integers(3, vocab, args.turn_tokens).tolist() for _ in range(T)]
                     for _ in range(N)]
        order = [i for i in range(N) for _ in range(T - 1)]
        random.Random(args.seed + 6).shuffle(order)
        seen = [0] * N
        self.revisits = []
        for i in order:
            seen[i] += 1
            self.revisits.append((i, seen[i]))


def sizes(args):
    """(tokens of a conversation at its end, pages it holds then, pages of all, pool pages P,
    host pages, unbounded pool pages, demote percentage)."""
    ps = args.page_size
    final = args.first_tokens + (args.turns - 1) * (args.turn_tokens + args.new_tokens) + \
        args.new_tokens
    conv = -(-final // ps)
    total = args.conversations * conv
    pool = args.pool_pages or max(total // 4, 3 * conv)
    host = int(math.ceil(args.tier_factor * pool))
    unbounded = total + 2 * args.conversations + 256  # + the warm-up's and partial pages
    pct = args.demote_free_pct or min(50, max(5, -(-125 * conv // pool)))
    return final, conv, total, pool, host, unbounded, pct


def turn(model, c, cuda, convs, plan, i, k, new):
    """Conversation i's turn k (0: its first tokens only): its prompt generated from, timed;
    the conversation grows by the turn's tokens and the generated ones. Returns (seconds to the
    first token, prompt tokens, tokens the Reserve linked from the cache)."""
    import torch
    prompt = convs[i] + (plan.user[i][k] if k else [])
    clock = StepClock(cuda)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out, pf = kv_generate(model, c, [prompt], new, clock=clock)
    ttft = clock.stamps[0] - t0
    convs[i] = out[0].tolist()
    assert len(convs[i]) == len(prompt) + new, (len(convs[i]), len(prompt), new)
    return ttft, len(prompt), pf["cached_tokens"][0]


def run_way(way, args, binary, model, vocab, plan, geometry, page_bytes, sz):
    """One way against a daemon of its own: the first visits, then the revisits; returns its
    figures (and prints a line)."""
    _, _, _, pool, host, unbounded, pct = sz
    cuda = args.device.startswith("cuda")
    pages = unbounded if way == "unbounded" else pool
    extra = tier_settings(host * page_bytes, pct) if way == "tier" else []
    t0 = time.perf_counter()
    d = Daemon(binary, geometry + ["--num-pages", str(pages)] + extra)
    try:
        with kvpool.Client(d.sock, "multiturn", 0, cache_scope="multiturn") as c:
            assert c.stats().page_bytes == page_bytes, (c.stats(), page_bytes)
            if way == "tier":
                wait_tier_ready(c, host)
            # warm-up (kernels, FlashInfer's plans on this pool), then nothing cached
            small = bench_hf.prompts_of(2, 64, vocab, args.seed + 99)
            kv_generate(model, c, small, 4)
            c.cache_flush()
            convs = [list(p) for p in plan.first]
            first = [turn(model, c, cuda, convs, plan, i, 0, args.new_tokens)
                     for i in range(args.conversations)]
            s1 = c.cache_stats()
            t1 = time.perf_counter()
            recs = [turn(model, c, cuda, convs, plan, i, k, args.new_tokens)
                    for i, k in plan.revisits]
            t2 = time.perf_counter()
            s2 = c.cache_stats()
            c.audit()
    finally:
        d.stop()
    delta = lambda k: getattr(s2, k) - getattr(s1, k)  # noqa: E731
    query, hits = delta("query_tokens_total"), delta("hit_tokens_total")
    host_hits = delta("host_hit_tokens_total")
    # the Reserves' own count of what they linked agrees with the cache's counters
    assert (sum(r[1] for r in recs), sum(r[2] for r in recs)) == (query, hits + host_hits), \
        (query, hits, host_hits, sum(r[1] for r in recs), sum(r[2] for r in recs))
    ttft = np.array([r[0] for r in recs]) * 1e3
    f = {"hit_rate": (hits + host_hits) / query,
         "ttft_p50_ms": float(np.percentile(ttft, 50)),
         "ttft_p99_ms": float(np.percentile(ttft, 99)),
         "ttft_first_visit_p50_ms": float(np.percentile([r[0] for r in first], 50)) * 1e3,
         "host_hit_share": host_hits / query,
         "pressure_evictions": delta("evictions_pressure_total"),
         "seconds": time.perf_counter() - t0}
    if way == "tier":
        f.update(demotions=delta("demotions_total"), promotions=delta("promotions_total"),
                 host_evictions=delta("host_evictions_total"),
                 restore_ms_per_turn=delta("restore_us_total") / 1e3 / len(recs))
    print("%-9s pool %d pages%s: %d revisits in %.1f s, token hit rate %.3f (host %.3f), TTFT "
          "p50 %.1f ms, p99 %.1f ms (first visits p50 %.1f ms); %d pages evicted without a copy%s"
          % (way, pages, " + host tier %d pages (demote_free_pct %d)" % (host, pct)
             if way == "tier" else "", len(recs), t2 - t1, f["hit_rate"], f["host_hit_share"],
             f["ttft_p50_ms"], f["ttft_p99_ms"], f["ttft_first_visit_p50_ms"],
             f["pressure_evictions"],
             "; %d demoted, %d restored, %d dropped from host, restore %.2f ms a turn" % (
                 f["demotions"], f["promotions"], f["host_evictions"],
                 f["restore_ms_per_turn"]) if way == "tier" else ""))
    return f


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bench_hf.add_model_args(ap)
    ap.add_argument("--smoke", action="store_true",
                    help="the host backend, the tiny model, few short conversations (also "
                         "KVPOOL_HF_GPU_SMOKE=1)")
    ap.add_argument("--conversations", type=int, default=None, help="default 32 (smoke 16)")
    ap.add_argument("--turns", type=int, default=None,
                    help="visits per conversation, the first included (default 5, smoke 3)")
    ap.add_argument("--first-tokens", type=int, default=None, help="default 3000 (smoke 96)")
    ap.add_argument("--turn-tokens", type=int, default=None,
                    help="new tokens a turn adds (default 64, smoke 16)")
    ap.add_argument("--new-tokens", type=int, default=None,
                    help="tokens generated a turn (default 4, smoke 2)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool-pages", type=int, default=0,
                    help="P (0: a quarter of the conversations' pages, at least 3 "
                         "conversations')")
    ap.add_argument("--tier-factor", type=float, default=4.0, help="host tier = this x P")
    ap.add_argument("--demote-free-pct", type=int, default=0,
                    help="the tier way's cache.demote_free_pct (0: 125%% of a conversation's "
                         "pages, within 5..50)")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--kvpoold", default=None, help="default: $KVPOOLD, else build/server/kvpoold")
    args = ap.parse_args()
    # a timeout's SIGTERM unwinds too: every daemon this script started is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    smoke = args.smoke or os.environ.get("KVPOOL_HF_GPU_SMOKE") == "1"
    if smoke:
        args.tiny, args.device, args.dtype = True, "cpu", "float32"
    for key, (full, small) in SIZES.items():
        if getattr(args, key) is None:
            setattr(args, key, small if smoke else full)
    ways = [w for w in args.ways.split(",") if w]
    if not ways or any(w not in WAYS for w in ways) or args.turns < 2:
        ap.error("--ways takes %s; --turns at least 2" % ",".join(WAYS))
    binary = kvpoold_path(args.kvpoold)
    if binary is None:
        ap.error("no kvpoold: set $KVPOOLD or --kvpoold")
    sz = sizes(args)
    final, conv, total, pool, host, unbounded, pct = sz
    args.prompt, args.context = final + 64, 0  # model_of's max_position_embeddings
    model, vocab = bench_hf.model_of(args)
    model.generation_config.eos_token_id = None  # always --new-tokens tokens
    cfg = model.config
    dt, elem = DTYPE[args.dtype]
    geometry = ["--backend", "cuda" if args.device.startswith("cuda") else "host",
                "--num-layers", str(cfg.num_hidden_layers),
                "--num-kv-heads", str(cfg.num_key_value_heads), "--head-dim", str(cfg.head_dim),
                "--dtype", dt, "--page-size", str(args.page_size)]
    page_bytes = 2 * cfg.num_hidden_layers * args.page_size * cfg.num_key_value_heads * \
        cfg.head_dim * elem
    plan = Plan(args, vocab)
    print("%d conversations x %d visits, %d first tokens + %d a turn, %d generated a turn: "
          "%d tokens (%d pages) each at the end, %d pages in all = %.2f x the pool's %d "
          "(%.2f GiB); host tier %d pages%s" % (
              args.conversations, args.turns, args.first_tokens, args.turn_tokens,
              args.new_tokens, final, conv, total, total / pool, pool,
              pool * page_bytes / 2**30, host, " (smoke)" if smoke else ""))
    figures = {"multiturn_pool_pages": pool, "multiturn_kv_over_pool": total / pool}
    got = {}
    for way in ways:
        got[way] = run_way(way, args, binary, model, vocab, plan, geometry, page_bytes, sz)
        for key in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms"):
            figures["multiturn_%s_%s" % (way, key)] = got[way][key]
    for other in ("notier", "unbounded"):
        if "tier" in got and other in got:
            for key in ("hit_rate", "ttft_p50_ms", "ttft_p99_ms"):
                figures["multiturn_tier_over_%s_%s" % (other, key)] = \
                    got["tier"][key] / got[other][key] if got[other][key] else float("nan")
    for key, v in figures.items():
        print("%s=%.4g" % (key, v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
