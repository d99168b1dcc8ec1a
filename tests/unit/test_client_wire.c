/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_client_wire.c - libkvpool against the daemon's side of the wire. First the pure steps:
 * a Request built the way the client builds it decodes exactly with the server's decoder, and a
 * page table encoded the way the server encodes it lands exactly in the caller's arrays (NULL
 * arrays skipped but counted, small capacities KVP_ELIMIT, inconsistent tables KVP_EPROTO).
 * Then the whole client against a scripted fake daemon on a real socket: Hello and the pool
 * mapping, request ids, status codes and messages, staging buffers, timeouts.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <pb_encode.h>

#include "kvp_client_internal.h"
#include "kvp_error.h"
#include "kvp_sock.h"
#include "kvp_test_util.h"
#include "kvp_wire.h"
#include "kvpool.h"

/* The seed example of DESIGN.md §1 as the daemon would answer it, plus two copies. */
static const int32_t seed_indptr[] = {0, 3, 4, 6, 8};
static const int32_t seed_indices[] = {0, 1, 2, 3, 4, 5, 6, 7};
static const int32_t seed_last[] = {13, 8, 9, 6};
static const int32_t seed_append[] = {0, 45, 53, 78, 100};
static const int32_t seed_lens[] = {45, 8, 25, 22};
static const uint32_t seed_copies[] = {1, 9, 2, 10};

/* Server side: a Response whose body `which` carries the seed page table, as a frame, with
 * `num_cached` PageTable.cached_tokens entries from cached (0: the field left out). */
static long encode_seed_table_cached(pb_size_t which, uint64_t id, uint8_t *buf, size_t cap,
                                     const int32_t *indptr, const uint32_t *cached,
                                     uint32_t num_cached)
{
    kvpool_Response *resp = calloc(1, sizeof(*resp));
    kvp_reply_arrays_t out;
    memset(&out, 0, sizeof(out));
    out.kv_indptr = kvp_array((void *)indptr, 4, 5, 5);
    out.kv_indices = kvp_array((void *)seed_indices, 4, 8, 8);
    out.kv_last_page_len = kvp_array((void *)seed_last, 4, 4, 4);
    out.append_indptr = kvp_array((void *)seed_append, 4, 5, 5);
    out.seq_lens = kvp_array((void *)seed_lens, 4, 4, 4);
    out.copies = kvp_array((void *)seed_copies, 8, 2, 2);
    out.cached_tokens = kvp_array((void *)cached, 4, num_cached, num_cached);
    resp->id = id;
    resp->has_status = true;
    resp->status.code = kvpool_Code_OK;
    resp->which_body = which;
    kvpool_PageTable *t = which == kvpool_Response_reserve_tag  ? &resp->body.reserve.table
                          : which == kvpool_Response_append_tag ? &resp->body.append.table
                                                                : &resp->body.get_page_table.table;
    if (which == kvpool_Response_reserve_tag)
        resp->body.reserve.has_table = true;
    else if (which == kvpool_Response_append_tag)
        resp->body.append.has_table = true;
    else
        resp->body.get_page_table.has_table = true;
    t->batch_size = 4;
    t->nnz = 100;
    kvp_wire_table_bind_encode(t, &out);
    long n = kvp_wire_encode_frame(kvpool_Response_fields, resp, buf, cap);
    free(resp);
    return n;
}

static long encode_seed_table(pb_size_t which, uint64_t id, uint8_t *buf, size_t cap,
                              const int32_t *indptr)
{
    return encode_seed_table_cached(which, id, buf, cap, indptr, NULL, 0);
}

typedef struct {
    int32_t indptr[16], indices[16], last[16], append[16], lens[16];
    uint32_t copies[16], cached[16];
    kvp_page_table_t t;
} table_buf_t;

static void table_init(table_buf_t *b, uint32_t cap_batch, uint32_t cap_indices,
                       uint32_t cap_copies)
{
    memset(b, 0x7f, sizeof(*b));
    memset(&b->t, 0, sizeof(b->t));
    b->t.kv_indptr = b->indptr;
    b->t.kv_indices = b->indices;
    b->t.kv_last_page_len = b->last;
    b->t.append_indptr = b->append;
    b->t.seq_lens = b->lens;
    b->t.copies = b->copies;
    b->t.cached_tokens = b->cached;
    b->t.cap_batch = cap_batch;
    b->t.cap_indices = cap_indices;
    b->t.cap_copies = cap_copies;
}

/* Client side: decodes one frame into t as the library does. */
static int client_decode_table(const uint8_t *frame, long n, kvp_page_table_t *t, char *err,
                               size_t err_len)
{
    kvpool_Response *resp = calloc(1, sizeof(*resp));
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, t);
    int rc = kvp__client_decode_response(resp, &r, frame + 4, (size_t)n - 4, err, err_len);
    if (rc == 0)
        rc = kvp__client_table_fill(t, resp, &r);
    free(resp);
    return rc;
}

START_TEST(reserve_of_256_sequences_decodes_exactly_on_the_server)
{
    enum { N = 256 };
    uint64_t ids[N];
    uint32_t toks[N];
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(21));
    for (int i = 0; i < N; i++) {
        ids[i] = kvp_rng_next(&rng) | (i % 2 ? 1ull << 63 : 0); /* the high bit survives */
        toks[i] = 1 + kvp_rng_below(&rng, 5000);
    }
    kvpool_Request req;
    kvp_batch_arrays_t b;
    kvp__client_batch_arrays(&b, ids, toks, N);
    ck_assert_int_eq(kvp__client_request_batch(&req, kvpool_Request_reserve_tag, &b), 0);
    req.id = 0xfedcba9876543210ull;
    uint8_t frame[8192];
    long n = kvp_wire_encode_frame(kvpool_Request_fields, &req, frame, sizeof(frame));
    ck_assert_int_gt(n, N * 12);
    ck_assert_uint_eq(kvp_frame_get_len(frame), (uint64_t)n - 4);

    /* the daemon's decoder, with its configured bound of exactly 256 */
    uint64_t got_ids[N];
    uint32_t got_toks[N];
    kvpool_Request sreq;
    memset(&sreq, 0, sizeof(sreq));
    kvp_batch_arrays_t sb = {.seq_ids = kvp_array(got_ids, 8, 0, N),
                             .num_tokens = kvp_array(got_toks, 4, 0, N)};
    kvp_wire_request_bind_decode(&sreq, &sb);
    ck_assert_int_eq(kvp_wire_decode(kvpool_Request_fields, &sreq, frame + 4, (size_t)n - 4, NULL),
                     0);
    ck_assert_uint_eq(sreq.id, 0xfedcba9876543210ull);
    ck_assert_uint_eq(sreq.which_body, kvpool_Request_reserve_tag);
    ck_assert(sreq.body.reserve.has_batch);
    ck_assert_uint_eq(sb.seq_ids.count, N);
    ck_assert_uint_eq(sb.num_tokens.count, N);
    ck_assert_int_eq(memcmp(got_ids, ids, sizeof(ids)), 0);
    ck_assert_int_eq(memcmp(got_toks, toks, sizeof(toks)), 0);

    /* one more than the daemon's bound is refused by its decoder */
    kvp_batch_arrays_t small = {.seq_ids = kvp_array(got_ids, 8, 0, N - 1),
                                .num_tokens = kvp_array(got_toks, 4, 0, N)};
    memset(&sreq, 0, sizeof(sreq));
    kvp_wire_request_bind_decode(&sreq, &small);
    ck_assert_int_eq(kvp_wire_decode(kvpool_Request_fields, &sreq, frame + 4, (size_t)n - 4, NULL),
                     KVP_EINVAL);
    ck_assert_int_eq(small.seq_ids.bad, KVP_ELIMIT);
}
END_TEST

START_TEST(release_and_page_table_requests_carry_seq_ids_only)
{
    uint64_t ids[3] = {7, 8, UINT64_MAX};
    static const pb_size_t bodies[] = {kvpool_Request_release_tag,
                                       kvpool_Request_get_page_table_tag};
    for (size_t k = 0; k < 2; k++) {
        kvpool_Request req;
        kvp_batch_arrays_t b;
        kvp__client_batch_arrays(&b, ids, NULL, 3);
        ck_assert_int_eq(kvp__client_request_batch(&req, bodies[k], &b), 0);
        req.id = 5;
        uint8_t frame[256];
        long n = kvp_wire_encode_frame(kvpool_Request_fields, &req, frame, sizeof(frame));
        ck_assert_int_gt(n, 0);
        uint64_t got[8];
        uint32_t toks[8];
        kvpool_Request sreq;
        memset(&sreq, 0, sizeof(sreq));
        kvp_batch_arrays_t sb = {.seq_ids = kvp_array(got, 8, 0, 8),
                                 .num_tokens = kvp_array(toks, 4, 0, 8)};
        kvp_wire_request_bind_decode(&sreq, &sb);
        ck_assert_int_eq(
            kvp_wire_decode(kvpool_Request_fields, &sreq, frame + 4, (size_t)n - 4, NULL), 0);
        ck_assert_uint_eq(sreq.which_body, bodies[k]);
        ck_assert_uint_eq(sb.seq_ids.count, 3);
        ck_assert_uint_eq(sb.num_tokens.count, 0);
        ck_assert_uint_eq(got[2], UINT64_MAX);
    }
    kvpool_Request req;
    kvp_batch_arrays_t b;
    kvp__client_batch_arrays(&b, ids, NULL, 3);
    ck_assert_int_eq(kvp__client_request_batch(&req, kvpool_Request_fork_tag, &b), KVP_EINVAL);
}
END_TEST

START_TEST(page_table_lands_exactly_in_the_callers_arrays)
{
    static const pb_size_t bodies[] = {kvpool_Response_reserve_tag, kvpool_Response_append_tag,
                                       kvpool_Response_get_page_table_tag};
    for (size_t k = 0; k < 3; k++) {
        uint8_t frame[1024];
        long n = encode_seed_table(bodies[k], 99, frame, sizeof(frame), seed_indptr);
        ck_assert_int_gt(n, 0);
        table_buf_t b;
        table_init(&b, 5, 8, 2); /* exactly enough */
        char err[200];
        ck_assert_int_eq(client_decode_table(frame, n, &b.t, err, sizeof(err)), 0);
        ck_assert_uint_eq(b.t.batch_size, 4);
        ck_assert_uint_eq(b.t.nnz, 100);
        ck_assert_uint_eq(b.t.num_indices, 8);
        ck_assert_uint_eq(b.t.num_copies, 2);
        ck_assert_int_eq(memcmp(b.indptr, seed_indptr, sizeof(seed_indptr)), 0);
        ck_assert_int_eq(memcmp(b.indices, seed_indices, sizeof(seed_indices)), 0);
        ck_assert_int_eq(memcmp(b.last, seed_last, sizeof(seed_last)), 0);
        ck_assert_int_eq(memcmp(b.append, seed_append, sizeof(seed_append)), 0);
        ck_assert_int_eq(memcmp(b.lens, seed_lens, sizeof(seed_lens)), 0);
        ck_assert_int_eq(memcmp(b.copies, seed_copies, sizeof(seed_copies)), 0);
        ck_assert_int_eq(b.indptr[5], 0x7f7f7f7f); /* nothing written past the data */
    }
}
END_TEST

START_TEST(null_arrays_are_skipped_but_counted)
{
    uint8_t frame[1024];
    long n = encode_seed_table(kvpool_Response_reserve_tag, 1, frame, sizeof(frame), seed_indptr);
    table_buf_t b;
    table_init(&b, 5, 0, 0);
    b.t.kv_indices = NULL;
    b.t.copies = NULL;
    b.t.seq_lens = NULL;
    ck_assert_int_eq(client_decode_table(frame, n, &b.t, NULL, 0), 0);
    ck_assert_uint_eq(b.t.num_indices, 8);
    ck_assert_uint_eq(b.t.num_copies, 2);
    ck_assert_int_eq(memcmp(b.indptr, seed_indptr, sizeof(seed_indptr)), 0);
    ck_assert_int_eq(memcmp(b.last, seed_last, sizeof(seed_last)), 0);
    ck_assert_int_eq(memcmp(b.append, seed_append, sizeof(seed_append)), 0);
    ck_assert_int_eq(b.lens[0], 0x7f7f7f7f);

    /* no table at all: only the counts */
    table_buf_t none;
    table_init(&none, 0, 0, 0);
    ck_assert_int_eq(client_decode_table(frame, n, NULL, NULL, 0), 0);
}
END_TEST

START_TEST(capacities_below_the_reply_give_elimit)
{
    uint8_t frame[1024];
    long n = encode_seed_table(kvpool_Response_reserve_tag, 1, frame, sizeof(frame), seed_indptr);
    char err[200];
    table_buf_t b;
    table_init(&b, 5, 7, 2);
    ck_assert_int_eq(client_decode_table(frame, n, &b.t, err, sizeof(err)), KVP_ELIMIT);
    ck_assert_ptr_nonnull(strstr(err, "kv_indices"));
    table_init(&b, 4, 8, 2); /* kv_indptr needs batch_size + 1 */
    ck_assert_int_eq(client_decode_table(frame, n, &b.t, err, sizeof(err)), KVP_ELIMIT);
    ck_assert_ptr_nonnull(strstr(err, "kv_indptr"));
    table_init(&b, 5, 8, 1);
    ck_assert_int_eq(client_decode_table(frame, n, &b.t, err, sizeof(err)), KVP_ELIMIT);
    ck_assert_ptr_nonnull(strstr(err, "copies"));
}
END_TEST

