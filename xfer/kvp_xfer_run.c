/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_xfer_run.c - a transfer on its worker thread (kvp_xfer_run; the protocol and the
 * pipeline are described in kvp_xfer.c's header): the header and the stream over NCCL, the
 * staging chunks, the chunk pipeline that packs and unpacks through the backend's page-mover
 * (ops->move), the waits against the deadline, and the abort of a failed communicator.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvp_error.h"
#include "kvp_log.h"
#include "kvp_xfer_internal.h"
#ifdef KVP_TEST_HOOKS
#include "kvp_knob.h"
#endif

/* ---- the transfer itself (worker thread) ----------------------------------------------- */

#ifdef KVP_HAVE_NCCL

/* Frees the staging chunks (their streams have drained): deregistered and ncclMemFree'd when
 * registered, else stream-ordered on the communicator's stream (leaked with a leaked stream). */
void kvp__xfer_stage_free(const kvp_nccl_t *n, comm_t *c)
{
    for (int b = 0; b < (int)NSTAGE; b++) {
        if (!c->stage[b])
            continue;
        if (c->stage_reg) {
            if (c->reg_handle[b] && c->comm)
                (void)n->CommDeregister(c->comm, c->reg_handle[b]);
            (void)n->MemFree(c->stage[b]);
        } else if (c->stream) {
            (void)cudaFreeAsync(c->stage[b], c->stream);
        }
        c->stage[b] = NULL;
        c->reg_handle[b] = NULL;
    }
    c->stage_cap = 0;
}

static uint64_t mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static int job_fail(kvp_xfer_job_t *j, int rc, const char *fmt, const char *arg)
{
    if (!j->msg[0])
        snprintf(j->msg, sizeof(j->msg), fmt, arg);
    return rc;
}

/* The pause between two polls of a wait that started at since_us: none for the first SPIN_US
 * (the waits of a transfer are on its critical path, and a nanosleep of 100 us costs ~150 on
 * a VM: the handshake's few waits alone cost a millisecond that way, a third of a 1 GiB
 * transfer over NVLink), then 200 us naps (a peer that has not joined yet, a long stream).
 * A transfer keeps its worker thread busy anyway; the spin costs one core while it runs. */
static void poll_pause(uint64_t since_us)
{
    if (mono_us() - since_us < SPIN_US)
        return;
    struct timespec ts = {0, 200 * 1000};
    nanosleep(&ts, NULL);
}

/* After an NCCL call on the non-blocking communicator: waits until it is no longer in
 * progress. 0, the NCCL error's code, or KVP_ETIMEDOUT. */
static int settle(const kvp_nccl_t *n, kvp_xfer_job_t *j, uint64_t deadline, const char *what)
{
    const uint64_t t0 = mono_us();
    for (;;) {
        ncclResult_t st = ncclInProgress;
        int rc = 0;
        KVP_NCCL_TRY(n, n->CommGetAsyncError(j->comm->comm, &st), rc, fail);
        if (st == ncclSuccess)
            return 0;
        if (st != ncclInProgress)
            return job_fail(j, KVP_NCCL_FAILED(n, st, what),
                            "NCCL reported an error while %s (peer gone?)", what);
        if (kvp__xfer_mono_ms() > deadline)
            return job_fail(j, KVP_ETIMEDOUT, "timed out while %s", what);
        poll_pause(t0);
        continue;
    fail:
        return job_fail(j, rc, "ncclCommGetAsyncError failed while %s", what);
    }
}

/* Waits until stream s ran what was queued, watching NCCL's async error and the deadline. */
static int wait_on(const kvp_nccl_t *n, kvp_xfer_job_t *j, cudaStream_t s, uint64_t deadline,
                   const char *what)
{
    const uint64_t t0 = mono_us();
    for (;;) {
        cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess)
            return 0;
        if (e != cudaErrorNotReady)
            return job_fail(j, KVP_CUDA_FAILED(e, "cudaStreamQuery"), "CUDA error while %s", what);
        ncclResult_t st = ncclSuccess;
        if (n->CommGetAsyncError(j->comm->comm, &st) == ncclSuccess && st != ncclSuccess &&
            st != ncclInProgress)
            return job_fail(j, KVP_NCCL_FAILED(n, st, what),
                            "NCCL reported an error while %s (peer gone?)", what);
        if (kvp__xfer_mono_ms() > deadline)
            return job_fail(j, KVP_ETIMEDOUT, "timed out while %s", what);
        poll_pause(t0);
    }
}

