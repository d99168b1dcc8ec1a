/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_append_cpu.c - the CPU form of every operation in kvp_kernels.h: FlashInfer's
 * append_paged_kv_cache (with any kvp_append_dest_t), its inverse the gather (pool slots out to
 * rows, a Load's copy: it shares the append's checks of the pool and of the rows' tensor),
 * get_seq_lens and get_batch_indices_positions, and whole-page copies. Each entry point validates
 * all of its arguments first and only then writes, so a rejected call leaves the cache and the
 * outputs exactly as they were. It is a plain copy on host memory that runs on the calling thread
 * (tokens are independent, so a caller may split a batch across threads); it is not the geometry:
 * it never derives a stride, pointers and strides come from the caller.
 */
#include "kvp_kernels.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "kvp_error.h"

/* Sequence length of request b: (pages - 1) * page_size + last_page_len, or 0 for a request
 * with no pages. The table must have been checked (the result then fits in int64). */
static int64_t seq_len_of(const kvp_paged_kv_t *kv, uint32_t b)
{
    int64_t num_pages = (int64_t)kv->kv_indptr[b + 1] - kv->kv_indptr[b];
    if (num_pages == 0)
        return 0;
    return (num_pages - 1) * (int64_t)kv->page_size + kv->kv_last_page_len[b];
}

/* *out = the byte extent of an [n0, n1, n2] tensor whose last dimension of n2 elements is
 * contiguous and whose other strides are s0 and s1 (elements): the offset one past its last
 * byte. Computed in unsigned 64-bit with overflow checks. False when a stride is negative, when a
 * stride's byte step does not fit in ptrdiff_t whatever its count (the copy turns every stride
 * into a byte step once, so a stride of 2^63 - 1 elements for one token is refused too), or when
 * the extent does. All n > 0. */
static bool extent_ok(uint64_t n0, int64_t s0, uint64_t n1, int64_t s1, uint64_t n2,
                      uint32_t elem_bytes, int64_t *out)
{
    uint64_t step0, step1, a, b, row, e;
    if (s0 < 0 || s1 < 0 || !n0 || !n1 || !n2)
        return false;
    if (__builtin_mul_overflow((uint64_t)s0, elem_bytes, &step0) ||
        __builtin_mul_overflow((uint64_t)s1, elem_bytes, &step1) || step0 > PTRDIFF_MAX ||
        step1 > PTRDIFF_MAX || __builtin_mul_overflow(n0 - 1, step0, &a) ||
        __builtin_mul_overflow(n1 - 1, step1, &b) || __builtin_add_overflow(a, b, &e) ||
        __builtin_mul_overflow(n2, elem_bytes, &row) || __builtin_add_overflow(e, row, &e) ||
        e > PTRDIFF_MAX)
        return false;
    *out = (int64_t)e;
    return true;
}

/* True when [p, p + extent) is an address range: it does not wrap around the address space
 * (a pointer plus a byte offset that wraps is undefined behaviour before any load). */
static bool span_ok(const void *p, int64_t extent)
{
    return (uintptr_t)p <= UINTPTR_MAX - (uint64_t)extent;
}

/* The part of a paged-KV description that page copies use too: data pointers, sizes, element
 * size and strides. Strides must be non-negative and the extent of the whole layer, page by
 * page, must fit in int64 bytes so that no address computation below can overflow. */
static int check_pool_shape(const kvp_paged_kv_t *kv)
{
    int64_t page_extent, pool_extent;
    if (!kv || !kv->k_data || !kv->v_data)
        return KVP_EINVAL;
    if (kv->elem_bytes != 1 && kv->elem_bytes != 2 && kv->elem_bytes != 4)
        return KVP_EINVAL;
    if (!kv->num_pages || !kv->page_size || !kv->num_heads || !kv->head_dim)
        return KVP_EINVAL;
    if (!extent_ok(kv->page_size, kv->stride_n, kv->num_heads, kv->stride_h, kv->head_dim,
                   kv->elem_bytes, &page_extent) ||
        !extent_ok(kv->num_pages, kv->stride_page, 1, 0, (uint64_t)page_extent / kv->elem_bytes,
                   kv->elem_bytes, &pool_extent) ||
        !span_ok(kv->k_data, pool_extent) || !span_ok(kv->v_data, pool_extent))
        return KVP_EINVAL;
    return 0;
}

/* Contract in kvp_kernels.h. Also: batch_size 0 is a valid (empty) batch; an empty request's
 * last_page_len may be 0..page_size; strides must be >= 0 and the layer's extent must fit in
 * int64 bytes (KVP_EINVAL otherwise). All EINVAL checks of the table run before any ERANGE one. */
int kvp_paged_kv_check(const kvp_paged_kv_t *kv)
{
    int rc = check_pool_shape(kv);
    if (rc)
        return rc;
    if (!kv->kv_indptr || !kv->kv_indices || !kv->kv_last_page_len)
        return KVP_EINVAL;
    /* the CSR structure first, so a malformed table is EINVAL whatever its values */
    if (kv->kv_indptr[0] != 0)
        return KVP_EINVAL;
    for (uint32_t b = 0; b < kv->batch_size; b++)
        if (kv->kv_indptr[b + 1] < kv->kv_indptr[b])
            return KVP_EINVAL;
    int32_t num_indices = kv->kv_indptr[kv->batch_size];
    for (int32_t j = 0; j < num_indices; j++)
        if (kv->kv_indices[j] < 0 || (uint32_t)kv->kv_indices[j] >= kv->num_pages)
            return KVP_ERANGE;
    for (uint32_t b = 0; b < kv->batch_size; b++) {
        int32_t last = kv->kv_last_page_len[b];
        int32_t lo = kv->kv_indptr[b + 1] > kv->kv_indptr[b] ? 1 : 0;
        if (last < lo || (uint32_t)last > kv->page_size)
            return KVP_ERANGE;
    }
    return 0;
}

/* Copies n rows of row_bytes each: row r from src + r*src_step to dst + r*dst_step (bytes).
 * When both sides are dense this is one memcpy (NHD pool and a contiguous source). */
static void copy_rows(unsigned char *dst, int64_t dst_step, const unsigned char *src,
                      int64_t src_step, uint32_t n, size_t row_bytes)
{
    if ((uint64_t)dst_step == row_bytes && (uint64_t)src_step == row_bytes) {
        memcpy(dst, src, (size_t)n * row_bytes);
        return;
    }
    for (uint32_t r = 0; r < n; r++)
        memcpy(dst + (int64_t)r * dst_step, src + (int64_t)r * src_step, row_bytes);
}

/* The checks of every form's destination (kvp_kernels.h, kvp_append_cpu): 0, KVP_EINVAL or
 * KVP_ERANGE; the table or pool shape is already checked. */
static int check_dest(const kvp_paged_kv_t *kv, const kvp_append_dest_t *d)
{
    const uint32_t nnz = d->nnz;
    if (d->kind == KVP_APPEND_DEST_TOKENS) {
        for (uint32_t i = 0; i < nnz; i++) {
            int32_t b = d->batch_indices[i];
            if (b < 0)
                continue; /* padding */
            if ((uint32_t)b >= kv->batch_size)
                return KVP_ERANGE;
            if (d->positions[i] < 0 || d->positions[i] >= seq_len_of(kv, (uint32_t)b))
                return KVP_ERANGE;
        }
    } else if (d->kind == KVP_APPEND_DEST_FUSED) {
        const int32_t *aip = d->append_indptr;
        if (aip[0] != 0 || (int64_t)aip[kv->batch_size] != (int64_t)nnz)
            return KVP_EINVAL;
        for (uint32_t b = 0; b < kv->batch_size; b++)
            if (aip[b + 1] < aip[b])
                return KVP_EINVAL;
        for (uint32_t b = 0; b < kv->batch_size; b++)
            if (aip[b + 1] - aip[b] > seq_len_of(kv, b))
                return KVP_ERANGE;
    } else {
        const int64_t cap = (int64_t)kv->num_pages * kv->page_size;
        for (uint32_t i = 0; i < nnz; i++)
            if (d->slots[i] >= cap)
                return KVP_ERANGE;
    }
    return 0;
}

/* Contract in kvp_kernels.h. Source strides must be >= 0, each stride's byte step and the
 * source's byte extent must fit in ptrdiff_t and not wrap the address space (KVP_EINVAL
 * otherwise, whatever nnz and num_heads are), and the source must not overlap the pool. Two
 * tokens naming the same slot: the later one wins. Callers must not run appends that write the
 * same pages concurrently. */
int kvp_append_cpu(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                   const kvp_append_dest_t *dest)
{
    if (!dest || dest->kind > KVP_APPEND_DEST_SLOTS)
        return KVP_EINVAL;
    const uint32_t nnz = dest->nnz;
    if (nnz == 0)
        return 0;
    const bool slots = dest->kind == KVP_APPEND_DEST_SLOTS;
    if (!kv || !src ||
        (dest->kind == KVP_APPEND_DEST_TOKENS && (!dest->batch_indices || !dest->positions)) ||
        (dest->kind == KVP_APPEND_DEST_FUSED && !dest->append_indptr) || (slots && !dest->slots))
        return KVP_EINVAL;
    int rc = slots ? check_pool_shape(kv) : kvp_paged_kv_check(kv);
    if (rc)
        return rc;
    int64_t k_extent, v_extent;
    if (!src->key || !src->value ||
        !extent_ok(nnz, src->k_stride_n, kv->num_heads, src->k_stride_h, kv->head_dim,
                   kv->elem_bytes, &k_extent) ||
        !extent_ok(nnz, src->v_stride_n, kv->num_heads, src->v_stride_h, kv->head_dim,
                   kv->elem_bytes, &v_extent) ||
        !span_ok(src->key, k_extent) || !span_ok(src->value, v_extent))
        return KVP_EINVAL;
    if ((rc = check_dest(kv, dest)))
        return rc;

    /* Everything is valid; from here on nothing fails. Strides become byte steps once. */
    const int64_t eb = kv->elem_bytes;
    const size_t row_bytes = (size_t)kv->head_dim * (size_t)eb;
    const int64_t page_step = kv->stride_page * eb, slot_step = kv->stride_n * eb;
    const int64_t head_step = kv->stride_h * eb;
    const int64_t k_tok_step = src->k_stride_n * eb, k_head_step = src->k_stride_h * eb;
    const int64_t v_tok_step = src->v_stride_n * eb, v_head_step = src->v_stride_h * eb;
    unsigned char *k_pool = kv->k_data, *v_pool = kv->v_data;
    const unsigned char *k_src = src->key, *v_src = src->value;
    const uint32_t page_size = kv->page_size, num_heads = kv->num_heads;

    uint32_t b = 0; /* FUSED: the request of token i */
    for (uint32_t i = 0; i < nnz; i++) {
        int32_t page;
        uint32_t pos;
        if (dest->kind == KVP_APPEND_DEST_TOKENS) {
            int32_t bi = dest->batch_indices[i];
            if (bi < 0)
                continue;
            pos = (uint32_t)dest->positions[i];
            page = kv->kv_indices[kv->kv_indptr[bi] + (int32_t)(pos / page_size)];
        } else if (dest->kind == KVP_APPEND_DEST_FUSED) {
            const int32_t *aip = dest->append_indptr;
            while ((int64_t)i >= aip[b + 1])
                b++; /* aip[batch_size] == nnz > i: it stops */
            pos = (uint32_t)(seq_len_of(kv, b) - (aip[b + 1] - aip[b]) + ((int32_t)i - aip[b]));
            page = kv->kv_indices[kv->kv_indptr[b] + (int32_t)(pos / page_size)];
        } else {
            int32_t slot = dest->slots[i];
            if (slot < 0)
                continue;
            page = (int32_t)((uint32_t)slot / page_size);
            pos = (uint32_t)slot; /* only pos % page_size is used below */
        }
        int64_t dst = (int64_t)page * page_step + (int64_t)(pos % page_size) * slot_step;
        copy_rows(k_pool + dst, head_step, k_src + (int64_t)i * k_tok_step, k_head_step, num_heads,
                  row_bytes);
        copy_rows(v_pool + dst, head_step, v_src + (int64_t)i * v_tok_step, v_head_step, num_heads,
                  row_bytes);
    }
    return 0;
}

/* Contract in kvp_kernels.h. The checks are the append's: the pool's shape as its slots form
 * checks it, dst as it checks a source; the copy is the slots form's with the two sides
 * swapped. */
int kvp_gather_cpu(const kvp_paged_kv_t *kv, const int32_t *slots, uint32_t nnz,
                   const kvp_gather_dst_t *dst)
{
    if (nnz == 0)
        return 0;
    if (!kv || !slots || !dst)
        return KVP_EINVAL;
    int rc = check_pool_shape(kv);
    if (rc)
        return rc;
    int64_t k_extent, v_extent;
    if (!dst->key || !dst->value ||
        !extent_ok(nnz, dst->k_stride_n, kv->num_heads, dst->k_stride_h, kv->head_dim,
                   kv->elem_bytes, &k_extent) ||
        !extent_ok(nnz, dst->v_stride_n, kv->num_heads, dst->v_stride_h, kv->head_dim,
                   kv->elem_bytes, &v_extent) ||
        !span_ok(dst->key, k_extent) || !span_ok(dst->value, v_extent))
        return KVP_EINVAL;
    const int64_t cap = (int64_t)kv->num_pages * kv->page_size;
    for (uint32_t i = 0; i < nnz; i++)
        if (slots[i] >= cap)
            return KVP_ERANGE;

    /* Everything is valid; from here on nothing fails. */
    const int64_t eb = kv->elem_bytes;
    const size_t row_bytes = (size_t)kv->head_dim * (size_t)eb;
    const int64_t page_step = kv->stride_page * eb, slot_step = kv->stride_n * eb;
    const int64_t head_step = kv->stride_h * eb;
    const int64_t k_tok_step = dst->k_stride_n * eb, k_head_step = dst->k_stride_h * eb;
    const int64_t v_tok_step = dst->v_stride_n * eb, v_head_step = dst->v_stride_h * eb;
    const unsigned char *k_pool = kv->k_data, *v_pool = kv->v_data;
    unsigned char *k_dst = dst->key, *v_dst = dst->value;
    for (uint32_t i = 0; i < nnz; i++) {
        const int32_t slot = slots[i];
        if (slot < 0)
            continue; /* padding */
        const uint32_t page = (uint32_t)slot / kv->page_size, pos = (uint32_t)slot % kv->page_size;
        const int64_t from = (int64_t)page * page_step + (int64_t)pos * slot_step;
        copy_rows(k_dst + (int64_t)i * k_tok_step, k_head_step, k_pool + from, head_step,
                  kv->num_heads, row_bytes);
        copy_rows(v_dst + (int64_t)i * v_tok_step, v_head_step, v_pool + from, head_step,
                  kv->num_heads, row_bytes);
    }
    return 0;
}

/* Contract in kvp_kernels.h: kvp_append_cpu's TOKENS form. */
int kvp_append_paged_kv_cache_cpu(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                  const int32_t *batch_indices, const int32_t *positions,
                                  uint32_t nnz)
{
    const kvp_append_dest_t d = {.kind = KVP_APPEND_DEST_TOKENS,
                                 .nnz = nnz,
                                 .batch_indices = batch_indices,
                                 .positions = positions};
    return kvp_append_cpu(kv, src, &d);
}

/* Contract in kvp_kernels.h. Also KVP_EINVAL: last_page_len outside 1..page_size on a
 * non-empty request, or a length that does not fit int32. The output is written only on success;
 * kv_indptr[0] is not required to be 0 (only differences are used). */
int kvp_get_seq_lens_cpu(const int32_t *kv_indptr, const int32_t *kv_last_page_len,
                         uint32_t batch_size, uint32_t page_size, int32_t *seq_lens)
{
    if (!kv_indptr || !kv_last_page_len || !seq_lens || !page_size)
        return KVP_EINVAL;
    /* validate every request first: the output is untouched on error */
    for (uint32_t b = 0; b < batch_size; b++) {
        int64_t num_pages = (int64_t)kv_indptr[b + 1] - kv_indptr[b];
        if (num_pages < 0)
            return KVP_EINVAL;
        if (num_pages == 0)
            continue;
        int32_t last = kv_last_page_len[b];
        if (last < 1 || (uint32_t)last > page_size ||
            (num_pages - 1) * (int64_t)page_size + last > INT32_MAX)
            return KVP_EINVAL;
    }
    for (uint32_t b = 0; b < batch_size; b++) {
        int64_t num_pages = (int64_t)kv_indptr[b + 1] - kv_indptr[b];
        seq_lens[b] =
            num_pages ? (int32_t)((num_pages - 1) * (int64_t)page_size + kv_last_page_len[b]) : 0;
    }
    return 0;
}

/* Contract in kvp_kernels.h. Also KVP_EINVAL: append_indptr[0] != 0, a negative seq_len, NULL
 * outputs with nnz > 0 (NULL outputs are fine when nnz is 0). */
int kvp_get_batch_indices_positions_cpu(const int32_t *append_indptr, const int32_t *seq_lens,
                                        uint32_t batch_size, uint32_t nnz, int32_t *batch_indices,
                                        int32_t *positions)
{
    if (!append_indptr || !seq_lens || (nnz && (!batch_indices || !positions)))
        return KVP_EINVAL;
    if (append_indptr[0] != 0 || (int64_t)append_indptr[batch_size] != (int64_t)nnz)
        return KVP_EINVAL;
    for (uint32_t b = 0; b < batch_size; b++) {
        int64_t append_len = (int64_t)append_indptr[b + 1] - append_indptr[b];
        if (append_len < 0 || seq_lens[b] < append_len)
            return KVP_EINVAL;
    }
    for (uint32_t b = 0; b < batch_size; b++) {
        int32_t first = append_indptr[b], append_len = append_indptr[b + 1] - first;
        int32_t pos0 = seq_lens[b] - append_len;
        for (int32_t j = 0; j < append_len; j++) {
            batch_indices[first + j] = (int32_t)b;
            positions[first + j] = pos0 + j;
        }
    }
    return 0;
}

/* Contract in kvp_kernels.h: KVP_ERANGE for a page id >= num_pages, KVP_EINVAL for src == dst,
 * a NULL list with num_copies > 0, or a bad shape (as kvp_paged_kv_check, page table ignored).
 * Copies run in list order; that a destination is never also a source is the caller's promise
 * and is not checked (it would take O(num_pages) memory or a sort). */
int kvp_page_copy_cpu(const kvp_paged_kv_t *kv, const kvp_page_copy_t *copies, uint32_t num_copies)
{
    int rc = check_pool_shape(kv);
    if (rc)
        return rc;
    if (num_copies && !copies)
        return KVP_EINVAL;
    for (uint32_t c = 0; c < num_copies; c++) {
        if (copies[c].src >= kv->num_pages || copies[c].dst >= kv->num_pages)
            return KVP_ERANGE;
        if (copies[c].src == copies[c].dst)
            return KVP_EINVAL;
    }

    const int64_t eb = kv->elem_bytes;
    const size_t row_bytes = (size_t)kv->head_dim * (size_t)eb;
    const int64_t page_step = kv->stride_page * eb, slot_step = kv->stride_n * eb;
    const int64_t head_step = kv->stride_h * eb;
    const uint64_t page_elems = (uint64_t)kv->page_size * kv->num_heads * kv->head_dim;
    /* A page's K block is dense when its rows tile it exactly, in NHD ([slot, head]) or HND
     * ([head, slot]) order; then one memcpy moves it. Pages must not overlap for that. */
    const bool nhd_dense = kv->stride_h == (int64_t)kv->head_dim &&
                           kv->stride_n == (int64_t)kv->num_heads * kv->head_dim;
    const bool hnd_dense = kv->stride_n == (int64_t)kv->head_dim &&
                           kv->stride_h == (int64_t)kv->page_size * kv->head_dim;
    const bool dense = (nhd_dense || hnd_dense) && (uint64_t)kv->stride_page >= page_elems;

    for (int kv_half = 0; kv_half < 2; kv_half++) {
        unsigned char *base = kv_half ? kv->v_data : kv->k_data;
        for (uint32_t c = 0; c < num_copies; c++) {
            unsigned char *dst = base + (int64_t)copies[c].dst * page_step;
            const unsigned char *from = base + (int64_t)copies[c].src * page_step;
            if (dense) {
                memcpy(dst, from, page_elems * (uint64_t)eb);
                continue;
            }
            /* any other strides: row by row; memmove because odd strides may interleave */
            for (uint32_t s = 0; s < kv->page_size; s++)
                for (uint32_t h = 0; h < kv->num_heads; h++) {
                    int64_t off = (int64_t)s * slot_step + (int64_t)h * head_step;
                    memmove(dst + off, from + off, row_bytes);
                }
        }
    }
    return 0;
}
