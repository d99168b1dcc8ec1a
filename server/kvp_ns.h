/*
 * kvp_ns.h - namespaces: name -> small id (the sequence table's namespace id), the uid that
 * owns it, live sessions, the lease that keeps its sequences after the last session leaves
 * (DESIGN.md §3), and the per-namespace dedup window that makes mutating calls idempotent.
 *
 * Pure bookkeeping: no sockets, no clock reads (times are caller-supplied milliseconds).
 * Loop thread only.
 */
#ifndef KVP_NS_H
#define KVP_NS_H

#include <stddef.h>
#include <stdint.h>

#define KVP_NS_NAME_MAX 64

/* One remembered answer: the encoded response frame of a mutating call. */
typedef struct {
    uint64_t req_id;
    uint8_t *frame; /* owned; NULL while the call is in flight or when too large to keep */
    uint32_t len;
    uint8_t state; /* 0 empty, 1 in flight, 2 answered, 3 answered but not kept */
} kvp_dedup_entry_t;

typedef struct {
    char name[KVP_NS_NAME_MAX + 1];
    int in_use;
    uint32_t owner_uid;
    uint32_t sessions;
    uint32_t lease_ms;
    uint64_t expires_at_ms;   /* sessions == 0: when its sequences go; 0 = none pending */
    kvp_dedup_entry_t *dedup; /* ring of dedup_window entries */
    uint32_t dedup_next;
    uint64_t dedup_bytes;
    uint64_t buffer_bytes; /* registered by its sessions, for limits.ns_max_buffer_bytes */
} kvp_ns_t;

typedef struct {
    kvp_ns_t *ns;
    uint32_t max;
    uint32_t dedup_window;
    uint32_t dedup_max_entry_bytes;
} kvp_ns_table_t;

int kvp_ns_table_init(kvp_ns_table_t *t, uint32_t max_namespaces, uint32_t dedup_window);
void kvp_ns_table_free(kvp_ns_table_t *t);

/* Attaches a session to namespace `name` (creating it, owned by uid): returns 0 and *id;
 * KVP_EINVAL (empty or too long name), KVP_EPERM (owned by another uid; root may attach to
 * any), KVP_ELIMIT (no free namespace slot). A new namespace takes lease_ms; an existing one
 * takes it only when set_lease (the Hello named a lease), so an observer that names none
 * never changes a running engine's lease. A pending expiry is cancelled. */
int kvp_ns_attach(kvp_ns_table_t *t, const char *name, uint32_t uid, uint32_t lease_ms,
                  int set_lease, uint32_t *id);

/* The id of the namespace called name, or -1. */
int kvp_ns_find(const kvp_ns_table_t *t, const char *name);

/* Detaches a session. Returns 1 when it was the last one and the lease is 0 (release its
 * sequences now), else 0 (an expiry is scheduled at now + lease when it was the last). */
int kvp_ns_detach(kvp_ns_table_t *t, uint32_t id, uint64_t now_ms);

/* The next namespace whose lease ran out at now_ms (returns its id and clears the pending
 * expiry), or -1. The caller releases its sequences and then calls kvp_ns_forget. */
int kvp_ns_next_expired(kvp_ns_table_t *t, uint64_t now_ms);

/* Frees a namespace slot with no sessions (its sequences must be gone), dropping its dedup
 * window; the id may be reused. */
void kvp_ns_forget(kvp_ns_table_t *t, uint32_t id);

/* Earliest pending expiry, or UINT64_MAX. */
uint64_t kvp_ns_next_deadline(const kvp_ns_table_t *t);

/* Looks req_id up in the namespace's window: returns NULL when unseen, else the entry
 * (state 1: still in flight; 2: frame holds the answer; 3: answered, answer not kept). */
const kvp_dedup_entry_t *kvp_ns_dedup_find(const kvp_ns_table_t *t, uint32_t id, uint64_t req_id);

/* Marks req_id in flight (evicting the oldest entry of the ring). */
void kvp_ns_dedup_begin(kvp_ns_table_t *t, uint32_t id, uint64_t req_id);

/* Stores the answer of req_id (copied; kept only when len <= the per-entry bound). */
void kvp_ns_dedup_end(kvp_ns_table_t *t, uint32_t id, uint64_t req_id, const uint8_t *frame,
                      uint32_t len);

#endif