/* Waits until the communicator's stream ran what was queued. */
static int wait_stream(const kvp_nccl_t *n, kvp_xfer_job_t *j, uint64_t deadline, const char *what)
{
    return wait_on(n, j, j->comm->stream, deadline, what);
}

/* Creates the stream and joins the communicator (rank 0 or 1 of 2). */
static int comm_join(const kvp_nccl_t *n, kvp_xfer_job_t *j, uint64_t deadline)
{
    comm_t *c = j->comm;
    int rc = 0;
    int least = 0, greatest = 0;
    if (j->x->prio)
        (void)cudaDeviceGetStreamPriorityRange(&least, &greatest);
    KVP_CUDA_TRY(cudaStreamCreateWithPriority(&c->stream, cudaStreamNonBlocking, greatest), rc,
                 fail);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0; /* so a peer that never joins costs the deadline, not a thread forever */
    ncclUniqueId id;
    memcpy(&id, c->id, sizeof(id));
    KVP_NCCL_TRY(n, n->CommInitRankConfig(&c->comm, 2, id, c->rank, &cfg), rc, fail);
    return settle(n, j, deadline, "joining the communicator");
fail:
    return job_fail(j, rc, "cannot %s the communicator", "create");
}

/* Queues a send or receive on the communicator's stream, without waiting for it to run. */
static int queue_send_recv(const kvp_nccl_t *n, kvp_xfer_job_t *j, int send, void *buf,
                           size_t bytes, uint64_t deadline, const char *what)
{
    comm_t *c = j->comm;
    const int peer = 1 - c->rank;
    int rc = 0;
    if (send)
        KVP_NCCL_TRY(n, n->Send(buf, bytes, ncclUint8, peer, c->comm, c->stream), rc, fail);
    else
        KVP_NCCL_TRY(n, n->Recv(buf, bytes, ncclUint8, peer, c->comm, c->stream), rc, fail);
    return settle(n, j, deadline, what);
fail:
    return job_fail(j, rc, "NCCL refused the call while %s", what);
}

/* The side stream, the events and two staging buffers of at least `want` bytes (registered
 * with the communicator when j->reg), kept with the communicator for its next transfers. */
static int stage_ready(const kvp_nccl_t *n, kvp_xfer_job_t *j, size_t want)
{
    comm_t *c = j->comm;
    int rc = 0;
    if (!c->side) {
        int least = 0, greatest = 0;
        if (j->x->prio)
            (void)cudaDeviceGetStreamPriorityRange(&least, &greatest);
        KVP_CUDA_TRY(cudaStreamCreateWithPriority(&c->side, cudaStreamNonBlocking, least), rc,
                     fail);
        for (int b = 0; b < (int)NSTAGE; b++) {
            KVP_CUDA_TRY(cudaEventCreateWithFlags(&c->filled[b], cudaEventDisableTiming), rc, fail);
            KVP_CUDA_TRY(cudaEventCreateWithFlags(&c->drained[b], cudaEventDisableTiming), rc,
                         fail);
        }
    }
    if (c->stage_cap >= want && c->stage_reg == j->reg && c->nstage == j->x->nstage)
        return 0;
    kvp__xfer_stage_free(n, c); /* both streams are idle: the last transfer waited for them */
    c->stage_reg = j->reg;
    c->nstage = j->x->nstage;
    for (int b = 0; b < c->nstage; b++) {
        if (j->reg) {
            KVP_NCCL_TRY(n, n->MemAlloc((void **)&c->stage[b], want), rc, fail_alloc);
            KVP_NCCL_TRY(n, n->CommRegister(c->comm, c->stage[b], want, &c->reg_handle[b]), rc,
                         fail_reg);
            if ((rc = settle(n, j, kvp__xfer_mono_ms() + 60000, "registering the staging buffers")))
                return rc;
        } else {
            KVP_CUDA_TRY(cudaMallocAsync((void **)&c->stage[b], want, c->stream), rc, fail_alloc);
        }
    }
    /* allocated in the communicator stream's order: the side stream may use them only once
     * that has run (rare: the cache grows to the largest chunk once) */
    KVP_CUDA_TRY(cudaStreamSynchronize(c->stream), rc, fail);
    c->stage_cap = want;
    return 0;
fail_reg:
    return job_fail(j, rc, "NCCL could not register the %s", "staging buffers");
fail:
    return job_fail(j, rc, "CUDA call failed while setting up the %s", "staging buffers");
fail_alloc:
    return job_fail(j, KVP_ENOMEM, "no device memory for the %s", "staging buffers");
}

