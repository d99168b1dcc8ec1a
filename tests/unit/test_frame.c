/* test_frame.c - the daemon's frame reader (server/kvp_frame.h): frames cut from a stream that
 * arrives in any pieces, each frame with exactly the fds sent with it, oversize headers, fd
 * floods and the bound on the buffer. Fds here are made-up numbers; "dropped" ones are
 * recorded instead of closed. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_frame.h"

static int DROPPED[256];
static int NDROPPED;

static void drop(int fd, void *arg)
{
    (void)arg;
    DROPPED[NDROPPED++] = fd;
}

static void reader(kvp_frame_reader_t *r, uint32_t max)
{
    NDROPPED = 0;
    kvp_frame_reader_init(r, max, drop, NULL);
}

/* Feeds bytes as one read (with fds attached to its first byte). */
static void feed(kvp_frame_reader_t *r, const uint8_t *b, size_t n, const int *fds, int nfds,
                 int want_rc)
{
    uint8_t *p;
    size_t room;
    ck_assert_int_eq(kvp_frame_reader_space(r, &p, &room), 0);
    ck_assert_uint_ge(room, n);
    memcpy(p, b, n);
    ck_assert_int_eq(kvp_frame_reader_commit(r, n, fds, nfds), want_rc);
}

static size_t frame(uint8_t *out, const char *payload)
{
    uint32_t n = (uint32_t)strlen(payload);
    kvp_frame_put_len(out, n);
    memcpy(out + 4, payload, n);
    return 4 + n;
}

START_TEST(frames_arriving_byte_by_byte_are_cut_whole)
{
    kvp_frame_reader_t r;
    reader(&r, 64);
    r.grow_bytes = 3; /* many growth steps */
    uint8_t s[64];
    size_t n = frame(s, "hello");
    n += frame(s + n, "");
    n += frame(s + n, "world!");
    const char *want[] = {"hello", "", "world!"};
    int got = 0;
    for (size_t i = 0; i < n; i++) {
        feed(&r, s + i, 1, NULL, 0, 0);
        kvp_frame_t f;
        int rc;
        while ((rc = kvp_frame_reader_next(&r, &f)) == 1) {
            ck_assert_int_lt(got, 3);
            ck_assert_uint_eq(f.len, strlen(want[got]));
            ck_assert_int_eq(memcmp(f.payload, want[got], f.len), 0);
            ck_assert_int_eq(f.nfds, 0);
            got++;
        }
        ck_assert_int_eq(rc, 0);
    }
    ck_assert_int_eq(got, 3);
    ck_assert_uint_eq(kvp_frame_reader_pending(&r), 0);
    ck_assert_int_eq(kvp_frame_reader_ready(&r), 0);
    kvp_frame_reader_free(&r);
    ck_assert_int_eq(NDROPPED, 0);
}
END_TEST

START_TEST(each_frame_gets_the_fds_sent_with_its_bytes)
{
    kvp_frame_reader_t r;
    reader(&r, 64);
    uint8_t a[16], b[16], c[16];
    size_t na = frame(a, "aa"), nb = frame(b, "bbb"), nc = frame(c, "c");
    int fa[2] = {10, 11}, fb[1] = {20}, fc[1] = {30};
    feed(&r, a, na, fa, 2, 0);
    feed(&r, b, 3, fb, 1, 0); /* b's first bytes with its fd */
    feed(&r, b + 3, nb - 3, NULL, 0, 0);
    feed(&r, c, nc, fc, 1, 0);
    kvp_frame_t f;
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_int_eq(f.nfds, 2);
    ck_assert_int_eq(f.fds[0], 10);
    ck_assert_int_eq(f.fds[1], 11);
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_int_eq(f.nfds, 1);
    ck_assert_int_eq(f.fds[0], 20);
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_int_eq(f.nfds, 1);
    ck_assert_int_eq(f.fds[0], 30);
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 0);
    ck_assert_int_eq(NDROPPED, 0);
    kvp_frame_reader_free(&r);
}
END_TEST

