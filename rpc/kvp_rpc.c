/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc.c - the daemon's state, the call table and the one entry point of the rpc layer
 * (see kvp_rpc.h and kvp_rpc_internal.h): the rules of a call's row, the retry protocol, the
 * dispatch and the accounting; sessions, leases and Hello. Each call's handler lives in the
 * file of its area.
 */
#include "kvp_rpc_internal.h"

#include <assert.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_log.h"
#include "kvp_utf8.h"

/* The largest answer a retry window keeps (a page table of ~64K entries). */
#define DEDUP_MAX_ENTRY_BYTES (256u << 10)

/* A limit left 0 where its row (kvp_rpc_limits.h) does not allow 0 takes the row's default:
 * the daemon passes its validated configuration, tests name only the limits they care about. */
#define FILL_DEFAULT(sec, key, field, type, def, min, max, reload, doc)                            \
    if ((min) > 0 && lim->field == 0)                                                              \
        lim->field = (def);
static void fill_defaults(kvp_rpc_limits_t *lim)
{
    KVP_RPC_LIMITS_KEYS(FILL_DEFAULT)
    KVP_RPC_TRANSFER_KEYS(FILL_DEFAULT)
    KVP_RPC_CACHE_KEYS(FILL_DEFAULT)
}
#undef FILL_DEFAULT

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
    fill_defaults(&r->lim);
    lim = &r->lim;
    r->start_ms = now_ms;
    r->next_session_id = 1;
    r->backend = backend; /* read while creating (the host tier); the caller's on failure */
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
    if ((rc = kvp_ns_table_init(&r->ns, lim->max_namespaces)))
        goto fail;
    kvp_dedup_limits_t dl = {.window = lim->dedup_window,
                             .max_entry_bytes = DEDUP_MAX_ENTRY_BYTES,
                             .ns_max_bytes = lim->dedup_ns_max_bytes,
                             .max_bytes = lim->dedup_max_bytes};
    if ((rc = kvp_dedup_init(&r->dedup, lim->max_namespaces, &dl)))
        goto fail;
    for (unsigned i = 1; i < kvp__rpc_num_calls; i++) {
        assert(kvp__rpc_calls[i].req_tag <= KVP_RPC_MAX_TAG &&
               !r->by_tag[kvp__rpc_calls[i].req_tag]);
        r->by_tag[kvp__rpc_calls[i].req_tag] = &kvp__rpc_calls[i];
    }
    r->items = calloc(lim->max_batch, sizeof(*r->items));
    if (!r->items) {
        rc = KVP_ENOMEM;
        goto fail;
    }
    if ((rc = kvp__rpc_cache_create(r)))
        goto fail;
    kvp_xfer_config_t xc = {.timeout_ms = lim->transfer_timeout_ms,
                            .comm_idle_ms = lim->transfer_comm_idle_ms,
                            .max_in_flight = lim->transfer_max_in_flight,
                            .chunk_bytes = lim->transfer_chunk_bytes};
    if ((rc = kvp_xfer_create(backend, &xc, &r->xfer)))
        goto fail;
    *out = r;
    return 0;
fail:
    kvp__rpc_cache_destroy(r); /* the host tier's memory before the backend it was made for */
    r->backend = NULL;
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
    kvp__rpc_cache_destroy(r);
    free(r->items);
    kvp_dedup_free(&r->dedup);
    kvp_ns_table_free(&r->ns);
    free(r->metrics_buf);
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

/* limits.uid_max_seqs: the namespaces of one uid form one tenant group of the sequence table
 * (kvp_seqtab_set_ns_group), whose quota the table checks when it creates a sequence. The
 * group of a new namespace is that of another namespace of its owner, else a group no
 * namespace in use has (scanned at Hello only). */
static uint32_t tenant_group(const kvp_rpc_t *r, uint32_t ns, uint32_t uid)
{
    for (uint32_t i = 0; i < r->ns.max; i++)
        if (i != ns && r->ns.ns[i].in_use && r->ns.ns[i].owner_uid == uid)
            return r->ns.ns[i].group;
    for (uint32_t g = 0;; g++) {
        uint32_t i = 0;
        while (i < r->ns.max && !(i != ns && r->ns.ns[i].in_use && r->ns.ns[i].group == g))
            i++;
        if (i == r->ns.max)
            return g; /* found within max namespaces: at most max - 1 others are in use */
    }
}

