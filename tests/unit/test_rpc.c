/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_rpc.c - the pure dispatch of kvpoold, without a socket: Hello first, every call's happy
 * path with exact answers, a daemon-run Append landing byte-exact in the host pool (read back
 * through the daemon's own pool mapping, exported fd), every refusal with its status code and
 * nothing changed, leases, idempotent replay, and the metrics text.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_metrics.h"
#include "kvp_rpc.h"
#include "kvp_test_util.h"

static kvp_rpc_t *R;
static kvp_session_t *S;
static uint64_t seq_ids[64];
static uint32_t num_tokens[64];
static kvp_batch_arrays_t B;
static kvp_rpc_io_t IO;
static kvpool_Request Q;
static uint64_t next_id = 100;
static uint64_t LAT_NS = 1000; /* the latency call_on reports for each answer */
static uint8_t ANSWER[1 << 16]; /* the last answer's frame, as the server would send it */
static long ANSWER_LEN;

static const kvp_geom_t G = {.num_layers = 2,
                             .num_pages = 32,
                             .page_size = 4,
                             .num_kv_heads = 2,
                             .head_dim = 8,
                             .dtype = KVP_DTYPE_FP16,
                             .layout = KVP_LAYOUT_NHD,
                             .storage = KVP_STORAGE_COMBINED,
                             .num_devices = 1};

static kvp_rpc_limits_t limits(void)
{
    return (kvp_rpc_limits_t){.max_seqs = 16,
                              .max_namespaces = 4,
                              .max_batch = 8,
                              .max_batch_tokens = 1000,
                              .max_buffers_per_client = 2,
                              .max_buffer_bytes = 1 << 20,
                              .dedup_window = 8,
                              .default_lease_ms = 0,
                              .max_lease_ms = 100000};
}

static void setup(void)
{
    kvp_backend_t *b;
    ck_assert_int_eq(kvp_backend_host_create(&G, &b), 0);
    kvp_rpc_limits_t lim = limits();
    ck_assert_int_eq(kvp_rpc_create(b, &lim, 1000, &R), 0);
    S = kvp_rpc_session_open(R, 1234, (uint32_t)getuid(), (uint32_t)getgid(), 1000);
    ck_assert_ptr_nonnull(S);
}

static void teardown(void)
{
    kvp_rpc_destroy(R);
    R = NULL;
}

/* Hands Q (id and body already set) to the rpc layer on session s as the server would: its
 * encoded bytes identify a retry, the answer is encoded into ANSWER and handed back. Returns
 * the status code (OK for a replay, whose frame is then in ANSWER). */
static kvpool_Code handle_on(kvp_session_t *s, int *fds, int nfds)
{
    static uint8_t payload[1 << 16];
    long plen = kvp_wire_encode_frame(kvpool_Request_fields, &Q, payload, sizeof(payload));
    ck_assert_int_gt(plen, 0);
    memset(&IO, 0, sizeof(IO));
    IO.batch = &B;
    IO.fds_in = fds;
    IO.nfds_in = nfds;
    int rc = kvp_rpc_handle(R, s, &Q, payload + KVP_FRAME_HDR_BYTES,
                            (uint32_t)plen - KVP_FRAME_HDR_BYTES, &IO, 2000, 0);
    if (rc == KVP_RPC_REPLAY) {
        ck_assert_uint_le(IO.replay_len, sizeof(ANSWER));
        memcpy(ANSWER, IO.replay, IO.replay_len);
        ANSWER_LEN = IO.replay_len;
        kvp_rpc_answered(R, s, NULL, IO.replay, IO.replay_len, LAT_NS);
        return kvpool_Code_OK;
    }
    kvp_rpc_job_t *j = NULL;
    if (rc == KVP_RPC_ASYNC) {
        j = IO.job;
        kvp_rpc_job_run(j);
        kvp_rpc_job_finish(R, j, &IO, 2000);
    }
    ANSWER_LEN = kvp_wire_encode_frame(kvpool_Response_fields, &IO.resp, ANSWER, sizeof(ANSWER));
    kvp_rpc_answered(R, s, &IO.resp, ANSWER_LEN > 0 ? ANSWER : NULL,
                     ANSWER_LEN > 0 ? (uint32_t)ANSWER_LEN : 0, LAT_NS);
    kvp_rpc_job_free(j); /* the arrays are not read after this in the tests below */
    ck_assert_uint_eq(IO.resp.id, Q.id);
    return IO.resp.status.code;
}

/* handle_on with a fresh request id. */
static kvpool_Code call_on(kvp_session_t *s, int *fds, int nfds)
{
    Q.id = next_id++;
    return handle_on(s, fds, nfds);
}

static kvpool_Code call(void)
{
    return call_on(S, NULL, 0);
}

static void body(pb_size_t which)
{
    memset(&Q, 0, sizeof(Q));
    Q.which_body = which;
}

static void batch(uint32_t n, const uint64_t *ids, const uint32_t *toks)
{
    memcpy(seq_ids, ids, n * 8);
    if (toks)
        memcpy(num_tokens, toks, n * 4);
    B.seq_ids = kvp_array(seq_ids, 8, n, 64);
    B.num_tokens = kvp_array(num_tokens, 4, toks ? n : 0, 64);
}

static void hello_on(kvp_session_t *s, const char *ns, uint32_t lease)
{
    body(kvpool_Request_hello_tag);
    Q.body.hello.protocol_version = KVP_PROTOCOL_VERSION;
    snprintf(Q.body.hello.namespace, sizeof(Q.body.hello.namespace), "%s", ns);
    snprintf(Q.body.hello.client_name, sizeof(Q.body.hello.client_name), "test");
    Q.body.hello.has_lease_ms = true;
    Q.body.hello.lease_ms = lease;
    Q.body.hello.want_pool_fds = true;
    ck_assert_int_eq(call_on(s, NULL, 0), kvpool_Code_OK);
}

static void audit_clean(void)
{
    char msg[256];
    int rc = kvp_seqtab_audit(kvp_rpc_seqtab(R), msg, sizeof(msg));
    ck_assert_msg(rc == 0, "audit: %s", msg);
}

START_TEST(first_request_must_be_hello)
{
    setup();
    body(kvpool_Request_stats_tag);
    ck_assert_int_eq(call(), kvpool_Code_FAILED_PRECONDITION);
    body(kvpool_Request_ping_tag);
    Q.body.ping.nonce = 77;
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_uint_eq(IO.resp.body.ping.nonce, 77);
    body(kvpool_Request_hello_tag);
    Q.body.hello.protocol_version = 99;
    ck_assert_int_eq(call(), kvpool_Code_FAILED_PRECONDITION);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "protocol version 99"));
    hello_on(S, "eng", 0);
    const kvpool_HelloResponse *h = &IO.resp.body.hello;
    ck_assert_uint_eq(h->session_id, S->id);
    ck_assert_uint_eq(h->pool.geometry.num_pages, 32);
    ck_assert_uint_eq(h->pool.geometry.page_size, 4);
    ck_assert_int_eq(h->pool.stride_n, 2 * 8);
    ck_assert_int_eq(h->pool.stride_page, 2 * 4 * 2 * 8);
    ck_assert_uint_eq(h->pool.pool_bytes, 2ull * 32 * 2 * 4 * 2 * 8 * 2);
    ck_assert_uint_eq(h->pool.num_fds, 1);
    ck_assert_int_eq(IO.nfds_out, 1);
    ck_assert_int_ge(IO.fds_out[0], 0);
    /* a second hello is refused */
    body(kvpool_Request_hello_tag);
    Q.body.hello.protocol_version = KVP_PROTOCOL_VERSION;
    ck_assert_int_eq(call(), kvpool_Code_FAILED_PRECONDITION);
    teardown();
}
END_TEST

