/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_metrics.c - the Prometheus text from a snapshot (see kvp_metrics.h).
 */
#include "kvp_metrics.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "kvp_log.h"
#include "kvp_utf8.h"
#include "kvp_wire.h"

#define NUM_BUCKETS KVP_METRICS_BUCKETS

static unsigned bucket_of(uint64_t ns)
{
    unsigned k = 0;
    uint64_t bound = 1000;
    while (k < NUM_BUCKETS - 1 && ns > bound) {
        k++;
        bound <<= 1;
    }
    return k;
}

void kvp_counters_observe(kvp_counters_t *c, unsigned call, unsigned code, uint64_t latency_ns)
{
    if (call >= KVP_METRICS_MAX_CALLS || code >= KVP_METRICS_CODES)
        return;
    c->calls[call][code]++;
    c->lat_buckets[call][bucket_of(latency_ns)]++;
    c->lat_sum_ns[call] += latency_ns;
}

void kvp_counters_observe_run(kvp_counters_t *c, uint64_t run_ns)
{
    c->run_buckets[bucket_of(run_ns)]++;
    c->run_sum_ns += run_ns;
}

/* Room kept at the end of the metrics buffer for the truncation notice. */
#define TRUNC_NOTE_BYTES 96

typedef struct {
    char *buf;
    size_t cap, len; /* cap: usable bytes for samples, the note's room excluded */
    int truncated;
} sbuf_t;

/* Appends whole text or nothing: a scraper must never see half a sample line. */
static void put(sbuf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(sbuf_t *b, const char *fmt, ...)
{
    if (b->truncated)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->buf + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= b->cap - b->len) {
        b->buf[b->len] = '\0';
        b->truncated = 1;
        return;
    }
    b->len += (size_t)n;
}

