/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_sock.c - kvp_sock, the client's framed socket I/O: frames of every size round-trip over
 * a socketpair, also when they trickle in one byte at a time; descriptors travel with their
 * frame and the ones nobody asked for are closed; oversize frames, end of stream, deadlines and
 * bad arguments give their exact codes; connect reports -errno.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_sock.h"
#include "kvp_test_util.h"
#include "kvp_wire.h"

#define MAX_FRAME (8u << 20)

static void pair(int sv[2])
{
    ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
}

/* A frame (header + payload) in a malloc'd buffer. */
static uint8_t *make_frame(const void *payload, uint32_t n)
{
    uint8_t *f = malloc((size_t)n + KVP_FRAME_HDR_BYTES);
    ck_assert_ptr_nonnull(f);
    kvp_frame_put_len(f, n);
    if (n)
        memcpy(f + KVP_FRAME_HDR_BYTES, payload, n);
    return f;
}

static int count_open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    ck_assert_ptr_nonnull(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        n += e->d_name[0] != '.';
    closedir(d);
    return n - 1; /* the directory's own fd */
}

static int memfd_with(const char *text)
{
    int fd = memfd_create("test-sock", MFD_CLOEXEC);
    ck_assert_int_ge(fd, 0);
    size_t n = strlen(text);
    ck_assert_int_eq(write(fd, text, n), (ssize_t)n);
    return fd;
}

static void expect_contents(int fd, const char *text)
{
    char buf[128] = {0};
    size_t n = strlen(text);
    ck_assert_int_eq(pread(fd, buf, sizeof(buf) - 1, 0), (ssize_t)n);
    ck_assert_str_eq(buf, text);
}

typedef struct {
    int fd;
    const uint8_t *bytes;
    size_t len;
    int one_byte_at_a_time;
} writer_t;

static void *writer_main(void *arg)
{
    writer_t *w = arg;
    for (size_t off = 0; off < w->len;) {
        size_t chunk = w->one_byte_at_a_time ? 1 : w->len - off;
        ssize_t r = write(w->fd, w->bytes + off, chunk);
        if (r <= 0)
            break;
        off += (size_t)r;
        if (w->one_byte_at_a_time && off % 7 == 0)
            usleep(200); /* let the reader catch up and see a partial frame */
    }
    return NULL;
}

START_TEST(frames_of_several_sizes_round_trip)
{
    int sv[2];
    pair(sv);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(11));
    static const uint32_t sizes[] = {0, 1, 3, 100, 4096, 60000};
    uint8_t *buf = NULL;
    size_t cap = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        uint32_t n = sizes[i];
        uint8_t *payload = malloc(n + 1);
        kvp_rng_fill(&rng, payload, n);
        uint8_t *frame = make_frame(payload, n);
        ck_assert_int_eq(
            kvp_sock_send_frame(sv[0], frame, n + 4u, NULL, 0, kvp_sock_deadline(5000)), 0);
        uint32_t len = 12345;
        unsigned nfds = 9;
        int fds[2];
        ck_assert_int_eq(kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, fds, 2, &nfds,
                                             kvp_sock_deadline(5000)),
                         0);
        ck_assert_uint_eq(len, n);
        ck_assert_uint_eq(nfds, 0);
        ck_assert_uint_ge(cap, n);
        if (n)
            ck_assert_int_eq(memcmp(buf, payload, n), 0);
        free(frame);
        free(payload);
    }
    free(buf);
    close(sv[0]);
    close(sv[1]);
}
END_TEST

