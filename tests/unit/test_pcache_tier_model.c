/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_pcache_tier_model.c - a model-based random test of the two-tier prefix cache (issue
 * #28): random operations drive the real sequence table, planner and cache (appends with token
 * ids, reuse with and without promotion, two-item batches promoting the same keys, appends
 * without ids, releases, forks, truncates, publishes, demote_begin / demote_end with ok and
 * failed copies and cancels in between, restore_end in random order and late, flushes of a
 * scope or all, limit changes, pins, counted lookups) and the same operations a small
 * reference model written from kvp_pcache.h alone: every page's references, key and state,
 * every host slot's state, each (scope, key)'s place, both eviction orders, the counters. After
 * EVERY operation the audit must pass and the real cache must agree with the model: each
 * page's state and refcount, each slot's, the location of every key, lookup_tiers of every
 * prompt, the eviction orders, the free count, every sequence's pages and the stats.
 *
 * Every allocation the model cannot predict page by page (the free stack's order) it checks by
 * rule instead: a page taken while the model counts free pages must be one it holds free, and
 * once none is free it must be the GPU order's head. Retention durations are 0 here (the exact
 * cases in test_pcache_tier.c cover them); priorities vary.
 *
 * Operations per run (two runs, seeds n and n + 1): KVP_MODEL_OPS, default 80000, about 15 s
 * for both under ASan on the 2-core VM (30 s beside other tests). A million each:
 *   KVP_MODEL_OPS=1000000 ./tests/test_pcache_tier_model
 * (about 15 s for both in a Release build). The seed is printed; KVP_SEED=<n> repeats a run.
 */
#include <check.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_pagekey.h"
#include "kvp_pcache.h"
#include "kvp_plan.h"
#include "kvp_test_util.h"

#define NP      48 /* GPU pages */
#define PS      2  /* tokens a page */
#define NH      16 /* host slots */
#define NSEQ    10 /* sequence ids 0..NSEQ-1, namespace 0 */
#define NPROMPT 3
#define PLEN    24
#define MAXPG   (PLEN / PS)
#define NSCOPE  2
#define NPINS   4
#define MAXMOVE 64
#define NKEYS   (NPROMPT * MAXPG)
#define NONE    UINT32_MAX

/* ---- the model ---------------------------------------------------------------------------- */

typedef struct {
    uint32_t refs; /* sequence references + pin references */
    int rpin;      /* the restore's allocator pin */
    int keyed, indexed, cached, demoting, restoring;
    uint32_t scope, kid, prio, slot; /* slot: of the move while demoting / restoring */
    uint64_t stamp;                  /* when it entered the GPU order */
} mpage_t;

enum { H_UNUSED = 0, H_FREE, H_ENTRY, H_BUSY_D, H_BUSY_R };

typedef struct {
    int st;
    uint32_t scope, kid, prio, page;
    uint64_t stamp; /* when it entered the host order */
} mslot_t;

enum { E_NONE = 0, E_GPU, E_HOST };

typedef struct {
    int where;
    uint32_t idx; /* page or slot */
} ment_t;

typedef struct {
    int live, chain, tracked, prev_full;
    uint32_t q, len, scope, prio, nkeyed, nhanded, np;
    uint32_t pages[MAXPG];
} mseq_t;

typedef struct {
    uint64_t id;
    uint32_t n;
    uint32_t pages[MAXPG];
} mpin_t;

typedef struct {
    /* the real thing */
    kvp_alloc_t *a;
    kvp_seqtab_t *t;
    kvp_pcache_t *c;
    kvp_plan_t p;
    uint64_t now;
    /* prompts and their keys */
    int32_t prompt[NPROMPT][PLEN];
    kvp_pagekey_t key[NKEYS];
    uint32_t nkeys;
    uint32_t kid[NPROMPT][MAXPG];
    /* the model */
    mpage_t pg[NP];
    mslot_t sl[NH];
    ment_t ent[NSCOPE][NKEYS];
    mseq_t sq[NSEQ];
    mpin_t pin[NPINS];
    uint32_t limit;
    uint64_t ord;
    uint64_t demotions, promotions, host_evictions, evictions[KVP_EVICT_REASONS];
    uint64_t query, hit, host_hit;
    /* moves in flight, as the daemon holds them */
    kvp_pcache_move_t dem[MAXMOVE], res[MAXMOVE];
    uint32_t ndem, nres;
    kvp_pcache_move_t done[MAXMOVE]; /* ended moves, for stale ends */
    uint32_t ndone;
    /* what the run exercised */
    uint64_t n_moved, n_failed_dem, n_cancel, n_promo, n_restore_fail, n_same_key, n_enospc,
        n_host_drop, n_rewrite_restoring, n_late_join;
    kvp_rng_t r;
} m_t;

static kvp_pagekey_t root0(void)
{
    kvp_pagekey_t root;
    kvp_pagekey_root(NULL, 0, &root);
    return root;
}

static void m_keys(m_t *m)
{
    for (uint32_t q = 0; q < NPROMPT; q++)
        for (uint32_t i = 0; i < PLEN; i++) /* a shared 8-token head, then the prompt's own */
            m->prompt[q][i] = (int32_t)(i < 8 ? i : 1000 * (q + 1) + i);
    for (uint32_t q = 0; q < NPROMPT; q++) {
        kvp_pagekey_t keys[MAXPG];
        kvp_pagekey_chain(root0(), m->prompt[q], PLEN, PS, keys, MAXPG);
        for (uint32_t k = 0; k < MAXPG; k++) {
            uint32_t id = 0;
            while (id < m->nkeys && !kvp_pagekey_eq(m->key[id], keys[k]))
                id++;
            if (id == m->nkeys)
                m->key[m->nkeys++] = keys[k];
            m->kid[q][k] = id;
        }
    }
}

static uint32_t m_free_count(const m_t *m)
{
    uint32_t n = 0;
    for (uint32_t p = 0; p < NP; p++) {
        const mpage_t *g = &m->pg[p];
        n += g->refs == 0 && !g->rpin && !g->cached && !g->demoting;
    }
    return n;
}

static uint32_t m_count(const m_t *m, int what)
{
    uint32_t n = 0;
    for (uint32_t p = 0; p < NP; p++)
        n += what == 0 ? m->pg[p].cached : what == 1 ? m->pg[p].demoting : m->pg[p].restoring;
    return n;
}

/* the head of the GPU order (lowest priority, then the earliest entry), or NONE */
static uint32_t m_gpu_head(const m_t *m)
{
    uint32_t best = NONE;
    for (uint32_t p = 0; p < NP; p++) {
        const mpage_t *g = &m->pg[p];
        if (g->cached && (best == NONE || g->prio < m->pg[best].prio ||
                          (g->prio == m->pg[best].prio && g->stamp < m->pg[best].stamp)))
            best = p;
    }
    return best;
}

