/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_daemon.c - integration: a real kvpoold process, real clients (libkvpool and raw frames)
 * over its Unix socket, real fd passing and a real shared pool. Each test starts its own
 * daemon with a small geometry and stops it with SIGTERM, expecting exit 0.
 *
 * Pool geometry of every test: 2 layers, 64 pages of 4 tokens, 2 KV heads, head_dim 16, fp16
 * (a row is 32 bytes), NHD combined unless a test says otherwise.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvp_geom.h"
#include "kvp_harness.h"
#include "kvp_kernels.h"
#include "kvp_raw.h"
#include "kvp_sock.h"
#include "kvp_test_util.h"
#include "kvp_wire.h"
#include "kvpool.h"

#define L     2
#define PAGES 64
#define PS    4
#define H     2
#define D     16
#define ROW   (D * 2)

static const char *const GEOM_ARGS[] = {"--backend",
                                        "host",
                                        "--num-layers",
                                        "2",
                                        "--num-pages",
                                        "64",
                                        "--page-size",
                                        "4",
                                        "--num-kv-heads",
                                        "2",
                                        "--head-dim",
                                        "16",
                                        "--dtype",
                                        "fp16",
                                        "--set",
                                        "limits.dedup_window=64",
                                        NULL};

static kvp_daemon_t DMN;

static void start(void)
{
    ck_assert_msg(kvp_daemon_start(&DMN, GEOM_ARGS) == 0, "kvpoold did not start");
}

static void stop_expect_clean(void)
{
    int code = kvp_daemon_stop(&DMN, SIGTERM);
    ck_assert_msg(code == 0, "kvpoold exited with %d", code);
}

static kvp_client_t *connect_ns(const char *ns, uint32_t lease_ms)
{
    kvp_client_opts_t o = {.socket_path = DMN.sock,
                           .ns = ns,
                           .client_name = "itest",
                           .lease_ms = lease_ms,
                           .timeout_ms = 10000,
                           .map_pool = 1};
    kvp_client_t *c = NULL;
    char err[256] = "";
    int rc = kvp_client_connect(&o, &c, err, sizeof(err));
    ck_assert_msg(rc == 0, "connect: %s (%s)", err, kvp_errname(rc));
    return c;
}

static void audit_ok(kvp_client_t *c)
{
    int rc = kvp_client_audit(c);
    ck_assert_msg(rc == 0, "audit: %s", kvp_client_last_error(c));
}

/* Page-table arrays big enough for every test. */
typedef struct {
    int32_t indptr[65], indices[PAGES * 4], last[64], aindptr[65], lens[64];
    uint32_t copies[2 * PAGES];
    kvp_page_table_t t;
} table_t;

static kvp_page_table_t *table(table_t *tb)
{
    memset(tb, 0, sizeof(*tb));
    tb->t = (kvp_page_table_t){.kv_indptr = tb->indptr,
                               .kv_indices = tb->indices,
                               .kv_last_page_len = tb->last,
                               .append_indptr = tb->aindptr,
                               .seq_lens = tb->lens,
                               .copies = tb->copies,
                               .cap_batch = 65,
                               .cap_indices = PAGES * 4,
                               .cap_copies = PAGES};
    return &tb->t;
}

/* Byte offset of (layer, page, kv, slot, head) from the pool info the daemon sent. */
static uint64_t pool_off(const kvp_pool_info_t *pi, uint32_t l, uint32_t page, int kv,
                         uint32_t slot, uint32_t h)
{
    return l * pi->layer_bytes + (kv ? pi->v_offset_bytes : 0) +
           ((uint64_t)page * pi->stride_page + (uint64_t)slot * pi->stride_n +
            (uint64_t)h * pi->stride_h) *
               pi->elem_bytes;
}

/* Staging layout used by the tests: per layer K [nnz, H, D] then V [nnz, H, D]. */
static kvp_source_t staging_source(uint32_t buf_id, uint32_t nnz)
{
    return (kvp_source_t){.buffer_id = buf_id,
                          .k_offset = 0,
                          .v_offset = (uint64_t)nnz * H * ROW,
                          .k_stride_n = H * ROW,
                          .k_stride_h = ROW,
                          .v_stride_n = H * ROW,
                          .v_stride_h = ROW,
                          .layer_stride = 2ull * nnz * H * ROW};
}

/* Checks every appended token of the batch against the staging rows, through the client's
 * own mapping of the pool. */
