/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc_cache.c - the prefix cache's part of the rpc layer (kvpool.proto, prefix cache;
 * DESIGN.md §9): scopes, the token ids and salts of Reserve and Append, Commit and the events
 * it waits for, Lookup, Pin, Unpin, CacheFlush, and the cache's part of Stats. The cache
 * itself is kvcache/kvp_pcache (pure); this file maps names, sessions and uids onto it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_log.h"
#include "kvp_rpc_internal.h"

/* Commits waiting for their worker's event at once, over the daemon (a Commit beyond it
 * answers UNAVAILABLE: retry once earlier ones are published). */
#define MAX_COMMITS 1024u
/* A Commit whose event has not completed after this long is dropped (a dead worker): its
 * pages stay private. */
#define COMMIT_TIMEOUT_MS 60000u

typedef struct kvp_commit {
    struct kvp_commit *next;
    const kvp_session_t *session; /* whose event it waits for */
    void *ev;                     /* borrowed from the session's commit_ev[] */
    uint64_t since_ms;
    uint32_t n;
    kvp_pcache_ref_t refs[];
} kvp_commit_t;

/* ---- create / destroy --------------------------------------------------------------------- */

static uint32_t max_scopes(const kvp_rpc_t *r)
{
    return r->lim.max_cache_scopes;
}

int kvp__rpc_cache_create(kvp_rpc_t *r)
{
    kvp_pcache_config_t cfg = {.max_scopes = max_scopes(r),
                               .max_pins = r->lim.max_pins,
                               .host_slots = kvp__rpc_tier_slots(r, r->lim.cache_host_bytes),
                               .keep_tokens = r->lim.ev_sink != NULL};
    int rc = kvp_pcache_create(r->seqs, &cfg, &r->pc);
    if (rc)
        return rc;
    r->scopes = calloc(cfg.max_scopes, sizeof(*r->scopes));
    r->content = calloc(r->lim.max_batch, sizeof(*r->content));
    r->cache_out = calloc(r->lim.max_batch, sizeof(*r->cache_out));
    r->cache_host_out = calloc(r->lim.max_batch, sizeof(*r->cache_host_out));
    if (!r->scopes || !r->content || !r->cache_out || !r->cache_host_out)
        return KVP_ENOMEM;
    if ((rc = kvp__rpc_events_create(r)))
        return rc;
    return kvp__rpc_tier_create(r);
}

void kvp__rpc_cache_destroy(kvp_rpc_t *r)
{
    while (r->commits) { /* their events went with their sessions */
        kvp_commit_t *c = r->commits;
        r->commits = c->next;
        free(c);
    }
    kvp__rpc_events_destroy(r); /* its last batch: AllBlocksCleared */
    kvp_pcache_destroy(r->pc);
    r->pc = NULL;
    kvp__rpc_tier_destroy(r);
    free(r->cache_host_out);
    free(r->cache_out);
    free(r->content);
    free(r->scopes);
    free(r->dump_buf);
    free(r->dump_names);
    free(r->dump_name_off);
    r->dump_buf = NULL;
    r->dump_names = NULL;
    r->dump_name_off = NULL;
    r->cache_host_out = r->cache_out = NULL; /* a second call (a failed create) is a no-op */
    r->content = NULL;
    r->scopes = NULL;
}

/* ---- scopes ------------------------------------------------------------------------------- */

uint32_t kvp__rpc_ns_scope(const kvp_rpc_t *r, uint32_t ns)
{
    return r->ns.ns[ns].scope1 - 1;
}

/* A pool-derived default: num_pages / div, at least 1 (kvp_config.h, limits.*_pinned_pages). */
static uint64_t pool_share(const kvp_rpc_t *r, uint32_t set, uint32_t div)
{
    if (set)
        return set;
    uint64_t n = r->backend->geom.num_pages / div;
    return n ? n : 1;
}

uint64_t kvp__rpc_ns_pin_quota(const kvp_rpc_t *r)
{
    return pool_share(r, r->lim.ns_max_pinned_pages, 8);
}

/* The prefix for namespaces' private scope names: no Hello may name one as its cache_scope. */
#define PRIVATE_SCOPE_PREFIX "ns:"

