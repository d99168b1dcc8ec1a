#!/usr/bin/env python3
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
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, args.dtype))
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


def kv_generate(model, client, prompts, new, salt=None):
    from kvpool.integrations.transformers import KvpoolCache, kvpool_generate
    model.set_attn_implementation("kvpool")
    cache = KvpoolCache(model, client, salt=salt)
    out = kvpool_generate(model, client, prompts, cache=cache, max_new_tokens=new,
                          do_sample=False)
    return out, cache.last_prefill


def hf_generate(model, prompts, new):
    import torch
    model.set_attn_implementation("sdpa")
    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              do_sample=False, pad_token_id=0)


def prefill_in_another_process(args, salt):
    """The warm case's other process: this script with --prefill-only, which generates one
    token for the prompt (committing its full pages) and exits."""
    cmd = [sys.executable, os.path.abspath(__file__), "--prefill-only", salt] + sys.argv[1:]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    ap.add_argument("--prefill-only", default=None, help=argparse.SUPPRESS)  # the other process
    args = ap.parse_args()
    if args.prefill_only is not None:
        salt = args.prefill_only.encode()
        model, vocab = model_of(args)
        prompt = prompts_of(1, args.prompt, vocab, args.seed + 1)
        with kvpool.Client(args.socket, "bench-hf-other", 0, cache_scope="bench-hf") as c:
            _, pf = kv_generate(model, c, prompt, 1, salt=salt)
        print(json.dumps(pf))
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
        cold, warm, hf = [], [], []
        for r in range(args.repeat):
            salt = b"cold-%d-%d" % (os.getpid(), r)
            (_, pf), t = timer(lambda: kv_generate(model, c, prompt, 1, salt=salt))
            assert pf["cached_tokens"] == [0], pf
            cold.append(t)
            wsalt = "warm-%d-%d" % (os.getpid(), r)
            other = prefill_in_another_process(args, wsalt)
            assert other["cached_tokens"] == [0], other
            (_, pf), t = timer(lambda: kv_generate(model, c, prompt, 1, salt=wsalt.encode()))
            ps = c.pool_info.page_size
            want = (args.prompt - 1) // ps * ps
            assert pf["cached_tokens"] == [want], (pf, want)
            warm.append(t)
            _, t = timer(lambda: hf_generate(model, prompt, 1))
            hf.append(t)
        figures["ttft_cold_ms"] = statistics.median(cold) * 1e3
        figures["ttft_warm_ms"] = statistics.median(warm) * 1e3
        figures["ttft_hf_ms"] = statistics.median(hf) * 1e3
        figures["ttft_warm_over_cold"] = figures["ttft_warm_ms"] / figures["ttft_cold_ms"]
        print("time to first token, %d-token prompt: cold %.1f ms, warm %.1f ms (%.3f of cold; "
              "%d tokens cached by another process), transformers %.1f ms" %
              (args.prompt, figures["ttft_cold_ms"], figures["ttft_warm_ms"],
               figures["ttft_warm_over_cold"], want, figures["ttft_hf_ms"]))
        # ---- decode ----
        for B in [int(b) for b in args.batches.split(",")]:
            prompts = prompts_of(B, args.context, vocab, args.seed + 2 + B)
            per = {"kvpool": [], "hf": []}
            for r in range(args.repeat):
                salt = b"dec-%d-%d-%d" % (os.getpid(), B, r)
                _, t1 = timer(lambda: kv_generate(model, c, prompts, 1, salt=salt))
                _, tn = timer(lambda: kv_generate(model, c, prompts, args.new_tokens + 1,
                                                  salt=salt + b"n"))
                per["kvpool"].append((tn - t1) / args.new_tokens)
                _, h1 = timer(lambda: hf_generate(model, prompts, 1))
                _, hn = timer(lambda: hf_generate(model, prompts, args.new_tokens + 1))
                per["hf"].append((hn - h1) / args.new_tokens)
            k = statistics.median(per["kvpool"]) * 1e3
            h = statistics.median(per["hf"]) * 1e3
            figures["decode_b%d_kvpool_ms" % B] = k
            figures["decode_b%d_hf_ms" % B] = h
            figures["decode_b%d_ratio" % B] = k / h
            print("decode, batch %d, context %d: kvpool %.2f ms/token, transformers %.2f "
                  "ms/token (%.2fx)" % (B, args.context, k, h, k / h))
    for key, v in figures.items():
        print("%s=%.4g" % (key, v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
