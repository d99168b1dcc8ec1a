/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_client.c - libkvpool (kvpool.h): one blocking connection to kvpoold per handle. Each
 * call encodes a Request into the handle's send buffer, sends it with kvp_sock, receives the
 * one Response frame and decodes it, bulk arrays going straight into the caller's arrays.
 * A transport failure (timeout, lost connection, broken framing) closes the connection, since
 * a late answer would be taken for the next one; later calls fail with KVP_ECLOSED. The
 * library never prints: every failure leaves its reason in the handle's last_error.
 */
#include "kvpool.h"
#include "kvp_limits.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <pb_decode.h>

#include "kvp_client_internal.h"
#include "kvp_knob.h"
#include "kvp_sock.h"
#include "kvp_wire.h"

#define CLIENT_MAX_FRAME_BYTES    (64u << 20) /* largest frame sent or accepted */
#define CLIENT_INIT_BUF_BYTES     (16u << 10) /* first size of the send and receive buffers */
#define CLIENT_MAX_HOST_BUFFERS   64          /* staging buffers per handle */
#define CLIENT_DEFAULT_TIMEOUT_MS 10000
#define CLIENT_DEFAULT_NAMESPACE  "default"
#define CLIENT_MAX_BUSY_POLL_US   1000000u /* opts.busy_poll_us, $KVPOOL_BUSY_POLL_US */
#define CLIENT_ERR_BYTES          320

_Static_assert(KVP_MAX_DEVICES <= KVP_MAX_FDS_PER_FRAME, "one pool fd per device on one frame");

/* A staging buffer made by kvp_client_alloc_host_buffer, unmapped on unregister or close. */
typedef struct {
    uint32_t id;
    void *ptr;
    size_t size_bytes;
} host_buffer_t;

struct kvp_client {
    int fd; /* -1 once the connection is lost */
    uint32_t timeout_ms;
    uint64_t busy_poll_ns; /* spin for the answer this long before sleeping */
    uint64_t next_id;
    uint64_t session_id;
    char server_version[sizeof(((kvpool_HelloResponse *)0)->server_version)];
    kvp_pool_info_t info;
    uint32_t num_pool;                      /* pool fds that came with Hello */
    void *pool_map[KVP_CLIENT_MAX_DEVICES]; /* host backend: the mapping, else NULL */
    int pool_fd[KVP_CLIENT_MAX_DEVICES];    /* cuda backend: kept open, else -1 */
    void *pool_dev[KVP_CLIENT_MAX_DEVICES]; /* cuda backend: device mapping (kvp_client_cuda.c) */
    void *cuda;                             /* kvp_client_cuda.c's state, NULL until used */
    size_t pool_map_bytes;
    host_buffer_t bufs[CLIENT_MAX_HOST_BUFFERS];
    uint32_t num_bufs;
    uint8_t *sbuf, *rbuf; /* whole frames out, payloads in; grown up to the max frame */
    size_t scap, rcap;
    kvpool_Request req;   /* scratch, one call at a time */
    kvpool_Response resp; /* scratch (large: the list bodies are fixed arrays) */
    char last_error[CLIENT_ERR_BYTES];
};

/* ---- reply decoding (also used by the unit tests through kvp_client_internal.h) -------- */

/* A sink for an array the caller did not want: checks the element size, counts, skips. */
static bool discard_array(pb_istream_t *stream, const pb_field_t *field, void **arg)
{
    (void)field;
    kvp_array_t *a = *arg;
    size_t n = stream->bytes_left;
    size_t elem = a->elem_size ? a->elem_size : 1; /* a zeroed kvp_array_t counts bytes */
    if (n % elem) {
        a->bad = KVP_EINVAL;
        PB_RETURN_ERROR(stream, "array length not a multiple of its element size");
    }
    if (n / elem > UINT32_MAX) {
        a->bad = KVP_ELIMIT;
        PB_RETURN_ERROR(stream, "array too long");
    }
    a->count = (uint32_t)(n / elem);
    return pb_read(stream, NULL, n);
}

static bool discard_text(pb_istream_t *stream, const pb_field_t *field, void **arg)
{
    (void)field;
    kvp_text_t *t = *arg;
    t->len = stream->bytes_left;
    return pb_read(stream, NULL, stream->bytes_left);
}

/* kvp_wire's body binder, plus sinks for the arrays whose data is NULL. */
typedef struct {
    bool (*bind)(pb_istream_t *stream, const pb_field_t *field, void **arg);
    kvp_reply_arrays_t *r;
} body_binder_t;

static void sink_if_unwanted(pb_callback_t *cb, const kvp_array_t *a)
{
    if (!a->data)
        cb->funcs.decode = discard_array;
}

static bool bind_body(pb_istream_t *stream, const pb_field_t *field, void **arg)
{
    body_binder_t *b = *arg;
    void *inner = b->r;
    if (!b->bind(stream, field, &inner))
        return false;
    kvp_reply_arrays_t *r = b->r;
    kvpool_PageTable *t = NULL;
    switch (field->tag) {
    case kvpool_Response_append_tag:
        t = &((kvpool_AppendResponse *)field->pData)->table;
        break;
    case kvpool_Response_reserve_tag:
        t = &((kvpool_ReserveResponse *)field->pData)->table;
        break;
    case kvpool_Response_get_page_table_tag:
        t = &((kvpool_GetPageTableResponse *)field->pData)->table;
        break;
    case kvpool_Response_lookup_tag:
        sink_if_unwanted(&((kvpool_LookupResponse *)field->pData)->cached_tokens,
                         &r->cached_tokens);
        break;
    case kvpool_Response_metrics_tag:
        if (!r->text.s)
            ((kvpool_MetricsResponse *)field->pData)->text.funcs.decode = discard_text;
        break;
    default:
        break;
    }
    if (t) {
        sink_if_unwanted(&t->kv_indptr, &r->kv_indptr);
        sink_if_unwanted(&t->kv_indices, &r->kv_indices);
        sink_if_unwanted(&t->kv_last_page_len, &r->kv_last_page_len);
        sink_if_unwanted(&t->append_indptr, &r->append_indptr);
        sink_if_unwanted(&t->seq_lens, &r->seq_lens);
        sink_if_unwanted(&t->copies, &r->copies);
        sink_if_unwanted(&t->cached_tokens, &r->cached_tokens);
    }
    return true;
}

void kvp__client_batch_arrays(kvp_batch_arrays_t *b, const uint64_t *seq_ids,
                              const uint32_t *num_tokens, uint32_t n)
{
    /* encoding only reads through data */
    b->seq_ids = kvp_array((void *)seq_ids, sizeof(uint64_t), n, n);
    b->num_tokens = kvp_array((void *)num_tokens, sizeof(uint32_t), num_tokens ? n : 0, n);
    b->token_ids = kvp_array(NULL, sizeof(int32_t), 0, 0);
    b->salts = kvp_array(NULL, 1, 0, 0);
    b->salt_lens = kvp_array(NULL, sizeof(uint32_t), 0, 0);
}

/* sum(v[0..n)) into *out; 0, or KVP_EINVAL when it does not fit in uint32. */
static int sum_u32(const uint32_t *v, uint32_t n, uint32_t *out)
{
    uint64_t sum = 0;
    for (uint32_t i = 0; i < n; i++)
        sum += v[i];
    if (sum > UINT32_MAX)
        return KVP_EINVAL;
    *out = (uint32_t)sum;
    return 0;
}

/* The salts of n sequences or prompts as two arrays; checks they agree. */
static int salt_arrays(kvp_batch_arrays_t *b, const uint8_t *salts, const uint32_t *salt_lens,
                       uint32_t n, const char **why)
{
    if (!salt_lens) {
        if (salts) {
            *why = "salts given without salt_lens";
            return KVP_EINVAL;
        }
        return 0;
    }
    uint32_t bytes;
    if (sum_u32(salt_lens, n, &bytes)) {
        *why = "the salts add up to more than 4 GiB";
        return KVP_EINVAL;
    }
    if (bytes && !salts) {
        *why = "salt_lens name salt bytes but salts is NULL";
        return KVP_EINVAL;
    }
    b->salt_lens = kvp_array((void *)salt_lens, sizeof(uint32_t), n, n);
    b->salts = kvp_array((void *)salts, 1, bytes, bytes);
    return 0;
}