START_TEST(large_frame_round_trips_while_the_sender_blocks)
{
    int sv[2];
    pair(sv);
    uint32_t n = 3u << 20; /* far above the socket buffer */
    uint8_t *payload = malloc(n);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(12));
    kvp_rng_fill(&rng, payload, n);
    uint8_t *frame = make_frame(payload, n);
    writer_t w = {sv[0], frame, (size_t)n + 4, 0};
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, writer_main, &w), 0);
    uint8_t *buf = NULL;
    size_t cap = 0;
    uint32_t len = 0;
    ck_assert_int_eq(kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, NULL, 0, NULL,
                                         kvp_sock_deadline(20000)),
                     0);
    pthread_join(th, NULL);
    ck_assert_uint_eq(len, n);
    ck_assert_int_eq(memcmp(buf, payload, n), 0);
    free(buf);
    free(frame);
    free(payload);
    close(sv[0]);
    close(sv[1]);
}
END_TEST

START_TEST(frames_written_byte_by_byte_are_reassembled_exactly)
{
    int sv[2];
    pair(sv);
    /* two frames back to back: the reader must stop exactly at the first one's end */
    const char *a = "first frame payload";
    const char *b = "second, a little longer, frame payload";
    size_t la = strlen(a), lb = strlen(b);
    uint8_t *stream = malloc(la + lb + 8);
    kvp_frame_put_len(stream, (uint32_t)la);
    memcpy(stream + 4, a, la);
    kvp_frame_put_len(stream + 4 + la, (uint32_t)lb);
    memcpy(stream + 8 + la, b, lb);
    writer_t w = {sv[0], stream, la + lb + 8, 1};
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, writer_main, &w), 0);

    uint8_t *buf = NULL;
    size_t cap = 0;
    uint32_t len = 0;
    ck_assert_int_eq(kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, NULL, 0, NULL,
                                         kvp_sock_deadline(10000)),
                     0);
    ck_assert_uint_eq(len, la);
    ck_assert_int_eq(memcmp(buf, a, la), 0);
    ck_assert_int_eq(kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, NULL, 0, NULL,
                                         kvp_sock_deadline(10000)),
                     0);
    ck_assert_uint_eq(len, lb);
    ck_assert_int_eq(memcmp(buf, b, lb), 0);
    pthread_join(th, NULL);
    free(buf);
    free(stream);
    close(sv[0]);
    close(sv[1]);
}
END_TEST

START_TEST(a_memfd_travels_with_its_frame)
{
    int sv[2];
    pair(sv);
    int mfd = memfd_with("kvpool shared bytes");
    uint8_t *frame = make_frame("hi", 2);
    ck_assert_int_eq(kvp_sock_send_frame(sv[0], frame, 6, &mfd, 1, kvp_sock_deadline(5000)), 0);

    uint8_t *buf = NULL;
    size_t cap = 0;
    uint32_t len = 0;
    int fds[4] = {-1, -1, -1, -1};
    unsigned nfds = 0;
    ck_assert_int_eq(kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, fds, 4, &nfds,
                                         kvp_sock_deadline(5000)),
                     0);
    ck_assert_uint_eq(len, 2);
    ck_assert_int_eq(memcmp(buf, "hi", 2), 0);
    ck_assert_uint_eq(nfds, 1);
    ck_assert_int_ge(fds[0], 0);
    ck_assert_int_ne(fds[0], mfd);
    ck_assert_int_eq(fds[1], -1);
    expect_contents(fds[0], "kvpool shared bytes");
    /* close-on-exec, and the same file: a write through one shows through the other */
    ck_assert_int_eq(fcntl(fds[0], F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
    ck_assert_int_eq(pwrite(fds[0], "K", 1, 0), 1);
    expect_contents(mfd, "Kvpool shared bytes");
    close(fds[0]);
    close(mfd);
    free(buf);
    free(frame);
    close(sv[0]);
    close(sv[1]);
}
END_TEST

START_TEST(several_fds_arrive_in_order_even_when_the_frame_is_read_in_pieces)
{
    int sv[2];
    pair(sv);
    int m[3] = {memfd_with("zero"), memfd_with("one"), memfd_with("two")};
    uint32_t n = 1u << 20; /* the frame needs several reads */
    uint8_t *payload = calloc(1, n);
    uint8_t *frame = make_frame(payload, n);
    int rc = 1;
    /* sender in the background: the frame is larger than the socket buffer */
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(sv[1]);
        rc = kvp_sock_send_frame(sv[0], frame, (size_t)n + 4, m, 3, kvp_sock_deadline(10000));
        _exit(rc == 0 ? 0 : 1);
    }
    close(sv[0]);
    uint8_t *buf = NULL;
    size_t cap = 0;
    uint32_t len = 0;
    int fds[KVP_MAX_FDS_PER_FRAME];
    unsigned nfds = 0;
    ck_assert_int_eq(kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, fds,
                                         KVP_MAX_FDS_PER_FRAME, &nfds, kvp_sock_deadline(10000)),
                     0);
    ck_assert_uint_eq(len, n);
    ck_assert_uint_eq(nfds, 3);
    expect_contents(fds[0], "zero");
    expect_contents(fds[1], "one");
    expect_contents(fds[2], "two");
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    for (int i = 0; i < 3; i++) {
        close(fds[i]);
        close(m[i]);
    }
    free(buf);
    free(frame);
    free(payload);
    close(sv[1]);
}
END_TEST

