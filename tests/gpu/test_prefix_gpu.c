/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_prefix_gpu.c - the prefix cache on the GPU hot path (issue #16, Tests: GPU), on a real
 * kvpoold (cuda backend) with two worker processes:
 *
 *   1. Visibility across processes with a deliberately slow writer. Worker A reserves a prompt
 *      with its token ids, queues on its stream a kernel that spins for SPIN_MS and then the
 *      fused appends of every layer, and commits with an interprocess event recorded after
 *      them (kvp_client_cuda_commit). The Commit is answered at once with nothing published;
 *      worker B, in another namespace of the same cache scope, polls Lookup: it must see 0
 *      until A's event completed (never earlier than SPIN_MS after the Commit) and then every
 *      full page.
 *   2. The hot path with reuse: B reserves the prompt plus a question with reuse, gets A's
 *      pages for the full-page prefix (cached_tokens and the page ids exact), appends only the
 *      rest in-process, and reads back every token of every layer, K and V: the prefix holds
 *      A's bytes, the rest B's.
 * Exits 77 without a GPU.
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvp_bench_kernels.h"
#include "kvp_gpu_check.h"
#include "kvp_gpu_test.h"
#include "kvp_harness.h"
#include "kvp_kernels_cuda.h"
#include "kvp_test_util.h"
#include "kvpool.h"

enum { L = 4, H = 4, D = 64, PS = 16, PROMPT = 1000, QUESTION = 24, SPIN_MS = 800 };
enum { FULL = PROMPT / PS * PS, MAXP = 128 };
#define ROW (D * 2)

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* one clock for every process of the machine */
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static kvp_client_t *connect_ns(const char *sock, const char *ns)
{
    kvp_client_opts_t o = {.socket_path = sock,
                           .ns = ns,
                           .lease_ms = 0,
                           .timeout_ms = 30000,
                           .map_pool = 1,
                           .cache_scope = "system-prompt"};
    kvp_client_t *c = NULL;
    char err[256];
    if (kvp_client_connect(&o, &c, err, sizeof(err)))
        FAIL("connect %s: %s", ns, err);
    KV(c, kvp_client_cuda_map_pool(c));
    return c;
}

/* The prompt's token ids, and the K/V rows a worker computes for tokens [0, n) of a sequence:
 * [layer][K|V][token][head][D], from a seed (so the other process can check them). */
static void tokens_of(int32_t *t, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        t[i] = (int32_t)(1000 + (i * 7919u) % 32000u);
}

static uint8_t *rows_of(uint64_t seed, uint32_t n)
{
    uint8_t *h = malloc((size_t)L * 2 * n * H * ROW);
    kvp_rng_t r;
    kvp_rng_seed(&r, seed);
    kvp_rng_fill(&r, h, (size_t)L * 2 * n * H * ROW);
    return h;
}

static const uint8_t *row_at(const uint8_t *h, uint32_t n, uint32_t l, int kv, uint32_t t,
                             uint32_t hh)
{
    return h + ((((size_t)l * 2 + (size_t)kv) * n + t) * H + hh) * ROW;
}

typedef struct {
    int32_t indptr[2], indices[MAXP], last[1], aip[2], lens[1];
    uint32_t cached[2];
    kvp_page_table_t t;
} table_t;

static void table_init(table_t *tb)
{
    memset(tb, 0, sizeof(*tb));
    tb->t = (kvp_page_table_t){.kv_indptr = tb->indptr,
                               .kv_indices = tb->indices,
                               .kv_last_page_len = tb->last,
                               .append_indptr = tb->aip,
                               .seq_lens = tb->lens,
                               .cached_tokens = tb->cached,
                               .cap_batch = 2,
                               .cap_indices = MAXP,
                               .cap_copies = 0};
}

/* Queues the fused appends of every layer for the one-sequence table tb: the new tokens'
 * rows are rows [from, from + n) of h (h holds `total` tokens). The uploads come first, from
 * pinned memory (an upload from pageable memory would block this thread until the stream
 * reached it), then a kernel that spins spin_ms (0: none), then the appends: with a spin the
 * appends are still pending when this returns. */
static void append_layers(kvp_client_t *c, const table_t *tb, const uint8_t *h, uint32_t total,
                          uint32_t from, uint32_t n, unsigned spin_ms, cudaStream_t s)
{
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    uint8_t *pool = kvp_client_pool_base(c, 0);
    const size_t src_bytes = (size_t)L * 2 * n * H * ROW;
    int32_t *dtab, *derr, *htab;
    uint8_t *dsrc, *hsrc;
    CK(cudaMalloc((void **)&dtab, 4 * (MAXP + 8)));
    CK(cudaMalloc((void **)&derr, 4));
    CK(cudaMalloc((void **)&dsrc, src_bytes));
    CK(cudaMallocHost((void **)&htab, 4 * (MAXP + 8)));
    CK(cudaMallocHost((void **)&hsrc, src_bytes));
    htab[0] = tb->indptr[0], htab[1] = tb->indptr[1];
    htab[2] = tb->last[0];
    htab[3] = tb->aip[0], htab[4] = tb->aip[1];
    memcpy(htab + 5, tb->indices, 4 * (size_t)tb->indptr[1]);
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++)
            memcpy(hsrc + (((size_t)l * 2 + (size_t)kv) * n) * H * ROW,
                   row_at(h, total, l, kv, from, 0), (size_t)n * H * ROW);
    CK(cudaMemsetAsync(derr, 0, 4, s));
    CK(cudaMemcpyAsync(dtab, htab, 4 * (5 + (size_t)tb->indptr[1]), cudaMemcpyHostToDevice, s));
    CK(cudaMemcpyAsync(dsrc, hsrc, src_bytes, cudaMemcpyHostToDevice, s));
    if (spin_ms && kvp_bench_spin_cuda((uint64_t)spin_ms * 1000000u, 1, s))
        FAIL("spin");
    for (uint32_t l = 0; l < L; l++) {
        kvp_paged_kv_t kv = {.k_data = pool + l * pi->layer_bytes,
                             .v_data = pool + l * pi->layer_bytes + pi->v_offset_bytes,
                             .elem_bytes = 2,
                             .num_pages = pi->num_pages,
                             .page_size = PS,
                             .num_heads = H,
                             .head_dim = D,
                             .stride_page = pi->stride_page,
                             .stride_n = pi->stride_n,
                             .stride_h = pi->stride_h,
                             .batch_size = 1,
                             .kv_indptr = dtab,
                             .kv_indices = dtab + 5,
                             .kv_last_page_len = dtab + 2};
        const uint8_t *sk = dsrc + (size_t)l * 2 * n * H * ROW;
        kvp_append_src_t as = {.key = sk,
                               .value = sk + (size_t)n * H * ROW,
                               .k_stride_n = H * D,
                               .k_stride_h = D,
                               .v_stride_n = H * D,
                               .v_stride_h = D};
        if (kvp_append_paged_kv_cache_fused_cuda(&kv, &as, dtab + 3, n, derr, s)) /* nnz */
            FAIL("append layer %u", l);
    }
    /* the buffers stay until the process exits: the appends may still be running */
}

