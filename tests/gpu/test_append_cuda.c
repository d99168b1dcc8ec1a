/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_append_cuda.c - the CUDA append against the CPU implementation, byte-exact, over the
 * foundation grid (page sizes x batch sizes x layouts x head_dim {64,128,256,512} x element
 * sizes x combined/split x contiguous/strided sources) with several prefill/decode rounds, the
 * pool poisoned beforehand and compared whole (so bytes outside the written slots are checked
 * unchanged). Each round runs one of six forms (checked, unchecked with explicit positions,
 * fused with append_indptr, fused under programmatic dependent launch, slots planned on the
 * device then appended, the same under PDL). Also: fused positions equal
 * get_batch_indices_positions, padding and nnz = 0, a bad position writes nothing, the checked
 * form refuses each kind of bad entry in each of its ways (one launch, validation block + gated
 * copy, validation kernel + gated copy),
 * graph capture and replay give the same bytes, page copies, the slot form (the daemon's
 * small-Append path), prefill-sized appends (padding, a bad page id). Exits 77 where no GPU is
 * usable (CI).
 */
#include <check.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_bench_kernels.h"
#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_kernels.h"
#include "kvp_kernels_cuda.h"
#include "kvp_test_util.h"

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        ck_assert_msg(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                 \
    } while (0)

static cudaStream_t S;
/* The copy kernels' shape the appends below run with (NULL: automatic);
 * kernel_shapes_match_cpu sets each forced shape in turn. */
static const kvp_append_cuda_opts_t *OPTS;

typedef struct {
    kvp_geom_t g;
    kvp_geom_derived_t d;
    uint8_t *ref;   /* host reference pool */
    uint8_t *dpool; /* device pool */
    uint8_t *back;  /* device pool copied back */
    uint32_t B, maxpages;
    uint32_t *pages;  /* [B][maxpages] */
    uint32_t *npages; /* [B] */
    uint32_t *len;    /* [B] */
    uint32_t *freelist;
    uint32_t nfree;
} world_t;

static void *dalloc(size_t n)
{
    void *p = NULL;
    CK(cudaMalloc(&p, n ? n : 16));
    return p;
}

static void up(void *d, const void *h, size_t n)
{
    if (n)
        CK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, S));
}

/* One round: grows the page tables by toks[b], appends random K/V on both sides, compares. */
static void round_once(world_t *w, kvp_rng_t *r, const uint32_t *toks, int strided, int form)
{
    const kvp_geom_t *g = &w->g;
    const kvp_geom_derived_t *d = &w->d;
    uint32_t B = w->B, H = d->heads, D = g->head_dim, e = d->elem_bytes, ps = g->page_size;
    uint32_t nnz = 0;
    int32_t *indptr = malloc(4 * (B + 1)), *aip = malloc(4 * (B + 1)), *last = malloc(4 * B);
    for (uint32_t b = 0; b < B; b++) {
        w->len[b] += toks[b];
        uint32_t need = kvp_geom_pages_for(ps, w->len[b]);
        while (w->npages[b] < need) {
            uint32_t k = kvp_rng_below(r, w->nfree);
            w->pages[b * w->maxpages + w->npages[b]++] = w->freelist[k];
            w->freelist[k] = w->freelist[--w->nfree];
        }
    }
    indptr[0] = 0;
    aip[0] = 0;
    for (uint32_t b = 0; b < B; b++) {
        indptr[b + 1] = indptr[b] + (int32_t)w->npages[b];
        aip[b + 1] = aip[b] + (int32_t)toks[b];
        last[b] = w->len[b] ? (int32_t)(w->len[b] - (w->npages[b] - 1) * ps) : 0;
    }
    nnz = (uint32_t)aip[B];
    int32_t *indices = malloc(4 * ((size_t)indptr[B] + 1));
    for (uint32_t b = 0; b < B; b++)
        for (uint32_t k = 0; k < w->npages[b]; k++)
            indices[indptr[b] + (int32_t)k] = (int32_t)w->pages[b * w->maxpages + k];
    /* source: [nnz, H, D] with padding when strided (K and V with different strides) */
    int64_t ksn = (int64_t)H * D + (strided ? 16 / e * 3 : 0), ksh = D + (strided ? 16 / e : 0);
    if (strided)
        ksn = (int64_t)H * ksh + 16 / e * 2;
    int64_t vsn = strided ? ksn + 16 / e : (int64_t)H * D, vsh = strided ? ksh : D;
    size_t kbytes = ((size_t)(nnz ? nnz : 1) * ksn + 16) * e,
           vbytes = ((size_t)(nnz ? nnz : 1) * vsn + 16) * e;
    uint8_t *hk = malloc(kbytes), *hv = malloc(vbytes);
    kvp_rng_fill(r, hk, kbytes);
    kvp_rng_fill(r, hv, vbytes);
    int32_t *bi = malloc(4 * (nnz + 1)), *pos = malloc(4 * (nnz + 1));
    int32_t *seq_lens = malloc(4 * B);
    for (uint32_t b = 0; b < B; b++)
        seq_lens[b] = (int32_t)w->len[b];
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(aip, seq_lens, B, nnz, bi, pos), 0);

    /* CPU reference on layer 1 (layer 0 must stay poisoned) */
    kvp_paged_kv_t kv = {.elem_bytes = e,
                         .num_pages = g->num_pages,
                         .page_size = ps,
                         .num_heads = H,
                         .head_dim = D,
                         .stride_page = d->stride_page,
                         .stride_n = d->stride_n,
                         .stride_h = d->stride_h,
                         .batch_size = B,
                         .kv_indptr = indptr,
                         .kv_indices = indices,
                         .kv_last_page_len = last};
    kv.k_data = w->ref + kvp_geom_layer_offset(d, 1);
    kv.v_data = (uint8_t *)kv.k_data + d->v_offset_bytes;
    kvp_append_src_t src = {.key = hk,
                            .value = hv,
                            .k_stride_n = ksn,
                            .k_stride_h = ksh,
                            .v_stride_n = vsn,
                            .v_stride_h = vsh};
    ck_assert_int_eq(kvp_append_paged_kv_cache_cpu(&kv, &src, bi, pos, nnz), 0);

    /* the same on the device */
    int32_t *d_indptr = dalloc(4 * (B + 1)), *d_aip = dalloc(4 * (B + 1)), *d_last = dalloc(4 * B);
    int32_t *d_indices = dalloc(4 * ((size_t)indptr[B] + 1));
    int32_t *d_bi = dalloc(4 * (nnz + 1)), *d_pos = dalloc(4 * (nnz + 1));
    int32_t *d_err = dalloc(4), *d_seq = dalloc(4 * B), *d_slots = dalloc(4 * (nnz + 1));
    uint8_t *dk = dalloc(kbytes), *dv = dalloc(vbytes);
    up(d_indptr, indptr, 4 * (B + 1));
    up(d_aip, aip, 4 * (B + 1));
    up(d_last, last, 4 * B);
    up(d_indices, indices, 4 * (size_t)indptr[B]);
    up(dk, hk, kbytes);
    up(dv, hv, vbytes);
    CK(cudaMemsetAsync(d_err, 0, 4, S));
    kvp_paged_kv_t dkv = kv;
    dkv.k_data = w->dpool + kvp_geom_layer_offset(d, 1);
    dkv.v_data = (uint8_t *)dkv.k_data + d->v_offset_bytes;
    dkv.kv_indptr = d_indptr;
    dkv.kv_indices = d_indices;
    dkv.kv_last_page_len = d_last;
    kvp_append_src_t dsrc = src;
    dsrc.key = dk;
    dsrc.value = dv;
    /* positions computed on the device, compared with the CPU's */
    ck_assert_int_eq(kvp_get_seq_lens_cuda(d_indptr, d_last, B, ps, d_seq, S), 0);
    ck_assert_int_eq(kvp_get_batch_indices_positions_cuda(d_aip, d_seq, B, nnz, d_bi, d_pos, S), 0);
    int rc;
    if (form == 0)
        rc = kvp_append_paged_kv_cache_cuda_opts(&dkv, &dsrc, d_bi, d_pos, nnz, d_err, OPTS, S);
    else if (form == 1)
        rc = kvp_append_paged_kv_cache_cuda_unchecked_opts(&dkv, &dsrc, d_bi, d_pos, nnz, d_err,
                                                           OPTS, S);
    else if (form == 2)
        rc = kvp_append_paged_kv_cache_fused_cuda_opts(&dkv, &dsrc, d_aip, nnz, d_err, 0, OPTS, S);
    else if (form == 3)
        rc = kvp_append_paged_kv_cache_fused_cuda_opts(&dkv, &dsrc, d_aip, nnz, d_err,
                                                       KVP_CUDA_APPEND_PDL, OPTS, S);
    else {
        /* the slots form: planned once, then appended (under PDL in form 5) */
        ck_assert_int_eq(kvp_append_plan_slots_cuda(&dkv, d_aip, nnz, d_slots, d_err, S), 0);
        rc = kvp_append_paged_kv_cache_slots_cuda(&dkv, &dsrc, d_slots, nnz, d_err,
                                                  form == 5 ? (unsigned)KVP_CUDA_APPEND_PDL : 0u,
                                                  OPTS, S);
    }
    ck_assert_int_eq(rc, 0);
    int32_t herr = -1;
    int32_t *hbi = malloc(4 * (nnz + 1)), *hpos = malloc(4 * (nnz + 1));
    CK(cudaMemcpyAsync(&herr, d_err, 4, cudaMemcpyDeviceToHost, S));
    CK(cudaMemcpyAsync(hbi, d_bi, 4 * (size_t)nnz, cudaMemcpyDeviceToHost, S));
    CK(cudaMemcpyAsync(hpos, d_pos, 4 * (size_t)nnz, cudaMemcpyDeviceToHost, S));
    int32_t *hslots = malloc(4 * (nnz + 1));
    CK(cudaMemcpyAsync(hslots, d_slots, 4 * (size_t)nnz, cudaMemcpyDeviceToHost, S));
    CK(cudaMemcpyAsync(w->back, w->dpool, d->pool_bytes, cudaMemcpyDeviceToHost, S));
    CK(cudaStreamSynchronize(S));
    ck_assert_int_eq(herr, 0);
    ck_assert_int_eq(memcmp(hbi, bi, 4 * (size_t)nnz), 0);
    ck_assert_int_eq(memcmp(hpos, pos, 4 * (size_t)nnz), 0);
    for (uint32_t i = 0; form >= 4 && i < nnz; i++) /* the planned slots, from the CPU's */
        ck_assert_int_eq(hslots[i], indices[indptr[bi[i]] + pos[i] / (int32_t)ps] * (int32_t)ps +
                                        pos[i] % (int32_t)ps);
    free(hslots);
    ck_assert_msg(memcmp(w->back, w->ref, d->pool_bytes) == 0,
                  "pool differs: ps %u B %u %s D %u e %u %s strided %d form %d nnz %u", ps, B,
                  g->layout ? "HND" : "NHD", D, e, g->storage ? "split" : "combined", strided, form,
                  nnz);
    void *frees[] = {d_indptr, d_aip, d_last,  d_indices, d_bi, d_pos,
                     d_err,    d_seq, d_slots, dk,        dv};
    for (unsigned i = 0; i < sizeof(frees) / sizeof(frees[0]); i++)
        CK(cudaFree(frees[i]));
    free(hbi), free(hpos), free(seq_lens), free(bi), free(pos), free(hk), free(hv);
    free(indices), free(indptr), free(aip), free(last);
}

