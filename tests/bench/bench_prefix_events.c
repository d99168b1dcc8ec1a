/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bench_prefix_events.c - bench_prefix's part 7: what KV events (issue #29) cost. The issue's
 * targets: the publisher sustains >= 1 M block events/s on one core, and a Reserve with token
 * ids is at most 1% slower (p50) with events on than off. Three measurements:
 *
 *   a) the encoder (kvp_ev_encode) on one core: batches of a 64-block chain (64 STORED
 *      records, 16 tokens each, one scope: one BlockStored of 64 hashes) and of 64 REMOVED
 *      records, made by the real batcher, rotating among 16 of each; median of per-batch rates.
 *   b) the publisher (kvp_evpub) on an ipc:// endpoint with a real subscriber (a SUB socket in
 *      a reader thread of this process): 18,000 batches of 64 stored blocks submitted
 *      back-to-back from this thread, as the daemon's loop would, timed from the first submit
 *      until its counters account for all of them (sent or dropped), and until the SUB
 *      received them; then 2,000 more one at a time, each once the thread is idle again (what
 *      a loop iteration usually meets): the submit call alone, which wakes the thread. Then
 *      the loop's own cost: kvp_events_observe of 16-token STORED events and a flush every 64
 *      into a sink that frees the batch, ns per block event, median.
 *   c) two real kvpoold (host backend), one publishing events to a SUB reader thread, one
 *      without; round by round, in the order A B, B A, ..., each gets a new sequence of 512
 *      new token ids (Reserve with reuse: 32 pages keyed), its Commit (32 blocks stored) and
 *      its Release (32 pages cached, evicted under pressure by later Reserves: removals).
 *      Reserve and Commit are timed apart; p50/p99 on and off and the ratios of the p50s; and
 *      each daemon's CPU time per round from /proc (counted, not timed: on a 2-core machine
 *      the publisher's threads and the client share the cores, so latency alone mixes the
 *      events' own cost with who waited for a core).
 *
 * Figures are printed, not asserted; -1 only when what is measured did not happen.
 */
#include "bench_prefix_events.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "kvp_events.h"
#include "kvp_evpub.h"
#include "kvp_harness.h"
#include "kvp_pagekey.h"
#include "kvpool.h"

#define EV_PS       16u                   /* tokens per block */
#define EV_CHAIN    64u                   /* blocks per batch */
#define EV_DISTINCT 16u                   /* distinct batches the in-process loops rotate among */
#define EV_SCOPE    "ns:bench"            /* the scope's published name */
#define EV_TOKENS   512u                  /* c): tokens per sequence */
#define EV_PAGES    (EV_TOKENS / EV_PS)   /* c): its pages (32) */
#define EV_POOL     "pool.num_pages=4096" /* c): the daemons' pool: full after 128 rounds */

static void ev_sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static void *ev_alloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "bench_prefix: out of memory\n");
        exit(1);
    }
    return p;
}

/* Random token ids of a Llama-3 vocabulary (most take 5 bytes in msgpack, as real ids do). */
static void ev_fill_tokens(int32_t *t, size_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9e3779b97f4a7c15ull | 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        t[i] = (int32_t)(x % 128256);
    }
}

/* ---- in-process: chains, the batcher, batches ----------------------------------------------- */

/* EV_DISTINCT chains of EV_CHAIN blocks: token ids, keys as the prefix cache chains them, and
 * the prefix cache's STORED and REMOVED events of every block. */
typedef struct {
    int32_t tok[EV_DISTINCT][EV_CHAIN * EV_PS];
    kvp_pagekey_t key[EV_DISTINCT][EV_CHAIN];
    kvp_pcache_event_t stored[EV_DISTINCT][EV_CHAIN], removed[EV_DISTINCT][EV_CHAIN];
    kvp_pagekey_t tag; /* EV_SCOPE's */
} ev_chains_t;

static void ev_chains_init(ev_chains_t *ch)
{
    kvp_pagekey_t root;
    kvp_pagekey_root(NULL, 0, &root);
    kvp_pagekey_root(EV_SCOPE, strlen(EV_SCOPE), &ch->tag);
    for (uint32_t c = 0; c < EV_DISTINCT; c++) {
        ev_fill_tokens(ch->tok[c], EV_CHAIN * EV_PS, 0x5eed + c);
        kvp_pagekey_chain(root, ch->tok[c], EV_CHAIN * EV_PS, EV_PS, ch->key[c], EV_CHAIN);
        for (uint32_t j = 0; j < EV_CHAIN; j++) {
            ch->stored[c][j] = (kvp_pcache_event_t){.kind = KVP_PCEV_STORED,
                                                    .medium = KVP_MEDIUM_GPU,
                                                    .scope = 0,
                                                    .has_parent = j > 0,
                                                    .key = ch->key[c][j],
                                                    .parent = j ? ch->key[c][j - 1] : root,
                                                    .tokens = ch->tok[c] + j * EV_PS};
            ch->removed[c][j] = (kvp_pcache_event_t){
                .kind = KVP_PCEV_REMOVED, .medium = KVP_MEDIUM_GPU, .key = ch->key[c][j]};
        }
    }
}

