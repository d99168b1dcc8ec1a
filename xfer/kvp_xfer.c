/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_xfer.c - KV transfers between daemons over NCCL (see kvp_xfer.h for the contract).
 *
 * One transfer on its communicator, in order on both sides (so a cached communicator stays in
 * step). Protocol version 2, one way until the end:
 *   exporter: header (64 bytes: transfer id, tokens, sequences and a hash of their split,
 *             layers, heads, head_dim, element size, chunk bytes, stream bytes, flags), then
 *             the stream in chunks, then it receives the importer's 8-byte outcome (0 or the
 *             refusal's code);
 *   importer: queues the header's receive and the whole stream at once, in the shape the
 *             ticket carries from ExportBegin (stream bytes, largest chunk, flags), unpacking
 *             into its new pages (or, when the size differs from its Import's, dropping the
 *             chunks in staging so the communicator stays in step); at the end it checks the
 *             header against its Import and sends the outcome.
 * Before, the exporter waited for an answer before the stream, and the importer for the
 * header before it queued the stream: round trips on the critical path of every transfer
 * (~0.3 ms each on 2 x H200, where an NCCL call on a non-blocking communicator costs ~100 us of
 * host time).
 *
 * The stream moves through two staging buffers per side, cached with the communicator: the
 * exporter packs chunk c+1 (on a side stream) while NCCL sends chunk c, the importer unpacks
 * chunk c into its new pages while chunk c+1 arrives, so the transfer runs at NCCL's
 * point-to-point rate instead of pack + send + unpack one after the other (measured on
 * 2 x H200: 0.25 of NCCL's rate unpipelined). The chunks follow kvp_xfer_chunk_at's schedule.
 * Everything is queued on the streams before the worker waits; the waits spin (poll_pause). A
 * transfer that fails may have written some of the importer's new pages; the dispatch frees
 * them, so the pool is exactly as before. Every wait polls the streams and
 * ncclCommGetAsyncError against the deadline; on an error or the deadline the communicator is
 * aborted (ncclCommAbort) and dropped.
 */
#include "kvp_xfer_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "kvp_error.h"
#include "kvp_kernels.h"
#include "kvp_log.h"
#ifdef KVP_TEST_HOOKS
#include "kvp_knob.h"
#endif

uint64_t kvp__xfer_mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ---- pure parts --------------------------------------------------------------------------- */

size_t kvp_xfer_chunk_bytes(uint32_t setting, uint64_t stream_bytes)
{
    uint64_t c = setting;
    if (!c) { /* automatic: a quarter (the schedule ramps down from it at the end) */
        c = stream_bytes / 4;
        c = c < CHUNK_AUTO_MIN ? CHUNK_AUTO_MIN : c > CHUNK_AUTO_MAX ? CHUNK_AUTO_MAX : c;
    }
    c = c > CHUNK_LIMIT ? CHUNK_LIMIT : c;
    const uint64_t whole = (stream_bytes + 255u) & ~(uint64_t)255u;
    c = (c + 255u) & ~(uint64_t)255u;
    return (size_t)(c < whole ? c : whole);
}

size_t kvp_xfer_chunk_at(size_t chunk_max, uint64_t off, uint64_t total)
{
    const uint64_t r = total - off, floor = chunk_max < CHUNK_TAIL ? chunk_max : CHUNK_TAIL;
    uint64_t c = chunk_max;
    const uint64_t up = off > chunk_max / 8 ? off : chunk_max / 8;
    c = c > up ? up : c;       /* ramp up: the first pack is short */
    c = c > r / 2 ? r / 2 : c; /* ramp down: the last unpack is short */
    c = c < floor ? floor : c;
    c = (c + 255u) & ~(uint64_t)255u;
    return (size_t)(c < r ? c : r);
}

uint64_t kvp_xfer_stream_bytes(const kvp_geom_t *g, uint32_t num_tokens)
{
    return (uint64_t)g->num_layers * kvp_kv_packed_layer_bytes(num_tokens, g->num_kv_heads,
                                                               g->head_dim,
                                                               kvp_dtype_size(g->dtype));
}

int kvp_xfer_check_stream(const kvp_xfer_stream_t *st, char *why, size_t why_len)
{
    if (!st->bytes) {
        snprintf(why, why_len, "bytes 0: pass the bytes ExportBegin answered");
        return KVP_EINVAL;
    }
    if (st->chunk_bytes < 256 || st->chunk_bytes > CHUNK_LIMIT || st->chunk_bytes % 256) {
        snprintf(why, why_len,
                 "chunk_bytes %u: pass the chunk_bytes ExportBegin answered (a multiple of 256 "
                 "in 256..%u)",
                 st->chunk_bytes, CHUNK_LIMIT);
        return KVP_EINVAL;
    }
    if (st->flags & ~KVP_XFER_REGISTERED) {
        snprintf(why, why_len, "flags %#x: pass the flags ExportBegin answered", st->flags);
        return KVP_EINVAL;
    }
    return 0;
}

uint32_t kvp_xfer_set_hash(const uint32_t *tokens, uint32_t n)
{
    uint32_t h = 2166136261u; /* FNV-1a over the counts' little-endian bytes */
    for (uint32_t i = 0; i < n; i++)
        for (int b = 0; b < 4; b++)
            h = (h ^ ((tokens[i] >> (8 * b)) & 0xffu)) * 16777619u;
    return h;
}

int kvp_xfer_check_export(const kvp_geom_t *g, uint32_t num_tokens, uint32_t timeout_ms, char *why,
                          size_t why_len)
{
    (void)g;
    if (num_tokens == 0) {
        snprintf(why, why_len, "the sequence holds no tokens");
        return KVP_EPRECOND;
    }
    if (timeout_ms > MAX_TIMEOUT_MS) {
        snprintf(why, why_len, "timeout_ms %u above %u", timeout_ms, MAX_TIMEOUT_MS);
        return KVP_EINVAL;
    }
    return 0;
}

int kvp_xfer_check_import(const kvp_geom_t *g, uint32_t id_len, uint64_t transfer_id,
                          uint32_t num_tokens, uint32_t max_tokens, uint32_t num_layers,
                          uint32_t timeout_ms, char *why, size_t why_len)
{
    if (id_len != KVP_XFER_ID_BYTES) {
        snprintf(why, why_len, "nccl_id has %u bytes, must be %u (as ExportBegin answered)", id_len,
                 KVP_XFER_ID_BYTES);
        return KVP_EINVAL;
    }
    if (transfer_id == 0) {
        snprintf(why, why_len, "transfer_id 0: pass the id ExportBegin answered");
        return KVP_EINVAL;
    }
    if (num_tokens == 0 || num_tokens > max_tokens) {
        snprintf(why, why_len, "num_tokens %u outside 1..%u", num_tokens, max_tokens);
        return KVP_EINVAL;
    }
    if (num_layers != g->num_layers) {
        snprintf(why, why_len, "num_layers %u: this pool has %u layers", num_layers, g->num_layers);
        return KVP_EINVAL;
    }
    if (timeout_ms > MAX_TIMEOUT_MS) {
        snprintf(why, why_len, "timeout_ms %u above %u", timeout_ms, MAX_TIMEOUT_MS);
        return KVP_EINVAL;
    }
    return 0;
}

int kvp_xfer_create(kvp_backend_t *b, const kvp_xfer_config_t *cfg, kvp_xfer_t **out)
{
    if (!b || !cfg || !out || !cfg->max_in_flight || !cfg->timeout_ms)
        return KVP_EINVAL;
    const kvp_backend_tuning_t *t = &b->tuning; /* the daemon's [tuning] */
    if (t->xfer_stages == 1 || t->xfer_stages > NSTAGE)
        return KVP_EINVAL;
#ifdef KVP_TEST_HOOKS
    /* test hooks (kvpoold-test; tests/gpu/test_multigpu_xfer.c, run_multigpu.sh): the exporter
     * pauses between the header exchange and the payload, so a test can kill it mid-transfer;
     * small chunks make every transfer span many */
    uint64_t stall = 0, chunk = 0;
    char why[200];
    if (kvp_knob_env_u64("KVPOOL_XFER_TEST_STALL_MS", 0, 3600000, &stall, why, sizeof(why)) < 0 ||
        kvp_knob_env_u64("KVPOOL_XFER_TEST_CHUNK_BYTES", 0, CHUNK_LIMIT, &chunk, why, sizeof(why)) <
            0) {
        kvp_log(KVP_LOG_ERR, "transfer test hook refused reason=\"%s\"", why);
        return KVP_EINVAL;
    }
#endif
    kvp_xfer_t *x = calloc(1, sizeof(*x));
    if (!x)
        return KVP_ENOMEM;
    x->b = b;
    x->cfg = *cfg;
    /* transfer ids are unique across daemons and restarts: a random start, counted up */
    if (getrandom(&x->next_id, sizeof(x->next_id), 0) != sizeof(x->next_id))
        x->next_id = (uint64_t)kvp__xfer_mono_ms() * 2654435761u;
    x->next_id |= 1;
    x->reg = t->xfer_register;
    x->prio = t->xfer_priority;
    x->nstage = t->xfer_stages ? (int)t->xfer_stages : 2;
#ifdef KVP_TEST_HOOKS
    x->stall_ms = (uint32_t)stall;
    x->chunk_test = (uint32_t)chunk;
#endif
    *out = x;
    return 0;
}

void kvp_xfer_set_config(kvp_xfer_t *x, const kvp_xfer_config_t *cfg)
{
    x->cfg.timeout_ms = cfg->timeout_ms ? cfg->timeout_ms : x->cfg.timeout_ms;
    x->cfg.comm_idle_ms = cfg->comm_idle_ms;
    x->cfg.chunk_bytes = cfg->chunk_bytes;
}

int kvp_xfer_check_ready(kvp_xfer_t *x, char *why, size_t why_len)
{
    if (x->b->kind != KVP_BACKEND_CUDA) {
        snprintf(why, why_len, "transfers need the cuda backend (this daemon runs %s)",
                 x->b->ops->name);
        return KVP_EUNAVAIL;
    }
    if ((x->b->geom.num_devices ? x->b->geom.num_devices : 1) != 1) {
        snprintf(why, why_len, "transfers of a pool over %u devices are not supported yet",
                 x->b->geom.num_devices);
        return KVP_EPRECOND;
    }
    const kvp_nccl_t *n;
    char r[200];
    if (kvp_nccl_get(&n, r, sizeof(r))) {
        snprintf(why, why_len, "NCCL unavailable: %s", r);
        return KVP_EUNAVAIL;
    }
    if (x->in_flight >= x->cfg.max_in_flight) {
        snprintf(why, why_len, "%u transfers in flight (transfer.max_in_flight)", x->in_flight);
        return KVP_ELIMIT;
    }
    return 0;
}

/* ---- communicator cache (loop thread) -------------------------------------------------- */

static void comm_free(comm_t *c)
{
#ifdef KVP_HAVE_NCCL
    const kvp_nccl_t *n;
    if (kvp_nccl_get(&n, NULL, 0) == 0) {
        kvp__xfer_stage_free(n, c);
        if (c->comm)
            (void)n->CommAbort(c->comm); /* local teardown; the peer drops its end on its own */
    }
    for (int b = 0; b < (int)NSTAGE; b++) {
        if (c->filled[b])
            (void)cudaEventDestroy(c->filled[b]);
        if (c->drained[b])
            (void)cudaEventDestroy(c->drained[b]);
    }
    if (c->side)
        (void)cudaStreamDestroy(c->side);
    if (c->stream)
        (void)cudaStreamDestroy(c->stream);
#endif
    free(c);
}

static void comm_unlink(kvp_xfer_t *x, comm_t *c)
{
    for (comm_t **pp = &x->comms; *pp; pp = &(*pp)->next)
        if (*pp == c) {
            *pp = c->next;
            return;
        }
}

void kvp_xfer_destroy(kvp_xfer_t *x)
{
    if (!x)
        return;
    while (x->comms) {
        comm_t *c = x->comms;
        x->comms = c->next;
        comm_free(c);
    }
    free(x);
}

uint64_t kvp_xfer_sweep(kvp_xfer_t *x, uint64_t now_ms)
{
    uint64_t next = UINT64_MAX;
    for (comm_t **pp = &x->comms; *pp;) {
        comm_t *c = *pp;
        uint64_t due = c->last_used_ms + x->cfg.comm_idle_ms;
        if (!c->busy && (c->broken || now_ms >= due)) {
            *pp = c->next;
            kvp_log(KVP_LOG_INFO, "transfer communicator dropped peer=%s rank=%d reason=%s",
                    c->peer[0] ? c->peer : "-", c->rank, c->broken ? "error" : "idle");
            comm_free(c);
            continue;
        }
        if (!c->busy && due < next)
            next = due;
        pp = &c->next;
    }
    return next;
}

static void job_free(kvp_xfer_job_t *j)
{
    if (!j)
        return;
    free(j->pages);
    free(j->tokens);
    free(j->page_off);
    free(j->stream_off);
    free(j);
}

static kvp_xfer_job_t *job_new(kvp_xfer_t *x, comm_t *c, int direction, uint64_t transfer_id,
                               const char *peer, const char *ns, const kvp_xfer_set_t *set,
                               uint32_t timeout_ms, uint64_t now_ms)
{
    const uint32_t P = x->b->geom.page_size, n = set->n;
    kvp_xfer_job_t *j = calloc(1, sizeof(*j));
    if (!j)
        return NULL;
    j->tokens = malloc((size_t)n * sizeof(uint32_t));
    j->page_off = malloc(((size_t)n + 1) * sizeof(uint32_t));
    j->stream_off = malloc(((size_t)n + 1) * sizeof(uint64_t));
    uint64_t np = 0;
    for (uint32_t i = 0; i < n; i++)
        np += kvp_geom_pages_for(P, set->tokens[i]);
    j->pages = malloc((size_t)np * sizeof(int32_t) + 4);
    if (!j->tokens || !j->page_off || !j->stream_off || !j->pages) {
        job_free(j);
        return NULL;
    }
    j->nseq = n;
    j->page_off[0] = 0;
    j->stream_off[0] = 0;
    uint64_t tokens = 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t pi = kvp_geom_pages_for(P, set->tokens[i]);
        for (uint32_t k = 0; k < pi; k++)
            j->pages[j->page_off[i] + k] = (int32_t)set->pages[i][k];
        j->tokens[i] = set->tokens[i];
        j->page_off[i + 1] = j->page_off[i] + pi;
        j->stream_off[i + 1] = j->stream_off[i] + kvp_xfer_stream_bytes(&x->b->geom, j->tokens[i]);
        tokens += set->tokens[i];
    }
    j->x = x;
    j->comm = c;
    j->direction = direction;
    j->transfer_id = transfer_id;
    j->num_tokens = (uint32_t)tokens; /* the dispatch bounds the sum */
    j->num_pages = (uint32_t)np;
    j->seq_hash = kvp_xfer_set_hash(j->tokens, n);
    j->bytes = j->stream_off[n];
    j->timeout_ms = timeout_ms ? timeout_ms : x->cfg.timeout_ms;
#ifdef KVP_TEST_HOOKS
    j->stall_ms = direction == KVP_XFER_EXPORT ? x->stall_ms : 0;
    j->chunk = kvp_xfer_chunk_bytes(x->chunk_test ? x->chunk_test : x->cfg.chunk_bytes, j->bytes);
#else
    j->chunk = kvp_xfer_chunk_bytes(x->cfg.chunk_bytes, j->bytes);
#endif
    j->rc = KVP_EINTERNAL; /* until run: a job that never ran counts as failed */
    snprintf(j->msg, sizeof(j->msg), "the transfer never ran");
    kvp_xfer_info_t *in = &j->info;
    in->transfer_id = transfer_id;
    in->direction = direction;
    snprintf(in->peer, sizeof(in->peer), "%s", peer ? peer : "");
    snprintf(in->ns, sizeof(in->ns), "%s", ns ? ns : "");
    in->seq_id = set->seq_ids[0];
    in->num_seqs = n;
    in->num_tokens = j->num_tokens;
    in->bytes = j->bytes;
    in->start_ms = now_ms;
    c->busy = 1;
    j->next = x->running;
    x->running = j;
    x->in_flight++;
    return j;
}