static int find_scope(const kvp_rpc_t *r, const char *name, int shared, uint32_t uid)
{
    for (uint32_t i = 0; i < max_scopes(r); i++) {
        const kvp_scope_t *sc = &r->scopes[i];
        if (sc->in_use && sc->shared == shared && (shared || sc->uid == uid) &&
            !strcmp(sc->name, name))
            return (int)i;
    }
    return -1;
}

/* A slot for a new scope: a free one, else one no namespace is in and no page of it is held
 * (its cached pages are flushed). -1 when every scope is in use. */
static int new_scope(kvp_rpc_t *r)
{
    for (uint32_t i = 0; i < max_scopes(r); i++)
        if (!r->scopes[i].in_use && kvp_pcache_scope_reset(r->pc, i) == 0)
            return (int)i;
    for (uint32_t i = 0; i < max_scopes(r); i++) {
        kvp_pcache_scope_stats_t st;
        kvp_pcache_scope_stats(r->pc, i, &st);
        if (r->scopes[i].namespaces == 0 && st.indexed_pages == st.cached_pages) {
            uint32_t n = kvp_pcache_flush(r->pc, i);
            kvp_pcache_scope_reset(r->pc, i); /* its counters are not the next scope's */
            kvp_log(KVP_LOG_INFO, "cache scope reused scope=%s cached_pages=%u", r->scopes[i].name,
                    n);
            memset(&r->scopes[i], 0, sizeof(r->scopes[i]));
            return (int)i;
        }
    }
    return -1;
}

int kvp__rpc_scope_join(kvp_rpc_t *r, const kvp_session_t *s, uint32_t ns, const char *name,
                        int ns_is_new, kvpool_Response *resp, uint64_t id)
{
    kvp_ns_t *n = &r->ns.ns[ns];
    if (kvp__rpc_check_name(resp, id, "cache_scope", name))
        return KVP_EINVAL;
    char key[sizeof(r->scopes[0].name)];
    int shared = 0;
    uint32_t uid = n->owner_uid;
    if (name[0]) {
        if (!strncmp(name, PRIVATE_SCOPE_PREFIX, strlen(PRIVATE_SCOPE_PREFIX))) {
            /* issue #26 defect 3: a uid that named another namespace's private scope could
             * then flush it by name */
            kvp_rpc_error(resp, id, KVP_EPERM,
                          "cache_scope '%s': names starting with '" PRIVATE_SCOPE_PREFIX
                          "' are the namespaces' private scopes (leave cache_scope empty for "
                          "yours)",
                          name);
            return KVP_EPERM;
        }
        if (kvp_access_scope_check(&r->lim.scope_access, name, s->uid, &shared)) {
            kvp_rpc_error(resp, id, KVP_EPERM,
                          "uid %u may not join cache scope '%s' (access.cache_scopes)", s->uid,
                          name);
            return KVP_EPERM;
        }
        snprintf(key, sizeof(key), "%s", name);
        uid = shared ? 0 : s->uid;
    } else {
        snprintf(key, sizeof(key), PRIVATE_SCOPE_PREFIX "%s", n->name);
    }
    if (n->scope1) { /* every session of a namespace is in its scope */
        if (!name[0] || (int)kvp__rpc_ns_scope(r, ns) == find_scope(r, key, shared, uid))
            return 0;
        kvp_rpc_error(resp, id, KVP_EPRECOND,
                      "namespace '%s' is in cache scope '%s'; a session naming '%s' cannot join it",
                      n->name, r->scopes[kvp__rpc_ns_scope(r, ns)].name, name);
        return KVP_EPRECOND;
    }
    (void)ns_is_new;
    int sc = find_scope(r, key, shared, uid);
    if (sc < 0 && (sc = new_scope(r)) >= 0) {
        kvp_scope_t *e = &r->scopes[sc];
        snprintf(e->name, sizeof(e->name), "%s", key);
        e->uid = uid;
        e->shared = (uint8_t)shared;
        e->in_use = 1;
        kvp__rpc_events_scope_named(r, (uint32_t)sc);
    }
    if (sc < 0) {
        kvp_rpc_error(resp, id, KVP_ELIMIT,
                      "every cache scope is in use (limits.max_cache_scopes %u)", max_scopes(r));
        return KVP_ELIMIT;
    }
    r->scopes[sc].namespaces++;
    n->scope1 = (uint32_t)sc + 1;
    kvp_pcache_set_pin_quota(r->pc, ns, kvp__rpc_ns_pin_quota(r));
    return 0;
}

