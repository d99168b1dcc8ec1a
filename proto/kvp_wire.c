/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_wire.c - frame helpers, bulk-array callbacks and status mapping (see kvp_wire.h).
 */
#include "kvp_wire.h"

#include "kvp_limits.h"

#include <string.h>

#include <pb_decode.h>
#include <pb_encode.h>

#include "kvp_error.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvpool's bulk arrays are little-endian on the wire; this host is not"
#endif

static bool array_encode(pb_ostream_t *stream, const pb_field_t *field, void *const *arg)
{
    const kvp_array_t *a = *arg;
    if (!pb_encode_tag_for_field(stream, field))
        return false;
    return pb_encode_string(stream, a->data, (size_t)a->count * a->elem_size);
}

static bool array_decode(pb_istream_t *stream, const pb_field_t *field, void **arg)
{
    (void)field;
    kvp_array_t *a = *arg;
    size_t n = stream->bytes_left;
    if (!a->elem_size) { /* a zeroed array: prepared for no element */
        if (n == 0) {
            a->count = 0;
            return true;
        }
        a->bad = KVP_ELIMIT;
        PB_RETURN_ERROR(stream, "array not accepted (no capacity prepared)");
    }
    if (n % a->elem_size) {
        a->bad = KVP_EINVAL;
        PB_RETURN_ERROR(stream, "array length not a multiple of its element size");
    }
    if (n / a->elem_size > a->cap) {
        a->bad = KVP_ELIMIT;
        PB_RETURN_ERROR(stream, "array longer than the configured limit");
    }
    if (!pb_read(stream, a->data, n))
        return false;
    a->count = (uint32_t)(n / a->elem_size);
    return true;
}

void kvp_array_bind_encode(pb_callback_t *cb, kvp_array_t *a)
{
    cb->funcs.encode = array_encode;
    cb->arg = a;
}

void kvp_array_bind_decode(pb_callback_t *cb, kvp_array_t *a)
{
    a->count = 0;
    a->bad = 0;
    cb->funcs.decode = array_decode;
    cb->arg = a;
}

static bool text_encode(pb_ostream_t *stream, const pb_field_t *field, void *const *arg)
{
    const kvp_text_t *t = *arg;
    if (!pb_encode_tag_for_field(stream, field))
        return false;
    return pb_encode_string(stream, (const pb_byte_t *)t->s, t->len);
}

static bool text_decode(pb_istream_t *stream, const pb_field_t *field, void **arg)
{
    (void)field;
    kvp_text_t *t = *arg;
    size_t n = stream->bytes_left;
    if (!t->cap || n > t->cap - 1) {
        t->bad = KVP_ELIMIT;
        PB_RETURN_ERROR(stream, "text longer than the buffer");
    }
    if (!pb_read(stream, (pb_byte_t *)t->s, n))
        return false;
    t->s[n] = '\0';
    t->len = n;
    return true;
}

void kvp_text_bind_encode(pb_callback_t *cb, kvp_text_t *t)
{
    cb->funcs.encode = text_encode;
    cb->arg = t;
}

void kvp_text_bind_decode(pb_callback_t *cb, kvp_text_t *t)
{
    t->len = 0;
    t->bad = 0;
    if (t->cap)
        t->s[0] = '\0';
    cb->funcs.decode = text_decode;
    cb->arg = t;
}

static void bind_batch_decode(kvpool_Batch *batch, kvp_batch_arrays_t *b)
{
    kvp_array_bind_decode(&batch->seq_ids, &b->seq_ids);
    kvp_array_bind_decode(&batch->num_tokens, &b->num_tokens);
    kvp_array_bind_decode(&batch->token_ids, &b->token_ids);
    kvp_array_bind_decode(&batch->salts, &b->salts);
    kvp_array_bind_decode(&batch->salt_lens, &b->salt_lens);
}