static int gpu_present(void)
{
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

/* Every every-th configuration of the grid (layouts, storages, head dims, dtypes, page sizes,
 * batches, dense and strided sources), 4 rounds each, byte-exact against the CPU. Returns the
 * number of configurations run. */
static uint32_t run_grid(uint32_t every)
{
    static const uint32_t page_sizes[] = {1, 3, 7, 16, 17};
    static const uint32_t batches[] = {1, 2, 7, 23, 91};
    static const uint32_t dims[] = {64, 128, 256, 512};
    static const kvp_dtype_t dtypes[] = {KVP_DTYPE_FP8_E4M3, KVP_DTYPE_FP16, KVP_DTYPE_FP32,
                                         KVP_DTYPE_BF16, KVP_DTYPE_FP8_E5M2};
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(0xc0da));
    uint32_t configs = 0, idx = 0;
    for (int lay = 0; lay < 2; lay++)
        for (int sto = 0; sto < 2; sto++)
            for (unsigned di = 0; di < 4; di++)
                for (unsigned ti = 0; ti < 3; ti++)
                    for (unsigned pi = 0; pi < 5; pi++)
                        for (unsigned bi = 0; bi < 5; bi++)
                            for (int strided = 0; strided < 2; strided++) {
                                if (idx++ % every)
                                    continue;
                                world_t w;
                                memset(&w, 0, sizeof(w));
                                uint32_t B = batches[bi], ps = page_sizes[pi];
                                uint32_t rounds = 4, maxtok = 3 * 12 + rounds + 1;
                                w.maxpages = kvp_geom_pages_for(ps, maxtok) + 1;
                                kvp_dtype_t dt = dtypes[ti == 1   ? (configs & 1 ? 3 : 1)
                                                        : ti == 0 ? (configs & 1 ? 4 : 0)
                                                                  : 2];
                                w.g = (kvp_geom_t){.num_layers = 2,
                                                   .num_pages = B * w.maxpages + 3,
                                                   .page_size = ps,
                                                   .num_kv_heads = 2,
                                                   .head_dim = dims[di],
                                                   .dtype = dt,
                                                   .layout = (kvp_layout_t)lay,
                                                   .storage = (kvp_storage_t)sto,
                                                   .num_devices = 1};
                                ck_assert_int_eq(kvp_geom_derive(&w.g, &w.d), 0);
                                w.B = B;
                                w.ref = malloc(w.d.pool_bytes);
                                w.back = malloc(w.d.pool_bytes);
                                memset(w.ref, 0xA5, w.d.pool_bytes);
                                w.dpool = dalloc(w.d.pool_bytes);
                                CK(cudaMemcpyAsync(w.dpool, w.ref, w.d.pool_bytes,
                                                   cudaMemcpyHostToDevice, S));
                                w.pages = calloc((size_t)B * w.maxpages, 4);
                                w.npages = calloc(B, 4);
                                w.len = calloc(B, 4);
                                w.freelist = malloc(4 * (size_t)w.g.num_pages);
                                w.nfree = w.g.num_pages;
                                for (uint32_t p = 0; p < w.nfree; p++)
                                    w.freelist[p] = p;
                                uint32_t *toks = calloc(B, 4);
                                for (uint32_t k = 0; k < rounds; k++) {
                                    for (uint32_t b = 0; b < B; b++)
                                        toks[b] = (k % 2 == 0) ? kvp_rng_below(&r, 12)
                                                               : (kvp_rng_below(&r, 5) ? 1 : 0);
                                    round_once(&w, &r, toks, strided, (int)((configs + k) % 6));
                                }
                                configs++;
                                free(toks), free(w.freelist), free(w.len), free(w.npages);
                                free(w.pages), free(w.ref), free(w.back);
                                CK(cudaFree(w.dpool));
                            }
    return configs;
}

START_TEST(cuda_matches_cpu_over_the_grid)
{
    /* KVP_GPU_QUICK (compute-sanitizer runs): every 23rd configuration only */
    uint32_t configs = run_grid(getenv("KVP_GPU_QUICK") ? 23 : 1);
    printf("grid: %u configurations x 4 rounds byte-exact\n", configs);
}
END_TEST

/* Prefill-sized appends (the shapes the block kernel takes), checked against the CPU
 * byte for byte on a poisoned pool: 3 requests of 700, 333 and 1200 new tokens after 5, 0 and
 * 13 old ones (so items straddle page and request boundaries), H 8, D 128, fp16, pages of 16,
 * both layouts, dense and strided sources. Forms: unchecked with every 97th token padding,
 * fused, fused under PDL, and fused with one page id of request 1 out of range (the rows of
 * that page are skipped, the rest written, KVP_ERANGE reported). The reference for the last
 * is the CPU append with those rows as padding. */
