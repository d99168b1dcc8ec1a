/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_cuda_gather.c - the cuda backend's ops->gather (kvp_backend.h): a Load's copy,
 * rows of pool slots out to a worker's registered device buffer, with kvp_gather_cuda once per
 * layer. It runs on a non-blocking stream of its own on the buffer's device, the slots uploaded
 * through stream-ordered memory, and is done when it returns: it takes no device lock, so a
 * Load never queues behind the device's Appends (run() keeps its stream and staging) nor they
 * behind it; the pages it reads are the caller's to keep still. Not here: the pool, buffers
 * and their import (kvp_backend_cuda.c), the kernel (kernels/kvp_gather_cuda.cu).
 */
#include <stdint.h>

#include "kvp_backend.h"
#include "kvp_backend_internal.h"
#include "kvp_error.h"

#ifdef KVP_HAVE_CUDA

#include "kvp_backend_cuda_internal.h"
#include "kvp_cuda_util.h"
#include "kvp_kernels_cuda.h"

/* Checks g against b before anything is queued: 0, KVP_EINVAL (a buffer not ours or not
 * writable, a layer range, a stride that is not an element stride the kernel can take) or
 * KVP_ERANGE (a slot beyond the pool). */
static int gather_check(const cuda_backend_t *cb, const kvp_gather_t *g)
{
    const kvp_backend_t *b = &cb->base;
    if (!g || !g->dst || !g->dst->priv || !g->dst->writable || (g->nnz && !g->slots) ||
        g->layer_begin > g->layer_end || g->layer_end > b->geom.num_layers)
        return KVP_EINVAL;
    const cuda_buf_t *buf = g->dst->priv;
    if (buf->dev >= cb->num_devices || !buf->dptr)
        return KVP_EINVAL;
    /* the dispatch checked the layout against the buffer; the kernel needs each stride as a
     * non-negative int64 element count */
    const uint64_t elem = b->derived.elem_bytes;
    const uint64_t strides[] = {g->k_stride_n, g->k_stride_h, g->v_stride_n, g->v_stride_h};
    for (unsigned i = 0; i < sizeof(strides) / sizeof(strides[0]); i++)
        if (strides[i] % elem || strides[i] / elem > (uint64_t)INT64_MAX)
            return KVP_EINVAL;
    const int64_t cap = (int64_t)b->geom.num_pages * b->geom.page_size;
    for (uint32_t i = 0; i < g->nnz; i++)
        if (g->slots[i] >= cap)
            return KVP_ERANGE;
    return 0;
}

int kvp__backend_cuda_gather(kvp_backend_t *b, const kvp_gather_t *g)
{
    cuda_backend_t *cb = (cuda_backend_t *)b;
    if (atomic_load(&cb->poisoned))
        return KVP_EINTERNAL;
    int rc = gather_check(cb, g);
    if (rc || g->nnz == 0 || g->layer_begin == g->layer_end)
        return rc;
    const cuda_buf_t *buf = g->dst->priv;
    const cuda_dev_t *dv = &cb->dev[buf->dev];
    /* the daemon's mapping of a writable buffer (cuda_buf_t keeps it const for run()'s reads) */
    uint8_t *dst_base = (uint8_t *)(uintptr_t)buf->dptr;
    void *pool = (void *)(uintptr_t)dv->pool.ptr;
    const size_t slots_bytes = (size_t)g->nnz * sizeof(int32_t);
    cudaStream_t s = NULL;
    int32_t *slots_dev = NULL;

    KVP_CUDA_TRY(cudaSetDevice(dv->ordinal), rc, fail);
    KVP_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), rc, fail);
    KVP_CUDA_TRY(cudaMallocAsync((void **)&slots_dev, slots_bytes, s), rc, fail_stream);
    KVP_CUDA_TRY(cudaMemcpyAsync(slots_dev, g->slots, slots_bytes, cudaMemcpyHostToDevice, s), rc,
                 fail_free);
    for (uint32_t l = g->layer_begin; l < g->layer_end; l++) {
        kvp_paged_kv_t kv;
        kvp_backend_layer_view(b, pool, l, &kv);
        kvp_gather_dst_t dst;
        kvp_backend_gather_dst(b, g, l, dst_base, &dst);
        KVP_KERNEL_TRY(kvp_gather_cuda(&kv, slots_dev, g->nnz, &dst, s), rc, fail_free);
    }
fail_free:
    if (slots_dev) {
        cudaError_t e = cudaFreeAsync(slots_dev, s);
        if (!rc && e != cudaSuccess)
            rc = KVP_CUDA_FAILED(e, "cudaFreeAsync(slots_dev)");
    }
fail_stream:
    /* waited for on every path: nothing may still read the slots or write dst on return */
    if (s) {
        cudaError_t e = cudaStreamSynchronize(s);
        if (!rc && e != cudaSuccess)
            rc = KVP_CUDA_FAILED(e, "cudaStreamSynchronize(gather)");
        (void)cudaStreamDestroy(s);
    }
fail:
    if (rc)
        kvp__backend_cuda_poison(cb, "a CUDA call failed while running a gather");
    return rc;
}

#else /* !KVP_HAVE_CUDA */

int kvp__backend_cuda_gather(kvp_backend_t *b, const kvp_gather_t *g)
{
    (void)b, (void)g;
    return KVP_EUNAVAIL;
}

#endif
