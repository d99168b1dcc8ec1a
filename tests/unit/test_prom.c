/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_prom.c - reading the Prometheus text back (client/kvp_prom, used by kvpoolctl top):
 * samples with and without labels, escaped label values, skipped comments and malformed
 * lines, and histogram_quantile's interpolation, +Inf bucket and empty histogram.
 */
#include <check.h>
#include <math.h>
#include <string.h>

#include "kvp_prom.h"

START_TEST(samples_labels_and_escapes_are_read)
{
    static const char text[] = "# HELP a_total x\n# TYPE a_total counter\n"
                               "a_total 12\n"
                               "b{ns=\"we\\\"ird\\\\n\\n}\",le=\"+Inf\"} 3.5e2\n"
                               "broken line here\n"
                               "c{x=\"1\"}\n"
                               "\n"
                               "d 7";
    size_t pos = 0;
    kvp_prom_sample_t s;
    char v[64];
    ck_assert_int_eq(kvp_prom_next(text, strlen(text), &pos, &s), 1);
    ck_assert(kvp_prom_is(&s, "a_total"));
    ck_assert(!kvp_prom_is(&s, "a_tota"));
    ck_assert(s.value == 12);
    ck_assert_int_eq(kvp_prom_label(&s, "x", v, sizeof(v)), -1);
    ck_assert_int_eq(kvp_prom_next(text, strlen(text), &pos, &s), 1);
    ck_assert(kvp_prom_is(&s, "b"));
    ck_assert(s.value == 350);
    ck_assert_int_eq(kvp_prom_label(&s, "ns", v, sizeof(v)), 0);
    ck_assert_str_eq(v, "we\"ird\\n\n}");
    ck_assert_int_eq(kvp_prom_label(&s, "le", v, sizeof(v)), 0);
    ck_assert_str_eq(v, "+Inf");
    ck_assert_int_eq(kvp_prom_next(text, strlen(text), &pos, &s), 1);
    ck_assert(kvp_prom_is(&s, "d")); /* the malformed lines were skipped; no final newline */
    ck_assert(s.value == 7);
    ck_assert_int_eq(kvp_prom_next(text, strlen(text), &pos, &s), 0);
}
END_TEST

START_TEST(quantiles_interpolate_within_buckets)
{
    const double le[] = {1, 2, 4, INFINITY};
    const double cum[] = {10, 30, 40, 40};
    ck_assert(fabs(kvp_prom_quantile(0.5, le, cum, 4) - 1.5) < 1e-12);  /* rank 20 in (1,2] */
    ck_assert(fabs(kvp_prom_quantile(0.25, le, cum, 4) - 1.0) < 1e-12); /* rank 10: edge */
    ck_assert(fabs(kvp_prom_quantile(0.1, le, cum, 4) - 0.4) < 1e-12);  /* from 0 */
    ck_assert(fabs(kvp_prom_quantile(1.0, le, cum, 4) - 4.0) < 1e-12);
    const double over[] = {0, 0, 1, 5};
    ck_assert(kvp_prom_quantile(0.99, le, over, 4) == 4.0); /* +Inf: the largest bound */
    const double none[] = {0, 0, 0, 0};
    ck_assert(isnan(kvp_prom_quantile(0.5, le, none, 4)));
    ck_assert(isnan(kvp_prom_quantile(0.5, le, cum, 1)));
}
END_TEST

int main(void)
{
    Suite *s = suite_create("prom");
    TCase *tc = tcase_create("prom");
    tcase_add_test(tc, samples_labels_and_escapes_are_read);
    tcase_add_test(tc, quantiles_interpolate_within_buckets);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