static void prefill_case(kvp_layout_t lay, int strided, int form, kvp_rng_t *r)
{
    enum { B = 3 };
    static const uint32_t old_len[B] = {5, 0, 13}, toks[B] = {700, 333, 1200};
    const uint32_t H = 8, D = 128, e = 2, ps = 16;
    uint32_t npages[B], P = 1; /* page 0 unused: the pool's first page stays poisoned */
    int32_t indptr[B + 1] = {0}, aip[B + 1] = {0}, last[B], seq[B];
    for (int b = 0; b < B; b++) {
        seq[b] = (int32_t)(old_len[b] + toks[b]);
        npages[b] = kvp_geom_pages_for(ps, (uint32_t)seq[b]);
        indptr[b + 1] = indptr[b] + (int32_t)npages[b];
        aip[b + 1] = aip[b] + (int32_t)toks[b];
        last[b] = seq[b] - (int32_t)(npages[b] - 1) * (int32_t)ps;
        P += npages[b];
    }
    const uint32_t nnz = (uint32_t)aip[B], np = (uint32_t)indptr[B];
    /* pages in a shuffled order, interleaving the requests */
    int32_t *indices = malloc(4 * np);
    for (uint32_t k = 0; k < np; k++)
        indices[k] = (int32_t)(k + 1);
    for (uint32_t k = np - 1; k > 0; k--) {
        uint32_t j = kvp_rng_below(r, k + 1);
        int32_t t = indices[k];
        indices[k] = indices[j], indices[j] = t;
    }
    kvp_geom_t g = {.num_layers = 1,
                    .num_pages = P,
                    .page_size = ps,
                    .num_kv_heads = H,
                    .head_dim = D,
                    .dtype = KVP_DTYPE_FP16,
                    .layout = lay,
                    .storage = KVP_STORAGE_COMBINED,
                    .num_devices = 1};
    kvp_geom_derived_t d;
    ck_assert_int_eq(kvp_geom_derive(&g, &d), 0);
    const int64_t sh = D + (strided ? 8 : 0), sn = (int64_t)H * sh + (strided ? 16 : 0);
    const size_t src_bytes = (size_t)nnz * sn * e;
    uint8_t *hk = malloc(src_bytes), *hv = malloc(src_bytes);
    uint8_t *ref = malloc(d.pool_bytes), *back = malloc(d.pool_bytes);
    kvp_rng_fill(r, hk, src_bytes);
    kvp_rng_fill(r, hv, src_bytes);
    memset(ref, 0xA5, d.pool_bytes);
    int32_t *bi = malloc(4 * nnz), *pos = malloc(4 * nnz);
    ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(aip, seq, B, nnz, bi, pos), 0);
    /* the device's inputs: padding for the unchecked form, a bad page for form 3 */
    int32_t *dev_bi = malloc(4 * nnz), *dev_indices = malloc(4 * np);
    memcpy(dev_bi, bi, 4 * nnz);
    memcpy(dev_indices, indices, 4 * np);
    const int32_t bad_k = indptr[1] + 7; /* request 1, positions 112..127 */
    for (uint32_t i = 0; i < nnz; i++) {
        if (form == 0 && i % 97 == 3)
            bi[i] = dev_bi[i] = -1;
        if (form == 3 && bi[i] == 1 && pos[i] / (int32_t)ps == 7)
            bi[i] = -1; /* the reference skips what the device must skip */
    }
    if (form == 3)
        dev_indices[bad_k] = (int32_t)P + 5;
    kvp_paged_kv_t kv = {.k_data = ref,
                         .v_data = ref + d.v_offset_bytes,
                         .elem_bytes = e,
                         .num_pages = P,
                         .page_size = ps,
                         .num_heads = H,
                         .head_dim = D,
                         .stride_page = d.stride_page,
                         .stride_n = d.stride_n,
                         .stride_h = d.stride_h,
                         .batch_size = B,
                         .kv_indptr = indptr,
                         .kv_indices = indices,
                         .kv_last_page_len = last};
    kvp_append_src_t src = {.key = hk,
                            .value = hv,
                            .k_stride_n = sn,
                            .k_stride_h = sh,
                            .v_stride_n = sn,
                            .v_stride_h = sh};
    ck_assert_int_eq(kvp_append_paged_kv_cache_cpu(&kv, &src, bi, pos, nnz), 0);

    uint8_t *dpool = dalloc(d.pool_bytes), *dk = dalloc(src_bytes), *dv = dalloc(src_bytes);
    int32_t *d_indptr = dalloc(4 * (B + 1)), *d_aip = dalloc(4 * (B + 1)), *d_last = dalloc(4 * B);
    int32_t *d_indices = dalloc(4 * np), *d_bi = dalloc(4 * nnz), *d_pos = dalloc(4 * nnz);
    int32_t *d_err = dalloc(4);
    CK(cudaMemsetAsync(dpool, 0xA5, d.pool_bytes, S));
    up(dk, hk, src_bytes);
    up(dv, hv, src_bytes);
    up(d_indptr, indptr, 4 * (B + 1));
    up(d_aip, aip, 4 * (B + 1));
    up(d_last, last, 4 * B);
    up(d_indices, dev_indices, 4 * np);
    up(d_bi, dev_bi, 4 * nnz);
    up(d_pos, pos, 4 * nnz);
    CK(cudaMemsetAsync(d_err, 0, 4, S));
    kvp_paged_kv_t dkv = kv;
    dkv.k_data = dpool;
    dkv.v_data = dpool + d.v_offset_bytes;
    dkv.kv_indptr = d_indptr;
    dkv.kv_indices = d_indices;
    dkv.kv_last_page_len = d_last;
    kvp_append_src_t dsrc = src;
    dsrc.key = dk;
    dsrc.value = dv;
    int rc = form == 0 ? kvp_append_paged_kv_cache_cuda_unchecked_opts(&dkv, &dsrc, d_bi, d_pos,
                                                                       nnz, d_err, OPTS, S)
                       : kvp_append_paged_kv_cache_fused_cuda_opts(
                             &dkv, &dsrc, d_aip, nnz, d_err,
                             form == 2 ? (unsigned)KVP_CUDA_APPEND_PDL : 0u, OPTS, S);
    ck_assert_int_eq(rc, 0);
    int32_t herr = -1;
    CK(cudaMemcpyAsync(&herr, d_err, 4, cudaMemcpyDeviceToHost, S));
    CK(cudaMemcpyAsync(back, dpool, d.pool_bytes, cudaMemcpyDeviceToHost, S));
    CK(cudaStreamSynchronize(S));
    ck_assert_int_eq(herr, form == 3 ? KVP_ERANGE : 0);
    ck_assert_msg(memcmp(back, ref, d.pool_bytes) == 0, "pool differs: %s strided %d form %d",
                  lay ? "HND" : "NHD", strided, form);
    void *fr[] = {dpool, dk, dv, d_indptr, d_aip, d_last, d_indices, d_bi, d_pos, d_err};
    for (unsigned i = 0; i < sizeof(fr) / sizeof(fr[0]); i++)
        CK(cudaFree(fr[i]));
    free(indices), free(hk), free(hv), free(ref), free(back), free(bi), free(pos);
    free(dev_bi), free(dev_indices);
}

/* Each forced shape of the copy kernels (what [tuning] append_* and bench_append_cuda's flags
 * choose) writes the same bytes as the CPU: a seventh of the grid and every prefill case. */
START_TEST(kernel_shapes_match_cpu)
{
    static const kvp_append_cuda_opts_t shapes[] = {
        {.kernel = KVP_APPEND_CUDA_KERNEL_WARP},
        {.kernel = KVP_APPEND_CUDA_KERNEL_WARP, .warps_per_block = 1},
        {.kernel = KVP_APPEND_CUDA_KERNEL_WARP, .warps_per_block = KVP_APPEND_CUDA_MAX_WARPS},
        {.kernel = KVP_APPEND_CUDA_KERNEL_BLOCK},
        {.kernel = KVP_APPEND_CUDA_KERNEL_BLOCK, .tokens_per_block = 1},
        {.kernel = KVP_APPEND_CUDA_KERNEL_BLOCK,
         .tokens_per_block = KVP_APPEND_CUDA_MAX_TPB,
         .blocks_per_sm = 1},
        {.blocks_per_sm = 4, .hints = KVP_APPEND_CUDA_HINT_LD | KVP_APPEND_CUDA_HINT_ST},
        {.kernel = KVP_APPEND_CUDA_KERNEL_FLAT},
        {.kernel = KVP_APPEND_CUDA_KERNEL_FLAT, .hints = KVP_APPEND_CUDA_HINT_LD},
        {.kernel = KVP_APPEND_CUDA_KERNEL_WARP, .vecs_per_thread = 1},
        {.kernel = KVP_APPEND_CUDA_KERNEL_WARP,
         .vecs_per_thread = KVP_APPEND_CUDA_MAX_ITEMS,
         .warps_per_block = KVP_APPEND_CUDA_MAX_WARPS},
        {.vecs_per_thread = 3, .warps_per_block = 5},
    };
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(0x5a9e));
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        OPTS = &shapes[i];
        ck_assert_uint_gt(run_grid(7), 0);
        for (int lay = 0; lay < 2; lay++)
            for (int form = 0; form < 4; form++)
                prefill_case((kvp_layout_t)lay, (int)(i & 1), form, &r);
    }
    OPTS = NULL;
}
END_TEST