START_TEST(reserve_fork_truncate_release_page_table)
{
    setup();
    hello_on(S, "eng", 0);
    uint64_t ids[2] = {7, 9};
    uint32_t toks[2] = {5, 3};
    body(kvpool_Request_reserve_tag);
    batch(2, ids, toks);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    const kvpool_PageTable *t = &IO.resp.body.reserve.table;
    ck_assert_uint_eq(t->batch_size, 2);
    ck_assert_uint_eq(t->nnz, 8);
    const int32_t *indptr = IO.out.kv_indptr.data, *idx = IO.out.kv_indices.data;
    const int32_t *last = IO.out.kv_last_page_len.data;
    ck_assert_uint_eq(IO.out.kv_indptr.count, 3);
    ck_assert_int_eq(indptr[1], 2);
    ck_assert_int_eq(indptr[2], 3);
    ck_assert_uint_eq(IO.out.kv_indices.count, 3);
    ck_assert_int_eq(idx[0], 0);
    ck_assert_int_eq(idx[1], 1);
    ck_assert_int_eq(idx[2], 2);
    ck_assert_int_eq(last[0], 1);
    ck_assert_int_eq(last[1], 3);

    body(kvpool_Request_fork_tag);
    Q.body.fork.parent = 7;
    Q.body.fork.child = 8;
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_uint_eq(IO.resp.body.fork.num_tokens, 5);
    ck_assert_int_eq(call(), kvpool_Code_ALREADY_EXISTS);
    Q.body.fork.parent = 70;
    Q.body.fork.child = 71;
    ck_assert_int_eq(call(), kvpool_Code_NOT_FOUND);

    /* appending to the fork copies its shared partial page: the reply lists the copy */
    uint64_t c8 = 8;
    uint32_t one = 1;
    body(kvpool_Request_reserve_tag);
    batch(1, &c8, &one);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_uint_eq(IO.out.copies.count, 2);
    ck_assert_uint_eq(((uint32_t *)IO.out.copies.data)[0], 1);
    ck_assert_uint_eq(((uint32_t *)IO.out.copies.data)[1], 3);

    body(kvpool_Request_truncate_tag);
    Q.body.truncate.seq_id = 7;
    Q.body.truncate.num_tokens = 4;
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_uint_eq(IO.resp.body.truncate.pages_freed, 1);
    Q.body.truncate.num_tokens = 40;
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);

    uint64_t q[2] = {9, 7};
    body(kvpool_Request_get_page_table_tag);
    batch(2, q, NULL);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_uint_eq(IO.out.kv_indices.count, 2);
    ck_assert_int_eq(((int32_t *)IO.out.kv_indices.data)[0], 2);
    ck_assert_int_eq(((int32_t *)IO.out.kv_indices.data)[1], 0);
    ck_assert_int_eq(((int32_t *)IO.out.seq_lens.data)[1], 4);

    uint64_t rel[3] = {7, 9, 1000};
    body(kvpool_Request_release_tag);
    batch(3, rel, NULL);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_uint_eq(IO.resp.body.release.released, 2);

    body(kvpool_Request_stats_tag);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_uint_eq(IO.resp.body.stats.stats.num_seqs, 1);
    ck_assert_uint_eq(IO.resp.body.stats.stats.num_tokens, 6);
    ck_assert_uint_eq(IO.resp.body.stats.stats.used_pages, 2);
    ck_assert_uint_eq(IO.resp.body.stats.stats.namespaces_count, 1);
    ck_assert_str_eq(IO.resp.body.stats.stats.namespaces[0].name, "eng");

    body(kvpool_Request_list_sequences_tag);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_uint_eq(IO.resp.body.list_sequences.seqs_count, 1);
    ck_assert_uint_eq(IO.resp.body.list_sequences.seqs[0].seq_id, 8);
    ck_assert_uint_eq(IO.resp.body.list_sequences.seqs[0].num_tokens, 6);
    ck_assert_uint_eq(IO.resp.body.list_sequences.next_cursor, 0);

    body(kvpool_Request_audit_tag);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert(IO.resp.body.audit.ok);
    ck_assert_str_eq(IO.resp.body.audit.message, "ok");
    audit_clean();
    teardown();
}
END_TEST