/* The batcher's scope names: one scope, as a namespace's own. */
static void ev_scope_fn(void *ctx, uint32_t scope, const char **name, kvp_pagekey_t *tag)
{
    const ev_chains_t *ch = ctx;
    (void)scope;
    *name = EV_SCOPE;
    *tag = ch->tag;
}

/* A sink that keeps the closed batch (ctx: where). */
static void ev_sink_keep(void *ctx, kvp_ev_batch_t *b)
{
    *(kvp_ev_batch_t **)ctx = b;
}

/* A sink that counts the batch's records (ctx: a uint64_t) and frees it. */
static void ev_sink_free(void *ctx, kvp_ev_batch_t *b)
{
    *(uint64_t *)ctx += b->n;
    kvp_ev_batch_free(b);
}

/* Batches of each chain's stored (or removed) events, as the batcher closes them. */
static int ev_make_batches(ev_chains_t *ch, int removed, kvp_ev_batch_t **out)
{
    kvp_ev_batch_t *got = NULL;
    kvp_events_t *e = NULL;
    if (kvp_events_create(EV_PS, ev_sink_keep, &got, ev_scope_fn, ch, &e))
        return -1;
    for (uint32_t c = 0; c < EV_DISTINCT; c++) {
        for (uint32_t j = 0; j < EV_CHAIN; j++)
            kvp_events_observe(e, removed ? &ch->removed[c][j] : &ch->stored[c][j]);
        got = NULL;
        kvp_events_flush(e);
        if (!got || got->n != EV_CHAIN) {
            kvp_events_destroy(e);
            return -1;
        }
        out[c] = got;
    }
    kvp_events_destroy(e);
    return 0;
}

/* A deep copy of b (the publisher takes ownership of what it is handed). */
static kvp_ev_batch_t *ev_batch_copy(const kvp_ev_batch_t *b)
{
    kvp_ev_batch_t *c = ev_alloc(sizeof(*c));
    *c = *b;
    c->next = NULL;
    c->rec = ev_alloc((size_t)b->n * sizeof(*b->rec));
    c->tok = ev_alloc((size_t)b->ntok * sizeof(*b->tok));
    c->names = ev_alloc(b->nnames);
    memcpy(c->rec, b->rec, (size_t)b->n * sizeof(*b->rec));
    memcpy(c->tok, b->tok, (size_t)b->ntok * sizeof(*b->tok));
    memcpy(c->names, b->names, b->nnames);
    c->cap = b->n, c->tokcap = b->ntok, c->namescap = b->nnames;
    return c;
}

/* ---- a) the encoder ---------------------------------------------------------------------- */

/* Encodes batches (rotating among src[EV_DISTINCT]) one at a time: the median per-batch rate
 * in block events/s, or 0 when an encode failed. *events and *bytes: of the last one. */
static double ev_encode_rate(kvp_ev_batch_t *const *src, uint32_t batches, uint32_t *events,
                             size_t *bytes)
{
    kvp_ev_buf_t out = {0};
    uint64_t *ns = ev_alloc((size_t)batches * sizeof(uint64_t));
    const uint32_t warm = batches / 10 + EV_DISTINCT;
    double rate = 0;
    for (uint32_t i = 0; i < warm + batches; i++) {
        uint32_t nev = 0;
        uint64_t t0 = bench_now_ns();
        int rc = kvp_ev_encode(src[i % EV_DISTINCT], 0, &out, &nev);
        uint64_t t1 = bench_now_ns();
        if (rc) {
            fprintf(stderr, "bench_prefix: kvp_ev_encode: %d\n", rc);
            goto out;
        }
        if (i >= warm)
            ns[i - warm] = t1 - t0;
        *events = nev;
        *bytes = out.len;
    }
    uint64_t med = bench_quantile(ns, batches, 0.5);
    rate = EV_CHAIN * 1e9 / (double)(med ? med : 1);
out:
    kvp_ev_buf_free(&out);
    free(ns);
    return rate;
}

/* ---- the subscriber: a SUB socket in a thread of its own ---------------------------------- */

typedef struct {
    char endpoint[192];
    pthread_t th;
    atomic_int stop, ready;            /* ready: 1 connected, -1 failed */
    _Atomic uint64_t msgs, bytes, bad; /* messages of 3 frames, their payload bytes; others */
    char err[320];
} ev_reader_t;

static void *ev_reader_main(void *arg)
{
    ev_reader_t *r = arg;
    void *ctx = zmq_ctx_new();
    void *s = ctx ? zmq_socket(ctx, ZMQ_SUB) : NULL;
    /* no receive high-water mark: this reader must never be why the publisher drops */
    int zero = 0, tmo_ms = 20;
    if (!s || zmq_setsockopt(s, ZMQ_RCVHWM, &zero, sizeof(zero)) ||
        zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero)) ||
        zmq_setsockopt(s, ZMQ_RCVTIMEO, &tmo_ms, sizeof(tmo_ms)) ||
        zmq_setsockopt(s, ZMQ_SUBSCRIBE, "", 0) || zmq_connect(s, r->endpoint)) {
        snprintf(r->err, sizeof(r->err), "SUB %s: %s", r->endpoint, zmq_strerror(zmq_errno()));
        atomic_store(&r->ready, -1);
        goto out;
    }
    atomic_store(&r->ready, 1);
    zmq_msg_t m;
    zmq_msg_init(&m);
    uint32_t frames = 0;
    while (!atomic_load_explicit(&r->stop, memory_order_relaxed)) {
        if (zmq_msg_recv(&m, s, 0) < 0) {
            int e = zmq_errno();
            if (e == EAGAIN || e == EINTR)
                continue;
            snprintf(r->err, sizeof(r->err), "SUB recv: %s", zmq_strerror(e));
            break;
        }
        frames++;
        if (!zmq_msg_more(&m)) {
            /* [topic, seq, payload] */
            if (frames == 3) {
                atomic_fetch_add_explicit(&r->bytes, zmq_msg_size(&m), memory_order_relaxed);
                atomic_fetch_add_explicit(&r->msgs, 1, memory_order_relaxed);
            } else {
                atomic_fetch_add_explicit(&r->bad, 1, memory_order_relaxed);
            }
            frames = 0;
        }
    }
    zmq_msg_close(&m);
