/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_cuda.c - the cuda backend (DESIGN.md §4): each device's pool is one allocation
 * of the CUDA virtual memory API (cuMemCreate, POSIX-fd handle type) mapped into the daemon
 * and exported as an fd that workers map themselves; worker buffers arrive as such fds, as
 * legacy cudaIpcMemHandle_t, or as sealed memfds (pinned with cudaHostRegister and read by the
 * kernels over the bus). run() - two paths on the device's own non-blocking stream, the
 * planner's slots carried inside one launch for a small Append or uploaded with the copies for
 * the rest - is kvp_backend_cuda_run.c's; the state both files share is
 * kvp_backend_cuda_internal.h's.
 *
 * The worker's "ready" event is waited for by the copy thread on the CPU (cudaEventQuery,
 * bounded by READY_TIMEOUT_MS), never by the device's stream: on the H200 a worker killed
 * while the daemon's stream waited on its event left that stream stalled for good, which
 * would stop every namespace on the device (DESIGN.md §8 wants only the dead worker's lease
 * affected), and a stream stalled that way would also hang every call that synchronises the
 * device. The reply goes out only once the copy has completed (the pages it writes stay
 * pinned just that long) and says so (AppendResponse.completed), so no worker needs to wait on
 * our "done" event: its handle is still handed out at RegisterBuffer, but nothing records it
 * any more (one stream operation less per Append, though no gain in its time was measurable),
 * so a wait on it - an older worker's, or kvp_client_cuda_wait_done - is a no-op, and
 * correct, since the answer itself comes after the copy. (Stream memory
 * operations on a flag word both sides map would give the GPU-side wait on the ready event
 * back; the daemon could then release a dead worker's wait by writing the word itself.)
 *
 * Not here: the planner (the dispatch hands run() a validated plan), run() and the kernels. A CUDA
 * error inside run() or a sticky error seen by health() poisons the backend: health() then
 * fails forever and the daemon exits for its service manager to restart it (DESIGN.md §8).
 * Built without CUDA, only the two entry points exist and say "unavailable".
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvp_backend.h"
#include "kvp_backend_internal.h"
#include "kvp_error.h"
#include "kvp_log.h"

#ifdef KVP_HAVE_CUDA

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "kvp_backend_cuda_internal.h"
#include "kvp_cuda_util.h"
#include "kvp_kernels_cuda.h"

void kvp__backend_cuda_poison(cuda_backend_t *cb, const char *why)
{
    if (!atomic_exchange(&cb->poisoned, 1))
        kvp_log(KVP_LOG_CRIT, "cuda backend poisoned reason=\"%s\"; no more work is accepted", why);
}

static int device_index(const cuda_backend_t *cb, int32_t ordinal)
{
    for (uint32_t i = 0; i < cb->num_devices; i++)
        if (cb->dev[i].ordinal == ordinal)
            return (int)i;
    return -1;
}

static int cuda_export(kvp_backend_t *b, int *fds, int max)
{
    cuda_backend_t *cb = (cuda_backend_t *)b;
    if (max < (int)cb->num_devices)
        return KVP_EINVAL;
    for (uint32_t i = 0; i < cb->num_devices; i++)
        fds[i] = cb->dev[i].export_fd;
    return (int)cb->num_devices;
}

/* ---- buffers ---------------------------------------------------------------------------- */

static void buf_free(cuda_backend_t *cb, cuda_buf_t *buf)
{
    int rc = 0;
    if (buf->dev < cb->num_devices)
        KVP_CUDA_TRY(cudaSetDevice(cb->dev[buf->dev].ordinal), rc, unwind);
unwind:
    (void)rc;
    /* no kernel reads it any more: every run waits for its work before it returns, and the
     * dispatch holds a buffer an Append uses until that Append's job is done */
    if (buf->done)
        KVP_CUDA_TRY(cudaEventDestroy(buf->done), rc, ev_ready);
ev_ready:
    if (buf->ready)
        KVP_CUDA_TRY(cudaEventDestroy(buf->ready), rc, ipc);
ipc:
    if (buf->ipc_ptr)
        KVP_CUDA_TRY(cudaIpcCloseMemHandle(buf->ipc_ptr), rc, host);
host:
    if (buf->host_map) {
        KVP_CUDA_TRY(cudaHostUnregister(buf->host_map), rc, host_unmap);
    host_unmap:
        munmap(buf->host_map, buf->host_bytes);
    }
    kvp_cuda_vmm_free(&buf->vmm);
    free(buf);
}

/* Maps a sealed memfd and pins it so the kernels read it directly. */
static int import_memfd(cuda_buf_t *buf, int ordinal, int fd, uint64_t size_bytes)
{
    int rc = 0;
    struct stat st;
    if (fstat(fd, &st) < 0)
        return -errno;
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size < size_bytes)
        return KVP_EINVAL;
    /* a buffer its owner could shrink would fault under the GPU's reads */
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK))
        return KVP_EPERM;
    int ro = 0;
    KVP_CUDA_TRY(cudaDeviceGetAttribute(&ro, cudaDevAttrHostRegisterReadOnlySupported, ordinal), rc,
                 fail);
    long page = sysconf(_SC_PAGESIZE);
    buf->host_bytes = (size_t)((size_bytes + (uint64_t)page - 1) / (uint64_t)page * (uint64_t)page);
    void *p =
        mmap(NULL, buf->host_bytes, ro ? PROT_READ : PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return -errno;
    KVP_CUDA_TRY(cudaHostRegister(p, buf->host_bytes,
                                  cudaHostRegisterMapped | (ro ? cudaHostRegisterReadOnly : 0)),
                 rc, fail_unmap);
    void *d = NULL;
    KVP_CUDA_TRY(cudaHostGetDevicePointer(&d, p, 0), rc, fail_unregister);
    buf->host_map = p;
    buf->dptr = d;
    return 0;
fail_unregister:
    (void)cudaHostUnregister(p); /* best effort on an unwind path: the first error is logged */
fail_unmap:
    munmap(p, buf->host_bytes);
fail:
    return rc;
}