int kvp__rpc_scope_leave(kvp_rpc_t *r, uint32_t ns)
{
    kvp_ns_t *n = &r->ns.ns[ns];
    if (kvp_pcache_ns_pins(r->pc, ns))
        return 1;
    if (n->scope1) {
        r->scopes[n->scope1 - 1].namespaces--;
        n->scope1 = 0;
    }
    return 0;
}

/* ---- token ids and salts ----------------------------------------------------------------- */

/* Checks salt_lens and salts against n sequences or prompts (or none): each at most
 * KVP_PAGEKEY_MAX_SALT, summing to the salt bytes. 0 or an error answered. */
static int check_salts(const kvp_batch_arrays_t *b, uint32_t n, kvpool_Response *resp, uint64_t id)
{
    const uint32_t nsalt = b->salt_lens.count;
    if (nsalt && nsalt != n) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "salt_lens has %u entries for %u sequences", nsalt, n);
        return KVP_EINVAL;
    }
    uint64_t sum = 0;
    for (uint32_t i = 0; i < nsalt; i++) {
        uint32_t l = ((const uint32_t *)b->salt_lens.data)[i];
        if (l > KVP_PAGEKEY_MAX_SALT) {
            kvp_rpc_error(resp, id, KVP_EINVAL, "salt %u is %u bytes, above %u", i, l,
                          KVP_PAGEKEY_MAX_SALT);
            return KVP_EINVAL;
        }
        sum += l;
    }
    if (sum != b->salts.count) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "salts holds %u bytes, salt_lens sum to %llu",
                      b->salts.count, (unsigned long long)sum);
        return KVP_EINVAL;
    }
    return 0;
}

int kvp__rpc_take_content(kvp_rpc_t *r, const kvp_session_t *s, const kvp_rpc_io_t *io, uint32_t n,
                          int has_opts, const kvpool_CacheOptions *opts, kvp_plan_cache_t *cache,
                          kvpool_Response *resp, uint64_t id)
{
    const kvp_batch_arrays_t *b = io->batch;
    const uint32_t ntok = b->token_ids.count, nsalt = b->salt_lens.count;
    if (!ntok) {
        if (nsalt || b->salts.count) {
            kvp_rpc_error(resp, id, KVP_EINVAL, "salts need token_ids");
            return -1;
        }
        if (has_opts && opts->reuse) {
            kvp_rpc_error(resp, id, KVP_EINVAL, "cache.reuse needs token_ids");
            return -1;
        }
        return 0;
    }
    uint64_t want = 0;
    for (uint32_t i = 0; i < n; i++)
        want += r->items[i].num_tokens;
    if (ntok != want) {
        kvp_rpc_error(resp, id, KVP_EINVAL,
                      "token_ids has %u entries, the batch appends %llu tokens", ntok,
                      (unsigned long long)want);
        return -1;
    }
    if (check_salts(b, n, resp, id))
        return -1;
    const uint32_t *lens = b->salt_lens.data;
    uint32_t prio = KVP_PCACHE_DEFAULT_PRIORITY;
    if (has_opts && opts->has_priority) {
        if (opts->priority > KVP_PCACHE_MAX_PRIORITY) {
            kvp_rpc_error(resp, id, KVP_EINVAL, "cache.priority %u above %u", opts->priority,
                          KVP_PCACHE_MAX_PRIORITY);
            return -1;
        }
        const uint32_t cap =
            r->lim.ns_max_priority ? r->lim.ns_max_priority : KVP_PCACHE_MAX_PRIORITY;
        if (opts->priority > cap && !kvp__rpc_is_operator(r, s->uid)) {
            /* eviction is daemon-wide: a tenant's priority ranks its pages against everyone's */
            kvp_rpc_error(resp, id, KVP_EPERM,
                          "cache.priority %u above limits.ns_max_priority %u (the range above it "
                          "is the operators')",
                          opts->priority, cap);
            return -1;
        }
        prio = opts->priority;
    }
    const int32_t *tok = b->token_ids.data;
    const uint8_t *salt = b->salts.data;
    for (uint32_t i = 0; i < n; i++) {
        r->content[i].token_ids = tok;
        tok += r->items[i].num_tokens;
        r->content[i].salt_len = nsalt ? lens[i] : 0;
        r->content[i].salt = nsalt ? salt : NULL;
        salt += r->content[i].salt_len;
    }
    cache->scope = kvp__rpc_ns_scope(r, s->ns);
    cache->reuse = has_opts && opts->reuse;
    cache->promote = cache->reuse && r->tier.mem != NULL; /* host hits restored (issue #28) */
    cache->leave_last = has_opts && opts->leave_last;
    cache->priority = (uint8_t)prio;
    cache->daemon_writes = 0; /* Append sets it */
    cache->retention_ms = has_opts ? opts->retention_ms : 0;
    return 1;
}

