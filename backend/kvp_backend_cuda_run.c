/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_cuda_run.c - the cuda backend's ops->run (kvp_backend.h): an Append's plan on
 * the device's own non-blocking stream. Two paths: a small Append (no copy-on-write copies, at
 * most KVP_APPEND_SLOTS_MAX tokens: every decode step) is one launch of the append over all its
 * layers with the planner's slots carried inside the launch (KVP_APPEND_CUDA_HOST_DEST);
 * anything else uploads the slots and the copies through pinned staging and runs the page
 * copies and the per-layer append of the slots form, with an error word read back. Either way
 * the kernels read the planner's destination as it is (kvp_exec_t.dest): nothing is derived
 * or re-checked here. The worker's data is ordered before the copy by its interprocess "ready"
 * event, waited for on the CPU (kvp_backend_cuda.c's file comment says why). Not here: the
 * pool, buffers and events (kvp_backend_cuda.c).
 */
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvp_backend.h"
#include "kvp_error.h"
#include "kvp_log.h"

#ifdef KVP_HAVE_CUDA

#include "kvp_backend_cuda_internal.h"
#include "kvp_cuda_util.h"
#include "kvp_kernels_cuda.h"

/* The kernels move 16-byte vectors: a source they would refuse is refused here first, before
 * anything is queued (the dispatch checks only element alignment). */
static int check_source_align(const cuda_buf_t *buf, const kvp_exec_t *e)
{
    if ((uintptr_t)buf->dptr % 16)
        return KVP_EINVAL;
    const uint64_t *v = kvp_src_layout_words(&e->layout);
    for (int i = 0; i < KVP_SRC_LAYOUT_WORDS; i++)
        if (v[i] % 16)
            return KVP_EINVAL;
    return 0;
}

/* Makes the slot hold at least bytes (its previous run is known to be finished). */
static int stage_reserve(stage_t *st, size_t bytes)
{
    int rc = 0;
    if (st->cap_bytes >= bytes)
        return 0;
    size_t cap = st->cap_bytes ? 2 * st->cap_bytes : STAGE_MIN_BYTES;
    while (cap < bytes)
        cap *= 2;
    /* rare (doubling); cudaFreeHost may wait for the device */
    if (st->host)
        KVP_CUDA_TRY(cudaFreeHost(st->host), rc, fail);
    st->host = NULL;
    st->cap_bytes = 0;
    KVP_CUDA_TRY(cudaHostAlloc((void **)&st->host, cap, cudaHostAllocDefault), rc, fail);
    st->cap_bytes = cap;
    return 0;
fail:
    return rc;
}

/* Makes the device copy hold at least bytes, in stream order (no synchronisation). */
int kvp__backend_cuda_dev_reserve(cuda_dev_t *dv, size_t bytes)
{
    int rc = 0;
    if (dv->dev_cap_bytes >= bytes)
        return 0;
    size_t cap = dv->dev_cap_bytes ? 2 * dv->dev_cap_bytes : STAGE_MIN_BYTES;
    while (cap < bytes)
        cap *= 2;
    if (dv->dev_words)
        KVP_CUDA_TRY(cudaFreeAsync(dv->dev_words, dv->stream), rc, fail);
    dv->dev_words = NULL;
    dv->dev_cap_bytes = 0;
    KVP_CUDA_TRY(cudaMallocAsync((void **)&dv->dev_words, cap, dv->stream), rc, fail);
    dv->dev_cap_bytes = cap;
    return 0;
fail:
    return rc;
}

/* Reads a finished run's error word; non-zero poisons. */
static int stage_check(cuda_backend_t *cb, const stage_t *st)
{
    int32_t err = st->host[st->err_word];
    if (err == 0)
        return 0;
    kvp_log(KVP_LOG_CRIT, "cuda append reported a bad row err=%s (planner bug)", kvp_errname(err));
    kvp__backend_cuda_poison(cb, "the append kernel reported an error");
    return KVP_EINTERNAL;
}

/* Word layout of a staged plan (int32 words): the slots (the planner's destination, as the
 * kernels read it), the copies, the error word. */
typedef struct {
    size_t slots, copies, err, total;
} plan_layout_t;

static void plan_layout(const kvp_exec_t *e, plan_layout_t *p)
{
    p->slots = 0;
    p->copies = p->slots + e->dest.nnz;
    p->err = p->copies + 2 * (size_t)e->num_copies;
    p->total = p->err + 1;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Queues e's copies on device dv and, when buf is not NULL, the append from buf (that device's
 * heads). The caller holds dv->lock. Nothing is waited for here, so the devices of a group
 * run their parts at the same time. */
static int enqueue_on_device(cuda_backend_t *cb, cuda_dev_t *dv, const kvp_exec_t *e,
                             cuda_buf_t *buf)
{
    kvp_backend_t *b = &cb->base;
    plan_layout_t pl;
    plan_layout(e, &pl);
    const size_t bytes = pl.total * sizeof(int32_t);
    int rc = 0;

    KVP_CUDA_TRY(cudaSetDevice(dv->ordinal), rc, fail);
    stage_t *st = &dv->stage;
    if ((rc = stage_reserve(st, bytes)) || (rc = kvp__backend_cuda_dev_reserve(dv, bytes)))
        goto fail;

    int32_t *h = st->host;
    if (e->dest.nnz)
        memcpy(h + pl.slots, e->dest.slots, e->dest.nnz * sizeof(int32_t));
    if (e->num_copies)
        memcpy(h + pl.copies, e->copies, e->num_copies * sizeof(kvp_page_copy_t));
    h[pl.err] = 0;
    int32_t *d = dv->dev_words;
    KVP_CUDA_TRY(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, dv->stream), rc, fail);

    void *pool = (void *)(uintptr_t)dv->pool.ptr;
    kvp_paged_kv_t kv;
    for (uint32_t l = 0; l < b->geom.num_layers && e->num_copies; l++) {
        kvp_backend_layer_view(b, pool, l, &kv);
        KVP_KERNEL_TRY(kvp_page_copy_cuda(&kv, (const kvp_page_copy_t *)(d + pl.copies),
                                          e->num_copies, d + pl.err, dv->stream),
                       rc, fail);
    }
    if (buf && e->dest.nnz) {
        /* the planner's slots as they are, uploaded; a slot beyond the pool lands in the
         * error word (stage_check poisons) */
        const kvp_append_dest_t dest = {
            .kind = KVP_APPEND_DEST_SLOTS, .nnz = e->dest.nnz, .slots = d + pl.slots};
        const kvp_append_cuda_args_t args = {.err_dev = d + pl.err, .shape = &b->tuning.append};
        for (uint32_t l = e->layer_begin; l < e->layer_end; l++) {
            kvp_backend_layer_view(b, pool, l, &kv);
            const uint8_t *base = buf->dptr + (uint64_t)(l - e->layer_begin) * e->layer_stride;
            kvp_append_src_t src;
            kvp_backend_exec_src(b, e, base, &src);
            KVP_KERNEL_TRY(kvp_append_cuda(&kv, &src, &dest, &args, dv->stream), rc, fail);
        }
    }
    KVP_CUDA_TRY(cudaMemcpyAsync(h + pl.err, d + pl.err, sizeof(int32_t), cudaMemcpyDeviceToHost,
                                 dv->stream),
                 rc, fail);
    st->err_word = pl.err;
    return 0;
fail:
    return rc ? rc : KVP_EINTERNAL;
}

