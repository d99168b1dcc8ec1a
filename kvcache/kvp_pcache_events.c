/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pcache_events.c - the prefix cache's events (issue #29, kvp_pcache.h "events"): the
 * observer told of each entry that enters (STORED) or leaves (REMOVED) the key table, a flush of
 * every scope told as one CLEARED and then what is still findable, the iteration of every
 * findable entry (the snapshot), and the token store behind them (keep_tokens): each entry
 * slot's page tokens, parent key and whether it has a parent, carried along when an entry moves
 * between tiers. The key table (kvp_pcache_index.c) calls in here only when an observer is set;
 * keying a page records its tokens (kvp_pcache.c, key_page). Nothing here changes what the
 * cache holds.
 */
#include <string.h>

#include "kvp_error.h"
#include "kvp_pcache.h"
#include "kvp_pcache_internal.h"

/* Entry slot s as a STORED event. The parent of a chain's first page is the salt's root key:
 * not a block, and the salt is never told, so it is left zero. */
static void fill_stored(const kvp_pcache_t *c, uint32_t s, kvp_pcache_event_t *ev)
{
    memset(ev, 0, sizeof(*ev));
    ev->kind = KVP_PCEV_STORED;
    ev->medium = kvp__pc_medium(c, s);
    ev->scope = c->scope[s];
    ev->key = c->key[s];
    if (!c->tok)
        return;
    ev->tokens = c->tok + (size_t)s * c->ps;
    ev->has_parent = c->has_parent[s];
    if (ev->has_parent)
        ev->parent = c->parent[s];
}

void kvp__pcache_emit(kvp_pcache_t *c, uint32_t kind, uint32_t s)
{
    kvp_pcache_event_t ev;
    if (kind == KVP_PCEV_STORED) {
        fill_stored(c, s, &ev);
    } else { /* REMOVED names the entry only */
        memset(&ev, 0, sizeof(ev));
        ev.kind = kind;
        ev.medium = kvp__pc_medium(c, s);
        ev.scope = c->scope[s];
        ev.key = c->key[s];
    }
    c->obs(c->obs_ctx, &ev);
}

void kvp__pcache_aux_copy(kvp_pcache_t *c, uint32_t dst, uint32_t src)
{
    if (!c->tok)
        return;
    memcpy(c->tok + (size_t)dst * c->ps, c->tok + (size_t)src * c->ps,
           (size_t)c->ps * sizeof(int32_t));
    c->parent[dst] = c->parent[src];
    c->has_parent[dst] = c->has_parent[src];
}

void kvp__pcache_clear_begin(kvp_pcache_t *c)
{
    kvp_pcache_event_t ev;
    memset(&ev, 0, sizeof(ev));
    ev.kind = KVP_PCEV_CLEARED;
    c->obs(c->obs_ctx, &ev);
    /* muted until clear_end: the table's changes reach no one (whatever the observer set in
     * its call is what clear_end restores) */
    c->obs_held = c->obs;
    c->obs = NULL;
}

void kvp__pcache_clear_end(kvp_pcache_t *c)
{
    c->obs = c->obs_held;
    c->obs_held = NULL;
    kvp_pcache_event_t ev;
    for (uint32_t cur = 0; c->obs && kvp_pcache_next_entry(c, &cur, &ev) == 0;)
        c->obs(c->obs_ctx, &ev);
}

void kvp_pcache_set_observer(kvp_pcache_t *c, kvp_pcache_observer_t fn, void *ctx)
{
    c->obs = fn;
    c->obs_ctx = fn ? ctx : NULL;
}

int kvp_pcache_next_entry(const kvp_pcache_t *c, uint32_t *cursor, kvp_pcache_event_t *out)
{
    /* entry slots are GPU pages, then host slots: their order is the snapshot's. A busy host
     * slot (a move in flight) is no entry: its key is its GPU page's. */
    const uint32_t nslots = c->np + c->nhost;
    for (uint32_t s = *cursor; s < nslots; s++) {
        if (c->flags[s] & KVP_PAGE_INDEXED) {
            fill_stored(c, s, out);
            *cursor = s + 1;
            return 0;
        }
    }
    return KVP_ENOENT;
}
