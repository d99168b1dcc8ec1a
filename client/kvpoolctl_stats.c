/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvpoolctl_stats.c - kvpoolctl's commands over the Stats answer: stats (the pool, the
 * namespaces, the cache's scopes with -o wide) and cache (the prefix cache's figures, GPU and
 * host tier, a hit rate over a window between two reads, one row per scope), and the one
 * mutating command, cache flush. They read through libkvpool's kvp_client_daemon_stats and
 * kvp_client_cache_flush and print through kvpoolctl_out.c; the connection is
 * kvpoolctl_cmd.c's.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvpool.h"
#include "kvpoolctl.h"
#include "kvpoolctl_out.h"
#include "kvpoolctl_top.h"

/* ---- the prefix cache (kvp_daemon_stats_t.cache and .scopes) ----------------------------
 * The figures come with Stats. A hit rate is over a window: between two reads
 * (cache --interval) or since the daemon started; a scope row's window figures are its
 * counters minus those of the same scope (name and uid) in the first read. */

typedef struct {
    kvp_scope_stats_t s;
    uint64_t query, hit; /* over the window */
    uint64_t host_hit;   /* over the window: found in the host tier */
} scope_row_t;

static void scope_hit_rate(const void *rec, const void *ctx, kvp_ctl_col_val_t *v)
{
    const scope_row_t *r = rec;
    (void)ctx;
    v->d = kvp_ctl_ratio(r->hit, r->query);
}

static const kvp_ctl_col_t scope_cols[] = {
    {"SCOPE", "name", 'l', SHOW_PLAIN, FIELD(scope_row_t, s.name)},
    {"UID", "uid", 'r', SHOW_PLAIN, FIELD(scope_row_t, s.uid)},
    {"NAMESPACES", "namespaces", 'r', SHOW_PLAIN, FIELD(scope_row_t, s.namespaces)},
    {"CACHED", "cached_pages", 'r', SHOW_PLAIN, FIELD(scope_row_t, s.cached_pages)},
    {"INDEXED", "indexed_pages", 'r', SHOW_PLAIN, FIELD(scope_row_t, s.indexed_pages)},
    {NULL, "query_tokens_total", 'r', SHOW_PLAIN, FIELD(scope_row_t, s.query_tokens)},
    {NULL, "hit_tokens_total", 'r', SHOW_PLAIN, FIELD(scope_row_t, s.hit_tokens)},
    {"QUERY", "query_tokens", 'r', SHOW_PLAIN, FIELD(scope_row_t, query)},
    {"HIT", "hit_tokens", 'r', SHOW_PLAIN, FIELD(scope_row_t, hit)},
    {"HIT%", "hit_rate", 'r', SHOW_PERCENT, .type = COL_F64, .get = scope_hit_rate},
    /* the host tier (issue #28): JSON only, so the table reads as before */
    {NULL, "host_pages", 'r', SHOW_PLAIN, FIELD(scope_row_t, s.host_pages)},
    {NULL, "host_hit_tokens_total", 'r', SHOW_PLAIN, FIELD(scope_row_t, s.host_hit_tokens)},
    {NULL, "host_hit_tokens", 'r', SHOW_PLAIN, FIELD(scope_row_t, host_hit)},
    {"QUERY_TOTAL", NULL, 'r', SHOW_PLAIN, FIELD(scope_row_t, s.query_tokens), .wide = 1},
    {"HIT_TOTAL", NULL, 'r', SHOW_PLAIN, FIELD(scope_row_t, s.hit_tokens), .wide = 1},
};
static const kvp_ctl_record_t scope_record = RECORD(scope_cols, scope_row_t);

/* cur - prev of a counter; cur alone when it went back (another daemon: not expected on one
 * connection, but never an underflow). */
static uint64_t delta(uint64_t cur, uint64_t prev)
{
    return cur >= prev ? cur - prev : cur;
}

