/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_cuda.c - the cuda backend (DESIGN.md §4): each device's pool is one allocation
 * of the CUDA virtual memory API (cuMemCreate, POSIX-fd handle type) mapped into the daemon
 * and exported as an fd that workers map themselves; worker buffers arrive as such fds, as
 * legacy cudaIpcMemHandle_t, or as sealed memfds (pinned with cudaHostRegister and read by the
 * kernels over the bus). run() has two paths on the device's own non-blocking stream: a small
 * Append (no copy-on-write copies, at most KVP_APPEND_SLOTS_MAX tokens: every decode step) is
 * one launch of kvp_append_slots_cuda over all its layers, with each token's slot computed
 * here and carried inside the launch; anything else uploads its plan through pinned staging
 * and runs the page copies and the per-layer append kernels, with an error word read back.
 * The worker's data is ordered before the copy by its interprocess "ready" event.
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
 * Not here: the planner (the dispatch hands run() a validated plan) and the kernels. A CUDA
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
#include "kvp_error.h"
#include "kvp_log.h"

#ifdef KVP_HAVE_CUDA

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "kvp_cuda_util.h"
#include "kvp_kernels_cuda.h"

#define STAGE_MIN_BYTES (64u << 10) /* first size of a staging slot and the device copy */
/* Longest wait for a worker's ready event (SYNC_EVENT) by default; tuning.ready_timeout_ms
 * ([tuning] cuda_ready_timeout_ms) overrides it when the backend is created (tests use a short
 * one). */
#define READY_TIMEOUT_MS 30000

/* Pinned host staging for one run's plan arrays. One per device is enough: a run holds the
 * device's lock and waits for its stream before it returns, so the next run finds the upload
 * and the error-word read-back of the previous one done. */
typedef struct {
    int32_t *host;
    size_t cap_bytes;
    size_t err_word; /* index of the run's error word in host[] */
} stage_t;

typedef struct {
    int ordinal;
    kvp_cuda_vmm_t pool;
    int export_fd;
    cudaStream_t stream;
    pthread_mutex_t lock; /* everything below, and the order of work on stream */
    int lock_ready;
    stage_t stage;
    int32_t *dev_words; /* the plan arrays on the device: stream-ordered, so one suffices */
    size_t dev_cap_bytes;
} cuda_dev_t;

typedef struct {
    kvp_backend_t base;
    uint32_t num_devices;
    cuda_dev_t *dev;
    atomic_int poisoned;
    uint64_t ready_timeout_ms;
    int plan_upload; /* tuning.plan_upload: every Append uploads its plan and runs the
                        page-table kernels (the path of batches over KVP_APPEND_SLOTS_MAX or with
                        copies), to compare the two in one build */
} cuda_backend_t;

/* A worker buffer as the daemon holds it (kvp_buffer_t.priv). */
typedef struct {
    uint32_t dev; /* index into cuda_backend_t.dev */
    uint32_t kind;
    kvp_cuda_vmm_t vmm;  /* BUFFER_CUDA_VMM_FD */
    void *ipc_ptr;       /* BUFFER_CUDA_IPC: from cudaIpcOpenMemHandle */
    void *host_map;      /* BUFFER_MEMFD: the mapping, registered with CUDA */
    size_t host_bytes;   /* its length */
    const uint8_t *dptr; /* where the kernels read */
    cudaEvent_t ready;   /* the worker's interprocess event, NULL if none */
    cudaEvent_t done;    /* ours, interprocess, NULL if none: handed out, never recorded */
} cuda_buf_t;

static void poison(cuda_backend_t *cb, const char *why)
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

/* ---- run -------------------------------------------------------------------------------- */

/* The kernels move 16-byte vectors: a source they would refuse is refused here first, before
 * anything is queued (the dispatch checks only element alignment). */
static int check_source_align(const cuda_buf_t *buf, const kvp_exec_t *e)
{
    if ((uintptr_t)buf->dptr % 16)
        return KVP_EINVAL;
    const uint64_t *v = kvp_src_layout_words(&e->layout);
    for (int i = 0; i < KVP_SRC_LAYOUT_WORDS; i++)
        if (v[i] % 16)
            return KVP_EINVAL;
    return 0;
}

