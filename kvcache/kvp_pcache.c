/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pcache.c - the prefix cache (see kvp_pcache.h for the model, kvp_pcache_internal.h for
 * the hooks the allocator, the sequence table and the planner call).
 *
 * Layout: structure-of-arrays over the pool's pages, all allocated at create (nothing is
 * allocated per page afterwards): the key, scope and generation of each page, a chained hash
 * index (bucket heads, one next link per page), the eviction lists (doubly linked, one per
 * retention priority, a bitmap of the non-empty ones), the release time, and a binary heap of
 * cached pages with a retention duration, ordered by (expiry, release stamp). About 62 bytes a page
 * (kvp_pcache_stats_t.bytes says exactly).
 */
#include "kvp_pcache.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_pcache_internal.h"
#include "kvp_seqtab_internal.h"

#define NIL       UINT32_MAX
#define NPRIO     (KVP_PCACHE_MAX_PRIORITY + 1)
#define F_KEYED   KVP_PAGE_KEYED
#define F_INDEXED KVP_PAGE_INDEXED
#define F_CACHED  KVP_PAGE_CACHED
#define MAX_PINS  65535u /* pin references per page are 16 bits */
/* A page's release stamp is its release time in ms shifted left by STAMP_BITS, plus a counter
 * of releases: ordering by stamp is ordering by release, even within one ms (where a
 * sequence's pages are released deepest first), with no more memory per page. */
#define STAMP_BITS 20u

const uint64_t kvp_pcache_residence_le_ms[KVP_PCACHE_RESIDENCE_BUCKETS] = {
    10, 100, 1000, 10000, 60000, 300000, 1800000, 3600000, 21600000, 86400000};

typedef struct {
    uint64_t id; /* 0: a free record */
    uint64_t expires_ms;
    uint32_t ns, scope, num_pages;
    uint32_t *pages;
} pin_t;

struct kvp_pcache {
    kvp_seqtab_t *t;
    kvp_alloc_t *a;
    uint32_t np, ps, max_scopes, max_pins, max_ns;
    uint64_t now;
    /* per page */
    kvp_pagekey_t *key;
    uint32_t *scope, *gen, *hnext, *prev, *next, *ret, *hpos;
    uint64_t *rel; /* when it was cached: ms << STAMP_BITS | a release counter (release order) */
    uint8_t *flags, *prio;
    uint16_t *pinrefs;
    /* index */
    uint32_t *bucket, bmask;
    /* eviction lists */
    uint32_t head[NPRIO], tail[NPRIO];
    uint64_t nonempty[2];
    /* cached pages with a retention duration */
    uint32_t *heap, heap_n;
    uint64_t release_seq;
    /* pins */
    pin_t *pins;
    uint32_t *pin_free, num_pin_free;
    uint64_t pin_seq;
    uint64_t *ns_quota; /* pinned-page quotas; what pins hold is the table's ns pinned_pages */
    uint32_t *ns_pins;
    kvp_pcache_scope_stats_t *sc;
    kvp_pcache_stats_t st;
};

/* ---- index ------------------------------------------------------------------------------- */

static inline uint32_t bucket_of(const kvp_pcache_t *c, uint32_t scope, kvp_pagekey_t k)
{
    /* the key is already a good hash; the scope only has to move it */
    return (uint32_t)(k.lo ^ ((uint64_t)scope * 0x9e3779b97f4a7c15ull)) & c->bmask;
}

uint32_t kvp_pcache_find(const kvp_pcache_t *c, uint32_t scope, kvp_pagekey_t key)
{
    for (uint32_t p = c->bucket[bucket_of(c, scope, key)]; p != NIL; p = c->hnext[p])
        if (kvp_pagekey_eq(c->key[p], key) && c->scope[p] == scope)
            return p;
    return NIL;
}

static void index_insert(kvp_pcache_t *c, uint32_t p)
{
    uint32_t b = bucket_of(c, c->scope[p], c->key[p]);
    c->hnext[p] = c->bucket[b];
    c->bucket[b] = p;
    c->flags[p] |= F_INDEXED;
    c->st.indexed_pages++;
    c->sc[c->scope[p]].indexed_pages++;
}

static void index_remove(kvp_pcache_t *c, uint32_t p)
{
    uint32_t *link = &c->bucket[bucket_of(c, c->scope[p], c->key[p])];
    while (*link != p) {
        assert(*link != NIL);
        link = &c->hnext[*link];
    }
    *link = c->hnext[p];
    c->hnext[p] = NIL;
    c->flags[p] &= (uint8_t)~F_INDEXED;
    c->st.indexed_pages--;
    c->sc[c->scope[p]].indexed_pages--;
}

/* ---- eviction lists and the retention heap ----------------------------------------------- */

static void list_push(kvp_pcache_t *c, uint32_t p)
{
    uint32_t l = c->prio[p];
    c->prev[p] = c->tail[l];
    c->next[p] = NIL;
    if (c->tail[l] != NIL)
        c->next[c->tail[l]] = p;
    else
        c->head[l] = p;
    c->tail[l] = p;
    c->nonempty[l >> 6] |= 1ull << (l & 63);
}

static void list_remove(kvp_pcache_t *c, uint32_t p)
{
    uint32_t l = c->prio[p];
    if (c->prev[p] != NIL)
        c->next[c->prev[p]] = c->next[p];
    else
        c->head[l] = c->next[p];
    if (c->next[p] != NIL)
        c->prev[c->next[p]] = c->prev[p];
    else
        c->tail[l] = c->prev[p];
    c->prev[p] = c->next[p] = NIL;
    if (c->head[l] == NIL)
        c->nonempty[l >> 6] &= ~(1ull << (l & 63));
}