START_TEST(inconsistent_or_malformed_replies_are_protocol_errors)
{
    /* kv_indptr[B] says 9 indices, 8 came */
    static const int32_t bad_indptr[] = {0, 3, 4, 6, 9};
    uint8_t frame[1024];
    long n = encode_seed_table(kvpool_Response_reserve_tag, 1, frame, sizeof(frame), bad_indptr);
    table_buf_t b;
    table_init(&b, 5, 8, 2);
    ck_assert_int_eq(client_decode_table(frame, n, &b.t, NULL, 0), KVP_EPROTO);

    /* garbage */
    uint8_t junk[] = {0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    char err[200];
    ck_assert_int_eq(client_decode_table(junk, sizeof(junk), &b.t, err, sizeof(err)), KVP_EPROTO);
    ck_assert_ptr_nonnull(strstr(err, "malformed"));

    /* an int32 array whose length is not a multiple of 4 */
    kvpool_Response *resp = calloc(1, sizeof(*resp));
    uint8_t three[3] = {1, 2, 3};
    kvp_reply_arrays_t out;
    memset(&out, 0, sizeof(out));
    out.kv_indices = kvp_array(three, 1, 3, 3);
    resp->id = 1;
    resp->which_body = kvpool_Response_get_page_table_tag;
    resp->body.get_page_table.has_table = true;
    kvp_wire_table_bind_encode(&resp->body.get_page_table.table, &out);
    n = kvp_wire_encode_frame(kvpool_Response_fields, resp, frame, sizeof(frame));
    ck_assert_int_gt(n, 0);
    free(resp);
    ck_assert_int_eq(client_decode_table(frame, n, &b.t, NULL, 0), KVP_EPROTO);
}
END_TEST

/* The daemon's direct encoder of its hot answers writes nanopb's bytes and gives its codes:
 * random Ping, Append, Reserve and GetPageTable answers (ids, sizes, zeros left out, arrays
 * empty or unbound, tables absent), shapes it hands to nanopb (errors, other bodies, unknown
 * callbacks), and every buffer size around the frame's length. */
static bool other_encode(pb_ostream_t *stream, const pb_field_t *field, void *const *arg)
{
    (void)arg;
    return pb_encode_tag_for_field(stream, field) &&
           pb_encode_string(stream, (const pb_byte_t *)"x", 1);
}

static void expect_same_encoding(const kvpool_Response *resp, size_t cap)
{
    uint8_t *a = malloc(cap ? cap : 1), *b = malloc(cap ? cap : 1);
    memset(a, 0xa5, cap);
    memset(b, 0xa5, cap);
    long na = kvp_wire_encode_frame(kvpool_Response_fields, resp, a, cap);
    long nb = kvp_wire_encode_response_frame(resp, b, cap);
    ck_assert_int_eq(nb, na);
    if (na > 0)
        ck_assert_int_eq(memcmp(a, b, (size_t)na), 0);
    free(a);
    free(b);
}

START_TEST(direct_answer_encoding_is_nanopbs_byte_for_byte)
{
    /* the encoder knows every field of kvpool.proto's hot messages, so the direct path is the
     * one compared below (a new field makes it step aside and this fail: teach it the field) */
    ck_assert(kvp__wire_direct_shapes_known());
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(31));
    enum { MAXB = 300 };
    static int32_t arr[7][4 * MAXB];
    for (int k = 0; k < 7; k++)
        kvp_rng_fill(&rng, arr[k], sizeof(arr[k]));
    static const pb_size_t bodies[] = {
        kvpool_Response_ping_tag,    kvpool_Response_append_tag,
        kvpool_Response_reserve_tag, kvpool_Response_get_page_table_tag,
        kvpool_Response_fork_tag,    kvpool_Response_release_tag};
    static const uint64_t big[] = {0,     1,     127,           128,
                                   16383, 16384, 0xffffffffull, 0xffffffffffffffffull};
    kvpool_Response *resp = calloc(1, sizeof(*resp));
    for (int iter = 0; iter < 3000; iter++) {
        memset(resp, 0, sizeof(*resp));
        resp->which_body = bodies[kvp_rng_below(&rng, 6)];
        resp->id = kvp_rng_below(&rng, 3) ? big[kvp_rng_below(&rng, 8)] : kvp_rng_next(&rng);
        resp->has_status = kvp_rng_below(&rng, 8) != 0;
        uint32_t shape = kvp_rng_below(&rng, 10);
        if (shape == 0)
            resp->status.code = kvpool_Code_NOT_FOUND; /* errors: nanopb's */
        else if (shape == 1)
            snprintf(resp->status.message, sizeof(resp->status.message), "why");
        kvp_reply_arrays_t out;
        kvpool_PageTable *t = NULL;
        switch (resp->which_body) {
        case kvpool_Response_ping_tag:
            resp->body.ping.nonce = big[kvp_rng_below(&rng, 8)];
            break;
        case kvpool_Response_append_tag:
            t = &resp->body.append.table;
            resp->body.append.has_table = kvp_rng_below(&rng, 6) != 0;
            resp->body.append.fence = big[kvp_rng_below(&rng, 8)];
            resp->body.append.completed = kvp_rng_below(&rng, 2);
            break;
        case kvpool_Response_reserve_tag:
            t = &resp->body.reserve.table;
            resp->body.reserve.has_table = kvp_rng_below(&rng, 6) != 0;
            break;
        case kvpool_Response_get_page_table_tag:
            t = &resp->body.get_page_table.table;
            resp->body.get_page_table.has_table = kvp_rng_below(&rng, 6) != 0;
            break;
        default:
            resp->body.fork.num_tokens = kvp_rng_below(&rng, 1000);
            break;
        }
        if (t) {
            uint32_t B = kvp_rng_below(&rng, 3) ? kvp_rng_below(&rng, MAXB) : 0;
            t->batch_size = B;
            t->nnz = kvp_rng_below(&rng, 4) ? (uint32_t)big[kvp_rng_below(&rng, 7)] : 0;
            out.kv_indptr = kvp_array(arr[0], 4, B + 1, B + 1);
            out.kv_indices = kvp_array(arr[1], 4, kvp_rng_below(&rng, 4 * MAXB), 0);
            out.kv_last_page_len = kvp_array(arr[2], 4, B, B);
            out.append_indptr = kvp_array(arr[3], 4, B + 1, B + 1);
            out.seq_lens = kvp_array(arr[4], 4, B, B);
            out.copies = kvp_array(arr[5], 4, 2 * kvp_rng_below(&rng, 3), 0);
            /* PageTable.cached_tokens (field 9): present with reuse, else left out */
            out.cached_tokens = kvp_array(arr[6], 4, kvp_rng_below(&rng, 2) ? B : 0, 0);
            kvp_wire_table_bind_encode(t, &out);
            if (kvp_rng_below(&rng, 5) == 0)
                t->copies.funcs.encode = NULL; /* left out */
            if (kvp_rng_below(&rng, 20) == 0)
                t->seq_lens.funcs.encode = other_encode; /* not ours: nanopb's */
            if (kvp_rng_below(&rng, 20) == 0)
                t->cached_tokens.funcs.encode = other_encode;
        }
        if (kvp_rng_below(&rng, 50) == 0)
            resp->cb_body.funcs.encode = other_encode;
        long n = kvp_wire_encode_frame(kvpool_Response_fields, resp, NULL, 0);
        ck_assert_int_eq(n, KVP_ELIMIT);
        long size = kvp_wire_encoded_size(kvpool_Response_fields, resp);
        ck_assert_int_ge(size, 0);
        size_t exact = (size_t)size + KVP_FRAME_HDR_BYTES;
        expect_same_encoding(resp, exact);
        expect_same_encoding(resp, exact + 1 + kvp_rng_below(&rng, 64));
        expect_same_encoding(resp, exact - 1);
        expect_same_encoding(resp, kvp_rng_below(&rng, (uint32_t)exact + 1));
    }
    free(resp);
}
END_TEST

/* And the client's direct encoder of its hot requests: Ping, Reserve, Release and
 * GetPageTable requests as libkvpool builds them (and variations: the prefix cache's
 * Batch.token_ids / salts / salt_lens, Reserve's CacheOptions with every combination of
 * present fields), and Commit (nanopb's), against nanopb. */
static void expect_same_request(const kvpool_Request *req, size_t cap)
{
    uint8_t *a = malloc(cap ? cap : 1), *b = malloc(cap ? cap : 1);
    long na = kvp_wire_encode_frame(kvpool_Request_fields, req, a, cap);
    long nb = kvp_wire_encode_request_frame(req, b, cap);
    ck_assert_int_eq(nb, na);
    if (na > 0)
        ck_assert_int_eq(memcmp(a, b, (size_t)na), 0);
    free(a);
    free(b);
}

START_TEST(direct_request_encoding_is_nanopbs_byte_for_byte)
{
    ck_assert(kvp__wire_direct_shapes_known()); /* the direct path is what is compared */
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(32));
    static uint64_t ids[300];
    static uint32_t toks[300];
    static int32_t token_ids[3000];
    static uint8_t salts[600];
    kvp_rng_fill(&rng, ids, sizeof(ids));
    kvp_rng_fill(&rng, toks, sizeof(toks));
    kvp_rng_fill(&rng, token_ids, sizeof(token_ids));
    kvp_rng_fill(&rng, salts, sizeof(salts));
    static const pb_size_t bodies[] = {
        kvpool_Request_ping_tag,           kvpool_Request_reserve_tag, kvpool_Request_release_tag,
        kvpool_Request_get_page_table_tag, kvpool_Request_fork_tag,    kvpool_Request_commit_tag,
        kvpool_Request_reserve_tag};
    static const uint64_t big[] = {0, 1, 127, 128, 16384, 0xffffffffull, 0xffffffffffffffffull};
    kvpool_Request *req = calloc(1, sizeof(*req));
    unsigned with_cache = 0, with_tokens = 0;
    for (int iter = 0; iter < 4000; iter++) {
        pb_size_t which = bodies[kvp_rng_below(&rng, 7)];
        uint32_t n = kvp_rng_below(&rng, 4) ? kvp_rng_below(&rng, 300) : 0;
        kvp_batch_arrays_t b;
        kvp__client_batch_arrays(&b, ids, kvp_rng_below(&rng, 3) ? toks : NULL, n);
        if (kvp_rng_below(&rng, 2)) { /* the prefix cache's arrays, any of them */
            uint32_t nt = kvp_rng_below(&rng, 4) ? kvp_rng_below(&rng, 3000) : 0;
            uint32_t ns = kvp_rng_below(&rng, 2) ? kvp_rng_below(&rng, 600) : 0;
            b.token_ids = kvp_array(token_ids, 4, nt, nt);
            b.salts = kvp_array(salts, 1, ns, ns);
            b.salt_lens = kvp_array(toks, 4, kvp_rng_below(&rng, 2) ? n : 0, n);
            with_tokens += nt > 0;
        }
        if (kvp__client_request_batch(req, which, &b) != 0) {
            memset(req, 0, sizeof(*req));
            req->which_body = which;
            if (which == kvpool_Request_ping_tag)
                req->body.ping.nonce = big[kvp_rng_below(&rng, 7)];
            else
                req->body.fork.parent = kvp_rng_next(&rng);
        } else if (kvp_rng_below(&rng, 8) == 0) {
            if (which == kvpool_Request_reserve_tag) /* no batch at all */
                req->body.reserve.has_batch = false;
            else if (which == kvpool_Request_release_tag)
                req->body.release.has_batch = false;
            else if (which == kvpool_Request_commit_tag)
                req->body.commit.has_batch = false;
            else
                req->body.get_page_table.has_batch = false;
        }
        if (which == kvpool_Request_reserve_tag && kvp_rng_below(&rng, 2)) {
            kvpool_CacheOptions *o = &req->body.reserve.cache;
            req->body.reserve.has_cache = true; /* even all defaults: an empty submessage */
            o->reuse = kvp_rng_below(&rng, 2);
            o->leave_last = kvp_rng_below(&rng, 2);
            o->has_priority = kvp_rng_below(&rng, 2); /* present even when 0 */
            o->priority = kvp_rng_below(&rng, 2) ? (uint32_t)big[kvp_rng_below(&rng, 6)] : 0;
            o->retention_ms = kvp_rng_below(&rng, 2) ? (uint32_t)big[kvp_rng_below(&rng, 6)] : 0;
            with_cache++;
        }
        if (which == kvpool_Request_commit_tag && kvp_rng_below(&rng, 2)) {
            req->body.commit.event_handle.size = 64;
            memcpy(req->body.commit.event_handle.bytes, token_ids, 64);
        }
        req->id = kvp_rng_below(&rng, 2) ? big[kvp_rng_below(&rng, 7)] : kvp_rng_next(&rng);
        if (kvp_rng_below(&rng, 50) == 0)
            req->cb_body.funcs.encode = other_encode;
        long size = kvp_wire_encoded_size(kvpool_Request_fields, req);
        ck_assert_int_ge(size, 0);
        size_t exact = (size_t)size + KVP_FRAME_HDR_BYTES;
        expect_same_request(req, exact);
        expect_same_request(req, exact + 1 + kvp_rng_below(&rng, 64));
        expect_same_request(req, exact - 1);
        expect_same_request(req, kvp_rng_below(&rng, (uint32_t)exact + 1));
    }
    ck_assert_uint_gt(with_cache, 100);
    ck_assert_uint_gt(with_tokens, 300);
    free(req);
}
END_TEST

