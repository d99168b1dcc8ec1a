/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_seqtab.c - the sequence table: fork shares pages, truncate frees exactly the pages no
 * longer needed, release returns them, namespaces are separate, per-namespace counters and
 * release_ns, the hash index under heavy insert/delete churn, and the audit catching each kind
 * of corruption it promises to find.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_plan.h"
#include "kvp_seqtab.h"
#include "kvp_test_util.h"

static kvp_alloc_t *A;
static kvp_seqtab_t *T;
static kvp_plan_t P;

static void setup_table(uint32_t pages, uint32_t page_size, uint32_t max_seqs)
{
    kvp_seqtab_config_t cfg = {.max_seqs = max_seqs, .max_namespaces = 3, .max_seq_tokens = 0};
    ck_assert_int_eq(kvp_alloc_create(pages, &A), 0);
    ck_assert_int_eq(kvp_seqtab_create(A, page_size, &cfg, &T), 0);
    kvp_plan_init(&P);
}

static void teardown_table(void)
{
    kvp_plan_free(&P);
    kvp_seqtab_destroy(T);
    kvp_alloc_destroy(A);
}

static void append(uint32_t ns, uint64_t id, uint32_t n)
{
    kvp_plan_item_t it = {ns, id, n};
    ck_assert_int_eq(kvp_plan_append(T, &it, 1, NULL, 0, &P), 0);
}

static void audit_ok(void)
{
    char msg[256] = "";
    int rc = kvp_seqtab_audit(T, msg, sizeof(msg));
    ck_assert_msg(rc == 0, "audit: %s", msg);
}

static void audit_fails_with(const char *needle)
{
    char msg[256] = "";
    ck_assert_int_eq(kvp_seqtab_audit(T, msg, sizeof(msg)), KVP_EAUDIT);
    ck_assert_msg(strstr(msg, needle) != NULL, "audit said '%s', expected '%s'", msg, needle);
}

START_TEST(create_rejects_bad_arguments)
{
    kvp_alloc_t *a;
    kvp_seqtab_t *t = NULL;
    ck_assert_int_eq(kvp_alloc_create(4, &a), 0);
    kvp_seqtab_config_t cfg = {.max_seqs = 0, .max_namespaces = 1};
    ck_assert_int_eq(kvp_seqtab_create(a, 4, &cfg, &t), KVP_EINVAL);
    cfg.max_seqs = 1, cfg.max_namespaces = 0;
    ck_assert_int_eq(kvp_seqtab_create(a, 4, &cfg, &t), KVP_EINVAL);
    cfg.max_namespaces = 1;
    ck_assert_int_eq(kvp_seqtab_create(a, 0, &cfg, &t), KVP_EINVAL);
    ck_assert_int_eq(kvp_seqtab_create(NULL, 4, &cfg, &t), KVP_EINVAL);
    ck_assert_ptr_null(t);
    kvp_seqtab_destroy(NULL);
    kvp_alloc_destroy(a);
}
END_TEST

