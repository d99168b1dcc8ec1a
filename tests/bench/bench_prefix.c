/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bench_prefix.c - the prefix cache (issue #16, DESIGN.md §9): what a fully cached prompt
 * costs the daemon, in-process and over the socket, and what allocation costs when every page
 * must be evicted first; what one client's large Lookups cost another's Ping; and what KV
 * events cost (bench_prefix_events.c). One run prints seven parts, then the figures as
 * key=value lines:
 *
 *   hash_tokens_per_s       content keys (kvp_pagekey_chain) of a 32,768-token prompt at page
 *                           16, one core: median of per-call rates, rotating among 8 prompts.
 *   hit_cpu_ns_per_token    in-process (no socket): a new sequence whose 32,768-token prompt
 *                           is fully cached, kvp_plan_append_cached with reuse (the daemon's
 *                           Reserve work: hash, find, link 2,048 pages), per token, median;
 *                           hit_release_ns_per_token the kvp_seqtab_release after it (the
 *                           pages go back to the eviction order), hit_cpu_total_ns_per_token
 *                           both.
 *   hit_reserve_p50_us/p99  the same Reserve over the socket to a real kvpoold (host backend,
 *                           4,096 pages of 16 tokens): 32,768 token ids (128 KiB) sent, a
 *                           2,048-page table back; cold_reserve_p50_us the same size without
 *                           token ids (2,048 free pages allocated); a Lookup of the prompt
 *                           (the same hashing and finding, no side effect), kvpool Ping and
 *                           Redis PING (when redis-server is installed) interleaved round by
 *                           round with them, so every figure sees the same machine state.
 *   evict_alloc_pages_per_s kvp_alloc_reserve of every page of a 65,536-page pool whose every
 *                           page is cached (32 different prompts published and released), each
 *                           page evicted first; evict_plan_pages_per_s the same through the
 *                           planner (one sequence of 1 Mi tokens without token ids); the
 *                           same in a 4,096-page pool beside it (evict_alloc_4096_...), and
 *                           allocation from the free stack (free_alloc_pages_per_s).
 *   cache_bytes_per_page    kvp_pcache_stats().bytes / num_pages at 65,536 pages, with the
 *                           daemon's defaults (256 scopes, 4,096 pins, 256 namespaces);
 *                           other sizes and the bytes per page added beside it.
 *   flood_*                 a bystander's Ping under a Lookup flood (issue #26): a kvpoold
 *                           (host backend, page 4, 16,384 pages cached as 256 prompts of 256
 *                           tokens) twice, with the old cap (--set limits.max_lookup_tokens=
 *                           1048576: Lookups of 4,096 prompts) and with its default; in each,
 *                           --flood-clients (2) connections send back-to-back Lookups of the
 *                           largest size the daemon accepts (whole hits), while a bystander in
 *                           another namespace pings --pings (2,000) times 0-1 ms apart, at most
 *                           8 s, idle first: Ping p50/p99/max, and a Lookup's own time (alone,
 *                           and under the flood). ~20 s.
 *   events_*                KV events (issue #29): kvp_ev_encode of 64-block chains (and of 64
 *                           removals), block events/s on one core; the publisher with a SUB
 *                           attached (ipc://), 18,000 batches of 64 blocks submitted at once:
 *                           block events/s until all are sent, drops; a submit to the idle
 *                           thread and the batcher's cost per block (the loop's side); two
 *                           kvpoold (host backend), events on and off, interleaved round by
 *                           round: Reserve of 512 new token ids and its Commit, p50/p99 each,
 *                           on/off ratios of the p50s, each daemon's CPU time per round.
 *
 * --quick (the CTest smoke run): 20 rounds and requests, 2 eviction rounds, no flood part
 * (200 pings with --flood), small events part; --no-daemon skips the socket and flood parts
 * (and the events part's daemons); --flood runs the flood part only, --events the events part
 * only, --no-events skips it. $KVPOOLD names the daemon (kvp_harness.h).
 *
 * A benchmark, not a test: no figure is asserted. It stops (exit 1) only when what it
 * measures did not happen (a hit that found less than the whole prompt, an allocation that
 * failed), since its figure would then mean nothing.
 *
 *   bench_prefix [--rounds N] [--requests N] [--quick] [--no-daemon] [--flood] [--pings N]
 *                [--flood-clients N] [--events] [--no-events]
 */
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_prefix_events.h"
#include "kvp_alloc.h"
#include "kvp_harness.h"
#include "kvp_redis.h"
#include "kvp_pagekey.h"
#include "kvp_pcache.h"
#include "kvp_plan.h"
#include "kvp_seqtab.h"
#include "kvpool.h"

#define PS           16u
#define PROMPT       32768u
#define PROMPT_PAGES (PROMPT / PS)
#define HASH_PROMPTS 8u
#define HIT_PAGES    4096u  /* the hit pool (and the daemon's): room for two prompts */
#define EVICT_PAGES  65536u /* the eviction pool: 32 prompts */

uint64_t bench_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Sorts v[n] and returns its q-quantile (q in [0, 1]). */
uint64_t bench_quantile(uint64_t *v, uint32_t n, double q)
{
    qsort(v, n, sizeof(uint64_t), cmp_u64);
    uint32_t i = (uint32_t)(q * (double)n);
    return v[i < n ? i : n - 1];
}

static void die(const char *what)
{
    fprintf(stderr, "bench_prefix: %s\n", what);
    exit(1);
}

/* Random token ids of a Llama-3 vocabulary. */
static void fill_tokens(int32_t *t, size_t n, uint64_t seed)
{
    uint64_t x = seed | 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        t[i] = (int32_t)(x % 128256);
    }
}

/* ---- in-process: a table and its cache ---------------------------------------------------- */

typedef struct {
    kvp_alloc_t *a;
    kvp_seqtab_t *t;
    kvp_pcache_t *c;
    kvp_plan_t p;
} core_t;

/* max_ns: namespaces of the table (the cache keeps 20 bytes of quota and pins for each). */
static void core_create(core_t *k, uint32_t num_pages, uint32_t max_ns)
{
    kvp_seqtab_config_t tc = {.max_seqs = 1024, .max_namespaces = max_ns, .max_seq_tokens = 0};
    kvp_pcache_config_t cc = {.max_scopes = 256, .max_pins = 1024}; /* the daemon's defaults */
    if (kvp_alloc_create(num_pages, &k->a) || kvp_seqtab_create(k->a, PS, &tc, &k->t) ||
        kvp_pcache_create(k->t, &cc, &k->c))
        die("cannot create the allocator, table and cache");
    kvp_plan_init(&k->p);
}

static void core_destroy(core_t *k)
{
    kvp_plan_free(&k->p);
    kvp_pcache_destroy(k->c);
    kvp_seqtab_destroy(k->t);
    kvp_alloc_destroy(k->a);
}

