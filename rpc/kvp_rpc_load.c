/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc_load.c - Load (kvpool.proto, issue #28): the cached full pages of a prompt's prefix,
 * from either tier, copied into a buffer the caller registered, where an Append with the same
 * layout would have read them. For engines that keep KV in their own memory and use kvpool as
 * the machine's shared KV store.
 *
 * The pages are taken the way a Reserve with reuse takes them: the planner links the GPU part
 * and promotes the host part into a transient sequence of the caller's namespace (so restores,
 * joins and quotas are the same code), the job waits for the restores, copies (ops->gather) on
 * a worker thread with the pages pinned, and the sequence is released when it answers.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_log.h"
#include "kvp_rpc_internal.h"

typedef struct {
    kvp_rpc_job_t base;
    kvp_gather_t g;
    kvp_buffer_t dst; /* by value: held until finish */
    uint32_t ns;
    uint64_t seq_id; /* the transient sequence */
    uint32_t loaded, host;
    uint32_t num_pinned;
    uint32_t *pinned;
    int32_t slots[];
} load_job_t;

static void load_run(kvp_rpc_job_t *base)
{
    load_job_t *j = (load_job_t *)base;
    kvp_backend_t *b = base->rpc->backend;
    base->rc = b->ops->gather(b, &j->g);
}

static void load_finish(kvp_rpc_t *r, kvp_rpc_job_t *base, kvp_rpc_io_t *io, uint64_t now_ms)
{
    (void)now_ms;
    load_job_t *j = (load_job_t *)base;
    for (uint32_t i = 0; i < j->num_pinned; i++)
        kvp_alloc_unpin(r->alloc, j->pinned[i]);
    j->num_pinned = 0;
    kvp__rpc_buf_unhold(r, &j->dst);
    kvp_seqtab_release(r->seqs, j->ns, j->seq_id); /* gone already if the namespace went */
    if (base->wait_failed) {
        kvp_rpc_error(&io->resp, base->req_id, r->unhealthy ? KVP_EINTERNAL : KVP_EUNAVAIL,
                      "load not applied: restoring the prefix from host memory failed");
        return;
    }
    if (base->rc) {
        if (base->rc != KVP_EINVAL && base->rc != KVP_ERANGE) {
            r->unhealthy = 1;
            kvp_log(KVP_LOG_CRIT, "load failed in backend rc=%s", kvp_errname(base->rc));
        }
        kvp_rpc_error(&io->resp, base->req_id, base->rc == KVP_ERANGE ? KVP_EINTERNAL : base->rc,
                      "load failed in the backend: %s", kvp_strerror(base->rc));
        return;
    }
    kvp__rpc_ok(io, base->req_id);
    io->resp.body.load.loaded_tokens = j->loaded;
    io->resp.body.load.host_tokens = j->host;
    io->resp.body.load.completed = true; /* gather returns once the copy is done */
}

static void load_free(kvp_rpc_job_t *base)
{
    if (base)
        free(((load_job_t *)base)->pinned);
    free(base);
}

static const kvp_rpc_job_ops_t load_ops = {
    .name = "load", .run = load_run, .finish = load_finish, .free = load_free};

/* An id for the transient sequence: the highest not in use in namespace ns. */
static uint64_t transient_id(const kvp_rpc_t *r, uint32_t ns)
{
    uint64_t id = UINT64_MAX;
    while (kvp_seqtab_find(r->seqs, ns, id))
        id--;
    return id;
}

