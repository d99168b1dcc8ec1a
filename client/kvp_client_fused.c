/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_client_fused.c - libkvpool's fused in-process append (kvp_client_cuda_append_fused,
 * kvpool.h): no handle and no daemon, the host-side checks and then the kernels library's one
 * append entry with the fused destination (append_indptr). The checks are the same in both
 * builds, so a build without CUDA refuses what a CUDA build refuses, then answers KVP_EUNAVAIL.
 */
#include "kvpool.h"

#include <stdint.h>

#include "kvp_cuda_err.h"
#include "kvp_kernels_cuda.h"

/* kvp_client_cuda_append_fused's host-side checks, the same in both builds (so that a build
 * without CUDA refuses what a CUDA build refuses): 0, or KVP_EINVAL recorded with its reason.
 * They repeat the kernels library's (it would refuse the same, but with no reason) and add
 * what it leaves to the caller: src and the page-table pointers, the int32 ranges. */
static int fused_refuse(const char *why)
{
    return KVP_CUDA_FAIL(KVP_EINVAL, "kvp_client_cuda_append_fused", "%s", why);
}

static int misaligned16(const void *p)
{
    return ((uintptr_t)p & 15u) != 0;
}

static int misaligned_stride(int64_t stride, uint32_t elem_bytes)
{
    return stride < 0 || stride > INT64_MAX / 4 || (stride * (int64_t)elem_bytes) % 16 != 0;
}

static int fused_check(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                       const int32_t *append_indptr, uint32_t nnz, unsigned flags)
{
    if (flags & ~(unsigned)KVP_CLIENT_CUDA_APPEND_PDL)
        return fused_refuse("unknown flag");
    if (!kv || !src)
        return fused_refuse("NULL kv or src");
    if (nnz == 0)
        return 0;
    if (nnz > INT32_MAX || kv->batch_size > INT32_MAX)
        return fused_refuse("nnz or batch_size above INT32_MAX (int32 page table)");
    if (!append_indptr || !kv->kv_indptr || !kv->kv_indices || !kv->kv_last_page_len)
        return fused_refuse("NULL append_indptr or page-table array");
    if (kv->batch_size == 0)
        return fused_refuse("tokens to append but batch_size 0");
    if (!kv->k_data || !kv->v_data || !src->key || !src->value)
        return fused_refuse("NULL cache or source pointer");
    const uint32_t e = kv->elem_bytes;
    if (e != 1 && e != 2 && e != 4)
        return fused_refuse("elem_bytes must be 1, 2 or 4");
    if (!kv->num_pages || !kv->page_size || !kv->num_heads || !kv->head_dim)
        return fused_refuse("num_pages, page_size, num_heads and head_dim must be non-zero");
    if (((uint64_t)kv->head_dim * e) % 16)
        return fused_refuse("rows (head_dim * elem_bytes) must be multiples of 16 bytes");
    if (misaligned16(kv->k_data) || misaligned16(kv->v_data) || misaligned16(src->key) ||
        misaligned16(src->value))
        return fused_refuse("cache and source pointers must be 16-byte aligned");
    if (misaligned_stride(kv->stride_page, e) || misaligned_stride(kv->stride_n, e) ||
        misaligned_stride(kv->stride_h, e) || misaligned_stride(src->k_stride_n, e) ||
        misaligned_stride(src->k_stride_h, e) || misaligned_stride(src->v_stride_n, e) ||
        misaligned_stride(src->v_stride_h, e))
        return fused_refuse("strides must be non-negative and 16-byte multiples");
    return 0;
}

#ifdef KVP_HAVE_CUDA

_Static_assert((unsigned)KVP_CLIENT_CUDA_APPEND_PDL == (unsigned)KVP_CUDA_APPEND_PDL,
               "kvpool.h's append flags are the kernels library's");

int kvp_client_cuda_append_fused(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                 const int32_t *append_indptr, uint32_t nnz, int32_t *err_dev,
                                 unsigned flags, void *stream)
{
    int rc = fused_check(kv, src, append_indptr, nnz, flags);
    if (rc || nnz == 0)
        return rc;
    const kvp_append_dest_t dest = {
        .kind = KVP_APPEND_DEST_FUSED, .nnz = nnz, .append_indptr = append_indptr};
    const kvp_append_cuda_args_t args = {.flags = flags, .err_dev = err_dev};
    KVP_KERNEL_TRY(kvp_append_cuda(kv, src, &dest, &args, stream), rc, fail);
    return 0;
fail:
    return rc;
}

#else /* !KVP_HAVE_CUDA */

int kvp_client_cuda_append_fused(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                 const int32_t *append_indptr, uint32_t nnz, int32_t *err_dev,
                                 unsigned flags, void *stream)
{
    (void)err_dev, (void)stream;
    int rc = fused_check(kv, src, append_indptr, nnz, flags);
    if (rc)
        return rc;
    return KVP_CUDA_FAIL(KVP_EUNAVAIL, "kvp_client_cuda_append_fused",
                         "libkvpool was built without CUDA");
}

#endif
