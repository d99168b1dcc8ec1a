/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_evpub.c - the KV-event publisher (server/kvp_evpub.c, issue #29) against real ZMQ
 * sockets in this process: what a SUB receives ([topic, seq, payload], payload byte-equal to
 * kvp_ev_encode's), the subscribers gauge, replay over a DEALER (ranges, the ring's bound,
 * malformed requests, a client that never reads), the endpoints (ipc, tcp bind and connect,
 * tcp://\*:0) and their errors, the high-water mark with a subscriber that never reads, the
 * queue bound, what stop still sends, and that the thread blocks the daemon's signals. Batches
 * are built by hand. Every wait is a poll loop with a deadline.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvp_error.h"
#include "kvp_events.h"
#include "kvp_evpub.h"

#define WAIT_MS 5000 /* the deadline of every wait: far beyond what any step needs */

/* ---- helpers ------------------------------------------------------------------------------ */

static char g_dir[64];

static void make_dir(void)
{
    strcpy(g_dir, "/tmp/kvp_evpub_XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(g_dir));
}

/* Removes what zmq left in the directory (it unlinks its ipc files on close) and the
 * directory. */
static void remove_dir(void)
{
    DIR *d = opendir(g_dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
                char path[512];
                snprintf(path, sizeof(path), "%s/%s", g_dir, e->d_name);
                unlink(path);
            }
        }
        closedir(d);
    }
    rmdir(g_dir);
}

static void ipc_ep(char *out, size_t n, const char *name)
{
    snprintf(out, n, "ipc://%s/%s", g_dir, name);
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Waits until *v == want (WAIT_MS at most); returns the last value seen. sock (or NULL): a
 * socket of ours to keep turning meanwhile: a bound SUB attaches a new peer's pipe, and so
 * sends it the subscription, only when its own thread calls into zmq. */
static uint64_t wait_eq_turning(_Atomic uint64_t *v, uint64_t want, void *sock)
{
    uint64_t end = mono_ms() + WAIT_MS;
    uint64_t x;
    while ((x = atomic_load(v)) != want && mono_ms() < end) {
        if (sock) {
            int ev;
            size_t len = sizeof(ev);
            zmq_getsockopt(sock, ZMQ_EVENTS, &ev, &len);
        }
        sleep_ms(1);
    }
    return x;
}

static uint64_t wait_eq(_Atomic uint64_t *v, uint64_t want)
{
    return wait_eq_turning(v, want, NULL);
}

static void put_be64(uint8_t out[8], uint64_t v)
{
    for (int i = 7; i >= 0; i--) {
        out[i] = (uint8_t)v;
        v >>= 8;
    }
}

/* A batch of nstored chained BlockStored records (block_size tokens each) of scope "tenant-a",
 * then nremoved BlockRemoved records; its contents depend only on the arguments. */
static kvp_ev_batch_t *make_batch(uint64_t seq, uint32_t nstored, uint32_t bs, uint32_t nremoved)
{
    static const char name[] = "tenant-a";
    kvp_ev_batch_t *b = calloc(1, sizeof(*b));
    ck_assert_ptr_nonnull(b);
    b->seq = seq;
    b->ts = 1700000000.25 + (double)seq;
    b->block_size = bs;
    b->n = b->cap = nstored + nremoved;
    b->rec = calloc(b->n ? b->n : 1, sizeof(*b->rec));
    b->ntok = b->tokcap = nstored * bs;
    b->tok = calloc(b->ntok ? b->ntok : 1, sizeof(int32_t));
    b->nnames = b->namescap = sizeof(name);
    b->names = malloc(sizeof(name));
    ck_assert(b->rec && b->tok && b->names);
    memcpy(b->names, name, sizeof(name));
    for (uint32_t t = 0; t < b->ntok; t++)
        b->tok[t] = (int32_t)(seq * 100000u + t);
    for (uint32_t i = 0; i < b->n; i++) {
        kvp_ev_rec_t *r = &b->rec[i];
        for (int k = 0; k < 16; k++)
            r->hash[k] = (uint8_t)(seq * 31u + i * 7u + (unsigned)k);
        if (i < nstored) {
            r->kind = KVP_EV_STORED;
            r->medium = KVP_EV_GPU;
            r->has_parent = i > 0;
            if (i > 0)
                memcpy(r->parent, b->rec[i - 1].hash, 16);
            r->tok_off = i * bs;
        } else {
            r->kind = KVP_EV_REMOVED;
            r->medium = KVP_EV_CPU;
        }
    }
    return b;
}

/* kvp_ev_encode's bytes for make_batch(seq, ...). */
static kvp_ev_buf_t encode_of(uint64_t seq, uint32_t nstored, uint32_t bs, uint32_t nremoved,
                              uint32_t dp_rank, uint32_t *events)
{
    kvp_ev_batch_t *b = make_batch(seq, nstored, bs, nremoved);
    kvp_ev_buf_t out = {0};
    ck_assert_int_eq(kvp_ev_encode(b, dp_rank, &out, events), 0);
    kvp_ev_batch_free(b);
    return out;
}

/* One received multipart message, each frame copied. */
typedef struct {
    int n;
    size_t len[8];
    uint8_t *data[8];
} msgv_t;

/* Receives one message (the socket's RCVTIMEO bounds it); returns its frame count or -1. */
static int recv_msgv(void *s, msgv_t *m)
{
    memset(m, 0, sizeof(*m));
    int more = 1;
    while (more) {
        zmq_msg_t f;
        zmq_msg_init(&f);
        if (zmq_msg_recv(&f, s, 0) < 0) {
            zmq_msg_close(&f);
            return -1;
        }
        more = zmq_msg_more(&f);
        if (m->n < 8) {
            m->len[m->n] = zmq_msg_size(&f);
            m->data[m->n] = malloc(m->len[m->n] + 1);
            ck_assert_ptr_nonnull(m->data[m->n]);
            memcpy(m->data[m->n], zmq_msg_data(&f), m->len[m->n]);
        }
        m->n++;
        zmq_msg_close(&f);
    }
    return m->n;
}

static void msgv_free(msgv_t *m)
{
    for (int i = 0; i < m->n && i < 8; i++)
        free(m->data[i]);
    m->n = 0;
}

static void frame_is(const msgv_t *m, int i, const void *want, size_t len)
{
    ck_assert_uint_eq(m->len[i], len);
    ck_assert(len == 0 || memcmp(m->data[i], want, len) == 0);
}

static void frame_is_seq(const msgv_t *m, int i, uint64_t seq)
{
    uint8_t b[8];
    put_be64(b, seq);
    frame_is(m, i, b, 8);
}

static void *zsock(void *ctx, int type)
{
    void *s = zmq_socket(ctx, type);
    ck_assert_ptr_nonnull(s);
    int v = WAIT_MS;
    ck_assert_int_eq(zmq_setsockopt(s, ZMQ_RCVTIMEO, &v, sizeof(v)), 0);
    v = 0;
    ck_assert_int_eq(zmq_setsockopt(s, ZMQ_LINGER, &v, sizeof(v)), 0);
    return s;
}

static void *sub_socket(void *ctx, const char *ep, const char *topic)
{
    void *s = zsock(ctx, ZMQ_SUB);
    ck_assert_int_eq(zmq_setsockopt(s, ZMQ_SUBSCRIBE, topic, strlen(topic)), 0);
    ck_assert_int_eq(zmq_connect(s, ep), 0);
    return s;
}

static kvp_evpub_config_t config(const char *ep, const char *replay, const char *topic,
                                 uint32_t steps, uint32_t hwm)
{
    kvp_evpub_config_t c = {.endpoint = ep,
                            .replay_endpoint = replay,
                            .topic = topic,
                            .buffer_steps = steps,
                            .hwm = hwm,
                            .dp_rank = 0};
    return c;
}

static kvp_evpub_t *start_ok(const kvp_evpub_config_t *c, kvp_ev_stats_t *st)
{
    kvp_evpub_t *p = NULL;
    char err[256] = "";
    int rc = kvp_evpub_start(c, st, &p, err, sizeof(err));
    ck_assert_msg(rc == 0, "start: %d %s", rc, err);
    ck_assert_ptr_nonnull(p);
    return p;
}

/* Receives one PUB message and checks it is [topic, seq, encode_of(seq, ...)]. */
static void expect_pub(void *sub, const char *topic, uint64_t seq, uint32_t nstored, uint32_t bs,
                       uint32_t nremoved, uint32_t dp_rank)
{
    msgv_t m;
    ck_assert_int_eq(recv_msgv(sub, &m), 3);
    frame_is(&m, 0, topic, strlen(topic));
    frame_is_seq(&m, 1, seq);
    kvp_ev_buf_t want = encode_of(seq, nstored, bs, nremoved, dp_rank, NULL);
    frame_is(&m, 2, want.data, want.len);
    kvp_ev_buf_free(&want);
    msgv_free(&m);
}

/* Sends a replay request [ "", start ] on a DEALER. */
static void ask_replay(void *dealer, uint64_t start)
{
    uint8_t b[8];
    put_be64(b, start);
    ck_assert_int_eq(zmq_send(dealer, "", 0, ZMQ_SNDMORE), 0);
    ck_assert_int_eq(zmq_send(dealer, b, 8, 0), 8);
}

/* Receives one replay answer on a DEALER: ["", topic, seq, payload of make_batch(seq, 2, 4,
 * 1)]. */
static void expect_replayed(void *dealer, const char *topic, uint64_t seq)
{
    msgv_t m;
    ck_assert_int_eq(recv_msgv(dealer, &m), 4);
    frame_is(&m, 0, "", 0);
    frame_is(&m, 1, topic, strlen(topic));
    frame_is_seq(&m, 2, seq);
    kvp_ev_buf_t want = encode_of(seq, 2, 4, 1, 0, NULL);
    frame_is(&m, 3, want.data, want.len);
    kvp_ev_buf_free(&want);
    msgv_free(&m);
}

static void expect_end_marker(void *dealer)
{
    msgv_t m;
    ck_assert_int_eq(recv_msgv(dealer, &m), 4);
    frame_is(&m, 0, "", 0);
    frame_is(&m, 1, "", 0);
    frame_is(&m, 2, "\xff\xff\xff\xff\xff\xff\xff\xff", 8);
    frame_is(&m, 3, "", 0);
    msgv_free(&m);
}

static int count_fds(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    ck_assert_ptr_nonnull(d);
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

/* ---- cases -------------------------------------------------------------------------------- */

START_TEST(subscribers_receive_topic_seq_and_encoded_payload_in_order)
{
    make_dir();
    char ep[128];
    ipc_ep(ep, sizeof(ep), "pub");
    kvp_ev_stats_t st = {0};
    kvp_evpub_config_t c = config(ep, NULL, "kv@test", 16, 1000);
    c.dp_rank = 3;
    kvp_evpub_t *p = start_ok(&c, &st);
    ck_assert_str_eq(kvp_evpub_endpoint(p), ep);
    ck_assert_ptr_null(kvp_evpub_replay_endpoint(p));

    void *ctx = zmq_ctx_new();
    void *by_topic = sub_socket(ctx, ep, "kv@test");
    void *by_topic2 = sub_socket(ctx, ep, "kv@test");
    void *all = sub_socket(ctx, ep, "");
    /* two peers on one topic count twice (XPUB_VERBOSER passes the duplicate) */
    ck_assert_uint_eq(wait_eq(&st.subscribers, 3), 3);

    /* three batches of different shapes: 1, 3 and 2 stored blocks, the last with 2 removals */
    uint32_t shape[3][3] = {{1, 4, 0}, {3, 4, 0}, {2, 8, 2}};
    uint64_t events = 0, blocks = 0, bytes = 0;
    for (uint64_t s = 0; s < 3; s++) {
        uint32_t nev;
        kvp_ev_buf_t e = encode_of(s, shape[s][0], shape[s][1], shape[s][2], 3, &nev);
        events += nev;
        blocks += shape[s][0] + shape[s][2];
        bytes += e.len;
        kvp_ev_buf_free(&e);
        kvp_evpub_submit(p, make_batch(s, shape[s][0], shape[s][1], shape[s][2]));
    }
    for (uint64_t s = 0; s < 3; s++)
        expect_pub(by_topic, "kv@test", s, shape[s][0], shape[s][1], shape[s][2], 3);
    for (uint64_t s = 0; s < 3; s++)
        expect_pub(by_topic2, "kv@test", s, shape[s][0], shape[s][1], shape[s][2], 3);
    for (uint64_t s = 0; s < 3; s++)
        expect_pub(all, "kv@test", s, shape[s][0], shape[s][1], shape[s][2], 3);

    /* a peer that goes away takes its subscription with it, even when another peer still
     * holds the same one */
    zmq_close(by_topic2);
    ck_assert_uint_eq(wait_eq(&st.subscribers, 2), 2);
    zmq_close(all);
    ck_assert_uint_eq(wait_eq(&st.subscribers, 1), 1);

    kvp_evpub_stop(p, 1000);
    ck_assert_uint_eq(st.batches, 3);
    ck_assert_uint_eq(events, 4); /* one BlockStored each, plus the BlockRemoved of batch 2 */
    ck_assert_uint_eq(st.events, events);
    ck_assert_uint_eq(st.blocks, blocks);
    ck_assert_uint_eq(st.bytes, bytes);
    ck_assert_uint_eq(st.dropped_hwm, 0);
    ck_assert_uint_eq(st.dropped_queue, 0);
    ck_assert_uint_eq(st.queued, 0);
    zmq_close(by_topic);
    zmq_ctx_term(ctx);
    remove_dir();
}
END_TEST

START_TEST(a_null_topic_publishes_an_empty_topic_frame)
{
    make_dir();
    char ep[128];
    ipc_ep(ep, sizeof(ep), "pub");
    kvp_ev_stats_t st = {0};
    kvp_evpub_config_t c = config(ep, NULL, NULL, 4, 100);
    c.dp_rank = 7;
    kvp_evpub_t *p = start_ok(&c, &st);
    void *ctx = zmq_ctx_new();
    void *all = sub_socket(ctx, ep, "");
    ck_assert_uint_eq(wait_eq(&st.subscribers, 1), 1);
    kvp_evpub_submit(p, make_batch(0, 1, 4, 0));
    kvp_evpub_submit(p, make_batch(1, 0, 4, 3)); /* removals only */
    expect_pub(all, "", 0, 1, 4, 0, 7);
    expect_pub(all, "", 1, 0, 4, 3, 7);
    kvp_evpub_stop(p, 1000);
    ck_assert_uint_eq(st.blocks, 4);
    zmq_close(all);
    zmq_ctx_term(ctx);
    remove_dir();
}
END_TEST

/* Starts a publisher with a replay endpoint and publishes seqs 0..n-1 (no subscriber: each
 * send succeeds and zmq discards it), waiting until the thread has sent them all. */
static kvp_evpub_t *replay_setup(kvp_ev_stats_t *st, uint32_t steps, uint64_t n, char *rep,
                                 size_t rep_len)
{
    char ep[128];
    ipc_ep(ep, sizeof(ep), "pub");
    ipc_ep(rep, rep_len, "replay");
    kvp_evpub_config_t c = config(ep, rep, "t", steps, 1000);
    kvp_evpub_t *p = start_ok(&c, st);
    ck_assert_str_eq(kvp_evpub_replay_endpoint(p), rep);
    for (uint64_t s = 0; s < n; s++)
        kvp_evpub_submit(p, make_batch(s, 2, 4, 1));
    ck_assert_uint_eq(wait_eq(&st->batches, n), n);
    return p;
}

START_TEST(replay_answers_from_the_start_seq_then_the_end_marker)
{
    make_dir();
    char rep[128];
    kvp_ev_stats_t st = {0};
    kvp_evpub_t *p = replay_setup(&st, 8, 5, rep, sizeof(rep));
    void *ctx = zmq_ctx_new();
    void *d = zsock(ctx, ZMQ_DEALER);
    ck_assert_int_eq(zmq_connect(d, rep), 0);

    ask_replay(d, 2);
    for (uint64_t s = 2; s < 5; s++)
        expect_replayed(d, "t", s);
    expect_end_marker(d);

    ask_replay(d, 5); /* beyond the last: only the end marker */
    expect_end_marker(d);
    ask_replay(d, UINT64_MAX - 1);
    expect_end_marker(d);

    ask_replay(d, 0);
    for (uint64_t s = 0; s < 5; s++)
        expect_replayed(d, "t", s);
    expect_end_marker(d);

    ck_assert_uint_eq(st.replay_requests, 4);
    ck_assert_uint_eq(st.replayed_batches, 3 + 5);
    ck_assert_uint_eq(st.replay_bad, 0);
    kvp_evpub_stop(p, 1000);
    zmq_close(d);
    zmq_ctx_term(ctx);
    remove_dir();
}
END_TEST

START_TEST(replay_keeps_only_the_last_buffer_steps_batches)
{
    make_dir();
    char rep[128];
    kvp_ev_stats_t st = {0};
    kvp_evpub_t *p = replay_setup(&st, 3, 5, rep, sizeof(rep));
    void *ctx = zmq_ctx_new();
    void *d = zsock(ctx, ZMQ_DEALER);
    ck_assert_int_eq(zmq_connect(d, rep), 0);
    ask_replay(d, 0);
    for (uint64_t s = 2; s < 5; s++)
        expect_replayed(d, "t", s);
    expect_end_marker(d);
    ck_assert_uint_eq(st.replayed_batches, 3);

    /* the ring keeps turning: seqs 5..9 leave 7, 8, 9 */
    for (uint64_t s = 5; s < 10; s++)
        kvp_evpub_submit(p, make_batch(s, 2, 4, 1));
    ck_assert_uint_eq(wait_eq(&st.batches, 10), 10);
    ask_replay(d, 8);
    expect_replayed(d, "t", 8);
    expect_replayed(d, "t", 9);
    expect_end_marker(d);
    ask_replay(d, 0);
    for (uint64_t s = 7; s < 10; s++)
        expect_replayed(d, "t", s);
    expect_end_marker(d);
    ck_assert_uint_eq(st.replayed_batches, 3 + 2 + 3);
    kvp_evpub_stop(p, 1000);
    zmq_close(d);
    zmq_ctx_term(ctx);
    remove_dir();
}
END_TEST

START_TEST(malformed_replay_requests_are_counted_and_ignored)
{
    make_dir();
    char rep[128];
    kvp_ev_stats_t st = {0};
    kvp_evpub_t *p = replay_setup(&st, 8, 2, rep, sizeof(rep));
    void *ctx = zmq_ctx_new();
    void *d = zsock(ctx, ZMQ_DEALER);
    ck_assert_int_eq(zmq_connect(d, rep), 0);
    uint8_t z[8] = {0};
    /* 2 frames at the ROUTER: [identity, seq] */
    ck_assert_int_eq(zmq_send(d, z, 8, 0), 8);
    /* 4 frames: [identity, "", seq, "x"] */
    ck_assert_int_eq(zmq_send(d, "", 0, ZMQ_SNDMORE), 0);
    ck_assert_int_eq(zmq_send(d, z, 8, ZMQ_SNDMORE), 8);
    ck_assert_int_eq(zmq_send(d, "x", 1, 0), 1);
    /* 3 frames, but a 4-byte seq */
    ck_assert_int_eq(zmq_send(d, "", 0, ZMQ_SNDMORE), 0);
    ck_assert_int_eq(zmq_send(d, z, 4, 0), 4);
    /* 3 frames, but the delimiter is not empty */
    ck_assert_int_eq(zmq_send(d, "?", 1, ZMQ_SNDMORE), 1);
    ck_assert_int_eq(zmq_send(d, z, 8, 0), 8);
    /* then a good one: its answer is the first thing that comes back */
    ask_replay(d, 1);
    expect_replayed(d, "t", 1);
    expect_end_marker(d);
    ck_assert_uint_eq(st.replay_bad, 4);
    ck_assert_uint_eq(st.replay_requests, 1);
    ck_assert_uint_eq(st.replayed_batches, 1);
    zmq_msg_t m;
    zmq_msg_init(&m);
    ck_assert_int_eq(zmq_msg_recv(&m, d, ZMQ_DONTWAIT), -1);
    zmq_msg_close(&m);
    kvp_evpub_stop(p, 1000);
    zmq_close(d);
    zmq_ctx_term(ctx);
    remove_dir();
}
END_TEST

START_TEST(a_replay_client_that_never_reads_is_cut_short)
{
    make_dir();
    char ep[128], rep[128];
    ipc_ep(ep, sizeof(ep), "pub");
    ipc_ep(rep, sizeof(rep), "replay");
    kvp_ev_stats_t st = {0};
    /* 4 batches of ~80 KB kept; the ROUTER's high-water mark is 2 * (4 + 1) = 10 messages */
    kvp_evpub_config_t c = config(ep, rep, "t", 4, 100);
    kvp_evpub_t *p = start_ok(&c, &st);
    for (uint64_t s = 0; s < 4; s++)
        kvp_evpub_submit(p, make_batch(s, 16, 256, 0));
    ck_assert_uint_eq(wait_eq(&st.batches, 4), 4);
    void *ctx = zmq_ctx_new();
    void *d = zsock(ctx, ZMQ_DEALER);
    int one = 1;
    ck_assert_int_eq(zmq_setsockopt(d, ZMQ_RCVHWM, &one, sizeof(one)), 0);
    ck_assert_int_eq(zmq_connect(d, rep), 0);
    /* 40 requests, 40 * 4 * 80 KB asked for, none read: the pipe fills and the replays are cut
     * short instead of queueing without bound */
    for (int i = 0; i < 40; i++)
        ask_replay(d, 0);
    ck_assert_uint_eq(wait_eq_turning(&st.replay_requests, 40, d), 40);
    ck_assert_uint_lt(st.replayed_batches, 40 * 4);
    ck_assert_uint_ge(st.replayed_batches, 1);
    /* read what did come: whole answers or cut ones, each message well-formed */
    int msgs = 0;
    int t = 300;
    ck_assert_int_eq(zmq_setsockopt(d, ZMQ_RCVTIMEO, &t, sizeof(t)), 0);
    for (;;) {
        msgv_t m;
        if (recv_msgv(d, &m) < 0)
            break;
        ck_assert_int_eq(m.n, 4);
        if (m.len[1] == 0) { /* the end marker */
            frame_is(&m, 2, "\xff\xff\xff\xff\xff\xff\xff\xff", 8);
        } else {
            frame_is(&m, 1, "t", 1);
            msgs++;
        }
        msgv_free(&m);
    }
    ck_assert_uint_eq((uint64_t)msgs, st.replayed_batches);
    /* drained, the client is answered in full again */
    t = WAIT_MS;
    ck_assert_int_eq(zmq_setsockopt(d, ZMQ_RCVTIMEO, &t, sizeof(t)), 0);
    uint64_t before = st.replayed_batches;
    ask_replay(d, 2);
    for (uint64_t s = 2; s < 4; s++) {
        msgv_t m;
        ck_assert_int_eq(recv_msgv(d, &m), 4);
        frame_is_seq(&m, 2, s);
        kvp_ev_buf_t want = encode_of(s, 16, 256, 0, 0, NULL);
        frame_is(&m, 3, want.data, want.len);
        kvp_ev_buf_free(&want);
        msgv_free(&m);
    }
    expect_end_marker(d);
    ck_assert_uint_eq(st.replayed_batches, before + 2);
    kvp_evpub_stop(p, 0);
    zmq_close(d);
    zmq_ctx_term(ctx);
    remove_dir();
}
END_TEST

/* Starts with c, expecting rc and an error naming want_in_err (and not leaving an fd open). */
static void start_fails(const kvp_evpub_config_t *c, int rc, const char *want1, const char *want2)
{
    kvp_ev_stats_t st = {0};
    kvp_evpub_t *p = NULL;
    char err[256] = "";
    int fds = count_fds();
    ck_assert_int_eq(kvp_evpub_start(c, &st, &p, err, sizeof(err)), rc);
    ck_assert_ptr_null(p);
    ck_assert_msg(strstr(err, want1), "err \"%s\" lacks \"%s\"", err, want1);
    if (want2)
        ck_assert_msg(strstr(err, want2), "err \"%s\" lacks \"%s\"", err, want2);
    ck_assert_int_eq(count_fds(), fds);
}

START_TEST(bad_endpoints_fail_with_a_message_naming_them)
{
    make_dir();
    char ep[160], rep[160];
    snprintf(ep, sizeof(ep), "ipc://%s/no/such/dir/pub", g_dir);
    kvp_evpub_config_t c = config(ep, NULL, "t", 4, 10);
    start_fails(&c, -ENOENT, ep, "No such file or directory");

    c = config("tcp://*:notaport", NULL, "t", 4, 10);
    start_fails(&c, KVP_EINVAL, "tcp://*:notaport", "Invalid argument");
    c = config("nosuch://host:1", NULL, "t", 4, 10); /* connected: the transport is unknown */
    start_fails(&c, KVP_EINVAL, "nosuch://host:1", NULL);

    /* a port in use, for the PUB and for the replay endpoint (after the PUB bound fine) */
    void *ctx = zmq_ctx_new();
    void *holder = zsock(ctx, ZMQ_PUB);
    ck_assert_int_eq(zmq_bind(holder, "tcp://*:0"), 0);
    char last[128];
    size_t len = sizeof(last);
    ck_assert_int_eq(zmq_getsockopt(holder, ZMQ_LAST_ENDPOINT, last, &len), 0);
    const char *port = strrchr(last, ':') + 1;
    snprintf(ep, sizeof(ep), "tcp://*:%s", port);
    c = config(ep, NULL, "t", 4, 10);
    start_fails(&c, -EADDRINUSE, ep, "Address already in use");
    char pub_ep[128];
    ipc_ep(pub_ep, sizeof(pub_ep), "pub");
    snprintf(rep, sizeof(rep), "tcp://127.0.0.1:%s", port);
    c = config(pub_ep, rep, "t", 4, 10);
    start_fails(&c, -EADDRINUSE, rep, "replay endpoint");

    /* the configuration itself */
    c = config("", NULL, "t", 4, 10);
    start_fails(&c, KVP_EINVAL, "endpoint", NULL);
    c = config(pub_ep, NULL, "t", 0, 10);
    start_fails(&c, KVP_EINVAL, "buffer_steps", NULL);
    c = config(pub_ep, NULL, "t", 4, 0);
    start_fails(&c, KVP_EINVAL, "hwm", NULL);

    /* and the endpoint the PUB had is free again */
    c = config(pub_ep, NULL, "t", 4, 10);
    kvp_ev_stats_t st = {0};
    kvp_evpub_stop(start_ok(&c, &st), 0);
    zmq_close(holder);
    zmq_ctx_term(ctx);
    remove_dir();
}
END_TEST

START_TEST(tcp_connect_to_a_binding_subscriber)
{
    void *ctx = zmq_ctx_new();
    void *sub = zsock(ctx, ZMQ_SUB);
    ck_assert_int_eq(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0), 0);
    ck_assert_int_eq(zmq_bind(sub, "tcp://127.0.0.1:0"), 0);
    char ep[128];
    size_t len = sizeof(ep);
    ck_assert_int_eq(zmq_getsockopt(sub, ZMQ_LAST_ENDPOINT, ep, &len), 0);
    kvp_ev_stats_t st = {0};
    kvp_evpub_config_t c = config(ep, NULL, "kv", 4, 100);
    kvp_evpub_t *p = start_ok(&c, &st);
    ck_assert_str_eq(kvp_evpub_endpoint(p), ep); /* connected: as given */
    ck_assert_uint_eq(wait_eq_turning(&st.subscribers, 1, sub), 1);
    kvp_evpub_submit(p, make_batch(0, 2, 4, 0));
    kvp_evpub_submit(p, make_batch(1, 1, 4, 1));
    expect_pub(sub, "kv", 0, 2, 4, 0, 0);
    expect_pub(sub, "kv", 1, 1, 4, 1, 0);
    kvp_evpub_stop(p, 1000);
    ck_assert_uint_eq(st.batches, 2);
    zmq_close(sub);
    zmq_ctx_term(ctx);
}
END_TEST

START_TEST(tcp_wildcard_port_zero_reports_the_bound_port)
{
    kvp_ev_stats_t st = {0};
    kvp_evpub_config_t c = config("tcp://*:0", NULL, "kv", 4, 100);
    kvp_evpub_t *p = start_ok(&c, &st);
    const char *ep = kvp_evpub_endpoint(p);
    ck_assert_ptr_nonnull(ep);
    ck_assert_msg(strncmp(ep, "tcp://0.0.0.0:", 14) == 0, "%s", ep);
    char *end;
    long port = strtol(ep + 14, &end, 10);
    ck_assert_int_eq(*end, '\0');
    ck_assert(port > 0 && port < 65536);
    char conn[64];
    snprintf(conn, sizeof(conn), "tcp://127.0.0.1:%ld", port);
    void *ctx = zmq_ctx_new();
    void *sub = sub_socket(ctx, conn, "kv");
    ck_assert_uint_eq(wait_eq(&st.subscribers, 1), 1);
    kvp_evpub_submit(p, make_batch(0, 3, 4, 0));
    expect_pub(sub, "kv", 0, 3, 4, 0, 0);
    kvp_evpub_stop(p, 1000);
    zmq_close(sub);
    zmq_ctx_term(ctx);
}
END_TEST

START_TEST(a_subscriber_that_never_reads_meets_the_high_water_mark)
{
    make_dir();
    char ep[128];
    ipc_ep(ep, sizeof(ep), "pub");
    kvp_ev_stats_t st = {0};
    kvp_evpub_config_t c = config(ep, NULL, "kv", 8, 10);
    kvp_evpub_t *p = start_ok(&c, &st);
    void *ctx = zmq_ctx_new();
    void *sub = zsock(ctx, ZMQ_SUB);
    int hwm = 10;
    ck_assert_int_eq(zmq_setsockopt(sub, ZMQ_RCVHWM, &hwm, sizeof(hwm)), 0);
    ck_assert_int_eq(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0), 0);
    ck_assert_int_eq(zmq_connect(sub, ep), 0);
    ck_assert_uint_eq(wait_eq(&st.subscribers, 1), 1);

    /* 5000 batches of ~5 KB (4 blocks of 256 tokens), never more than hwm queued, so the
     * queue drops none and every refusal is the subscriber's high-water mark */
    const uint64_t n = 5000;
    for (uint64_t s = 0; s < n; s++) {
        uint64_t end = mono_ms() + WAIT_MS;
        while (atomic_load(&st.queued) >= 10 && mono_ms() < end)
            sched_yield();
        kvp_evpub_submit(p, make_batch(s, 4, 256, 0));
    }
    uint64_t end = mono_ms() + 4 * WAIT_MS;
    while (atomic_load(&st.batches) + atomic_load(&st.dropped_hwm) < n && mono_ms() < end)
        sleep_ms(1);
    ck_assert_uint_eq(st.dropped_queue, 0);
    ck_assert_uint_eq(st.batches + st.dropped_hwm, n);
    ck_assert_uint_gt(st.dropped_hwm, 0);
    /* what got through is bounded by the two pipes and the kernel's socket buffers */
    ck_assert_uint_lt(st.batches, n / 2);
    ck_assert_uint_eq(st.subscribers, 1);
    kvp_evpub_stop(p, 0);
    ck_assert_uint_eq(st.batches + st.dropped_hwm + st.dropped_queue, n);
    zmq_close(sub);
    zmq_ctx_term(ctx);
    remove_dir();
}
END_TEST

START_TEST(the_queue_bound_drops_and_counts_a_burst)
{
    kvp_ev_stats_t st = {0};
    kvp_evpub_config_t c = config("inproc://burst", NULL, "kv", 4, 1);
    kvp_evpub_t *p = start_ok(&c, &st);
    const uint64_t n = 2000;
    for (uint64_t s = 0; s < n; s++)
        kvp_evpub_submit(p, make_batch(s, 1, 16, 0));
    kvp_evpub_stop(p, WAIT_MS);
    /* no subscriber: every batch that reached the socket was sent */
    ck_assert_uint_eq(st.dropped_hwm, 0);
    ck_assert_uint_eq(st.batches + st.dropped_queue, n);
    ck_assert_uint_ge(st.batches, 1);
    ck_assert_uint_eq(st.queued, 0);
}
END_TEST

/* A SUB read on a thread of its own, so what stop sends can leave zmq while stop runs. */
typedef struct {
    void *sub;
    _Atomic uint64_t *sent; /* the publisher's batches counter */
    uint64_t n, got;
    int bad; /* the first message that was not [topic "kv", seq got, encode_of(got, 16, 256)] */
} reader_t;

static void *reader_main(void *arg)
{
    reader_t *r = arg;
    /* not a byte read before the publisher has handed all n to zmq: they are all inside zmq
     * (its pipe, the socket buffers) when stop closes the socket */
    if (wait_eq(r->sent, r->n) != r->n)
        return NULL;
    while (r->got < r->n) {
        msgv_t m;
        if (recv_msgv(r->sub, &m) != 3)
            break;
        uint8_t seq[8];
        put_be64(seq, r->got);
        kvp_ev_buf_t want = encode_of(r->got, 16, 256, 0, 0, NULL);
        int ok = m.len[0] == 2 && memcmp(m.data[0], "kv", 2) == 0 && m.len[1] == 8 &&
                 memcmp(m.data[1], seq, 8) == 0 && m.len[2] == want.len &&
                 memcmp(m.data[2], want.data, want.len) == 0;
        kvp_ev_buf_free(&want);
        msgv_free(&m);
        if (!ok) {
            r->bad = 1;
            break;
        }
        r->got++;
    }
    return NULL;
}

START_TEST(the_queue_bound_drops_while_the_thread_is_busy)
{
    kvp_ev_stats_t st = {0};
    kvp_evpub_config_t c = config("inproc://busy", NULL, "kv", 4, 3);
    kvp_evpub_t *p = start_ok(&c, &st);
    /* one batch of 8M token ids keeps the thread encoding for tens of milliseconds at least,
     * and the ten small ones behind it are submitted meanwhile (all built beforehand). The
     * thread takes the big one with k = 0, 1 or 2 small ones (3 fit the bound), then three more
     * fit while it encodes: 7 - k dropped; or it has not woken yet: the big one and two small
     * ones queued, 8 dropped. */
    kvp_ev_batch_t *big = make_batch(0, 1, 8u << 20, 0);
    kvp_ev_batch_t *small[10];
    for (int i = 0; i < 10; i++)
        small[i] = make_batch((uint64_t)i + 1, 1, 4, 0);
    kvp_evpub_submit(p, big);
    for (int i = 0; i < 10; i++)
        kvp_evpub_submit(p, small[i]);
    uint64_t dropped = atomic_load(&st.dropped_queue);
    ck_assert_msg(dropped >= 5 && dropped <= 8, "dropped_queue %llu", (unsigned long long)dropped);
    kvp_evpub_stop(p, WAIT_MS);
    ck_assert_uint_eq(st.dropped_queue, dropped);
    ck_assert_uint_eq(st.batches, 11 - dropped);
    ck_assert_uint_eq(st.queued, 0);
}
END_TEST

START_TEST(stop_sends_what_is_queued)
{
    make_dir();
    char ep[128];
    ipc_ep(ep, sizeof(ep), "pub");
    kvp_ev_stats_t st = {0};
    kvp_evpub_config_t c = config(ep, NULL, "kv", 4, 1000);
    kvp_evpub_t *p = start_ok(&c, &st);
    void *ctx = zmq_ctx_new();
    void *sub = sub_socket(ctx, ep, "kv");
    ck_assert_uint_eq(wait_eq(&st.subscribers, 1), 1);
    const uint64_t n = 500;
    for (uint64_t s = 0; s < n; s++)
        kvp_evpub_submit(p, make_batch(s, 1, 8, 0));
    kvp_evpub_stop(p, WAIT_MS);
    ck_assert_uint_eq(st.batches, n);
    ck_assert_uint_eq(st.dropped_queue, 0);
    ck_assert_uint_eq(st.dropped_hwm, 0);
    for (uint64_t s = 0; s < n; s++)
        expect_pub(sub, "kv", s, 1, 8, 0, 0);
    zmq_close(sub);
    zmq_ctx_term(ctx);
    remove_dir();
}
END_TEST

START_TEST(stop_flushes_a_backlog_left_inside_zmq)
{
    make_dir();
    char ep[128];
    ipc_ep(ep, sizeof(ep), "pub");
    kvp_ev_stats_t st = {0};
    kvp_evpub_config_t c = config(ep, NULL, "kv", 4, 1000);
    kvp_evpub_t *p = start_ok(&c, &st);
    void *ctx = zmq_ctx_new();
    /* a receive HWM of 1: the SUB's side takes almost nothing off the socket before the
     * reader reads, so the backlog stays in the publisher's pipe */
    void *sub = zsock(ctx, ZMQ_SUB);
    int one = 1;
    ck_assert_int_eq(zmq_setsockopt(sub, ZMQ_RCVHWM, &one, sizeof(one)), 0);
    ck_assert_int_eq(zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "kv", 2), 0);
    ck_assert_int_eq(zmq_connect(sub, ep), 0);
    ck_assert_uint_eq(wait_eq(&st.subscribers, 1), 1);
    /* 300 batches of ~80 KB, far more than the socket buffers hold, read only once all are
     * sent: at stop nearly all of it is still inside zmq and must be flushed while the reader
     * reads */
    reader_t r = {.sub = sub, .sent = &st.batches, .n = 300};
    for (uint64_t s = 0; s < r.n; s++)
        kvp_evpub_submit(p, make_batch(s, 16, 256, 0));
    pthread_t th;
    ck_assert_int_eq(pthread_create(&th, NULL, reader_main, &r), 0);
    kvp_evpub_stop(p, WAIT_MS);
    ck_assert_int_eq(pthread_join(th, NULL), 0);
    ck_assert_uint_eq(st.batches, r.n);
    ck_assert_uint_eq(st.dropped_queue, 0);
    ck_assert_uint_eq(st.dropped_hwm, 0);
    ck_assert_int_eq(r.bad, 0);
    /* Everything arrives in order but for at most the last two: zmq drops the message its
     * sending engine was still writing when the lingering session ended, and the one this
     * SUB's engine held back for its full pipe when the connection closed. (Closed with
     * linger 0, nearly all of the backlog would be lost.) */
    ck_assert_msg(r.got >= r.n - 2, "got %llu of %llu", (unsigned long long)r.got,
                  (unsigned long long)r.n);
    zmq_close(sub);
    zmq_ctx_term(ctx);
    remove_dir();
}
END_TEST

