/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_events.c - the KV-event batcher (kvp_events.h): on the loop thread, the prefix cache's
 * observer copies each block event into the open batch (a record of fixed size, the page's
 * token ids into the batch's token array, the scope's name once per run of the same scope);
 * kvp_events_flush numbers the batch and hands it to the sink. Nothing here encodes or sends:
 * the publisher's thread does, so the cost on the loop is a copy per block.
 */
#include "kvp_events.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvp_error.h"

struct kvp_events {
    uint32_t block_size;
    kvp_ev_sink_fn sink;
    void *sink_ctx;
    kvp_ev_scope_fn scope_fn;
    void *scope_ctx;
    kvp_ev_batch_t *open;
    uint64_t open_ms; /* when the open batch took its first record (CLOCK_MONOTONIC) */
    uint64_t next_seq;
    uint64_t lost;
    uint32_t last_n, last_ntok, last_nnames; /* the last batch's sizes: the next one's start */
    /* the open batch's last scope and where its name is */
    uint32_t last_scope, last_off;
    kvp_pagekey_t last_tag;
};

int kvp_events_create(uint32_t block_size, kvp_ev_sink_fn sink, void *sink_ctx,
                      kvp_ev_scope_fn scope_fn, void *scope_ctx, kvp_events_t **out)
{
    if (!out || !sink || !scope_fn || block_size == 0)
        return KVP_EINVAL;
    kvp_events_t *e = calloc(1, sizeof(*e));
    if (!e)
        return KVP_ENOMEM;
    e->block_size = block_size;
    e->sink = sink;
    e->sink_ctx = sink_ctx;
    e->scope_fn = scope_fn;
    e->scope_ctx = scope_ctx;
    *out = e;
    return 0;
}

void kvp_events_destroy(kvp_events_t *e)
{
    if (!e)
        return;
    kvp_ev_batch_free(e->open);
    free(e);
}

void kvp_events_hash(kvp_pagekey_t key, kvp_pagekey_t tag, uint8_t out[KVP_EV_HASH_BYTES])
{
    const uint64_t hi = key.hi ^ tag.hi, lo = key.lo ^ tag.lo;
    for (int i = 0; i < 8; i++) {
        out[i] = (uint8_t)(hi >> (56 - 8 * i));
        out[8 + i] = (uint8_t)(lo >> (56 - 8 * i));
    }
}

/* Grows *p (n elements of size sz used, *cap room) to hold want more; 0 or KVP_ENOMEM. */
static int reserve(void **p, uint32_t *cap, uint32_t n, uint32_t want, size_t sz)
{
    if ((uint64_t)n + want <= *cap)
        return 0;
    uint64_t c = *cap ? (uint64_t)*cap * 2 : 64;
    while (c < (uint64_t)n + want)
        c *= 2;
    if (c > UINT32_MAX)
        return KVP_ENOMEM;
    void *q = realloc(*p, (size_t)c * sz);
    if (!q)
        return KVP_ENOMEM;
    *p = q;
    *cap = (uint32_t)c;
    return 0;
}

/* The open batch (a new one when none is open), or NULL. */
static kvp_ev_batch_t *open_batch(kvp_events_t *e)
{
    if (!e->open) {
        e->open = calloc(1, sizeof(*e->open));
        if (!e->open)
            return NULL;
        e->open->block_size = e->block_size;
        e->last_scope = UINT32_MAX;
        /* room for as much as the last batch held, so a batch grows by realloc rarely (each
         * growth copies it); a failure here only leaves the room to grow later */
        kvp_ev_batch_t *b = e->open;
        if (e->last_n && reserve((void **)&b->rec, &b->cap, 0, e->last_n, sizeof(*b->rec)) == 0)
            (void)reserve((void **)&b->tok, &b->tokcap, 0, e->last_ntok, 4);
        if (e->last_nnames)
            (void)reserve((void **)&b->names, &b->namescap, 0, e->last_nnames, 1);
        e->open_ms = kvp_events_now_ms();
    }
    return e->open;
}

/* A new record in the open batch, zeroed, or NULL (counted as lost). */
static kvp_ev_rec_t *new_rec(kvp_events_t *e, kvp_ev_batch_t **bp)
{
    kvp_ev_batch_t *b = open_batch(e);
    if (!b || reserve((void **)&b->rec, &b->cap, b->n, 1, sizeof(*b->rec))) {
        e->lost++;
        return NULL;
    }
    *bp = b;
    kvp_ev_rec_t *r = &b->rec[b->n];
    memset(r, 0, sizeof(*r));
    return r;
}

