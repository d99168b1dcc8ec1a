/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_gather_cpu.c - the CPU gather (kvp_gather_cpu, kvp_kernels.h), a Load's copy: rows of
 * pool slots out to a tensor at any offsets and strides. Pinned down three ways: it inverts
 * the append (rows appended to random slots through kvp_append_cpu, gathered back into a
 * buffer of another layout, equal the source byte for byte) over every layout, storage and
 * element size; it reads each slot where the geometry alone (kvp_geom_offset) puts it, repeats
 * and padding included; and every refusal leaves the destination as it was. In each case the
 * whole destination is compared, so a byte written outside the gathered rows fails. Random
 * tests print their seed and replay with KVP_TEST_SEED.
 */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_kernels.h"
#include "kvp_test_util.h"

#define DEFAULT_SEED 0x9a7e0f11ull

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    ck_assert_ptr_nonnull(p);
    return p;
}

/* The canary of a destination's untouched bytes: position-dependent, so a row written at a
 * wrong place cannot look untouched. */
static void canary(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(0xA5 ^ (i * 29));
}

/* Where rows live in a buffer, in bytes: token n, head h at off + n * sn + h * sh (K and V). */
typedef struct {
    uint64_t k_off, v_off, kn, kh, vn, vh, bytes;
} rows_t;

#define NUM_ROW_KINDS 4

/* A layout of nnz tokens x H heads x row bytes (element size e): 0 packed [K: n][h] then V;
 * 1 head-major [h][n] with a padded head pitch; 2 per token K's heads then V's, padded;
 * 3 token-major with padded rows and a padded token pitch. Offsets and padding are random
 * multiples of e. */
static rows_t make_rows(kvp_rng_t *r, int kind, uint32_t nnz, uint32_t H, uint64_t row, uint32_t e)
{
    rows_t l;
    const uint64_t pad = e * (1 + kvp_rng_below(r, 5)), off = e * kvp_rng_below(r, 9);
    switch (kind) {
    case 0:
        l.kh = l.vh = row;
        l.kn = l.vn = H * row;
        l.k_off = off;
        l.v_off = l.k_off + nnz * l.kn;
        break;
    case 1:
        l.kn = l.vn = row;
        l.kh = l.vh = nnz * row + pad;
        l.k_off = off;
        l.v_off = l.k_off + H * l.kh + pad;
        break;
    case 2:
        l.kh = l.vh = row;
        l.kn = l.vn = 2 * H * row + pad;
        l.k_off = off;
        l.v_off = off + H * row;
        break;
    default:
        l.kh = l.vh = row + pad;
        l.kn = l.vn = H * l.kh + 2 * pad;
        l.v_off = off;
        l.k_off = l.v_off + nnz * l.vn + pad; /* V first */
        break;
    }
    const uint64_t k_end = l.k_off + (nnz - 1) * l.kn + (H - 1) * l.kh + row;
    const uint64_t v_end = l.v_off + (nnz - 1) * l.vn + (H - 1) * l.vh + row;
    l.bytes = (k_end > v_end ? k_end : v_end) + pad;
    return l;
}

static kvp_append_src_t src_of(const uint8_t *buf, const rows_t *l, uint32_t e)
{
    return (kvp_append_src_t){.key = buf + l->k_off,
                              .value = buf + l->v_off,
                              .k_stride_n = (int64_t)(l->kn / e),
                              .k_stride_h = (int64_t)(l->kh / e),
                              .v_stride_n = (int64_t)(l->vn / e),
                              .v_stride_h = (int64_t)(l->vh / e)};
}

static kvp_gather_dst_t dst_of(uint8_t *buf, const rows_t *l, uint32_t e)
{
    return (kvp_gather_dst_t){.key = buf + l->k_off,
                              .value = buf + l->v_off,
                              .k_stride_n = (int64_t)(l->kn / e),
                              .k_stride_h = (int64_t)(l->kh / e),
                              .v_stride_n = (int64_t)(l->vn / e),
                              .v_stride_h = (int64_t)(l->vh / e)};
}

