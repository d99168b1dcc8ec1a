/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvpool.h - libkvpool, the C client of kvpoold. A model worker (or any tool) includes this one
 * header: connect, say hello, map the pool, register a staging buffer, and append / reserve /
 * fork / truncate / release sequences, read page tables and statistics; an operator's tool reads
 * the daemon-wide figures (stats of every namespace, sessions, metrics) through it too.
 *
 * One handle = one connection = one session of one namespace. Calls are blocking, answered in
 * order, each bounded by the handle's timeout; a handle is not thread-safe (use one per
 * thread, or a lock). Every function returns 0 or a negative KVP_E* code (kvp_error.h) and
 * leaves a human-readable message in kvp_client_last_error(). Server statuses map to codes as
 * kvp_wire_err_from_code does (INVALID_ARGUMENT -> KVP_EINVAL, NOT_FOUND -> KVP_ENOENT,
 * RESOURCE_EXHAUSTED -> KVP_ENOSPC, PERMISSION_DENIED -> KVP_EPERM, ...); transport failures are
 * KVP_ECLOSED (connection lost), KVP_ETIMEDOUT, KVP_EPROTO, or -errno from connect.
 *
 * Page tables come back in caller-owned int32 arrays laid out exactly as FlashInfer's plan()
 * and append_paged_kv_cache take them.
 *
 * Installed (`cmake --install`) as <prefix>/include/kvpool.h beside the headers it includes and
 * kvpool_version.h, with no kvpool/ folder (libuv's habit: #include <kvpool.h>); link
 * libkvpool.so through `pkg-config --cflags --libs kvpool` or CMake's find_package(kvpool) and
 * kvpool::kvpool (kvpool::kvpool_static for the self-contained libkvpool.a).
 */
#ifndef KVPOOL_H
#define KVPOOL_H

#include <stddef.h>
#include <stdint.h>

#include "kvp_error.h"
#include "kvp_kernels.h" /* kvp_paged_kv_t, kvp_append_src_t (kvp_client_cuda_append_fused) */
#include "kvp_layout.h"
#include "kvp_pool_info.h"
#include "kvpool_version.h" /* KVP_VERSION_*, KVP_ABI_VERSION */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_client kvp_client_t;

/* Most devices (pool fds) one daemon describes; one fd per device rides on the Hello frame. */
#define KVP_CLIENT_MAX_DEVICES KVP_MAX_DEVICES /* common/kvp_limits.h */

/* kvp_client_opts_t.lease_ms value that leaves the lease to the daemon (its configured
 * limits.default_lease_ms): the Hello then carries no lease at all. */
#define KVP_LEASE_DEFAULT UINT32_MAX

typedef struct {
    const char *socket_path; /* NULL: the default path (kvp_client_default_socket) */
    const char *ns;          /* namespace; NULL or "" -> "default" */
    const char *client_name; /* NULL -> program name */
    uint32_t lease_ms;       /* how long this namespace's sequences outlive its last session;
                                0 releases them when it goes; KVP_LEASE_DEFAULT: the daemon's */
    uint32_t timeout_ms;     /* per call; 0 -> 10000 */
    int map_pool;            /* ask for the pool fds and map the pool (host backend: mmap) */
    uint32_t busy_poll_us;   /* after a request, poll for the answer this long before sleeping
                                (latency for CPU: a wake-up costs tens of us on a VM); 0: the
                                value of $KVPOOL_BUSY_POLL_US (a decimal 0..1000000, else
                                kvp_client_connect fails with KVP_EINVAL), else off. At most
                                1000000. */
    int observer;            /* attach to no namespace (kvpool.proto HelloRequest.observer):
                                read-only calls only; ns, lease_ms and map_pool must be left
                                unset (NULL, KVP_LEASE_DEFAULT or 0, 0). kvpoolctl's mode. */
    const char *cache_scope; /* HelloRequest.cache_scope; NULL or "": the namespace's private
                                scope. At most 64 bytes (else KVP_EINVAL); every session of a
                                namespace names the same one (the daemon checks). */
} kvp_client_opts_t;

/* The pool as the daemon describes it (PoolInfo): kvp_pool_info_t of common/kvp_pool_info.h. */

/* A page table in caller-owned arrays. Zero the struct, then set the arrays and caps
 * (elements); after the call the counts are filled. An array left NULL is not wanted: its
 * entries are read and dropped. A reply larger than a non-NULL array's cap fails the call with
 * KVP_ELIMIT (the server-side change has happened; GetPageTable with bigger arrays reads the
 * table again). */
typedef struct {
    int32_t *kv_indptr;        /* [batch_size + 1] */
    int32_t *kv_indices;       /* [kv_indptr[batch_size]] */
    int32_t *kv_last_page_len; /* [batch_size] */
    int32_t *append_indptr;    /* [batch_size + 1] */
    int32_t *seq_lens;         /* [batch_size] */
    uint32_t *copies;          /* [2 * num_copies]: (src, dst) page pairs to copy first */
    uint32_t cap_batch;        /* capacity of the batch-sized arrays (>= batch_size + 1) */
    uint32_t cap_indices;      /* capacity of kv_indices */
    uint32_t cap_copies;       /* capacity of copies in pairs */
    uint32_t batch_size, nnz, num_indices, num_copies; /* filled by the call */
    uint32_t *cached_tokens; /* [batch_size] when not NULL, cap cap_batch: PageTable.cached_tokens
                                (0s when the answer has none) */
} kvp_page_table_t;

/* Where an Append reads K and V in a registered buffer (see kvpool.proto, message Source, and
 * common/kvp_layout.h: .layout, or its fields .k_offset ... .layer_stride directly); all in
 * bytes. layer_end 0 = all layers. */
typedef struct {
    uint32_t buffer_id;
    KVP_SRC_LAYOUT_MEMBER;
    uint32_t layer_begin, layer_end;
} kvp_source_t;

/* One rank of a tensor-parallel Append (kvpool.proto, RankSource): buffer `buffer_id` that
 * the connection with session `session_id` registered (kvp_client_session_id of the rank's
 * handle; 0: the calling handle), for the rank's own device. */
typedef struct {
    uint64_t session_id;
    uint32_t buffer_id;
} kvp_rank_source_t;

typedef struct {
    uint32_t num_pages, free_pages, used_pages, shared_pages, num_seqs, num_clients;
    uint64_t num_tokens, page_refs, page_bytes, uptime_ms, requests_total, append_bytes_total;
} kvp_stats_summary_t;

/* How a Reserve or Append uses the prefix cache (kvpool.proto: Batch.token_ids / salts /
 * salt_lens, CacheOptions). Borrowed for the call. token_ids: the token ids of the tokens
 * appended, sum(num_tokens) entries in batch order, or NULL (the call keys nothing, and the
 * sequences' chains end). salt_lens: n entries (0: no salt, at most 256 bytes each) or NULL
 * (no salts); salts: their concatenation (may be NULL when every length is 0). A salt applies
 * to a sequence this call starts (empty). reuse: start each such sequence with its longest
 * cached full-page prefix (PageTable.cached_tokens says how many tokens each row found; the
 * caller then computes and appends only the tokens after them); leave_last: with reuse, leave
 * at least one token to compute. priority: the pages' retention priority once released,
 * 0..100 (lower goes first), -1: the daemon's default (35); retention_ms: how long it holds
 * (0: while cached). skip_tokens (daemon-run Append with reuse, one sequence; Reserve: 0):
 * the source holds the rows of tokens [skip_tokens, num_tokens) only, because a Lookup said the
 * first skip_tokens are cached (a multiple of the page size); if fewer are cached by the time
 * the Append runs it fails with KVP_EPRECOND and changes nothing (kvpool.proto AppendRequest).
 * A zeroed struct with priority -1 is "token ids only, defaults". */
typedef struct {
    const int32_t *token_ids;
    const uint8_t *salts;
    const uint32_t *salt_lens;
    int reuse;
    int leave_last;
    int priority; /* -1: the daemon's default (35) */
    uint32_t retention_ms;
    uint32_t skip_tokens;
} kvp_cache_opts_t;

/* A pin (kvpool.proto PinResponse). */
typedef struct {
    uint64_t pin_id;
    uint32_t pinned_tokens, pinned_pages;
    uint64_t expires_in_ms;
} kvp_pin_t;

/* The prefix cache's counters (kvpool.proto CacheStats, the daemon-wide part). The host tier's
 * (issue #28) come last, appended so the earlier members keep their offsets; all 0 from a
 * daemon without a host tier (cache.host_bytes 0). hit_tokens_total counts tokens found on the
 * GPU, host_hit_tokens_total those found in host memory. */
typedef struct {
    uint32_t cached_pages, pinned_pages, indexed_pages, pins;
    uint64_t query_tokens_total, hit_tokens_total, evictions_pressure_total, evictions_flush_total,
        evictions_rewrite_total, bytes;
    /* the host tier */
    uint32_t host_pages;            /* entries kept in host memory */
    uint32_t host_slots;            /* slots usable now (pinned so far, within host_bytes) */
    uint64_t host_bytes_total;      /* cache.host_bytes as running */
    uint64_t host_bytes_ready;      /* of it allocated and pinned so far */
    uint64_t host_hit_tokens_total; /* tokens of Lookups and reuse found in host memory */
    uint64_t demotions_total;       /* pages moved GPU -> host */
    uint64_t promotions_total;      /* pages restored host -> GPU */
    uint64_t host_evictions_total;  /* dropped from the host tier (final) */
    uint64_t offload_bytes_total, restore_bytes_total;
    uint64_t offload_us_total, restore_us_total; /* the copies' time (worker threads, summed) */
    uint32_t demoting, restoring;                /* pages being copied out / restored now */
    uint32_t host_slot_bytes;                    /* one host slot: a page, every layer, K and V */
} kvp_cache_stats_t;

/* sizeof the public struct called type_name (each struct typedef of this header:
 * "kvp_client_opts_t", "kvp_pool_info_t", "kvp_page_table_t", "kvp_source_t",
 * "kvp_rank_source_t", "kvp_stats_summary_t", "kvp_transfer_ticket_t", "kvp_transfer_info_t",
 * "kvp_cache_opts_t", "kvp_pin_t", "kvp_cache_stats_t", "kvp_namespace_stats_t",
 * "kvp_scope_stats_t", "kvp_daemon_stats_t", "kvp_seq_info_t", "kvp_session_info_t",
 * "kvp_load_t"), 0 for any other name: bindings that mirror the structs (the Python package's
 * ctypes) check their copies against it. */
size_t kvp_client_sizeof(const char *type_name);

/* The version of the libkvpool that is running: KVP_VERSION_STRING of the library's own build
 * ("1.2.3"), static storage, any thread. A program compares it with the KVP_VERSION_STRING it
 * was compiled with to tell a newer or older library loaded at run time. */
const char *kvp_client_version(void);

/* The running library's ABI number, KVP_ABI_VERSION of its build (its SONAME major:
 * libkvpool.so.1 answers 1). A binding that mirrors the structs (ctypes) refuses a library whose
 * number differs from the one it was written for, then checks kvp_client_sizeof. Any thread. */
unsigned kvp_client_abi_version(void);

/* Default socket: $KVPOOL_SOCKET; else /run/kvpool/kvpool.sock for root, else
 * $XDG_RUNTIME_DIR/kvpool/kvpool.sock (or /tmp/kvpool-<uid>/kvpool.sock without it).
 * Writes into buf (NUL-terminated); returns buf, or NULL if it does not fit. */
char *kvp_client_default_socket(char *buf, size_t len);

/* Connects and says Hello. On success *out is a live handle (free with kvp_client_close).
 * Returns 0, -errno from connect (e.g. -ENOENT, -ECONNREFUSED: daemon unreachable), or a
 * server status (KVP_EPERM, KVP_EINVAL ...). When it fails, err (if not NULL) receives the
 * message. */
int kvp_client_connect(const kvp_client_opts_t *opts, kvp_client_t **out, char *err,
                       size_t err_len);

/* Closes the connection, unmaps the pool and frees the handle. NULL is a no-op. */
void kvp_client_close(kvp_client_t *c);

/* Message of the last failed call on this handle ("" after a success). */
const char *kvp_client_last_error(const kvp_client_t *c);

/* The session id the daemon assigned in Hello. */
uint64_t kvp_client_session_id(const kvp_client_t *c);

/* The daemon's version string from Hello ("" when it sent none). Owned by the handle. */
const char *kvp_client_server_version(const kvp_client_t *c);

const kvp_pool_info_t *kvp_client_pool_info(const kvp_client_t *c);

/* The mapped pool of device `device` (host backend: the memfd mapping; cuda backend: the
 * DEVICE pointer once kvp_client_cuda_map_pool ran), or NULL when the pool was not mapped.
 * Layer l's K tensor is at base + l * layer_bytes, V at + v_offset_bytes. */
void *kvp_client_pool_base(const kvp_client_t *c, uint32_t device);

/* The pool fd of device `device` that the handle keeps open (cuda backend, for the VMM
 * import), or -1 (host backend: the fd is closed once mapped; pool not mapped). Borrowed:
 * owned by the handle and closed by kvp_client_close. */
int kvp_client_pool_fd(const kvp_client_t *c, uint32_t device);

int kvp_client_ping(kvp_client_t *c, uint64_t *rtt_ns);

/* Creates a memfd staging buffer of size_bytes, maps it (returned in *ptr) and registers it.
 * The buffer is unmapped and unregistered by kvp_client_unregister_buffer or at close. */
int kvp_client_alloc_host_buffer(kvp_client_t *c, uint64_t size_bytes, void **ptr,
                                 uint32_t *buffer_id);

/* Registers a buffer given as an fd (memfd, or a CUDA VMM POSIX fd for kind 1); the fd is sent
 * and stays owned by the caller. kind: 0 memfd, 1 cuda vmm fd. */
int kvp_client_register_fd(kvp_client_t *c, int fd, uint32_t kind, uint64_t size_bytes,
                           uint32_t *buffer_id);

int kvp_client_unregister_buffer(kvp_client_t *c, uint32_t buffer_id);

/* Daemon-run append: the daemon grows the n sequences by num_tokens[i] tokens, copies K/V
 * from the source and answers once the data is in the pool. table (may be NULL) receives the
 * batch's page table. */
int kvp_client_append(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                      uint32_t n, const kvp_source_t *src, kvp_page_table_t *table);

/* Tensor-parallel daemon-run append (DESIGN.md §6), sent by the group's leader: the daemon
 * grows the sequences once and copies, on every device g of the pool's group, device g's
 * heads from ranks[g]'s buffer (num_ranks = the pool's num_devices, in device order). src
 * gives the offsets, strides and layer range that apply to every rank's buffer (its
 * buffer_id is not used). sync_events: every rank recorded its buffer's ready event
 * (kvp_client_cuda_record_ready) before this call, and the daemon waits for each of them on
 * its CPU; 0: the ranks' data is already in their buffers. Appends on all devices or on none.
 * table as in kvp_client_append. */
int kvp_client_append_ranks(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                            uint32_t n, const kvp_source_t *src, const kvp_rank_source_t *ranks,
                            uint32_t num_ranks, int sync_events, kvp_page_table_t *table);

/* Reserve: the same allocation and page table without the copy; the caller runs the returned
 * copies (copy-on-write) and then its own appends on the mapped pool. */
int kvp_client_reserve(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                       uint32_t n, kvp_page_table_t *table);

/* ---- the prefix cache (kvpool.proto "the prefix cache", DESIGN.md §9) ---------------------
 * Pages keyed by their content (token ids + salt, in the namespace's cache scope, see
 * kvp_client_opts_t.cache_scope) are found again by later sequences of the scope. A keyed
 * page becomes findable only once its K/V is written in every layer: at once for a daemon-run
 * Append over every layer; after kvp_client_commit (or kvp_client_cuda_commit) for Reserve. */

/* kvp_client_reserve with the prefix cache: cache (NULL: exactly kvp_client_reserve) gives
 * the token ids, salts and options. With reuse, table->cached_tokens (when not NULL) receives
 * the tokens each row linked from the cache; the page table's append_indptr counts only the
 * tokens after them, which the caller appends (then commits). KVP_EINVAL: salts without
 * salt_lens, a salt length without salts, a priority below -1, or more token ids or salt
 * bytes than one call carries (UINT32_MAX); the daemon refuses the rest (token_ids of another
 * count than sum(num_tokens), a salt above 256 bytes, a priority above 100). */
int kvp_client_reserve_cached(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                              uint32_t n, const kvp_cache_opts_t *cache, kvp_page_table_t *table);

/* kvp_client_append with the prefix cache (cache NULL: exactly kvp_client_append). The pages
 * it fills are findable once it answered OK when src covers every layer (else after a
 * Commit). With reuse only the tokens after each row's cached prefix are appended
 * (append_indptr and nnz count only them; kvpool.proto CacheOptions). Errors as
 * kvp_client_reserve_cached. */
int kvp_client_append_cached(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                             uint32_t n, const kvp_source_t *src, const kvp_cache_opts_t *cache,
                             kvp_page_table_t *table);

/* Commit: makes the keyed pages of the n sequences findable (the Reserve path, after the
 * caller's own appends of every layer). event_handle: NULL (the writes are complete: the
 * caller synchronized its stream) or the 64 bytes of a cudaIpcEventHandle_t of an
 * interprocess event recorded after the appends, which the daemon polls before it publishes
 * (kvp_client_cuda_commit does this for a stream). *pages (may be NULL): pages covered;
 * *published (may be NULL): of them findable when the daemon answered. */
int kvp_client_commit(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n,
                      const void *event_handle, uint32_t *pages, uint32_t *published);

/* Lookup, no side effect: how many leading tokens of each of n prompts are cached in the
 * caller's scope. token_ids: the prompts one after the other (sum(lengths) entries); salts /
 * salt_lens as in kvp_cache_opts_t (salt_lens NULL: no salts). cached_tokens[n] receives the
 * answer (whole pages: multiples of the page size). KVP_ENOSPC (RESOURCE_EXHAUSTED, as every
 * limit the daemon enforces): more prompts than limits.max_batch or tokens than
 * limits.max_lookup_tokens; last_error says which. */
int kvp_client_lookup(kvp_client_t *c, const int32_t *token_ids, const uint32_t *lengths,
                      uint32_t n, const uint8_t *salts, const uint32_t *salt_lens,
                      uint32_t *cached_tokens);

/* kvp_client_lookup that also reads the host tier (issue #28): host_tokens[n] (may be NULL: not
 * wanted) receives LookupResponse.host_tokens, the tokens after cached_tokens[i] found in host
 * memory (whole pages; a Reserve or Append with reuse, or a Load, restores them to the GPU
 * first). All 0 when the daemon has no host tier (the answer carries no host_tokens). Errors as
 * kvp_client_lookup; KVP_EPROTO when the answer's host_tokens are not one per prompt. Neither
 * array is written by a call that fails before the answer arrives. */
int kvp_client_lookup_tiers(kvp_client_t *c, const int32_t *token_ids, const uint32_t *lengths,
                            uint32_t n, const uint8_t *salts, const uint32_t *salt_lens,
                            uint32_t *cached_tokens, uint32_t *host_tokens);

/* What a Load answered (kvpool.proto LoadResponse). */
typedef struct {
    uint32_t loaded_tokens; /* tokens copied into the buffer: a multiple of the page size */
    uint32_t host_tokens;   /* of them, restored from the host tier first */
    int completed;          /* the bytes are in the buffer (always 1 from current daemons) */
} kvp_load_t;

/* Load (issue #28): copies the cached full pages of the prompt token_ids[num_tokens]'s prefix
 * (salt[salt_len], at most 256 bytes; salt may be NULL when salt_len is 0), from the GPU or the
 * host tier, into buffer dest->buffer_id, which this handle registered and the daemon can write
 * (a host buffer of kvp_client_alloc_host_buffer; device memory on the cuda backend), laid out
 * where an Append with dest as its source would read them: token t of layer l, head h at
 * k_offset + (l - layer_begin) * layer_stride + t * k_stride_n + h * k_stride_h (K; V alike).
 * max_tokens > 0 caps the tokens copied (whole pages; 0: every cached one). Returns once the
 * bytes are in the buffer; *out (may be NULL) receives the answer. KVP_ENOENT: no page of the
 * prefix is cached (or no buffer dest->buffer_id on this connection, as for an Append);
 * KVP_EINVAL: a bad layout (checked as an Append's source is: the wire has no OUT_OF_RANGE, a
 * range error arrives as INVALID_ARGUMENT); KVP_EPRECOND: a buffer the daemon cannot write;
 * KVP_ENOSPC: over the namespace's page quota while the copy holds the pages. KVP_EINVAL before
 * anything is sent: NULL token_ids with num_tokens, NULL dest, a salt over 256 bytes or NULL
 * with salt_len. On any failure nothing is written to the buffer and *out is left as it was;
 * the message is in kvp_client_last_error(). */
int kvp_client_load(kvp_client_t *c, const int32_t *token_ids, uint32_t num_tokens,
                    const void *salt, uint32_t salt_len, const kvp_source_t *dest,
                    uint32_t max_tokens, kvp_load_t *out);

/* Pin: keeps the cached prefix of the prompt token_ids[num_tokens] (with salt[salt_len], at
 * most 256 bytes; salt may be NULL when salt_len is 0) resident for ttl_ms (0: the daemon's
 * limits.pin_max_ttl_ms), whoever holds it; the pin belongs to the namespace and outlives its
 * sessions. *out (may be NULL) receives the pin. KVP_ENOENT: nothing of the prompt is cached;
 * KVP_ENOSPC: over the namespace's pinned-page quota (nothing pinned). */
int kvp_client_pin(kvp_client_t *c, const int32_t *token_ids, uint32_t num_tokens, const void *salt,
                   uint32_t salt_len, uint32_t ttl_ms, kvp_pin_t *out);

/* Drops pin pin_id of this namespace; *pages (may be NULL): the pages it held. KVP_ENOENT: no
 * such pin. */
int kvp_client_unpin(kvp_client_t *c, uint64_t pin_id, uint32_t *pages);

/* CacheFlush: drops every cached page nobody holds (pinned and held pages stay) in the
 * caller's scope; scope (NULL or "": own; at most 64 bytes) and all (every scope) are for an
 * operator (root or the daemon's uid; others KVP_EPERM). *pages (may be NULL): pages
 * dropped. */
int kvp_client_cache_flush(kvp_client_t *c, const char *scope, int all, uint32_t *pages);

/* ---- the cache snapshot (issue #29, KV events; kvpool.proto CacheDump) -------------------- */

#define KVP_CACHE_DUMP_MAX_BYTES (1u << 20) /* the most blocks bytes one page carries */

/* One page of the snapshot. The caller supplies records (room for records_cap bytes;
 * KVP_CACHE_DUMP_MAX_BYTES always suffices) and names (names_cap bytes, the same suffices);
 * the call fills the rest. */
typedef struct {
    uint8_t *records;
    size_t records_cap;
    char *names;
    size_t names_cap;
    uint32_t num_blocks;   /* records of this page */
    uint32_t record_bytes; /* 40 + 4 * block_size */
    uint32_t block_size;
    uint32_t next_cursor; /* 0: this was the last page */
    int64_t next_seq;     /* the first event batch not reflected (-1: events off) */
    int events;           /* events are on: token ids and parents are real */
    size_t names_len;
} kvp_cache_dump_t;

/* A block of a page, decoded (pointers into the page's buffers). */
typedef struct {
    uint8_t hash[16];   /* as the events name it */
    uint8_t parent[16]; /* zeros when !has_parent */
    int has_parent;
    int medium;               /* 0: GPU, 1: CPU (the host tier) */
    const char *scope;        /* as extra_keys carries it */
    const int32_t *token_ids; /* block_size of them (unaligned-safe: copy before use on
                                 strict-alignment machines) */
} kvp_cache_block_t;

/* CacheDump: the page of the snapshot from cursor (0: the first) of at most max_blocks blocks
 * (0: as many as fit). An operator (root, the daemon's uid) sees every scope, anyone else
 * their namespace's; an observer session that is no operator gets KVP_EPERM. Continue with
 * d->next_cursor until it is 0; load the pages, then apply event batches from the FIRST
 * page's next_seq on (kvpool.proto CacheDump: why that is consistent). KVP_ELIMIT when the
 * page does not fit records_cap or names_cap (KVP_CACHE_DUMP_MAX_BYTES each always do). */
int kvp_client_cache_dump(kvp_client_t *c, uint32_t cursor, uint32_t max_blocks,
                          kvp_cache_dump_t *d);

/* Block i of a page: 0, or KVP_EINVAL (i out of range, or a record naming no scope). */
int kvp_cache_dump_block(const kvp_cache_dump_t *d, uint32_t i, kvp_cache_block_t *out);

/* The prefix cache's counters from Stats.cache (all 0 from a daemon that sends none). */
int kvp_client_cache_stats(kvp_client_t *c, kvp_cache_stats_t *out);

int kvp_client_fork(kvp_client_t *c, uint64_t parent, uint64_t child);
int kvp_client_truncate(kvp_client_t *c, uint64_t seq_id, uint32_t num_tokens);
/* Releases n sequences; *released (may be NULL) counts those that existed. */
int kvp_client_release(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n, uint32_t *released);
int kvp_client_page_table(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n,
                          kvp_page_table_t *table);
int kvp_client_stats(kvp_client_t *c, kvp_stats_summary_t *out);
/* Runs the daemon's audit: 0 when clean, KVP_EAUDIT with the violation in last_error. */
int kvp_client_audit(kvp_client_t *c);

/* ---- transfers between daemons (DESIGN.md §6, kvpool.proto ExportBegin / Import) ----------
 * The sending engine calls kvp_client_export_begin on its daemon and hands the ticket to the
 * receiving engine (over its own channel), which calls kvp_client_import on its daemon; the
 * two daemons then move the sequence over NCCL. Both answer KVP_EUNAVAIL when a daemon cannot
 * transfer (host backend, no NCCL). */

#define KVP_TRANSFER_ID_BYTES 128
#define KVP_TRANSFER_MAX_SEQS 64 /* sequences in one transfer (a set) */

typedef struct {
    uint8_t nccl_id[KVP_TRANSFER_ID_BYTES]; /* the communicator's ncclUniqueId */
    uint64_t transfer_id;
    uint32_t num_tokens, num_layers; /* num_tokens: of the whole set */
    uint64_t bytes;                  /* of the packed stream */
    uint32_t num_seqs;               /* 1, or a set's size */
    uint32_t chunk_bytes, flags;     /* the stream's shape: pass the ticket on unchanged */
    uint32_t seq_tokens[KVP_TRANSFER_MAX_SEQS]; /* each sequence's tokens, in stream order */
} kvp_transfer_ticket_t;

/* Starts sending sequence seq_id (its tokens now) to the daemon named peer (the communicator
 * cache key: one name per receiving daemon); answers at once with the ticket. timeout_ms: the
 * whole transfer, the receiver's join included (0: the daemon's transfer.timeout_ms). The
 * outcome is in kvp_client_list_transfers. */
int kvp_client_export_begin(kvp_client_t *c, uint64_t seq_id, const char *peer, uint32_t timeout_ms,
                            kvp_transfer_ticket_t *ticket);

/* The same for a set of n (1..KVP_TRANSFER_MAX_SEQS) distinct sequences moved as one transfer:
 * one stream, the sequences one after the other, so the set pays one set-up and one pipeline
 * fill and drain (the way to hand a batch of prefilled requests to a decode node). */
int kvp_client_export_begin_set(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n,
                                const char *peer, uint32_t timeout_ms,
                                kvp_transfer_ticket_t *ticket);

/* Receives the ticket's sequence as the new sequence seq_id of this namespace; returns once
 * the data is in the pool (this call waits up to timeout_ms, or the daemon's default, plus the
 * handle's own timeout). On failure (KVP_EUNAVAIL: the sender went away; KVP_ETIMEDOUT: the
 * deadline; KVP_EINVAL: the streams do not match; KVP_EEXIST; KVP_ENOSPC) the pool is as it
 * was. *num_pages (may be NULL) receives the new sequence's pages. */
int kvp_client_import(kvp_client_t *c, const kvp_transfer_ticket_t *ticket, uint64_t seq_id,
                      uint32_t timeout_ms, uint32_t *num_pages);

/* Receives a set's ticket as the new sequences seq_ids[ticket->num_seqs] (in the exporter's
 * order), all or none: on failure none of them exists. *num_pages: of all of them. */
int kvp_client_import_set(kvp_client_t *c, const kvp_transfer_ticket_t *ticket,
                          const uint64_t *seq_ids, uint32_t timeout_ms, uint32_t *num_pages);

typedef struct {
    uint64_t transfer_id, seq_id, bytes, elapsed_ms; /* seq_id: a set's first */
    uint32_t num_tokens, num_seqs;
    char direction[8]; /* "export" | "import" */
    char state[8];     /* "running" | "ok" | "failed" */
    char peer[65], ns[65], message[128];
} kvp_transfer_info_t;

/* Transfers in flight, then the newest finished ones (at most 32), into out[max]; *n receives
 * how many. */
int kvp_client_list_transfers(kvp_client_t *c, kvp_transfer_info_t *out, uint32_t max, uint32_t *n);

/* ---- daemon-wide reads for operators and monitoring (kvpoolctl speaks only through these) ---
 * What the daemon shows of itself beyond the caller's own sequences: the whole Stats answer
 * with its namespaces and cache scopes, a namespace's sequences, the connected sessions, the
 * audit's verdict, the Prometheus text and the pool description. An observer handle
 * (kvp_client_opts_t.observer) may make all of them; each lists only what the caller's uid may
 * see (the daemon decides). The wire bounds what one answer holds: */
#define KVP_CLIENT_NAME_BYTES          65  /* a namespace, client or scope name, NUL included */
#define KVP_CLIENT_SCOPE_NAME_BYTES    72  /* a scope as Stats names it ("ns:<namespace>") */
#define KVP_CLIENT_MAX_NAMESPACES      64  /* namespaces in one Stats answer */
#define KVP_CLIENT_MAX_SCOPES          64  /* cache scopes in one Stats answer */
#define KVP_CLIENT_MAX_SEQS_LISTED     256 /* sequences in one kvp_client_list_seqs page */
#define KVP_CLIENT_MAX_SESSIONS        256 /* sessions kvp_client_list_clients returns */
#define KVP_CLIENT_MAX_TRANSFERS       32  /* transfers kvp_client_list_transfers returns */
#define KVP_CLIENT_AUDIT_MESSAGE_BYTES 256 /* the audit's text, NUL included */

/* One namespace of a Stats answer (kvpool.proto NamespaceStats). */
typedef struct {
    char name[KVP_CLIENT_NAME_BYTES];
    uint32_t num_seqs, sessions, lease_ms;
    uint32_t dedup_entries; /* request ids its dedup window remembers (kept or not) */
    uint64_t num_tokens, page_refs;
    uint64_t lease_expires_in_ms; /* 0 while a session is attached */
    uint64_t dedup_bytes;         /* of answers its dedup window keeps for retries */
} kvp_namespace_stats_t;

/* One cache scope of a Stats answer (kvpool.proto CacheScopeStats). */
typedef struct {
    char name[KVP_CLIENT_SCOPE_NAME_BYTES]; /* a scope name, or "ns:<namespace>" (private) */
    uint32_t uid;                           /* of an unlisted scope; 0 for shared ones */
    uint32_t namespaces;                    /* attached */
    uint32_t cached_pages;                  /* findable, held by nobody */
    uint32_t indexed_pages;                 /* findable, held or not */
    uint64_t query_tokens, hit_tokens;      /* tokens asked for (Lookup, reuse); of them found
                                               on the GPU */
    uint32_t host_pages;                    /* entries kept in the host tier (issue #28) */
    uint64_t host_hit_tokens;               /* of the tokens asked for, found in the host tier */
} kvp_scope_stats_t;

/* The whole Stats answer. Zero the struct, then set the arrays and their caps (entries); the
 * call fills the rest. An array left NULL (cap 0) is not wanted; entries beyond a cap are
 * dropped (caps of KVP_CLIENT_MAX_NAMESPACES and KVP_CLIENT_MAX_SCOPES drop nothing). */
typedef struct {
    kvp_stats_summary_t summary; /* what kvp_client_stats returns */
    uint64_t dedup_bytes;        /* answers kept for retries, all namespaces */
    uint64_t dedup_evictions_total;
    uint32_t namespaces_total;         /* namespaces visible to the caller (0 from a daemon that
                                          does not count them: then num_namespaces is all) */
    int namespaces_truncated;          /* the answer lists only some of them */
    int pool_shared_across_uids;       /* the pool fds went to sessions of two uids since start */
    int has_cache;                     /* the answer carries the prefix cache's figures */
    kvp_cache_stats_t cache;           /* as kvp_client_cache_stats (0s without has_cache) */
    kvp_namespace_stats_t *namespaces; /* [cap_namespaces] */
    kvp_scope_stats_t *scopes;         /* [cap_scopes]: the cache's scopes visible to the caller */
    uint32_t cap_namespaces, cap_scopes;
    uint32_t num_namespaces, num_scopes; /* filled: entries written */
} kvp_daemon_stats_t;

/* Stats, all of it, into *out (arrays and caps set by the caller, the rest overwritten; all 0
 * from a daemon that sends no figures). Returns 0 or the call's code; KVP_EINVAL for out NULL
 * or an array NULL with a cap. */
int kvp_client_daemon_stats(kvp_client_t *c, kvp_daemon_stats_t *out);

/* One sequence of a ListSequences answer (kvpool.proto SequenceInfo). */
typedef struct {
    uint64_t seq_id;
    uint64_t idle_ms; /* since a call last touched it */
    uint32_t num_tokens, num_pages;
    uint32_t shared_pages; /* of its pages, those another sequence holds too */
} kvp_seq_info_t;

/* One page of the sequences of namespace ns (ListSequences): ns NULL or "" is the caller's own
 * (an observer must name one; KVP_EINVAL), at most 64 bytes. Starts at cursor (0: the first)
 * and writes at most max entries (1..KVP_CLIENT_MAX_SEQS_LISTED; a larger max gets that many)
 * into out; *n receives how many, *next_cursor (may be NULL) where the next page starts, 0
 * when none is left. KVP_ENOENT: no namespace ns; KVP_EPERM: another uid's namespace. */
int kvp_client_list_seqs(kvp_client_t *c, const char *ns, uint32_t cursor, kvp_seq_info_t *out,
                         uint32_t max, uint32_t *n, uint32_t *next_cursor);

/* One connected session (kvpool.proto ClientInfo). */
typedef struct {
    uint64_t session_id;
    uint64_t requests;              /* answered so far */
    uint64_t connected_ms;          /* since it connected */
    char ns[KVP_CLIENT_NAME_BYTES]; /* the namespace it attached to; "" for an observer */
    char client_name[KVP_CLIENT_NAME_BYTES];
    int32_t pid;
    uint32_t uid, gid;
    uint32_t buffers; /* staging buffers registered */
} kvp_session_info_t;

/* The sessions the caller may see (ListClients: an operator all, another uid its own and
 * those attached to its namespaces), the first max of them into out[max]; *n receives how
 * many (a max of KVP_CLIENT_MAX_SESSIONS drops none). */
int kvp_client_list_clients(kvp_client_t *c, kvp_session_info_t *out, uint32_t max, uint32_t *n);

/* The daemon's audit, its verdict as data: returns 0 with *ok 1 (clean) or 0 (a violation, or
 * the audit could not run) and the daemon's text ("ok" when clean) in message (len bytes,
 * NUL-terminated, cut to fit: KVP_CLIENT_AUDIT_MESSAGE_BYTES holds it all; NULL or len 0: not
 * wanted); or the call's code when the daemon
 * could not be asked. kvp_client_audit is the same with a violation as KVP_EAUDIT. */
int kvp_client_audit_report(kvp_client_t *c, int *ok, char *message, size_t len);

/* The daemon's metrics in the Prometheus text exposition format 0.0.4 (what its HTTP endpoint
 * serves), into text (cap bytes, NUL-terminated); *len (may be NULL) receives its length
 * without the NUL. KVP_ELIMIT: the text needs more than cap bytes. */
int kvp_client_metrics(kvp_client_t *c, char *text, size_t cap, size_t *len);

/* Asks the daemon for its pool description again (PoolInfo, no descriptors) into *out.
 * kvp_client_pool_info returns the copy Hello brought, which the daemon keeps for its life. */
int kvp_client_get_pool_info(kvp_client_t *c, kvp_pool_info_t *out);

/* The protocol version this library speaks (kvpool.proto HelloRequest.protocol_version); a
 * daemon of another one refuses the Hello. Any thread. */
unsigned kvp_client_protocol_version(void);

/* Low-level access for tests and tools that need a call libkvpool does not wrap: sends an
 * already-filled Request (zero-initialised, then the body set; its id is set here) and decodes
 * the Response into *resp, binding bulk arrays to `arrays` (may be NULL: bulk fields are skipped;
 * an array whose data is NULL is skipped but counted). Descriptors attached to the response are
 * closed. Types are kvpool_Request / kvpool_Response / kvp_reply_arrays_t from kvp_wire.h; declared
 * void here so this header does not need nanopb's. Returns the transport or status code; KVP_ELIMIT
 * when a bound array or text is smaller than the reply. */
int kvp_client_call_raw(kvp_client_t *c, void *request, void *response, void *arrays);

/* ---- CUDA (cuda backend) ------------------------------------------------------------------
 * For workers of a daemon whose pool lives on GPUs (kvp_pool_info_t.backend == 1). Device
 * pointers are void *, streams are cudaStream_t passed as void * (PyTorch's, CuPy's: the
 * driver's handles), so this header needs no CUDA header. Each call may set the calling
 * thread's current device while it works and restores the previous one before returning.
 * Every function returns KVP_EUNAVAIL when libkvpool was built without CUDA or no CUDA driver
 * is usable; CUDA failures return the KVP_E* code of kvp_error.h that fits (KVP_EINVAL for a
 * refused handle or pointer, KVP_ENOMEM, KVP_EINTERNAL) with the failing call, file and line
 * in kvp_client_last_error() and in kvp_last_cuda_error(). Kernels are loaded eagerly on each
 * device the handle touches, before any cross-stream wait (CUDA lazy loading deadlocks such
 * waits). */

/* What the last failing CUDA call of the CALLING THREAD was, "" when none failed (never
 * NULL): "FILE:LINE CALL: TEXT (NAME)", e.g. "kernels/kvp_append_cuda.cu:790 kernel launch:
 * invalid argument (cudaErrorInvalidValue)", FILE relative to kvpool's source tree. Per thread,
 * not per handle: it covers the kvp_client_cuda_* calls and the in-process kernels of
 * kvp_kernels_cuda.h (whose entry points return only a KVP_E* code), so a worker learns which
 * call failed where. A success does not clear it; kvp_clear_cuda_error() does. The text is the
 * thread's and stays valid until its next CUDA failure or clear. libkvpool logs nothing: this
 * is how a caller reads CUDA failures. Present in every build ("" without CUDA). */
const char *kvp_last_cuda_error(void);

/* Empties the calling thread's kvp_last_cuda_error(). */
void kvp_clear_cuda_error(void);

/* Maps the pool of every device (connect with map_pool = 1): imports each pool fd with the
 * CUDA VMM API and maps pool_bytes rounded up to map_granularity read/write on CUDA device
 * device_ids[g] (the daemon's ordinals: run both with the same CUDA_VISIBLE_DEVICES). After it
 * kvp_client_pool_base(c, g) returns the DEVICE pointer of device g's pool, for the in-process
 * append (kvp_kernels_cuda.h) after kvp_client_reserve. A second call does nothing. Returns 0,
 * KVP_EPRECOND (not a cuda pool, or no pool fds: connect with map_pool), or a CUDA code. */
int kvp_client_cuda_map_pool(kvp_client_t *c);

/* Allocates size_bytes (rounded up to the VMM granularity) of memory on CUDA device `device`
 * with the VMM API, maps it here (*dptr, 16-byte aligned) and registers it with the daemon as
 * a BUFFER_CUDA_VMM_FD staging buffer (*buffer_id). with_events: also an interprocess "ready"
 * event sent with it, and the daemon's "done" event kept, so kvp_client_cuda_append_async
 * orders the copy on the GPU. Freed by kvp_client_cuda_free_buffer or kvp_client_close. */
int kvp_client_cuda_alloc_buffer(kvp_client_t *c, uint64_t size_bytes, int device, void **dptr,
                                 uint32_t *buffer_id, int with_events);

/* Registers size_bytes of cudaMalloc'd memory at dptr_base (a PyTorch tensor's storage, say;
 * it may lie inside a larger allocation) as a BUFFER_CUDA_IPC staging buffer, with events. The
 * memory stays the caller's and must outlive the registration; PyTorch's expandable segments
 * (VMM memory) cannot be shared this way. Source offsets given to kvp_client_cuda_append_async
 * are relative to dptr_base; kvp_client_append instead takes them relative to the start of the
 * allocation that holds dptr_base (cuMemGetAddressRange). */
int kvp_client_cuda_register_ipc(kvp_client_t *c, const void *dptr_base, uint64_t size_bytes,
                                 uint32_t *buffer_id);

/* Daemon-run append ordered by events: records the buffer's ready event on `stream`, sends
 * Append with SYNC_EVENT, and returns with the appended pages in place, so work queued on
 * `stream` afterwards sees them without any stream synchronisation here (an answer with
 * completed = 0, which no current daemon sends, makes `stream` wait for the done event). The
 * daemon waits for the ready event on its own CPU (never on its GPU stream, which a dying
 * worker could stall for every namespace), runs the copy to completion and answers: the
 * call therefore returns once the work queued on `stream` before it has run. A ready event
 * that does not complete within the daemon's timeout (30 s) fails the call with
 * KVP_EUNAVAIL and nothing appended. The buffer (src->buffer_id) must come from
 * kvp_client_cuda_alloc_buffer / register_ipc on this handle; one without events makes this
 * synchronise `stream` first and the daemon finish the copy before it answers. table as in
 * kvp_client_append. */
int kvp_client_cuda_append_async(kvp_client_t *c, const uint64_t *seq_ids,
                                 const uint32_t *num_tokens, uint32_t n, const kvp_source_t *src,
                                 kvp_page_table_t *table, void *stream);

/* kvp_client_cuda_append_async with the prefix cache (kvp_client_append_cached; cache NULL:
 * exactly kvp_client_cuda_append_async). */
int kvp_client_cuda_append_async_cached(kvp_client_t *c, const uint64_t *seq_ids,
                                        const uint32_t *num_tokens, uint32_t n,
                                        const kvp_source_t *src, const kvp_cache_opts_t *cache,
                                        kvp_page_table_t *table, void *stream);

/* For a rank of a tensor-parallel group: records the ready event of buffer_id (a buffer with
 * events of this handle) on `stream`, after the rank's K/V were queued there; the rank then
 * tells its leader, whose kvp_client_append_ranks (sync_events = 1) makes the daemon wait for
 * it. */
int kvp_client_cuda_record_ready(kvp_client_t *c, uint32_t buffer_id, void *stream);

/* For a rank after its leader's kvp_client_append_ranks: makes `stream` wait for the daemon's
 * done event of buffer_id, so work queued there afterwards sees the appended pages. (The
 * daemon answers an Append once the copy has completed, so this wait is only needed when the
 * leader saw completed = 0; it is always correct.) */
int kvp_client_cuda_wait_done(kvp_client_t *c, uint32_t buffer_id, void *stream);

/* Queues the copy-on-write copies of t (a kvp_client_reserve answer; nothing when it has none)
 * on `stream`, every layer, on the mapped pool of the current CUDA device (one of the pool's
 * devices; kvp_client_cuda_map_pool first). Queue it before the step's own appends on the
 * same stream. The page ids are uploaded through a small pinned scratch of the handle. */
int kvp_client_cuda_copy_pages(kvp_client_t *c, const kvp_page_table_t *t, void *stream);

/* Commit for the Reserve path on the GPU: records an interprocess event of the handle on
 * `stream` (a stream of the calling thread's current CUDA device) after the caller's appends
 * of every layer queued there, and sends Commit with the event's 64-byte handle: the daemon
 * answers at once and publishes the sequences' keyed pages when it sees the event complete
 * (it polls it on its CPU). Returns without waiting for the GPU. The handle keeps one event
 * per device, created (and its IPC handle taken) the first time, then re-recorded: a later
 * Commit only moves an earlier one's publication later, never earlier. */
int kvp_client_cuda_commit(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n, void *stream);

/* kvp_client_cuda_commit that also returns the answer's counts (as kvp_client_commit; each
 * may be NULL). */
int kvp_client_cuda_commit_ex(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n, void *stream,
                              uint32_t *pages, uint32_t *published);

/* Unregisters a buffer of kvp_client_cuda_alloc_buffer / register_ipc and frees what the
 * handle holds for it (mapping, events). Work queued on it must be finished. */
int kvp_client_cuda_free_buffer(kvp_client_t *c, uint32_t buffer_id);

/* kvp_client_cuda_append_fused's flags. */
enum {
    /* Programmatic dependent launch (sm_90+, ignored before; kvp_kernels_cuda.h's
     * KVP_CUDA_APPEND_PDL): the copy may start while the stream's previous kernel still runs.
     * It reads the page table (kv's kv_indptr, kv_indices, kv_last_page_len and append_indptr)
     * at once and waits for that kernel only before it reads the sources and writes the pool:
     * so the page-table arrays must be complete before the previous kernel starts (uploaded
     * earlier in the stream), while the sources may come from the previous kernel. FlashInfer's
     * enable_pdl contract. */
    KVP_CLIENT_CUDA_APPEND_PDL = 1u,
};

/* The in-process append of the Reserve path in one launch (kvp_kernels_cuda.h's fused append,
 * FlashInfer's append_paged_kv_cache with the batch indices and positions computed inside the
 * launch): token i of src ([nnz, num_heads, head_dim] rows) belongs to the request b with
 * append_indptr[b] <= i < append_indptr[b+1] and goes to position seq_len[b] - append_len[b] +
 * (i - append_indptr[b]) of it, seq_len from kv's page table (which already counts the
 * appended tokens: a Reserve answer). kv describes one layer of a pool this process mapped
 * (kvp_client_cuda_map_pool; kvp_client_pool_info gives the strides) or any other paged cache;
 * its page-table arrays and append_indptr ([kv->batch_size + 1]) are DEVICE int32 arrays,
 * read only by the kernel (kv_indices must hold kv_indptr[batch_size] entries and kv_indptr
 * be non-decreasing: unchecked, they are device memory). nnz must equal append_indptr[batch_size]
 * (the caller knows it: no host read of device memory). err_dev (a device int32, may be NULL)
 * receives KVP_ERANGE, first failure wins (compare-and-swap from 0), when a row was skipped: a
 * token outside every request or before position 0, or a page id >= kv->num_pages (nothing is ever
 * written out of bounds); this call never resets it: the caller zeroes it and reads it when it
 * likes. Rows must be 16-byte multiples and every pointer and stride 16-byte aligned (the copy
 * moves 16-byte vectors). flags: KVP_CLIENT_CUDA_APPEND_*.
 *
 * It takes no handle and touches no connection or handle state: any thread may call it at any
 * time, on `stream` (a cudaStream_t of the calling thread's CURRENT device, which must be the
 * device of kv's and src's memory; this call does not switch devices). It only enqueues one
 * kernel: no allocation, no synchronisation, no host read of device memory, so it may be
 * captured into a CUDA graph (the arrays' addresses are baked into the graph; their contents
 * are read at each replay). Kernels are loaded on first use unless kvp_cuda_kernels_preload /
 * kvp_client_cuda_map_pool ran on this device first (do that before capturing).
 *
 * Returns 0 (nnz = 0: nothing queued), KVP_EINVAL for a refused argument before anything is
 * queued (kv or src NULL, an unknown flag; and with nnz > 0: append_indptr or a pointer of kv
 * or src NULL, batch_size 0, nnz or batch_size above INT32_MAX, elem_bytes not 1, 2 or 4, a
 * zero size, a negative or misaligned stride, a misaligned pointer or row), or a launch
 * failure's code; every failure is recorded with its reason in kvp_last_cuda_error(). Built
 * without CUDA it checks the same arguments and then returns KVP_EUNAVAIL (also for nnz = 0). */
int kvp_client_cuda_append_fused(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                 const int32_t *append_indptr, uint32_t nnz, int32_t *err_dev,
                                 unsigned flags, void *stream);

#ifdef __cplusplus
}
#endif
#endif
