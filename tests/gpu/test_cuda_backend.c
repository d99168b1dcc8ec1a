/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_cuda_backend.c - the cuda backend and libkvpool's CUDA section on a real GPU, every
 * result compared byte-exact with the CPU reference (kvp_append_cpu and
 * kvp_page_copy_cpu on a host copy). Directly: the backend created as the dispatch would,
 * worker-style VMM and memfd buffers imported, plans with copy-on-write copies and layer
 * ranges executed, the pool read back through a second mapping of its exported fd; refusals
 * (too large a claim, a garbage IPC handle, an unsealed memfd, a misaligned source) leave it
 * healthy, a bad position poisons it; the page-mover out to host and device memory and back.
 * End to end: kvpoold --backend cuda with worker processes
 * that map the pool, append through event-ordered VMM and IPC buffers and a memfd, reserve and
 * append in-process, and one SIGKILLed mid-stream that leaves the daemon healthy.
 *
 * Each test runs in its own forked process, and the probe for a GPU in a child too, so no
 * process initialises CUDA before it forks a worker. Exits 77 where no GPU is usable (CI).
 */
#include <check.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvp_backend.h"
#include "kvp_cuda_drv.h"
#include "kvp_cuda_vmm.h"
#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_gpu_test.h"
#include "kvp_harness.h"
#include "kvp_kernels.h"
#include "kvp_kernels_cuda.h"
#include "kvp_knob.h"
#include "kvp_test_util.h"
#include "kvpool.h"
#include "kvpool.pb.h"

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        ck_assert_msg(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                 \
    } while (0)

/* ---- a plan built by hand (the backend runs what the dispatch would hand it) ------------- */

typedef struct {
    uint32_t B, nnz, num_copies;
    int32_t indptr[9], indices[64], last[8], aip[9], seq_lens[8];
    int32_t bidx[512], pos[512];
    int32_t slots[512]; /* the planner's destination (kvp_plan_slots), from bidx and pos */
    kvp_page_copy_t copies[8];
    uint32_t len[8], npages[8], pages[8][16];
} plan_t;

/* Grows request b by toks[b] tokens (pages from *next_free), then fills the CSR arrays,
 * batch indices and positions. */
static void plan_grow(plan_t *p, const kvp_geom_t *g, const uint32_t *toks, uint32_t *next_free)
{
    uint32_t ps = g->page_size;
    p->indptr[0] = 0;
    p->aip[0] = 0;
    for (uint32_t b = 0; b < p->B; b++) {
        p->len[b] += toks[b];
        while (p->npages[b] < kvp_geom_pages_for(ps, p->len[b])) {
            ck_assert_uint_lt(*next_free, g->num_pages);
            ck_assert_uint_lt(p->npages[b], 16);
            p->pages[b][p->npages[b]++] = (*next_free)++;
        }
        p->indptr[b + 1] = p->indptr[b] + (int32_t)p->npages[b];
        for (uint32_t k = 0; k < p->npages[b]; k++)
            p->indices[p->indptr[b] + (int32_t)k] = (int32_t)p->pages[b][k];
        p->last[b] = (int32_t)(p->len[b] - (p->npages[b] - 1) * ps);
        p->aip[b + 1] = p->aip[b] + (int32_t)toks[b];
        p->seq_lens[b] = (int32_t)p->len[b];
    }
    p->nnz = (uint32_t)p->aip[p->B];
    ck_assert_uint_le(p->nnz, 512);
    ck_assert_int_eq(
        kvp_get_batch_indices_positions_cpu(p->aip, p->seq_lens, p->B, p->nnz, p->bidx, p->pos), 0);
    for (uint32_t i = 0; i < p->nnz; i++)
        p->slots[i] = p->indices[p->indptr[p->bidx[i]] + p->pos[i] / (int32_t)ps] * (int32_t)ps +
                      p->pos[i] % (int32_t)ps;
}

static kvp_exec_t plan_exec(const plan_t *p, const kvp_buffer_t *buf, uint64_t row_bytes,
                            uint32_t H, uint32_t lb, uint32_t le)
{
    uint64_t kv_bytes = (uint64_t)p->nnz * H * row_bytes;
    return (kvp_exec_t){.dest = {.kind = KVP_APPEND_DEST_SLOTS, .nnz = p->nnz, .slots = p->slots},
                        .copies = p->copies,
                        .num_copies = p->num_copies,
                        .src = buf,
                        .k_offset = 0,
                        .v_offset = kv_bytes,
                        .k_stride_n = H * row_bytes,
                        .k_stride_h = row_bytes,
                        .v_stride_n = H * row_bytes,
                        .v_stride_h = row_bytes,
                        .layer_stride = 2 * kv_bytes,
                        .layer_begin = lb,
                        .layer_end = le};
}

/* What the backend must have done, on the host copy: copies in every layer, then the append
 * from src (host bytes laid out as e says) in e's layers. */
static void reference(const kvp_backend_t *b, uint8_t *pool, const kvp_exec_t *e,
                      const uint8_t *src)
{
    kvp_paged_kv_t kv;
    const uint64_t elem = b->derived.elem_bytes;
    for (uint32_t l = 0; l < b->geom.num_layers && e->num_copies; l++) {
        kvp_backend_layer_view(b, pool, l, &kv);
        ck_assert_int_eq(kvp_page_copy_cpu(&kv, e->copies, e->num_copies), 0);
    }
    for (uint32_t l = e->layer_begin; l < e->layer_end; l++) {
        kvp_backend_layer_view(b, pool, l, &kv);
        const uint8_t *base = src + (uint64_t)(l - e->layer_begin) * e->layer_stride;
        kvp_append_src_t s = {.key = base + e->k_offset,
                              .value = base + e->v_offset,
                              .k_stride_n = (int64_t)(e->k_stride_n / elem),
                              .k_stride_h = (int64_t)(e->k_stride_h / elem),
                              .v_stride_n = (int64_t)(e->v_stride_n / elem),
                              .v_stride_h = (int64_t)(e->v_stride_h / elem)};
        ck_assert_int_eq(kvp_append_cpu(&kv, &s, &e->dest), 0);
    }
}

/* The backend's pool, mapped a second time from its exported fd, read back whole. */
typedef struct {
    kvp_backend_t *b;
    kvp_cuda_vmm_t view;
    uint8_t *ref, *back;
    cudaStream_t s;
} world_t;

/* The in-process backends' tuning: run_device.sh sets KVPOOL_CUDA_PLAN_UPLOAD=1 to run the
 * suite again over the plan-upload path (the daemons started here read the same variable as
 * their [tuning] cuda_plan_upload). */
static const kvp_backend_tuning_t *test_tuning(void)
{
    static kvp_backend_tuning_t t;
    bool up = false;
    const char *e = kvp_knob_env("KVPOOL_CUDA_PLAN_UPLOAD");
    ck_assert_msg(!e || kvp_knob_parse_bool(e, &up) == 0, "KVPOOL_CUDA_PLAN_UPLOAD=%s", e);
    t.plan_upload = up;
    return &t;
}

/* The negative tests below provoke err/crit lines of the backend's log (this process's stderr)
 * on purpose: each says so before it provokes them and after, so that a reader of the test's
 * output does not take those lines for failures. */
static void expected_begin(const char *what)
{
    fprintf(stderr, "expected: the err/crit lines up to 'expected: end' are provoked: %s\n", what);
}

static void expected_end(void)
{
    fprintf(stderr, "expected: end\n");
}

