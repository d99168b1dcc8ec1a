/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_geom.c - geometry validation and the derivation of every stride and offset.
 * See kvp_geom.h for the memory order. Pure functions, no allocation.
 */
#include "kvp_geom.h"

#include <assert.h>
#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "kvp_error.h"

uint32_t kvp_dtype_size(kvp_dtype_t t)
{
    switch (t) {
    case KVP_DTYPE_FP8_E4M3:
    case KVP_DTYPE_FP8_E5M2:
        return 1;
    case KVP_DTYPE_FP16:
    case KVP_DTYPE_BF16:
        return 2;
    case KVP_DTYPE_FP32:
        return 4;
    }
    return 0;
}

static const char *const dtype_names[] = {NULL, "fp8_e4m3", "fp8_e5m2", "fp16", "bf16", "fp32"};
static const char *const layout_names[] = {"nhd", "hnd"};
static const char *const storage_names[] = {"combined", "split"};

const char *kvp_dtype_name(kvp_dtype_t t)
{
    return kvp_dtype_size(t) ? dtype_names[t] : "invalid";
}

const char *kvp_layout_name(kvp_layout_t l)
{
    return (unsigned)l < 2 ? layout_names[l] : "invalid";
}

const char *kvp_storage_name(kvp_storage_t s)
{
    return (unsigned)s < 2 ? storage_names[s] : "invalid";
}

/* Case-insensitive lookup of s in names[first..n). */
static int lookup(const char *s, const char *const *names, int first, int n)
{
    if (!s)
        return -1;
    for (int i = first; i < n; i++) {
        const char *a = s, *b = names[i];
        while (*a && *b && tolower((unsigned char)*a) == *b) {
            a++;
            b++;
        }
        if (!*a && !*b)
            return i;
    }
    return -1;
}

int kvp_dtype_parse(const char *s, kvp_dtype_t *out)
{
    int i = lookup(s, dtype_names, 1, 6);
    if (i < 0 && s && (lookup(s, (const char *const[]){"float16", "half"}, 0, 2) >= 0))
        i = KVP_DTYPE_FP16;
    if (i < 0 && s && lookup(s, (const char *const[]){"bfloat16"}, 0, 1) >= 0)
        i = KVP_DTYPE_BF16;
    if (i < 0 && s && lookup(s, (const char *const[]){"float32", "float"}, 0, 2) >= 0)
        i = KVP_DTYPE_FP32;
    if (i < 0)
        return KVP_EINVAL;
    *out = (kvp_dtype_t)i;
    return 0;
}

int kvp_layout_parse(const char *s, kvp_layout_t *out)
{
    int i = lookup(s, layout_names, 0, 2);
    if (i < 0)
        return KVP_EINVAL;
    *out = (kvp_layout_t)i;
    return 0;
}

int kvp_storage_parse(const char *s, kvp_storage_t *out)
{
    int i = lookup(s, storage_names, 0, 2);
    if (i < 0)
        return KVP_EINVAL;
    *out = (kvp_storage_t)i;
    return 0;
}

static int fail(int code, char *msg, size_t msg_len, const char *fmt, unsigned long long v)
{
    if (msg && msg_len)
        snprintf(msg, msg_len, fmt, v);
    return code;
}

/* a * b into *out, false on 64-bit overflow. */
static int mul_ok(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}

