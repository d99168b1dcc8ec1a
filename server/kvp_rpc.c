/*
 * kvp_rpc.c - the daemon's state and the pure dispatch (see kvp_rpc.h). One function per call,
 * each validating its request before touching anything, so a bad request gets a status and
 * changes nothing.
 */
#include "kvp_rpc.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_utf8.h"
#include "kvp_log.h"
#include "kvp_xfer.h"

#ifndef KVP_VERSION
#define KVP_VERSION "0.1.0"
#endif

#define NUM_CALLS 43 /* Request body tags 2..17, and 40..42 (transfers) */
#define NUM_CODES 15
/* Latency histograms: upper bounds 1 us * 2^k for k = 0..20 (1 us .. about 1.05 s), then +Inf.
 * Powers of two keep the bucket search a shift loop, and 21 finite bounds cover a Ping on a
 * quiet machine as well as a large host-backend Append, so percentiles read from the histogram
 * (kvpoolctl top) stay within a factor of two everywhere. */
#define NUM_BUCKETS 22

struct kvp_rpc_job {
    kvp_rpc_t *rpc;
    kvp_exec_t exec;
    int rc;
    uint64_t req_id;
    uint32_t batch_size, nnz, num_copies, num_indices;
    int32_t *kv_indptr, *kv_indices, *kv_last_page_len, *append_indptr, *seq_lens;
    int32_t *batch_indices, *positions;
    kvp_page_copy_t *copies;
    uint32_t *pinned;
    uint32_t num_pinned;
    uint64_t bytes;
    uint32_t ns;       /* for a rollback when the backend refuses the source */
    uint64_t *seq_ids; /* [batch_size] */
    /* tensor-parallel form: each rank's buffer, copied by value (another session may move or
     * drop its entry while the job runs; the hold keeps the backend state alive) */
    kvp_buffer_t rank_buf[KVP_GEOM_MAX_DEVICES];
    const kvp_buffer_t *rank_ptr[KVP_GEOM_MAX_DEVICES];
    uint32_t num_ranks;
    /* a transfer (ExportBegin's background job, or Import) instead of an append */
    kvp_xfer_job_t *xfer;
    int xfer_dir; /* KVP_XFER_EXPORT / _IMPORT */
    uint64_t xfer_seq, xfer_id;
    uint32_t xfer_tokens;
};

/* A buffer a job in flight reads. Only the job's own connection waits for its job, so a buffer
 * of another session (a tensor-parallel rank's) may be unregistered, or its session closed,
 * while the copy still reads it: its release is then deferred to the last job's finish. */
typedef struct held_buf {
    struct held_buf *next;
    const void *key; /* the buffer's priv (cuda) or host_ptr (host) */
    uint32_t refs;
    int released;     /* its owner let go: release when refs reaches 0 */
    kvp_buffer_t buf; /* the value to release */
} held_buf_t;

struct kvp_rpc {
    kvp_backend_t *backend;
    kvp_alloc_t *alloc;
    kvp_seqtab_t *seqs;
    kvp_plan_t plan;
    kvp_plan_limits_t plan_limits;
    kvp_ns_table_t ns;
    kvp_rpc_limits_t lim;
    kvp_plan_item_t *items; /* [max_batch] */
    kvp_session_t *sessions;
    uint32_t num_sessions;
    uint32_t num_clients;
    uint64_t next_session_id;
    uint64_t start_ms;
    int draining;
    int unhealthy;
    /* metrics */
    uint64_t calls[NUM_CALLS][NUM_CODES];
    uint64_t lat_buckets[NUM_CALLS][NUM_BUCKETS];
    uint64_t lat_sum_ns[NUM_CALLS];
    uint64_t requests_total;
    uint64_t append_bytes_total;
    uint64_t alloc_failures[4]; /* exhausted, limit, invalid, other */
    uint64_t pages_allocated_total;
    uint64_t lease_expiries_total;
    uint64_t cow_copies_total;
    uint64_t evicted_seqs_total;       /* sequences released because their lease ran out */
    uint64_t evicted_pages_total;      /* pages those releases returned to the free list */
    uint64_t run_buckets[NUM_BUCKETS]; /* time a copy worker spent on one Append plan */
    uint64_t run_sum_ns;
    held_buf_t *held; /* buffers that jobs in flight read */
    kvp_xfer_t *xfer; /* transfers between daemons */
};

/* Bytes of the Response body member for a tag: clearing only that member (not the whole
 * 45 KB union, sized by ListClients) keeps small answers cheap. */
static size_t body_size(pb_size_t which)
{
    kvpool_Response *r = NULL;
    switch (which) {
    case kvpool_Response_hello_tag:
        return sizeof(r->body.hello);
    case kvpool_Response_ping_tag:
        return sizeof(r->body.ping);
    case kvpool_Response_pool_info_tag:
        return sizeof(r->body.pool_info);
    case kvpool_Response_register_buffer_tag:
        return sizeof(r->body.register_buffer);
    case kvpool_Response_append_tag:
        return sizeof(r->body.append);
    case kvpool_Response_reserve_tag:
        return sizeof(r->body.reserve);
    case kvpool_Response_fork_tag:
        return sizeof(r->body.fork);
    case kvpool_Response_truncate_tag:
        return sizeof(r->body.truncate);
    case kvpool_Response_release_tag:
        return sizeof(r->body.release);
    case kvpool_Response_get_page_table_tag:
        return sizeof(r->body.get_page_table);
    case kvpool_Response_stats_tag:
        return sizeof(r->body.stats);
    case kvpool_Response_list_sequences_tag:
        return sizeof(r->body.list_sequences);
    case kvpool_Response_list_clients_tag:
        return sizeof(r->body.list_clients);
    case kvpool_Response_audit_tag:
        return sizeof(r->body.audit);
    case kvpool_Response_metrics_tag:
        return sizeof(r->body.metrics);
    case kvpool_Response_export_begin_tag:
        return sizeof(r->body.export_begin);
    case kvpool_Response_import_tag:
        return sizeof(r->body.import);
    case kvpool_Response_list_transfers_tag:
        return sizeof(r->body.list_transfers);
    default:
        return 0;
    }
}

static void clear(kvpool_Response *resp, pb_size_t which)
{
    memset(resp, 0, offsetof(kvpool_Response, body));
    memset(&resp->body, 0, body_size(which));
    resp->which_body = which;
}

void kvp_rpc_error(kvpool_Response *resp, uint64_t id, int err, const char *fmt, ...)
{
    clear(resp, 0);
    resp->id = id;
    resp->has_status = true;
    resp->status.code = kvp_wire_code_from_err(err);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(resp->status.message, sizeof(resp->status.message), fmt, ap);
    va_end(ap);
}

int kvp_rpc_create(kvp_backend_t *backend, const kvp_rpc_limits_t *lim, uint64_t now_ms,
                   kvp_rpc_t **out)
{
    if (!backend || !lim || !out || !lim->max_batch || !lim->max_seqs || !lim->max_namespaces)
        return KVP_EINVAL;
    kvp_rpc_t *r = calloc(1, sizeof(*r));
    if (!r)
        return KVP_ENOMEM;
    int rc;
    r->lim = *lim;
    r->start_ms = now_ms;
    r->next_session_id = 1;
    kvp_plan_init(&r->plan);
    r->plan_limits.max_batch = lim->max_batch;
    r->plan_limits.max_tokens = lim->max_batch_tokens;
    kvp_seqtab_config_t cfg = {.max_seqs = lim->max_seqs,
                               .max_namespaces = lim->max_namespaces,
                               .max_seq_tokens = lim->max_seq_tokens};
    if ((rc = kvp_alloc_create(backend->geom.num_pages, &r->alloc)))
        goto fail;
    if ((rc = kvp_seqtab_create(r->alloc, backend->geom.page_size, &cfg, &r->seqs)))
        goto fail;
    if ((rc = kvp_ns_table_init(&r->ns, lim->max_namespaces, lim->dedup_window)))
        goto fail;
    r->items = calloc(lim->max_batch, sizeof(*r->items));
    if (!r->items) {
        rc = KVP_ENOMEM;
        goto fail;
    }
    kvp_xfer_config_t xc = {
        .timeout_ms = lim->transfer_timeout_ms ? lim->transfer_timeout_ms : 30000,
        .comm_idle_ms = lim->transfer_comm_idle_ms ? lim->transfer_comm_idle_ms : 300000,
        .max_in_flight = lim->transfer_max_in_flight ? lim->transfer_max_in_flight : 2,
        .chunk_bytes = lim->transfer_chunk_bytes};
    if ((rc = kvp_xfer_create(backend, &xc, &r->xfer)))
        goto fail;
    r->backend = backend;
    *out = r;
    return 0;
fail:
    kvp_rpc_destroy(r);
    return rc;
}

void kvp_rpc_destroy(kvp_rpc_t *r)
{
    if (!r)
        return;
    while (r->sessions)
        kvp_rpc_session_close(r, r->sessions, 0);
    while (r->held) { /* no job runs any more */
        held_buf_t *h = r->held;
        r->held = h->next;
        if (h->released)
            r->backend->ops->release_buffer(r->backend, &h->buf);
        free(h);
    }
    free(r->items);
    kvp_ns_table_free(&r->ns);
    kvp_plan_free(&r->plan);
    kvp_xfer_destroy(r->xfer);
    kvp_seqtab_destroy(r->seqs);
    kvp_alloc_destroy(r->alloc);
    if (r->backend)
        r->backend->ops->destroy(r->backend);
    free(r);
}

kvp_seqtab_t *kvp_rpc_seqtab(kvp_rpc_t *r)
{
    return r->seqs;
}

kvp_backend_t *kvp_rpc_backend(kvp_rpc_t *r)
{
    return r->backend;
}

void kvp_rpc_set_limits(kvp_rpc_t *r, const kvp_rpc_limits_t *lim)
{
    r->lim.max_batch_tokens = lim->max_batch_tokens;
    r->plan_limits.max_tokens = lim->max_batch_tokens;
    r->lim.max_buffer_bytes = lim->max_buffer_bytes;
    r->lim.default_lease_ms = lim->default_lease_ms;
    r->lim.max_lease_ms = lim->max_lease_ms;
    kvp_xfer_config_t xc = {.timeout_ms = lim->transfer_timeout_ms,
                            .comm_idle_ms =
                                lim->transfer_comm_idle_ms ? lim->transfer_comm_idle_ms : 300000,
                            .chunk_bytes = lim->transfer_chunk_bytes};
    kvp_xfer_set_config(r->xfer, &xc);
    r->lim.ns_max_seqs = lim->ns_max_seqs;
    r->lim.ns_max_pages = lim->ns_max_pages;
    r->lim.ns_max_buffer_bytes = lim->ns_max_buffer_bytes;
    r->lim.ns_max_connections = lim->ns_max_connections;
    for (uint32_t i = 0; i < r->ns.max; i++)
        if (r->ns.ns[i].in_use)
            kvp_seqtab_set_ns_limits(r->seqs, i, lim->ns_max_seqs, lim->ns_max_pages);
}

void kvp_rpc_set_num_clients(kvp_rpc_t *r, uint32_t n)
{
    r->num_clients = n;
}

void kvp_rpc_set_draining(kvp_rpc_t *r, int draining)
{
    r->draining = draining;
}

int kvp_rpc_healthy(kvp_rpc_t *r)
{
    return !r->unhealthy && r->backend->ops->health(r->backend) == 0;
}

/* ---- buffers held by jobs ------------------------------------------------------------- */

static const void *buf_key(const kvp_buffer_t *b)
{
    return b->priv ? b->priv : b->host_ptr;
}

