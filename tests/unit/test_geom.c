/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_geom.c - geometry validation (every bad field gets its own code and a message naming
 * it), name parsing, and the derived strides and offsets for both layouts and storages,
 * checked against the tensor shapes of DESIGN.md §1 written out by hand.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_geom.h"

static kvp_geom_t good(void)
{
    return (kvp_geom_t){.num_layers = 2,
                        .num_pages = 10,
                        .page_size = 16,
                        .num_kv_heads = 8,
                        .head_dim = 128,
                        .dtype = KVP_DTYPE_FP16,
                        .layout = KVP_LAYOUT_NHD,
                        .storage = KVP_STORAGE_COMBINED,
                        .num_devices = 1};
}

static void expect_bad(kvp_geom_t g, int code, const char *field)
{
    char msg[160] = "x";
    ck_assert_int_eq(kvp_geom_validate(&g, msg, sizeof(msg)), code);
    ck_assert_msg(strstr(msg, field) != NULL, "message '%s' does not name %s", msg, field);
    kvp_geom_derived_t d;
    memset(&d, 0x5a, sizeof(d));
    ck_assert_int_eq(kvp_geom_derive(&g, &d), code);
    ck_assert_uint_eq(d.elem_bytes, 0x5a5a5a5au); /* untouched */
}

START_TEST(every_bad_field_has_its_own_error)
{
    char msg[64] = "x";
    kvp_geom_t g = good();
    ck_assert_int_eq(kvp_geom_validate(&g, msg, sizeof(msg)), 0);
    ck_assert_str_eq(msg, "");
    ck_assert_int_eq(kvp_geom_validate(NULL, msg, sizeof(msg)), KVP_EGEOM_NULL);

    g = good(), g.num_layers = 0, expect_bad(g, KVP_EGEOM_NUM_LAYERS, "num_layers");
    g = good(), g.num_layers = 4097, expect_bad(g, KVP_EGEOM_NUM_LAYERS, "num_layers");
    g = good(), g.num_pages = 0, expect_bad(g, KVP_EGEOM_NUM_PAGES, "num_pages");
    g = good(), g.num_pages = 0x80000000u, expect_bad(g, KVP_EGEOM_NUM_PAGES, "num_pages");
    g = good(), g.page_size = 0, expect_bad(g, KVP_EGEOM_PAGE_SIZE, "page_size");
    g = good(), g.page_size = 65537, expect_bad(g, KVP_EGEOM_PAGE_SIZE, "page_size");
    g = good(), g.num_kv_heads = 0, expect_bad(g, KVP_EGEOM_NUM_KV_HEADS, "num_kv_heads");
    g = good(), g.num_kv_heads = 1025, expect_bad(g, KVP_EGEOM_NUM_KV_HEADS, "num_kv_heads");
    g = good(), g.head_dim = 0, expect_bad(g, KVP_EGEOM_HEAD_DIM, "head_dim");
    g = good(), g.head_dim = 4097, expect_bad(g, KVP_EGEOM_HEAD_DIM, "head_dim");
    g = good(), g.dtype = (kvp_dtype_t)0, expect_bad(g, KVP_EGEOM_DTYPE, "dtype");
    g = good(), g.dtype = (kvp_dtype_t)6, expect_bad(g, KVP_EGEOM_DTYPE, "dtype");
    g = good(), g.layout = (kvp_layout_t)2, expect_bad(g, KVP_EGEOM_LAYOUT, "layout");
    g = good(), g.storage = (kvp_storage_t)2, expect_bad(g, KVP_EGEOM_STORAGE, "storage");
    g = good(), g.num_devices = 3, expect_bad(g, KVP_EGEOM_NUM_DEVICES, "num_devices");
    g = good(), g.num_devices = 65, expect_bad(g, KVP_EGEOM_NUM_DEVICES, "num_devices");
    g = good(), g.num_pages = 0x7fffffffu, expect_bad(g, KVP_EGEOM_TOO_LARGE, "int32");
    g = good(), g.num_pages = 1 << 20, g.page_size = 2048, g.num_layers = 4096,
    g.num_kv_heads = 1024, g.head_dim = 4096, g.dtype = KVP_DTYPE_FP32;
    expect_bad(g, KVP_EGEOM_TOO_LARGE, "num_pages*page_size");
    g = good(), g.num_pages = 1 << 16, g.page_size = 1 << 14, g.num_layers = 4096,
    g.num_kv_heads = 1024, g.head_dim = 4096, g.dtype = KVP_DTYPE_FP32;
    expect_bad(g, KVP_EGEOM_TOO_LARGE, "overflow");
    /* first bad field wins, in struct order */
    g = good(), g.num_layers = 0, g.head_dim = 0;
    expect_bad(g, KVP_EGEOM_NUM_LAYERS, "num_layers");
    /* num_devices 0 reads as 1; 2 and 8 divide 8 heads */
    g = good(), g.num_devices = 0;
    ck_assert_int_eq(kvp_geom_validate(&g, NULL, 0), 0);
    g.num_devices = 8;
    ck_assert_int_eq(kvp_geom_validate(&g, NULL, 0), 0);
}
END_TEST

