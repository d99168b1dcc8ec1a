/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvpoolctl_cmd.c - kvpoolctl's connection and error report, and its commands about the daemon
 * and its sessions: status, pool, seqs, clients, transfers, audit, metrics, health and top
 * (drawn by kvpoolctl_top.c). Each connects, makes its libkvpool calls (kvpool.h only: no
 * protocol type) and prints a table or one JSON object through kvpoolctl_out.c. The prefix
 * cache and the statistics are kvpoolctl_stats.c's; the command line is kvpoolctl.c's.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"
#include "kvpoolctl.h"
#include "kvpoolctl_out.h"
#include "kvpoolctl_top.h"

#define METRICS_TEXT_BYTES (4u << 20)
#define SEQS_PAGE          256u

static const char *dtype_name(uint32_t d)
{
    static const char *names[] = {"unspecified", "fp8_e4m3", "fp8_e5m2", "fp16", "bf16", "fp32"};
    return d < sizeof(names) / sizeof(names[0]) ? names[d] : "unknown";
}

static const char *layout_name(uint32_t l)
{
    return l == 0 ? "NHD" : l == 1 ? "HND" : "unknown";
}

static const char *storage_name(uint32_t s)
{
    return s == 0 ? "combined" : s == 1 ? "split" : "unknown";
}

static const char *backend_name(uint32_t b)
{
    return b == 0 ? "host" : b == 1 ? "cuda" : "unknown";
}

/* ---- talking to the daemon ---------------------------------------------------------------- */

/* Exit status for a failed call: transport failures mean the daemon is unreachable. */
static int exit_for(int rc)
{
    if (rc == KVP_ECLOSED || rc == KVP_ETIMEDOUT || (rc < 0 && rc > -1000))
        return EXIT_UNREACHABLE;
    return EXIT_SERVER;
}

int kvp_ctl_report(ctl_t *x, int rc, const char *what)
{
    const char *msg = x->c ? kvp_client_last_error(x->c) : "";
    fprintf(stderr, "kvpoolctl: %s: %s\n", what, msg[0] ? msg : kvp_strerror(rc));
    return exit_for(rc);
}

int kvp_ctl_connect(ctl_t *x, char *err, size_t err_len)
{
    kvp_client_opts_t co = {
        .socket_path = x->o->socket_path,
        .ns = x->o->join,
        .observer = x->o->join == NULL, /* reads without owning a namespace (kvpool.proto) */
        .cache_scope = x->o->cache_scope,
        .client_name = "kvpoolctl",
        .lease_ms = KVP_LEASE_DEFAULT, /* never change the lease of the namespace it joins */
        .timeout_ms = x->o->timeout_ms,
        .map_pool = 0,
    };
    char msg[512];
    int rc = kvp_client_connect(&co, &x->c, msg, sizeof(msg));
    if (rc == 0)
        return 0;
    x->c = NULL;
    int code = exit_for(rc);
    if (err) {
        snprintf(err, err_len, "%s", msg[0] ? msg : kvp_strerror(rc));
        return code;
    }
    fprintf(stderr, "kvpoolctl: %s\n", msg[0] ? msg : kvp_strerror(rc));
    if (code == EXIT_UNREACHABLE)
        fprintf(stderr, "kvpoolctl: is kvpoold running? (socket %s)\n", x->o->socket_path);
    return code;
}

int kvp_ctl_get_stats(ctl_t *x, kvp_ctl_stats_t *st)
{
    memset(&st->s, 0, sizeof(st->s));
    st->s.namespaces = st->namespaces;
    st->s.cap_namespaces = KVP_CLIENT_MAX_NAMESPACES;
    st->s.scopes = st->scopes;
    st->s.cap_scopes = KVP_CLIENT_MAX_SCOPES;
    return kvp_client_daemon_stats(x->c, &st->s);
}

kvp_ctl_stats_t *kvp_ctl_read_stats(ctl_t *x, int *status)
{
    kvp_ctl_stats_t *st = malloc(sizeof(*st));
    if (!st) {
        *status = kvp_ctl_report(x, KVP_ENOMEM, "stats");
        return NULL;
    }
    int rc = kvp_ctl_get_stats(x, st);
    if (rc) {
        free(st);
        *status = kvp_ctl_report(x, rc, "stats");
        return NULL;
    }
    return st;
}

