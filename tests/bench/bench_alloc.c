/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bench_alloc.c - page allocator microbenchmark: alloc+free operations per second on one
 * thread. One operation = one page reserved (kvp_alloc_reserve of 1 page) and freed again
 * (kvp_alloc_unref), in three patterns: single page alloc/free pairs, a decode-like pattern
 * (hold a working set, free and re-allocate at random positions), and batch reservations of
 * 64 pages. Prints the median of --rounds runs (and min/max). Target (DESIGN.md §7): >= 50M/s.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvp_alloc.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static volatile uint32_t sink;

/* pairs: reserve 1, unref it, n times */
static double run_pairs(kvp_alloc_t *a, uint64_t n)
{
    double t0 = now_s();
    uint32_t p = 0, acc = 0;
    for (uint64_t i = 0; i < n; i++) {
        kvp_alloc_reserve(a, 1, &p);
        acc += p;
        kvp_alloc_unref(a, p);
    }
    sink = acc;
    return n / (now_s() - t0);
}

/* working set: half the pool held; each op frees a random held page and takes a new one */
static double run_working_set(kvp_alloc_t *a, uint32_t pool, uint64_t n)
{
    uint32_t held_n = pool / 2;
    uint32_t *held = malloc(held_n * sizeof(uint32_t));
    kvp_alloc_reserve(a, held_n, held);
    uint64_t x = 88172645463325252ull;
    double t0 = now_s();
    for (uint64_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        uint32_t k = (uint32_t)((x >> 32) * held_n >> 32);
        kvp_alloc_unref(a, held[k]);
        kvp_alloc_reserve(a, 1, &held[k]);
    }
    double r = n / (now_s() - t0);
    for (uint32_t i = 0; i < held_n; i++)
        kvp_alloc_unref(a, held[i]);
    free(held);
    return r;
}

/* batches of 64 pages reserved at once, then freed */
static double run_batches(kvp_alloc_t *a, uint64_t n)
{
    uint32_t p[64];
    double t0 = now_s();
    for (uint64_t i = 0; i < n / 64; i++) {
        kvp_alloc_reserve(a, 64, p);
        for (int j = 0; j < 64; j++)
            kvp_alloc_unref(a, p[j]);
    }
    return (n / 64 * 64) / (now_s() - t0);
}

int main(int argc, char **argv)
{
    int rounds = 11;
    uint64_t ops = 20000000;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--rounds") && i + 1 < argc)
            rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ops") && i + 1 < argc)
            ops = strtoull(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: %s [--rounds N] [--ops N]\n", argv[0]);
            return 2;
        }
    }
    if (rounds < 1 || rounds > 1000)
        rounds = 11;
    const uint32_t pool = 1u << 20;
    kvp_alloc_t *a;
    if (kvp_alloc_create(pool, &a)) {
        fprintf(stderr, "cannot create allocator\n");
        return 1;
    }
    const char *names[3] = {"pairs (reserve 1 + free)", "working set (free random, reserve 1)",
                            "batch of 64 (reserve 64 + free 64)"};
    double *r = malloc(sizeof(double) * rounds);
    printf("allocator microbenchmark: pool %u pages, %llu ops per round, %d rounds, 1 thread\n",
           pool, (unsigned long long)ops, rounds);
    for (int kind = 0; kind < 3; kind++) {
        for (int i = 0; i < rounds; i++)
            r[i] = kind == 0   ? run_pairs(a, ops)
                   : kind == 1 ? run_working_set(a, pool, ops)
                               : run_batches(a, ops);
        qsort(r, rounds, sizeof(double), cmp_d);
        printf("  %-40s median %7.1f M ops/s  (min %.1f, max %.1f)  target 50 M/s: %s\n",
               names[kind], r[rounds / 2] / 1e6, r[0] / 1e6, r[rounds - 1] / 1e6,
               r[rounds / 2] >= 50e6 ? "met" : "MISSED");
    }
    free(r);
    kvp_alloc_destroy(a);
    return 0;
}
