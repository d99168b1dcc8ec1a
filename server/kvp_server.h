/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_server.h - the socket side of kvpoold: a Unix listening socket on a libuv loop,
 * connections read with our own recvmsg (SCM_RIGHTS fd passing, which libuv's pipes cannot
 * hand over for memfds), frames cut and decoded, kvp_rpc_handle called, answers encoded and
 * written with sendmsg (fds attached to their first byte). An off-loop call (Append, Import)
 * suspends its connection until the rpc layer, which runs its job on its worker threads,
 * resumes it with the answer; requests on one connection are answered in order. Knows nothing of
 * the core beyond kvp_rpc.h (STYLE.md: files are layers).
 *
 * Against hostile clients (issue #15) it bounds what a connection holds: a Hello deadline, a
 * partial-frame deadline, connections per peer uid, a budget for all buffered bytes with
 * backpressure on connections that do not read their answers, and the fd rules of kvp_frame.h
 * (kvp_server.c's header says how; kvp_config.h documents the keys).
 *
 * Loop thread only. One server object per daemon, no globals: a test can run two.
 */
#ifndef KVP_SERVER_H
#define KVP_SERVER_H

#include <stdint.h>
#include <uv.h>

#include "kvp_rpc.h"
#include "kvp_server_limits.h"

typedef struct kvp_server kvp_server_t;

typedef struct {
    const char *socket_path; /* created unless listen_fd >= 0 */
    uint32_t socket_mode;    /* e.g. 0660 */
    int64_t socket_gid;      /* chown group, or -1 */
    int listen_fd;           /* an inherited listening socket (socket activation), or -1 */
    uint32_t max_frame_bytes;
    /* the reloadable limits (issue #15, a hostile client; kvp_server_limits.h): connections
     * (all, per peer uid: the daemon's uid and root exempt), unsent answers per connection
     * (above it the client is dropped), read buffers + unsent answers of all connections, the
     * Hello and partial-frame deadlines, the drain; 0 turns the per-uid, deadline and budget
     * ones off */
    KVP_SERVER_LIMITS_KEYS(KVP_RPC_LIMIT_FIELD)
    unsigned threads;      /* worker threads for off-loop requests (kvp_jobs); 0 -> 4 */
    uint32_t busy_poll_us; /* kvp_jobs busy polling; 0: off */
} kvp_server_config_t;

/* Creates the server on loop with rpc (borrowed; must outlive the server). Binds and listens
 * (or adopts listen_fd). Returns 0 or a negative code; the socket path is unlinked on destroy
 * when we created it. */
int kvp_server_create(uv_loop_t *loop, const kvp_server_config_t *cfg, kvp_rpc_t *rpc,
                      kvp_server_t **out);

/* Begins a drain: stop accepting, stop reading new requests, finish and answer what is in
 * flight or already received, close every connection; then calls done(arg) once (from the
 * loop). Connections still open after drain_timeout_ms are closed forcibly. */
void kvp_server_drain(kvp_server_t *s, void (*done)(void *arg), void *arg);

/* Closes everything at once (after a drain, or on a fatal error) and frees the server once
 * its handles are closed: run the loop until it returns after calling this. */
void kvp_server_destroy(kvp_server_t *s);

uint32_t kvp_server_num_connections(const kvp_server_t *s);

/* Updates run-time reloadable limits (SIGHUP): the rows of kvp_server_limits.h are taken from
 * cfg, the rest of it is ignored. */
void kvp_server_set_limits(kvp_server_t *s, const kvp_server_config_t *cfg);

/* Bytes the server buffers now: read buffers and unsent answers of every connection. */
uint64_t kvp_server_buffered_bytes(const kvp_server_t *s);

/* Sets the [access] lists (kvp_config.h): uids and gids that may connect besides the daemon's
 * own uid and root; with both empty (the state after create) the socket file's group may.
 * Applies to connections accepted from now on. Lists are copied (at most 64 entries each). */
void kvp_server_set_access(kvp_server_t *s, const uint32_t *uids, uint32_t num_uids,
                           const uint32_t *gids, uint32_t num_gids);

/* Monotonic milliseconds as the server and dispatch see them. */
uint64_t kvp_server_now_ms(void);

#endif