static void check_landed(kvp_client_t *c, const kvp_page_table_t *t, const uint8_t *stage,
                         const kvp_source_t *src)
{
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    const uint8_t *pool = kvp_client_pool_base(c, 0);
    ck_assert_ptr_nonnull(pool);
    for (uint32_t b = 0; b < t->batch_size; b++)
        for (int32_t i = t->append_indptr[b]; i < t->append_indptr[b + 1]; i++) {
            uint32_t pos = (uint32_t)(t->seq_lens[b] - (t->append_indptr[b + 1] - i));
            uint32_t page = (uint32_t)t->kv_indices[t->kv_indptr[b] + pos / PS];
            for (uint32_t l = 0; l < L; l++)
                for (uint32_t h = 0; h < H; h++)
                    for (int kv = 0; kv < 2; kv++) {
                        const uint8_t *want = stage + l * src->layer_stride +
                                              (kv ? src->v_offset : src->k_offset) +
                                              (uint64_t)i * H * ROW + h * ROW;
                        const uint8_t *got = pool + pool_off(pi, l, page, kv, pos % PS, h);
                        KVP_CHECK(memcmp(got, want, ROW) == 0,
                                  "batch %u token %d layer %u head %u %s differs", b, i, l, h,
                                  kv ? "V" : "K");
                    }
        }
}

/* A worker process: connects in its namespace, appends 3 sequences through the daemon in two
 * rounds, checks the bytes through its own mapping. Exits 0 when all is right. */
static void worker(const char *ns, uint64_t seed)
{
    kvp_client_t *c = connect_ns(ns, 0);
    kvp_rng_t r;
    kvp_rng_seed(&r, seed);
    uint32_t nnz_max = 40;
    size_t bytes = (size_t)L * 2 * nnz_max * H * ROW;
    void *stage;
    uint32_t buf;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, bytes, &stage, &buf), 0);
    uint64_t ids[3] = {1, 2, 3};
    for (int round = 0; round < 2; round++) {
        uint32_t toks[3] = {round ? 1u : 9u, round ? 1u : 5u, round ? 1u : 13u};
        uint32_t nnz = toks[0] + toks[1] + toks[2];
        kvp_rng_fill(&r, stage, bytes);
        kvp_source_t src = staging_source(buf, nnz);
        table_t tb;
        ck_assert_int_eq(kvp_client_append(c, ids, toks, 3, &src, table(&tb)), 0);
        ck_assert_uint_eq(tb.t.nnz, nnz);
        check_landed(c, &tb.t, stage, &src);
    }
    audit_ok(c);
    kvp_client_close(c);
}

START_TEST(two_worker_processes_append_in_their_namespaces)
{
    start();
    pid_t p[2];
    for (int i = 0; i < 2; i++) {
        p[i] = fork();
        if (p[i] == 0) {
            worker(i ? "engine-b" : "engine-a", 100 + (uint64_t)i);
            _exit(0);
        }
    }
    for (int i = 0; i < 2; i++) {
        int st;
        ck_assert_int_eq(waitpid(p[i], &st, 0), p[i]);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker %d failed", i);
    }
    /* both namespaces had lease 0: everything went back */
    kvp_client_t *c = connect_ns("observer", 0);
    kvp_stats_summary_t st;
    ck_assert_int_eq(kvp_client_stats(c, &st), 0);
    ck_assert_uint_eq(st.num_seqs, 0);
    ck_assert_uint_eq(st.free_pages, PAGES);
    audit_ok(c);
    kvp_client_close(c);
    stop_expect_clean();
}
END_TEST