/* Row (kv, token n, head h) of a buffer laid out as l. */
static uint8_t *row_at(uint8_t *buf, const rows_t *l, int kv, uint32_t n, uint32_t h)
{
    return buf + (kv ? l->v_off + n * l->vn + h * l->vh : l->k_off + n * l->kn + h * l->kh);
}

/* A pool of geometry g (layer `layer`'s view in *kv), filled with random bytes. */
typedef struct {
    kvp_geom_t g;
    kvp_geom_derived_t d;
    uint8_t *pool;
    kvp_paged_kv_t kv;
    uint32_t layer;
} pool_t;

static void pool_open(pool_t *p, const kvp_geom_t *g, uint32_t layer, kvp_rng_t *r)
{
    p->g = *g;
    ck_assert_int_eq(kvp_geom_derive(g, &p->d), 0);
    p->pool = xmalloc(p->d.pool_bytes);
    kvp_rng_fill(r, p->pool, p->d.pool_bytes);
    p->layer = layer;
    memset(&p->kv, 0, sizeof(p->kv));
    p->kv.k_data = p->pool + kvp_geom_layer_offset(&p->d, layer);
    p->kv.v_data = (uint8_t *)p->kv.k_data + p->d.v_offset_bytes;
    p->kv.elem_bytes = p->d.elem_bytes;
    p->kv.num_pages = g->num_pages;
    p->kv.page_size = g->page_size;
    p->kv.num_heads = p->d.heads;
    p->kv.head_dim = g->head_dim;
    p->kv.stride_page = p->d.stride_page;
    p->kv.stride_n = p->d.stride_n;
    p->kv.stride_h = p->d.stride_h;
}

static kvp_dtype_t dtype_of(uint32_t elem, int alt)
{
    if (elem == 1)
        return alt ? KVP_DTYPE_FP8_E5M2 : KVP_DTYPE_FP8_E4M3;
    if (elem == 2)
        return alt ? KVP_DTYPE_BF16 : KVP_DTYPE_FP16;
    return KVP_DTYPE_FP32;
}

/* nnz distinct slots of the pool in random order, about one in eight of them padding (-1). */
static void random_slots(kvp_rng_t *r, uint32_t cap, uint32_t nnz, int32_t *slots)
{
    int32_t *all = xmalloc(cap * sizeof(int32_t));
    for (uint32_t i = 0; i < cap; i++)
        all[i] = (int32_t)i;
    for (uint32_t i = 0; i < nnz; i++) {
        uint32_t j = i + kvp_rng_below(r, cap - i);
        int32_t t = all[i];
        all[i] = all[j];
        all[j] = t;
        slots[i] = kvp_rng_below(r, 8) == 0 ? -1 : all[i];
    }
    free(all);
}

static const uint32_t PAGE_SIZES[] = {1, 4, 16};
static const uint32_t HEAD_DIMS[] = {4, 16, 64};
static const uint32_t ELEMS[] = {1, 2, 4};
#define NUM_PAGE_SIZES (sizeof(PAGE_SIZES) / sizeof(PAGE_SIZES[0]))

/* ---- the gather inverts the append ----------------------------------------------------- */

