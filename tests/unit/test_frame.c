/* SPDX-License-Identifier: Apache-2.0 */
/* test_frame.c - the daemon's frame reader (server/kvp_frame.h): frames cut from a stream that
 * arrives in any pieces, each frame with exactly the fds sent with it, oversize headers, fd
 * floods and the bound on the buffer. Fds here are made-up numbers; "dropped" ones are
 * recorded instead of closed. */
#include <check.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

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

/* Feeds bytes as one read (with fds that came with it). */
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

/* One read holding all of a frame without fds and the start of the next one, whose fd came
 * with that read: the fd is the second frame's (the read's last byte is in it). */
START_TEST(fds_go_to_the_frame_where_their_read_ends)
{
    kvp_frame_reader_t r;
    reader(&r, 64);
    uint8_t s2[32];
    size_t na = frame(s2, "plain");
    size_t nb = frame(s2 + na, "with-fd");
    int fd = 40;
    feed(&r, s2, na + 3, &fd, 1, 0);
    feed(&r, s2 + na + 3, nb - 3, NULL, 0, 0);
    kvp_frame_t f;
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_uint_eq(f.len, 5);
    ck_assert_int_eq(f.nfds, 0);
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_uint_eq(f.len, 7);
    ck_assert_int_eq(f.nfds, 1);
    ck_assert_int_eq(f.fds[0], 40);
    kvp_frame_reader_free(&r);
    ck_assert_int_eq(NDROPPED, 0);
}
END_TEST

/* The kernel behaviour the rule above stands on, on a real socket pair: a client pipelines a
 * frame without fds and one with an fd (each its own sendmsg, the fd on the second's first
 * byte), the daemon's one recvmsg with room for both returns both frames' bytes and the fd,
 * and the reader gives the fd to the second frame; a third frame's fd, in a read of its own,
 * stays its own. */
static void send_part(int sock, const uint8_t *b, size_t n, int fd)
{
    struct iovec iov = {(void *)b, n};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
    char cbuf[CMSG_SPACE(sizeof(int))];
    if (fd >= 0) {
        memset(cbuf, 0, sizeof(cbuf));
        m.msg_control = cbuf;
        m.msg_controllen = sizeof(cbuf);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof(int));
    }
    ck_assert_int_eq(sendmsg(sock, &m, 0), (ssize_t)n);
}

/* One recvmsg into the reader, as the server does; returns the bytes read. */
static ssize_t recv_into(int sock, kvp_frame_reader_t *r)
{
    uint8_t *p;
    size_t room;
    ck_assert_int_eq(kvp_frame_reader_space(r, &p, &room), 0);
    struct iovec iov = {p, room};
    char cbuf[CMSG_SPACE(sizeof(int) * 4)];
    struct msghdr m = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf)};
    ssize_t n = recvmsg(sock, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    ck_assert_int_gt(n, 0);
    int fds[4], nfds = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm; cm = CMSG_NXTHDR(&m, cm))
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS)
            for (size_t i = 0; i < (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int) && nfds < 4; i++)
                memcpy(&fds[nfds++], CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
    ck_assert_int_eq(kvp_frame_reader_commit(r, (size_t)n, fds, nfds), 0);
    return n;
}

START_TEST(a_pipelined_frame_keeps_its_fd_on_a_real_socket)
{
    int sv[2];
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    int carried = open("/dev/null", O_RDONLY | O_CLOEXEC), third = dup(carried);
    ck_assert_int_ge(carried, 0);
    ck_assert_int_ge(third, 0);
    uint8_t a[32], b[32], c[32];
    size_t na = frame(a, "ping"), nb = frame(b, "register"), nc = frame(c, "again");
    send_part(sv[0], a, na, -1);
    send_part(sv[0], b, nb, carried);
    send_part(sv[0], c, nc, third);
    kvp_frame_reader_t r;
    reader(&r, 64);
    r.grow_bytes = 256; /* room for all three: the kernel alone decides where reads end */
    ck_assert_int_eq(recv_into(sv[1], &r), (ssize_t)(na + nb)); /* a and b, then it stops */
    ck_assert_int_eq(recv_into(sv[1], &r), (ssize_t)nc);
    kvp_frame_t f;
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_uint_eq(f.len, 4);
    ck_assert_int_eq(f.nfds, 0);
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_uint_eq(f.len, 8);
    ck_assert_int_eq(f.nfds, 1);
    struct stat st;
    ck_assert_int_eq(fstat(f.fds[0], &st), 0);
    ck_assert(S_ISCHR(st.st_mode)); /* /dev/null came through */
    close(f.fds[0]);
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_uint_eq(f.len, 5);
    ck_assert_int_eq(f.nfds, 1);
    close(f.fds[0]);
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 0);
    kvp_frame_reader_free(&r);
    ck_assert_int_eq(NDROPPED, 0);
    close(carried), close(third), close(sv[0]), close(sv[1]);
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