out:
    if (s)
        zmq_close(s);
    if (ctx)
        zmq_ctx_term(ctx);
    return NULL;
}

/* Starts the reader on endpoint; 0 once its SUB socket is connected, -1 otherwise. */
static int ev_reader_start(ev_reader_t *r, const char *endpoint)
{
    memset(r, 0, sizeof(*r));
    snprintf(r->endpoint, sizeof(r->endpoint), "%s", endpoint);
    if (pthread_create(&r->th, NULL, ev_reader_main, r)) {
        fprintf(stderr, "bench_prefix: cannot start the SUB reader\n");
        return -1;
    }
    while (atomic_load(&r->ready) == 0)
        ev_sleep_us(1000);
    if (atomic_load(&r->ready) < 0) {
        pthread_join(r->th, NULL);
        fprintf(stderr, "bench_prefix: %s\n", r->err);
        return -1;
    }
    return 0;
}

static void ev_reader_stop(ev_reader_t *r)
{
    atomic_store(&r->stop, 1);
    pthread_join(r->th, NULL);
    if (r->err[0])
        fprintf(stderr, "bench_prefix: %s\n", r->err);
}

static uint64_t ev_load(_Atomic uint64_t *v)
{
    return atomic_load_explicit(v, memory_order_relaxed);
}

/* ---- b) the publisher and the batcher ------------------------------------------------------ */

/* Waits until the publisher's counters account for want batches (sent or dropped) or the
 * deadline passes; returns how many they account for. */
static uint64_t ev_wait_done(kvp_ev_stats_t *st, uint64_t want, uint64_t deadline, long poll_us)
{
    uint64_t done;
    while ((done = ev_load(&st->batches) + ev_load(&st->dropped_hwm) +
                   ev_load(&st->dropped_queue)) < want &&
           bench_now_ns() < deadline)
        ev_sleep_us(poll_us);
    return done;
}

/* Hands n copies of src (rotating) to a publisher with a SUB attached: the first n - n/10
 * (at most 2,000 fewer) back-to-back, then the rest one at a time to an idle thread. 0, or -1
 * when nothing was measured. */
