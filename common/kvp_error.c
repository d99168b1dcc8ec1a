/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_error.c - names for the error codes of kvp_error.h. Pure table lookups; the negated
 * errno range falls through to the C library's strerror names.
 */
#include "kvp_error.h"

#include <string.h>

struct entry {
    int code;
    const char *name;
    const char *text;
};

static const struct entry table[] = {
    {KVP_OK, "KVP_OK", "success"},
    {KVP_EINVAL, "KVP_EINVAL", "invalid argument"},
    {KVP_ENOMEM, "KVP_ENOMEM", "out of host memory"},
    {KVP_ENOSPC, "KVP_ENOSPC", "not enough free pages in the pool"},
    {KVP_ENOENT, "KVP_ENOENT", "no such sequence"},
    {KVP_EEXIST, "KVP_EEXIST", "sequence already exists"},
    {KVP_ELIMIT, "KVP_ELIMIT", "a configured limit would be exceeded"},
    {KVP_ERANGE, "KVP_ERANGE", "value out of range"},
    {KVP_EAUDIT, "KVP_EAUDIT", "audit found a broken invariant"},
    {KVP_EDUPSEQ, "KVP_EDUPSEQ", "sequence appears twice in one batch"},
    {KVP_EBUSY, "KVP_EBUSY", "resource busy"},
    {KVP_EPERM, "KVP_EPERM", "permission denied"},
    {KVP_EUNAVAIL, "KVP_EUNAVAIL", "service unavailable"},
    {KVP_EPRECOND, "KVP_EPRECOND", "failed precondition"},
    {KVP_EINTERNAL, "KVP_EINTERNAL", "internal error"},
    {KVP_ETIMEDOUT, "KVP_ETIMEDOUT", "timed out"},
    {KVP_EPROTO, "KVP_EPROTO", "protocol error"},
    {KVP_ECLOSED, "KVP_ECLOSED", "connection closed"},
    {KVP_EGEOM_NUM_LAYERS, "KVP_EGEOM_NUM_LAYERS", "geometry: num_layers must be 1..4096"},
    {KVP_EGEOM_NUM_PAGES, "KVP_EGEOM_NUM_PAGES", "geometry: num_pages must be 1..2^31-1"},
    {KVP_EGEOM_PAGE_SIZE, "KVP_EGEOM_PAGE_SIZE", "geometry: page_size must be 1..65536"},
    {KVP_EGEOM_NUM_KV_HEADS, "KVP_EGEOM_NUM_KV_HEADS", "geometry: num_kv_heads must be 1..1024"},
    {KVP_EGEOM_HEAD_DIM, "KVP_EGEOM_HEAD_DIM", "geometry: head_dim must be 1..4096"},
    {KVP_EGEOM_DTYPE, "KVP_EGEOM_DTYPE", "geometry: unknown dtype"},
    {KVP_EGEOM_LAYOUT, "KVP_EGEOM_LAYOUT", "geometry: layout must be NHD or HND"},
    {KVP_EGEOM_STORAGE, "KVP_EGEOM_STORAGE", "geometry: storage must be combined or split"},
    {KVP_EGEOM_NUM_DEVICES, "KVP_EGEOM_NUM_DEVICES",
     "geometry: num_devices must be 1..16 and divide num_kv_heads"},
    {KVP_EGEOM_TOO_LARGE, "KVP_EGEOM_TOO_LARGE",
     "geometry: pool bytes overflow 64 bits or token capacity overflows int32"},
    {KVP_EGEOM_NULL, "KVP_EGEOM_NULL", "geometry: none given"},
};

static const struct entry *find(int code)
{
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        if (table[i].code == code)
            return &table[i];
    return NULL;
}

const char *kvp_strerror(int code)
{
    const struct entry *e = find(code);
    if (e)
        return e->text;
    if (code < 0 && code > -4096)
        return strerror(-code);
    return "unknown error";
}

const char *kvp_errname(int code)
{
    const struct entry *e = find(code);
    if (e)
        return e->name;
#ifdef _GNU_SOURCE
    if (code < 0 && code > -4096 && strerrorname_np(-code))
        return strerrorname_np(-code);
#endif
    return code < 0 && code > -4096 ? "ERRNO" : "UNKNOWN";
}
