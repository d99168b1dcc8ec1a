/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_dedup.c - retry windows (see kvp_dedup.h). A window is a ring of `window` entries with a
 * hash index of the slots in use by request id, allocated behind the ring: every mutating call
 * looks its id up once and answers once, and a linear scan of 1,024 entries was a visible part
 * of a decode step's Reserve. Kept answers are also on two lists, oldest first (the
 * namespace's and the daemon's), so either budget evicts in O(1).
 */
#include "kvp_dedup.h"

#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"

/* ---- hash index: open addressing, linear probing, backward-shift deletion ---- */

/* Slots of the index: a power of two, at least twice the window (so probes stay short). */
static uint32_t index_cap(uint32_t window)
{
    uint32_t c = 2;
    while (c < 2u * window)
        c <<= 1;
    return c;
}

/* Slot values are ring index + 1, 0 is empty. */
static uint32_t *index_of(const kvp_dedup_t *d, const kvp_dedup_window_t *w)
{
    return (uint32_t *)(void *)(w->ring + d->lim.window);
}

static uint32_t index_home(uint64_t req_id, uint32_t mask)
{
    uint64_t z = req_id * 0x9e3779b97f4a7c15ull;
    return (uint32_t)(z ^ (z >> 32)) & mask;
}

static void index_insert(const kvp_dedup_t *d, kvp_dedup_window_t *w, uint32_t slot)
{
    uint32_t *slots = index_of(d, w), mask = index_cap(d->lim.window) - 1;
    uint32_t i = index_home(w->ring[slot].req_id, mask);
    while (slots[i])
        i = (i + 1) & mask;
    slots[i] = slot + 1;
}

static void index_remove(const kvp_dedup_t *d, kvp_dedup_window_t *w, uint32_t slot)
{
    uint32_t *slots = index_of(d, w), mask = index_cap(d->lim.window) - 1;
    uint32_t i = index_home(w->ring[slot].req_id, mask);
    while (slots[i] != slot + 1)
        i = (i + 1) & mask; /* present: every slot in use is indexed */
    slots[i] = 0;
    for (uint32_t j = (i + 1) & mask; slots[j]; j = (j + 1) & mask) {
        uint32_t home = index_home(w->ring[slots[j] - 1].req_id, mask);
        /* move it back into the hole at i unless its home lies cyclically in (i, j] */
        int in_range = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!in_range) {
            slots[i] = slots[j];
            slots[j] = 0;
            i = j;
        }
    }
}

static kvp_dedup_entry_t *find(const kvp_dedup_t *d, uint32_t ns, uint64_t req_id)
{
    if (ns >= d->max_ns || req_id == 0 || !d->w[ns].ring)
        return NULL;
    const kvp_dedup_window_t *w = &d->w[ns];
    const uint32_t *slots = index_of(d, w);
    uint32_t mask = index_cap(d->lim.window) - 1;
    for (uint32_t i = index_home(req_id, mask); slots[i]; i = (i + 1) & mask)
        if (w->ring[slots[i] - 1].req_id == req_id)
            return &w->ring[slots[i] - 1];
    return NULL;
}

/* ---- kept answers ---- */

static void unkeep(kvp_dedup_t *d, kvp_dedup_entry_t *e)
{
    kvp_dedup_window_t *w = &d->w[e->ns];
    if (e->ns_older)
        e->ns_older->ns_newer = e->ns_newer;
    else
        w->oldest = e->ns_newer;
    if (e->ns_newer)
        e->ns_newer->ns_older = e->ns_older;
    else
        w->newest = e->ns_older;
    if (e->all_older)
        e->all_older->all_newer = e->all_newer;
    else
        d->oldest = e->all_newer;
    if (e->all_newer)
        e->all_newer->all_older = e->all_older;
    else
        d->newest = e->all_older;
    e->ns_older = e->ns_newer = e->all_older = e->all_newer = NULL;
    w->bytes -= e->len;
    d->bytes -= e->len;
    free(e->frame);
    e->frame = NULL;
    e->len = 0;
}

