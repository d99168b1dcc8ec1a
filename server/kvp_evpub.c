/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_evpub.c - the KV-event publisher thread (issue #29): takes closed batches from the loop
 * (kvp_evpub_submit), encodes each (kvp_ev_encode), publishes it on a ZMQ XPUB socket as
 * [topic, seq (8 bytes big-endian), payload], keeps the last buffer_steps payloads and answers
 * replay requests on a ROUTER socket, as vLLM 0.33.0's ZmqEventPublisher does.
 *
 * Why an XPUB and not a PUB: a PUB drops silently at a subscriber's high-water mark; an XPUB
 * with XPUB_NODROP refuses the message instead (EAGAIN on a non-blocking send), so the drop is
 * counted (dropped_hwm) and the thread never blocks. It is the same wire socket type for SUB
 * peers. It also hands us the subscriptions, which keep the subscribers gauge.
 *
 * Memory stays bounded whatever the peers do: the submit queue holds at most hwm batches
 * (then drops and counts), each peer's pipe at most hwm messages (XPUB_NODROP refuses past it),
 * the replay ring buffer_steps payloads, and the ROUTER's pipe 2 * (buffer_steps + 1) messages.
 *
 * Threads: the sockets are created here and then used only by the publisher thread (ZMQ
 * sockets are not thread-safe; pthread_create and pthread_join are the hand-over barriers).
 * The loop thread touches only the queue, under the mutex, and the eventfd.
 */
#include "kvp_evpub.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvp_error.h"

/* One replay entry: a batch's seq and its payload (an owned buffer, reused when overwritten). */
typedef struct {
    uint64_t seq;
    kvp_ev_buf_t buf;
} ring_ent_t;

struct kvp_evpub {
    void *zctx, *pub, *router; /* router: NULL without a replay endpoint */
    int efd;                   /* wakes the thread: the queue became non-empty, or stop */
    pthread_t thread;
    kvp_ev_stats_t *stats;
    uint32_t hwm, dp_rank, steps;
    char *topic;
    size_t topic_len;
    char *endpoint, *replay_endpoint; /* as bound (ZMQ_LAST_ENDPOINT) or as connected */

    pthread_mutex_t lock; /* guards the fields down to deadline_ns */
    kvp_ev_batch_t *head, *tail;
    uint32_t qlen;
    int stopping;
    uint64_t deadline_ns; /* CLOCK_MONOTONIC; set with stopping */

    /* the thread's own */
    ring_ent_t *ring; /* steps entries, the oldest at ring_head */
    uint32_t ring_head, ring_n;
    kvp_ev_buf_t enc; /* the encoder's output; swapped with the ring slot it replaces */
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void put_be64(uint8_t out[8], uint64_t v)
{
    for (int i = 7; i >= 0; i--) {
        out[i] = (uint8_t)v;
        v >>= 8;
    }
}

static uint64_t get_be64(const uint8_t in[8])
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | in[i];
    return v;
}

static void set_err(char *err, size_t err_len, const char *fmt, ...)
{
    if (!err || !err_len)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
}

/* A failed zmq_bind/zmq_connect/zmq_setsockopt's errno as our code: an endpoint zmq cannot
 * parse is the caller's input (KVP_EINVAL); what the system refused (in use, no such
 * directory, permission) comes back as the negated errno; zmq's own codes (above the errno
 * range) that are not about the endpoint are internal. */
static int zmq_code(int e)
{
    if (e == EINVAL || e == EPROTONOSUPPORT || e == ENOCOMPATPROTO)
        return KVP_EINVAL;
    if (e == ENOMEM)
        return KVP_ENOMEM;
    if (e > 0 && e < 4096)
        return -e;
    return KVP_EINTERNAL;
}

/* vLLM's _is_bind_endpoint: wildcards and local transports are bound, the rest connected. */
static int is_bind_endpoint(const char *ep)
{
    return strchr(ep, '*') || strstr(ep, "::") || strncmp(ep, "ipc://", 6) == 0 ||
           strncmp(ep, "inproc://", 9) == 0;
}

static int set_int(void *s, int opt, int v)
{
    return zmq_setsockopt(s, opt, &v, sizeof(v));
}

/* Binds s to ep and returns the endpoint as bound (strdup'd) in *bound. */
static int bind_socket(void *s, const char *what, const char *ep, char **bound, char *err,
                       size_t err_len)
{
    /* an IPv6 literal needs the option, else zmq rejects it as malformed */
    if ((strchr(ep, '[') || strstr(ep, "::")) && set_int(s, ZMQ_IPV6, 1) != 0) {
        int e = zmq_errno();
        set_err(err, err_len, "cannot bind %s %s: %s", what, ep, zmq_strerror(e));
        return zmq_code(e);
    }
    if (zmq_bind(s, ep) != 0) {
        int e = zmq_errno();
        set_err(err, err_len, "cannot bind %s %s: %s", what, ep, zmq_strerror(e));
        return zmq_code(e);
    }
    char last[1024];
    size_t len = sizeof(last);
    if (zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, last, &len) != 0 || len == 0) {
        int e = zmq_errno();
        set_err(err, err_len, "cannot read the bound address of %s %s: %s", what, ep,
                zmq_strerror(e));
        return KVP_EINTERNAL;
    }
    last[sizeof(last) - 1] = '\0';
    *bound = strdup(last);
    if (!*bound) {
        set_err(err, err_len, "out of memory");
        return KVP_ENOMEM;
    }
    return 0;
}