/* Every token of the sequence of table tb, every layer, K and V, against want(token). */
static void check_rows(kvp_client_t *c, const table_t *tb, uint32_t len,
                       const uint8_t *(*want)(uint32_t l, int kv, uint32_t t, uint32_t hh))
{
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    uint8_t *pool = kvp_client_pool_base(c, 0);
    uint8_t row[ROW];
    for (uint32_t t = 0; t < len; t++)
        for (uint32_t l = 0; l < L; l++)
            for (int kv = 0; kv < 2; kv++)
                for (uint32_t hh = 0; hh < H; hh++) {
                    int32_t page = tb->indices[t / PS];
                    size_t off = l * pi->layer_bytes + (kv ? pi->v_offset_bytes : 0) +
                                 ((size_t)page * (size_t)pi->stride_page +
                                  (size_t)(t % PS) * (size_t)pi->stride_n +
                                  (size_t)hh * (size_t)pi->stride_h) *
                                     2;
                    CK(cudaMemcpy(row, pool + off, ROW, cudaMemcpyDeviceToHost));
                    if (memcmp(row, want(l, kv, t, hh), ROW))
                        FAIL("token %u layer %u %s head %u: not the bytes written", t, l,
                             kv ? "V" : "K", hh);
                }
}

static uint8_t *g_a, *g_b; /* A's rows (PROMPT tokens) and B's (PROMPT + QUESTION) */

