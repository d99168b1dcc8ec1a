/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fuzz_kernel.c - libFuzzer target for the argument checks of the CPU kernel API
 * (kernels/kvp_kernels.h). The input chooses a small layer geometry (element size, pages,
 * page size, heads, head dim, NHD or HND, page padding) and the pool buffers are allocated to
 * exactly what those strides describe: pointers and strides are the caller's contract, so they
 * stay truthful. Everything the API must validate comes from the input as is: the CSR page
 * table (indptr, indices, last page lengths), batch indices, positions, counts, append indptr,
 * seq lens and page copies. Properties: no out-of-bounds access (ASan) and no undefined
 * behaviour (UBSan); a call that returns an error leaves the pool (and the outputs it promises
 * not to touch) unchanged.
 *
 * Bit 6 of the first byte makes one stride hostile (issue #15): a source or pool stride whose
 * byte step (stride * elem_bytes) does not fit in ptrdiff_t, read from the input. No buffer can
 * be that large, so every call given it must refuse it whatever its counts are (one token, one
 * head, one page): the harness aborts when one returns 0.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_kernels.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct {
    const uint8_t *p;
    size_t n;
} rd_t;

static uint8_t u8(rd_t *r)
{
    if (!r->n)
        return 0;
    r->n--;
    return *r->p++;
}

static int32_t i32(rd_t *r)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)u8(r) << (8 * i);
    return (int32_t)v;
}

/* A page-table value: mostly small (so that a table that passes the checks fits the arrays
 * below), sometimes an extreme one. */
static int32_t small_or_extreme(rd_t *r)
{
    uint8_t m = u8(r);
    switch (m & 7) {
    case 0:
        return INT32_MAX;
    case 1:
        return INT32_MIN;
    case 2:
        return -1;
    default:
        return (int8_t)u8(r);
    }
}

#define MAX_B      16
#define MAX_IDX    128 /* every bounded indptr value is <= 127 */
#define MAX_NNZ    64
#define MAX_COPIES 16

