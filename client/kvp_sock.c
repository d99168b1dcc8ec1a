/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_sock.c - framed blocking I/O over a Unix stream socket (see kvp_sock.h). Every read and
 * write is non-blocking (MSG_DONTWAIT) and waits in ppoll() for the time left to the caller's
 * deadline, so a blocking fd and a deadline mix. A frame is read with exact-length reads,
 * never beyond its end: Linux hands SCM_RIGHTS descriptors to the recvmsg() that reads the
 * byte they were attached to, so reading ahead could pull in the next frame's descriptors.
 * The one exception is an answer (kvp_sock_recv_answer), after which the peer sends nothing:
 * its header and payload are read together, and anything past its end is refused.
 */
#include "kvp_sock.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_wire.h"

/* Room for the most descriptors a frame may carry, aligned for struct cmsghdr. */
typedef union {
    char buf[CMSG_SPACE(sizeof(int) * KVP_MAX_FDS_PER_FRAME)];
    struct cmsghdr align;
} cmsg_buf_t;

/* The descriptors received so far while reading one frame. */
typedef struct {
    int fds[KVP_MAX_FDS_PER_FRAME];
    unsigned n;
    int overflow; /* more than a frame may carry arrived (or the kernel truncated them) */
} rx_fds_t;

uint64_t kvp_sock_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t kvp_sock_deadline(uint32_t timeout_ms)
{
    if (timeout_ms == 0)
        return KVP_SOCK_NO_DEADLINE;
    return kvp_sock_now_ns() + (uint64_t)timeout_ms * 1000000ull;
}

/* Waits until fd is ready for `events` or the deadline passes. Readiness includes POLLHUP and
 * POLLERR: the recvmsg/sendmsg that follows reports them. Returns 0, KVP_ETIMEDOUT, -errno. */
static int wait_ready(int fd, short events, uint64_t deadline_ns)
{
    for (;;) {
        struct pollfd p = {.fd = fd, .events = events, .revents = 0};
        struct timespec ts, *tsp = NULL;
        if (deadline_ns != KVP_SOCK_NO_DEADLINE) {
            uint64_t now = kvp_sock_now_ns();
            uint64_t left = deadline_ns > now ? deadline_ns - now : 0;
            ts.tv_sec = (time_t)(left / 1000000000ull);
            ts.tv_nsec = (long)(left % 1000000000ull);
            tsp = &ts;
        }
        int r = ppoll(&p, 1, tsp, NULL);
        if (r > 0)
            return 0;
        if (r == 0)
            return KVP_ETIMEDOUT;
        if (errno != EINTR)
            return -errno;
    }
}

int kvp_sock_spin_readable(int fd, uint64_t spin_ns)
{
    const uint64_t until = kvp_sock_now_ns() + spin_ns;
    struct timespec zero = {0, 0};
    do {
        struct pollfd p = {.fd = fd, .events = POLLIN, .revents = 0};
        if (ppoll(&p, 1, &zero, NULL) > 0)
            return 1;
    } while (spin_ns && kvp_sock_now_ns() < until);
    return 0;
}

int kvp_sock_connect(const char *path, uint32_t timeout_ms, int *fd)
{
    if (!path || !fd)
        return KVP_EINVAL;
    struct sockaddr_un addr;
    size_t path_len = strlen(path);
    if (path_len == 0 || path_len >= sizeof(addr.sun_path))
        return KVP_EINVAL;
    memset(&addr, 0, sizeof(addr));
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, path_len + 1);

    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return -errno;
    /* A blocking AF_UNIX connect waits only while the listener's backlog is full, for at
     * most SO_SNDTIMEO, and then fails with EAGAIN. */
    int rc;
    struct timeval tv = {.tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000};
    if (timeout_ms && setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) < 0) {
        rc = -errno;
        goto fail_close;
    }
    while (connect(s, (const struct sockaddr *)&addr, sizeof(addr)) < 0) {
        /* An interrupted AF_UNIX connect leaves the socket unconnected: try again. */
        if (errno != EINTR) {
            rc = errno == EAGAIN ? KVP_ETIMEDOUT : -errno;
            goto fail_close;
        }
    }
    if (timeout_ms) {
        struct timeval zero = {0, 0};
        if (setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &zero, sizeof(zero)) < 0) {
            rc = -errno;
            goto fail_close;
        }
    }
    *fd = s;
    return 0;

