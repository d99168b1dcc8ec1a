/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_client_cuda.c - the CUDA section of libkvpool (kvpool.h): mapping the cuda backend's
 * pool into the worker with the VMM API, staging buffers shared with the daemon (a VMM fd, or
 * a legacy cudaIpcMemHandle_t for memory such as a PyTorch tensor's), the daemon-run append
 * ordered by interprocess events, a Reserve's copy-on-write copies on the worker's stream, and
 * and the Commit of the prefix cache ordered by an interprocess event on the worker's stream.
 * The fused in-process append, which needs no handle, is kvp_client_fused.c.
 *
 * The state hangs off the handle (kvp__client_cuda_state) and is freed by kvp_client_close.
 * Every CUDA call goes through a check macro of cuda/kvp_cuda_err.h, which records the call,
 * file and line as the thread's last CUDA error (kvp_last_cuda_error); the entry point then
 * copies that text into the handle's last error as well. Built without CUDA, every entry point
 * returns KVP_EUNAVAIL (the record is there in both builds).
 */
#include "kvpool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvp_client_internal.h"
#include "kvp_cuda_err.h"

const char *kvp_last_cuda_error(void)
{
    return kvp_cuda_last_error();
}

void kvp_clear_cuda_error(void)
{
    kvp_cuda_clear_error();
}

#ifdef KVP_HAVE_CUDA

#include "kvp_cuda_drv.h"
#include "kvp_cuda_vmm.h"
#include "kvp_kernels_cuda.h"

#define CUDA_MAX_BUFFERS  64   /* CUDA staging buffers per handle */
#define SCRATCH_MIN_BYTES 4096 /* first size of the copy-pages scratch */
#define MAX_PRELOADED     64   /* devices whose kernels this handle loaded */

/* A staging buffer this handle registered. */
typedef struct {
    uint32_t id;
    uint32_t kind; /* BUFFER_CUDA_VMM_FD or BUFFER_CUDA_IPC */
    int device;
    kvp_cuda_vmm_t vmm;   /* VMM: our allocation and mapping */
    uint64_t base_offset; /* IPC: dptr_base - the allocation's base */
    cudaEvent_t ready;    /* ours, interprocess; NULL without events */
    cudaEvent_t done;     /* the daemon's, opened from its handle; NULL without events */
} cbuf_t;

/* Page-copy ids on their way to the device. The pinned half is rewritten only once the last
 * upload from it is done; the device half is reused in the order of a stream wait. */
typedef struct {
    kvp_page_copy_t *host;
    void *dev;
    size_t cap_bytes;
    cudaEvent_t uploaded; /* after the last upload from host */
    cudaEvent_t used;     /* after the last copy kernel that read dev */
    int valid;            /* the events have been recorded */
} scratch_t;

/* The interprocess event kvp_client_cuda_commit records on a device, and its IPC handle:
 * made once per device and re-recorded for every Commit. A re-record before the daemon saw
 * the last one complete only moves the publication later, never earlier (the event completes
 * once the newest work recorded into it has run). */
typedef struct {
    int device;
    cudaEvent_t ev;
    cudaIpcEventHandle_t handle;
} commit_event_t;

_Static_assert(sizeof(cudaIpcEventHandle_t) ==
                   sizeof(((kvpool_CommitRequest *)0)->event_handle.bytes),
               "kvpool.proto CommitRequest.event_handle is a cudaIpcEventHandle_t");

typedef struct {
    kvp_cuda_vmm_t pool[KVP_CLIENT_MAX_DEVICES];
    int pool_mapped;
    commit_event_t commit[KVP_CLIENT_MAX_DEVICES];
    uint32_t num_commit;
    scratch_t scratch[KVP_CLIENT_MAX_DEVICES];
    cbuf_t bufs[CUDA_MAX_BUFFERS];
    uint32_t num_bufs;
    int preloaded[MAX_PRELOADED];
    uint32_t num_preloaded;
} cstate_t;

/* The previous current device, restored on the way out. */
typedef struct {
    int prev;
    int set;
} devguard_t;

/* After a check macro failed: the thread's record (what failed, where) becomes the handle's
 * last error too. Returns rc. */
static int cuda_fail(kvp_client_t *c, int rc)
{
    return kvp__client_fail(c, rc, "%s", kvp_cuda_last_error());
}

/* The driver and this handle's state, or KVP_EUNAVAIL / KVP_ENOMEM. *out is set on every
 * path (NULL on failure). */
static int get_state(kvp_client_t *c, cstate_t **out)
{
    const kvp_cuda_drv_t *drv;
    *out = NULL;
    if (kvp_cuda_drv_get(&drv))
        return kvp__client_fail(c, KVP_EUNAVAIL, "CUDA unavailable: %s", kvp_cuda_last_error());
    void **slot = kvp__client_cuda_state(c);
    if (!*slot && !(*slot = calloc(1, sizeof(cstate_t))))
        return kvp__client_fail(c, KVP_ENOMEM, "out of memory");
    *out = *slot;
    return 0;
}

static int dev_enter(kvp_client_t *c, int device, devguard_t *g)
{
    int rc = 0;
    g->prev = -1;
    g->set = 0;
    KVP_CUDA_TRY(cudaGetDevice(&g->prev), rc, fail);
    if (g->prev != device)
        KVP_CUDA_TRY(cudaSetDevice(device), rc, fail);
    g->set = g->prev != device;
    return 0;
fail:
    return cuda_fail(c, rc);
}

static void dev_leave(devguard_t *g)
{
    if (g->set)
        (void)cudaSetDevice(g->prev); /* back to where the caller was; nothing to report */
    g->set = 0;
}

/* Loads the kernels on the current device once per handle (DESIGN.md §4: before any
 * cross-stream wait). */
static int preload(kvp_client_t *c, cstate_t *st, int device)
{
    for (uint32_t i = 0; i < st->num_preloaded; i++)
        if (st->preloaded[i] == device)
            return 0;
    int rc = 0;
    KVP_KERNEL_TRY(kvp_cuda_kernels_preload(), rc, fail);
    if (st->num_preloaded < MAX_PRELOADED)
        st->preloaded[st->num_preloaded++] = device;
    return 0;
fail:
    return kvp__client_fail(c, rc, "kernels on device %d: %s", device, kvp_cuda_last_error());
}

static cbuf_t *find_buf(cstate_t *st, uint32_t id)
{
    for (uint32_t i = 0; i < st->num_bufs; i++)
        if (st->bufs[i].id == id)
            return &st->bufs[i];
    return NULL;
}

static void buf_free(cbuf_t *b)
{
    /* teardown: a failure here has no one left to report to, so these calls are bare */
    devguard_t g = {0, 0};
    if (cudaGetDevice(&g.prev) == cudaSuccess && cudaSetDevice(b->device) == cudaSuccess)
        g.set = 1;
    if (b->ready)
        (void)cudaEventDestroy(b->ready);
    if (b->done)
        (void)cudaEventDestroy(b->done);
    kvp_cuda_vmm_free(&b->vmm);
    dev_leave(&g);
    memset(b, 0, sizeof(*b));
}

/* ---- the pool ------------------------------------------------------------------------- */

static void pool_unmap(kvp_client_t *c, cstate_t *st)
{
    for (uint32_t g = 0; g < KVP_CLIENT_MAX_DEVICES; g++) {
        kvp_cuda_vmm_free(&st->pool[g]);
        kvp__client_set_pool_base(c, g, NULL);
    }
    st->pool_mapped = 0;
}

int kvp_client_cuda_map_pool(kvp_client_t *c)
{
    if (!c)
        return KVP_EINVAL;
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    if (pi->backend != 1)
        return kvp__client_fail(c, KVP_EPRECOND,
                                "map_pool: the daemon's pool is not a cuda pool "
                                "(backend %u)",
                                pi->backend);
    uint32_t n = kvp__client_num_pool(c);
    if (n == 0)
        return kvp__client_fail(c, KVP_EPRECOND,
                                "map_pool: no pool fds (connect with map_pool = 1)");
    if (pi->map_granularity == 0 || pi->pool_bytes == 0 ||
        pi->pool_bytes > SIZE_MAX - pi->map_granularity)
        return kvp__client_fail(
            c, KVP_EPROTO, "map_pool: the daemon sent pool_bytes %llu, granularity %llu",
            (unsigned long long)pi->pool_bytes, (unsigned long long)pi->map_granularity);
    cstate_t *st;
    int rc = get_state(c, &st);
    if (rc)
        return rc;
    if (st->pool_mapped)
        return 0;
    size_t size = (size_t)((pi->pool_bytes + pi->map_granularity - 1) / pi->map_granularity *
                           pi->map_granularity);
    for (uint32_t g = 0; g < n; g++) {
        int device = pi->device_ids[g];
        devguard_t guard;
        if ((rc = dev_enter(c, device, &guard)))
            goto fail;
        if (!(rc = preload(c, st, device)) &&
            (rc = kvp_cuda_vmm_import(kvp_client_pool_fd(c, g), device, size, &st->pool[g], NULL)))
            cuda_fail(c, rc);
        dev_leave(&guard);
        if (rc)
            goto fail;
        kvp__client_set_pool_base(c, g, (void *)(uintptr_t)st->pool[g].ptr);
    }
    st->pool_mapped = 1;
    return 0;
fail:
    pool_unmap(c, st);
    return rc;
}

/* ---- staging buffers ---------------------------------------------------------------------- */

/* Creates the worker's interprocess ready event and writes its handle into the request. */
static int make_ready_event(kvp_client_t *c, cbuf_t *b, kvpool_RegisterBufferRequest *q)
{
    int rc = 0;
    cudaIpcEventHandle_t h;
    KVP_CUDA_TRY(
        cudaEventCreateWithFlags(&b->ready, cudaEventDisableTiming | cudaEventInterprocess), rc,
        fail);
    KVP_CUDA_TRY(cudaIpcGetEventHandle(&h, b->ready), rc, fail);
    _Static_assert(sizeof(h) <= sizeof(q->event_handle.bytes), "event handle fits the proto");
    memcpy(q->event_handle.bytes, &h, sizeof(h));
    q->event_handle.size = sizeof(h);
    return 0;
fail:
    return cuda_fail(c, rc);
}

/* After a successful RegisterBuffer: takes the id and opens the daemon's done event. On
 * failure the buffer is unregistered again. */
static int take_registration(kvp_client_t *c, cstate_t *st, cbuf_t *b, uint32_t *buffer_id)
{
    int rc = 0;
    const kvpool_RegisterBufferResponse *r = &kvp__client_response(c)->body.register_buffer;
    b->id = r->buffer_id;
    if (b->ready) {
        cudaIpcEventHandle_t h;
        if (r->done_event_handle.size != sizeof(h)) {
            rc = KVP_EPROTO;
            kvp_client_unregister_buffer(c, b->id);
            return kvp__client_fail(c, rc,
                                    "the daemon sent no done event for the buffer (%u "
                                    "bytes); is it a cuda daemon?",
                                    (unsigned)r->done_event_handle.size);
        }
        memcpy(&h, r->done_event_handle.bytes, sizeof(h));
        KVP_CUDA_TRY(cudaIpcOpenEventHandle(&b->done, h), rc, fail);
    }
    st->bufs[st->num_bufs++] = *b;
    *buffer_id = b->id;
    return 0;
fail:
    /* the unregister may overwrite the handle's last error, not the thread's CUDA record */
    kvp_client_unregister_buffer(c, b->id);
    return cuda_fail(c, rc);
}

int kvp_client_cuda_alloc_buffer(kvp_client_t *c, uint64_t size_bytes, int device, void **dptr,
                                 uint32_t *buffer_id, int with_events)
{
    if (!c)
        return KVP_EINVAL;
    if (!dptr || !buffer_id || size_bytes == 0 || size_bytes > SIZE_MAX / 2 || device < 0)
        return kvp__client_fail(c, KVP_EINVAL, "cuda_alloc_buffer: bad size, device or output");
    cstate_t *st;
    int rc = get_state(c, &st);
    if (rc)
        return rc;
    if (st->num_bufs == CUDA_MAX_BUFFERS)
        return kvp__client_fail(c, KVP_ELIMIT, "at most %u CUDA buffers per handle",
                                CUDA_MAX_BUFFERS);
    devguard_t guard;
    if ((rc = dev_enter(c, device, &guard)))
        return rc;
    cbuf_t b;
    memset(&b, 0, sizeof(b));
    b.kind = kvpool_BufferKind_BUFFER_CUDA_VMM_FD;
    b.device = device;
    int fd = -1;
    if ((rc = preload(c, st, device)))
        goto fail;
    if ((rc = kvp_cuda_vmm_alloc(device, (size_t)size_bytes, &b.vmm)) ||
        (rc = kvp_cuda_vmm_export(&b.vmm, &fd))) {
        cuda_fail(c, rc);
        goto fail;
    }
    kvpool_Request *req = kvp__client_request(c, kvpool_Request_register_buffer_tag);
    kvpool_RegisterBufferRequest *q = &req->body.register_buffer;
    q->kind = kvpool_BufferKind_BUFFER_CUDA_VMM_FD;
    q->size_bytes = b.vmm.size; /* the whole mapping: both sides round alike */
    q->device = device;
    if (with_events && (rc = make_ready_event(c, &b, q)))
        goto fail;
    if ((rc = kvp__client_call(c, kvpool_Response_register_buffer_tag, NULL, &fd, 1)))
        goto fail;
    close(fd); /* the daemon holds its own reference now */
    fd = -1;
    if ((rc = take_registration(c, st, &b, buffer_id)))
        goto fail;
    dev_leave(&guard);
    *dptr = (void *)(uintptr_t)b.vmm.ptr;
    return 0;
fail:
    if (fd >= 0)
        close(fd);
    buf_free(&b);
    dev_leave(&guard);
    return rc;
}

int kvp_client_cuda_register_ipc(kvp_client_t *c, const void *dptr_base, uint64_t size_bytes,
                                 uint32_t *buffer_id)
{
    if (!c)
        return KVP_EINVAL;
    if (!dptr_base || !buffer_id || size_bytes == 0)
        return kvp__client_fail(c, KVP_EINVAL, "cuda_register_ipc: NULL pointer or size 0");
    cstate_t *st;
    int rc = get_state(c, &st);
    if (rc)
        return rc;
    if (st->num_bufs == CUDA_MAX_BUFFERS)
        return kvp__client_fail(c, KVP_ELIMIT, "at most %u CUDA buffers per handle",
                                CUDA_MAX_BUFFERS);
    const kvp_cuda_drv_t *drv;
    if ((rc = kvp_cuda_drv_get(&drv)))
        return cuda_fail(c, rc);
    struct cudaPointerAttributes attr;
    KVP_CUDA_TRY(cudaPointerGetAttributes(&attr, dptr_base), rc, fail_early);
    if (attr.type != cudaMemoryTypeDevice)
        return kvp__client_fail(c, KVP_EINVAL,
                                "cuda_register_ipc: %p is not device memory (type %d)", dptr_base,
                                (int)attr.type);
    devguard_t guard;
    if ((rc = dev_enter(c, attr.device, &guard)))
        return rc;
    cbuf_t b;
    memset(&b, 0, sizeof(b));
    b.kind = kvpool_BufferKind_BUFFER_CUDA_IPC;
    b.device = attr.device;
    if ((rc = preload(c, st, attr.device)))
        goto fail;
    CUdeviceptr base = 0;
    size_t range = 0;
    KVP_CU_TRY(drv->cuMemGetAddressRange(&base, &range, (CUdeviceptr)(uintptr_t)dptr_base), rc,
               fail_cuda);
    b.base_offset = (uint64_t)((uintptr_t)dptr_base - (uintptr_t)base);
    if (size_bytes > range || b.base_offset > range - size_bytes) {
        rc = kvp__client_fail(c, KVP_EINVAL,
                              "cuda_register_ipc: %llu bytes at offset %llu exceed the %zu-byte "
                              "allocation",
                              (unsigned long long)size_bytes, (unsigned long long)b.base_offset,
                              range);
        goto fail;
    }
    cudaIpcMemHandle_t h;
    KVP_CUDA_TRY(cudaIpcGetMemHandle(&h, (void *)(uintptr_t)base), rc, fail_cuda);
    kvpool_Request *req = kvp__client_request(c, kvpool_Request_register_buffer_tag);
    kvpool_RegisterBufferRequest *q = &req->body.register_buffer;
    q->kind = kvpool_BufferKind_BUFFER_CUDA_IPC;
    q->size_bytes = b.base_offset + size_bytes; /* the daemon maps from the allocation's base */
    q->device = attr.device;
    _Static_assert(sizeof(h) <= sizeof(q->ipc_handle.bytes), "ipc handle fits the proto");
    memcpy(q->ipc_handle.bytes, &h, sizeof(h));
    q->ipc_handle.size = sizeof(h);
    if ((rc = make_ready_event(c, &b, q)))
        goto fail;
    if ((rc = kvp__client_call(c, kvpool_Response_register_buffer_tag, NULL, NULL, 0)) ||
        (rc = take_registration(c, st, &b, buffer_id)))
        goto fail;
    dev_leave(&guard);
    return 0;
fail_cuda:
    cuda_fail(c, rc);
fail:
    buf_free(&b);
    dev_leave(&guard);
    return rc;
fail_early:
    return cuda_fail(c, rc);
}

int kvp_client_cuda_free_buffer(kvp_client_t *c, uint32_t buffer_id)
{
    if (!c)
        return KVP_EINVAL;
    cstate_t *st;
    int rc = get_state(c, &st);
    if (rc)
        return rc;
    cbuf_t *b = find_buf(st, buffer_id);
    if (!b)
        return kvp__client_fail(c, KVP_ENOENT, "no CUDA buffer %u on this handle", buffer_id);
    rc = kvp_client_unregister_buffer(c, buffer_id);
    if (rc && rc != KVP_ENOENT)
        return rc; /* keep it: the daemon may still read it */
    buf_free(b);
    *b = st->bufs[--st->num_bufs];
    return 0;
}

/* ---- append and copies -------------------------------------------------------------------- */

int kvp_client_cuda_append_async(kvp_client_t *c, const uint64_t *seq_ids,
                                 const uint32_t *num_tokens, uint32_t n, const kvp_source_t *src,
                                 kvp_page_table_t *table, void *stream)
{
    return kvp_client_cuda_append_async_cached(c, seq_ids, num_tokens, n, src, NULL, table, stream);
}

int kvp_client_cuda_append_async_cached(kvp_client_t *c, const uint64_t *seq_ids,
                                        const uint32_t *num_tokens, uint32_t n,
                                        const kvp_source_t *src, const kvp_cache_opts_t *cache,
                                        kvp_page_table_t *table, void *stream)
{
    if (!c)
        return KVP_EINVAL;
    if (!src)
        return kvp__client_fail(c, KVP_EINVAL, "cuda_append_async: NULL source");
    cstate_t *st;
    int rc = get_state(c, &st);
    if (rc)
        return rc;
    cbuf_t *b = find_buf(st, src->buffer_id);
    if (!b)
        return kvp__client_fail(c, KVP_EINVAL,
                                "cuda_append_async: buffer %u is not a CUDA buffer of this handle",
                                src->buffer_id);
    kvp_source_t s = *src;
    if (s.k_offset > UINT64_MAX - b->base_offset || s.v_offset > UINT64_MAX - b->base_offset)
        return kvp__client_fail(c, KVP_EINVAL, "cuda_append_async: source offset overflows");
    s.k_offset += b->base_offset;
    s.v_offset += b->base_offset;
    cudaStream_t cs = (cudaStream_t)stream;
    if (!b->ready || !b->done) {
        /* no events: the data must be in the buffer before the daemon reads it */
        KVP_CUDA_TRY(cudaStreamSynchronize(cs), rc, fail);
        return kvp__client_append_ranks(c, seq_ids, num_tokens, n, &s, NULL, 0,
                                        kvpool_SyncMode_SYNC_NONE, cache, table);
    }
    KVP_CUDA_TRY(cudaEventRecord(b->ready, cs), rc, fail);
    if ((rc = kvp__client_append_ranks(c, seq_ids, num_tokens, n, &s, NULL, 0,
                                       kvpool_SyncMode_SYNC_EVENT, cache, table)))
        return rc;
    /* an answer sent once the copy completed needs no device-side wait (a cross-process
     * handoff); otherwise the daemon recorded done before it answered and this wait covers
     * the copy */
    if (!kvp__client_append_completed(c))
        KVP_CUDA_TRY(cudaStreamWaitEvent(cs, b->done, 0), rc, fail);
    return 0;
fail:
    return cuda_fail(c, rc);
}

/* The events of one of this handle's CUDA buffers, or a failure naming what is missing. *out
 * is set on every path (NULL on failure). */
static int event_buf(kvp_client_t *c, uint32_t buffer_id, cbuf_t **out, const char *who)
{
    *out = NULL;
    cstate_t *st;
    int rc = get_state(c, &st);
    if (rc)
        return rc;
    cbuf_t *b = find_buf(st, buffer_id);
    if (!b || !b->ready || !b->done)
        return kvp__client_fail(c, KVP_EINVAL,
                                "%s: buffer %u is not a CUDA buffer with events of "
                                "this handle",
                                who, buffer_id);
    *out = b;
    return 0;
}

int kvp_client_cuda_record_ready(kvp_client_t *c, uint32_t buffer_id, void *stream)
{
    if (!c)
        return KVP_EINVAL;
    cbuf_t *b;
    int rc = event_buf(c, buffer_id, &b, "cuda_record_ready");
    if (rc)
        return rc;
    KVP_CUDA_TRY(cudaEventRecord(b->ready, (cudaStream_t)stream), rc, fail);
    return 0;
fail:
    return cuda_fail(c, rc);
}

int kvp_client_cuda_wait_done(kvp_client_t *c, uint32_t buffer_id, void *stream)
{
    if (!c)
        return KVP_EINVAL;
    cbuf_t *b;
    int rc = event_buf(c, buffer_id, &b, "cuda_wait_done");
    if (rc)
        return rc;
    KVP_CUDA_TRY(cudaStreamWaitEvent((cudaStream_t)stream, b->done, 0), rc, fail);
    return 0;
fail:
    return cuda_fail(c, rc);
}

/* ---- the prefix cache's Commit ------------------------------------------------------------ */

/* The commit event of the current device, made on first use. */
static int commit_event(kvp_client_t *c, cstate_t *st, commit_event_t **out)
{
    int rc = 0, device = -1;
    *out = NULL;
    KVP_CUDA_TRY(cudaGetDevice(&device), rc, fail);
    for (uint32_t i = 0; i < st->num_commit; i++) {
        if (st->commit[i].device == device) {
            *out = &st->commit[i];
            return 0;
        }
    }
    if (st->num_commit == KVP_CLIENT_MAX_DEVICES)
        return kvp__client_fail(c, KVP_ELIMIT, "cuda_commit: events on %u devices already",
                                (unsigned)KVP_CLIENT_MAX_DEVICES);
    commit_event_t e;
    memset(&e, 0, sizeof(e));
    e.device = device;
    KVP_CUDA_TRY(cudaEventCreateWithFlags(&e.ev, cudaEventDisableTiming | cudaEventInterprocess),
                 rc, fail);
    KVP_CUDA_TRY(cudaIpcGetEventHandle(&e.handle, e.ev), rc, fail_destroy);
    st->commit[st->num_commit] = e;
    *out = &st->commit[st->num_commit++];
    return 0;
fail_destroy:
    (void)cudaEventDestroy(e.ev); /* the failure that matters is recorded already */
fail:
    return cuda_fail(c, rc);
}

int kvp_client_cuda_commit(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n, void *stream)
{
    return kvp_client_cuda_commit_ex(c, seq_ids, n, stream, NULL, NULL);
}

int kvp_client_cuda_commit_ex(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n, void *stream,
                              uint32_t *pages, uint32_t *published)
{
    if (!c)
        return KVP_EINVAL;
    if (n && !seq_ids)
        return kvp__client_fail(c, KVP_EINVAL, "cuda_commit: NULL seq_ids with n = %u", n);
    cstate_t *st;
    int rc = get_state(c, &st);
    if (rc)
        return rc;
    commit_event_t *e;
    if ((rc = commit_event(c, st, &e)))
        return rc;
    KVP_CUDA_TRY(cudaEventRecord(e->ev, (cudaStream_t)stream), rc, fail);
    return kvp_client_commit(c, seq_ids, n, &e->handle, pages, published);
fail:
    return cuda_fail(c, rc);
}

/* Pool index of the current device. */
static int current_pool(kvp_client_t *c, uint32_t *g_out, int *device_out)
{
    int rc = 0, device = -1;
    KVP_CUDA_TRY(cudaGetDevice(&device), rc, fail);
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    for (uint32_t g = 0; g < kvp__client_num_pool(c) && g < KVP_CLIENT_MAX_DEVICES; g++) {
        if (pi->device_ids[g] == device) {
            *g_out = g;
            *device_out = device;
            return 0;
        }
    }
    return kvp__client_fail(c, KVP_EINVAL,
                            "the current CUDA device %d holds no pool of this "
                            "daemon",
                            device);
fail:
    return cuda_fail(c, rc);
}

/* Makes sc hold bytes, waiting for its previous users only when it must grow. */
static int scratch_reserve(kvp_client_t *c, scratch_t *sc, size_t bytes)
{
    int rc = 0;
    if (!sc->uploaded) {
        KVP_CUDA_TRY(cudaEventCreateWithFlags(&sc->uploaded, cudaEventDisableTiming), rc, fail);
        KVP_CUDA_TRY(cudaEventCreateWithFlags(&sc->used, cudaEventDisableTiming), rc, fail);
    }
    if (sc->valid)
        KVP_CUDA_TRY(cudaEventSynchronize(sc->uploaded), rc, fail);
    if (sc->cap_bytes >= bytes)
        return 0;
    size_t cap = sc->cap_bytes ? 2 * sc->cap_bytes : SCRATCH_MIN_BYTES;
    while (cap < bytes)
        cap *= 2;
    if (sc->valid)
        KVP_CUDA_TRY(cudaEventSynchronize(sc->used), rc, fail);
    if (sc->host)
        KVP_CUDA_TRY(cudaFreeHost(sc->host), rc, fail);
    sc->host = NULL;
    if (sc->dev)
        KVP_CUDA_TRY(cudaFree(sc->dev), rc, fail);
    sc->dev = NULL;
    sc->cap_bytes = 0;
    sc->valid = 0;
    KVP_CUDA_TRY(cudaHostAlloc((void **)&sc->host, cap, cudaHostAllocDefault), rc, fail);
    KVP_CUDA_TRY(cudaMalloc(&sc->dev, cap), rc, fail);
    sc->cap_bytes = cap;
    return 0;
fail:
    return cuda_fail(c, rc);
}

int kvp_client_cuda_copy_pages(kvp_client_t *c, const kvp_page_table_t *t, void *stream)
{
    if (!c)
        return KVP_EINVAL;
    if (!t)
        return kvp__client_fail(c, KVP_EINVAL, "cuda_copy_pages: NULL page table");
    if (t->num_copies == 0)
        return 0;
    if (!t->copies)
        return kvp__client_fail(c, KVP_EINVAL,
                                "cuda_copy_pages: the table's copies were not "
                                "read (copies array NULL)");
    cstate_t *st;
    int rc = get_state(c, &st);
    if (rc)
        return rc;
    if (!st->pool_mapped)
        return kvp__client_fail(c, KVP_EPRECOND, "cuda_copy_pages: kvp_client_cuda_map_pool first");
    uint32_t g = 0;
    int device = -1;
    if ((rc = current_pool(c, &g, &device)))
        return rc;
    scratch_t *sc = &st->scratch[g];
    const size_t bytes = (size_t)t->num_copies * sizeof(kvp_page_copy_t);
    cudaStream_t cs = (cudaStream_t)stream;
    if ((rc = scratch_reserve(c, sc, bytes)))
        return rc;
    for (uint32_t i = 0; i < t->num_copies; i++) {
        sc->host[i].src = t->copies[2 * i];
        sc->host[i].dst = t->copies[2 * i + 1];
    }
    /* the device half may still be read by a copy queued on another stream */
    if (sc->valid)
        KVP_CUDA_TRY(cudaStreamWaitEvent(cs, sc->used, 0), rc, fail);
    KVP_CUDA_TRY(cudaMemcpyAsync(sc->dev, sc->host, bytes, cudaMemcpyHostToDevice, cs), rc, fail);
    KVP_CUDA_TRY(cudaEventRecord(sc->uploaded, cs), rc, fail);
    sc->valid = 1;
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    uint8_t *base = kvp_client_pool_base(c, g);
    uint32_t l;
    for (l = 0; l < pi->num_layers; l++) {
        kvp_paged_kv_t kv;
        memset(&kv, 0, sizeof(kv));
        kv.k_data = base + (uint64_t)l * pi->layer_bytes;
        kv.v_data = (uint8_t *)kv.k_data + pi->v_offset_bytes;
        kv.elem_bytes = pi->elem_bytes;
        kv.num_pages = pi->num_pages;
        kv.page_size = pi->page_size;
        kv.num_heads = pi->heads_per_device;
        kv.head_dim = pi->head_dim;
        kv.stride_page = pi->stride_page;
        kv.stride_n = pi->stride_n;
        kv.stride_h = pi->stride_h;
        KVP_KERNEL_TRY(kvp_page_copy_cuda(&kv, sc->dev, t->num_copies, NULL, cs), rc, fail_copy);
    }
    KVP_CUDA_TRY(cudaEventRecord(sc->used, cs), rc, fail);
    return 0;
fail_copy:
    return kvp__client_fail(c, rc, "page copy (layer %u, device %d): %s", l, device,
                            kvp_cuda_last_error());
fail:
    return cuda_fail(c, rc);
}

void kvp__client_cuda_close(kvp_client_t *c)
{
    void **slot = kvp__client_cuda_state(c);
    cstate_t *st = *slot;
    if (!st)
        return;
    for (uint32_t i = 0; i < st->num_bufs; i++)
        buf_free(&st->bufs[i]);
    for (uint32_t i = 0; i < st->num_commit; i++) {
        /* teardown: failures have no one left to report to; the daemon keeps its own
         * reference to an event it opened */
        devguard_t g = {0, 0};
        if (cudaGetDevice(&g.prev) == cudaSuccess &&
            cudaSetDevice(st->commit[i].device) == cudaSuccess)
            g.set = 1;
        (void)cudaEventDestroy(st->commit[i].ev);
        dev_leave(&g);
    }
    for (uint32_t g = 0; g < KVP_CLIENT_MAX_DEVICES; g++) {
        scratch_t *sc = &st->scratch[g];
        /* teardown: failures have no one left to report to */
        if (sc->used)
            (void)cudaEventSynchronize(sc->used);
        if (sc->uploaded)
            (void)cudaEventDestroy(sc->uploaded);
        if (sc->used)
            (void)cudaEventDestroy(sc->used);
        if (sc->host)
            (void)cudaFreeHost(sc->host);
        if (sc->dev)
            (void)cudaFree(sc->dev);
    }
    pool_unmap(c, st);
    free(st);
    *slot = NULL;
}

#else /* !KVP_HAVE_CUDA */

static int unavailable(kvp_client_t *c)
{
    if (!c)
        return KVP_EINVAL;
    return kvp__client_fail(c, KVP_EUNAVAIL, "libkvpool was built without CUDA");
}

int kvp_client_cuda_map_pool(kvp_client_t *c)
{
    return unavailable(c);
}

int kvp_client_cuda_alloc_buffer(kvp_client_t *c, uint64_t size_bytes, int device, void **dptr,
                                 uint32_t *buffer_id, int with_events)
{
    (void)size_bytes, (void)device, (void)dptr, (void)buffer_id, (void)with_events;
    return unavailable(c);
}

int kvp_client_cuda_register_ipc(kvp_client_t *c, const void *dptr_base, uint64_t size_bytes,
                                 uint32_t *buffer_id)
{
    (void)dptr_base, (void)size_bytes, (void)buffer_id;
    return unavailable(c);
}

int kvp_client_cuda_append_async(kvp_client_t *c, const uint64_t *seq_ids,
                                 const uint32_t *num_tokens, uint32_t n, const kvp_source_t *src,
                                 kvp_page_table_t *table, void *stream)
{
    (void)seq_ids, (void)num_tokens, (void)n, (void)src, (void)table, (void)stream;
    return unavailable(c);
}

int kvp_client_cuda_record_ready(kvp_client_t *c, uint32_t buffer_id, void *stream)
{
    (void)buffer_id, (void)stream;
    return unavailable(c);
}

int kvp_client_cuda_wait_done(kvp_client_t *c, uint32_t buffer_id, void *stream)
{
    (void)buffer_id, (void)stream;
    return unavailable(c);
}

int kvp_client_cuda_copy_pages(kvp_client_t *c, const kvp_page_table_t *t, void *stream)
{
    (void)t, (void)stream;
    return unavailable(c);
}

int kvp_client_cuda_free_buffer(kvp_client_t *c, uint32_t buffer_id)
{
    (void)buffer_id;
    return unavailable(c);
}

int kvp_client_cuda_commit(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n, void *stream)
{
    (void)seq_ids, (void)n, (void)stream;
    return unavailable(c);
}

int kvp_client_cuda_commit_ex(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n, void *stream,
                              uint32_t *pages, uint32_t *published)
{
    (void)seq_ids, (void)n, (void)stream, (void)pages, (void)published;
    return unavailable(c);
}

int kvp_client_cuda_append_async_cached(kvp_client_t *c, const uint64_t *seq_ids,
                                        const uint32_t *num_tokens, uint32_t n,
                                        const kvp_source_t *src, const kvp_cache_opts_t *cache,
                                        kvp_page_table_t *table, void *stream)
{
    (void)seq_ids, (void)num_tokens, (void)n, (void)src, (void)cache, (void)table, (void)stream;
    return unavailable(c);
}

void kvp__client_cuda_close(kvp_client_t *c)
{
    (void)c;
}

#endif