/* Queues the pack (into buf) or unpack (out of it) of the stream's bytes [off, off + len) on
 * s through the backend's page-mover, one piece per sequence the range crosses (the stream is
 * the sequences' packed forms one after the other). */
static int queue_pack(kvp_xfer_job_t *j, const int32_t *pages_dev, uint64_t off, uint64_t len,
                      uint8_t *buf, int unpack, cudaStream_t s)
{
    kvp_backend_t *b = j->x->b;
    uint32_t q = 0; /* the sequence holding off */
    while (len) {
        while (off >= j->stream_off[q + 1])
            q++;
        const uint64_t so = off - j->stream_off[q], seq_bytes = j->stream_off[q + 1] - off;
        const uint64_t piece = len < seq_bytes ? len : seq_bytes;
        const kvp_move_t m = {.dir = unpack ? KVP_MOVE_IN : KVP_MOVE_OUT,
                              .pages = j->pages + j->page_off[q],
                              .pages_dev = pages_dev + j->page_off[q],
                              .num_tokens = j->tokens[q],
                              .begin = so,
                              .end = so + piece,
                              .buf = buf,
                              .buf_medium = KVP_MEDIUM_GPU,
                              .stream = s};
        int rc = b->ops->move(b, &m);
        if (rc)
            return job_fail(j, rc, "pack kernel launch failed%s", "");
        buf += piece;
        off += piece;
        len -= piece;
    }
    return 0;
}

/* Debug level only: timing events around every chunk's NCCL call and pack/unpack, so the log
 * shows the GPU timeline of a transfer (where its time goes). */
#define TRACE_MAX 64
typedef struct {
    int n;
    cudaEvent_t t0, ev[TRACE_MAX][4]; /* NCCL begin, end; pack begin, end */
} gpu_trace_t;

static gpu_trace_t *trace_new(cudaStream_t s)
{
    gpu_trace_t *t = calloc(1, sizeof(*t));
    if (t && (cudaEventCreate(&t->t0) != cudaSuccess || cudaEventRecord(t->t0, s) != cudaSuccess)) {
        free(t);
        return NULL;
    }
    return t;
}

static void trace_mark(gpu_trace_t *t, uint64_t k, int which, cudaStream_t s)
{
    if (!t || k >= TRACE_MAX)
        return;
    if (!t->ev[k][which] && cudaEventCreate(&t->ev[k][which]) != cudaSuccess)
        return;
    (void)cudaEventRecord(t->ev[k][which], s);
    if ((int)k >= t->n)
        t->n = (int)k + 1;
}

/* After both streams finished: logs (when the transfer succeeded) each chunk's [begin, end] in
 * us from the start, NCCL call then pack/unpack, and frees the trace. */
