/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_seqtab.h - the sequence table: (namespace, seq_id) -> length in tokens + page vector.
 *
 * Sequences grow through the batch planner (kvp_plan.h), which is the only way pages are
 * added; this module forks (the child shares the parent's pages, refcount + 1), truncates
 * (speculative-decoding rollback: drops tokens, frees pages no longer needed) and releases.
 * It keeps O(1) statistics, per-namespace counters and quotas, and an audit that recomputes
 * every invariant of DESIGN.md §3 from scratch and compares.
 *
 * Namespaces are small integers (0..max_namespaces-1) handed out by the caller (the server
 * maps names to ids). Times are caller-supplied milliseconds: the core never reads a clock.
 * Not thread-safe: one owner thread (the daemon's loop). Borrows the allocator, which must
 * outlive the table.
 */
#ifndef KVP_SEQTAB_H
#define KVP_SEQTAB_H

#include <stdint.h>

#include "kvp_alloc.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_seqtab kvp_seqtab_t;
struct kvp_chain; /* kvp_pcache_internal.h */

/* One sequence. Owned by the table; pointers stay valid until the sequence is released or the
 * table is destroyed (records never move). Read-only for callers. */
typedef struct {
    uint32_t ns;
    uint64_t id;
    uint32_t num_tokens;
    uint32_t num_pages; /* == ceil(num_tokens / page_size) */
    uint32_t cap_pages;
    uint32_t *pages; /* [num_pages], physical page ids in sequence order */
    uint64_t last_touch_ms;
    uint64_t mark;           /* planner scratch: batch epoch that last saw this sequence */
    struct kvp_chain *chain; /* prefix cache: content keys of its pages; NULL without token ids */
} kvp_seq_t;

typedef struct {
    uint32_t max_seqs;       /* sequences the table can hold (>= 1) */
    uint32_t max_namespaces; /* namespace ids are 0..max_namespaces-1 (>= 1) */
    uint32_t max_seq_tokens; /* tokens per sequence; 0 = the pool's capacity (<= INT32_MAX) */
} kvp_seqtab_config_t;

/* Counters of the whole table, O(1) to read. */
typedef struct {
    uint32_t num_pages;    /* pool capacity */
    uint32_t free_pages;   /* refcount 0, on the free stack */
    uint32_t used_pages;   /* neither free nor cached nor demoting */
    uint32_t cached_pages; /* refcount 0, kept by the prefix cache (kvp_pcache.h) */
    uint32_t demoting;     /* refcount 0, their copy to the host tier in flight (kvp_pcache.h) */
    uint32_t shared_pages; /* refcount >= 2 */
    uint32_t num_seqs;
    uint64_t num_tokens; /* sum of sequence lengths */
    uint64_t page_refs;  /* sum of page-vector lengths (a shared page counts once per holder) */
} kvp_stats_t;

/* Per-namespace counters and limits. A limit of 0 means unlimited. */
typedef struct {
    uint32_t num_seqs;
    uint64_t num_tokens;
    uint64_t page_refs;
    uint64_t pinned_pages; /* its prefix-cache pins' page references (kvp_pcache_pin) */
    uint32_t max_seqs;
    uint64_t max_page_refs; /* over page_refs + pinned_pages: pins count against the quota */
} kvp_ns_stats_t;

/* Creates an empty table over `alloc` for pages of `page_size` tokens. Returns 0, KVP_EINVAL
 * (NULL, zero sizes) or KVP_ENOMEM. Caller frees with kvp_seqtab_destroy. */
int kvp_seqtab_create(kvp_alloc_t *alloc, uint32_t page_size, const kvp_seqtab_config_t *cfg,
                      kvp_seqtab_t **out);

/* Releases every sequence's pages back to the allocator and frees the table. NULL: no-op. */
void kvp_seqtab_destroy(kvp_seqtab_t *t);

/* The sequence, or NULL. */
kvp_seq_t *kvp_seqtab_find(const kvp_seqtab_t *t, uint32_t ns, uint64_t id);

/* Creates `child` sharing every page of `parent` (same namespace): refcounts + 1, same length.
 * Returns 0; KVP_ENOENT (no parent), KVP_EEXIST (child exists), KVP_ELIMIT (table or namespace
 * sequence limit, or namespace page quota), KVP_ENOMEM, KVP_EINVAL (bad ns). On error nothing
 * changed. */
int kvp_seqtab_fork(kvp_seqtab_t *t, uint32_t ns, uint64_t parent, uint64_t child, uint64_t now_ms);

/* Shrinks a sequence to `num_tokens` (<= its length), freeing pages no longer needed. A kept,
 * partially filled, shared last page stays shared: the next append copies it (copy-on-write).
 * Returns 0, KVP_ENOENT, KVP_ERANGE (longer than the sequence) or KVP_EINVAL. */
int kvp_seqtab_truncate(kvp_seqtab_t *t, uint32_t ns, uint64_t id, uint32_t num_tokens,
                        uint64_t now_ms);

/* Drops a sequence and its page references, its last page first (a prefix cache then keeps
 * the deepest page of a chain first in line for eviction). Returns 0 or KVP_ENOENT. */
int kvp_seqtab_release(kvp_seqtab_t *t, uint32_t ns, uint64_t id);

/* Drops every sequence of a namespace (lease expiry). Returns the number released. */
uint32_t kvp_seqtab_release_ns(kvp_seqtab_t *t, uint32_t ns);

/* Iteration in unspecified order: start with *cursor = 0; returns NULL at the end. Only
 * valid while the table is not modified. */
kvp_seq_t *kvp_seqtab_next(const kvp_seqtab_t *t, uint32_t *cursor);

void kvp_seqtab_stats(const kvp_seqtab_t *t, kvp_stats_t *out);

/* Per-namespace counters; KVP_EINVAL for a bad ns. */
int kvp_seqtab_ns_stats(const kvp_seqtab_t *t, uint32_t ns, kvp_ns_stats_t *out);

/* Tenant groups: namespaces that share a sequence quota (the daemon groups the namespaces of
 * one uid: limits.uid_max_seqs). Group ids are 0..max_namespaces-1; every namespace starts in
 * the group of its own id. set_ns_group moves a namespace (and the count of its live
 * sequences) to another group; set_group_limit sets a group's quota (0 = none; lowering it
 * below current use only refuses growth). A sequence is created only when its namespace's
 * and its group's quotas both allow it (else KVP_ELIMIT, nothing changed). Return 0 or
 * KVP_EINVAL for a bad id. */
int kvp_seqtab_set_ns_group(kvp_seqtab_t *t, uint32_t ns, uint32_t group);
int kvp_seqtab_set_group_limit(kvp_seqtab_t *t, uint32_t group, uint32_t max_seqs);
/* Live sequences of a group (0 for a bad id). */
uint32_t kvp_seqtab_group_seqs(const kvp_seqtab_t *t, uint32_t group);

/* Sets a namespace's quotas (0 = unlimited). Lowering a quota below current use is allowed:
 * it only refuses further growth. Returns 0 or KVP_EINVAL. */
int kvp_seqtab_set_ns_limits(kvp_seqtab_t *t, uint32_t ns, uint32_t max_seqs,
                             uint64_t max_page_refs);

uint32_t kvp_seqtab_page_size(const kvp_seqtab_t *t);
uint32_t kvp_seqtab_max_seq_tokens(const kvp_seqtab_t *t);
kvp_alloc_t *kvp_seqtab_alloc(const kvp_seqtab_t *t);

/* Checks every invariant of DESIGN.md §3 from scratch: the allocator's own (free stack,
 * refcount-0 pages), each sequence's page count against its length, last_page_len in
 * 1..page_size, page ids in range and allocated, no page twice in one sequence, each page's
 * refcount equal to the number of page-vector entries naming it (plus the prefix cache's pin
 * references), the hash index finding every
 * record, and every counter (table and namespaces) equal to its recomputed value. Returns 0,
 * KVP_EAUDIT with the first violation in msg, or KVP_ENOMEM. O(pages + page refs). */
int kvp_seqtab_audit(const kvp_seqtab_t *t, char *msg, unsigned msg_len);

#ifdef __cplusplus
}
#endif
#endif