int kvp__client_batch_cache(kvp_batch_arrays_t *b, const uint32_t *num_tokens, uint32_t n,
                            const kvp_cache_opts_t *cache, const char **why)
{
    if (!cache)
        return 0;
    if (cache->token_ids) {
        uint32_t total;
        if (!num_tokens || sum_u32(num_tokens, n, &total)) {
            *why = "token ids need num_tokens adding up to at most UINT32_MAX";
            return KVP_EINVAL;
        }
        b->token_ids = kvp_array((void *)cache->token_ids, sizeof(int32_t), total, total);
    }
    return salt_arrays(b, cache->salts, cache->salt_lens, n, why);
}

int kvp__client_cache_options(kvpool_CacheOptions *o, bool *has, const kvp_cache_opts_t *cache)
{
    memset(o, 0, sizeof(*o));
    *has = false;
    if (!cache)
        return 0;
    if (cache->priority < -1)
        return KVP_EINVAL;
    o->reuse = cache->reuse != 0;
    o->leave_last = cache->leave_last != 0;
    o->has_priority = cache->priority >= 0;
    o->priority = o->has_priority ? (uint32_t)cache->priority : 0;
    o->retention_ms = cache->retention_ms;
    *has = o->reuse || o->leave_last || o->has_priority || o->retention_ms;
    return 0;
}

int kvp__client_request_batch(kvpool_Request *req, pb_size_t which_body, kvp_batch_arrays_t *b)
{
    kvpool_Batch *batch;
    memset(req, 0, sizeof(*req));
    req->which_body = which_body;
    switch (which_body) {
    case kvpool_Request_append_tag:
        req->body.append.has_batch = true;
        batch = &req->body.append.batch;
        break;
    case kvpool_Request_reserve_tag:
        req->body.reserve.has_batch = true;
        batch = &req->body.reserve.batch;
        break;
    case kvpool_Request_release_tag:
        req->body.release.has_batch = true;
        batch = &req->body.release.batch;
        break;
    case kvpool_Request_get_page_table_tag:
        req->body.get_page_table.has_batch = true;
        batch = &req->body.get_page_table.batch;
        break;
    case kvpool_Request_commit_tag:
        req->body.commit.has_batch = true;
        batch = &req->body.commit.batch;
        break;
    default:
        req->which_body = 0;
        return KVP_EINVAL;
    }
    kvp_wire_batch_bind_encode(batch, b);
    if (!b->num_tokens.data)
        batch->num_tokens.funcs.encode = NULL; /* seq_ids only: leave the field out */
    return 0;
}

void kvp__client_table_arrays(kvp_reply_arrays_t *r, const kvp_page_table_t *t)
{
    memset(r, 0, sizeof(*r));
    if (!t) {
        r->kv_indptr = r->kv_indices = r->kv_last_page_len = kvp_array(NULL, 4, 0, 0);
        r->append_indptr = r->seq_lens = kvp_array(NULL, 4, 0, 0);
        r->copies = kvp_array(NULL, 8, 0, 0);
        r->cached_tokens = kvp_array(NULL, 4, 0, 0);
        return;
    }
    r->kv_indptr = kvp_array(t->kv_indptr, sizeof(int32_t), 0, t->cap_batch);
    r->kv_indices = kvp_array(t->kv_indices, sizeof(int32_t), 0, t->cap_indices);
    r->kv_last_page_len = kvp_array(t->kv_last_page_len, sizeof(int32_t), 0, t->cap_batch);
    r->append_indptr = kvp_array(t->append_indptr, sizeof(int32_t), 0, t->cap_batch);
    r->seq_lens = kvp_array(t->seq_lens, sizeof(int32_t), 0, t->cap_batch);
    r->copies = kvp_array(t->copies, 2 * sizeof(uint32_t), 0, t->cap_copies);
    r->cached_tokens = kvp_array(t->cached_tokens, sizeof(uint32_t), 0, t->cap_batch);
}

/* The name of the first array of r that failed, and its code. */
static const char *bad_array(const kvp_reply_arrays_t *r, int *code)
{
    const struct {
        const kvp_array_t *a;
        const char *name;
    } all[] = {{&r->kv_indptr, "kv_indptr"},
               {&r->kv_indices, "kv_indices"},
               {&r->kv_last_page_len, "kv_last_page_len"},
               {&r->append_indptr, "append_indptr"},
               {&r->seq_lens, "seq_lens"},
               {&r->copies, "copies"},
               {&r->cached_tokens, "cached_tokens"}};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        if (all[i].a->bad) {
            *code = all[i].a->bad;
            return all[i].name;
        }
    }
    if (r->text.bad) {
        *code = r->text.bad;
        return "text";
    }
    *code = 0;
    return NULL;
}

int kvp__client_decode_response(kvpool_Response *resp, kvp_reply_arrays_t *r, const uint8_t *buf,
                                size_t len, char *err, size_t err_len)
{
    resp->cb_status.funcs.decode = NULL;
    resp->cb_status.arg = NULL;
    kvp_wire_response_bind_decode(resp, r);
    body_binder_t binder = {resp->cb_body.funcs.decode, r};
    resp->cb_body.funcs.decode = bind_body;
    resp->cb_body.arg = &binder;

    const char *why = NULL;
    int rc = kvp_wire_decode(kvpool_Response_fields, resp, buf, len, &why);
    resp->cb_body.funcs.decode = NULL; /* binder lives on this stack frame */
    resp->cb_body.arg = NULL;
    if (rc == 0) {
        if (err && err_len)
            err[0] = '\0';
        return 0;
    }
    int code;
    const char *name = bad_array(r, &code);
    if (name && code == KVP_ELIMIT) {
        if (err)
            snprintf(err, err_len, "the reply's %s is larger than the caller's capacity", name);
        return KVP_ELIMIT;
    }
    if (err)
        snprintf(err, err_len, "malformed response from the daemon: %s%s%s", why ? why : "?",
                 name ? " in " : "", name ? name : "");
    return KVP_EPROTO;
}

static const kvpool_PageTable *response_table(const kvpool_Response *resp)
{
    switch (resp->which_body) {
    case kvpool_Response_append_tag:
        return resp->body.append.has_table ? &resp->body.append.table : NULL;
    case kvpool_Response_reserve_tag:
        return resp->body.reserve.has_table ? &resp->body.reserve.table : NULL;
    case kvpool_Response_get_page_table_tag:
        return resp->body.get_page_table.has_table ? &resp->body.get_page_table.table : NULL;
    default:
        return NULL;
    }
}

static uint32_t response_batch_size(const kvpool_Response *resp)
{
    const kvpool_PageTable *pt = response_table(resp);
    return pt ? pt->batch_size : 0;
}

/* count is 0 (the daemon left the array out) or exactly `want`. */
static int count_ok(uint32_t count, uint64_t want)
{
    return count == 0 || count == want;
}

int kvp__client_table_fill(kvp_page_table_t *t, const kvpool_Response *resp,
                           const kvp_reply_arrays_t *r)
{
    const kvpool_PageTable *pt = response_table(resp);
    uint32_t batch_size = pt ? pt->batch_size : 0;
    if (!count_ok(r->kv_indptr.count, (uint64_t)batch_size + 1) ||
        !count_ok(r->append_indptr.count, (uint64_t)batch_size + 1) ||
        !count_ok(r->kv_last_page_len.count, batch_size) ||
        !count_ok(r->seq_lens.count, batch_size) || !count_ok(r->cached_tokens.count, batch_size))
        return KVP_EPROTO;
    /* kv_indptr[B] is the number of indices, when both arrays were read */
    if (r->kv_indptr.data && r->kv_indptr.count &&
        ((const int32_t *)r->kv_indptr.data)[batch_size] != (int32_t)r->kv_indices.count)
        return KVP_EPROTO;
    if (t) {
        if (t->cached_tokens && r->cached_tokens.count == 0 && batch_size) {
            /* the answer has none: 0 tokens cached for every row */
            if (batch_size > t->cap_batch)
                return KVP_ELIMIT;
            memset(t->cached_tokens, 0, (size_t)batch_size * sizeof(uint32_t));
        }
        t->batch_size = batch_size;
        t->nnz = pt ? pt->nnz : 0;
        t->num_indices = r->kv_indices.count;
        t->num_copies = r->copies.count;
    }
    return 0;
}

/* ---- the handle --------------------------------------------------------------------------- */

static int fail(kvp_client_t *c, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Records the reason of a failed call and returns rc. */
static int fail(kvp_client_t *c, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->last_error, sizeof(c->last_error), fmt, ap);
    va_end(ap);
    return rc;
}