/* The small-Append path: one launch of the slot kernel for every layer of the range, the
 * planner's slots inside the launch (kvp_append_cuda with KVP_APPEND_CUDA_HOST_DEST), so
 * nothing is uploaded before it and no error word is read back after it (the kernel entry
 * range-checks every slot on the host first). Used
 * when there are no copy-on-write copies and the batch fits one launch; decode steps are
 * that case. The caller holds dv->lock. */
static int enqueue_slots(cuda_backend_t *cb, cuda_dev_t *dv, const kvp_exec_t *e, cuda_buf_t *buf)
{
    kvp_backend_t *b = &cb->base;
    int rc = 0;
    KVP_CUDA_TRY(cudaSetDevice(dv->ordinal), rc, fail);
    kvp_paged_kv_t kv;
    kvp_backend_layer_view(b, (void *)(uintptr_t)dv->pool.ptr, e->layer_begin, &kv);
    const uint8_t *base = buf->dptr;
    kvp_append_src_t src;
    kvp_backend_exec_src(b, e, base, &src);
    const kvp_append_cuda_args_t args = {.flags = KVP_APPEND_CUDA_HOST_DEST,
                                         .num_layers = e->layer_end - e->layer_begin,
                                         .layer_stride_bytes = b->derived.layer_bytes,
                                         .src_layer_stride_bytes = e->layer_stride};
    /* a slot beyond the pool is refused before anything is queued (KVP_ERANGE): a plan our
     * planner cannot have made, not a failed launch */
    int krc = 0;
    KVP_KERNEL_TRY(
        (krc = kvp_append_cuda(&kv, &src, &e->dest, &args, dv->stream)) == KVP_ERANGE ? 0 : krc, rc,
        fail);
    if (krc == KVP_ERANGE) {
        kvp_log(KVP_LOG_CRIT, "cuda append plan names a slot outside the pool (planner bug)");
        return KVP_EINTERNAL;
    }
    return 0;
fail:
    return rc ? rc : KVP_EINTERNAL;
}

