/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_cuda_drv.c - see kvp_cuda_drv.h: the driver table filled once through
 * cudaGetDriverEntryPointByVersion. No logging here; a missing driver is noted in the calling
 * thread's record (kvp_cuda_err.h).
 */
#include "kvp_cuda_drv.h"

#include <pthread.h>
#include <stdio.h>

static kvp_cuda_drv_t drv_table;
static int drv_rc = KVP_EUNAVAIL;
static char drv_why[200];
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

/* Looks one symbol up; 0, or KVP_EUNAVAIL with drv_why set. */
static int lookup(const char *name, void **fn)
{
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    cudaError_t e =
        cudaGetDriverEntryPointByVersion(name, fn, KVP_CUDA_DRV_ABI, cudaEnableDefault, &q);
    if (e != cudaSuccess) {
        snprintf(drv_why, sizeof(drv_why), "no CUDA driver: %s (%s)", cudaGetErrorName(e),
                 cudaGetErrorString(e));
        return KVP_EUNAVAIL;
    }
    if (q != cudaDriverEntryPointSuccess || !*fn) {
        snprintf(drv_why, sizeof(drv_why), "the CUDA driver lacks %s (ABI %d, query result %d)",
                 name, KVP_CUDA_DRV_ABI, (int)q);
        *fn = NULL;
        return KVP_EUNAVAIL;
    }
    return 0;
}

#define LOOKUP(t, name)                                                                            \
    do {                                                                                           \
        if (lookup(#name, (void **)&(t)->name))                                                    \
            return;                                                                                \
    } while (0)

static void load_once(void)
{
    kvp_cuda_drv_t *t = &drv_table;
    LOOKUP(t, cuGetErrorName);
    LOOKUP(t, cuGetErrorString);
    LOOKUP(t, cuDeviceGet);
    LOOKUP(t, cuDeviceGetAttribute);
    LOOKUP(t, cuMemGetAllocationGranularity);
    LOOKUP(t, cuMemCreate);
    LOOKUP(t, cuMemRelease);
    LOOKUP(t, cuMemExportToShareableHandle);
    LOOKUP(t, cuMemImportFromShareableHandle);
    LOOKUP(t, cuMemGetAllocationPropertiesFromHandle);
    LOOKUP(t, cuMemAddressReserve);
    LOOKUP(t, cuMemAddressFree);
    LOOKUP(t, cuMemMap);
    LOOKUP(t, cuMemUnmap);
    LOOKUP(t, cuMemSetAccess);
    LOOKUP(t, cuMemGetAddressRange);
    drv_rc = 0;
}

int kvp_cuda_drv_get(const kvp_cuda_drv_t **out)
{
    pthread_once(&drv_once, load_once);
    if (drv_rc)
        return kvp__cuda_note(drv_rc, "cudaGetDriverEntryPointByVersion", __FILE__, __LINE__, "%s",
                              drv_why);
    *out = &drv_table;
    return 0;
}

const kvp_cuda_drv_t *kvp__cuda_drv_table(void)
{
    pthread_once(&drv_once, load_once);
    return drv_rc ? NULL : &drv_table;
}