START_TEST(fds_nobody_asked_for_are_closed)
{
    int sv[2];
    pair(sv);
    int before = count_open_fds();
    uint8_t *frame = make_frame("x", 1);
    uint8_t *buf = NULL;
    size_t cap = 0;
    uint32_t len = 0;

    /* no room at all: both are closed */
    int m[3] = {memfd_with("a"), memfd_with("b"), memfd_with("c")};
    ck_assert_int_eq(kvp_sock_send_frame(sv[0], frame, 5, m, 2, kvp_sock_deadline(5000)), 0);
    ck_assert_int_eq(kvp_sock_send_frame(sv[0], frame, 5, m, 3, kvp_sock_deadline(5000)), 0);
    for (int i = 0; i < 3; i++)
        close(m[i]);
    ck_assert_int_eq(count_open_fds(), before);
    ck_assert_int_eq(kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, NULL, 0, NULL,
                                         kvp_sock_deadline(5000)),
                     0);
    ck_assert_int_eq(count_open_fds(), before);

    /* room for one of three: the first is handed out, the other two closed */
    int fd = -1;
    unsigned nfds = 0;
    ck_assert_int_eq(kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, &fd, 1, &nfds,
                                         kvp_sock_deadline(5000)),
                     0);
    ck_assert_uint_eq(nfds, 1);
    expect_contents(fd, "a");
    ck_assert_int_eq(count_open_fds(), before + 1);
    close(fd);
    ck_assert_int_eq(count_open_fds(), before);
    free(buf);
    free(frame);
    close(sv[0]);
    close(sv[1]);
}
END_TEST

START_TEST(frame_above_the_maximum_is_a_protocol_error)
{
    int sv[2];
    pair(sv);
    int before = count_open_fds();
    uint8_t hdr[4];
    kvp_frame_put_len(hdr, 1025);
    int m = memfd_with("attached to a rejected frame");
    /* an fd attached to the oversize frame must not leak either */
    struct iovec iov = {hdr, 4};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } cb;
    memset(&cb, 0, sizeof(cb)); /* the padding goes to the kernel too (valgrind) */
    struct msghdr mh = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cb.buf, .msg_controllen = sizeof(cb.buf)};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &m, sizeof(int));
    ck_assert_int_eq(sendmsg(sv[0], &mh, 0), 4);
    close(m);

    uint8_t *buf = NULL;
    size_t cap = 0;
    uint32_t len = 0;
    int fd = -1;
    unsigned nfds = 7;
    ck_assert_int_eq(
        kvp_sock_recv_frame(sv[1], &buf, &cap, &len, 1024, &fd, 1, &nfds, kvp_sock_deadline(5000)),
        KVP_EPROTO);
    ck_assert_uint_eq(nfds, 0);
    ck_assert_int_eq(fd, -1);
    ck_assert_int_eq(count_open_fds(), before);
    ck_assert_ptr_null(buf); /* nothing allocated for it */

    /* exactly the maximum is fine */
    uint8_t *ok = calloc(1, 1024 + 4);
    kvp_frame_put_len(ok, 1024);
    int sv2[2];
    pair(sv2);
    writer_t w = {sv2[0], ok, 1028, 0};
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, writer_main, &w), 0);
    ck_assert_int_eq(
        kvp_sock_recv_frame(sv2[1], &buf, &cap, &len, 1024, NULL, 0, NULL, kvp_sock_deadline(5000)),
        0);
    ck_assert_uint_eq(len, 1024);
    pthread_join(th, NULL);
    free(ok);
    free(buf);
    close(sv[0]);
    close(sv[1]);
    close(sv2[0]);
    close(sv2[1]);
}
END_TEST