static int import_ipc(cuda_buf_t *buf, const uint8_t *handle, uint64_t size_bytes)
{
    const kvp_cuda_drv_t *drv;
    int rc = kvp_cuda_driver(&drv);
    if (rc)
        return rc;
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof(h));
    void *p = NULL;
    KVP_CUDA_TRY(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), rc, fail);
    buf->ipc_ptr = p;
    CUdeviceptr base = 0;
    size_t range = 0;
    KVP_CU_TRY(drv->cuMemGetAddressRange(&base, &range, (CUdeviceptr)(uintptr_t)p), rc, fail);
    if ((uint64_t)range < size_bytes || base != (CUdeviceptr)(uintptr_t)p) {
        kvp_log(KVP_LOG_WARNING,
                "ipc buffer refused reason=\"claims %llu bytes, the allocation holds %zu\"",
                (unsigned long long)size_bytes, range);
        return KVP_EINVAL; /* buf_free closes the handle */
    }
    buf->dptr = p;
    return 0;
fail:
    return rc;
}

static int cuda_import(kvp_backend_t *b, const kvp_import_req_t *req, kvp_buffer_t *out,
                       uint8_t *done_event_out, uint32_t *done_event_len)
{
    const uint32_t kind = req->kind;
    const int fd = req->fd;
    const uint64_t size_bytes = req->size_bytes;
    const int32_t device = req->device;
    const uint8_t *ipc_handle = req->ipc_handle, *event_handle = req->event_handle;
    const uint32_t ipc_len = req->ipc_len, event_len = req->event_len;
    cuda_backend_t *cb = (cuda_backend_t *)b;
    if (done_event_len)
        *done_event_len = 0;
    if (atomic_load(&cb->poisoned))
        return KVP_EUNAVAIL;
    if (size_bytes == 0 || size_bytes > SIZE_MAX / 2 || !out)
        return KVP_EINVAL;
    if (event_len && (event_len != KVP_BACKEND_IPC_HANDLE_BYTES || !event_handle ||
                      !done_event_out || !done_event_len))
        return KVP_EINVAL;
    switch (kind) {
    case KVP_BUFFER_MEMFD:
    case KVP_BUFFER_CUDA_VMM_FD:
        if (fd < 0)
            return KVP_EINVAL;
        break;
    case KVP_BUFFER_CUDA_IPC:
        if (fd >= 0 || !ipc_handle || ipc_len != KVP_BACKEND_IPC_HANDLE_BYTES)
            return KVP_EINVAL;
        break;
    default:
        return KVP_EINVAL;
    }
    int di = device_index(cb, device);
    if (di < 0 && kind == KVP_BUFFER_MEMFD)
        di = 0; /* host memory: any device of the pool may read it */
    if (di < 0)
        return KVP_EINVAL;
    cuda_buf_t *buf = calloc(1, sizeof(*buf));
    if (!buf)
        return KVP_ENOMEM;
    buf->dev = (uint32_t)di;
    buf->kind = kind;
    out->device_index = (uint32_t)di;
    int rc = 0;
    KVP_CUDA_TRY(cudaSetDevice(cb->dev[di].ordinal), rc, fail);
    if (kind == KVP_BUFFER_MEMFD) {
        if ((rc = import_memfd(buf, cb->dev[di].ordinal, fd, size_bytes)))
            goto fail;
    } else if (kind == KVP_BUFFER_CUDA_IPC) {
        if ((rc = import_ipc(buf, ipc_handle, size_bytes)))
            goto fail;
    } else {
        int location = -1; /* a failure is logged by the hook, with the failing call */
        if ((rc = kvp_cuda_vmm_import(fd, cb->dev[di].ordinal, (size_t)size_bytes, &buf->vmm,
                                      &location)))
            goto fail;
        if (location != cb->dev[di].ordinal)
            kvp_log(KVP_LOG_INFO, "vmm buffer lives on device %d, read from device %d", location,
                    cb->dev[di].ordinal);
        buf->dptr = (const uint8_t *)(uintptr_t)buf->vmm.ptr;
    }
    if (event_len) {
        cudaIpcEventHandle_t eh;
        memcpy(&eh, event_handle, sizeof(eh));
        KVP_CUDA_TRY(cudaIpcOpenEventHandle(&buf->ready, eh), rc, fail);
        KVP_CUDA_TRY(
            cudaEventCreateWithFlags(&buf->done, cudaEventDisableTiming | cudaEventInterprocess),
            rc, fail);
        cudaIpcEventHandle_t dh;
        KVP_CUDA_TRY(cudaIpcGetEventHandle(&dh, buf->done), rc, fail);
        memcpy(done_event_out, &dh, sizeof(dh));
    }
    if (fd >= 0)
        close(fd); /* ours on success; the mapping keeps the memory */
    if (event_len)
        *done_event_len = KVP_BACKEND_IPC_HANDLE_BYTES;
    out->kind = kind;
    out->size_bytes = size_bytes;
    out->host_ptr = NULL;
    out->priv = buf;
    /* device memory is written by a Load (ops->gather); a host memfd is mapped read-only where
     * the device can register it so (and its registration then forbids the GPU's writes) */
    out->writable = kind != KVP_BUFFER_MEMFD;
    return 0;
fail:
    /* a worker's bad handle is a refused request, not a broken backend */
    buf_free(cb, buf);
    return rc == KVP_EINTERNAL ? KVP_EINVAL : rc;
}

