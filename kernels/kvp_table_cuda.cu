/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_table_cuda.cu - the CUDA page-table helpers of kvp_kernels_cuda.h and whole-page copies:
 * the slots of a step planned on the device (kvp_append_plan_slots_cuda, the fused lookup of
 * kvp_append_cuda_dev.cuh), FlashInfer's get_seq_lens and get_batch_indices_positions, and the
 * copy-on-write page copies. Not the append (kvp_append_cuda.cu). Its kernels are loaded eagerly
 * through kvp__cuda_table_preload, called by kvp_cuda_kernels_preload.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kvp_append_cuda_dev.cuh"
#include "kvp_cuda_err.h"
#include "kvp_kernels_cuda.h"

namespace
{

/* The slots of a step (kvp_append_plan_slots_cuda): token i's pool slot (page id *
 * page_size + offset) by the fused lookup, or -1 (reported in *err) when it has none. */
__global__ void plan_slots_kernel(Geo g, const int32_t *__restrict__ aip, uint32_t nnz,
                                  int32_t *__restrict__ slots, int32_t *err)
{
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < nnz; i += gridDim.x * blockDim.x) {
        int32_t page, pos;
        slots[i] =
            fused_page_pos(g, i, nnz, aip, err, &page, &pos)
                ? page * (int32_t)g.page_size + (pos - page_of(g, pos) * (int32_t)g.page_size)
                : -1;
    }
}

__global__ void seq_lens_kernel(const int32_t *indptr, const int32_t *last, uint32_t batch_size,
                                uint32_t page_size, int32_t *out)
{
    for (uint32_t b = blockIdx.x * blockDim.x + threadIdx.x; b < batch_size;
         b += gridDim.x * blockDim.x)
        out[b] = seq_len_of(indptr, last, page_size, (int32_t)b);
}

__global__ void batch_positions_kernel(const int32_t *append_indptr, const int32_t *seq_lens,
                                       uint32_t batch_size, int32_t *batch_indices,
                                       int32_t *positions)
{
    /* one block per request, threads over its tokens */
    for (uint32_t b = blockIdx.x; b < batch_size; b += gridDim.x) {
        int32_t start = append_indptr[b], len = append_indptr[b + 1] - start;
        int32_t base = seq_lens[b] - len;
        for (int32_t j = threadIdx.x; j < len; j += blockDim.x) {
            batch_indices[start + j] = (int32_t)b;
            positions[start + j] = base + j;
        }
    }
}

/* One block per (copy, K|V): the whole page, addressed through the strides. */
__global__ void page_copy_kernel(Geo g, const kvp_page_copy_t *__restrict__ copies,
                                 uint32_t num_copies, int32_t *err)
{
    for (uint32_t c = blockIdx.x >> 1; c < num_copies; c += gridDim.x >> 1) {
        uint32_t kv = blockIdx.x & 1;
        uint32_t src = copies[c].src, dst = copies[c].dst;
        if (src >= g.num_pages || dst >= g.num_pages || src == dst) {
            if (threadIdx.x == 0 && kv == 0)
                set_err(err, KVP_ERANGE);
            continue;
        }
        uint8_t *base = kv ? g.v : g.k;
        uint32_t per_slot = g.num_heads * g.vecs;
        uint32_t items = g.page_size * per_slot;
        for (uint32_t it = threadIdx.x; it < items; it += blockDim.x) {
            uint32_t slot = it / per_slot, r = it - slot * per_slot;
            uint32_t h = r / g.vecs, vec = r - h * g.vecs;
            int64_t off = (int64_t)slot * g.slot_stride + (int64_t)h * g.head_stride + vec * 16;
            uint4 val = *reinterpret_cast<const uint4 *>(base + (int64_t)src * g.page_stride + off);
            *reinterpret_cast<uint4 *>(base + (int64_t)dst * g.page_stride + off) = val;
        }
    }
}

} // namespace

/* Loads this file's kernels (kvp_cuda_kernels_preload). Returns 0 or the failing call's code. */
extern "C" int kvp__cuda_table_preload(void)
{
    const void *const fns[] = {
        reinterpret_cast<const void *>(&plan_slots_kernel),
        reinterpret_cast<const void *>(&seq_lens_kernel),
        reinterpret_cast<const void *>(&batch_positions_kernel),
        reinterpret_cast<const void *>(&page_copy_kernel),
    };
    cudaFuncAttributes a;
    int rc = 0;
    for (const void *f : fns)
        KVP_CUDA_TRY(cudaFuncGetAttributes(&a, f), rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_append_plan_slots_cuda(const kvp_paged_kv_t *kv, const int32_t *append_indptr,
                                          uint32_t nnz, int32_t *slots_dev, int32_t *err_dev,
                                          void *stream)
{
    if (nnz == 0)
        return 0;
    Geo g;
    int rc = make_geo(kv, nullptr, &g);
    if (rc)
        return rc;
    if (!append_indptr || !slots_dev || !g.batch_size || !kv->kv_indptr || !kv->kv_indices ||
        !kv->kv_last_page_len || (uint64_t)kv->num_pages * kv->page_size > (uint64_t)INT32_MAX)
        return KVP_EINVAL;
    uint32_t blocks = (nnz + kThreads - 1) / kThreads;
    if (blocks > 4096)
        blocks = 4096;
    plan_slots_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        g, append_indptr, nnz, slots_dev, err_dev);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_get_seq_lens_cuda(const int32_t *kv_indptr, const int32_t *kv_last_page_len,
                                     uint32_t batch_size, uint32_t page_size, int32_t *seq_lens,
                                     void *stream)
{
    if (!kv_indptr || !kv_last_page_len || !seq_lens || !page_size)
        return KVP_EINVAL;
    if (!batch_size)
        return 0;
    int rc = 0;
    uint32_t blocks = (batch_size + kThreads - 1) / kThreads;
    seq_lens_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        kv_indptr, kv_last_page_len, batch_size, page_size, seq_lens);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_get_batch_indices_positions_cuda(const int32_t *append_indptr,
                                                    const int32_t *seq_lens, uint32_t batch_size,
                                                    uint32_t nnz, int32_t *batch_indices,
                                                    int32_t *positions, void *stream)
{
    if (!append_indptr || !seq_lens)
        return KVP_EINVAL;
    if (!batch_size || !nnz)
        return 0;
    if (!batch_indices || !positions)
        return KVP_EINVAL;
    int rc = 0;
    uint32_t blocks = batch_size < 65535u ? batch_size : 65535u;
    batch_positions_kernel<<<blocks, 128, 0, static_cast<cudaStream_t>(stream)>>>(
        append_indptr, seq_lens, batch_size, batch_indices, positions);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_page_copy_cuda(const kvp_paged_kv_t *kv, const kvp_page_copy_t *copies,
                                  uint32_t num_copies, int32_t *err_dev, void *stream)
{
    if (num_copies == 0)
        return 0;
    Geo g;
    int rc = make_geo(kv, nullptr, &g);
    if (rc)
        return rc;
    if (!copies)
        return KVP_EINVAL;
    uint32_t blocks = 2 * (num_copies < 32768u ? num_copies : 32768u);
    page_copy_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        g, copies, num_copies, err_dev);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}
