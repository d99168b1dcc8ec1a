/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc_xfer.c - the transfer calls between daemons: ExportBegin (answered at once, the send as a
 * background job), Import (off the loop), ListTransfers (see kvp_rpc_internal.h).
 */
#include "kvp_rpc_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_log.h"

/* A transfer's job (ExportBegin's send in the background, Import's receive for its call):
 * the pages it reads or writes stay pinned until it finished. */
typedef struct {
    kvp_rpc_job_t base;
    kvp_xfer_job_t *xfer;
    uint32_t ns;       /* Import: the namespace of the new sequences */
    uint64_t *seq_ids; /* [num_seqs] */
    uint32_t num_seqs;
    uint32_t *pinned;
    uint32_t num_pinned;
    uint64_t xfer_id;
    uint32_t xfer_tokens;
} xfer_job_t;

static void xfer_job_run(kvp_rpc_job_t *base)
{
    kvp_xfer_run(((xfer_job_t *)base)->xfer);
}

static void xfer_job_free(kvp_rpc_job_t *base)
{
    xfer_job_t *j = (xfer_job_t *)base;
    free(j->pinned);
    free(j->seq_ids);
    free(j);
}

static void xfer_unpin(kvp_rpc_t *r, xfer_job_t *j)
{
    for (uint32_t i = 0; i < j->num_pinned; i++)
        kvp_alloc_unpin(r->alloc, j->pinned[i]);
    j->num_pinned = 0;
}

static void finish_import(kvp_rpc_t *r, kvp_rpc_job_t *base, kvp_rpc_io_t *io, uint64_t now_ms);
static void finish_export(kvp_rpc_t *r, kvp_rpc_job_t *base, kvp_rpc_io_t *io, uint64_t now_ms);

static const kvp_rpc_job_ops_t import_ops = {
    .name = "import", .run = xfer_job_run, .finish = finish_import, .free = xfer_job_free};
static const kvp_rpc_job_ops_t export_ops = {
    .name = "export", .run = xfer_job_run, .finish = finish_export, .free = xfer_job_free};

static xfer_job_t *xfer_job_new(const kvp_rpc_job_ops_t *ops, uint64_t num_pages, uint32_t nseq,
                                const uint64_t *ids)
{
    xfer_job_t *j = calloc(1, sizeof(*j));
    if (!j)
        return NULL;
    j->base.ops = ops;
    j->pinned = malloc(((size_t)num_pages + 1) * sizeof(uint32_t));
    j->seq_ids = malloc((size_t)nseq * sizeof(uint64_t));
    if (!j->pinned || !j->seq_ids) {
        xfer_job_free(&j->base);
        return NULL;
    }
    memcpy(j->seq_ids, ids, (size_t)nseq * sizeof(uint64_t));
    j->num_seqs = nseq;
    return j;
}

static void xfer_pin(kvp_rpc_t *r, xfer_job_t *j, const uint32_t *pages, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        kvp_alloc_pin(r->alloc, pages[i]);
        j->pinned[j->num_pinned++] = pages[i];
    }
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

/* ExportBegin: answers at once with the communicator's id; the send runs in the background. The
 * sequences' pages are pinned until it ends (a Release meanwhile cannot hand them to another
 * sequence); tokens appended meanwhile are not part of the transfer. */
int kvp__rpc_export_begin(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                          kvp_rpc_io_t *io, uint64_t now_ms)
{
    const uint64_t id = req->id;
    const kvpool_ExportBeginRequest *q = &req->body.export_begin;
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
    xfer_job_t *j = xfer_job_new(&export_ops, np, n, ids);
    uint8_t nid[KVP_XFER_ID_BYTES];
    uint64_t tid = 0;
    const kvp_xfer_set_t set = {.n = n, .seq_ids = ids, .tokens = toks, .pages = pages};
    kvp_xfer_stream_t st;
    rc = j ? kvp_xfer_export_begin(r->xfer, q->peer, s->ns_name, &set, q->timeout_ms, now_ms, nid,
                                   &tid, &st, &j->xfer)
           : KVP_ENOMEM;
    if (rc) {
        if (j)
            xfer_job_free(&j->base);
        kvp_rpc_error(resp, id, rc, "cannot start the export: %s", kvp_strerror(rc));
        return KVP_RPC_DONE;
    }
    j->base.rpc = r;
    j->base.call = io->call;
    j->xfer_id = tid;
    j->xfer_tokens = (uint32_t)total;
    for (uint32_t i = 0; i < n; i++)
        xfer_pin(r, j, seqs[i]->pages, seqs[i]->num_pages);
    kvp__rpc_ok(io, id);
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
    kvp__rpc_submit_bg(r, &j->base, now_ms); /* the send: nothing waits for it */
    return KVP_RPC_DONE;
}

/* Import: the new sequences' pages are allocated all-or-nothing here, the receive runs as the
 * connection's job, and kvp_rpc_job_finish answers; a failed transfer releases the sequences,
 * so the pool is as it was before the call. */
