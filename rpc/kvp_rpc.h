/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc.h - the daemon's state and its one entry point: a decoded Request in, a Response
 * (or the stored answer of a retry) out (STYLE.md rule 8). No sockets and no clock reads here:
 * the server layer frames bytes, passes the fds that arrived with a frame, supplies the time,
 * sends what the rpc layer answers and hands the encoded answer back (kvp_rpc_answered), which
 * is where the retry window and the metrics learn the outcome. Unit tests drive it directly
 * (tests/unit/test_rpc.c), and the fuzzer feeds it decoded garbage.
 *
 * The calls are rows of one table (kvp_rpc.c; kvp_rpc_internal.h lists the files of the
 * layer): dispatch, the Hello and fd rules, the idempotency protocol and the metrics labels
 * all read it. Off-loop calls (Append, Import) answer asynchronously: the handler plans (pages
 * allocated, tables updated, pages in flight pinned) and hands back a job; the server runs
 * kvp_rpc_job_run() on a copy worker thread and then kvp_rpc_job_finish() on the loop thread,
 * which fills the response. Loop thread only, except kvp_rpc_job_run.
 */
#ifndef KVP_RPC_H
#define KVP_RPC_H

#include <stdint.h>

#include "kvp_access.h"
#include "kvp_backend.h"
#include "kvp_ns.h"
#include "kvp_plan.h"
#include "kvp_seqtab.h"
#include "kvp_wire.h"

typedef struct kvp_rpc kvp_rpc_t;
typedef struct kvp_rpc_job kvp_rpc_job_t;
typedef struct kvp_rpc_call kvp_rpc_call_t; /* a row of the call table */

/* Request body tags the table may use: 1..KVP_RPC_MAX_TAG. */
#define KVP_RPC_MAX_TAG 63

typedef struct {
    uint32_t max_seqs;
    uint32_t max_namespaces;
    uint32_t max_seq_tokens;
    uint32_t max_batch;
    uint32_t max_batch_tokens;
    uint32_t max_buffers_per_client;
    uint64_t max_buffer_bytes;
    uint32_t dedup_window;       /* request ids remembered per namespace */
    uint64_t dedup_ns_max_bytes; /* answers kept per namespace; 0: 8 MiB */
    uint64_t dedup_max_bytes;    /* answers kept by the daemon; 0: 64 MiB */
    uint32_t default_lease_ms;
    uint32_t max_lease_ms;
    /* transfers (kvp_xfer.h); 0: 30000, 300000, 2 */
    uint32_t transfer_timeout_ms;
    uint32_t transfer_comm_idle_ms;
    uint32_t transfer_max_in_flight;
    uint32_t transfer_chunk_bytes; /* 0: automatic */
    /* per-namespace quotas, 0 = none (kvp_config.h, limits.ns_max_*) */
    uint32_t ns_max_seqs;
    uint32_t ns_max_pages; /* page references */
    uint64_t ns_max_buffer_bytes;
    uint32_t ns_max_connections;
    /* per-uid quotas, 0 = none (kvp_config.h, limits.uid_max_*); root and operator_uid are
     * exempt */
    uint32_t uid_max_namespaces;
    uint32_t uid_max_idle_namespaces; /* of them with no session (a lease pending) */
    uint32_t uid_max_seqs;            /* over all the namespaces the uid owns */
    /* the daemon's own uid (kvpoold: geteuid()): with root, an operator, who may attach to
     * the reserved namespaces and sees every tenant's metadata (kvpool.proto, Names). Not
     * changed by kvp_rpc_set_limits. */
    uint32_t operator_uid;
    /* who may receive the pool fds (access.pool_uids / pool_gids); all zero: everyone */
    kvp_pool_access_t pool_access;
    /* the prefix cache (kvp_config.h, limits.max_cache_scopes ... and access.cache_scopes);
     * 0: 256 scopes, 1024 pins, no per-namespace or per-uid pin count, pinned pages derived
     * from the pool, priority up to 100, a day, 16384 pages' worth of tokens */
    uint32_t max_cache_scopes;
    uint32_t max_pins;
    uint32_t ns_max_pins, uid_max_pins;                 /* 0: none */
    uint32_t ns_max_pinned_pages, uid_max_pinned_pages; /* 0: num_pages / 8, / 4 */
    uint32_t ns_max_priority;                           /* 0: 100 (no limit) */
    uint32_t pin_max_ttl_ms;
    uint32_t max_lookup_tokens;
    kvp_scope_access_t scope_access;
} kvp_rpc_limits_t;

