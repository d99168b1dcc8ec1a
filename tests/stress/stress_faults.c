/* SPDX-License-Identifier: Apache-2.0 */
/*
 * stress_faults.c - faults on a real kvpoold (host backend), one scenario per daemon:
 *
 *   kill       worker processes doing Appends and Reserves in their own namespaces (lease 0)
 *              are SIGKILLed at random moments, mid-request, and replaced, for SECONDS; a
 *              bystander namespace holds sequences with known bytes throughout. After: every
 *              killed worker's pages are back, the bystander's lengths and bytes are intact,
 *              audit clean, the daemon's fds back to the baseline.
 *   noread     a client pipelines Metrics requests and never reads an answer: the daemon drops
 *              it once max_queued_bytes (256 KiB) is passed, its RSS stays bounded, and a
 *              bystander is served all along.
 *   slow       a client dribbles one Reserve frame a byte every millisecond; a bystander's
 *              pings are all answered meanwhile; the dribbled request is then answered right.
 *   fds        the daemon runs with RLIMIT_NOFILE 64; clients connect until one is refused
 *              (UNAVAILABLE, "out of file descriptors": the reserve-fd trick, no busy loop:
 *              the daemon's CPU time over a second at the limit is checked); the others are
 *              served; once some leave, connecting works again; fds back to the baseline.
 *
 *   sigterm    64 worker processes, each in its own namespace (lease 60 s), Append and
 *              Reserve to 4 sequences as fast as they can, releasing a sequence when it is
 *              full; each keeps the net token count of the calls it saw acknowledged in a
 *              shared page. After 2 s the daemon gets SIGTERM: it must exit 0, and the token
 *              count it logs at exit ("final ... tokens=") must equal the sum of the workers'
 *              acknowledged counts: every acknowledged request applied, nothing else.
 *
 *   stress_faults [SCENARIO...]   (default: all)   KVP_STRESS_SECONDS (kill: default 10)
 *
 * Pool exhaustion under load is in stress_load (RESOURCE_EXHAUSTED all-or-nothing, recovery).
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_sock.h"
#include "stress_common.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* user + system CPU seconds of a process */
static double cpu_s(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    S_CHECK(f, "open %s", path);
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    unsigned long ut = 0, st = 0;
    S_CHECK(p &&
                sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) == 2,
            "parse stat");
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static kvp_source_t source(uint32_t buf, uint32_t nnz)
{
    return (kvp_source_t){.buffer_id = buf,
                          .v_offset = (uint64_t)nnz * S_HEADS * S_ROW,
                          .k_stride_n = S_HEADS * S_ROW,
                          .k_stride_h = S_ROW,
                          .v_stride_n = S_HEADS * S_ROW,
                          .v_stride_h = S_ROW,
                          .layer_stride = 2ull * nnz * S_HEADS * S_ROW};
}

/* The pool bytes of token pos of a sequence (page table t, batch entry 0), K of layer 0. */
static const uint8_t *token_k(kvp_client_t *c, const kvp_page_table_t *t, uint32_t pos, uint32_t h)
{
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    uint32_t page = (uint32_t)t->kv_indices[pos / S_PS];
    return (const uint8_t *)kvp_client_pool_base(c, 0) +
           ((uint64_t)page * pi->stride_page + (uint64_t)(pos % S_PS) * pi->stride_n +
            (uint64_t)h * pi->stride_h) *
               pi->elem_bytes;
}

/* ---- kill ------------------------------------------------------------------------------- */

static void doomed(const kvp_daemon_t *d, int k)
{
    char ns[32];
    snprintf(ns, sizeof(ns), "doomed%d", k);
    kvp_client_t *c = s_connect(d, ns, 0, 1);
    void *stage;
    uint32_t buf;
    S_CHECK(kvp_client_alloc_host_buffer(c, 64 << 10, &stage, &buf) == 0, "buffer");
    memset(stage, k, 64 << 10);
    for (uint64_t i = 0;; i++) {
        uint64_t id = i % 8;
        uint32_t n = 1 + (uint32_t)(i % 16);
        kvp_source_t src = source(buf, n);
        int rc = i % 3 ? kvp_client_append(c, &id, &n, 1, &src, NULL)
                       : kvp_client_reserve(c, &id, &n, 1, NULL);
        if (rc == KVP_ENOSPC || (rc == 0 && i % 5 == 0)) {
            uint32_t rel;
            kvp_client_release(c, &id, 1, &rel);
        } else if (rc) {
            S_CHECK(0, "doomed %d: %s", k, kvp_client_last_error(c));
        }
    }
}

