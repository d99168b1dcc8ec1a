/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bench_tier.c - the host tier's mover (ops->move_slots of the cuda backend, issue #28) against
 * the pinned cudaMemcpy ceilings measured in the same run. A cuda backend of Llama-3.1-8B's
 * geometry (32 layers, 8 KV heads, head_dim 128, bf16, page 16: 2 MiB a page packed) with a
 * pool of --pool-gib GiB, and a host tier of --tier-gib GiB (kvp_tier_mem, pinned in 1 GiB
 * chunks by its thread). Printed as key=value lines:
 *   tier_ready_seconds, tier_pin_gbps: how long the tier took to be pinned, and its rate;
 *     decode_step_us_pinning (device time, median and max) and decode_step_wall_us_pinning
 *     (wall clock, median, p99, max; how many over 1 ms): the decode step below, back to back
 *     while it was pinned (a driver lock held by cudaHostRegister shows there);
 *   tier_pinned_h2d_gbps, tier_pinned_d2h_gbps, tier_pinned_bidir_gbps: cudaMemcpyAsync of 1 GiB
 *     between a cudaHostAlloc buffer and device memory, each way, and both ways at once on two
 *     streams (bytes of both over the time of both); _registered_: the same from the tier's
 *     own memory (cudaHostRegister);
 *   per batch of B scattered pages to B scattered slots (B = --batches, 64,256,1024):
 *     tier_offload_gbps_bB, tier_restore_gbps_bB, tier_both_gbps_bB (an offload and a restore
 *     of B pages each at once, two threads, bytes of both over the round's time), each the
 *     median of --runs runs (fresh random pages and slots each), with _p10 / _p90 and the ratio
 *     to its ceiling (_ratio: offload / d2h, restore / h2d, both / bidir); the largest batch's
 *     figures again without the suffix (tier_offload_gbps=...);
 *   decode_step_us_idle, decode_step_us_offload, decode_step_slowdown_during_offload (and
 *     _restore): the median device time (CUDA events) of a decode step's append - 256
 *     sequences x 1 token, all 32 layers in one launch of kvp_append_cuda with the slots in the
 *     launch, what the daemon's run() queues for a decode Append - on a stream of its own, while
 *     another thread offloads (restores) batches of the largest size back to back, over the
 *     same step idle.
 * Correctness first: before anything is timed, a batch of random pages (fresh random bytes
 * moved in with the page-mover, ops->move) goes out to slots, each slot compared byte for byte
 * with those bytes, then comes back into other pages, read back with the page-mover and
 * compared again; exit 1 on a difference. Time is wall-clock around each synchronous
 * move_slots call (what a worker thread waits). --pack-blocks N sets [tuning] pack_blocks (the
 * pack kernels' grid cap; 0: the mover's default); --tier-chunk-mib N the tier's pinning chunk
 * (0: kvp_tier_mem's 1 GiB); --pin-only stops after the pinning figures. Exits 77 without a
 * GPU.
 *
 *   bench_tier [--pool-gib N] [--tier-gib N] [--runs N] [--batches B,B,...] [--pack-blocks N]
 *              [--tier-chunk-mib N] [--pin-only]
 */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvp_backend.h"
#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_kernels.h"
#include "kvp_kernels_cuda.h"
#include "kvp_tier_mem.h"

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));  \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)
#define KV(call)                                                                                   \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_) {                                                                                 \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, kvp_strerror(rc_));       \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

#define MAX_BATCHES   8
#define MAX_RUNS      1000
#define DECODE_SEQS   256u
#define DECODE_STEPS  200
#define CEIL_BYTES    (1ull << 30)
#define MAX_PIN_STEPS 100000

typedef struct {
    kvp_backend_t *b;
    kvp_tier_mem_t *tier;
    uint32_t num_pages, nslots;
    uint64_t pb; /* one page's packed form */
} bench_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void rng_fill(uint64_t *s, void *p, size_t n)
{
    uint8_t *b = p;
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v = rng_next(s);
        memcpy(b + i, &v, n - i < 8 ? n - i : 8);
    }
}

