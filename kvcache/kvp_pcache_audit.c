/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pcache_audit.c - reading the prefix cache: its counters, a scope's counters and their
 * reset, and the audit that recounts every structure from scratch, both tiers and the moves
 * between them (kvp_pcache.h). Nothing here
 * changes what the cache holds (scope_reset zeroes counters only); the audit allocates its own
 * scratch and is O(pages + slots + sequences).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_pcache.h"
#include "kvp_pcache_internal.h"
#include "kvp_seqtab_internal.h"

#define NIL   KVP__PC_NIL
#define NPRIO KVP__PC_NPRIO

void kvp_pcache_stats(const kvp_pcache_t *c, kvp_pcache_stats_t *out)
{
    *out = c->st;
}

int kvp_pcache_scope_reset(kvp_pcache_t *c, uint32_t scope)
{
    if (scope >= c->max_scopes)
        return KVP_EINVAL;
    if (c->sc[scope].indexed_pages || c->sc[scope].host_pages)
        return KVP_EBUSY;
    /* nor may a keyed page or a chain of it live on, to be published under the next owner
     * (rare: a scope id is given to another scope; O(pages + sequences)) */
    for (uint32_t p = 0; p < c->np; p++)
        if ((c->flags[p] & KVP_PAGE_KEYED) && c->scope[p] == scope)
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
    const uint32_t np = c->np, nslots = c->np + c->nhost;
    const uint8_t other_flags = KVP_PAGE_KEYED | KVP_PAGE_INDEXED; /* an entry of another medium */
    uint8_t *seen = calloc(nslots, 1);
    uint32_t *pinned = calloc(np, 4);
    uint64_t *nsp = calloc(c->max_ns, 8);
    uint32_t *nspins = calloc(c->max_ns, 4);
    kvp_pcache_scope_stats_t *sc = calloc(c->max_scopes, sizeof(*sc));
    if (!seen || !pinned || !nsp || !nspins || !sc) {
        rc = KVP_ENOMEM;
        goto out;
    }
    uint32_t indexed = 0, cached = 0, pinned_pages = 0, pins = 0, in_heap = 0, hosted = 0;
    /* the index: every entry indexed, in its bucket, found as itself, once */
    for (uint32_t b = 0; b <= c->bmask; b++) {
        for (uint32_t p = c->bucket[b], steps = 0; p != NIL; p = c->hnext[p]) {
            if (p >= nslots || ++steps > nslots)
                AUDIT_FAIL("index bucket %u: bad link or a cycle", b);
            if (!(c->flags[p] & KVP_PAGE_INDEXED) || !(c->flags[p] & KVP_PAGE_KEYED))
                AUDIT_FAIL("slot %u is in the index but not indexed (flags %u)", p, c->flags[p]);
            if (p >= np && c->flags[p] != other_flags)
                AUDIT_FAIL("host slot %u: flags %u in the index", p - np, c->flags[p]);
            if (p >= np && p - np >= c->hlimit)
                AUDIT_FAIL("host slot %u: indexed at or above the limit %u", p - np, c->hlimit);
            if (kvp__pc_bucket(c, c->scope[p], c->key[p]) != b)
                AUDIT_FAIL("slot %u is in the wrong bucket", p);
            if (seen[p]++)
                AUDIT_FAIL("slot %u is in the index twice", p);
            if (kvp__pcache_find_slot(c, c->scope[p], c->key[p]) != p)
                AUDIT_FAIL("slot %u: its (scope, key) finds another entry", p);
            if (c->scope[p] >= c->max_scopes)
                AUDIT_FAIL("slot %u: scope %u out of range", p, c->scope[p]);
            /* keep_tokens: what a STORED event tells of the entry is its content */
            if (c->has_parent && c->has_parent[p] > 1)
                AUDIT_FAIL("slot %u: has_parent %u", p, c->has_parent[p]);
            if (c->has_parent && c->has_parent[p] &&
                !kvp_pagekey_eq(kvp_pagekey_next(c->parent[p], c->tok + (size_t)p * c->ps, c->ps),
                                c->key[p]))
                AUDIT_FAIL("slot %u: its parent and tokens do not make its key", p);
            if (p < np) {
                indexed++;
                sc[c->scope[p]].indexed_pages++;
            } else {
                hosted++;
                sc[c->scope[p]].host_pages++;
            }
        }
    }
    /* the eviction lists of each medium */
    for (uint32_t m = 0; m < KVP_MEDIUMS; m++) {
        const kvp__pc_order_t *o = &c->ord[m];
        for (uint32_t l = 0; l < NPRIO; l++) {
            uint32_t prev = NIL, steps = 0;
            int nonempty = (o->nonempty[l >> 6] >> (l & 63)) & 1;
            if (nonempty != (o->head[l] != NIL))
                AUDIT_FAIL("medium %u list %u: non-empty bit %d but head %u", m, l, nonempty,
                           o->head[l]);
            for (uint32_t p = o->head[l]; p != NIL; prev = p, p = c->next[p]) {
                if (p >= nslots || ++steps > nslots)
                    AUDIT_FAIL("medium %u list %u: bad link or a cycle", m, l);
                if (kvp__pc_medium(c, p) != m)
                    AUDIT_FAIL("slot %u is in a list of medium %u", p, m);
                if (c->prev[p] != prev)
                    AUDIT_FAIL("list %u: page %u's back link is wrong", l, p);
                if (m == KVP_MEDIUM_GPU &&
                    (!(c->flags[p] & KVP_PAGE_CACHED) || !(c->flags[p] & KVP_PAGE_INDEXED)))
                    AUDIT_FAIL("page %u is in eviction list %u but not cached (flags %u)", p, l,
                               c->flags[p]);
                if (m != KVP_MEDIUM_GPU && c->flags[p] != other_flags)
                    AUDIT_FAIL("host slot %u is in list %u with flags %u", p - np, l, c->flags[p]);
                if (c->prio[p] != l)
                    AUDIT_FAIL("slot %u of priority %u is in list %u", p, c->prio[p], l);
                if (seen[p] & 2)
                    AUDIT_FAIL("slot %u is in the eviction lists twice", p);
                seen[p] |= 2;
                if (m == KVP_MEDIUM_GPU) {
                    cached++;
                    sc[c->scope[p]].cached_pages++;
                }
            }
            if (o->tail[l] != prev)
                AUDIT_FAIL("medium %u list %u: tail %u but the last entry is %u", m, l, o->tail[l],
                           prev);
        }
    }
    /* pins */
    for (uint32_t i = 0; i < c->max_pins; i++) {
        const kvp__pc_pin_t *pin = &c->pins[i];
        if (!pin->id)
            continue;
        if ((pin->id & 0xffffu) != i || pin->ns >= c->max_ns || pin->num_pages == 0)
            AUDIT_FAIL("pin record %u is inconsistent", i);
        for (uint32_t k = 0; k < pin->num_pages; k++) {
            uint32_t p = pin->pages[k];
            /* indexed when pinned; a restore that failed since leaves it keyed, unindexed */
            if (p >= np || !(c->flags[p] & KVP_PAGE_KEYED))
                AUDIT_FAIL("pin %llu holds page %u, not keyed", (unsigned long long)pin->id, p);
            pinned[p]++;
        }
        nsp[pin->ns] += pin->num_pages;
        nspins[pin->ns]++;
        pins++;
    }
    /* every GPU page */
    uint32_t demoting = 0, restoring = 0;
    for (uint32_t p = 0; p < np; p++) {
        const uint8_t f = c->flags[p];
        const uint32_t rc_p = kvp_alloc_refcount(c->a, p), apins = kvp_alloc_pins(c->a, p);
        const int moving = (f & (KVP_PAGE_DEMOTING | KVP_PAGE_RESTORING)) != 0;
        const int should_cache =
            (f & KVP_PAGE_INDEXED) && rc_p == 0 && apins == 0 && !(f & KVP_PAGE_DEMOTING);
        if (f & ~(KVP_PAGE_KEYED | KVP_PAGE_INDEXED | KVP_PAGE_CACHED | KVP_PAGE_DEMOTING |
                  KVP_PAGE_RESTORING))
            AUDIT_FAIL("page %u: flags %u", p, f);
        if (((f & KVP_PAGE_CACHED) != 0) != should_cache)
            AUDIT_FAIL("page %u: cached flag %d, indexed %d, refcount %u, pins %u", p,
                       (f & KVP_PAGE_CACHED) != 0, (f & KVP_PAGE_INDEXED) != 0, rc_p, apins);
        if (((f & KVP_PAGE_INDEXED) != 0) != ((seen[p] & 1) != 0))
            AUDIT_FAIL("page %u: indexed flag but not in the index (or the reverse)", p);
        if (((f & KVP_PAGE_CACHED) != 0) != ((seen[p] & 2) != 0))
            AUDIT_FAIL("page %u: cached flag but in no eviction list (or the reverse)", p);
        if (f && !(f & KVP_PAGE_KEYED))
            AUDIT_FAIL("page %u: flags %u without a key", p, f);
        if (f == KVP_PAGE_KEYED && rc_p == 0 && apins == 0)
            AUDIT_FAIL("page %u: keyed, unindexed, with no reference", p);
        if (moving) {
            const uint32_t j = kvp__pc_move_slot(c, p);
            const uint8_t kind = (f & KVP_PAGE_RESTORING) ? KVP__PC_RESTORE_SRC : 0;
            if ((f & (KVP_PAGE_DEMOTING | KVP_PAGE_RESTORING)) ==
                    (KVP_PAGE_DEMOTING | KVP_PAGE_RESTORING) ||
                !(f & KVP_PAGE_INDEXED) || (f & KVP_PAGE_CACHED))
                AUDIT_FAIL("page %u: moving with flags %u", p, f);
            if (j >= c->nhost || c->flags[np + j] != (KVP_SLOT_BUSY | kind) || c->hpage[j] != p)
                AUDIT_FAIL("%s page %u names host slot %u, not busy with its move",
                           kind ? "restoring" : "demoting", p, j);
        }
        if ((f & KVP_PAGE_DEMOTING) && (rc_p || apins))
            AUDIT_FAIL("demoting page %u: refcount %u, pins %u", p, rc_p, apins);
        if ((f & KVP_PAGE_RESTORING) && apins == 0)
            AUDIT_FAIL("restoring page %u is not pinned", p);
        demoting += (f & KVP_PAGE_DEMOTING) != 0;
        restoring += (f & KVP_PAGE_RESTORING) != 0;
        if (pinned[p] != c->pinrefs[p])
            AUDIT_FAIL("page %u: %u pin references counted, %u kept", p, pinned[p], c->pinrefs[p]);
        pinned_pages += pinned[p] > 0;
    }
    /* every host slot: exactly one of free (usable only), an entry (usable only, indexed and
     * listed), busy (a move's, paired with its page) or unused (at or above the limit) */
    uint32_t host_free = 0, busy = 0, busy_restore = 0, live_demotions = 0;
    for (uint32_t j = 0; j < c->nhost; j++) {
        const uint32_t p = np + j;
        const uint8_t f = c->flags[p];
        const int is_free = (c->hfree[j >> 6] >> (j & 63)) & 1;
        if (is_free && (f != 0 || j >= c->hlimit))
            AUDIT_FAIL("host slot %u: free with flags %u (limit %u)", j, f, c->hlimit);
        if (is_free && (j >> 6) < c->hfree_lo)
            AUDIT_FAIL("host slot %u: free below the free-set hint %u", j, c->hfree_lo * 64);
        if (f == other_flags) {
            if (j >= c->hlimit)
                AUDIT_FAIL("host slot %u: an entry at or above the limit %u", j, c->hlimit);
        } else if (f == KVP_SLOT_BUSY || f == (KVP_SLOT_BUSY | KVP__PC_RESTORE_SRC)) {
            const uint32_t pg = c->hpage[j];
            if (pg >= np)
                AUDIT_FAIL("host slot %u: busy with page %u", j, pg);
            busy++;
            if (f & KVP__PC_RESTORE_SRC) {
                busy_restore++;
                if (kvp_alloc_pins(c->a, pg) == 0)
                    AUDIT_FAIL("host slot %u: a restore's source, its page %u not pinned", j, pg);
            } else if ((c->flags[pg] & KVP_PAGE_DEMOTING) && kvp__pc_move_slot(c, pg) == j) {
                live_demotions++;
            }
        } else if (f != 0) {
            AUDIT_FAIL("host slot %u: flags %u", j, f);
        } else if (!is_free && j < c->hlimit) {
            AUDIT_FAIL("host slot %u: usable, neither free, an entry nor busy", j);
        }
        if ((f == other_flags) != ((seen[p] & 1) != 0) ||
            (f == other_flags) != ((seen[p] & 2) != 0))
            AUDIT_FAIL("host slot %u: flags %u, in the index %d, in a list %d", j, f, seen[p] & 1,
                       (seen[p] & 2) != 0);
        host_free += is_free;
    }
    if (c->nhost % 64 && c->hfree[c->nhost / 64] >> (c->nhost % 64))
        AUDIT_FAIL("free-set bits beyond the last host slot");
    if (live_demotions != demoting || busy_restore < restoring)
        AUDIT_FAIL("moves: %u demoting pages but %u slots busy with their demotion; %u restoring "
                   "pages, %u slots busy with restores",
                   demoting, live_demotions, restoring, busy_restore);
    if (host_free != c->st.host_free || busy != c->st.host_busy || demoting != c->st.demoting ||
        restoring != c->st.restoring || c->hlimit != c->st.host_slots_usable ||
        c->hlimit > c->nhost)
        AUDIT_FAIL("host counters: free %u/%u busy %u/%u demoting %u/%u restoring %u/%u "
                   "usable %u/%u (counted/kept)",
                   host_free, c->st.host_free, busy, c->st.host_busy, demoting, c->st.demoting,
                   restoring, c->st.restoring, c->hlimit, c->st.host_slots_usable);
    /* the retention heap: cached GPU pages and host entries with a duration, nothing else */
    for (uint32_t p = 0; p < nslots; p++) {
        const uint8_t f = c->flags[p];
        if (c->prio[p] > KVP_PCACHE_MAX_PRIORITY)
            AUDIT_FAIL("slot %u: priority %u", p, c->prio[p]);
        const int listed = p < np ? (f & KVP_PAGE_CACHED) != 0 : f == other_flags;
        const int want_heap = listed && c->ret[p];
        if (want_heap != (c->hpos[p] != 0))
            AUDIT_FAIL("slot %u: listed %d with retention %u ms but heap position %u", p, listed,
                       c->ret[p], c->hpos[p]);
        if (c->hpos[p]) {
            uint32_t i = c->hpos[p] - 1;
            if (i >= c->heap_n || c->heap[i] != p)
                AUDIT_FAIL("slot %u: heap position %u is wrong", p, i);
            if (i > 0 && kvp__pc_heap_less(c, p, c->heap[(i - 1) / 2]))
                AUDIT_FAIL("retention heap out of order at %u", i);
            in_heap++;
        }
    }
    if (in_heap != c->heap_n)
        AUDIT_FAIL("retention heap holds %u slots, %u counted", c->heap_n, in_heap);
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
            if (!(c->flags[p] & KVP_PAGE_KEYED) || c->scope[p] != ch->scope)
                AUDIT_FAIL("seq ns=%u id=%llu: page %u (index %u) of its chain is not keyed "
                           "in its scope",
                           s->ns, (unsigned long long)s->id, p, k);
        }
        const int tail_keyed =
            s->num_tokens % c->ps && (c->flags[s->pages[s->num_pages - 1]] & KVP_PAGE_KEYED);
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
            sc[s].cached_pages != c->sc[s].cached_pages || sc[s].host_pages != c->sc[s].host_pages)
            AUDIT_FAIL("scope %u: indexed %u/%u cached %u/%u host %u/%u (counted/kept)", s,
                       sc[s].indexed_pages, c->sc[s].indexed_pages, sc[s].cached_pages,
                       c->sc[s].cached_pages, sc[s].host_pages, c->sc[s].host_pages);
    if (indexed != c->st.indexed_pages || cached != c->st.cached_pages ||
        pinned_pages != c->st.pinned_pages || pins != c->st.pins ||
        pins + c->num_pin_free != c->max_pins || hosted != c->st.host_pages)
        AUDIT_FAIL("counters: indexed %u/%u cached %u/%u pinned %u/%u pins %u/%u host %u/%u "
                   "(counted/kept)",
                   indexed, c->st.indexed_pages, cached, c->st.cached_pages, pinned_pages,
                   c->st.pinned_pages, pins, c->st.pins, hosted, c->st.host_pages);
out:
    free(sc);
    free(nspins);
    free(nsp);
    free(pinned);
    free(seen);
    return rc;
}