static int ev_bench_publish(kvp_ev_batch_t *const *src, uint32_t n, bench_events_result_t *res)
{
    char dir[] = "/tmp/kvpev.XXXXXX";
    if (!mkdtemp(dir)) {
        perror("bench_prefix: mkdtemp");
        return -1;
    }
    char ep[96], path[96];
    snprintf(path, sizeof(path), "%s/pub.sock", dir);
    snprintf(ep, sizeof(ep), "ipc://%s/pub.sock", dir);
    /* the daemon's defaults but the high-water mark: high enough that nothing should drop */
    kvp_evpub_config_t cfg = {.endpoint = ep, .topic = "kv", .buffer_steps = 10000, .hwm = 1000000};
    kvp_ev_stats_t st = {0};
    kvp_evpub_t *p = NULL;
    ev_reader_t rd;
    char err[256];
    int rc = -1, reading = 0;
    const uint32_t idle = n / 10 < 2000 ? n / 10 : 2000, bulk = n - idle;
    uint64_t *ins = ev_alloc((size_t)idle * sizeof(uint64_t));
    kvp_ev_batch_t **q = ev_alloc((size_t)n * sizeof(*q));
    for (uint32_t i = 0; i < n; i++) {
        q[i] = ev_batch_copy(src[i % EV_DISTINCT]);
        q[i]->seq = i;
    }
    uint32_t handed = 0;
    if (kvp_evpub_start(&cfg, &st, &p, err, sizeof(err))) {
        fprintf(stderr, "bench_prefix: kvp_evpub_start: %s\n", err);
        goto out;
    }
    if (ev_reader_start(&rd, ep))
        goto out;
    reading = 1;
    /* the subscription must have reached the publisher, else its first batches go nowhere */
    uint64_t deadline = bench_now_ns() + 5000000000ull;
    while (ev_load(&st.subscribers) < 1 && bench_now_ns() < deadline)
        ev_sleep_us(1000);
    if (ev_load(&st.subscribers) < 1) {
        fprintf(stderr, "bench_prefix: the publisher saw no subscriber in 5 s\n");
        goto out;
    }
    /* throughput: everything at once, as fast as the loop could hand it over */
    const uint64_t t0 = bench_now_ns();
    for (; handed < bulk; handed++)
        kvp_evpub_submit(p, q[handed]);
    const uint64_t t_sub = bench_now_ns();
    /* at least 10 s, or 100 us a batch, before giving up */
    const uint64_t done = ev_wait_done(&st, bulk, t0 + 10000000000ull + bulk * 100000ull, 100);
    const uint64_t t1 = bench_now_ns();
    const uint64_t sent = ev_load(&st.batches);
    deadline = t1 + 10000000000ull;
    while (ev_load(&rd.msgs) < sent && bench_now_ns() < deadline)
        ev_sleep_us(100);
    const uint64_t t2 = bench_now_ns();
    const uint64_t got = ev_load(&rd.msgs), got_bytes = ev_load(&rd.bytes);
    if (done < bulk)
        fprintf(stderr, "bench_prefix: the publisher accounted for %llu of %u batches in %.1f s\n",
                (unsigned long long)done, bulk, (double)(t1 - t0) / 1e9);
    if (got == 0 || done < bulk) {
        fprintf(stderr, "bench_prefix: the subscriber received %llu batches\n",
                (unsigned long long)got);
        goto out;
    }
    /* the loop's side of one hand-over to an idle thread (what a daemon's loop iteration
     * usually meets): the submit call alone, which wakes the thread through its eventfd */
    for (uint32_t i = 0; i < idle; i++, handed++) {
        const uint64_t s0 = bench_now_ns();
        kvp_evpub_submit(p, q[handed]);
        ins[i] = bench_now_ns() - s0;
        if (ev_wait_done(&st, (uint64_t)handed + 1, bench_now_ns() + 5000000000ull, 20) <
            (uint64_t)handed + 1) {
            fprintf(stderr, "bench_prefix: an idle publisher did not send a batch in 5 s\n");
            goto out;
        }
    }
    res->pub_dropped = ev_load(&st.dropped_hwm) + ev_load(&st.dropped_queue);
    res->pub_received = got;
    res->pub_bps = (double)bulk * EV_CHAIN * 1e9 / (double)(t1 - t0);
    res->pub_delivered_bps = got == sent ? (double)got * EV_CHAIN * 1e9 / (double)(t2 - t0) : 0;
    res->pub_idle_submit_ns = idle ? (double)bench_quantile(ins, idle, 0.5) : 0;
    res->pub_ok = 1;
    rc = 0;
    printf("   publisher (kvp_evpub: its thread encodes and sends; ipc://, hwm 1,000,000, a SUB "
           "reader thread of this process): %u batches of %u stored blocks (%.2f M block "
           "events) submitted back-to-back in %.1f ms\n",
           bulk, EV_CHAIN, (double)bulk * EV_CHAIN / 1e6, (double)(t_sub - t0) / 1e6);
    printf("     sent (its counters account for all) after %.1f ms: %.2f M block events/s, "
           "%.1f MB/s of payload\n",
           (double)(t1 - t0) / 1e6, res->pub_bps / 1e6,
           (double)ev_load(&st.bytes) * 1e3 / (double)(t1 - t0));
    if (got == sent)
        printf("     received by the SUB (%llu messages, %llu payload bytes) after %.1f ms: %.2f "
               "M block events/s\n",
               (unsigned long long)got, (unsigned long long)got_bytes, (double)(t2 - t0) / 1e6,
               res->pub_delivered_bps / 1e6);
    else
        printf("     received by the SUB: %llu of %llu messages sent\n", (unsigned long long)got,
               (unsigned long long)sent);
    printf("     then %u more one at a time to the idle thread: kvp_evpub_submit p50 %.0f ns "
           "(p99 %.0f); dropped in all: hwm %llu, queue %llu\n",
           idle, res->pub_idle_submit_ns, idle ? (double)bench_quantile(ins, idle, 0.99) : 0.0,
           (unsigned long long)ev_load(&st.dropped_hwm),
           (unsigned long long)ev_load(&st.dropped_queue));
out:
    if (reading)
        ev_reader_stop(&rd);
    kvp_evpub_stop(p, 1000);
    for (uint32_t i = handed; i < n; i++)
        kvp_ev_batch_free(q[i]);
    free(q);
    free(ins);
    unlink(path);
    rmdir(dir);
    return rc;
}

/* The loop's cost: observe EV_CHAIN stored events and flush, per block event (median). */
static int ev_bench_observe(ev_chains_t *ch, uint32_t batches, bench_events_result_t *res)
{
    uint64_t recs = 0;
    kvp_events_t *e = NULL;
    if (kvp_events_create(EV_PS, ev_sink_free, &recs, ev_scope_fn, ch, &e))
        return -1;
    uint64_t *ns = ev_alloc((size_t)batches * sizeof(uint64_t));
    const uint32_t warm = batches / 10 + EV_DISTINCT;
    for (uint32_t i = 0; i < warm + batches; i++) {
        const kvp_pcache_event_t *ev = ch->stored[i % EV_DISTINCT];
        uint64_t t0 = bench_now_ns();
        for (uint32_t j = 0; j < EV_CHAIN; j++)
            kvp_events_observe(e, &ev[j]);
        kvp_events_flush(e);
        uint64_t t1 = bench_now_ns();
        if (i >= warm)
            ns[i - warm] = t1 - t0;
    }
    const uint64_t want = (uint64_t)(warm + batches) * EV_CHAIN;
    int rc = -1;
    if (recs != want || kvp_events_lost(e)) {
        fprintf(stderr, "bench_prefix: the batcher closed %llu records of %llu (%llu lost)\n",
                (unsigned long long)recs, (unsigned long long)want,
                (unsigned long long)kvp_events_lost(e));
    } else {
        res->obs_ns = (double)bench_quantile(ns, batches, 0.5) / EV_CHAIN;
        res->obs_ok = 1;
        rc = 0;
        printf("   the loop's cost (kvp_events_observe of %u stored 16-token blocks, then "
               "kvp_events_flush into a sink that frees): %.1f ns per block event (median of "
               "%u batches; p99 %.1f)\n",
               EV_CHAIN, res->obs_ns, batches,
               (double)bench_quantile(ns, batches, 0.99) / EV_CHAIN);
    }
    kvp_events_destroy(e);
    free(ns);
    return rc;
}