/* Options out of range are refused before anything is queued, whatever nnz. */
START_TEST(bad_kernel_options_are_refused)
{
    static const kvp_append_cuda_opts_t bad[] = {
        {.kernel = KVP_APPEND_CUDA_KERNEL_FLAT + 1},
        {.tokens_per_block = KVP_APPEND_CUDA_MAX_TPB + 1},
        {.blocks_per_sm = KVP_APPEND_CUDA_MAX_BPSM + 1},
        {.warps_per_block = KVP_APPEND_CUDA_MAX_WARPS + 1},
        {.hints = 4},
        {.vecs_per_thread = KVP_APPEND_CUDA_MAX_ITEMS + 1},
        {.checked = KVP_APPEND_CUDA_CHECKED_BLOCK + 1},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        ck_assert_int_eq(kvp_append_cuda_opts_check(&bad[i]), KVP_EINVAL);
        ck_assert_int_eq(
            kvp_append_paged_kv_cache_cuda_opts(NULL, NULL, NULL, NULL, 0, NULL, &bad[i], S),
            KVP_EINVAL);
        ck_assert_int_eq(kvp_append_paged_kv_cache_cuda_unchecked_opts(NULL, NULL, NULL, NULL, 0,
                                                                       NULL, &bad[i], S),
                         KVP_EINVAL);
        ck_assert_int_eq(
            kvp_append_paged_kv_cache_fused_cuda_opts(NULL, NULL, NULL, 0, NULL, 0, &bad[i], S),
            KVP_EINVAL);
        ck_assert_int_eq(
            kvp_append_paged_kv_cache_slots_cuda(NULL, NULL, NULL, 0, NULL, 0, &bad[i], S),
            KVP_EINVAL);
    }
    const kvp_append_cuda_opts_t top = {KVP_APPEND_CUDA_KERNEL_BLOCK,
                                        KVP_APPEND_CUDA_MAX_TPB,
                                        KVP_APPEND_CUDA_MAX_BPSM,
                                        KVP_APPEND_CUDA_MAX_WARPS,
                                        3,
                                        KVP_APPEND_CUDA_MAX_ITEMS,
                                        KVP_APPEND_CUDA_CHECKED_BLOCK};
    ck_assert_int_eq(kvp_append_cuda_opts_check(&top), 0);
    ck_assert_int_eq(kvp_append_cuda_opts_check(NULL), 0);
    ck_assert_int_eq(kvp_append_paged_kv_cache_cuda_opts(NULL, NULL, NULL, NULL, 0, NULL, &top, S),
                     0);
    const kvp_pack_cuda_opts_t pack_bad = {.max_blocks = KVP_PACK_CUDA_MAX_BLOCKS + 1};
    ck_assert_int_eq(kvp_kv_pack_range_cuda_ex(NULL, NULL, 0, 0, 0, NULL, &pack_bad, S),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_kv_unpack_range_cuda_ex(NULL, NULL, 0, 0, 0, NULL, &pack_bad, S),
                     KVP_EINVAL);
}
END_TEST

START_TEST(prefill_matches_cpu)
{
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(0x9f11));
    for (int lay = 0; lay < 2; lay++)
        for (int strided = 0; strided < 2; strided++)
            for (int form = 0; form < 4; form++)
                prefill_case((kvp_layout_t)lay, strided, form, &r);
}
END_TEST

/* A small fixed setup for the guard and graph tests: B 3, page 4, H 2, D 64 fp16. */
typedef struct {
    kvp_paged_kv_t kv;
    kvp_append_src_t src;
    int32_t *d_bi, *d_pos, *d_err, *d_aip;
    uint8_t *pool;
    size_t pool_bytes;
} small_t;

static void small_init(small_t *s, const int32_t *bi, const int32_t *pos, uint32_t nnz)
{
    static const int32_t indptr[4] = {0, 1, 2, 4}, indices[4] = {3, 0, 1, 2}, last[3] = {2, 4, 1};
    static const int32_t aip[4] = {0, 1, 3, 4};
    s->pool_bytes = 8 * 2 * 4 * 2 * 64 * 2;
    s->pool = dalloc(s->pool_bytes);
    CK(cudaMemsetAsync(s->pool, 0x5a, s->pool_bytes, S));
    int32_t *d_indptr = dalloc(16), *d_indices = dalloc(16), *d_last = dalloc(12);
    s->d_aip = dalloc(16);
    up(d_indptr, indptr, 16);
    up(d_indices, indices, 16);
    up(d_last, last, 12);
    up(s->d_aip, aip, 16);
    s->d_bi = dalloc(4 * 8);
    s->d_pos = dalloc(4 * 8);
    s->d_err = dalloc(4);
    up(s->d_bi, bi, 4 * nnz);
    up(s->d_pos, pos, 4 * nnz);
    CK(cudaMemsetAsync(s->d_err, 0, 4, S));
    s->kv = (kvp_paged_kv_t){.k_data = s->pool,
                             .v_data = s->pool + 4 * 2 * 64 * 2,
                             .elem_bytes = 2,
                             .num_pages = 8,
                             .page_size = 4,
                             .num_heads = 2,
                             .head_dim = 64,
                             .stride_page = 2 * 4 * 2 * 64,
                             .stride_n = 2 * 64,
                             .stride_h = 64,
                             .batch_size = 3,
                             .kv_indptr = d_indptr,
                             .kv_indices = d_indices,
                             .kv_last_page_len = d_last};
    uint8_t *src = dalloc(8 * 2 * 64 * 2 * 2);
    CK(cudaMemsetAsync(src, 0x11, 8 * 2 * 64 * 2 * 2, S));
    s->src = (kvp_append_src_t){.key = src,
                                .value = src + 8 * 2 * 64 * 2,
                                .k_stride_n = 128,
                                .k_stride_h = 64,
                                .v_stride_n = 128,
                                .v_stride_h = 64};
}

static int32_t read_err(const small_t *s)
{
    int32_t e = 0;
    CK(cudaMemcpyAsync(&e, s->d_err, 4, cudaMemcpyDeviceToHost, S));
    CK(cudaStreamSynchronize(S));
    return e;
}

static int pool_untouched(const small_t *s)
{
    uint8_t *h = malloc(s->pool_bytes);
    CK(cudaMemcpy(h, s->pool, s->pool_bytes, cudaMemcpyDeviceToHost));
    int ok = 1;
    for (size_t i = 0; i < s->pool_bytes; i++)
        ok &= h[i] == 0x5a;
    free(h);
    return ok;
}

START_TEST(bad_position_writes_nothing_and_reports)
{
    /* request 0 has 2 tokens: position 2 is outside it; the other tokens are fine */
    int32_t bi[4] = {1, 1, 2, 0}, pos[4] = {2, 3, 4, 2};
    small_t s;
    small_init(&s, bi, pos, 4);
    ck_assert_int_eq(kvp_append_paged_kv_cache_cuda(&s.kv, &s.src, s.d_bi, s.d_pos, 4, s.d_err, S),
                     0);
    ck_assert_int_eq(read_err(&s), KVP_ERANGE);
    ck_assert(pool_untouched(&s));
    /* host-visible problems are refused before anything is enqueued */
    kvp_paged_kv_t bad = s.kv;
    bad.head_dim = 60; /* 120-byte rows: not a multiple of 16 */
    ck_assert_int_eq(kvp_append_paged_kv_cache_cuda(&bad, &s.src, s.d_bi, s.d_pos, 4, s.d_err, S),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_append_paged_kv_cache_cuda(&s.kv, &s.src, s.d_bi, s.d_pos, 4, NULL, S),
                     KVP_EINVAL);
}
END_TEST

