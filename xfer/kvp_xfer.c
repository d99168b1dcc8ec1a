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
#include "kvp_xfer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "kvp_error.h"
#include "kvp_kernels.h"
#include "kvp_log.h"
#include "kvp_nccl.h"
#ifdef KVP_TEST_HOOKS
#include "kvp_knob.h"
#endif

#ifdef KVP_HAVE_NCCL
#include "kvp_cuda_util.h"
#include "kvp_kernels_cuda.h"
#endif

#define MAX_TIMEOUT_MS 3600000u
#define HDR_MAGIC      0x5850564bu /* "KVPX" little-endian */
#define HDR_VERSION    2u
#define DRAIN_MS       10000u       /* longest wait for an aborted transfer's stream */
#define CHUNK_AUTO_MAX (256u << 20) /* automatic largest chunk (staging: 2 per side per comm) */
#define CHUNK_AUTO_MIN (4u << 20)
#define CHUNK_TAIL     (4u << 20) /* the schedule's smallest chunk (kvp_xfer_chunk_at) */
#define CHUNK_LIMIT    (1u << 30) /* transfer.chunk_bytes's maximum; an importer refuses more */
#define NSTAGE         4u         /* most staging chunks per side ([tuning] xfer_stages: 2..4) */
#define SPIN_US        20000u     /* a wait spins this long, then naps (see poll_pause) */

typedef struct comm {
    struct comm *next;
    uint8_t id[KVP_XFER_ID_BYTES];
    char peer[65];
    int rank; /* 0 exporter, 1 importer */
    int busy; /* a job holds it */
    int broken;
    uint64_t last_used_ms;
#ifdef KVP_HAVE_NCCL
    ncclComm_t comm; /* NULL until the first transfer joins */
    cudaStream_t stream;
    cudaStream_t side;                           /* pack / unpack of the chunks */
    cudaEvent_t filled[NSTAGE], drained[NSTAGE]; /* staging buffer b: packed or received; sent or
                                                    unpacked */
    uint8_t *stage[NSTAGE]; /* the staging chunks (device memory), stage_cap each */
    int nstage;             /* how many of them exist */
    size_t stage_cap;
    int stage_reg;            /* the chunks come from ncclMemAlloc, registered with the comm */
    void *reg_handle[NSTAGE]; /* their ncclCommRegister handles */
#endif
} comm_t;

struct kvp_xfer_job {
    kvp_xfer_t *x;
    struct kvp_xfer_job *next; /* running list */
    comm_t *comm;
    int direction;
    uint64_t transfer_id;
    uint32_t num_tokens, num_pages; /* of the whole set */
    uint32_t nseq;                  /* sequences in the set */
    uint32_t *tokens;               /* [nseq] */
    uint32_t *page_off;             /* [nseq + 1]: sequence i's pages start at pages[page_off[i]] */
    uint64_t *stream_off;           /* [nseq + 1]: its stream bytes start at stream_off[i] */
    uint32_t seq_hash;              /* kvp_xfer_set_hash of tokens */
    int32_t *pages;
    uint64_t bytes;
    uint32_t timeout_ms;
#ifdef KVP_TEST_HOOKS
    uint32_t stall_ms; /* test hook, exporter only */
#endif
    size_t chunk;           /* staging chunk bytes: the exporter's choice, the header's on import */
    int reg;                /* staging registered with NCCL: the exporter's choice, the ticket's */
    kvp_xfer_stream_t wire; /* import: the stream's shape as the ticket gives it */
    void *trace;            /* gpu_trace_t at debug level */
    uint64_t start_us;      /* when the worker thread took it (timing log) */
    int clean;              /* the failure was a refusal both sides agreed on: the communicator is
                               still in step and stays cached */
    int rc;
    char msg[128];
    kvp_xfer_info_t info;
};

struct kvp_xfer {
    kvp_backend_t *b;
    kvp_xfer_config_t cfg;
    comm_t *comms;
    kvp_xfer_job_t *running;
    uint32_t in_flight;
    kvp_xfer_info_t hist[KVP_XFER_HISTORY];
    uint32_t hist_next, hist_count;
    uint64_t totals[2][2], bytes[2];
    uint64_t next_id;
#ifdef KVP_TEST_HOOKS
    uint32_t stall_ms;   /* test hook: the exporter pauses after the header */
    uint32_t chunk_test; /* test hook: overrides transfer.chunk_bytes (else 0) */
#endif
    int reg;              /* b->tuning.xfer_register: register the staging chunks with NCCL */
    int prio;             /* b->tuning.xfer_priority: NCCL's stream high, pack's low */
    int nstage;           /* staging chunks per side: b->tuning.xfer_stages, default 2 */
    uint32_t pack_blocks; /* b->tuning.pack_blocks: the pack kernels' grid cap, 0: automatic */
};

