# SPDX-License-Identifier: Apache-2.0
"""kvpool.integrations.transformers against a real kvpoold (host backend, CPU): a seeded random
Llama-architecture model (2 layers, hidden 64, 4 query heads, 2 KV heads: GQA) generates greedily
for a batch of prompts of different lengths (left padded, as generate() takes them) with its K/V
only in the daemon's pool (KvpoolCache + the "kvpool" attention: gather + SDPA here, no
FlashInfer on CPU), and must produce exactly the tokens of the same model with transformers' own
cache and SDPA attention; the largest logit difference is printed (pytest -s) and bounded.
Page sizes 16 and 1, NHD and HND, fp32 (and fp16/bf16 pools at page 16).

Cross-process reuse: process A (this file run as a worker) generates from a long prompt in one
cache scope and exits; process B, in another namespace of the same scope, with A's prompt plus a
question (batched with an unrelated prompt) links exactly A's whole pages of the prompt, computes
only the rest, and generates exactly the tokens of a cold run (another scope) and of
transformers' own cache.

Skipped unless torch and transformers import. CI runs it (deploy/test.sh) through
`tests/python/run.sh --torch`, which makes a venv with both from PyPI
(tests/python/requirements-torch.txt); by hand, e.g.
    BUILD_DIR=build sh tests/python/run.sh --torch -s -k hf_integration
The daemon fixture `start` comes from conftest.py.
"""
import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_common  # noqa: E402
from conftest import ROOT  # noqa: E402

import kvpool  # noqa: E402
from kvpool.integrations.transformers import KvpoolCache, kvpool_generate  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 2, 64, 4, 2, 256
HEAD_DIM = HIDDEN // HEADS
PROMPT_LENS = (7, 33, 100)
NEW_TOKENS = 16
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# largest |logit(kvpool) - logit(transformers)| allowed: the same arithmetic on the same values,
# up to the order of the reductions (SDPA over a padded, masked key range)
LOGIT_TOL = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 1.5e-1}
SCOPE = "hf-test-model"


def make_model(dtype="fp32", seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=1024,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None,
                      initializer_range=0.1)
    model = LlamaForCausalLM(cfg).to(DTYPES[dtype]).eval()
    model.generation_config.eos_token_id = None  # always NEW_TOKENS tokens
    model.generation_config.pad_token_id = 0
    return model


def prompts_of(lens, seed=1):
    return hf_common.prompts_of(lens, VOCAB, seed)


def left_pad(prompts):
    return hf_common.left_pad(prompts)


GEN = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
           return_dict_in_generate=True)


def reference(model, prompts):
    """The same model with transformers' own cache (DynamicCache) and SDPA attention."""
    ids, mask = left_pad(prompts)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **GEN)


def max_logit_diff(a, b):
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a.logits, b.logits))


def new_tokens(out, prompts):
    L = max(len(p) for p in prompts)
    return out.sequences[:, L:].tolist()


def geometry(page_size, layout, dtype="fp32", num_pages=1024):
    return ["--num-layers", str(LAYERS), "--num-kv-heads", str(KV_HEADS), "--head-dim",
            str(HEAD_DIM), "--dtype", dtype, "--page-size", str(page_size), "--num-pages",
            str(num_pages), "--layout", layout]


@pytest.mark.parametrize("page_size,layout,dtype", [
    (16, "nhd", "fp32"), (16, "hnd", "fp32"), (1, "nhd", "fp32"), (1, "hnd", "fp32"),
    (16, "nhd", "fp16"), (16, "hnd", "bf16")])
