/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_gather_cuda.c - the CUDA gather (kvp_gather_cuda, a Load's copy) against the CPU gather
 * (kvp_gather_cpu), byte-exact over a grid of pools (layouts, storages, element sizes, head
 * dims, page sizes) and destinations (packed, head-major, interleaved, padded, and ones whose
 * offsets and strides allow only 8-, 4-, 2- or 1-byte vectors), the whole destination compared
 * so a byte written outside the gathered rows fails; padding, repeated slots, and a slot past
 * the pool skipped on the device; the host-side refusals. Then the cuda backend's ops->gather
 * into a worker's VMM buffer, byte-exact against the CPU over the pool read back, with the
 * refusals that leave the buffer unchanged (a memfd buffer is not writable, a slot past the
 * pool, a bad layer range) and the backend healthy. Exits 77 where no GPU is usable (CI).
 */
#include <check.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvp_backend.h"
#include "kvp_cuda_err.h"
#include "kvp_cuda_vmm.h"
#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_gpu_test.h"
#include "kvp_kernels.h"
#include "kvp_kernels_cuda.h"
#include "kvp_test_util.h"

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        ck_assert_msg(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                 \
    } while (0)

static cudaStream_t S;

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    ck_assert_ptr_nonnull(p);
    return p;
}

static void *dalloc(size_t n)
{
    void *p = NULL;
    CK(cudaMalloc(&p, n ? n : 16));
    return p;
}

static void canary(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(0xC3 ^ (i * 31));
}

/* Rows of a destination, in bytes: token n, head h at off + n * sn + h * sh (K and V). */
typedef struct {
    uint64_t k_off, v_off, kn, kh, vn, vh, bytes;
} rows_t;

#define NUM_ROW_KINDS 5

/* Kind 0 packed [n][h] K then V; 1 head-major with a padded head pitch; 2 per token K's heads
 * then V's, the token pitch padded by 8 bytes (8-byte vectors); 3 token-major, padded rows, V
 * first; 4 padded by one element everywhere, so the vector is the element (4, 2 or 1 bytes). */
static rows_t make_rows(int kind, uint32_t nnz, uint32_t H, uint64_t row, uint32_t e)
{
    rows_t l;
    const uint64_t pad = 16;
    switch (kind) {
    case 0:
        l.kh = l.vh = row;
        l.kn = l.vn = H * row;
        l.k_off = 32;
        l.v_off = l.k_off + nnz * l.kn + pad;
        break;
    case 1:
        l.kn = l.vn = row;
        l.kh = l.vh = nnz * row + pad;
        l.k_off = 0;
        l.v_off = H * l.kh + 2 * pad;
        break;
    case 2:
        l.kh = l.vh = row;
        l.kn = l.vn = 2 * H * row + 8;
        l.k_off = pad;
        l.v_off = pad + H * row;
        break;
    case 3:
        l.kh = l.vh = row + pad;
        l.kn = l.vn = H * l.kh + 3 * pad;
        l.v_off = 48;
        l.k_off = l.v_off + nnz * l.vn + pad;
        break;
    default:
        l.kh = l.vh = row + e;
        l.kn = l.vn = H * l.kh + e;
        l.k_off = e;
        l.v_off = l.k_off + nnz * l.kn + e;
        break;
    }
    const uint64_t k_end = l.k_off + (nnz - 1) * l.kn + (H - 1) * l.kh + row;
    const uint64_t v_end = l.v_off + (nnz - 1) * l.vn + (H - 1) * l.vh + row;
    l.bytes = (k_end > v_end ? k_end : v_end) + pad;
    return l;
}

static kvp_gather_dst_t dst_of(uint8_t *base, const rows_t *l, uint32_t e)
{
    return (kvp_gather_dst_t){.key = base + l->k_off,
                              .value = base + l->v_off,
                              .k_stride_n = (int64_t)(l->kn / e),
                              .k_stride_h = (int64_t)(l->kh / e),
                              .v_stride_n = (int64_t)(l->vn / e),
                              .v_stride_h = (int64_t)(l->vh / e)};
}

