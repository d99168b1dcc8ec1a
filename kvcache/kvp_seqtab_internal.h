/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_seqtab_internal.h - the sequence table's hooks for the batch planner (kvp_plan.c).
 * Not part of the public API: only kvcache/ includes it.
 *
 * The table's struct and its hash lookups live here, as static inline functions, so that the
 * planner's per-sequence loop inlines them: a 256-sequence decode step looks up every
 * sequence once, and a call plus a fresh hash per lookup (and per prefetch) cost more than the
 * lookups themselves. The planner hashes each key once (kvp__seqtab_home) and hands the home
 * slot to the prefetches, the lookup and the insert.
 */
#ifndef KVP_SEQTAB_INTERNAL_H
#define KVP_SEQTAB_INTERNAL_H

#include "kvp_seqtab.h"

#define KVP__SEQTAB_EMPTY 0u /* hash slot value; records are stored as index + 1 */

struct kvp_seqtab {
    kvp_alloc_t *alloc; /* borrowed */
    uint32_t page_size;
    uint32_t max_seqs;
    uint32_t max_namespaces;
    uint32_t max_seq_tokens;
    kvp_seq_t *recs;    /* [max_seqs]; a free record has pages == NULL and id marked free */
    uint8_t *used;      /* [max_seqs] */
    uint32_t *free_ids; /* [max_seqs] stack of free record indexes */
    uint32_t num_free_recs;
    uint32_t *slots; /* [hash_cap] */
    uint32_t hash_mask;
    kvp_ns_stats_t *ns; /* [max_namespaces] */
    uint32_t *ns_group; /* [max_namespaces]: the tenant group of each namespace */
    uint32_t *group_seqs, *group_max_seqs; /* [max_namespaces]: live sequences, quota (0: none) */
    uint32_t num_seqs;
    uint64_t num_tokens;
    uint64_t page_refs;
    uint64_t epoch;
    uint32_t *page_scratch; /* [num_pages], zero between uses */
    uint64_t *ns_scratch;   /* [max_namespaces], zero between uses */
    struct kvp_pcache *pc;  /* the prefix cache attached (kvp_pcache.h), or NULL */
};

/* The home slot of (ns, id): where its linear probe starts. */
static inline uint32_t kvp__seqtab_home(const kvp_seqtab_t *t, uint32_t ns, uint64_t id)
{
    uint64_t z = id ^ ((uint64_t)ns * 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (uint32_t)(z ^ (z >> 31)) & t->hash_mask;
}

/* Slot index holding (ns, id), or the empty slot where it would go; home from
 * kvp__seqtab_home(t, ns, id). */
static inline uint32_t kvp__seqtab_probe(const kvp_seqtab_t *t, uint32_t ns, uint64_t id,
                                         uint32_t home)
{
    uint32_t i = home;
    for (;;) {
        uint32_t v = t->slots[i];
        if (v == KVP__SEQTAB_EMPTY)
            return i;
        const kvp_seq_t *s = &t->recs[v - 1];
        if (s->id == id && s->ns == ns)
            return i;
        i = (i + 1) & t->hash_mask;
    }
}

/* kvp_seqtab_find with the home slot already computed. */
static inline kvp_seq_t *kvp__seqtab_find_at(const kvp_seqtab_t *t, uint32_t ns, uint64_t id,
                                             uint32_t home)
{
    uint32_t v = t->slots[kvp__seqtab_probe(t, ns, id, home)];
    return v == KVP__SEQTAB_EMPTY ? NULL : &t->recs[v - 1];
}

/* Software prefetch for a batch of lookups (a table of 65536 sequences is megabytes: every
 * probe is a cache miss). The slot first; a few items later, once it has arrived, the record
 * it names. Only hints: no effect on results. */
static inline void kvp__seqtab_prefetch_slot(const kvp_seqtab_t *t, uint32_t home)
{
    __builtin_prefetch(&t->slots[home]);
}

static inline void kvp__seqtab_prefetch_rec(const kvp_seqtab_t *t, uint32_t home)
{
    uint32_t v = t->slots[home];
    if (v != KVP__SEQTAB_EMPTY) {
        const kvp_seq_t *s = &t->recs[v - 1];
        __builtin_prefetch(s);
        __builtin_prefetch((const char *)s + sizeof(*s) - 1);
    }
}

/* Inserts an empty sequence at its place in the probe from home (kvp__seqtab_home). Returns 0
 * and *out, or KVP_ELIMIT (table or namespace sequence limit), KVP_EINVAL (bad ns). The
 * sequence must not exist. */
int kvp__seqtab_insert(kvp_seqtab_t *t, uint32_t ns, uint64_t id, uint32_t home, uint64_t now_ms,
                       kvp_seq_t **out);

/* Removes an EMPTY sequence (rollback of kvp__seqtab_insert). */
void kvp__seqtab_remove_empty(kvp_seqtab_t *t, kvp_seq_t *s);

/* Grows s->pages so it holds at least `cap` entries. 0 or KVP_ENOMEM (s unchanged). */
int kvp__seq_reserve(kvp_seq_t *s, uint32_t cap);

/* Adds to the table's and s's namespace counters after the planner changed s. */
static inline void kvp__seqtab_account(kvp_seqtab_t *t, uint32_t ns, int64_t d_tokens,
                                       int64_t d_refs)
{
    t->num_tokens += (uint64_t)d_tokens;
    t->page_refs += (uint64_t)d_refs;
    t->ns[ns].num_tokens += (uint64_t)d_tokens;
    t->ns[ns].page_refs += (uint64_t)d_refs;
}

/* A zeroed uint32 scratch array of num_pages entries; the planner must zero what it dirties. */
static inline uint32_t *kvp__seqtab_page_scratch(kvp_seqtab_t *t)
{
    return t->page_scratch;
}

/* A zeroed uint64 scratch array of max_namespaces entries; same rule. */
static inline uint64_t *kvp__seqtab_ns_scratch(kvp_seqtab_t *t)
{
    return t->ns_scratch;
}

/* A new batch epoch (never 0), to detect a sequence named twice in one batch. */
static inline uint64_t kvp__seqtab_epoch(kvp_seqtab_t *t)
{
    return ++t->epoch;
}

static inline uint32_t kvp__seqtab_max_namespaces(const kvp_seqtab_t *t)
{
    return t->max_namespaces;
}

/* A namespace's counters and limits, read in place (ns < max_namespaces). */
static inline const kvp_ns_stats_t *kvp__seqtab_ns(const kvp_seqtab_t *t, uint32_t ns)
{
    return &t->ns[ns];
}

#endif
