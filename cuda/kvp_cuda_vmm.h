/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_cuda_vmm.h - the CUDA virtual-memory steps kvpoold and libkvpool share: the granularity
 * both sides round to, an exportable device allocation mapped read/write, its export as a
 * POSIX fd, the import and mapping of such an fd, and the teardown. The pool (daemon), the
 * worker's view of it (libkvpool), staging buffers (libkvpool) and the daemon's view of them
 * are all made with these, so the two sides of an fd cannot disagree on sizes or flags.
 *
 * Each function returns 0 or a KVP_E* code; on failure the calling thread's record
 * (kvp_cuda_last_error) says which call failed where, and the log hook has seen it. The caller
 * owns the kvp_cuda_vmm_t. Built only with CUDA (KVP_HAVE_CUDA). Not exported from
 * libkvpool.so.
 */
#ifndef KVP_CUDA_VMM_H
#define KVP_CUDA_VMM_H

#include <stddef.h>

#include "kvp_cuda_drv.h"

#ifdef __cplusplus
extern "C" {
#endif

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
 * fd agree on the size. */
int kvp_cuda_vmm_granularity(int device, size_t *out);

/* Creates a device allocation of at least size bytes on `device`, exportable as a POSIX fd,
 * and maps it read/write for that device. The caller must have made `device` current
 * (cudaSetDevice). Nothing is left behind on failure; free with kvp_cuda_vmm_free. */
int kvp_cuda_vmm_alloc(int device, size_t size, kvp_cuda_vmm_t *m);

/* Exports m's allocation as a new POSIX fd (close-on-exec; owned by the caller). */
int kvp_cuda_vmm_export(const kvp_cuda_vmm_t *m, int *fd);

/* Imports the allocation behind fd (borrowed: not closed) and maps its first size bytes,
 * rounded up to the granularity, read/write for `device` (made current by the caller).
 * A size larger than the allocation fails cleanly (the map is refused). *location receives
 * the ordinal the memory lives on as the driver reports it (may be NULL). Free with
 * kvp_cuda_vmm_free. */
int kvp_cuda_vmm_import(int fd, int device, size_t size, kvp_cuda_vmm_t *m, int *location);

/* Unmaps, releases and frees the address range, in that order; safe on NULL, a zeroed or a
 * partly built m. Any thread; the memory must no longer be in use by queued GPU work. */
void kvp_cuda_vmm_free(kvp_cuda_vmm_t *m);

#ifdef __cplusplus
}
#endif
#endif