static void world_open(world_t *w, const kvp_geom_t *g)
{
    memset(w, 0, sizeof(*w));
    int dev = 0;
    ck_assert_int_eq(kvp_backend_cuda_create(g, &dev, 1, test_tuning(), &w->b), 0);
    kvp_backend_t *b = w->b;
    ck_assert_int_eq(b->kind, kvpool_BackendKind_BACKEND_CUDA);
    ck_assert_uint_gt(b->map_granularity, 0);
    ck_assert_uint_ge(b->map_bytes, b->derived.pool_bytes);
    ck_assert_uint_eq(b->map_bytes % b->map_granularity, 0);
    ck_assert_uint_lt(b->map_bytes - b->derived.pool_bytes, b->map_granularity);
    ck_assert_uint_eq(b->num_device_ids, 1);
    ck_assert_int_eq(b->device_ids[0], 0);
    int fds[4];
    ck_assert_int_eq(b->ops->export_fds(b, fds, 4), 1);
    CK(cudaSetDevice(0));
    int rc = kvp_cuda_vmm_import(fds[0], 0, b->map_bytes, &w->view, NULL);
    ck_assert_msg(rc == 0, "import of the pool fd: %s", kvp_cuda_last_error());
    w->ref = calloc(1, b->derived.pool_bytes);
    w->back = malloc(b->derived.pool_bytes);
    ck_assert(w->ref && w->back);
    CK(cudaStreamCreateWithFlags(&w->s, cudaStreamNonBlocking));
    ck_assert_int_eq(b->ops->health(b), 0);
}

static void world_compare(world_t *w, const char *what)
{
    size_t n = w->b->derived.pool_bytes;
    CK(cudaMemcpyAsync(w->back, (void *)(uintptr_t)w->view.ptr, n, cudaMemcpyDeviceToHost, w->s));
    CK(cudaStreamSynchronize(w->s));
    size_t i = 0;
    while (i < n && w->back[i] == w->ref[i])
        i++;
    ck_assert_msg(i == n, "%s: pool differs from the CPU reference at byte %zu of %zu", what, i, n);
}

static void world_close(world_t *w)
{
    kvp_cuda_vmm_free(&w->view);
    w->b->ops->destroy(w->b);
    CK(cudaStreamDestroy(w->s));
    free(w->ref);
    free(w->back);
}

/* A worker-style VMM buffer of bytes, filled with random bytes (host copy in *host), imported
 * into the backend. */
static void vmm_buffer(world_t *w, size_t bytes, kvp_rng_t *r, kvp_cuda_vmm_t *m, uint8_t **host,
                       kvp_buffer_t *buf)
{
    int rc = kvp_cuda_vmm_alloc(0, bytes, m);
    ck_assert_msg(rc == 0, "%s", kvp_cuda_last_error());
    *host = malloc(m->size);
    kvp_rng_fill(r, *host, m->size);
    CK(cudaMemcpyAsync((void *)(uintptr_t)m->ptr, *host, m->size, cudaMemcpyHostToDevice, w->s));
    CK(cudaStreamSynchronize(w->s));
    int fd = -1;
    ck_assert_int_eq(kvp_cuda_vmm_export(m, &fd), 0);
    uint8_t done[KVP_BACKEND_IPC_HANDLE_BYTES];
    uint32_t done_len = 99;
    rc = w->b->ops->import_buffer(w->b,
                                  &(kvp_import_req_t){.kind = kvpool_BufferKind_BUFFER_CUDA_VMM_FD,
                                                      .fd = fd,
                                                      .size_bytes = m->size,
                                                      .device = 0},
                                  buf, done, &done_len);
    ck_assert_int_eq(rc, 0);
    ck_assert_uint_eq(done_len, 0); /* no event asked, none given */
    /* the fd belongs to the backend now */
}

static const kvp_geom_t GEOMS[] = {
    {3, 40, 16, 4, 64, KVP_DTYPE_FP16, KVP_LAYOUT_NHD, KVP_STORAGE_COMBINED, 1},
    {2, 48, 8, 2, 128, KVP_DTYPE_BF16, KVP_LAYOUT_HND, KVP_STORAGE_SPLIT, 1},
    {2, 96, 4, 3, 32, KVP_DTYPE_FP32, KVP_LAYOUT_NHD, KVP_STORAGE_SPLIT, 1},
    {4, 32, 16, 8, 128, KVP_DTYPE_FP8_E4M3, KVP_LAYOUT_HND, KVP_STORAGE_COMBINED, 1},
};

START_TEST(direct_append_and_copies_match_cpu)
{
    const kvp_geom_t *g = &GEOMS[_i];
    world_t w;
    world_open(&w, g);
    kvp_backend_t *b = w.b;
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(0xb0c0 + (uint64_t)_i));

    /* round 1: the seed example's lengths, every layer */
    plan_t p;
    memset(&p, 0, sizeof(p));
    p.B = 4;
    uint32_t next_free = 0;
    const uint32_t toks1[] = {45, 8, 25, 22};
    plan_grow(&p, g, toks1, &next_free);
    const uint64_t row = b->derived.row_bytes;
    const uint32_t H = b->derived.heads, L = g->num_layers;
    size_t src_bytes = (size_t)2 * 512 * H * row * L;
    kvp_cuda_vmm_t m;
    uint8_t *host;
    kvp_buffer_t buf;
    vmm_buffer(&w, src_bytes, &r, &m, &host, &buf);
    kvp_exec_t e = plan_exec(&p, &buf, row, H, 0, L);
    ck_assert_int_eq(b->ops->run(b, &e), 0);
    reference(b, w.ref, &e, host);
    world_compare(&w, "prefill");

    /* round 2: one token each, two copy-on-write copies of written pages, layers [1, L),
     * asking for SYNC_EVENT on a buffer without events (must still complete in run) */
    p.num_copies = 2;
    p.copies[0] = (kvp_page_copy_t){(uint32_t)p.pages[0][1], next_free++};
    p.copies[1] = (kvp_page_copy_t){(uint32_t)p.pages[2][0], next_free++};
    const uint32_t toks2[] = {1, 1, 1, 1};
    plan_grow(&p, g, toks2, &next_free);
    kvp_rng_fill(&r, host, m.size);
    CK(cudaMemcpyAsync((void *)(uintptr_t)m.ptr, host, m.size, cudaMemcpyHostToDevice, w.s));
    CK(cudaStreamSynchronize(w.s));
    e = plan_exec(&p, &buf, row, H, 1, L);
    e.sync = kvpool_SyncMode_SYNC_EVENT;
    ck_assert_int_eq(b->ops->run(b, &e), 0);
    reference(b, w.ref, &e, host);
    world_compare(&w, "decode with copies");
    ck_assert_int_eq(b->ops->health(b), 0);

    b->ops->release_buffer(b, &buf);
    ck_assert_ptr_null(buf.priv);
    kvp_cuda_vmm_free(&m);
    free(host);
    world_close(&w);
}
END_TEST

/* The page-mover (ops->move, issue #27): the packed form of pages out of the GPU pool into host
 * memory (staged through the device, done when move returns) and into device memory on the
 * caller's stream (as transfers use it), whole and in 4 KiB pieces, byte-exact against the CPU
 * pack of the same pool; back in from host memory, the pool byte-exact with the CPU unpack;
 * refusals leave it healthy. */