/* The window of each scope of cur (prev NULL: since start) into rows[cur->num_scopes]. */
static void scope_rows(const kvp_daemon_stats_t *cur, const kvp_daemon_stats_t *prev,
                       scope_row_t *rows)
{
    for (uint32_t i = 0; i < cur->num_scopes; i++) {
        const kvp_scope_stats_t *c = &cur->scopes[i], *p = NULL;
        for (uint32_t k = 0; prev && k < prev->num_scopes && !p; k++)
            if (prev->scopes[k].uid == c->uid && strcmp(prev->scopes[k].name, c->name) == 0)
                p = &prev->scopes[k];
        rows[i].s = *c;
        rows[i].query = p ? delta(c->query_tokens, p->query_tokens) : c->query_tokens;
        rows[i].hit = p ? delta(c->hit_tokens, p->hit_tokens) : c->hit_tokens;
        rows[i].host_hit = p ? delta(c->host_hit_tokens, p->host_hit_tokens) : c->host_hit_tokens;
    }
}

/* ---- the host tier (issue #28): kvp_cache_stats_t's host_* figures ----------------------- */

/* A copy's rate over the window in GB/s (10^9 bytes a second): bytes per microsecond of the
 * copies' summed time / 1000; NaN when they took no time (nothing moved). */
static double gb_per_s(uint64_t bytes, uint64_t us)
{
    return us ? (double)bytes / (double)us / 1000.0 : NAN;
}

/* A number, or null for NaN (JSON has no NaN). */
static void json_number(kvp_ctl_json_t *j, const char *key, double v)
{
    if (isnan(v))
        kvp_ctl_json_ratio(j, key, v); /* writes null */
    else
        kvp_ctl_json_double(j, key, v);
}

/* The host tier as JSON object "host": cur's figures and the window's (prev NULL: since
 * start): hit tokens and their share of the tokens asked for, the copies' GB/s. */
static void json_host(kvp_ctl_json_t *j, const kvp_cache_stats_t *cur,
                      const kvp_cache_stats_t *prev)
{
    const uint64_t q = delta(cur->query_tokens_total, prev ? prev->query_tokens_total : 0);
    const uint64_t h = delta(cur->host_hit_tokens_total, prev ? prev->host_hit_tokens_total : 0);
    kvp_ctl_json_open(j, "host", '{');
    kvp_ctl_json_bool(j, "enabled", cur->host_bytes_total > 0);
    kvp_ctl_json_u64(j, "pages", cur->host_pages);
    kvp_ctl_json_u64(j, "slots", cur->host_slots);
    kvp_ctl_json_u64(j, "slot_bytes", cur->host_slot_bytes);
    kvp_ctl_json_u64(j, "bytes_total", cur->host_bytes_total);
    kvp_ctl_json_u64(j, "bytes_ready", cur->host_bytes_ready);
    kvp_ctl_json_u64(j, "hit_tokens_total", cur->host_hit_tokens_total);
    kvp_ctl_json_u64(j, "hit_tokens", h);
    kvp_ctl_json_ratio(j, "hit_rate", kvp_ctl_ratio(h, q));
    kvp_ctl_json_u64(j, "demotions_total", cur->demotions_total);
    kvp_ctl_json_u64(j, "promotions_total", cur->promotions_total);
    kvp_ctl_json_u64(j, "evictions_total", cur->host_evictions_total);
    kvp_ctl_json_u64(j, "demoting", cur->demoting);
    kvp_ctl_json_u64(j, "restoring", cur->restoring);
    const struct {
        const char *name;
        uint64_t bytes, us, prev_bytes, prev_us;
    } dirs[] = {{"offload", cur->offload_bytes_total, cur->offload_us_total,
                 prev ? prev->offload_bytes_total : 0, prev ? prev->offload_us_total : 0},
                {"restore", cur->restore_bytes_total, cur->restore_us_total,
                 prev ? prev->restore_bytes_total : 0, prev ? prev->restore_us_total : 0}};
    for (size_t i = 0; i < 2; i++) {
        kvp_ctl_json_open(j, dirs[i].name, '{');
        kvp_ctl_json_u64(j, "bytes_total", dirs[i].bytes);
        kvp_ctl_json_u64(j, "us_total", dirs[i].us);
        kvp_ctl_json_double(j, "gb_total", (double)dirs[i].bytes / 1e9);
        json_number(
            j, "gb_per_s",
            gb_per_s(delta(dirs[i].bytes, dirs[i].prev_bytes), delta(dirs[i].us, dirs[i].prev_us)));
        kvp_ctl_json_close(j, '}');
    }
    kvp_ctl_json_close(j, '}');
}