uint32_t kvp_ctl_ns_total(const kvp_daemon_stats_t *s)
{
    return s->namespaces_total > s->num_namespaces ? s->namespaces_total : s->num_namespaces;
}

/* ---- commands ----------------------------------------------------------------------------- */

static void json_geometry(kvp_ctl_json_t *j, const kvp_pool_info_t *p)
{
    kvp_ctl_json_open(j, "geometry", '{');
    kvp_ctl_json_u64(j, "num_layers", p->num_layers);
    kvp_ctl_json_u64(j, "num_pages", p->num_pages);
    kvp_ctl_json_u64(j, "page_size", p->page_size);
    kvp_ctl_json_u64(j, "num_kv_heads", p->num_kv_heads);
    kvp_ctl_json_u64(j, "head_dim", p->head_dim);
    kvp_ctl_json_str(j, "dtype", dtype_name(p->dtype));
    kvp_ctl_json_str(j, "layout", layout_name(p->layout));
    kvp_ctl_json_str(j, "storage", storage_name(p->storage));
    kvp_ctl_json_u64(j, "num_devices", p->num_devices);
    kvp_ctl_json_close(j, '}');
}

int kvp_ctl_cmd_status(ctl_t *x)
{
    int rc = kvp_ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    uint64_t rtt_ns = 0;
    rc = kvp_client_ping(x->c, &rtt_ns);
    if (rc)
        return kvp_ctl_report(x, rc, "ping");
    kvp_ctl_stats_t *st = kvp_ctl_read_stats(x, &rc);
    if (!st)
        return rc;
    const kvp_daemon_stats_t *d = &st->s;
    const kvp_stats_summary_t *s = &d->summary;
    const kvp_pool_info_t *p = kvp_client_pool_info(x->c);
    char b1[64], b2[64], b3[256];
    if (x->o->json) {
        kvp_ctl_json_t j = {.f = stdout};
        kvp_ctl_json_open(&j, NULL, '{');
        kvp_ctl_json_str(&j, "socket", x->o->socket_path);
        kvp_ctl_json_str(&j, "server_version", kvp_client_server_version(x->c));
        kvp_ctl_json_u64(&j, "protocol_version", kvp_client_protocol_version());
        kvp_ctl_json_u64(&j, "session_id", kvp_client_session_id(x->c));
        kvp_ctl_json_str(&j, "backend", backend_name(p->backend));
        json_geometry(&j, p);
        kvp_ctl_json_u64(&j, "pool_bytes", p->pool_bytes);
        kvp_ctl_json_u64(&j, "page_bytes", s->page_bytes);
        kvp_ctl_json_open(&j, "usage", '{');
        kvp_ctl_json_u64(&j, "num_pages", s->num_pages);
        kvp_ctl_json_u64(&j, "used_pages", s->used_pages);
        kvp_ctl_json_u64(&j, "free_pages", s->free_pages);
        kvp_ctl_json_u64(&j, "shared_pages", s->shared_pages);
        kvp_ctl_json_u64(&j, "num_seqs", s->num_seqs);
        kvp_ctl_json_u64(&j, "num_tokens", s->num_tokens);
        kvp_ctl_json_u64(&j, "num_namespaces", kvp_ctl_ns_total(d));
        kvp_ctl_json_u64(&j, "num_clients", s->num_clients);
        kvp_ctl_json_close(&j, '}');
        /* every device of a tensor-parallel group holds the same pages (its share of heads) */
        kvp_ctl_json_open(&j, "devices", '[');
        for (uint32_t g = 0; g < p->num_devices && g < KVP_CLIENT_MAX_DEVICES; g++) {
            kvp_ctl_json_open(&j, NULL, '{');
            kvp_ctl_json_u64(&j, "index", g);
            kvp_ctl_json_i64(&j, "cuda_device", p->backend == 1 ? p->device_ids[g] : -1);
            kvp_ctl_json_u64(&j, "heads_begin", (uint64_t)g * p->heads_per_device);
            kvp_ctl_json_u64(&j, "heads_end", (uint64_t)(g + 1) * p->heads_per_device);
            kvp_ctl_json_u64(&j, "used_bytes", (uint64_t)s->used_pages * s->page_bytes);
            kvp_ctl_json_u64(&j, "capacity_bytes", (uint64_t)s->num_pages * s->page_bytes);
            kvp_ctl_json_close(&j, '}');
        }
        kvp_ctl_json_close(&j, ']');
        /* the prefix cache's host tier (issue #28): zeros and enabled false without one */
        kvp_ctl_json_open(&j, "host_tier", '{');
        kvp_ctl_json_bool(&j, "enabled", d->cache.host_bytes_total > 0);
        kvp_ctl_json_u64(&j, "bytes_total", d->cache.host_bytes_total);
        kvp_ctl_json_u64(&j, "bytes_ready", d->cache.host_bytes_ready);
        kvp_ctl_json_u64(&j, "pages", d->cache.host_pages);
        kvp_ctl_json_u64(&j, "slots", d->cache.host_slots);
        kvp_ctl_json_close(&j, '}');
        kvp_ctl_json_u64(&j, "uptime_ms", s->uptime_ms);
        kvp_ctl_json_bool(&j, "pool_shared_across_uids", d->pool_shared_across_uids);
        kvp_ctl_json_double(&j, "rtt_us", (double)rtt_ns / 1000.0);
        kvp_ctl_json_close(&j, '}');
    } else {
        const char *ver = kvp_client_server_version(x->c);
        printf("socket       %s\n", kvp_ctl_safe(x->o->socket_path, b3, sizeof(b3)));
        printf("daemon       kvpoold %s, protocol %u, session %llu\n",
               ver[0] ? kvp_ctl_safe(ver, b1, sizeof(b1)) : "(unknown version)",
               kvp_client_protocol_version(), (unsigned long long)kvp_client_session_id(x->c));
        printf("backend      %s, %u device%s\n", backend_name(p->backend), p->num_devices,
               p->num_devices == 1 ? "" : "s");
        printf("geometry     %u layers, %u pages x %u tokens, %u kv heads x %u, %s, %s, %s\n",
               p->num_layers, p->num_pages, p->page_size, p->num_kv_heads, p->head_dim,
               dtype_name(p->dtype), layout_name(p->layout), storage_name(p->storage));
        printf("pool         %s per device, %s per page\n",
               kvp_ctl_fmt_bytes(p->pool_bytes, b1, 64), kvp_ctl_fmt_bytes(s->page_bytes, b2, 64));
        printf("usage        %u/%u pages used (%.1f%%), %u free, %u shared\n", s->used_pages,
               s->num_pages, s->num_pages ? 100.0 * s->used_pages / s->num_pages : 0.0,
               s->free_pages, s->shared_pages);
        const int each_device = p->num_devices > 1 || x->o->wide;
        for (uint32_t g = 0; each_device && g < p->num_devices && g < KVP_CLIENT_MAX_DEVICES; g++) {
            char c[16] = "";
            if (p->backend == 1)
                snprintf(c, sizeof(c), " (cuda %d)", p->device_ids[g]);
            printf("  device %u%s heads %u..%u: %s of %s\n", g, c, g * p->heads_per_device,
                   (g + 1) * p->heads_per_device - 1,
                   kvp_ctl_fmt_bytes((uint64_t)s->used_pages * s->page_bytes, b1, 64),
                   kvp_ctl_fmt_bytes((uint64_t)s->num_pages * s->page_bytes, b2, 64));
        }
        if (d->cache.host_bytes_total > 0) /* issue #28: allocated and pinned in the background */
            printf("host tier    %s of %s pinned, %u page%s\n",
                   kvp_ctl_fmt_bytes(d->cache.host_bytes_ready, b1, 64),
                   kvp_ctl_fmt_bytes(d->cache.host_bytes_total, b2, 64), d->cache.host_pages,
                   d->cache.host_pages == 1 ? "" : "s");
        printf("sequences    %u (%llu tokens) in %u namespace%s\n", s->num_seqs,
               (unsigned long long)s->num_tokens, (unsigned)kvp_ctl_ns_total(d),
               kvp_ctl_ns_total(d) == 1 ? "" : "s");
        printf("clients      %u\n", s->num_clients);
        if (d->pool_shared_across_uids) /* issue #15: the pool is one trust domain */
            printf("warning      pool memory shared across uids (see access.pool_uids)\n");
        printf("uptime       %s\n", kvp_ctl_fmt_duration(s->uptime_ms, b1, sizeof(b1)));
        printf("rtt          %.1f us\n", (double)rtt_ns / 1000.0);
    }
    free(st);
    return EXIT_OK;
}

