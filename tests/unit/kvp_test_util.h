/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_test_util.h - small helpers shared by the unit tests: a deterministic PRNG (so every
 * random test is reproducible from its printed seed) and byte-pattern helpers.
 */
#ifndef KVP_TEST_UTIL_H
#define KVP_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t s;
} kvp_rng_t;

void kvp_rng_seed(kvp_rng_t *r, uint64_t seed);
uint64_t kvp_rng_next(kvp_rng_t *r);
/* uniform in [0, n), n > 0 */
uint32_t kvp_rng_below(kvp_rng_t *r, uint32_t n);
/* fills n bytes with random bytes */
void kvp_rng_fill(kvp_rng_t *r, void *p, size_t n);

/* Seed for random tests: KVP_TEST_SEED from the environment, else `dflt`. */
uint64_t kvp_test_seed(uint64_t dflt);

#endif

/* A cheap assertion for hot loops: Check's ck_assert_* report every passing assertion to the
 * parent process (a pipe write each), which makes loops over millions of checks slow. This
 * only calls into Check when the condition fails. Needs <check.h>. */
#define KVP_CHECK(cond, ...)                                                                       \
    do {                                                                                           \
        if (!(cond))                                                                               \
            ck_abort_msg(__VA_ARGS__);                                                             \
    } while (0)
