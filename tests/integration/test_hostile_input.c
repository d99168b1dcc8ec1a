/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_hostile_input.c - integration: what a hostile client writes into an Append's source and a
 * RegisterBuffer's descriptor (issue #15 defects 1 and 10), against a real kvpoold (host
 * backend, small pool) with raw frames (tests/integration/kvp_raw.h), so the test chooses every
 * offset and stride, including the ones libkvpool would never send.
 *
 * Each refusal is asserted with its exact status and a message naming what is wrong, and with
 * the pool's state unchanged (Stats and the sequence's length); the daemon must keep answering
 * and exit 0 on SIGTERM, so the ASan/UBSan build of this test (a sanitized daemon) proves that no
 * undefined behaviour was reached.
 */
#include <check.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvp_harness.h"
#include "kvp_raw.h"

/* 2 layers, 64 pages of 4 tokens, 2 KV heads, head_dim 16, fp16: a row is 32 bytes */
#define H   2
#define ROW 32
#define BUF 4096

static const char *const SMALL[] = {
    "--backend",      "host", "--num-layers", "2",  "--num-pages", "64",   "--page-size", "4",
    "--num-kv-heads", "2",    "--head-dim",   "16", "--dtype",     "fp16", NULL};

static kvp_daemon_t DMN;

static void start_small(void)
{
    ck_assert_msg(kvp_daemon_start(&DMN, SMALL) == 0, "kvpoold did not start");
}

static void stop_expect_clean(void)
{
    int code = kvp_daemon_stop(&DMN, SIGTERM);
    ck_assert_msg(code == 0, "kvpoold exited with %d", code);
}

/* A valid source for `tokens` tokens in buffer buf, all layers: K rows then V rows. */
static kvpool_Source valid_source(uint32_t buf, uint32_t tokens)
{
    kvpool_Source s = {.buffer_id = buf};
    s.v_offset = (uint64_t)tokens * H * ROW;
    s.k_stride_n = s.v_stride_n = H * ROW;
    s.k_stride_h = s.v_stride_h = ROW;
    s.layer_stride = 2ull * tokens * H * ROW;
    return s;
}

static int append_src(kvp_raw_t *w, uint64_t id, uint64_t seq, uint32_t tokens,
                      const kvpool_Source *src, kvpool_Response *resp)
{
    kvp_batch_arrays_t b = {.seq_ids = kvp_array(&seq, 8, 1, 1),
                            .num_tokens = kvp_array(&tokens, 4, 1, 1)};
    kvpool_Request q = kvp_raw_batch_req(kvpool_Request_append_tag, id, &b);
    q.body.append.has_source = true;
    q.body.append.source = *src;
    return kvp_raw_call(w, &q, NULL, 0, resp);
}

/* What a refused call must leave as it was. */
typedef struct {
    uint32_t free_pages, used_pages, num_seqs;
    uint64_t num_tokens, page_refs, append_bytes_total;
} pool_state_t;

static pool_state_t pool_state(kvp_raw_t *w)
{
    kvpool_Request q = {.id = 0, .which_body = kvpool_Request_stats_tag};
    kvpool_Response resp;
    ck_assert_int_eq(kvp_raw_call(w, &q, NULL, 0, &resp), kvpool_Code_OK);
    const kvpool_Stats *s = &resp.body.stats.stats;
    return (pool_state_t){s->free_pages, s->used_pages, s->num_seqs,
                          s->num_tokens, s->page_refs,  s->append_bytes_total};
}

static void assert_state_eq(const pool_state_t *a, const pool_state_t *b, const char *what)
{
    ck_assert_msg(
        a->free_pages == b->free_pages && a->used_pages == b->used_pages &&
            a->num_seqs == b->num_seqs && a->num_tokens == b->num_tokens &&
            a->page_refs == b->page_refs && a->append_bytes_total == b->append_bytes_total,
        "%s changed the pool: free %u->%u seqs %u->%u tokens %llu->%llu bytes "
        "%llu->%llu",
        what, a->free_pages, b->free_pages, a->num_seqs, b->num_seqs,
        (unsigned long long)a->num_tokens, (unsigned long long)b->num_tokens,
        (unsigned long long)a->append_bytes_total, (unsigned long long)b->append_bytes_total);
}

/* Defect 1: the exact Append of the issue. One token, so (nnz - 1) * k_stride_n is 0 and the
 * old range check passed; the copy then multiplied the stride by the element size in int64
 * (UBSan: the daemon died; release: OK and a token appended). Now INVALID_ARGUMENT (the
 * daemon's range refusal, KVP_ERANGE) naming the stride, and nothing appended. */