/* n distinct random values in [lo, lo + span), scratch holding span values. */
static void pick(uint64_t *s, uint32_t *out, uint32_t n, uint32_t lo, uint32_t span,
                 uint32_t *scratch)
{
    for (uint32_t i = 0; i < span; i++)
        scratch[i] = i;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t j = i + (uint32_t)(rng_next(s) % (span - i));
        uint32_t t = scratch[i];
        scratch[i] = scratch[j];
        scratch[j] = t;
        out[i] = lo + scratch[i];
    }
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Sorts v and returns its q-quantile (nearest rank). */
static double quantile(double *v, int n, double q)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return v[(int)(q * (n - 1) + 0.5)];
}

/* key[suffix]=median, _p10, _p90 and _ratio (median / ceiling); returns the median. */
static double print_stat(const char *key, const char *suffix, double *v, int n, double ceiling)
{
    const double p10 = quantile(v, n, 0.1), med = quantile(v, n, 0.5), p90 = quantile(v, n, 0.9);
    printf("%s%s=%.2f\n%s%s_p10=%.2f\n%s%s_p90=%.2f\n%s%s_ratio=%.3f\n", key, suffix, med, key,
           suffix, p10, key, suffix, p90, key, suffix, ceiling > 0 ? med / ceiling : 0.0);
    return med;
}

/* ---- ceilings ------------------------------------------------------------------------------ */

/* Medians (GB/s) of runs cudaMemcpyAsync's of bytes: out[0] host -> device (host_a -> dev_a),
 * out[1] device -> host (dev_a -> host_a), out[2] both at once on two streams (host_a ->
 * dev_a beside dev_b -> host_b: bytes of both over the time of both). */
static void ceilings(uint8_t *host_a, uint8_t *host_b, uint8_t *dev_a, uint8_t *dev_b,
                     uint64_t bytes, int runs, double out[3])
{
    cudaStream_t s1, s2;
    cudaEvent_t e0, e1, e2;
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventCreate(&e2));
    double *v = xmalloc(sizeof(double) * (size_t)runs);
    for (int way = 0; way < 3; way++) {
        for (int r = -2; r < runs; r++) { /* two warm-up runs */
            CK(cudaEventRecord(e0, s1));
            if (way == 0 || way == 2)
                CK(cudaMemcpyAsync(dev_a, host_a, bytes, cudaMemcpyHostToDevice, s1));
            if (way == 1)
                CK(cudaMemcpyAsync(host_a, dev_a, bytes, cudaMemcpyDeviceToHost, s1));
            if (way == 2) {
                CK(cudaStreamWaitEvent(s2, e0, 0));
                CK(cudaMemcpyAsync(host_b, dev_b, bytes, cudaMemcpyDeviceToHost, s2));
                CK(cudaEventRecord(e2, s2));
                CK(cudaStreamWaitEvent(s1, e2, 0));
            }
            CK(cudaEventRecord(e1, s1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 0)
                v[r] = (double)bytes * (way == 2 ? 2 : 1) / ((double)ms * 1e-3) / 1e9;
        }
        out[way] = quantile(v, runs, 0.5);
    }
    free(v);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaEventDestroy(e2));
    CK(cudaStreamDestroy(s1));
    CK(cudaStreamDestroy(s2));
}

/* ---- correctness --------------------------------------------------------------------------- */

static void page_move(bench_t *bn, int dir, uint32_t page, void *buf)
{
    const int32_t pg = (int32_t)page;
    const kvp_move_t m = {.dir = dir,
                          .pages = &pg,
                          .num_tokens = bn->b->geom.page_size,
                          .begin = 0,
                          .end = bn->pb,
                          .buf = buf,
                          .buf_medium = KVP_MEDIUM_HOST};
    KV(bn->b->ops->move(bn->b, &m));
}

/* n random pages get fresh random bytes (the page-mover), go out to n random slots (each
 * compared with those bytes), come back into n other pages (read back with the page-mover,
 * compared). Returns 0, or 1 on a difference. */
