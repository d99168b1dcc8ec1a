# SPDX-License-Identifier: Apache-2.0
"""kvpool.integrations.transformers on a GPU (issue #17's tests, label gpu): a real kvpoold on
the cuda backend, a seeded random Llama-architecture model of the issue's shape (4 layers, 32
query heads, 8 KV heads, head_dim 128) on the GPU, its K/V only in the daemon's pool (appended
in-process by libkvpool's fused kernel), attention by FlashInfer's paged prefill/decode wrappers
on the pool views when flashinfer imports (else gather + SDPA; KVPOOL_HF_NEED_FLASHINFER=1 makes
its absence a failure).

  * generate: greedy, 64 new tokens, a batch of 4 prompts (7, 33, 100, 515 tokens, left
    padded), fp16 and bf16, NHD and HND, page sizes 16 and 1, against the same model with
    transformers' own cache (DynamicCache) and attention (SDPA). The generated tokens must be
    identical; the largest logit difference is printed and bounded. A row may part from the
    reference only where the reference itself is at a tie (its two best logits closer than the
    bound): then the row's later tokens follow a different prefix, and the test checks that the
    kvpool token there is one of the tied ones and prints it (it does not hide it).
  * cross-process reuse: process A generates from a 3,000-token prompt and exits; process B
    (another namespace, the same cache scope) with A's prompt + a question links exactly A's
    whole pages of the prompt, computes only the rest and generates what a cold run generates.
  * a worker killed (SIGKILL) mid-generation: the daemon stays healthy, its audit clean, and
    past the worker's lease its pages are free or cached (its committed prompt findable).

Skipped without torch, transformers or a CUDA GPU (CI has none). On the H200:
    KVPOOLD=... KVPOOL_LIB=.../libkvpool.so PYTHONPATH=client/python:<flashinfer> \\
        python3 -m pytest -q -s tests/python/test_hf_gpu.py
KVPOOL_HF_GPU_SMOKE=1 runs the same tests' code on a CPU (the host backend, a tiny model, short
prompts): a check of the tests themselves before GPU time is spent, not a result.
"""
import json
import os
import sys
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
SMOKE = os.environ.get("KVPOOL_HF_GPU_SMOKE") == "1"
if not torch.cuda.is_available() and not SMOKE:
    pytest.skip("no CUDA GPU", allow_module_level=True)

import hf_common  # noqa: E402
import kvpool  # noqa: E402
from kvpool.integrations.transformers import (KvpoolCache, flashinfer_available,  # noqa: E402
                                              kvpool_generate)

LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB, FFN = 4, 32, 8, 128, 1024, 2048
PROMPT_LENS = (7, 33, 100, 515)
NEW_TOKENS = 64
LONG = 3000  # the cross-process test's prompt
if SMOKE:
    LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB, FFN = 2, 4, 2, 16, 256, 128
    PROMPT_LENS, NEW_TOKENS, LONG = (7, 33, 40, 51), 8, 300
HIDDEN = HEADS * HEAD_DIM
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# largest |logit(kvpool) - logit(transformers)| allowed (logits of std ~1.3): the same model,
# attention by another kernel (FlashInfer's or a gather + SDPA against SDPA's), so results differ
# in the last bits of the dtype, carried through 4 layers
LOGIT_TOL = {"fp16": 0.05, "bf16": 0.3}
SCOPE = "hf-gpu-test"
NEED_FI = os.environ.get("KVPOOL_HF_NEED_FLASHINFER") == "1"
DEV = torch.device("cpu") if SMOKE else torch.device("cuda", 0)


def make_model(dtype, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=8192, pad_token_id=0, bos_token_id=1,
                      eos_token_id=None)
    with torch.device(DEV):
        model = LlamaForCausalLM(cfg).to(DTYPES[dtype]).eval()
    model.generation_config.eos_token_id = None  # always the tokens asked for
    model.generation_config.pad_token_id = 0
    return model


def prompts_of(lens, seed=1):
    return hf_common.prompts_of(lens, VOCAB, seed)


def left_pad(prompts):
    return hf_common.left_pad(prompts, DEV)


def gen_kwargs(new):
    return dict(max_new_tokens=new, do_sample=False, output_logits=True,
                return_dict_in_generate=True)


def reference(model, prompts, new=NEW_TOKENS):
    """transformers' own cache (DynamicCache) and attention (SDPA)."""
    model.set_attn_implementation("sdpa")
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **gen_kwargs(new))