/* ---- c) two kvpoold, events on and off ---------------------------------------------------- */

/* A process's CPU time so far in ns, from /proc's schedstat of each of its threads (time on a
 * CPU, ns resolution): in all, its publisher's thread ("kvp-evpub") and ZMQ's background
 * threads ("ZMQbg/..."). */
typedef struct {
    uint64_t all, evpub, zmq;
} ev_cpu_t;

static ev_cpu_t ev_proc_cpu(pid_t pid)
{
    ev_cpu_t c = {0};
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    if (!d)
        return c;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        char f[96], comm[32] = "";
        snprintf(f, sizeof(f), "/proc/%d/task/%.16s/comm", (int)pid, de->d_name);
        FILE *fp = fopen(f, "r");
        if (fp) {
            if (!fgets(comm, sizeof(comm), fp))
                comm[0] = '\0';
            fclose(fp);
        }
        snprintf(f, sizeof(f), "/proc/%d/task/%.16s/schedstat", (int)pid, de->d_name);
        fp = fopen(f, "r");
        unsigned long long ns = 0;
        if (fp) {
            if (fscanf(fp, "%llu", &ns) != 1)
                ns = 0;
            fclose(fp);
        }
        c.all += ns;
        if (!strncmp(comm, "kvp-evpub", 9))
            c.evpub += ns;
        else if (!strncmp(comm, "ZMQbg", 5))
            c.zmq += ns;
    }
    closedir(d);
    return c;
}

/* One daemon of the pair and what its rounds measured. */
typedef struct {
    const char *name;
    kvp_daemon_t d;
    int up;
    kvp_client_t *c;
    uint64_t next_id;
    uint64_t *res_ns, *com_ns;
} ev_side_t;

/* The value of the metrics line "<name> <value>" (name with its labels), or -1 when absent. */
static int ev_metric(const char *text, const char *name, uint64_t *v)
{
    const size_t len = strlen(name);
    for (const char *p = text; (p = strstr(p, name)) != NULL; p += len) {
        if ((p == text || p[-1] == '\n') && p[len] == ' ') {
            *v = strtoull(p + len + 1, NULL, 10);
            return 0;
        }
    }
    return -1;
}

/* Reads one metric of the side's daemon into *v; 0 or -1. */
static int ev_side_metric(ev_side_t *s, char *text, size_t cap, const char *name, uint64_t *v)
{
    if (kvp_client_metrics(s->c, text, cap, NULL)) {
        fprintf(stderr, "bench_prefix: Metrics: %s\n", kvp_client_last_error(s->c));
        return -1;
    }
    if (ev_metric(text, name, v)) {
        fprintf(stderr, "bench_prefix: no %s in the daemon's metrics\n", name);
        return -1;
    }
    return 0;
}

static int ev_side_start(ev_side_t *s, const char *events_set)
{
    const char *args[] = {"--log-level",
                          "warning",
                          "--backend",
                          "host",
                          "--num-layers",
                          "2",
                          "--num-kv-heads",
                          "2",
                          "--head-dim",
                          "16",
                          "--set",
                          EV_POOL,
                          "--set",
                          "pool.page_size=16",
                          events_set ? "--set" : NULL,
                          events_set,
                          NULL};
    if (kvp_daemon_start(&s->d, args)) {
        fprintf(stderr, "bench_prefix: kvpoold (events %s) did not start\n", s->name);
        return -1;
    }
    s->up = 1;
    kvp_client_opts_t o = {.socket_path = s->d.sock,
                           .ns = "bench",
                           .client_name = "bench_prefix",
                           .timeout_ms = 30000};
    char err[256];
    if (kvp_client_connect(&o, &s->c, err, sizeof(err))) {
        fprintf(stderr, "bench_prefix: connect: %s\n", err);
        return -1;
    }
    return 0;
}