static uint32_t m_host_head(const m_t *m)
{
    uint32_t best = NONE;
    for (uint32_t j = 0; j < NH; j++) {
        const mslot_t *s = &m->sl[j];
        if (s->st == H_ENTRY && (best == NONE || s->prio < m->sl[best].prio ||
                                 (s->prio == m->sl[best].prio && s->stamp < m->sl[best].stamp)))
            best = j;
    }
    return best;
}

static void m_slot_release(m_t *m, uint32_t j)
{
    m->sl[j].st = j < m->limit ? H_FREE : H_UNUSED;
}

/* a page's last reference and pin went: cached when indexed, else free (its key goes) */
static void m_on_zero(m_t *m, uint32_t p)
{
    mpage_t *g = &m->pg[p];
    KVP_CHECK(!g->demoting && !g->restoring, "model: page %u zero while moving", p);
    if (g->indexed) {
        g->cached = 1;
        g->stamp = ++m->ord;
    } else {
        g->keyed = 0;
    }
}

static void m_unref(m_t *m, uint32_t p)
{
    KVP_CHECK(m->pg[p].refs > 0, "model: unref of page %u at 0", p);
    if (--m->pg[p].refs == 0 && !m->pg[p].rpin)
        m_on_zero(m, p);
}

static void m_take_ref(m_t *m, uint32_t p)
{
    mpage_t *g = &m->pg[p];
    if (g->cached) {
        g->cached = 0;
    } else if (g->demoting) {
        g->demoting = 0; /* cancelled; the slot stays busy */
        m->n_cancel++;
    } else if (g->refs == 0) {
        m->n_late_join += g->restoring;
    }
    g->refs++;
}

/* the page leaves the key table and loses its key (under pressure, a flush) */
static void m_drop_gpu(m_t *m, uint32_t p, int reason)
{
    mpage_t *g = &m->pg[p];
    m->ent[g->scope][g->kid].where = E_NONE;
    g->keyed = g->indexed = g->cached = g->demoting = 0;
    m->evictions[reason]++;
}

static void m_drop_host(m_t *m, uint32_t j)
{
    m->ent[m->sl[j].scope][m->sl[j].kid].where = E_NONE;
    m->sl[j].st = H_UNUSED;
}

/* the sole holder rewrites keyed page p (a truncate made it partial) */
static void m_unkey(m_t *m, uint32_t p)
{
    mpage_t *g = &m->pg[p];
    if (g->indexed) {
        m->ent[g->scope][g->kid].where = E_NONE;
        m->evictions[KVP_EVICT_REWRITE]++;
    }
    if (g->restoring) {
        g->restoring = 0; /* its restore's end only unpins it */
        m->n_rewrite_restoring++;
    }
    g->keyed = g->indexed = 0;
}

/* A page the real allocator handed out, checked by rule: one the model holds free while it
 * counts any, then the GPU order's head (evicted). It becomes a held, unkeyed page. */
static void m_taken(m_t *m, uint32_t p)
{
    KVP_CHECK(p < NP, "allocated page %u out of range", p);
    mpage_t *g = &m->pg[p];
    if (m_free_count(m) > 0) {
        KVP_CHECK(g->refs == 0 && !g->rpin && !g->cached && !g->demoting,
                  "page %u handed out, not free in the model (refs %u cached %d demoting %d)", p,
                  g->refs, g->cached, g->demoting);
    } else {
        const uint32_t h = m_gpu_head(m);
        KVP_CHECK(h == p, "page %u handed out, the GPU order's head is %u", p, h);
        m_drop_gpu(m, p, KVP_EVICT_PRESSURE);
    }
    memset(g, 0, sizeof(*g));
    g->refs = 1;
}

static kvp_seq_t *real_seq(const m_t *m, uint32_t id)
{
    return kvp_seqtab_find(m->t, 0, id);
}

/* ---- checking the real cache against the model -------------------------------------------- */

static unsigned m_page_flags(const mpage_t *g)
{
    return (g->keyed ? KVP_PAGE_KEYED : 0) | (g->indexed ? KVP_PAGE_INDEXED : 0) |
           (g->cached ? KVP_PAGE_CACHED : 0) | (g->demoting ? KVP_PAGE_DEMOTING : 0) |
           (g->restoring ? KVP_PAGE_RESTORING : 0);
}

/* the model's walk of prompt q in scope: both tiers, and the GPU's leading pages */
static uint32_t m_walk(const m_t *m, uint32_t scope, uint32_t q, uint32_t npages, uint32_t *gpu)
{
    uint32_t k = 0, g = 0;
    for (; k < npages; k++) {
        const ment_t *e = &m->ent[scope][m->kid[q][k]];
        if (e->where == E_NONE)
            break;
        if (e->where == E_GPU && g == k)
            g++;
    }
    *gpu = g;
    return k;
}

