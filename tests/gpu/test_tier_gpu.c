/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_tier_gpu.c - the prefix cache's host tier across processes on the GPU (issue #28, Tests:
 * GPU): "the same cross-process restore with a deliberately slow reader", on a real kvpoold
 * (cuda backend, a host tier of 1 GiB pinned in 64 MiB chunks, demote_free_pct 50) with pages
 * of 512 KiB (8 layers, 8 KV heads, head_dim 128, fp16, 16 tokens):
 *
 *   1. Worker A reserves a prompt of 4010 tokens with its token ids, appends every layer
 *      in-process (the fused append), commits and releases: 250 full pages cached.
 *   2. A filler without token ids takes the pool under the watermark; the demoter moves all 250
 *      pages to host memory (Stats, Lookup: gpu 0, host 4000 tokens).
 *   3. Worker B reserves prompt + question with reuse: the 250 pages are restored (cached_tokens
 *      4000). B then reads them back page by page from its mapped pool, 2 ms between pages,
 *      while this process appends and releases other prompts under pressure (each demoted, and
 *      later restored by an Append with reuse): every byte B reads is A's, and no page of the
 *      traffic's is one of B's.
 *   4. A Load of the prompt into device memory B registered gives A's rows exactly, from the GPU
 *      (B holds the pages) and from the host tier (pushed out again).
 *   5. The counters are exact (every demotion and restore counted), the Audit is clean, nothing
 *      restores, and SIGTERM exits 0.
 * This process never initialises CUDA (the workers fork from it). Exits 77 without a GPU.
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvp_gpu_check.h"
#include "kvp_gpu_test.h"
#include "kvp_harness.h"
#include "kvp_kernels_cuda.h"
#include "kvp_test_util.h"
#include "kvpool.h"

enum { L = 8, H = 8, D = 128, PS = 16, NP = 2048, ROW = D * 2 };
enum { PROMPT = 4010, QUESTION = 24, FULL = PROMPT / PS * PS, FULLP = FULL / PS };
enum { BPAGES = (PROMPT + QUESTION + PS - 1) / PS, MAXP = 1280 };
/* Pool pressure (watermark: NP / 2 free). PUSH: a filler under which every cached page is
 * demoted (free + cached stays under NP / 2); HOLD: the traffic's, so free pages stay under the
 * watermark while B holds its pages. */
enum { PUSH_PAGES = 1100, HOLD_PAGES = 900 };
/* The traffic: NTP prompts of TP tokens (64 pages) and a partial page of TSUF tokens of the
 * round's own (never keyed); round r appends prompt r % NTP, with reuse from round NTP on. */
enum { NTP = 16, TP = 1024, TSUF = 8, TT = TP + TSUF, MIN_ROUNDS = 2 * NTP, MAX_ROUNDS = 20000 };
#define SLOT_BYTES    ((uint64_t)L * 2 * PS * H * ROW) /* a page, every layer, K and V: 512 KiB */
#define HOST_SLOTS    ((1ull << 30) / SLOT_BYTES)      /* cache.host_bytes=1GiB */
#define ROWS_BYTES(n) ((size_t)L * 2 * (n)*H * ROW)

static uint8_t *g_a; /* A's rows: [layer][K|V][token][head][D] of PROMPT tokens */

/* this process, its workers and its daemon: what a failing check (exit) cleans up */
static pid_t g_parent, g_pa, g_pb;
static kvp_daemon_t g_dmn;
static int g_dmn_up;

static void cleanup(void)
{
    if (getpid() != g_parent)
        return; /* a worker's exit */
    if (g_pa > 0)
        kill(g_pa, SIGKILL);
    if (g_pb > 0)
        kill(g_pb, SIGKILL);
    if (g_dmn_up) {
        kvp_daemon_dump_log(&g_dmn);
        kvp_daemon_stop(&g_dmn, SIGKILL);
    }
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {0, (long)ms * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- pipes between this process and worker B ------------------------------------------------ */

static void put(int fd, const void *p, size_t n)
{
    if (write(fd, p, n) != (ssize_t)n)
        FAIL("pipe write: %s", strerror(errno));
}

static void get(int fd, void *p, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t k = read(fd, (char *)p + got, n - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            FAIL("pipe read: the other process ended");
        got += (size_t)k;
    }
}

static void expect(int fd, char want)
{
    char b;
    get(fd, &b, 1);
    if (b != want)
        FAIL("pipe: got '%c', want '%c'", b, want);
}

/* 1 when byte `want` arrived (0: nothing yet), without blocking. */
static int arrived(int fd, char want)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 0) <= 0)
        return 0;
    expect(fd, want);
    return 1;
}