START_TEST(gather_returns_exactly_what_the_append_wrote)
{
    const uint64_t seed = kvp_test_seed(DEFAULT_SEED);
    const uint32_t ps = PAGE_SIZES[_i];
    uint32_t index = (uint32_t)_i * 1000u;
    for (int layout = KVP_LAYOUT_NHD; layout <= KVP_LAYOUT_HND; layout++)
        for (int storage = KVP_STORAGE_COMBINED; storage <= KVP_STORAGE_SPLIT; storage++)
            for (size_t dx = 0; dx < sizeof(HEAD_DIMS) / sizeof(HEAD_DIMS[0]); dx++)
                for (size_t ex = 0; ex < sizeof(ELEMS) / sizeof(ELEMS[0]); ex++, index++) {
                    kvp_rng_t r;
                    kvp_rng_seed(&r, seed ^ ((uint64_t)index << 32));
                    const kvp_geom_t g = {.num_layers = 2,
                                          .num_pages = 3 + kvp_rng_below(&r, 10),
                                          .page_size = ps,
                                          .num_kv_heads = 1 + kvp_rng_below(&r, 4),
                                          .head_dim = HEAD_DIMS[dx],
                                          .dtype = dtype_of(ELEMS[ex], (int)(index & 1)),
                                          .layout = (kvp_layout_t)layout,
                                          .storage = (kvp_storage_t)storage,
                                          .num_devices = 1};
                    pool_t p;
                    pool_open(&p, &g, 1, &r);
                    const uint32_t e = p.d.elem_bytes, H = p.d.heads;
                    const uint64_t row = p.d.row_bytes;
                    const uint32_t cap = g.num_pages * ps;
                    const uint32_t nnz = 1 + kvp_rng_below(&r, cap);
                    int32_t *slots = xmalloc(nnz * sizeof(int32_t));
                    random_slots(&r, cap, nnz, slots);
                    const int sk = (int)kvp_rng_below(&r, NUM_ROW_KINDS);
                    const int dk = (sk + 1 + (int)kvp_rng_below(&r, NUM_ROW_KINDS - 1)) %
                                   NUM_ROW_KINDS; /* always another layout */
                    const rows_t sl = make_rows(&r, sk, nnz, H, row, e);
                    const rows_t dl = make_rows(&r, dk, nnz, H, row, e);
                    uint8_t *src = xmalloc(sl.bytes), *dst = xmalloc(dl.bytes),
                            *want = xmalloc(dl.bytes), *pool_after = xmalloc(p.d.pool_bytes);
                    kvp_rng_fill(&r, src, sl.bytes);
                    canary(dst, dl.bytes);
                    canary(want, dl.bytes);
                    char ctx[200];
                    snprintf(ctx, sizeof(ctx),
                             "seed=%#llx index=%u page_size=%u layout=%s storage=%s "
                             "head_dim=%u elem=%u heads=%u nnz=%u src=%d dst=%d",
                             (unsigned long long)seed, index, ps, kvp_layout_name(g.layout),
                             kvp_storage_name(g.storage), g.head_dim, e, H, nnz, sk, dk);

                    const kvp_append_src_t as = src_of(src, &sl, e);
                    const kvp_append_dest_t ad = {
                        .kind = KVP_APPEND_DEST_SLOTS, .nnz = nnz, .slots = slots};
                    ck_assert_msg(kvp_append_cpu(&p.kv, &as, &ad) == 0, "append: %s", ctx);
                    memcpy(pool_after, p.pool, p.d.pool_bytes);
                    const kvp_gather_dst_t gd = dst_of(dst, &dl, e);
                    ck_assert_msg(kvp_gather_cpu(&p.kv, slots, nnz, &gd) == 0, "gather: %s", ctx);

                    /* the source's rows where dst's layout puts them; padding rows untouched */
                    for (uint32_t i = 0; i < nnz; i++)
                        for (uint32_t h = 0; h < H && slots[i] >= 0; h++)
                            for (int kv = 0; kv < 2; kv++)
                                memcpy(row_at(want, &dl, kv, i, h), row_at(src, &sl, kv, i, h),
                                       row);
                    size_t at = 0;
                    while (at < dl.bytes && dst[at] == want[at])
                        at++;
                    ck_assert_msg(at == dl.bytes, "%s: dst byte %zu of %llu differs", ctx, at,
                                  (unsigned long long)dl.bytes);
                    ck_assert_msg(memcmp(p.pool, pool_after, p.d.pool_bytes) == 0,
                                  "%s: the gather wrote the pool", ctx);
                    free(pool_after);
                    free(want);
                    free(dst);
                    free(src);
                    free(slots);
                    free(p.pool);
                }
}
END_TEST

/* ---- the gather reads where the geometry puts each slot -------------------------------- */

