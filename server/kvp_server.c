/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_server.c - listening socket, connections, framing, fd passing and the write path of
 * kvpoold (see kvp_server.h). The read path reads like a sentence: on_readable -> read_some
 * (recvmsg into the frame reader, fds noted with the stream offset they arrived at) ->
 * kvp_frame_reader_next (kvp_frame.h: cut one frame with its fds) ->
 * handle_frame (decode, replay or dispatch) -> send_response (encode, queue, sendmsg).
 *
 * A connection answers in order: while one of its calls is suspended (an Append's job runs on
 * the rpc layer's worker threads until on_resume), its later
 * frames wait in its read buffer and it stops reading once a full frame is buffered (so one
 * client's flood costs it, not the daemon). A client that does not read its answers is dropped
 * when its unsent bytes pass max_queued_bytes.
 *
 * Hostile clients (issue #15). Backpressure: while a connection has OUTPUT_PAUSE_BYTES of
 * answers unsent (or any, once the daemon's budget max_buffered_bytes is spent) it is neither
 * read nor are its buffered requests processed; it resumes as its client reads. The budget
 * counts every read buffer and every unsent answer; a read buffer may always take its first
 * KVP_FRAME_GROW_BYTES, beyond that it grows only within the budget, else the connection
 * WAITS (not read) until memory comes back: nothing is lost, and the holders of the budget
 * are partial frames that the frame deadline closes, or answers that drain. Deadlines (a
 * sweep timer): a connection without a completed Hello after hello_timeout_ms, or with a
 * partial frame older than frame_timeout_ms (counted while the daemon reads it), is answered
 * with an error and closed. A peer uid other than the daemon's own and root holds at most
 * uid_max_connections. Fds: see kvp_frame.h (at most 4 a frame, 4 parked a connection); a
 * message over that is answered with an error and the connection closed.
 */
#include "kvp_server.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "kvp_access.h"
#include "kvp_error.h"
#include "kvp_frame.h"
#include "kvp_log.h"
#include "kvp_wire.h"

typedef struct out_frame {
    struct out_frame *next;
    uint8_t *buf;
    size_t len, off;
    int fds[KVP_MAX_FDS_PER_FRAME]; /* borrowed from the backend: never closed here */
    int nfds;
} out_frame_t;

typedef struct conn {
    uv_poll_t poll;
    kvp_server_t *srv;
    struct conn *next, *prev;
    int fd;
    kvp_session_t *sess;
    kvp_frame_reader_t rd; /* received bytes and fds, cut into frames */
    out_frame_t *out_head, *out_tail;
    uint64_t queued;
    int events;
    int busy;    /* a call of this connection is suspended (its job runs off the loop) */
    int closing; /* close once the job (if any) is back */
    int close_after_flush;
    uint32_t uid;         /* SO_PEERCRED at accept */
    uint64_t accepted_ms; /* for the Hello deadline */
    uint64_t partial_off; /* 1 + stream offset of the partial frame being timed; 0: none */
    uint64_t partial_ms;  /* when that partial frame was first seen while reading */
    uint64_t acct_in;     /* rd.cap and queued as counted in srv->buffered */
    uint64_t acct_out;
    int wait_budget; /* not read until the buffer budget has room */
} conn_t;

/* Unsent answers above which a connection is not read and its requests wait (backpressure). */
#define OUTPUT_PAUSE_BYTES (1u << 20)

struct kvp_server {
    uv_loop_t *loop;
    kvp_server_config_t cfg;
    char *socket_path; /* owned copy; unlinked on destroy when created here */
    int created_socket;
    int listen_fd;
    uv_poll_t listen_poll;
    int listening;
    uv_timer_t accept_retry;
    int reserve_fd;       /* /dev/null, given up to refuse a connection when out of fds */
    uint64_t refused_fds; /* connections refused for want of a descriptor */
    kvp_access_t access;  /* who may connect */
    uv_timer_t drain_timer;
    uv_timer_t sweep;      /* Hello and frame deadlines, budget waiters */
    uint64_t buffered;     /* read buffers + unsent answers of all connections */
    uint32_t num_waiting;  /* connections with wait_budget */
    int in_release;        /* budget_released is running */
    uint64_t budget_waits; /* times a connection waited for the budget (for the log) */
    kvp_rpc_t *rpc;
    conn_t *conns;
    uint32_t num_conns;
    int draining;
    void (*drain_done)(void *);
    void *drain_arg;
    int destroying;
    int open_handles;
    /* decode scratch, reused by every frame (loop thread only) */
    kvpool_Request req;
    uint64_t *seq_ids;
    uint32_t *num_tokens;
    int32_t *token_ids; /* decode scratch of the prefix cache's arrays */
    uint8_t *salts;
    uint32_t *salt_lens;
    kvp_batch_arrays_t batch;
    kvp_rpc_io_t io;
    uint8_t *obuf; /* [ENCODE_KEEP_BYTES]: answers are encoded here (loop thread only) */
};

static void conn_close(conn_t *c);
static void conn_update_events(conn_t *c);
static void process_frames(conn_t *c);
static void account(conn_t *c);

uint64_t kvp_server_now_ms(void)
{
    return uv_hrtime() / 1000000u;
}

/* ---- write path -------------------------------------------------------------------------- */

/* One sendmsg of buf[0..len) (the fds, when nfds > 0, ride with its first byte). Returns the
 * bytes the socket took (0 when it is full), or -1 when the connection broke. */
static ssize_t send_some(conn_t *c, const uint8_t *buf, size_t len, const int *fds, int nfds)
{
    struct iovec iov = {(void *)buf, len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    char cbuf[CMSG_SPACE(sizeof(int) * KVP_MAX_FDS_PER_FRAME)];
    if (nfds) {
        memset(cbuf, 0, sizeof(cbuf));
        msg.msg_control = cbuf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)nfds);
    }
    for (;;) {
        ssize_t n = sendmsg(c->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n >= 0)
            return n;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return 0;
        return -1;
    }
}

/* Writes as much of the queue as the socket takes. Returns 0, or -1 when the connection broke. */
static int flush(conn_t *c)
{
    int rc = 0;
    while (c->out_head) {
        out_frame_t *f = c->out_head;
        ssize_t n =
            send_some(c, f->buf + f->off, f->len - f->off, f->fds, f->off == 0 ? f->nfds : 0);
        if (n < 0) {
            rc = -1;
            break;
        }
        if (n == 0)
            break;
        f->off += (size_t)n;
        c->queued -= (uint64_t)n;
        if (f->off == f->len) {
            c->out_head = f->next;
            if (!c->out_head)
                c->out_tail = NULL;
            free(f->buf);
            free(f);
        }
    }
    account(c);
    return rc;
}

/* Sends one encoded frame, in order after what is queued. buf is borrowed: when the queue is
 * empty the frame goes straight from it to the socket (the usual case: no copy and no
 * allocation per answer), and only the part the socket does not take now is copied into the
 * queue, which then owns that copy. Drops the connection when it broke or its unsent bytes
 * pass max_queued_bytes. */
static void send_frame(conn_t *c, const uint8_t *buf, size_t len, const int *fds, int nfds)
{
    size_t sent = 0;
    if (!c->out_head) {
        ssize_t n = send_some(c, buf, len, fds, nfds);
        if (n < 0) {
            conn_close(c);
            return;
        }
        sent = (size_t)n;
    }
    if (sent < len) {
        out_frame_t *f = calloc(1, sizeof(*f));
        uint8_t *copy = f ? malloc(len - sent) : NULL;
        if (!copy) {
            free(f);
            conn_close(c);
            return;
        }
        memcpy(copy, buf + sent, len - sent);
        f->buf = copy;
        f->len = len - sent;
        if (sent == 0 && nfds) { /* not sent yet: they go with the queued bytes */
            f->nfds = nfds;
            memcpy(f->fds, fds, sizeof(int) * (size_t)nfds);
        }
        if (c->out_tail)
            c->out_tail->next = f;
        else
            c->out_head = f;
        c->out_tail = f;
        c->queued += f->len;
        if (flush(c) < 0) {
            conn_close(c);
            return;
        }
    }
    if (c->queued > c->srv->cfg.max_queued_bytes) {
        kvp_log(KVP_LOG_WARNING,
                "client dropped reason=\"not reading its answers\" session=%llu queued=%llu",
                (unsigned long long)(c->sess ? c->sess->id : 0), (unsigned long long)c->queued);
        conn_close(c);
        return;
    }
    conn_update_events(c);
}

/* Encodes resp (with its bound arrays) into the server's encode buffer and sends it (the hot
 * answers are written by kvp_wire_encode_response_frame directly, the same bytes nanopb would
 * write). Answers up to ENCODE_KEEP_BYTES are encoded once into that buffer, which is kept between
 * answers; a larger one (long page tables, metrics, lists) is sized first, encoded into a buffer of
 * its own and freed after, so one huge answer does not hold its memory for good. When the
 * connection has a session the rpc layer sees the encoded answer first (kvp_rpc_answered: the
 * retry window keeps a copy, the metrics count it); with deliver 0 (the connection closed while
 * its Append ran) the answer is only recorded, so a retry on a new connection still gets it. */
#define ENCODE_KEEP_BYTES (256u << 10)

static void send_response(conn_t *c, const kvpool_Response *resp, const int *fds, int nfds,
                          int deliver)
{
    kvp_server_t *s = c->srv;
    uint8_t *buf = s->obuf, *big = NULL;
    long n = kvp_wire_encode_response_frame(resp, buf, ENCODE_KEEP_BYTES);
    if (n < 0) {
        long size = kvp_wire_encoded_size(kvpool_Response_fields, resp);
        big = size < 0 ? NULL : malloc((size_t)size + KVP_FRAME_HDR_BYTES);
        n = big ? kvp_wire_encode_response_frame(resp, big, (size_t)size + KVP_FRAME_HDR_BYTES)
                : -1;
        buf = big;
    }
    if (c->sess)
        kvp_rpc_answered(s->rpc, c->sess, resp, n < 0 ? NULL : buf, n < 0 ? 0 : (uint32_t)n,
                         uv_hrtime());
    if (n < 0) {
        free(big);
        kvp_log(KVP_LOG_ERR, "cannot encode response id=%llu", (unsigned long long)resp->id);
        if (deliver)
            conn_close(c);
        return;
    }
    if (deliver)
        send_frame(c, buf, (size_t)n, fds, nfds);
    free(big);
}

/* An error answer outside the rpc layer's accounting (a frame the reader refused). */
static void send_error(conn_t *c, uint64_t id, int err, const char *msg)
{
    kvpool_Response resp;
    kvp_rpc_error(&resp, id, err, "%s", msg);
    uint8_t buf[512];
    long n = kvp_wire_encode_response_frame(&resp, buf, sizeof(buf));
    if (n > 0)
        send_frame(c, buf, (size_t)n, NULL, 0);
}

/* Answers err (request id 0) and closes at once, without waiting for the client to read: for
 * clients that broke a deadline or the fd rules (they may never read). The answer goes out
 * when the socket has room for it, which a client that reads finds before the end of stream. */
static void conn_fail(conn_t *c, int err, const char *msg)
{
    if (!c->out_head && !c->closing)
        send_error(c, 0, err, msg);
    if (!c->closing)
        conn_close(c);
}

/* ---- the buffer budget --------------------------------------------------------------------- */

/* A connection whose answers are not drained is neither read nor processed. */
static int output_paused(const conn_t *c)
{
    const kvp_server_t *s = c->srv;
    if (c->queued >= OUTPUT_PAUSE_BYTES)
        return 1;
    return c->queued && s->cfg.max_buffered_bytes && s->buffered > s->cfg.max_buffered_bytes;
}

/* Memory came back: connections waiting for the budget try to read again. */
static void budget_released(kvp_server_t *s)
{
    if (s->in_release)
        return;
    s->in_release = 1;
    for (conn_t *c = s->conns, *n; c && s->num_waiting; c = n) {
        n = c->next;
        if (!c->wait_budget)
            continue;
        c->wait_budget = 0;
        s->num_waiting--;
        conn_update_events(c);
    }
    s->in_release = 0;
}

/* Brings s->buffered up to date with c's read buffer and unsent answers. */
static void account(conn_t *c)
{
    kvp_server_t *s = c->srv;
    uint64_t in = c->rd.cap, out = c->queued, before = s->buffered;
    s->buffered = s->buffered - c->acct_in - c->acct_out + in + out;
    c->acct_in = in;
    c->acct_out = out;
    if (s->buffered < before && s->num_waiting)
        budget_released(s);
}

uint64_t kvp_server_buffered_bytes(const kvp_server_t *s)
{
    return s->buffered;
}

/* ---- connection lifetime ------------------------------------------------------------------ */

/* The frame reader gives up fds that came with no frame (or too many): close them. */
static void drop_fd(int fd, void *arg)
{
    (void)arg;
    close(fd);
}

static void maybe_drain_done(kvp_server_t *s)
{
    if (s->draining && s->num_conns == 0 && s->drain_done) {
        void (*cb)(void *) = s->drain_done;
        s->drain_done = NULL;
        uv_timer_stop(&s->drain_timer);
        cb(s->drain_arg);
    }
}

static void on_server_handle_closed(uv_handle_t *h)
{
    kvp_server_t *s = h->data;
    if (--s->open_handles == 0) {
        free(s->seq_ids);
        free(s->num_tokens);
        free(s->token_ids);
        free(s->salts);
        free(s->salt_lens);
        free(s->obuf);
        free(s->socket_path);
        free(s);
    }
}

static void jobs_closed(void *arg)
{
    kvp_server_t *s = arg;
    on_server_handle_closed((uv_handle_t *)&s->listen_poll); /* may free s */
}

static void on_conn_closed(uv_handle_t *h)
{
    conn_t *c = h->data;
    kvp_server_t *s = c->srv;
    close(c->fd);
    kvp_frame_reader_free(&c->rd);
    while (c->out_head) {
        out_frame_t *f = c->out_head;
        c->out_head = f->next;
        free(f->buf);
        free(f);
    }
    c->queued = 0;
    account(c); /* its buffers are gone: may wake budget waiters */
    if (c->sess)
        kvp_rpc_session_close(s->rpc, c->sess, kvp_server_now_ms());
    free(c);
    maybe_drain_done(s);
    on_server_handle_closed((uv_handle_t *)&s->listen_poll); /* may free s: last */
}

static void conn_close(conn_t *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    kvp_server_t *s = c->srv;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    s->num_conns--;
    if (c->wait_budget) {
        c->wait_budget = 0;
        s->num_waiting--;
    }
    kvp_rpc_set_num_clients(s->rpc, s->num_conns);
    uv_poll_stop(&c->poll);
    if (c->sess)
        kvp_log(KVP_LOG_INFO, "client disconnected session=%llu pid=%d",
                (unsigned long long)c->sess->id, c->sess->pid);
    if (!c->busy)
        uv_close((uv_handle_t *)&c->poll, on_conn_closed);
    /* else: on_resume closes it once the call's job is back */
}

static void on_conn_event(uv_poll_t *h, int status, int events);

static void conn_update_events(conn_t *c)
{
    if (c->closing)
        return;
    int ev = 0;
    int frame_ready = kvp_frame_reader_ready(&c->rd);
    if (!c->close_after_flush && !c->srv->draining && !frame_ready && !c->wait_budget &&
        !output_paused(c))
        ev |= UV_READABLE;
    if (c->out_head)
        ev |= UV_WRITABLE;
    if (c->close_after_flush && !c->out_head) {
        conn_close(c);
        return;
    }
    if (c->srv->draining && !c->busy && !c->out_head && !frame_ready) {
        conn_close(c);
        return;
    }
    if (ev != c->events) {
        c->events = ev;
        if (ev)
            uv_poll_start(&c->poll, ev, on_conn_event);
        else
            uv_poll_stop(&c->poll);
    }
}

/* ---- read path --------------------------------------------------------------------------- */

/* One recvmsg into the frame reader. Returns bytes read, 0 on EOF, -1 on error / EAGAIN (with
 * errno; EAGAIN too when the reader holds a whole frame and wants it taken first). Received fds
 * go to the reader with the stream offset they arrived at. *drained is set when the read came
 * back short with no descriptors: a Unix stream recvmsg fills the buffer from every queued
 * message unless one carries descriptors (it stops after that one), so the socket held no
 * more bytes and a further read would only return EAGAIN. */
static ssize_t read_some(conn_t *c, int *drained)
{
    *drained = 0;
    kvp_server_t *s = c->srv;
    size_t grow = kvp_frame_reader_growth(&c->rd);
    if (grow && c->rd.cap >= KVP_FRAME_GROW_BYTES && s->cfg.max_buffered_bytes &&
        s->buffered + grow > s->cfg.max_buffered_bytes) {
        /* beyond its first step a read buffer grows only within the budget: wait */
        if (!c->wait_budget) {
            c->wait_budget = 1;
            s->num_waiting++;
            if (s->budget_waits++ % 1000 == 0)
                kvp_log(KVP_LOG_WARNING,
                        "connection waits reason=\"max_buffered_bytes\" buffered=%llu "
                        "waits_total=%llu",
                        (unsigned long long)s->buffered, (unsigned long long)s->budget_waits);
        }
        errno = EAGAIN;
        return -1;
    }
    uint8_t *p;
    size_t room;
    int rc = kvp_frame_reader_space(&c->rd, &p, &room);
    account(c);
    if (rc) {
        errno = rc == KVP_ENOMEM ? ENOMEM : EAGAIN;
        return -1;
    }
    struct iovec iov = {p, room};
    char cbuf[CMSG_SPACE(sizeof(int) * KVP_MAX_FDS_PER_FRAME)];
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf)};
    ssize_t n;
    do
        n = recvmsg(c->fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    if (n < 0)
        return -1;
    int fds[KVP_MAX_FDS_PER_FRAME];
    int nfds = 0, got = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
            continue;
        int nfd = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        const uint8_t *data = CMSG_DATA(cm);
        for (int i = 0; i < nfd; i++) {
            int fd;
            memcpy(&fd, data + sizeof(int) * (size_t)i, sizeof(int));
            got++;
            if (nfds < KVP_MAX_FDS_PER_FRAME)
                fds[nfds++] = fd;
            else
                close(fd);
        }
    }
    int truncated = (msg.msg_flags & MSG_CTRUNC) != 0; /* more fds than cbuf holds: the
                                                          kernel discarded the rest */
    if (truncated) {
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
        nfds = 0;
    }
    int abuse = kvp_frame_reader_commit(&c->rd, (size_t)n, fds, nfds) != 0 || truncated;
    if (abuse) {
        /* fd flood: protocol abuse; the reader dropped this read's fds */
        char why[200];
        snprintf(why, sizeof(why),
                 "a message carried %s%d descriptors; at most %d per frame and %d pending per "
                 "connection; closing",
                 truncated ? "more than " : "", got, KVP_FRAME_MAX_FDS_PER_FRAME,
                 KVP_FRAME_MAX_PENDING_FDS);
        kvp_log(KVP_LOG_WARNING, "client dropped reason=\"too many descriptors\" fds=%d uid=%u",
                got, (unsigned)c->uid);
        conn_fail(c, KVP_EINVAL, why);
        return n;
    }
    if (c->srv->cfg.frame_timeout_ms && kvp_frame_reader_pending(&c->rd) &&
        !kvp_frame_reader_ready(&c->rd)) {
        uint64_t off = c->rd.rx_total - kvp_frame_reader_pending(&c->rd) + 1;
        if (c->partial_off != off) { /* a new partial frame: its clock starts */
            c->partial_off = off;
            c->partial_ms = kvp_server_now_ms();
        }
    }
    *drained = n > 0 && (size_t)n < room && nfds == 0;
    return n;
}

/* Decodes one frame's payload and hands it to the rpc layer, which answers it, replays a
 * retry's first answer, or suspends it (an off-loop call: the connection waits, on_resume
 * answers). */
static void handle_frame(conn_t *c, const uint8_t *payload, uint32_t len, int *fds, int nfds)
{
    kvp_server_t *s = c->srv;
    uint64_t t0 = uv_hrtime();
    kvpool_Request *req = &s->req;
    kvp_rpc_io_t *io = &s->io; /* the rpc layer sets every field it answers with */
    memset(req, 0, sizeof(*req));
    s->batch.seq_ids = kvp_array(s->seq_ids, 8, 0, s->cfg.max_frame_bytes / 8);
    s->batch.num_tokens = kvp_array(s->num_tokens, 4, 0, s->cfg.max_frame_bytes / 8);
    /* a frame's bytes bound every array it carries (and the daemon's limits, checked after) */
    s->batch.token_ids = kvp_array(s->token_ids, 4, 0, s->cfg.max_frame_bytes / 4);
    s->batch.salts = kvp_array(s->salts, 1, 0, s->cfg.max_frame_bytes);
    s->batch.salt_lens = kvp_array(s->salt_lens, 4, 0, s->cfg.max_frame_bytes / 8);
    kvp_wire_request_bind_decode(req, &s->batch);
    const char *why = NULL;
    if (kvp_wire_decode(kvpool_Request_fields, req, payload, len, &why)) {
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
        char msg[200];
        snprintf(msg, sizeof(msg), "malformed request: %s", why ? why : "decode failed");
        kvp_rpc_reject(s->rpc, c->sess, req->id, KVP_EINVAL, msg, io, t0);
        send_response(c, &io->resp, NULL, 0, 1);
        return;
    }
    io->batch = &s->batch;
    io->fds_in = fds;
    io->nfds_in = nfds;
    int rc = kvp_rpc_handle(s->rpc, c->sess, req, payload, len, io, kvp_server_now_ms(), t0);
    for (int i = 0; i < nfds; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    switch (rc) {
    case KVP_RPC_ASYNC: /* suspended: no more of this connection's frames until on_resume */
        c->busy = 1;
        return;
    case KVP_RPC_REPLAY:
        kvp_rpc_answered(s->rpc, c->sess, NULL, io->replay, io->replay_len, uv_hrtime());
        send_frame(c, io->replay, io->replay_len, NULL, 0); /* copies what it must keep */
        return;
    default:
        send_response(c, &io->resp, io->fds_out, io->nfds_out, 1);
    }
}

/* The rpc layer's resume (kvp_rpc_resume_fn): the off-loop call of the connection whose
 * session is sess is answered in io. */
static void on_resume(void *arg, kvp_session_t *sess, kvp_rpc_io_t *io)
{
    (void)arg;
    conn_t *c = sess->transport;
    c->busy = 0;
    if (c->closing) {
        /* closed meanwhile: the answer is recorded for a retry, not sent */
        send_response(c, &io->resp, NULL, 0, 0);
        uv_close((uv_handle_t *)&c->poll, on_conn_closed);
        return;
    }
    send_response(c, &io->resp, NULL, 0, 1); /* may close c (not busy any more) */
    if (!c->closing)
        process_frames(c);
}

/* Cuts and handles every complete frame in the read buffer (stopping while a job runs). */
static void process_frames(conn_t *c)
{
    kvp_server_t *s = c->srv;
    while (!c->closing && !c->busy && !c->close_after_flush && !output_paused(c)) {
        kvp_frame_t f;
        int rc = kvp_frame_reader_next(&c->rd, &f);
        if (rc == 0)
            break;
        if (rc < 0) {
            char msg[128];
            snprintf(msg, sizeof(msg), "frame of %u bytes above max_frame_bytes %u; closing", f.len,
                     s->cfg.max_frame_bytes);
            kvp_log(KVP_LOG_WARNING, "client dropped reason=\"frame too large\" bytes=%u", f.len);
            send_error(c, 0, KVP_EINVAL, msg);
            c->close_after_flush = 1;
            break;
        }
        handle_frame(c, f.payload, f.len, f.fds, f.nfds);
    }
    if (!c->closing && !c->busy && c->rd.cap > KVP_FRAME_GROW_BYTES) {
        kvp_frame_reader_trim(&c->rd); /* a large frame's memory goes back to the budget */
        account(c);
    }
    if (!c->closing)
        conn_update_events(c);
}

static void on_conn_event(uv_poll_t *h, int status, int events)
{
    conn_t *c = h->data;
    if (status < 0) {
        conn_close(c);
        return;
    }
    if (events & UV_WRITABLE) {
        if (flush(c) < 0) {
            conn_close(c);
            return;
        }
        /* answers drained: requests that waited for that run now */
        if (!c->busy && !c->closing && kvp_frame_reader_ready(&c->rd) && !output_paused(c))
            process_frames(c);
        if (c->closing)
            return;
    }
    if (events & UV_READABLE) {
        kvp_rpc_touch(c->srv->rpc);
        /* Until the socket is empty (at most 16 reads: one client cannot hold the loop). A
         * short read ends it without the recvmsg that would return EAGAIN; should bytes arrive
         * meanwhile, the poll, level-triggered, reports them on the next turn of the loop. */
        int drained = 0;
        for (int i = 0; i < 16 && !c->closing && !drained; i++) {
            ssize_t n = read_some(c, &drained);
            if (n == 0) {
                /* EOF: answer what is complete, then close */
                process_frames(c);
                if (!c->closing) {
                    if (c->busy || c->out_head)
                        c->close_after_flush = 1;
                    else
                        conn_close(c);
                }
                return;
            }
            if (n < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK)
                    break;
                conn_close(c);
                return;
            }
        }
        if (!c->closing)
            process_frames(c);
        return;
    }
    conn_update_events(c);
}

/* ---- accept -------------------------------------------------------------------------------- */

static void on_accept(uv_poll_t *h, int status, int events);

static void on_accept_retry(uv_timer_t *t)
{
    kvp_server_t *s = t->data;
    if (!s->draining && s->listening)
        uv_poll_start(&s->listen_poll, UV_READABLE, on_accept);
}

static void pause_accept(kvp_server_t *s, int err)
{
    kvp_log(KVP_LOG_WARNING, "accept failed err=%s; pausing 100 ms", kvp_errname(-err));
    uv_poll_stop(&s->listen_poll);
    uv_timer_start(&s->accept_retry, on_accept_retry, 100, 0);
}

/* Out of descriptors (EMFILE/ENFILE): the waiting connection would keep the listener readable
 * and the loop spinning. The classic way out: give back the descriptor kept in reserve,
 * accept the connection with it, tell the client why (best effort, it is new: its buffer has
 * room) and close it, then take the reserve again. Returns 0 when one was refused this way,
 * -1 when there is no reserve (then accepting pauses for 100 ms instead). */
static int refuse_with_reserve_fd(kvp_server_t *s)
{
    if (s->reserve_fd < 0)
        return -1;
    close(s->reserve_fd);
    s->reserve_fd = -1;
    int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
        kvpool_Response resp;
        uint8_t buf[256];
        kvp_rpc_error(&resp, 0, KVP_EUNAVAIL, "daemon out of file descriptors; retry later");
        long n = kvp_wire_encode_frame(kvpool_Response_fields, &resp, buf, sizeof(buf));
        if (n > 0 && send(fd, buf, (size_t)n, MSG_DONTWAIT | MSG_NOSIGNAL) < 0)
            kvp_log(KVP_LOG_DEBUG, "refusal not sent err=%s", kvp_errname(-errno));
        close(fd);
        s->refused_fds++;
        if (s->refused_fds == 1 || s->refused_fds % 1000 == 0)
            kvp_log(KVP_LOG_WARNING,
                    "connection refused reason=\"out of file descriptors\" refused_total=%llu",
                    (unsigned long long)s->refused_fds);
    }
    s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    return fd >= 0 ? 0 : -1;
}

