/*
 * kvp_ns.c - namespace table, leases and dedup windows (see kvp_ns.h). The dedup window is a
 * ring of dedup_window (default 1024) entries with a hash index of the entries in use by
 * request id, allocated behind the ring: every mutating call looks its id up twice (replay,
 * then the answer), and two linear scans of the ring were a visible part of a decode step's
 * Reserve. The index only speeds the lookup up; it finds the entry the scan of the ring would
 * (the first in ring order with that id).
 */
#include "kvp_ns.h"

#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"

#define DEDUP_MAX_ENTRY_BYTES (256u << 10)

int kvp_ns_table_init(kvp_ns_table_t *t, uint32_t max_namespaces, uint32_t dedup_window)
{
    memset(t, 0, sizeof(*t));
    if (max_namespaces == 0)
        return KVP_EINVAL;
    t->ns = calloc(max_namespaces, sizeof(*t->ns));
    if (!t->ns)
        return KVP_ENOMEM;
    t->max = max_namespaces;
    t->dedup_window = dedup_window;
    t->dedup_max_entry_bytes = DEDUP_MAX_ENTRY_BYTES;
    return 0;
}

/* ---- dedup index: open addressing, linear probing, backward-shift deletion ---- */

/* Slots of the index: a power of two, at least twice the window (so probes stay short). */
static uint32_t index_cap(uint32_t window)
{
    uint32_t c = 2;
    while (c < 2u * window)
        c <<= 1;
    return c;
}

/* The index lives right behind the ring, in the same allocation: slot values are ring
 * index + 1, 0 is empty. */
static uint32_t *index_of(const kvp_ns_t *n, uint32_t window)
{
    return (uint32_t *)(void *)(n->dedup + window);
}

static uint32_t index_home(uint64_t req_id, uint32_t mask)
{
    uint64_t z = req_id * 0x9e3779b97f4a7c15ull;
    return (uint32_t)(z ^ (z >> 32)) & mask;
}

static void index_insert(kvp_ns_t *n, uint32_t window, uint32_t ring_idx)
{
    uint32_t *slots = index_of(n, window), mask = index_cap(window) - 1;
    uint32_t i = index_home(n->dedup[ring_idx].req_id, mask);
    while (slots[i])
        i = (i + 1) & mask;
    slots[i] = ring_idx + 1;
}

static void index_remove(kvp_ns_t *n, uint32_t window, uint32_t ring_idx)
{
    uint32_t *slots = index_of(n, window), mask = index_cap(window) - 1;
    uint32_t i = index_home(n->dedup[ring_idx].req_id, mask);
    while (slots[i] != ring_idx + 1)
        i = (i + 1) & mask; /* present: every entry in use is indexed */
    slots[i] = 0;
    for (uint32_t j = (i + 1) & mask; slots[j]; j = (j + 1) & mask) {
        uint32_t home = index_home(n->dedup[slots[j] - 1].req_id, mask);
        /* move it back into the hole at i unless its home lies cyclically in (i, j] */
        int in_range = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!in_range) {
            slots[i] = slots[j];
            slots[j] = 0;
            i = j;
        }
    }
}

static void dedup_clear(kvp_ns_t *n, uint32_t window)
{
    if (!n->dedup)
        return;
    for (uint32_t i = 0; i < window; i++)
        free(n->dedup[i].frame);
    free(n->dedup);
    n->dedup = NULL;
    n->dedup_next = 0;
    n->dedup_bytes = 0;
}

void kvp_ns_table_free(kvp_ns_table_t *t)
{
    if (!t->ns)
        return;
    for (uint32_t i = 0; i < t->max; i++)
        dedup_clear(&t->ns[i], t->dedup_window);
    free(t->ns);
    t->ns = NULL;
}

int kvp_ns_attach(kvp_ns_table_t *t, const char *name, uint32_t uid, uint32_t lease_ms,
                  int set_lease, uint32_t *id)
{
    size_t len = name ? strlen(name) : 0;
    if (len == 0 || len > KVP_NS_NAME_MAX)
        return KVP_EINVAL;
    int free_slot = -1;
    for (uint32_t i = 0; i < t->max; i++) {
        kvp_ns_t *n = &t->ns[i];
        if (!n->in_use) {
            if (free_slot < 0)
                free_slot = (int)i;
            continue;
        }
        if (strcmp(n->name, name) == 0) {
            if (n->owner_uid != uid && uid != 0)
                return KVP_EPERM;
            n->sessions++;
            if (set_lease)
                n->lease_ms = lease_ms;
            n->expires_at_ms = 0;
            *id = i;
            return 0;
        }
    }
    if (free_slot < 0)
        return KVP_ELIMIT;
    kvp_ns_t *n = &t->ns[free_slot];
    memset(n, 0, sizeof(*n));
    if (t->dedup_window) {
        n->dedup = calloc(1, (size_t)t->dedup_window * sizeof(*n->dedup) +
                                 (size_t)index_cap(t->dedup_window) * sizeof(uint32_t));
        if (!n->dedup)
            return KVP_ENOMEM;
    }
    memcpy(n->name, name, len + 1);
    n->in_use = 1;
    n->owner_uid = uid;
    n->sessions = 1;
    n->lease_ms = lease_ms;
    *id = (uint32_t)free_slot;
    return 0;
}