static void trace_done(gpu_trace_t *t, const kvp_xfer_job_t *j)
{
    if (!t)
        return;
    if (j->rc)
        goto out;
    char line[2048];
    size_t o = 0;
    for (int k = 0; k < t->n; k++) {
        float v[4] = {0, 0, 0, 0};
        for (int w = 0; w < 4; w++)
            if (t->ev[k][w])
                (void)cudaEventElapsedTime(&v[w], t->t0, t->ev[k][w]);
        int m = snprintf(line + o, sizeof(line) - o, " %d:%.0f-%.0f/%.0f-%.0f", k, v[0] * 1e3,
                         v[1] * 1e3, v[2] * 1e3, v[3] * 1e3);
        if (m < 0 || (size_t)m >= sizeof(line) - o)
            break;
        o += (size_t)m;
    }
    kvp_log(KVP_LOG_DEBUG, "transfer gpu timeline dir=%s us(nccl/pack):%s",
            j->direction == KVP_XFER_EXPORT ? "export" : "import", line);
out:
    for (int k = 0; k < t->n; k++)
        for (int w = 0; w < 4; w++)
            if (t->ev[k][w])
                (void)cudaEventDestroy(t->ev[k][w]);
    (void)cudaEventDestroy(t->t0);
    free(t);
}

/* Queues the chunked, double-buffered move of a stream of `total` bytes in chunks of ch (see
 * the file header); the caller waits for both streams. Exporter: pack on the side stream,
 * send on the communicator's. Importer: receive, then unpack on the side stream; with
 * unpack = 0 the chunks are received and dropped (a refused stream, drained so the
 * communicator stays in step). */
static int move_stream(const kvp_nccl_t *n, kvp_xfer_job_t *j, const int32_t *pages_dev, size_t ch,
                       uint64_t total, int unpack, uint64_t deadline)
{
    comm_t *c = j->comm;
    const int send = j->direction == KVP_XFER_EXPORT;
    int rc = stage_ready(n, j, ch);
    if (rc)
        return rc;
    gpu_trace_t *t = j->trace = kvp_log_enabled(KVP_LOG_DEBUG) ? trace_new(c->stream) : NULL;
    uint64_t len = 0;
    for (uint64_t off = 0, k = 0; off < total; off += len, k++) {
        const int b = (int)(k % (uint64_t)c->nstage);
        len = kvp_xfer_chunk_at(ch, off, total);
        if (send) {
            if (k >= (uint64_t)c->nstage) /* the send of an earlier chunk is done with it */
                KVP_CUDA_TRY(cudaStreamWaitEvent(c->side, c->drained[b], 0), rc, fail);
            trace_mark(t, k, 2, c->side);
            if ((rc = queue_pack(j, pages_dev, off, len, c->stage[b], 0, c->side)))
                return rc;
            trace_mark(t, k, 3, c->side);
            KVP_CUDA_TRY(cudaEventRecord(c->filled[b], c->side), rc, fail);
            KVP_CUDA_TRY(cudaStreamWaitEvent(c->stream, c->filled[b], 0), rc, fail);
            trace_mark(t, k, 0, c->stream);
            if ((rc = queue_send_recv(n, j, 1, c->stage[b], len, deadline, "sending the KV")))
                return rc;
            trace_mark(t, k, 1, c->stream);
            KVP_CUDA_TRY(cudaEventRecord(c->drained[b], c->stream), rc, fail);
        } else if (unpack) {
            if (k >= (uint64_t)c->nstage) /* the unpack of an earlier chunk is done with it */
                KVP_CUDA_TRY(cudaStreamWaitEvent(c->stream, c->drained[b], 0), rc, fail);
            trace_mark(t, k, 0, c->stream);
            if ((rc = queue_send_recv(n, j, 0, c->stage[b], len, deadline, "receiving the KV")))
                return rc;
            trace_mark(t, k, 1, c->stream);
            KVP_CUDA_TRY(cudaEventRecord(c->filled[b], c->stream), rc, fail);
            KVP_CUDA_TRY(cudaStreamWaitEvent(c->side, c->filled[b], 0), rc, fail);
            trace_mark(t, k, 2, c->side);
            if ((rc = queue_pack(j, pages_dev, off, len, c->stage[b], 1, c->side)))
                return rc;
            trace_mark(t, k, 3, c->side);
            KVP_CUDA_TRY(cudaEventRecord(c->drained[b], c->side), rc, fail);
        } else if ((rc = queue_send_recv(n, j, 0, c->stage[b], len, deadline,
                                         "draining a refused stream"))) {
            return rc;
        }
    }
    return 0;
fail:
    return job_fail(j, rc, "CUDA call failed while %s", send ? "sending" : "receiving");
}