/* The checked form's refusals, each kind of bad entry alone (and two together), in each of its
 * ways: a decode step of B tokens with the bad entry in the last token (so the blocks that
 * write nothing else must see it) as one launch whose every block checks every token, as one
 * validation block and the copy behind it, and forced onto the validation kernel + gated
 * block kernel; then 6 * B tokens (the validation block) and 10 * B (a prefill's way). A bad case
 * leaves the whole pool untouched with the exact code; the good case (with padding rows) writes
 * exactly the CPU's bytes and resets an error word that held garbage to 0. */
enum { CK_B = 300, CK_LEN = 40, CK_PS = 16, CK_H = 2, CK_D = 64 };

static void checked_case(uint32_t per_req, const kvp_append_cuda_opts_t *opts, int bad)
{
    const uint32_t B = CK_B, ps = CK_PS, pages_per = (CK_LEN + ps - 1) / ps;
    const uint32_t P = B * pages_per + 1, nnz = B * per_req, e = 2;
    const size_t page_bytes = (size_t)ps * CK_H * CK_D * e, pool_bytes = 2 * P * page_bytes;
    int32_t indptr[CK_B + 1], last[CK_B], *indices = malloc(4 * B * pages_per);
    int32_t *bi = malloc(4 * nnz), *pos = malloc(4 * nnz);
    for (uint32_t b = 0; b <= B; b++)
        indptr[b] = (int32_t)(b * pages_per);
    for (uint32_t b = 0; b < B; b++) {
        last[b] = (int32_t)(CK_LEN - (pages_per - 1) * ps);
        for (uint32_t k = 0; k < pages_per; k++)
            indices[b * pages_per + k] = (int32_t)(1 + k * B + b);
        for (uint32_t j = 0; j < per_req; j++) {
            bi[b * per_req + j] = (int32_t)b;
            pos[b * per_req + j] = (int32_t)(CK_LEN - per_req + j);
        }
    }
    const uint32_t t = nnz - 1, bt = (uint32_t)bi[t]; /* the last token, of the last request */
    switch (bad) {
    case 1:
        bi[t] = (int32_t)B;
        break; /* ERANGE */
    case 2:
        pos[t] = CK_LEN;
        break; /* ERANGE */
    case 3:
        pos[t] = -1;
        break; /* ERANGE */
    case 4:
        indices[indptr[bt] + pos[t] / (int32_t)ps] = (int32_t)P;
        break; /* ERANGE */
    case 5:
        last[bt] = 0;
        break; /* ERANGE */
    case 6:
        indptr[B] = indptr[B - 1] - 1;
        break; /* EINVAL */
    case 7:
        indptr[0] = 1;
        break; /* EINVAL */
    case 8:
        indptr[B] = indptr[B - 1] - 1, bi[t - 1] = (int32_t)B;
        break; /* EINVAL */
    case 9:
        bi[0] = bi[nnz / 2] = bi[t] = -1;
        break; /* padding: fine */
    default:
        break;
    }
    const int32_t want = bad >= 6 && bad <= 8 ? KVP_EINVAL : bad >= 1 && bad <= 5 ? KVP_ERANGE : 0;
    const size_t src_bytes = (size_t)nnz * CK_H * CK_D * e;
    uint8_t *hk = malloc(src_bytes), *hv = malloc(src_bytes), *ref = malloc(pool_bytes);
    uint8_t *back = malloc(pool_bytes);
    kvp_rng_t r;
    kvp_rng_seed(&r, 0xc4ec + (uint64_t)bad);
    kvp_rng_fill(&r, hk, src_bytes);
    kvp_rng_fill(&r, hv, src_bytes);
    memset(ref, 0x3c, pool_bytes);
    kvp_paged_kv_t kv = {.k_data = ref,
                         .v_data = ref + P * page_bytes,
                         .elem_bytes = e,
                         .num_pages = P,
                         .page_size = ps,
                         .num_heads = CK_H,
                         .head_dim = CK_D,
                         .stride_page = (int64_t)ps * CK_H * CK_D,
                         .stride_n = CK_H * CK_D,
                         .stride_h = CK_D,
                         .batch_size = B,
                         .kv_indptr = indptr,
                         .kv_indices = indices,
                         .kv_last_page_len = last};
    kvp_append_src_t src = {.key = hk,
                            .value = hv,
                            .k_stride_n = CK_H * CK_D,
                            .k_stride_h = CK_D,
                            .v_stride_n = CK_H * CK_D,
                            .v_stride_h = CK_D};
    if (!want)
        ck_assert_int_eq(kvp_append_paged_kv_cache_cpu(&kv, &src, bi, pos, nnz), 0);
    uint8_t *dpool = dalloc(pool_bytes), *dk = dalloc(src_bytes), *dv = dalloc(src_bytes);
    int32_t *d_indptr = dalloc(4 * (B + 1)), *d_last = dalloc(4 * B);
    int32_t *d_indices = dalloc(4 * B * pages_per), *d_bi = dalloc(4 * nnz);
    int32_t *d_pos = dalloc(4 * nnz), *d_err = dalloc(4);
    CK(cudaMemsetAsync(dpool, 0x3c, pool_bytes, S));
    CK(cudaMemsetAsync(d_err, 0x7f, 4, S)); /* garbage: the append resets it */
    up(dk, hk, src_bytes);
    up(dv, hv, src_bytes);
    up(d_indptr, indptr, 4 * (B + 1));
    up(d_last, last, 4 * B);
    up(d_indices, indices, 4 * B * pages_per);
    up(d_bi, bi, 4 * nnz);
    up(d_pos, pos, 4 * nnz);
    kvp_paged_kv_t dkv = kv;
    dkv.k_data = dpool;
    dkv.v_data = dpool + P * page_bytes;
    dkv.kv_indptr = d_indptr;
    dkv.kv_indices = d_indices;
    dkv.kv_last_page_len = d_last;
    kvp_append_src_t dsrc = src;
    dsrc.key = dk;
    dsrc.value = dv;
    ck_assert_int_eq(
        kvp_append_paged_kv_cache_cuda_opts(&dkv, &dsrc, d_bi, d_pos, nnz, d_err, opts, S), 0);
    int32_t herr = 0;
    CK(cudaMemcpyAsync(&herr, d_err, 4, cudaMemcpyDeviceToHost, S));
    CK(cudaMemcpyAsync(back, dpool, pool_bytes, cudaMemcpyDeviceToHost, S));
    CK(cudaStreamSynchronize(S));
    ck_assert_msg(herr == want, "per_req %u opts %s bad %d: err %d, expected %d", per_req,
                  opts ? "block" : "auto", bad, herr, want);
    ck_assert_msg(memcmp(back, ref, pool_bytes) == 0, "per_req %u opts %s bad %d: pool differs",
                  per_req, opts ? "block" : "auto", bad);
    void *fr[] = {dpool, dk, dv, d_indptr, d_last, d_indices, d_bi, d_pos, d_err};
    for (unsigned i = 0; i < sizeof(fr) / sizeof(fr[0]); i++)
        CK(cudaFree(fr[i]));
    free(indices), free(bi), free(pos), free(hk), free(hv), free(ref), free(back);
}

START_TEST(checked_refuses_each_bad_entry)
{
    static const kvp_append_cuda_opts_t one = {.checked = KVP_APPEND_CUDA_CHECKED_ONE};
    static const kvp_append_cuda_opts_t vblock = {.checked = KVP_APPEND_CUDA_CHECKED_BLOCK};
    static const kvp_append_cuda_opts_t block = {.kernel = KVP_APPEND_CUDA_KERNEL_BLOCK};
    for (int bad = 0; bad <= 9; bad++) {
        checked_case(1, NULL, bad);    /* 300 tokens: the validation block + gated copy */
        checked_case(1, &one, bad);    /* the one launch */
        checked_case(1, &vblock, bad); /* the validation block, asked for */
        checked_case(1, &block, bad);  /* the validation kernel + gated block kernel */
        checked_case(6, NULL, bad);    /* 1,800: the validation block's every thread busy */
        checked_case(10, NULL, bad);   /* 3,000: a prefill's way */
    }
}
END_TEST