START_TEST(an_fd_flood_is_reported_and_all_its_fds_dropped)
{
    kvp_frame_reader_t r;
    reader(&r, 64);
    int fds[16];
    for (int i = 0; i < 16; i++)
        fds[i] = 100 + i;
    uint8_t a[8];
    size_t na = frame(a, "x");
    /* the attack of issue #15: one byte of a header with 16 fds, twice */
    feed(&r, a, 1, fds, 16, KVP_ELIMIT);
    feed(&r, a + 1, 1, fds, 16, KVP_ELIMIT);
    ck_assert_int_eq(NDROPPED, 32);
    ck_assert_int_eq(r.nfds, 0);                        /* nothing parked */
    ck_assert_uint_eq(kvp_frame_reader_pending(&r), 2); /* the bytes are kept */
    feed(&r, a + 2, na - 2, NULL, 0, 0);
    kvp_frame_t f;
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_int_eq(f.nfds, 0);
    kvp_frame_reader_free(&r);
}
END_TEST

START_TEST(a_connection_parks_at_most_four_fds)
{
    kvp_frame_reader_t r;
    reader(&r, 64);
    int fds[] = {100, 101, 102, 103, 104};
    uint8_t a[8];
    size_t na = frame(a, "x");
    feed(&r, a, 1, fds, 2, 0);
    feed(&r, a + 1, 1, fds + 2, 2, 0); /* four pending: the bound */
    ck_assert_int_eq(NDROPPED, 0);
    feed(&r, a + 2, 1, fds + 4, 1, KVP_ELIMIT); /* a fifth is dropped, alone */
    ck_assert_int_eq(NDROPPED, 1);
    ck_assert_int_eq(DROPPED[0], 104);
    feed(&r, a + 3, na - 3, NULL, 0, 0);
    kvp_frame_t f;
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_int_eq(f.nfds, 4);
    for (int i = 0; i < 4; i++)
        ck_assert_int_eq(f.fds[i], 100 + i);
    kvp_frame_reader_free(&r);
    ck_assert_int_eq(NDROPPED, 1);
}
END_TEST

START_TEST(growth_is_announced_and_trim_gives_a_large_frame_back)
{
    kvp_frame_reader_t r;
    reader(&r, 100);
    r.grow_bytes = 7;
    ck_assert_uint_eq(kvp_frame_reader_growth(&r), 7); /* nothing allocated yet */
    uint8_t big[104];
    memset(big, 'z', sizeof(big));
    kvp_frame_put_len(big, 100);
    size_t total = 0;
    uint8_t *p;
    size_t room;
    while (total < sizeof(big)) {
        ck_assert_int_eq(kvp_frame_reader_space(&r, &p, &room), 0);
        size_t n = room < sizeof(big) - total ? room : sizeof(big) - total;
        memcpy(p, big + total, n);
        ck_assert_int_eq(kvp_frame_reader_commit(&r, n, NULL, 0), 0);
        total += n;
        /* full after each read: the next step is 7 bytes, the last one 6 (up to 104) */
        size_t want = total == 104 ? 0 : r.cap == 98 ? 6 : 7;
        ck_assert_uint_eq(kvp_frame_reader_growth(&r), want);
    }
    ck_assert_uint_eq(r.cap, 104);
    kvp_frame_reader_trim(&r); /* a whole frame pending: kept */
    ck_assert_uint_eq(r.cap, 104);
    kvp_frame_t f;
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_uint_eq(f.len, 100);
    kvp_frame_reader_trim(&r);
    ck_assert_uint_eq(r.cap, 7);
    ck_assert_uint_eq(kvp_frame_reader_pending(&r), 0);
    /* the reader still works after the shrink */
    uint8_t a[8];
    size_t na = frame(a, "ok");
    feed(&r, a, na, NULL, 0, 0);
    ck_assert_int_eq(kvp_frame_reader_next(&r, &f), 1);
    ck_assert_uint_eq(f.len, 2);
    ck_assert_int_eq(memcmp(f.payload, "ok", 2), 0);
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
    tcase_add_test(tc, fds_go_to_the_frame_where_their_read_ends);
    tcase_add_test(tc, a_pipelined_frame_keeps_its_fd_on_a_real_socket);
    tcase_add_test(tc, an_oversize_header_is_refused_with_its_length);
    tcase_add_test(tc, the_buffer_never_holds_more_than_one_largest_frame);
    tcase_add_test(tc, an_fd_flood_is_reported_and_all_its_fds_dropped);
    tcase_add_test(tc, a_connection_parks_at_most_four_fds);
    tcase_add_test(tc, growth_is_announced_and_trim_gives_a_large_frame_back);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