int kvp_ctl_cmd_pool(ctl_t *x)
{
    int rc = kvp_ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    kvp_pool_info_t pi;
    rc = kvp_client_get_pool_info(x->c, &pi);
    if (rc)
        return kvp_ctl_report(x, rc, "pool");
    const kvp_pool_info_t *p = &pi;
    /* the device ordinals the daemon sends: those of a cuda pool's devices, none for host */
    uint32_t num_ids = p->backend != 0 ? p->num_devices : 0;
    if (num_ids > KVP_CLIENT_MAX_DEVICES)
        num_ids = KVP_CLIENT_MAX_DEVICES;
    char b1[64];
    if (x->o->json) {
        kvp_ctl_json_t j = {.f = stdout};
        kvp_ctl_json_open(&j, NULL, '{');
        kvp_ctl_json_str(&j, "backend", backend_name(p->backend));
        json_geometry(&j, p);
        kvp_ctl_json_u64(&j, "pool_bytes", p->pool_bytes);
        kvp_ctl_json_u64(&j, "layer_bytes", p->layer_bytes);
        kvp_ctl_json_u64(&j, "v_offset_bytes", p->v_offset_bytes);
        kvp_ctl_json_i64(&j, "stride_page", p->stride_page);
        kvp_ctl_json_i64(&j, "stride_n", p->stride_n);
        kvp_ctl_json_i64(&j, "stride_h", p->stride_h);
        kvp_ctl_json_u64(&j, "elem_bytes", p->elem_bytes);
        kvp_ctl_json_u64(&j, "heads_per_device", p->heads_per_device);
        kvp_ctl_json_open(&j, "device_ids", '[');
        for (uint32_t i = 0; i < num_ids; i++)
            kvp_ctl_json_i64(&j, NULL, p->device_ids[i]);
        kvp_ctl_json_close(&j, ']');
        kvp_ctl_json_u64(&j, "map_granularity", p->map_granularity);
        kvp_ctl_json_close(&j, '}');
        return EXIT_OK;
    }
    printf("backend            %s\n", backend_name(p->backend));
    printf("devices            %u", p->num_devices);
    for (uint32_t i = 0; i < num_ids; i++)
        printf("%s%d", i ? "," : " (cuda ", p->device_ids[i]);
    printf("%s\n", num_ids ? ")" : "");
    printf("layers             %u\n", p->num_layers);
    printf("pages              %u x %u tokens\n", p->num_pages, p->page_size);
    printf("kv heads           %u (%u per device) x head_dim %u\n", p->num_kv_heads,
           p->heads_per_device, p->head_dim);
    printf("dtype              %s (%u bytes)\n", dtype_name(p->dtype), p->elem_bytes);
    printf("layout             %s, %s K/V\n", layout_name(p->layout), storage_name(p->storage));
    printf("pool bytes         %llu (%s per device)\n", (unsigned long long)p->pool_bytes,
           kvp_ctl_fmt_bytes(p->pool_bytes, b1, sizeof(b1)));
    printf("layer bytes        %llu\n", (unsigned long long)p->layer_bytes);
    printf("v offset bytes     %llu\n", (unsigned long long)p->v_offset_bytes);
    printf("strides            page %lld, n %lld, h %lld (elements)\n", (long long)p->stride_page,
           (long long)p->stride_n, (long long)p->stride_h);
    if (p->map_granularity)
        printf("map granularity    %s\n", kvp_ctl_fmt_bytes(p->map_granularity, b1, sizeof(b1)));
    return EXIT_OK;
}