int kvp_xfer_export_begin(kvp_xfer_t *x, const char *peer, const char *ns,
                          const kvp_xfer_set_t *set, uint32_t timeout_ms, uint64_t now_ms,
                          uint8_t id_out[KVP_XFER_ID_BYTES], uint64_t *transfer_id,
                          kvp_xfer_stream_t *stream, kvp_xfer_job_t **out)
{
#ifdef KVP_HAVE_NCCL
    const kvp_nccl_t *n;
    int rc = kvp_nccl_get(&n, NULL, 0);
    if (rc)
        return rc;
    kvp_xfer_sweep(x, now_ms);
    comm_t *c = NULL;
    for (comm_t *k = x->comms; k && !c; k = k->next)
        if (k->rank == 0 && !k->busy && !k->broken && k->comm && strcmp(k->peer, peer) == 0 &&
            now_ms < k->last_used_ms + x->cfg.comm_idle_ms / 2)
            c = k; /* the importer still holds its end: reuse */
    if (!c) {
        if (!(c = calloc(1, sizeof(*c))))
            return KVP_ENOMEM;
        ncclUniqueId id;
        KVP_NCCL_TRY(n, n->GetUniqueId(&id), rc, fail_new);
        memcpy(c->id, &id, sizeof(id));
        snprintf(c->peer, sizeof(c->peer), "%s", peer);
        c->rank = 0;
        c->last_used_ms = now_ms;
        c->next = x->comms;
        x->comms = c;
    }
    uint64_t tid = x->next_id;
    x->next_id += 2;
    kvp_xfer_job_t *j = job_new(x, c, KVP_XFER_EXPORT, tid, peer, ns, set, timeout_ms, now_ms);
    if (!j) {
        c->busy = 0;
        return KVP_ENOMEM;
    }
    j->reg = x->reg && n->CommRegister != NULL;
    memcpy(id_out, c->id, KVP_XFER_ID_BYTES);
    *transfer_id = tid;
    stream->bytes = j->bytes;
    stream->chunk_bytes = (uint32_t)j->chunk;
    stream->flags = j->reg ? KVP_XFER_REGISTERED : 0u;
    *out = j;
    return 0;
fail_new:
    free(c);
    return rc;
#else
    (void)x, (void)peer, (void)ns, (void)set, (void)stream;
    (void)timeout_ms, (void)now_ms, (void)id_out, (void)transfer_id, (void)out;
    return KVP_EUNAVAIL;
#endif
}