/* One round on one daemon: Reserve (timed), Commit (timed), Release. */
static int ev_side_round(ev_side_t *s, const int32_t *tok, kvp_page_table_t *t,
                         const uint32_t *cached, uint64_t *res_ns, uint64_t *com_ns)
{
    uint64_t id = ++s->next_id;
    const uint32_t n = EV_TOKENS;
    kvp_cache_opts_t o = {.token_ids = tok, .reuse = 1, .priority = -1};
    uint64_t t0 = bench_now_ns();
    int rc = kvp_client_reserve_cached(s->c, &id, &n, 1, &o, t);
    uint64_t t1 = bench_now_ns();
    if (rc || t->num_indices != EV_PAGES || cached[0] != 0) {
        fprintf(stderr, "bench_prefix: a Reserve (events %s): rc %d, %u pages, %u cached: %s\n",
                s->name, rc, t->num_indices, cached[0], kvp_client_last_error(s->c));
        return -1;
    }
    uint32_t pages = 0, published = 0;
    uint64_t t2 = bench_now_ns();
    rc = kvp_client_commit(s->c, &id, 1, NULL, &pages, &published);
    uint64_t t3 = bench_now_ns();
    if (rc || published != EV_PAGES) {
        fprintf(stderr, "bench_prefix: a Commit (events %s): rc %d, %u of %u published: %s\n",
                s->name, rc, published, pages, kvp_client_last_error(s->c));
        return -1;
    }
    if (kvp_client_release(s->c, &id, 1, NULL)) {
        fprintf(stderr, "bench_prefix: a Release: %s\n", kvp_client_last_error(s->c));
        return -1;
    }
    *res_ns = t1 - t0;
    *com_ns = t3 - t2;
    return 0;
}