static held_buf_t *held_find(kvp_rpc_t *r, const void *key)
{
    for (held_buf_t *h = r->held; h; h = h->next)
        if (h->key == key)
            return h;
    return NULL;
}

/* A job will read b. 0 or KVP_ENOMEM. Loop thread. */
static int buf_hold(kvp_rpc_t *r, const kvp_buffer_t *b)
{
    held_buf_t *h = held_find(r, buf_key(b));
    if (!h) {
        if (!(h = calloc(1, sizeof(*h))))
            return KVP_ENOMEM;
        h->key = buf_key(b);
        h->next = r->held;
        r->held = h;
    }
    h->refs++;
    return 0;
}

/* The job that held b finished: a buffer whose owner let go meanwhile is released now. */
static void buf_unhold(kvp_rpc_t *r, const kvp_buffer_t *b)
{
    const void *key = buf_key(b);
    for (held_buf_t **pp = &r->held; *pp; pp = &(*pp)->next) {
        held_buf_t *h = *pp;
        if (h->key != key)
            continue;
        if (--h->refs == 0) {
            if (h->released)
                r->backend->ops->release_buffer(r->backend, &h->buf);
            *pp = h->next;
            free(h);
        }
        return;
    }
}

/* Its owner unregisters b (or closes): released now, or by the last job that reads it. */
static void buf_release(kvp_rpc_t *r, kvp_buffer_t *b)
{
    held_buf_t *h = held_find(r, buf_key(b));
    if (h && !h->released) {
        h->buf = *b;
        h->released = 1;
        return;
    }
    r->backend->ops->release_buffer(r->backend, b);
}

/* ---- sessions ------------------------------------------------------------------------- */

kvp_session_t *kvp_rpc_session_open(kvp_rpc_t *r, int32_t pid, uint32_t uid, uint32_t gid,
                                    uint64_t now_ms)
{
    kvp_session_t *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->buffers = calloc(r->lim.max_buffers_per_client ? r->lim.max_buffers_per_client : 1,
                        sizeof(*s->buffers));
    if (!s->buffers) {
        free(s);
        return NULL;
    }
    s->id = r->next_session_id++;
    s->pid = pid;
    s->uid = uid;
    s->gid = gid;
    s->connected_ms = now_ms;
    s->next_buffer_id = 1;
    s->next = r->sessions;
    if (r->sessions)
        r->sessions->prev = s;
    r->sessions = s;
    r->num_sessions++;
    return s;
}

static void release_namespace(kvp_rpc_t *r, uint32_t ns, const char *why)
{
    uint32_t n = kvp_seqtab_release_ns(r->seqs, ns);
    kvp_log(KVP_LOG_INFO, "namespace released ns=%s sequences=%u reason=%s", r->ns.ns[ns].name, n,
            why);
    kvp_ns_forget(&r->ns, ns);
}

void kvp_rpc_session_close(kvp_rpc_t *r, kvp_session_t *s, uint64_t now_ms)
{
    for (uint32_t i = 0; i < s->num_buffers; i++) {
        if (s->hello_done)
            r->ns.ns[s->ns].buffer_bytes -= s->buffers[i].buf.size_bytes;
        buf_release(r, &s->buffers[i].buf);
    }
    if (s->hello_done && kvp_ns_detach(&r->ns, s->ns, now_ms))
        release_namespace(r, s->ns, "lease 0");
    if (s->prev)
        s->prev->next = s->next;
    else
        r->sessions = s->next;
    if (s->next)
        s->next->prev = s->prev;
    r->num_sessions--;
    free(s->buffers);
    free(s);
}

uint32_t kvp_rpc_expire_leases(kvp_rpc_t *r, uint64_t now_ms)
{
    uint32_t n = 0;
    kvp_xfer_sweep(r->xfer, now_ms); /* communicators idle too long (the tick calls here) */
    int id;
    while ((id = kvp_ns_next_expired(&r->ns, now_ms)) >= 0) {
        kvp_stats_t before, after;
        kvp_seqtab_stats(r->seqs, &before);
        release_namespace(r, (uint32_t)id, "lease expired");
        kvp_seqtab_stats(r->seqs, &after);
        r->lease_expiries_total++;
        r->evicted_seqs_total += before.num_seqs - after.num_seqs;
        r->evicted_pages_total += after.free_pages - before.free_pages;
        n++;
    }
    return n;
}

uint64_t kvp_rpc_next_deadline(const kvp_rpc_t *r)
{
    return kvp_ns_next_deadline(&r->ns);
}

/* ---- idempotency ---------------------------------------------------------------------- */

int kvp_rpc_is_mutating(pb_size_t which)
{
    switch (which) {
    case kvpool_Request_append_tag:
    case kvpool_Request_reserve_tag:
    case kvpool_Request_fork_tag:
    case kvpool_Request_truncate_tag:
    case kvpool_Request_release_tag:
    case kvpool_Request_register_buffer_tag:
    case kvpool_Request_unregister_buffer_tag:
    case kvpool_Request_import_tag:
        return 1;
    default:
        return 0;
    }
}

int kvp_rpc_replay(kvp_rpc_t *r, const kvp_session_t *s, uint64_t req_id, const uint8_t **frame,
                   uint32_t *len)
{
    if (!s->hello_done || req_id == 0)
        return 0;
    const kvp_dedup_entry_t *e = kvp_ns_dedup_find(&r->ns, s->ns, req_id);
    if (!e)
        return 0;
    if (e->state == 2) {
        *frame = e->frame;
        *len = e->len;
        return 1;
    }
    return e->state == 1 ? 2 : 3;
}

void kvp_rpc_begin(kvp_rpc_t *r, const kvp_session_t *s, uint64_t req_id)
{
    if (s->hello_done)
        kvp_ns_dedup_begin(&r->ns, s->ns, req_id);
}

void kvp_rpc_remember(kvp_rpc_t *r, const kvp_session_t *s, uint64_t req_id, const uint8_t *frame,
                      uint32_t len)
{
    if (s->hello_done)
        kvp_ns_dedup_end(&r->ns, s->ns, req_id, frame, len);
}

/* ---- helpers -------------------------------------------------------------------------- */

static void ok(kvpool_Response *resp, uint64_t id, pb_size_t which)
{
    clear(resp, which);
    resp->id = id;
    resp->has_status = true;
    resp->status.code = kvpool_Code_OK;
}

static void fill_pool_info(kvp_rpc_t *r, kvpool_PoolInfo *pi)
{
    const kvp_backend_t *b = r->backend;
    const kvp_geom_t *g = &b->geom;
    const kvp_geom_derived_t *d = &b->derived;
    pi->has_geometry = true;
    pi->geometry.num_layers = g->num_layers;
    pi->geometry.num_pages = g->num_pages;
    pi->geometry.page_size = g->page_size;
    pi->geometry.num_kv_heads = g->num_kv_heads;
    pi->geometry.head_dim = g->head_dim;
    pi->geometry.dtype = (kvpool_DType)g->dtype;
    pi->geometry.layout = (kvpool_Layout)g->layout;
    pi->geometry.storage = (kvpool_Storage)g->storage;
    pi->geometry.num_devices = g->num_devices ? g->num_devices : 1;
    pi->backend = (kvpool_BackendKind)b->kind;
    pi->pool_bytes = d->pool_bytes;
    pi->layer_bytes = d->layer_bytes;
    pi->v_offset_bytes = d->v_offset_bytes;
    pi->stride_page = d->stride_page;
    pi->stride_n = d->stride_n;
    pi->stride_h = d->stride_h;
    pi->elem_bytes = d->elem_bytes;
    pi->heads_per_device = d->heads;
    pi->map_granularity = b->map_granularity;
    for (uint32_t i = 0; i < b->num_device_ids && i < 64; i++)
        pi->device_ids[pi->device_ids_count++] = b->device_ids[i];
}

static int attach_pool_fds(kvp_rpc_t *r, kvp_rpc_io_t *io, kvpool_PoolInfo *pi)
{
    int n = r->backend->ops->export_fds(r->backend, io->fds_out, KVP_MAX_FDS_PER_FRAME);
    if (n < 0)
        return n;
    io->nfds_out = n;
    pi->num_fds = (uint32_t)n;
    return 0;
}

static const char *plan_error_text(int rc)
{
    switch (rc) {
    case KVP_ENOSPC:
        return "pool exhausted";
    case KVP_ELIMIT:
        return "limit or quota exceeded";
    case KVP_EDUPSEQ:
        return "sequence named twice in one batch";
    case KVP_EINVAL:
        return "invalid batch";
    default:
        return kvp_strerror(rc);
    }
}

/* Reads the batch of a request into r->items (ns of the session); n_tokens optional. */
static int take_batch(kvp_rpc_t *r, const kvp_session_t *s, const kvp_rpc_io_t *io, int with_tokens,
                      uint32_t *n_out, kvpool_Response *resp, uint64_t id)
{
    const kvp_batch_arrays_t *b = io->batch;
    uint32_t n = b->seq_ids.count;
    if (n == 0) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "empty batch: seq_ids has no entries");
        return KVP_EINVAL;
    }
    if (n > r->lim.max_batch) {
        kvp_rpc_error(resp, id, KVP_ELIMIT, "batch of %u sequences above max_batch %u", n,
                      r->lim.max_batch);
        return KVP_ELIMIT;
    }
    if (with_tokens && b->num_tokens.count != n) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "num_tokens has %u entries, seq_ids %u",
                      b->num_tokens.count, n);
        return KVP_EINVAL;
    }
    const uint64_t *ids = b->seq_ids.data;
    const uint32_t *toks = b->num_tokens.data;
    for (uint32_t i = 0; i < n; i++) {
        r->items[i].ns = s->ns;
        r->items[i].seq_id = ids[i];
        r->items[i].num_tokens = with_tokens ? toks[i] : 0;
    }
    *n_out = n;
    return 0;
}

/* Points the response arrays at the planner's page table. */
static void table_from_plan(kvp_rpc_t *r, kvpool_PageTable *t, kvp_reply_arrays_t *out)
{
    const kvp_plan_t *p = &r->plan;
    uint32_t B = p->batch_size;
    t->batch_size = B;
    t->nnz = p->nnz;
    out->kv_indptr = kvp_array(p->kv_indptr, 4, B + 1, B + 1);
    out->kv_indices = kvp_array(p->kv_indices, 4, (uint32_t)p->kv_indptr[B], 0);
    out->kv_last_page_len = kvp_array(p->kv_last_page_len, 4, B, B);
    out->append_indptr = kvp_array(p->append_indptr, 4, B + 1, B + 1);
    out->seq_lens = kvp_array(p->seq_lens, 4, B, B);
    out->copies = kvp_array(p->copies, 4, 2 * p->num_copies, 0);
    kvp_wire_table_bind_encode(t, out);
}

static void count_alloc_failure(kvp_rpc_t *r, int rc)
{
    r->alloc_failures[rc == KVP_ENOSPC ? 0 : rc == KVP_ELIMIT ? 1 : rc == KVP_EINVAL ? 2 : 3]++;
}

/* ---- the calls -------------------------------------------------------------------------- */