static inline uint64_t released_ms(const kvp_pcache_t *c, uint32_t p)
{
    return c->rel[p] >> STAMP_BITS;
}

static inline uint64_t expiry(const kvp_pcache_t *c, uint32_t p)
{
    return released_ms(c, p) + c->ret[p];
}

/* By expiry, then release order: pages whose retention ends together are demoted in the order
 * they were released, so a chain's deepest page stays first in line. */
static inline int heap_less(const kvp_pcache_t *c, uint32_t a, uint32_t b)
{
    uint64_t ea = expiry(c, a), eb = expiry(c, b);
    return ea < eb || (ea == eb && c->rel[a] < c->rel[b]);
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
        if (!heap_less(c, p, c->heap[up]))
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
        if (l < c->heap_n && heap_less(c, c->heap[l], best))
            m = l, best = c->heap[l];
        if (l + 1 < c->heap_n && heap_less(c, c->heap[l + 1], best))
            m = l + 1, best = c->heap[l + 1];
        if (m == i)
            break;
        heap_set(c, i, best);
        i = m;
    }
    heap_set(c, i, p);
}

static void heap_push(kvp_pcache_t *c, uint32_t p)
{
    c->heap[c->heap_n] = p;
    heap_up(c, c->heap_n++);
}

static void heap_remove(kvp_pcache_t *c, uint32_t p)
{
    uint32_t i = c->hpos[p] - 1;
    c->hpos[p] = 0;
    uint32_t last = c->heap[--c->heap_n];
    if (i == c->heap_n)
        return;
    c->heap[i] = last;
    c->hpos[last] = i + 1;
    if (i > 0 && heap_less(c, last, c->heap[(i - 1) / 2]))
        heap_up(c, i);
    else
        heap_down(c, i);
}

/* Cached pages whose retention ended count as the default priority from now on. */
static void demote_expired(kvp_pcache_t *c)
{
    while (c->heap_n && expiry(c, c->heap[0]) <= c->now) {
        uint32_t p = c->heap[0];
        heap_remove(c, p);
        list_remove(c, p);
        c->prio[p] = KVP_PCACHE_DEFAULT_PRIORITY;
        c->ret[p] = 0;
        list_push(c, p);
    }
}

/* A cached page leaves its list (it is linked, pinned or dropped). */
static void uncache(kvp_pcache_t *c, uint32_t p)
{
    list_remove(c, p);
    if (c->hpos[p])
        heap_remove(c, p);
    c->flags[p] &= (uint8_t)~F_CACHED;
    c->st.cached_pages--;
    c->sc[c->scope[p]].cached_pages--;
}

/* A cached page leaves the cache altogether, for reason. */
static void drop_cached(kvp_pcache_t *c, uint32_t p, kvp_evict_reason_t reason)
{
    uncache(c, p);
    index_remove(c, p);
    c->flags[p] = 0;
    c->gen[p]++;
    c->st.evictions[reason]++;
    if (reason != KVP_EVICT_PRESSURE)
        return; /* the histogram is the cache's working set under pressure, not a flush */
    uint64_t stay = c->now - released_ms(c, p);
    unsigned b = 0;
    while (b < KVP_PCACHE_RESIDENCE_BUCKETS && stay > kvp_pcache_residence_le_ms[b])
        b++;
    c->st.residence[b]++;
    c->st.residence_sum_ms += stay;
}

/* ---- hooks -------------------------------------------------------------------------------- */

int kvp__pcache_on_zero(kvp_pcache_t *c, uint32_t p)
{
    uint8_t f = c->flags[p];
    if (!(f & F_INDEXED)) {
        if (f) { /* keyed, never published (or a duplicate): its content goes with it */
            c->flags[p] = 0;
            c->gen[p]++;
        }
        return 0;
    }
    c->flags[p] = f | F_CACHED;
    c->rel[p] = c->now << STAMP_BITS | (c->release_seq++ & ((1u << STAMP_BITS) - 1));
    list_push(c, p);
    if (c->ret[p])
        heap_push(c, p);
    c->st.cached_pages++;
    c->sc[c->scope[p]].cached_pages++;
    return 1;
}

uint32_t kvp__pcache_evict(kvp_pcache_t *c)
{
    demote_expired(c);
    uint32_t l = c->nonempty[0] ? (uint32_t)__builtin_ctzll(c->nonempty[0])
                                : 64u + (uint32_t)__builtin_ctzll(c->nonempty[1]);
    assert(c->nonempty[0] || c->nonempty[1]);
    uint32_t p = c->head[l];
    drop_cached(c, p, KVP_EVICT_PRESSURE);
    return p;
}

uint32_t kvp__pcache_num_cached(const kvp_pcache_t *c)
{
    return c->st.cached_pages;
}

int kvp__pcache_is_cached(const kvp_pcache_t *c, uint32_t p)
{
    return (c->flags[p] & F_CACHED) != 0;
}

uint32_t kvp__pcache_pin_refs(const kvp_pcache_t *c, uint32_t p)
{
    return c->pinrefs[p];
}

uint32_t kvp__pcache_max_scopes(const kvp_pcache_t *c)
{
    return c->max_scopes;
}

kvp_chain_t *kvp__pcache_chain_new(const kvp_pcache_t *c)
{
    return calloc(1, sizeof(kvp_chain_t) + 2u * c->ps * sizeof(int32_t));
}