START_TEST(end_of_stream_is_closed_before_and_inside_a_frame)
{
    int sv[2];
    pair(sv);
    uint8_t *buf = NULL;
    size_t cap = 0;
    uint32_t len = 0;
    close(sv[0]);
    ck_assert_int_eq(kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, NULL, 0, NULL,
                                         kvp_sock_deadline(5000)),
                     KVP_ECLOSED);
    close(sv[1]);

    pair(sv);
    uint8_t part[7];
    kvp_frame_put_len(part, 10);
    memcpy(part + 4, "abc", 3); /* 3 of the 10 bytes, then the peer goes away */
    ck_assert_int_eq(write(sv[0], part, sizeof(part)), (ssize_t)sizeof(part));
    close(sv[0]);
    ck_assert_int_eq(kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, NULL, 0, NULL,
                                         kvp_sock_deadline(5000)),
                     KVP_ECLOSED);
    free(buf);
    close(sv[1]);
}
END_TEST

START_TEST(deadline_gives_timedout_before_and_inside_a_frame)
{
    int sv[2];
    pair(sv);
    uint8_t *buf = NULL;
    size_t cap = 0;
    uint32_t len = 0;
    uint64_t t0 = kvp_sock_now_ns();
    ck_assert_int_eq(kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, NULL, 0, NULL,
                                         kvp_sock_deadline(50)),
                     KVP_ETIMEDOUT);
    ck_assert_uint_ge(kvp_sock_now_ns() - t0, 50u * 1000000u);

    uint8_t part[6];
    kvp_frame_put_len(part, 10);
    memcpy(part + 4, "ab", 2);
    ck_assert_int_eq(write(sv[0], part, sizeof(part)), (ssize_t)sizeof(part));
    ck_assert_int_eq(kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, NULL, 0, NULL,
                                         kvp_sock_deadline(50)),
                     KVP_ETIMEDOUT);
    free(buf);
    close(sv[0]);
    close(sv[1]);
}
END_TEST

/* An answer is read header and payload together: the same frames, fds and codes as
 * kvp_sock_recv_frame, whatever the buffer (none yet, smaller than the frame, larger), also
 * when it trickles in; bytes past the answer are a protocol error and its fds are closed. */