int kvp__rpc_load(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                  uint64_t now_ms)
{
    const uint64_t id = req->id;
    const kvpool_LoadRequest *q = &req->body.load;
    kvpool_Response *resp = &io->resp;
    const kvp_batch_arrays_t *b = io->batch;
    const uint32_t ps = r->backend->geom.page_size, L = r->backend->geom.num_layers;
    if (!r->backend->ops->gather) {
        kvp_rpc_error(resp, id, KVP_EUNAVAIL, "this backend cannot load");
        return KVP_RPC_DONE;
    }
    if (!q->has_dest) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "load needs a dest");
        return KVP_RPC_DONE;
    }
    const kvpool_Source *dest = &q->dest;
    kvp_session_buffer_t *sb = kvp__rpc_find_buffer(s, dest->buffer_id);
    if (!sb) {
        kvp_rpc_error(resp, id, KVP_ENOENT, "no buffer %u registered on this connection",
                      dest->buffer_id);
        return KVP_RPC_DONE;
    }
    if (!sb->buf.writable) {
        kvp_rpc_error(resp, id, KVP_EPRECOND,
                      "buffer %u is read-only to the daemon (register a memfd opened read-write "
                      "without a write seal)",
                      dest->buffer_id);
        return KVP_RPC_DONE;
    }
    const uint32_t lb = dest->layer_begin, le = dest->layer_end ? dest->layer_end : L;
    if (lb >= le || le > L) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "layer range [%u, %u) outside [0, %u)", lb, le, L);
        return KVP_RPC_DONE;
    }
    const uint32_t ntok = b->token_ids.count;
    if (ntok == 0 || ntok > kvp__rpc_max_lookup_tokens(r)) {
        kvp_rpc_error(resp, id, ntok ? KVP_ELIMIT : KVP_EINVAL,
                      "a Load names 1..%u tokens (limits.max_lookup_tokens), not %u",
                      kvp__rpc_max_lookup_tokens(r), ntok);
        return KVP_RPC_DONE;
    }
    const int32_t *tok = b->token_ids.data;
    const uint32_t scope = kvp__rpc_ns_scope(r, s->ns);
    kvp_pagekey_t root;
    kvp_pagekey_root(q->salt.bytes, q->salt.size, &root);
    uint32_t gpu, f = kvp_pcache_lookup_tiers(r->pc, scope, root, tok, ntok, 0, &gpu);
    if (!r->tier.mem)
        f = gpu; /* no host tier: what is on the GPU */
    if (q->max_tokens && f > q->max_tokens / ps)
        f = q->max_tokens / ps;
    if (f == 0) {
        kvp_rpc_error(resp, id, KVP_ENOENT, "no page of the prompt is cached");
        return KVP_RPC_DONE;
    }
    kvp_src_layout_t layout;
    kvp_wire_source_layout(dest, &layout);
    char why[160];
    int rc = kvp__rpc_check_layout(r, &layout, &sb->buf, f * ps, lb, le, why, sizeof(why));
    if (rc) {
        kvp_rpc_error(resp, id, rc, "dest: %s", why);
        return KVP_RPC_DONE;
    }
    /* the prefix into a transient sequence: linked and promoted, nothing appended */
    const uint64_t seq_id = transient_id(r, s->ns);
    r->items[0] = (kvp_plan_item_t){.ns = s->ns, .seq_id = seq_id, .num_tokens = f * ps};
    r->content[0] = (kvp_plan_content_t){
        .token_ids = tok, .salt = q->salt.bytes, .salt_len = (uint32_t)q->salt.size};
    kvp_plan_cache_t cache = {.scope = scope,
                              .reuse = 1,
                              .promote = r->tier.mem != NULL,
                              .priority = KVP_PCACHE_DEFAULT_PRIORITY};
    r->plan_reused = 1;
    rc = kvp_plan_append_cached(r->seqs, r->items, r->content, 1, &r->plan_limits, &cache, now_ms,
                                &r->plan);
    if (rc) {
        kvp__rpc_count_alloc_failure(r, rc);
        kvp_rpc_error(resp, id, rc, "%s", kvp__rpc_plan_error_text(rc));
        return KVP_RPC_DONE;
    }
    const kvp_plan_t *p = &r->plan;
    kvp__rpc_tier_kick(r, now_ms);
    load_job_t *j = NULL;
    int started = 0; /* kvp__rpc_tier_restore ran: it owns the promoted pages, failed or not */
    if (p->cached_tokens[0] != f * ps || p->nnz != 0) { /* found by the lookup just above */
        rc = KVP_EINTERNAL;
    } else if (!(j = calloc(1, sizeof(*j) + (size_t)f * ps * sizeof(int32_t))) ||
               !(j->pinned = malloc((size_t)f * sizeof(uint32_t)))) {
        rc = KVP_ENOMEM;
    } else if ((rc = kvp__rpc_buf_hold(r, &sb->buf)) == 0) {
        j->dst = sb->buf;
        started = 1;
        rc = kvp__rpc_tier_restore(r, now_ms);
    }
    if (rc && !started)
        kvp__rpc_tier_drop_restores(r);
    if (rc) {
        if (j && j->dst.size_bytes)
            kvp__rpc_buf_unhold(r, &j->dst);
        load_free(j ? &j->base : NULL);
        kvp_seqtab_release(r->seqs, s->ns, seq_id);
        kvp_rpc_error(resp, id, rc, "load: %s", kvp_strerror(rc));
        return KVP_RPC_DONE;
    }
    j->base.ops = &load_ops;
    j->base.rpc = r;
    j->base.call = io->call;
    j->base.req_id = id;
    j->ns = s->ns;
    j->seq_id = seq_id;
    j->loaded = f * ps;
    j->host = p->restored_tokens[0];
    const int32_t *pages = p->kv_indices + p->kv_indptr[0];
    for (uint32_t k = 0; k < f; k++) {
        kvp_alloc_pin(r->alloc, (uint32_t)pages[k]);
        j->pinned[j->num_pinned++] = (uint32_t)pages[k];
        for (uint32_t t = 0; t < ps; t++)
            j->slots[k * ps + t] = pages[k] * (int32_t)ps + (int32_t)t;
    }
    j->g = (kvp_gather_t){.slots = j->slots,
                          .nnz = f * ps,
                          .dst = &j->dst,
                          .layout = layout,
                          .layer_begin = lb,
                          .layer_end = le};
    if (kvp__rpc_tier_wait_plan(r, &j->base))
        j->base.wait_failed = 1; /* refused once the restores it waits for (if any) end */
    io->job = &j->base;
    return KVP_RPC_ASYNC;
}
