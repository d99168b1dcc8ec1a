/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_cuda_move.c - the cuda backend's page-mover (ops->move, kvp_backend.h): the pack
 * and unpack kernels over a packed range, per layer. Two uses: transfers (xfer/) queue a chunk
 * on their own stream with the page ids and the staging already on the device; a caller with
 * host memory (a second tier, a test) gives host ids and a host buffer and the move stages
 * them through device memory on a stream of its own, done when it returns. Only the pool's
 * address and device come from the backend (kvp_backend_cuda_device): no backend state here.
 */
#include <stdint.h>

#include "kvp_backend.h"
#include "kvp_backend_internal.h"
#include "kvp_error.h"

#ifdef KVP_HAVE_CUDA
#include "kvp_cuda_util.h"
#include "kvp_kernels_cuda.h"

typedef struct {
    const kvp_backend_t *b;
    const kvp_move_t *m;
    void *pool;
    const int32_t *pages_dev;
    uint8_t *buf_dev;
    cudaStream_t stream;
} cuda_move_t;

static int cuda_move_piece(void *arg, uint32_t layer, uint64_t lo, uint64_t hi, uint64_t buf_off)
{
    const cuda_move_t *cm = arg;
    const kvp_move_t *m = cm->m;
    kvp_paged_kv_t kv;
    kvp_backend_layer_view(cm->b, cm->pool, layer, &kv);
    const kvp_pack_cuda_opts_t po = {.max_blocks = cm->b->tuning.pack_blocks};
    uint8_t *buf = cm->buf_dev + buf_off;
    int rc = 0;
    if (m->dir == KVP_MOVE_OUT)
        KVP_KERNEL_TRY(kvp_kv_pack_range_cuda_ex(&kv, cm->pages_dev, m->num_tokens, lo, hi, buf,
                                                 &po, cm->stream),
                       rc, fail);
    else
        KVP_KERNEL_TRY(kvp_kv_unpack_range_cuda_ex(&kv, cm->pages_dev, m->num_tokens, lo, hi, buf,
                                                   &po, cm->stream),
                       rc, fail);
    return 0;
fail:
    return rc;
}

int kvp__backend_cuda_move(kvp_backend_t *b, const kvp_move_t *m)
{
    int rc = kvp_backend_move_check(b, m);
    if (rc)
        return rc;
    if (((m->begin | m->end) & 15u) ||
        (m->stream && (m->buf_medium != KVP_MEDIUM_GPU || !m->pages_dev)))
        return KVP_EINVAL;
    if (m->begin == m->end)
        return 0;
    cuda_move_t cm = {.b = b, .m = m, .pages_dev = m->pages_dev, .stream = m->stream};
    int ordinal;
    if (kvp_backend_cuda_device(b, m->device, &ordinal, &cm.pool))
        return KVP_EINVAL;
    const uint64_t bytes = m->end - m->begin;
    const size_t pages_bytes =
        (size_t)(((uint64_t)m->num_tokens + b->geom.page_size - 1) / b->geom.page_size) * 4u;
    int32_t *pages_tmp = NULL;
    uint8_t *buf_tmp = NULL;
    KVP_CUDA_TRY(cudaSetDevice(ordinal), rc, fail);
    if (!cm.stream)
        KVP_CUDA_TRY(cudaStreamCreateWithFlags(&cm.stream, cudaStreamNonBlocking), rc, fail);
    if (!cm.pages_dev) {
        KVP_CUDA_TRY(cudaMallocAsync((void **)&pages_tmp, pages_bytes, cm.stream), rc, fail_stream);
        KVP_CUDA_TRY(
            cudaMemcpyAsync(pages_tmp, m->pages, pages_bytes, cudaMemcpyHostToDevice, cm.stream),
            rc, fail_free);
        cm.pages_dev = pages_tmp;
    }
    if (m->buf_medium == KVP_MEDIUM_HOST) {
        KVP_CUDA_TRY(cudaMallocAsync((void **)&buf_tmp, bytes, cm.stream), rc, fail_free);
        if (m->dir == KVP_MOVE_IN)
            KVP_CUDA_TRY(cudaMemcpyAsync(buf_tmp, m->buf, bytes, cudaMemcpyHostToDevice, cm.stream),
                         rc, fail_free);
        cm.buf_dev = buf_tmp;
    } else {
        cm.buf_dev = m->buf;
    }
    if ((rc = kvp__backend_move_pieces(b, m, cuda_move_piece, &cm)))
        goto fail_free;
    if (m->buf_medium == KVP_MEDIUM_HOST && m->dir == KVP_MOVE_OUT)
        KVP_CUDA_TRY(cudaMemcpyAsync(m->buf, buf_tmp, bytes, cudaMemcpyDeviceToHost, cm.stream), rc,
                     fail_free);
fail_free:
    if (buf_tmp)
        (void)cudaFreeAsync(buf_tmp, cm.stream);
    if (pages_tmp)
        (void)cudaFreeAsync(pages_tmp, cm.stream);
fail_stream:
    if (!m->stream) {
        cudaError_t e = cudaStreamSynchronize(cm.stream);
        if (!rc && e != cudaSuccess)
            rc = kvp__cuda_fail_rt(e, "cudaStreamSynchronize", __FILE__, __LINE__);
        (void)cudaStreamDestroy(cm.stream);
    }
fail:
    return rc;
}

#else /* !KVP_HAVE_CUDA */

int kvp__backend_cuda_move(kvp_backend_t *b, const kvp_move_t *m)
{
    (void)b, (void)m;
    return KVP_EUNAVAIL;
}

#endif