static void scenario_kill(unsigned seconds)
{
    enum { N = 16, PAGES = 512 };
    kvp_daemon_t d;
    s_start(&d, PAGES, NULL, NULL);
    kvp_client_t *by = s_connect(&d, "bystander", 0, 1);
    S_CHECK(s_wait_clients(by, 1) == 1, "probe connection");
    /* the bystander's sequence: 37 tokens of known bytes */
    void *stage;
    uint32_t buf;
    S_CHECK(kvp_client_alloc_host_buffer(by, 64 << 10, &stage, &buf) == 0, "buffer");
    for (int i = 0; i < 64 << 10; i++)
        ((uint8_t *)stage)[i] = (uint8_t)(i * 7 + 3);
    uint64_t bid = 42;
    uint32_t btok = 37;
    kvp_source_t bsrc = source(buf, btok);
    S_CHECK(kvp_client_append(by, &bid, &btok, 1, &bsrc, NULL) == 0, "bystander append");
    int fd0 = kvp_daemon_fd_count(&d);
    pid_t p[N];
    for (int k = 0; k < N; k++)
        if ((p[k] = fork()) == 0)
            doomed(&d, k), _exit(0);
    srand((unsigned)time(NULL));
    unsigned kills = 0;
    double end = now_s() + seconds;
    while (now_s() < end) {
        usleep(1000 + (useconds_t)(rand() % 20000));
        int k = rand() % N;
        kill(p[k], SIGKILL);
        int st;
        waitpid(p[k], &st, 0);
        S_CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "worker %d ended on its own (%d)", k,
                st);
        kills++;
        if ((p[k] = fork()) == 0)
            doomed(&d, k), _exit(0);
        S_CHECK(kvp_client_ping(by, NULL) == 0, "bystander ping");
    }
    for (int k = 0; k < N; k++) {
        kill(p[k], SIGKILL);
        waitpid(p[k], NULL, 0);
    }
    S_CHECK(s_wait_clients(by, 1) == 1, "connections of killed workers still open");
    kvp_stats_summary_t st;
    S_CHECK(kvp_client_stats(by, &st) == 0, "stats");
    S_CHECK(st.num_seqs == 1 && st.num_tokens == 37 && st.used_pages == 10 &&
                st.free_pages == PAGES - 10,
            "after the kills: %u seqs %llu tokens %u used pages", st.num_seqs,
            (unsigned long long)st.num_tokens, st.used_pages);
    s_table_t tb;
    S_CHECK(kvp_client_page_table(by, &bid, 1, s_table(&tb)) == 0 && tb.t.seq_lens[0] == 37,
            "bystander length");
    for (uint32_t t = 0; t < 37; t++)
        for (uint32_t h = 0; h < S_HEADS; h++)
            S_CHECK(memcmp(token_k(by, &tb.t, t, h),
                           (uint8_t *)stage + (uint64_t)t * S_HEADS * S_ROW + h * S_ROW,
                           S_ROW) == 0,
                    "bystander token %u changed", t);
    S_CHECK(kvp_client_audit(by) == 0, "audit: %s", kvp_client_last_error(by));
    int fd1 = s_wait_fds(&d, fd0);
    S_CHECK(fd1 == fd0, "daemon fds %d after, %d before", fd1, fd0);
    kvp_client_close(by);
    S_CHECK(kvp_daemon_stop(&d, SIGTERM) == 0, "daemon exit");
    printf("kill: %u SIGKILLs of %d workers mid-request in %u s; bystander's 37 tokens intact, "
           "every killed worker's page back (%u free of %u), audit clean, daemon fds %d = %d, "
           "exit 0\n",
           kills, N, seconds, st.free_pages + 10, PAGES, fd1, fd0);
}

/* ---- noread ------------------------------------------------------------------------------- */