/* The peer's groups: its primary gid first, then its supplementary groups (SO_PEERGROUPS,
 * Linux 4.13+; without it only the primary one). Returns the count. */
static uint32_t peer_groups(int fd, gid_t primary, uint32_t *out, uint32_t cap)
{
    uint32_t n = 0;
    out[n++] = (uint32_t)primary;
#ifdef SO_PEERGROUPS
    gid_t g[KVP_ACCESS_MAX_IDS * 4];
    socklen_t len = sizeof(g);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, g, &len) == 0)
        for (socklen_t i = 0; i < len / sizeof(gid_t) && n < cap; i++)
            out[n++] = (uint32_t)g[i];
#else
    (void)fd;
    (void)cap;
#endif
    return n;
}

static void on_accept(uv_poll_t *h, int status, int events)
{
    (void)events;
    kvp_server_t *s = h->data;
    if (status < 0 || s->draining)
        return;
    for (int i = 0; i < 64; i++) {
        int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR)
                continue;
            int err = errno;
            if ((err == EMFILE || err == ENFILE) && refuse_with_reserve_fd(s) == 0)
                continue;
            if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM)
                pause_accept(s, err); /* instead of spinning on a readable listener */
            else if (err != EAGAIN && err != EWOULDBLOCK)
                kvp_log(KVP_LOG_WARNING, "accept failed err=%s", kvp_errname(-err));
            return;
        }
        struct ucred cred = {0, (uid_t)-1, (gid_t)-1};
        socklen_t cl = sizeof(cred);
        getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl);
        conn_t *c = calloc(1, sizeof(*c));
        if (!c) {
            close(fd);
            continue;
        }
        c->srv = s;
        c->fd = fd;
        c->uid = (uint32_t)cred.uid;
        c->accepted_ms = kvp_server_now_ms();
        kvp_frame_reader_init(&c->rd, s->cfg.max_frame_bytes, drop_fd, NULL);
        c->poll.data = c;
        int prc = uv_poll_init(s->loop, &c->poll, fd);
        if (prc) {
            kvp_log(KVP_LOG_WARNING, "connection dropped reason=\"poll init\" err=%s",
                    uv_err_name(prc));
            close(fd);
            free(c);
            continue;
        }
        s->open_handles++;
        c->next = s->conns;
        if (s->conns)
            s->conns->prev = c;
        s->conns = c;
        s->num_conns++;
        kvp_rpc_set_num_clients(s->rpc, s->num_conns);
        uint32_t groups[KVP_ACCESS_MAX_IDS * 4 + 1];
        uint32_t ngroups = peer_groups(fd, cred.gid, groups, KVP_ACCESS_MAX_IDS * 4 + 1);
        if (kvp_access_check(&s->access, (uint32_t)cred.uid, groups, ngroups)) {
            kvp_log(KVP_LOG_WARNING,
                    "connection refused reason=\"not allowed\" pid=%d uid=%u gid=%u", (int)cred.pid,
                    (unsigned)cred.uid, (unsigned)cred.gid);
            char msg[160];
            snprintf(msg, sizeof(msg),
                     "uid %u may not connect to this daemon (access.allowed_uids / allowed_gids)",
                     (unsigned)cred.uid);
            send_error(c, 0, KVP_EPERM, msg);
            c->close_after_flush = 1;
            conn_update_events(c);
            continue;
        }
        if (s->cfg.uid_max_connections && cred.uid != 0 && c->uid != s->access.self_uid) {
            /* per uid, so one tenant cannot take every slot (the daemon's uid and root,
             * the operators, are exempt); refused connections have no session */
            uint32_t held = 0;
            for (const conn_t *o = s->conns; o; o = o->next)
                held += o->sess && o->uid == c->uid;
            if (held >= s->cfg.uid_max_connections) {
                kvp_log(KVP_LOG_WARNING,
                        "connection refused reason=\"uid_max_connections\" pid=%d uid=%u held=%u",
                        (int)cred.pid, (unsigned)cred.uid, held);
                char msg[160];
                snprintf(msg, sizeof(msg),
                         "uid %u holds %u connections (server.uid_max_connections); close one",
                         (unsigned)cred.uid, held);
                send_error(c, 0, KVP_ELIMIT, msg);
                c->close_after_flush = 1;
                conn_update_events(c);
                continue;
            }
        }
        if (s->num_conns > s->cfg.max_connections) {
            kvp_log(KVP_LOG_WARNING, "connection refused reason=\"max_connections\" pid=%d",
                    (int)cred.pid);
            send_error(c, 0, KVP_EUNAVAIL, "too many connections");
            c->close_after_flush = 1;
            conn_update_events(c);
            continue;
        }
        c->sess = kvp_rpc_session_open(s->rpc, cred.pid, cred.uid, cred.gid, kvp_server_now_ms());
        if (!c->sess) {
            conn_close(c);
            continue;
        }
        c->sess->transport = c;
        kvp_log(KVP_LOG_DEBUG, "client connected session=%llu pid=%d uid=%u",
                (unsigned long long)c->sess->id, (int)cred.pid, (unsigned)cred.uid);
        conn_update_events(c);
    }
}

