/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc_info.c - the introspection calls (Ping, PoolInfo, Stats, ListSequences, ListClients,
 * Audit, Metrics) and the metrics snapshot (see kvp_rpc_internal.h).
 */
#include "kvp_rpc_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_log.h"

void kvp__rpc_fill_pool_info(kvp_rpc_t *r, kvpool_PoolInfo *pi)
{
    kvp_pool_info_t info;
    kvp_backend_pool_info(r->backend, &info);
    kvp_wire_pool_info_put(pi, &info);
}

int kvp__rpc_attach_pool_fds(kvp_rpc_t *r, const kvp_session_t *s, kvp_rpc_io_t *io,
                             kvpool_PoolInfo *pi)
{
    /* whoever holds these maps the whole pool read-write (README "Trust model") */
    if (kvp_access_pool_check(&r->lim.pool_access, s->uid, s->gid))
        return KVP_EPERM;
    int n = r->backend->ops->export_fds(r->backend, io->fds_out, KVP_MAX_FDS_PER_FRAME);
    if (n < 0)
        return n;
    io->nfds_out = n;
    pi->num_fds = (uint32_t)n;
    if (!r->pool_fds_given) {
        r->pool_fds_given = 1;
        r->pool_fds_uid = s->uid;
    } else if (s->uid != r->pool_fds_uid && !r->pool_shared_across_uids) {
        r->pool_shared_across_uids = 1;
        kvp_log(KVP_LOG_WARNING,
                "pool memory shared across uids uid=%u first_uid=%u reason=\"any holder of the "
                "pool fds can read and write every namespace's pages; see access.pool_uids\"",
                s->uid, r->pool_fds_uid);
    }
    return 0;
}
int kvp__rpc_stats(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                   uint64_t now_ms)
{
    const uint64_t id = req->id;
    kvp__rpc_ok(io, id);
    kvpool_StatsResponse *sr = &io->resp.body.stats;
    sr->has_stats = true;
    kvpool_Stats *st = &sr->stats;
    kvp_stats_t p;
    kvp_seqtab_stats(r->seqs, &p);
    st->num_pages = p.num_pages;
    st->free_pages = p.free_pages;
    st->used_pages = p.used_pages;
    st->shared_pages = p.shared_pages;
    st->num_seqs = p.num_seqs;
    st->num_tokens = p.num_tokens;
    st->page_refs = p.page_refs;
    st->page_bytes =
        r->backend->derived.layer_bytes / r->backend->geom.num_pages * r->backend->geom.num_layers;
    st->num_clients = r->num_clients;
    st->uptime_ms = now_ms - r->start_ms;
    st->requests_total = r->counters.requests_total;
    st->append_bytes_total = r->counters.append_bytes_total;
    st->dedup_bytes = r->dedup.bytes;
    st->dedup_evictions_total = r->dedup.evictions_total;
    st->pool_shared_across_uids = r->pool_shared_across_uids != 0;
    st->has_cache = true;
    kvp__rpc_cache_stats(r, s, &st->cache);
    const pb_size_t cap = sizeof(st->namespaces) / sizeof(st->namespaces[0]);
    for (uint32_t i = 0; i < r->ns.max; i++) {
        const kvp_ns_t *n = &r->ns.ns[i];
        if (!n->in_use || !kvp__rpc_may_see_ns(r, s, i))
            continue;
        st->namespaces_total++;
        if (st->namespaces_count == cap) {
            st->namespaces_truncated = true;
            continue;
        }
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
        o->dedup_bytes = r->dedup.w[i].bytes;
        o->dedup_entries = r->dedup.w[i].entries;
    }
    return 0;
}

int kvp__rpc_list_sequences(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                            kvp_rpc_io_t *io, uint64_t now_ms)
{
    const uint64_t id = req->id;
    const kvpool_ListSequencesRequest *q = &req->body.list_sequences;
    uint32_t ns = s->ns;
    if (!q->namespace[0] && s->observer) {
        kvp_rpc_error(&io->resp, id, KVP_EINVAL, "an observer names the namespace to list");
        return 0;
    }
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
        if (!kvp__rpc_may_see_ns(r, s, ns)) {
            kvp_rpc_error(&io->resp, id, KVP_EPERM,
                          "namespace '%s' belongs to another user: only its owner, root and "
                          "the daemon's uid see its sequences",
                          q->namespace);
            return 0;
        }
    }
    uint32_t limit = q->limit && q->limit < 256 ? q->limit : 256;
    kvp__rpc_ok(io, id);
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

