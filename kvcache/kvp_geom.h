/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_geom.h - the geometry of a KV pool and every stride and byte offset derived from it.
 *
 * The geometry is fixed when a pool is created. This file is the single place where the
 * shape of the pool turns into numbers: element size, strides in elements (as FlashInfer's
 * paged_kv_t takes them), per-layer and per-device byte sizes, and the byte offset of any
 * (layer, page, K|V, slot, head). Nothing else in the project computes a stride on its own.
 *
 * Memory order of one device's pool: layers one after another, each `layer_bytes` long.
 * Within a layer, combined storage is one tensor [num_pages, 2, page_size, H, D] (NHD) or
 * [num_pages, 2, H, page_size, D] (HND), K at [:, 0] and V at [:, 1]; split storage is the
 * K tensor [num_pages, page_size, H, D] (or [num_pages, H, page_size, D]) followed by the V
 * tensor of the same shape. With num_devices = G > 1 (tensor parallelism) every device holds
 * the same layout with H/G heads: device g holds heads [g*H/G, (g+1)*H/G).
 *
 * Pure C, no allocation, thread-safe (all functions read only their arguments).
 */
#ifndef KVP_GEOM_H
#define KVP_GEOM_H

#include <stddef.h>
#include <stdint.h>

#include "kvp_limits.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    KVP_DTYPE_FP8_E4M3 = 1,
    KVP_DTYPE_FP8_E5M2 = 2,
    KVP_DTYPE_FP16 = 3,
    KVP_DTYPE_BF16 = 4,
    KVP_DTYPE_FP32 = 5,
} kvp_dtype_t;

typedef enum {
    KVP_LAYOUT_NHD = 0, /* page: [page_size, H, D] */
    KVP_LAYOUT_HND = 1, /* page: [H, page_size, D] */
} kvp_layout_t;

typedef enum {
    KVP_STORAGE_COMBINED = 0, /* one tensor [num_pages, 2, ...] per layer */
    KVP_STORAGE_SPLIT = 1,    /* a K tensor and a V tensor per layer */
} kvp_storage_t;

/* Bounds every geometry must respect (see kvp_geom_validate). */
#define KVP_GEOM_MAX_LAYERS    4096u
#define KVP_GEOM_MAX_PAGES     0x7fffffffu /* page ids are int32 in the page tables */
#define KVP_GEOM_MAX_PAGE_SIZE 65536u
#define KVP_GEOM_MAX_HEADS     1024u
#define KVP_GEOM_MAX_HEAD_DIM  4096u
#define KVP_GEOM_MAX_DEVICES   KVP_MAX_DEVICES /* common/kvp_limits.h */

typedef struct {
    uint32_t num_layers;
    uint32_t num_pages;
    uint32_t page_size;    /* tokens per page */
    uint32_t num_kv_heads; /* H, over all devices of a tensor-parallel group */
    uint32_t head_dim;     /* D */
    kvp_dtype_t dtype;
    kvp_layout_t layout;
    kvp_storage_t storage;
    uint32_t num_devices; /* G, tensor-parallel group size; 0 is read as 1 */
} kvp_geom_t;

/* Everything derived from a geometry for ONE device's share (H/G heads). Strides are in
 * elements and are the same for the K and the V tensor of a layer. */
typedef struct {
    uint32_t elem_bytes;     /* 1, 2 or 4 */
    uint32_t heads;          /* heads held by one device: H / G */
    uint64_t row_bytes;      /* head_dim * elem_bytes */
    int64_t stride_page;     /* elements from page p to page p+1 */
    int64_t stride_n;        /* elements from slot s to slot s+1 (FlashInfer's stride_n) */
    int64_t stride_h;        /* elements from head h to head h+1 (FlashInfer's stride_h) */
    uint64_t kv_bytes;       /* bytes of one page's K (or V) of one layer: page_size*heads*D*e */
    uint64_t v_offset_bytes; /* bytes from a layer's K base to its V base */
    uint64_t layer_bytes;    /* bytes of one layer, K and V, all pages */
    uint64_t pool_bytes;     /* bytes of the whole pool on one device */
    uint64_t token_bytes;    /* K+V bytes of one token over all layers on one device */
} kvp_geom_derived_t;

/* Checks every field and returns 0 or the KVP_EGEOM_* code of the first bad field, in the
 * order of the struct. When msg is not NULL a one-line explanation naming the field and its
 * value is written there (truncated to msg_len). Derived sizes that overflow give
 * KVP_EGEOM_TOO_LARGE. */
int kvp_geom_validate(const kvp_geom_t *g, char *msg, size_t msg_len);

/* Fills *d for a valid geometry. Returns 0, or the kvp_geom_validate code (and leaves *d
 * untouched) when g is invalid. */
int kvp_geom_derive(const kvp_geom_t *g, kvp_geom_derived_t *d);

/* Element size of a dtype in bytes, 0 for an unknown dtype. */
uint32_t kvp_dtype_size(kvp_dtype_t t);

/* Lower-case names ("fp16", "nhd", "combined") and their parsers. The parsers return 0 and
 * set *out, or KVP_EINVAL for an unknown name. */
const char *kvp_dtype_name(kvp_dtype_t t);
const char *kvp_layout_name(kvp_layout_t l);
const char *kvp_storage_name(kvp_storage_t s);
int kvp_dtype_parse(const char *s, kvp_dtype_t *out);
int kvp_layout_parse(const char *s, kvp_layout_t *out);
int kvp_storage_parse(const char *s, kvp_storage_t *out);

/* Byte offset, from the base of one device's pool, of layer `layer`, page `page`, K (kv = 0)
 * or V (kv = 1), slot `slot`, head `head` (a head index local to the device), element 0.
 * Arguments must be in range (asserted). */
uint64_t kvp_geom_offset(const kvp_geom_derived_t *d, const kvp_geom_t *g, uint32_t layer,
                         uint32_t page, int kv, uint32_t slot, uint32_t head);

/* Byte offset from the pool base to layer `layer`'s K tensor (page 0); its V tensor starts
 * d->v_offset_bytes further. */
uint64_t kvp_geom_layer_offset(const kvp_geom_derived_t *d, uint32_t layer);

/* Number of pages that hold `num_tokens` tokens: ceil(num_tokens / page_size). */
static inline uint32_t kvp_geom_pages_for(uint32_t page_size, uint64_t num_tokens)
{
    return (uint32_t)((num_tokens + page_size - 1) / page_size);
}

#ifdef __cplusplus
}
#endif
#endif
