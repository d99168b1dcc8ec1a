/*
 * kvp_cuda_util.h - the daemon's CUDA check macros (STYLE.md rule 7, NCCL's CUDACHECKGOTO):
 * every runtime or driver call goes through KVP_CUDA_CHECK / KVP_CU_CHECK, which on failure
 * logs the call, file, line and CUDA's error name through kvp_log, turns the error into a
 * KVP_E* code and jumps to an unwind label. The driver functions themselves come from the
 * table of client/kvp_cuda_drv.h (kvpoold never links libcuda). Built only with CUDA.
 */
#ifndef KVP_CUDA_UTIL_H
#define KVP_CUDA_UTIL_H

#include "kvp_cuda_drv.h"

/* Log one failed call at KVP_LOG_ERR ("cuda call failed call=... error=... file=... line=...")
 * and return its KVP_E* code (kvp_cuda_rt_code / kvp_cuda_drv_code). Any thread. */
int kvp_cuda_fail_rt(cudaError_t res, const char *call, const char *file, int line);
int kvp_cuda_fail_drv(CUresult res, const char *call, const char *file, int line);

/* Log a failure a kvp_cuda_drv helper described in err, with what the daemon was doing, and
 * return rc. */
int kvp_cuda_fail_err(int rc, const kvp_cuda_err_t *err, const char *doing);

/* The driver table, logging why it is unavailable the first time (KVP_EUNAVAIL). */
int kvp_cuda_driver(const kvp_cuda_drv_t **out);

#define KVP_CUDA_CHECK(call, rc, label)                                                            \
    do {                                                                                           \
        cudaError_t kvp_res_ = (call);                                                             \
        if (kvp_res_ != cudaSuccess) {                                                             \
            (rc) = kvp_cuda_fail_rt(kvp_res_, #call, __FILE__, __LINE__);                          \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

#define KVP_CU_CHECK(call, rc, label)                                                              \
    do {                                                                                           \
        CUresult kvp_res_ = (call);                                                                \
        if (kvp_res_ != CUDA_SUCCESS) {                                                            \
            (rc) = kvp_cuda_fail_drv(kvp_res_, #call, __FILE__, __LINE__);                         \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

/* For a kernels-library call (kvp_kernels_cuda.h), which returns a KVP_E* code itself. */
#define KVP_KERNEL_CHECK(call, rc, label)                                                          \
    do {                                                                                           \
        int kvp_krc_ = (call);                                                                     \
        if (kvp_krc_ != 0) {                                                                       \
            (rc) = kvp_cuda_fail_kernel(kvp_krc_, #call, __FILE__, __LINE__);                      \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

/* Logs a kernels-library failure (with cudaGetLastError's name when it was a launch error)
 * and returns rc. */
int kvp_cuda_fail_kernel(int rc, const char *call, const char *file, int line);

#endif
