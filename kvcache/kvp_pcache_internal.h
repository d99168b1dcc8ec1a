/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pcache_internal.h - the prefix cache's hooks for the allocator, the sequence table and
 * the planner (kvcache/ only; see kvp_pcache.h for the model).
 *
 * The allocator asks the cache what to do with a page whose last reference went
 * (kvp__pcache_on_zero) and takes cached pages when its free stack is empty
 * (kvp__pcache_evict). The sequence table keeps a chain record per sequence with token ids and
 * lets the cache see truncates. The planner links found pages and feeds appended token ids.
 */
#ifndef KVP_PCACHE_INTERNAL_H
#define KVP_PCACHE_INTERNAL_H

#include <stdint.h>

#include "kvp_alloc.h"
#include "kvp_pagekey.h"
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
void kvp__alloc_revive(kvp_alloc_t *a, uint32_t page);    /* a cached page: refcount 0 -> 1 */

/* Refcount and pins of page reached 0: returns 1 when the cache keeps it (indexed: now
 * cached), 0 when it goes to the free stack (its key, if any, is dropped). */
int kvp__pcache_on_zero(struct kvp_pcache *pc, uint32_t page);
/* Takes the next cached page in eviction order out of the cache (refcount stays 0; the
 * caller hands it out). There must be one (kvp__pcache_num_cached > 0). */
uint32_t kvp__pcache_evict(struct kvp_pcache *pc);
uint32_t kvp__pcache_num_cached(const struct kvp_pcache *pc);
int kvp__pcache_is_cached(const struct kvp_pcache *pc, uint32_t page);

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
 * cached page leaves its eviction list). */
void kvp__pcache_link(struct kvp_pcache *pc, uint32_t page, uint32_t priority,
                      uint32_t retention_ms);
/* s appended tokens[0..n) (s->pages and s->num_tokens already updated): keys the pages they
 * filled. pre[0..npre), when the chain has no partial page, are the keys of the next full
 * pages already computed (phase 1 of a reuse); the rest is hashed here. */
void kvp__pcache_chain_append(struct kvp_pcache *pc, kvp_seq_t *s, const int32_t *tokens,
                              uint32_t n, const kvp_pagekey_t *pre, uint32_t npre);
/* Counts a query of q tokens that found h (reuse, lookups). */
void kvp__pcache_count_query(struct kvp_pcache *pc, uint32_t scope, uint64_t q, uint64_t h);
uint32_t kvp__pcache_max_scopes(const struct kvp_pcache *pc);

#endif
