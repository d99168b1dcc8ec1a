/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pcache.c - the prefix cache's life and its chains: create and destroy, the clock, and the
 * hooks through which the planner and the sequence table key pages (a chain per sequence with
 * token ids), unkey them (a truncate, a rewrite) and count queries. The model is in
 * kvp_pcache.h; the layout, shared by the cache's files, in kvp_pcache_internal.h. Finding and
 * publishing live in kvp_pcache_index.c, the eviction order in kvp_pcache_evict.c, the host
 * tier (its slots, demotion, restores) in kvp_pcache_tier.c, pins in kvp_pcache_pin.c, counters
 * and the audit in kvp_pcache_audit.c, events and the entry iterator in kvp_pcache_events.c.
 *
 * Layout: structure-of-arrays over entry slots (the pool's pages, then host_slots slots of the
 * host tier), all allocated at create (nothing is allocated per page afterwards). About 60
 * bytes a page plus 58 a host slot, and with keep_tokens page_size * 4 + 17 more a slot
 * (kvp_pcache_stats_t.bytes says exactly).
 */
#include "kvp_pcache.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_pcache_internal.h"
#include "kvp_seqtab_internal.h"

#define NIL KVP__PC_NIL

/* ---- the hooks of the table and the planner ----------------------------------------------- */

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