/* The slots form's own guards: the plan gives -1 (and KVP_ERANGE) to a token whose page id is
 * out of range and the right slot to the others; the append (row, flat and block kernel)
 * skips a negative slot and one beyond the pool (reporting KVP_ERANGE) and writes the rest,
 * byte-exact with the CPU. */
START_TEST(slots_form_guards)
{
    /* small_init's table: requests of 2, 4 and 1 tokens (pages 3 | 0 | 1 2), pages of 4 */
    int32_t none[1] = {0};
    small_t s;
    small_init(&s, none, none, 1);
    int32_t *d_slots = dalloc(4 * 4), hs[4];
    ck_assert_int_eq(kvp_append_plan_slots_cuda(&s.kv, s.d_aip, 4, d_slots, s.d_err, S), 0);
    CK(cudaMemcpyAsync(hs, d_slots, 16, cudaMemcpyDeviceToHost, S));
    /* aip {0,1,3,4}: token 0 -> request 0 position 1; 1, 2 -> request 1 positions 2, 3;
     * 3 -> request 2 position 4 (its second page, id 2) */
    ck_assert_int_eq(read_err(&s), 0);
    ck_assert_int_eq(hs[0], 3 * 4 + 1);
    ck_assert_int_eq(hs[1], 0 * 4 + 2);
    ck_assert_int_eq(hs[2], 0 * 4 + 3);
    ck_assert_int_eq(hs[3], 2 * 4 + 0);
    /* request 2's second page id out of range: its token has no slot */
    const int32_t bad_indices[4] = {3, 0, 1, 8};
    up((void *)s.kv.kv_indices, bad_indices, 16);
    ck_assert_int_eq(kvp_append_plan_slots_cuda(&s.kv, s.d_aip, 4, d_slots, s.d_err, S), 0);
    CK(cudaMemcpyAsync(hs, d_slots, 16, cudaMemcpyDeviceToHost, S));
    ck_assert_int_eq(read_err(&s), KVP_ERANGE);
    ck_assert_int_eq(hs[3], -1);
    ck_assert_int_eq(hs[0], 3 * 4 + 1);
    /* the append: slots -1 and 8 * 4 (beyond the pool) skipped, 13 and 2 written; by each
     * kernel the slots form can take (auto: the row kernel at this size; the flat kernel auto
     * takes for large batches; the block kernel), from an untouched pool each time */
    const int32_t slots[4] = {-1, 13, 8 * 4, 2};
    up(d_slots, slots, 16);
    static const kvp_append_cuda_opts_t kernels[] = {
        {.kernel = KVP_APPEND_CUDA_KERNEL_AUTO},
        {.kernel = KVP_APPEND_CUDA_KERNEL_FLAT},
        {.kernel = KVP_APPEND_CUDA_KERNEL_BLOCK},
    };
    uint8_t *h = malloc(s.pool_bytes);
    for (size_t k = 0; k < sizeof(kernels) / sizeof(kernels[0]); k++) {
        CK(cudaMemsetAsync(s.pool, 0x5a, s.pool_bytes, S));
        CK(cudaMemsetAsync(s.d_err, 0, 4, S));
        ck_assert_int_eq(kvp_append_paged_kv_cache_slots_cuda(&s.kv, &s.src, d_slots, 4, s.d_err, 0,
                                                              &kernels[k], S),
                         0);
        ck_assert_msg(read_err(&s) == KVP_ERANGE, "kernel %u: err %d", kernels[k].kernel,
                      read_err(&s));
        CK(cudaMemcpy(h, s.pool, s.pool_bytes, cudaMemcpyDeviceToHost));
        /* combined storage: page p's K at byte p * 2048, its V 1024 further, slot offset o
         * at o * 256 (2 heads * 64 * 2 bytes) in each; the source is 0x11 everywhere */
        size_t changed = 0;
        for (size_t i = 0; i < s.pool_bytes; i++) {
            size_t slot = i / 2048 * 4 + i % 1024 / 256;
            int written = slot == 13 || slot == 2;
            ck_assert_msg(h[i] == (written ? 0x11 : 0x5a), "kernel %u: byte %zu is 0x%02x",
                          kernels[k].kernel, i, h[i]);
            changed += written;
        }
        ck_assert_uint_eq(changed, 2 * 2 * 256); /* 2 tokens, K and V, 256 bytes each */
    }
    free(h);
    CK(cudaFree(d_slots));
    /* host-side refusals */
    ck_assert_int_eq(
        kvp_append_paged_kv_cache_slots_cuda(&s.kv, &s.src, NULL, 4, s.d_err, 0, NULL, S),
        KVP_EINVAL);
    ck_assert_int_eq(
        kvp_append_paged_kv_cache_slots_cuda(&s.kv, &s.src, slots, 4, s.d_err, 2, NULL, S),
        KVP_EINVAL);
    ck_assert_int_eq(kvp_append_plan_slots_cuda(&s.kv, NULL, 4, (int32_t *)slots, s.d_err, S),
                     KVP_EINVAL);
}
END_TEST

START_TEST(padding_and_nnz_zero)
{
    int32_t bi[4] = {-1, -1, -1, -1}, pos[4] = {0, 0, 0, 0};
    small_t s;
    small_init(&s, bi, pos, 4);
    ck_assert_int_eq(kvp_append_paged_kv_cache_cuda(&s.kv, &s.src, s.d_bi, s.d_pos, 4, s.d_err, S),
                     0);
    ck_assert_int_eq(read_err(&s), 0);
    ck_assert(pool_untouched(&s));
    ck_assert_int_eq(kvp_append_paged_kv_cache_cuda(NULL, NULL, NULL, NULL, 0, NULL, S), 0);
    ck_assert_int_eq(kvp_append_paged_kv_cache_fused_cuda(NULL, NULL, NULL, 0, NULL, S), 0);
    ck_assert(pool_untouched(&s));
}
END_TEST

START_TEST(graph_replay_gives_the_same_bytes)
{
    int32_t bi[4] = {0, 1, 1, 2}, pos[4] = {1, 2, 3, 4};
    small_t a, b;
    small_init(&a, bi, pos, 4);
    small_init(&b, bi, pos, 4);
    ck_assert_int_eq(kvp_cuda_kernels_preload(), 0);
    ck_assert_int_eq(kvp_append_paged_kv_cache_fused_cuda(&a.kv, &a.src, a.d_aip, 4, a.d_err, S),
                     0);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamSynchronize(S));
    CK(cudaStreamBeginCapture(S, cudaStreamCaptureModeThreadLocal));
    ck_assert_int_eq(kvp_append_paged_kv_cache_fused_cuda(&b.kv, &b.src, b.d_aip, 4, b.d_err, S),
                     0);
    CK(cudaStreamEndCapture(S, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; i++)
        CK(cudaGraphLaunch(exec, S));
    CK(cudaStreamSynchronize(S));
    uint8_t *ha = malloc(a.pool_bytes), *hb = malloc(b.pool_bytes);
    CK(cudaMemcpy(ha, a.pool, a.pool_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb, b.pool, b.pool_bytes, cudaMemcpyDeviceToHost));
    ck_assert_int_eq(memcmp(ha, hb, a.pool_bytes), 0);
    ck_assert_int_eq(read_err(&b), 0);
    int changed = 0;
    for (size_t i = 0; i < a.pool_bytes; i++)
        changed += ha[i] != 0x5a;
    ck_assert_int_eq(changed, 4 * 2 * 2 * 128); /* 4 tokens x K,V x 2 heads x 128 bytes */
    free(ha), free(hb);
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
}
END_TEST

/* Under PDL the append waits for the kernel before it, which writes its sources: a slow
 * producer (spins 20 us, then fills the sources with byte j) and a PDL append into layer j,
 * 24 times back to back, also replayed from a graph. Every layer must hold its own byte: an
 * append that read its sources early would copy the previous round's byte. Two sizes: 256
 * tokens (the warp kernel) and 4096 (the block kernel). */