START_TEST(reserve_then_in_process_append_gives_the_same_bytes)
{
    start();
    kvp_client_t *c = connect_ns("eng", 0);
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    uint8_t *pool = kvp_client_pool_base(c, 0);
    uint32_t nnz = 11;
    size_t bytes = (size_t)L * 2 * nnz * H * ROW;
    void *stage;
    uint32_t buf;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, bytes, &stage, &buf), 0);
    kvp_rng_t r;
    kvp_rng_seed(&r, 9);
    kvp_rng_fill(&r, stage, bytes);
    kvp_source_t src = staging_source(buf, nnz);
    /* sequence 1 through the daemon, sequence 2 reserved and appended here */
    uint64_t id1 = 1, id2 = 2;
    table_t a, b;
    ck_assert_int_eq(kvp_client_append(c, &id1, &nnz, 1, &src, table(&a)), 0);
    ck_assert_int_eq(kvp_client_reserve(c, &id2, &nnz, 1, table(&b)), 0);
    ck_assert_uint_eq(b.t.num_copies, 0);
    int32_t bi[11], pos[11];
    ck_assert_int_eq(
        kvp_get_batch_indices_positions_cpu(b.t.append_indptr, b.t.seq_lens, 1, nnz, bi, pos), 0);
    for (uint32_t l = 0; l < L; l++) {
        kvp_paged_kv_t kv = {.k_data = pool + l * pi->layer_bytes,
                             .v_data = pool + l * pi->layer_bytes + pi->v_offset_bytes,
                             .elem_bytes = pi->elem_bytes,
                             .num_pages = pi->num_pages,
                             .page_size = pi->page_size,
                             .num_heads = pi->heads_per_device,
                             .head_dim = pi->head_dim,
                             .stride_page = pi->stride_page,
                             .stride_n = pi->stride_n,
                             .stride_h = pi->stride_h,
                             .batch_size = 1,
                             .kv_indptr = b.t.kv_indptr,
                             .kv_indices = b.t.kv_indices,
                             .kv_last_page_len = b.t.kv_last_page_len};
        const uint8_t *base = (const uint8_t *)stage + l * src.layer_stride;
        kvp_append_src_t as = {.key = base,
                               .value = base + src.v_offset,
                               .k_stride_n = H * D,
                               .k_stride_h = D,
                               .v_stride_n = H * D,
                               .v_stride_h = D};
        ck_assert_int_eq(kvp_append_paged_kv_cache_cpu(&kv, &as, bi, pos, nnz), 0);
    }
    /* the two sequences hold the same bytes in their pages */
    for (uint32_t t = 0; t < nnz; t++)
        for (uint32_t l = 0; l < L; l++)
            for (int kv = 0; kv < 2; kv++)
                for (uint32_t h = 0; h < H; h++) {
                    uint32_t p1 = (uint32_t)a.t.kv_indices[t / PS];
                    uint32_t p2 = (uint32_t)b.t.kv_indices[t / PS];
                    ck_assert_int_eq(memcmp(pool + pool_off(pi, l, p1, kv, t % PS, h),
                                            pool + pool_off(pi, l, p2, kv, t % PS, h), ROW),
                                     0);
                }
    audit_ok(c);
    kvp_client_close(c);
    stop_expect_clean();
}
END_TEST

/* ---- a model-checked random run through the client ------------------------------------- */

typedef struct {
    int live;
    uint64_t id;
    uint32_t len;
} mseq_t;

START_TEST(fork_truncate_release_agree_with_a_model)
{
    start();
    kvp_client_t *c = connect_ns("model", 0);
    mseq_t m[12] = {{0}};
    uint64_t next_id = 1;
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(77));
    uint32_t exhausted = 0;
    for (int step = 0; step < 400; step++) {
        int i = (int)kvp_rng_below(&r, 12);
        uint32_t op = kvp_rng_below(&r, 10);
        table_t tb;
        if (op < 5) {
            if (!m[i].live)
                m[i] = (mseq_t){0, next_id++, 0};
            uint32_t add = 1 + kvp_rng_below(&r, 20);
            int rc = kvp_client_reserve(c, &m[i].id, &add, 1, table(&tb));
            if (rc == KVP_ENOSPC) {
                exhausted++;
                continue;
            }
            ck_assert_msg(rc == 0, "reserve: %s", kvp_client_last_error(c));
            m[i].live = 1;
            m[i].len += add;
            ck_assert_int_eq(tb.t.seq_lens[0], (int)m[i].len);
            ck_assert_int_eq(tb.t.kv_indptr[1], (int)((m[i].len + PS - 1) / PS));
        } else if (op < 7 && m[i].live) {
            int j = (int)kvp_rng_below(&r, 12);
            if (m[j].live || j == i)
                continue;
            uint64_t cid = next_id++;
            ck_assert_int_eq(kvp_client_fork(c, m[i].id, cid), 0);
            m[j] = (mseq_t){1, cid, m[i].len};
        } else if (op < 9 && m[i].live) {
            uint32_t nl = kvp_rng_below(&r, m[i].len + 1);
            ck_assert_int_eq(kvp_client_truncate(c, m[i].id, m[i].len + 1), KVP_EINVAL);
            ck_assert_int_eq(kvp_client_truncate(c, m[i].id, nl), 0);
            m[i].len = nl;
        } else if (m[i].live) {
            uint32_t rel = 9;
            ck_assert_int_eq(kvp_client_release(c, &m[i].id, 1, &rel), 0);
            ck_assert_uint_eq(rel, 1);
            m[i].live = 0;
        }
        audit_ok(c);
        kvp_stats_summary_t st;
        ck_assert_int_eq(kvp_client_stats(c, &st), 0);
        uint32_t n = 0;
        uint64_t tokens = 0;
        for (int k = 0; k < 12; k++)
            if (m[k].live)
                n++, tokens += m[k].len;
        ck_assert_uint_eq(st.num_seqs, n);
        ck_assert_uint_eq(st.num_tokens, tokens);
        /* the page table of every live sequence has the model's length */
        for (int k = 0; k < 12; k++) {
            if (!m[k].live)
                continue;
            ck_assert_int_eq(kvp_client_page_table(c, &m[k].id, 1, table(&tb)), 0);
            ck_assert_int_eq(tb.t.seq_lens[0], (int)m[k].len);
        }
    }
    ck_assert_uint_gt(exhausted, 0);
    kvp_client_close(c);
    stop_expect_clean();
}
END_TEST

