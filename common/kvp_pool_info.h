/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pool_info.h - the pool as the daemon describes it to a worker (PoolInfo, Hello): one
 * struct, filled by the daemon from its backend (kvp_backend_pool_info), carried by the wire
 * (kvp_wire_pool_info_put / _get, the only place that names the proto's fields) and handed to
 * the worker by libkvpool (kvp_client_pool_info). Strides in elements. The Python package
 * mirrors it with ctypes; its test compares the mirror's size with kvp_client_sizeof's.
 */
#ifndef KVP_POOL_INFO_H
#define KVP_POOL_INFO_H

#include <stdint.h>

#include "kvp_limits.h"

typedef struct {
    uint32_t num_layers, num_pages, page_size, num_kv_heads, head_dim;
    uint32_t dtype;   /* kvp_dtype_t values (1 fp8_e4m3 .. 5 fp32) */
    uint32_t layout;  /* 0 NHD, 1 HND */
    uint32_t storage; /* 0 combined, 1 split */
    uint32_t num_devices;
    uint32_t backend; /* 0 host, 1 cuda */
    uint32_t elem_bytes, heads_per_device;
    uint64_t pool_bytes, layer_bytes, v_offset_bytes;
    int64_t stride_page, stride_n, stride_h;
    uint64_t map_granularity;            /* cuda: VMM granularity of the pool fds */
    int32_t device_ids[KVP_MAX_DEVICES]; /* cuda: ordinal of device i (first num_devices) */
} kvp_pool_info_t;

#endif
