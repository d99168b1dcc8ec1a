/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_seqtab.c - sequence table: records in a fixed array (so pointers stay valid), an
 * open-addressing hash index with linear probing and backward-shift deletion (no tombstones,
 * so lookups never degrade), per-namespace counters, and the audit. The struct and the hash
 * lookups are in kvp_seqtab_internal.h, inline, for the planner's per-sequence loop.
 */
#include "kvp_seqtab.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_pcache_internal.h"
#include "kvp_seqtab_internal.h"

int kvp_seqtab_create(kvp_alloc_t *alloc, uint32_t page_size, const kvp_seqtab_config_t *cfg,
                      kvp_seqtab_t **out)
{
    if (!alloc || !cfg || !out || page_size == 0 || cfg->max_seqs == 0 ||
        cfg->max_namespaces == 0 || cfg->max_seqs > (1u << 30))
        return KVP_EINVAL;
    uint64_t cap_tokens = (uint64_t)kvp_alloc_num_pages(alloc) * page_size;
    if (cap_tokens > 0x7fffffffull)
        cap_tokens = 0x7fffffffull;
    kvp_seqtab_t *t = calloc(1, sizeof(*t));
    if (!t)
        return KVP_ENOMEM;
    t->alloc = alloc;
    t->page_size = page_size;
    t->max_seqs = cfg->max_seqs;
    t->max_namespaces = cfg->max_namespaces;
    t->max_seq_tokens = cfg->max_seq_tokens && cfg->max_seq_tokens < cap_tokens
                            ? cfg->max_seq_tokens
                            : (uint32_t)cap_tokens;
    uint32_t hash_cap = 16;
    while (hash_cap < 2u * cfg->max_seqs)
        hash_cap <<= 1;
    t->hash_mask = hash_cap - 1;
    t->recs = calloc(cfg->max_seqs, sizeof(*t->recs));
    t->used = calloc(cfg->max_seqs, 1);
    t->free_ids = malloc((size_t)cfg->max_seqs * sizeof(uint32_t));
    t->slots = calloc(hash_cap, sizeof(uint32_t));
    t->ns = calloc(cfg->max_namespaces, sizeof(*t->ns));
    t->page_scratch = calloc(kvp_alloc_num_pages(alloc), sizeof(uint32_t));
    t->ns_scratch = calloc(cfg->max_namespaces, sizeof(uint64_t));
    t->ns_group = calloc(cfg->max_namespaces, sizeof(uint32_t));
    t->group_seqs = calloc(cfg->max_namespaces, sizeof(uint32_t));
    t->group_max_seqs = calloc(cfg->max_namespaces, sizeof(uint32_t));
    if (!t->recs || !t->used || !t->free_ids || !t->slots || !t->ns || !t->page_scratch ||
        !t->ns_scratch || !t->ns_group || !t->group_seqs || !t->group_max_seqs) {
        kvp_seqtab_destroy(t);
        return KVP_ENOMEM;
    }
    for (uint32_t i = 0; i < cfg->max_namespaces; i++)
        t->ns_group[i] = i; /* every namespace its own group until told otherwise */
    for (uint32_t i = 0; i < cfg->max_seqs; i++)
        t->free_ids[i] = cfg->max_seqs - 1 - i;
    t->num_free_recs = cfg->max_seqs;
    *out = t;
    return 0;
}

void kvp_seqtab_destroy(kvp_seqtab_t *t)
{
    if (!t)
        return;
    if (t->recs && t->used) {
        for (uint32_t i = 0; i < t->max_seqs; i++) {
            if (!t->used[i])
                continue;
            for (uint32_t j = t->recs[i].num_pages; j-- > 0;)
                kvp_alloc_unref(t->alloc, t->recs[i].pages[j]);
            free(t->recs[i].pages);
            free(t->recs[i].chain);
        }
    }
    free(t->group_max_seqs);
    free(t->group_seqs);
    free(t->ns_group);
    free(t->ns_scratch);
    free(t->page_scratch);
    free(t->ns);
    free(t->slots);
    free(t->free_ids);
    free(t->used);
    free(t->recs);
    free(t);
}

/* Slot index holding (ns, id), or the empty slot where it would go. */
static uint32_t probe(const kvp_seqtab_t *t, uint32_t ns, uint64_t id)
{
    return kvp__seqtab_probe(t, ns, id, kvp__seqtab_home(t, ns, id));
}