/* The blocked-signal mask (SigBlk) of this process's thread named name; 0 when none is. */
static unsigned long long sigblk_of(const char *name, int *found)
{
    *found = 0;
    DIR *d = opendir("/proc/self/task");
    ck_assert_ptr_nonnull(d);
    struct dirent *e;
    unsigned long long mask = 0;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char path[300], comm[64] = "";
        snprintf(path, sizeof(path), "/proc/self/task/%s/comm", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        if (!fgets(comm, sizeof(comm), f))
            comm[0] = '\0';
        fclose(f);
        comm[strcspn(comm, "\n")] = '\0';
        if (strcmp(comm, name) != 0)
            continue;
        snprintf(path, sizeof(path), "/proc/self/task/%s/status", e->d_name);
        f = fopen(path, "r");
        ck_assert_ptr_nonnull(f);
        char line[256];
        while (fgets(line, sizeof(line), f))
            if (sscanf(line, "SigBlk: %llx", &mask) == 1)
                (*found)++;
        fclose(f);
    }
    closedir(d);
    return mask;
}

static int blocks(unsigned long long mask, int sig)
{
    return (mask >> (sig - 1)) & 1;
}

START_TEST(the_thread_blocks_the_daemons_signals)
{
    /* the creator (the loop thread) takes them, and its mask is as it was afterwards */
    sigset_t none, before, after;
    sigemptyset(&none);
    ck_assert_int_eq(pthread_sigmask(SIG_SETMASK, &none, NULL), 0);
    ck_assert_int_eq(pthread_sigmask(SIG_SETMASK, NULL, &before), 0);
    kvp_ev_stats_t st = {0};
    kvp_evpub_config_t c = config("inproc://sig", NULL, "kv", 4, 10);
    kvp_evpub_t *p = start_ok(&c, &st);
    ck_assert_int_eq(pthread_sigmask(SIG_SETMASK, NULL, &after), 0);
    for (int s = 1; s < 32; s++)
        ck_assert_int_eq(sigismember(&before, s), sigismember(&after, s));

    /* glibc starts a thread with everything blocked and sets its mask once it runs: read it
     * after the thread has done some work */
    kvp_evpub_submit(p, make_batch(0, 1, 4, 0));
    ck_assert_uint_eq(wait_eq(&st.batches, 1), 1);
    int found;
    unsigned long long m = sigblk_of("kvp-evpub", &found);
    ck_assert_int_eq(found, 1);
    const int sigs[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGPIPE, SIGCHLD};
    for (size_t i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++)
        ck_assert_msg(blocks(m, sigs[i]), "signal %d not blocked (SigBlk %llx)", sigs[i], m);
    /* faults stay deliverable where they happen */
    ck_assert_msg(!blocks(m, SIGSEGV) && !blocks(m, SIGBUS), "SigBlk %llx", m);
    kvp_evpub_stop(p, 1000);
    sigblk_of("kvp-evpub", &found);
    ck_assert_int_eq(found, 0); /* joined */
}
END_TEST

