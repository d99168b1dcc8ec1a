/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_dedup.c - the retry windows (server/kvp_dedup.h): what a window remembers and for how
 * long, which slot a new id takes, the byte budgets per namespace and for the daemon (oldest
 * answer first, its id left as not kept), reloads, and the accounting under random traffic.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_dedup.h"
#include "kvp_error.h"
#include "kvp_test_util.h"

static kvp_dedup_t D;

static void init(uint32_t max_ns, uint32_t window, uint32_t entry, uint64_t ns_max, uint64_t max)
{
    kvp_dedup_limits_t lim = {
        .window = window, .max_entry_bytes = entry, .ns_max_bytes = ns_max, .max_bytes = max};
    ck_assert_int_eq(kvp_dedup_init(&D, max_ns, &lim), 0);
    for (uint32_t i = 0; i < max_ns; i++)
        ck_assert_int_eq(kvp_dedup_open(&D, i), 0);
}

static int state(uint32_t ns, uint64_t id)
{
    const kvp_dedup_entry_t *e = kvp_dedup_find(&D, ns, id);
    return e ? e->state : KVP_DEDUP_FREE;
}

/* begin + answer with a frame of len bytes, each byte = id */
static void answered(uint32_t ns, uint64_t id, uint32_t len)
{
    uint8_t frame[64];
    memset(frame, (int)(id & 0xff), sizeof(frame));
    ck_assert_int_eq(kvp_dedup_begin(&D, ns, id, 7, id * 3), 0);
    kvp_dedup_answer(&D, ns, id, frame, len);
}

START_TEST(an_answer_is_kept_with_its_call_and_digest)
{
    init(1, 8, 16, 1000, 1000);
    ck_assert_ptr_null(kvp_dedup_find(&D, 0, 5));
    ck_assert_int_eq(kvp_dedup_begin(&D, 0, 5, 3, 0xabc), 0);
    ck_assert_int_eq(state(0, 5), KVP_DEDUP_IN_FLIGHT);
    const uint8_t frame[4] = {1, 2, 3, 4};
    kvp_dedup_answer(&D, 0, 5, frame, 4);
    const kvp_dedup_entry_t *e = kvp_dedup_find(&D, 0, 5);
    ck_assert_int_eq(e->state, KVP_DEDUP_KEPT);
    ck_assert_uint_eq(e->call, 3);
    ck_assert_uint_eq(e->digest, 0xabc);
    ck_assert_uint_eq(e->len, 4);
    ck_assert_int_eq(memcmp(e->frame, frame, 4), 0);
    ck_assert_uint_eq(D.bytes, 4);
    ck_assert_uint_eq(D.w[0].bytes, 4);
    /* a second answer of the same id changes nothing */
    const uint8_t other[2] = {9, 9};
    kvp_dedup_answer(&D, 0, 5, other, 2);
    ck_assert_uint_eq(kvp_dedup_find(&D, 0, 5)->len, 4);
    /* too large to keep: applied, not kept */
    uint8_t big[17] = {0};
    ck_assert_int_eq(kvp_dedup_begin(&D, 0, 6, 3, 0), 0);
    kvp_dedup_answer(&D, 0, 6, big, 17);
    ck_assert_int_eq(state(0, 6), KVP_DEDUP_NOT_KEPT);
    /* lost answer (NULL frame): not kept either */
    ck_assert_int_eq(kvp_dedup_begin(&D, 0, 7, 3, 0), 0);
    kvp_dedup_answer(&D, 0, 7, NULL, 0);
    ck_assert_int_eq(state(0, 7), KVP_DEDUP_NOT_KEPT);
    /* a failed call's id leaves the window */
    ck_assert_int_eq(kvp_dedup_begin(&D, 0, 8, 3, 0), 0);
    kvp_dedup_forget(&D, 0, 8);
    ck_assert_ptr_null(kvp_dedup_find(&D, 0, 8));
    ck_assert_uint_eq(D.w[0].entries, 3);
    /* id 0 and unknown namespaces are never remembered */
    ck_assert_int_eq(kvp_dedup_begin(&D, 0, 0, 3, 0), KVP_EINVAL);
    ck_assert_int_eq(kvp_dedup_begin(&D, 1, 9, 3, 0), KVP_EINVAL);
    ck_assert_ptr_null(kvp_dedup_find(&D, 1, 5));
    kvp_dedup_free(&D);
}
END_TEST