/* ---- deadlines ----------------------------------------------------------------------------- */

/* The sweep's period: a quarter of the shortest deadline, 10 ms .. 1 s. */
static uint64_t sweep_period_ms(const kvp_server_config_t *cfg)
{
    uint32_t t = 4000;
    if (cfg->hello_timeout_ms && cfg->hello_timeout_ms < t)
        t = cfg->hello_timeout_ms;
    if (cfg->frame_timeout_ms && cfg->frame_timeout_ms < t)
        t = cfg->frame_timeout_ms;
    t /= 4;
    return t < 10 ? 10 : t;
}

static void on_sweep(uv_timer_t *t)
{
    kvp_server_t *s = t->data;
    uint64_t now = kvp_server_now_ms();
    const uint32_t hello_ms = s->cfg.hello_timeout_ms, frame_ms = s->cfg.frame_timeout_ms;
    for (conn_t *c = s->conns, *n; c; c = n) {
        n = c->next;
        if (c->closing)
            continue;
        if (hello_ms && (!c->sess || !c->sess->hello_done) && now - c->accepted_ms >= hello_ms) {
            if (!c->sess) { /* a refusal its client did not read */
                conn_close(c);
                continue;
            }
            kvp_log(KVP_LOG_WARNING, "client dropped reason=\"no Hello\" pid=%d uid=%u ms=%u",
                    c->sess->pid, (unsigned)c->uid, hello_ms);
            char msg[128];
            snprintf(msg, sizeof(msg), "no Hello within %u ms (server.hello_timeout_ms); closing",
                     hello_ms);
            conn_fail(c, KVP_ETIMEDOUT, msg);
            continue;
        }
        /* a partial frame counts while the daemon reads the connection (not while it waits
         * for an Append, for its client to read answers, or for the budget) */
        size_t pend = kvp_frame_reader_pending(&c->rd);
        if (!frame_ms || !(c->events & UV_READABLE) || !pend || kvp_frame_reader_ready(&c->rd)) {
            c->partial_off = 0;
            continue;
        }
        uint64_t off = c->rd.rx_total - pend + 1;
        if (c->partial_off != off) {
            c->partial_off = off;
            c->partial_ms = now;
        } else if (now - c->partial_ms >= frame_ms) {
            kvp_log(KVP_LOG_WARNING,
                    "client dropped reason=\"partial frame\" session=%llu bytes=%zu ms=%u",
                    (unsigned long long)(c->sess ? c->sess->id : 0), pend, frame_ms);
            char msg[128];
            snprintf(msg, sizeof(msg),
                     "frame incomplete after %u ms (server.frame_timeout_ms); closing", frame_ms);
            conn_fail(c, KVP_ETIMEDOUT, msg);
        }
    }
    if (s->num_waiting)
        budget_released(s); /* a safety net: waiters retry at least once a sweep */
}