int kvp_geom_validate(const kvp_geom_t *g, char *msg, size_t msg_len)
{
    if (!g)
        return fail(KVP_EGEOM_NULL, msg, msg_len, "no geometry given%.0llu", 0);
    if (g->num_layers < 1 || g->num_layers > KVP_GEOM_MAX_LAYERS)
        return fail(KVP_EGEOM_NUM_LAYERS, msg, msg_len, "num_layers=%llu: must be 1..4096",
                    g->num_layers);
    if (g->num_pages < 1 || g->num_pages > KVP_GEOM_MAX_PAGES)
        return fail(KVP_EGEOM_NUM_PAGES, msg, msg_len, "num_pages=%llu: must be 1..2147483647",
                    g->num_pages);
    if (g->page_size < 1 || g->page_size > KVP_GEOM_MAX_PAGE_SIZE)
        return fail(KVP_EGEOM_PAGE_SIZE, msg, msg_len, "page_size=%llu: must be 1..65536",
                    g->page_size);
    if (g->num_kv_heads < 1 || g->num_kv_heads > KVP_GEOM_MAX_HEADS)
        return fail(KVP_EGEOM_NUM_KV_HEADS, msg, msg_len, "num_kv_heads=%llu: must be 1..1024",
                    g->num_kv_heads);
    if (g->head_dim < 1 || g->head_dim > KVP_GEOM_MAX_HEAD_DIM)
        return fail(KVP_EGEOM_HEAD_DIM, msg, msg_len, "head_dim=%llu: must be 1..4096",
                    g->head_dim);
    if (!kvp_dtype_size(g->dtype))
        return fail(KVP_EGEOM_DTYPE, msg, msg_len,
                    "dtype=%llu: must be fp8_e4m3, fp8_e5m2, fp16, bf16 or fp32",
                    (unsigned long long)g->dtype);
    if ((unsigned)g->layout > KVP_LAYOUT_HND)
        return fail(KVP_EGEOM_LAYOUT, msg, msg_len, "layout=%llu: must be NHD or HND",
                    (unsigned long long)g->layout);
    if ((unsigned)g->storage > KVP_STORAGE_SPLIT)
        return fail(KVP_EGEOM_STORAGE, msg, msg_len, "storage=%llu: must be combined or split",
                    (unsigned long long)g->storage);
    uint32_t devs = g->num_devices ? g->num_devices : 1;
    _Static_assert(KVP_GEOM_MAX_DEVICES == 16, "the messages below say 1..16");
    if (devs > KVP_GEOM_MAX_DEVICES || g->num_kv_heads % devs)
        return fail(KVP_EGEOM_NUM_DEVICES, msg, msg_len,
                    "num_devices=%llu: must be 1..16 (KVP_MAX_DEVICES) and divide "
                    "num_kv_heads",
                    devs);
    /* token capacity must fit int32 positions; bytes must fit uint64 */
    uint64_t tokens, bytes;
    if (!mul_ok(g->num_pages, g->page_size, &tokens) || tokens > 0x7fffffffull)
        return fail(KVP_EGEOM_TOO_LARGE, msg, msg_len,
                    "num_pages*page_size=%llu tokens: must fit in int32",
                    (unsigned long long)g->num_pages * g->page_size);
    if (!mul_ok(tokens, (uint64_t)(g->num_kv_heads / devs) * g->head_dim, &bytes) ||
        !mul_ok(bytes, 2ull * kvp_dtype_size(g->dtype), &bytes) ||
        !mul_ok(bytes, g->num_layers, &bytes))
        return fail(KVP_EGEOM_TOO_LARGE, msg, msg_len, "pool bytes overflow 64 bits%.0llu", 0);
    if (msg && msg_len)
        msg[0] = '\0';
    return 0;
}

int kvp_geom_derive(const kvp_geom_t *g, kvp_geom_derived_t *d)
{
    int rc = kvp_geom_validate(g, NULL, 0);
    if (rc)
        return rc;
    kvp_geom_derived_t r;
    memset(&r, 0, sizeof(r));
    uint32_t devs = g->num_devices ? g->num_devices : 1;
    uint64_t D = g->head_dim, P = g->page_size;
    r.elem_bytes = kvp_dtype_size(g->dtype);
    r.heads = g->num_kv_heads / devs;
    r.row_bytes = D * r.elem_bytes;
    uint64_t page_elems = P * r.heads * D; /* elements of one page's K (or V) */
    if (g->layout == KVP_LAYOUT_NHD) {
        r.stride_n = (int64_t)(r.heads * D);
        r.stride_h = (int64_t)D;
    } else {
        r.stride_n = (int64_t)D;
        r.stride_h = (int64_t)(P * D);
    }
    r.kv_bytes = page_elems * r.elem_bytes;
    if (g->storage == KVP_STORAGE_COMBINED) {
        r.stride_page = (int64_t)(2 * page_elems);
        r.v_offset_bytes = r.kv_bytes;
    } else {
        r.stride_page = (int64_t)page_elems;
        r.v_offset_bytes = r.kv_bytes * g->num_pages;
    }
    r.layer_bytes = 2 * r.kv_bytes * g->num_pages;
    r.pool_bytes = r.layer_bytes * g->num_layers;
    r.token_bytes = 2 * r.heads * r.row_bytes * g->num_layers;
    *d = r;
    return 0;
}

uint64_t kvp_geom_layer_offset(const kvp_geom_derived_t *d, uint32_t layer)
{
    return (uint64_t)layer * d->layer_bytes;
}

uint64_t kvp_geom_offset(const kvp_geom_derived_t *d, const kvp_geom_t *g, uint32_t layer,
                         uint32_t page, int kv, uint32_t slot, uint32_t head)
{
    assert(layer < g->num_layers && page < g->num_pages && slot < g->page_size);
    assert(head < d->heads && (kv == 0 || kv == 1));
    (void)g; /* only the asserts read it */
    uint64_t elems = (uint64_t)page * (uint64_t)d->stride_page +
                     (uint64_t)slot * (uint64_t)d->stride_n +
                     (uint64_t)head * (uint64_t)d->stride_h;
    return kvp_geom_layer_offset(d, layer) + (kv ? d->v_offset_bytes : 0) + elems * d->elem_bytes;
}
