/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pcache_evict.c - what the prefix cache keeps and what goes: the eviction order of each
 * medium (a doubly linked list per retention priority, a bitmap of the non-empty ones), the
 * retention heap of cached GPU pages and host entries with a duration, the allocator's hooks (a
 * page's last reference went, give me a page: under pressure the victim is destroyed, never
 * demoted), references (a link cancels a demotion), retention and flush. It does not find
 * entries (kvp_pcache_index.c) nor move them between tiers (kvp_pcache_tier.c).
 */
#include <assert.h>

#include "kvp_error.h"
#include "kvp_pcache.h"
#include "kvp_pcache_internal.h"

#define NIL        KVP__PC_NIL
#define NPRIO      KVP__PC_NPRIO
#define STAMP_BITS KVP__PC_STAMP_BITS

const uint64_t kvp_pcache_residence_le_ms[KVP_PCACHE_RESIDENCE_BUCKETS] = {
    10, 100, 1000, 10000, 60000, 300000, 1800000, 3600000, 21600000, 86400000};

/* ---- eviction lists and the retention heap ----------------------------------------------- */

void kvp__pcache_list_push(kvp_pcache_t *c, uint32_t p)
{
    kvp__pc_order_t *o = &c->ord[kvp__pc_medium(c, p)];
    uint32_t l = c->prio[p];
    c->prev[p] = o->tail[l];
    c->next[p] = NIL;
    if (o->tail[l] != NIL)
        c->next[o->tail[l]] = p;
    else
        o->head[l] = p;
    o->tail[l] = p;
    o->nonempty[l >> 6] |= 1ull << (l & 63);
}

void kvp__pcache_list_remove(kvp_pcache_t *c, uint32_t p)
{
    kvp__pc_order_t *o = &c->ord[kvp__pc_medium(c, p)];
    uint32_t l = c->prio[p];
    if (c->prev[p] != NIL)
        c->next[c->prev[p]] = c->next[p];
    else
        o->head[l] = c->next[p];
    if (c->next[p] != NIL)
        c->prev[c->next[p]] = c->prev[p];
    else
        o->tail[l] = c->prev[p];
    c->prev[p] = c->next[p] = NIL;
    if (o->head[l] == NIL)
        o->nonempty[l >> 6] &= ~(1ull << (l & 63));
}

static inline void heap_set(kvp_pcache_t *c, uint32_t i, uint32_t p)
{
    c->heap[i] = p;
    c->hpos[p] = i + 1;
}

static void heap_up(kvp_pcache_t *c, uint32_t i)
{
    uint32_t p = c->heap[i];
    while (i > 0) {
        uint32_t up = (i - 1) / 2;
        if (!kvp__pc_heap_less(c, p, c->heap[up]))
            break;
        heap_set(c, i, c->heap[up]);
        i = up;
    }
    heap_set(c, i, p);
}

static void heap_down(kvp_pcache_t *c, uint32_t i)
{
    uint32_t p = c->heap[i];
    for (;;) {
        uint32_t l = 2 * i + 1, m = i;
        uint32_t best = p;
        if (l < c->heap_n && kvp__pc_heap_less(c, c->heap[l], best))
            m = l, best = c->heap[l];
        if (l + 1 < c->heap_n && kvp__pc_heap_less(c, c->heap[l + 1], best))
            m = l + 1, best = c->heap[l + 1];
        if (m == i)
            break;
        heap_set(c, i, best);
        i = m;
    }
    heap_set(c, i, p);
}

void kvp__pcache_heap_push(kvp_pcache_t *c, uint32_t p)
{
    c->heap[c->heap_n] = p;
    heap_up(c, c->heap_n++);
}

void kvp__pcache_heap_remove(kvp_pcache_t *c, uint32_t p)
{
    uint32_t i = c->hpos[p] - 1;
    c->hpos[p] = 0;
    uint32_t last = c->heap[--c->heap_n];
    if (i == c->heap_n)
        return;
    c->heap[i] = last;
    c->hpos[last] = i + 1;
    if (i > 0 && kvp__pc_heap_less(c, last, c->heap[(i - 1) / 2]))
        heap_up(c, i);
    else
        heap_down(c, i);
}