/* One layer's view of a pool of geometry g at base (layer 1 when there are two). */
static kvp_paged_kv_t view_of(const kvp_geom_t *g, const kvp_geom_derived_t *d, uint8_t *base,
                              uint32_t layer)
{
    kvp_paged_kv_t kv;
    memset(&kv, 0, sizeof(kv));
    kv.k_data = base + kvp_geom_layer_offset(d, layer);
    kv.v_data = (uint8_t *)kv.k_data + d->v_offset_bytes;
    kv.elem_bytes = d->elem_bytes;
    kv.num_pages = g->num_pages;
    kv.page_size = g->page_size;
    kv.num_heads = d->heads;
    kv.head_dim = g->head_dim;
    kv.stride_page = d->stride_page;
    kv.stride_n = d->stride_n;
    kv.stride_h = d->stride_h;
    return kv;
}

static kvp_dtype_t dtype_of(uint32_t elem)
{
    return elem == 1 ? KVP_DTYPE_FP8_E4M3 : elem == 2 ? KVP_DTYPE_BF16 : KVP_DTYPE_FP32;
}

/* One configuration: the pool random on both sides, slots random (padding, repeats, and with
 * `past` one slot past the pool, which the device skips and the CPU reference treats as
 * padding), the destination a canary on both sides; the whole destination compared. */
static void run_one(const kvp_geom_t *g, uint32_t nnz, int kind, int past, kvp_rng_t *r,
                    const char *ctx)
{
    kvp_geom_derived_t d;
    ck_assert_int_eq(kvp_geom_derive(g, &d), 0);
    const uint32_t e = d.elem_bytes, cap = g->num_pages * g->page_size;
    uint8_t *hpool = xmalloc(d.pool_bytes), *dpool = dalloc(d.pool_bytes);
    kvp_rng_fill(r, hpool, d.pool_bytes);
    CK(cudaMemcpyAsync(dpool, hpool, d.pool_bytes, cudaMemcpyHostToDevice, S));
    int32_t *slots = xmalloc(nnz * sizeof(int32_t)), *ref_slots = xmalloc(nnz * sizeof(int32_t));
    for (uint32_t i = 0; i < nnz; i++) {
        slots[i] = kvp_rng_below(r, 9) == 0 ? -1 : (int32_t)kvp_rng_below(r, cap);
        ref_slots[i] = slots[i];
    }
    if (past) {
        const uint32_t i = kvp_rng_below(r, nnz);
        slots[i] = kvp_rng_below(r, 2) ? (int32_t)cap : INT32_MAX;
        ref_slots[i] = -1;
    }
    int32_t *dslots = dalloc(nnz * sizeof(int32_t));
    CK(cudaMemcpyAsync(dslots, slots, nnz * sizeof(int32_t), cudaMemcpyHostToDevice, S));
    const rows_t l = make_rows(kind, nnz, d.heads, d.row_bytes, e);
    uint8_t *want = xmalloc(l.bytes), *got = xmalloc(l.bytes), *ddst = dalloc(l.bytes);
    canary(want, l.bytes);
    CK(cudaMemcpyAsync(ddst, want, l.bytes, cudaMemcpyHostToDevice, S));

    const uint32_t layer = g->num_layers - 1;
    kvp_paged_kv_t hkv = view_of(g, &d, hpool, layer), dkv = view_of(g, &d, dpool, layer);
    const kvp_gather_dst_t hd = dst_of(want, &l, e), dd = dst_of(ddst, &l, e);
    ck_assert_msg(kvp_gather_cpu(&hkv, ref_slots, nnz, &hd) == 0, "cpu: %s", ctx);
    int rc = kvp_gather_cuda(&dkv, dslots, nnz, &dd, S);
    ck_assert_msg(rc == 0, "cuda: %s: %s (%s)", ctx, kvp_errname(rc), kvp_cuda_last_error());
    CK(cudaMemcpyAsync(got, ddst, l.bytes, cudaMemcpyDeviceToHost, S));
    CK(cudaStreamSynchronize(S));
    size_t at = 0;
    while (at < l.bytes && got[at] == want[at])
        at++;
    ck_assert_msg(at == l.bytes, "%s: destination byte %zu of %llu differs", ctx, at,
                  (unsigned long long)l.bytes);
    CK(cudaFree(ddst));
    CK(cudaFree(dslots));
    CK(cudaFree(dpool));
    free(got);
    free(want);
    free(ref_slots);
    free(slots);
    free(hpool);
}

