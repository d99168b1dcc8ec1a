/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_cuda_stub.c - the CUDA entry points of kvp_kernels_cuda.h for a build without CUDA:
 * kvp_cuda_available() says 0 and every operation returns KVP_EUNAVAIL, so callers link the
 * same symbols either way and decide at run time (libkvpool's older append entry points are
 * kvp_append_cuda_compat.c's in both builds, over kvp_append_cuda here).
 */
#include "kvp_kernels_cuda.h"

/* libkvpool exports the older append entry points (kvp_append_cuda_compat.c) but calls none:
 * this reference pulls their object out of the archive into every link that takes this one. */
__attribute__((used)) static int (*const kvp_compat_anchor)(
    const kvp_paged_kv_t *, const kvp_append_src_t *, const int32_t *, const int32_t *, uint32_t,
    int32_t *, void *) = kvp_append_paged_kv_cache_cuda;

int kvp_cuda_available(void)
{
    return 0;
}

int kvp_cuda_kernels_preload(void)
{
    return KVP_EUNAVAIL;
}

int kvp_append_cuda(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                    const kvp_append_dest_t *dest, const kvp_append_cuda_args_t *args, void *stream)
{
    (void)kv, (void)src, (void)dest, (void)args, (void)stream;
    return KVP_EUNAVAIL;
}

int kvp_append_plan_slots_cuda(const kvp_paged_kv_t *kv, const int32_t *append_indptr, uint32_t nnz,
                               int32_t *slots_dev, int32_t *err_dev, void *stream)
{
    (void)kv, (void)append_indptr, (void)nnz, (void)slots_dev, (void)err_dev, (void)stream;
    return KVP_EUNAVAIL;
}

int kvp_get_seq_lens_cuda(const int32_t *kv_indptr, const int32_t *kv_last_page_len,
                          uint32_t batch_size, uint32_t page_size, int32_t *seq_lens, void *stream)
{
    (void)kv_indptr, (void)kv_last_page_len, (void)batch_size, (void)page_size, (void)seq_lens;
    (void)stream;
    return KVP_EUNAVAIL;
}

int kvp_get_batch_indices_positions_cuda(const int32_t *append_indptr, const int32_t *seq_lens,
                                         uint32_t batch_size, uint32_t nnz, int32_t *batch_indices,
                                         int32_t *positions, void *stream)
{
    (void)append_indptr, (void)seq_lens, (void)batch_size, (void)nnz, (void)batch_indices;
    (void)positions, (void)stream;
    return KVP_EUNAVAIL;
}

int kvp_page_copy_cuda(const kvp_paged_kv_t *kv, const kvp_page_copy_t *copies, uint32_t num_copies,
                       int32_t *err_dev, void *stream)
{
    (void)kv, (void)copies, (void)num_copies, (void)err_dev, (void)stream;
    return KVP_EUNAVAIL;
}

int kvp_gather_cuda(const kvp_paged_kv_t *kv, const int32_t *slots_dev, uint32_t nnz,
                    const kvp_gather_dst_t *dst, void *stream)
{
    (void)kv, (void)slots_dev, (void)nnz, (void)dst, (void)stream;
    return KVP_EUNAVAIL;
}

int kvp_kv_pack_pages_cuda(const kvp_paged_kv_t *kv, uint32_t num_layers,
                           uint64_t layer_stride_bytes, const uint32_t *pages, uint32_t n,
                           void *buf_dev, uint64_t buf_stride_bytes,
                           const kvp_pack_cuda_opts_t *opts, void *stream)
{
    (void)kv, (void)num_layers, (void)layer_stride_bytes, (void)pages, (void)n, (void)buf_dev;
    (void)buf_stride_bytes, (void)opts, (void)stream;
    return KVP_EUNAVAIL;
}

int kvp_kv_unpack_pages_cuda(const kvp_paged_kv_t *kv, uint32_t num_layers,
                             uint64_t layer_stride_bytes, const uint32_t *pages, uint32_t n,
                             const void *buf_dev, uint64_t buf_stride_bytes,
                             const kvp_pack_cuda_opts_t *opts, void *stream)
{
    (void)kv, (void)num_layers, (void)layer_stride_bytes, (void)pages, (void)n, (void)buf_dev;
    (void)buf_stride_bytes, (void)opts, (void)stream;
    return KVP_EUNAVAIL;
}

int kvp_kv_pack_cuda(const kvp_paged_kv_t *kv, const int32_t *pages_dev, uint32_t num_tokens,
                     void *out_dev, void *stream)
{
    (void)kv, (void)pages_dev, (void)num_tokens, (void)out_dev, (void)stream;
    return KVP_EUNAVAIL;
}

int kvp_kv_unpack_cuda(const kvp_paged_kv_t *kv, const int32_t *pages_dev, uint32_t num_tokens,
                       const void *in_dev, void *stream)
{
    (void)kv, (void)pages_dev, (void)num_tokens, (void)in_dev, (void)stream;
    return KVP_EUNAVAIL;
}

int kvp_kv_pack_range_cuda(const kvp_paged_kv_t *kv, const int32_t *pages_dev, uint32_t num_tokens,
                           uint64_t begin, uint64_t end, void *out_dev, void *stream)
{
    (void)kv, (void)pages_dev, (void)num_tokens, (void)begin, (void)end, (void)out_dev;
    (void)stream;
    return KVP_EUNAVAIL;
}

int kvp_kv_unpack_range_cuda(const kvp_paged_kv_t *kv, const int32_t *pages_dev,
                             uint32_t num_tokens, uint64_t begin, uint64_t end, const void *in_dev,
                             void *stream)
{
    (void)kv, (void)pages_dev, (void)num_tokens, (void)begin, (void)end, (void)in_dev;
    (void)stream;
    return KVP_EUNAVAIL;
}

int kvp_kv_pack_range_cuda_ex(const kvp_paged_kv_t *kv, const int32_t *pages_dev,
                              uint32_t num_tokens, uint64_t begin, uint64_t end, void *out_dev,
                              const kvp_pack_cuda_opts_t *opts, void *stream)
{
    (void)kv, (void)pages_dev, (void)num_tokens, (void)begin, (void)end, (void)out_dev;
    (void)opts, (void)stream;
    return KVP_EUNAVAIL;
}

int kvp_kv_unpack_range_cuda_ex(const kvp_paged_kv_t *kv, const int32_t *pages_dev,
                                uint32_t num_tokens, uint64_t begin, uint64_t end,
                                const void *in_dev, const kvp_pack_cuda_opts_t *opts, void *stream)
{
    (void)kv, (void)pages_dev, (void)num_tokens, (void)begin, (void)end, (void)in_dev;
    (void)opts, (void)stream;
    return KVP_EUNAVAIL;
}
