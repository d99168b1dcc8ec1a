/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_plan_internal.h - what the batch planner's two files share (kvcache/ only): kvp_plan.c
 * plans a batch in two phases (kvp_plan.h); kvp_plan_reuse.c is its prefix-cache reuse, the
 * phase-1 search of an item's findable prefix in one or both tiers and the phase-2 linking and
 * promotion of what was found. Nothing outside the planner includes this.
 */
#ifndef KVP_PLAN_INTERNAL_H
#define KVP_PLAN_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvp_pcache.h"
#include "kvp_plan.h"
#include "kvp_seqtab.h"

/* What phase 1 learned about an item's chain (bits 1-2 of kvp_plan_t.created): none,
 * continuing one, or starting one. */
enum { KVP__CH_NONE = 0, KVP__CH_CONT = 1, KVP__CH_START = 2 };

/* Grows *buf to hold `need` elements of `size` bytes; *cap tracks capacity. 0 or KVP_ENOMEM
 * (*buf unchanged). */
int kvp__plan_grow(void **buf, uint32_t *cap, uint32_t need, size_t size);

/* Phase 1 of item i, which starts a chain with reuse: its keys into p->keys from *nkeys, the
 * entry slots of its findable prefix (GPU pages; with cache->promote, host entries too, as
 * entry slots >= the pool's pages) into p->link_pages from *nlinks, their count in
 * p->linked[i]. Counts once per batch the cached pages it links (*linked_cached, marked in
 * dec[]) and the host entries it promotes (*promotions, marked on the slot). Returns 0 or
 * KVP_ENOMEM. */
int kvp__plan_find_prefix(kvp_pcache_t *pc, kvp_plan_t *p, uint32_t i, const kvp_plan_item_t *it,
                          const kvp_plan_content_t *ct, const kvp_plan_cache_t *cache, uint32_t ps,
                          uint32_t *dec, uint32_t *nkeys, uint32_t *nlinks, uint64_t *linked_cached,
                          uint64_t *promotions);

/* Clears the marks phase 1 left on the nlinks entries of p->link_pages. */
void kvp__plan_clean_links(kvp_pcache_t *pc, const kvp_plan_t *p, uint32_t nlinks, uint32_t *dec);

/* Phase 2 before allocation: starts the chain of every item that starts one and puts its found
 * prefix in its sequence, GPU pages linked first (for every item, so no later allocation evicts
 * one), then the host entries promoted, each into a page of its own (an entry an earlier item
 * promoted is linked), their moves in p->restores. Counts the queries. Cannot fail: phase 1
 * counted the pages. */
void kvp__plan_link_found(kvp_seqtab_t *t, kvp_pcache_t *pc, kvp_plan_t *p,
                          const kvp_plan_item_t *items, const kvp_plan_content_t *content,
                          uint32_t n, const kvp_plan_cache_t *cache, uint32_t ps);

#endif