static uint32_t uid_seq_quota(const kvp_rpc_t *r, uint32_t uid)
{
    return kvp__rpc_is_operator(r, uid) ? 0 : r->lim.uid_max_seqs;
}

/* The RELOAD rows of kvp_rpc_limits.h are copied; the RESTART rows keep their running values. */
#define COPY_RELOADABLE(sec, key, field, type, def, min, max, reload, doc)                         \
    if (KVP_RPC_LIMIT_RELOADABLE(reload))                                                          \
        r->lim.field = lim->field;
void kvp_rpc_set_limits(kvp_rpc_t *r, const kvp_rpc_limits_t *lim)
{
    KVP_RPC_LIMITS_KEYS(COPY_RELOADABLE)
    KVP_RPC_TRANSFER_KEYS(COPY_RELOADABLE)
    KVP_RPC_CACHE_KEYS(COPY_RELOADABLE)
    r->lim.pool_access = lim->pool_access;
    fill_defaults(&r->lim);
    lim = &r->lim;
    /* what the modules hold a copy of */
    r->plan_limits.max_tokens = lim->max_batch_tokens;
    kvp_xfer_config_t xc = {.timeout_ms = lim->transfer_timeout_ms,
                            .comm_idle_ms = lim->transfer_comm_idle_ms,
                            .chunk_bytes = lim->transfer_chunk_bytes};
    kvp_xfer_set_config(r->xfer, &xc);
    for (uint32_t i = 0; i < r->ns.max; i++)
        if (r->ns.ns[i].in_use)
            kvp_pcache_set_pin_quota(r->pc, i, kvp__rpc_ns_pin_quota(r));
    kvp_dedup_set_budgets(&r->dedup, lim->dedup_ns_max_bytes, lim->dedup_max_bytes);
    for (uint32_t i = 0; i < r->ns.max; i++)
        if (r->ns.ns[i].in_use) {
            kvp_seqtab_set_ns_limits(r->seqs, i, lim->ns_max_seqs, lim->ns_max_pages);
            kvp_seqtab_set_group_limit(r->seqs, r->ns.ns[i].group,
                                       uid_seq_quota(r, r->ns.ns[i].owner_uid));
        }
}
#undef COPY_RELOADABLE

void kvp_rpc_set_num_clients(kvp_rpc_t *r, uint32_t n)
{
    r->num_clients = n;
}

void kvp_rpc_set_draining(kvp_rpc_t *r, int draining)
{
    r->draining = draining;
}

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
    kvp_dedup_close(&r->dedup, ns);
    if (kvp__rpc_scope_leave(r, ns)) { /* its pins outlive it (kvpool.proto, Pin) */
        r->ns.ns[ns].pins_only = 1;
        r->ns.ns[ns].expires_at_ms = 0;
        return;
    }
    kvp_ns_forget(&r->ns, ns);
}

/* limits.uid_max_idle_namespaces: while uid owns more namespaces with no session (a lease
 * pending) than that, the one whose lease ends first goes now, so a tenant's lapsed sessions
 * never fill the namespace table for a day. */
