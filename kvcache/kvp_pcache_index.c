/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pcache_index.c - the prefix cache's key table: finding entries (find, locate, Lookup's
 * walk over the GPU tier or both), publishing pages into the table, and the per-location state
 * queries (kvp_pcache.h). The table is a chained hash over entry slots (kvp_pcache_internal.h):
 * bucket heads and one next link per slot, so an entry is found the same way whatever its medium.
 * Every entry enters and leaves the table here, so this is where the observer hears of it
 * (kvp_pcache_events.c). It does not decide what stays cached or goes (kvp_pcache_evict.c) nor
 * hold references (pins, the planner).
 */
#include <assert.h>

#include "kvp_error.h"
#include "kvp_pcache.h"
#include "kvp_pcache_internal.h"

#define NIL KVP__PC_NIL

/* ---- the table ---------------------------------------------------------------------------- */

uint32_t kvp__pcache_find_slot(const kvp_pcache_t *c, uint32_t scope, kvp_pagekey_t key)
{
    for (uint32_t p = c->bucket[kvp__pc_bucket(c, scope, key)]; p != NIL; p = c->hnext[p])
        if (kvp_pagekey_eq(c->key[p], key) && c->scope[p] == scope)
            return p;
    return NIL;
}

uint32_t kvp_pcache_find(const kvp_pcache_t *c, uint32_t scope, kvp_pagekey_t key)
{
    const uint32_t s = kvp__pcache_find_slot(c, scope, key);
    return s < c->np ? s : NIL; /* an entry of another medium is not a page to hand out */
}

kvp_loc_t kvp_pcache_locate(const kvp_pcache_t *c, uint32_t scope, kvp_pagekey_t key)
{
    const uint32_t s = kvp__pcache_find_slot(c, scope, key);
    return s == NIL ? kvp_loc_none() : kvp__pc_loc(c, s);
}

void kvp__pcache_index_insert(kvp_pcache_t *c, uint32_t s)
{
    uint32_t b = kvp__pc_bucket(c, c->scope[s], c->key[s]);
    c->hnext[s] = c->bucket[b];
    c->bucket[b] = s;
    c->flags[s] |= KVP_PAGE_INDEXED;
    if (s < c->np) {
        c->st.indexed_pages++;
        c->sc[c->scope[s]].indexed_pages++;
    } else {
        c->st.host_pages++;
        c->sc[c->scope[s]].host_pages++;
    }
    kvp__pcache_event(c, KVP_PCEV_STORED, s); /* findable now: an observer sees it there */
}

void kvp__pcache_index_remove(kvp_pcache_t *c, uint32_t s)
{
    uint32_t *link = &c->bucket[kvp__pc_bucket(c, c->scope[s], c->key[s])];
    while (*link != s) {
        assert(*link != NIL);
        link = &c->hnext[*link];
    }
    *link = c->hnext[s];
    c->hnext[s] = NIL;
    c->flags[s] &= (uint8_t)~KVP_PAGE_INDEXED;
    if (s < c->np) {
        c->st.indexed_pages--;
        c->sc[c->scope[s]].indexed_pages--;
    } else {
        c->st.host_pages--;
        c->sc[c->scope[s]].host_pages--;
    }
    kvp__pcache_event(c, KVP_PCEV_REMOVED, s);
}

/* ---- finding ------------------------------------------------------------------------------ */

uint32_t kvp__pcache_walk(const kvp_pcache_t *c, uint32_t scope, kvp_pagekey_t key,
                          const int32_t *tokens, uint64_t num_tokens, uint32_t *pages)
{
    const uint64_t full = num_tokens / c->ps;
    uint32_t k = 0;
    for (; k < full; k++) {
        key = kvp_pagekey_next(key, tokens + (uint64_t)k * c->ps, c->ps);
        uint32_t p = kvp_pcache_find(c, scope, key);
        if (p == NIL)
            break;
        if (pages)
            pages[k] = p;
    }
    return k;
}

uint32_t kvp_pcache_lookup(kvp_pcache_t *c, uint32_t scope, kvp_pagekey_t root,
                           const int32_t *tokens, uint64_t num_tokens, int count_stats)
{
    if (scope >= c->max_scopes || (num_tokens && !tokens))
        return 0;
    uint32_t k = kvp__pcache_walk(c, scope, root, tokens, num_tokens, NULL);
    if (count_stats)
        kvp__pcache_count_query(c, scope, num_tokens, (uint64_t)k * c->ps, 0);
    return k;
}