typedef struct {
    char ns[KVP_CLIENT_NAME_BYTES];
    kvp_seq_info_t info;
} seq_row_t;

/* seqs: one sequence and its namespace */
static const kvp_ctl_col_t seq_cols[] = {
    {"NAMESPACE", "namespace", 'l', SHOW_PLAIN, FIELD(seq_row_t, ns)},
    {"SEQ_ID", "seq_id", 'r', SHOW_PLAIN, FIELD(seq_row_t, info.seq_id)},
    {"TOKENS", "num_tokens", 'r', SHOW_PLAIN, FIELD(seq_row_t, info.num_tokens)},
    {"PAGES", "num_pages", 'r', SHOW_PLAIN, FIELD(seq_row_t, info.num_pages)},
    {"SHARED", "shared_pages", 'r', SHOW_PLAIN, FIELD(seq_row_t, info.shared_pages)},
    {"IDLE", "idle_ms", 'r', SHOW_DURATION, FIELD(seq_row_t, info.idle_ms)},
    {"IDLE_MS", NULL, 'r', SHOW_PLAIN, FIELD(seq_row_t, info.idle_ms), .wide = 1},
};
static const kvp_ctl_record_t seq_record = RECORD(seq_cols, seq_row_t);

int kvp_ctl_cmd_seqs(ctl_t *x)
{
    int rc = kvp_ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    /* which namespaces: the one asked for, or every one the daemon reports */
    kvp_ctl_stats_t *st = calloc(1, sizeof(*st));
    kvp_seq_info_t *page = malloc(SEQS_PAGE * sizeof(*page));
    if (!st || !page) {
        free(page);
        free(st);
        return kvp_ctl_report(x, KVP_ENOMEM, "seqs");
    }
    const kvp_daemon_stats_t *d = &st->s;
    if (x->o->ns) {
        snprintf(st->namespaces[0].name, sizeof(st->namespaces[0].name), "%s", x->o->ns);
        st->s.num_namespaces = 1;
    } else {
        rc = kvp_ctl_get_stats(x, st);
        if (rc) {
            free(page);
            free(st);
            return kvp_ctl_report(x, rc, "stats");
        }
    }
    seq_row_t *rows = NULL;
    size_t nrows = 0, cap = 0;
    int truncated = 0;
    /* the daemon listed only some namespaces (Stats holds 64): their sequences are all we
     * can read, and the answer says it is not complete */
    const int ns_truncated = d->namespaces_truncated;
    for (uint32_t i = 0; i < d->num_namespaces && !truncated; i++) {
        uint32_t cursor = 0;
        do {
            uint32_t want = SEQS_PAGE, got = 0, next = 0;
            if (x->o->limit && x->o->limit - nrows < SEQS_PAGE)
                want = (uint32_t)(x->o->limit - nrows) + 1; /* +1: learn if there is more */
            rc =
                kvp_client_list_seqs(x->c, st->namespaces[i].name, cursor, page, want, &got, &next);
            if (rc) {
                free(rows);
                free(page);
                free(st);
                return kvp_ctl_report(x, rc, "list sequences");
            }
            for (uint32_t k = 0; k < got; k++) {
                if (x->o->limit && nrows == x->o->limit) {
                    truncated = 1;
                    break;
                }
                if (nrows == cap) {
                    cap = cap ? 2 * cap : 256;
                    seq_row_t *nr = realloc(rows, cap * sizeof(*rows));
                    if (!nr) {
                        free(rows);
                        free(page);
                        free(st);
                        return kvp_ctl_report(x, KVP_ENOMEM, "seqs");
                    }
                    rows = nr;
                }
                memcpy(rows[nrows].ns, st->namespaces[i].name, sizeof(rows[nrows].ns));
                rows[nrows].info = page[k];
                nrows++;
            }
            if (x->o->limit && nrows == x->o->limit && next)
                truncated = 1;
            /* a cursor that does not move, or an empty page, would loop forever */
            if (next == cursor || got == 0)
                break;
            cursor = next;
        } while (cursor && !truncated);
    }

    char b1[128];
    if (x->o->json) {
        kvp_ctl_json_t j = {.f = stdout};
        kvp_ctl_json_open(&j, NULL, '{');
        kvp_ctl_json_records(&j, "sequences", &seq_record, rows, nrows, NULL);
        kvp_ctl_json_u64(&j, "count", nrows);
        kvp_ctl_json_bool(&j, "truncated", truncated || ns_truncated);
        kvp_ctl_json_bool(&j, "namespaces_truncated", ns_truncated);
        kvp_ctl_json_close(&j, '}');
    } else if (nrows == 0) {
        fprintf(stderr, "no sequences%s%s\n", x->o->ns ? " in namespace " : "",
                x->o->ns ? kvp_ctl_safe(x->o->ns, b1, sizeof(b1)) : "");
    } else {
        kvp_ctl_table_records(stdout, x->o->wide, x->o->no_headers, &seq_record, rows, nrows, NULL);
        if (truncated) {
            fflush(stdout); /* the note comes after the table, also on a shared terminal */
            fprintf(stderr, "(stopped at --limit %u)\n", x->o->limit);
        }
        if (ns_truncated) {
            fflush(stdout);
            fprintf(stderr,
                    "(incomplete: the daemon listed %u of %u namespaces; use --namespace)\n",
                    (unsigned)d->num_namespaces, (unsigned)kvp_ctl_ns_total(d));
        }
    }
    free(rows);
    free(page);
    free(st);
    return EXIT_OK;
}