/* A memfd staging buffer holding K then V as [nnz, H, D] fp16 rows. */
static int make_staging_unsealed(size_t bytes, uint8_t **map)
{
    int fd = memfd_create("test-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(ftruncate(fd, (off_t)bytes), 0);
    *map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ck_assert_ptr_ne(*map, MAP_FAILED);
    return fd;
}

/* The daemon takes only memfds sealed against shrinking (else a client could SIGBUS it). */
static int make_staging(size_t bytes, uint8_t **map)
{
    int fd = memfd_create("test-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(ftruncate(fd, (off_t)bytes), 0);
    ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    *map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ck_assert_ptr_ne(*map, MAP_FAILED);
    return fd;
}

START_TEST(daemon_append_lands_in_the_pool_byte_exact)
{
    setup();
    hello_on(S, "eng", 0);
    int pool_fd = IO.fds_out[0];
    kvp_geom_derived_t d;
    ck_assert_int_eq(kvp_geom_derive(&G, &d), 0);
    uint8_t *pool = mmap(NULL, d.pool_bytes, PROT_READ, MAP_SHARED, pool_fd, 0);
    ck_assert_ptr_ne(pool, MAP_FAILED);

    const uint32_t nnz = 6, row = 16, H = 2, L = 2;
    size_t layer_stride = 2 * nnz * H * row;
    size_t bytes = L * layer_stride;
    uint8_t *stage;
    int fd = make_staging(bytes, &stage);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, 5);
    kvp_rng_fill(&rng, stage, bytes);

    body(kvpool_Request_register_buffer_tag);
    Q.body.register_buffer.kind = kvpool_BufferKind_BUFFER_MEMFD;
    Q.body.register_buffer.size_bytes = bytes;
    int fds[1] = {fd};
    ck_assert_int_eq(call_on(S, fds, 1), kvpool_Code_OK);
    ck_assert_int_eq(fds[0], -1); /* taken */
    uint32_t buf_id = IO.resp.body.register_buffer.buffer_id;

    uint64_t ids[2] = {1, 2};
    uint32_t toks[2] = {4, 2};
    body(kvpool_Request_append_tag);
    batch(2, ids, toks);
    Q.body.append.has_source = true;
    kvpool_Source *src = &Q.body.append.source;
    src->buffer_id = buf_id;
    src->k_offset = 0;
    src->v_offset = nnz * H * row;
    src->k_stride_n = src->v_stride_n = H * row;
    src->k_stride_h = src->v_stride_h = row;
    src->layer_stride = layer_stride;
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_uint_eq(IO.resp.body.append.table.nnz, 6);
    /* token t of the batch: seq 1 tokens 0..3 (page 0), seq 2 tokens 0..1 (page 1) */
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t t = 0; t < nnz; t++)
            for (uint32_t h = 0; h < H; h++)
                for (int kv = 0; kv < 2; kv++) {
                    uint32_t page = t < 4 ? 0 : 1, slot = t < 4 ? t : t - 4;
                    uint64_t off = kvp_geom_offset(&d, &G, l, page, kv, slot, h);
                    const uint8_t *want =
                        stage + l * layer_stride + (kv ? src->v_offset : 0) + t * H * row + h * row;
                    ck_assert_int_eq(memcmp(pool + off, want, row), 0);
                }
    body(kvpool_Request_stats_tag);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_uint_eq(IO.resp.body.stats.stats.append_bytes_total, 6ull * 2 * H * row * L);

    /* a source range one byte past the buffer is refused, nothing allocated */
    uint32_t used_before = IO.resp.body.stats.stats.used_pages;
    body(kvpool_Request_append_tag);
    batch(2, ids, toks);
    Q.body.append.has_source = true;
    *src = (kvpool_Source){.buffer_id = buf_id,
                           .k_offset = 0,
                           .v_offset = nnz * H * row + 2,
                           .k_stride_n = H * row,
                           .k_stride_h = row,
                           .v_stride_n = H * row,
                           .v_stride_h = row,
                           .layer_stride = layer_stride};
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "V source range exceeds"));
    src->v_offset = nnz * H * row + 1; /* not a multiple of the element size */
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);
    src->v_offset = nnz * H * row;
    src->buffer_id = 99;
    ck_assert_int_eq(call(), kvpool_Code_NOT_FOUND);
    src->buffer_id = buf_id;
    src->layer_end = 3;
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);
    body(kvpool_Request_stats_tag);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_uint_eq(IO.resp.body.stats.stats.used_pages, used_before);

    body(kvpool_Request_unregister_buffer_tag);
    Q.body.unregister_buffer.buffer_id = buf_id;
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_int_eq(call(), kvpool_Code_NOT_FOUND);
    audit_clean();
    munmap(stage, bytes);
    munmap(pool, d.pool_bytes);
    teardown();
}
END_TEST

