# SPDX-License-Identifier: Apache-2.0
"""kvpool_generate(): model.generate() with prefix reuse through the daemon's prefix cache.
transformers' forward computes every input token, so reuse cannot happen inside generate():
this module runs the prefill itself (one Reserve with reuse, ONE forward over the uncached
tokens, the last included, and a Commit), then hands generate() the cache with the logits of
that forward for its first step (kvpool.integrations.transformers._forward serves them)."""
import inspect
import time

import numpy as np
import torch

from ._cache import KvpoolCache

def _left_pad(prompts, pad_id, device):
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for b, p in enumerate(prompts):
        if len(p):
            ids[b, L - len(p):] = torch.as_tensor(np.asarray(p, np.int64))
            mask[b, L - len(p):] = 1
    return ids.to(device), mask.to(device)


def _prompts_of(input_ids, attention_mask):
    """Token-id lists of a [B, L] batch (its mask's 1 columns), or of a list of sequences."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids.detach().cpu().numpy()
        m = np.ones(ids.shape, bool) if attention_mask is None else \
            attention_mask.detach().cpu().numpy().astype(bool)
        return [ids[b][m[b]].astype(np.int64) for b in range(ids.shape[0])]
    return [np.asarray(p, np.int64).reshape(-1) for p in input_ids]


def kvpool_generate(model, client, input_ids, attention_mask=None, *, cache=None, keep=False,
                    salt=None, reuse=True, attention="auto", **generate_kwargs):
    """model.generate() on kvpool with prefix reuse (see the module's docstring).

    input_ids: a list of token-id sequences (prompts of any lengths), or a [B, L] tensor with
    its attention_mask (left or right padded: the mask's 1 columns are each row's prompt).
    client: the kvpool.Client (its cache_scope decides who shares pages). cache: a KvpoolCache
    to use (default: a new one, closed at the end). keep: leave the sequences in the daemon
    (a given cache: its own keep decides). reuse: link cached prefixes (False: compute all,
    still keying and committing the pages). Other keywords go to model.generate(), which gets
    the prompts left-padded (pad: generation_config.pad_token_id, else 0) and this cache.
    Returns what model.generate() returns; cache.last_prefill holds cached_tokens and
    computed_tokens per row."""
    prompts = _prompts_of(input_ids, attention_mask)
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("kvpool_generate needs prompts of at least one token")
    own = cache is None
    if own:
        cache = KvpoolCache(model, client, keep=keep, salt=salt, attention=attention)
    if cache._lens is not None:
        raise ValueError("kvpool_generate needs a fresh cache (its sequences hold tokens)")
    dev = next(model.parameters()).device
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if isinstance(pad, (list, tuple)):
        pad = pad[0]
    pad = 0 if pad is None else int(pad)
    try:
        with torch.no_grad():
            _prefill(model, cache, prompts, reuse, pad, dev)
        ids, mask = _left_pad(prompts, pad, dev)
        generate_kwargs.setdefault("pad_token_id", pad)
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                              **generate_kwargs)
    finally:
        if own:
            cache.close()
        else:
            cache.finish()


def _prefill(model, cache, prompts, reuse, pad, dev):
    """kvpool_generate's own prefill: every prompt token after the cached prefix, the last one
    included, in ONE forward; its last position's logits are kept for generate()'s first step
    (which then runs no forward: KvpoolCache._first). Leaves the cache at max(P) - 1 columns
    seen, so that generate() feeds the last prompt tokens as its first step."""
    B = len(prompts)
    L = max(len(p) for p in prompts)
    seqs = cache._rows(B)
    heads = prompts
    counts = np.array([h.size for h in heads], np.uint32)
    t0 = time.perf_counter()
    # leave_last: at least the last token is computed (its logits give the first new token)
    table = cache.client.reserve(seqs, counts, token_ids=heads if cache.key_tokens else None,
                                 salts=cache.salt if cache.key_tokens else None, reuse=reuse,
                                 leave_last=bool(reuse))
    cache.reserves += 1
    cached = np.asarray(table.cached_tokens, np.int64)[:B] if table.cached_tokens.size else \
        np.zeros(B, np.int64)
    if cached.size != B:
        cached = np.zeros(B, np.int64)
    rest = counts.astype(np.int64) - cached
    R = int(rest.max()) if B else 0
    cache.last_prefill = dict(cached_tokens=cached.tolist(), computed_tokens=rest.tolist(),
                              page_size=cache.page_size,
                              reserve_ms=(time.perf_counter() - t0) * 1e3)
    # the cached prefix is already in the rows: count it as the rows' length before the step
    cache._lens = cached.copy()
    new = np.zeros((B, R), bool)
    ids = np.full((B, R), pad, np.int64)
    pos = np.zeros((B, R), np.int64)
    for b in range(B):
        r = int(rest[b])
        if r:
            new[b, R - r:] = True
            ids[b, R - r:] = heads[b][int(cached[b]):]
            pos[b, R - r:] = np.arange(int(cached[b]), int(cached[b]) + r)
    if int(rest.min()) < 1:
        raise RuntimeError("Reserve linked a whole prompt (cached %s of %s tokens): nothing "
                           "left to compute" % (cached.tolist(), counts.tolist()))
    cache._prepared = (table, new)
    try:
        kw = {}
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            kw["logits_to_keep"] = 1  # only the last position's (each row's last token)
        t0 = time.perf_counter()
        out = model(input_ids=torch.from_numpy(ids).to(dev), position_ids=torch.from_numpy(
            pos).to(dev), past_key_values=cache, use_cache=True, **kw)
        cache.last_prefill["forward_ms"] = (time.perf_counter() - t0) * 1e3
    finally:
        cache._prepared = None
    cache._step = None
    cache._first = out.logits[:, -1:]
    cache._forward_override.install()  # generate()'s first step answers these logits
    cache._hf_len = L - 1
    if cache.key_tokens:
        t0 = time.perf_counter()
        cache.client.commit(seqs)
        cache.last_prefill["commit_ms"] = (time.perf_counter() - t0) * 1e3