typedef struct {
    uint32_t id;
    kvp_buffer_t buf;
} kvp_session_buffer_t;

/* A connection's session. Created by kvp_rpc_session_open, freed by kvp_rpc_session_close. */
typedef struct kvp_session {
    struct kvp_session *next, *prev;
    uint64_t id;
    int hello_done;
    int observer; /* a Hello with observer set: attached to no namespace (ns unused) */
    uint32_t ns;
    int32_t pid;
    uint32_t uid, gid;
    char name[KVP_NS_NAME_MAX + 1];
    char ns_name[KVP_NS_NAME_MAX + 1];
    uint64_t connected_ms;
    uint64_t requests;
    kvp_session_buffer_t *buffers; /* [max_buffers_per_client] */
    uint32_t num_buffers;
    uint32_t next_buffer_id;
    /* the interprocess events its Commits named, opened once each (kvp_rpc_cache.c) */
    struct {
        uint8_t handle[64];
        void *ev;
    } commit_ev[KVP_MAX_DEVICES];
    uint32_t num_commit_ev;
    /* the request being answered (at most one per connection): kvp_rpc_handle sets it,
     * kvp_rpc_answered closes it */
    struct {
        const kvp_rpc_call_t *call;
        uint64_t req_id;
        uint64_t start_ns;
        int in_window; /* its id was begun in the namespace's retry window */
    } pending;
} kvp_session_t;

/* What one dispatch reads and writes besides the request. */
typedef struct {
    const kvp_batch_arrays_t *batch; /* the decoded bulk arrays of the request */
    int *fds_in;                     /* fds that arrived with the frame; dispatch sets the ones
                                        it takes to -1, the caller closes the rest */
    int nfds_in;
    kvpool_Response resp;               /* filled by dispatch (or by job_finish) */
    kvp_reply_arrays_t out;             /* bulk arrays the response points at */
    int fds_out[KVP_MAX_FDS_PER_FRAME]; /* borrowed fds to attach to the response */
    int nfds_out;
    kvp_rpc_job_t *job; /* set when dispatch returns KVP_RPC_ASYNC */
    /* set by dispatch besides an answer given at once (ExportBegin): work the server runs
     * with kvp_rpc_job_run on a worker thread, then kvp_rpc_bg_finish and kvp_rpc_job_free on
     * the loop thread; no response is sent for it */
    kvp_rpc_job_t *bg_job;
    const kvp_rpc_call_t *call; /* the call being answered (NULL: none decoded) */
    const uint8_t *replay;      /* KVP_RPC_REPLAY: the stored answer frame, header included */
    uint32_t replay_len;
} kvp_rpc_io_t;

/* kvp_rpc_handle: answer io->resp now; run io->job off the loop; send io->replay as is. */
enum { KVP_RPC_DONE = 0, KVP_RPC_ASYNC = 1, KVP_RPC_REPLAY = 2 };

/* Takes ownership of `backend`. Returns 0, KVP_EINVAL, KVP_ENOMEM. */
int kvp_rpc_create(kvp_backend_t *backend, const kvp_rpc_limits_t *lim, uint64_t now_ms,
                   kvp_rpc_t **out);
/* Frees everything, the backend included; sessions must be closed first. NULL: no-op. */
void kvp_rpc_destroy(kvp_rpc_t *r);

kvp_session_t *kvp_rpc_session_open(kvp_rpc_t *r, int32_t pid, uint32_t uid, uint32_t gid,
                                    uint64_t now_ms);
/* Detaches from the namespace (releasing its sequences when the lease is 0), releases the
 * session's buffers and frees it. */
void kvp_rpc_session_close(kvp_rpc_t *r, kvp_session_t *s, uint64_t now_ms);

/* The one entry point: one decoded request of session s (payload: its encoded bytes, which
 * identify a retry; may be NULL in tests), with io->batch / fds_in / nfds_in set by the
 * caller. Applies the Hello, fd and health rules of the call's row, the retry window
 * (kvpool.proto, Idempotency) and dispatches. Returns KVP_RPC_DONE (io->resp holds the
 * answer), KVP_RPC_ASYNC (io->job to run) or KVP_RPC_REPLAY (io->replay: the first answer of
 * this request id, to send unchanged, without fds). start_ns: when the frame arrived (for
 * the latency histogram). Every return is followed, once the answer is encoded, by one
 * kvp_rpc_answered. */
int kvp_rpc_handle(kvp_rpc_t *r, kvp_session_t *s, kvpool_Request *req, const uint8_t *payload,
                   uint32_t len, kvp_rpc_io_t *io, uint64_t now_ms, uint64_t start_ns);