def test_generate_matches_transformers_cache(start, page_size, layout, dtype):
    d = start(*geometry(page_size, layout, dtype))
    model = make_model(dtype)
    prompts = prompts_of(PROMPT_LENS)
    ref = reference(model, prompts)
    ids, mask = left_pad(prompts)
    model.set_attn_implementation("kvpool")
    with d.client("hf-gen", lease_ms=0) as c:
        with KvpoolCache(model, c) as cache:
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, past_key_values=cache, **GEN)
            # one Reserve per forward step: the prefill and NEW_TOKENS - 1 decode steps (the
            # last token is not fed back); only real tokens are stored, padding never
            assert cache.reserves == NEW_TOKENS
            lens = [n + NEW_TOKENS - 1 for n in PROMPT_LENS]
            assert cache.seq_lens.tolist() == lens
            assert c.stats().num_tokens == sum(lens)
            assert c.stats().num_seqs == len(PROMPT_LENS)
            c.audit()
        diff = max_logit_diff(ref, out)
        print("\n%s %s page %d: largest logit difference %.3g" % (dtype, layout, page_size,
                                                                   diff))
        assert new_tokens(out, prompts) == new_tokens(ref, prompts)
        assert out.sequences.tolist() == ref.sequences.tolist()
        assert diff <= LOGIT_TOL[dtype]
        # released at the end (the context manager): nothing left but cached pages
        st = c.stats()
        assert st.num_seqs == 0 and st.num_tokens == 0 and st.used_pages == 0
        c.audit()
        # kvpool_generate without a cache scope: nothing to reuse, the same tokens
        out2 = kvpool_generate(model, c, prompts, **GEN)
        assert out2.sequences.tolist() == ref.sequences.tolist()
        assert max_logit_diff(ref, out2) <= LOGIT_TOL[dtype]
        assert c.stats().num_seqs == 0
        c.audit()


def test_keep_continues_and_right_padding(start):
    """keep=True leaves the sequences for a second generate() (a multi-turn continuation, as
    transformers' own cache does); right-padded prompts store only the real tokens."""
    d = start(*geometry(4, "nhd"))
    model = make_model()
    prompts = prompts_of((5, 12))
    ref = reference(model, prompts)
    model.set_attn_implementation("kvpool")
    ids, mask = left_pad(prompts)
    with d.client("hf-keep", lease_ms=0) as c:
        cache = KvpoolCache(model, c, keep=True)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, past_key_values=cache,
                                 max_new_tokens=4, do_sample=False)
        assert out.tolist() == ref.sequences[:, :ids.shape[1] + 4].tolist()
        cache.finish()  # keep: committed, not released
        assert c.stats().num_seqs == 2
        assert cache.seq_lens.tolist() == [5 + 3, 12 + 3]
        # continue: generate() feeds the not-yet-cached last token and decodes on
        mask2 = torch.cat([mask, torch.ones(2, 4, dtype=torch.long)], dim=1)
        with torch.no_grad():
            out2 = model.generate(out, attention_mask=mask2, past_key_values=cache,
                                  max_new_tokens=NEW_TOKENS - 4, do_sample=False)
        assert out2.tolist() == ref.sequences.tolist()
        cache.keep = False
        cache.close()
        assert c.stats().num_seqs == 0
        # right padding: the prompt tokens are the mask's 1 columns; the pool holds only them
        rids = torch.zeros_like(ids)
        rmask = torch.zeros_like(mask)
        for b, p in enumerate(prompts):
            rids[b, :len(p)] = torch.tensor(p)
            rmask[b, :len(p)] = 1
        with KvpoolCache(model, c) as cache:
            with torch.no_grad():
                model(input_ids=rids, attention_mask=rmask, past_key_values=cache)
            assert cache.seq_lens.tolist() == [5, 12]
        c.audit()


def test_refuses_a_mismatched_pool_and_other_attention(start):
    d = start("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "32", "--dtype",
              "fp32", "--page-size", "4", "--num-pages", "64")
    model = make_model()
    with d.client("hf-bad") as c:
        with pytest.raises(ValueError, match="head_dim is 32, the model has 16"):
            KvpoolCache(model, c)
    d2 = start(*geometry(4, "nhd"))
    with d2.client("hf-sdpa") as c:
        model.set_attn_implementation("sdpa")
        with KvpoolCache(model, c) as cache:
            with pytest.raises(ValueError, match="attn_implementation='kvpool'"):
                model(input_ids=torch.tensor([[3, 4, 5]]), past_key_values=cache)


# ---- the FlashInfer path's plumbing, on a stand-in --------------------------------------------

