/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_append_cpu.c - the CPU kernels of kvp_kernels.h against FlashInfer's semantics
 * (DESIGN.md §1): the seed example, a wide random grid checked byte for byte against a naive
 * reference that addresses the pool only through kvp_geom_offset, the guards (every rejected
 * call leaves the pool untouched), page copies, and the helpers' error cases.
 * Random tests are reproducible: the seed is printed in every failure message and can be
 * replayed with KVP_TEST_SEED.
 */
#include <check.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_kernels.h"
#include "kvp_test_util.h"

#define DEFAULT_SEED 0x6b7670a11ull

/* Source padding is filled with SENTINEL; payload and poison bytes never take that value, so a
 * SENTINEL byte in the pool means the kernel copied padding. */
#define SENTINEL 0xFFu

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    ck_assert_ptr_nonnull(p);
    return p;
}

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    ck_assert_ptr_nonnull(p);
    return p;
}

/* The poison pattern: period 251, values 1..251 (never SENTINEL), position-dependent so that a
 * row moved to another place inside the pool cannot look like untouched memory. */
static void poison(unsigned char *p, size_t n)
{
    size_t len = n < 251 ? n : 251;
    for (size_t i = 0; i < len; i++)
        p[i] = (unsigned char)(1 + (i * 37) % 251);
    while (len < n) {
        size_t chunk = len <= n - len ? len : n - len;
        memcpy(p + len, p, chunk);
        len += chunk;
    }
}

/* Random payload bytes, never SENTINEL. */
static void fill_payload(kvp_rng_t *rng, unsigned char *p, size_t n)
{
    kvp_rng_fill(rng, p, n);
    for (size_t i = 0; i < n; i++)
        if (p[i] == SENTINEL)
            p[i] = 0x7e;
}

/* Index of the first byte where a and b differ, or n when they are equal. */
static size_t first_diff(const unsigned char *a, const unsigned char *b, size_t n)
{
    if (memcmp(a, b, n) == 0)
        return n;
    size_t i = 0;
    while (a[i] == b[i])
        i++;
    return i;
}

/* The paged_kv_t of layer `layer` of a pool laid out by geometry g. */
static kvp_paged_kv_t kv_for_layer(const kvp_geom_t *g, const kvp_geom_derived_t *d,
                                   unsigned char *pool, uint32_t layer)
{
    kvp_paged_kv_t kv;
    memset(&kv, 0, sizeof(kv));
    kv.k_data = pool + kvp_geom_layer_offset(d, layer);
    kv.v_data = (unsigned char *)kv.k_data + d->v_offset_bytes;
    kv.elem_bytes = d->elem_bytes;
    kv.num_pages = g->num_pages;
    kv.page_size = g->page_size;
    kv.num_heads = d->heads;
    kv.head_dim = g->head_dim;
    kv.stride_page = d->stride_page;
    kv.stride_n = d->stride_n;
    kv.stride_h = d->stride_h;
    return kv;
}

/* ---- a. the seed example of DESIGN.md §1 ---------------------------------------------- */

START_TEST(test_seed_example_matches_flashinfer)
{
    const uint64_t seed = kvp_test_seed(DEFAULT_SEED);
    const uint32_t append_lens[4] = {45, 8, 25, 22};
    const int32_t kv_indptr[5] = {0, 3, 4, 6, 8};
    const int32_t kv_indices[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    const int32_t kv_last_page_len[4] = {13, 8, 9, 6};
    const int32_t append_indptr[5] = {0, 45, 53, 78, 100};
    enum { NNZ = 100, H = 32, D = 128, PS = 16 };

    int32_t seq_lens[4];
    ck_assert_int_eq(kvp_get_seq_lens_cpu(kv_indptr, kv_last_page_len, 4, PS, seq_lens), 0);
    for (int b = 0; b < 4; b++)
        ck_assert_int_eq(seq_lens[b], append_lens[b]);

    int32_t want_bi[NNZ], want_pos[NNZ];
    int t = 0;
    for (int32_t b = 0; b < 4; b++)
        for (int32_t j = 0; j < (int32_t)append_lens[b]; j++, t++) {
            want_bi[t] = b;
            want_pos[t] = j;
        }
    ck_assert_int_eq(t, NNZ);
    int32_t bi[NNZ], pos[NNZ];
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(append_indptr, seq_lens, 4, NNZ, bi, pos),
                     0);
    ck_assert_mem_eq(bi, want_bi, sizeof(bi));
    ck_assert_mem_eq(pos, want_pos, sizeof(pos));

    /* two spare pages (8, 9) that no request owns must stay poisoned */
    kvp_geom_t g = {.num_layers = 1,
                    .num_pages = 10,
                    .page_size = PS,
                    .num_kv_heads = H,
                    .head_dim = D,
                    .dtype = KVP_DTYPE_FP16,
                    .layout = KVP_LAYOUT_NHD,
                    .storage = KVP_STORAGE_COMBINED};
    kvp_geom_derived_t d;
    ck_assert_int_eq(kvp_geom_derive(&g, &d), 0);
    const size_t row = d.row_bytes;
    unsigned char *pool = xmalloc(d.pool_bytes), *fresh = xmalloc(d.pool_bytes);
    unsigned char *written = xcalloc(d.pool_bytes, 1);
    poison(pool, d.pool_bytes);
    memcpy(fresh, pool, d.pool_bytes);
    unsigned char *key = xmalloc(NNZ * H * row), *value = xmalloc(NNZ * H * row);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, seed);
    fill_payload(&rng, key, NNZ * H * row);
    fill_payload(&rng, value, NNZ * H * row);

    kvp_paged_kv_t kv = kv_for_layer(&g, &d, pool, 0);
    kv.batch_size = 4;
    kv.kv_indptr = kv_indptr;
    kv.kv_indices = kv_indices;
    kv.kv_last_page_len = kv_last_page_len;
    kvp_append_src_t src = {key, value, H * D, D, H * D, D};
    ck_assert_int_eq(kvp_append_paged_kv_cache_cpu(&kv, &src, bi, pos, NNZ), 0);

    size_t num_written = 0;
    for (int i = 0; i < NNZ; i++) {
        uint32_t b = (uint32_t)want_bi[i], p = (uint32_t)want_pos[i];
        uint32_t page = (uint32_t)kv_indices[kv_indptr[b] + p / PS], slot = p % PS;
        for (uint32_t h = 0; h < H; h++)
            for (int half = 0; half < 2; half++) {
                uint64_t off = kvp_geom_offset(&d, &g, 0, page, half, slot, h);
                const unsigned char *want = (half ? value : key) + ((size_t)i * H + h) * row;
                if (memcmp(pool + off, want, row) != 0)
                    ck_abort_msg("seed=%#llx token %d (request %u position %u) head %u %s: "
                                 "row not at page %u slot %u",
                                 (unsigned long long)seed, i, b, p, h, half ? "V" : "K", page,
                                 slot);
                memset(written + off, 1, row);
                num_written += row;
            }
    }
    ck_assert_uint_eq(num_written, (size_t)NNZ * H * 2 * row);
    for (size_t i = 0; i < d.pool_bytes; i++)
        if (!written[i] && pool[i] != fresh[i])
            ck_abort_msg("seed=%#llx byte %zu of the pool was not appended to but changed",
                         (unsigned long long)seed, i);
    free(pool);
    free(fresh);
    free(written);
    free(key);
    free(value);
}
END_TEST

/* ---- b. the wide grid against a naive reference --------------------------------------- */

static const uint32_t grid_page_sizes[] = {1, 3, 7, 16, 17};
static const uint32_t grid_batches[] = {1, 2, 7, 23, 91};
/* most tokens a request gets in a prefill round, per batch size: big batches get short
 * prefills so that the grid stays fast */
