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
  * The attention function "kvpool" reads K/V from the pool through the step's page table:
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
Reserve (the model's forward is wrapped while the cache lives) and gets the logits the prefill
computed for those tokens, so generate()'s own logits processing picks the first token and goes
on as usual. The cache's last_prefill says what happened (cached_tokens, computed_tokens per
row, and the host milliseconds of the Reserve and the Commit).

Not supported (raise): beam search / reorder_cache, batch_select / repeat, crop other than 0
(assisted decoding), sliding-window or non-attention layers, pools split over several devices,
a pool dtype other than the model's, and any attention implementation but "kvpool" with this
cache.
"""
import functools
import inspect
import os
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.modeling_utils import AttentionInterface

from .. import _torch, paged

__all__ = ["ATTENTION_NAME", "KvpoolCache", "kvpool_attention_forward", "kvpool_generate",
           "flashinfer_available", "register"]

ATTENTION_NAME = "kvpool"
TORCH_DTYPES = {3: torch.float16, 4: torch.bfloat16, 5: torch.float32}
_FLASHINFER_WORKSPACE_BYTES = 128 << 20

_active = threading.local()  # .cache: the KvpoolCache whose step runs in this thread
_flashinfer_mod = []


def _flashinfer():
    """The flashinfer module, or None when it does not import ($KVPOOL_HF_ATTENTION=sdpa:
    never)."""
    if os.environ.get("KVPOOL_HF_ATTENTION", "").lower() == "sdpa":
        return None
    if not _flashinfer_mod:
        try:
            import flashinfer  # noqa: PLC0415

            _flashinfer_mod.append(flashinfer)
        except Exception:  # ImportError, or a broken install (its JIT needs nvcc)
            _flashinfer_mod.append(None)
    return _flashinfer_mod[0]


def flashinfer_available():
    """Whether the FlashInfer attention path can be used (flashinfer imports)."""
    return _flashinfer() is not None


class _Layer(CacheLayerMixin):
    """One layer's entry of Cache.layers; the data and the step's state are the KvpoolCache's."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False
    is_sliding = False

    def __init__(self, cache, layer_idx):
        super().__init__()
        self._cache, self._idx = cache, layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self._idx)

    def get_mask_sizes(self, query_length):
        return self._cache._hf_len + query_length, 0

    def get_seq_length(self):
        return self._cache._hf_len

    def get_max_length(self):
        return -1

    def reset(self):
        raise NotImplementedError("KvpoolCache: reset is not supported (finish() and a new cache)")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("KvpoolCache does not support beam search (reorder_cache)")

    def crop(self, tokens_to_remove):
        if tokens_to_remove:
            raise NotImplementedError("KvpoolCache: crop(%d) is not supported" % tokens_to_remove)

    def batch_repeat_interleave(self, repeats):
        raise NotImplementedError("KvpoolCache: batch_repeat_interleave is not supported")

    def batch_select_indices(self, indices):
        raise NotImplementedError("KvpoolCache: batch_select_indices is not supported")


class _Step:
    """The state of one forward step: its page table and the indices derived from it."""

    __slots__ = ("table", "nnz", "rb", "rt", "rows", "dense", "bi", "pos", "aip", "append", "kv_indices",
                 "kv_indptr", "kv_last", "T", "counts", "old_lens", "gather", "plan", "wrapper")


def _rows_of(s, states):
    """The step's new rows of a layer's [B, H, T, D] states as [nnz, H, D] in batch order: a
    view when the step is dense (no padding), else a gather of the real tokens."""
    x = states.transpose(1, 2)  # [B, T, H, D]
    if s.dense:
        return x.reshape(-1, x.shape[2], x.shape[3])
    return x[s.rb, s.rt]


def _host_tensor(a, dtype):
    """A host pool view (NumPy) as a CPU tensor of the pool's dtype (bf16 is shown raw)."""
    t = torch.from_numpy(a)
    return t.view(dtype) if t.dtype != dtype else t


