/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_bench_kernels.cu - kernels the benchmarks use to simulate a model step around the
 * append (not part of the kernel library's API): a compute stand-in that keeps every SM busy
 * for a fixed time, and a reader that touches the rows just appended (so a missing ordering
 * shows up as time, and in the checksum). Built into kvp_bench_kernels, linked only by
 * benchmarks.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "kvp_bench_kernels.h"
#include "kvp_cuda_err.h"

namespace
{

__device__ __forceinline__ uint64_t global_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void spin_kernel(uint64_t ns)
{
    uint64_t start = global_ns();
    while (global_ns() - start < ns)
        ;
}

/* One thread that does nothing but the programmatic-dependent-launch handshake: the floor of
 * a launch in a PDL chain. */
__global__ void empty_pdl_kernel(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* The bound of any append moving the same bytes: a plain contiguous copy of n 16-byte
 * vectors, V per thread (all loads, then all stores), grid-stride beyond that; under PDL it
 * waits for its predecessor before its first load (an append's sources come from the kernel
 * before it). */
template <int V>
__global__ void __launch_bounds__(256)
    plain_copy_kernel(const uint4 *__restrict__ src, uint4 *__restrict__ dst, uint64_t n, int pdl)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (pdl) {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        asm volatile("griddepcontrol.wait;" ::: "memory");
    }
#endif
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t base = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; base < n;
         base += stride * V) {
        uint4 r[V];
#pragma unroll
        for (int k = 0; k < V; k++)
            if (base + k * stride < n)
                r[k] = src[base + k * stride];
#pragma unroll
        for (int k = 0; k < V; k++)
            if (base + k * stride < n)
                dst[base + k * stride] = r[k];
    }
}

/* The bound of an append without any lookup: token i's K and V rows (16-byte vector per
 * thread) go to the slot of the bench's own page table, computed from i (request
 * b = i >> t_shift, position old_len + (i & (T - 1)), page (pos >> ps_shift) * B + b), so the
 * scattered destination is paid and no page-table load is. Under PDL it waits for its
 * predecessor before its load. */
__global__ void __launch_bounds__(256)
    scatter_copy_kernel(kvp_paged_kv_t kv, const uint8_t *__restrict__ sk,
                        const uint8_t *__restrict__ sv, uint64_t n, uint32_t vec_shift,
                        uint32_t kv_shift, uint32_t t_shift, uint32_t ps_shift, uint32_t old_len,
                        int pdl)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (pdl) {
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        asm volatile("griddepcontrol.wait;" ::: "memory");
    }
#endif
    uint64_t g = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= n)
        return;
    uint64_t i = g >> (kv_shift + 1);
    uint32_t r = (uint32_t)(g & ((2u << kv_shift) - 1)), v = r >> kv_shift;
    r &= (1u << kv_shift) - 1;
    uint32_t h = r >> vec_shift, vec = r & ((1u << vec_shift) - 1);
    uint32_t b = (uint32_t)(i >> t_shift);
    uint32_t pos = old_len + (uint32_t)(i & ((1u << t_shift) - 1));
    int64_t page = (int64_t)(pos >> ps_shift) * kv.batch_size + b;
    int64_t el = page * kv.stride_page + (int64_t)(pos & ((1u << ps_shift) - 1)) * kv.stride_n +
                 (int64_t)h * kv.stride_h;
    uint8_t *dst =
        static_cast<uint8_t *>(v ? kv.v_data : kv.k_data) + el * kv.elem_bytes + vec * 16;
    const uint8_t *src = (v ? sv : sk) + ((i << kv_shift) + r) * 16;
    *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
}

/* Spins ns, then fills bytes (a multiple of 16) with the byte value: a slow producer. */
__global__ void spin_fill_kernel(uint8_t *dst, uint64_t bytes, uint8_t value, uint64_t ns)
{
    uint64_t start = global_ns();
    while (global_ns() - start < ns)
        ;
    uint32_t w = value * 0x01010101u;
    uint4 v = make_uint4(w, w, w, w);
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < bytes / 16;
         i += (uint64_t)gridDim.x * blockDim.x)
        reinterpret_cast<uint4 *>(dst)[i] = v;
}

/* For each request b, reads the K row of its last token (every head) and adds the first 8
 * bytes of each into *sum. */
__global__ void read_last_kernel(kvp_paged_kv_t kv, unsigned long long *sum)
{
    uint32_t b = blockIdx.x * blockDim.y + threadIdx.y;
    if (b >= kv.batch_size)
        return;
    int32_t np = kv.kv_indptr[b + 1] - kv.kv_indptr[b];
    if (np <= 0)
        return;
    int32_t pos = (np - 1) * (int32_t)kv.page_size + kv.kv_last_page_len[b] - 1;
    int32_t page = kv.kv_indices[kv.kv_indptr[b] + pos / (int32_t)kv.page_size];
    uint32_t h = threadIdx.x;
    if (h >= kv.num_heads)
        return;
    const uint8_t *row =
        static_cast<const uint8_t *>(kv.k_data) +
        ((int64_t)page * kv.stride_page + (int64_t)(pos % (int32_t)kv.page_size) * kv.stride_n +
         (int64_t)h * kv.stride_h) *
            kv.elem_bytes;
    atomicAdd(sum, (unsigned long long)*reinterpret_cast<const uint64_t *>(row));
}

} // namespace

/* A launch of grid x block on stream, under programmatic dependent launch when pdl (at: the
 * attribute's storage, alive until the launch). */
static cudaLaunchConfig_t launch_cfg(unsigned grid, unsigned block, void *stream, int pdl,
                                     cudaLaunchAttribute *at)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid ? grid : 1);
    cfg.blockDim = dim3(block);
    cfg.stream = static_cast<cudaStream_t>(stream);
    at->id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at->val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    return cfg;
}