/* ---- listener ------------------------------------------------------------------------------ */

static int mkdir_parent(const char *path)
{
    char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash || slash == dir)
        return 0;
    *slash = '\0';
    for (char *p = dir + 1; *p; p++) {
        if (*p == '/') {
            *p = '\0';
            if (mkdir(dir, 0755) < 0 && errno != EEXIST)
                return -errno;
            *p = '/';
        }
    }
    if (mkdir(dir, 0755) < 0 && errno != EEXIST)
        return -errno;
    return 0;
}

static int make_listener(kvp_server_t *s)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    const char *path = s->cfg.socket_path;
    if (!path || !*path || strlen(path) >= sizeof(a.sun_path))
        return KVP_EINVAL;
    strcpy(a.sun_path, path);
    int rc = mkdir_parent(path);
    if (rc)
        return rc;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) < 0) {
        if (errno != EADDRINUSE)
            goto fail;
        /* a socket file exists: stale (nobody listening) or a live daemon */
        int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        int live = probe >= 0 && connect(probe, (struct sockaddr *)&a, sizeof(a)) == 0;
        if (probe >= 0)
            close(probe);
        if (live) {
            close(fd);
            kvp_log(KVP_LOG_ERR, "another daemon is listening socket=%s", path);
            return -EADDRINUSE;
        }
        unlink(path);
        if (bind(fd, (struct sockaddr *)&a, sizeof(a)) < 0)
            goto fail;
    }
    if (chmod(path, s->cfg.socket_mode) < 0)
        goto fail;
    if (s->cfg.socket_gid >= 0 && chown(path, (uid_t)-1, (gid_t)s->cfg.socket_gid) < 0)
        goto fail;
    if (listen(fd, 512) < 0)
        goto fail;
    s->listen_fd = fd;
    s->created_socket = 1;
    return 0;
