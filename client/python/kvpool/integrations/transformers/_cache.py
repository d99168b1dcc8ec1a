# SPDX-License-Identifier: Apache-2.0
"""KvpoolCache: the transformers Cache whose K/V live only in the kvpool daemon's pool. One
forward step = one Reserve (the model's forward pre-hook), one append a layer (Cache.update:
the fused append on the cuda backend, NumPy's on the host backend), attention through the
step's page table (AttentionMixin, kvpool.integrations.transformers._attention). The package's
docstring tells the whole story; this file is the step's bookkeeping and the Cache interface."""
import os
import time

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ... import _torch, paged
from ...codes import Backend, DType, Layout, torch_dtype
from ._attention import KWARG, ATTENTION_NAME, AttentionMixin, _flashinfer, _rows_of
from ._forward import ForwardOverride

# the pool dtypes a model computes in (fp8 pools are not)
_COMPUTE_DTYPES = (DType.FP16, DType.BF16, DType.FP32)


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

    __slots__ = ("table", "nnz", "rb", "rt", "rows", "dense", "bi", "pos", "aip", "append",
                 "kv_indices", "kv_indptr", "kv_last", "T", "counts", "old_lens", "gather", "plan",
                 "wrapper")


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


class KvpoolCache(AttentionMixin, Cache):
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
        if info.dtype not in _COMPUTE_DTYPES:
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
        self.dtype = torch_dtype(info.dtype)
        self.cuda = info.backend == Backend.CUDA
        self.device = torch.device("cuda", info.device_ids[0]) if self.cuda else \
            torch.device("cpu")
        self.page_size = int(info.page_size)
        self.layout = "HND" if info.layout == Layout.HND else "NHD"
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
        # model.forward overridden only for what no hook can do (_forward.py): graph steps,
        # and generate()'s first step after kvpool_generate's prefill (installed then)
        self._forward_override = ForwardOverride(model, self)
        if self.cuda_graphs:
            self._forward_override.install()

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
        """finish(), then removes the forward pre-hook (and the forward override) from the
        model."""
        try:
            self.finish()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self._forward_override.remove()
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

    def _pre_hook(self, module, args, kwargs):
        """The model's forward pre-hook: a call with past_key_values=this cache is a step.
        Runs its Reserve and hands this cache to the attention function through the forward's
        keywords (KWARG), which the model passes down to every layer's attention."""
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
            return args, {**kwargs, KWARG: self}
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
        return args, {**kwargs, KWARG: self}

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