static void cap_idle_namespaces(kvp_rpc_t *r, uint32_t uid)
{
    const uint32_t cap = r->lim.uid_max_idle_namespaces;
    if (!cap || kvp__rpc_is_operator(r, uid))
        return;
    for (;;) {
        uint32_t idle = 0;
        int first = -1;
        uint64_t first_end = 0;
        for (uint32_t i = 0; i < r->ns.max; i++) {
            const kvp_ns_t *n = &r->ns.ns[i];
            if (!n->in_use || n->owner_uid != uid || n->sessions ||
                (!n->expires_at_ms && !n->pins_only))
                continue;
            /* a namespace kept only for its pins is idle too, until its last pin ends (issue
             * #26 defect 6): it holds pages as a leased one does */
            const uint64_t end =
                n->pins_only ? kvp_pcache_ns_last_expiry(r->pc, i) : n->expires_at_ms;
            idle++;
            if (first < 0 || end < first_end ||
                (end == first_end && n->idle_seq < r->ns.ns[first].idle_seq))
                first = (int)i, first_end = end; /* a tie: the one idle first */
        }
        if (idle <= cap)
            return;
        kvp_ns_t *n = &r->ns.ns[first];
        if (n->pins_only) {
            uint32_t pins = kvp_pcache_unpin_ns(r->pc, (uint32_t)first);
            kvp_log(KVP_LOG_INFO, "namespace released ns=%s pins=%u reason=uid_max_idle_namespaces",
                    n->name, pins);
            kvp__rpc_scope_leave(r, (uint32_t)first);
            kvp_ns_forget(&r->ns, (uint32_t)first);
            continue;
        }
        n->expires_at_ms = 0;
        release_namespace(r, (uint32_t)first, "uid_max_idle_namespaces");
    }
}

void kvp_rpc_session_close(kvp_rpc_t *r, kvp_session_t *s, uint64_t now_ms)
{
    const int attached = s->hello_done && !s->observer;
    kvp__rpc_cache_session_close(r, s);
    for (uint32_t i = 0; i < s->num_buffers; i++) {
        if (attached)
            r->ns.ns[s->ns].buffer_bytes -= s->buffers[i].buf.size_bytes;
        kvp__rpc_buf_release(r, &s->buffers[i].buf);
    }
    if (attached) {
        const uint32_t owner = r->ns.ns[s->ns].owner_uid;
        if (kvp_ns_detach(&r->ns, s->ns, now_ms))
            release_namespace(r, s->ns, "lease 0"); /* may stay for its pins: idle then */
        cap_idle_namespaces(r, owner);
    }
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
    kvp__rpc_cache_tick(r, now_ms);  /* pins whose time is up */
    int id;
    while ((id = kvp_ns_next_expired(&r->ns, now_ms)) >= 0) {
        kvp_stats_t before, after;
        kvp_seqtab_stats(r->seqs, &before);
        release_namespace(r, (uint32_t)id, "lease expired");
        kvp_seqtab_stats(r->seqs, &after);
        r->counters.lease_expiries_total++;
        r->counters.evicted_seqs_total += before.num_seqs - after.num_seqs;
        r->counters.evicted_pages_total +=
            (after.free_pages + after.cached_pages) - (before.free_pages + before.cached_pages);
        n++;
    }
    return n;
}

uint64_t kvp_rpc_next_deadline(const kvp_rpc_t *r)
{
    return kvp_ns_next_deadline(&r->ns);
}
/* Undoes what a refused Hello did to namespace ns: a namespace that existed gets its record
 * back exactly as it was (sessions, lease, pending expiry, pins_only); a new one goes with its
 * scope and retry window. It used to detach with time 0, which rewrote a leased namespace's
 * expiry: released at the next tick, or never with lease_ms 0 (issue #26 defect 7). */
static void hello_undo(kvp_rpc_t *r, uint32_t ns, const kvp_ns_t *saved)
{
    if (saved) {
        r->ns.ns[ns] = *saved;
        return;
    }
    r->ns.ns[ns].sessions = 0;
    kvp_dedup_close(&r->dedup, ns);
    kvp__rpc_scope_leave(r, ns);
    kvp_ns_forget(&r->ns, ns);
}