START_TEST(the_window_forgets_its_oldest_id_and_skips_ids_in_flight)
{
    init(1, 4, 16, 1000, 1000);
    for (uint64_t id = 1; id <= 5; id++)
        answered(0, id, 2);
    ck_assert_int_eq(state(0, 1), KVP_DEDUP_FREE);
    for (uint64_t id = 2; id <= 5; id++)
        ck_assert_int_eq(state(0, id), KVP_DEDUP_KEPT);
    ck_assert_uint_eq(D.bytes, 8);
    kvp_dedup_free(&D);

    init(1, 2, 16, 1000, 1000);
    ck_assert_int_eq(kvp_dedup_begin(&D, 0, 1, 1, 0), 0); /* stays in flight */
    answered(0, 2, 2);
    answered(0, 3, 2); /* takes 2's slot, not 1's */
    ck_assert_int_eq(state(0, 1), KVP_DEDUP_IN_FLIGHT);
    ck_assert_int_eq(state(0, 2), KVP_DEDUP_FREE);
    ck_assert_int_eq(state(0, 3), KVP_DEDUP_KEPT);
    ck_assert_int_eq(kvp_dedup_begin(&D, 0, 4, 1, 0), 0);         /* 3's slot */
    ck_assert_int_eq(kvp_dedup_begin(&D, 0, 5, 1, 0), KVP_EBUSY); /* all in flight */
    ck_assert_int_eq(state(0, 3), KVP_DEDUP_FREE);
    ck_assert_uint_eq(D.bytes, 0);
    kvp_dedup_free(&D);
}
END_TEST

START_TEST(byte_budgets_evict_the_oldest_answer_of_the_namespace_then_of_the_daemon)
{
    init(2, 16, 16, 10, 14);
    answered(0, 1, 4);
    answered(0, 2, 4);
    answered(0, 3, 4); /* namespace 0 at 12 > 10: id 1 gives way */
    ck_assert_int_eq(state(0, 1), KVP_DEDUP_NOT_KEPT);
    ck_assert_int_eq(state(0, 2), KVP_DEDUP_KEPT);
    ck_assert_uint_eq(D.w[0].bytes, 8);
    answered(1, 1, 4); /* daemon at 12 */
    answered(1, 2, 4); /* daemon at 16 > 14: the oldest of all (ns 0, id 2) gives way */
    ck_assert_int_eq(state(0, 2), KVP_DEDUP_NOT_KEPT);
    ck_assert_int_eq(state(0, 3), KVP_DEDUP_KEPT);
    ck_assert_int_eq(state(1, 1), KVP_DEDUP_KEPT);
    ck_assert_uint_eq(D.bytes, 12);
    ck_assert_uint_eq(D.evictions_total, 2);
    /* a reload to smaller budgets evicts at once */
    kvp_dedup_set_budgets(&D, 4, 4);
    ck_assert_uint_le(D.bytes, 4);
    ck_assert_int_eq(state(1, 2), KVP_DEDUP_KEPT);
    ck_assert_int_eq(state(0, 3), KVP_DEDUP_NOT_KEPT);
    /* an answer above a budget is never kept */
    answered(1, 3, 5);
    ck_assert_int_eq(state(1, 3), KVP_DEDUP_NOT_KEPT);
    ck_assert_int_eq(state(1, 2), KVP_DEDUP_KEPT);
    /* closing a namespace returns its bytes */
    kvp_dedup_close(&D, 1);
    ck_assert_uint_eq(D.bytes, 0);
    ck_assert_ptr_null(kvp_dedup_find(&D, 1, 2));
    kvp_dedup_free(&D);
}
END_TEST

