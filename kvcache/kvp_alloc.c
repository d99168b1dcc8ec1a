/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_alloc.c - free-stack page allocator with refcounts. See kvp_alloc.h.
 *
 * Layout: one array of refcounts and one array used as the free stack. The stack is filled
 * so that page 0 is popped first, which keeps fresh pools' page tables readable
 * (arange-like) and makes tests deterministic.
 */
#include "kvp_alloc.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_pcache_internal.h"

struct kvp_alloc {
    uint32_t num_pages;
    uint32_t num_free; /* depth of the free stack */
    uint32_t num_shared;
    uint32_t num_pinned_free; /* refcount 0, pinned: off the stack until unpinned */
    uint32_t *refcount;       /* [num_pages] */
    uint32_t *pins;           /* [num_pages] */
    uint32_t *stack;          /* [num_pages]; stack[0..num_free) are free page ids, top last */
    struct kvp_pcache *pc;    /* the prefix cache keeping indexed pages at refcount 0, or NULL */
};

void kvp__alloc_set_cache(kvp_alloc_t *a, struct kvp_pcache *pc)
{
    a->pc = pc;
}

/* A page whose last reference and last pin went: the cache keeps it (indexed) or it is free. */
static inline void page_zero(kvp_alloc_t *a, uint32_t page)
{
    if (!a->pc || !kvp__pcache_on_zero(a->pc, page))
        a->stack[a->num_free++] = page;
}

void kvp__alloc_push_free(kvp_alloc_t *a, uint32_t page)
{
    assert(page < a->num_pages && a->refcount[page] == 0 && !a->pins[page]);
    a->stack[a->num_free++] = page;
}

void kvp__alloc_revive(kvp_alloc_t *a, uint32_t page)
{
    assert(page < a->num_pages && a->refcount[page] == 0);
    if (a->pins[page])
        a->num_pinned_free--; /* released while a copy pinned it: held again */
    a->refcount[page] = 1;
}

uint32_t kvp_alloc_num_cached(const kvp_alloc_t *a)
{
    return a->pc ? kvp__pcache_num_cached(a->pc) : 0;
}

uint32_t kvp_alloc_num_demoting(const kvp_alloc_t *a)
{
    return a->pc ? kvp__pcache_num_demoting(a->pc) : 0;
}

uint32_t kvp_alloc_num_available(const kvp_alloc_t *a)
{
    return a->num_free + kvp_alloc_num_cached(a);
}

int kvp_alloc_create(uint32_t num_pages, kvp_alloc_t **out)
{
    if (!out || num_pages == 0 || num_pages > 0x7fffffffu)
        return KVP_EINVAL;
    kvp_alloc_t *a = calloc(1, sizeof(*a));
    if (!a)
        goto fail_struct;
    a->refcount = calloc(num_pages, sizeof(uint32_t));
    if (!a->refcount)
        goto fail_refcount;
    a->pins = calloc(num_pages, sizeof(uint32_t));
    if (!a->pins)
        goto fail_pins;
    a->stack = malloc((size_t)num_pages * sizeof(uint32_t));
    if (!a->stack)
        goto fail_stack;
    a->num_pages = num_pages;
    a->num_free = num_pages;
    for (uint32_t i = 0; i < num_pages; i++)
        a->stack[i] = num_pages - 1 - i;
    *out = a;
    return 0;

fail_stack:
    free(a->pins);
fail_pins:
    free(a->refcount);
fail_refcount:
    free(a);
fail_struct:
    return KVP_ENOMEM;
}

void kvp_alloc_destroy(kvp_alloc_t *a)
{
    if (!a)
        return;
    free(a->stack);
    free(a->pins);
    free(a->refcount);
    free(a);
}

int kvp_alloc_reserve(kvp_alloc_t *a, uint32_t n, uint32_t *pages)
{
    if (n > a->num_free && (!a->pc || n - a->num_free > kvp__pcache_num_cached(a->pc)))
        return KVP_ENOSPC;
    uint32_t top = a->num_free, from_stack = n < top ? n : top;
    for (uint32_t i = 0; i < from_stack; i++) {
        uint32_t p = a->stack[--top];
        assert(a->refcount[p] == 0);
        a->refcount[p] = 1;
        pages[i] = p;
    }
    a->num_free = top;
    for (uint32_t i = from_stack; i < n; i++) { /* then the cache's, in eviction order */
        uint32_t p = kvp__pcache_evict(a->pc);
        assert(p < a->num_pages && a->refcount[p] == 0 && !a->pins[p]);
        a->refcount[p] = 1;
        pages[i] = p;
    }
    return 0;
}

void kvp_alloc_ref(kvp_alloc_t *a, uint32_t page)
{
    assert(page < a->num_pages && a->refcount[page] >= 1);
    if (++a->refcount[page] == 2)
        a->num_shared++;
}

uint32_t kvp_alloc_unref(kvp_alloc_t *a, uint32_t page)
{
    assert(page < a->num_pages && a->refcount[page] >= 1);
    uint32_t rc = --a->refcount[page];
    if (rc == 1)
        a->num_shared--;
    else if (rc == 0) {
        if (a->pins[page])
            a->num_pinned_free++;
        else
            page_zero(a, page);
    }
    return rc;
}

