/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pcache_internal.h - the prefix cache's hooks for the allocator, the sequence table and
 * the planner (kvcache/ only; see kvp_pcache.h for the model).
 *
 * The allocator asks the cache what to do with a page whose last reference went
 * (kvp__pcache_on_zero) and takes cached pages when its free stack is empty
 * (kvp__pcache_evict). The sequence table keeps a chain record per sequence with token ids and
 * lets the cache see truncates. The planner links found pages and feeds appended token ids.
 * The last part is the cache's own: its layout and the functions its files (kvp_pcache*.c)
 * share; nothing outside them reads it.
 */
#ifndef KVP_PCACHE_INTERNAL_H
#define KVP_PCACHE_INTERNAL_H

#include <stdint.h>

#include "kvp_alloc.h"
#include "kvp_loc.h"
#include "kvp_pagekey.h"
#include "kvp_pcache.h"
#include "kvp_seqtab.h"

struct kvp_pcache;
struct kvp_seqtab;

/* A sequence's chain: what it takes to key its next full page. Owned by the sequence record
 * (kvp_seq_t.chain), allocated once the sequence has token ids from its first token on. */
typedef struct kvp_chain {
    uint32_t scope;
    uint8_t tracked;      /* keys its pages; 0 once an append came without token ids */
    uint8_t priority;     /* retention of the pages it keys or links */
    uint8_t prev_full;    /* tok[ps..2ps) holds the tokens of page num_keyed - 1 */
    uint8_t tail_keyed;   /* a truncate left a keyed page (shared then) as the partial last page:
                             the next append must not write into it while it is keyed */
    uint8_t tail_foreign; /* the partial last page holds rows a worker wrote (Reserve) or a
                             truncate kept: a daemon-run Append that fills it did not write all
                             of it, so it does not publish it (kvp_plan_t.publish_from) */
    uint32_t retention_ms;
    uint32_t num_keyed;  /* pages [0, num_keyed) of the sequence have its keys */
    uint32_t num_handed; /* of them, handed out for publishing (or linked) */
    uint32_t pend_n;     /* tokens of the partial last page, in tok[0..pend_n) */
    kvp_pagekey_t root;  /* from the salt */
    kvp_pagekey_t last;  /* key of page num_keyed - 1, root when num_keyed is 0 */
    int32_t tok[];       /* [2 * page_size] */
} kvp_chain_t;

/* ---- allocator (kvp_alloc.c) ---- */
void kvp__alloc_set_cache(kvp_alloc_t *a, struct kvp_pcache *pc);
void kvp__alloc_push_free(kvp_alloc_t *a, uint32_t page); /* refcount 0, no pin, not cached */
/* A page at refcount 0 the cache hands to a holder (cached, demoting, or pinned by a copy in
 * flight): refcount 0 -> 1. */
void kvp__alloc_revive(kvp_alloc_t *a, uint32_t page);

/* Refcount and pins of page reached 0: returns 1 when the cache keeps it (indexed: now
 * cached), 0 when it goes to the free stack (its key, if any, is dropped). */
int kvp__pcache_on_zero(struct kvp_pcache *pc, uint32_t page);
/* Takes the next cached page in eviction order out of the cache (refcount stays 0; the
 * caller hands it out). There must be one (kvp__pcache_num_cached > 0). */
uint32_t kvp__pcache_evict(struct kvp_pcache *pc);
uint32_t kvp__pcache_num_cached(const struct kvp_pcache *pc);
int kvp__pcache_is_cached(const struct kvp_pcache *pc, uint32_t page);
/* Demoting pages: refcount 0, no pin, neither free nor cached (kvp_pcache.h, the host tier). */
uint32_t kvp__pcache_num_demoting(const struct kvp_pcache *pc);
int kvp__pcache_is_demoting(const struct kvp_pcache *pc, uint32_t page);