/* Creates sequence id with the prompt's token ids, publishes its pages, releases it: its
 * PROMPT_PAGES pages are then cached. */
static void cache_prompt(core_t *k, uint64_t id, const int32_t *tokens, uint64_t now_ms)
{
    kvp_plan_item_t it = {.ns = 0, .seq_id = id, .num_tokens = PROMPT};
    kvp_plan_content_t ct = {.token_ids = tokens};
    kvp_plan_cache_t cache = {.scope = 0, .priority = KVP_PCACHE_DEFAULT_PRIORITY};
    kvp_plan_limits_t lim = {0};
    if (kvp_plan_append_cached(k->t, &it, &ct, 1, &lim, &cache, now_ms, &k->p))
        die("cannot create a prompt");
    if (kvp_pcache_publish_seq(k->c, kvp_seqtab_find(k->t, 0, id)) != PROMPT_PAGES)
        die("a prompt's pages were not all published");
    if (kvp_seqtab_release(k->t, 0, id))
        die("cannot release a prompt");
}

/* ---- part 1: hashing ---------------------------------------------------------------------- */

static double bench_hash(uint32_t calls)
{
    int32_t *tok = malloc((size_t)HASH_PROMPTS * PROMPT * sizeof(int32_t));
    kvp_pagekey_t *keys = malloc(PROMPT_PAGES * sizeof(kvp_pagekey_t));
    uint64_t *ns = malloc((size_t)calls * sizeof(uint64_t));
    if (!tok || !keys || !ns)
        die("out of memory");
    fill_tokens(tok, (size_t)HASH_PROMPTS * PROMPT, 0x9e3779b97f4a7c15ull);
    kvp_pagekey_t root;
    if (kvp_pagekey_root("bench", 5, &root))
        die("kvp_pagekey_root");
    uint64_t check = 0;
    for (uint32_t i = 0; i < calls + 20; i++) { /* 20 warm-up calls */
        const int32_t *t = tok + (size_t)(i % HASH_PROMPTS) * PROMPT;
        uint64_t t0 = bench_now_ns();
        uint32_t n = kvp_pagekey_chain(root, t, PROMPT, PS, keys, PROMPT_PAGES);
        uint64_t dt = bench_now_ns() - t0;
        check ^= keys[n - 1].lo;
        if (i >= 20)
            ns[i - 20] = dt;
    }
    uint64_t p01 = bench_quantile(ns, calls, 0.01), p50 = bench_quantile(ns, calls, 0.5),
             p99 = bench_quantile(ns, calls, 0.99);
    double med = (double)PROMPT * 1e9 / (double)p50;
    printf("1. content keys of a %u-token prompt, page %u, one core, %u calls (check %016llx)\n",
           PROMPT, PS, calls, (unsigned long long)check);
    printf("   per call: p50 %.1f us (%.3g tokens/s, %.2f ns/token), fastest 1%% %.1f us "
           "(%.3g tokens/s), p99 %.1f us (%.3g tokens/s)\n",
           p50 / 1e3, med, (double)p50 / PROMPT, p01 / 1e3, (double)PROMPT * 1e9 / (double)p01,
           p99 / 1e3, (double)PROMPT * 1e9 / (double)p99);
    free(tok);
    free(keys);
    free(ns);
    return med;
}

/* ---- part 2: a fully cached prompt, in-process -------------------------------------------- */

typedef struct {
    double reserve_ns_tok, release_ns_tok, total_ns_tok;
    double last_reserve_ns_tok, cold_ns_tok;
} hit_result_t;

static hit_result_t bench_hit(uint32_t rounds)
{
    hit_result_t res = {0};
    core_t k;
    core_create(&k, HIT_PAGES, 4);
    int32_t *tok = malloc(PROMPT * sizeof(int32_t));
    uint64_t *res_ns = malloc((size_t)rounds * sizeof(uint64_t));
    uint64_t *rel_ns = malloc((size_t)rounds * sizeof(uint64_t));
    uint64_t *sum_ns = malloc((size_t)rounds * sizeof(uint64_t));
    if (!tok || !res_ns || !rel_ns || !sum_ns)
        die("out of memory");
    fill_tokens(tok, PROMPT, 0x1234567);
    uint64_t now = 1000;
    cache_prompt(&k, 1, tok, now);
    kvp_stats_t st;
    kvp_seqtab_stats(k.t, &st);
    if (st.cached_pages != PROMPT_PAGES)
        die("the prompt is not cached");

    kvp_plan_item_t it = {.ns = 0, .seq_id = 0, .num_tokens = PROMPT};
    kvp_plan_content_t ct = {.token_ids = tok};
    kvp_plan_limits_t lim = {0};
    uint64_t id = 100;
    /* three ways, each rounds times after a warm-up of rounds / 10: reuse (every page linked),
     * reuse with leave_last (2,047 linked, the last page allocated and keyed), and the same
     * size without token ids (2,048 pages from the free stack) */
    for (int way = 0; way < 3; way++) {
        kvp_plan_cache_t cache = {.scope = 0,
                                  .reuse = way < 2,
                                  .leave_last = way == 1,
                                  .priority = KVP_PCACHE_DEFAULT_PRIORITY};
        const uint32_t warm = rounds / 10 + 1;
        for (uint32_t r = 0; r < rounds + warm; r++) {
            it.seq_id = ++id;
            now++;
            uint64_t t0 = bench_now_ns();
            int rc = way < 2 ? kvp_plan_append_cached(k.t, &it, &ct, 1, &lim, &cache, now, &k.p)
                             : kvp_plan_append(k.t, &it, 1, &lim, now, &k.p);
            uint64_t t1 = bench_now_ns();
            if (rc)
                die("a reserve failed");
            const uint32_t want = way == 0 ? PROMPT : way == 1 ? PROMPT - PS : 0;
            if ((way < 2 && k.p.cached_tokens[0] != want) ||
                k.p.num_new_pages != (way == 0   ? 0
                                      : way == 1 ? 1
                                                 : PROMPT_PAGES))
                die("a hit did not link what the prompt has cached");
            if (kvp_seqtab_release(k.t, 0, it.seq_id))
                die("a release failed");
            uint64_t t2 = bench_now_ns();
            if (r >= warm) {
                res_ns[r - warm] = t1 - t0;
                rel_ns[r - warm] = t2 - t1;
                sum_ns[r - warm] = t2 - t0;
            }
        }
        char msg[256];
        if (kvp_pcache_audit(k.c, msg, sizeof(msg)))
            die(msg);
        uint64_t r50 = bench_quantile(res_ns, rounds, 0.5),
                 r99 = bench_quantile(res_ns, rounds, 0.99);
        uint64_t l50 = bench_quantile(rel_ns, rounds, 0.5),
                 s50 = bench_quantile(sum_ns, rounds, 0.5);
        static const char *const names[] = {"reuse, fully cached (2,048 pages linked)",
                                            "reuse + leave_last (2,047 linked, 1 new)",
                                            "no token ids (2,048 free pages)"};
        if (way == 0)
            printf("\n2. a new sequence of a %u-token prompt, page %u, in-process (the daemon's "
                   "Reserve work, no socket), %u rounds\n",
                   PROMPT, PS, rounds);
        printf("   %-42s reserve p50 %7.1f us (%.2f ns/token), p99 %7.1f us; release p50 %6.1f "
               "us (%.2f ns/token); both %7.1f us (%.2f ns/token)\n",
               names[way], r50 / 1e3, (double)r50 / PROMPT, r99 / 1e3, l50 / 1e3,
               (double)l50 / PROMPT, s50 / 1e3, (double)s50 / PROMPT);
        if (way == 0) {
            res.reserve_ns_tok = (double)r50 / PROMPT;
            res.release_ns_tok = (double)l50 / PROMPT;
            res.total_ns_tok = (double)s50 / PROMPT;
        } else if (way == 1) {
            res.last_reserve_ns_tok = (double)r50 / PROMPT;
        } else {
            res.cold_ns_tok = (double)r50 / PROMPT;
        }
    }
    core_destroy(&k);
    free(tok);
    free(res_ns);
    free(rel_ns);
    free(sum_ns);
    return res;
}

