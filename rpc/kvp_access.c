/* SPDX-License-Identifier: Apache-2.0 */
/* kvp_access.c - the connection policy and the pool-memory policy (see kvp_access.h). */
#include "kvp_access.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_ns.h"

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

#define SCOPE_FAIL(...)                                                                            \
    do {                                                                                           \
        snprintf(why, why_len, __VA_ARGS__);                                                       \
        return KVP_EINVAL;                                                                         \
    } while (0)

int kvp_access_scopes_parse(const char *text, kvp_scope_access_t *out, char *why, unsigned why_len)
{
    kvp_scope_access_t a;
    memset(&a, 0, sizeof(a));
    const char *p = text;
    while (*p) {
        const char *end = strchr(p, ';');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        const char *eq = memchr(p, '=', len);
        if (!eq)
            SCOPE_FAIL("scope entry \"%.*s\": expected name=uid,uid", (int)len, p);
        if (a.count == KVP_ACCESS_MAX_SCOPES)
            SCOPE_FAIL("more than %u scopes", KVP_ACCESS_MAX_SCOPES);
        size_t nl = (size_t)(eq - p);
        char name[65];
        if (nl == 0 || nl >= sizeof(name))
            SCOPE_FAIL("scope name of %zu bytes (1..64)", nl);
        memcpy(name, p, nl);
        name[nl] = 0;
        if (!kvp_ns_name_valid(name, 0))
            SCOPE_FAIL("scope name \"%s\": only [A-Za-z0-9._:@/+-]", name);
        /* the forms KV events give private and unlisted scopes (rpc/kvp_rpc_events.c): a
         * shared scope of such a name would share their block hashes (issue #29) */
        if (!strncmp(name, "ns:", 3) || !strncmp(name, "uid:", 4))
            SCOPE_FAIL("scope name \"%s\": \"ns:\" and \"uid:\" begin the names of private "
                       "and unlisted scopes",
                       name);
        for (uint32_t i = 0; i < a.count; i++)
            if (!strcmp(a.scopes[i].name, name))
                SCOPE_FAIL("scope \"%s\" listed twice", name);
        memcpy(a.scopes[a.count].name, name, nl + 1);
        const char *q = eq + 1, *stop = p + len;
        if (q == stop)
            SCOPE_FAIL("scope \"%s\" names no uid", name);
        while (q < stop) {
            char *e;
            if (*q < '0' || *q > '9')
                SCOPE_FAIL("scope \"%s\": expected a numeric uid", name);
            unsigned long v = strtoul(q, &e, 10);
            if (e > stop || (e < stop && *e != ',') || v > UINT32_MAX - 1)
                SCOPE_FAIL("scope \"%s\": expected comma-separated numeric uids", name);
            if (a.scopes[a.count].num_uids == KVP_ACCESS_MAX_SCOPE_UIDS)
                SCOPE_FAIL("scope \"%s\": more than %u uids", name, KVP_ACCESS_MAX_SCOPE_UIDS);
            a.scopes[a.count].uids[a.scopes[a.count].num_uids++] = (uint32_t)v;
            q = e < stop ? e + 1 : e;
            if (q == stop && e < stop)
                SCOPE_FAIL("scope \"%s\": trailing comma", name);
        }
        a.count++;
        p = end ? end + 1 : p + len;
    }
    a.self_uid = out->self_uid;
    *out = a;
    return 0;
}

int kvp_access_scope_check(const kvp_scope_access_t *a, const char *name, uint32_t uid, int *shared)
{
    for (uint32_t i = 0; i < a->count; i++) {
        if (strcmp(a->scopes[i].name, name))
            continue;
        if (uid != 0 && uid != a->self_uid &&
            !listed(a->scopes[i].uids, a->scopes[i].num_uids, uid))
            return KVP_EPERM;
        *shared = 1;
        return 0;
    }
    *shared = 0;
    return 0;
}