/* A transport failure: the stream is out of step, so the connection goes. */
static int lost(kvp_client_t *c, int rc, const char *what)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    if (rc == KVP_ETIMEDOUT)
        return fail(c, rc, "no answer from the daemon within %u ms (%s); connection closed",
                    c->timeout_ms, what);
    if (rc == KVP_ECLOSED)
        return fail(c, rc, "the daemon closed the connection (%s)", what);
    return fail(c, rc, "connection lost (%s): %s", what, kvp_strerror(rc));
}

static uint64_t next_id(kvp_client_t *c)
{
    uint64_t id = c->next_id++;
    if (id == 0) /* 0 disables deduplication: never use it */
        id = c->next_id++;
    return id;
}

/* A random start for request ids, so ids stay unique per namespace across restarts. */
static uint64_t random_id(const void *salt)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof(v), GRND_NONBLOCK) != (ssize_t)sizeof(v)) {
        /* no entropy yet (early boot) or no syscall: time, pid and an address, mixed */
        v = kvp_sock_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)salt;
        v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
        v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
        v ^= v >> 31;
    }
    return v ? v : 1;
}

/* Encodes req as a frame into the send buffer, growing it. Returns the frame length or a
 * negative code. */
static long encode_request(kvp_client_t *c, const kvpool_Request *req)
{
    long n = kvp_wire_encode_request_frame(req, c->sbuf, c->scap);
    if (n != KVP_ELIMIT)
        return n;
    long need = kvp_wire_encoded_size(kvpool_Request_fields, req);
    if (need < 0)
        return KVP_EINVAL;
    if ((unsigned long)need > CLIENT_MAX_FRAME_BYTES)
        return KVP_ELIMIT;
    size_t want = (size_t)need + KVP_FRAME_HDR_BYTES;
    if (want < 2 * c->scap)
        want = 2 * c->scap;
    if (want > CLIENT_MAX_FRAME_BYTES + KVP_FRAME_HDR_BYTES)
        want = CLIENT_MAX_FRAME_BYTES + KVP_FRAME_HDR_BYTES;
    uint8_t *nb = realloc(c->sbuf, want);
    if (!nb)
        return KVP_ENOMEM;
    c->sbuf = nb;
    c->scap = want;
    return kvp_wire_encode_request_frame(req, c->sbuf, c->scap);
}

static void close_fds(const int *fds, unsigned n)
{
    for (unsigned i = 0; i < n; i++)
        close(fds[i]);
}

/*
 * One round trip: sends req with send_fds attached, receives and decodes the answer into
 * resp (bulk arrays into r), and checks id, status and body (expect: the body tag a success
 * must carry, 0 for any). Descriptors that came with the answer go to recv_fds (up to
 * max_recv, *num_recv of them, owned by the caller) on success and are closed otherwise.
 */
static int call(kvp_client_t *c, kvpool_Request *req, kvpool_Response *resp, kvp_reply_arrays_t *r,
                pb_size_t expect, const int *send_fds, unsigned num_send, int *recv_fds,
                unsigned max_recv, unsigned *num_recv)
{
    unsigned nfds = 0;
    int rc;
    c->last_error[0] = '\0';
    if (num_recv)
        *num_recv = 0;
    if (c->fd < 0)
        return fail(c, KVP_ECLOSED, "not connected: the connection was closed after an error");

    uint64_t id = next_id(c);
    req->id = id;
    long n = encode_request(c, req);
    if (n == KVP_ELIMIT)
        return fail(c, KVP_ELIMIT, "the request does not fit in a frame (at most %u bytes)",
                    CLIENT_MAX_FRAME_BYTES);
    if (n < 0)
        return fail(c, (int)n, "cannot encode the request: %s", kvp_strerror((int)n));
    uint64_t deadline = kvp_sock_deadline(c->timeout_ms);
    rc = kvp_sock_send_frame(c->fd, c->sbuf, (size_t)n, send_fds, num_send, deadline);
    if (rc == KVP_ECLOSED) {
        /* The daemon may have refused this connection (access, connection limit, out of
         * descriptors) and closed it before the request went out: its answer, id 0, can still
         * be waiting to be read. Report that rather than a bare "closed". */
        uint32_t len = 0;
        if (kvp_sock_recv_frame(c->fd, &c->rbuf, &c->rcap, &len, CLIENT_MAX_FRAME_BYTES, NULL, 0,
                                NULL, kvp_sock_deadline(200)) == 0 &&
            kvp__client_decode_response(resp, r, c->rbuf, len, NULL, 0) == 0 && resp->id == 0 &&
            resp->has_status && resp->status.code != kvpool_Code_OK) {
            int err = kvp_wire_err_from_code(resp->status.code);
            lost(c, err, "request rejected");
            return fail(c, err, "%s",
                        resp->status.message[0] ? resp->status.message
                                                : kvp_wire_code_name(resp->status.code));
        }
    }
    if (rc)
        return lost(c, rc, "sending the request");
    uint32_t len = 0;
    if (c->busy_poll_ns)
        kvp_sock_spin_readable(c->fd, c->busy_poll_ns);
    /* one request in flight, one answer to it: the daemon sends nothing after it */
    rc = kvp_sock_recv_answer(c->fd, &c->rbuf, &c->rcap, &len, CLIENT_MAX_FRAME_BYTES, recv_fds,
                              recv_fds ? max_recv : 0, recv_fds ? &nfds : NULL, deadline);
    if (rc)
        return lost(c, rc, "receiving the response");

    rc = kvp__client_decode_response(resp, r, c->rbuf, len, c->last_error, sizeof(c->last_error));
    if (rc)
        goto fail_close_fds; /* framing intact: the connection stays */
    kvpool_Code code = resp->has_status ? resp->status.code : kvpool_Code_OK;
    if (resp->id != id) {
        close_fds(recv_fds, nfds);
        if (resp->id == 0 && code != kvpool_Code_OK) {
            /* the daemon rejected the frame itself and is closing the connection */
            int err = kvp_wire_err_from_code(code);
            lost(c, err, "request rejected");
            return fail(c, err, "%s",
                        resp->status.message[0] ? resp->status.message : kvp_wire_code_name(code));
        }
        lost(c, KVP_EPROTO, "response out of step");
        return fail(c, KVP_EPROTO, "response id %llu does not match request id %llu",
                    (unsigned long long)resp->id, (unsigned long long)id);
    }
    if (code != kvpool_Code_OK) {
        rc = fail(c, kvp_wire_err_from_code(code), "%s",
                  resp->status.message[0] ? resp->status.message : kvp_wire_code_name(code));
        goto fail_close_fds;
    }
    if (expect && resp->which_body != expect) {
        rc = fail(c, KVP_EPROTO, "the daemon answered with body %u, expected %u",
                  (unsigned)resp->which_body, (unsigned)expect);
        goto fail_close_fds;
    }
    if (num_recv)
        *num_recv = nfds;
    return 0;

fail_close_fds:
    close_fds(recv_fds, nfds);
    return rc;
}

char *kvp_client_default_socket(char *buf, size_t len)
{
    if (!buf || !len)
        return NULL;
    const char *env = kvp_knob_env("KVPOOL_SOCKET");
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    int n;
    if (env && *env)
        n = snprintf(buf, len, "%s", env);
    else if (geteuid() == 0)
        n = snprintf(buf, len, "/run/kvpool/kvpool.sock");
    else if (xdg && *xdg)
        n = snprintf(buf, len, "%s/kvpool/kvpool.sock", xdg);
    else
        n = snprintf(buf, len, "/tmp/kvpool-%u/kvpool.sock", (unsigned)geteuid());
    if (n < 0 || (size_t)n >= len)
        return NULL;
    return buf;
}

const char *kvp_client_version(void)
{
    return KVP_VERSION_STRING;
}

unsigned kvp_client_abi_version(void)
{
    return KVP_ABI_VERSION;
}

size_t kvp_client_sizeof(const char *type_name)
{
#define T(t)                                                                                       \
    {                                                                                              \
#t, sizeof(t)                                                                              \
    }
    static const struct {
        const char *name;
        size_t size;
    } types[] = {T(kvp_client_opts_t),     T(kvp_pool_info_t),
                 T(kvp_page_table_t),      T(kvp_source_t),
                 T(kvp_rank_source_t),     T(kvp_stats_summary_t),
                 T(kvp_transfer_ticket_t), T(kvp_transfer_info_t),
                 T(kvp_cache_opts_t),      T(kvp_pin_t),
                 T(kvp_cache_stats_t)};
#undef T
    for (size_t i = 0; type_name && i < sizeof(types) / sizeof(types[0]); i++)
        if (strcmp(types[i].name, type_name) == 0)
            return types[i].size;
    return 0;
}