fail:
    rc = -errno;
    close(fd);
    return rc;
}

int kvp_server_create(uv_loop_t *loop, const kvp_server_config_t *cfg, kvp_rpc_t *rpc,
                      kvp_server_t **out)
{
    if (!loop || !cfg || !rpc || !out || !cfg->max_frame_bytes)
        return KVP_EINVAL;
    kvp_server_t *s = calloc(1, sizeof(*s));
    if (!s)
        return KVP_ENOMEM;
    int rc;
    s->loop = loop;
    s->cfg = *cfg;
    s->rpc = rpc;
    s->listen_fd = -1;
    s->reserve_fd = -1;
    s->socket_path = cfg->socket_path ? strdup(cfg->socket_path) : NULL;
    s->cfg.socket_path = s->socket_path;
    s->seq_ids = malloc(cfg->max_frame_bytes);
    s->num_tokens = malloc(cfg->max_frame_bytes / 2 + 4);
    /* pages are touched only by the frames that carry token ids or salts */
    s->token_ids = malloc(cfg->max_frame_bytes + 4);
    s->salts = malloc(cfg->max_frame_bytes + 4);
    s->salt_lens = malloc(cfg->max_frame_bytes / 2 + 4);
    s->obuf = malloc(ENCODE_KEEP_BYTES);
    if (!s->seq_ids || !s->num_tokens || !s->token_ids || !s->salts || !s->salt_lens || !s->obuf ||
        (cfg->socket_path && !s->socket_path)) {
        rc = KVP_ENOMEM;
        goto fail;
    }
    if (cfg->listen_fd >= 0) {
        s->listen_fd = cfg->listen_fd;
        int fl = fcntl(s->listen_fd, F_GETFL);
        fcntl(s->listen_fd, F_SETFL, fl | O_NONBLOCK);
    } else if ((rc = make_listener(s))) {
        goto fail;
    }
    if ((rc = kvp_rpc_start(rpc, loop, cfg->threads ? cfg->threads : 4, cfg->busy_poll_us,
                            kvp_server_now_ms, on_resume, s)))
        goto fail;
    /* the access policy: the daemon's uid, root, and the socket file's group until
     * kvp_server_set_access gives lists */
    s->access.self_uid = (uint32_t)geteuid();
    s->access.socket_gid = cfg->socket_gid >= 0 ? (uint32_t)cfg->socket_gid : (uint32_t)getegid();
    struct stat st;
    if (s->created_socket && stat(s->socket_path, &st) == 0)
        s->access.socket_gid = (uint32_t)st.st_gid;
    s->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    uv_poll_init(loop, &s->listen_poll, s->listen_fd);
    s->listen_poll.data = s;
    uv_timer_init(loop, &s->accept_retry);
    s->accept_retry.data = s;
    uv_timer_init(loop, &s->drain_timer);
    s->drain_timer.data = s;
    uv_timer_init(loop, &s->sweep);
    s->sweep.data = s;
    uint64_t period = sweep_period_ms(cfg);
    uv_timer_start(&s->sweep, on_sweep, period, period);
    s->open_handles = 5; /* four handles and the rpc layer's worker threads */
    s->listening = 1;
    uv_poll_start(&s->listen_poll, UV_READABLE, on_accept);
    kvp_log(KVP_LOG_NOTICE, "listening socket=%s mode=%04o inherited=%d",
            s->socket_path ? s->socket_path : "(inherited)", cfg->socket_mode, cfg->listen_fd >= 0);
    *out = s;
    return 0;
fail:
    if (s->listen_fd >= 0 && cfg->listen_fd < 0)
        close(s->listen_fd);
    free(s->seq_ids);
    free(s->num_tokens);
    free(s->token_ids);
    free(s->salts);
    free(s->salt_lens);
    free(s->obuf);
    free(s->socket_path);
    free(s);
    return rc;
}