START_TEST(metrics_text_is_read_skipped_or_refused_when_too_long)
{
    kvpool_Response *resp = calloc(1, sizeof(*resp));
    char text[] = "kvpool_free_pages 12\nkvpool_used_pages 4\n";
    kvp_reply_arrays_t out;
    memset(&out, 0, sizeof(out));
    out.text.s = text;
    out.text.len = strlen(text);
    resp->id = 3;
    resp->which_body = kvpool_Response_metrics_tag;
    kvp_text_bind_encode(&resp->body.metrics.text, &out.text);
    uint8_t frame[512];
    long n = kvp_wire_encode_frame(kvpool_Response_fields, resp, frame, sizeof(frame));
    ck_assert_int_gt(n, 0);

    char got[64];
    kvp_reply_arrays_t r;
    memset(&r, 0, sizeof(r)); /* as kvpoolctl does: only the text bound */
    r.text.s = got;
    r.text.cap = sizeof(got);
    memset(resp, 0, sizeof(*resp));
    ck_assert_int_eq(kvp__client_decode_response(resp, &r, frame + 4, (size_t)n - 4, NULL, 0), 0);
    ck_assert_str_eq(got, text);
    ck_assert_uint_eq(r.text.len, strlen(text));

    kvp__client_table_arrays(&r, NULL); /* no text buffer: skipped */
    ck_assert_int_eq(kvp__client_decode_response(resp, &r, frame + 4, (size_t)n - 4, NULL, 0), 0);
    ck_assert_uint_eq(resp->id, 3);

    memset(&r, 0, sizeof(r));
    r.text.s = got;
    r.text.cap = 10;
    char err[200];
    ck_assert_int_eq(
        kvp__client_decode_response(resp, &r, frame + 4, (size_t)n - 4, err, sizeof(err)),
        KVP_ELIMIT);
    ck_assert_ptr_nonnull(strstr(err, "text"));
    free(resp);
}
END_TEST

/* ---- the prefix cache's fields ---------------------------------------------------------- */

/* Server side: decodes one request frame with arrays of exactly `cap` elements each. */
typedef struct {
    uint64_t ids[64];
    uint32_t toks[64], salt_lens[64];
    int32_t token_ids[256];
    uint8_t salts[256];
    kvp_batch_arrays_t b;
} server_arrays_t;

static void server_arrays(server_arrays_t *a, uint32_t cap_tokens, uint32_t cap_salts)
{
    memset(a, 0x5a, sizeof(*a));
    a->b.seq_ids = kvp_array(a->ids, 8, 0, 64);
    a->b.num_tokens = kvp_array(a->toks, 4, 0, 64);
    a->b.token_ids = kvp_array(a->token_ids, 4, 0, cap_tokens);
    a->b.salts = kvp_array(a->salts, 1, 0, cap_salts);
    a->b.salt_lens = kvp_array(a->salt_lens, 4, 0, 64);
}

static int server_decode(const uint8_t *frame, long n, kvpool_Request *req, server_arrays_t *a)
{
    memset(req, 0, sizeof(*req));
    kvp_wire_request_bind_decode(req, &a->b);
    return kvp_wire_decode(kvpool_Request_fields, req, frame + 4, (size_t)n - 4, NULL);
}

START_TEST(reserve_with_token_ids_salts_and_options_decodes_exactly_on_the_server)
{
    uint64_t ids[3] = {5, 6, 1ull << 62};
    uint32_t toks[3] = {20, 0, 13};
    int32_t token_ids[33];
    for (int i = 0; i < 33; i++)
        token_ids[i] = i % 2 ? -i * 1000003 : i; /* negative ids survive as int32 */
    uint8_t salts[] = {'l', 'o', 'r', 'a', '7', 0xff};
    uint32_t salt_lens[3] = {5, 0, 1};
    kvp_cache_opts_t cache = {.token_ids = token_ids,
                              .salts = salts,
                              .salt_lens = salt_lens,
                              .reuse = 1,
                              .leave_last = 1,
                              .priority = 0,
                              .retention_ms = 60000};
    kvpool_Request req;
    kvp_batch_arrays_t b;
    kvp__client_batch_arrays(&b, ids, toks, 3);
    const char *why = NULL;
    ck_assert_int_eq(kvp__client_batch_cache(&b, toks, 3, &cache, &why), 0);
    ck_assert_int_eq(kvp__client_request_batch(&req, kvpool_Request_reserve_tag, &b), 0);
    bool has = false;
    ck_assert_int_eq(kvp__client_cache_options(&req.body.reserve.cache, &has, &cache), 0);
    ck_assert(has);
    req.body.reserve.has_cache = has;
    req.id = 77;
    uint8_t frame[1024], ref[1024];
    long n = kvp_wire_encode_request_frame(&req, frame, sizeof(frame));
    ck_assert_int_gt(n, 0);
    /* the direct encoder's bytes are nanopb's */
    ck_assert_int_eq(kvp_wire_encode_frame(kvpool_Request_fields, &req, ref, sizeof(ref)), n);
    ck_assert_int_eq(memcmp(frame, ref, (size_t)n), 0);

    static server_arrays_t a;
    static kvpool_Request sreq;
    server_arrays(&a, 33, 6);
    ck_assert_int_eq(server_decode(frame, n, &sreq, &a), 0);
    ck_assert_uint_eq(sreq.which_body, kvpool_Request_reserve_tag);
    ck_assert_uint_eq(a.b.seq_ids.count, 3);
    ck_assert_uint_eq(a.b.num_tokens.count, 3);
    ck_assert_uint_eq(a.b.token_ids.count, 33);
    ck_assert_uint_eq(a.b.salts.count, 6);
    ck_assert_uint_eq(a.b.salt_lens.count, 3);
    ck_assert_int_eq(memcmp(a.ids, ids, sizeof(ids)), 0);
    ck_assert_int_eq(memcmp(a.token_ids, token_ids, sizeof(token_ids)), 0);
    ck_assert_int_eq(a.token_ids[33], 0x5a5a5a5a); /* nothing past the data */
    ck_assert_int_eq(memcmp(a.salts, salts, sizeof(salts)), 0);
    ck_assert_int_eq(memcmp(a.salt_lens, salt_lens, sizeof(salt_lens)), 0);
    ck_assert(sreq.body.reserve.has_cache);
    ck_assert(sreq.body.reserve.cache.reuse);
    ck_assert(sreq.body.reserve.cache.leave_last);
    ck_assert(sreq.body.reserve.cache.has_priority); /* 0 is a priority, not "absent" */
    ck_assert_uint_eq(sreq.body.reserve.cache.priority, 0);
    ck_assert_uint_eq(sreq.body.reserve.cache.retention_ms, 60000);

    /* one token id more than the daemon's bound: refused by its decoder, with the reason */
    server_arrays(&a, 32, 6);
    ck_assert_int_eq(server_decode(frame, n, &sreq, &a), KVP_EINVAL);
    ck_assert_int_eq(a.b.token_ids.bad, KVP_ELIMIT);
    ck_assert_int_eq(a.b.seq_ids.bad, 0);
    /* salts likewise */
    server_arrays(&a, 33, 5);
    ck_assert_int_eq(server_decode(frame, n, &sreq, &a), KVP_EINVAL);
    ck_assert_int_eq(a.b.salts.bad, KVP_ELIMIT);
    /* a daemon that prepared no token-id array (zeroed: elem_size 0) refuses them, no crash */
    server_arrays(&a, 33, 6);
    memset(&a.b.token_ids, 0, sizeof(a.b.token_ids));
    ck_assert_int_eq(server_decode(frame, n, &sreq, &a), KVP_EINVAL);
    ck_assert_int_eq(a.b.token_ids.bad, KVP_ELIMIT);

    /* without the cache: no token ids, no salts, no options on the wire */
    kvp__client_batch_arrays(&b, ids, toks, 3);
    ck_assert_int_eq(kvp__client_request_batch(&req, kvpool_Request_reserve_tag, &b), 0);
    req.id = 77;
    n = kvp_wire_encode_request_frame(&req, frame, sizeof(frame));
    ck_assert_int_eq(n, 4 + 2 + 2 + 2 + (2 + 24) + (2 + 12)); /* hdr, id, body, batch, 2 arrays */
    server_arrays(&a, 33, 6);
    ck_assert_int_eq(server_decode(frame, n, &sreq, &a), 0);
    ck_assert_uint_eq(a.b.token_ids.count, 0);
    ck_assert_uint_eq(a.b.salts.count, 0);
    ck_assert_uint_eq(a.b.salt_lens.count, 0);
    ck_assert(!sreq.body.reserve.has_cache);
}
END_TEST

START_TEST(client_cache_arguments_are_checked_before_anything_is_sent)
{
    uint64_t ids[2] = {1, 2};
    uint32_t toks[2] = {3, 4};
    int32_t token_ids[7] = {1, 2, 3, 4, 5, 6, 7};
    uint8_t salt[2] = {1, 2};
    uint32_t lens[2] = {2, 0}, zero_lens[2] = {0, 0};
    kvp_batch_arrays_t b;
    const char *why = NULL;

    kvp__client_batch_arrays(&b, ids, toks, 2);
    kvp_cache_opts_t c1 = {.salts = salt, .priority = -1}; /* salts without lengths */
    ck_assert_int_eq(kvp__client_batch_cache(&b, toks, 2, &c1, &why), KVP_EINVAL);
    ck_assert_str_eq(why, "salts given without salt_lens");
    kvp_cache_opts_t c2 = {.salt_lens = lens, .priority = -1}; /* lengths without bytes */
    ck_assert_int_eq(kvp__client_batch_cache(&b, toks, 2, &c2, &why), KVP_EINVAL);
    ck_assert_str_eq(why, "salt_lens name salt bytes but salts is NULL");
    kvp_cache_opts_t c3 = {.salt_lens = zero_lens, .priority = -1}; /* all empty: fine */
    ck_assert_int_eq(kvp__client_batch_cache(&b, toks, 2, &c3, &why), 0);
    ck_assert_uint_eq(b.salt_lens.count, 2);
    ck_assert_uint_eq(b.salts.count, 0);
    kvp_cache_opts_t c4 = {.token_ids = token_ids, .priority = -1};
    ck_assert_int_eq(kvp__client_batch_cache(&b, NULL, 2, &c4, &why), KVP_EINVAL);
    uint32_t huge[2] = {UINT32_MAX, 1};
    ck_assert_int_eq(kvp__client_batch_cache(&b, huge, 2, &c4, &why), KVP_EINVAL);
    kvp__client_batch_arrays(&b, ids, toks, 2);
    ck_assert_int_eq(kvp__client_batch_cache(&b, toks, 2, &c4, &why), 0);
    ck_assert_uint_eq(b.token_ids.count, 7); /* sum(num_tokens) */
    ck_assert_ptr_eq(b.token_ids.data, token_ids);
    ck_assert_int_eq(kvp__client_batch_cache(&b, toks, 2, NULL, &why), 0);

    kvpool_CacheOptions o;
    bool has = true;
    ck_assert_int_eq(kvp__client_cache_options(&o, &has, &c4), 0);
    ck_assert(!has); /* token ids only: every option is the default, none sent */
    kvp_cache_opts_t bad = {.priority = -2};
    ck_assert_int_eq(kvp__client_cache_options(&o, &has, &bad), KVP_EINVAL);
    kvp_cache_opts_t p100 = {.priority = 100};
    ck_assert_int_eq(kvp__client_cache_options(&o, &has, &p100), 0);
    ck_assert(has && o.has_priority && o.priority == 100 && !o.reuse);
    kvp_cache_opts_t ret = {.priority = -1, .retention_ms = 5};
    ck_assert_int_eq(kvp__client_cache_options(&o, &has, &ret), 0);
    ck_assert(has && !o.has_priority && o.retention_ms == 5);
    ck_assert_int_eq(kvp__client_cache_options(&o, &has, NULL), 0);
    ck_assert(!has);
}
END_TEST

START_TEST(commit_lookup_and_pin_requests_decode_exactly_on_the_server)
{
    static server_arrays_t a;
    static kvpool_Request req, sreq;
    uint8_t frame[2048];

    /* Commit: seq ids and the event handle */
    uint64_t ids[2] = {9, UINT64_MAX};
    kvp_batch_arrays_t b;
    kvp__client_batch_arrays(&b, ids, NULL, 2);
    ck_assert_int_eq(kvp__client_request_batch(&req, kvpool_Request_commit_tag, &b), 0);
    req.body.commit.event_handle.size = 64;
    for (int i = 0; i < 64; i++)
        req.body.commit.event_handle.bytes[i] = (uint8_t)(i * 3);
    req.id = 1;
    long n = kvp_wire_encode_request_frame(&req, frame, sizeof(frame));
    ck_assert_int_gt(n, 0);
    server_arrays(&a, 16, 16);
    ck_assert_int_eq(server_decode(frame, n, &sreq, &a), 0);
    ck_assert_uint_eq(sreq.which_body, kvpool_Request_commit_tag);
    ck_assert_uint_eq(a.b.seq_ids.count, 2);
    ck_assert_uint_eq(a.ids[1], UINT64_MAX);
    ck_assert_uint_eq(a.b.num_tokens.count, 0);
    ck_assert_uint_eq(sreq.body.commit.event_handle.size, 64);
    ck_assert_uint_eq(sreq.body.commit.event_handle.bytes[63], (uint8_t)(63 * 3));

    /* Lookup: token_ids -> token_ids, lengths -> num_tokens, salts, salt_lens */
    int32_t prompts[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, -10};
    uint32_t lengths[3] = {4, 0, 6};
    uint8_t salts[3] = {7, 8, 9};
    uint32_t salt_lens[3] = {0, 3, 0};
    kvp__client_batch_arrays(&b, NULL, lengths, 3);
    b.token_ids = kvp_array(prompts, 4, 10, 10);
    b.salts = kvp_array(salts, 1, 3, 3);
    b.salt_lens = kvp_array(salt_lens, 4, 3, 3);
    memset(&req, 0, sizeof(req));
    req.which_body = kvpool_Request_lookup_tag;
    kvp_wire_lookup_request_bind_encode(&req.body.lookup, &b);
    n = kvp_wire_encode_request_frame(&req, frame, sizeof(frame));
    ck_assert_int_gt(n, 0);
    server_arrays(&a, 10, 16);
    ck_assert_int_eq(server_decode(frame, n, &sreq, &a), 0);
    ck_assert_uint_eq(sreq.which_body, kvpool_Request_lookup_tag);
    ck_assert_uint_eq(a.b.token_ids.count, 10);
    ck_assert_int_eq(memcmp(a.token_ids, prompts, sizeof(prompts)), 0);
    ck_assert_uint_eq(a.b.num_tokens.count, 3);
    ck_assert_int_eq(memcmp(a.toks, lengths, sizeof(lengths)), 0);
    ck_assert_uint_eq(a.b.salts.count, 3);
    ck_assert_int_eq(memcmp(a.salts, salts, 3), 0);
    ck_assert_uint_eq(a.b.salt_lens.count, 3);
    ck_assert_uint_eq(a.salt_lens[1], 3);
    ck_assert_uint_eq(a.b.seq_ids.count, 0);
    server_arrays(&a, 9, 16); /* a Lookup over the token bound */
    ck_assert_int_eq(server_decode(frame, n, &sreq, &a), KVP_EINVAL);
    ck_assert_int_eq(a.b.token_ids.bad, KVP_ELIMIT);

    /* Lookup without salts: the fields are left out */
    b.salts = kvp_array(NULL, 1, 0, 0);
    b.salt_lens = kvp_array(NULL, 4, 0, 0);
    kvp_wire_lookup_request_bind_encode(&req.body.lookup, &b);
    n = kvp_wire_encode_request_frame(&req, frame, sizeof(frame));
    server_arrays(&a, 10, 16);
    ck_assert_int_eq(server_decode(frame, n, &sreq, &a), 0);
    ck_assert_uint_eq(a.b.salts.count, 0);
    ck_assert_uint_eq(a.b.salt_lens.count, 0);
    ck_assert_uint_eq(a.b.token_ids.count, 10);

    /* Pin: token ids, salt, ttl */
    memset(&req, 0, sizeof(req));
    req.which_body = kvpool_Request_pin_tag;
    kvp__client_batch_arrays(&b, NULL, NULL, 0);
    b.token_ids = kvp_array(prompts, 4, 10, 10);
    kvp_wire_pin_request_bind_encode(&req.body.pin, &b);
    memcpy(req.body.pin.salt.bytes, "tenant-9", 8);
    req.body.pin.salt.size = 8;
    req.body.pin.ttl_ms = 1234;
    n = kvp_wire_encode_request_frame(&req, frame, sizeof(frame));
    ck_assert_int_gt(n, 0);
    server_arrays(&a, 10, 16);
    ck_assert_int_eq(server_decode(frame, n, &sreq, &a), 0);
    ck_assert_uint_eq(sreq.which_body, kvpool_Request_pin_tag);
    ck_assert_uint_eq(a.b.token_ids.count, 10);
    ck_assert_int_eq(a.token_ids[9], -10);
    ck_assert_uint_eq(sreq.body.pin.salt.size, 8);
    ck_assert_int_eq(memcmp(sreq.body.pin.salt.bytes, "tenant-9", 8), 0);
    ck_assert_uint_eq(sreq.body.pin.ttl_ms, 1234);
    server_arrays(&a, 3, 16);
    ck_assert_int_eq(server_decode(frame, n, &sreq, &a), KVP_EINVAL);
    ck_assert_int_eq(a.b.token_ids.bad, KVP_ELIMIT);
}
END_TEST