int kvp_xfer_import_begin(kvp_xfer_t *x, const uint8_t id[KVP_XFER_ID_BYTES], uint64_t transfer_id,
                          const char *ns, const kvp_xfer_set_t *set,
                          const kvp_xfer_stream_t *stream, uint32_t timeout_ms, uint64_t now_ms,
                          kvp_xfer_job_t **out)
{
    kvp_xfer_sweep(x, now_ms);
    comm_t *c = NULL;
    for (comm_t *k = x->comms; k && !c; k = k->next)
        if (k->rank == 1 && memcmp(k->id, id, KVP_XFER_ID_BYTES) == 0)
            c = k;
    if (c && c->busy)
        return KVP_EBUSY;
    if (!c) {
        if (!(c = calloc(1, sizeof(*c))))
            return KVP_ENOMEM;
        memcpy(c->id, id, KVP_XFER_ID_BYTES);
        c->rank = 1;
        c->last_used_ms = now_ms;
        c->next = x->comms;
        x->comms = c;
    }
    kvp_xfer_job_t *j =
        job_new(x, c, KVP_XFER_IMPORT, transfer_id, "", ns, set, timeout_ms, now_ms);
    if (!j) {
        c->busy = 0;
        return KVP_ENOMEM;
    }
    j->wire = *stream;
    j->chunk = stream->chunk_bytes;
    j->reg = (stream->flags & KVP_XFER_REGISTERED) != 0;
    *out = j;
    return 0;
}

