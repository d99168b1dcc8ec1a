/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_multigpu_xfer.c - KV transfers between two real kvpoold processes over NCCL (DESIGN.md
 * §6): senders on GPU 0, receivers on GPU 1, one daemon per pool geometry, every pairing of
 * layout (NHD/HND), storage (combined/split) and page size {16, 64} on either side. Each
 * transfer: a sequence of 77 tokens written into the sender's pool by a daemon-run Append,
 * ExportBegin there, Import on the receiver; the receiver's pages read back through its own
 * mapping must hold every row byte-exact, both ListTransfers report ok, both audits are clean.
 * Then the sending daemon is SIGKILLed mid-transfer (KVPOOL_XFER_TEST_STALL_MS, a hook of the
 * test daemon kvpoold-test, holds it between the header exchange and the payload): the Import
 * fails, the receiver's usage and audit are exactly as before, and it imports from a fresh
 * sender afterwards. A mismatched Import is refused and the communicator stays usable
 * (refused_then_reused); sets of sequences move as one transfer (set_transfer). Run it again
 * with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 for the network transport
 * (tests/gpu/run_multigpu.sh). Needs libnccl.so.2 (or $KVPOOL_NCCL_LIB: the daemons' [tuning]
 * nccl_lib). Label multigpu: exits 77 with fewer than two GPUs.
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

#include "kvp_gpu_test.h"
#include "kvp_harness.h"
#include "kvp_test_util.h"
#include "kvpool.h"

#define T_TOKENS 77u
#define LAYERS   2u
#define HEADS    4u
#define HDIM     64u
#define ELEM     2u
#define ROW      (HDIM * ELEM)

static int failures;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "FAIL line %d: ", __LINE__);                                           \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            failures++;                                                                            \
            return -1;                                                                             \
        }                                                                                          \
    } while (0)

typedef struct {
    kvp_daemon_t d;
    int device;
    uint32_t page_size, layout, storage;
    char name[32];
} pool_t;

static int start_pool(pool_t *p, int device, uint32_t ps, uint32_t layout, uint32_t storage)
{
    char dev[8], pss[8];
    snprintf(dev, sizeof(dev), "%d", device);
    snprintf(pss, sizeof(pss), "%u", ps);
    p->device = device, p->page_size = ps, p->layout = layout, p->storage = storage;
    snprintf(p->name, sizeof(p->name), "gpu%d-p%u-%s-%s", device, ps, layout ? "hnd" : "nhd",
             storage ? "split" : "combined");
    const char *args[] = {"--backend",
                          "cuda",
                          "--devices",
                          dev,
                          "--num-layers",
                          "2",
                          "--num-pages",
                          "64",
                          "--page-size",
                          pss,
                          "--num-kv-heads",
                          "4",
                          "--head-dim",
                          "64",
                          "--dtype",
                          "fp16",
                          "--layout",
                          layout ? "hnd" : "nhd",
                          "--storage",
                          storage ? "split" : "combined",
                          "--set",
                          "transfer.timeout_ms=20000",
                          "--set",
                          "transfer.max_in_flight=8",
                          NULL};
    return kvp_daemon_start(&p->d, args);
}

static kvp_client_t *connect_to(const pool_t *p, const char *ns, int map)
{
    kvp_client_opts_t o = {.socket_path = p->d.sock,
                           .ns = ns,
                           .client_name = "xfer-test",
                           .lease_ms = 600000,
                           .timeout_ms = 30000,
                           .map_pool = map};
    kvp_client_t *c = NULL;
    char err[256];
    if (kvp_client_connect(&o, &c, err, sizeof(err))) {
        fprintf(stderr, "connect %s: %s\n", p->name, err);
        return NULL;
    }
    return c;
}

/* Writes T tokens of random K/V as sequence seq of the sender (a daemon-run Append from a
 * memfd). host receives the staging bytes: per layer K [T, H, D] then V, which is exactly the
 * packed transfer form, so it is also what the receiver must hold. */