fail_close:
    close(s);
    return rc;
}

int kvp_sock_send_frame(int fd, const void *frame, size_t len, const int *fds, unsigned num_fds,
                        uint64_t deadline_ns)
{
    if (fd < 0 || !frame || len < KVP_FRAME_HDR_BYTES || len - KVP_FRAME_HDR_BYTES > UINT32_MAX ||
        num_fds > KVP_MAX_FDS_PER_FRAME || (num_fds && !fds))
        return KVP_EINVAL;
    if (kvp_frame_get_len(frame) != len - KVP_FRAME_HDR_BYTES)
        return KVP_EINVAL;

    const uint8_t *p = frame;
    size_t off = 0;
    int fds_pending = num_fds > 0;
    cmsg_buf_t cbuf;
    while (off < len) {
        struct iovec iov = {.iov_base = (void *)(p + off), .iov_len = len - off};
        struct msghdr mh;
        memset(&mh, 0, sizeof(mh));
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        if (fds_pending) {
            /* the descriptors ride with the frame's first byte */
            memset(&cbuf, 0, sizeof(cbuf));
            mh.msg_control = cbuf.buf;
            mh.msg_controllen = CMSG_SPACE(sizeof(int) * num_fds);
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int) * num_fds);
            memcpy(CMSG_DATA(cm), fds, sizeof(int) * num_fds);
        }
        ssize_t r = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r >= 0) {
            off += (size_t)r;
            fds_pending = 0;
            continue;
        }
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int rc = wait_ready(fd, POLLOUT, deadline_ns);
            if (rc)
                return rc;
            continue;
        }
        if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN)
            return KVP_ECLOSED;
        return -errno;
    }
    return 0;
}

/* Takes the SCM_RIGHTS descriptors of one received message into set. */
static void collect_fds(struct msghdr *mh, rx_fds_t *set)
{
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(mh); cm; cm = CMSG_NXTHDR(mh, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
            continue;
        size_t n = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        const unsigned char *data = CMSG_DATA(cm);
        for (size_t i = 0; i < n; i++) {
            int f;
            memcpy(&f, data + i * sizeof(int), sizeof(int));
            if (set->n < KVP_MAX_FDS_PER_FRAME) {
                set->fds[set->n++] = f;
            } else {
                close(f);
                set->overflow = 1;
            }
        }
    }
    /* the kernel dropped descriptors that did not fit our buffer */
    if (mh->msg_flags & MSG_CTRUNC)
        set->overflow = 1;
}

/* One non-blocking recvmsg into iov[0 .. iovcnt), collecting descriptors into set, waiting
 * (up to the deadline) while nothing is queued. Returns the bytes read (> 0), KVP_ECLOSED,
 * KVP_ETIMEDOUT or -errno. */
static ssize_t recv_some(int fd, struct iovec *iov, size_t iovcnt, rx_fds_t *set,
                         uint64_t deadline_ns)
{
    cmsg_buf_t cbuf;
    for (;;) {
        struct msghdr mh;
        memset(&mh, 0, sizeof(mh));
        mh.msg_iov = iov;
        mh.msg_iovlen = iovcnt;
        mh.msg_control = cbuf.buf;
        mh.msg_controllen = sizeof(cbuf.buf);
        ssize_t r = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (r > 0) {
            collect_fds(&mh, set);
            return r;
        }
        if (r == 0)
            return KVP_ECLOSED;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int rc = wait_ready(fd, POLLIN, deadline_ns);
            if (rc)
                return rc;
            continue;
        }
        if (errno == ECONNRESET || errno == ENOTCONN)
            return KVP_ECLOSED;
        return -errno;
    }
}

/* Reads exactly n bytes into dst, collecting descriptors into set. wait_first: poll before
 * the first read (nothing is expected to be queued yet). */
static int read_exact(int fd, uint8_t *dst, size_t n, rx_fds_t *set, uint64_t deadline_ns,
                      int wait_first)
{
    size_t got = 0;
    if (wait_first && n) {
        int rc = wait_ready(fd, POLLIN, deadline_ns);
        if (rc)
            return rc;
    }
    while (got < n) {
        struct iovec iov = {.iov_base = dst + got, .iov_len = n - got};
        ssize_t r = recv_some(fd, &iov, 1, set, deadline_ns);
        if (r < 0)
            return (int)r;
        got += (size_t)r;
    }
    return 0;
}

