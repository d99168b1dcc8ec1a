#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""bench_hf.py - issue #17's benchmark: a Llama-architecture model (random weights, a given
geometry; default Llama-3.1-8B's: 32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128)
on kvpool (kvpool.integrations.transformers) against transformers' own cache, in one run:

  ttft      time to first token of a P-token prompt: cold (nothing cached), warm (the prompt's
            full pages cached by ANOTHER process, which prefilled it and exited), and
            transformers' own cache; the ratio warm / cold (target <= 0.1)
  decode    time per generated token at batch 1 and 32 with a context of C tokens: kvpool
            (FlashInfer attention when importable, else gather + SDPA) against transformers'
            own cache (target: no slower)

Medians of --repeat runs; CUDA events on a GPU, wall time on the CPU. Figures printed last as
key=value lines. The daemon must have the model's geometry and enough pages, e.g. on the H200:

    kvpoold --backend cuda --num-layers 32 --num-kv-heads 8 --head-dim 128 --dtype bf16 \\
            --page-size 16 --num-pages 40000 &
    python3 tests/bench/bench_hf.py --device cuda --dtype bfloat16

and a CPU smoke run of the code with a tiny model:

    kvpoold --backend host --num-layers 2 --num-kv-heads 2 --head-dim 16 --dtype fp32 \\
            --page-size 16 --num-pages 4096 &
    python3 tests/bench/bench_hf.py --tiny --prompt 300 --context 200 --batches 1,2 \\
            --new-tokens 4 --repeat 1

Not run by CI (needs torch and transformers, and a GPU for the figures that count).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import kvpool  # noqa: E402


def model_of(args):
    import torch
    import transformers
    torch.manual_seed(args.seed)
    if args.tiny:
        layers, hidden, heads, kv, dim, vocab = 2, 64, 4, 2, 16, 1000
    else:
        layers, hidden, heads, kv, dim, vocab = (args.layers, args.hidden, args.heads,
                                                 args.kv_heads, args.head_dim, args.vocab)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(args.ffn_mult * hidden),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=dim, max_position_embeddings=max(args.prompt, args.context) + 4096)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))  # built in the dtype: no fp32 copy
    try:
        with torch.device(args.device):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval(), vocab


def prompts_of(n, length, vocab, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


class Timer:
    """Seconds of fn(): CUDA events on a GPU (after a synchronize), else wall time."""

    def __init__(self, device):
        import torch
        self.torch, self.cuda = torch, device.startswith("cuda")

    def __call__(self, fn):
        torch = self.torch
        if self.cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            return out, a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


class StepClock:
    """A transformers StoppingCriteria that stops nothing and stamps the time after each step
    (generate() calls it once per forward step, after the token is chosen): a synchronize, then
    perf_counter. Decode steps are the differences between consecutive stamps."""

    def __init__(self, cuda):
        import torch
        self.torch, self.cuda, self.stamps = torch, cuda, []

    def __call__(self, input_ids, scores, **kw):
        if self.cuda:
            self.torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        return self.torch.zeros(input_ids.shape[0], dtype=self.torch.bool,
                                device=input_ids.device)

    def decode_steps(self):
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def _criteria(clock):
    from transformers import StoppingCriteriaList
    return {} if clock is None else {"stopping_criteria": StoppingCriteriaList([clock])}


def kv_generate(model, client, prompts, new, salt=None, clock=None, cache_out=None,
                graphs=False):
    from kvpool.integrations.transformers import KvpoolCache, kvpool_generate
    model.set_attn_implementation("kvpool")
    cache = KvpoolCache(model, client, salt=salt, cuda_graphs=graphs)
    if cache_out is not None:
        cache_out.append(cache)
    out = kvpool_generate(model, client, prompts, cache=cache, max_new_tokens=new,
                          do_sample=False, **_criteria(clock))
    return out, cache.last_prefill


def hf_generate(model, prompts, new, clock=None):
    import torch
    model.set_attn_implementation("sdpa")
    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              do_sample=False, pad_token_id=0, **_criteria(clock))


def prefill_in_another_process(args, salts):
    """The warm case's other process: this script with --prefill-only, which generates one
    token for the prompt under each salt (committing its full pages) and exits."""
    cmd = [sys.executable, os.path.abspath(__file__), "--prefill-only", ",".join(salts)] + \
        sys.argv[1:]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _is_kvpool_append(name):
    """libkvpool's append kernels (kernels/kvp_append_cuda_copy.cuh since issue #27:
    copy_block_kernel, copy_warp_kernel, copy_flat_kernel, copy_inline_kernel; before it
    copy_kernel and copy_row_kernel), not PyTorch's copy kernels
    (at::native::...direct_copy_kernel...)."""
    names = ("copy_block_kernel<", "copy_warp_kernel<", "copy_flat_kernel<", "copy_inline_kernel<",
             "copy_kernel<", "copy_row_kernel<")
    return any(k in name for k in names) and "at::" not in name and "direct_copy" not in name