def compare(ref, out, prompts, tol, what):
    """Rows' generated tokens identical to the reference's, up to a reference tie; returns the
    largest logit difference over the steps where both saw the same prefix."""
    L = max(len(p) for p in prompts)
    a, b = ref.sequences[:, L:].tolist(), out.sequences[:, L:].tolist()
    diff, ties = 0.0, []
    for r in range(len(prompts)):
        for t in range(len(a[r])):
            lr = ref.logits[t][r].float()
            diff = max(diff, (lr - out.logits[t][r].float()).abs().max().item())
            if a[r][t] != b[r][t]:
                top2 = torch.topk(lr, 2).values
                gap = (top2[0] - top2[1]).item()
                mine = (top2[0] - lr[b[r][t]]).item()
                assert mine <= tol, "%s row %d step %d: kvpool chose %d, %.3g below the " \
                    "reference's best %d" % (what, r, t, b[r][t], mine, a[r][t])
                ties.append((r, t, gap))
                break  # the prefixes differ from here on
    for r, t, gap in ties:
        print("\n%s: row %d parts from the reference at step %d, a tie (the reference's two "
              "best logits %.3g apart)" % (what, r, t, gap))
    return diff, ties


def teacher_forced(model, out, prompts, new, tol, what):
    """Every token kvpool generated, checked against the reference on kvpool's own prefix: one
    forward of transformers (SDPA, its own cache) over the prompts + kvpool's tokens. Each
    token must be the reference's best there, or within tol of it (a tie under the dtype's
    rounding). Returns (tokens that are the reference's best, tokens)."""
    model.set_attn_implementation("sdpa")
    L = max(len(p) for p in prompts)
    seq = out.sequences
    _, mask = left_pad(prompts)
    mask = torch.cat([mask, torch.ones(len(prompts), new, dtype=mask.dtype, device=DEV)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate() gives a left-padded batch
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=mask, position_ids=pos).logits.float()
    same = 0
    for r in range(len(prompts)):
        for t in range(new):
            lr, tok = logits[r, L - 1 + t], int(seq[r, L + t])
            below = (lr.max() - lr[tok]).item()
            assert below <= tol, "%s row %d step %d: kvpool's token %d is %.3g below the " \
                "reference's best on the same prefix" % (what, r, t, tok, below)
            same += int(tok == int(lr.argmax()))
    return same, len(prompts) * new


def geometry(page_size, layout, dtype, num_pages):
    return ["--backend", "host" if SMOKE else "cuda", "--num-layers", str(LAYERS), "--num-kv-heads", str(KV_HEADS),
            "--head-dim", str(HEAD_DIM), "--dtype", dtype, "--page-size", str(page_size),
            "--num-pages", str(num_pages), "--layout", layout]


def test_flashinfer_is_there_when_required():
    assert flashinfer_available() or not NEED_FI, "KVPOOL_HF_NEED_FLASHINFER=1: no flashinfer"


_models = {}


def model_of(dtype):
    if dtype not in _models:
        _models.clear()
        torch.cuda.empty_cache()
        _models[dtype] = make_model(dtype)
    return _models[dtype]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page_size", [16, 1])
def test_generate_matches_transformers(start, dtype, layout, page_size):
    total = sum(PROMPT_LENS) + len(PROMPT_LENS) * NEW_TOKENS
    d = start(*geometry(page_size, layout, dtype, num_pages=2 * total // page_size + 64))
    model = model_of(dtype)
    prompts = prompts_of(PROMPT_LENS)
    ref = reference(model, prompts)
    ids, mask = left_pad(prompts)
    model.set_attn_implementation("kvpool")
    with d.client("hf-gpu", lease_ms=0) as c:
        with KvpoolCache(model, c) as cache:
            assert cache.use_flashinfer == (flashinfer_available() and not SMOKE)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, past_key_values=cache,
                                     **gen_kwargs(NEW_TOKENS))
            assert cache.reserves == NEW_TOKENS  # one Reserve a forward step
            assert cache.append_fallbacks == 0  # decode steps: the states as they are
            lens = [n + NEW_TOKENS - 1 for n in PROMPT_LENS]
            assert cache.seq_lens.tolist() == lens
            st = c.stats()
            assert st.num_tokens == sum(lens) and st.num_seqs == len(PROMPT_LENS)
            c.audit()
        what = "%s %s page %d (%s)" % (dtype, layout, page_size,
                                       "flashinfer" if cache.use_flashinfer else "sdpa")
        diff, ties = compare(ref, out, prompts, LOGIT_TOL[dtype], what)
        print("\n%s: largest logit difference %.3g, %d of %d rows identical over %d tokens" % (
            what, diff, len(prompts) - len(ties), len(prompts), NEW_TOKENS))
        assert diff <= LOGIT_TOL[dtype]
        if not ties:
            assert out.sequences.tolist() == ref.sequences.tolist()
        else:  # past a tie the prefixes differ: every token checked on kvpool's own prefix
            same, n = teacher_forced(model, out, prompts, NEW_TOKENS, LOGIT_TOL[dtype], what)
            print("%s: on kvpool's own prefix, %d of %d tokens are the reference's best, the "
                  "rest within %.3g of it (ties)" % (what, same, n, LOGIT_TOL[dtype]))
        st = c.stats()
        assert st.num_seqs == 0 and st.num_tokens == 0 and st.used_pages == 0
        c.audit()


@pytest.mark.skipif(SMOKE, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype,layout,page_size", [("fp16", "nhd", 16), ("bf16", "hnd", 1)])
def test_cuda_graph_decode_matches_eager(start, dtype, layout, page_size):
    """KvpoolCache(cuda_graphs=True): every decode step replayed from the batch's graph gives
    the tokens and logits of the eager kvpool run, bit for bit (the same kernels on the same
    bytes), and the pool ends as the eager run leaves it."""
    total = sum(PROMPT_LENS) + len(PROMPT_LENS) * NEW_TOKENS
    d = start(*geometry(page_size, layout, dtype, num_pages=2 * total // page_size + 64))
    model = model_of(dtype)
    prompts = prompts_of(PROMPT_LENS)
    ids, mask = left_pad(prompts)
    model.set_attn_implementation("kvpool")
    outs = []
    with d.client("hf-graph", lease_ms=0) as c:
        for graphs in (False, True):
            with KvpoolCache(model, c, cuda_graphs=graphs) as cache:
                with torch.no_grad():
                    outs.append(model.generate(ids, attention_mask=mask, past_key_values=cache,
                                               **gen_kwargs(NEW_TOKENS)))
                assert cache.graph_steps == (NEW_TOKENS - 1 if graphs else 0)
                assert cache.seq_lens.tolist() == [n + NEW_TOKENS - 1 for n in PROMPT_LENS]
                c.audit()
            assert "forward" not in model.__dict__  # the model's own forward again
        eager, graph = outs
        assert graph.sequences.tolist() == eager.sequences.tolist()
        assert all(torch.equal(a, b) for a, b in zip(eager.logits, graph.logits))
        st = c.stats()
        assert st.num_seqs == 0 and st.used_pages == 0
        c.audit()
    print("\n%s %s page %d: %d decode steps from CUDA graphs, tokens and logits identical to "
          "the eager steps" % (dtype, layout, page_size, NEW_TOKENS - 1))


# ---- cross-process prefix reuse (processes: this file with --worker) ----------------------


def run_worker(sock, namespace, scope, prompts, new):
    return hf_common.run_worker(__file__, ["--worker", sock, namespace, scope,
                                           json.dumps(prompts), new], namespace)


def worker_main(sock, namespace, scope, prompts, new):
    model = make_model("fp16")
    with kvpool.Client(sock, namespace, 0, cache_scope=scope) as c:
        cache = KvpoolCache(model, c)
        model.set_attn_implementation("kvpool")
        t0 = time.perf_counter()
        out = kvpool_generate(model, c, prompts, cache=cache, max_new_tokens=new,
                              do_sample=False)
        t = time.perf_counter() - t0
        cache.close()
        c.audit()
        L = max(len(p) for p in prompts)
        print("RESULT " + json.dumps(dict(tokens=out[:, L:].tolist(), seconds=t,
                                          flashinfer=cache.use_flashinfer, **cache.last_prefill)))
    return 0


def test_prefix_reuse_across_processes(start):
    page_size = 16
    d = start(*geometry(page_size, "nhd", "fp16", num_pages=4096))
    system = prompts_of((LONG,), seed=5)[0]
    a = run_worker(d.sock, "hf-proc-a", SCOPE, [system], 8)
    assert a["cached_tokens"] == [0] and a["computed_tokens"] == [LONG]
    question = prompts_of((25,), seed=6)[0]
    if question[0] == a["tokens"][0][0]:  # B's prompt must leave A's sequence after `system`
        question[0] = 2 if question[0] != 2 else 3
    prompts = [system + question]
    b = run_worker(d.sock, "hf-proc-b", SCOPE, prompts, 32)
    cached = LONG // page_size * page_size  # A's whole pages of the prompt
    assert b["cached_tokens"] == [cached]
    assert b["computed_tokens"] == [LONG + 25 - cached]
    cold = run_worker(d.sock, "hf-proc-cold", "another-scope", prompts, 32)
    assert cold["cached_tokens"] == [0] and cold["computed_tokens"] == [LONG + 25]
    print("\ncross-process: B linked %d cached tokens, computed %d, generate() %.1f ms; the cold "
          "run computed %d in %.1f ms (flashinfer: %s)" % (
              cached, b["computed_tokens"][0], b["seconds"] * 1e3, LONG + 25,
              cold["seconds"] * 1e3, b["flashinfer"]))
    assert b["tokens"] == cold["tokens"]
    with d.client("hf-probe", cache_scope=SCOPE) as c:
        assert c.lookup([system + question, system]) == [(LONG + 25) // page_size * page_size,
                                                         cached]
        st = c.stats()
        assert st.num_seqs == 0 and st.used_pages == 0
        c.audit()


def test_prefix_restored_from_host_tier(start):
    """Issue #28: A's prompt leaves the GPU pool for the host tier (a filler takes the pool
    under the demoter's watermark), B with A's prompt + a question restores it (its Reserve
    with reuse links A's whole pages again) and generates what a cold run generates."""
    page_size, pages = 16, 4096
    d = start(*geometry(page_size, "nhd", "fp16", num_pages=pages), "--set",
              "cache.host_bytes=512MiB", "--set", "cache.demote_free_pct=50",
              "--set", "cache.host_chunk_bytes=64MiB")
    system = prompts_of((LONG,), seed=15)[0]
    a = run_worker(d.sock, "hf-tier-a", SCOPE, [system], 8)
    assert a["cached_tokens"] == [0] and a["computed_tokens"] == [LONG]
    cached = LONG // page_size * page_size
    with d.client("hf-tier-filler", cache_scope="filler") as f:
        f.reserve([1], [pages // 2 * page_size])  # under the watermark: A's pages go out
        deadline = time.monotonic() + 60
        while True:
            st = f.cache_stats()
            if st.host_pages >= cached // page_size and st.demoting == 0:
                break
            assert time.monotonic() < deadline, "not demoted: %r" % (st,)
            time.sleep(0.01)
        f.release([1])
    with d.client("hf-tier-probe", cache_scope=SCOPE) as c:
        hit = c.lookup_tiers([system])[0]
        assert (hit.gpu_tokens, hit.host_tokens) == (0, cached)
    question = prompts_of((25,), seed=16)[0]
    if question[0] == a["tokens"][0][0]:
        question[0] = 2 if question[0] != 2 else 3
    prompts = [system + question]
    b = run_worker(d.sock, "hf-tier-b", SCOPE, prompts, 32)
    assert b["cached_tokens"] == [cached]
    assert b["computed_tokens"] == [LONG + 25 - cached]
    cold = run_worker(d.sock, "hf-tier-cold", "another-scope", prompts, 32)
    assert cold["cached_tokens"] == [0]
    print("\nhost tier: B restored %d tokens from host memory and computed %d, generate() "
          "%.1f ms; the cold run %.1f ms" % (cached, b["computed_tokens"][0], b["seconds"] * 1e3,
                                           cold["seconds"] * 1e3))
    assert b["tokens"] == cold["tokens"]
    with d.client("hf-tier-probe", cache_scope=SCOPE) as c:
        st = c.cache_stats()
        assert st.promotions_total >= cached // page_size
        assert st.host_pages == 0
        c.audit()


def doomed_main(sock, namespace, scope, prompts):
    """Killed in the middle of generation: prefills (committing its prompt's full pages), says
    READY at its first decode step, then generates far more tokens than the test waits for."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    model = make_model("fp16")
    c = kvpool.Client(sock, namespace, 300, cache_scope=scope)  # lease 300 ms
    cache = KvpoolCache(model, c)
    model.set_attn_implementation("kvpool")

    class Ready(StoppingCriteria):
        said = False

        def __call__(self, input_ids, scores, **kw):
            if not Ready.said:
                print("READY", flush=True)
                Ready.said = True
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    kvpool_generate(model, c, prompts, cache=cache, max_new_tokens=100000, do_sample=False,
                    stopping_criteria=StoppingCriteriaList([Ready()]))
    return 1  # never reached: the test kills it


def test_worker_killed_mid_generation(start):
    d = start(*geometry(16, "hnd", "fp16", num_pages=16384))
    n = 100 if SMOKE else 700
    prompt = prompts_of((n,), seed=9)[0]
    p = hf_common.start_doomed(__file__, ["--doomed", d.sock, "hf-doomed", SCOPE,
                                          json.dumps([prompt])])
    try:
        # decode steps further, kernels in flight: it went on decoding past its prompt
        hf_common.wait_generating(d, SCOPE, n // 16 + 1)
    finally:
        p.kill()
        p.wait()
    hf_common.check_after_kill(d, prompt, SCOPE, 16)  # past the 300 ms lease


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5]),
                             int(sys.argv[6])))
    if len(sys.argv) == 6 and sys.argv[1] == "--doomed":
        sys.exit(doomed_main(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])))
    sys.exit("usage: test_hf_gpu.py --worker SOCKET NAMESPACE SCOPE PROMPTS_JSON NEW")