kvp_seq_t *kvp_seqtab_find(const kvp_seqtab_t *t, uint32_t ns, uint64_t id)
{
    return kvp__seqtab_find_at(t, ns, id, kvp__seqtab_home(t, ns, id));
}

int kvp__seqtab_insert(kvp_seqtab_t *t, uint32_t ns, uint64_t id, uint32_t home, uint64_t now_ms,
                       kvp_seq_t **out)
{
    if (ns >= t->max_namespaces)
        return KVP_EINVAL;
    kvp_ns_stats_t *n = &t->ns[ns];
    const uint32_t g = t->ns_group[ns];
    if (t->num_free_recs == 0 || (n->max_seqs && n->num_seqs >= n->max_seqs) ||
        (t->group_max_seqs[g] && t->group_seqs[g] >= t->group_max_seqs[g]))
        return KVP_ELIMIT;
    uint32_t slot = kvp__seqtab_probe(t, ns, id, home);
    assert(t->slots[slot] == KVP__SEQTAB_EMPTY);
    uint32_t r = t->free_ids[--t->num_free_recs];
    kvp_seq_t *s = &t->recs[r];
    memset(s, 0, sizeof(*s));
    s->ns = ns;
    s->id = id;
    s->last_touch_ms = now_ms;
    t->used[r] = 1;
    t->slots[slot] = r + 1;
    t->num_seqs++;
    n->num_seqs++;
    t->group_seqs[g]++;
    *out = s;
    return 0;
}

/* Removes s from the index (backward-shift deletion) and frees its record. */
static void remove_rec(kvp_seqtab_t *t, kvp_seq_t *s)
{
    uint32_t i = probe(t, s->ns, s->id);
    assert(t->slots[i] != KVP__SEQTAB_EMPTY);
    t->slots[i] = KVP__SEQTAB_EMPTY;
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & t->hash_mask;
        uint32_t v = t->slots[j];
        if (v == KVP__SEQTAB_EMPTY)
            break;
        const kvp_seq_t *o = &t->recs[v - 1];
        uint32_t home = kvp__seqtab_home(t, o->ns, o->id);
        /* move o back into the hole at i unless its home lies cyclically in (i, j] */
        int in_range = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!in_range) {
            t->slots[i] = v;
            t->slots[j] = KVP__SEQTAB_EMPTY;
            i = j;
        }
    }
    uint32_t r = (uint32_t)(s - t->recs);
    t->ns[s->ns].num_seqs--;
    t->group_seqs[t->ns_group[s->ns]]--;
    t->num_seqs--;
    free(s->pages);
    free(s->chain);
    memset(s, 0, sizeof(*s));
    t->used[r] = 0;
    t->free_ids[t->num_free_recs++] = r;
}

void kvp__seqtab_remove_empty(kvp_seqtab_t *t, kvp_seq_t *s)
{
    assert(s->num_pages == 0 && s->num_tokens == 0);
    remove_rec(t, s);
}

int kvp__seq_reserve(kvp_seq_t *s, uint32_t cap)
{
    if (cap <= s->cap_pages)
        return 0;
    uint32_t c = s->cap_pages ? s->cap_pages : 4;
    while (c < cap)
        c = c > 0x7fffffffu ? cap : c * 2;
    uint32_t *p = realloc(s->pages, (size_t)c * sizeof(uint32_t));
    if (!p)
        return KVP_ENOMEM;
    s->pages = p;
    s->cap_pages = c;
    return 0;
}