/* Tensor-parallel form on the host backend (a group of one device): the leader's Append names
 * a rank buffer another connection of the namespace registered; a buffer of another namespace,
 * a wrong rank count, a non-zero source.buffer_id, an unknown session or buffer are refused
 * with nothing allocated; a rank buffer unregistered while the job is queued stays readable
 * until the job finishes. */
START_TEST(rank_sources_name_buffers_of_other_sessions_of_the_namespace)
{
    setup();
    hello_on(S, "eng", 0);
    int pool_fd = IO.fds_out[0];
    kvp_geom_derived_t d;
    ck_assert_int_eq(kvp_geom_derive(&G, &d), 0);
    uint8_t *pool = mmap(NULL, d.pool_bytes, PROT_READ, MAP_SHARED, pool_fd, 0);
    ck_assert_ptr_ne(pool, MAP_FAILED);
    kvp_session_t *rank =
        kvp_rpc_session_open(R, 1235, (uint32_t)getuid(), (uint32_t)getgid(), 1000);
    kvp_session_t *other =
        kvp_rpc_session_open(R, 1236, (uint32_t)getuid(), (uint32_t)getgid(), 1000);
    hello_on(rank, "eng", 0);
    hello_on(other, "other", 0);

    const uint32_t nnz = 3, row = 16, H = 2, L = 2;
    size_t layer_stride = 2 * nnz * H * row, bytes = L * layer_stride;
    uint8_t *stage, *stage2;
    int fd = make_staging(bytes, &stage), fd2 = make_staging(bytes, &stage2);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, 8);
    kvp_rng_fill(&rng, stage, bytes);
    body(kvpool_Request_register_buffer_tag);
    Q.body.register_buffer.kind = kvpool_BufferKind_BUFFER_MEMFD;
    Q.body.register_buffer.size_bytes = bytes;
    int fds[1] = {fd};
    ck_assert_int_eq(call_on(rank, fds, 1), kvpool_Code_OK);
    uint32_t rank_buf = IO.resp.body.register_buffer.buffer_id;
    fds[0] = fd2;
    ck_assert_int_eq(call_on(other, fds, 1), kvpool_Code_OK);
    uint32_t other_buf = IO.resp.body.register_buffer.buffer_id;

    uint64_t ids[1] = {5};
    uint32_t toks[1] = {nnz};
    const kvpool_Source src = {.k_offset = 0,
                               .v_offset = nnz * H * row,
                               .k_stride_n = H * row,
                               .k_stride_h = row,
                               .v_stride_n = H * row,
                               .v_stride_h = row,
                               .layer_stride = layer_stride};