START_TEST(an_fd_that_came_with_no_frame_is_dropped_once)
{
    kvp_frame_reader_t r;
    reader(&r, 64);
    uint8_t a[16], b[16];
    size_t na = frame(a, "aa"), nb = frame(b, "b");
    int fd = 7;
    /* the fd arrives with the middle of frame a's bytes... */
    feed(&r, a, 2, NULL, 0, 0);
    feed(&r, a + 2, na - 2, &fd, 1, 0);
    kvp_frame_t f;
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_int_eq(f.nfds, 1); /* ...which is still within frame a */
    /* one that arrives with bytes a later frame never claims is dropped at free */
    int late = 8;
    feed(&r, b, 2, &late, 1, 0);
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 0);
    kvp_frame_reader_free(&r);
    ck_assert_int_eq(NDROPPED, 1);
    ck_assert_int_eq(DROPPED[0], 8);
    (void)nb;
}
END_TEST

START_TEST(an_oversize_header_is_refused_with_its_length)
{
    kvp_frame_reader_t r;
    reader(&r, 4096);
    uint8_t h[4];
    kvp_frame_put_len(h, 4097);
    feed(&r, h, 4, NULL, 0, 0);
    ck_assert_int_eq(kvp_frame_reader_ready(&r), 1);
    kvp_frame_t f;
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), KVP_ELIMIT);
    ck_assert_uint_eq(f.len, 4097);
    kvp_frame_reader_free(&r);
}
END_TEST

START_TEST(the_buffer_never_holds_more_than_one_largest_frame)
{
    kvp_frame_reader_t r;
    reader(&r, 100);
    r.grow_bytes = 7;
    uint8_t junk[256];
    memset(junk, 0, sizeof(junk));
    kvp_frame_put_len(junk, 100);
    size_t total = 0;
    uint8_t *p;
    size_t room;
    while (kvp_frame_reader_space(&r, &p, &room) == 0) {
        size_t n = room < 5 ? room : 5;
        memcpy(p, junk + total, n);
        ck_assert_int_eq(kvp_frame_reader_commit(&r, n, NULL, 0), 0);
        total += n;
    }
    ck_assert_uint_eq(total, 104);
    ck_assert_uint_eq(r.cap, 104);
    ck_assert_int_eq(kvp_frame_reader_space(&r, &p, &room), KVP_EBUSY);
    kvp_frame_t f;
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_uint_eq(f.len, 100);
    ck_assert_int_eq(kvp_frame_reader_space(&r, &p, &room), 0); /* room again */
    ck_assert_uint_eq(room, 104);
    kvp_frame_reader_free(&r);
}
END_TEST

START_TEST(an_fd_flood_is_reported_and_the_excess_dropped)
{
    kvp_frame_reader_t r;
    reader(&r, 64);
    int fds[KVP_FRAME_MAX_PENDING_FDS + 3];
    for (int i = 0; i < KVP_FRAME_MAX_PENDING_FDS + 3; i++)
        fds[i] = 100 + i;
    uint8_t a[8];
    size_t na = frame(a, "x");
    feed(&r, a, 2, fds, KVP_FRAME_MAX_PENDING_FDS, 0);
    feed(&r, a + 2, na - 2, fds + KVP_FRAME_MAX_PENDING_FDS, 3, KVP_ELIMIT);
    ck_assert_int_eq(NDROPPED, 3);
    kvp_frame_t f;
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_int_eq(f.nfds, KVP_MAX_FDS_PER_FRAME); /* the frame keeps 16, the rest go */
    ck_assert_int_eq(NDROPPED, 3 + KVP_FRAME_MAX_PENDING_FDS - KVP_MAX_FDS_PER_FRAME);
    kvp_frame_reader_free(&r);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("frame");
    TCase *tc = tcase_create("frame");
    tcase_add_test(tc, frames_arriving_byte_by_byte_are_cut_whole);
    tcase_add_test(tc, each_frame_gets_the_fds_sent_with_its_bytes);
    tcase_add_test(tc, an_fd_that_came_with_no_frame_is_dropped_once);
    tcase_add_test(tc, an_oversize_header_is_refused_with_its_length);
    tcase_add_test(tc, the_buffer_never_holds_more_than_one_largest_frame);
    tcase_add_test(tc, an_fd_flood_is_reported_and_the_excess_dropped);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