static const uint32_t grid_prefill_max[] = {40, 40, 24, 10, 4};
static const uint32_t grid_head_dims[] = {64, 128, 256};
static const uint32_t grid_elem_bytes[] = {1, 2, 4};

typedef enum {
    ROUND_DECODE_SOME_IDLE, /* 1 token per request, about a quarter of them 0 */
    ROUND_PREFILL,          /* 1..prefill_max tokens per request */
    ROUND_DECODE,           /* 1 token per request */
} round_kind_t;

/* starts with an idle-heavy decode so that some requests are still empty (no pages) */
static const round_kind_t grid_rounds[] = {ROUND_DECODE_SOME_IDLE, ROUND_PREFILL, ROUND_DECODE,
                                           ROUND_PREFILL, ROUND_DECODE_SOME_IDLE};
#define GRID_ROUNDS (sizeof(grid_rounds) / sizeof(grid_rounds[0]))

/* The test's own copy of the batch: page lists grown from a shuffled free list, and the
 * lengths before the round. Independent of the kernels' helpers. */
typedef struct {
    uint32_t max_pages;  /* page-list capacity per request */
    uint32_t *pages;     /* [batch][max_pages] */
    uint32_t *num_pages; /* [batch] */
    uint32_t *len;       /* [batch] tokens before this round */
    uint32_t *free_list, num_free;
} grid_tables_t;

/* A source buffer [nnz, H, D] holding `dense` (rows packed) with the given strides; the gaps
 * hold SENTINEL. Caller frees. */
static unsigned char *scatter_source(const unsigned char *dense, uint32_t nnz, uint32_t heads,
                                     size_t row, uint32_t elem_bytes, int64_t stride_n,
                                     int64_t stride_h)
{
    size_t size = (size_t)nnz * (size_t)stride_n * elem_bytes;
    unsigned char *buf = xmalloc(size);
    memset(buf, SENTINEL, size);
    for (uint32_t i = 0; i < nnz; i++)
        for (uint32_t h = 0; h < heads; h++)
            memcpy(buf + ((size_t)i * (size_t)stride_n + (size_t)h * (size_t)stride_h) * elem_bytes,
                   dense + ((size_t)i * heads + h) * row, row);
    return buf;
}

/* Runs every round of one grid configuration and compares the whole pool with the reference
 * after each. g->num_pages is ignored (sized here); the kernel writes the last layer. */
static void grid_run(const kvp_geom_t *geom, uint32_t batch, uint32_t prefill_max, bool strided,
                     kvp_rng_t *rng, const char *ctx)
{
    uint32_t max_tokens = 0;
    for (size_t r = 0; r < GRID_ROUNDS; r++)
        max_tokens += grid_rounds[r] == ROUND_PREFILL ? prefill_max : 1;
    grid_tables_t t = {.max_pages = kvp_geom_pages_for(geom->page_size, max_tokens)};
    kvp_geom_t g = *geom;
    g.num_pages = batch * t.max_pages + 3 + batch / 4; /* spare pages stay poisoned */
    kvp_geom_derived_t d;
    ck_assert_msg(kvp_geom_derive(&g, &d) == 0, "%s: geometry rejected", ctx);
    const uint32_t ps = g.page_size, H = d.heads, D = g.head_dim, eb = d.elem_bytes;
    const uint32_t layer = g.num_layers - 1;
    const size_t row = d.row_bytes, pool_bytes = d.pool_bytes;
    const uint32_t max_nnz = batch * prefill_max;

    unsigned char *pool = xmalloc(pool_bytes), *ref = xmalloc(pool_bytes);
    poison(pool, pool_bytes);
    memcpy(ref, pool, pool_bytes);

    t.pages = xmalloc((size_t)batch * t.max_pages * sizeof(uint32_t));
    t.num_pages = xcalloc(batch, sizeof(uint32_t));
    t.len = xcalloc(batch, sizeof(uint32_t));
    t.free_list = xmalloc((size_t)g.num_pages * sizeof(uint32_t));
    for (uint32_t p = 0; p < g.num_pages; p++)
        t.free_list[p] = p;
    for (uint32_t p = g.num_pages - 1; p > 0; p--) { /* Fisher-Yates */
        uint32_t q = kvp_rng_below(rng, p + 1), tmp = t.free_list[p];
        t.free_list[p] = t.free_list[q];
        t.free_list[q] = tmp;
    }
    t.num_free = g.num_pages;

    uint32_t *append_len = xmalloc(batch * sizeof(uint32_t));
    int32_t *kv_indptr = xmalloc((batch + 1) * sizeof(int32_t));
    int32_t *kv_indices = xmalloc((size_t)batch * t.max_pages * sizeof(int32_t));
    int32_t *kv_last = xmalloc(batch * sizeof(int32_t));
    int32_t *append_indptr = xmalloc((batch + 1) * sizeof(int32_t));
    int32_t *seq_lens = xmalloc(batch * sizeof(int32_t));
    int32_t *bi = xmalloc(max_nnz * sizeof(int32_t)), *pos = xmalloc(max_nnz * sizeof(int32_t));
    uint32_t *own_bi = xmalloc(max_nnz * sizeof(uint32_t));
    uint32_t *own_pos = xmalloc(max_nnz * sizeof(uint32_t));
    unsigned char *dense_k = xmalloc((size_t)max_nnz * H * row);
    unsigned char *dense_v = xmalloc((size_t)max_nnz * H * row);

    for (size_t r = 0; r < GRID_ROUNDS; r++) {
        /* this round's tokens, and the page tables grown to hold them (DESIGN.md §1) */
        uint32_t nnz = 0;
        for (uint32_t b = 0; b < batch; b++) {
            uint32_t a = grid_rounds[r] == ROUND_PREFILL  ? 1 + kvp_rng_below(rng, prefill_max)
                         : grid_rounds[r] == ROUND_DECODE ? 1
                                                          : (kvp_rng_below(rng, 4) ? 1 : 0);
            append_len[b] = a;
            for (uint32_t j = 0; j < a; j++, nnz++) {
                own_bi[nnz] = b;
                own_pos[nnz] = t.len[b] + j;
            }
            uint32_t need = kvp_geom_pages_for(ps, t.len[b] + a);
            while (t.num_pages[b] < need) {
                ck_assert_uint_gt(t.num_free, 0);
                t.pages[b * t.max_pages + t.num_pages[b]++] = t.free_list[--t.num_free];
            }
        }
        kv_indptr[0] = 0;
        append_indptr[0] = 0;
        for (uint32_t b = 0; b < batch; b++) {
            for (uint32_t k = 0; k < t.num_pages[b]; k++)
                kv_indices[kv_indptr[b] + (int32_t)k] = (int32_t)t.pages[b * t.max_pages + k];
            kv_indptr[b + 1] = kv_indptr[b] + (int32_t)t.num_pages[b];
            uint32_t new_len = t.len[b] + append_len[b];
            kv_last[b] = t.num_pages[b] ? (int32_t)(new_len - (t.num_pages[b] - 1) * ps) : 0;
            append_indptr[b + 1] = append_indptr[b] + (int32_t)append_len[b];
        }

        /* the helpers must agree with the test's own bookkeeping */
        ck_assert_int_eq(kvp_get_seq_lens_cpu(kv_indptr, kv_last, batch, ps, seq_lens), 0);
        for (uint32_t b = 0; b < batch; b++)
            if (seq_lens[b] != (int32_t)(t.len[b] + append_len[b]))
                ck_abort_msg("%s round %zu: seq_lens[%u] = %d, want %u", ctx, r, b, seq_lens[b],
                             t.len[b] + append_len[b]);
        ck_assert_int_eq(
            kvp_get_batch_indices_positions_cpu(append_indptr, seq_lens, batch, nnz, bi, pos), 0);
        for (uint32_t i = 0; i < nnz; i++)
            if (bi[i] != (int32_t)own_bi[i] || pos[i] != (int32_t)own_pos[i])
                ck_abort_msg("%s round %zu: token %u is (%d, %d), want (%u, %u)", ctx, r, i, bi[i],
                             pos[i], own_bi[i], own_pos[i]);

        /* the source: packed, or scattered with padding between heads and tokens */
        fill_payload(rng, dense_k, (size_t)nnz * H * row);
        fill_payload(rng, dense_v, (size_t)nnz * H * row);
        kvp_append_src_t src = {dense_k, dense_v, (int64_t)H * D, D, (int64_t)H * D, D};
        unsigned char *buf_k = NULL, *buf_v = NULL;
        if (strided) {
            src.k_stride_h = D + 1 + kvp_rng_below(rng, 7);
            src.k_stride_n = (int64_t)H * src.k_stride_h + 1 + kvp_rng_below(rng, 13);
            src.v_stride_h = src.k_stride_h + 1 + kvp_rng_below(rng, 5);
            src.v_stride_n = (int64_t)H * src.v_stride_h + 2 + kvp_rng_below(rng, 11);
            buf_k = scatter_source(dense_k, nnz, H, row, eb, src.k_stride_n, src.k_stride_h);
            buf_v = scatter_source(dense_v, nnz, H, row, eb, src.v_stride_n, src.v_stride_h);
            src.key = buf_k;
            src.value = buf_v;
        }

        kvp_paged_kv_t kv = kv_for_layer(&g, &d, pool, layer);
        kv.batch_size = batch;
        kv.kv_indptr = kv_indptr;
        kv.kv_indices = kv_indices;
        kv.kv_last_page_len = kv_last;
        int rc = kvp_append_paged_kv_cache_cpu(&kv, &src, bi, pos, nnz);
        ck_assert_msg(rc == 0, "%s round %zu: append returned %s", ctx, r, kvp_errname(rc));

        /* the naive reference: token by token, head by head, byte by byte */
        for (uint32_t i = 0; i < nnz; i++) {
            uint32_t b = own_bi[i], p = own_pos[i];
            uint32_t page = t.pages[b * t.max_pages + p / ps], slot = p % ps;
            for (uint32_t h = 0; h < H; h++)
                for (int half = 0; half < 2; half++) {
                    uint64_t off = kvp_geom_offset(&d, &g, layer, page, half, slot, h);
                    const unsigned char *from =
                        (half ? dense_v : dense_k) + ((size_t)i * H + h) * row;
                    for (size_t x = 0; x < row; x++)
                        ref[off + x] = from[x];
                }
        }
        size_t at = first_diff(pool, ref, pool_bytes);
        if (at != pool_bytes)
            ck_abort_msg("%s round %zu (nnz %u): pool differs from the reference at byte %zu "
                         "(layer %llu, byte %llu of it): got %#x, want %#x",
                         ctx, r, nnz, at, (unsigned long long)(at / d.layer_bytes),
                         (unsigned long long)(at % d.layer_bytes), pool[at], ref[at]);
        if (strided && memchr(pool, SENTINEL, pool_bytes))
            ck_abort_msg("%s round %zu: source padding was copied into the pool", ctx, r);

        for (uint32_t b = 0; b < batch; b++)
            t.len[b] += append_len[b];
        free(buf_k);
        free(buf_v);
    }

    free(dense_v);
    free(dense_k);
    free(own_pos);
    free(own_bi);
    free(pos);
    free(bi);
    free(seq_lens);
    free(append_indptr);
    free(kv_last);
    free(kv_indices);
    free(kv_indptr);
    free(append_len);
    free(t.free_list);
    free(t.len);
    free(t.num_pages);
    free(t.pages);
    free(ref);
    free(pool);
}

