/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_client_cache.c - libkvpool's prefix-cache calls that are not a sequence call (kvpool.h,
 * "the prefix cache"): Lookup (with the host tier's answer), Load, Pin, Unpin and CacheFlush.
 * Reserve and Append with the cache are kvp_client_seq.c's, the cache's counters (a part of
 * Stats) kvp_client_admin.c's. Like the other call files it builds the request in the handle's
 * scratch and keeps no state.
 */
#include <stdio.h>
#include <string.h>

#include "kvp_client_internal.h"
#include "kvp_wire.h"
#include "kvpool.h"

int kvp_client_lookup(kvp_client_t *c, const int32_t *token_ids, const uint32_t *lengths,
                      uint32_t n, const uint8_t *salts, const uint32_t *salt_lens,
                      uint32_t *cached_tokens)
{
    return kvp_client_lookup_tiers(c, token_ids, lengths, n, salts, salt_lens, cached_tokens, NULL);
}

int kvp_client_lookup_tiers(kvp_client_t *c, const int32_t *token_ids, const uint32_t *lengths,
                            uint32_t n, const uint8_t *salts, const uint32_t *salt_lens,
                            uint32_t *cached_tokens, uint32_t *host_tokens)
{
    if (!c)
        return KVP_EINVAL;
    if (n && (!lengths || !cached_tokens))
        return kvp__client_fail(c, KVP_EINVAL, "lookup: NULL lengths or cached_tokens with n = %u",
                                n);
    uint32_t total = 0;
    if (n && kvp__client_sum_u32(lengths, n, &total))
        return kvp__client_fail(c, KVP_EINVAL,
                                "lookup: the lengths add up to more than UINT32_MAX");
    if (total && !token_ids)
        return kvp__client_fail(c, KVP_EINVAL, "lookup: NULL token_ids for %u tokens", total);
    kvp_batch_arrays_t b;
    kvp__client_batch_arrays(&b, NULL, lengths, n);
    b.token_ids = kvp_array((void *)token_ids, sizeof(int32_t), total, total);
    const char *why = NULL;
    if (kvp__client_salt_arrays(&b, salts, salt_lens, n, &why))
        return kvp__client_fail(c, KVP_EINVAL, "lookup: %s", why);
    kvpool_Request *req = kvp__client_request(c, kvpool_Request_lookup_tag);
    kvp_wire_lookup_request_bind_encode(&req->body.lookup, &b);
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, NULL);
    r.cached_tokens = kvp_array(cached_tokens, sizeof(uint32_t), 0, n);
    /* host_tokens NULL: a sink that counts (kvp_client_wire.c), so its count is checked too */
    r.host_tokens = kvp_array(host_tokens, sizeof(uint32_t), 0, n);
    int rc = kvp__client_call(c, kvpool_Response_lookup_tag, &r, NULL, 0);
    if (rc)
        return rc;
    if (r.cached_tokens.count != n)
        return kvp__client_fail(c, KVP_EPROTO, "lookup: %u answers for %u prompts",
                                r.cached_tokens.count, n);
    if (r.host_tokens.count != 0 && r.host_tokens.count != n)
        return kvp__client_fail(c, KVP_EPROTO, "lookup: %u host tier answers for %u prompts",
                                r.host_tokens.count, n);
    if (host_tokens && r.host_tokens.count == 0 && n) /* no host tier: nothing there */
        memset(host_tokens, 0, (size_t)n * sizeof(uint32_t));
    return 0;
}