START_TEST(fork_shares_every_page)
{
    setup_table(16, 4, 8);
    append(0, 1, 10);
    ck_assert_int_eq(kvp_seqtab_fork(T, 0, 1, 2, 5), 0);
    const kvp_seq_t *p = kvp_seqtab_find(T, 0, 1), *c = kvp_seqtab_find(T, 0, 2);
    ck_assert_uint_eq(c->num_tokens, 10);
    ck_assert_uint_eq(c->num_pages, 3);
    for (uint32_t i = 0; i < 3; i++) {
        ck_assert_uint_eq(c->pages[i], p->pages[i]);
        ck_assert_uint_eq(kvp_alloc_refcount(A, p->pages[i]), 2);
    }
    kvp_stats_t st;
    kvp_seqtab_stats(T, &st);
    ck_assert_uint_eq(st.used_pages, 3);
    ck_assert_uint_eq(st.shared_pages, 3);
    ck_assert_uint_eq(st.num_tokens, 20);
    ck_assert_uint_eq(st.page_refs, 6);
    ck_assert_int_eq(kvp_seqtab_fork(T, 0, 1, 2, 5), KVP_EEXIST);
    ck_assert_int_eq(kvp_seqtab_fork(T, 0, 9, 3, 5), KVP_ENOENT);
    ck_assert_int_eq(kvp_seqtab_fork(T, 1, 1, 3, 5), KVP_ENOENT); /* other namespace */
    ck_assert_int_eq(kvp_seqtab_fork(T, 3, 1, 3, 5), KVP_EINVAL);
    /* fork of an empty sequence */
    append(0, 7, 0);
    ck_assert_int_eq(kvp_seqtab_fork(T, 0, 7, 8, 5), 0);
    ck_assert_uint_eq(kvp_seqtab_find(T, 0, 8)->num_pages, 0);
    /* releasing the parent leaves the child's pages alive */
    ck_assert_int_eq(kvp_seqtab_release(T, 0, 1), 0);
    kvp_seqtab_stats(T, &st);
    ck_assert_uint_eq(st.used_pages, 3);
    ck_assert_uint_eq(st.shared_pages, 0);
    audit_ok();
    teardown_table();
}
END_TEST

START_TEST(fork_respects_limits)
{
    setup_table(16, 4, 3);
    append(0, 1, 8);
    ck_assert_int_eq(kvp_seqtab_set_ns_limits(T, 0, 0, 3), 0);
    ck_assert_int_eq(kvp_seqtab_fork(T, 0, 1, 2, 0), KVP_ELIMIT); /* 2 + 2 refs > 3 */
    ck_assert_int_eq(kvp_seqtab_set_ns_limits(T, 0, 0, 0), 0);
    ck_assert_int_eq(kvp_seqtab_fork(T, 0, 1, 2, 0), 0);
    ck_assert_int_eq(kvp_seqtab_fork(T, 0, 1, 3, 0), 0);
    ck_assert_int_eq(kvp_seqtab_fork(T, 0, 1, 4, 0), KVP_ELIMIT); /* table holds 3 */
    ck_assert_ptr_null(kvp_seqtab_find(T, 0, 4));
    audit_ok();
    teardown_table();
}
END_TEST

START_TEST(truncate_frees_exactly_the_unneeded_pages)
{
    setup_table(16, 4, 8);
    append(0, 1, 10); /* pages 0,1,2 */
    ck_assert_int_eq(kvp_seqtab_truncate(T, 0, 1, 11, 0), KVP_ERANGE);
    ck_assert_int_eq(kvp_seqtab_truncate(T, 0, 1, 9, 0), 0); /* still 3 pages */
    ck_assert_uint_eq(kvp_alloc_num_free(A), 13);
    ck_assert_int_eq(kvp_seqtab_truncate(T, 0, 1, 8, 0), 0); /* 2 pages */
    ck_assert_uint_eq(kvp_alloc_num_free(A), 14);
    ck_assert_uint_eq(kvp_seqtab_find(T, 0, 1)->num_pages, 2);
    ck_assert_int_eq(kvp_seqtab_truncate(T, 0, 1, 0, 0), 0);
    ck_assert_uint_eq(kvp_alloc_num_free(A), 16);
    ck_assert_ptr_nonnull(kvp_seqtab_find(T, 0, 1)); /* still exists, empty */
    ck_assert_int_eq(kvp_seqtab_truncate(T, 0, 2, 0, 0), KVP_ENOENT);
    /* truncating a forked sequence drops only its own references */
    append(0, 1, 12);
    ck_assert_int_eq(kvp_seqtab_fork(T, 0, 1, 2, 0), 0);
    ck_assert_int_eq(kvp_seqtab_truncate(T, 0, 2, 1, 0), 0);
    ck_assert_uint_eq(kvp_alloc_num_free(A), 13);
    const kvp_seq_t *p = kvp_seqtab_find(T, 0, 1);
    ck_assert_uint_eq(kvp_alloc_refcount(A, p->pages[0]), 2);
    ck_assert_uint_eq(kvp_alloc_refcount(A, p->pages[1]), 1);
    audit_ok();
    teardown_table();
}
END_TEST

