/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvpoolctl.h - what the files of the kvpoolctl program share: its exit statuses, the parsed
 * command line (kvpoolctl.c), the context a command runs in, the connection and error report
 * every command uses, and the commands themselves (kvpoolctl_cmd.c, kvpoolctl_stats.c). Part of
 * the program, not of libkvpool: a command speaks to the daemon only through kvpool.h.
 */
#ifndef KVPOOLCTL_H
#define KVPOOLCTL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/un.h>

#include "kvpool.h"

enum {
    EXIT_OK = 0,
    EXIT_SERVER = 1,
    EXIT_USAGE = 2,
    EXIT_UNREACHABLE = 3,
};

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
    int dump;                /* cache dump */
} opts_t;

/* A command's context: the options, and the handle once kvp_ctl_connect made it (closed by
 * main). */
typedef struct {
    opts_t *o;
    const char *cmd;
    kvp_client_t *c;
} ctl_t;

/* One Stats answer with room for everything it lists (kvp_client_daemon_stats). */
typedef struct {
    kvp_daemon_stats_t s;
    kvp_namespace_stats_t namespaces[KVP_CLIENT_MAX_NAMESPACES];
    kvp_scope_stats_t scopes[KVP_CLIENT_MAX_SCOPES];
} kvp_ctl_stats_t;

/* Connects and says Hello (an observer unless the options name a namespace to join). Returns 0
 * or the exit status: with err NULL the message is printed, else it is left in err. */
int kvp_ctl_connect(ctl_t *x, char *err, size_t err_len);

/* Prints why `what` failed (libkvpool's message, else the code's) and returns the exit
 * status: EXIT_UNREACHABLE for a transport failure, else EXIT_SERVER. */
int kvp_ctl_report(ctl_t *x, int rc, const char *what);

/* Reads Stats into st, its arrays pointed at st's own. Returns 0 or libkvpool's code. */
int kvp_ctl_get_stats(ctl_t *x, kvp_ctl_stats_t *st);
/* The same into a new kvp_ctl_stats_t (the caller frees it), or NULL with the failure reported
 * and its exit status in *status. */
kvp_ctl_stats_t *kvp_ctl_read_stats(ctl_t *x, int *status);

/* How many namespaces the daemon has (visible to this uid): namespaces_total, or the list's
 * length from a daemon that does not send it. */
uint32_t kvp_ctl_ns_total(const kvp_daemon_stats_t *s);

/* The commands: each returns the process exit status. */
int kvp_ctl_cmd_status(ctl_t *x);
int kvp_ctl_cmd_stats(ctl_t *x);
int kvp_ctl_cmd_pool(ctl_t *x);
int kvp_ctl_cmd_seqs(ctl_t *x);
int kvp_ctl_cmd_clients(ctl_t *x);
int kvp_ctl_cmd_transfers(ctl_t *x);
int kvp_ctl_cmd_audit(ctl_t *x);
int kvp_ctl_cmd_metrics(ctl_t *x);
int kvp_ctl_cmd_health(ctl_t *x);
int kvp_ctl_cmd_top(ctl_t *x);
int kvp_ctl_cmd_cache(ctl_t *x);
int kvp_ctl_cmd_cache_dump(ctl_t *x); /* kvpoolctl_dump.c */

#endif