START_TEST(pages_move_out_and_back_through_the_page_mover)
{
    const kvp_geom_t *g = &GEOMS[_i];
    world_t w;
    world_open(&w, g);
    kvp_backend_t *b = w.b;
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(0x27a0 + (uint64_t)_i));
    const size_t n = b->derived.pool_bytes;
    kvp_rng_fill(&r, w.ref, n);
    CK(cudaMemcpyAsync((void *)(uintptr_t)w.view.ptr, w.ref, n, cudaMemcpyHostToDevice, w.s));
    CK(cudaStreamSynchronize(w.s));

    const int32_t pages[] = {5, 2, 7, 11};
    const uint32_t toks = 3 * g->page_size + (g->page_size + 1) / 2,
                   L = g->num_layers; /* 4 pages */
    const uint64_t total = kvp_backend_move_bytes(b, toks), lb = total / L;
    uint8_t *expect = malloc(total), *out = malloc(total), *zeros = calloc(1, total);
    ck_assert(expect && out && zeros);
    for (uint32_t l = 0; l < L; l++) { /* the CPU's pack of the reference pool */
        kvp_paged_kv_t kv;
        kvp_backend_layer_view(b, w.ref, l, &kv);
        ck_assert_int_eq(kvp_kv_pack_range_cpu(&kv, pages, toks, 0, lb, expect + l * lb), 0);
    }
    kvp_move_t m = {.dir = KVP_MOVE_OUT,
                    .pages = pages,
                    .num_tokens = toks,
                    .begin = 0,
                    .end = total,
                    .buf = out,
                    .buf_medium = KVP_MEDIUM_HOST};
    ck_assert_int_eq(b->ops->move(b, &m), 0);
    ck_assert_msg(memcmp(out, expect, total) == 0, "move out to host memory differs");
    memset(out, 0, total);
    for (uint64_t off = 0; off < total; off += 4096) { /* pieces across layers */
        m.begin = off;
        m.end = off + 4096 < total ? off + 4096 : total;
        m.buf = out + off;
        ck_assert_int_eq(b->ops->move(b, &m), 0);
    }
    ck_assert_msg(memcmp(out, expect, total) == 0, "move out in pieces differs");

    /* device memory on the caller's stream, page ids on the device: the transfers' form */
    uint8_t *dbuf;
    int32_t *dpages;
    CK(cudaMalloc((void **)&dbuf, total));
    CK(cudaMalloc((void **)&dpages, sizeof(pages)));
    CK(cudaMemcpy(dpages, pages, sizeof(pages), cudaMemcpyHostToDevice));
    m = (kvp_move_t){.dir = KVP_MOVE_OUT,
                     .pages = pages,
                     .pages_dev = dpages,
                     .num_tokens = toks,
                     .begin = 0,
                     .end = total,
                     .buf = dbuf,
                     .buf_medium = KVP_MEDIUM_GPU,
                     .stream = w.s};
    ck_assert_int_eq(b->ops->move(b, &m), 0);
    CK(cudaStreamSynchronize(w.s));
    memset(out, 0, total);
    CK(cudaMemcpy(out, dbuf, total, cudaMemcpyDeviceToHost));
    ck_assert_msg(memcmp(out, expect, total) == 0, "move out to device memory differs");

    /* in: zeros over the pages' rows, then the packed bytes back: the pool as it was */
    m = (kvp_move_t){.dir = KVP_MOVE_IN,
                     .pages = pages,
                     .num_tokens = toks,
                     .begin = 0,
                     .end = total,
                     .buf = zeros,
                     .buf_medium = KVP_MEDIUM_HOST};
    ck_assert_int_eq(b->ops->move(b, &m), 0);
    uint8_t *orig = malloc(n);
    ck_assert_ptr_nonnull(orig);
    memcpy(orig, w.ref, n);
    for (uint32_t l = 0; l < L; l++) {
        kvp_paged_kv_t kv;
        kvp_backend_layer_view(b, w.ref, l, &kv);
        ck_assert_int_eq(kvp_kv_unpack_range_cpu(&kv, pages, toks, 0, lb, zeros + l * lb), 0);
    }
    ck_assert_int_ne(memcmp(orig, w.ref, n), 0);
    world_compare(&w, "move in of zeros");
    m.buf = expect;
    ck_assert_int_eq(b->ops->move(b, &m), 0);
    memcpy(w.ref, orig, n);
    world_compare(&w, "move in of the packed bytes");

    /* refusals: a range not in 16-byte steps, a page beyond the pool, device 1 */
    m.begin = 8;
    ck_assert_int_eq(b->ops->move(b, &m), KVP_EINVAL);
    const int32_t bad[] = {5, 2, 7, (int32_t)g->num_pages};
    m = (kvp_move_t){.dir = KVP_MOVE_IN,
                     .pages = bad,
                     .num_tokens = toks,
                     .begin = 0,
                     .end = total,
                     .buf = zeros,
                     .buf_medium = KVP_MEDIUM_HOST};
    ck_assert_int_eq(b->ops->move(b, &m), KVP_ERANGE);
    m.pages = pages, m.device = 1;
    ck_assert_int_eq(b->ops->move(b, &m), KVP_EINVAL);
    world_compare(&w, "after the refused moves");
    ck_assert_int_eq(b->ops->health(b), 0);

    CK(cudaFree(dbuf));
    CK(cudaFree(dpages));
    free(orig);
    free(zeros);
    free(out);
    free(expect);
    world_close(&w);
}
END_TEST

START_TEST(memfd_buffer_is_read_over_the_bus)
{
    const kvp_geom_t *g = &GEOMS[0];
    world_t w;
    world_open(&w, g);
    kvp_backend_t *b = w.b;
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(0xfd));
    plan_t p;
    memset(&p, 0, sizeof(p));
    p.B = 3;
    uint32_t next_free = 0;
    const uint32_t toks[] = {17, 1, 40};
    plan_grow(&p, g, toks, &next_free);
    const uint64_t row = b->derived.row_bytes;
    const uint32_t H = b->derived.heads;
    size_t bytes = (size_t)2 * p.nnz * H * row * g->num_layers;

    int fd = memfd_create("test-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(ftruncate(fd, (off_t)bytes), 0);
    uint8_t *host = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ck_assert(host != MAP_FAILED);
    kvp_rng_fill(&r, host, bytes);
    kvp_buffer_t buf;
    uint8_t done[KVP_BACKEND_IPC_HANDLE_BYTES];
    uint32_t done_len;
    /* unsealed: refused, nothing kept */
    ck_assert_int_eq(
        b->ops->import_buffer(
            b,
            &(kvp_import_req_t){
                .kind = kvpool_BufferKind_BUFFER_MEMFD, .fd = fd, .size_bytes = bytes, .device = 0},
            &buf, done, &done_len),
        KVP_EPERM);
    ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    ck_assert_int_eq(
        b->ops->import_buffer(
            b,
            &(kvp_import_req_t){
                .kind = kvpool_BufferKind_BUFFER_MEMFD, .fd = fd, .size_bytes = bytes, .device = 0},
            &buf, done, &done_len),
        0);
    kvp_exec_t e = plan_exec(&p, &buf, row, H, 0, g->num_layers);
    ck_assert_int_eq(b->ops->run(b, &e), 0);
    reference(b, w.ref, &e, host);
    world_compare(&w, "memfd source");
    b->ops->release_buffer(b, &buf);
    munmap(host, bytes);
    world_close(&w);
}
END_TEST

