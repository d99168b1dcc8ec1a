/*
 * kvp_plan.h - the batch planner: turns a batch of (sequence, tokens to append) into pages and
 * a FlashInfer page table, all-or-nothing.
 *
 * kvp_plan_append allocates every page the batch needs (new pages and copy-on-write copies),
 * grows the sequences, and fills a kvp_plan_t with the batch's CSR page table (kv_indptr,
 * kv_indices, kv_last_page_len, laid out exactly as FlashInfer's plan() and
 * append_paged_kv_cache take them), append_indptr, and the page copies a backend must run
 * BEFORE the append. If anything would fail (pool exhausted, limit, quota, duplicate sequence,
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

#include "kvp_seqtab.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    uint32_t ns;
    uint64_t seq_id;
    uint32_t num_tokens; /* tokens to append (ignored by kvp_plan_page_table) */
} kvp_plan_item_t;

/* Same layout as kernels' kvp_page_copy_t: K and V of page src go to page dst in every layer. */
typedef struct {
    uint32_t src;
    uint32_t dst;
} kvp_plan_copy_t;

typedef struct {
    uint32_t batch_size;
    uint32_t nnz;              /* append_indptr[batch_size] */
    uint32_t num_copies;       /* copy-on-write copies to run before the append */
    uint32_t num_new_pages;    /* pages this plan took from the free stack */
    int32_t *kv_indptr;        /* [batch_size + 1] */
    int32_t *kv_indices;       /* [kv_indptr[batch_size]] */
    int32_t *kv_last_page_len; /* [batch_size]; 0 for an empty sequence */
    int32_t *append_indptr;    /* [batch_size + 1] */
    int32_t *seq_lens;         /* [batch_size], lengths after the append */
    kvp_plan_copy_t *copies;   /* [num_copies] */
    uint32_t fail_index;       /* on error: the batch item that caused it (or batch_size) */
    /* private: capacities and scratch */
    uint32_t cap_batch, cap_indices, cap_copies, cap_new;
    uint32_t *new_pages;
    kvp_seq_t **seqs;
    uint32_t *tail_page; /* [batch]: the partial last page an item appends into, or UINT32_MAX */
    uint8_t *created;
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
 * The current page table of existing sequences (no allocation, no change): kv_indptr,
 * kv_indices, kv_last_page_len, seq_lens; append_indptr is all zeros, no copies. Returns 0,
 * KVP_ENOENT (p->fail_index names the missing one), KVP_EINVAL, KVP_ELIMIT or KVP_ENOMEM.
 */
int kvp_plan_page_table(const kvp_seqtab_t *t, const kvp_plan_item_t *items, uint32_t n,
                        const kvp_plan_limits_t *limits, kvp_plan_t *p);

#ifdef __cplusplus
}
#endif
#endif