/* The scope's tag, and (with names) its name's offset in b, written once per run of a scope. */
static int scope_of(kvp_events_t *e, kvp_ev_batch_t *b, uint32_t scope, int names,
                    kvp_pagekey_t *tag, uint32_t *off)
{
    if (scope == e->last_scope && (!names || e->last_off != UINT32_MAX)) {
        *tag = e->last_tag;
        *off = e->last_off;
        return 0;
    }
    const char *name = "";
    e->scope_fn(e->scope_ctx, scope, &name, tag);
    uint32_t o = UINT32_MAX;
    if (names) {
        const uint32_t len = (uint32_t)strlen(name) + 1;
        if (reserve((void **)&b->names, &b->namescap, b->nnames, len, 1))
            return KVP_ENOMEM;
        memcpy(b->names + b->nnames, name, len);
        o = b->nnames;
        b->nnames += len;
    }
    e->last_scope = scope;
    e->last_tag = *tag;
    e->last_off = o;
    *off = o;
    return 0;
}

void kvp_events_observe(void *ctx, const kvp_pcache_event_t *ev)
{
    kvp_events_t *e = ctx;
    kvp_ev_batch_t *b;
    kvp_ev_rec_t *r = new_rec(e, &b);
    if (!r)
        return;
    if (ev->kind == KVP_PCEV_CLEARED) {
        r->kind = KVP_EV_CLEARED;
        b->n++;
        return;
    }
    const int stored = ev->kind == KVP_PCEV_STORED;
    kvp_pagekey_t tag;
    uint32_t off;
    if (scope_of(e, b, ev->scope, stored, &tag, &off) ||
        (stored && reserve((void **)&b->tok, &b->tokcap, b->ntok, e->block_size, 4))) {
        e->lost++;
        return;
    }
    r->kind = stored ? KVP_EV_STORED : KVP_EV_REMOVED;
    r->medium = ev->medium == KVP_MEDIUM_HOST ? KVP_EV_CPU : KVP_EV_GPU;
    kvp_events_hash(ev->key, tag, r->hash);
    if (stored) {
        r->scope_off = off;
        r->has_parent = ev->has_parent ? 1 : 0;
        if (ev->has_parent)
            kvp_events_hash(ev->parent, tag, r->parent);
        r->tok_off = b->ntok;
        if (ev->tokens)
            memcpy(b->tok + b->ntok, ev->tokens, (size_t)e->block_size * 4);
        else
            memset(b->tok + b->ntok, 0, (size_t)e->block_size * 4);
        b->ntok += e->block_size;
    }
    b->n++;
}

void kvp_events_clear(kvp_events_t *e)
{
    kvp_pcache_event_t ev = {.kind = KVP_PCEV_CLEARED};
    kvp_events_observe(e, &ev);
}

void kvp_events_flush(kvp_events_t *e)
{
    kvp_ev_batch_t *b = e->open;
    if (!b || b->n == 0)
        return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    b->ts = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    b->seq = e->next_seq++;
    e->last_n = b->n;
    e->last_ntok = b->ntok;
    e->last_nnames = b->nnames;
    e->open = NULL;
    e->sink(e->sink_ctx, b);
}

uint64_t kvp_events_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

int kvp_events_open(const kvp_events_t *e)
{
    return e->open && e->open->n;
}

uint32_t kvp_events_due_in(const kvp_events_t *e, uint64_t now_ms, uint32_t batch_ms)
{
    if (!kvp_events_open(e))
        return UINT32_MAX;
    const uint64_t due = e->open_ms + batch_ms;
    if (e->open->n >= KVP_EV_BATCH_MAX_RECORDS || now_ms >= due)
        return 0;
    return (uint32_t)(due - now_ms);
}

void kvp_events_forget_scope(kvp_events_t *e)
{
    e->last_scope = UINT32_MAX;
}

uint64_t kvp_events_next_seq(const kvp_events_t *e)
{
    return e->next_seq;
}

uint64_t kvp_events_lost(const kvp_events_t *e)
{
    return e->lost;
}