/* ---- sequence table (kvp_seqtab.c) ---- */
void kvp__seqtab_set_cache(struct kvp_seqtab *t, struct kvp_pcache *pc);
/* References pins hold on page (the audit adds them to the sequences' references). */
uint32_t kvp__pcache_pin_refs(const struct kvp_pcache *pc, uint32_t page);
/* A copy of c for a forked child, or NULL (KVP_ENOMEM). */
kvp_chain_t *kvp__pcache_chain_dup(const struct kvp_pcache *pc, const kvp_chain_t *c);
/* s was truncated from old_tokens to s->num_tokens (its pages already dropped): a kept
 * partial page that was keyed loses its key when s is its only holder, and s's chain keeps
 * what is still true (kvp_pcache.h, truncate). */
void kvp__pcache_truncated(struct kvp_pcache *pc, kvp_seq_t *s, uint32_t old_tokens);

/* A keyed page its sole holder is about to write: it leaves the key table (counted as a
 * rewrite) and loses its key. */
void kvp__pcache_unkey(struct kvp_pcache *pc, uint32_t page);

/* ---- planner (kvp_plan.c) ---- */
/* A fresh chain record (not started), or NULL. Freed with free(). */
kvp_chain_t *kvp__pcache_chain_new(const struct kvp_pcache *pc);
void kvp__pcache_chain_start(kvp_chain_t *c, uint32_t scope, kvp_pagekey_t root, uint32_t priority,
                             uint32_t retention_ms);
/* Links an indexed page into a sequence whose chain has priority/retention: refcount + 1 (a
 * cached page leaves its eviction list, a demoting one's demotion is cancelled). */
void kvp__pcache_link(struct kvp_pcache *pc, uint32_t page, uint32_t priority,
                      uint32_t retention_ms);
/* s appended tokens[0..n) (s->pages and s->num_tokens already updated): keys the pages they
 * filled. pre[0..npre), when the chain has no partial page, are the keys of the next full
 * pages already computed (phase 1 of a reuse); the rest is hashed here. */
void kvp__pcache_chain_append(struct kvp_pcache *pc, kvp_seq_t *s, const int32_t *tokens,
                              uint32_t n, const kvp_pagekey_t *pre, uint32_t npre);
/* Counts a query of q tokens that found h_gpu tokens in the GPU tier's leading pages and
 * h_host more (reuse, lookups). */
void kvp__pcache_count_query(struct kvp_pcache *pc, uint32_t scope, uint64_t q, uint64_t h_gpu,
                             uint64_t h_host);
uint32_t kvp__pcache_max_scopes(const struct kvp_pcache *pc);
uint32_t kvp__pcache_num_pages(const struct kvp_pcache *pc);
/* The entry slot of (scope, key) in either tier, or KVP__PC_NIL: below
 * kvp__pcache_num_pages a GPU page, above it a host entry's slot (promotion, issue #28). */
uint32_t kvp__pcache_find_slot(const struct kvp_pcache *pc, uint32_t scope, kvp_pagekey_t key);
/* Planner scratch on a host entry's slot: returns 1 when it was not marked yet (so a batch
 * counts an entry it promotes once) and marks it; unmark clears it. The planner unmarks every
 * slot it marked before returning. */
int kvp__pcache_mark_host(struct kvp_pcache *pc, uint32_t slot);
void kvp__pcache_unmark_host(struct kvp_pcache *pc, uint32_t slot);
/* Promotes the host entry at slot to page (fresh from kvp_alloc_reserve: refcount 1, unkeyed):
 * the page takes the entry's identity (indexed, RESTORING, its priority and retention raised
 * to priority/retention_ms) and an allocator pin; the slot is busy (the restore's source).
 * Writes the move to *out. */
void kvp__pcache_promote(struct kvp_pcache *pc, uint32_t slot, uint32_t page, uint32_t priority,
                         uint32_t retention_ms, kvp_pcache_move_t *out);

/* ---- the cache's own files (kvp_pcache.c, _index.c, _evict.c, _tier.c, _pin.c, _audit.c,
 * _events.c) ---- */