/* Takes the Hello answer: pool description, and the pool fds (owned by the handle from here
 * on, closed by kvp_client_close whatever happens). */
static int take_hello(kvp_client_t *c, const kvpool_HelloResponse *h, const int *fds, unsigned nfds,
                      int map_pool)
{
    if (!map_pool) {
        close_fds(fds, nfds); /* not asked for */
        nfds = 0;
    }
    for (unsigned i = 0; i < nfds; i++)
        c->pool_fd[i] = fds[i];
    c->num_pool = nfds;

    if (h->protocol_version != KVP_PROTOCOL_VERSION)
        return fail(c, KVP_EPROTO, "the daemon speaks protocol %u, this library %u",
                    h->protocol_version, KVP_PROTOCOL_VERSION);
    c->session_id = h->session_id;
    snprintf(c->server_version, sizeof(c->server_version), "%s", h->server_version);
    if (h->has_pool)
        kvp_wire_pool_info_get(&c->info, &h->pool);
    if (!map_pool)
        return 0;
    if (!h->has_pool)
        return fail(c, KVP_EPROTO, "the Hello answer carries no pool description");
    if (nfds == 0 || nfds != h->pool.num_fds)
        return fail(c, KVP_EPROTO, "the daemon announced %u pool fds and %u arrived",
                    h->pool.num_fds, nfds);

    if (h->pool.backend == kvpool_BackendKind_BACKEND_CUDA)
        return 0; /* kept open for the CUDA VMM import */
    if (h->pool.backend != kvpool_BackendKind_BACKEND_HOST)
        return fail(c, KVP_EPROTO, "unknown backend %d", (int)h->pool.backend);
    if (h->pool.pool_bytes == 0 || h->pool.pool_bytes > SIZE_MAX)
        return fail(c, KVP_EPROTO, "pool size %llu cannot be mapped",
                    (unsigned long long)h->pool.pool_bytes);
    c->pool_map_bytes = (size_t)h->pool.pool_bytes;
    for (unsigned i = 0; i < nfds; i++) {
        struct stat st;
        if (fstat(c->pool_fd[i], &st) < 0)
            return fail(c, -errno, "pool fd %u: fstat: %s", i, strerror(errno));
        if (st.st_size < 0 || (uint64_t)st.st_size < h->pool.pool_bytes)
            return fail(c, KVP_EPROTO, "pool fd %u holds %lld bytes, the pool is %llu", i,
                        (long long)st.st_size, (unsigned long long)h->pool.pool_bytes);
        void *p =
            mmap(NULL, c->pool_map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->pool_fd[i], 0);
        if (p == MAP_FAILED)
            return fail(c, -errno, "cannot map the pool of device %u: %s", i, strerror(errno));
        c->pool_map[i] = p;
        close(c->pool_fd[i]); /* the mapping keeps the memory */
        c->pool_fd[i] = -1;
    }
    return 0;
}

int kvp_client_connect(const kvp_client_opts_t *opts, kvp_client_t **out, char *err, size_t err_len)
{
    static const kvp_client_opts_t defaults;
    const kvp_client_opts_t *o = opts ? opts : &defaults;
    if (err && err_len)
        err[0] = '\0';
    if (!out) {
        if (err)
            snprintf(err, err_len, "kvp_client_connect: out is NULL");
        return KVP_EINVAL;
    }
    const char *ns = o->ns && *o->ns ? o->ns : CLIENT_DEFAULT_NAMESPACE;
    if (strlen(ns) >= sizeof(((kvpool_HelloRequest *)0)->namespace)) {
        if (err)
            snprintf(err, err_len, "namespace longer than %zu bytes",
                     sizeof(((kvpool_HelloRequest *)0)->namespace) - 1);
        return KVP_EINVAL;
    }
    const char *scope = o->cache_scope ? o->cache_scope : "";
    if (strlen(scope) >= sizeof(((kvpool_HelloRequest *)0)->cache_scope)) {
        if (err)
            snprintf(err, err_len, "cache scope longer than %zu bytes",
                     sizeof(((kvpool_HelloRequest *)0)->cache_scope) - 1);
        return KVP_EINVAL;
    }
    char path_buf[sizeof(((struct sockaddr_un *)0)->sun_path)];
    const char *path = o->socket_path && *o->socket_path
                           ? o->socket_path
                           : kvp_client_default_socket(path_buf, sizeof(path_buf));
    if (!path) {
        if (err)
            snprintf(err, err_len, "the default socket path is too long");
        return KVP_EINVAL;
    }
    uint64_t spin_us = o->busy_poll_us;
    if (!spin_us && kvp_knob_env_u64("KVPOOL_BUSY_POLL_US", 0, CLIENT_MAX_BUSY_POLL_US, &spin_us,
                                     err, err_len) < 0)
        return KVP_EINVAL;

    int rc;
    kvp_client_t *c = calloc(1, sizeof(*c));
    if (!c) {
        if (err)
            snprintf(err, err_len, "out of memory");
        return KVP_ENOMEM;
    }
    c->fd = -1;
    for (unsigned i = 0; i < KVP_CLIENT_MAX_DEVICES; i++)
        c->pool_fd[i] = -1;
    c->timeout_ms = o->timeout_ms ? o->timeout_ms : CLIENT_DEFAULT_TIMEOUT_MS;
    c->busy_poll_ns =
        (spin_us > CLIENT_MAX_BUSY_POLL_US ? CLIENT_MAX_BUSY_POLL_US : spin_us) * 1000u;
    c->next_id = random_id(c);
    c->sbuf = malloc(CLIENT_INIT_BUF_BYTES);
    c->rbuf = malloc(CLIENT_INIT_BUF_BYTES);
    if (!c->sbuf || !c->rbuf) {
        rc = fail(c, KVP_ENOMEM, "out of memory");
        goto fail_close;
    }
    c->scap = c->rcap = CLIENT_INIT_BUF_BYTES;

    rc = kvp_sock_connect(path, c->timeout_ms, &c->fd);
    if (rc) {
        fail(c, rc, "cannot connect to %s: %s", path, kvp_strerror(rc));
        goto fail_close;
    }

    kvpool_Request *req = &c->req;
    memset(req, 0, sizeof(*req));
    req->which_body = kvpool_Request_hello_tag;
    kvpool_HelloRequest *h = &req->body.hello;
    h->protocol_version = KVP_PROTOCOL_VERSION;
    h->observer = o->observer != 0;
    if (!h->observer) /* an observer names none */
        snprintf(h->namespace, sizeof(h->namespace), "%s", ns);
    snprintf(h->client_name, sizeof(h->client_name), "%s",
             o->client_name ? o->client_name : program_invocation_short_name);
    h->has_lease_ms = o->lease_ms != KVP_LEASE_DEFAULT && !h->observer;
    h->lease_ms = h->has_lease_ms ? o->lease_ms : 0;
    h->want_pool_fds = o->map_pool != 0;
    snprintf(h->cache_scope, sizeof(h->cache_scope), "%s", scope);

    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, NULL);
    int fds[KVP_MAX_FDS_PER_FRAME];
    unsigned nfds = 0;
    rc = call(c, req, &c->resp, &r, kvpool_Response_hello_tag, NULL, 0, fds, KVP_MAX_FDS_PER_FRAME,
              &nfds);
    if (rc)
        goto fail_close;
    rc = take_hello(c, &c->resp.body.hello, fds, nfds, o->map_pool);
    if (rc)
        goto fail_close;
    *out = c;
    return 0;

fail_close:
    if (err && err_len)
        snprintf(err, err_len, "%s", c->last_error);
    kvp_client_close(c);
    return rc;
}

void kvp_client_close(kvp_client_t *c)
{
    if (!c)
        return;
    kvp__client_cuda_close(c); /* device mappings, buffers and events first */
    if (c->fd >= 0)
        close(c->fd);
    for (uint32_t i = 0; i < c->num_bufs; i++)
        munmap(c->bufs[i].ptr, c->bufs[i].size_bytes);
    for (uint32_t i = 0; i < c->num_pool; i++) {
        if (c->pool_map[i])
            munmap(c->pool_map[i], c->pool_map_bytes);
        if (c->pool_fd[i] >= 0)
            close(c->pool_fd[i]);
    }
    free(c->sbuf);
    free(c->rbuf);
    free(c);
}