/* ---- part 4: allocation that evicts every page -------------------------------------------- */

typedef struct {
    double alloc_pps, plan_pps, free_pps;
} evict_result_t;

static void fill_cache(core_t *k, uint32_t np, const int32_t *tok, uint64_t *id, uint64_t now)
{
    for (uint32_t i = 0; i < np / PROMPT_PAGES; i++)
        cache_prompt(k, ++*id, tok + (size_t)i * PROMPT, now);
    kvp_stats_t st;
    kvp_seqtab_stats(k->t, &st);
    if (st.cached_pages != np || st.free_pages != 0)
        die("the pool is not all cached");
}

/* np: pages of the pool, a multiple of PROMPT_PAGES. */
static evict_result_t bench_evict(uint32_t rounds, uint32_t np)
{
    evict_result_t res = {0};
    core_t k;
    core_create(&k, np, 4);
    int32_t *tok = malloc((size_t)(np / PROMPT_PAGES) * PROMPT * sizeof(int32_t));
    uint32_t *pages = malloc(np * sizeof(uint32_t));
    uint64_t *a_ns = malloc((size_t)rounds * sizeof(uint64_t));
    uint64_t *p_ns = malloc((size_t)rounds * sizeof(uint64_t));
    uint64_t *f_ns = malloc((size_t)rounds * sizeof(uint64_t));
    if (!tok || !pages || !a_ns || !p_ns || !f_ns)
        die("out of memory");
    fill_tokens(tok, (size_t)(np / PROMPT_PAGES) * PROMPT, 0xabcdef);
    uint64_t id = 0, now = 1000;
    kvp_plan_limits_t lim = {0};
    kvp_pcache_stats_t cs0, cs1;
    kvp_pcache_stats(k.c, &cs0);
    for (uint32_t r = 0; r < rounds + 1; r++) { /* round 0 warms up */
        /* the allocator alone: every page evicted, then freed (no longer keyed) */
        fill_cache(&k, np, tok, &id, ++now);
        uint64_t t0 = bench_now_ns();
        int rc = kvp_alloc_reserve(k.a, np, pages);
        uint64_t t1 = bench_now_ns();
        if (rc || kvp_alloc_num_cached(k.a) != 0)
            die("kvp_alloc_reserve did not evict every page");
        for (uint32_t i = 0; i < np; i++)
            kvp_alloc_unref(k.a, pages[i]);
        if (kvp_alloc_num_free(k.a) != np)
            die("evicted pages did not come back free");
        /* the same from the free stack, for comparison */
        uint64_t t2 = bench_now_ns();
        rc = kvp_alloc_reserve(k.a, np, pages);
        uint64_t t3 = bench_now_ns();
        if (rc)
            die("kvp_alloc_reserve of free pages failed");
        for (uint32_t i = 0; i < np; i++)
            kvp_alloc_unref(k.a, pages[i]);
        /* through the planner: one sequence that takes every page */
        fill_cache(&k, np, tok, &id, ++now);
        kvp_plan_item_t it = {.ns = 0, .seq_id = ++id, .num_tokens = np * PS};
        uint64_t t4 = bench_now_ns();
        rc = kvp_plan_append(k.t, &it, 1, &lim, ++now, &k.p);
        uint64_t t5 = bench_now_ns();
        if (rc || k.p.num_evicted != np || k.p.num_new_pages != np)
            die("the plan did not evict every page");
        if (kvp_seqtab_release(k.t, 0, it.seq_id))
            die("a release failed");
        if (r > 0) {
            a_ns[r - 1] = t1 - t0;
            f_ns[r - 1] = t3 - t2;
            p_ns[r - 1] = t5 - t4;
        }
    }
    kvp_pcache_stats(k.c, &cs1);
    char msg[256];
    if (kvp_pcache_audit(k.c, msg, sizeof(msg)))
        die(msg);
    uint64_t a50 = bench_quantile(a_ns, rounds, 0.5), p50 = bench_quantile(p_ns, rounds, 0.5),
             f50 = bench_quantile(f_ns, rounds, 0.5);
    uint64_t amin = bench_quantile(a_ns, rounds, 0), amax = bench_quantile(a_ns, rounds, 1);
    res.alloc_pps = np * 1e9 / (double)a50;
    res.plan_pps = np * 1e9 / (double)p50;
    res.free_pps = np * 1e9 / (double)f50;
    printf("\n4. allocation of every page of a %u-page pool whose every page is cached (%u "
           "prompts published and released), %u rounds, %llu evictions\n",
           np, (np / PROMPT_PAGES), rounds,
           (unsigned long long)(cs1.evictions[KVP_EVICT_PRESSURE] -
                                cs0.evictions[KVP_EVICT_PRESSURE]));
    printf("   kvp_alloc_reserve, every page evicted:  p50 %7.1f us (%.3g pages/s, %.2f ns/page)"
           ", fastest %.1f us, slowest %.1f us\n",
           a50 / 1e3, res.alloc_pps, (double)a50 / np, amin / 1e3, amax / 1e3);
    printf("   kvp_plan_append of %u tokens, evicting: p50 %7.1f us (%.3g pages/s, %.2f ns/page, "
           "page table included)\n",
           np * PS, p50 / 1e3, res.plan_pps, (double)p50 / np);
    printf("   kvp_alloc_reserve of free pages:        p50 %7.1f us (%.3g pages/s, %.2f "
           "ns/page; no cache work, for comparison)\n",
           f50 / 1e3, res.free_pps, (double)f50 / np);
    core_destroy(&k);
    free(tok);
    free(pages);
    free(a_ns);
    free(p_ns);
    free(f_ns);
    return res;
}

