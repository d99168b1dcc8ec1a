/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_xfer.h - KV transfers between daemons over NCCL point-to-point (DESIGN.md §6, the
 * ExportBegin / Import calls of kvpool.proto). The dispatch (kvp_rpc.c) validates a request,
 * allocates or pins the pages and asks this module for a transfer job; the job runs on a
 * worker thread (kvp_xfer_run: join or reuse the communicator, send or receive a header, move
 * the packed stream with ncclSend/ncclRecv on the communicator's own stream, pack
 * or unpack it with the kernels of kernels/kvp_pack_cuda.cu, then the importer's outcome goes
 * back) and is finished on the loop thread
 * (kvp_xfer_finish), where the dispatch unpins or releases the pages.
 *
 * Communicators (two ranks: 0 exports, 1 imports) are cached: the exporter reuses an idle one
 * of the same peer name (its unique id goes out again), the importer finds its own by that id.
 * A communicator is used by one transfer at a time, aborted (ncclCommAbort) on any error or
 * timeout, and dropped after transfer.comm_idle_ms without use (the exporter stops reusing one
 * after half that, so the importer still has its end). Waits poll the stream and
 * ncclCommGetAsyncError against the transfer's deadline, so a dead peer costs at most the
 * timeout, never the daemon's health.
 *
 * Not here: the page allocation (the dispatch's planner) and the sockets. Threads: every
 * function on the loop thread except kvp_xfer_run.
 */
#ifndef KVP_XFER_H
#define KVP_XFER_H

#include <stddef.h>
#include <stdint.h>

#include "kvp_backend.h"

#define KVP_XFER_ID_BYTES 128 /* sizeof(ncclUniqueId) */
#define KVP_XFER_HISTORY  16  /* finished transfers kept for ListTransfers */
#define KVP_XFER_MAX_SEQS 64  /* sequences in one transfer (kvpool.options) */

/* The shape of a transfer's stream, decided by the exporter: the ticket carries it to Import,
 * so the importer queues the whole stream at once (the header still comes first, and is
 * checked against the Import at the end). */
typedef struct {
    uint64_t bytes;       /* the whole stream */
    uint32_t chunk_bytes; /* the largest chunk (kvp_xfer_chunk_at's schedule) */
    uint32_t flags;       /* KVP_XFER_REGISTERED */
} kvp_xfer_stream_t;
#define KVP_XFER_REGISTERED 1u /* the staging buffers are registered with NCCL on both sides */

/* Checks an Import's stream shape (as ExportBegin answered): bytes > 0, chunk_bytes a multiple
 * of 256 in 256..1 GiB, flags known. 0 or KVP_EINVAL with why. */
int kvp_xfer_check_stream(const kvp_xfer_stream_t *st, char *why, size_t why_len);

/* The sequences of one transfer, in stream order: sequence i has tokens[i] > 0 tokens in its
 * first ceil(tokens[i] / page_size) pages pages[i][...]. */
typedef struct {
    uint32_t n; /* 1..KVP_XFER_MAX_SEQS */
    const uint64_t *seq_ids;
    const uint32_t *tokens;
    const uint32_t *const *pages;
} kvp_xfer_set_t;

typedef struct kvp_xfer kvp_xfer_t;
typedef struct kvp_xfer_job kvp_xfer_job_t;

typedef struct {
    uint32_t timeout_ms;    /* default per transfer (peer join included) */
    uint32_t comm_idle_ms;  /* an unused communicator is destroyed after this */
    uint32_t max_in_flight; /* transfers running at once (export and import together) */
    uint32_t chunk_bytes;   /* staging chunk of an export; 0: kvp_xfer_chunk_bytes's choice */
} kvp_xfer_config_t;

enum { KVP_XFER_EXPORT = 0, KVP_XFER_IMPORT = 1 };

/* One transfer as ListTransfers reports it. */
typedef struct {
    uint64_t transfer_id;
    int direction; /* KVP_XFER_EXPORT / _IMPORT */
    char peer[65];
    char ns[65];
    uint64_t seq_id; /* the first of the set */
    uint32_t num_seqs;
    uint32_t num_tokens; /* of the whole set */
    uint64_t bytes;
    int state; /* 0 running, 1 ok, 2 failed */
    char message[128];
    uint64_t start_ms, end_ms;
} kvp_xfer_info_t;

/* Borrows b (outlives x). Returns 0, KVP_EINVAL, KVP_ENOMEM. Never loads NCCL. */
int kvp_xfer_create(kvp_backend_t *b, const kvp_xfer_config_t *cfg, kvp_xfer_t **out);
/* Aborts the cached communicators; no job may be in flight. NULL: no-op. */
void kvp_xfer_destroy(kvp_xfer_t *x);
/* SIGHUP: timeout_ms, comm_idle_ms and chunk_bytes apply to later transfers. */
void kvp_xfer_set_config(kvp_xfer_t *x, const kvp_xfer_config_t *cfg);

/* Whether this daemon can transfer: 0; KVP_EUNAVAIL (host backend, NCCL not loadable);
 * KVP_EPRECOND (a pool of more than one device); KVP_ELIMIT (max_in_flight reached). why gets
 * the reason. */
int kvp_xfer_check_ready(kvp_xfer_t *x, char *why, size_t why_len);

/* Pure checks of the requests against this pool's geometry (no NCCL needed), in this order:
 * export: num_tokens > 0 (KVP_EPRECOND: an empty sequence), timeout_ms <= 3600000 (KVP_EINVAL);
 * import: nccl_id of KVP_XFER_ID_BYTES bytes, transfer_id != 0, num_tokens 1..max_tokens,
 * num_layers == the pool's, timeout_ms <= 3600000 (all KVP_EINVAL). */
int kvp_xfer_check_export(const kvp_geom_t *g, uint32_t num_tokens, uint32_t timeout_ms, char *why,
                          size_t why_len);
int kvp_xfer_check_import(const kvp_geom_t *g, uint32_t id_len, uint64_t transfer_id,
                          uint32_t num_tokens, uint32_t max_tokens, uint32_t num_layers,
                          uint32_t timeout_ms, char *why, size_t why_len);

/* The largest staging chunk of an export of stream_bytes: setting (transfer.chunk_bytes) or,
 * when 0, a quarter of the stream within [4 MiB, 256 MiB]; at most 1 GiB and the whole
 * stream; rounded up to a multiple of 256 bytes. The header carries it: the importer stages
 * in the exporter's chunks. */
size_t kvp_xfer_chunk_bytes(uint32_t setting, uint64_t stream_bytes);

/* The schedule: the size of the chunk that starts at stream offset off (< total), given the
 * largest chunk. Chunks ramp up from chunk_max / 8 (never more than what is already queued),
 * so the first pack is short, and ramp down to halves of what is left, at least 4 MiB (or
 * chunk_max when smaller), so the last unpack is short; in between they are chunk_max. Each
 * NCCL call costs ~20 us over NVLink (measured on 2 x H200), so the middle chunks are large.
 * Multiples of 256 bytes but the last; both sides compute the same schedule. */
size_t kvp_xfer_chunk_at(size_t chunk_max, uint64_t off, uint64_t total);

/* Bytes of the packed stream of num_tokens tokens of this geometry (all layers, K and V, all
 * heads of a one-device pool). */
uint64_t kvp_xfer_stream_bytes(const kvp_geom_t *g, uint32_t num_tokens);

/* The header's check of a set's split into sequences: FNV-1a over the token counts. */
uint32_t kvp_xfer_set_hash(const uint32_t *tokens, uint32_t n);

/* Starts an export of the set (its pages copied; the caller keeps them pinned until
 * kvp_xfer_finish): picks or creates the communicator of peer, writes its unique id to id_out
 * and the new transfer's id to *transfer_id. The stream is the sequences' packed streams one
 * after the other. kvp_xfer_check_ready must have said 0. Returns 0, KVP_EUNAVAIL (NCCL),
 * KVP_ENOMEM. */
int kvp_xfer_export_begin(kvp_xfer_t *x, const char *peer, const char *ns,
                          const kvp_xfer_set_t *set, uint32_t timeout_ms, uint64_t now_ms,
                          uint8_t id_out[KVP_XFER_ID_BYTES], uint64_t *transfer_id,
                          kvp_xfer_stream_t *stream, kvp_xfer_job_t **out);

/* Starts an import of the set into its pages (the new sequences', pinned by the caller).
 * Returns 0, KVP_EBUSY (the communicator of that id is in use by another transfer),
 * KVP_ENOMEM. */
int kvp_xfer_import_begin(kvp_xfer_t *x, const uint8_t id[KVP_XFER_ID_BYTES], uint64_t transfer_id,
                          const char *ns, const kvp_xfer_set_t *set,
                          const kvp_xfer_stream_t *stream, uint32_t timeout_ms, uint64_t now_ms,
                          kvp_xfer_job_t **out);

/* Worker thread: runs the transfer to its end (success, error or deadline). */
void kvp_xfer_run(kvp_xfer_job_t *j);

/* Loop thread, after run: records the outcome (metrics, history), returns the communicator to
 * the cache or drops it, frees j. Returns 0 or the transfer's error code; msg (msg_len) gets
 * the reason. The caller then unpins (export) or releases the new sequence on error (import). */
int kvp_xfer_finish(kvp_xfer_t *x, kvp_xfer_job_t *j, uint64_t now_ms, char *msg, size_t msg_len);

/* Drops communicators idle for comm_idle_ms. Returns the next time (ms) it has work, UINT64_MAX
 * when none. */
uint64_t kvp_xfer_sweep(kvp_xfer_t *x, uint64_t now_ms);

/* Transfers in flight then the newest finished, at most max. Returns how many were written. */
uint32_t kvp_xfer_list(const kvp_xfer_t *x, kvp_xfer_info_t *out, uint32_t max);

/* Counters for the metrics: [direction][0 ok, 1 failed] and bytes moved by direction (ok
 * transfers only); in flight now; cached communicators. */
void kvp_xfer_counters(const kvp_xfer_t *x, uint64_t totals[2][2], uint64_t bytes[2],
                       uint32_t *in_flight, uint32_t *comms);

#endif