START_TEST(gather_matches_cpu_over_the_grid)
{
    static const uint32_t page_sizes[] = {1, 16};
    static const uint32_t head_dims[] = {64, 128, 256};
    static const uint32_t elems[] = {1, 2, 4};
    static const uint32_t nnzs[] = {1, 7, 300, 4099};
    const uint64_t seed = kvp_test_seed(0x6a7e);
    uint32_t index = 0;
    for (size_t px = 0; px < 2; px++)
        for (int layout = KVP_LAYOUT_NHD; layout <= KVP_LAYOUT_HND; layout++)
            for (int storage = KVP_STORAGE_COMBINED; storage <= KVP_STORAGE_SPLIT; storage++)
                for (size_t dx = 0; dx < 3; dx++)
                    for (size_t ex = 0; ex < 3; ex++, index++) {
                        kvp_rng_t r;
                        kvp_rng_seed(&r, seed ^ ((uint64_t)index << 32));
                        const kvp_geom_t g = {.num_layers = 1 + (index & 1),
                                              .num_pages = 64 + kvp_rng_below(&r, 64),
                                              .page_size = page_sizes[px],
                                              .num_kv_heads = 1 + kvp_rng_below(&r, 8),
                                              .head_dim = head_dims[dx],
                                              .dtype = dtype_of(elems[ex]),
                                              .layout = (kvp_layout_t)layout,
                                              .storage = (kvp_storage_t)storage,
                                              .num_devices = 1};
                        const uint32_t nnz = nnzs[index % 4];
                        const int kind = (int)(index % NUM_ROW_KINDS), past = (index % 3) == 0;
                        char ctx[200];
                        snprintf(ctx, sizeof(ctx),
                                 "seed=%#llx index=%u page_size=%u layout=%d storage=%d "
                                 "head_dim=%u elem=%u heads=%u nnz=%u dst=%d past=%d",
                                 (unsigned long long)seed, index, g.page_size, layout, storage,
                                 g.head_dim, elems[ex], g.num_kv_heads, nnz, kind, past);
                        run_one(&g, nnz, kind, past, &r, ctx);
                    }
}
END_TEST

START_TEST(gather_refuses_on_the_host)
{
    const kvp_geom_t g = {2, 8, 4, 2, 64, KVP_DTYPE_FP16, KVP_LAYOUT_NHD, KVP_STORAGE_COMBINED, 1};
    kvp_geom_derived_t d;
    ck_assert_int_eq(kvp_geom_derive(&g, &d), 0);
    uint8_t *dpool = dalloc(d.pool_bytes);
    int32_t *dslots = dalloc(64);
    const rows_t l = make_rows(0, 4, d.heads, d.row_bytes, 2);
    uint8_t *ddst = dalloc(l.bytes);
    const kvp_paged_kv_t good = view_of(&g, &d, dpool, 0);
    const kvp_gather_dst_t gd = dst_of(ddst, &l, 2);
    kvp_paged_kv_t kv;
    kvp_gather_dst_t dd;
    ck_assert_int_eq(kvp_gather_cuda(NULL, dslots, 4, &gd, S), KVP_EINVAL);
    ck_assert_int_eq(kvp_gather_cuda(&good, NULL, 4, &gd, S), KVP_EINVAL);
    ck_assert_int_eq(kvp_gather_cuda(&good, dslots, 4, NULL, S), KVP_EINVAL);
    dd = gd, dd.value = NULL;
    ck_assert_int_eq(kvp_gather_cuda(&good, dslots, 4, &dd, S), KVP_EINVAL);
    dd = gd, dd.k_stride_h = -1;
    ck_assert_int_eq(kvp_gather_cuda(&good, dslots, 4, &dd, S), KVP_EINVAL);
    dd = gd, dd.v_stride_n = INT64_MAX / 2 + 1; /* its byte step overflows */
    ck_assert_int_eq(kvp_gather_cuda(&good, dslots, 4, &dd, S), KVP_EINVAL);
    kv = good, kv.elem_bytes = 8;
    ck_assert_int_eq(kvp_gather_cuda(&kv, dslots, 4, &gd, S), KVP_EINVAL);
    kv = good, kv.num_pages = 0;
    ck_assert_int_eq(kvp_gather_cuda(&kv, dslots, 4, &gd, S), KVP_EINVAL);
    kv = good, kv.stride_page = -1;
    ck_assert_int_eq(kvp_gather_cuda(&kv, dslots, 4, &gd, S), KVP_EINVAL);
    /* nnz 0: nothing queued, the slots not needed */
    ck_assert_int_eq(kvp_gather_cuda(&good, NULL, 0, &gd, S), 0);
    CK(cudaStreamSynchronize(S));
    CK(cudaFree(ddst));
    CK(cudaFree(dslots));
    CK(cudaFree(dpool));
}
END_TEST

