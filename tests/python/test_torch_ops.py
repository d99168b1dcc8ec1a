# SPDX-License-Identifier: Apache-2.0
"""kvpool's PyTorch custom operators (torch.library, kvpool._torch) on the CPU: no GPU and no
daemon. The page-table helpers (torch.ops.kvpool.get_seq_lens, .get_batch_indices_positions)
give NumPy's exact answers on CPU tensors, pass torch.library.opcheck (schema, fake
implementation, autograd registration) and are traced by torch.compile without a graph break;
the fused append's operator declares the caches and the err word as written, and its fake
implementation traces on meta tensors (its real one needs a GPU: test_torch.py).
Skipped without PyTorch (tests/python/run.sh --torch installs it)."""
import numpy as np
import pytest

from conftest import kvpool  # noqa: F401 (the package, installed or the source tree's)

torch = pytest.importorskip("torch")

from kvpool import _torch  # noqa: E402,F401 (registers the operators)

I32 = dict(dtype=torch.int32)
# two requests: 5 tokens on pages [3, 6], then 2 tokens appended after 3 on [1, 4] (page 4)
KV_INDPTR, LAST, PAGE = [0, 2, 4], [1, 1], 4
APPEND_INDPTR, SEQ_LENS, NNZ = [0, 5, 7], [5, 5], 8  # one padding entry


def test_helpers_give_numpys_answers_on_cpu_tensors():
    lens = torch.ops.kvpool.get_seq_lens(torch.tensor(KV_INDPTR, **I32),
                                         torch.tensor(LAST, **I32), PAGE)
    assert lens.dtype == torch.int32 and lens.tolist() == [5, 5]
    bi, pos = torch.ops.kvpool.get_batch_indices_positions(
        torch.tensor(APPEND_INDPTR, **I32), torch.tensor(SEQ_LENS, **I32), NNZ)
    assert bi.tolist() == [0, 0, 0, 0, 0, 1, 1, -1]
    assert pos.tolist() == [0, 1, 2, 3, 4, 3, 4, 0]
    nbi, npos = kvpool.get_batch_indices_positions(np.array(APPEND_INDPTR), np.array(SEQ_LENS),
                                                   NNZ)
    assert bi.tolist() == nbi.tolist() and pos.tolist() == npos.tolist()
    # kvpool's functions take torch tensors of any integer dtype through the operators
    bi64, _ = kvpool.get_batch_indices_positions(torch.tensor(APPEND_INDPTR),
                                                 torch.tensor(SEQ_LENS), NNZ)
    assert bi64.dtype == torch.int32 and bi64.tolist() == bi.tolist()
    # and refuse what NumPy refuses, with its message
    with pytest.raises(ValueError, match="append_indptr\\[-1\\] = 9 exceeds nnz = 8"):
        kvpool.get_batch_indices_positions(torch.tensor([0, 5, 9]), torch.tensor(SEQ_LENS), NNZ)


def test_helpers_pass_opcheck():
    for op, args in ((torch.ops.kvpool.get_seq_lens,
                      (torch.tensor(KV_INDPTR, **I32), torch.tensor(LAST, **I32), PAGE)),
                     (torch.ops.kvpool.get_batch_indices_positions,
                      (torch.tensor(APPEND_INDPTR, **I32), torch.tensor(SEQ_LENS, **I32), NNZ))):
        res = torch.library.opcheck(op, args)
        assert set(res.values()) == {"SUCCESS"}, (op, res)


def test_compile_traces_the_helpers_in_one_graph():
    def step(kv_indptr, last, append_indptr):
        lens = kvpool.get_seq_lens(kv_indptr, last, PAGE)
        bi, pos = kvpool.get_batch_indices_positions(append_indptr, lens, NNZ)
        return bi * 1000 + pos

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)  # a break raises
    out = compiled(torch.tensor(KV_INDPTR, **I32), torch.tensor(LAST, **I32),
                   torch.tensor(APPEND_INDPTR, **I32))
    assert out.tolist() == [0, 1, 2, 3, 4, 1003, 1004, -1000]


def test_fused_append_operator_declares_its_writes_and_traces_on_meta():
    schema = torch.ops.kvpool.append_paged_kv_cache_fused.default._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and
               a.alias_info.is_write]
    assert written == ["k_cache", "v_cache", "err"]
    assert len(schema.returns) == 0
    from torch.fx.experimental.proxy_tensor import make_fx

    def append(key, k, v, aip, idx, ip, last, err):
        torch.ops.kvpool.append_paged_kv_cache_fused(key, key, k, v, aip, idx, ip, last, "NHD",
                                                     err, False)
        return k

    meta = dict(device="meta")
    args = (torch.empty(3, 2, 8, dtype=torch.float16, **meta),
            torch.empty(4, 16, 2, 8, dtype=torch.float16, **meta),
            torch.empty(4, 16, 2, 8, dtype=torch.float16, **meta),
            torch.empty(2, **I32, **meta), torch.empty(1, **I32, **meta),
            torch.empty(2, **I32, **meta), torch.empty(1, **I32, **meta),
            torch.empty(1, **I32, **meta))
    gm = make_fx(append)(*args)
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.kvpool.append_paged_kv_cache_fused.default]
