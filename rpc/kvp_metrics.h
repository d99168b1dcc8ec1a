/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_metrics.h - the daemon's counters and the Prometheus text written from them. The rpc
 * layer counts into a kvp_counters_t and, for a scrape, fills a kvp_metrics_t snapshot (gauges
 * read from the core at that moment, the counters by pointer); kvp_metrics_text writes the
 * exposition from the snapshot alone, so no handler formats metrics and the text can be tested
 * from a hand-made snapshot.
 *
 * Exposition 0.0.4: every family has HELP and TYPE; names follow Prometheus conventions
 * (kvpool_ prefix, base units, _total counters); no per-client labels (namespaces are bounded
 * by max_namespaces). Pure: no clock, no I/O but the caller's buffer.
 */
#ifndef KVP_METRICS_H
#define KVP_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "kvp_pcache.h"
#include "kvp_seqtab.h"

#define KVP_METRICS_MAX_CALLS 32 /* rows of the call table, "invalid" included */
#define KVP_METRICS_CODES     15 /* status codes 0..14 */
/* Latency histograms: upper bounds 1 us * 2^k for k = 0..20 (1 us .. about 1.05 s), then +Inf.
 * Powers of two keep the bucket search a shift loop, and 21 finite bounds cover a Ping on a
 * quiet machine as well as a large host-backend Append, so percentiles read from the histogram
 * (kvpoolctl top) stay within a factor of two everywhere. */
#define KVP_METRICS_BUCKETS 22

typedef struct {
    uint64_t calls[KVP_METRICS_MAX_CALLS][KVP_METRICS_CODES];
    uint64_t lat_buckets[KVP_METRICS_MAX_CALLS][KVP_METRICS_BUCKETS];
    uint64_t lat_sum_ns[KVP_METRICS_MAX_CALLS];
    uint64_t run_buckets[KVP_METRICS_BUCKETS]; /* time a copy worker spent on one Append plan */
    uint64_t run_sum_ns;
    uint64_t requests_total;
    uint64_t append_bytes_total;
    uint64_t alloc_failures[4]; /* exhausted, limit, invalid, other */
    uint64_t pages_allocated_total;
    uint64_t lease_expiries_total;
    uint64_t cow_copies_total;
    uint64_t evicted_seqs_total;  /* sequences released because their lease ran out */
    uint64_t evicted_pages_total; /* pages those releases returned to the free list */
    uint64_t dedup_replays_total; /* retries answered from a window */
} kvp_counters_t;

/* One observation of a call (index in the call table) answered with code. */
void kvp_counters_observe(kvp_counters_t *c, unsigned call, unsigned code, uint64_t latency_ns);
void kvp_counters_observe_run(kvp_counters_t *c, uint64_t run_ns);

typedef struct {
    char name[65];
    uint32_t num_seqs;
    uint64_t num_tokens, page_refs, dedup_bytes;
} kvp_metrics_ns_t;

typedef struct {
    const char *version, *backend;
    int up;
    uint64_t uptime_ms;
    uint32_t num_devices;
    const int *device_ids; /* [num_device_ids]; a device without one is labelled by index */
    uint32_t num_device_ids;
    kvp_stats_t pool;
    uint64_t page_bytes;
    const kvp_metrics_ns_t *ns; /* [num_ns], the namespaces in use */
    uint32_t num_ns;
    uint32_t clients;
    uint64_t dedup_bytes, dedup_evictions_total;
    uint32_t dedup_entries;
    uint64_t xfer_total[2][2]; /* [export|import][ok|failed] */
    uint64_t xfer_bytes[2];
    uint32_t xfer_in_flight, xfer_comms;
    /* The prefix cache (kvp_pcache_stats at the scrape): its kvpool_prefix_cache_* families
     * are written only when has_cache (a daemon without a cache writes none of them). */
    kvp_pcache_stats_t cache;
    int has_cache;
    uint32_t commits_pending; /* Commits waiting for their event */
    /* The host tier (issue #28): kvpool_tier_* families and the host series of the cache's,
     * only when has_tier. */
    int has_tier;
    uint64_t tier_bytes[2]; /* [offload|restore] copied */
    uint64_t tier_ns[2];    /* [offload|restore] time the copies took */
    uint64_t host_bytes_total, host_bytes_ready, host_slot_bytes;
    /* KV events (issue #29): kvpool_events_* families, only when has_events. */
    int has_events;
    struct {
        uint64_t batches, events, blocks, bytes;
        uint64_t dropped_hwm, dropped_queue, dropped_memory;
        uint64_t replay_requests, replay_bad, replayed_batches;
        uint64_t subscribers, queued, next_seq;
    } ev;
    const kvp_counters_t *counters;
    const char *const *call_names; /* [num_calls], index 0 "invalid" */
    unsigned num_calls;
} kvp_metrics_t;

/* Writes the text into buf (NUL-terminated) and returns its length. When cap is too small the
 * text stops after the last whole line that fits and ends with a "# kvpool: truncated"
 * comment (logged as a warning): never half a sample. */
size_t kvp_metrics_text(const kvp_metrics_t *m, char *buf, size_t cap);

/* Internal, exposed for the unit test: escapes a namespace name as a Prometheus label value
 * into out (cap bytes, NUL-terminated; 2 * 64 + 2 always holds a whole name). */
void kvp__metrics_label_escape(const char *in, char *out, size_t cap);

#endif