/* A frame that did not decode: fills io->resp with err and msg for request id (0 when
 * unknown); answered like any other (kvp_rpc_answered follows). */
void kvp_rpc_reject(kvp_rpc_t *r, kvp_session_t *s, uint64_t id, int err, const char *msg,
                    kvp_rpc_io_t *io, uint64_t start_ns);
/* The answer of s's pending request is encoded: resp (NULL for a replay) and its frame (NULL
 * when it could not be encoded or is not sent). A new mutating call's OK answer is kept for
 * retries within the budgets; an error lets its id go. end_ns: when it was answered. */
void kvp_rpc_answered(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Response *resp,
                      const uint8_t *frame, uint32_t len, uint64_t end_ns);

/* Copy worker thread: runs the job's plan on the backend. */
void kvp_rpc_job_run(kvp_rpc_job_t *job);
/* Loop thread, after job_run: unpins, fills io->resp / io->out; the job stays alive (its
 * arrays back io->out) until kvp_rpc_job_free after the response is encoded. When the backend
 * refused the source (KVP_EINVAL) or timed out on the worker's event (KVP_ETIMEDOUT) the
 * sequences are rolled back to their lengths before the call and the answer is an error; any
 * other backend failure marks the daemon unhealthy. */
void kvp_rpc_job_finish(kvp_rpc_t *r, kvp_rpc_job_t *job, kvp_rpc_io_t *io, uint64_t now_ms);
void kvp_rpc_job_free(kvp_rpc_job_t *job);
/* Loop thread, after kvp_rpc_job_run of an io->bg_job: records its outcome (an export's pages
 * are unpinned); the job stays alive until kvp_rpc_job_free. */
void kvp_rpc_bg_finish(kvp_rpc_t *r, kvp_rpc_job_t *job, uint64_t now_ms);

/* Releases the sequences of namespaces whose lease ran out; returns how many namespaces. */
uint32_t kvp_rpc_expire_leases(kvp_rpc_t *r, uint64_t now_ms);
/* Earliest lease deadline (ms), UINT64_MAX when none. */
uint64_t kvp_rpc_next_deadline(const kvp_rpc_t *r);

/* Prefix-cache Commits waiting for their worker's event (kvpool.proto, Visibility): polls
 * each once and publishes the pages of those complete; returns how many are still waiting.
 * The server calls it every server.commit_poll_ms while kvp_rpc_commits_pending is not 0, and
 * the rpc layer calls wake(arg) when a Commit starts waiting (kvp_rpc_set_commit_wake). */
uint32_t kvp_rpc_poll_commits(kvp_rpc_t *r, uint64_t now_ms);
uint32_t kvp_rpc_commits_pending(const kvp_rpc_t *r);
void kvp_rpc_set_commit_wake(kvp_rpc_t *r, void (*wake)(void *arg), void *arg);

/* Fills resp with an error status (code from a KVP_E* value) and message. */
void kvp_rpc_error(kvpool_Response *resp, uint64_t id, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Metrics: how long one kvp_rpc_job_run took on its copy worker, measured by the server (this
 * module reads no clock). Loop thread. */
void kvp_rpc_observe_run(kvp_rpc_t *r, uint64_t run_ns);
/* Prometheus text exposition 0.0.4 of the daemon's state into buf (kvp_metrics.h: written
 * from a snapshot; truncated at a whole line when cap is too small). Returns its length. */
size_t kvp_rpc_metrics_text(kvp_rpc_t *r, char *buf, size_t cap, uint64_t now_ms);

/* SIGHUP: applies the limits that can change at run time (max_batch_tokens,
 * max_buffer_bytes, default_lease_ms, max_lease_ms, the dedup byte budgets, and the ns_max_*
 * and uid_max_* quotas, which apply to every namespace at once); the others size tables and need a
 * restart (the config module reports them). */
void kvp_rpc_set_limits(kvp_rpc_t *r, const kvp_rpc_limits_t *lim);

/* Server facts dispatch reports (Stats, metrics). */
void kvp_rpc_set_num_clients(kvp_rpc_t *r, uint32_t n);
void kvp_rpc_set_draining(kvp_rpc_t *r, int draining);
int kvp_rpc_healthy(kvp_rpc_t *r);

/* For tests and kvpoold: the core the dispatch works on. */
kvp_seqtab_t *kvp_rpc_seqtab(kvp_rpc_t *r);
kvp_backend_t *kvp_rpc_backend(kvp_rpc_t *r);

#endif
