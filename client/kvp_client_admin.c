/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_client_admin.c - libkvpool's daemon-wide reads (kvpool.h): Stats (the summary, the
 * prefix cache's counters, or all of it with the namespaces and cache scopes), ListSequences,
 * ListClients, Audit, Metrics and PoolInfo. They copy the wire's answers into the plain structs
 * of kvpool.h, so a tool such as kvpoolctl never sees a protocol type. Nothing here changes the
 * daemon; the round trip is kvp_client.c's.
 */
#include <stdio.h>
#include <string.h>

#include "kvp_client_internal.h"
#include "kvp_wire.h"
#include "kvpool.h"

/* kvpool.h restates the wire's bounds (kvpool.options) so it needs no nanopb header. */
#define FIELD_SIZE(T, m)  sizeof(((T *)0)->m)
#define FIELD_COUNT(T, m) (sizeof(((T *)0)->m) / sizeof(((T *)0)->m[0]))
_Static_assert(KVP_CLIENT_NAME_BYTES == FIELD_SIZE(kvpool_NamespaceStats, name), "name");
_Static_assert(KVP_CLIENT_NAME_BYTES == FIELD_SIZE(kvpool_HelloRequest, namespace), "namespace");
_Static_assert(KVP_CLIENT_NAME_BYTES == FIELD_SIZE(kvpool_HelloRequest, cache_scope), "scope");
_Static_assert(KVP_CLIENT_NAME_BYTES == FIELD_SIZE(kvpool_ListSequencesRequest, namespace), "ns");
_Static_assert(KVP_CLIENT_NAME_BYTES == FIELD_SIZE(kvpool_CacheFlushRequest, scope), "scope");
_Static_assert(KVP_CLIENT_NAME_BYTES == FIELD_SIZE(kvpool_ClientInfo, namespace), "namespace");
_Static_assert(KVP_CLIENT_NAME_BYTES == FIELD_SIZE(kvpool_ClientInfo, client_name), "name");
_Static_assert(KVP_CLIENT_SCOPE_NAME_BYTES == FIELD_SIZE(kvpool_CacheScopeStats, name), "scope");
_Static_assert(KVP_CLIENT_MAX_NAMESPACES == FIELD_COUNT(kvpool_Stats, namespaces), "namespaces");
_Static_assert(KVP_CLIENT_MAX_SCOPES == FIELD_COUNT(kvpool_CacheStats, scopes), "scopes");
_Static_assert(KVP_CLIENT_MAX_SEQS_LISTED == FIELD_COUNT(kvpool_ListSequencesResponse, seqs),
               "seqs");
_Static_assert(KVP_CLIENT_MAX_SESSIONS == FIELD_COUNT(kvpool_ListClientsResponse, clients),
               "clients");
_Static_assert(KVP_CLIENT_AUDIT_MESSAGE_BYTES == FIELD_SIZE(kvpool_AuditResponse, message),
               "audit message");
_Static_assert(KVP_CLIENT_MAX_TRANSFERS == FIELD_COUNT(kvpool_ListTransfersResponse, transfers),
               "transfers");

/* A Stats call for `who` into out (zeroed first): 0 and *s (NULL when the answer holds no
 * stats), or the call's error. */