static int check_bytes(bench_t *bn, uint32_t n, uint64_t *seed)
{
    const uint32_t half = bn->num_pages / 2;
    uint32_t *from = xmalloc(n * 4), *into = xmalloc(n * 4), *slot = xmalloc(n * 4);
    uint32_t *scratch = xmalloc((half > bn->nslots ? half : bn->nslots) * 4);
    void **addr = xmalloc(n * sizeof(void *));
    uint8_t *want = xmalloc(n * bn->pb), *got = xmalloc(bn->pb);
    pick(seed, from, n, 0, half, scratch);
    pick(seed, into, n, half, half, scratch);
    pick(seed, slot, n, 0, bn->nslots, scratch);
    rng_fill(seed, want, n * bn->pb);
    for (uint32_t i = 0; i < n; i++) {
        page_move(bn, KVP_MOVE_IN, from[i], want + i * bn->pb);
        addr[i] = kvp_tier_mem_slot(bn->tier, slot[i]);
        memset(addr[i], 0xa5, bn->pb);
    }
    int bad = 0;
    kvp_slot_move_t m = {.dir = KVP_MOVE_OUT, .pages = from, .slots = addr, .n = n};
    KV(bn->b->ops->move_slots(bn->b, &m));
    for (uint32_t i = 0; i < n && !bad; i++)
        if (memcmp(addr[i], want + i * bn->pb, bn->pb)) {
            fprintf(stderr, "offload: page %u's slot %u differs\n", from[i], slot[i]);
            bad = 1;
        }
    m = (kvp_slot_move_t){.dir = KVP_MOVE_IN, .pages = into, .slots = addr, .n = n};
    KV(bn->b->ops->move_slots(bn->b, &m));
    for (uint32_t i = 0; i < n && !bad; i++) {
        page_move(bn, KVP_MOVE_OUT, into[i], got);
        if (memcmp(got, want + i * bn->pb, bn->pb)) {
            fprintf(stderr, "restore: slot %u into page %u differs\n", slot[i], into[i]);
            bad = 1;
        }
    }
    printf("bytes %s: %u pages out to scattered slots and back into other pages\n",
           bad ? "DIFFER" : "agree", n);
    free(got);
    free(want);
    free(addr);
    free(scratch);
    free(slot);
    free(into);
    free(from);
    return bad;
}

/* ---- the mover, timed ---------------------------------------------------------------------- */

/* One side of a run: dir, n pages of [plo, plo + pspan), n slots of [slo, slo + sspan). */
typedef struct {
    bench_t *bn;
    int dir;
    uint32_t n, plo, pspan, slo, sspan;
    uint64_t seed;
    uint32_t *pages, *slot_idx, *scratch;
    void **slots;
    double t0, t1;
} side_t;

static void side_init(side_t *sd, bench_t *bn, int dir, uint32_t n, uint32_t plo, uint32_t pspan,
                      uint32_t slo, uint32_t sspan, uint64_t seed)
{
    *sd = (side_t){.bn = bn,
                   .dir = dir,
                   .n = n,
                   .plo = plo,
                   .pspan = pspan,
                   .slo = slo,
                   .sspan = sspan,
                   .seed = seed};
    sd->pages = xmalloc(n * sizeof(uint32_t));
    sd->slot_idx = xmalloc(n * sizeof(uint32_t));
    sd->scratch = xmalloc((pspan > sspan ? pspan : sspan) * sizeof(uint32_t));
    sd->slots = xmalloc(n * sizeof(void *));
}

static void side_free(side_t *sd)
{
    free(sd->slots);
    free(sd->scratch);
    free(sd->slot_idx);
    free(sd->pages);
}

/* Fresh scattered pages and slots for the next move. */
static void side_pick(side_t *sd)
{
    pick(&sd->seed, sd->pages, sd->n, sd->plo, sd->pspan, sd->scratch);
    pick(&sd->seed, sd->slot_idx, sd->n, sd->slo, sd->sspan, sd->scratch);
    for (uint32_t i = 0; i < sd->n; i++)
        sd->slots[i] = kvp_tier_mem_slot(sd->bn->tier, sd->slot_idx[i]);
}