/* ---- part 5: memory ----------------------------------------------------------------------- */

static double bench_bytes(void)
{
    static const uint32_t sizes[] = {HIT_PAGES, EVICT_PAGES, 1u << 20};
    uint64_t bytes[3];
    printf("\n5. the cache's tables (kvp_pcache_stats().bytes; the daemon's defaults: 256 "
           "scopes, 4,096 pins, 256 namespaces)\n");
    for (int i = 0; i < 3; i++) {
        core_t k;
        core_create(&k, sizes[i], 256);
        kvp_pcache_stats_t cs;
        kvp_pcache_stats(k.c, &cs);
        bytes[i] = cs.bytes;
        printf("   %8u pages: %10llu bytes, %.1f bytes/page\n", sizes[i],
               (unsigned long long)cs.bytes, (double)cs.bytes / sizes[i]);
        core_destroy(&k);
    }
    printf("   per page added (%u -> %u pages): %.1f bytes\n", sizes[1], sizes[2],
           (double)(bytes[2] - bytes[1]) / (double)(sizes[2] - sizes[1]));
    return (double)bytes[1] / EVICT_PAGES;
}

/* ---- part 3: over the socket -------------------------------------------------------------- */

typedef struct {
    double hit_p50, hit_p99, cold_p50, cold_p99, lookup_p50, ping_p50, redis_p50;
    int ok, have_redis;
} socket_result_t;

static socket_result_t bench_socket(uint32_t requests)
{
    socket_result_t res = {0};
    kvp_daemon_t d;
    const char *args[] = {"--log-level",
                          "warning",
                          "--backend",
                          "host",
                          "--num-layers",
                          "2",
                          "--num-kv-heads",
                          "2",
                          "--head-dim",
                          "16",
                          "--set",
                          "pool.num_pages=4096",
                          "--set",
                          "pool.page_size=16",
                          "--set",
                          "server.max_frame_bytes=16MiB",
                          NULL};
    if (kvp_daemon_start(&d, args)) {
        fprintf(stderr, "bench_prefix: kvpoold did not start: socket part skipped\n");
        return res;
    }
    char rsock[400];
    pid_t redis = kvp_redis_start(d.dir, rsock, sizeof(rsock));
    int rfd = redis > 0 ? kvp_redis_connect(rsock) : -1;
    res.have_redis = rfd >= 0;

    kvp_client_opts_t o = {.socket_path = d.sock,
                           .ns = "bench",
                           .client_name = "bench_prefix",
                           .timeout_ms = 30000,
                           .map_pool = 0};
    kvp_client_t *c = NULL;
    char err[256];
    int32_t *tok = malloc(PROMPT * sizeof(int32_t));
    int32_t *indptr = malloc(4 * sizeof(int32_t)), *aindptr = malloc(4 * sizeof(int32_t));
    int32_t *indices = malloc((PROMPT_PAGES + 8) * sizeof(int32_t));
    int32_t *last = malloc(4 * sizeof(int32_t)), *lens = malloc(4 * sizeof(int32_t));
    uint32_t *cached = malloc(4 * sizeof(uint32_t));
    uint64_t *hit = malloc((size_t)requests * sizeof(uint64_t));
    uint64_t *cold = malloc((size_t)requests * sizeof(uint64_t));
    uint64_t *ping = malloc((size_t)requests * sizeof(uint64_t));
    uint64_t *rping = malloc((size_t)requests * sizeof(uint64_t));
    uint64_t *look = malloc((size_t)requests * sizeof(uint64_t));
    if (!tok || !indptr || !aindptr || !indices || !last || !lens || !cached || !hit || !cold ||
        !ping || !rping || !look)
        die("out of memory");
    fill_tokens(tok, PROMPT, 0x7777);
    if (kvp_client_connect(&o, &c, err, sizeof(err))) {
        fprintf(stderr, "bench_prefix: connect: %s\n", err);
        goto out;
    }
    kvp_page_table_t table = {.kv_indptr = indptr,
                              .kv_indices = indices,
                              .kv_last_page_len = last,
                              .append_indptr = aindptr,
                              .seq_lens = lens,
                              .cap_batch = 4,
                              .cap_indices = PROMPT_PAGES + 8,
                              .cached_tokens = cached};
    uint64_t id = 1;
    const uint32_t n = PROMPT;
    kvp_cache_opts_t keyed = {.token_ids = tok, .priority = -1};
    kvp_cache_opts_t reuse = {.token_ids = tok, .reuse = 1, .priority = -1};
    uint32_t pages = 0, published = 0;
    /* the prompt: reserved with its token ids, (written in-process: nothing to write here),
     * committed, released: cached */
    if (kvp_client_reserve_cached(c, &id, &n, 1, &keyed, &table) ||
        kvp_client_commit(c, &id, 1, NULL, &pages, &published) ||
        kvp_client_release(c, &id, 1, NULL)) {
        fprintf(stderr, "bench_prefix: caching the prompt: %s\n", kvp_client_last_error(c));
        goto out;
    }
    if (published != PROMPT_PAGES) {
        fprintf(stderr, "bench_prefix: the commit published %u pages, not %u\n", published,
                PROMPT_PAGES);
        goto out;
    }
    const uint32_t warm = requests / 10 + 1;
    for (uint32_t r = 0; r < requests + warm; r++) {
        /* hit: a new sequence reusing the prompt (its release is not timed) */
        ++id;
        uint64_t t0 = bench_now_ns();
        int rc = kvp_client_reserve_cached(c, &id, &n, 1, &reuse, &table);
        uint64_t t1 = bench_now_ns();
        if (rc || cached[0] != PROMPT || table.num_indices != PROMPT_PAGES) {
            fprintf(stderr, "bench_prefix: a hit Reserve: rc %d, %u cached tokens: %s\n", rc,
                    cached[0], kvp_client_last_error(c));
            goto out;
        }
        if (kvp_client_release(c, &id, 1, NULL))
            goto out;
        /* cold: the same size without token ids */
        ++id;
        uint64_t t2 = bench_now_ns();
        rc = kvp_client_reserve(c, &id, &n, 1, &table);
        uint64_t t3 = bench_now_ns();
        if (rc || table.num_indices != PROMPT_PAGES) {
            fprintf(stderr, "bench_prefix: a cold Reserve: %s\n", kvp_client_last_error(c));
            goto out;
        }
        if (kvp_client_release(c, &id, 1, NULL))
            goto out;
        /* Lookup of the whole prompt: the same hashing and finding, no side effect (not a
         * mutating call: no retry window, no page table) */
        uint32_t found = 0;
        uint64_t t7 = bench_now_ns();
        rc = kvp_client_lookup(c, tok, &n, 1, NULL, NULL, &found);
        uint64_t t8 = bench_now_ns();
        if (rc || found != PROMPT) {
            fprintf(stderr, "bench_prefix: a Lookup: rc %d, %u found: %s\n", rc, found,
                    kvp_client_last_error(c));
            goto out;
        }
        uint64_t t4 = bench_now_ns();
        if (kvp_client_ping(c, NULL))
            goto out;
        uint64_t t5 = bench_now_ns(), t6 = t5;
        if (rfd >= 0) {
            if (kvp_redis_ping(rfd)) {
                fprintf(stderr, "bench_prefix: Redis PING failed\n");
                goto out;
            }
            t6 = bench_now_ns();
        }
        if (r >= warm) {
            hit[r - warm] = t1 - t0;
            cold[r - warm] = t3 - t2;
            ping[r - warm] = t5 - t4;
            look[r - warm] = t8 - t7;
            rping[r - warm] = t6 - t5;
        }
    }
    kvp_cache_stats_t cs;
    if (kvp_client_cache_stats(c, &cs) == 0)
        printf("\n3. (the daemon's Stats after the run: %u cached pages, %llu of %llu queried "
               "tokens hit, cache tables %llu bytes for %u pages: %.1f bytes/page)",
               cs.cached_pages, (unsigned long long)cs.hit_tokens_total,
               (unsigned long long)cs.query_tokens_total, (unsigned long long)cs.bytes, HIT_PAGES,
               (double)cs.bytes / HIT_PAGES);
    res.hit_p50 = bench_quantile(hit, requests, 0.5) / 1e3;
    res.hit_p99 = bench_quantile(hit, requests, 0.99) / 1e3;
    res.cold_p50 = bench_quantile(cold, requests, 0.5) / 1e3;
    res.cold_p99 = bench_quantile(cold, requests, 0.99) / 1e3;
    res.ping_p50 = bench_quantile(ping, requests, 0.5) / 1e3;
    res.lookup_p50 = bench_quantile(look, requests, 0.5) / 1e3;
    res.redis_p50 = res.have_redis ? bench_quantile(rping, requests, 0.5) / 1e3 : 0;
    res.ok = 1;
    printf("\n   Reserve of a new %u-token sequence over the socket, real kvpoold (host backend, "
           "4,096 pages of 16, 2 layers, H 2, D 16), one client, %u rounds, each: hit, cold, "
           "Lookup, Ping, Redis PING\n",
           PROMPT, requests);
    printf("   %-52s %10s %10s\n", "", "p50 us", "p99 us");
    printf("   %-52s %10.1f %10.1f\n", "hit: reuse, 32,768 token ids, fully cached", res.hit_p50,
           res.hit_p99);
    printf("   %-52s %10.1f %10.1f\n", "cold: no token ids, 2,048 free pages", res.cold_p50,
           res.cold_p99);
    printf("   %-52s %10.1f %10.1f\n", "Lookup of the prompt (no side effect)", res.lookup_p50,
           bench_quantile(look, requests, 0.99) / 1e3);
    printf("   %-52s %10.1f %10.1f\n", "kvpool Ping", res.ping_p50,
           bench_quantile(ping, requests, 0.99) / 1e3);
    if (res.have_redis)
        printf("   %-52s %10.1f %10.1f\n", "Redis PING (unix socket)", res.redis_p50,
               bench_quantile(rping, requests, 0.99) / 1e3);
    else
        printf("   %-52s %10s %10s (no redis-server)\n", "Redis PING", "-", "-");
out:
    kvp_client_close(c);
    if (rfd >= 0)
        close(rfd);
    if (redis > 0) {
        kill(redis, SIGTERM);
        waitpid(redis, NULL, 0);
        unlink(rsock);
    }
    if (kvp_daemon_stop(&d, SIGTERM) != 0)
        res.ok = 0;
    free(tok);
    free(indptr);
    free(aindptr);
    free(indices);
    free(last);
    free(lens);
    free(cached);
    free(hit);
    free(cold);
    free(ping);
    free(rping);
    free(look);
    return res;
}