START_TEST(cached_tokens_land_in_the_table_or_read_as_zeros)
{
    static const uint32_t cached[4] = {32, 0, 16, 0};
    static const pb_size_t bodies[] = {kvpool_Response_reserve_tag, kvpool_Response_append_tag,
                                       kvpool_Response_get_page_table_tag};
    uint8_t frame[1024];
    table_buf_t b;
    for (size_t k = 0; k < 3; k++) {
        long n =
            encode_seed_table_cached(bodies[k], 3, frame, sizeof(frame), seed_indptr, cached, 4);
        ck_assert_int_gt(n, 0);
        table_init(&b, 5, 8, 2);
        ck_assert_int_eq(client_decode_table(frame, n, &b.t, NULL, 0), 0);
        ck_assert_uint_eq(b.t.batch_size, 4);
        ck_assert_int_eq(memcmp(b.cached, cached, sizeof(cached)), 0);
        ck_assert_uint_eq(b.cached[4], 0x7f7f7f7f);
        ck_assert_int_eq(memcmp(b.indices, seed_indices, sizeof(seed_indices)), 0);
    }

    /* an answer without cached_tokens: zeros in the caller's array, exactly batch_size */
    long n = encode_seed_table(kvpool_Response_reserve_tag, 3, frame, sizeof(frame), seed_indptr);
    table_init(&b, 5, 8, 2);
    ck_assert_int_eq(client_decode_table(frame, n, &b.t, NULL, 0), 0);
    static const uint32_t zeros[4];
    ck_assert_int_eq(memcmp(b.cached, zeros, sizeof(zeros)), 0);
    ck_assert_uint_eq(b.cached[4], 0x7f7f7f7f);

    /* not wanted (NULL): skipped, the rest read as before */
    n = encode_seed_table_cached(kvpool_Response_reserve_tag, 3, frame, sizeof(frame), seed_indptr,
                                 cached, 4);
    table_init(&b, 5, 8, 2);
    b.t.cached_tokens = NULL;
    ck_assert_int_eq(client_decode_table(frame, n, &b.t, NULL, 0), 0);
    ck_assert_uint_eq(b.cached[0], 0x7f7f7f7f);
    ck_assert_int_eq(memcmp(b.last, seed_last, sizeof(seed_last)), 0);

    /* a row count other than batch_size is a protocol error */
    n = encode_seed_table_cached(kvpool_Response_reserve_tag, 3, frame, sizeof(frame), seed_indptr,
                                 cached, 3);
    table_init(&b, 5, 8, 2);
    ck_assert_int_eq(client_decode_table(frame, n, &b.t, NULL, 0), KVP_EPROTO);
    /* more rows than the caller's cap: KVP_ELIMIT naming the array */
    n = encode_seed_table_cached(kvpool_Response_reserve_tag, 3, frame, sizeof(frame), seed_indptr,
                                 cached, 4);
    table_init(&b, 5, 8, 2);
    uint32_t small[3];
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, &b.t);
    r.cached_tokens = kvp_array(small, 4, 0, 3);
    static kvpool_Response resp;
    char err[200];
    ck_assert_int_eq(
        kvp__client_decode_response(&resp, &r, frame + 4, (size_t)n - 4, err, sizeof(err)),
        KVP_ELIMIT);
    ck_assert_ptr_nonnull(strstr(err, "cached_tokens"));
}
END_TEST

START_TEST(lookup_answer_lands_in_the_callers_array)
{
    static kvpool_Response resp;
    uint32_t answer[3] = {48, 0, 16};
    kvp_reply_arrays_t out;
    memset(&out, 0, sizeof(out));
    out.cached_tokens = kvp_array(answer, 4, 3, 3);
    resp.id = 12;
    resp.which_body = kvpool_Response_lookup_tag;
    kvp_wire_lookup_bind_encode(&resp.body.lookup, &out);
    uint8_t frame[256];
    long n = kvp_wire_encode_response_frame(&resp, frame, sizeof(frame)); /* nanopb's path */
    ck_assert_int_eq(n, 4 + 2 + (2 + 1) + 2 + 12); /* hdr, id, body (tag 51: 2-byte key), array */

    uint32_t got[4] = {7, 7, 7, 7};
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, NULL);
    r.cached_tokens = kvp_array(got, 4, 0, 3);
    memset(&resp, 0, sizeof(resp));
    ck_assert_int_eq(kvp__client_decode_response(&resp, &r, frame + 4, (size_t)n - 4, NULL, 0), 0);
    ck_assert_uint_eq(resp.which_body, kvpool_Response_lookup_tag);
    ck_assert_uint_eq(r.cached_tokens.count, 3);
    ck_assert_int_eq(memcmp(got, answer, sizeof(answer)), 0);
    ck_assert_uint_eq(got[3], 7);

    r.cached_tokens = kvp_array(got, 4, 0, 2); /* fewer prompts than the answer */
    char err[200];
    ck_assert_int_eq(
        kvp__client_decode_response(&resp, &r, frame + 4, (size_t)n - 4, err, sizeof(err)),
        KVP_ELIMIT);
    ck_assert_ptr_nonnull(strstr(err, "cached_tokens"));
    /* kvpoolctl's zeroed arrays (data NULL, elem_size 0): skipped, counted in bytes */
    memset(&r, 0, sizeof(r));
    ck_assert_int_eq(kvp__client_decode_response(&resp, &r, frame + 4, (size_t)n - 4, NULL, 0), 0);
    ck_assert_uint_eq(r.cached_tokens.count, 12); /* the client's sink counts bytes */
}
END_TEST

/* Server side: a Lookup answer of n prompts, host_tokens too when host is not NULL. */
static long encode_lookup_answer(uint8_t *frame, size_t cap, const uint32_t *cached,
                                 const uint32_t *host, uint32_t n)
{
    static kvpool_Response resp;
    memset(&resp, 0, sizeof(resp));
    kvp_reply_arrays_t out;
    memset(&out, 0, sizeof(out));
    out.cached_tokens = kvp_array((void *)cached, 4, n, n);
    out.host_tokens = kvp_array((void *)host, 4, host ? n : 0, n);
    resp.id = 13;
    resp.which_body = kvpool_Response_lookup_tag;
    kvp_wire_lookup_bind_encode(&resp.body.lookup, &out);
    return kvp_wire_encode_response_frame(&resp, frame, cap);
}

START_TEST(lookup_answer_with_and_without_host_tokens_decodes_exactly)
{
    static const uint32_t cached[3] = {48, 0, 16}, host[3] = {32, 64, 0};
    static kvpool_Response resp;
    uint8_t frame[256];
    char err[200];

    /* with a host tier: field 2, one uint32 per prompt, each array exactly where it belongs */
    long n = encode_lookup_answer(frame, sizeof(frame), cached, host, 3);
    ck_assert_int_eq(n, 4 + 2 + (2 + 1) + (2 + 12) + (2 + 12)); /* hdr, id, body, two arrays */
    uint32_t got[4] = {7, 7, 7, 7}, got_host[4] = {9, 9, 9, 9};
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, NULL);
    r.cached_tokens = kvp_array(got, 4, 0, 3);
    r.host_tokens = kvp_array(got_host, 4, 0, 3);
    ck_assert_int_eq(kvp__client_decode_response(&resp, &r, frame + 4, (size_t)n - 4, NULL, 0), 0);
    ck_assert_uint_eq(resp.which_body, kvpool_Response_lookup_tag);
    ck_assert_uint_eq(r.cached_tokens.count, 3);
    ck_assert_uint_eq(r.host_tokens.count, 3);
    ck_assert_int_eq(memcmp(got, cached, sizeof(cached)), 0);
    ck_assert_int_eq(memcmp(got_host, host, sizeof(host)), 0);
    ck_assert_uint_eq(got[3], 7); /* nothing past the data */
    ck_assert_uint_eq(got_host[3], 9);

    /* not wanted (a plain kvp_client_lookup): skipped but counted, cached_tokens as before */
    memset(got, 0, sizeof(got));
    kvp__client_table_arrays(&r, NULL);
    r.cached_tokens = kvp_array(got, 4, 0, 3);
    ck_assert_int_eq(kvp__client_decode_response(&resp, &r, frame + 4, (size_t)n - 4, NULL, 0), 0);
    ck_assert_uint_eq(r.host_tokens.count, 3);
    ck_assert_int_eq(memcmp(got, cached, sizeof(cached)), 0);

    /* fewer prompts than the answer: KVP_ELIMIT naming host_tokens */
    kvp__client_table_arrays(&r, NULL);
    r.cached_tokens = kvp_array(got, 4, 0, 3);
    r.host_tokens = kvp_array(got_host, 4, 0, 2);
    ck_assert_int_eq(
        kvp__client_decode_response(&resp, &r, frame + 4, (size_t)n - 4, err, sizeof(err)),
        KVP_ELIMIT);
    ck_assert_ptr_nonnull(strstr(err, "host_tokens"));

    /* without a host tier the field is absent: count 0, the caller's array untouched */
    n = encode_lookup_answer(frame, sizeof(frame), cached, NULL, 3);
    ck_assert_int_eq(n, 4 + 2 + (2 + 1) + (2 + 12));
    uint32_t untouched[3] = {5, 5, 5};
    kvp__client_table_arrays(&r, NULL);
    r.cached_tokens = kvp_array(got, 4, 0, 3);
    r.host_tokens = kvp_array(untouched, 4, 0, 3);
    ck_assert_int_eq(kvp__client_decode_response(&resp, &r, frame + 4, (size_t)n - 4, NULL, 0), 0);
    ck_assert_uint_eq(r.cached_tokens.count, 3);
    ck_assert_uint_eq(r.host_tokens.count, 0);
    ck_assert_uint_eq(untouched[0], 5);
    ck_assert_uint_eq(untouched[2], 5);
}
END_TEST

/* Client side as kvp_client_load builds it: token ids (int32, bound as an array), the salt, the
 * destination (Source) and max_tokens; decoded by the daemon's kvp_wire_request_bind_decode. */
