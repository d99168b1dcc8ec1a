/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_plan.h - the batch planner: turns a batch of (sequence, tokens to append) into pages and
 * a FlashInfer page table, all-or-nothing.
 *
 * kvp_plan_append allocates every page the batch needs (new pages and copy-on-write copies),
 * grows the sequences, and fills a kvp_plan_t with the batch's CSR page table (kv_indptr,
 * kv_indices, kv_last_page_len, laid out exactly as FlashInfer's plan() and
 * append_paged_kv_cache take them), append_indptr, and the page copies a backend must run
 * BEFORE the append; kvp_plan_slots turns the table into each token's pool slot, the form the
 * append kernels read. If anything would fail (pool exhausted, limit, quota, duplicate sequence,
 * memory) it returns the error and the table, the allocator and the sequences are exactly as
 * before. The planner never touches pool memory: a backend executes the plan.
 *
 * A sequence named in an append batch that does not exist yet is created (empty) first; a
 * batch item with 0 tokens still gets its page-table row. Not thread-safe (the table's owner
 * thread). The plan's arrays are owned by the plan and reused across calls.
 */
#ifndef KVP_PLAN_H
#define KVP_PLAN_H

#include <stdint.h>

#include "kvp_pagekey.h"
#include "kvp_pcache.h"
#include "kvp_seqtab.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    uint32_t ns;
    uint64_t seq_id;
    uint32_t num_tokens; /* tokens to append (ignored by kvp_plan_page_table) */
} kvp_plan_item_t;

/* What the prefix cache (kvp_pcache.h) knows of a batch item, in an array parallel to the
 * items: the token ids of its num_tokens tokens (NULL: none; the sequence's chain then ends
 * unless it appends 0 tokens), and the salt of a sequence whose chain starts here (an empty
 * one: new, or with 0 tokens; ignored otherwise). Borrowed for the call. */
typedef struct {
    const int32_t *token_ids;
    const void *salt;
    uint32_t salt_len; /* <= KVP_PAGEKEY_MAX_SALT */
} kvp_plan_content_t;

/* How a batch uses the prefix cache (kvp_plan_append_cached); applies to items that start a
 * chain (empty sequence, token ids given). */
typedef struct {
    uint32_t scope;        /* the scope chains start in, and reuse looks in */
    uint8_t reuse;         /* link the longest findable full-page prefix first */
    uint8_t leave_last;    /* reuse leaves at least one token of the item to append */
    uint8_t priority;      /* retention priority of the new chains (kvp_pcache_set_retention) */
    uint8_t daemon_writes; /* the daemon's own copy writes the rows (Append), not a worker */
    uint32_t retention_ms; /* and its duration (0: no end) */
    uint8_t promote;       /* with reuse: continue the found prefix into the host tier, each
                              host entry restored into a fresh page (kvp_plan_t.restores) */
} kvp_plan_cache_t;

/* Same layout as kernels' kvp_page_copy_t: K and V of page src go to page dst in every layer. */
typedef struct {
    uint32_t src;
    uint32_t dst;
} kvp_plan_copy_t;

typedef struct {
    uint32_t batch_size;
    uint32_t nnz;                 /* append_indptr[batch_size] */
    uint32_t num_copies;          /* copy-on-write copies to run before the append */
    uint32_t num_new_pages;       /* pages this plan took from the free stack */
    int32_t *kv_indptr;           /* [batch_size + 1] */
    int32_t *kv_indices;          /* [kv_indptr[batch_size]] */
    int32_t *kv_last_page_len;    /* [batch_size]; 0 for an empty sequence */
    int32_t *append_indptr;       /* [batch_size + 1] */
    int32_t *seq_lens;            /* [batch_size], lengths after the append */
    kvp_plan_copy_t *copies;      /* [num_copies] */
    uint32_t *cached_tokens;      /* [batch_size]: tokens linked from the cache (reuse only) */
    uint64_t num_cached_tokens;   /* their sum */
    uint32_t *restored_tokens;    /* [batch_size], with content: of cached_tokens, those of pages
                                     found in the host tier (promote), restored by this plan */
    uint64_t num_restored_tokens; /* their sum */
    uint32_t num_restores;        /* restores this plan started (promote) */
    kvp_pcache_move_t *restores;  /* [num_restores]: {page, gen, host slot}: the caller copies
                                     each slot into its page, then kvp_pcache_restore_end */
    uint32_t num_evicted;         /* cached pages this plan evicted to get its pages */
    uint32_t *publish_from;       /* [batch_size], with content: the first page index of each item
                                     whose every row this plan's writer wrote or a daemon-run
                                     Append did (kvp_pcache_take_written); UINT32_MAX: none */
    uint32_t fail_index;          /* on error: the batch item that caused it (or batch_size) */
    /* private: capacities and scratch */
    uint32_t cap_batch, cap_indices, cap_copies, cap_new;
    uint32_t *new_pages;
    kvp_seq_t **seqs;
    uint32_t *tail_page; /* [batch]: the partial last page an item appends into, or UINT32_MAX */
    uint8_t *created;
    uint32_t cap_keys;
    kvp_pagekey_t *keys; /* scratch: keys of the pages a batch fills or links */
    uint32_t *key_off;   /* [batch]: each item's first entry in keys */
    uint32_t *linked;    /* [batch]: pages each item links from the cache */
    uint32_t cap_links, cap_restores;
    uint32_t *link_pages; /* scratch: the entry slots found (page, or a host entry's slot
                             numbered after the pages), item after item */
    void **chains;        /* [batch]: chain records made for items that start one */
} kvp_plan_t;