/* ---- part 6: a bystander's Ping under a Lookup flood (issue #26) --------------------------- */

/* Issue #26's shape: page 4, prompts of 256 tokens, a Lookup of 4,096 of them (1 Mi tokens:
 * the old limits.max_lookup_tokens) is the largest a client could send. The flood's prompts
 * are FAIR_CACHED distinct prompts, cached first and repeated, so every Lookup hashes and finds
 * every page of every prompt (whole-prompt hits), the most work a token can cost. */
#define FAIR_PS           4u
#define FAIR_PROMPT       256u
#define FAIR_CACHED       256u  /* 16,384 pages cached: one Lookup under the new cap */
#define FAIR_MAX_PROMPTS  4096u /* 4,096 x 256 = 1,048,576 tokens */
#define FAIR_POOL_PAGES   20480u
#define FAIR_ALONE_CALLS  10u
#define FAIR_MAX_LOOKUPS  65536u        /* per flood client: times kept */
#define FAIR_PHASE_MAX_NS 8000000000ull /* a ping phase ends after 8 s, pings or not */

typedef struct {
    double p50_us, p99_us, max_us;
    uint32_t n;
    double secs;
} fair_lat_t;

/* One flood client: its own connection, back-to-back Lookups of tok[lens] until stop. */
typedef struct {
    const char *sock;
    const int32_t *tok;
    const uint32_t *lens;
    uint32_t n;
    const atomic_int *stop;
    atomic_uint done; /* Lookups answered */
    uint64_t *ns;     /* [FAIR_MAX_LOOKUPS] round trips */
    int failed;
    char err[256];
} fair_flood_t;

typedef struct {
    uint32_t lookup_tokens, flood_lookups;
    double alone_p50_us, flood_p50_us, flood_secs;
    fair_lat_t idle, flood;
    int ok;
} fair_result_t;

static int fair_connect(const char *sock, const char *ns, kvp_client_t **c, char *err,
                        size_t err_len)
{
    kvp_client_opts_t o = {.socket_path = sock,
                           .ns = ns,
                           .client_name = "bench_prefix",
                           .timeout_ms = 60000,
                           .map_pool = 0};
    return kvp_client_connect(&o, c, err, err_len);
}

/* Checks a Lookup's answer: every prompt a whole-prompt hit. */
static int fair_all_found(const uint32_t *cached, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (cached[i] != FAIR_PROMPT)
            return 0;
    return 1;
}

