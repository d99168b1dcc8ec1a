/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_alloc.c - the page allocator: order, all-or-nothing reservation, refcounts and the
 * shared counter, exhaustion and recovery, the audit catching corruption, and a long random
 * run against a model of refcounts.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_alloc.h"
#include "kvp_error.h"
#include "kvp_test_util.h"

static void audit_ok(const kvp_alloc_t *a)
{
    char msg[200] = "";
    int rc = kvp_alloc_audit(a, msg, sizeof(msg));
    ck_assert_msg(rc == 0, "audit: %s", msg);
}

START_TEST(create_rejects_bad_sizes)
{
    kvp_alloc_t *a = (kvp_alloc_t *)0x1;
    ck_assert_int_eq(kvp_alloc_create(0, &a), KVP_EINVAL);
    ck_assert_int_eq(kvp_alloc_create(0x80000000u, &a), KVP_EINVAL);
    ck_assert_int_eq(kvp_alloc_create(4, NULL), KVP_EINVAL);
    ck_assert_ptr_eq(a, (kvp_alloc_t *)0x1);
    kvp_alloc_destroy(NULL);
}
END_TEST

START_TEST(fresh_pool_hands_out_pages_in_order)
{
    kvp_alloc_t *a;
    ck_assert_int_eq(kvp_alloc_create(8, &a), 0);
    uint32_t p[8];
    ck_assert_int_eq(kvp_alloc_reserve(a, 3, p), 0);
    ck_assert_uint_eq(p[0], 0);
    ck_assert_uint_eq(p[1], 1);
    ck_assert_uint_eq(p[2], 2);
    ck_assert_uint_eq(kvp_alloc_num_free(a), 5);
    ck_assert_uint_eq(kvp_alloc_refcount(a, 1), 1);
    ck_assert_uint_eq(kvp_alloc_refcount(a, 3), 0);
    /* LIFO: the page freed last is handed out first */
    ck_assert_uint_eq(kvp_alloc_unref(a, 1), 0);
    ck_assert_int_eq(kvp_alloc_reserve(a, 1, p), 0);
    ck_assert_uint_eq(p[0], 1);
    audit_ok(a);
    kvp_alloc_destroy(a);
}
END_TEST

START_TEST(reservation_is_all_or_nothing)
{
    kvp_alloc_t *a;
    ck_assert_int_eq(kvp_alloc_create(5, &a), 0);
    uint32_t p[6] = {77, 77, 77, 77, 77, 77};
    ck_assert_int_eq(kvp_alloc_reserve(a, 6, p), KVP_ENOSPC);
    ck_assert_uint_eq(kvp_alloc_num_free(a), 5);
    ck_assert_uint_eq(p[0], 77);
    ck_assert_int_eq(kvp_alloc_reserve(a, 5, p), 0);
    ck_assert_uint_eq(kvp_alloc_num_free(a), 0);
    ck_assert_int_eq(kvp_alloc_reserve(a, 1, p + 5), KVP_ENOSPC);
    ck_assert_int_eq(kvp_alloc_reserve(a, 0, p + 5), 0);
    /* recovery once pages come back */
    kvp_alloc_unref(a, p[2]);
    kvp_alloc_unref(a, p[4]);
    ck_assert_int_eq(kvp_alloc_reserve(a, 2, p + 2), 0);
    ck_assert_uint_eq(kvp_alloc_num_free(a), 0);
    audit_ok(a);
    kvp_alloc_destroy(a);
}
END_TEST

START_TEST(refcounts_and_shared_counter)
{
    kvp_alloc_t *a;
    ck_assert_int_eq(kvp_alloc_create(4, &a), 0);
    uint32_t p;
    ck_assert_int_eq(kvp_alloc_reserve(a, 1, &p), 0);
    kvp_alloc_ref(a, p);
    kvp_alloc_ref(a, p);
    ck_assert_uint_eq(kvp_alloc_refcount(a, p), 3);
    ck_assert_uint_eq(kvp_alloc_num_shared(a), 1);
    ck_assert_uint_eq(kvp_alloc_unref(a, p), 2);
    ck_assert_uint_eq(kvp_alloc_num_shared(a), 1);
    ck_assert_uint_eq(kvp_alloc_unref(a, p), 1);
    ck_assert_uint_eq(kvp_alloc_num_shared(a), 0);
    ck_assert_uint_eq(kvp_alloc_num_free(a), 3);
    ck_assert_uint_eq(kvp_alloc_unref(a, p), 0);
    ck_assert_uint_eq(kvp_alloc_num_free(a), 4);
    ck_assert_uint_eq(kvp_alloc_refcount(a, 99), 0);
    audit_ok(a);
    kvp_alloc_destroy(a);
}
END_TEST