static kvp_dtype_t dtype_of_size(uint32_t elem_bytes, bool alt)
{
    switch (elem_bytes) {
    case 1:
        return alt ? KVP_DTYPE_FP8_E5M2 : KVP_DTYPE_FP8_E4M3;
    case 2:
        return alt ? KVP_DTYPE_BF16 : KVP_DTYPE_FP16;
    default:
        return KVP_DTYPE_FP32;
    }
}

/* One loop iteration per page size; inside, every batch size x layout x head_dim x element
 * size x storage x source kind. Heads (2..4), the dtype among those of one size and the layer
 * count (1, or 2 with layer 0 left untouched) vary with a hash of the configuration. */
START_TEST(test_grid_matches_naive_reference)
{
    const uint64_t seed = kvp_test_seed(DEFAULT_SEED);
    const uint32_t ps = grid_page_sizes[_i];
    uint32_t index = (uint32_t)_i * 1000u;
    for (size_t bx = 0; bx < sizeof(grid_batches) / sizeof(grid_batches[0]); bx++)
        for (int layout = KVP_LAYOUT_NHD; layout <= KVP_LAYOUT_HND; layout++)
            for (size_t dx = 0; dx < sizeof(grid_head_dims) / sizeof(grid_head_dims[0]); dx++)
                for (size_t ex = 0; ex < sizeof(grid_elem_bytes) / sizeof(grid_elem_bytes[0]); ex++)
                    for (int storage = KVP_STORAGE_COMBINED; storage <= KVP_STORAGE_SPLIT;
                         storage++)
                        for (int strided = 0; strided < 2; strided++, index++) {
                            uint32_t mix = index * 0x9e3779b1u;
                            kvp_geom_t g = {
                                .num_layers = 1 + ((mix >> 13) & 1),
                                .num_pages = 1, /* sized by grid_run */
                                .page_size = ps,
                                .num_kv_heads = 2 + (mix >> 17) % 3,
                                .head_dim = grid_head_dims[dx],
                                .dtype = dtype_of_size(grid_elem_bytes[ex], (mix >> 7) & 1),
                                .layout = (kvp_layout_t)layout,
                                .storage = (kvp_storage_t)storage,
                            };
                            char ctx[256];
                            snprintf(ctx, sizeof(ctx),
                                     "seed=%#llx (replay with KVP_TEST_SEED) page_size=%u "
                                     "batch=%u layout=%s storage=%s head_dim=%u dtype=%s "
                                     "heads=%u layers=%u source=%s",
                                     (unsigned long long)seed, ps, grid_batches[bx],
                                     kvp_layout_name(g.layout), kvp_storage_name(g.storage),
                                     g.head_dim, kvp_dtype_name(g.dtype), g.num_kv_heads,
                                     g.num_layers, strided ? "strided" : "contiguous");
                            kvp_rng_t rng;
                            kvp_rng_seed(&rng, seed ^ ((uint64_t)index << 32));
                            grid_run(&g, grid_batches[bx], grid_prefill_max[bx], strided, &rng,
                                     ctx);
                        }
}
END_TEST

/* ---- c. guards ------------------------------------------------------------------------ */

/* A small valid batch: page_size 4, 2 heads of 8 fp16, combined NHD, 64 pages.
 * Request 0: 60 tokens in 15 scattered pages, all appended now (tokens 0..59);
 * request 1: empty (no pages, last_page_len 0);
 * request 2: 7 tokens in pages 0 and 63, its last 3 appended now (tokens 60..62). */
enum { G_PS = 4, G_PAGES = 64, G_H = 2, G_D = 8, G_BATCH = 3, G_NNZ = 63, G_NUM_INDICES = 17 };