/* ---- bad input ---------------------------------------------------------------------------- */

/* Sends a Hello in namespace "raw" with this protocol version (the answer is read apart). */
static void raw_hello(kvp_raw_t *w, uint32_t version)
{
    kvpool_Request q = {.id = 1, .which_body = kvpool_Request_hello_tag};
    q.body.hello.protocol_version = version;
    snprintf(q.body.hello.namespace, sizeof(q.body.hello.namespace), "raw");
    kvp_raw_send(w, &q, NULL, 0);
}

START_TEST(bad_input_gets_its_exact_status_and_changes_nothing)
{
    start();
    kvp_client_t *c = connect_ns("eng", 0);
    kvp_client_t *other = connect_ns("other", 0);
    uint64_t id = 5;
    uint32_t n = 6;
    table_t tb;
    ck_assert_int_eq(kvp_client_reserve(c, &id, &n, 1, table(&tb)), 0);
    kvp_stats_summary_t before, after;
    ck_assert_int_eq(kvp_client_stats(c, &before), 0);

    /* unknown sequence; another namespace's sequence */
    uint64_t unknown = 999;
    ck_assert_int_eq(kvp_client_page_table(c, &unknown, 1, table(&tb)), KVP_ENOENT);
    ck_assert_int_eq(kvp_client_page_table(other, &id, 1, table(&tb)), KVP_ENOENT);
    ck_assert_int_eq(kvp_client_truncate(other, id, 1), KVP_ENOENT);
    ck_assert_int_eq(kvp_client_fork(other, id, 77), KVP_ENOENT);
    /* source outside the registered buffer */
    void *stage;
    uint32_t buf;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, 4096, &stage, &buf), 0);
    uint32_t toks = 40;
    kvp_source_t src = staging_source(buf, toks); /* needs 2*40*2*32*2 = 10 KiB */
    ck_assert_int_eq(kvp_client_append(c, &id, &toks, 1, &src, table(&tb)), KVP_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvp_client_last_error(c), "exceeds buffer"));
    /* zero and huge token counts */
    uint32_t zero = 0, huge = 2000000000u;
    src = staging_source(buf, 1);
    ck_assert_int_eq(kvp_client_append(c, &id, &zero, 1, &src, table(&tb)), KVP_EINVAL);
    ck_assert_int_eq(kvp_client_reserve(c, &id, &huge, 1, table(&tb)), KVP_ENOSPC);
    /* pool exhaustion: two sequences wanting 40 pages each; nothing half-allocated */
    uint64_t two[2] = {50, 51};
    uint32_t big[2] = {160, 160};
    ck_assert_int_eq(kvp_client_reserve(c, two, big, 2, table(&tb)), KVP_ENOSPC);
    ck_assert_ptr_nonnull(strstr(kvp_client_last_error(c), "pool exhausted"));
    ck_assert_int_eq(kvp_client_stats(c, &after), 0);
    ck_assert_uint_eq(after.used_pages, before.used_pages);
    ck_assert_uint_eq(after.num_seqs, before.num_seqs);

    /* raw frames: a request before Hello, wrong protocol version, garbage, fds */
    kvp_raw_t w;
    kvp_raw_open(&w, DMN.sock);
    kvpool_Response resp;
    kvpool_Request q = {.id = 3, .which_body = kvpool_Request_stats_tag};
    kvp_raw_send(&w, &q, NULL, 0);
    ck_assert_int_eq(kvp_raw_recv(&w, &resp), kvpool_Code_FAILED_PRECONDITION);
    ck_assert_uint_eq(resp.id, 3);
    raw_hello(&w, 99);
    ck_assert_int_eq(kvp_raw_recv(&w, &resp), kvpool_Code_FAILED_PRECONDITION);
    raw_hello(&w, KVP_PROTOCOL_VERSION);
    ck_assert_int_eq(kvp_raw_recv(&w, &resp), kvpool_Code_OK);
    /* garbage payload in a well-formed frame: an error, and the connection lives on */
    uint8_t garbage[12] = {8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    ck_assert_int_eq(kvp_sock_send_frame(w.fd, garbage, 12, NULL, 0, kvp_sock_deadline(2000)), 0);
    ck_assert_int_eq(kvp_raw_recv(&w, &resp), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(resp.status.message, "malformed"));
    /* an fd where none is expected */
    int memfd = memfd_create("x", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ck_assert_int_eq(ftruncate(memfd, 4096), 0);
    ck_assert_int_eq(fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    q = (kvpool_Request){.id = 4, .which_body = kvpool_Request_stats_tag};
    kvp_raw_send(&w, &q, &memfd, 1);
    ck_assert_int_eq(kvp_raw_recv(&w, &resp), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(resp.status.message, "fds"));
    /* none where one is */
    q = (kvpool_Request){.id = 5, .which_body = kvpool_Request_register_buffer_tag};
    q.body.register_buffer.size_bytes = 4096;
    kvp_raw_send(&w, &q, NULL, 0);
    ck_assert_int_eq(kvp_raw_recv(&w, &resp), kvpool_Code_INVALID_ARGUMENT);
    /* and with the fd it works */
    q.id = 6;
    kvp_raw_send(&w, &q, &memfd, 1);
    ck_assert_int_eq(kvp_raw_recv(&w, &resp), kvpool_Code_OK);
    close(memfd);
    /* a retried Reserve (same request id, even on a new connection of the namespace) gets the
     * first answer, byte for byte, and is applied once */
    {
        uint64_t rid = 42;
        uint32_t rtok = 5;
        kvp_batch_arrays_t rb = {.seq_ids = kvp_array(&rid, 8, 1, 1),
                                 .num_tokens = kvp_array(&rtok, 4, 1, 1)};
        q = (kvpool_Request){.id = 0x5151, .which_body = kvpool_Request_reserve_tag};
        q.body.reserve.has_batch = true;
        kvp_wire_batch_bind_encode(&q.body.reserve.batch, &rb);
        uint8_t first[4096];
        kvp_raw_send(&w, &q, NULL, 0);
        ck_assert_int_eq(kvp_raw_recv(&w, &resp), kvpool_Code_OK);
        ck_assert_uint_le(w.len, sizeof(first));
        uint32_t first_len = w.len;
        memcpy(first, w.rbuf, first_len);
        ck_assert_int_eq(w.arr[4][0], 5); /* seq_lens */
        kvp_raw_t w2;
        kvp_raw_open(&w2, DMN.sock);
        raw_hello(&w2, KVP_PROTOCOL_VERSION); /* the same namespace "raw" */
        ck_assert_int_eq(kvp_raw_recv(&w2, &resp), kvpool_Code_OK);
        kvp_raw_send(&w2, &q, NULL, 0);
        ck_assert_int_eq(kvp_raw_recv(&w2, &resp), kvpool_Code_OK);
        ck_assert_uint_eq(w2.len, first_len);
        ck_assert_int_eq(memcmp(w2.rbuf, first, first_len), 0);
        q = (kvpool_Request){.id = 0x5152, .which_body = kvpool_Request_get_page_table_tag};
        q.body.get_page_table.has_batch = true;
        kvp_wire_batch_bind_encode(&q.body.get_page_table.batch, &rb);
        kvp_raw_send(&w2, &q, NULL, 0);
        ck_assert_int_eq(kvp_raw_recv(&w2, &resp), kvpool_Code_OK);
        ck_assert_uint_eq(resp.body.get_page_table.table.batch_size, 1);
        ck_assert_int_eq(w2.last.seq_lens.count, 1);
        ck_assert_int_eq(w2.arr[4][0], 5); /* applied once, not 10 */
        q = (kvpool_Request){.id = 0x5153, .which_body = kvpool_Request_release_tag};
        q.body.release.has_batch = true;
        kvp_wire_batch_bind_encode(&q.body.release.batch, &rb);
        kvp_raw_send(&w2, &q, NULL, 0);
        ck_assert_int_eq(kvp_raw_recv(&w2, &resp), kvpool_Code_OK);
        ck_assert_uint_eq(resp.body.release.released, 1);
        kvp_raw_close(&w2);
    }
    /* still served after all that */
    q = (kvpool_Request){.id = 7, .which_body = kvpool_Request_ping_tag};
    kvp_raw_send(&w, &q, NULL, 0);
    ck_assert_int_eq(kvp_raw_recv(&w, &resp), kvpool_Code_OK);
    kvp_raw_close(&w);

    /* oversize frame: an error answer, then the connection is closed */
    kvp_raw_open(&w, DMN.sock);
    uint8_t hdr[4];
    kvp_frame_put_len(hdr, 0x7fffffffu);
    ck_assert_int_eq(write(w.fd, hdr, 4), 4);
    ck_assert_int_eq(kvp_raw_recv(&w, &resp), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(resp.status.message, "above max_frame_bytes"));
    ck_assert_int_eq(kvp_raw_recv(&w, &resp), -1); /* closed */
    kvp_raw_close(&w);
    /* truncated frame: half a frame, then hang up */
    kvp_raw_open(&w, DMN.sock);
    kvp_frame_put_len(hdr, 100);
    ck_assert_int_eq(write(w.fd, hdr, 4), 4);
    ck_assert_int_eq(write(w.fd, garbage, 10), 10);
    kvp_raw_close(&w);

    /* the daemon and the other clients noticed nothing */
    ck_assert_int_eq(kvp_client_ping(c, NULL), 0);
    ck_assert_int_eq(kvp_client_stats(c, &after), 0);
    ck_assert_uint_eq(after.used_pages, before.used_pages);
    ck_assert_uint_eq(after.num_seqs, before.num_seqs);
    audit_ok(c);
    kvp_client_close(other);
    kvp_client_close(c);
    stop_expect_clean();
}
END_TEST

/* A client that pipelines a request without fds and a RegisterBuffer with its memfd: the
 * daemon, stopped while both are sent, reads them in one recvmsg (the kernel glues the first
 * to the start of the second and stops after the one carrying the fd), and each frame must
 * still get exactly its own fds: the Ping none, the RegisterBuffer the memfd. (Under the old
 * first-byte rule the Ping got the fd and both were refused.) */
START_TEST(pipelined_frames_keep_their_own_fds)
{
    start();
    kvp_raw_t w;
    kvp_raw_open(&w, DMN.sock);
    kvpool_Response resp;
    raw_hello(&w, KVP_PROTOCOL_VERSION);
    ck_assert_int_eq(kvp_raw_recv(&w, &resp), kvpool_Code_OK);
    int memfd = memfd_create("pipelined", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ck_assert_int_ge(memfd, 0);
    ck_assert_int_eq(ftruncate(memfd, 4096), 0);
    ck_assert_int_eq(fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    for (int round = 0; round < 3; round++) {
        int st;
        ck_assert_int_eq(kill(DMN.pid, SIGSTOP), 0);
        ck_assert_int_eq(waitpid(DMN.pid, &st, WUNTRACED), DMN.pid);
        ck_assert(WIFSTOPPED(st));
        kvpool_Request q = {.id = 100 + 2 * (uint64_t)round, .which_body = kvpool_Request_ping_tag};
        kvp_raw_send(&w, &q, NULL, 0);
        q = (kvpool_Request){.id = 101 + 2 * (uint64_t)round,
                             .which_body = kvpool_Request_register_buffer_tag};
        q.body.register_buffer.size_bytes = 4096;
        kvp_raw_send(&w, &q, &memfd, 1);
        ck_assert_int_eq(kill(DMN.pid, SIGCONT), 0);
        ck_assert_int_eq(kvp_raw_recv(&w, &resp), kvpool_Code_OK);
        ck_assert_uint_eq(resp.id, 100 + 2 * (uint64_t)round);
        ck_assert_int_eq(resp.which_body, kvpool_Response_ping_tag);
        ck_assert_int_eq(kvp_raw_recv(&w, &resp), kvpool_Code_OK);
        ck_assert_uint_eq(resp.id, 101 + 2 * (uint64_t)round);
        ck_assert_int_eq(resp.which_body, kvpool_Response_register_buffer_tag);
    }
    close(memfd);
    kvp_raw_close(&w);
    stop_expect_clean();
}
END_TEST

/* ---- worker death and leases --------------------------------------------------------------- */

/* A child that reserves `tokens` for sequence 1 in ns with the lease, says so on the pipe,
 * then waits to be killed. */
static pid_t doomed_worker(const char *ns, uint32_t lease_ms, uint32_t tokens)
{
    int p[2];
    ck_assert_int_eq(pipe(p), 0);
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        kvp_client_t *c = connect_ns(ns, lease_ms);
        uint64_t id = 1;
        table_t tb;
        if (kvp_client_reserve(c, &id, &tokens, 1, table(&tb)))
            _exit(3);
        char ok = 'k';
        if (write(p[1], &ok, 1) != 1)
            _exit(4);
        for (;;)
            pause();
    }
    close(p[1]);
    char got = 0;
    ck_assert_int_eq(read(p[0], &got, 1), 1);
    close(p[0]);
    return pid;
}

static uint32_t num_seqs(kvp_client_t *c)
{
    kvp_stats_summary_t st;
    ck_assert_int_eq(kvp_client_stats(c, &st), 0);
    return st.num_seqs;
}

typedef struct {
    kvp_client_t *c;
    uint32_t want;
} seqs_arg_t;

static int seqs_are(void *arg)
{
    const seqs_arg_t *a = arg;
    return num_seqs(a->c) == a->want;
}

/* Waits up to 10 s until the pool holds want sequences (a release on a drop or an expiry is
 * the daemon's own doing, seen asynchronously), then asserts it. */
static void wait_seqs(kvp_client_t *c, uint32_t want)
{
    seqs_arg_t a = {c, want};
    kvp_wait_until(seqs_are, &a, 10000);
    ck_assert_uint_eq(num_seqs(c), want);
}

typedef struct {
    kvp_raw_t w; /* an observer session of the operator: sees every namespace */
    kvpool_Response *resp;
    const char *ns;
} detach_arg_t;

/* Whether Stats shows no session in namespace a->ns (or no such namespace). */
static int ns_detached(void *arg)
{
    detach_arg_t *a = arg;
    kvpool_Request q = {.id = 0, .which_body = kvpool_Request_stats_tag};
    if (kvp_raw_call(&a->w, &q, NULL, 0, a->resp) != kvpool_Code_OK)
        return 0;
    const kvpool_Stats *st = &a->resp->body.stats.stats;
    for (pb_size_t i = 0; i < st->namespaces_count; i++)
        if (strcmp(st->namespaces[i].name, a->ns) == 0)
            return st->namespaces[i].sessions == 0;
    return 1;
}

/* Waits until the daemon has handled the close of every session of namespace ns: a dropped
 * connection is seen asynchronously, and what a lease keeps can only be checked after that. */
static void wait_detached(const char *ns)
{
    detach_arg_t a = {.resp = calloc(1, sizeof(kvpool_Response)), .ns = ns};
    ck_assert_ptr_nonnull(a.resp);
    kvp_raw_open(&a.w, DMN.sock);
    kvpool_Request q = {.id = 1, .which_body = kvpool_Request_hello_tag};
    q.body.hello.protocol_version = KVP_PROTOCOL_VERSION;
    q.body.hello.observer = true;
    ck_assert_int_eq(kvp_raw_call(&a.w, &q, NULL, 0, a.resp), kvpool_Code_OK);
    const int ok = kvp_wait_until(ns_detached, &a, 10000);
    kvp_raw_close(&a.w);
    free(a.resp);
    ck_assert_msg(ok, "namespace %s still has a session after 10 s", ns);
}

START_TEST(killed_worker_loses_only_what_its_lease_says)
{
    start();
    kvp_client_t *obs = connect_ns("observer", 0);
    /* lease 0: gone as soon as the daemon sees the connection drop */
    pid_t w = doomed_worker("lease0", 0, 9);
    ck_assert_uint_eq(num_seqs(obs), 1);
    kill(w, SIGKILL);
    waitpid(w, NULL, 0);
    wait_seqs(obs, 0);
    /* lease 3 s: kept, found again by a new connection, then released on expiry */
    w = doomed_worker("leased", 3000, 7);
    kill(w, SIGKILL);
    waitpid(w, NULL, 0);
    wait_detached("leased");
    ck_assert_uint_eq(num_seqs(obs), 1);
    kvp_client_t *again = connect_ns("leased", 3000);
    uint64_t id = 1;
    table_t tb;
    ck_assert_int_eq(kvp_client_page_table(again, &id, 1, table(&tb)), 0);
    ck_assert_int_eq(tb.t.seq_lens[0], 7);
    kvp_client_close(again);
    wait_detached("leased");
    ck_assert_uint_eq(num_seqs(obs), 1); /* lease runs from the last detach */
    wait_seqs(obs, 0);
    kvp_stats_summary_t st;
    ck_assert_int_eq(kvp_client_stats(obs, &st), 0);
    ck_assert_uint_eq(st.free_pages, PAGES);
    audit_ok(obs);
    kvp_client_close(obs);
    stop_expect_clean();
}
END_TEST

/* ---- concurrency and shutdown ------------------------------------------------------------- */

static void busy_worker(int k, int rounds, int report_fd)
{
    char ns[32];
    snprintf(ns, sizeof(ns), "w%d", k);
    kvp_client_t *c = connect_ns(ns, 60000);
    void *stage;
    uint32_t buf;
    size_t bytes = (size_t)L * 2 * 4 * H * ROW;
    if (kvp_client_alloc_host_buffer(c, bytes, &stage, &buf))
        _exit(2);
    memset(stage, k, bytes);
    uint64_t id = (uint64_t)k + 1;
    uint32_t one = 1;
    kvp_source_t src = staging_source(buf, 1);
    for (int i = 0; i < rounds; i++) {
        table_t tb;
        int rc = kvp_client_append(c, &id, &one, 1, &src, table(&tb));
        if (rc) {
            /* the daemon stopping: report how many appends were acknowledged */
            break;
        }
        if (report_fd >= 0) {
            char b = 1;
            if (write(report_fd, &b, 1) != 1)
                _exit(5);
        }
    }
    kvp_client_close(c);
}

START_TEST(sixteen_clients_append_concurrently)
{
    start();
    enum { N = 16, ROUNDS = 3 };
    pid_t p[N];
    for (int k = 0; k < N; k++) {
        p[k] = fork();
        if (p[k] == 0) {
            busy_worker(k, ROUNDS, -1);
            _exit(0);
        }
    }
    for (int k = 0; k < N; k++) {
        int st;
        waitpid(p[k], &st, 0);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker %d failed", k);
    }
    kvp_client_t *obs = connect_ns("observer", 0);
    kvp_stats_summary_t st;
    ck_assert_int_eq(kvp_client_stats(obs, &st), 0);
    ck_assert_uint_eq(st.num_seqs, N);            /* leases of 60 s keep them */
    ck_assert_uint_eq(st.num_tokens, N * ROUNDS); /* exactly one token per append */
    ck_assert_uint_eq(st.used_pages, N);          /* 3 tokens fit one 4-token page */
    audit_ok(obs);
    kvp_client_close(obs);
    stop_expect_clean();
}
END_TEST

START_TEST(sigterm_under_load_applies_every_answered_request_and_exits_0)
{
    start();
    enum { N = 4 };
    int pp[2];
    ck_assert_int_eq(pipe(pp), 0);
    pid_t p[N];
    for (int k = 0; k < N; k++) {
        p[k] = fork();
        if (p[k] == 0) {
            close(pp[0]);
            busy_worker(k, 1000000, pp[1]);
            _exit(0);
        }
    }
    close(pp[1]);
    /* under load: SIGTERM once every worker's first append is applied (it makes the worker's
     * sequence); they go on appending until the daemon stops them or the pool is full */
    kvp_client_t *obs = connect_ns("observer", 0);
    wait_seqs(obs, N);
    kvp_client_close(obs);
    int code_fd = pp[0];
    ck_assert_int_eq(kill(DMN.pid, SIGTERM), 0);
    uint64_t acked = 0;
    char b[256];
    ssize_t n;
    while ((n = read(code_fd, b, sizeof(b))) > 0)
        acked += (uint64_t)n;
    close(code_fd);
    for (int k = 0; k < N; k++)
        waitpid(p[k], NULL, 0);
    int st;
    ck_assert_int_eq(waitpid(DMN.pid, &st, 0), DMN.pid);
    DMN.pid = 0;
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "kvpoold exit status %d", st);
    ck_assert_uint_gt(acked, 0);
    /* every acknowledged append was applied and every applied one was answered: the daemon's
     * final state holds exactly one token per acknowledged append */
    FILE *f = fopen(DMN.log, "r");
    ck_assert_ptr_nonnull(f);
    char line[1024];
    unsigned long long tokens = ~0ull;
    while (fgets(line, sizeof(line), f)) {
        char *t = strstr(line, "final seqs=");
        if (t)
            ck_assert_int_eq(sscanf(strstr(t, "tokens="), "tokens=%llu", &tokens), 1);
    }
    fclose(f);
    ck_assert_uint_eq(tokens, acked);
    kvp_daemon_stop(&DMN, 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("daemon");
    TCase *tc = tcase_create("daemon");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, two_worker_processes_append_in_their_namespaces);
    tcase_add_test(tc, reserve_then_in_process_append_gives_the_same_bytes);
    tcase_add_test(tc, fork_truncate_release_agree_with_a_model);
    tcase_add_test(tc, bad_input_gets_its_exact_status_and_changes_nothing);
    tcase_add_test(tc, pipelined_frames_keep_their_own_fds);
    tcase_add_test(tc, killed_worker_loses_only_what_its_lease_says);
    tcase_add_test(tc, sixteen_clients_append_concurrently);
    tcase_add_test(tc, sigterm_under_load_applies_every_answered_request_and_exits_0);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
