/*
 * kvp_cuda_drv.c - see kvp_cuda_drv.h: the driver table filled once through
 * cudaGetDriverEntryPointByVersion, the error mapping, and the VMM steps (create / export /
 * import / map / free) shared by kvpoold's cuda backend and libkvpool. No logging here.
 */
#include "kvp_cuda_drv.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

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

int kvp_cuda_drv_get(const kvp_cuda_drv_t **out, kvp_cuda_err_t *err)
{
    pthread_once(&drv_once, load_once);
    if (drv_rc) {
        if (err)
            snprintf(err->msg, sizeof(err->msg), "%s", drv_why);
        return drv_rc;
    }
    *out = &drv_table;
    return 0;
}

int kvp_cuda_drv_code(CUresult res)
{
    switch (res) {
    case CUDA_SUCCESS:
        return 0;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_STUB_LIBRARY:
    case CUDA_ERROR_DEVICE_UNAVAILABLE:
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
    case CUDA_ERROR_SYSTEM_NOT_READY:
        return KVP_EUNAVAIL;
    case CUDA_ERROR_OUT_OF_MEMORY:
        return KVP_ENOMEM;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NOT_PERMITTED:
    case CUDA_ERROR_ALREADY_MAPPED:
    case CUDA_ERROR_MAP_FAILED:
        return KVP_EINVAL;
    default:
        return KVP_EINTERNAL;
    }
}

int kvp_cuda_rt_code(cudaError_t res)
{
    switch (res) {
    case cudaSuccess:
        return 0;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorStubLibrary:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorSystemNotReady:
    case cudaErrorCompatNotSupportedOnDevice:
        return KVP_EUNAVAIL;
    case cudaErrorMemoryAllocation:
        return KVP_ENOMEM;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorMapBufferObjectFailed:
    case cudaErrorAlreadyMapped:
    case cudaErrorNotSupported:
        return KVP_EINVAL;
    default:
        return KVP_EINTERNAL;
    }
}

int kvp_cuda_err_drv(kvp_cuda_err_t *err, CUresult res, const char *call, const char *file,
                     int line)
{
    if (err) {
        const char *name = NULL, *text = NULL;
        const kvp_cuda_drv_t *d;
        if (kvp_cuda_drv_get(&d, NULL) == 0) {
            if (d->cuGetErrorName(res, &name) != CUDA_SUCCESS)
                name = NULL;
            if (d->cuGetErrorString(res, &text) != CUDA_SUCCESS)
                text = NULL;
        }
        char num[32];
        snprintf(num, sizeof(num), "CUresult %d", (int)res);
        snprintf(err->msg, sizeof(err->msg), "%s failed: %s (%s) at %s:%d", call, name ? name : num,
                 text ? text : "no description", file, line);
    }
    return kvp_cuda_drv_code(res);
}

int kvp_cuda_err_rt(kvp_cuda_err_t *err, cudaError_t res, const char *call, const char *file,
                    int line)
{
    /* clear this thread's last-error slot, or a later launch check (cudaGetLastError) would
     * report this failure again; a sticky error stays whatever we do */
    (void)cudaGetLastError();
    if (err)
        snprintf(err->msg, sizeof(err->msg), "%s failed: %s (%s) at %s:%d", call,
                 cudaGetErrorName(res), cudaGetErrorString(res), file, line);
    return kvp_cuda_rt_code(res);
}

/* ---- VMM ------------------------------------------------------------------------------ */

static void prop_for(int device, CUmemAllocationProp *prop)
{
    memset(prop, 0, sizeof(*prop));
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = device;
    prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}

int kvp_cuda_vmm_granularity(int device, size_t *out, kvp_cuda_err_t *err)
{
    const kvp_cuda_drv_t *d;
    int rc = kvp_cuda_drv_get(&d, err);
    if (rc)
        return rc;
    CUmemAllocationProp prop;
    prop_for(device, &prop);
    size_t g = 0;
    KVP_CUDRV_TRY(err,
                  d->cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                  rc, fail);
    if (g == 0) {
        if (err)
            snprintf(err->msg, sizeof(err->msg), "the driver reports granularity 0");
        return KVP_EINTERNAL;
    }
    *out = g;
    return 0;
fail:
    return rc;
}

static int round_up(size_t size, size_t g, size_t *out, kvp_cuda_err_t *err)
{
    if (size == 0 || size > SIZE_MAX - g) {
        if (err)
            snprintf(err->msg, sizeof(err->msg), "size %zu cannot be mapped", size);
        return KVP_EINVAL;
    }
    *out = (size + g - 1) / g * g;
    return 0;
}