START_TEST(refused_imports_and_sources_leave_it_healthy)
{
    const kvp_geom_t *g = &GEOMS[0];
    world_t w;
    world_open(&w, g);
    kvp_backend_t *b = w.b;
    kvp_cuda_vmm_t m;
    ck_assert_int_eq(kvp_cuda_vmm_alloc(0, 1, &m), 0);
    int fd = -1;
    ck_assert_int_eq(kvp_cuda_vmm_export(&m, &fd), 0);
    kvp_buffer_t buf;
    memset(&buf, 0, sizeof(buf));
    uint8_t done[KVP_BACKEND_IPC_HANDLE_BYTES];
    uint32_t done_len;
    expected_begin("imports of a too large claim, another device, garbage IPC and event handles");
    /* claims twice what it exported: the map is refused */
    int rc = b->ops->import_buffer(b,
                                   &(kvp_import_req_t){.kind = kvpool_BufferKind_BUFFER_CUDA_VMM_FD,
                                                       .fd = fd,
                                                       .size_bytes = 2 * m.size,
                                                       .device = 0},
                                   &buf, done, &done_len);
    ck_assert_int_ne(rc, 0);
    ck_assert_int_ne(rc, KVP_EINTERNAL);
    ck_assert_int_ge(fcntl(fd, F_GETFD), 0); /* on failure the fd stays the caller's */
    /* a device that is not the pool's */
    ck_assert_int_eq(
        b->ops->import_buffer(b,
                              &(kvp_import_req_t){.kind = kvpool_BufferKind_BUFFER_CUDA_VMM_FD,
                                                  .fd = fd,
                                                  .size_bytes = m.size,
                                                  .device = 7},
                              &buf, done, &done_len),
        KVP_EINVAL);
    /* a garbage legacy IPC handle, and one of the wrong length */
    uint8_t junk[KVP_BACKEND_IPC_HANDLE_BYTES];
    memset(junk, 0x5a, sizeof(junk));
    rc = b->ops->import_buffer(b,
                               &(kvp_import_req_t){.kind = kvpool_BufferKind_BUFFER_CUDA_IPC,
                                                   .fd = -1,
                                                   .size_bytes = 4096,
                                                   .device = 0,
                                                   .ipc_handle = junk,
                                                   .ipc_len = sizeof(junk)},
                               &buf, done, &done_len);
    ck_assert_int_ne(rc, 0);
    ck_assert_int_eq(
        b->ops->import_buffer(b,
                              &(kvp_import_req_t){.kind = kvpool_BufferKind_BUFFER_CUDA_IPC,
                                                  .fd = -1,
                                                  .size_bytes = 4096,
                                                  .device = 0,
                                                  .ipc_handle = junk,
                                                  .ipc_len = 10},
                              &buf, done, &done_len),
        KVP_EINVAL);
    /* a garbage event handle with a good buffer */
    rc = b->ops->import_buffer(b,
                               &(kvp_import_req_t){.kind = kvpool_BufferKind_BUFFER_CUDA_VMM_FD,
                                                   .fd = fd,
                                                   .size_bytes = m.size,
                                                   .device = 0,
                                                   .event_handle = junk,
                                                   .event_len = sizeof(junk)},
                               &buf, done, &done_len);
    ck_assert_int_ne(rc, 0);
    expected_end();
    ck_assert_int_eq(b->ops->health(b), 0);

    /* a good import, then a source the 16-byte kernels cannot read: refused before anything */
    ck_assert_int_eq(
        b->ops->import_buffer(b,
                              &(kvp_import_req_t){.kind = kvpool_BufferKind_BUFFER_CUDA_VMM_FD,
                                                  .fd = fd,
                                                  .size_bytes = m.size,
                                                  .device = 0},
                              &buf, done, &done_len),
        0);
    plan_t p;
    memset(&p, 0, sizeof(p));
    p.B = 1;
    uint32_t next_free = 0;
    const uint32_t toks[] = {3};
    plan_grow(&p, g, toks, &next_free);
    kvp_exec_t e = plan_exec(&p, &buf, b->derived.row_bytes, b->derived.heads, 0, 1);
    e.k_offset = 2;
    ck_assert_int_eq(b->ops->run(b, &e), KVP_EINVAL);
    ck_assert_int_eq(b->ops->health(b), 0);
    e.k_offset = 0;
    ck_assert_int_eq(b->ops->run(b, &e), 0);
    ck_assert_int_eq(b->ops->health(b), 0);
    b->ops->release_buffer(b, &buf);
    kvp_cuda_vmm_free(&m);
    world_close(&w);
}
END_TEST

START_TEST(a_bad_position_poisons_the_backend)
{
    const kvp_geom_t *g = &GEOMS[0];
    world_t w;
    world_open(&w, g);
    kvp_backend_t *b = w.b;
    kvp_rng_t r;
    kvp_rng_seed(&r, 7);
    plan_t p;
    memset(&p, 0, sizeof(p));
    p.B = 1;
    uint32_t next_free = 0;
    const uint32_t toks[] = {5};
    plan_grow(&p, g, toks, &next_free);
    /* beyond the pool: the planner never does this */
    p.slots[4] = (int32_t)(g->num_pages * g->page_size);
    kvp_cuda_vmm_t m;
    uint8_t *host;
    kvp_buffer_t buf;
    vmm_buffer(&w, 1 << 20, &r, &m, &host, &buf);
    kvp_exec_t e = plan_exec(&p, &buf, b->derived.row_bytes, b->derived.heads, 0, 1);
    expected_begin("an append with a slot beyond the pool poisons the backend");
    ck_assert_int_eq(b->ops->run(b, &e), KVP_EINTERNAL);
    ck_assert_int_eq(b->ops->health(b), KVP_EINTERNAL);
    ck_assert_int_eq(b->ops->run(b, &e), KVP_EINTERNAL); /* forever after */
    expected_end();
    b->ops->release_buffer(b, &buf);
    kvp_cuda_vmm_free(&m);
    free(host);
    world_close(&w);
}
END_TEST

START_TEST(create_refuses_what_it_cannot_serve)
{
    kvp_backend_t *b = NULL;
    int dev0 = 0, dev_bad = 4096, two[2] = {0, 0};
    kvp_geom_t g = GEOMS[0];
    expected_begin("backends refused for 8-byte rows, device 4096, bad tuning, twice device 0");
    g.head_dim = 4; /* 8-byte rows: the kernels move 16-byte vectors */
    ck_assert_int_eq(kvp_backend_cuda_create(&g, &dev0, 1, NULL, &b), KVP_EINVAL);
    g = GEOMS[0];
    ck_assert_int_eq(kvp_backend_cuda_create(&g, &dev_bad, 1, NULL, &b), KVP_EINVAL);
    ck_assert_int_eq(kvp_backend_cuda_create(&g, two, 2, NULL, &b), KVP_EINVAL); /* G is 1 */
    /* tuning out of the kernels' range ([tuning] checks the same bounds) */
    kvp_backend_tuning_t bad = {.append = {.warps_per_block = KVP_APPEND_CUDA_MAX_WARPS + 1}};
    ck_assert_int_eq(kvp_backend_cuda_create(&g, &dev0, 1, &bad, &b), KVP_EINVAL);
    bad = (kvp_backend_tuning_t){.pack_blocks = KVP_PACK_CUDA_MAX_BLOCKS + 1};
    ck_assert_int_eq(kvp_backend_cuda_create(&g, &dev0, 1, &bad, &b), KVP_EINVAL);
    g.num_devices = 2;
    g.num_kv_heads = 4;
    ck_assert_int_eq(kvp_backend_cuda_create(&g, two, 2, NULL, &b), KVP_EINVAL); /* twice 0 */
    expected_end();
    ck_assert_ptr_null(b);
    ck_assert_int_eq(kvp_backend_cuda_probe(), 1);
}
END_TEST

/* ---- end to end: kvpoold --backend cuda and worker processes ------------------------------ */

#define E2E_LAYERS 2
#define E2E_PAGES  64
#define E2E_PS     16
#define E2E_HEADS  4
#define E2E_DIM    64 /* fp16: 128-byte rows */