/* What B tells this process. */
typedef struct {
    uint64_t reserve_ns;   /* its Reserve with reuse (the restore included) */
    int32_t pages[BPAGES]; /* the pages it holds */
} b_reserved_t;

typedef struct {
    uint32_t passes, pages_read, pages_during; /* during: while the traffic ran */
    uint64_t load_ns;                          /* Load from the GPU */
} b_read_t;

/* ---- tokens, rows, tables ------------------------------------------------------------------- */

static void tokens_of(int32_t *t, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        t[i] = (int32_t)(1000 + (i * 7919u) % 32000u);
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

static kvp_client_t *connect_ns(const char *sock, const char *ns, int map_pool)
{
    kvp_client_opts_t o = {.socket_path = sock,
                           .ns = ns,
                           .lease_ms = 0,
                           .timeout_ms = 30000,
                           .map_pool = map_pool,
                           .cache_scope = "tier"};
    kvp_client_t *c = NULL;
    char err[256];
    if (kvp_client_connect(&o, &c, err, sizeof(err)))
        FAIL("connect %s: %s", ns, err);
    if (map_pool) {
        KV(c, kvp_client_cuda_map_pool(c));
        const kvp_pool_info_t *pi = kvp_client_pool_info(c);
        if (pi->num_layers != L || pi->num_pages != NP || pi->page_size != PS ||
            pi->num_kv_heads != H || pi->head_dim != D || pi->elem_bytes != 2 ||
            pi->num_devices != 1 || pi->backend != 1)
            FAIL("%s: not the pool this test started", ns);
        /* a page's K (or V) of a layer is PS * H * D contiguous elements (NHD or HND) */
        if ((PS - 1) * pi->stride_n + (H - 1) * pi->stride_h + D != PS * H * D ||
            pi->stride_page < PS * H * D)
            FAIL("%s: unexpected strides", ns);
    }
    return c;
}

/* ---- worker A: the writer ------------------------------------------------------------------- */

/* Queues the fused appends of every layer of A's rows (PROMPT tokens) for the one-sequence
 * table tb on s; *herr (pinned) receives the kernels' error word once s is synchronized. */
static void append_prompt(kvp_client_t *c, const table_t *tb, cudaStream_t s, int32_t **herr)
{
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    uint8_t *pool = kvp_client_pool_base(c, 0);
    const size_t src_bytes = ROWS_BYTES(PROMPT);
    int32_t *dtab, *derr, *htab;
    uint8_t *dsrc, *hsrc;
    CK(cudaMalloc((void **)&dtab, 4 * (MAXP + 8)));
    CK(cudaMalloc((void **)&derr, 4));
    CK(cudaMalloc((void **)&dsrc, src_bytes));
    CK(cudaMallocHost((void **)&htab, 4 * (MAXP + 8)));
    CK(cudaMallocHost((void **)&hsrc, src_bytes));
    CK(cudaMallocHost((void **)herr, 4));
    htab[0] = tb->indptr[0], htab[1] = tb->indptr[1];
    htab[2] = tb->last[0];
    htab[3] = tb->aip[0], htab[4] = tb->aip[1];
    memcpy(htab + 5, tb->indices, 4 * (size_t)tb->indptr[1]);
    memcpy(hsrc, g_a, src_bytes); /* the same layout: [layer][K|V][token][head][D] */
    CK(cudaMemsetAsync(derr, 0, 4, s));
    CK(cudaMemcpyAsync(dtab, htab, 4 * (5 + (size_t)tb->indptr[1]), cudaMemcpyHostToDevice, s));
    CK(cudaMemcpyAsync(dsrc, hsrc, src_bytes, cudaMemcpyHostToDevice, s));
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
        const uint8_t *sk = dsrc + (size_t)l * 2 * PROMPT * H * ROW;
        kvp_append_src_t as = {.key = sk,
                               .value = sk + (size_t)PROMPT * H * ROW,
                               .k_stride_n = H * D,
                               .k_stride_h = D,
                               .v_stride_n = H * D,
                               .v_stride_h = D};
        if (kvp_append_paged_kv_cache_fused_cuda(&kv, &as, dtab + 3, PROMPT, derr, s))
            FAIL("append layer %u: %s", l, kvp_last_cuda_error());
    }
    CK(cudaMemcpyAsync(*herr, derr, 4, cudaMemcpyDeviceToHost, s));
    /* the buffers stay until the process exits */
}