static void check_same(const void *a, const void *b, size_t n, const char *what)
{
    if (memcmp(a, b, n) != 0) {
        fprintf(stderr, "fuzz_kernel: %s changed by a call that failed\n", what);
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    rd_t r = {data, size};
    static const uint32_t ebs[4] = {1, 2, 4, 4};
    uint8_t g0 = u8(&r), g1 = u8(&r), g2 = u8(&r);
    uint32_t eb = ebs[g0 & 3];
    uint32_t num_pages = 1 + ((g0 >> 2) & 15); /* 1..16 */
    uint32_t page_size = 1 + (g1 & 7);         /* 1..8 */
    uint32_t heads = 1 + ((g1 >> 3) & 3);      /* 1..4 */
    uint32_t head_dim = 1 + (g2 & 15);         /* 1..16 */
    int hnd = (g2 >> 4) & 1;
    uint32_t pad = (g2 >> 5) & 7; /* extra elements per page */
    uint64_t page_elems = (uint64_t)page_size * heads * head_dim;
    uint64_t stride_page = page_elems + pad;
    size_t pool_bytes = (size_t)(num_pages * stride_page * eb);

    uint8_t *k = malloc(pool_bytes), *v = malloc(pool_bytes);
    uint8_t *k0 = malloc(pool_bytes), *v0 = malloc(pool_bytes);
    for (size_t i = 0; i < pool_bytes; i++) {
        k[i] = (uint8_t)(i * 7 + 1);
        v[i] = (uint8_t)(i * 13 + 5);
    }
    memcpy(k0, k, pool_bytes);
    memcpy(v0, v, pool_bytes);

    uint8_t flags = u8(&r);
    uint32_t batch_size = u8(&r) % (MAX_B + 1); /* 0..16 */
    int32_t indptr[MAX_B + 1], last[MAX_B], indices[MAX_IDX];
    for (uint32_t b = 0; b <= batch_size; b++)
        indptr[b] = small_or_extreme(&r);
    /* the last entry bounds what a valid table reads from indices */
    if (indptr[batch_size] > MAX_IDX - 1 || indptr[batch_size] < 0)
        indptr[batch_size] = (int8_t)(indptr[batch_size] & 0x7f);
    if (flags & 1)
        indptr[0] = 0;
    for (uint32_t b = 0; b < batch_size; b++)
        last[b] = (flags & 2) ? i32(&r) : (int32_t)(u8(&r) % (page_size + 2));
    for (uint32_t i = 0; i < MAX_IDX; i++)
        indices[i] = (flags & 4) ? (int32_t)(u8(&r) % (num_pages + 1)) : i32(&r);

    kvp_paged_kv_t kv = {
        .k_data = (flags & 0x80) && (flags & 0x40) ? NULL : k,
        .v_data = v,
        .elem_bytes = (flags & 0x40) && !(flags & 0x80) ? (uint32_t)(u8(&r) % 6) : eb,
        .num_pages = num_pages,
        .page_size = page_size,
        .num_heads = heads,
        .head_dim = head_dim,
        .stride_page = (int64_t)stride_page,
        .stride_n = hnd ? (int64_t)head_dim : (int64_t)heads * head_dim,
        .stride_h = hnd ? (int64_t)page_size * head_dim : (int64_t)head_dim,
        .batch_size = batch_size,
        .kv_indptr = indptr,
        .kv_indices = indices,
        .kv_last_page_len = last,
    };
    /* a mismatched elem_bytes must not let the kernel past the buffers: keep it <= eb */
    if (kv.elem_bytes > eb)
        kv.elem_bytes = eb;
    /* a hostile stride: > PTRDIFF_MAX / elem_bytes elements (0..3 source, 4..6 pool); with
     * one-byte elements every int64 stride has a byte step that fits, so none is hostile */
    int hostile = ((g0 >> 6) & 1) && kv.elem_bytes >= 2;
    uint32_t hostile_which = 0;
    int64_t hostile_stride = 0;
    if (hostile) {
        hostile_which = u8(&r) % 7;
        uint64_t lo = (uint64_t)PTRDIFF_MAX / kv.elem_bytes + 1;
        uint64_t span = (uint64_t)INT64_MAX - lo + 1, x = 0;
        for (int i = 0; i < 8; i++)
            x |= (uint64_t)u8(&r) << (8 * i);
        hostile_stride = (int64_t)(lo + x % span);
        if (hostile_which == 4)
            kv.stride_page = hostile_stride;
        else if (hostile_which == 5)
            kv.stride_n = hostile_stride;
        else if (hostile_which == 6)
            kv.stride_h = hostile_stride;
    }
    const int hostile_pool = hostile && hostile_which >= 4;

    int verbose = getenv("KVP_FUZZ_VERBOSE") != NULL; /* to check what a seed reaches */
    int rc = kvp_paged_kv_check(&kv);
    if (verbose)
        fprintf(stderr, "check %d\n", rc);
    if (hostile_pool && rc == 0) {
        fprintf(stderr, "fuzz_kernel: hostile pool stride %lld accepted by the check\n",
                (long long)hostile_stride);
        abort();
    }

    /* seq lens */
    int32_t seq_lens[MAX_B + 1];
    memset(seq_lens, 0x5a, sizeof(seq_lens));
    rc = kvp_get_seq_lens_cpu(indptr, last, batch_size, page_size, seq_lens);
    if (verbose)
        fprintf(stderr, "seq_lens %d\n", rc);

    /* append: sources [nnz, H, D] dense */
    uint32_t nnz = u8(&r) % (MAX_NNZ + 1);
    size_t src_bytes = (size_t)nnz * heads * head_dim * eb + 1;
    uint8_t *ks = malloc(src_bytes), *vs = malloc(src_bytes);
    memset(ks, 0x11, src_bytes);
    memset(vs, 0x22, src_bytes);
    int32_t bi[MAX_NNZ + 1], pos[MAX_NNZ + 1];
    for (uint32_t i = 0; i < nnz; i++) {
        bi[i] = (flags & 8) ? i32(&r) : (int32_t)(u8(&r) % (batch_size + 2)) - 1;
        pos[i] = (flags & 16) ? i32(&r) : (int32_t)u8(&r) % 64;
    }
    kvp_append_src_t src = {.key = ks,
                            .value = vs,
                            .k_stride_n = (int64_t)heads * head_dim,
                            .k_stride_h = head_dim,
                            .v_stride_n = (int64_t)heads * head_dim,
                            .v_stride_h = head_dim};
    if (hostile && hostile_which < 4)
        *(hostile_which == 0   ? &src.k_stride_n
          : hostile_which == 1 ? &src.k_stride_h
          : hostile_which == 2 ? &src.v_stride_n
                               : &src.v_stride_h) = hostile_stride;
    rc = kvp_append_paged_kv_cache_cpu(&kv, &src, bi, pos, nnz);
    if (verbose)
        fprintf(stderr, "append nnz=%u %d\n", nnz, rc);
    if (hostile && nnz && rc == 0) {
        fprintf(stderr, "fuzz_kernel: append accepted hostile stride %lld (which %u)\n",
                (long long)hostile_stride, hostile_which);
        abort();
    }
    if (rc != 0) {
        check_same(k, k0, pool_bytes, "K pool (append)");
        check_same(v, v0, pool_bytes, "V pool (append)");
    } else {
        memcpy(k0, k, pool_bytes);
        memcpy(v0, v, pool_bytes);
    }

    /* batch indices / positions: outputs of exactly the capacity passed */
    uint32_t cap = u8(&r) % (MAX_NNZ + 1);
    int32_t aindptr[MAX_B + 1], slens[MAX_B];
    for (uint32_t b = 0; b <= batch_size; b++)
        aindptr[b] = (flags & 32) ? i32(&r) : (int32_t)(u8(&r) % (MAX_NNZ + 1));
    for (uint32_t b = 0; b < batch_size; b++)
        slens[b] = (flags & 32) ? i32(&r) : (int32_t)u8(&r);
    int32_t *obi = malloc(cap * sizeof(int32_t) + 1), *opos = malloc(cap * sizeof(int32_t) + 1);
    memset(obi, 0x33, cap * sizeof(int32_t));
    memset(opos, 0x44, cap * sizeof(int32_t));
    rc = kvp_get_batch_indices_positions_cpu(aindptr, slens, batch_size, cap, obi, opos);
    if (verbose)
        fprintf(stderr, "batch_indices_positions %d\n", rc);
    if (rc != 0) {
        for (uint32_t i = 0; i < cap; i++)
            if (obi[i] != 0x33333333 || opos[i] != 0x44444444) {
                fprintf(stderr, "fuzz_kernel: outputs written by a failed "
                                "get_batch_indices_positions\n");
                abort();
            }
    }

    /* page copies */
    kvp_page_copy_t copies[MAX_COPIES];
    uint32_t ncopies = u8(&r) % (MAX_COPIES + 1);
    for (uint32_t c = 0; c < ncopies; c++) {
        copies[c].src = (flags & 4) ? u8(&r) % (num_pages + 1) : (uint32_t)i32(&r);
        copies[c].dst = (flags & 4) ? u8(&r) % (num_pages + 1) : (uint32_t)i32(&r);
    }
    rc = kvp_page_copy_cpu(&kv, copies, ncopies);
    if (verbose)
        fprintf(stderr, "page_copy n=%u %d\n", ncopies, rc);
    if (hostile_pool && ncopies && rc == 0) {
        fprintf(stderr, "fuzz_kernel: page copy accepted hostile pool stride %lld\n",
                (long long)hostile_stride);
        abort();
    }
    if (rc != 0) {
        check_same(k, k0, pool_bytes, "K pool (page copy)");
        check_same(v, v0, pool_bytes, "V pool (page copy)");
    }

    free(obi);
    free(opos);
    free(ks);
    free(vs);
    free(k);
    free(v);
    free(k0);
    free(v0);
    return 0;
}