static int fill_n(kvp_client_t *c, uint64_t seq, uint32_t T, uint8_t *host, kvp_rng_t *rng)
{
    const uint64_t kv = (uint64_t)T * HEADS * ROW, bytes = LAYERS * 2 * kv;
    void *stage;
    uint32_t id;
    CHECK(kvp_client_alloc_host_buffer(c, bytes, &stage, &id) == 0, "host buffer: %s",
          kvp_client_last_error(c));
    kvp_rng_fill(rng, host, bytes);
    memcpy(stage, host, bytes);
    kvp_source_t src = {.buffer_id = id,
                        .v_offset = kv,
                        .k_stride_n = HEADS * ROW,
                        .k_stride_h = ROW,
                        .v_stride_n = HEADS * ROW,
                        .v_stride_h = ROW,
                        .layer_stride = 2 * kv};
    uint32_t n = T;
    CHECK(kvp_client_append(c, &seq, &n, 1, &src, NULL) == 0, "append: %s",
          kvp_client_last_error(c));
    CHECK(kvp_client_unregister_buffer(c, id) == 0, "unregister");
    return 0;
}

static int fill_sequence(kvp_client_t *c, uint64_t seq, uint8_t *host, kvp_rng_t *rng)
{
    return fill_n(c, seq, T_TOKENS, host, rng);
}

/* Reads the receiver's pool and compares every row of sequence seq (T tokens) with expect. */
static int check_n(kvp_client_t *c, uint64_t seq, uint32_t T, const uint8_t *expect,
                   const char *what)
{
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    CHECK(kvp_client_cuda_map_pool(c) == 0, "map: %s", kvp_client_last_error(c));
    int32_t indptr[2], indices[64], last[1];
    kvp_page_table_t t = {.kv_indptr = indptr,
                          .kv_indices = indices,
                          .kv_last_page_len = last,
                          .cap_batch = 2,
                          .cap_indices = 64};
    CHECK(kvp_client_page_table(c, &seq, 1, &t) == 0, "page table: %s", kvp_client_last_error(c));
    CHECK(t.num_indices == (T + pi->page_size - 1) / pi->page_size, "%s: %u pages", what,
          t.num_indices);
    uint8_t *back = malloc(pi->pool_bytes);
    CHECK(back, "oom");
    /* the mapping is accessible from the pool's own device only (cuMemSetAccess) */
    int r = cudaSetDevice(pi->device_ids[0]);
    if (r == cudaSuccess)
        r = cudaMemcpy(back, kvp_client_pool_base(c, 0), pi->pool_bytes, cudaMemcpyDeviceToHost);
    if (r != cudaSuccess) {
        free(back);
        CHECK(0, "cudaMemcpy of the pool failed");
    }
    const uint64_t kvb = (uint64_t)T * HEADS * ROW;
    for (uint32_t l = 0; l < LAYERS; l++)
        for (uint32_t w = 0; w < 2; w++)
            for (uint32_t tok = 0; tok < T; tok++)
                for (uint32_t h = 0; h < HEADS; h++) {
                    uint64_t page = (uint64_t)indices[tok / pi->page_size];
                    uint64_t elems = page * (uint64_t)pi->stride_page +
                                     (tok % pi->page_size) * (uint64_t)pi->stride_n +
                                     h * (uint64_t)pi->stride_h;
                    uint64_t off =
                        l * pi->layer_bytes + (w ? pi->v_offset_bytes : 0) + elems * pi->elem_bytes;
                    const uint8_t *want =
                        expect + (2 * l + w) * kvb + ((uint64_t)tok * HEADS + h) * ROW;
                    if (memcmp(back + off, want, ROW)) {
                        free(back);
                        CHECK(0, "%s: layer %u %s token %u head %u differs", what, l, w ? "V" : "K",
                              tok, h);
                    }
                }
    free(back);
    return 0;
}

static int check_received(kvp_client_t *c, uint64_t seq, const uint8_t *expect, const char *what)
{
    return check_n(c, seq, T_TOKENS, expect, what);
}