/* One move, timed on the wall clock (move_slots returns when the bytes are in place). */
static double side_move(side_t *sd)
{
    kvp_slot_move_t m = {.dir = sd->dir, .pages = sd->pages, .slots = sd->slots, .n = sd->n};
    sd->t0 = now_s();
    KV(sd->bn->b->ops->move_slots(sd->bn->b, &m));
    sd->t1 = now_s();
    return (double)sd->n * (double)sd->bn->pb / (sd->t1 - sd->t0) / 1e9;
}

/* Both directions at once: each round the two threads start together (a barrier with the
 * main thread, which has picked for both). */
typedef struct {
    side_t *sd;
    pthread_barrier_t *go, *done;
    int rounds;
} both_t;

static void *both_main(void *arg)
{
    both_t *a = arg;
    for (int r = 0; r < a->rounds; r++) {
        pthread_barrier_wait(a->go);
        side_move(a->sd);
        pthread_barrier_wait(a->done);
    }
    return NULL;
}

static void both_rounds(side_t *off, side_t *res, int runs, double *v)
{
    pthread_barrier_t go, done;
    pthread_barrier_init(&go, NULL, 3);
    pthread_barrier_init(&done, NULL, 3);
    const int rounds = runs + 1; /* round 0 warms up */
    both_t a = {off, &go, &done, rounds}, c = {res, &go, &done, rounds};
    pthread_t ta, tc;
    if (pthread_create(&ta, NULL, both_main, &a) || pthread_create(&tc, NULL, both_main, &c))
        exit(2);
    for (int r = 0; r < rounds; r++) {
        side_pick(off);
        side_pick(res);
        pthread_barrier_wait(&go);
        pthread_barrier_wait(&done);
        const double t0 = off->t0 < res->t0 ? off->t0 : res->t0;
        const double t1 = off->t1 > res->t1 ? off->t1 : res->t1;
        if (r > 0)
            v[r - 1] = (double)(off->n + res->n) * (double)off->bn->pb / (t1 - t0) / 1e9;
    }
    pthread_join(ta, NULL);
    pthread_join(tc, NULL);
    pthread_barrier_destroy(&go);
    pthread_barrier_destroy(&done);
}

/* ---- the decode step --------------------------------------------------------------------- */

typedef struct {
    kvp_paged_kv_t kv;
    kvp_append_src_t src;
    kvp_append_cuda_args_t args;
    int32_t slots[DECODE_SEQS];
    uint32_t first_page;
    cudaStream_t s;
    cudaEvent_t e0, e1;
} decode_t;

/* A decode step's append: DECODE_SEQS sequences, one token each, into pages [first_page,
 * first_page + DECODE_SEQS) (one a sequence), every layer in one launch, the slots in it. */