/* Makes the slot hold at least bytes (its previous run is known to be finished). */
static int stage_reserve(stage_t *st, size_t bytes)
{
    int rc = 0;
    if (st->cap_bytes >= bytes)
        return 0;
    size_t cap = st->cap_bytes ? 2 * st->cap_bytes : STAGE_MIN_BYTES;
    while (cap < bytes)
        cap *= 2;
    /* rare (doubling); cudaFreeHost may wait for the device */
    if (st->host)
        KVP_CUDA_TRY(cudaFreeHost(st->host), rc, fail);
    st->host = NULL;
    st->cap_bytes = 0;
    KVP_CUDA_TRY(cudaHostAlloc((void **)&st->host, cap, cudaHostAllocDefault), rc, fail);
    st->cap_bytes = cap;
    return 0;
fail:
    return rc;
}

/* Makes the device copy hold at least bytes, in stream order (no synchronisation). */
static int dev_reserve(cuda_dev_t *dv, size_t bytes)
{
    int rc = 0;
    if (dv->dev_cap_bytes >= bytes)
        return 0;
    size_t cap = dv->dev_cap_bytes ? 2 * dv->dev_cap_bytes : STAGE_MIN_BYTES;
    while (cap < bytes)
        cap *= 2;
    if (dv->dev_words)
        KVP_CUDA_TRY(cudaFreeAsync(dv->dev_words, dv->stream), rc, fail);
    dv->dev_words = NULL;
    dv->dev_cap_bytes = 0;
    KVP_CUDA_TRY(cudaMallocAsync((void **)&dv->dev_words, cap, dv->stream), rc, fail);
    dv->dev_cap_bytes = cap;
    return 0;
fail:
    return rc;
}

/* Reads a finished run's error word; non-zero poisons. */
static int stage_check(cuda_backend_t *cb, const stage_t *st)
{
    int32_t err = st->host[st->err_word];
    if (err == 0)
        return 0;
    kvp_log(KVP_LOG_CRIT, "cuda append reported a bad row err=%s (planner bug)", kvp_errname(err));
    poison(cb, "the append kernel reported an error");
    return KVP_EINTERNAL;
}

/* Word layout of a staged plan (int32 words). */
typedef struct {
    size_t indptr, indices, last, bidx, pos, copies, err, total;
} plan_layout_t;

static void plan_layout(const kvp_exec_t *e, plan_layout_t *p)
{
    size_t B = e->batch_size, I = (size_t)e->kv_indptr[e->batch_size], N = e->nnz;
    p->indptr = 0;
    p->indices = p->indptr + B + 1;
    p->last = p->indices + I;
    p->bidx = p->last + B;
    p->pos = p->bidx + N;
    p->copies = p->pos + N;
    p->err = p->copies + 2 * (size_t)e->num_copies;
    p->total = p->err + 1;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Queues e's copies on device dv and, when buf is not NULL, the append from buf (that device's
 * heads). The caller holds dv->lock. Nothing is waited for here, so the devices of a group
 * run their parts at the same time. */