/* Both receives. answer: the peer sends nothing after this frame until it is asked again, so
 * the header and as much of the payload as fits *buf are read together, in one recvmsg when
 * they arrived together; bytes past the frame's end break that promise (KVP_EPROTO). */
static int recv_frame(int fd, uint8_t **buf, size_t *cap, uint32_t *len, uint32_t max_frame_bytes,
                      int *fds, unsigned max_fds, unsigned *num_fds, uint64_t deadline_ns,
                      int answer)
{
    if (fd < 0 || !buf || !cap || !len || (fds && !num_fds) || (!*buf && *cap))
        return KVP_EINVAL;
    if (!fds)
        max_fds = 0;
    if (num_fds)
        *num_fds = 0;

    rx_fds_t set = {.n = 0, .overflow = 0};
    uint8_t hdr[KVP_FRAME_HDR_BYTES];
    size_t have = 0; /* payload bytes already in *buf */
    int rc;
    if (answer && *cap) {
        rc = wait_ready(fd, POLLIN, deadline_ns);
        if (rc)
            goto fail_close_fds;
        struct iovec iov[2] = {{.iov_base = hdr, .iov_len = sizeof(hdr)},
                               {.iov_base = *buf, .iov_len = *cap}};
        ssize_t r = recv_some(fd, iov, 2, &set, deadline_ns);
        if (r < 0) {
            rc = (int)r;
            goto fail_close_fds;
        }
        if ((size_t)r < sizeof(hdr))
            rc = read_exact(fd, hdr + r, sizeof(hdr) - (size_t)r, &set, deadline_ns, 0);
        else
            have = (size_t)r - sizeof(hdr);
    } else {
        rc = read_exact(fd, hdr, sizeof(hdr), &set, deadline_ns, 1);
    }
    if (rc)
        goto fail_close_fds;
    uint32_t n = kvp_frame_get_len(hdr);
    if (n > max_frame_bytes || set.overflow || have > n) {
        rc = KVP_EPROTO;
        goto fail_close_fds;
    }
    if (n > *cap) {
        /* grow geometrically so a stream of growing frames reallocates O(log) times */
        size_t want = *cap * 2 > n ? *cap * 2 : n;
        if (want > max_frame_bytes)
            want = max_frame_bytes;
        uint8_t *nb = realloc(*buf, want); /* keeps the `have` bytes read so far */
        if (!nb) {
            rc = KVP_ENOMEM;
            goto fail_close_fds;
        }
        *buf = nb;
        *cap = want;
    }
    rc = read_exact(fd, *buf + have, n - have, &set, deadline_ns, 0);
    if (rc)
        goto fail_close_fds;
    if (set.overflow) {
        rc = KVP_EPROTO;
        goto fail_close_fds;
    }

    for (unsigned i = 0; i < set.n; i++) {
        if (i < max_fds)
            fds[i] = set.fds[i];
        else
            close(set.fds[i]); /* not asked for: never leak it */
    }
    if (num_fds)
        *num_fds = set.n < max_fds ? set.n : max_fds;
    *len = n;
    return 0;

fail_close_fds:
    for (unsigned i = 0; i < set.n; i++)
        close(set.fds[i]);
    return rc;
}

int kvp_sock_recv_frame(int fd, uint8_t **buf, size_t *cap, uint32_t *len, uint32_t max_frame_bytes,
                        int *fds, unsigned max_fds, unsigned *num_fds, uint64_t deadline_ns)
{
    return recv_frame(fd, buf, cap, len, max_frame_bytes, fds, max_fds, num_fds, deadline_ns, 0);
}

int kvp_sock_recv_answer(int fd, uint8_t **buf, size_t *cap, uint32_t *len,
                         uint32_t max_frame_bytes, int *fds, unsigned max_fds, unsigned *num_fds,
                         uint64_t deadline_ns)
{
    return recv_frame(fd, buf, cap, len, max_frame_bytes, fds, max_fds, num_fds, deadline_ns, 1);
}