void kvp__pcache_expire_retention(kvp_pcache_t *c)
{
    while (c->heap_n && kvp__pc_expiry(c, c->heap[0]) <= c->now) {
        uint32_t p = c->heap[0];
        kvp__pcache_heap_remove(c, p);
        kvp__pcache_list_remove(c, p);
        c->prio[p] = KVP_PCACHE_DEFAULT_PRIORITY;
        c->ret[p] = 0;
        kvp__pcache_list_push(c, p);
    }
}

void kvp__pcache_uncache(kvp_pcache_t *c, uint32_t p)
{
    kvp__pcache_list_remove(c, p);
    if (c->hpos[p])
        kvp__pcache_heap_remove(c, p);
    c->flags[p] &= (uint8_t)~KVP_PAGE_CACHED;
    c->st.cached_pages--;
    c->sc[c->scope[p]].cached_pages--;
}

/* A cached page leaves the cache altogether, for reason. */
static void drop_cached(kvp_pcache_t *c, uint32_t p, kvp_evict_reason_t reason)
{
    kvp__pcache_uncache(c, p);
    kvp__pcache_index_remove(c, p);
    c->flags[p] = 0;
    c->gen[p]++;
    c->st.evictions[reason]++;
    if (reason != KVP_EVICT_PRESSURE)
        return; /* the histogram is the cache's working set under pressure, not a flush */
    uint64_t stay = c->now - kvp__pc_released_ms(c, p);
    unsigned b = 0;
    while (b < KVP_PCACHE_RESIDENCE_BUCKETS && stay > kvp_pcache_residence_le_ms[b])
        b++;
    c->st.residence[b]++;
    c->st.residence_sum_ms += stay;
}

/* ---- the allocator's hooks ---------------------------------------------------------------- */

int kvp__pcache_on_zero(kvp_pcache_t *c, uint32_t p)
{
    uint8_t f = c->flags[p];
    assert(!(f & (KVP_PAGE_DEMOTING | KVP_PAGE_RESTORING))); /* held at 0 refs, or pinned */
    if (!(f & KVP_PAGE_INDEXED)) {
        if (f) { /* keyed, never published (or a duplicate): its content goes with it */
            c->flags[p] = 0;
            c->gen[p]++;
        }
        return 0;
    }
    c->flags[p] = f | KVP_PAGE_CACHED;
    c->rel[p] = c->now << STAMP_BITS | (c->release_seq++ & ((1u << STAMP_BITS) - 1));
    kvp__pcache_list_push(c, p);
    if (c->ret[p])
        kvp__pcache_heap_push(c, p);
    c->st.cached_pages++;
    c->sc[c->scope[p]].cached_pages++;
    return 1;
}

/* The head of the GPU eviction order is destroyed (allocation under pressure: the daemon's
 * demoter keeps free pages ahead of it with kvp_pcache_demote_begin). Returns the page, now
 * unkeyed at refcount 0 in no list. There must be a cached page. */
static uint32_t take_victim(kvp_pcache_t *c)
{
    kvp__pcache_expire_retention(c);
    const kvp__pc_order_t *o = &c->ord[KVP_MEDIUM_GPU];
    assert(o->nonempty[0] || o->nonempty[1]);
    uint32_t l = o->nonempty[0] ? (uint32_t)__builtin_ctzll(o->nonempty[0])
                                : 64u + (uint32_t)__builtin_ctzll(o->nonempty[1]);
    uint32_t p = o->head[l];
    drop_cached(c, p, KVP_EVICT_PRESSURE);
    return p;
}

uint32_t kvp__pcache_evict(kvp_pcache_t *c)
{
    return take_victim(c);
}

uint32_t kvp__pcache_num_cached(const kvp_pcache_t *c)
{
    return c->st.cached_pages;
}

int kvp__pcache_is_cached(const kvp_pcache_t *c, uint32_t p)
{
    return (c->flags[p] & KVP_PAGE_CACHED) != 0;
}

uint32_t kvp__pcache_num_demoting(const kvp_pcache_t *c)
{
    return c->st.demoting;
}

int kvp__pcache_is_demoting(const kvp_pcache_t *c, uint32_t p)
{
    return (c->flags[p] & KVP_PAGE_DEMOTING) != 0;
}

/* ---- retention ---------------------------------------------------------------------------- */

/* (priority, retention) a beats b: higher priority, or the same and a longer duration (0 is
 * no end: the longest) */
