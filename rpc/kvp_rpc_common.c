/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc_common.c - what the handlers of the rpc layer share, below all of them: answers (OK,
 * errors), the caller's rights (operator, who may see a namespace, valid names), and a
 * request's batch and the page table an answer carries. Calls nothing of the other files of
 * the layer, so the handler files depend on it and never on each other through it.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_rpc_internal.h"
#include "kvp_utf8.h"

int kvp__rpc_is_operator(const kvp_rpc_t *r, uint32_t uid)
{
    return uid == 0 || uid == r->lim.operator_uid;
}

int kvp__rpc_may_see_ns(const kvp_rpc_t *r, const kvp_session_t *s, uint32_t ns)
{
    return kvp__rpc_is_operator(r, s->uid) || r->ns.ns[ns].owner_uid == s->uid;
}

int kvp__rpc_check_name(kvpool_Response *resp, uint64_t id, const char *field, const char *v)
{
    for (const unsigned char *p = (const unsigned char *)v; *p;) {
        size_t n = kvp_utf8_len(p);
        if (!n) {
            kvp_rpc_error(resp, id, KVP_EINVAL, "%s is not valid UTF-8 (byte %zu)", field,
                          (size_t)(p - (const unsigned char *)v));
            return KVP_EINVAL;
        }
        p += n;
    }
    if (!kvp_ns_name_valid(v, 1)) {
        kvp_rpc_error(resp, id, KVP_EINVAL,
                      "%s may hold only 1..%u of [A-Za-z0-9._:@/+-] (kvpool.proto, Names)", field,
                      KVP_NS_NAME_MAX);
        return KVP_EINVAL;
    }
    return 0;
}

int kvp_rpc_healthy(kvp_rpc_t *r)
{
    return !r->unhealthy && r->backend->ops->health(r->backend) == 0;
}

void kvp__rpc_ok(kvp_rpc_io_t *io, uint64_t id)
{
    const kvp_rpc_call_t *c = io->call;
    kvpool_Response *resp = &io->resp;
    memset(resp, 0, offsetof(kvpool_Response, body));
    memset(&resp->body, 0, c->resp_bytes); /* not the whole 45 KB union (ListClients) */
    resp->which_body = c->resp_tag;
    resp->id = id;
    resp->has_status = true;
    resp->status.code = kvpool_Code_OK;
}

void kvp_rpc_error(kvpool_Response *resp, uint64_t id, int err, const char *fmt, ...)
{
    memset(resp, 0, offsetof(kvpool_Response, body));
    resp->which_body = 0;
    resp->id = id;
    resp->has_status = true;
    resp->status.code = kvp_wire_code_from_err(err);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(resp->status.message, sizeof(resp->status.message), fmt, ap);
    va_end(ap);
}

const char *kvp__rpc_plan_error_text(int rc)
{
    switch (rc) {
    case KVP_ENOSPC:
        return "pool exhausted";
    case KVP_ELIMIT:
        return "limit or quota exceeded";
    case KVP_EDUPSEQ:
        return "sequence named twice in one batch";
    case KVP_EINVAL:
        return "invalid batch";
    default:
        return kvp_strerror(rc);
    }
}

/* Reads the batch of a request into r->items (ns of the session); n_tokens optional. */
int kvp__rpc_take_batch(kvp_rpc_t *r, const kvp_session_t *s, const kvp_rpc_io_t *io,
                        int with_tokens, uint32_t *n_out, kvpool_Response *resp, uint64_t id)
{
    const kvp_batch_arrays_t *b = io->batch;
    uint32_t n = b->seq_ids.count;
    if (n == 0) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "empty batch: seq_ids has no entries");
        return KVP_EINVAL;
    }
    if (n > r->lim.max_batch) {
        kvp_rpc_error(resp, id, KVP_ELIMIT, "batch of %u sequences above max_batch %u", n,
                      r->lim.max_batch);
        return KVP_ELIMIT;
    }
    if (with_tokens && b->num_tokens.count != n) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "num_tokens has %u entries, seq_ids %u",
                      b->num_tokens.count, n);
        return KVP_EINVAL;
    }
    const uint64_t *ids = b->seq_ids.data;
    const uint32_t *toks = b->num_tokens.data;
    for (uint32_t i = 0; i < n; i++) {
        r->items[i].ns = s->ns;
        r->items[i].seq_id = ids[i];
        r->items[i].num_tokens = with_tokens ? toks[i] : 0;
    }
    *n_out = n;
    return 0;
}

/* Points the response arrays at the planner's page table. */
void kvp__rpc_table_from_plan(kvp_rpc_t *r, kvpool_PageTable *t, kvp_reply_arrays_t *out)
{
    const kvp_plan_t *p = &r->plan;
    uint32_t B = p->batch_size;
    t->batch_size = B;
    t->nnz = p->nnz;
    out->kv_indptr = kvp_array(p->kv_indptr, 4, B + 1, B + 1);
    out->kv_indices = kvp_array(p->kv_indices, 4, (uint32_t)p->kv_indptr[B], 0);
    out->kv_last_page_len = kvp_array(p->kv_last_page_len, 4, B, B);
    out->append_indptr = kvp_array(p->append_indptr, 4, B + 1, B + 1);
    out->seq_lens = kvp_array(p->seq_lens, 4, B, B);
    out->copies = kvp_array(p->copies, 4, 2 * p->num_copies, 0);
    out->cached_tokens = kvp_array(p->cached_tokens, 4, r->plan_reused ? B : 0, 0);
    kvp_wire_table_bind_encode(t, out);
}

void kvp__rpc_count_alloc_failure(kvp_rpc_t *r, int rc)
{
    r->counters.alloc_failures[rc == KVP_ENOSPC   ? 0
                               : rc == KVP_ELIMIT ? 1
                               : rc == KVP_EINVAL ? 2
                                                  : 3]++;
}
