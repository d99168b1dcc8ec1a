/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_ns.h - namespaces: name -> small id (the sequence table's namespace id), the uid that
 * owns it, live sessions, the lease that keeps its sequences after the last session leaves
 * (DESIGN.md §3). The retry windows of the namespaces are kvp_dedup.h's.
 *
 * Pure bookkeeping: no sockets, no clock reads (times are caller-supplied milliseconds).
 * Loop thread only.
 */
#ifndef KVP_NS_H
#define KVP_NS_H

#include <stddef.h>
#include <stdint.h>

#define KVP_NS_NAME_MAX 64

typedef struct {
    char name[KVP_NS_NAME_MAX + 1];
    int in_use;
    uint32_t owner_uid;
    uint32_t sessions;
    uint32_t lease_ms;
    uint64_t expires_at_ms; /* sessions == 0: when its sequences go; 0 = none pending */
    uint64_t buffer_bytes;  /* registered by its sessions, for limits.ns_max_buffer_bytes */
    uint32_t group;    /* its tenant group in the sequence table (the owner uid's; kvp_rpc.c) */
    uint32_t scope1;   /* its prefix-cache scope + 1 (kvp_rpc_cache.c); 0: none yet */
    int pins_only;     /* released, kept only for its pins (kvp_rpc_cache.c) */
    uint64_t idle_seq; /* the table's count when its last session went: which went idle first
                          when two leases end in the same ms */
} kvp_ns_t;

typedef struct {
    kvp_ns_t *ns;
    uint32_t max;
    uint64_t idle_seq; /* namespaces that went idle so far */
} kvp_ns_table_t;

int kvp_ns_table_init(kvp_ns_table_t *t, uint32_t max_namespaces);
void kvp_ns_table_free(kvp_ns_table_t *t);

/* Attaches a session to namespace `name` (creating it, owned by uid): returns 0 and *id;
 * KVP_EINVAL (empty or too long name), KVP_EPERM (owned by another uid; root may attach to
 * any), KVP_ELIMIT (no free namespace slot). A new namespace takes lease_ms; an existing one
 * takes it only when set_lease (the Hello named a lease), so an observer that names none
 * never changes a running engine's lease. A pending expiry is cancelled. */
int kvp_ns_attach(kvp_ns_table_t *t, const char *name, uint32_t uid, uint32_t lease_ms,
                  int set_lease, uint32_t *id);

/* Whether name is a valid client-chosen name (kvpool.proto, Names): 1..KVP_NS_NAME_MAX bytes
 * of [A-Za-z0-9._:@/+-] (0 bytes too when allow_empty). The set is ASCII, so a valid name is
 * valid UTF-8, and holds no space, '=' or quote, so it cannot forge a key=value log field. */
int kvp_ns_name_valid(const char *name, int allow_empty);
/* Whether name is reserved for the daemon's operators: "default", "kvpoolctl" and every name
 * starting with KVP_NS_RESERVED_PREFIX. */
#define KVP_NS_RESERVED_PREFIX "kvpool."
int kvp_ns_reserved(const char *name);

/* The id of the namespace called name, or -1. */
int kvp_ns_find(const kvp_ns_table_t *t, const char *name);

/* Detaches a session. Returns 1 when it was the last one and the lease is 0 (release its
 * sequences now), else 0 (an expiry is scheduled at now + lease when it was the last). */
int kvp_ns_detach(kvp_ns_table_t *t, uint32_t id, uint64_t now_ms);

/* The next namespace whose lease ran out at now_ms (returns its id and clears the pending
 * expiry), or -1. The caller releases its sequences and then calls kvp_ns_forget. */
int kvp_ns_next_expired(kvp_ns_table_t *t, uint64_t now_ms);

/* Frees a namespace slot with no sessions (its sequences must be gone); the id may be
 * reused. */
void kvp_ns_forget(kvp_ns_table_t *t, uint32_t id);

/* Earliest pending expiry, or UINT64_MAX. */
uint64_t kvp_ns_next_deadline(const kvp_ns_table_t *t);

#endif