/* Waits until dv's stream has run what was queued and, for enqueue_on_device's work
 * (has_err_word), checks the run's error word. The daemon waits for the copy before answering in
 * both sync modes: the pages the copy writes stay pinned only until run() returns
 * (kvp_rpc_job_finish unpins them), so returning while the GPU still writes would let a concurrent
 * Release hand those pages to another sequence. SYNC_EVENT still orders the worker's stream after
 * the copy on the GPU (the done event), so the worker's stream never waits on the CPU. The caller
 * holds dv->lock. */
static int finish_on_device(cuda_backend_t *cb, cuda_dev_t *dv, int has_err_word)
{
    int rc = 0;
    KVP_CUDA_TRY(cudaSetDevice(dv->ordinal), rc, fail);
    KVP_CUDA_TRY(cudaStreamSynchronize(dv->stream), rc, fail);
    return has_err_word ? stage_check(cb, &dv->stage) : 0;
fail:
    return rc;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Waits on the CPU until the worker's ready event completes: spinning briefly, then sleeping
 * with a growing interval. 0; KVP_ETIMEDOUT after timeout_ms (a dead or stuck worker);
 * KVP_EINVAL when the event reports an error. Copy thread, no lock held. */
static int wait_ready(const cuda_buf_t *buf, uint64_t timeout_ms)
{
    const uint64_t start = now_ms();
    long sleep_ns = 20 * 1000;
    for (unsigned i = 0;; i++) {
        cudaError_t e = cudaEventQuery(buf->ready);
        if (e == cudaSuccess)
            return 0;
        if (e != cudaErrorNotReady) {
            (void)KVP_CUDA_FAILED(e, "cudaEventQuery(buf->ready)");
            return KVP_EINVAL;
        }
        if (now_ms() - start > timeout_ms) {
            kvp_log(KVP_LOG_WARNING,
                    "append skipped reason=\"the worker's ready event did not complete in %llu "
                    "ms\"",
                    (unsigned long long)timeout_ms);
            return KVP_ETIMEDOUT;
        }
        if (i < 256) {
            sched_yield();
            continue;
        }
        struct timespec ts = {0, sleep_ns};
        nanosleep(&ts, NULL);
        if (sleep_ns < 500 * 1000)
            sleep_ns += sleep_ns / 4;
    }
}

int kvp__backend_cuda_run(kvp_backend_t *b, const kvp_exec_t *e)
{
    cuda_backend_t *cb = (cuda_backend_t *)b;
    if (atomic_load(&cb->poisoned))
        return KVP_EINTERNAL;
    if (!e || e->layer_begin > e->layer_end || e->layer_end > b->geom.num_layers)
        return KVP_EINTERNAL; /* the dispatch validated all this: a bug, not a refusal */
    /* feed[g]: the buffer device g appends from (NULL: copies only). The single-source form
     * feeds the buffer's own device (it carries that device's heads); the tensor-parallel form
     * feeds every device from its rank's buffer. */
    cuda_buf_t *feed[KVP_GEOM_MAX_DEVICES] = {0};
    if (e->num_rank_src) {
        if (e->num_rank_src != cb->num_devices)
            return KVP_EINTERNAL;
        for (uint32_t g = 0; g < cb->num_devices; g++) {
            const kvp_buffer_t *kb = e->rank_src[g];
            if (!kb || !kb->priv || ((cuda_buf_t *)kb->priv)->dev != g)
                return KVP_EINTERNAL;
            feed[g] = kb->priv;
        }
    } else {
        if (!e->src || !e->src->priv)
            return KVP_EINTERNAL;
        cuda_buf_t *buf = e->src->priv;
        feed[buf->dev] = buf;
    }
    /* an append that cannot run is skipped on every device, but the copies still run: the
     * dispatch then rolls the sequences back over pages whose old slots are right. Every
     * rank's source is checked and every ready event waited for before anything is queued,
     * so a group appends on all of its devices or on none. */
    int refused = 0;
    const uint64_t t0 = now_ns();
    for (uint32_t g = 0; g < cb->num_devices && e->dest.nnz && !refused; g++) {
        if (feed[g] && check_source_align(feed[g], e)) {
            kvp_log(KVP_LOG_WARNING, "append skipped reason=\"source offsets and strides must "
                                     "be multiples of 16 bytes for the cuda kernels\"");
            refused = KVP_EINVAL;
        }
    }
    for (uint32_t g = 0; g < cb->num_devices && e->dest.nnz && !refused; g++)
        if (feed[g] && e->sync == KVP_SYNC_EVENT && feed[g]->ready)
            refused = wait_ready(feed[g], cb->ready_timeout_ms);
    const uint64_t t1 = now_ns();
    /* page ids name the same slots on every device: copies run everywhere. Devices are locked
     * in index order (every run does the same, so two runs cannot deadlock), all of them are
     * given their work first and waited for after, so the group's devices work in parallel. */
    int locked[KVP_GEOM_MAX_DEVICES] = {0};
    int rc = 0;
    const int small = !refused && !e->num_copies && e->dest.nnz &&
                      e->dest.nnz <= KVP_APPEND_SLOTS_MAX && !cb->plan_upload;
    for (uint32_t g = 0; g < cb->num_devices && !rc; g++) {
        cuda_buf_t *buf = refused ? NULL : feed[g];
        if (!buf && !e->num_copies)
            continue;
        pthread_mutex_lock(&cb->dev[g].lock);
        locked[g] = 1;
        rc = small ? enqueue_slots(cb, &cb->dev[g], e, buf)
                   : enqueue_on_device(cb, &cb->dev[g], e, buf);
    }
    const uint64_t t2 = now_ns();
    for (uint32_t g = 0; g < cb->num_devices && !rc; g++)
        if (locked[g])
            rc = finish_on_device(cb, &cb->dev[g], !small);
    for (uint32_t g = cb->num_devices; g-- > 0;)
        if (locked[g])
            pthread_mutex_unlock(&cb->dev[g].lock);
    if (rc) {
        kvp__backend_cuda_poison(cb, "a CUDA call failed while running an append");
        return rc;
    }
    if (kvp_log_enabled(KVP_LOG_DEBUG))
        kvp_log(KVP_LOG_DEBUG,
                "cuda run timing nnz=%u ranks=%u path=%s ready_wait_us=%.1f enqueue_us=%.1f "
                "wait_us=%.1f",
                e->dest.nnz, e->num_rank_src, small ? "slots" : "upload", (double)(t1 - t0) / 1e3,
                (double)(t2 - t1) / 1e3, (double)(now_ns() - t2) / 1e3);
    return refused;
}

#endif