kvp_chain_t *kvp__pcache_chain_dup(const kvp_pcache_t *c, const kvp_chain_t *src)
{
    size_t bytes = sizeof(kvp_chain_t) + 2u * c->ps * sizeof(int32_t);
    kvp_chain_t *d = malloc(bytes);
    if (d)
        memcpy(d, src, bytes);
    return d;
}

void kvp__pcache_chain_start(kvp_chain_t *ch, uint32_t scope, kvp_pagekey_t root, uint32_t priority,
                             uint32_t retention_ms)
{
    ch->scope = scope;
    ch->tracked = 1;
    ch->priority = (uint8_t)priority;
    ch->prev_full = 0;
    ch->tail_keyed = 0;
    ch->tail_foreign = 0;
    ch->retention_ms = retention_ms;
    ch->num_keyed = ch->num_handed = ch->pend_n = 0;
    ch->root = ch->last = root;
}

/* (priority, retention) a beats b: higher priority, or the same and a longer duration (0 is
 * no end: the longest) */
static inline int stronger(uint32_t pa, uint32_t ra, uint32_t pb, uint32_t rb)
{
    if (pa != pb)
        return pa > pb;
    return ra != rb && (ra == 0 || (rb != 0 && ra > rb));
}

static void raise_retention(kvp_pcache_t *c, uint32_t p, uint32_t prio, uint32_t ret)
{
    if (stronger(prio, ret, c->prio[p], c->ret[p])) {
        c->prio[p] = (uint8_t)prio;
        c->ret[p] = ret;
    }
}

/* A reference on an indexed page; a cached one comes back out of its list. */
static void take_ref(kvp_pcache_t *c, uint32_t p)
{
    if (c->flags[p] & F_CACHED) {
        uncache(c, p);
        kvp__alloc_revive(c->a, p);
    } else {
        kvp_alloc_ref(c->a, p);
    }
}

void kvp__pcache_link(kvp_pcache_t *c, uint32_t p, uint32_t priority, uint32_t retention_ms)
{
    take_ref(c, p);
    raise_retention(c, p, priority, retention_ms);
}

static void key_page(kvp_pcache_t *c, kvp_chain_t *ch, uint32_t p, kvp_pagekey_t k)
{
    assert(c->flags[p] == 0);
    c->key[p] = k;
    c->scope[p] = ch->scope;
    c->flags[p] = F_KEYED;
    c->gen[p]++;
    c->prio[p] = ch->priority;
    c->ret[p] = ch->retention_ms;
    ch->last = k;
    ch->num_keyed++;
}

void kvp__pcache_chain_append(kvp_pcache_t *c, kvp_seq_t *s, const int32_t *tokens, uint32_t n,
                              const kvp_pagekey_t *pre, uint32_t npre)
{
    kvp_chain_t *ch = s->chain;
    if (!ch || !ch->tracked || n == 0)
        return;
    const uint32_t ps = c->ps;
    const size_t page_bytes = (size_t)ps * sizeof(int32_t);
    uint32_t i = 0;
    if (ch->pend_n) {
        uint32_t take = ps - ch->pend_n < n ? ps - ch->pend_n : n;
        memcpy(ch->tok + ch->pend_n, tokens, (size_t)take * sizeof(int32_t));
        ch->pend_n += take;
        i = take;
        npre = 0; /* pre[] is for a chain with no partial page */
        if (ch->pend_n < ps)
            return;
        key_page(c, ch, s->pages[ch->num_keyed], kvp_pagekey_next(ch->last, ch->tok, ps));
        memcpy(ch->tok + ps, ch->tok, page_bytes);
        ch->prev_full = 1;
        ch->pend_n = 0;
    }
    const int32_t *last_full = NULL;
    for (uint32_t k = 0; n - i >= ps; k++, i += ps) {
        kvp_pagekey_t key = k < npre ? pre[k] : kvp_pagekey_next(ch->last, tokens + i, ps);
        key_page(c, ch, s->pages[ch->num_keyed], key);
        last_full = tokens + i;
    }
    if (last_full) {
        memcpy(ch->tok + ps, last_full, page_bytes);
        ch->prev_full = 1;
    }
    ch->pend_n = n - i;
    if (ch->pend_n)
        memcpy(ch->tok, tokens + i, (size_t)ch->pend_n * sizeof(int32_t));
}

void kvp__pcache_unkey(kvp_pcache_t *c, uint32_t p)
{
    if (!(c->flags[p] & F_KEYED))
        return;
    if (c->flags[p] & F_INDEXED) {
        index_remove(c, p);
        c->st.evictions[KVP_EVICT_REWRITE]++;
    }
    c->flags[p] = 0;
    c->gen[p]++;
}

