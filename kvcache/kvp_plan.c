/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_plan.c - the batch planner (see kvp_plan.h).
 *
 * Two phases make a batch all-or-nothing. Phase 1 looks every sequence up (creating missing
 * ones empty, remembered so they can be removed again), rejects duplicates, counts the pages
 * the batch needs, checks limits and quotas, and grows every buffer that phase 2 writes into
 * (growing a buffer changes nothing visible). Any failure there rolls back the created
 * sequences. Phase 2 cannot fail: it takes the pages, runs the copy-on-write bookkeeping and
 * writes the page table.
 *
 * Copy-on-write count: when m sequences of the batch append into the same partially filled
 * page whose refcount is r, the first min(m, r - 1) of them (in batch order) copy it and the
 * last holder, if it is in the batch, writes in place. A keyed page (a truncate made it the
 * partial tail of a sequence while others held it, kvp_pcache.h) is copied by every holder but
 * the last, like any other; the last holder first takes its key away (it leaves the key table,
 * counted as a rewrite) and then writes in place. It used to copy it too and drop its own
 * reference in the plan, so the copy's source went to the cache or the free stack before the
 * copy ran: another Reserve could be handed it, and the daemon's Append aborted pinning it
 * (issue #26 defect 1). The last holder has no one to keep the source alive for a copy that a
 * worker runs later, so in place is the only safe choice. Phase 1 simulates exactly that with a
 * per-page scratch counter so the page count it checks is exact, not a bound.
 */
#include "kvp_plan.h"

#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_pcache.h"
#include "kvp_pcache_internal.h"
#include "kvp_plan_internal.h"
#include "kvp_seqtab_internal.h"

void kvp_plan_init(kvp_plan_t *p)
{
    memset(p, 0, sizeof(*p));
}

void kvp_plan_free(kvp_plan_t *p)
{
    free(p->kv_indptr);
    free(p->kv_indices);
    free(p->kv_last_page_len);
    free(p->append_indptr);
    free(p->seq_lens);
    free(p->copies);
    free(p->new_pages);
    free(p->seqs);
    free(p->tail_page);
    free(p->created);
    free(p->cached_tokens);
    free(p->keys);
    free(p->key_off);
    free(p->linked);
    free(p->link_pages);
    free(p->chains);
    free(p->publish_from);
    free(p->restored_tokens);
    free(p->restores);
    kvp_plan_init(p);
}

int kvp__plan_grow(void **buf, uint32_t *cap, uint32_t need, size_t size)
{
    if (need <= *cap && *buf)
        return 0;
    uint32_t c = *cap ? *cap : 16;
    while (c < need)
        c = c >= 0x80000000u ? need : c * 2;
    void *nb = realloc(*buf, (size_t)c * size);
    if (!nb)
        return KVP_ENOMEM;
    *buf = nb;
    *cap = c;
    return 0;
}

/* Batch-sized arrays; all share cap_batch so they are grown together. */
static int grow_batch(kvp_plan_t *p, uint32_t n)
{
    if (n + 1 <= p->cap_batch && p->kv_indptr)
        return 0;
    uint32_t c = p->cap_batch;
    void **bufs[] = {(void **)&p->kv_indptr,     (void **)&p->kv_last_page_len,
                     (void **)&p->append_indptr, (void **)&p->seq_lens,
                     (void **)&p->seqs,          (void **)&p->tail_page,
                     (void **)&p->cached_tokens, (void **)&p->key_off,
                     (void **)&p->linked,        (void **)&p->chains,
                     (void **)&p->publish_from,  (void **)&p->restored_tokens,
                     (void **)&p->created};
    size_t sizes[] = {4, 4, 4, 4, sizeof(kvp_seq_t *), 4, 4, 4, 4, sizeof(void *), 4, 4, 1};
    for (unsigned i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        uint32_t cc = c;
        if (kvp__plan_grow(bufs[i], &cc, n + 1, sizes[i]))
            return KVP_ENOMEM;
        if (i == sizeof(sizes) / sizeof(sizes[0]) - 1)
            p->cap_batch = cc;
    }
    return 0;
}

static int check_limits(const kvp_plan_limits_t *lim, const kvp_plan_item_t *items, uint32_t n,
                        uint32_t *fail_index, uint64_t *nnz_out)
{
    uint64_t nnz = 0;
    if (lim && lim->max_batch && n > lim->max_batch) {
        *fail_index = lim->max_batch;
        return KVP_ELIMIT;
    }
    for (uint32_t i = 0; i < n; i++) {
        nnz += items[i].num_tokens;
        if (nnz > 0x7fffffffull || (lim && lim->max_tokens && nnz > lim->max_tokens)) {
            *fail_index = i;
            return KVP_ELIMIT;
        }
    }
    *nnz_out = nnz;
    return 0;
}

/* Page arithmetic for the table's page size: shifts and masks when it is a power of two (1,
 * 16, 64: what engines use), divisions otherwise. The planner does several per sequence, and
 * a 64-bit division costs tens of cycles: it was the largest single cost of planning a
 * 256-sequence decode step. Same results either way. */
typedef struct {
    uint32_t size;
    uint32_t shift; /* log2(size) when pow2 */
    int pow2;
} page_math_t;

static page_math_t page_math(uint32_t page_size)
{
    page_math_t m = {page_size, 0, page_size && (page_size & (page_size - 1)) == 0};
    while (m.pow2 && (1u << m.shift) < page_size)
        m.shift++;
    return m;
}

/* ceil(tokens / page_size), as kvp_geom_pages_for */
static inline uint32_t pages_for(const page_math_t *m, uint64_t tokens)
{
    if (m->pow2)
        return (uint32_t)((tokens + m->size - 1) >> m->shift);
    return kvp_geom_pages_for(m->size, tokens);
}

/* tokens % page_size: 0 when the last page is full (or there is none) */
static inline uint32_t tail_of(const page_math_t *m, uint32_t tokens)
{
    return m->pow2 ? tokens & (m->size - 1) : tokens % m->size;
}

/* Writes row i of the CSR page table for s; *off is the running kv_indices offset. */
static inline void write_row(kvp_plan_t *p, uint32_t i, const kvp_seq_t *s, uint32_t page_size,
                             uint32_t *off)
{
    uint32_t np = s->num_pages;
    if (np == 1)
        p->kv_indices[*off] = (int32_t)s->pages[0]; /* a decode step's usual row */
    else if (np)
        memcpy(p->kv_indices + *off, s->pages, (size_t)np * sizeof(int32_t));
    *off += np;
    p->kv_indptr[i + 1] = (int32_t)*off;
    p->kv_last_page_len[i] = s->num_tokens ? (int32_t)(s->num_tokens - (np - 1) * page_size) : 0;
    p->seq_lens[i] = (int32_t)s->num_tokens;
}

/* plan->tail_page[i] of an item that writes into no partially filled page */
#define NO_PAGE UINT32_MAX

/* Lookahead of the batch's table lookups: the slot PREFETCH_SLOT items ahead, the record
 * PREFETCH_REC items ahead (its slot is in cache by then). Each key is hashed once, when its
 * slot is prefetched; the home slots wait in a ring of HOME_RING entries until the lookup. */
#define PREFETCH_SLOT 16
#define PREFETCH_REC  8
#define HOME_RING     32 /* a power of two above PREFETCH_SLOT */

typedef struct {
    const kvp_seqtab_t *t;
    const kvp_plan_item_t *items;
    uint32_t n;
    uint32_t home[HOME_RING];
} lookahead_t;

/* Hashes item i (if any), keeps its home slot and prefetches the slot. */
static inline void look_slot(lookahead_t *la, uint32_t i)
{
    if (i >= la->n)
        return;
    const kvp_plan_item_t *it = &la->items[i];
    uint32_t h = it->ns < la->t->max_namespaces ? kvp__seqtab_home(la->t, it->ns, it->seq_id) : 0;
    la->home[i % HOME_RING] = h;
    kvp__seqtab_prefetch_slot(la->t, h);
}

static inline void lookahead_start(lookahead_t *la, const kvp_seqtab_t *t,
                                   const kvp_plan_item_t *items, uint32_t n)
{
    la->t = t;
    la->items = items;
    la->n = n;
    for (uint32_t i = 0; i < PREFETCH_SLOT; i++)
        look_slot(la, i);
    for (uint32_t i = 0; i < PREFETCH_REC && i < n; i++)
        kvp__seqtab_prefetch_rec(t, la->home[i % HOME_RING]);
}

/* Before item i is looked up: prefetches ahead and returns item i's home slot (item i's
 * namespace must have been checked to be in range). */
static inline uint32_t lookahead_next(lookahead_t *la, uint32_t i)
{
    look_slot(la, i + PREFETCH_SLOT);
    if (i + PREFETCH_REC < la->n)
        kvp__seqtab_prefetch_rec(la->t, la->home[(i + PREFETCH_REC) % HOME_RING]);
    return la->home[i % HOME_RING];
}

static void rollback_created(kvp_seqtab_t *t, kvp_plan_t *p, uint32_t upto)
{
    for (uint32_t i = 0; i < upto; i++)
        if (p->created[i] & 1) /* bit 0; bits 1-2 hold the item's chain state */
            kvp__seqtab_remove_empty(t, p->seqs[i]);
}

/* with_content is a constant at each call: kvp_plan_append's copy (a decode step: no token
 * ids) keeps none of the content branches. */
static inline __attribute__((always_inline)) int
plan_append(kvp_seqtab_t *t, const kvp_plan_item_t *items, const kvp_plan_content_t *content,
            uint32_t n, const kvp_plan_limits_t *limits, const kvp_plan_cache_t *cache,
            uint64_t now_ms, kvp_plan_t *p, const int with_content)
{
    if (!with_content)
        content = NULL;
    p->fail_index = n;
    if (!t || !p || (n && !items) || n == 0)
        return KVP_EINVAL;
    p->num_restores = 0;
    p->num_restored_tokens = 0;
    uint64_t nnz;
    int rc = check_limits(limits, items, n, &p->fail_index, &nnz);
    if (rc)
        return rc;
    if (grow_batch(p, n))
        return KVP_ENOMEM;

    const uint32_t ps = kvp_seqtab_page_size(t);
    const page_math_t pm = page_math(ps);
    const uint32_t max_tokens = kvp_seqtab_max_seq_tokens(t);
    const uint32_t max_ns = kvp__seqtab_max_namespaces(t);
    kvp_alloc_t *a = kvp_seqtab_alloc(t);
    kvp_pcache_t *pc = kvp_seqtab_pcache(t);
    static const kvp_plan_cache_t no_cache = {.priority = KVP_PCACHE_DEFAULT_PRIORITY};
    if (!cache)
        cache = &no_cache;
    if (!pc)
        content = NULL; /* nothing to key with */
    if (content &&
        (cache->scope >= kvp__pcache_max_scopes(pc) || cache->priority > KVP_PCACHE_MAX_PRIORITY))
        return KVP_EINVAL;
    const uint32_t *refcount = kvp__alloc_refcounts(a); /* in place: pages of sequences */
    uint32_t *dec = kvp__seqtab_page_scratch(t);
    uint64_t *ns_refs = kvp__seqtab_ns_scratch(t);
    const uint64_t epoch = kvp__seqtab_epoch(t);
    uint64_t need = 0, copies = 0, total_pages = 0, linked_cached = 0, promotions = 0;
    uint32_t nkeys = 0, nlinks = 0;
    uint32_t seen = 0;    /* items whose p->seqs[] entry is valid (for cleanup) */
    uint32_t fail_at = n; /* the offending item, n for the batch as a whole */
    uint32_t i;
    lookahead_t la;
    uint8_t *chk = p->created; /* bits 1-2 of created[]: CH_* of the item */

    /* ---- phase 1: look up, count, check, grow; undoable ---- */
    lookahead_start(&la, t, items, n);
    for (i = 0; i < n && !rc; i++) {
        const kvp_plan_item_t *it = &items[i];
        uint32_t home = lookahead_next(&la, i);
        fail_at = i;
        if (it->ns >= max_ns) {
            rc = KVP_EINVAL;
            break;
        }
        kvp_seq_t *s = kvp__seqtab_find_at(t, it->ns, it->seq_id, home);
        p->created[i] = 0;
        if (content)
            p->chains[i] = NULL;
        if (!s) {
            rc = kvp__seqtab_insert(t, it->ns, it->seq_id, home, now_ms, &s);
            if (rc)
                break;
            p->created[i] = 1;
        } else if (s->mark == epoch) {
            rc = KVP_EDUPSEQ;
            break;
        }
        s->mark = epoch;
        p->seqs[i] = s;
        p->tail_page[i] = NO_PAGE;
        seen = i + 1;
        uint64_t len = (uint64_t)s->num_tokens + it->num_tokens;
        if (len > max_tokens) {
            rc = KVP_ELIMIT;
            break;
        }
        uint32_t linked = 0;
        if (content) {
            const kvp_plan_content_t *ct = &content[i];
            p->linked[i] = 0;
            if (ct->token_ids && it->num_tokens && s->num_tokens == 0) {
                if (ct->salt_len > KVP_PAGEKEY_MAX_SALT || (ct->salt_len && !ct->salt)) {
                    rc = KVP_EINVAL;
                    break;
                }
                chk[i] |= KVP__CH_START << 1;
                if (!s->chain && !(p->chains[i] = kvp__pcache_chain_new(pc))) {
                    rc = KVP_ENOMEM;
                    break;
                }
                if (cache->reuse &&
                    (rc = kvp__plan_find_prefix(pc, p, i, it, ct, cache, ps, dec, &nkeys, &nlinks,
                                                &linked_cached, &promotions)))
                    break;
                linked = p->linked[i];
            } else if (ct->token_ids && s->chain && s->chain->tracked) {
                chk[i] |= KVP__CH_CONT << 1;
            }
        }
        uint32_t pages_after = pages_for(&pm, len);
        uint32_t fresh = pages_after - s->num_pages - linked;
        uint32_t cow = 0;
        if (it->num_tokens && tail_of(&pm, s->num_tokens)) {
            uint32_t last = s->pages[s->num_pages - 1];
            p->tail_page[i] = last; /* for the cleanup and phase 2: no second look-up */
            if (refcount[last] - dec[last] > 1) {
                cow = 1;
                dec[last]++;
            }
        }
        need += fresh + cow;
        copies += cow;
        total_pages += pages_after;
        ns_refs[it->ns] += fresh + linked;
        const kvp_ns_stats_t *nst = kvp__seqtab_ns(t, it->ns);
        if (nst->max_page_refs &&
            nst->page_refs + nst->pinned_pages + ns_refs[it->ns] > nst->max_page_refs)
            rc = KVP_ELIMIT;
        else if (pages_after > s->cap_pages && kvp__seq_reserve(s, pages_after))
            rc = KVP_ENOMEM;
    }
    /* clean the scratch counters whatever happened (only items with a tail page raised dec,
     * and the cached pages a reuse links) */
    for (uint32_t j = 0; j < seen; j++) {
        ns_refs[items[j].ns] = 0;
        if (p->tail_page[j] != NO_PAGE)
            dec[p->tail_page[j]] = 0;
    }
    if (nlinks)
        kvp__plan_clean_links(pc, p, nlinks, dec);
    if (!rc) {
        fail_at = n;
        if (need + linked_cached + promotions > kvp_alloc_num_available(a))
            rc = KVP_ENOSPC;
        else if (total_pages > 0x7fffffffull)
            rc = KVP_ELIMIT;
        else if (kvp__plan_grow((void **)&p->kv_indices, &p->cap_indices, (uint32_t)total_pages + 1,
                                4) ||
                 kvp__plan_grow((void **)&p->copies, &p->cap_copies, (uint32_t)copies + 1,
                                sizeof(kvp_plan_copy_t)) ||
                 kvp__plan_grow((void **)&p->new_pages, &p->cap_new, (uint32_t)need + 1, 4) ||
                 (promotions && kvp__plan_grow((void **)&p->restores, &p->cap_restores,
                                               (uint32_t)promotions, sizeof(kvp_pcache_move_t))))
            rc = KVP_ENOMEM;
    }
    if (rc) {
        if (content)
            for (uint32_t j = 0; j < seen; j++)
                free(p->chains[j]);
        rollback_created(t, p, seen);
        p->fail_index = fail_at;
        return rc;
    }

    /* ---- phase 2: commit; cannot fail ---- */
    const uint32_t free_before = kvp_alloc_num_free(a);
    if (content) {
        /* chains start, found pages are linked before allocation may evict, host entries are
         * promoted (their pages taken before the batch's own) */
        kvp_pcache_set_now(pc, now_ms);
        kvp__plan_link_found(t, pc, p, items, content, n, cache, ps);
    }
    int r2 = kvp_alloc_reserve(a, (uint32_t)need, p->new_pages);
    (void)r2; /* checked above: need <= free + cached (less what the links took) */
    p->num_evicted =
        need + promotions > free_before ? (uint32_t)(need + promotions) - free_before : 0;
    uint32_t taken = 0, off = 0;
    p->kv_indptr[0] = 0;
    p->append_indptr[0] = 0;
    p->num_copies = 0;
    p->num_cached_tokens = 0;
    nnz = 0;
    /* the counters grow by sums: added once per run of items of one namespace (a batch is
     * usually one run) rather than through memory once per item */
    uint32_t run_ns = items[0].ns;
    uint64_t run_tokens = 0, run_refs = 0;
    for (i = 0; i < n; i++) {
        kvp_seq_t *s = p->seqs[i];
        uint32_t add = items[i].num_tokens;
        uint32_t f = 0, ch = 0;
        if (content) {
            ch = (p->created[i] >> 1) & 3u;
            f = ch == KVP__CH_START && cache->reuse ? p->linked[i] : 0;
            add -= f * ps;
            p->cached_tokens[i] = f * ps;
            p->num_cached_tokens += (uint64_t)f * ps;
        }
        uint32_t last = p->tail_page[i]; /* s->pages[num_pages - 1], set when add > 0 */
        if (last != NO_PAGE && refcount[last] > 1) {
            uint32_t dst = p->new_pages[taken++];
            p->copies[p->num_copies].src = last;
            p->copies[p->num_copies].dst = dst;
            p->num_copies++;
            kvp_alloc_unref(a, last); /* another holder keeps it: never 0 here */
            s->pages[s->num_pages - 1] = dst;
            if (s->chain)
                s->chain->tail_keyed = 0;
        } else if (last != NO_PAGE && s->chain && s->chain->tail_keyed) {
            kvp__pcache_unkey(pc, last); /* its last holder rewrites it: no longer that key's */
            s->chain->tail_keyed = 0;
        }
        uint32_t pages_after = pages_for(&pm, (uint64_t)s->num_tokens + add);
        uint32_t fresh = pages_after - s->num_pages;
        for (uint32_t k = 0; k < fresh; k++) /* usually 0 or 1 pages: no memcpy call */
            s->pages[s->num_pages + k] = p->new_pages[taken + k];
        taken += fresh;
        s->num_pages = pages_after;
        s->num_tokens += add;
        s->last_touch_ms = now_ms;
        if (ch) {
            /* what the writer may publish: from the page of its first row, unless that page
             * already holds rows of a worker (or a truncate) and the writer is the daemon */
            const uint32_t old_tail = tail_of(&pm, s->num_tokens - add);
            const uint32_t first = (s->num_tokens - add) / ps;
            p->publish_from[i] =
                old_tail && s->chain->tail_foreign && cache->daemon_writes ? first + 1 : first;
            if (add && !cache->daemon_writes)
                s->chain->tail_foreign = 1;
            else if (add && (old_tail == 0 || old_tail + add >= ps))
                s->chain->tail_foreign = 0; /* the partial page left is this copy's alone */
            const uint32_t nfull = items[i].num_tokens / ps;
            const int have_pre = ch == KVP__CH_START && cache->reuse;
            kvp__pcache_chain_append(pc, s, content[i].token_ids + (size_t)f * ps, add,
                                     have_pre ? p->keys + p->key_off[i] + f : NULL,
                                     have_pre ? nfull - f : 0);
        } else if (add && s->chain) {
            s->chain->tracked = 0; /* tokens without ids: the chain ends here */
        }
        if (content && !ch)
            p->publish_from[i] = UINT32_MAX;
        if (s->ns != run_ns) {
            kvp__seqtab_account(t, run_ns, (int64_t)run_tokens, (int64_t)run_refs);
            run_ns = s->ns;
            run_tokens = run_refs = 0;
        }
        run_tokens += add;
        run_refs += fresh;
        nnz += add;
        p->append_indptr[i + 1] = p->append_indptr[i] + (int32_t)add;
        write_row(p, i, s, ps, &off);
    }
    kvp__seqtab_account(t, run_ns, (int64_t)run_tokens, (int64_t)run_refs);
    p->batch_size = n;
    p->nnz = (uint32_t)nnz;
    p->num_new_pages = taken;
    p->fail_index = n;
    return 0;
}

int kvp_plan_append(kvp_seqtab_t *t, const kvp_plan_item_t *items, uint32_t n,
                    const kvp_plan_limits_t *limits, uint64_t now_ms, kvp_plan_t *p)
{
    return plan_append(t, items, NULL, n, limits, NULL, now_ms, p, 0);
}

int kvp_plan_append_cached(kvp_seqtab_t *t, const kvp_plan_item_t *items,
                           const kvp_plan_content_t *content, uint32_t n,
                           const kvp_plan_limits_t *limits, const kvp_plan_cache_t *cache,
                           uint64_t now_ms, kvp_plan_t *p)
{
    return plan_append(t, items, content, n, limits, cache, now_ms, p, 1);
}

int kvp_plan_page_table(const kvp_seqtab_t *t, const kvp_plan_item_t *items, uint32_t n,
                        const kvp_plan_limits_t *limits, kvp_plan_t *p)
{
    p->fail_index = n;
    if (!t || !p || !items || n == 0)
        return KVP_EINVAL;
    if (limits && limits->max_batch && n > limits->max_batch) {
        p->fail_index = limits->max_batch;
        return KVP_ELIMIT;
    }
    if (grow_batch(p, n))
        return KVP_ENOMEM;
    uint64_t total = 0;
    lookahead_t la;
    lookahead_start(&la, t, items, n);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t home = lookahead_next(&la, i);
        const kvp_seq_t *s = items[i].ns < kvp__seqtab_max_namespaces(t)
                                 ? kvp__seqtab_find_at(t, items[i].ns, items[i].seq_id, home)
                                 : NULL;
        if (!s) {
            p->fail_index = i;
            return items[i].ns < kvp__seqtab_max_namespaces(t) ? KVP_ENOENT : KVP_EINVAL;
        }
        p->seqs[i] = (kvp_seq_t *)s;
        total += s->num_pages;
    }
    if (total > 0x7fffffffull)
        return KVP_ELIMIT;
    if (kvp__plan_grow((void **)&p->kv_indices, &p->cap_indices, (uint32_t)total + 1, 4))
        return KVP_ENOMEM;
    uint32_t off = 0;
    p->kv_indptr[0] = 0;
    for (uint32_t i = 0; i < n; i++) {
        p->append_indptr[i] = 0;
        write_row(p, i, p->seqs[i], kvp_seqtab_page_size(t), &off);
    }
    p->append_indptr[n] = 0;
    p->batch_size = n;
    p->nnz = 0;
    p->num_copies = 0;
    p->num_new_pages = 0;
    p->num_restores = 0;
    p->num_restored_tokens = 0;
    return 0;
}

void kvp_plan_slots(const kvp_plan_t *p, uint32_t page_size, int32_t *slots)
{
    const page_math_t pm = page_math(page_size);
    for (uint32_t b = 0; b < p->batch_size; b++) {
        const int32_t first = p->append_indptr[b], add = p->append_indptr[b + 1] - first;
        const int32_t *pages = p->kv_indices + p->kv_indptr[b];
        uint32_t pos = (uint32_t)(p->seq_lens[b] - add);
        for (int32_t j = 0; j < add; j++, pos++) {
            const uint32_t k = pm.pow2 ? pos >> pm.shift : pos / page_size;
            slots[first + j] = (int32_t)((uint32_t)pages[k] * page_size + (pos - k * page_size));
        }
    }
}
