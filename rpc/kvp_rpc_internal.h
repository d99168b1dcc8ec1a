/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc_internal.h - what the files of the rpc layer share and nothing outside it uses: the
 * daemon state, the job of an off-loop call, the call table's row type, and the handlers.
 *
 *   kvp_rpc.c       state, the one entry point (dedup, dispatch, accounting), sessions,
 *                   leases, Hello
 *   kvp_rpc_calls.c the call table: one row per call
 *   kvp_rpc_common.c what every handler uses (answers, rights, a request's batch); calls none
 *                   of the files above it
 *   kvp_rpc_seq.c   Reserve, Append (and its job), Fork, Truncate, Release, GetPageTable
 *   kvp_rpc_buf.c   RegisterBuffer, UnregisterBuffer, buffers held by jobs in flight
 *   kvp_rpc_xfer.c  ExportBegin, Import, ListTransfers (and their jobs)
 *   kvp_rpc_cache.c Commit, Lookup, Pin, Unpin, CacheFlush, the scopes
 *   kvp_rpc_tier.c  the host tier: its memory, the demoter, restores and the calls waiting
 *   kvp_rpc_load.c  Load (and its job)
 *   kvp_rpc_exec.c  the worker threads: a job submitted, run, finished and its call resumed
 *   kvp_rpc_info.c  Ping, PoolInfo, Stats, ListSequences, ListClients, Audit, Metrics, and the
 *                   metrics snapshot kvp_metrics.c writes as text
 *
 * A handler validates its request before it touches anything, answers in io->resp (through
 * kvp__rpc_ok or kvp_rpc_error) and returns KVP_RPC_DONE, or KVP_RPC_ASYNC with io->job set
 * when its call is flagged KVP_CALL_OFF_LOOP (kvp_rpc_handle then submits the job). Handlers
 * are plain functions named kvp__rpc_<call>. Loop thread only.
 */
#ifndef KVP_RPC_INTERNAL_H
#define KVP_RPC_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvp_dedup.h"
#include "kvp_jobs.h"
#include "kvp_metrics.h"
#include "kvp_pcache.h"
#include "kvp_rpc.h"
#include "kvp_xfer.h"
#include "kvpool_version.h" /* KVP_VERSION_STRING: Hello, kvpool_build_info */

/* The largest metrics text a Metrics call answers (truncated at a whole line beyond). */
#define KVP_RPC_METRICS_CAP (1u << 20)

/* The facts of one call. Adding a call to the daemon is one row in kvp_rpc_calls.c's table and
 * one handler (docs/ARCHITECTURE.md). */
enum {
    KVP_CALL_MUTATING = 1u << 0,       /* changes daemon state */
    KVP_CALL_PER_CONN = 1u << 1,       /* changes only its connection's state: its request id
                                          is not deduplicated (kvpool.proto, Idempotency) */
    KVP_CALL_BEFORE_HELLO = 1u << 2,   /* may come before Hello */
    KVP_CALL_WHEN_UNHEALTHY = 1u << 3, /* answered while the daemon is unhealthy */
    KVP_CALL_TAKES_FDS = 1u << 4,      /* its frame may carry descriptors */
    KVP_CALL_OFF_LOOP = 1u << 5,       /* may return KVP_RPC_ASYNC: runs on a copy worker */
    KVP_CALL_OBSERVER = 1u << 6,       /* read-only: allowed to an observer session (one
                                          attached to no namespace, kvpool.proto Hello) */
};

typedef int (*kvp_rpc_handler_t)(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                                 kvp_rpc_io_t *io, uint64_t now_ms);

struct kvp_rpc_call {
    pb_size_t req_tag;   /* kvpool_Request_<x>_tag */
    pb_size_t resp_tag;  /* kvpool_Response_<x>_tag */
    const char *name;    /* the metrics label and log name */
    uint32_t flags;      /* KVP_CALL_* */
    uint32_t resp_bytes; /* of the response's body member (cleared by kvp__rpc_ok) */
    kvp_rpc_handler_t handler;
};

/* A job: the part of an off-loop call (an Append's copy, an Import's receive) or of a call's
 * background work (an ExportBegin's send) that runs on a worker thread. Each kind is its own
 * type that starts with this header (kvp_rpc_seq.c: appends, kvp_rpc_xfer.c: transfers) and
 * brings its operations; kvp_rpc_exec.c submits and resumes every kind the same way. */
typedef struct {
    const char *name;
    void (*run)(kvp_rpc_job_t *j); /* worker thread */
    /* loop thread, after run: records the outcome and, for a call's job, answers it in io
     * (io NULL for background work: nothing is answered) */
    void (*finish)(kvp_rpc_t *r, kvp_rpc_job_t *j, kvp_rpc_io_t *io, uint64_t now_ms);
    void (*free)(kvp_rpc_job_t *j); /* after finish (or instead of run, when never submitted) */
} kvp_rpc_job_ops_t;

struct kvp_rpc_job {
    const kvp_rpc_job_ops_t *ops;
    kvp_rpc_t *rpc;
    const kvp_rpc_call_t *call;
    kvp_session_t *sess; /* the session its answer goes to; NULL: background work */
    uint64_t req_id;
    int rc;              /* run's outcome */
    kvp_job_item_t item; /* kvp_rpc_exec.c: its place in the worker pool */
    /* a call whose plan links pages being restored from the host tier (kvp_rpc_tier.c) waits
     * for those restores before it runs: parked, not submitted, while waits > 0 */
    uint32_t waits;
    uint8_t parked;      /* kvp__rpc_submit_call parked it */
    uint8_t wait_failed; /* a restore it waited for failed: its pages hold no content */
};

/* kvp_rpc_exec.c: hands j to the worker threads; when they are not started (unit tests,
 * fuzzers) a call's job goes back to the caller in io->job, background work runs inline. */
void kvp__rpc_submit_bg(kvp_rpc_t *r, kvp_rpc_job_t *j, uint64_t now_ms);
/* A parked call's job (waits reached 0): to the worker threads, or, when they are stopped,
 * run and answered here. */
void kvp__rpc_submit_parked(kvp_rpc_t *r, kvp_rpc_job_t *j);
/* kvp_rpc_handle, after a handler returned KVP_RPC_ASYNC: 1 when io->job went to the worker
 * threads (the answer comes through resume), 0 when it stays in io->job (not started). */
int kvp__rpc_submit_call(kvp_rpc_t *r, kvp_session_t *s, kvp_rpc_io_t *io);

/* A buffer a job in flight reads. Only the job's own connection waits for its job, so a buffer
 * of another session (a tensor-parallel rank's) may be unregistered, or its session closed,
 * while the copy still reads it: its release is then deferred to the last job's finish. */
typedef struct held_buf {
    struct held_buf *next;
    const void *key; /* the buffer's priv (cuda) or host_ptr (host) */
    uint32_t refs;
    int released;     /* its owner let go: release when refs reaches 0 */
    kvp_buffer_t buf; /* the value to release */
} held_buf_t;

/* A prefix-cache scope (kvpool.proto Hello.cache_scope): a namespace's private one is named
 * "ns:<namespace>" for its owner; a listed shared one has shared = 1 and uid 0; an unlisted
 * name is qualified by the uid that gave it. A scope is kept while namespaces are in it or
 * pages are held in it; otherwise its slot may be reused (its cached pages flushed). */
typedef struct {
    char name[72];
    uint32_t uid;
    uint8_t shared, in_use;
    uint32_t namespaces;
    /* as KV events and CacheDump name it (kvp_rpc_events.c): the name, "ns:<namespace>" for a
     * private one, "uid:<uid>:<name>" for an unlisted one; its tag mixes into block hashes */
    char pub[88];
    kvp_pagekey_t tag;
} kvp_scope_t;

/* The host tier (kvp_rpc_tier.c; issue #28). mem NULL: none. */
typedef struct kvp_tier_mem kvp_tier_mem_t;
typedef struct {
    kvp_tier_mem_t *mem;
    uint64_t slot_bytes;
    uint32_t nslots;            /* capacity: cache.host_bytes at the start / slot_bytes */
    uint32_t limit;             /* slots the cache may use now (kvp_pcache_set_host_limit) */
    uint64_t start_bytes;       /* cache.host_bytes at the start: a reload may not raise it */
    uint32_t demotions;         /* demotion batches in flight */
    uint32_t restores;          /* restore tasks in flight */
    kvp_rpc_job_t **restore_of; /* [num_pages]: the restore task writing the page, or NULL */
    kvp_pcache_move_t *scratch;
    uint32_t cap_scratch;
    uint64_t mark;
    int ready_logged;
    uint64_t offload_bytes, restore_bytes, offload_ns, restore_ns;
} kvp_tier_t;

struct kvp_rpc {
    kvp_backend_t *backend;
    kvp_alloc_t *alloc;
    kvp_seqtab_t *seqs;
    kvp_plan_t plan;
    kvp_plan_limits_t plan_limits;
    kvp_ns_table_t ns;
    kvp_dedup_t dedup;
    kvp_rpc_limits_t lim;
    kvp_plan_item_t *items; /* [max_batch] */
    kvp_session_t *sessions;
    uint32_t num_sessions;
    uint32_t num_clients;
    uint64_t next_session_id;
    uint64_t start_ms;
    int draining;
    int unhealthy;
    const kvp_rpc_call_t *by_tag[KVP_RPC_MAX_TAG + 1]; /* request tag -> row */
    kvp_counters_t counters;                           /* kvp_metrics.h */
    char *metrics_buf; /* [KVP_RPC_METRICS_CAP], the text of the last Metrics call */
    kvp_text_t metrics_text;
    held_buf_t *held; /* buffers that jobs in flight read */
    kvp_xfer_t *xfer; /* transfers between daemons */
    /* the pool fds were handed to sessions of two different uids (kvp__rpc_attach_pool_fds):
     * sticky, a process keeps its mapping after it disconnects */
    int pool_fds_given, pool_shared_across_uids;
    uint32_t pool_fds_uid; /* the first uid given them */
    /* the prefix cache (kvp_rpc_cache.c) */
    kvp_pcache_t *pc;
    kvp_scope_t *scopes;         /* [lim.max_cache_scopes] */
    kvp_plan_content_t *content; /* [max_batch]: a batch's token ids and salts */
    int plan_reused;             /* the last plan linked from the cache (answers cached_tokens) */
    uint32_t *cache_out;         /* [max_batch]: a Lookup's answer */
    uint32_t *cache_host_out;    /* [max_batch]: a Lookup's host_tokens */
    kvp_tier_t tier;             /* the host tier (kvp_rpc_tier.c) */
    kvp_events_t *events;        /* KV events (kvp_rpc_events.c); NULL: off */
    uint8_t *dump_buf;           /* a CacheDump answer's blocks, names, and per scope the */
    char *dump_names;            /* offset of its name there (allocated at the first dump) */
    uint32_t *dump_name_off;
    struct kvp_commit *commits; /* waiting for their event, oldest first */
    uint32_t num_commits;
    void (*commit_wake)(void *arg);
    void *commit_wake_arg;
    /* the worker threads and the transport's resume (kvp_rpc_exec.c); NULL: not started */
    kvp_jobs_t *jobs;
    uint64_t (*clock_ms)(void);
    kvp_rpc_resume_fn resume;
    void *resume_arg;
    kvp_rpc_io_t resume_io; /* the answer of a job that finished, handed to resume */
};

/* The table (kvp_rpc_calls.c), in row order; kvp__rpc_calls[0] is the "invalid" pseudo-call (a
 * frame that did not decode or named no call). A row's index labels its metrics. */
extern const kvp_rpc_call_t kvp__rpc_calls[];
extern const unsigned kvp__rpc_num_calls;
#define KVP_RPC_CALL_INDEX(c) ((unsigned)((c)-kvp__rpc_calls))

/* Root or the daemon's own uid (kvpool.proto, Names): sees every namespace. */
int kvp__rpc_is_operator(const kvp_rpc_t *r, uint32_t uid);
/* Whether session s may read namespace ns's metadata (its owner, or an operator). */
int kvp__rpc_may_see_ns(const kvp_rpc_t *r, const kvp_session_t *s, uint32_t ns);
/* 0 when v (the request's string field `field`) is valid UTF-8 and empty or a valid name
 * (kvp_ns_name_valid), else KVP_EINVAL with the refusal answered in resp. */
int kvp__rpc_check_name(kvpool_Response *resp, uint64_t id, const char *field, const char *v);

/* An OK answer of io->call with its body member cleared. */
void kvp__rpc_ok(kvp_rpc_io_t *io, uint64_t id);

/* kvp_rpc_common.c: the batch of a request into r->items (ns of the session; n_tokens optional);
 * 0, or an error answered in resp */
int kvp__rpc_take_batch(kvp_rpc_t *r, const kvp_session_t *s, const kvp_rpc_io_t *io,
                        int with_tokens, uint32_t *n_out, kvpool_Response *resp, uint64_t id);
void kvp__rpc_table_from_plan(kvp_rpc_t *r, kvpool_PageTable *t, kvp_reply_arrays_t *out);
void kvp__rpc_count_alloc_failure(kvp_rpc_t *r, int rc);
const char *kvp__rpc_plan_error_text(int rc);

/* kvp_rpc_buf.c */
kvp_session_buffer_t *kvp__rpc_find_buffer(kvp_session_t *s, uint32_t buffer_id);
int kvp__rpc_buf_hold(kvp_rpc_t *r, const kvp_buffer_t *b);
void kvp__rpc_buf_unhold(kvp_rpc_t *r, const kvp_buffer_t *b);
void kvp__rpc_buf_release(kvp_rpc_t *r, kvp_buffer_t *b);

/* kvp_rpc_info.c */
void kvp__rpc_fill_pool_info(kvp_rpc_t *r, kvpool_PoolInfo *pi);
/* Attaches the pool fds to io for session s, or KVP_EPERM when access.pool_uids / pool_gids
 * do not name s's uid (nothing attached). */
int kvp__rpc_attach_pool_fds(kvp_rpc_t *r, const kvp_session_t *s, kvp_rpc_io_t *io,
                             kvpool_PoolInfo *pi);

/* kvp_rpc_cache.c: the prefix cache's part of the rpc layer */
int kvp__rpc_cache_create(kvp_rpc_t *r);
void kvp__rpc_cache_destroy(kvp_rpc_t *r);
/* Hello: joins the scope the request names (empty: the namespace's own) for namespace ns of
 * session s; 0, or an error answered in resp (nothing changed). */
int kvp__rpc_scope_join(kvp_rpc_t *r, const kvp_session_t *s, uint32_t ns, const char *name,
                        int ns_is_new, kvpool_Response *resp, uint64_t id);
/* A namespace goes: leaves its scope. Returns 1 when it still has pins (keep its slot). */
int kvp__rpc_scope_leave(kvp_rpc_t *r, uint32_t ns);
uint32_t kvp__rpc_ns_scope(const kvp_rpc_t *r, uint32_t ns);
/* limits.ns_max_pinned_pages as it applies: 0 is derived from the pool (num_pages / 8). */
uint64_t kvp__rpc_ns_pin_quota(const kvp_rpc_t *r);
/* Reserve / Append: the batch's token ids and salts into r->content and the options into
 * *cache. Returns 1 when the batch uses the cache (content then set), 0 when not, or -1 with
 * an error answered in resp. r->items must hold the batch. */
int kvp__rpc_take_content(kvp_rpc_t *r, const kvp_session_t *s, const kvp_rpc_io_t *io, uint32_t n,
                          int has_opts, const kvpool_CacheOptions *opts, kvp_plan_cache_t *cache,
                          kvpool_Response *resp, uint64_t id);
/* A session closes: its Commits still waiting are dropped and its events closed. */
void kvp__rpc_cache_session_close(kvp_rpc_t *r, kvp_session_t *s);
/* Pins expire, namespaces kept only for their pins go (the tick). */
void kvp__rpc_cache_tick(kvp_rpc_t *r, uint64_t now_ms);
/* limits.max_lookup_tokens as it applies (0: 16384 pages' worth, at most 1 Mi tokens). */
uint32_t kvp__rpc_max_lookup_tokens(const kvp_rpc_t *r);
/* Stats' cache part for session s. */
void kvp__rpc_cache_stats(kvp_rpc_t *r, const kvp_session_t *s, kvpool_CacheStats *out);

/* kvp_rpc_tier.c: the host tier */
/* Host slots host_bytes makes (0 without a tier: no bytes, or a backend without move_slots). */
uint32_t kvp__rpc_tier_slots(const kvp_rpc_t *r, uint64_t host_bytes);
int kvp__rpc_tier_create(kvp_rpc_t *r); /* after the cache: its memory, from r->lim */
void kvp__rpc_tier_destroy(kvp_rpc_t *r);
/* The demoter: keeps the watermark of free pages (after a plan, on the tick, after a batch). */
void kvp__rpc_tier_kick(kvp_rpc_t *r, uint64_t now_ms);
/* After a plan: starts the restore of what it promoted (r->plan.restores). 0 or KVP_ENOMEM
 * (the promoted pages then lost their keys: fail the call). */
int kvp__rpc_tier_restore(kvp_rpc_t *r, uint64_t now_ms);
/* After a plan whose call fails before kvp__rpc_tier_restore: its promoted pages are given up
 * (restore ended as failed: unpinned, their keys gone), so nothing stays pinned. */
void kvp__rpc_tier_drop_restores(kvp_rpc_t *r);
/* Makes call job w wait for every restore writing a page the plan linked (r->plan's leading
 * cached_tokens of each row): w->waits counts them. 0 or KVP_ENOMEM. */
int kvp__rpc_tier_wait_plan(kvp_rpc_t *r, kvp_rpc_job_t *w);
void kvp__rpc_tier_stats(kvp_rpc_t *r, kvpool_CacheStats *out);
/* Every page a restore task writes is restoring in the cache and the other way round, the
 * tasks and batches in flight agree with the cache's counts: 0 or KVP_EAUDIT (msg says). */
int kvp__rpc_tier_audit(const kvp_rpc_t *r, char *msg, size_t len);

/* kvp_rpc_events.c: KV events (issue #29) */
/* After the cache: the batcher when lim.ev_sink is set (observes the cache; its first batch is
 * AllBlocksCleared). 0 or KVP_ENOMEM. */
int kvp__rpc_events_create(kvp_rpc_t *r);
/* Before the cache goes: a last AllBlocksCleared, flushed; frees the batcher. */
void kvp__rpc_events_destroy(kvp_rpc_t *r);
/* Scope sc was just named (created or reused): its published name and tag. */
void kvp__rpc_events_scope_named(kvp_rpc_t *r, uint32_t sc);
/* The events' counters into m (has_events when events are on). */
void kvp__rpc_events_metrics(const kvp_rpc_t *r, kvp_metrics_t *m);

/* kvp_rpc_seq.c: checks an Append's source (or a Load's destination) layout against buf. */
int kvp__rpc_check_layout(const kvp_rpc_t *r, const kvp_src_layout_t *src, const kvp_buffer_t *buf,
                          uint32_t nnz, uint32_t lb, uint32_t le, char *why, size_t why_len);

/* The handlers, one per row of the table (kvp_rpc_calls.c: the row's type checks the signature). */
int kvp__rpc_hello(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                   uint64_t now_ms);
int kvp__rpc_ping(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                  uint64_t now_ms);
int kvp__rpc_pool_info(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                       uint64_t now_ms);
int kvp__rpc_register_buffer(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                             kvp_rpc_io_t *io, uint64_t now_ms);
int kvp__rpc_unregister_buffer(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                               kvp_rpc_io_t *io, uint64_t now_ms);
int kvp__rpc_append(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                    uint64_t now_ms);
int kvp__rpc_reserve(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                     uint64_t now_ms);
int kvp__rpc_fork(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                  uint64_t now_ms);
int kvp__rpc_truncate(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                      uint64_t now_ms);
int kvp__rpc_release(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                     uint64_t now_ms);
int kvp__rpc_get_page_table(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                            kvp_rpc_io_t *io, uint64_t now_ms);
int kvp__rpc_stats(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                   uint64_t now_ms);
int kvp__rpc_list_sequences(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                            kvp_rpc_io_t *io, uint64_t now_ms);
int kvp__rpc_list_clients(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                          kvp_rpc_io_t *io, uint64_t now_ms);
int kvp__rpc_audit(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                   uint64_t now_ms);
int kvp__rpc_metrics(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                     uint64_t now_ms);
int kvp__rpc_export_begin(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                          kvp_rpc_io_t *io, uint64_t now_ms);
int kvp__rpc_import(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                    uint64_t now_ms);
int kvp__rpc_list_transfers(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                            kvp_rpc_io_t *io, uint64_t now_ms);
int kvp__rpc_commit(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                    uint64_t now_ms);
int kvp__rpc_lookup(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                    uint64_t now_ms);
int kvp__rpc_pin(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                 uint64_t now_ms);
int kvp__rpc_unpin(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                   uint64_t now_ms);
int kvp__rpc_cache_flush(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                         kvp_rpc_io_t *io, uint64_t now_ms);
int kvp__rpc_load(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                  uint64_t now_ms);
int kvp__rpc_cache_dump(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                        uint64_t now_ms);

#endif