/* clients: one session; ctx is kvpoolctl's own session id (marked "*" in the table) */
static void client_session_cell(const void *rec, const void *ctx, char *buf, size_t len)
{
    const kvp_session_info_t *ci = rec;
    snprintf(buf, len, "%llu%s", (unsigned long long)ci->session_id,
             ci->session_id == *(const uint64_t *)ctx ? "*" : "");
}

static void client_self(const void *rec, const void *ctx, kvp_ctl_col_val_t *v)
{
    v->u = ((const kvp_session_info_t *)rec)->session_id == *(const uint64_t *)ctx;
}

static const kvp_ctl_col_t client_cols[] = {
    {"SESSION", "session_id", 'r', SHOW_CUSTOM, FIELD(kvp_session_info_t, session_id),
     .cell = client_session_cell},
    {"NAMESPACE", "namespace", 'l', SHOW_PLAIN, FIELD(kvp_session_info_t, ns)},
    {"NAME", "client_name", 'l', SHOW_PLAIN, FIELD(kvp_session_info_t, client_name)},
    {"PID", "pid", 'r', SHOW_PLAIN, FIELD(kvp_session_info_t, pid)},
    {"UID", "uid", 'r', SHOW_PLAIN, FIELD(kvp_session_info_t, uid)},
    {"GID", "gid", 'r', SHOW_PLAIN, FIELD(kvp_session_info_t, gid)},
    {"REQUESTS", "requests", 'r', SHOW_PLAIN, FIELD(kvp_session_info_t, requests)},
    {NULL, "connected_ms", 'r', SHOW_PLAIN, FIELD(kvp_session_info_t, connected_ms)},
    {"BUFFERS", "buffers", 'r', SHOW_PLAIN, FIELD(kvp_session_info_t, buffers)},
    {"AGE", NULL, 'r', SHOW_DURATION, FIELD(kvp_session_info_t, connected_ms)},
    {NULL, "self", 'l', SHOW_PLAIN, .type = COL_BOOL, .get = client_self},
    {"CONNECTED_MS", NULL, 'r', SHOW_PLAIN, FIELD(kvp_session_info_t, connected_ms), .wide = 1},
};
static const kvp_ctl_record_t client_record = RECORD(client_cols, kvp_session_info_t);