static int do_hello(kvp_rpc_t *r, kvp_session_t *s, const kvpool_HelloRequest *h, kvp_rpc_io_t *io,
                    uint64_t id)
{
    kvpool_Response *resp = &io->resp;
    if (s->hello_done) {
        kvp_rpc_error(resp, id, KVP_EPRECOND, "hello already done on this connection");
        return 0;
    }
    if (h->protocol_version != KVP_PROTOCOL_VERSION) {
        kvp_rpc_error(resp, id, KVP_EPRECOND, "protocol version %u not supported (daemon: %u)",
                      h->protocol_version, KVP_PROTOCOL_VERSION);
        return 0;
    }
    if (r->draining) {
        kvp_rpc_error(resp, id, KVP_EUNAVAIL, "daemon is shutting down");
        return 0;
    }
    const char *name = h->namespace[0] ? h->namespace : "default";
    uint32_t lease = h->has_lease_ms ? h->lease_ms : r->lim.default_lease_ms;
    int set_lease = h->has_lease_ms;
    if (lease > r->lim.max_lease_ms) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "lease_ms %u above max_lease_ms %u", lease,
                      r->lim.max_lease_ms);
        return 0;
    }
    int existing = kvp_ns_find(&r->ns, name);
    if (existing >= 0 && r->lim.ns_max_connections &&
        r->ns.ns[existing].sessions >= r->lim.ns_max_connections &&
        (r->ns.ns[existing].owner_uid == s->uid || s->uid == 0)) {
        kvp_rpc_error(resp, id, KVP_ELIMIT,
                      "namespace '%s' has %u connections: its quota (limits.ns_max_connections)",
                      name, r->ns.ns[existing].sessions);
        return 0;
    }
    uint32_t ns;
    int rc = kvp_ns_attach(&r->ns, name, s->uid, lease, set_lease, &ns);
    if (rc) {
        kvp_rpc_error(resp, id, rc,
                      rc == KVP_EPERM    ? "namespace '%s' belongs to another user"
                      : rc == KVP_ELIMIT ? "no free namespace slot for '%s'"
                                         : "invalid namespace name '%s'",
                      name);
        return 0;
    }
    if (existing < 0)
        kvp_seqtab_set_ns_limits(r->seqs, ns, r->lim.ns_max_seqs, r->lim.ns_max_pages);
    ok(resp, id, kvpool_Response_hello_tag);
    kvpool_HelloResponse *hr = &resp->body.hello;
    hr->protocol_version = KVP_PROTOCOL_VERSION;
    snprintf(hr->server_version, sizeof(hr->server_version), "%s", KVP_VERSION);
    hr->session_id = s->id;
    hr->has_pool = true;
    fill_pool_info(r, &hr->pool);
    if (h->want_pool_fds && (rc = attach_pool_fds(r, io, &hr->pool))) {
        kvp_ns_detach(&r->ns, ns, 0);
        kvp_rpc_error(resp, id, KVP_EINTERNAL, "cannot export the pool: %s", kvp_strerror(rc));
        return 0;
    }
    s->hello_done = 1;
    s->ns = ns;
    snprintf(s->name, sizeof(s->name), "%s", h->client_name);
    snprintf(s->ns_name, sizeof(s->ns_name), "%s", name);
    kvp_log(KVP_LOG_INFO, "session hello session=%llu ns=%s client=%s pid=%d uid=%u lease_ms=%u",
            (unsigned long long)s->id, name, s->name, s->pid, s->uid, lease);
    return 0;
}

static int do_register(kvp_rpc_t *r, kvp_session_t *s, const kvpool_RegisterBufferRequest *q,
                       kvp_rpc_io_t *io, uint64_t id)
{
    kvpool_Response *resp = &io->resp;
    if (q->kind != kvpool_BufferKind_BUFFER_MEMFD &&
        r->backend->kind == kvpool_BackendKind_BACKEND_HOST) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "buffer kind %d not supported by the host backend",
                      (int)q->kind);
        return 0;
    }
    if (q->size_bytes == 0 || q->size_bytes > r->lim.max_buffer_bytes) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "size_bytes %llu outside 1..%llu",
                      (unsigned long long)q->size_bytes,
                      (unsigned long long)r->lim.max_buffer_bytes);
        return 0;
    }
    const int wants_fd = q->kind != kvpool_BufferKind_BUFFER_CUDA_IPC;
    if (wants_fd && (io->nfds_in != 1 || io->fds_in[0] < 0)) {
        kvp_rpc_error(resp, id, KVP_EINVAL,
                      "RegisterBuffer of kind %d needs exactly one fd, got %d", (int)q->kind,
                      io->nfds_in);
        return 0;
    }
    if (!wants_fd && (io->nfds_in != 0 || q->ipc_handle.size != 64)) {
        kvp_rpc_error(
            resp, id, KVP_EINVAL,
            "a CUDA IPC buffer needs a 64-byte ipc_handle and no fd (got %u bytes, %d fds)",
            (unsigned)q->ipc_handle.size, io->nfds_in);
        return 0;
    }
    if (s->num_buffers >= r->lim.max_buffers_per_client) {
        kvp_rpc_error(resp, id, KVP_ELIMIT, "buffer limit %u reached",
                      r->lim.max_buffers_per_client);
        return 0;
    }
    kvp_ns_t *nsp = &r->ns.ns[s->ns];
    if (r->lim.ns_max_buffer_bytes &&
        (nsp->buffer_bytes > r->lim.ns_max_buffer_bytes ||
         q->size_bytes > r->lim.ns_max_buffer_bytes - nsp->buffer_bytes)) {
        kvp_rpc_error(resp, id, KVP_ELIMIT,
                      "namespace '%s' has %llu bytes registered; %llu more would pass its quota "
                      "%llu (limits.ns_max_buffer_bytes)",
                      nsp->name, (unsigned long long)nsp->buffer_bytes,
                      (unsigned long long)q->size_bytes,
                      (unsigned long long)r->lim.ns_max_buffer_bytes);
        return 0;
    }
    kvp_session_buffer_t *sb = &s->buffers[s->num_buffers];
    uint8_t done_event[KVP_BACKEND_IPC_HANDLE_BYTES];
    uint32_t done_len = 0;
    int rc = r->backend->ops->import_buffer(
        r->backend, (uint32_t)q->kind, wants_fd ? io->fds_in[0] : -1, q->size_bytes, q->device,
        q->ipc_handle.bytes, q->ipc_handle.size, q->event_handle.bytes, q->event_handle.size,
        done_event, &done_len, &sb->buf);
    if (rc) {
        kvp_rpc_error(resp, id, rc == KVP_EPERM ? KVP_EINVAL : rc, "cannot import the buffer: %s",
                      rc == KVP_EPERM ? "a memfd must carry F_SEAL_SHRINK (so it cannot be "
                                        "shrunk under the daemon)"
                                      : kvp_strerror(rc));
        return 0;
    }
    if (wants_fd)
        io->fds_in[0] = -1; /* the backend owns it now */
    sb->id = s->next_buffer_id++;
    s->num_buffers++;
    nsp->buffer_bytes += sb->buf.size_bytes;
    ok(resp, id, kvpool_Response_register_buffer_tag);
    resp->body.register_buffer.buffer_id = sb->id;
    if (done_len && done_len <= sizeof(resp->body.register_buffer.done_event_handle.bytes)) {
        memcpy(resp->body.register_buffer.done_event_handle.bytes, done_event, done_len);
        resp->body.register_buffer.done_event_handle.size = (pb_size_t)done_len;
    }
    return 0;
}

static kvp_session_buffer_t *find_buffer(kvp_session_t *s, uint32_t buffer_id)
{
    for (uint32_t i = 0; i < s->num_buffers; i++)
        if (s->buffers[i].id == buffer_id)
            return &s->buffers[i];
    return NULL;
}

static int do_unregister(kvp_rpc_t *r, kvp_session_t *s, const kvpool_UnregisterBufferRequest *q,
                         kvp_rpc_io_t *io, uint64_t id)
{
    kvp_session_buffer_t *sb = find_buffer(s, q->buffer_id);
    if (!sb) {
        kvp_rpc_error(&io->resp, id, KVP_ENOENT, "no buffer %u", q->buffer_id);
        return 0;
    }
    r->ns.ns[s->ns].buffer_bytes -= sb->buf.size_bytes;
    buf_release(r, &sb->buf);
    *sb = s->buffers[--s->num_buffers];
    ok(&io->resp, id, kvpool_Response_unregister_buffer_tag);
    return 0;
}

static int do_reserve(kvp_rpc_t *r, kvp_session_t *s, kvp_rpc_io_t *io, uint64_t id,
                      uint64_t now_ms)
{
    uint32_t n;
    if (take_batch(r, s, io, 1, &n, &io->resp, id))
        return 0;
    int rc = kvp_plan_append(r->seqs, r->items, n, &r->plan_limits, now_ms, &r->plan);
    if (rc) {
        count_alloc_failure(r, rc);
        kvp_rpc_error(&io->resp, id, rc, "%s (batch item %u)", plan_error_text(rc),
                      r->plan.fail_index);
        return 0;
    }
    r->pages_allocated_total += r->plan.num_new_pages;
    r->cow_copies_total += r->plan.num_copies;
    ok(&io->resp, id, kvpool_Response_reserve_tag);
    io->resp.body.reserve.has_table = true;
    table_from_plan(r, &io->resp.body.reserve.table, &io->out);
    return 0;
}

/* Checks the source ranges of an append against the buffer: every byte any layer, token and
 * head reads lies inside it, offsets and strides are multiples of the element size. */
static int check_source(const kvp_rpc_t *r, const kvpool_Source *src, const kvp_buffer_t *buf,
                        uint32_t nnz, uint32_t lb, uint32_t le, char *why, size_t why_len)
{
    const kvp_geom_derived_t *d = &r->backend->derived;
    /* offsets and strides: whole elements, and what the backend's copy needs on top */
    uint64_t e =
        d->elem_bytes > r->backend->src_align_bytes ? d->elem_bytes : r->backend->src_align_bytes;
    uint64_t vals[] = {src->k_offset,   src->v_offset,   src->k_stride_n,  src->k_stride_h,
                       src->v_stride_n, src->v_stride_h, src->layer_stride};
    for (unsigned i = 0; i < 7; i++)
        if (vals[i] % e) {
            snprintf(why, why_len, "source offsets and strides must be multiples of %llu bytes",
                     (unsigned long long)e);
            return KVP_EINVAL;
        }
    if (nnz == 0)
        return 0;
    uint64_t H = d->heads;
    for (int kv = 0; kv < 2; kv++) {
        uint64_t off = kv ? src->v_offset : src->k_offset;
        uint64_t sn = kv ? src->v_stride_n : src->k_stride_n;
        uint64_t sh = kv ? src->v_stride_h : src->k_stride_h;
        uint64_t a, b, c, end;
        if (__builtin_mul_overflow((uint64_t)(le - lb - 1), src->layer_stride, &a) ||
            __builtin_mul_overflow((uint64_t)(nnz - 1), sn, &b) ||
            __builtin_mul_overflow(H - 1, sh, &c) || __builtin_add_overflow(off, a, &end) ||
            __builtin_add_overflow(end, b, &end) || __builtin_add_overflow(end, c, &end) ||
            __builtin_add_overflow(end, d->row_bytes, &end) || end > buf->size_bytes) {
            snprintf(why, why_len, "%s source range exceeds buffer of %llu bytes", kv ? "V" : "K",
                     (unsigned long long)buf->size_bytes);
            return KVP_ERANGE;
        }
    }
    return 0;
}

static void job_free_arrays(kvp_rpc_job_t *j)
{
    free(j->kv_indptr);
    free(j->pinned);
    free(j->seq_ids);
}

void kvp_rpc_job_free(kvp_rpc_job_t *job)
{
    if (!job)
        return;
    job_free_arrays(job);
    free(job);
}

/* Copies the plan into a job (the planner's arrays are reused by the next call) and pins
 * every page the job reads or writes. */
