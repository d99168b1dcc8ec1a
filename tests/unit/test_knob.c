/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_knob.c - the one parser of knob values (common/kvp_knob.h): whole-string decimal
 * integers with a range, byte counts with suffixes, booleans, the KVPOOL_ environment names,
 * and environment knobs with the message that names the variable and the range.
 */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_knob.h"

START_TEST(u64_takes_whole_decimal_numbers_in_range)
{
    uint64_t v = 99;
    ck_assert_int_eq(kvp_knob_parse_u64("0", 0, 10, &v), 0);
    ck_assert_uint_eq(v, 0);
    ck_assert_int_eq(kvp_knob_parse_u64("42", 0, 100, &v), 0);
    ck_assert_uint_eq(v, 42);
    ck_assert_int_eq(kvp_knob_parse_u64("007", 0, 100, &v), 0);
    ck_assert_uint_eq(v, 7);
    ck_assert_int_eq(kvp_knob_parse_u64("18446744073709551615", 0, UINT64_MAX, &v), 0);
    ck_assert_uint_eq(v, UINT64_MAX);
    ck_assert_int_eq(kvp_knob_parse_u64("4", 4, 4, &v), 0);
    ck_assert_uint_eq(v, 4);

    /* not a number: the five ways strtoul and atoi let through */
    static const char *const junk[] = {"", "-1", "+1", " 1", "1 ", "1x", "0x10", "1.5", "x"};
    for (size_t i = 0; i < sizeof(junk) / sizeof(junk[0]); i++) {
        v = 99;
        ck_assert_msg(kvp_knob_parse_u64(junk[i], 0, 100, &v) == KVP_EINVAL, "'%s'", junk[i]);
        ck_assert_uint_eq(v, 99);
    }
    ck_assert_int_eq(kvp_knob_parse_u64(NULL, 0, 100, &v), KVP_EINVAL);

    /* outside the range, or past 64 bits */
    ck_assert_int_eq(kvp_knob_parse_u64("5", 1, 4, &v), KVP_ERANGE);
    ck_assert_int_eq(kvp_knob_parse_u64("0", 1, 4, &v), KVP_ERANGE);
    ck_assert_int_eq(kvp_knob_parse_u64("18446744073709551616", 0, UINT64_MAX, &v), KVP_ERANGE);
    ck_assert_uint_eq(v, 99);
}
END_TEST

START_TEST(size_takes_suffixes_of_1024)
{
    static const struct {
        const char *text;
        uint64_t bytes;
    } ok[] = {{"4096", 4096},     {"4K", 4096},         {"4KiB", 4096},
              {"4 KiB", 4096},    {"16M", 16ull << 20}, {"16\tMiB", 16ull << 20},
              {"2G", 2ull << 30}, {"1T", 1ull << 40},   {"16777215T", 16777215ull << 40}};
    uint64_t v = 0;
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        ck_assert_msg(kvp_knob_parse_size(ok[i].text, 0, UINT64_MAX, &v) == 0, "'%s'", ok[i].text);
        ck_assert_uint_eq(v, ok[i].bytes);
    }
    v = 7;
    static const char *const junk[] = {"", "M", "16Q", "16MB", "16Mi", "16 ", "-4K", "4k"};
    for (size_t i = 0; i < sizeof(junk) / sizeof(junk[0]); i++)
        ck_assert_msg(kvp_knob_parse_size(junk[i], 0, UINT64_MAX, &v) == KVP_EINVAL, "'%s'",
                      junk[i]);
    ck_assert_int_eq(kvp_knob_parse_size("16777216T", 0, UINT64_MAX, &v), KVP_ERANGE);
    ck_assert_int_eq(kvp_knob_parse_size("2K", 0, 1024, &v), KVP_ERANGE);
    ck_assert_int_eq(kvp_knob_parse_size("1K", 2048, 4096, &v), KVP_ERANGE);
    ck_assert_uint_eq(v, 7);
}
END_TEST

START_TEST(bool_takes_the_four_pairs_in_any_case)
{
    static const char *const yes[] = {"true", "yes", "on", "1", "TRUE", "Yes", "oN"};
    static const char *const no[] = {"false", "no", "off", "0", "FALSE", "Off"};
    bool b;
    for (size_t i = 0; i < sizeof(yes) / sizeof(yes[0]); i++) {
        b = false;
        ck_assert_int_eq(kvp_knob_parse_bool(yes[i], &b), 0);
        ck_assert(b);
    }
    for (size_t i = 0; i < sizeof(no) / sizeof(no[0]); i++) {
        b = true;
        ck_assert_int_eq(kvp_knob_parse_bool(no[i], &b), 0);
        ck_assert(!b);
    }
    static const char *const junk[] = {"", "2", "y", "truee", " true", "enable"};
    for (size_t i = 0; i < sizeof(junk) / sizeof(junk[0]); i++) {
        b = true;
        ck_assert_int_eq(kvp_knob_parse_bool(junk[i], &b), KVP_EINVAL);
        ck_assert(b);
    }
    ck_assert_int_eq(kvp_knob_parse_bool(NULL, &b), KVP_EINVAL);
}
END_TEST