void kvp_alloc_pin(kvp_alloc_t *a, uint32_t page)
{
    assert(page < a->num_pages && a->refcount[page] >= 1);
    a->pins[page]++;
}

void kvp_alloc_unpin(kvp_alloc_t *a, uint32_t page)
{
    assert(page < a->num_pages && a->pins[page] >= 1);
    if (--a->pins[page] == 0 && a->refcount[page] == 0) {
        a->num_pinned_free--;
        page_zero(a, page);
    }
}

uint32_t kvp_alloc_pins(const kvp_alloc_t *a, uint32_t page)
{
    return page < a->num_pages ? a->pins[page] : 0;
}

uint32_t kvp_alloc_num_pinned_free(const kvp_alloc_t *a)
{
    return a->num_pinned_free;
}

uint32_t kvp_alloc_refcount(const kvp_alloc_t *a, uint32_t page)
{
    return page < a->num_pages ? a->refcount[page] : 0;
}

const uint32_t *kvp__alloc_refcounts(const kvp_alloc_t *a)
{
    return a->refcount;
}

uint32_t kvp_alloc_num_pages(const kvp_alloc_t *a)
{
    return a->num_pages;
}

uint32_t kvp_alloc_num_free(const kvp_alloc_t *a)
{
    return a->num_free;
}

uint32_t kvp_alloc_num_shared(const kvp_alloc_t *a)
{
    return a->num_shared;
}

const uint32_t *kvp_alloc_free_stack(const kvp_alloc_t *a, uint32_t *n)
{
    *n = a->num_free;
    return a->stack;
}

int kvp_alloc_audit(const kvp_alloc_t *a, char *msg, unsigned msg_len)
{
    uint8_t *seen = calloc(a->num_pages, 1);
    if (!seen)
        return KVP_ENOMEM;
    int rc = 0;
    uint32_t shared = 0, zero = 0, pinned_free = 0;
    for (uint32_t i = 0; i < a->num_free && !rc; i++) {
        uint32_t p = a->stack[i];
        if (p >= a->num_pages) {
            snprintf(msg, msg_len, "free stack entry %u holds page %u >= num_pages %u", i, p,
                     a->num_pages);
            rc = KVP_EAUDIT;
        } else if (seen[p]) {
            snprintf(msg, msg_len, "page %u is on the free stack twice", p);
            rc = KVP_EAUDIT;
        } else if (a->refcount[p] != 0) {
            snprintf(msg, msg_len, "page %u is on the free stack with refcount %u", p,
                     a->refcount[p]);
            rc = KVP_EAUDIT;
        } else if (a->pins[p] != 0) {
            snprintf(msg, msg_len, "page %u is on the free stack with %u pins", p, a->pins[p]);
            rc = KVP_EAUDIT;
        } else {
            seen[p] = 1;
        }
    }
    uint32_t cached = 0, demoting = 0;
    for (uint32_t p = 0; p < a->num_pages && !rc; p++) {
        const int in_cache = a->pc && kvp__pcache_is_cached(a->pc, p);
        const int in_demotion = a->pc && kvp__pcache_is_demoting(a->pc, p);
        if (in_cache && in_demotion) {
            snprintf(msg, msg_len, "page %u is both cached and demoting", p);
            rc = KVP_EAUDIT;
        } else if ((in_cache || in_demotion) && (seen[p] || a->refcount[p] || a->pins[p])) {
            snprintf(msg, msg_len, "%s page %u: refcount %u, %u pins, %s the free stack",
                     in_cache ? "cached" : "demoting", p, a->refcount[p], a->pins[p],
                     seen[p] ? "on" : "off");
            rc = KVP_EAUDIT;
        } else if (a->refcount[p] == 0 && !a->pins[p] && !seen[p] && !in_cache && !in_demotion) {
            snprintf(msg, msg_len, "page %u has refcount 0 but is not on the free stack", p);
            rc = KVP_EAUDIT;
        }
        cached += in_cache;
        demoting += in_demotion;
        zero += a->refcount[p] == 0 && !a->pins[p] && !in_cache && !in_demotion;
        pinned_free += a->refcount[p] == 0 && a->pins[p];
        shared += a->refcount[p] > 1;
    }
    if (!rc && zero != a->num_free) {
        snprintf(msg, msg_len, "free count %u but %u pages have refcount 0", a->num_free, zero);
        rc = KVP_EAUDIT;
    }
    if (!rc && cached != kvp_alloc_num_cached(a)) {
        snprintf(msg, msg_len, "cached count %u but %u pages are cached", kvp_alloc_num_cached(a),
                 cached);
        rc = KVP_EAUDIT;
    }
    if (!rc && demoting != kvp_alloc_num_demoting(a)) {
        snprintf(msg, msg_len, "demoting count %u but %u pages are demoting",
                 kvp_alloc_num_demoting(a), demoting);
        rc = KVP_EAUDIT;
    }
    if (!rc && pinned_free != a->num_pinned_free) {
        snprintf(msg, msg_len, "pinned-free count %u but %u pages are free and pinned",
                 a->num_pinned_free, pinned_free);
        rc = KVP_EAUDIT;
    }
    if (!rc && shared != a->num_shared) {
        snprintf(msg, msg_len, "shared count %u but %u pages have refcount > 1", a->num_shared,
                 shared);
        rc = KVP_EAUDIT;
    }
    free(seen);
    return rc;
}