static void keep(kvp_dedup_t *d, kvp_dedup_entry_t *e, uint8_t *frame, uint32_t len)
{
    kvp_dedup_window_t *w = &d->w[e->ns];
    e->frame = frame;
    e->len = len;
    e->state = KVP_DEDUP_KEPT;
    e->ns_older = w->newest;
    if (w->newest)
        w->newest->ns_newer = e;
    else
        w->oldest = e;
    w->newest = e;
    e->all_older = d->newest;
    if (d->newest)
        d->newest->all_newer = e;
    else
        d->oldest = e;
    d->newest = e;
    w->bytes += len;
    d->bytes += len;
}

/* Drops the oldest answers until ns's window and the daemon are within budget (ns may be
 * UINT32_MAX: only the daemon's budget). The ids stay, as not kept. */
static void fit(kvp_dedup_t *d, uint32_t ns)
{
    while (ns < d->max_ns && d->w[ns].bytes > d->lim.ns_max_bytes) {
        kvp_dedup_entry_t *e = d->w[ns].oldest;
        unkeep(d, e);
        e->state = KVP_DEDUP_NOT_KEPT;
        d->evictions_total++;
    }
    while (d->bytes > d->lim.max_bytes) {
        kvp_dedup_entry_t *e = d->oldest;
        unkeep(d, e);
        e->state = KVP_DEDUP_NOT_KEPT;
        d->evictions_total++;
    }
}

/* Frees ring slot `slot` of w (its id leaves the window). */
static void release_slot(kvp_dedup_t *d, kvp_dedup_window_t *w, uint32_t slot)
{
    kvp_dedup_entry_t *e = &w->ring[slot];
    if (e->state == KVP_DEDUP_FREE)
        return;
    if (e->state == KVP_DEDUP_KEPT)
        unkeep(d, e);
    index_remove(d, w, slot);
    e->state = KVP_DEDUP_FREE;
    e->req_id = 0;
    w->entries--;
}

/* ---- the API ---- */

int kvp_dedup_init(kvp_dedup_t *d, uint32_t max_ns, const kvp_dedup_limits_t *lim)
{
    memset(d, 0, sizeof(*d));
    if (!max_ns || !lim || !lim->window)
        return KVP_EINVAL;
    d->w = calloc(max_ns, sizeof(*d->w));
    if (!d->w)
        return KVP_ENOMEM;
    d->max_ns = max_ns;
    d->lim = *lim;
    return 0;
}

void kvp_dedup_free(kvp_dedup_t *d)
{
    if (!d->w)
        return;
    for (uint32_t i = 0; i < d->max_ns; i++)
        kvp_dedup_close(d, i);
    free(d->w);
    d->w = NULL;
}

void kvp_dedup_set_budgets(kvp_dedup_t *d, uint64_t ns_max_bytes, uint64_t max_bytes)
{
    d->lim.ns_max_bytes = ns_max_bytes;
    d->lim.max_bytes = max_bytes;
    for (uint32_t i = 0; i < d->max_ns; i++)
        if (d->w[i].ring)
            fit(d, i);
}

int kvp_dedup_open(kvp_dedup_t *d, uint32_t ns)
{
    if (ns >= d->max_ns)
        return KVP_EINVAL;
    kvp_dedup_window_t *w = &d->w[ns];
    if (w->ring)
        return 0;
    w->ring = calloc(1, (size_t)d->lim.window * sizeof(*w->ring) +
                            (size_t)index_cap(d->lim.window) * sizeof(uint32_t));
    if (!w->ring)
        return KVP_ENOMEM;
    for (uint32_t i = 0; i < d->lim.window; i++)
        w->ring[i].ns = ns;
    return 0;
}

