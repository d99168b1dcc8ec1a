/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_plan_reuse.c - the batch planner's reuse of the prefix cache (kvp_plan.h,
 * kvp_plan_append_cached with reuse): phase 1 finds each new chain's longest findable prefix,
 * on the GPU or (promote) through the host tier too, and counts what it costs; phase 2 links
 * the GPU pages and promotes the host entries into fresh pages. The rest of the planner (the
 * two phases, the page table, copy-on-write) is kvp_plan.c; the cache's side of a promotion is
 * kvp_pcache_tier.c.
 */
#include <string.h>

#include "kvp_error.h"
#include "kvp_pcache_internal.h"
#include "kvp_plan_internal.h"
#include "kvp_seqtab_internal.h"

#define NIL KVP__PC_NIL

int kvp__plan_find_prefix(kvp_pcache_t *pc, kvp_plan_t *p, uint32_t i, const kvp_plan_item_t *it,
                          const kvp_plan_content_t *ct, const kvp_plan_cache_t *cache, uint32_t ps,
                          uint32_t *dec, uint32_t *nkeys, uint32_t *nlinks, uint64_t *linked_cached,
                          uint64_t *promotions)
{
    const uint32_t nfull = it->num_tokens / ps;
    p->key_off[i] = *nkeys;
    p->linked[i] = 0;
    if (nfull == 0)
        return 0;
    if (kvp__plan_grow((void **)&p->keys, &p->cap_keys, *nkeys + nfull, sizeof(kvp_pagekey_t)) ||
        kvp__plan_grow((void **)&p->link_pages, &p->cap_links, *nlinks + nfull, 4))
        return KVP_ENOMEM;
    kvp_pagekey_t root;
    kvp_pagekey_root(ct->salt, ct->salt_len, &root);
    kvp_pagekey_t *keys = p->keys + *nkeys;
    kvp_pagekey_chain(root, ct->token_ids, it->num_tokens, ps, keys, nfull);
    *nkeys += nfull;
    const uint32_t max_f = cache->leave_last ? (it->num_tokens - 1) / ps : nfull;
    const uint32_t np = kvp__pcache_num_pages(pc);
    const int promote = cache->promote != 0;
    uint32_t f = 0;
    for (; f < max_f; f++) {
        const uint32_t e = promote ? kvp__pcache_find_slot(pc, cache->scope, keys[f])
                                   : kvp_pcache_find(pc, cache->scope, keys[f]);
        if (e == NIL)
            break;
        p->link_pages[*nlinks + f] = e;
        if (e >= np) { /* a host entry: a fresh page, once per batch */
            *promotions += (uint64_t)kvp__pcache_mark_host(pc, e);
        } else if (kvp__pcache_is_cached(pc, e) && !dec[e]) {
            /* a cached page leaves what allocation can take (a demoting one never counted) */
            dec[e] = 1;
            (*linked_cached)++;
        }
    }
    p->linked[i] = f;
    *nlinks += f;
    return 0;
}

void kvp__plan_clean_links(kvp_pcache_t *pc, const kvp_plan_t *p, uint32_t nlinks, uint32_t *dec)
{
    const uint32_t np = kvp__pcache_num_pages(pc);
    for (uint32_t k = 0; k < nlinks; k++) {
        const uint32_t e = p->link_pages[k];
        if (e < np)
            dec[e] = 0;
        else
            kvp__pcache_unmark_host(pc, e);
    }
}

void kvp__plan_link_found(kvp_seqtab_t *t, kvp_pcache_t *pc, kvp_plan_t *p,
                          const kvp_plan_item_t *items, const kvp_plan_content_t *content,
                          uint32_t n, const kvp_plan_cache_t *cache, uint32_t ps)
{
    const uint32_t np = kvp__pcache_num_pages(pc);
    uint32_t lo = 0, promoted = 0;
    for (uint32_t i = 0; i < n; i++) {
        p->restored_tokens[i] = 0;
        if (!((p->created[i] >> 1) & KVP__CH_START))
            continue;
        kvp_seq_t *s = p->seqs[i];
        if (p->chains[i])
            s->chain = p->chains[i];
        kvp_pagekey_t root;
        kvp_pagekey_root(content[i].salt, content[i].salt_len, &root);
        kvp__pcache_chain_start(s->chain, cache->scope, root, cache->priority, cache->retention_ms);
        const uint32_t f = cache->reuse ? p->linked[i] : 0;
        uint32_t gpu = 0, lead = f; /* GPU pages, and the leading run of them */
        for (uint32_t k = 0; k < f; k++) {
            const uint32_t e = p->link_pages[lo + k];
            if (e >= np) { /* promoted below, once every GPU page is linked */
                lead = lead < k ? lead : k;
                continue;
            }
            s->pages[k] = e;
            kvp__pcache_link(pc, e, cache->priority, cache->retention_ms);
            gpu++;
        }
        promoted += f - gpu;
        lo += f;
        if (cache->reuse)
            kvp__pcache_count_query(pc, cache->scope, items[i].num_tokens, (uint64_t)lead * ps,
                                    (uint64_t)(f - lead) * ps);
        if (f) {
            s->num_pages = f;
            s->num_tokens = f * ps;
            s->chain->num_keyed = s->chain->num_handed = f;
            s->chain->last = p->keys[p->key_off[i] + f - 1];
            /* the last linked page's tokens, for a truncate back into it */
            memcpy(s->chain->tok + ps, content[i].token_ids + (size_t)(f - 1) * ps,
                   (size_t)ps * sizeof(int32_t));
            s->chain->prev_full = 1;
            kvp__seqtab_account(t, s->ns, (int64_t)f * ps, f);
        }
    }
    if (!promoted)
        return;
    /* the host entries: a page each, taken now that no page the batch links is cached */
    kvp_alloc_t *a = kvp_seqtab_alloc(t);
    lo = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!((p->created[i] >> 1) & KVP__CH_START))
            continue;
        kvp_seq_t *s = p->seqs[i];
        const uint32_t f = p->linked[i];
        for (uint32_t k = 0; k < f; k++) {
            if (p->link_pages[lo + k] < np)
                continue;
            /* still in the host tier, or an earlier item of the batch promoted it */
            const uint32_t e = kvp__pcache_find_slot(pc, cache->scope, p->keys[p->key_off[i] + k]);
            if (e >= np) {
                uint32_t pg;
                int rc = kvp_alloc_reserve(a, 1, &pg);
                (void)rc; /* phase 1 counted it: cannot fail */
                kvp__pcache_promote(pc, e, pg, cache->priority, cache->retention_ms,
                                    &p->restores[p->num_restores++]);
                s->pages[k] = pg;
            } else {
                s->pages[k] = e;
                kvp__pcache_link(pc, e, cache->priority, cache->retention_ms);
            }
            p->restored_tokens[i] += ps;
            p->num_restored_tokens += ps;
        }
        lo += f;
    }
}
