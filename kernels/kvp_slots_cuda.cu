/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_slots_cuda.cu - whole pages in the packed form (kvp_kernels.h), every layer in one launch,
 * page after page (kvp_kv_pack_pages_cuda, kvp_kernels_cuda.h): the host tier's slot mover
 * (backend/kvp_backend_cuda_slots.c) packs a batch of scattered pages into device staging in
 * slot order with it, so each slot then leaves in one copy-engine copy, and unpacks the reverse.
 * kvp_pack_cuda.cu's kernels move one layer of one sequence per launch: a batch of 1,024 pages
 * of 32 layers would be 32,768 of them. Here a block takes one (page, layer, K|V) segment at a
 * time (all of it contiguous in the buffer), its threads the segment's 16-byte vectors; the
 * page ids travel inside the launch (a __grid_constant__ parameter), so nothing is uploaded
 * first. Loads and stores carry the evict-first hint: the bytes pass through once, and L2 stays
 * the decode step's. Three layers as in kvp_append_cuda.cu: the kernel, a static launcher with
 * an explicit stream, the exported C entry points that validate their arguments.
 */
#include <cuda_runtime.h>

#include "kvp_cuda_err.h"
#include "kvp_kernels_cuda.h"

namespace
{

constexpr unsigned kThreads = 256;
constexpr int kIlp = 8; /* vectors a thread has in flight: 32 KiB a block */

struct pages_args {
    uint8_t *k, *v;        /* layer 0's K and V tensors */
    uint8_t *buf;          /* page i's packed form at buf + i * buf_stride */
    uint64_t layer_stride; /* bytes from a layer's tensors to the next layer's */
    uint64_t buf_stride;
    uint64_t sp, sn, sh; /* page, slot and head strides in bytes */
    uint32_t n, layers, heads, vecs_per_row;
    uint32_t seg_vecs; /* vectors of one page's K (or V) of one layer: page_size * hv */
    uint32_t pages[KVP_PACK_PAGES_MAX];
};

/* unpack = false: pool -> buf; true: buf -> pool. */
template <bool unpack>
__global__ void __launch_bounds__(kThreads) pages_kernel(const __grid_constant__ pages_args a)
{
    const uint32_t segs_per_page = 2 * a.layers;
    const uint64_t num_segs = (uint64_t)a.n * segs_per_page;
    const uint32_t hv = a.heads * a.vecs_per_row;
    for (uint64_t s = blockIdx.x; s < num_segs; s += gridDim.x) {
        const uint32_t i = (uint32_t)(s / segs_per_page);
        const uint32_t r = (uint32_t)(s - (uint64_t)i * segs_per_page); /* layer * 2 + K|V */
        uint8_t *pool = ((r & 1) ? a.v : a.k) + (uint64_t)(r >> 1) * a.layer_stride +
                        (uint64_t)a.pages[i] * a.sp;
        uint4 *seg = reinterpret_cast<uint4 *>(a.buf + (uint64_t)i * a.buf_stride) +
                     (uint64_t)r * a.seg_vecs;
        for (uint32_t base = threadIdx.x; base < a.seg_vecs; base += kThreads * kIlp) {
            uint4 v[kIlp];
            uint4 *dst[kIlp];
#pragma unroll
            for (int k = 0; k < kIlp; k++) {
                const uint32_t x = base + (uint32_t)k * kThreads;
                dst[k] = nullptr;
                if (x >= a.seg_vecs)
                    continue;
                const uint32_t t = x / hv, rem = x - t * hv, h = rem / a.vecs_per_row,
                               c = rem - h * a.vecs_per_row;
                uint4 *pv = reinterpret_cast<uint4 *>(pool + t * a.sn + h * a.sh) + c;
                if (unpack) {
                    v[k] = __ldcs(seg + x);
                    dst[k] = pv;
                } else {
                    v[k] = __ldcs(pv);
                    dst[k] = seg + x;
                }
            }
#pragma unroll
            for (int k = 0; k < kIlp; k++)
                if (dst[k])
                    __stcs(dst[k], v[k]);
        }
    }
}

bool aligned16(const void *p)
{
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

int fill_args(const kvp_paged_kv_t *kv, uint32_t num_layers, uint64_t layer_stride_bytes,
              const uint32_t *pages, uint32_t n, const void *buf_dev, uint64_t buf_stride_bytes,
              const kvp_pack_cuda_opts_t *opts, pages_args *a)
{
    if (!kv || !kv->k_data || !kv->v_data || !buf_dev || (n && !pages) || !num_layers ||
        n > KVP_PACK_PAGES_MAX || (opts && opts->max_blocks > KVP_PACK_CUDA_MAX_BLOCKS))
        return KVP_EINVAL;
    const uint64_t e = kv->elem_bytes, row = (uint64_t)kv->head_dim * e;
    if ((e != 1 && e != 2 && e != 4) || !kv->page_size || !kv->num_heads || !kv->num_pages ||
        row == 0 || row % 16 || !aligned16(kv->k_data) || !aligned16(kv->v_data) ||
        !aligned16(buf_dev) || kv->stride_page < 0 || kv->stride_n < 0 || kv->stride_h < 0 ||
        (kv->stride_page * e) % 16 || (kv->stride_n * e) % 16 || (kv->stride_h * e) % 16 ||
        layer_stride_bytes % 16 || buf_stride_bytes % 16)
        return KVP_EINVAL;
    const uint64_t vpr = row / 16, seg = (uint64_t)kv->page_size * kv->num_heads * vpr;
    /* a segment's vector index is 32-bit; pages must not overlap in the buffer */
    if (seg > UINT32_MAX / 2 || (n > 1 && buf_stride_bytes < 2ull * num_layers * seg * 16))
        return KVP_EINVAL;
    for (uint32_t i = 0; i < n; i++)
        if (pages[i] >= kv->num_pages)
            return KVP_ERANGE;
    a->k = static_cast<uint8_t *>(kv->k_data);
    a->v = static_cast<uint8_t *>(kv->v_data);
    a->buf = static_cast<uint8_t *>(const_cast<void *>(buf_dev));
    a->layer_stride = layer_stride_bytes;
    a->buf_stride = buf_stride_bytes;
    a->sp = (uint64_t)kv->stride_page * e;
    a->sn = (uint64_t)kv->stride_n * e;
    a->sh = (uint64_t)kv->stride_h * e;
    a->n = n;
    a->layers = num_layers;
    a->heads = kv->num_heads;
    a->vecs_per_row = (uint32_t)vpr;
    a->seg_vecs = (uint32_t)seg;
    for (uint32_t i = 0; i < n; i++)
        a->pages[i] = pages[i];
    return 0;
}

template <bool unpack> int launch(const pages_args &a, uint32_t max_blocks, cudaStream_t s)
{
    int rc = 0;
    if (!a.n)
        return 0;
    uint64_t cap = max_blocks;
    if (!cap) { /* two blocks per SM of the current device */
        int dev = 0, sms = 0;
        KVP_CUDA_TRY(cudaGetDevice(&dev), rc, fail);
        KVP_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), rc, fail);
        cap = 2ull * (uint64_t)(sms > 0 ? sms : 1);
    }
    {
        const uint64_t segs = 2ull * a.n * a.layers;
        const uint64_t blocks = segs < cap ? segs : cap; /* the loop over segments does the rest */
        pages_kernel<unpack><<<(unsigned)blocks, kThreads, 0, s>>>(a);
        KVP_LAUNCH_TRY(rc, fail);
    }
    return 0;
fail:
    return rc;
}

} // namespace