/* ---- Commit ------------------------------------------------------------------------------ */

void kvp_rpc_set_commit_wake(kvp_rpc_t *r, void (*wake)(void *arg), void *arg)
{
    r->commit_wake = wake;
    r->commit_wake_arg = arg;
}

uint32_t kvp_rpc_commits_pending(const kvp_rpc_t *r)
{
    return r->num_commits;
}

uint32_t kvp_rpc_poll_commits(kvp_rpc_t *r, uint64_t now_ms)
{
    kvp_commit_t **link = &r->commits;
    while (*link) {
        kvp_commit_t *c = *link;
        int q = r->backend->ops->event_query(r->backend, c->ev);
        if (q == 0 && now_ms - c->since_ms < COMMIT_TIMEOUT_MS) {
            link = &c->next;
            continue;
        }
        if (q == 1)
            kvp_pcache_publish(r->pc, c->refs, c->n);
        else
            kvp_log(KVP_LOG_WARNING, "commit dropped pages=%u reason=\"%s\"", c->n,
                    q < 0 ? "the worker's event reported an error"
                          : "the worker's event did not complete in 60 s");
        *link = c->next;
        free(c);
        r->num_commits--;
    }
    return r->num_commits;
}

void kvp__rpc_cache_session_close(kvp_rpc_t *r, kvp_session_t *s)
{
    /* its event goes with it (the worker may be gone: the event must not be queried again), so
     * what it committed and is still waiting stays private */
    for (kvp_commit_t **link = &r->commits; *link;) {
        kvp_commit_t *c = *link;
        if (c->session != s) {
            link = &c->next;
            continue;
        }
        kvp_log(KVP_LOG_INFO, "commit dropped pages=%u reason=\"the worker disconnected first\"",
                c->n);
        *link = c->next;
        free(c);
        r->num_commits--;
    }
    for (uint32_t i = 0; i < s->num_commit_ev; i++)
        r->backend->ops->event_close(r->backend, s->commit_ev[i].ev);
    s->num_commit_ev = 0;
}

/* The session's opened event for handle (opening it the first time): 0 and *ev, or an error
 * answered in resp. */
static int session_event(kvp_rpc_t *r, kvp_session_t *s, const uint8_t *handle, void **ev,
                         kvpool_Response *resp, uint64_t id)
{
    for (uint32_t i = 0; i < s->num_commit_ev; i++)
        if (!memcmp(s->commit_ev[i].handle, handle, KVP_BACKEND_IPC_HANDLE_BYTES)) {
            *ev = s->commit_ev[i].ev;
            return 0;
        }
    const uint32_t cap = sizeof(s->commit_ev) / sizeof(s->commit_ev[0]);
    if (s->num_commit_ev == cap) {
        kvp_rpc_error(resp, id, KVP_ELIMIT, "a connection's Commits name at most %u events", cap);
        return KVP_ELIMIT;
    }
    if (r->backend->ops->event_open(r->backend, handle, KVP_BACKEND_IPC_HANDLE_BYTES, ev)) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "the driver refused event_handle");
        return KVP_EINVAL;
    }
    memcpy(s->commit_ev[s->num_commit_ev].handle, handle, KVP_BACKEND_IPC_HANDLE_BYTES);
    s->commit_ev[s->num_commit_ev++].ev = *ev;
    return 0;
}

