/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_gather_cuda.cu - the gather (kvp_gather_cuda, kvp_kernels_cuda.h) on the device: rows of
 * pool slots of one layer copied out to a destination tensor, the inverse of the append's
 * slots form and a Load's copy. The three layers of kvp_pack_cuda.cu: the __global__ kernel, a
 * static launcher on an explicit stream, the exported C entry point that validates what the
 * host can see. One thread per vector, in destination order (vector, then head, then token,
 * K before V), so the destination is written coalesced and each pool row read whole; the vector
 * is the widest of 16, 8, 4, 2, 1 bytes that the row, the strides and the base addresses allow.
 * Not here: checking the slots against the pool (the caller's, on the host: the kernel only
 * skips a slot beyond the pool, it never reports it).
 */
#include <stdint.h>

#include <cuda_runtime.h>

#include "kvp_cuda_err.h"
#include "kvp_kernels_cuda.h"

namespace
{

struct gather_args {
    const uint8_t *k, *v;        /* the layer's K and V tensors */
    uint8_t *dk, *dv;            /* the destination's K and V rows */
    const int32_t *slots;        /* [nnz] pool slots, device memory */
    uint64_t sp, sn, sh;         /* pool page, slot and head strides in bytes */
    uint64_t dkn, dkh, dvn, dvh; /* destination token and head strides in bytes */
    uint64_t total;              /* 2 * nnz * heads * vecs */
    int64_t cap;                 /* num_pages * page_size: slots at or beyond it are skipped */
    uint32_t nnz, heads, vecs, page_size;
};

/* T is the vector: uint4, uint2, uint32_t, uint16_t or uint8_t. */
template <typename T> __global__ void gather_kernel(gather_args a)
{
    const uint64_t step = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < a.total; i += step) {
        uint64_t rest = i / a.vecs;
        const uint32_t c = (uint32_t)(i - rest * a.vecs);
        const uint32_t h = (uint32_t)(rest % a.heads);
        rest /= a.heads;
        const bool is_v = rest >= a.nnz;
        const uint32_t t = (uint32_t)(is_v ? rest - a.nnz : rest);
        const int32_t slot = a.slots[t];
        if (slot < 0 || (int64_t)slot >= a.cap)
            continue; /* padding; or beyond the pool, which the caller has refused already */
        const uint32_t page = (uint32_t)slot / a.page_size, pos = (uint32_t)slot % a.page_size;
        const T *from = reinterpret_cast<const T *>((is_v ? a.v : a.k) + (uint64_t)page * a.sp +
                                                    (uint64_t)pos * a.sn + (uint64_t)h * a.sh);
        T *to = reinterpret_cast<T *>(is_v ? a.dv + (uint64_t)t * a.dvn + (uint64_t)h * a.dvh
                                           : a.dk + (uint64_t)t * a.dkn + (uint64_t)h * a.dkh);
        to[c] = from[c];
    }
}

/* The five instantiations, the only ones launched or preloaded. */
#define KVP_GATHER_KERNELS(X) X(uint4) X(uint2) X(uint32_t) X(uint16_t) X(uint8_t)

/* The byte step of an element stride, or false when it is negative or does not fit in int64. */
bool step_of(int64_t stride, uint32_t elem, uint64_t *out)
{
    if (stride < 0 || (uint64_t)stride > (uint64_t)INT64_MAX / elem)
        return false;
    *out = (uint64_t)stride * elem;
    return true;
}