/* "1.234 GB at 5.67 GB/s", the rate over the window; "- GB/s" when nothing moved in it */
static const char *fmt_moved(uint64_t bytes, uint64_t window_bytes, uint64_t window_us, char *buf,
                             size_t len)
{
    const double r = gb_per_s(window_bytes, window_us);
    if (isnan(r))
        snprintf(buf, len, "%.3f GB at - GB/s", (double)bytes / 1e9);
    else
        snprintf(buf, len, "%.3f GB at %.2f GB/s", (double)bytes / 1e9, r);
    return buf;
}

/* The cache as one JSON object `key`: cur's figures, the window's tokens and hit rate (prev
 * NULL: since start; interval_ms 0 then), evictions by reason, one object per scope. */
static void json_cache(kvp_ctl_json_t *j, const char *key, const kvp_daemon_stats_t *cur_stats,
                       const kvp_daemon_stats_t *prev_stats, uint32_t interval_ms)
{
    static scope_row_t rows[KVP_CLIENT_MAX_SCOPES];
    const kvp_cache_stats_t *cur = &cur_stats->cache,
                            *prev = prev_stats ? &prev_stats->cache : NULL;
    const uint64_t q = delta(cur->query_tokens_total, prev ? prev->query_tokens_total : 0);
    const uint64_t h = delta(cur->hit_tokens_total, prev ? prev->hit_tokens_total : 0);
    kvp_ctl_json_open(j, key, '{');
    kvp_ctl_json_u64(j, "cached_pages", cur->cached_pages);
    kvp_ctl_json_u64(j, "pinned_pages", cur->pinned_pages);
    kvp_ctl_json_u64(j, "indexed_pages", cur->indexed_pages);
    kvp_ctl_json_u64(j, "pins", cur->pins);
    kvp_ctl_json_u64(j, "bytes", cur->bytes);
    kvp_ctl_json_u64(j, "query_tokens_total", cur->query_tokens_total);
    kvp_ctl_json_u64(j, "hit_tokens_total", cur->hit_tokens_total);
    kvp_ctl_json_u64(j, "interval_ms", prev ? interval_ms : 0);
    kvp_ctl_json_u64(j, "query_tokens", q);
    kvp_ctl_json_u64(j, "hit_tokens", h);
    kvp_ctl_json_ratio(j, "hit_rate", kvp_ctl_ratio(h, q));
    kvp_ctl_json_open(j, "evictions", '{');
    kvp_ctl_json_u64(j, "pressure", cur->evictions_pressure_total);
    kvp_ctl_json_u64(j, "flush", cur->evictions_flush_total);
    kvp_ctl_json_u64(j, "rewrite", cur->evictions_rewrite_total);
    kvp_ctl_json_close(j, '}');
    json_host(j, cur, prev);
    scope_rows(cur_stats, prev_stats, rows);
    kvp_ctl_json_records(j, "scopes", &scope_record, rows, cur_stats->num_scopes, NULL);
    kvp_ctl_json_close(j, '}');
}

/* "75.0% (750 of 1000 tokens)", or "- (no lookups)" */
static const char *fmt_hit_rate(uint64_t hit, uint64_t query, char *buf, size_t len)
{
    char pct[32];
    if (query == 0)
        snprintf(buf, len, "- (no lookups)");
    else
        snprintf(buf, len, "%s (%llu of %llu tokens)",
                 kvp_ctl_fmt_percent(kvp_ctl_ratio(hit, query), pct, sizeof(pct)),
                 (unsigned long long)hit, (unsigned long long)query);
    return buf;
}