START_TEST(gather_reads_each_slot_where_the_geometry_puts_it)
{
    const uint64_t seed = kvp_test_seed(DEFAULT_SEED) + 1;
    kvp_rng_t r;
    kvp_rng_seed(&r, seed ^ (uint64_t)_i);
    for (int round = 0; round < 24; round++) {
        const kvp_geom_t g = {.num_layers = 3,
                              .num_pages = 2 + kvp_rng_below(&r, 6),
                              .page_size = PAGE_SIZES[kvp_rng_below(&r, NUM_PAGE_SIZES)],
                              .num_kv_heads = 4,
                              .head_dim = 8 << kvp_rng_below(&r, 3),
                              .dtype = dtype_of(ELEMS[kvp_rng_below(&r, 3)], round & 1),
                              .layout = (kvp_layout_t)(round & 1),
                              .storage = (kvp_storage_t)((round >> 1) & 1),
                              /* two devices: the view holds one device's two heads */
                              .num_devices = 2};
        pool_t p;
        pool_open(&p, &g, kvp_rng_below(&r, 3), &r);
        ck_assert_uint_eq(p.d.heads, 2);
        const uint32_t e = p.d.elem_bytes, H = p.d.heads, cap = g.num_pages * g.page_size;
        const uint64_t row = p.d.row_bytes;
        /* repeats allowed (a Load may read one slot twice), and padding */
        const uint32_t nnz = 1 + kvp_rng_below(&r, 2 * cap);
        int32_t *slots = xmalloc(nnz * sizeof(int32_t));
        for (uint32_t i = 0; i < nnz; i++)
            slots[i] = kvp_rng_below(&r, 6) == 0 ? -1 - (int32_t)kvp_rng_below(&r, 3)
                                                 : (int32_t)kvp_rng_below(&r, cap);
        const rows_t dl = make_rows(&r, (int)kvp_rng_below(&r, NUM_ROW_KINDS), nnz, H, row, e);
        uint8_t *dst = xmalloc(dl.bytes), *want = xmalloc(dl.bytes);
        canary(dst, dl.bytes);
        canary(want, dl.bytes);
        for (uint32_t i = 0; i < nnz; i++) {
            if (slots[i] < 0)
                continue;
            const uint32_t page = (uint32_t)slots[i] / g.page_size,
                           pos = (uint32_t)slots[i] % g.page_size;
            for (uint32_t h = 0; h < H; h++)
                for (int kv = 0; kv < 2; kv++)
                    memcpy(row_at(want, &dl, kv, i, h),
                           p.pool + kvp_geom_offset(&p.d, &g, p.layer, page, kv, pos, h), row);
        }
        const kvp_gather_dst_t gd = dst_of(dst, &dl, e);
        ck_assert_int_eq(kvp_gather_cpu(&p.kv, slots, nnz, &gd), 0);
        ck_assert_msg(memcmp(dst, want, dl.bytes) == 0,
                      "seed=%#llx round %d: dst differs from the geometry's rows",
                      (unsigned long long)seed, round);
        free(want);
        free(dst);
        free(slots);
        free(p.pool);
    }
}
END_TEST

/* ---- refusals ---------------------------------------------------------------------------- */