class _FakeWrapper:
    """A stand-in for FlashInfer's paged wrappers with their plan()/run() contract (CSR page
    table, causal aligned to the end of each request's KV, GQA), computed in plain torch on
    the (k, v) pool views: it checks what the integration plans and passes, not the kernels."""

    plans = []
    runs = [0]

    def __init__(self, workspace, kv_layout="NHD", decode=False):
        self.layout, self.decode = kv_layout, decode

    def _plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal, kw):
        for t in (indptr, last):
            assert t.dtype == torch.int32 and t.device.type == "cpu"
        assert indices.dtype == torch.int32
        assert kw["pos_encoding_mode"] == "NONE" and kw["q_data_type"] == kw["kv_data_type"]
        self.p = dict(qo=qo_indptr.tolist(), indptr=indptr.tolist(), indices=indices.tolist(),
                      last=last.tolist(), hq=hq, hkv=hkv, ps=ps, causal=causal,
                      scale=kw["sm_scale"])
        _FakeWrapper.plans.append("decode" if self.decode else "prefill")

    def plan(self, *a, **kw):
        if self.decode:
            indptr, indices, last, hq, hkv, d, ps = a
            qo = torch.arange(len(last) + 1, dtype=torch.int32)
            self._plan(qo, indptr, indices, last, hq, hkv, d, ps, False, kw)
        else:
            qo, indptr, indices, last, hq, hkv, d, ps = a
            assert kw.get("causal") is True
            self._plan(qo, indptr, indices, last, hq, hkv, d, ps, True, kw)

    def run(self, q, paged_kv_cache):
        k, v = paged_kv_cache
        p, out = self.p, torch.empty_like(q)
        _FakeWrapper.runs[0] += 1
        for b in range(len(p["last"])):
            pages = p["indices"][p["indptr"][b]:p["indptr"][b + 1]]
            n = (len(pages) - 1) * p["ps"] + p["last"][b]
            pos = torch.arange(n)
            pg = torch.tensor(pages, dtype=torch.long)[pos // p["ps"]]
            sl = pos % p["ps"]
            K = (k[pg, :, sl] if self.layout == "HND" else k[pg, sl]).float()  # [n, Hkv, D]
            V = (v[pg, :, sl] if self.layout == "HND" else v[pg, sl]).float()
            g = p["hq"] // p["hkv"]
            K, V = K.repeat_interleave(g, dim=1), V.repeat_interleave(g, dim=1)
            lo, hi = p["qo"][b], p["qo"][b + 1]
            qb = q[lo:hi].float()  # [m, Hq, D]
            sc = torch.einsum("mhd,nhd->hmn", qb, K) * p["scale"]
            m = hi - lo
            if p["causal"]:
                vis = torch.arange(n)[None, :] <= (n - m + torch.arange(m))[:, None]
                sc = sc.masked_fill(~vis[None], float("-inf"))
            out[lo:hi] = torch.einsum("hmn,nhd->mhd", sc.softmax(-1), V).to(q.dtype)
        return out


def _fake_flashinfer():
    import types

    fi = types.ModuleType("flashinfer")
    def prefill(ws, layout="NHD", backend="auto"):
        assert backend == "auto"  # KvpoolCache's default: FlashInfer picks
        return _FakeWrapper(ws, layout)

    fi.BatchPrefillWithPagedKVCacheWrapper = prefill
    fi.BatchDecodeWithPagedKVCacheWrapper = lambda ws, layout="NHD": _FakeWrapper(ws, layout,
                                                                                 True)
    return fi


@pytest.mark.parametrize("page_size,layout", [(16, "hnd"), (1, "nhd")])
def test_flashinfer_path_plans_once_per_step(start, monkeypatch, page_size, layout):
    """attention='flashinfer' with a stand-in module: one plan per forward step (prefill
    wrapper for the prompt step and the reuse prefill, decode wrapper for one-token steps),
    one run per layer, the rows that add no token left out; the tokens equal transformers'."""
    from kvpool.integrations.transformers import _attention as kt_attention

    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer())
    monkeypatch.setattr(kt_attention, "_flashinfer_mod", [])
    _FakeWrapper.plans.clear()
    _FakeWrapper.runs[0] = 0
    d = start(*geometry(page_size, layout))
    model = make_model()
    prompts = prompts_of(PROMPT_LENS)
    ref = reference(model, prompts)
    ids, mask = left_pad(prompts)
    model.set_attn_implementation("kvpool")
    with d.client("hf-fi", lease_ms=0, cache_scope="hf-fi") as c:
        with KvpoolCache(model, c, attention="flashinfer") as cache:
            assert cache.use_flashinfer
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, past_key_values=cache, **GEN)
        assert out.sequences.tolist() == ref.sequences.tolist()
        assert max_logit_diff(ref, out) <= LOGIT_TOL["fp32"]
        assert _FakeWrapper.plans == ["prefill"] + ["decode"] * (NEW_TOKENS - 1)
        assert _FakeWrapper.runs[0] == LAYERS * NEW_TOKENS
        # the same batch again through kvpool_generate: its prefill links the committed
        # prefix of every row (whole pages of the first P-1 tokens)
        _FakeWrapper.plans.clear()
        cache = KvpoolCache(model, c, attention="flashinfer")
        out2 = kvpool_generate(model, c, prompts, cache=cache, **GEN)
        assert cache.last_prefill["cached_tokens"] == [
            ((n - 1) // page_size) * page_size for n in PROMPT_LENS]
        assert out2.sequences.tolist() == ref.sequences.tolist()
        # its one prefill computes every uncached token, the last included (whose logits are
        # generate()'s first step: no forward, no plan there), then NEW_TOKENS - 1 decode steps
        assert cache.last_prefill["computed_tokens"] == [
            n - ((n - 1) // page_size) * page_size for n in PROMPT_LENS]
        rest = cache.last_prefill["computed_tokens"]
        first = "decode" if all(r == 1 for r in rest) else "prefill"  # page 1: one token a row
        assert _FakeWrapper.plans == [first] + ["decode"] * (NEW_TOKENS - 1)
        assert cache.reserves == NEW_TOKENS  # the prefill's Reserve + one a decode step
        c.audit()


# ---- cross-process prefix reuse ----------------------------------------------------------------

def run_worker(sock, namespace, scope, prompts, timeout=300):
    """This file as a worker PROCESS: kvpool_generate of `prompts` in namespace/scope; returns
    its RESULT (tokens, cached_tokens, computed_tokens)."""
    return hf_common.run_worker(__file__, ["--worker", sock, namespace, scope,
                                           json.dumps(prompts)], namespace, timeout)


def worker_main(sock, namespace, scope, prompts):
    model = make_model()
    with kvpool.Client(sock, namespace, 0, cache_scope=scope) as c:
        cache = KvpoolCache(model, c)
        model.set_attn_implementation("kvpool")
        out = kvpool_generate(model, c, prompts, cache=cache, max_new_tokens=NEW_TOKENS,
                              do_sample=False)
        cache.close()
        c.audit()
        L = max(len(p) for p in prompts)
        print("RESULT " + json.dumps(dict(tokens=out[:, L:].tolist(), **cache.last_prefill)))
    return 0


@pytest.mark.parametrize("page_size,layout", [(16, "nhd"), (16, "hnd"), (1, "nhd")])
def test_prefix_reuse_across_processes(start, page_size, layout):
    d = start(*geometry(page_size, layout, num_pages=4096))
    system = prompts_of((300,), seed=5)[0]
    # A: the long prompt alone, in a fresh scope: nothing cached, all computed
    a = run_worker(d.sock, "hf-proc-a", SCOPE, [system])
    assert a["cached_tokens"] == [0] and a["computed_tokens"] == [300]
    question = prompts_of((11,), seed=6)[0]
    if question[0] == a["tokens"][0][0]:  # B's prompt must leave A's sequence after `system`
        question[0] = question[0] % (VOCAB - 2) + 2 if question[0] != 2 else 3
    other = prompts_of((40,), seed=7)[0]
    prompts = [system + question, other]
    # B: A's prompt + a question, batched with an unrelated prompt: row 0 links A's whole pages
    # of the prompt (A committed its prompt and decoded tokens, then released), row 1 nothing
    b = run_worker(d.sock, "hf-proc-b", SCOPE, prompts)
    cached = (300 // page_size) * page_size
    assert b["cached_tokens"] == [cached, 0]
    assert b["computed_tokens"] == [311 - cached, 40]
    # a cold run of the same batch (another scope: nothing to find) generates the same tokens
    cold = run_worker(d.sock, "hf-proc-cold", "another-scope", prompts)
    assert cold["cached_tokens"] == [0, 0] and cold["computed_tokens"] == [311, 40]
    assert b["tokens"] == cold["tokens"]
    # and so does transformers' own cache (this process)
    model = make_model()
    assert new_tokens(reference(model, prompts), prompts) == b["tokens"]
    assert new_tokens(reference(model, [system]), [system]) == a["tokens"]
    with d.client("hf-probe", cache_scope=SCOPE) as c:
        # B's prompt is cached now, in whole pages
        assert c.lookup([system + question, system]) == [(311 // page_size) * page_size,
                                                          cached]
        st = c.stats()
        assert st.num_seqs == 0 and st.used_pages == 0
        c.audit()


def doomed_main(sock, namespace, scope, prompts):
    """A worker that is killed in the middle of generation: prefills (committing its prompt's
    full pages), says READY, then generates far more tokens than the test waits for."""
    model = make_model()
    c = kvpool.Client(sock, namespace, 300, cache_scope=scope)  # lease 300 ms
    cache = KvpoolCache(model, c)
    model.set_attn_implementation("kvpool")

    class Ready:
        said = False

        def __call__(self, input_ids, scores):
            if not Ready.said:  # the first decode step: the prefill is committed by now
                print("READY", flush=True)
                Ready.said = True
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    from transformers import StoppingCriteriaList
    kvpool_generate(model, c, prompts, cache=cache, max_new_tokens=100000, do_sample=False,
                    stopping_criteria=StoppingCriteriaList([Ready()]))
    return 1  # never reached: the test kills it


def test_worker_killed_mid_generation(start):
    """A worker killed (SIGKILL) in the middle of generate(): the daemon stays healthy, its
    audit is clean, and within the lease the worker's pages are back: free, or cached when
    keyed (its committed prompt is still findable)."""
    d = start(*geometry(16, "nhd", num_pages=4096))
    prompt = prompts_of((100,), seed=9)[0]
    p = hf_common.start_doomed(__file__, ["--doomed", d.sock, "hf-doomed", SCOPE,
                                          json.dumps([prompt])])
    try:
        # mid-generation: a few decode steps further, past the prompt's pages
        hf_common.wait_generating(d, SCOPE, 100 // 16)
    finally:
        p.kill()
        p.wait()
    hf_common.check_after_kill(d, prompt, SCOPE, 16)  # past the 300 ms lease


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])))
    if len(sys.argv) == 6 and sys.argv[1] == "--doomed":
        sys.exit(doomed_main(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])))
    sys.exit("usage: test_hf_integration.py --worker SOCKET NAMESPACE SCOPE PROMPTS_JSON")


def test_hf_generate_example(start):
    """client/python/examples/hf_generate.py end to end: cold, warm (the prefix linked from
    the cache, only the rest computed) and transformers' own cache give the same tokens."""
    import importlib.util
    import io
    import contextlib
    path = os.path.join(ROOT, "client", "python", "examples", "hf_generate.py")
    spec = importlib.util.spec_from_file_location("kvpool_hf_generate", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    d = start("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16", "--dtype", "fp32",
              "--page-size", "16", "--num-pages", "1024")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = ex.main(["--socket", d.sock, "--prompt-tokens", "200", "--new-tokens", "4",
                      "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"])
    out = buf.getvalue()
    assert rc == 0, out
    assert "(prefill: 0 cached, 200 computed)" in out, out
    assert "(prefill: 192 cached, 8 computed)" in out, out
    assert "identical in the three runs" in out, out
