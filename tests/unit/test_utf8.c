/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_utf8.c - kvp_utf8_len (common/kvp_utf8.h), the UTF-8 check behind the metrics text and
 * kvpoolctl's JSON: the length of every valid form at the edges of its range, 0 for every
 * class of invalid input (bytes that never start a sequence, overlong forms, surrogates, code
 * points above U+10FFFF, bad or missing continuation bytes), and that it reads no further than
 * its contract allows: every input lives in an allocation of exactly its own bytes (the NUL
 * included), so AddressSanitizer reports a read past it.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_utf8.h"

/* kvp_utf8_len over a heap copy of exactly n bytes of s. */
static size_t len_of(const char *s, size_t n)
{
    unsigned char *p = malloc(n);
    ck_assert_ptr_nonnull(p);
    memcpy(p, s, n);
    size_t r = kvp_utf8_len(p);
    free(p);
    return r;
}

/* The same for a NUL-terminated literal (its NUL included in the copy). */
#define LEN(lit) len_of(lit, sizeof(lit))

START_TEST(ascii_is_one_byte_nul_included)
{
    for (unsigned c = 1; c < 0x80; c++) {
        char s[2] = {(char)c, 0};
        ck_assert_uint_eq(len_of(s, 2), 1);
    }
    /* NUL is ASCII: the API is NUL-terminated, the caller stops there; a NUL alone is one
     * byte read and nothing more (an allocation of one byte) */
    ck_assert_uint_eq(len_of("", 1), 1);
    ck_assert_uint_eq(LEN("A\xff"), 1); /* only the first sequence is looked at */
}
END_TEST

START_TEST(two_byte_sequences)
{
    ck_assert_uint_eq(LEN("\xc2\x80"), 2); /* U+0080, the smallest */
    ck_assert_uint_eq(LEN("\xc3\xa9"), 2); /* U+00E9 */
    ck_assert_uint_eq(LEN("\xdf\xbf"), 2); /* U+07FF, the largest */
    ck_assert_uint_eq(LEN("\xc3\xa9z"), 2);
}
END_TEST

START_TEST(three_byte_sequences)
{
    ck_assert_uint_eq(LEN("\xe0\xa0\x80"), 3); /* U+0800, the smallest */
    ck_assert_uint_eq(LEN("\xe6\xbc\xa2"), 3); /* U+6F22 */
    ck_assert_uint_eq(LEN("\xed\x9f\xbf"), 3); /* U+D7FF, just below the surrogates */
    ck_assert_uint_eq(LEN("\xee\x80\x80"), 3); /* U+E000, just above them */
    ck_assert_uint_eq(LEN("\xef\xbb\xbf"), 3); /* U+FEFF */
    ck_assert_uint_eq(LEN("\xef\xbf\xbf"), 3); /* U+FFFF, the largest */
}
END_TEST

START_TEST(four_byte_sequences)
{
    ck_assert_uint_eq(LEN("\xf0\x90\x80\x80"), 4); /* U+10000, the smallest */
    ck_assert_uint_eq(LEN("\xf0\x9f\x98\x80"), 4); /* U+1F600 */
    ck_assert_uint_eq(LEN("\xf3\xbf\xbf\xbf"), 4); /* U+FFFFF */
    ck_assert_uint_eq(LEN("\xf4\x8f\xbf\xbf"), 4); /* U+10FFFF, the largest */
}
END_TEST

START_TEST(overlong_forms_are_invalid)
{
    ck_assert_uint_eq(LEN("\xc0\x80"), 0);         /* U+0000 in two bytes */
    ck_assert_uint_eq(LEN("\xc0\xaf"), 0);         /* '/' in two bytes */
    ck_assert_uint_eq(LEN("\xc1\xbf"), 0);         /* U+007F in two bytes */
    ck_assert_uint_eq(LEN("\xe0\x80\x80"), 0);     /* U+0000 in three */
    ck_assert_uint_eq(LEN("\xe0\x80\xaf"), 0);     /* '/' in three */
    ck_assert_uint_eq(LEN("\xe0\x9f\xbf"), 0);     /* U+07FF in three */
    ck_assert_uint_eq(LEN("\xf0\x80\x80\x80"), 0); /* U+0000 in four */
    ck_assert_uint_eq(LEN("\xf0\x8f\xbf\xbf"), 0); /* U+FFFF in four */
}
END_TEST

START_TEST(surrogates_are_invalid)
{
    ck_assert_uint_eq(LEN("\xed\xa0\x80"), 0); /* U+D800 */
    ck_assert_uint_eq(LEN("\xed\xad\xbf"), 0); /* U+DB7F */
    ck_assert_uint_eq(LEN("\xed\xb0\x80"), 0); /* U+DC00 */
    ck_assert_uint_eq(LEN("\xed\xbf\xbf"), 0); /* U+DFFF */
    /* a surrogate pair written as two sequences (CESU-8) is two invalid ones */
    ck_assert_uint_eq(LEN("\xed\xa0\xbd\xed\xb8\x80"), 0);
}
END_TEST