/* Whether session s may see session o in ListClients: an operator sees all; another uid its
 * own sessions and those attached to a namespace it owns. */
static int may_see_session(const kvp_rpc_t *r, const kvp_session_t *s, const kvp_session_t *o)
{
    return kvp__rpc_is_operator(r, s->uid) || o->uid == s->uid ||
           (o->hello_done && !o->observer && r->ns.ns[o->ns].owner_uid == s->uid);
}

int kvp__rpc_list_clients(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                          kvp_rpc_io_t *io, uint64_t now_ms)
{
    const uint64_t id = req->id;
    kvp__rpc_ok(io, id);
    kvpool_ListClientsResponse *lr = &io->resp.body.list_clients;
    for (kvp_session_t *o_s = r->sessions; o_s && lr->clients_count < 256; o_s = o_s->next) {
        if (!may_see_session(r, s, o_s))
            continue;
        kvpool_ClientInfo *o = &lr->clients[lr->clients_count++];
        o->session_id = o_s->id;
        snprintf(o->namespace, sizeof(o->namespace), "%s", o_s->ns_name);
        snprintf(o->client_name, sizeof(o->client_name), "%s", o_s->name);
        o->pid = o_s->pid;
        o->uid = o_s->uid;
        o->gid = o_s->gid;
        o->requests = o_s->requests;
        o->connected_ms = now_ms - o_s->connected_ms;
        o->buffers = o_s->num_buffers;
    }
    return 0;
}

int kvp__rpc_audit(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                   uint64_t now_ms)
{
    const uint64_t id = req->id;
    (void)s;
    (void)now_ms;
    kvp__rpc_ok(io, id);
    kvpool_AuditResponse *ar = &io->resp.body.audit;
    int rc = kvp_pcache_audit(r->pc, ar->message, sizeof(ar->message)); /* the table's too */
    if (rc == 0) /* the host tier's restores in flight agree with the cache */
        rc = kvp__rpc_tier_audit(r, ar->message, sizeof(ar->message));
    ar->ok = rc == 0;
    if (rc == 0)
        snprintf(ar->message, sizeof(ar->message), "ok");
    else if (rc != KVP_EAUDIT)
        snprintf(ar->message, sizeof(ar->message), "audit could not run: %s", kvp_strerror(rc));
    if (rc)
        kvp_log(KVP_LOG_ERR, "audit failed reason=\"%s\"", ar->message);
    return 0;
}

int kvp__rpc_ping(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                  uint64_t now_ms)
{
    (void)r, (void)s, (void)now_ms;
    kvp__rpc_ok(io, req->id);
    io->resp.body.ping.nonce = req->body.ping.nonce;
    return KVP_RPC_DONE;
}

int kvp__rpc_pool_info(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                       uint64_t now_ms)
{
    (void)now_ms;
    if (s->observer && req->body.pool_info.want_pool_fds) {
        kvp_rpc_error(&io->resp, req->id, KVP_EPRECOND, "an observer takes no pool fds");
        return KVP_RPC_DONE;
    }
    kvp__rpc_ok(io, req->id);
    kvp__rpc_fill_pool_info(r, &io->resp.body.pool_info);
    int rc = req->body.pool_info.want_pool_fds
                 ? kvp__rpc_attach_pool_fds(r, s, io, &io->resp.body.pool_info)
                 : 0;
    if (rc == KVP_EPERM)
        kvp_rpc_error(&io->resp, req->id, KVP_EPERM,
                      "uid %u may not receive the pool's memory (access.pool_uids / pool_gids)",
                      s->uid);
    else if (rc)
        kvp_rpc_error(&io->resp, req->id, KVP_EINTERNAL, "cannot export the pool");
    return KVP_RPC_DONE;
}

/* The text goes into a buffer the rpc state keeps (allocated on the first scrape over the
 * socket: most daemons are scraped over HTTP, which has its own). */
static size_t metrics_text(kvp_rpc_t *r, const kvp_session_t *viewer, char *buf, size_t cap,
                           uint64_t now_ms);