static kvp_rpc_job_t *make_job(kvp_rpc_t *r, const kvp_buffer_t *buf,
                               const kvp_buffer_t *const *ranks, uint32_t num_ranks,
                               const kvpool_Source *src, uint32_t lb, uint32_t le, uint64_t id,
                               uint32_t sync)
{
    const kvp_plan_t *p = &r->plan;
    uint32_t B = p->batch_size, I = (uint32_t)p->kv_indptr[B], C = p->num_copies, N = p->nnz;
    kvp_rpc_job_t *j = calloc(1, sizeof(*j));
    if (!j)
        return NULL;
    size_t words = (size_t)(B + 1) * 2 + (size_t)B * 2 + I + (size_t)N * 2 + (size_t)C * 2;
    int32_t *w = malloc(words * sizeof(int32_t) + 4);
    j->pinned = malloc(((size_t)I + 2 * C + 1) * sizeof(uint32_t));
    j->seq_ids = malloc(((size_t)B + 1) * sizeof(uint64_t));
    if (!w || !j->pinned || !j->seq_ids) {
        free(w);
        free(j->pinned);
        free(j->seq_ids);
        free(j);
        return NULL;
    }
    for (uint32_t g = 0; g < num_ranks; g++) {
        if (buf_hold(r, ranks[g])) {
            while (g-- > 0)
                buf_unhold(r, &j->rank_buf[g]);
            free(w);
            free(j->pinned);
            free(j->seq_ids);
            free(j);
            return NULL;
        }
        j->rank_buf[g] = *ranks[g];
        j->rank_ptr[g] = &j->rank_buf[g];
    }
    j->num_ranks = num_ranks;
    for (uint32_t b = 0; b < B; b++)
        j->seq_ids[b] = r->items[b].seq_id;
    j->ns = B ? r->items[0].ns : 0;
    j->kv_indptr = w, w += B + 1;
    j->append_indptr = w, w += B + 1;
    j->kv_last_page_len = w, w += B;
    j->seq_lens = w, w += B;
    j->kv_indices = w, w += I;
    j->batch_indices = w, w += N;
    j->positions = w, w += N;
    j->copies = (kvp_page_copy_t *)w;
    memcpy(j->kv_indptr, p->kv_indptr, (B + 1) * 4);
    memcpy(j->append_indptr, p->append_indptr, (B + 1) * 4);
    memcpy(j->kv_last_page_len, p->kv_last_page_len, B * 4);
    memcpy(j->seq_lens, p->seq_lens, B * 4);
    if (I)
        memcpy(j->kv_indices, p->kv_indices, (size_t)I * 4);
    if (C)
        memcpy(j->copies, p->copies, (size_t)C * sizeof(kvp_page_copy_t));
    if (N)
        kvp_get_batch_indices_positions_cpu(j->append_indptr, j->seq_lens, B, N, j->batch_indices,
                                            j->positions);
    j->rpc = r;
    j->req_id = id;
    j->batch_size = B, j->nnz = N, j->num_copies = C, j->num_indices = I;
    /* pin: copy sources and destinations, and the pages that receive tokens */
    for (uint32_t c = 0; c < C; c++) {
        kvp_alloc_pin(r->alloc, j->copies[c].src);
        j->pinned[j->num_pinned++] = j->copies[c].src;
        kvp_alloc_pin(r->alloc, j->copies[c].dst);
        j->pinned[j->num_pinned++] = j->copies[c].dst;
    }
    const uint32_t ps = r->backend->geom.page_size;
    for (uint32_t b = 0; b < B; b++) {
        uint32_t add = (uint32_t)(j->append_indptr[b + 1] - j->append_indptr[b]);
        if (!add)
            continue;
        uint32_t first = (uint32_t)(j->seq_lens[b] - (int32_t)add) / ps;
        for (int32_t k = j->kv_indptr[b] + (int32_t)first; k < j->kv_indptr[b + 1]; k++) {
            kvp_alloc_pin(r->alloc, (uint32_t)j->kv_indices[k]);
            j->pinned[j->num_pinned++] = (uint32_t)j->kv_indices[k];
        }
    }
    kvp_exec_t *e = &j->exec;
    e->batch_size = B;
    e->nnz = N;
    e->kv_indptr = j->kv_indptr;
    e->kv_indices = j->kv_indices;
    e->kv_last_page_len = j->kv_last_page_len;
    e->batch_indices = j->batch_indices;
    e->positions = j->positions;
    e->copies = j->copies;
    e->num_copies = C;
    e->src = num_ranks ? NULL : buf;
    e->rank_src = num_ranks ? j->rank_ptr : NULL;
    e->num_rank_src = num_ranks;
    e->k_offset = src->k_offset;
    e->v_offset = src->v_offset;
    e->k_stride_n = src->k_stride_n;
    e->k_stride_h = src->k_stride_h;
    e->v_stride_n = src->v_stride_n;
    e->v_stride_h = src->v_stride_h;
    e->layer_stride = src->layer_stride;
    e->layer_begin = lb;
    e->layer_end = le;
    e->sync = sync;
    j->bytes = (uint64_t)N * 2 * r->backend->derived.heads * r->backend->derived.row_bytes *
               (le - lb) * (num_ranks ? num_ranks : 1);
    return j;
}

/* Resolves a tensor-parallel Append's rank_sources (kvpool.proto, AppendRequest): one buffer
 * per device of the group, in device order, each registered for its device by a session of
 * the caller's namespace. Returns 0 with ranks[0..G) set, or a code with the reason in why. */
static int take_rank_sources(kvp_rpc_t *r, kvp_session_t *s, const kvpool_AppendRequest *q,
                             const kvp_buffer_t **ranks, uint32_t *num_out, char *why,
                             size_t why_len)
{
    const uint32_t G = r->backend->geom.num_devices ? r->backend->geom.num_devices : 1;
    if (q->rank_sources_count != G) {
        snprintf(why, why_len, "rank_sources has %u entries; the pool's group has %u devices",
                 (unsigned)q->rank_sources_count, G);
        return KVP_EINVAL;
    }
    if (q->source.buffer_id != 0) {
        snprintf(why, why_len, "with rank_sources, source.buffer_id must be 0 (got %u)",
                 q->source.buffer_id);
        return KVP_EINVAL;
    }
    for (uint32_t g = 0; g < G; g++) {
        const kvpool_RankSource *rs = &q->rank_sources[g];
        kvp_session_t *owner = NULL;
        if (rs->session_id == 0 || rs->session_id == s->id)
            owner = s;
        for (kvp_session_t *o = r->sessions; o && !owner; o = o->next)
            if (o->id == rs->session_id && o->hello_done && o->ns == s->ns)
                owner = o;
        if (!owner) {
            snprintf(why, why_len, "rank %u: no session %llu in this namespace", g,
                     (unsigned long long)rs->session_id);
            return KVP_ENOENT;
        }
        kvp_session_buffer_t *b = find_buffer(owner, rs->buffer_id);
        if (!b) {
            snprintf(why, why_len, "rank %u: session %llu has no buffer %u", g,
                     (unsigned long long)owner->id, rs->buffer_id);
            return KVP_ENOENT;
        }
        if (b->buf.device_index != g) {
            snprintf(why, why_len,
                     "rank %u: buffer %u of session %llu was registered for device index %u, "
                     "not %u",
                     g, rs->buffer_id, (unsigned long long)owner->id, b->buf.device_index, g);
            return KVP_EINVAL;
        }
        ranks[g] = &b->buf;
    }
    *num_out = G;
    return 0;
}

static int do_append(kvp_rpc_t *r, kvp_session_t *s, const kvpool_AppendRequest *q,
                     kvp_rpc_io_t *io, uint64_t id, uint64_t now_ms)
{
    kvpool_Response *resp = &io->resp;
    if (!q->has_source) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "append needs a source");
        return KVP_RPC_DONE;
    }
    const kvpool_Source *src = &q->source;
    kvp_session_buffer_t *sb = NULL;
    if (!q->rank_sources_count && !(sb = find_buffer(s, src->buffer_id))) {
        kvp_rpc_error(resp, id, KVP_ENOENT, "no buffer %u registered on this connection",
                      src->buffer_id);
        return KVP_RPC_DONE;
    }
    if (q->sync != kvpool_SyncMode_SYNC_NONE &&
        r->backend->kind == kvpool_BackendKind_BACKEND_HOST) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "sync mode %d needs the cuda backend", (int)q->sync);
        return KVP_RPC_DONE;
    }
    uint32_t L = r->backend->geom.num_layers;
    uint32_t lb = src->layer_begin, le = src->layer_end ? src->layer_end : L;
    if (lb >= le || le > L) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "layer range [%u, %u) outside [0, %u)", lb, le, L);
        return KVP_RPC_DONE;
    }
    uint32_t n;
    if (take_batch(r, s, io, 1, &n, resp, id))
        return KVP_RPC_DONE;
    uint64_t nnz = 0;
    for (uint32_t i = 0; i < n; i++)
        nnz += r->items[i].num_tokens;
    if (nnz == 0) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "nothing to append: every num_tokens is 0");
        return KVP_RPC_DONE;
    }
    char why[160];
    const kvp_buffer_t *ranks[KVP_GEOM_MAX_DEVICES];
    uint32_t num_ranks = 0;
    int rc = nnz > 0x7fffffffu ? KVP_ELIMIT : 0;
    if (!rc && q->rank_sources_count)
        rc = take_rank_sources(r, s, q, ranks, &num_ranks, why, sizeof(why));
    for (uint32_t g = 0; g < num_ranks && !rc; g++)
        rc = check_source(r, src, ranks[g], (uint32_t)nnz, lb, le, why, sizeof(why));
    if (!rc && !num_ranks)
        rc = check_source(r, src, &sb->buf, (uint32_t)nnz, lb, le, why, sizeof(why));
    if (rc) {
        kvp_rpc_error(resp, id, rc, "%s", rc == KVP_ELIMIT ? "too many tokens" : why);
        return KVP_RPC_DONE;
    }
    rc = kvp_plan_append(r->seqs, r->items, n, &r->plan_limits, now_ms, &r->plan);
    if (rc) {
        count_alloc_failure(r, rc);
        kvp_rpc_error(resp, id, rc, "%s (batch item %u)", plan_error_text(rc), r->plan.fail_index);
        return KVP_RPC_DONE;
    }
    r->pages_allocated_total += r->plan.num_new_pages;
    r->cow_copies_total += r->plan.num_copies;
    kvp_rpc_job_t *j =
        make_job(r, sb ? &sb->buf : NULL, ranks, num_ranks, src, lb, le, id, (uint32_t)q->sync);
    if (!j) {
        /* the plan is committed but cannot be executed: give the pages back by rolling the
         * sequences back to their previous lengths */
        for (uint32_t i = 0; i < n; i++)
            kvp_seqtab_truncate(r->seqs, s->ns, r->items[i].seq_id,
                                (uint32_t)r->plan.seq_lens[i] - r->items[i].num_tokens, now_ms);
        kvp_rpc_error(resp, id, KVP_ENOMEM, "out of memory for the append job");
        return KVP_RPC_DONE;
    }
    io->job = j;
    return KVP_RPC_ASYNC;
}

static void finish_import(kvp_rpc_t *r, kvp_rpc_job_t *j, kvp_rpc_io_t *io, uint64_t now_ms);

void kvp_rpc_job_run(kvp_rpc_job_t *job)
{
    if (job->xfer) {
        kvp_xfer_run(job->xfer);
        return;
    }
    kvp_backend_t *b = job->rpc->backend;
    job->rc = b->ops->run(b, &job->exec);
}

