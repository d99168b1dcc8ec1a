/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_client_seq.c - libkvpool's sequence calls (kvpool.h): Append (daemon-run, with
 * tensor-parallel ranks and the prefix cache), Reserve, Commit, GetPageTable, Release, Fork and
 * Truncate. Each checks its arguments, builds the request in the handle's scratch with
 * kvp_client_wire.c and sends it through the handle's round trip, page tables going straight
 * into the caller's arrays. It keeps no state of its own; the connection and the errors are
 * kvp_client.c's, Lookup, Pin and CacheFlush kvp_client_cache.c's.
 */
#include <string.h>

#include "kvp_client_internal.h"
#include "kvp_wire.h"
#include "kvpool.h"

/* Tensor-parallel rank sources one Append carries (kvpool.options). */
#define MAX_RANKS (sizeof(((kvpool_AppendRequest *)0)->rank_sources) / sizeof(kvpool_RankSource))

/* Sends the batch request built in the scratch request and reads the page table into table. */
static int table_call(kvp_client_t *c, pb_size_t expect, kvp_page_table_t *table)
{
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, table);
    if (table)
        table->batch_size = table->nnz = table->num_indices = table->num_copies = 0;
    int rc = kvp__client_call(c, expect, &r, NULL, 0);
    if (rc)
        return rc;
    const kvpool_Response *resp = kvp__client_response(c);
    rc = kvp__client_table_fill(table, resp, &r);
    if (rc == KVP_ELIMIT)
        return kvp__client_fail(c, rc, "the reply's batch of %u rows is larger than cap_batch %u",
                                kvp__client_response_batch_size(resp),
                                table ? table->cap_batch : 0);
    if (rc)
        return kvp__client_fail(c, rc,
                                "the daemon sent a page table whose arrays disagree with its size");
    return 0;
}

static int check_batch(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                       uint32_t n, int need_tokens)
{
    if (n && (!seq_ids || (need_tokens && !num_tokens)))
        return kvp__client_fail(c, KVP_EINVAL, "NULL seq_ids or num_tokens with n = %u", n);
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
        return kvp__client_fail(c, KVP_EINVAL, "%s: %s", who, why);
    return 0;
}

/* The body's CacheOptions (opts, has_opts) of cache. */
static int cache_options(kvp_client_t *c, const char *who, const kvp_cache_opts_t *cache,
                         kvpool_CacheOptions *opts, bool *has_opts)
{
    if (kvp__client_cache_options(opts, has_opts, cache))
        return kvp__client_fail(c, KVP_EINVAL, "%s: priority %d (0..100, or -1 for the default)",
                                who, cache->priority);
    return 0;
}

int kvp_client_append_ranks(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                            uint32_t n, const kvp_source_t *src, const kvp_rank_source_t *ranks,
                            uint32_t num_ranks, int sync_events, kvp_page_table_t *table)
{
    if (!c)
        return KVP_EINVAL;
    if (!ranks || num_ranks == 0)
        return kvp__client_fail(c, KVP_EINVAL, "append_ranks: no ranks given");
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
    if (num_ranks > MAX_RANKS)
        return kvp__client_fail(c, KVP_EINVAL, "append: %u ranks, at most %u", num_ranks,
                                (unsigned)MAX_RANKS);
    int rc = check_batch(c, seq_ids, num_tokens, n, 1);
    if (rc)
        return rc;
    if (!src)
        return kvp__client_fail(c, KVP_EINVAL, "append: NULL source");
    kvp_batch_arrays_t b;
    kvp__client_batch_arrays(&b, seq_ids, num_tokens, n);
    if (cache && (rc = cache_arrays(c, "append", &b, num_tokens, n, cache)))
        return rc;
    kvpool_Request *req = kvp__client_scratch_request(c);
    kvp__client_request_batch(req, kvpool_Request_append_tag, &b);
    kvpool_AppendRequest *a = &req->body.append;
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
    const kvpool_Response *resp = kvp__client_response(c);
    return resp->which_body == kvpool_Response_append_tag && resp->body.append.completed;
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
    kvpool_Request *req = kvp__client_scratch_request(c);
    kvp__client_request_batch(req, kvpool_Request_reserve_tag, &b);
    kvpool_ReserveRequest *q = &req->body.reserve;
    if (cache && (rc = cache_options(c, "reserve", cache, &q->cache, &q->has_cache)))
        return rc;
    return table_call(c, kvpool_Response_reserve_tag, table);
}

/* The request of a call that names only sequences (Commit, GetPageTable, Release) into the
 * scratch request,
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
    kvp__client_request_batch(kvp__client_scratch_request(c), tag, b);
    return 0;
}

int kvp_client_commit(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n,
                      const void *event_handle, uint32_t *pages, uint32_t *published)
{
    kvp_batch_arrays_t b;
    int rc = seqs_request(c, kvpool_Request_commit_tag, seq_ids, n, &b);
    if (rc)
        return rc;
    kvpool_CommitRequest *q = &kvp__client_scratch_request(c)->body.commit;
    if (event_handle) {
        memcpy(q->event_handle.bytes, event_handle, sizeof(q->event_handle.bytes));
        q->event_handle.size = sizeof(q->event_handle.bytes);
    }
    rc = kvp__client_call(c, kvpool_Response_commit_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    if (pages)
        *pages = kvp__client_response(c)->body.commit.pages;
    if (published)
        *published = kvp__client_response(c)->body.commit.published;
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
    rc = kvp__client_call(c, kvpool_Response_release_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    if (released)
        *released = kvp__client_response(c)->body.release.released;
    return 0;
}

int kvp_client_fork(kvp_client_t *c, uint64_t parent, uint64_t child)
{
    if (!c)
        return KVP_EINVAL;
    kvpool_Request *req = kvp__client_request(c, kvpool_Request_fork_tag);
    req->body.fork.parent = parent;
    req->body.fork.child = child;
    return kvp__client_call(c, kvpool_Response_fork_tag, NULL, NULL, 0);
}

int kvp_client_truncate(kvp_client_t *c, uint64_t seq_id, uint32_t num_tokens)
{
    if (!c)
        return KVP_EINVAL;
    kvpool_Request *req = kvp__client_request(c, kvpool_Request_truncate_tag);
    req->body.truncate.seq_id = seq_id;
    req->body.truncate.num_tokens = num_tokens;
    return kvp__client_call(c, kvpool_Response_truncate_tag, NULL, NULL, 0);
}
