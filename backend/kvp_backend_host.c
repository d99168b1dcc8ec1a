/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_host.c - the host backend: the pool lives in one memfd, mapped shared by the
 * daemon and by every worker that received the fd over SCM_RIGHTS; worker staging buffers are
 * memfds too. run() executes a plan with the CPU kernels on a copy worker thread. Used where
 * there is no GPU (CI, CPU inference) and as the reference the cuda backend is checked against.
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

typedef struct {
    kvp_backend_t base;
    int fd;
    uint8_t *pool;
} host_backend_t;

void kvp_backend_layer_view(const kvp_backend_t *b, void *pool_base, uint32_t layer,
                            kvp_paged_kv_t *kv)
{
    const kvp_geom_derived_t *d = &b->derived;
    memset(kv, 0, sizeof(*kv));
    kv->k_data = (uint8_t *)pool_base + kvp_geom_layer_offset(d, layer);
    kv->v_data = (uint8_t *)kv->k_data + d->v_offset_bytes;
    kv->elem_bytes = d->elem_bytes;
    kv->num_pages = b->geom.num_pages;
    kv->page_size = b->geom.page_size;
    kv->num_heads = d->heads;
    kv->head_dim = b->geom.head_dim;
    kv->stride_page = d->stride_page;
    kv->stride_n = d->stride_n;
    kv->stride_h = d->stride_h;
}

void kvp_backend_pool_info(const kvp_backend_t *b, kvp_pool_info_t *out)
{
    const kvp_geom_t *g = &b->geom;
    const kvp_geom_derived_t *d = &b->derived;
    *out = (kvp_pool_info_t){.num_layers = g->num_layers,
                             .num_pages = g->num_pages,
                             .page_size = g->page_size,
                             .num_kv_heads = g->num_kv_heads,
                             .head_dim = g->head_dim,
                             .dtype = (uint32_t)g->dtype,
                             .layout = (uint32_t)g->layout,
                             .storage = (uint32_t)g->storage,
                             .num_devices = g->num_devices ? g->num_devices : 1,
                             .backend = b->kind,
                             .elem_bytes = d->elem_bytes,
                             .heads_per_device = d->heads,
                             .pool_bytes = d->pool_bytes,
                             .layer_bytes = d->layer_bytes,
                             .v_offset_bytes = d->v_offset_bytes,
                             .stride_page = d->stride_page,
                             .stride_n = d->stride_n,
                             .stride_h = d->stride_h,
                             .map_granularity = b->map_granularity};
    for (uint32_t i = 0; i < b->num_device_ids && i < KVP_MAX_DEVICES; i++)
        out->device_ids[i] = b->device_ids[i];
}

void kvp_backend_exec_src(const kvp_backend_t *b, const kvp_exec_t *e, const uint8_t *base,
                          kvp_append_src_t *src)
{
    const uint64_t elem = b->derived.elem_bytes;
    *src = (kvp_append_src_t){
        .key = base + e->k_offset,
        .value = base + e->v_offset,
        .k_stride_n = (int64_t)(e->k_stride_n / elem),
        .k_stride_h = (int64_t)(e->k_stride_h / elem),
        .v_stride_n = (int64_t)(e->v_stride_n / elem),
        .v_stride_h = (int64_t)(e->v_stride_h / elem),
    };
}

static int host_export(kvp_backend_t *b, int *fds, int max)
{
    host_backend_t *h = (host_backend_t *)b;
    if (max < 1)
        return KVP_EINVAL;
    fds[0] = h->fd;
    return 1;
}

/* Host memory only: a CUDA kind is refused, and events are ignored (no done event). Every
 * refusal that is the client's descriptor's fault is a KVP_* code or -EACCES (not open for
 * reading), never an mmap errno the rpc layer would have to guess at: the rpc side
 * (kvp_rpc_buf.c) answers each with INVALID_ARGUMENT and says what is wrong. Only a failure
 * that is the daemon's own (out of address space: KVP_ENOMEM, other errno values) is not. */