static void *fair_flood_main(void *arg)
{
    fair_flood_t *f = arg;
    kvp_client_t *c = NULL;
    uint32_t *cached = malloc(f->n * sizeof(uint32_t));
    if (!cached) {
        snprintf(f->err, sizeof(f->err), "out of memory");
        goto fail;
    }
    if (fair_connect(f->sock, "flood", &c, f->err, sizeof(f->err)))
        goto fail;
    while (!atomic_load(f->stop)) {
        uint64_t t0 = bench_now_ns();
        int rc = kvp_client_lookup(c, f->tok, f->lens, f->n, NULL, NULL, cached);
        uint64_t t1 = bench_now_ns();
        if (rc || !fair_all_found(cached, f->n)) {
            snprintf(f->err, sizeof(f->err), "a flood Lookup: rc %d, %s", rc,
                     rc ? kvp_client_last_error(c) : "not every prompt found whole");
            goto fail;
        }
        uint32_t i = atomic_load(&f->done);
        if (i < FAIR_MAX_LOOKUPS)
            f->ns[i] = t1 - t0;
        atomic_store(&f->done, i + 1);
    }
    kvp_client_close(c);
    free(cached);
    return NULL;
fail:
    f->failed = 1;
    atomic_store(&f->done, UINT32_MAX / 2); /* wakes the waiter */
    kvp_client_close(c);
    free(cached);
    return NULL;
}

/* Pings up to `pings` times (after 20 warm-up pings), each after a random 0-1 ms pause so that
 * pings land at random points of the daemon's work; stops after FAIR_PHASE_MAX_NS. */
static int fair_pings(kvp_client_t *c, uint64_t *ns, uint32_t pings, fair_lat_t *out)
{
    uint64_t x = 0x2545f4914f6cdd1dull, start = 0;
    uint32_t n = 0;
    for (uint32_t r = 0; r < pings + 20; r++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        struct timespec gap = {0, (long)(x % 1000000)};
        nanosleep(&gap, NULL);
        uint64_t t0 = bench_now_ns();
        if (kvp_client_ping(c, NULL))
            return -1;
        uint64_t t1 = bench_now_ns();
        if (r == 20)
            start = t0;
        if (r >= 20) {
            ns[n++] = t1 - t0;
            if (t1 - start > FAIR_PHASE_MAX_NS)
                break;
        }
    }
    out->n = n;
    out->secs = (double)(bench_now_ns() - start) / 1e9;
    out->p50_us = bench_quantile(ns, n, 0.5) / 1e3;
    out->p99_us = bench_quantile(ns, n, 0.99) / 1e3;
    out->max_us = bench_quantile(ns, n, 1.0) / 1e3;
    return 0;
}

/* The largest Lookup of whole FAIR_PROMPT-token prompts the daemon accepts, at most
 * FAIR_MAX_PROMPTS: asks for the most, then for what the refusal names as the limit
 * ("... above N (limits.max_lookup_tokens)"), else half. Returns the prompts, 0 on failure. */
static uint32_t fair_probe(kvp_client_t *c, const int32_t *tok, const uint32_t *lens,
                           uint32_t *cached)
{
    uint32_t n = FAIR_MAX_PROMPTS;
    while (n > 0) {
        int rc = kvp_client_lookup(c, tok, lens, n, NULL, NULL, cached);
        if (rc == 0)
            return fair_all_found(cached, n) ? n : 0;
        const char *e = kvp_client_last_error(c);
        if (!strstr(e, "max_lookup_tokens") && !strstr(e, "max_batch")) {
            fprintf(stderr, "bench_prefix: a Lookup of %u prompts: %s\n", n, e);
            return 0;
        }
        const char *above = strstr(e, "max_lookup_tokens") ? strstr(e, "above ") : NULL;
        uint32_t next = above ? (uint32_t)(strtoul(above + 6, NULL, 10) / FAIR_PROMPT) : n / 2;
        n = next < n ? next : n / 2;
    }
    fprintf(stderr, "bench_prefix: the daemon accepts no Lookup of one %u-token prompt\n",
            FAIR_PROMPT);
    return 0;
}

/* One daemon configuration (extra: its --set arguments, NULL-terminated, may be empty):
 * caches the prompts, finds the largest Lookup, times it alone, then the bystander's pings
 * idle and under `floods` flooding clients. */