static void pdl_round_trip(int B, uint32_t ps)
{
    enum { ROUNDS = 24 };
    const uint32_t H = 8, D = 128, row = D * 2;
    const size_t layer_bytes = (size_t)B * 2 * ps * H * row; /* B pages of K and V */
    uint8_t *pool = dalloc(layer_bytes * ROUNDS), *src = dalloc((size_t)2 * B * H * row);
    int32_t *hip = malloc(4 * (B + 1)), *hidx = malloc(4 * B), *hlast = malloc(4 * B);
    for (int b = 0; b <= B; b++)
        hip[b] = b;
    for (int b = 0; b < B; b++)
        hidx[b] = (b * 7) % B, hlast[b] = 1;
    int32_t *d_ip = dalloc(4 * (B + 1)), *d_idx = dalloc(4 * B), *d_last = dalloc(4 * B),
            *d_aip = dalloc(4 * (B + 1)), *d_err = dalloc(4);
    up(d_ip, hip, 4 * (B + 1));
    up(d_idx, hidx, 4 * B);
    up(d_last, hlast, 4 * B);
    up(d_aip, hip, 4 * (B + 1)); /* one token per request */
    CK(cudaMemsetAsync(d_err, 0, 4, S));
    ck_assert_int_eq(kvp_cuda_kernels_preload(), 0);
    ck_assert_int_eq(kvp_bench_kernels_preload(), 0);
    kvp_append_src_t as = {.key = src,
                           .value = src + (size_t)B * H * row,
                           .k_stride_n = H * D,
                           .k_stride_h = D,
                           .v_stride_n = H * D,
                           .v_stride_h = D};
    uint8_t *host = malloc(layer_bytes);
    for (int pass = 0; pass < 2; pass++) { /* 0: stream, 1: graph replay */
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        CK(cudaMemsetAsync(pool, 0, layer_bytes * ROUNDS, S));
        CK(cudaStreamSynchronize(S));
        if (pass == 1)
            CK(cudaStreamBeginCapture(S, cudaStreamCaptureModeThreadLocal));
        for (int j = 0; j < ROUNDS; j++) {
            kvp_paged_kv_t kv = {.k_data = pool + layer_bytes * j,
                                 .v_data = pool + layer_bytes * j + (size_t)ps * H * row,
                                 .elem_bytes = 2,
                                 .num_pages = B,
                                 .page_size = ps,
                                 .num_heads = H,
                                 .head_dim = D,
                                 .stride_page = 2 * ps * H * D,
                                 .stride_n = H * D,
                                 .stride_h = D,
                                 .batch_size = B,
                                 .kv_indptr = d_ip,
                                 .kv_indices = d_idx,
                                 .kv_last_page_len = d_last};
            ck_assert_int_eq(
                kvp_bench_spin_fill_cuda(src, (size_t)2 * B * H * row, (uint8_t)(j + 1), 20000, S),
                0);
            ck_assert_int_eq(kvp_append_paged_kv_cache_fused_cuda_ex(&kv, &as, d_aip, B, d_err,
                                                                     KVP_CUDA_APPEND_PDL, S),
                             0);
        }
        if (pass == 1) {
            CK(cudaStreamEndCapture(S, &graph));
            CK(cudaGraphInstantiate(&exec, graph, 0));
            CK(cudaGraphLaunch(exec, S));
        }
        CK(cudaStreamSynchronize(S));
        for (int j = 0; j < ROUNDS; j++) {
            CK(cudaMemcpy(host, pool + layer_bytes * j, layer_bytes, cudaMemcpyDeviceToHost));
            size_t want = 0, bad = 0;
            for (size_t i = 0; i < layer_bytes; i++) {
                /* slot 0 of each page (K and V halves) holds the round's byte, the rest 0 */
                size_t in_half = i % ((size_t)ps * H * row);
                uint8_t expect = in_half < (size_t)H * row ? (uint8_t)(j + 1) : 0;
                want += expect != 0;
                bad += host[i] != expect;
            }
            ck_assert_uint_eq(want, (size_t)B * 2 * H * row);
            ck_assert_msg(bad == 0, "pass %d layer %d: %zu bytes wrong", pass, j, bad);
        }
        if (exec) {
            CK(cudaGraphExecDestroy(exec));
            CK(cudaGraphDestroy(graph));
        }
    }
    int32_t herr = -1;
    CK(cudaMemcpy(&herr, d_err, 4, cudaMemcpyDeviceToHost));
    ck_assert_int_eq(herr, 0);
    free(host), free(hip), free(hidx), free(hlast);
    void *fr[] = {pool, src, d_ip, d_idx, d_last, d_aip, d_err};
    for (unsigned i = 0; i < sizeof(fr) / sizeof(fr[0]); i++)
        CK(cudaFree(fr[i]));
}

START_TEST(pdl_append_waits_for_the_producer)
{
    pdl_round_trip(256, 16);
    pdl_round_trip(4096, 1);
    ck_assert_int_eq(kvp_append_paged_kv_cache_fused_cuda_ex(NULL, NULL, NULL, 0, NULL, 2, S),
                     KVP_EINVAL);
}
END_TEST

START_TEST(page_copy_matches_cpu)
{
    for (int lay = 0; lay < 2; lay++)
        for (int sto = 0; sto < 2; sto++) {
            kvp_geom_t g = {.num_layers = 1,
                            .num_pages = 6,
                            .page_size = 5,
                            .num_kv_heads = 3,
                            .head_dim = 64,
                            .dtype = KVP_DTYPE_BF16,
                            .layout = (kvp_layout_t)lay,
                            .storage = (kvp_storage_t)sto,
                            .num_devices = 1};
            kvp_geom_derived_t d;
            ck_assert_int_eq(kvp_geom_derive(&g, &d), 0);
            uint8_t *h = malloc(d.pool_bytes), *back = malloc(d.pool_bytes);
            kvp_rng_t r;
            kvp_rng_seed(&r, 3);
            kvp_rng_fill(&r, h, d.pool_bytes);
            uint8_t *dp = dalloc(d.pool_bytes);
            CK(cudaMemcpy(dp, h, d.pool_bytes, cudaMemcpyHostToDevice));
            kvp_page_copy_t cps[2] = {{1, 4}, {2, 5}};
            kvp_page_copy_t *dc = dalloc(sizeof(cps));
            CK(cudaMemcpy(dc, cps, sizeof(cps), cudaMemcpyHostToDevice));
            kvp_paged_kv_t kv = {.k_data = h,
                                 .v_data = h + d.v_offset_bytes,
                                 .elem_bytes = 2,
                                 .num_pages = 6,
                                 .page_size = 5,
                                 .num_heads = 3,
                                 .head_dim = 64,
                                 .stride_page = d.stride_page,
                                 .stride_n = d.stride_n,
                                 .stride_h = d.stride_h};
            ck_assert_int_eq(kvp_page_copy_cpu(&kv, cps, 2), 0);
            kv.k_data = dp;
            kv.v_data = dp + d.v_offset_bytes;
            int32_t *err = dalloc(4);
            CK(cudaMemset(err, 0, 4));
            ck_assert_int_eq(kvp_page_copy_cuda(&kv, dc, 2, err, S), 0);
            CK(cudaStreamSynchronize(S));
            CK(cudaMemcpy(back, dp, d.pool_bytes, cudaMemcpyDeviceToHost));
            ck_assert_int_eq(memcmp(back, h, d.pool_bytes), 0);
            free(h), free(back);
            CK(cudaFree(dp));
            CK(cudaFree(dc));
            CK(cudaFree(err));
        }
}
END_TEST

/* The host-slots form of kvp_append_cuda (KVP_APPEND_CUDA_HOST_DEST: the daemon's
 * small-Append path): slots in host memory, num_layers layers in one launch. */
static int host_slots(const kvp_paged_kv_t *kv, const kvp_append_src_t *src, const int32_t *slots,
                      uint32_t nnz, uint32_t num_layers, uint64_t layer_stride_bytes,
                      uint64_t src_layer_stride_bytes, cudaStream_t s)
{
    const kvp_append_dest_t d = {.kind = KVP_APPEND_DEST_SLOTS, .nnz = nnz, .slots = slots};
    const kvp_append_cuda_args_t a = {.flags = KVP_APPEND_CUDA_HOST_DEST,
                                      .num_layers = num_layers,
                                      .layer_stride_bytes = layer_stride_bytes,
                                      .src_layer_stride_bytes = src_layer_stride_bytes};
    return kvp_append_cuda(kv, src, &d, &a, s);
}

