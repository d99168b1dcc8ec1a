/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_loc.h - where a cached page's content lives: a medium and an index in it (issue #27, the
 * seams for tiers). In KVP_MEDIUM_GPU the index is the pool's page id (GPU memory on the cuda
 * backend, the pool memfd on the host backend); in KVP_MEDIUM_HOST it is a slot of the
 * host-memory tier (issue #28), which the prefix cache hands out (kvp_pcache.h). A plain value:
 * holding one holds nothing, and it does not say whether content is there (ask the prefix
 * cache).
 */
#ifndef KVP_LOC_H
#define KVP_LOC_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    KVP_MEDIUM_GPU = 0,  /* the pool: what sequences map and kernels read */
    KVP_MEDIUM_HOST = 1, /* the host tier: content kept for later, never handed out as a page */
    KVP_MEDIUMS = 2
} kvp_medium_t;

typedef struct {
    uint32_t medium; /* kvp_medium_t; KVP_MEDIUMS: no location */
    uint32_t index;  /* page id (GPU) or slot (host) */
} kvp_loc_t;

static inline kvp_loc_t kvp_loc(uint32_t medium, uint32_t index)
{
    kvp_loc_t l = {medium, index};
    return l;
}

/* "Nowhere": what a search that found nothing returns. */
static inline kvp_loc_t kvp_loc_none(void)
{
    return kvp_loc(KVP_MEDIUMS, UINT32_MAX);
}

static inline int kvp_loc_is_none(kvp_loc_t l)
{
    return l.medium >= KVP_MEDIUMS;
}

static inline int kvp_loc_eq(kvp_loc_t a, kvp_loc_t b)
{
    return a.medium == b.medium && a.index == b.index;
}

#ifdef __cplusplus
}
#endif
#endif