const char *kvp_client_last_error(const kvp_client_t *c)
{
    return c ? c->last_error : "";
}

uint64_t kvp_client_session_id(const kvp_client_t *c)
{
    return c ? c->session_id : 0;
}

const char *kvp_client_server_version(const kvp_client_t *c)
{
    return c ? c->server_version : "";
}

const kvp_pool_info_t *kvp_client_pool_info(const kvp_client_t *c)
{
    return c ? &c->info : NULL;
}

void *kvp_client_pool_base(const kvp_client_t *c, uint32_t device)
{
    if (!c || device >= c->num_pool)
        return NULL;
    return c->pool_map[device] ? c->pool_map[device] : c->pool_dev[device];
}

int kvp_client_pool_fd(const kvp_client_t *c, uint32_t device)
{
    if (!c || device >= c->num_pool)
        return -1;
    return c->pool_fd[device];
}

/* A request with no bulk arrays, answered with no bulk arrays. */
static int simple_call(kvp_client_t *c, pb_size_t expect)
{
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, NULL);
    return call(c, &c->req, &c->resp, &r, expect, NULL, 0, NULL, 0, NULL);
}

/* Zeroes the scratch request and sets its body. */
static kvpool_Request *new_request(kvp_client_t *c, pb_size_t which_body)
{
    memset(&c->req, 0, sizeof(c->req));
    c->req.which_body = which_body;
    return &c->req;
}

int kvp_client_ping(kvp_client_t *c, uint64_t *rtt_ns)
{
    if (!c)
        return KVP_EINVAL;
    kvpool_Request *req = new_request(c, kvpool_Request_ping_tag);
    uint64_t nonce = c->next_id ^ 0x9e3779b97f4a7c15ull;
    req->body.ping.nonce = nonce;
    uint64_t t0 = kvp_sock_now_ns();
    int rc = simple_call(c, kvpool_Response_ping_tag);
    uint64_t t1 = kvp_sock_now_ns();
    if (rc)
        return rc;
    if (c->resp.body.ping.nonce != nonce)
        return fail(c, KVP_EPROTO, "ping answered with another nonce");
    if (rtt_ns)
        *rtt_ns = t1 - t0;
    return 0;
}

static int register_fd(kvp_client_t *c, int fd, kvpool_BufferKind kind, uint64_t size_bytes,
                       uint32_t *buffer_id)
{
    kvpool_Request *req = new_request(c, kvpool_Request_register_buffer_tag);
    req->body.register_buffer.kind = kind;
    req->body.register_buffer.size_bytes = size_bytes;
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, NULL);
    int rc = call(c, req, &c->resp, &r, kvpool_Response_register_buffer_tag, &fd, 1, NULL, 0, NULL);
    if (rc)
        return rc;
    *buffer_id = c->resp.body.register_buffer.buffer_id;
    return 0;
}

int kvp_client_register_fd(kvp_client_t *c, int fd, uint32_t kind, uint64_t size_bytes,
                           uint32_t *buffer_id)
{
    if (!c)
        return KVP_EINVAL;
    if (fd < 0 || !buffer_id || size_bytes == 0)
        return fail(c, KVP_EINVAL, "register_fd: bad fd, size or buffer_id");
    if (kind != kvpool_BufferKind_BUFFER_MEMFD && kind != kvpool_BufferKind_BUFFER_CUDA_VMM_FD)
        return fail(c, KVP_EINVAL, "register_fd: kind %u is not 0 (memfd) or 1 (cuda vmm fd)",
                    kind);
    /* a closed fd would fail the send, and a failed send costs the connection */
    if (fcntl(fd, F_GETFD) < 0)
        return fail(c, KVP_EINVAL, "register_fd: fd %d is not open", fd);
    return register_fd(c, fd, (kvpool_BufferKind)kind, size_bytes, buffer_id);
}

int kvp_client_alloc_host_buffer(kvp_client_t *c, uint64_t size_bytes, void **ptr,
                                 uint32_t *buffer_id)
{
    if (!c)
        return KVP_EINVAL;
    if (!ptr || !buffer_id || size_bytes == 0 || size_bytes > (uint64_t)INT64_MAX ||
        size_bytes > SIZE_MAX)
        return fail(c, KVP_EINVAL, "alloc_host_buffer: bad size or NULL output");
    if (c->num_bufs == CLIENT_MAX_HOST_BUFFERS)
        return fail(c, KVP_ELIMIT, "alloc_host_buffer: at most %u host buffers per handle",
                    CLIENT_MAX_HOST_BUFFERS);

    int rc;
    int fd = memfd_create("kvpool-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return fail(c, -errno, "memfd_create: %s", strerror(errno));
    if (ftruncate(fd, (off_t)size_bytes) < 0) {
        rc = fail(c, -errno, "ftruncate %llu bytes: %s", (unsigned long long)size_bytes,
                  strerror(errno));
        goto fail_close;
    }
    /* The daemon maps this memory: a fixed size means it can never fault on a shrunk file. */
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
        rc = fail(c, -errno, "sealing the staging memfd: %s", strerror(errno));
        goto fail_close;
    }
    void *p = mmap(NULL, (size_t)size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        rc =
            fail(c, -errno, "mmap %llu bytes: %s", (unsigned long long)size_bytes, strerror(errno));
        goto fail_close;
    }
    uint32_t id;
    rc = register_fd(c, fd, kvpool_BufferKind_BUFFER_MEMFD, size_bytes, &id);
    if (rc)
        goto fail_unmap;
    close(fd); /* the daemon holds its own reference now */
    c->bufs[c->num_bufs].id = id;
    c->bufs[c->num_bufs].ptr = p;
    c->bufs[c->num_bufs].size_bytes = (size_t)size_bytes;
    c->num_bufs++;
    *ptr = p;
    *buffer_id = id;
    return 0;

fail_unmap:
    munmap(p, (size_t)size_bytes);
fail_close:
    close(fd);
    return rc;
}

int kvp_client_unregister_buffer(kvp_client_t *c, uint32_t buffer_id)
{
    if (!c)
        return KVP_EINVAL;
    kvpool_Request *req = new_request(c, kvpool_Request_unregister_buffer_tag);
    req->body.unregister_buffer.buffer_id = buffer_id;
    /* an empty body may arrive as no body at all: accept any */
    int rc = simple_call(c, 0);
    if (rc && rc != KVP_ENOENT)
        return rc; /* keep the mapping: the daemon may still read it */
    for (uint32_t i = 0; i < c->num_bufs; i++) {
        if (c->bufs[i].id != buffer_id)
            continue;
        munmap(c->bufs[i].ptr, c->bufs[i].size_bytes);
        c->bufs[i] = c->bufs[--c->num_bufs];
        break;
    }
    return rc;
}

/* Sends a batch request built in c->req and reads the page table into table. */
static int table_call(kvp_client_t *c, pb_size_t expect, kvp_page_table_t *table)
{
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, table);
    if (table)
        table->batch_size = table->nnz = table->num_indices = table->num_copies = 0;
    int rc = call(c, &c->req, &c->resp, &r, expect, NULL, 0, NULL, 0, NULL);
    if (rc)
        return rc;
    rc = kvp__client_table_fill(table, &c->resp, &r);
    if (rc == KVP_ELIMIT)
        return fail(c, rc, "the reply's batch of %u rows is larger than cap_batch %u",
                    response_batch_size(&c->resp), table ? table->cap_batch : 0);
    if (rc)
        return fail(c, rc, "the daemon sent a page table whose arrays disagree with its size");
    return 0;
}

static int check_batch(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                       uint32_t n, int need_tokens)
{
    if (n && (!seq_ids || (need_tokens && !num_tokens)))
        return fail(c, KVP_EINVAL, "NULL seq_ids or num_tokens with n = %u", n);
    return 0;
}

int kvp_client_append(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                      uint32_t n, const kvp_source_t *src, kvp_page_table_t *table)
{
    return kvp__client_append(c, seq_ids, num_tokens, n, src, kvpool_SyncMode_SYNC_NONE, table);
}

int kvp_client_append_cached(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                             uint32_t n, const kvp_source_t *src, const kvp_cache_opts_t *cache,
                             kvp_page_table_t *table)
{
    return kvp__client_append_ranks(c, seq_ids, num_tokens, n, src, NULL, 0,
                                    kvpool_SyncMode_SYNC_NONE, cache, table);
}