int fill_args(const kvp_paged_kv_t *kv, const int32_t *slots_dev, uint32_t nnz,
              const kvp_gather_dst_t *dst, gather_args *a, uint32_t *vec_bytes)
{
    if (!kv || !dst || !kv->k_data || !kv->v_data || !dst->key || !dst->value ||
        (nnz && !slots_dev))
        return KVP_EINVAL;
    const uint32_t e = kv->elem_bytes;
    if ((e != 1 && e != 2 && e != 4) || !kv->page_size || !kv->num_heads || !kv->head_dim ||
        !kv->num_pages)
        return KVP_EINVAL;
    if (!step_of(kv->stride_page, e, &a->sp) || !step_of(kv->stride_n, e, &a->sn) ||
        !step_of(kv->stride_h, e, &a->sh) || !step_of(dst->k_stride_n, e, &a->dkn) ||
        !step_of(dst->k_stride_h, e, &a->dkh) || !step_of(dst->v_stride_n, e, &a->dvn) ||
        !step_of(dst->v_stride_h, e, &a->dvh))
        return KVP_EINVAL;
    const uint64_t row = (uint64_t)kv->head_dim * e;
    /* the widest vector everything is a multiple of */
    const uint64_t any = row | a->sp | a->sn | a->sh | a->dkn | a->dkh | a->dvn | a->dvh |
                         (uint64_t)(uintptr_t)kv->k_data | (uint64_t)(uintptr_t)kv->v_data |
                         (uint64_t)(uintptr_t)dst->key | (uint64_t)(uintptr_t)dst->value;
    uint32_t w = 16;
    while (w > 1 && (any & (w - 1)))
        w /= 2;
    *vec_bytes = w;
    a->k = static_cast<const uint8_t *>(kv->k_data);
    a->v = static_cast<const uint8_t *>(kv->v_data);
    a->dk = static_cast<uint8_t *>(dst->key);
    a->dv = static_cast<uint8_t *>(dst->value);
    a->slots = slots_dev;
    a->vecs = (uint32_t)(row / w);
    a->total = 2ull * nnz * kv->num_heads * a->vecs;
    a->cap = (int64_t)kv->num_pages * kv->page_size;
    a->nnz = nnz;
    a->heads = kv->num_heads;
    a->page_size = kv->page_size;
    return 0;
}

template <typename T> void launch_t(const gather_args &a, cudaStream_t s)
{
    const unsigned threads = 256;
    uint64_t blocks = (a.total + threads - 1) / threads;
    if (blocks > (1ull << 30))
        blocks = 1ull << 30; /* the grid-stride loop does the rest */
    gather_kernel<T><<<(unsigned)blocks, threads, 0, s>>>(a);
}

void launch(const gather_args &a, uint32_t vec_bytes, cudaStream_t s)
{
    switch (vec_bytes) {
    case 16:
        launch_t<uint4>(a, s);
        break;
    case 8:
        launch_t<uint2>(a, s);
        break;
    case 4:
        launch_t<uint32_t>(a, s);
        break;
    case 2:
        launch_t<uint16_t>(a, s);
        break;
    default:
        launch_t<uint8_t>(a, s);
        break;
    }
}

} // namespace

/* Loads the gather kernels (kvp_cuda_kernels_preload calls it, as kvp__cuda_pack_preload). */
extern "C" int kvp__cuda_gather_preload(void)
{
    cudaFuncAttributes attr;
    int rc = 0;
#define KVP_GATHER_PRELOAD(T)                                                                      \
    KVP_CUDA_TRY(cudaFuncGetAttributes(&attr, reinterpret_cast<const void *>(gather_kernel<T>)),   \
                 rc, fail);
    KVP_GATHER_KERNELS(KVP_GATHER_PRELOAD)
#undef KVP_GATHER_PRELOAD
    return 0;
fail:
    return rc;
}

extern "C" int kvp_gather_cuda(const kvp_paged_kv_t *kv, const int32_t *slots_dev, uint32_t nnz,
                               const kvp_gather_dst_t *dst, void *stream)
{
    gather_args a;
    uint32_t vec_bytes = 0;
    int rc = fill_args(kv, slots_dev, nnz, dst, &a, &vec_bytes);
    if (rc || nnz == 0)
        return rc;
    launch(a, vec_bytes, static_cast<cudaStream_t>(stream));
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}
