/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pack_cuda.cu - the packed transfer form (kvp_kernels.h) on the device: one kernel moves
 * one layer of a sequence between its pages and the contiguous [K|V][token][head][D] stream,
 * either way. One thread per 16-byte vector, in stream order, so the stream side is read or
 * written fully coalesced and the pool side in whole rows; a grid-stride loop covers any size.
 * Three layers as in kvp_append_cuda.cu: the kernel, a static launcher with an explicit
 * stream, the exported C entry points that validate their arguments.
 */
#include <stdlib.h>

#include <cuda_runtime.h>

#include "kvp_cuda_err.h"
#include "kvp_kernels_cuda.h"

namespace
{

struct pack_args {
    uint8_t *k, *v;              /* the layer's K and V tensors */
    const int32_t *pages;        /* [ceil(tokens / page_size)] */
    uint8_t *stream;             /* the layer's packed part */
    uint64_t total_vecs;         /* 2 * tokens * heads * vecs_per_row */
    uint64_t vec_begin, vec_end; /* the part of the layer's stream this call moves; the stream
                                    pointer is that part's first byte */
    uint64_t sp, sn, sh;         /* page, slot and head strides in bytes */
    uint32_t tokens, heads, vecs_per_row, page_size, num_pages;
};

/* unpack = false: pool -> stream; true: stream -> pool. Each thread moves kIlp vectors per
 * step (all loads, then all stores) so a small grid keeps enough bytes in flight: the grid is
 * kept to a few blocks per SM on purpose, so that NCCL's kernels, which send the previous chunk
 * while this one is packed, still find room on every SM (a grid that fills the GPU would make
 * the pipelined transfer run pack and send one after the other). */
constexpr int kIlp = 4;

__device__ __forceinline__ uint4 *pool_vec(const pack_args &a, uint64_t i)
{
    uint64_t rest = i / a.vecs_per_row;
    const uint32_t c = (uint32_t)(i - rest * a.vecs_per_row);
    const uint32_t h = (uint32_t)(rest % a.heads);
    rest /= a.heads;
    const uint32_t t = (uint32_t)(rest % a.tokens);
    const uint32_t which = (uint32_t)(rest / a.tokens);
    const int32_t page = a.pages[t / a.page_size];
    if (page < 0 || (uint32_t)page >= a.num_pages)
        return nullptr; /* never out of bounds; the caller checked its pages */
    uint8_t *row = (which ? a.v : a.k) + (uint64_t)page * a.sp +
                   (uint64_t)(t % a.page_size) * a.sn + (uint64_t)h * a.sh;
    return reinterpret_cast<uint4 *>(row) + c;
}

template <bool unpack> __global__ void pack_kernel(pack_args a)
{
    const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
    uint4 *stream = reinterpret_cast<uint4 *>(a.stream);
    for (uint64_t base = a.vec_begin + (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
         base < a.vec_end; base += kIlp * step) {
        uint4 v[kIlp];
        uint4 *dst[kIlp];
#pragma unroll
        for (int k = 0; k < kIlp; k++) {
            const uint64_t i = base + k * step;
            dst[k] = nullptr;
            if (i >= a.vec_end)
                continue;
            uint4 *pv = pool_vec(a, i);
            if (!pv)
                continue;
            if (unpack) {
                v[k] = stream[i - a.vec_begin];
                dst[k] = pv;
            } else {
                v[k] = *pv;
                dst[k] = stream + (i - a.vec_begin);
            }
        }
#pragma unroll
        for (int k = 0; k < kIlp; k++)
            if (dst[k])
                *dst[k] = v[k];
    }
}

bool aligned16(const void *p)
{
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

int fill_args(const kvp_paged_kv_t *kv, const int32_t *pages_dev, uint32_t num_tokens,
              const void *stream_dev, pack_args *a)
{
    if (!kv || !kv->k_data || !kv->v_data || !pages_dev || !stream_dev)
        return KVP_EINVAL;
    const uint64_t e = kv->elem_bytes, row = (uint64_t)kv->head_dim * e;
    if ((e != 1 && e != 2 && e != 4) || !kv->page_size || !kv->num_heads || !kv->num_pages ||
        row == 0 || row % 16 || !aligned16(kv->k_data) || !aligned16(kv->v_data) ||
        !aligned16(stream_dev) || kv->stride_page < 0 || kv->stride_n < 0 || kv->stride_h < 0 ||
        (kv->stride_page * e) % 16 || (kv->stride_n * e) % 16 || (kv->stride_h * e) % 16)
        return KVP_EINVAL;
    a->k = static_cast<uint8_t *>(kv->k_data);
    a->v = static_cast<uint8_t *>(kv->v_data);
    a->pages = pages_dev;
    a->stream = static_cast<uint8_t *>(const_cast<void *>(stream_dev));
    a->vecs_per_row = (uint32_t)(row / 16);
    a->total_vecs = 2ull * num_tokens * kv->num_heads * a->vecs_per_row;
    a->vec_begin = 0;
    a->vec_end = a->total_vecs;
    a->sp = (uint64_t)kv->stride_page * e;
    a->sn = (uint64_t)kv->stride_n * e;
    a->sh = (uint64_t)kv->stride_h * e;
    a->tokens = num_tokens;
    a->heads = kv->num_heads;
    a->page_size = kv->page_size;
    a->num_pages = kv->num_pages;
    return 0;
}

template <bool unpack> int launch(const pack_args &a, uint32_t max_blocks, cudaStream_t s)
{
    if (a.vec_end <= a.vec_begin)
        return 0;
    static int sms = 0;
    if (!sms) {
        int dev = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
            sms <= 0)
            sms = 132;
    }
    /* the grid's cap: the caller's (kvp_pack_cuda_opts_t), else 2 per SM */
    const uint64_t cap = max_blocks ? (uint64_t)max_blocks : 2ull * (uint64_t)sms;
    const unsigned threads = 256;
    const uint64_t per_block = (uint64_t)threads * kIlp;
    uint64_t blocks = (a.vec_end - a.vec_begin + per_block - 1) / per_block;
    if (blocks > cap)
        blocks = cap; /* the grid-stride loop does the rest */
    int rc = 0;
    pack_kernel<unpack><<<(unsigned)blocks, threads, 0, s>>>(a);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

} // namespace

extern "C" int kvp__cuda_pack_preload(void)
{
    cudaFuncAttributes attr;
    int rc = 0;
    KVP_CUDA_TRY(cudaFuncGetAttributes(&attr, reinterpret_cast<const void *>(pack_kernel<false>)),
                 rc, fail);
    KVP_CUDA_TRY(cudaFuncGetAttributes(&attr, reinterpret_cast<const void *>(pack_kernel<true>)),
                 rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_kv_pack_cuda(const kvp_paged_kv_t *kv, const int32_t *pages_dev,
                                uint32_t num_tokens, void *out_dev, void *stream)
{
    pack_args a;
    int rc = fill_args(kv, pages_dev, num_tokens, out_dev, &a);
    return rc ? rc : launch<false>(a, 0, static_cast<cudaStream_t>(stream));
}

extern "C" int kvp_kv_unpack_cuda(const kvp_paged_kv_t *kv, const int32_t *pages_dev,
                                  uint32_t num_tokens, const void *in_dev, void *stream)
{
    pack_args a;
    int rc = fill_args(kv, pages_dev, num_tokens, in_dev, &a);
    return rc ? rc : launch<true>(a, 0, static_cast<cudaStream_t>(stream));
}

/* A byte range [begin, end) of the layer's packed part (multiples of 16): the pipelined
 * transfer moves a stream in chunks that need not start at a layer boundary. */
static int set_range(pack_args *a, uint64_t begin, uint64_t end)
{
    if (begin % 16 || end % 16 || begin > end || end / 16 > a->total_vecs)
        return KVP_EINVAL;
    a->vec_begin = begin / 16;
    a->vec_end = end / 16;
    return 0;
}

extern "C" int kvp_kv_pack_range_cuda_ex(const kvp_paged_kv_t *kv, const int32_t *pages_dev,
                                         uint32_t num_tokens, uint64_t begin, uint64_t end,
                                         void *out_dev, const kvp_pack_cuda_opts_t *opts,
                                         void *stream)
{
    if (opts && opts->max_blocks > KVP_PACK_CUDA_MAX_BLOCKS)
        return KVP_EINVAL;
    pack_args a;
    int rc = fill_args(kv, pages_dev, num_tokens, out_dev, &a);
    if (!rc)
        rc = set_range(&a, begin, end);
    return rc ? rc
              : launch<false>(a, opts ? opts->max_blocks : 0, static_cast<cudaStream_t>(stream));
}

extern "C" int kvp_kv_unpack_range_cuda_ex(const kvp_paged_kv_t *kv, const int32_t *pages_dev,
                                           uint32_t num_tokens, uint64_t begin, uint64_t end,
                                           const void *in_dev, const kvp_pack_cuda_opts_t *opts,
                                           void *stream)
{
    if (opts && opts->max_blocks > KVP_PACK_CUDA_MAX_BLOCKS)
        return KVP_EINVAL;
    pack_args a;
    int rc = fill_args(kv, pages_dev, num_tokens, in_dev, &a);
    if (!rc)
        rc = set_range(&a, begin, end);
    return rc ? rc
              : launch<true>(a, opts ? opts->max_blocks : 0, static_cast<cudaStream_t>(stream));
}

extern "C" int kvp_kv_pack_range_cuda(const kvp_paged_kv_t *kv, const int32_t *pages_dev,
                                      uint32_t num_tokens, uint64_t begin, uint64_t end,
                                      void *out_dev, void *stream)
{
    return kvp_kv_pack_range_cuda_ex(kv, pages_dev, num_tokens, begin, end, out_dev, nullptr,
                                     stream);
}

extern "C" int kvp_kv_unpack_range_cuda(const kvp_paged_kv_t *kv, const int32_t *pages_dev,
                                        uint32_t num_tokens, uint64_t begin, uint64_t end,
                                        const void *in_dev, void *stream)
{
    return kvp_kv_unpack_range_cuda_ex(kv, pages_dev, num_tokens, begin, end, in_dev, nullptr,
                                       stream);
}
