/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc_events.c - the rpc layer's side of KV events (issue #29): the batcher's life (it
 * observes the prefix cache; the daemon's first and last batches are AllBlocksCleared), the
 * scopes' published names and tags, the per-iteration flush, the CacheDump call (the snapshot a
 * late consumer loads before the stream) and the events' counters for the metrics.
 *
 * Published scope names (what extra_keys and CacheDump carry): a shared scope's name, a
 * namespace's private "ns:<namespace>", and "uid:<uid>:<name>" for a name a uid gave without
 * an access.cache_scopes entry (two uids may each have one of the same name). Block hashes mix
 * in the tag of that name (kvp_events.h), so the same content in two scopes never shares one.
 */
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_log.h"
#include "kvp_rpc_internal.h"

/* Bytes of one CacheDump answer's blocks: well inside the smallest answer the Metrics call
 * already needs (KVP_RPC_METRICS_CAP). */
#define DUMP_CAP        (1u << 20)
#define DUMP_MAX_BLOCKS 65536u
#define REC_FIXED       40u /* hash, parent, scope_off, medium, has_parent, reserved */

static void scope_name(void *ctx, uint32_t scope, const char **name, kvp_pagekey_t *tag)
{
    const kvp_rpc_t *r = ctx;
    const kvp_scope_t *sc = &r->scopes[scope];
    *name = sc->pub;
    *tag = sc->tag;
}

void kvp__rpc_events_scope_named(kvp_rpc_t *r, uint32_t i)
{
    kvp_scope_t *sc = &r->scopes[i];
    if (sc->shared || !strncmp(sc->name, "ns:", 3))
        snprintf(sc->pub, sizeof(sc->pub), "%s", sc->name);
    else
        snprintf(sc->pub, sizeof(sc->pub), "uid:%u:%s", sc->uid, sc->name);
    kvp_pagekey_root(sc->pub, strlen(sc->pub), &sc->tag);
    if (r->events)
        kvp_events_forget_scope(r->events);
}

int kvp__rpc_events_create(kvp_rpc_t *r)
{
    if (!r->lim.ev_sink)
        return 0;
    int rc = kvp_events_create(r->backend->geom.page_size, r->lim.ev_sink, r->lim.ev_ctx,
                               scope_name, r, &r->events);
    if (rc)
        return rc;
    kvp_pcache_set_observer(r->pc, kvp_events_observe, r->events);
    kvp_events_clear(r->events); /* a consumer that saw an earlier daemon forgets its blocks */
    kvp_events_flush(r->events);
    return 0;
}

void kvp__rpc_events_destroy(kvp_rpc_t *r)
{
    if (!r->events)
        return;
    if (r->pc)
        kvp_pcache_set_observer(r->pc, NULL, NULL);
    kvp_events_clear(r->events); /* the cache goes with the daemon */
    kvp_events_flush(r->events);
    kvp_events_destroy(r->events);
    r->events = NULL;
}

void kvp_rpc_events_flush(kvp_rpc_t *r)
{
    if (r->events)
        kvp_events_flush(r->events);
}

uint32_t kvp_rpc_events_tick(kvp_rpc_t *r, uint32_t batch_ms)
{
    if (!r->events)
        return UINT32_MAX;
    /* the loop calls this every iteration: no clock read without an open batch */
    uint32_t in = kvp_events_open(r->events)
                      ? kvp_events_due_in(r->events, kvp_events_now_ms(), batch_ms)
                      : UINT32_MAX;
    if (in == 0) {
        kvp_events_flush(r->events);
        return UINT32_MAX;
    }
    return in;
}

/* ---- CacheDump ----------------------------------------------------------------------------- */

static void put_le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