START_TEST(answers_read_in_one_go_keep_frames_fds_and_codes)
{
    int sv[2];
    pair(sv);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(13));
    static const uint32_t sizes[] = {0, 1, 3, 100, 4096, 60000, 3u << 20};
    static const size_t caps[] = {0, 2, 64, 5000, 1u << 16};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        for (size_t k = 0; k < sizeof(caps) / sizeof(caps[0]); k++) {
            uint32_t n = sizes[i];
            uint8_t *payload = malloc(n + 1);
            kvp_rng_fill(&rng, payload, n);
            uint8_t *frame = make_frame(payload, n);
            int mfd = memfd_with("an answer's fd");
            writer_t w = {sv[0], frame, (size_t)n + 4, 0};
            pthread_t th;
            int via_thread = n > 60000; /* above the socket buffer: the sender blocks */
            if (via_thread)
                ck_assert_int_eq(pthread_create(&th, NULL, writer_main, &w), 0);
            else
                ck_assert_int_eq(
                    kvp_sock_send_frame(sv[0], frame, n + 4u, &mfd, k % 2, kvp_sock_deadline(5000)),
                    0);
            size_t cap = caps[k];
            uint8_t *buf = cap ? malloc(cap) : NULL;
            uint32_t len = 12345;
            unsigned nfds = 9;
            int fds[2] = {-1, -1};
            ck_assert_int_eq(kvp_sock_recv_answer(sv[1], &buf, &cap, &len, MAX_FRAME, fds, 2, &nfds,
                                                  kvp_sock_deadline(20000)),
                             0);
            if (via_thread)
                pthread_join(th, NULL);
            ck_assert_uint_eq(len, n);
            ck_assert_uint_ge(cap, n);
            if (n)
                ck_assert_int_eq(memcmp(buf, payload, n), 0);
            ck_assert_uint_eq(nfds, via_thread ? 0 : k % 2);
            if (nfds) {
                expect_contents(fds[0], "an answer's fd");
                close(fds[0]);
            }
            close(mfd);
            free(buf);
            free(frame);
            free(payload);
        }
    }

    /* one byte at a time: the header itself arrives in pieces */
    const char *a = "an answer that trickles in";
    size_t la = strlen(a);
    uint8_t *fa = make_frame(a, (uint32_t)la);
    writer_t w = {sv[0], fa, la + 4, 1};
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, writer_main, &w), 0);
    size_t cap = 8;
    uint8_t *buf = malloc(cap);
    uint32_t len = 0;
    ck_assert_int_eq(kvp_sock_recv_answer(sv[1], &buf, &cap, &len, MAX_FRAME, NULL, 0, NULL,
                                          kvp_sock_deadline(10000)),
                     0);
    pthread_join(th, NULL);
    ck_assert_uint_eq(len, la);
    ck_assert_int_eq(memcmp(buf, a, la), 0);

    /* a second frame right behind the answer, with an fd, read with it (the buffer has room):
     * refused, nothing leaks */
    cap = 1024;
    buf = realloc(buf, cap);
    int before = count_open_fds();
    int mfd = memfd_with("behind the answer");
    uint8_t *fb = make_frame("next", 4);
    ck_assert_int_eq(kvp_sock_send_frame(sv[0], fa, la + 4, NULL, 0, kvp_sock_deadline(5000)), 0);
    ck_assert_int_eq(kvp_sock_send_frame(sv[0], fb, 8, &mfd, 1, kvp_sock_deadline(5000)), 0);
    close(mfd);
    int fd = -1;
    unsigned nfds = 0;
    ck_assert_int_eq(kvp_sock_recv_answer(sv[1], &buf, &cap, &len, MAX_FRAME, &fd, 1, &nfds,
                                          kvp_sock_deadline(5000)),
                     KVP_EPROTO);
    ck_assert_uint_eq(nfds, 0);
    ck_assert_int_eq(count_open_fds(), before);

    /* oversize, deadline and end of stream: kvp_sock_recv_frame's codes */
    uint8_t big[4];
    kvp_frame_put_len(big, 1025);
    ck_assert_int_eq(write(sv[0], big, 4), 4);
    ck_assert_int_eq(
        kvp_sock_recv_answer(sv[1], &buf, &cap, &len, 1024, NULL, 0, NULL, kvp_sock_deadline(5000)),
        KVP_EPROTO);
    close(sv[0]);
    close(sv[1]);
    pair(sv);
    uint64_t t0 = kvp_sock_now_ns();
    ck_assert_int_eq(kvp_sock_recv_answer(sv[1], &buf, &cap, &len, MAX_FRAME, NULL, 0, NULL,
                                          kvp_sock_deadline(50)),
                     KVP_ETIMEDOUT);
    ck_assert_uint_ge(kvp_sock_now_ns() - t0, 50u * 1000000u);
    uint8_t part[6];
    kvp_frame_put_len(part, 10);
    memcpy(part + 4, "ab", 2);
    ck_assert_int_eq(write(sv[0], part, sizeof(part)), (ssize_t)sizeof(part));
    close(sv[0]);
    ck_assert_int_eq(kvp_sock_recv_answer(sv[1], &buf, &cap, &len, MAX_FRAME, NULL, 0, NULL,
                                          kvp_sock_deadline(5000)),
                     KVP_ECLOSED);
    free(buf);
    free(fa);
    free(fb);
    close(sv[1]);
}
END_TEST