static void pinger(const kvp_daemon_t *d, int report_fd, double seconds)
{
    kvp_client_t *c = s_connect(d, "pinger", 0, 0);
    uint32_t n = 0;
    double end = now_s() + seconds;
    while (now_s() < end) {
        S_CHECK(kvp_client_ping(c, NULL) == 0, "ping: %s", kvp_client_last_error(c));
        n++;
        usleep(1000);
    }
    kvp_client_close(c);
    S_CHECK(write(report_fd, &n, sizeof(n)) == (ssize_t)sizeof(n), "report");
}

static pid_t start_pinger(const kvp_daemon_t *d, double seconds, int *rfd)
{
    int pp[2];
    S_CHECK(pipe(pp) == 0, "pipe");
    pid_t pid = fork();
    if (pid == 0) {
        close(pp[0]);
        pinger(d, pp[1], seconds);
        _exit(0);
    }
    close(pp[1]);
    *rfd = pp[0];
    return pid;
}

static uint32_t end_pinger(pid_t pid, int rfd)
{
    uint32_t n = 0;
    int st;
    S_CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0,
            "the bystander failed");
    S_CHECK(read(rfd, &n, sizeof(n)) == (ssize_t)sizeof(n), "pinger report");
    close(rfd);
    return n;
}

static int log_has(const kvp_daemon_t *d, const char *what)
{
    FILE *f = fopen(d->log, "r");
    char line[1024];
    int found = 0;
    while (f && fgets(line, sizeof(line), f))
        found |= strstr(line, what) != NULL;
    if (f)
        fclose(f);
    return found;
}

static void scenario_noread(void)
{
    const char *extra[] = {"--set", "server.max_frame_bytes=64K", "--set",
                           "server.max_queued_bytes=256K", NULL};
    kvp_daemon_t d;
    s_start(&d, 256, extra, NULL);
    kvp_client_t *obs = s_connect(&d, "observer", 0, 0);
    S_CHECK(s_wait_clients(obs, 1) == 1, "probe connection");
    int fd0 = kvp_daemon_fd_count(&d);
    long rss0 = kvp_daemon_rss_kib(&d);
    int rfd;
    pid_t pg = start_pinger(&d, 3.0, &rfd);
    int fd = s_raw_hello(&d, "greedy");
    uint64_t sent = 0;
    int broke = 0;
    for (int i = 0; i < 1000000 && !broke; i++) {
        kvpool_Request q = {.id = 100 + (uint64_t)i, .which_body = kvpool_Request_metrics_tag};
        uint8_t b[64];
        long n = kvp_wire_encode_frame(kvpool_Request_fields, &q, b, sizeof(b));
        size_t off = 0;
        while (off < (size_t)n) {
            ssize_t w = send(fd, b + off, (size_t)n - off, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                usleep(1000);
                continue;
            }
            if (w < 0) {
                broke = 1; /* EPIPE / ECONNRESET: the daemon hung up */
                break;
            }
            off += (size_t)w;
        }
        sent++;
    }
    S_CHECK(broke, "the daemon never dropped the client that does not read");
    long rss1 = kvp_daemon_rss_kib(&d);
    uint32_t pings = end_pinger(pg, rfd);
    S_CHECK(pings > 20, "the bystander got only %u pings", pings);
    S_CHECK(log_has(&d, "reason=\"not reading its answers\""), "no drop in the log");
    close(fd);
    S_CHECK(s_wait_clients(obs, 1) == 1, "connections left");
    int fd1 = s_wait_fds(&d, fd0);
    S_CHECK(fd1 == fd0, "daemon fds %d, %d before", fd1, fd0);
    S_CHECK(rss1 - rss0 < 16384, "daemon RSS grew by %ld KiB", rss1 - rss0);
    S_CHECK(kvp_client_ping(obs, NULL) == 0, "observer");
    kvp_client_close(obs);
    S_CHECK(kvp_daemon_stop(&d, SIGTERM) == 0, "daemon exit");
    printf("noread: %llu Metrics requests sent unread, client dropped at max_queued_bytes 256 "
           "KiB; daemon RSS +%ld KiB while it queued; bystander answered %u pings meanwhile; "
           "fds %d = %d; exit 0\n",
           (unsigned long long)sent, rss1 - rss0, pings, fd1, fd0);
}

/* ---- slow --------------------------------------------------------------------------------- */