static kvp_daemon_t DMN;

static void start_daemon_on(const char *devices)
{
    const char *args[] = {"--backend",
                          "cuda",
                          "--devices",
                          devices,
                          "--num-layers",
                          "2",
                          "--num-pages",
                          "64",
                          "--page-size",
                          "16",
                          "--num-kv-heads",
                          "4",
                          "--head-dim",
                          "64",
                          "--dtype",
                          "fp16",
                          NULL};
    ck_assert_int_eq(kvp_daemon_start(&DMN, args), 0);
}

static void start_daemon(void)
{
    start_daemon_on("0");
}

/* Worker-side failure: print and leave with 1. */
#define W(cond, ...)                                                                               \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "worker %d, line %d: ", (int)getpid(), __LINE__);                      \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            _exit(1);                                                                              \
        }                                                                                          \
    } while (0)

#define WC(call) W((call) == cudaSuccess, "%s failed", #call)

static kvp_client_t *worker_connect(const char *ns)
{
    kvp_client_opts_t o = {.socket_path = DMN.sock,
                           .ns = ns,
                           .client_name = "gpu-worker",
                           .lease_ms = 0,
                           .timeout_ms = 20000,
                           .map_pool = 1};
    kvp_client_t *c = NULL;
    char err[256];
    int rc = kvp_client_connect(&o, &c, err, sizeof(err));
    W(rc == 0, "connect: %s", err);
    return c;
}

/* The worker's CPU reference of its device pool and the arrays of one step. */
typedef struct {
    kvp_client_t *c;
    const kvp_pool_info_t *pi;
    uint8_t *ref, *back;
    int32_t indptr[65], indices[256], last[64], aip[65], seq_lens[64], bidx[1024], pos[1024];
    uint32_t copies[64];
    kvp_page_table_t t;
} wstate_t;

static void wstate_init(wstate_t *s, kvp_client_t *c)
{
    memset(s, 0, sizeof(*s));
    s->c = c;
    s->pi = kvp_client_pool_info(c);
    s->ref = calloc(1, s->pi->pool_bytes);
    s->back = malloc(s->pi->pool_bytes);
    W(s->ref && s->back, "out of memory");
}

static void wtable(wstate_t *s)
{
    memset(&s->t, 0, sizeof(s->t));
    s->t.kv_indptr = s->indptr;
    s->t.kv_indices = s->indices;
    s->t.kv_last_page_len = s->last;
    s->t.append_indptr = s->aip;
    s->t.seq_lens = s->seq_lens;
    s->t.copies = s->copies;
    s->t.cap_batch = 65;
    s->t.cap_indices = 256;
    s->t.cap_copies = 32;
}

static void wlayer(const wstate_t *s, uint8_t *pool, uint32_t l, kvp_paged_kv_t *kv)
{
    const kvp_pool_info_t *pi = s->pi;
    memset(kv, 0, sizeof(*kv));
    kv->k_data = pool + (uint64_t)l * pi->layer_bytes;
    kv->v_data = (uint8_t *)kv->k_data + pi->v_offset_bytes;
    kv->elem_bytes = pi->elem_bytes;
    kv->num_pages = pi->num_pages;
    kv->page_size = pi->page_size;
    kv->num_heads = pi->heads_per_device;
    kv->head_dim = pi->head_dim;
    kv->stride_page = pi->stride_page;
    kv->stride_n = pi->stride_n;
    kv->stride_h = pi->stride_h;
    kv->batch_size = s->t.batch_size;
    kv->kv_indptr = s->indptr;
    kv->kv_indices = s->indices;
    kv->kv_last_page_len = s->last;
}

/* Source layout of every worker step: per layer K [nnz, H, D] then V, contiguous. */
static kvp_source_t wsource(const wstate_t *s, uint32_t id, uint32_t nnz)
{
    uint64_t row = (uint64_t)s->pi->head_dim * s->pi->elem_bytes, H = s->pi->heads_per_device;
    uint64_t kv = nnz * H * row;
    return (kvp_source_t){.buffer_id = id,
                          .k_offset = 0,
                          .v_offset = kv,
                          .k_stride_n = H * row,
                          .k_stride_h = row,
                          .v_stride_n = H * row,
                          .v_stride_h = row,
                          .layer_stride = 2 * kv,
                          .layer_begin = 0,
                          .layer_end = 0};
}

/* Applies the reply in s->t (copies, then the append of src_host laid out as wsource says)
 * to the reference. */
static void wreference(wstate_t *s, const uint8_t *src_host)
{
    kvp_paged_kv_t kv;
    const kvp_pool_info_t *pi = s->pi;
    uint32_t nnz = s->t.nnz;
    W(kvp_get_batch_indices_positions_cpu(s->aip, s->seq_lens, s->t.batch_size, nnz, s->bidx,
                                          s->pos) == 0,
      "positions");
    for (uint32_t l = 0; l < pi->num_layers && s->t.num_copies; l++) {
        wlayer(s, s->ref, l, &kv);
        W(kvp_page_copy_cpu(&kv, (const kvp_page_copy_t *)s->copies, s->t.num_copies) == 0, "copy");
    }
    kvp_source_t src = wsource(s, 0, nnz);
    uint64_t e = pi->elem_bytes;
    for (uint32_t l = 0; l < pi->num_layers; l++) {
        wlayer(s, s->ref, l, &kv);
        const uint8_t *base = src_host + l * src.layer_stride;
        kvp_append_src_t a = {.key = base + src.k_offset,
                              .value = base + src.v_offset,
                              .k_stride_n = (int64_t)(src.k_stride_n / e),
                              .k_stride_h = (int64_t)(src.k_stride_h / e),
                              .v_stride_n = (int64_t)(src.v_stride_n / e),
                              .v_stride_h = (int64_t)(src.v_stride_h / e)};
        W(kvp_append_paged_kv_cache_cpu(&kv, &a, s->bidx, s->pos, nnz) == 0, "cpu append");
    }
}

/* Reads the pool of device index g back through the worker's own mapping and compares it
 * with the reference. */
static void wcompare(wstate_t *s, uint32_t g, const char *what)
{
    void *base = kvp_client_pool_base(s->c, g);
    WC(cudaMemcpy(s->back, base, s->pi->pool_bytes, cudaMemcpyDeviceToHost));
    size_t i = 0;
    while (i < s->pi->pool_bytes && s->back[i] == s->ref[i])
        i++;
    W(i == s->pi->pool_bytes, "%s: pool differs from the reference at byte %zu", what, i);
}