#define TP_APPEND(sid, bid, count)                                                                 \
    do {                                                                                           \
        body(kvpool_Request_append_tag);                                                           \
        batch(1, ids, toks);                                                                       \
        Q.body.append.has_source = true;                                                           \
        Q.body.append.source = src;                                                                \
        Q.body.append.rank_sources_count = (count);                                                \
        Q.body.append.rank_sources[0].session_id = (sid);                                          \
        Q.body.append.rank_sources[0].buffer_id = (bid);                                           \
    } while (0)
    TP_APPEND(other->id, other_buf, 1);
    ck_assert_int_eq(call(), kvpool_Code_NOT_FOUND);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "no session"));
    TP_APPEND(rank->id, 77, 1);
    ck_assert_int_eq(call(), kvpool_Code_NOT_FOUND);
    TP_APPEND(rank->id, rank_buf, 2);
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "rank_sources has 2 entries"));
    TP_APPEND(rank->id, rank_buf, 1);
    Q.body.append.source.buffer_id = 3;
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);
    TP_APPEND(rank->id, rank_buf, 1);
    Q.body.append.source.v_offset = bytes; /* past the rank's buffer */
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);
    body(kvpool_Request_stats_tag);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_uint_eq(IO.resp.body.stats.stats.used_pages, 0);

    /* queued, then the rank unregisters its buffer before the copy runs */
    TP_APPEND(rank->id, rank_buf, 1);
    Q.id = next_id++;
    memset(&IO, 0, sizeof(IO));
    IO.batch = &B;
    ck_assert_int_eq(kvp_rpc_handle(R, S, &Q, NULL, 0, &IO, 2000, 0), KVP_RPC_ASYNC);
    kvp_rpc_job_t *job = IO.job;
    kvp_rpc_io_t io2;
    memset(&io2, 0, sizeof(io2));
    kvpool_Request q2;
    memset(&q2, 0, sizeof(q2));
    q2.id = next_id++;
    q2.which_body = kvpool_Request_unregister_buffer_tag;
    q2.body.unregister_buffer.buffer_id = rank_buf;
    io2.batch = &B;
    ck_assert_int_eq(kvp_rpc_handle(R, rank, &q2, NULL, 0, &io2, 2000, 0), KVP_RPC_DONE);
    ck_assert_int_eq(io2.resp.status.code, kvpool_Code_OK);
    kvp_rpc_answered(R, rank, &io2.resp, NULL, 0, 0);
    kvp_rpc_job_run(job);
    kvp_rpc_job_finish(R, job, &IO, 2000);
    ck_assert_int_eq(IO.resp.status.code, kvpool_Code_OK);
    kvp_rpc_answered(R, S, &IO.resp, NULL, 0, 0);
    kvp_rpc_job_free(job);
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t t = 0; t < nnz; t++)
            for (uint32_t h = 0; h < H; h++)
                for (int kv = 0; kv < 2; kv++) {
                    uint64_t off = kvp_geom_offset(&d, &G, l, 0, kv, t, h);
                    const uint8_t *want =
                        stage + l * layer_stride + (kv ? src.v_offset : 0) + t * H * row + h * row;
                    ck_assert_int_eq(memcmp(pool + off, want, row), 0);
                }
#undef TP_APPEND
    audit_clean();
    kvp_rpc_session_close(R, other, 3000);
    kvp_rpc_session_close(R, rank, 3000);
    munmap(stage, bytes);
    munmap(stage2, bytes);
    munmap(pool, d.pool_bytes);
    teardown();
}
END_TEST

