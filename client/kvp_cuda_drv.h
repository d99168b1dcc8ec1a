/*
 * kvp_cuda_drv.h - the CUDA driver functions kvpool needs (the virtual memory API), reached
 * through the runtime's cudaGetDriverEntryPointByVersion and kept in one table filled once per
 * process, plus the VMM steps both sides share (create an exportable allocation, import one
 * from a POSIX fd, map it, free it) and the mapping of CUDA errors onto KVP_E* codes.
 *
 * Nothing in kvpool links libcuda: the runtime is linked statically and finds the driver at
 * run time, so every binary starts on a machine without a driver (CI) and there the table
 * reports KVP_EUNAVAIL. The file lives in client/ because libkvpool needs it and must not
 * depend on server/; kvpoold links it too (the server may use client-layer helpers). It never
 * logs: a failure is described in a kvp_cuda_err_t the caller logs (daemon) or keeps as the
 * handle's last error (libkvpool). Built only with CUDA (KVP_HAVE_CUDA). Not exported from
 * libkvpool.so.
 */
#ifndef KVP_CUDA_DRV_H
#define KVP_CUDA_DRV_H

#include <stddef.h>
#include <stdint.h>

#include <cuda.h> /* types only: every driver call goes through the table */
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

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

/* What went wrong in a CUDA call: "CALL failed: NAME (text) at FILE:LINE". */
typedef struct {
    char msg[320];
} kvp_cuda_err_t;

/*
 * The driver table, loaded on the first call (thread-safe, once per process: the driver is a
 * process-wide resource, so this is the one deliberate global of the CUDA layer). Returns 0
 * and sets *out; KVP_EUNAVAIL when there is no driver or it lacks a function (err, if not NULL,
 * says which; the answer is the same on every later call).
 */
int kvp_cuda_drv_get(const kvp_cuda_drv_t **out, kvp_cuda_err_t *err);

/* KVP_E* code of a driver / runtime error: no driver or device -> KVP_EUNAVAIL, out of
 * memory -> KVP_ENOMEM, an invalid value, handle or device -> KVP_EINVAL, else KVP_EINTERNAL. */
int kvp_cuda_drv_code(CUresult res);
int kvp_cuda_rt_code(cudaError_t res);

/* Fill err (may be NULL) with "call failed: name (text) at file:line" and return the code.
 * Used by the macros below. */
int kvp_cuda_err_drv(kvp_cuda_err_t *err, CUresult res, const char *call, const char *file,
                     int line);
int kvp_cuda_err_rt(kvp_cuda_err_t *err, cudaError_t res, const char *call, const char *file,
                    int line);

/* Check macros for code that records instead of logging: on failure `rc` gets the KVP_E* code,
 * `err` the description, and control goes to `label`. */
#define KVP_CUDRV_TRY(err, call, rc, label)                                                        \
    do {                                                                                           \
        CUresult kvp_res_ = (call);                                                                \
        if (kvp_res_ != CUDA_SUCCESS) {                                                            \
            (rc) = kvp_cuda_err_drv((err), kvp_res_, #call, __FILE__, __LINE__);                   \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

#define KVP_CUDART_TRY(err, call, rc, label)                                                       \
    do {                                                                                           \
        cudaError_t kvp_res_ = (call);                                                             \
        if (kvp_res_ != cudaSuccess) {                                                             \
            (rc) = kvp_cuda_err_rt((err), kvp_res_, #call, __FILE__, __LINE__);                    \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

/* One VMM mapping: a physical allocation handle mapped read/write for one device into an
 * address range reserved for it. Zero-initialise before use; kvp_cuda_vmm_free undoes
 * whatever part of it exists. */
typedef struct {
    CUmemGenericAllocationHandle handle;
    CUdeviceptr ptr; /* 0 while nothing is reserved */
    size_t size;     /* bytes reserved and mapped: a multiple of the granularity */
    int device;      /* the CUDA ordinal that has access */
    unsigned have_handle : 1;
    unsigned mapped : 1;
} kvp_cuda_vmm_t;

/* The granularity kvpool maps with on `device` (the recommended one, a multiple of the
 * minimum): pools, staging buffers and imports are all rounded up to it, so both sides of an
 * fd agree on the size. Returns 0 or a KVP_E* code with err filled. */
int kvp_cuda_vmm_granularity(int device, size_t *out, kvp_cuda_err_t *err);

/* Creates a device allocation of at least size bytes on `device`, exportable as a POSIX fd,
 * and maps it read/write for that device. The caller must have made `device` current
 * (cudaSetDevice). Returns 0 or a code (nothing left behind); free with kvp_cuda_vmm_free. */
int kvp_cuda_vmm_alloc(int device, size_t size, kvp_cuda_vmm_t *m, kvp_cuda_err_t *err);

/* Exports m's allocation as a new POSIX fd (close-on-exec; owned by the caller). */
int kvp_cuda_vmm_export(const kvp_cuda_vmm_t *m, int *fd, kvp_cuda_err_t *err);

/* Imports the allocation behind fd (borrowed: not closed) and maps its first size bytes,
 * rounded up to the granularity, read/write for `device` (made current by the caller).
 * A size larger than the allocation fails cleanly (the map is refused). *location receives
 * the ordinal the memory lives on as the driver reports it (may be NULL). Returns 0 or a
 * code; free with kvp_cuda_vmm_free. */
int kvp_cuda_vmm_import(int fd, int device, size_t size, kvp_cuda_vmm_t *m, int *location,
                        kvp_cuda_err_t *err);

/* Unmaps, releases and frees the address range, in that order; safe on a zeroed or
 * partly built m. Any thread; the memory must no longer be in use by queued GPU work. */
void kvp_cuda_vmm_free(kvp_cuda_vmm_t *m);

#ifdef __cplusplus
}
#endif
#endif
