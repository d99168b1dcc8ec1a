/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_dedup.h - the retry windows that make mutating calls idempotent (kvpool.proto,
 * "Idempotency"): per namespace, the last `window` request ids with the call and a digest of
 * the request they were first sent with, and the encoded answer of each while the byte budgets
 * allow.
 *
 * Memory is bounded whatever clients send: an answer above max_entry_bytes is never kept; the
 * answers kept by one namespace stay within ns_max_bytes and those of all namespaces within
 * max_bytes, the oldest answer (of the namespace, or of the daemon) giving way first. An
 * evicted answer leaves its id behind as KVP_DEDUP_NOT_KEPT (a retry is refused, never applied
 * twice) until the id leaves the window. Ids are forgotten outright when their call failed
 * (an error changed nothing, so the retry runs again).
 *
 * Pure bookkeeping: no sockets, no clock, no protocol knowledge (a call is a small number the
 * caller chooses). Loop thread only.
 */
#ifndef KVP_DEDUP_H
#define KVP_DEDUP_H

#include <stddef.h>
#include <stdint.h>

/* The state of one remembered request id. */
typedef enum {
    KVP_DEDUP_FREE = 0,  /* slot unused */
    KVP_DEDUP_IN_FLIGHT, /* begun, not answered yet: a retry must wait */
    KVP_DEDUP_KEPT,      /* answered OK; frame holds the encoded answer */
    KVP_DEDUP_NOT_KEPT,  /* answered OK; the answer was too large or evicted for bytes */
} kvp_dedup_state_t;

typedef struct kvp_dedup_entry {
    uint64_t req_id;
    uint64_t digest; /* of the request as first sent */
    uint8_t *frame;  /* owned; set in state KVP_DEDUP_KEPT only */
    uint32_t len;
    uint32_t ns;
    uint16_t call;
    uint8_t state; /* kvp_dedup_state_t */
    /* kept answers, oldest first: of the namespace, and of the daemon */
    struct kvp_dedup_entry *ns_older, *ns_newer, *all_older, *all_newer;
} kvp_dedup_entry_t;

typedef struct {
    kvp_dedup_entry_t *ring; /* [window], then the hash index; NULL while closed */
    uint32_t next;           /* the ring slot the next id takes */
    uint32_t entries;        /* slots not free */
    uint64_t bytes;          /* of its kept answers */
    kvp_dedup_entry_t *oldest, *newest;
} kvp_dedup_window_t;

typedef struct {
    uint32_t window;          /* ids per namespace, >= 1 */
    uint32_t max_entry_bytes; /* largest answer kept */
    uint64_t ns_max_bytes;    /* kept answers of one namespace */
    uint64_t max_bytes;       /* kept answers of all namespaces */
} kvp_dedup_limits_t;

typedef struct {
    kvp_dedup_window_t *w; /* [max_ns] */
    uint32_t max_ns;
    kvp_dedup_limits_t lim;
    uint64_t bytes;           /* of all kept answers */
    uint64_t evictions_total; /* answers dropped to stay within a byte budget */
    kvp_dedup_entry_t *oldest, *newest;
} kvp_dedup_t;

/* Returns 0, KVP_EINVAL (max_ns or window 0), KVP_ENOMEM. */
int kvp_dedup_init(kvp_dedup_t *d, uint32_t max_ns, const kvp_dedup_limits_t *lim);
void kvp_dedup_free(kvp_dedup_t *d);
/* A reload: takes new byte budgets (window stays) and evicts at once what no longer fits. */
void kvp_dedup_set_budgets(kvp_dedup_t *d, uint64_t ns_max_bytes, uint64_t max_bytes);

/* Namespace ns starts (allocates its window: 0 or KVP_ENOMEM) or ends (drops it). */
int kvp_dedup_open(kvp_dedup_t *d, uint32_t ns);
void kvp_dedup_close(kvp_dedup_t *d, uint32_t ns);

/* The entry of req_id in ns's window, or NULL (also for id 0 and a closed window). */
const kvp_dedup_entry_t *kvp_dedup_find(const kvp_dedup_t *d, uint32_t ns, uint64_t req_id);
/* Remembers req_id (not in the window) as in flight, taking the oldest slot that is not in
 * flight itself. Returns 0, or KVP_EBUSY when every slot of the window is in flight. */
int kvp_dedup_begin(kvp_dedup_t *d, uint32_t ns, uint64_t req_id, uint16_t call, uint64_t digest);
/* req_id's call answered OK: keeps a copy of frame (NULL: the answer was lost) within the
 * budgets. No-op unless req_id is in flight. */
void kvp_dedup_answer(kvp_dedup_t *d, uint32_t ns, uint64_t req_id, const uint8_t *frame,
                      uint32_t len);
/* req_id's call failed: the id leaves the window. No-op unless req_id is in flight. */
void kvp_dedup_forget(kvp_dedup_t *d, uint32_t ns, uint64_t req_id);

/* A digest of a request's bytes (not cryptographic: it tells a retry from another request
 * that reuses the id by mistake). */
uint64_t kvp_dedup_digest(const uint8_t *p, size_t len);

#endif
