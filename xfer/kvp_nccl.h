/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_nccl.h - NCCL loaded at run time (DESIGN.md §6): kvpoold never links libnccl. The first
 * kvp_nccl_get() dlopens the library kvp_nccl_set_library named ([tuning] nccl_lib), else
 * "libnccl.so.2", and resolves the handful of entry points transfers use into a function
 * table, as cuda/kvp_cuda_drv.c does for the CUDA driver; without the library (or in a build
 * without CUDA or nccl.h) it answers KVP_EUNAVAIL and the daemon serves everything but
 * transfers, which then answer UNAVAILABLE. nccl.h is included for its types only. Every NCCL
 * call goes through KVP_NCCL_TRY (cuda/kvp_cuda_err.h, with this table's GetErrorString),
 * which records and logs the call, file, line and NCCL's error string and turns the result
 * into a KVP_E* code.
 */
#ifndef KVP_NCCL_H
#define KVP_NCCL_H

#include <stddef.h>

#ifdef KVP_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "kvp_cuda_err.h"

typedef struct {
    int version; /* ncclGetVersion: 22703 for 2.27.3 */
    ncclResult_t (*GetVersion)(int *version);
    ncclResult_t (*GetUniqueId)(ncclUniqueId *id);
    ncclResult_t (*CommInitRankConfig)(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                       ncclConfig_t *config);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t comm, ncclResult_t *async_error);
    ncclResult_t (*CommAbort)(ncclComm_t comm);
    ncclResult_t (*CommDestroy)(ncclComm_t comm);
    ncclResult_t (*Send)(const void *buf, size_t count, ncclDataType_t type, int peer,
                         ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*Recv)(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                         cudaStream_t stream);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    const char *(*GetErrorString)(ncclResult_t result);
    /* optional (NULL when the library lacks them, before 2.19): buffers NCCL can register, so
     * point-to-point within a node copies straight between the two ranks' buffers */
    ncclResult_t (*MemAlloc)(void **ptr, size_t size);
    ncclResult_t (*MemFree)(void *ptr);
    ncclResult_t (*CommRegister)(const ncclComm_t comm, void *buff, size_t size, void **handle);
    ncclResult_t (*CommDeregister)(const ncclComm_t comm, void *handle);
} kvp_nccl_t;

#else
typedef struct kvp_nccl kvp_nccl_t;
#endif

/* Names the library the first kvp_nccl_get loads: a file name (searched as dlopen does) or a
 * path; NULL or "": libnccl.so.2. Call it before any thread calls kvp_nccl_get (kvpoold does at
 * start). Returns 0, KVP_EINVAL (255 bytes or more) or KVP_EBUSY (the library is already
 * loaded, or was tried). A build without NCCL ignores it (0). */
int kvp_nccl_set_library(const char *path);

/* The table, loaded once per process (thread-safe). Returns 0, or KVP_EUNAVAIL (built without
 * NCCL support, library not found, an entry point missing, a version before 2.18), logging
 * why once. why (may be NULL) receives the reason. */
int kvp_nccl_get(const kvp_nccl_t **out, char *why, size_t why_len);

#endif