static int enqueue_on_device(cuda_backend_t *cb, cuda_dev_t *dv, const kvp_exec_t *e,
                             cuda_buf_t *buf)
{
    kvp_backend_t *b = &cb->base;
    plan_layout_t pl;
    plan_layout(e, &pl);
    const size_t bytes = pl.total * sizeof(int32_t);
    int rc = 0;

    KVP_CUDA_TRY(cudaSetDevice(dv->ordinal), rc, fail);
    stage_t *st = &dv->stage;
    if ((rc = stage_reserve(st, bytes)) || (rc = dev_reserve(dv, bytes)))
        goto fail;

    int32_t *h = st->host;
    memcpy(h + pl.indptr, e->kv_indptr, (e->batch_size + 1) * sizeof(int32_t));
    if (pl.last > pl.indices)
        memcpy(h + pl.indices, e->kv_indices, (pl.last - pl.indices) * sizeof(int32_t));
    memcpy(h + pl.last, e->kv_last_page_len, e->batch_size * sizeof(int32_t));
    if (e->nnz) {
        memcpy(h + pl.bidx, e->batch_indices, e->nnz * sizeof(int32_t));
        memcpy(h + pl.pos, e->positions, e->nnz * sizeof(int32_t));
    }
    if (e->num_copies)
        memcpy(h + pl.copies, e->copies, e->num_copies * sizeof(kvp_page_copy_t));
    h[pl.err] = 0;
    int32_t *d = dv->dev_words;
    KVP_CUDA_TRY(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, dv->stream), rc, fail);

    void *pool = (void *)(uintptr_t)dv->pool.ptr;
    kvp_paged_kv_t kv;
    for (uint32_t l = 0; l < b->geom.num_layers && e->num_copies; l++) {
        kvp_backend_layer_view(b, pool, l, &kv);
        KVP_KERNEL_TRY(kvp_page_copy_cuda(&kv, (const kvp_page_copy_t *)(d + pl.copies),
                                          e->num_copies, d + pl.err, dv->stream),
                       rc, fail);
    }
    if (buf && e->nnz) {
        for (uint32_t l = e->layer_begin; l < e->layer_end; l++) {
            kvp_backend_layer_view(b, pool, l, &kv);
            kv.batch_size = e->batch_size;
            kv.kv_indptr = d + pl.indptr;
            kv.kv_indices = d + pl.indices;
            kv.kv_last_page_len = d + pl.last;
            const uint8_t *base = buf->dptr + (uint64_t)(l - e->layer_begin) * e->layer_stride;
            kvp_append_src_t src;
            kvp_backend_exec_src(b, e, base, &src);
            KVP_KERNEL_TRY(kvp_append_paged_kv_cache_cuda_unchecked_opts(
                               &kv, &src, d + pl.bidx, d + pl.pos, e->nnz, d + pl.err,
                               &b->tuning.append, dv->stream),
                           rc, fail);
        }
    }
    KVP_CUDA_TRY(cudaMemcpyAsync(h + pl.err, d + pl.err, sizeof(int32_t), cudaMemcpyDeviceToHost,
                                 dv->stream),
                 rc, fail);
    st->err_word = pl.err;
    return 0;
fail:
    return rc ? rc : KVP_EINTERNAL;
}

/* Where every token of e goes, as pool slots (page id * page_size + position % page_size; -1
 * for padding), from the plan's own page table: the form kvp_append_slots_cuda takes. Each
 * token is checked as the kernels' guards check it (request in the batch, position inside its
 * sequence, page id in the pool): 0, or KVP_ERANGE for a plan our planner cannot have made,
 * which the caller treats as the kernels' error word (poison). */
static int plan_slots(const kvp_backend_t *b, const kvp_exec_t *e, int32_t *slots)
{
    const int32_t ps = (int32_t)b->geom.page_size;
    const uint32_t np = b->geom.num_pages;
    for (uint32_t i = 0; i < e->nnz; i++) {
        int32_t bi = e->batch_indices[i], pos = e->positions[i];
        if (bi < 0) {
            slots[i] = -1;
            continue;
        }
        if ((uint32_t)bi >= e->batch_size)
            return KVP_ERANGE;
        int32_t p0 = e->kv_indptr[bi], n = e->kv_indptr[bi + 1] - p0;
        int32_t len = n > 0 ? (n - 1) * ps + e->kv_last_page_len[bi] : 0;
        if (pos < 0 || pos >= len)
            return KVP_ERANGE;
        int32_t page = e->kv_indices[p0 + pos / ps];
        if ((uint32_t)page >= np)
            return KVP_ERANGE;
        slots[i] = page * ps + pos % ps;
    }
    return 0;
}

/* The small-Append path: one launch of the slot kernel for every layer of the range, the
 * slots inside the launch, so nothing is uploaded before it and no error word is read back
 * after it (the slots come from our own planner and are range-checked on the host). Used
 * when there are no copy-on-write copies and the batch fits one launch; decode steps are
 * that case. The caller holds dv->lock. */