static const uint8_t *want_b(uint32_t l, int kv, uint32_t t, uint32_t hh)
{
    return t < FULL ? row_at(g_a, PROMPT, l, kv, t, hh)
                    : row_at(g_b, PROMPT + QUESTION, l, kv, t, hh);
}

/* Worker A: the slow writer. Reports on fd: the Commit's time (ns), then its page ids. */
static void worker_a(const char *sock, int fd, int go_fd)
{
    kvp_client_t *c = connect_ns(sock, "writer");
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (kvp_cuda_kernels_preload() || kvp_bench_kernels_preload())
        FAIL("preload");
    int32_t tok[PROMPT];
    tokens_of(tok, PROMPT);
    uint64_t id = 1;
    uint32_t n = PROMPT;
    kvp_cache_opts_t co = {.token_ids = tok, .priority = -1};
    table_t tb;
    table_init(&tb);
    KV(c, kvp_client_reserve_cached(c, &id, &n, 1, &co, &tb.t));
    if (tb.t.nnz != PROMPT || tb.indptr[1] != (PROMPT + PS - 1) / PS)
        FAIL("A's reserve: nnz %u, %d pages", tb.t.nnz, tb.indptr[1]);
    append_layers(c, &tb, g_a, PROMPT, 0, PROMPT, SPIN_MS, s);
    if (cudaStreamQuery(s) != cudaErrorNotReady)
        FAIL("A's stream is idle before its Commit: the slow writer did not hold the appends");
    uint32_t pages = 0, published = 99;
    KV(c, kvp_client_cuda_commit_ex(c, &id, 1, s, &pages, &published));
    uint64_t t_commit = now_ns();
    if (pages != FULL / PS || published != 0)
        FAIL("A's commit: %u pages covered, %u published (want %u, 0: the writes are pending)",
             pages, published, FULL / PS);
    if (write(fd, &t_commit, 8) != 8 || write(fd, tb.indices, 4 * MAXP) != 4 * MAXP)
        FAIL("pipe");
    CK(cudaStreamSynchronize(s));
    char go;
    if (read(go_fd, &go, 1) != 1) /* B is done: A's sequence may go */
        FAIL("pipe");
    kvp_client_close(c);
    exit(0);
}