int kvp__rpc_commit(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                    uint64_t now_ms)
{
    const uint64_t id = req->id;
    const kvpool_CommitRequest *q = &req->body.commit;
    kvpool_Response *resp = &io->resp;
    const uint32_t elen = q->event_handle.size;
    uint32_t n;
    if (kvp__rpc_take_batch(r, s, io, 0, &n, resp, id))
        return 0;
    if (kvp_access_pool_check(&r->lim.pool_access, s->uid, s->gid)) {
        /* issue #26 defect 8: a Commit says "I wrote these pages"; a uid refused the pool's
         * memory cannot have, so its word would publish whatever rows the pages held */
        kvp_rpc_error(resp, id, KVP_EPERM,
                      "uid %u may not receive the pool's memory (access.pool_uids / pool_gids), "
                      "so it cannot have written pages to commit: daemon-run Append publishes "
                      "what it copies",
                      s->uid);
        return 0;
    }
    if (elen && elen != KVP_BACKEND_IPC_HANDLE_BYTES) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "event_handle is %u bytes, not %u", elen,
                      KVP_BACKEND_IPC_HANDLE_BYTES);
        return 0;
    }
    if (elen && !r->backend->ops->event_open) {
        kvp_rpc_error(resp, id, KVP_EINVAL,
                      "the %s backend has no events: synchronize, then Commit without one",
                      r->backend->ops->name);
        return 0;
    }
    if (elen && r->num_commits >= MAX_COMMITS) {
        kvp_rpc_error(resp, id, KVP_EUNAVAIL, "%u commits wait for their events; retry",
                      r->num_commits);
        return 0;
    }
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; i++) { /* all exist, or nothing changes */
        kvp_seq_t *sq = kvp_seqtab_find(r->seqs, s->ns, r->items[i].seq_id);
        if (!sq) {
            kvp_rpc_error(resp, id, KVP_ENOENT, "no sequence %llu (batch item %u)",
                          (unsigned long long)r->items[i].seq_id, i);
            return 0;
        }
        total += sq->num_pages;
    }
    kvp_commit_t *c = malloc(sizeof(*c) + (size_t)(total ? total : 1) * sizeof(kvp_pcache_ref_t));
    if (!c) {
        kvp_rpc_error(resp, id, KVP_ENOMEM, "out of memory for the commit");
        return 0;
    }
    c->ev = NULL;
    c->session = s;
    if (elen && session_event(r, s, q->event_handle.bytes, &c->ev, resp, id)) {
        free(c);
        return 0;
    }
    c->n = 0;
    for (uint32_t i = 0; i < n; i++) {
        kvp_seq_t *sq = kvp_seqtab_find(r->seqs, s->ns, r->items[i].seq_id);
        c->n += kvp_pcache_take_unpublished(r->pc, sq, c->refs + c->n, (uint32_t)(total - c->n));
    }
    kvp__rpc_ok(io, id);
    kvpool_CommitResponse *cr = &resp->body.commit;
    cr->pages = c->n;
    int done = !elen || r->backend->ops->event_query(r->backend, c->ev) == 1;
    if (done || c->n == 0) {
        cr->published = done ? kvp_pcache_publish(r->pc, c->refs, c->n) : 0;
        free(c);
        return 0;
    }
    c->since_ms = now_ms;
    c->next = NULL;
    kvp_commit_t **tail = &r->commits;
    while (*tail)
        tail = &(*tail)->next;
    *tail = c;
    if (r->num_commits++ == 0 && r->commit_wake)
        r->commit_wake(r->commit_wake_arg);
    return 0;
}

/* ---- Lookup, Pin, Unpin, CacheFlush ------------------------------------------------------ */

/* limits.max_lookup_tokens; 0: 16384 pages' worth (at most 2^20 tokens). Finding a page costs
 * about the same whatever its size (a hash of its ids and a probe), so the work of one call on
 * the loop is bounded in pages: one client's Lookups must not stall everyone else's calls
 * (issue #26, "no fairness on the loop"). */
uint32_t kvp__rpc_max_lookup_tokens(const kvp_rpc_t *r)
{
    if (r->lim.max_lookup_tokens)
        return r->lim.max_lookup_tokens;
    uint64_t t = 16384ull * r->backend->geom.page_size;
    return t < (1u << 20) ? (uint32_t)t : 1u << 20;
}