/* ---- the queue (loop thread -> publisher thread) ------------------------------------------ */

static void wake(kvp_evpub_t *p)
{
    uint64_t one = 1;
    /* EAGAIN: the counter is already non-zero, the thread will wake anyway */
    ssize_t n = write(p->efd, &one, sizeof(one));
    (void)n;
}

void kvp_evpub_submit(void *ctx, kvp_ev_batch_t *b)
{
    kvp_evpub_t *p = ctx;
    if (!b)
        return;
    if (!p) {
        kvp_ev_batch_free(b);
        return;
    }
    b->next = NULL;
    pthread_mutex_lock(&p->lock);
    if (p->qlen >= p->hwm) {
        pthread_mutex_unlock(&p->lock);
        kvp_ev_batch_free(b);
        atomic_fetch_add_explicit(&p->stats->dropped_queue, 1, memory_order_relaxed);
        return;
    }
    int was_empty = p->head == NULL;
    if (p->tail)
        p->tail->next = b;
    else
        p->head = b;
    p->tail = b;
    p->qlen++;
    atomic_store_explicit(&p->stats->queued, p->qlen, memory_order_relaxed);
    pthread_mutex_unlock(&p->lock);
    /* only the empty -> non-empty edge: the thread takes the whole list when it wakes */
    if (was_empty)
        wake(p);
}

/* ---- the thread --------------------------------------------------------------------------- */

/* Reads the XPUB's subscription notices. With XPUB_VERBOSER every peer's subscribe and, when
 * a peer goes away, each of its unsubscribes come through, so the gauge follows the peers (a
 * peer subscribed to two prefixes counts twice). */
static void read_subscriptions(kvp_evpub_t *p)
{
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, p->pub, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return;
        }
        const uint8_t *d = zmq_msg_data(&m);
        if (zmq_msg_size(&m) >= 1) {
            uint64_t n = atomic_load_explicit(&p->stats->subscribers, memory_order_relaxed);
            if (d[0] == 1)
                n++;
            else if (d[0] == 0 && n > 0)
                n--;
            atomic_store_explicit(&p->stats->subscribers, n, memory_order_relaxed);
        }
        zmq_msg_close(&m);
    }
}

/* Sends [topic, seq, payload] on the XPUB. The first frame decides: XPUB_NODROP checks every
 * frame against the pipes' high-water marks, which count whole messages only, so once the
 * first frame is taken the rest of the message is too (nothing partial is ever sent); the later
 * frames are sent without ZMQ_DONTWAIT for that reason. Returns 0 or the failing errno. */