START_TEST(send_times_out_when_the_peer_never_reads)
{
    int sv[2];
    pair(sv);
    int small = 4096;
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
    uint32_t n = 4u << 20;
    uint8_t *frame = calloc(1, (size_t)n + 4);
    kvp_frame_put_len(frame, n);
    ck_assert_int_eq(
        kvp_sock_send_frame(sv[0], frame, (size_t)n + 4, NULL, 0, kvp_sock_deadline(50)),
        KVP_ETIMEDOUT);
    free(frame);
    close(sv[0]);
    close(sv[1]);
}
END_TEST

START_TEST(send_to_a_closed_peer_is_closed_without_sigpipe)
{
    int sv[2];
    pair(sv);
    close(sv[1]);
    uint8_t *frame = make_frame("ping", 4);
    /* SIGPIPE would kill this test process: MSG_NOSIGNAL turns it into an error */
    ck_assert_int_eq(kvp_sock_send_frame(sv[0], frame, 8, NULL, 0, kvp_sock_deadline(1000)),
                     KVP_ECLOSED);
    free(frame);
    close(sv[0]);
}
END_TEST

START_TEST(send_and_recv_reject_bad_arguments)
{
    int sv[2];
    pair(sv);
    uint8_t *frame = make_frame("abcd", 4);
    int fds[KVP_MAX_FDS_PER_FRAME + 1] = {0};
    ck_assert_int_eq(kvp_sock_send_frame(sv[0], frame, 7, NULL, 0, KVP_SOCK_NO_DEADLINE),
                     KVP_EINVAL); /* header says 4, 3 given */
    ck_assert_int_eq(kvp_sock_send_frame(sv[0], frame, 3, NULL, 0, KVP_SOCK_NO_DEADLINE),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_sock_send_frame(sv[0], NULL, 8, NULL, 0, KVP_SOCK_NO_DEADLINE),
                     KVP_EINVAL);
    ck_assert_int_eq(
        kvp_sock_send_frame(sv[0], frame, 8, fds, KVP_MAX_FDS_PER_FRAME + 1, KVP_SOCK_NO_DEADLINE),
        KVP_EINVAL);
    ck_assert_int_eq(kvp_sock_send_frame(sv[0], frame, 8, NULL, 1, KVP_SOCK_NO_DEADLINE),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_sock_send_frame(-1, frame, 8, NULL, 0, KVP_SOCK_NO_DEADLINE), KVP_EINVAL);
    uint8_t *buf = NULL;
    size_t cap = 0;
    uint32_t len;
    ck_assert_int_eq(kvp_sock_recv_frame(sv[1], NULL, &cap, &len, MAX_FRAME, NULL, 0, NULL,
                                         KVP_SOCK_NO_DEADLINE),
                     KVP_EINVAL);
    ck_assert_int_eq(
        kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, fds, 1, NULL, KVP_SOCK_NO_DEADLINE),
        KVP_EINVAL);
    /* nothing was sent by the rejected calls */
    ck_assert_int_eq(kvp_sock_recv_frame(sv[1], &buf, &cap, &len, MAX_FRAME, NULL, 0, NULL,
                                         kvp_sock_deadline(20)),
                     KVP_ETIMEDOUT);
    free(frame);
    close(sv[0]);
    close(sv[1]);
}
END_TEST

