/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_metrics_text.c - the Prometheus text of kvp_metrics_text written from a hand-made
 * snapshot (no daemon): the prefix cache's families, exact line by line, only when the snapshot
 * has a cache, every sample after its family's TYPE, and a cut inside them still ends at a
 * whole line.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_log.h"
#include "kvp_metrics.h"

static kvp_counters_t counters; /* all zero */

/* A snapshot of an idle daemon: no namespace, no call, the cache figures below when has. */
static kvp_metrics_t snapshot(int has_cache)
{
    kvp_metrics_t m;
    memset(&m, 0, sizeof(m));
    m.version = "0.0.0-test";
    m.backend = "host";
    m.up = 1;
    m.uptime_ms = 2500;
    m.num_devices = 1;
    m.pool.num_pages = 64;
    m.pool.free_pages = 64;
    m.page_bytes = 4096;
    m.counters = &counters;
    m.has_cache = has_cache;
    if (has_cache) {
        kvp_pcache_stats_t *c = &m.cache;
        c->indexed_pages = 40;
        c->cached_pages = 12;
        c->pinned_pages = 3;
        c->pins = 2;
        c->query_tokens = 1000;
        c->hit_tokens = 750;
        c->evictions[KVP_EVICT_PRESSURE] = 7;
        c->evictions[KVP_EVICT_FLUSH] = 5;
        c->evictions[KVP_EVICT_REWRITE] = 1;
        for (unsigned k = 0; k <= KVP_PCACHE_RESIDENCE_BUCKETS; k++)
            c->residence[k] = k + 1; /* cumulative 1, 3, 6, ... 66 */
        c->residence_sum_ms = 123456;
        c->bytes = 1u << 20;
        m.commits_pending = 4;
    }
    return m;
}

/* ms as Prometheus writes a bound in seconds, by hand rather than by printf's %g: whole
 * seconds without a point, else the fraction with its trailing zeros dropped. */
static void seconds_of_ms(uint64_t ms, char *out, size_t cap)
{
    if (ms % 1000 == 0) {
        snprintf(out, cap, "%llu", (unsigned long long)(ms / 1000));
        return;
    }
    char frac[4];
    snprintf(frac, sizeof(frac), "%03u", (unsigned)(ms % 1000));
    for (int i = 2; i > 0 && frac[i] == '0'; i--)
        frac[i] = '\0';
    snprintf(out, cap, "%llu.%s", (unsigned long long)(ms / 1000), frac);
}

static char text[1 << 16];