static void put_header(sbuf_t *b, const char *name, const char *type, const char *help)
{
    put(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

enum { NS_SEQS, NS_TOKENS, NS_PAGE_REFS, NS_DEDUP };

/* One gauge family with a sample per namespace in use. */
static void put_ns_family(sbuf_t *b, const kvp_metrics_t *m, const char *name, const char *help,
                          int what)
{
    char esc[2 * 64 + 2];
    put_header(b, name, "gauge", help);
    for (uint32_t i = 0; i < m->num_ns; i++) {
        const kvp_metrics_ns_t *ns = &m->ns[i];
        kvp__metrics_label_escape(ns->name, esc, sizeof(esc));
        const uint64_t v = what == NS_SEQS     ? ns->num_seqs
                           : what == NS_TOKENS ? ns->num_tokens
                           : what == NS_DEDUP  ? ns->dedup_bytes
                                               : ns->page_refs;
        put(b, "%s{namespace=\"%s\"} %llu\n", name, esc, (unsigned long long)v);
    }
}

/* A namespace name is chosen by a client: escape it as a label value (backslash, quote and
 * newline as the format says; other control bytes and invalid UTF-8 become '?') so that no
 * name can break or forge a line. out holds at least 2 * 64 + 1 bytes. */
void kvp__metrics_label_escape(const char *in, char *out, size_t cap)
{
    size_t o = 0;
    const unsigned char *s = (const unsigned char *)in;
    while (*s && o + 3 < cap) {
        size_t n = kvp_utf8_len(s);
        if (*s == '\\' || *s == '"') {
            out[o++] = '\\';
            out[o++] = (char)*s++;
        } else if (*s == '\n') {
            out[o++] = '\\';
            out[o++] = 'n';
            s++;
        } else if (n == 0 || *s < 0x20 || *s == 0x7f) {
            out[o++] = '?';
            s++;
        } else if (o + n < cap) {
            memcpy(out + o, s, n);
            o += n;
            s += n;
        } else {
            break;
        }
    }
    out[o] = '\0';
}

static void put_histogram(sbuf_t *b, const char *name, const char *label, const char *value,
                          const uint64_t *buckets, uint64_t sum_ns)
{
    uint64_t cum = 0, total = 0;
    for (unsigned k = 0; k < NUM_BUCKETS; k++)
        total += buckets[k];
    char lbl[96] = "";
    if (label)
        snprintf(lbl, sizeof(lbl), "%s=\"%s\",", label, value);
    double bound = 1e-6;
    for (unsigned k = 0; k < NUM_BUCKETS - 1; k++, bound *= 2) {
        cum += buckets[k];
        put(b, "%s_bucket{%sle=\"%.9g\"} %llu\n", name, lbl, bound, (unsigned long long)cum);
    }
    put(b, "%s_bucket{%sle=\"+Inf\"} %llu\n", name, lbl, (unsigned long long)total);
    if (label) {
        put(b, "%s_sum{%s=\"%s\"} %.9f\n", name, label, value, (double)sum_ns / 1e9);
        put(b, "%s_count{%s=\"%s\"} %llu\n", name, label, value, (unsigned long long)total);
    } else {
        put(b, "%s_sum %.9f\n%s_count %llu\n", name, (double)sum_ns / 1e9, name,
            (unsigned long long)total);
    }
}

/* The host tier's families (issue #28): what moved each way, the time the copies took, the
 * host memory, and what left the host tier for good. */
static void put_tier(sbuf_t *b, const kvp_metrics_t *m)
{
    static const char *const dir[2] = {"offload", "restore"};
    put_header(b, "kvpool_tier_bytes_total", "counter",
               "Bytes copied between the GPU pool and the host tier (offload: demotions, "
               "restore: promotions on a hit).");
    for (unsigned i = 0; i < 2; i++)
        put(b, "kvpool_tier_bytes_total{direction=\"%s\"} %llu\n", dir[i],
            (unsigned long long)m->tier_bytes[i]);
    put_header(b, "kvpool_tier_seconds_total", "counter",
               "Time the tier's copies took on the worker threads, summed (bytes / seconds is "
               "the rate each direction ran at).");
    for (unsigned i = 0; i < 2; i++)
        put(b, "kvpool_tier_seconds_total{direction=\"%s\"} %.6f\n", dir[i],
            (double)m->tier_ns[i] / 1e9);
    put_header(b, "kvpool_tier_pages_total", "counter",
               "Pages moved: demoted to host memory, restored from it.");
    put(b, "kvpool_tier_pages_total{direction=\"offload\"} %llu\n",
        (unsigned long long)m->cache.demotions);
    put(b, "kvpool_tier_pages_total{direction=\"restore\"} %llu\n",
        (unsigned long long)m->cache.promotions);
    put_header(b, "kvpool_tier_host_evictions_total", "counter",
               "Pages dropped from the host tier for good (to make room, or a lowered "
               "cache.host_bytes).");
    put(b, "kvpool_tier_host_evictions_total %llu\n", (unsigned long long)m->cache.host_evictions);
    put_header(b, "kvpool_tier_host_bytes", "gauge",
               "Host memory of the tier: total (cache.host_bytes in whole slots), ready (allocated "
               "and pinned so far), used (slots holding a page).");
    put(b, "kvpool_tier_host_bytes{state=\"total\"} %llu\n",
        (unsigned long long)m->host_bytes_total);
    put(b, "kvpool_tier_host_bytes{state=\"ready\"} %llu\n",
        (unsigned long long)m->host_bytes_ready);
    put(b, "kvpool_tier_host_bytes{state=\"used\"} %llu\n",
        (unsigned long long)((uint64_t)m->cache.host_pages * m->host_slot_bytes));
}

/* KV events (issue #29, rpc/kvp_events.h): what the publisher sent, dropped and replayed. */
static void put_events(sbuf_t *b, const kvp_metrics_t *m)
{
    put_header(b, "kvpool_events_batches_total", "counter",
               "Event batches sent on the events.endpoint PUB socket.");
    put(b, "kvpool_events_batches_total %llu\n", (unsigned long long)m->ev.batches);
    put_header(b, "kvpool_events_total", "counter",
               "Events (BlockStored, BlockRemoved, AllBlocksCleared) in those batches.");
    put(b, "kvpool_events_total %llu\n", (unsigned long long)m->ev.events);
    put_header(b, "kvpool_events_blocks_total", "counter",
               "Block hashes those events named (a BlockStored of a chain names several).");
    put(b, "kvpool_events_blocks_total %llu\n", (unsigned long long)m->ev.blocks);
    put_header(b, "kvpool_events_bytes_total", "counter", "Payload bytes of those batches.");
    put(b, "kvpool_events_bytes_total %llu\n", (unsigned long long)m->ev.bytes);
    put_header(b, "kvpool_events_dropped_total", "counter",
               "Batches not sent: hwm (a subscriber's high-water mark was full; still in the "
               "replay buffer), queue (events.hwm batches already waited for the publisher's "
               "thread), memory (events lost to a failed allocation). A consumer sees a gap in "
               "the sequence numbers and replays, or reloads a snapshot.");
    put(b, "kvpool_events_dropped_total{reason=\"hwm\"} %llu\n",
        (unsigned long long)m->ev.dropped_hwm);
    put(b, "kvpool_events_dropped_total{reason=\"queue\"} %llu\n",
        (unsigned long long)m->ev.dropped_queue);
    put(b, "kvpool_events_dropped_total{reason=\"memory\"} %llu\n",
        (unsigned long long)m->ev.dropped_memory);
    put_header(b, "kvpool_events_replay_requests_total", "counter",
               "Requests on the events.replay_endpoint ROUTER socket (bad: malformed, ignored).");
    put(b, "kvpool_events_replay_requests_total{result=\"ok\"} %llu\n",
        (unsigned long long)m->ev.replay_requests);
    put(b, "kvpool_events_replay_requests_total{result=\"bad\"} %llu\n",
        (unsigned long long)m->ev.replay_bad);
    put_header(b, "kvpool_events_replayed_batches_total", "counter",
               "Batches sent again in answer to replay requests.");
    put(b, "kvpool_events_replayed_batches_total %llu\n",
        (unsigned long long)m->ev.replayed_batches);
    put_header(b, "kvpool_events_subscribers", "gauge", "Subscriptions the PUB socket holds now.");
    put(b, "kvpool_events_subscribers %llu\n", (unsigned long long)m->ev.subscribers);
    put_header(b, "kvpool_events_queued_batches", "gauge",
               "Batches closed on the loop, not yet taken by the publisher's thread.");
    put(b, "kvpool_events_queued_batches %llu\n", (unsigned long long)m->ev.queued);
    put_header(b, "kvpool_events_next_sequence", "gauge",
               "The sequence number the next batch gets (batches closed so far).");
    put(b, "kvpool_events_next_sequence %llu\n", (unsigned long long)m->ev.next_seq);
}

/* The prefix cache's families (kvp_pcache.h): tokens asked for and found, pages by state,
 * evictions by reason (kvp_evict_reason_t order) and how long a cached page stayed in the
 * eviction order before memory pressure took it (kvp_pcache_stats_t.residence; the bounds
 * kvp_pcache_residence_le_ms are milliseconds, seconds here). */
static void put_cache(sbuf_t *b, const kvp_metrics_t *m)
{
    const kvp_pcache_stats_t *c = &m->cache;
    put_header(b, "kvpool_prefix_cache_query_tokens_total", "counter",
               "Prompt tokens looked up in the prefix cache (Lookup, and Reserve or Append with "
               "reuse).");
    put(b, "kvpool_prefix_cache_query_tokens_total %llu\n", (unsigned long long)c->query_tokens);
    put_header(b, "kvpool_prefix_cache_hit_tokens_total", "counter",
               "Of those tokens, the ones found cached (whole pages), by the tier they were "
               "found in (host: restored from host memory).");
    put(b, "kvpool_prefix_cache_hit_tokens_total{tier=\"gpu\"} %llu\n",
        (unsigned long long)c->hit_tokens);
    if (m->has_tier)
        put(b, "kvpool_prefix_cache_hit_tokens_total{tier=\"host\"} %llu\n",
            (unsigned long long)c->host_hit_tokens);
    put_header(b, "kvpool_prefix_cache_pages", "gauge",
               "Pages of the prefix cache by tier and state (indexed: findable, held or not; "
               "cached: findable and held by nobody, evictable; pinned: held by at least one pin; "
               "the host tier's pages are all indexed and cached).");
    put(b, "kvpool_prefix_cache_pages{tier=\"gpu\",state=\"cached\"} %u\n", c->cached_pages);
    put(b, "kvpool_prefix_cache_pages{tier=\"gpu\",state=\"pinned\"} %u\n", c->pinned_pages);
    put(b, "kvpool_prefix_cache_pages{tier=\"gpu\",state=\"indexed\"} %u\n", c->indexed_pages);
    if (m->has_tier)
        put(b, "kvpool_prefix_cache_pages{tier=\"host\",state=\"indexed\"} %u\n", c->host_pages);
    put_header(b, "kvpool_prefix_cache_pins", "gauge",
               "Pins alive (neither unpinned nor expired).");
    put(b, "kvpool_prefix_cache_pins %u\n", c->pins);
    put_header(b, "kvpool_prefix_cache_commits_pending", "gauge",
               "Commits whose event the daemon still polls: their pages become findable (and "
               "their KV events go out) once it completes.");
    put(b, "kvpool_prefix_cache_commits_pending %u\n", m->commits_pending);
    put_header(b, "kvpool_prefix_cache_evictions_total", "counter",
               "Pages that left the prefix cache, by reason (pressure: an allocation needed "
               "the page; flush: CacheFlush; rewrite: a truncate made the page partial again).");
    static const char *const why[KVP_EVICT_REASONS] = {"pressure", "flush", "rewrite"};
    for (unsigned i = 0; i < KVP_EVICT_REASONS; i++)
        put(b, "kvpool_prefix_cache_evictions_total{reason=\"%s\"} %llu\n", why[i],
            (unsigned long long)c->evictions[i]);
    put_header(b, "kvpool_prefix_cache_residence_seconds", "histogram",
               "Time a cached page (held by nobody) stayed in the eviction order before an "
               "allocation evicted it (pages a flush drops are not counted).");
    uint64_t cum = 0;
    for (unsigned k = 0; k < KVP_PCACHE_RESIDENCE_BUCKETS; k++) {
        cum += c->residence[k];
        put(b, "kvpool_prefix_cache_residence_seconds_bucket{le=\"%.9g\"} %llu\n",
            (double)kvp_pcache_residence_le_ms[k] / 1000.0, (unsigned long long)cum);
    }
    cum += c->residence[KVP_PCACHE_RESIDENCE_BUCKETS];
    put(b, "kvpool_prefix_cache_residence_seconds_bucket{le=\"+Inf\"} %llu\n",
        (unsigned long long)cum);
    put(b, "kvpool_prefix_cache_residence_seconds_sum %.3f\n",
        (double)c->residence_sum_ms / 1000.0);
    put(b, "kvpool_prefix_cache_residence_seconds_count %llu\n", (unsigned long long)cum);
    put_header(b, "kvpool_prefix_cache_bytes", "gauge",
               "Daemon memory of the prefix cache's own tables (fixed at start).");
    put(b, "kvpool_prefix_cache_bytes %llu\n", (unsigned long long)c->bytes);
    if (m->has_tier)
        put_tier(b, m);
    if (m->has_events)
        put_events(b, m);
}

size_t kvp_metrics_text(const kvp_metrics_t *m, char *buf, size_t cap)
{
    if (!buf || cap == 0)
        return 0;
    buf[0] = '\0';
    if (cap <= TRUNC_NOTE_BYTES)
        return 0;
    sbuf_t b = {buf, cap - TRUNC_NOTE_BYTES, 0, 0};
    const kvp_stats_t s = m->pool;
    const uint64_t page_bytes = m->page_bytes;
    const kvp_counters_t *r = m->counters;

    put_header(&b, "kvpool_build_info", "gauge",
               "Build information: version and pool backend (always 1).");
    put(&b, "kvpool_build_info{version=\"%s\",backend=\"%s\"} 1\n", m->version, m->backend);
    put_header(&b, "kvpool_up", "gauge", "Whether the daemon can serve (1) or is unhealthy (0).");
    put(&b, "kvpool_up %d\n", m->up);
    put_header(&b, "kvpool_uptime_seconds", "gauge", "Seconds since the daemon started.");
    put(&b, "kvpool_uptime_seconds %.3f\n", (double)m->uptime_ms / 1000.0);

    /* Every device of the tensor-parallel group holds the same pages (DESIGN.md §6): one page
     * table, H/G heads each. The device label is the CUDA ordinal on the cuda backend and the
     * group index on the host backend. */
    const char *states[] = {"capacity", "used", "free", "shared"};
    uint32_t vals[] = {s.num_pages, s.used_pages, s.free_pages, s.shared_pages};
    uint32_t ndev = m->num_devices ? m->num_devices : 1;
    put_header(&b, "kvpool_pages", "gauge",
               "Pages of the pool on each device by state (capacity = used + free; shared: "
               "held by more than one sequence).");
    for (uint32_t d = 0; d < ndev; d++)
        for (int i = 0; i < 4; i++)
            put(&b, "kvpool_pages{device=\"%d\",state=\"%s\"} %u\n",
                d < m->num_device_ids ? m->device_ids[d] : (int)d, states[i], vals[i]);
    put_header(&b, "kvpool_pool_bytes", "gauge",
               "Bytes of the pool on each device by state (pages times the bytes of one page, "
               "all layers, K and V).");
    for (uint32_t d = 0; d < ndev; d++)
        for (int i = 0; i < 4; i++)
            put(&b, "kvpool_pool_bytes{device=\"%d\",state=\"%s\"} %llu\n",
                d < m->num_device_ids ? m->device_ids[d] : (int)d, states[i],
                (unsigned long long)vals[i] * page_bytes);
    put_header(&b, "kvpool_page_size_bytes", "gauge",
               "Bytes of one page on one device (all layers, K and V).");
    put(&b, "kvpool_page_size_bytes %llu\n", (unsigned long long)page_bytes);

    put_header(&b, "kvpool_namespaces", "gauge", "Namespaces (engines) known to the daemon.");
    put(&b, "kvpool_namespaces %u\n", m->num_ns);
    put_header(&b, "kvpool_live_sequences", "gauge", "Live sequences over all namespaces.");
    put(&b, "kvpool_live_sequences %u\n", s.num_seqs);
    put_header(&b, "kvpool_live_tokens", "gauge", "Tokens held over all namespaces.");
    put(&b, "kvpool_live_tokens %llu\n", (unsigned long long)s.num_tokens);
    put_ns_family(&b, m, "kvpool_sequences", "Live sequences per namespace.", NS_SEQS);
    put_ns_family(&b, m, "kvpool_tokens", "Tokens held per namespace.", NS_TOKENS);
    put_ns_family(&b, m, "kvpool_page_refs",
                  "Page references held per namespace (a shared page counts once per holder).",
                  NS_PAGE_REFS);
    put_header(&b, "kvpool_connected_clients", "gauge", "Open client connections (sessions).");
    put(&b, "kvpool_connected_clients %u\n", m->clients);

    put_header(&b, "kvpool_page_allocations_total", "counter",
               "Pages taken from the free list by Append and Reserve (copy-on-write included).");
    put(&b, "kvpool_page_allocations_total %llu\n", (unsigned long long)r->pages_allocated_total);
    put_header(&b, "kvpool_allocation_failures_total", "counter",
               "Append or Reserve batches refused by the planner, by reason (exhausted: not "
               "enough free pages; limit: a configured limit; invalid: a bad request).");
    const char *reasons[] = {"exhausted", "limit", "invalid", "other"};
    for (int i = 0; i < 4; i++)
        put(&b, "kvpool_allocation_failures_total{reason=\"%s\"} %llu\n", reasons[i],
            (unsigned long long)r->alloc_failures[i]);
    put_header(&b, "kvpool_cow_copies_total", "counter", "Pages copied on write.");
    put(&b, "kvpool_cow_copies_total %llu\n", (unsigned long long)r->cow_copies_total);
    put_header(&b, "kvpool_lease_expiries_total", "counter",
               "Namespaces released because their lease ran out with no session attached.");
    put(&b, "kvpool_lease_expiries_total %llu\n", (unsigned long long)r->lease_expiries_total);
    put_header(&b, "kvpool_evicted_sequences_total", "counter",
               "Sequences released by the daemon rather than by their client (lease expiry; "
               "the daemon never evicts a sequence for space: it evicts cached prefix pages "
               "nobody holds, kvpool_prefix_cache_evictions_total, and a pool full of held "
               "pages answers RESOURCE_EXHAUSTED).");
    put(&b, "kvpool_evicted_sequences_total{reason=\"lease_expired\"} %llu\n",
        (unsigned long long)r->evicted_seqs_total);
    put_header(&b, "kvpool_evicted_pages_total", "counter",
               "Pages returned to the free list by those evictions.");
    put(&b, "kvpool_evicted_pages_total{reason=\"lease_expired\"} %llu\n",
        (unsigned long long)r->evicted_pages_total);
    put_header(&b, "kvpool_append_bytes_total", "counter",
               "K and V bytes copied into the pool by daemon-run Appends (all layers).");
    put(&b, "kvpool_append_bytes_total %llu\n", (unsigned long long)r->append_bytes_total);
    put_header(&b, "kvpool_append_run_seconds", "histogram",
               "Time a copy worker spent running one Append plan: copy-on-write copies and "
               "the append (host: the CPU copy; cuda: waiting for the worker's ready event and "
               "the launches, the GPU may still be running when event sync is used).");
    put_histogram(&b, "kvpool_append_run_seconds", NULL, NULL, r->run_buckets, r->run_sum_ns);

    static const char *const dirs[] = {"export", "import"};
    put_header(&b, "kvpool_transfers_total", "counter",
               "KV transfers between daemons (ExportBegin / Import over NCCL) that ended, by "
               "direction and result (ok, failed: an error, a refusal or the deadline).");
    for (int d = 0; d < 2; d++)
        for (int k = 0; k < 2; k++)
            put(&b, "kvpool_transfers_total{direction=\"%s\",result=\"%s\"} %llu\n", dirs[d],
                k ? "failed" : "ok", (unsigned long long)m->xfer_total[d][k]);
    put_header(&b, "kvpool_transfer_bytes_total", "counter",
               "Bytes of the packed KV streams of transfers that succeeded, by direction.");
    for (int d = 0; d < 2; d++)
        put(&b, "kvpool_transfer_bytes_total{direction=\"%s\"} %llu\n", dirs[d],
            (unsigned long long)m->xfer_bytes[d]);
    put_header(&b, "kvpool_transfers_in_flight", "gauge", "KV transfers running now.");
    put(&b, "kvpool_transfers_in_flight %u\n", m->xfer_in_flight);
    put_header(&b, "kvpool_transfer_communicators", "gauge",
               "NCCL communicators cached for transfers (one per peer and direction).");
    put(&b, "kvpool_transfer_communicators %u\n", m->xfer_comms);

    put_header(&b, "kvpool_dedup_bytes", "gauge",
               "Bytes of answers the retry windows keep (limits.dedup_max_bytes bounds them).");
    put(&b, "kvpool_dedup_bytes %llu\n", (unsigned long long)m->dedup_bytes);
    put_ns_family(&b, m, "kvpool_namespace_dedup_bytes",
                  "Bytes of answers kept per namespace (limits.dedup_ns_max_bytes bounds them).",
                  NS_DEDUP);
    put_header(&b, "kvpool_dedup_entries", "gauge",
               "Request ids the retry windows remember, answers kept or not.");
    put(&b, "kvpool_dedup_entries %u\n", m->dedup_entries);
    put_header(&b, "kvpool_dedup_evictions_total", "counter",
               "Answers dropped from a retry window to stay within a byte budget (their ids "
               "are still refused as applied).");
    put(&b, "kvpool_dedup_evictions_total %llu\n", (unsigned long long)m->dedup_evictions_total);
    put_header(&b, "kvpool_dedup_replays_total", "counter",
               "Retries answered with the first answer of their request id.");
    put(&b, "kvpool_dedup_replays_total %llu\n", (unsigned long long)r->dedup_replays_total);
    if (m->has_cache)
        put_cache(&b, m);
    put_header(&b, "kvpool_rpc_requests_total", "counter",
               "Requests answered, by call and status code (call=\"invalid\": a frame that did "
               "not decode or named no call).");
    for (unsigned c = 0; c < m->num_calls; c++)
        for (unsigned k = 0; k < KVP_METRICS_CODES; k++)
            if (r->calls[c][k])
                put(&b, "kvpool_rpc_requests_total{call=\"%s\",code=\"%s\"} %llu\n",
                    m->call_names[c], kvp_wire_code_name((kvpool_Code)k),
                    (unsigned long long)r->calls[c][k]);
    put_header(&b, "kvpool_rpc_duration_seconds", "histogram",
               "Time from a request's frame to its answer, by call.");
    for (unsigned c = 0; c < m->num_calls; c++) {
        uint64_t total = 0;
        for (unsigned k = 0; k < NUM_BUCKETS; k++)
            total += r->lat_buckets[c][k];
        if (total)
            put_histogram(&b, "kvpool_rpc_duration_seconds", "call", m->call_names[c],
                          r->lat_buckets[c], r->lat_sum_ns[c]);
    }
    if (b.truncated) {
        /* the note's room was kept out of b.cap */
        int n =
            snprintf(buf + b.len, TRUNC_NOTE_BYTES, "# kvpool: truncated at %zu bytes\n", b.len);
        if (n > 0 && n < TRUNC_NOTE_BYTES)
            b.len += (size_t)n;
        kvp_log(KVP_LOG_WARNING, "metrics truncated bytes=%zu", b.len);
    }
    return b.len;
}