START_TEST(load_request_decodes_exactly_on_the_server)
{
    static server_arrays_t a;
    static kvpool_Request req, sreq;
    uint8_t frame[2048];
    int32_t prompt[40];
    for (int i = 0; i < 40; i++)
        prompt[i] = i % 3 ? 1000 + i : -i; /* negative ids survive as int32 */
    memset(&req, 0, sizeof(req));
    req.which_body = kvpool_Request_load_tag;
    req.id = 0x55;
    kvp_array_t ids = kvp_array(prompt, 4, 40, 40);
    kvp_array_bind_encode(&req.body.load.token_ids, &ids);
    memcpy(req.body.load.salt.bytes, "lora-7", 6);
    req.body.load.salt.size = 6;
    req.body.load.has_dest = true;
    const kvp_src_layout_t l = {.k_offset = 4096,
                                .v_offset = 1ull << 33,
                                .k_stride_n = 512,
                                .k_stride_h = 128,
                                .v_stride_n = 1024,
                                .v_stride_h = 256,
                                .layer_stride = 1ull << 20};
    kvp_wire_source_put(&req.body.load.dest, 9, &l, 1, 3);
    req.body.load.max_tokens = 32;
    long n = kvp_wire_encode_request_frame(&req, frame, sizeof(frame)); /* nanopb's path */
    ck_assert_int_gt(n, 0);

    server_arrays(&a, 40, 16);
    ck_assert_int_eq(server_decode(frame, n, &sreq, &a), 0);
    ck_assert_uint_eq(sreq.id, 0x55);
    ck_assert_uint_eq(sreq.which_body, kvpool_Request_load_tag);
    ck_assert_uint_eq(a.b.token_ids.count, 40);
    ck_assert_int_eq(memcmp(a.token_ids, prompt, sizeof(prompt)), 0);
    ck_assert_int_eq(a.token_ids[40], 0x5a5a5a5a); /* nothing past the data */
    ck_assert_uint_eq(a.b.seq_ids.count, 0);
    ck_assert_uint_eq(a.b.salts.count, 0); /* the salt is the message's own field */
    const kvpool_LoadRequest *q = &sreq.body.load;
    ck_assert_uint_eq(q->salt.size, 6);
    ck_assert_int_eq(memcmp(q->salt.bytes, "lora-7", 6), 0);
    ck_assert(q->has_dest);
    ck_assert_uint_eq(q->dest.buffer_id, 9);
    kvp_src_layout_t back;
    kvp_wire_source_layout(&q->dest, &back);
    ck_assert_int_eq(memcmp(&back, &l, sizeof(l)), 0);
    ck_assert_uint_eq(q->dest.layer_begin, 1);
    ck_assert_uint_eq(q->dest.layer_end, 3);
    ck_assert_uint_eq(q->max_tokens, 32);

    /* one token id more than the daemon's bound: refused by its decoder, with the reason */
    server_arrays(&a, 39, 16);
    ck_assert_int_eq(server_decode(frame, n, &sreq, &a), KVP_EINVAL);
    ck_assert_int_eq(a.b.token_ids.bad, KVP_ELIMIT);
}
END_TEST

/* ---- a scripted fake daemon on a real socket ------------------------------------------- */

enum { FAKE_MAX_IDS = 64, FAKE_POOL_BYTES = 1 << 20 };

typedef struct {
    char path[108];
    int lfd;
    pthread_t th;
    int joined;
    /* script */
    kvpool_BackendKind backend;
    kvpool_Code hello_code;
    int ping_silent;   /* never answer a Ping */
    int ping_wrong_id; /* answer a Ping with another id */
    /* what happened */
    kvpool_HelloRequest hello;
    uint64_t ids[FAKE_MAX_IDS];
    unsigned nids;
    int pool_fd;   /* the pool memfd the fake hands out (kept) */
    int buf_fd;    /* the staging buffer received (kept) */
    int buf_seals; /* its seals */
    uint64_t buf_size;
    uint32_t unregistered;
    uint64_t reserve_ids[4];
    uint32_t reserve_toks[4];
    uint32_t reserve_n;
    /* the prefix cache's calls: what the last one carried */
    pb_size_t cache_body; /* Reserve or Append */
    uint32_t token_n, salt_n, salt_lens_n;
    int32_t token_ids[256];
    uint8_t salts[256];
    uint32_t salt_lens[64];
    bool has_cache;
    kvpool_CacheOptions cache;
    uint32_t commit_n;
    kvpool_CommitRequest_event_handle_t commit_event;
    uint32_t lookup_n;
    kvpool_PinRequest pin;
    uint64_t unpinned;
    kvpool_CacheFlushRequest flush;
    int lookup_host;         /* answer Lookups with host_tokens (a daemon with a host tier) */
    kvpool_LoadRequest load; /* the last Load (its token ids in token_ids / token_n) */
    uint32_t load_n;         /* Loads received */
    int load_overshoot;      /* answer a Load with more tokens than the prompt has */
    kvpool_Response resp;
} fake_t;

static void fake_status(kvpool_Response *resp, kvpool_Code code, const char *msg)
{
    resp->has_status = true;
    resp->status.code = code;
    snprintf(resp->status.message, sizeof(resp->status.message), "%s", msg);
}

static void *fake_main(void *arg)
{
    fake_t *f = arg;
    int c = accept4(f->lfd, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0)
        return NULL;
    uint8_t *in = NULL, *out = malloc(1 << 16);
    size_t cap = 0;
    for (;;) {
        uint32_t len;
        int fds[KVP_MAX_FDS_PER_FRAME];
        unsigned nfds = 0;
        if (kvp_sock_recv_frame(c, &in, &cap, &len, 1 << 20, fds, KVP_MAX_FDS_PER_FRAME, &nfds,
                                KVP_SOCK_NO_DEADLINE))
            break;
        kvpool_Request req;
        memset(&req, 0, sizeof(req));
        uint64_t ids[64];
        uint32_t toks[64], salt_lens[64];
        int32_t token_ids[256];
        uint8_t salts[256];
        kvp_batch_arrays_t b = {.seq_ids = kvp_array(ids, 8, 0, 64),
                                .num_tokens = kvp_array(toks, 4, 0, 64),
                                .token_ids = kvp_array(token_ids, 4, 0, 256),
                                .salts = kvp_array(salts, 1, 0, 256),
                                .salt_lens = kvp_array(salt_lens, 4, 0, 64)};
        kvp_wire_request_bind_decode(&req, &b);
        if (kvp_wire_decode(kvpool_Request_fields, &req, in, len, NULL))
            break;
        if (f->nids < FAKE_MAX_IDS)
            f->ids[f->nids++] = req.id;
        kvpool_Response *resp = &f->resp;
        memset(resp, 0, sizeof(*resp));
        resp->id = req.id;
        int send_fd = -1;
        long n = 0;
        switch (req.which_body) {
        case kvpool_Request_hello_tag: {
            f->hello = req.body.hello;
            if (f->hello_code != kvpool_Code_OK) {
                fake_status(resp, f->hello_code, "namespace is owned by another user");
                break;
            }
            resp->which_body = kvpool_Response_hello_tag;
            kvpool_HelloResponse *h = &resp->body.hello;
            h->protocol_version = KVP_PROTOCOL_VERSION;
            snprintf(h->server_version, sizeof(h->server_version), "9.9.9-fake");
            h->session_id = 4242;
            h->has_pool = true;
            h->pool.has_geometry = true;
            h->pool.geometry.num_layers = 2;
            h->pool.geometry.num_pages = 16;
            h->pool.geometry.page_size = 16;
            h->pool.geometry.num_kv_heads = 2;
            h->pool.geometry.head_dim = 64;
            h->pool.geometry.dtype = kvpool_DType_FP16;
            h->pool.geometry.num_devices = 1;
            h->pool.backend = f->backend;
            h->pool.pool_bytes = FAKE_POOL_BYTES;
            h->pool.layer_bytes = FAKE_POOL_BYTES / 2;
            h->pool.elem_bytes = 2;
            h->pool.device_ids_count = 1;
            h->pool.device_ids[0] = 3;
            h->pool.map_granularity = 2 << 20;
            if (req.body.hello.want_pool_fds) {
                h->pool.num_fds = 1;
                send_fd = f->pool_fd;
            }
            break;
        }
        case kvpool_Request_ping_tag:
            if (f->ping_silent)
                continue;
            resp->which_body = kvpool_Response_ping_tag;
            resp->body.ping.nonce = req.body.ping.nonce;
            if (f->ping_wrong_id)
                resp->id = req.id + 1;
            break;
        case kvpool_Request_fork_tag:
            fake_status(resp, kvpool_Code_NOT_FOUND, "sequence 7 not found");
            break;
        case kvpool_Request_register_buffer_tag:
            if (nfds == 1) {
                f->buf_fd = fds[0];
                f->buf_seals = fcntl(fds[0], F_GET_SEALS);
                f->buf_size = req.body.register_buffer.size_bytes;
                nfds = 0;
            }
            resp->which_body = kvpool_Response_register_buffer_tag;
            resp->body.register_buffer.buffer_id = 5;
            break;
        case kvpool_Request_unregister_buffer_tag:
            f->unregistered = req.body.unregister_buffer.buffer_id;
            resp->which_body = kvpool_Response_unregister_buffer_tag;
            break;
        case kvpool_Request_reserve_tag:
        case kvpool_Request_append_tag: {
            int is_reserve = req.which_body == kvpool_Request_reserve_tag;
            f->reserve_n = b.seq_ids.count;
            memcpy(f->reserve_ids, ids, sizeof(f->reserve_ids));
            memcpy(f->reserve_toks, toks, sizeof(f->reserve_toks));
            f->cache_body = req.which_body;
            f->token_n = b.token_ids.count;
            f->salt_n = b.salts.count;
            f->salt_lens_n = b.salt_lens.count;
            memcpy(f->token_ids, token_ids, sizeof(f->token_ids));
            memcpy(f->salts, salts, sizeof(f->salts));
            memcpy(f->salt_lens, salt_lens, sizeof(f->salt_lens));
            f->has_cache = is_reserve ? req.body.reserve.has_cache : req.body.append.has_cache;
            f->cache = is_reserve ? req.body.reserve.cache : req.body.append.cache;
            static const uint32_t cached[4] = {32, 0, 16, 0};
            n = encode_seed_table_cached(
                is_reserve ? kvpool_Response_reserve_tag : kvpool_Response_append_tag, req.id, out,
                1 << 16, seed_indptr, cached, f->cache.reuse ? 4 : 0);
            break;
        }
        case kvpool_Request_commit_tag:
            f->commit_n = b.seq_ids.count;
            f->commit_event = req.body.commit.event_handle;
            resp->which_body = kvpool_Response_commit_tag;
            resp->body.commit.pages = 2 * b.seq_ids.count;
            resp->body.commit.published =
                req.body.commit.event_handle.size ? 0 : 2 * b.seq_ids.count;
            break;
        case kvpool_Request_lookup_tag: {
            /* whole pages of 16 of each prompt, as a daemon with everything cached answers */
            f->lookup_n = b.num_tokens.count;
            f->token_n = b.token_ids.count;
            f->salt_n = b.salts.count;
            f->salt_lens_n = b.salt_lens.count;
            memcpy(f->token_ids, token_ids, sizeof(f->token_ids));
            memcpy(f->salts, salts, sizeof(f->salts));
            memcpy(f->salt_lens, salt_lens, sizeof(f->salt_lens));
            static uint32_t answer[64];
            for (uint32_t i = 0; i < b.num_tokens.count; i++)
                answer[i] = toks[i] / 16 * 16;
            /* with a host tier: the first page on the GPU, the other whole pages in host
             * memory */
            static uint32_t host_answer[64];
            for (uint32_t i = 0; f->lookup_host && i < b.num_tokens.count; i++) {
                host_answer[i] = answer[i] > 16 ? answer[i] - 16 : 0;
                answer[i] -= host_answer[i];
            }
            static kvp_reply_arrays_t la;
            memset(&la, 0, sizeof(la));
            la.cached_tokens = kvp_array(answer, 4, b.num_tokens.count, 0);
            if (f->lookup_host)
                la.host_tokens = kvp_array(host_answer, 4, b.num_tokens.count, 0);
            resp->which_body = kvpool_Response_lookup_tag;
            kvp_wire_lookup_bind_encode(&resp->body.lookup, &la);
            break;
        }
        case kvpool_Request_pin_tag:
            f->pin = req.body.pin;
            f->token_n = b.token_ids.count;
            memcpy(f->token_ids, token_ids, sizeof(f->token_ids));
            if (b.token_ids.count < 16) {
                fake_status(resp, kvpool_Code_NOT_FOUND, "nothing of the prompt is cached");
                break;
            }
            resp->which_body = kvpool_Response_pin_tag;
            resp->body.pin.pin_id = 0x1234567890ull;
            resp->body.pin.pinned_tokens = b.token_ids.count / 16 * 16;
            resp->body.pin.pinned_pages = b.token_ids.count / 16;
            resp->body.pin.expires_in_ms = req.body.pin.ttl_ms ? req.body.pin.ttl_ms : 600000;
            break;
        case kvpool_Request_load_tag: {
            /* whole pages of 16 (max_tokens caps them), the last 16 from the host tier */
            f->load = req.body.load;
            f->load_n++;
            f->token_n = b.token_ids.count;
            memcpy(f->token_ids, token_ids, sizeof(f->token_ids));
            if (b.token_ids.count < 16) {
                fake_status(resp, kvpool_Code_NOT_FOUND, "nothing of the prompt is cached");
                break;
            }
            uint32_t loaded = b.token_ids.count / 16 * 16;
            if (req.body.load.max_tokens && loaded > req.body.load.max_tokens)
                loaded = req.body.load.max_tokens / 16 * 16;
            resp->which_body = kvpool_Response_load_tag;
            resp->body.load.loaded_tokens = f->load_overshoot ? b.token_ids.count + 16 : loaded;
            resp->body.load.host_tokens = loaded >= 32 ? 16 : 0;
            resp->body.load.completed = true;
            break;
        }
        case kvpool_Request_unpin_tag:
            f->unpinned = req.body.unpin.pin_id;
            resp->which_body = kvpool_Response_unpin_tag;
            resp->body.unpin.pages = 3;
            break;
        case kvpool_Request_cache_flush_tag:
            f->flush = req.body.cache_flush;
            resp->which_body = kvpool_Response_cache_flush_tag;
            resp->body.cache_flush.pages = 7;
            break;
        case kvpool_Request_stats_tag: {
            resp->which_body = kvpool_Response_stats_tag;
            resp->body.stats.has_stats = true;
            kvpool_Stats *st = &resp->body.stats.stats;
            st->num_pages = 16;
            st->has_cache = true;
            st->cache = (kvpool_CacheStats){.cached_pages = 1,
                                            .pinned_pages = 2,
                                            .indexed_pages = 3,
                                            .pins = 4,
                                            .query_tokens_total = 5,
                                            .hit_tokens_total = 6,
                                            .evictions_pressure_total = 7,
                                            .evictions_flush_total = 8,
                                            .evictions_rewrite_total = 9,
                                            .bytes = 1ull << 40};
            /* the host tier's figures (issue #28), each its own value, and one scope */
            kvpool_CacheStats *cs = &st->cache;
            cs->host_pages = 11, cs->host_slots = 12, cs->host_bytes_total = 1ull << 35;
            cs->host_bytes_ready = 14, cs->host_hit_tokens_total = 15, cs->demotions_total = 16;
            cs->promotions_total = 17, cs->host_evictions_total = 18;
            cs->offload_bytes_total = 19, cs->restore_bytes_total = 20;
            cs->offload_us_total = 21, cs->restore_us_total = 22;
            cs->demoting = 23, cs->restoring = 24, cs->host_slot_bytes = 25;
            cs->scopes_count = 1;
            snprintf(cs->scopes[0].name, sizeof(cs->scopes[0].name), "ns:engine-a");
            cs->scopes[0].hit_tokens = 30;
            cs->scopes[0].host_pages = 31;
            cs->scopes[0].host_hit_tokens = 1ull << 33;
            break;
        }
        default:
            fake_status(resp, kvpool_Code_UNIMPLEMENTED, "not in the script");
            break;
        }
        for (unsigned i = 0; i < nfds; i++)
            close(fds[i]);
        if (n == 0)
            n = kvp_wire_encode_frame(kvpool_Response_fields, resp, out, 1 << 16);
        if (n < 0 || kvp_sock_send_frame(c, out, (size_t)n, send_fd >= 0 ? &send_fd : NULL,
                                         send_fd >= 0 ? 1 : 0, KVP_SOCK_NO_DEADLINE))
            break;
    }
    free(in);
    free(out);
    close(c);
    return NULL;
}

