# SPDX-License-Identifier: Apache-2.0
"""kvpool.integrations.transformers: a Hugging Face transformers Cache whose K/V live only in the
kvpool daemon's pool, the "kvpool" attention function reading them through the page table, and
kvpool_generate() (prefix reuse through the daemon's prefix cache). Needs torch and
transformers (pip install 'kvpool[transformers]'); written against transformers 5.17.

    model = LlamaForCausalLM.from_pretrained(DIR, attn_implementation="kvpool")  # or
    model.set_attn_implementation("kvpool")      # the name is registered on import of this module
    client = kvpool.Client(socket, "my-namespace", cache_scope="my-model")
    with KvpoolCache(model, client) as cache:    # released (or kept: keep=True) on exit
        out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, ...)
    # or, with prefix reuse:
    out = kvpool_generate(model, client, prompts, max_new_tokens=64)

How a forward step runs (one step = one call of the model's forward):

  * A forward pre-hook on the model (installed by KvpoolCache, active only for calls whose
    past_key_values is this cache) reads the step's input_ids and 2-D attention_mask: a row's
    new tokens are the columns of the step whose mask is 1 (generate()'s left padding, or right
    padding, is never stored). ONE Reserve for the whole batch (Client.reserve: each row's
    count of real tokens, with their token ids so that full pages are keyed for the prefix
    cache), Client.apply_copies (copy-on-write), and the step's batch indices / positions, on
    the pool's device.
  * Cache.update(layer) takes the layer's new K/V rows of the real tokens ([nnz, Hkv, D], batch
    order: a view when the step has no padding, else a gather) and appends them in-process on
    the mapped pool. The cuda backend uses libkvpool's fused append (one launch a layer, the
    positions computed in it from the page table; kvpool._torch.FusedAppend, prepared once a
    step), queued on the current stream; the host backend's CPU views go through NumPy
    (kvpool.append_paged_kv_cache). It returns the new states unchanged: the full K/V are
    never materialised in HF's [B, H, S, D] layout. host_seconds adds up the host time of the
    steps' Reserves, appends and attention plans.
  * The attention function "kvpool" reads K/V from the pool through the step's page table. It
    gets the step's cache in its keyword arguments (kvpool_cache=), as transformers' paged
    attention gets its cache: the pre-hook adds the keyword to the forward's, and the model
    hands its keywords down to every layer's attention call. No thread-local, no global.
    - FlashInfer (cuda backend, fp16/bf16, flashinfer importable): the step's page table is
      planned ONCE, at the first layer's call (sm_scale is known only then), on
      BatchDecodeWithPagedKVCacheWrapper when every row adds exactly one token, else on
      BatchPrefillWithPagedKVCacheWrapper (causal: a row's new tokens are the last of its
      sequence); every layer then runs on that plan with the layer's pool views (k, v).
    - fallback (host backend, fp32, or FlashInfer absent; or attention="sdpa"): the step's
      gather indices and mask [B, 1, T, S_max] are built once per step; each layer gathers
      its rows' K/V from the pool pages ([B, Hkv, S_max, D]) and calls
      torch.nn.functional.scaled_dot_product_attention (GQA by repeating K/V heads, as
      transformers' repeat_kv does). Correct everywhere, but it copies each layer's K/V once
      per step: a reference and a CPU path, not the fast path.
    Query positions of padding get the row's whole context (their outputs are never read).
  * get_seq_length() is transformers' notion: the columns seen so far (padding included),
    which is what generate() slices input_ids and builds position_ids with. The rows' real
    lengths are the daemon's (seq_lens).

Sequences: one per batch row (seq ids: seq_ids=, else a random base + row). finish() (the
context manager's exit, and kvpool_generate's end) commits the keyed pages (key_tokens=True)
and releases the sequences, unless keep=True (then the cache can continue in a later
generate() with the longer input_ids / attention_mask, as transformers' own cache can).

Prefix reuse (kvpool_generate): transformers' forward computes every input token, so reuse
cannot happen inside generate(). kvpool_generate(model, client, prompts) does the prefill
itself: one Reserve with each prompt's token ids, reuse=True and leave_last=True (the daemon
links each row's longest cached full-page prefix that leaves at least the last token to
compute: cached_tokens, a multiple of the page size), ONE forward over the remaining tokens
only, the last included (position ids from cached_tokens on), commit() of the new full pages
(findable by any process of the cache scope from then on); then model.generate() with the full
left-padded prompts and this cache, which reports P_max - 1 columns seen, so generate() asks
for its first step on the last prompt token of every row: that step runs no forward and no
Reserve (the one override of model.forward, _forward.py, answers it) and gets the logits the
prefill computed for those tokens, so generate()'s own logits processing picks the first
token and goes on as usual. The cache's last_prefill says what happened (cached_tokens,
computed_tokens per row, and the host milliseconds of the Reserve and the Commit).

Not supported (raise): beam search / reorder_cache, batch_select / repeat, crop other than 0
(assisted decoding), sliding-window or non-attention layers, pools split over several devices,
a pool dtype other than the model's, and any attention implementation but "kvpool" with this
cache.

The package's files: _cache.py (KvpoolCache: the step's Reserve, the appends, the Cache
interface), _attention.py (the attention function and its FlashInfer / SDPA paths),
_generate.py (kvpool_generate and its prefill), _forward.py (the one override of model.forward:
the prefill's first step and graph steps), _graphs.py (the decode step as a CUDA graph).
"""
from ._attention import (ATTENTION_NAME, flashinfer_available, kvpool_attention_forward,
                         register)
from ._cache import KvpoolCache
from ._generate import kvpool_generate

__all__ = ["ATTENTION_NAME", "KvpoolCache", "kvpool_attention_forward", "kvpool_generate",
           "flashinfer_available", "register"]

register()
