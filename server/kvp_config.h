/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_config.h - the configuration of kvpoold: every setting with its default, loaded from an
 * INI file (libinih), then command-line flags over it, then validated as a whole.
 *
 * Order of precedence: built-in defaults < the file named by --config < the environment (only
 * for the [tuning] keys: KVPOOL_<KEY>, see there) < the other flags and --set (whatever their
 * order on the command line). kvp_config_validate checks each value's range, the relations
 * between values and the pool geometry (through kvp_geom_validate), and derives num_pages from
 * pool_bytes. A reload (SIGHUP) reads the file and the environment again, re-applies the
 * command-line settings and reports the changed settings that only take effect at a restart.
 * This module only parses and checks: it opens no socket, resolves no user or group and starts
 * nothing.
 *
 * The file (every key optional; '#' or ';' starts a comment line; sizes take a K, M, G or T
 * suffix, alone or with "iB": all are powers of 1024; booleans are true|false|yes|no|on|off|
 * 1|0). A key outside these sections, a key set twice in one file and a line longer than
 * 199 characters (libinih's line buffer) are errors, except that the list keys (devices,
 * allowed_uids, allowed_gids) may be repeated: each line adds its entries to the list.
 *
 * The keys, their defaults, bounds, reload rules and documentation are the rows of the
 * settings table in kvp_config.c, and for [limits] and [transfer] (the rpc layer's limits) of
 * rpc/kvp_rpc_limits.h; kvpoold.conf(5) and the example deploy/kvpoold.conf are generated from
 * them. Sections: [server] (socket, connections, logging, metrics, threads), [pool] (the
 * geometry, kvp_geom.h), [limits] (tables, retry memory, leases, quotas, the prefix cache),
 * [access] (who may connect, receive the pool's fds, share cache scopes), [transfer] (NCCL
 * transfers, kvp_xfer.h) and [tuning] (the cuda backend's knobs; every [tuning] key may also
 * come from KVPOOL_<KEY>). A reload applies the rows marked reloadable and keeps, and reports,
 * the others.
 */
#ifndef KVP_CONFIG_H
#define KVP_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvp_geom.h"
#include "kvp_rpc_limits.h"
#include "kvp_server_limits.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVP_CONFIG_SOCKET_MAX    108  /* sizeof(sun_path): at most 107 bytes and a NUL */
#define KVP_CONFIG_NAME_MAX      64   /* socket_group, metrics_listen, with the NUL */
#define KVP_CONFIG_PATH_MAX      4096 /* the config file's path, with the NUL */
#define KVP_CONFIG_MAX_IDS       64   /* entries of devices, allowed_uids, allowed_gids */
#define KVP_CONFIG_VALUE_MAX     256  /* one value given on the command line, with the NUL */
#define KVP_CONFIG_LIB_MAX       256  /* tuning.nccl_lib, with the NUL */
#define KVP_CONFIG_SCOPES_MAX    1024 /* access.cache_scopes, with the NUL */
#define KVP_CONFIG_ENDPOINT_MAX  256  /* events.endpoint, replay_endpoint, topic, with the NUL */
#define KVP_CONFIG_MAX_OVERRIDES 96   /* >= the number of keys: one slot per key */

typedef enum {
    KVP_CONFIG_BACKEND_AUTO = 0,
    KVP_CONFIG_BACKEND_HOST = 1,
    KVP_CONFIG_BACKEND_CUDA = 2,
} kvp_config_backend_t;

/* What the command line asks for (kvp_config_parse_args). */
typedef enum {
    KVP_CONFIG_RUN = 0,     /* serve */
    KVP_CONFIG_CHECK = 1,   /* --check-config: validate, print the effective config, exit */
    KVP_CONFIG_VERSION = 2, /* --version */
    KVP_CONFIG_HELP = 3,    /* -h, --help */
} kvp_config_action_t;

typedef struct {
    uint32_t count;
    uint32_t ids[KVP_CONFIG_MAX_IDS];
} kvp_config_idlist_t;

/* One command-line setting, kept so that a reload can apply it again over the new file. */
typedef struct {
    uint32_t key; /* internal index of the setting */
    char value[KVP_CONFIG_VALUE_MAX];
} kvp_config_override_t;

/* Plain data: may be copied by assignment. Each field is a key of the settings table
 * (kvp_config.c), which gives its meaning, default and bounds. */
typedef struct {
    /* [server] */
    char socket[KVP_CONFIG_SOCKET_MAX];
    uint32_t socket_mode;
    char socket_group[KVP_CONFIG_NAME_MAX];
    KVP_SERVER_LIMITS_KEYS(KVP_RPC_LIMIT_FIELD) /* server/kvp_server_limits.h */
    uint64_t max_frame_bytes;
    int log_level; /* KVP_LOG_* */
    bool watchdog;
    char metrics_listen[KVP_CONFIG_NAME_MAX];
    uint32_t metrics_max_connections;
    uint32_t metrics_max_connections_per_peer;
    uint32_t metrics_head_timeout_ms;
    uint32_t metrics_timeout_ms;
    uint32_t copy_threads;
    uint32_t busy_poll_us;
    uint32_t commit_poll_ms;
    /* [pool] */
    kvp_config_backend_t backend;
    kvp_config_idlist_t devices;
    uint32_t num_layers;
    uint32_t num_pages;
    uint64_t pool_bytes;
    uint32_t page_size;
    uint32_t num_kv_heads;
    uint32_t head_dim;
    kvp_dtype_t dtype;
    kvp_layout_t layout;
    kvp_storage_t storage;
    /* [limits] and [transfer]: the rows of rpc/kvp_rpc_limits.h, the same fields as
     * kvp_rpc_limits_t's (the [transfer] ones named transfer_<key>) */
    KVP_RPC_LIMITS_KEYS(KVP_RPC_LIMIT_FIELD)
    KVP_RPC_TRANSFER_KEYS(KVP_RPC_LIMIT_FIELD)
    KVP_RPC_CACHE_KEYS(KVP_RPC_LIMIT_FIELD)
    /* [access] */
    kvp_config_idlist_t allowed_uids;
    kvp_config_idlist_t allowed_gids;
    kvp_config_idlist_t pool_uids;
    kvp_config_idlist_t pool_gids;
    char cache_scopes[KVP_CONFIG_SCOPES_MAX];
    /* [events] (issue #29) */
    char events_endpoint[KVP_CONFIG_ENDPOINT_MAX];
    char events_replay_endpoint[KVP_CONFIG_ENDPOINT_MAX];
    char events_topic[KVP_CONFIG_ENDPOINT_MAX];
    uint32_t events_buffer_steps;
    uint32_t events_batch_ms;
    uint32_t events_hwm;
    /* [tuning] */
    uint32_t cuda_ready_timeout_ms;
    bool cuda_plan_upload;
    uint32_t append_kernel; /* 0 auto, 1 warp, 2 block: KVP_APPEND_CUDA_KERNEL_* */
    uint32_t append_tokens_per_block;
    uint32_t append_blocks_per_sm;
    uint32_t append_warps_per_block;
    uint32_t append_hints; /* 0 none, 1 ld, 2 st, 3 ldst: KVP_APPEND_CUDA_HINT_* bits */
    uint32_t append_vecs_per_thread;
    uint32_t pack_blocks;
    uint32_t xfer_stages;
    bool xfer_register;
    bool xfer_priority;
    char nccl_lib[KVP_CONFIG_LIB_MAX];

    /* Where the settings came from: the last file loaded ("" for none) and the command-line
     * settings recorded by kvp_config_parse_args, in the order of first appearance. */
    char config_path[KVP_CONFIG_PATH_MAX];
    uint32_t num_overrides;
    kvp_config_override_t overrides[KVP_CONFIG_MAX_OVERRIDES];
} kvp_config_t;

/* Every error message below is written to err (NUL-terminated, truncated to err_len; err may be
 * NULL) and names the file and line where there is one, the key, and the offending value. On
 * success err holds "" (except for kvp_config_reload_file, see there). */

/* Fills *cfg with the defaults of the settings table's rows (reads geteuid() and
 * $XDG_RUNTIME_DIR for the socket path). No file, no overrides. */
void kvp_config_defaults(kvp_config_t *cfg);

/* Applies the settings of the INI file at path over *cfg and records path in cfg->config_path.
 * Returns 0; -errno when the file cannot be opened or read ("cannot open PATH: reason");
 * KVP_EINVAL for an unknown section or key, a key outside a section or set twice, a bad value,
 * a syntax error or a line that is too long ("PATH:LINE: ..."). On error *cfg is unchanged. */
int kvp_config_load_file(kvp_config_t *cfg, const char *path, char *err, size_t err_len);

/* The same for INI text in memory; `name` stands for the file name in messages. Does not touch
 * cfg->config_path. */
int kvp_config_load_string(kvp_config_t *cfg, const char *text, const char *name, char *err,
                           size_t err_len);

/* Sets one key ("server.log_level") from its text form, as a file line would. Returns 0 or
 * KVP_EINVAL (unknown key, bad value); on error *cfg is unchanged. Not recorded as an override. */
int kvp_config_set(kvp_config_t *cfg, const char *key, const char *value, char *err,
                   size_t err_len);

/* Applies the environment's overrides of the [tuning] keys over *cfg: for each key the
 * variable KVPOOL_<KEY> (upper case), when set, is parsed and checked as a file line would be.
 * Returns 0, or KVP_EINVAL with "environment KVPOOL_<KEY>: tuning.<key>: invalid value 'V':
 * <the allowed values or range>"; on error *cfg is unchanged. Not recorded as an override
 * (the environment is read again by a reload). kvp_config_parse_args calls it. */
int kvp_config_apply_env(kvp_config_t *cfg, char *err, size_t err_len);

/* Reads the command line over *cfg (normally fresh from kvp_config_defaults): argv[1..argc)
 * holds long options as "--opt value" or "--opt=value":
 *   --config FILE, --socket PATH, --backend B, --devices LIST, --num-layers N, --num-pages N,
 *   --pool-bytes SIZE, --page-size N, --num-kv-heads N, --head-dim N, --dtype T, --layout L,
 *   --storage S, --log-level L, --set SECTION.KEY=VALUE (any key; may repeat),
 *   --check-config, --version, -h/--help.
 * The file named by --config (at most once) is loaded first, then the environment's [tuning]
 * overrides (kvp_config_apply_env), then every other setting applies over them in command-line
 * order; the settings are recorded in cfg->overrides for reloads. With
 * -h/--help or --version nothing is loaded or applied. Sets *action. Returns 0, or -errno /
 * KVP_EINVAL with a message (unknown option, missing value, positional argument, a file or
 * value error); on error *cfg is unchanged. Does not validate: call kvp_config_validate next. */
int kvp_config_parse_args(kvp_config_t *cfg, int argc, char *const argv[],
                          kvp_config_action_t *action, char *err, size_t err_len);

/* Prints the command-line help to out. */
void kvp_config_usage(FILE *out, const char *prog);

/* Checks the whole configuration: each value's range (also for fields set directly in the
 * struct), then relations (max_queued_bytes >= max_frame_bytes, default_lease_ms <=
 * max_lease_ms, distinct devices), then the geometry. When num_pages is 0 it is derived from
 * pool_bytes and stored in cfg (KVP_EINVAL when pool_bytes holds no page or too many). Returns
 * 0; KVP_EINVAL naming the key(s); or the KVP_EGEOM_* code of kvp_geom_validate with its
 * message ("pool: invalid geometry: ..."). On error *cfg is unchanged. */
int kvp_config_validate(kvp_config_t *cfg, char *err, size_t err_len);

/* The pool geometry of cfg (num_devices = the number of devices). Meaningful after
 * kvp_config_validate succeeded; before it num_pages may still be 0. */
void kvp_config_geom(const kvp_config_t *cfg, kvp_geom_t *g);

/* The number of host copy threads to start: copy_threads, or when 0 the number of CPUs this
 * process may run on (sched_getaffinity), clamped to 1..8. */
uint32_t kvp_config_copy_threads(const kvp_config_t *cfg);

/* Prints the configuration in INI form, every key, to out: a file that loads back to the same
 * settings. Used by --check-config. */
void kvp_config_dump(const kvp_config_t *cfg, FILE *out);

/* For a reload: builds in *out a fresh configuration from the defaults, the file at path, the
 * environment's [tuning] overrides and old's command-line settings, and validates it. Every
 * changed key that is not reloadable keeps old's value in *out (so *out is what the daemon can
 * run with now), and is listed in err as
 * "not reloadable, restart to apply: pool.num_pages, server.socket" (err is "" when there is
 * none); the result is validated again. Returns the number of such keys (>= 0), or a negative
 * code as kvp_config_load_file / kvp_config_validate do, with their message; on error *out is
 * unchanged. old is only read; out may not alias old. */
int kvp_config_reload_file(const kvp_config_t *old, const char *path, kvp_config_t *out, char *err,
                           size_t err_len);

/* Build time (kvp_confdoc): the documentation of every key, from the settings table. */
typedef enum {
    KVP_CONFIG_DOC_MAN = 0,     /* the KEYS chapter of kvpoold.conf(5), scdoc */
    KVP_CONFIG_DOC_EXAMPLE = 1, /* the example kvpoold.conf: each key, commented, its default */
} kvp_config_doc_t;

/* Copies the template tmpl to out, the line "@kvp_config_keys" (exactly one) replaced by the
 * keys of every section with their defaults, documentation and reload rules. For the example,
 * each line "@kvp_config_set section.key = value" sets that key (checked as --set would) and is
 * not copied: such a key is written uncommented with its value. Returns 0, KVP_EINVAL (a bad
 * template or value, with a message in err) or KVP_ENOMEM. */
int kvp_config_doc_render(kvp_config_doc_t kind, FILE *tmpl, FILE *out, char *err, size_t err_len);

/* "auto", "host", "cuda"; "invalid" otherwise. Static. */
const char *kvp_config_backend_name(kvp_config_backend_t b);

#ifdef __cplusplus
}
#endif
#endif