int kvp_seqtab_fork(kvp_seqtab_t *t, uint32_t ns, uint64_t parent, uint64_t child, uint64_t now_ms)
{
    if (ns >= t->max_namespaces)
        return KVP_EINVAL;
    kvp_seq_t *p = kvp_seqtab_find(t, ns, parent);
    if (!p)
        return KVP_ENOENT;
    if (kvp_seqtab_find(t, ns, child))
        return KVP_EEXIST;
    kvp_ns_stats_t *n = &t->ns[ns];
    if (n->max_page_refs && n->page_refs + n->pinned_pages + p->num_pages > n->max_page_refs)
        return KVP_ELIMIT;
    uint32_t *pages = NULL;
    struct kvp_chain *chain = NULL;
    if (p->num_pages) {
        pages = malloc((size_t)p->num_pages * sizeof(uint32_t));
        if (!pages)
            return KVP_ENOMEM;
    }
    if (p->chain && t->pc && !(chain = kvp__pcache_chain_dup(t->pc, p->chain))) {
        free(pages);
        return KVP_ENOMEM;
    }
    kvp_seq_t *c;
    int rc = kvp__seqtab_insert(t, ns, child, kvp__seqtab_home(t, ns, child), now_ms, &c);
    if (rc) {
        free(chain);
        free(pages);
        return rc;
    }
    c->chain = chain;
    /* p stays valid: records never move */
    if (p->num_pages)
        memcpy(pages, p->pages, (size_t)p->num_pages * sizeof(uint32_t));
    for (uint32_t i = 0; i < p->num_pages; i++)
        kvp_alloc_ref(t->alloc, pages[i]);
    c->pages = pages;
    c->num_pages = c->cap_pages = p->num_pages;
    c->num_tokens = p->num_tokens;
    p->last_touch_ms = now_ms;
    kvp__seqtab_account(t, ns, p->num_tokens, p->num_pages);
    return 0;
}

int kvp_seqtab_truncate(kvp_seqtab_t *t, uint32_t ns, uint64_t id, uint32_t num_tokens,
                        uint64_t now_ms)
{
    if (ns >= t->max_namespaces)
        return KVP_EINVAL;
    kvp_seq_t *s = kvp_seqtab_find(t, ns, id);
    if (!s)
        return KVP_ENOENT;
    if (num_tokens > s->num_tokens)
        return KVP_ERANGE;
    uint32_t keep = kvp_geom_pages_for(t->page_size, num_tokens);
    for (uint32_t i = s->num_pages; i-- > keep;) /* last first, as a release */
        kvp_alloc_unref(t->alloc, s->pages[i]);
    kvp__seqtab_account(t, ns, -(int64_t)(s->num_tokens - num_tokens),
                        -(int64_t)(s->num_pages - keep));
    const uint32_t old_tokens = s->num_tokens;
    s->num_pages = keep;
    s->num_tokens = num_tokens;
    s->last_touch_ms = now_ms;
    if (t->pc)
        kvp__pcache_truncated(t->pc, s, old_tokens);
    return 0;
}

static void release_seq(kvp_seqtab_t *t, kvp_seq_t *s)
{
    for (uint32_t i = s->num_pages; i-- > 0;)
        kvp_alloc_unref(t->alloc, s->pages[i]);
    kvp__seqtab_account(t, s->ns, -(int64_t)s->num_tokens, -(int64_t)s->num_pages);
    remove_rec(t, s);
}

int kvp_seqtab_release(kvp_seqtab_t *t, uint32_t ns, uint64_t id)
{
    if (ns >= t->max_namespaces)
        return KVP_EINVAL;
    kvp_seq_t *s = kvp_seqtab_find(t, ns, id);
    if (!s)
        return KVP_ENOENT;
    release_seq(t, s);
    return 0;
}

uint32_t kvp_seqtab_release_ns(kvp_seqtab_t *t, uint32_t ns)
{
    uint32_t n = 0;
    if (ns >= t->max_namespaces)
        return 0;
    for (uint32_t i = 0; i < t->max_seqs && t->ns[ns].num_seqs; i++) {
        if (t->used[i] && t->recs[i].ns == ns) {
            release_seq(t, &t->recs[i]);
            n++;
        }
    }
    return n;
}

kvp_seq_t *kvp_seqtab_next(const kvp_seqtab_t *t, uint32_t *cursor)
{
    for (uint32_t i = *cursor; i < t->max_seqs; i++) {
        if (t->used[i]) {
            *cursor = i + 1;
            return &t->recs[i];
        }
    }
    *cursor = t->max_seqs;
    return NULL;
}

