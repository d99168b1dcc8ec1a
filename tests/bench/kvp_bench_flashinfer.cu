/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_bench_flashinfer.cu - FlashInfer's AppendPagedKVCache as the baseline of
 * bench_append_cuda (kvp_bench_flashinfer.h), compiled from flashinfer-python's headers when
 * the build fetched them (KVP_HAVE_FLASHINFER: tests/bench/kvp_flashinfer.cmake puts the wheel's
 * flashinfer/data/include and its vendored CCCL on the include path), plus the pattern fill
 * and the diff the bench checks both appends' bytes with. FlashInfer's kernel is called
 * exactly as its own Python binding calls it (append_paged_kv_cache: AppendPagedKVCache with
 * the caller's batch_indices/positions); only the paged_kv_t is built here, over kvpool's pool.
 * Not part of the kernel library; benchmarks only.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#if defined(KVP_HAVE_FLASHINFER)
#include <flashinfer/page.cuh>
#endif

#include "kvp_bench_flashinfer.h"
#include "kvp_cuda_err.h"

namespace
{

__device__ __forceinline__ uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

__device__ __forceinline__ uint4 pattern_word(uint64_t seed, uint64_t i)
{
    uint64_t a = mix64(seed * 0x100000001b3ull ^ (2 * i)), b = mix64(seed ^ (2 * i + 1));
    return make_uint4((uint32_t)a, (uint32_t)(a >> 32), (uint32_t)b, (uint32_t)(b >> 32));
}

__global__ void fill_kernel(uint4 *dst, uint64_t words, uint64_t seed)
{
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < words;
         i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = pattern_word(seed, i);
}

__global__ void diff_kernel(const uint4 *a, const uint4 *b, uint64_t words, uint64_t seed,
                            unsigned long long *count)
{
    unsigned long long n = 0;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < words;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint4 x = a[i], y = b ? b[i] : pattern_word(seed, i);
        n += (x.x != y.x) | (x.y != y.y) | (x.z != y.z) | (x.w != y.w);
    }
    for (int o = 16; o > 0; o /= 2)
        n += __shfl_down_sync(0xffffffffu, n, o);
    if ((threadIdx.x & 31) == 0 && n)
        atomicAdd(count, n);
}

/* A grid that covers the device a few times over (grid-stride loops do the rest). */
unsigned grid_for(uint64_t words)
{
    uint64_t g = (words + 255) / 256;
    return (unsigned)(g < 4096 ? (g ? g : 1) : 4096);
}

} // namespace

extern "C" int kvp_bench_fill_cuda(void *dst, uint64_t bytes, uint64_t seed, void *stream)
{
    if (!dst || bytes % 16)
        return KVP_EINVAL;
    int rc = 0;
    fill_kernel<<<grid_for(bytes / 16), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<uint4 *>(dst), bytes / 16, seed);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_bench_diff_cuda(const void *a, const void *b, uint64_t bytes, uint64_t seed,
                                   unsigned long long *count_dev, void *stream)
{
    if (!a || !count_dev || bytes % 16)
        return KVP_EINVAL;
    int rc = 0;
    diff_kernel<<<grid_for(bytes / 16), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const uint4 *>(a), static_cast<const uint4 *>(b), bytes / 16, seed, count_dev);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

#if defined(KVP_HAVE_FLASHINFER)

#ifndef KVP_FLASHINFER_VERSION
#define KVP_FLASHINFER_VERSION "?"
#endif

extern "C" int kvp_bench_flashinfer_available(void)
{
    return 1;
}

extern "C" const char *kvp_bench_flashinfer_what(void)
{
    return "flashinfer-python " KVP_FLASHINFER_VERSION " headers (AppendPagedKVCache, page.cuh)";
}