static void cuda_release(kvp_backend_t *b, kvp_buffer_t *kb)
{
    cuda_backend_t *cb = (cuda_backend_t *)b;
    if (!kb->priv)
        return;
    buf_free(cb, kb->priv);
    kb->priv = NULL;
}

/* ---- health, destroy, create ------------------------------------------------------------ */

static int cuda_health(kvp_backend_t *b)
{
    cuda_backend_t *cb = (cuda_backend_t *)b;
    if (atomic_load(&cb->poisoned))
        return KVP_EINTERNAL;
    for (uint32_t i = 0; i < cb->num_devices; i++) {
        cuda_dev_t *dv = &cb->dev[i];
        cudaError_t e = cudaStreamQuery(dv->stream);
        if (e != cudaSuccess && e != cudaErrorNotReady) {
            /* a sticky error (illegal address, launch failure, ECC...) poisons the context */
            (void)KVP_CUDA_FAILED(e, "cudaStreamQuery(dv->stream)");
            kvp__backend_cuda_poison(cb, "the device's stream reports an error");
            return KVP_EINTERNAL;
        }
    }
    return 0;
}

static void dev_destroy(cuda_dev_t *dv)
{
    int rc = 0;
    if (dv->stream) {
        KVP_CUDA_TRY(cudaSetDevice(dv->ordinal), rc, sync_done);
        KVP_CUDA_TRY(cudaStreamSynchronize(dv->stream), rc, sync_done);
    }
sync_done:
    if (dv->stage.host)
        KVP_CUDA_TRY(cudaFreeHost(dv->stage.host), rc, stage_done);
stage_done:
    memset(&dv->stage, 0, sizeof(dv->stage));
    if (dv->dev_words) {
        KVP_CUDA_TRY(cudaFreeAsync(dv->dev_words, dv->stream), rc, stream);
        KVP_CUDA_TRY(cudaStreamSynchronize(dv->stream), rc, stream);
    }
stream:
    if (dv->stream)
        KVP_CUDA_TRY(cudaStreamDestroy(dv->stream), rc, pool);
pool:
    if (dv->export_fd >= 0)
        close(dv->export_fd);
    kvp_cuda_vmm_free(&dv->pool);
    if (dv->lock_ready)
        pthread_mutex_destroy(&dv->lock);
    (void)rc;
}

