/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvpoolctl.c - the operator CLI of kvpoold: status, stats, pool, seqs, clients, audit,
 * metrics, health, top (kvpoolctl_top.c), cache, help. It is a plain libkvpool client (an
 * observer: attached to no namespace unless --join names one, pool not mapped) that reads through
 * kvp_client_call_raw and prints aligned tables for people (-o table, -o wide with more columns,
 * --no-headers for scripts) or one JSON object (-o json, --json). As in kubectl, -n NS is the
 * namespace a command acts on or filters by, in every command that has one. It changes nothing
 * in the daemon but for `cache flush`, a mutating call observers may not make: that one joins a
 * namespace (-n, default "kvpoolctl", which only operators may attach). The command and option
 * tables below also drive `help CMD`, `CMD --help` and the hidden `__complete` that the bash
 * completion (deploy/completion/kvpoolctl.bash) asks, so the three cannot drift apart. Exit
 * codes: 0 ok, 1 the daemon answered with an error, 2 usage error, 3 daemon unreachable or timed
 * out; `health` answers only 0 or 1, as container and service health checks expect.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>
#include <time.h>

#include "kvp_utf8.h"
#include "kvp_wire.h"
#include "kvpool.h"
#include "kvpoolctl_top.h"

enum {
    EXIT_OK = 0,
    EXIT_SERVER = 1,
    EXIT_USAGE = 2,
    EXIT_UNREACHABLE = 3,
};

#define METRICS_TEXT_BYTES (4u << 20)
#define SEQS_PAGE          256u
/* The namespace `cache flush` joins when --namespace names none (a reserved name: root and the
 * daemon's uid only). */
#define FLUSH_NS "kvpoolctl"
/* Scopes one Stats lists (CacheStats.scopes, kvpool.options). */
#define MAX_SCOPES (sizeof(((kvpool_CacheStats *)0)->scopes) / sizeof(kvpool_CacheScopeStats))

typedef struct {
    const char *socket_path;
    char socket_buf[sizeof(((struct sockaddr_un *)0)->sun_path)];
    const char *ns;   /* -n: the namespace the command acts on or filters by; NULL = all */
    const char *join; /* the namespace the session joins (--join; cache flush: -n); NULL =
                         an observer */
    uint32_t timeout_ms;
    int timeout_set;
    int json;                /* -o json, --json */
    int wide;                /* -o wide */
    int output_set;          /* -o, --json or --no-headers given */
    int no_headers;          /* --no-headers: tables without their title row */
    uint32_t limit;          /* seqs: most rows, 0 = all */
    uint32_t interval_ms;    /* top: between refreshes; cache: between its two reads */
    int interval_set;        /* --interval / --watch given */
    uint32_t count;          /* top: refreshes, 0 = until quit */
    const char *cache_scope; /* Hello.cache_scope of the namespace joined (NULL: its own) */
    int flush;               /* cache flush */
    const char *flush_scope; /* cache flush --scope */
    int flush_all;           /* cache flush --all */
} opts_t;

typedef struct {
    opts_t *o;
    const char *cmd;
    kvp_client_t *c;
    kvpool_Request req;
    kvpool_Response *resp; /* heap: the list bodies are large */
    char err[256];         /* a failure found here rather than by libkvpool */
} ctl_t;

/* ---- small formatting helpers ------------------------------------------------------------ */

static void die_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

/* ---- commands, options and their help ------------------------------------------------------
 * One table of commands and one of options drive the help (`kvpoolctl --help`, `help CMD`,
 * `CMD --help`), getopt's long options and the hidden `__complete` the bash completion asks.
 * An option's mask says which commands take it; one taken before the command (global) is
 * checked against the command once it is known. */

enum {
    C_STATUS,
    C_STATS,
    C_POOL,
    C_SEQS,
    C_CLIENTS,
    C_TRANSFERS,
    C_AUDIT,
    C_METRICS,
    C_HEALTH,
    C_TOP,
    C_CACHE,
    C_HELP,
    NUM_CMDS
};

#define M(c)  (1u << (c))
#define M_ALL ((1u << NUM_CMDS) - 1)
/* -n: the commands that act on or filter by a namespace */
#define M_NS (M(C_STATS) | M(C_SEQS) | M(C_CLIENTS) | M(C_TRANSFERS) | M(C_TOP) | M(C_CACHE))
/* -o, --json, --no-headers: every command that prints a table or a record */
#define M_OUT    (M_ALL & ~(M(C_TOP) | M(C_HELP)))
#define M_DAEMON (M_ALL & ~M(C_HELP))

static const struct {
    const char *name;
    const char *doc; /* its lines of the command list */
} cmd_doc[NUM_CMDS] = {
    [C_STATUS] = {"status",
                  "  status                 daemon, backend, geometry, usage and round-trip time\n"
                  "                         (wide: every device, also the only one)\n"},
    [C_STATS] = {"stats",
                 "  stats [-n NS]          pool and per-namespace statistics (-n: namespace NS\n"
                 "                         only; wide: dedup columns, the cache's scopes)\n"},
    [C_POOL] = {"pool", "  pool                   pool description (geometry, strides, sizes)\n"},
    [C_SEQS] = {"seqs",
                "  seqs [-n NS] [--limit N]\n"
                "                         sequences of namespace NS (default: every namespace;\n"
                "                         wide: IDLE_MS)\n"},
    [C_CLIENTS] = {"clients",
                   "  clients [-n NS]        connected sessions (-n: those attached to NS; wide:\n"
                   "                         CONNECTED_MS)\n"},
    [C_TRANSFERS] =
        {"transfers",
         "  transfers [-n NS]      KV transfers between daemons: in flight, then recent\n"
         "                         (-n: those of NS; wide: NUM_SEQS, ELAPSED_MS)\n"},
    [C_AUDIT] = {"audit", "  audit                  run the daemon's invariant audit\n"},
    [C_METRICS] = {"metrics", "  metrics                Prometheus metrics text\n"},
    [C_HEALTH] =
        {"health",
         "  health                 exit 0 when the daemon answers and its audit is clean\n"},
    [C_TOP] =
        {"top",
         "  top [--interval SEC] [--count N] [-n NS]\n"
         "                         live view: usage per device, rates, latency percentiles,\n"
         "                         top namespaces (-n: NS only; 'q' or Ctrl-C quits); one\n"
         "                         key=value line per refresh when stdout is not a terminal\n"},
    [C_CACHE] =
        {"cache",
         "  cache [--interval SEC | -w, --watch SEC]\n"
         "                         prefix cache: cached, pinned and indexed pages, pins,\n"
         "                         hit rate (over SEC seconds between two reads; without\n"
         "                         it since start), evictions by reason, one row per scope\n"
         "                         (-n: the row of NS's private scope ns:NS, or of the\n"
         "                         --cache-scope named; wide: the scopes' lifetime totals)\n"
         "  cache flush [--scope S | --all]\n"
         "                         drop every cached page nobody holds (pinned and held\n"
         "                         pages stay) in scope S, in every scope (--all), or, with\n"
         "                         neither, in the scope of namespace NS of -n; prints the\n"
         "                         pages dropped. A mutating call: it joins namespace NS of\n"
         "                         -n (default \"kvpoolctl\", which only root and the\n"
         "                         daemon's uid may join; others name their own with -n,\n"
         "                         and --cache-scope when it shares a scope); --scope and\n"
         "                         --all are for those operators\n"},
    [C_HELP] = {"help",
                "  help [CMD]             the command list, or the usage of command CMD (the\n"
                "                         same as kvpoolctl CMD --help)\n"},
};

enum {
    OPT_JSON = 256,
    OPT_VERSION,
    OPT_LIMIT,
    OPT_INTERVAL,
    OPT_COUNT,
    OPT_SCOPE,
    OPT_ALL,
    OPT_CACHE_SCOPE,
    OPT_NO_HEADERS,
    OPT_JOIN,
};

static const struct {
    const char *name; /* the long option */
    int has_arg;
    int val;         /* the short letter, or OPT_* */
    int global;      /* also taken before the command */
    unsigned cmds;   /* the commands that take it */
    const char *doc; /* its lines of the help */
} opt_doc[] = {
    {"socket", required_argument, 's', 1, M_ALL,
     "  -s, --socket PATH      daemon socket (default: $KVPOOL_SOCKET, else the\n"
     "                         standard path)\n"},
    {"timeout", required_argument, 't', 1, M_ALL,
     "  -t, --timeout MS       per-call timeout in milliseconds (default 10000)\n"},
    {"namespace", required_argument, 'n', 1, M_NS,
     "  -n, --namespace NS     the namespace the command acts on or filters by (stats,\n"
     "                         seqs, clients, transfers, top: its rows only; cache: its\n"
     "                         private scope's row; cache flush: joins NS, flushes its\n"
     "                         scope); daemon-wide commands refuse it\n"},
    {"output", required_argument, 'o', 1, M_OUT,
     "  -o, --output FORMAT    json (the same as --json), table (the default) or wide\n"
     "                         (the table with the command's extra columns)\n"},
    {"json", no_argument, OPT_JSON, 1, M_OUT,
     "      --json             print one JSON object instead of tables (-o json)\n"},
    {"no-headers", no_argument, OPT_NO_HEADERS, 1, M_OUT,
     "      --no-headers       tables without their title row (for scripts)\n"},
    {"join", required_argument, OPT_JOIN, 1, M_DAEMON,
     "      --join NS          join namespace NS instead of reading as an observer (a\n"
     "                         Hello that creates NS when absent, its lease unchanged)\n"},
    {"cache-scope", required_argument, OPT_CACHE_SCOPE, 1, M_DAEMON,
     "      --cache-scope NAME the cache scope the joined namespace names in Hello (with\n"
     "                         --join, or cache flush -n NS; default its private scope)\n"},
    {"limit", required_argument, OPT_LIMIT, 0, M(C_SEQS),
     "      --limit N          seqs: at most N rows\n"},
    {"interval", required_argument, OPT_INTERVAL, 0, M(C_TOP) | M(C_CACHE),
     "      --interval SEC     top: between refreshes (default 2); cache: between its\n"
     "                         two reads\n"},
    {"watch", required_argument, 'w', 0, M(C_CACHE),
     "  -w, --watch SEC        cache: the same as --interval\n"},
    {"count", required_argument, OPT_COUNT, 0, M(C_TOP),
     "      --count N          top: refreshes before it exits (default: until 'q')\n"},
    {"scope", required_argument, OPT_SCOPE, 0, M(C_CACHE),
     "      --scope S          cache flush: the scope to flush\n"},
    {"all", no_argument, OPT_ALL, 0, M(C_CACHE),
     "      --all              cache flush: every scope\n"},
    {"help", no_argument, 'h', 1, M_ALL,
     "  -h, --help             this help (after a command: that command's usage)\n"},
    {"version", no_argument, OPT_VERSION, 1, M_ALL, "      --version          print the version\n"},
};
#define NUM_OPTS (sizeof(opt_doc) / sizeof(opt_doc[0]))