static inline int stronger(uint32_t pa, uint32_t ra, uint32_t pb, uint32_t rb)
{
    if (pa != pb)
        return pa > pb;
    return ra != rb && (ra == 0 || (rb != 0 && ra > rb));
}

void kvp__pcache_raise_retention(kvp_pcache_t *c, uint32_t p, uint32_t prio, uint32_t ret)
{
    if (stronger(prio, ret, c->prio[p], c->ret[p])) {
        c->prio[p] = (uint8_t)prio;
        c->ret[p] = ret;
    }
}

void kvp__pcache_take_ref(kvp_pcache_t *c, uint32_t p)
{
    if (c->flags[p] & KVP_PAGE_CACHED) {
        kvp__pcache_uncache(c, p);
        kvp__alloc_revive(c->a, p);
    } else if (c->flags[p] & KVP_PAGE_DEMOTING) {
        /* cancelled: the page is held again; its slot stays busy until the demotion's end,
         * which finds the page no longer demoting into it */
        c->flags[p] &= (uint8_t)~KVP_PAGE_DEMOTING;
        c->st.demoting--;
        kvp__alloc_revive(c->a, p);
    } else if (kvp_alloc_refcount(c->a, p) == 0) {
        kvp__alloc_revive(c->a, p); /* released while a copy pins it (a restore, a job) */
    } else {
        kvp_alloc_ref(c->a, p);
    }
}

void kvp__pcache_link(kvp_pcache_t *c, uint32_t p, uint32_t priority, uint32_t retention_ms)
{
    kvp__pcache_take_ref(c, p);
    kvp__pcache_raise_retention(c, p, priority, retention_ms);
}

int kvp_pcache_set_retention(kvp_pcache_t *c, kvp_seq_t *s, uint32_t priority,
                             uint32_t retention_ms)
{
    if (priority > KVP_PCACHE_MAX_PRIORITY || !s || !s->chain)
        return KVP_EINVAL;
    s->chain->priority = (uint8_t)priority;
    s->chain->retention_ms = retention_ms;
    for (uint32_t k = 0; k < s->chain->num_keyed; k++)
        kvp__pcache_raise_retention(c, s->pages[k], priority, retention_ms);
    return 0;
}

/* ---- flush and order ---------------------------------------------------------------------- */

uint32_t kvp_pcache_flush(kvp_pcache_t *c, uint32_t scope)
{
    /* everything at once is one CLEARED and what is left, not a REMOVED per entry */
    const int clear = scope == KVP_PCACHE_NO_SCOPE && c->obs;
    if (clear)
        kvp__pcache_clear_begin(c);
    uint32_t n = kvp__pcache_flush_demoting(c, scope);
    for (uint32_t m = 0; m < KVP_MEDIUMS; m++) {
        for (uint32_t l = 0; l < NPRIO; l++) {
            for (uint32_t p = c->ord[m].head[l], nx; p != NIL; p = nx) {
                nx = c->next[p];
                if (scope != KVP_PCACHE_NO_SCOPE && c->scope[p] != scope)
                    continue;
                if (m == KVP_MEDIUM_GPU) {
                    drop_cached(c, p, KVP_EVICT_FLUSH);
                    kvp__alloc_push_free(c->a, p);
                } else {
                    kvp__pcache_drop_host(c, p);
                    kvp__pcache_host_release(c, p - c->np);
                    c->st.evictions[KVP_EVICT_FLUSH]++;
                }
                n++;
            }
        }
    }
    if (clear)
        kvp__pcache_clear_end(c);
    return n;
}

uint32_t kvp_pcache_eviction_order(const kvp_pcache_t *c, uint32_t *out, uint32_t max)
{
    uint32_t n = 0;
    for (uint32_t l = 0; l < NPRIO; l++)
        for (uint32_t p = c->ord[KVP_MEDIUM_GPU].head[l]; p != NIL && n < max; p = c->next[p])
            out[n++] = p;
    return n;
}

uint32_t kvp_pcache_eviction_order_in(const kvp_pcache_t *c, uint32_t medium, kvp_loc_t *out,
                                      uint32_t max)
{
    uint32_t n = 0;
    for (uint32_t l = 0; medium < KVP_MEDIUMS && l < NPRIO; l++)
        for (uint32_t p = c->ord[medium].head[l]; p != NIL && n < max; p = c->next[p])
            out[n++] = kvp__pc_loc(c, p);
    return n;
}