/* Waits until both streams ran what was queued. */
static int wait_both(const kvp_nccl_t *n, kvp_xfer_job_t *j, uint64_t deadline, const char *what)
{
    int rc = wait_stream(n, j, deadline, what);
    if (!rc && j->comm->side)
        rc = wait_on(n, j, j->comm->side, deadline, what);
    return rc;
}

/* Copies device -> host on the communicator's stream and waits. (Host -> device copies are
 * only queued: cudaMemcpyAsync from pageable memory has taken the bytes when it returns.) */
static int copy_back(const kvp_nccl_t *n, kvp_xfer_job_t *j, void *dst, const void *src,
                     size_t bytes, uint64_t deadline)
{
    int rc = 0;
    KVP_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, j->comm->stream), rc,
                 fail);
    return wait_stream(n, j, deadline, "copying");
fail:
    return job_fail(j, rc, "CUDA copy failed%s", "");
}

/* Queues a host -> device copy on the communicator's stream. */
static int copy_to(kvp_xfer_job_t *j, void *dst, const void *src, size_t bytes)
{
    int rc = 0;
    KVP_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, j->comm->stream), rc,
                 fail);
    return 0;
fail:
    return job_fail(j, rc, "CUDA copy failed%s", "");
}

/* The transfer on its communicator (see the file header for the protocol). */
static int run_transfer(const kvp_nccl_t *n, kvp_xfer_job_t *j, uint8_t **dev_out)
{
    kvp_backend_t *b = j->x->b;
    int rc = 0;
    if (b->kind != KVP_BACKEND_CUDA || !b->num_device_ids)
        return job_fail(j, KVP_EUNAVAIL, "transfers need the cuda backend%s", "");
    const int ordinal = b->device_ids[0];
    const uint64_t deadline = kvp__xfer_mono_ms() + j->timeout_ms;
    KVP_CUDA_TRY(cudaSetDevice(ordinal), rc, fail_cuda);
    if (!j->comm->comm && (rc = comm_join(n, j, deadline)))
        return rc;
    const uint64_t t_joined = mono_us();
    /* one small device buffer: the header at 0, the outcome at 128, then the page ids (the
     * stream itself goes through the communicator's staging chunks) */
    const size_t pages_off = 256;
    uint8_t *dev = NULL;
    KVP_CUDA_TRY(cudaMallocAsync((void **)&dev, pages_off + j->num_pages * 4u, j->comm->stream), rc,
                 fail_alloc);
    *dev_out = dev;
    const int32_t *pages_dev = (const int32_t *)(dev + pages_off);
    const kvp_geom_t *g = &b->geom;
    wire_hdr_t hdr = {.magic = HDR_MAGIC,
                      .version = HDR_VERSION,
                      .transfer_id = j->transfer_id,
                      .num_tokens = j->num_tokens,
                      .num_layers = g->num_layers,
                      .num_heads = g->num_kv_heads,
                      .head_dim = g->head_dim,
                      .elem_bytes = kvp_dtype_size(g->dtype),
                      .chunk_bytes = (uint32_t)j->chunk,
                      .stream_bytes = j->bytes,
                      .flags = j->reg ? KVP_XFER_REGISTERED : 0u,
                      .num_seqs = j->nseq,
                      .seq_hash = j->seq_hash};
    int64_t outcome = 0;
    uint64_t t_header = 0, t_queued = 0;
    if ((rc = copy_to(j, dev + pages_off, j->pages, j->num_pages * 4u)))
        return rc;
    if (j->direction == KVP_XFER_EXPORT) {
        if ((rc = copy_to(j, dev, &hdr, sizeof(hdr))) ||
            (rc = queue_send_recv(n, j, 1, dev, sizeof(hdr), deadline, "sending the header")))
            return rc;
#ifdef KVP_TEST_HOOKS
        if (j->stall_ms) {
            struct timespec ts = {j->stall_ms / 1000, (long)(j->stall_ms % 1000) * 1000000};
            nanosleep(&ts, NULL);
        }
#endif
        t_header = mono_us();
        if ((rc = move_stream(n, j, pages_dev, j->chunk, j->bytes, 1, deadline)) ||
            (rc = queue_send_recv(n, j, 0, dev + 128, sizeof(outcome), deadline,
                                  "waiting for the importer's outcome")))
            return rc;
        t_queued = mono_us();
        if ((rc = wait_both(n, j, deadline, "sending the KV")) ||
            (rc = copy_back(n, j, &outcome, dev + 128, sizeof(outcome), deadline)))
            return rc;
        if (outcome != 0) {
            j->clean = 1; /* the importer drained the stream: still in step */
            return job_fail(j, KVP_EINVAL, "the importer refused the transfer: %s",
                            kvp_strerror((int)outcome));
        }
    } else {
        /* the whole stream is queued at once, in the ticket's shape: the header first, checked
         * at the end; a stream of another size than this Import's is received and dropped
         * (drained), so the communicator stays in step */
        if (j->reg && !n->CommRegister) /* both sides register, or neither (NCCL's rule) */
            return job_fail(j, KVP_EUNAVAIL, "the exporter registers its staging buffers and %s",
                            "this NCCL cannot (ncclCommRegister, NCCL >= 2.19)");
        const int fits = j->wire.bytes == j->bytes;
        if ((rc = queue_send_recv(n, j, 0, dev, sizeof(hdr), deadline, "waiting for the header")))
            return rc;
        t_header = mono_us();
        if ((rc = move_stream(n, j, pages_dev, j->chunk, j->wire.bytes, fits, deadline)))
            return rc;
        t_queued = mono_us();
        wire_hdr_t got;
        if ((rc = wait_both(n, j, deadline, "receiving the KV")) ||
            (rc = copy_back(n, j, &got, dev, sizeof(got), deadline)))
            return rc;
        if (got.magic != HDR_MAGIC || got.version != HDR_VERSION ||
            got.chunk_bytes != j->wire.chunk_bytes || got.stream_bytes != j->wire.bytes ||
            got.flags != j->wire.flags)
            /* not clean: the ticket was altered, the two sides' calls may not have matched */
            return job_fail(j, KVP_EINVAL, "the exporter's header does not match the %s",
                            "ticket's stream (pass the ticket on unchanged)");
        const char *bad = got.transfer_id != hdr.transfer_id ? "another transfer_id"
                          : got.num_tokens != hdr.num_tokens ? "another token count"
                          : got.num_seqs != hdr.num_seqs     ? "another number of sequences"
                          : got.seq_hash != hdr.seq_hash     ? "another split into sequences"
                          : got.num_layers != hdr.num_layers ? "another layer count"
                          : got.num_heads != hdr.num_heads   ? "another number of kv heads"
                          : got.head_dim != hdr.head_dim     ? "another head_dim"
                          : got.elem_bytes != hdr.elem_bytes ? "another element size"
                          : !fits                            ? "another stream size"
                                                             : NULL;
        /* both streams are idle: the pageable copy does not wait */
        outcome = bad ? KVP_EINVAL : 0;
        if ((rc = copy_to(j, dev + 128, &outcome, sizeof(outcome))) ||
            (rc = queue_send_recv(n, j, 1, dev + 128, sizeof(outcome), deadline,
                                  "sending the outcome")) ||
            (rc = wait_stream(n, j, deadline, "sending the outcome")))
            return rc;
        if (bad) {
            j->clean = 1;
            return job_fail(j, KVP_EINVAL, "the exporter's stream does not match the Import: %s",
                            bad);
        }
    }
    if (kvp_log_enabled(KVP_LOG_DEBUG)) /* where a transfer's time goes */
        kvp_log(KVP_LOG_DEBUG,
                "transfer timing dir=%s bytes=%llu chunk=%zu join_us=%llu header_us=%llu "
                "queue_us=%llu wait_us=%llu",
                j->direction == KVP_XFER_EXPORT ? "export" : "import", (unsigned long long)j->bytes,
                j->chunk, (unsigned long long)(t_joined - j->start_us),
                (unsigned long long)(t_header - t_joined),
                (unsigned long long)(t_queued - t_header),
                (unsigned long long)(mono_us() - t_queued));
    return 0;
fail_cuda:
    return job_fail(j, rc, "CUDA call failed%s", "");
fail_alloc:
    return job_fail(j, KVP_ENOMEM, "no device memory for a %s", "transfer");
}