/* ---- the cuda backend's ops->gather ----------------------------------------------------- */

START_TEST(backend_gather_writes_a_vmm_buffer_and_refuses_the_rest)
{
    const kvp_geom_t g = {3, 40, 16, 4, 128, KVP_DTYPE_BF16, KVP_LAYOUT_HND, KVP_STORAGE_SPLIT, 1};
    int dev = 0;
    kvp_backend_t *b = NULL;
    ck_assert_int_eq(kvp_backend_cuda_create(&g, &dev, 1, NULL, &b), 0);
    const kvp_geom_derived_t *d = &b->derived;
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(0x10ad));
    /* the pool, written through a second mapping of its exported fd */
    int pool_fd;
    ck_assert_int_eq(b->ops->export_fds(b, &pool_fd, 1), 1);
    kvp_cuda_vmm_t view = {0};
    ck_assert_int_eq(kvp_cuda_vmm_import(pool_fd, 0, b->map_bytes, &view, NULL), 0);
    uint8_t *hpool = xmalloc(d->pool_bytes);
    kvp_rng_fill(&r, hpool, d->pool_bytes);
    CK(cudaMemcpyAsync((void *)(uintptr_t)view.ptr, hpool, d->pool_bytes, cudaMemcpyHostToDevice,
                       S));
    CK(cudaStreamSynchronize(S));

    /* a worker's VMM buffer: K token-major, V head-major, layer blocks, a canary around */
    enum { NNZ = 200 };
    const uint64_t row = d->row_bytes, H = d->heads;
    const uint64_t k_off = 64, kn = H * row, kh = row, v_off = k_off + NNZ * kn + 32;
    const uint64_t vn = row, vh = NNZ * row + 16, layer_stride = v_off + H * vh + 48;
    const size_t bytes = 2 * layer_stride;
    kvp_cuda_vmm_t m = {0};
    ck_assert_int_eq(kvp_cuda_vmm_alloc(0, bytes, &m), 0);
    uint8_t *clean = xmalloc(m.size), *got = xmalloc(m.size), *want = xmalloc(m.size);
    canary(clean, m.size);
    CK(cudaMemcpyAsync((void *)(uintptr_t)m.ptr, clean, m.size, cudaMemcpyHostToDevice, S));
    CK(cudaStreamSynchronize(S));
    int fd = -1;
    ck_assert_int_eq(kvp_cuda_vmm_export(&m, &fd), 0);
    uint8_t done[KVP_BACKEND_IPC_HANDLE_BYTES];
    uint32_t done_len = 0;
    kvp_buffer_t buf;
    memset(&buf, 0, sizeof(buf));
    ck_assert_int_eq(b->ops->import_buffer(b,
                                           &(kvp_import_req_t){.kind = KVP_BUFFER_CUDA_VMM_FD,
                                                               .fd = fd,
                                                               .size_bytes = m.size,
                                                               .device = 0},
                                           &buf, done, &done_len),
                     0);
    ck_assert(buf.writable);

    int32_t slots[NNZ];
    for (uint32_t i = 0; i < NNZ; i++)
        slots[i] = i % 17 == 3 ? -1 : (int32_t)kvp_rng_below(&r, g.num_pages * g.page_size);
    kvp_gather_t ld = {.slots = slots,
                       .nnz = NNZ,
                       .dst = &buf,
                       .k_offset = k_off,
                       .v_offset = v_off,
                       .k_stride_n = kn,
                       .k_stride_h = kh,
                       .v_stride_n = vn,
                       .v_stride_h = vh,
                       .layer_stride = layer_stride,
                       .layer_begin = 1,
                       .layer_end = 3};