static int ev_bench_daemons(uint32_t rounds, bench_events_result_t *res)
{
    char dir[] = "/tmp/kvpev.XXXXXX";
    if (!mkdtemp(dir)) {
        perror("bench_prefix: mkdtemp");
        return -1;
    }
    char ep[96], path[96], set[128];
    snprintf(path, sizeof(path), "%s/ev.sock", dir);
    snprintf(ep, sizeof(ep), "ipc://%s/ev.sock", dir);
    snprintf(set, sizeof(set), "events.endpoint=%s", ep);
    ev_side_t side[2] = {{.name = "on"}, {.name = "off"}};
    ev_reader_t rd;
    int reading = 0, rc = -1;
    const size_t mcap = 1u << 20;
    char *mtext = ev_alloc(mcap);
    const uint32_t warm = rounds / 10 + 1;
    int32_t *tok = ev_alloc(EV_TOKENS * sizeof(int32_t));
    /* a batch of one, with room (the arrays' caps are elements, kv_indptr's too) */
    int32_t indptr[4], aindptr[4], indices[EV_PAGES + 8], last[4], lens[4];
    uint32_t cached[4] = {0};
    kvp_page_table_t table = {.kv_indptr = indptr,
                              .kv_indices = indices,
                              .kv_last_page_len = last,
                              .append_indptr = aindptr,
                              .seq_lens = lens,
                              .cap_batch = 4,
                              .cap_indices = EV_PAGES + 8,
                              .cached_tokens = cached};
    for (int i = 0; i < 2; i++) {
        side[i].res_ns = ev_alloc((size_t)rounds * sizeof(uint64_t));
        side[i].com_ns = ev_alloc((size_t)rounds * sizeof(uint64_t));
    }
    if (ev_side_start(&side[0], set) || ev_side_start(&side[1], NULL) || ev_reader_start(&rd, ep))
        goto out;
    reading = 1;
    uint64_t subs = 0, b0 = 0;
    uint64_t deadline = bench_now_ns() + 5000000000ull;
    while (!ev_side_metric(&side[0], mtext, mcap, "kvpool_events_subscribers", &subs) && subs < 1 &&
           bench_now_ns() < deadline)
        ev_sleep_us(2000);
    if (subs < 1) {
        fprintf(stderr, "bench_prefix: the events daemon saw no subscriber in 5 s\n");
        goto out;
    }
    if (ev_side_metric(&side[0], mtext, mcap, "kvpool_events_batches_total", &b0))
        goto out;
    const uint64_t got0 = ev_load(&rd.msgs);
    const uint64_t t0 = bench_now_ns();
    ev_cpu_t cpu0[2] = {{0}}, cpu1[2];
    for (uint32_t r = 0; r < warm + rounds; r++) {
        if (r == warm)
            for (int k = 0; k < 2; k++)
                cpu0[k] = ev_proc_cpu(side[k].d.pid);
        ev_fill_tokens(tok, EV_TOKENS, 0x10000ull + r); /* new content every round */
        for (int k = 0; k < 2; k++) {
            /* A B, then B A: each daemon goes first every other round */
            ev_side_t *s = &side[(r & 1) ^ k];
            uint64_t rn, cn;
            if (ev_side_round(s, tok, &table, cached, &rn, &cn))
                goto out;
            if (r >= warm)
                s->res_ns[r - warm] = rn, s->com_ns[r - warm] = cn;
        }
    }
    const double secs = (double)(bench_now_ns() - t0) / 1e9;
    for (int k = 0; k < 2; k++)
        cpu1[k] = ev_proc_cpu(side[k].d.pid);
    res->cpu_us_on = (double)(cpu1[0].all - cpu0[0].all) / 1e3 / rounds;
    res->cpu_us_off = (double)(cpu1[1].all - cpu0[1].all) / 1e3 / rounds;
    const double evpub_us = (double)(cpu1[0].evpub - cpu0[0].evpub) / 1e3 / rounds;
    const double zmq_us = (double)(cpu1[0].zmq - cpu0[0].zmq) / 1e3 / rounds;
    /* every batch the daemon sent since the subscription counted must reach the SUB */
    uint64_t sent = 0;
    deadline = bench_now_ns() + 10000000000ull;
    while (!ev_side_metric(&side[0], mtext, mcap, "kvpool_events_batches_total", &sent) &&
           ev_load(&rd.msgs) - got0 < sent - b0 && bench_now_ns() < deadline)
        ev_sleep_us(2000);
    res->daemon_received = ev_load(&rd.msgs) - got0;
    if (res->daemon_received == 0) {
        fprintf(stderr, "bench_prefix: the SUB received no batch from the events daemon\n");
        goto out;
    }
    uint64_t m[8] = {0};
    static const char *const mnames[8] = {"kvpool_events_batches_total",
                                          "kvpool_events_total",
                                          "kvpool_events_blocks_total",
                                          "kvpool_events_bytes_total",
                                          "kvpool_events_dropped_total{reason=\"hwm\"}",
                                          "kvpool_events_dropped_total{reason=\"queue\"}",
                                          "kvpool_events_dropped_total{reason=\"memory\"}",
                                          "kvpool_events_next_sequence"};
    int have_m = kvp_client_metrics(side[0].c, mtext, mcap, NULL) == 0;
    for (int i = 0; have_m && i < 8; i++)
        if (ev_metric(mtext, mnames[i], &m[i]))
            have_m = 0;

    res->reserve_p50_on = bench_quantile(side[0].res_ns, rounds, 0.5) / 1e3;
    res->reserve_p99_on = bench_quantile(side[0].res_ns, rounds, 0.99) / 1e3;
    res->reserve_p50_off = bench_quantile(side[1].res_ns, rounds, 0.5) / 1e3;
    res->reserve_p99_off = bench_quantile(side[1].res_ns, rounds, 0.99) / 1e3;
    res->commit_p50_on = bench_quantile(side[0].com_ns, rounds, 0.5) / 1e3;
    res->commit_p99_on = bench_quantile(side[0].com_ns, rounds, 0.99) / 1e3;
    res->commit_p50_off = bench_quantile(side[1].com_ns, rounds, 0.5) / 1e3;
    res->commit_p99_off = bench_quantile(side[1].com_ns, rounds, 0.99) / 1e3;
    res->daemon_ok = 1;
    rc = 0;
    printf("   kvpool over the socket: two kvpoold (host backend, 4,096 pages of 16, 2 layers, H "
           "2, D 16), events on (ipc://, a SUB reader thread) and off, %u rounds (+%u warm-up) "
           "in %.0f ms, in the order on off, off on, ...; each round on each: a new sequence "
           "of %u new token ids reserved with reuse (%u pages keyed; the pool holds 128 "
           "rounds' pages, each later Reserve evicts %u cached ones: removals), its Commit (%u "
           "blocks stored), its Release\n",
           rounds, warm, secs * 1e3, EV_TOKENS, EV_PAGES, EV_PAGES, EV_PAGES);
    printf("   %-24s %10s %10s %8s %10s %10s\n", "", "on p50 us", "off p50 us", "on/off",
           "on p99 us", "off p99 us");
    printf("   %-24s %10.1f %10.1f %8.3f %10.1f %10.1f\n", "Reserve (512 token ids)",
           res->reserve_p50_on, res->reserve_p50_off, res->reserve_p50_on / res->reserve_p50_off,
           res->reserve_p99_on, res->reserve_p99_off);
    printf("   %-24s %10.1f %10.1f %8.3f %10.1f %10.1f\n", "Commit (32 blocks)", res->commit_p50_on,
           res->commit_p50_off, res->commit_p50_on / res->commit_p50_off, res->commit_p99_on,
           res->commit_p99_off);
    printf("   each daemon's CPU time per measured round (all its threads, /proc schedstat): on "
           "%.1f us (its publisher thread %.1f, ZMQ's threads %.1f, the rest %.1f), off %.1f us "
           "(on - off: %+.1f us)\n",
           res->cpu_us_on, evpub_us, zmq_us, res->cpu_us_on - evpub_us - zmq_us, res->cpu_us_off,
           res->cpu_us_on - res->cpu_us_off);
    if (have_m)
        printf("   the events daemon's counters: %llu batches, %llu events, %llu blocks, %llu "
               "bytes; dropped: hwm %llu, queue %llu, memory %llu; next sequence %llu; the SUB "
               "received %llu batches (%llu bad) after it subscribed\n",
               (unsigned long long)m[0], (unsigned long long)m[1], (unsigned long long)m[2],
               (unsigned long long)m[3], (unsigned long long)m[4], (unsigned long long)m[5],
               (unsigned long long)m[6], (unsigned long long)m[7],
               (unsigned long long)res->daemon_received, (unsigned long long)ev_load(&rd.bad));
out:
    if (reading)
        ev_reader_stop(&rd);
    for (int i = 0; i < 2; i++) {
        kvp_client_close(side[i].c);
        if (side[i].up && kvp_daemon_stop(&side[i].d, SIGTERM) != 0) {
            res->daemon_ok = 0;
            rc = -1;
        }
        free(side[i].res_ns);
        free(side[i].com_ns);
    }
    unlink(path);
    rmdir(dir);
    free(mtext);
    free(tok);
    return rc;
}