void kvp_dedup_close(kvp_dedup_t *d, uint32_t ns)
{
    if (ns >= d->max_ns || !d->w[ns].ring)
        return;
    kvp_dedup_window_t *w = &d->w[ns];
    for (uint32_t i = 0; i < d->lim.window; i++)
        if (w->ring[i].state == KVP_DEDUP_KEPT)
            unkeep(d, &w->ring[i]);
    free(w->ring);
    memset(w, 0, sizeof(*w));
}

const kvp_dedup_entry_t *kvp_dedup_find(const kvp_dedup_t *d, uint32_t ns, uint64_t req_id)
{
    return find(d, ns, req_id);
}

int kvp_dedup_begin(kvp_dedup_t *d, uint32_t ns, uint64_t req_id, uint16_t call, uint64_t digest)
{
    if (ns >= d->max_ns || req_id == 0 || !d->w[ns].ring)
        return KVP_EINVAL;
    kvp_dedup_window_t *w = &d->w[ns];
    const uint32_t W = d->lim.window;
    uint32_t slot = w->next, tries = 0;
    while (w->ring[slot].state == KVP_DEDUP_IN_FLIGHT) {
        if (++tries == W)
            return KVP_EBUSY;
        slot = (slot + 1) % W;
    }
    w->next = (slot + 1) % W;
    release_slot(d, w, slot);
    kvp_dedup_entry_t *e = &w->ring[slot];
    e->req_id = req_id;
    e->digest = digest;
    e->call = call;
    e->state = KVP_DEDUP_IN_FLIGHT;
    index_insert(d, w, slot);
    w->entries++;
    return 0;
}

void kvp_dedup_answer(kvp_dedup_t *d, uint32_t ns, uint64_t req_id, const uint8_t *frame,
                      uint32_t len)
{
    kvp_dedup_entry_t *e = find(d, ns, req_id);
    if (!e || e->state != KVP_DEDUP_IN_FLIGHT)
        return;
    e->state = KVP_DEDUP_NOT_KEPT;
    if (!frame || len > d->lim.max_entry_bytes || len > d->lim.ns_max_bytes ||
        len > d->lim.max_bytes)
        return;
    uint8_t *copy = malloc(len ? len : 1);
    if (!copy)
        return;
    memcpy(copy, frame, len);
    keep(d, e, copy, len);
    fit(d, ns);
}

void kvp_dedup_forget(kvp_dedup_t *d, uint32_t ns, uint64_t req_id)
{
    kvp_dedup_entry_t *e = find(d, ns, req_id);
    if (!e || e->state != KVP_DEDUP_IN_FLIGHT)
        return;
    kvp_dedup_window_t *w = &d->w[ns];
    release_slot(d, w, (uint32_t)(e - w->ring));
}

/* Four independent multiply chains over 32-byte blocks (a Reserve of a 256-sequence decode step
 * is 3 KB: one chain would be latency-bound at ~4 cycles per 8 bytes), then the tail and a
 * final mix. */
uint64_t kvp_dedup_digest(const uint8_t *p, size_t len)
{
    const uint64_t m = 0x9e3779b97f4a7c15ull;
    uint64_t h[4] = {0x243f6a8885a308d3ull ^ len, 0x13198a2e03707344ull, 0xa4093822299f31d0ull,
                     0x082efa98ec4e6c89ull};
    size_t i = 0;
    for (; i + 32 <= len; i += 32)
        for (int k = 0; k < 4; k++) {
            uint64_t v;
            memcpy(&v, p + i + 8 * k, 8);
            h[k] = (h[k] ^ v) * m;
            h[k] ^= h[k] >> 31;
        }
    for (; i + 8 <= len; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        h[0] = (h[0] ^ v) * m;
        h[0] ^= h[0] >> 31;
    }
    uint64_t v = 0;
    if (len > i)
        memcpy(&v, p + i, len - i);
    uint64_t x = ((h[0] ^ v) * m) ^ (h[1] * 0xbf58476d1ce4e5b9ull);
    x ^= (h[2] * 0x94d049bb133111ebull) ^ (h[3] * m);
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    return x ^ (x >> 32);
}