/* The host-slots form (the daemon's small-Append path) against a reference
 * written from the geometry alone: every layout, storage and row shape (4, 8, 16, 32 and a
 * generic 6 vectors), both inline capacities and their edges, three layers in one launch,
 * strided sources, padding; the rest of the pool (poisoned) must be unchanged. */
static void slots_case(kvp_layout_t lay, kvp_storage_t sto, uint32_t D, uint32_t nnz, kvp_rng_t *r)
{
    const uint32_t L = 3, H = 4, P = 80, ps = 16;
    kvp_geom_t g = {.num_layers = L,
                    .num_pages = P,
                    .page_size = ps,
                    .num_kv_heads = H,
                    .head_dim = D,
                    .dtype = KVP_DTYPE_FP16,
                    .layout = lay,
                    .storage = sto,
                    .num_devices = 1};
    kvp_geom_derived_t d;
    ck_assert_int_eq(kvp_geom_derive(&g, &d), 0);
    const uint64_t row = d.row_bytes, es = d.elem_bytes;
    /* source: [L][nnz][H] rows, each token padded by one row, each layer by 16 bytes */
    const uint64_t tok_stride = (H + 1) * row, layer_src = nnz * tok_stride * 2 + 16;
    const uint64_t src_bytes = L * layer_src;
    uint8_t *hsrc = malloc(src_bytes), *ref = malloc(d.pool_bytes), *back = malloc(d.pool_bytes);
    kvp_rng_fill(r, hsrc, src_bytes);
    kvp_rng_fill(r, ref, d.pool_bytes);
    /* distinct slots from a shuffled [0, P*ps), one in seven padding */
    int32_t *slots = malloc(nnz * sizeof(int32_t)), *all = malloc(P * ps * sizeof(int32_t));
    for (uint32_t i = 0; i < P * ps; i++)
        all[i] = (int32_t)i;
    for (uint32_t i = P * ps - 1; i > 0; i--) {
        uint32_t j = kvp_rng_below(r, i + 1);
        int32_t t = all[i];
        all[i] = all[j], all[j] = t;
    }
    for (uint32_t i = 0; i < nnz; i++)
        slots[i] = kvp_rng_below(r, 7) == 0 ? -1 : all[i];
    uint8_t *dsrc = dalloc(src_bytes), *dp = dalloc(d.pool_bytes);
    CK(cudaMemcpy(dsrc, hsrc, src_bytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dp, ref, d.pool_bytes, cudaMemcpyHostToDevice));
    /* K rows at token offset 0, V rows at nnz * tok_stride */
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t i = 0; i < nnz; i++) {
            if (slots[i] < 0)
                continue;
            uint64_t page = (uint64_t)slots[i] / ps, slot = (uint64_t)slots[i] % ps;
            for (uint32_t h = 0; h < H; h++) {
                uint64_t dst = kvp_geom_layer_offset(&d, l) + page * d.stride_page * es +
                               slot * d.stride_n * es + h * d.stride_h * es;
                const uint8_t *sk = hsrc + l * layer_src + i * tok_stride + h * row;
                memcpy(ref + dst, sk, row);
                memcpy(ref + dst + d.v_offset_bytes, sk + nnz * tok_stride, row);
            }
        }
    kvp_paged_kv_t kv = {.k_data = dp,
                         .v_data = dp + d.v_offset_bytes,
                         .elem_bytes = 2,
                         .num_pages = P,
                         .page_size = ps,
                         .num_heads = H,
                         .head_dim = D,
                         .stride_page = d.stride_page,
                         .stride_n = d.stride_n,
                         .stride_h = d.stride_h};
    kvp_append_src_t src = {.key = dsrc,
                            .value = dsrc + nnz * tok_stride,
                            .k_stride_n = (int64_t)(tok_stride / es),
                            .k_stride_h = (int64_t)(row / es),
                            .v_stride_n = (int64_t)(tok_stride / es),
                            .v_stride_h = (int64_t)(row / es)};
    ck_assert_int_eq(host_slots(&kv, &src, slots, nnz, L, d.layer_bytes, layer_src, S), 0);
    CK(cudaStreamSynchronize(S));
    CK(cudaMemcpy(back, dp, d.pool_bytes, cudaMemcpyDeviceToHost));
    ck_assert_msg(memcmp(back, ref, d.pool_bytes) == 0,
                  "slots append differs: layout %d storage %d D %u nnz %u", (int)lay, (int)sto, D,
                  nnz);
    free(hsrc), free(ref), free(back), free(slots), free(all);
    CK(cudaFree(dsrc));
    CK(cudaFree(dp));
}

START_TEST(slots_append_matches_reference)
{
    static const uint32_t dims[] = {32, 48, 64, 128, 256};
    static const uint32_t counts[] = {1, 37, 256, 257, 1000, KVP_APPEND_SLOTS_MAX};
    kvp_rng_t r;
    kvp_rng_seed(&r, 20261201);
    for (int lay = 0; lay < 2; lay++)
        for (int sto = 0; sto < 2; sto++)
            for (size_t di = 0; di < sizeof(dims) / sizeof(dims[0]); di++)
                for (size_t ci = 0; ci < sizeof(counts) / sizeof(counts[0]); ci++)
                    slots_case((kvp_layout_t)lay, (kvp_storage_t)sto, dims[di], counts[ci], &r);
}
END_TEST

/* Bad arguments are refused before anything is queued: the pool keeps every byte. */
START_TEST(slots_append_refuses_before_writing)
{
    small_t s;
    small_init(&s, NULL, NULL, 0);
    int32_t slots[KVP_APPEND_SLOTS_MAX + 1];
    for (uint32_t i = 0; i <= KVP_APPEND_SLOTS_MAX; i++)
        slots[i] = (int32_t)(i % (s.kv.num_pages * s.kv.page_size));
    const uint32_t cap = s.kv.num_pages * s.kv.page_size;
    int32_t bad[3] = {0, (int32_t)cap, 1};
    ck_assert_int_eq(host_slots(&s.kv, &s.src, bad, 3, 1, 0, 0, S), KVP_ERANGE);
    ck_assert_int_eq(host_slots(&s.kv, &s.src, slots, KVP_APPEND_SLOTS_MAX + 1, 1, 0, 0, S),
                     KVP_EINVAL);
    ck_assert_int_eq(host_slots(&s.kv, &s.src, slots, 2, 2, 0, 0, S), KVP_EINVAL);
    ck_assert_int_eq(host_slots(&s.kv, &s.src, NULL, 2, 1, 0, 0, S), KVP_EINVAL);
    ck_assert_int_eq(host_slots(&s.kv, &s.src, slots, 2, 65536, 16, 0, S), KVP_EINVAL);
    ck_assert_int_eq(host_slots(&s.kv, &s.src, slots, 0, 1, 0, 0, S), 0);
    CK(cudaStreamSynchronize(S));
    ck_assert(pool_untouched(&s));
}
END_TEST

int main(void)
{
    if (!gpu_present()) {
        printf("no usable GPU: skipped\n");
        return 77;
    }
    if (cudaStreamCreateWithFlags(&S, cudaStreamNonBlocking) != cudaSuccess)
        return 1;
    Suite *s = suite_create("append_cuda");
    TCase *tc = tcase_create("append_cuda");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, bad_position_writes_nothing_and_reports);
    tcase_add_test(tc, padding_and_nnz_zero);
    tcase_add_test(tc, checked_refuses_each_bad_entry);
    tcase_add_test(tc, slots_form_guards);
    tcase_add_test(tc, graph_replay_gives_the_same_bytes);
    tcase_add_test(tc, pdl_append_waits_for_the_producer);
    tcase_add_test(tc, page_copy_matches_cpu);
    tcase_add_test(tc, slots_append_matches_reference);
    tcase_add_test(tc, slots_append_refuses_before_writing);
    tcase_add_test(tc, prefill_matches_cpu);
    tcase_add_test(tc, cuda_matches_cpu_over_the_grid);
    tcase_add_test(tc, kernel_shapes_match_cpu);
    tcase_add_test(tc, bad_kernel_options_are_refused);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_set_fork_status(sr, CK_NOFORK); /* one CUDA context for the whole run */
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