/* ---- the part ------------------------------------------------------------------------------ */

int bench_events(const bench_events_opts_t *o, bench_events_result_t *r)
{
    memset(r, 0, sizeof(*r));
    const uint32_t enc = o->quick ? 200 : 20000, pub = o->quick ? 200 : 20000;
    const uint32_t obs = o->quick ? 200 : 20000, rounds = o->quick ? 20 : 5000;
    int rc = 0;
    printf("\n7. KV events (issue #29): chains of %u blocks of %u tokens, one scope; "
           "encoder and batcher on this thread, publisher on its own\n",
           EV_CHAIN, EV_PS);
    ev_chains_t *ch = ev_alloc(sizeof(*ch));
    ev_chains_init(ch);
    kvp_ev_batch_t *stored[EV_DISTINCT] = {0}, *removed[EV_DISTINCT] = {0};
    if (ev_make_batches(ch, 0, stored) || ev_make_batches(ch, 1, removed)) {
        fprintf(stderr, "bench_prefix: the batcher made no batch\n");
        rc = -1;
        goto out;
    }

    uint32_t ev_s = 0, ev_r = 0;
    size_t by_s = 0, by_r = 0;
    r->enc_stored_bps = ev_encode_rate(stored, enc, &ev_s, &by_s);
    r->enc_removed_bps = ev_encode_rate(removed, enc, &ev_r, &by_r);
    r->enc_ok = r->enc_stored_bps > 0 && r->enc_removed_bps > 0;
    if (!r->enc_ok) {
        rc = -1;
    } else {
        printf("   encoder (kvp_ev_encode, one core), median of %u batches, rotating among %u:\n",
               enc, EV_DISTINCT);
        printf("     %u STORED chained (%u event, %zu bytes): %.2f M block events/s (%.1f "
               "ns/block)\n",
               EV_CHAIN, ev_s, by_s, r->enc_stored_bps / 1e6, 1e9 / r->enc_stored_bps);
        printf("     %u REMOVED (%u event, %zu bytes): %.2f M block events/s (%.1f ns/block)\n",
               EV_CHAIN, ev_r, by_r, r->enc_removed_bps / 1e6, 1e9 / r->enc_removed_bps);
    }
    if (ev_bench_publish(stored, pub, r))
        rc = -1;
    if (ev_bench_observe(ch, obs, r))
        rc = -1;
    if (o->daemon && ev_bench_daemons(rounds, r))
        rc = -1;
    printf("   targets (issue #29): publisher >= 1 M block events/s: %s; Reserve p50 on/off "
           "<= 1.01: %s\n",
           !r->pub_ok          ? "-"
           : r->pub_bps >= 1e6 ? "met"
                               : "MISSED",
           !r->daemon_ok                                    ? "-"
           : r->reserve_p50_on <= 1.01 * r->reserve_p50_off ? "met"
                                                            : "MISSED");
out:
    for (uint32_t i = 0; i < EV_DISTINCT; i++) {
        kvp_ev_batch_free(stored[i]);
        kvp_ev_batch_free(removed[i]);
    }
    free(ch);
    return rc;
}

void bench_events_keys(const bench_events_result_t *r)
{
    if (r->enc_ok) {
        printf("events_encode_blocks_per_s=%.0f\n", r->enc_stored_bps);
        printf("events_encode_removed_blocks_per_s=%.0f\n", r->enc_removed_bps);
    }
    if (r->pub_ok) {
        printf("events_publish_blocks_per_s=%.0f\n", r->pub_bps);
        if (r->pub_delivered_bps > 0)
            printf("events_publish_delivered_blocks_per_s=%.0f\n", r->pub_delivered_bps);
        printf("events_publish_dropped=%llu\n", (unsigned long long)r->pub_dropped);
    }
    if (r->obs_ok)
        printf("events_observe_ns_per_block=%.1f\n", r->obs_ns);
    if (r->pub_ok)
        printf("events_submit_idle_ns=%.0f\n", r->pub_idle_submit_ns);
    if (r->daemon_ok) {
        printf("events_reserve_p50_us_on=%.1f\n", r->reserve_p50_on);
        printf("events_reserve_p50_us_off=%.1f\n", r->reserve_p50_off);
        printf("events_reserve_p50_ratio=%.3f\n", r->reserve_p50_on / r->reserve_p50_off);
        printf("events_reserve_p99_us_on=%.1f\n", r->reserve_p99_on);
        printf("events_reserve_p99_us_off=%.1f\n", r->reserve_p99_off);
        printf("events_commit_p50_us_on=%.1f\n", r->commit_p50_on);
        printf("events_commit_p50_us_off=%.1f\n", r->commit_p50_off);
        printf("events_commit_p50_ratio=%.3f\n", r->commit_p50_on / r->commit_p50_off);
        printf("events_commit_p99_us_on=%.1f\n", r->commit_p99_on);
        printf("events_commit_p99_us_off=%.1f\n", r->commit_p99_off);
        printf("events_daemon_cpu_us_per_round_on=%.1f\n", r->cpu_us_on);
        printf("events_daemon_cpu_us_per_round_off=%.1f\n", r->cpu_us_off);
    }
}