static void decode_init(decode_t *d, bench_t *bn, uint32_t first_page, uint64_t *seed)
{
    const kvp_backend_t *b = bn->b;
    int ordinal;
    void *pool;
    KV(kvp_backend_cuda_device(b, 0, &ordinal, &pool));
    kvp_backend_layer_view(b, pool, 0, &d->kv);
    const uint64_t rows = (uint64_t)DECODE_SEQS * b->derived.heads * b->derived.row_bytes;
    const uint64_t bytes = 2 * rows * b->geom.num_layers;
    uint8_t *host = xmalloc(bytes), *dev;
    rng_fill(seed, host, bytes);
    CK(cudaMalloc((void **)&dev, bytes));
    CK(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
    free(host);
    const int64_t hd = (int64_t)b->derived.heads * b->geom.head_dim;
    d->src = (kvp_append_src_t){.key = dev,
                                .value = dev + rows,
                                .k_stride_n = hd,
                                .k_stride_h = b->geom.head_dim,
                                .v_stride_n = hd,
                                .v_stride_h = b->geom.head_dim};
    d->args = (kvp_append_cuda_args_t){.flags = KVP_APPEND_CUDA_HOST_DEST,
                                       .num_layers = b->geom.num_layers,
                                       .layer_stride_bytes = b->derived.layer_bytes,
                                       .src_layer_stride_bytes = 2 * rows};
    d->first_page = first_page;
    CK(cudaStreamCreateWithFlags(&d->s, cudaStreamNonBlocking));
    CK(cudaEventCreate(&d->e0));
    CK(cudaEventCreate(&d->e1));
}

/* Device time (us) of steps decode steps (after warm unrecorded ones), a short pause between them
 * so they sample every phase of a concurrent move; wall (may be NULL): each one's wall-clock
 * time, from before its first event is recorded until its last completed. */
static void decode_steps(decode_t *d, const bench_t *bn, int warm, int steps, double *us,
                         double *wall)
{
    const struct timespec pause = {0, 100000};
    const uint32_t ps = bn->b->geom.page_size;
    for (int i = -warm; i < steps; i++) {
        const double t0 = now_s();
        for (uint32_t q = 0; q < DECODE_SEQS; q++)
            d->slots[q] = (int32_t)((d->first_page + q) * ps + (uint32_t)(i + warm) % ps);
        const kvp_append_dest_t dest = {
            .kind = KVP_APPEND_DEST_SLOTS, .nnz = DECODE_SEQS, .slots = d->slots};
        CK(cudaEventRecord(d->e0, d->s));
        KV(kvp_append_cuda(&d->kv, &d->src, &dest, &d->args, d->s));
        CK(cudaEventRecord(d->e1, d->s));
        CK(cudaEventSynchronize(d->e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, d->e0, d->e1));
        if (i >= 0)
            us[i] = (double)ms * 1e3;
        if (i >= 0 && wall)
            wall[i] = (now_s() - t0) * 1e6;
        nanosleep(&pause, NULL);
    }
}

/* A mover that moves batches back to back until told to stop. */
typedef struct {
    side_t *sd;
    atomic_int stop, moves;
} busy_t;

static void *busy_main(void *arg)
{
    busy_t *bz = arg;
    while (!atomic_load(&bz->stop)) {
        side_pick(bz->sd);
        side_move(bz->sd);
        atomic_fetch_add(&bz->moves, 1);
    }
    return NULL;
}

/* Median decode step (us) while sd moves back to back; the moves done meanwhile in *moves. */
static void decode_busy(decode_t *d, const bench_t *bn, side_t *sd, double *us, int *moves)
{
    busy_t bz = {.sd = sd};
    atomic_init(&bz.stop, 0);
    atomic_init(&bz.moves, 0);
    pthread_t t;
    if (pthread_create(&t, NULL, busy_main, &bz))
        exit(2);
    const struct timespec nap = {0, 1000000};
    while (atomic_load(&bz.moves) < 1) /* its context made, the link busy */
        nanosleep(&nap, NULL);
    decode_steps(d, bn, 5, DECODE_STEPS, us, NULL);
    atomic_store(&bz.stop, 1);
    pthread_join(t, NULL);
    *moves = atomic_load(&bz.moves);
}

/* ---- main ---------------------------------------------------------------------------------- */

static uint32_t arg_u32(const char *flag, const char *v, uint32_t lo, uint32_t hi)
{
    char *end;
    unsigned long x = v ? strtoul(v, &end, 10) : 0;
    if (!v || *end || x < lo || x > hi) {
        fprintf(stderr, "%s wants a number in %u..%u\n", flag, lo, hi);
        exit(2);
    }
    return (uint32_t)x;
}

int main(int argc, char **argv)
{
    uint32_t pool_gib = 40, tier_gib = 16, runs = 20, pack_blocks = 0, chunk_mib = 0;
    int pin_only = 0;
    uint32_t batches[MAX_BATCHES] = {64, 256, 1024}, nb = 3;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--pool-gib"))
            pool_gib = arg_u32(argv[i], v, 1, 128), i++;
        else if (!strcmp(argv[i], "--tier-gib"))
            tier_gib = arg_u32(argv[i], v, 1, 512), i++;
        else if (!strcmp(argv[i], "--runs"))
            runs = arg_u32(argv[i], v, 1, MAX_RUNS), i++;
        else if (!strcmp(argv[i], "--tier-chunk-mib"))
            chunk_mib = arg_u32(argv[i], v, 0, 65536), i++;
        else if (!strcmp(argv[i], "--pin-only"))
            pin_only = 1;
        else if (!strcmp(argv[i], "--pack-blocks"))
            pack_blocks = arg_u32(argv[i], v, 0, KVP_PACK_CUDA_MAX_BLOCKS), i++;
        else if (!strcmp(argv[i], "--batches") && v) {
            nb = 0;
            for (char *p = argv[++i]; *p && nb < MAX_BATCHES;) {
                char *end;
                unsigned long x = strtoul(p, &end, 10);
                if (end == p || x < 1 || x > 65536) {
                    fprintf(stderr, "--batches wants sizes 1..65536, comma-separated\n");
                    return 2;
                }
                batches[nb++] = (uint32_t)x;
                p = *end == ',' ? end + 1 : end;
            }
        } else {
            fprintf(stderr, "unknown argument '%s' (see the file header)\n", argv[i]);
            return 2;
        }
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) {
        printf("no usable GPU: skipped\n");
        return 77;
    }
    const kvp_geom_t g = {.num_layers = 32,
                          .page_size = 16,
                          .num_kv_heads = 8,
                          .head_dim = 128,
                          .dtype = KVP_DTYPE_BF16,
                          .layout = KVP_LAYOUT_NHD,
                          .storage = KVP_STORAGE_COMBINED,
                          .num_devices = 1,
                          .num_pages = (uint32_t)(((uint64_t)pool_gib << 30) / (2ull << 20))};
    const kvp_backend_tuning_t tuning = {.pack_blocks = pack_blocks};
    bench_t bn = {.num_pages = g.num_pages};
    int dev = 0;
    KV(kvp_backend_cuda_create(&g, &dev, 1, &tuning, &bn.b));
    bn.pb = kvp_backend_slot_bytes(bn.b);
    bn.nslots = (uint32_t)(((uint64_t)tier_gib << 30) / bn.pb);
    uint32_t max_batch = 0;
    for (uint32_t i = 0; i < nb; i++)
        max_batch = batches[i] > max_batch ? batches[i] : max_batch;
    if (bn.num_pages / 2 < max_batch + DECODE_SEQS || bn.nslots / 2 < max_batch) {
        fprintf(stderr, "a batch of %u needs a larger pool or tier\n", max_batch);
        return 2;
    }
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device=\"%s\" pool_pages=%u pool_gib=%u tier_slots=%u tier_gib=%u page_bytes=%llu "
           "runs=%u pack_blocks=%u tier_chunk_mib=%u\n",
           prop.name, bn.num_pages, pool_gib, bn.nslots, tier_gib, (unsigned long long)bn.pb, runs,
           pack_blocks, chunk_mib);

    uint64_t seed = 0x28ab;
    int ordinal;
    void *pool;
    KV(kvp_backend_cuda_device(bn.b, 0, &ordinal, &pool));
    const uint64_t fill = 64ull << 20;
    uint8_t *rnd;
    CK(cudaHostAlloc((void **)&rnd, fill + 4096, cudaHostAllocDefault));
    rng_fill(&seed, rnd, fill + 4096);
    cudaStream_t fs;
    CK(cudaStreamCreateWithFlags(&fs, cudaStreamNonBlocking));
    const uint64_t pool_bytes = bn.b->derived.pool_bytes;
    for (uint64_t off = 0, k = 0; off < pool_bytes; off += fill, k++) /* no two pages alike */
        CK(cudaMemcpyAsync((uint8_t *)pool + off, rnd + (k * 16) % 4096,
                           pool_bytes - off < fill ? pool_bytes - off : fill,
                           cudaMemcpyHostToDevice, fs));
    CK(cudaStreamSynchronize(fs));

    /* the decode step idle, then while the tier is pinned in 1 GiB chunks by its thread (the
     * step's wall time too: a driver lock held by cudaHostRegister would show there) */
    decode_t d;
    decode_init(&d, &bn, bn.num_pages - DECODE_SEQS, &seed);
    double idle[DECODE_STEPS], busy[DECODE_STEPS];
    decode_steps(&d, &bn, 5, DECODE_STEPS, idle, NULL);
    const double idle_med = quantile(idle, DECODE_STEPS, 0.5);
    const double idle_p90 = quantile(idle, DECODE_STEPS, 0.9);
    printf("decode_step_us_idle=%.2f\ndecode_step_us_idle_p90=%.2f\n", idle_med, idle_p90);
    const double t_tier = now_s();
    KV(kvp_tier_mem_create(bn.b, bn.nslots, bn.pb, (uint64_t)chunk_mib << 20, -1, &bn.tier));
    double *pin_dev = xmalloc(sizeof(double) * MAX_PIN_STEPS);
    double *pin_wall = xmalloc(sizeof(double) * MAX_PIN_STEPS);
    int pin_steps = 0;
    while (!kvp_tier_mem_done(bn.tier) && pin_steps < MAX_PIN_STEPS) {
        decode_steps(&d, &bn, 0, 1, pin_dev + pin_steps, pin_wall + pin_steps);
        pin_steps++;
    }
    const struct timespec nap = {0, 5000000};
    while (!kvp_tier_mem_done(bn.tier))
        nanosleep(&nap, NULL);
    KV(kvp_tier_mem_error(bn.tier));
    const double ready_s = now_s() - t_tier;
    printf("tier_ready_seconds=%.2f\ntier_pin_gbps=%.2f\n", ready_s,
           (double)kvp_tier_mem_ready_bytes(bn.tier) / ready_s / 1e9);
    if (pin_steps > 0) {
        int slow = 0;
        for (int i = 0; i < pin_steps; i++)
            slow += pin_wall[i] > 1000.0;
        printf("decode_steps_while_pinning=%d\ndecode_steps_over_1ms_while_pinning=%d\n", pin_steps,
               slow);
        printf("decode_step_us_pinning=%.2f\ndecode_step_us_pinning_max=%.2f\n",
               quantile(pin_dev, pin_steps, 0.5), quantile(pin_dev, pin_steps, 1.0));
        printf("decode_step_wall_us_pinning=%.2f\ndecode_step_wall_us_pinning_p99=%.2f\n"
               "decode_step_wall_us_pinning_max=%.2f\n",
               quantile(pin_wall, pin_steps, 0.5), quantile(pin_wall, pin_steps, 0.99),
               quantile(pin_wall, pin_steps, 1.0));
    }
    free(pin_dev);
    free(pin_wall);
    if (pin_only) {
        kvp_tier_mem_destroy(bn.tier);
        bn.b->ops->destroy(bn.b);
        return 0;
    }
    uint8_t *tier0 = kvp_tier_mem_slot(bn.tier, 0);
    for (uint64_t off = 0, total = (uint64_t)bn.nslots * bn.pb; off < total; off += fill)
        memcpy(tier0 + off, rnd + (off >> 20) % 4096, total - off < fill ? total - off : fill);

    /* correctness before any timing */
    if (check_bytes(&bn, 257, &seed))
        return 1;

    /* ceilings: cudaHostAlloc memory, then the tier's own (registered) memory */
    double cl[3], reg[3];
    uint8_t *ha, *hb, *da, *db;
    CK(cudaHostAlloc((void **)&ha, CEIL_BYTES, cudaHostAllocDefault));
    CK(cudaHostAlloc((void **)&hb, CEIL_BYTES, cudaHostAllocDefault));
    memcpy(ha, rnd, fill);
    memcpy(hb, rnd, fill);
    CK(cudaMalloc((void **)&da, CEIL_BYTES));
    CK(cudaMalloc((void **)&db, CEIL_BYTES));
    CK(cudaMemcpy(da, ha, CEIL_BYTES, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(db, ha, CEIL_BYTES, cudaMemcpyHostToDevice));
    ceilings(ha, hb, da, db, CEIL_BYTES, (int)runs, cl);
    const uint32_t gib_slots = (uint32_t)(CEIL_BYTES / bn.pb);
    if (bn.nslots >= 2 * gib_slots)
        ceilings(tier0, (uint8_t *)kvp_tier_mem_slot(bn.tier, gib_slots), da, db, CEIL_BYTES,
                 (int)runs, reg);
    else
        reg[0] = reg[1] = reg[2] = 0;
    printf("tier_pinned_h2d_gbps=%.2f\ntier_pinned_d2h_gbps=%.2f\ntier_pinned_bidir_gbps=%.2f\n",
           cl[0], cl[1], cl[2]);
    printf("tier_pinned_registered_h2d_gbps=%.2f\ntier_pinned_registered_d2h_gbps=%.2f\n"
           "tier_pinned_registered_bidir_gbps=%.2f\n",
           reg[0], reg[1], reg[2]);
    CK(cudaFree(da));
    CK(cudaFree(db));
    CK(cudaFreeHost(ha));
    CK(cudaFreeHost(hb));

    /* the mover: offload from the first half of the pool into the first half of the tier,
     * restore from the second half of the tier into the second half of the pool (but the
     * decode step's pages at its end) */
    const uint32_t ph = bn.num_pages / 2, sh = bn.nslots / 2;
    double *v = xmalloc(sizeof(double) * (runs + 1));
    double last[3] = {0, 0, 0};
    for (uint32_t k = 0; k < nb; k++) {
        const uint32_t n = batches[k];
        char sfx[32];
        snprintf(sfx, sizeof(sfx), "_b%u", n);
        side_t off, res;
        side_init(&off, &bn, KVP_MOVE_OUT, n, 0, ph, 0, sh, seed + 1 + k);
        side_init(&res, &bn, KVP_MOVE_IN, n, ph, bn.num_pages - ph - DECODE_SEQS, sh,
                  bn.nslots - sh, seed + 101 + k);
        for (int r = -1; r < (int)runs; r++) { /* run -1 warms up (and makes the context) */
            side_pick(&off);
            double gbs = side_move(&off);
            if (r >= 0)
                v[r] = gbs;
        }
        last[0] = print_stat("tier_offload_gbps", sfx, v, (int)runs, cl[1]);
        for (int r = -1; r < (int)runs; r++) {
            side_pick(&res);
            double gbs = side_move(&res);
            if (r >= 0)
                v[r] = gbs;
        }
        last[1] = print_stat("tier_restore_gbps", sfx, v, (int)runs, cl[0]);
        both_rounds(&off, &res, (int)runs, v);
        last[2] = print_stat("tier_both_gbps", sfx, v, (int)runs, cl[2]);
        side_free(&off);
        side_free(&res);
    }
    printf("tier_offload_gbps=%.2f\ntier_offload_ratio=%.3f\n", last[0], last[0] / cl[1]);
    printf("tier_restore_gbps=%.2f\ntier_restore_ratio=%.3f\n", last[1], last[1] / cl[0]);
    printf("tier_both_gbps=%.2f\ntier_both_ratio=%.3f\n", last[2], last[2] / cl[2]);

    /* the decode step beside a mover running the largest batch back to back */
    for (int dir = KVP_MOVE_OUT; dir <= KVP_MOVE_IN; dir++) {
        side_t sd;
        if (dir == KVP_MOVE_OUT)
            side_init(&sd, &bn, dir, max_batch, 0, ph, 0, sh, seed + 201);
        else
            side_init(&sd, &bn, dir, max_batch, ph, bn.num_pages - ph - DECODE_SEQS, sh,
                      bn.nslots - sh, seed + 202);
        int moves = 0;
        decode_busy(&d, &bn, &sd, busy, &moves);
        const char *what = dir == KVP_MOVE_OUT ? "offload" : "restore";
        const double med = quantile(busy, DECODE_STEPS, 0.5),
                     p90 = quantile(busy, DECODE_STEPS, 0.9);
        printf("decode_step_us_%s=%.2f\ndecode_step_us_%s_p90=%.2f\n", what, med, what, p90);
        printf("decode_step_slowdown_during_%s=%.3f\ndecode_step_slowdown_during_%s_p90=%.3f\n",
               what, med / idle_med, what, p90 / idle_p90);
        printf("decode_step_%s_batches_meanwhile=%d\n", what, moves);
        side_free(&sd);
    }
    free(v);
    kvp_tier_mem_destroy(bn.tier);
    bn.b->ops->destroy(bn.b);
    return 0;
}