static void scenario_slow(void)
{
    kvp_daemon_t d;
    s_start(&d, 256, NULL, NULL);
    kvp_client_t *obs = s_connect(&d, "observer", 0, 0);
    int fd = s_raw_hello(&d, "slow");
    uint8_t *rbuf = NULL;
    size_t rcap = 0;
    uint32_t len;
    S_CHECK(kvp_sock_recv_frame(fd, &rbuf, &rcap, &len, 1 << 20, NULL, 0, NULL,
                                kvp_sock_deadline(5000)) == 0,
            "hello answer");
    /* a Reserve of 100 sequences x 1 token: about 1.3 KB, sent a byte a millisecond */
    uint64_t ids[100];
    uint32_t toks[100];
    for (int i = 0; i < 100; i++)
        ids[i] = 1000 + (uint64_t)i, toks[i] = 1;
    kvp_batch_arrays_t rb = {.seq_ids = kvp_array(ids, 8, 100, 100),
                             .num_tokens = kvp_array(toks, 4, 100, 100)};
    kvpool_Request q = {.id = 77, .which_body = kvpool_Request_reserve_tag};
    q.body.reserve.has_batch = true;
    kvp_wire_batch_bind_encode(&q.body.reserve.batch, &rb);
    uint8_t frame[4096];
    long n = kvp_wire_encode_frame(kvpool_Request_fields, &q, frame, sizeof(frame));
    S_CHECK(n > 1000, "frame");
    int rfd;
    pid_t pg = start_pinger(&d, (double)n / 1000.0 * 0.8, &rfd);
    double t0 = now_s();
    for (long i = 0; i < n; i++) {
        S_CHECK(send(fd, frame + i, 1, MSG_NOSIGNAL) == 1, "dribble");
        usleep(1000);
    }
    double took = now_s() - t0;
    uint32_t pings = end_pinger(pg, rfd); /* it ended before the frame was complete */
    S_CHECK(pings > 20, "the bystander got only %u pings while one client dribbled", pings);
    S_CHECK(kvp_sock_recv_frame(fd, &rbuf, &rcap, &len, 1 << 20, NULL, 0, NULL,
                                kvp_sock_deadline(5000)) == 0,
            "reserve answer");
    static kvpool_Response r;
    static int32_t a[6][256];
    kvp_reply_arrays_t ra;
    memset(&ra, 0, sizeof(ra));
    kvp_array_t *all[] = {&ra.kv_indptr,     &ra.kv_indices, &ra.kv_last_page_len,
                          &ra.append_indptr, &ra.seq_lens,   &ra.copies};
    for (int i = 0; i < 6; i++)
        *all[i] = kvp_array(a[i], 4, 0, 256);
    memset(&r, 0, sizeof(r));
    kvp_wire_response_bind_decode(&r, &ra);
    S_CHECK(kvp_wire_decode(kvpool_Response_fields, &r, rbuf, len, NULL) == 0, "decode");
    S_CHECK(r.id == 77 && r.status.code == kvpool_Code_OK && ra.seq_lens.count == 100,
            "dribbled reserve: id %llu code %d", (unsigned long long)r.id, (int)r.status.code);
    kvp_stats_summary_t st;
    S_CHECK(kvp_client_stats(obs, &st) == 0 && st.num_seqs == 100 && st.num_tokens == 100,
            "stats after the dribbled reserve");
    free(rbuf);
    close(fd);
    S_CHECK(kvp_client_audit(obs) == 0, "audit");
    kvp_client_close(obs);
    S_CHECK(kvp_daemon_stop(&d, SIGTERM) == 0, "daemon exit");
    printf("slow: a %ld-byte Reserve dribbled a byte a millisecond (%.1f s); a bystander got %u "
           "pings answered meanwhile; the dribbled Reserve then answered OK with 100 sequences; "
           "exit 0\n",
           n, took, pings);
}

/* ---- fds ---------------------------------------------------------------------------------- */

