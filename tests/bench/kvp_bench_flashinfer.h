/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_bench_flashinfer.h - benchmark-only (kvp_bench_flashinfer.cu, linked by
 * tests/bench/bench_append_cuda only): FlashInfer's own AppendPagedKVCache, compiled from the
 * C++ headers of the flashinfer-python wheel fetched at configure time (-DKVP_BENCH_FLASHINFER=ON
 * or -DKVP_FLASHINFER_WHEEL=PATH, tests/bench/kvp_flashinfer.cmake), run on a pool that
 * kvp_paged_kv_t describes, as the baseline kvpool's appends are measured against; and two
 * helpers that check two appends wrote the same bytes (a fill with a pattern, a diff).
 * Nothing of FlashInfer is in the tree: built without it, the FlashInfer entry points return
 * KVP_EUNAVAIL and kvp_bench_flashinfer_available() says 0; the helpers always work. Nothing
 * is needed at run time (the headers are compiled in). Each returns 0 or a KVP_E* code, a CUDA
 * failure recorded with its file and line (cuda/kvp_cuda_err.h: kvp_cuda_last_error). Streams
 * are cudaStream_t passed as void *; every call only enqueues work (graph-capture safe).
 */
#ifndef KVP_BENCH_FLASHINFER_H
#define KVP_BENCH_FLASHINFER_H

#include "kvp_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when FlashInfer's AppendPagedKVCache was compiled in, else 0. */
int kvp_bench_flashinfer_available(void);

/* What was compiled in ("flashinfer-python 0.7.2.post1 headers") or why nothing was. Static. */
const char *kvp_bench_flashinfer_what(void);

/*
 * FlashInfer's AppendPagedKVCache<half, int32_t> (page.cuh) on the layer kv describes, with
 * batch_indices/positions given (device arrays of nnz entries: FlashInfer's contract, no
 * padding entries, nothing checked on the device). Its paged_kv_t is built over the same
 * memory, page table and strides (combined or split storage, NHD or HND: the strides say
 * which). fp16 only (elem_bytes 2), head_dim 64, 128, 256 or 512, at most 1,024 threads per
 * block (min(head_dim / 8, 32) * num_heads), pool strides below 2^32 elements (FlashInfer keeps
 * them in 32 bits), 16-byte aligned rows; else KVP_EINVAL before anything is queued. nnz 0:
 * nothing. KVP_EUNAVAIL when built without FlashInfer.
 */
int kvp_bench_flashinfer_append_cuda(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                     const int32_t *batch_indices, const int32_t *positions,
                                     uint32_t nnz, void *stream);

/* Fills bytes (a multiple of 16) of dst with a pattern of seed: 16-byte word i is a hash of
 * (seed, i), so no two words and no two seeds' fills look alike (METHOD.md: never zeros). */
int kvp_bench_fill_cuda(void *dst, uint64_t bytes, uint64_t seed, void *stream);

/* Adds to *count_dev (device) the number of 16-byte words of a[0, bytes) that differ from b's,
 * or, with b NULL, from what kvp_bench_fill_cuda(seed) wrote there. bytes a multiple of 16. */
int kvp_bench_diff_cuda(const void *a, const void *b, uint64_t bytes, uint64_t seed,
                        unsigned long long *count_dev, void *stream);

/* Loads this file's kernels (FlashInfer's too when compiled in) in the current context. */
int kvp_bench_flashinfer_preload(void);

#ifdef __cplusplus
}
#endif
#endif