START_TEST(refusals_change_nothing)
{
    setup();
    hello_on(S, "eng", 0);
    uint64_t ids[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    uint32_t toks[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    body(kvpool_Request_reserve_tag);
    batch(9, ids, toks); /* max_batch 8 */
    ck_assert_int_eq(call(), kvpool_Code_RESOURCE_EXHAUSTED);
    batch(2, ids, toks);
    B.num_tokens.count = 1; /* arrays disagree */
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);
    uint64_t dup[2] = {3, 3};
    batch(2, dup, toks);
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);
    batch(0, ids, toks);
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);
    uint32_t big[2] = {4 * 17, 4 * 17}; /* 34 pages, more than the 32-page pool */
    batch(2, ids, big);
    ck_assert_int_eq(call(), kvpool_Code_RESOURCE_EXHAUSTED);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "pool exhausted"));
    /* register: wrong fd count, size 0, too large */
    body(kvpool_Request_register_buffer_tag);
    Q.body.register_buffer.size_bytes = 64;
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);
    Q.body.register_buffer.size_bytes = 0;
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);
    Q.body.register_buffer.size_bytes = 2 << 20;
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);
    /* an fd smaller than it claims */
    uint8_t *m;
    int fd = make_staging(64, &m);
    Q.body.register_buffer.size_bytes = 4096;
    int fds[1] = {fd};
    ck_assert_int_eq(call_on(S, fds, 1), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_int_eq(fds[0], fd); /* not taken: the caller closes it */
    close(fd);
    munmap(m, 64);
    /* an unsealed memfd that could shrink under the daemon */
    fd = make_staging_unsealed(4096, &m);
    fds[0] = fd;
    ck_assert_int_eq(call_on(S, fds, 1), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "F_SEAL_SHRINK"));
    close(fd);
    munmap(m, 4096);
    body(kvpool_Request_stats_tag);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_uint_eq(IO.resp.body.stats.stats.num_seqs, 0);
    ck_assert_uint_eq(IO.resp.body.stats.stats.used_pages, 0);
    body(0);
    ck_assert_int_eq(call(), kvpool_Code_INVALID_ARGUMENT);
    audit_clean();
    teardown();
}
END_TEST

START_TEST(namespaces_are_owned_and_leases_keep_sequences)
{
    setup();
    hello_on(S, "eng", 5000);
    uint64_t id = 1;
    uint32_t n = 3;
    body(kvpool_Request_reserve_tag);
    batch(1, &id, &n);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    /* another uid may not attach to it (root could) */
    if (getuid() != 0) {
        kvp_session_t *o = kvp_rpc_session_open(R, 1, getuid() + 1, 0, 1000);
        body(kvpool_Request_hello_tag);
        Q.body.hello.protocol_version = KVP_PROTOCOL_VERSION;
        snprintf(Q.body.hello.namespace, sizeof(Q.body.hello.namespace), "eng");
        ck_assert_int_eq(call_on(o, NULL, 0), kvpool_Code_PERMISSION_DENIED);
        kvp_rpc_session_close(R, o, 1000);
    }
    /* a foreign uid session of a different namespace cannot see "eng"'s sequences */
    kvp_session_t *o2 = kvp_rpc_session_open(R, 1, getuid(), 0, 1000);
    hello_on(o2, "other", 0);
    body(kvpool_Request_get_page_table_tag);
    batch(1, &id, NULL);
    ck_assert_int_eq(call_on(o2, NULL, 0), kvpool_Code_NOT_FOUND);
    kvp_rpc_session_close(R, o2, 1000);
    /* the last session leaves: the sequences live for the lease (5 s), then go */
    kvp_rpc_session_close(R, S, 10000);
    ck_assert_uint_eq(kvp_rpc_next_deadline(R), 15000);
    ck_assert_uint_eq(kvp_rpc_expire_leases(R, 14999), 0);
    ck_assert_ptr_nonnull(kvp_seqtab_find(kvp_rpc_seqtab(R), 0, 1));
    /* a worker that comes back before the lease ends finds its sequence */
    S = kvp_rpc_session_open(R, 1, getuid(), 0, 12000);
    hello_on(S, "eng", 5000);
    body(kvpool_Request_get_page_table_tag);
    batch(1, &id, NULL);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    ck_assert_int_eq(((int32_t *)IO.out.seq_lens.data)[0], 3);
    kvp_rpc_session_close(R, S, 20000);
    ck_assert_uint_eq(kvp_rpc_expire_leases(R, 25000), 1);
    kvp_stats_t st;
    kvp_seqtab_stats(kvp_rpc_seqtab(R), &st);
    ck_assert_uint_eq(st.num_seqs, 0);
    ck_assert_uint_eq(st.used_pages, 0);
    /* lease 0: released at once when the session closes */
    S = kvp_rpc_session_open(R, 1, getuid(), 0, 30000);
    hello_on(S, "eng0", 0);
    body(kvpool_Request_reserve_tag);
    batch(1, &id, &n);
    ck_assert_int_eq(call(), kvpool_Code_OK);
    kvp_rpc_session_close(R, S, 30000);
    kvp_seqtab_stats(kvp_rpc_seqtab(R), &st);
    ck_assert_uint_eq(st.num_seqs, 0);
    S = kvp_rpc_session_open(R, 1, getuid(), 0, 30000);
    audit_clean();
    teardown();
}
END_TEST

