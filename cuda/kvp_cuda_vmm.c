/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_cuda_vmm.c - see kvp_cuda_vmm.h: create / export / import / map / free of VMM
 * allocations through the driver table, every call checked with KVP_CU_TRY.
 */
#include "kvp_cuda_vmm.h"

#include <fcntl.h>
#include <stdint.h>
#include <string.h>

static void prop_for(int device, CUmemAllocationProp *prop)
{
    memset(prop, 0, sizeof(*prop));
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = device;
    prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
}

int kvp_cuda_vmm_granularity(int device, size_t *out)
{
    const kvp_cuda_drv_t *d;
    int rc = kvp_cuda_drv_get(&d);
    if (rc)
        return rc;
    CUmemAllocationProp prop;
    prop_for(device, &prop);
    size_t g = 0;
    KVP_CU_TRY(d->cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
               rc, fail);
    if (g == 0)
        return KVP_CUDA_FAIL(KVP_EINTERNAL, "cuMemGetAllocationGranularity",
                             "the driver reports granularity 0 on device %d", device);
    *out = g;
    return 0;
fail:
    return rc;
}

static int round_up(size_t size, size_t g, size_t *out)
{
    if (size == 0 || size > SIZE_MAX - g)
        return KVP_CUDA_FAIL(KVP_EINVAL, "kvp_cuda_vmm", "size %zu cannot be mapped", size);
    *out = (size + g - 1) / g * g;
    return 0;
}

/* Reserves m->size bytes, maps m->handle there and gives m->device read/write access. */
static int map_rw(const kvp_cuda_drv_t *d, kvp_cuda_vmm_t *m, size_t align)
{
    int rc = 0;
    KVP_CU_TRY(d->cuMemAddressReserve(&m->ptr, m->size, align, 0, 0), rc, fail);
    KVP_CU_TRY(d->cuMemMap(m->ptr, m->size, 0, m->handle, 0), rc, fail);
    m->mapped = 1;
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof(acc));
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = m->device;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    KVP_CU_TRY(d->cuMemSetAccess(m->ptr, m->size, &acc, 1), rc, fail);
    return 0;
fail:
    return rc;
}

int kvp_cuda_vmm_alloc(int device, size_t size, kvp_cuda_vmm_t *m)
{
    const kvp_cuda_drv_t *d;
    size_t g;
    int rc;
    memset(m, 0, sizeof(*m));
    if ((rc = kvp_cuda_drv_get(&d)) || (rc = kvp_cuda_vmm_granularity(device, &g)) ||
        (rc = round_up(size, g, &m->size)))
        return rc;
    m->device = device;
    CUmemAllocationProp prop;
    prop_for(device, &prop);
    KVP_CU_TRY(d->cuMemCreate(&m->handle, m->size, &prop, 0), rc, fail);
    m->have_handle = 1;
    if ((rc = map_rw(d, m, g)))
        goto fail;
    return 0;
fail:
    kvp_cuda_vmm_free(m);
    return rc;
}

int kvp_cuda_vmm_export(const kvp_cuda_vmm_t *m, int *fd)
{
    const kvp_cuda_drv_t *d;
    int rc = kvp_cuda_drv_get(&d);
    if (rc)
        return rc;
    if (!m->have_handle)
        return KVP_CUDA_FAIL(KVP_EINVAL, "kvp_cuda_vmm_export", "no allocation to export");
    int out = -1;
    KVP_CU_TRY(d->cuMemExportToShareableHandle(&out, m->handle,
                                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
               rc, fail);
    /* the daemon forks nothing, but a worker might: keep the pool out of its children */
    (void)fcntl(out, F_SETFD, FD_CLOEXEC);
    *fd = out;
    return 0;
fail:
    return rc;
}

int kvp_cuda_vmm_import(int fd, int device, size_t size, kvp_cuda_vmm_t *m, int *location)
{
    const kvp_cuda_drv_t *d;
    size_t g;
    int rc;
    memset(m, 0, sizeof(*m));
    if ((rc = kvp_cuda_drv_get(&d)) || (rc = kvp_cuda_vmm_granularity(device, &g)) ||
        (rc = round_up(size, g, &m->size)))
        return rc;
    if (fd < 0)
        return KVP_CUDA_FAIL(KVP_EINVAL, "kvp_cuda_vmm_import", "no fd to import");
    m->device = device;
    KVP_CU_TRY(d->cuMemImportFromShareableHandle(&m->handle, (void *)(uintptr_t)fd,
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
               rc, fail);
    m->have_handle = 1;
    if (location) {
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof(prop));
        KVP_CU_TRY(d->cuMemGetAllocationPropertiesFromHandle(&prop, m->handle), rc, fail);
        *location = prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE ? prop.location.id : -1;
    }
    /* cuMemMap refuses a range longer than the allocation: a worker that claimed more than it
     * exported gets a clean error here rather than a fault later */
    if ((rc = map_rw(d, m, g)))
        goto fail;
    return 0;
fail:
    kvp_cuda_vmm_free(m);
    return rc;
}

void kvp_cuda_vmm_free(kvp_cuda_vmm_t *m)
{
    const kvp_cuda_drv_t *d;
    if (!m || !(d = kvp__cuda_drv_table()))
        return;
    /* teardown: a failure has no one to report to, and the steps must all be tried */
    if (m->mapped)
        (void)d->cuMemUnmap(m->ptr, m->size);
    if (m->have_handle)
        (void)d->cuMemRelease(m->handle);
    if (m->ptr)
        (void)d->cuMemAddressFree(m->ptr, m->size);
    memset(m, 0, sizeof(*m));
}
