/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_common.c - what every backend shares: the pool as workers are told of it, the
 * kernels' views of the pool and of an append's source, the page-mover's checks and its
 * split of a packed range into per-layer pieces, the host tier's slot size and the slot
 * mover's checks. No backend state of its own; a backend's file
 * holds only what differs (where the pool lives, which kernels run).
 */
#include <string.h>

#include "kvp_backend.h"
#include "kvp_backend_internal.h"
#include "kvp_error.h"

void kvp_backend_layer_view(const kvp_backend_t *b, void *pool_base, uint32_t layer,
                            kvp_paged_kv_t *kv)
{
    const kvp_geom_derived_t *d = &b->derived;
    memset(kv, 0, sizeof(*kv));
    kv->k_data = (uint8_t *)pool_base + kvp_geom_layer_offset(d, layer);
    kv->v_data = (uint8_t *)kv->k_data + d->v_offset_bytes;
    kv->elem_bytes = d->elem_bytes;
    kv->num_pages = b->geom.num_pages;
    kv->page_size = b->geom.page_size;
    kv->num_heads = d->heads;
    kv->head_dim = b->geom.head_dim;
    kv->stride_page = d->stride_page;
    kv->stride_n = d->stride_n;
    kv->stride_h = d->stride_h;
}

void kvp_backend_pool_info(const kvp_backend_t *b, kvp_pool_info_t *out)
{
    const kvp_geom_t *g = &b->geom;
    const kvp_geom_derived_t *d = &b->derived;
    *out = (kvp_pool_info_t){.num_layers = g->num_layers,
                             .num_pages = g->num_pages,
                             .page_size = g->page_size,
                             .num_kv_heads = g->num_kv_heads,
                             .head_dim = g->head_dim,
                             .dtype = (uint32_t)g->dtype,
                             .layout = (uint32_t)g->layout,
                             .storage = (uint32_t)g->storage,
                             .num_devices = g->num_devices ? g->num_devices : 1,
                             .backend = b->kind,
                             .elem_bytes = d->elem_bytes,
                             .heads_per_device = d->heads,
                             .pool_bytes = d->pool_bytes,
                             .layer_bytes = d->layer_bytes,
                             .v_offset_bytes = d->v_offset_bytes,
                             .stride_page = d->stride_page,
                             .stride_n = d->stride_n,
                             .stride_h = d->stride_h,
                             .map_granularity = b->map_granularity};
    for (uint32_t i = 0; i < b->num_device_ids && i < KVP_MAX_DEVICES; i++)
        out->device_ids[i] = b->device_ids[i];
}

void kvp_backend_exec_src(const kvp_backend_t *b, const kvp_exec_t *e, const uint8_t *base,
                          kvp_append_src_t *src)
{
    const uint64_t elem = b->derived.elem_bytes;
    *src = (kvp_append_src_t){
        .key = base + e->k_offset,
        .value = base + e->v_offset,
        .k_stride_n = (int64_t)(e->k_stride_n / elem),
        .k_stride_h = (int64_t)(e->k_stride_h / elem),
        .v_stride_n = (int64_t)(e->v_stride_n / elem),
        .v_stride_h = (int64_t)(e->v_stride_h / elem),
    };
}

void kvp_backend_gather_dst(const kvp_backend_t *b, const kvp_gather_t *g, uint32_t layer,
                            uint8_t *dst_base, kvp_gather_dst_t *dst)
{
    const uint64_t elem = b->derived.elem_bytes;
    uint8_t *base = dst_base + (uint64_t)(layer - g->layer_begin) * g->layer_stride;
    *dst = (kvp_gather_dst_t){
        .key = base + g->k_offset,
        .value = base + g->v_offset,
        .k_stride_n = (int64_t)(g->k_stride_n / elem),
        .k_stride_h = (int64_t)(g->k_stride_h / elem),
        .v_stride_n = (int64_t)(g->v_stride_n / elem),
        .v_stride_h = (int64_t)(g->v_stride_h / elem),
    };
}

/* One device's packed layer: every token, that device's heads, K and V. */
static uint64_t layer_bytes(const kvp_backend_t *b, uint32_t num_tokens)
{
    return kvp_kv_packed_layer_bytes(num_tokens, b->derived.heads, b->geom.head_dim,
                                     b->derived.elem_bytes);
}

uint64_t kvp_backend_move_bytes(const kvp_backend_t *b, uint32_t num_tokens)
{
    return (uint64_t)b->geom.num_layers * layer_bytes(b, num_tokens);
}

uint64_t kvp_backend_slot_bytes(const kvp_backend_t *b)
{
    const uint32_t devices = b->geom.num_devices ? b->geom.num_devices : 1;
    return devices * kvp_backend_move_bytes(b, b->geom.page_size);
}

int kvp__backend_slot_move_check(const kvp_backend_t *b, const kvp_slot_move_t *m)
{
    if (!b || !m || (m->dir != KVP_MOVE_OUT && m->dir != KVP_MOVE_IN) || !m->n || !m->pages ||
        !m->slots)
        return KVP_EINVAL;
    for (uint32_t i = 0; i < m->n; i++)
        if (!m->slots[i])
            return KVP_EINVAL;
    for (uint32_t i = 0; i < m->n; i++)
        if (m->pages[i] >= b->geom.num_pages)
            return KVP_ERANGE;
    return 0;
}

int kvp_backend_move_check(const kvp_backend_t *b, const kvp_move_t *m)
{
    if (!b || !m || (m->dir != KVP_MOVE_OUT && m->dir != KVP_MOVE_IN) ||
        (m->buf_medium != KVP_MEDIUM_HOST && m->buf_medium != KVP_MEDIUM_GPU))
        return KVP_EINVAL;
    const uint32_t devices = b->geom.num_devices ? b->geom.num_devices : 1;
    if (m->device >= devices || m->begin > m->end ||
        m->end > kvp_backend_move_bytes(b, m->num_tokens))
        return KVP_EINVAL;
    if (m->begin == m->end)
        return 0;
    if (!m->buf || !m->pages)
        return KVP_EINVAL;
    const uint32_t np =
        (uint32_t)(((uint64_t)m->num_tokens + b->geom.page_size - 1) / b->geom.page_size);
    for (uint32_t i = 0; i < np; i++)
        if (m->pages[i] < 0 || (uint32_t)m->pages[i] >= b->geom.num_pages)
            return KVP_ERANGE;
    return 0;
}

int kvp__backend_move_pieces(const kvp_backend_t *b, const kvp_move_t *m,
                             int (*each)(void *arg, uint32_t layer, uint64_t lo, uint64_t hi,
                                         uint64_t buf_off),
                             void *arg)
{
    const uint64_t lb = layer_bytes(b, m->num_tokens);
    for (uint64_t off = m->begin; off < m->end;) {
        const uint32_t layer = (uint32_t)(off / lb);
        const uint64_t lo = off % lb;
        const uint64_t hi = m->end - off < lb - lo ? lo + (m->end - off) : lb;
        int rc = each(arg, layer, lo, hi, off - m->begin);
        if (rc)
            return rc;
        off += hi - lo;
    }
    return 0;
}
