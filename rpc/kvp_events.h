/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_events.h - KV events (issue #29): what the prefix cache stores and removes, in vLLM's
 * wire format, for cache-aware routers (llm-d, Dynamo).
 *
 * Three parts, one direction:
 *   batcher    (kvp_events.c, the loop thread) observes the prefix cache (kvp_pcache_set_observer)
 *              and appends one record per block event to the open batch; kvp_events_flush closes
 *              it once per loop iteration, numbers it (seq 0, 1, ...) and hands it to the sink.
 *              Nothing here blocks: a record is a copy of a few dozen bytes and the page's
 *              token ids.
 *   encoder    (kvp_events_enc.c, pure) turns a closed batch into the bytes of vLLM 0.33.0's
 *              KVEventBatch (msgspec, array-like): [ts, [event, ...], data_parallel_rank], each
 *              event a tagged map (BlockStored / BlockRemoved / AllBlocksCleared). Runs of
 *              records that continue one chain (same scope and medium, each the previous one's
 *              child) become one BlockStored with several block_hashes, as vLLM's scheduler
 *              emits them; runs of removals of one medium one BlockRemoved.
 *   publisher  (server/kvp_evpub.c, a thread of its own) encodes, sends on the PUB socket
 *              ([topic, seq as 8 bytes big-endian, payload]), keeps the last buffer_steps
 *              payloads for the ROUTER replay socket, and updates the counters below.
 *
 * Block identity. A block's hash is its page key (XXH3-128, kvp_pagekey.h) XOR the tag of its
 * scope (kvp_pagekey_root of the scope's published name), 16 bytes big-endian (hi then lo):
 * BlockRemoved names no scope, so equal content in two scopes must not share a hash. A chain's
 * salt is inside its keys and never published. The scope's name travels in extra_keys: one
 * entry per block, the 1-tuple [name] (vLLM's cache_salt position: what separates tenants).
 */
#ifndef KVP_EVENTS_H
#define KVP_EVENTS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "kvp_pagekey.h"
#include "kvp_pcache.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVP_EV_HASH_BYTES 16u

typedef enum {
    KVP_EV_STORED = 0,  /* BlockStored */
    KVP_EV_REMOVED = 1, /* BlockRemoved */
    KVP_EV_CLEARED = 2  /* AllBlocksCleared */
} kvp_ev_kind_t;

typedef enum {
    KVP_EV_GPU = 0, /* medium "GPU": the pool */
    KVP_EV_CPU = 1  /* medium "CPU": the host tier (issue #28) */
} kvp_ev_medium_t;

/* One block event. */
typedef struct {
    uint8_t kind;       /* kvp_ev_kind_t */
    uint8_t medium;     /* kvp_ev_medium_t (STORED, REMOVED) */
    uint8_t has_parent; /* STORED: 0 for a chain's first page (parent_block_hash None) */
    uint8_t pad;
    uint32_t scope_off; /* STORED: the scope's name, NUL-terminated, at batch->names + scope_off */
    uint32_t tok_off;   /* STORED: block_size token ids at batch->tok + tok_off */
    uint8_t hash[KVP_EV_HASH_BYTES];
    uint8_t parent[KVP_EV_HASH_BYTES]; /* STORED with has_parent */
} kvp_ev_rec_t;

/* A batch: what one loop iteration stored and removed, in order. Owned by whoever holds it
 * (the batcher while open, then the sink); freed with kvp_ev_batch_free. */
typedef struct kvp_ev_batch {
    struct kvp_ev_batch *next; /* the publisher's queue link */
    uint64_t seq;              /* 0, 1, 2, ... per daemon run */
    double ts;                 /* seconds since the epoch when it closed (CLOCK_REALTIME) */
    uint32_t block_size;       /* tokens per block: the pool's page_size */
    uint32_t n, cap;           /* records */
    kvp_ev_rec_t *rec;
    uint32_t ntok, tokcap; /* token ids */
    int32_t *tok;
    uint32_t nnames, namescap; /* scope names, each NUL-terminated */
    char *names;
} kvp_ev_batch_t;

void kvp_ev_batch_free(kvp_ev_batch_t *b);

/* ---- the encoder (kvp_events_enc.c) -------------------------------------------------------- */

/* A growing byte buffer. */
typedef struct {
    uint8_t *data;
    size_t len, cap;
} kvp_ev_buf_t;

void kvp_ev_buf_free(kvp_ev_buf_t *b);

/* Replaces out's contents with the msgpack of b as vLLM 0.33.0's KVEventBatch with
 * data_parallel_rank dp_rank. Returns 0, KVP_ENOMEM (out then empty) or KVP_EINVAL (NULL, or a
 * malformed batch: an unknown kind or medium, offsets outside the batch, a scope name that is
 * not NUL-terminated UTF-8; out and *events untouched). *events (when not NULL) gets the number
 * of events (maps) written. */
int kvp_ev_encode(const kvp_ev_batch_t *b, uint32_t dp_rank, kvp_ev_buf_t *out, uint32_t *events);

/* ---- counters (the publisher's thread writes, the metrics read) ---------------------------- */

typedef struct {
    _Atomic uint64_t batches;          /* batches sent on the PUB socket */
    _Atomic uint64_t events;           /* events (maps) in them */
    _Atomic uint64_t blocks;           /* block hashes in them (stored + removed) */
    _Atomic uint64_t bytes;            /* payload bytes sent */
    _Atomic uint64_t dropped_hwm;      /* batches the PUB socket's high-water mark refused */
    _Atomic uint64_t dropped_queue;    /* batches dropped before the thread (queue at hwm) */
    _Atomic uint64_t replay_requests;  /* requests on the ROUTER socket (well-formed) */
    _Atomic uint64_t replay_bad;       /* malformed ones, ignored */
    _Atomic uint64_t replayed_batches; /* batches sent in answer */
    _Atomic uint64_t subscribers;      /* SUB peers subscribed now (XPUB notices) */
    _Atomic uint64_t queued;           /* batches handed over, not yet taken by the thread */
} kvp_ev_stats_t;

/* ---- the batcher (kvp_events.c) ------------------------------------------------------------ */

/* Where closed batches go (the publisher's submit); takes ownership. Called on the loop thread;
 * must not block. */
typedef void (*kvp_ev_sink_fn)(void *ctx, kvp_ev_batch_t *b);

typedef struct kvp_events kvp_events_t;

/* A scope's published name (NUL-terminated, valid until the next call) and tag. */
typedef void (*kvp_ev_scope_fn)(void *ctx, uint32_t scope, const char **name, kvp_pagekey_t *tag);

/* The batcher of a pool of block_size tokens per page: closed batches go to sink(sink_ctx, b),
 * scope ids are named by scope_fn(scope_ctx, ...). Returns 0, KVP_EINVAL or KVP_ENOMEM. */
int kvp_events_create(uint32_t block_size, kvp_ev_sink_fn sink, void *sink_ctx,
                      kvp_ev_scope_fn scope_fn, void *scope_ctx, kvp_events_t **out);
/* Frees the batcher and its open batch (unsent). NULL: no-op. */
void kvp_events_destroy(kvp_events_t *e);

/* The prefix cache's observer (kvp_pcache_set_observer; ctx: the batcher): appends a record to
 * the open batch. Out of memory drops the record and counts it (kvp_events_lost). */
void kvp_events_observe(void *ctx, const kvp_pcache_event_t *ev);

/* Appends an AllBlocksCleared (the daemon's first batch and its last: a consumer that outlives
 * a restart forgets what the old daemon had). */
void kvp_events_clear(kvp_events_t *e);

/* Closes the open batch when it holds a record: numbered (kvp_events_next_seq), stamped with
 * the wall clock and handed to the sink. */
void kvp_events_flush(kvp_events_t *e);

/* A batch closes once it is batch_ms old (events.batch_ms; 0: at the end of the loop iteration
 * that opened it) or holds KVP_EV_BATCH_MAX_RECORDS records: one batch per loop iteration
 * would wake the publisher's thread and ZMQ's for every request. Returns UINT32_MAX when no
 * batch is open, 0 when the open one is due, else the ms until it is. now_ms: a monotonic
 * clock (kvp_events_now_ms). */
#define KVP_EV_BATCH_MAX_RECORDS 8192u
uint32_t kvp_events_due_in(const kvp_events_t *e, uint64_t now_ms, uint32_t batch_ms);
/* 1 when a batch is open (holds a record). */
int kvp_events_open(const kvp_events_t *e);
/* CLOCK_MONOTONIC in ms: the clock of batch ages. */
uint64_t kvp_events_now_ms(void);

/* A scope id was given to another scope: names and tags already looked up in the open batch
 * are not its. */
void kvp_events_forget_scope(kvp_events_t *e);

/* The sequence number the next closed batch gets: a snapshot taken right after a flush
 * reflects every batch before it. */
uint64_t kvp_events_next_seq(const kvp_events_t *e);

/* Records lost to a failed allocation (a consumer must then reload a snapshot). */
uint64_t kvp_events_lost(const kvp_events_t *e);

/* A block's published hash: key XOR the scope's tag, hi then lo, big-endian. */
void kvp_events_hash(kvp_pagekey_t key, kvp_pagekey_t tag, uint8_t out[KVP_EV_HASH_BYTES]);

#ifdef __cplusplus
}
#endif
#endif