static fake_t *fake_start(kvpool_BackendKind backend)
{
    fake_t *f = calloc(1, sizeof(*f));
    ck_assert_ptr_nonnull(f);
    static unsigned counter;
    snprintf(f->path, sizeof(f->path), "/tmp/kvp_test_client_%d_%u.sock", (int)getpid(), counter++);
    unlink(f->path);
    f->backend = backend;
    f->buf_fd = -1;
    f->pool_fd = memfd_create("fake-pool", MFD_CLOEXEC);
    ck_assert_int_ge(f->pool_fd, 0);
    ck_assert_int_eq(ftruncate(f->pool_fd, FAKE_POOL_BYTES), 0);
    ck_assert_int_eq(pwrite(f->pool_fd, "POOL", 4, 0), 4);
    ck_assert_int_eq(pwrite(f->pool_fd, "TAIL", 4, FAKE_POOL_BYTES - 4), 4);
    f->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", f->path);
    ck_assert_int_eq(bind(f->lfd, (struct sockaddr *)&addr, sizeof(addr)), 0);
    ck_assert_int_eq(listen(f->lfd, 4), 0);
    ck_assert_int_eq(pthread_create(&f->th, NULL, fake_main, f), 0);
    return f;
}

/* Waits for the fake to see the client go (the client must have closed by now). */
static void fake_join(fake_t *f)
{
    if (!f->joined)
        pthread_join(f->th, NULL);
    f->joined = 1;
}

static void fake_stop(fake_t *f)
{
    fake_join(f);
    close(f->lfd);
    close(f->pool_fd);
    if (f->buf_fd >= 0)
        close(f->buf_fd);
    unlink(f->path);
    free(f);
}

static kvp_client_t *connect_to(fake_t *f, int map_pool, uint32_t timeout_ms)
{
    kvp_client_opts_t o = {.socket_path = f->path,
                           .ns = "engine-a",
                           .client_name = "worker-0",
                           .lease_ms = 30000,
                           .timeout_ms = timeout_ms,
                           .map_pool = map_pool};
    kvp_client_t *c = NULL;
    char err[256];
    int rc = kvp_client_connect(&o, &c, err, sizeof(err));
    ck_assert_msg(rc == 0, "connect: %s (%s)", kvp_strerror(rc), err);
    return c;
}

START_TEST(hello_maps_the_host_pool_and_ids_count_up_from_a_random_start)
{
    fake_t *f = fake_start(kvpool_BackendKind_BACKEND_HOST);
    kvp_client_t *c = connect_to(f, 1, 5000);
    ck_assert_uint_eq(f->hello.protocol_version, KVP_PROTOCOL_VERSION);
    ck_assert_str_eq(f->hello.namespace, "engine-a");
    ck_assert_str_eq(f->hello.client_name, "worker-0");
    ck_assert(f->hello.has_lease_ms);
    ck_assert_uint_eq(f->hello.lease_ms, 30000);
    ck_assert(f->hello.want_pool_fds);
    ck_assert_uint_eq(kvp_client_session_id(c), 4242);
    ck_assert_str_eq(kvp_client_server_version(c), "9.9.9-fake");
    const kvp_pool_info_t *p = kvp_client_pool_info(c);
    ck_assert_uint_eq(p->num_layers, 2);
    ck_assert_uint_eq(p->pool_bytes, FAKE_POOL_BYTES);
    ck_assert_uint_eq(p->dtype, 3);
    ck_assert_int_eq(p->device_ids[0], 3);
    ck_assert_uint_eq(p->map_granularity, 2u << 20);

    /* the mapping is the daemon's memory, both ways; the fd itself was closed */
    char *base = kvp_client_pool_base(c, 0);
    ck_assert_ptr_nonnull(base);
    ck_assert_ptr_null(kvp_client_pool_base(c, 1));
    ck_assert_int_eq(kvp_client_pool_fd(c, 0), -1);
    ck_assert_int_eq(memcmp(base, "POOL", 4), 0);
    ck_assert_int_eq(memcmp(base + FAKE_POOL_BYTES - 4, "TAIL", 4), 0);
    memcpy(base + 100, "from the worker", 15);
    char check[16] = {0};
    ck_assert_int_eq(pread(f->pool_fd, check, 15, 100), 15);
    ck_assert_str_eq(check, "from the worker");

    uint64_t rtt = 0;
    ck_assert_int_eq(kvp_client_ping(c, &rtt), 0);
    ck_assert_uint_gt(rtt, 0);
    ck_assert_int_eq(kvp_client_ping(c, NULL), 0);
    ck_assert_str_eq(kvp_client_last_error(c), "");
    kvp_client_close(c);
    fake_join(f);
    ck_assert_uint_eq(f->nids, 3);
    ck_assert_uint_ne(f->ids[0], 0);
    ck_assert_uint_eq(f->ids[1], f->ids[0] + 1 + (f->ids[0] + 1 == 0));
    ck_assert_uint_eq(f->ids[2], f->ids[1] + 1 + (f->ids[1] + 1 == 0));
    fake_stop(f);
}
END_TEST

START_TEST(cuda_pool_fds_are_kept_open_and_not_mapped)
{
    fake_t *f = fake_start(kvpool_BackendKind_BACKEND_CUDA);
    kvp_client_t *c = connect_to(f, 1, 5000);
    ck_assert_ptr_null(kvp_client_pool_base(c, 0));
    int fd = kvp_client_pool_fd(c, 0);
    ck_assert_int_ge(fd, 0);
    char check[4];
    ck_assert_int_eq(pread(fd, check, 4, 0), 4);
    ck_assert_int_eq(memcmp(check, "POOL", 4), 0);
    kvp_client_close(c);
    ck_assert_int_eq(fcntl(fd, F_GETFD), -1); /* closed with the handle */
    fake_stop(f);
}
END_TEST

START_TEST(without_map_pool_nothing_is_asked_for_or_mapped)
{
    fake_t *f = fake_start(kvpool_BackendKind_BACKEND_HOST);
    kvp_client_opts_t o = {.socket_path = f->path, .lease_ms = KVP_LEASE_DEFAULT};
    kvp_client_t *c = NULL;
    ck_assert_int_eq(kvp_client_connect(&o, &c, NULL, 0), 0);
    ck_assert(!f->hello.want_pool_fds);
    ck_assert(!f->hello.has_lease_ms); /* the daemon's default lease */
    ck_assert_str_eq(f->hello.namespace, "default");
    ck_assert_str_eq(f->hello.client_name, "test_client_wire"); /* the program's name */
    ck_assert_ptr_null(kvp_client_pool_base(c, 0));
    ck_assert_int_eq(kvp_client_pool_fd(c, 0), -1);
    ck_assert_uint_eq(kvp_client_pool_info(c)->num_pages, 16);
    kvp_client_close(c);
    fake_stop(f);
}
END_TEST

START_TEST(status_errors_map_to_codes_and_messages)
{
    fake_t *f = fake_start(kvpool_BackendKind_BACKEND_HOST);
    kvp_client_t *c = connect_to(f, 0, 5000);
    ck_assert_int_eq(kvp_client_fork(c, 7, 8), KVP_ENOENT);
    ck_assert_str_eq(kvp_client_last_error(c), "sequence 7 not found");
    ck_assert_int_eq(kvp_client_truncate(c, 7, 1), KVP_EINTERNAL); /* UNIMPLEMENTED */
    ck_assert_int_eq(kvp_client_ping(c, NULL), 0);
    ck_assert_str_eq(kvp_client_last_error(c), "");
    kvp_client_close(c);
    fake_stop(f);
}
END_TEST

START_TEST(hello_refused_by_the_daemon_fails_connect_with_its_message)
{
    fake_t *f = fake_start(kvpool_BackendKind_BACKEND_HOST);
    f->hello_code = kvpool_Code_PERMISSION_DENIED;
    kvp_client_opts_t o = {.socket_path = f->path, .ns = "x"};
    kvp_client_t *c = (kvp_client_t *)0x1;
    char err[256];
    ck_assert_int_eq(kvp_client_connect(&o, &c, err, sizeof(err)), KVP_EPERM);
    ck_assert_str_eq(err, "namespace is owned by another user");
    ck_assert_ptr_eq(c, (kvp_client_t *)0x1);
    fake_stop(f);
}
END_TEST

START_TEST(connect_to_nothing_is_enoent_with_a_message)
{
    kvp_client_opts_t o = {.socket_path = "/tmp/kvp_test_client_no_such.sock"};
    unlink(o.socket_path);
    kvp_client_t *c = NULL;
    char err[256];
    ck_assert_int_eq(kvp_client_connect(&o, &c, err, sizeof(err)), -ENOENT);
    ck_assert_ptr_nonnull(strstr(err, "/tmp/kvp_test_client_no_such.sock"));
    o.ns = "a-namespace-name-that-is-far-too-long-for-the-sixty-three-byte-limit";
    ck_assert_int_eq(kvp_client_connect(&o, &c, err, sizeof(err)), KVP_EINVAL);
}
END_TEST

START_TEST(a_reply_with_another_id_breaks_the_connection)
{
    fake_t *f = fake_start(kvpool_BackendKind_BACKEND_HOST);
    kvp_client_t *c = connect_to(f, 0, 5000);
    f->ping_wrong_id = 1;
    ck_assert_int_eq(kvp_client_ping(c, NULL), KVP_EPROTO);
    ck_assert_ptr_nonnull(strstr(kvp_client_last_error(c), "does not match"));
    ck_assert_int_eq(kvp_client_ping(c, NULL), KVP_ECLOSED);
    kvp_client_close(c);
    fake_stop(f);
}
END_TEST

START_TEST(a_silent_daemon_times_out_and_the_connection_is_dropped)
{
    fake_t *f = fake_start(kvpool_BackendKind_BACKEND_HOST);
    kvp_client_t *c = connect_to(f, 0, 100);
    f->ping_silent = 1;
    ck_assert_int_eq(kvp_client_ping(c, NULL), KVP_ETIMEDOUT);
    ck_assert_int_eq(kvp_client_ping(c, NULL), KVP_ECLOSED);
    kvp_client_close(c);
    fake_stop(f);
}
END_TEST

START_TEST(host_buffer_is_a_sealed_memfd_shared_with_the_daemon)
{
    fake_t *f = fake_start(kvpool_BackendKind_BACKEND_HOST);
    kvp_client_t *c = connect_to(f, 0, 5000);
    void *ptr = NULL;
    uint32_t id = 0;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, 65536, &ptr, &id), 0);
    ck_assert_uint_eq(id, 5);
    ck_assert_ptr_nonnull(ptr);
    ck_assert_uint_eq(f->buf_size, 65536);
    ck_assert_int_ge(f->buf_fd, 0);
    ck_assert_int_eq(f->buf_seals & (F_SEAL_SHRINK | F_SEAL_GROW), F_SEAL_SHRINK | F_SEAL_GROW);
    memcpy((char *)ptr + 65536 - 6, "staged", 6);
    char check[7] = {0};
    ck_assert_int_eq(pread(f->buf_fd, check, 6, 65536 - 6), 6);
    ck_assert_str_eq(check, "staged");
    ck_assert_int_eq(ftruncate(f->buf_fd, 10), -1); /* nobody can shrink it under the daemon */

    ck_assert_int_eq(kvp_client_unregister_buffer(c, id), 0);
    ck_assert_uint_eq(f->unregistered, 5);
    ck_assert_int_eq(kvp_client_register_fd(c, 0, 7, 10, &id), KVP_EINVAL);
    int closed = memfd_create("closed", MFD_CLOEXEC);
    close(closed);
    ck_assert_int_eq(kvp_client_register_fd(c, closed, 0, 10, &id), KVP_EINVAL);
    ck_assert_int_eq(kvp_client_ping(c, NULL), 0); /* still connected */
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, 0, &ptr, &id), KVP_EINVAL);
    kvp_client_close(c);
    fake_stop(f);
}
END_TEST