void kvp_seqtab_stats(const kvp_seqtab_t *t, kvp_stats_t *out)
{
    memset(out, 0, sizeof(*out));
    out->num_pages = kvp_alloc_num_pages(t->alloc);
    out->free_pages = kvp_alloc_num_free(t->alloc);
    out->cached_pages = kvp_alloc_num_cached(t->alloc);
    out->demoting = kvp_alloc_num_demoting(t->alloc);
    out->used_pages = out->num_pages - out->free_pages - out->cached_pages - out->demoting;
    out->shared_pages = kvp_alloc_num_shared(t->alloc);
    out->num_seqs = t->num_seqs;
    out->num_tokens = t->num_tokens;
    out->page_refs = t->page_refs;
}

int kvp_seqtab_ns_stats(const kvp_seqtab_t *t, uint32_t ns, kvp_ns_stats_t *out)
{
    if (ns >= t->max_namespaces)
        return KVP_EINVAL;
    *out = t->ns[ns];
    return 0;
}

int kvp_seqtab_set_ns_group(kvp_seqtab_t *t, uint32_t ns, uint32_t group)
{
    if (ns >= t->max_namespaces || group >= t->max_namespaces)
        return KVP_EINVAL;
    const uint32_t n = t->ns[ns].num_seqs, old = t->ns_group[ns];
    t->group_seqs[old] -= n; /* its live sequences move with it */
    t->group_seqs[group] += n;
    t->ns_group[ns] = group;
    return 0;
}

int kvp_seqtab_set_group_limit(kvp_seqtab_t *t, uint32_t group, uint32_t max_seqs)
{
    if (group >= t->max_namespaces)
        return KVP_EINVAL;
    t->group_max_seqs[group] = max_seqs;
    return 0;
}

uint32_t kvp_seqtab_group_seqs(const kvp_seqtab_t *t, uint32_t group)
{
    return group < t->max_namespaces ? t->group_seqs[group] : 0;
}

int kvp_seqtab_set_ns_limits(kvp_seqtab_t *t, uint32_t ns, uint32_t max_seqs,
                             uint64_t max_page_refs)
{
    if (ns >= t->max_namespaces)
        return KVP_EINVAL;
    t->ns[ns].max_seqs = max_seqs;
    t->ns[ns].max_page_refs = max_page_refs;
    return 0;
}

uint32_t kvp_seqtab_page_size(const kvp_seqtab_t *t)
{
    return t->page_size;
}

uint32_t kvp_seqtab_max_seq_tokens(const kvp_seqtab_t *t)
{
    return t->max_seq_tokens;
}

kvp_alloc_t *kvp_seqtab_alloc(const kvp_seqtab_t *t)
{
    return t->alloc;
}

void kvp__seqtab_set_cache(kvp_seqtab_t *t, struct kvp_pcache *pc)
{
    t->pc = pc;
}

#define AUDIT_FAIL(...)                                                                            \
    do {                                                                                           \
        snprintf(msg, msg_len, __VA_ARGS__);                                                       \
        rc = KVP_EAUDIT;                                                                           \
        goto out;                                                                                  \
    } while (0)