/* The values of -o, in the order the completion offers them. */
static const char *const output_formats[] = {"json", "wide", "table"};

static const char usage_exit[] =
    "exit status: 0 ok, 1 the daemon answered with an error, 2 usage error,\n"
    "3 daemon unreachable or timed out (health: 0 healthy, 1 anything else)\n";

/* Index of command name, or -1. */
static int cmd_index(const char *name)
{
    for (int i = 0; i < NUM_CMDS; i++)
        if (strcmp(name, cmd_doc[i].name) == 0)
            return i;
    return -1;
}

/* The whole help: every command, every option. */
static void usage(FILE *f)
{
    fputs("usage: kvpoolctl [options] <command> [command options]\n\ncommands:\n", f);
    for (int i = 0; i < NUM_CMDS; i++)
        fputs(cmd_doc[i].doc, f);
    fputs("\noptions (those marked with a command name go after the command; the others\n"
          "also before it):\n",
          f);
    for (size_t i = 0; i < NUM_OPTS; i++)
        fputs(opt_doc[i].doc, f);
    fputc('\n', f);
    fputs(usage_exit, f);
}

/* One command's help: its lines of the command list and the options it takes. */
static void cmd_usage(FILE *f, int ci)
{
    fprintf(f, "usage: kvpoolctl [options] %s [command options]\n\n", cmd_doc[ci].name);
    fputs(cmd_doc[ci].doc, f);
    fputs("\noptions:\n", f);
    for (size_t i = 0; i < NUM_OPTS; i++)
        if (opt_doc[i].cmds & M(ci))
            fputs(opt_doc[i].doc, f);
    fputc('\n', f);
    fputs(usage_exit, f);
}

static void die_usage(const char *fmt, ...)
{
    va_list ap;
    fputs("kvpoolctl: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputs("\nTry 'kvpoolctl --help'.\n", stderr);
    exit(EXIT_USAGE);
}

/* Strict decimal uint32 in [lo, hi]. */
static uint32_t parse_u32(const char *what, const char *s, uint32_t lo, uint32_t hi)
{
    char *end;
    if (!s || !*s || *s == '-' || *s == '+' || *s == ' ')
        die_usage("%s: '%s' is not a number", what, s ? s : "");
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v < lo || v > hi)
        die_usage("%s: '%s' is not a number in %u..%u", what, s, lo, hi);
    return (uint32_t)v;
}