/* Fills dev (bytes) with random bytes, keeping them in host. */
static void wfill(kvp_rng_t *r, void *dev, uint8_t *host, size_t bytes)
{
    kvp_rng_fill(r, host, bytes);
    WC(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
}

/* A worker on the pool of device index g (its heads): every kind of append, each compared with
 * the CPU reference through the worker's own mapping. 0 when all went well. */
static int worker_run(const char *ns, uint32_t g)
{
    kvp_client_t *c = worker_connect(ns);
    wstate_t s;
    wstate_init(&s, c);
    const kvp_pool_info_t *pi = s.pi;
    W(pi->backend == 1 && pi->map_granularity > 0 && g < pi->num_devices, "pool info");
    const int device = pi->device_ids[g];
    W(kvp_client_cuda_map_pool(c) == 0, "map_pool: %s", kvp_client_last_error(c));
    W(kvp_client_cuda_map_pool(c) == 0, "map_pool twice");
    for (uint32_t i = 0; i < pi->num_devices; i++)
        W(kvp_client_pool_base(c, i) != NULL, "no device base for device index %u", i);
    WC(cudaSetDevice(device));
    /* the reference starts from the pool as it is: pages earlier namespaces freed keep their
     * bytes, and nothing else runs while this worker does */
    WC(cudaMemcpy(s.ref, kvp_client_pool_base(c, g), pi->pool_bytes, cudaMemcpyDeviceToHost));
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(0xe2e));
    cudaStream_t st;
    WC(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const uint64_t row = (uint64_t)pi->head_dim * pi->elem_bytes;
    const size_t max_bytes = (size_t)2 * 256 * pi->heads_per_device * row * pi->num_layers;
    uint8_t *host = malloc(max_bytes);

    /* 1: VMM buffer with events, the seed example's lengths, ordered on the GPU */
    void *dbuf;
    uint32_t vmm_id;
    W(kvp_client_cuda_alloc_buffer(c, max_bytes, device, &dbuf, &vmm_id, 1) == 0, "alloc: %s",
      kvp_client_last_error(c));
    W(((uintptr_t)dbuf & 15) == 0, "buffer alignment");
    uint64_t ids[4] = {1, 2, 3, 4};
    uint32_t toks[4] = {45, 8, 25, 22};
    kvp_source_t src = wsource(&s, vmm_id, 100);
    wfill(&r, dbuf, host, max_bytes);
    wtable(&s);
    W(kvp_client_cuda_append_async(c, ids, toks, 4, &src, &s.t, st) == 0, "append_async: %s",
      kvp_client_last_error(c));
    WC(cudaStreamSynchronize(st));
    W(s.t.nnz == 100 && s.t.batch_size == 4, "table");
    wreference(&s, host);
    wcompare(&s, g, "event-ordered VMM append");

    /* 2: fork 1 -> 5 (its last page is shared), then one token each for 1 and 5: the daemon
     * copies the shared page first (copy-on-write) */
    W(kvp_client_fork(c, 1, 5) == 0, "fork: %s", kvp_client_last_error(c));
    uint64_t ids2[2] = {1, 5};
    uint32_t toks2[2] = {1, 1};
    src = wsource(&s, vmm_id, 2);
    /* the previous append is done (synchronised), so the buffer may be rewritten */
    wfill(&r, dbuf, host, max_bytes);
    wtable(&s);
    W(kvp_client_cuda_append_async(c, ids2, toks2, 2, &src, &s.t, st) == 0, "append_async 2: %s",
      kvp_client_last_error(c));
    WC(cudaStreamSynchronize(st));
    W(s.t.num_copies == 1, "expected one copy-on-write copy, got %u", s.t.num_copies);
    wreference(&s, host);
    wcompare(&s, g, "append with copy-on-write");

    /* 3: Reserve + in-process append on the mapped pool, with a copy-on-write again */
    W(kvp_client_fork(c, 2, 6) == 0, "fork 2");
    uint64_t ids3[3] = {2, 6, 3};
    uint32_t toks3[3] = {3, 2, 7};
    wtable(&s);
    W(kvp_client_reserve(c, ids3, toks3, 3, &s.t) == 0, "reserve: %s", kvp_client_last_error(c));
    W(s.t.num_copies == 1, "reserve: expected one copy, got %u", s.t.num_copies);
    uint32_t nnz = s.t.nnz;
    W(kvp_get_batch_indices_positions_cpu(s.aip, s.seq_lens, s.t.batch_size, nnz, s.bidx, s.pos) ==
          0,
      "positions");
    int32_t *d_words;
    size_t words = 65 + 256 + 64 + 1024 + 1024;
    WC(cudaMalloc((void **)&d_words, words * 4));
    int32_t *d_indptr = d_words, *d_indices = d_indptr + 65, *d_last = d_indices + 256,
            *d_bidx = d_last + 64, *d_pos = d_bidx + 1024;
    WC(cudaMemcpy(d_indptr, s.indptr, 4 * (s.t.batch_size + 1), cudaMemcpyHostToDevice));
    WC(cudaMemcpy(d_indices, s.indices, 4 * s.t.num_indices, cudaMemcpyHostToDevice));
    WC(cudaMemcpy(d_last, s.last, 4 * s.t.batch_size, cudaMemcpyHostToDevice));
    WC(cudaMemcpy(d_bidx, s.bidx, 4 * nnz, cudaMemcpyHostToDevice));
    WC(cudaMemcpy(d_pos, s.pos, 4 * nnz, cudaMemcpyHostToDevice));
    void *dsrc;
    WC(cudaMalloc(&dsrc, max_bytes));
    wfill(&r, dsrc, host, max_bytes);
    W(kvp_client_cuda_copy_pages(c, &s.t, st) == 0, "copy_pages: %s", kvp_client_last_error(c));
    kvp_source_t ls = wsource(&s, 0, nnz);
    for (uint32_t l = 0; l < pi->num_layers; l++) {
        kvp_paged_kv_t kv;
        wlayer(&s, kvp_client_pool_base(c, g), l, &kv);
        kv.kv_indptr = d_indptr;
        kv.kv_indices = d_indices;
        kv.kv_last_page_len = d_last;
        const uint8_t *base = (const uint8_t *)dsrc + l * ls.layer_stride;
        kvp_append_src_t a = {.key = base,
                              .value = base + ls.v_offset,
                              .k_stride_n = (int64_t)(ls.k_stride_n / pi->elem_bytes),
                              .k_stride_h = (int64_t)(ls.k_stride_h / pi->elem_bytes),
                              .v_stride_n = (int64_t)(ls.v_stride_n / pi->elem_bytes),
                              .v_stride_h = (int64_t)(ls.v_stride_h / pi->elem_bytes)};
        W(kvp_append_paged_kv_cache_cuda_unchecked(&kv, &a, d_bidx, d_pos, nnz, NULL, st) == 0,
          "in-process append");
    }
    WC(cudaStreamSynchronize(st));
    wreference(&s, host);
    wcompare(&s, g, "reserve + in-process append");

    /* 4: a legacy IPC buffer registered at an interior pointer (as a PyTorch tensor would be) */
    uint8_t *ipc_alloc;
    WC(cudaMalloc((void **)&ipc_alloc, max_bytes + 4096));
    uint32_t ipc_id;
    W(kvp_client_cuda_register_ipc(c, ipc_alloc + 4096, max_bytes, &ipc_id) == 0,
      "register_ipc: %s", kvp_client_last_error(c));
    uint64_t ids4[2] = {7, 3};
    uint32_t toks4[2] = {33, 4};
    src = wsource(&s, ipc_id, 37);
    wfill(&r, ipc_alloc + 4096, host, max_bytes);
    wtable(&s);
    W(kvp_client_cuda_append_async(c, ids4, toks4, 2, &src, &s.t, st) == 0, "ipc append: %s",
      kvp_client_last_error(c));
    WC(cudaStreamSynchronize(st));
    wreference(&s, host);
    wcompare(&s, g, "IPC buffer append");

    /* 5: a host memfd buffer appended by a cuda daemon (read over the bus; a memfd carries
     * no device, so it feeds device index 0) */
    if (g == 0) {
        void *hbuf;
        uint32_t host_id;
        W(kvp_client_alloc_host_buffer(c, max_bytes, &hbuf, &host_id) == 0, "host buffer: %s",
          kvp_client_last_error(c));
        kvp_rng_fill(&r, hbuf, max_bytes);
        uint64_t ids5[1] = {8};
        uint32_t toks5[1] = {19};
        src = wsource(&s, host_id, 19);
        wtable(&s);
        W(kvp_client_append(c, ids5, toks5, 1, &src, &s.t) == 0, "host append: %s",
          kvp_client_last_error(c));
        wreference(&s, hbuf);
        wcompare(&s, 0, "memfd buffer append");
    }

    W(kvp_client_audit(c) == 0, "audit: %s", kvp_client_last_error(c));
    W(kvp_client_cuda_free_buffer(c, ipc_id) == 0, "free ipc: %s", kvp_client_last_error(c));
    W(kvp_client_cuda_free_buffer(c, vmm_id) == 0, "free vmm: %s", kvp_client_last_error(c));
    W(kvp_client_cuda_free_buffer(c, vmm_id) == KVP_ENOENT, "double free");
    WC(cudaFree(ipc_alloc));
    WC(cudaFree(dsrc));
    WC(cudaFree(d_words));
    WC(cudaStreamDestroy(st));
    kvp_client_close(c);
    free(host);
    return 0;
}

static int wait_child(pid_t pid)
{
    int st;
    while (waitpid(pid, &st, 0) < 0)
        ;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void daemon_healthy(void)
{
    /* the tick (100 ms) would have made an unhealthy daemon exit 70 */
    struct timespec ts = {0, 300 * 1000 * 1000};
    nanosleep(&ts, NULL);
    ck_assert_int_eq(kill(DMN.pid, 0), 0);
    kvp_client_opts_t o = {.socket_path = DMN.sock, .ns = "observer", .timeout_ms = 20000};
    kvp_client_t *c = NULL;
    char err[256];
    ck_assert_msg(kvp_client_connect(&o, &c, err, sizeof(err)) == 0, "%s", err);
    ck_assert_int_eq(kvp_client_ping(c, NULL), 0);
    ck_assert_msg(kvp_client_audit(c) == 0, "%s", kvp_client_last_error(c)); /* refused if sick */
    kvp_client_close(c);
}

START_TEST(e2e_worker_appends_land_byte_exact)
{
    start_daemon();
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0)
        _exit(worker_run("gpu-e2e", 0));
    int code = wait_child(pid);
    if (code)
        kvp_daemon_dump_log(&DMN);
    ck_assert_int_eq(code, 0);
    daemon_healthy();
    ck_assert_int_eq(kvp_daemon_stop(&DMN, SIGTERM), 0);
}
END_TEST

/* Appends without ever waiting, telling the parent once it is under way. */
static int doomed_main(int ready_fd)
{
    kvp_client_t *c = worker_connect("gpu-doomed");
    W(kvp_client_cuda_map_pool(c) == 0, "map_pool: %s", kvp_client_last_error(c));
    cudaStream_t st;
    WC(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    void *dbuf;
    uint32_t id;
    const uint64_t row = (uint64_t)E2E_DIM * 2, kv = 1 * E2E_HEADS * row;
    W(kvp_client_cuda_alloc_buffer(c, 2 * kv * E2E_LAYERS, 0, &dbuf, &id, 1) == 0, "alloc: %s",
      kvp_client_last_error(c));
    kvp_source_t src = {.buffer_id = id,
                        .v_offset = kv,
                        .k_stride_n = E2E_HEADS * row,
                        .k_stride_h = row,
                        .v_stride_n = E2E_HEADS * row,
                        .v_stride_h = row,
                        .layer_stride = 2 * kv};
    for (uint32_t i = 0;; i++) {
        uint64_t sid = 100 + i % 8;
        uint32_t one = 1;
        WC(cudaMemsetAsync(dbuf, (int)i, 2 * kv * E2E_LAYERS, st));
        int rc = kvp_client_cuda_append_async(c, &sid, &one, 1, &src, NULL, st);
        if (rc == KVP_ENOSPC) {
            uint64_t all[8] = {100, 101, 102, 103, 104, 105, 106, 107};
            W(kvp_client_release(c, all, 8, NULL) == 0, "release");
            continue;
        }
        W(rc == 0, "append_async: %s", kvp_client_last_error(c));
        if (i == 20 && write(ready_fd, "x", 1) != 1)
            _exit(1);
    }
}

START_TEST(e2e_worker_killed_mid_stream_leaves_daemon_healthy)
{
    start_daemon();
    int p[2];
    ck_assert_int_eq(pipe(p), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(p[0]);
        _exit(doomed_main(p[1]));
    }
    close(p[1]);
    char x;
    ck_assert_int_eq(read(p[0], &x, 1), 1);
    kill(pid, SIGKILL);
    ck_assert_int_eq(wait_child(pid), 128 + SIGKILL);
    close(p[0]);
    daemon_healthy();
    /* and it still serves GPU work: a whole worker run after the death */
    pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0)
        _exit(worker_run("gpu-e2e", 0));
    int code = wait_child(pid);
    if (code)
        kvp_daemon_dump_log(&DMN);
    ck_assert_int_eq(code, 0);
    daemon_healthy();
    ck_assert_int_eq(kvp_daemon_stop(&DMN, SIGTERM), 0);
}
END_TEST

/* Queues seconds of GPU work, says so, then sends an event-ordered append behind that
 * work and is killed while the daemon waits for its ready event. */
static int doomed_busy_main(int ready_fd)
{
    kvp_client_t *c = worker_connect("gpu-doomed-busy");
    cudaStream_t st;
    WC(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    void *dbuf, *big;
    uint32_t id;
    const uint64_t row = (uint64_t)E2E_DIM * 2, kv = 1 * E2E_HEADS * row;
    W(kvp_client_cuda_alloc_buffer(c, 2 * kv * E2E_LAYERS, 0, &dbuf, &id, 1) == 0, "alloc: %s",
      kvp_client_last_error(c));
    const size_t big_bytes = (size_t)16 << 30; /* 400 x 16 GiB: a few seconds of work */
    WC(cudaMalloc(&big, big_bytes));
    for (int i = 0; i < 400; i++)
        WC(cudaMemsetAsync(big, i, big_bytes, st));
    kvp_source_t src = {.buffer_id = id,
                        .v_offset = kv,
                        .k_stride_n = E2E_HEADS * row,
                        .k_stride_h = row,
                        .v_stride_n = E2E_HEADS * row,
                        .v_stride_h = row,
                        .layer_stride = 2 * kv};
    uint64_t sid = 42;
    uint32_t one = 1;
    W(cudaStreamQuery(st) == cudaErrorNotReady, "the stream should still be busy");
    if (write(ready_fd, "x", 1) != 1)
        _exit(1);
    /* blocks: the daemon answers once the ready event completes, which it never will */
    kvp_client_cuda_append_async(c, &sid, &one, 1, &src, NULL, st);
    for (;;)
        pause();
}

START_TEST(e2e_worker_killed_while_the_daemon_waits_for_it)
{
    setenv("KVPOOL_CUDA_READY_TIMEOUT_MS", "3000", 1); /* for the daemon started next */
    start_daemon();
    int p[2];
    ck_assert_int_eq(pipe(p), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(p[0]);
        _exit(doomed_busy_main(p[1]));
    }
    close(p[1]);
    char x;
    ck_assert_int_eq(read(p[0], &x, 1), 1);
    struct timespec ts = {0, 300 * 1000 * 1000}; /* the append is in flight by then */
    nanosleep(&ts, NULL);
    kill(pid, SIGKILL);
    ck_assert_int_eq(wait_child(pid), 128 + SIGKILL);
    close(p[0]);
    daemon_healthy();
    /* other namespaces are served while the dead worker's append waits out its timeout, and
     * after it */
    pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0)
        _exit(worker_run("gpu-after-death", 0));
    ck_assert_int_eq(wait_child(pid), 0);
    ts.tv_sec = 3;
    ts.tv_nsec = 500 * 1000 * 1000;
    nanosleep(&ts, NULL);
    daemon_healthy();
    pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0)
        _exit(worker_run("gpu-after-timeout", 0));
    int code = wait_child(pid);
    if (code)
        kvp_daemon_dump_log(&DMN);
    ck_assert_int_eq(code, 0);
    daemon_healthy();
    ck_assert_int_eq(kvp_daemon_stop(&DMN, SIGTERM), 0);
}
END_TEST