static void cuda_destroy(kvp_backend_t *b)
{
    cuda_backend_t *cb = (cuda_backend_t *)b;
    if (!cb)
        return;
    kvp__backend_cuda_slots_free(cb);
    for (uint32_t i = cb->num_devices; i-- > 0;)
        dev_destroy(&cb->dev[i]);
    free(cb->dev);
    free(cb);
}

/* Commit events: the worker's interprocess event, opened on the pool's first device (an IPC
 * event handle opens in any context of the machine). cudaEventQuery never blocks, so the loop
 * thread may poll it. */
static int cuda_event_open(kvp_backend_t *b, const uint8_t *handle, uint32_t len, void **ev)
{
    cuda_backend_t *cb = (cuda_backend_t *)b;
    int rc = 0;
    cudaIpcEventHandle_t eh;
    cudaEvent_t e = NULL;
    if (len != sizeof(eh))
        return KVP_EINVAL;
    memcpy(&eh, handle, sizeof(eh));
    KVP_CUDA_TRY(cudaSetDevice(cb->dev[0].ordinal), rc, fail);
    KVP_CUDA_TRY(cudaIpcOpenEventHandle(&e, eh), rc, fail);
    *ev = e;
    return 0;
fail:
    (void)rc;
    return KVP_EINVAL;
}

static int cuda_event_query(kvp_backend_t *b, void *ev)
{
    (void)b;
    cudaError_t e = cudaEventQuery((cudaEvent_t)ev);
    if (e == cudaSuccess)
        return 1;
    if (e == cudaErrorNotReady)
        return 0;
    return KVP_CUDA_FAILED(e, "cudaEventQuery(commit event)");
}

static void cuda_event_close(kvp_backend_t *b, void *ev)
{
    (void)b;
    if (ev)
        (void)cudaEventDestroy((cudaEvent_t)ev);
}

static const kvp_backend_ops_t cuda_ops = {
    .name = "cuda",
    .event_open = cuda_event_open,
    .event_query = cuda_event_query,
    .event_close = cuda_event_close,
    .export_fds = cuda_export,
    .import_buffer = cuda_import,
    .release_buffer = cuda_release,
    .run = kvp__backend_cuda_run,
    .move = kvp__backend_cuda_move,
    .move_slots = kvp__backend_cuda_move_slots,
    .gather = kvp__backend_cuda_gather,
    .health = cuda_health,
    .destroy = cuda_destroy,
};