static void m_check(m_t *m, uint64_t op)
{
    char msg[256] = "";
    int rc = kvp_pcache_audit(m->c, msg, sizeof(msg));
    KVP_CHECK(rc == 0, "op %" PRIu64 ": audit: %s", op, msg);
    uint32_t indexed = 0, host = 0, pinned = 0, busy = 0, hfree = 0;
    for (uint32_t p = 0; p < NP; p++) {
        const mpage_t *g = &m->pg[p];
        KVP_CHECK(kvp_alloc_refcount(m->a, p) == g->refs,
                  "op %" PRIu64 ": page %u refcount %u, "
                  "model %u",
                  op, p, kvp_alloc_refcount(m->a, p), g->refs);
        KVP_CHECK(kvp_alloc_pins(m->a, p) == (uint32_t)g->rpin, "op %" PRIu64 ": page %u pins", op,
                  p);
        KVP_CHECK(kvp_pcache_page_state(m->c, p) == m_page_flags(g),
                  "op %" PRIu64 ": page %u state %u, model %u", op, p,
                  kvp_pcache_page_state(m->c, p), m_page_flags(g));
        KVP_CHECK(kvp_pcache_restoring(m->c, p) == g->restoring, "op %" PRIu64 ": restoring %u", op,
                  p);
        if (g->keyed) {
            kvp_pagekey_t k;
            uint32_t scope;
            KVP_CHECK(kvp_pcache_page_key(m->c, p, &k, &scope) == 0 &&
                          kvp_pagekey_eq(k, m->key[g->kid]) && scope == g->scope,
                      "op %" PRIu64 ": page %u's key", op, p);
        }
        indexed += g->indexed;
    }
    for (uint32_t i = 0; i < NPINS; i++)
        for (uint32_t k = 0; k < m->pin[i].n; k++) {
            uint32_t dup = 0;
            for (uint32_t i2 = 0; i2 < i; i2++)
                for (uint32_t k2 = 0; k2 < m->pin[i2].n; k2++)
                    dup |= m->pin[i2].pages[k2] == m->pin[i].pages[k];
            pinned += !dup;
        }
    KVP_CHECK(kvp_alloc_num_free(m->a) == m_free_count(m), "op %" PRIu64 ": free %u, model %u", op,
              kvp_alloc_num_free(m->a), m_free_count(m));
    for (uint32_t j = 0; j < NH; j++) {
        const mslot_t *s = &m->sl[j];
        const unsigned want = s->st == H_ENTRY ? KVP_PAGE_KEYED | KVP_PAGE_INDEXED
                              : s->st == H_BUSY_D || s->st == H_BUSY_R ? KVP_SLOT_BUSY
                                                                       : 0;
        const unsigned got = kvp_pcache_loc_state(m->c, kvp_loc(KVP_MEDIUM_HOST, j));
        KVP_CHECK(got == want, "op %" PRIu64 ": host slot %u state %u, model %u (st %d)", op, j,
                  got, want, s->st);
        if (s->st == H_ENTRY) {
            kvp_pagekey_t k;
            uint32_t scope;
            KVP_CHECK(kvp_pcache_loc_key(m->c, kvp_loc(KVP_MEDIUM_HOST, j), &k, &scope) == 0 &&
                          kvp_pagekey_eq(k, m->key[s->kid]) && scope == s->scope,
                      "op %" PRIu64 ": host slot %u's key", op, j);
        }
        host += s->st == H_ENTRY;
        busy += s->st == H_BUSY_D || s->st == H_BUSY_R;
        hfree += s->st == H_FREE;
    }
    for (uint32_t s = 0; s < NSCOPE; s++)
        for (uint32_t k = 0; k < m->nkeys; k++) {
            const ment_t *e = &m->ent[s][k];
            const kvp_loc_t l = kvp_pcache_locate(m->c, s, m->key[k]);
            const int ok = e->where == E_NONE  ? kvp_loc_is_none(l)
                           : e->where == E_GPU ? kvp_loc_eq(l, kvp_loc(KVP_MEDIUM_GPU, e->idx))
                                               : kvp_loc_eq(l, kvp_loc(KVP_MEDIUM_HOST, e->idx));
            KVP_CHECK(ok, "op %" PRIu64 ": scope %u key %u at {%u,%u}, model %d/%u", op, s, k,
                      l.medium, l.index, e->where, e->idx);
        }
    for (uint32_t s = 0; s < NSCOPE; s++)
        for (uint32_t q = 0; q < NPROMPT; q++) {
            uint32_t gw, gg = 7;
            const uint32_t want = m_walk(m, s, q, MAXPG, &gw);
            const uint32_t got =
                kvp_pcache_lookup_tiers(m->c, s, root0(), m->prompt[q], PLEN, 0, &gg);
            KVP_CHECK(got == want && gg == gw,
                      "op %" PRIu64 ": lookup_tiers scope %u prompt %u "
                      "= %u (gpu %u), model %u (%u)",
                      op, s, q, got, gg, want, gw);
            KVP_CHECK(kvp_pcache_lookup(m->c, s, root0(), m->prompt[q], PLEN, 0) == gw,
                      "op %" PRIu64 ": lookup", op);
        }
    /* both orders */
    uint32_t order[NP], n = kvp_pcache_eviction_order(m->c, order, NP);
    KVP_CHECK(n == m_count(m, 0), "op %" PRIu64 ": %u cached in the order, model %u", op, n,
              m_count(m, 0));
    for (uint32_t i = 0; i < n; i++) {
        const mpage_t *g = &m->pg[order[i]];
        KVP_CHECK(g->cached, "op %" PRIu64 ": page %u in the order, not cached", op, order[i]);
        if (i) {
            const mpage_t *h = &m->pg[order[i - 1]];
            KVP_CHECK(h->prio < g->prio || (h->prio == g->prio && h->stamp < g->stamp),
                      "op %" PRIu64 ": GPU order wrong at %u", op, i);
        }
    }
    kvp_loc_t ho[NH];
    n = kvp_pcache_eviction_order_in(m->c, KVP_MEDIUM_HOST, ho, NH);
    KVP_CHECK(n == host, "op %" PRIu64 ": host order %u, model %u", op, n, host);
    for (uint32_t i = 0; i < n; i++) {
        const mslot_t *s = &m->sl[ho[i].index];
        KVP_CHECK(ho[i].medium == KVP_MEDIUM_HOST && s->st == H_ENTRY,
                  "op %" PRIu64 ": host "
                  "order holds slot %u",
                  op, ho[i].index);
        if (i) {
            const mslot_t *h = &m->sl[ho[i - 1].index];
            KVP_CHECK(h->prio < s->prio || (h->prio == s->prio && h->stamp < s->stamp),
                      "op %" PRIu64 ": host order wrong at %u", op, i);
        }
    }
    /* sequences */
    for (uint32_t id = 0; id < NSEQ; id++) {
        const mseq_t *q = &m->sq[id];
        const kvp_seq_t *s = real_seq(m, id);
        KVP_CHECK((s != NULL) == q->live, "op %" PRIu64 ": seq %u live %d", op, id, q->live);
        if (!s)
            continue;
        KVP_CHECK(s->num_tokens == q->len && s->num_pages == q->np,
                  "op %" PRIu64 ": seq %u has %u tokens %u pages, model %u %u", op, id,
                  s->num_tokens, s->num_pages, q->len, q->np);
        for (uint32_t k = 0; k < q->np; k++)
            KVP_CHECK(s->pages[k] == q->pages[k], "op %" PRIu64 ": seq %u page %u", op, id, k);
    }
    /* counters */
    kvp_pcache_stats_t st;
    kvp_pcache_stats(m->c, &st);
    uint32_t pins = 0;
    for (uint32_t i = 0; i < NPINS; i++)
        pins += m->pin[i].n > 0;
    KVP_CHECK(st.indexed_pages == indexed && st.cached_pages == m_count(m, 0) &&
                  st.host_pages == host && st.host_slots_usable == m->limit &&
                  st.host_free == hfree && st.host_busy == busy && st.demoting == m_count(m, 1) &&
                  st.restoring == m_count(m, 2) && st.pins == pins && st.pinned_pages == pinned,
              "op %" PRIu64 ": stats indexed %u/%u cached %u/%u host %u/%u usable %u/%u free "
              "%u/%u busy %u/%u demoting %u/%u restoring %u/%u pins %u/%u pinned %u/%u",
              op, st.indexed_pages, indexed, st.cached_pages, m_count(m, 0), st.host_pages, host,
              st.host_slots_usable, m->limit, st.host_free, hfree, st.host_busy, busy, st.demoting,
              m_count(m, 1), st.restoring, m_count(m, 2), st.pins, pins, st.pinned_pages, pinned);
    KVP_CHECK(st.demotions == m->demotions && st.promotions == m->promotions &&
                  st.host_evictions == m->host_evictions &&
                  st.evictions[KVP_EVICT_PRESSURE] == m->evictions[KVP_EVICT_PRESSURE] &&
                  st.evictions[KVP_EVICT_FLUSH] == m->evictions[KVP_EVICT_FLUSH] &&
                  st.evictions[KVP_EVICT_REWRITE] == m->evictions[KVP_EVICT_REWRITE],
              "op %" PRIu64 ": demotions %" PRIu64 "/%" PRIu64 " promotions %" PRIu64 "/%" PRIu64
              " host evictions %" PRIu64 "/%" PRIu64 " evictions %" PRIu64 "/%" PRIu64 " %" PRIu64
              "/%" PRIu64 " %" PRIu64 "/%" PRIu64,
              op, st.demotions, m->demotions, st.promotions, m->promotions, st.host_evictions,
              m->host_evictions, st.evictions[0], m->evictions[0], st.evictions[1], m->evictions[1],
              st.evictions[2], m->evictions[2]);
    KVP_CHECK(
        st.query_tokens == m->query && st.hit_tokens == m->hit && st.host_hit_tokens == m->host_hit,
        "op %" PRIu64 ": query %" PRIu64 "/%" PRIu64 " hit %" PRIu64 "/%" PRIu64
        " host hit %" PRIu64 "/%" PRIu64,
        op, st.query_tokens, m->query, st.hit_tokens, m->hit, st.host_hit_tokens, m->host_hit);
    kvp_stats_t ts;
    kvp_seqtab_stats(m->t, &ts);
    KVP_CHECK(ts.demoting == m_count(m, 1) && ts.cached_pages == m_count(m, 0) &&
                  ts.free_pages == m_free_count(m) &&
                  ts.used_pages == NP - m_free_count(m) - m_count(m, 0) - m_count(m, 1),
              "op %" PRIu64 ": table stats", op);
}

