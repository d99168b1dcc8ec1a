/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_layout.h - where an Append reads K and V in a registered buffer: one struct for the
 * client's request (kvpool.h kvp_source_t), the wire (kvp_wire_source_put / _layout, the only
 * place that names the proto's fields) and the daemon's executor (kvp_backend.h kvp_exec_t).
 * All in bytes: token n, head h of layer l (counted from the Append's layer_begin) reads K at
 * k_offset + l * layer_stride + n * k_stride_n + h * k_stride_h, V likewise.
 *
 * The structs that carry a layout embed it as an anonymous union of the named struct and its
 * fields, so `src.k_offset` and `src.layout` both work and the memory layout is that of the
 * plain fields (the Python package's ctypes mirror depends on it).
 */
#ifndef KVP_LAYOUT_H
#define KVP_LAYOUT_H

#include <stdint.h>

#define KVP_SRC_LAYOUT_FIELDS                                                                      \
    uint64_t k_offset, v_offset;                                                                   \
    uint64_t k_stride_n, k_stride_h, v_stride_n, v_stride_h;                                       \
    uint64_t layer_stride

typedef struct {
    KVP_SRC_LAYOUT_FIELDS;
} kvp_src_layout_t;

/* Its fields as an array (all uint64_t, no padding between them), for checks that treat every
 * offset and stride alike. */
#define KVP_SRC_LAYOUT_WORDS 7
static inline const uint64_t *kvp_src_layout_words(const kvp_src_layout_t *l)
{
    return &l->k_offset;
}
#ifdef __cplusplus /* an installed header: C++ programs include it through kvpool.h */
static_assert(sizeof(kvp_src_layout_t) == KVP_SRC_LAYOUT_WORDS * sizeof(uint64_t),
              "kvp_src_layout_t is its uint64_t fields, nothing else");
#else
_Static_assert(sizeof(kvp_src_layout_t) == KVP_SRC_LAYOUT_WORDS * sizeof(uint64_t),
               "kvp_src_layout_t is its uint64_t fields, nothing else");
#endif

/* The member a struct embeds: `KVP_SRC_LAYOUT_MEMBER;` gives it .layout and the fields. */
#define KVP_SRC_LAYOUT_MEMBER                                                                      \
    union {                                                                                        \
        kvp_src_layout_t layout;                                                                   \
        struct {                                                                                   \
            KVP_SRC_LAYOUT_FIELDS;                                                                 \
        };                                                                                         \
    }

#endif
