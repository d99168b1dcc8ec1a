/* kvp_access.c - the connection policy and the pool-memory policy (see kvp_access.h). */
#include "kvp_access.h"

#include <stddef.h>

#include "kvp_error.h"

static int listed(const uint32_t *ids, uint32_t n, uint32_t id)
{
    for (uint32_t i = 0; i < n; i++)
        if (ids[i] == id)
            return 1;
    return 0;
}

int kvp_access_check(const kvp_access_t *a, uint32_t uid, const uint32_t *gids, uint32_t ngids)
{
    if (uid == 0 || uid == a->self_uid)
        return 0;
    if (a->num_uids == 0 && a->num_gids == 0)
        return gids && listed(gids, ngids, a->socket_gid) ? 0 : KVP_EPERM;
    if (listed(a->uids, a->num_uids, uid))
        return 0;
    for (uint32_t i = 0; gids && i < ngids; i++)
        if (listed(a->gids, a->num_gids, gids[i]))
            return 0;
    return KVP_EPERM;
}

int kvp_access_pool_check(const kvp_pool_access_t *a, uint32_t uid, uint32_t gid)
{
    if (a->num_uids == 0 && a->num_gids == 0)
        return 0;
    if (uid == 0 || uid == a->self_uid || listed(a->uids, a->num_uids, uid) ||
        listed(a->gids, a->num_gids, gid))
        return 0;
    return KVP_EPERM;
}