class ProfClock(StepClock):
    """A StepClock that runs torch.profiler (CUDA activity: CUPTI sees every library's
    kernels, libkvpool's too) from the first stamp (the prefill done) to stop()."""

    def __call__(self, input_ids, scores, **kw):
        out = StepClock.__call__(self, input_ids, scores, **kw)
        if len(self.stamps) == 1:
            from torch.profiler import ProfilerActivity, profile
            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.start()
        return out

    def stop(self):
        """(GPU seconds of kvpool's append kernels, of all kernels) in the decode steps."""
        self.torch.cuda.synchronize()
        self.prof.stop()
        mine = total = 0.0
        self.matched = set()
        for e in self.prof.key_averages():
            t = getattr(e, "device_time_total", None)
            if t is None:
                t = e.cuda_time_total
            if not t or e.key.startswith("ProfilerStep"):
                continue
            total += t
            if _is_kvpool_append(e.key):
                mine += t
                self.matched.add(e.key[:80])
        return mine / 1e6, total / 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socket", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke runs)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn-mult", type=float, default=3.5)  # 14336 / 4096 in Llama-3.1-8B
    ap.add_argument("--prompt", type=int, default=10000)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="also decode with KvpoolCache(cuda_graphs=True)")
    ap.add_argument("--prefill-only", default=None, help=argparse.SUPPRESS)  # the other process
    args = ap.parse_args()
    if args.prefill_only is not None:
        model, vocab = model_of(args)
        prompt = prompts_of(1, args.prompt, vocab, args.seed + 1)
        pfs = []
        with kvpool.Client(args.socket, "bench-hf-other", 0, cache_scope="bench-hf") as c:
            for salt in args.prefill_only.split(","):
                _, pf = kv_generate(model, c, prompt, 1, salt=salt.encode())
                pfs.append(pf)
        print(json.dumps(pfs))
        return 0
    model, vocab = model_of(args)
    timer = Timer(args.device)
    figures = {}
    prompt = prompts_of(1, args.prompt, vocab, args.seed + 1)
    with kvpool.Client(args.socket, "bench-hf", 0, cache_scope="bench-hf") as c:
        # warm-up: every path once (kernels, FlashInfer's JIT, allocator caches)
        small = prompts_of(2, 64, vocab, args.seed + 99)
        kv_generate(model, c, small, 4, salt=b"warm-up-%d" % os.getpid())
        hf_generate(model, small, 4)
        # ---- time to first token ----
        cold, warm, hf, warm_rpc, warm_fwd = [], [], [], [], []
        # the other process prefills the prompt once per repeat (a salt each: a fresh prefix
        # every time) and exits before the timed runs
        wsalts = ["warm-%d-%d" % (os.getpid(), r) for r in range(args.repeat)]
        for other in prefill_in_another_process(args, wsalts):
            assert other["cached_tokens"] == [0], other
        ps = c.pool_info.page_size
        want = (args.prompt - 1) // ps * ps
        for r in range(args.repeat):
            salt = b"cold-%d-%d" % (os.getpid(), r)
            (_, pf), t = timer(lambda: kv_generate(model, c, prompt, 1, salt=salt))
            assert pf["cached_tokens"] == [0], pf
            cold.append(t)
            (_, pf), t = timer(lambda: kv_generate(model, c, prompt, 1,
                                                   salt=wsalts[r].encode()))
            assert pf["cached_tokens"] == [want], (pf, want)
            warm.append(t)
            warm_rpc.append(pf["reserve_ms"] + pf.get("commit_ms", 0.0))
            warm_fwd.append(pf["forward_ms"])
            _, t = timer(lambda: hf_generate(model, prompt, 1))
            hf.append(t)
        figures["ttft_cold_ms"] = statistics.median(cold) * 1e3
        figures["ttft_warm_ms"] = statistics.median(warm) * 1e3
        figures["ttft_hf_ms"] = statistics.median(hf) * 1e3
        figures["ttft_warm_over_cold"] = figures["ttft_warm_ms"] / figures["ttft_cold_ms"]
        figures["ttft_warm_daemon_ms"] = statistics.median(warm_rpc)
        print("time to first token, %d-token prompt: cold %.1f ms, warm %.1f ms (%.3f of cold; "
              "%d tokens cached by another process), transformers %.1f ms" %
              (args.prompt, figures["ttft_cold_ms"], figures["ttft_warm_ms"],
               figures["ttft_warm_over_cold"], want, figures["ttft_hf_ms"]))
        figures["ttft_warm_forward_ms"] = statistics.median(warm_fwd)
        print("  warm: the daemon's part (the Reserve that links the cached pages + the Commit) "
              "%.2f ms; the one forward of the uncached suffix (host time of the call) %.2f ms; "
              "the rest is generate()'s own work around its first token" % (
                  figures["ttft_warm_daemon_ms"], figures["ttft_warm_forward_ms"]))
        # ---- decode: every step of --new-tokens stamped (StepClock), medians over the steps
        # of --repeat generations each ----
        cuda = args.device.startswith("cuda")
        for B in [int(b) for b in args.batches.split(",")]:
            prompts = prompts_of(B, args.context, vocab, args.seed + 2 + B)
            per = {"kvpool": [], "hf": [], "graphs": []}
            host = dict(reserve=0.0, append=0.0, attention_plan=0.0)
            for r in range(args.repeat):
                clock, caches = StepClock(cuda), []
                kv_generate(model, c, prompts, args.new_tokens + 1,
                            salt=b"dec-%d-%d-%d" % (os.getpid(), B, r), clock=clock,
                            cache_out=caches)
                per["kvpool"] += clock.decode_steps()
                clock = StepClock(cuda)
                hf_generate(model, prompts, args.new_tokens + 1, clock=clock)
                per["hf"] += clock.decode_steps()
                if args.cuda_graphs:
                    clock = StepClock(cuda)
                    kv_generate(model, c, prompts, args.new_tokens + 1,
                                salt=b"dec-g-%d-%d-%d" % (os.getpid(), B, r), clock=clock,
                                graphs=True)
                    per["graphs"] += clock.decode_steps()
            # kvpool's own host time in the decode steps: one more generation, the counters
            # read after its prefill and at its end
            clock, caches = StepClock(cuda), []

            class Mark(StepClock):
                def __call__(self, input_ids, scores, **kw):
                    if not self.stamps:
                        self.first = dict(caches[0].host_seconds)
                    return StepClock.__call__(self, input_ids, scores, **kw)

            mark = Mark(cuda)
            kv_generate(model, c, prompts, args.new_tokens + 1, salt=b"dec-h-%d-%d" % (
                os.getpid(), B), clock=mark, cache_out=caches)
            steps = sum(mark.decode_steps())
            figures["decode_b%d_append_fallbacks" % B] = caches[0].append_fallbacks
            for key in host:
                host[key] = (caches[0].host_seconds[key] - mark.first[key]) / steps
            if args.cuda_graphs:  # the same from graph replays: the Reserve is all that is left
                caches.clear()
                mark = Mark(cuda)
                kv_generate(model, c, prompts, args.new_tokens + 1, salt=b"dec-gh-%d-%d" % (
                    os.getpid(), B), clock=mark, cache_out=caches, graphs=True)
                gsteps = sum(mark.decode_steps())
                greserve = (caches[0].host_seconds["reserve"] - mark.first["reserve"]) / gsteps
                figures["decode_b%d_graphs_host_reserve_share" % B] = greserve
                print("decode, batch %d, CUDA graphs: host time in the step: Reserve + page "
                      "table %.2f%% (the appends and attention run inside the graph)" % (
                          B, 100 * greserve))
            k = statistics.median(per["kvpool"]) * 1e3
            h = statistics.median(per["hf"]) * 1e3
            figures["decode_b%d_kvpool_ms" % B] = k
            figures["decode_b%d_hf_ms" % B] = h
            figures["decode_b%d_ratio" % B] = k / h
            if per["graphs"]:
                gk = statistics.median(per["graphs"]) * 1e3
                figures["decode_b%d_kvpool_graphs_ms" % B] = gk
                figures["decode_b%d_graphs_ratio" % B] = gk / h
                print("decode, batch %d: kvpool with CUDA graphs %.2f ms/token (%.2fx "
                      "transformers)" % (B, gk, gk / h))
            figures["decode_b%d_host_reserve_share" % B] = host["reserve"]
            figures["decode_b%d_host_append_share" % B] = host["append"]
            figures["decode_b%d_host_attention_plan_share" % B] = host["attention_plan"]
            print("decode, batch %d, context %d: kvpool %.2f ms/token, transformers %.2f "
                  "ms/token (%.2fx); host time in the step: Reserve + page table %.2f%%, "
                  "append launches %.2f%%, attention plan %.2f%%" % (
                      B, args.context, k, h, k / h, 100 * host["reserve"],
                      100 * host["append"], 100 * host["attention_plan"]))
            if cuda:  # the append kernels' GPU time in the decode steps (torch.profiler)
                prof = ProfClock(cuda)
                kv_generate(model, c, prompts, args.new_tokens + 1, salt=b"dec-p-%d-%d" % (
                    os.getpid(), B), clock=prof)
                mine, total = prof.stop()
                n = len(prof.stamps) - 1
                figures["decode_b%d_append_kernel_us" % B] = mine / n * 1e6
                figures["decode_b%d_append_kernel_share" % B] = mine / n / (k / 1e3)
                print("  GPU: append kernels %.1f us a decode step (%.3f%% of the step), all "
                      "kernels %.2f ms a step; counted as kvpool's: %s" % (
                          mine / n * 1e6, 100 * mine / n / (k / 1e3), total / n * 1e3,
                          sorted(prof.matched)))
    for key, v in figures.items():
        print("%s=%.4g" % (key, v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