def _mask_numpy(attention_mask, B, T):
    """The step's columns of a 2-D attention mask as a bool NumPy array [B, T] (None: all)."""
    if attention_mask is None:
        return np.ones((B, T), dtype=bool)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError("KvpoolCache needs a 2-D attention_mask (or None), got %s"
                         % (type(attention_mask).__name__ if not isinstance(
                             attention_mask, torch.Tensor) else tuple(attention_mask.shape)))
    if attention_mask.shape[0] != B or attention_mask.shape[1] < T:
        raise ValueError("attention_mask %s does not cover the step's [%d, %d] inputs"
                         % (tuple(attention_mask.shape), B, T))
    return attention_mask[:, -T:].detach().to("cpu").numpy().astype(bool)


class KvpoolCache(Cache):
    """A transformers Cache backed by kvpool (see the module's docstring).

    model: the transformers model (its config must use attn_implementation "kvpool"; the
    forward pre-hook is installed on it). client: a kvpool.Client with the pool mapped, whose
    geometry is the model's (layers, KV heads, head_dim, dtype; one device). seq_ids: the
    batch rows' sequence ids (default: a random base + row, fixed at the first step).
    keep: finish() commits but does not release. key_tokens: send the token ids with each
    Reserve (full pages keyed for the prefix cache; committed by finish()). salt: bytes
    separating this model's pages from others' of the same cache scope (e.g. the model's
    name and revision). attention: "auto" (FlashInfer when usable, else gather + SDPA),
    "flashinfer" (whenever flashinfer imports; raise if it does not), "sdpa" (always the
    fallback). flashinfer_backend: the prefill wrapper's backend ("auto": FlashInfer picks,
    FA3 on sm_90 for fp16/bf16; "fa2"; $KVPOOL_FLASHINFER_BACKEND overrides the default).
    cuda_graphs: run decode steps (every row adds one token, no padding) from a CUDA graph
    captured once per batch size (_DecodeGraph): the step's Reserve, page-table copy and
    FlashInfer plan stay on the host, the whole forward (every layer's append and attention)
    is one replay. Needs the cuda backend and FlashInfer; opt-in (False by default)."""

    def __init__(self, model, client, *, seq_ids=None, keep=False, key_tokens=True, salt=None,
                 attention="auto", flashinfer_backend=None, cuda_graphs=False):
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        info = client.pool_info
        self.client, self.info, self.config = client, info, cfg
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or
                                cfg.num_attention_heads)
        self.num_q_heads = int(cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or
                            cfg.hidden_size // cfg.num_attention_heads)
        bad = []
        if info.num_layers != self.num_layers:
            bad.append("num_layers is %d, the model has %d" % (info.num_layers, self.num_layers))
        if info.num_devices != 1:
            bad.append("the pool spans %d devices (one supported)" % info.num_devices)
        if info.heads_per_device != self.num_kv_heads:
            bad.append("num_kv_heads is %d, the model has %d" % (info.heads_per_device,
                                                                 self.num_kv_heads))
        if info.head_dim != self.head_dim:
            bad.append("head_dim is %d, the model has %d" % (info.head_dim, self.head_dim))
        if info.dtype not in TORCH_DTYPES:
            bad.append("dtype %s is not a torch compute dtype" % info.dtype_name)
        types = getattr(cfg, "layer_types", None)
        if types is not None and any(t != "full_attention" for t in types):
            bad.append("only full-attention layers are supported, the model has %s"
                       % sorted(set(types)))
        if bad:
            raise ValueError("KvpoolCache: the daemon's pool does not fit the model: "
                             + "; ".join(bad))
        if attention not in ("auto", "flashinfer", "sdpa"):
            raise ValueError("attention must be 'auto', 'flashinfer' or 'sdpa', not %r"
                             % (attention,))
        self.dtype = TORCH_DTYPES[info.dtype]
        self.cuda = info.backend_name == "cuda"
        self.device = torch.device("cuda", info.device_ids[0]) if self.cuda else \
            torch.device("cpu")
        self.page_size = int(info.page_size)
        self.layout = "HND" if info.layout == 1 else "NHD"
        if self.cuda:
            self._k = [client.k_view(i) for i in range(self.num_layers)]
            self._v = [client.v_view(i) for i in range(self.num_layers)]
        else:
            self._k = [_host_tensor(client.k_view(i), self.dtype) for i in range(self.num_layers)]
            self._v = [_host_tensor(client.v_view(i), self.dtype) for i in range(self.num_layers)]
        fi = _flashinfer() if attention != "sdpa" else None
        # "auto": FlashInfer where it runs (a cuda fp16/bf16 pool); "flashinfer": whenever it
        # imports (its own checks then refuse what it cannot run)
        self.use_flashinfer = fi is not None and (attention == "flashinfer" or (
            self.cuda and self.dtype in (torch.float16, torch.bfloat16)))
        if attention == "flashinfer" and not self.use_flashinfer:
            raise ValueError("attention='flashinfer' needs flashinfer importable")
        self._fi_backend = flashinfer_backend or os.environ.get("KVPOOL_FLASHINFER_BACKEND",
                                                                "auto")
        self._fi_workspace = None
        self._fi_prefill = self._fi_decode = None
        self.keep, self.key_tokens, self.salt = bool(keep), bool(key_tokens), salt
        self._seq_ids = None if seq_ids is None else np.asarray(seq_ids, np.uint64).reshape(-1)
        self._lens = None  # the rows' real lengths (the daemon's seq_lens)
        self._hf_len = 0  # columns seen, padding included (transformers' seq length)
        self._step = None
        self._prepared = None  # (table, new-token mask) of kvpool_generate's own prefill
        self.last_prefill = None
        self.reserves = 0  # Reserve calls made (one per forward step)
        # host time spent in kvpool's part of the steps (perf_counter seconds, cumulative):
        # "reserve" the step's Reserve + copy-on-write + page-table upload, "append" the layers'
        # append launches, "attention_plan" FlashInfer's plan (once a step)
        self.host_seconds = dict(reserve=0.0, append=0.0, attention_plan=0.0)
        # dense steps whose states the fused append could not take as they are (gathered)
        self.append_fallbacks = 0
        self._model = model
        super().__init__(layers=[_Layer(self, i) for i in range(self.num_layers)])
        self._hook = model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        self.cuda_graphs = bool(cuda_graphs)
        self._graphs = {}  # batch size -> _DecodeGraph
        self._fi_scaling = None  # (scaling, softcap) the model's layers attend with
        self.graph_steps = 0  # decode steps run from a graph
        self._first = None  # logits of kvpool_generate's prefill for generate()'s first step
        self._reserver = None  # (seq ids, Client.step_reserve of them): the steps' Reserve
        if self.cuda_graphs and not (self.cuda and self.use_flashinfer):
            raise ValueError("cuda_graphs=True needs the cuda backend and FlashInfer")
        # model.forward wrapped for this cache's life (graph steps, and generate()'s first step
        # after kvpool_generate's prefill); other calls go to the model's own forward
        self._orig_forward = model.forward
        self._prev_forward = model.__dict__.get("forward")  # another wrapper, restored at close

        def forward(*args, **kwargs):  # generate() reads the model's signature: wraps
            return self._forward(*args, **kwargs)

        model.forward = functools.wraps(self._orig_forward)(forward)

    # ---- life cycle -----------------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    @property
    def seq_ids(self):
        """The batch rows' sequence ids (None before the first step)."""
        return None if self._seq_ids is None or self._lens is None else self._seq_ids.copy()

    @property
    def seq_lens(self):
        """The rows' real lengths in the pool (tokens, padding excluded)."""
        return None if self._lens is None else self._lens.copy()

    def finish(self, keep=None):
        """Ends generation: commits the keyed pages (key_tokens) so other processes of the
        cache scope find them, then releases the sequences unless keep (default: the
        constructor's). Idempotent once released."""
        keep = self.keep if keep is None else keep
        self._step = None
        self._first = None
        self._reserver = None
        if getattr(_active, "cache", None) is self:
            _active.cache = None
        if self._lens is None:
            return
        seqs = self._seq_ids[: self._lens.size]
        if self.key_tokens:
            self.client.commit(seqs)
        if not keep:
            self.client.release(seqs)
            self._lens = None
            self._hf_len = 0
            self._seq_ids = None if self._auto_ids else self._seq_ids

    def close(self):
        """finish(), then removes the forward pre-hook (and the graph wrapper) from the model."""
        try:
            self.finish()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if self._orig_forward is not None:
                if self._prev_forward is not None:
                    self._model.forward = self._prev_forward
                else:
                    self._model.__dict__.pop("forward", None)  # the class's forward again
                self._orig_forward = None
            self._graphs.clear()

    # ---- transformers' Cache interface --------------------------------------------------------

    def get_seq_length(self, layer_idx=0):
        return self._hf_len

    def get_mask_sizes(self, query_length, layer_idx=0):
        return self._hf_len + query_length, 0

    def get_max_length(self, layer_idx=None):
        return -1

    @property
    def is_compileable(self):
        return False

    @property
    def batch_size(self):
        return -1 if self._lens is None else int(self._lens.size)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Appends the step's new K/V of layer layer_idx ([B, Hkv, T, D], real tokens only) to
        the pool; returns the states unchanged (attention reads the pool)."""
        t0 = time.perf_counter()
        s = self._step
        if s is None:
            raise RuntimeError("KvpoolCache.update outside a step: the model's forward pre-hook "
                               "did not run (call the model itself, with past_key_values=cache)")
        if key_states.dtype != self.dtype or key_states.device != self.device:
            raise TypeError("layer %d's K/V are %s on %s, the pool is %s on %s (no conversion)"
                            % (layer_idx, key_states.dtype, key_states.device, self.dtype,
                               self.device))
        if s.nnz:
            cache = (self._k[layer_idx], self._v[layer_idx])
            if s.append is not None and s.dense:
                try:  # the states as they are: no transpose, reshape or gather
                    s.append.states(key_states, value_states, *cache)
                    self.host_seconds["append"] += time.perf_counter() - t0
                    return key_states, value_states
                except ValueError:  # strides it cannot take: the rows gathered below
                    self.append_fallbacks += 1
            k, v = _rows_of(s, key_states), _rows_of(s, value_states)  # [nnz, Hkv, D]
            if s.append is not None:
                s.append(k, v, cache)
            else:
                paged.append_paged_kv_cache(k, v, s.bi, s.pos, cache, s.kv_indices, s.kv_indptr,
                                            s.kv_last, kv_layout=self.layout)
            self.host_seconds["append"] += time.perf_counter() - t0
        return key_states, value_states

    # ---- the step ---------------------------------------------------------------------------

    _auto_ids = False

    def _rows(self, B):
        if self._lens is None:
            if self._seq_ids is None:
                base = int.from_bytes(os.urandom(8), "little") & ((1 << 62) - 1) & ~0xFFFF
                self._seq_ids = np.arange(base, base + B, dtype=np.uint64)
                self._auto_ids = True
            if self._seq_ids.size != B:
                raise ValueError("%d seq_ids for a batch of %d" % (self._seq_ids.size, B))
            self._lens = np.zeros(B, np.int64)
        elif self._lens.size != B:
            raise ValueError("the batch has %d rows, the cache %d" % (B, self._lens.size))
        return self._seq_ids

    def _forward(self, *args, **kwargs):
        """model.forward under cuda_graphs: a decode step from its batch size's graph, anything
        else the model's own forward (the pre-hook has run the step's Reserve either way)."""
        if self._first is not None and kwargs.get("past_key_values") is self:
            logits, self._first = self._first, None  # generate()'s first step: computed
            from transformers.modeling_outputs import CausalLMOutputWithPast
            return CausalLMOutputWithPast(logits=logits, past_key_values=self)
        s = self._step
        ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
        if not self.cuda_graphs or args or s is None or kwargs.get("past_key_values") is not self or ids is None or \
                pos is None or not s.dense or s.T != 1 or self._fi_scaling is None or \
                any(v for k, v in kwargs.items() if k not in _GRAPH_KWARGS and v is not None
                    and v is not False):
            return self._orig_forward(*args, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        B = int(ids.shape[0])
        g = self._graphs.get(B)
        if g is None:
            g = self._graphs[B] = _DecodeGraph(self, B)
        t0 = time.perf_counter()
        g.load(self, s, self.num_q_heads)
        self.host_seconds["attention_plan"] += time.perf_counter() - t0
        g.ids.copy_(ids)
        g.pos.copy_(pos)
        kw = dict(input_ids=g.ids, position_ids=g.pos, past_key_values=self, use_cache=True)
        if g.graph is None:
            dev = self.device
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # once for real: kernels chosen, workspaces made
                s.append = g.fused(self, side)
                self._orig_forward(**kw)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                s.append = g.fused(self, torch.cuda.current_stream(dev))
                out = self._orig_forward(**kw)
            g.graph, g.logits = graph, out.logits
        g.graph.replay()
        self.graph_steps += 1
        return CausalLMOutputWithPast(logits=g.logits.clone(), past_key_values=self)

    def _pre_hook(self, module, args, kwargs):
        if kwargs.get("past_key_values") is not self:
            return None
        impl = getattr(module.config, "_attn_implementation", None)
        if impl != ATTENTION_NAME:
            raise ValueError("KvpoolCache needs attn_implementation=%r (the model uses %r): "
                             "model.set_attn_implementation(%r)" % (ATTENTION_NAME, impl,
                                                                   ATTENTION_NAME))
        if self._prepared is not None:
            table, new = self._prepared
            self._prepared = None
            self._start_step(table, new)
            return None
        if self._first is not None:  # computed by kvpool_generate's prefill: no Reserve
            ids = kwargs.get("input_ids")
            if ids is None or ids.dim() != 2 or ids.shape[1] != 1:
                self._first = None
                raise RuntimeError("kvpool_generate: generate()'s first step is not the last "
                                   "prompt token (input %s)" % (None if ids is None else
                                                                tuple(ids.shape),))
            self._step = None
            self._hf_len += 1
            return None
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        emb = kwargs.get("inputs_embeds")
        shape = tuple(ids.shape[:2]) if ids is not None else tuple(emb.shape[:2])
        self.begin_step(ids, kwargs.get("attention_mask"), shape)
        return None

    def begin_step(self, input_ids, attention_mask, shape):
        """The step's one Reserve (the hook calls this): input_ids [B, T] (None with
        inputs_embeds: no keys), attention_mask [B, >= T] or None."""
        t0 = time.perf_counter()
        B, T = int(shape[0]), int(shape[1])
        new = _mask_numpy(attention_mask, B, T)
        seqs = self._rows(B)
        counts = new.sum(axis=1).astype(np.uint32)
        token_ids = None
        if self.key_tokens and input_ids is not None:
            token_ids = input_ids.detach().to("cpu").numpy()[new]
        if self._reserver is None or self._reserver[0] is not seqs:
            # made once for the batch's sequences; each step then only fills it in
            self._reserver = (seqs, self.client.step_reserve(seqs, salts=self.salt))
        table = self._reserver[1].run(counts, token_ids)
        self.reserves += 1
        self._hf_len += T
        self._start_step(table, new)
        self.host_seconds["reserve"] += time.perf_counter() - t0

    def _start_step(self, table, new):
        B, T = new.shape
        counts = new.sum(axis=1).astype(np.int64)
        want = self._lens + counts
        got = np.asarray(table.seq_lens, np.int64)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise RuntimeError("Reserve answered seq_lens %s, expected %s" % (got.tolist(),
                                                                             want.tolist()))
        self.client.apply_copies(table)
        s = _Step()
        s.table, s.T, s.counts, s.old_lens = table, T, counts, self._lens
        rb, rt = np.nonzero(new)
        s.rows = (rb, rt)  # host copies (the SDPA fallback's mask)
        nnz = int(rb.size)
        if int(table.nnz) != nnz:
            raise RuntimeError("Reserve appends %d tokens, the step has %d" % (table.nnz, nnz))
        # dense: every column of every row is a new token (no padding: a decode step of a
        # batch, or a prefill of equal lengths), so a layer's rows are a view, not a gather
        s.dense, s.nnz = nnz == B * T, nnz
        if self.cuda:
            # the fused append computes each token's position from the page table inside its
            # one launch (libkvpool's kvp_client_cuda_append_fused): only append_indptr is sent
            s.bi = s.pos = None
            parts = (rb, rt, table.append_indptr, table.kv_indices, table.kv_indptr,
                     table.kv_last_page_len)
        else:
            s.aip = None
            bi, pos = paged.get_batch_indices_positions(table.append_indptr, table.seq_lens, nnz)
            parts = (rb, rt, bi, pos, table.kv_indices, table.kv_indptr, table.kv_last_page_len)
        # the step's int32 arrays go to the pool's device in one copy, then are sliced
        flat = torch.from_numpy(np.concatenate([np.asarray(a, np.int32) for a in parts]))
        if self.cuda:
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        views = torch.split(flat, [len(a) for a in parts])
        if self.cuda:
            s.rb, s.rt, s.aip, s.kv_indices, s.kv_indptr, s.kv_last = views
            # checked and built once a step; each layer's append then only launches
            s.append = _torch.FusedAppend((self._k[0], self._v[0]), s.aip, s.kv_indices,
                                          s.kv_indptr, s.kv_last, kv_layout=self.layout)
        else:
            s.rb, s.rt, s.bi, s.pos, s.kv_indices, s.kv_indptr, s.kv_last = views
            s.append = None
        s.gather = s.plan = s.wrapper = None
        self._lens = got
        self._step = s
        _active.cache = self

    # ---- attention ----------------------------------------------------------------------------

    def attend(self, layer_idx, query, scaling, softcap=None):
        """The step's attention of layer layer_idx: query [B, Hq, T, D] -> [B, T, Hq, D]."""
        s = self._step
        if s is None:
            raise RuntimeError("kvpool attention outside a KvpoolCache step")
        if scaling is None:
            scaling = self.head_dim ** -0.5
        if self.use_flashinfer:
            return self._attend_flashinfer(s, layer_idx, query, float(scaling), softcap)
        return self._attend_sdpa(s, layer_idx, query, float(scaling), softcap)

    def _gather_plan(self, s):
        """Per step: the pages/slots [B, S_max] of each row's whole sequence, and the mask
        [B, 1, T, S_max] (key j visible to a real query at position p when j <= p)."""
        t, ps, dev = s.table, self.page_size, self.device
        lens = np.asarray(t.seq_lens, np.int64)
        B = lens.size
        S = max(int(lens.max()) if B else 0, 1)
        j = np.arange(S, dtype=np.int64)
        pages = np.zeros((B, S), np.int64)
        for b in range(B):
            n = int(lens[b])
            if n:
                ip = int(t.kv_indptr[b])
                row = np.asarray(t.kv_indices[ip: ip + (n + ps - 1) // ps], np.int64)
                pages[b, :n] = row[j[:n] // ps]
        slots = np.broadcast_to(j % ps, (B, S))
        valid = j[None, :] < lens[:, None]  # [B, S]
        qpos = np.full((B, s.T), -1, np.int64)  # -1: padding
        rb, rt = s.rows
        if rb.size:
            start = np.concatenate([[0], np.cumsum(s.counts)[:-1]])
            k = np.arange(rb.size) - start[rb]
            qpos[rb, rt] = s.old_lens[rb] + k
        mask = valid[:, None, :] & ((j[None, None, :] <= qpos[:, :, None]) |
                                    (qpos[:, :, None] < 0))
        mask[:, :, 0] |= ~mask.any(axis=2)  # no fully masked query row (NaN): never read
        s.gather = (torch.from_numpy(np.array(pages)).to(dev), torch.from_numpy(
            np.array(slots)).to(dev), torch.from_numpy(mask[:, None]).to(dev))
        return s.gather

    def _attend_sdpa(self, s, layer, query, scaling, softcap):
        if softcap:
            raise NotImplementedError("logit soft-capping in the SDPA fallback")
        pages, slots, mask = s.gather or self._gather_plan(s)
        kv, vv = self._k[layer], self._v[layer]
        if self.layout == "HND":
            K, V = kv[pages, :, slots], vv[pages, :, slots]  # [B, S, Hkv, D]
        else:
            K, V = kv[pages, slots], vv[pages, slots]
        K, V = K.transpose(1, 2), V.transpose(1, 2)  # [B, Hkv, S, D]
        group = query.shape[1] // K.shape[1]
        if group > 1:
            K = K.repeat_interleave(group, dim=1)
            V = V.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(query, K, V, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous()

    def _fi_plan(self, s, Hq, scaling, softcap):
        """Plans FlashInfer on the step's page table (rows that add tokens only): once a step."""
        fi = _flashinfer()
        t, dev = s.table, self.device
        if self._fi_workspace is None:
            self._fi_workspace = torch.zeros(_FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8,
                                             device=dev)
            self._fi_prefill = fi.BatchPrefillWithPagedKVCacheWrapper(
                self._fi_workspace, self.layout, backend=self._fi_backend)
            self._fi_decode = fi.BatchDecodeWithPagedKVCacheWrapper(self._fi_workspace,
                                                                    self.layout)
        active = np.nonzero(s.counts > 0)[0]
        ip = np.asarray(t.kv_indptr, np.int64)
        npages = ip[1:] - ip[:-1]
        kv_indptr = np.concatenate([[0], np.cumsum(npages[active])]).astype(np.int32)
        indices = np.concatenate([np.asarray(t.kv_indices[ip[b]: ip[b + 1]]) for b in active]
                                 ).astype(np.int32) if active.size else np.zeros(0, np.int32)
        last = np.asarray(t.kv_last_page_len, np.int32)[active]
        qo_indptr = np.concatenate([[0], np.cumsum(s.counts[active])]).astype(np.int32)
        cpu = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        common = self._fi_common(scaling, softcap)
        # every row active (a decode step): the step's kv_indices are on the device already
        idx = s.kv_indices if active.size == s.counts.size else cpu(indices).to(dev)
        if active.size and np.all(s.counts[active] == 1):
            self._fi_decode.plan(cpu(kv_indptr), idx, cpu(last), Hq, self.num_kv_heads,
                                 self.head_dim, self.page_size, **common)
            s.wrapper = self._fi_decode
        else:
            self._fi_prefill.plan(cpu(qo_indptr), cpu(kv_indptr), idx, cpu(last), Hq,
                                  self.num_kv_heads, self.head_dim, self.page_size, causal=True,
                                  **common)
            s.wrapper = self._fi_prefill
        s.plan = (scaling, softcap)

    def _fi_common(self, scaling, softcap):
        """The keywords every FlashInfer plan of this cache takes."""
        return dict(pos_encoding_mode="NONE", sm_scale=scaling,
                    logits_soft_cap=float(softcap) if softcap else None,
                    q_data_type=self.dtype, kv_data_type=self.dtype)

    def _attend_flashinfer(self, s, layer, query, scaling, softcap):
        B, Hq, T, D = query.shape
        if not s.rb.numel():
            return torch.zeros(B, T, Hq, D, dtype=query.dtype, device=query.device)
        if s.plan != (scaling, softcap):
            if self.cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("kvpool attention: a plan inside a CUDA graph capture")
            t0 = time.perf_counter()
            self._fi_plan(s, Hq, scaling, softcap)
            self.host_seconds["attention_plan"] += time.perf_counter() - t0
            self._fi_scaling = (scaling, softcap)
        out = None if s.dense else torch.zeros(B, T, Hq, D, dtype=query.dtype,
                                                device=query.device)
        q = _rows_of(s, query).contiguous()  # [nnz, Hq, D]
        o = s.wrapper.run(q, (self._k[layer], self._v[layer]))
        if s.dense:
            return o.view(B, T, Hq, D)
        out[s.rb, s.rt] = o.to(query.dtype)
        return out


class _DecodeGraph:
    """KvpoolCache(cuda_graphs=True)'s decode step of batch B in a CUDA graph.

    Static device buffers: the step's page table ([append_indptr | kv_indptr |
    kv_last_page_len | kv_indices], capacity: the pool's pages) for the fused appends, the input
    ids and positions, and FlashInfer's decode wrapper in its CUDA-graph mode over buffers of
    its own. Each step copies the Reserve's table in (one copy from a pinned buffer), plans
    FlashInfer (host), copies the step's ids and positions, and replays; the graph's logits are
    copied out (the next replay overwrites them). The first step of a batch size runs the
    forward once on a side stream (kernels chosen, workspaces made; it writes the same K/V the
    replay writes), captures it, then replays it."""

    def __init__(self, cache, B):
        dev, cap = cache.device, int(cache.info.num_pages)
        i32 = dict(dtype=torch.int32, device=dev)
        self.B, self.cap = B, cap
        self.buf = torch.zeros(3 * B + 2 + cap, **i32)
        self.host = torch.zeros(3 * B + 2 + cap, dtype=torch.int32).pin_memory()
        self.aip, self.indptr = self.buf[: B + 1], self.buf[B + 1: 2 * B + 2]
        self.last, self.indices = self.buf[2 * B + 2: 3 * B + 2], self.buf[3 * B + 2:]
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, 1, dtype=torch.long, device=dev)
        fi = _flashinfer()
        if cache._fi_workspace is None:
            cache._fi_workspace = torch.zeros(_FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8,
                                              device=dev)
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            cache._fi_workspace, cache.layout, use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.zeros(B + 1, **i32),
            paged_kv_indices_buffer=torch.zeros(cap, **i32),
            paged_kv_last_page_len_buffer=torch.zeros(B, **i32))
        self.graph = None
        self.logits = None

    def load(self, cache, s, Hq):
        """The step's table into the static buffers, FlashInfer planned on it (host)."""
        t = s.table
        B, n = self.B, int(t.kv_indices.size)
        if n > self.cap:
            raise RuntimeError("a page table of %d pages, the graph holds %d" % (n, self.cap))
        h = self.host.numpy()
        h[: B + 1] = t.append_indptr
        h[B + 1: 2 * B + 2] = t.kv_indptr
        h[2 * B + 2: 3 * B + 2] = t.kv_last_page_len
        h[3 * B + 2: 3 * B + 2 + n] = t.kv_indices
        used = 3 * B + 2 + n
        self.buf[:used].copy_(self.host[:used], non_blocking=True)
        scaling, softcap = cache._fi_scaling
        self.wrapper.plan(torch.from_numpy(np.asarray(t.kv_indptr, np.int32)), self.indices[:n],
                          torch.from_numpy(np.asarray(t.kv_last_page_len, np.int32)), Hq,
                          cache.num_kv_heads, cache.head_dim, cache.page_size,
                          **cache._fi_common(scaling, softcap))
        s.wrapper, s.plan = self.wrapper, (scaling, softcap)

    def fused(self, cache, stream):
        return _torch.FusedAppend((cache._k[0], cache._v[0]), self.aip, self.indices,
                                  self.indptr, self.last, kv_layout=cache.layout, stream=stream)


# forward() keywords a graph step takes (anything else truthy: the step runs eagerly)
_GRAPH_KWARGS = frozenset(("input_ids", "position_ids", "attention_mask", "past_key_values",
                           "use_cache", "cache_position", "logits_to_keep", "return_dict"))


def kvpool_attention_forward(module, query, key, value, attention_mask, scaling=None,
                             dropout=0.0, **kwargs):
    """transformers' attention function "kvpool": attention over the K/V in the pool, through
    the page table of the KvpoolCache step running in this thread (key, value and
    attention_mask are ignored: the cache knows the step's tokens and padding). Returns
    (attn_output [B, T, Hq, D], None)."""
    cache = getattr(_active, "cache", None)
    if cache is None or cache._step is None:
        raise RuntimeError("attn_implementation 'kvpool' needs past_key_values=KvpoolCache(...)")
    if dropout:
        raise NotImplementedError("kvpool attention has no dropout (inference only)")
    return cache.attend(module.layer_idx, query, scaling, kwargs.get("softcap")), None


def register():
    """Registers "kvpool" with transformers' AttentionInterface (done on import)."""
    AttentionInterface.register(ATTENTION_NAME, kvpool_attention_forward)


register()


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
    cache._hf_len = L - 1
    if cache.key_tokens:
        t0 = time.perf_counter()
        cache.client.commit(seqs)
        cache.last_prefill["commit_ms"] = (time.perf_counter() - t0) * 1e3