int kvp_client_load(kvp_client_t *c, const int32_t *token_ids, uint32_t num_tokens,
                    const void *salt, uint32_t salt_len, const kvp_source_t *dest,
                    uint32_t max_tokens, kvp_load_t *out)
{
    if (!c)
        return KVP_EINVAL;
    if (num_tokens && !token_ids)
        return kvp__client_fail(c, KVP_EINVAL, "load: NULL token_ids for %u tokens", num_tokens);
    if (salt_len && !salt)
        return kvp__client_fail(c, KVP_EINVAL, "load: NULL salt of %u bytes", salt_len);
    if (!dest)
        return kvp__client_fail(c, KVP_EINVAL, "load: NULL destination");
    kvpool_Request *req = kvp__client_request(c, kvpool_Request_load_tag);
    kvpool_LoadRequest *q = &req->body.load;
    if (salt_len > sizeof(q->salt.bytes))
        return kvp__client_fail(c, KVP_EINVAL, "load: a salt of %u bytes, at most %zu", salt_len,
                                sizeof(q->salt.bytes));
    /* encoding only reads through data; borrowed until the request is sent below */
    kvp_array_t ids = kvp_array((void *)token_ids, sizeof(int32_t), num_tokens, num_tokens);
    kvp_array_bind_encode(&q->token_ids, &ids);
    if (salt_len)
        memcpy(q->salt.bytes, salt, salt_len);
    q->salt.size = (pb_size_t)salt_len;
    q->has_dest = true;
    kvp_wire_source_put(&q->dest, dest->buffer_id, &dest->layout, dest->layer_begin,
                        dest->layer_end);
    q->max_tokens = max_tokens;
    int rc = kvp__client_call(c, kvpool_Response_load_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    const kvpool_LoadResponse *l = &kvp__client_response(c)->body.load;
    if (max_tokens && l->loaded_tokens > max_tokens)
        return kvp__client_fail(c, KVP_EPROTO, "load: %u tokens loaded, at most %u asked for",
                                l->loaded_tokens, max_tokens);
    if (l->loaded_tokens > num_tokens || l->host_tokens > l->loaded_tokens)
        return kvp__client_fail(c, KVP_EPROTO,
                                "load: %u tokens loaded (%u from host memory) of a %u-token prompt",
                                l->loaded_tokens, l->host_tokens, num_tokens);
    if (out) {
        out->loaded_tokens = l->loaded_tokens;
        out->host_tokens = l->host_tokens;
        out->completed = l->completed;
    }
    return 0;
}

int kvp_client_pin(kvp_client_t *c, const int32_t *token_ids, uint32_t num_tokens, const void *salt,
                   uint32_t salt_len, uint32_t ttl_ms, kvp_pin_t *out)
{
    if (!c)
        return KVP_EINVAL;
    if (num_tokens && !token_ids)
        return kvp__client_fail(c, KVP_EINVAL, "pin: NULL token_ids for %u tokens", num_tokens);
    if (salt_len && !salt)
        return kvp__client_fail(c, KVP_EINVAL, "pin: NULL salt of %u bytes", salt_len);
    kvpool_Request *req = kvp__client_request(c, kvpool_Request_pin_tag);
    kvpool_PinRequest *q = &req->body.pin;
    if (salt_len > sizeof(q->salt.bytes))
        return kvp__client_fail(c, KVP_EINVAL, "pin: a salt of %u bytes, at most %zu", salt_len,
                                sizeof(q->salt.bytes));
    kvp_batch_arrays_t b;
    kvp__client_batch_arrays(&b, NULL, NULL, 0);
    b.token_ids = kvp_array((void *)token_ids, sizeof(int32_t), num_tokens, num_tokens);
    kvp_wire_pin_request_bind_encode(q, &b);
    if (salt_len)
        memcpy(q->salt.bytes, salt, salt_len);
    q->salt.size = (pb_size_t)salt_len;
    q->ttl_ms = ttl_ms;
    int rc = kvp__client_call(c, kvpool_Response_pin_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    if (out) {
        const kvpool_PinResponse *p = &kvp__client_response(c)->body.pin;
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
    kvpool_Request *req = kvp__client_request(c, kvpool_Request_unpin_tag);
    req->body.unpin.pin_id = pin_id;
    int rc = kvp__client_call(c, kvpool_Response_unpin_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    if (pages)
        *pages = kvp__client_response(c)->body.unpin.pages;
    return 0;
}

int kvp_client_cache_flush(kvp_client_t *c, const char *scope, int all, uint32_t *pages)
{
    if (!c)
        return KVP_EINVAL;
    kvpool_Request *req = kvp__client_request(c, kvpool_Request_cache_flush_tag);
    kvpool_CacheFlushRequest *q = &req->body.cache_flush;
    if (scope && strlen(scope) >= sizeof(q->scope))
        return kvp__client_fail(c, KVP_EINVAL, "cache_flush: scope longer than %zu bytes",
                                sizeof(q->scope) - 1);
    snprintf(q->scope, sizeof(q->scope), "%s", scope ? scope : "");
    q->all = all != 0;
    int rc = kvp__client_call(c, kvpool_Response_cache_flush_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    if (pages)
        *pages = kvp__client_response(c)->body.cache_flush.pages;
    return 0;
}

int kvp_client_cache_dump(kvp_client_t *c, uint32_t cursor, uint32_t max_blocks,
                          kvp_cache_dump_t *d)
{
    if (!c)
        return KVP_EINVAL;
    if (!d || !d->records || !d->names || d->records_cap > UINT32_MAX ||
        d->names_cap > UINT32_MAX || d->names_cap == 0)
        return kvp__client_fail(c, KVP_EINVAL, "cache_dump: NULL or oversized buffers");
    kvpool_Request *req = kvp__client_request(c, kvpool_Request_cache_dump_tag);
    req->body.cache_dump.cursor = cursor;
    req->body.cache_dump.max_blocks = max_blocks;
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, NULL);
    r.dump_blocks = kvp_array(d->records, 1, 0, (uint32_t)d->records_cap);
    r.dump_names = kvp_array(d->names, 1, 0, (uint32_t)d->names_cap - 1);
    int rc = kvp__client_call(c, kvpool_Response_cache_dump_tag, &r, NULL, 0);
    if (rc)
        return rc;
    const kvpool_CacheDumpResponse *a = &kvp__client_response(c)->body.cache_dump;
    if (a->block_size == 0 || a->block_record_bytes != 40 + 4ull * a->block_size ||
        r.dump_blocks.count % a->block_record_bytes)
        return kvp__client_fail(c, KVP_EPROTO,
                                "cache_dump: %u bytes of blocks in records of %u bytes (block "
                                "size %u)",
                                r.dump_blocks.count, a->block_record_bytes, a->block_size);
    d->record_bytes = a->block_record_bytes;
    d->block_size = a->block_size;
    d->num_blocks = r.dump_blocks.count / a->block_record_bytes;
    d->next_cursor = a->next_cursor;
    d->next_seq = a->next_seq;
    d->events = a->events;
    d->names_len = r.dump_names.count;
    d->names[d->names_len] = '\0';
    return 0;
}

int kvp_cache_dump_block(const kvp_cache_dump_t *d, uint32_t i, kvp_cache_block_t *out)
{
    if (!d || !out || i >= d->num_blocks)
        return KVP_EINVAL;
    const uint8_t *p = d->records + (size_t)i * d->record_bytes;
    uint32_t off =
        (uint32_t)p[32] | (uint32_t)p[33] << 8 | (uint32_t)p[34] << 16 | (uint32_t)p[35] << 24;
    if (off >= d->names_len || !memchr(d->names + off, '\0', d->names_len - off))
        return KVP_EINVAL;
    memcpy(out->hash, p, 16);
    memcpy(out->parent, p + 16, 16);
    out->medium = p[36];
    out->has_parent = p[37];
    out->scope = d->names + off;
    out->token_ids = (const int32_t *)(const void *)(p + 40);
    return 0;
}