/*
 * Entry slots. Every field of a cache entry (key, scope, hash link, list links, priority,
 * retention, release stamp, heap position, flags) lives in arrays indexed by an entry slot:
 * slot p < np is GPU page p, slot np + j is host slot j (kvp_loc_t {KVP_MEDIUM_HOST, j}).
 * Moving an entry between tiers (kvp_pcache_demote_end, promotion) moves its fields from one
 * slot to another; the hash chains, the eviction lists, the retention heap and the audit work
 * on slots whatever the medium. Fields only a GPU page has (its generation, pin references)
 * stay indexed by page id; fields only a host slot has (the page of its move, whether it is
 * free) by host slot.
 *
 * A host slot is in exactly one state: free (its bit in hfree set; only below the limit),
 * an entry (flags KEYED | INDEXED; only below the limit), busy (flags KVP_SLOT_BUSY, plus
 * KVP__PC_RESTORE_SRC for a restore's source; hpage[j] is the page of the move), or unused
 * (flags 0, bit clear: at or above the limit). A move pairs a slot with a GPU page both ways:
 * the slot's hpage names the page, and the page, while DEMOTING or RESTORING (when it is in no
 * eviction list), names the slot in its prev link (kvp__pc_move_slot). A demotion cancelled by
 * a link leaves the slot busy and naming the page, while the page no longer names it: the end
 * call tells the two apart by that, and by the generation.
 *
 * Why no entry table of its own (entry ids, a location per entry, a page -> entry map): an
 * entry lives in exactly one place at a time (in flight it is still its GPU page's), so its
 * location already names it uniquely and the slot is the entry. A separate table would add an
 * indirection to every find (the reuse path's budget is a few ns a token) and at least 8 bytes
 * a page to a cache that must stay under 64 (it is at 60). It becomes needed when one key must
 * have two places at once (an inclusive host copy kept after promotion): it can be added
 * behind kvp_loc_t then, since no caller sees slots. kvp__pc_slot / kvp__pc_loc are the one
 * indirection point.
 */
#define KVP__PC_NIL      UINT32_MAX
#define KVP__PC_NPRIO    (KVP_PCACHE_MAX_PRIORITY + 1)
#define KVP__PC_MAX_PINS 65535u /* pin references per page are 16 bits */
/* A page's release stamp is its release time in ms shifted left by STAMP_BITS, plus a counter
 * of releases: ordering by stamp is ordering by release, even within one ms (where a
 * sequence's pages are released deepest first), with no more memory per page. */
#define KVP__PC_STAMP_BITS 20u
/* Internal flag bits beside the public KVP_PAGE_* / KVP_SLOT_BUSY (kvp_pcache_loc_state masks
 * them out): a busy host slot that a restore reads (without it, a demotion writes it), and the
 * planner's scratch mark on a host entry. */
#define KVP__PC_RESTORE_SRC 64u
#define KVP__PC_MARK        128u
#define KVP__PC_PUBLIC_FLAGS                                                                       \
    (KVP_PAGE_KEYED | KVP_PAGE_INDEXED | KVP_PAGE_CACHED | KVP_PAGE_DEMOTING |                     \
     KVP_PAGE_RESTORING | KVP_SLOT_BUSY)

typedef struct {
    uint64_t id; /* 0: a free record */
    uint64_t expires_ms;
    uint32_t ns, scope, num_pages;
    uint32_t *pages;
} kvp__pc_pin_t;

/* One medium's eviction order: a list per retention priority, a bitmap of the non-empty ones. */
typedef struct {
    uint32_t head[KVP__PC_NPRIO], tail[KVP__PC_NPRIO];
    uint64_t nonempty[2];
} kvp__pc_order_t;