START_TEST(cache_families_are_written_exactly)
{
    kvp_metrics_t m = snapshot(1);
    size_t len = kvp_metrics_text(&m, text, sizeof(text));
    ck_assert_uint_eq(len, strlen(text));
    ck_assert_ptr_null(strstr(text, "truncated"));

    static char want[8192];
    size_t w = 0;
#define WANT(...) w += (size_t)snprintf(want + w, sizeof(want) - w, __VA_ARGS__)
    WANT("# HELP kvpool_prefix_cache_query_tokens_total Prompt tokens looked up in the prefix "
         "cache (Lookup, and Reserve or Append with reuse).\n"
         "# TYPE kvpool_prefix_cache_query_tokens_total counter\n"
         "kvpool_prefix_cache_query_tokens_total 1000\n");
    WANT("# HELP kvpool_prefix_cache_hit_tokens_total Of those tokens, the ones found cached "
         "(whole pages), by the tier they were found in (host: restored from host memory).\n"
         "# TYPE kvpool_prefix_cache_hit_tokens_total counter\n"
         "kvpool_prefix_cache_hit_tokens_total{tier=\"gpu\"} 750\n");
    WANT("# HELP kvpool_prefix_cache_pages Pages of the prefix cache by tier and state (indexed: "
         "findable, held or not; cached: findable and held by nobody, evictable; pinned: held "
         "by at least one pin; the host tier's pages are all indexed and cached).\n"
         "# TYPE kvpool_prefix_cache_pages gauge\n"
         "kvpool_prefix_cache_pages{tier=\"gpu\",state=\"cached\"} 12\n"
         "kvpool_prefix_cache_pages{tier=\"gpu\",state=\"pinned\"} 3\n"
         "kvpool_prefix_cache_pages{tier=\"gpu\",state=\"indexed\"} 40\n");
    WANT("# HELP kvpool_prefix_cache_pins Pins alive (neither unpinned nor expired).\n"
         "# TYPE kvpool_prefix_cache_pins gauge\n"
         "kvpool_prefix_cache_pins 2\n");
    WANT("# HELP kvpool_prefix_cache_commits_pending Commits whose event the daemon still "
         "polls: their pages become findable (and their KV events go out) once it completes.\n"
         "# TYPE kvpool_prefix_cache_commits_pending gauge\n"
         "kvpool_prefix_cache_commits_pending 4\n");
    WANT("# HELP kvpool_prefix_cache_evictions_total Pages that left the prefix cache, by "
         "reason (pressure: an allocation needed the page; flush: CacheFlush; rewrite: a "
         "truncate made the page partial again).\n"
         "# TYPE kvpool_prefix_cache_evictions_total counter\n"
         "kvpool_prefix_cache_evictions_total{reason=\"pressure\"} 7\n"
         "kvpool_prefix_cache_evictions_total{reason=\"flush\"} 5\n"
         "kvpool_prefix_cache_evictions_total{reason=\"rewrite\"} 1\n");
    WANT("# HELP kvpool_prefix_cache_residence_seconds Time a cached page (held by nobody) "
         "stayed in the eviction order before an allocation evicted it (pages a flush drops "
         "are not counted).\n"
         "# TYPE kvpool_prefix_cache_residence_seconds histogram\n");
    unsigned cum = 0;
    for (unsigned k = 0; k < KVP_PCACHE_RESIDENCE_BUCKETS; k++) {
        char le[32];
        seconds_of_ms(kvp_pcache_residence_le_ms[k], le, sizeof(le));
        cum += k + 1;
        WANT("kvpool_prefix_cache_residence_seconds_bucket{le=\"%s\"} %u\n", le, cum);
    }
    ck_assert_uint_eq(cum, 55);
    WANT("kvpool_prefix_cache_residence_seconds_bucket{le=\"+Inf\"} 66\n"
         "kvpool_prefix_cache_residence_seconds_sum 123.456\n"
         "kvpool_prefix_cache_residence_seconds_count 66\n");
    WANT("# HELP kvpool_prefix_cache_bytes Daemon memory of the prefix cache's own tables "
         "(fixed at start).\n"
         "# TYPE kvpool_prefix_cache_bytes gauge\n"
         "kvpool_prefix_cache_bytes 1048576\n");
#undef WANT
    ck_assert_uint_lt(w, sizeof(want));

    const char *at = strstr(text, "# HELP kvpool_prefix_cache_");
    ck_assert_ptr_nonnull(at);
    ck_assert_msg(strncmp(at, want, w) == 0, "got:\n%.*s\nwant:\n%s", (int)w, at, want);
    /* one block: no other prefix cache line before or after it */
    ck_assert_ptr_null(strstr(at + w, "\nkvpool_prefix_cache_"));
    ck_assert_ptr_null(strstr(at + w, "# HELP kvpool_prefix_cache_"));
    ck_assert(at == text || at[-1] == '\n');
    ck_assert(strstr(text, "\nkvpool_prefix_cache_") > at);
}
END_TEST

/* The host tier (issue #28): the host series of the cache's families and the kvpool_tier_*
 * families, exactly, only with has_tier. */