/* Worker B: the reader. */
static void worker_b(const char *sock, int fd, int go_fd)
{
    kvp_client_t *c = connect_ns(sock, "reader");
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (kvp_cuda_kernels_preload())
        FAIL("preload");
    int32_t tok[PROMPT + QUESTION];
    tokens_of(tok, PROMPT);
    for (uint32_t i = PROMPT; i < PROMPT + QUESTION; i++)
        tok[i] = (int32_t)(50000 + i);
    uint64_t t_commit;
    int32_t a_pages[MAXP];
    if (read(fd, &t_commit, 8) != 8 || read(fd, a_pages, 4 * MAXP) != 4 * MAXP)
        FAIL("pipe");
    /* 1. nothing before A's event completes, then every full page */
    uint32_t len = PROMPT, got = 0, zeros = 0;
    uint64_t t_hit = 0;
    while (now_ns() - t_commit < 20000000000ull) {
        KV(c, kvp_client_lookup(c, tok, &len, 1, NULL, NULL, &got));
        if (got) {
            t_hit = now_ns();
            break;
        }
        zeros++;
        usleep(1000);
    }
    if (got != FULL)
        FAIL("B's lookup found %u tokens (want %u) after %.1f s", got, FULL,
             (double)(now_ns() - t_commit) / 1e9);
    if (zeros == 0)
        FAIL("B found A's pages at its first lookup, before A's %d ms writer could finish",
             SPIN_MS);
    if (t_hit - t_commit < (uint64_t)(SPIN_MS / 2) * 1000000u)
        FAIL("B found A's pages %.1f ms after the Commit: before the slow writer finished",
             (double)(t_hit - t_commit) / 1e6);
    printf("visibility: %u lookups saw 0, the pages were findable %.1f ms after the Commit "
           "(writer spin %d ms)\n",
           zeros, (double)(t_hit - t_commit) / 1e6, SPIN_MS);
    /* 2. reuse on the hot path: A's pages, then B's own tokens appended in-process */
    uint64_t id = 7;
    uint32_t n = PROMPT + QUESTION;
    kvp_cache_opts_t co = {.token_ids = tok, .reuse = 1, .priority = -1};
    table_t tb;
    table_init(&tb);
    KV(c, kvp_client_reserve_cached(c, &id, &n, 1, &co, &tb.t));
    if (tb.cached[0] != FULL || tb.t.nnz != PROMPT + QUESTION - FULL ||
        tb.aip[1] != PROMPT + QUESTION - FULL || tb.lens[0] != PROMPT + QUESTION)
        FAIL("B's reserve: cached %u nnz %u (want %u, %u)", tb.cached[0], tb.t.nnz, FULL,
             PROMPT + QUESTION - FULL);
    for (uint32_t p = 0; p < FULL / PS; p++)
        if (tb.indices[p] != a_pages[p])
            FAIL("B's page %u is %d, A's is %d", p, tb.indices[p], a_pages[p]);
    append_layers(c, &tb, g_b, PROMPT + QUESTION, FULL, PROMPT + QUESTION - FULL, 0, s);
    CK(cudaStreamSynchronize(s));
    check_rows(c, &tb, PROMPT + QUESTION, want_b);
    printf("reuse: %u cached tokens linked from A's pages, %u appended in-process; every row "
           "exact\n",
           FULL, PROMPT + QUESTION - FULL);
    if (kvp_client_audit(c))
        FAIL("audit: %s", kvp_client_last_error(c));
    char go = 1;
    if (write(go_fd, &go, 1) != 1)
        FAIL("pipe");
    kvp_client_close(c);
    exit(0);
}

int main(void)
{
    if (kvp_gpu_count() < 1) {
        printf("no usable GPU: skipped\n");
        return 77;
    }
    g_a = rows_of(0xa11ce, PROMPT);
    g_b = rows_of(0xb0b, PROMPT + QUESTION);
    kvp_daemon_t dmn;
    const char *args[] = {"--backend",   "cuda", "--num-layers",   "4", "--num-pages", "512",
                          "--page-size", "16",   "--num-kv-heads", "4", "--head-dim",  "64",
                          NULL};
    if (kvp_daemon_start(&dmn, args))
        FAIL("kvpoold (cuda) did not start");
    int ab[2], ba[2];
    if (pipe(ab) || pipe(ba))
        FAIL("pipe");
    pid_t pa = fork();
    if (pa == 0) {
        close(ab[0]);
        close(ba[1]);
        alarm(120); /* a worker that waits on a dead peer fails instead of hanging */
        worker_a(dmn.sock, ab[1], ba[0]);
    }
    pid_t pb = fork();
    if (pb == 0) {
        close(ab[1]);
        close(ba[0]);
        alarm(120);
        worker_b(dmn.sock, ab[0], ba[1]);
    }
    /* only the workers hold the pipes: one's exit is the other's end of file */
    close(ab[0]);
    close(ab[1]);
    close(ba[0]);
    close(ba[1]);
    int sa, sb;
    if (waitpid(pb, &sb, 0) != pb || !WIFEXITED(sb) || WEXITSTATUS(sb)) {
        kill(pa, SIGKILL);
        kvp_daemon_dump_log(&dmn);
        FAIL("worker B failed (status %d)", sb);
    }
    if (waitpid(pa, &sa, 0) != pa || !WIFEXITED(sa) || WEXITSTATUS(sa)) {
        kvp_daemon_dump_log(&dmn);
        FAIL("worker A failed (status %d)", sa);
    }
    int rc = kvp_daemon_stop(&dmn, SIGTERM);
    if (rc)
        FAIL("kvpoold exited %d", rc);
    printf("test_prefix_gpu: ok\n");
    return 0;
}