typedef struct {
    kvp_geom_t g;
    kvp_geom_derived_t d;
    unsigned char *pool, *before;
    int32_t indptr[G_BATCH + 1], indices[G_NUM_INDICES], last[G_BATCH];
    unsigned char *key, *value; /* packed [G_NNZ, G_H, G_D] */
    int32_t bi[G_NNZ], pos[G_NNZ];
    kvp_paged_kv_t kv;
    kvp_append_src_t src;
    /* what the call receives; a case may point any of them elsewhere */
    const kvp_paged_kv_t *kv_arg;
    const kvp_append_src_t *src_arg;
    const int32_t *bi_arg, *pos_arg;
    uint32_t nnz;
} guard_env_t;

static void guard_env_init(guard_env_t *e)
{
    memset(e, 0, sizeof(*e));
    e->g = (kvp_geom_t){.num_layers = 1,
                        .num_pages = G_PAGES,
                        .page_size = G_PS,
                        .num_kv_heads = G_H,
                        .head_dim = G_D,
                        .dtype = KVP_DTYPE_FP16,
                        .layout = KVP_LAYOUT_NHD,
                        .storage = KVP_STORAGE_COMBINED};
    ck_assert_int_eq(kvp_geom_derive(&e->g, &e->d), 0);
    e->pool = xmalloc(e->d.pool_bytes);
    e->before = xmalloc(e->d.pool_bytes);
    poison(e->pool, e->d.pool_bytes);
    memcpy(e->before, e->pool, e->d.pool_bytes);

    for (int k = 0; k < 15; k++)
        e->indices[k] = (k * 7 + 3) % G_PAGES;
    e->indices[15] = 0;
    e->indices[16] = G_PAGES - 1;
    const int32_t indptr[G_BATCH + 1] = {0, 15, 15, 17}, last[G_BATCH] = {4, 0, 3};
    memcpy(e->indptr, indptr, sizeof(indptr));
    memcpy(e->last, last, sizeof(last));
    for (int i = 0; i < 60; i++) {
        e->bi[i] = 0;
        e->pos[i] = i;
    }
    for (int i = 60; i < G_NNZ; i++) {
        e->bi[i] = 2;
        e->pos[i] = 4 + (i - 60);
    }

    size_t bytes = (size_t)G_NNZ * G_H * e->d.row_bytes;
    e->key = xmalloc(bytes);
    e->value = xmalloc(bytes);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(DEFAULT_SEED));
    fill_payload(&rng, e->key, bytes);
    fill_payload(&rng, e->value, bytes);

    e->kv = kv_for_layer(&e->g, &e->d, e->pool, 0);
    e->kv.batch_size = G_BATCH;
    e->kv.kv_indptr = e->indptr;
    e->kv.kv_indices = e->indices;
    e->kv.kv_last_page_len = e->last;
    e->src = (kvp_append_src_t){e->key, e->value, G_H * G_D, G_D, G_H * G_D, G_D};
    e->kv_arg = &e->kv;
    e->src_arg = &e->src;
    e->bi_arg = e->bi;
    e->pos_arg = e->pos;
    e->nnz = G_NNZ;
}

static void guard_env_free(guard_env_t *e)
{
    free(e->pool);
    free(e->before);
    free(e->key);
    free(e->value);
}

static int guard_env_append(const guard_env_t *e)
{
    return kvp_append_paged_kv_cache_cpu(e->kv_arg, e->src_arg, e->bi_arg, e->pos_arg, e->nnz);
}

/* The pool the env's call must produce: `before` with every non-padding token's rows placed
 * through the env's page table and kvp_geom_offset. Caller frees. */
static unsigned char *guard_env_expected(const guard_env_t *e)
{
    unsigned char *want = xmalloc(e->d.pool_bytes);
    memcpy(want, e->before, e->d.pool_bytes);
    const size_t row = e->d.row_bytes;
    for (uint32_t i = 0; i < e->nnz; i++) {
        if (e->bi[i] < 0)
            continue;
        uint32_t b = (uint32_t)e->bi[i], p = (uint32_t)e->pos[i];
        uint32_t page = (uint32_t)e->indices[e->indptr[b] + (int32_t)(p / G_PS)];
        for (uint32_t h = 0; h < G_H; h++)
            for (int half = 0; half < 2; half++)
                memcpy(want + kvp_geom_offset(&e->d, &e->g, 0, page, half, p % G_PS, h),
                       (half ? e->value : e->key) + ((size_t)i * G_H + h) * row, row);
    }
    return want;
}

START_TEST(test_guard_baseline_batch_lands)
{
    guard_env_t e;
    guard_env_init(&e);
    ck_assert_int_eq(kvp_paged_kv_check(&e.kv), 0);
    ck_assert_int_eq(guard_env_append(&e), 0);
    unsigned char *want = guard_env_expected(&e);
    ck_assert_msg(memcmp(e.pool, want, e.d.pool_bytes) == 0, "pool differs from expected");
    ck_assert_msg(memcmp(e.pool, e.before, e.d.pool_bytes) != 0, "nothing was written");
    free(want);
    guard_env_free(&e);
}
END_TEST

START_TEST(test_guard_nnz_zero_is_noop)
{
    guard_env_t e;
    guard_env_init(&e);
    e.nnz = 0;
    e.bi_arg = NULL;
    e.pos_arg = NULL;
    ck_assert_int_eq(guard_env_append(&e), 0);
    e.kv_arg = NULL;
    e.src_arg = NULL;
    ck_assert_int_eq(guard_env_append(&e), 0);
    e.kv_arg = &e.kv;
    e.kv.elem_bytes = 3; /* not even looked at */
    ck_assert_int_eq(guard_env_append(&e), 0);
    ck_assert_msg(memcmp(e.pool, e.before, e.d.pool_bytes) == 0, "pool changed");
    guard_env_free(&e);
}
END_TEST

START_TEST(test_guard_padding_is_skipped)
{
    guard_env_t e;
    guard_env_init(&e);
    /* padding entries with positions that would be invalid for any request */
    e.bi[0] = -1;
    e.pos[0] = 0;
    e.bi[10] = -1;
    e.pos[10] = 12345;
    e.bi[61] = -7;
    e.pos[61] = -3;
    e.bi[62] = INT32_MIN;
    e.pos[62] = INT32_MAX;
    ck_assert_int_eq(guard_env_append(&e), 0);
    unsigned char *want = guard_env_expected(&e); /* skips the padding entries */
    ck_assert_msg(memcmp(e.pool, want, e.d.pool_bytes) == 0, "pool differs from expected");
    /* the padded tokens' own slots (request 0 positions 0 and 10) kept their poison */
    for (int half = 0; half < 2; half++) {
        uint64_t off =
            kvp_geom_offset(&e.d, &e.g, 0, (uint32_t)e.indices[10 / G_PS], half, 10 % G_PS, 0);
        ck_assert_mem_eq(e.pool + off, e.before + off, e.d.row_bytes);
        off = kvp_geom_offset(&e.d, &e.g, 0, (uint32_t)e.indices[0], half, 0, 1);
        ck_assert_mem_eq(e.pool + off, e.before + off, e.d.row_bytes);
    }
    free(want);

    /* a batch of no requests whose tokens are all padding */
    memcpy(e.before, e.pool, e.d.pool_bytes);
    for (int i = 0; i < G_NNZ; i++)
        e.bi[i] = -1;
    e.kv.batch_size = 0;
    ck_assert_int_eq(guard_env_append(&e), 0);
    ck_assert_msg(memcmp(e.pool, e.before, e.d.pool_bytes) == 0, "all-padding batch wrote");
    guard_env_free(&e);
}
END_TEST

/* want: what the append returns; check_want: what kvp_paged_kv_check says of the same kv, so
 * that a case proves which check caught it (0: the table is fine, the source or a token is
 * bad). */
