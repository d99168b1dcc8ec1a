# SPDX-License-Identifier: Apache-2.0
"""KvpoolCache(cuda_graphs=True): a decode step of batch B replayed from a CUDA graph captured
once per batch size. The step's Reserve, page-table upload and FlashInfer plan stay on the
host; the whole forward (every layer's fused append and attention) is one replay. Reached from
the cache's forward override (kvpool.integrations.transformers._forward)."""
import time

import numpy as np
import torch

from ... import _torch
from ._attention import _FLASHINFER_WORKSPACE_BYTES, KWARG, _flashinfer


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
_GRAPH_KWARGS = frozenset((KWARG, "input_ids", "position_ids", "attention_mask",
                           "past_key_values", "use_cache", "cache_position", "logits_to_keep",
                           "return_dict"))


def graph_step(cache, args, kwargs):
    """Runs the step from its batch size's graph when it is a graph step (cuda_graphs, a dense
    one-token step with FlashInfer planned, nothing but _GRAPH_KWARGS): the model's output;
    None otherwise (the caller runs the model's own forward)."""
    s = cache._step
    ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
    if not cache.cuda_graphs or args or s is None or kwargs.get("past_key_values") is not cache \
            or ids is None or pos is None or not s.dense or s.T != 1 or \
            cache._fi_scaling is None or \
            any(v for k, v in kwargs.items() if k not in _GRAPH_KWARGS and v is not None
                and v is not False):
        return None
    from transformers.modeling_outputs import CausalLMOutputWithPast

    B = int(ids.shape[0])
    g = cache._graphs.get(B)
    if g is None:
        g = cache._graphs[B] = _DecodeGraph(cache, B)
    t0 = time.perf_counter()
    g.load(cache, s, cache.num_q_heads)
    cache.host_seconds["attention_plan"] += time.perf_counter() - t0
    g.ids.copy_(ids)
    g.pos.copy_(pos)
    kw = {"input_ids": g.ids, "position_ids": g.pos, "past_key_values": cache,
          "use_cache": True, KWARG: cache}
    forward = cache._forward_override.original
    if g.graph is None:
        dev = cache.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # once for real: kernels chosen, workspaces made
            s.append = g.fused(cache, side)
            forward(**kw)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            s.append = g.fused(cache, torch.cuda.current_stream(dev))
            out = forward(**kw)
        g.graph, g.logits = graph, out.logits
    g.graph.replay()
    cache.graph_steps += 1
    return CausalLMOutputWithPast(logits=g.logits.clone(), past_key_values=cache)