/* The host tier's lines of `cache` (after the GPU's): one line when there is none. */
static void print_host(const kvp_cache_stats_t *c, const kvp_cache_stats_t *p, uint32_t interval_ms)
{
    char b1[64], b2[64], b3[64], b4[160];
    if (c->host_bytes_total == 0) {
        printf("host tier    none (cache.host_bytes is 0)\n");
        return;
    }
    printf("host tier    %u pages in %u usable slots of %s; %s of %s ready\n", c->host_pages,
           c->host_slots, kvp_ctl_fmt_bytes(c->host_slot_bytes, b1, sizeof(b1)),
           kvp_ctl_fmt_bytes(c->host_bytes_ready, b2, sizeof(b2)),
           kvp_ctl_fmt_bytes(c->host_bytes_total, b3, sizeof(b3)));
    fmt_hit_rate(delta(c->host_hit_tokens_total, p ? p->host_hit_tokens_total : 0),
                 delta(c->query_tokens_total, p ? p->query_tokens_total : 0), b4, sizeof(b4));
    if (p)
        printf("host hits    %s over %s\n", b4, kvp_ctl_fmt_duration(interval_ms, b1, sizeof(b1)));
    else
        printf("host hits    %s since start\n", b4);
    printf("host moves   %llu demoted, %llu promoted, %llu evicted; %u demoting, %u restoring\n",
           (unsigned long long)c->demotions_total, (unsigned long long)c->promotions_total,
           (unsigned long long)c->host_evictions_total, c->demoting, c->restoring);
    printf("offload      %s\n",
           fmt_moved(c->offload_bytes_total,
                     delta(c->offload_bytes_total, p ? p->offload_bytes_total : 0),
                     delta(c->offload_us_total, p ? p->offload_us_total : 0), b4, sizeof(b4)));
    printf("restore      %s\n",
           fmt_moved(c->restore_bytes_total,
                     delta(c->restore_bytes_total, p ? p->restore_bytes_total : 0),
                     delta(c->restore_us_total, p ? p->restore_us_total : 0), b4, sizeof(b4)));
}