START_TEST(namespaces_are_separate_and_release_ns_drops_one)
{
    setup_table(32, 4, 16);
    append(0, 1, 5);
    append(1, 1, 6);
    append(1, 2, 7);
    append(2, 1, 1);
    ck_assert_uint_eq(kvp_seqtab_find(T, 0, 1)->num_tokens, 5);
    ck_assert_uint_eq(kvp_seqtab_find(T, 1, 1)->num_tokens, 6);
    kvp_ns_stats_t ns;
    ck_assert_int_eq(kvp_seqtab_ns_stats(T, 1, &ns), 0);
    ck_assert_uint_eq(ns.num_seqs, 2);
    ck_assert_uint_eq(ns.num_tokens, 13);
    ck_assert_uint_eq(ns.page_refs, 4);
    ck_assert_int_eq(kvp_seqtab_ns_stats(T, 3, &ns), KVP_EINVAL);
    ck_assert_uint_eq(kvp_seqtab_release_ns(T, 1), 2);
    ck_assert_uint_eq(kvp_seqtab_release_ns(T, 1), 0);
    ck_assert_ptr_null(kvp_seqtab_find(T, 1, 2));
    ck_assert_ptr_nonnull(kvp_seqtab_find(T, 0, 1));
    ck_assert_ptr_nonnull(kvp_seqtab_find(T, 2, 1));
    kvp_stats_t st;
    kvp_seqtab_stats(T, &st);
    ck_assert_uint_eq(st.num_seqs, 2);
    ck_assert_uint_eq(st.num_tokens, 6);
    ck_assert_uint_eq(st.used_pages, 3);
    ck_assert_int_eq(kvp_seqtab_release(T, 0, 1), 0);
    ck_assert_int_eq(kvp_seqtab_release(T, 0, 1), KVP_ENOENT);
    ck_assert_int_eq(kvp_seqtab_release(T, 9, 1), KVP_EINVAL);
    /* iteration visits exactly the live sequences */
    uint32_t cur = 0, n = 0;
    const kvp_seq_t *s;
    while ((s = kvp_seqtab_next(T, &cur))) {
        ck_assert_uint_eq(s->ns, 2);
        n++;
    }
    ck_assert_uint_eq(n, 1);
    audit_ok();
    teardown_table();
}
END_TEST

START_TEST(hash_index_survives_churn)
{
    enum { MAXS = 500 };
    setup_table(64, 64, MAXS);
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(7));
    static uint64_t ids[MAXS];
    static uint8_t live[MAXS];
    for (int step = 0; step < 40000; step++) {
        uint32_t i = kvp_rng_below(&r, MAXS);
        if (!live[i]) {
            /* ids clustered so probes collide: small range, many namespaces of keys */
            ids[i] = kvp_rng_below(&r, 1u << 20) * 1024u;
            if (kvp_seqtab_find(T, i % 3, ids[i]))
                continue;
            append(i % 3, ids[i], 0);
            live[i] = 1;
        } else {
            ck_assert_int_eq(kvp_seqtab_release(T, i % 3, ids[i]), 0);
            live[i] = 0;
        }
        if (step % 1000 == 0) {
            for (uint32_t j = 0; j < MAXS; j++)
                if (live[j])
                    ck_assert_ptr_nonnull(kvp_seqtab_find(T, j % 3, ids[j]));
            audit_ok();
        }
    }
    audit_ok();
    teardown_table();
}
END_TEST