/* Page p of the chain's sequence, holding tokens[0..ps), gets key k (the next of ch->last). */
static void key_page(kvp_pcache_t *c, kvp_chain_t *ch, uint32_t p, kvp_pagekey_t k,
                     const int32_t *tokens)
{
    assert(c->flags[p] == 0);
    c->key[p] = k;
    c->scope[p] = ch->scope;
    c->flags[p] = KVP_PAGE_KEYED;
    c->gen[p]++;
    c->prio[p] = ch->priority;
    c->ret[p] = ch->retention_ms;
    if (c->tok) { /* keep_tokens: what a STORED event and the snapshot tell of the page */
        memcpy(c->tok + (size_t)p * c->ps, tokens, (size_t)c->ps * sizeof(int32_t));
        c->parent[p] = ch->last;
        c->has_parent[p] = ch->num_keyed > 0; /* the first page chains from the salt's root */
    }
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
        key_page(c, ch, s->pages[ch->num_keyed], kvp_pagekey_next(ch->last, ch->tok, ps), ch->tok);
        memcpy(ch->tok + ps, ch->tok, page_bytes);
        ch->prev_full = 1;
        ch->pend_n = 0;
    }
    const int32_t *last_full = NULL;
    for (uint32_t k = 0; n - i >= ps; k++, i += ps) {
        kvp_pagekey_t key = k < npre ? pre[k] : kvp_pagekey_next(ch->last, tokens + i, ps);
        key_page(c, ch, s->pages[ch->num_keyed], key, tokens + i);
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
    if (!(c->flags[p] & KVP_PAGE_KEYED))
        return;
    if (c->flags[p] & KVP_PAGE_INDEXED) {
        kvp__pcache_index_remove(c, p);
        c->st.evictions[KVP_EVICT_REWRITE]++;
    }
    if (c->flags[p] & KVP_PAGE_RESTORING)
        c->st.restoring--; /* its restore's end then only unpins it and frees the slot */
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
        if ((c->flags[p] & KVP_PAGE_KEYED) && kvp_alloc_refcount(c->a, p) == 1)
            kvp__pcache_unkey(c, p); /* its sole holder will write into it */
        else if (c->flags[p] & KVP_PAGE_KEYED)
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

void kvp__pcache_count_query(kvp_pcache_t *c, uint32_t scope, uint64_t q, uint64_t h_gpu,
                             uint64_t h_host)
{
    c->st.query_tokens += q;
    c->st.hit_tokens += h_gpu;
    c->st.host_hit_tokens += h_host;
    c->sc[scope].query_tokens += q;
    c->sc[scope].hit_tokens += h_gpu;
    c->sc[scope].host_hit_tokens += h_host;
}

uint32_t kvp__pcache_num_pages(const kvp_pcache_t *c)
{
    return c->np;
}

/* ---- create / destroy --------------------------------------------------------------------- */

int kvp_pcache_create(kvp_seqtab_t *t, const kvp_pcache_config_t *cfg, kvp_pcache_t **out)
{
    if (!t || !cfg || !out || cfg->max_scopes == 0 || cfg->max_pins == 0 ||
        cfg->max_pins > KVP__PC_MAX_PINS || cfg->keep_tokens > 1 || t->pc ||
        (uint64_t)kvp_alloc_num_pages(kvp_seqtab_alloc(t)) + cfg->host_slots >= NIL)
        return KVP_EINVAL;
    kvp_pcache_t *c = calloc(1, sizeof(*c));
    if (!c)
        return KVP_ENOMEM;
    c->t = t;
    c->a = kvp_seqtab_alloc(t);
    c->np = kvp_alloc_num_pages(c->a);
    c->nhost = cfg->host_slots;
    c->ps = kvp_seqtab_page_size(t);
    c->max_scopes = cfg->max_scopes;
    c->max_pins = cfg->max_pins;
    c->max_ns = kvp__seqtab_max_namespaces(t);
    const size_t np = c->np, ns = np + c->nhost; /* GPU pages, entry slots */
    uint32_t nb = 16;
    while (nb < ns / 2)
        nb <<= 1;
    c->bmask = nb - 1;
    c->key = calloc(ns, sizeof(*c->key));
    c->scope = calloc(ns, 4);
    c->hnext = malloc(ns * 4);
    c->prev = malloc(ns * 4);
    c->next = malloc(ns * 4);
    c->ret = calloc(ns, 4);
    c->rel = calloc(ns, 8);
    c->flags = calloc(ns, 1);
    c->prio = calloc(ns, 1);
    c->hpos = calloc(ns, 4);
    c->heap = malloc(ns * 4);
    c->gen = calloc(np, 4);
    c->pinrefs = calloc(np, 2);
    const size_t hwords = ((size_t)c->nhost + 63) / 64;
    c->hpage = calloc(c->nhost ? c->nhost : 1, 4);
    c->hfree = calloc(hwords ? hwords : 1, 8);
    c->bucket = malloc((size_t)nb * 4);
    c->pins = calloc(cfg->max_pins, sizeof(kvp__pc_pin_t));
    c->pin_free = malloc((size_t)cfg->max_pins * 4);
    c->ns_quota = malloc((size_t)c->max_ns * 8);
    c->ns_pins = calloc(c->max_ns, 4);
    c->sc = calloc(cfg->max_scopes, sizeof(*c->sc));
    if (cfg->keep_tokens) { /* the token store of events (kvp_pcache_events.c) */
        c->tok = calloc(ns * c->ps, sizeof(int32_t));
        c->parent = calloc(ns, sizeof(kvp_pagekey_t));
        c->has_parent = calloc(ns, 1);
    }
    if (!c->key || !c->scope || !c->gen || !c->hnext || !c->prev || !c->next || !c->ret ||
        !c->hpos || !c->rel || !c->flags || !c->prio || !c->pinrefs || !c->heap || !c->bucket ||
        !c->hpage || !c->hfree || !c->pins || !c->pin_free || !c->ns_quota || !c->ns_pins ||
        !c->sc || (cfg->keep_tokens && (!c->tok || !c->parent || !c->has_parent))) {
        c->t = NULL; /* not attached yet */
        kvp_pcache_destroy(c);
        return KVP_ENOMEM;
    }
    memset(c->hnext, 0xff, ns * 4);
    memset(c->prev, 0xff, ns * 4);
    memset(c->next, 0xff, ns * 4);
    memset(c->bucket, 0xff, (size_t)nb * 4);
    for (uint32_t m = 0; m < KVP_MEDIUMS; m++)
        for (uint32_t l = 0; l < KVP__PC_NPRIO; l++)
            c->ord[m].head[l] = c->ord[m].tail[l] = NIL;
    for (uint32_t i = 0; i < c->max_ns; i++)
        c->ns_quota[i] = UINT64_MAX;
    for (uint32_t i = 0; i < cfg->max_pins; i++)
        c->pin_free[i] = cfg->max_pins - 1 - i;
    c->num_pin_free = cfg->max_pins;
    /* per slot: key, scope, hnext, prev, next, ret, hpos, heap, rel, flags, prio; per page:
     * gen, pinrefs; per host slot: hpage, a bit of hfree; with keep_tokens per slot: tokens,
     * parent, has_parent */
    c->st.bytes = sizeof(*c) + ns * (sizeof(kvp_pagekey_t) + 4 * 7 + 8 + 1 + 1) + np * (4 + 2) +
                  (size_t)c->nhost * 4 + hwords * 8 + (size_t)nb * 4 +
                  (size_t)cfg->max_pins * (sizeof(kvp__pc_pin_t) + 4) + (size_t)c->max_ns * 12 +
                  (size_t)cfg->max_scopes * sizeof(*c->sc) +
                  (cfg->keep_tokens ? ns * ((size_t)c->ps * 4 + sizeof(kvp_pagekey_t) + 1) : 0);
    kvp__alloc_set_cache(c->a, c);
    kvp__seqtab_set_cache(t, c);
    *out = c;
    return 0;
}

void kvp_pcache_destroy(kvp_pcache_t *c)
{
    if (!c)
        return;
    /* what goes now is no news, and the observer's owner may be gone already */
    c->obs = NULL;
    if (c->t) { /* attached: give everything back first */
        for (uint32_t i = 0; i < c->max_pins; i++)
            if (c->pins[i].id)
                kvp__pcache_drop_pin(c, i);
        /* restores still in flight (the daemon drains its copies first): their pins go, their
         * pages keep no key; demotions in flight: flush frees their pages */
        for (uint32_t j = 0; j < c->nhost; j++) {
            if ((c->flags[c->np + j] & (KVP_SLOT_BUSY | KVP__PC_RESTORE_SRC)) ==
                (KVP_SLOT_BUSY | KVP__PC_RESTORE_SRC)) {
                const uint32_t pg = c->hpage[j];
                kvp_pcache_move_t m = {pg, c->gen[pg], j};
                kvp_pcache_restore_end(c, &m, 1, 0);
            }
        }
        kvp_pcache_flush(c, KVP_PCACHE_NO_SCOPE);
        kvp__alloc_set_cache(c->a, NULL);
        kvp__seqtab_set_cache(c->t, NULL);
        uint32_t cur = 0;
        for (kvp_seq_t *s; (s = kvp_seqtab_next(c->t, &cur));) {
            free(s->chain);
            s->chain = NULL;
        }
    }
    free(c->has_parent);
    free(c->parent);
    free(c->tok);
    free(c->sc);
    free(c->hfree);
    free(c->hpage);
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