START_TEST(pinned_page_returns_to_the_free_stack_only_after_its_last_pin)
{
    kvp_alloc_t *a;
    ck_assert_int_eq(kvp_alloc_create(2, &a), 0);
    uint32_t p[2];
    ck_assert_int_eq(kvp_alloc_reserve(a, 2, p), 0);
    kvp_alloc_pin(a, p[0]);
    kvp_alloc_pin(a, p[0]);
    ck_assert_uint_eq(kvp_alloc_pins(a, p[0]), 2);
    ck_assert_uint_eq(kvp_alloc_unref(a, p[0]), 0);
    ck_assert_uint_eq(kvp_alloc_num_free(a), 0); /* held by its pins */
    ck_assert_uint_eq(kvp_alloc_num_pinned_free(a), 1);
    uint32_t q;
    ck_assert_int_eq(kvp_alloc_reserve(a, 1, &q), KVP_ENOSPC);
    audit_ok(a);
    kvp_alloc_unpin(a, p[0]);
    ck_assert_uint_eq(kvp_alloc_num_free(a), 0);
    kvp_alloc_unpin(a, p[0]);
    ck_assert_uint_eq(kvp_alloc_num_free(a), 1);
    ck_assert_uint_eq(kvp_alloc_num_pinned_free(a), 0);
    /* a pin on a page that stays referenced changes nothing on unpin */
    kvp_alloc_pin(a, p[1]);
    kvp_alloc_unpin(a, p[1]);
    ck_assert_uint_eq(kvp_alloc_refcount(a, p[1]), 1);
    ck_assert_uint_eq(kvp_alloc_num_free(a), 1);
    audit_ok(a);
    kvp_alloc_destroy(a);
}
END_TEST

START_TEST(audit_catches_a_corrupted_free_stack)
{
    kvp_alloc_t *a;
    ck_assert_int_eq(kvp_alloc_create(4, &a), 0);
    uint32_t p[2];
    ck_assert_int_eq(kvp_alloc_reserve(a, 2, p), 0);
    uint32_t n;
    uint32_t *stack = (uint32_t *)kvp_alloc_free_stack(a, &n);
    ck_assert_uint_eq(n, 2);
    uint32_t saved = stack[0];
    stack[0] = p[0]; /* an allocated page on the free stack */
    char msg[200] = "";
    ck_assert_int_eq(kvp_alloc_audit(a, msg, sizeof(msg)), KVP_EAUDIT);
    ck_assert_ptr_nonnull(strstr(msg, "refcount"));
    stack[0] = stack[1]; /* a page twice */
    ck_assert_int_eq(kvp_alloc_audit(a, msg, sizeof(msg)), KVP_EAUDIT);
    ck_assert_ptr_nonnull(strstr(msg, "twice"));
    stack[0] = saved;
    audit_ok(a);
    kvp_alloc_destroy(a);
}
END_TEST

START_TEST(random_run_matches_refcount_model)
{
    enum { N = 257 };
    kvp_alloc_t *a;
    ck_assert_int_eq(kvp_alloc_create(N, &a), 0);
    uint32_t model[N] = {0};
    uint32_t held[4 * N], nheld = 0; /* one entry per reference */
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(42));
    uint32_t exhausted = 0;
    for (int step = 0; step < 20000; step++) {
        uint32_t op = kvp_rng_below(&r, 3);
        if (op == 0) {
            uint32_t want = kvp_rng_below(&r, 40), got[40];
            if (nheld + want > 4 * N)
                continue;
            uint32_t free_before = kvp_alloc_num_free(a);
            int rc = kvp_alloc_reserve(a, want, got);
            if (want > free_before) {
                ck_assert_int_eq(rc, KVP_ENOSPC);
                ck_assert_uint_eq(kvp_alloc_num_free(a), free_before);
                exhausted++;
            } else {
                ck_assert_int_eq(rc, 0);
                for (uint32_t i = 0; i < want; i++) {
                    KVP_CHECK(model[got[i]] == 0, "page %u handed out while held", got[i]);
                    model[got[i]] = 1;
                    held[nheld++] = got[i];
                }
            }
        } else if (op == 1 && nheld && nheld < 4 * N) {
            uint32_t p = held[kvp_rng_below(&r, nheld)];
            kvp_alloc_ref(a, p);
            model[p]++;
            held[nheld++] = p;
        } else if (nheld) {
            uint32_t i = kvp_rng_below(&r, nheld), p = held[i];
            held[i] = held[--nheld];
            uint32_t rc = kvp_alloc_unref(a, p);
            KVP_CHECK(rc == --model[p], "unref of page %u gave %u", p, rc);
        }
        uint32_t nfree = 0, nshared = 0;
        for (uint32_t p = 0; p < N; p++) {
            KVP_CHECK(kvp_alloc_refcount(a, p) == model[p], "page %u refcount %u, model %u", p,
                      kvp_alloc_refcount(a, p), model[p]);
            nfree += model[p] == 0;
            nshared += model[p] > 1;
        }
        KVP_CHECK(kvp_alloc_num_free(a) == nfree, "free %u, model %u", kvp_alloc_num_free(a),
                  nfree);
        KVP_CHECK(kvp_alloc_num_shared(a) == nshared, "shared %u, model %u",
                  kvp_alloc_num_shared(a), nshared);
        if (step % 64 == 0)
            audit_ok(a);
    }
    ck_assert_uint_gt(exhausted, 0);
    audit_ok(a);
    kvp_alloc_destroy(a);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("alloc");
    TCase *tc = tcase_create("alloc");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, create_rejects_bad_sizes);
    tcase_add_test(tc, fresh_pool_hands_out_pages_in_order);
    tcase_add_test(tc, reservation_is_all_or_nothing);
    tcase_add_test(tc, refcounts_and_shared_counter);
    tcase_add_test(tc, pinned_page_returns_to_the_free_stack_only_after_its_last_pin);
    tcase_add_test(tc, audit_catches_a_corrupted_free_stack);
    tcase_add_test(tc, random_run_matches_refcount_model);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