static void scenario_fds(void)
{
    enum { NOFILE = 64, MAXC = 128 };
    kvp_daemon_opts_t o = {.nofile = NOFILE};
    kvp_daemon_t d;
    s_start(&d, 256, NULL, &o);
    kvp_client_t *by = s_connect(&d, "bystander", 0, 0);
    S_CHECK(s_wait_clients(by, 1) == 1, "probe connection");
    int fd0 = kvp_daemon_fd_count(&d);
    kvp_client_t *c[MAXC];
    int n = 0, refused = 0;
    char err[256] = "";
    for (; n < MAXC; n++) {
        kvp_client_opts_t co = {
            .socket_path = d.sock, .ns = "many", .lease_ms = 0, .timeout_ms = 5000};
        int rc = kvp_client_connect(&co, &c[n], err, sizeof(err));
        if (rc) {
            S_CHECK(rc == KVP_EUNAVAIL && strstr(err, "out of file descriptors"),
                    "refusal at the fd limit: %s (%s)", err, kvp_errname(rc));
            refused = 1;
            break;
        }
    }
    S_CHECK(refused && n > 20 && n < NOFILE, "%d connections before the limit", n);
    /* at the limit: no busy loop, even with connections knocking */
    double cpu0 = cpu_s(d.pid);
    for (int i = 0; i < 20; i++) {
        kvp_client_t *x = NULL;
        kvp_client_opts_t co = {.socket_path = d.sock, .ns = "many", .timeout_ms = 5000};
        S_CHECK(kvp_client_connect(&co, &x, err, sizeof(err)) == KVP_EUNAVAIL, "still refused");
        usleep(50000);
    }
    double cpu = cpu_s(d.pid) - cpu0;
    S_CHECK(cpu < 0.3, "daemon used %.2f s of CPU in 1 s at the fd limit", cpu);
    S_CHECK(kvp_client_ping(by, NULL) == 0 && kvp_client_ping(c[0], NULL) == 0, "served");
    /* some leave: new connections are accepted again */
    for (int i = 0; i < 10; i++)
        kvp_client_close(c[--n]);
    int back = 0;
    for (int i = 0; i < 200 && !back; i++) {
        kvp_client_opts_t co = {.socket_path = d.sock, .ns = "many", .timeout_ms = 5000};
        back = kvp_client_connect(&co, &c[n], err, sizeof(err)) == 0;
        if (!back)
            usleep(10000);
    }
    S_CHECK(back, "accepting did not resume: %s", err);
    n++;
    S_CHECK(kvp_client_ping(c[n - 1], NULL) == 0, "new connection served");
    while (n)
        kvp_client_close(c[--n]);
    S_CHECK(s_wait_clients(by, 1) == 1, "connections left");
    int fd1 = s_wait_fds(&d, fd0);
    S_CHECK(fd1 == fd0, "daemon fds %d, %d before", fd1, fd0);
    S_CHECK(kvp_client_audit(by) == 0, "audit");
    kvp_client_close(by);
    S_CHECK(kvp_daemon_stop(&d, SIGTERM) == 0, "daemon exit");
    printf("fds: RLIMIT_NOFILE %d: connections refused with UNAVAILABLE \"out of file "
           "descriptors\" at the limit, daemon CPU %.2f s over 1 s of refusals, others served, "
           "accepting resumed once 10 left; fds %d = %d; exit 0\n",
           NOFILE, cpu, fd1, fd0);
}

/* ---- sigterm ------------------------------------------------------------------------------ */

enum { TERM_WORKERS = 64, TERM_SEQS = 4, TERM_MAX_TOKENS = 256 };

/* One worker: its acknowledged net token count goes to *acked after every answer. Stops at
 * the first error (the daemon draining, then gone). */
static void term_worker(const kvp_daemon_t *d, int k, _Atomic uint64_t *acked,
                        _Atomic uint32_t *calls)
{
    char ns[32];
    snprintf(ns, sizeof(ns), "term%d", k);
    kvp_client_t *c = s_connect(d, ns, 60000, 0);
    void *stage;
    uint32_t buf;
    if (kvp_client_alloc_host_buffer(c, 64 << 10, &stage, &buf))
        _exit(3);
    memset(stage, k, 64 << 10);
    uint32_t len[TERM_SEQS] = {0};
    uint64_t total = 0;
    for (uint64_t i = 0;; i++) {
        uint64_t id = i % TERM_SEQS;
        uint32_t n = 1 + (uint32_t)((i * 7 + (uint64_t)k) % 4);
        int rc;
        if (len[id] + n > TERM_MAX_TOKENS) {
            uint32_t rel = 0;
            rc = kvp_client_release(c, &id, 1, &rel);
            if (rc)
                break;
            total -= len[id];
            len[id] = 0;
        } else {
            kvp_source_t src = source(buf, n);
            rc = i % 3 ? kvp_client_append(c, &id, &n, 1, &src, NULL)
                       : kvp_client_reserve(c, &id, &n, 1, NULL);
            if (rc)
                break;
            len[id] += n;
            total += n;
        }
        atomic_store(acked, total);
        atomic_fetch_add(calls, 1);
    }
    _exit(0); /* no close: the connection goes with the process, as a worker's would */
}