START_TEST(replay_returns_the_first_answer_and_applies_nothing_twice)
{
    setup();
    hello_on(S, "eng", 0);
    uint64_t id = 1;
    uint32_t n = 3;
    body(kvpool_Request_reserve_tag);
    batch(1, &id, &n);
    Q.id = 555;
    ck_assert_int_eq(handle_on(S, NULL, 0), kvpool_Code_OK);
    uint8_t first[4096];
    long first_len = ANSWER_LEN;
    ck_assert_int_gt(first_len, 0);
    memcpy(first, ANSWER, (size_t)first_len);
    /* the retry, on another session of the namespace: the same bytes, nothing applied */
    kvp_session_t *s2 = kvp_rpc_session_open(R, 1, getuid(), 0, 2000);
    hello_on(s2, "eng", 0);
    body(kvpool_Request_reserve_tag);
    batch(1, &id, &n);
    Q.id = 555;
    ck_assert_int_eq(handle_on(s2, NULL, 0), kvpool_Code_OK);
    ck_assert_int_eq(ANSWER_LEN, first_len);
    ck_assert_int_eq(memcmp(ANSWER, first, (size_t)first_len), 0);
    ck_assert_uint_eq(kvp_seqtab_find(kvp_rpc_seqtab(R), S->ns, 1)->num_tokens, 3);
    /* the id for another call: refused, naming the first call */
    body(kvpool_Request_fork_tag);
    Q.body.fork.parent = 1;
    Q.body.fork.child = 2;
    Q.id = 555;
    ck_assert_int_eq(handle_on(s2, NULL, 0), kvpool_Code_ALREADY_EXISTS);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "reserve"));
    ck_assert_ptr_null(kvp_seqtab_find(kvp_rpc_seqtab(R), S->ns, 2));
    /* an error is not remembered: the same id runs again */
    Q.id = 556;
    Q.body.fork.parent = 9; /* no such sequence */
    ck_assert_int_eq(handle_on(s2, NULL, 0), kvpool_Code_NOT_FOUND);
    ck_assert_int_eq(handle_on(s2, NULL, 0), kvpool_Code_NOT_FOUND);
    /* per-connection calls are never answered from the window */
    body(kvpool_Request_unregister_buffer_tag);
    Q.body.unregister_buffer.buffer_id = 77;
    Q.id = 557;
    ck_assert_int_eq(handle_on(s2, NULL, 0), kvpool_Code_NOT_FOUND);
    ck_assert_int_eq(handle_on(s2, NULL, 0), kvpool_Code_NOT_FOUND);
    /* the window holds 8: after 8 more ids the first one is forgotten and applies again */
    for (uint64_t i = 0; i < 8; i++) {
        body(kvpool_Request_truncate_tag);
        Q.body.truncate.seq_id = 1;
        Q.body.truncate.num_tokens = 3;
        Q.id = 1000 + i;
        ck_assert_int_eq(handle_on(S, NULL, 0), kvpool_Code_OK);
    }
    body(kvpool_Request_reserve_tag);
    batch(1, &id, &n);
    Q.id = 555;
    ck_assert_int_eq(handle_on(S, NULL, 0), kvpool_Code_OK);
    ck_assert_uint_eq(kvp_seqtab_find(kvp_rpc_seqtab(R), S->ns, 1)->num_tokens, 6);
    kvp_rpc_session_close(R, s2, 3000);
    teardown();
}
END_TEST