void kvp__pcache_truncated(kvp_pcache_t *c, kvp_seq_t *s, uint32_t old_tokens)
{
    const uint32_t ps = c->ps, L = s->num_tokens, full = L / ps, rem = L % ps;
    kvp_chain_t *ch = s->chain; /* a sequence without one holds no keyed page */
    if (ch) {
        ch->tail_keyed = 0;
        ch->tail_foreign = rem != 0; /* whoever wrote the kept rows, the next writer did not */
    }
    if (rem) {
        uint32_t p = s->pages[full];
        if ((c->flags[p] & F_KEYED) && kvp_alloc_refcount(c->a, p) == 1)
            kvp__pcache_unkey(c, p); /* its sole holder will write into it */
        else if (c->flags[p] & F_KEYED)
            ch->tail_keyed = 1; /* shared now; the holder left last writes into it */
    }
    if (!ch)
        return;
    if (ch->num_keyed > full) {
        ch->num_keyed = full;
        ch->last = full ? c->key[s->pages[full - 1]] : ch->root;
    }
    if (ch->num_handed > ch->num_keyed)
        ch->num_handed = ch->num_keyed;
    if (!ch->tracked)
        return;
    const uint32_t old_full = old_tokens / ps;
    if (rem == 0) {
        ch->pend_n = 0;
        if (full != old_full)
            ch->prev_full = 0;
    } else if (full == old_full) {
        ch->pend_n = rem;
    } else if (full + 1 == old_full && ch->prev_full) {
        memcpy(ch->tok, ch->tok + ps, (size_t)rem * sizeof(int32_t));
        ch->pend_n = rem;
        ch->prev_full = 0;
    } else {
        ch->tracked = 0; /* the tokens of the new partial page are not known */
    }
}

void kvp__pcache_count_query(kvp_pcache_t *c, uint32_t scope, uint64_t q, uint64_t h)
{
    c->st.query_tokens += q;
    c->st.hit_tokens += h;
    c->sc[scope].query_tokens += q;
    c->sc[scope].hit_tokens += h;
}

/* ---- create / destroy --------------------------------------------------------------------- */

int kvp_pcache_create(kvp_seqtab_t *t, const kvp_pcache_config_t *cfg, kvp_pcache_t **out)
{
    if (!t || !cfg || !out || cfg->max_scopes == 0 || cfg->max_pins == 0 ||
        cfg->max_pins > MAX_PINS || t->pc)
        return KVP_EINVAL;
    kvp_pcache_t *c = calloc(1, sizeof(*c));
    if (!c)
        return KVP_ENOMEM;
    c->t = t;
    c->a = kvp_seqtab_alloc(t);
    c->np = kvp_alloc_num_pages(c->a);
    c->ps = kvp_seqtab_page_size(t);
    c->max_scopes = cfg->max_scopes;
    c->max_pins = cfg->max_pins;
    c->max_ns = kvp__seqtab_max_namespaces(t);
    uint32_t nb = 16;
    while (nb < c->np / 2)
        nb <<= 1;
    c->bmask = nb - 1;
    const size_t np = c->np;
    c->key = calloc(np, sizeof(*c->key));
    c->scope = calloc(np, 4);
    c->gen = calloc(np, 4);
    c->hnext = malloc(np * 4);
    c->prev = malloc(np * 4);
    c->next = malloc(np * 4);
    c->ret = calloc(np, 4);
    c->hpos = calloc(np, 4);
    c->rel = calloc(np, 8);
    c->flags = calloc(np, 1);
    c->prio = calloc(np, 1);
    c->pinrefs = calloc(np, 2);
    c->heap = malloc(np * 4);
    c->bucket = malloc((size_t)nb * 4);
    c->pins = calloc(cfg->max_pins, sizeof(pin_t));
    c->pin_free = malloc((size_t)cfg->max_pins * 4);
    c->ns_quota = malloc((size_t)c->max_ns * 8);
    c->ns_pins = calloc(c->max_ns, 4);
    c->sc = calloc(cfg->max_scopes, sizeof(*c->sc));
    if (!c->key || !c->scope || !c->gen || !c->hnext || !c->prev || !c->next || !c->ret ||
        !c->hpos || !c->rel || !c->flags || !c->prio || !c->pinrefs || !c->heap || !c->bucket ||
        !c->pins || !c->pin_free || !c->ns_quota || !c->ns_pins || !c->sc) {
        c->t = NULL; /* not attached yet */
        kvp_pcache_destroy(c);
        return KVP_ENOMEM;
    }
    memset(c->hnext, 0xff, np * 4);
    memset(c->prev, 0xff, np * 4);
    memset(c->next, 0xff, np * 4);
    memset(c->bucket, 0xff, (size_t)nb * 4);
    for (uint32_t l = 0; l < NPRIO; l++)
        c->head[l] = c->tail[l] = NIL;
    for (uint32_t i = 0; i < c->max_ns; i++)
        c->ns_quota[i] = UINT64_MAX;
    for (uint32_t i = 0; i < cfg->max_pins; i++)
        c->pin_free[i] = cfg->max_pins - 1 - i;
    c->num_pin_free = cfg->max_pins;
    c->st.bytes = sizeof(*c) + np * (sizeof(kvp_pagekey_t) + 4 * 8 + 8 + 1 + 1 + 2) +
                  (size_t)nb * 4 + (size_t)cfg->max_pins * (sizeof(pin_t) + 4) +
                  (size_t)c->max_ns * 12 + (size_t)cfg->max_scopes * sizeof(*c->sc);
    kvp__alloc_set_cache(c->a, c);
    kvp__seqtab_set_cache(t, c);
    *out = c;
    return 0;
}

static void drop_pin(kvp_pcache_t *c, uint32_t idx)
{
    pin_t *pin = &c->pins[idx];
    for (uint32_t k = pin->num_pages; k-- > 0;) {
        uint32_t p = pin->pages[k];
        if (--c->pinrefs[p] == 0)
            c->st.pinned_pages--;
        kvp_alloc_unref(c->a, p);
    }
    c->t->ns[pin->ns].pinned_pages -= pin->num_pages;
    c->ns_pins[pin->ns]--;
    c->st.pins--;
    free(pin->pages);
    memset(pin, 0, sizeof(*pin));
    c->pin_free[c->num_pin_free++] = idx;
}

