/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bench_transfer.c - KV transfer between two kvpoold processes over NCCL (DESIGN.md §6) against
 * NCCL's own send/recv of the same bytes, measured in the same run. A sender daemon on GPU 0
 * and a receiver on GPU 1 (8 layers, H 32, D 128, fp16, page 16); 4 sequences of 8192 tokens
 * (1 GiB of packed K/V each) are moved by ExportBegin + Import, the whole set timed per round
 * (round 1 includes the communicator's set-up, later rounds reuse it). The baseline is two
 * processes, one per GPU, with one communicator, timing ncclSend/ncclRecv of the same four
 * 1 GiB messages (also synchronised after each message, and as 64 MiB sends). argv[1]: the
 * largest staging chunk (transfer.chunk_bytes, 0: automatic); argv[2]: transfers in flight
 * (1: one sequence after the other; 2: two clients each moving every other sequence, so one
 * transfer's set-up overlaps the other's stream), or "set": the four sequences as one transfer
 * (ExportBegin of a set: one stream). Run it as is (default transports) and with NCCL_P2P_DISABLE=1
 * NCCL_SHM_DISABLE=1 (the network transport), as tests/gpu/run_multigpu.sh does. Needs two GPUs
 * and libnccl.so.2 (or $KVPOOL_NCCL_LIB). Prints figures; never asserts a time.
 */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvp_harness.h"
#include "kvp_nccl.h"
#include "kvp_xfer.h"
#include "kvpool.h"

#define NSEQ   4
#define TOKENS 8192u
#define ROUNDS 5

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static char chunk_set[64] = "transfer.chunk_bytes=0"; /* argv[1]: the exporter's chunk */

static int start(kvp_daemon_t *d, const char *dev)
{
    const char *args[] = {"--backend",
                          "cuda",
                          "--devices",
                          dev,
                          "--num-layers",
                          "8",
                          "--num-pages",
                          "4096",
                          "--page-size",
                          "16",
                          "--num-kv-heads",
                          "32",
                          "--head-dim",
                          "128",
                          "--dtype",
                          "fp16",
                          "--set",
                          "transfer.timeout_ms=120000",
                          "--set",
                          "limits.max_batch_tokens=65536",
                          "--set",
                          "transfer.max_in_flight=4",
                          "--set",
                          "server.copy_threads=6",
                          "--set",
                          chunk_set,
                          "--log-level",
                          getenv("KVP_BENCH_TRACE") ? "debug" : "info",
                          NULL};
    /* KVP_BENCH_TRACE set: the daemons log each transfer's phases (debug level); their logs
     * are printed at the end */
    return kvp_daemon_start(d, args);
}

static kvp_client_t *conn(const kvp_daemon_t *d, const char *ns)
{
    kvp_client_opts_t o = {.socket_path = d->sock, .ns = ns, .lease_ms = 0, .timeout_ms = 120000};
    kvp_client_t *c = NULL;
    char err[256];
    if (kvp_client_connect(&o, &c, err, sizeof(err))) {
        fprintf(stderr, "connect: %s\n", err);
        exit(1);
    }
    return c;
}

/* The NCCL baselines (GB/s, best round each), measured by rank 0. */
typedef struct {
    double back_to_back; /* NSEQ messages of `bytes` queued back to back: the target's peer */
    double synced;       /* the same, the stream synchronised after each message, as a client
                            moving one sequence at a time does */
    double chunked;      /* each message as sends of BASE_CHUNK bytes, back to back */
} baseline_t;

#define BASE_CHUNK (64u << 20)

/* NCCL's own send/recv of NSEQ messages of `bytes`, rank = GPU. Child process. Writes the
 * baselines to out_fd (rank 0). */
static int nccl_rank(int rank, int id_fd_w, int id_fd_r, int out_fd, size_t bytes)
{
#ifdef KVP_HAVE_NCCL
    const kvp_nccl_t *n;
    char why[256];
    /* the library the daemons load too: $KVPOOL_NCCL_LIB is their [tuning] nccl_lib */
    if (kvp_nccl_set_library(getenv("KVPOOL_NCCL_LIB")) || kvp_nccl_get(&n, why, sizeof(why))) {
        fprintf(stderr, "nccl: %s\n", why);
        return 1;
    }
    ncclUniqueId id;
    if (rank == 0) {
        if (n->GetUniqueId(&id) != ncclSuccess || write(id_fd_w, &id, sizeof(id)) != sizeof(id))
            return 1;
    } else if (read(id_fd_r, &id, sizeof(id)) != sizeof(id)) {
        return 1;
    }
    cudaSetDevice(rank);
    void *buf;
    cudaStream_t s;
    if (cudaMalloc(&buf, bytes) != cudaSuccess || cudaStreamCreate(&s) != cudaSuccess)
        return 1;
    cudaMemset(buf, rank, bytes);
    ncclComm_t comm;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    if (n->CommInitRankConfig(&comm, 2, id, rank, &cfg) != ncclSuccess)
        return 1;
    double best[3] = {0, 0, 0};
    for (int mode = 0; mode < 3; mode++) {
        const size_t piece = mode == 2 ? BASE_CHUNK : bytes;
        for (int r = 0; r <= ROUNDS; r++) {
            cudaStreamSynchronize(s);
            double t0 = now_s();
            for (int k = 0; k < NSEQ; k++) {
                for (size_t off = 0; off < bytes; off += piece) {
                    size_t len = bytes - off < piece ? bytes - off : piece;
                    if (rank == 0)
                        n->Send((char *)buf + off, len, ncclUint8, 1, comm, s);
                    else
                        n->Recv((char *)buf + off, len, ncclUint8, 0, comm, s);
                }
                if (mode == 1)
                    cudaStreamSynchronize(s);
            }
            cudaStreamSynchronize(s);
            double gbs = (double)bytes * NSEQ / (now_s() - t0) / 1e9;
            if (r > 0 && gbs > best[mode]) /* round 0 warms up */
                best[mode] = gbs;
        }
    }
    n->CommDestroy(comm);
    baseline_t out = {best[0], best[1], best[2]};
    if (rank == 0 && write(out_fd, &out, sizeof(out)) != sizeof(out))
        return 1;
    return 0;
#else
    (void)rank, (void)id_fd_w, (void)id_fd_r, (void)out_fd, (void)bytes;
    fprintf(stderr, "built without nccl.h\n");
    return 1;
#endif
}

static baseline_t nccl_baseline(size_t bytes)
{
    int idp[2], outp[2];
    baseline_t gbs = {0, 0, 0};
    if (pipe(idp) || pipe(outp))
        return gbs;
    pid_t p[2];
    for (int r = 0; r < 2; r++)
        if ((p[r] = fork()) == 0)
            _exit(nccl_rank(r, idp[1], idp[0], outp[1], bytes));
    close(idp[0]), close(idp[1]), close(outp[1]);
    if (read(outp[0], &gbs, sizeof(gbs)) != sizeof(gbs))
        memset(&gbs, 0, sizeof(gbs));
    for (int r = 0; r < 2; r++)
        waitpid(p[r], NULL, 0);
    close(outp[0]);
    return gbs;
}

/* One mover: ExportBegin on the sender, Import on the receiver, then the wait until the
 * sender noted its end (so its next export reuses the communicator), for sequences first,
 * first + step, ... of one round. */
typedef struct {
    kvp_client_t *ca, *cb;
    int first, step, warm, rc, n;
    int set; /* the NSEQ sequences as one transfer (ExportBegin of a set) */
    double t0, t1;
    uint64_t seq_bytes;
    /* per warm transfer, client side (us): the ExportBegin call, the Import call (it returns
     * once the KV is in the receiver's pool), the wait until the sender noted its end */
    double exp[ROUNDS * NSEQ], imp[ROUNDS * NSEQ], end[ROUNDS * NSEQ];
} mover_t;

static void *mover(void *arg)
{
    mover_t *m = arg;
    m->t0 = now_s();
    for (int i = m->first; i < NSEQ; i += m->set ? NSEQ : m->step) {
        const double u0 = now_s();
        kvp_transfer_ticket_t tk;
        uint64_t ids[NSEQ], got[NSEQ];
        for (int k = 0; k < NSEQ; k++)
            ids[k] = (uint64_t)k + 1, got[k] = 100 + (uint64_t)k;
        if (m->set ? kvp_client_export_begin_set(m->ca, ids, NSEQ, "bench-receiver", 0, &tk)
                   : kvp_client_export_begin(m->ca, (uint64_t)i + 1, "bench-receiver", 0, &tk)) {
            fprintf(stderr, "export_begin: %s\n", kvp_client_last_error(m->ca));
            m->rc = 1;
            return NULL;
        }
        m->seq_bytes = m->set ? tk.bytes / NSEQ : tk.bytes;
        const double u1 = now_s();
        if (m->set ? kvp_client_import_set(m->cb, &tk, got, 0, NULL)
                   : kvp_client_import(m->cb, &tk, 100 + (uint64_t)i, 0, NULL)) {
            fprintf(stderr, "import: %s\n", kvp_client_last_error(m->cb));
            m->rc = 1;
            return NULL;
        }
        const double u2 = now_s();
        for (int k = 0, running = 1; running && k < 100000; k++) {
            kvp_transfer_info_t info[32];
            uint32_t n = 0;
            if (kvp_client_list_transfers(m->ca, info, 32, &n))
                break;
            running = 0;
            for (uint32_t q = 0; q < n; q++)
                if (info[q].transfer_id == tk.transfer_id)
                    running = strcmp(info[q].state, "running") == 0;
        }
        if (m->warm) {
            m->exp[m->n] = (u1 - u0) * 1e6, m->imp[m->n] = (u2 - u1) * 1e6;
            m->end[m->n++] = (now_s() - u2) * 1e6;
        }
    }
    m->t1 = now_s();
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc > 1) /* the largest staging chunk in bytes (transfer.chunk_bytes); 0: automatic */
        snprintf(chunk_set, sizeof(chunk_set), "transfer.chunk_bytes=%s", argv[1]);
    /* argv[2]: transfers in flight, or "set": the four sequences as one transfer */
    const int set = argc > 2 && strcmp(argv[2], "set") == 0;
    const int in_flight =
        !set && argc > 2 && atoi(argv[2]) >= 1 && atoi(argv[2]) <= NSEQ ? atoi(argv[2]) : 1;
    const char *p2p = getenv("NCCL_P2P_DISABLE"), *shm = getenv("NCCL_SHM_DISABLE");
    const char *mode = p2p && shm
                           ? "network transport forced (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)"
                           : "default transports";
    kvp_daemon_t a, b;
    if (start(&a, "0") || start(&b, "1")) {
        fprintf(stderr, "the daemons did not start (two GPUs needed)\n");
        return 1;
    }
    kvp_client_t *ca = conn(&a, "prefill"), *cb = conn(&b, "decode");
    uint64_t ids[NSEQ];
    uint32_t toks[NSEQ];
    for (int i = 0; i < NSEQ; i++)
        ids[i] = (uint64_t)i + 1, toks[i] = TOKENS;
    if (kvp_client_reserve(ca, ids, toks, NSEQ, NULL)) {
        fprintf(stderr, "reserve: %s\n", kvp_client_last_error(ca));
        return 1;
    }
    double secs[ROUNDS];
    /* in_flight movers, each with its own connections, move sequences i = t, t + K, ... one
     * after the other; a round is timed from the first start to the last end */
    mover_t mv[NSEQ];
    for (int t = 0; t < in_flight; t++)
        mv[t] = (mover_t){.ca = t ? conn(&a, "prefill") : ca,
                          .cb = t ? conn(&b, "decode") : cb,
                          .first = t,
                          .step = in_flight,
                          .set = set};
    for (int r = 0; r < ROUNDS; r++) {
        pthread_t th[NSEQ];
        for (int t = 0; t < in_flight; t++) {
            mv[t].warm = r > 0;
            pthread_create(&th[t], NULL, mover, &mv[t]);
        }
        double t0 = 1e30, t1 = 0;
        for (int t = 0; t < in_flight; t++) {
            pthread_join(th[t], NULL);
            if (mv[t].rc)
                return 1;
            t0 = mv[t].t0 < t0 ? mv[t].t0 : t0;
            t1 = mv[t].t1 > t1 ? mv[t].t1 : t1;
        }
        secs[r] = t1 - t0;
        uint64_t got[NSEQ];
        for (int i = 0; i < NSEQ; i++)
            got[i] = 100 + (uint64_t)i;
        kvp_client_release(cb, got, NSEQ, NULL);
    }
    /* the client-side phases of every mover's warm transfers */
    double t_exp[(ROUNDS - 1) * NSEQ], t_imp[(ROUNDS - 1) * NSEQ], t_end[(ROUNDS - 1) * NSEQ];
    int nt = 0;
    uint64_t seq_bytes = 0;
    for (int t = 0; t < in_flight; t++) {
        for (int k = 0; k < mv[t].n; k++, nt++)
            t_exp[nt] = mv[t].exp[k], t_imp[nt] = mv[t].imp[k], t_end[nt] = mv[t].end[k];
        seq_bytes = mv[t].seq_bytes;
        if (t) {
            kvp_client_close(mv[t].ca);
            kvp_client_close(mv[t].cb);
        }
    }
    kvp_client_close(ca);
    kvp_client_close(cb);
    if (getenv("KVP_BENCH_TRACE")) {
        kvp_daemon_dump_log(&a);
        kvp_daemon_dump_log(&b);
    }
    kvp_daemon_stop(&a, SIGTERM);
    kvp_daemon_stop(&b, SIGTERM);
    baseline_t bl = nccl_baseline((size_t)seq_bytes);
    const double base = bl.back_to_back;
    const double total = (double)seq_bytes * NSEQ;
    double warm[ROUNDS - 1];
    for (int r = 1; r < ROUNDS; r++)
        warm[r - 1] = total / secs[r] / 1e9;
    qsort(warm, ROUNDS - 1, sizeof(double), cmp_double);
    double med = (warm[(ROUNDS - 1) / 2] + warm[(ROUNDS - 2) / 2]) / 2;
    if (set)
        printf("bench_transfer: %s, %s (0: automatic, %zu bytes here), the %d sequences as one "
               "transfer (a set)\n",
               mode, chunk_set, kvp_xfer_chunk_bytes(0, seq_bytes * NSEQ), NSEQ);
    else
        printf("bench_transfer: %s, %s (0: automatic, %zu bytes here), %d transfer(s) in "
               "flight\n",
               mode, chunk_set, kvp_xfer_chunk_bytes(0, seq_bytes), in_flight);
    printf("  set: %d sequences x %u tokens, 8 layers, H 32, D 128, fp16 = %.2f GiB\n", NSEQ,
           TOKENS, total / (1 << 30));
    printf("  | what | GB/s |\n  |---|---|\n");
    printf("  | kvpool ExportBegin+Import, round 1 (communicator set-up included) | %.1f |\n",
           total / secs[0] / 1e9);
    printf("  | kvpool ExportBegin+Import, warm rounds, median | %.1f |\n", med);
    printf("  | kvpool warm, best | %.1f |\n", warm[ROUNDS - 2]);
    printf("  | NCCL send/recv of the same bytes, best round | %.1f |\n", base);
    printf("  | NCCL, synchronised after each 1 GiB message | %.1f |\n", bl.synced);
    printf("  | NCCL, each message as %u MiB sends | %.1f |\n", BASE_CHUNK >> 20, bl.chunked);
    if (base > 0)
        printf("  kvpool warm median / NCCL = %.2f\n", med / base);
    qsort(t_exp, (size_t)nt, sizeof(double), cmp_double);
    qsort(t_imp, (size_t)nt, sizeof(double), cmp_double);
    qsort(t_end, (size_t)nt, sizeof(double), cmp_double);
    printf("  per warm transfer (%d), client side, median us: ExportBegin %.0f, Import %.0f, "
           "sender's end seen after %.0f; its bytes at NCCL's rate: %.0f\n",
           nt, t_exp[nt / 2], t_imp[nt / 2], t_end[nt / 2],
           base > 0 ? (double)seq_bytes * (set ? NSEQ : 1) / base / 1e3 : 0.0);
    return 0;
}