int kvp_ns_find(const kvp_ns_table_t *t, const char *name)
{
    for (uint32_t i = 0; i < t->max; i++)
        if (t->ns[i].in_use && strcmp(t->ns[i].name, name) == 0)
            return (int)i;
    return -1;
}

int kvp_ns_detach(kvp_ns_table_t *t, uint32_t id, uint64_t now_ms)
{
    kvp_ns_t *n = &t->ns[id];
    if (!n->in_use || n->sessions == 0)
        return 0;
    if (--n->sessions)
        return 0;
    if (n->lease_ms == 0)
        return 1;
    n->expires_at_ms = now_ms + n->lease_ms;
    return 0;
}

int kvp_ns_next_expired(kvp_ns_table_t *t, uint64_t now_ms)
{
    for (uint32_t i = 0; i < t->max; i++) {
        kvp_ns_t *n = &t->ns[i];
        if (n->in_use && n->sessions == 0 && n->expires_at_ms && n->expires_at_ms <= now_ms) {
            n->expires_at_ms = 0;
            return (int)i;
        }
    }
    return -1;
}

void kvp_ns_forget(kvp_ns_table_t *t, uint32_t id)
{
    kvp_ns_t *n = &t->ns[id];
    if (!n->in_use || n->sessions)
        return;
    dedup_clear(n, t->dedup_window);
    memset(n, 0, sizeof(*n));
}

uint64_t kvp_ns_next_deadline(const kvp_ns_table_t *t)
{
    uint64_t best = UINT64_MAX;
    for (uint32_t i = 0; i < t->max; i++) {
        const kvp_ns_t *n = &t->ns[i];
        if (n->in_use && n->sessions == 0 && n->expires_at_ms && n->expires_at_ms < best)
            best = n->expires_at_ms;
    }
    return best;
}

/* The first entry in ring order that is in use with req_id, or NULL. */
static kvp_dedup_entry_t *find(const kvp_ns_table_t *t, uint32_t id, uint64_t req_id)
{
    const kvp_ns_t *n = &t->ns[id];
    if (!n->dedup || req_id == 0)
        return NULL;
    const uint32_t *slots = index_of(n, t->dedup_window);
    uint32_t mask = index_cap(t->dedup_window) - 1, best = 0;
    /* every entry with req_id sits in this probe run; a window holds one per id unless a
     * caller began an id twice, and then the scan of the ring found the first */
    for (uint32_t i = index_home(req_id, mask); slots[i]; i = (i + 1) & mask)
        if (n->dedup[slots[i] - 1].req_id == req_id && (!best || slots[i] < best))
            best = slots[i];
    return best ? &n->dedup[best - 1] : NULL;
}

const kvp_dedup_entry_t *kvp_ns_dedup_find(const kvp_ns_table_t *t, uint32_t id, uint64_t req_id)
{
    return find(t, id, req_id);
}

void kvp_ns_dedup_begin(kvp_ns_table_t *t, uint32_t id, uint64_t req_id)
{
    kvp_ns_t *n = &t->ns[id];
    if (!n->dedup || req_id == 0)
        return;
    uint32_t slot = n->dedup_next;
    kvp_dedup_entry_t *e = &n->dedup[slot];
    n->dedup_next = (n->dedup_next + 1) % t->dedup_window;
    if (e->state)
        index_remove(n, t->dedup_window, slot);
    n->dedup_bytes -= e->len;
    free(e->frame);
    e->frame = NULL;
    e->len = 0;
    e->req_id = req_id;
    e->state = 1;
    index_insert(n, t->dedup_window, slot);
}

void kvp_ns_dedup_end(kvp_ns_table_t *t, uint32_t id, uint64_t req_id, const uint8_t *frame,
                      uint32_t len)
{
    kvp_dedup_entry_t *e = find(t, id, req_id);
    if (!e || e->state != 1)
        return;
    e->state = 3;
    if (len > t->dedup_max_entry_bytes)
        return;
    e->frame = malloc(len);
    if (!e->frame)
        return;
    memcpy(e->frame, frame, len);
    e->len = len;
    e->state = 2;
    t->ns[id].dedup_bytes += len;
}