struct kvp_pcache {
    kvp_seqtab_t *t;
    kvp_alloc_t *a;
    uint32_t np, ps, max_scopes, max_pins, max_ns;
    uint32_t nhost;  /* host slots: entry slots np..np+nhost-1 */
    uint32_t hlimit; /* host slots [0, hlimit) are usable (kvp_pcache_set_host_limit) */
    uint64_t now;
    /* per entry slot [np + nhost] */
    kvp_pagekey_t *key;
    uint32_t *scope, *hnext, *prev, *next, *ret, *hpos;
    uint64_t *rel; /* when it was cached: ms << STAMP_BITS | a release counter (release order) */
    uint8_t *flags, *prio;
    /* per GPU page [np] */
    uint32_t *gen;
    uint16_t *pinrefs;
    /* per host slot [nhost]: the page of a busy slot's move; the free set, one bit a slot */
    uint32_t *hpage;
    uint64_t *hfree;
    uint32_t hfree_lo; /* no free bit in the words below it */
    /* index */
    uint32_t *bucket, bmask;
    /* eviction order of each medium */
    kvp__pc_order_t ord[KVP_MEDIUMS];
    /* cached GPU pages and host entries with a retention duration */
    uint32_t *heap, heap_n;
    uint64_t release_seq;
    /* pins */
    kvp__pc_pin_t *pins;
    uint32_t *pin_free, num_pin_free;
    uint64_t pin_seq;
    uint64_t *ns_quota; /* pinned-page quotas; what pins hold is the table's ns pinned_pages */
    uint32_t *ns_pins;
    kvp_pcache_scope_stats_t *sc;
    kvp_pcache_stats_t st;
    /* events (kvp_pcache_events.c): the observer, NULL when none (a flush of every scope parks
     * it in obs_held to mute its REMOVED events); with keep_tokens, per entry slot [np + nhost],
     * the page's token ids (ps each), its parent's key and whether it has one (NULL without) */
    kvp_pcache_observer_t obs, obs_held;
    void *obs_ctx;
    int32_t *tok;
    kvp_pagekey_t *parent;
    uint8_t *has_parent;
};

/* The entry slot of a location, or KVP__PC_NIL when the cache has no such slot. */
static inline uint32_t kvp__pc_slot(const struct kvp_pcache *c, kvp_loc_t l)
{
    if (l.medium == KVP_MEDIUM_GPU)
        return l.index < c->np ? l.index : KVP__PC_NIL;
    if (l.medium == KVP_MEDIUM_HOST)
        return l.index < c->nhost ? c->np + l.index : KVP__PC_NIL;
    return KVP__PC_NIL;
}

static inline kvp_loc_t kvp__pc_loc(const struct kvp_pcache *c, uint32_t slot)
{
    return slot < c->np ? kvp_loc(KVP_MEDIUM_GPU, slot) : kvp_loc(KVP_MEDIUM_HOST, slot - c->np);
}

static inline uint32_t kvp__pc_medium(const struct kvp_pcache *c, uint32_t slot)
{
    return slot < c->np ? KVP_MEDIUM_GPU : KVP_MEDIUM_HOST;
}

static inline uint32_t kvp__pc_bucket(const struct kvp_pcache *c, uint32_t scope, kvp_pagekey_t k)
{
    /* the key is already a good hash; the scope only has to move it */
    return (uint32_t)(k.lo ^ ((uint64_t)scope * 0x9e3779b97f4a7c15ull)) & c->bmask;
}

/* The host slot a DEMOTING or RESTORING page's move uses (such a page is in no eviction list,
 * so its prev link holds it). */
static inline uint32_t kvp__pc_move_slot(const struct kvp_pcache *c, uint32_t page)
{
    return c->prev[page];
}

static inline uint64_t kvp__pc_released_ms(const struct kvp_pcache *c, uint32_t p)
{
    return c->rel[p] >> KVP__PC_STAMP_BITS;
}

static inline uint64_t kvp__pc_expiry(const struct kvp_pcache *c, uint32_t p)
{
    return kvp__pc_released_ms(c, p) + c->ret[p];
}

/* The retention heap's order: by expiry, then release order, so pages whose retention ends
 * together fall back to the default priority in the order they were released and a chain's
 * deepest page stays first in line. */
static inline int kvp__pc_heap_less(const struct kvp_pcache *c, uint32_t a, uint32_t b)
{
    uint64_t ea = kvp__pc_expiry(c, a), eb = kvp__pc_expiry(c, b);
    return ea < eb || (ea == eb && c->rel[a] < c->rel[b]);
}