static const char *fmt_bytes(uint64_t b, char *buf, size_t len)
{
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double v = (double)b;
    unsigned u = 0;
    while (v >= 1024.0 && u + 1 < sizeof(units) / sizeof(units[0])) {
        v /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%llu B", (unsigned long long)b);
    else
        snprintf(buf, len, "%.1f %s", v, units[u]);
    return buf;
}

static const char *fmt_duration(uint64_t ms, char *buf, size_t len)
{
    uint64_t s = ms / 1000;
    if (ms < 1000)
        snprintf(buf, len, "%llums", (unsigned long long)ms);
    else if (s < 60)
        snprintf(buf, len, "%.1fs", (double)ms / 1000.0);
    else if (s < 3600)
        snprintf(buf, len, "%llum%02llus", (unsigned long long)(s / 60),
                 (unsigned long long)(s % 60));
    else if (s < 86400)
        snprintf(buf, len, "%lluh%02llum", (unsigned long long)(s / 3600),
                 (unsigned long long)(s / 60 % 60));
    else
        snprintf(buf, len, "%llud%02lluh", (unsigned long long)(s / 86400),
                 (unsigned long long)(s / 3600 % 24));
    return buf;
}

/* A ratio as a percentage with one decimal; "-" for NaN (nothing to divide). */
static const char *fmt_percent(double r, char *buf, size_t len)
{
    if (isnan(r))
        snprintf(buf, len, "-");
    else
        snprintf(buf, len, "%.1f%%", 100.0 * r);
    return buf;
}

/* hit / query, NaN when nothing was asked. */
static double ratio(uint64_t hit, uint64_t query)
{
    return query ? (double)hit / (double)query : NAN;
}

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

/* ---- JSON: one pretty-printed object, strings escaped and made valid UTF-8 --------------- */

typedef struct {
    FILE *f;
    int depth;
    unsigned count[16];
} json_t;

static void json_string(FILE *f, const char *str)
{
    const unsigned char *s = (const unsigned char *)str;
    fputc('"', f);
    while (*s) {
        if (*s == '"' || *s == '\\') {
            fputc('\\', f);
            fputc(*s++, f);
        } else if (*s == '\n') {
            fputs("\\n", f);
            s++;
        } else if (*s == '\t') {
            fputs("\\t", f);
            s++;
        } else if (*s < 0x20 || *s == 0x7f) {
            fprintf(f, "\\u%04x", *s++);
        } else {
            size_t n = kvp_utf8_len(s);
            if (n == 0) {
                fputs("\\ufffd", f); /* not UTF-8: JSON cannot carry the byte */
                s++;
            } else {
                fwrite(s, 1, n, f);
                s += n;
            }
        }
    }
    fputc('"', f);
}

static void j_member(json_t *j, const char *key)
{
    if (j->depth > 0) {
        if (j->count[j->depth]++)
            fputc(',', j->f);
        fprintf(j->f, "\n%*s", 2 * j->depth, "");
    }
    if (key) {
        json_string(j->f, key);
        fputs(": ", j->f);
    }
}

static void j_open(json_t *j, const char *key, char c)
{
    j_member(j, key);
    fputc(c, j->f);
    j->depth++;
    j->count[j->depth] = 0;
}

static void j_close(json_t *j, char c)
{
    unsigned had = j->count[j->depth];
    j->depth--;
    if (had)
        fprintf(j->f, "\n%*s", 2 * j->depth, "");
    fputc(c, j->f);
    if (j->depth == 0)
        fputc('\n', j->f);
}

static void j_str(json_t *j, const char *key, const char *v)
{
    j_member(j, key);
    json_string(j->f, v);
}

static void j_u64(json_t *j, const char *key, uint64_t v)
{
    j_member(j, key);
    fprintf(j->f, "%llu", (unsigned long long)v);
}

static void j_i64(json_t *j, const char *key, int64_t v)
{
    j_member(j, key);
    fprintf(j->f, "%lld", (long long)v);
}

static void j_bool(json_t *j, const char *key, int v)
{
    j_member(j, key);
    fputs(v ? "true" : "false", j->f);
}

static void j_double(json_t *j, const char *key, double v)
{
    j_member(j, key);
    fprintf(j->f, "%.3f", v);
}

/* A ratio in 0..1 with six decimals; null for NaN (JSON has no NaN). */
static void j_ratio(json_t *j, const char *key, double v)
{
    j_member(j, key);
    if (isnan(v))
        fputs("null", j->f);
    else
        fprintf(j->f, "%.6f", v);
}

/* ---- tables: columns sized to their widest cell, separated by three spaces --------------- */

typedef struct {
    unsigned ncols;
    const char *const *header;
    const char *align; /* per column: 'l' or 'r' */
    char **cells;      /* rows * ncols strings */
    size_t rows, cap;
} table_t;

/* Adds a row of t->ncols cells (copied). */
static void table_add(table_t *t, char *const *cells)
{
    if (t->rows == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 64;
        char **grown = realloc(t->cells, cap * t->ncols * sizeof(char *));
        if (!grown) {
            fputs("kvpoolctl: out of memory\n", stderr);
            exit(EXIT_SERVER);
        }
        t->cells = grown;
        t->cap = cap;
    }
    for (unsigned i = 0; i < t->ncols; i++) {
        char *cell = strdup(cells[i]);
        if (!cell) {
            fputs("kvpoolctl: out of memory\n", stderr);
            exit(EXIT_SERVER);
        }
        t->cells[t->rows * t->ncols + i] = cell;
    }
    t->rows++;
}

/* The table on f, its title row first unless no_headers. */
static void table_print(const table_t *t, FILE *f, int no_headers)
{
    size_t width[32] = {0};
    for (unsigned i = 0; i < t->ncols; i++)
        width[i] = strlen(t->header[i]);
    for (size_t r = 0; r < t->rows; r++)
        for (unsigned i = 0; i < t->ncols; i++) {
            size_t n = strlen(t->cells[r * t->ncols + i]);
            if (n > width[i])
                width[i] = n;
        }
    for (size_t r = no_headers ? 1 : 0; r <= t->rows; r++) {
        for (unsigned i = 0; i < t->ncols; i++) {
            const char *cell = r == 0 ? t->header[i] : t->cells[(r - 1) * t->ncols + i];
            int w = (int)width[i];
            int last = i + 1 == t->ncols;
            if (i)
                fputs("   ", f);
            if (t->align[i] == 'r')
                fprintf(f, "%*s", w, cell);
            else if (last)
                fputs(cell, f);
            else
                fprintf(f, "%-*s", w, cell);
        }
        fputc('\n', f);
    }
}

static void table_free(table_t *t)
{
    for (size_t i = 0; i < t->rows * t->ncols; i++)
        free(t->cells[i]);
    free(t->cells);
}

/* ---- records: one column table drives both a record's text table and its JSON ------------
 * A list record (a namespace of stats, a sequence, a client, a transfer) is described once, as
 * an array of columns: the table's title, the JSON key, how the table shows the value and
 * where the value comes from (a field of the record, its type taken from the field itself, or
 * a function for what is not one field). The table shows the columns that have a title (those
 * marked wide with -o wide only: they come last, table-only, so the JSON stays as it was), the
 * JSON the ones that have a key, each in array order; adding a field is one row. */

typedef enum { COL_U32, COL_U64, COL_I32, COL_STR, COL_BOOL, COL_F64 } col_type_t;

typedef enum {
    SHOW_PLAIN,    /* a number in decimal; text made safe for a terminal (kvp_ctl_safe) */
    SHOW_RAW,      /* text as it is: words the daemon itself writes ("export", "running") */
    SHOW_OR_DASH,  /* text made safe, "-" when empty */
    SHOW_DURATION, /* milliseconds, as fmt_duration */
    SHOW_BYTES,    /* bytes, as fmt_bytes */
    SHOW_PERCENT,  /* a ratio (COL_F64) as a percentage, "-" when NaN (JSON: null) */
    SHOW_CUSTOM,   /* the column's cell function writes it */
} col_show_t;

typedef struct {
    uint64_t u; /* COL_U32, COL_U64, COL_BOOL */
    int64_t i;  /* COL_I32 */
    double d;   /* COL_F64 (computed only) */
    const char *s;
} col_val_t;

/* Bytes of one table cell: the longest text field (127 bytes) with room to spare. */
#define CELL_BYTES 260
#define MAX_COLS   16

typedef struct {
    const char *header; /* table title; NULL: JSON only */
    const char *key;    /* JSON member; NULL: table only */
    char align;         /* table: 'l' or 'r' */
    col_show_t show;
    col_type_t type;
    size_t offset; /* of the field in the record (unless get) */
    /* computed columns; ctx is the command's (e.g. the own session id) */
    void (*get)(const void *rec, const void *ctx, col_val_t *v);
    void (*cell)(const void *rec, const void *ctx, char *buf, size_t len); /* SHOW_CUSTOM */
    int wide; /* the table shows it with -o wide only */
} col_t;

/* .offset and .type of field m of record type T; a field of another type does not compile. */
#define FIELD(T, m)                                                                                \
    .offset = offsetof(T, m),                                                                      \
    .type = _Generic(((T *)0)->m, uint32_t: COL_U32, uint64_t: COL_U64, int32_t: COL_I32,         \
                     char *: COL_STR)

typedef struct {
    const col_t *cols;
    size_t ncols;
    size_t size; /* of one record: the records are an array */
} record_t;

#define RECORD(cols, T)                                                                            \
    {                                                                                              \
        cols, sizeof(cols) / sizeof(cols[0]), sizeof(T)                                            \
    }

static void col_value(const col_t *c, const void *rec, const void *ctx, col_val_t *v)
{
    memset(v, 0, sizeof(*v));
    if (c->get) {
        c->get(rec, ctx, v);
        return;
    }
    const void *p = (const char *)rec + c->offset;
    switch (c->type) {
    case COL_U32:
        v->u = *(const uint32_t *)p;
        break;
    case COL_U64:
        v->u = *(const uint64_t *)p;
        break;
    case COL_I32:
        v->i = *(const int32_t *)p;
        break;
    case COL_STR:
        v->s = p;
        break;
    case COL_BOOL: /* computed only */
    case COL_F64:
        break;
    }
}

static void col_cell(const col_t *c, const void *rec, const void *ctx, char *buf, size_t len)
{
    col_val_t v;
    if (c->show == SHOW_CUSTOM) {
        c->cell(rec, ctx, buf, len);
        return;
    }
    col_value(c, rec, ctx, &v);
    switch (c->show) {
    case SHOW_DURATION:
        fmt_duration(v.u, buf, len);
        return;
    case SHOW_BYTES:
        fmt_bytes(v.u, buf, len);
        return;
    case SHOW_PERCENT:
        fmt_percent(v.d, buf, len);
        return;
    default:
        break;
    }
    switch (c->type) {
    case COL_U32:
    case COL_U64:
        snprintf(buf, len, "%llu", (unsigned long long)v.u);
        break;
    case COL_I32:
        snprintf(buf, len, "%lld", (long long)v.i);
        break;
    case COL_BOOL:
        snprintf(buf, len, "%s", v.u ? "true" : "false");
        break;
    case COL_F64:
        snprintf(buf, len, "%.3f", v.d);
        break;
    case COL_STR:
        if (c->show == SHOW_OR_DASH && !v.s[0])
            snprintf(buf, len, "-");
        else if (c->show == SHOW_RAW)
            snprintf(buf, len, "%s", v.s);
        else
            kvp_ctl_safe(v.s, buf, len);
        break;
    }
}

/* n records as the JSON array `key`, one object each. */
static void json_records(json_t *j, const char *key, const record_t *r, const void *recs, size_t n,
                         const void *ctx)
{
    j_open(j, key, '[');
    for (size_t k = 0; k < n; k++) {
        const void *rec = (const char *)recs + k * r->size;
        j_open(j, NULL, '{');
        for (size_t i = 0; i < r->ncols; i++) {
            const col_t *c = &r->cols[i];
            col_val_t v;
            if (!c->key)
                continue;
            col_value(c, rec, ctx, &v);
            switch (c->type) {
            case COL_U32:
            case COL_U64:
                j_u64(j, c->key, v.u);
                break;
            case COL_I32:
                j_i64(j, c->key, v.i);
                break;
            case COL_STR:
                j_str(j, c->key, v.s);
                break;
            case COL_BOOL:
                j_bool(j, c->key, v.u != 0);
                break;
            case COL_F64:
                j_ratio(j, c->key, v.d);
                break;
            }
        }
        j_close(j, '}');
    }
    j_close(j, ']');
}

/* n records as an aligned table on f, the title row first unless o->no_headers; the wide
 * columns with o->wide only. */
static void table_records(FILE *f, const opts_t *o, const record_t *r, const void *recs, size_t n,
                          const void *ctx)
{
    const char *hdr[MAX_COLS];
    char align[MAX_COLS + 1];
    const col_t *cols[MAX_COLS];
    unsigned nc = 0;
    for (size_t i = 0; i < r->ncols; i++)
        if (r->cols[i].header && (!r->cols[i].wide || o->wide)) {
            if (nc == MAX_COLS) {
                fputs("kvpoolctl: too many columns\n", stderr); /* our bug */
                abort();
            }
            hdr[nc] = r->cols[i].header;
            align[nc] = r->cols[i].align;
            cols[nc++] = &r->cols[i];
        }
    align[nc] = '\0';
    table_t t = {.ncols = nc, .header = hdr, .align = align};
    char text[MAX_COLS][CELL_BYTES];
    char *cells[MAX_COLS];
    for (size_t k = 0; k < n; k++) {
        const void *rec = (const char *)recs + k * r->size;
        for (unsigned i = 0; i < nc; i++) {
            col_cell(cols[i], rec, ctx, text[i], sizeof(text[i]));
            cells[i] = text[i];
        }
        table_add(&t, cells);
    }
    table_print(&t, f, o->no_headers);
    table_free(&t);
}

/* ---- talking to the daemon ---------------------------------------------------------------- */

/* Exit status for a failed call: transport failures mean the daemon is unreachable. */
static int exit_for(int rc)
{
    if (rc == KVP_ECLOSED || rc == KVP_ETIMEDOUT || (rc < 0 && rc > -1000))
        return EXIT_UNREACHABLE;
    return EXIT_SERVER;
}

/* Prints why `what` failed and returns the exit status. */
static int report(ctl_t *x, int rc, const char *what)
{
    const char *msg = x->err[0] ? x->err : x->c ? kvp_client_last_error(x->c) : "";
    fprintf(stderr, "kvpoolctl: %s: %s\n", what, msg[0] ? msg : kvp_strerror(rc));
    return exit_for(rc);
}

/* Connects and says Hello. Returns 0 or the exit status (message printed) unless quiet, in
 * which case the message is left in err. */
static int ctl_connect(ctl_t *x, char *err, size_t err_len)
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

/* Sends x->req (body set by the caller) and checks the answer's body. */
static int ctl_call(ctl_t *x, pb_size_t expect, kvp_reply_arrays_t *arrays)
{
    int rc = kvp_client_call_raw(x->c, &x->req, x->resp, arrays);
    if (rc)
        return rc;
    if (x->resp->which_body != expect) {
        snprintf(x->err, sizeof(x->err), "the daemon answered with body %u, expected %u",
                 (unsigned)x->resp->which_body, (unsigned)expect);
        return KVP_EPROTO;
    }
    return 0;
}

static void new_req(ctl_t *x, pb_size_t which)
{
    memset(&x->req, 0, sizeof(x->req));
    x->req.which_body = which;
}

static int get_stats(ctl_t *x, kvpool_Stats *out)
{
    new_req(x, kvpool_Request_stats_tag);
    int rc = ctl_call(x, kvpool_Response_stats_tag, NULL);
    if (rc)
        return rc;
    if (x->resp->body.stats.has_stats)
        *out = x->resp->body.stats.stats;
    else
        memset(out, 0, sizeof(*out));
    return 0;
}

/* ---- commands ----------------------------------------------------------------------------- */

static void json_geometry(json_t *j, const kvp_pool_info_t *p)
{
    j_open(j, "geometry", '{');
    j_u64(j, "num_layers", p->num_layers);
    j_u64(j, "num_pages", p->num_pages);
    j_u64(j, "page_size", p->page_size);
    j_u64(j, "num_kv_heads", p->num_kv_heads);
    j_u64(j, "head_dim", p->head_dim);
    j_str(j, "dtype", dtype_name(p->dtype));
    j_str(j, "layout", layout_name(p->layout));
    j_str(j, "storage", storage_name(p->storage));
    j_u64(j, "num_devices", p->num_devices);
    j_close(j, '}');
}

/* How many namespaces the daemon has (visible to this uid): namespaces_total, or the list's
 * length from a daemon that does not send it. */
static uint32_t ns_total(const kvpool_Stats *s)
{
    return s->namespaces_total > s->namespaces_count ? s->namespaces_total : s->namespaces_count;
}

static int cmd_status(ctl_t *x)
{
    int rc = ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    uint64_t rtt_ns = 0;
    rc = kvp_client_ping(x->c, &rtt_ns);
    if (rc)
        return report(x, rc, "ping");
    kvpool_Stats *s = malloc(sizeof(*s));
    if (!s)
        return report(x, KVP_ENOMEM, "stats");
    rc = get_stats(x, s);
    if (rc) {
        free(s);
        return report(x, rc, "stats");
    }
    const kvp_pool_info_t *p = kvp_client_pool_info(x->c);
    char b1[64], b2[64], b3[256];
    if (x->o->json) {
        json_t j = {.f = stdout};
        j_open(&j, NULL, '{');
        j_str(&j, "socket", x->o->socket_path);
        j_str(&j, "server_version", kvp_client_server_version(x->c));
        j_u64(&j, "protocol_version", KVP_PROTOCOL_VERSION);
        j_u64(&j, "session_id", kvp_client_session_id(x->c));
        j_str(&j, "backend", backend_name(p->backend));
        json_geometry(&j, p);
        j_u64(&j, "pool_bytes", p->pool_bytes);
        j_u64(&j, "page_bytes", s->page_bytes);
        j_open(&j, "usage", '{');
        j_u64(&j, "num_pages", s->num_pages);
        j_u64(&j, "used_pages", s->used_pages);
        j_u64(&j, "free_pages", s->free_pages);
        j_u64(&j, "shared_pages", s->shared_pages);
        j_u64(&j, "num_seqs", s->num_seqs);
        j_u64(&j, "num_tokens", s->num_tokens);
        j_u64(&j, "num_namespaces", ns_total(s));
        j_u64(&j, "num_clients", s->num_clients);
        j_close(&j, '}');
        /* every device of a tensor-parallel group holds the same pages (its share of heads) */
        j_open(&j, "devices", '[');
        for (uint32_t g = 0; g < p->num_devices && g < KVP_CLIENT_MAX_DEVICES; g++) {
            j_open(&j, NULL, '{');
            j_u64(&j, "index", g);
            j_i64(&j, "cuda_device", p->backend == 1 ? p->device_ids[g] : -1);
            j_u64(&j, "heads_begin", (uint64_t)g * p->heads_per_device);
            j_u64(&j, "heads_end", (uint64_t)(g + 1) * p->heads_per_device);
            j_u64(&j, "used_bytes", (uint64_t)s->used_pages * s->page_bytes);
            j_u64(&j, "capacity_bytes", (uint64_t)s->num_pages * s->page_bytes);
            j_close(&j, '}');
        }
        j_close(&j, ']');
        j_u64(&j, "uptime_ms", s->uptime_ms);
        j_bool(&j, "pool_shared_across_uids", s->pool_shared_across_uids);
        j_double(&j, "rtt_us", (double)rtt_ns / 1000.0);
        j_close(&j, '}');
    } else {
        const char *ver = kvp_client_server_version(x->c);
        printf("socket       %s\n", kvp_ctl_safe(x->o->socket_path, b3, sizeof(b3)));
        printf("daemon       kvpoold %s, protocol %u, session %llu\n",
               ver[0] ? kvp_ctl_safe(ver, b1, sizeof(b1)) : "(unknown version)",
               KVP_PROTOCOL_VERSION, (unsigned long long)kvp_client_session_id(x->c));
        printf("backend      %s, %u device%s\n", backend_name(p->backend), p->num_devices,
               p->num_devices == 1 ? "" : "s");
        printf("geometry     %u layers, %u pages x %u tokens, %u kv heads x %u, %s, %s, %s\n",
               p->num_layers, p->num_pages, p->page_size, p->num_kv_heads, p->head_dim,
               dtype_name(p->dtype), layout_name(p->layout), storage_name(p->storage));
        printf("pool         %s per device, %s per page\n", fmt_bytes(p->pool_bytes, b1, 64),
               fmt_bytes(s->page_bytes, b2, 64));
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
                   fmt_bytes((uint64_t)s->used_pages * s->page_bytes, b1, 64),
                   fmt_bytes((uint64_t)s->num_pages * s->page_bytes, b2, 64));
        }
        printf("sequences    %u (%llu tokens) in %u namespace%s\n", s->num_seqs,
               (unsigned long long)s->num_tokens, (unsigned)ns_total(s),
               ns_total(s) == 1 ? "" : "s");
        printf("clients      %u\n", s->num_clients);
        if (s->pool_shared_across_uids) /* issue #15: the pool is one trust domain */
            printf("warning      pool memory shared across uids (see access.pool_uids)\n");
        printf("uptime       %s\n", fmt_duration(s->uptime_ms, b1, sizeof(b1)));
        printf("rtt          %.1f us\n", (double)rtt_ns / 1000.0);
    }
    free(s);
    return EXIT_OK;
}

