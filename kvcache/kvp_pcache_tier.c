/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pcache_tier.c - the prefix cache's host tier (issue #28, kvp_pcache.h "Identity and
 * tiers"): its slots (the usable limit, the free set, lowest slot first), asynchronous demotion
 * (begin pairs cached GPU pages with slots, end moves the entries or undoes the pairing),
 * promotion (the planner's hook that gives a host entry a fresh GPU page) and the end of a
 * restore. It never copies bytes: the daemon does, between the begin and end calls, and this
 * file only keeps each slot's state and each key's single place exact. The eviction lists and
 * the retention heap it uses are kvp_pcache_evict.c's, the key table kvp_pcache_index.c's.
 */
#include <assert.h>

#include "kvp_error.h"
#include "kvp_pcache.h"
#include "kvp_pcache_internal.h"

#define NIL         KVP__PC_NIL
#define BUSY        KVP_SLOT_BUSY
#define RESTORE_SRC KVP__PC_RESTORE_SRC
#define ENTRY       (KVP_PAGE_KEYED | KVP_PAGE_INDEXED)

/* ---- the free set ------------------------------------------------------------------------- */

static inline int is_free(const kvp_pcache_t *c, uint32_t j)
{
    return (c->hfree[j >> 6] >> (j & 63)) & 1;
}

static void set_free(kvp_pcache_t *c, uint32_t j)
{
    assert(!is_free(c, j) && c->flags[c->np + j] == 0 && j < c->hlimit);
    c->hfree[j >> 6] |= 1ull << (j & 63);
    if ((j >> 6) < c->hfree_lo)
        c->hfree_lo = j >> 6;
    c->st.host_free++;
}

static void clear_free(kvp_pcache_t *c, uint32_t j)
{
    c->hfree[j >> 6] &= ~(1ull << (j & 63));
    c->st.host_free--;
}

/* The lowest free slot, taken out of the free set, or NIL. Keeping entries low means a lower
 * limit drops fewer of them. */
static uint32_t take_free(kvp_pcache_t *c)
{
    if (!c->st.host_free)
        return NIL;
    uint32_t w = c->hfree_lo;
    while (!c->hfree[w])
        w++; /* host_free > 0: a word at or above the hint has a bit */
    c->hfree_lo = w;
    const uint32_t j = w * 64u + (uint32_t)__builtin_ctzll(c->hfree[w]);
    clear_free(c, j);
    return j;
}

void kvp__pcache_host_release(kvp_pcache_t *c, uint32_t j)
{
    if (j < c->hlimit)
        set_free(c, j);
}

void kvp__pcache_drop_host(kvp_pcache_t *c, uint32_t s)
{
    assert(s >= c->np && s < c->np + c->nhost && c->flags[s] == ENTRY);
    kvp__pcache_list_remove(c, s);
    if (c->hpos[s])
        kvp__pcache_heap_remove(c, s);
    kvp__pcache_index_remove(c, s);
    c->flags[s] = 0;
}

/* A slot for a demotion: the lowest free one, else the host order's head is dropped for good
 * (never a busy slot: those are in no list). NIL when the tier has neither. */
static uint32_t slot_for_demotion(kvp_pcache_t *c)
{
    uint32_t j = take_free(c);
    if (j != NIL)
        return j;
    const kvp__pc_order_t *o = &c->ord[KVP_MEDIUM_HOST];
    if (!o->nonempty[0] && !o->nonempty[1])
        return NIL;
    uint32_t l = o->nonempty[0] ? (uint32_t)__builtin_ctzll(o->nonempty[0])
                                : 64u + (uint32_t)__builtin_ctzll(o->nonempty[1]);
    const uint32_t s = o->head[l];
    kvp__pcache_drop_host(c, s);
    c->st.host_evictions++;
    return s - c->np;
}

void kvp_pcache_set_host_limit(kvp_pcache_t *c, uint32_t n)
{
    if (n > c->nhost)
        n = c->nhost;
    const uint32_t old = c->hlimit;
    c->hlimit = n;
    c->st.host_slots_usable = n;
    for (uint32_t j = old; j < n; j++) /* raised: unused slots become free, busy ones at end */
        if (c->flags[c->np + j] == 0)
            set_free(c, j);
    for (uint32_t j = n; j < old; j++) { /* lowered */
        const uint32_t s = c->np + j;
        if (is_free(c, j)) {
            clear_free(c, j);
        } else if (c->flags[s] == ENTRY) {
            kvp__pcache_drop_host(c, s);
            c->st.host_evictions++;
        }
    }
}

/* ---- demotion ----------------------------------------------------------------------------- */

uint32_t kvp_pcache_demote_begin(kvp_pcache_t *c, uint64_t now_ms, uint32_t want_free_pages,
                                 uint32_t max, kvp_pcache_move_t *out)
{
    kvp_pcache_set_now(c, now_ms);
    kvp__pcache_expire_retention(c);
    const kvp__pc_order_t *o = &c->ord[KVP_MEDIUM_GPU];
    uint32_t n = 0;
    while (n < max && c->st.cached_pages &&
           (uint64_t)kvp_alloc_num_free(c->a) + c->st.demoting < want_free_pages) {
        const uint32_t j = slot_for_demotion(c);
        if (j == NIL)
            break;
        uint32_t l = o->nonempty[0] ? (uint32_t)__builtin_ctzll(o->nonempty[0])
                                    : 64u + (uint32_t)__builtin_ctzll(o->nonempty[1]);
        const uint32_t p = o->head[l];
        kvp__pcache_uncache(c, p);
        c->flags[p] |= KVP_PAGE_DEMOTING;
        c->prev[p] = j; /* kvp__pc_move_slot */
        c->st.demoting++;
        c->flags[c->np + j] = BUSY;
        c->hpage[j] = p;
        c->st.host_busy++;
        out[n].page = p;
        out[n].gen = c->gen[p];
        out[n].slot = j;
        n++;
    }
    return n;
}

/* The slot of move m is busy with a move of m's page of that kind (restore or not), or 0. */
static int move_matches(const kvp_pcache_t *c, const kvp_pcache_move_t *m, uint8_t kind)
{
    if (m->slot >= c->nhost || m->page >= c->np)
        return 0;
    return (c->flags[c->np + m->slot] & (BUSY | RESTORE_SRC)) == (BUSY | kind) &&
           c->hpage[m->slot] == m->page;
}

/* The move of host slot j ended: the slot is free again, or unused above the limit. */
static void end_busy(kvp_pcache_t *c, uint32_t j)
{
    c->flags[c->np + j] = 0;
    c->st.host_busy--;
    kvp__pcache_host_release(c, j);
}

/* The entry of demoting page p moves to host slot j (busy no more): indexed there, at its
 * priority's host list tail, in the retention heap with a duration. p goes to the free stack. */
static void move_to_host(kvp_pcache_t *c, uint32_t p, uint32_t j)
{
    const uint32_t s = c->np + j;
    kvp__pcache_index_remove(c, p);
    c->key[s] = c->key[p];
    c->scope[s] = c->scope[p];
    c->prio[s] = c->prio[p];
    c->ret[s] = c->ret[p];
    c->rel[s] = c->rel[p]; /* its release: a retention duration keeps counting from there */
    c->flags[s] = KVP_PAGE_KEYED;
    kvp__pcache_aux_copy(c, s, p); /* before the insert: its STORED event tells the tokens */
    kvp__pcache_index_insert(c, s);
    kvp__pcache_list_push(c, s);
    if (c->ret[s])
        kvp__pcache_heap_push(c, s);
    c->st.host_busy--;
    c->flags[p] = 0;
    c->gen[p]++;
    kvp__alloc_push_free(c->a, p);
    c->st.demotions++;
}

uint32_t kvp_pcache_demote_end(kvp_pcache_t *c, const kvp_pcache_move_t *m, uint32_t n, int ok)
{
    uint32_t moved = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!move_matches(c, &m[i], 0))
            continue; /* not a demotion in flight: ended already, or made up */
        const uint32_t p = m[i].page, j = m[i].slot;
        if (!(c->flags[p] & KVP_PAGE_DEMOTING) || c->gen[p] != m[i].gen ||
            kvp__pc_move_slot(c, p) != j) {
            end_busy(c, j); /* cancelled: the page is whoever's it is now */
            continue;
        }
        c->flags[p] &= (uint8_t)~KVP_PAGE_DEMOTING;
        c->st.demoting--;
        if (ok && j < c->hlimit) {
            move_to_host(c, p, j);
            moved++;
            continue;
        }
        /* failed, or the limit retired the slot meanwhile: the page is cached again, at its
         * list's tail (its release time unchanged) */
        c->flags[p] |= KVP_PAGE_CACHED;
        kvp__pcache_list_push(c, p);
        if (c->ret[p])
            kvp__pcache_heap_push(c, p);
        c->st.cached_pages++;
        c->sc[c->scope[p]].cached_pages++;
        end_busy(c, j);
    }
    if (moved)
        kvp__pcache_expire_retention(c); /* durations that ended while the copies ran */
    return moved;
}