START_TEST(a_refused_gather_writes_nothing)
{
    kvp_rng_t r;
    kvp_rng_seed(&r, 7);
    const kvp_geom_t g = {.num_layers = 1,
                          .num_pages = 4,
                          .page_size = 4,
                          .num_kv_heads = 2,
                          .head_dim = 8,
                          .dtype = KVP_DTYPE_FP16,
                          .layout = KVP_LAYOUT_NHD,
                          .storage = KVP_STORAGE_COMBINED,
                          .num_devices = 1};
    pool_t p;
    pool_open(&p, &g, 0, &r);
    enum { NNZ = 5 };
    int32_t slots[NNZ] = {3, 0, 15, -1, 7};
    const rows_t dl = make_rows(&r, 0, NNZ, 2, 16, 2);
    uint8_t *dst = xmalloc(dl.bytes), *clean = xmalloc(dl.bytes);
    canary(dst, dl.bytes);
    canary(clean, dl.bytes);
    const kvp_gather_dst_t good = dst_of(dst, &dl, 2);
    kvp_gather_dst_t d;
    kvp_paged_kv_t kv;
#define REFUSED(want, kvp, sl, n, dp)                                                              \
    do {                                                                                           \
        ck_assert_int_eq(kvp_gather_cpu((kvp), (sl), (n), (dp)), (want));                          \
        ck_assert_msg(memcmp(dst, clean, dl.bytes) == 0, "line %d: dst written", __LINE__);        \
    } while (0)

    /* slots beyond the pool: the first slot past it, and the largest; the good ones before
     * them are not written either */
    slots[4] = 16;
    REFUSED(KVP_ERANGE, &p.kv, slots, NNZ, &good);
    slots[4] = INT32_MAX;
    REFUSED(KVP_ERANGE, &p.kv, slots, NNZ, &good);
    slots[4] = 7;
    /* missing arguments */
    REFUSED(KVP_EINVAL, NULL, slots, NNZ, &good);
    REFUSED(KVP_EINVAL, &p.kv, NULL, NNZ, &good);
    REFUSED(KVP_EINVAL, &p.kv, slots, NNZ, NULL);
    d = good, d.key = NULL;
    REFUSED(KVP_EINVAL, &p.kv, slots, NNZ, &d);
    d = good, d.value = NULL;
    REFUSED(KVP_EINVAL, &p.kv, slots, NNZ, &d);
    /* the destination's strides: negative, a byte step past ptrdiff_t, an extent that wraps */
    d = good, d.k_stride_n = -8;
    REFUSED(KVP_EINVAL, &p.kv, slots, NNZ, &d);
    d = good, d.v_stride_h = -1;
    REFUSED(KVP_EINVAL, &p.kv, slots, NNZ, &d);
    d = good, d.k_stride_h = INT64_MAX / 2 + 1;
    REFUSED(KVP_EINVAL, &p.kv, slots, NNZ, &d);
    d = good, d.v_stride_n = INT64_MAX / 4;
    REFUSED(KVP_EINVAL, &p.kv, slots, NNZ, &d);
    /* the pool's shape */
    kv = p.kv, kv.elem_bytes = 3;
    REFUSED(KVP_EINVAL, &kv, slots, NNZ, &good);
    kv = p.kv, kv.head_dim = 0;
    REFUSED(KVP_EINVAL, &kv, slots, NNZ, &good);
    kv = p.kv, kv.num_pages = 0;
    REFUSED(KVP_EINVAL, &kv, slots, NNZ, &good);
    kv = p.kv, kv.stride_n = -1;
    REFUSED(KVP_EINVAL, &kv, slots, NNZ, &good);
    kv = p.kv, kv.k_data = NULL;
    REFUSED(KVP_EINVAL, &kv, slots, NNZ, &good);
    /* nnz 0 reads nothing, whatever the arguments */
    REFUSED(0, NULL, NULL, 0, NULL);
#undef REFUSED

    /* and the good call does write: slots 3, 0, 15, (padding), 7 */
    ck_assert_int_eq(kvp_gather_cpu(&p.kv, slots, NNZ, &good), 0);
    ck_assert_int_ne(memcmp(dst, clean, dl.bytes), 0);
    ck_assert_int_eq(
        memcmp(row_at(dst, &dl, 1, 2, 1), p.pool + kvp_geom_offset(&p.d, &g, 0, 3, 1, 3, 1), 16),
        0);
    ck_assert_int_eq(memcmp(row_at(dst, &dl, 0, 3, 0), row_at(clean, &dl, 0, 3, 0), 32), 0);
    free(clean);
    free(dst);
    free(p.pool);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("gather_cpu");
    TCase *tc = tcase_create("gather_cpu");
    tcase_set_timeout(tc, 300);
    tcase_add_loop_test(tc, gather_returns_exactly_what_the_append_wrote, 0, (int)NUM_PAGE_SIZES);
    tcase_add_loop_test(tc, gather_reads_each_slot_where_the_geometry_puts_it, 0, 4);
    tcase_add_test(tc, a_refused_gather_writes_nothing);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
