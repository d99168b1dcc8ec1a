/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bench_pagekey.c - content keys of full pages (kvcache/kvp_pagekey.h) on one core: the keys
 * of a 32K-token prompt (one kvp_pagekey_chain call) at page sizes 16, 32 and 64, in tokens
 * per second; the median of --rounds rounds of 20 prompts each (min and max beside it). The
 * prompts are random token ids, rotated among 8 so the cache does not hold one prompt's
 * answer. Target (DESIGN.md §7): >= 800 M tokens/s on one core.
 *
 *   bench_pagekey [--rounds N]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvp_pagekey.h"

#define PROMPT  32768
#define PROMPTS 8
#define PER_RND 20

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    int rounds = 15;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
            rounds = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: %s [--rounds N]\n", argv[0]);
            return 2;
        }
    }
    if (rounds < 1)
        rounds = 1;
    int32_t *tok = malloc((size_t)PROMPTS * PROMPT * sizeof(int32_t));
    kvp_pagekey_t *keys = malloc(PROMPT * sizeof(kvp_pagekey_t));
    double *rate = malloc((size_t)rounds * sizeof(double));
    if (!tok || !keys || !rate)
        return 1;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < (size_t)PROMPTS * PROMPT; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        tok[i] = (int32_t)(x % 128256); /* a Llama-3 vocabulary */
    }
    kvp_pagekey_t root;
    if (kvp_pagekey_root("bench", 5, &root))
        return 1;
    printf("content keys of a %d-token prompt (XXH3-128 chained per full page), one core, %d "
           "rounds of %d prompts\n",
           PROMPT, rounds, PER_RND);
    printf("%-10s %14s %14s %14s %12s\n", "page size", "median tok/s", "min tok/s", "max tok/s",
           "ns per page");
    static const uint32_t sizes[] = {16, 32, 64};
    uint64_t check = 0;
    for (unsigned s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        const uint32_t ps = sizes[s];
        for (int r = 0; r < rounds; r++) {
            double t0 = now_s();
            for (int p = 0; p < PER_RND; p++) {
                const int32_t *t = tok + (size_t)((r * PER_RND + p) % PROMPTS) * PROMPT;
                uint32_t n = kvp_pagekey_chain(root, t, PROMPT, ps, keys, PROMPT);
                check ^= keys[n - 1].lo;
            }
            rate[r] = (double)PER_RND * PROMPT / (now_s() - t0);
        }
        qsort(rate, (size_t)rounds, sizeof(double), cmp_d);
        double med = rate[rounds / 2];
        printf("%-10u %14.3g %14.3g %14.3g %12.1f\n", ps, med, rate[0], rate[rounds - 1],
               1e9 * ps / med);
    }
    printf("(check %016llx)\n", (unsigned long long)check);
    free(tok);
    free(keys);
    free(rate);
    return 0;
}
