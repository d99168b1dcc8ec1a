/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pcache_pin.c - the prefix cache's pins (kvp_pcache.h): a pin holds a reference on each
 * GPU page of a findable prefix until its time is up, within a namespace's quotas; pin records
 * live in a fixed table of max_pins with a free list. It does not decide eviction order (a
 * pinned page is simply never cached) nor find pages itself (the key table's walk).
 */
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_pcache.h"
#include "kvp_pcache_internal.h"
#include "kvp_seqtab_internal.h"

void kvp__pcache_drop_pin(kvp_pcache_t *c, uint32_t idx)
{
    kvp__pc_pin_t *pin = &c->pins[idx];
    for (uint32_t k = pin->num_pages; k-- > 0;) {
        uint32_t p = pin->pages[k];
        if (--c->pinrefs[p] == 0)
            c->st.pinned_pages--;
        kvp_alloc_unref(c->a, p);
    }
    c->t->ns[pin->ns].pinned_pages -= pin->num_pages;
    c->ns_pins[pin->ns]--;
    c->st.pins--;
    free(pin->pages);
    memset(pin, 0, sizeof(*pin));
    c->pin_free[c->num_pin_free++] = idx;
}

uint32_t kvp__pcache_pin_refs(const kvp_pcache_t *c, uint32_t p)
{
    return c->pinrefs[p];
}

int kvp_pcache_set_pin_quota(kvp_pcache_t *c, uint32_t ns, uint64_t max_pinned_pages)
{
    if (ns >= c->max_ns)
        return KVP_EINVAL;
    c->ns_quota[ns] = max_pinned_pages;
    return 0;
}

int kvp_pcache_pin(kvp_pcache_t *c, uint32_t ns, uint32_t scope, kvp_pagekey_t root,
                   const int32_t *tokens, uint64_t num_tokens, uint64_t now_ms, uint64_t ttl_ms,
                   uint64_t *pin_id, uint32_t *pages_out)
{
    if (ns >= c->max_ns || scope >= c->max_scopes || (num_tokens && !tokens) || !pin_id)
        return KVP_EINVAL;
    kvp_pcache_set_now(c, now_ms);
    uint64_t full = num_tokens / c->ps;
    if (full == 0)
        return KVP_ENOENT;
    if (full > UINT32_MAX)
        return KVP_EINVAL;
    uint32_t *pages = malloc((size_t)full * sizeof(uint32_t));
    if (!pages)
        return KVP_ENOMEM;
    uint32_t f = kvp__pcache_walk(c, scope, root, tokens, num_tokens, pages);
    const kvp_ns_stats_t *nst = &c->t->ns[ns];
    int rc = 0;
    if (f == 0)
        rc = KVP_ENOENT;
    else if (c->ns_quota[ns] < f || c->t->ns[ns].pinned_pages > c->ns_quota[ns] - f ||
             !c->num_pin_free ||
             (nst->max_page_refs && nst->page_refs + nst->pinned_pages + f > nst->max_page_refs))
        rc = KVP_ELIMIT;
    if (rc) {
        free(pages);
        return rc;
    }
    uint32_t *shrunk = realloc(pages, (size_t)f * sizeof(uint32_t));
    if (shrunk)
        pages = shrunk;
    uint32_t idx = c->pin_free[--c->num_pin_free];
    kvp__pc_pin_t *pin = &c->pins[idx];
    pin->id = (++c->pin_seq << 16) | idx;
    pin->expires_ms = ttl_ms > UINT64_MAX - now_ms ? UINT64_MAX : now_ms + ttl_ms;
    pin->ns = ns;
    pin->scope = scope;
    pin->num_pages = f;
    pin->pages = pages;
    for (uint32_t k = 0; k < f; k++) {
        kvp__pcache_take_ref(c, pages[k]);
        if (c->pinrefs[pages[k]]++ == 0)
            c->st.pinned_pages++;
    }
    c->t->ns[ns].pinned_pages += f;
    c->ns_pins[ns]++;
    c->st.pins++;
    *pin_id = pin->id;
    if (pages_out)
        *pages_out = f;
    return 0;
}

int kvp_pcache_unpin(kvp_pcache_t *c, uint32_t ns, uint64_t pin_id)
{
    uint32_t idx = (uint32_t)(pin_id & 0xffffu);
    if (pin_id == 0 || idx >= c->max_pins || c->pins[idx].id != pin_id || c->pins[idx].ns != ns)
        return KVP_ENOENT;
    int pages = (int)c->pins[idx].num_pages;
    kvp__pcache_drop_pin(c, idx);
    return pages;
}

uint32_t kvp_pcache_unpin_ns(kvp_pcache_t *c, uint32_t ns)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < c->max_pins && ns < c->max_ns && c->ns_pins[ns]; i++)
        if (c->pins[i].id && c->pins[i].ns == ns) {
            kvp__pcache_drop_pin(c, i);
            n++;
        }
    return n;
}

uint64_t kvp_pcache_ns_last_expiry(const kvp_pcache_t *c, uint32_t ns)
{
    uint64_t e = 0;
    for (uint32_t i = 0; i < c->max_pins && ns < c->max_ns && c->ns_pins[ns]; i++)
        if (c->pins[i].id && c->pins[i].ns == ns && c->pins[i].expires_ms > e)
            e = c->pins[i].expires_ms;
    return e;
}

uint32_t kvp_pcache_expire(kvp_pcache_t *c, uint64_t now_ms)
{
    kvp_pcache_set_now(c, now_ms);
    uint32_t n = 0;
    for (uint32_t i = 0; i < c->max_pins && c->st.pins; i++)
        if (c->pins[i].id && c->pins[i].expires_ms <= c->now) {
            kvp__pcache_drop_pin(c, i);
            n++;
        }
    kvp__pcache_expire_retention(c);
    return n;
}

uint64_t kvp_pcache_next_expiry(const kvp_pcache_t *c)
{
    uint64_t e = UINT64_MAX;
    for (uint32_t i = 0; i < c->max_pins && c->st.pins; i++)
        if (c->pins[i].id && c->pins[i].expires_ms < e)
            e = c->pins[i].expires_ms;
    return e;
}

uint64_t kvp_pcache_ns_pinned_pages(const kvp_pcache_t *c, uint32_t ns)
{
    return ns < c->max_ns ? c->t->ns[ns].pinned_pages : 0;
}

uint32_t kvp_pcache_ns_pins(const kvp_pcache_t *c, uint32_t ns)
{
    return ns < c->max_ns ? c->ns_pins[ns] : 0;
}

int kvp_pcache_next_pin(const kvp_pcache_t *c, uint32_t *cursor, kvp_pcache_pin_info_t *out)
{
    for (uint32_t i = *cursor; i < c->max_pins; i++) {
        if (!c->pins[i].id)
            continue;
        *cursor = i + 1;
        out->pin_id = c->pins[i].id;
        out->ns = c->pins[i].ns;
        out->scope = c->pins[i].scope;
        out->pages = c->pins[i].num_pages;
        out->expires_ms = c->pins[i].expires_ms;
        return 0;
    }
    *cursor = c->max_pins;
    return KVP_ENOENT;
}