static int stats_call(kvp_client_t *c, const char *who, void *out, size_t out_len,
                      const kvpool_Stats **s)
{
    if (!c)
        return KVP_EINVAL;
    if (!out)
        return kvp__client_fail(c, KVP_EINVAL, "%s: NULL output", who);
    kvp__client_request(c, kvpool_Request_stats_tag);
    int rc = kvp__client_call(c, kvpool_Response_stats_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    memset(out, 0, out_len);
    const kvpool_StatsResponse *r = &kvp__client_response(c)->body.stats;
    *s = r->has_stats ? &r->stats : NULL;
    return 0;
}

static void summary_get(kvp_stats_summary_t *out, const kvpool_Stats *s)
{
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
}

int kvp_client_stats(kvp_client_t *c, kvp_stats_summary_t *out)
{
    const kvpool_Stats *s = NULL;
    int rc = stats_call(c, "stats", out, sizeof(*out), &s);
    if (rc || !s)
        return rc;
    summary_get(out, s);
    return 0;
}

static void cache_get(kvp_cache_stats_t *out, const kvpool_CacheStats *s)
{
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
    out->host_pages = s->host_pages;
    out->host_slots = s->host_slots;
    out->host_bytes_total = s->host_bytes_total;
    out->host_bytes_ready = s->host_bytes_ready;
    out->host_hit_tokens_total = s->host_hit_tokens_total;
    out->demotions_total = s->demotions_total;
    out->promotions_total = s->promotions_total;
    out->host_evictions_total = s->host_evictions_total;
    out->offload_bytes_total = s->offload_bytes_total;
    out->restore_bytes_total = s->restore_bytes_total;
    out->offload_us_total = s->offload_us_total;
    out->restore_us_total = s->restore_us_total;
    out->demoting = s->demoting;
    out->restoring = s->restoring;
    out->host_slot_bytes = s->host_slot_bytes;
}

int kvp_client_cache_stats(kvp_client_t *c, kvp_cache_stats_t *out)
{
    const kvpool_Stats *st = NULL;
    int rc = stats_call(c, "cache_stats", out, sizeof(*out), &st);
    if (rc || !st || !st->has_cache)
        return rc;
    cache_get(out, &st->cache);
    return 0;
}

int kvp_client_audit(kvp_client_t *c)
{
    if (!c)
        return KVP_EINVAL;
    kvp__client_request(c, kvpool_Request_audit_tag);
    int rc = kvp__client_call(c, kvpool_Response_audit_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    const kvpool_AuditResponse *a = &kvp__client_response(c)->body.audit;
    if (!a->ok)
        return kvp__client_fail(c, KVP_EAUDIT, "%s",
                                a->message[0] ? a->message : "audit failed (no message)");
    return 0;
}

int kvp_client_daemon_stats(kvp_client_t *c, kvp_daemon_stats_t *out)
{
    if (c && out &&
        ((!out->namespaces && out->cap_namespaces) || (!out->scopes && out->cap_scopes)))
        return kvp__client_fail(c, KVP_EINVAL, "daemon_stats: an array NULL with a cap");
    kvp_daemon_stats_t keep; /* the caller's arrays and caps */
    memset(&keep, 0, sizeof(keep));
    if (out)
        keep = *out;
    const kvpool_Stats *s = NULL;
    int rc = stats_call(c, "daemon_stats", out, sizeof(*out), &s);
    if (rc)
        return rc;
    out->namespaces = keep.namespaces;
    out->scopes = keep.scopes;
    out->cap_namespaces = keep.cap_namespaces;
    out->cap_scopes = keep.cap_scopes;
    if (!s)
        return 0;
    summary_get(&out->summary, s);
    out->dedup_bytes = s->dedup_bytes;
    out->dedup_evictions_total = s->dedup_evictions_total;
    out->namespaces_total = s->namespaces_total;
    out->namespaces_truncated = s->namespaces_truncated;
    out->pool_shared_across_uids = s->pool_shared_across_uids;
    out->has_cache = s->has_cache;
    if (s->has_cache)
        cache_get(&out->cache, &s->cache);
    for (pb_size_t i = 0; i < s->namespaces_count && i < out->cap_namespaces; i++) {
        const kvpool_NamespaceStats *w = &s->namespaces[i];
        kvp_namespace_stats_t *o = &out->namespaces[out->num_namespaces++];
        memset(o, 0, sizeof(*o));
        snprintf(o->name, sizeof(o->name), "%s", w->name);
        o->num_seqs = w->num_seqs;
        o->sessions = w->sessions;
        o->lease_ms = w->lease_ms;
        o->dedup_entries = w->dedup_entries;
        o->num_tokens = w->num_tokens;
        o->page_refs = w->page_refs;
        o->lease_expires_in_ms = w->lease_expires_in_ms;
        o->dedup_bytes = w->dedup_bytes;
    }
    for (pb_size_t i = 0; s->has_cache && i < s->cache.scopes_count && i < out->cap_scopes; i++) {
        const kvpool_CacheScopeStats *w = &s->cache.scopes[i];
        kvp_scope_stats_t *o = &out->scopes[out->num_scopes++];
        memset(o, 0, sizeof(*o));
        snprintf(o->name, sizeof(o->name), "%s", w->name);
        o->uid = w->uid;
        o->namespaces = w->namespaces;
        o->cached_pages = w->cached_pages;
        o->indexed_pages = w->indexed_pages;
        o->query_tokens = w->query_tokens;
        o->hit_tokens = w->hit_tokens;
        o->host_pages = w->host_pages;
        o->host_hit_tokens = w->host_hit_tokens;
    }
    return 0;
}

int kvp_client_list_seqs(kvp_client_t *c, const char *ns, uint32_t cursor, kvp_seq_info_t *out,
                         uint32_t max, uint32_t *n, uint32_t *next_cursor)
{
    if (!c)
        return KVP_EINVAL;
    if (!out || !n || max == 0)
        return kvp__client_fail(c, KVP_EINVAL, "list_seqs: NULL out or n, or max 0");
    kvpool_ListSequencesRequest *q =
        &kvp__client_request(c, kvpool_Request_list_sequences_tag)->body.list_sequences;
    if (ns && strlen(ns) >= sizeof(q->namespace))
        return kvp__client_fail(c, KVP_EINVAL, "list_seqs: namespace longer than %zu bytes",
                                sizeof(q->namespace) - 1);
    snprintf(q->namespace, sizeof(q->namespace), "%s", ns ? ns : "");
    q->cursor = cursor;
    q->limit = max;
    int rc = kvp__client_call(c, kvpool_Response_list_sequences_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    const kvpool_ListSequencesResponse *r = &kvp__client_response(c)->body.list_sequences;
    if (r->seqs_count > max)
        return kvp__client_fail(c, KVP_EPROTO, "list_seqs: %u sequences for at most %u",
                                (unsigned)r->seqs_count, max);
    for (pb_size_t i = 0; i < r->seqs_count; i++) {
        out[i].seq_id = r->seqs[i].seq_id;
        out[i].idle_ms = r->seqs[i].idle_ms;
        out[i].num_tokens = r->seqs[i].num_tokens;
        out[i].num_pages = r->seqs[i].num_pages;
        out[i].shared_pages = r->seqs[i].shared_pages;
    }
    *n = r->seqs_count;
    if (next_cursor)
        *next_cursor = r->next_cursor;
    return 0;
}

int kvp_client_list_clients(kvp_client_t *c, kvp_session_info_t *out, uint32_t max, uint32_t *n)
{
    if (!c)
        return KVP_EINVAL;
    if ((!out && max) || !n)
        return kvp__client_fail(c, KVP_EINVAL, "list_clients: NULL out or n");
    kvp__client_request(c, kvpool_Request_list_clients_tag);
    int rc = kvp__client_call(c, kvpool_Response_list_clients_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    const kvpool_ListClientsResponse *r = &kvp__client_response(c)->body.list_clients;
    uint32_t k = 0;
    for (; k < r->clients_count && k < max; k++) {
        const kvpool_ClientInfo *w = &r->clients[k];
        kvp_session_info_t *o = &out[k];
        memset(o, 0, sizeof(*o));
        o->session_id = w->session_id;
        o->requests = w->requests;
        o->connected_ms = w->connected_ms;
        snprintf(o->ns, sizeof(o->ns), "%s", w->namespace);
        snprintf(o->client_name, sizeof(o->client_name), "%s", w->client_name);
        o->pid = w->pid;
        o->uid = w->uid;
        o->gid = w->gid;
        o->buffers = w->buffers;
    }
    *n = k;
    return 0;
}

int kvp_client_audit_report(kvp_client_t *c, int *ok, char *message, size_t len)
{
    if (!c)
        return KVP_EINVAL;
    if (!ok || (!message && len))
        return kvp__client_fail(c, KVP_EINVAL, "audit_report: NULL ok or message");
    kvp__client_request(c, kvpool_Request_audit_tag);
    int rc = kvp__client_call(c, kvpool_Response_audit_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    const kvpool_AuditResponse *a = &kvp__client_response(c)->body.audit;
    *ok = a->ok;
    if (len)
        snprintf(message, len, "%s", a->message);
    return 0;
}

int kvp_client_metrics(kvp_client_t *c, char *text, size_t cap, size_t *len)
{
    if (!c)
        return KVP_EINVAL;
    if (!text || cap == 0)
        return kvp__client_fail(c, KVP_EINVAL, "metrics: NULL text or cap 0");
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, NULL);
    r.text.s = text;
    r.text.cap = cap;
    text[0] = '\0'; /* an empty text may arrive as no field at all */
    kvp__client_request(c, kvpool_Request_metrics_tag);
    int rc = kvp__client_call(c, kvpool_Response_metrics_tag, &r, NULL, 0);
    if (rc)
        return rc;
    if (len)
        *len = r.text.len;
    return 0;
}

int kvp_client_get_pool_info(kvp_client_t *c, kvp_pool_info_t *out)
{
    if (!c)
        return KVP_EINVAL;
    if (!out)
        return kvp__client_fail(c, KVP_EINVAL, "get_pool_info: NULL output");
    kvp__client_request(c, kvpool_Request_pool_info_tag)->body.pool_info.want_pool_fds = false;
    int rc = kvp__client_call(c, kvpool_Response_pool_info_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    kvp_wire_pool_info_get(out, &kvp__client_response(c)->body.pool_info);
    return 0;
}