int kvp__rpc_lookup(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                    uint64_t now_ms)
{
    (void)now_ms;
    const uint64_t id = req->id;
    kvpool_Response *resp = &io->resp;
    const kvp_batch_arrays_t *b = io->batch;
    const uint32_t n = b->num_tokens.count;
    if (n == 0 || n > r->lim.max_batch) {
        kvp_rpc_error(resp, id, n ? KVP_ELIMIT : KVP_EINVAL,
                      "a Lookup names 1..%u prompts (limits.max_batch), not %u", r->lim.max_batch,
                      n);
        return 0;
    }
    const uint32_t *lens = b->num_tokens.data;
    uint64_t sum = 0;
    for (uint32_t i = 0; i < n; i++)
        sum += lens[i];
    if (sum > kvp__rpc_max_lookup_tokens(r)) {
        kvp_rpc_error(resp, id, KVP_ELIMIT,
                      "a Lookup of %llu tokens is above %u (limits."
                      "max_lookup_tokens)",
                      (unsigned long long)sum, kvp__rpc_max_lookup_tokens(r));
        return 0;
    }
    if (sum != b->token_ids.count) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "token_ids has %u entries, lengths sum to %llu",
                      b->token_ids.count, (unsigned long long)sum);
        return 0;
    }
    if (check_salts(b, n, resp, id))
        return 0;
    const uint32_t scope = kvp__rpc_ns_scope(r, s->ns), ps = r->backend->geom.page_size;
    const int32_t *tok = b->token_ids.data;
    const uint8_t *salt = b->salts.data;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t sl = b->salt_lens.count ? ((const uint32_t *)b->salt_lens.data)[i] : 0;
        kvp_pagekey_t root;
        kvp_pagekey_root(salt, sl, &root);
        uint32_t gpu, all = kvp_pcache_lookup_tiers(r->pc, scope, root, tok, lens[i], 1, &gpu);
        r->cache_out[i] = gpu * ps;
        r->cache_host_out[i] = (all - gpu) * ps;
        tok += lens[i];
        salt += sl;
    }
    kvp__rpc_ok(io, id);
    io->out.cached_tokens = kvp_array(r->cache_out, 4, n, 0);
    /* host_tokens only with a host tier (absent: none, as before issue #28) */
    io->out.host_tokens = kvp_array(r->cache_host_out, 4, r->tier.mem ? n : 0, 0);
    kvp_wire_lookup_bind_encode(&resp->body.lookup, &io->out);
    return 0;
}

/* Whether a pin of f more pages would pass one of the pin shares (kvp_config.h; issue #26
 * defects 5 and 6): the daemon's pin table, the namespace's pins and pinned pages, its page
 * quota (pins count against it), and its owner uid's pins and pinned pages over all its
 * namespaces (operators exempt). Names the limit hit in why. kvp_pcache_pin checks the
 * namespace's page quotas again; here they are checked first to say which one. */
static int pin_refused(const kvp_rpc_t *r, uint32_t ns, uint64_t f, char *why, size_t len)
{
    const kvp_ns_t *n = &r->ns.ns[ns];
    kvp_pcache_stats_t st;
    kvp_pcache_stats(r->pc, &st);
    const uint32_t max_pins = r->lim.max_pins;
    const uint32_t ns_pins = kvp_pcache_ns_pins(r->pc, ns);
    kvp_ns_stats_t nst;
    kvp_seqtab_ns_stats(r->seqs, ns, &nst);
    const uint64_t ns_quota = kvp__rpc_ns_pin_quota(r);
    if (st.pins >= max_pins)
        snprintf(why, len, "the daemon holds %u pins (limits.max_pins)", st.pins);
    else if (r->lim.ns_max_pins && ns_pins >= r->lim.ns_max_pins)
        snprintf(why, len, "namespace '%s' holds %u pins (limits.ns_max_pins)", n->name, ns_pins);
    else if (nst.pinned_pages + f > ns_quota)
        snprintf(why, len,
                 "namespace '%s' pins %llu pages; %llu more pass limits.ns_max_pinned_pages %llu",
                 n->name, (unsigned long long)nst.pinned_pages, (unsigned long long)f,
                 (unsigned long long)ns_quota);
    else if (nst.max_page_refs && nst.page_refs + nst.pinned_pages + f > nst.max_page_refs)
        snprintf(why, len,
                 "namespace '%s' holds %llu page references and pins %llu pages; %llu more pass "
                 "limits.ns_max_pages %llu",
                 n->name, (unsigned long long)nst.page_refs, (unsigned long long)nst.pinned_pages,
                 (unsigned long long)f, (unsigned long long)nst.max_page_refs);
    else if (!kvp__rpc_is_operator(r, n->owner_uid)) {
        uint32_t pins = 0;
        uint64_t pages = 0;
        for (uint32_t i = 0; i < r->ns.max; i++)
            if (r->ns.ns[i].in_use && r->ns.ns[i].owner_uid == n->owner_uid) {
                pins += kvp_pcache_ns_pins(r->pc, i);
                pages += kvp_pcache_ns_pinned_pages(r->pc, i);
            }
        const uint64_t uid_quota = pool_share(r, r->lim.uid_max_pinned_pages, 4);
        if (r->lim.uid_max_pins && pins >= r->lim.uid_max_pins)
            snprintf(why, len, "uid %u holds %u pins (limits.uid_max_pins)", n->owner_uid, pins);
        else if (pages + f > uid_quota)
            snprintf(why, len,
                     "uid %u pins %llu pages; %llu more pass limits.uid_max_pinned_pages %llu",
                     n->owner_uid, (unsigned long long)pages, (unsigned long long)f,
                     (unsigned long long)uid_quota);
        else
            return 0;
    } else
        return 0;
    return 1;
}

