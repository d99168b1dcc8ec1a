/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_gpu_check.h - the checks of the GPU tests that run worker processes (test_hot_path,
 * test_prefix_gpu): print where and why, exit 1. Include after stdio.h, stdlib.h,
 * cuda_runtime_api.h and kvpool.h.
 */
#ifndef KVP_GPU_CHECK_H
#define KVP_GPU_CHECK_H

/* CK: a CUDA runtime call; KV: a libkvpool call on handle c. */
#define FAIL(...)                                                                                  \
    do {                                                                                           \
        fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                                       \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, "\n");                                                                     \
        exit(1);                                                                                   \
    } while (0)
#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            FAIL("%s: %s", #call, cudaGetErrorString(e_));                                         \
    } while (0)
#define KV(c, call)                                                                                \
    do {                                                                                           \
        int r_ = (call);                                                                           \
        if (r_)                                                                                    \
            FAIL("%s: %s (%s)", #call, kvp_errname(r_), kvp_client_last_error(c));                 \
    } while (0)

#endif