/* Random traffic over three namespaces: after every step the byte counts equal the kept
 * answers, stay inside both budgets, and every kept frame still holds its id's bytes. */
START_TEST(accounting_holds_under_random_traffic)
{
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(1414));
    init(3, 32, 48, 200, 400);
    for (int step = 0; step < 20000; step++) {
        uint32_t ns = kvp_rng_below(&rng, 3);
        uint64_t id = 1 + kvp_rng_below(&rng, 100);
        const kvp_dedup_entry_t *e = kvp_dedup_find(&D, ns, id);
        if (!e) {
            if (kvp_dedup_begin(&D, ns, id, 1, 0) == 0 && kvp_rng_below(&rng, 8) == 0)
                kvp_dedup_forget(&D, ns, id);
            else
                kvp_dedup_answer(&D, ns, id, (uint8_t[64]){0}, 1 + kvp_rng_below(&rng, 60));
        }
        if (kvp_rng_below(&rng, 500) == 0)
            kvp_dedup_set_budgets(&D, 50 + kvp_rng_below(&rng, 200),
                                  100 + kvp_rng_below(&rng, 400));
        /* plain checks, one assertion per step (a Check assertion costs a pipe write) */
        uint64_t all = 0;
        int bad = 0;
        for (uint32_t n = 0; n < 3; n++) {
            uint64_t sum = 0;
            uint32_t used = 0;
            for (uint32_t i = 0; i < 32; i++) {
                const kvp_dedup_entry_t *x = &D.w[n].ring[i];
                used += x->state != KVP_DEDUP_FREE;
                if (x->state == KVP_DEDUP_KEPT) {
                    sum += x->len;
                    bad |= kvp_dedup_find(&D, n, x->req_id) != x;
                } else {
                    bad |= x->frame != NULL;
                }
            }
            bad |= sum != D.w[n].bytes || sum > D.lim.ns_max_bytes || used != D.w[n].entries;
            all += sum;
        }
        bad |= all != D.bytes || all > D.lim.max_bytes;
        ck_assert_msg(!bad, "accounting broken at step %d", step);
    }
    kvp_dedup_free(&D);
}
END_TEST

START_TEST(the_digest_tells_requests_apart)
{
    uint8_t a[37], b[37];
    for (int i = 0; i < 37; i++)
        a[i] = b[i] = (uint8_t)(i * 7);
    ck_assert_uint_eq(kvp_dedup_digest(a, 37), kvp_dedup_digest(b, 37));
    b[36] ^= 1; /* the tail */
    ck_assert_uint_ne(kvp_dedup_digest(a, 37), kvp_dedup_digest(b, 37));
    b[36] ^= 1;
    b[3] ^= 0x80; /* a word */
    ck_assert_uint_ne(kvp_dedup_digest(a, 37), kvp_dedup_digest(b, 37));
    ck_assert_uint_ne(kvp_dedup_digest(a, 36), kvp_dedup_digest(a, 37));
    ck_assert_uint_eq(kvp_dedup_digest(NULL, 0), kvp_dedup_digest(a, 0));
}
END_TEST

int main(void)
{
    Suite *s = suite_create("dedup");
    TCase *tc = tcase_create("dedup");
    tcase_add_test(tc, an_answer_is_kept_with_its_call_and_digest);
    tcase_add_test(tc, the_window_forgets_its_oldest_id_and_skips_ids_in_flight);
    tcase_add_test(tc, byte_budgets_evict_the_oldest_answer_of_the_namespace_then_of_the_daemon);
    tcase_add_test(tc, accounting_holds_under_random_traffic);
    tcase_add_test(tc, the_digest_tells_requests_apart);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