int kvp__client_append(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                       uint32_t n, const kvp_source_t *src, kvpool_SyncMode sync,
                       kvp_page_table_t *table)
{
    return kvp__client_append_ranks(c, seq_ids, num_tokens, n, src, NULL, 0, sync, NULL, table);
}

/* The prefix-cache arrays of cache into b (of kvp__client_batch_arrays, before
 * kvp__client_request_batch binds them), with the reason of a refusal. */
static int cache_arrays(kvp_client_t *c, const char *who, kvp_batch_arrays_t *b,
                        const uint32_t *num_tokens, uint32_t n, const kvp_cache_opts_t *cache)
{
    const char *why = NULL;
    if (kvp__client_batch_cache(b, num_tokens, n, cache, &why))
        return fail(c, KVP_EINVAL, "%s: %s", who, why);
    return 0;
}

/* The body's CacheOptions (opts, has_opts) of cache. */
static int cache_options(kvp_client_t *c, const char *who, const kvp_cache_opts_t *cache,
                         kvpool_CacheOptions *opts, bool *has_opts)
{
    if (kvp__client_cache_options(opts, has_opts, cache))
        return fail(c, KVP_EINVAL, "%s: priority %d (0..100, or -1 for the default)", who,
                    cache->priority);
    return 0;
}

int kvp_client_append_ranks(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                            uint32_t n, const kvp_source_t *src, const kvp_rank_source_t *ranks,
                            uint32_t num_ranks, int sync_events, kvp_page_table_t *table)
{
    if (!c)
        return KVP_EINVAL;
    if (!ranks || num_ranks == 0)
        return fail(c, KVP_EINVAL, "append_ranks: no ranks given");
    return kvp__client_append_ranks(
        c, seq_ids, num_tokens, n, src, ranks, num_ranks,
        sync_events ? kvpool_SyncMode_SYNC_EVENT : kvpool_SyncMode_SYNC_NONE, NULL, table);
}

int kvp__client_append_ranks(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                             uint32_t n, const kvp_source_t *src, const kvp_rank_source_t *ranks,
                             uint32_t num_ranks, kvpool_SyncMode sync,
                             const kvp_cache_opts_t *cache, kvp_page_table_t *table)
{
    if (!c)
        return KVP_EINVAL;
    if (num_ranks >
        sizeof(c->req.body.append.rank_sources) / sizeof(c->req.body.append.rank_sources[0]))
        return fail(c, KVP_EINVAL, "append: %u ranks, at most %u", num_ranks,
                    (unsigned)(sizeof(c->req.body.append.rank_sources) /
                               sizeof(c->req.body.append.rank_sources[0])));
    int rc = check_batch(c, seq_ids, num_tokens, n, 1);
    if (rc)
        return rc;
    if (!src)
        return fail(c, KVP_EINVAL, "append: NULL source");
    kvp_batch_arrays_t b;
    kvp__client_batch_arrays(&b, seq_ids, num_tokens, n);
    if (cache && (rc = cache_arrays(c, "append", &b, num_tokens, n, cache)))
        return rc;
    kvp__client_request_batch(&c->req, kvpool_Request_append_tag, &b);
    kvpool_AppendRequest *a = &c->req.body.append;
    if (cache && (rc = cache_options(c, "append", cache, &a->cache, &a->has_cache)))
        return rc;
    if (cache)
        a->skip_tokens = cache->skip_tokens;
    a->has_source = true;
    kvp_wire_source_put(&a->source, src->buffer_id, &src->layout, src->layer_begin, src->layer_end);
    if (num_ranks) {
        a->source.buffer_id = 0; /* each rank's buffer is named below */
        for (uint32_t g = 0; g < num_ranks; g++) {
            a->rank_sources[g].session_id = ranks[g].session_id;
            a->rank_sources[g].buffer_id = ranks[g].buffer_id;
        }
        a->rank_sources_count = (pb_size_t)num_ranks;
    }
    a->sync = sync;
    return table_call(c, kvpool_Response_append_tag, table);
}

int kvp__client_append_completed(const kvp_client_t *c)
{
    return c->resp.which_body == kvpool_Response_append_tag && c->resp.body.append.completed;
}

int kvp_client_reserve(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                       uint32_t n, kvp_page_table_t *table)
{
    return kvp_client_reserve_cached(c, seq_ids, num_tokens, n, NULL, table);
}

int kvp_client_reserve_cached(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                              uint32_t n, const kvp_cache_opts_t *cache, kvp_page_table_t *table)
{
    if (!c)
        return KVP_EINVAL;
    int rc = check_batch(c, seq_ids, num_tokens, n, 1);
    if (rc)
        return rc;
    kvp_batch_arrays_t b;
    kvp__client_batch_arrays(&b, seq_ids, num_tokens, n);
    if (cache && (rc = cache_arrays(c, "reserve", &b, num_tokens, n, cache)))
        return rc;
    kvp__client_request_batch(&c->req, kvpool_Request_reserve_tag, &b);
    kvpool_ReserveRequest *q = &c->req.body.reserve;
    if (cache && (rc = cache_options(c, "reserve", cache, &q->cache, &q->has_cache)))
        return rc;
    return table_call(c, kvpool_Response_reserve_tag, table);
}

/* The request of a call that names only sequences (Commit, GetPageTable, Release) into c->req,
 * its seq_ids checked; b holds the arrays the request points at until it is sent. */
static int seqs_request(kvp_client_t *c, pb_size_t tag, const uint64_t *seq_ids, uint32_t n,
                        kvp_batch_arrays_t *b)
{
    if (!c)
        return KVP_EINVAL;
    int rc = check_batch(c, seq_ids, NULL, n, 0);
    if (rc)
        return rc;
    kvp__client_batch_arrays(b, seq_ids, NULL, n);
    kvp__client_request_batch(&c->req, tag, b);
    return 0;
}

int kvp_client_commit(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n,
                      const void *event_handle, uint32_t *pages, uint32_t *published)
{
    kvp_batch_arrays_t b;
    int rc = seqs_request(c, kvpool_Request_commit_tag, seq_ids, n, &b);
    if (rc)
        return rc;
    kvpool_CommitRequest *q = &c->req.body.commit;
    if (event_handle) {
        memcpy(q->event_handle.bytes, event_handle, sizeof(q->event_handle.bytes));
        q->event_handle.size = sizeof(q->event_handle.bytes);
    }
    rc = simple_call(c, kvpool_Response_commit_tag);
    if (rc)
        return rc;
    if (pages)
        *pages = c->resp.body.commit.pages;
    if (published)
        *published = c->resp.body.commit.published;
    return 0;
}

int kvp_client_lookup(kvp_client_t *c, const int32_t *token_ids, const uint32_t *lengths,
                      uint32_t n, const uint8_t *salts, const uint32_t *salt_lens,
                      uint32_t *cached_tokens)
{
    if (!c)
        return KVP_EINVAL;
    if (n && (!lengths || !cached_tokens))
        return fail(c, KVP_EINVAL, "lookup: NULL lengths or cached_tokens with n = %u", n);
    uint32_t total = 0;
    if (n && sum_u32(lengths, n, &total))
        return fail(c, KVP_EINVAL, "lookup: the lengths add up to more than UINT32_MAX");
    if (total && !token_ids)
        return fail(c, KVP_EINVAL, "lookup: NULL token_ids for %u tokens", total);
    kvp_batch_arrays_t b;
    kvp__client_batch_arrays(&b, NULL, lengths, n);
    b.token_ids = kvp_array((void *)token_ids, sizeof(int32_t), total, total);
    const char *why = NULL;
    if (salt_arrays(&b, salts, salt_lens, n, &why))
        return fail(c, KVP_EINVAL, "lookup: %s", why);
    kvpool_Request *req = new_request(c, kvpool_Request_lookup_tag);
    kvp_wire_lookup_request_bind_encode(&req->body.lookup, &b);
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, NULL);
    r.cached_tokens = kvp_array(cached_tokens, sizeof(uint32_t), 0, n);
    int rc = call(c, &c->req, &c->resp, &r, kvpool_Response_lookup_tag, NULL, 0, NULL, 0, NULL);
    if (rc)
        return rc;
    if (r.cached_tokens.count != n)
        return fail(c, KVP_EPROTO, "lookup: %u answers for %u prompts", r.cached_tokens.count, n);
    return 0;
}