START_TEST(stop_of_null_is_a_noop)
{
    kvp_evpub_stop(NULL, 0);
    ck_assert_ptr_null(kvp_evpub_endpoint(NULL));
    ck_assert_ptr_null(kvp_evpub_replay_endpoint(NULL));
}
END_TEST

int main(void)
{
    Suite *s = suite_create("evpub");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, subscribers_receive_topic_seq_and_encoded_payload_in_order);
    tcase_add_test(tc, a_null_topic_publishes_an_empty_topic_frame);
    tcase_add_test(tc, replay_answers_from_the_start_seq_then_the_end_marker);
    tcase_add_test(tc, replay_keeps_only_the_last_buffer_steps_batches);
    tcase_add_test(tc, malformed_replay_requests_are_counted_and_ignored);
    tcase_add_test(tc, a_replay_client_that_never_reads_is_cut_short);
    tcase_add_test(tc, bad_endpoints_fail_with_a_message_naming_them);
    tcase_add_test(tc, tcp_connect_to_a_binding_subscriber);
    tcase_add_test(tc, tcp_wildcard_port_zero_reports_the_bound_port);
    tcase_add_test(tc, a_subscriber_that_never_reads_meets_the_high_water_mark);
    tcase_add_test(tc, the_queue_bound_drops_and_counts_a_burst);
    tcase_add_test(tc, the_queue_bound_drops_while_the_thread_is_busy);
    tcase_add_test(tc, stop_sends_what_is_queued);
    tcase_add_test(tc, stop_flushes_a_backlog_left_inside_zmq);
    tcase_add_test(tc, the_thread_blocks_the_daemons_signals);
    tcase_add_test(tc, stop_of_null_is_a_noop);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