/* ---- appends through the planner ---------------------------------------------------------- */

typedef struct {
    uint32_t id, n; /* tokens to append */
    int start;      /* starts a chain (empty sequence, token ids) */
    int with_ids;   /* token ids given */
    uint32_t q, scope, prio;
    int reuse, promote, leave_last;
    /* what phase 1 finds */
    uint32_t f, lead, nhost, fresh, cow;
    ment_t found[MAXPG];
} mitem_t;

/* One batch of items through kvp_plan_append_cached and the model. Items either all start
 * chains or there is one item (so copy-on-write needs no per-batch simulation). */
static void m_plan(m_t *m, mitem_t *it, uint32_t n, uint64_t op)
{
    kvp_plan_item_t items[2];
    kvp_plan_content_t ct[2];
    uint64_t need = 0, linked_cached = 0, promos = 0;
    uint8_t lc_seen[NP] = {0}, host_seen[NH] = {0};
    for (uint32_t i = 0; i < n; i++) {
        mitem_t *x = &it[i];
        const mseq_t *s = &m->sq[x->id];
        const uint32_t len = s->live ? s->len : 0, np = s->live ? s->np : 0;
        const uint32_t from = x->start ? 0 : len; /* the prompt position of the first token */
        items[i] = (kvp_plan_item_t){0, x->id, x->n};
        ct[i] = (kvp_plan_content_t){x->with_ids ? m->prompt[x->q] + from : NULL, NULL, 0};
        x->f = x->lead = x->nhost = x->cow = 0;
        if (x->start && x->reuse) {
            const uint32_t max_f = x->leave_last ? (x->n - 1) / PS : x->n / PS;
            for (; x->f < max_f; x->f++) {
                const ment_t *e = &m->ent[x->scope][m->kid[x->q][x->f]];
                if (e->where == E_NONE || (e->where == E_HOST && !x->promote))
                    break;
                x->found[x->f] = *e;
                if (e->where == E_GPU) {
                    if (x->lead == x->f)
                        x->lead++;
                    if (m->pg[e->idx].cached && !lc_seen[e->idx]++)
                        linked_cached++;
                } else {
                    x->nhost++;
                    if (!host_seen[e->idx]++)
                        promos++;
                }
            }
        }
        const uint32_t pages_after = (len + x->n + PS - 1) / PS;
        x->fresh = pages_after - np - x->f;
        if (len % PS) {
            const uint32_t tail = s->pages[np - 1];
            KVP_CHECK(!m->pg[tail].keyed, "model: a keyed partial tail page %u", tail);
            x->cow = m->pg[tail].refs > 1;
        }
        need += x->fresh + x->cow;
    }
    kvp_plan_cache_t cc = {.scope = it[0].scope,
                           .reuse = (uint8_t)it[0].reuse,
                           .leave_last = (uint8_t)it[0].leave_last,
                           .priority = (uint8_t)it[0].prio,
                           .daemon_writes = 1,
                           .retention_ms = 0,
                           .promote = (uint8_t)it[0].promote};
    const int enospc = need + linked_cached + promos > m_free_count(m) + m_count(m, 0);
    int rc = kvp_plan_append_cached(m->t, items, ct, n, NULL, &cc, m->now, &m->p);
    KVP_CHECK(rc == (enospc ? KVP_ENOSPC : 0), "op %" PRIu64 ": plan returned %s, model %s", op,
              kvp_errname(rc), enospc ? "ENOSPC" : "0");
    if (enospc) {
        KVP_CHECK(m->p.num_restores == 0, "op %" PRIu64 ": a refused plan has restores", op);
        m->n_enospc++;
        return;
    }
    /* the sequences and their chains start; found GPU pages are linked, all items first */
    for (uint32_t i = 0; i < n; i++) {
        mitem_t *x = &it[i];
        mseq_t *s = &m->sq[x->id];
        if (!s->live) {
            memset(s, 0, sizeof(*s));
            s->live = 1;
        }
        if (!x->start)
            continue;
        s->chain = 1;
        s->tracked = 1;
        s->prev_full = x->f > 0;
        s->q = x->q;
        s->scope = x->scope;
        s->prio = x->prio;
        s->nkeyed = s->nhanded = x->f;
        for (uint32_t k = 0; k < x->f; k++) {
            if (x->found[k].where != E_GPU)
                continue;
            const uint32_t p = x->found[k].idx;
            m_take_ref(m, p);
            if (m->pg[p].prio < x->prio)
                m->pg[p].prio = x->prio;
            s->pages[k] = p;
        }
        if (x->reuse) {
            m->query += x->n;
            m->hit += (uint64_t)x->lead * PS;
            m->host_hit += (uint64_t)(x->f - x->lead) * PS;
        }
    }
    /* host entries: promoted into a page each, or linked when an earlier item promoted it */
    uint32_t nr = 0;
    for (uint32_t i = 0; i < n; i++) {
        mitem_t *x = &it[i];
        mseq_t *s = &m->sq[x->id];
        const kvp_seq_t *rs = real_seq(m, x->id);
        KVP_CHECK(rs != NULL, "op %" PRIu64 ": seq %u missing", op, x->id);
        uint32_t restored = 0;
        for (uint32_t k = 0; k < x->f; k++) {
            if (x->found[k].where != E_HOST)
                continue;
            restored += PS;
            const uint32_t kid = m->kid[x->q][k];
            ment_t *e = &m->ent[x->scope][kid];
            const uint32_t p = rs->pages[k];
            if (e->where == E_GPU) { /* an earlier item's */
                KVP_CHECK(p == e->idx, "op %" PRIu64 ": item %u page %u links %u, model %u", op, i,
                          k, p, e->idx);
                m_take_ref(m, p);
                if (m->pg[p].prio < x->prio)
                    m->pg[p].prio = x->prio;
                s->pages[k] = p;
                m->n_same_key++;
                continue;
            }
            KVP_CHECK(e->where == E_HOST, "model: entry gone");
            const uint32_t j = e->idx;
            KVP_CHECK(nr < m->p.num_restores, "op %" PRIu64 ": too few restores", op);
            const kvp_pcache_move_t *mv = &m->p.restores[nr++];
            KVP_CHECK(mv->page == p && mv->slot == j,
                      "op %" PRIu64 ": restore {%u,%u}, model {%u,%u}", op, mv->page, mv->slot, p,
                      j);
            m_taken(m, p);
            mpage_t *g = &m->pg[p];
            g->keyed = g->indexed = g->restoring = 1;
            g->rpin = 1;
            g->scope = x->scope;
            g->kid = kid;
            g->prio = m->sl[j].prio > x->prio ? m->sl[j].prio : x->prio;
            g->slot = j;
            m->sl[j].st = H_BUSY_R;
            m->sl[j].page = p;
            e->where = E_GPU;
            e->idx = p;
            s->pages[k] = p;
            m->promotions++;
            m->n_promo++;
            KVP_CHECK(m->nres < MAXMOVE, "too many restores");
            m->res[m->nres++] = *mv;
        }
        KVP_CHECK(m->p.restored_tokens[i] == restored && m->p.cached_tokens[i] == x->f * PS,
                  "op %" PRIu64 ": item %u cached %u restored %u, model %u %u", op, i,
                  m->p.cached_tokens[i], m->p.restored_tokens[i], x->f * PS, restored);
    }
    KVP_CHECK(m->p.num_restores == nr, "op %" PRIu64 ": %u restores, model %u", op,
              m->p.num_restores, nr);
    /* the batch's own pages: copy-on-write copies, then fresh pages, item by item */
    for (uint32_t i = 0; i < n; i++) {
        mitem_t *x = &it[i];
        mseq_t *s = &m->sq[x->id];
        const kvp_seq_t *rs = real_seq(m, x->id);
        const uint32_t len0 = x->start ? x->f * PS : s->len;
        const uint32_t np0 = x->start ? x->f : s->np;
        if (x->cow) {
            const uint32_t old = s->pages[np0 - 1], nw = rs->pages[np0 - 1];
            m_taken(m, nw);
            s->pages[np0 - 1] = nw;
            m_unref(m, old);
        }
        for (uint32_t k = 0; k < x->fresh; k++) {
            const uint32_t p = rs->pages[np0 + k];
            m_taken(m, p);
            s->pages[np0 + k] = p;
        }
        const uint32_t add = x->n - (x->start ? x->f * PS : 0);
        s->len = len0 + add;
        s->np = np0 + x->fresh;
        /* keys of the pages it filled */
        if (x->with_ids && s->chain && s->tracked) {
            const uint32_t old_full = len0 / PS, new_full = s->len / PS;
            for (uint32_t k = old_full; k < new_full; k++) {
                mpage_t *g = &m->pg[s->pages[k]];
                KVP_CHECK(!g->keyed, "model: keying keyed page %u", s->pages[k]);
                g->keyed = 1;
                g->scope = s->scope;
                g->kid = m->kid[s->q][k];
                g->prio = s->prio;
            }
            if (new_full > old_full)
                s->prev_full = 1;
            s->nkeyed = new_full;
        } else if (s->chain) {
            s->tracked = 0; /* ids missing, or an untracked chain stays so */
        }
    }
}