void kvp_pcache_destroy(kvp_pcache_t *c)
{
    if (!c)
        return;
    if (c->t) { /* attached: give everything back first */
        for (uint32_t i = 0; i < c->max_pins; i++)
            if (c->pins[i].id)
                drop_pin(c, i);
        kvp_pcache_flush(c, KVP_PCACHE_NO_SCOPE);
        kvp__alloc_set_cache(c->a, NULL);
        kvp__seqtab_set_cache(c->t, NULL);
        uint32_t cur = 0;
        for (kvp_seq_t *s; (s = kvp_seqtab_next(c->t, &cur));) {
            free(s->chain);
            s->chain = NULL;
        }
    }
    free(c->sc);
    free(c->ns_pins);
    free(c->ns_quota);
    free(c->pin_free);
    free(c->pins);
    free(c->bucket);
    free(c->heap);
    free(c->pinrefs);
    free(c->prio);
    free(c->flags);
    free(c->rel);
    free(c->hpos);
    free(c->ret);
    free(c->next);
    free(c->prev);
    free(c->hnext);
    free(c->gen);
    free(c->scope);
    free(c->key);
    free(c);
}

kvp_pcache_t *kvp_seqtab_pcache(const kvp_seqtab_t *t)
{
    return t->pc;
}

void kvp_pcache_set_now(kvp_pcache_t *c, uint64_t now_ms)
{
    if (now_ms > c->now)
        c->now = now_ms;
}

/* ---- finding ------------------------------------------------------------------------------ */

/* The findable leading pages of tokens: their ids into pages[] (when not NULL, room for
 * num_tokens / ps), their count returned. */
static uint32_t walk(const kvp_pcache_t *c, uint32_t scope, kvp_pagekey_t key,
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
    uint32_t k = walk(c, scope, root, tokens, num_tokens, NULL);
    if (count_stats)
        kvp__pcache_count_query(c, scope, num_tokens, (uint64_t)k * c->ps);
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
        if (c->flags[p] != F_KEYED)
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
        if (p >= c->np || c->gen[p] != refs[i].gen || c->flags[p] != F_KEYED ||
            kvp_alloc_refcount(c->a, p) == 0 || kvp_alloc_pins(c->a, p))
            continue;
        if (kvp_pcache_find(c, c->scope[p], c->key[p]) != NIL)
            continue; /* the same content is findable already: this copy stays private */
        index_insert(c, p);
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

/* ---- retention, pins, flush --------------------------------------------------------------- */

int kvp_pcache_set_retention(kvp_pcache_t *c, kvp_seq_t *s, uint32_t priority,
                             uint32_t retention_ms)
{
    if (priority > KVP_PCACHE_MAX_PRIORITY || !s || !s->chain)
        return KVP_EINVAL;
    s->chain->priority = (uint8_t)priority;
    s->chain->retention_ms = retention_ms;
    for (uint32_t k = 0; k < s->chain->num_keyed; k++)
        raise_retention(c, s->pages[k], priority, retention_ms);
    return 0;
}

int kvp_pcache_set_pin_quota(kvp_pcache_t *c, uint32_t ns, uint64_t max_pinned_pages)
{
    if (ns >= c->max_ns)
        return KVP_EINVAL;
    c->ns_quota[ns] = max_pinned_pages;
    return 0;
}

int kvp_pcache_pin(kvp_pcache_t *c, uint32_t ns, uint32_t scope, kvp_pagekey_t root,
                   const int32_t *tokens, uint64_t num_tokens, uint64_t now_ms, uint64_t ttl_ms,
                   uint64_t *pin_id, uint32_t *pages_out)
{
    if (ns >= c->max_ns || scope >= c->max_scopes || (num_tokens && !tokens) || !pin_id)
        return KVP_EINVAL;
    kvp_pcache_set_now(c, now_ms);
    uint64_t full = num_tokens / c->ps;
    if (full == 0)
        return KVP_ENOENT;
    if (full > UINT32_MAX)
        return KVP_EINVAL;
    uint32_t *pages = malloc((size_t)full * sizeof(uint32_t));
    if (!pages)
        return KVP_ENOMEM;
    uint32_t f = walk(c, scope, root, tokens, num_tokens, pages);
    const kvp_ns_stats_t *nst = &c->t->ns[ns];
    int rc = 0;
    if (f == 0)
        rc = KVP_ENOENT;
    else if (c->ns_quota[ns] < f || c->t->ns[ns].pinned_pages > c->ns_quota[ns] - f ||
             !c->num_pin_free ||
             (nst->max_page_refs && nst->page_refs + nst->pinned_pages + f > nst->max_page_refs))
        rc = KVP_ELIMIT;
    if (rc) {
        free(pages);
        return rc;
    }
    uint32_t *shrunk = realloc(pages, (size_t)f * sizeof(uint32_t));
    if (shrunk)
        pages = shrunk;
    uint32_t idx = c->pin_free[--c->num_pin_free];
    pin_t *pin = &c->pins[idx];
    pin->id = (++c->pin_seq << 16) | idx;
    pin->expires_ms = ttl_ms > UINT64_MAX - now_ms ? UINT64_MAX : now_ms + ttl_ms;
    pin->ns = ns;
    pin->scope = scope;
    pin->num_pages = f;
    pin->pages = pages;
    for (uint32_t k = 0; k < f; k++) {
        take_ref(c, pages[k]);
        if (c->pinrefs[pages[k]]++ == 0)
            c->st.pinned_pages++;
    }
    c->t->ns[ns].pinned_pages += f;
    c->ns_pins[ns]++;
    c->st.pins++;
    *pin_id = pin->id;
    if (pages_out)
        *pages_out = f;
    return 0;
}

int kvp_pcache_unpin(kvp_pcache_t *c, uint32_t ns, uint64_t pin_id)
{
    uint32_t idx = (uint32_t)(pin_id & 0xffffu);
    if (pin_id == 0 || idx >= c->max_pins || c->pins[idx].id != pin_id || c->pins[idx].ns != ns)
        return KVP_ENOENT;
    int pages = (int)c->pins[idx].num_pages;
    drop_pin(c, idx);
    return pages;
}

uint32_t kvp_pcache_unpin_ns(kvp_pcache_t *c, uint32_t ns)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < c->max_pins && ns < c->max_ns && c->ns_pins[ns]; i++)
        if (c->pins[i].id && c->pins[i].ns == ns) {
            drop_pin(c, i);
            n++;
        }
    return n;
}