static int enqueue_slots(cuda_backend_t *cb, cuda_dev_t *dv, const kvp_exec_t *e, cuda_buf_t *buf,
                         const int32_t *slots)
{
    kvp_backend_t *b = &cb->base;
    int rc = 0;
    KVP_CUDA_TRY(cudaSetDevice(dv->ordinal), rc, fail);
    kvp_paged_kv_t kv;
    kvp_backend_layer_view(b, (void *)(uintptr_t)dv->pool.ptr, e->layer_begin, &kv);
    const uint8_t *base = buf->dptr;
    kvp_append_src_t src;
    kvp_backend_exec_src(b, e, base, &src);
    KVP_KERNEL_TRY(kvp_append_slots_cuda(&kv, &src, slots, e->nnz, e->layer_end - e->layer_begin,
                                         b->derived.layer_bytes, e->layer_stride, dv->stream),
                   rc, fail);
    return 0;
fail:
    return rc ? rc : KVP_EINTERNAL;
}

/* Waits until dv's stream has run what was queued and, for enqueue_on_device's work
 * (has_err_word), checks the run's error word. The daemon waits for the copy before answering in
 * both sync modes: the pages the copy writes stay pinned only until run() returns
 * (kvp_rpc_job_finish unpins them), so returning while the GPU still writes would let a concurrent
 * Release hand those pages to another sequence. SYNC_EVENT still orders the worker's stream after
 * the copy on the GPU (the done event), so the worker's stream never waits on the CPU. The caller
 * holds dv->lock. */
