/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_append_cuda_compat.c - libkvpool's exported append entry points (kvp_kernels_cuda.h, the
 * kvp_append_paged_kv_cache_* section), each one call of kvp_append_cuda with its form. They
 * stay because libkvpool.so exports them and the Python package calls two of them through
 * ctypes; nothing in this tree calls them except the tests that pin that ABI. Built with and
 * without CUDA (kvp_append_cuda is then kvp_cuda_stub.c's and says KVP_EUNAVAIL).
 */
#include "kvp_kernels_cuda.h"

static int tokens(const kvp_paged_kv_t *kv, const kvp_append_src_t *src, const int32_t *bi,
                  const int32_t *pos, uint32_t nnz, int32_t *err_dev, uint32_t flags,
                  const kvp_append_cuda_opts_t *opts, void *stream)
{
    const kvp_append_dest_t d = {
        .kind = KVP_APPEND_DEST_TOKENS, .nnz = nnz, .batch_indices = bi, .positions = pos};
    const kvp_append_cuda_args_t a = {.flags = flags, .err_dev = err_dev, .shape = opts};
    return kvp_append_cuda(kv, src, &d, &a, stream);
}

/* The fused and slots forms took KVP_CUDA_APPEND_PDL alone. */
static int indexed(const kvp_paged_kv_t *kv, const kvp_append_src_t *src, uint32_t kind,
                   const int32_t *idx, uint32_t nnz, int32_t *err_dev, unsigned flags,
                   const kvp_append_cuda_opts_t *opts, void *stream)
{
    if (flags & ~(unsigned)KVP_CUDA_APPEND_PDL)
        return KVP_EINVAL;
    const kvp_append_dest_t d = {.kind = kind,
                                 .nnz = nnz,
                                 .append_indptr = kind == KVP_APPEND_DEST_FUSED ? idx : NULL,
                                 .slots = kind == KVP_APPEND_DEST_SLOTS ? idx : NULL};
    const kvp_append_cuda_args_t a = {.flags = flags, .err_dev = err_dev, .shape = opts};
    return kvp_append_cuda(kv, src, &d, &a, stream);
}

int kvp_append_paged_kv_cache_cuda_opts(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                        const int32_t *batch_indices, const int32_t *positions,
                                        uint32_t nnz, int32_t *err_dev,
                                        const kvp_append_cuda_opts_t *opts, void *stream)
{
    return tokens(kv, src, batch_indices, positions, nnz, err_dev, KVP_APPEND_CUDA_CHECKED, opts,
                  stream);
}

int kvp_append_paged_kv_cache_cuda(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                   const int32_t *batch_indices, const int32_t *positions,
                                   uint32_t nnz, int32_t *err_dev, void *stream)
{
    return tokens(kv, src, batch_indices, positions, nnz, err_dev, KVP_APPEND_CUDA_CHECKED, NULL,
                  stream);
}

int kvp_append_paged_kv_cache_cuda_unchecked_opts(const kvp_paged_kv_t *kv,
                                                  const kvp_append_src_t *src,
                                                  const int32_t *batch_indices,
                                                  const int32_t *positions, uint32_t nnz,
                                                  int32_t *err_dev,
                                                  const kvp_append_cuda_opts_t *opts, void *stream)
{
    return tokens(kv, src, batch_indices, positions, nnz, err_dev, 0, opts, stream);
}

int kvp_append_paged_kv_cache_cuda_unchecked(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                             const int32_t *batch_indices, const int32_t *positions,
                                             uint32_t nnz, int32_t *err_dev, void *stream)
{
    return tokens(kv, src, batch_indices, positions, nnz, err_dev, 0, NULL, stream);
}

int kvp_append_paged_kv_cache_fused_cuda_opts(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                              const int32_t *append_indptr, uint32_t nnz,
                                              int32_t *err_dev, unsigned flags,
                                              const kvp_append_cuda_opts_t *opts, void *stream)
{
    return indexed(kv, src, KVP_APPEND_DEST_FUSED, append_indptr, nnz, err_dev, flags, opts,
                   stream);
}

int kvp_append_paged_kv_cache_fused_cuda_ex(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                            const int32_t *append_indptr, uint32_t nnz,
                                            int32_t *err_dev, unsigned flags, void *stream)
{
    return indexed(kv, src, KVP_APPEND_DEST_FUSED, append_indptr, nnz, err_dev, flags, NULL,
                   stream);
}

int kvp_append_paged_kv_cache_fused_cuda(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                         const int32_t *append_indptr, uint32_t nnz,
                                         int32_t *err_dev, void *stream)
{
    return indexed(kv, src, KVP_APPEND_DEST_FUSED, append_indptr, nnz, err_dev, 0, NULL, stream);
}

int kvp_append_paged_kv_cache_slots_cuda(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                         const int32_t *slots_dev, uint32_t nnz, int32_t *err_dev,
                                         unsigned flags, const kvp_append_cuda_opts_t *opts,
                                         void *stream)
{
    return indexed(kv, src, KVP_APPEND_DEST_SLOTS, slots_dev, nnz, err_dev, flags, opts, stream);
}