START_TEST(reserve_round_trip_fills_the_page_table)
{
    fake_t *f = fake_start(kvpool_BackendKind_BACKEND_HOST);
    kvp_client_t *c = connect_to(f, 0, 5000);
    uint64_t ids[4] = {10, 11, 12, 1ull << 60};
    uint32_t toks[4] = {45, 8, 25, 22};
    table_buf_t b;
    table_init(&b, 5, 8, 2);
    ck_assert_int_eq(kvp_client_reserve(c, ids, toks, 4, &b.t), 0);
    ck_assert_uint_eq(f->reserve_n, 4);
    ck_assert_int_eq(memcmp(f->reserve_ids, ids, sizeof(ids)), 0);
    ck_assert_int_eq(memcmp(f->reserve_toks, toks, sizeof(toks)), 0);
    ck_assert_uint_eq(b.t.batch_size, 4);
    ck_assert_uint_eq(b.t.nnz, 100);
    ck_assert_uint_eq(b.t.num_indices, 8);
    ck_assert_uint_eq(b.t.num_copies, 2);
    ck_assert_int_eq(memcmp(b.indices, seed_indices, sizeof(seed_indices)), 0);

    /* too small: KVP_ELIMIT, and the connection is still good */
    table_init(&b, 5, 4, 2);
    ck_assert_int_eq(kvp_client_reserve(c, ids, toks, 4, &b.t), KVP_ELIMIT);
    ck_assert_int_eq(kvp_client_reserve(c, ids, toks, 4, NULL), 0);
    ck_assert_int_eq(kvp_client_reserve(c, NULL, toks, 4, NULL), KVP_EINVAL);
    ck_assert_int_eq(kvp_client_ping(c, NULL), 0);
    kvp_client_close(c);
    fake_stop(f);
}
END_TEST

START_TEST(prefix_cache_calls_carry_their_arguments_and_read_their_answers)
{
    fake_t *f = fake_start(kvpool_BackendKind_BACKEND_HOST);
    kvp_client_opts_t o = {.socket_path = f->path, .ns = "engine-b", .cache_scope = "llama-70b"};
    kvp_client_t *c = NULL;
    ck_assert_int_eq(kvp_client_connect(&o, &c, NULL, 0), 0);
    ck_assert_str_eq(f->hello.cache_scope, "llama-70b");

    /* Reserve with token ids, salts and reuse: the table's cached_tokens come back */
    uint64_t ids[4] = {10, 11, 12, 13};
    uint32_t toks[4] = {45, 8, 25, 22};
    int32_t token_ids[100];
    for (int i = 0; i < 100; i++)
        token_ids[i] = 1000 + i;
    uint8_t salts[] = {'a', 'b', 'c'};
    uint32_t salt_lens[4] = {0, 3, 0, 0};
    kvp_cache_opts_t cache = {.token_ids = token_ids,
                              .salts = salts,
                              .salt_lens = salt_lens,
                              .reuse = 1,
                              .priority = 80,
                              .retention_ms = 0};
    table_buf_t b;
    table_init(&b, 5, 8, 2);
    ck_assert_int_eq(kvp_client_reserve_cached(c, ids, toks, 4, &cache, &b.t), 0);
    ck_assert_uint_eq(f->cache_body, kvpool_Request_reserve_tag);
    ck_assert_uint_eq(f->token_n, 100);
    ck_assert_int_eq(memcmp(f->token_ids, token_ids, sizeof(token_ids)), 0);
    ck_assert_uint_eq(f->salt_n, 3);
    ck_assert_int_eq(memcmp(f->salts, "abc", 3), 0);
    ck_assert_uint_eq(f->salt_lens_n, 4);
    ck_assert_uint_eq(f->salt_lens[1], 3);
    ck_assert(f->has_cache && f->cache.reuse && !f->cache.leave_last);
    ck_assert(f->cache.has_priority && f->cache.priority == 80 && f->cache.retention_ms == 0);
    static const uint32_t want_cached[4] = {32, 0, 16, 0};
    ck_assert_int_eq(memcmp(b.cached, want_cached, sizeof(want_cached)), 0);
    ck_assert_uint_eq(b.t.batch_size, 4);

    /* the plain Reserve sends none of it, and its table reads cached_tokens as 0s */
    table_init(&b, 5, 8, 2);
    ck_assert_int_eq(kvp_client_reserve(c, ids, toks, 4, &b.t), 0);
    ck_assert_uint_eq(f->token_n, 0);
    ck_assert_uint_eq(f->salt_lens_n, 0);
    ck_assert(!f->has_cache);
    static const uint32_t zeros[4];
    ck_assert_int_eq(memcmp(b.cached, zeros, sizeof(zeros)), 0);

    /* token ids only (defaults): no CacheOptions on the wire */
    kvp_cache_opts_t plain = {.token_ids = token_ids, .priority = -1};
    ck_assert_int_eq(kvp_client_reserve_cached(c, ids, toks, 4, &plain, NULL), 0);
    ck_assert_uint_eq(f->token_n, 100);
    ck_assert(!f->has_cache);

    /* Append with the cache */
    kvp_source_t src = {.buffer_id = 5};
    table_init(&b, 5, 8, 2);
    cache.leave_last = 1;
    ck_assert_int_eq(kvp_client_append_cached(c, ids, toks, 4, &src, &cache, &b.t), 0);
    ck_assert_uint_eq(f->cache_body, kvpool_Request_append_tag);
    ck_assert_uint_eq(f->token_n, 100);
    ck_assert(f->has_cache && f->cache.reuse && f->cache.leave_last);
    ck_assert_int_eq(memcmp(b.cached, want_cached, sizeof(want_cached)), 0);

    /* refused before anything is sent; the connection stays */
    kvp_cache_opts_t bad = {.salts = salts, .priority = -1};
    ck_assert_int_eq(kvp_client_reserve_cached(c, ids, toks, 4, &bad, NULL), KVP_EINVAL);
    ck_assert_str_eq(kvp_client_last_error(c), "reserve: salts given without salt_lens");
    kvp_cache_opts_t badp = {.priority = -7};
    ck_assert_int_eq(kvp_client_append_cached(c, ids, toks, 4, &src, &badp, NULL), KVP_EINVAL);
    ck_assert_ptr_nonnull(strstr(kvp_client_last_error(c), "priority -7"));

    /* Commit, without and with an event handle */
    uint32_t pages = 0, published = 0;
    ck_assert_int_eq(kvp_client_commit(c, ids, 3, NULL, &pages, &published), 0);
    ck_assert_uint_eq(f->commit_n, 3);
    ck_assert_uint_eq(f->commit_event.size, 0);
    ck_assert_uint_eq(pages, 6);
    ck_assert_uint_eq(published, 6);
    uint8_t ev[64];
    for (int i = 0; i < 64; i++)
        ev[i] = (uint8_t)(255 - i);
    ck_assert_int_eq(kvp_client_commit(c, ids, 2, ev, &pages, &published), 0);
    ck_assert_uint_eq(f->commit_event.size, 64);
    ck_assert_int_eq(memcmp(f->commit_event.bytes, ev, 64), 0);
    ck_assert_uint_eq(pages, 4);
    ck_assert_uint_eq(published, 0);
    ck_assert_int_eq(kvp_client_commit(c, ids, 1, NULL, NULL, NULL), 0);

    /* Lookup of three prompts, one with a salt */
    uint32_t lengths[3] = {40, 15, 33};
    uint32_t lsalt_lens[3] = {0, 0, 2};
    uint32_t found[3] = {9, 9, 9};
    ck_assert_int_eq(kvp_client_lookup(c, token_ids, lengths, 3, salts, lsalt_lens, found), 0);
    ck_assert_uint_eq(f->lookup_n, 3);
    ck_assert_uint_eq(f->token_n, 88);
    ck_assert_uint_eq(f->salt_n, 2);
    ck_assert_uint_eq(f->salt_lens_n, 3);
    ck_assert_uint_eq(found[0], 32);
    ck_assert_uint_eq(found[1], 0);
    ck_assert_uint_eq(found[2], 32);
    ck_assert_int_eq(kvp_client_lookup(c, token_ids, lengths, 3, NULL, NULL, found), 0);
    ck_assert_uint_eq(f->salt_n, 0);
    ck_assert_uint_eq(f->salt_lens_n, 0);
    ck_assert_int_eq(kvp_client_lookup(c, NULL, lengths, 3, NULL, NULL, found), KVP_EINVAL);

    /* Pin, Unpin */
    kvp_pin_t pin;
    memset(&pin, 0, sizeof(pin));
    ck_assert_int_eq(kvp_client_pin(c, token_ids, 40, "xy", 2, 5000, &pin), 0);
    ck_assert_uint_eq(f->token_n, 40);
    ck_assert_int_eq(f->token_ids[39], 1039);
    ck_assert_uint_eq(f->pin.salt.size, 2);
    ck_assert_int_eq(memcmp(f->pin.salt.bytes, "xy", 2), 0);
    ck_assert_uint_eq(f->pin.ttl_ms, 5000);
    ck_assert_uint_eq(pin.pin_id, 0x1234567890ull);
    ck_assert_uint_eq(pin.pinned_tokens, 32);
    ck_assert_uint_eq(pin.pinned_pages, 2);
    ck_assert_uint_eq(pin.expires_in_ms, 5000);
    ck_assert_int_eq(kvp_client_pin(c, token_ids, 8, NULL, 0, 0, &pin), KVP_ENOENT);
    ck_assert_str_eq(kvp_client_last_error(c), "nothing of the prompt is cached");
    uint8_t big_salt[257] = {0};
    ck_assert_int_eq(kvp_client_pin(c, token_ids, 40, big_salt, 257, 0, &pin), KVP_EINVAL);
    ck_assert_int_eq(kvp_client_unpin(c, pin.pin_id, &pages), 0);
    ck_assert_uint_eq(f->unpinned, 0x1234567890ull);
    ck_assert_uint_eq(pages, 3);

    /* CacheFlush and the cache's counters */
    ck_assert_int_eq(kvp_client_cache_flush(c, "other", 0, &pages), 0);
    ck_assert_str_eq(f->flush.scope, "other");
    ck_assert(!f->flush.all);
    ck_assert_uint_eq(pages, 7);
    ck_assert_int_eq(kvp_client_cache_flush(c, NULL, 1, NULL), 0);
    ck_assert_str_eq(f->flush.scope, "");
    ck_assert(f->flush.all);
    char longs[80];
    memset(longs, 'a', sizeof(longs) - 1);
    longs[sizeof(longs) - 1] = '\0';
    ck_assert_int_eq(kvp_client_cache_flush(c, longs, 0, NULL), KVP_EINVAL);
    kvp_cache_stats_t cs;
    ck_assert_int_eq(kvp_client_cache_stats(c, &cs), 0);
    ck_assert_uint_eq(cs.cached_pages, 1);
    ck_assert_uint_eq(cs.pinned_pages, 2);
    ck_assert_uint_eq(cs.indexed_pages, 3);
    ck_assert_uint_eq(cs.pins, 4);
    ck_assert_uint_eq(cs.query_tokens_total, 5);
    ck_assert_uint_eq(cs.hit_tokens_total, 6);
    ck_assert_uint_eq(cs.evictions_pressure_total, 7);
    ck_assert_uint_eq(cs.evictions_flush_total, 8);
    ck_assert_uint_eq(cs.evictions_rewrite_total, 9);
    ck_assert_uint_eq(cs.bytes, 1ull << 40);
    ck_assert_int_eq(kvp_client_ping(c, NULL), 0);
    kvp_client_close(c);

    /* a scope name over 64 bytes is refused before connecting */
    o.cache_scope = longs;
    char err[200];
    ck_assert_int_eq(kvp_client_connect(&o, &c, err, sizeof(err)), KVP_EINVAL);
    ck_assert_str_eq(err, "cache scope longer than 64 bytes");
    fake_stop(f);
}
END_TEST