START_TEST(audit_finds_each_kind_of_corruption)
{
    setup_table(16, 4, 8);
    append(0, 1, 6);
    append(0, 2, 3);
    audit_ok();
    kvp_seq_t *s = kvp_seqtab_find(T, 0, 1);
    /* length disagrees with the page count */
    s->num_tokens = 9;
    audit_fails_with("pages for 9 tokens");
    s->num_tokens = 6;
    /* a page named twice in one sequence */
    uint32_t saved = s->pages[1];
    kvp_alloc_ref(A, s->pages[0]);
    s->pages[1] = s->pages[0];
    audit_fails_with("twice");
    s->pages[1] = saved;
    kvp_alloc_unref(A, s->pages[0]);
    audit_ok();
    /* refcount disagrees with the page vectors */
    kvp_alloc_ref(A, s->pages[0]);
    audit_fails_with("refcount 2 but 1");
    kvp_alloc_unref(A, s->pages[0]);
    /* a free page referenced by a sequence */
    saved = s->pages[1];
    s->pages[1] = 15;
    audit_fails_with("is free");
    s->pages[1] = saved;
    audit_ok();
    teardown_table();
}
END_TEST

/* Namespaces 0 and 2 in one tenant group with a quota of 3 (what the daemon does for one uid's
 * namespaces, limits.uid_max_seqs): the quota counts both, namespace 1 is not held to it, a
 * release makes room, and moving a namespace carries its sequences' count. */
START_TEST(a_tenant_group_shares_one_sequence_quota)
{
    setup_table(64, 4, 32);
    kvp_plan_item_t it;
    ck_assert_int_eq(kvp_seqtab_set_ns_group(T, 2, 0), 0);
    ck_assert_int_eq(kvp_seqtab_set_group_limit(T, 0, 3), 0);
    append(0, 1, 1);
    append(0, 2, 1);
    append(2, 1, 1);
    ck_assert_uint_eq(kvp_seqtab_group_seqs(T, 0), 3);
    it = (kvp_plan_item_t){2, 2, 1};
    ck_assert_int_eq(kvp_plan_append(T, &it, 1, NULL, 0, &P), KVP_ELIMIT);
    it = (kvp_plan_item_t){0, 3, 1};
    ck_assert_int_eq(kvp_plan_append(T, &it, 1, NULL, 0, &P), KVP_ELIMIT);
    ck_assert_int_eq(kvp_seqtab_fork(T, 0, 1, 9, 0), KVP_ELIMIT);
    append(1, 1, 1); /* another group */
    append(1, 2, 1);
    append(0, 1, 1); /* growing a sequence is not creating one */
    audit_ok();
    ck_assert_int_eq(kvp_seqtab_release(T, 0, 2), 0);
    ck_assert_uint_eq(kvp_seqtab_group_seqs(T, 0), 2);
    append(2, 2, 1);
    /* namespace 2 (2 sequences) leaves for group 2: group 0 keeps namespace 0's one */
    ck_assert_int_eq(kvp_seqtab_set_ns_group(T, 2, 2), 0);
    ck_assert_uint_eq(kvp_seqtab_group_seqs(T, 0), 1);
    ck_assert_uint_eq(kvp_seqtab_group_seqs(T, 2), 2);
    audit_ok();
    ck_assert_int_eq(kvp_seqtab_set_ns_group(T, 3, 0), KVP_EINVAL);
    ck_assert_int_eq(kvp_seqtab_set_group_limit(T, 3, 1), KVP_EINVAL);
    teardown_table();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("seqtab");
    TCase *tc = tcase_create("seqtab");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, create_rejects_bad_arguments);
    tcase_add_test(tc, fork_shares_every_page);
    tcase_add_test(tc, fork_respects_limits);
    tcase_add_test(tc, truncate_frees_exactly_the_unneeded_pages);
    tcase_add_test(tc, namespaces_are_separate_and_release_ns_drops_one);
    tcase_add_test(tc, hash_index_survives_churn);
    tcase_add_test(tc, audit_finds_each_kind_of_corruption);
    tcase_add_test(tc, a_tenant_group_shares_one_sequence_quota);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
