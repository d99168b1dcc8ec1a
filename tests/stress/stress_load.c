/* SPDX-License-Identifier: Apache-2.0 */
/*
 * stress_load.c - load and soak: a real kvpoold (host backend) and CLIENTS worker processes
 * (default 64) using libkvpool over its socket, each doing random Reserve / Append / Fork /
 * Truncate / Release / GetPageTable calls for SECONDS, with random clean disconnects and
 * reconnects, and random abrupt ones: a second connection of the namespace sends a Reserve and
 * hangs up without reading the answer, after which the worker finds out (GetPageTable) whether
 * it was applied. Each worker keeps a model of its sequences and checks every answer against
 * it (lengths, page counts, all-or-nothing on RESOURCE_EXHAUSTED, the bytes an Append put in
 * the pool through its own mapping); the pool is small, so exhaustion is frequent.
 *
 * The run is two rounds of SECONDS/2. After each round the workers report their models and
 * exit (leases keep their sequences); the harness checks the daemon against the sum of the
 * models: total and per-namespace sequences, tokens and page references exactly, every
 * sequence's length, then releases everything and checks the audit, every page free, a whole
 * pool reservable again (recovery), and the daemon's open fds equal to before the load. Its
 * RSS after round 2 may not exceed its RSS after round 1 by more than 4 MiB (memory does not
 * grow with the requests served).
 *
 *   KVP_STRESS_SECONDS (20), KVP_STRESS_CLIENTS (64), KVP_STRESS_PAGES (1024),
 *   KVP_TEST_SEED (random seed, printed), KVP_STRESS_QUIET=1 (no per-round lines)
 *
 * Exit 0 when everything matched; the figures go to stdout.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_sock.h"
#include "stress_common.h"

#if defined(__SANITIZE_ADDRESS__)
#define SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SANITIZED 1
#endif
#endif
#ifndef SANITIZED
#define SANITIZED 0
#endif

#define NS_COUNT 16
#define SLOTS    6
#define BUF_TOKS 16

typedef struct {
    int live;
    uint64_t id;
    uint32_t len;
} mseq_t;

/* A worker's report to the harness. */
typedef struct {
    uint32_t n;
    uint64_t ids[SLOTS];
    uint32_t lens[SLOTS];
    uint64_t calls, exhausted, reconnects, abrupt, abrupt_applied, appended_tokens;
} report_t;

typedef struct {
    uint64_t s;
} rng_t;

static uint64_t rnd(rng_t *r)
{
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return r->s;
}