void kvp_rpc_job_finish(kvp_rpc_t *r, kvp_rpc_job_t *j, kvp_rpc_io_t *io, uint64_t now_ms)
{
    if (j->xfer) {
        finish_import(r, j, io, now_ms);
        return;
    }
    for (uint32_t i = 0; i < j->num_pinned; i++)
        kvp_alloc_unpin(r->alloc, j->pinned[i]);
    j->num_pinned = 0;
    for (uint32_t g = 0; g < j->num_ranks; g++)
        buf_unhold(r, &j->rank_buf[g]);
    j->num_ranks = 0;
    if (j->rc == KVP_ETIMEDOUT || j->rc == KVP_EINVAL) {
        /* the backend refused or could not wait for the source (a dead worker's event, an
         * unreadable buffer) and appended nothing: give the tokens back, stay healthy */
        for (uint32_t b = 0; b < j->batch_size; b++) {
            uint32_t add = (uint32_t)(j->append_indptr[b + 1] - j->append_indptr[b]);
            kvp_seqtab_truncate(r->seqs, j->ns, j->seq_ids[b], (uint32_t)j->seq_lens[b] - add,
                                now_ms);
        }
        kvp_rpc_error(&io->resp, j->req_id, j->rc == KVP_ETIMEDOUT ? KVP_EUNAVAIL : KVP_EINVAL,
                      "append not applied: %s",
                      j->rc == KVP_ETIMEDOUT ? "the worker's ready event never completed"
                                             : "the backend cannot read the source");
        return;
    }
    if (j->rc) {
        /* a validated plan failed in the backend: the pool can no longer be trusted */
        r->unhealthy = 1;
        kvp_log(KVP_LOG_CRIT, "append failed in backend rc=%s", kvp_errname(j->rc));
        kvp_rpc_error(&io->resp, j->req_id, KVP_EINTERNAL, "append failed in the backend: %s",
                      kvp_strerror(j->rc));
        return;
    }
    r->append_bytes_total += j->bytes;
    ok(&io->resp, j->req_id, kvpool_Response_append_tag);
    kvpool_AppendResponse *ar = &io->resp.body.append;
    ar->completed = true; /* run() returns once the copy is done (kvp_backend.h) */
    ar->has_table = true;
    uint32_t B = j->batch_size;
    ar->table.batch_size = B;
    ar->table.nnz = j->nnz;
    io->out.kv_indptr = kvp_array(j->kv_indptr, 4, B + 1, 0);
    io->out.kv_indices = kvp_array(j->kv_indices, 4, j->num_indices, 0);
    io->out.kv_last_page_len = kvp_array(j->kv_last_page_len, 4, B, 0);
    io->out.append_indptr = kvp_array(j->append_indptr, 4, B + 1, 0);
    io->out.seq_lens = kvp_array(j->seq_lens, 4, B, 0);
    io->out.copies = kvp_array(j->copies, 4, 2 * j->num_copies, 0);
    kvp_wire_table_bind_encode(&ar->table, &io->out);
}

static int do_fork(kvp_rpc_t *r, kvp_session_t *s, const kvpool_ForkRequest *q, kvp_rpc_io_t *io,
                   uint64_t id, uint64_t now_ms)
{
    int rc = kvp_seqtab_fork(r->seqs, s->ns, q->parent, q->child, now_ms);
    if (rc) {
        kvp_rpc_error(&io->resp, id, rc,
                      rc == KVP_ENOENT   ? "no sequence %llu"
                      : rc == KVP_EEXIST ? "sequence %llu already exists"
                                         : "cannot fork %llu: limit or quota",
                      (unsigned long long)(rc == KVP_EEXIST ? q->child : q->parent));
        return 0;
    }
    ok(&io->resp, id, kvpool_Response_fork_tag);
    io->resp.body.fork.num_tokens = kvp_seqtab_find(r->seqs, s->ns, q->child)->num_tokens;
    return 0;
}

static int do_truncate(kvp_rpc_t *r, kvp_session_t *s, const kvpool_TruncateRequest *q,
                       kvp_rpc_io_t *io, uint64_t id, uint64_t now_ms)
{
    const kvp_seq_t *seq = kvp_seqtab_find(r->seqs, s->ns, q->seq_id);
    uint32_t before = seq ? seq->num_pages : 0;
    int rc = kvp_seqtab_truncate(r->seqs, s->ns, q->seq_id, q->num_tokens, now_ms);
    if (rc) {
        if (rc == KVP_ENOENT)
            kvp_rpc_error(&io->resp, id, rc, "no sequence %llu", (unsigned long long)q->seq_id);
        else
            kvp_rpc_error(&io->resp, id, KVP_EINVAL, "cannot truncate %u-token sequence to %u",
                          seq ? seq->num_tokens : 0, q->num_tokens);
        return 0;
    }
    ok(&io->resp, id, kvpool_Response_truncate_tag);
    io->resp.body.truncate.pages_freed = before - seq->num_pages;
    return 0;
}

static int do_release(kvp_rpc_t *r, kvp_session_t *s, kvp_rpc_io_t *io, uint64_t id)
{
    uint32_t n, released = 0;
    if (take_batch(r, s, io, 0, &n, &io->resp, id))
        return 0;
    for (uint32_t i = 0; i < n; i++)
        released += kvp_seqtab_release(r->seqs, s->ns, r->items[i].seq_id) == 0;
    ok(&io->resp, id, kvpool_Response_release_tag);
    io->resp.body.release.released = released;
    return 0;
}

static int do_page_table(kvp_rpc_t *r, kvp_session_t *s, kvp_rpc_io_t *io, uint64_t id)
{
    uint32_t n;
    if (take_batch(r, s, io, 0, &n, &io->resp, id))
        return 0;
    int rc = kvp_plan_page_table(r->seqs, r->items, n, &r->plan_limits, &r->plan);
    if (rc) {
        kvp_rpc_error(&io->resp, id, rc, "%s (batch item %u)",
                      rc == KVP_ENOENT ? "no such sequence" : kvp_strerror(rc), r->plan.fail_index);
        return 0;
    }
    ok(&io->resp, id, kvpool_Response_get_page_table_tag);
    io->resp.body.get_page_table.has_table = true;
    table_from_plan(r, &io->resp.body.get_page_table.table, &io->out);
    return 0;
}

static int do_stats(kvp_rpc_t *r, kvp_rpc_io_t *io, uint64_t id, uint64_t now_ms)
{
    ok(&io->resp, id, kvpool_Response_stats_tag);
    kvpool_StatsResponse *sr = &io->resp.body.stats;
    sr->has_stats = true;
    kvpool_Stats *st = &sr->stats;
    kvp_stats_t s;
    kvp_seqtab_stats(r->seqs, &s);
    st->num_pages = s.num_pages;
    st->free_pages = s.free_pages;
    st->used_pages = s.used_pages;
    st->shared_pages = s.shared_pages;
    st->num_seqs = s.num_seqs;
    st->num_tokens = s.num_tokens;
    st->page_refs = s.page_refs;
    st->page_bytes =
        r->backend->derived.layer_bytes / r->backend->geom.num_pages * r->backend->geom.num_layers;
    st->num_clients = r->num_clients;
    st->uptime_ms = now_ms - r->start_ms;
    st->requests_total = r->requests_total;
    st->append_bytes_total = r->append_bytes_total;
    for (uint32_t i = 0; i < r->ns.max && st->namespaces_count < 64; i++) {
        const kvp_ns_t *n = &r->ns.ns[i];
        if (!n->in_use)
            continue;
        kvp_ns_stats_t ns;
        kvp_seqtab_ns_stats(r->seqs, i, &ns);
        kvpool_NamespaceStats *o = &st->namespaces[st->namespaces_count++];
        snprintf(o->name, sizeof(o->name), "%s", n->name);
        o->num_seqs = ns.num_seqs;
        o->num_tokens = ns.num_tokens;
        o->page_refs = ns.page_refs;
        o->sessions = n->sessions;
        o->lease_ms = n->lease_ms;
        o->lease_expires_in_ms = n->expires_at_ms > now_ms ? n->expires_at_ms - now_ms : 0;
    }
    return 0;
}

static int do_list_seqs(kvp_rpc_t *r, kvp_session_t *s, const kvpool_ListSequencesRequest *q,
                        kvp_rpc_io_t *io, uint64_t id, uint64_t now_ms)
{
    uint32_t ns = s->ns;
    if (q->namespace[0]) {
        int found = -1;
        for (uint32_t i = 0; i < r->ns.max; i++)
            if (r->ns.ns[i].in_use && strcmp(r->ns.ns[i].name, q->namespace) == 0)
                found = (int)i;
        if (found < 0) {
            kvp_rpc_error(&io->resp, id, KVP_ENOENT, "no namespace '%s'", q->namespace);
            return 0;
        }
        ns = (uint32_t)found;
    }
    uint32_t limit = q->limit && q->limit < 256 ? q->limit : 256;
    ok(&io->resp, id, kvpool_Response_list_sequences_tag);
    kvpool_ListSequencesResponse *lr = &io->resp.body.list_sequences;
    uint32_t cur = q->cursor;
    const kvp_seq_t *seq;
    while (lr->seqs_count < limit && (seq = kvp_seqtab_next(r->seqs, &cur))) {
        if (seq->ns != ns)
            continue;
        kvpool_SequenceInfo *o = &lr->seqs[lr->seqs_count++];
        o->seq_id = seq->id;
        o->num_tokens = seq->num_tokens;
        o->num_pages = seq->num_pages;
        for (uint32_t i = 0; i < seq->num_pages; i++)
            o->shared_pages += kvp_alloc_refcount(r->alloc, seq->pages[i]) > 1;
        o->idle_ms = now_ms > seq->last_touch_ms ? now_ms - seq->last_touch_ms : 0;
    }
    /* a cursor is a record index + 1; 0 means done */
    uint32_t probe = cur;
    lr->next_cursor = kvp_seqtab_next(r->seqs, &probe) ? cur : 0;
    return 0;
}

static int do_list_clients(kvp_rpc_t *r, kvp_rpc_io_t *io, uint64_t id, uint64_t now_ms)
{
    ok(&io->resp, id, kvpool_Response_list_clients_tag);
    kvpool_ListClientsResponse *lr = &io->resp.body.list_clients;
    for (kvp_session_t *s = r->sessions; s && lr->clients_count < 256; s = s->next) {
        kvpool_ClientInfo *o = &lr->clients[lr->clients_count++];
        o->session_id = s->id;
        snprintf(o->namespace, sizeof(o->namespace), "%s", s->ns_name);
        snprintf(o->client_name, sizeof(o->client_name), "%s", s->name);
        o->pid = s->pid;
        o->uid = s->uid;
        o->gid = s->gid;
        o->requests = s->requests;
        o->connected_ms = now_ms - s->connected_ms;
        o->buffers = s->num_buffers;
    }
    return 0;
}

static int do_audit(kvp_rpc_t *r, kvp_rpc_io_t *io, uint64_t id)
{
    ok(&io->resp, id, kvpool_Response_audit_tag);
    kvpool_AuditResponse *ar = &io->resp.body.audit;
    int rc = kvp_seqtab_audit(r->seqs, ar->message, sizeof(ar->message));
    ar->ok = rc == 0;
    if (rc == 0)
        snprintf(ar->message, sizeof(ar->message), "ok");
    else if (rc != KVP_EAUDIT)
        snprintf(ar->message, sizeof(ar->message), "audit could not run: %s", kvp_strerror(rc));
    if (rc)
        kvp_log(KVP_LOG_ERR, "audit failed reason=\"%s\"", ar->message);
    return 0;
}

