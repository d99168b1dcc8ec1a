/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvpoolctl.c - the operator CLI of kvpoold: status, stats, pool, seqs, clients, audit,
 * metrics, health, top (kvpoolctl_top.c), cache, help. It is a plain libkvpool client (an
 * observer: attached to no namespace unless --join names one, pool not mapped) that reads through
 * kvpool.h's calls alone, never a protocol type, and prints aligned tables for people (-o table,
 * -o wide with more columns, --no-headers for scripts) or one JSON object (-o json, --json). As in
 * kubectl, -n NS is the namespace a command acts on or filters by, in every command that has one.
 * It changes nothing in the daemon but for `cache flush`, a mutating call observers may not make:
 * that one joins a namespace (-n, default "kvpoolctl", which only operators may attach). The
 * command and option tables below also drive `help CMD`, `CMD --help` and the hidden `__complete`
 * that the bash completion (deploy/completion/kvpoolctl.bash) asks, so the three cannot drift
 * apart. Exit codes: 0 ok, 1 the daemon answered with an error, 2 usage error, 3 daemon unreachable
 * or timed out; `health` answers only 0 or 1, as container and service health checks expect. This
 * file is the command line (tables, help, parsing, completion, main); the commands are
 * kvpoolctl_cmd.c and kvpoolctl_stats.c, the output helpers kvpoolctl_out.c.
 */
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"
#include "kvpoolctl.h"

/* The namespace `cache flush` joins when --namespace names none (a reserved name: root and the
 * daemon's uid only). */
#define FLUSH_NS "kvpoolctl"

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
                  "  status                 daemon, backend, geometry, usage, the cache's host\n"
                  "                         tier (when it has one) and round-trip time (wide:\n"
                  "                         every device, also the only one)\n"},
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
         "                         it since start), evictions by reason, the host tier\n"
         "                         (pages, slots, bytes ready, hits, moves, GB/s), one row\n"
         "                         per scope (-n: the row of NS's private scope ns:NS, or\n"
         "                         of the --cache-scope named; wide: the scopes' lifetime\n"
         "                         totals)\n"
         "  cache flush [--scope S | --all]\n"
         "                         drop every cached page nobody holds (pinned and held\n"
         "                         pages stay) in scope S, in every scope (--all), or, with\n"
         "                         neither, in the scope of namespace NS of -n; prints the\n"
         "                         pages dropped. A mutating call: it joins namespace NS of\n"
         "                         -n (default \"kvpoolctl\", which only root and the\n"
         "                         daemon's uid may join; others name their own with -n,\n"
         "                         and --cache-scope when it shares a scope); --scope and\n"
         "                         --all are for those operators\n"
         "  cache dump             every cached block (hash, medium, parent, scope; -o json:\n"
         "                         token ids too, and next_seq: the snapshot a KV-event\n"
         "                         consumer loads before the stream); an operator sees every\n"
         "                         scope, -n NS joins NS and sees its scope\n"},
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

/* ---- main --------------------------------------------------------------------------------- */

static int (*const commands[NUM_CMDS])(ctl_t *x) = {
    [C_STATUS] = kvp_ctl_cmd_status,   [C_STATS] = kvp_ctl_cmd_stats,
    [C_POOL] = kvp_ctl_cmd_pool,       [C_SEQS] = kvp_ctl_cmd_seqs,
    [C_CLIENTS] = kvp_ctl_cmd_clients, [C_TRANSFERS] = kvp_ctl_cmd_transfers,
    [C_AUDIT] = kvp_ctl_cmd_audit,     [C_METRICS] = kvp_ctl_cmd_metrics,
    [C_HEALTH] = kvp_ctl_cmd_health,   [C_TOP] = kvp_ctl_cmd_top,
    [C_CACHE] = kvp_ctl_cmd_cache,     [C_HELP] = NULL, /* in main */
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
            printf("kvpoolctl %s (protocol %u)\n", KVP_VERSION_STRING,
                   kvp_client_protocol_version());
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
        if (ci == C_CACHE) {
            puts("flush");
            puts("dump");
        }
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
        kvp_ctl_stats_t *s = malloc(sizeof(*s));
        char why[256];
        if (s && kvp_ctl_connect(&x, why, sizeof(why)) == 0 && kvp_ctl_get_stats(&x, s) == 0)
            for (uint32_t i = 0; i < s->s.num_namespaces; i++)
                puts(s->namespaces[i].name);
        kvp_client_close(x.c);
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
    } else if (ci == C_CACHE && optind < sub_argc && strcmp(sub_argv[optind], "dump") == 0) {
        o.dump = 1;
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
    if (o.dump) {
        if (o.interval_set)
            die_usage("--interval and --watch apply to cache, not to cache dump");
        if (o.ns && o.join && strcmp(o.ns, o.join) != 0)
            die_usage("cache dump: -n and --join name two namespaces");
        if (!o.join)
            o.join = o.ns; /* a tenant sees its scope by joining its namespace */
    }
    if (o.cache_scope && !o.join)
        die_usage("--cache-scope needs a namespace to join (--join NS, or cache flush -n NS)");

    resolve_socket(&o);
    /* names of the wire's size (namespaces in Hello and ListSequences, scopes in CacheFlush
     * and Hello): KVP_CLIENT_NAME_BYTES, NUL included */
    check_name("-n/--namespace", o.ns, KVP_CLIENT_NAME_BYTES);
    check_name("--join", o.join, KVP_CLIENT_NAME_BYTES);
    if (o.flush_scope && strlen(o.flush_scope) >= KVP_CLIENT_NAME_BYTES)
        die_usage("scope longer than %zu bytes", (size_t)KVP_CLIENT_NAME_BYTES - 1);
    if (o.cache_scope && strlen(o.cache_scope) >= KVP_CLIENT_NAME_BYTES)
        die_usage("cache scope longer than %zu bytes", (size_t)KVP_CLIENT_NAME_BYTES - 1);

    ctl_t x;
    memset(&x, 0, sizeof(x));
    x.o = &o;
    x.cmd = cmd;
    int code = commands[ci](&x);
    kvp_client_close(x.c);
    if (fflush(stdout) != 0 && code == EXIT_OK)
        code = EXIT_SERVER; /* e.g. a closed pipe or a full disk */
    return code;
}