static void worker_a(const char *sock)
{
    kvp_client_t *c = connect_ns(sock, "writer", 1);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    if (kvp_cuda_kernels_preload())
        FAIL("preload: %s", kvp_last_cuda_error());
    static int32_t tok[PROMPT];
    tokens_of(tok, PROMPT);
    uint64_t id = 1;
    uint32_t n = PROMPT;
    kvp_cache_opts_t co = {.token_ids = tok, .priority = -1};
    table_t tb;
    table_init(&tb);
    KV(c, kvp_client_reserve_cached(c, &id, &n, 1, &co, &tb.t));
    if (tb.t.nnz != PROMPT || tb.indptr[1] != (PROMPT + PS - 1) / PS)
        FAIL("A's reserve: nnz %u, %d pages", tb.t.nnz, tb.indptr[1]);
    int32_t *herr;
    append_prompt(c, &tb, s, &herr);
    uint32_t pages = 0;
    KV(c, kvp_client_cuda_commit_ex(c, &id, 1, s, &pages, NULL));
    if (pages != FULLP)
        FAIL("A's commit covers %u pages (want %u)", pages, FULLP);
    CK(cudaStreamSynchronize(s));
    if (*herr)
        FAIL("A's appends skipped rows: %s", kvp_errname(*herr));
    /* published once the daemon saw the event: then every full page is found on the GPU */
    uint32_t len = PROMPT, gpu = 0, host = 99;
    for (uint64_t t0 = now_ns(); now_ns() - t0 < 20000000000ull; sleep_ms(1)) {
        KV(c, kvp_client_lookup_tiers(c, tok, &len, 1, NULL, NULL, &gpu, &host));
        if (gpu)
            break;
    }
    if (gpu != FULL || host != 0)
        FAIL("A's prompt after its commit: gpu %u host %u tokens (want %u, 0)", gpu, host, FULL);
    uint32_t released = 0;
    KV(c, kvp_client_release(c, &id, 1, &released));
    kvp_client_close(c);
    exit(released == 1 ? 0 : 1);
}

/* ---- worker B: the slow reader -------------------------------------------------------------- */

/* Page `page` of B's table, the prompt's page p, every layer, K and V, read from the mapped pool
 * into hb (SLOT_BYTES, pinned) and checked against A's rows. */
static void read_page(kvp_client_t *c, cudaStream_t s, uint8_t *hb, int32_t page, uint32_t p)
{
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    const uint8_t *pool = kvp_client_pool_base(c, 0);
    const size_t blk = (size_t)PS * H * D * 2;
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++) {
            size_t off = l * pi->layer_bytes + (kv ? pi->v_offset_bytes : 0) +
                         (size_t)page * (size_t)pi->stride_page * 2;
            CK(cudaMemcpyAsync(hb + ((size_t)l * 2 + (size_t)kv) * blk, pool + off, blk,
                               cudaMemcpyDeviceToHost, s));
        }
    CK(cudaStreamSynchronize(s));
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++)
            for (uint32_t i = 0; i < PS; i++)
                for (uint32_t hh = 0; hh < H; hh++) {
                    const uint8_t *got =
                        hb + ((size_t)l * 2 + (size_t)kv) * blk +
                        ((size_t)i * (size_t)pi->stride_n + (size_t)hh * (size_t)pi->stride_h) * 2;
                    if (memcmp(got, row_at(g_a, PROMPT, l, kv, p * PS + i, hh), ROW))
                        FAIL("B's page %d (prompt page %u), token %u layer %u %s head %u: not "
                             "A's bytes",
                             page, p, p * PS + i, l, kv ? "V" : "K", hh);
                }
}

/* Loads the prompt into B's device buffer (first filled with byte `fill`), copies it back into
 * hbuf and checks it: A's rows for tokens [0, FULL), `fill` after. Returns the Load's time. */
