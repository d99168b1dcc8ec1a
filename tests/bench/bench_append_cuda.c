/*
 * bench_append_cuda.c - the CUDA append kernels against the device-to-device copy ceiling
 * measured in the same run (METHOD.md): a large cudaMemcpyAsync counting bytes read + written.
 * For each workload and layout: the fused append (positions computed in the launch), the
 * checked append (validation kernel + copy), and the fused append replayed from a CUDA graph
 * (µs per launch) with and without programmatic dependent launch: 100 launches rotating over
 * 8 layers of the pool for decode steps, 10 alternating between 2 source sets for prefills.
 * Times are medians of --reps event-timed runs after warm-up; bytes = K and V rows read once
 * and written once. fp16, page 16 unless the workload says otherwise. Prints one table; exits
 * 77 without a GPU. The copy kernels' shape (kvp_append_cuda_opts_t) comes from the flags below
 * (default: automatic, what the daemon and libkvpool run): run the binary once per setting in
 * one device call to compare.
 *
 * --host: instead, the host side of the daemon's two ways to run a decode step's Append
 * (256 x 1, H 8, D 128, one layer): the slot kernel with its slots in the launch, against the
 * plan upload + kernel + error read-back, and an empty launch as the floor; per way the host
 * time of queueing it and of queueing it and synchronising (medians of 2,000, wall clock).
 *
 *   bench_append_cuda [--reps N] [--only SUBSTRING] [--host] [--kernel auto|warp|block]
 *                     [--tokens-per-block N] [--blocks-per-sm N] [--warps-per-block N]
 *                     [--hints none|ld|st|ldst]
 * (the kernel flags are the daemon's [tuning] append_* keys, kvp_config.h)
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvp_bench_kernels.h"
#include "kvp_geom.h"
#include "kvp_kernels_cuda.h"
#include "kvp_knob.h"

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));  \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static int REPS = 50;
static const char *ONLY = NULL; /* --only SUBSTRING: the workloads whose name contains it */
static cudaStream_t S;
static int HOST = 0;                /* --host: the host-side costs only */
static kvp_append_cuda_opts_t OPTS; /* --kernel ... --hints: the copy kernels' shape */

static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Median milliseconds of fn over REPS event-timed runs. */
typedef void (*op_fn)(void *);
static float time_ms(op_fn fn, void *arg, int reps)
{
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 5; i++)
        fn(arg);
    float *t = malloc(sizeof(float) * (size_t)reps);
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(a, S));
        fn(arg);
        CK(cudaEventRecord(b, S));
        CK(cudaEventSynchronize(b));
        CK(cudaEventElapsedTime(&t[i], a, b));
    }
    qsort(t, (size_t)reps, sizeof(float), cmp_f);
    float m = t[reps / 2];
    free(t);
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return m;
}

typedef struct {
    void *dst, *src;
    size_t bytes;
} copy_arg_t;

static void do_copy(void *p)
{
    copy_arg_t *c = p;
    CK(cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice, S));
}

typedef struct {
    kvp_paged_kv_t kv;
    kvp_append_src_t src;
    int32_t *aip, *bi, *pos, *err;
    uint32_t nnz;
    int checked;
    unsigned flags; /* KVP_CUDA_APPEND_* of the fused form */
} app_arg_t;

static void do_append(void *p)
{
    app_arg_t *a = p;
    int rc = a->checked ? kvp_append_paged_kv_cache_cuda_opts(&a->kv, &a->src, a->bi, a->pos,
                                                              a->nnz, a->err, &OPTS, S)
                        : kvp_append_paged_kv_cache_fused_cuda_opts(&a->kv, &a->src, a->aip, a->nnz,
                                                                    a->err, a->flags, &OPTS, S);
    if (rc) {
        fprintf(stderr, "append failed: %d\n", rc);
        exit(1);
    }
}

typedef struct {
    cudaGraphExec_t exec;
} graph_arg_t;

static void do_graph(void *p)
{
    CK(cudaGraphLaunch(((graph_arg_t *)p)->exec, S));
}

typedef struct {
    const char *name;
    uint32_t batch, tokens, heads, dim, page_size, old_len;
} workload_t;

static double CEIL_GBS;

