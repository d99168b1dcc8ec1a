/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_backend_host.c - the host backend (backend/kvp_backend_host.c) through its operations
 * table (backend/kvp_backend.h), without the dispatch: the pool memfd it exports (size, seals,
 * zeroed), the import of a worker's staging buffer (a sealed memfd, as the daemon gets it over
 * SCM_RIGHTS) and its refusals, and run(): an append plan lands byte-exact where DESIGN.md §1
 * puts every token (checked against a reference written here from the tensor shapes, for each
 * layout, storage and element size, over the WHOLE pool, so nothing else is written), the
 * layer range, copy-on-write copies in every layer before the append, and plans it refuses
 * with the pool unchanged; the page-mover (move), out to host memory and back, byte-exact;
 * the gather (a Load's copy) into a writable memfd, byte-exact, and its refusals (a read-only
 * buffer, a slot past the pool) with the buffer unchanged.
 *
 * Not here: the check of an Append's source offsets and strides against the buffer's size.
 * The backend's contract is that the dispatch validated them before run() (kvp_backend.h,
 * kvp_exec_t); that check is the rpc layer's and is tested with it (tests/unit/test_rpc.c).
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvp_backend.h"
#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_test_util.h"
#include "kvpool.pb.h"

/* The geometries the plans run on: every layout and storage, the three element sizes. */
static const kvp_geom_t GEOMS[] = {
    {.num_layers = 2,
     .num_pages = 8,
     .page_size = 4,
     .num_kv_heads = 2,
     .head_dim = 8,
     .dtype = KVP_DTYPE_FP16,
     .layout = KVP_LAYOUT_NHD,
     .storage = KVP_STORAGE_COMBINED,
     .num_devices = 1},
    {.num_layers = 2,
     .num_pages = 8,
     .page_size = 4,
     .num_kv_heads = 3,
     .head_dim = 16,
     .dtype = KVP_DTYPE_FP8_E4M3,
     .layout = KVP_LAYOUT_HND,
     .storage = KVP_STORAGE_COMBINED,
     .num_devices = 1},
    {.num_layers = 3,
     .num_pages = 8,
     .page_size = 4,
     .num_kv_heads = 2,
     .head_dim = 4,
     .dtype = KVP_DTYPE_FP32,
     .layout = KVP_LAYOUT_NHD,
     .storage = KVP_STORAGE_SPLIT,
     .num_devices = 1},
    {.num_layers = 2,
     .num_pages = 8,
     .page_size = 4,
     .num_kv_heads = 4,
     .head_dim = 8,
     .dtype = KVP_DTYPE_BF16,
     .layout = KVP_LAYOUT_HND,
     .storage = KVP_STORAGE_SPLIT,
     .num_devices = 1},
};
#define NUM_GEOMS (sizeof(GEOMS) / sizeof(GEOMS[0]))

static uint64_t elem_of(const kvp_geom_t *g)
{
    return g->dtype == KVP_DTYPE_FP32 ? 4 : g->dtype <= KVP_DTYPE_FP8_E5M2 ? 1 : 2;
}

/* Bytes of one page's K (or V) in one layer: page_size * H * D elements. */
static uint64_t page_kv_bytes(const kvp_geom_t *g)
{
    return (uint64_t)g->page_size * g->num_kv_heads * g->head_dim * elem_of(g);
}

static uint64_t layer_bytes(const kvp_geom_t *g)
{
    return 2 * (uint64_t)g->num_pages * page_kv_bytes(g);
}

/* Where (layer, page, K|V, slot, head) lives, from the shapes of DESIGN.md §1 alone (not from
 * kvp_geom): combined [P, 2, S, H, D] (NHD) / [P, 2, H, S, D] (HND); split a K tensor
 * [P, S, H, D] / [P, H, S, D] followed by the V tensor; the layers one after another. */
static uint64_t ref_offset(const kvp_geom_t *g, uint32_t l, uint32_t page, int kv, uint32_t slot,
                           uint32_t h)
{
    const uint64_t S = g->page_size, H = g->num_kv_heads, D = g->head_dim, e = elem_of(g);
    uint64_t in_page = g->layout == KVP_LAYOUT_NHD ? (slot * H + h) * D : (h * S + slot) * D;
    uint64_t elems;
    if (g->storage == KVP_STORAGE_COMBINED)
        elems = ((uint64_t)page * 2 + (uint64_t)kv) * S * H * D + in_page;
    else
        elems = (uint64_t)kv * g->num_pages * S * H * D + (uint64_t)page * S * H * D + in_page;
    return l * layer_bytes(g) + elems * e;
}