/* Zeroes a plan; it owns nothing yet. */
void kvp_plan_init(kvp_plan_t *p);

/* Frees the plan's arrays (the plan can be reused after kvp_plan_init). */
void kvp_plan_free(kvp_plan_t *p);

/* Limits a batch must respect; 0 = unlimited. */
typedef struct {
    uint32_t max_batch;  /* items per batch */
    uint32_t max_tokens; /* tokens per batch (nnz) */
} kvp_plan_limits_t;

/*
 * Plans an append of items[0..n) (see the file comment). Returns 0, or:
 *   KVP_EINVAL   n == 0, bad namespace;
 *   KVP_ELIMIT   batch or token limit, a sequence would exceed max_seq_tokens, the table or a
 *                namespace would exceed its sequence limit or its page quota;
 *   KVP_EDUPSEQ  a sequence appears twice;
 *   KVP_ENOSPC   not enough free pages (the pool is exhausted);
 *   KVP_ENOMEM   host memory.
 * On error p->fail_index names the item and nothing else changed.
 */
int kvp_plan_append(kvp_seqtab_t *t, const kvp_plan_item_t *items, uint32_t n,
                    const kvp_plan_limits_t *limits, uint64_t now_ms, kvp_plan_t *p);

/*
 * kvp_plan_append with the prefix cache (content NULL: no item has token ids; cache NULL:
 * scope 0, no reuse, default retention; without a cache attached to the table, kvp_pcache.h,
 * token ids are ignored). Items with token ids
 * key the pages they fill (findable only once published); an item that starts a chain takes
 * its salt, the scope, and with reuse first links the longest findable prefix of its tokens
 * (p->cached_tokens[i], a multiple of the page size; the item appends only the rest, and
 * append_indptr and nnz count only those). With promote too, that prefix continues through
 * pages found in the host tier: each such entry takes a fresh page (counted in what the batch
 * needs), indexed there at once as RESTORING and pinned until kvp_pcache_restore_end; its
 * {page, gen, slot} is in p->restores, and the page sits in the sequence like a linked one
 * (p->restored_tokens[i] counts it). An entry an earlier item of the batch promoted is linked.
 * Allocation takes free pages first, then evicts cached ones (never one this batch links).
 * Further errors: KVP_EINVAL for a salt above KVP_PAGEKEY_MAX_SALT or a bad scope.
 * All-or-nothing as kvp_plan_append (a failed plan starts no restore).
 */
int kvp_plan_append_cached(kvp_seqtab_t *t, const kvp_plan_item_t *items,
                           const kvp_plan_content_t *content, uint32_t n,
                           const kvp_plan_limits_t *limits, const kvp_plan_cache_t *cache,
                           uint64_t now_ms, kvp_plan_t *p);

/*
 * The current page table of existing sequences (no allocation, no change): kv_indptr,
 * kv_indices, kv_last_page_len, seq_lens; append_indptr is all zeros, no copies. Returns 0,
 * KVP_ENOENT (p->fail_index names the missing one), KVP_EINVAL, KVP_ELIMIT or KVP_ENOMEM.
 */
int kvp_plan_page_table(const kvp_seqtab_t *t, const kvp_plan_item_t *items, uint32_t n,
                        const kvp_plan_limits_t *limits, kvp_plan_t *p);

/*
 * Where every token of the plan's append goes, in the form the append kernels read
 * (kernels/kvp_kernels.h, KVP_APPEND_DEST_SLOTS): slots[i] = the pool slot, page id *
 * page_size + position % page_size, of token i (append_indptr's numbering), from the plan's
 * own page table: request b's j-th appended token is at position seq_lens[b] - append_len[b]
 * + j. page_size is the table's (kvp_seqtab_page_size); slots has room for p->nnz entries.
 * The geometry keeps num_pages * page_size within int32 (kvp_geom.h), so every slot fits.
 * Pure; the caller's thread.
 */
void kvp_plan_slots(const kvp_plan_t *p, uint32_t page_size, int32_t *slots);

#ifdef __cplusplus
}
#endif
#endif