uint32_t kvp_server_num_connections(const kvp_server_t *s)
{
    return s->num_conns;
}

void kvp_server_set_limits(kvp_server_t *s, const kvp_server_config_t *cfg)
{
    KVP_SERVER_LIMITS_COPY(&s->cfg, cfg);
    if (!s->destroying) {
        uint64_t period = sweep_period_ms(&s->cfg);
        uv_timer_start(&s->sweep, on_sweep, period, period);
    }
    if (s->num_waiting)
        budget_released(s); /* a larger budget lets waiters read */
}

void kvp_server_set_access(kvp_server_t *s, const uint32_t *uids, uint32_t num_uids,
                           const uint32_t *gids, uint32_t num_gids)
{
    s->access.num_uids = num_uids < KVP_ACCESS_MAX_IDS ? num_uids : KVP_ACCESS_MAX_IDS;
    s->access.num_gids = num_gids < KVP_ACCESS_MAX_IDS ? num_gids : KVP_ACCESS_MAX_IDS;
    for (uint32_t i = 0; i < s->access.num_uids; i++)
        s->access.uids[i] = uids[i];
    for (uint32_t i = 0; i < s->access.num_gids; i++)
        s->access.gids[i] = gids[i];
    kvp_log(KVP_LOG_INFO, "access policy self_uid=%u socket_gid=%u allowed_uids=%u allowed_gids=%u",
            s->access.self_uid, s->access.socket_gid, s->access.num_uids, s->access.num_gids);
}

