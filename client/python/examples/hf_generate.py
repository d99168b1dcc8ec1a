#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""hf_generate.py - generate with a Llama-architecture model whose KV cache lives in kvpool
(kvpool.integrations.transformers), and time it with and without a warm prefix.

By default the model is built from a config with seeded random weights (no download: the
numbers are about speed and about the tokens matching, not about text); --model DIR loads a
local checkpoint instead (its tokenizer too, when --text is given). Three runs of the same
prompt(s), each in a fresh process state of the cache (new sequences):

  cold     kvpool, the prefix cache empty for this prompt (another salt: nothing matches)
  warm     kvpool after "cold" committed the prompt's full pages: the prefill computes only
           the tokens after the cached prefix (printed: cached / computed)
  hf       transformers' own cache and attention (the reference: the tokens must equal)

For each it prints time to first token (the prefill and the first decode step) and decode
tokens/s. The daemon must have the model's geometry, e.g. for the default model:

    kvpoold --backend host --num-layers 4 --num-kv-heads 2 --head-dim 32 --dtype fp32 \\
            --page-size 16 --num-pages 4096
    python3 hf_generate.py --prompt-tokens 1000 --new-tokens 32

(on a GPU: --backend cuda --dtype bf16 and `--device cuda --dtype bf16` here; FlashInfer is used
when importable, else gather + SDPA). Needs torch and transformers (pip install
'kvpool[transformers]').
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kvpool  # noqa: E402


def build_model(args, torch, transformers):
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, torch_dtype=getattr(torch, args.dtype))
    else:
        torch.manual_seed(args.seed)
        cfg = transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
            max_position_embeddings=max(4096, args.prompt_tokens + args.new_tokens + 64))
        model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, args.dtype))
    return model.to(args.device).eval()


def prompt_ids(args, torch):
    if args.text:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.model)
        return [tok(args.text)["input_ids"]]
    g = torch.Generator().manual_seed(args.seed + 1)
    vocab = args.vocab if not args.model else 1000
    return [torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()]


def timed(torch, device, fn):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socket", default=None)
    ap.add_argument("--namespace", default="hf-generate")
    ap.add_argument("--scope", default="hf-generate")
    ap.add_argument("--model", default=None, help="a local checkpoint directory")
    ap.add_argument("--text", default=None, help="with --model: a prompt to tokenize")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        import torch
        import transformers
        from kvpool.integrations.transformers import KvpoolCache, kvpool_generate
    except ImportError as e:
        print("hf_generate.py needs torch and transformers (%s)" % e, file=sys.stderr)
        return 2
    model = build_model(args, torch, transformers)
    prompts = prompt_ids(args, torch)
    n_new = args.new_tokens
    client = kvpool.Client(args.socket, args.namespace, lease_ms=0, cache_scope=args.scope)
    try:
        # first token alone, then the whole generation: decode tokens/s from the difference
        def run(salt, new, reuse=True):
            model.set_attn_implementation("kvpool")  # registered by the integration's import
            cache = KvpoolCache(model, client, salt=salt)
            out = kvpool_generate(model, client, prompts, cache=cache, salt=salt, reuse=reuse,
                                  max_new_tokens=new, do_sample=False)
            return out, cache.last_prefill

        salt = b"run-%d" % time.time_ns()  # a prompt nobody cached yet: the cold run is cold
        (_, pf_cold), ttft_cold = timed(torch, args.device, lambda: run(salt, 1))
        (out_cold, _), t_cold = timed(torch, args.device, lambda: run(salt + b"-all", n_new))
        (out_w1, pf_warm), ttft_warm = timed(torch, args.device, lambda: run(salt, 1))
        (out_warm, _), t_warm = timed(torch, args.device, lambda: run(salt, n_new))
        ids = torch.tensor(prompts, device=args.device)
        model.set_attn_implementation("sdpa")  # transformers' own cache and attention
        with torch.no_grad():
            out_hf, t_hf = timed(torch, args.device, lambda: model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                do_sample=False, pad_token_id=0))
            _, ttft_hf = timed(torch, args.device, lambda: model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                pad_token_id=0))
    finally:
        client.close()
    P = len(prompts[0])
    same = (out_cold.tolist() == out_warm.tolist() == out_hf.tolist())
    print("prompt %d tokens, %d new tokens, %s %s, %d layers" %
          (P, n_new, args.device, args.dtype, args.layers))
    for name, ttft, total, pf in (("cold", ttft_cold, t_cold, pf_cold),
                                  ("warm", ttft_warm, t_warm, pf_warm),
                                  ("hf", ttft_hf, t_hf, None)):
        tps = (n_new - 1) / max(total - ttft, 1e-9)
        extra = ""
        if pf is not None:
            extra = "  (prefill: %d cached, %d computed)" % (
                int(pf["cached_tokens"][0]), int(pf["computed_tokens"][0]))
        print("  %-5s time to first token %8.1f ms, decode %8.1f tokens/s%s" %
              (name, ttft * 1e3, tps, extra))
    print("  warm / cold time to first token: %.3f" % (ttft_warm / ttft_cold))
    print("  tokens: %s" % ("identical in the three runs" if same else "DIFFER"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