int kvp__rpc_metrics(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                     uint64_t now_ms)
{
    if (!r->metrics_buf && !(r->metrics_buf = malloc(KVP_RPC_METRICS_CAP))) {
        kvp_rpc_error(&io->resp, req->id, KVP_ENOMEM, "no memory for the metrics text");
        return KVP_RPC_DONE;
    }
    kvp__rpc_ok(io, req->id);
    r->metrics_text.len = metrics_text(r, s, r->metrics_buf, KVP_RPC_METRICS_CAP, now_ms);
    r->metrics_text.s = r->metrics_buf;
    kvp_text_bind_encode(&io->resp.body.metrics.text, &r->metrics_text);
    return KVP_RPC_DONE;
}

size_t kvp_rpc_metrics_text(kvp_rpc_t *r, char *buf, size_t cap, uint64_t now_ms)
{
    return metrics_text(r, NULL, buf, cap, now_ms);
}

/* The metrics text; with a viewer (a Metrics call over the socket) only the namespaces it may
 * see (kvp__rpc_may_see_ns, as Stats and ListSequences: issue #26), without one (the operator's
 * HTTP endpoint) every namespace. */
static size_t metrics_text(kvp_rpc_t *r, const kvp_session_t *viewer, char *buf, size_t cap,
                           uint64_t now_ms)
{
    const kvp_backend_t *be = r->backend;
    const char *names[KVP_METRICS_MAX_CALLS];
    for (unsigned i = 0; i < kvp__rpc_num_calls; i++)
        names[i] = kvp__rpc_calls[i].name;
    uint32_t n = 0;
    for (uint32_t i = 0; i < r->ns.max; i++)
        n += r->ns.ns[i].in_use != 0;
    kvp_metrics_ns_t *ns = calloc(n ? n : 1, sizeof(*ns));
    if (!ns) {
        if (buf && cap)
            buf[0] = '\0';
        return 0;
    }
    kvp_metrics_t m = {.version = KVP_VERSION_STRING,
                       .backend = be->ops->name,
                       .up = kvp_rpc_healthy(r),
                       .uptime_ms = now_ms - r->start_ms,
                       .num_devices = be->geom.num_devices,
                       .device_ids = be->device_ids,
                       .num_device_ids = be->num_device_ids,
                       .page_bytes =
                           be->derived.layer_bytes / be->geom.num_pages * be->geom.num_layers,
                       .ns = ns,
                       .clients = r->num_clients,
                       .dedup_bytes = r->dedup.bytes,
                       .dedup_evictions_total = r->dedup.evictions_total,
                       .counters = &r->counters,
                       .call_names = names,
                       .num_calls = kvp__rpc_num_calls};
    kvp_seqtab_stats(r->seqs, &m.pool);
    kvp_pcache_stats(r->pc, &m.cache);
    m.has_cache = 1;
    m.commits_pending = kvp_rpc_commits_pending(r);
    if (r->tier.mem) {
        kvpool_CacheStats cs = kvpool_CacheStats_init_zero;
        kvp__rpc_tier_stats(r, &cs);
        m.has_tier = 1;
        m.tier_bytes[0] = cs.offload_bytes_total;
        m.tier_bytes[1] = cs.restore_bytes_total;
        m.tier_ns[0] = r->tier.offload_ns;
        m.tier_ns[1] = r->tier.restore_ns;
        m.host_bytes_total = cs.host_bytes_total;
        m.host_bytes_ready = cs.host_bytes_ready;
        m.host_slot_bytes = cs.host_slot_bytes;
    }
    kvp__rpc_events_metrics(r, &m);
    for (uint32_t i = 0; i < r->ns.max && m.num_ns < n; i++) {
        if (!r->ns.ns[i].in_use || (viewer && !kvp__rpc_may_see_ns(r, viewer, i)))
            continue;
        kvp_ns_stats_t st;
        kvp_seqtab_ns_stats(r->seqs, i, &st);
        kvp_metrics_ns_t *o = &ns[m.num_ns++];
        snprintf(o->name, sizeof(o->name), "%s", r->ns.ns[i].name);
        o->num_seqs = st.num_seqs;
        o->num_tokens = st.num_tokens;
        o->page_refs = st.page_refs;
        o->dedup_bytes = r->dedup.w[i].bytes;
        m.dedup_entries += r->dedup.w[i].entries;
    }
    kvp_xfer_counters(r->xfer, m.xfer_total, m.xfer_bytes, &m.xfer_in_flight, &m.xfer_comms);
    size_t len = kvp_metrics_text(&m, buf, cap);
    free(ns);
    return len;
}
