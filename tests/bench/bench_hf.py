#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""bench_hf.py - issue #17's benchmark: a Llama-architecture model (random weights, a given
geometry; default Llama-3.1-8B's: 32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128)
on kvpool (kvpool.integrations.transformers) against transformers' own cache, in one run:

  ttft      time to first token of a P-token prompt: cold (nothing cached), warm (the prompt's
            full pages cached by ANOTHER process, which prefilled it and exited), and
            transformers' own cache; the ratio warm / cold (target <= 0.1)
  host-warm (issue #28) the same prompt's full pages in the HOST tier of a second daemon this
            script starts ($KVPOOLD or --kvpoold; the first daemon's geometry, with
            cache.host_bytes for the prompts' pages, cache.demote_free_pct=50,
            cache.host_chunk_bytes=64MiB): prefilled there, pushed to host memory by a filler
            client that reserves pages without token ids until the demoter has moved them, then
            timed like warm, so the Reserve restores them; ttft_host_warm_ms, its ratio to cold
            (target <= 0.2) and the restore's share, restore_ms (the Stats' restore_us_total
            delta, target <= 30 ms) beside the Reserve's own time. --no-host-warm skips it
  decode    time per generated token at batch 1 and 32 with a context of C tokens: kvpool
            (FlashInfer attention when importable, else gather + SDPA) against transformers'
            own cache (target: no slower)

Medians of --repeat runs; CUDA events on a GPU, wall time on the CPU. Figures printed last as
key=value lines. The daemon must have the model's geometry and enough pages, e.g. on the H200:

    kvpoold --backend cuda --num-layers 32 --num-kv-heads 8 --head-dim 128 --dtype bf16 \\
            --page-size 16 --num-pages 40000 &
    KVPOOLD=$(command -v kvpoold) python3 tests/bench/bench_hf.py --device cuda --dtype bfloat16

and a CPU smoke run of the code with a tiny model:

    kvpoold --backend host --num-layers 2 --num-kv-heads 2 --head-dim 16 --dtype fp32 \\
            --page-size 16 --num-pages 4096 &
    KVPOOLD=... python3 tests/bench/bench_hf.py --tiny --prompt 300 --context 200 \\
            --batches 1,2 --new-tokens 4 --repeat 1