START_TEST(names_round_trip)
{
    for (int t = KVP_DTYPE_FP8_E4M3; t <= KVP_DTYPE_FP32; t++) {
        kvp_dtype_t out;
        ck_assert_int_eq(kvp_dtype_parse(kvp_dtype_name((kvp_dtype_t)t), &out), 0);
        ck_assert_int_eq(out, t);
    }
    kvp_dtype_t d;
    ck_assert_int_eq(kvp_dtype_parse("BF16", &d), 0);
    ck_assert_int_eq(d, KVP_DTYPE_BF16);
    ck_assert_int_eq(kvp_dtype_parse("float16", &d), 0);
    ck_assert_int_eq(d, KVP_DTYPE_FP16);
    ck_assert_int_eq(kvp_dtype_parse("fp64", &d), KVP_EINVAL);
    ck_assert_int_eq(kvp_dtype_parse(NULL, &d), KVP_EINVAL);
    kvp_layout_t l;
    ck_assert_int_eq(kvp_layout_parse("HND", &l), 0);
    ck_assert_int_eq(l, KVP_LAYOUT_HND);
    ck_assert_int_eq(kvp_layout_parse("nhdx", &l), KVP_EINVAL);
    kvp_storage_t s;
    ck_assert_int_eq(kvp_storage_parse("split", &s), 0);
    ck_assert_int_eq(s, KVP_STORAGE_SPLIT);
    ck_assert_int_eq(kvp_storage_parse("both", &s), KVP_EINVAL);
    ck_assert_str_eq(kvp_dtype_name((kvp_dtype_t)9), "invalid");
    ck_assert_uint_eq(kvp_dtype_size(KVP_DTYPE_FP8_E5M2), 1);
    ck_assert_uint_eq(kvp_dtype_size(KVP_DTYPE_BF16), 2);
    ck_assert_uint_eq(kvp_dtype_size(KVP_DTYPE_FP32), 4);
}
END_TEST

/* Row-major index of a tensor element written out by hand from DESIGN.md §1's shapes. */
static uint64_t by_shape(const kvp_geom_t *g, uint32_t heads, uint32_t page, int kv, uint32_t slot,
                         uint32_t head)
{
    uint64_t P = g->page_size, H = heads, D = g->head_dim, N = g->num_pages;
    uint64_t inner = g->layout == KVP_LAYOUT_NHD ? (slot * H + head) * D : (head * P + slot) * D;
    if (g->storage == KVP_STORAGE_COMBINED) /* [N, 2, P, H, D] or [N, 2, H, P, D] */
        return ((uint64_t)page * 2 + kv) * P * H * D + inner;
    /* K then V, each [N, P, H, D] or [N, H, P, D] */
    return (uint64_t)kv * N * P * H * D + (uint64_t)page * P * H * D + inner;
}