int kvp__rpc_import(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                    uint64_t now_ms)
{
    const uint64_t id = req->id;
    const kvpool_ImportRequest *q = &req->body.import;
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
        kvp__rpc_count_alloc_failure(r, rc);
        kvp_rpc_error(resp, id, rc, "%s", kvp__rpc_plan_error_text(rc));
        return KVP_RPC_DONE;
    }
    r->counters.pages_allocated_total += r->plan.num_new_pages;
    const kvp_seq_t *seqs[KVP_XFER_MAX_SEQS];
    const uint32_t *pages[KVP_XFER_MAX_SEQS];
    uint64_t np = 0;
    for (uint32_t i = 0; i < n; i++) {
        seqs[i] = kvp_seqtab_find(r->seqs, s->ns, ids[i]);
        pages[i] = seqs[i]->pages;
        np += seqs[i]->num_pages;
    }
    xfer_job_t *j = xfer_job_new(&import_ops, np, n, ids);
    const kvp_xfer_set_t set = {.n = n, .seq_ids = ids, .tokens = toks, .pages = pages};
    rc = j ? kvp_xfer_import_begin(r->xfer, q->nccl_id.bytes, q->transfer_id, s->ns_name, &set, &st,
                                   q->timeout_ms, now_ms, &j->xfer)
           : KVP_ENOMEM;
    if (rc) {
        if (j)
            xfer_job_free(&j->base);
        for (uint32_t i = 0; i < n; i++)
            kvp_seqtab_release(r->seqs, s->ns, ids[i]);
        kvp_rpc_error(resp, id, rc, "cannot start the import: %s",
                      rc == KVP_EBUSY ? "a transfer on this communicator is still running"
                                      : kvp_strerror(rc));
        return KVP_RPC_DONE;
    }
    j->base.rpc = r;
    j->base.call = io->call;
    j->base.req_id = id;
    j->ns = s->ns;
    j->xfer_id = q->transfer_id;
    j->xfer_tokens = q->num_tokens;
    for (uint32_t i = 0; i < n; i++)
        xfer_pin(r, j, seqs[i]->pages, seqs[i]->num_pages);
    io->job = &j->base;
    return KVP_RPC_ASYNC;
}

/* Import's answer: the sequences as received, or, when the transfer failed, released (the
 * new pages may hold part of the stream: they go back to the free list). */
static void finish_import(kvp_rpc_t *r, kvp_rpc_job_t *base, kvp_rpc_io_t *io, uint64_t now_ms)
{
    xfer_job_t *j = (xfer_job_t *)base;
    char msg[160];
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < j->num_seqs; i++) {
        const kvp_seq_t *seq = kvp_seqtab_find(r->seqs, j->ns, j->seq_ids[i]);
        bytes += seq ? kvp_xfer_stream_bytes(&r->backend->geom, seq->num_tokens) : 0;
    }
    int rc = kvp_xfer_finish(r->xfer, j->xfer, now_ms, msg, sizeof(msg));
    j->xfer = NULL;
    xfer_unpin(r, j);
    if (rc) {
        for (uint32_t i = 0; i < j->num_seqs; i++)
            kvp_seqtab_release(r->seqs, j->ns, j->seq_ids[i]);
        kvp_rpc_error(&io->resp, base->req_id, rc, "import failed: %s", msg);
        return;
    }
    uint32_t pages = 0;
    for (uint32_t i = 0; i < j->num_seqs; i++) {
        const kvp_seq_t *seq = kvp_seqtab_find(r->seqs, j->ns, j->seq_ids[i]);
        pages += seq ? seq->num_pages : 0;
    }
    kvp__rpc_ok(io, base->req_id);
    kvpool_ImportResponse *ir = &io->resp.body.import;
    ir->transfer_id = j->xfer_id;
    ir->num_tokens = j->xfer_tokens;
    ir->num_pages = pages;
    ir->bytes = bytes;
}

/* The send is done: its outcome is logged and counted by the transfer engine; the pages it
 * read are released. */
static void finish_export(kvp_rpc_t *r, kvp_rpc_job_t *base, kvp_rpc_io_t *io, uint64_t now_ms)
{
    xfer_job_t *j = (xfer_job_t *)base;
    (void)io;
    if (!j->xfer)
        return;
    kvp_xfer_finish(r->xfer, j->xfer, now_ms, NULL, 0);
    j->xfer = NULL;
    xfer_unpin(r, j);
}

int kvp__rpc_list_transfers(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                            kvp_rpc_io_t *io, uint64_t now_ms)
{
    const uint64_t id = req->id;
    kvp__rpc_ok(io, id);
    kvpool_ListTransfersResponse *lr = &io->resp.body.list_transfers;
    kvp_xfer_info_t info[32];
    uint32_t n = kvp_xfer_list(r->xfer, info, 32);
    static const char *const states[] = {"running", "ok", "failed"};
    const int all = kvp__rpc_is_operator(r, s->uid);
    for (uint32_t i = 0; i < n; i++) {
        const kvp_xfer_info_t *in = &info[i];
        /* another tenant's transfers (its namespace, peer, sequences) are its own business:
         * a uid sees those of the namespaces it may read, operators all (issue #15 defect 7) */
        int ns = kvp_ns_find(&r->ns, in->ns);
        if (!all && (ns < 0 || !kvp__rpc_may_see_ns(r, s, (uint32_t)ns)))
            continue;
        kvpool_TransferInfo *o = &lr->transfers[lr->transfers_count++];
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
