/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_bench_kernels.h - benchmark-only kernels (kvp_bench_kernels.cu): a fixed-time compute
 * stand-in, a slow producer and a reader of the rows just appended. Not part of the kernel
 * library's API. Each returns 0 or a KVP_E* code, a CUDA failure recorded with its file and line
 * (cuda/kvp_cuda_err.h: kvp_cuda_last_error).
 */
#ifndef KVP_BENCH_KERNELS_H
#define KVP_BENCH_KERNELS_H

#include "kvp_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Keeps `blocks` blocks busy for ns nanoseconds (the %globaltimer clock). */
int kvp_bench_spin_cuda(uint64_t ns, unsigned blocks, void *stream);
/* Launches a one-thread kernel under programmatic dependent launch (the PDL chain's floor). */
int kvp_bench_empty_pdl_cuda(void *stream);
/* Copies bytes (a multiple of 16) from src to dst as one contiguous run, 16-byte vectors, under
 * PDL when pdl (waiting for the predecessor before its first load): what any append moving the
 * same bytes is bounded by. */
int kvp_bench_plain_copy_cuda(void *dst, const void *src, uint64_t bytes, int pdl, void *stream);
/* Copies the K and V rows of nnz tokens (token-major sources sk / sv, H x D each) to the
 * slots of the bench's interleaved page table (request b's page k is k * batch_size + b; its
 * tokens at positions old_len..old_len + tokens - 1), each destination computed from the token
 * index without a load: the scatter of a paged append with none of its lookups. H, D, tokens
 * and page_size powers of two (else KVP_EINVAL). */
int kvp_bench_scatter_copy_cuda(const kvp_paged_kv_t *kv, const void *sk, const void *sv,
                                uint32_t nnz, uint32_t tokens, uint32_t old_len, int pdl,
                                void *stream);
/* Spins ns nanoseconds, then fills bytes (a multiple of 16) of dst with value: a slow
 * producer of an append's sources (the PDL ordering test). */
int kvp_bench_spin_fill_cuda(void *dst, uint64_t bytes, uint8_t value, uint64_t ns, void *stream);
/* Adds the first 8 bytes of every head's K row of every request's last token into *sum_dev. */
int kvp_bench_read_last_cuda(const kvp_paged_kv_t *kv, unsigned long long *sum_dev, void *stream);
int kvp_bench_kernels_preload(void);

#ifdef __cplusplus
}
#endif
#endif