/* ---- the prefix cache (kvpool.proto CacheStats) ----------------------------------------
 * The figures come with Stats (Stats.cache). A hit rate is over a window: between two reads
 * (cache --interval) or since the daemon started; a scope row's window figures are its
 * counters minus those of the same scope (name and uid) in the first read. */

typedef struct {
    kvpool_CacheScopeStats s;
    uint64_t query, hit; /* over the window */
} scope_row_t;

static void scope_hit_rate(const void *rec, const void *ctx, col_val_t *v)
{
    const scope_row_t *r = rec;
    (void)ctx;
    v->d = ratio(r->hit, r->query);
}

static const col_t scope_cols[] = {
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
    {"QUERY_TOTAL", NULL, 'r', SHOW_PLAIN, FIELD(scope_row_t, s.query_tokens), .wide = 1},
    {"HIT_TOTAL", NULL, 'r', SHOW_PLAIN, FIELD(scope_row_t, s.hit_tokens), .wide = 1},
};
static const record_t scope_record = RECORD(scope_cols, scope_row_t);

/* cur - prev of a counter; cur alone when it went back (another daemon: not expected on one
 * connection, but never an underflow). */
static uint64_t delta(uint64_t cur, uint64_t prev)
{
    return cur >= prev ? cur - prev : cur;
}

/* The window of each scope of cur (prev NULL: since start) into rows[cur->scopes_count]. */
static void scope_rows(const kvpool_CacheStats *cur, const kvpool_CacheStats *prev,
                       scope_row_t *rows)
{
    for (pb_size_t i = 0; i < cur->scopes_count; i++) {
        const kvpool_CacheScopeStats *c = &cur->scopes[i], *p = NULL;
        for (pb_size_t k = 0; prev && k < prev->scopes_count && !p; k++)
            if (prev->scopes[k].uid == c->uid && strcmp(prev->scopes[k].name, c->name) == 0)
                p = &prev->scopes[k];
        rows[i].s = *c;
        rows[i].query = p ? delta(c->query_tokens, p->query_tokens) : c->query_tokens;
        rows[i].hit = p ? delta(c->hit_tokens, p->hit_tokens) : c->hit_tokens;
    }
}

/* The cache as one JSON object `key`: cur's figures, the window's tokens and hit rate (prev
 * NULL: since start; interval_ms 0 then), evictions by reason, one object per scope. */
static void json_cache(json_t *j, const char *key, const kvpool_CacheStats *cur,
                       const kvpool_CacheStats *prev, uint32_t interval_ms)
{
    static scope_row_t rows[MAX_SCOPES];
    const uint64_t q = delta(cur->query_tokens_total, prev ? prev->query_tokens_total : 0);
    const uint64_t h = delta(cur->hit_tokens_total, prev ? prev->hit_tokens_total : 0);
    j_open(j, key, '{');
    j_u64(j, "cached_pages", cur->cached_pages);
    j_u64(j, "pinned_pages", cur->pinned_pages);
    j_u64(j, "indexed_pages", cur->indexed_pages);
    j_u64(j, "pins", cur->pins);
    j_u64(j, "bytes", cur->bytes);
    j_u64(j, "query_tokens_total", cur->query_tokens_total);
    j_u64(j, "hit_tokens_total", cur->hit_tokens_total);
    j_u64(j, "interval_ms", prev ? interval_ms : 0);
    j_u64(j, "query_tokens", q);
    j_u64(j, "hit_tokens", h);
    j_ratio(j, "hit_rate", ratio(h, q));
    j_open(j, "evictions", '{');
    j_u64(j, "pressure", cur->evictions_pressure_total);
    j_u64(j, "flush", cur->evictions_flush_total);
    j_u64(j, "rewrite", cur->evictions_rewrite_total);
    j_close(j, '}');
    scope_rows(cur, prev, rows);
    json_records(j, "scopes", &scope_record, rows, cur->scopes_count, NULL);
    j_close(j, '}');
}

/* "75.0% (750 of 1000 tokens)", or "- (no lookups)" */
static const char *fmt_hit_rate(uint64_t hit, uint64_t query, char *buf, size_t len)
{
    char pct[32];
    if (query == 0)
        snprintf(buf, len, "- (no lookups)");
    else
        snprintf(buf, len, "%s (%llu of %llu tokens)",
                 fmt_percent(ratio(hit, query), pct, sizeof(pct)), (unsigned long long)hit,
                 (unsigned long long)query);
    return buf;
}

