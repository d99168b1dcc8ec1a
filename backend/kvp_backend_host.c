/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_host.c - the host backend: the pool lives in one memfd, mapped shared by the
 * daemon and by every worker that received the fd over SCM_RIGHTS; worker staging buffers are
 * memfds too. run() executes a plan, and gather() a Load's copy out to a buffer, with the CPU
 * kernels on a copy worker thread. Used where there is no GPU (CI, CPU inference) and as the
 * reference the cuda backend is checked against.
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

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010 /* Linux 5.1; older libc headers lack the name */
#endif

typedef struct {
    kvp_backend_t base;
    int fd;
    uint8_t *pool;
} host_backend_t;

static int host_export(kvp_backend_t *b, int *fds, int max)
{
    host_backend_t *h = (host_backend_t *)b;
    if (max < 1)
        return KVP_EINVAL;
    fds[0] = h->fd;
    return 1;
}

/* Host memory only: a CUDA kind is refused, and events are ignored (no done event). A buffer
 * the daemon may write (a Load's destination) is mapped PROT_READ | PROT_WRITE and marked
 * writable: one opened read-write whose memfd is sealed against neither writes nor future
 * writes; any other is mapped PROT_READ as an Append source needs, and is not. Every
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
    /* The daemon maps the buffer at least PROT_READ: a descriptor opened write-only (a memfd
     * reopened through /proc/self/fd with O_WRONLY) or O_PATH cannot be mapped (mmap: EACCES). */
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
    bool writable = (fl & O_ACCMODE) == O_RDWR && !(seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE));
    void *p = mmap(NULL, (size_t)size_bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                   MAP_SHARED, fd, 0);
    if (p == MAP_FAILED && writable && (errno == EACCES || errno == EPERM)) {
        /* a file that refuses a shared writable mapping for another reason: a source still */
        writable = false;
        p = mmap(NULL, (size_t)size_bytes, PROT_READ, MAP_SHARED, fd, 0);
    }
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
    out->writable = writable;
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
    /* the planner's destination as it is (kvp_exec_t.dest): the kernel reads the slots */
    for (uint32_t l = e->layer_begin; l < e->layer_end && e->dest.nnz && !rc; l++) {
        kvp_backend_layer_view(b, h->pool, l, &kv);
        const uint8_t *base =
            (const uint8_t *)from->host_ptr + (uint64_t)(l - e->layer_begin) * e->layer_stride;
        kvp_append_src_t src;
        kvp_backend_exec_src(b, e, base, &src);
        rc = kvp_append_cpu(&kv, &src, &e->dest);
    }
    return rc;
}

/* A Load's copy with the CPU kernel: every slot is checked before any layer is written, so a
 * refused gather leaves dst as it was. */
static int host_gather(kvp_backend_t *b, const kvp_gather_t *g)
{
    host_backend_t *h = (host_backend_t *)b;
    if (!g || !g->dst || !g->dst->host_ptr || !g->dst->writable || (g->nnz && !g->slots) ||
        g->layer_begin > g->layer_end || g->layer_end > b->geom.num_layers)
        return KVP_EINVAL;
    const int64_t cap = (int64_t)b->geom.num_pages * b->geom.page_size;
    for (uint32_t i = 0; i < g->nnz; i++)
        if (g->slots[i] >= cap)
            return KVP_ERANGE;
    int rc = 0;
    for (uint32_t l = g->layer_begin; l < g->layer_end && g->nnz && !rc; l++) {
        kvp_paged_kv_t kv;
        kvp_backend_layer_view(b, h->pool, l, &kv);
        kvp_gather_dst_t dst;
        kvp_backend_gather_dst(b, g, l, (uint8_t *)g->dst->host_ptr, &dst);
        rc = kvp_gather_cpu(&kv, g->slots, g->nnz, &dst);
    }
    return rc;
}

typedef struct {
    host_backend_t *h;
    const kvp_move_t *m;
} host_move_t;

static int host_move_piece(void *arg, uint32_t layer, uint64_t lo, uint64_t hi, uint64_t buf_off)
{
    const host_move_t *hm = arg;
    const kvp_move_t *m = hm->m;
    kvp_paged_kv_t kv;
    kvp_backend_layer_view(&hm->h->base, hm->h->pool, layer, &kv);
    uint8_t *buf = (uint8_t *)m->buf + buf_off;
    return m->dir == KVP_MOVE_OUT
               ? kvp_kv_pack_range_cpu(&kv, m->pages, m->num_tokens, lo, hi, buf)
               : kvp_kv_unpack_range_cpu(&kv, m->pages, m->num_tokens, lo, hi, buf);
}

/* The page-mover on the CPU: the pool is process memory, so is buf (no device medium). */
static int host_move(kvp_backend_t *b, const kvp_move_t *m)
{
    int rc = kvp_backend_move_check(b, m);
    if (rc)
        return rc;
    if (m->buf_medium != KVP_MEDIUM_HOST || m->stream)
        return KVP_EINVAL;
    host_move_t hm = {.h = (host_backend_t *)b, .m = m};
    return kvp__backend_move_pieces(b, m, host_move_piece, &hm);
}

/* The host tier's mover on the CPU: each page's packed form (every layer, K then V) to or from
 * its slot, one page-mover call per page. The pool is one device: a slot holds its heads at 0. */
static int host_move_slots(kvp_backend_t *b, const kvp_slot_move_t *sm)
{
    int rc = kvp__backend_slot_move_check(b, sm);
    if (rc)
        return rc;
    const uint32_t ps = b->geom.page_size;
    for (uint32_t i = 0; i < sm->n && !rc; i++) {
        const int32_t page = (int32_t)sm->pages[i]; /* < num_pages <= INT32_MAX: checked */
        const kvp_move_t m = {.dir = sm->dir,
                              .pages = &page,
                              .num_tokens = ps,
                              .begin = 0,
                              .end = kvp_backend_move_bytes(b, ps),
                              .buf = sm->slots[i],
                              .buf_medium = KVP_MEDIUM_HOST};
        rc = host_move(b, &m);
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
    .move = host_move,
    .move_slots = host_move_slots,
    .gather = host_gather,
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