typedef struct {
    const char *name;
    int want, check_want;
    void (*mutate)(guard_env_t *e);
} guard_case_t;

static void pos_eq_seq_len(guard_env_t *e)
{
    e->pos[0] = 60;
}
static void pos_negative(guard_env_t *e)
{
    e->pos[1] = -1;
}
static void pos_int_min(guard_env_t *e)
{
    e->pos[1] = INT32_MIN;
}
static void pos_in_empty_request(guard_env_t *e)
{
    e->bi[5] = 1;
    e->pos[5] = 0;
}
static void bi_eq_batch_size(guard_env_t *e)
{
    e->bi[2] = G_BATCH;
}
static void bi_int_max(guard_env_t *e)
{
    e->bi[2] = INT32_MAX;
}
static void page_eq_num_pages(guard_env_t *e)
{
    e->indices[4] = G_PAGES;
}
static void page_negative(guard_env_t *e)
{
    e->indices[4] = -1;
}
static void num_pages_below_a_page_id(guard_env_t *e)
{
    e->kv.num_pages = G_PAGES - 1; /* page 63 of request 2 is now out of range */
}
static void last_zero_nonempty(guard_env_t *e)
{
    e->last[0] = 0;
}
static void last_above_page_size(guard_env_t *e)
{
    e->last[2] = G_PS + 1;
}
static void last_negative_empty(guard_env_t *e)
{
    e->last[1] = -1;
}
static void last_above_page_size_empty(guard_env_t *e)
{
    e->last[1] = G_PS + 1;
}
static void indptr_decreasing(guard_env_t *e)
{
    e->indptr[2] = 14;
}
static void indptr_first_nonzero(guard_env_t *e)
{
    e->indptr[0] = 1;
}
static void elem_bytes_3(guard_env_t *e)
{
    e->kv.elem_bytes = 3;
}
static void elem_bytes_8(guard_env_t *e)
{
    e->kv.elem_bytes = 8;
}
static void page_size_0(guard_env_t *e)
{
    e->kv.page_size = 0;
}
static void num_heads_0(guard_env_t *e)
{
    e->kv.num_heads = 0;
}
static void head_dim_0(guard_env_t *e)
{
    e->kv.head_dim = 0;
}
static void num_pages_0(guard_env_t *e)
{
    e->kv.num_pages = 0;
}
static void null_key(guard_env_t *e)
{
    e->src.key = NULL;
}
static void null_value(guard_env_t *e)
{
    e->src.value = NULL;
}
static void null_k_data(guard_env_t *e)
{
    e->kv.k_data = NULL;
}
static void null_v_data(guard_env_t *e)
{
    e->kv.v_data = NULL;
}
static void null_indptr(guard_env_t *e)
{
    e->kv.kv_indptr = NULL;
}
static void null_indices(guard_env_t *e)
{
    e->kv.kv_indices = NULL;
}
static void null_last(guard_env_t *e)
{
    e->kv.kv_last_page_len = NULL;
}
static void null_batch_indices(guard_env_t *e)
{
    e->bi_arg = NULL;
}
static void null_positions(guard_env_t *e)
{
    e->pos_arg = NULL;
}
static void null_kv(guard_env_t *e)
{
    e->kv_arg = NULL;
}
static void null_src(guard_env_t *e)
{
    e->src_arg = NULL;
}
static void pool_stride_negative(guard_env_t *e)
{
    e->kv.stride_n = -e->kv.stride_n;
}
static void pool_extent_overflows(guard_env_t *e)
{
    e->kv.stride_page = INT64_MAX / 8;
}
static void source_stride_negative(guard_env_t *e)
{
    e->src.k_stride_h = -G_D;
}
static void source_extent_overflows(guard_env_t *e)
{
    e->src.v_stride_n = INT64_MAX / 16;
}
/* Issue #15 defect 1: strides whose count is 1 (one token, one head) multiply by 0 in the
 * extent, but their byte step (stride * elem_bytes) overflows int64 all the same: the daemon's
 * Append with k_stride_n = 2^64 - 2 bytes became this call. */
static void one_token(guard_env_t *e)
{
    e->nnz = 1; /* token 0: request 0, position 0, a valid slot */
}
static void one_token_k_stride_n_2p64_minus_2_bytes(guard_env_t *e)
{
    one_token(e);
    e->src.k_stride_n = INT64_MAX; /* (2^64 - 2) / 2 bytes of fp16 */
}
static void one_token_v_stride_n_2p63_bytes(guard_env_t *e)
{
    one_token(e);
    e->src.v_stride_n = (int64_t)(UINT64_C(1) << 62); /* 2^63 bytes: one past ptrdiff_t */
}
static void one_head_k_stride_h_int64_max(guard_env_t *e)
{
    e->kv.num_heads = 1;
    e->src.k_stride_h = INT64_MAX;
}
static void one_head_pool_stride_h_int64_max(guard_env_t *e)
{
    e->kv.num_heads = 1;
    e->kv.stride_h = INT64_MAX;
}
static void source_wraps_address_space(guard_env_t *e)
{
    e->src.value = (const void *)(UINTPTR_MAX - 64); /* its extent wraps past the top */
}
static void pool_wraps_address_space(guard_env_t *e)
{
    e->kv.v_data = (void *)(UINTPTR_MAX - 64);
}
static void bad_token_after_good_ones(guard_env_t *e)
{
    e->pos[G_NNZ - 1] = 7; /* request 2 holds 7 tokens: 62 good tokens, then this one */
}