START_TEST(metrics_text_follows_the_exposition_format)
{
    setup();
    hello_on(S, "eng", 0);
    uint64_t id = 1, big_id = 2;
    uint32_t n = 1, big = 1000;
    body(kvpool_Request_reserve_tag);
    batch(1, &id, &n);
    LAT_NS = 3000;
    ck_assert_int_eq(call(), kvpool_Code_OK);
    body(kvpool_Request_reserve_tag);
    batch(1, &big_id, &big);
    LAT_NS = 500;
    ck_assert_int_eq(call(), kvpool_Code_RESOURCE_EXHAUSTED);
    LAT_NS = 1000;
    static char text[1 << 16];
    size_t len = kvp_rpc_metrics_text(R, text, sizeof(text), 5000);
    ck_assert_uint_eq(len, strlen(text));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_pages{device=\"0\",state=\"capacity\"} 32\n"));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_pages{device=\"0\",state=\"free\"} 31\n"));
    ck_assert_ptr_nonnull(
        strstr(text, "kvpool_rpc_requests_total{call=\"reserve\",code=\"OK\"} 1\n"));
    ck_assert_ptr_nonnull(strstr(
        text, "kvpool_rpc_requests_total{call=\"reserve\",code=\"RESOURCE_EXHAUSTED\"} 1\n"));
    ck_assert_ptr_nonnull(
        strstr(text, "kvpool_rpc_duration_seconds_bucket{call=\"reserve\",le=\"1e-06\"} 1\n"));
    ck_assert_ptr_nonnull(
        strstr(text, "kvpool_rpc_duration_seconds_bucket{call=\"reserve\",le=\"+Inf\"} 2\n"));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_rpc_duration_seconds_count{call=\"reserve\"} 2\n"));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_sequences{namespace=\"eng\"} 1\n"));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_uptime_seconds 4.000\n"));
    /* every sample line's metric has a TYPE line before it */
    for (char *line = text; *line;) {
        char *nl = strchr(line, '\n');
        ck_assert_ptr_nonnull(nl);
        if (*line != '#') {
            char name[128];
            size_t k = strcspn(line, "{ ");
            snprintf(name, sizeof(name), "# TYPE %.*s ", (int)k, line);
            char *suffix = strstr(name, "_bucket ");
            if (!suffix)
                suffix = strstr(name, "_sum ");
            if (!suffix)
                suffix = strstr(name, "_count ");
            if (suffix)
                strcpy(suffix, " ");
            ck_assert_msg(strstr(text, name) && strstr(text, name) < line, "no %s", name);
        }
        line = nl + 1;
    }
    teardown();
}
END_TEST

START_TEST(metrics_label_values_are_escaped)
{
    char out[2 * KVP_NS_NAME_MAX + 2];
    kvp__metrics_label_escape("a\"b\\c\nd", out, sizeof(out));
    ck_assert_str_eq(out, "a\\\"b\\\\c\\nd");
    kvp__metrics_label_escape("t\x01\x7f\xff\xc3\xa9", out, sizeof(out)); /* é stays */
    ck_assert_str_eq(out, "t???\xc3\xa9");
    char tiny[5];
    kvp__metrics_label_escape("\"\"\"", tiny, sizeof(tiny)); /* never half an escape */
    ck_assert_str_eq(tiny, "\\\"");
}
END_TEST

START_TEST(metrics_text_truncates_at_a_line_boundary_and_says_so)
{
    setup();
    hello_on(S, "eng", 0);
    kvp_rpc_observe_run(R, 1500); /* 1.5 us: the 2 us bucket */
    static char full[1 << 16], part[2000];
    size_t n = kvp_rpc_metrics_text(R, full, sizeof(full), 5000);
    ck_assert_ptr_nonnull(strstr(full, "kvpool_append_run_seconds_bucket{le=\"1e-06\"} 0\n"));
    ck_assert_ptr_nonnull(strstr(full, "kvpool_append_run_seconds_bucket{le=\"2e-06\"} 1\n"));
    ck_assert_ptr_nonnull(strstr(full, "kvpool_append_run_seconds_count 1\n"));
    ck_assert_ptr_nonnull(strstr(full, "kvpool_append_run_seconds_sum 0.000001500\n"));
    ck_assert_ptr_null(strstr(full, "truncated"));
    size_t m = kvp_rpc_metrics_text(R, part, sizeof(part), 5000);
    ck_assert_uint_lt(m, n);
    ck_assert_uint_eq(m, strlen(part));
    char *note = strstr(part, "# kvpool: truncated at ");
    ck_assert_ptr_nonnull(note);
    ck_assert_int_eq(note[strlen(note) - 1], '\n');
    /* everything before the note is a prefix of the full text ending at a newline */
    size_t body = (size_t)(note - part);
    ck_assert_uint_gt(body, 0);
    ck_assert_int_eq(part[body - 1], '\n');
    ck_assert_int_eq(memcmp(part, full, body), 0);
    teardown();
}
END_TEST

int main(void)
{

    Suite *s = suite_create("rpc");
    TCase *tc = tcase_create("rpc");
    tcase_add_test(tc, first_request_must_be_hello);
    tcase_add_test(tc, reserve_fork_truncate_release_page_table);
    tcase_add_test(tc, daemon_append_lands_in_the_pool_byte_exact);
    tcase_add_test(tc, rank_sources_name_buffers_of_other_sessions_of_the_namespace);
    tcase_add_test(tc, refusals_change_nothing);
    tcase_add_test(tc, namespaces_are_owned_and_leases_keep_sequences);
    tcase_add_test(tc, replay_returns_the_first_answer_and_applies_nothing_twice);
    tcase_add_test(tc, metrics_text_follows_the_exposition_format);
    tcase_add_test(tc, metrics_label_values_are_escaped);
    tcase_add_test(tc, metrics_text_truncates_at_a_line_boundary_and_says_so);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
