/* SPDX-License-Identifier: Apache-2.0 */
/* test_error.c - every code has a distinct name and text; errno codes fall through. */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"

static const int codes[] = {KVP_OK,
                            KVP_EINVAL,
                            KVP_ENOMEM,
                            KVP_ENOSPC,
                            KVP_ENOENT,
                            KVP_EEXIST,
                            KVP_ELIMIT,
                            KVP_ERANGE,
                            KVP_EAUDIT,
                            KVP_EDUPSEQ,
                            KVP_EBUSY,
                            KVP_EPERM,
                            KVP_EUNAVAIL,
                            KVP_EPRECOND,
                            KVP_EINTERNAL,
                            KVP_ETIMEDOUT,
                            KVP_EPROTO,
                            KVP_ECLOSED,
                            KVP_EGEOM_NUM_LAYERS,
                            KVP_EGEOM_NUM_PAGES,
                            KVP_EGEOM_PAGE_SIZE,
                            KVP_EGEOM_NUM_KV_HEADS,
                            KVP_EGEOM_HEAD_DIM,
                            KVP_EGEOM_DTYPE,
                            KVP_EGEOM_LAYOUT,
                            KVP_EGEOM_STORAGE,
                            KVP_EGEOM_NUM_DEVICES,
                            KVP_EGEOM_TOO_LARGE,
                            KVP_EGEOM_NULL};

START_TEST(every_code_has_a_distinct_name_and_text)
{
    size_t n = sizeof(codes) / sizeof(codes[0]);
    for (size_t i = 0; i < n; i++) {
        ck_assert_str_ne(kvp_strerror(codes[i]), "unknown error");
        ck_assert_int_eq(strncmp(kvp_errname(codes[i]), "KVP_", 4), 0);
        for (size_t j = 0; j < i; j++) {
            ck_assert_str_ne(kvp_strerror(codes[i]), kvp_strerror(codes[j]));
            ck_assert_str_ne(kvp_errname(codes[i]), kvp_errname(codes[j]));
        }
    }
    ck_assert_str_eq(kvp_errname(KVP_ENOSPC), "KVP_ENOSPC");
}
END_TEST

START_TEST(errno_codes_use_the_c_library_names)
{
    ck_assert_str_eq(kvp_strerror(-ENOENT), strerror(ENOENT));
    ck_assert_str_eq(kvp_errname(-ECONNREFUSED), "ECONNREFUSED");
    ck_assert_str_eq(kvp_strerror(-5000), "unknown error");
    ck_assert_str_eq(kvp_errname(12345), "UNKNOWN");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("error");
    TCase *tc = tcase_create("error");
    tcase_add_test(tc, every_code_has_a_distinct_name_and_text);
    tcase_add_test(tc, errno_codes_use_the_c_library_names);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