uint64_t kvp_pcache_ns_last_expiry(const kvp_pcache_t *c, uint32_t ns)
{
    uint64_t e = 0;
    for (uint32_t i = 0; i < c->max_pins && ns < c->max_ns && c->ns_pins[ns]; i++)
        if (c->pins[i].id && c->pins[i].ns == ns && c->pins[i].expires_ms > e)
            e = c->pins[i].expires_ms;
    return e;
}

uint32_t kvp_pcache_expire(kvp_pcache_t *c, uint64_t now_ms)
{
    kvp_pcache_set_now(c, now_ms);
    uint32_t n = 0;
    for (uint32_t i = 0; i < c->max_pins && c->st.pins; i++)
        if (c->pins[i].id && c->pins[i].expires_ms <= c->now) {
            drop_pin(c, i);
            n++;
        }
    demote_expired(c);
    return n;
}

uint64_t kvp_pcache_next_expiry(const kvp_pcache_t *c)
{
    uint64_t e = UINT64_MAX;
    for (uint32_t i = 0; i < c->max_pins && c->st.pins; i++)
        if (c->pins[i].id && c->pins[i].expires_ms < e)
            e = c->pins[i].expires_ms;
    return e;
}

uint64_t kvp_pcache_ns_pinned_pages(const kvp_pcache_t *c, uint32_t ns)
{
    return ns < c->max_ns ? c->t->ns[ns].pinned_pages : 0;
}

uint32_t kvp_pcache_ns_pins(const kvp_pcache_t *c, uint32_t ns)
{
    return ns < c->max_ns ? c->ns_pins[ns] : 0;
}

uint32_t kvp_pcache_flush(kvp_pcache_t *c, uint32_t scope)
{
    uint32_t n = 0;
    for (uint32_t l = 0; l < NPRIO; l++) {
        for (uint32_t p = c->head[l], nx; p != NIL; p = nx) {
            nx = c->next[p];
            if (scope != KVP_PCACHE_NO_SCOPE && c->scope[p] != scope)
                continue;
            drop_cached(c, p, KVP_EVICT_FLUSH);
            kvp__alloc_push_free(c->a, p);
            n++;
        }
    }
    return n;
}

int kvp_pcache_next_pin(const kvp_pcache_t *c, uint32_t *cursor, kvp_pcache_pin_info_t *out)
{
    for (uint32_t i = *cursor; i < c->max_pins; i++) {
        if (!c->pins[i].id)
            continue;
        *cursor = i + 1;
        out->pin_id = c->pins[i].id;
        out->ns = c->pins[i].ns;
        out->scope = c->pins[i].scope;
        out->pages = c->pins[i].num_pages;
        out->expires_ms = c->pins[i].expires_ms;
        return 0;
    }
    *cursor = c->max_pins;
    return KVP_ENOENT;
}

/* ---- reading ------------------------------------------------------------------------------ */

void kvp_pcache_stats(const kvp_pcache_t *c, kvp_pcache_stats_t *out)
{
    *out = c->st;
}

int kvp_pcache_scope_reset(kvp_pcache_t *c, uint32_t scope)
{
    if (scope >= c->max_scopes)
        return KVP_EINVAL;
    if (c->sc[scope].indexed_pages)
        return KVP_EBUSY;
    /* nor may a keyed page or a chain of it live on, to be published under the next owner
     * (rare: a scope id is given to another scope; O(pages + sequences)) */
    for (uint32_t p = 0; p < c->np; p++)
        if ((c->flags[p] & F_KEYED) && c->scope[p] == scope)
            return KVP_EBUSY;
    uint32_t cur = 0;
    for (const kvp_seq_t *q; (q = kvp_seqtab_next(c->t, &cur));)
        if (q->chain && q->chain->scope == scope && q->chain->tracked)
            return KVP_EBUSY;
    memset(&c->sc[scope], 0, sizeof(c->sc[scope]));
    return 0;
}

int kvp_pcache_scope_stats(const kvp_pcache_t *c, uint32_t scope, kvp_pcache_scope_stats_t *out)
{
    if (scope >= c->max_scopes)
        return KVP_EINVAL;
    *out = c->sc[scope];
    return 0;
}

unsigned kvp_pcache_page_state(const kvp_pcache_t *c, uint32_t page)
{
    return page < c->np ? c->flags[page] : 0;
}

int kvp_pcache_page_key(const kvp_pcache_t *c, uint32_t page, kvp_pagekey_t *key, uint32_t *scope)
{
    if (page >= c->np || !(c->flags[page] & F_KEYED))
        return KVP_ENOENT;
    if (key)
        *key = c->key[page];
    if (scope)
        *scope = c->scope[page];
    return 0;
}

