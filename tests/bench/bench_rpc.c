/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bench_rpc.c - RPC latency and throughput of a real kvpoold (host backend) over its Unix
 * socket, with Redis PING over a Unix socket measured in the same run as the yardstick
 * (DESIGN.md §7). Prints, for 1 and 8 concurrent clients: Ping, Reserve of a 256-sequence
 * decode step (256 x 1 token) and Append of that step (K/V from a registered memfd), each with
 * p50, p99 and requests/s; then the daemon's RSS before and after --memory-requests pings.
 *
 * Every client is a thread with its own connection (libkvpool); Redis is driven by the same
 * loop with a minimal RESP client (PING -> +PONG), so both are timed the same way. Redis runs
 * only when redis-server is installed (skipped with a note otherwise).
 *
 *   bench_rpc [--requests N] [--memory-requests N] [--quick]
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvp_harness.h"
#include "kvp_redis.h"
#include "kvpool.h"

#define BATCH 256

static uint32_t REQUESTS = 20000;
static uint64_t MEM_REQUESTS = 1000000;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

typedef enum { OP_PING, OP_RESERVE, OP_APPEND, OP_REDIS } op_t;

typedef struct {
    op_t op;
    int index;
    const char *sock;
    uint32_t n;
    uint64_t *lat; /* [n] ns */
    int failed;
    pthread_barrier_t *start;
} job_t;

static void *client_main(void *arg)
{
    job_t *j = arg;
    if (j->op == OP_REDIS) {
        int fd = kvp_redis_connect(j->sock);
        if (fd < 0) {
            j->failed = 1;
            pthread_barrier_wait(j->start);
            return NULL;
        }
        for (int i = 0; i < 1000; i++)
            kvp_redis_ping(fd);
        pthread_barrier_wait(j->start);
        for (uint32_t i = 0; i < j->n; i++) {
            uint64_t t0 = now_ns();
            if (kvp_redis_ping(fd)) {
                j->failed = 1;
                break;
            }
            j->lat[i] = now_ns() - t0;
        }
        close(fd);
        return NULL;
    }
    char ns[32];
    snprintf(ns, sizeof(ns), "bench%d", j->index);
    kvp_client_opts_t o = {.socket_path = j->sock,
                           .ns = ns,
                           .client_name = "bench_rpc",
                           .timeout_ms = 30000,
                           .map_pool = 0};
    kvp_client_t *c = NULL;
    char err[256];
    if (kvp_client_connect(&o, &c, err, sizeof(err))) {
        fprintf(stderr, "connect: %s\n", err);
        j->failed = 1;
        pthread_barrier_wait(j->start);
        return NULL;
    }
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    uint64_t row = (uint64_t)pi->head_dim * pi->elem_bytes, H = pi->heads_per_device;
    uint64_t ids[BATCH];
    uint32_t toks[BATCH];
    for (int i = 0; i < BATCH; i++)
        ids[i] = (uint64_t)i + 1, toks[i] = 1;
    void *stage = NULL;
    uint32_t buf = 0;
    kvp_source_t src = {0};
    if (j->op == OP_APPEND) {
        uint64_t layer = 2 * BATCH * H * row;
        if (kvp_client_alloc_host_buffer(c, layer * pi->num_layers, &stage, &buf)) {
            j->failed = 1;
            pthread_barrier_wait(j->start);
            kvp_client_close(c);
            return NULL;
        }
        memset(stage, 0x3c, layer * pi->num_layers);
        src = (kvp_source_t){.buffer_id = buf,
                             .k_offset = 0,
                             .v_offset = BATCH * H * row,
                             .k_stride_n = H * row,
                             .k_stride_h = row,
                             .v_stride_n = H * row,
                             .v_stride_h = row,
                             .layer_stride = layer};
    }
    /* steps until this client's share of the pool is used up, then release and go on: the
     * release is not timed */
    uint32_t tokens_per_seq = pi->num_pages / BATCH / 8 * pi->page_size;
    if (tokens_per_seq == 0)
        tokens_per_seq = 1;
    uint32_t step_in_round = 0;
    for (int i = 0; i < 200; i++)
        kvp_client_ping(c, NULL);
    pthread_barrier_wait(j->start);
    for (uint32_t i = 0; i < j->n; i++) {
        int rc = 0;
        if (j->op != OP_PING && step_in_round == tokens_per_seq) {
            rc = kvp_client_release(c, ids, BATCH, NULL);
            step_in_round = 0;
        }
        uint64_t t0 = now_ns();
        if (j->op == OP_PING)
            rc = kvp_client_ping(c, NULL);
        else if (j->op == OP_RESERVE)
            rc = rc ? rc : kvp_client_reserve(c, ids, toks, BATCH, NULL);
        else
            rc = rc ? rc : kvp_client_append(c, ids, toks, BATCH, &src, NULL);
        j->lat[i] = now_ns() - t0;
        step_in_round++;
        if (rc) {
            fprintf(stderr, "request failed: %s\n", kvp_client_last_error(c));
            j->failed = 1;
            break;
        }
    }
    kvp_client_close(c);
    return NULL;
}

typedef struct {
    double p50_us, p99_us, rps;
    int ok;
} result_t;