uint32_t kvp__pcache_flush_demoting(kvp_pcache_t *c, uint32_t scope)
{
    uint32_t n = 0;
    for (uint32_t j = 0; j < c->nhost && c->st.demoting; j++) {
        if ((c->flags[c->np + j] & (BUSY | RESTORE_SRC)) != BUSY)
            continue;
        const uint32_t p = c->hpage[j];
        if (!(c->flags[p] & KVP_PAGE_DEMOTING) || kvp__pc_move_slot(c, p) != j ||
            (scope != KVP_PCACHE_NO_SCOPE && c->scope[p] != scope))
            continue;
        /* the copy only reads the page: it is free at once; the slot stays busy until the end
         * call, which finds the generation changed */
        kvp__pcache_index_remove(c, p);
        c->flags[p] = 0;
        c->gen[p]++;
        c->st.demoting--;
        c->st.evictions[KVP_EVICT_FLUSH]++;
        kvp__alloc_push_free(c->a, p);
        n++;
    }
    return n;
}

/* ---- promotion and restores --------------------------------------------------------------- */

int kvp__pcache_mark_host(kvp_pcache_t *c, uint32_t s)
{
    assert(s >= c->np && (c->flags[s] & ENTRY) == ENTRY);
    if (c->flags[s] & KVP__PC_MARK)
        return 0;
    c->flags[s] |= KVP__PC_MARK;
    return 1;
}