/* key table (kvp_pcache_index.c; kvp__pcache_find_slot above) */
/* Slot s (keyed) enters / leaves the table; counted in its medium's stats. */
void kvp__pcache_index_insert(struct kvp_pcache *c, uint32_t s);
void kvp__pcache_index_remove(struct kvp_pcache *c, uint32_t s);
/* The findable leading GPU pages of tokens: their ids into pages[] (when not NULL, room for
 * num_tokens / page_size), their count returned. */
uint32_t kvp__pcache_walk(const struct kvp_pcache *c, uint32_t scope, kvp_pagekey_t key,
                          const int32_t *tokens, uint64_t num_tokens, uint32_t *pages);

/* eviction order (kvp_pcache_evict.c) */
/* Slot s enters its medium's list of its priority at the tail / leaves it. */
void kvp__pcache_list_push(struct kvp_pcache *c, uint32_t s);
void kvp__pcache_list_remove(struct kvp_pcache *c, uint32_t s);
/* Slot s enters / leaves the retention heap. */
void kvp__pcache_heap_push(struct kvp_pcache *c, uint32_t s);
void kvp__pcache_heap_remove(struct kvp_pcache *c, uint32_t s);
/* Cached GPU pages and host entries whose retention ended count as the default priority from
 * now on. */
void kvp__pcache_expire_retention(struct kvp_pcache *c);
/* A cached page leaves its list (linked, pinned, demoted or dropped). */
void kvp__pcache_uncache(struct kvp_pcache *c, uint32_t page);
/* A reference on an indexed GPU page; a cached one comes back out of its list, a demoting one's
 * demotion is cancelled. */
void kvp__pcache_take_ref(struct kvp_pcache *c, uint32_t page);
/* (priority, retention) of slot s rises to (prio, ret) when those are stronger. */
void kvp__pcache_raise_retention(struct kvp_pcache *c, uint32_t s, uint32_t prio, uint32_t ret);

/* the host tier (kvp_pcache_tier.c) */
/* The host entry at slot s leaves the cache (out of its list, the heap and the table); its
 * slot is left with flags 0 for the caller to free, reuse or retire. */
void kvp__pcache_drop_host(struct kvp_pcache *c, uint32_t s);
/* Host slot j (flags 0) becomes free when below the limit, else stays unused. */
void kvp__pcache_host_release(struct kvp_pcache *c, uint32_t j);
/* Flush's part: drops the demoting pages of scope (KVP_PCACHE_NO_SCOPE: all) to the free
 * stack. Returns how many. */
uint32_t kvp__pcache_flush_demoting(struct kvp_pcache *c, uint32_t scope);

/* events (kvp_pcache_events.c) */
/* Tells the observer (there must be one) that slot s entered (KVP_PCEV_STORED) or left
 * (KVP_PCEV_REMOVED) the key table. */
void kvp__pcache_emit(struct kvp_pcache *c, uint32_t kind, uint32_t s);
/* What the key table calls once its change is complete: without an observer one branch. */
static inline void kvp__pcache_event(struct kvp_pcache *c, uint32_t kind, uint32_t s)
{
    if (c->obs)
        kvp__pcache_emit(c, kind, s);
}
/* An entry moves from slot src to slot dst: dst takes src's tokens, parent and has_parent
 * (keep_tokens; else nothing). Called before dst enters the table, so its STORED event has
 * them. */
void kvp__pcache_aux_copy(struct kvp_pcache *c, uint32_t dst, uint32_t src);
/* A flush of every scope with an observer: begin tells CLEARED and mutes the observer (no
 * REMOVED per entry); end unmutes it and tells STORED for each entry still findable. */
void kvp__pcache_clear_begin(struct kvp_pcache *c);
void kvp__pcache_clear_end(struct kvp_pcache *c);

/* pins (kvp_pcache_pin.c) */
/* Drops pin record idx: its references go, its namespace's counts shrink. */
void kvp__pcache_drop_pin(struct kvp_pcache *c, uint32_t idx);

#endif