static const guard_case_t guard_cases[] = {
    {"position == seq_len", KVP_ERANGE, 0, pos_eq_seq_len},
    {"negative position", KVP_ERANGE, 0, pos_negative},
    {"position INT32_MIN", KVP_ERANGE, 0, pos_int_min},
    {"token of an empty request", KVP_ERANGE, 0, pos_in_empty_request},
    {"batch index == batch_size", KVP_ERANGE, 0, bi_eq_batch_size},
    {"batch index INT32_MAX", KVP_ERANGE, 0, bi_int_max},
    {"page id == num_pages", KVP_ERANGE, KVP_ERANGE, page_eq_num_pages},
    {"negative page id", KVP_ERANGE, KVP_ERANGE, page_negative},
    {"num_pages below a page id in the table", KVP_ERANGE, KVP_ERANGE, num_pages_below_a_page_id},
    {"last_page_len 0 on a non-empty request", KVP_ERANGE, KVP_ERANGE, last_zero_nonempty},
    {"last_page_len > page_size", KVP_ERANGE, KVP_ERANGE, last_above_page_size},
    {"last_page_len -1 on an empty request", KVP_ERANGE, KVP_ERANGE, last_negative_empty},
    {"last_page_len > page_size on an empty request", KVP_ERANGE, KVP_ERANGE,
     last_above_page_size_empty},
    {"decreasing kv_indptr", KVP_EINVAL, KVP_EINVAL, indptr_decreasing},
    {"kv_indptr[0] != 0", KVP_EINVAL, KVP_EINVAL, indptr_first_nonzero},
    {"elem_bytes 3", KVP_EINVAL, KVP_EINVAL, elem_bytes_3},
    {"elem_bytes 8", KVP_EINVAL, KVP_EINVAL, elem_bytes_8},
    {"page_size 0", KVP_EINVAL, KVP_EINVAL, page_size_0},
    {"num_heads 0", KVP_EINVAL, KVP_EINVAL, num_heads_0},
    {"head_dim 0", KVP_EINVAL, KVP_EINVAL, head_dim_0},
    {"num_pages 0", KVP_EINVAL, KVP_EINVAL, num_pages_0},
    {"NULL key", KVP_EINVAL, 0, null_key},
    {"NULL value", KVP_EINVAL, 0, null_value},
    {"NULL k_data", KVP_EINVAL, KVP_EINVAL, null_k_data},
    {"NULL v_data", KVP_EINVAL, KVP_EINVAL, null_v_data},
    {"NULL kv_indptr", KVP_EINVAL, KVP_EINVAL, null_indptr},
    {"NULL kv_indices", KVP_EINVAL, KVP_EINVAL, null_indices},
    {"NULL kv_last_page_len", KVP_EINVAL, KVP_EINVAL, null_last},
    {"NULL batch_indices", KVP_EINVAL, 0, null_batch_indices},
    {"NULL positions", KVP_EINVAL, 0, null_positions},
    {"NULL kv", KVP_EINVAL, KVP_EINVAL, null_kv},
    {"NULL src", KVP_EINVAL, 0, null_src},
    {"negative pool stride", KVP_EINVAL, KVP_EINVAL, pool_stride_negative},
    {"pool extent overflows int64", KVP_EINVAL, KVP_EINVAL, pool_extent_overflows},
    {"negative source stride", KVP_EINVAL, 0, source_stride_negative},
    {"source extent overflows int64", KVP_EINVAL, 0, source_extent_overflows},
    {"one token, k_stride_n of 2^64 - 2 bytes", KVP_EINVAL, 0,
     one_token_k_stride_n_2p64_minus_2_bytes},
    {"one token, v_stride_n of 2^63 bytes", KVP_EINVAL, 0, one_token_v_stride_n_2p63_bytes},
    {"one head, source k_stride_h INT64_MAX", KVP_EINVAL, 0, one_head_k_stride_h_int64_max},
    {"one head, pool stride_h INT64_MAX", KVP_EINVAL, KVP_EINVAL, one_head_pool_stride_h_int64_max},
    {"source extent wraps the address space", KVP_EINVAL, 0, source_wraps_address_space},
    {"pool extent wraps the address space", KVP_EINVAL, KVP_EINVAL, pool_wraps_address_space},
    {"bad token after 62 good ones", KVP_ERANGE, 0, bad_token_after_good_ones},
};
#define NUM_GUARD_CASES ((int)(sizeof(guard_cases) / sizeof(guard_cases[0])))

START_TEST(test_guard_rejects_with_pool_untouched)
{
    const guard_case_t *c = &guard_cases[_i];
    guard_env_t e;
    guard_env_init(&e);
    c->mutate(&e);
    int check = kvp_paged_kv_check(e.kv_arg);
    ck_assert_msg(check == c->check_want, "%s: kvp_paged_kv_check gave %s, want %s", c->name,
                  kvp_errname(check), kvp_errname(c->check_want));
    int rc = guard_env_append(&e);
    ck_assert_msg(rc == c->want, "%s: got %s, want %s", c->name, kvp_errname(rc),
                  kvp_errname(c->want));
    ck_assert_msg(memcmp(e.pool, e.before, e.d.pool_bytes) == 0, "%s: pool changed", c->name);
    guard_env_free(&e);
}
END_TEST

/* ---- d. page copies ------------------------------------------------------------------- */

static const kvp_page_copy_t copy_list[] = {{3, 7}, {0, 5}, {11, 1}, {4, 10}};
#define NUM_COPIES (sizeof(copy_list) / sizeof(copy_list[0]))

/* _i: layout (bit 0) x storage (bit 1); every element size. Two layers, the copy runs on
 * layer 1; the expected pool moves rows one by one through kvp_geom_offset. */
START_TEST(test_page_copy_moves_k_and_v_of_whole_pages)
{
    const uint64_t seed = kvp_test_seed(DEFAULT_SEED);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, seed + (uint64_t)_i);
    for (size_t ex = 0; ex < 3; ex++) {
        kvp_geom_t g = {.num_layers = 2,
                        .num_pages = 12,
                        .page_size = 5,
                        .num_kv_heads = 3,
                        .head_dim = 16,
                        .dtype = dtype_of_size(grid_elem_bytes[ex], ex & 1),
                        .layout = (kvp_layout_t)(_i & 1),
                        .storage = (kvp_storage_t)(_i >> 1)};
        kvp_geom_derived_t d;
        ck_assert_int_eq(kvp_geom_derive(&g, &d), 0);
        unsigned char *pool = xmalloc(d.pool_bytes), *before = xmalloc(d.pool_bytes);
        unsigned char *want = xmalloc(d.pool_bytes);
        kvp_rng_fill(&rng, pool, d.pool_bytes);
        memcpy(before, pool, d.pool_bytes);
        memcpy(want, pool, d.pool_bytes);
        for (size_t c = 0; c < NUM_COPIES; c++)
            for (int half = 0; half < 2; half++)
                for (uint32_t s = 0; s < g.page_size; s++)
                    for (uint32_t h = 0; h < d.heads; h++)
                        memcpy(want + kvp_geom_offset(&d, &g, 1, copy_list[c].dst, half, s, h),
                               before + kvp_geom_offset(&d, &g, 1, copy_list[c].src, half, s, h),
                               d.row_bytes);
        ck_assert_msg(memcmp(want, before, d.pool_bytes) != 0, "copies change nothing");

        /* only data, sizes and strides are used: no page table given */
        kvp_paged_kv_t kv = kv_for_layer(&g, &d, pool, 1);
        ck_assert_int_eq(kvp_page_copy_cpu(&kv, copy_list, NUM_COPIES), 0);
        size_t at = first_diff(pool, want, d.pool_bytes);
        ck_assert_msg(at == d.pool_bytes, "seed=%#llx %s %s %s: pool differs at byte %zu",
                      (unsigned long long)seed, kvp_layout_name(g.layout),
                      kvp_storage_name(g.storage), kvp_dtype_name(g.dtype), at);
        free(pool);
        free(before);
        free(want);
    }
}
END_TEST

/* Pool strides that no geometry produces (padding after each row, slot and page) take the
 * row-by-row path; _i: 0 NHD-like, 1 HND-like. Split K and V buffers. */
START_TEST(test_page_copy_with_padded_strides)
{
    enum { P = 6, PS = 5, H = 3, D = 16, EB = 2 };
    kvp_paged_kv_t kv;
    memset(&kv, 0, sizeof(kv));
    kv.elem_bytes = EB;
    kv.num_pages = P;
    kv.page_size = PS;
    kv.num_heads = H;
    kv.head_dim = D;
    if (_i == 0) {
        kv.stride_h = D + 4;
        kv.stride_n = H * kv.stride_h + 4;
        kv.stride_page = PS * kv.stride_n + 8;
    } else {
        kv.stride_n = D + 2;
        kv.stride_h = PS * kv.stride_n + 3;
        kv.stride_page = H * kv.stride_h + 1;
    }
    size_t bytes = (size_t)P * (size_t)kv.stride_page * EB;
    unsigned char *k = xmalloc(bytes), *v = xmalloc(bytes);
    unsigned char *want_k = xmalloc(bytes), *want_v = xmalloc(bytes);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(DEFAULT_SEED));
    kvp_rng_fill(&rng, k, bytes);
    kvp_rng_fill(&rng, v, bytes);
    memcpy(want_k, k, bytes);
    memcpy(want_v, v, bytes);
    const kvp_page_copy_t copies[] = {{0, 4}, {5, 1}};
    for (size_t c = 0; c < 2; c++)
        for (uint32_t s = 0; s < PS; s++)
            for (uint32_t h = 0; h < H; h++) {
                int64_t row = s * kv.stride_n + h * kv.stride_h;
                size_t dst = (size_t)(copies[c].dst * kv.stride_page + row) * EB;
                size_t from = (size_t)(copies[c].src * kv.stride_page + row) * EB;
                memcpy(want_k + dst, k + from, D * EB);
                memcpy(want_v + dst, v + from, D * EB);
            }
    kv.k_data = k;
    kv.v_data = v;
    ck_assert_int_eq(kvp_page_copy_cpu(&kv, copies, 2), 0);
    ck_assert_msg(memcmp(k, want_k, bytes) == 0, "K differs");
    ck_assert_msg(memcmp(v, want_v, bytes) == 0, "V differs");
    free(k);
    free(v);
    free(want_k);
    free(want_v);
}
END_TEST

