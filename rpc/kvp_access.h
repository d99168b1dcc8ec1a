/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_access.h - who may connect to kvpoold: the policy of the [access] section
 * (kvp_config.h) as a pure function of the peer's credentials, so it is unit-tested without
 * sockets or other users. The server reads the credentials (SO_PEERCRED, SO_PEERGROUPS) and
 * refuses a peer this says no to with PERMISSION_DENIED before it can send a request. The second
 * policy, kvp_access_pool_check, decides who of the admitted may receive the pool's fds.
 */
#ifndef KVP_ACCESS_H
#define KVP_ACCESS_H

#include <stdint.h>

#define KVP_ACCESS_MAX_IDS 64

typedef struct {
    uint32_t self_uid;   /* the daemon's effective uid: always allowed (as is root) */
    uint32_t socket_gid; /* the socket file's group: allowed when both lists are empty */
    uint32_t num_uids, num_gids;
    uint32_t uids[KVP_ACCESS_MAX_IDS]; /* access.allowed_uids */
    uint32_t gids[KVP_ACCESS_MAX_IDS]; /* access.allowed_gids */
} kvp_access_t;

/* Decides for a peer with uid and groups gids[0..ngids) (its primary group first, then its
 * supplementary ones). Root and self_uid are always allowed; with both lists empty so are the
 * members of socket_gid; otherwise exactly the listed uids and the members of the listed gids.
 * Returns 0 (allowed) or KVP_EPERM. */
int kvp_access_check(const kvp_access_t *a, uint32_t uid, const uint32_t *gids, uint32_t ngids);

/* Who may receive the pool's memory (access.pool_uids / pool_gids): the pool fds that Hello and
 * PoolInfo hand out on want_pool_fds. Whoever holds them can map the whole pool read-write,
 * every namespace's K/V bytes included; namespace ownership protects allocation, not data.
 * Plain data, copied by assignment; all zero (both lists empty) admits everyone, the one trust
 * domain of earlier versions. */
typedef struct {
    uint32_t self_uid; /* the daemon's effective uid: always allowed (as is root) */
    uint32_t num_uids, num_gids;
    uint32_t uids[KVP_ACCESS_MAX_IDS]; /* access.pool_uids */
    uint32_t gids[KVP_ACCESS_MAX_IDS]; /* access.pool_gids: matched against the primary gid */
} kvp_pool_access_t;

/* Decides whether a session of uid (primary group gid) may receive the pool fds. Both lists
 * empty: yes. Otherwise root, self_uid, the listed uids and the uids whose primary group is
 * listed (the session records only the primary gid). Returns 0 (allowed) or KVP_EPERM. */
int kvp_access_pool_check(const kvp_pool_access_t *a, uint32_t uid, uint32_t gid);

/* Who may join which prefix-cache scope (access.cache_scopes, kvpool.proto Hello.cache_scope):
 * "name=uid,uid;name2=uid" lists the scopes shared across uids and who may join each. A scope
 * a Hello names that is listed here is one scope for the listed uids (and root and self_uid);
 * anyone else naming it is refused. An unlisted name is private to the uid that names it:
 * another uid naming the same string gets a different scope. So sharing KV (and the timing
 * side channel a shared cache is) across tenants happens only where the operator wrote it. */
#define KVP_ACCESS_MAX_SCOPES     32
#define KVP_ACCESS_MAX_SCOPE_UIDS 16
typedef struct {
    uint32_t self_uid;
    uint32_t count;
    struct {
        char name[65];
        uint32_t num_uids;
        uint32_t uids[KVP_ACCESS_MAX_SCOPE_UIDS];
    } scopes[KVP_ACCESS_MAX_SCOPES];
} kvp_scope_access_t;

/* Parses text ("" is no shared scope) into *out (self_uid left 0). Returns 0, or KVP_EINVAL
 * with the reason in why: a name that is not a valid name (kvp_ns_name_valid) or that starts
 * with "ns:" or "uid:" (how KV events name private and unlisted scopes), listed twice, without
 * uids, too many scopes or uids, a uid that is not a number. */
int kvp_access_scopes_parse(const char *text, kvp_scope_access_t *out, char *why, unsigned why_len);

/* For a Hello of uid naming scope `name` (non-empty): 0 with *shared = 1 (a listed scope the
 * uid may join: root, self_uid and the listed uids may) or *shared = 0 (unlisted: the uid's
 * own), or KVP_EPERM (listed, and the uid is not). */
int kvp_access_scope_check(const kvp_scope_access_t *a, const char *name, uint32_t uid,
                           int *shared);

#endif
