/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_cuda_slots.c - the cuda backend's host-tier mover (ops->move_slots, kvp_backend.h):
 * a batch of scattered pages between the GPU pool and slots of pinned host memory
 * (kvp_tier_mem.h), each slot one page's packed form.
 *
 * The method. PCIe, not the GPU, bounds this: a Llama-3.1-8B page is 2 MiB packed, ~38 us at
 * the ~55 GB/s of the H200's Gen5 link, while the same bytes take well under 1 us of HBM. So the
 * link must stay busy and the SMs mostly free for decode. Per chunk of the batch (up to 16 MiB
 * of pages), one launch of kvp_kv_pack_pages_cuda gathers the chunk's pages (every layer, K
 * and V) into device staging in slot order, and the copy engine moves each slot out with one
 * cudaMemcpyAsync, 2 MiB at a time, which the DMA engine streams at the link's rate (on the
 * H200, 2026-12-04: 93% of the pinned cudaMemcpy ceiling each way, 92% both ways); a restore is the
 * reverse (copies in, then the unpack). The pack and the copies sit on two streams of their own and
 * a ring of four staging chunks ordered by events, so chunk c + 1 is packed while chunk c crosses
 * the link, and the pack's grid is capped (PACK_BLOCKS, or [tuning] pack_blocks) so it takes a few
 * SMs for a short time. Not chosen: per-layer pieces (64 copies of 32 KiB a page: the copy engine's
 * per-copy cost dominates), and a kernel storing straight into mapped host memory (it would hold
 * SMs for the whole transfer, and reads of host memory from SMs reach far less than the copy
 * engine).
 *
 * Concurrency: every call takes a context of its own (two non-blocking streams and the staging
 * ring per device) from the backend's free list, making one when none is free, and gives it
 * back when done; so calls from different threads never share a stream or queue behind one
 * another, and there are never more contexts than calls that ran at once (the daemon's worker
 * threads). The call is done (bytes in place, pages free to reuse) when it returns. A
 * tensor-parallel pool moves device g's heads to g * kvp_backend_move_bytes(b, page_size) of
 * each slot, every device's chunk queued before the next chunk, so the devices run in parallel.
 * A CUDA failure after work was queued poisons the backend (the caller cannot know what landed).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_backend.h"
#include "kvp_backend_internal.h"
#include "kvp_error.h"

#ifdef KVP_HAVE_CUDA

#include "kvp_backend_cuda_internal.h"
#include "kvp_cuda_util.h"
#include "kvp_kernels_cuda.h"

#define RING        4           /* staging chunks per device and context */
#define CHUNK_BYTES (16u << 20) /* staging chunk: 8 Llama-8B pages */
#define PACK_BLOCKS 32u         /* the pack's grid cap when [tuning] pack_blocks is 0 */

/* One device's part of a context. */
typedef struct {
    int ordinal;
    uint8_t *pool;
    cudaStream_t ks, cs; /* the pack kernels', the copies' */
    cudaEvent_t filled[RING], drained[RING];
    uint8_t *stage[RING];
    int used[RING]; /* drained[r] was recorded by this call */
} slot_dev_t;

typedef struct slot_ctx {
    struct slot_ctx *next;
    uint32_t num_devices;
    slot_dev_t dev[];
} slot_ctx_t;

struct kvp__cuda_slots {
    pthread_mutex_t lock; /* free */
    slot_ctx_t *free;
    uint32_t chunk_pages; /* pages a staging chunk holds */
    uint64_t page_bytes;  /* one page's packed form on one device */
};

static void ctx_free(slot_ctx_t *ctx)
{
    for (uint32_t g = 0; g < ctx->num_devices; g++) {
        slot_dev_t *d = &ctx->dev[g];
        int rc = 0;
        KVP_CUDA_TRY(cudaSetDevice(d->ordinal), rc, next);
        /* idle already (every call waits for its work); a failed call's may not be */
        if (d->ks)
            (void)cudaStreamSynchronize(d->ks);
        if (d->cs)
            (void)cudaStreamSynchronize(d->cs);
        for (int r = 0; r < RING; r++) {
            if (d->stage[r])
                (void)cudaFree(d->stage[r]);
            if (d->filled[r])
                (void)cudaEventDestroy(d->filled[r]);
            if (d->drained[r])
                (void)cudaEventDestroy(d->drained[r]);
        }
        if (d->ks)
            (void)cudaStreamDestroy(d->ks);
        if (d->cs)
            (void)cudaStreamDestroy(d->cs);
    next:
        (void)rc;
    }
    free(ctx);
}