int kvp_xfer_finish(kvp_xfer_t *x, kvp_xfer_job_t *j, uint64_t now_ms, char *msg, size_t msg_len)
{
    for (kvp_xfer_job_t **pp = &x->running; *pp; pp = &(*pp)->next)
        if (*pp == j) {
            *pp = j->next;
            break;
        }
    x->in_flight--;
    comm_t *c = j->comm;
    c->busy = 0;
    c->last_used_ms = now_ms;
    if (c->broken) {
        comm_unlink(x, c);
        comm_free(c);
    }
    const int d = j->direction;
    x->totals[d][j->rc ? 1 : 0]++;
    if (!j->rc)
        x->bytes[d] += j->bytes;
    kvp_xfer_info_t *in = &j->info;
    in->state = j->rc ? 2 : 1;
    in->end_ms = now_ms;
    snprintf(in->message, sizeof(in->message), "%s", j->rc ? j->msg : "");
    x->hist[x->hist_next] = *in;
    x->hist_next = (x->hist_next + 1) % KVP_XFER_HISTORY;
    if (x->hist_count < KVP_XFER_HISTORY)
        x->hist_count++;
    kvp_log(j->rc ? KVP_LOG_WARNING : KVP_LOG_INFO,
            "transfer %s direction=%s transfer_id=%llu seqs=%u tokens=%u bytes=%llu ms=%llu%s%s%s",
            j->rc ? "failed" : "done", d ? "import" : "export", (unsigned long long)j->transfer_id,
            j->nseq, j->num_tokens, (unsigned long long)j->bytes,
            (unsigned long long)(now_ms - in->start_ms), j->rc ? " reason=\"" : "",
            j->rc ? j->msg : "", j->rc ? "\"" : "");
    int rc = j->rc;
    if (msg && msg_len)
        snprintf(msg, msg_len, "%s", j->msg);
    job_free(j);
    return rc;
}

uint32_t kvp_xfer_list(const kvp_xfer_t *x, kvp_xfer_info_t *out, uint32_t max)
{
    uint32_t n = 0;
    for (const kvp_xfer_job_t *j = x->running; j && n < max; j = j->next)
        out[n++] = j->info;
    for (uint32_t k = 0; k < x->hist_count && n < max; k++)
        out[n++] = x->hist[(x->hist_next + KVP_XFER_HISTORY - 1 - k) % KVP_XFER_HISTORY];
    return n;
}

void kvp_xfer_counters(const kvp_xfer_t *x, uint64_t totals[2][2], uint64_t bytes[2],
                       uint32_t *in_flight, uint32_t *comms)
{
    memcpy(totals, x->totals, sizeof(x->totals));
    memcpy(bytes, x->bytes, sizeof(x->bytes));
    *in_flight = x->in_flight;
    uint32_t k = 0;
    for (const comm_t *c = x->comms; c; c = c->next)
        k++;
    *comms = k;
}