static void sleep_ms(uint32_t ms)
{
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

static int cmd_cache_flush(ctl_t *x)
{
    int rc = ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    new_req(x, kvpool_Request_cache_flush_tag);
    kvpool_CacheFlushRequest *f = &x->req.body.cache_flush;
    if (x->o->flush_scope)
        snprintf(f->scope, sizeof(f->scope), "%s", x->o->flush_scope);
    f->all = x->o->flush_all != 0;
    rc = ctl_call(x, kvpool_Response_cache_flush_tag, NULL);
    if (rc)
        return report(x, rc, "cache flush");
    const uint32_t pages = x->resp->body.cache_flush.pages;
    char b1[160];
    if (x->o->json) {
        json_t j = {.f = stdout};
        j_open(&j, NULL, '{');
        j_u64(&j, "pages", pages);
        j_str(&j, "scope", x->o->flush_scope ? x->o->flush_scope : "");
        j_bool(&j, "all", x->o->flush_all);
        j_str(&j, "namespace", x->o->join);
        j_close(&j, '}');
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
static void keep_ns_scope(const opts_t *o, kvpool_CacheStats *c)
{
    char want[sizeof(c->scopes[0].name) + 8];
    if (o->cache_scope)
        snprintf(want, sizeof(want), "%s", o->cache_scope);
    else
        snprintf(want, sizeof(want), "ns:%s", o->ns);
    pb_size_t n = 0;
    for (pb_size_t i = 0; i < c->scopes_count; i++)
        if (strcmp(c->scopes[i].name, want) == 0)
            c->scopes[n++] = c->scopes[i];
    c->scopes_count = n;
}

static int cmd_cache(ctl_t *x)
{
    if (x->o->flush)
        return cmd_cache_flush(x);
    int rc = ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    kvpool_Stats *s = malloc(sizeof(*s)), *first = NULL;
    if (!s)
        return report(x, KVP_ENOMEM, "stats");
    rc = get_stats(x, s);
    if (rc == 0 && x->o->interval_set) {
        first = s;
        s = malloc(sizeof(*s));
        if (!s) {
            free(first);
            return report(x, KVP_ENOMEM, "stats");
        }
        sleep_ms(x->o->interval_ms);
        rc = get_stats(x, s);
    }
    if (rc) {
        free(s);
        free(first);
        return report(x, rc, "stats");
    }
    const int all_scopes_listed = s->cache.scopes_count == MAX_SCOPES;
    if (x->o->ns) {
        keep_ns_scope(x->o, &s->cache);
        if (first)
            keep_ns_scope(x->o, &first->cache);
    }
    const kvpool_CacheStats *c = &s->cache, *p = first ? &first->cache : NULL;
    if (x->o->json) {
        json_t j = {.f = stdout};
        json_cache(&j, NULL, c, p, x->o->interval_ms);
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
        printf("hit rate     %s over %s\n", b2, fmt_duration(x->o->interval_ms, b1, sizeof(b1)));
    else
        printf("hit rate     %s since start\n", b2);
    printf("evictions    %llu pressure, %llu flush, %llu rewrite\n",
           (unsigned long long)c->evictions_pressure_total,
           (unsigned long long)c->evictions_flush_total,
           (unsigned long long)c->evictions_rewrite_total);
    printf("memory       %s (the cache's tables)\n", fmt_bytes(c->bytes, b1, sizeof(b1)));
    if (c->scopes_count) {
        static scope_row_t rows[MAX_SCOPES];
        scope_rows(c, p, rows);
        putchar('\n');
        table_records(stdout, x->o, &scope_record, rows, c->scopes_count, NULL);
    }
    fflush(stdout); /* the notes come after the table */
    if (all_scopes_listed)
        fprintf(stderr, "(the daemon lists at most %u scopes)\n", (unsigned)MAX_SCOPES);
    if (x->o->ns && !c->scopes_count)
        fprintf(stderr, "(no scope %s%s visible here)\n", x->o->cache_scope ? "" : "ns:",
                kvp_ctl_safe(x->o->cache_scope ? x->o->cache_scope : x->o->ns, b2, sizeof(b2)));
    if (!s->has_cache)
        fprintf(stderr, "(the daemon sent no prefix cache figures)\n");
    free(s);
    free(first);
    return EXIT_OK;
}

/* stats: one namespace */
static void ns_expires_cell(const void *rec, const void *ctx, char *buf, size_t len)
{
    const kvpool_NamespaceStats *n = rec;
    (void)ctx;
    if (n->sessions)
        snprintf(buf, len, "-"); /* attached: no expiry pending */
    else
        fmt_duration(n->lease_expires_in_ms, buf, len);
}

static const col_t ns_cols[] = {
    {"NAMESPACE", "name", 'l', SHOW_PLAIN, FIELD(kvpool_NamespaceStats, name)},
    {"SEQS", "num_seqs", 'r', SHOW_PLAIN, FIELD(kvpool_NamespaceStats, num_seqs)},
    {"TOKENS", "num_tokens", 'r', SHOW_PLAIN, FIELD(kvpool_NamespaceStats, num_tokens)},
    {"PAGE_REFS", "page_refs", 'r', SHOW_PLAIN, FIELD(kvpool_NamespaceStats, page_refs)},
    {"SESSIONS", "sessions", 'r', SHOW_PLAIN, FIELD(kvpool_NamespaceStats, sessions)},
    {"LEASE", "lease_ms", 'r', SHOW_DURATION, FIELD(kvpool_NamespaceStats, lease_ms)},
    {"EXPIRES_IN", "lease_expires_in_ms", 'r', SHOW_CUSTOM,
     FIELD(kvpool_NamespaceStats, lease_expires_in_ms), .cell = ns_expires_cell},
    {"DEDUP_BYTES", NULL, 'r', SHOW_PLAIN, FIELD(kvpool_NamespaceStats, dedup_bytes), .wide = 1},
    {"DEDUP_ENTRIES", NULL, 'r', SHOW_PLAIN, FIELD(kvpool_NamespaceStats, dedup_entries),
     .wide = 1},
};
static const record_t ns_record = RECORD(ns_cols, kvpool_NamespaceStats);

static int cmd_stats(ctl_t *x)
{
    int rc = ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    kvpool_Stats *s = malloc(sizeof(*s));
    if (!s)
        return report(x, KVP_ENOMEM, "stats");
    rc = get_stats(x, s);
    if (rc) {
        free(s);
        return report(x, rc, "stats");
    }
    if (x->o->ns) { /* namespace NS only: the one row of it, or no such namespace */
        pb_size_t k = 0;
        while (k < s->namespaces_count && strcmp(s->namespaces[k].name, x->o->ns) != 0)
            k++;
        if (k == s->namespaces_count) {
            char b[160];
            if (s->namespaces_truncated)
                fprintf(stderr,
                        "kvpoolctl: stats: namespace '%s' is not among the %u the daemon lists "
                        "(of %u)\n",
                        kvp_ctl_safe(x->o->ns, b, sizeof(b)), (unsigned)s->namespaces_count,
                        (unsigned)ns_total(s));
            else
                fprintf(stderr, "kvpoolctl: stats: no namespace '%s'\n",
                        kvp_ctl_safe(x->o->ns, b, sizeof(b)));
            free(s);
            return EXIT_SERVER;
        }
        s->namespaces[0] = s->namespaces[k];
        s->namespaces_count = 1;
        s->namespaces_truncated = false; /* the answer about NS is complete */
    }
    char b1[64];
    if (x->o->json) {
        json_t j = {.f = stdout};
        j_open(&j, NULL, '{');
        j_u64(&j, "num_pages", s->num_pages);
        j_u64(&j, "free_pages", s->free_pages);
        j_u64(&j, "used_pages", s->used_pages);
        j_u64(&j, "shared_pages", s->shared_pages);
        j_u64(&j, "num_seqs", s->num_seqs);
        j_u64(&j, "num_tokens", s->num_tokens);
        j_u64(&j, "page_refs", s->page_refs);
        j_u64(&j, "page_bytes", s->page_bytes);
        j_u64(&j, "num_clients", s->num_clients);
        j_u64(&j, "uptime_ms", s->uptime_ms);
        j_u64(&j, "requests_total", s->requests_total);
        j_u64(&j, "append_bytes_total", s->append_bytes_total);
        json_records(&j, "namespaces", &ns_record, s->namespaces, s->namespaces_count, NULL);
        j_u64(&j, "namespaces_total", ns_total(s));
        j_bool(&j, "namespaces_truncated", s->namespaces_truncated);
        json_cache(&j, "cache", &s->cache, NULL, 0);
        j_close(&j, '}');
        free(s);
        return EXIT_OK;
    }
    printf("pages        %u total, %u free, %u used, %u shared\n", s->num_pages, s->free_pages,
           s->used_pages, s->shared_pages);
    printf("page refs    %llu\n", (unsigned long long)s->page_refs);
    printf("page size    %s (all layers, K and V, one device)\n",
           fmt_bytes(s->page_bytes, b1, sizeof(b1)));
    printf("sequences    %u (%llu tokens)\n", s->num_seqs, (unsigned long long)s->num_tokens);
    printf("clients      %u\n", s->num_clients);
    printf("requests     %llu\n", (unsigned long long)s->requests_total);
    printf("appended     %s\n", fmt_bytes(s->append_bytes_total, b1, sizeof(b1)));
    printf("uptime       %s\n", fmt_duration(s->uptime_ms, b1, sizeof(b1)));
    if (s->has_cache) {
        char b2[160];
        const kvpool_CacheStats *c = &s->cache;
        printf("cache        %u cached, %u pinned, %u indexed pages; hit rate %s\n",
               c->cached_pages, c->pinned_pages, c->indexed_pages,
               fmt_hit_rate(c->hit_tokens_total, c->query_tokens_total, b2, sizeof(b2)));
    }
    if (x->o->wide)
        printf("dedup        %s kept for retries, %llu evicted\n",
               fmt_bytes(s->dedup_bytes, b1, sizeof(b1)),
               (unsigned long long)s->dedup_evictions_total);
    if (s->namespaces_count) {
        putchar('\n');
        table_records(stdout, x->o, &ns_record, s->namespaces, s->namespaces_count, NULL);
    }
    if (x->o->wide && s->has_cache && s->cache.scopes_count) { /* the cache's scopes */
        static scope_row_t rows[MAX_SCOPES];
        scope_rows(&s->cache, NULL, rows);
        putchar('\n');
        table_records(stdout, x->o, &scope_record, rows, s->cache.scopes_count, NULL);
    }
    if (s->namespaces_truncated) {
        fflush(stdout); /* the note comes after the table */
        fprintf(stderr, "(%u of %u namespaces shown: the daemon lists at most %u)\n",
                (unsigned)s->namespaces_count, (unsigned)ns_total(s),
                (unsigned)s->namespaces_count);
    }
    free(s);
    return EXIT_OK;
}

static int cmd_pool(ctl_t *x)
{
    int rc = ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    new_req(x, kvpool_Request_pool_info_tag);
    x->req.body.pool_info.want_pool_fds = false;
    rc = ctl_call(x, kvpool_Response_pool_info_tag, NULL);
    if (rc)
        return report(x, rc, "pool");
    const kvpool_PoolInfo *p = &x->resp->body.pool_info;
    const kvpool_Geometry *g = &p->geometry;
    char b1[64];
    if (x->o->json) {
        json_t j = {.f = stdout};
        j_open(&j, NULL, '{');
        j_str(&j, "backend", backend_name((uint32_t)p->backend));
        j_open(&j, "geometry", '{');
        j_u64(&j, "num_layers", g->num_layers);
        j_u64(&j, "num_pages", g->num_pages);
        j_u64(&j, "page_size", g->page_size);
        j_u64(&j, "num_kv_heads", g->num_kv_heads);
        j_u64(&j, "head_dim", g->head_dim);
        j_str(&j, "dtype", dtype_name((uint32_t)g->dtype));
        j_str(&j, "layout", layout_name((uint32_t)g->layout));
        j_str(&j, "storage", storage_name((uint32_t)g->storage));
        j_u64(&j, "num_devices", g->num_devices);
        j_close(&j, '}');
        j_u64(&j, "pool_bytes", p->pool_bytes);
        j_u64(&j, "layer_bytes", p->layer_bytes);
        j_u64(&j, "v_offset_bytes", p->v_offset_bytes);
        j_i64(&j, "stride_page", p->stride_page);
        j_i64(&j, "stride_n", p->stride_n);
        j_i64(&j, "stride_h", p->stride_h);
        j_u64(&j, "elem_bytes", p->elem_bytes);
        j_u64(&j, "heads_per_device", p->heads_per_device);
        j_open(&j, "device_ids", '[');
        for (pb_size_t i = 0; i < p->device_ids_count; i++)
            j_i64(&j, NULL, p->device_ids[i]);
        j_close(&j, ']');
        j_u64(&j, "map_granularity", p->map_granularity);
        j_close(&j, '}');
        return EXIT_OK;
    }
    printf("backend            %s\n", backend_name((uint32_t)p->backend));
    printf("devices            %u", g->num_devices);
    for (pb_size_t i = 0; i < p->device_ids_count; i++)
        printf("%s%d", i ? "," : " (cuda ", p->device_ids[i]);
    printf("%s\n", p->device_ids_count ? ")" : "");
    printf("layers             %u\n", g->num_layers);
    printf("pages              %u x %u tokens\n", g->num_pages, g->page_size);
    printf("kv heads           %u (%u per device) x head_dim %u\n", g->num_kv_heads,
           p->heads_per_device, g->head_dim);
    printf("dtype              %s (%u bytes)\n", dtype_name((uint32_t)g->dtype), p->elem_bytes);
    printf("layout             %s, %s K/V\n", layout_name((uint32_t)g->layout),
           storage_name((uint32_t)g->storage));
    printf("pool bytes         %llu (%s per device)\n", (unsigned long long)p->pool_bytes,
           fmt_bytes(p->pool_bytes, b1, sizeof(b1)));
    printf("layer bytes        %llu\n", (unsigned long long)p->layer_bytes);
    printf("v offset bytes     %llu\n", (unsigned long long)p->v_offset_bytes);
    printf("strides            page %lld, n %lld, h %lld (elements)\n", (long long)p->stride_page,
           (long long)p->stride_n, (long long)p->stride_h);
    if (p->map_granularity)
        printf("map granularity    %s\n", fmt_bytes(p->map_granularity, b1, sizeof(b1)));
    return EXIT_OK;
}

typedef struct {
    char ns[sizeof(((kvpool_NamespaceStats *)0)->name)];
    kvpool_SequenceInfo info;
} seq_row_t;

/* seqs: one sequence and its namespace */
static const col_t seq_cols[] = {
    {"NAMESPACE", "namespace", 'l', SHOW_PLAIN, FIELD(seq_row_t, ns)},
    {"SEQ_ID", "seq_id", 'r', SHOW_PLAIN, FIELD(seq_row_t, info.seq_id)},
    {"TOKENS", "num_tokens", 'r', SHOW_PLAIN, FIELD(seq_row_t, info.num_tokens)},
    {"PAGES", "num_pages", 'r', SHOW_PLAIN, FIELD(seq_row_t, info.num_pages)},
    {"SHARED", "shared_pages", 'r', SHOW_PLAIN, FIELD(seq_row_t, info.shared_pages)},
    {"IDLE", "idle_ms", 'r', SHOW_DURATION, FIELD(seq_row_t, info.idle_ms)},
    {"IDLE_MS", NULL, 'r', SHOW_PLAIN, FIELD(seq_row_t, info.idle_ms), .wide = 1},
};
static const record_t seq_record = RECORD(seq_cols, seq_row_t);

static int cmd_seqs(ctl_t *x)
{
    int rc = ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    /* which namespaces: the one asked for, or every one the daemon reports */
    kvpool_Stats *s = calloc(1, sizeof(*s));
    if (!s)
        return report(x, KVP_ENOMEM, "seqs");
    if (x->o->ns) {
        snprintf(s->namespaces[0].name, sizeof(s->namespaces[0].name), "%s", x->o->ns);
        s->namespaces_count = 1;
    } else {
        rc = get_stats(x, s);
        if (rc) {
            free(s);
            return report(x, rc, "stats");
        }
    }
    seq_row_t *rows = NULL;
    size_t nrows = 0, cap = 0;
    int truncated = 0;
    /* the daemon listed only some namespaces (Stats holds 64): their sequences are all we
     * can read, and the answer says it is not complete */
    const int ns_truncated = s->namespaces_truncated;
    for (pb_size_t i = 0; i < s->namespaces_count && !truncated; i++) {
        uint32_t cursor = 0;
        do {
            new_req(x, kvpool_Request_list_sequences_tag);
            kvpool_ListSequencesRequest *lr = &x->req.body.list_sequences;
            snprintf(lr->namespace, sizeof(lr->namespace), "%s", s->namespaces[i].name);
            lr->cursor = cursor;
            lr->limit = SEQS_PAGE;
            if (x->o->limit && x->o->limit - nrows < SEQS_PAGE)
                lr->limit = (uint32_t)(x->o->limit - nrows) + 1; /* +1: learn if there is more */
            rc = ctl_call(x, kvpool_Response_list_sequences_tag, NULL);
            if (rc) {
                free(rows);
                free(s);
                return report(x, rc, "list sequences");
            }
            const kvpool_ListSequencesResponse *lsr = &x->resp->body.list_sequences;
            for (pb_size_t k = 0; k < lsr->seqs_count; k++) {
                if (x->o->limit && nrows == x->o->limit) {
                    truncated = 1;
                    break;
                }
                if (nrows == cap) {
                    cap = cap ? 2 * cap : 256;
                    seq_row_t *nr = realloc(rows, cap * sizeof(*rows));
                    if (!nr) {
                        free(rows);
                        free(s);
                        return report(x, KVP_ENOMEM, "seqs");
                    }
                    rows = nr;
                }
                memcpy(rows[nrows].ns, s->namespaces[i].name, sizeof(rows[nrows].ns));
                rows[nrows].info = lsr->seqs[k];
                nrows++;
            }
            if (x->o->limit && nrows == x->o->limit && lsr->next_cursor)
                truncated = 1;
            /* a cursor that does not move, or an empty page, would loop forever */
            if (lsr->next_cursor == cursor || lsr->seqs_count == 0)
                break;
            cursor = lsr->next_cursor;
        } while (cursor && !truncated);
    }

    char b1[128];
    if (x->o->json) {
        json_t j = {.f = stdout};
        j_open(&j, NULL, '{');
        json_records(&j, "sequences", &seq_record, rows, nrows, NULL);
        j_u64(&j, "count", nrows);
        j_bool(&j, "truncated", truncated || ns_truncated);
        j_bool(&j, "namespaces_truncated", ns_truncated);
        j_close(&j, '}');
    } else if (nrows == 0) {
        fprintf(stderr, "no sequences%s%s\n", x->o->ns ? " in namespace " : "",
                x->o->ns ? kvp_ctl_safe(x->o->ns, b1, sizeof(b1)) : "");
    } else {
        table_records(stdout, x->o, &seq_record, rows, nrows, NULL);
        if (truncated) {
            fflush(stdout); /* the note comes after the table, also on a shared terminal */
            fprintf(stderr, "(stopped at --limit %u)\n", x->o->limit);
        }
        if (ns_truncated) {
            fflush(stdout);
            fprintf(stderr,
                    "(incomplete: the daemon listed %u of %u namespaces; use --namespace)\n",
                    (unsigned)s->namespaces_count, (unsigned)ns_total(s));
        }
    }
    free(rows);
    free(s);
    return EXIT_OK;
}

/* clients: one session; ctx is kvpoolctl's own session id (marked "*" in the table) */
static void client_session_cell(const void *rec, const void *ctx, char *buf, size_t len)
{
    const kvpool_ClientInfo *ci = rec;
    snprintf(buf, len, "%llu%s", (unsigned long long)ci->session_id,
             ci->session_id == *(const uint64_t *)ctx ? "*" : "");
}

static void client_self(const void *rec, const void *ctx, col_val_t *v)
{
    v->u = ((const kvpool_ClientInfo *)rec)->session_id == *(const uint64_t *)ctx;
}

static const col_t client_cols[] = {
    {"SESSION", "session_id", 'r', SHOW_CUSTOM, FIELD(kvpool_ClientInfo, session_id),
     .cell = client_session_cell},
    {"NAMESPACE", "namespace", 'l', SHOW_PLAIN, FIELD(kvpool_ClientInfo, namespace)},
    {"NAME", "client_name", 'l', SHOW_PLAIN, FIELD(kvpool_ClientInfo, client_name)},
    {"PID", "pid", 'r', SHOW_PLAIN, FIELD(kvpool_ClientInfo, pid)},
    {"UID", "uid", 'r', SHOW_PLAIN, FIELD(kvpool_ClientInfo, uid)},
    {"GID", "gid", 'r', SHOW_PLAIN, FIELD(kvpool_ClientInfo, gid)},
    {"REQUESTS", "requests", 'r', SHOW_PLAIN, FIELD(kvpool_ClientInfo, requests)},
    {NULL, "connected_ms", 'r', SHOW_PLAIN, FIELD(kvpool_ClientInfo, connected_ms)},
    {"BUFFERS", "buffers", 'r', SHOW_PLAIN, FIELD(kvpool_ClientInfo, buffers)},
    {"AGE", NULL, 'r', SHOW_DURATION, FIELD(kvpool_ClientInfo, connected_ms)},
    {NULL, "self", 'l', SHOW_PLAIN, .type = COL_BOOL, .get = client_self},
    {"CONNECTED_MS", NULL, 'r', SHOW_PLAIN, FIELD(kvpool_ClientInfo, connected_ms), .wide = 1},
};
static const record_t client_record = RECORD(client_cols, kvpool_ClientInfo);

static int cmd_clients(ctl_t *x)
{
    int rc = ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    new_req(x, kvpool_Request_list_clients_tag);
    rc = ctl_call(x, kvpool_Response_list_clients_tag, NULL);
    if (rc)
        return report(x, rc, "list clients");
    kvpool_ListClientsResponse *l = &x->resp->body.list_clients;
    if (x->o->ns) { /* the sessions attached to NS */
        pb_size_t n = 0;
        for (pb_size_t i = 0; i < l->clients_count; i++)
            if (strcmp(l->clients[i].namespace, x->o->ns) == 0)
                l->clients[n++] = l->clients[i];
        l->clients_count = n;
    }
    uint64_t self = kvp_client_session_id(x->c);
    if (x->o->json) {
        json_t j = {.f = stdout};
        j_open(&j, NULL, '{');
        json_records(&j, "clients", &client_record, l->clients, l->clients_count, &self);
        j_close(&j, '}');
        return EXIT_OK;
    }
    table_records(stdout, x->o, &client_record, l->clients, l->clients_count, &self);
    return EXIT_OK;
}

/* transfers: one transfer (a set shows its first sequence and how many more) */
static void transfer_seq_cell(const void *rec, const void *ctx, char *buf, size_t len)
{
    const kvpool_TransferInfo *t = rec;
    (void)ctx;
    if (t->num_seqs > 1)
        snprintf(buf, len, "%llu+%u", (unsigned long long)t->seq_id, t->num_seqs - 1);
    else
        snprintf(buf, len, "%llu", (unsigned long long)t->seq_id);
}

static const col_t transfer_cols[] = {
    {"TRANSFER", "transfer_id", 'r', SHOW_PLAIN, FIELD(kvpool_TransferInfo, transfer_id)},
    {"DIR", "direction", 'l', SHOW_RAW, FIELD(kvpool_TransferInfo, direction)},
    {"STATE", "state", 'l', SHOW_RAW, FIELD(kvpool_TransferInfo, state)},
    {"PEER", "peer", 'l', SHOW_OR_DASH, FIELD(kvpool_TransferInfo, peer)},
    {"NAMESPACE", "namespace", 'l', SHOW_PLAIN, FIELD(kvpool_TransferInfo, namespace)},
    {"SEQ", "seq_id", 'l', SHOW_CUSTOM, FIELD(kvpool_TransferInfo, seq_id),
     .cell = transfer_seq_cell},
    {NULL, "num_seqs", 'r', SHOW_PLAIN, FIELD(kvpool_TransferInfo, num_seqs)},
    {"TOKENS", "num_tokens", 'r', SHOW_PLAIN, FIELD(kvpool_TransferInfo, num_tokens)},
    {"BYTES", "bytes", 'r', SHOW_BYTES, FIELD(kvpool_TransferInfo, bytes)},
    {"ELAPSED", "elapsed_ms", 'r', SHOW_DURATION, FIELD(kvpool_TransferInfo, elapsed_ms)},
    {"MESSAGE", "message", 'l', SHOW_OR_DASH, FIELD(kvpool_TransferInfo, message)},
    {"NUM_SEQS", NULL, 'r', SHOW_PLAIN, FIELD(kvpool_TransferInfo, num_seqs), .wide = 1},
    {"ELAPSED_MS", NULL, 'r', SHOW_PLAIN, FIELD(kvpool_TransferInfo, elapsed_ms), .wide = 1},
};
static const record_t transfer_record = RECORD(transfer_cols, kvpool_TransferInfo);

static int cmd_transfers(ctl_t *x)
{
    int rc = ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    new_req(x, kvpool_Request_list_transfers_tag);
    rc = ctl_call(x, kvpool_Response_list_transfers_tag, NULL);
    if (rc)
        return report(x, rc, "list transfers");
    kvpool_ListTransfersResponse *l = &x->resp->body.list_transfers;
    if (x->o->ns) { /* the transfers of NS */
        pb_size_t n = 0;
        for (pb_size_t i = 0; i < l->transfers_count; i++)
            if (strcmp(l->transfers[i].namespace, x->o->ns) == 0)
                l->transfers[n++] = l->transfers[i];
        l->transfers_count = n;
    }
    if (x->o->json) {
        json_t j = {.f = stdout};
        j_open(&j, NULL, '{');
        json_records(&j, "transfers", &transfer_record, l->transfers, l->transfers_count, NULL);
        j_close(&j, '}');
        return EXIT_OK;
    }
    table_records(stdout, x->o, &transfer_record, l->transfers, l->transfers_count, NULL);
    return EXIT_OK;
}

static int cmd_audit(ctl_t *x)
{
    int rc = ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    new_req(x, kvpool_Request_audit_tag);
    rc = ctl_call(x, kvpool_Response_audit_tag, NULL);
    if (rc)
        return report(x, rc, "audit");
    const kvpool_AuditResponse *a = &x->resp->body.audit;
    char b1[300];
    if (x->o->json) {
        json_t j = {.f = stdout};
        j_open(&j, NULL, '{');
        j_bool(&j, "ok", a->ok);
        j_str(&j, "message", a->message);
        j_close(&j, '}');
    } else if (a->ok) {
        printf("ok\n");
    } else {
        printf("audit failed: %s\n",
               a->message[0] ? kvp_ctl_safe(a->message, b1, sizeof(b1)) : "?");
    }
    return a->ok ? EXIT_OK : EXIT_SERVER;
}

static int cmd_metrics(ctl_t *x)
{
    int rc = ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    char *text = malloc(METRICS_TEXT_BYTES);
    if (!text)
        return report(x, KVP_ENOMEM, "metrics");
    kvp_reply_arrays_t arrays;
    memset(&arrays, 0, sizeof(arrays));
    arrays.text.s = text;
    arrays.text.cap = METRICS_TEXT_BYTES;
    new_req(x, kvpool_Request_metrics_tag);
    rc = ctl_call(x, kvpool_Response_metrics_tag, &arrays);
    if (rc) {
        free(text);
        return report(x, rc, "metrics");
    }
    if (x->o->json) {
        json_t j = {.f = stdout};
        j_open(&j, NULL, '{');
        j_str(&j, "text", text);
        j_close(&j, '}');
    } else {
        fwrite(text, 1, arrays.text.len, stdout);
        if (arrays.text.len && text[arrays.text.len - 1] != '\n')
            putchar('\n');
    }
    free(text);
    return EXIT_OK;
}

static int cmd_top(ctl_t *x)
{
    int rc = ctl_connect(x, NULL, 0);
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

static int cmd_health(ctl_t *x)
{
    char why[512] = "";
    uint64_t rtt_ns = 0;
    int healthy = 0;
    if (ctl_connect(x, why, sizeof(why)) == 0) {
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
        json_t j = {.f = stdout};
        j_open(&j, NULL, '{');
        j_bool(&j, "healthy", healthy);
        j_str(&j, "reason", why);
        if (healthy)
            j_double(&j, "rtt_us", (double)rtt_ns / 1000.0);
        j_close(&j, '}');
    } else if (healthy) {
        printf("ok\n");
    } else {
        char b[600];
        printf("unhealthy: %s\n", kvp_ctl_safe(why, b, sizeof(b)));
    }
    return healthy ? EXIT_OK : EXIT_SERVER;
}

/* ---- main --------------------------------------------------------------------------------- */

static int (*const commands[NUM_CMDS])(ctl_t *x) = {
    [C_STATUS] = cmd_status, [C_STATS] = cmd_stats,     [C_POOL] = cmd_pool,
    [C_SEQS] = cmd_seqs,     [C_CLIENTS] = cmd_clients, [C_TRANSFERS] = cmd_transfers,
    [C_AUDIT] = cmd_audit,   [C_METRICS] = cmd_metrics, [C_HEALTH] = cmd_health,
    [C_TOP] = cmd_top,       [C_CACHE] = cmd_cache,     [C_HELP] = NULL, /* in main */
};

/* --interval SEC: seconds with an optional fraction, 0.1 .. 86400; returns milliseconds. */
static uint32_t parse_interval(const char *what, const char *s)
{
    char *end;
    errno = 0;
    double v = s && *s && *s != '-' && *s != '+' && *s != ' ' ? strtod(s, &end) : -1;
    if (v == -1 || errno || *end || !(v >= 0.1 && v <= 86400))
        die_usage("%s: '%s' is not a number of seconds in 0.1..86400", what, s ? s : "");
    return (uint32_t)(v * 1000 + 0.5);
}

/* -o FORMAT: one of output_formats. */
static void parse_output(opts_t *o, const char *v)
{
    o->output_set = 1;
    if (strcmp(v, "json") == 0) {
        o->json = 1;
        o->wide = 0;
    } else if (strcmp(v, "wide") == 0) {
        o->json = 0;
        o->wide = 1;
    } else if (strcmp(v, "table") == 0) {
        o->json = 0;
        o->wide = 0;
    } else {
        die_usage("-o/--output: '%s' is not one of json, wide, table", v);
    }
}

/* Parses options from argv[optind]. ci -1: the options before the command (stops at the
 * first operand, takes no command's own option); else those of command ci. */
static void parse_opts(int argc, char **argv, opts_t *o, int ci, const struct option *long_opts)
{
    const int is_seqs = ci == C_SEQS;
    const int is_top = ci == C_TOP;
    const int is_cache = ci == C_CACHE;
    int c;
    const char *shortopts = ci >= 0 ? ":s:n:t:ho:w:" : "+:s:n:t:ho:w:";
    while ((c = getopt_long(argc, argv, shortopts, long_opts, NULL)) != -1) {
        switch (c) {
        case 's':
            o->socket_path = optarg;
            break;
        case 'n':
            o->ns = optarg;
            break;
        case 't':
            o->timeout_ms = parse_u32("--timeout", optarg, 1, 86400000);
            o->timeout_set = 1;
            break;
        case 'o':
            parse_output(o, optarg);
            break;
        case OPT_JSON:
            o->json = 1;
            o->wide = 0;
            o->output_set = 1;
            break;
        case OPT_NO_HEADERS:
            o->no_headers = 1;
            o->output_set = 1;
            break;
        case OPT_JOIN:
            o->join = optarg;
            break;
        case OPT_LIMIT:
            if (!is_seqs)
                die_usage("--limit applies to the seqs command only");
            o->limit = parse_u32("--limit", optarg, 1, UINT32_MAX);
            break;
        case OPT_INTERVAL:
            if (!is_top && !is_cache)
                die_usage("--interval applies to the top and cache commands only");
            o->interval_ms = parse_interval("--interval", optarg);
            o->interval_set = 1;
            break;
        case 'w': /* cache: another name of --interval */
            if (!is_cache)
                die_usage("--watch applies to the cache command only");
            o->interval_ms = parse_interval("--watch", optarg);
            o->interval_set = 1;
            break;
        case OPT_COUNT:
            if (!is_top)
                die_usage("--count applies to the top command only");
            o->count = parse_u32("--count", optarg, 0, UINT32_MAX);
            break;
        case OPT_SCOPE:
            if (!is_cache)
                die_usage("--scope applies to cache flush only");
            o->flush_scope = optarg;
            break;
        case OPT_ALL:
            if (!is_cache)
                die_usage("--all applies to cache flush only");
            o->flush_all = 1;
            break;
        case OPT_CACHE_SCOPE:
            o->cache_scope = optarg;
            break;
        case 'h':
            if (ci >= 0)
                cmd_usage(stdout, ci);
            else
                usage(stdout);
            exit(EXIT_OK);
        case OPT_VERSION:
            printf("kvpoolctl %s (protocol %u)\n", KVP_VERSION_STRING, KVP_PROTOCOL_VERSION);
            exit(EXIT_OK);
        case ':':
            die_usage("option '%s' needs a value", argv[optind - 1]);
        default:
            if (optopt)
                die_usage("unknown option '-%c'", optopt);
            die_usage("unknown option '%s'", argv[optind - 1]);
        }
    }
}

static void resolve_socket(opts_t *o)
{
    if (!o->socket_path) {
        o->socket_path = kvp_client_default_socket(o->socket_buf, sizeof(o->socket_buf));
        if (!o->socket_path)
            die_usage("the default socket path ($KVPOOL_SOCKET or $XDG_RUNTIME_DIR) is too long");
    } else if (!*o->socket_path || strlen(o->socket_path) >= sizeof(o->socket_buf)) {
        die_usage("socket path must be 1..%zu bytes", sizeof(o->socket_buf) - 1);
    }
}

/* The hidden `kvpoolctl [-s PATH] [-t MS] __complete WHAT [CMD]` that the bash completion asks,
 * one word a line: `commands`; `options [CMD]` (without CMD those taken before a command);
 * `valued` (the options that take a value); `words CMD` (its operands: cache's flush, help's
 * command names); `formats` (the values of -o); `namespaces` (those
 * the daemon lists to this uid, asked with a 1 s timeout unless -t says otherwise; nothing when
 * no daemon answers). Exit 0, or 2 for a WHAT it does not know. */
static int complete(opts_t *o, int argc, char **argv)
{
    const char *what = argc > 0 ? argv[0] : "";
    if (strcmp(what, "commands") == 0) {
        for (int i = 0; i < NUM_CMDS; i++)
            puts(cmd_doc[i].name);
    } else if (strcmp(what, "options") == 0) {
        int ci = argc > 1 ? cmd_index(argv[1]) : -1;
        if (argc > 1 && ci < 0)
            return EXIT_OK; /* an unknown command takes nothing */
        for (size_t i = 0; i < NUM_OPTS; i++) {
            if (ci >= 0 ? !(opt_doc[i].cmds & M(ci)) : !opt_doc[i].global)
                continue;
            printf("--%s\n", opt_doc[i].name);
            if (opt_doc[i].val < 256)
                printf("-%c\n", opt_doc[i].val);
        }
    } else if (strcmp(what, "valued") == 0) {
        for (size_t i = 0; i < NUM_OPTS; i++) {
            if (opt_doc[i].has_arg != required_argument)
                continue;
            printf("--%s\n", opt_doc[i].name);
            if (opt_doc[i].val < 256)
                printf("-%c\n", opt_doc[i].val);
        }
    } else if (strcmp(what, "words") == 0) { /* the operands of command argv[1] */
        const int ci = argc > 1 ? cmd_index(argv[1]) : -1;
        if (ci == C_CACHE)
            puts("flush");
        for (int i = 0; ci == C_HELP && i < NUM_CMDS; i++)
            puts(cmd_doc[i].name);
    } else if (strcmp(what, "formats") == 0) {
        for (size_t i = 0; i < sizeof(output_formats) / sizeof(output_formats[0]); i++)
            puts(output_formats[i]);
    } else if (strcmp(what, "namespaces") == 0) {
        ctl_t x;
        memset(&x, 0, sizeof(x));
        x.o = o;
        o->join = NULL; /* an observer: completing never joins a namespace */
        o->cache_scope = NULL;
        if (!o->timeout_set)
            o->timeout_ms = 1000;
        resolve_socket(o);
        kvpool_Stats *s = malloc(sizeof(*s));
        x.resp = calloc(1, sizeof(*x.resp));
        char why[256];
        if (s && x.resp && ctl_connect(&x, why, sizeof(why)) == 0 && get_stats(&x, s) == 0)
            for (pb_size_t i = 0; i < s->namespaces_count; i++)
                puts(s->namespaces[i].name);
        kvp_client_close(x.c);
        free(x.resp);
        free(s);
    } else {
        die_usage("__complete: '%s' is not one of commands, options, valued, words, formats, "
                  "namespaces",
                  what);
    }
    return EXIT_OK;
}

static void check_name(const char *what, const char *v, size_t size)
{
    if (v && (!*v || strlen(v) >= size))
        die_usage("%s: a name of 1..%zu bytes", what, size - 1);
}

int main(int argc, char **argv)
{
    opts_t o;
    memset(&o, 0, sizeof(o));
    opterr = 0;
    o.interval_ms = 2000;
    struct option long_opts[NUM_OPTS + 1];
    for (size_t i = 0; i < NUM_OPTS; i++)
        long_opts[i] = (struct option){opt_doc[i].name, opt_doc[i].has_arg, NULL, opt_doc[i].val};
    long_opts[NUM_OPTS] = (struct option){NULL, 0, NULL, 0};
    parse_opts(argc, argv, &o, -1, long_opts);
    if (optind >= argc)
        die_usage("no command given");
    const char *cmd = argv[optind];
    if (strcmp(cmd, "__complete") == 0) {
        int code = complete(&o, argc - optind - 1, argv + optind + 1);
        return fflush(stdout) == 0 ? code : EXIT_SERVER;
    }
    const int ci = cmd_index(cmd);
    if (ci < 0)
        die_usage("unknown command '%s'", cmd);

    /* the command's own options: argv[optind] plays argv[0] */
    int sub_argc = argc - optind;
    char **sub_argv = argv + optind;
    optind = 0; /* glibc: restart scanning */
    parse_opts(sub_argc, sub_argv, &o, ci, long_opts);
    if (ci == C_HELP) {
        if (o.ns || o.output_set || o.join || o.cache_scope)
            die_usage("help takes a command name and no other option");
        if (optind >= sub_argc) {
            usage(stdout);
        } else {
            const int hi = cmd_index(sub_argv[optind]);
            if (hi < 0)
                die_usage("help: unknown command '%s'", sub_argv[optind]);
            if (optind + 1 < sub_argc)
                die_usage("unexpected argument '%s'", sub_argv[optind + 1]);
            cmd_usage(stdout, hi);
        }
        return fflush(stdout) == 0 ? EXIT_OK : EXIT_SERVER;
    }
    if (ci == C_CACHE && optind < sub_argc && strcmp(sub_argv[optind], "flush") == 0) {
        o.flush = 1;
        optind++;
    }
    if (optind < sub_argc)
        die_usage("unexpected argument '%s'", sub_argv[optind]);
    if (o.ns && !(M_NS & M(ci)))
        die_usage("-n/--namespace does not apply to %s, which is daemon-wide (--join NS joins "
                  "a namespace)",
                  cmd);
    if (o.output_set && !(M_OUT & M(ci)))
        die_usage("-o, --json and --no-headers do not apply to %s: it draws a live view, or "
                  "prints key=value lines when stdout is not a terminal",
                  cmd);
    if (o.flush) {
        if (o.interval_set)
            die_usage("--interval and --watch apply to cache, not to cache flush");
        if (o.flush_scope && o.flush_all)
            die_usage("cache flush: --scope and --all exclude each other");
        if (o.ns && o.join && strcmp(o.ns, o.join) != 0)
            die_usage("cache flush: -n and --join name two namespaces");
        if (!o.join)
            o.join = o.ns; /* the namespace it acts on: flushing its scope joins it */
        if (!o.join && !o.flush_scope && !o.flush_all)
            die_usage("cache flush: name --scope S or --all (root and the daemon's uid), or "
                      "your namespace with -n NS to flush its scope");
        if (!o.join)
            o.join = FLUSH_NS; /* a mutating call: not as an observer */
    } else if (o.flush_scope || o.flush_all) {
        die_usage("--scope and --all apply to cache flush only");
    }
    if (o.cache_scope && !o.join)
        die_usage("--cache-scope needs a namespace to join (--join NS, or cache flush -n NS)");

    resolve_socket(&o);
    check_name("-n/--namespace", o.ns, sizeof(((kvpool_HelloRequest *)0)->namespace));
    check_name("-n/--namespace", o.ns, sizeof(((kvpool_ListSequencesRequest *)0)->namespace));
    check_name("--join", o.join, sizeof(((kvpool_HelloRequest *)0)->namespace));
    if (o.flush_scope && strlen(o.flush_scope) >= sizeof(((kvpool_CacheFlushRequest *)0)->scope))
        die_usage("scope longer than %zu bytes",
                  sizeof(((kvpool_CacheFlushRequest *)0)->scope) - 1);
    if (o.cache_scope && strlen(o.cache_scope) >= sizeof(((kvpool_HelloRequest *)0)->cache_scope))
        die_usage("cache scope longer than %zu bytes",
                  sizeof(((kvpool_HelloRequest *)0)->cache_scope) - 1);

    ctl_t x;
    memset(&x, 0, sizeof(x));
    x.o = &o;
    x.cmd = cmd;
    x.resp = calloc(1, sizeof(*x.resp));
    if (!x.resp) {
        fputs("kvpoolctl: out of memory\n", stderr);
        return EXIT_SERVER;
    }
    int code = commands[ci](&x);
    kvp_client_close(x.c);
    free(x.resp);
    if (fflush(stdout) != 0 && code == EXIT_OK)
        code = EXIT_SERVER; /* e.g. a closed pipe or a full disk */
    return code;
}
