/*
 * bench_transfer.c - KV transfer between two kvpoold processes over NCCL (DESIGN.md §6) against
 * NCCL's own send/recv of the same bytes, measured in the same run. A sender daemon on GPU 0
 * and a receiver on GPU 1 (8 layers, H 32, D 128, fp16, page 16); 4 sequences of 8192 tokens
 * (1 GiB of packed K/V each) are moved by ExportBegin + Import, the whole set timed per round
 * (round 1 includes the communicator's set-up, later rounds reuse it). The baseline is two
 * processes, one per GPU, with one communicator, timing ncclSend/ncclRecv of the same four
 * 1 GiB messages. Run it as is (default transports) and with NCCL_P2P_DISABLE=1
 * NCCL_SHM_DISABLE=1 (the network transport), as tests/gpu/run_multigpu.sh does. Needs two GPUs
 * and libnccl.so.2 (or $KVPOOL_NCCL_LIB). Prints figures; never asserts a time.
 */
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvp_harness.h"
#include "kvp_nccl.h"
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

/* NCCL's own send/recv of NSEQ messages of `bytes`, rank = GPU. Child process. Writes the
 * GB/s of the best of ROUNDS rounds to out_fd (rank 0). */
static int nccl_rank(int rank, int id_fd_w, int id_fd_r, int out_fd, size_t bytes)
{
#ifdef KVP_HAVE_NCCL
    const kvp_nccl_t *n;
    char why[256];
    if (kvp_nccl_get(&n, why, sizeof(why))) {
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
    double best = 0;
    for (int r = 0; r <= ROUNDS; r++) {
        cudaStreamSynchronize(s);
        double t0 = now_s();
        for (int k = 0; k < NSEQ; k++) {
            if (rank == 0)
                n->Send(buf, bytes, ncclUint8, 1, comm, s);
            else
                n->Recv(buf, bytes, ncclUint8, 0, comm, s);
        }
        cudaStreamSynchronize(s);
        double gbs = (double)bytes * NSEQ / (now_s() - t0) / 1e9;
        if (r > 0 && gbs > best) /* round 0 warms up */
            best = gbs;
    }
    n->CommDestroy(comm);
    if (rank == 0 && write(out_fd, &best, sizeof(best)) != sizeof(best))
        return 1;
    return 0;
#else
    (void)rank, (void)id_fd_w, (void)id_fd_r, (void)out_fd, (void)bytes;
    fprintf(stderr, "built without nccl.h\n");
    return 1;
#endif
}

static double nccl_baseline(size_t bytes)
{
    int idp[2], outp[2];
    if (pipe(idp) || pipe(outp))
        return 0;
    pid_t p[2];
    for (int r = 0; r < 2; r++)
        if ((p[r] = fork()) == 0)
            _exit(nccl_rank(r, idp[1], idp[0], outp[1], bytes));
    close(idp[0]), close(idp[1]), close(outp[1]);
    double gbs = 0;
    if (read(outp[0], &gbs, sizeof(gbs)) != sizeof(gbs))
        gbs = 0;
    for (int r = 0; r < 2; r++)
        waitpid(p[r], NULL, 0);
    close(outp[0]);
    return gbs;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(void)
{
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
    uint64_t seq_bytes = 0;
    double secs[ROUNDS];
    for (int r = 0; r < ROUNDS; r++) {
        double t0 = now_s();
        for (int i = 0; i < NSEQ; i++) {
            kvp_transfer_ticket_t tk;
            if (kvp_client_export_begin(ca, ids[i], "bench-receiver", 0, &tk)) {
                fprintf(stderr, "export_begin: %s\n", kvp_client_last_error(ca));
                return 1;
            }
            seq_bytes = tk.bytes;
            if (kvp_client_import(cb, &tk, 100 + (uint64_t)i, 0, NULL)) {
                fprintf(stderr, "import: %s\n", kvp_client_last_error(cb));
                return 1;
            }
            /* the sender notes its end a moment after the receiver: wait for it, so the next
             * export reuses the cached communicator instead of setting up another */
            for (int k = 0; k < 100000; k++) {
                kvp_transfer_info_t info[1];
                uint32_t n = 0;
                if (kvp_client_list_transfers(ca, info, 1, &n) || n == 0 ||
                    strcmp(info[0].state, "running") != 0)
                    break;
            }
        }
        secs[r] = now_s() - t0;
        uint64_t got[NSEQ];
        for (int i = 0; i < NSEQ; i++)
            got[i] = 100 + (uint64_t)i;
        kvp_client_release(cb, got, NSEQ, NULL);
    }
    kvp_client_close(ca);
    kvp_client_close(cb);
    if (getenv("KVP_BENCH_TRACE")) {
        kvp_daemon_dump_log(&a);
        kvp_daemon_dump_log(&b);
    }
    kvp_daemon_stop(&a, SIGTERM);
    kvp_daemon_stop(&b, SIGTERM);
    double base = nccl_baseline((size_t)seq_bytes);
    const double total = (double)seq_bytes * NSEQ;
    double warm[ROUNDS - 1];
    for (int r = 1; r < ROUNDS; r++)
        warm[r - 1] = total / secs[r] / 1e9;
    qsort(warm, ROUNDS - 1, sizeof(double), cmp_double);
    double med = (warm[(ROUNDS - 1) / 2] + warm[(ROUNDS - 2) / 2]) / 2;
    printf("bench_transfer: %s\n", mode);
    printf("  set: %d sequences x %u tokens, 8 layers, H 32, D 128, fp16 = %.2f GiB\n", NSEQ,
           TOKENS, total / (1 << 30));
    printf("  | what | GB/s |\n  |---|---|\n");
    printf("  | kvpool ExportBegin+Import, round 1 (communicator set-up included) | %.1f |\n",
           total / secs[0] / 1e9);
    printf("  | kvpool ExportBegin+Import, warm rounds, median | %.1f |\n", med);
    printf("  | kvpool warm, best | %.1f |\n", warm[ROUNDS - 2]);
    printf("  | NCCL send/recv of the same bytes, best round | %.1f |\n", base);
    if (base > 0)
        printf("  kvpool warm median / NCCL = %.2f\n", med / base);
    return 0;
}