static fair_result_t fair_run(const char *const *extra, uint32_t pings, uint32_t floods,
                              const int32_t *tok, const uint32_t *lens)
{
    fair_result_t res = {0};
    const char *args[32] = {"--log-level",    "warning",
                            "--backend",      "host",
                            "--num-layers",   "2",
                            "--num-kv-heads", "2",
                            "--head-dim",     "16",
                            "--set",          "pool.num_pages=20480", /* FAIR_POOL_PAGES */
                            "--set",          "pool.page_size=4"};    /* FAIR_PS */
    uint32_t na = 14;
    for (uint32_t i = 0; extra[i] && na < 31; i++)
        args[na++] = extra[i];
    kvp_daemon_t d;
    if (kvp_daemon_start(&d, args)) {
        fprintf(stderr, "bench_prefix: kvpoold did not start: flood part skipped\n");
        return res;
    }
    kvp_client_t *setup = NULL, *by = NULL;
    fair_flood_t *fl = calloc(floods, sizeof(fair_flood_t));
    pthread_t *th = calloc(floods, sizeof(pthread_t));
    uint32_t *cached = malloc(FAIR_MAX_PROMPTS * sizeof(uint32_t));
    uint64_t *ids = malloc(FAIR_CACHED * sizeof(uint64_t));
    uint64_t *ns = malloc(((size_t)pings + FAIR_MAX_LOOKUPS * (size_t)floods) * sizeof(uint64_t));
    int32_t *ip = malloc((FAIR_CACHED + 1) * sizeof(int32_t));
    int32_t *idx = malloc(FAIR_CACHED * (FAIR_PROMPT / FAIR_PS) * sizeof(int32_t));
    if (!fl || !th || !cached || !ids || !ns || !ip || !idx)
        die("out of memory");
    atomic_int stop = 0;
    uint32_t started = 0;
    char err[256];
    /* the cache: FAIR_CACHED prompts reserved with their token ids, committed (nothing to
     * write in-process), released; the setup connection keeps the namespace (and its scope)
     * alive for the run */
    if (fair_connect(d.sock, "flood", &setup, err, sizeof(err)) ||
        fair_connect(d.sock, "bystander", &by, err, sizeof(err))) {
        fprintf(stderr, "bench_prefix: connect: %s\n", err);
        goto out;
    }
    for (uint32_t i = 0; i < FAIR_CACHED; i++)
        ids[i] = i + 1;
    kvp_page_table_t table = {.kv_indptr = ip,
                              .kv_indices = idx,
                              .cap_batch = FAIR_CACHED + 1,
                              .cap_indices = FAIR_CACHED * (FAIR_PROMPT / FAIR_PS)};
    kvp_cache_opts_t keyed = {.token_ids = tok, .priority = -1};
    uint32_t pages = 0, published = 0;
    if (kvp_client_reserve_cached(setup, ids, lens, FAIR_CACHED, &keyed, &table) ||
        kvp_client_commit(setup, ids, FAIR_CACHED, NULL, &pages, &published) ||
        kvp_client_release(setup, ids, FAIR_CACHED, NULL)) {
        fprintf(stderr, "bench_prefix: caching the prompts: %s\n", kvp_client_last_error(setup));
        goto out;
    }
    if (published != FAIR_CACHED * (FAIR_PROMPT / FAIR_PS)) {
        fprintf(stderr, "bench_prefix: the commit published %u pages, not %u\n", published,
                FAIR_CACHED * (FAIR_PROMPT / FAIR_PS));
        goto out;
    }
    const uint32_t n = fair_probe(setup, tok, lens, cached);
    if (n == 0)
        goto out;
    res.lookup_tokens = n * FAIR_PROMPT;
    /* the Lookup alone: the loop's time per call, nothing else running */
    for (uint32_t r = 0; r < FAIR_ALONE_CALLS; r++) {
        uint64_t t0 = bench_now_ns();
        int rc = kvp_client_lookup(setup, tok, lens, n, NULL, NULL, cached);
        ns[r] = bench_now_ns() - t0;
        if (rc || !fair_all_found(cached, n)) {
            fprintf(stderr, "bench_prefix: a Lookup alone: %s\n", kvp_client_last_error(setup));
            goto out;
        }
    }
    res.alone_p50_us = bench_quantile(ns, FAIR_ALONE_CALLS, 0.5) / 1e3;
    if (fair_pings(by, ns, pings, &res.idle)) {
        fprintf(stderr, "bench_prefix: an idle Ping: %s\n", kvp_client_last_error(by));
        goto out;
    }
    /* the flood: each client's first Lookup answered before the bystander starts */
    for (; started < floods; started++) {
        fair_flood_t *f = &fl[started];
        *f = (fair_flood_t){.sock = d.sock,
                            .tok = tok,
                            .lens = lens,
                            .n = n,
                            .stop = &stop,
                            .ns = ns + pings + (size_t)started * FAIR_MAX_LOOKUPS};
        atomic_init(&f->done, 0);
        if (pthread_create(&th[started], NULL, fair_flood_main, f))
            break;
    }
    for (uint32_t i = 0; i < started; i++)
        while (atomic_load(&fl[i].done) == 0) {
            struct timespec ms = {0, 1000000};
            nanosleep(&ms, NULL);
        }
    uint32_t before = 0;
    for (uint32_t i = 0; i < started; i++)
        before += atomic_load(&fl[i].done);
    uint64_t t0 = bench_now_ns();
    int ping_rc = started == floods ? fair_pings(by, ns, pings, &res.flood) : -1;
    uint64_t t1 = bench_now_ns();
    atomic_store(&stop, 1);
    res.flood_secs = (double)(t1 - t0) / 1e9;
    for (uint32_t i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    if (ping_rc) {
        fprintf(stderr, "bench_prefix: a Ping under the flood: %s\n",
                started < floods ? "a flood client did not start" : kvp_client_last_error(by));
        goto out;
    }
    /* every flood client's Lookups but its first (made before the others started),
     * gathered behind the pings' slots */
    uint64_t *all = ns + pings;
    uint32_t m = 0, after = 0;
    for (uint32_t i = 0; i < started; i++) {
        if (fl[i].failed) {
            fprintf(stderr, "bench_prefix: flood client %u: %s\n", i, fl[i].err);
            goto out;
        }
        uint32_t k = atomic_load(&fl[i].done);
        after += k;
        k = k < FAIR_MAX_LOOKUPS ? k : FAIR_MAX_LOOKUPS;
        memmove(all + m, fl[i].ns + 1, (k - 1) * sizeof(uint64_t));
        m += k - 1;
    }
    if (m == 0) {
        fprintf(stderr, "bench_prefix: the flood clients made one Lookup each\n");
        goto out;
    }
    res.flood_lookups = after - before;
    res.flood_p50_us = bench_quantile(all, m, 0.5) / 1e3;
    res.ok = 1;
out:
    atomic_store(&stop, 1);
    kvp_client_close(by);
    kvp_client_close(setup);
    if (kvp_daemon_stop(&d, SIGTERM) != 0)
        res.ok = 0;
    free(fl);
    free(th);
    free(cached);
    free(ids);
    free(ns);
    free(ip);
    free(idx);
    return res;
}

static void fair_print(const char *what, const fair_result_t *r, uint32_t floods)
{
    printf("   %s: Lookups of %u prompts x %u = %u tokens\n", what, r->lookup_tokens / FAIR_PROMPT,
           FAIR_PROMPT, r->lookup_tokens);
    printf("     a Lookup alone: p50 %.1f us (%.1f ns/token); under the flood: p50 %.1f us, "
           "%u Lookups of %u clients in %.1f s\n",
           r->alone_p50_us, r->alone_p50_us * 1e3 / r->lookup_tokens, r->flood_p50_us,
           r->flood_lookups, floods, r->flood_secs);
    printf("     %-30s %10s %10s %10s %8s\n", "bystander Ping", "p50 us", "p99 us", "max us",
           "pings");
    printf("     %-30s %10.1f %10.1f %10.1f %8u\n", "idle", r->idle.p50_us, r->idle.p99_us,
           r->idle.max_us, r->idle.n);
    printf("     %-30s %10.1f %10.1f %10.1f %8u\n", "under the flood", r->flood.p50_us,
           r->flood.p99_us, r->flood.max_us, r->flood.n);
}

static void fair_keys(const char *name, const fair_result_t *r)
{
    printf("flood_%s_lookup_tokens=%u\n", name, r->lookup_tokens);
    printf("flood_%s_lookup_alone_p50_us=%.1f\n", name, r->alone_p50_us);
    printf("flood_%s_lookup_p50_us=%.1f\n", name, r->flood_p50_us);
    printf("flood_%s_ping_idle_p50_us=%.1f\n", name, r->idle.p50_us);
    printf("flood_%s_ping_idle_p99_us=%.1f\n", name, r->idle.p99_us);
    printf("flood_%s_ping_p50_us=%.1f\n", name, r->flood.p50_us);
    printf("flood_%s_ping_p99_us=%.1f\n", name, r->flood.p99_us);
    printf("flood_%s_ping_max_us=%.1f\n", name, r->flood.max_us);
}

/* Both configurations, the old cap first. Returns 0, or -1 when either failed. */
static int bench_flood(uint32_t pings, uint32_t floods, fair_result_t *old_cap, fair_result_t *dflt)
{
    int32_t *tok = malloc((size_t)FAIR_MAX_PROMPTS * FAIR_PROMPT * sizeof(int32_t));
    uint32_t *lens = malloc(FAIR_MAX_PROMPTS * sizeof(uint32_t));
    if (!tok || !lens)
        die("out of memory");
    /* prompt i is cached prompt i % FAIR_CACHED */
    fill_tokens(tok, (size_t)FAIR_CACHED * FAIR_PROMPT, 0x2626);
    for (uint32_t i = 0; i < FAIR_MAX_PROMPTS; i++) {
        lens[i] = FAIR_PROMPT;
        if (i >= FAIR_CACHED)
            memcpy(tok + (size_t)i * FAIR_PROMPT, tok + (size_t)(i % FAIR_CACHED) * FAIR_PROMPT,
                   FAIR_PROMPT * sizeof(int32_t));
    }
    static const char *const old_args[] = {
        "--set", "limits.max_lookup_tokens=1048576", "--set", "limits.max_batch=4096",
        "--set", "server.max_frame_bytes=16MiB",     NULL};
    static const char *const no_args[] = {NULL};
    printf("\n6. a bystander's Ping under a Lookup flood (issue #26): kvpoold (host backend, "
           "%u pages of %u, %u prompts of %u tokens cached: %u pages), %u flood clients "
           "(namespace flood, a connection each) sending back-to-back Lookups of the largest "
           "size the daemon accepts, every prompt a cached one (whole hits); a bystander "
           "(namespace bystander) pings up to %u times, 0-1 ms apart, at most %.0f s; the "
           "daemon: %s\n",
           FAIR_POOL_PAGES, FAIR_PS, FAIR_CACHED, FAIR_PROMPT,
           FAIR_CACHED * (FAIR_PROMPT / FAIR_PS), floods, pings, FAIR_PHASE_MAX_NS / 1e9,
           getenv("KVPOOLD") ? getenv("KVPOOLD") : "the build's");
    *old_cap = fair_run(old_args, pings, floods, tok, lens);
    if (old_cap->ok)
        fair_print("old cap (--set limits.max_lookup_tokens=1048576)", old_cap, floods);
    *dflt = fair_run(no_args, pings, floods, tok, lens);
    if (dflt->ok)
        fair_print("the daemon's default limits.max_lookup_tokens", dflt, floods);
    free(tok);
    free(lens);
    return old_cap->ok && dflt->ok ? 0 : -1;
}

int main(int argc, char **argv)
{
    uint32_t rounds = 1000, requests = 2000, evict_rounds = 31, pings = 2000, floods = 2;
    int daemon = 1, quick = 0, flood_only = 0, events = 1, events_only = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--rounds") && i + 1 < argc)
            rounds = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--requests") && i + 1 < argc)
            requests = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--pings") && i + 1 < argc)
            pings = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--flood-clients") && i + 1 < argc)
            floods = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--quick"))
            rounds = 20, requests = 20, evict_rounds = 2, pings = 200, quick = 1;
        else if (!strcmp(argv[i], "--no-daemon"))
            daemon = 0;
        else if (!strcmp(argv[i], "--flood"))
            flood_only = 1;
        else if (!strcmp(argv[i], "--events"))
            events_only = 1;
        else if (!strcmp(argv[i], "--no-events"))
            events = 0;
        else {
            fprintf(stderr,
                    "usage: %s [--rounds N] [--requests N] [--quick] [--no-daemon] [--flood] "
                    "[--pings N] [--flood-clients N] [--events] [--no-events]\n",
                    argv[0]);
            return 2;
        }
    }
    if (rounds < 10)
        rounds = 10;
    if (requests < 10)
        requests = 10;
    if (pings < 10)
        pings = 10;
    if (floods < 1 || floods > 64)
        floods = floods < 1 ? 1 : 64;
    fair_result_t old_cap = {0}, dflt = {0};
    bench_events_opts_t evo = {.quick = quick, .daemon = daemon};
    bench_events_result_t evr = {0};
    if (events_only) {
        int rc = bench_events(&evo, &evr);
        printf("\n");
        bench_events_keys(&evr);
        return rc ? 1 : 0;
    }
    if (flood_only) {
        int rc = bench_flood(pings, floods, &old_cap, &dflt);
        printf("\n");
        if (old_cap.ok)
            fair_keys("old_cap", &old_cap);
        if (dflt.ok)
            fair_keys("default", &dflt);
        return rc ? 1 : 0;
    }
    printf("prefix cache benchmark (issue #16): page %u, prompt %u tokens (%u pages)\n\n", PS,
           PROMPT, PROMPT_PAGES);
    double hash = bench_hash(rounds);
    hit_result_t hit = bench_hit(rounds);
    socket_result_t sock = {0};
    if (daemon)
        sock = bench_socket(requests);
    evict_result_t ev = bench_evict(evict_rounds, EVICT_PAGES);
    evict_result_t ev_small = bench_evict(evict_rounds * 4, HIT_PAGES);
    double bpp = bench_bytes();
    int flood_rc = daemon && !quick ? bench_flood(pings, floods, &old_cap, &dflt) : 0;
    int events_rc = events ? bench_events(&evo, &evr) : 0;

    printf("\ntargets (issue #16): hash >= 800 M tokens/s: %s; hit <= 3 ns/token (reserve): %s; "
           "eviction >= 20 M pages/s: %s; <= 64 bytes/page: %s\n",
           hash >= 800e6 ? "met" : "MISSED", hit.reserve_ns_tok <= 3.0 ? "met" : "MISSED",
           ev.alloc_pps >= 20e6 ? "met" : "MISSED", bpp <= 64.0 ? "met" : "MISSED");
    printf("\nhash_tokens_per_s=%.0f\n", hash);
    printf("hit_cpu_ns_per_token=%.3f\n", hit.reserve_ns_tok);
    printf("hit_release_ns_per_token=%.3f\n", hit.release_ns_tok);
    printf("hit_cpu_total_ns_per_token=%.3f\n", hit.total_ns_tok);
    printf("hit_leave_last_ns_per_token=%.3f\n", hit.last_reserve_ns_tok);
    printf("cold_cpu_ns_per_token=%.3f\n", hit.cold_ns_tok);
    if (sock.ok) {
        printf("hit_reserve_p50_us=%.1f\n", sock.hit_p50);
        printf("hit_reserve_p99_us=%.1f\n", sock.hit_p99);
        printf("cold_reserve_p50_us=%.1f\n", sock.cold_p50);
        printf("cold_reserve_p99_us=%.1f\n", sock.cold_p99);
        printf("lookup_p50_us=%.1f\n", sock.lookup_p50);
        printf("ping_p50_us=%.1f\n", sock.ping_p50);
        if (sock.have_redis)
            printf("redis_ping_p50_us=%.1f\n", sock.redis_p50);
    }
    printf("evict_alloc_pages_per_s=%.0f\n", ev.alloc_pps);
    printf("evict_plan_pages_per_s=%.0f\n", ev.plan_pps);
    printf("free_alloc_pages_per_s=%.0f\n", ev.free_pps);
    printf("evict_alloc_4096_pages_per_s=%.0f\n", ev_small.alloc_pps);
    printf("cache_bytes_per_page=%.1f\n", bpp);
    if (old_cap.ok)
        fair_keys("old_cap", &old_cap);
    if (dflt.ok)
        fair_keys("default", &dflt);
    bench_events_keys(&evr);
    return (daemon && !sock.ok) || flood_rc || events_rc ? 1 : 0;
}