Not run by CI (needs torch and transformers, and a GPU for the figures that count).
"""
import argparse
import json
import os
import shutil
import signal
import socket as pysocket
import statistics
import subprocess
import sys
import tempfile
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


# ---- daemons of the benchmark's own, and the host tier (issue #28) --------------------------

def kvpoold_path(given=None):
    """The daemon binary: given (--kvpoold), else $KVPOOLD, else build/server/kvpoold; None
    when the first of them named is not an executable file."""
    p = given or os.environ.get("KVPOOLD") or os.path.join(ROOT, "build", "server", "kvpoold")
    return p if os.path.isfile(p) and os.access(p, os.X_OK) else None


class Daemon:
    """A kvpoold this script starts (tests/python/conftest.py's way): a socket in a temporary
    folder, stderr in a log there; answers once the socket takes connections. stop() sends
    SIGTERM (SIGKILL after 10 s) and removes the folder."""

    def __init__(self, binary, args, start_timeout_s=120.0):
        self.dir = tempfile.mkdtemp(prefix="kvpool-bench-")
        self.sock = os.path.join(self.dir, "kvpool.sock")
        self.log = open(os.path.join(self.dir, "kvpoold.log"), "w+")
        env = {k: v for k, v in os.environ.items()
               if k not in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "WATCHDOG_USEC")}
        self.args = list(args)
        self.proc = subprocess.Popen([binary, "--socket", self.sock] + self.args,
                                     stdout=subprocess.DEVNULL, stderr=self.log, env=env)
        end = time.time() + start_timeout_s
        while time.time() < end and self.proc.poll() is None:
            s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
            try:
                s.connect(self.sock)
                return
            except OSError:
                time.sleep(0.02)
            finally:
                s.close()
        self.log.flush()
        with open(self.log.name) as f:
            log = f.read()
        self.stop()
        raise RuntimeError("kvpoold %s did not start:\n%s" % (" ".join(self.args), log[-4000:]))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def tier_settings(host_bytes, demote_free_pct, chunk_bytes=64 << 20):
    """kvpoold's flags for a host tier of host_bytes (issue #28)."""
    return ["--set", "cache.host_bytes=%d" % host_bytes,
            "--set", "cache.demote_free_pct=%d" % demote_free_pct,
            "--set", "cache.host_chunk_bytes=%d" % chunk_bytes]


def geometry_of(info, num_pages):
    """kvpoold's flags for a pool of num_pages pages with the geometry of PoolInfo info (another
    daemon's: the model's K/V fit both)."""
    a = ["--backend", info.backend_name, "--num-layers", str(info.num_layers),
         "--num-kv-heads", str(info.num_kv_heads), "--head-dim", str(info.head_dim),
         "--dtype", info.dtype_name, "--page-size", str(info.page_size),
         "--layout", info.layout_name, "--storage", info.storage_name,
         "--num-pages", str(num_pages)]
    if info.backend_name == "cuda" and info.device_ids:
        a += ["--devices", ",".join(str(d) for d in info.device_ids)]
    return a


def wait_until(what, cond, timeout_s=300.0):
    """Polls cond() until it answers something true (the demoter and the tier's allocation run
    in the daemon's background) and returns it; RuntimeError naming `what` after timeout_s."""
    end = time.time() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.time() > end:
            raise RuntimeError("timed out after %.0f s waiting for %s" % (timeout_s, what))
        time.sleep(0.005)


def wait_tier_ready(c, slots):
    """Waits until the host tier is wholly allocated (and pinned, cuda) and the cache uses at
    least `slots` slots of it; returns the cache's stats then."""
    def ready():
        s = c.cache_stats()
        return s if s.host_bytes_total and s.host_bytes_ready == s.host_bytes_total and \
            s.host_slots >= slots else None
    return wait_until("the host tier ready (%d slots)" % slots, ready)


def push_to_host(c, prompts, salts, wants, chunk_pages=256, timeout_s=300.0):
    """Moves the cached full pages of `prompts` (each with its salt) from the GPU pool to the
    host tier of c's daemon: a filler client reserves pages without token ids, never more than
    are free (so nothing is evicted without a copy), and the demoter, keeping
    cache.demote_free_pct of the pool free, moves cached pages to host memory in eviction order
    (least recently released first). Done when the prompts' wanted tokens are all in host
    memory and nothing is demoting; then the filler disconnects (lease 0: its pages go).
    RuntimeError when pages were dropped instead. Returns (pages the filler held, seconds)."""
    t0 = time.perf_counter()
    end = t0 + timeout_s
    held, seq = 0, 1 << 40
    with kvpool.Client(c.socket, "bench-filler", 0, map_pool=False) as f:
        ps = f.pool_info.page_size
        while True:
            cs = c.cache_stats()
            hits = c.lookup_tiers(prompts, salts)
            if cs.demoting == 0 and all(h.gpu_tokens == 0 and h.host_tokens == w
                                        for h, w in zip(hits, wants)):
                break
            lost = [(i, h) for i, (h, w) in enumerate(zip(hits, wants))
                    if h.gpu_tokens + h.host_tokens < w]
            if lost:
                raise RuntimeError("pages dropped instead of demoted: prompt (index, tiers) %s "
                                   "of %s tokens each; cache %s" % (lost, wants, cs))
            if time.perf_counter() > end:
                raise RuntimeError("timed out pushing the prompts to host memory: tiers %s, "
                                   "cache %s" % (hits, cs))
            free = f.stats().free_pages
            if cs.demoting or free == 0:
                time.sleep(0.002)  # the demoter's turn (kicked on each plan and each tick)
                continue
            n = min(chunk_pages, free)
            f.reserve([seq], [n * ps])
            held, seq = held + n, seq + 1
    return held, time.perf_counter() - t0


class HostWarm:
    """The host-warm case: a second daemon with a host tier (the first daemon's geometry), the
    --repeat prompts prefilled there (a salt each: a fresh prefix every repeat) and pushed to
    host memory together (push_to_host), then each timed once by run(r). A small prompt goes
    first through the same path, untimed (the first restore's one-time costs)."""

    def __init__(self, args, binary, main_client, model, vocab, prompt, want):
        info, ps = main_client.pool_info, main_client.pool_info.page_size
        page_bytes = main_client.stats().page_bytes
        self.model, self.prompt, self.want = model, prompt, want
        self.warmup = prompts_of(1, 8 * ps + 1, vocab, args.seed + 77)[0]  # 8 full pages
        tag = "%d-%d" % (os.getpid(), int(time.time()))
        self.salts = [b"host-%s-%d" % (tag.encode(), r) for r in range(args.repeat)]
        self.wsalt = b"host-warm-up-" + tag.encode()
        # what must fit in host memory, + 64: the warm-up's 2 x 68 tokens (8 pages) are
        # demoted too, first, and dropped first if the tier ran out (it does not)
        self.slots = args.repeat * (want // ps) + 8 + 64
        held = args.repeat * (len(prompt) // ps + 2) + 2 * (8 + 2) + 16
        num_pages = args.host_pool_pages or 2 * held + 256  # all cached before the push
        t0 = time.perf_counter()
        self.daemon = Daemon(binary, geometry_of(info, num_pages) + tier_settings(
            self.slots * page_bytes, 50))
        try:
            self.c = kvpool.Client(self.daemon.sock, "bench-hf", 0, cache_scope="bench-hf")
            st = wait_tier_ready(self.c, self.slots)
            assert st.host_slot_bytes == page_bytes, (st, page_bytes)
            small = prompts_of(2, 64, vocab, args.seed + 99)
            kv_generate(model, self.c, small, 4, salt=b"warm-up-" + tag.encode())
            kv_generate(model, self.c, [self.warmup], 1, salt=self.wsalt)
            for salt in self.salts:
                _, pf = kv_generate(model, self.c, [prompt], 1, salt=salt)
                assert pf["cached_tokens"] == [0], pf
            self.all = [self.warmup] + [prompt] * args.repeat
            self.all_salts = [self.wsalt] + self.salts
            self.wants = [8 * ps] + [want] * args.repeat
            # Commit publishes once the GPU is done (cuda: an event the daemon polls); the
            # demoter may already have moved some of them out: found in either tier
            wait_until("the prefilled pages published", lambda: [
                h.total for h in self.c.lookup_tiers(self.all, self.all_salts)] == self.wants)
            self.filler_pages, self.push_s = push_to_host(self.c, self.all, self.all_salts,
                                                          self.wants)
            self.setup_s = time.perf_counter() - t0
            _, pf = kv_generate(model, self.c, [self.warmup], 1, salt=self.wsalt)
            assert pf["cached_tokens"] == [8 * ps], pf
        except BaseException:
            self.close()
            raise
        self.num_pages = num_pages

    def run(self, r, timer):
        """Repeat r, timed: (seconds to the first token, the prefill's record, the cache's
        counters' deltas over the call)."""
        c = self.c
        tiers = c.lookup_tiers([self.prompt], self.salts[r])
        assert tiers == [kvpool.TierHit(0, self.want)], (tiers, self.want)
        s0 = c.cache_stats()
        (_, pf), t = timer(lambda: kv_generate(self.model, c, [self.prompt], 1,
                                               salt=self.salts[r]))
        s1 = c.cache_stats()
        assert pf["cached_tokens"] == [self.want], (pf, self.want)
        d = {k: getattr(s1, k) - getattr(s0, k) for k in (
            "restore_us_total", "restore_bytes_total", "promotions_total",
            "host_hit_tokens_total", "hit_tokens_total")}
        ps = c.pool_info.page_size
        assert d["promotions_total"] == self.want // ps, (d, self.want)
        assert d["host_hit_tokens_total"] == self.want, (d, self.want)
        return t, pf, d

    def close(self):
        if getattr(self, "c", None) is not None:
            self.c.close()
        self.daemon.stop()


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


def add_model_args(ap):
    """The model's flags (model_of's; bench_multiturn.py takes them too)."""
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
    ap.add_argument("--seed", type=int, default=0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socket", default=None)
    add_model_args(ap)
    ap.add_argument("--prompt", type=int, default=10000)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="also decode with KvpoolCache(cuda_graphs=True)")
    ap.add_argument("--no-host-warm", action="store_true",
                    help="skip the host-warm case (issue #28's host tier)")
    ap.add_argument("--kvpoold", default=None,
                    help="the daemon binary the host-warm case starts (default: $KVPOOLD, "
                         "else build/server/kvpoold)")
    ap.add_argument("--host-pool-pages", type=int, default=0,
                    help="pages of the host-warm daemon's GPU pool (0: twice what its prompts "
                         "hold, + 256)")
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
        hw = None  # the host-warm case: its own daemon, the prompts pushed to its host tier
        hw_t, hw_reserve, hw_restore, hw_bytes, hw_fwd = [], [], [], [], []
        if not args.no_host_warm:
            binary = kvpoold_path(args.kvpoold)
            if binary is None:
                raise SystemExit("bench_hf.py: the host-warm case starts a kvpoold: set "
                                 "$KVPOOLD or --kvpoold (or --no-host-warm)")
            hw = HostWarm(args, binary, c, model, vocab, prompt[0], want)
            print("host-warm: a daemon of %d pages with a host tier of %d pages; %d prompts of "
                  "%d cached tokens pushed to host memory in %.2f s (the filler held %d pages; "
                  "setup %.1f s)" % (hw.num_pages, hw.slots, args.repeat, want, hw.push_s,
                                     hw.filler_pages, hw.setup_s))
        try:
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
                if hw is not None:
                    t, pf, d = hw.run(r, timer)
                    hw_t.append(t)
                    hw_reserve.append(pf["reserve_ms"])
                    hw_restore.append(d["restore_us_total"] / 1e3)
                    hw_bytes.append(d["restore_bytes_total"])
                    hw_fwd.append(pf["forward_ms"])
                _, t = timer(lambda: hf_generate(model, prompt, 1))
                hf.append(t)
        finally:
            if hw is not None:
                hw.close()  # its pool's memory back before the decode runs
        figures["ttft_cold_ms"] = statistics.median(cold) * 1e3
        figures["ttft_warm_ms"] = statistics.median(warm) * 1e3
        figures["ttft_hf_ms"] = statistics.median(hf) * 1e3
        figures["ttft_warm_over_cold"] = figures["ttft_warm_ms"] / figures["ttft_cold_ms"]
        if hw is not None:
            figures["ttft_host_warm_ms"] = statistics.median(hw_t) * 1e3
            figures["ttft_host_warm_over_cold"] = \
                figures["ttft_host_warm_ms"] / figures["ttft_cold_ms"]
            figures["restore_ms"] = statistics.median(hw_restore)
            figures["ttft_host_warm_reserve_ms"] = statistics.median(hw_reserve)
            figures["ttft_host_warm_forward_ms"] = statistics.median(hw_fwd)
            figures["restore_gb_per_s"] = statistics.median(
                [b / (ms * 1e6) if ms > 0 else 0.0 for b, ms in zip(hw_bytes, hw_restore)])
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
        if hw is not None:
            met = lambda ok: "met" if ok else "missed"  # noqa: E731
            print("  host-warm (the %d cached tokens restored from the host tier by the "
                  "Reserve): %.1f ms (%.3f of cold; target <= 0.2: %s); the restore %.2f ms "
                  "(%d pages, %.1f GB/s; target <= 30 ms: %s), the Reserve in all %.2f ms, "
                  "the forward %.2f ms" % (
                      want, figures["ttft_host_warm_ms"], figures["ttft_host_warm_over_cold"],
                      met(figures["ttft_host_warm_over_cold"] <= 0.2), figures["restore_ms"],
                      want // ps, figures["restore_gb_per_s"], met(figures["restore_ms"] <= 30),
                      figures["ttft_host_warm_reserve_ms"], figures["ttft_host_warm_forward_ms"]))
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