extern "C" int kvp__cuda_slots_preload(void)
{
    cudaFuncAttributes attr;
    int rc = 0;
    KVP_CUDA_TRY(cudaFuncGetAttributes(&attr, reinterpret_cast<const void *>(pages_kernel<false>)),
                 rc, fail);
    KVP_CUDA_TRY(cudaFuncGetAttributes(&attr, reinterpret_cast<const void *>(pages_kernel<true>)),
                 rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_kv_pack_pages_cuda(const kvp_paged_kv_t *kv, uint32_t num_layers,
                                      uint64_t layer_stride_bytes, const uint32_t *pages,
                                      uint32_t n, void *buf_dev, uint64_t buf_stride_bytes,
                                      const kvp_pack_cuda_opts_t *opts, void *stream)
{
    pages_args a = {};
    int rc = fill_args(kv, num_layers, layer_stride_bytes, pages, n, buf_dev, buf_stride_bytes,
                       opts, &a);
    return rc ? rc
              : launch<false>(a, opts ? opts->max_blocks : 0, static_cast<cudaStream_t>(stream));
}

extern "C" int kvp_kv_unpack_pages_cuda(const kvp_paged_kv_t *kv, uint32_t num_layers,
                                        uint64_t layer_stride_bytes, const uint32_t *pages,
                                        uint32_t n, const void *buf_dev, uint64_t buf_stride_bytes,
                                        const kvp_pack_cuda_opts_t *opts, void *stream)
{
    pages_args a = {};
    int rc = fill_args(kv, num_layers, layer_stride_bytes, pages, n, buf_dev, buf_stride_bytes,
                       opts, &a);
    return rc ? rc
              : launch<true>(a, opts ? opts->max_blocks : 0, static_cast<cudaStream_t>(stream));
}