/* ---- operations --------------------------------------------------------------------------- */

static uint32_t rnd(m_t *m, uint32_t n)
{
    return kvp_rng_below(&m->r, n);
}

static const uint32_t prios[3] = {0, KVP_PCACHE_DEFAULT_PRIORITY, 70};

static void publish_id(m_t *m, uint32_t id, uint64_t op);

/* the writer's copy completed: most appends publish at once (as the daemon's Append does) */
static void maybe_publish(m_t *m, uint32_t id, uint64_t op)
{
    if (m->sq[id].live && rnd(m, 3) != 0)
        publish_id(m, id, op);
}

static void op_start(m_t *m, uint64_t op)
{
    uint32_t id = rnd(m, NSEQ);
    const mseq_t *s = &m->sq[id];
    if (s->live && s->len)
        return;
    mitem_t x = {.id = id, .start = 1, .with_ids = 1};
    x.q = rnd(m, NPROMPT);
    x.n = 1 + rnd(m, PLEN);
    x.scope = rnd(m, 8) ? 0 : 1;
    x.prio = prios[rnd(m, 3)];
    x.reuse = rnd(m, 4) != 0;
    x.promote = x.reuse && rnd(m, 4) != 0;
    x.leave_last = rnd(m, 3) == 0;
    if (rnd(m, 6) == 0) { /* a sequence without token ids: pressure */
        x.start = x.with_ids = 0;
        x.reuse = x.promote = x.leave_last = 0;
        x.n = 1 + rnd(m, 16);
    }
    m_plan(m, &x, 1, op);
    maybe_publish(m, id, op);
}

/* two new chains in one batch, often the same prompt: one promotes, the other links */
static void op_pair(m_t *m, uint64_t op)
{
    uint32_t a = rnd(m, NSEQ), b = rnd(m, NSEQ);
    if (a == b || (m->sq[a].live && m->sq[a].len) || (m->sq[b].live && m->sq[b].len))
        return;
    mitem_t x[2];
    memset(x, 0, sizeof(x));
    const uint32_t q = rnd(m, NPROMPT), scope = rnd(m, 8) ? 0 : 1, prio = prios[rnd(m, 3)];
    const int promote = rnd(m, 5) != 0, ll = rnd(m, 3) == 0;
    for (uint32_t i = 0; i < 2; i++) {
        x[i] = (mitem_t){.id = i ? b : a,
                         .start = 1,
                         .with_ids = 1,
                         .scope = scope,
                         .prio = prio,
                         .reuse = 1,
                         .promote = promote,
                         .leave_last = ll};
        x[i].q = i && rnd(m, 3) == 0 ? rnd(m, NPROMPT) : q;
        x[i].n = 1 + rnd(m, PLEN);
    }
    m_plan(m, x, 2, op);
    maybe_publish(m, a, op);
    maybe_publish(m, b, op);
}