static result_t run(op_t op, const char *sock, int clients, uint32_t n)
{
    result_t res = {0};
    job_t jobs[16];
    pthread_t th[16];
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)clients + 1);
    for (int k = 0; k < clients; k++) {
        jobs[k] = (job_t){.op = op,
                          .index = k,
                          .sock = sock,
                          .n = n,
                          .lat = calloc(n, sizeof(uint64_t)),
                          .start = &bar};
        pthread_create(&th[k], NULL, client_main, &jobs[k]);
    }
    pthread_barrier_wait(&bar);
    uint64_t t0 = now_ns();
    for (int k = 0; k < clients; k++)
        pthread_join(th[k], NULL);
    uint64_t wall = now_ns() - t0;
    uint64_t *all = malloc(sizeof(uint64_t) * n * (size_t)clients);
    int failed = 0;
    for (int k = 0; k < clients; k++) {
        memcpy(all + (size_t)k * n, jobs[k].lat, sizeof(uint64_t) * n);
        failed |= jobs[k].failed;
        free(jobs[k].lat);
    }
    pthread_barrier_destroy(&bar);
    if (!failed) {
        size_t total = (size_t)n * (size_t)clients;
        qsort(all, total, sizeof(uint64_t), cmp_u64);
        res.p50_us = all[total / 2] / 1e3;
        res.p99_us = all[total * 99 / 100] / 1e3;
        res.rps = total / (wall / 1e9);
        res.ok = 1;
    }
    free(all);
    return res;
}

static long rss_kib(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long v = -1;
    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "VmRSS: %ld kB", &v) == 1)
            break;
    if (f)
        fclose(f);
    return v;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--requests") && i + 1 < argc)
            REQUESTS = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--memory-requests") && i + 1 < argc)
            MEM_REQUESTS = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--quick"))
            REQUESTS = 2000, MEM_REQUESTS = 20000;
        else {
            fprintf(stderr, "usage: %s [--requests N] [--memory-requests N] [--quick]\n", argv[0]);
            return 2;
        }
    }
    if (REQUESTS < 100)
        REQUESTS = 100;
    kvp_daemon_t d;
    const char *args[] = {"--log-level", "warning", "--backend", "host", NULL};
    if (kvp_daemon_start(&d, args)) {
        fprintf(stderr, "kvpoold did not start\n");
        return 1;
    }
    char rsock[400];
    pid_t redis = kvp_redis_start(d.dir, rsock, sizeof(rsock));

    printf("kvpoold RPC benchmark: host backend, default pool (2 layers, 8 KV heads, head_dim "
           "128, fp16, page 16), %u requests per client\n",
           REQUESTS);
    printf("%-34s %8s %10s %10s %12s\n", "workload", "clients", "p50 us", "p99 us", "req/s");
    double redis_p50 = 0, ping_p50 = 0, reserve_p50 = 0;
    int clients_list[2] = {1, 8};
    for (int ci = 0; ci < 2; ci++) {
        int cl = clients_list[ci];
        struct {
            op_t op;
            const char *name;
        } rows[] = {{OP_REDIS, "redis PING (unix socket)"},
                    {OP_PING, "kvpool Ping"},
                    {OP_RESERVE, "kvpool Reserve 256x1 decode step"},
                    {OP_APPEND, "kvpool Append 256x1 decode step"}};
        for (unsigned r = 0; r < 4; r++) {
            if (rows[r].op == OP_REDIS && redis < 0) {
                printf("%-34s %8d %10s %10s %12s\n", rows[r].name, cl, "-", "-",
                       "(no redis-server)");
                continue;
            }
            uint32_t n = rows[r].op == OP_APPEND ? REQUESTS / 4 : REQUESTS;
            result_t res = run(rows[r].op, rows[r].op == OP_REDIS ? rsock : d.sock, cl, n);
            if (!res.ok) {
                printf("%-34s %8d FAILED\n", rows[r].name, cl);
                continue;
            }
            printf("%-34s %8d %10.1f %10.1f %12.0f\n", rows[r].name, cl, res.p50_us, res.p99_us,
                   res.rps);
            if (cl == 1) {
                if (rows[r].op == OP_REDIS)
                    redis_p50 = res.p50_us;
                if (rows[r].op == OP_PING)
                    ping_p50 = res.p50_us;
                if (rows[r].op == OP_RESERVE)
                    reserve_p50 = res.p50_us;
            }
        }
    }
    if (redis_p50 > 0) {
        printf("\ntargets (1 client): Ping p50 %.1f us vs Redis PING p50 %.1f us: ratio %.2f "
               "(target <= 1.00: %s)\n",
               ping_p50, redis_p50, ping_p50 / redis_p50, ping_p50 <= redis_p50 ? "met" : "MISSED");
        printf("                    Reserve p50 %.1f us vs 2 x Redis PING p50 %.1f us: ratio "
               "%.2f (target <= 1.00: %s)\n",
               reserve_p50, 2 * redis_p50, reserve_p50 / (2 * redis_p50),
               reserve_p50 <= 2 * redis_p50 ? "met" : "MISSED");
    }
    /* memory: RSS before and after many requests (pings and reserve/release cycles) */
    long before = rss_kib(d.pid);
    uint32_t per = (uint32_t)(MEM_REQUESTS / 2);
    result_t a = run(OP_PING, d.sock, 2, per / 2);
    result_t b = run(OP_RESERVE, d.sock, 2, per / 2);
    long after = rss_kib(d.pid);
    printf("\ndaemon memory: RSS %ld KiB before, %ld KiB after %llu more requests (%+ld KiB)%s\n",
           before, after, (unsigned long long)MEM_REQUESTS, after - before,
           a.ok && b.ok ? "" : " (some requests failed)");
    if (redis > 0) {
        kill(redis, SIGTERM);
        waitpid(redis, NULL, 0);
        unlink(rsock);
    }
    int code = kvp_daemon_stop(&d, SIGTERM);
    return code == 0 ? 0 : 1;
}