static int ctx_new(kvp_backend_t *b, const struct kvp__cuda_slots *s, slot_ctx_t **out)
{
    const uint32_t devices = b->geom.num_devices ? b->geom.num_devices : 1;
    slot_ctx_t *ctx = calloc(1, sizeof(*ctx) + devices * sizeof(slot_dev_t));
    if (!ctx)
        return KVP_ENOMEM;
    int rc = 0;
    for (uint32_t g = 0; g < devices; g++) {
        slot_dev_t *d = &ctx->dev[g];
        void *pool;
        if (kvp_backend_cuda_device(b, g, &d->ordinal, &pool)) {
            rc = KVP_EINTERNAL;
            goto fail;
        }
        d->pool = pool;
        ctx->num_devices = g + 1;
        KVP_CUDA_TRY(cudaSetDevice(d->ordinal), rc, fail);
        KVP_CUDA_TRY(cudaStreamCreateWithFlags(&d->ks, cudaStreamNonBlocking), rc, fail);
        KVP_CUDA_TRY(cudaStreamCreateWithFlags(&d->cs, cudaStreamNonBlocking), rc, fail);
        for (int r = 0; r < RING; r++) {
            KVP_CUDA_TRY(cudaEventCreateWithFlags(&d->filled[r], cudaEventDisableTiming), rc, fail);
            KVP_CUDA_TRY(cudaEventCreateWithFlags(&d->drained[r], cudaEventDisableTiming), rc,
                         fail);
            KVP_CUDA_TRY(cudaMalloc((void **)&d->stage[r], (size_t)s->chunk_pages * s->page_bytes),
                         rc, fail);
        }
    }
    *out = ctx;
    return 0;
fail:
    ctx_free(ctx);
    return rc;
}

/* The backend's contexts, made on the first call. */
static struct kvp__cuda_slots *slots_of(cuda_backend_t *cb)
{
    struct kvp__cuda_slots *s = atomic_load(&cb->slots);
    if (s)
        return s;
    s = calloc(1, sizeof(*s));
    if (!s || pthread_mutex_init(&s->lock, NULL)) {
        free(s);
        return NULL;
    }
    const kvp_backend_t *b = &cb->base;
    s->page_bytes = kvp_backend_move_bytes(b, b->geom.page_size);
    const uint64_t fit = CHUNK_BYTES / s->page_bytes;
    s->chunk_pages = fit < 1 ? 1 : fit > KVP_PACK_PAGES_MAX ? KVP_PACK_PAGES_MAX : (uint32_t)fit;
    struct kvp__cuda_slots *none = NULL;
    if (!atomic_compare_exchange_strong(&cb->slots, &none, s)) { /* another thread's won */
        pthread_mutex_destroy(&s->lock);
        free(s);
        return none;
    }
    return s;
}

static int ctx_take(kvp_backend_t *b, struct kvp__cuda_slots *s, slot_ctx_t **out)
{
    pthread_mutex_lock(&s->lock);
    slot_ctx_t *ctx = s->free;
    if (ctx)
        s->free = ctx->next;
    pthread_mutex_unlock(&s->lock);
    if (ctx) {
        *out = ctx;
        return 0;
    }
    return ctx_new(b, s, out); /* outside the lock: a first call of each thread at once */
}

static void ctx_give(struct kvp__cuda_slots *s, slot_ctx_t *ctx)
{
    pthread_mutex_lock(&s->lock);
    ctx->next = s->free;
    s->free = ctx;
    pthread_mutex_unlock(&s->lock);
}

void kvp__backend_cuda_slots_free(cuda_backend_t *cb)
{
    struct kvp__cuda_slots *s = atomic_exchange(&cb->slots, NULL);
    if (!s)
        return;
    while (s->free) {
        slot_ctx_t *ctx = s->free;
        s->free = ctx->next;
        ctx_free(ctx);
    }
    pthread_mutex_destroy(&s->lock);
    free(s);
}

/* The copies of cnt pages of chunk staging r, one per slot, on d->cs. Never one per run of
 * adjacent slots: two adjacent slots may lie in two chunks the tier pinned apart (two
 * cudaHostRegister calls), and a copy may not cross from one registration into the next
 * (cudaErrorInvalidValue). A slot lies in one chunk (kvp_tier_mem's chunks are whole slots). */
static int copy_slots(slot_dev_t *d, int r, const kvp_slot_move_t *m, uint32_t first, uint32_t cnt,
                      uint64_t part_off, uint64_t pb)
{
    int rc = 0;
    for (uint32_t j = 0; j < cnt; j++) {
        uint8_t *host = (uint8_t *)m->slots[first + j] + part_off;
        uint8_t *dev = d->stage[r] + (uint64_t)j * pb;
        if (m->dir == KVP_MOVE_OUT)
            KVP_CUDA_TRY(cudaMemcpyAsync(host, dev, (size_t)pb, cudaMemcpyDeviceToHost, d->cs), rc,
                         fail);
        else
            KVP_CUDA_TRY(cudaMemcpyAsync(dev, host, (size_t)pb, cudaMemcpyHostToDevice, d->cs), rc,
                         fail);
    }
fail:
    return rc;
}

/* Queues chunk [first, first + cnt) of m on device d through staging r: pack then copies out,
 * or copies in then unpack. */
