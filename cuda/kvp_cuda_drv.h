/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_cuda_drv.h - the CUDA driver functions kvpool needs (the virtual memory API), reached
 * through the runtime's cudaGetDriverEntryPointByVersion and kept in one table filled once per
 * process. The VMM steps built on it are in kvp_cuda_vmm.h, the check macros (KVP_CU_TRY for
 * a call through this table) in kvp_cuda_err.h.
 *
 * Nothing in kvpool links libcuda: the runtime is linked statically and finds the driver at
 * run time, so every binary starts on a machine without a driver (CI) and there the table
 * reports KVP_EUNAVAIL. Part of cuda/, the layer kvpoold, libkvpool and the kernels share; it
 * never logs. Built only with CUDA (KVP_HAVE_CUDA). Not exported from libkvpool.so.
 */
#ifndef KVP_CUDA_DRV_H
#define KVP_CUDA_DRV_H

#include <stddef.h>
#include <stdint.h>

#include <cuda.h> /* types only: every driver call goes through the table */
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "kvp_cuda_err.h"
#include "kvp_error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Driver ABI requested from cudaGetDriverEntryPointByVersion: every function below has kept
 * its signature since (the PFN_*_v* typedefs name the version of each). */
#define KVP_CUDA_DRV_ABI 12000

typedef struct {
    PFN_cuGetErrorName_v6000 cuGetErrorName;
    PFN_cuGetErrorString_v6000 cuGetErrorString;
    PFN_cuDeviceGet_v2000 cuDeviceGet;
    PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute;
    PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity;
    PFN_cuMemCreate_v10020 cuMemCreate;
    PFN_cuMemRelease_v10020 cuMemRelease;
    PFN_cuMemExportToShareableHandle_v10020 cuMemExportToShareableHandle;
    PFN_cuMemImportFromShareableHandle_v10020 cuMemImportFromShareableHandle;
    PFN_cuMemGetAllocationPropertiesFromHandle_v10020 cuMemGetAllocationPropertiesFromHandle;
    PFN_cuMemAddressReserve_v10020 cuMemAddressReserve;
    PFN_cuMemAddressFree_v10020 cuMemAddressFree;
    PFN_cuMemMap_v10020 cuMemMap;
    PFN_cuMemUnmap_v10020 cuMemUnmap;
    PFN_cuMemSetAccess_v10020 cuMemSetAccess;
    PFN_cuMemGetAddressRange_v3020 cuMemGetAddressRange;
} kvp_cuda_drv_t;

/*
 * The driver table, loaded on the first call (thread-safe, once per process: the driver is a
 * process-wide resource, so this is the one deliberate global of the CUDA layer). Returns 0
 * and sets *out; KVP_EUNAVAIL when there is no driver or it lacks a function, with the reason
 * in the calling thread's record (kvp_cuda_last_error), not handed to the log hook: no driver
 * is an answer, which the caller reports as it sees fit. The answer is the same on every call.
 */
int kvp_cuda_drv_get(const kvp_cuda_drv_t **out);

/* The table, or NULL without a driver; records nothing (for kvp_cuda_err.c, which names a
 * driver result while it records a failure). */
const kvp_cuda_drv_t *kvp__cuda_drv_table(void);

#ifdef __cplusplus
}
#endif
#endif
