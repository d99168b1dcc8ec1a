/* SPDX-License-Identifier: Apache-2.0 */
/* kvp_test_util.c - see kvp_test_util.h. splitmix64: tiny, fast, good enough for tests. */
#include "kvp_test_util.h"

#include <stdlib.h>
#include <string.h>

void kvp_rng_seed(kvp_rng_t *r, uint64_t seed)
{
    r->s = seed;
}

uint64_t kvp_rng_next(kvp_rng_t *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint32_t kvp_rng_below(kvp_rng_t *r, uint32_t n)
{
    return (uint32_t)((kvp_rng_next(r) >> 32) * n >> 32);
}

void kvp_rng_fill(kvp_rng_t *r, void *p, size_t n)
{
    unsigned char *b = p;
    while (n >= 8) {
        uint64_t v = kvp_rng_next(r);
        memcpy(b, &v, 8);
        b += 8;
        n -= 8;
    }
    if (n) {
        uint64_t v = kvp_rng_next(r);
        memcpy(b, &v, n);
    }
}

uint64_t kvp_test_seed(uint64_t dflt)
{
    const char *s = getenv("KVP_TEST_SEED");
    return s && *s ? strtoull(s, NULL, 0) : dflt;
}
