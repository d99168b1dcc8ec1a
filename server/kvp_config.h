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
 *   [server]
 *   socket           path of the listening Unix socket, absolute, at most 107 bytes.
 *                    Default: /run/kvpool/kvpool.sock when run as root (euid 0), else
 *                    $XDG_RUNTIME_DIR/kvpool/kvpool.sock, else /tmp/kvpool-<uid>/kvpool.sock
 *                    (the rule of kvp_client_default_socket). Ignored under socket activation.
 *   socket_mode      permission bits of the socket file, octal, <= 0777. Default 0660.
 *   socket_group     group (name or number) given to the socket file; empty: the daemon's
 *                    group. Default empty.
 *   max_connections  connections served at once; more are refused. 1..1048576. Default 256.
 *   max_frame_bytes  largest frame accepted or sent (DESIGN.md §5). 4 KiB..1 GiB. Default 16 MiB.
 *   max_queued_bytes answers queued unsent on one connection (a client that does not read
 *                    them) before the daemon drops that client; must be >= max_frame_bytes. Up to
 * 16 GiB. Default 64 MiB.
 *   max_buffered_bytes  memory the daemon gives all connections together: read buffers and
 *                    unsent answers. A read buffer always gets its first 64 KiB; beyond that a
 *                    connection whose buffer would pass the budget is not read (it waits, loses
 *                    nothing) until memory comes back; a connection with answers unsent stops
 *                    being processed while the budget is spent (each may overshoot it by one
 *                    answer). 0 (no budget), or max_frame_bytes..64 GiB. Default 256 MiB.
 *                    Besides it, a connection with 1 MiB of unsent answers is neither read nor
 *                    processed until its client reads (backpressure, fixed).
 *   uid_max_connections connections one peer uid may hold (a uid at it gets RESOURCE_EXHAUSTED
 *                    and the connection closed; others still get in). The daemon's own uid and
 *                    root are exempt. 0 (no limit)..1048576. Default 128.
 *   hello_timeout_ms a connection that has not completed Hello this long after it was
 *                    accepted is answered DEADLINE_EXCEEDED and closed. 0 (off)..3600000.
 *                    Default 10000.
 *   frame_timeout_ms a frame begun and not completed within this long (counted while the daemon
 *                    reads the connection) closes it, with an answer; its fds go with it.
 *                    0 (off)..3600000. Default 10000.
 * log_level        emerg|alert|crit|err|warning|notice|info|debug. Default
 * info. watchdog         send WATCHDOG=1 when systemd asks for it (WATCHDOG_USEC). Default true.
 *   metrics_listen   host:port of the Prometheus HTTP endpoint ("127.0.0.1:9464",
 *                    "[::1]:9464"); empty: off. Default empty.
 *   metrics_max_connections  HTTP connections at once (kvp_http.h). 1..1024. Default 16.
 *   metrics_max_connections_per_peer  of them from one peer address. 1..1024. Default 8.
 *   metrics_head_timeout_ms  time a connection has to send its request head. 10..60000.
 *                    Default 1000.
 *   metrics_timeout_ms  one connection's whole life (head, answer, close); the head
 *                    deadline is the smaller of the two. 100..600000. Default 5000.
 *                    Fairness: a new connection over either limit evicts the oldest
 *                    connection (of that peer, for the per-peer limit) that has not sent its
 *                    head and is older than a tenth of the head deadline; when none may go
 *                    yet, the newcomer waits and accepting pauses (kvp_http.h). Idle sockets
 *                    therefore cannot lock a scraper out, even from the same address.
 *   drain_timeout_ms on SIGTERM, how long in-flight work may take before exit. 0..3600000.
 *                    Default 10000.
 *   copy_threads     worker threads for the requests that leave the event loop (the
 *                    backends' copies); 0: the number of usable CPUs, at most 8 (see
 *                    kvp_config_copy_threads). 0..256. Default 0.
 *   busy_poll_us     after each request, the event loop and the worker threads poll that many
 *                    microseconds for the next one instead of sleeping (server/kvp_jobs.h: a
 *                    wake-up costs tens of microseconds on a virtual machine). Trades up to
 *                    one CPU per busy thread, while requests flow, for latency. 0 (off)..
 *                    1000000. Default 0.
 *   commit_poll_ms   how often the daemon polls the events of pending prefix-cache Commits
 *                    (the pages become findable at the first poll that sees the worker's
 *                    event complete). 1..1000. Default 1. Reloadable.
 *   [pool]           (the geometry: DESIGN.md §3, kvp_geom.h)
 *   backend          auto|host|cuda. auto: cuda when a GPU is usable, else host. Default auto.
 *   devices          comma list of distinct CUDA ordinals (0..1023), 1..16 of them
 * (KVP_MAX_DEVICES). The geometry's num_devices (tensor-parallel group size G) is their number,
 *                    whatever the backend. Default "0".
 *   num_layers       Default 2.
 *   num_pages        pages in the pool; 0: derived from pool_bytes. Default 0.
 *   pool_bytes       bytes of the pool on ONE device (all layers, K and V); used only when
 *                    num_pages = 0, then num_pages = pool_bytes / (bytes of one page over all
 *                    layers, K and V, on one device). Default 256 MiB.
 *   page_size        tokens per page. Default 16.
 *   num_kv_heads     H, over all devices. Default 8.
 *   head_dim         D. Default 128.
 *   dtype            fp8_e4m3|fp8_e5m2|fp16|bf16|fp32. Default fp16.
 *   layout           nhd|hnd. Default nhd.
 *   storage          combined|split. Default combined.
 *   [limits]
 *   max_seqs               live sequences over all namespaces. 1..67108864. Default 65536.
 *   max_namespaces         namespaces at once. 1..1048576. Default 256.
 *   max_batch              sequences in one Append/Reserve. 1..1048576. Default 4096.
 *   max_batch_tokens       tokens in one Append/Reserve. 1..2147483647. Default 1048576.
 *   max_seq_tokens         tokens of one sequence; 0: the pool's capacity. 0..2147483647.
 *                          Default 0.
 *   max_buffers_per_client registered buffers of one connection. 1..65536. Default 64.
 *   max_buffer_bytes       size of one registered buffer. 1..2^50. Default 64 GiB.
 *   dedup_ns_max_bytes     bytes of answers one namespace's retry window keeps (an answer above
 *                          256 KiB is never kept); the oldest answer gives way first and its
 *                          id is then refused as "applied, not kept". 4 KiB..1 TiB. Default
 *                          8 MiB. Reloadable.
 *   dedup_max_bytes        the same over all namespaces together: with max_namespaces, what
 *                          bounds the daemon's retry memory. 4 KiB..1 TiB. Default 64 MiB.
 *                          Reloadable.
 *   dedup_window           request ids remembered per namespace for retries. 1..1048576.
 *                          Default 1024.
 *   default_lease_ms       lease of a Hello that asks for none. Default 30000.
 *   max_lease_ms           largest lease a client may ask for; >= default_lease_ms.
 *                          Up to 2^32-1. Default 86400000 (one day).
 *   Per-namespace quotas (0: none; a namespace is the unit a tenant gets). A request that
 *   would pass one is refused with RESOURCE_EXHAUSTED and changes nothing; lowering one below
 *   what a namespace holds only refuses further growth:
 *   ns_max_seqs            live sequences of one namespace. 0..67108864. Default 0.
 *   ns_max_pages           page references of one namespace (a page shared by k of its
 *                          sequences counts k times: exact and O(1), see README). 0..2^32-1.
 *                          Default 0.
 *   ns_max_buffer_bytes    bytes of the buffers registered by all connections of one
 *                          namespace together. 0..2^50. Default 0.
 *   ns_max_connections     connections attached to one namespace at once (a Hello above it
 *                          is refused). 0..1048576. Default 0.
 *   Per-uid quotas (0: none) for every uid but root and the daemon's own (the operators), so
 *   one tenant cannot fill the global tables; above one a request is RESOURCE_EXHAUSTED:
 *   uid_max_namespaces     namespaces one uid owns (a Hello creating one more is refused).
 *                          0..1048576. Default 32.
 *   uid_max_idle_namespaces  of them with no session, a lease pending: beyond it the one
 *                          whose lease ends first is released at once. 0..1048576. Default 8.
 *   uid_max_seqs           live sequences over all the namespaces one uid owns. 0..67108864.
 *                          Default 16384 (a quarter of the default max_seqs).
 *   The prefix cache (kvpool.proto, prefix cache; DESIGN.md §9):
 *   max_cache_scopes       scopes known at once (a namespace's private one, and each name a
 *                          Hello gives; one with no namespace and nothing held is reused).
 *                          1..1048576. Default 256.
 *   Pins hold pages against eviction, so each has a share (issue #26 defects 5, 6); a Pin
 *   above one is RESOURCE_EXHAUSTED naming the limit it hit. Pinned pages also count against
 *   ns_max_pages, and a namespace kept only for its pins counts as an idle namespace of its
 *   uid (uid_max_idle_namespaces). Root and the daemon's uid are exempt from the uid_ keys.
 *   max_pins               pins alive at once over the daemon. 1..65535. Default 1024.
 *   ns_max_pins            pins of one namespace. 0..65535 (0: no limit). Default 64.
 *   uid_max_pins           pins over all the namespaces one uid owns. 0..65535 (0: no
 *                          limit). Default 256.
 *   ns_max_pinned_pages    pages one namespace may keep pinned (a page in two pins counts
 *                          twice). 0: derived from the pool, num_pages / 8 (at least 1); set
 *                          num_pages or more for no limit. Default 0. Reloadable.
 *   uid_max_pinned_pages   the same over all the namespaces of one uid. 0: num_pages / 4 (at
 *                          least 1). Default 0. Reloadable.
 *   ns_max_priority        highest retention priority (CacheOptions.priority) a non-operator
 *                          may give; above it a request is PERMISSION_DENIED. Eviction is
 *                          daemon-wide, lowest priority first, so a tenant's priority ranks
 *                          its pages against every other tenant's: the operators keep the
 *                          range above this for what they decide. 0..100. Default 50.
 *   pin_max_ttl_ms         longest pin (a Pin asking more is cut to it). Default 86400000.
 *                          Reloadable.
 *   max_lookup_tokens      tokens one Lookup or Pin may carry: the work of one call on the
 *                          event loop (every other client waits behind it). 0: 16384 pages'
 *                          worth, 16384 x page_size tokens, at most 1048576 (about 1 ms of
 *                          the loop on the CI machine at page size 4). Default 0. Reloadable.
 *   [access]         who may connect (checked on each connection with SO_PEERCRED and
 *                    SO_PEERGROUPS; a peer that is refused gets PERMISSION_DENIED and is
 *                    disconnected). The daemon's own uid and root may always connect.
 *   allowed_uids     comma list of numeric uids that may connect, at most 64.
 *   allowed_gids     comma list of numeric gids whose members (primary or supplementary
 *                    group) may connect, at most 64.
 *                    Both empty (the default): members of the socket file's group may
 *                    connect (server.socket_group, else the daemon's group), as the socket's
 *                    0660 mode says. Either set: exactly the listed uids and groups (and the
 *                    daemon's uid and root). A namespace belongs to the uid that created it;
 *                    other uids (root excepted) are refused with PERMISSION_DENIED.
 *   pool_uids        comma list of uids that may receive the pool's memory (the fds of
 *                    Hello/PoolInfo want_pool_fds), at most 64.
 *   pool_gids        the same by primary gid, at most 64. Both empty (the default): every
 *                    admitted uid may (one trust domain). Either set: the listed ones, root
 *                    and the daemon's uid; anyone else asking gets PERMISSION_DENIED and keeps
 *                    to daemon-run calls (RegisterBuffer + Append). Trust model: any
 *                    process holding the pool fds can map ALL of the pool read-write;
 *                    namespace ownership protects allocation, not data. The daemon warns once
 *                    (and Stats.pool_shared_across_uids says) when two uids were given them.
 *   cache_scopes     the prefix-cache scopes shared across uids and who may join each:
 *                    "name=uid,uid;name2=uid" (at most 32 scopes of 16 uids). A Hello naming
 *                    a listed scope joins it if its uid is listed (or is root or the
 *                    daemon's), else gets PERMISSION_DENIED; an unlisted scope name is the
 *                    uid's own (kvp_access.h). Default "": no KV shared across uids.
 *   [transfer]       KV transfers between daemons over NCCL (kvp_xfer.h, DESIGN.md §6)
 *   timeout_ms       longest time one ExportBegin or Import may take, the peer's join
 *                    included, when the request names none. 1..3600000. Default 30000.
 *   comm_idle_ms     a cached NCCL communicator unused this long is destroyed (the exporter
 *                    stops reusing it after half). 1000..2^32-1. Default 300000.
 *   max_in_flight    transfers running at once (exports and imports; each holds a worker
 *                    thread of server.copy_threads while it runs). 1..64. Default 2.
 *   chunk_bytes      the largest staging chunk of an export (the importer stages in the
 *                    exporter's chunks): the stream is packed, sent, received and unpacked in
 *                    chunks, two per side in flight, ramping up from an eighth of it and down
 *                    to 4 MiB at the end. 0: a quarter of the stream within 4..256 MiB.
 *                    0..1073741824 (rounded up to 256 bytes). Default 0.
 *                    transfer.timeout_ms, transfer.comm_idle_ms and transfer.chunk_bytes are
 *                    reloadable, transfer.max_in_flight needs a restart.
 *   [tuning]         how the cuda backend, its kernels and the transfers run: the knobs the
 *                    benchmarks compare (tests/bench/README.md); the defaults are what they
 *                    chose. Every key may also be set by the environment variable KVPOOL_ and
 *                    the key in upper case (cuda_plan_upload: KVPOOL_CUDA_PLAN_UPLOAD), parsed
 *                    and range-checked as the file's value (a bad one stops the start, naming
 *                    the variable); the environment overrides the file, --set and the flags
 *                    override the environment. Every key needs a restart. The host backend
 *                    uses none of them.
 *   cuda_ready_timeout_ms  longest wait for a worker's ready event before an Append is refused
 *                    (a dead or stuck worker). 1..3600000. Default 30000.
 *   cuda_plan_upload every Append uploads its plan and runs the page-table kernel, even where
 *                    the slot kernel would do (to compare the two paths). Default false.
 *   append_kernel    the daemon's copy kernel for Appends with copies or over 1024 tokens:
 *                    auto|warp|block|flat (auto: a warp per token for small batches, the
 *                    block kernel for larger ones). Default auto.
 *   append_tokens_per_block  tokens per block of the block kernel; 0: automatic. 0..64.
 *                    Default 0.
 *   append_blocks_per_sm  cap of the block kernel's grid in blocks per SM (a persistent grid);
 *                    0: none. 0..1024. Default 0.
 *   append_warps_per_block  tokens per block of the warp kernel; 0: automatic (2).
 *                    0..8. Default 0.
 *   append_hints     evict-first hints on the source loads and/or the pool stores:
 *                    none|ld|st|ldst. Default none.
 *   append_vecs_per_thread  16-byte vectors each thread of the warp kernel moves (so whole
 *                    warps of ceil(row vectors / this) threads take a token); 0: automatic
 *                    (2). 0..8. Default 0.
 *   pack_blocks      cap of the transfer pack/unpack kernels' grid; 0: two blocks per SM.
 *                    0..65535. Default 0.
 *   xfer_stages      staging chunks per side of a transfer in flight. 2..4. Default 2.
 *   xfer_register    staging buffers from ncclMemAlloc, registered with the communicator on
 *                    both sides (when the library has it). Default false.
 *   xfer_priority    NCCL's stream at high priority, the pack's at low. Default false.
 *   nccl_lib         the NCCL library transfers dlopen: a file name (searched as dlopen does)
 *                    or a path, at most 255 bytes; empty: libnccl.so.2. Default libnccl.so.2.
 *
 * Reloadable at run time: server.log_level, server.max_connections, server.max_queued_bytes,
 * server.max_buffered_bytes, server.uid_max_connections, server.hello_timeout_ms,
 * server.frame_timeout_ms,
 * server.drain_timeout_ms, limits.max_batch_tokens, limits.max_buffer_bytes,
 * limits.default_lease_ms, limits.max_lease_ms, limits.dedup_ns_max_bytes,
 * limits.dedup_max_bytes, the limits.ns_max_* quotas (applied to every
 * namespace, existing ones included), and the [access] keys (for new connections). Every other key
 * needs a restart: the [limits] that size the daemon's tables (max_seqs, max_namespaces, max_batch,
 * max_seq_tokens, max_buffers_per_client, dedup_window), server.socket, socket_mode,
 * socket_group, max_frame_bytes, watchdog, metrics_listen, copy_threads, busy_poll_us, and all of
 * [pool] and [tuning].
 */
#ifndef KVP_CONFIG_H
#define KVP_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvp_geom.h"

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

/* Plain data: may be copied by assignment. Field meanings and defaults: see the file header. */
typedef struct {
    /* [server] */
    char socket[KVP_CONFIG_SOCKET_MAX];
    uint32_t socket_mode;
    char socket_group[KVP_CONFIG_NAME_MAX];
    uint32_t max_connections;
    uint64_t max_frame_bytes;
    uint64_t max_queued_bytes;
    uint64_t max_buffered_bytes;
    uint32_t uid_max_connections;
    uint32_t hello_timeout_ms;
    uint32_t frame_timeout_ms;
    int log_level; /* KVP_LOG_* */
    bool watchdog;
    char metrics_listen[KVP_CONFIG_NAME_MAX];
    uint32_t metrics_max_connections;
    uint32_t metrics_max_connections_per_peer;
    uint32_t metrics_head_timeout_ms;
    uint32_t metrics_timeout_ms;
    uint32_t drain_timeout_ms;
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
    /* [limits] */
    uint32_t max_seqs;
    uint32_t max_namespaces;
    uint32_t max_batch;
    uint32_t max_batch_tokens;
    uint32_t max_seq_tokens;
    uint32_t max_buffers_per_client;
    uint64_t max_buffer_bytes;
    uint32_t dedup_window;
    uint64_t dedup_ns_max_bytes;
    uint64_t dedup_max_bytes;
    uint32_t default_lease_ms;
    uint32_t max_lease_ms;
    uint32_t ns_max_seqs;
    uint32_t ns_max_pages;
    uint64_t ns_max_buffer_bytes;
    uint32_t ns_max_connections;
    uint32_t uid_max_namespaces;
    uint32_t uid_max_idle_namespaces;
    uint32_t uid_max_seqs;
    uint32_t max_cache_scopes;
    uint32_t max_pins;
    uint32_t ns_max_pins;
    uint32_t uid_max_pins;
    uint32_t ns_max_pinned_pages;
    uint32_t uid_max_pinned_pages;
    uint32_t ns_max_priority;
    uint32_t pin_max_ttl_ms;
    uint32_t max_lookup_tokens;
    /* [access] */
    kvp_config_idlist_t allowed_uids;
    kvp_config_idlist_t allowed_gids;
    kvp_config_idlist_t pool_uids;
    kvp_config_idlist_t pool_gids;
    char cache_scopes[KVP_CONFIG_SCOPES_MAX];
    /* [transfer] */
    uint32_t transfer_timeout_ms;
    uint32_t transfer_comm_idle_ms;
    uint32_t transfer_max_in_flight;
    uint32_t transfer_chunk_bytes;
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

/* Fills *cfg with the defaults (reads geteuid() and $XDG_RUNTIME_DIR for the socket path).
 * No file, no overrides. */
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

/* "auto", "host", "cuda"; "invalid" otherwise. Static. */
const char *kvp_config_backend_name(kvp_config_backend_t b);

#ifdef __cplusplus
}
#endif
#endif