/* Whether `ordinal` can hold an exportable VMM pool and stream-ordered allocations. */
static int device_ok(const kvp_cuda_drv_t *drv, int ordinal)
{
    int rc = 0, vmm = 0, posix = 0, pools = 0;
    CUdevice cu;
    KVP_CU_TRY(drv->cuDeviceGet(&cu, ordinal), rc, fail);
    KVP_CU_TRY(drv->cuDeviceGetAttribute(
                   &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cu),
               rc, fail);
    KVP_CU_TRY(drv->cuDeviceGetAttribute(
                   &posix, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, cu),
               rc, fail);
    KVP_CUDA_TRY(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, ordinal), rc,
                 fail);
    if (!vmm || !posix || !pools) {
        kvp_log(KVP_LOG_ERR,
                "cuda device unsuitable device=%d vmm=%d posix_fd_export=%d memory_pools=%d",
                ordinal, vmm, posix, pools);
        return KVP_EUNAVAIL;
    }
    return 0;
fail:
    return rc;
}

/* Stream, kernels, pool (created, exported, zeroed) and staging of one device. */
static int dev_create(cuda_dev_t *dv, size_t map_bytes)
{
    int rc = 0;
    KVP_CUDA_TRY(cudaSetDevice(dv->ordinal), rc, fail);
    KVP_CUDA_TRY(cudaStreamCreateWithFlags(&dv->stream, cudaStreamNonBlocking), rc, fail);
    /* eager loading before any cross-stream wait can be queued (DESIGN.md §4) */
    KVP_KERNEL_TRY(kvp_cuda_kernels_preload(), rc, fail);
    if ((rc = kvp_cuda_vmm_alloc(dv->ordinal, map_bytes, &dv->pool)) ||
        (rc = kvp_cuda_vmm_export(&dv->pool, &dv->export_fd)))
        goto fail;
    KVP_CUDA_TRY(cudaMemsetAsync((void *)(uintptr_t)dv->pool.ptr, 0, dv->pool.size, dv->stream), rc,
                 fail);
    if ((rc = kvp__backend_cuda_dev_reserve(dv, STAGE_MIN_BYTES)))
        goto fail;
    KVP_CUDA_TRY(cudaStreamSynchronize(dv->stream), rc, fail);
    return 0;
fail:
    return rc;
}