void kvp__pcache_unmark_host(kvp_pcache_t *c, uint32_t s)
{
    c->flags[s] &= (uint8_t)~KVP__PC_MARK;
}

void kvp__pcache_promote(kvp_pcache_t *c, uint32_t s, uint32_t pg, uint32_t priority,
                         uint32_t retention_ms, kvp_pcache_move_t *out)
{
    assert(s >= c->np && c->flags[s] == ENTRY && pg < c->np && c->flags[pg] == 0);
    assert(kvp_alloc_refcount(c->a, pg) == 1);
    const uint32_t j = s - c->np;
    kvp__pcache_list_remove(c, s);
    if (c->hpos[s])
        kvp__pcache_heap_remove(c, s);
    kvp__pcache_index_remove(c, s);
    c->key[pg] = c->key[s];
    c->scope[pg] = c->scope[s];
    c->prio[pg] = c->prio[s];
    c->ret[pg] = c->ret[s];
    c->rel[pg] = c->rel[s];
    c->gen[pg]++; /* keyed anew */
    c->flags[pg] = KVP_PAGE_KEYED;
    kvp__pcache_aux_copy(c, pg, s);
    kvp__pcache_index_insert(c, pg);
    c->flags[pg] |= KVP_PAGE_RESTORING;
    c->prev[pg] = j; /* kvp__pc_move_slot */
    kvp__pcache_raise_retention(c, pg, priority, retention_ms);
    kvp_alloc_pin(c->a, pg); /* until restore_end: a released page is not reused while written */
    c->flags[s] = BUSY | RESTORE_SRC;
    c->hpage[j] = pg;
    c->st.host_busy++;
    c->st.restoring++;
    c->st.promotions++;
    out->page = pg;
    out->gen = c->gen[pg];
    out->slot = j;
}

void kvp_pcache_restore_end(kvp_pcache_t *c, const kvp_pcache_move_t *m, uint32_t n, int ok)
{
    for (uint32_t i = 0; i < n; i++) {
        if (!move_matches(c, &m[i], RESTORE_SRC))
            continue; /* not a restore in flight */
        const uint32_t p = m[i].page, j = m[i].slot;
        end_busy(c, j);
        /* still restoring unless a truncate rewrote it meanwhile (kvp__pcache_unkey) */
        if ((c->flags[p] & KVP_PAGE_RESTORING) && kvp__pc_move_slot(c, p) == j) {
            c->flags[p] &= (uint8_t)~KVP_PAGE_RESTORING;
            c->st.restoring--;
            if (!ok) { /* its content is not there: private from now on, never findable */
                kvp__pcache_index_remove(c, p);
                c->st.evictions[KVP_EVICT_REWRITE]++;
                c->gen[p]++;
                c->flags[p] = KVP_PAGE_KEYED; /* its holders' chains still name its key */
            }
        }
        kvp_alloc_unpin(c->a, p); /* no holder left: cached (ok) or free */
    }
}

int kvp_pcache_restoring(const kvp_pcache_t *c, uint32_t page)
{
    return page < c->np && (c->flags[page] & KVP_PAGE_RESTORING) != 0;
}