/* After a failure: abort the communicator (its NCCL kernels then exit) and wait, bounded, for
 * the stream to drain. 1 when it drained (the buffer can be freed), else 0: the stream and the
 * buffer are then leaked rather than freed under a kernel that may still run. */
static int abort_and_drain(const kvp_nccl_t *n, kvp_xfer_job_t *j)
{
    comm_t *c = j->comm;
    c->broken = 1;
    if (c->comm) {
        (void)n->CommAbort(c->comm);
        c->comm = NULL;
    }
    if (!c->stream)
        return 1;
    const uint64_t until = kvp__xfer_mono_ms() + DRAIN_MS;
    cudaError_t e;
    while (((e = cudaStreamQuery(c->stream)) == cudaErrorNotReady ||
            (c->side && cudaStreamQuery(c->side) == cudaErrorNotReady)) &&
           kvp__xfer_mono_ms() < until) {
        struct timespec ts = {0, 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (e == cudaSuccess && (!c->side || cudaStreamQuery(c->side) == cudaSuccess))
        return 1;
    kvp_log(KVP_LOG_ERR, "transfer stream did not drain after the abort; its buffer is leaked");
    c->stream = NULL; /* leaked with it */
    return 0;
}

void kvp_xfer_run(kvp_xfer_job_t *j)
{
    const kvp_nccl_t *n;
    j->msg[0] = '\0';
    if (kvp_nccl_get(&n, j->msg, sizeof(j->msg))) {
        j->rc = KVP_EUNAVAIL;
        return;
    }
    uint8_t *dev = NULL;
    j->start_us = mono_us();
    j->rc = run_transfer(n, j, &dev);
    trace_done(j->trace, j);
    j->trace = NULL;
    int can_free = 1;
    if (j->rc && !j->clean)
        can_free = abort_and_drain(n, j);
    comm_t *c = j->comm;
    if (dev && can_free && c->stream) {
        /* stream-ordered, so no device-wide synchronisation (a cudaFree would wait for every
         * stream of the device, other transfers' waits for their peers included) */
        if (cudaFreeAsync(dev, c->stream) != cudaSuccess ||
            cudaStreamSynchronize(c->stream) != cudaSuccess)
            kvp_log(KVP_LOG_ERR, "transfer buffer free failed");
    }
    if (c->broken && c->stream) {
        if (can_free) /* the streams drained: the staging chunks can go with the stream */
            kvp__xfer_stage_free(n, c);
        c->stage_cap = 0;
        if (can_free)
            (void)cudaStreamSynchronize(c->stream);
        (void)cudaStreamDestroy(c->stream);
        c->stream = NULL;
    }
}

#else /* !KVP_HAVE_NCCL */

void kvp_xfer_run(kvp_xfer_job_t *j)
{
    snprintf(j->msg, sizeof(j->msg), "built without NCCL support");
    j->rc = KVP_EUNAVAIL;
}

#endif