/* ---- transfers between daemons (kvp_xfer.h) ------------------------------------------- */

static kvp_rpc_job_t *xfer_job_new(uint64_t num_pages, uint32_t nseq, const uint64_t *ids)
{
    kvp_rpc_job_t *j = calloc(1, sizeof(*j));
    if (!j)
        return NULL;
    j->pinned = malloc(((size_t)num_pages + 1) * sizeof(uint32_t));
    j->seq_ids = malloc((size_t)nseq * sizeof(uint64_t));
    if (!j->pinned || !j->seq_ids) {
        kvp_rpc_job_free(j);
        return NULL;
    }
    memcpy(j->seq_ids, ids, (size_t)nseq * sizeof(uint64_t));
    j->batch_size = nseq;
    return j;
}

static void xfer_pin(kvp_rpc_t *r, kvp_rpc_job_t *j, const uint32_t *pages, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        kvp_alloc_pin(r->alloc, pages[i]);
        j->pinned[j->num_pinned++] = pages[i];
    }
}

static void xfer_unpin(kvp_rpc_t *r, kvp_rpc_job_t *j)
{
    for (uint32_t i = 0; i < j->num_pinned; i++)
        kvp_alloc_unpin(r->alloc, j->pinned[i]);
    j->num_pinned = 0;
}

/* The sequences a transfer request names: the set seq_ids, else the one seq_id. 0, or an
 * error answered (seq_id beside a set, a sequence named twice). */
static int xfer_ids(kvpool_Response *resp, uint64_t id, const uint64_t *seq_id, const uint64_t *set,
                    uint32_t set_count, const uint64_t **ids, uint32_t *n)
{
    if (set_count && *seq_id) {
        kvp_rpc_error(resp, id, KVP_EINVAL,
                      "seq_id %llu beside seq_ids: name a set in seq_ids "
                      "only",
                      (unsigned long long)*seq_id);
        return KVP_EINVAL;
    }
    *ids = set_count ? set : seq_id; /* the request's own field: it outlives the call */
    *n = set_count ? set_count : 1;
    for (uint32_t i = 1; i < *n; i++)
        for (uint32_t k = 0; k < i; k++)
            if ((*ids)[i] == (*ids)[k]) {
                kvp_rpc_error(resp, id, KVP_EINVAL, "sequence %llu is named twice in seq_ids",
                              (unsigned long long)(*ids)[i]);
                return KVP_EINVAL;
            }
    return 0;
}

/* ExportBegin: answers at once with the communicator's id; the send runs as io->bg_job. The
 * sequences' pages are pinned until it ends (a Release meanwhile cannot hand them to another
 * sequence); tokens appended meanwhile are not part of the transfer. */
static int do_export_begin(kvp_rpc_t *r, kvp_session_t *s, const kvpool_ExportBeginRequest *q,
                           kvp_rpc_io_t *io, uint64_t id, uint64_t now_ms)
{
    kvpool_Response *resp = &io->resp;
    const uint64_t *ids;
    uint32_t n;
    if (xfer_ids(resp, id, &q->seq_id, q->seq_ids, q->seq_ids_count, &ids, &n))
        return KVP_RPC_DONE;
    const kvp_seq_t *seqs[KVP_XFER_MAX_SEQS];
    const uint32_t *pages[KVP_XFER_MAX_SEQS];
    uint32_t toks[KVP_XFER_MAX_SEQS];
    uint64_t total = 0, np = 0, bytes = 0;
    char why[200];
    int rc = 0;
    for (uint32_t i = 0; i < n; i++) {
        seqs[i] = kvp_seqtab_find(r->seqs, s->ns, ids[i]);
        if (!seqs[i]) {
            kvp_rpc_error(resp, id, KVP_ENOENT, "no sequence %llu", (unsigned long long)ids[i]);
            return KVP_RPC_DONE;
        }
        rc = kvp_xfer_check_export(&r->backend->geom, seqs[i]->num_tokens, q->timeout_ms, why,
                                   sizeof(why));
        if (rc && n > 1)
            kvp_rpc_error(resp, id, rc, "sequence %llu: %s", (unsigned long long)ids[i], why);
        else if (rc)
            kvp_rpc_error(resp, id, rc, "%s", why);
        if (rc)
            return KVP_RPC_DONE;
        pages[i] = seqs[i]->pages;
        toks[i] = seqs[i]->num_tokens;
        total += toks[i];
        np += seqs[i]->num_pages;
        bytes += kvp_xfer_stream_bytes(&r->backend->geom, toks[i]);
    }
    if (total > INT32_MAX) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "the set holds %llu tokens, above %d",
                      (unsigned long long)total, INT32_MAX);
        return KVP_RPC_DONE;
    }
    rc = kvp_xfer_check_ready(r->xfer, why, sizeof(why));
    if (rc) {
        kvp_rpc_error(resp, id, rc, "%s", why);
        return KVP_RPC_DONE;
    }
    kvp_rpc_job_t *j = xfer_job_new(np, n, ids);
    uint8_t nid[KVP_XFER_ID_BYTES];
    uint64_t tid = 0;
    const kvp_xfer_set_t set = {.n = n, .seq_ids = ids, .tokens = toks, .pages = pages};
    kvp_xfer_stream_t st;
    rc = j ? kvp_xfer_export_begin(r->xfer, q->peer, s->ns_name, &set, q->timeout_ms, now_ms, nid,
                                   &tid, &st, &j->xfer)
           : KVP_ENOMEM;
    if (rc) {
        kvp_rpc_job_free(j);
        kvp_rpc_error(resp, id, rc, "cannot start the export: %s", kvp_strerror(rc));
        return KVP_RPC_DONE;
    }
    j->rpc = r;
    j->xfer_dir = KVP_XFER_EXPORT;
    j->xfer_seq = ids[0];
    j->xfer_id = tid;
    j->xfer_tokens = (uint32_t)total;
    for (uint32_t i = 0; i < n; i++)
        xfer_pin(r, j, seqs[i]->pages, seqs[i]->num_pages);
    ok(resp, id, kvpool_Response_export_begin_tag);
    kvpool_ExportBeginResponse *er = &resp->body.export_begin;
    memcpy(er->nccl_id.bytes, nid, KVP_XFER_ID_BYTES);
    er->nccl_id.size = KVP_XFER_ID_BYTES;
    er->transfer_id = tid;
    er->num_tokens = (uint32_t)total;
    er->num_layers = r->backend->geom.num_layers;
    er->bytes = bytes;
    er->chunk_bytes = st.chunk_bytes;
    er->flags = st.flags;
    er->seq_tokens_count = n;
    memcpy(er->seq_tokens, toks, (size_t)n * sizeof(uint32_t));
    io->bg_job = j;
    return KVP_RPC_DONE;
}

/* Import: the new sequences' pages are allocated all-or-nothing here, the receive runs as the
 * connection's job, and kvp_rpc_job_finish answers; a failed transfer releases the sequences,
 * so the pool is as it was before the call. */
static int do_import(kvp_rpc_t *r, kvp_session_t *s, const kvpool_ImportRequest *q,
                     kvp_rpc_io_t *io, uint64_t id, uint64_t now_ms)
{
    kvpool_Response *resp = &io->resp;
    const kvp_geom_t *g = &r->backend->geom;
    const uint64_t *ids;
    uint32_t n;
    if (xfer_ids(resp, id, &q->seq_id, q->seq_ids, q->seq_ids_count, &ids, &n))
        return KVP_RPC_DONE;
    const uint32_t *toks = q->seq_ids_count ? q->seq_tokens : &q->num_tokens;
    if (q->seq_ids_count) {
        uint64_t sum = 0;
        for (uint32_t i = 0; i < q->seq_tokens_count; i++)
            sum += q->seq_tokens[i];
        if (q->seq_tokens_count != n || sum != q->num_tokens) {
            kvp_rpc_error(resp, id, KVP_EINVAL,
                          "seq_tokens (%u entries, %llu tokens) must give each of the %u seq_ids "
                          "its tokens, num_tokens (%u) in all, as ExportBegin answered",
                          (unsigned)q->seq_tokens_count, (unsigned long long)sum, n, q->num_tokens);
            return KVP_RPC_DONE;
        }
    }
    uint64_t cap = (uint64_t)g->num_pages * g->page_size;
    uint32_t max_tokens = r->lim.max_seq_tokens && r->lim.max_seq_tokens < cap
                              ? r->lim.max_seq_tokens
                              : (uint32_t)(cap < 0x7fffffffu ? cap : 0x7fffffffu);
    char why[200];
    int rc = 0;
    for (uint32_t i = 0; i < n && !rc; i++) {
        if (kvp_seqtab_find(r->seqs, s->ns, ids[i])) {
            kvp_rpc_error(resp, id, KVP_EEXIST, "sequence %llu already exists",
                          (unsigned long long)ids[i]);
            return KVP_RPC_DONE;
        }
        rc = kvp_xfer_check_import(g, q->nccl_id.size, q->transfer_id, toks[i], max_tokens,
                                   q->num_layers, q->timeout_ms, why, sizeof(why));
    }
    const kvp_xfer_stream_t st = {
        .bytes = q->bytes, .chunk_bytes = q->chunk_bytes, .flags = q->flags};
    if (!rc)
        rc = kvp_xfer_check_stream(&st, why, sizeof(why));
    if (!rc && n > r->lim.max_batch) {
        snprintf(why, sizeof(why), "a set of %u sequences is above limits.max_batch (%u)", n,
                 r->lim.max_batch);
        rc = KVP_ELIMIT;
    }
    if (!rc)
        rc = kvp_xfer_check_ready(r->xfer, why, sizeof(why));
    if (rc) {
        kvp_rpc_error(resp, id, rc, "%s", why);
        return KVP_RPC_DONE;
    }
    for (uint32_t i = 0; i < n; i++) {
        r->items[i].ns = s->ns;
        r->items[i].seq_id = ids[i];
        r->items[i].num_tokens = toks[i];
    }
    rc = kvp_plan_append(r->seqs, r->items, n, &r->plan_limits, now_ms, &r->plan);
    if (rc) {
        count_alloc_failure(r, rc);
        kvp_rpc_error(resp, id, rc, "%s", plan_error_text(rc));
        return KVP_RPC_DONE;
    }
    r->pages_allocated_total += r->plan.num_new_pages;
    const kvp_seq_t *seqs[KVP_XFER_MAX_SEQS];
    const uint32_t *pages[KVP_XFER_MAX_SEQS];
    uint64_t np = 0;
    for (uint32_t i = 0; i < n; i++) {
        seqs[i] = kvp_seqtab_find(r->seqs, s->ns, ids[i]);
        pages[i] = seqs[i]->pages;
        np += seqs[i]->num_pages;
    }
    kvp_rpc_job_t *j = xfer_job_new(np, n, ids);
    const kvp_xfer_set_t set = {.n = n, .seq_ids = ids, .tokens = toks, .pages = pages};
    rc = j ? kvp_xfer_import_begin(r->xfer, q->nccl_id.bytes, q->transfer_id, s->ns_name, &set, &st,
                                   q->timeout_ms, now_ms, &j->xfer)
           : KVP_ENOMEM;
    if (rc) {
        kvp_rpc_job_free(j);
        for (uint32_t i = 0; i < n; i++)
            kvp_seqtab_release(r->seqs, s->ns, ids[i]);
        kvp_rpc_error(resp, id, rc, "cannot start the import: %s",
                      rc == KVP_EBUSY ? "a transfer on this communicator is still running"
                                      : kvp_strerror(rc));
        return KVP_RPC_DONE;
    }
    j->rpc = r;
    j->req_id = id;
    j->ns = s->ns;
    j->xfer_dir = KVP_XFER_IMPORT;
    j->xfer_seq = ids[0];
    j->xfer_id = q->transfer_id;
    j->xfer_tokens = q->num_tokens;
    for (uint32_t i = 0; i < n; i++)
        xfer_pin(r, j, seqs[i]->pages, seqs[i]->num_pages);
    io->job = j;
    return KVP_RPC_ASYNC;
}