START_TEST(env_names_are_the_prefix_and_the_key_in_upper_case)
{
    char buf[32];
    ck_assert_int_eq(kvp_knob_env_name("cuda_plan_upload", buf, sizeof(buf)), 0);
    ck_assert_str_eq(buf, "KVPOOL_CUDA_PLAN_UPLOAD");
    ck_assert_int_eq(kvp_knob_env_name("xfer_stages", buf, sizeof(buf)), 0);
    ck_assert_str_eq(buf, "KVPOOL_XFER_STAGES");
    /* "KVPOOL_" + 24 characters + NUL is 32: fits exactly; one more does not */
    ck_assert_int_eq(kvp_knob_env_name("abcdefghijklmnopqrstuvwx", buf, sizeof(buf)), 0);
    ck_assert_str_eq(buf, "KVPOOL_ABCDEFGHIJKLMNOPQRSTUVWX");
    ck_assert_int_eq(kvp_knob_env_name("abcdefghijklmnopqrstuvwxy", buf, sizeof(buf)), KVP_EINVAL);
    ck_assert_str_eq(buf, "");
    ck_assert_int_eq(kvp_knob_env_name(NULL, buf, sizeof(buf)), KVP_EINVAL);
    ck_assert_int_eq(kvp_knob_env_name("x", NULL, 8), KVP_EINVAL);
}
END_TEST

START_TEST(env_knobs_name_the_variable_and_the_range)
{
    char err[256];
    uint64_t v = 5;
    unsetenv("KVPOOL_TEST_KNOB");
    ck_assert_ptr_null(kvp_knob_env("KVPOOL_TEST_KNOB"));
    ck_assert_ptr_null(kvp_knob_env(NULL));
    strcpy(err, "untouched");
    ck_assert_int_eq(kvp_knob_env_u64("KVPOOL_TEST_KNOB", 0, 1000, &v, err, sizeof(err)), 0);
    ck_assert_uint_eq(v, 5);
    ck_assert_str_eq(err, "untouched");

    setenv("KVPOOL_TEST_KNOB", "200", 1);
    ck_assert_int_eq(kvp_knob_env_u64("KVPOOL_TEST_KNOB", 0, 1000, &v, err, sizeof(err)), 1);
    ck_assert_uint_eq(v, 200);

    setenv("KVPOOL_TEST_KNOB", "2000", 1);
    ck_assert_int_eq(kvp_knob_env_u64("KVPOOL_TEST_KNOB", 0, 1000, &v, err, sizeof(err)),
                     KVP_EINVAL);
    ck_assert_str_eq(err, "KVPOOL_TEST_KNOB: invalid value '2000': expected an unsigned decimal "
                          "integer in 0..1000");
    ck_assert_uint_eq(v, 200);

    /* set but empty is a bad number, not "unset" */
    setenv("KVPOOL_TEST_KNOB", "", 1);
    ck_assert_str_eq(kvp_knob_env("KVPOOL_TEST_KNOB"), "");
    ck_assert_int_eq(kvp_knob_env_u64("KVPOOL_TEST_KNOB", 1, 9, &v, err, sizeof(err)), KVP_EINVAL);
    ck_assert_str_eq(err, "KVPOOL_TEST_KNOB: invalid value '': expected an unsigned decimal "
                          "integer in 1..9");
    ck_assert_int_eq(kvp_knob_env_u64("KVPOOL_TEST_KNOB", 1, 9, &v, NULL, 0), KVP_EINVAL);
    unsetenv("KVPOOL_TEST_KNOB");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("knob");
    TCase *tc = tcase_create("knob");
    tcase_add_test(tc, u64_takes_whole_decimal_numbers_in_range);
    tcase_add_test(tc, size_takes_suffixes_of_1024);
    tcase_add_test(tc, bool_takes_the_four_pairs_in_any_case);
    tcase_add_test(tc, env_names_are_the_prefix_and_the_key_in_upper_case);
    tcase_add_test(tc, env_knobs_name_the_variable_and_the_range);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
