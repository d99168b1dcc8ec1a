/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bench_append_cuda.c - the CUDA append kernels against the device-to-device copy ceiling
 * measured in the same run (METHOD.md: a large cudaMemcpyAsync counting bytes read + written)
 * and against FlashInfer's own AppendPagedKVCache (issue #18), side by side in one run. For
 * each workload and layout: FlashInfer's append (when built with its headers:
 * -DKVP_BENCH_FLASHINFER=ON or -DKVP_FLASHINFER_WHEEL=PATH, tests/bench/kvp_flashinfer.cmake), the
 * fused append (positions computed in the launch), the checked append (every token validated
 * before any write), the unchecked one (FlashInfer's inputs: the same batch_indices/positions)
 * and the slots form (each token's pool slot planned once per step by
 * kvp_append_plan_slots_cuda, like FlashInfer's batch_indices/positions, and checked against
 * the host's), each as a
 * single launch and replayed from a CUDA graph (us per launch; the fused form also under
 * programmatic dependent launch): 100 launches rotating over 8 layers of the pool for decode
 * steps, 10 alternating between 2 source sets for prefills. Page tables, batch indices and
 * positions are computed once on the host and uploaded from pinned memory on the bench's own
 * stream before anything is timed. Before timing, every row checks the bytes: FlashInfer's
 * append (kvpool's checked one without FlashInfer) into one pool, each kvpool form into another
 * filled with the same pattern, compared word for word (and the reference must have changed
 * exactly the appended rows). After the forms, each row's bounds, in the same graph shape: a
 * plain contiguous copy of the same K and V bytes (16-byte vectors, the append's grid rule;
 * also under PDL), cudaMemcpyAsync of them, and the scatter copy of the same rows to the same
 * slots with each destination computed from the token index (no page-table load; its bytes
 * checked against the reference like a form's): the launch, the copy and the paged scatter
 * that any append of those rows pays.
 * Times are medians of --reps event-timed runs after warm-up; bytes
 * = K and V rows read once and written once. fp16, page 16 unless the workload says otherwise.
 * Prints one line per form, then a summary (kvpool / FlashInfer per row); exits 1 when a byte
 * check fails, 77 without a GPU. The copy kernels' shape (kvp_append_cuda_opts_t) comes from
 * the flags below (default: automatic, what the daemon and libkvpool run): run the binary once
 * per setting in one device call to compare.
 *
 * --host: instead, the host side of the daemon's two ways to run a decode step's Append
 * (256 x 1, H 8, D 128, one layer): the slot kernel with its slots in the launch, against the
 * plan upload + kernel + error read-back, and an empty launch as the floor; per way the host
 * time of queueing it and of queueing it and synchronising (medians of 2,000, wall clock).
 *
 *   bench_append_cuda [--reps N] [--only SUBSTRING] [--host] [--kernel auto|warp|block|flat]
 *                     [--tokens-per-block N] [--blocks-per-sm N] [--warps-per-block N]
 *                     [--hints none|ld|st|ldst] [--vecs-per-thread N]
 *                     [--checked auto|one|block]
 * (the kernel flags are the daemon's [tuning] append_* keys, kvp_config.h)
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvp_bench_flashinfer.h"
#include "kvp_bench_kernels.h"
#include "kvp_cuda_err.h"
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

#define KC(call)                                                                                   \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ != 0) {                                                                            \
            fprintf(stderr, "%s:%d %s: %s %s\n", __FILE__, __LINE__, #call, kvp_strerror(rc_),     \
                    kvp_cuda_last_error());                                                        \
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

/* The forms of the append a workload times: kvpool's three and FlashInfer's. */
enum { FORM_FUSED, FORM_CHECKED, FORM_UNCHECKED, FORM_SLOTS, FORM_FLASHINFER, NUM_FORMS };
static const char *const FORM_NAME[NUM_FORMS] = {
    "fused", "checked", "unchecked (the same batch_indices/positions)",
    "slots (planned once per step)", "FlashInfer AppendPagedKVCache"};

typedef struct {
    kvp_paged_kv_t kv;
    kvp_append_src_t src;
    int32_t *aip, *bi, *pos, *slots, *err;
    uint32_t nnz;
    int form;       /* FORM_* */
    unsigned flags; /* KVP_CUDA_APPEND_* of the fused and slots forms */
} app_arg_t;

static void do_append(void *p)
{
    app_arg_t *a = p;
    int rc;
    switch (a->form) {
    case FORM_FUSED:
        rc = kvp_append_paged_kv_cache_fused_cuda_opts(&a->kv, &a->src, a->aip, a->nnz, a->err,
                                                       a->flags, &OPTS, S);
        break;
    case FORM_CHECKED:
        rc = kvp_append_paged_kv_cache_cuda_opts(&a->kv, &a->src, a->bi, a->pos, a->nnz, a->err,
                                                 &OPTS, S);
        break;
    case FORM_UNCHECKED:
        rc = kvp_append_paged_kv_cache_cuda_unchecked_opts(&a->kv, &a->src, a->bi, a->pos, a->nnz,
                                                           a->err, &OPTS, S);
        break;
    case FORM_SLOTS:
        rc = kvp_append_paged_kv_cache_slots_cuda(&a->kv, &a->src, a->slots, a->nnz, a->err,
                                                  a->flags, &OPTS, S);
        break;
    default:
        rc = kvp_bench_flashinfer_append_cuda(&a->kv, &a->src, a->bi, a->pos, a->nnz, S);
        break;
    }
    if (rc) {
        fprintf(stderr, "append (%s) failed: %s %s\n", FORM_NAME[a->form], kvp_strerror(rc),
                kvp_cuda_last_error());
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
static int HAVE_FI;  /* FlashInfer's append compiled in (kvp_bench_flashinfer_available) */
static int MISMATCH; /* a byte check failed: the exit status is 1 */

/* One row of the summary: us per launch, single launch and graph replay, per form (0: not
 * run); PDL is the fused form's graph under programmatic dependent launch. */
typedef struct {
    const char *name;
    const char *lay;
    float single[NUM_FORMS], graph[NUM_FORMS], graph_pdl, slots_pdl;
    float copy, copy_pdl;       /* bound: a plain contiguous copy of the same bytes, graph */
    float scatter, scatter_pdl; /* bound: the same rows to the same slots without lookups */
} summary_t;
static summary_t SUM[32];
static unsigned NSUM;

/* a0 moved to launch i's layer (i % nl, layer_bytes apart) and source set (i % ns,
 * src_set_bytes apart): so a graph's rows measure the steady state of back-to-back launches,
 * not one buffer sitting in L2. */
static app_arg_t arg_at(const app_arg_t *a0, int i, unsigned nl, size_t layer_bytes, unsigned ns,
                        size_t src_set_bytes)
{
    app_arg_t a = *a0;
    a.kv.k_data = (uint8_t *)a.kv.k_data + (i % nl) * layer_bytes;
    a.kv.v_data = (uint8_t *)a.kv.v_data + (i % nl) * layer_bytes;
    a.src.key = (const uint8_t *)a.src.key + (i % ns) * src_set_bytes;
    a.src.value = (const uint8_t *)a.src.value + (i % ns) * src_set_bytes;
    return a;
}

/* Ends the capture begun on S (n launches) and returns the median ms per launch of replaying
 * it. */
static float end_capture_ms(int n)
{
    cudaGraph_t graph;
    graph_arg_t ga;
    CK(cudaStreamEndCapture(S, &graph));
    CK(cudaGraphInstantiate(&ga.exec, graph, 0));
    float ms = time_ms(do_graph, &ga, REPS) / (float)n;
    CK(cudaGraphExecDestroy(ga.exec));
    CK(cudaGraphDestroy(graph));
    return ms;
}

/* Per-launch ms of a graph of n launches of form (arg_at's rotation). */
static float graph_ms(const app_arg_t *a0, int form, unsigned flags, int n, unsigned nl,
                      size_t layer_bytes, unsigned ns, size_t src_set_bytes)
{
    CK(cudaStreamBeginCapture(S, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < n; i++) {
        app_arg_t a = arg_at(a0, i, nl, layer_bytes, ns, src_set_bytes);
        a.form = form;
        a.flags = flags;
        do_append(&a);
    }
    return end_capture_ms(n);
}

/* The bounds of every form on a row, each the same K and V bytes in the same graph shape as
 * graph_ms (launch i on layer i % nl, source set i % ns): a plain contiguous copy
 * (kvp_bench_plain_copy_cuda), cudaMemcpyAsync, and the scatter copy to the appended rows'
 * own slots without any lookup (kvp_bench_scatter_copy_cuda). */
enum { BOUND_PLAIN, BOUND_MEMCPY, BOUND_SCATTER };

static void do_bound(const app_arg_t *a, const workload_t *w, int kind, int pdl, uint8_t *dst,
                     const uint8_t *src, size_t bytes)
{
    if (kind == BOUND_MEMCPY)
        CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, S));
    else if (kind == BOUND_PLAIN)
        KC(kvp_bench_plain_copy_cuda(dst, src, bytes, pdl, S));
    else
        KC(kvp_bench_scatter_copy_cuda(&a->kv, a->src.key, a->src.value, a->nnz, w->tokens,
                                       w->old_len, pdl, S));
}

static float graph_bound_ms(const app_arg_t *a0, const workload_t *w, int kind, int pdl,
                            uint8_t *pool, const uint8_t *src, size_t bytes, int n, unsigned nl,
                            size_t layer_bytes, unsigned ns)
{
    CK(cudaStreamBeginCapture(S, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < n; i++) {
        app_arg_t a = arg_at(a0, i, nl, layer_bytes, ns, bytes);
        do_bound(&a, w, kind, pdl, pool + (i % nl) * layer_bytes, src + (i % ns) * bytes, bytes);
    }
    return end_capture_ms(n);
}

/* "1.37x" (kvpool / FlashInfer) into buf, or "-" without a FlashInfer figure. */
static const char *ratio(char *buf, size_t len, float ms, float fi_ms)
{
    if (fi_ms > 0 && ms > 0)
        snprintf(buf, len, "%.2fx", ms / fi_ms);
    else
        snprintf(buf, len, "-");
    return buf;
}

static void print_row(const workload_t *w, const char *lay, uint32_t nnz, double bytes, float ms,
                      float fi_ms, const char *form, const char *how)
{
    char r[16];
    double gbs = bytes / (ms * 1e-3) / 1e9;
    printf("%-28s %-4s %9u %10.2f %9.0f %7.1f%% %7s   %s%s\n", w->name, lay, nnz, ms * 1e3, gbs,
           100.0 * gbs / CEIL_GBS, ratio(r, sizeof(r), ms, fi_ms), form, how);
}

/* Words of 16 ints, so every array of the table block starts 64-byte aligned. */
static size_t pad16(size_t n)
{
    return (n + 15) / 16 * 16;
}

enum { POOL_SEED = 0x9001, SRC_SEED = 0x5eed };

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
    const char *lay = layout == KVP_LAYOUT_NHD ? "NHD" : "HND";
    /* decode graphs rotate over 8 layers of the pool, prefill graphs over 2 source sets */
    const unsigned nl = w->tokens == 1 ? 8 : 1, ns = w->tokens == 1 ? 1 : 2;
    uint32_t nnz = B * w->tokens;
    size_t row = (size_t)w->dim * 2, src_bytes = (size_t)nnz * w->heads * row;
    uint8_t *pool, *ref, *src;
    CK(cudaMalloc((void **)&pool, d.pool_bytes * nl));
    CK(cudaMalloc((void **)&ref, d.pool_bytes));
    CK(cudaMalloc((void **)&src, 2 * src_bytes * ns));
    /* sources and pool hold a pattern, never zeros (METHOD.md): a row written to the wrong
     * place, or not at all, shows in the byte check below */
    KC(kvp_bench_fill_cuda(src, 2 * src_bytes * ns, SRC_SEED, S));
    KC(kvp_bench_fill_cuda(pool, d.pool_bytes * nl, POOL_SEED, S));

    /* The page table, append_indptr, batch indices and positions, computed once on the host
     * and uploaded once, from pinned memory on the bench's stream, before anything is timed
     * (an engine does this once per step, not once per layer). Error words after them. */
    const size_t o_indptr = 0, o_idx = o_indptr + pad16(B + 1);
    const size_t o_last = o_idx + pad16((size_t)B * pages_per), o_aip = o_last + pad16(B);
    const size_t o_bi = o_aip + pad16(B + 1), o_pos = o_bi + pad16(nnz);
    const size_t o_slots = o_pos + pad16(nnz), o_err = o_slots + pad16(nnz), n_words = o_err + 16;
    int32_t *h, *dv;
    CK(cudaHostAlloc((void **)&h, n_words * 4, cudaHostAllocDefault));
    memset(h, 0, n_words * 4);
    h[o_indptr] = h[o_aip] = 0;
    for (uint32_t b = 0; b < B; b++) {
        h[o_indptr + b + 1] = h[o_indptr + b] + (int32_t)pages_per;
        h[o_aip + b + 1] = h[o_aip + b] + (int32_t)w->tokens;
        h[o_last + b] = (int32_t)(len - (pages_per - 1) * ps);
        for (uint32_t k = 0; k < pages_per; k++) /* interleave requests' pages */
            h[o_idx + (size_t)b * pages_per + k] = (int32_t)(k * B + b);
        for (uint32_t j = 0; j < w->tokens; j++) {
            h[o_bi + (size_t)b * w->tokens + j] = (int32_t)b;
            h[o_pos + (size_t)b * w->tokens + j] = (int32_t)(w->old_len + j);
        }
    }
    CK(cudaMalloc((void **)&dv, n_words * 4));
    CK(cudaMemcpyAsync(dv, h, n_words * 4, cudaMemcpyHostToDevice, S));
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
                          .kv_indptr = dv + o_indptr,
                          .kv_indices = dv + o_idx,
                          .kv_last_page_len = dv + o_last},
                   .src = {.key = src,
                           .value = src + src_bytes,
                           .k_stride_n = (int64_t)w->heads * w->dim,
                           .k_stride_h = w->dim,
                           .v_stride_n = (int64_t)w->heads * w->dim,
                           .v_stride_h = w->dim},
                   .aip = dv + o_aip,
                   .bi = dv + o_bi,
                   .pos = dv + o_pos,
                   .slots = dv + o_slots,
                   .err = dv + o_err,
                   .nnz = nnz};
    /* the slots form's plan, once per step as an engine runs it (not timed): checked below
     * against the slots the host computes from the same table (error word 8) */
    KC(kvp_append_plan_slots_cuda(&a.kv, a.aip, nnz, a.slots, dv + o_err + 8, S));

    /* Bytes first: the reference (FlashInfer's append; kvpool's checked form when FlashInfer
     * is absent) into ref, which must differ from the untouched pattern in exactly the
     * appended rows' words; then each kvpool form into layer 0 of pool, refilled with the
     * same pattern, which must equal ref word for word. Error word 1 + form per form. */
    unsigned long long *cnt_dev, *cnt_host;
    CK(cudaMalloc((void **)&cnt_dev, 8 * sizeof(*cnt_dev)));
    CK(cudaHostAlloc((void **)&cnt_host, 8 * sizeof(*cnt_host), cudaHostAllocDefault));
    CK(cudaMemsetAsync(cnt_dev, 0, 8 * sizeof(*cnt_dev), S));
    const int ref_form = HAVE_FI ? FORM_FLASHINFER : FORM_CHECKED;
    KC(kvp_bench_fill_cuda(ref, d.pool_bytes, POOL_SEED, S));
    app_arg_t r = a;
    r.form = ref_form;
    r.kv.k_data = ref;
    r.kv.v_data = ref + d.v_offset_bytes;
    r.err = dv + o_err + 1 + ref_form;
    do_append(&r);
    KC(kvp_bench_diff_cuda(ref, NULL, d.pool_bytes, POOL_SEED, &cnt_dev[0], S));
    for (int f = FORM_FUSED; f <= FORM_SLOTS; f++) {
        KC(kvp_bench_fill_cuda(pool, d.pool_bytes, POOL_SEED, S));
        r = a;
        r.form = f;
        r.err = dv + o_err + 1 + f;
        do_append(&r);
        KC(kvp_bench_diff_cuda(pool, ref, d.pool_bytes, 0, &cnt_dev[1 + f], S));
    }
    /* the scatter bound writes the same bytes to the same slots (counter 5) */
    KC(kvp_bench_fill_cuda(pool, d.pool_bytes, POOL_SEED, S));
    KC(kvp_bench_scatter_copy_cuda(&a.kv, a.src.key, a.src.value, nnz, w->tokens, w->old_len, 0,
                                   S));
    KC(kvp_bench_diff_cuda(pool, ref, d.pool_bytes, 0, &cnt_dev[5], S));
    CK(cudaMemcpyAsync(cnt_host, cnt_dev, 8 * sizeof(*cnt_dev), cudaMemcpyDeviceToHost, S));
    CK(cudaMemcpyAsync(h + o_err, dv + o_err, 16 * 4, cudaMemcpyDeviceToHost, S));
    int32_t *slots_back = malloc(4 * (size_t)nnz);
    CK(cudaMemcpyAsync(slots_back, a.slots, 4 * (size_t)nnz, cudaMemcpyDeviceToHost, S));
    CK(cudaStreamSynchronize(S));
    uint32_t slots_bad = h[o_err + 8] != 0;
    for (uint32_t i = 0; i < nnz; i++) {
        int32_t b = h[o_bi + i], p = h[o_pos + i];
        int32_t want = h[o_idx + (size_t)b * pages_per + (uint32_t)p / ps] * (int32_t)ps +
                       (int32_t)((uint32_t)p % ps);
        slots_bad += slots_back[i] != want;
    }
    free(slots_back);
    const unsigned long long rows_words = 2ull * nnz * w->heads * (row / 16);
    int ok = cnt_host[0] == rows_words && slots_bad == 0 && cnt_host[5] == 0;
    for (int f = FORM_FUSED; f <= FORM_SLOTS; f++)
        ok = ok && cnt_host[1 + f] == 0 && h[o_err + 1 + f] == 0;
    printf("%-28s %-4s bytes %s: %s changed %llu 16-byte words (the appended K and V rows: "
           "%llu); fused/checked/unchecked/slots differ from it in %llu/%llu/%llu/%llu (errors "
           "%d/%d/%d/%d); %u planned slots wrong; the scatter bound differs in %llu\n",
           w->name, lay, ok ? "agree" : "DIFFER", HAVE_FI ? "FlashInfer" : "checked (reference)",
           cnt_host[0], rows_words, cnt_host[1], cnt_host[2], cnt_host[3], cnt_host[4],
           h[o_err + 1], h[o_err + 2], h[o_err + 3], h[o_err + 4], slots_bad, cnt_host[5]);
    if (!ok)
        MISMATCH = 1;

    /* Then time: single launches, then graph replays, FlashInfer first (its figure is the
     * ratio's denominator). */
    double bytes = 2.0 * 2.0 * (double)src_bytes; /* K+V, read + write */
    summary_t *sum = NSUM < sizeof(SUM) / sizeof(SUM[0]) ? &SUM[NSUM++] : NULL;
    summary_t local = {.name = w->name, .lay = lay};
    static const int order[NUM_FORMS] = {FORM_FLASHINFER, FORM_FUSED, FORM_CHECKED, FORM_UNCHECKED,
                                         FORM_SLOTS};
    for (int i = 0; i < NUM_FORMS; i++) {
        int f = order[i];
        if (f == FORM_FLASHINFER && !HAVE_FI)
            continue;
        a.form = f;
        local.single[f] = time_ms(do_append, &a, REPS);
        print_row(w, lay, nnz, bytes, local.single[f], local.single[FORM_FLASHINFER], FORM_NAME[f],
                  ", single launch");
    }
    a.form = FORM_FUSED;
    const int n = w->tokens == 1 ? 100 : 10;
    char how[64];
    snprintf(how, sizeof(how), ", graph of %d (%s)", n,
             w->tokens == 1 ? "8 layers" : "2 source sets");
    for (int i = 0; i < NUM_FORMS; i++) {
        int f = order[i];
        if (f == FORM_FLASHINFER && !HAVE_FI)
            continue;
        local.graph[f] = graph_ms(&a, f, 0, n, nl, d.pool_bytes, ns, 2 * src_bytes);
        print_row(w, lay, nnz, bytes, local.graph[f], local.graph[FORM_FLASHINFER], FORM_NAME[f],
                  how);
        if (f == FORM_FUSED || f == FORM_SLOTS) {
            char pdl[80];
            snprintf(pdl, sizeof(pdl), "%s, PDL", how);
            float *t = f == FORM_FUSED ? &local.graph_pdl : &local.slots_pdl;
            *t = graph_ms(&a, f, KVP_CUDA_APPEND_PDL, n, nl, d.pool_bytes, ns, 2 * src_bytes);
            print_row(w, lay, nnz, bytes, *t, local.graph[FORM_FLASHINFER], FORM_NAME[f], pdl);
        }
    }
    /* the bounds, after the forms (they overwrite the pool's rows) */
    static const char *const bound_name[] = {"plain copy of the same bytes (bound)",
                                             "cudaMemcpyAsync of the same bytes (bound)",
                                             "scatter copy to the same slots, no lookup (bound)"};
    float *bound_t[][2] = {
        {&local.copy, &local.copy_pdl}, {NULL, NULL}, {&local.scatter, &local.scatter_pdl}};
    for (int kind = BOUND_PLAIN; kind <= BOUND_SCATTER; kind++)
        for (int pdl = 0; pdl < (kind == BOUND_MEMCPY ? 1 : 2); pdl++) {
            char lbl[80];
            snprintf(lbl, sizeof(lbl), "%s%s", how, pdl ? ", PDL" : "");
            float t =
                graph_bound_ms(&a, w, kind, pdl, pool, src, 2 * src_bytes, n, nl, d.pool_bytes, ns);
            if (bound_t[kind][pdl])
                *bound_t[kind][pdl] = t;
            print_row(w, lay, nnz, bytes, t, local.graph[FORM_FLASHINFER], bound_name[kind], lbl);
        }
    if (sum)
        *sum = local;
    CK(cudaMemcpyAsync(h + o_err, dv + o_err, 4, cudaMemcpyDeviceToHost, S));
    CK(cudaStreamSynchronize(S));
    if (h[o_err])
        printf("  (device error flag %d)\n", h[o_err]);
    void *fr[] = {pool, ref, src, dv, cnt_dev};
    for (unsigned i = 0; i < sizeof(fr) / sizeof(fr[0]); i++)
        CK(cudaFree(fr[i]));
    CK(cudaFreeHost(h));
    CK(cudaFreeHost(cnt_host));
}

/* The table, last: us per launch and kvpool / FlashInfer per form, graph replay and
 * single launch, and the checked form over the unchecked one. */
static void print_summary(void)
{
    char r[10][16], fgs[16], fss[16];
    printf("\nsummary, us per launch (x: kvpool / FlashInfer in this run; ceiling %.0f GB/s; "
           "chk/unc: checked / unchecked)\n",
           CEIL_GBS);
    printf("%-28s %-4s %-6s %9s %16s %16s %16s %16s %16s %16s %7s %16s %16s %16s %16s\n",
           "workload", "lay", "", "FlashInfer", "fused", "fused + PDL", "slots", "slots + PDL",
           "checked", "unchecked", "chk/unc", "copy (bound)", "copy + PDL", "scatter (bound)",
           "scatter + PDL");
    for (unsigned i = 0; i < NSUM; i++) {
        const summary_t *s = &SUM[i];
        const float fg = s->graph[FORM_FLASHINFER], fs = s->single[FORM_FLASHINFER];
        snprintf(fgs, sizeof(fgs), "%.2f", fg * 1e3);
        snprintf(fss, sizeof(fss), "%.2f", fs * 1e3);
        if (!HAVE_FI)
            strcpy(fgs, "-"), strcpy(fss, "-");
        printf("%-28s %-4s %-6s %9s %8.2f %7s %8.2f %7s %8.2f %7s %8.2f %7s %8.2f %7s %8.2f %7s "
               "%6.2fx %8.2f %7s %8.2f %7s %8.2f %7s %8.2f %7s\n",
               s->name, s->lay, "graph", fgs, s->graph[FORM_FUSED] * 1e3,
               ratio(r[0], 16, s->graph[FORM_FUSED], fg), s->graph_pdl * 1e3,
               ratio(r[1], 16, s->graph_pdl, fg), s->graph[FORM_SLOTS] * 1e3,
               ratio(r[4], 16, s->graph[FORM_SLOTS], fg), s->slots_pdl * 1e3,
               ratio(r[5], 16, s->slots_pdl, fg), s->graph[FORM_CHECKED] * 1e3,
               ratio(r[2], 16, s->graph[FORM_CHECKED], fg), s->graph[FORM_UNCHECKED] * 1e3,
               ratio(r[3], 16, s->graph[FORM_UNCHECKED], fg),
               s->graph[FORM_CHECKED] / s->graph[FORM_UNCHECKED], s->copy * 1e3,
               ratio(r[6], 16, s->copy, fg), s->copy_pdl * 1e3, ratio(r[7], 16, s->copy_pdl, fg),
               s->scatter * 1e3, ratio(r[8], 16, s->scatter, fg), s->scatter_pdl * 1e3,
               ratio(r[9], 16, s->scatter_pdl, fg));
        printf("%-28s %-4s %-6s %9s %8.2f %7s %8s %7s %8.2f %7s %8s %7s %8.2f %7s %8.2f %7s "
               "%6.2fx\n",
               s->name, s->lay, "single", fss, s->single[FORM_FUSED] * 1e3,
               ratio(r[0], 16, s->single[FORM_FUSED], fs), "", "", s->single[FORM_SLOTS] * 1e3,
               ratio(r[4], 16, s->single[FORM_SLOTS], fs), "", "", s->single[FORM_CHECKED] * 1e3,
               ratio(r[2], 16, s->single[FORM_CHECKED], fs), s->single[FORM_UNCHECKED] * 1e3,
               ratio(r[3], 16, s->single[FORM_UNCHECKED], fs),
               s->single[FORM_CHECKED] / s->single[FORM_UNCHECKED]);
    }
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

/* The host-slots form of kvp_append_cuda (KVP_APPEND_CUDA_HOST_DEST: the daemon's
 * small-Append path): slots in host memory, num_layers layers in one launch. */
static int host_slots(const kvp_paged_kv_t *kv, const kvp_append_src_t *src, const int32_t *slots,
                      uint32_t nnz, uint32_t num_layers, uint64_t layer_stride_bytes,
                      uint64_t src_layer_stride_bytes, cudaStream_t s)
{
    const kvp_append_dest_t d = {.kind = KVP_APPEND_DEST_SLOTS, .nnz = nnz, .slots = slots};
    const kvp_append_cuda_args_t a = {.flags = KVP_APPEND_CUDA_HOST_DEST,
                                      .num_layers = num_layers,
                                      .layer_stride_bytes = layer_stride_bytes,
                                      .src_layer_stride_bytes = src_layer_stride_bytes};
    return kvp_append_cuda(kv, src, &d, &a, s);
}

static void way_slots(void *p)
{
    host_arg_t *a = p;
    if (host_slots(&a->kv, &a->src, a->slots, a->nnz, 1, 0, 0, S))
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
    KC(kvp_bench_fill_cuda(src, 2ull * B * H * D * 2, SRC_SEED, S));
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
    CK(cudaMemsetAsync(a.err_dev, 0, 64, S));
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
    CK(cudaMemcpyAsync(a.plan_dev, a.plan_host, a.plan_bytes, cudaMemcpyHostToDevice, S));
    CK(cudaStreamSynchronize(S)); /* uploads done before anything is timed */
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
    static const char *const kernels[] = {"auto", "warp", "block", "flat"};
    static const char *const hints[] = {"none", "ld", "st", "ldst"};
    static const char *const checked[] = {"auto", "one", "block"};
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            REPS = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            ONLY = argv[++i];
        else if (!strcmp(argv[i], "--host"))
            HOST = 1;
        else if (!strcmp(argv[i], "--kernel") && i + 1 < argc)
            OPTS.kernel = pick(argv[i], argv[i + 1], kernels, 4), i++;
        else if (!strcmp(argv[i], "--tokens-per-block") && i + 1 < argc)
            OPTS.tokens_per_block = number(argv[i], argv[i + 1], KVP_APPEND_CUDA_MAX_TPB), i++;
        else if (!strcmp(argv[i], "--blocks-per-sm") && i + 1 < argc)
            OPTS.blocks_per_sm = number(argv[i], argv[i + 1], KVP_APPEND_CUDA_MAX_BPSM), i++;
        else if (!strcmp(argv[i], "--warps-per-block") && i + 1 < argc)
            OPTS.warps_per_block = number(argv[i], argv[i + 1], KVP_APPEND_CUDA_MAX_WARPS), i++;
        else if (!strcmp(argv[i], "--hints") && i + 1 < argc)
            OPTS.hints = pick(argv[i], argv[i + 1], hints, 4), i++;
        else if (!strcmp(argv[i], "--checked") && i + 1 < argc)
            OPTS.checked = pick(argv[i], argv[i + 1], checked, 3), i++;
        else if (!strcmp(argv[i], "--vecs-per-thread") && i + 1 < argc)
            OPTS.vecs_per_thread = number(argv[i], argv[i + 1], KVP_APPEND_CUDA_MAX_ITEMS), i++;
        else {
            fprintf(stderr, "unknown argument '%s' (see the file header)\n", argv[i]);
            return 2;
        }
    printf("copy kernels: kernel=%s tokens_per_block=%u blocks_per_sm=%u warps_per_block=%u "
           "vecs_per_thread=%u hints=%s checked=%s (0: automatic)\n",
           kernels[OPTS.kernel], OPTS.tokens_per_block, OPTS.blocks_per_sm, OPTS.warps_per_block,
           OPTS.vecs_per_thread, hints[OPTS.hints], checked[OPTS.checked]);
    HAVE_FI = kvp_bench_flashinfer_available();
    printf("FlashInfer column: %s\n", kvp_bench_flashinfer_what());
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        printf("no usable GPU: skipped\n");
        return 77;
    }
    CK(cudaStreamCreateWithFlags(&S, cudaStreamNonBlocking));
    if (kvp_cuda_kernels_preload() || kvp_bench_kernels_preload() ||
        kvp_bench_flashinfer_preload()) {
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
    KC(kvp_bench_fill_cuda(c.src, c.bytes, SRC_SEED, S));
    CK(cudaStreamSynchronize(S));
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
        CK(cudaMemsetAsync(z, 0, 64, S));
        CK(cudaStreamSynchronize(S));
        CK(cudaStreamBeginCapture(S, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < 100; i++)
            if (kvp_get_seq_lens_cuda(z, z + 4, 1, 16, z + 8, S))
                exit(1);
        printf("graph replay floor: %.2f us per launch of a one-thread kernel\n",
               end_capture_ms(100) * 1e3);
        CK(cudaStreamBeginCapture(S, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < 100; i++)
            if (kvp_bench_empty_pdl_cuda(S))
                exit(1);
        printf("graph replay floor under PDL: %.2f us per launch of a one-thread kernel that "
               "waits for its predecessor\n\n",
               end_capture_ms(100) * 1e3);
        CK(cudaFree(z));
    }
    if (HAVE_FI)
        printf("FlashInfer's AppendPagedKVCache and kvpool's unchecked form get the same "
               "batch_indices/positions,\ncomputed once and uploaded before timing (an engine "
               "computes them once per step, not once per layer),\nso those per-layer times "
               "compare directly; kvpool's fused form computes them inside its own launch, and "
               "its slots form\nreads slots planned once per step in the same way.\n"
               "Before timing, each row checks that FlashInfer's bytes and each kvpool form's "
               "agree (separate pools).\nx FI: kvpool / FlashInfer, single launch against "
               "single launch, graph against graph.\n\n");
    else
        printf("FlashInfer column absent: the byte check takes kvpool's checked form as the "
               "reference.\n\n");
    printf("%-28s %-4s %9s %10s %9s %8s %7s   %s\n", "workload", "lay", "tokens", "us", "GB/s",
           "ceiling", "x FI", "form");
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
    print_summary();
    if (MISMATCH) {
        printf("\nbyte check FAILED on at least one row (see \"bytes DIFFER\" above)\n");
        return 1;
    }
    return 0;
}