/* ---- two devices (tensor parallelism): skipped with fewer ------------------------------- */

START_TEST(two_devices_copy_everywhere_append_where_the_buffer_lives)
{
    if (kvp_gpu_count() < 2)
        return;
    kvp_geom_t g = GEOMS[0];
    g.num_devices = 2; /* 4 heads: 2 per device */
    int devs[2] = {0, 1};
    kvp_backend_t *b;
    ck_assert_int_eq(kvp_backend_cuda_create(&g, devs, 2, test_tuning(), &b), 0);
    ck_assert_uint_eq(b->derived.heads, 2);
    ck_assert_uint_eq(b->num_device_ids, 2);
    int fds[4];
    ck_assert_int_eq(b->ops->export_fds(b, fds, 4), 2);
    kvp_cuda_vmm_t view[2], m[2];
    uint8_t *ref[2], *back = malloc(b->derived.pool_bytes), *host[2];
    kvp_buffer_t buf[2];
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(0x2d));
    const uint64_t row = b->derived.row_bytes;
    const uint32_t H = b->derived.heads, L = g.num_layers;
    for (int d = 0; d < 2; d++) {
        CK(cudaSetDevice(d));
        ck_assert_int_eq(kvp_cuda_vmm_import(fds[d], d, b->map_bytes, &view[d], NULL), 0);
        ref[d] = calloc(1, b->derived.pool_bytes);
        size_t bytes = (size_t)2 * 512 * H * row * L;
        ck_assert_int_eq(kvp_cuda_vmm_alloc(d, bytes, &m[d]), 0);
        host[d] = malloc(m[d].size);
        kvp_rng_fill(&r, host[d], m[d].size);
        CK(cudaMemcpy((void *)(uintptr_t)m[d].ptr, host[d], m[d].size, cudaMemcpyHostToDevice));
        int fd;
        ck_assert_int_eq(kvp_cuda_vmm_export(&m[d], &fd), 0);
        uint8_t done[KVP_BACKEND_IPC_HANDLE_BYTES];
        uint32_t dl;
        ck_assert_int_eq(
            b->ops->import_buffer(b,
                                  &(kvp_import_req_t){.kind = kvpool_BufferKind_BUFFER_CUDA_VMM_FD,
                                                      .fd = fd,
                                                      .size_bytes = m[d].size,
                                                      .device = d},
                                  &buf[d], done, &dl),
            0);
    }
    /* both ranks append their heads of the same batch */
    plan_t p;
    memset(&p, 0, sizeof(p));
    p.B = 2;
    uint32_t next_free = 0;
    const uint32_t toks1[] = {20, 9};
    plan_grow(&p, &g, toks1, &next_free);
    for (int d = 0; d < 2; d++) {
        kvp_exec_t e = plan_exec(&p, &buf[d], row, H, 0, L);
        ck_assert_int_eq(b->ops->run(b, &e), 0);
        reference(b, ref[d], &e, host[d]);
    }
    /* rank 1's next step carries a copy: it must happen on device 0's pool too */
    p.num_copies = 1;
    p.copies[0] = (kvp_page_copy_t){(uint32_t)p.pages[0][1], next_free++};
    const uint32_t toks2[] = {1, 1};
    plan_grow(&p, &g, toks2, &next_free);
    kvp_exec_t e = plan_exec(&p, &buf[1], row, H, 0, L);
    ck_assert_int_eq(b->ops->run(b, &e), 0);
    reference(b, ref[1], &e, host[1]);
    kvp_exec_t copies_only = e;
    copies_only.layer_begin = copies_only.layer_end = 0; /* the copies alone */
    reference(b, ref[0], &copies_only, NULL);
    for (int d = 0; d < 2; d++) {
        CK(cudaSetDevice(d));
        CK(cudaMemcpy(back, (void *)(uintptr_t)view[d].ptr, b->derived.pool_bytes,
                      cudaMemcpyDeviceToHost));
        ck_assert_msg(memcmp(back, ref[d], b->derived.pool_bytes) == 0, "device %d differs", d);
    }
    ck_assert_int_eq(b->ops->health(b), 0);
    for (int d = 0; d < 2; d++) {
        b->ops->release_buffer(b, &buf[d]);
        kvp_cuda_vmm_free(&m[d]);
        kvp_cuda_vmm_free(&view[d]);
        free(ref[d]);
        free(host[d]);
    }
    free(back);
    b->ops->destroy(b);
}
END_TEST