static void scenario_sigterm(void)
{
    kvp_daemon_t d;
    s_start(&d, 20000, NULL, NULL); /* room for every sequence: no RESOURCE_EXHAUSTED here */
    struct shared {
        _Atomic uint64_t acked[TERM_WORKERS];
        _Atomic uint32_t calls;
    } *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    S_CHECK(sh != MAP_FAILED, "mmap");
    memset((void *)sh, 0, sizeof(*sh));
    pid_t p[TERM_WORKERS];
    for (int k = 0; k < TERM_WORKERS; k++)
        if ((p[k] = fork()) == 0)
            term_worker(&d, k, &sh->acked[k], &sh->calls);
    sleep(2);
    uint32_t before = atomic_load(&sh->calls);
    S_CHECK(kill(d.pid, SIGTERM) == 0, "SIGTERM");
    int st;
    S_CHECK(waitpid(d.pid, &st, 0) == d.pid, "waitpid kvpoold");
    pid_t dpid = d.pid;
    d.pid = 0; /* reaped here */
    for (int k = 0; k < TERM_WORKERS; k++) {
        int wst;
        waitpid(p[k], &wst, 0);
        S_CHECK(WIFEXITED(wst) && WEXITSTATUS(wst) == 0, "worker %d: status %d", k, wst);
    }
    S_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "kvpoold %d exit status %d", (int)dpid, st);
    uint64_t acked = 0;
    for (int k = 0; k < TERM_WORKERS; k++)
        acked += atomic_load(&sh->acked[k]);
    uint32_t calls = atomic_load(&sh->calls);
    FILE *f = fopen(d.log, "r");
    S_CHECK(f, "daemon log");
    char line[1024];
    unsigned long long tokens = ~0ull;
    while (fgets(line, sizeof(line), f)) {
        char *t = strstr(line, "final seqs=");
        if (t && strstr(t, "tokens="))
            S_CHECK(sscanf(strstr(t, "tokens="), "tokens=%llu", &tokens) == 1, "final line");
    }
    fclose(f);
    S_CHECK(before > (uint32_t)TERM_WORKERS, "only %u calls before SIGTERM", before);
    S_CHECK(tokens == acked, "the daemon ended with %llu tokens; the workers saw %llu acknowledged",
            tokens, (unsigned long long)acked);
    munmap((void *)sh, sizeof(*sh));
    kvp_daemon_stop(&d, 0); /* removes its directory */
    printf("sigterm: %d workers, %u acknowledged calls (%u before the signal), SIGTERM: exit 0, "
           "final tokens %llu = %llu acknowledged\n",
           TERM_WORKERS, calls, before, tokens, (unsigned long long)acked);
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    unsigned seconds = s_env("KVP_STRESS_SECONDS", 10);
    const char *all[] = {"kill", "noread", "slow", "fds", "sigterm"};
    int nall = 5;
    const char **which = argc > 1 ? (const char **)argv + 1 : all;
    int n = argc > 1 ? argc - 1 : nall;
    for (int i = 0; i < n; i++) {
        if (!strcmp(which[i], "kill"))
            scenario_kill(seconds);
        else if (!strcmp(which[i], "noread"))
            scenario_noread();
        else if (!strcmp(which[i], "slow"))
            scenario_slow();
        else if (!strcmp(which[i], "fds"))
            scenario_fds();
        else if (!strcmp(which[i], "sigterm"))
            scenario_sigterm();
        else {
            fprintf(stderr, "unknown scenario %s (kill, noread, slow, fds, sigterm)\n", which[i]);
            return 2;
        }
        fflush(stdout);
    }
    return 0;
}