START_TEST(test_page_copy_rejects_with_nothing_copied)
{
    kvp_geom_t g = {.num_layers = 1,
                    .num_pages = 8,
                    .page_size = 4,
                    .num_kv_heads = 2,
                    .head_dim = 8,
                    .dtype = KVP_DTYPE_FP16,
                    .layout = KVP_LAYOUT_HND,
                    .storage = KVP_STORAGE_SPLIT};
    kvp_geom_derived_t d;
    ck_assert_int_eq(kvp_geom_derive(&g, &d), 0);
    unsigned char *pool = xmalloc(d.pool_bytes), *before = xmalloc(d.pool_bytes);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(DEFAULT_SEED));
    kvp_rng_fill(&rng, pool, d.pool_bytes);
    memcpy(before, pool, d.pool_bytes);
    kvp_paged_kv_t kv = kv_for_layer(&g, &d, pool, 0);

    /* a good copy first in every list: a rejection must not have run it */
    const kvp_page_copy_t same[] = {{1, 2}, {3, 3}};
    const kvp_page_copy_t src_out[] = {{1, 2}, {8, 4}};
    const kvp_page_copy_t dst_out[] = {{1, 2}, {4, 8}};
    const kvp_page_copy_t dst_huge[] = {{1, 2}, {4, UINT32_MAX}};
    ck_assert_int_eq(kvp_page_copy_cpu(&kv, same, 2), KVP_EINVAL);
    ck_assert_int_eq(kvp_page_copy_cpu(&kv, src_out, 2), KVP_ERANGE);
    ck_assert_int_eq(kvp_page_copy_cpu(&kv, dst_out, 2), KVP_ERANGE);
    ck_assert_int_eq(kvp_page_copy_cpu(&kv, dst_huge, 2), KVP_ERANGE);
    ck_assert_int_eq(kvp_page_copy_cpu(&kv, NULL, 1), KVP_EINVAL);
    ck_assert_int_eq(kvp_page_copy_cpu(NULL, same, 1), KVP_EINVAL);
    ck_assert_int_eq(kvp_page_copy_cpu(&kv, NULL, 0), 0);
    kv.elem_bytes = 3;
    ck_assert_int_eq(kvp_page_copy_cpu(&kv, same, 1), KVP_EINVAL);
    kv.elem_bytes = 2;
    kv.v_data = NULL;
    ck_assert_int_eq(kvp_page_copy_cpu(&kv, same, 1), KVP_EINVAL);
    ck_assert_msg(memcmp(pool, before, d.pool_bytes) == 0, "a rejected copy changed the pool");
    free(pool);
    free(before);
}
END_TEST

/* ---- e. the helpers ------------------------------------------------------------------- */

START_TEST(test_seq_lens_of_empty_and_full_requests)
{
    const int32_t indptr[5] = {0, 0, 2, 2, 5}, last[4] = {0, 3, 0, 4};
    int32_t seq_lens[4];
    ck_assert_int_eq(kvp_get_seq_lens_cpu(indptr, last, 4, 4, seq_lens), 0);
    const int32_t want[4] = {0, 7, 0, 12};
    ck_assert_mem_eq(seq_lens, want, sizeof(want));
}
END_TEST

START_TEST(test_seq_lens_rejects_with_output_untouched)
{
    const int32_t good_indptr[3] = {0, 2, 3}, good_last[2] = {1, 4};
    const int32_t decreasing[3] = {0, 2, 1}, last_zero[2] = {0, 4}, last_big[2] = {1, 5};
    const int32_t huge_indptr[3] = {0, INT32_MAX, INT32_MAX};
    int32_t out[2] = {0x7a7a7a7a, 0x7a7a7a7a};
    const int32_t untouched[2] = {0x7a7a7a7a, 0x7a7a7a7a};
    ck_assert_int_eq(kvp_get_seq_lens_cpu(decreasing, good_last, 2, 4, out), KVP_EINVAL);
    ck_assert_int_eq(kvp_get_seq_lens_cpu(good_indptr, good_last, 2, 0, out), KVP_EINVAL);
    ck_assert_int_eq(kvp_get_seq_lens_cpu(NULL, good_last, 2, 4, out), KVP_EINVAL);
    ck_assert_int_eq(kvp_get_seq_lens_cpu(good_indptr, NULL, 2, 4, out), KVP_EINVAL);
    ck_assert_int_eq(kvp_get_seq_lens_cpu(good_indptr, good_last, 2, 4, NULL), KVP_EINVAL);
    ck_assert_int_eq(kvp_get_seq_lens_cpu(good_indptr, last_zero, 2, 4, out), KVP_EINVAL);
    ck_assert_int_eq(kvp_get_seq_lens_cpu(good_indptr, last_big, 2, 4, out), KVP_EINVAL);
    ck_assert_int_eq(kvp_get_seq_lens_cpu(huge_indptr, good_last, 2, 4, out), KVP_EINVAL);
    ck_assert_mem_eq(out, untouched, sizeof(out));
    ck_assert_int_eq(kvp_get_seq_lens_cpu(good_indptr, good_last, 2, 4, out), 0);
    ck_assert_int_eq(out[0], 5);
    ck_assert_int_eq(out[1], 4);
}
END_TEST

START_TEST(test_batch_indices_positions_skip_idle_requests)
{
    const int32_t append_indptr[4] = {0, 2, 2, 5}, seq_lens[3] = {10, 4, 3};
    int32_t bi[5], pos[5];
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(append_indptr, seq_lens, 3, 5, bi, pos),
                     0);
    const int32_t want_bi[5] = {0, 0, 2, 2, 2}, want_pos[5] = {8, 9, 0, 1, 2};
    ck_assert_mem_eq(bi, want_bi, sizeof(bi));
    ck_assert_mem_eq(pos, want_pos, sizeof(pos));
    const int32_t none[4] = {0, 0, 0, 0};
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(none, seq_lens, 3, 0, NULL, NULL), 0);
}
END_TEST

START_TEST(test_batch_indices_positions_reject_with_outputs_untouched)
{
    const int32_t seq_lens[3] = {10, 4, 3};
    const int32_t good[4] = {0, 2, 2, 5};
    const int32_t too_long[4] = {0, 2, 7, 8}; /* request 1 appends 5 > seq_len 4 */
    const int32_t decreasing[4] = {0, 3, 2, 5};
    const int32_t first_nonzero[4] = {1, 2, 2, 5};
    const int32_t wild[4] = {0, INT32_MIN, INT32_MAX, 5};
    const int32_t negative_len[3] = {10, -1, 3};
    int32_t bi[8], pos[8];
    memset(bi, 0x7a, sizeof(bi));
    memset(pos, 0x7a, sizeof(pos));
    int32_t untouched[8];
    memset(untouched, 0x7a, sizeof(untouched));
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(too_long, seq_lens, 3, 8, bi, pos),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(good, seq_lens, 3, 4, bi, pos),
                     KVP_EINVAL); /* append_indptr[B] = 5 != nnz */
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(good, seq_lens, 3, 6, bi, pos),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(decreasing, seq_lens, 3, 5, bi, pos),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(first_nonzero, seq_lens, 3, 5, bi, pos),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(wild, seq_lens, 3, 5, bi, pos),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(good, negative_len, 3, 5, bi, pos),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(good, seq_lens, 3, 5, NULL, pos),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(good, seq_lens, 3, 5, bi, NULL),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(NULL, seq_lens, 3, 5, bi, pos),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(good, NULL, 3, 5, bi, pos), KVP_EINVAL);
    ck_assert_mem_eq(bi, untouched, sizeof(bi));
    ck_assert_mem_eq(pos, untouched, sizeof(pos));
}
END_TEST

