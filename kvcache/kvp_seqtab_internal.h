/*
 * kvp_seqtab_internal.h - the sequence table's hooks for the batch planner (kvp_plan.c).
 * Not part of the public API: only kvcache/ includes it.
 */
#ifndef KVP_SEQTAB_INTERNAL_H
#define KVP_SEQTAB_INTERNAL_H

#include "kvp_seqtab.h"

/* Inserts an empty sequence. Returns 0 and *out, or KVP_ELIMIT (table or namespace sequence
 * limit), KVP_EINVAL (bad ns). The sequence must not exist. */
int kvp__seqtab_insert(kvp_seqtab_t *t, uint32_t ns, uint64_t id, uint64_t now_ms, kvp_seq_t **out);

/* Removes an EMPTY sequence (rollback of kvp__seqtab_insert). */
void kvp__seqtab_remove_empty(kvp_seqtab_t *t, kvp_seq_t *s);

/* Grows s->pages so it holds at least `cap` entries. 0 or KVP_ENOMEM (s unchanged). */
int kvp__seq_reserve(kvp_seq_t *s, uint32_t cap);

/* Adds to the table's and s's namespace counters after the planner changed s. */
void kvp__seqtab_account(kvp_seqtab_t *t, uint32_t ns, int64_t d_tokens, int64_t d_refs);

/* A zeroed uint32 scratch array of num_pages entries; the planner must zero what it dirties. */
uint32_t *kvp__seqtab_page_scratch(kvp_seqtab_t *t);

/* A zeroed uint64 scratch array of max_namespaces entries; same rule. */
uint64_t *kvp__seqtab_ns_scratch(kvp_seqtab_t *t);

/* A new batch epoch (never 0), to detect a sequence named twice in one batch. */
uint64_t kvp__seqtab_epoch(kvp_seqtab_t *t);

uint32_t kvp__seqtab_max_namespaces(const kvp_seqtab_t *t);

/* Software prefetch for a batch of lookups (a table of 65536 sequences is megabytes: every
 * probe is a cache miss). Stage 0 prefetches the hash slot of (ns, id); stage 1, issued a few
 * items later, reads that slot and prefetches the record it names. Only hints: no effect on
 * results. */
void kvp__seqtab_prefetch(const kvp_seqtab_t *t, uint32_t ns, uint64_t id, int stage);

#endif
