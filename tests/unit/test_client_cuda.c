/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_client_cuda.c - the host-side argument checks of kvpool.h's kvp_client_cuda_append_fused,
 * without a GPU: every refused argument returns KVP_EINVAL before anything is queued and
 * leaves its reason in kvp_last_cuda_error(); nnz = 0 queues nothing (0 with CUDA), and a
 * build without CUDA answers KVP_EUNAVAIL to well-formed calls. No call here ever reaches a
 * kernel launch: the pointers are host memory, so a CUDA build is only given calls it refuses
 * or nnz = 0 (the GPU side is tests/python/test_torch.py's).
 */
#include <check.h>
#include <stdint.h>
#include <string.h>

#include "kvpool.h"

#define WHO "kvp_client_cuda_append_fused: "

static _Alignas(16) uint8_t mem[4096];
static int32_t indptr[3] = {0, 1, 2}, indices[2] = {0, 1}, last[2] = {1, 1}, aip[3] = {0, 1, 2};

/* A well-formed one-layer description: 8 pages of 4 slots, 2 heads of 8 fp16 (16-byte rows),
 * NHD strides; two requests of one token each. */
static kvp_paged_kv_t kv_ok(void)
{
    kvp_paged_kv_t kv;
    memset(&kv, 0, sizeof(kv));
    kv.k_data = mem;
    kv.v_data = mem + 1024;
    kv.elem_bytes = 2;
    kv.num_pages = 8;
    kv.page_size = 4;
    kv.num_heads = 2;
    kv.head_dim = 8;
    kv.stride_page = 4 * 2 * 8;
    kv.stride_n = 2 * 8;
    kv.stride_h = 8;
    kv.batch_size = 2;
    kv.kv_indptr = indptr;
    kv.kv_indices = indices;
    kv.kv_last_page_len = last;
    return kv;
}

static kvp_append_src_t src_ok(void)
{
    kvp_append_src_t s;
    memset(&s, 0, sizeof(s));
    s.key = mem + 2048;
    s.value = mem + 3072;
    s.k_stride_n = s.v_stride_n = 16;
    s.k_stride_h = s.v_stride_h = 8;
    return s;
}

/* The record must be exactly "client/kvp_client_fused.c:<line> kvp_client_cuda_append_fused:
 * <reason>". */
static void assert_record(const char *reason)
{
    const char *r = kvp_last_cuda_error();
    const char *prefix = "client/kvp_client_fused.c:";
    ck_assert_msg(strncmp(r, prefix, strlen(prefix)) == 0, "record '%s'", r);
    const char *who = strstr(r, " " WHO);
    ck_assert_msg(who != NULL, "record '%s'", r);
    for (const char *d = r + strlen(prefix); d < who; d++)
        ck_assert_msg(*d >= '0' && *d <= '9', "record '%s'", r);
    ck_assert_str_eq(who + 1 + strlen(WHO), reason);
}

static int call(const kvp_paged_kv_t *kv, const kvp_append_src_t *src, const int32_t *a,
                uint32_t nnz, unsigned flags)
{
    kvp_clear_cuda_error();
    return kvp_client_cuda_append_fused(kv, src, a, nnz, NULL, flags, NULL);
}

static void refused(const kvp_paged_kv_t *kv, const kvp_append_src_t *src, const int32_t *a,
                    uint32_t nnz, unsigned flags, const char *reason)
{
    ck_assert_int_eq(call(kv, src, a, nnz, flags), KVP_EINVAL);
    assert_record(reason);
}

START_TEST(test_fused_refuses_flags_and_null_structs_whatever_nnz)
{
    kvp_paged_kv_t kv = kv_ok();
    kvp_append_src_t src = src_ok();
    for (uint32_t nnz = 0; nnz <= 2; nnz += 2) {
        refused(&kv, &src, aip, nnz, 2u, "unknown flag");
        refused(&kv, &src, aip, nnz, KVP_CLIENT_CUDA_APPEND_PDL | 0x80u, "unknown flag");
        refused(NULL, &src, aip, nnz, 0, "NULL kv or src");
        refused(&kv, NULL, aip, nnz, KVP_CLIENT_CUDA_APPEND_PDL, "NULL kv or src");
    }
    ck_assert_int_eq(KVP_CLIENT_CUDA_APPEND_PDL, 1);
}
END_TEST

START_TEST(test_fused_refuses_null_arrays_and_pointers)
{
    kvp_append_src_t src = src_ok();
    kvp_paged_kv_t kv = kv_ok();
    const char *arrays = "NULL append_indptr or page-table array";
    refused(&kv, &src, NULL, 2, 0, arrays);
    kv.kv_indptr = NULL;
    refused(&kv, &src, aip, 2, 0, arrays);
    kv = kv_ok();
    kv.kv_indices = NULL;
    refused(&kv, &src, aip, 2, 0, arrays);
    kv = kv_ok();
    kv.kv_last_page_len = NULL;
    refused(&kv, &src, aip, 2, KVP_CLIENT_CUDA_APPEND_PDL, arrays);

    const char *ptrs = "NULL cache or source pointer";
    kv = kv_ok();
    kv.k_data = NULL;
    refused(&kv, &src, aip, 2, 0, ptrs);
    kv = kv_ok();
    kv.v_data = NULL;
    refused(&kv, &src, aip, 2, 0, ptrs);
    kv = kv_ok();
    src.key = NULL;
    refused(&kv, &src, aip, 2, 0, ptrs);
    src = src_ok();
    src.value = NULL;
    refused(&kv, &src, aip, 2, 0, ptrs);
}
END_TEST

START_TEST(test_fused_refuses_sizes)
{
    kvp_append_src_t src = src_ok();
    kvp_paged_kv_t kv = kv_ok();
    kv.batch_size = 0;
    refused(&kv, &src, aip, 2, 0, "tokens to append but batch_size 0");
    kv = kv_ok();
    const char *big = "nnz or batch_size above INT32_MAX (int32 page table)";
    refused(&kv, &src, aip, (uint32_t)INT32_MAX + 1u, 0, big);
    kv.batch_size = (uint32_t)INT32_MAX + 1u;
    refused(&kv, &src, aip, 2, 0, big);

    kv = kv_ok();
    kv.elem_bytes = 3;
    refused(&kv, &src, aip, 2, 0, "elem_bytes must be 1, 2 or 4");
    kv.elem_bytes = 8;
    refused(&kv, &src, aip, 2, 0, "elem_bytes must be 1, 2 or 4");
    const char *zero = "num_pages, page_size, num_heads and head_dim must be non-zero";
    kv = kv_ok();
    kv.num_pages = 0;
    refused(&kv, &src, aip, 2, 0, zero);
    kv = kv_ok();
    kv.page_size = 0;
    refused(&kv, &src, aip, 2, 0, zero);
    kv = kv_ok();
    kv.num_heads = 0;
    refused(&kv, &src, aip, 2, 0, zero);
    kv = kv_ok();
    kv.head_dim = 0;
    refused(&kv, &src, aip, 2, 0, zero);
    kv = kv_ok();
    kv.head_dim = 4; /* 8-byte rows */
    refused(&kv, &src, aip, 2, 0, "rows (head_dim * elem_bytes) must be multiples of 16 bytes");
}
END_TEST

START_TEST(test_fused_refuses_alignment_and_strides)
{
    kvp_append_src_t src = src_ok();
    kvp_paged_kv_t kv = kv_ok();
    const char *align = "cache and source pointers must be 16-byte aligned";
    kv.k_data = mem + 8;
    refused(&kv, &src, aip, 2, 0, align);
    kv = kv_ok();
    kv.v_data = mem + 1032;
    refused(&kv, &src, aip, 2, 0, align);
    kv = kv_ok();
    src.key = mem + 2050;
    refused(&kv, &src, aip, 2, 0, align);
    src = src_ok();
    src.value = mem + 3073;
    refused(&kv, &src, aip, 2, 0, align);
    src = src_ok();

    const char *strides = "strides must be non-negative and 16-byte multiples";
    int64_t *fields[] = {&kv.stride_page, &kv.stride_n,    &kv.stride_h,   &src.k_stride_n,
                         &src.k_stride_h, &src.v_stride_n, &src.v_stride_h};
    const int64_t bad[] = {-8, 4, INT64_MAX / 2};
    for (size_t f = 0; f < sizeof(fields) / sizeof(fields[0]); f++) {
        for (size_t b = 0; b < sizeof(bad) / sizeof(bad[0]); b++) {
            kv = kv_ok();
            src = src_ok();
            *fields[f] = bad[b];
            refused(&kv, &src, aip, 2, 0, strides);
        }
    }
#ifndef KVP_HAVE_CUDA
    /* a zero source stride (one row broadcast to every token) passes the checks */
    kv = kv_ok();
    src = src_ok();
    src.k_stride_n = src.v_stride_n = 0;
    ck_assert_int_eq(call(&kv, &src, aip, 2, 0), KVP_EUNAVAIL);
    assert_record("libkvpool was built without CUDA");
#endif
}
END_TEST

START_TEST(test_fused_nnz_zero_queues_nothing)
{
    kvp_paged_kv_t kv = kv_ok();
    kvp_append_src_t src = src_ok();
    /* nnz = 0 needs no arrays: nothing would read them */
    kv.kv_indptr = kv.kv_indices = kv.kv_last_page_len = NULL;
    kv.batch_size = 0;
    for (unsigned flags = 0; flags <= KVP_CLIENT_CUDA_APPEND_PDL; flags++) {
        int rc = call(&kv, &src, NULL, 0, flags);
#ifdef KVP_HAVE_CUDA
        ck_assert_int_eq(rc, 0);
        ck_assert_str_eq(kvp_last_cuda_error(), "");
#else
        ck_assert_int_eq(rc, KVP_EUNAVAIL);
        assert_record("libkvpool was built without CUDA");
#endif
    }
}
END_TEST

#ifndef KVP_HAVE_CUDA
/* Without CUDA a well-formed call gets KVP_EUNAVAIL (never 0: nothing was appended). */
START_TEST(test_fused_without_cuda_is_unavailable)
{
    kvp_paged_kv_t kv = kv_ok();
    kvp_append_src_t src = src_ok();
    ck_assert_int_eq(call(&kv, &src, aip, 2, 0), KVP_EUNAVAIL);
    assert_record("libkvpool was built without CUDA");
    ck_assert_int_eq(call(&kv, &src, aip, 2, KVP_CLIENT_CUDA_APPEND_PDL), KVP_EUNAVAIL);
    assert_record("libkvpool was built without CUDA");
    /* the arguments are still checked first */
    refused(&kv, &src, NULL, 2, 0, "NULL append_indptr or page-table array");
}
END_TEST
#endif

int main(void)
{
    Suite *s = suite_create("client_cuda");
    TCase *tc = tcase_create("append_fused");
    tcase_add_test(tc, test_fused_refuses_flags_and_null_structs_whatever_nnz);
    tcase_add_test(tc, test_fused_refuses_null_arrays_and_pointers);
    tcase_add_test(tc, test_fused_refuses_sizes);
    tcase_add_test(tc, test_fused_refuses_alignment_and_strides);
    tcase_add_test(tc, test_fused_nnz_zero_queues_nothing);
#ifndef KVP_HAVE_CUDA
    tcase_add_test(tc, test_fused_without_cuda_is_unavailable);
#endif
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