int kvp_ctl_cmd_clients(ctl_t *x)
{
    int rc = kvp_ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    kvp_session_info_t *l = malloc(KVP_CLIENT_MAX_SESSIONS * sizeof(*l));
    if (!l)
        return kvp_ctl_report(x, KVP_ENOMEM, "list clients");
    uint32_t n = 0;
    rc = kvp_client_list_clients(x->c, l, KVP_CLIENT_MAX_SESSIONS, &n);
    if (rc) {
        free(l);
        return kvp_ctl_report(x, rc, "list clients");
    }
    if (x->o->ns) { /* the sessions attached to NS */
        uint32_t k = 0;
        for (uint32_t i = 0; i < n; i++)
            if (strcmp(l[i].ns, x->o->ns) == 0)
                l[k++] = l[i];
        n = k;
    }
    uint64_t self = kvp_client_session_id(x->c);
    if (x->o->json) {
        kvp_ctl_json_t j = {.f = stdout};
        kvp_ctl_json_open(&j, NULL, '{');
        kvp_ctl_json_records(&j, "clients", &client_record, l, n, &self);
        kvp_ctl_json_close(&j, '}');
    } else {
        kvp_ctl_table_records(stdout, x->o->wide, x->o->no_headers, &client_record, l, n, &self);
    }
    free(l);
    return EXIT_OK;
}

