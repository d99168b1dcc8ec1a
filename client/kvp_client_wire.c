/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_client_wire.c - libkvpool's message steps apart from the socket: the Batch arrays a
 * request points at, the prefix-cache fields, the decoding of one Response payload with bulk
 * arrays going straight into the caller's arrays (sinks for those not wanted), and the page
 * table's counts and checks after a decode. Pure functions of their arguments, so
 * tests/unit/test_client_wire.c checks them against the daemon's decoder. It holds no handle
 * and sends nothing: the round trip is kvp_client.c's.
 */
#include <stdio.h>
#include <string.h>

#include <pb_decode.h>

#include "kvp_client_internal.h"
#include "kvp_wire.h"

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
        sink_if_unwanted(&((kvpool_LookupResponse *)field->pData)->host_tokens, &r->host_tokens);
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
int kvp__client_sum_u32(const uint32_t *v, uint32_t n, uint32_t *out)
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
int kvp__client_salt_arrays(kvp_batch_arrays_t *b, const uint8_t *salts, const uint32_t *salt_lens,
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
    if (kvp__client_sum_u32(salt_lens, n, &bytes)) {
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
        if (!num_tokens || kvp__client_sum_u32(num_tokens, n, &total)) {
            *why = "token ids need num_tokens adding up to at most UINT32_MAX";
            return KVP_EINVAL;
        }
        b->token_ids = kvp_array((void *)cache->token_ids, sizeof(int32_t), total, total);
    }
    return kvp__client_salt_arrays(b, cache->salts, cache->salt_lens, n, why);
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
        r->host_tokens = kvp_array(NULL, 4, 0, 0);
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
               {&r->cached_tokens, "cached_tokens"},
               {&r->host_tokens, "host_tokens"}};
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

uint32_t kvp__client_response_batch_size(const kvpool_Response *resp)
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