static void finish_import(kvp_rpc_t *r, kvp_rpc_job_t *j, kvp_rpc_io_t *io, uint64_t now_ms)
{
    char msg[160];
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < j->batch_size; i++) {
        const kvp_seq_t *seq = kvp_seqtab_find(r->seqs, j->ns, j->seq_ids[i]);
        bytes += seq ? kvp_xfer_stream_bytes(&r->backend->geom, seq->num_tokens) : 0;
    }
    int rc = kvp_xfer_finish(r->xfer, j->xfer, now_ms, msg, sizeof(msg));
    j->xfer = NULL;
    xfer_unpin(r, j);
    if (rc) {
        /* the new pages may hold part of the stream: they go back to the free list */
        for (uint32_t i = 0; i < j->batch_size; i++)
            kvp_seqtab_release(r->seqs, j->ns, j->seq_ids[i]);
        kvp_rpc_error(&io->resp, j->req_id, rc, "import failed: %s", msg);
        return;
    }
    uint32_t pages = 0;
    for (uint32_t i = 0; i < j->batch_size; i++) {
        const kvp_seq_t *seq = kvp_seqtab_find(r->seqs, j->ns, j->seq_ids[i]);
        pages += seq ? seq->num_pages : 0;
    }
    ok(&io->resp, j->req_id, kvpool_Response_import_tag);
    kvpool_ImportResponse *ir = &io->resp.body.import;
    ir->transfer_id = j->xfer_id;
    ir->num_tokens = j->xfer_tokens;
    ir->num_pages = pages;
    ir->bytes = bytes;
}

void kvp_rpc_bg_finish(kvp_rpc_t *r, kvp_rpc_job_t *j, uint64_t now_ms)
{
    if (!j->xfer)
        return;
    kvp_xfer_finish(r->xfer, j->xfer, now_ms, NULL, 0); /* logged and counted there */
    j->xfer = NULL;
    xfer_unpin(r, j);
}

static int do_list_transfers(kvp_rpc_t *r, kvp_rpc_io_t *io, uint64_t id, uint64_t now_ms)
{
    ok(&io->resp, id, kvpool_Response_list_transfers_tag);
    kvpool_ListTransfersResponse *lr = &io->resp.body.list_transfers;
    kvp_xfer_info_t info[32];
    uint32_t n = kvp_xfer_list(r->xfer, info, 32);
    static const char *const states[] = {"running", "ok", "failed"};
    for (uint32_t i = 0; i < n; i++) {
        kvpool_TransferInfo *o = &lr->transfers[lr->transfers_count++];
        const kvp_xfer_info_t *in = &info[i];
        o->transfer_id = in->transfer_id;
        snprintf(o->direction, sizeof(o->direction), "%s", in->direction ? "import" : "export");
        snprintf(o->peer, sizeof(o->peer), "%s", in->peer);
        snprintf(o->namespace, sizeof(o->namespace), "%s", in->ns);
        o->seq_id = in->seq_id;
        o->num_seqs = in->num_seqs;
        o->num_tokens = in->num_tokens;
        o->bytes = in->bytes;
        snprintf(o->state, sizeof(o->state), "%s", states[in->state]);
        snprintf(o->message, sizeof(o->message), "%s", in->message);
        o->elapsed_ms = (in->state ? in->end_ms : now_ms) - in->start_ms;
    }
    return KVP_RPC_DONE;
}

int kvp_rpc_dispatch(kvp_rpc_t *r, kvp_session_t *s, kvpool_Request *req, kvp_rpc_io_t *io,
                     uint64_t now_ms)
{
    const uint64_t id = req->id;
    io->job = NULL;
    io->bg_job = NULL;
    io->nfds_out = 0;
    io->mutating = kvp_rpc_is_mutating(req->which_body);
    memset(&io->out, 0, sizeof(io->out));
    s->requests++;
    r->requests_total++;
    if (!s->hello_done && req->which_body != kvpool_Request_hello_tag &&
        req->which_body != kvpool_Request_ping_tag) {
        kvp_rpc_error(&io->resp, id, KVP_EPRECOND, "the first request must be Hello");
        return KVP_RPC_DONE;
    }
    if (io->nfds_in > 0 && req->which_body != kvpool_Request_register_buffer_tag) {
        kvp_rpc_error(&io->resp, id, KVP_EINVAL,
                      "request carries %d fds; only RegisterBuffer takes one", io->nfds_in);
        return KVP_RPC_DONE;
    }
    if (r->unhealthy && req->which_body != kvpool_Request_ping_tag) {
        kvp_rpc_error(&io->resp, id, KVP_EUNAVAIL, "daemon is unhealthy");
        return KVP_RPC_DONE;
    }
    switch (req->which_body) {
    case kvpool_Request_hello_tag:
        return do_hello(r, s, &req->body.hello, io, id);
    case kvpool_Request_ping_tag:
        ok(&io->resp, id, kvpool_Response_ping_tag);
        io->resp.body.ping.nonce = req->body.ping.nonce;
        return KVP_RPC_DONE;
    case kvpool_Request_pool_info_tag: {
        ok(&io->resp, id, kvpool_Response_pool_info_tag);
        fill_pool_info(r, &io->resp.body.pool_info);
        int rc = req->body.pool_info.want_pool_fds
                     ? attach_pool_fds(r, io, &io->resp.body.pool_info)
                     : 0;
        if (rc)
            kvp_rpc_error(&io->resp, id, KVP_EINTERNAL, "cannot export the pool");
        return KVP_RPC_DONE;
    }
    case kvpool_Request_register_buffer_tag:
        return do_register(r, s, &req->body.register_buffer, io, id);
    case kvpool_Request_unregister_buffer_tag:
        return do_unregister(r, s, &req->body.unregister_buffer, io, id);
    case kvpool_Request_append_tag:
        return do_append(r, s, &req->body.append, io, id, now_ms);
    case kvpool_Request_reserve_tag:
        return do_reserve(r, s, io, id, now_ms);
    case kvpool_Request_fork_tag:
        return do_fork(r, s, &req->body.fork, io, id, now_ms);
    case kvpool_Request_truncate_tag:
        return do_truncate(r, s, &req->body.truncate, io, id, now_ms);
    case kvpool_Request_release_tag:
        return do_release(r, s, io, id);
    case kvpool_Request_get_page_table_tag:
        return do_page_table(r, s, io, id);
    case kvpool_Request_stats_tag:
        return do_stats(r, io, id, now_ms);
    case kvpool_Request_list_sequences_tag:
        return do_list_seqs(r, s, &req->body.list_sequences, io, id, now_ms);
    case kvpool_Request_list_clients_tag:
        return do_list_clients(r, io, id, now_ms);
    case kvpool_Request_audit_tag:
        return do_audit(r, io, id);
    case kvpool_Request_export_begin_tag:
        return do_export_begin(r, s, &req->body.export_begin, io, id, now_ms);
    case kvpool_Request_import_tag:
        return do_import(r, s, &req->body.import, io, id, now_ms);
    case kvpool_Request_list_transfers_tag:
        return do_list_transfers(r, io, id, now_ms);
    case kvpool_Request_metrics_tag:
        /* the text is produced by the server layer, which owns the buffer (kvp_rpc_metrics) */
        ok(&io->resp, id, kvpool_Response_metrics_tag);
        return KVP_RPC_DONE;
    default:
        kvp_rpc_error(&io->resp, id, KVP_EINVAL, "unknown or empty request body (tag %u)",
                      (unsigned)req->which_body);
        return KVP_RPC_DONE;
    }
}

/* ---- metrics -------------------------------------------------------------------------- */

/* Index = Request body tag. 0 stands for a frame that did not decode or named no call. */
static const char *const call_names[NUM_CALLS] = {"invalid",
                                                  NULL,
                                                  "hello",
                                                  "ping",
                                                  "pool_info",
                                                  "register_buffer",
                                                  "unregister_buffer",
                                                  "append",
                                                  "reserve",
                                                  "fork",
                                                  "truncate",
                                                  "release",
                                                  "get_page_table",
                                                  "stats",
                                                  "list_sequences",
                                                  "list_clients",
                                                  "audit",
                                                  "metrics",
                                                  [40] = "export_begin",
                                                  [41] = "import",
                                                  [42] = "list_transfers"};

static unsigned bucket_of(uint64_t ns)
{
    unsigned k = 0;
    uint64_t bound = 1000;
    while (k < NUM_BUCKETS - 1 && ns > bound) {
        k++;
        bound <<= 1;
    }
    return k;
}

void kvp_rpc_observe(kvp_rpc_t *r, pb_size_t which, kvpool_Code code, uint64_t latency_ns)
{
    if (which >= NUM_CALLS || !call_names[which] || (unsigned)code >= NUM_CODES)
        return;
    r->calls[which][code]++;
    r->lat_buckets[which][bucket_of(latency_ns)]++;
    r->lat_sum_ns[which] += latency_ns;
}

void kvp_rpc_observe_run(kvp_rpc_t *r, uint64_t run_ns)
{
    r->run_buckets[bucket_of(run_ns)]++;
    r->run_sum_ns += run_ns;
}

/* Room kept at the end of the metrics buffer for the truncation notice. */
#define TRUNC_NOTE_BYTES 96

typedef struct {
    char *buf;
    size_t cap, len; /* cap: usable bytes for samples, the note's room excluded */
    int truncated;
} sbuf_t;

/* Appends whole text or nothing: a scraper must never see half a sample line. */
static void put(sbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(sbuf_t *b, const char *fmt, ...)
{
    if (b->truncated)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->buf + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= b->cap - b->len) {
        b->buf[b->len] = '\0';
        b->truncated = 1;
        return;
    }
    b->len += (size_t)n;
}