/* Per-launch ms of a graph of n fused launches, launch i writing layer i % nl of the pool
 * (layer_bytes apart) from source set i % ns (src_bytes apart): so the rows measure the
 * steady state of back-to-back launches, not one buffer sitting in L2. */
static float graph_ms(const app_arg_t *a0, int n, unsigned nl, size_t layer_bytes, unsigned ns,
                      size_t src_set_bytes, unsigned flags)
{
    cudaGraph_t graph;
    graph_arg_t ga;
    CK(cudaStreamBeginCapture(S, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < n; i++) {
        app_arg_t a = *a0;
        a.flags = flags;
        a.kv.k_data = (uint8_t *)a.kv.k_data + (i % nl) * layer_bytes;
        a.kv.v_data = (uint8_t *)a.kv.v_data + (i % nl) * layer_bytes;
        a.src.key = (const uint8_t *)a.src.key + (i % ns) * src_set_bytes;
        a.src.value = (const uint8_t *)a.src.value + (i % ns) * src_set_bytes;
        do_append(&a);
    }
    CK(cudaStreamEndCapture(S, &graph));
    CK(cudaGraphInstantiate(&ga.exec, graph, 0));
    float ms = time_ms(do_graph, &ga, REPS) / (float)n;
    CK(cudaGraphExecDestroy(ga.exec));
    CK(cudaGraphDestroy(graph));
    return ms;
}

static void run_workload(const workload_t *w, kvp_layout_t layout)
{
    /* pool: every request holds old_len + tokens */
    uint32_t ps = w->page_size, B = w->batch;
    uint32_t len = w->old_len + w->tokens, pages_per = kvp_geom_pages_for(ps, len);
    kvp_geom_t g = {.num_layers = 1,
                    .num_pages = B * pages_per + 1,
                    .page_size = ps,
                    .num_kv_heads = w->heads,
                    .head_dim = w->dim,
                    .dtype = KVP_DTYPE_FP16,
                    .layout = layout,
                    .storage = KVP_STORAGE_COMBINED,
                    .num_devices = 1};
    kvp_geom_derived_t d;
    if (kvp_geom_derive(&g, &d)) {
        fprintf(stderr, "bad geometry for %s\n", w->name);
        return;
    }
    /* decode graphs rotate over 8 layers of the pool, prefill graphs over 2 source sets */
    const unsigned nl = w->tokens == 1 ? 8 : 1, ns = w->tokens == 1 ? 1 : 2;
    uint8_t *pool;
    CK(cudaMalloc((void **)&pool, d.pool_bytes * nl));
    CK(cudaMemsetAsync(pool, 0, d.pool_bytes * nl, S));
    uint32_t nnz = B * w->tokens;
    size_t row = (size_t)w->dim * 2, src_bytes = (size_t)nnz * w->heads * row;
    uint8_t *src;
    CK(cudaMalloc((void **)&src, 2 * src_bytes * ns));
    CK(cudaMemsetAsync(src, 0x3c, 2 * src_bytes * ns, S));
    int32_t *h_indptr = malloc(4 * (B + 1)), *h_idx = malloc(4 * (size_t)B * pages_per);
    int32_t *h_last = malloc(4 * B), *h_aip = malloc(4 * (B + 1));
    int32_t *h_bi = malloc(4 * (size_t)nnz), *h_pos = malloc(4 * (size_t)nnz);
    h_indptr[0] = h_aip[0] = 0;
    for (uint32_t b = 0; b < B; b++) {
        h_indptr[b + 1] = h_indptr[b] + (int32_t)pages_per;
        h_aip[b + 1] = h_aip[b] + (int32_t)w->tokens;
        h_last[b] = (int32_t)(len - (pages_per - 1) * ps);
        for (uint32_t k = 0; k < pages_per; k++) /* interleave requests' pages */
            h_idx[b * pages_per + k] = (int32_t)(k * B + b);
        for (uint32_t j = 0; j < w->tokens; j++) {
            h_bi[b * w->tokens + j] = (int32_t)b;
            h_pos[b * w->tokens + j] = (int32_t)(w->old_len + j);
        }
    }
    int32_t *d_indptr, *d_idx, *d_last, *d_aip, *d_bi, *d_pos, *d_err;
    CK(cudaMalloc((void **)&d_indptr, 4 * (B + 1)));
    CK(cudaMalloc((void **)&d_idx, 4 * (size_t)B * pages_per));
    CK(cudaMalloc((void **)&d_last, 4 * B));
    CK(cudaMalloc((void **)&d_aip, 4 * (B + 1)));
    CK(cudaMalloc((void **)&d_bi, 4 * (size_t)nnz));
    CK(cudaMalloc((void **)&d_pos, 4 * (size_t)nnz));
    CK(cudaMalloc((void **)&d_err, 4));
    CK(cudaMemcpy(d_indptr, h_indptr, 4 * (B + 1), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_idx, h_idx, 4 * (size_t)B * pages_per, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_last, h_last, 4 * B, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_aip, h_aip, 4 * (B + 1), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_bi, h_bi, 4 * (size_t)nnz, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_pos, h_pos, 4 * (size_t)nnz, cudaMemcpyHostToDevice));
    CK(cudaMemset(d_err, 0, 4));
    app_arg_t a = {.kv = {.k_data = pool,
                          .v_data = pool + d.v_offset_bytes,
                          .elem_bytes = 2,
                          .num_pages = g.num_pages,
                          .page_size = ps,
                          .num_heads = w->heads,
                          .head_dim = w->dim,
                          .stride_page = d.stride_page,
                          .stride_n = d.stride_n,
                          .stride_h = d.stride_h,
                          .batch_size = B,
                          .kv_indptr = d_indptr,
                          .kv_indices = d_idx,
                          .kv_last_page_len = d_last},
                   .src = {.key = src,
                           .value = src + src_bytes,
                           .k_stride_n = (int64_t)w->heads * w->dim,
                           .k_stride_h = w->dim,
                           .v_stride_n = (int64_t)w->heads * w->dim,
                           .v_stride_h = w->dim},
                   .aip = d_aip,
                   .bi = d_bi,
                   .pos = d_pos,
                   .err = d_err,
                   .nnz = nnz};
    double bytes = 2.0 * 2.0 * (double)src_bytes; /* K+V, read + write */
    const char *lay = layout == KVP_LAYOUT_NHD ? "NHD" : "HND";
    float ms = time_ms(do_append, &a, REPS);
    double gbs = bytes / (ms * 1e-3) / 1e9;
    printf("%-28s %-4s %9u %10.2f %9.0f %7.1f%%   fused\n", w->name, lay, nnz, ms * 1e3, gbs,
           100.0 * gbs / CEIL_GBS);
    a.checked = 1;
    ms = time_ms(do_append, &a, REPS);
    gbs = bytes / (ms * 1e-3) / 1e9;
    printf("%-28s %-4s %9u %10.2f %9.0f %7.1f%%   checked (validate + copy)\n", w->name, lay, nnz,
           ms * 1e3, gbs, 100.0 * gbs / CEIL_GBS);
    a.checked = 0;
    for (int pdl = 0; pdl < 2; pdl++) {
        unsigned fl = pdl ? KVP_CUDA_APPEND_PDL : 0u;
        int n = w->tokens == 1 ? 100 : 10;
        ms = graph_ms(&a, n, nl, d.pool_bytes, ns, 2 * src_bytes, fl);
        gbs = bytes / (ms * 1e-3) / 1e9;
        printf("%-28s %-4s %9u %10.2f %9.0f %7.1f%%   fused, graph of %d (%s)%s\n", w->name, lay,
               nnz, ms * 1e3, gbs, 100.0 * gbs / CEIL_GBS, n,
               w->tokens == 1 ? "8 layers" : "2 source sets", pdl ? ", PDL" : "");
    }
    int32_t herr;
    CK(cudaMemcpy(&herr, d_err, 4, cudaMemcpyDeviceToHost));
    if (herr)
        printf("  (device error flag %d)\n", herr);
    void *fr[] = {pool, src, d_indptr, d_idx, d_last, d_aip, d_bi, d_pos, d_err};
    for (unsigned i = 0; i < sizeof(fr) / sizeof(fr[0]); i++)
        CK(cudaFree(fr[i]));
    free(h_indptr), free(h_idx), free(h_last), free(h_aip), free(h_bi), free(h_pos);
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median host time of `way` queued alone (sync 0) or queued and synchronised (sync 1). */
typedef void (*way_fn)(void *);
static double host_us(way_fn way, void *arg, int sync)
{
    enum { N = 2000 };
    static double t[N];
    for (int i = -100; i < N; i++) {
        double t0 = now_us();
        way(arg);
        if (sync)
            CK(cudaStreamSynchronize(S));
        double t1 = now_us();
        if (!sync)
            CK(cudaStreamSynchronize(S));
        if (i >= 0)
            t[i] = t1 - t0;
    }
    qsort(t, N, sizeof(double), cmp_d);
    return t[N / 2];
}

typedef struct {
    kvp_paged_kv_t kv;
    kvp_append_src_t src;
    int32_t *slots, *plan_host, *plan_dev, *err_dev;
    size_t plan_bytes;
    uint32_t nnz;
} host_arg_t;

static void way_slots(void *p)
{
    host_arg_t *a = p;
    if (kvp_append_slots_cuda(&a->kv, &a->src, a->slots, a->nnz, 1, 0, 0, S))
        exit(1);
}

static void way_upload(void *p)
{
    host_arg_t *a = p;
    const uint32_t B = a->nnz;
    CK(cudaMemcpyAsync(a->plan_dev, a->plan_host, a->plan_bytes, cudaMemcpyHostToDevice, S));
    kvp_paged_kv_t kv = a->kv;
    kv.batch_size = B;
    kv.kv_indptr = a->plan_dev;
    kv.kv_indices = a->plan_dev + B + 1;
    kv.kv_last_page_len = a->plan_dev + 2 * B + 1;
    if (kvp_append_paged_kv_cache_cuda_unchecked_opts(&kv, &a->src, a->plan_dev + 3 * B + 1,
                                                      a->plan_dev + 4 * B + 1, B, a->err_dev, &OPTS,
                                                      S))
        exit(1);
    CK(cudaMemcpyAsync(a->plan_host + 5 * B + 1, a->err_dev, 4, cudaMemcpyDeviceToHost, S));
}

static void way_empty(void *p)
{
    host_arg_t *a = p;
    if (kvp_get_seq_lens_cuda(a->plan_dev, a->plan_dev + 1, 1, 16, a->err_dev, S))
        exit(1);
}

/* The decode step of the daemon's Append: 256 sequences with one token each, one page per
 * sequence (page i, slot 3), H 8, D 128, fp16. */
static void run_host(void)
{
    const uint32_t B = 256, H = 8, D = 128, ps = 16, P = 8192;
    kvp_geom_t g = {.num_layers = 1,
                    .num_pages = P,
                    .page_size = ps,
                    .num_kv_heads = H,
                    .head_dim = D,
                    .dtype = KVP_DTYPE_FP16,
                    .layout = KVP_LAYOUT_NHD,
                    .storage = KVP_STORAGE_COMBINED,
                    .num_devices = 1};
    kvp_geom_derived_t d;
    if (kvp_geom_derive(&g, &d))
        exit(1);
    host_arg_t a = {.nnz = B};
    uint8_t *pool, *src;
    CK(cudaMalloc((void **)&pool, d.pool_bytes));
    CK(cudaMalloc((void **)&src, 2ull * B * H * D * 2));
    CK(cudaMemset(src, 0x3c, 2ull * B * H * D * 2));
    a.kv = (kvp_paged_kv_t){.k_data = pool,
                            .v_data = pool + d.v_offset_bytes,
                            .elem_bytes = 2,
                            .num_pages = P,
                            .page_size = ps,
                            .num_heads = H,
                            .head_dim = D,
                            .stride_page = d.stride_page,
                            .stride_n = d.stride_n,
                            .stride_h = d.stride_h};
    a.src = (kvp_append_src_t){.key = src,
                               .value = src + (size_t)B * H * D * 2,
                               .k_stride_n = H * D,
                               .k_stride_h = D,
                               .v_stride_n = H * D,
                               .v_stride_h = D};
    /* plan words as the upload path lays them out: indptr, indices, last, bidx, pos, err */
    a.plan_bytes = (5 * (size_t)B + 1) * 4;
    CK(cudaHostAlloc((void **)&a.plan_host, a.plan_bytes + 4, cudaHostAllocDefault));
    CK(cudaMalloc((void **)&a.plan_dev, a.plan_bytes + 4));
    CK(cudaMalloc((void **)&a.err_dev, 64));
    CK(cudaMemset(a.err_dev, 0, 64));
    a.slots = malloc(B * sizeof(int32_t));
    int32_t *w = a.plan_host;
    for (uint32_t b = 0; b <= B; b++)
        w[b] = (int32_t)b;
    for (uint32_t b = 0; b < B; b++) {
        w[B + 1 + b] = (int32_t)b;          /* page b */
        w[2 * B + 1 + b] = 4;               /* four tokens: the new one at position 3 */
        w[3 * B + 1 + b] = (int32_t)b;      /* batch index */
        w[4 * B + 1 + b] = 3;               /* position */
        a.slots[b] = (int32_t)(b * ps + 3); /* the same slot */
    }
    CK(cudaMemcpy(a.plan_dev, a.plan_host, a.plan_bytes, cudaMemcpyHostToDevice));
    printf("host side of a decode step's daemon Append (256 x 1, H 8, D 128, one layer), "
           "median of 2000:\n");
    printf("  %-44s %9s %16s\n", "way", "queue us", "queue + sync us");
    struct {
        const char *name;
        way_fn fn;
    } ways[] = {{"slot kernel, slots in the launch", way_slots},
                {"upload + page-table kernel + error read-back", way_upload},
                {"empty launch (one-thread kernel)", way_empty}};
    for (unsigned i = 0; i < sizeof(ways) / sizeof(ways[0]); i++)
        printf("  %-44s %9.2f %16.2f\n", ways[i].name, host_us(ways[i].fn, &a, 0),
               host_us(ways[i].fn, &a, 1));
    CK(cudaFree(pool));
    CK(cudaFree(src));
    CK(cudaFree(a.plan_dev));
    CK(cudaFree(a.err_dev));
    CK(cudaFreeHost(a.plan_host));
    free(a.slots);
}

/* The index of name in names[0..n), or exits with a usage message. */
static uint32_t pick(const char *flag, const char *name, const char *const *names, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (!strcmp(name, names[i]))
            return i;
    fprintf(stderr, "%s: '%s' is not one of", flag, name);
    for (uint32_t i = 0; i < n; i++)
        fprintf(stderr, " %s", names[i]);
    fprintf(stderr, "\n");
    exit(2);
}

/* A number for flag in 0..max, or exits with a usage message. */
static uint32_t number(const char *flag, const char *text, uint32_t max)
{
    uint64_t v;
    if (kvp_knob_parse_u64(text, 0, max, &v)) {
        fprintf(stderr, "%s: '%s' is not a number in 0..%u\n", flag, text, max);
        exit(2);
    }
    return (uint32_t)v;
}

int main(int argc, char **argv)
{
    static const char *const kernels[] = {"auto", "warp", "block"};
    static const char *const hints[] = {"none", "ld", "st", "ldst"};
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            REPS = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            ONLY = argv[++i];
        else if (!strcmp(argv[i], "--host"))
            HOST = 1;
        else if (!strcmp(argv[i], "--kernel") && i + 1 < argc)
            OPTS.kernel = pick(argv[i], argv[i + 1], kernels, 3), i++;
        else if (!strcmp(argv[i], "--tokens-per-block") && i + 1 < argc)
            OPTS.tokens_per_block = number(argv[i], argv[i + 1], KVP_APPEND_CUDA_MAX_TPB), i++;
        else if (!strcmp(argv[i], "--blocks-per-sm") && i + 1 < argc)
            OPTS.blocks_per_sm = number(argv[i], argv[i + 1], KVP_APPEND_CUDA_MAX_BPSM), i++;
        else if (!strcmp(argv[i], "--warps-per-block") && i + 1 < argc)
            OPTS.warps_per_block = number(argv[i], argv[i + 1], KVP_APPEND_CUDA_MAX_WARPS), i++;
        else if (!strcmp(argv[i], "--hints") && i + 1 < argc)
            OPTS.hints = pick(argv[i], argv[i + 1], hints, 4), i++;
        else {
            fprintf(stderr, "unknown argument '%s' (see the file header)\n", argv[i]);
            return 2;
        }
    printf("copy kernels: kernel=%s tokens_per_block=%u blocks_per_sm=%u warps_per_block=%u "
           "hints=%s (0: automatic)\n",
           kernels[OPTS.kernel], OPTS.tokens_per_block, OPTS.blocks_per_sm, OPTS.warps_per_block,
           hints[OPTS.hints]);
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no usable GPU: skipped\n");
        return 77;
    }
    CK(cudaStreamCreateWithFlags(&S, cudaStreamNonBlocking));
    if (kvp_cuda_kernels_preload() || kvp_bench_kernels_preload()) {
        fprintf(stderr, "preload failed\n");
        return 1;
    }
    if (HOST) {
        run_host();
        return 0;
    }
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    /* the ceiling: 2 GiB device-to-device copy, bytes read + written */
    copy_arg_t c = {.bytes = (size_t)2 << 30};
    CK(cudaMalloc(&c.src, c.bytes));
    CK(cudaMalloc(&c.dst, c.bytes));
    CK(cudaMemset(c.src, 1, c.bytes));
    float ms = time_ms(do_copy, &c, 20);
    CEIL_GBS = 2.0 * (double)c.bytes / (ms * 1e-3) / 1e9;
    CK(cudaFree(c.src));
    CK(cudaFree(c.dst));
    printf("device: %s, %d SMs; d2d copy ceiling %.0f GB/s (2 GiB cudaMemcpyAsync, read + "
           "write, median of 20)\n\n",
           prop.name, prop.multiProcessorCount, CEIL_GBS);
    /* the floor of a graph node: 100 one-thread kernels (get_seq_lens of one request) */
    {
        int32_t *z;
        CK(cudaMalloc((void **)&z, 64));
        CK(cudaMemset(z, 0, 64));
        cudaGraph_t graph;
        graph_arg_t ga;
        CK(cudaStreamBeginCapture(S, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < 100; i++)
            if (kvp_get_seq_lens_cuda(z, z + 4, 1, 16, z + 8, S))
                exit(1);
        CK(cudaStreamEndCapture(S, &graph));
        CK(cudaGraphInstantiate(&ga.exec, graph, 0));
        printf("graph replay floor: %.2f us per launch of a one-thread kernel\n",
               time_ms(do_graph, &ga, REPS) / 100.0f * 1e3);
        CK(cudaGraphExecDestroy(ga.exec));
        CK(cudaGraphDestroy(graph));
        CK(cudaStreamBeginCapture(S, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < 100; i++)
            if (kvp_bench_empty_pdl_cuda(S))
                exit(1);
        CK(cudaStreamEndCapture(S, &graph));
        CK(cudaGraphInstantiate(&ga.exec, graph, 0));
        printf("graph replay floor under PDL: %.2f us per launch of a one-thread kernel that "
               "waits for its predecessor\n\n",
               time_ms(do_graph, &ga, REPS) / 100.0f * 1e3);
        CK(cudaGraphExecDestroy(ga.exec));
        CK(cudaGraphDestroy(graph));
        CK(cudaFree(z));
    }
    printf("%-28s %-4s %9s %10s %9s %8s   %s\n", "workload", "lay", "tokens", "us", "GB/s",
           "ceiling", "form");
    static const workload_t ws[] = {
        {"decode 256x1 H8 D128", 256, 1, 8, 128, 16, 100},
        {"decode 1024x1 H8 D128", 1024, 1, 8, 128, 16, 100},
        {"decode 256x1 H32 D128", 256, 1, 32, 128, 16, 100},
        {"prefill 16x1024 H8 D128", 16, 1024, 8, 128, 16, 0},
        {"prefill 4x8192 H32 D128", 4, 8192, 32, 128, 16, 0},
        {"prefill 8x4096 H8 D128 p64", 8, 4096, 8, 128, 64, 0},
        {"prefill 64x256 H8 D64", 64, 256, 8, 64, 16, 0},
    };
    for (unsigned i = 0; i < sizeof(ws) / sizeof(ws[0]); i++)
        for (int lay = 0; lay < 2 && (!ONLY || strstr(ws[i].name, ONLY)); lay++)
            run_workload(&ws[i], (kvp_layout_t)lay);
    return 0;
}