START_TEST(offsets_match_the_tensor_shapes)
{
    for (int lay = 0; lay < 2; lay++)
        for (int sto = 0; sto < 2; sto++)
            for (uint32_t devs = 1; devs <= 2; devs++) {
                kvp_geom_t g = {.num_layers = 3,
                                .num_pages = 5,
                                .page_size = 3,
                                .num_kv_heads = 4,
                                .head_dim = 8,
                                .dtype = KVP_DTYPE_BF16,
                                .layout = (kvp_layout_t)lay,
                                .storage = (kvp_storage_t)sto,
                                .num_devices = devs};
                kvp_geom_derived_t d;
                ck_assert_int_eq(kvp_geom_derive(&g, &d), 0);
                uint32_t H = 4 / devs;
                ck_assert_uint_eq(d.heads, H);
                ck_assert_uint_eq(d.elem_bytes, 2);
                ck_assert_uint_eq(d.row_bytes, 16);
                ck_assert_uint_eq(d.kv_bytes, 3ull * H * 8 * 2);
                ck_assert_uint_eq(d.layer_bytes, 2ull * 5 * 3 * H * 8 * 2);
                ck_assert_uint_eq(d.pool_bytes, 3 * d.layer_bytes);
                ck_assert_uint_eq(d.token_bytes, 2ull * H * 16 * 3);
                for (uint32_t l = 0; l < 3; l++)
                    for (uint32_t p = 0; p < 5; p++)
                        for (int kv = 0; kv < 2; kv++)
                            for (uint32_t s = 0; s < 3; s++)
                                for (uint32_t h = 0; h < H; h++) {
                                    uint64_t want =
                                        l * d.layer_bytes + by_shape(&g, H, p, kv, s, h) * 2;
                                    ck_assert_uint_eq(kvp_geom_offset(&d, &g, l, p, kv, s, h),
                                                      want);
                                    /* the strides say the same thing */
                                    uint64_t via = (uint64_t)p * d.stride_page +
                                                   (uint64_t)s * d.stride_n +
                                                   (uint64_t)h * d.stride_h;
                                    ck_assert_uint_eq(kvp_geom_layer_offset(&d, l) +
                                                          (kv ? d.v_offset_bytes : 0) + via * 2,
                                                      want);
                                }
            }
}
END_TEST

START_TEST(flashinfer_strides_for_common_shapes)
{
    kvp_geom_t g = good();
    kvp_geom_derived_t d;
    ck_assert_int_eq(kvp_geom_derive(&g, &d), 0); /* NHD combined [10, 2, 16, 8, 128] */
    ck_assert_int_eq(d.stride_page, 2 * 16 * 8 * 128);
    ck_assert_int_eq(d.stride_n, 8 * 128);
    ck_assert_int_eq(d.stride_h, 128);
    ck_assert_uint_eq(d.v_offset_bytes, 16 * 8 * 128 * 2);
    g.layout = KVP_LAYOUT_HND, g.storage = KVP_STORAGE_SPLIT; /* [10, 8, 16, 128] x 2 */
    ck_assert_int_eq(kvp_geom_derive(&g, &d), 0);
    ck_assert_int_eq(d.stride_page, 8 * 16 * 128);
    ck_assert_int_eq(d.stride_n, 128);
    ck_assert_int_eq(d.stride_h, 16 * 128);
    ck_assert_uint_eq(d.v_offset_bytes, 10ull * 8 * 16 * 128 * 2);
    ck_assert_uint_eq(kvp_geom_pages_for(16, 0), 0);
    ck_assert_uint_eq(kvp_geom_pages_for(16, 16), 1);
    ck_assert_uint_eq(kvp_geom_pages_for(16, 17), 2);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("geom");
    TCase *tc = tcase_create("geom");
    tcase_add_test(tc, every_bad_field_has_its_own_error);
    tcase_add_test(tc, names_round_trip);
    tcase_add_test(tc, offsets_match_the_tensor_shapes);
    tcase_add_test(tc, flashinfer_strides_for_common_shapes);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
