/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_http.c - the Prometheus endpoint's request classifier (kvp__http_classify): which
 * request heads are answered 200, 400, 404, 405 or 505, and that an incomplete head waits for
 * more bytes. The socket side (a real kvpoold serving /metrics) is exercised by
 * tests/integration/test_metrics.py.
 */
#include <check.h>
#include <string.h>

#include "kvp_http.h"

static int classify(const char *s, int *is_head)
{
    return kvp__http_classify(s, strlen(s), is_head);
}

START_TEST(get_and_head_of_metrics_are_served)
{
    int hd = -1;
    ck_assert_int_eq(classify("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", &hd), 200);
    ck_assert_int_eq(hd, 0);
    ck_assert_int_eq(classify("GET /metrics HTTP/1.0\r\n\r\n", &hd), 200);
    ck_assert_int_eq(classify("GET /metrics?name[]=x HTTP/1.1\r\n\r\n", &hd), 200);
    ck_assert_int_eq(classify("\r\nGET /metrics HTTP/1.1\nAccept: */*\n\n", &hd), 200);
    ck_assert_int_eq(classify("HEAD /metrics HTTP/1.1\r\n\r\n", &hd), 200);
    ck_assert_int_eq(hd, 1);
}
END_TEST

START_TEST(an_incomplete_head_waits_for_more_bytes)
{
    int hd;
    ck_assert_int_eq(classify("", &hd), 0);
    ck_assert_int_eq(classify("GET /metrics HTTP/1.1\r\n", &hd), 0);
    ck_assert_int_eq(classify("GET /metrics HTTP/1.1\r\nHost: x\r\n\r", &hd), 0);
    ck_assert_int_eq(classify("\r\n\r\n", &hd), 0); /* empty lines before the request line */
}
END_TEST

START_TEST(other_paths_are_404_and_other_methods_405)
{
    int hd;
    ck_assert_int_eq(classify("GET / HTTP/1.1\r\n\r\n", &hd), 404);
    ck_assert_int_eq(classify("GET /metricsx HTTP/1.1\r\n\r\n", &hd), 404);
    ck_assert_int_eq(classify("GET /metrics/ HTTP/1.1\r\n\r\n", &hd), 404);
    ck_assert_int_eq(classify("POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", &hd), 405);
    ck_assert_int_eq(classify("get /metrics HTTP/1.1\r\n\r\n", &hd), 405); /* case-sensitive */
    ck_assert_int_eq(classify("DELETE /x HTTP/1.1\r\n\r\n", &hd), 405);
}
END_TEST

START_TEST(malformed_heads_are_400_and_other_versions_505)
{
    int hd;
    const char *bad[] = {
        "GARBAGE\r\n\r\n",
        "GET /metrics\r\n\r\n",                /* HTTP/0.9 form */
        "GET  /metrics HTTP/1.1\r\n\r\n",      /* empty target */
        "GET /metrics HTTP/1.1 extra\r\n\r\n", /* version with junk */
        "GET /metrics HTTX/1.1\r\n\r\n",
        "GET http://host/metrics HTTP/1.1\r\n\r\n", /* absolute form: not a proxy */
        "GET * HTTP/1.1\r\n\r\n",
        "G(T /metrics HTTP/1.1\r\n\r\n", /* method not a token */
        "GET /metrics HTTP/1.1\r\nNoColon\r\n\r\n",
        "GET /metrics HTTP/1.1\r\n: empty name\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nBad Name: x\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nX: a\x01z\r\n\r\n",
        "GET /met\x7frics HTTP/1.1\r\n\r\n",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        ck_assert_msg(classify(bad[i], &hd) == 400, "case %zu: %d", i, classify(bad[i], &hd));
    /* a NUL byte inside the head */
    static const char nul[] = "GET /metrics HTTP/1.1\r\nX: a\0b\r\n\r\n";
    ck_assert_int_eq(kvp__http_classify(nul, sizeof(nul) - 1, &hd), 400);
    ck_assert_int_eq(classify("GET /metrics HTTP/2.0\r\n\r\n", &hd), 505);
    ck_assert_int_eq(classify("GET /metrics HTTP/1.2\r\n\r\n", &hd), 505);
    ck_assert_int_eq(classify("GET /metrics HTTP/0.9\r\n\r\n", &hd), 505);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("http");
    TCase *tc = tcase_create("http");
    tcase_add_test(tc, get_and_head_of_metrics_are_served);
    tcase_add_test(tc, an_incomplete_head_waits_for_more_bytes);
    tcase_add_test(tc, other_paths_are_404_and_other_methods_405);
    tcase_add_test(tc, malformed_heads_are_400_and_other_versions_505);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