int kvp__rpc_hello(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                   uint64_t now_ms)
{
    const uint64_t id = req->id;
    const kvpool_HelloRequest *h = &req->body.hello;
    (void)now_ms;
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
    if (kvp__rpc_check_name(resp, id, "namespace", h->namespace) ||
        kvp__rpc_check_name(resp, id, "client_name", h->client_name))
        return 0;
    if (h->observer) {
        if (h->namespace[0] || h->want_pool_fds || h->has_lease_ms) {
            kvp_rpc_error(resp, id, KVP_EINVAL,
                          "an observer names no namespace, lease or pool fds");
            return 0;
        }
        kvp__rpc_ok(io, id);
        kvpool_HelloResponse *hr = &resp->body.hello;
        hr->protocol_version = KVP_PROTOCOL_VERSION;
        snprintf(hr->server_version, sizeof(hr->server_version), "%s", KVP_VERSION_STRING);
        hr->session_id = s->id;
        hr->has_pool = true;
        kvp__rpc_fill_pool_info(r, &hr->pool);
        s->hello_done = 1;
        s->observer = 1;
        snprintf(s->name, sizeof(s->name), "%s", h->client_name);
        kvp_log(KVP_LOG_INFO, "session hello session=%llu observer=1 client=%s pid=%d uid=%u",
                (unsigned long long)s->id, s->name, s->pid, s->uid);
        return 0;
    }
    const char *name = h->namespace[0] ? h->namespace : "default";
    const int op = kvp__rpc_is_operator(r, s->uid);
    if (!op && kvp_ns_reserved(name)) {
        kvp_rpc_error(resp, id, KVP_EPERM,
                      "namespace '%s' is reserved for the daemon's operators (root, uid %u); "
                      "name another one",
                      name, r->lim.operator_uid);
        return 0;
    }
    uint32_t lease = h->has_lease_ms ? h->lease_ms : r->lim.default_lease_ms;
    int set_lease = h->has_lease_ms;
    if (lease > r->lim.max_lease_ms) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "lease_ms %u above max_lease_ms %u", lease,
                      r->lim.max_lease_ms);
        return 0;
    }
    if (h->want_pool_fds && kvp_access_pool_check(&r->lim.pool_access, s->uid, s->gid)) {
        /* before anything is attached: the session may Hello again without want_pool_fds */
        kvp_rpc_error(resp, id, KVP_EPERM,
                      "uid %u may not receive the pool's memory (access.pool_uids / pool_gids); "
                      "Hello without want_pool_fds for daemon-run calls",
                      s->uid);
        return 0;
    }
    int existing = kvp_ns_find(&r->ns, name);
    if (existing < 0 && !op && r->lim.uid_max_namespaces) {
        uint32_t owned = 0;
        for (uint32_t i = 0; i < r->ns.max; i++)
            owned += r->ns.ns[i].in_use && r->ns.ns[i].owner_uid == s->uid;
        if (owned >= r->lim.uid_max_namespaces) {
            kvp_rpc_error(resp, id, KVP_ELIMIT,
                          "uid %u owns %u namespaces: its quota (limits.uid_max_namespaces)",
                          s->uid, owned);
            return 0;
        }
    }
    if (existing >= 0 && r->lim.ns_max_connections &&
        r->ns.ns[existing].sessions >= r->lim.ns_max_connections &&
        (r->ns.ns[existing].owner_uid == s->uid || s->uid == 0)) {
        kvp_rpc_error(resp, id, KVP_ELIMIT,
                      "namespace '%s' has %u connections: its quota (limits.ns_max_connections)",
                      name, r->ns.ns[existing].sessions);
        return 0;
    }
    kvp_ns_t saved = {0}; /* what a refused Hello must give back (hello_undo) */
    if (existing >= 0)
        saved = r->ns.ns[existing];
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
    if (existing < 0) {
        kvp_seqtab_set_ns_limits(r->seqs, ns, r->lim.ns_max_seqs, r->lim.ns_max_pages);
        kvp_ns_t *n = &r->ns.ns[ns];
        n->group = tenant_group(r, ns, n->owner_uid);
        kvp_seqtab_set_ns_group(r->seqs, ns, n->group);
        kvp_seqtab_set_group_limit(r->seqs, n->group, uid_seq_quota(r, n->owner_uid));
    }
    r->ns.ns[ns].pins_only = 0; /* a namespace kept for its pins is back */
    if (kvp__rpc_scope_join(r, s, ns, h->cache_scope, existing < 0, resp, id)) {
        hello_undo(r, ns, existing >= 0 ? &saved : NULL);
        return 0;
    }
    if ((rc = kvp_dedup_open(&r->dedup, ns))) {
        hello_undo(r, ns, existing >= 0 ? &saved : NULL);
        kvp_rpc_error(resp, id, rc, "no memory for the namespace's retry window");
        return 0;
    }
    kvp__rpc_ok(io, id);
    kvpool_HelloResponse *hr = &resp->body.hello;
    hr->protocol_version = KVP_PROTOCOL_VERSION;
    snprintf(hr->server_version, sizeof(hr->server_version), "%s", KVP_VERSION_STRING);
    hr->session_id = s->id;
    hr->has_pool = true;
    kvp__rpc_fill_pool_info(r, &hr->pool);
    if (h->want_pool_fds && (rc = kvp__rpc_attach_pool_fds(r, s, io, &hr->pool))) {
        hello_undo(r, ns, existing >= 0 ? &saved : NULL);
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

/* ---- answers ---------------------------------------------------------------------------- */

/* ---- the entry point -------------------------------------------------------------------- */

static void begin(kvp_rpc_t *r, kvp_session_t *s, const kvp_rpc_call_t *call, uint64_t req_id,
                  kvp_rpc_io_t *io, uint64_t start_ns)
{
    io->job = NULL;
    io->nfds_out = 0;
    io->replay = NULL;
    io->replay_len = 0;
    io->call = call;
    memset(&io->out, 0, sizeof(io->out));
    s->pending.call = call;
    s->pending.req_id = req_id;
    s->pending.start_ns = start_ns;
    s->pending.in_window = 0;
    s->requests++;
    r->counters.requests_total++;
}

/* The retry window's verdict on a deduplicated call: KVP_RPC_DONE with an answer (a refusal),
 * KVP_RPC_REPLAY, or -1 (a new id, now in flight: dispatch it). */
static int retry_window(kvp_rpc_t *r, kvp_session_t *s, const kvp_rpc_call_t *call,
                        const kvpool_Request *req, const uint8_t *payload, uint32_t len,
                        kvp_rpc_io_t *io)
{
    const uint64_t id = req->id;
    const uint16_t ci = (uint16_t)KVP_RPC_CALL_INDEX(call);
    const uint64_t digest = payload ? kvp_dedup_digest(payload, len) : 0;
    const kvp_dedup_entry_t *e = kvp_dedup_find(&r->dedup, s->ns, id);
    if (!e) {
        if (kvp_dedup_begin(&r->dedup, s->ns, id, ci, digest)) {
            kvp_rpc_error(&io->resp, id, KVP_EUNAVAIL,
                          "every request id of the namespace's retry window is in flight; "
                          "retry later");
            return KVP_RPC_DONE;
        }
        s->pending.in_window = 1;
        return -1;
    }
    if (e->call != ci) {
        kvp_rpc_error(&io->resp, id, KVP_EEXIST,
                      "request id %llu was used for %s in this namespace; a retry must repeat "
                      "the same call (draw a fresh id for a new one)",
                      (unsigned long long)id, kvp__rpc_calls[e->call].name);
        return KVP_RPC_DONE;
    }
    if (e->digest != digest) {
        kvp_rpc_error(&io->resp, id, KVP_EEXIST,
                      "request id %llu was used for another %s (other arguments) in this "
                      "namespace; a retry must repeat the same request",
                      (unsigned long long)id, call->name);
        return KVP_RPC_DONE;
    }
    switch ((kvp_dedup_state_t)e->state) {
    case KVP_DEDUP_KEPT:
        io->replay = e->frame;
        io->replay_len = e->len;
        r->counters.dedup_replays_total++;
        return KVP_RPC_REPLAY;
    case KVP_DEDUP_IN_FLIGHT:
        kvp_rpc_error(&io->resp, id, KVP_EUNAVAIL, "request id still in flight; retry later");
        return KVP_RPC_DONE;
    default:
        kvp_rpc_error(&io->resp, id, KVP_EPRECOND,
                      "request id already applied; its answer was not kept (too large, or "
                      "evicted by the retry window's byte budget): read the state with "
                      "GetPageTable");
        return KVP_RPC_DONE;
    }
}

int kvp_rpc_handle(kvp_rpc_t *r, kvp_session_t *s, kvpool_Request *req, const uint8_t *payload,
                   uint32_t len, kvp_rpc_io_t *io, uint64_t now_ms, uint64_t start_ns)
{
    const uint64_t id = req->id;
    const kvp_rpc_call_t *call =
        req->which_body <= KVP_RPC_MAX_TAG ? r->by_tag[req->which_body] : NULL;
    begin(r, s, call ? call : &kvp__rpc_calls[0], id, io, start_ns);
    if (!call) {
        kvp_rpc_error(&io->resp, id, KVP_EINVAL, "unknown or empty request body (tag %u)",
                      (unsigned)req->which_body);
        return KVP_RPC_DONE;
    }
    if (!s->hello_done && !(call->flags & KVP_CALL_BEFORE_HELLO)) {
        kvp_rpc_error(&io->resp, id, KVP_EPRECOND, "the first request must be Hello");
        return KVP_RPC_DONE;
    }
    if (s->observer && !(call->flags & KVP_CALL_OBSERVER)) {
        kvp_rpc_error(&io->resp, id, KVP_EPRECOND,
                      "%s: an observer session (attached to no namespace) makes read-only "
                      "calls only",
                      call->name);
        return KVP_RPC_DONE;
    }
    /* the string fields a handler reads (Hello checks its own) */
    if ((req->which_body == kvpool_Request_list_sequences_tag &&
         kvp__rpc_check_name(&io->resp, id, "namespace", req->body.list_sequences.namespace)) ||
        (req->which_body == kvpool_Request_export_begin_tag &&
         kvp__rpc_check_name(&io->resp, id, "peer", req->body.export_begin.peer)))
        return KVP_RPC_DONE;
    if (io->nfds_in > 0 && !(call->flags & KVP_CALL_TAKES_FDS)) {
        kvp_rpc_error(&io->resp, id, KVP_EINVAL,
                      "request carries %d fds; only RegisterBuffer takes one", io->nfds_in);
        return KVP_RPC_DONE;
    }
    if (r->unhealthy && !(call->flags & KVP_CALL_WHEN_UNHEALTHY)) {
        kvp_rpc_error(&io->resp, id, KVP_EUNAVAIL, "daemon is unhealthy");
        return KVP_RPC_DONE;
    }
    if ((call->flags & KVP_CALL_MUTATING) && !(call->flags & KVP_CALL_PER_CONN) && id != 0) {
        int v = retry_window(r, s, call, req, payload, len, io);
        if (v >= 0)
            return v;
    }
    int rc = call->handler(r, s, req, io, now_ms);
    assert(rc == KVP_RPC_DONE || (rc == KVP_RPC_ASYNC && (call->flags & KVP_CALL_OFF_LOOP)));
    if (rc == KVP_RPC_ASYNC)
        kvp__rpc_submit_call(r, s, io); /* the answer comes through resume (or io->job) */
    return rc;
}

void kvp_rpc_reject(kvp_rpc_t *r, kvp_session_t *s, uint64_t id, int err, const char *msg,
                    kvp_rpc_io_t *io, uint64_t start_ns)
{
    begin(r, s, &kvp__rpc_calls[0], id, io, start_ns);
    kvp_rpc_error(&io->resp, id, err, "%s", msg);
}

void kvp_rpc_answered(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Response *resp,
                      const uint8_t *frame, uint32_t len, uint64_t end_ns)
{
    const kvpool_Code code = resp ? resp->status.code : kvpool_Code_OK;
    const kvp_rpc_call_t *call = s->pending.call ? s->pending.call : &kvp__rpc_calls[0];
    kvp_counters_observe(&r->counters, KVP_RPC_CALL_INDEX(call), (unsigned)code,
                         end_ns - s->pending.start_ns);
    if (s->pending.in_window) {
        /* only an OK answer is remembered: a failed call changed nothing, so its retry runs */
        if (code == kvpool_Code_OK)
            kvp_dedup_answer(&r->dedup, s->ns, s->pending.req_id, frame, len);
        else
            kvp_dedup_forget(&r->dedup, s->ns, s->pending.req_id);
    }
    s->pending.call = NULL;
    s->pending.in_window = 0;
}

void kvp_rpc_observe_run(kvp_rpc_t *r, uint64_t run_ns)
{
    kvp_counters_observe_run(&r->counters, run_ns);
}