START_TEST(host_tier_lookup_and_load_carry_their_arguments_and_read_their_answers)
{
    fake_t *f = fake_start(kvpool_BackendKind_BACKEND_HOST);
    kvp_client_t *c = connect_to(f, 0, 5000);
    int32_t token_ids[100];
    for (int i = 0; i < 100; i++)
        token_ids[i] = 3000 - i;
    uint32_t lengths[3] = {40, 15, 33};

    /* a daemon without a host tier: host_tokens read as 0s, exactly n of them */
    uint32_t found[3] = {9, 9, 9}, host[4] = {9, 9, 9, 9};
    ck_assert_int_eq(kvp_client_lookup_tiers(c, token_ids, lengths, 3, NULL, NULL, found, host), 0);
    static const uint32_t want_found[3] = {32, 0, 32}, zeros[3];
    ck_assert_int_eq(memcmp(found, want_found, sizeof(want_found)), 0);
    ck_assert_int_eq(memcmp(host, zeros, sizeof(zeros)), 0);
    ck_assert_uint_eq(host[3], 9);

    /* with one (the fake: the first page on the GPU, the rest in host memory): the answer's
     * host_tokens; the plain Lookup skips them and still works */
    f->lookup_host = 1;
    uint32_t lengths4[4] = {40, 15, 33, 12}; /* 100 token ids */
    uint32_t found4[4] = {9, 9, 9, 9};
    ck_assert_int_eq(kvp_client_lookup_tiers(c, token_ids, lengths4, 4, NULL, NULL, found4, host),
                     0);
    static const uint32_t want_gpu[4] = {16, 0, 16, 0}, want_host[4] = {16, 0, 16, 0};
    ck_assert_int_eq(memcmp(found4, want_gpu, sizeof(want_gpu)), 0);
    ck_assert_int_eq(memcmp(host, want_host, sizeof(want_host)), 0);
    ck_assert_uint_eq(f->token_n, 100);
    memset(found4, 0xff, sizeof(found4));
    ck_assert_int_eq(kvp_client_lookup(c, token_ids, lengths4, 4, NULL, NULL, found4), 0);
    ck_assert_int_eq(memcmp(found4, want_gpu, sizeof(want_gpu)), 0);
    memset(found4, 0xff, sizeof(found4));
    ck_assert_int_eq(kvp_client_lookup_tiers(c, token_ids, lengths4, 4, NULL, NULL, found4, NULL),
                     0);
    ck_assert_int_eq(memcmp(found4, want_gpu, sizeof(want_gpu)), 0);
    ck_assert_int_eq(kvp_client_lookup_tiers(c, NULL, lengths, 3, NULL, NULL, found, host),
                     KVP_EINVAL);

    /* Load: token ids, salt, destination and cap reach the daemon exactly; its answer comes back */
    kvp_source_t dest = {.buffer_id = 5,
                         .layout = {.k_offset = 64,
                                    .v_offset = 1 << 20,
                                    .k_stride_n = 256,
                                    .k_stride_h = 128,
                                    .v_stride_n = 256,
                                    .v_stride_h = 128,
                                    .layer_stride = 1 << 16},
                         .layer_begin = 0,
                         .layer_end = 2};
    kvp_load_t ld = {0, 0, 0};
    ck_assert_int_eq(kvp_client_load(c, token_ids, 40, "salt-1", 6, &dest, 0, &ld), 0);
    ck_assert_uint_eq(f->load_n, 1);
    ck_assert_uint_eq(f->token_n, 40);
    ck_assert_int_eq(memcmp(f->token_ids, token_ids, 40 * sizeof(int32_t)), 0);
    ck_assert_uint_eq(f->load.salt.size, 6);
    ck_assert_int_eq(memcmp(f->load.salt.bytes, "salt-1", 6), 0);
    ck_assert(f->load.has_dest);
    ck_assert_uint_eq(f->load.dest.buffer_id, 5);
    kvp_src_layout_t back;
    kvp_wire_source_layout(&f->load.dest, &back);
    ck_assert_int_eq(memcmp(&back, &dest.layout, sizeof(back)), 0);
    ck_assert_uint_eq(f->load.dest.layer_begin, 0);
    ck_assert_uint_eq(f->load.dest.layer_end, 2);
    ck_assert_uint_eq(f->load.max_tokens, 0);
    ck_assert_uint_eq(ld.loaded_tokens, 32);
    ck_assert_uint_eq(ld.host_tokens, 16);
    ck_assert_int_eq(ld.completed, 1);
    /* a cap, no salt, no output wanted */
    ck_assert_int_eq(kvp_client_load(c, token_ids, 100, NULL, 0, &dest, 20, NULL), 0);
    ck_assert_uint_eq(f->load.max_tokens, 20);
    ck_assert_uint_eq(f->load.salt.size, 0);
    ck_assert_uint_eq(f->token_n, 100);
    ck_assert_int_eq(kvp_client_load(c, token_ids, 100, NULL, 0, &dest, 20, &ld), 0);
    ck_assert_uint_eq(ld.loaded_tokens, 16);
    ck_assert_uint_eq(ld.host_tokens, 0);

    /* the daemon's NOT_FOUND: KVP_ENOENT with its message, *out untouched */
    kvp_load_t keep = {77, 78, 79};
    ck_assert_int_eq(kvp_client_load(c, token_ids, 8, NULL, 0, &dest, 0, &keep), KVP_ENOENT);
    ck_assert_str_eq(kvp_client_last_error(c), "nothing of the prompt is cached");
    ck_assert_uint_eq(keep.loaded_tokens, 77);
    ck_assert_uint_eq(keep.completed, 79);

    /* refused before anything is sent */
    const uint32_t sent = f->load_n;
    uint8_t big_salt[257] = {0};
    ck_assert_int_eq(kvp_client_load(c, token_ids, 40, big_salt, 257, &dest, 0, &ld), KVP_EINVAL);
    ck_assert_str_eq(kvp_client_last_error(c), "load: a salt of 257 bytes, at most 256");
    ck_assert_int_eq(kvp_client_load(c, NULL, 40, NULL, 0, &dest, 0, &ld), KVP_EINVAL);
    ck_assert_int_eq(kvp_client_load(c, token_ids, 40, NULL, 3, &dest, 0, &ld), KVP_EINVAL);
    ck_assert_int_eq(kvp_client_load(c, token_ids, 40, NULL, 0, NULL, 0, &ld), KVP_EINVAL);
    ck_assert_str_eq(kvp_client_last_error(c), "load: NULL destination");
    ck_assert_int_eq(kvp_client_load(NULL, token_ids, 40, NULL, 0, &dest, 0, &ld), KVP_EINVAL);
    ck_assert_uint_eq(f->load_n, sent);

    /* the host tier's counters, daemon-wide and per scope, each read into its own member */
    kvp_cache_stats_t cs;
    memset(&cs, 0xee, sizeof(cs));
    ck_assert_int_eq(kvp_client_cache_stats(c, &cs), 0);
    ck_assert_uint_eq(cs.bytes, 1ull << 40);
    ck_assert_uint_eq(cs.host_pages, 11);
    ck_assert_uint_eq(cs.host_slots, 12);
    ck_assert_uint_eq(cs.host_bytes_total, 1ull << 35);
    ck_assert_uint_eq(cs.host_bytes_ready, 14);
    ck_assert_uint_eq(cs.host_hit_tokens_total, 15);
    ck_assert_uint_eq(cs.demotions_total, 16);
    ck_assert_uint_eq(cs.promotions_total, 17);
    ck_assert_uint_eq(cs.host_evictions_total, 18);
    ck_assert_uint_eq(cs.offload_bytes_total, 19);
    ck_assert_uint_eq(cs.restore_bytes_total, 20);
    ck_assert_uint_eq(cs.offload_us_total, 21);
    ck_assert_uint_eq(cs.restore_us_total, 22);
    ck_assert_uint_eq(cs.demoting, 23);
    ck_assert_uint_eq(cs.restoring, 24);
    ck_assert_uint_eq(cs.host_slot_bytes, 25);
    static kvp_scope_stats_t scopes[2];
    memset(scopes, 0xee, sizeof(scopes));
    kvp_daemon_stats_t ds;
    memset(&ds, 0, sizeof(ds));
    ds.scopes = scopes;
    ds.cap_scopes = 2;
    ck_assert_int_eq(kvp_client_daemon_stats(c, &ds), 0);
    ck_assert_int_eq(memcmp(&ds.cache, &cs, sizeof(cs)), 0);
    ck_assert_uint_eq(ds.num_scopes, 1);
    ck_assert_str_eq(scopes[0].name, "ns:engine-a");
    ck_assert_uint_eq(scopes[0].hit_tokens, 30);
    ck_assert_uint_eq(scopes[0].host_pages, 31);
    ck_assert_uint_eq(scopes[0].host_hit_tokens, 1ull << 33);
    ck_assert_uint_eq(scopes[1].host_pages, 0xeeeeeeee); /* nothing past the answer */

    /* an answer of more tokens than the prompt has: a protocol error, *out untouched */
    f->load_overshoot = 1;
    ck_assert_int_eq(kvp_client_load(c, token_ids, 40, NULL, 0, &dest, 0, &keep), KVP_EPROTO);
    ck_assert_uint_eq(keep.loaded_tokens, 77);
    ck_assert_int_eq(kvp_client_ping(c, NULL), 0);
    kvp_client_close(c);
    fake_stop(f);
}
END_TEST

/* kvp_client_cuda_commit: without CUDA (a build without it, or no driver) KVP_EUNAVAIL and
 * nothing sent; with a GPU, Commit carries the 64-byte handle of the event it recorded, and a
 * second call reuses the event (the same handle). */
START_TEST(cuda_commit_sends_an_event_handle_or_is_unavailable)
{
    fake_t *f = fake_start(kvpool_BackendKind_BACKEND_HOST);
    kvp_client_t *c = connect_to(f, 0, 5000);
    uint64_t id = 1;
    int rc = kvp_client_cuda_commit(c, &id, 1, NULL);
    if (rc == KVP_EUNAVAIL) {
        ck_assert_uint_eq(f->commit_n, 0);
    } else {
        ck_assert_msg(rc == 0, "cuda_commit: %s", kvp_client_last_error(c));
        ck_assert_uint_eq(f->commit_n, 1);
        ck_assert_uint_eq(f->commit_event.size, 64);
        kvpool_CommitRequest_event_handle_t first = f->commit_event;
        uint32_t pages = 0, published = 9;
        ck_assert_int_eq(kvp_client_cuda_commit_ex(c, &id, 1, NULL, &pages, &published), 0);
        ck_assert_uint_eq(pages, 2);
        ck_assert_uint_eq(published, 0);
        ck_assert_int_eq(memcmp(f->commit_event.bytes, first.bytes, 64), 0);
    }
    ck_assert_int_eq(kvp_client_ping(c, NULL), 0);
    kvp_client_close(c);
    fake_stop(f);
}
END_TEST

START_TEST(default_socket_follows_the_environment)
{
    char buf[108];
    setenv("KVPOOL_SOCKET", "/run/x/y.sock", 1);
    ck_assert_str_eq(kvp_client_default_socket(buf, sizeof(buf)), "/run/x/y.sock");
    ck_assert_ptr_null(kvp_client_default_socket(buf, 5));
    unsetenv("KVPOOL_SOCKET");
    if (geteuid() != 0) {
        setenv("XDG_RUNTIME_DIR", "/run/user/1000", 1);
        ck_assert_str_eq(kvp_client_default_socket(buf, sizeof(buf)),
                         "/run/user/1000/kvpool/kvpool.sock");
    } else {
        ck_assert_str_eq(kvp_client_default_socket(buf, sizeof(buf)), "/run/kvpool/kvpool.sock");
    }
    ck_assert_ptr_null(kvp_client_default_socket(NULL, 10));
}
END_TEST

/* $KVPOOL_BUSY_POLL_US is checked whole (common/kvp_knob.h): a bad value fails the connect
 * before any socket is touched, instead of turning into 0. */
START_TEST(a_bad_busy_poll_environment_fails_the_connect)
{
    char e[256];
    kvp_client_t *c = NULL;
    kvp_client_opts_t o = {.socket_path = "/nonexistent/kvpool-test/kvpool.sock"};
    static const char *const bad[] = {"abc", "", "-1", "200us", "1000001"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        setenv("KVPOOL_BUSY_POLL_US", bad[i], 1);
        ck_assert_int_eq(kvp_client_connect(&o, &c, e, sizeof(e)), KVP_EINVAL);
        ck_assert_ptr_null(c);
        char want[160];
        snprintf(want, sizeof(want),
                 "KVPOOL_BUSY_POLL_US: invalid value '%s': expected an unsigned decimal integer "
                 "in 0..1000000",
                 bad[i]);
        ck_assert_str_eq(e, want);
    }
    /* given in the options, the variable is not read */
    o.busy_poll_us = 5;
    ck_assert_int_eq(kvp_client_connect(&o, &c, e, sizeof(e)), -ENOENT);
    /* a good value: on to the connect, which finds no socket */
    o.busy_poll_us = 0;
    setenv("KVPOOL_BUSY_POLL_US", "1000000", 1);
    ck_assert_int_eq(kvp_client_connect(&o, &c, e, sizeof(e)), -ENOENT);
    unsetenv("KVPOOL_BUSY_POLL_US");
    ck_assert_int_eq(kvp_client_connect(&o, &c, e, sizeof(e)), -ENOENT);
    ck_assert_ptr_null(c);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("client_wire");
    TCase *tc = tcase_create("wire");
    tcase_add_test(tc, reserve_of_256_sequences_decodes_exactly_on_the_server);
    tcase_add_test(tc, release_and_page_table_requests_carry_seq_ids_only);
    tcase_add_test(tc, page_table_lands_exactly_in_the_callers_arrays);
    tcase_add_test(tc, null_arrays_are_skipped_but_counted);
    tcase_add_test(tc, capacities_below_the_reply_give_elimit);
    tcase_add_test(tc, inconsistent_or_malformed_replies_are_protocol_errors);
    tcase_add_test(tc, direct_answer_encoding_is_nanopbs_byte_for_byte);
    tcase_add_test(tc, direct_request_encoding_is_nanopbs_byte_for_byte);
    tcase_add_test(tc, metrics_text_is_read_skipped_or_refused_when_too_long);
    tcase_add_test(tc, reserve_with_token_ids_salts_and_options_decodes_exactly_on_the_server);
    tcase_add_test(tc, client_cache_arguments_are_checked_before_anything_is_sent);
    tcase_add_test(tc, commit_lookup_and_pin_requests_decode_exactly_on_the_server);
    tcase_add_test(tc, cached_tokens_land_in_the_table_or_read_as_zeros);
    tcase_add_test(tc, lookup_answer_lands_in_the_callers_array);
    tcase_add_test(tc, lookup_answer_with_and_without_host_tokens_decodes_exactly);
    tcase_add_test(tc, load_request_decodes_exactly_on_the_server);
    suite_add_tcase(s, tc);
    TCase *tf = tcase_create("fake_daemon");
    tcase_set_timeout(tf, 30);
    tcase_add_test(tf, hello_maps_the_host_pool_and_ids_count_up_from_a_random_start);
    tcase_add_test(tf, cuda_pool_fds_are_kept_open_and_not_mapped);
    tcase_add_test(tf, without_map_pool_nothing_is_asked_for_or_mapped);
    tcase_add_test(tf, status_errors_map_to_codes_and_messages);
    tcase_add_test(tf, hello_refused_by_the_daemon_fails_connect_with_its_message);
    tcase_add_test(tf, connect_to_nothing_is_enoent_with_a_message);
    tcase_add_test(tf, a_reply_with_another_id_breaks_the_connection);
    tcase_add_test(tf, a_silent_daemon_times_out_and_the_connection_is_dropped);
    tcase_add_test(tf, host_buffer_is_a_sealed_memfd_shared_with_the_daemon);
    tcase_add_test(tf, reserve_round_trip_fills_the_page_table);
    tcase_add_test(tf, prefix_cache_calls_carry_their_arguments_and_read_their_answers);
    tcase_add_test(tf, host_tier_lookup_and_load_carry_their_arguments_and_read_their_answers);
    tcase_add_test(tf, cuda_commit_sends_an_event_handle_or_is_unavailable);
    tcase_add_test(tf, default_socket_follows_the_environment);
    tcase_add_test(tf, a_bad_busy_poll_environment_fails_the_connect);
    suite_add_tcase(s, tf);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