static void op_grow(m_t *m, uint64_t op)
{
    uint32_t id = rnd(m, NSEQ);
    const mseq_t *s = &m->sq[id];
    if (!s->live || !s->len)
        return;
    mitem_t x = {.id = id, .q = s->q, .scope = s->scope, .prio = s->prio};
    x.with_ids = s->chain && rnd(m, 10) != 0;
    const uint32_t room = PLEN - s->len;
    if (room == 0)
        return;
    x.n = 1 + rnd(m, room < 6 ? room : 6);
    m_plan(m, &x, 1, op);
    maybe_publish(m, id, op);
}

static void op_release(m_t *m)
{
    uint32_t id = rnd(m, NSEQ);
    mseq_t *s = &m->sq[id];
    if (!s->live)
        return;
    KVP_CHECK(kvp_seqtab_release(m->t, 0, id) == 0, "release");
    for (uint32_t k = s->np; k-- > 0;)
        m_unref(m, s->pages[k]);
    memset(s, 0, sizeof(*s));
}

static void op_fork(m_t *m)
{
    uint32_t a = rnd(m, NSEQ), b = rnd(m, NSEQ);
    if (!m->sq[a].live || m->sq[b].live)
        return;
    KVP_CHECK(kvp_seqtab_fork(m->t, 0, a, b, m->now) == 0, "fork");
    m->sq[b] = m->sq[a];
    for (uint32_t k = 0; k < m->sq[b].np; k++)
        m->pg[m->sq[b].pages[k]].refs++;
}

static void op_truncate(m_t *m)
{
    uint32_t id = rnd(m, NSEQ);
    mseq_t *s = &m->sq[id];
    if (!s->live)
        return;
    uint32_t len = rnd(m, s->len + 1);
    for (uint32_t k = 0; k < s->np && rnd(m, 4); k++) /* often: into a page being restored */
        if (m->pg[s->pages[k]].restoring && m->pg[s->pages[k]].refs == 1) {
            len = k * PS + 1; /* <= s->len: page k is full */
            break;
        }
    /* a keyed page made partial while shared stays keyed (the next append copies it): the
     * model leaves that to test_pcache.c and truncates to the page boundary instead */
    if (len % PS && m->pg[s->pages[len / PS]].keyed && m->pg[s->pages[len / PS]].refs > 1)
        len -= len % PS;
    KVP_CHECK(kvp_seqtab_truncate(m->t, 0, id, len, m->now) == 0, "truncate");
    const uint32_t keep = (len + PS - 1) / PS, old_len = s->len;
    for (uint32_t k = s->np; k-- > keep;)
        m_unref(m, s->pages[k]);
    s->np = keep;
    s->len = len;
    const uint32_t full = len / PS, rem = len % PS;
    if (rem && m->pg[s->pages[full]].keyed)
        m_unkey(m, s->pages[full]); /* its sole holder will write into it */
    if (!s->chain)
        return;
    if (s->nkeyed > full)
        s->nkeyed = full;
    if (s->nhanded > s->nkeyed)
        s->nhanded = s->nkeyed;
    if (!s->tracked)
        return;
    const uint32_t old_full = old_len / PS;
    if (rem == 0) {
        if (full != old_full)
            s->prev_full = 0;
    } else if (full == old_full) {
    } else if (full + 1 == old_full && s->prev_full) {
        s->prev_full = 0;
    } else {
        s->tracked = 0;
    }
}

static void publish_id(m_t *m, uint32_t id, uint64_t op)
{
    mseq_t *s = &m->sq[id];
    if (!s->live)
        return;
    uint32_t want = 0;
    if (s->chain) {
        for (uint32_t k = s->nhanded; k < s->nkeyed; k++) {
            const uint32_t p = s->pages[k];
            mpage_t *g = &m->pg[p];
            if (!g->keyed || g->indexed || g->rpin)
                continue;
            ment_t *e = &m->ent[g->scope][g->kid];
            if (e->where == E_GPU)
                continue; /* a twin of a findable page stays private */
            if (e->where == E_HOST) {
                m_slot_release(m, e->idx); /* a GPU copy replaces a host entry */
                m->n_host_drop++;
            }
            e->where = E_GPU;
            e->idx = p;
            g->indexed = 1;
            want++;
        }
        s->nhanded = s->nkeyed;
    }
    const uint32_t got = kvp_pcache_publish_seq(m->c, real_seq(m, id));
    KVP_CHECK(got == want, "op %" PRIu64 ": published %u, model %u", op, got, want);
}

static void op_publish(m_t *m, uint64_t op)
{
    publish_id(m, rnd(m, NSEQ), op);
}

static void op_demote_begin(m_t *m, uint64_t op)
{
    /* the watermark: anywhere, or a few pages above what is free now */
    const uint32_t want_free = rnd(m, 2) ? rnd(m, NP + 1) : m_free_count(m) + rnd(m, 6);
    const uint32_t max = rnd(m, 7);
    kvp_pcache_move_t out[8];
    m->now += rnd(m, 3);
    const uint32_t got = kvp_pcache_demote_begin(m->c, m->now, want_free, max, out);
    uint32_t n = 0;
    while (n < max && m_count(m, 0) && m_free_count(m) + m_count(m, 1) < want_free) {
        uint32_t j = NONE;
        for (uint32_t i = 0; i < m->limit && j == NONE; i++)
            if (m->sl[i].st == H_FREE)
                j = i;
        if (j == NONE && (j = m_host_head(m)) != NONE) {
            m_drop_host(m, j);
            m->host_evictions++;
        }
        if (j == NONE)
            break;
        const uint32_t p = m_gpu_head(m);
        KVP_CHECK(n < got && out[n].page == p && out[n].slot == j,
                  "op %" PRIu64 ": demotion %u {%u,%u}, model {%u,%u}", op, n,
                  n < got ? out[n].page : NONE, n < got ? out[n].slot : NONE, p, j);
        mpage_t *g = &m->pg[p];
        g->cached = 0;
        g->demoting = 1;
        g->slot = j;
        m->sl[j].st = H_BUSY_D;
        m->sl[j].page = p;
        KVP_CHECK(m->ndem < MAXMOVE, "too many demotions");
        m->dem[m->ndem++] = out[n];
        n++;
    }
    KVP_CHECK(got == n, "op %" PRIu64 ": %u demotions, model %u", op, got, n);
}