int kvp__rpc_pin(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                 uint64_t now_ms)
{
    const uint64_t id = req->id;
    const kvpool_PinRequest *q = &req->body.pin;
    kvpool_Response *resp = &io->resp;
    const kvp_batch_arrays_t *b = io->batch;
    const uint32_t ntok = b->token_ids.count;
    if (ntok > kvp__rpc_max_lookup_tokens(r)) {
        kvp_rpc_error(resp, id, KVP_ELIMIT,
                      "a Pin of %u tokens is above %u (limits."
                      "max_lookup_tokens)",
                      ntok, kvp__rpc_max_lookup_tokens(r));
        return 0;
    }
    const uint32_t max_ttl = r->lim.pin_max_ttl_ms;
    const uint32_t ttl = q->ttl_ms == 0 || q->ttl_ms > max_ttl ? max_ttl : q->ttl_ms;
    kvp_pagekey_t root;
    kvp_pagekey_root(q->salt.bytes, q->salt.size, &root); /* size bounded by the options */
    const uint32_t scope = kvp__rpc_ns_scope(r, s->ns);
    const uint32_t f = kvp_pcache_lookup(r->pc, scope, root, b->token_ids.data, ntok, 0);
    char why[200];
    if (f && pin_refused(r, s->ns, f, why, sizeof(why))) {
        kvp_rpc_error(resp, id, KVP_ELIMIT, "pin of %u pages refused: %s", f, why);
        return 0;
    }
    uint64_t pin_id;
    uint32_t pages = 0;
    int rc = kvp_pcache_pin(r->pc, s->ns, scope, root, b->token_ids.data, ntok, now_ms, ttl,
                            &pin_id, &pages);
    if (rc) {
        kvp_rpc_error(resp, id, rc,
                      rc == KVP_ENOENT ? "nothing of this prompt is cached"
                                       : "cannot pin in namespace '%s': %s",
                      r->ns.ns[s->ns].name, kvp_strerror(rc));
        return 0;
    }
    kvp__rpc_ok(io, id);
    kvpool_PinResponse *pr = &resp->body.pin;
    pr->pin_id = pin_id;
    pr->pinned_pages = pages;
    pr->pinned_tokens = pages * r->backend->geom.page_size;
    pr->expires_in_ms = ttl;
    return 0;
}

int kvp__rpc_unpin(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                   uint64_t now_ms)
{
    (void)now_ms;
    const uint64_t id = req->id;
    int rc = kvp_pcache_unpin(r->pc, s->ns, req->body.unpin.pin_id);
    if (rc < 0) {
        kvp_rpc_error(&io->resp, id, rc, "no pin %llu in this namespace",
                      (unsigned long long)req->body.unpin.pin_id);
        return 0;
    }
    kvp__rpc_ok(io, id);
    io->resp.body.unpin.pages = (uint32_t)rc;
    return 0;
}