/* kvp_append_cpu's three destinations say the same thing three ways: two requests (pages
 * {3, 1} holding 7 tokens, the last 5 appended; page {2} holding 2, both appended), page size
 * 4, and each form writes the same bytes; a slot beyond the pool and a malformed append_indptr
 * are refused with the pool untouched. */
START_TEST(test_dest_forms_write_the_same_bytes)
{
    enum { P = 4, H = 2, D = 4, PAGES = 5, NNZ = 7 };
    const int32_t indptr[] = {0, 2, 3}, indices[] = {3, 1, 2}, last[] = {3, 2};
    const int32_t aip[] = {0, 5, 7};
    const int32_t bi[] = {0, 0, 0, 0, 0, 1, 1}, pos[] = {2, 3, 4, 5, 6, 0, 1};
    const int32_t slots[] = {3 * P + 2, 3 * P + 3, 1 * P + 0, 1 * P + 1,
                             1 * P + 2, 2 * P + 0, 2 * P + 1};
    static uint16_t pool[3][2 * PAGES * P * H * D], src[NNZ * H * D * 2];
    for (size_t i = 0; i < sizeof(src) / sizeof(src[0]); i++)
        src[i] = (uint16_t)(i * 7 + 1);
    memset(pool, 0, sizeof(pool));
    const kvp_append_src_t as = {.key = src,
                                 .value = src + NNZ * H * D,
                                 .k_stride_n = H * D,
                                 .k_stride_h = D,
                                 .v_stride_n = H * D,
                                 .v_stride_h = D};
    const kvp_append_dest_t dests[3] = {
        {.kind = KVP_APPEND_DEST_TOKENS, .nnz = NNZ, .batch_indices = bi, .positions = pos},
        {.kind = KVP_APPEND_DEST_FUSED, .nnz = NNZ, .append_indptr = aip},
        {.kind = KVP_APPEND_DEST_SLOTS, .nnz = NNZ, .slots = slots}};
    for (int f = 0; f < 3; f++) {
        kvp_paged_kv_t kv = {.k_data = pool[f],
                             .v_data = pool[f] + PAGES * P * H * D,
                             .elem_bytes = 2,
                             .num_pages = PAGES,
                             .page_size = P,
                             .num_heads = H,
                             .head_dim = D,
                             .stride_page = P * H * D,
                             .stride_n = H * D,
                             .stride_h = D,
                             .batch_size = 2,
                             .kv_indptr = indptr,
                             .kv_indices = indices,
                             .kv_last_page_len = last};
        ck_assert_int_eq(kvp_append_cpu(&kv, &as, &dests[f]), 0);
    }
    ck_assert_int_eq(memcmp(pool[0], pool[1], sizeof(pool[0])), 0);
    ck_assert_int_eq(memcmp(pool[0], pool[2], sizeof(pool[0])), 0);
    /* token 4 (request 0, position 6: page 1, slot 2), head 1, V */
    ck_assert_int_eq(memcmp(pool[2] + PAGES * P * H * D + (1 * P + 2) * H * D + D,
                            src + NNZ * H * D + 4 * H * D + D, D * 2),
                     0);
    /* refusals: nothing written */
    kvp_paged_kv_t kv = {.k_data = pool[2],
                         .v_data = pool[2] + PAGES * P * H * D,
                         .elem_bytes = 2,
                         .num_pages = PAGES,
                         .page_size = P,
                         .num_heads = H,
                         .head_dim = D,
                         .stride_page = P * H * D,
                         .stride_n = H * D,
                         .stride_h = D}; /* no page table: the slots form needs none */
    memset(pool[2], 0, sizeof(pool[2]));
    int32_t bad[NNZ];
    memcpy(bad, slots, sizeof(bad));
    bad[6] = PAGES * P;
    kvp_append_dest_t d = {.kind = KVP_APPEND_DEST_SLOTS, .nnz = NNZ, .slots = bad};
    ck_assert_int_eq(kvp_append_cpu(&kv, &as, &d), KVP_ERANGE);
    bad[6] = -1; /* padding */
    bad[0] = 0;
    ck_assert_int_eq(kvp_append_cpu(&kv, &as, &d), 0);
    memset(pool[2], 0, sizeof(pool[2]));
    kv.batch_size = 2, kv.kv_indptr = indptr, kv.kv_indices = indices, kv.kv_last_page_len = last;
    const int32_t aip_short[] = {0, 5, 6}, aip_long[] = {0, 1, 7};
    d = (kvp_append_dest_t){.kind = KVP_APPEND_DEST_FUSED, .nnz = NNZ, .append_indptr = aip_short};
    ck_assert_int_eq(kvp_append_cpu(&kv, &as, &d), KVP_EINVAL); /* [batch_size] != nnz */
    d.append_indptr = aip_long; /* request 1 would append 6 of its 2 tokens */
    ck_assert_int_eq(kvp_append_cpu(&kv, &as, &d), KVP_ERANGE);
    ck_assert_int_eq(kvp_append_cpu(&kv, &as, NULL), KVP_EINVAL);
    for (size_t i = 0; i < sizeof(pool[2]) / sizeof(pool[2][0]); i++)
        ck_assert_uint_eq(pool[2][i], 0);
}
END_TEST

static Suite *append_cpu_suite(void)
{
    Suite *s = suite_create("append_cpu");

    TCase *tc = tcase_create("seed_example");
    tcase_add_test(tc, test_seed_example_matches_flashinfer);
    tcase_add_test(tc, test_dest_forms_write_the_same_bytes);
    suite_add_tcase(s, tc);

    tc = tcase_create("grid");
    tcase_set_timeout(tc, 300);
    tcase_add_loop_test(tc, test_grid_matches_naive_reference, 0,
                        (int)(sizeof(grid_page_sizes) / sizeof(grid_page_sizes[0])));
    suite_add_tcase(s, tc);

    tc = tcase_create("guards");
    tcase_add_test(tc, test_guard_baseline_batch_lands);
    tcase_add_test(tc, test_guard_nnz_zero_is_noop);
    tcase_add_test(tc, test_guard_padding_is_skipped);
    tcase_add_loop_test(tc, test_guard_rejects_with_pool_untouched, 0, NUM_GUARD_CASES);
    suite_add_tcase(s, tc);

    tc = tcase_create("page_copy");
    tcase_add_loop_test(tc, test_page_copy_moves_k_and_v_of_whole_pages, 0, 4);
    tcase_add_loop_test(tc, test_page_copy_with_padded_strides, 0, 2);
    tcase_add_test(tc, test_page_copy_rejects_with_nothing_copied);
    suite_add_tcase(s, tc);

    tc = tcase_create("helpers");
    tcase_add_test(tc, test_seq_lens_of_empty_and_full_requests);
    tcase_add_test(tc, test_seq_lens_rejects_with_output_untouched);
    tcase_add_test(tc, test_batch_indices_positions_skip_idle_requests);
    tcase_add_test(tc, test_batch_indices_positions_reject_with_outputs_untouched);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(append_cpu_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