static uint64_t load_and_check(kvp_client_t *c, cudaStream_t s, const int32_t *tok, uint32_t bid,
                               uint8_t *dbuf, uint8_t *hbuf, uint8_t fill, uint32_t want_host)
{
    const size_t bytes = ROWS_BYTES(PROMPT), span = (size_t)PROMPT * H * ROW;
    CK(cudaMemsetAsync(dbuf, fill, bytes, s));
    CK(cudaStreamSynchronize(s));
    kvp_source_t dst = {.buffer_id = bid};
    dst.k_offset = 0;
    dst.v_offset = span;
    dst.k_stride_n = dst.v_stride_n = (uint64_t)H * ROW;
    dst.k_stride_h = dst.v_stride_h = ROW;
    dst.layer_stride = 2 * span;
    kvp_load_t ld = {0};
    uint64_t t0 = now_ns();
    KV(c, kvp_client_load(c, tok, PROMPT, NULL, 0, &dst, 0, &ld));
    uint64_t ns = now_ns() - t0;
    if (ld.loaded_tokens != FULL || ld.host_tokens != want_host || ld.completed != 1)
        FAIL("Load: %u tokens, %u from host, completed %d (want %u, %u, 1)", ld.loaded_tokens,
             ld.host_tokens, ld.completed, FULL, want_host);
    CK(cudaMemcpyAsync(hbuf, dbuf, bytes, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++) {
            const uint8_t *got = hbuf + ((size_t)l * 2 + (size_t)kv) * span;
            const uint8_t *want = row_at(g_a, PROMPT, l, kv, 0, 0);
            for (uint32_t t = 0; t < FULL; t++)
                if (memcmp(got + (size_t)t * H * ROW, want + (size_t)t * H * ROW, H * ROW))
                    FAIL("Load (host %u): token %u layer %u %s: not A's bytes", want_host, t, l,
                         kv ? "V" : "K");
            for (size_t i = (size_t)FULL * H * ROW; i < span; i++)
                if (got[i] != fill)
                    FAIL("Load wrote past the loaded tokens: layer %u %s byte %zu", l,
                         kv ? "V" : "K", i);
        }
    return ns;
}

static void worker_b(const char *sock, int in, int out)
{
    kvp_client_t *c = connect_ns(sock, "reader", 1);
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    void *dbuf;
    uint32_t bid;
    KV(c, kvp_client_cuda_alloc_buffer(c, ROWS_BYTES(PROMPT), pi->device_ids[0], &dbuf, &bid, 0));
    uint8_t *hbuf, *hpage;
    CK(cudaMallocHost((void **)&hbuf, ROWS_BYTES(PROMPT)));
    CK(cudaMallocHost((void **)&hpage, SLOT_BYTES));
    static int32_t tok[PROMPT + QUESTION];
    tokens_of(tok, PROMPT);
    for (uint32_t i = PROMPT; i < PROMPT + QUESTION; i++)
        tok[i] = (int32_t)(50000 + i);

    /* the restore: every full page of the prompt, from host memory */
    expect(in, 'R');
    uint64_t id = 7;
    uint32_t n = PROMPT + QUESTION;
    kvp_cache_opts_t co = {.token_ids = tok, .reuse = 1, .priority = -1};
    table_t tb;
    table_init(&tb);
    b_reserved_t rep;
    uint64_t t0 = now_ns();
    KV(c, kvp_client_reserve_cached(c, &id, &n, 1, &co, &tb.t));
    rep.reserve_ns = now_ns() - t0;
    if (tb.cached[0] != FULL || tb.t.nnz != PROMPT + QUESTION - FULL ||
        tb.aip[1] != PROMPT + QUESTION - FULL || tb.lens[0] != PROMPT + QUESTION ||
        tb.indptr[1] != BPAGES || tb.t.num_copies != 0)
        FAIL("B's reserve: cached %u nnz %u pages %d copies %u (want %u, %u, %u, 0)", tb.cached[0],
             tb.t.nnz, tb.indptr[1], tb.t.num_copies, FULL, PROMPT + QUESTION - FULL, BPAGES);
    static uint8_t seen[NP];
    for (uint32_t p = 0; p < BPAGES; p++) {
        if (tb.indices[p] < 0 || tb.indices[p] >= NP || seen[tb.indices[p]]++)
            FAIL("B's page %u is %d: out of range or twice", p, tb.indices[p]);
        rep.pages[p] = tb.indices[p];
    }
    put(out, &rep, sizeof(rep));

    /* the slow reads: pass after pass, 2 ms between pages, from the start of the traffic
     * until a pass that began after it ended */
    expect(in, 'T');
    b_read_t rd = {0};
    int done = 0;
    for (;;) {
        const int last = done;
        for (uint32_t p = 0; p < FULLP; p++) {
            read_page(c, s, hpage, tb.indices[p], p);
            rd.pages_read++;
            if (!done) {
                rd.pages_during++;
                done = arrived(in, 'D');
            }
            sleep_ms(2);
        }
        if (++rd.passes == 1)
            put(out, "P", 1);
        if (last)
            break;
    }

    /* a Load while B holds the pages: from the GPU; B's release waits until this process has
     * counted the traffic's moves (B's pages cached under its filler would be demoted too) */
    rd.load_ns = load_and_check(c, s, tok, bid, dbuf, hbuf, 0xA5, 0);
    expect(in, 'G');
    uint32_t released = 0;
    KV(c, kvp_client_release(c, &id, 1, &released));
    if (released != 1)
        FAIL("B's release: %u", released);
    put(out, &rd, sizeof(rd));

    /* pushed out again: a Load restores it from host memory */
    expect(in, 'L');
    uint64_t load_host_ns = load_and_check(c, s, tok, bid, dbuf, hbuf, 0x5A, FULL);
    put(out, &load_host_ns, sizeof(load_host_ns));
    KV(c, kvp_client_cuda_free_buffer(c, bid));
    KV(c, kvp_client_audit(c));
    kvp_client_close(c);
    exit(0);
}

/* ---- this process: pressure, traffic, the counters ------------------------------------------ */

#define EXPECT_EQ(what, got, want)                                                                 \
    do {                                                                                           \
        unsigned long long g_ = (got), w_ = (want);                                                \
        if (g_ != w_)                                                                              \
            FAIL("%s: %llu (want %llu)", what, g_, w_);                                            \
    } while (0)

static kvp_cache_stats_t stats(kvp_client_t *obs)
{
    kvp_cache_stats_t st;
    KV(obs, kvp_client_cache_stats(obs, &st));
    return st;
}

/* A's prompt, looked up: want_gpu tokens on the GPU, want_host after them in host memory. */
static void expect_tiers(kvp_client_t *c, const int32_t *tok_a, uint32_t want_gpu,
                         uint32_t want_host, const char *when)
{
    uint32_t len = PROMPT, gpu, host;
    KV(c, kvp_client_lookup_tiers(c, tok_a, &len, 1, NULL, NULL, &gpu, &host));
    if (gpu != want_gpu || host != want_host)
        FAIL("A's prompt %s: gpu %u host %u tokens (want %u, %u)", when, gpu, host, want_gpu,
             want_host);
}

typedef struct {
    kvp_client_t *c, *obs;
    const int32_t *tok;
    uint32_t len, gpu, host; /* the Lookup wanted */
    int settled;             /* and nothing demoting */
} where_t;

static int reached(void *arg)
{
    where_t *w = arg;
    kvp_cache_stats_t st;
    uint32_t gpu, host, len = w->len;
    if (w->settled && (kvp_client_cache_stats(w->obs, &st) || st.demoting))
        return 0;
    if (kvp_client_lookup_tiers(w->c, w->tok, &len, 1, NULL, NULL, &gpu, &host))
        return 0;
    return gpu == w->gpu && host == w->host;
}

static int host_ready(void *arg)
{
    kvp_cache_stats_t st;
    return !kvp_client_cache_stats(arg, &st) && st.host_slots == HOST_SLOTS;
}

static int quiet(void *arg)
{
    kvp_cache_stats_t st;
    return !kvp_client_cache_stats(arg, &st) && st.cached_pages == 0 && st.demoting == 0 &&
           st.restoring == 0;
}

/* Moves A's prompt out of the GPU pool: a filler of PUSH_PAGES without token ids takes the free
 * pages under the watermark, so the demoter moves every cached page; waits until the prompt is
 * all in host memory and nothing demotes, then releases the filler. */
static void push_out(kvp_client_t *c, kvp_client_t *obs, const int32_t *tok_a)
{
    uint64_t seq = 90001;
    uint32_t n = PUSH_PAGES * PS, released = 0;
    KV(c, kvp_client_reserve(c, &seq, &n, 1, NULL));
    where_t w = {c, obs, tok_a, PROMPT, 0, FULL, 1};
    if (!kvp_wait_until(reached, &w, 20000)) {
        EXPECT_EQ("demoting after a push", stats(obs).demoting, 0);
        expect_tiers(c, tok_a, 0, FULL, "after a push");
    }
    KV(c, kvp_client_release(c, &seq, 1, &released));
    EXPECT_EQ("the filler's release", released, 1);
}

/* B's pages, which no other call may be handed. */
static uint8_t g_b_holds[NP];

static void check_disjoint(const table_t *tb, const char *what, uint32_t r)
{
    for (int32_t i = 0; i < tb->indptr[1]; i++)
        if (tb->indices[i] < 0 || tb->indices[i] >= NP || g_b_holds[tb->indices[i]])
            FAIL("%s (round %u) was given page %d, which B holds", what, r, tb->indices[i]);
}

static void traffic_tokens(int32_t *tok, uint32_t k, uint32_t r)
{
    for (uint32_t i = 0; i < TP; i++)
        tok[i] = (int32_t)(2000000 + k * 10000 + i);
    for (uint32_t i = 0; i < TSUF; i++)
        tok[TP + i] = (int32_t)(3000000 + r * TSUF + i);
}

/* Round r: prompt r % NTP appended by the daemon (from the memfd src), with reuse; from round
 * NTP on the prompt is waited for in host memory first, so the Append restores its 64 pages.
 * Then released: under the watermark, the demoter moves it out again. */
static void traffic_round(kvp_client_t *c, const kvp_source_t *src, uint32_t r)
{
    int32_t tok[TT];
    const uint32_t k = r % NTP, reuse = r >= NTP ? TP : 0;
    traffic_tokens(tok, k, r);
    if (reuse) {
        where_t w = {c, NULL, tok, TP, 0, TP, 0};
        if (!kvp_wait_until(reached, &w, 10000))
            FAIL("round %u: prompt %u not in host memory", r, k);
    }
    uint64_t seq = 1000 + r;
    uint32_t n = TT, released = 0;
    kvp_cache_opts_t co = {.token_ids = tok, .reuse = 1, .priority = -1};
    table_t tb;
    table_init(&tb);
    KV(c, kvp_client_append_cached(c, &seq, &n, 1, src, &co, &tb.t));
    if (tb.cached[0] != reuse || tb.t.nnz != TT - reuse || tb.indptr[1] != (TT + PS - 1) / PS)
        FAIL("round %u: cached %u nnz %u pages %d (want %u, %u, %u)", r, tb.cached[0], tb.t.nnz,
             tb.indptr[1], reuse, TT - reuse, (TT + PS - 1) / PS);
    check_disjoint(&tb, "the traffic", r);
    KV(c, kvp_client_release(c, &seq, 1, &released));
    EXPECT_EQ("a round's release", released, 1);
}

int main(void)
{
    if (kvp_gpu_count() < 1) {
        printf("no usable GPU: skipped\n");
        return 77;
    }
    g_parent = getpid();
    atexit(cleanup);
    g_a = malloc(ROWS_BYTES(PROMPT));
    kvp_rng_t rng;
    kvp_rng_seed(&rng, 0xa11ce);
    kvp_rng_fill(&rng, g_a, ROWS_BYTES(PROMPT));
    static int32_t tok_a[PROMPT];
    tokens_of(tok_a, PROMPT);

    /* clang-format off */
    const char *args[] = {"--backend", "cuda", "--num-layers", "8", "--num-pages", "2048",
                          "--page-size", "16", "--num-kv-heads", "8", "--head-dim", "128",
                          "--dtype", "fp16", "--set", "cache.host_bytes=1GiB",
                          "--set", "cache.host_chunk_bytes=64MiB",
                          "--set", "cache.demote_free_pct=50", NULL};
    /* clang-format on */
    if (kvp_daemon_start(&g_dmn, args))
        FAIL("kvpoold (cuda, host tier) did not start");
    g_dmn_up = 1;
    signal(SIGPIPE, SIG_IGN); /* a peer gone: its pipe's write fails, the check says so */

    /* the workers first: neither holds this process's connections; A holds no pipe of B's */
    if ((g_pa = fork()) == 0) {
        alarm(240); /* a worker that waits on a dead peer fails instead of hanging */
        worker_a(g_dmn.sock);
    }
    int to_b[2], from_b[2];
    if (pipe(to_b) || pipe(from_b))
        FAIL("pipe");
    if ((g_pb = fork()) == 0) {
        close(to_b[1]);
        close(from_b[0]);
        alarm(240);
        worker_b(g_dmn.sock, to_b[0], from_b[1]);
    }
    close(to_b[0]);
    close(from_b[1]);
    const int tb_fd = to_b[1], fb_fd = from_b[0];
    if (g_pa < 0 || g_pb < 0)
        FAIL("fork");

    kvp_client_t *c = connect_ns(g_dmn.sock, "driver", 0);
    kvp_client_opts_t oo = {.socket_path = g_dmn.sock, .observer = 1, .timeout_ms = 30000};
    kvp_client_t *obs = NULL;
    char err[256];
    if (kvp_client_connect(&oo, &obs, err, sizeof(err)))
        FAIL("observer: %s", err);
    if (!kvp_wait_until(host_ready, obs, 30000))
        EXPECT_EQ("host slots pinned", stats(obs).host_slots, HOST_SLOTS);
    kvp_cache_stats_t st = stats(obs);
    EXPECT_EQ("host_slot_bytes", st.host_slot_bytes, SLOT_BYTES);
    EXPECT_EQ("host_bytes_total", st.host_bytes_total, 1ull << 30);

    /* 1. A's prompt, cached on the GPU */
    int sa;
    if (waitpid(g_pa, &sa, 0) != g_pa || !WIFEXITED(sa) || WEXITSTATUS(sa))
        FAIL("worker A failed (status %d)", sa);
    g_pa = 0;
    expect_tiers(c, tok_a, FULL, 0, "after A's commit");

    /* 2. pushed out to host memory by the demoter */
    push_out(c, obs, tok_a);
    expect_tiers(c, tok_a, 0, FULL, "after the push");
    st = stats(obs);
    EXPECT_EQ("host_pages after the push", st.host_pages, FULLP);
    EXPECT_EQ("demotions after the push", st.demotions_total, FULLP);
    EXPECT_EQ("offload bytes after the push", st.offload_bytes_total, FULLP * SLOT_BYTES);
    const uint64_t offload_us = st.offload_us_total;

    /* 3. B's Reserve with reuse restores it */
    put(tb_fd, "R", 1);
    b_reserved_t rep;
    get(fb_fd, &rep, sizeof(rep));
    for (uint32_t p = 0; p < BPAGES; p++)
        g_b_holds[rep.pages[p]] = 1; /* B checked them: in range, distinct */
    st = stats(obs);
    EXPECT_EQ("host_pages after B's restore", st.host_pages, 0);
    EXPECT_EQ("promotions after B's restore", st.promotions_total, FULLP);
    EXPECT_EQ("restoring after B's restore", st.restoring, 0);
    EXPECT_EQ("restore bytes", st.restore_bytes_total, FULLP * SLOT_BYTES);
    const uint64_t restore_us = st.restore_us_total;
    expect_tiers(c, tok_a, FULL, 0, "after B's restore");

    /* ... and reads it slowly while other prompts are appended, demoted and restored */
    uint64_t hold = 90002;
    uint32_t hn = HOLD_PAGES * PS, released = 0;
    table_t ht;
    table_init(&ht);
    KV(c, kvp_client_reserve(c, &hold, &hn, 1, &ht.t));
    check_disjoint(&ht, "the traffic's filler", 0);
    void *sbuf;
    uint32_t sbid;
    KV(c, kvp_client_alloc_host_buffer(c, ROWS_BYTES(TT), &sbuf, &sbid));
    kvp_rng_fill(&rng, sbuf, ROWS_BYTES(TT));
    kvp_source_t src = {.buffer_id = sbid};
    src.k_offset = 0;
    src.v_offset = (uint64_t)TT * H * ROW;
    src.k_stride_n = src.v_stride_n = (uint64_t)H * ROW;
    src.k_stride_h = src.v_stride_h = ROW;
    src.layer_stride = 2 * (uint64_t)TT * H * ROW;
    put(tb_fd, "T", 1);
    uint64_t t_traffic = now_ns();
    int b_pass = 0;
    uint32_t rounds = 0;
    for (; rounds < MAX_ROUNDS && (rounds < MIN_ROUNDS || !b_pass); rounds++) {
        traffic_round(c, &src, rounds);
        if (!b_pass)
            b_pass = arrived(fb_fd, 'P');
    }
    if (!b_pass)
        FAIL("B did not finish a pass within %u rounds", rounds);
    put(tb_fd, "D", 1);
    t_traffic = now_ns() - t_traffic;
    if (!kvp_wait_until(quiet, obs, 20000))
        FAIL("after the traffic: %u cached, %u demoting, %u restoring", stats(obs).cached_pages,
             stats(obs).demoting, stats(obs).restoring);
    st = stats(obs);
    const uint64_t traffic_restored = (uint64_t)(rounds - NTP) * (TP / PS);
    EXPECT_EQ("demotions after the traffic", st.demotions_total,
              FULLP + (uint64_t)rounds * (TP / PS));
    EXPECT_EQ("promotions after the traffic", st.promotions_total, FULLP + traffic_restored);
    EXPECT_EQ("host_pages after the traffic", st.host_pages, NTP * (TP / PS));
    EXPECT_EQ("host evictions", st.host_evictions_total, 0);
    KV(c, kvp_client_release(c, &hold, 1, &released));
    EXPECT_EQ("the traffic filler's release", released, 1);
    put(tb_fd, "G", 1);
    b_read_t rd;
    get(fb_fd, &rd, sizeof(rd)); /* B's last pass, its Load from the GPU, its release */

    /* 4. out again: B's Load restores it */
    push_out(c, obs, tok_a);
    EXPECT_EQ("host_pages after the second push", stats(obs).host_pages, NTP * (TP / PS) + FULLP);
    put(tb_fd, "L", 1);
    uint64_t load_host_ns;
    get(fb_fd, &load_host_ns, sizeof(load_host_ns));
    int sb;
    if (waitpid(g_pb, &sb, 0) != g_pb || !WIFEXITED(sb) || WEXITSTATUS(sb))
        FAIL("worker B failed (status %d)", sb);
    g_pb = 0;

    /* 5. every move counted, nothing in flight, the audit clean, a clean exit */
    st = stats(obs);
    EXPECT_EQ("restoring", st.restoring, 0);
    EXPECT_EQ("demoting", st.demoting, 0);
    EXPECT_EQ("demotions", st.demotions_total, 2 * FULLP + (uint64_t)rounds * (TP / PS));
    EXPECT_EQ("promotions", st.promotions_total, 2 * FULLP + traffic_restored);
    EXPECT_EQ("restore bytes", st.restore_bytes_total, st.promotions_total * SLOT_BYTES);
    EXPECT_EQ("offload bytes", st.offload_bytes_total, st.demotions_total * SLOT_BYTES);
    EXPECT_EQ("host_pages", st.host_pages, NTP * (TP / PS));
    EXPECT_EQ("host evictions", st.host_evictions_total, 0);
    expect_tiers(c, tok_a, FULL, 0, "after the Load");
    int ok = 0;
    char msg[KVP_CLIENT_AUDIT_MESSAGE_BYTES];
    KV(obs, kvp_client_audit_report(obs, &ok, msg, sizeof(msg)));
    if (!ok)
        FAIL("audit: %s", msg);
    kvp_client_close(c);
    kvp_client_close(obs);
    g_dmn_up = 0;
    int rc = kvp_daemon_stop(&g_dmn, SIGTERM);
    if (rc)
        FAIL("kvpoold exited %d", rc);

    const double bytes = (double)FULLP * SLOT_BYTES;
    printf("restore_pages=%u\n", FULLP);
    printf("restore_bytes=%llu\n", (unsigned long long)(FULLP * SLOT_BYTES));
    printf("restore_reserve_ms=%.2f\n", (double)rep.reserve_ns / 1e6);
    printf("restore_reserve_gbps=%.2f\n", bytes / (double)rep.reserve_ns);
    printf("restore_copy_us=%llu\n", (unsigned long long)restore_us);
    printf("offload_copy_us=%llu\n", (unsigned long long)offload_us);
    printf("traffic_rounds=%u traffic_ms=%.0f traffic_restored_pages=%llu\n", rounds,
           (double)t_traffic / 1e6, (unsigned long long)traffic_restored);
    printf("reader_passes=%u reader_pages=%u reader_pages_during_traffic=%u\n", rd.passes,
           rd.pages_read, rd.pages_during);
    printf("load_gpu_ms=%.2f load_host_ms=%.2f load_bytes=%llu\n", (double)rd.load_ns / 1e6,
           (double)load_host_ns / 1e6, (unsigned long long)(FULLP * SLOT_BYTES));
    printf("test_tier_gpu: ok\n");
    return 0;
}
