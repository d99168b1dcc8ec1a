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
 * allocated, tables updated, pages in flight pinned) and the rpc layer runs the rest on its
 * worker threads (kvp_rpc_start), then hands the answer to the transport's resume callback on
 * the loop thread: the transport suspends the connection and resumes it, nothing more. Loop
 * thread only, except kvp_rpc_job_run.
 */
#ifndef KVP_RPC_H
#define KVP_RPC_H

#include <stdint.h>
#include <uv.h>

#include "kvp_access.h"
#include "kvp_backend.h"
#include "kvp_events.h"
#include "kvp_ns.h"
#include "kvp_plan.h"
#include "kvp_rpc_limits.h"
#include "kvp_seqtab.h"
#include "kvp_wire.h"

typedef struct kvp_rpc kvp_rpc_t;
typedef struct kvp_rpc_job kvp_rpc_job_t;
typedef struct kvp_rpc_call kvp_rpc_call_t; /* a row of the call table */

/* Request body tags the table may use: 1..KVP_RPC_MAX_TAG. */
#define KVP_RPC_MAX_TAG 63

/* The limits of the rpc layer: the rows of kvp_rpc_limits.h (the [limits] and [transfer] keys,
 * with their defaults and meanings there), then what the daemon derives. A field left 0 where
 * its row does not allow 0 takes the row's default in kvp_rpc_create and kvp_rpc_set_limits. */
typedef struct {
    KVP_RPC_LIMITS_KEYS(KVP_RPC_LIMIT_FIELD)
    KVP_RPC_TRANSFER_KEYS(KVP_RPC_LIMIT_FIELD)
    KVP_RPC_CACHE_KEYS(KVP_RPC_LIMIT_FIELD)
    /* the daemon's own uid (kvpoold: geteuid()): with root, an operator, who may attach to
     * the reserved namespaces and sees every tenant's metadata (kvpool.proto, Names). Not
     * changed by kvp_rpc_set_limits. */
    uint32_t operator_uid;
    /* who may receive the pool fds (access.pool_uids / pool_gids); all zero: everyone */
    kvp_pool_access_t pool_access;
    /* who may join which shared prefix-cache scope (access.cache_scopes); not changed by
     * kvp_rpc_set_limits */
    kvp_scope_access_t scope_access;
    /* KV events (issue #29): closed batches go to ev_sink(ev_ctx, batch) (the publisher's
     * submit; NULL: events off, and the cache keeps no token ids); ev_stats are the publisher's
     * counters, read by the metrics (NULL without events). Not changed by kvp_rpc_set_limits. */
    kvp_ev_sink_fn ev_sink;
    void *ev_ctx;
    kvp_ev_stats_t *ev_stats;
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
    void *transport; /* the transport's handle of the connection (resume), opaque here */
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
    kvp_rpc_job_t *job;         /* KVP_RPC_ASYNC without worker threads (kvp_rpc_start): the job the
                                   caller runs (kvp_rpc_job_run, _finish, _free) */
    const kvp_rpc_call_t *call; /* the call being answered (NULL: none decoded) */
    const uint8_t *replay;      /* KVP_RPC_REPLAY: the stored answer frame, header included */
    uint32_t replay_len;
} kvp_rpc_io_t;

/* kvp_rpc_handle: answer io->resp now; the answer comes later (through the resume callback,
 * or io->job without worker threads); send io->replay as is. */
enum { KVP_RPC_DONE = 0, KVP_RPC_ASYNC = 1, KVP_RPC_REPLAY = 2 };

/* The transport's half of an asynchronous call: called on the loop thread when the job of a
 * call of session s, for which kvp_rpc_handle returned KVP_RPC_ASYNC, is done, with its answer
 * in io (io->resp, io->out; valid until the callback returns, then the job is freed). The
 * callback encodes and sends it (or not, when the connection closed meanwhile) and calls
 * kvp_rpc_answered, as after any other answer. */
typedef void (*kvp_rpc_resume_fn)(void *arg, kvp_session_t *s, kvp_rpc_io_t *io);

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

/* Starts the worker threads the calls' jobs run on (kvp_jobs.h: threads 1..256, busy_poll_us)
 * on loop, and sets the transport's clock (the milliseconds kvp_rpc_handle is given) and
 * resume callback. Returns 0, KVP_EINVAL, or kvp_jobs_create's code.
 * Without it (unit tests, fuzzers) a call's job comes back in io->job for the caller to run
 * with the three functions below, and background work runs inline. */