int kvp__rpc_cache_dump(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                        uint64_t now_ms)
{
    (void)now_ms;
    const uint64_t id = req->id;
    const kvpool_CacheDumpRequest *q = &req->body.cache_dump;
    kvpool_Response *resp = &io->resp;
    const int op = kvp__rpc_is_operator(r, s->uid);
    if (!op && s->observer) {
        kvp_rpc_error(resp, id, KVP_EPERM,
                      "an observer session sees no cache scope: only the operators (root, uid %u) "
                      "dump the whole cache",
                      r->lim.operator_uid);
        return 0;
    }
    const uint32_t own = op ? UINT32_MAX : kvp__rpc_ns_scope(r, s->ns);
    const uint32_t ps = r->backend->geom.page_size, rec = REC_FIXED + 4 * ps;
    const uint32_t nscopes = r->lim.max_cache_scopes;
    if (!r->dump_buf) {
        r->dump_buf = malloc(DUMP_CAP);
        r->dump_names = malloc((size_t)nscopes * sizeof(r->scopes[0].pub));
        r->dump_name_off = malloc((size_t)nscopes * sizeof(uint32_t));
        if (!r->dump_buf || !r->dump_names || !r->dump_name_off) {
            kvp_rpc_error(resp, id, KVP_ENOMEM, "no memory for a cache dump");
            return 0;
        }
    }
    uint32_t max = q->max_blocks ? q->max_blocks : DUMP_MAX_BLOCKS;
    if (max > DUMP_MAX_BLOCKS)
        max = DUMP_MAX_BLOCKS;
    if (max > DUMP_CAP / rec)
        max = DUMP_CAP / rec;
    if (max == 0) {
        kvp_rpc_error(resp, id, KVP_ELIMIT, "a block of %u tokens does not fit a dump answer", ps);
        return 0;
    }
    /* the state below reflects every batch before next_seq */
    kvp_rpc_events_flush(r);
    for (uint32_t i = 0; i < nscopes; i++)
        r->dump_name_off[i] = UINT32_MAX;
    uint32_t n = 0, nnames = 0, cursor = q->cursor, next = 0;
    kvp_pcache_event_t e;
    for (;;) {
        const uint32_t at = cursor;
        if (kvp_pcache_next_entry(r->pc, &cursor, &e))
            break; /* the end: next stays 0 */
        if (own != UINT32_MAX && e.scope != own)
            continue;
        if (n == max) {
            next = at; /* this entry starts the next page */
            break;
        }
        const kvp_scope_t *sc = &r->scopes[e.scope];
        if (r->dump_name_off[e.scope] == UINT32_MAX) {
            const size_t len = strlen(sc->pub) + 1;
            memcpy(r->dump_names + nnames, sc->pub, len);
            r->dump_name_off[e.scope] = nnames;
            nnames += (uint32_t)len;
        }
        uint8_t *o = r->dump_buf + (size_t)n * rec;
        memset(o, 0, REC_FIXED);
        kvp_events_hash(e.key, sc->tag, o);
        if (e.has_parent)
            kvp_events_hash(e.parent, sc->tag, o + 16);
        put_le32(o + 32, r->dump_name_off[e.scope]);
        o[36] = e.medium == KVP_MEDIUM_HOST ? 1 : 0;
        o[37] = e.has_parent ? 1 : 0;
        if (e.tokens)
            memcpy(o + REC_FIXED, e.tokens, (size_t)ps * 4);
        else
            memset(o + REC_FIXED, 0, (size_t)ps * 4);
        n++;
    }
    kvp__rpc_ok(io, id);
    kvpool_CacheDumpResponse *d = &resp->body.cache_dump;
    d->next_cursor = next;
    d->next_seq = r->events ? (int64_t)kvp_events_next_seq(r->events) : -1;
    d->block_size = ps;
    d->block_record_bytes = rec;
    d->events = r->events != NULL;
    io->out.dump_blocks = kvp_array(r->dump_buf, 1, n * rec, 0);
    io->out.dump_names = kvp_array(r->dump_names, 1, nnames, 0);
    kvp_wire_dump_bind_encode(d, &io->out);
    return 0;
}

/* ---- metrics ------------------------------------------------------------------------------- */

void kvp__rpc_events_metrics(const kvp_rpc_t *r, kvp_metrics_t *m)
{
    const kvp_ev_stats_t *st = r->lim.ev_stats;
    if (!r->events || !st)
        return;
    m->has_events = 1;
    m->ev.batches = atomic_load(&st->batches);
    m->ev.events = atomic_load(&st->events);
    m->ev.blocks = atomic_load(&st->blocks);
    m->ev.bytes = atomic_load(&st->bytes);
    m->ev.dropped_hwm = atomic_load(&st->dropped_hwm);
    m->ev.dropped_queue = atomic_load(&st->dropped_queue);
    m->ev.dropped_memory = kvp_events_lost(r->events);
    m->ev.replay_requests = atomic_load(&st->replay_requests);
    m->ev.replay_bad = atomic_load(&st->replay_bad);
    m->ev.replayed_batches = atomic_load(&st->replayed_batches);
    m->ev.subscribers = atomic_load(&st->subscribers);
    m->ev.queued = atomic_load(&st->queued);
    m->ev.next_seq = kvp_events_next_seq(r->events);
}