static int chunk_queue(const kvp_backend_t *b, slot_dev_t *d, int r, const kvp_slot_move_t *m,
                       uint32_t first, uint32_t cnt, uint64_t part_off, uint64_t pb,
                       const kvp_pack_cuda_opts_t *po)
{
    int rc = 0;
    kvp_paged_kv_t kv;
    kvp_backend_layer_view(b, d->pool, 0, &kv);
    const uint32_t L = b->geom.num_layers;
    const uint64_t ls = b->derived.layer_bytes;
    KVP_CUDA_TRY(cudaSetDevice(d->ordinal), rc, fail);
    if (m->dir == KVP_MOVE_OUT) {
        /* staging r is free once its previous copies out are done */
        if (d->used[r])
            KVP_CUDA_TRY(cudaStreamWaitEvent(d->ks, d->drained[r], 0), rc, fail);
        KVP_KERNEL_TRY(
            kvp_kv_pack_pages_cuda(&kv, L, ls, m->pages + first, cnt, d->stage[r], pb, po, d->ks),
            rc, fail);
        KVP_CUDA_TRY(cudaEventRecord(d->filled[r], d->ks), rc, fail);
        KVP_CUDA_TRY(cudaStreamWaitEvent(d->cs, d->filled[r], 0), rc, fail);
        if ((rc = copy_slots(d, r, m, first, cnt, part_off, pb)))
            goto fail;
        KVP_CUDA_TRY(cudaEventRecord(d->drained[r], d->cs), rc, fail);
    } else {
        /* staging r is free once its previous unpack is done */
        if (d->used[r])
            KVP_CUDA_TRY(cudaStreamWaitEvent(d->cs, d->drained[r], 0), rc, fail);
        if ((rc = copy_slots(d, r, m, first, cnt, part_off, pb)))
            goto fail;
        KVP_CUDA_TRY(cudaEventRecord(d->filled[r], d->cs), rc, fail);
        KVP_CUDA_TRY(cudaStreamWaitEvent(d->ks, d->filled[r], 0), rc, fail);
        KVP_KERNEL_TRY(
            kvp_kv_unpack_pages_cuda(&kv, L, ls, m->pages + first, cnt, d->stage[r], pb, po, d->ks),
            rc, fail);
        KVP_CUDA_TRY(cudaEventRecord(d->drained[r], d->ks), rc, fail);
    }
    d->used[r] = 1;
fail:
    return rc;
}

int kvp__backend_cuda_move_slots(kvp_backend_t *b, const kvp_slot_move_t *m)
{
    cuda_backend_t *cb = (cuda_backend_t *)b;
    int rc = kvp__backend_slot_move_check(b, m);
    if (rc)
        return rc;
    if (atomic_load(&cb->poisoned))
        return KVP_EUNAVAIL;
    struct kvp__cuda_slots *s = slots_of(cb);
    if (!s)
        return KVP_ENOMEM;
    slot_ctx_t *ctx = NULL;
    if ((rc = ctx_take(b, s, &ctx)))
        return rc; /* nothing queued: no staging (device memory), the backend is fine */
    const kvp_pack_cuda_opts_t po = {.max_blocks = b->tuning.pack_blocks ? b->tuning.pack_blocks
                                                                         : PACK_BLOCKS};
    const uint64_t pb = s->page_bytes;
    uint32_t c = 0;
    for (uint32_t first = 0; first < m->n && !rc; first += s->chunk_pages, c++) {
        const uint32_t cnt = m->n - first < s->chunk_pages ? m->n - first : s->chunk_pages;
        for (uint32_t g = 0; g < ctx->num_devices && !rc; g++)
            rc = chunk_queue(b, &ctx->dev[g], (int)(c % RING), m, first, cnt, (uint64_t)g * pb, pb,
                             &po);
    }
    /* everything queued is waited for, after a failure too: the staging must be idle before
     * it is reused, and the pages and slots before the caller reuses them */
    for (uint32_t g = 0; g < ctx->num_devices; g++) {
        slot_dev_t *d = &ctx->dev[g];
        cudaError_t e = cudaSetDevice(d->ordinal);
        if (e == cudaSuccess)
            e = cudaStreamSynchronize(d->ks);
        if (e == cudaSuccess)
            e = cudaStreamSynchronize(d->cs);
        if (e != cudaSuccess && !rc)
            rc = KVP_CUDA_FAILED(e, "cudaStreamSynchronize(slot mover)");
        memset(d->used, 0, sizeof(d->used));
    }
    if (rc) {
        kvp__backend_cuda_poison(cb, "a host-tier move failed");
        ctx_free(ctx);
        return rc;
    }
    ctx_give(s, ctx);
    return 0;
}

#else /* !KVP_HAVE_CUDA */

int kvp__backend_cuda_move_slots(kvp_backend_t *b, const kvp_slot_move_t *m)
{
    (void)b, (void)m;
    return KVP_EUNAVAIL;
}

#endif