extern "C" int kvp_bench_flashinfer_append_cuda(const kvp_paged_kv_t *kv,
                                                const kvp_append_src_t *src,
                                                const int32_t *batch_indices,
                                                const int32_t *positions, uint32_t nnz,
                                                void *stream)
{
    if (!kv || !src)
        return KVP_EINVAL;
    if (nnz == 0)
        return 0;
    const uint32_t D = kv->head_dim, H = kv->num_heads;
    const int64_t strides[] = {kv->stride_page, kv->stride_n, kv->stride_h};
    if (kv->elem_bytes != 2 || (D != 64 && D != 128 && D != 256 && D != 512) || H == 0 ||
        (D / 8 > 32 ? 32 : D / 8) * H > 1024 || !kv->k_data || !kv->v_data || !kv->kv_indptr ||
        !kv->kv_indices || !kv->kv_last_page_len || !src->key || !src->value || !batch_indices ||
        !positions)
        return KVP_EINVAL;
    for (int64_t s : strides)
        if (s < 0 || s > (int64_t)UINT32_MAX || s % 8)
            return KVP_EINVAL;
    if (src->k_stride_n < 0 || src->k_stride_h < 0 || src->v_stride_n < 0 || src->v_stride_h < 0 ||
        (src->k_stride_n | src->k_stride_h | src->v_stride_n | src->v_stride_h) % 8 ||
        (((uintptr_t)kv->k_data | (uintptr_t)kv->v_data | (uintptr_t)src->key |
          (uintptr_t)src->value) %
         16))
        return KVP_EINVAL;
    /* kNHD with strides {page, n, h} reads them as they are: stride_n = [1], stride_h = [2],
     * so an HND pool (whose stride_n is D and stride_h page_size * D) is described too. */
    flashinfer::paged_kv_t<half, int32_t> fkv(
        H, kv->page_size, D, kv->batch_size, flashinfer::QKVLayout::kNHD,
        static_cast<half *>(kv->k_data), static_cast<half *>(kv->v_data), strides,
        const_cast<int32_t *>(kv->kv_indices), const_cast<int32_t *>(kv->kv_indptr),
        const_cast<int32_t *>(kv->kv_last_page_len));
    int rc = 0;
    KVP_CUDA_TRY((flashinfer::AppendPagedKVCache<half, int32_t>(
                     fkv, static_cast<half *>(const_cast<void *>(src->key)),
                     static_cast<half *>(const_cast<void *>(src->value)),
                     const_cast<int32_t *>(batch_indices), const_cast<int32_t *>(positions), nnz,
                     (size_t)src->k_stride_n, (size_t)src->k_stride_h, (size_t)src->v_stride_n,
                     (size_t)src->v_stride_h, static_cast<cudaStream_t>(stream))),
                 rc, fail);
    return 0;
fail:
    return rc;
}

#else /* !KVP_HAVE_FLASHINFER */

extern "C" int kvp_bench_flashinfer_available(void)
{
    return 0;
}

extern "C" const char *kvp_bench_flashinfer_what(void)
{
    return "absent: built without FlashInfer's headers (configure with -DKVP_BENCH_FLASHINFER=ON "
           "or -DKVP_FLASHINFER_WHEEL=PATH)";
}

extern "C" int kvp_bench_flashinfer_append_cuda(const kvp_paged_kv_t *kv,
                                                const kvp_append_src_t *src,
                                                const int32_t *batch_indices,
                                                const int32_t *positions, uint32_t nnz,
                                                void *stream)
{
    (void)kv, (void)src, (void)batch_indices, (void)positions, (void)nnz, (void)stream;
    return KVP_EUNAVAIL;
}

#endif /* KVP_HAVE_FLASHINFER */

extern "C" int kvp_bench_flashinfer_preload(void)
{
    cudaFuncAttributes a;
    int rc = 0;
    const void *fns[] = {
        reinterpret_cast<const void *>(fill_kernel),
        reinterpret_cast<const void *>(diff_kernel),
#if defined(KVP_HAVE_FLASHINFER)
        /* the instances AppendPagedKVCache dispatches to for fp16 (vec_size 8, 16 at D 512) */
        reinterpret_cast<const void *>(flashinfer::AppendPagedKVCacheKernel<64, 8, half, int32_t>),
        reinterpret_cast<const void *>(flashinfer::AppendPagedKVCacheKernel<128, 8, half, int32_t>),
        reinterpret_cast<const void *>(flashinfer::AppendPagedKVCacheKernel<256, 8, half, int32_t>),
        reinterpret_cast<const void *>(
            flashinfer::AppendPagedKVCacheKernel<512, 16, half, int32_t>),
#endif
    };
    for (const void *f : fns)
        KVP_CUDA_TRY(cudaFuncGetAttributes(&a, f), rc, fail);
    return 0;
fail:
    return rc;
}
