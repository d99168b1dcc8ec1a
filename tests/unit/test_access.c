/* SPDX-License-Identifier: Apache-2.0 */
/* test_access.c - the connection and pool-memory policies of [access] (server/kvp_access.h). */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_access.h"
#include "kvp_error.h"

static const kvp_access_t DEFAULT = {.self_uid = 500, .socket_gid = 600};

START_TEST(root_and_the_daemons_uid_may_always_connect)
{
    kvp_access_t listed = DEFAULT;
    listed.num_uids = 1;
    listed.uids[0] = 1000;
    uint32_t g = 12345;
    ck_assert_int_eq(kvp_access_check(&DEFAULT, 0, &g, 1), 0);
    ck_assert_int_eq(kvp_access_check(&DEFAULT, 500, &g, 1), 0);
    ck_assert_int_eq(kvp_access_check(&listed, 0, NULL, 0), 0);
    ck_assert_int_eq(kvp_access_check(&listed, 500, NULL, 0), 0);
}
END_TEST

START_TEST(by_default_the_socket_group_decides)
{
    uint32_t in[] = {100, 600}, out[] = {100, 601};
    ck_assert_int_eq(kvp_access_check(&DEFAULT, 1000, in, 2), 0); /* supplementary group */
    ck_assert_int_eq(kvp_access_check(&DEFAULT, 1000, in + 1, 1), 0);
    ck_assert_int_eq(kvp_access_check(&DEFAULT, 1000, out, 2), KVP_EPERM);
    ck_assert_int_eq(kvp_access_check(&DEFAULT, 1000, NULL, 0), KVP_EPERM);
}
END_TEST

START_TEST(lists_replace_the_socket_group)
{
    kvp_access_t a = DEFAULT;
    a.num_uids = 2;
    a.uids[0] = 1000;
    a.uids[1] = 1001;
    a.num_gids = 1;
    a.gids[0] = 50;
    uint32_t sock[] = {600}, g50[] = {7, 50}, other[] = {7};
    ck_assert_int_eq(kvp_access_check(&a, 1001, other, 1), 0);
    ck_assert_int_eq(kvp_access_check(&a, 2000, g50, 2), 0);
    ck_assert_int_eq(kvp_access_check(&a, 2000, other, 1), KVP_EPERM);
    ck_assert_int_eq(kvp_access_check(&a, 2000, sock, 1), KVP_EPERM); /* no longer enough */
    a.num_gids = 0;                                                   /* uids only */
    ck_assert_int_eq(kvp_access_check(&a, 2000, g50, 2), KVP_EPERM);
    ck_assert_int_eq(kvp_access_check(&a, 1000, NULL, 0), 0);
}
END_TEST

/* access.pool_uids / pool_gids: who may receive the pool fds (issue #15 defect 11) */
/* access.cache_scopes: a shared scope may not take the forms KV events give private
 * ("ns:<namespace>") and unlisted ("uid:<uid>:<name>") scopes (issue #29): their blocks' hashes
 * would be the same scope's to a router. */
START_TEST(shared_scope_names_leave_the_private_forms_alone)
{
    kvp_scope_access_t a;
    char why[160];
    ck_assert_int_eq(kvp_access_scopes_parse("team=1000,1001;rag.v2=7", &a, why, sizeof(why)), 0);
    ck_assert_uint_eq(a.count, 2);
    ck_assert_str_eq(a.scopes[0].name, "team");
    ck_assert_str_eq(a.scopes[1].name, "rag.v2");
    const char *bad[] = {"ns:engine-a=1000", "uid:1000:team=1000", "ok=1;uid:=2"};
    for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        why[0] = 0;
        ck_assert_int_eq(kvp_access_scopes_parse(bad[i], &a, why, sizeof(why)), KVP_EINVAL);
        ck_assert_msg(strstr(why, "begin the names of private and unlisted scopes"), "%s: %s",
                      bad[i], why);
    }
    /* "uid" and "ns" alone, or later in a name, are names like any other */
    ck_assert_int_eq(kvp_access_scopes_parse("uid=1;ns=2;a:uid:b=3", &a, why, sizeof(why)), 0);
    ck_assert_uint_eq(a.count, 3);
}
END_TEST

START_TEST(pool_memory_goes_to_everyone_by_default_else_to_the_listed)
{
    kvp_pool_access_t p = {.self_uid = 500};
    ck_assert_int_eq(kvp_access_pool_check(&p, 2000, 2000), 0); /* one trust domain */
    p.num_uids = 1;
    p.uids[0] = 1000;
    ck_assert_int_eq(kvp_access_pool_check(&p, 1000, 7), 0);
    ck_assert_int_eq(kvp_access_pool_check(&p, 2000, 2000), KVP_EPERM);
    ck_assert_int_eq(kvp_access_pool_check(&p, 0, 0), 0);     /* root */
    ck_assert_int_eq(kvp_access_pool_check(&p, 500, 500), 0); /* the daemon's uid */
    p.num_gids = 1;
    p.gids[0] = 44;
    ck_assert_int_eq(kvp_access_pool_check(&p, 2000, 44), 0); /* by primary gid */
    ck_assert_int_eq(kvp_access_pool_check(&p, 2000, 45), KVP_EPERM);
    p.num_uids = 0; /* gids only */
    ck_assert_int_eq(kvp_access_pool_check(&p, 1000, 7), KVP_EPERM);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("access");
    TCase *tc = tcase_create("access");
    tcase_add_test(tc, root_and_the_daemons_uid_may_always_connect);
    tcase_add_test(tc, by_default_the_socket_group_decides);
    tcase_add_test(tc, lists_replace_the_socket_group);
    tcase_add_test(tc, pool_memory_goes_to_everyone_by_default_else_to_the_listed);
    tcase_add_test(tc, shared_scope_names_leave_the_private_forms_alone);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