int kvp_client_pin(kvp_client_t *c, const int32_t *token_ids, uint32_t num_tokens, const void *salt,
                   uint32_t salt_len, uint32_t ttl_ms, kvp_pin_t *out)
{
    if (!c)
        return KVP_EINVAL;
    if (num_tokens && !token_ids)
        return fail(c, KVP_EINVAL, "pin: NULL token_ids for %u tokens", num_tokens);
    if (salt_len && !salt)
        return fail(c, KVP_EINVAL, "pin: NULL salt of %u bytes", salt_len);
    kvpool_Request *req = new_request(c, kvpool_Request_pin_tag);
    kvpool_PinRequest *q = &req->body.pin;
    if (salt_len > sizeof(q->salt.bytes))
        return fail(c, KVP_EINVAL, "pin: a salt of %u bytes, at most %zu", salt_len,
                    sizeof(q->salt.bytes));
    kvp_batch_arrays_t b;
    kvp__client_batch_arrays(&b, NULL, NULL, 0);
    b.token_ids = kvp_array((void *)token_ids, sizeof(int32_t), num_tokens, num_tokens);
    kvp_wire_pin_request_bind_encode(q, &b);
    if (salt_len)
        memcpy(q->salt.bytes, salt, salt_len);
    q->salt.size = (pb_size_t)salt_len;
    q->ttl_ms = ttl_ms;
    int rc = simple_call(c, kvpool_Response_pin_tag);
    if (rc)
        return rc;
    if (out) {
        const kvpool_PinResponse *p = &c->resp.body.pin;
        out->pin_id = p->pin_id;
        out->pinned_tokens = p->pinned_tokens;
        out->pinned_pages = p->pinned_pages;
        out->expires_in_ms = p->expires_in_ms;
    }
    return 0;
}

int kvp_client_unpin(kvp_client_t *c, uint64_t pin_id, uint32_t *pages)
{
    if (!c)
        return KVP_EINVAL;
    kvpool_Request *req = new_request(c, kvpool_Request_unpin_tag);
    req->body.unpin.pin_id = pin_id;
    int rc = simple_call(c, kvpool_Response_unpin_tag);
    if (rc)
        return rc;
    if (pages)
        *pages = c->resp.body.unpin.pages;
    return 0;
}

int kvp_client_cache_flush(kvp_client_t *c, const char *scope, int all, uint32_t *pages)
{
    if (!c)
        return KVP_EINVAL;
    kvpool_Request *req = new_request(c, kvpool_Request_cache_flush_tag);
    kvpool_CacheFlushRequest *q = &req->body.cache_flush;
    if (scope && strlen(scope) >= sizeof(q->scope))
        return fail(c, KVP_EINVAL, "cache_flush: scope longer than %zu bytes",
                    sizeof(q->scope) - 1);
    snprintf(q->scope, sizeof(q->scope), "%s", scope ? scope : "");
    q->all = all != 0;
    int rc = simple_call(c, kvpool_Response_cache_flush_tag);
    if (rc)
        return rc;
    if (pages)
        *pages = c->resp.body.cache_flush.pages;
    return 0;
}

int kvp_client_page_table(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n,
                          kvp_page_table_t *table)
{
    kvp_batch_arrays_t b;
    int rc = seqs_request(c, kvpool_Request_get_page_table_tag, seq_ids, n, &b);
    if (rc)
        return rc;
    return table_call(c, kvpool_Response_get_page_table_tag, table);
}

int kvp_client_release(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n, uint32_t *released)
{
    kvp_batch_arrays_t b;
    int rc = seqs_request(c, kvpool_Request_release_tag, seq_ids, n, &b);
    if (rc)
        return rc;
    rc = simple_call(c, kvpool_Response_release_tag);
    if (rc)
        return rc;
    if (released)
        *released = c->resp.body.release.released;
    return 0;
}

int kvp_client_fork(kvp_client_t *c, uint64_t parent, uint64_t child)
{
    if (!c)
        return KVP_EINVAL;
    kvpool_Request *req = new_request(c, kvpool_Request_fork_tag);
    req->body.fork.parent = parent;
    req->body.fork.child = child;
    return simple_call(c, kvpool_Response_fork_tag);
}

int kvp_client_truncate(kvp_client_t *c, uint64_t seq_id, uint32_t num_tokens)
{
    if (!c)
        return KVP_EINVAL;
    kvpool_Request *req = new_request(c, kvpool_Request_truncate_tag);
    req->body.truncate.seq_id = seq_id;
    req->body.truncate.num_tokens = num_tokens;
    return simple_call(c, kvpool_Response_truncate_tag);
}

/* A Stats call for `who` into out (zeroed first): 0 and *s (NULL when the answer holds no
 * stats), or the call's error. */
static int stats_call(kvp_client_t *c, const char *who, void *out, size_t out_len,
                      const kvpool_Stats **s)
{
    if (!c)
        return KVP_EINVAL;
    if (!out)
        return fail(c, KVP_EINVAL, "%s: NULL output", who);
    new_request(c, kvpool_Request_stats_tag);
    int rc = simple_call(c, kvpool_Response_stats_tag);
    if (rc)
        return rc;
    memset(out, 0, out_len);
    *s = c->resp.body.stats.has_stats ? &c->resp.body.stats.stats : NULL;
    return 0;
}

int kvp_client_stats(kvp_client_t *c, kvp_stats_summary_t *out)
{
    const kvpool_Stats *s = NULL;
    int rc = stats_call(c, "stats", out, sizeof(*out), &s);
    if (rc || !s)
        return rc;
    out->num_pages = s->num_pages;
    out->free_pages = s->free_pages;
    out->used_pages = s->used_pages;
    out->shared_pages = s->shared_pages;
    out->num_seqs = s->num_seqs;
    out->num_clients = s->num_clients;
    out->num_tokens = s->num_tokens;
    out->page_refs = s->page_refs;
    out->page_bytes = s->page_bytes;
    out->uptime_ms = s->uptime_ms;
    out->requests_total = s->requests_total;
    out->append_bytes_total = s->append_bytes_total;
    return 0;
}

int kvp_client_cache_stats(kvp_client_t *c, kvp_cache_stats_t *out)
{
    const kvpool_Stats *st = NULL;
    int rc = stats_call(c, "cache_stats", out, sizeof(*out), &st);
    if (rc || !st || !st->has_cache)
        return rc;
    const kvpool_CacheStats *s = &st->cache;
    out->cached_pages = s->cached_pages;
    out->pinned_pages = s->pinned_pages;
    out->indexed_pages = s->indexed_pages;
    out->pins = s->pins;
    out->query_tokens_total = s->query_tokens_total;
    out->hit_tokens_total = s->hit_tokens_total;
    out->evictions_pressure_total = s->evictions_pressure_total;
    out->evictions_flush_total = s->evictions_flush_total;
    out->evictions_rewrite_total = s->evictions_rewrite_total;
    out->bytes = s->bytes;
    return 0;
}

int kvp_client_audit(kvp_client_t *c)
{
    if (!c)
        return KVP_EINVAL;
    new_request(c, kvpool_Request_audit_tag);
    int rc = simple_call(c, kvpool_Response_audit_tag);
    if (rc)
        return rc;
    if (!c->resp.body.audit.ok)
        return fail(c, KVP_EAUDIT, "%s",
                    c->resp.body.audit.message[0] ? c->resp.body.audit.message
                                                  : "audit failed (no message)");
    return 0;
}