static int finish_on_device(cuda_backend_t *cb, cuda_dev_t *dv, int has_err_word)
{
    int rc = 0;
    KVP_CUDA_TRY(cudaSetDevice(dv->ordinal), rc, fail);
    KVP_CUDA_TRY(cudaStreamSynchronize(dv->stream), rc, fail);
    return has_err_word ? stage_check(cb, &dv->stage) : 0;
fail:
    return rc;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Waits on the CPU until the worker's ready event completes: spinning briefly, then sleeping
 * with a growing interval. 0; KVP_ETIMEDOUT after timeout_ms (a dead or stuck worker);
 * KVP_EINVAL when the event reports an error. Copy thread, no lock held. */
static int wait_ready(const cuda_buf_t *buf, uint64_t timeout_ms)
{
    const uint64_t start = now_ms();
    long sleep_ns = 20 * 1000;
    for (unsigned i = 0;; i++) {
        cudaError_t e = cudaEventQuery(buf->ready);
        if (e == cudaSuccess)
            return 0;
        if (e != cudaErrorNotReady) {
            (void)KVP_CUDA_FAILED(e, "cudaEventQuery(buf->ready)");
            return KVP_EINVAL;
        }
        if (now_ms() - start > timeout_ms) {
            kvp_log(KVP_LOG_WARNING,
                    "append skipped reason=\"the worker's ready event did not complete in %llu "
                    "ms\"",
                    (unsigned long long)timeout_ms);
            return KVP_ETIMEDOUT;
        }
        if (i < 256) {
            sched_yield();
            continue;
        }
        struct timespec ts = {0, sleep_ns};
        nanosleep(&ts, NULL);
        if (sleep_ns < 500 * 1000)
            sleep_ns += sleep_ns / 4;
    }
}

static int cuda_run(kvp_backend_t *b, const kvp_exec_t *e)
{
    cuda_backend_t *cb = (cuda_backend_t *)b;
    if (atomic_load(&cb->poisoned))
        return KVP_EINTERNAL;
    if (!e || e->layer_begin > e->layer_end || e->layer_end > b->geom.num_layers)
        return KVP_EINTERNAL; /* the dispatch validated all this: a bug, not a refusal */
    /* feed[g]: the buffer device g appends from (NULL: copies only). The single-source form
     * feeds the buffer's own device (it carries that device's heads); the tensor-parallel form
     * feeds every device from its rank's buffer. */
    cuda_buf_t *feed[KVP_GEOM_MAX_DEVICES] = {0};
    if (e->num_rank_src) {
        if (e->num_rank_src != cb->num_devices)
            return KVP_EINTERNAL;
        for (uint32_t g = 0; g < cb->num_devices; g++) {
            const kvp_buffer_t *kb = e->rank_src[g];
            if (!kb || !kb->priv || ((cuda_buf_t *)kb->priv)->dev != g)
                return KVP_EINTERNAL;
            feed[g] = kb->priv;
        }
    } else {
        if (!e->src || !e->src->priv)
            return KVP_EINTERNAL;
        cuda_buf_t *buf = e->src->priv;
        feed[buf->dev] = buf;
    }
    /* an append that cannot run is skipped on every device, but the copies still run: the
     * dispatch then rolls the sequences back over pages whose old slots are right. Every
     * rank's source is checked and every ready event waited for before anything is queued,
     * so a group appends on all of its devices or on none. */
    int refused = 0;
    const uint64_t t0 = now_ns();
    for (uint32_t g = 0; g < cb->num_devices && e->nnz && !refused; g++) {
        if (feed[g] && check_source_align(feed[g], e)) {
            kvp_log(KVP_LOG_WARNING, "append skipped reason=\"source offsets and strides must "
                                     "be multiples of 16 bytes for the cuda kernels\"");
            refused = KVP_EINVAL;
        }
    }
    for (uint32_t g = 0; g < cb->num_devices && e->nnz && !refused; g++)
        if (feed[g] && e->sync == KVP_SYNC_EVENT && feed[g]->ready)
            refused = wait_ready(feed[g], cb->ready_timeout_ms);
    const uint64_t t1 = now_ns();
    /* page ids name the same slots on every device: copies run everywhere. Devices are locked
     * in index order (every run does the same, so two runs cannot deadlock), all of them are
     * given their work first and waited for after, so the group's devices work in parallel. */
    int locked[KVP_GEOM_MAX_DEVICES] = {0};
    int rc = 0;
    int32_t slots[KVP_APPEND_SLOTS_MAX];
    const int small =
        !refused && !e->num_copies && e->nnz && e->nnz <= KVP_APPEND_SLOTS_MAX && !cb->plan_upload;
    if (small && plan_slots(b, e, slots)) {
        kvp_log(KVP_LOG_CRIT, "cuda append plan names a slot outside its sequence (planner bug)");
        poison(cb, "an append plan named a slot outside its sequence");
        return KVP_EINTERNAL;
    }
    for (uint32_t g = 0; g < cb->num_devices && !rc; g++) {
        cuda_buf_t *buf = refused ? NULL : feed[g];
        if (!buf && !e->num_copies)
            continue;
        pthread_mutex_lock(&cb->dev[g].lock);
        locked[g] = 1;
        rc = small ? enqueue_slots(cb, &cb->dev[g], e, buf, slots)
                   : enqueue_on_device(cb, &cb->dev[g], e, buf);
    }
    const uint64_t t2 = now_ns();
    for (uint32_t g = 0; g < cb->num_devices && !rc; g++)
        if (locked[g])
            rc = finish_on_device(cb, &cb->dev[g], !small);
    for (uint32_t g = cb->num_devices; g-- > 0;)
        if (locked[g])
            pthread_mutex_unlock(&cb->dev[g].lock);
    if (rc) {
        poison(cb, "a CUDA call failed while running an append");
        return rc;
    }
    if (kvp_log_enabled(KVP_LOG_DEBUG))
        kvp_log(KVP_LOG_DEBUG,
                "cuda run timing nnz=%u ranks=%u path=%s ready_wait_us=%.1f enqueue_us=%.1f "
                "wait_us=%.1f",
                e->nnz, e->num_rank_src, small ? "slots" : "upload", (double)(t1 - t0) / 1e3,
                (double)(t2 - t1) / 1e3, (double)(now_ns() - t2) / 1e3);
    return refused;
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
            poison(cb, "the device's stream reports an error");
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
    .run = cuda_run,
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
    if ((rc = dev_reserve(dv, STAGE_MIN_BYTES)))
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
