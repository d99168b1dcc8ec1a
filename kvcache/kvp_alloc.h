/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_alloc.h - the page allocator: page ids 0..num_pages-1, a free stack, a refcount per page.
 *
 * Allocation pops the free stack and freeing pushes it, so both are O(1); a batch reservation
 * is all-or-nothing (it gets every page it asks for or changes nothing). A page is free
 * exactly when its refcount is 0. Sharing (fork, copy-on-write) raises the refcount; the
 * allocator counts pages whose refcount is above 1 ("shared") so stats are O(1).
 *
 * Not thread-safe: the daemon owns one allocator on its event-loop thread (as memcached's
 * do_slabs_alloc is called under the caller's lock). No allocation after create.
 */
#ifndef KVP_ALLOC_H
#define KVP_ALLOC_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_alloc kvp_alloc_t;

/* Creates an allocator with every page free, page ids handed out in increasing order first.
 * Returns 0, KVP_EINVAL (num_pages 0 or above 2^31-1) or KVP_ENOMEM. Caller frees with
 * kvp_alloc_destroy. */
int kvp_alloc_create(uint32_t num_pages, kvp_alloc_t **out);

/* Frees the allocator; NULL is a no-op. */
void kvp_alloc_destroy(kvp_alloc_t *a);

/* All-or-nothing: takes n free pages, writes their ids to pages[0..n), sets each refcount to
 * 1. With a prefix cache attached (kvp_pcache.h) the free stack goes first, then cached pages
 * are evicted in the cache's order. Returns 0, or KVP_ENOSPC (fewer than n free and cached;
 * nothing changed). n = 0 returns 0. */
int kvp_alloc_reserve(kvp_alloc_t *a, uint32_t n, uint32_t *pages);

/* Adds a reference to an allocated page (refcount >= 1, asserted). */
void kvp_alloc_ref(kvp_alloc_t *a, uint32_t page);

/* Drops a reference; the page returns to the free stack when its refcount reaches 0.
 * Returns the new refcount. The page must be allocated (asserted). */
uint32_t kvp_alloc_unref(kvp_alloc_t *a, uint32_t page);

/* Pins hold a page's memory while a backend reads or writes it off the owner thread (an append
 * or copy in flight): a page whose refcount drops to 0 while pinned goes back to the free
 * stack only when its last pin is dropped, so it can never be handed to another sequence
 * while a copy still touches it. Pins do not count as references (copy-on-write ignores
 * them). kvp_alloc_pin needs an allocated page (refcount >= 1, asserted). */
void kvp_alloc_pin(kvp_alloc_t *a, uint32_t page);
void kvp_alloc_unpin(kvp_alloc_t *a, uint32_t page);
uint32_t kvp_alloc_pins(const kvp_alloc_t *a, uint32_t page);
/* pages with refcount 0 waiting for their last pin */
uint32_t kvp_alloc_num_pinned_free(const kvp_alloc_t *a);

uint32_t kvp_alloc_refcount(const kvp_alloc_t *a, uint32_t page);
/* Internal (kvcache/ only): the refcount array itself, [num_pages], read-only and valid until
 * kvp_alloc_destroy, so the batch planner reads the refcounts of a batch's pages in place
 * instead of one call per page. Callers index it only with allocated page ids. */
const uint32_t *kvp__alloc_refcounts(const kvp_alloc_t *a);
uint32_t kvp_alloc_num_pages(const kvp_alloc_t *a);
uint32_t kvp_alloc_num_free(const kvp_alloc_t *a);
/* pages the prefix cache keeps at refcount 0 (evictable), 0 without a cache */
uint32_t kvp_alloc_num_cached(const kvp_alloc_t *a);
/* pages the prefix cache is demoting to its host tier (refcount 0, neither free nor cached:
 * not handed out until the demotion ends), 0 without a cache */
uint32_t kvp_alloc_num_demoting(const kvp_alloc_t *a);
/* free + cached: what kvp_alloc_reserve can hand out (demoting pages are not) */
uint32_t kvp_alloc_num_available(const kvp_alloc_t *a);
/* pages with refcount > 1 */
uint32_t kvp_alloc_num_shared(const kvp_alloc_t *a);

/* The free stack, bottom first (read-only view for the audit): *n receives its depth. */
const uint32_t *kvp_alloc_free_stack(const kvp_alloc_t *a, uint32_t *n);

/* Checks the allocator's own invariants: every free-stack entry is a distinct page with
 * refcount 0 and no pin, every unpinned page with refcount 0 is exactly one of on the stack,
 * cached or demoting, the cached, demoting, shared and pinned-free counters are exact.
 * Returns 0 or KVP_EAUDIT with a one-line reason in msg. O(num_pages); uses a scratch bitmap
 * allocated here (KVP_ENOMEM if that fails). */
int kvp_alloc_audit(const kvp_alloc_t *a, char *msg, unsigned msg_len);

#ifdef __cplusplus
}
#endif
#endif