START_TEST(tier_families_are_written_exactly)
{
    kvp_metrics_t m = snapshot(1);
    kvp_metrics_text(&m, text, sizeof(text));
    ck_assert_ptr_null(strstr(text, "tier=\"host\""));
    ck_assert_ptr_null(strstr(text, "kvpool_tier_"));
    m.has_tier = 1;
    m.cache.host_pages = 17;
    m.cache.host_hit_tokens = 640;
    m.cache.demotions = 90;
    m.cache.promotions = 40;
    m.cache.host_evictions = 33;
    m.tier_bytes[0] = 90 * 4096, m.tier_bytes[1] = 40 * 4096;
    m.tier_ns[0] = 1500000000, m.tier_ns[1] = 250000;
    m.host_bytes_total = 64 * 4096, m.host_bytes_ready = 32 * 4096, m.host_slot_bytes = 4096;
    kvp_metrics_text(&m, text, sizeof(text));
    ck_assert_ptr_nonnull(strstr(text,
                                 "kvpool_prefix_cache_hit_tokens_total{tier=\"gpu\"} 750\n"
                                 "kvpool_prefix_cache_hit_tokens_total{tier=\"host\"} 640\n"));
    ck_assert_ptr_nonnull(
        strstr(text, "kvpool_prefix_cache_pages{tier=\"gpu\",state=\"indexed\"} 40\n"
                     "kvpool_prefix_cache_pages{tier=\"host\",state=\"indexed\"} 17\n"));
    ck_assert_ptr_nonnull(strstr(text, "# TYPE kvpool_tier_bytes_total counter\n"
                                       "kvpool_tier_bytes_total{direction=\"offload\"} 368640\n"
                                       "kvpool_tier_bytes_total{direction=\"restore\"} 163840\n"));
    ck_assert_ptr_nonnull(strstr(text,
                                 "kvpool_tier_seconds_total{direction=\"offload\"} 1.500000\n"
                                 "kvpool_tier_seconds_total{direction=\"restore\"} 0.000250\n"));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_tier_pages_total{direction=\"offload\"} 90\n"
                                       "kvpool_tier_pages_total{direction=\"restore\"} 40\n"));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_tier_host_evictions_total 33\n"));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_tier_host_bytes{state=\"total\"} 262144\n"
                                       "kvpool_tier_host_bytes{state=\"ready\"} 131072\n"
                                       "kvpool_tier_host_bytes{state=\"used\"} 69632\n"));
}
END_TEST

/* KV events (issue #29): the kvpool_events_* families, exactly, only with has_events. */
START_TEST(events_families_are_written_exactly)
{
    kvp_metrics_t m = snapshot(1);
    kvp_metrics_text(&m, text, sizeof(text));
    ck_assert_ptr_null(strstr(text, "kvpool_events_"));
    m.has_events = 1;
    m.ev.batches = 10, m.ev.events = 25, m.ev.blocks = 300, m.ev.bytes = 45678;
    m.ev.dropped_hwm = 3, m.ev.dropped_queue = 2, m.ev.dropped_memory = 1;
    m.ev.replay_requests = 7, m.ev.replay_bad = 5, m.ev.replayed_batches = 70;
    m.ev.subscribers = 2, m.ev.queued = 6, m.ev.next_seq = 15;
    kvp_metrics_text(&m, text, sizeof(text));
    const char *const want[] = {
        "# TYPE kvpool_events_batches_total counter\nkvpool_events_batches_total 10\n",
        "# TYPE kvpool_events_total counter\nkvpool_events_total 25\n",
        "# TYPE kvpool_events_blocks_total counter\nkvpool_events_blocks_total 300\n",
        "# TYPE kvpool_events_bytes_total counter\nkvpool_events_bytes_total 45678\n",
        "kvpool_events_dropped_total{reason=\"hwm\"} 3\n"
        "kvpool_events_dropped_total{reason=\"queue\"} 2\n"
        "kvpool_events_dropped_total{reason=\"memory\"} 1\n",
        "kvpool_events_replay_requests_total{result=\"ok\"} 7\n"
        "kvpool_events_replay_requests_total{result=\"bad\"} 5\n",
        "# TYPE kvpool_events_replayed_batches_total counter\n"
        "kvpool_events_replayed_batches_total 70\n",
        "# TYPE kvpool_events_subscribers gauge\nkvpool_events_subscribers 2\n",
        "# TYPE kvpool_events_queued_batches gauge\nkvpool_events_queued_batches 6\n",
        "# TYPE kvpool_events_next_sequence gauge\nkvpool_events_next_sequence 15\n",
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++)
        ck_assert_msg(strstr(text, want[i]), "missing: %s", want[i]);
}
END_TEST

