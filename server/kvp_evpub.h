/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_evpub.h - the KV-event publisher (issue #29): a thread of its own with a ZMQ PUB socket
 * (vLLM's ZmqEventPublisher, 0.33.0) and, optionally, a ROUTER socket for replay. The loop
 * hands it closed batches (kvp_evpub_submit, the batcher's sink: rpc/kvp_events.h); the thread
 * encodes each (kvp_ev_encode), sends [topic, seq (8 bytes big-endian), payload], and keeps
 * the last buffer_steps payloads for replay. It never blocks the loop: submit takes a mutex
 * for a pointer swap and writes an eventfd; a full queue (hwm batches waiting) drops the batch
 * and counts it. The PUB side is an XPUB with XPUB_NODROP and non-blocking sends, so a batch
 * that a subscriber's high-water mark refuses is counted (dropped_hwm) instead of vanishing;
 * it stays in the replay buffer.
 *
 * Endpoints as vLLM's: a wildcard ("tcp://\*:5557", "::") or ipc:// / inproc:// endpoint is
 * bound, any other one connected (a router that binds its SUB socket: llm-d's indexer); the
 * replay endpoint is always bound. Replay: a request [identity, "", start_seq (8 bytes
 * big-endian)] is answered with [identity, "", topic, seq, payload] for every buffered batch
 * from start_seq on, then [identity, "", "", -1 (8 bytes), ""].
 */
#ifndef KVP_EVPUB_H
#define KVP_EVPUB_H

#include <stddef.h>
#include <stdint.h>

#include "kvp_events.h"

typedef struct {
    const char *endpoint;        /* PUB; required */
    const char *replay_endpoint; /* ROUTER; NULL or "": none */
    const char *topic;           /* first frame of every message; NULL: "" */
    uint32_t buffer_steps;       /* batches kept for replay (>= 1) */
    uint32_t hwm;                /* PUB send high-water mark and the submit queue's bound */
    uint32_t dp_rank;            /* EventBatch.data_parallel_rank */
} kvp_evpub_config_t;

typedef struct kvp_evpub kvp_evpub_t;

/* Opens the sockets (bind/connect as above) and starts the thread. Returns 0, KVP_EINVAL (a
 * malformed endpoint or config), a negative errno (-EADDRINUSE, -ENOENT: the system refused the
 * bind or connect) or KVP_ENOMEM, with a sentence in err ("cannot bind event endpoint ipc://...:
 * No such file or directory") and nothing left running. stats (kept by the caller, outliving the
 * publisher) gets the counters. */
int kvp_evpub_start(const kvp_evpub_config_t *cfg, kvp_ev_stats_t *stats, kvp_evpub_t **out,
                    char *err, size_t err_len);

/* The batcher's sink (kvp_ev_sink_fn; ctx is the publisher): queues b for the thread, taking
 * ownership. Never blocks beyond a short mutex; with hwm batches already queued, frees b and
 * counts it in dropped_queue. */
void kvp_evpub_submit(void *ctx, kvp_ev_batch_t *b);

/* Sends what is queued (for at most timeout_ms; batches left then count in dropped_queue),
 * stops the thread, closes the sockets (the PUB socket lingers for what is left of timeout_ms,
 * so what zmq still holds reaches connected subscribers) and frees everything. NULL: no-op. */
void kvp_evpub_stop(kvp_evpub_t *p, uint32_t timeout_ms);

/* The endpoints as bound (ZMQ_LAST_ENDPOINT for a bound one: a wildcard port 0 gets the port the
 * system chose), for the log and the tests. */
const char *kvp_evpub_endpoint(const kvp_evpub_t *p);
const char *kvp_evpub_replay_endpoint(const kvp_evpub_t *p);

#endif