int kvp_rpc_start(kvp_rpc_t *r, uv_loop_t *loop, unsigned threads, uint32_t busy_poll_us,
                  uint64_t (*clock_ms)(void), kvp_rpc_resume_fn resume, void *arg);
/* A request arrived (kvp_jobs_touch: with busy polling the loop keeps polling a while). */
void kvp_rpc_touch(kvp_rpc_t *r);
/* Stops the worker threads once every job in flight is done (each still finishes and resumes
 * its call), then calls closed(arg) on the loop thread. No-op (closed called at once) when
 * not started. */
void kvp_rpc_stop(kvp_rpc_t *r, void (*closed)(void *arg), void *arg);

/* Without worker threads, io->job of KVP_RPC_ASYNC: run (any thread), then finish (loop
 * thread: unpins, fills io->resp / io->out, which the job's arrays back until
 * kvp_rpc_job_free after the response is encoded). When the backend refused the source
 * (KVP_EINVAL) or timed out on the worker's event (KVP_ETIMEDOUT) the sequences are rolled
 * back to their lengths before the call and the answer is an error; any other backend failure
 * marks the daemon unhealthy. */
void kvp_rpc_job_run(kvp_rpc_job_t *job);
void kvp_rpc_job_finish(kvp_rpc_t *r, kvp_rpc_job_t *job, kvp_rpc_io_t *io, uint64_t now_ms);
void kvp_rpc_job_free(kvp_rpc_job_t *job);

/* Releases the sequences of namespaces whose lease ran out; returns how many namespaces. */
uint32_t kvp_rpc_expire_leases(kvp_rpc_t *r, uint64_t now_ms);
/* Earliest lease deadline (ms), UINT64_MAX when none. */
uint64_t kvp_rpc_next_deadline(const kvp_rpc_t *r);

/* Prefix-cache Commits waiting for their worker's event (kvpool.proto, Visibility): polls
 * each once and publishes the pages of those complete; returns how many are still waiting.
 * The server calls it every server.commit_poll_ms while kvp_rpc_commits_pending is not 0, and
 * the rpc layer calls wake(arg) when a Commit starts waiting (kvp_rpc_set_commit_wake). */
uint32_t kvp_rpc_poll_commits(kvp_rpc_t *r, uint64_t now_ms);

/* KV events (issue #29): closes the open batch of events, if any, and hands it to the sink.
 * No-op with events off. */
void kvp_rpc_events_flush(kvp_rpc_t *r);
/* The transport calls it after each loop iteration's callbacks (and when the time it returned
 * has passed): closes the open batch when it is due (kvp_events_due_in: batch_ms old, or
 * full). Returns UINT32_MAX when no batch is open (nothing to arm), else the ms until the open
 * one is due (arm a timer for it). */
uint32_t kvp_rpc_events_tick(kvp_rpc_t *r, uint32_t batch_ms);
uint32_t kvp_rpc_commits_pending(const kvp_rpc_t *r);
void kvp_rpc_set_commit_wake(kvp_rpc_t *r, void (*wake)(void *arg), void *arg);

/* Fills resp with an error status (code from a KVP_E* value) and message. */
void kvp_rpc_error(kvpool_Response *resp, uint64_t id, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Metrics: how long one job ran on its worker thread (kvp_rpc_exec.c observes every job it
 * resumes with the worker pool's stamps; tests call it directly). Loop thread. */
void kvp_rpc_observe_run(kvp_rpc_t *r, uint64_t run_ns);
/* Prometheus text exposition 0.0.4 of the daemon's state into buf (kvp_metrics.h: written
 * from a snapshot; truncated at a whole line when cap is too small). Returns its length. */
size_t kvp_rpc_metrics_text(kvp_rpc_t *r, char *buf, size_t cap, uint64_t now_ms);

/* SIGHUP: applies the limits that can change at run time, the RELOAD rows of kvp_rpc_limits.h
 * (the quotas apply to every namespace at once), and pool_access; the RESTART rows size tables
 * and keep their running values (the config module reports them). */
void kvp_rpc_set_limits(kvp_rpc_t *r, const kvp_rpc_limits_t *lim);

/* Server facts dispatch reports (Stats, metrics). */
void kvp_rpc_set_num_clients(kvp_rpc_t *r, uint32_t n);
void kvp_rpc_set_draining(kvp_rpc_t *r, int draining);
int kvp_rpc_healthy(kvp_rpc_t *r);

/* For tests and kvpoold: the core the dispatch works on. */
kvp_seqtab_t *kvp_rpc_seqtab(kvp_rpc_t *r);
kvp_backend_t *kvp_rpc_backend(kvp_rpc_t *r);

#endif