static uint32_t below(rng_t *r, uint32_t n)
{
    return (uint32_t)(rnd(r) % n);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint32_t pages_of(uint32_t len)
{
    return (len + S_PS - 1) / S_PS;
}

/* ---- worker --------------------------------------------------------------------------------- */

typedef struct {
    const kvp_daemon_t *d;
    int k;
    char ns[16];
    kvp_client_t *c;
    void *stage;
    uint32_t buf;
    mseq_t m[SLOTS];
    uint64_t next_id;
    rng_t r;
    report_t rep;
} worker_t;

static void w_connect(worker_t *w)
{
    w->c = s_connect(w->d, w->ns, 60000, 1);
    size_t bytes = (size_t)S_LAYERS * 2 * BUF_TOKS * S_HEADS * S_ROW;
    S_CHECK(kvp_client_alloc_host_buffer(w->c, bytes, &w->stage, &w->buf) == 0, "buffer: %s",
            kvp_client_last_error(w->c));
}

/* Reads the lengths of every live sequence and compares with the model. */
static void w_verify(worker_t *w)
{
    uint64_t ids[SLOTS];
    int slot[SLOTS];
    uint32_t n = 0;
    for (int i = 0; i < SLOTS; i++)
        if (w->m[i].live)
            slot[n] = i, ids[n++] = w->m[i].id;
    if (!n)
        return;
    s_table_t tb;
    int rc = kvp_client_page_table(w->c, ids, n, s_table(&tb));
    w->rep.calls++;
    S_CHECK(rc == 0, "worker %d page table: %s", w->k, kvp_client_last_error(w->c));
    for (uint32_t b = 0; b < n; b++) {
        S_CHECK(tb.t.seq_lens[b] == (int32_t)w->m[slot[b]].len,
                "worker %d seq %llx: daemon %d, model %u", w->k, (unsigned long long)ids[b],
                tb.t.seq_lens[b], w->m[slot[b]].len);
        S_CHECK(tb.t.kv_indptr[b + 1] - tb.t.kv_indptr[b] == (int32_t)pages_of(w->m[slot[b]].len),
                "worker %d: page count", w->k);
    }
}

/* Picks 1..2 distinct slots for a batch (creating ids for empty ones). */
static uint32_t w_pick(worker_t *w, int *slots, uint64_t *ids, uint32_t *toks, uint32_t max_add)
{
    uint32_t n = 1 + below(&w->r, 2);
    int a = (int)below(&w->r, SLOTS), b = (a + 1 + (int)below(&w->r, SLOTS - 1)) % SLOTS;
    slots[0] = a, slots[1] = b;
    for (uint32_t i = 0; i < n; i++) {
        mseq_t *s = &w->m[slots[i]];
        if (!s->live)
            s->id = ((uint64_t)(w->k + 1) << 32) | w->next_id++, s->len = 0;
        ids[i] = s->id;
        uint32_t room = S_MAXSEQ - s->len;
        toks[i] = room ? 1 + below(&w->r, room < max_add ? room : max_add) : 0;
        if (!toks[i])
            return 0;
    }
    return n;
}

static void w_grow(worker_t *w, int append)
{
    int slots[2];
    uint64_t ids[2];
    uint32_t toks[2];
    uint32_t n = w_pick(w, slots, ids, toks, append ? BUF_TOKS / 2 : 24);
    if (!n)
        return;
    s_table_t tb;
    int rc;
    kvp_source_t src;
    uint32_t nnz = 0;
    for (uint32_t i = 0; i < n; i++)
        nnz += toks[i];
    if (append) {
        size_t bytes = (size_t)S_LAYERS * 2 * nnz * S_HEADS * S_ROW;
        for (size_t i = 0; i < bytes; i++)
            ((uint8_t *)w->stage)[i] = (uint8_t)rnd(&w->r);
        src = (kvp_source_t){.buffer_id = w->buf,
                             .v_offset = (uint64_t)nnz * S_HEADS * S_ROW,
                             .k_stride_n = S_HEADS * S_ROW,
                             .k_stride_h = S_ROW,
                             .v_stride_n = S_HEADS * S_ROW,
                             .v_stride_h = S_ROW,
                             .layer_stride = 2ull * nnz * S_HEADS * S_ROW};
        rc = kvp_client_append(w->c, ids, toks, n, &src, s_table(&tb));
    } else {
        rc = kvp_client_reserve(w->c, ids, toks, n, s_table(&tb));
    }
    w->rep.calls++;
    if (rc == KVP_ENOSPC) {
        /* pool exhausted: all or nothing, so the model stays and so must the daemon */
        S_CHECK(strstr(kvp_client_last_error(w->c), "pool exhausted"), "worker %d: %s", w->k,
                kvp_client_last_error(w->c));
        w->rep.exhausted++;
        w_verify(w);
        return;
    }
    S_CHECK(rc == 0, "worker %d %s: %s", w->k, append ? "append" : "reserve",
            kvp_client_last_error(w->c));
    S_CHECK(tb.t.batch_size == n && tb.t.nnz == nnz, "worker %d: batch shape", w->k);
    for (uint32_t i = 0; i < n; i++) {
        mseq_t *s = &w->m[slots[i]];
        s->live = 1;
        s->len += toks[i];
        S_CHECK(tb.t.seq_lens[i] == (int32_t)s->len, "worker %d: seq_lens %d model %u", w->k,
                tb.t.seq_lens[i], s->len);
    }
    if (!append)
        return;
    w->rep.appended_tokens += nnz;
    /* the data is in the pool, where the page table says */
    const kvp_pool_info_t *pi = kvp_client_pool_info(w->c);
    const uint8_t *pool = kvp_client_pool_base(w->c, 0);
    for (uint32_t b = 0; b < n; b++)
        for (int32_t i = tb.t.append_indptr[b]; i < tb.t.append_indptr[b + 1]; i++) {
            uint32_t pos = (uint32_t)(tb.t.seq_lens[b] - (tb.t.append_indptr[b + 1] - i));
            uint32_t page = (uint32_t)tb.t.kv_indices[tb.t.kv_indptr[b] + pos / S_PS];
            for (uint32_t l = 0; l < S_LAYERS; l++)
                for (int kv = 0; kv < 2; kv++)
                    for (uint32_t h = 0; h < S_HEADS; h++) {
                        const uint8_t *want = (const uint8_t *)w->stage + l * src.layer_stride +
                                              (kv ? src.v_offset : 0) +
                                              (uint64_t)i * S_HEADS * S_ROW + h * S_ROW;
                        uint64_t off =
                            l * pi->layer_bytes + (kv ? pi->v_offset_bytes : 0) +
                            ((uint64_t)page * pi->stride_page +
                             (uint64_t)(pos % S_PS) * pi->stride_n + (uint64_t)h * pi->stride_h) *
                                pi->elem_bytes;
                        S_CHECK(memcmp(pool + off, want, S_ROW) == 0,
                                "worker %d: appended bytes differ", w->k);
                    }
        }
}

/* A second connection of the namespace sends a Reserve and hangs up without the answer. */
static void w_abrupt(worker_t *w)
{
    int i = (int)below(&w->r, SLOTS);
    mseq_t *s = &w->m[i];
    if (!s->live || s->len + 4 > S_MAXSEQ)
        return;
    int fd = s_raw_hello(w->d, w->ns);
    uint64_t id = s->id;
    uint32_t add = 1 + below(&w->r, 4);
    kvp_batch_arrays_t rb = {.seq_ids = kvp_array(&id, 8, 1, 1),
                             .num_tokens = kvp_array(&add, 4, 1, 1)};
    kvpool_Request q = {.id = rnd(&w->r) | 1, .which_body = kvpool_Request_reserve_tag};
    q.body.reserve.has_batch = true;
    kvp_wire_batch_bind_encode(&q.body.reserve.batch, &rb);
    S_CHECK(s_raw_send(fd, &q) == 0, "abrupt send");
    if (below(&w->r, 2))
        usleep(below(&w->r, 2000)); /* sometimes answered before the hang-up, sometimes not */
    close(fd);
    w->rep.abrupt++;
    /* applied or not: the daemon says which, and it must be one of the two */
    s_table_t tb;
    int rc;
    for (int tries = 0;; tries++) {
        rc = kvp_client_page_table(w->c, &id, 1, s_table(&tb));
        S_CHECK(rc == 0, "worker %d: %s", w->k, kvp_client_last_error(w->c));
        if (tb.t.seq_lens[0] == (int32_t)(s->len + add) || tries > 200)
            break;
        usleep(1000); /* the daemon may not have read the orphan's frame yet */
    }
    uint32_t got = (uint32_t)tb.t.seq_lens[0];
    S_CHECK(got == s->len || got == s->len + add, "worker %d: abrupt reserve left %u (was %u +%u)",
            w->k, got, s->len, add);
    if (got != s->len)
        w->rep.abrupt_applied++;
    s->len = got;
}

static void worker(const kvp_daemon_t *d, int k, double seconds, uint64_t seed, int out_fd)
{
    worker_t w;
    memset(&w, 0, sizeof(w));
    w.d = d;
    w.k = k;
    w.r.s = seed * 0x9e3779b97f4a7c15ull + (uint64_t)k * 7919 + 1;
    w.next_id = 1;
    snprintf(w.ns, sizeof(w.ns), "ns%d", k % NS_COUNT);
    w_connect(&w);
    double end = now_s() + seconds;
    while (now_s() < end) {
        uint32_t op = below(&w.r, 100);
        int i = (int)below(&w.r, SLOTS);
        if (op < 30) {
            w_grow(&w, 0);
        } else if (op < 45) {
            w_grow(&w, 1);
        } else if (op < 55) {
            int j = (int)below(&w.r, SLOTS);
            if (!w.m[i].live || w.m[j].live)
                continue;
            uint64_t cid = ((uint64_t)(k + 1) << 32) | w.next_id++;
            int rc = kvp_client_fork(w.c, w.m[i].id, cid);
            w.rep.calls++;
            S_CHECK(rc == 0, "worker %d fork: %s", k, kvp_client_last_error(w.c));
            w.m[j] = (mseq_t){1, cid, w.m[i].len};
        } else if (op < 70) {
            if (!w.m[i].live)
                continue;
            uint32_t nl = below(&w.r, w.m[i].len + 1);
            S_CHECK(kvp_client_truncate(w.c, w.m[i].id, w.m[i].len + 1) == KVP_EINVAL,
                    "worker %d: truncate past the end accepted", k);
            S_CHECK(kvp_client_truncate(w.c, w.m[i].id, nl) == 0, "worker %d truncate: %s", k,
                    kvp_client_last_error(w.c));
            w.rep.calls += 2;
            w.m[i].len = nl;
        } else if (op < 82) {
            if (!w.m[i].live)
                continue;
            uint32_t rel = 9;
            S_CHECK(kvp_client_release(w.c, &w.m[i].id, 1, &rel) == 0 && rel == 1,
                    "worker %d release", k);
            w.rep.calls++;
            w.m[i].live = 0;
        } else if (op < 94) {
            w_verify(&w);
        } else if (op < 97) {
            kvp_client_close(w.c); /* clean disconnect; the lease keeps the sequences */
            w.rep.reconnects++;
            w_connect(&w);
            w_verify(&w);
        } else {
            w_abrupt(&w);
        }
    }
    w_verify(&w);
    for (int i = 0; i < SLOTS; i++)
        if (w.m[i].live) {
            w.rep.ids[w.rep.n] = w.m[i].id;
            w.rep.lens[w.rep.n++] = w.m[i].len;
        }
    /* abrupt hang-ups leave a 0-token sequence only if the model said so: never */
    kvp_client_close(w.c);
    S_CHECK(write(out_fd, &w.rep, sizeof(w.rep)) == (ssize_t)sizeof(w.rep), "report");
}

/* ---- harness ------------------------------------------------------------------------------- */

typedef struct {
    uint64_t calls, exhausted, reconnects, abrupt, abrupt_applied, appended_tokens;
} totals_t;

static void round_run(const kvp_daemon_t *d, kvp_client_t *obs, int clients, double seconds,
                      uint64_t seed, uint32_t pages, totals_t *tot)
{
    pid_t *pid = calloc((size_t)clients, sizeof(pid_t));
    int *rfd = calloc((size_t)clients, sizeof(int));
    report_t *rep = calloc((size_t)clients, sizeof(report_t));
    S_CHECK(pid && rfd && rep, "memory");
    for (int k = 0; k < clients; k++) {
        int p[2];
        S_CHECK(pipe(p) == 0, "pipe");
        pid[k] = fork();
        S_CHECK(pid[k] >= 0, "fork");
        if (pid[k] == 0) {
            close(p[0]);
            worker(d, k, seconds, seed, p[1]);
            _exit(0);
        }
        close(p[1]);
        rfd[k] = p[0];
    }
    for (int k = 0; k < clients; k++) {
        int st;
        S_CHECK(waitpid(pid[k], &st, 0) == pid[k], "waitpid");
        S_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker %d failed (status %d)", k, st);
        S_CHECK(read(rfd[k], &rep[k], sizeof(rep[k])) == (ssize_t)sizeof(rep[k]), "report %d", k);
        close(rfd[k]);
        tot->calls += rep[k].calls;
        tot->exhausted += rep[k].exhausted;
        tot->reconnects += rep[k].reconnects;
        tot->abrupt += rep[k].abrupt;
        tot->abrupt_applied += rep[k].abrupt_applied;
        tot->appended_tokens += rep[k].appended_tokens;
    }
    /* the daemon against the sum of the models: total and per namespace */
    uint32_t want_seqs = 0;
    uint64_t want_tokens = 0, want_refs = 0;
    uint32_t ns_seqs[NS_COUNT] = {0};
    uint64_t ns_tokens[NS_COUNT] = {0}, ns_refs[NS_COUNT] = {0};
    for (int k = 0; k < clients; k++)
        for (uint32_t i = 0; i < rep[k].n; i++) {
            want_seqs++, ns_seqs[k % NS_COUNT]++;
            want_tokens += rep[k].lens[i], ns_tokens[k % NS_COUNT] += rep[k].lens[i];
            want_refs += pages_of(rep[k].lens[i]),
                ns_refs[k % NS_COUNT] += pages_of(rep[k].lens[i]);
        }
    kvp_stats_summary_t st;
    S_CHECK(kvp_client_stats(obs, &st) == 0, "stats");
    S_CHECK(st.num_seqs == want_seqs, "num_seqs %u, models %u", st.num_seqs, want_seqs);
    S_CHECK(st.num_tokens == want_tokens, "num_tokens %llu, models %llu",
            (unsigned long long)st.num_tokens, (unsigned long long)want_tokens);
    S_CHECK(st.page_refs == want_refs, "page_refs %llu, models %llu",
            (unsigned long long)st.page_refs, (unsigned long long)want_refs);
    S_CHECK(st.used_pages <= want_refs && st.used_pages + st.free_pages == pages, "pages");
    for (int n = 0; n < NS_COUNT && n < clients; n++) {
        char ns[16];
        snprintf(ns, sizeof(ns), "ns%d", n);
        uint32_t sq;
        uint64_t tk, rf;
        S_CHECK(s_ns_stats(obs, ns, &sq, &tk, &rf) == 0, "namespace %s missing", ns);
        S_CHECK(sq == ns_seqs[n] && tk == ns_tokens[n] && rf == ns_refs[n],
                "namespace %s: %u seqs %llu tokens %llu refs, models %u %llu %llu", ns, sq,
                (unsigned long long)tk, (unsigned long long)rf, ns_seqs[n],
                (unsigned long long)ns_tokens[n], (unsigned long long)ns_refs[n]);
    }
    S_CHECK(kvp_client_audit(obs) == 0, "audit: %s", kvp_client_last_error(obs));
    /* every sequence's length, then release it all (as root, attached to each namespace) */
    for (int n = 0; n < NS_COUNT && n < clients; n++) {
        char ns[16];
        snprintf(ns, sizeof(ns), "ns%d", n);
        kvp_client_t *c = s_connect(d, ns, KVP_LEASE_DEFAULT, 0);
        for (int k = n; k < clients; k += NS_COUNT)
            for (uint32_t i = 0; i < rep[k].n; i++) {
                s_table_t tb;
                S_CHECK(kvp_client_page_table(c, &rep[k].ids[i], 1, s_table(&tb)) == 0,
                        "page table");
                S_CHECK(tb.t.seq_lens[0] == (int32_t)rep[k].lens[i], "length of a sequence");
                uint32_t rel = 0;
                S_CHECK(kvp_client_release(c, &rep[k].ids[i], 1, &rel) == 0 && rel == 1, "release");
            }
        kvp_client_close(c);
    }
    S_CHECK(kvp_client_stats(obs, &st) == 0, "stats");
    S_CHECK(st.num_seqs == 0 && st.used_pages == 0 && st.free_pages == pages && st.page_refs == 0,
            "not everything went back: seqs %u used %u free %u", st.num_seqs, st.used_pages,
            st.free_pages);
    /* recovery: the whole pool can be reserved again, then given back */
    uint64_t big = 0xb16;
    uint32_t all = pages * S_PS < S_MAXSEQ ? pages * S_PS : S_MAXSEQ;
    S_CHECK(kvp_client_reserve(obs, &big, &all, 1, NULL) == 0, "recovery reserve: %s",
            kvp_client_last_error(obs));
    uint32_t rel = 0;
    S_CHECK(kvp_client_release(obs, &big, 1, &rel) == 0 && rel == 1, "recovery release");
    S_CHECK(kvp_client_audit(obs) == 0, "audit: %s", kvp_client_last_error(obs));
    free(pid);
    free(rfd);
    free(rep);
}

int main(void)
{
    unsigned seconds = s_env("KVP_STRESS_SECONDS", 20);
    int clients = (int)s_env("KVP_STRESS_CLIENTS", 64);
    unsigned pages = s_env("KVP_STRESS_PAGES", 1024);
    uint64_t seed = s_env("KVP_TEST_SEED", (unsigned)time(NULL));
    int quiet = s_env("KVP_STRESS_QUIET", 0);
    printf("stress_load: %d clients, %u s, %u pages of %d tokens, seed %llu (KVP_TEST_SEED)\n",
           clients, seconds, pages, S_PS, (unsigned long long)seed);
    fflush(stdout);
    signal(SIGPIPE, SIG_IGN);
    kvp_daemon_t d;
    s_start(&d, pages, NULL, NULL);
    kvp_client_t *obs = s_connect(&d, "observer", 0, 0);
    S_CHECK(s_wait_clients(obs, 1) == 1, "the harness's probe connection is still open");
    int fd0 = kvp_daemon_fd_count(&d);
    long rss0 = kvp_daemon_rss_kib(&d);
    totals_t tot = {0};
    long rss[2];
    int fds[2];
    double t0 = now_s();
    for (int round = 0; round < 2; round++) {
        round_run(&d, obs, clients, seconds / 2.0, seed + (uint64_t)round, pages, &tot);
        S_CHECK(s_wait_clients(obs, 1) == 1, "connections left open");
        fds[round] = s_wait_fds(&d, fd0);
        rss[round] = kvp_daemon_rss_kib(&d);
        if (!quiet)
            printf("round %d: daemon fds %d (before the load %d), RSS %ld KiB (before %ld KiB)\n",
                   round + 1, fds[round], fd0, rss[round], rss0);
        S_CHECK(fds[round] == fd0, "daemon fds %d after round %d, %d before", fds[round], round + 1,
                fd0);
    }
    double took = now_s() - t0;
    /* under valgrind the RSS is mostly valgrind's own (shadow memory), and an ASan daemon (this
     * program is built like it) keeps freed blocks in its quarantine: looser bounds there */
    long rss_bound = kvp_daemon_wrapped() ? 16384 : SANITIZED ? 65536 : 4096;
    S_CHECK(rss[1] - rss[0] <= rss_bound, "daemon RSS grew from %ld to %ld KiB in round 2", rss[0],
            rss[1]);
    S_CHECK(tot.exhausted > 0, "the pool was never exhausted: the test did not test that");
    S_CHECK(tot.reconnects > 0 && tot.abrupt > 0, "no disconnects happened");
    kvp_client_close(obs);
    int code = kvp_daemon_stop(&d, SIGTERM);
    S_CHECK(code == 0, "kvpoold exited with %d", code);
    printf("stress_load: ok: %llu calls in %.1f s (%.0f/s), %llu RESOURCE_EXHAUSTED (pool), "
           "%llu reconnects, %llu abrupt hang-ups with a Reserve in flight (%llu applied), "
           "%llu tokens appended and checked; audit clean, stats exact, 0 pages, 0 fds and "
           "%ld KiB RSS more after round 2 than after round 1; exit 0\n",
           (unsigned long long)tot.calls, took, tot.calls / took, (unsigned long long)tot.exhausted,
           (unsigned long long)tot.reconnects, (unsigned long long)tot.abrupt,
           (unsigned long long)tot.abrupt_applied, (unsigned long long)tot.appended_tokens,
           rss[1] - rss[0]);
    return 0;
}