uint32_t kvp_pcache_lookup_tiers(kvp_pcache_t *c, uint32_t scope, kvp_pagekey_t root,
                                 const int32_t *tokens, uint64_t num_tokens, int count_stats,
                                 uint32_t *gpu_pages)
{
    if (gpu_pages)
        *gpu_pages = 0;
    if (scope >= c->max_scopes || (num_tokens && !tokens))
        return 0;
    const uint64_t full = num_tokens / c->ps;
    kvp_pagekey_t key = root;
    uint32_t k = 0, gpu = 0;
    for (; k < full; k++) {
        key = kvp_pagekey_next(key, tokens + (uint64_t)k * c->ps, c->ps);
        const uint32_t s = kvp__pcache_find_slot(c, scope, key);
        if (s == NIL)
            break;
        if (s < c->np && gpu == k)
            gpu++; /* still the leading GPU part */
    }
    if (count_stats)
        kvp__pcache_count_query(c, scope, num_tokens, (uint64_t)gpu * c->ps,
                                (uint64_t)(k - gpu) * c->ps);
    if (gpu_pages)
        *gpu_pages = gpu;
    return k;
}

/* ---- publishing --------------------------------------------------------------------------- */

uint32_t kvp_pcache_take_unpublished(kvp_pcache_t *c, kvp_seq_t *s, kvp_pcache_ref_t *out,
                                     uint32_t max)
{
    kvp_chain_t *ch = s->chain;
    uint32_t n = 0;
    while (ch && ch->num_handed < ch->num_keyed && n < max) {
        uint32_t p = s->pages[ch->num_handed++];
        out[n].page = p;
        out[n].gen = c->gen[p];
        n++;
    }
    return n;
}

uint32_t kvp_pcache_take_written(kvp_pcache_t *c, kvp_seq_t *s, uint32_t from_page,
                                 kvp_pcache_ref_t *out, uint32_t max)
{
    kvp_chain_t *ch = s->chain;
    if (!ch || from_page >= ch->num_keyed)
        return 0;
    uint32_t n = 0;
    for (uint32_t k = from_page; k < ch->num_keyed && n < max; k++) {
        const uint32_t p = s->pages[k];
        if (c->flags[p] != KVP_PAGE_KEYED)
            continue; /* linked, or a twin of an indexed page */
        out[n].page = p;
        out[n].gen = c->gen[p];
        n++;
    }
    /* handed out when nothing before them still waits for its writer's Commit; otherwise that
     * Commit takes them again, and publish skips them while this writer's pins hold them */
    if (ch->num_handed >= from_page)
        ch->num_handed = ch->num_keyed;
    return n;
}

uint32_t kvp_pcache_publish(kvp_pcache_t *c, const kvp_pcache_ref_t *refs, uint32_t n)
{
    uint32_t done = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t p = refs[i].page;
        if (p >= c->np || c->gen[p] != refs[i].gen || c->flags[p] != KVP_PAGE_KEYED ||
            kvp_alloc_refcount(c->a, p) == 0 || kvp_alloc_pins(c->a, p))
            continue;
        uint32_t twin = kvp__pcache_find_slot(c, c->scope[p], c->key[p]);
        if (twin < c->np)
            continue;      /* the same content is findable already: this copy stays private */
        if (twin != NIL) { /* a GPU copy beats one that is not a page */
            kvp__pcache_drop_host(c, twin);
            kvp__pcache_host_release(c, twin - c->np);
        }
        kvp__pcache_index_insert(c, p);
        done++;
    }
    return done;
}

uint32_t kvp_pcache_publish_seq(kvp_pcache_t *c, kvp_seq_t *s)
{
    kvp_pcache_ref_t refs[64];
    uint32_t done = 0, n;
    while ((n = kvp_pcache_take_unpublished(c, s, refs, 64)) > 0)
        done += kvp_pcache_publish(c, refs, n);
    return done;
}

/* ---- state of a location ------------------------------------------------------------------ */

unsigned kvp_pcache_loc_state(const kvp_pcache_t *c, kvp_loc_t loc)
{
    const uint32_t s = kvp__pc_slot(c, loc);
    return s == NIL ? 0 : c->flags[s] & KVP__PC_PUBLIC_FLAGS;
}

unsigned kvp_pcache_page_state(const kvp_pcache_t *c, uint32_t page)
{
    return kvp_pcache_loc_state(c, kvp_loc(KVP_MEDIUM_GPU, page));
}

int kvp_pcache_loc_key(const kvp_pcache_t *c, kvp_loc_t loc, kvp_pagekey_t *key, uint32_t *scope)
{
    const uint32_t s = kvp__pc_slot(c, loc);
    if (s == NIL || !(c->flags[s] & KVP_PAGE_KEYED))
        return KVP_ENOENT;
    if (key)
        *key = c->key[s];
    if (scope)
        *scope = c->scope[s];
    return 0;
}

int kvp_pcache_page_key(const kvp_pcache_t *c, uint32_t page, kvp_pagekey_t *key, uint32_t *scope)
{
    return kvp_pcache_loc_key(c, kvp_loc(KVP_MEDIUM_GPU, page), key, scope);
}