int kvp__rpc_cache_flush(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                         kvp_rpc_io_t *io, uint64_t now_ms)
{
    (void)now_ms;
    const uint64_t id = req->id;
    const kvpool_CacheFlushRequest *q = &req->body.cache_flush;
    kvpool_Response *resp = &io->resp;
    if (kvp__rpc_check_name(resp, id, "scope", q->scope))
        return 0;
    const int op = kvp__rpc_is_operator(r, s->uid);
    const uint32_t own = kvp__rpc_ns_scope(r, s->ns);
    uint32_t pages = 0;
    if (q->all || q->scope[0]) {
        if (!op && (q->all || strcmp(q->scope, r->scopes[own].name))) {
            kvp_rpc_error(resp, id, KVP_EPERM,
                          "only the operators (root, uid %u) flush another scope or every one",
                          r->lim.operator_uid);
            return 0;
        }
        if (q->all) {
            pages = kvp_pcache_flush(r->pc, KVP_PCACHE_NO_SCOPE);
        } else if (!op) {
            /* the caller's own scope: the (name, uid) pair it joined, never another uid's
             * scope of the same name (issue #26 defect 3) */
            pages = kvp_pcache_flush(r->pc, own);
        } else { /* operators: every scope of that name */
            int found = 0;
            for (uint32_t i = 0; i < max_scopes(r); i++)
                if (r->scopes[i].in_use && !strcmp(r->scopes[i].name, q->scope)) {
                    pages += kvp_pcache_flush(r->pc, i);
                    found = 1;
                }
            if (!found) {
                kvp_rpc_error(resp, id, KVP_ENOENT, "no cache scope '%s'", q->scope);
                return 0;
            }
        }
    } else {
        pages = kvp_pcache_flush(r->pc, own);
    }
    kvp_log(KVP_LOG_INFO, "cache flushed ns=%s scope=%s pages=%u", r->ns.ns[s->ns].name,
            q->all        ? "*"
            : q->scope[0] ? q->scope
                          : r->scopes[own].name,
            pages);
    kvp__rpc_ok(io, id);
    resp->body.cache_flush.pages = pages;
    return 0;
}

/* ---- tick and Stats ----------------------------------------------------------------------- */

void kvp__rpc_cache_tick(kvp_rpc_t *r, uint64_t now_ms)
{
    kvp__rpc_tier_kick(r, now_ms); /* the host tier's readiness and the watermark */
    if (kvp_pcache_expire(r->pc, now_ms) == 0)
        return;
    for (uint32_t i = 0; i < r->ns.max; i++) {
        kvp_ns_t *n = &r->ns.ns[i];
        if (n->in_use && n->pins_only && !kvp__rpc_scope_leave(r, i)) {
            kvp_log(KVP_LOG_INFO, "namespace released ns=%s reason=\"its last pin expired\"",
                    n->name);
            kvp_ns_forget(&r->ns, i);
        }
    }
}

void kvp__rpc_cache_stats(kvp_rpc_t *r, const kvp_session_t *s, kvpool_CacheStats *out)
{
    kvp_pcache_stats_t st;
    kvp_pcache_stats(r->pc, &st);
    out->cached_pages = st.cached_pages;
    out->pinned_pages = st.pinned_pages;
    out->indexed_pages = st.indexed_pages;
    out->pins = st.pins;
    out->query_tokens_total = st.query_tokens;
    out->hit_tokens_total = st.hit_tokens;
    out->evictions_pressure_total = st.evictions[KVP_EVICT_PRESSURE];
    out->evictions_flush_total = st.evictions[KVP_EVICT_FLUSH];
    out->evictions_rewrite_total = st.evictions[KVP_EVICT_REWRITE];
    out->bytes = st.bytes;
    kvp__rpc_tier_stats(r, out);
    const int op = kvp__rpc_is_operator(r, s->uid);
    const pb_size_t cap = sizeof(out->scopes) / sizeof(out->scopes[0]);
    for (uint32_t i = 0; i < max_scopes(r) && out->scopes_count < cap; i++) {
        const kvp_scope_t *sc = &r->scopes[i];
        if (!sc->in_use)
            continue;
        int mine = !s->observer && r->ns.ns[s->ns].scope1 == i + 1;
        if (!op && !mine && (sc->shared || sc->uid != s->uid))
            continue;
        kvp_pcache_scope_stats_t ss;
        kvp_pcache_scope_stats(r->pc, i, &ss);
        kvpool_CacheScopeStats *o = &out->scopes[out->scopes_count++];
        snprintf(o->name, sizeof(o->name), "%s", sc->name);
        o->uid = sc->uid;
        o->namespaces = sc->namespaces;
        o->cached_pages = ss.cached_pages;
        o->indexed_pages = ss.indexed_pages;
        o->query_tokens = ss.query_tokens;
        o->hit_tokens = ss.hit_tokens;
        o->host_pages = ss.host_pages;
        o->host_hit_tokens = ss.host_hit_tokens;
    }
}
