/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fuzz_http.c - libFuzzer target for the metrics endpoint's request classifier
 * (kvp__http_classify, server/kvp_http.h): the bytes of a request head as the connection has
 * read them so far, at most KVP_HTTP_MAX_REQUEST (the connection's buffer; the server answers
 * 431 itself when it fills without a blank line).
 *
 * Checked on every input besides ASan/UBSan (the input is copied into an allocation of exactly
 * its size, so a read past len is an ASan report):
 *   - the status is one the contract names: 0 (incomplete), 200, 400, 404, 405 or 505;
 *     *is_head is 0 or 1, and 1 only on the GET/HEAD path (200 or 404);
 *   - 200 only for a request line that starts "GET /metrics" or "HEAD /metrics" (after the
 *     empty lines it may skip), the path ending there or at a '?';
 *   - a decided head stays decided: the server calls it again with more bytes after each read,
 *     so a status given for a prefix (len - 1, len / 2) is the status of the whole input;
 *   - "GET /metrics HTTP/1.1\r\n\r\n" (and the HEAD form) followed by anything, up to the
 *     limit, is 200: the head ends at the first blank line and nothing after it is read.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_http.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* kvp__http_classify over an exact-size heap copy of data[0..len). */
static int classify(const uint8_t *data, size_t len, int *is_head)
{
    char *buf = malloc(len ? len : 1);
    if (!buf)
        abort();
    if (len)
        memcpy(buf, data, len);
    *is_head = -1;
    int st = kvp__http_classify(buf, len, is_head);
    free(buf);
    return st;
}

/* The checks that hold for any input; returns the status. */
static int classify_checked(const uint8_t *data, size_t len)
{
    int is_head;
    int st = classify(data, len, &is_head);
    if (st != 0 && st != 200 && st != 400 && st != 404 && st != 405 && st != 505)
        abort();
    if (is_head != 0 && is_head != 1)
        abort();
    if (is_head && st != 200 && st != 404)
        abort();
    if (st == 200) {
        size_t i = 0;
        while (i < len && (data[i] == '\r' || data[i] == '\n'))
            i++;
        const char *want = is_head ? "HEAD /metrics" : "GET /metrics";
        size_t n = strlen(want);
        if (len - i < n + 1 || memcmp(data + i, want, n) != 0 ||
            (data[i + n] != ' ' && data[i + n] != '?'))
            abort();
    }
    return st;
}

/* A valid head, then the input: 200 whatever follows. */
static void check_prefixed(const char *head, int want_head, const uint8_t *data, size_t size)
{
    static uint8_t buf[KVP_HTTP_MAX_REQUEST];
    size_t n = strlen(head);
    size_t rest = size < sizeof(buf) - n ? size : sizeof(buf) - n;
    memcpy(buf, head, n);
    memcpy(buf + n, data, rest);
    int is_head;
    if (classify(buf, n + rest, &is_head) != 200 || is_head != want_head)
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > KVP_HTTP_MAX_REQUEST)
        size = KVP_HTTP_MAX_REQUEST;
    int st = classify_checked(data, size);
    if (size > 0) {
        int p = classify_checked(data, size - 1);
        if (p != 0 && p != st)
            abort();
        p = classify_checked(data, size / 2);
        if (p != 0 && p != st)
            abort();
    }
    check_prefixed("GET /metrics HTTP/1.1\r\n\r\n", 0, data, size);
    check_prefixed("HEAD /metrics HTTP/1.0\r\n\r\n", 1, data, size);
    check_prefixed("\r\nGET /metrics?x=1 HTTP/1.1\nHost: a\n\n", 0, data, size);
    return 0;
}