static void stop_listening(kvp_server_t *s)
{
    if (!s->listening)
        return;
    s->listening = 0;
    uv_poll_stop(&s->listen_poll);
    uv_timer_stop(&s->accept_retry);
    close(s->listen_fd);
    if (s->reserve_fd >= 0)
        close(s->reserve_fd);
    s->reserve_fd = -1;
    if (s->created_socket && s->socket_path)
        unlink(s->socket_path);
}

static void on_drain_timeout(uv_timer_t *t)
{
    kvp_server_t *s = t->data;
    kvp_log(KVP_LOG_WARNING, "drain timeout; closing %u connections", s->num_conns);
    for (conn_t *c = s->conns, *n; c; c = n) {
        n = c->next;
        conn_close(c);
    }
}

void kvp_server_drain(kvp_server_t *s, void (*done)(void *arg), void *arg)
{
    if (s->draining)
        return;
    s->draining = 1;
    s->drain_done = done;
    s->drain_arg = arg;
    kvp_rpc_set_draining(s->rpc, 1);
    stop_listening(s);
    kvp_log(KVP_LOG_NOTICE, "draining connections=%u", s->num_conns);
    uv_timer_start(&s->drain_timer, on_drain_timeout, s->cfg.drain_timeout_ms, 0);
    for (conn_t *c = s->conns, *n; c; c = n) {
        n = c->next;
        process_frames(c); /* answer what was already received */
    }
    maybe_drain_done(s);
}

void kvp_server_destroy(kvp_server_t *s)
{
    if (!s || s->destroying)
        return;
    s->destroying = 1;
    s->drain_done = NULL;
    stop_listening(s);
    for (conn_t *c = s->conns, *n; c; c = n) {
        n = c->next;
        conn_close(c);
    }
    uv_close((uv_handle_t *)&s->listen_poll, on_server_handle_closed);
    uv_close((uv_handle_t *)&s->accept_retry, on_server_handle_closed);
    uv_close((uv_handle_t *)&s->drain_timer, on_server_handle_closed);
    uv_timer_stop(&s->sweep);
    uv_close((uv_handle_t *)&s->sweep, on_server_handle_closed);
    kvp_rpc_stop(s->rpc, jobs_closed, s);
}