/* Called by nanopb before a oneof submessage of Request is decoded: binds its arrays. */
static bool request_body_cb(pb_istream_t *stream, const pb_field_t *field, void **arg)
{
    (void)stream;
    kvp_batch_arrays_t *b = *arg;
    switch (field->tag) {
    case kvpool_Request_append_tag:
        bind_batch_decode(&((kvpool_AppendRequest *)field->pData)->batch, b);
        break;
    case kvpool_Request_reserve_tag:
        bind_batch_decode(&((kvpool_ReserveRequest *)field->pData)->batch, b);
        break;
    case kvpool_Request_release_tag:
        bind_batch_decode(&((kvpool_ReleaseRequest *)field->pData)->batch, b);
        break;
    case kvpool_Request_get_page_table_tag:
        bind_batch_decode(&((kvpool_GetPageTableRequest *)field->pData)->batch, b);
        break;
    case kvpool_Request_commit_tag:
        bind_batch_decode(&((kvpool_CommitRequest *)field->pData)->batch, b);
        break;
    case kvpool_Request_lookup_tag: {
        kvpool_LookupRequest *q = field->pData;
        kvp_array_bind_decode(&q->token_ids, &b->token_ids);
        kvp_array_bind_decode(&q->lengths, &b->num_tokens);
        kvp_array_bind_decode(&q->salts, &b->salts);
        kvp_array_bind_decode(&q->salt_lens, &b->salt_lens);
        break;
    }
    case kvpool_Request_pin_tag:
        kvp_array_bind_decode(&((kvpool_PinRequest *)field->pData)->token_ids, &b->token_ids);
        break;
    case kvpool_Request_load_tag:
        kvp_array_bind_decode(&((kvpool_LoadRequest *)field->pData)->token_ids, &b->token_ids);
        break;
    default:
        break;
    }
    return true;
}