#define READ_BACK()                                                                                \
    do {                                                                                           \
        CK(cudaMemcpyAsync(got, (void *)(uintptr_t)m.ptr, m.size, cudaMemcpyDeviceToHost, S));     \
        CK(cudaStreamSynchronize(S));                                                              \
    } while (0)

    /* refusals first: nothing written, the backend healthy */
    slots[NNZ - 1] = (int32_t)(g.num_pages * g.page_size);
    ck_assert_int_eq(b->ops->gather(b, &ld), KVP_ERANGE);
    slots[NNZ - 1] = 0;
    ld.layer_end = 4;
    ck_assert_int_eq(b->ops->gather(b, &ld), KVP_EINVAL);
    ld.layer_end = 3;
    READ_BACK();
    ck_assert_int_eq(memcmp(got, clean, m.size), 0);
    ck_assert_int_eq(b->ops->health(b), 0);

    /* layers 1 and 2 into the buffer's two layer blocks, against the CPU on the host pool */
    ck_assert_int_eq(b->ops->gather(b, &ld), 0);
    memcpy(want, clean, m.size);
    for (uint32_t l = 1; l < 3; l++) {
        kvp_paged_kv_t kv;
        kvp_backend_layer_view(b, hpool, l, &kv);
        uint8_t *base = want + (l - 1) * layer_stride;
        const kvp_gather_dst_t hd = {.key = base + k_off,
                                     .value = base + v_off,
                                     .k_stride_n = (int64_t)(kn / d->elem_bytes),
                                     .k_stride_h = (int64_t)(kh / d->elem_bytes),
                                     .v_stride_n = (int64_t)(vn / d->elem_bytes),
                                     .v_stride_h = (int64_t)(vh / d->elem_bytes)};
        ck_assert_int_eq(kvp_gather_cpu(&kv, slots, NNZ, &hd), 0);
    }
    READ_BACK();
    size_t at = 0;
    while (at < m.size && got[at] == want[at])
        at++;
    ck_assert_msg(at == m.size, "buffer byte %zu of %zu differs from the CPU gather", at, m.size);
    ck_assert_int_eq(b->ops->health(b), 0);
#undef READ_BACK

    /* a host memfd buffer is read over the bus, never written: refused */
    int mfd = memfd_create("test-gather", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ck_assert_int_ge(mfd, 0);
    ck_assert_int_eq(ftruncate(mfd, 1 << 20), 0);
    ck_assert_int_eq(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    kvp_buffer_t host;
    memset(&host, 0, sizeof(host));
    ck_assert_int_eq(b->ops->import_buffer(b,
                                           &(kvp_import_req_t){.kind = KVP_BUFFER_MEMFD,
                                                               .fd = mfd,
                                                               .size_bytes = 1 << 20,
                                                               .device = 0},
                                           &host, done, &done_len),
                     0);
    ck_assert(!host.writable);
    ld.dst = &host;
    ck_assert_int_eq(b->ops->gather(b, &ld), KVP_EINVAL);
    ck_assert_int_eq(b->ops->health(b), 0);

    b->ops->release_buffer(b, &host);
    b->ops->release_buffer(b, &buf);
    kvp_cuda_vmm_free(&m);
    kvp_cuda_vmm_free(&view);
    b->ops->destroy(b);
    free(want);
    free(got);
    free(clean);
    free(hpool);
}
END_TEST

int main(void)
{
    if (kvp_gpu_count() < 1) {
        printf("no usable GPU: skipped\n");
        return 77;
    }
    if (cudaStreamCreateWithFlags(&S, cudaStreamNonBlocking) != cudaSuccess)
        return 1;
    Suite *s = suite_create("gather_cuda");
    TCase *tc = tcase_create("gather_cuda");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, gather_refuses_on_the_host);
    tcase_add_test(tc, gather_matches_cpu_over_the_grid);
    tcase_add_test(tc, backend_gather_writes_a_vmm_buffer_and_refuses_the_rest);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_set_fork_status(sr, CK_NOFORK); /* one CUDA context for the whole run */
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
