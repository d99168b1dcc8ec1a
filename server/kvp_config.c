/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_config.c - one table of settings (section, key, type, field, range, reloadable) drives
 * everything here: the INI handler, --set and the named flags, validation, the dump and the
 * reload comparison, so a new key is one table line plus its struct field.
 *
 * libinih does the INI syntax. It reads lines through our reader, which counts lines (the
 * handler of Debian's build gets no line number), rejects over-long lines instead of letting
 * inih split them into two, and notices unknown [sections] even when they hold no key. Every
 * public function works on a copy and commits it on success, so a failed load, parse or
 * validation leaves the caller's config as it was.
 */
#include "kvp_config.h"

#include "kvp_access.h"

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

typedef enum {
    T_SOCKET,  /* char[]: absolute path */
    T_GROUP,   /* char[]: empty or a group name or number */
    T_LISTEN,  /* char[]: empty or host:port */
    T_U32,     /* uint32_t in [min, max] */
    T_SIZE,    /* uint64_t in [min, max], K/M/G/T suffixes */
    T_MODE,    /* uint32_t, octal, <= max */
    T_BOOL,    /* bool */
    T_LEVEL,   /* int, KVP_LOG_* */
    T_BACKEND, /* kvp_config_backend_t */
    T_DTYPE,   /* kvp_dtype_t */
    T_LAYOUT,  /* kvp_layout_t */
    T_STORAGE, /* kvp_storage_t */
    T_IDLIST,  /* kvp_config_idlist_t: >= min entries, each <= max, distinct */
    T_ENUM,    /* uint32_t: the index of one of names[0..max] */
    T_LIB,     /* char[]: a library file name or path, or empty */
    T_SCOPES,  /* char[]: access.cache_scopes, "name=uid,uid;..." (kvp_access.h) */
} type_t;

typedef struct {
    const char *section;
    const char *name;
    type_t type;
    size_t offset;
    size_t size;
    uint64_t min, max;
    bool reloadable;
    const char *const *names; /* T_ENUM */
} setting_t;

#define FIELD_SIZE(f) sizeof(((kvp_config_t *)0)->f)
#define S(sec, f, type, min, max, reload)                                                          \
    {                                                                                              \
#sec, #f, type, offsetof(kvp_config_t, f), FIELD_SIZE(f), min, max, reload, NULL           \
    }

/* A key whose field has another name (the [transfer] keys: transfer_<key>). */
#define S_FIELD(sec, key, f, type, min, max, reload)                                               \
    {                                                                                              \
#sec, #key, type, offsetof(kvp_config_t, f), FIELD_SIZE(f), min, max, reload, NULL         \
    }

/* A T_ENUM key: its value is the index of one of names (max = the last index). */
#define S_ENUM(sec, f, names, reload)                                                              \
    {                                                                                              \
#sec, #f, T_ENUM, offsetof(kvp_config_t, f), FIELD_SIZE(f), 0,                             \
            sizeof(names) / sizeof(names[0]) - 1, reload, names                                    \
    }

static const char *const append_kernels[] = {"auto", "warp", "block", "flat"};
static const char *const append_hints[] = {"none", "ld", "st", "ldst"};

#define KIB (1ull << 10)
#define MIB (1ull << 20)
#define GIB (1ull << 30)

static const setting_t settings[] = {
    S(server, socket, T_SOCKET, 0, 0, false),
    S(server, socket_mode, T_MODE, 0, 0777, false),
    S(server, socket_group, T_GROUP, 0, 0, false),
    S(server, max_connections, T_U32, 1, 1u << 20, true),
    S(server, max_frame_bytes, T_SIZE, 4 * KIB, GIB, false),
    S(server, max_queued_bytes, T_SIZE, 4 * KIB, 16 * GIB, true),
    S(server, max_buffered_bytes, T_SIZE, 0, 64 * GIB, true),
    S(server, uid_max_connections, T_U32, 0, 1u << 20, true),
    S(server, hello_timeout_ms, T_U32, 0, 3600000, true),
    S(server, frame_timeout_ms, T_U32, 0, 3600000, true),
    S(server, log_level, T_LEVEL, 0, 0, true),
    S(server, watchdog, T_BOOL, 0, 0, false),
    S(server, metrics_listen, T_LISTEN, 0, 0, false),
    S(server, metrics_max_connections, T_U32, 1, 1024, false),
    S(server, metrics_max_connections_per_peer, T_U32, 1, 1024, false),
    S(server, metrics_head_timeout_ms, T_U32, 10, 60000, false),
    S(server, metrics_timeout_ms, T_U32, 100, 600000, false),
    S(server, drain_timeout_ms, T_U32, 0, 3600000, true),
    S(server, copy_threads, T_U32, 0, 256, false),
    S(server, busy_poll_us, T_U32, 0, 1000000, false),
    S(server, commit_poll_ms, T_U32, 1, 1000, true),
    S(pool, backend, T_BACKEND, 0, 0, false),
    S(pool, devices, T_IDLIST, 1, 1023, false),
    S(pool, num_layers, T_U32, 0, UINT32_MAX, false),
    S(pool, num_pages, T_U32, 0, UINT32_MAX, false),
    S(pool, pool_bytes, T_SIZE, 1, UINT64_MAX, false),
    S(pool, page_size, T_U32, 0, UINT32_MAX, false),
    S(pool, num_kv_heads, T_U32, 0, UINT32_MAX, false),
    S(pool, head_dim, T_U32, 0, UINT32_MAX, false),
    S(pool, dtype, T_DTYPE, 0, 0, false),
    S(pool, layout, T_LAYOUT, 0, 0, false),
    S(pool, storage, T_STORAGE, 0, 0, false),
    S(limits, max_seqs, T_U32, 1, 1u << 26, false),
    S(limits, max_namespaces, T_U32, 1, 1u << 20, false),
    S(limits, max_batch, T_U32, 1, 1u << 20, false),
    S(limits, max_batch_tokens, T_U32, 1, INT32_MAX, true),
    S(limits, max_seq_tokens, T_U32, 0, INT32_MAX, false),
    S(limits, max_buffers_per_client, T_U32, 1, 65536, false),
    S(limits, max_buffer_bytes, T_SIZE, 1, 1ull << 50, true),
    S(limits, dedup_window, T_U32, 1, 1u << 20, false),
    S(limits, dedup_ns_max_bytes, T_SIZE, 4 * KIB, 1ull << 40, true),
    S(limits, dedup_max_bytes, T_SIZE, 4 * KIB, 1ull << 40, true),
    S(limits, default_lease_ms, T_U32, 0, UINT32_MAX, true),
    S(limits, max_lease_ms, T_U32, 0, UINT32_MAX, true),
    S(limits, ns_max_seqs, T_U32, 0, 1u << 26, true),
    S(limits, ns_max_pages, T_U32, 0, UINT32_MAX, true),
    S(limits, ns_max_buffer_bytes, T_SIZE, 0, 1ull << 50, true),
    S(limits, ns_max_connections, T_U32, 0, 1u << 20, true),
    S(limits, uid_max_namespaces, T_U32, 0, 1u << 20, true),
    S(limits, uid_max_idle_namespaces, T_U32, 0, 1u << 20, true),
    S(limits, uid_max_seqs, T_U32, 0, 1u << 26, true),
    S(limits, max_cache_scopes, T_U32, 1, 1u << 20, false),
    S(limits, max_pins, T_U32, 1, 65535, false),
    S(limits, ns_max_pins, T_U32, 0, 65535, true),
    S(limits, uid_max_pins, T_U32, 0, 65535, true),
    S(limits, ns_max_pinned_pages, T_U32, 0, UINT32_MAX, true),
    S(limits, uid_max_pinned_pages, T_U32, 0, UINT32_MAX, true),
    S(limits, ns_max_priority, T_U32, 0, 100, true),
    S(limits, pin_max_ttl_ms, T_U32, 1, UINT32_MAX, true),
    S(limits, max_lookup_tokens, T_U32, 0, INT32_MAX, true),
    S(access, allowed_uids, T_IDLIST, 0, UINT32_MAX - 1, true),
    S(access, allowed_gids, T_IDLIST, 0, UINT32_MAX - 1, true),
    S(access, pool_uids, T_IDLIST, 0, UINT32_MAX - 1, true),
    S(access, pool_gids, T_IDLIST, 0, UINT32_MAX - 1, true),
    S(access, cache_scopes, T_SCOPES, 0, 0, false),
    S_FIELD(transfer, timeout_ms, transfer_timeout_ms, T_U32, 1, 3600000, true),
    S_FIELD(transfer, comm_idle_ms, transfer_comm_idle_ms, T_U32, 1000, UINT32_MAX, true),
    S_FIELD(transfer, max_in_flight, transfer_max_in_flight, T_U32, 1, 64, false),
    S_FIELD(transfer, chunk_bytes, transfer_chunk_bytes, T_U32, 0, 1073741824, true),
    /* [tuning]: the bounds of the kernel keys are kvp_kernels_cuda.h's (checked in kvpoold.c) */
    S(tuning, cuda_ready_timeout_ms, T_U32, 1, 3600000, false),
    S(tuning, cuda_plan_upload, T_BOOL, 0, 0, false),
    S_ENUM(tuning, append_kernel, append_kernels, false),
    S(tuning, append_tokens_per_block, T_U32, 0, 64, false),
    S(tuning, append_blocks_per_sm, T_U32, 0, 1024, false),
    S(tuning, append_warps_per_block, T_U32, 0, 8, false),
    S_ENUM(tuning, append_hints, append_hints, false),
    S(tuning, append_vecs_per_thread, T_U32, 0, 8, false),
    S(tuning, pack_blocks, T_U32, 0, 65535, false),
    S(tuning, xfer_stages, T_U32, 2, 4, false),
    S(tuning, xfer_register, T_BOOL, 0, 0, false),
    S(tuning, xfer_priority, T_BOOL, 0, 0, false),
    S(tuning, nccl_lib, T_LIB, 0, 0, false),
};

#define NUM_SETTINGS (sizeof(settings) / sizeof(settings[0]))
_Static_assert(NUM_SETTINGS <= KVP_CONFIG_MAX_OVERRIDES, "one override slot per key");

static const char *const sections[] = {"server", "pool", "limits", "access", "transfer", "tuning"};

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
    for (size_t i = 0; i < sizeof(sections) / sizeof(sections[0]); i++)
        if (strcmp(sections[i], name) == 0)
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

void kvp_config_defaults(kvp_config_t *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    default_socket(cfg->socket, sizeof(cfg->socket));
    cfg->socket_mode = 0660;
    cfg->max_connections = 256;
    cfg->max_frame_bytes = 16 * MIB;
    cfg->max_queued_bytes = 64 * MIB;
    cfg->max_buffered_bytes = 256 * MIB;
    cfg->uid_max_connections = 128;
    cfg->hello_timeout_ms = 10000;
    cfg->frame_timeout_ms = 10000;
    cfg->log_level = KVP_LOG_INFO;
    cfg->watchdog = true;
    cfg->drain_timeout_ms = 10000;
    cfg->metrics_max_connections = 16;
    cfg->metrics_max_connections_per_peer = 8;
    cfg->metrics_head_timeout_ms = 1000;
    cfg->metrics_timeout_ms = 5000;
    cfg->copy_threads = 0;
    cfg->busy_poll_us = 0;

    cfg->backend = KVP_CONFIG_BACKEND_AUTO;
    cfg->devices.count = 1;
    cfg->devices.ids[0] = 0;
    cfg->num_layers = 2;
    cfg->num_pages = 0;
    cfg->pool_bytes = 256 * MIB;
    cfg->page_size = 16;
    cfg->num_kv_heads = 8;
    cfg->head_dim = 128;
    cfg->dtype = KVP_DTYPE_FP16;
    cfg->layout = KVP_LAYOUT_NHD;
    cfg->storage = KVP_STORAGE_COMBINED;

    cfg->max_seqs = 65536;
    cfg->max_namespaces = 256;
    cfg->uid_max_namespaces = 32;
    cfg->uid_max_idle_namespaces = 8;
    cfg->uid_max_seqs = 16384;
    cfg->max_cache_scopes = 256;
    cfg->max_pins = 1024;
    cfg->ns_max_pins = 64;
    cfg->uid_max_pins = 256;
    cfg->ns_max_pinned_pages = 0; /* derived from the pool */
    cfg->uid_max_pinned_pages = 0;
    cfg->ns_max_priority = 50;
    cfg->pin_max_ttl_ms = 86400000;
    cfg->max_lookup_tokens = 0; /* derived from the page size */
    cfg->commit_poll_ms = 1;
    cfg->max_batch = 4096;
    cfg->max_batch_tokens = 1048576;
    cfg->max_seq_tokens = 0;
    cfg->max_buffers_per_client = 64;
    cfg->max_buffer_bytes = 64 * GIB;
    cfg->dedup_window = 1024;
    cfg->dedup_ns_max_bytes = 8ull << 20;
    cfg->dedup_max_bytes = 64ull << 20;
    cfg->default_lease_ms = 30000;
    cfg->max_lease_ms = 86400000;

    cfg->transfer_timeout_ms = 30000;
    cfg->transfer_comm_idle_ms = 300000;
    cfg->transfer_max_in_flight = 2;

    cfg->cuda_ready_timeout_ms = 30000;
    cfg->xfer_stages = 2;
    snprintf(cfg->nccl_lib, sizeof(cfg->nccl_lib), "libnccl.so.2");
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

void kvp_config_dump(const kvp_config_t *cfg, FILE *out)
{
    char text[1024];
    const char *section = "";
    fprintf(out, "; kvpoold effective configuration%s%s\n", cfg->config_path[0] ? ": " : "",
            cfg->config_path);
    for (size_t i = 0; i < NUM_SETTINGS; i++) {
        const setting_t *s = &settings[i];
        if (strcmp(section, s->section) != 0) {
            section = s->section;
            fprintf(out, "%s[%s]\n", i ? "\n" : "", section);
        }
        if (s->type == T_IDLIST) { /* 16 entries a line keep lines within inih's limit */
            const kvp_config_idlist_t *l = cfield(cfg, s);
            for (uint32_t k = 0; k == 0 || k < l->count; k += 16) {
                fprintf(out, "%s = ", s->name);
                for (uint32_t j = k; j < l->count && j < k + 16; j++)
                    fprintf(out, "%s%u", j > k ? "," : "", l->ids[j]);
                fputc('\n', out);
            }
            continue;
        }
        format_value(cfg, s, text, sizeof(text));
        fprintf(out, "%s = %s\n", s->name, text);
    }
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
