# SPDX-License-Identifier: Apache-2.0
"""The "kvpool" attention of the transformers integration: the function transformers calls
(kvpool_attention_forward, registered with its AttentionInterface), and the two ways a step's
attention reads K/V from the pool through its page table (FlashInfer's paged wrappers, planned
once a step; or a gather + SDPA fallback). The KvpoolCache of the step reaches the function
in the attention kwargs (KWARG), as transformers' own paged attention gets its cache: the
cache's forward pre-hook adds it to the model's forward keywords, which every layer hands on
to its attention function. Nothing here keeps state between steps but FlashInfer's module."""
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from transformers.modeling_utils import AttentionInterface

ATTENTION_NAME = "kvpool"
# the attention keyword that carries the step's KvpoolCache (put there by its pre-hook)
KWARG = "kvpool_cache"
_FLASHINFER_WORKSPACE_BYTES = 128 << 20

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


def _rows_of(s, states):
    """The step's new rows of a layer's [B, H, T, D] states as [nnz, H, D] in batch order: a
    view when the step is dense (no padding), else a gather of the real tokens."""
    x = states.transpose(1, 2)  # [B, T, H, D]
    if s.dense:
        return x.reshape(-1, x.shape[2], x.shape[3])
    return x[s.rb, s.rt]


class AttentionMixin:
    """KvpoolCache's attention methods (the cache's fields: _step, _k/_v pool views, the
    FlashInfer wrappers and workspace); kept apart from the cache's step bookkeeping."""

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



def kvpool_attention_forward(module, query, key, value, attention_mask, scaling=None,
                             dropout=0.0, **kwargs):
    """transformers' attention function "kvpool": attention over the K/V in the pool, through
    the page table of the KvpoolCache step given in kwargs[KWARG] (key, value and
    attention_mask are ignored: the cache knows the step's tokens and padding). Returns
    (attn_output [B, T, Hq, D], None)."""
    cache = kwargs.get(KWARG)
    if cache is None or cache._step is None:
        raise RuntimeError("attn_implementation 'kvpool' needs past_key_values=KvpoolCache(...)")
    if dropout:
        raise NotImplementedError("kvpool attention has no dropout (inference only)")
    return cache.attend(module.layer_idx, query, scaling, kwargs.get("softcap")), None


def register():
    """Registers "kvpool" with transformers' AttentionInterface (done on import)."""
    AttentionInterface.register(ATTENTION_NAME, kvpool_attention_forward)