void kvp_wire_request_bind_decode(kvpool_Request *req, kvp_batch_arrays_t *b)
{
    kvp_array_t *all[] = {&b->seq_ids, &b->num_tokens, &b->token_ids, &b->salts, &b->salt_lens};
    for (unsigned i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        all[i]->count = 0, all[i]->bad = 0;
    req->cb_body.funcs.decode = request_body_cb;
    req->cb_body.arg = b;
}

static void bind_table_decode(kvpool_PageTable *t, kvp_reply_arrays_t *r)
{
    kvp_array_bind_decode(&t->kv_indptr, &r->kv_indptr);
    kvp_array_bind_decode(&t->kv_indices, &r->kv_indices);
    kvp_array_bind_decode(&t->kv_last_page_len, &r->kv_last_page_len);
    kvp_array_bind_decode(&t->append_indptr, &r->append_indptr);
    kvp_array_bind_decode(&t->seq_lens, &r->seq_lens);
    kvp_array_bind_decode(&t->copies, &r->copies);
    kvp_array_bind_decode(&t->cached_tokens, &r->cached_tokens);
}

static bool response_body_cb(pb_istream_t *stream, const pb_field_t *field, void **arg)
{
    (void)stream;
    kvp_reply_arrays_t *r = *arg;
    switch (field->tag) {
    case kvpool_Response_append_tag:
        bind_table_decode(&((kvpool_AppendResponse *)field->pData)->table, r);
        break;
    case kvpool_Response_reserve_tag:
        bind_table_decode(&((kvpool_ReserveResponse *)field->pData)->table, r);
        break;
    case kvpool_Response_get_page_table_tag:
        bind_table_decode(&((kvpool_GetPageTableResponse *)field->pData)->table, r);
        break;
    case kvpool_Response_lookup_tag:
        kvp_array_bind_decode(&((kvpool_LookupResponse *)field->pData)->cached_tokens,
                              &r->cached_tokens);
        kvp_array_bind_decode(&((kvpool_LookupResponse *)field->pData)->host_tokens,
                              &r->host_tokens);
        break;
    case kvpool_Response_cache_dump_tag:
        kvp_array_bind_decode(&((kvpool_CacheDumpResponse *)field->pData)->blocks, &r->dump_blocks);
        kvp_array_bind_decode(&((kvpool_CacheDumpResponse *)field->pData)->names, &r->dump_names);
        break;
    case kvpool_Response_metrics_tag:
        kvp_text_bind_decode(&((kvpool_MetricsResponse *)field->pData)->text, &r->text);
        break;
    default:
        break;
    }
    return true;
}

void kvp_wire_response_bind_decode(kvpool_Response *resp, kvp_reply_arrays_t *r)
{
    kvp_array_t *all[] = {&r->kv_indptr,   &r->kv_indices, &r->kv_last_page_len, &r->append_indptr,
                          &r->seq_lens,    &r->copies,     &r->cached_tokens,    &r->host_tokens,
                          &r->dump_blocks, &r->dump_names};
    for (unsigned i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        all[i]->count = 0, all[i]->bad = 0;
    r->text.len = 0;
    r->text.bad = 0;
    resp->cb_body.funcs.decode = response_body_cb;
    resp->cb_body.arg = r;
}

/* Binds a for encoding when it has elements; leaves the field out otherwise. */
static void bind_encode_nonempty(pb_callback_t *cb, kvp_array_t *a)
{
    if (a->count)
        kvp_array_bind_encode(cb, a);
    else
        cb->funcs.encode = NULL;
}

void kvp_wire_batch_bind_encode(kvpool_Batch *batch, kvp_batch_arrays_t *b)
{
    kvp_array_bind_encode(&batch->seq_ids, &b->seq_ids);
    kvp_array_bind_encode(&batch->num_tokens, &b->num_tokens);
    bind_encode_nonempty(&batch->token_ids, &b->token_ids);
    bind_encode_nonempty(&batch->salts, &b->salts);
    bind_encode_nonempty(&batch->salt_lens, &b->salt_lens);
}

void kvp_wire_lookup_request_bind_encode(kvpool_LookupRequest *q, kvp_batch_arrays_t *b)
{
    kvp_array_bind_encode(&q->token_ids, &b->token_ids);
    kvp_array_bind_encode(&q->lengths, &b->num_tokens);
    bind_encode_nonempty(&q->salts, &b->salts);
    bind_encode_nonempty(&q->salt_lens, &b->salt_lens);
}

void kvp_wire_pin_request_bind_encode(kvpool_PinRequest *q, kvp_batch_arrays_t *b)
{
    kvp_array_bind_encode(&q->token_ids, &b->token_ids);
}

void kvp_wire_lookup_bind_encode(kvpool_LookupResponse *l, kvp_reply_arrays_t *r)
{
    kvp_array_bind_encode(&l->cached_tokens, &r->cached_tokens);
    bind_encode_nonempty(&l->host_tokens, &r->host_tokens);
}

void kvp_wire_dump_bind_encode(kvpool_CacheDumpResponse *d, kvp_reply_arrays_t *r)
{
    kvp_array_bind_encode(&d->blocks, &r->dump_blocks);
    kvp_array_bind_encode(&d->names, &r->dump_names);
}

void kvp_wire_table_bind_encode(kvpool_PageTable *t, kvp_reply_arrays_t *r)
{
    kvp_array_bind_encode(&t->kv_indptr, &r->kv_indptr);
    kvp_array_bind_encode(&t->kv_indices, &r->kv_indices);
    kvp_array_bind_encode(&t->kv_last_page_len, &r->kv_last_page_len);
    kvp_array_bind_encode(&t->append_indptr, &r->append_indptr);
    kvp_array_bind_encode(&t->seq_lens, &r->seq_lens);
    kvp_array_bind_encode(&t->copies, &r->copies);
    bind_encode_nonempty(&t->cached_tokens, &r->cached_tokens);
}

long kvp_wire_encoded_size(const pb_msgdesc_t *fields, const void *msg)
{
    size_t n;
    if (!pb_get_encoded_size(&n, fields, msg))
        return -1;
    return (long)n;
}

long kvp_wire_encode_frame(const pb_msgdesc_t *fields, const void *msg, uint8_t *buf, size_t cap)
{
    if (cap < KVP_FRAME_HDR_BYTES)
        return KVP_ELIMIT;
    pb_ostream_t os = pb_ostream_from_buffer(buf + KVP_FRAME_HDR_BYTES, cap - KVP_FRAME_HDR_BYTES);
    if (!pb_encode(&os, fields, msg))
        return KVP_ELIMIT;
    kvp_frame_put_len(buf, (uint32_t)os.bytes_written);
    return (long)(os.bytes_written + KVP_FRAME_HDR_BYTES);
}

/* ---- the hot answers without nanopb's field walk ------------------------------------- */

static size_t varint_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static uint8_t *put_varint(uint8_t *p, uint64_t v)
{
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

/* A key (field number < 16, so one byte) and its wire type; field numbers are nanopb's
 * generated *_tag constants. */
#define KEY(field, wt) ((uint8_t)((field) << 3 | (wt)))
_Static_assert(
    sizeof(((kvpool_PoolInfo *)0)->device_ids) == KVP_MAX_DEVICES * sizeof(int32_t),
    "kvpool.options: PoolInfo.device_ids max_count is common/kvp_limits.h's device limit");
_Static_assert(sizeof(((kvpool_AppendRequest *)0)->rank_sources) ==
                   KVP_MAX_DEVICES * sizeof(kvpool_RankSource),
               "kvpool.options: AppendRequest.rank_sources max_count is the device limit");
_Static_assert(kvpool_Request_get_page_table_tag < 16 && kvpool_Request_release_tag < 16 &&
                   kvpool_Request_reserve_tag < 16 && kvpool_Response_get_page_table_tag < 16 &&
                   kvpool_PageTable_cached_tokens_tag < 16 && kvpool_Batch_salt_lens_tag < 16 &&
                   kvpool_CacheOptions_retention_ms_tag < 16,
               "the direct encoders write one-byte keys");
#define WT_VARINT 0
#define WT_LEN    2

/* The bytes of one PageTable array field as array_encode writes them; 0 when nanopb would
 * leave it out (no encode callback). Sets *ok = 0 for a callback this fast path does not
 * know. */
static size_t array_field_len(const pb_callback_t *cb, int *ok)
{
    if (!cb->funcs.encode)
        return 0;
    if (cb->funcs.encode != array_encode) {
        *ok = 0;
        return 0;
    }
    const kvp_array_t *a = cb->arg;
    size_t n = (size_t)a->count * a->elem_size;
    return 1 + varint_len(n) + n;
}

static uint8_t *put_array_field(uint8_t *p, uint32_t field, const pb_callback_t *cb)
{
    if (!cb->funcs.encode)
        return p;
    const kvp_array_t *a = cb->arg;
    size_t n = (size_t)a->count * a->elem_size;
    *p++ = KEY(field, WT_LEN);
    p = put_varint(p, n);
    if (n)
        memcpy(p, a->data, n);
    return p + n;
}

/* The direct encoders below know every field of the messages they write. A field added to
 * one of them in kvpool.proto changes its descriptor's field count: then they step aside
 * (nanopb writes everything) rather than leave the new field out, and test_client_wire's
 * check of these counts fails until they learn it. */
int kvp__wire_direct_shapes_known(void)
{
    return kvpool_Status_msg.field_count == 2 && kvpool_PingResponse_msg.field_count == 1 &&
           kvpool_PingRequest_msg.field_count == 1 && kvpool_PageTable_msg.field_count == 9 &&
           kvpool_AppendResponse_msg.field_count == 3 &&
           kvpool_ReserveResponse_msg.field_count == 1 &&
           kvpool_GetPageTableResponse_msg.field_count == 1 && kvpool_Batch_msg.field_count == 5 &&
           kvpool_ReserveRequest_msg.field_count == 2 && kvpool_CacheOptions_msg.field_count == 4 &&
           kvpool_ReleaseRequest_msg.field_count == 1 &&
           kvpool_GetPageTableRequest_msg.field_count == 1;
}

static int direct_ok(void)
{
    static int known = -1; /* the descriptors are constant: decided once */
    if (known < 0)
        known = kvp__wire_direct_shapes_known();
    return known;
}

long kvp_wire_encode_response_frame(const kvpool_Response *resp, uint8_t *buf, size_t cap)
{
    /* Which shapes are written here: an OK status with no message, and a Ping or a page-table
     * body (Append, Reserve, GetPageTable) whose arrays are bound with kvp_array_bind_encode.
     * Everything else, errors included, goes to nanopb. Field order, proto3 defaults left out
     * and submessage lengths are nanopb's, so the bytes are the same (test_client_wire). */
    int ok = direct_ok() && !resp->cb_status.funcs.encode && !resp->cb_body.funcs.encode &&
             (!resp->has_status ||
              (resp->status.code == kvpool_Code_OK && resp->status.message[0] == '\0'));
    const kvpool_PageTable *t = NULL;
    int has_table = 0;
    uint32_t body_field = 0;
    size_t extra = 0; /* AppendResponse's fields after the table */
    uint64_t fence = 0, nonce = 0;
    bool completed = false;
    switch (ok ? resp->which_body : 0) {
    case kvpool_Response_ping_tag:
        body_field = kvpool_Response_ping_tag;
        nonce = resp->body.ping.nonce;
        break;
    case kvpool_Response_append_tag:
        body_field = kvpool_Response_append_tag;
        t = &resp->body.append.table;
        has_table = resp->body.append.has_table;
        fence = resp->body.append.fence;
        completed = resp->body.append.completed;
        extra = (fence ? 1 + varint_len(fence) : 0) + (completed ? 2 : 0);
        break;
    case kvpool_Response_reserve_tag:
        body_field = kvpool_Response_reserve_tag;
        t = &resp->body.reserve.table;
        has_table = resp->body.reserve.has_table;
        break;
    case kvpool_Response_get_page_table_tag:
        body_field = kvpool_Response_get_page_table_tag;
        t = &resp->body.get_page_table.table;
        has_table = resp->body.get_page_table.has_table;
        break;
    default:
        ok = 0;
        break;
    }
    size_t table_len = 0;
    if (ok && t && has_table) {
        table_len = (t->batch_size ? 1 + varint_len(t->batch_size) : 0) +
                    (t->nnz ? 1 + varint_len(t->nnz) : 0) + array_field_len(&t->kv_indptr, &ok) +
                    array_field_len(&t->kv_indices, &ok) +
                    array_field_len(&t->kv_last_page_len, &ok) +
                    array_field_len(&t->append_indptr, &ok) + array_field_len(&t->seq_lens, &ok) +
                    array_field_len(&t->copies, &ok) + array_field_len(&t->cached_tokens, &ok);
    }
    if (!ok)
        return kvp_wire_encode_frame(kvpool_Response_fields, resp, buf, cap);

    size_t body_len = t ? (has_table ? 1 + varint_len(table_len) + table_len : 0) + extra
                        : (nonce ? 1 + varint_len(nonce) : 0);
    size_t len = (resp->id ? 1 + varint_len(resp->id) : 0) + (resp->has_status ? 2 : 0) + 1 +
                 varint_len(body_len) + body_len;
    if (cap < KVP_FRAME_HDR_BYTES || len > cap - KVP_FRAME_HDR_BYTES || len > UINT32_MAX)
        return KVP_ELIMIT;

    uint8_t *p = buf + KVP_FRAME_HDR_BYTES;
    if (resp->id) {
        *p++ = KEY(kvpool_Response_id_tag, WT_VARINT);
        p = put_varint(p, resp->id);
    }
    if (resp->has_status) { /* an empty Status: code OK and no message are left out */
        *p++ = KEY(kvpool_Response_status_tag, WT_LEN);
        *p++ = 0;
    }
    *p++ = KEY(body_field, WT_LEN);
    p = put_varint(p, body_len);
    if (!t) {
        if (nonce) {
            *p++ = KEY(kvpool_PingResponse_nonce_tag, WT_VARINT);
            p = put_varint(p, nonce);
        }
    } else {
        if (has_table) { /* table is field 1 of all three bodies */
            *p++ = KEY(kvpool_AppendResponse_table_tag, WT_LEN);
            p = put_varint(p, table_len);
            if (t->batch_size) {
                *p++ = KEY(kvpool_PageTable_batch_size_tag, WT_VARINT);
                p = put_varint(p, t->batch_size);
            }
            if (t->nnz) {
                *p++ = KEY(kvpool_PageTable_nnz_tag, WT_VARINT);
                p = put_varint(p, t->nnz);
            }
            p = put_array_field(p, kvpool_PageTable_kv_indptr_tag, &t->kv_indptr);
            p = put_array_field(p, kvpool_PageTable_kv_indices_tag, &t->kv_indices);
            p = put_array_field(p, kvpool_PageTable_kv_last_page_len_tag, &t->kv_last_page_len);
            p = put_array_field(p, kvpool_PageTable_append_indptr_tag, &t->append_indptr);
            p = put_array_field(p, kvpool_PageTable_seq_lens_tag, &t->seq_lens);
            p = put_array_field(p, kvpool_PageTable_copies_tag, &t->copies);
            p = put_array_field(p, kvpool_PageTable_cached_tokens_tag, &t->cached_tokens);
        }
        if (fence) {
            *p++ = KEY(kvpool_AppendResponse_fence_tag, WT_VARINT);
            p = put_varint(p, fence);
        }
        if (completed) {
            *p++ = KEY(kvpool_AppendResponse_completed_tag, WT_VARINT);
            *p++ = 1;
        }
    }
    kvp_frame_put_len(buf, (uint32_t)len);
    return (long)(len + KVP_FRAME_HDR_BYTES);
}

/* CacheOptions' bytes as nanopb writes them: false, 0 and an absent priority left out. */
static size_t cache_options_len(const kvpool_CacheOptions *o)
{
    return (o->reuse ? 2 : 0) + (o->leave_last ? 2 : 0) +
           (o->has_priority ? 1 + varint_len(o->priority) : 0) +
           (o->retention_ms ? 1 + varint_len(o->retention_ms) : 0);
}

static uint8_t *put_cache_options(uint8_t *p, const kvpool_CacheOptions *o)
{
    if (o->reuse) {
        *p++ = KEY(kvpool_CacheOptions_reuse_tag, WT_VARINT);
        *p++ = 1;
    }
    if (o->leave_last) {
        *p++ = KEY(kvpool_CacheOptions_leave_last_tag, WT_VARINT);
        *p++ = 1;
    }
    if (o->has_priority) {
        *p++ = KEY(kvpool_CacheOptions_priority_tag, WT_VARINT);
        p = put_varint(p, o->priority);
    }
    if (o->retention_ms) {
        *p++ = KEY(kvpool_CacheOptions_retention_ms_tag, WT_VARINT);
        p = put_varint(p, o->retention_ms);
    }
    return p;
}

long kvp_wire_encode_request_frame(const kvpool_Request *req, uint8_t *buf, size_t cap)
{
    /* A Ping, or a Reserve (Batch and CacheOptions), Release or GetPageTable (a Batch only)
     * bound with kvp_wire_batch_bind_encode; the rest, and any other callback, through nanopb */
    int ok = direct_ok() && !req->cb_body.funcs.encode;
    const kvpool_Batch *b = NULL;
    const kvpool_CacheOptions *opts = NULL; /* Reserve's, when present */
    int has_batch = 0;
    uint64_t nonce = 0;
    switch (ok ? req->which_body : 0) {
    case kvpool_Request_ping_tag:
        nonce = req->body.ping.nonce;
        break;
    case kvpool_Request_reserve_tag:
        b = &req->body.reserve.batch;
        has_batch = req->body.reserve.has_batch;
        if (req->body.reserve.has_cache)
            opts = &req->body.reserve.cache;
        break;
    case kvpool_Request_release_tag:
        b = &req->body.release.batch;
        has_batch = req->body.release.has_batch;
        break;
    case kvpool_Request_get_page_table_tag:
        b = &req->body.get_page_table.batch;
        has_batch = req->body.get_page_table.has_batch;
        break;
    default:
        ok = 0;
        break;
    }
    size_t batch_len = 0, opts_len = 0;
    if (ok && has_batch)
        batch_len = array_field_len(&b->seq_ids, &ok) + array_field_len(&b->num_tokens, &ok) +
                    array_field_len(&b->token_ids, &ok) + array_field_len(&b->salts, &ok) +
                    array_field_len(&b->salt_lens, &ok);
    if (opts)
        opts_len = cache_options_len(opts);
    if (!ok)
        return kvp_wire_encode_frame(kvpool_Request_fields, req, buf, cap);

    size_t body_len = b ? (has_batch ? 1 + varint_len(batch_len) + batch_len : 0) +
                              (opts ? 1 + varint_len(opts_len) + opts_len : 0)
                        : (nonce ? 1 + varint_len(nonce) : 0);
    size_t len = (req->id ? 1 + varint_len(req->id) : 0) + 1 + varint_len(body_len) + body_len;
    if (cap < KVP_FRAME_HDR_BYTES || len > cap - KVP_FRAME_HDR_BYTES || len > UINT32_MAX)
        return KVP_ELIMIT;

    uint8_t *p = buf + KVP_FRAME_HDR_BYTES;
    if (req->id) {
        *p++ = KEY(kvpool_Request_id_tag, WT_VARINT);
        p = put_varint(p, req->id);
    }
    *p++ = KEY(req->which_body, WT_LEN);
    p = put_varint(p, body_len);
    if (!b && nonce) {
        *p++ = KEY(kvpool_PingRequest_nonce_tag, WT_VARINT);
        p = put_varint(p, nonce);
    } else if (b) {
        if (has_batch) { /* batch is field 1 of all three bodies */
            *p++ = KEY(kvpool_ReserveRequest_batch_tag, WT_LEN);
            p = put_varint(p, batch_len);
            p = put_array_field(p, kvpool_Batch_seq_ids_tag, &b->seq_ids);
            p = put_array_field(p, kvpool_Batch_num_tokens_tag, &b->num_tokens);
            p = put_array_field(p, kvpool_Batch_token_ids_tag, &b->token_ids);
            p = put_array_field(p, kvpool_Batch_salts_tag, &b->salts);
            p = put_array_field(p, kvpool_Batch_salt_lens_tag, &b->salt_lens);
        }
        if (opts) {
            *p++ = KEY(kvpool_ReserveRequest_cache_tag, WT_LEN);
            p = put_varint(p, opts_len);
            p = put_cache_options(p, opts);
        }
    }
    kvp_frame_put_len(buf, (uint32_t)len);
    return (long)(len + KVP_FRAME_HDR_BYTES);
}

int kvp_wire_decode(const pb_msgdesc_t *fields, void *msg, const uint8_t *buf, size_t len,
                    const char **err)
{
    pb_istream_t is = pb_istream_from_buffer(buf, len);
    if (pb_decode(&is, fields, msg)) {
        if (err)
            *err = NULL;
        return 0;
    }
    if (err)
        *err = PB_GET_ERROR(&is);
    return KVP_EINVAL; /* a bound array's own reason is in its `bad` field */
}

kvpool_Code kvp_wire_code_from_err(int err)
{
    switch (err) {
    case 0:
        return kvpool_Code_OK;
    case KVP_ENOENT:
        return kvpool_Code_NOT_FOUND;
    case KVP_EEXIST:
        return kvpool_Code_ALREADY_EXISTS;
    case KVP_ENOSPC:
    case KVP_ELIMIT:
    case KVP_ENOMEM:
        return kvpool_Code_RESOURCE_EXHAUSTED;
    case KVP_EPERM:
        return kvpool_Code_PERMISSION_DENIED;
    case KVP_EPRECOND:
    case KVP_EBUSY:
        return kvpool_Code_FAILED_PRECONDITION;
    case KVP_EUNAVAIL:
    case KVP_ECLOSED:
        return kvpool_Code_UNAVAILABLE;
    case KVP_ETIMEDOUT:
        return kvpool_Code_DEADLINE_EXCEEDED;
    case KVP_EINTERNAL:
    case KVP_EAUDIT:
        return kvpool_Code_INTERNAL;
    default: /* KVP_EINVAL, KVP_ERANGE, KVP_EDUPSEQ, KVP_EPROTO, KVP_EGEOM_* */
        return err <= -1000 ? kvpool_Code_INVALID_ARGUMENT : kvpool_Code_INTERNAL;
    }
}

int kvp_wire_err_from_code(kvpool_Code code)
{
    switch (code) {
    case kvpool_Code_OK:
        return 0;
    case kvpool_Code_INVALID_ARGUMENT:
        return KVP_EINVAL;
    case kvpool_Code_NOT_FOUND:
        return KVP_ENOENT;
    case kvpool_Code_ALREADY_EXISTS:
        return KVP_EEXIST;
    case kvpool_Code_RESOURCE_EXHAUSTED:
        return KVP_ENOSPC;
    case kvpool_Code_PERMISSION_DENIED:
        return KVP_EPERM;
    case kvpool_Code_FAILED_PRECONDITION:
        return KVP_EPRECOND;
    case kvpool_Code_UNAVAILABLE:
        return KVP_EUNAVAIL;
    case kvpool_Code_DEADLINE_EXCEEDED:
        return KVP_ETIMEDOUT;
    default:
        return KVP_EINTERNAL;
    }
}

const char *kvp_wire_code_name(kvpool_Code code)
{
    switch (code) {
    case kvpool_Code_OK:
        return "OK";
    case kvpool_Code_CANCELLED:
        return "CANCELLED";
    case kvpool_Code_UNKNOWN:
        return "UNKNOWN";
    case kvpool_Code_INVALID_ARGUMENT:
        return "INVALID_ARGUMENT";
    case kvpool_Code_DEADLINE_EXCEEDED:
        return "DEADLINE_EXCEEDED";
    case kvpool_Code_NOT_FOUND:
        return "NOT_FOUND";
    case kvpool_Code_ALREADY_EXISTS:
        return "ALREADY_EXISTS";
    case kvpool_Code_PERMISSION_DENIED:
        return "PERMISSION_DENIED";
    case kvpool_Code_RESOURCE_EXHAUSTED:
        return "RESOURCE_EXHAUSTED";
    case kvpool_Code_FAILED_PRECONDITION:
        return "FAILED_PRECONDITION";
    case kvpool_Code_UNIMPLEMENTED:
        return "UNIMPLEMENTED";
    case kvpool_Code_INTERNAL:
        return "INTERNAL";
    case kvpool_Code_UNAVAILABLE:
        return "UNAVAILABLE";
    }
    return "UNKNOWN";
}

void kvp_wire_source_put(kvpool_Source *o, uint32_t buffer_id, const kvp_src_layout_t *l,
                         uint32_t layer_begin, uint32_t layer_end)
{
    o->buffer_id = buffer_id;
    o->k_offset = l->k_offset;
    o->v_offset = l->v_offset;
    o->k_stride_n = l->k_stride_n;
    o->k_stride_h = l->k_stride_h;
    o->v_stride_n = l->v_stride_n;
    o->v_stride_h = l->v_stride_h;
    o->layer_stride = l->layer_stride;
    o->layer_begin = layer_begin;
    o->layer_end = layer_end;
}

void kvp_wire_source_layout(const kvpool_Source *s, kvp_src_layout_t *out)
{
    *out = (kvp_src_layout_t){.k_offset = s->k_offset,
                              .v_offset = s->v_offset,
                              .k_stride_n = s->k_stride_n,
                              .k_stride_h = s->k_stride_h,
                              .v_stride_n = s->v_stride_n,
                              .v_stride_h = s->v_stride_h,
                              .layer_stride = s->layer_stride};
}

void kvp_wire_pool_info_put(kvpool_PoolInfo *o, const kvp_pool_info_t *i)
{
    o->has_geometry = true;
    o->geometry.num_layers = i->num_layers;
    o->geometry.num_pages = i->num_pages;
    o->geometry.page_size = i->page_size;
    o->geometry.num_kv_heads = i->num_kv_heads;
    o->geometry.head_dim = i->head_dim;
    o->geometry.dtype = (kvpool_DType)i->dtype;
    o->geometry.layout = (kvpool_Layout)i->layout;
    o->geometry.storage = (kvpool_Storage)i->storage;
    o->geometry.num_devices = i->num_devices;
    o->backend = (kvpool_BackendKind)i->backend;
    o->pool_bytes = i->pool_bytes;
    o->layer_bytes = i->layer_bytes;
    o->v_offset_bytes = i->v_offset_bytes;
    o->stride_page = i->stride_page;
    o->stride_n = i->stride_n;
    o->stride_h = i->stride_h;
    o->elem_bytes = i->elem_bytes;
    o->heads_per_device = i->heads_per_device;
    o->map_granularity = i->map_granularity;
    o->device_ids_count = 0; /* the host backend has no device ordinals to send */
    for (uint32_t d = 0; i->backend != 0 && d < i->num_devices && d < KVP_MAX_DEVICES; d++)
        o->device_ids[o->device_ids_count++] = i->device_ids[d];
}

void kvp_wire_pool_info_get(kvp_pool_info_t *o, const kvpool_PoolInfo *p)
{
    memset(o, 0, sizeof(*o));
    o->num_layers = p->geometry.num_layers;
    o->num_pages = p->geometry.num_pages;
    o->page_size = p->geometry.page_size;
    o->num_kv_heads = p->geometry.num_kv_heads;
    o->head_dim = p->geometry.head_dim;
    o->dtype = (uint32_t)p->geometry.dtype;
    o->layout = (uint32_t)p->geometry.layout;
    o->storage = (uint32_t)p->geometry.storage;
    o->num_devices = p->geometry.num_devices;
    o->backend = (uint32_t)p->backend;
    o->elem_bytes = p->elem_bytes;
    o->heads_per_device = p->heads_per_device;
    o->pool_bytes = p->pool_bytes;
    o->layer_bytes = p->layer_bytes;
    o->v_offset_bytes = p->v_offset_bytes;
    o->stride_page = p->stride_page;
    o->stride_n = p->stride_n;
    o->stride_h = p->stride_h;
    o->map_granularity = p->map_granularity;
    for (pb_size_t i = 0; i < p->device_ids_count && i < KVP_MAX_DEVICES; i++)
        o->device_ids[i] = p->device_ids[i];
}