static int export_begin(kvp_client_t *c, uint64_t seq_id, const uint64_t *seq_ids, uint32_t n,
                        const char *peer, uint32_t timeout_ms, kvp_transfer_ticket_t *ticket)
{
    if (!c)
        return KVP_EINVAL;
    if (!peer || !ticket || strlen(peer) >= sizeof(c->req.body.export_begin.peer))
        return fail(c, KVP_EINVAL, "export_begin: NULL ticket, or peer NULL or over %zu bytes",
                    sizeof(c->req.body.export_begin.peer) - 1);
    if (seq_ids && (n == 0 || n > KVP_TRANSFER_MAX_SEQS))
        return fail(c, KVP_EINVAL, "export_begin: a set of %u sequences (1..%d)", n,
                    KVP_TRANSFER_MAX_SEQS);
    new_request(c, kvpool_Request_export_begin_tag);
    kvpool_ExportBeginRequest *q = &c->req.body.export_begin;
    q->seq_id = seq_id;
    if (seq_ids) {
        q->seq_ids_count = n;
        memcpy(q->seq_ids, seq_ids, (size_t)n * sizeof(uint64_t));
    }
    snprintf(q->peer, sizeof(q->peer), "%s", peer);
    q->timeout_ms = timeout_ms;
    int rc = simple_call(c, kvpool_Response_export_begin_tag);
    if (rc)
        return rc;
    const kvpool_ExportBeginResponse *r = &c->resp.body.export_begin;
    if (r->nccl_id.size != KVP_TRANSFER_ID_BYTES)
        return fail(c, KVP_EPROTO, "export_begin: nccl_id of %u bytes", (unsigned)r->nccl_id.size);
    if (r->seq_tokens_count != (seq_ids ? n : 1))
        return fail(c, KVP_EPROTO, "export_begin: %u token counts for %u sequences",
                    (unsigned)r->seq_tokens_count, seq_ids ? n : 1);
    memcpy(ticket->nccl_id, r->nccl_id.bytes, KVP_TRANSFER_ID_BYTES);
    ticket->transfer_id = r->transfer_id;
    ticket->num_tokens = r->num_tokens;
    ticket->num_layers = r->num_layers;
    ticket->bytes = r->bytes;
    ticket->num_seqs = r->seq_tokens_count;
    ticket->chunk_bytes = r->chunk_bytes;
    ticket->flags = r->flags;
    memcpy(ticket->seq_tokens, r->seq_tokens, r->seq_tokens_count * sizeof(uint32_t));
    return 0;
}

int kvp_client_export_begin(kvp_client_t *c, uint64_t seq_id, const char *peer, uint32_t timeout_ms,
                            kvp_transfer_ticket_t *ticket)
{
    return export_begin(c, seq_id, NULL, 0, peer, timeout_ms, ticket);
}

int kvp_client_export_begin_set(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n,
                                const char *peer, uint32_t timeout_ms,
                                kvp_transfer_ticket_t *ticket)
{
    if (c && !seq_ids)
        return fail(c, KVP_EINVAL, "export_begin_set: NULL seq_ids");
    return export_begin(c, 0, seq_ids, n, peer, timeout_ms, ticket);
}

static int import(kvp_client_t *c, const kvp_transfer_ticket_t *ticket, uint64_t seq_id,
                  const uint64_t *seq_ids, uint32_t timeout_ms, uint32_t *num_pages)
{
    if (!c)
        return KVP_EINVAL;
    if (!ticket)
        return fail(c, KVP_EINVAL, "import: NULL ticket");
    if (ticket->num_seqs == 0 || ticket->num_seqs > KVP_TRANSFER_MAX_SEQS ||
        (!seq_ids && ticket->num_seqs != 1))
        return fail(c, KVP_EINVAL, "import: the ticket names %u sequences%s", ticket->num_seqs,
                    seq_ids ? "" : " (a set: kvp_client_import_set)");
    new_request(c, kvpool_Request_import_tag);
    kvpool_ImportRequest *q = &c->req.body.import;
    memcpy(q->nccl_id.bytes, ticket->nccl_id, KVP_TRANSFER_ID_BYTES);
    q->nccl_id.size = KVP_TRANSFER_ID_BYTES;
    q->transfer_id = ticket->transfer_id;
    q->seq_id = seq_id;
    if (seq_ids) {
        q->seq_ids_count = ticket->num_seqs;
        memcpy(q->seq_ids, seq_ids, ticket->num_seqs * sizeof(uint64_t));
        q->seq_tokens_count = ticket->num_seqs;
        memcpy(q->seq_tokens, ticket->seq_tokens, ticket->num_seqs * sizeof(uint32_t));
    }
    q->num_tokens = ticket->num_tokens;
    q->num_layers = ticket->num_layers;
    q->bytes = ticket->bytes;
    q->chunk_bytes = ticket->chunk_bytes;
    q->flags = ticket->flags;
    q->timeout_ms = timeout_ms;
    /* the daemon answers when the transfer ends: wait for its deadline, then ours */
    const uint32_t saved = c->timeout_ms;
    uint64_t wait = (uint64_t)saved + (timeout_ms ? timeout_ms : 3600000u);
    c->timeout_ms = wait > UINT32_MAX ? UINT32_MAX : (uint32_t)wait;
    int rc = simple_call(c, kvpool_Response_import_tag);
    c->timeout_ms = saved;
    if (rc)
        return rc;
    if (num_pages)
        *num_pages = c->resp.body.import.num_pages;
    return 0;
}

int kvp_client_import(kvp_client_t *c, const kvp_transfer_ticket_t *ticket, uint64_t seq_id,
                      uint32_t timeout_ms, uint32_t *num_pages)
{
    return import(c, ticket, seq_id, NULL, timeout_ms, num_pages);
}

int kvp_client_import_set(kvp_client_t *c, const kvp_transfer_ticket_t *ticket,
                          const uint64_t *seq_ids, uint32_t timeout_ms, uint32_t *num_pages)
{
    if (c && !seq_ids)
        return fail(c, KVP_EINVAL, "import_set: NULL seq_ids");
    return import(c, ticket, 0, seq_ids, timeout_ms, num_pages);
}

int kvp_client_list_transfers(kvp_client_t *c, kvp_transfer_info_t *out, uint32_t max, uint32_t *n)
{
    if (!c)
        return KVP_EINVAL;
    if ((!out && max) || !n)
        return fail(c, KVP_EINVAL, "list_transfers: NULL out or n");
    new_request(c, kvpool_Request_list_transfers_tag);
    int rc = simple_call(c, kvpool_Response_list_transfers_tag);
    if (rc)
        return rc;
    const kvpool_ListTransfersResponse *r = &c->resp.body.list_transfers;
    uint32_t k = 0;
    for (; k < r->transfers_count && k < max; k++) {
        const kvpool_TransferInfo *t = &r->transfers[k];
        kvp_transfer_info_t *o = &out[k];
        memset(o, 0, sizeof(*o));
        o->transfer_id = t->transfer_id;
        o->num_seqs = t->num_seqs;
        o->seq_id = t->seq_id;
        o->bytes = t->bytes;
        o->elapsed_ms = t->elapsed_ms;
        o->num_tokens = t->num_tokens;
        snprintf(o->direction, sizeof(o->direction), "%s", t->direction);
        snprintf(o->state, sizeof(o->state), "%s", t->state);
        snprintf(o->peer, sizeof(o->peer), "%s", t->peer);
        snprintf(o->ns, sizeof(o->ns), "%s", t->namespace);
        snprintf(o->message, sizeof(o->message), "%s", t->message);
    }
    *n = k;
    return 0;
}

int kvp_client_call_raw(kvp_client_t *c, void *request, void *response, void *arrays)
{
    if (!c)
        return KVP_EINVAL;
    if (!request || !response)
        return fail(c, KVP_EINVAL, "call_raw: NULL request or response");
    kvp_reply_arrays_t sink;
    kvp_reply_arrays_t *r = arrays;
    if (!r) {
        kvp__client_table_arrays(&sink, NULL);
        r = &sink;
    }
    return call(c, request, response, r, 0, NULL, 0, NULL, 0, NULL);
}

/* ---- the handle's internals for kvp_client_cuda.c (kvp_client_internal.h) -------------- */

kvpool_Request *kvp__client_request(kvp_client_t *c, pb_size_t which_body)
{
    return new_request(c, which_body);
}

int kvp__client_call(kvp_client_t *c, pb_size_t expect, kvp_reply_arrays_t *r, const int *fds,
                     unsigned nfds)
{
    kvp_reply_arrays_t sink;
    if (!r) {
        kvp__client_table_arrays(&sink, NULL);
        r = &sink;
    }
    return call(c, &c->req, &c->resp, r, expect, fds, nfds, NULL, 0, NULL);
}

const kvpool_Response *kvp__client_response(const kvp_client_t *c)
{
    return &c->resp;
}

int kvp__client_fail(kvp_client_t *c, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->last_error, sizeof(c->last_error), fmt, ap);
    va_end(ap);
    return rc;
}

void **kvp__client_cuda_state(kvp_client_t *c)
{
    return &c->cuda;
}

void kvp__client_set_pool_base(kvp_client_t *c, uint32_t device, void *base)
{
    if (device < c->num_pool)
        c->pool_dev[device] = base;
}

uint32_t kvp__client_num_pool(const kvp_client_t *c)
{
    return c->num_pool;
}