static void sleep_ms(uint32_t ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static int cmd_cache_flush(ctl_t *x)
{
    int rc = kvp_ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    uint32_t pages = 0;
    rc = kvp_client_cache_flush(x->c, x->o->flush_scope, x->o->flush_all, &pages);
    if (rc)
        return kvp_ctl_report(x, rc, "cache flush");
    char b1[160];
    if (x->o->json) {
        kvp_ctl_json_t j = {.f = stdout};
        kvp_ctl_json_open(&j, NULL, '{');
        kvp_ctl_json_u64(&j, "pages", pages);
        kvp_ctl_json_str(&j, "scope", x->o->flush_scope ? x->o->flush_scope : "");
        kvp_ctl_json_bool(&j, "all", x->o->flush_all);
        kvp_ctl_json_str(&j, "namespace", x->o->join);
        kvp_ctl_json_close(&j, '}');
    } else if (x->o->flush_all) {
        printf("flushed %u page%s (every scope)\n", pages, pages == 1 ? "" : "s");
    } else if (x->o->flush_scope) {
        printf("flushed %u page%s (scope %s)\n", pages, pages == 1 ? "" : "s",
               kvp_ctl_safe(x->o->flush_scope, b1, sizeof(b1)));
    } else {
        printf("flushed %u page%s (the scope of namespace %s)\n", pages, pages == 1 ? "" : "s",
               kvp_ctl_safe(x->o->join, b1, sizeof(b1)));
    }
    return EXIT_OK;
}

/* cache -n NS: only the scope of NS, its private one ns:NS (or the one --cache-scope names);
 * an observer cannot learn which shared scope a namespace is in. */
static void keep_ns_scope(const opts_t *o, kvp_daemon_stats_t *d)
{
    char want[KVP_CLIENT_SCOPE_NAME_BYTES + 8];
    if (o->cache_scope)
        snprintf(want, sizeof(want), "%s", o->cache_scope);
    else
        snprintf(want, sizeof(want), "ns:%s", o->ns);
    uint32_t n = 0;
    for (uint32_t i = 0; i < d->num_scopes; i++)
        if (strcmp(d->scopes[i].name, want) == 0)
            d->scopes[n++] = d->scopes[i];
    d->num_scopes = n;
}

int kvp_ctl_cmd_cache(ctl_t *x)
{
    if (x->o->flush)
        return cmd_cache_flush(x);
    if (x->o->dump)
        return kvp_ctl_cmd_cache_dump(x);
    int rc = kvp_ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    kvp_ctl_stats_t *s = malloc(sizeof(*s)), *first = NULL;
    if (!s)
        return kvp_ctl_report(x, KVP_ENOMEM, "stats");
    rc = kvp_ctl_get_stats(x, s);
    if (rc == 0 && x->o->interval_set) {
        first = s;
        s = malloc(sizeof(*s));
        if (!s) {
            free(first);
            return kvp_ctl_report(x, KVP_ENOMEM, "stats");
        }
        sleep_ms(x->o->interval_ms);
        rc = kvp_ctl_get_stats(x, s);
    }
    if (rc) {
        free(s);
        free(first);
        return kvp_ctl_report(x, rc, "stats");
    }
    const int all_scopes_listed = s->s.num_scopes == KVP_CLIENT_MAX_SCOPES;
    if (x->o->ns) {
        keep_ns_scope(x->o, &s->s);
        if (first)
            keep_ns_scope(x->o, &first->s);
    }
    const kvp_daemon_stats_t *cur = &s->s, *prev = first ? &first->s : NULL;
    const kvp_cache_stats_t *c = &cur->cache, *p = prev ? &prev->cache : NULL;
    if (x->o->json) {
        kvp_ctl_json_t j = {.f = stdout};
        json_cache(&j, NULL, cur, prev, x->o->interval_ms);
        free(s);
        free(first);
        return EXIT_OK;
    }
    char b1[64], b2[160];
    printf("pages        %u cached, %u pinned, %u indexed\n", c->cached_pages, c->pinned_pages,
           c->indexed_pages);
    printf("pins         %u\n", c->pins);
    fmt_hit_rate(delta(c->hit_tokens_total, p ? p->hit_tokens_total : 0),
                 delta(c->query_tokens_total, p ? p->query_tokens_total : 0), b2, sizeof(b2));
    if (p)
        printf("hit rate     %s over %s\n", b2,
               kvp_ctl_fmt_duration(x->o->interval_ms, b1, sizeof(b1)));
    else
        printf("hit rate     %s since start\n", b2);
    printf("evictions    %llu pressure, %llu flush, %llu rewrite\n",
           (unsigned long long)c->evictions_pressure_total,
           (unsigned long long)c->evictions_flush_total,
           (unsigned long long)c->evictions_rewrite_total);
    printf("memory       %s (the cache's tables)\n", kvp_ctl_fmt_bytes(c->bytes, b1, sizeof(b1)));
    if (cur->has_cache)
        print_host(c, p, x->o->interval_ms);
    if (cur->num_scopes) {
        static scope_row_t rows[KVP_CLIENT_MAX_SCOPES];
        scope_rows(cur, prev, rows);
        putchar('\n');
        kvp_ctl_table_records(stdout, x->o->wide, x->o->no_headers, &scope_record, rows,
                              cur->num_scopes, NULL);
    }
    fflush(stdout); /* the notes come after the table */
    if (all_scopes_listed)
        fprintf(stderr, "(the daemon lists at most %u scopes)\n", (unsigned)KVP_CLIENT_MAX_SCOPES);
    if (x->o->ns && !cur->num_scopes)
        fprintf(stderr, "(no scope %s%s visible here)\n", x->o->cache_scope ? "" : "ns:",
                kvp_ctl_safe(x->o->cache_scope ? x->o->cache_scope : x->o->ns, b2, sizeof(b2)));
    if (!cur->has_cache)
        fprintf(stderr, "(the daemon sent no prefix cache figures)\n");
    free(s);
    free(first);
    return EXIT_OK;
}

/* stats: one namespace */
static void ns_expires_cell(const void *rec, const void *ctx, char *buf, size_t len)
{
    const kvp_namespace_stats_t *n = rec;
    (void)ctx;
    if (n->sessions)
        snprintf(buf, len, "-"); /* attached: no expiry pending */
    else
        kvp_ctl_fmt_duration(n->lease_expires_in_ms, buf, len);
}

static const kvp_ctl_col_t ns_cols[] = {
    {"NAMESPACE", "name", 'l', SHOW_PLAIN, FIELD(kvp_namespace_stats_t, name)},
    {"SEQS", "num_seqs", 'r', SHOW_PLAIN, FIELD(kvp_namespace_stats_t, num_seqs)},
    {"TOKENS", "num_tokens", 'r', SHOW_PLAIN, FIELD(kvp_namespace_stats_t, num_tokens)},
    {"PAGE_REFS", "page_refs", 'r', SHOW_PLAIN, FIELD(kvp_namespace_stats_t, page_refs)},
    {"SESSIONS", "sessions", 'r', SHOW_PLAIN, FIELD(kvp_namespace_stats_t, sessions)},
    {"LEASE", "lease_ms", 'r', SHOW_DURATION, FIELD(kvp_namespace_stats_t, lease_ms)},
    {"EXPIRES_IN", "lease_expires_in_ms", 'r', SHOW_CUSTOM,
     FIELD(kvp_namespace_stats_t, lease_expires_in_ms), .cell = ns_expires_cell},
    {"DEDUP_BYTES", NULL, 'r', SHOW_PLAIN, FIELD(kvp_namespace_stats_t, dedup_bytes), .wide = 1},
    {"DEDUP_ENTRIES", NULL, 'r', SHOW_PLAIN, FIELD(kvp_namespace_stats_t, dedup_entries),
     .wide = 1},
};
static const kvp_ctl_record_t ns_record = RECORD(ns_cols, kvp_namespace_stats_t);

int kvp_ctl_cmd_stats(ctl_t *x)
{
    int rc = kvp_ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    kvp_ctl_stats_t *st = kvp_ctl_read_stats(x, &rc);
    if (!st)
        return rc;
    kvp_daemon_stats_t *d = &st->s;
    const kvp_stats_summary_t *s = &d->summary;
    if (x->o->ns) { /* namespace NS only: the one row of it, or no such namespace */
        uint32_t k = 0;
        while (k < d->num_namespaces && strcmp(d->namespaces[k].name, x->o->ns) != 0)
            k++;
        if (k == d->num_namespaces) {
            char b[160];
            if (d->namespaces_truncated)
                fprintf(stderr,
                        "kvpoolctl: stats: namespace '%s' is not among the %u the daemon lists "
                        "(of %u)\n",
                        kvp_ctl_safe(x->o->ns, b, sizeof(b)), (unsigned)d->num_namespaces,
                        (unsigned)kvp_ctl_ns_total(d));
            else
                fprintf(stderr, "kvpoolctl: stats: no namespace '%s'\n",
                        kvp_ctl_safe(x->o->ns, b, sizeof(b)));
            free(st);
            return EXIT_SERVER;
        }
        d->namespaces[0] = d->namespaces[k];
        d->num_namespaces = 1;
        d->namespaces_truncated = 0; /* the answer about NS is complete */
    }
    char b1[64];
    if (x->o->json) {
        kvp_ctl_json_t j = {.f = stdout};
        kvp_ctl_json_open(&j, NULL, '{');
        kvp_ctl_json_u64(&j, "num_pages", s->num_pages);
        kvp_ctl_json_u64(&j, "free_pages", s->free_pages);
        kvp_ctl_json_u64(&j, "used_pages", s->used_pages);
        kvp_ctl_json_u64(&j, "shared_pages", s->shared_pages);
        kvp_ctl_json_u64(&j, "num_seqs", s->num_seqs);
        kvp_ctl_json_u64(&j, "num_tokens", s->num_tokens);
        kvp_ctl_json_u64(&j, "page_refs", s->page_refs);
        kvp_ctl_json_u64(&j, "page_bytes", s->page_bytes);
        kvp_ctl_json_u64(&j, "num_clients", s->num_clients);
        kvp_ctl_json_u64(&j, "uptime_ms", s->uptime_ms);
        kvp_ctl_json_u64(&j, "requests_total", s->requests_total);
        kvp_ctl_json_u64(&j, "append_bytes_total", s->append_bytes_total);
        kvp_ctl_json_records(&j, "namespaces", &ns_record, d->namespaces, d->num_namespaces, NULL);
        kvp_ctl_json_u64(&j, "namespaces_total", kvp_ctl_ns_total(d));
        kvp_ctl_json_bool(&j, "namespaces_truncated", d->namespaces_truncated);
        json_cache(&j, "cache", d, NULL, 0);
        kvp_ctl_json_close(&j, '}');
        free(st);
        return EXIT_OK;
    }
    printf("pages        %u total, %u free, %u used, %u shared\n", s->num_pages, s->free_pages,
           s->used_pages, s->shared_pages);
    printf("page refs    %llu\n", (unsigned long long)s->page_refs);
    printf("page size    %s (all layers, K and V, one device)\n",
           kvp_ctl_fmt_bytes(s->page_bytes, b1, sizeof(b1)));
    printf("sequences    %u (%llu tokens)\n", s->num_seqs, (unsigned long long)s->num_tokens);
    printf("clients      %u\n", s->num_clients);
    printf("requests     %llu\n", (unsigned long long)s->requests_total);
    printf("appended     %s\n", kvp_ctl_fmt_bytes(s->append_bytes_total, b1, sizeof(b1)));
    printf("uptime       %s\n", kvp_ctl_fmt_duration(s->uptime_ms, b1, sizeof(b1)));
    if (d->has_cache) {
        char b2[160];
        const kvp_cache_stats_t *c = &d->cache;
        printf("cache        %u cached, %u pinned, %u indexed pages; hit rate %s\n",
               c->cached_pages, c->pinned_pages, c->indexed_pages,
               fmt_hit_rate(c->hit_tokens_total, c->query_tokens_total, b2, sizeof(b2)));
    }
    if (x->o->wide)
        printf("dedup        %s kept for retries, %llu evicted\n",
               kvp_ctl_fmt_bytes(d->dedup_bytes, b1, sizeof(b1)),
               (unsigned long long)d->dedup_evictions_total);
    if (d->num_namespaces) {
        putchar('\n');
        kvp_ctl_table_records(stdout, x->o->wide, x->o->no_headers, &ns_record, d->namespaces,
                              d->num_namespaces, NULL);
    }
    if (x->o->wide && d->has_cache && d->num_scopes) { /* the cache's scopes */
        static scope_row_t rows[KVP_CLIENT_MAX_SCOPES];
        scope_rows(d, NULL, rows);
        putchar('\n');
        kvp_ctl_table_records(stdout, x->o->wide, x->o->no_headers, &scope_record, rows,
                              d->num_scopes, NULL);
    }
    if (d->namespaces_truncated) {
        fflush(stdout); /* the note comes after the table */
        fprintf(stderr, "(%u of %u namespaces shown: the daemon lists at most %u)\n",
                (unsigned)d->num_namespaces, (unsigned)kvp_ctl_ns_total(d),
                (unsigned)d->num_namespaces);
    }
    free(st);
    return EXIT_OK;
}