static void remember_done(m_t *m, const kvp_pcache_move_t *mv)
{
    if (m->ndone < MAXMOVE)
        m->done[m->ndone++] = *mv;
    else
        m->done[rnd(m, MAXMOVE)] = *mv;
}

/* a random subset of the demotions in flight ends, in random order, all ok or all failed */
static void op_demote_end(m_t *m, uint64_t op)
{
    if (!m->ndem)
        return;
    kvp_pcache_move_t mv[MAXMOVE];
    uint32_t n = 0;
    const uint32_t k = 1 + rnd(m, m->ndem);
    while (n < k) {
        const uint32_t i = rnd(m, m->ndem);
        mv[n++] = m->dem[i];
        m->dem[i] = m->dem[--m->ndem];
    }
    const int ok = rnd(m, 5) != 0;
    uint32_t want = 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t p = mv[i].page, j = mv[i].slot;
        mpage_t *g = &m->pg[p];
        mslot_t *s = &m->sl[j];
        KVP_CHECK(s->st == H_BUSY_D && s->page == p, "model: demotion slot %u not busy", j);
        if (!g->demoting || g->slot != j) {
            m_slot_release(m, j); /* cancelled */
        } else if (ok && j < m->limit) {
            g->demoting = 0;
            s->st = H_ENTRY;
            s->scope = g->scope;
            s->kid = g->kid;
            s->prio = g->prio;
            s->stamp = ++m->ord;
            m->ent[g->scope][g->kid] = (ment_t){E_HOST, j};
            memset(g, 0, sizeof(*g)); /* free */
            m->demotions++;
            m->n_moved++;
            want++;
        } else {
            g->demoting = 0;
            g->cached = 1;
            g->stamp = ++m->ord;
            m_slot_release(m, j);
            m->n_failed_dem++;
        }
        remember_done(m, &mv[i]);
    }
    const uint32_t got = kvp_pcache_demote_end(m->c, mv, n, ok);
    KVP_CHECK(got == want, "op %" PRIu64 ": demote_end moved %u, model %u", op, got, want);
}

static void op_restore_end(m_t *m)
{
    if (!m->nres)
        return;
    kvp_pcache_move_t mv[MAXMOVE];
    uint32_t n = 0;
    const uint32_t k = 1 + rnd(m, m->nres);
    while (n < k) {
        const uint32_t i = rnd(m, m->nres);
        mv[n++] = m->res[i];
        m->res[i] = m->res[--m->nres];
    }
    const int ok = rnd(m, 6) != 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t p = mv[i].page, j = mv[i].slot;
        mpage_t *g = &m->pg[p];
        KVP_CHECK(m->sl[j].st == H_BUSY_R && m->sl[j].page == p && g->rpin,
                  "model: restore slot %u", j);
        m_slot_release(m, j);
        if (g->restoring && g->slot == j) {
            g->restoring = 0;
            if (!ok) { /* private from now on */
                m->ent[g->scope][g->kid].where = E_NONE;
                g->indexed = 0;
                m->evictions[KVP_EVICT_REWRITE]++;
                m->n_restore_fail++;
            }
        }
        g->rpin = 0;
        if (g->refs == 0)
            m_on_zero(m, p);
        remember_done(m, &mv[i]);
    }
    kvp_pcache_restore_end(m->c, mv, n, ok);
}

/* an end the cache already saw (the daemon's retry, a bug): ignored */
static void op_stale_end(m_t *m, uint64_t op)
{
    if (!m->ndone)
        return;
    const kvp_pcache_move_t mv = m->done[rnd(m, m->ndone)];
    /* still ended? the slot may be busy again with a newer move of the same page */
    const mslot_t *s = &m->sl[mv.slot];
    if ((s->st == H_BUSY_D || s->st == H_BUSY_R) && s->page == mv.page)
        return;
    const uint32_t got = kvp_pcache_demote_end(m->c, &mv, 1, (int)rnd(m, 2));
    KVP_CHECK(got == 0, "op %" PRIu64 ": a stale demote_end moved %u", op, got);
    kvp_pcache_restore_end(m->c, &mv, 1, (int)rnd(m, 2));
}

static void op_flush(m_t *m, uint64_t op)
{
    const uint32_t scope = rnd(m, 3) ? rnd(m, NSCOPE) : KVP_PCACHE_NO_SCOPE;
    uint32_t want = 0;
    for (uint32_t p = 0; p < NP; p++) {
        mpage_t *g = &m->pg[p];
        if ((g->cached || g->demoting) && (scope == KVP_PCACHE_NO_SCOPE || g->scope == scope)) {
            m_drop_gpu(m, p, KVP_EVICT_FLUSH); /* free at once; a demotion's slot stays busy */
            want++;
        }
    }
    for (uint32_t j = 0; j < NH; j++)
        if (m->sl[j].st == H_ENTRY && (scope == KVP_PCACHE_NO_SCOPE || m->sl[j].scope == scope)) {
            m_drop_host(m, j);
            m_slot_release(m, j);
            m->evictions[KVP_EVICT_FLUSH]++;
            want++;
        }
    const uint32_t got = kvp_pcache_flush(m->c, scope);
    KVP_CHECK(got == want, "op %" PRIu64 ": flush %u, model %u", op, got, want);
}

static void op_limit(m_t *m)
{
    /* mostly a roomy tier, sometimes a small one or none, sometimes above host_slots */
    uint32_t n = rnd(m, 4) ? NH - rnd(m, 3) + rnd(m, 5) : rnd(m, NH / 2);
    kvp_pcache_set_host_limit(m->c, n);
    if (n > NH)
        n = NH;
    for (uint32_t j = m->limit; j < n; j++)
        if (m->sl[j].st == H_UNUSED)
            m->sl[j].st = H_FREE;
    for (uint32_t j = n; j < m->limit; j++) {
        if (m->sl[j].st == H_FREE) {
            m->sl[j].st = H_UNUSED;
        } else if (m->sl[j].st == H_ENTRY) {
            m_drop_host(m, j);
            m->host_evictions++;
        }
    }
    m->limit = n;
}