START_TEST(one_token_with_a_stride_of_2p64_minus_2_is_refused_and_changes_nothing)
{
    start_small();
    kvpool_Response resp;
    kvp_raw_t w;
    kvp_raw_open(&w, DMN.sock);
    ck_assert_int_eq(kvp_raw_hello(&w, "hostile", &resp), kvpool_Code_OK);
    uint32_t buf = kvp_raw_register_memfd(&w, 2, BUF);
    pool_state_t before = pool_state(&w);

    kvpool_Source src = valid_source(buf, 1);
    src.k_stride_n = UINT64_MAX - 1; /* 2^64 - 2: even, so a whole number of fp16 elements */
    ck_assert_int_eq(append_src(&w, 3, 7, 1, &src, &resp), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_msg(strstr(resp.status.message, "k_stride_n 18446744073709551614 exceeds buffer of "
                                              "4096 bytes"),
                  "message: %s", resp.status.message);
    ck_assert_int_eq(kvp_raw_seq_len(&w, 7), -1);
    pool_state_t after = pool_state(&w);
    assert_state_eq(&before, &after, "the hostile Append");

    /* the daemon is well and the same buffer still serves a valid Append */
    src = valid_source(buf, 1);
    ck_assert_int_eq(append_src(&w, 4, 7, 1, &src, &resp), kvpool_Code_OK);
    ck_assert_int_eq(kvp_raw_seq_len(&w, 7), 1);
    kvp_raw_close(&w);
    stop_expect_clean();
}
END_TEST

/* Defect 1's neighbours: every offset and stride of the source, with counts that zero the old
 * products (one layer, one token) or wrap them (H heads, an offset near 2^64). Each is refused
 * with INVALID_ARGUMENT and changes nothing. */
typedef struct {
    const char *name, *msg; /* msg: a part of the expected status message */
    uint32_t tokens, layer_end;
    uint64_t k_offset, v_offset, k_stride_n, k_stride_h, v_stride_n, v_stride_h, layer_stride;
} bad_source_t;

#define KEEP UINT64_MAX /* leave the valid value */

static const bad_source_t bad_sources[] = {
    {"v_stride_n 2^64 - 2, one token", "v_stride_n 18446744073709551614 exceeds", 1, 0, KEEP, KEEP,
     KEEP, KEEP, UINT64_MAX - 1, KEEP, KEEP},
    {"k_stride_h 2^63 with 2 heads", "k_stride_h 9223372036854775808 exceeds", 1, 0, KEEP, KEEP,
     KEEP, UINT64_C(1) << 63, KEEP, KEEP, KEEP},
    {"v_stride_h 2^64 - 2 with 2 heads", "v_stride_h 18446744073709551614 exceeds", 3, 0, KEEP,
     KEEP, KEEP, KEEP, KEEP, UINT64_MAX - 1, KEEP},
    {"layer_stride 2^63 with one layer", "layer_stride 9223372036854775808 exceeds", 1, 1, KEEP,
     KEEP, KEEP, KEEP, KEEP, KEEP, UINT64_C(1) << 63},
    {"layer_stride 2^63 with both layers", "layer_stride 9223372036854775808 exceeds", 1, 0, KEEP,
     KEEP, KEEP, KEEP, KEEP, KEEP, UINT64_C(1) << 63},
    {"v_offset 2^64 - 32", "v_offset 18446744073709551584 exceeds", 1, 0, KEEP, UINT64_MAX - 31,
     KEEP, KEEP, KEEP, KEEP, KEEP},
    {"k_offset 2^64 - 2^12", "k_offset 18446744073709547520 exceeds", 1, 0, UINT64_MAX - 4095, KEEP,
     KEEP, KEEP, KEEP, KEEP, KEEP},
    {"k_stride_n one past the buffer, one token", "k_stride_n 4098 exceeds", 1, 0, KEEP, KEEP,
     BUF + 2, KEEP, KEEP, KEEP, KEEP},
    /* in range word by word, but the sum passes the buffer: the old check's own refusal */
    {"V rows past the end", "V source range exceeds buffer of 4096 bytes", 1, 0, KEEP, BUF - ROW,
     KEEP, KEEP, KEEP, KEEP, KEEP},
};
#define NUM_BAD_SOURCES ((int)(sizeof(bad_sources) / sizeof(bad_sources[0])))

static void set_word(uint64_t *field, uint64_t v)
{
    if (v != KEEP)
        *field = v;
}

START_TEST(hostile_offsets_and_strides_are_refused_and_change_nothing)
{
    start_small();
    kvpool_Response resp;
    kvp_raw_t w;
    kvp_raw_open(&w, DMN.sock);
    ck_assert_int_eq(kvp_raw_hello(&w, "hostile", &resp), kvpool_Code_OK);
    uint32_t buf = kvp_raw_register_memfd(&w, 2, BUF);
    /* seq 9 holds 2 tokens: the refused Appends would extend a live sequence */
    kvpool_Source ok = valid_source(buf, 2);
    ck_assert_int_eq(append_src(&w, 3, 9, 2, &ok, &resp), kvpool_Code_OK);
    pool_state_t before = pool_state(&w);

    for (int c = 0; c < NUM_BAD_SOURCES; c++) {
        const bad_source_t *b = &bad_sources[c];
        kvpool_Source src = valid_source(buf, b->tokens);
        src.layer_end = b->layer_end;
        set_word(&src.k_offset, b->k_offset);
        set_word(&src.v_offset, b->v_offset);
        set_word(&src.k_stride_n, b->k_stride_n);
        set_word(&src.k_stride_h, b->k_stride_h);
        set_word(&src.v_stride_n, b->v_stride_n);
        set_word(&src.v_stride_h, b->v_stride_h);
        set_word(&src.layer_stride, b->layer_stride);
        int code = append_src(&w, 100 + (uint64_t)c, 9, b->tokens, &src, &resp);
        ck_assert_msg(code == kvpool_Code_INVALID_ARGUMENT, "%s: status %d (%s)", b->name, code,
                      resp.status.message);
        ck_assert_msg(strstr(resp.status.message, b->msg), "%s: message '%s', want '%s'", b->name,
                      resp.status.message, b->msg);
        ck_assert_int_eq(kvp_raw_seq_len(&w, 9), 2);
        pool_state_t after = pool_state(&w);
        assert_state_eq(&before, &after, b->name);
    }
    ck_assert_int_eq(append_src(&w, 200, 9, 2, &ok, &resp), kvpool_Code_OK);
    ck_assert_int_eq(kvp_raw_seq_len(&w, 9), 4);
    kvp_raw_close(&w);
    stop_expect_clean();
}
END_TEST

/* Defect 10: a sealed memfd reopened write-only cannot be mapped for reading; it was INTERNAL
 * "Permission denied" (the host backend's mmap errno passed through). A client's mistake:
 * INVALID_ARGUMENT saying the fd must be open for reading, and no buffer registered. An O_PATH
 * descriptor of the same memfd likewise. */
START_TEST(a_write_only_memfd_is_invalid_argument_with_a_reason)
{
    start_small();
    kvpool_Response resp;
    kvp_raw_t w;
    kvp_raw_open(&w, DMN.sock);
    ck_assert_int_eq(kvp_raw_hello(&w, "hostile", &resp), kvpool_Code_OK);
    int fd = kvp_raw_sealed_memfd(BUF);
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    const int modes[] = {O_WRONLY, O_PATH};
    for (int m = 0; m < 2; m++) {
        int wo = open(path, modes[m] | O_CLOEXEC);
        ck_assert_int_ge(wo, 0);
        ck_assert_int_eq(kvp_raw_register_fd(&w, 10 + (uint64_t)m, wo, BUF, &resp),
                         kvpool_Code_INVALID_ARGUMENT);
        ck_assert_msg(
            strstr(resp.status.message, "must be open for reading, not O_WRONLY or O_PATH"),
            "message: %s", resp.status.message);
        close(wo);
    }
    /* nothing was registered: an Append from buffer 1 finds none, the next buffer is 1 */
    kvpool_Source src = valid_source(1, 1);
    ck_assert_int_eq(append_src(&w, 20, 7, 1, &src, &resp), kvpool_Code_NOT_FOUND);
    ck_assert_int_eq(kvp_raw_register_fd(&w, 21, fd, BUF, &resp), kvpool_Code_OK);
    ck_assert_uint_eq(resp.body.register_buffer.buffer_id, 1);
    close(fd);

    /* the other refusals of the descriptor stay client errors with their reason */
    int unsealed = memfd_create("unsealed", MFD_CLOEXEC);
    ck_assert_int_ge(unsealed, 0);
    ck_assert_int_eq(ftruncate(unsealed, BUF), 0);
    ck_assert_int_eq(kvp_raw_register_fd(&w, 22, unsealed, BUF, &resp),
                     kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(resp.status.message, "F_SEAL_SHRINK"));
    close(unsealed);
    int small = kvp_raw_sealed_memfd(BUF / 2);
    ck_assert_int_eq(kvp_raw_register_fd(&w, 23, small, BUF, &resp), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_msg(strstr(resp.status.message, "at least size_bytes bytes"), "message: %s",
                  resp.status.message);
    close(small);
    int pipefd[2];
    ck_assert_int_eq(pipe(pipefd), 0);
    ck_assert_int_eq(kvp_raw_register_fd(&w, 24, pipefd[0], BUF, &resp),
                     kvpool_Code_INVALID_ARGUMENT);
    ck_assert_msg(strstr(resp.status.message, "must be a memfd"), "message: %s",
                  resp.status.message);
    close(pipefd[0]);
    close(pipefd[1]);
    kvp_raw_close(&w);
    stop_expect_clean();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("hostile_input");
    TCase *tc = tcase_create("hostile_input");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, one_token_with_a_stride_of_2p64_minus_2_is_refused_and_changes_nothing);
    tcase_add_test(tc, hostile_offsets_and_strides_are_refused_and_change_nothing);
    tcase_add_test(tc, a_write_only_memfd_is_invalid_argument_with_a_reason);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