int kvp_backend_cuda_create(const kvp_geom_t *g, const int *devices, int num_devices,
                            const kvp_backend_tuning_t *tuning, kvp_backend_t **out)
{
    const kvp_backend_tuning_t defaults = {0};
    if (!tuning)
        tuning = &defaults;
    if (!g || !devices || !out || num_devices < 1 || num_devices > (int)KVP_GEOM_MAX_DEVICES ||
        (uint32_t)num_devices != (g->num_devices ? g->num_devices : 1) ||
        tuning->ready_timeout_ms > 3600000u || kvp_append_cuda_opts_check(&tuning->append) ||
        tuning->pack_blocks > KVP_PACK_CUDA_MAX_BLOCKS)
        return KVP_EINVAL;
    kvp_geom_derived_t derived;
    int rc = kvp_geom_derive(g, &derived);
    if (rc)
        return rc;
    if (derived.row_bytes % 16) {
        kvp_log(KVP_LOG_ERR,
                "cuda pool refused reason=\"a row (head_dim * elem_bytes = %llu bytes) must be a "
                "multiple of 16 bytes for the cuda kernels\"",
                (unsigned long long)derived.row_bytes);
        return KVP_EINVAL;
    }
    const kvp_cuda_drv_t *drv;
    if ((rc = kvp_cuda_driver(&drv)))
        return rc;
    int count = 0;
    KVP_CUDA_TRY(cudaGetDeviceCount(&count), rc, fail_early);
    if (count < 1)
        return KVP_EUNAVAIL;
    for (int i = 0; i < num_devices; i++) {
        for (int j = 0; j < i; j++)
            if (devices[j] == devices[i])
                return KVP_EINVAL;
        if (devices[i] < 0 || devices[i] >= count) {
            kvp_log(KVP_LOG_ERR, "cuda pool refused reason=\"no device %d (%d visible)\"",
                    devices[i], count);
            return KVP_EINVAL;
        }
        if ((rc = device_ok(drv, devices[i])))
            return rc;
    }

    cuda_backend_t *cb = calloc(1, sizeof(*cb));
    if (!cb)
        return KVP_ENOMEM;
    cb->dev = calloc((size_t)num_devices, sizeof(*cb->dev));
    if (!cb->dev) {
        free(cb);
        return KVP_ENOMEM;
    }
    cb->base.ops = &cuda_ops;
    cb->base.geom = *g;
    cb->base.derived = derived;
    cb->base.kind = KVP_BACKEND_CUDA;
    cb->base.src_align_bytes = 16;
    atomic_init(&cb->poisoned, 0);
    cb->base.tuning = *tuning;
    cb->ready_timeout_ms = tuning->ready_timeout_ms ? tuning->ready_timeout_ms : READY_TIMEOUT_MS;
    cb->plan_upload = tuning->plan_upload;
    for (int i = 0; i < num_devices; i++) {
        cb->dev[i].ordinal = devices[i];
        cb->dev[i].export_fd = -1;
        cb->base.device_ids[i] = devices[i];
        cb->base.num_device_ids = (uint32_t)i + 1;
        if (pthread_mutex_init(&cb->dev[i].lock, NULL)) {
            rc = KVP_ENOMEM;
            goto fail;
        }
        cb->dev[i].lock_ready = 1;
        cb->num_devices++;
    }
    /* one granularity for every device, so each fd maps with the same size */
    size_t gran = 0;
    for (uint32_t i = 0; i < cb->num_devices; i++) {
        size_t gi;
        if ((rc = kvp_cuda_vmm_granularity(cb->dev[i].ordinal, &gi)))
            goto fail;
        gran = gi > gran ? gi : gran;
    }
    if (derived.pool_bytes > SIZE_MAX - gran) {
        rc = KVP_EGEOM_TOO_LARGE;
        goto fail;
    }
    cb->base.map_granularity = gran;
    cb->base.map_bytes = (derived.pool_bytes + gran - 1) / gran * gran;
    for (uint32_t i = 0; i < cb->num_devices; i++)
        if ((rc = dev_create(&cb->dev[i], (size_t)cb->base.map_bytes)))
            goto fail;
    kvp_log(KVP_LOG_INFO,
            "pool created backend=cuda bytes=%llu mapped_bytes=%llu granularity=%llu pages=%u "
            "layers=%u devices=%u",
            (unsigned long long)derived.pool_bytes, (unsigned long long)cb->base.map_bytes,
            (unsigned long long)gran, g->num_pages, g->num_layers, cb->num_devices);
    *out = &cb->base;
    return 0;
fail:
    cuda_destroy(&cb->base);
    return rc;
fail_early:
    return rc;
}

int kvp_backend_cuda_device(const kvp_backend_t *b, uint32_t g, int *ordinal, void **pool_base)
{
    if (!b || b->ops != &cuda_ops)
        return KVP_EUNAVAIL;
    const cuda_backend_t *cb = (const cuda_backend_t *)b;
    if (g >= cb->num_devices)
        return KVP_EUNAVAIL;
    *ordinal = cb->dev[g].ordinal;
    *pool_base = (void *)(uintptr_t)cb->dev[g].pool.ptr;
    return 0;
}

int kvp_backend_cuda_probe(void)
{
    const kvp_cuda_drv_t *drv;
    if (kvp_cuda_driver(&drv))
        return 0;
    int count = 0;
    /* a failure here is the answer "no GPU", not an error: not logged as one */
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        kvp_log(KVP_LOG_INFO, "cuda unavailable reason=\"cudaGetDeviceCount: %s\"",
                cudaGetErrorName(e));
        return 0;
    }
    return count > 0;
}

#else /* !KVP_HAVE_CUDA */

int kvp_backend_cuda_create(const kvp_geom_t *g, const int *devices, int num_devices,
                            const kvp_backend_tuning_t *tuning, kvp_backend_t **out)
{
    (void)g, (void)devices, (void)num_devices, (void)tuning, (void)out;
    kvp_log(KVP_LOG_ERR, "cuda backend unavailable reason=\"built without CUDA\"");
    return KVP_EUNAVAIL;
}

int kvp_backend_cuda_probe(void)
{
    return 0;
}

int kvp_backend_cuda_device(const kvp_backend_t *b, uint32_t g, int *ordinal, void **pool_base)
{
    (void)b, (void)g, (void)ordinal, (void)pool_base;
    return KVP_EUNAVAIL;
}

#endif