START_TEST(e2e_two_devices_worker_on_the_second)
{
    if (kvp_gpu_count() < 2)
        return;
    start_daemon_on("0,1");
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0)
        _exit(worker_run("gpu-tp", 1));
    int code = wait_child(pid);
    if (code)
        kvp_daemon_dump_log(&DMN);
    ck_assert_int_eq(code, 0);
    daemon_healthy();
    ck_assert_int_eq(kvp_daemon_stop(&DMN, SIGTERM), 0);
}
END_TEST

int main(void)
{
    if (kvp_gpu_count() < 1) {
        printf("no usable GPU: skipped\n");
        return 77;
    }
    Suite *s = suite_create("cuda_backend");
    TCase *direct = tcase_create("direct");
    tcase_set_timeout(direct, 300);
    tcase_add_loop_test(direct, direct_append_and_copies_match_cpu, 0,
                        (int)(sizeof(GEOMS) / sizeof(GEOMS[0])));
    tcase_add_loop_test(direct, pages_move_out_and_back_through_the_page_mover, 0,
                        (int)(sizeof(GEOMS) / sizeof(GEOMS[0])));
    tcase_add_test(direct, memfd_buffer_is_read_over_the_bus);
    tcase_add_test(direct, refused_imports_and_sources_leave_it_healthy);
    tcase_add_test(direct, a_bad_position_poisons_the_backend);
    tcase_add_test(direct, create_refuses_what_it_cannot_serve);
    suite_add_tcase(s, direct);
    TCase *e2e = tcase_create("e2e");
    tcase_set_timeout(e2e, 300);
    tcase_add_test(e2e, e2e_worker_appends_land_byte_exact);
    tcase_add_test(e2e, e2e_worker_killed_mid_stream_leaves_daemon_healthy);
    suite_add_tcase(s, e2e);
    /* apart, with a short timeout: if a dead worker's event could stall the daemon's stream,
     * this is where it would hang */
    TCase *death = tcase_create("death");
    tcase_set_timeout(death, 90);
    tcase_add_test(death, e2e_worker_killed_while_the_daemon_waits_for_it);
    suite_add_tcase(s, death);
    TCase *tp = tcase_create("two_devices");
    tcase_set_timeout(tp, 300);
    tcase_add_test(tp, two_devices_copy_everywhere_append_where_the_buffer_lives);
    tcase_add_test(tp, e2e_two_devices_worker_on_the_second);
    suite_add_tcase(s, tp);
    SRunner *sr = srunner_create(s);
    srunner_set_fork_status(sr, CK_FORK); /* a fresh process, and CUDA context, per test */
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