/* Reserves m->size bytes, maps m->handle there and gives `device` read/write access. */
static int map_rw(const kvp_cuda_drv_t *d, kvp_cuda_vmm_t *m, size_t align, kvp_cuda_err_t *err)
{
    int rc = 0;
    KVP_CUDRV_TRY(err, d->cuMemAddressReserve(&m->ptr, m->size, align, 0, 0), rc, fail);
    KVP_CUDRV_TRY(err, d->cuMemMap(m->ptr, m->size, 0, m->handle, 0), rc, fail);
    m->mapped = 1;
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof(acc));
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = m->device;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    KVP_CUDRV_TRY(err, d->cuMemSetAccess(m->ptr, m->size, &acc, 1), rc, fail);
    return 0;
fail:
    return rc;
}

int kvp_cuda_vmm_alloc(int device, size_t size, kvp_cuda_vmm_t *m, kvp_cuda_err_t *err)
{
    const kvp_cuda_drv_t *d;
    size_t g;
    int rc;
    memset(m, 0, sizeof(*m));
    if ((rc = kvp_cuda_drv_get(&d, err)) || (rc = kvp_cuda_vmm_granularity(device, &g, err)) ||
        (rc = round_up(size, g, &m->size, err)))
        return rc;
    m->device = device;
    CUmemAllocationProp prop;
    prop_for(device, &prop);
    KVP_CUDRV_TRY(err, d->cuMemCreate(&m->handle, m->size, &prop, 0), rc, fail);
    m->have_handle = 1;
    if ((rc = map_rw(d, m, g, err)))
        goto fail;
    return 0;
fail:
    kvp_cuda_vmm_free(m);
    return rc;
}

int kvp_cuda_vmm_export(const kvp_cuda_vmm_t *m, int *fd, kvp_cuda_err_t *err)
{
    const kvp_cuda_drv_t *d;
    int rc = kvp_cuda_drv_get(&d, err);
    if (rc)
        return rc;
    if (!m->have_handle) {
        if (err)
            snprintf(err->msg, sizeof(err->msg), "no allocation to export");
        return KVP_EINVAL;
    }
    int out = -1;
    KVP_CUDRV_TRY(err,
                  d->cuMemExportToShareableHandle(&out, m->handle,
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                  rc, fail);
    /* the daemon forks nothing, but a worker might: keep the pool out of its children */
    (void)fcntl(out, F_SETFD, FD_CLOEXEC);
    *fd = out;
    return 0;
fail:
    return rc;
}

int kvp_cuda_vmm_import(int fd, int device, size_t size, kvp_cuda_vmm_t *m, int *location,
                        kvp_cuda_err_t *err)
{
    const kvp_cuda_drv_t *d;
    size_t g;
    int rc;
    memset(m, 0, sizeof(*m));
    if ((rc = kvp_cuda_drv_get(&d, err)) || (rc = kvp_cuda_vmm_granularity(device, &g, err)) ||
        (rc = round_up(size, g, &m->size, err)))
        return rc;
    if (fd < 0) {
        if (err)
            snprintf(err->msg, sizeof(err->msg), "no fd to import");
        return KVP_EINVAL;
    }
    m->device = device;
    KVP_CUDRV_TRY(err,
                  d->cuMemImportFromShareableHandle(&m->handle, (void *)(uintptr_t)fd,
                                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                  rc, fail);
    m->have_handle = 1;
    if (location) {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof(prop));
        KVP_CUDRV_TRY(err, d->cuMemGetAllocationPropertiesFromHandle(&prop, m->handle), rc, fail);
        *location = prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop.location.id : -1;
    }
    /* cuMemMap refuses a range longer than the allocation: a worker that claimed more than it
     * exported gets a clean error here rather than a fault later */
    if ((rc = map_rw(d, m, g, err)))
        goto fail;
    return 0;
fail:
    kvp_cuda_vmm_free(m);
    return rc;
}

void kvp_cuda_vmm_free(kvp_cuda_vmm_t *m)
{
    const kvp_cuda_drv_t *d;
    if (!m || kvp_cuda_drv_get(&d, NULL))
        return;
    if (m->mapped)
        (void)d->cuMemUnmap(m->ptr, m->size);
    if (m->have_handle)
        (void)d->cuMemRelease(m->handle);
    if (m->ptr)
        (void)d->cuMemAddressFree(m->ptr, m->size);
    memset(m, 0, sizeof(*m));
}