/* The first message of every transfer. */
typedef struct {
    uint32_t magic, version;
    uint64_t transfer_id;
    uint32_t num_tokens, num_layers, num_heads, head_dim, elem_bytes, chunk_bytes;
    uint64_t stream_bytes;
    uint32_t flags;    /* KVP_XFER_REGISTERED: the importer registers its staging chunks too */
    uint32_t num_seqs; /* a set: its sequences, one stream after the other */
    uint32_t seq_hash; /* of their token counts (kvp_xfer_set_hash) */
    uint8_t reserved[4];
} wire_hdr_t;
_Static_assert(sizeof(wire_hdr_t) == 64, "the header is 64 bytes on the wire");

static uint64_t mono_ms(void)
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
    if (t->xfer_stages == 1 || t->xfer_stages > NSTAGE || t->pack_blocks > KVP_PACK_CUDA_MAX_BLOCKS)
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
        x->next_id = (uint64_t)mono_ms() * 2654435761u;
    x->next_id |= 1;
    x->reg = t->xfer_register;
    x->prio = t->xfer_priority;
    x->nstage = t->xfer_stages ? (int)t->xfer_stages : 2;
    x->pack_blocks = t->pack_blocks;
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

#ifdef KVP_HAVE_NCCL
/* Frees the staging chunks (their streams have drained): deregistered and ncclMemFree'd when
 * registered, else stream-ordered on the communicator's stream (leaked with a leaked stream). */
static void stage_free(const kvp_nccl_t *n, comm_t *c)
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
#endif

static void comm_free(comm_t *c)
{
#ifdef KVP_HAVE_NCCL
    const kvp_nccl_t *n;
    if (kvp_nccl_get(&n, NULL, 0) == 0) {
        stage_free(n, c);
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

/* ---- the transfer itself (worker thread) ----------------------------------------------- */

#ifdef KVP_HAVE_NCCL

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
        if (mono_ms() > deadline)
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
        if (mono_ms() > deadline)
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
    stage_free(n, c); /* both streams are idle: the last transfer waited for them */
    c->stage_reg = j->reg;
    c->nstage = j->x->nstage;
    for (int b = 0; b < c->nstage; b++) {
        if (j->reg) {
            KVP_NCCL_TRY(n, n->MemAlloc((void **)&c->stage[b], want), rc, fail_alloc);
            KVP_NCCL_TRY(n, n->CommRegister(c->comm, c->stage[b], want, &c->reg_handle[b]), rc,
                         fail_reg);
            if ((rc = settle(n, j, mono_ms() + 60000, "registering the staging buffers")))
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

/* Queues on stream s the pack (unpack = 0) or unpack of stream bytes [off, off + len) between
 * the pool's pages and buf: the range may span layers and sequences of the set. */
static int queue_pack(kvp_xfer_job_t *j, void *pool, const int32_t *pages_dev, uint64_t off,
                      uint64_t len, uint8_t *buf, int unpack, cudaStream_t s)
{
    kvp_backend_t *b = j->x->b;
    uint32_t q = 0; /* the sequence holding off */
    while (len) {
        while (off >= j->stream_off[q + 1])
            q++;
        const uint64_t lb = (j->stream_off[q + 1] - j->stream_off[q]) / b->geom.num_layers;
        const uint64_t so = off - j->stream_off[q];
        const uint32_t l = (uint32_t)(so / lb);
        const uint64_t o = so % lb, piece = len < lb - o ? len : lb - o;
        const int32_t *pg = pages_dev + j->page_off[q];
        kvp_paged_kv_t kv;
        kvp_backend_layer_view(b, pool, l, &kv);
        const kvp_pack_cuda_opts_t po = {.max_blocks = j->x->pack_blocks};
        int rc = unpack
                     ? kvp_kv_unpack_range_cuda_ex(&kv, pg, j->tokens[q], o, o + piece, buf, &po, s)
                     : kvp_kv_pack_range_cuda_ex(&kv, pg, j->tokens[q], o, o + piece, buf, &po, s);
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
static int move_stream(const kvp_nccl_t *n, kvp_xfer_job_t *j, void *pool, const int32_t *pages_dev,
                       size_t ch, uint64_t total, int unpack, uint64_t deadline)
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
            if ((rc = queue_pack(j, pool, pages_dev, off, len, c->stage[b], 0, c->side)))
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
            if ((rc = queue_pack(j, pool, pages_dev, off, len, c->stage[b], 1, c->side)))
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
    int ordinal, rc = 0;
    void *pool;
    if (kvp_backend_cuda_device(b, 0, &ordinal, &pool))
        return job_fail(j, KVP_EUNAVAIL, "transfers need the cuda backend%s", "");
    const uint64_t deadline = mono_ms() + j->timeout_ms;
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
        if ((rc = move_stream(n, j, pool, pages_dev, j->chunk, j->bytes, 1, deadline)) ||
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
        if ((rc = move_stream(n, j, pool, pages_dev, j->chunk, j->wire.bytes, fits, deadline)))
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
    const uint64_t until = mono_ms() + DRAIN_MS;
    cudaError_t e;
    while (((e = cudaStreamQuery(c->stream)) == cudaErrorNotReady ||
            (c->side && cudaStreamQuery(c->side) == cudaErrorNotReady)) &&
           mono_ms() < until) {
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
            stage_free(n, c);
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