START_TEST(code_points_above_u10ffff_are_invalid)
{
    ck_assert_uint_eq(LEN("\xf4\x90\x80\x80"), 0); /* U+110000 */
    ck_assert_uint_eq(LEN("\xf4\xbf\xbf\xbf"), 0); /* U+13FFFF */
    /* lead bytes that could only start one: F5..F7, and the old 5- and 6-byte forms */
    ck_assert_uint_eq(LEN("\xf5\x80\x80\x80"), 0);
    ck_assert_uint_eq(LEN("\xf7\xbf\xbf\xbf"), 0);
    ck_assert_uint_eq(LEN("\xf8\x88\x80\x80\x80"), 0);
    ck_assert_uint_eq(LEN("\xfc\x84\x80\x80\x80\x80"), 0);
}
END_TEST

START_TEST(bytes_that_never_start_a_sequence_are_invalid)
{
    /* continuation bytes 80..BF alone, C0/C1, F5..FF: every one of them */
    for (unsigned c = 0x80; c <= 0xff; c++) {
        if (c >= 0xc2 && c <= 0xf4)
            continue;
        char s[3] = {(char)c, (char)0x80, 0}; /* even with a continuation byte after it */
        ck_assert_msg(len_of(s, 3) == 0, "lead byte %02x: %zu", c, len_of(s, 3));
    }
    ck_assert_uint_eq(LEN("\xfe"), 0);
    ck_assert_uint_eq(LEN("\xff"), 0);
    ck_assert_uint_eq(LEN("\xfe\xff"), 0); /* a UTF-16 byte order mark */
    ck_assert_uint_eq(LEN("\x80"), 0);
    ck_assert_uint_eq(LEN("\xbf\xbf"), 0);
}
END_TEST

START_TEST(bad_continuation_bytes_are_invalid)
{
    ck_assert_uint_eq(LEN("\xc3\x41"), 0);         /* ASCII where one is due */
    ck_assert_uint_eq(LEN("\xc3\xc3\xa9"), 0);     /* a lead byte where one is due */
    ck_assert_uint_eq(LEN("\xe6\xbc\x41"), 0);     /* the third byte */
    ck_assert_uint_eq(LEN("\xe6\x41\xa2"), 0);     /* the second */
    ck_assert_uint_eq(LEN("\xf0\x9f\x98\x41"), 0); /* the fourth */
    ck_assert_uint_eq(LEN("\xf0\x9f\xc0\x80"), 0);
    ck_assert_uint_eq(LEN("\xc2\xff"), 0);
}
END_TEST

START_TEST(truncated_sequences_stop_at_the_nul)
{
    /* each allocation ends right after the NUL: a read past it is an ASan report */
    ck_assert_uint_eq(LEN("\xc3"), 0);
    ck_assert_uint_eq(LEN("\xe6"), 0);
    ck_assert_uint_eq(LEN("\xe6\xbc"), 0);
    ck_assert_uint_eq(LEN("\xf0"), 0);
    ck_assert_uint_eq(LEN("\xf0\x9f"), 0);
    ck_assert_uint_eq(LEN("\xf0\x9f\x98"), 0);
    ck_assert_uint_eq(LEN("\xf4\x8f\xbf"), 0);
    /* and at any other bad byte: a truncated sequence followed by more text */
    ck_assert_uint_eq(len_of("\xf0\x9f"
                             "A",
                             3),
                      0);
}
END_TEST

START_TEST(a_string_walks_sequence_by_sequence)
{
    /* what the callers do: step by the length, escape a byte where it is 0 */
    static const char s[] = "a\xc3\xa9\xe6\xbc\xa2\xf0\x9f\x98\x80\xed\xa0\x80z\xc3";
    unsigned char *p = malloc(sizeof(s));
    ck_assert_ptr_nonnull(p);
    memcpy(p, s, sizeof(s));
    const size_t want[] = {1, 2, 3, 4, 0, 0, 0, 1, 0};
    size_t i = 0, k = 0;
    while (p[i]) {
        ck_assert_uint_lt(k, sizeof(want) / sizeof(want[0]));
        size_t n = kvp_utf8_len(p + i);
        ck_assert_msg(n == want[k], "sequence %zu at byte %zu: %zu, want %zu", k, i, n, want[k]);
        i += n ? n : 1;
        k++;
    }
    ck_assert_uint_eq(k, sizeof(want) / sizeof(want[0]));
    ck_assert_uint_eq(i, sizeof(s) - 1);
    free(p);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("utf8");
    TCase *tc = tcase_create("utf8");
    tcase_add_test(tc, ascii_is_one_byte_nul_included);
    tcase_add_test(tc, two_byte_sequences);
    tcase_add_test(tc, three_byte_sequences);
    tcase_add_test(tc, four_byte_sequences);
    tcase_add_test(tc, overlong_forms_are_invalid);
    tcase_add_test(tc, surrogates_are_invalid);
    tcase_add_test(tc, code_points_above_u10ffff_are_invalid);
    tcase_add_test(tc, bytes_that_never_start_a_sequence_are_invalid);
    tcase_add_test(tc, bad_continuation_bytes_are_invalid);
    tcase_add_test(tc, truncated_sequences_stop_at_the_nul);
    tcase_add_test(tc, a_string_walks_sequence_by_sequence);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