static int pub_send(kvp_evpub_t *p, uint64_t seq, const kvp_ev_buf_t *payload)
{
    uint8_t seqb[8];
    put_be64(seqb, seq);
    if (zmq_send(p->pub, p->topic, p->topic_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
        return zmq_errno();
    if (zmq_send(p->pub, seqb, sizeof(seqb), ZMQ_SNDMORE) < 0)
        return zmq_errno();
    if (zmq_send(p->pub, payload->data, payload->len, 0) < 0)
        return zmq_errno();
    return 0;
}

/* Keeps p->enc as the newest replay entry (the oldest one goes when the ring is full); the
 * replaced entry's buffer becomes the next p->enc, so payload memory is reused, not copied. */
static void ring_push(kvp_evpub_t *p, uint64_t seq)
{
    ring_ent_t *slot;
    if (p->ring_n < p->steps) {
        slot = &p->ring[(p->ring_head + p->ring_n) % p->steps];
        p->ring_n++;
    } else {
        slot = &p->ring[p->ring_head];
        p->ring_head = (p->ring_head + 1) % p->steps;
    }
    kvp_ev_buf_t t = slot->buf;
    slot->buf = p->enc;
    slot->seq = seq;
    p->enc = t;
    p->enc.len = 0;
}

/* Publishes one batch and frees it. stopping: a refused send waits for room until the
 * deadline (a slow subscriber still gets what was queued at stop), else it is dropped. */
static void publish_one(kvp_evpub_t *p, kvp_ev_batch_t *b, int stopping, uint64_t deadline)
{
    kvp_ev_stats_t *st = p->stats;
    uint32_t nev = 0;
    if (kvp_ev_encode(b, p->dp_rank, &p->enc, &nev) != 0) {
        /* out of memory or a malformed batch: it never reaches the socket */
        atomic_fetch_add_explicit(&st->dropped_queue, 1, memory_order_relaxed);
        kvp_ev_batch_free(b);
        return;
    }
    int e = pub_send(p, b->seq, &p->enc);
    while (e == EAGAIN && stopping) {
        uint64_t now = now_ns();
        if (now >= deadline)
            break;
        /* an XPUB reports POLLOUT whether or not its peers have room: retry every ms */
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
        e = pub_send(p, b->seq, &p->enc);
    }
    if (e == 0) {
        uint64_t blocks = 0;
        for (uint32_t i = 0; i < b->n; i++)
            blocks += b->rec[i].kind == KVP_EV_STORED || b->rec[i].kind == KVP_EV_REMOVED;
        atomic_fetch_add_explicit(&st->batches, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&st->events, nev, memory_order_relaxed);
        atomic_fetch_add_explicit(&st->blocks, blocks, memory_order_relaxed);
        atomic_fetch_add_explicit(&st->bytes, p->enc.len, memory_order_relaxed);
    } else {
        /* EAGAIN: a subscriber's pipe is full. Anything else (the socket cannot send at all)
         * loses the batch the same way; both stay in the replay buffer. */
        atomic_fetch_add_explicit(&st->dropped_hwm, 1, memory_order_relaxed);
    }
    ring_push(p, b->seq);
    kvp_ev_batch_free(b);
}

/* Sends one reply frame on the ROUTER. The identity frame is sent with ZMQ_DONTWAIT: with
 * ROUTER_MANDATORY a full pipe refuses it (EAGAIN) and a gone peer too (EHOSTUNREACH); once it
 * is taken, the ROUTER takes the message's other frames whole. */
static int router_send(kvp_evpub_t *p, zmq_msg_t *id, const void *a, size_t alen, const void *b,
                       size_t blen, const void *c, size_t clen)
{
    if (zmq_send(p->router, zmq_msg_data(id), zmq_msg_size(id), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
        return zmq_errno();
    if (zmq_send(p->router, "", 0, ZMQ_SNDMORE) < 0 ||
        zmq_send(p->router, a, alen, ZMQ_SNDMORE) < 0 ||
        zmq_send(p->router, b, blen, ZMQ_SNDMORE) < 0 || zmq_send(p->router, c, clen, 0) < 0)
        return zmq_errno();
    return 0;
}

/* Answers one well-formed request: every buffered batch from start on, then the end marker,
 * which is attempted even when the pipe filled up (vLLM sizes the HWM so a full replay fits). */
static void answer_replay(kvp_evpub_t *p, zmq_msg_t *id, uint64_t start)
{
    kvp_ev_stats_t *st = p->stats;
    uint8_t seqb[8];
    for (uint32_t i = 0; i < p->ring_n; i++) {
        const ring_ent_t *r = &p->ring[(p->ring_head + i) % p->steps];
        if (r->seq < start)
            continue;
        put_be64(seqb, r->seq);
        int e = router_send(p, id, p->topic, p->topic_len, seqb, 8, r->buf.data, r->buf.len);
        if (e == EHOSTUNREACH)
            return; /* the peer is gone: nothing to end */
        if (e != 0)
            break;
        atomic_fetch_add_explicit(&st->replayed_batches, 1, memory_order_relaxed);
    }
    put_be64(seqb, UINT64_MAX); /* -1 as a signed 64-bit big-endian */
    (void)router_send(p, id, "", 0, seqb, 8, "", 0);
}

/* Serves every request waiting on the ROUTER. A request is exactly [identity, "", start seq
 * as 8 bytes]; anything else is read to its end, counted and ignored. */
static void serve_replays(kvp_evpub_t *p)
{
    for (;;) {
        zmq_msg_t f[3];
        int nf = 0, more = 1, bad = 0;
        for (int i = 0; i < 3; i++)
            zmq_msg_init(&f[i]);
        zmq_msg_t extra;
        zmq_msg_init(&extra);
        while (more) {
            zmq_msg_t *m = nf < 3 ? &f[nf] : &extra;
            if (zmq_msg_recv(m, p->router, nf == 0 ? ZMQ_DONTWAIT : 0) < 0) {
                if (nf == 0) { /* nothing waiting */
                    for (int i = 0; i < 3; i++)
                        zmq_msg_close(&f[i]);
                    zmq_msg_close(&extra);
                    return;
                }
                bad = 1; /* cannot happen: a message's frames arrive together */
                break;
            }
            nf++;
            more = zmq_msg_more(m);
        }
        if (!bad && nf == 3 && zmq_msg_size(&f[1]) == 0 && zmq_msg_size(&f[2]) == 8) {
            atomic_fetch_add_explicit(&p->stats->replay_requests, 1, memory_order_relaxed);
            answer_replay(p, &f[0], get_be64(zmq_msg_data(&f[2])));
        } else {
            atomic_fetch_add_explicit(&p->stats->replay_bad, 1, memory_order_relaxed);
        }
        for (int i = 0; i < 3; i++)
            zmq_msg_close(&f[i]);
        zmq_msg_close(&extra);
    }
}

static void *evpub_main(void *arg)
{
    kvp_evpub_t *p = arg;
    for (;;) {
        zmq_pollitem_t it[3];
        int n = 0, ri = -1;
        it[n++] = (zmq_pollitem_t){.socket = p->pub, .events = ZMQ_POLLIN};
        if (p->router) {
            ri = n;
            it[n++] = (zmq_pollitem_t){.socket = p->router, .events = ZMQ_POLLIN};
        }
        int ei = n;
        it[n++] = (zmq_pollitem_t){.socket = NULL, .fd = p->efd, .events = ZMQ_POLLIN};
        if (zmq_poll(it, n, -1) < 0) {
            if (zmq_errno() == EINTR)
                continue;
            break; /* the sockets are closed only after the join: cannot happen */
        }
        if (it[0].revents & ZMQ_POLLIN)
            read_subscriptions(p);
        if (ri >= 0 && (it[ri].revents & ZMQ_POLLIN))
            serve_replays(p);
        /* the eventfd is reset before the list is taken, so a batch queued after the take
         * writes it again and nothing is left behind */
        if (it[ei].revents & ZMQ_POLLIN) {
            uint64_t v;
            ssize_t r = read(p->efd, &v, sizeof(v));
            (void)r;
        }
        pthread_mutex_lock(&p->lock);
        kvp_ev_batch_t *list = p->head;
        p->head = p->tail = NULL;
        p->qlen = 0;
        atomic_store_explicit(&p->stats->queued, 0, memory_order_relaxed);
        int stopping = p->stopping;
        uint64_t deadline = p->deadline_ns;
        pthread_mutex_unlock(&p->lock);

        while (list) {
            kvp_ev_batch_t *b = list;
            list = b->next;
            if (stopping && now_ns() >= deadline) {
                /* stop's time is up: what is left never reaches the socket */
                atomic_fetch_add_explicit(&p->stats->dropped_queue, 1, memory_order_relaxed);
                kvp_ev_batch_free(b);
                continue;
            }
            publish_one(p, b, stopping, deadline);
        }
        if (stopping) {
            pthread_mutex_lock(&p->lock);
            int empty = p->head == NULL;
            pthread_mutex_unlock(&p->lock);
            if (empty)
                break;
        }
    }
    return NULL;
}

/* ---- start and stop ----------------------------------------------------------------------- */

/* Closes and frees everything; the thread is not running. pub_linger: how long the XPUB may
 * still flush what the thread sent (0 on a failed start). */
static void destroy(kvp_evpub_t *p, int pub_linger)
{
    if (p->pub) {
        set_int(p->pub, ZMQ_LINGER, pub_linger);
        zmq_close(p->pub);
    }
    if (p->router) {
        set_int(p->router, ZMQ_LINGER, 0);
        zmq_close(p->router);
    }
    if (p->zctx) {
        while (zmq_ctx_term(p->zctx) != 0 && zmq_errno() == EINTR)
            ;
    }
    if (p->efd >= 0)
        close(p->efd);
    while (p->head) {
        kvp_ev_batch_t *b = p->head;
        p->head = b->next;
        kvp_ev_batch_free(b);
        atomic_fetch_add_explicit(&p->stats->dropped_queue, 1, memory_order_relaxed);
    }
    atomic_store_explicit(&p->stats->queued, 0, memory_order_relaxed);
    if (p->ring) {
        for (uint32_t i = 0; i < p->steps; i++)
            kvp_ev_buf_free(&p->ring[i].buf);
        free(p->ring);
    }
    kvp_ev_buf_free(&p->enc);
    pthread_mutex_destroy(&p->lock);
    free(p->topic);
    free(p->endpoint);
    free(p->replay_endpoint);
    free(p);
}

/* Creates a socket with the options every use of it needs. */
static void *new_socket(kvp_evpub_t *p, int type, int sndhwm, char *err, size_t err_len, int *rc)
{
    void *s = zmq_socket(p->zctx, type);
    if (!s) {
        int e = zmq_errno();
        set_err(err, err_len, "cannot create a ZMQ socket: %s", zmq_strerror(e));
        *rc = e == ENOMEM ? KVP_ENOMEM : KVP_EINTERNAL;
        return NULL;
    }
    int bad = set_int(s, ZMQ_SNDHWM, sndhwm) || set_int(s, ZMQ_LINGER, 0);
    if (type == ZMQ_XPUB)
        /* NODROP: refuse at the high-water mark (counted) instead of dropping silently;
         * VERBOSER: every peer's (un)subscription, for the subscribers gauge */
        bad = bad || set_int(s, ZMQ_XPUB_NODROP, 1) || set_int(s, ZMQ_XPUB_VERBOSER, 1);
    else
        /* a full pipe refuses (EAGAIN) instead of dropping the replay silently */
        bad = bad || set_int(s, ZMQ_ROUTER_MANDATORY, 1);
    if (bad) {
        int e = zmq_errno();
        set_err(err, err_len, "cannot set up a ZMQ socket: %s", zmq_strerror(e));
        *rc = KVP_EINTERNAL;
        zmq_close(s);
        return NULL;
    }
    return s;
}

int kvp_evpub_start(const kvp_evpub_config_t *cfg, kvp_ev_stats_t *stats, kvp_evpub_t **out,
                    char *err, size_t err_len)
{
    if (!cfg || !stats || !out) {
        set_err(err, err_len, "kvp_evpub_start: missing argument");
        return KVP_EINVAL;
    }
    if (!cfg->endpoint || !*cfg->endpoint) {
        set_err(err, err_len, "no event endpoint");
        return KVP_EINVAL;
    }
    /* the ROUTER's high-water mark 2 * (buffer_steps + 1) must fit an int */
    if (cfg->buffer_steps < 1 || cfg->buffer_steps > INT_MAX / 2 - 1) {
        set_err(err, err_len, "event buffer_steps %u out of range (1..%d)", cfg->buffer_steps,
                INT_MAX / 2 - 1);
        return KVP_EINVAL;
    }
    if (cfg->hwm < 1 || cfg->hwm > INT_MAX) {
        set_err(err, err_len, "event hwm %u out of range (1..%d)", cfg->hwm, INT_MAX);
        return KVP_EINVAL;
    }
    kvp_evpub_t *p = calloc(1, sizeof(*p));
    if (!p) {
        set_err(err, err_len, "out of memory");
        return KVP_ENOMEM;
    }
    p->efd = -1;
    p->stats = stats;
    p->hwm = cfg->hwm;
    p->dp_rank = cfg->dp_rank;
    p->steps = cfg->buffer_steps;
    pthread_mutex_init(&p->lock, NULL);
    int rc;
    p->topic = strdup(cfg->topic ? cfg->topic : "");
    p->ring = calloc(p->steps, sizeof(*p->ring));
    if (!p->topic || !p->ring) {
        set_err(err, err_len, "out of memory");
        rc = KVP_ENOMEM;
        goto fail;
    }
    p->topic_len = strlen(p->topic);
    p->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (p->efd < 0) {
        rc = -errno;
        set_err(err, err_len, "cannot create an eventfd: %s", strerror(errno));
        goto fail;
    }
    p->zctx = zmq_ctx_new();
    if (!p->zctx) {
        int e = zmq_errno();
        set_err(err, err_len, "cannot create a ZMQ context: %s", zmq_strerror(e));
        rc = e == ENOMEM ? KVP_ENOMEM : KVP_EINTERNAL;
        goto fail;
    }

    p->pub = new_socket(p, ZMQ_XPUB, (int)cfg->hwm, err, err_len, &rc);
    if (!p->pub)
        goto fail;
    if (is_bind_endpoint(cfg->endpoint)) {
        rc = bind_socket(p->pub, "event endpoint", cfg->endpoint, &p->endpoint, err, err_len);
        if (rc)
            goto fail;
    } else {
        if (zmq_connect(p->pub, cfg->endpoint) != 0) {
            int e = zmq_errno();
            set_err(err, err_len, "cannot connect event endpoint %s: %s", cfg->endpoint,
                    zmq_strerror(e));
            rc = zmq_code(e);
            goto fail;
        }
        p->endpoint = strdup(cfg->endpoint);
        if (!p->endpoint) {
            set_err(err, err_len, "out of memory");
            rc = KVP_ENOMEM;
            goto fail;
        }
    }

    if (cfg->replay_endpoint && *cfg->replay_endpoint) {
        p->router = new_socket(p, ZMQ_ROUTER, 2 * ((int)cfg->buffer_steps + 1), err, err_len, &rc);
        if (!p->router)
            goto fail;
        rc = bind_socket(p->router, "replay endpoint", cfg->replay_endpoint, &p->replay_endpoint,
                         err, err_len);
        if (rc)
            goto fail;
    }

    /* The thread starts with every asynchronous signal blocked, so SIGTERM, SIGHUP and SIGINT
     * reach the loop thread; the faults stay deliverable (the sanitizers, a core dump). */
    sigset_t all, old;
    sigfillset(&all);
    sigdelset(&all, SIGSEGV);
    sigdelset(&all, SIGBUS);
    sigdelset(&all, SIGFPE);
    sigdelset(&all, SIGILL);
    sigdelset(&all, SIGABRT);
    sigdelset(&all, SIGTRAP);
    atomic_store_explicit(&stats->subscribers, 0, memory_order_relaxed);
    atomic_store_explicit(&stats->queued, 0, memory_order_relaxed);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int e = pthread_create(&p->thread, NULL, evpub_main, p);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e) {
        set_err(err, err_len, "cannot start the event publisher thread: %s", strerror(e));
        rc = e == EAGAIN ? KVP_ENOMEM : -e;
        goto fail;
    }
    /* its name in top -H, gdb and /proc (best effort) */
    (void)pthread_setname_np(p->thread, "kvp-evpub");
    *out = p;
    return 0;

fail:
    destroy(p, 0);
    return rc;
}

void kvp_evpub_stop(kvp_evpub_t *p, uint32_t timeout_ms)
{
    if (!p)
        return;
    uint64_t deadline = now_ns() + (uint64_t)timeout_ms * 1000000u;
    pthread_mutex_lock(&p->lock);
    p->stopping = 1;
    p->deadline_ns = deadline;
    pthread_mutex_unlock(&p->lock);
    wake(p);
    pthread_join(p->thread, NULL);
    /* Closing with linger 0 would throw away what the thread sent but zmq has not yet written
     * to the peers; the XPUB lingers for what is left of the timeout instead (zmq_ctx_term
     * waits at most that long), the ROUTER not at all. */
    uint64_t now = now_ns(), left_ms = now < deadline ? (deadline - now + 999999u) / 1000000u : 0;
    int linger = left_ms > INT_MAX ? INT_MAX : (int)left_ms;
    destroy(p, linger);
}

const char *kvp_evpub_endpoint(const kvp_evpub_t *p)
{
    return p ? p->endpoint : NULL;
}

const char *kvp_evpub_replay_endpoint(const kvp_evpub_t *p)
{
    return p ? p->replay_endpoint : NULL;
}