uint32_t kvp_pcache_eviction_order(const kvp_pcache_t *c, uint32_t *out, uint32_t max)
{
    uint32_t n = 0;
    for (uint32_t l = 0; l < NPRIO; l++)
        for (uint32_t p = c->head[l]; p != NIL && n < max; p = c->next[p])
            out[n++] = p;
    return n;
}

#define AUDIT_FAIL(...)                                                                            \
    do {                                                                                           \
        snprintf(msg, msg_len, __VA_ARGS__);                                                       \
        rc = KVP_EAUDIT;                                                                           \
        goto out;                                                                                  \
    } while (0)

int kvp_pcache_audit(const kvp_pcache_t *c, char *msg, unsigned msg_len)
{
    int rc = kvp_seqtab_audit(c->t, msg, msg_len);
    if (rc)
        return rc;
    const uint32_t np = c->np;
    uint8_t *seen = calloc(np, 1);
    uint32_t *pinned = calloc(np, 4);
    uint64_t *nsp = calloc(c->max_ns, 8);
    uint32_t *nspins = calloc(c->max_ns, 4);
    kvp_pcache_scope_stats_t *sc = calloc(c->max_scopes, sizeof(*sc));
    if (!seen || !pinned || !nsp || !nspins || !sc) {
        rc = KVP_ENOMEM;
        goto out;
    }
    uint32_t indexed = 0, cached = 0, pinned_pages = 0, pins = 0, in_heap = 0;
    /* the index: every entry indexed, in its bucket, found as itself, once */
    for (uint32_t b = 0; b <= c->bmask; b++) {
        for (uint32_t p = c->bucket[b], steps = 0; p != NIL; p = c->hnext[p]) {
            if (p >= np || ++steps > np)
                AUDIT_FAIL("index bucket %u: bad link or a cycle", b);
            if (!(c->flags[p] & F_INDEXED) || !(c->flags[p] & F_KEYED))
                AUDIT_FAIL("page %u is in the index but not indexed (flags %u)", p, c->flags[p]);
            if (bucket_of(c, c->scope[p], c->key[p]) != b)
                AUDIT_FAIL("page %u is in the wrong bucket", p);
            if (seen[p]++)
                AUDIT_FAIL("page %u is in the index twice", p);
            if (kvp_pcache_find(c, c->scope[p], c->key[p]) != p)
                AUDIT_FAIL("page %u: its (scope, key) finds another page", p);
            if (c->scope[p] >= c->max_scopes)
                AUDIT_FAIL("page %u: scope %u out of range", p, c->scope[p]);
            indexed++;
            sc[c->scope[p]].indexed_pages++;
        }
    }
    /* the eviction lists */
    for (uint32_t l = 0; l < NPRIO; l++) {
        uint32_t prev = NIL, steps = 0;
        int nonempty = (c->nonempty[l >> 6] >> (l & 63)) & 1;
        if (nonempty != (c->head[l] != NIL))
            AUDIT_FAIL("list %u: non-empty bit %d but head %u", l, nonempty, c->head[l]);
        for (uint32_t p = c->head[l]; p != NIL; prev = p, p = c->next[p]) {
            if (p >= np || ++steps > np)
                AUDIT_FAIL("list %u: bad link or a cycle", l);
            if (c->prev[p] != prev)
                AUDIT_FAIL("list %u: page %u's back link is wrong", l, p);
            if (!(c->flags[p] & F_CACHED) || !(c->flags[p] & F_INDEXED))
                AUDIT_FAIL("page %u is in eviction list %u but not cached (flags %u)", p, l,
                           c->flags[p]);
            if (c->prio[p] != l)
                AUDIT_FAIL("page %u of priority %u is in list %u", p, c->prio[p], l);
            if (seen[p] & 2)
                AUDIT_FAIL("page %u is in the eviction lists twice", p);
            seen[p] |= 2;
            cached++;
            sc[c->scope[p]].cached_pages++;
        }
        if (c->tail[l] != prev)
            AUDIT_FAIL("list %u: tail %u but the last page is %u", l, c->tail[l], prev);
    }
    /* pins */
    for (uint32_t i = 0; i < c->max_pins; i++) {
        const pin_t *pin = &c->pins[i];
        if (!pin->id)
            continue;
        if ((pin->id & 0xffffu) != i || pin->ns >= c->max_ns || pin->num_pages == 0)
            AUDIT_FAIL("pin record %u is inconsistent", i);
        for (uint32_t k = 0; k < pin->num_pages; k++) {
            uint32_t p = pin->pages[k];
            if (p >= np || !(c->flags[p] & F_INDEXED))
                AUDIT_FAIL("pin %llu holds page %u, not indexed", (unsigned long long)pin->id, p);
            pinned[p]++;
        }
        nsp[pin->ns] += pin->num_pages;
        nspins[pin->ns]++;
        pins++;
    }
    /* every page */
    for (uint32_t p = 0; p < np; p++) {
        const uint8_t f = c->flags[p];
        const uint32_t rc_p = kvp_alloc_refcount(c->a, p), apins = kvp_alloc_pins(c->a, p);
        const int should_cache = (f & F_INDEXED) && rc_p == 0 && apins == 0;
        if (((f & F_CACHED) != 0) != should_cache)
            AUDIT_FAIL("page %u: cached flag %d, indexed %d, refcount %u, pins %u", p,
                       (f & F_CACHED) != 0, (f & F_INDEXED) != 0, rc_p, apins);
        if (((f & F_INDEXED) != 0) != ((seen[p] & 1) != 0))
            AUDIT_FAIL("page %u: indexed flag but not in the index (or the reverse)", p);
        if (((f & F_CACHED) != 0) != ((seen[p] & 2) != 0))
            AUDIT_FAIL("page %u: cached flag but in no eviction list (or the reverse)", p);
        if (f && !(f & F_KEYED))
            AUDIT_FAIL("page %u: flags %u without a key", p, f);
        if (f == F_KEYED && rc_p == 0 && apins == 0)
            AUDIT_FAIL("page %u: keyed, unindexed, with no reference", p);
        if (pinned[p] != c->pinrefs[p])
            AUDIT_FAIL("page %u: %u pin references counted, %u kept", p, pinned[p], c->pinrefs[p]);
        pinned_pages += pinned[p] > 0;
        if (c->prio[p] > KVP_PCACHE_MAX_PRIORITY)
            AUDIT_FAIL("page %u: priority %u", p, c->prio[p]);
        const int want_heap = (f & F_CACHED) && c->ret[p];
        if (want_heap != (c->hpos[p] != 0))
            AUDIT_FAIL("page %u: cached with retention %u ms but heap position %u", p, c->ret[p],
                       c->hpos[p]);
        if (c->hpos[p]) {
            uint32_t i = c->hpos[p] - 1;
            if (i >= c->heap_n || c->heap[i] != p)
                AUDIT_FAIL("page %u: heap position %u is wrong", p, i);
            if (i > 0 && heap_less(c, p, c->heap[(i - 1) / 2]))
                AUDIT_FAIL("retention heap out of order at %u", i);
            in_heap++;
        }
    }
    if (in_heap != c->heap_n)
        AUDIT_FAIL("retention heap holds %u pages, %u counted", c->heap_n, in_heap);
    /* the chains of the sequences */
    uint32_t cur = 0;
    for (kvp_seq_t *s; (s = kvp_seqtab_next(c->t, &cur));) {
        const kvp_chain_t *ch = s->chain;
        if (!ch)
            continue;
        if (ch->num_keyed > s->num_pages || ch->num_handed > ch->num_keyed ||
            ch->scope >= c->max_scopes || ch->pend_n >= c->ps)
            AUDIT_FAIL("seq ns=%u id=%llu: chain counters out of range", s->ns,
                       (unsigned long long)s->id);
        if (ch->tracked &&
            (ch->num_keyed != s->num_tokens / c->ps || ch->pend_n != s->num_tokens % c->ps))
            AUDIT_FAIL("seq ns=%u id=%llu: chain keyed %u pages and holds %u tokens for %u tokens",
                       s->ns, (unsigned long long)s->id, ch->num_keyed, ch->pend_n, s->num_tokens);
        for (uint32_t k = 0; k < ch->num_keyed; k++) {
            uint32_t p = s->pages[k];
            if (!(c->flags[p] & F_KEYED) || c->scope[p] != ch->scope)
                AUDIT_FAIL("seq ns=%u id=%llu: page %u (index %u) of its chain is not keyed "
                           "in its scope",
                           s->ns, (unsigned long long)s->id, p, k);
        }
        const int tail_keyed =
            s->num_tokens % c->ps && (c->flags[s->pages[s->num_pages - 1]] & F_KEYED);
        if (tail_keyed != (ch->tail_keyed != 0))
            AUDIT_FAIL("seq ns=%u id=%llu: partial last page keyed %d, marked %d", s->ns,
                       (unsigned long long)s->id, tail_keyed, ch->tail_keyed);
        if (ch->num_keyed && !kvp_pagekey_eq(ch->last, c->key[s->pages[ch->num_keyed - 1]]))
            AUDIT_FAIL("seq ns=%u id=%llu: chain's last key is not its last page's", s->ns,
                       (unsigned long long)s->id);
    }
    for (uint32_t n = 0; n < c->max_ns; n++)
        if (nsp[n] != c->t->ns[n].pinned_pages || nspins[n] != c->ns_pins[n])
            AUDIT_FAIL("namespace %u: pinned pages %llu/%llu, pins %u/%u (counted/kept)", n,
                       (unsigned long long)nsp[n], (unsigned long long)c->t->ns[n].pinned_pages,
                       nspins[n], c->ns_pins[n]);
    for (uint32_t s = 0; s < c->max_scopes; s++)
        if (sc[s].indexed_pages != c->sc[s].indexed_pages ||
            sc[s].cached_pages != c->sc[s].cached_pages)
            AUDIT_FAIL("scope %u: indexed %u/%u cached %u/%u (counted/kept)", s,
                       sc[s].indexed_pages, c->sc[s].indexed_pages, sc[s].cached_pages,
                       c->sc[s].cached_pages);
    if (indexed != c->st.indexed_pages || cached != c->st.cached_pages ||
        pinned_pages != c->st.pinned_pages || pins != c->st.pins ||
        pins + c->num_pin_free != c->max_pins)
        AUDIT_FAIL("counters: indexed %u/%u cached %u/%u pinned %u/%u pins %u/%u (counted/kept)",
                   indexed, c->st.indexed_pages, cached, c->st.cached_pages, pinned_pages,
                   c->st.pinned_pages, pins, c->st.pins);
out:
    free(sc);
    free(nspins);
    free(nsp);
    free(pinned);
    free(seen);
    return rc;
}