/* Waits until the exporter's ListTransfers says transfer tid ended; 0 when it ended in state
 * `want` with a message containing `msg`. */
static int export_ended(kvp_client_t *c, uint64_t tid, const char *want, const char *msg)
{
    for (int i = 0; i < 2000; i++) {
        kvp_transfer_info_t info[32];
        uint32_t n = 0;
        CHECK(kvp_client_list_transfers(c, info, 32, &n) == 0, "list: %s",
              kvp_client_last_error(c));
        for (uint32_t k = 0; k < n; k++)
            if (info[k].transfer_id == tid && strcmp(info[k].state, "running") != 0) {
                CHECK(strcmp(info[k].state, want) == 0 && strstr(info[k].message, msg),
                      "export ended %s (%s), expected %s (%s)", info[k].state, info[k].message,
                      want, msg);
                return 0;
            }
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    CHECK(0, "export %llu still running after 20 s", (unsigned long long)tid);
}

static int export_outcome(kvp_client_t *c, uint64_t tid)
{
    return export_ended(c, tid, "ok", "");
}

static int transfer_pair(pool_t *a, pool_t *b, uint64_t seq, kvp_rng_t *rng)
{
    char what[96];
    snprintf(what, sizeof(what), "%s -> %s", a->name, b->name);
    kvp_client_t *ca = connect_to(a, "prefill", 0), *cb = connect_to(b, "decode", 1);
    CHECK(ca && cb, "%s: connect", what);
    uint8_t *expect = malloc((size_t)LAYERS * 2 * T_TOKENS * HEADS * ROW);
    int rc = fill_sequence(ca, seq, expect, rng);
    kvp_transfer_ticket_t tk;
    if (!rc && kvp_client_export_begin(ca, seq, b->name, 0, &tk)) {
        fprintf(stderr, "FAIL %s: export_begin: %s\n", what, kvp_client_last_error(ca));
        failures++, rc = -1;
    }
    if (!rc && (tk.num_tokens != T_TOKENS || tk.num_layers != LAYERS ||
                tk.bytes != (uint64_t)LAYERS * 2 * T_TOKENS * HEADS * ROW)) {
        fprintf(stderr, "FAIL %s: ticket\n", what);
        failures++, rc = -1;
    }
    uint32_t np = 0;
    if (!rc && kvp_client_import(cb, &tk, seq + 1000, 0, &np)) {
        fprintf(stderr, "FAIL %s: import: %s\n", what, kvp_client_last_error(cb));
        failures++, rc = -1;
    }
    if (!rc)
        rc = check_received(cb, seq + 1000, expect, what);
    if (!rc)
        rc = export_outcome(ca, tk.transfer_id);
    if (!rc && (kvp_client_audit(ca) || kvp_client_audit(cb))) {
        fprintf(stderr, "FAIL %s: audit\n", what);
        failures++, rc = -1;
    }
    /* leave both pools empty for the next pairing */
    uint64_t s1 = seq + 1000;
    if (ca)
        kvp_client_release(ca, &seq, 1, NULL);
    if (cb)
        kvp_client_release(cb, &s1, 1, NULL);
    kvp_client_close(ca);
    kvp_client_close(cb);
    free(expect);
    if (!rc)
        printf("ok   %s\n", what);
    return rc;
}

/* An Import whose token count does not match the exporter's header is refused: INVALID_ARGUMENT
 * with the reason, the receiver's pool as before, the exporter reports the refusal. The
 * refused stream was drained, so the communicator stays cached and in step: the next export
 * to the same peer reuses it (the same unique id) and arrives byte-exact. */
static int refused_then_reused(pool_t *a, pool_t *b, uint64_t seq, kvp_rng_t *rng)
{
    kvp_client_t *ca = connect_to(a, "prefill", 0), *cb = connect_to(b, "decode", 1);
    CHECK(ca && cb, "connect");
    uint8_t *expect = malloc((size_t)LAYERS * 2 * T_TOKENS * HEADS * ROW);
    CHECK(expect && fill_sequence(ca, seq, expect, rng) == 0, "fill");
    kvp_stats_summary_t before, after;
    CHECK(kvp_client_stats(cb, &before) == 0, "stats");
    kvp_transfer_ticket_t tk, bad;
    CHECK(kvp_client_export_begin(ca, seq, b->name, 0, &tk) == 0, "export_begin: %s",
          kvp_client_last_error(ca));
    bad = tk;
    bad.num_tokens = T_TOKENS - 1;
    int irc = kvp_client_import(cb, &bad, seq + 1000, 0, NULL);
    CHECK(irc == KVP_EINVAL && strstr(kvp_client_last_error(cb), "another token count"),
          "a mismatched Import: %s (%s)", kvp_strerror(irc), kvp_client_last_error(cb));
    CHECK(kvp_client_stats(cb, &after) == 0, "stats after");
    CHECK(after.used_pages == before.used_pages && after.num_seqs == before.num_seqs &&
              after.num_tokens == before.num_tokens,
          "the refused Import changed the pool: used %u -> %u", before.used_pages,
          after.used_pages);
    CHECK(kvp_client_audit(cb) == 0, "audit: %s", kvp_client_last_error(cb));
    CHECK(export_ended(ca, tk.transfer_id, "failed", "the importer refused") == 0,
          "the exporter reports the refusal");
    kvp_transfer_ticket_t tk2;
    CHECK(kvp_client_export_begin(ca, seq, b->name, 0, &tk2) == 0, "export_begin again: %s",
          kvp_client_last_error(ca));
    CHECK(memcmp(tk2.nccl_id, tk.nccl_id, sizeof(tk.nccl_id)) == 0,
          "the communicator was not reused after a clean refusal");
    CHECK(kvp_client_import(cb, &tk2, seq + 1000, 0, NULL) == 0, "import: %s",
          kvp_client_last_error(cb));
    CHECK(check_received(cb, seq + 1000, expect, "after a refusal") == 0, "received");
    CHECK(export_outcome(ca, tk2.transfer_id) == 0, "export outcome");
    CHECK(kvp_client_audit(ca) == 0 && kvp_client_audit(cb) == 0, "audit after");
    uint64_t s1 = seq + 1000;
    kvp_client_release(ca, &seq, 1, NULL);
    kvp_client_release(cb, &s1, 1, NULL);
    kvp_client_close(ca);
    kvp_client_close(cb);
    free(expect);
    printf("ok   refused Import (drained), then the same communicator reused\n");
    return 0;
}

/* A set of four sequences of different lengths (one of a single token) moves as one transfer:
 * the ticket names each one's tokens, the receiver creates all four, each byte-exact, both
 * ListTransfers report the set, the audits are clean. */
static int set_transfer(pool_t *a, pool_t *b, uint64_t base, kvp_rng_t *rng)
{
    enum { N = 4 };
    const uint32_t T[N] = {77, 1, 150, 33};
    char what[96];
    snprintf(what, sizeof(what), "set of %d: %s -> %s", N, a->name, b->name);
    kvp_client_t *ca = connect_to(a, "prefill", 0), *cb = connect_to(b, "decode", 1);
    CHECK(ca && cb, "%s: connect", what);
    uint8_t *expect[N];
    uint64_t ids[N], got[N];
    uint32_t total = 0;
    for (int i = 0; i < N; i++) {
        ids[i] = base + (uint64_t)i, got[i] = base + 1000 + (uint64_t)i;
        expect[i] = malloc((size_t)LAYERS * 2 * T[i] * HEADS * ROW);
        CHECK(expect[i] && fill_n(ca, ids[i], T[i], expect[i], rng) == 0, "%s: fill", what);
        total += T[i];
    }
    kvp_transfer_ticket_t tk;
    CHECK(kvp_client_export_begin_set(ca, ids, N, b->name, 0, &tk) == 0, "%s: export: %s", what,
          kvp_client_last_error(ca));
    CHECK(tk.num_seqs == N && tk.num_tokens == total &&
              tk.bytes == (uint64_t)LAYERS * 2 * total * HEADS * ROW,
          "%s: ticket (%u sequences, %u tokens)", what, tk.num_seqs, tk.num_tokens);
    for (int i = 0; i < N; i++)
        CHECK(tk.seq_tokens[i] == T[i], "%s: ticket tokens[%d] %u", what, i, tk.seq_tokens[i]);
    CHECK(kvp_client_import(cb, &tk, got[0], 0, NULL) == KVP_EINVAL, "%s: a set through import",
          what);
    uint32_t np = 0;
    CHECK(kvp_client_import_set(cb, &tk, got, 0, &np) == 0, "%s: import: %s", what,
          kvp_client_last_error(cb));
    uint32_t want_pages = 0;
    for (int i = 0; i < N; i++) {
        want_pages += (T[i] + b->page_size - 1) / b->page_size;
        CHECK(check_n(cb, got[i], T[i], expect[i], what) == 0, "%s: sequence %d", what, i);
    }
    CHECK(np == want_pages, "%s: %u pages, expected %u", what, np, want_pages);
    CHECK(export_outcome(ca, tk.transfer_id) == 0, "%s: export outcome", what);
    kvp_transfer_info_t info[32];
    uint32_t n = 0;
    CHECK(kvp_client_list_transfers(cb, info, 32, &n) == 0 && n > 0 &&
              info[0].transfer_id == tk.transfer_id && info[0].num_seqs == N &&
              info[0].seq_id == got[0] && info[0].num_tokens == total,
          "%s: the receiver's ListTransfers", what);
    CHECK(kvp_client_audit(ca) == 0 && kvp_client_audit(cb) == 0, "%s: audit", what);
    kvp_client_release(ca, ids, N, NULL);
    kvp_client_release(cb, got, N, NULL);
    kvp_client_close(ca);
    kvp_client_close(cb);
    for (int i = 0; i < N; i++)
        free(expect[i]);
    printf("ok   %s\n", what);
    return 0;
}

static void *killer(void *arg)
{
    pool_t *p = arg;
    struct timespec ts = {4, 0}; /* the header exchange is long done */
    nanosleep(&ts, NULL);
    kill(p->d.pid, SIGKILL);
    return NULL;
}

/* The sender dies after the header exchange, before the payload. */
static int sender_killed_mid_transfer(pool_t *recv, kvp_rng_t *rng)
{
    pool_t a;
    setenv("KVPOOL_XFER_TEST_STALL_MS", "8000", 1);
    int rc = start_pool(&a, 0, 16, 0, 0);
    unsetenv("KVPOOL_XFER_TEST_STALL_MS");
    CHECK(rc == 0, "start the doomed sender");
    kvp_client_t *ca = connect_to(&a, "prefill", 0), *cb = connect_to(recv, "decode", 0);
    CHECK(ca && cb, "connect");
    uint8_t *expect = malloc((size_t)LAYERS * 2 * T_TOKENS * HEADS * ROW);
    CHECK(fill_sequence(ca, 5, expect, rng) == 0, "fill");
    kvp_stats_summary_t before, after;
    CHECK(kvp_client_stats(cb, &before) == 0, "stats");
    kvp_transfer_ticket_t tk;
    CHECK(kvp_client_export_begin(ca, 5, "doomed", 0, &tk) == 0, "export_begin: %s",
          kvp_client_last_error(ca));
    pthread_t th;
    pthread_create(&th, NULL, killer, &a);
    int irc = kvp_client_import(cb, &tk, 77, 20000, NULL);
    pthread_join(th, NULL);
    printf("import from a killed sender: %s (%s)\n", kvp_strerror(irc), kvp_client_last_error(cb));
    CHECK(irc == KVP_EUNAVAIL || irc == KVP_ETIMEDOUT, "the import must fail, got %s",
          kvp_strerror(irc));
    CHECK(kvp_client_stats(cb, &after) == 0, "stats after");
    CHECK(after.used_pages == before.used_pages && after.free_pages == before.free_pages &&
              after.num_seqs == before.num_seqs && after.num_tokens == before.num_tokens,
          "the receiver's pool changed: used %u -> %u, seqs %u -> %u", before.used_pages,
          after.used_pages, before.num_seqs, after.num_seqs);
    CHECK(kvp_client_audit(cb) == 0, "audit after: %s", kvp_client_last_error(cb));
    kvp_transfer_info_t info[32];
    uint32_t n = 0;
    CHECK(kvp_client_list_transfers(cb, info, 32, &n) == 0 && n > 0 &&
              strcmp(info[0].state, "failed") == 0,
          "the receiver reports the failure");
    printf("receiver reports: %s\n", info[0].message);
    kvp_client_close(ca);
    kvp_client_close(cb);
    free(expect);
    kvp_daemon_stop(&a.d, 0);
    /* the receiver is healthy: it imports from a fresh sender */
    pool_t a2;
    CHECK(start_pool(&a2, 0, 16, 0, 0) == 0, "start a fresh sender");
    rc = transfer_pair(&a2, recv, 7, rng);
    kvp_daemon_stop(&a2.d, SIGTERM);
    return rc;
}

#ifndef KVPOOLD_TEST_PATH
#define KVPOOLD_TEST_PATH "kvpoold-test"
#endif

int main(void)
{
    if (kvp_gpu_count() < 2) {
        printf("fewer than two usable GPUs: skipped\n");
        return 77;
    }
    /* every daemon here is kvpoold-test, the build with the transfer test hooks
     * (KVPOOL_XFER_TEST_*; the production kvpoold ignores them): $KVPOOLD_TEST, else the one
     * built next to this test */
    setenv("KVPOOLD", getenv("KVPOOLD_TEST") ? getenv("KVPOOLD_TEST") : KVPOOLD_TEST_PATH, 1);
    printf("NCCL_P2P_DISABLE=%s NCCL_SHM_DISABLE=%s KVPOOL_NCCL_LIB=%s\n",
           getenv("NCCL_P2P_DISABLE") ? getenv("NCCL_P2P_DISABLE") : "",
           getenv("NCCL_SHM_DISABLE") ? getenv("NCCL_SHM_DISABLE") : "",
           getenv("KVPOOL_NCCL_LIB") ? getenv("KVPOOL_NCCL_LIB") : "(libnccl.so.2)");
    /* every daemon is started before this process touches CUDA */
    enum { NV = 8 };
    pool_t send[NV], recv[NV];
    const uint32_t sizes[2] = {16, 64};
    for (int v = 0; v < NV; v++) {
        if (start_pool(&send[v], 0, sizes[v & 1], (v >> 1) & 1, (v >> 2) & 1) ||
            start_pool(&recv[v], 1, sizes[v & 1], (v >> 1) & 1, (v >> 2) & 1)) {
            fprintf(stderr, "a daemon did not start\n");
            return 1;
        }
    }
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(0x8f));
    uint64_t seq = 1;
    for (int i = 0; i < NV; i++)
        for (int j = 0; j < NV; j++)
            transfer_pair(&send[i], &recv[j], seq++, &rng);
    /* a cached communicator is reused: the same pair again */
    transfer_pair(&send[0], &recv[3], seq++, &rng);
    refused_then_reused(&send[1], &recv[2], seq, &rng);
    seq += 2;
    /* sets across page sizes, layouts and storages */
    set_transfer(&send[0], &recv[7], 500, &rng);
    set_transfer(&send[6], &recv[1], 600, &rng);
    sender_killed_mid_transfer(&recv[0], &rng);
    for (int v = 0; v < NV; v++) {
        int a = kvp_daemon_stop(&send[v].d, SIGTERM), b = kvp_daemon_stop(&recv[v].d, SIGTERM);
        if (a || b) {
            fprintf(stderr, "FAIL daemon exit codes %d %d (%s, %s)\n", a, b, send[v].name,
                    recv[v].name);
            failures++;
        }
    }
    printf("%s: %d failure(s)\n", failures ? "FAILED" : "PASSED", failures);
    return failures ? 1 : 0;
}
