/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_cuda_util.h - the daemon's side of the cuda/ layer: the log hook that sends every
 * failure the check macros record (kvp_cuda_err.h: KVP_CUDA_TRY, KVP_CU_TRY, KVP_LAUNCH_TRY,
 * KVP_KERNEL_TRY, KVP_NCCL_TRY) to kvp_log with its file and line, and the driver table with
 * its unavailability logged once. The macros, the VMM steps and the driver table themselves
 * live in cuda/ (shared with libkvpool and the kernels). Built only with CUDA.
 */
#ifndef KVP_CUDA_UTIL_H
#define KVP_CUDA_UTIL_H

#include "kvp_cuda_drv.h"
#include "kvp_cuda_err.h"
#include "kvp_cuda_vmm.h"

/* Installs kvp_log as the process's CUDA log hook (each failure at KVP_LOG_ERR: "cuda call
 * failed error=\"FILE:LINE CALL: TEXT (NAME)\""). Idempotent, any thread; the cuda backend
 * calls it before its first CUDA call (create, probe), and transfers need that backend. */
void kvp_cuda_log_install(void);

/* The driver table (kvp_cuda_log_install first), logging why it is unavailable the first time
 * at KVP_LOG_INFO (KVP_EUNAVAIL: no GPU is an answer, not an error). */
int kvp_cuda_driver(const kvp_cuda_drv_t **out);

#endif