/* A worker's staging buffer: a memfd sealed against shrinking and growing, mapped here. */
static int make_staging(size_t bytes, int seal, uint8_t **map)
{
    int fd = memfd_create("test-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(ftruncate(fd, (off_t)bytes), 0);
    if (seal)
        ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    *map = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ck_assert_ptr_ne(*map, MAP_FAILED);
    return fd;
}

static int import_memfd(kvp_backend_t *b, int fd, uint64_t size, kvp_buffer_t *out)
{
    uint8_t done[KVP_BACKEND_IPC_HANDLE_BYTES];
    uint32_t done_len = 99;
    int rc = b->ops->import_buffer(
        b,
        &(kvp_import_req_t){
            .kind = kvpool_BufferKind_BUFFER_MEMFD, .fd = fd, .size_bytes = size, .device = 0},
        out, done, &done_len);
    ck_assert_uint_eq(done_len, 0); /* host memory: never a done event */
    return rc;
}

static int fd_is_open(int fd)
{
    return fcntl(fd, F_GETFD) >= 0 || errno != EBADF;
}

/* The backend, its exported pool mapped writable (as a worker maps it), the pool's size. */
typedef struct {
    kvp_geom_t g;
    kvp_backend_t *b;
    uint8_t *pool;
    uint64_t bytes;
} fixture_t;

static void open_fixture(fixture_t *f, const kvp_geom_t *g)
{
    f->g = *g;
    ck_assert_int_eq(kvp_backend_host_create(g, &f->b), 0);
    f->bytes = f->b->derived.pool_bytes;
    ck_assert_uint_eq(f->bytes, g->num_layers * layer_bytes(g));
    int fd;
    ck_assert_int_eq(f->b->ops->export_fds(f->b, &fd, 1), 1);
    f->pool = mmap(NULL, f->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ck_assert_ptr_ne(f->pool, MAP_FAILED);
}

static void close_fixture(fixture_t *f)
{
    munmap(f->pool, f->bytes);
    f->b->ops->destroy(f->b);
}

START_TEST(create_exports_one_sealed_zeroed_memfd_of_the_pool_size)
{
    const kvp_geom_t *g = &GEOMS[0];
    kvp_backend_t *b = NULL;
    ck_assert_int_eq(kvp_backend_host_create(g, &b), 0);
    ck_assert_ptr_nonnull(b);
    ck_assert_str_eq(b->ops->name, "host");
    ck_assert_int_eq(b->kind, kvpool_BackendKind_BACKEND_HOST);
    ck_assert_uint_eq(b->src_align_bytes, 0);
    ck_assert_uint_eq(b->map_granularity, 0);
    ck_assert_uint_eq(b->num_device_ids, 0);
    /* 2 layers x 8 pages x (K + V) x 4 tokens x 2 heads x 8 x fp16 */
    ck_assert_uint_eq(b->derived.pool_bytes, 2ull * 8 * 2 * 4 * 2 * 8 * 2);
    ck_assert_int_eq(b->ops->health(b), 0);

    int fds[4] = {-1, -1, -1, -1};
    ck_assert_int_eq(b->ops->export_fds(b, fds, 4), 1);
    ck_assert_int_ge(fds[0], 0);
    ck_assert_int_eq(fds[1], -1);
    ck_assert_int_eq(b->ops->export_fds(b, fds, 0), KVP_EINVAL);
    struct stat st;
    ck_assert_int_eq(fstat(fds[0], &st), 0);
    ck_assert(S_ISREG(st.st_mode));
    ck_assert_uint_eq((uint64_t)st.st_size, b->derived.pool_bytes);
    ck_assert(fcntl(fds[0], F_GETFD) & FD_CLOEXEC); /* never leaks into a child */
    /* a worker may map it but never resize it */
    int seals = fcntl(fds[0], F_GET_SEALS);
    ck_assert_int_eq(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
                     F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    ck_assert_int_ne(ftruncate(fds[0], (off_t)b->derived.pool_bytes * 2), 0);
    ck_assert_int_ne(ftruncate(fds[0], 0), 0);
    uint8_t *p = mmap(NULL, b->derived.pool_bytes, PROT_READ, MAP_SHARED, fds[0], 0);
    ck_assert_ptr_ne(p, MAP_FAILED);
    for (uint64_t i = 0; i < b->derived.pool_bytes; i++)
        KVP_CHECK(p[i] == 0, "pool byte %llu is %u", (unsigned long long)i, p[i]);
    munmap(p, b->derived.pool_bytes);
    /* the fd stays the backend's: exporting again hands out the same one */
    int again = -1;
    ck_assert_int_eq(b->ops->export_fds(b, &again, 1), 1);
    ck_assert_int_eq(again, fds[0]);
    b->ops->destroy(b);
    ck_assert(!fd_is_open(fds[0])); /* destroy closes it */
}
END_TEST

START_TEST(create_refuses_a_bad_geometry)
{
    /* the geometry's own code for the field at fault (kvp_error.h: KVP_EGEOM_*), and *out
     * untouched */
    kvp_geom_t g = GEOMS[0];
    kvp_backend_t *b = (kvp_backend_t *)&g; /* sentinel */
    g.num_layers = 0;
    ck_assert_int_eq(kvp_backend_host_create(&g, &b), KVP_EGEOM_NUM_LAYERS);
    g = GEOMS[0];
    g.head_dim = 0;
    ck_assert_int_eq(kvp_backend_host_create(&g, &b), KVP_EGEOM_HEAD_DIM);
    g = GEOMS[0];
    g.dtype = 0;
    ck_assert_int_eq(kvp_backend_host_create(&g, &b), KVP_EGEOM_DTYPE);
    ck_assert_ptr_eq(b, (kvp_backend_t *)&g);
}
END_TEST

START_TEST(import_maps_a_sealed_memfd_and_takes_the_fd)
{
    fixture_t f;
    open_fixture(&f, &GEOMS[0]);
    uint8_t *stage;
    int fd = make_staging(8192, 1, &stage);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, 11);
    kvp_rng_fill(&rng, stage, 8192);
    kvp_buffer_t buf;
    memset(&buf, 0, sizeof(buf));
    buf.device_index = 7;
    /* a buffer may be registered smaller than its memfd */
    ck_assert_int_eq(import_memfd(f.b, fd, 6000, &buf), 0);
    ck_assert(!fd_is_open(fd)); /* ownership passed on success */
    ck_assert_uint_eq(buf.kind, kvpool_BufferKind_BUFFER_MEMFD);
    ck_assert_uint_eq(buf.size_bytes, 6000);
    ck_assert_uint_eq(buf.device_index, 0);
    ck_assert_ptr_nonnull(buf.host_ptr);
    ck_assert_int_eq(memcmp(buf.host_ptr, stage, 6000), 0);
    /* the daemon's mapping is the worker's memory: a later write by the worker shows */
    stage[100] ^= 0xff;
    ck_assert_uint_eq(((const uint8_t *)buf.host_ptr)[100], stage[100]);
    f.b->ops->release_buffer(f.b, &buf);
    ck_assert_ptr_null(buf.host_ptr);
    munmap(stage, 8192);
    close_fixture(&f);
}
END_TEST

START_TEST(import_refuses_what_it_cannot_safely_map_and_leaves_the_fd)
{
    fixture_t f;
    open_fixture(&f, &GEOMS[0]);
    kvp_buffer_t buf;
    memset(&buf, 0, sizeof(buf));
    uint8_t *m;
    uint8_t done[KVP_BACKEND_IPC_HANDLE_BYTES];
    uint32_t done_len = 99;

    /* an unsealed memfd: its owner could shrink it under the copy thread (SIGBUS) */
    int fd = make_staging(4096, 0, &m);
    ck_assert_int_eq(import_memfd(f.b, fd, 4096, &buf), KVP_EPERM);
    ck_assert(fd_is_open(fd)); /* on failure the caller still owns it */
    close(fd);
    munmap(m, 4096);

    fd = make_staging(4096, 1, &m);
    /* claims more bytes than the memfd has */
    ck_assert_int_eq(import_memfd(f.b, fd, 4097, &buf), KVP_EINVAL);
    ck_assert(fd_is_open(fd));
    /* size 0 */
    ck_assert_int_eq(import_memfd(f.b, fd, 0, &buf), KVP_EINVAL);
    /* a CUDA kind: host memory only */
    ck_assert_int_eq(
        f.b->ops->import_buffer(f.b,
                                &(kvp_import_req_t){.kind = kvpool_BufferKind_BUFFER_CUDA_VMM_FD,
                                                    .fd = fd,
                                                    .size_bytes = 4096,
                                                    .device = 0},
                                &buf, done, &done_len),
        KVP_EINVAL);
    ck_assert_uint_eq(done_len, 0);
    ck_assert(fd_is_open(fd));
    ck_assert_ptr_null(buf.host_ptr);
    close(fd);
    munmap(m, 4096);
    /* no fd, and an fd that is not a file */
    ck_assert_int_eq(import_memfd(f.b, -1, 4096, &buf), KVP_EINVAL);
    int pipefd[2];
    ck_assert_int_eq(pipe(pipefd), 0);
    ck_assert_int_eq(import_memfd(f.b, pipefd[0], 1, &buf), KVP_EINVAL);
    ck_assert(fd_is_open(pipefd[0]));
    close(pipefd[0]);
    close(pipefd[1]);
    ck_assert_ptr_null(buf.host_ptr);
    close_fixture(&f);
}
END_TEST

/* The append plan of the tests below: request 0 holds pages {5, 2} and 6 tokens (all appended
 * now: positions 0..5), request 1 holds page {7} and 3 tokens (1 old, positions 1..2 appended),
 * and token 8 is a padding entry (batch index -1). */
static const int32_t INDPTR[] = {0, 2, 3}, INDICES[] = {5, 2, 7}; /* last_page_len 2, 3 */
static const int32_t BATCH[] = {0, 0, 0, 0, 0, 0, 1, 1, -1};
static const int32_t POS[] = {0, 1, 2, 3, 4, 5, 1, 2, 0};
#define NNZ 9u

/* The source in the staging buffer, per layer: K token-major with a padded row pitch
 * [nnz][H][D] + one spare element per token, V head-major [H][nnz][D]. */
typedef struct {
    uint64_t k_stride_n, k_stride_h, v_stride_n, v_stride_h, k_offset, v_offset, layer_stride;
} src_layout_t;

static src_layout_t src_layout(const kvp_geom_t *g)
{
    const uint64_t e = elem_of(g), row = g->head_dim * e, H = g->num_kv_heads;
    src_layout_t s;
    s.k_offset = 2 * e; /* not at the start of the buffer */
    s.k_stride_h = row;
    s.k_stride_n = H * row + e;
    s.v_offset = s.k_offset + NNZ * s.k_stride_n + 6 * e;
    s.v_stride_n = row;
    s.v_stride_h = NNZ * row;
    s.layer_stride = s.v_offset + H * s.v_stride_h + 4 * e;
    return s;
}

/* The plan's destination as the planner hands it to run() (kvp_plan_slots): each token's pool
 * slot, from BATCH/POS and the page table above (-1 for the padding entry). */
static int32_t SLOTS[NNZ];

static kvp_exec_t plan(const kvp_geom_t *g, const kvp_buffer_t *src, const src_layout_t *s,
                       uint32_t lb, uint32_t le)
{
    const int32_t ps = (int32_t)g->page_size;
    for (uint32_t i = 0; i < NNZ; i++)
        SLOTS[i] = BATCH[i] < 0 ? -1 : INDICES[INDPTR[BATCH[i]] + POS[i] / ps] * ps + POS[i] % ps;
    return (kvp_exec_t){.dest = {.kind = KVP_APPEND_DEST_SLOTS, .nnz = NNZ, .slots = SLOTS},
                        .src = src,
                        .k_offset = s->k_offset,
                        .v_offset = s->v_offset,
                        .k_stride_n = s->k_stride_n,
                        .k_stride_h = s->k_stride_h,
                        .v_stride_n = s->v_stride_n,
                        .v_stride_h = s->v_stride_h,
                        .layer_stride = s->layer_stride,
                        .layer_begin = lb,
                        .layer_end = le};
}

/* What the plan writes into expect: every non-padding token, head, K and V of layers
 * [lb, le), from the source rows at stage. */
static void expect_append(const kvp_geom_t *g, uint8_t *expect, const uint8_t *stage,
                          const src_layout_t *s, uint32_t lb, uint32_t le)
{
    const uint64_t row = g->head_dim * elem_of(g);
    for (uint32_t l = lb; l < le; l++)
        for (uint32_t i = 0; i < NNZ; i++) {
            if (BATCH[i] < 0)
                continue;
            int32_t b = BATCH[i], pos = POS[i];
            uint32_t page = (uint32_t)INDICES[INDPTR[b] + pos / (int32_t)g->page_size];
            uint32_t slot = (uint32_t)pos % g->page_size;
            for (uint32_t h = 0; h < g->num_kv_heads; h++)
                for (int kv = 0; kv < 2; kv++) {
                    const uint8_t *from =
                        stage + (l - lb) * s->layer_stride +
                        (kv ? s->v_offset + i * s->v_stride_n + h * s->v_stride_h
                            : s->k_offset + i * s->k_stride_n + h * s->k_stride_h);
                    memcpy(expect + ref_offset(g, l, page, kv, slot, h), from, row);
                }
        }
}

static void assert_pool_is(const fixture_t *f, const uint8_t *expect, const char *what)
{
    for (uint64_t i = 0; i < f->bytes; i++)
        KVP_CHECK(f->pool[i] == expect[i],
                  "%s: geometry layout %d storage %d: pool byte %llu is %u, want %u", what,
                  f->g.layout, f->g.storage, (unsigned long long)i, f->pool[i], expect[i]);
}

START_TEST(an_append_lands_where_flashinfer_puts_each_token)
{
    const kvp_geom_t *g = &GEOMS[_i];
    fixture_t f;
    open_fixture(&f, g);
    src_layout_t s = src_layout(g);
    size_t bytes = g->num_layers * s.layer_stride;
    uint8_t *stage;
    int fd = make_staging(bytes, 1, &stage);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, 100 + (uint64_t)_i);
    kvp_rng_fill(&rng, stage, bytes);
    kvp_buffer_t buf;
    ck_assert_int_eq(import_memfd(f.b, fd, bytes, &buf), 0);

    uint8_t *expect = calloc(1, f.bytes);
    ck_assert_ptr_nonnull(expect);
    kvp_exec_t e = plan(g, &buf, &s, 0, g->num_layers);
    ck_assert_int_eq(f.b->ops->run(f.b, &e), 0);
    expect_append(g, expect, stage, &s, 0, g->num_layers);
    assert_pool_is(&f, expect, "all layers");
    /* one known cell by hand, so the reference itself is pinned down: layer 0, token 4 of
     * request 0 (position 4: page 2, slot 0), head 1, K */
    {
        const uint64_t el = elem_of(g), row = g->head_dim * el, S = g->page_size,
                       H = g->num_kv_heads, D = g->head_dim;
        uint64_t off =
            g->storage == KVP_STORAGE_COMBINED
                ? (2 * 2 * S * H * D + (g->layout == KVP_LAYOUT_NHD ? 1 * D : 1 * S * D)) * el
                : (2 * S * H * D + (g->layout == KVP_LAYOUT_NHD ? 1 * D : 1 * S * D)) * el;
        ck_assert_int_eq(memcmp(f.pool + off, stage + s.k_offset + 4 * s.k_stride_n + row, row), 0);
    }

    /* the same plan over layers [1, 2) reads the buffer's first layer block: fresh data */
    kvp_rng_fill(&rng, stage, bytes);
    e = plan(g, &buf, &s, 1, 2);
    ck_assert_int_eq(f.b->ops->run(f.b, &e), 0);
    expect_append(g, expect, stage, &s, 1, 2);
    assert_pool_is(&f, expect, "layer 1 only");

    /* nnz 0 and no copies: nothing happens */
    kvp_rng_fill(&rng, stage, bytes);
    e = plan(g, &buf, &s, 0, g->num_layers);
    e.dest.nnz = 0;
    ck_assert_int_eq(f.b->ops->run(f.b, &e), 0);
    assert_pool_is(&f, expect, "nnz 0");

    f.b->ops->release_buffer(f.b, &buf);
    free(expect);
    munmap(stage, bytes);
    close_fixture(&f);
}
END_TEST

/* Fills the pool with random bytes through the worker's mapping; returns a copy. */
static uint8_t *randomize_pool(fixture_t *f, uint64_t seed)
{
    kvp_rng_t rng;
    kvp_rng_seed(&rng, seed);
    kvp_rng_fill(&rng, f->pool, f->bytes);
    uint8_t *copy = malloc(f->bytes);
    ck_assert_ptr_nonnull(copy);
    memcpy(copy, f->pool, f->bytes);
    return copy;
}

/* In expect, page dst of every layer (K and V) becomes page src. */
static void expect_copy(const kvp_geom_t *g, uint8_t *expect, uint32_t src, uint32_t dst)
{
    for (uint32_t l = 0; l < g->num_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            memcpy(expect + ref_offset(g, l, dst, kv, 0, 0),
                   expect + ref_offset(g, l, src, kv, 0, 0), page_kv_bytes(g));
}

START_TEST(copies_run_in_every_layer_before_the_append)
{
    const kvp_geom_t *g = &GEOMS[_i];
    fixture_t f;
    open_fixture(&f, g);
    uint8_t *expect = randomize_pool(&f, 200 + (uint64_t)_i);
    src_layout_t s = src_layout(g);
    size_t bytes = g->num_layers * s.layer_stride;
    uint8_t *stage;
    int fd = make_staging(bytes, 1, &stage);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, 300 + (uint64_t)_i);
    kvp_rng_fill(&rng, stage, bytes);
    kvp_buffer_t buf;
    ck_assert_int_eq(import_memfd(f.b, fd, bytes, &buf), 0);

    /* copies alone (nnz 0, an empty layer range): still applied to every layer */
    const kvp_page_copy_t two[] = {{.src = 3, .dst = 6}, {.src = 1, .dst = 0}};
    kvp_exec_t e = plan(g, &buf, &s, 0, 0);
    e.dest.nnz = 0;
    e.copies = two;
    e.num_copies = 2;
    ck_assert_int_eq(f.b->ops->run(f.b, &e), 0);
    expect_copy(g, expect, 3, 6);
    expect_copy(g, expect, 1, 0);
    assert_pool_is(&f, expect, "copies only");

    /* copy-on-write then append, appending to layer 1 only: page 4 is copied into page 7 in
     * every layer first (request 1's page), then the append overwrites request 1's slots 1
     * and 2 of page 7 in layer 1; slot 0 and the other slots keep the copy */
    const kvp_page_copy_t cow[] = {{.src = 4, .dst = 7}};
    kvp_rng_fill(&rng, stage, bytes);
    e = plan(g, &buf, &s, 1, 2);
    e.copies = cow;
    e.num_copies = 1;
    ck_assert_int_eq(f.b->ops->run(f.b, &e), 0);
    expect_copy(g, expect, 4, 7);
    expect_append(g, expect, stage, &s, 1, 2);
    assert_pool_is(&f, expect, "copy then append");
    /* the order by hand: in layer 1, page 7's slot 0 is page 4's (copied), its slot 1 is
     * token 6's row (appended after the copy, so not overwritten by it) */
    const uint64_t row = g->head_dim * elem_of(g);
    ck_assert_int_eq(
        memcmp(f.pool + ref_offset(g, 1, 7, 0, 0, 0), f.pool + ref_offset(g, 1, 4, 0, 0, 0), row),
        0);
    ck_assert_int_eq(
        memcmp(f.pool + ref_offset(g, 1, 7, 0, 1, 0), stage + s.k_offset + 6 * s.k_stride_n, row),
        0);

    f.b->ops->release_buffer(f.b, &buf);
    free(expect);
    munmap(stage, bytes);
    close_fixture(&f);
}
END_TEST

START_TEST(plans_it_refuses_leave_the_pool_unchanged)
{
    const kvp_geom_t *g = &GEOMS[0];
    fixture_t f;
    open_fixture(&f, g);
    uint8_t *before = randomize_pool(&f, 400);
    src_layout_t s = src_layout(g);
    size_t bytes = g->num_layers * s.layer_stride;
    uint8_t *stage;
    int fd = make_staging(bytes, 1, &stage);
    memset(stage, 0x5a, bytes);
    kvp_buffer_t buf, other;
    ck_assert_int_eq(import_memfd(f.b, fd, bytes, &buf), 0);

    /* a slot past the pool's last (page 8 of 8), or far beyond it: the planner's slots are
     * inside their sequences by construction, so the pool's bound is what run() checks */
    int32_t slots[NNZ];
    kvp_exec_t e = plan(g, &buf, &s, 0, g->num_layers);
    memcpy(slots, SLOTS, sizeof(slots));
    e.dest.slots = slots;
    slots[5] = (int32_t)(g->num_pages * g->page_size);
    ck_assert_int_eq(f.b->ops->run(f.b, &e), KVP_ERANGE);
    assert_pool_is(&f, before, "slot of page 8 of 8");
    slots[5] = INT32_MAX;
    ck_assert_int_eq(f.b->ops->run(f.b, &e), KVP_ERANGE);
    assert_pool_is(&f, before, "slot INT32_MAX");
    /* copies naming a page outside the pool, or a page onto itself: no copy runs */
    const kvp_page_copy_t out_of_pool[] = {{.src = 3, .dst = 6}, {.src = 1, .dst = 8}};
    const kvp_page_copy_t onto_itself[] = {{.src = 3, .dst = 6}, {.src = 2, .dst = 2}};
    e = plan(g, &buf, &s, 0, g->num_layers);
    e.copies = out_of_pool;
    e.num_copies = 2;
    ck_assert_int_eq(f.b->ops->run(f.b, &e), KVP_ERANGE);
    assert_pool_is(&f, before, "copy to page 8 of 8");
    e.copies = onto_itself;
    ck_assert_int_eq(f.b->ops->run(f.b, &e), KVP_EINVAL);
    assert_pool_is(&f, before, "copy onto itself");
    /* no source at all, or a tensor-parallel form of two ranks on a one-device pool: the
     * dispatch never sends these, and the backend says so rather than guess */
    e = plan(g, NULL, &s, 0, g->num_layers);
    ck_assert_int_eq(f.b->ops->run(f.b, &e), KVP_EINTERNAL);
    uint8_t *m2;
    int fd2 = make_staging(bytes, 1, &m2);
    ck_assert_int_eq(import_memfd(f.b, fd2, bytes, &other), 0);
    const kvp_buffer_t *ranks[2] = {&buf, &other};
    e.rank_src = ranks;
    e.num_rank_src = 2;
    ck_assert_int_eq(f.b->ops->run(f.b, &e), KVP_EINTERNAL);
    assert_pool_is(&f, before, "no usable source");
    /* the one-rank tensor-parallel form is the single-source form */
    e.num_rank_src = 1;
    ck_assert_int_eq(f.b->ops->run(f.b, &e), 0);
    expect_append(g, before, stage, &s, 0, g->num_layers);
    assert_pool_is(&f, before, "one rank");
    ck_assert_int_eq(f.b->ops->health(f.b), 0); /* refusals leave it healthy */

    f.b->ops->release_buffer(f.b, &other);
    f.b->ops->release_buffer(f.b, &buf);
    free(before);
    munmap(m2, bytes);
    munmap(stage, bytes);
    close_fixture(&f);
}
END_TEST

/* The packed form (kvp_kernels.h) of tokens [0, n) held in pages, from DESIGN.md §1's shapes
 * alone (ref_offset): per layer K then V, [token][head][D]. */
static void expect_packed(const fixture_t *f, const uint8_t *pool, const int32_t *pages, uint32_t n,
                          uint8_t *out)
{
    const kvp_geom_t *g = &f->g;
    const uint64_t row = g->head_dim * elem_of(g);
    for (uint32_t l = 0; l < g->num_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            for (uint32_t t = 0; t < n; t++)
                for (uint32_t h = 0; h < g->num_kv_heads; h++) {
                    memcpy(out,
                           pool + ref_offset(g, l, (uint32_t)pages[t / g->page_size], kv,
                                             t % g->page_size, h),
                           row);
                    out += row;
                }
}

/* The page-mover seam (ops->move, issue #27): pages go out to host memory and come back
 * byte-exact, whole or in pieces that cut rows, heads and layers, and nothing else moves. */
START_TEST(pages_move_out_and_back_through_the_page_mover)
{
    fixture_t f;
    open_fixture(&f, &GEOMS[_i]);
    const kvp_geom_t *g = &f.g;
    uint8_t *orig = randomize_pool(&f, 0x27 + (uint64_t)_i);
    const int32_t pages[] = {5, 2, 7};
    const uint32_t n = 2 * g->page_size + 3; /* the last page partly used */
    const uint64_t total = kvp_backend_move_bytes(f.b, n);
    ck_assert_uint_eq(total, g->num_layers * 2ull * n * g->num_kv_heads * g->head_dim * elem_of(g));
    uint8_t *expect = malloc(total), *out = malloc(total), *pieces = malloc(total);
    ck_assert(expect && out && pieces);
    expect_packed(&f, orig, pages, n, expect);

    kvp_move_t m = {.dir = KVP_MOVE_OUT,
                    .pages = pages,
                    .num_tokens = n,
                    .begin = 0,
                    .end = total,
                    .buf = out,
                    .buf_medium = KVP_MEDIUM_HOST};
    ck_assert_int_eq(f.b->ops->move(f.b, &m), 0);
    ck_assert_mem_eq(out, expect, total);
    ck_assert_mem_eq(f.pool, orig, f.bytes); /* moving out changes nothing */

    /* in odd pieces (7 bytes cuts rows and heads; the pieces cross layers) */
    for (uint64_t off = 0; off < total; off += 7) {
        m.begin = off;
        m.end = off + 7 < total ? off + 7 : total;
        m.buf = pieces + off;
        ck_assert_int_eq(f.b->ops->move(f.b, &m), 0);
    }
    ck_assert_mem_eq(pieces, expect, total);

    /* the pages' used slots cleared, then moved back in: the pool is the original again */
    uint8_t *cleared = malloc(f.bytes);
    ck_assert_ptr_nonnull(cleared);
    for (uint32_t l = 0; l < g->num_layers; l++)
        for (int kv = 0; kv < 2; kv++)
            for (uint32_t t = 0; t < n; t++)
                memset(f.pool + ref_offset(g, l, (uint32_t)pages[t / g->page_size], kv,
                                           t % g->page_size, 0),
                       0,
                       g->num_kv_heads * g->head_dim * elem_of(g) *
                           (g->layout == KVP_LAYOUT_NHD ? 1 : 0));
    if (g->layout == KVP_LAYOUT_HND) /* rows of one slot are not adjacent: clear per head */
        for (uint32_t l = 0; l < g->num_layers; l++)
            for (int kv = 0; kv < 2; kv++)
                for (uint32_t t = 0; t < n; t++)
                    for (uint32_t h = 0; h < g->num_kv_heads; h++)
                        memset(f.pool + ref_offset(g, l, (uint32_t)pages[t / g->page_size], kv,
                                                   t % g->page_size, h),
                               0, g->head_dim * elem_of(g));
    memcpy(cleared, f.pool, f.bytes);
    ck_assert_int_ne(memcmp(cleared, orig, f.bytes), 0);
    m = (kvp_move_t){.dir = KVP_MOVE_IN,
                     .pages = pages,
                     .num_tokens = n,
                     .begin = 0,
                     .end = total / 2,
                     .buf = out,
                     .buf_medium = KVP_MEDIUM_HOST};
    ck_assert_int_eq(f.b->ops->move(f.b, &m), 0); /* half first, then the rest */
    m.begin = total / 2;
    m.end = total;
    m.buf = out + total / 2;
    ck_assert_int_eq(f.b->ops->move(f.b, &m), 0);
    ck_assert_mem_eq(f.pool, orig, f.bytes);
    free(cleared);
    free(pieces);
    free(out);
    free(expect);
    free(orig);
    close_fixture(&f);
}
END_TEST

START_TEST(a_move_it_refuses_changes_nothing)
{
    fixture_t f;
    open_fixture(&f, &GEOMS[0]);
    uint8_t *orig = randomize_pool(&f, 99);
    const int32_t pages[] = {1, 8}; /* 8: out of range */
    const uint32_t n = 2 * f.g.page_size;
    const uint64_t total = kvp_backend_move_bytes(f.b, n);
    uint8_t *buf = calloc(1, total + 16);
    ck_assert_ptr_nonnull(buf);
    const kvp_move_t good = {.dir = KVP_MOVE_IN,
                             .pages = pages,
                             .num_tokens = f.g.page_size,
                             .begin = 0,
                             .end = kvp_backend_move_bytes(f.b, f.g.page_size),
                             .buf = buf,
                             .buf_medium = KVP_MEDIUM_HOST};
    kvp_move_t m = good;
    m.num_tokens = n; /* reaches page 8 */
    m.end = total;
    ck_assert_int_eq(f.b->ops->move(f.b, &m), KVP_ERANGE);
    m = good, m.end = good.end + 1; /* past the stream */
    ck_assert_int_eq(f.b->ops->move(f.b, &m), KVP_EINVAL);
    m = good, m.begin = 2, m.end = 1;
    ck_assert_int_eq(f.b->ops->move(f.b, &m), KVP_EINVAL);
    m = good, m.device = 1; /* one device only */
    ck_assert_int_eq(f.b->ops->move(f.b, &m), KVP_EINVAL);
    m = good, m.buf_medium = KVP_MEDIUM_GPU; /* no device memory here */
    ck_assert_int_eq(f.b->ops->move(f.b, &m), KVP_EINVAL);
    m = good, m.dir = 2;
    ck_assert_int_eq(f.b->ops->move(f.b, &m), KVP_EINVAL);
    m = good, m.buf = NULL;
    ck_assert_int_eq(f.b->ops->move(f.b, &m), KVP_EINVAL);
    ck_assert_mem_eq(f.pool, orig, f.bytes);
    m = good; /* and the good one does move: page 1's slots become zeros */
    ck_assert_int_eq(f.b->ops->move(f.b, &m), 0);
    ck_assert_int_ne(memcmp(f.pool, orig, f.bytes), 0);
    free(buf);
    free(orig);
    close_fixture(&f);
}
END_TEST

/* ---- the gather (ops->gather, a Load's copy, issue #28) --------------------------------- */

/* The Load of the gather tests: slots of pages 5, 2, 7 and 0 out of order, one slot twice
 * (a Load may read a slot twice), the last slot of the pool, and a padding entry (-1). */
static void load_slots(const kvp_geom_t *g, int32_t *slots)
{
    const int32_t ps = (int32_t)g->page_size, last = (int32_t)(g->num_pages * g->page_size) - 1;
    const int32_t s[NNZ] = {5 * ps + 1, 2 * ps + 3, 7 * ps, -1, 1, 2 * ps + 3, last, 5 * ps, 2};
    memcpy(slots, s, sizeof(s));
}

static kvp_gather_t load_of(const kvp_buffer_t *dst, const src_layout_t *s, const int32_t *slots,
                            uint32_t lb, uint32_t le)
{
    return (kvp_gather_t){.slots = slots,
                          .nnz = NNZ,
                          .dst = dst,
                          .k_offset = s->k_offset,
                          .v_offset = s->v_offset,
                          .k_stride_n = s->k_stride_n,
                          .k_stride_h = s->k_stride_h,
                          .v_stride_n = s->v_stride_n,
                          .v_stride_h = s->v_stride_h,
                          .layer_stride = s->layer_stride,
                          .layer_begin = lb,
                          .layer_end = le};
}

/* What the Load writes into expect (the buffer's bytes): each non-padding token's rows of
 * layers [lb, le) of pool, where an Append with the same layout would read them. */
static void expect_load(const kvp_geom_t *g, uint8_t *expect, const uint8_t *pool,
                        const src_layout_t *s, const int32_t *slots, uint32_t lb, uint32_t le)
{
    const uint64_t row = g->head_dim * elem_of(g);
    for (uint32_t l = lb; l < le; l++)
        for (uint32_t i = 0; i < NNZ; i++)
            for (uint32_t h = 0; h < g->num_kv_heads && slots[i] >= 0; h++)
                for (int kv = 0; kv < 2; kv++) {
                    const uint32_t page = (uint32_t)slots[i] / g->page_size,
                                   slot = (uint32_t)slots[i] % g->page_size;
                    memcpy(expect + (l - lb) * s->layer_stride +
                               (kv ? s->v_offset + i * s->v_stride_n + h * s->v_stride_h
                                   : s->k_offset + i * s->k_stride_n + h * s->k_stride_h),
                           pool + ref_offset(g, l, page, kv, slot, h), row);
                }
}

static void fill_canary(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(0x5c ^ (i * 13));
}

START_TEST(a_gather_writes_pool_rows_into_a_writable_memfd)
{
    const kvp_geom_t *g = &GEOMS[_i];
    fixture_t f;
    open_fixture(&f, g);
    uint8_t *pool = randomize_pool(&f, 500 + (uint64_t)_i);
    src_layout_t s = src_layout(g);
    size_t bytes = g->num_layers * s.layer_stride;
    uint8_t *stage;
    int fd = make_staging(bytes, 1, &stage); /* read-write, sealed against resizing only */
    fill_canary(stage, bytes);
    kvp_buffer_t buf;
    ck_assert_int_eq(import_memfd(f.b, fd, bytes, &buf), 0);
    ck_assert(buf.writable);
    uint8_t *expect = malloc(bytes);
    ck_assert_ptr_nonnull(expect);
    int32_t slots[NNZ];
    load_slots(g, slots);

    /* every layer: the worker sees the rows in its own mapping, the rest is the canary */
    kvp_gather_t ld = load_of(&buf, &s, slots, 0, g->num_layers);
    ck_assert_int_eq(f.b->ops->gather(f.b, &ld), 0);
    fill_canary(expect, bytes);
    expect_load(g, expect, pool, &s, slots, 0, g->num_layers);
    ck_assert_mem_eq(stage, expect, bytes);
    ck_assert_mem_eq(f.pool, pool, f.bytes); /* a Load only reads the pool */
    /* one cell by hand, so the reference itself is pinned down: token 2 is slot 0 of page 7,
     * its V of head 1 in layer 0 */
    {
        const uint64_t el = elem_of(g), row = g->head_dim * el, S = g->page_size,
                       H = g->num_kv_heads, D = g->head_dim;
        const uint64_t in_page = g->layout == KVP_LAYOUT_NHD ? 1 * D : 1 * S * D;
        const uint64_t off =
            g->storage == KVP_STORAGE_COMBINED
                ? ((7 * 2 + 1) * S * H * D + in_page) * el
                : ((uint64_t)g->num_pages * S * H * D + 7 * S * H * D + in_page) * el;
        ck_assert_int_eq(
            memcmp(stage + s.v_offset + 2 * s.v_stride_n + 1 * s.v_stride_h, pool + off, row), 0);
    }

    /* layers [1, 2) land in the buffer's first layer block; nothing else changes */
    fill_canary(stage, bytes);
    ld = load_of(&buf, &s, slots, 1, 2);
    ck_assert_int_eq(f.b->ops->gather(f.b, &ld), 0);
    fill_canary(expect, bytes);
    expect_load(g, expect, pool, &s, slots, 1, 2);
    ck_assert_mem_eq(stage, expect, bytes);

    /* nnz 0, or an empty layer range: nothing is written */
    fill_canary(stage, bytes);
    fill_canary(expect, bytes);
    ld = load_of(&buf, &s, slots, 0, g->num_layers);
    ld.nnz = 0;
    ck_assert_int_eq(f.b->ops->gather(f.b, &ld), 0);
    ld = load_of(&buf, &s, slots, 1, 1);
    ck_assert_int_eq(f.b->ops->gather(f.b, &ld), 0);
    ck_assert_mem_eq(stage, expect, bytes);

    f.b->ops->release_buffer(f.b, &buf);
    free(expect);
    free(pool);
    munmap(stage, bytes);
    close_fixture(&f);
}
END_TEST

/* A sealed memfd of bytes holding a pattern, with extra seals, and no writable mapping (a
 * write seal needs none to exist); *map is a read-only view of it. */
static int make_sealed(size_t bytes, int extra_seals, uint8_t **map)
{
    int fd = memfd_create("test-load", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(ftruncate(fd, (off_t)bytes), 0);
    uint8_t *tmp = malloc(bytes);
    ck_assert_ptr_nonnull(tmp);
    fill_canary(tmp, bytes);
    ck_assert_int_eq(pwrite(fd, tmp, bytes, 0), (ssize_t)bytes);
    free(tmp);
    ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | extra_seals), 0);
    *map = mmap(NULL, bytes, PROT_READ, MAP_SHARED, fd, 0);
    ck_assert_ptr_ne(*map, MAP_FAILED);
    return fd;
}

START_TEST(a_gather_it_refuses_writes_nothing)
{
    const kvp_geom_t *g = &GEOMS[0];
    fixture_t f;
    open_fixture(&f, g);
    uint8_t *pool = randomize_pool(&f, 600);
    src_layout_t s = src_layout(g);
    size_t bytes = g->num_layers * s.layer_stride;
    uint8_t *clean = malloc(bytes);
    ck_assert_ptr_nonnull(clean);
    fill_canary(clean, bytes);
    int32_t slots[NNZ];
    load_slots(g, slots);
    kvp_gather_t ld;

    /* read-only buffers are Append sources still, never a Load's destination: a memfd sealed
     * against writes, and a sealed memfd reopened read-only */
    uint8_t *ro_map;
    int fd = make_sealed(bytes, F_SEAL_WRITE, &ro_map);
    kvp_buffer_t ro;
    ck_assert_int_eq(import_memfd(f.b, fd, bytes, &ro), 0);
    ck_assert(!ro.writable);
    ld = load_of(&ro, &s, slots, 0, g->num_layers);
    ck_assert_int_eq(f.b->ops->gather(f.b, &ld), KVP_EINVAL);
    ck_assert_mem_eq(ro_map, clean, bytes);
    f.b->ops->release_buffer(f.b, &ro);
    munmap(ro_map, bytes);

    fd = make_sealed(bytes, 0, &ro_map);
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    int rd = open(path, O_RDONLY | O_CLOEXEC);
    ck_assert_int_ge(rd, 0);
    close(fd);
    ck_assert_int_eq(import_memfd(f.b, rd, bytes, &ro), 0);
    ck_assert(!ro.writable);
    ld = load_of(&ro, &s, slots, 0, g->num_layers);
    ck_assert_int_eq(f.b->ops->gather(f.b, &ld), KVP_EINVAL);
    ck_assert_mem_eq(ro_map, clean, bytes);
    f.b->ops->release_buffer(f.b, &ro);
    munmap(ro_map, bytes);

    /* a writable one, and Loads the backend refuses before writing a byte */
    uint8_t *stage;
    fd = make_staging(bytes, 1, &stage);
    fill_canary(stage, bytes);
    kvp_buffer_t buf;
    ck_assert_int_eq(import_memfd(f.b, fd, bytes, &buf), 0);
    ck_assert(buf.writable);
    slots[6] = (int32_t)(g->num_pages * g->page_size); /* the first slot past the pool */
    ld = load_of(&buf, &s, slots, 0, g->num_layers);
    ck_assert_int_eq(f.b->ops->gather(f.b, &ld), KVP_ERANGE);
    ck_assert_mem_eq(stage, clean, bytes);
    slots[6] = INT32_MAX;
    ck_assert_int_eq(f.b->ops->gather(f.b, &ld), KVP_ERANGE);
    ck_assert_mem_eq(stage, clean, bytes);
    load_slots(g, slots);
    ld = load_of(&buf, &s, slots, 0, g->num_layers + 1); /* past the last layer */
    ck_assert_int_eq(f.b->ops->gather(f.b, &ld), KVP_EINVAL);
    ld = load_of(&buf, &s, slots, 2, 1);
    ck_assert_int_eq(f.b->ops->gather(f.b, &ld), KVP_EINVAL);
    ld = load_of(&buf, &s, NULL, 0, g->num_layers);
    ck_assert_int_eq(f.b->ops->gather(f.b, &ld), KVP_EINVAL);
    ld = load_of(NULL, &s, slots, 0, g->num_layers);
    ck_assert_int_eq(f.b->ops->gather(f.b, &ld), KVP_EINVAL);
    ck_assert_mem_eq(stage, clean, bytes);
    ck_assert_mem_eq(f.pool, pool, f.bytes);
    ck_assert_int_eq(f.b->ops->health(f.b), 0); /* refusals leave it healthy */
    /* and the same Load with good slots does write */
    ld = load_of(&buf, &s, slots, 0, g->num_layers);
    ck_assert_int_eq(f.b->ops->gather(f.b, &ld), 0);
    ck_assert_int_ne(memcmp(stage, clean, bytes), 0);

    f.b->ops->release_buffer(f.b, &buf);
    munmap(stage, bytes);
    free(clean);
    free(pool);
    close_fixture(&f);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("backend_host");
    TCase *tc = tcase_create("backend_host");
    tcase_add_test(tc, create_exports_one_sealed_zeroed_memfd_of_the_pool_size);
    tcase_add_test(tc, create_refuses_a_bad_geometry);
    tcase_add_test(tc, import_maps_a_sealed_memfd_and_takes_the_fd);
    tcase_add_test(tc, import_refuses_what_it_cannot_safely_map_and_leaves_the_fd);
    tcase_add_loop_test(tc, an_append_lands_where_flashinfer_puts_each_token, 0, (int)NUM_GEOMS);
    tcase_add_loop_test(tc, copies_run_in_every_layer_before_the_append, 0, (int)NUM_GEOMS);
    tcase_add_test(tc, plans_it_refuses_leave_the_pool_unchanged);
    tcase_add_loop_test(tc, pages_move_out_and_back_through_the_page_mover, 0, (int)NUM_GEOMS);
    tcase_add_test(tc, a_move_it_refuses_changes_nothing);
    tcase_add_loop_test(tc, a_gather_writes_pool_rows_into_a_writable_memfd, 0, (int)NUM_GEOMS);
    tcase_add_test(tc, a_gather_it_refuses_writes_nothing);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