START_TEST(no_cache_no_cache_families)
{
    kvp_metrics_t m = snapshot(0);
    size_t len = kvp_metrics_text(&m, text, sizeof(text));
    ck_assert_uint_eq(len, strlen(text));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_pages{device=\"0\",state=\"capacity\"} 64\n"));
    /* no sample, HELP or TYPE of the families (another family's help may name one) */
    ck_assert_ptr_null(strstr(text, "\nkvpool_prefix_cache_"));
    ck_assert_ptr_null(strstr(text, " kvpool_prefix_cache_pages "));
    ck_assert_ptr_null(strstr(text, "# TYPE kvpool_prefix_cache_"));
    /* the figures alone do not write the families: has_cache does */
    m.cache.cached_pages = 9;
    kvp_metrics_text(&m, text, sizeof(text));
    ck_assert_ptr_null(strstr(text, "\nkvpool_prefix_cache_"));
}
END_TEST

START_TEST(every_cache_sample_follows_its_type)
{
    kvp_metrics_t m = snapshot(1);
    kvp_metrics_text(&m, text, sizeof(text));
    unsigned samples = 0;
    for (char *line = text; *line;) {
        char *nl = strchr(line, '\n');
        ck_assert_ptr_nonnull(nl);
        if (*line != '#' && strncmp(line, "kvpool_prefix_cache_", 20) == 0) {
            char name[128];
            size_t k = strcspn(line, "{ ");
            snprintf(name, sizeof(name), "# TYPE %.*s ", (int)k, line);
            char *suffix = strstr(name, "_bucket ");
            if (!suffix)
                suffix = strstr(name, "_sum ");
            if (!suffix)
                suffix = strstr(name, "_count ");
            if (suffix)
                strcpy(suffix, " ");
            char *type = strstr(text, name);
            ck_assert_msg(type && type < line, "no %s before %.*s", name, (int)(nl - line), line);
            ck_assert_msg(!strstr(type + 1, name), "two %s", name); /* one TYPE per family */
            samples++;
        }
        line = nl + 1;
    }
    /* 2 token counters, 3 page states, pins, commits pending, 3 reasons, buckets + Inf + sum +
     * count, bytes */
    ck_assert_uint_eq(samples, 2 + 3 + 1 + 1 + 3 + KVP_PCACHE_RESIDENCE_BUCKETS + 3 + 1);
}
END_TEST

START_TEST(a_cut_inside_the_cache_families_ends_at_a_line)
{
    kvp_metrics_t m = snapshot(1);
    size_t full = kvp_metrics_text(&m, text, sizeof(text));
    const char *at = strstr(text, "kvpool_prefix_cache_residence_seconds_bucket");
    ck_assert_ptr_nonnull(at);
    const size_t mid = (size_t)(at - text) + 10; /* inside a bucket line */
    static char part[sizeof(text)];
    kvp_log_set_level(KVP_LOG_ERR); /* each cut logs a warning */
    for (size_t cap = mid; cap < mid + 400; cap += 7) {
        size_t n = kvp_metrics_text(&m, part, cap);
        ck_assert_uint_lt(n, full);
        ck_assert_uint_eq(n, strlen(part));
        char *note = strstr(part, "# kvpool: truncated at ");
        ck_assert_ptr_nonnull(note);
        size_t body = (size_t)(note - part);
        ck_assert_uint_gt(body, 0);
        ck_assert_int_eq(part[body - 1], '\n');
        ck_assert_int_eq(memcmp(part, text, body), 0);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("metrics_text");
    TCase *tc = tcase_create("metrics_text");
    tcase_add_test(tc, cache_families_are_written_exactly);
    tcase_add_test(tc, no_cache_no_cache_families);
    tcase_add_test(tc, tier_families_are_written_exactly);
    tcase_add_test(tc, events_families_are_written_exactly);
    tcase_add_test(tc, every_cache_sample_follows_its_type);
    tcase_add_test(tc, a_cut_inside_the_cache_families_ends_at_a_line);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