/* transfers: one transfer (a set shows its first sequence and how many more) */
static void transfer_seq_cell(const void *rec, const void *ctx, char *buf, size_t len)
{
    const kvp_transfer_info_t *t = rec;
    (void)ctx;
    if (t->num_seqs > 1)
        snprintf(buf, len, "%llu+%u", (unsigned long long)t->seq_id, t->num_seqs - 1);
    else
        snprintf(buf, len, "%llu", (unsigned long long)t->seq_id);
}

static const kvp_ctl_col_t transfer_cols[] = {
    {"TRANSFER", "transfer_id", 'r', SHOW_PLAIN, FIELD(kvp_transfer_info_t, transfer_id)},
    {"DIR", "direction", 'l', SHOW_RAW, FIELD(kvp_transfer_info_t, direction)},
    {"STATE", "state", 'l', SHOW_RAW, FIELD(kvp_transfer_info_t, state)},
    {"PEER", "peer", 'l', SHOW_OR_DASH, FIELD(kvp_transfer_info_t, peer)},
    {"NAMESPACE", "namespace", 'l', SHOW_PLAIN, FIELD(kvp_transfer_info_t, ns)},
    {"SEQ", "seq_id", 'l', SHOW_CUSTOM, FIELD(kvp_transfer_info_t, seq_id),
     .cell = transfer_seq_cell},
    {NULL, "num_seqs", 'r', SHOW_PLAIN, FIELD(kvp_transfer_info_t, num_seqs)},
    {"TOKENS", "num_tokens", 'r', SHOW_PLAIN, FIELD(kvp_transfer_info_t, num_tokens)},
    {"BYTES", "bytes", 'r', SHOW_BYTES, FIELD(kvp_transfer_info_t, bytes)},
    {"ELAPSED", "elapsed_ms", 'r', SHOW_DURATION, FIELD(kvp_transfer_info_t, elapsed_ms)},
    {"MESSAGE", "message", 'l', SHOW_OR_DASH, FIELD(kvp_transfer_info_t, message)},
    {"NUM_SEQS", NULL, 'r', SHOW_PLAIN, FIELD(kvp_transfer_info_t, num_seqs), .wide = 1},
    {"ELAPSED_MS", NULL, 'r', SHOW_PLAIN, FIELD(kvp_transfer_info_t, elapsed_ms), .wide = 1},
};
static const kvp_ctl_record_t transfer_record = RECORD(transfer_cols, kvp_transfer_info_t);

int kvp_ctl_cmd_transfers(ctl_t *x)
{
    int rc = kvp_ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    kvp_transfer_info_t l[KVP_CLIENT_MAX_TRANSFERS];
    uint32_t n = 0;
    rc = kvp_client_list_transfers(x->c, l, KVP_CLIENT_MAX_TRANSFERS, &n);
    if (rc)
        return kvp_ctl_report(x, rc, "list transfers");
    if (x->o->ns) { /* the transfers of NS */
        uint32_t k = 0;
        for (uint32_t i = 0; i < n; i++)
            if (strcmp(l[i].ns, x->o->ns) == 0)
                l[k++] = l[i];
        n = k;
    }
    if (x->o->json) {
        kvp_ctl_json_t j = {.f = stdout};
        kvp_ctl_json_open(&j, NULL, '{');
        kvp_ctl_json_records(&j, "transfers", &transfer_record, l, n, NULL);
        kvp_ctl_json_close(&j, '}');
        return EXIT_OK;
    }
    kvp_ctl_table_records(stdout, x->o->wide, x->o->no_headers, &transfer_record, l, n, NULL);
    return EXIT_OK;
}