static void temp_socket_path(char *buf, size_t len, const char *tag)
{
    snprintf(buf, len, "/tmp/kvp_test_sock_%d_%s.sock", (int)getpid(), tag);
    unlink(buf);
}

START_TEST(connect_reports_errno_and_path_errors)
{
    int fd = -7;
    char longpath[200];
    memset(longpath, 'a', sizeof(longpath) - 1);
    longpath[0] = '/';
    longpath[sizeof(longpath) - 1] = '\0';
    ck_assert_int_eq(kvp_sock_connect(longpath, 100, &fd), KVP_EINVAL);
    ck_assert_int_eq(kvp_sock_connect("", 100, &fd), KVP_EINVAL);
    ck_assert_int_eq(kvp_sock_connect(NULL, 100, &fd), KVP_EINVAL);
    char path[108];
    temp_socket_path(path, sizeof(path), "missing");
    ck_assert_int_eq(kvp_sock_connect(path, 100, &fd), -ENOENT);

    /* a socket file with nobody listening */
    temp_socket_path(path, sizeof(path), "refused");
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
    ck_assert_int_eq(bind(s, (struct sockaddr *)&addr, sizeof(addr)), 0);
    ck_assert_int_eq(kvp_sock_connect(path, 100, &fd), -ECONNREFUSED);
    ck_assert_int_eq(fd, -7);
    close(s);
    unlink(path);
}
END_TEST

START_TEST(connect_to_a_listener_gives_a_cloexec_stream)
{
    char path[108];
    temp_socket_path(path, sizeof(path), "listen");
    int l = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
    ck_assert_int_eq(bind(l, (struct sockaddr *)&addr, sizeof(addr)), 0);
    ck_assert_int_eq(listen(l, 4), 0);
    int fd = -1;
    ck_assert_int_eq(kvp_sock_connect(path, 1000, &fd), 0);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(fcntl(fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
    int a = accept(l, NULL, NULL);
    ck_assert_int_ge(a, 0);
    uint8_t *frame = make_frame("over a real socket", 18);
    ck_assert_int_eq(kvp_sock_send_frame(fd, frame, 22, NULL, 0, kvp_sock_deadline(1000)), 0);
    uint8_t *buf = NULL;
    size_t cap = 0;
    uint32_t len = 0;
    ck_assert_int_eq(
        kvp_sock_recv_frame(a, &buf, &cap, &len, MAX_FRAME, NULL, 0, NULL, kvp_sock_deadline(1000)),
        0);
    ck_assert_uint_eq(len, 18);
    ck_assert_int_eq(memcmp(buf, "over a real socket", 18), 0);
    free(buf);
    free(frame);
    close(a);
    close(fd);
    close(l);
    unlink(path);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("sock");
    TCase *tc = tcase_create("sock");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, frames_of_several_sizes_round_trip);
    tcase_add_test(tc, large_frame_round_trips_while_the_sender_blocks);
    tcase_add_test(tc, frames_written_byte_by_byte_are_reassembled_exactly);
    tcase_add_test(tc, a_memfd_travels_with_its_frame);
    tcase_add_test(tc, several_fds_arrive_in_order_even_when_the_frame_is_read_in_pieces);
    tcase_add_test(tc, fds_nobody_asked_for_are_closed);
    tcase_add_test(tc, frame_above_the_maximum_is_a_protocol_error);
    tcase_add_test(tc, end_of_stream_is_closed_before_and_inside_a_frame);
    tcase_add_test(tc, deadline_gives_timedout_before_and_inside_a_frame);
    tcase_add_test(tc, answers_read_in_one_go_keep_frames_fds_and_codes);
    tcase_add_test(tc, send_times_out_when_the_peer_never_reads);
    tcase_add_test(tc, send_to_a_closed_peer_is_closed_without_sigpipe);
    tcase_add_test(tc, send_and_recv_reject_bad_arguments);
    tcase_add_test(tc, connect_reports_errno_and_path_errors);
    tcase_add_test(tc, connect_to_a_listener_gives_a_cloexec_stream);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