static void put_header(sbuf_t *b, const char *name, const char *type, const char *help)
{
    put(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

enum { NS_SEQS, NS_TOKENS, NS_PAGE_REFS };

/* One gauge family with a sample per namespace in use: its sequences, tokens or page refs. */
static void put_ns_family(sbuf_t *b, kvp_rpc_t *r, const char *name, const char *help, int what)
{
    char esc[2 * KVP_NS_NAME_MAX + 2];
    put_header(b, name, "gauge", help);
    for (uint32_t i = 0; i < r->ns.max; i++) {
        if (!r->ns.ns[i].in_use)
            continue;
        kvp_ns_stats_t ns;
        kvp_seqtab_ns_stats(r->seqs, i, &ns);
        kvp__rpc_label_escape(r->ns.ns[i].name, esc, sizeof(esc));
        const uint64_t v = what == NS_SEQS     ? ns.num_seqs
                           : what == NS_TOKENS ? ns.num_tokens
                                               : ns.page_refs;
        put(b, "%s{namespace=\"%s\"} %llu\n", name, esc, (unsigned long long)v);
    }
}

/* A namespace name is chosen by a client: escape it as a label value (backslash, quote and
 * newline as the format says; other control bytes and invalid UTF-8 become '?') so that no
 * name can break or forge a line. out holds at least 2 * KVP_NS_NAME_MAX + 1 bytes. */
void kvp__rpc_label_escape(const char *in, char *out, size_t cap)
{
    size_t o = 0;
    const unsigned char *s = (const unsigned char *)in;
    while (*s && o + 3 < cap) {
        size_t n = kvp_utf8_len(s);
        if (*s == '\\' || *s == '"') {
            out[o++] = '\\';
            out[o++] = (char)*s++;
        } else if (*s == '\n') {
            out[o++] = '\\';
            out[o++] = 'n';
            s++;
        } else if (n == 0 || *s < 0x20 || *s == 0x7f) {
            out[o++] = '?';
            s++;
        } else if (o + n < cap) {
            memcpy(out + o, s, n);
            o += n;
            s += n;
        } else {
            break;
        }
    }
    out[o] = '\0';
}

static void put_histogram(sbuf_t *b, const char *name, const char *label, const char *value,
                          const uint64_t *buckets, uint64_t sum_ns)
{
    uint64_t cum = 0, total = 0;
    for (unsigned k = 0; k < NUM_BUCKETS; k++)
        total += buckets[k];
    char lbl[96] = "";
    if (label)
        snprintf(lbl, sizeof(lbl), "%s=\"%s\",", label, value);
    double bound = 1e-6;
    for (unsigned k = 0; k < NUM_BUCKETS - 1; k++, bound *= 2) {
        cum += buckets[k];
        put(b, "%s_bucket{%sle=\"%.9g\"} %llu\n", name, lbl, bound, (unsigned long long)cum);
    }
    put(b, "%s_bucket{%sle=\"+Inf\"} %llu\n", name, lbl, (unsigned long long)total);
    if (label) {
        put(b, "%s_sum{%s=\"%s\"} %.9f\n", name, label, value, (double)sum_ns / 1e9);
        put(b, "%s_count{%s=\"%s\"} %llu\n", name, label, value, (unsigned long long)total);
    } else {
        put(b, "%s_sum %.9f\n%s_count %llu\n", name, (double)sum_ns / 1e9, name,
            (unsigned long long)total);
    }
}

size_t kvp_rpc_metrics_text(kvp_rpc_t *r, char *buf, size_t cap, uint64_t now_ms)
{
    if (!buf || cap == 0)
        return 0;
    buf[0] = '\0';
    if (cap <= TRUNC_NOTE_BYTES)
        return 0;
    sbuf_t b = {buf, cap - TRUNC_NOTE_BYTES, 0, 0};
    kvp_stats_t s;
    kvp_seqtab_stats(r->seqs, &s);
    const kvp_backend_t *be = r->backend;
    uint64_t page_bytes = be->derived.layer_bytes / be->geom.num_pages * be->geom.num_layers;

    put_header(&b, "kvpool_build_info", "gauge",
               "Build information: version and pool backend (always 1).");
    put(&b, "kvpool_build_info{version=\"%s\",backend=\"%s\"} 1\n", KVP_VERSION, be->ops->name);
    put_header(&b, "kvpool_up", "gauge", "Whether the daemon can serve (1) or is unhealthy (0).");
    put(&b, "kvpool_up %d\n", kvp_rpc_healthy(r));
    put_header(&b, "kvpool_uptime_seconds", "gauge", "Seconds since the daemon started.");
    put(&b, "kvpool_uptime_seconds %.3f\n", (double)(now_ms - r->start_ms) / 1000.0);

    /* Every device of the tensor-parallel group holds the same pages (DESIGN.md §6): one page
     * table, H/G heads each. The device label is the CUDA ordinal on the cuda backend and the
     * group index on the host backend. */
    const char *states[] = {"capacity", "used", "free", "shared"};
    uint32_t vals[] = {s.num_pages, s.used_pages, s.free_pages, s.shared_pages};
    uint32_t ndev = be->geom.num_devices ? be->geom.num_devices : 1;
    put_header(&b, "kvpool_pages", "gauge",
               "Pages of the pool on each device by state (capacity = used + free; shared: "
               "held by more than one sequence).");
    for (uint32_t d = 0; d < ndev; d++)
        for (int i = 0; i < 4; i++)
            put(&b, "kvpool_pages{device=\"%d\",state=\"%s\"} %u\n",
                d < be->num_device_ids ? be->device_ids[d] : (int)d, states[i], vals[i]);
    put_header(&b, "kvpool_pool_bytes", "gauge",
               "Bytes of the pool on each device by state (pages times the bytes of one page, "
               "all layers, K and V).");
    for (uint32_t d = 0; d < ndev; d++)
        for (int i = 0; i < 4; i++)
            put(&b, "kvpool_pool_bytes{device=\"%d\",state=\"%s\"} %llu\n",
                d < be->num_device_ids ? be->device_ids[d] : (int)d, states[i],
                (unsigned long long)vals[i] * page_bytes);
    put_header(&b, "kvpool_page_size_bytes", "gauge",
               "Bytes of one page on one device (all layers, K and V).");
    put(&b, "kvpool_page_size_bytes %llu\n", (unsigned long long)page_bytes);

    uint32_t num_ns = 0;
    for (uint32_t i = 0; i < r->ns.max; i++)
        num_ns += r->ns.ns[i].in_use != 0;
    put_header(&b, "kvpool_namespaces", "gauge", "Namespaces (engines) known to the daemon.");
    put(&b, "kvpool_namespaces %u\n", num_ns);
    put_header(&b, "kvpool_live_sequences", "gauge", "Live sequences over all namespaces.");
    put(&b, "kvpool_live_sequences %u\n", s.num_seqs);
    put_header(&b, "kvpool_live_tokens", "gauge", "Tokens held over all namespaces.");
    put(&b, "kvpool_live_tokens %llu\n", (unsigned long long)s.num_tokens);
    put_ns_family(&b, r, "kvpool_sequences", "Live sequences per namespace.", NS_SEQS);
    put_ns_family(&b, r, "kvpool_tokens", "Tokens held per namespace.", NS_TOKENS);
    put_ns_family(&b, r, "kvpool_page_refs",
                  "Page references held per namespace (a shared page counts once per holder).",
                  NS_PAGE_REFS);
    put_header(&b, "kvpool_connected_clients", "gauge", "Open client connections (sessions).");
    put(&b, "kvpool_connected_clients %u\n", r->num_clients);

    put_header(&b, "kvpool_page_allocations_total", "counter",
               "Pages taken from the free list by Append and Reserve (copy-on-write included).");
    put(&b, "kvpool_page_allocations_total %llu\n", (unsigned long long)r->pages_allocated_total);
    put_header(&b, "kvpool_allocation_failures_total", "counter",
               "Append or Reserve batches refused by the planner, by reason (exhausted: not "
               "enough free pages; limit: a configured limit; invalid: a bad request).");
    const char *reasons[] = {"exhausted", "limit", "invalid", "other"};
    for (int i = 0; i < 4; i++)
        put(&b, "kvpool_allocation_failures_total{reason=\"%s\"} %llu\n", reasons[i],
            (unsigned long long)r->alloc_failures[i]);
    put_header(&b, "kvpool_cow_copies_total", "counter", "Pages copied on write.");
    put(&b, "kvpool_cow_copies_total %llu\n", (unsigned long long)r->cow_copies_total);
    put_header(&b, "kvpool_lease_expiries_total", "counter",
               "Namespaces released because their lease ran out with no session attached.");
    put(&b, "kvpool_lease_expiries_total %llu\n", (unsigned long long)r->lease_expiries_total);
    put_header(&b, "kvpool_evicted_sequences_total", "counter",
               "Sequences released by the daemon rather than by their client (lease expiry; "
               "the daemon never evicts for space: a full pool answers RESOURCE_EXHAUSTED).");
    put(&b, "kvpool_evicted_sequences_total{reason=\"lease_expired\"} %llu\n",
        (unsigned long long)r->evicted_seqs_total);
    put_header(&b, "kvpool_evicted_pages_total", "counter",
               "Pages returned to the free list by those evictions.");
    put(&b, "kvpool_evicted_pages_total{reason=\"lease_expired\"} %llu\n",
        (unsigned long long)r->evicted_pages_total);
    put_header(&b, "kvpool_append_bytes_total", "counter",
               "K and V bytes copied into the pool by daemon-run Appends (all layers).");
    put(&b, "kvpool_append_bytes_total %llu\n", (unsigned long long)r->append_bytes_total);
    put_header(&b, "kvpool_append_run_seconds", "histogram",
               "Time a copy worker spent running one Append plan: copy-on-write copies and "
               "the append (host: the CPU copy; cuda: waiting for the worker's ready event and "
               "the launches, the GPU may still be running when event sync is used).");
    put_histogram(&b, "kvpool_append_run_seconds", NULL, NULL, r->run_buckets, r->run_sum_ns);

    uint64_t xt[2][2], xb[2];
    uint32_t x_in_flight, x_comms;
    kvp_xfer_counters(r->xfer, xt, xb, &x_in_flight, &x_comms);
    static const char *const dirs[] = {"export", "import"};
    put_header(&b, "kvpool_transfers_total", "counter",
               "KV transfers between daemons (ExportBegin / Import over NCCL) that ended, by "
               "direction and result (ok, failed: an error, a refusal or the deadline).");
    for (int d = 0; d < 2; d++)
        for (int k = 0; k < 2; k++)
            put(&b, "kvpool_transfers_total{direction=\"%s\",result=\"%s\"} %llu\n", dirs[d],
                k ? "failed" : "ok", (unsigned long long)xt[d][k]);
    put_header(&b, "kvpool_transfer_bytes_total", "counter",
               "Bytes of the packed KV streams of transfers that succeeded, by direction.");
    for (int d = 0; d < 2; d++)
        put(&b, "kvpool_transfer_bytes_total{direction=\"%s\"} %llu\n", dirs[d],
            (unsigned long long)xb[d]);
    put_header(&b, "kvpool_transfers_in_flight", "gauge", "KV transfers running now.");
    put(&b, "kvpool_transfers_in_flight %u\n", x_in_flight);
    put_header(&b, "kvpool_transfer_communicators", "gauge",
               "NCCL communicators cached for transfers (one per peer and direction).");
    put(&b, "kvpool_transfer_communicators %u\n", x_comms);

    put_header(&b, "kvpool_rpc_requests_total", "counter",
               "Requests answered, by call and status code (call=\"invalid\": a frame that did "
               "not decode or named no call).");
    for (unsigned c = 0; c < NUM_CALLS; c++)
        for (unsigned k = 0; k < NUM_CODES; k++)
            if (call_names[c] && r->calls[c][k])
                put(&b, "kvpool_rpc_requests_total{call=\"%s\",code=\"%s\"} %llu\n", call_names[c],
                    kvp_wire_code_name((kvpool_Code)k), (unsigned long long)r->calls[c][k]);
    put_header(&b, "kvpool_rpc_duration_seconds", "histogram",
               "Time from a request's frame to its answer, by call.");
    for (unsigned c = 0; c < NUM_CALLS; c++) {
        uint64_t total = 0;
        for (unsigned k = 0; call_names[c] && k < NUM_BUCKETS; k++)
            total += r->lat_buckets[c][k];
        if (total)
            put_histogram(&b, "kvpool_rpc_duration_seconds", "call", call_names[c],
                          r->lat_buckets[c], r->lat_sum_ns[c]);
    }
    if (b.truncated) {
        /* the note's room was kept out of b.cap */
        int n =
            snprintf(buf + b.len, TRUNC_NOTE_BYTES, "# kvpool: truncated at %zu bytes\n", b.len);
        if (n > 0 && n < TRUNC_NOTE_BYTES)
            b.len += (size_t)n;
        kvp_log(KVP_LOG_WARNING, "metrics truncated bytes=%zu", b.len);
    }
    return b.len;
}
