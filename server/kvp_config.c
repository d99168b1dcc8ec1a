/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_config.c - the settings parser: one table of settings drives everything here and in
 * kvp_config_doc.c. Each row is a key: its section, name, type and field, its default, its
 * bounds, whether a reload (SIGHUP) applies it, and its documentation. From the rows come the
 * defaults (kvp_config_defaults), the INI handler, --set and the named flags, the environment's
 * [tuning] overrides, validation, the reload comparison, --check-config's dump, and, at build
 * time, the keys of kvpoold.conf(5) and the example deploy/kvpoold.conf (kvp_confdoc).
 *
 * How to add a knob:
 *   - a [limits] or [transfer] key (the rpc layer's): one row in rpc/kvp_rpc_limits.h, then use
 *     r->lim.<field> in the rpc layer. The field appears in kvp_rpc_limits_t and kvp_config_t,
 *     kvpoold copies it to the rpc layer (KVP_RPC_LIMITS_COPY), kvp_rpc_set_limits copies it on
 *     a reload when the row says RELOAD, and kvp_rpc_create gives it the row's default when a
 *     caller left it 0 below the row's minimum.
 *   - a reloadable [server] key of the transport: one row in server/kvp_server_limits.h, then
 *     use s->cfg.<field> in kvp_server.c (kvpoold copies the rows at start and on a reload).
 *   - a key of another section: one row in settings[] below and its field in kvp_config_t
 *     (kvp_config.h), then its use: kvpoold.c hands it to the module that reads it (at start;
 *     on a reload too when the row says RELOAD, in on_signal).
 * The row's doc is the key's paragraph of kvpoold.conf(5) (scdoc markup); the generator adds
 * the default and the reload rule, and tests/docs/test_man.py checks the page and the example
 * against this table and against `kvpoold --check-config`.
 *
 * libinih does the INI syntax. It reads lines through our reader, which counts lines (the
 * handler of Debian's build gets no line number), rejects over-long lines instead of letting
 * inih split them into two, and notices unknown [sections] even when they hold no key. Every
 * public function works on a copy and commits it on success, so a failed load, parse or
 * validation leaves the caller's config as it was.
 */
#include "kvp_config.h"

#include "kvp_access.h"
#include "kvp_config_internal.h"
#include "kvp_rpc_limits.h"
#include "kvp_server_limits.h"

#include <assert.h>
#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <sched.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_knob.h"
#include "kvp_log.h"

typedef kvp__config_setting_t setting_t;

#define FIELD_SIZE(f)     sizeof(((kvp_config_t *)0)->f)
#define IS_RELOAD_RELOAD  true  /* a SIGHUP applies the new value */
#define IS_RELOAD_RESTART false /* a SIGHUP keeps the running value and says so */

/* A key whose default is written as in the file (def_text; NULL for T_SOCKET: computed). */
#define ROW(sec, f, type, def_text, min, max, reload, doc)                                         \
    {                                                                                              \
#sec, #f, type, offsetof(kvp_config_t, f), FIELD_SIZE(f), min, max, IS_RELOAD_##reload,    \
            NULL, 0, def_text, doc                                                                 \
    }

/* A key whose field is named otherwise (section_key). */
#define ROWF(sec, key, f, type, def_text, min, max, reload, doc)                                   \
    {                                                                                              \
#sec, #key, type, offsetof(kvp_config_t, f), FIELD_SIZE(f), min, max, IS_RELOAD_##reload,  \
            NULL, 0, def_text, doc                                                                 \
    }

/* A T_ENUM key: its value is the index of one of names (max = the last index). */
#define ENUM(sec, f, names, def_text, reload, doc)                                                 \
    {                                                                                              \
#sec, #f, T_ENUM, offsetof(kvp_config_t, f), FIELD_SIZE(f), 0,                             \
            sizeof(names) / sizeof(names[0]) - 1, IS_RELOAD_##reload, names, 0, def_text, doc      \
    }

/* A row of rpc/kvp_rpc_limits.h: [limits] and [transfer], U32 or SIZE, a numeric default. */
#define LIMIT(sec, key, f, type, def, min, max, reload, doc)                                       \
    {#sec,          #key, T_##type, offsetof(kvp_config_t, f),                                     \
     FIELD_SIZE(f), min,  max,      IS_RELOAD_##reload,                                            \
     NULL,          def,  NULL,     doc},

static const char *const append_kernels[] = {"auto", "warp", "block", "flat"};
static const char *const append_hints[] = {"none", "ld", "st", "ldst"};

#define KIB (1ull << 10)
#define MIB (1ull << 20)
#define GIB (1ull << 30)

/* Every key, in the order of --check-config and of the documentation. The [tuning] kernel
 * keys' bounds are kvp_kernels_cuda.h's (checked in kvpoold.c). */
static const setting_t settings[] = {
    ROW(server, socket, T_SOCKET, NULL, 0, 0, RESTART,
        "Path of the listening Unix socket (absolute, at most 107 bytes). Default: "
        "/run/kvpool/kvpool.sock when kvpoold runs as root, else "
        "$XDG_RUNTIME_DIR/kvpool/kvpool.sock, else /tmp/kvpool-_UID_/kvpool.sock (the path "
        "*kvpoolctl*(1) and libkvpool look for). The example configuration sets "
        "/run/kvpool/kvpool.sock. Ignored under socket activation (kvpoold.socket owns the socket "
        "then)."),
    ROW(server, socket_mode, T_MODE, "0660", 0, 0777, RESTART,
        "Permission bits of the socket file when kvpoold creates it (octal, at most 0777)."),
    ROW(server, socket_group, T_GROUP, "", 0, 0, RESTART,
        "Group of the socket file when kvpoold creates it (name or number); empty: the daemon's "
        "own group. The example configuration sets kvpool (the group of *kvpoold.socket*). Workers "
        "must be able to connect: give them this group."),
    /* clang-format off: the rows of a list expand to rows with their commas */
    KVP_SERVER_LIMITS_KEYS(LIMIT)
    /* clang-format on */
    ROW(server, max_frame_bytes, T_SIZE, "16MiB", 4 * KIB, GIB, RESTART,
        "Largest request or answer frame (4 KiB..1 GiB)."),
    ROW(server, log_level, T_LEVEL, "info", 0, 0, RELOAD,
        "emerg|alert|crit|err|warning|notice|info|debug. Under systemd the lines carry syslog "
        "priorities (<N>) for the journal; elsewhere RFC 3339 UTC timestamps."),
    ROW(server, watchdog, T_BOOL, "true", 0, 0, RESTART,
        "Send WATCHDOG=1 when the service manager asks for it (WatchdogSec=)."),
    ROW(server, metrics_listen, T_LISTEN, "", 0, 0, RESTART,
        "Prometheus endpoint: _host_:_port_ (\"127.0.0.1:9464\", \"[::1]:9464\") serving GET "
        "/metrics over HTTP; empty: off. Keep it on loopback or a management network "
        "(kvpoold.service allows only localhost: IPAddressAllow=)."),
    ROW(server, metrics_max_connections, T_U32, "16", 1, 1024, RESTART,
        "HTTP connections at once (1..1024)."),
    ROW(server, metrics_max_connections_per_peer, T_U32, "8", 1, 1024, RESTART,
        "HTTP connections at once from one peer address (1..1024)."),
    ROW(server, metrics_head_timeout_ms, T_U32, "1000", 10, 60000, RESTART,
        "Time an HTTP connection has to send its request head (ms, 10..60000); the head deadline "
        "is the smaller of this and metrics_timeout_ms. Fairness: over either connection limit a "
        "newcomer evicts the oldest connection (of its peer, for the per-peer limit) that has not "
        "sent its head and is older than a tenth of the head deadline; when none may go yet the "
        "newcomer waits and accepting pauses (the backlog keeps arrival order). Idle sockets "
        "cannot lock a scraper out, even one on the same host."),
    ROW(server, metrics_timeout_ms, T_U32, "5000", 100, 600000, RESTART,
        "The whole life of an HTTP connection: head, answer and close (ms, 100..600000)."),
    ROW(server, copy_threads, T_U32, "0", 0, 256, RESTART,
        "Worker threads for the requests that leave the event loop (the backends' copies); 0: the "
        "usable CPUs, at most 8 (0..256)."),
    ROW(server, busy_poll_us, T_U32, "0", 0, 1000000, RESTART,
        "After each request the event loop and the worker threads poll this many microseconds for "
        "the next one instead of sleeping (0..1000000; 0: off). A wake-up costs tens of "
        "microseconds on a virtual machine: on the H200 machine 200 took the Append RPC p50 from "
        "140-165 to 90-104 us under MPS. Costs up to a CPU per busy thread while requests flow."),
    ROW(server, commit_poll_ms, T_U32, "1", 1, 1000, RELOAD,
        "How often the daemon polls the events of pending prefix-cache Commits, in ms (1..1000): "
        "the pages a worker committed become findable at the first poll that sees its event "
        "complete."),
    ROW(pool, backend, T_BACKEND, "auto", 0, 0, RESTART,
        "auto (cuda when a GPU is usable, else host) | host | cuda."),
    ROW(pool, devices, T_IDLIST, "0", 1, 1023, RESTART,
        "CUDA ordinals of the tensor-parallel group, comma-separated (the group size G is their "
        "number; num_kv_heads must divide by it). Workers must see the same ordinals: same "
        "CUDA_VISIBLE_DEVICES as the daemon."),
    ROW(pool, num_layers, T_U32, "2", 0, UINT32_MAX, RESTART, "Model layers."),
    ROW(pool, num_pages, T_U32, "0", 0, UINT32_MAX, RESTART,
        "Pages in the pool; 0: derived from pool_bytes."),
    ROW(pool, pool_bytes, T_SIZE, "256MiB", 1, UINT64_MAX, RESTART,
        "Bytes of the pool on ONE device (all layers, K and V), used when num_pages = 0."),
    ROW(pool, page_size, T_U32, "16", 0, UINT32_MAX, RESTART, "Tokens per page."),
    ROW(pool, num_kv_heads, T_U32, "8", 0, UINT32_MAX, RESTART, "KV heads over all devices (H)."),
    ROW(pool, head_dim, T_U32, "128", 0, UINT32_MAX, RESTART, "Head dimension (D)."),
    ROW(pool, dtype, T_DTYPE, "fp16", 0, 0, RESTART,
        "fp8_e4m3|fp8_e5m2|fp16|bf16|fp32 (the cache's element type; appends never convert)."),
    ROW(pool, layout, T_LAYOUT, "nhd", 0, 0, RESTART, "nhd|hnd: FlashInfer's kv_layout."),
    ROW(pool, storage, T_STORAGE, "combined", 0, 0, RESTART,
        "combined (one [pages, 2, ...] tensor per layer) | split (a K tensor and a V tensor)."),
    /* clang-format off */
    KVP_RPC_LIMITS_KEYS(LIMIT)
    /* clang-format on */
    ROW(access, allowed_uids, T_IDLIST, "", 0, UINT32_MAX - 1, RELOAD,
        "Numeric uids that may connect, comma-separated (at most 64; the key may repeat)."),
    ROW(access, allowed_gids, T_IDLIST, "", 0, UINT32_MAX - 1, RELOAD,
        "Numeric gids whose members (primary or supplementary group) may connect, comma-separated "
        "(at most 64). Both empty: members of the socket file's group (socket_group, else the "
        "daemon's) may connect. Either set: exactly the listed uids and groups. The daemon's own "
        "uid and root may always connect; anyone else gets PERMISSION_DENIED. A namespace belongs "
        "to the uid that created it."),
    ROW(access, pool_uids, T_IDLIST, "", 0, UINT32_MAX - 1, RELOAD,
        "Numeric uids that may receive the pool's memory (the fds of Hello or PoolInfo with "
        "want_pool_fds, what a worker maps), comma-separated (at most 64); root and the daemon's "
        "uid always may. Anyone else gets PERMISSION_DENIED for the fds and keeps to daemon-run "
        "calls (RegisterBuffer + Append). pool_uids and pool_gids both empty (the default): every "
        "admitted uid may; when two uids have, the daemon logs \"pool memory shared across uids\" "
        "once and *kvpoolctl status* says so. See *TRUST MODEL*. Applies to new requests."),
    ROW(access, pool_gids, T_IDLIST, "", 0, UINT32_MAX - 1, RELOAD,
        "The same by primary gid: numeric gids, comma-separated (at most 64)."),
    ROW(access, cache_scopes, T_SCOPES, "", 0, 0, RESTART,
        "Prefix-cache scopes shared across uids, and who may join each: \"name=uid,uid;name2=uid\" "
        "(at most 32 scopes of 16 uids). A Hello naming a listed scope joins it when its uid is "
        "listed (or is root or the daemon's), else gets PERMISSION_DENIED; any other scope name is "
        "private to the uid that gives it. Names starting with ns: or uid: are refused (KV events "
        "name private and unlisted scopes so). A shared prefix cache is a timing side channel "
        "between "
        "its members: list only uids that trust each other. Default: nothing shared across uids."),
    KVP_RPC_TRANSFER_KEYS(LIMIT) KVP_RPC_CACHE_KEYS(LIMIT) ROWF(
        events, endpoint, events_endpoint, T_ZMQ, "", 0, 0, RESTART,
        "Where KV events go, in vLLM's format; empty: off. A ZMQ endpoint: one "
        "with a wildcard (\"tcp://\\*:5557\", \"::\") or an ipc:// or inproc:// one is bound, "
        "any other one connected to (a router that binds its SUB socket), as vLLM does. A bind "
        "that fails stops the start. Anyone who can reach the endpoint sees every scope's block "
        "hashes and token ids: bind loopback or an ipc:// path whose directory only the routers' "
        "uids may enter."),
    ROWF(events, replay_endpoint, events_replay_endpoint, T_ZMQ, "", 0, 0, RESTART,
         "A ROUTER socket for replay, always bound; empty: none. A DEALER sending [\"\", 8-byte "
         "big-endian start sequence] gets every buffered batch from there as [\"\", topic, "
         "sequence, payload], then [\"\", \"\", -1, \"\"]."),
    ROWF(events, topic, events_topic, T_TEXT, "", 0, 0, RESTART,
         "The first frame of every event message (subscribers filter on its prefix)."),
    ROWF(events, buffer_steps, events_buffer_steps, T_U32, "10000", 1, 1000000, RESTART,
         "Batches kept for replay (1..1000000)."),
    ROWF(events, batch_ms, events_batch_ms, T_U32, "1", 0, 1000, RESTART,
         "How long a batch gathers events before it is sent, in ms (0..1000; 8,192 block events "
         "close one sooner). 0: a batch per event-loop iteration that changed the cache, the "
         "lowest latency; each batch wakes the publisher's thread and ZMQ's, which on a busy "
         "daemon costs tens of microseconds of CPU a batch (bench_prefix --events)."),
    ROWF(events, hwm, events_hwm, T_U32, "100000", 1, 100000000, RESTART,
         "The PUB socket's high-water mark per subscriber, in batches, and the bound of batches "
         "waiting for the publisher's thread (1..100000000). Past it batches are dropped and "
         "counted (kvpool_events_dropped_total), never waited for."),
    ROW(tuning, cuda_ready_timeout_ms, T_U32, "30000", 1, 3600000, RESTART,
        "Longest wait for a worker's ready event before its Append is refused (ms, 1..3600000)."),
    ROW(tuning, cuda_plan_upload, T_BOOL, "false", 0, 0, RESTART,
        "Every Append uploads its plan and runs the page-table kernel, even where the slot kernel "
        "would do (to compare the two paths)."),
    ENUM(tuning, append_kernel, append_kernels, "auto", RESTART,
         "The copy kernel of the Appends with copies or over 1024 tokens: auto|warp|block|flat."),
    ROW(tuning, append_tokens_per_block, T_U32, "0", 0, 64, RESTART,
        "Tokens per block of the block kernel; 0: automatic (0..64)."),
    ROW(tuning, append_blocks_per_sm, T_U32, "0", 0, 1024, RESTART,
        "Cap of the block kernel's grid in blocks per SM (a persistent grid); 0: none (0..1024)."),
    ROW(tuning, append_warps_per_block, T_U32, "0", 0, 8, RESTART,
        "Tokens per block of the warp kernel; 0: automatic, 2 (0..8)."),
    ENUM(tuning, append_hints, append_hints, "none", RESTART,
         "Evict-first hints on the source loads and/or the pool stores: none|ld|st|ldst."),
    ROW(tuning, append_vecs_per_thread, T_U32, "0", 0, 8, RESTART,
        "16-byte vectors each thread of the warp kernel moves, so whole warps of ceil(row vectors "
        "/ this) threads take a token; 0: automatic, 2 (0..8)."),
    ROW(tuning, pack_blocks, T_U32, "0", 0, 65535, RESTART,
        "Cap of the transfers' pack and unpack kernels' grid; 0: two blocks per SM (0..65535)."),
    ROW(tuning, xfer_stages, T_U32, "2", 2, 4, RESTART,
        "Staging chunks per side of a transfer in flight (2..4)."),
    ROW(tuning, xfer_register, T_BOOL, "false", 0, 0, RESTART,
        "Staging buffers from ncclMemAlloc, registered with the communicator on both sides."),
    ROW(tuning, xfer_priority, T_BOOL, "false", 0, 0, RESTART,
        "NCCL's stream at high priority, the pack's at low."),
    ROW(tuning, nccl_lib, T_LIB, "libnccl.so.2", 0, 0, RESTART,
        "The NCCL library transfers load: a file name (searched as dlopen does) or a path; empty: "
        "libnccl.so.2."),
};

#define NUM_SETTINGS (sizeof(settings) / sizeof(settings[0]))
_Static_assert(NUM_SETTINGS <= KVP_CONFIG_MAX_OVERRIDES, "one override slot per key");

/* The sections, in file order, with the introduction the documentation gives each. */
static const struct {
    const char *name;
    const char *doc;
} sections[] = {
    {"server",
     "The listening socket, connection limits, logging, the metrics endpoint and the daemon's "
     "threads."},
    {"pool",
     "The pool's geometry (DESIGN.md §3). Every key here needs a restart, and a restart drops "
     "every sequence: workers re-create their KV."},
    {"limits",
     "Sizes of the daemon's tables, retry memory, leases, quotas and the prefix cache. "
     "Per-namespace quotas (ns_max_\\*; 0: none; a namespace is what a tenant gets): a request "
     "that would pass one is refused with RESOURCE_EXHAUSTED and changes nothing; lowering one "
     "below what a namespace holds only refuses further growth; a reload applies them to every "
     "namespace, existing ones included. Per-uid quotas (uid_max_\\*; 0: none) hold for every uid "
     "but root and the daemon's own (the operators), so one tenant cannot fill the global tables; "
     "a request above one is RESOURCE_EXHAUSTED. Names (namespaces, client names, peers, cache "
     "scopes) are 1 to 64 characters of A-Z a-z 0-9 and . \\_ : @ / + -; \"default\", "
     "\"kvpoolctl\" and \"kvpool.\\*\" are reserved for root and the daemon's uid."},
    {"access",
     "Who may connect, checked on each connection with SO_PEERCRED and SO_PEERGROUPS; a refused "
     "peer gets PERMISSION_DENIED and is disconnected. The daemon's own uid and root may always "
     "connect. A namespace belongs to the uid that created it. The list keys may repeat: each line "
     "adds its entries."},
    {"transfer",
     "KV transfers between daemons over NCCL (ExportBegin and Import; need the cuda backend and "
     "libnccl.so.2, or tuning.nccl_lib, at run time)."},
    {"cache",
     "The prefix cache's host memory tier (issue #28): where cached pages go when the GPU pool "
     "needs their room, and come back from on a hit. Off unless host_bytes is set."},
    {"events",
     "KV events (issue #29): every block the prefix cache stores or removes, on either tier, "
     "published in vLLM's wire format (ZMQ, msgpack; docs/EVENTS.md) for cache-aware routers "
     "(llm-d, Dynamo). "
     "Off unless endpoint is set. *kvpoolctl cache dump* gives the snapshot a late subscriber "
     "loads first."},
    {"tuning",
     "How the cuda backend, its kernels and the transfers run: the knobs the benchmarks compare; "
     "the defaults are what they chose. Each key may also come from the environment as KVPOOL_ and "
     "the key in upper case (xfer_stages: *KVPOOL_XFER_STAGES*), checked like a value in the file; "
     "the environment overrides the file, the command line overrides the environment. A bad value "
     "stops the start. Every key needs a restart. The host backend uses none of them."},
};
#define NUM_SECTIONS (sizeof(sections) / sizeof(sections[0]))

/* Named flags: each is --set for one key. */
static const struct {
    const char *flag;
    const char *key;
} flag_keys[] = {
    {"socket", "server.socket"},
    {"log-level", "server.log_level"},
    {"backend", "pool.backend"},
    {"devices", "pool.devices"},
    {"num-layers", "pool.num_layers"},
    {"num-pages", "pool.num_pages"},
    {"pool-bytes", "pool.pool_bytes"},
    {"page-size", "pool.page_size"},
    {"num-kv-heads", "pool.num_kv_heads"},
    {"head-dim", "pool.head_dim"},
    {"dtype", "pool.dtype"},
    {"layout", "pool.layout"},
    {"storage", "pool.storage"},
};

/* ---- messages -------------------------------------------------------------------------- */

static int fail(int code, char *err, size_t err_len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int fail(int code, char *err, size_t err_len, const char *fmt, ...)
{
    if (err && err_len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_len, fmt, ap);
        va_end(ap);
    }
    return code;
}

static void clear_err(char *err, size_t err_len)
{
    if (err && err_len)
        err[0] = '\0';
}

/* ---- the table ------------------------------------------------------------------------- */

static void *field(kvp_config_t *cfg, const setting_t *s)
{
    return (char *)cfg + s->offset;
}

static const void *cfield(const kvp_config_t *cfg, const setting_t *s)
{
    return (const char *)cfg + s->offset;
}

static int find_setting(const char *section, const char *name)
{
    for (size_t i = 0; i < NUM_SETTINGS; i++)
        if (strcmp(settings[i].section, section) == 0 && strcmp(settings[i].name, name) == 0)
            return (int)i;
    return -1;
}

/* "section.key" -> index, or -1. */
static int find_dotted(const char *key)
{
    const char *dot = strchr(key, '.');
    char section[16];
    if (!dot || (size_t)(dot - key) >= sizeof(section))
        return -1;
    memcpy(section, key, (size_t)(dot - key));
    section[dot - key] = '\0';
    return find_setting(section, dot + 1);
}

static bool known_section(const char *name)
{
    for (size_t i = 0; i < NUM_SECTIONS; i++)
        if (strcmp(sections[i].name, name) == 0)
            return true;
    return false;
}

/* ---- parsing values -------------------------------------------------------------------- */

/* A decimal unsigned integer that is the whole of [s, *end): returns 0, -1 (not a number:
 * empty, sign, space, garbage) or -2 (overflows 64 bits). *end is where parsing stopped. */
static int parse_decimal(const char *s, uint64_t *out, const char **end)
{
    if (!isdigit((unsigned char)*s))
        return -1;
    char *e;
    errno = 0;
    unsigned long long v = strtoull(s, &e, 10);
    if (errno == ERANGE)
        return -2;
    *out = v;
    *end = e;
    return 0;
}

/* A T_ENUM value: the index of its name (any case), or -1. */
static int parse_enum(const setting_t *s, const char *text)
{
    for (uint64_t i = 0; i <= s->max; i++)
        if (strcasecmp(text, s->names[i]) == 0)
            return (int)i;
    return -1;
}

/* "expected a|b|c" for a T_ENUM key. */
static int enum_fail(const setting_t *s, char *why, size_t why_len)
{
    size_t off = (size_t)snprintf(why, why_len, "expected ");
    for (uint64_t i = 0; i <= s->max && off < why_len; i++)
        off += (size_t)snprintf(why + off, why_len - off, "%s%s", i ? "|" : "", s->names[i]);
    return -1;
}

static int parse_backend(const char *s, kvp_config_backend_t *out)
{
    for (int b = KVP_CONFIG_BACKEND_AUTO; b <= KVP_CONFIG_BACKEND_CUDA; b++)
        if (strcasecmp(s, kvp_config_backend_name((kvp_config_backend_t)b)) == 0) {
            *out = (kvp_config_backend_t)b;
            return 0;
        }
    return -1;
}

/* Checks a list already parsed or set directly: count, element bound, duplicates. */
static int check_idlist(const setting_t *s, const kvp_config_idlist_t *l, char *why, size_t why_len)
{
    if (l->count > KVP_CONFIG_MAX_IDS)
        return fail(-1, why, why_len, "more than %u entries", KVP_CONFIG_MAX_IDS);
    if (l->count < s->min)
        return fail(-1, why, why_len, "at least %llu entry needed", (unsigned long long)s->min);
    for (uint32_t i = 0; i < l->count; i++) {
        if (l->ids[i] > s->max)
            return fail(-1, why, why_len, "entry %u is out of range 0..%llu", l->ids[i],
                        (unsigned long long)s->max);
        for (uint32_t j = 0; j < i; j++)
            if (l->ids[j] == l->ids[i])
                return fail(-1, why, why_len, "entry %u is listed twice", l->ids[i]);
    }
    return 0;
}

/* "a, b,c" -> list; empty text -> empty list. */
static int parse_idlist(const setting_t *s, const char *text, kvp_config_idlist_t *l, char *why,
                        size_t why_len)
{
    memset(l, 0, sizeof(*l));
    const char *p = text;
    while (*p == ' ' || *p == '\t')
        p++;
    if (!*p)
        return check_idlist(s, l, why, why_len);
    for (;;) {
        uint64_t v;
        const char *end;
        int r = parse_decimal(p, &v, &end);
        if (r == -2 || (r == 0 && v > s->max))
            return fail(-1, why, why_len, "entry out of range 0..%llu", (unsigned long long)s->max);
        if (r < 0)
            return fail(-1, why, why_len, "expected a comma-separated list of numbers");
        if (l->count == KVP_CONFIG_MAX_IDS)
            return fail(-1, why, why_len, "more than %u entries", KVP_CONFIG_MAX_IDS);
        l->ids[l->count++] = (uint32_t)v;
        p = end;
        while (*p == ' ' || *p == '\t')
            p++;
        if (!*p)
            break;
        if (*p != ',')
            return fail(-1, why, why_len, "expected a comma-separated list of numbers");
        p++;
        while (*p == ' ' || *p == '\t')
            p++;
    }
    return check_idlist(s, l, why, why_len);
}

static bool has_control(const char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || *s == 0x7f)
            return true;
    return false;
}

/* Checks a string field's text: NUL-terminated within the field, then per type. */
static int check_string(const setting_t *s, const char *v, char *why, size_t why_len)
{
    size_t len = strnlen(v, s->size);
    if (len == s->size)
        return fail(-1, why, why_len, "longer than %zu bytes", s->size - 1);
    if (has_control(v))
        return fail(-1, why, why_len, "control characters are not allowed");
    switch (s->type) {
    case T_SOCKET:
        if (v[0] != '/')
            return fail(-1, why, why_len, "expected an absolute path");
        return 0;
    case T_GROUP:
        for (const char *p = v; *p; p++)
            if (!isalnum((unsigned char)*p) && *p != '_' && *p != '.' && !(*p == '-' && p != v))
                return fail(-1, why, why_len, "expected a group name or number, or empty");
        return 0;
    case T_LISTEN: {
        if (!*v)
            return 0;
        const char *colon = strrchr(v, ':');
        uint64_t port;
        if (!colon || colon == v || kvp_knob_parse_u64(colon + 1, 1, 65535, &port) < 0)
            return fail(-1, why, why_len, "expected host:port (port 1..65535), or empty");
        if (v[0] == '[' && colon[-1] != ']')
            return fail(-1, why, why_len, "expected [ipv6-address]:port");
        if (v[0] != '[' && memchr(v, ':', (size_t)(colon - v)))
            return fail(-1, why, why_len, "an IPv6 address needs brackets: [addr]:port");
        if (memchr(v, ' ', len))
            return fail(-1, why, why_len, "expected host:port without spaces");
        return 0;
    }
    case T_ZMQ:
        if (!*v)
            return 0;
        if (strncmp(v, "tcp://", 6) && strncmp(v, "ipc://", 6) && strncmp(v, "inproc://", 9))
            return fail(-1, why, why_len, "expected tcp://, ipc:// or inproc://, or empty");
        if (strchr(v, ' '))
            return fail(-1, why, why_len, "expected an endpoint without spaces");
        return 0;
    case T_SCOPES: {
        kvp_scope_access_t a;
        memset(&a, 0, sizeof(a));
        char w[160];
        if (kvp_access_scopes_parse(v, &a, w, sizeof(w)))
            return fail(-1, why, why_len, "%s", w);
        return 0;
    }
    default:
        return 0;
    }
}

static int check_range(const setting_t *s, uint64_t v, char *why, size_t why_len)
{
    if (v < s->min || v > s->max)
        return fail(-1, why, why_len, "out of range %llu..%llu", (unsigned long long)s->min,
                    (unsigned long long)s->max);
    return 0;
}

/* Checks the value held in a field (also one set directly in the struct). */
static int check_field(const setting_t *s, const void *p, char *why, size_t why_len)
{
    switch (s->type) {
    case T_SOCKET:
    case T_GROUP:
    case T_LISTEN:
        return check_string(s, p, why, why_len);
    case T_U32:
        return check_range(s, *(const uint32_t *)p, why, why_len);
    case T_SIZE:
        return check_range(s, *(const uint64_t *)p, why, why_len);
    case T_MODE:
        return *(const uint32_t *)p <= s->max ? 0 : fail(-1, why, why_len, "above 0777");
    case T_BOOL:
        return 0;
    case T_LEVEL: {
        int v = *(const int *)p;
        return v >= KVP_LOG_EMERG && v <= KVP_LOG_DEBUG ? 0 : fail(-1, why, why_len, "not a level");
    }
    case T_BACKEND:
        return strcmp(kvp_config_backend_name(*(const kvp_config_backend_t *)p), "invalid")
                   ? 0
                   : fail(-1, why, why_len, "not a backend");
    case T_DTYPE:
        return kvp_dtype_size(*(const kvp_dtype_t *)p) ? 0 : fail(-1, why, why_len, "not a dtype");
    case T_LAYOUT:
        return strcmp(kvp_layout_name(*(const kvp_layout_t *)p), "invalid")
                   ? 0
                   : fail(-1, why, why_len, "not a layout");
    case T_STORAGE:
        return strcmp(kvp_storage_name(*(const kvp_storage_t *)p), "invalid")
                   ? 0
                   : fail(-1, why, why_len, "not a storage");
    case T_IDLIST:
        return check_idlist(s, p, why, why_len);
    case T_ENUM:
        return *(const uint32_t *)p <= s->max ? 0 : enum_fail(s, why, why_len);
    case T_LIB:
    case T_SCOPES:
    case T_ZMQ:
    case T_TEXT:
        return check_string(s, p, why, why_len);
    }
    return -1;
}

/* Parses `text` for setting s and stores it in cfg; on error writes why and leaves cfg as is. */
static int parse_into(kvp_config_t *cfg, const setting_t *s, const char *text, char *why,
                      size_t why_len)
{
    union {
        char str[KVP_CONFIG_SCOPES_MAX];
        uint32_t u32;
        uint64_t u64;
        int level;
        bool b;
        kvp_config_backend_t backend;
        kvp_dtype_t dtype;
        kvp_layout_t layout;
        kvp_storage_t storage;
        kvp_config_idlist_t list;
    } v;
    _Static_assert(KVP_CONFIG_SCOPES_MAX >= KVP_CONFIG_SOCKET_MAX &&
                       KVP_CONFIG_SCOPES_MAX >= KVP_CONFIG_NAME_MAX &&
                       KVP_CONFIG_SCOPES_MAX >= KVP_CONFIG_LIB_MAX,
                   "string fields fit v.str");
    memset(&v, 0, sizeof(v));
    int r = 0;
    uint64_t n;
    switch (s->type) {
    case T_SOCKET:
    case T_GROUP:
    case T_LISTEN:
    case T_LIB:
    case T_SCOPES:
    case T_ZMQ:
    case T_TEXT:
        if (s->type == T_SOCKET && !*text)
            return fail(-1, why, why_len, "expected an absolute path");
        if (strlen(text) >= s->size)
            return fail(-1, why, why_len, "longer than %zu bytes", s->size - 1);
        memcpy(v.str, text, strlen(text));
        r = check_string(s, v.str, why, why_len);
        break;
    case T_U32:
    case T_SIZE:
        r = s->type == T_U32 ? kvp_knob_parse_u64(text, 0, UINT64_MAX, &n)
                             : kvp_knob_parse_size(text, 0, UINT64_MAX, &n);
        if (r == KVP_EINVAL)
            return fail(-1, why, why_len, "%s",
                        s->type == T_U32 ? "expected an unsigned decimal integer"
                                         : "expected a byte count with an optional K, M, G or "
                                           "T suffix (KiB, MiB, GiB, TiB)");
        if (r == KVP_ERANGE)
            return fail(-1, why, why_len, "out of range %llu..%llu", (unsigned long long)s->min,
                        (unsigned long long)s->max);
        if (check_range(s, n, why, why_len) < 0)
            return -1;
        if (s->type == T_U32)
            v.u32 = (uint32_t)n;
        else
            v.u64 = n;
        break;
    case T_MODE: {
        if (!*text || strspn(text, "01234567") != strlen(text))
            return fail(-1, why, why_len, "expected an octal mode such as 0660");
        errno = 0;
        unsigned long m = strtoul(text, NULL, 8);
        if (errno || m > s->max)
            return fail(-1, why, why_len, "above 0777");
        v.u32 = (uint32_t)m;
        break;
    }
    case T_BOOL:
        if (kvp_knob_parse_bool(text, &v.b) < 0)
            return fail(-1, why, why_len, "expected true or false (yes/no, on/off, 1/0)");
        break;
    case T_LEVEL:
        if (kvp_log_level_parse(text, &v.level) < 0)
            return fail(-1, why, why_len,
                        "expected emerg, alert, crit, err, warning, notice, info or debug");
        break;
    case T_BACKEND:
        if (parse_backend(text, &v.backend) < 0)
            return fail(-1, why, why_len, "expected auto, host or cuda");
        break;
    case T_DTYPE:
        if (kvp_dtype_parse(text, &v.dtype) < 0)
            return fail(-1, why, why_len, "expected fp8_e4m3, fp8_e5m2, fp16, bf16 or fp32");
        break;
    case T_LAYOUT:
        if (kvp_layout_parse(text, &v.layout) < 0)
            return fail(-1, why, why_len, "expected nhd or hnd");
        break;
    case T_STORAGE:
        if (kvp_storage_parse(text, &v.storage) < 0)
            return fail(-1, why, why_len, "expected combined or split");
        break;
    case T_IDLIST:
        r = parse_idlist(s, text, &v.list, why, why_len);
        break;
    case T_ENUM: {
        int e = parse_enum(s, text);
        if (e < 0)
            return enum_fail(s, why, why_len);
        v.u32 = (uint32_t)e;
        break;
    }
    }
    if (r < 0)
        return r;
    memcpy(field(cfg, s), &v, s->size);
    return 0;
}

/* Sets setting i from text; the message is "<key>: invalid value '<text>': <why>". */
static int set_value(kvp_config_t *cfg, int i, const char *text, char *msg, size_t msg_len)
{
    char why[160];
    const setting_t *s = &settings[i];
    if (parse_into(cfg, s, text, why, sizeof(why)) < 0)
        return fail(KVP_EINVAL, msg, msg_len, "%s.%s: invalid value '%s': %s", s->section, s->name,
                    text, why);
    return 0;
}

/* ---- formatting values ----------------------------------------------------------------- */

static void format_size(uint64_t v, char *buf, size_t len)
{
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB"};
    int u = -1;
    while (u < 3 && v && v % 1024 == 0) {
        v /= 1024;
        u++;
    }
    snprintf(buf, len, "%llu%s", (unsigned long long)v, u < 0 ? "" : units[u]);
}

static void format_value(const kvp_config_t *cfg, const setting_t *s, char *buf, size_t len)
{
    const void *p = cfield(cfg, s);
    switch (s->type) {
    case T_SOCKET:
    case T_GROUP:
    case T_LISTEN:
    case T_LIB:
    case T_SCOPES:
    case T_ZMQ:
    case T_TEXT:
        snprintf(buf, len, "%.*s", (int)strnlen(p, s->size), (const char *)p);
        return;
    case T_ENUM: {
        uint32_t e = *(const uint32_t *)p;
        snprintf(buf, len, "%s", e <= s->max ? s->names[e] : "invalid");
        return;
    }
    case T_U32:
        snprintf(buf, len, "%u", *(const uint32_t *)p);
        return;
    case T_SIZE:
        format_size(*(const uint64_t *)p, buf, len);
        return;
    case T_MODE:
        snprintf(buf, len, "%04o", *(const uint32_t *)p);
        return;
    case T_BOOL:
        snprintf(buf, len, "%s", *(const bool *)p ? "true" : "false");
        return;
    case T_LEVEL:
        snprintf(buf, len, "%s", kvp_log_level_name(*(const int *)p));
        return;
    case T_BACKEND:
        snprintf(buf, len, "%s", kvp_config_backend_name(*(const kvp_config_backend_t *)p));
        return;
    case T_DTYPE:
        snprintf(buf, len, "%s", kvp_dtype_name(*(const kvp_dtype_t *)p));
        return;
    case T_LAYOUT:
        snprintf(buf, len, "%s", kvp_layout_name(*(const kvp_layout_t *)p));
        return;
    case T_STORAGE:
        snprintf(buf, len, "%s", kvp_storage_name(*(const kvp_storage_t *)p));
        return;
    case T_IDLIST: {
        const kvp_config_idlist_t *l = p;
        size_t off = 0;
        buf[0] = '\0';
        for (uint32_t i = 0; i < l->count && i < KVP_CONFIG_MAX_IDS && off < len; i++) {
            int w = snprintf(buf + off, len - off, "%s%u", i ? "," : "", l->ids[i]);
            if (w < 0)
                break;
            off += (size_t)w;
        }
        return;
    }
    }
}

static bool same_value(const kvp_config_t *a, const kvp_config_t *b, const setting_t *s)
{
    const void *pa = cfield(a, s), *pb = cfield(b, s);
    switch (s->type) {
    case T_SOCKET:
    case T_GROUP:
    case T_LISTEN:
    case T_LIB:
    case T_SCOPES:
    case T_ZMQ:
    case T_TEXT:
        return strncmp(pa, pb, s->size) == 0;
    case T_IDLIST: {
        const kvp_config_idlist_t *la = pa, *lb = pb;
        return la->count == lb->count &&
               memcmp(la->ids, lb->ids, sizeof(la->ids[0]) * la->count) == 0;
    }
    case T_BOOL:
        return *(const bool *)pa == *(const bool *)pb;
    default:
        return memcmp(pa, pb, s->size) == 0;
    }
}

/* ---- defaults -------------------------------------------------------------------------- */

const char *kvp_config_backend_name(kvp_config_backend_t b)
{
    switch (b) {
    case KVP_CONFIG_BACKEND_AUTO:
        return "auto";
    case KVP_CONFIG_BACKEND_HOST:
        return "host";
    case KVP_CONFIG_BACKEND_CUDA:
        return "cuda";
    }
    return "invalid";
}

static void default_socket(char *buf, size_t len)
{
    uid_t uid = geteuid();
    if (uid == 0) {
        snprintf(buf, len, "/run/kvpool/kvpool.sock");
        return;
    }
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    if (xdg && xdg[0] == '/') {
        int n = snprintf(buf, len, "%s/kvpool/kvpool.sock", xdg);
        if (n > 0 && (size_t)n < len)
            return;
    }
    snprintf(buf, len, "/tmp/kvpool-%u/kvpool.sock", (unsigned)uid);
}

/* A row's default into cfg. The defaults are checked like any value by kvp_config_validate
 * (and test_config checks that they validate). */
static void set_default(kvp_config_t *cfg, const setting_t *s)
{
    char why[160];
    if (s->type == T_SOCKET && !s->def_text) {
        default_socket(field(cfg, s), s->size);
    } else if (s->def_text) {
        int r = parse_into(cfg, s, s->def_text, why, sizeof(why));
        assert(r == 0 && "a default that does not parse");
        (void)r;
    } else if (s->size == sizeof(uint64_t)) {
        *(uint64_t *)field(cfg, s) = s->def;
    } else {
        assert(s->size == sizeof(uint32_t) && s->def <= UINT32_MAX);
        *(uint32_t *)field(cfg, s) = (uint32_t)s->def;
    }
}

void kvp_config_defaults(kvp_config_t *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    for (size_t i = 0; i < NUM_SETTINGS; i++)
        set_default(cfg, &settings[i]);
}

/* ---- for kvp_config_doc.c ---------------------------------------------------------------- */

const kvp__config_setting_t *kvp__config_setting(size_t i)
{
    return i < NUM_SETTINGS ? &settings[i] : NULL;
}

const char *kvp__config_section_doc(const char *section)
{
    for (size_t i = 0; i < NUM_SECTIONS; i++)
        if (strcmp(sections[i].name, section) == 0)
            return sections[i].doc;
    return NULL;
}

void kvp__config_format(const kvp_config_t *cfg, size_t i, char *buf, size_t len)
{
    if (i < NUM_SETTINGS)
        format_value(cfg, &settings[i], buf, len);
    else if (len)
        buf[0] = '\0';
}

/* ---- loading INI ----------------------------------------------------------------------- */

typedef struct {
    kvp_config_t *cfg;
    const char *name; /* file name for messages */
    FILE *fp;         /* the source: a file ... */
    const char *text; /* ... or a string */
    int lineno;
    int code;     /* the first error; later ones are not reported */
    int err_line; /* its line */
    char *err;
    size_t err_len;
    int set_line[NUM_SETTINGS]; /* where each key was set, 0: not yet */
} load_t;

static void load_fail(load_t *l, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void load_fail(load_t *l, const char *fmt, ...)
{
    if (l->code)
        return;
    l->code = KVP_EINVAL;
    l->err_line = l->lineno;
    if (!l->err || !l->err_len)
        return;
    int n = snprintf(l->err, l->err_len, "%s:%d: ", l->name, l->lineno);
    if (n < 0 || (size_t)n >= l->err_len)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(l->err + n, l->err_len - (size_t)n, fmt, ap);
    va_end(ap);
}

static int next_char(load_t *l)
{
    if (l->fp)
        return getc(l->fp);
    if (!*l->text)
        return EOF;
    return (unsigned char)*l->text++;
}

/* inih's ini_reader: one whole line per call, so l->lineno is inih's line number too. A line
 * that does not fit the parser's buffer is reported and handed over empty. Leading blanks are
 * removed: inih would read an indented line as the continuation of the previous value. */
static char *read_line(char *str, int num, void *stream)
{
    load_t *l = stream;
    size_t n = 0, cap = (size_t)num - 1;
    bool any = false, too_long = false, nul = false;
    for (;;) {
        int c = next_char(l);
        if (c == EOF)
            break;
        any = true;
        if (c == '\n')
            break;
        if (c == '\0')
            nul = true;
        if (n < cap)
            str[n++] = (char)c;
        else
            too_long = true;
    }
    if (!any)
        return NULL;
    l->lineno++;
    str[n] = '\0';
    if (too_long || nul) {
        if (too_long)
            load_fail(l, "line longer than %zu characters", cap);
        else
            load_fail(l, "NUL byte in line");
        str[0] = '\0';
        return str;
    }
    size_t blanks = strspn(str, " \t\r\v\f");
    memmove(str, str + blanks, n - blanks + 1);
    /* inih calls the handler only for keys; an empty unknown section is found here */
    const char *p = str;
    const char *close = *p == '[' ? strchr(p, ']') : NULL;
    if (close) {
        char section[64];
        size_t len = (size_t)(close - p - 1);
        snprintf(section, sizeof(section), "%.*s", (int)len, p + 1);
        if (len >= sizeof(section) || !known_section(section))
            load_fail(l, "unknown section [%s]", section);
    }
    return str;
}

static int on_key(void *user, const char *section, const char *name, const char *value)
{
    load_t *l = user;
    if (!*section) {
        load_fail(l, "key '%s' outside of any section", name);
        return 0;
    }
    if (!known_section(section)) {
        load_fail(l, "unknown section [%s]", section);
        return 0;
    }
    int i = find_setting(section, name);
    if (i < 0) {
        load_fail(l, "unknown key '%s' in section [%s]", name, section);
        return 0;
    }
    const setting_t *s = &settings[i];
    char msg[512], list[1024];
    if (l->set_line[i] && s->type == T_IDLIST) {
        /* a list may take several lines (inih's lines are short): each adds entries */
        format_value(l->cfg, s, list, sizeof(list));
        size_t n = strlen(list);
        snprintf(list + n, sizeof(list) - n, "%s%s", n ? "," : "", value);
        value = list;
    } else if (l->set_line[i]) {
        load_fail(l, "%s.%s set twice (first at line %d)", section, name, l->set_line[i]);
        return 0;
    }
    l->set_line[i] = l->lineno;
    if (set_value(l->cfg, i, value, msg, sizeof(msg)) < 0) {
        load_fail(l, "%s", msg);
        return 0;
    }
    return 1;
}

/* Parses from l's source into a copy of cfg and commits it on success. */
static int load(kvp_config_t *cfg, load_t *l)
{
    kvp_config_t *tmp = malloc(sizeof(*tmp));
    if (!tmp)
        return fail(KVP_ENOMEM, l->err, l->err_len, "out of memory");
    *tmp = *cfg;
    l->cfg = tmp;
    int r = ini_parse_stream(read_line, l, on_key, l);
    int read_errno = l->fp && ferror(l->fp) ? (errno ? errno : EIO) : 0;
    if (read_errno)
        r = fail(-read_errno, l->err, l->err_len, "cannot read %s: %s", l->name,
                 strerror(read_errno));
    else if (r < 0) /* -2: inih's line buffer (only when built without INI_USE_STACK) */
        r = fail(KVP_ENOMEM, l->err, l->err_len, "out of memory");
    else if (r > 0 && (!l->code || r < l->err_line)) {
        /* inih's first error is a syntax error before any error we reported */
        l->code = 0;
        l->lineno = r;
        load_fail(l, "syntax error: expected [section], key = value or a comment");
        r = l->code;
    } else {
        r = l->code;
    }
    if (r == 0) {
        *cfg = *tmp;
        clear_err(l->err, l->err_len);
    }
    free(tmp);
    return r;
}

int kvp_config_load_string(kvp_config_t *cfg, const char *text, const char *name, char *err,
                           size_t err_len)
{
    if (!cfg || !text)
        return fail(KVP_EINVAL, err, err_len, "no configuration given");
    load_t l = {.name = name ? name : "<string>", .text = text, .err = err, .err_len = err_len};
    return load(cfg, &l);
}

int kvp_config_load_file(kvp_config_t *cfg, const char *path, char *err, size_t err_len)
{
    if (!cfg || !path || !*path)
        return fail(KVP_EINVAL, err, err_len, "no configuration file given");
    if (strlen(path) >= sizeof(cfg->config_path))
        return fail(-ENAMETOOLONG, err, err_len, "configuration file path too long");
    FILE *fp = fopen(path, "re");
    if (!fp) {
        int e = errno;
        return fail(-e, err, err_len, "cannot open %s: %s", path, strerror(e));
    }
    load_t l = {.name = path, .fp = fp, .err = err, .err_len = err_len};
    errno = 0;
    int r = load(cfg, &l);
    fclose(fp);
    if (r == 0)
        snprintf(cfg->config_path, sizeof(cfg->config_path), "%s", path);
    return r;
}

int kvp_config_set(kvp_config_t *cfg, const char *key, const char *value, char *err, size_t err_len)
{
    if (!cfg || !key || !value)
        return fail(KVP_EINVAL, err, err_len, "no key or value given");
    int i = find_dotted(key);
    if (i < 0)
        return fail(KVP_EINVAL, err, err_len, "unknown key '%s' (expected section.key)", key);
    int r = set_value(cfg, i, value, err, err_len);
    if (r == 0)
        clear_err(err, err_len);
    return r;
}

/* ---- the environment ------------------------------------------------------------------ */

/* The [tuning] keys only: the environment is how the benchmarks and the tests used to set
 * them, and a file or a flag says the rest. Works on a copy, like a file load. */
int kvp_config_apply_env(kvp_config_t *cfg, char *err, size_t err_len)
{
    if (!cfg)
        return fail(KVP_EINVAL, err, err_len, "no configuration given");
    kvp_config_t *tmp = malloc(sizeof(*tmp));
    if (!tmp)
        return fail(KVP_ENOMEM, err, err_len, "out of memory");
    *tmp = *cfg;
    int r = 0;
    for (size_t i = 0; i < NUM_SETTINGS && r == 0; i++) {
        char name[96], msg[512];
        if (strcmp(settings[i].section, "tuning") != 0 ||
            kvp_knob_env_name(settings[i].name, name, sizeof(name)) < 0)
            continue;
        const char *v = kvp_knob_env(name);
        if (v && set_value(tmp, (int)i, v, msg, sizeof(msg)) < 0)
            r = fail(KVP_EINVAL, err, err_len, "environment %s: %s", name, msg);
    }
    if (r == 0) {
        *cfg = *tmp;
        clear_err(err, err_len);
    }
    free(tmp);
    return r;
}

/* ---- the command line ------------------------------------------------------------------ */

typedef enum { OPT_CONFIG, OPT_SET, OPT_KEY, OPT_CHECK, OPT_VERSION, OPT_HELP } opt_kind_t;

typedef struct {
    opt_kind_t kind;
    int setting;       /* OPT_KEY */
    char flag[32];     /* as written, without "=value", for messages */
    const char *value; /* OPT_CONFIG, OPT_SET, OPT_KEY */
} opt_t;

/* Reads the option at argv[*i] (and its separate value), advancing *i past them. */
static int next_opt(int argc, char *const argv[], int *i, opt_t *o, char *err, size_t err_len)
{
    const char *arg = argv[*i];
    (*i)++;
    memset(o, 0, sizeof(*o));
    if (strcmp(arg, "-h") == 0) {
        o->kind = OPT_HELP;
        snprintf(o->flag, sizeof(o->flag), "-h");
        return 0;
    }
    if (strncmp(arg, "--", 2) != 0 || !arg[2])
        return fail(KVP_EINVAL, err, err_len, "unexpected argument '%s' (see --help)", arg);
    const char *name = arg + 2, *eq = strchr(name, '=');
    size_t name_len = eq ? (size_t)(eq - name) : strlen(name);
    snprintf(o->flag, sizeof(o->flag), "--%.*s", (int)name_len, name);

    static const struct {
        const char *name;
        opt_kind_t kind;
    } plain[] = {{"help", OPT_HELP},
                 {"version", OPT_VERSION},
                 {"check-config", OPT_CHECK},
                 {"config", OPT_CONFIG},
                 {"set", OPT_SET}};
    bool found = false;
    for (size_t k = 0; k < sizeof(plain) / sizeof(plain[0]) && !found; k++)
        if (strlen(plain[k].name) == name_len && strncmp(plain[k].name, name, name_len) == 0) {
            o->kind = plain[k].kind;
            found = true;
        }
    for (size_t k = 0; k < sizeof(flag_keys) / sizeof(flag_keys[0]) && !found; k++)
        if (strlen(flag_keys[k].flag) == name_len &&
            strncmp(flag_keys[k].flag, name, name_len) == 0) {
            o->kind = OPT_KEY;
            o->setting = find_dotted(flag_keys[k].key);
            found = true;
        }
    if (!found)
        return fail(KVP_EINVAL, err, err_len, "unknown option '%.*s' (see --help)",
                    (int)name_len + 2, arg);

    bool wants_value = o->kind == OPT_CONFIG || o->kind == OPT_SET || o->kind == OPT_KEY;
    if (!wants_value) {
        if (eq)
            return fail(KVP_EINVAL, err, err_len, "%s takes no value", o->flag);
        return 0;
    }
    if (eq) {
        o->value = eq + 1;
    } else {
        if (*i >= argc)
            return fail(KVP_EINVAL, err, err_len, "%s needs a value", o->flag);
        o->value = argv[(*i)++];
    }
    return 0;
}

/* Applies one command-line setting to cfg and records it for reloads. */
static int apply_override(kvp_config_t *cfg, int setting, const char *value, const char *flag,
                          char *err, size_t err_len)
{
    char msg[512];
    size_t len = strlen(value);
    if (len >= KVP_CONFIG_VALUE_MAX)
        return fail(KVP_EINVAL, err, err_len, "%s: %s.%s: value longer than %d bytes", flag,
                    settings[setting].section, settings[setting].name, KVP_CONFIG_VALUE_MAX - 1);
    if (set_value(cfg, setting, value, msg, sizeof(msg)) < 0)
        return fail(KVP_EINVAL, err, err_len, "%s: %s", flag, msg);
    uint32_t slot = 0;
    while (slot < cfg->num_overrides && cfg->overrides[slot].key != (uint32_t)setting)
        slot++;
    if (slot >= KVP_CONFIG_MAX_OVERRIDES) /* one slot per key: only a corrupt cfg gets here */
        return fail(KVP_ELIMIT, err, err_len, "%s: too many command-line settings", flag);
    kvp_config_override_t *o = &cfg->overrides[slot];
    o->key = (uint32_t)setting;
    memset(o->value, 0, sizeof(o->value));
    memcpy(o->value, value, len);
    if (slot == cfg->num_overrides)
        cfg->num_overrides++;
    return 0;
}

static int apply_set(kvp_config_t *cfg, const char *arg, char *err, size_t err_len)
{
    const char *eq = strchr(arg, '=');
    char key[64];
    if (!eq || (size_t)(eq - arg) >= sizeof(key))
        return fail(KVP_EINVAL, err, err_len, "--set: expected SECTION.KEY=VALUE, got '%s'", arg);
    memcpy(key, arg, (size_t)(eq - arg));
    key[eq - arg] = '\0';
    int i = find_dotted(key);
    if (i < 0)
        return fail(KVP_EINVAL, err, err_len, "--set: unknown key '%s'", key);
    return apply_override(cfg, i, eq + 1, "--set", err, err_len);
}

int kvp_config_parse_args(kvp_config_t *cfg, int argc, char *const argv[],
                          kvp_config_action_t *action, char *err, size_t err_len)
{
    if (!cfg || !action || argc < 0 || (argc > 0 && !argv))
        return fail(KVP_EINVAL, err, err_len, "no configuration or arguments given");
    opt_t o;
    const char *config = NULL;
    bool help = false, version = false, check = false;
    int r;
    /* pass 1: syntax, the actions and the config file */
    for (int i = 1; i < argc;) {
        if ((r = next_opt(argc, argv, &i, &o, err, err_len)) < 0)
            return r;
        if (o.kind == OPT_HELP)
            help = true;
        else if (o.kind == OPT_VERSION)
            version = true;
        else if (o.kind == OPT_CHECK)
            check = true;
        else if (o.kind == OPT_CONFIG) {
            if (config)
                return fail(KVP_EINVAL, err, err_len, "--config given twice");
            if (!*o.value)
                return fail(KVP_EINVAL, err, err_len, "--config needs a file name");
            config = o.value;
        }
    }
    if (help || version) {
        *action = help ? KVP_CONFIG_HELP : KVP_CONFIG_VERSION;
        clear_err(err, err_len);
        return 0;
    }

    kvp_config_t *tmp = malloc(sizeof(*tmp));
    if (!tmp)
        return fail(KVP_ENOMEM, err, err_len, "out of memory");
    *tmp = *cfg;
    if (config && (r = kvp_config_load_file(tmp, config, err, err_len)) < 0)
        goto free_tmp;
    if ((r = kvp_config_apply_env(tmp, err, err_len)) < 0)
        goto free_tmp;
    /* pass 2: every other setting over the file and the environment, in command-line order */
    for (int i = 1; i < argc;) {
        next_opt(argc, argv, &i, &o, NULL, 0); /* cannot fail: pass 1 read the same */
        r = 0;
        if (o.kind == OPT_SET)
            r = apply_set(tmp, o.value, err, err_len);
        else if (o.kind == OPT_KEY)
            r = apply_override(tmp, o.setting, o.value, o.flag, err, err_len);
        if (r < 0)
            goto free_tmp;
    }
    *cfg = *tmp;
    *action = check ? KVP_CONFIG_CHECK : KVP_CONFIG_RUN;
    clear_err(err, err_len);
    r = 0;
free_tmp:
    free(tmp);
    return r;
}

void kvp_config_usage(FILE *out, const char *prog)
{
    fprintf(out,
            "usage: %s [options]\n"
            "Serves a paged KV-cache pool to LLM inference workers over a Unix socket.\n"
            "\n"
            "  --config FILE         read settings from FILE (INI: [server] [pool] [limits]\n"
            "                        [access] [transfer] [tuning]); $KVPOOL_<KEY> overrides\n"
            "                        a [tuning] key; the options below apply over both\n"
            "  --socket PATH         listening socket (server.socket)\n"
            "  --backend B           auto, host or cuda (pool.backend)\n"
            "  --devices LIST        CUDA ordinals, comma-separated (pool.devices)\n"
            "  --num-layers N        (pool.num_layers)\n"
            "  --num-pages N         pages in the pool; 0 derives it from --pool-bytes\n"
            "  --pool-bytes SIZE     pool size per device, e.g. 40GiB (pool.pool_bytes)\n"
            "  --page-size N         tokens per page (pool.page_size)\n"
            "  --num-kv-heads N      (pool.num_kv_heads)\n"
            "  --head-dim N          (pool.head_dim)\n"
            "  --dtype T             fp8_e4m3, fp8_e5m2, fp16, bf16 or fp32 (pool.dtype)\n"
            "  --layout L            nhd or hnd (pool.layout)\n"
            "  --storage S           combined or split (pool.storage)\n"
            "  --log-level L         emerg ... debug (server.log_level)\n"
            "  --set SECTION.KEY=V   any setting, e.g. --set limits.max_seqs=1000\n"
            "  --check-config        validate, print the effective configuration, exit\n"
            "  --version             print the version and exit\n"
            "  -h, --help            print this help and exit\n",
            prog ? prog : "kvpoold");
}

/* ---- validation ------------------------------------------------------------------------ */

void kvp_config_geom(const kvp_config_t *cfg, kvp_geom_t *g)
{
    *g = (kvp_geom_t){.num_layers = cfg->num_layers,
                      .num_pages = cfg->num_pages,
                      .page_size = cfg->page_size,
                      .num_kv_heads = cfg->num_kv_heads,
                      .head_dim = cfg->head_dim,
                      .dtype = cfg->dtype,
                      .layout = cfg->layout,
                      .storage = cfg->storage,
                      .num_devices = cfg->devices.count};
}

static int geom_fail(int code, const char *msg, char *err, size_t err_len)
{
    return fail(code, err, err_len, "pool: invalid geometry: %s", msg);
}

int kvp_config_validate(kvp_config_t *cfg, char *err, size_t err_len)
{
    if (!cfg)
        return fail(KVP_EINVAL, err, err_len, "no configuration given");
    char why[160], text[1024];
    for (size_t i = 0; i < NUM_SETTINGS; i++) {
        const setting_t *s = &settings[i];
        if (check_field(s, cfield(cfg, s), why, sizeof(why)) < 0) {
            format_value(cfg, s, text, sizeof(text));
            return fail(KVP_EINVAL, err, err_len, "%s.%s: invalid value '%s': %s", s->section,
                        s->name, text, why);
        }
    }
    if (cfg->max_queued_bytes < cfg->max_frame_bytes)
        return fail(KVP_EINVAL, err, err_len,
                    "server.max_queued_bytes (%llu) must be >= server.max_frame_bytes (%llu)",
                    (unsigned long long)cfg->max_queued_bytes,
                    (unsigned long long)cfg->max_frame_bytes);
    if (cfg->max_buffered_bytes && cfg->max_buffered_bytes < cfg->max_frame_bytes)
        return fail(KVP_EINVAL, err, err_len,
                    "server.max_buffered_bytes (%llu) must be 0 or >= server.max_frame_bytes "
                    "(%llu)",
                    (unsigned long long)cfg->max_buffered_bytes,
                    (unsigned long long)cfg->max_frame_bytes);
    if (cfg->default_lease_ms > cfg->max_lease_ms)
        return fail(KVP_EINVAL, err, err_len,
                    "limits.default_lease_ms (%u) must be <= limits.max_lease_ms (%u)",
                    cfg->default_lease_ms, cfg->max_lease_ms);

    kvp_geom_t g;
    kvp_geom_derived_t d;
    char msg[160];
    int r;
    kvp_config_geom(cfg, &g);
    if (g.num_pages == 0) {
        g.num_pages = 1; /* the bytes of one page */
        if ((r = kvp_geom_validate(&g, msg, sizeof(msg))) < 0)
            return geom_fail(r, msg, err, err_len);
        kvp_geom_derive(&g, &d);
        uint64_t n = cfg->pool_bytes / d.pool_bytes;
        if (n == 0)
            return fail(KVP_EINVAL, err, err_len,
                        "pool.pool_bytes: %llu bytes hold no page (one page is %llu bytes "
                        "per device over %u layers, K and V)",
                        (unsigned long long)cfg->pool_bytes, (unsigned long long)d.pool_bytes,
                        g.num_layers);
        if (n > KVP_GEOM_MAX_PAGES)
            return fail(KVP_EINVAL, err, err_len,
                        "pool.pool_bytes: %llu bytes make %llu pages, above the maximum %u",
                        (unsigned long long)cfg->pool_bytes, (unsigned long long)n,
                        KVP_GEOM_MAX_PAGES);
        g.num_pages = (uint32_t)n;
    }
    if ((r = kvp_geom_validate(&g, msg, sizeof(msg))) < 0)
        return geom_fail(r, msg, err, err_len);
    cfg->num_pages = g.num_pages;
    clear_err(err, err_len);
    return 0;
}

uint32_t kvp_config_copy_threads(const kvp_config_t *cfg)
{
    if (cfg->copy_threads)
        return cfg->copy_threads;
    cpu_set_t set;
    long n = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set)
                                                          : sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 8 ? 8 : (uint32_t)n;
}

/* ---- reload ---------------------------------------------------------------------------- */

int kvp_config_reload_file(const kvp_config_t *old, const char *path, kvp_config_t *out, char *err,
                           size_t err_len)
{
    if (!old || !path || !out || old == out)
        return fail(KVP_EINVAL, err, err_len, "bad reload arguments");
    kvp_config_t *tmp = malloc(sizeof(*tmp));
    if (!tmp)
        return fail(KVP_ENOMEM, err, err_len, "out of memory");
    int r;
    kvp_config_defaults(tmp);
    if ((r = kvp_config_load_file(tmp, path, err, err_len)) < 0)
        goto free_tmp;
    if ((r = kvp_config_apply_env(tmp, err, err_len)) < 0)
        goto free_tmp;
    for (uint32_t k = 0; k < old->num_overrides && k < KVP_CONFIG_MAX_OVERRIDES; k++) {
        const kvp_config_override_t *o = &old->overrides[k];
        char msg[512];
        if (o->key >= NUM_SETTINGS) {
            r = fail(KVP_EINVAL, err, err_len, "corrupt command-line setting %u", o->key);
            goto free_tmp;
        }
        if ((r = set_value(tmp, (int)o->key, o->value, msg, sizeof(msg))) < 0) {
            r = fail(r, err, err_len, "command line: %s", msg);
            goto free_tmp;
        }
        tmp->overrides[k] = *o;
    }
    tmp->num_overrides = old->num_overrides;
    if ((r = kvp_config_validate(tmp, err, err_len)) < 0)
        goto free_tmp;

    int kept = 0;
    size_t off = 0;
    char list[1024] = "";
    for (size_t i = 0; i < NUM_SETTINGS; i++) {
        const setting_t *s = &settings[i];
        if (s->reloadable || same_value(old, tmp, s))
            continue;
        memcpy(field(tmp, s), cfield(old, s), s->size);
        int w = snprintf(list + off, sizeof(list) - off, "%s%s.%s", kept ? ", " : "", s->section,
                         s->name);
        if (w > 0 && off + (size_t)w < sizeof(list))
            off += (size_t)w;
        kept++;
    }
    if (kept) {
        char msg[512];
        if ((r = kvp_config_validate(tmp, msg, sizeof(msg))) < 0) {
            r = fail(r, err, err_len,
                     "with the running values of the settings that need a restart (%s): %s", list,
                     msg);
            goto free_tmp;
        }
    }
    *out = *tmp;
    if (kept)
        fail(0, err, err_len, "not reloadable, restart to apply: %s", list);
    else
        clear_err(err, err_len);
    r = kept;
free_tmp:
    free(tmp);
    return r;
}