extern "C" int kvp_bench_spin_cuda(uint64_t ns, unsigned blocks, void *stream)
{
    int rc = 0;
    spin_kernel<<<blocks, 128, 0, static_cast<cudaStream_t>(stream)>>>(ns);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_bench_empty_pdl_cuda(void *stream)
{
    cudaLaunchAttribute at;
    cudaLaunchConfig_t cfg = launch_cfg(1, 1, stream, 1, &at);
    int rc = 0;
    KVP_CUDA_TRY(cudaLaunchKernelEx(&cfg, empty_pdl_kernel), rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_bench_plain_copy_cuda(void *dst, const void *src, uint64_t bytes, int pdl,
                                         void *stream)
{
    if (bytes % 16)
        return KVP_EINVAL;
    /* the append's own rule (row_block): the fewest vectors a thread with at most 64 Ki threads,
     * 128 Ki under PDL; 8 a thread and a grid-stride loop beyond */
    const uint64_t n = bytes / 16, cap = pdl ? 131072 : 65536;
    int v = 1;
    while (v < 8 && (n + v - 1) / v > cap)
        v *= 2;
    uint64_t threads = (n + v - 1) / v;
    if (threads > cap)
        threads = cap;
    cudaLaunchAttribute at;
    cudaLaunchConfig_t cfg = launch_cfg((unsigned)((threads + 255) / 256), 256, stream, pdl, &at);
    const uint4 *s = static_cast<const uint4 *>(src);
    uint4 *d = static_cast<uint4 *>(dst);
    int rc = 0;
    switch (v) {
    case 1:
        KVP_CUDA_TRY(cudaLaunchKernelEx(&cfg, plain_copy_kernel<1>, s, d, n, pdl), rc, fail);
        break;
    case 2:
        KVP_CUDA_TRY(cudaLaunchKernelEx(&cfg, plain_copy_kernel<2>, s, d, n, pdl), rc, fail);
        break;
    case 4:
        KVP_CUDA_TRY(cudaLaunchKernelEx(&cfg, plain_copy_kernel<4>, s, d, n, pdl), rc, fail);
        break;
    default:
        KVP_CUDA_TRY(cudaLaunchKernelEx(&cfg, plain_copy_kernel<8>, s, d, n, pdl), rc, fail);
        break;
    }
    return 0;
fail:
    return rc;
}

static int log2_exact(uint64_t x, uint32_t *out)
{
    uint32_t k = 0;
    while (k < 63 && (1ull << k) < x)
        k++;
    if (x == 0 || (1ull << k) != x)
        return KVP_EINVAL;
    *out = k;
    return 0;
}

extern "C" int kvp_bench_scatter_copy_cuda(const kvp_paged_kv_t *kv, const void *sk, const void *sv,
                                           uint32_t nnz, uint32_t tokens, uint32_t old_len, int pdl,
                                           void *stream)
{
    uint32_t vec_shift, kv_shift, t_shift, ps_shift;
    const uint64_t vecs = (uint64_t)kv->head_dim * kv->elem_bytes / 16;
    if (log2_exact(vecs, &vec_shift) || log2_exact(vecs * kv->num_heads, &kv_shift) ||
        log2_exact(tokens, &t_shift) || log2_exact(kv->page_size, &ps_shift) ||
        kv->head_dim * kv->elem_bytes % 16)
        return KVP_EINVAL;
    const uint64_t n = (uint64_t)nnz << (kv_shift + 1);
    cudaLaunchAttribute at;
    cudaLaunchConfig_t cfg = launch_cfg((unsigned)((n + 255) / 256), 256, stream, pdl, &at);
    int rc = 0;
    KVP_CUDA_TRY(cudaLaunchKernelEx(&cfg, scatter_copy_kernel, *kv,
                                    static_cast<const uint8_t *>(sk),
                                    static_cast<const uint8_t *>(sv), n, vec_shift, kv_shift,
                                    t_shift, ps_shift, old_len, pdl),
                 rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_bench_spin_fill_cuda(void *dst, uint64_t bytes, uint8_t value, uint64_t ns,
                                        void *stream)
{
    int rc = 0;
    spin_fill_kernel<<<64, 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<uint8_t *>(dst),
                                                                        bytes, value, ns);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_bench_read_last_cuda(const kvp_paged_kv_t *kv, unsigned long long *sum_dev,
                                        void *stream)
{
    if (kv->num_heads > 32)
        return KVP_EINVAL;
    int rc = 0;
    dim3 block(32, 8);
    unsigned grid = (kv->batch_size + 7) / 8;
    read_last_kernel<<<grid ? grid : 1, block, 0, static_cast<cudaStream_t>(stream)>>>(*kv,
                                                                                       sum_dev);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_bench_kernels_preload(void)
{
    cudaFuncAttributes a;
    int rc = 0;
    const void *fns[] = {
        reinterpret_cast<const void *>(spin_kernel),
        reinterpret_cast<const void *>(read_last_kernel),
        reinterpret_cast<const void *>(spin_fill_kernel),
        reinterpret_cast<const void *>(empty_pdl_kernel),
        reinterpret_cast<const void *>(plain_copy_kernel<1>),
        reinterpret_cast<const void *>(plain_copy_kernel<2>),
        reinterpret_cast<const void *>(plain_copy_kernel<4>),
        reinterpret_cast<const void *>(plain_copy_kernel<8>),
        reinterpret_cast<const void *>(scatter_copy_kernel),
    };
    for (const void *f : fns)
        KVP_CUDA_TRY(cudaFuncGetAttributes(&a, f), rc, fail);
    return 0;
fail:
    return rc;
}