int kvp_seqtab_audit(const kvp_seqtab_t *t, char *msg, unsigned msg_len)
{
    int rc = kvp_alloc_audit(t->alloc, msg, msg_len);
    if (rc)
        return rc;
    uint32_t np = kvp_alloc_num_pages(t->alloc);
    uint32_t *refs = calloc(np, sizeof(uint32_t));
    uint64_t *last_seen = calloc(np, sizeof(uint64_t)); /* record index + 1 that last named p */
    kvp_ns_stats_t *ns = calloc(t->max_namespaces, sizeof(*ns));
    uint64_t *groups = NULL; /* sequences counted per tenant group */
    if (!refs || !last_seen || !ns) {
        rc = KVP_ENOMEM;
        goto out;
    }
    uint32_t seqs = 0, free_recs = 0;
    uint64_t tokens = 0, prefs = 0;
    for (uint32_t r = 0; r < t->max_seqs; r++) {
        if (!t->used[r]) {
            free_recs++;
            continue;
        }
        const kvp_seq_t *s = &t->recs[r];
        if (s->ns >= t->max_namespaces)
            AUDIT_FAIL("seq ns=%u id=%llu: namespace out of range", s->ns,
                       (unsigned long long)s->id);
        if (kvp_seqtab_find(t, s->ns, s->id) != s)
            AUDIT_FAIL("seq ns=%u id=%llu: not found through the hash index", s->ns,
                       (unsigned long long)s->id);
        if (s->num_tokens > t->max_seq_tokens)
            AUDIT_FAIL("seq ns=%u id=%llu: %u tokens above the limit %u", s->ns,
                       (unsigned long long)s->id, s->num_tokens, t->max_seq_tokens);
        if (s->num_pages != kvp_geom_pages_for(t->page_size, s->num_tokens))
            AUDIT_FAIL("seq ns=%u id=%llu: %u pages for %u tokens (page_size %u)", s->ns,
                       (unsigned long long)s->id, s->num_pages, s->num_tokens, t->page_size);
        if (s->num_pages > s->cap_pages)
            AUDIT_FAIL("seq ns=%u id=%llu: %u pages above capacity %u", s->ns,
                       (unsigned long long)s->id, s->num_pages, s->cap_pages);
        if (s->num_tokens) {
            uint32_t last = s->num_tokens - (s->num_pages - 1) * t->page_size;
            if (last < 1 || last > t->page_size)
                AUDIT_FAIL("seq ns=%u id=%llu: last_page_len %u outside 1..%u", s->ns,
                           (unsigned long long)s->id, last, t->page_size);
        }
        for (uint32_t i = 0; i < s->num_pages; i++) {
            uint32_t p = s->pages[i];
            if (p >= np)
                AUDIT_FAIL("seq ns=%u id=%llu: page %u out of range", s->ns,
                           (unsigned long long)s->id, p);
            if (kvp_alloc_refcount(t->alloc, p) == 0)
                AUDIT_FAIL("seq ns=%u id=%llu: page %u is free", s->ns, (unsigned long long)s->id,
                           p);
            if (last_seen[p] == (uint64_t)r + 1)
                AUDIT_FAIL("seq ns=%u id=%llu: page %u appears twice", s->ns,
                           (unsigned long long)s->id, p);
            last_seen[p] = (uint64_t)r + 1;
            refs[p]++;
        }
        seqs++;
        tokens += s->num_tokens;
        prefs += s->num_pages;
        ns[s->ns].num_seqs++;
        ns[s->ns].num_tokens += s->num_tokens;
        ns[s->ns].page_refs += s->num_pages;
    }
    for (uint32_t p = 0; p < np; p++) {
        const uint32_t pins = t->pc ? kvp__pcache_pin_refs(t->pc, p) : 0;
        if (refs[p] + pins != kvp_alloc_refcount(t->alloc, p))
            AUDIT_FAIL("page %u: refcount %u but %u page-vector entries and %u pins", p,
                       kvp_alloc_refcount(t->alloc, p), refs[p], pins);
    }
    if (seqs != t->num_seqs || tokens != t->num_tokens || prefs != t->page_refs)
        AUDIT_FAIL("stats: seqs %u/%u tokens %llu/%llu page_refs %llu/%llu (counted/kept)", seqs,
                   t->num_seqs, (unsigned long long)tokens, (unsigned long long)t->num_tokens,
                   (unsigned long long)prefs, (unsigned long long)t->page_refs);
    if (free_recs != t->num_free_recs)
        AUDIT_FAIL("records: %u free but free list holds %u", free_recs, t->num_free_recs);
    for (uint32_t i = 0; i < t->max_namespaces; i++)
        if (ns[i].num_seqs != t->ns[i].num_seqs || ns[i].num_tokens != t->ns[i].num_tokens ||
            ns[i].page_refs != t->ns[i].page_refs)
            AUDIT_FAIL("namespace %u: counters disagree with the table", i);
    if (!(groups = calloc(t->max_namespaces, sizeof(*groups)))) {
        rc = KVP_ENOMEM;
        goto out;
    }
    for (uint32_t i = 0; i < t->max_namespaces; i++)
        groups[t->ns_group[i]] += ns[i].num_seqs;
    for (uint32_t g = 0; g < t->max_namespaces; g++)
        if (groups[g] != t->group_seqs[g])
            AUDIT_FAIL("tenant group %u: %llu sequences counted, %u kept", g,
                       (unsigned long long)groups[g], t->group_seqs[g]);
    for (uint32_t i = 0; i < np; i++)
        if (t->page_scratch[i])
            AUDIT_FAIL("planner scratch not clean at page %u", i);
out:
    free(groups);
    free(ns);
    free(last_seen);
    free(refs);
    return rc;
}