static void op_pin(m_t *m, uint64_t op)
{
    const uint32_t i = rnd(m, NPINS);
    mpin_t *pn = &m->pin[i];
    if (pn->n) { /* unpin: its references go, the last page first */
        KVP_CHECK(kvp_pcache_unpin(m->c, 0, pn->id) == (int)pn->n, "unpin");
        for (uint32_t k = pn->n; k-- > 0;)
            m_unref(m, pn->pages[k]);
        memset(pn, 0, sizeof(*pn));
        return;
    }
    const uint32_t q = rnd(m, NPROMPT), scope = rnd(m, NSCOPE), ntok = 1 + rnd(m, PLEN);
    uint32_t gpu;
    m_walk(m, scope, q, ntok / PS, &gpu);
    uint32_t used = 0;
    for (uint32_t k = 0; k < NPINS; k++)
        used += m->pin[k].n > 0;
    uint64_t id = 0;
    uint32_t pages = 0;
    int rc = kvp_pcache_pin(m->c, 0, scope, root0(), m->prompt[q], ntok, m->now, UINT32_MAX, &id,
                            &pages);
    const int want = gpu == 0 ? KVP_ENOENT : used == NPINS ? KVP_ELIMIT : 0;
    KVP_CHECK(rc == want, "op %" PRIu64 ": pin %s, model %s", op, kvp_errname(rc),
              kvp_errname(want));
    if (rc)
        return;
    KVP_CHECK(pages == gpu, "op %" PRIu64 ": pin of %u pages, model %u", op, pages, gpu);
    pn->id = id;
    pn->n = gpu;
    for (uint32_t k = 0; k < gpu; k++) {
        pn->pages[k] = m->ent[scope][m->kid[q][k]].idx;
        m_take_ref(m, pn->pages[k]);
    }
}

static void op_lookup(m_t *m, uint64_t op)
{
    const uint32_t q = rnd(m, NPROMPT), scope = rnd(m, NSCOPE), ntok = rnd(m, PLEN + 1);
    uint32_t gw, gg;
    const uint32_t want = m_walk(m, scope, q, ntok / PS, &gw);
    const uint32_t got = kvp_pcache_lookup_tiers(m->c, scope, root0(), m->prompt[q], ntok, 1, &gg);
    KVP_CHECK(got == want && gg == gw, "op %" PRIu64 ": lookup_tiers", op);
    m->query += ntok;
    m->hit += (uint64_t)gw * PS;
    m->host_hit += (uint64_t)(want - gw) * PS;
}

static uint64_t env_u64(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    return v && *v ? strtoull(v, NULL, 0) : dflt;
}

START_TEST(the_two_tiers_follow_the_model)
{
    static m_t mm;
    m_t *m = &mm;
    memset(m, 0, sizeof(*m));
    const uint64_t seed = env_u64("KVP_SEED", 0x28a11 + (uint64_t)_i);
    const uint64_t ops = env_u64("KVP_MODEL_OPS", 80000);
    printf("test_pcache_tier_model: KVP_SEED=%" PRIu64 " KVP_MODEL_OPS=%" PRIu64 "\n", seed, ops);
    fflush(stdout);
    kvp_rng_seed(&m->r, seed);
    kvp_seqtab_config_t cfg = {.max_seqs = 64, .max_namespaces = 2, .max_seq_tokens = 0};
    kvp_pcache_config_t pc = {.max_scopes = NSCOPE, .max_pins = NPINS, .host_slots = NH};
    ck_assert_int_eq(kvp_alloc_create(NP, &m->a), 0);
    ck_assert_int_eq(kvp_seqtab_create(m->a, PS, &cfg, &m->t), 0);
    ck_assert_int_eq(kvp_pcache_create(m->t, &pc, &m->c), 0);
    kvp_plan_init(&m->p);
    m_keys(m);
    op_limit(m);
    m_check(m, 0);
    for (uint64_t op = 1; op <= ops; op++) {
        m->now += rnd(m, 2);
        const uint32_t w = rnd(m, 28);
        if (w < 4)
            op_start(m, op);
        else if (w < 6)
            op_pair(m, op);
        else if (w < 8)
            op_grow(m, op);
        else if (w < 11)
            op_release(m);
        else if (w < 12)
            op_fork(m);
        else if (w < 14)
            op_truncate(m);
        else if (w < 17)
            op_publish(m, op);
        else if (w < 20)
            op_demote_begin(m, op);
        else if (w < 22)
            op_demote_end(m, op);
        else if (w < 23)
            op_restore_end(m);
        else if (w < 24)
            rnd(m, 16) ? op_stale_end(m, op) : op_flush(m, op);
        else if (w < 25)
            op_limit(m);
        else if (w < 26)
            op_pin(m, op);
        else
            op_lookup(m, op);
        m_check(m, op);
    }
    printf("test_pcache_tier_model: moved %" PRIu64 " failed %" PRIu64 " cancelled %" PRIu64
           " promoted %" PRIu64 " (same key in a batch %" PRIu64 ") restores failed %" PRIu64
           " rewritten while restoring %" PRIu64 " late joins %" PRIu64 " host entries replaced "
           "%" PRIu64 " host evictions %" PRIu64 " ENOSPC %" PRIu64 "\n",
           m->n_moved, m->n_failed_dem, m->n_cancel, m->n_promo, m->n_same_key, m->n_restore_fail,
           m->n_rewrite_restoring, m->n_late_join, m->n_host_drop, m->host_evictions, m->n_enospc);
    fflush(stdout);
    if (ops >= 20000) /* a run long enough must have reached every path */
        ck_assert_msg(m->n_moved && m->n_failed_dem && m->n_cancel && m->n_promo && m->n_same_key &&
                          m->n_restore_fail && m->n_rewrite_restoring && m->n_late_join &&
                          m->n_host_drop && m->host_evictions && m->n_enospc,
                      "a path was never taken (see the counts above)");
    /* the daemon drains its moves, then everything goes */
    kvp_pcache_move_t left[MAXMOVE];
    uint32_t n = 0;
    for (uint32_t i = 0; i < m->ndem; i++)
        left[n++] = m->dem[i];
    kvp_pcache_demote_end(m->c, left, n, 1);
    kvp_pcache_restore_end(m->c, m->res, m->nres, 1);
    char msg[256];
    ck_assert_msg(kvp_pcache_audit(m->c, msg, sizeof(msg)) == 0, "final audit: %s", msg);
    for (uint32_t id = 0; id < NSEQ; id++)
        if (m->sq[id].live)
            ck_assert_int_eq(kvp_seqtab_release(m->t, 0, id), 0);
    kvp_plan_free(&m->p);
    kvp_pcache_destroy(m->c);
    kvp_seqtab_destroy(m->t);
    ck_assert_uint_eq(kvp_alloc_num_free(m->a), NP);
    kvp_alloc_destroy(m->a);
}
END_TEST

static Suite *model_suite(void)
{
    Suite *s = suite_create("pcache_tier_model");
    TCase *tc = tcase_create("model");
    tcase_set_timeout(tc, 0); /* KVP_MODEL_OPS sets the length; ctest's TIMEOUT bounds it */
    tcase_add_loop_test(tc, the_two_tiers_follow_the_model, 0, 2);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(model_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