int kvp_ctl_cmd_audit(ctl_t *x)
{
    int rc = kvp_ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    int ok = 0;
    char message[KVP_CLIENT_AUDIT_MESSAGE_BYTES];
    rc = kvp_client_audit_report(x->c, &ok, message, sizeof(message));
    if (rc)
        return kvp_ctl_report(x, rc, "audit");
    char b1[300];
    if (x->o->json) {
        kvp_ctl_json_t j = {.f = stdout};
        kvp_ctl_json_open(&j, NULL, '{');
        kvp_ctl_json_bool(&j, "ok", ok);
        kvp_ctl_json_str(&j, "message", message);
        kvp_ctl_json_close(&j, '}');
    } else if (ok) {
        printf("ok\n");
    } else {
        printf("audit failed: %s\n", message[0] ? kvp_ctl_safe(message, b1, sizeof(b1)) : "?");
    }
    return ok ? EXIT_OK : EXIT_SERVER;
}

int kvp_ctl_cmd_metrics(ctl_t *x)
{
    int rc = kvp_ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    char *text = malloc(METRICS_TEXT_BYTES);
    if (!text)
        return kvp_ctl_report(x, KVP_ENOMEM, "metrics");
    size_t len = 0;
    rc = kvp_client_metrics(x->c, text, METRICS_TEXT_BYTES, &len);
    if (rc) {
        free(text);
        return kvp_ctl_report(x, rc, "metrics");
    }
    if (x->o->json) {
        kvp_ctl_json_t j = {.f = stdout};
        kvp_ctl_json_open(&j, NULL, '{');
        kvp_ctl_json_str(&j, "text", text);
        kvp_ctl_json_close(&j, '}');
    } else {
        fwrite(text, 1, len, stdout);
        if (len && text[len - 1] != '\n')
            putchar('\n');
    }
    free(text);
    return EXIT_OK;
}

int kvp_ctl_cmd_top(ctl_t *x)
{
    int rc = kvp_ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    kvp_top_opts_t t = {
        .socket_path = x->o->socket_path,
        .interval_ms = x->o->interval_ms,
        .count = x->o->count,
        .ns = x->o->ns,
    };
    return kvp_ctl_top(x->c, &t);
}

int kvp_ctl_cmd_health(ctl_t *x)
{
    char why[512] = "";
    uint64_t rtt_ns = 0;
    int healthy = 0;
    if (kvp_ctl_connect(x, why, sizeof(why)) == 0) {
        int rc = kvp_client_ping(x->c, &rtt_ns);
        if (rc == 0)
            rc = kvp_client_audit(x->c);
        if (rc == 0)
            healthy = 1;
        else if (rc == KVP_EAUDIT)
            snprintf(why, sizeof(why), "audit failed: %s", kvp_client_last_error(x->c));
        else
            snprintf(why, sizeof(why), "%s", kvp_client_last_error(x->c));
    }
    if (x->o->json) {
        kvp_ctl_json_t j = {.f = stdout};
        kvp_ctl_json_open(&j, NULL, '{');
        kvp_ctl_json_bool(&j, "healthy", healthy);
        kvp_ctl_json_str(&j, "reason", why);
        if (healthy)
            kvp_ctl_json_double(&j, "rtt_us", (double)rtt_ns / 1000.0);
        kvp_ctl_json_close(&j, '}');
    } else if (healthy) {
        printf("ok\n");
    } else {
        char b[600];
        printf("unhealthy: %s\n", kvp_ctl_safe(why, b, sizeof(b)));
    }
    return healthy ? EXIT_OK : EXIT_SERVER;
}