static int host_import(kvp_backend_t *b, const kvp_import_req_t *req, kvp_buffer_t *out,
                       uint8_t *done_event_out, uint32_t *done_event_len)
{
    (void)b, (void)done_event_out; /* the host backend has no events and no devices */
    const uint32_t kind = req->kind;
    const int fd = req->fd;
    const uint64_t size_bytes = req->size_bytes;
    if (done_event_len)
        *done_event_len = 0;
    if (kind != KVP_BUFFER_MEMFD || fd < 0 || size_bytes == 0)
        return KVP_EINVAL;
    /* The daemon maps the buffer PROT_READ: a descriptor opened write-only (a memfd reopened
     * through /proc/self/fd with O_WRONLY) or O_PATH cannot be mapped (mmap: EACCES). */
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || (fl & O_ACCMODE) == O_WRONLY || (fl & O_PATH))
        return -EACCES;
    struct stat st;
    if (fstat(fd, &st) < 0)
        return KVP_EINVAL; /* the fd came with the frame: a failure here is not ours */
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size < size_bytes)
        return KVP_EINVAL; /* not a memfd/file, or smaller than claimed */
    /* A buffer its owner could shrink would SIGBUS the copy thread: only sealed memfds. */
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK))
        return KVP_EPERM;
    void *p = mmap(NULL, (size_t)size_bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int err = errno;
        kvp_log(KVP_LOG_INFO, "buffer mmap failed size_bytes=%llu err=%s",
                (unsigned long long)size_bytes, kvp_errname(-err));
        if (err == EACCES)
            return -EACCES;
        if (err == EINVAL || err == ENODEV || err == EOVERFLOW)
            return KVP_EINVAL; /* a file that cannot be mapped this way: the client's */
        return err == ENOMEM ? KVP_ENOMEM : -err; /* the daemon's own (address space, fds) */
    }
    close(fd);
    out->kind = kind;
    out->size_bytes = size_bytes;
    out->host_ptr = p;
    out->priv = NULL;
    out->device_index = 0;
    return 0;
}

static void host_release(kvp_backend_t *b, kvp_buffer_t *buf)
{
    (void)b;
    if (buf->host_ptr)
        munmap(buf->host_ptr, buf->size_bytes);
    buf->host_ptr = NULL;
}

static int host_run(kvp_backend_t *b, const kvp_exec_t *e)
{
    host_backend_t *h = (host_backend_t *)b;
    kvp_paged_kv_t kv;
    int rc = 0;
    /* the host pool is one device: a tensor-parallel append names exactly one rank */
    const kvp_buffer_t *from = e->num_rank_src ? e->rank_src[0] : e->src;
    if (!from || (e->num_rank_src && e->num_rank_src != 1))
        return KVP_EINTERNAL; /* the dispatch validated this: a bug, not a refusal */
    /* copy-on-write copies in every layer: a page id names the same slots in all layers */
    for (uint32_t l = 0; l < b->geom.num_layers && e->num_copies && !rc; l++) {
        kvp_backend_layer_view(b, h->pool, l, &kv);
        rc = kvp_page_copy_cpu(&kv, e->copies, e->num_copies);
    }
    for (uint32_t l = e->layer_begin; l < e->layer_end && e->nnz && !rc; l++) {
        kvp_backend_layer_view(b, h->pool, l, &kv);
        kv.batch_size = e->batch_size;
        kv.kv_indptr = e->kv_indptr;
        kv.kv_indices = e->kv_indices;
        kv.kv_last_page_len = e->kv_last_page_len;
        const uint8_t *base =
            (const uint8_t *)from->host_ptr + (uint64_t)(l - e->layer_begin) * e->layer_stride;
        kvp_append_src_t src;
        kvp_backend_exec_src(b, e, base, &src);
        rc = kvp_append_paged_kv_cache_cpu(&kv, &src, e->batch_indices, e->positions, e->nnz);
    }
    return rc;
}

static int host_health(kvp_backend_t *b)
{
    (void)b;
    return 0;
}

static void host_destroy(kvp_backend_t *b)
{
    host_backend_t *h = (host_backend_t *)b;
    if (!h)
        return;
    if (h->pool)
        munmap(h->pool, b->derived.pool_bytes);
    if (h->fd >= 0)
        close(h->fd);
    free(h);
}

static const kvp_backend_ops_t host_ops = {
    .name = "host",
    .export_fds = host_export,
    .import_buffer = host_import,
    .release_buffer = host_release,
    .run = host_run,
    .health = host_health,
    .destroy = host_destroy,
};

int kvp_backend_host_create(const kvp_geom_t *g, kvp_backend_t **out)
{
    host_backend_t *h = calloc(1, sizeof(*h));
    if (!h)
        return KVP_ENOMEM;
    h->fd = -1;
    int rc = kvp_geom_derive(g, &h->base.derived);
    if (rc)
        goto fail;
    h->base.geom = *g;
    h->base.ops = &host_ops;
    h->base.kind = KVP_BACKEND_HOST;
    h->fd = memfd_create("kvpool-pool", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (h->fd < 0) {
        rc = -errno;
        goto fail;
    }
    if (ftruncate(h->fd, (off_t)h->base.derived.pool_bytes) < 0) {
        rc = -errno;
        goto fail;
    }
    /* workers may map it but never resize it */
    (void)fcntl(h->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    h->pool = mmap(NULL, h->base.derived.pool_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, h->fd, 0);
    if (h->pool == MAP_FAILED) {
        h->pool = NULL;
        rc = -errno;
        goto fail;
    }
    kvp_log(KVP_LOG_INFO, "pool created backend=host bytes=%llu pages=%u layers=%u",
            (unsigned long long)h->base.derived.pool_bytes, g->num_pages, g->num_layers);
    *out = &h->base;
    return 0;
fail:
    host_destroy(&h->base);
    return rc;
}
