/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_ns.c - namespace table and leases (see kvp_ns.h): a linear table of max_namespaces
 * slots, looked up by name on Hello only (the hot calls carry the session's namespace id).
 */
#include "kvp_ns.h"

#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"

int kvp_ns_table_init(kvp_ns_table_t *t, uint32_t max_namespaces)
{
    memset(t, 0, sizeof(*t));
    if (max_namespaces == 0)
        return KVP_EINVAL;
    t->ns = calloc(max_namespaces, sizeof(*t->ns));
    if (!t->ns)
        return KVP_ENOMEM;
    t->max = max_namespaces;
    return 0;
}

void kvp_ns_table_free(kvp_ns_table_t *t)
{
    if (!t->ns)
        return;
    free(t->ns);
    t->ns = NULL;
}

int kvp_ns_attach(kvp_ns_table_t *t, const char *name, uint32_t uid, uint32_t lease_ms,
                  int set_lease, uint32_t *id)
{
    size_t len = name ? strlen(name) : 0;
    if (len == 0 || len > KVP_NS_NAME_MAX)
        return KVP_EINVAL;
    int free_slot = -1;
    for (uint32_t i = 0; i < t->max; i++) {
        kvp_ns_t *n = &t->ns[i];
        if (!n->in_use) {
            if (free_slot < 0)
                free_slot = (int)i;
            continue;
        }
        if (strcmp(n->name, name) == 0) {
            if (n->owner_uid != uid && uid != 0)
                return KVP_EPERM;
            n->sessions++;
            if (set_lease)
                n->lease_ms = lease_ms;
            n->expires_at_ms = 0;
            *id = i;
            return 0;
        }
    }
    if (free_slot < 0)
        return KVP_ELIMIT;
    kvp_ns_t *n = &t->ns[free_slot];
    memset(n, 0, sizeof(*n));
    memcpy(n->name, name, len + 1);
    n->in_use = 1;
    n->owner_uid = uid;
    n->sessions = 1;
    n->lease_ms = lease_ms;
    *id = (uint32_t)free_slot;
    return 0;
}

int kvp_ns_name_valid(const char *name, int allow_empty)
{
    size_t len = 0;
    for (; name[len]; len++) {
        unsigned char ch = (unsigned char)name[len];
        if (len == KVP_NS_NAME_MAX || !((ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') ||
                                        (ch >= '0' && ch <= '9') || strchr("._:@/+-", ch)))
            return 0;
    }
    return len > 0 || allow_empty;
}

int kvp_ns_reserved(const char *name)
{
    return strcmp(name, "default") == 0 || strcmp(name, "kvpoolctl") == 0 ||
           strncmp(name, KVP_NS_RESERVED_PREFIX, strlen(KVP_NS_RESERVED_PREFIX)) == 0;
}

int kvp_ns_find(const kvp_ns_table_t *t, const char *name)
{
    for (uint32_t i = 0; i < t->max; i++)
        if (t->ns[i].in_use && strcmp(t->ns[i].name, name) == 0)
            return (int)i;
    return -1;
}

int kvp_ns_detach(kvp_ns_table_t *t, uint32_t id, uint64_t now_ms)
{
    kvp_ns_t *n = &t->ns[id];
    if (!n->in_use || n->sessions == 0)
        return 0;
    if (--n->sessions)
        return 0;
    if (n->lease_ms == 0)
        return 1;
    n->expires_at_ms = now_ms + n->lease_ms;
    n->idle_seq = ++t->idle_seq;
    return 0;
}

int kvp_ns_next_expired(kvp_ns_table_t *t, uint64_t now_ms)
{
    for (uint32_t i = 0; i < t->max; i++) {
        kvp_ns_t *n = &t->ns[i];
        if (n->in_use && n->sessions == 0 && n->expires_at_ms && n->expires_at_ms <= now_ms) {
            n->expires_at_ms = 0;
            return (int)i;
        }
    }
    return -1;
}

void kvp_ns_forget(kvp_ns_table_t *t, uint32_t id)
{
    kvp_ns_t *n = &t->ns[id];
    if (!n->in_use || n->sessions)
        return;
    memset(n, 0, sizeof(*n));
}

uint64_t kvp_ns_next_deadline(const kvp_ns_table_t *t)
{
    uint64_t best = UINT64_MAX;
    for (uint32_t i = 0; i < t->max; i++) {
        const kvp_ns_t *n = &t->ns[i];
        if (n->in_use && n->sessions == 0 && n->expires_at_ms && n->expires_at_ms < best)
            best = n->expires_at_ms;
    }
    return best;
}
