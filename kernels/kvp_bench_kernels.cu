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

namespace {

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
    const uint8_t *row = static_cast<const uint8_t *>(kv.k_data) +
                         ((int64_t)page * kv.stride_page +
                          (int64_t)(pos % (int32_t)kv.page_size) * kv.stride_n +
                          (int64_t)h * kv.stride_h) *
                             kv.elem_bytes;
    atomicAdd(sum, (unsigned long long)*reinterpret_cast<const uint64_t *>(row));
}

} // namespace

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
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(1);
    cfg.blockDim = dim3(1);
    cfg.stream = static_cast<cudaStream_t>(stream);
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    int rc = 0;
    KVP_CUDA_TRY(cudaLaunchKernelEx(&cfg, empty_pdl_kernel), rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_bench_spin_fill_cuda(void *dst, uint64_t bytes, uint8_t value, uint64_t ns,
                                        void *stream)
{
    int rc = 0;
    spin_fill_kernel<<<64, 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<uint8_t *>(dst), bytes, value, ns);
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
    };
    for (const void *f : fns)
        KVP_CUDA_TRY(cudaFuncGetAttributes(&a, f), rc, fail);
    return 0;
fail:
    return rc;
}
