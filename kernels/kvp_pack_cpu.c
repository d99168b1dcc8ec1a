/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pack_cpu.c - the packed transfer form of a sequence's KV on the CPU (kvp_kernels.h):
 * the reference the CUDA pack/unpack kernels are tested against, and the unit-tested
 * statement of the format. Pure C, libc only.
 */
#include <string.h>

#include "kvp_kernels.h"

uint64_t kvp_kv_packed_layer_bytes(uint32_t num_tokens, uint32_t num_heads, uint32_t head_dim,
                                   uint32_t elem_bytes)
{
    return 2ull * num_tokens * num_heads * (uint64_t)head_dim * elem_bytes;
}

/* Checks the layer description and the pages the tokens use. */
static int check(const kvp_paged_kv_t *kv, const int32_t *pages, uint32_t num_tokens,
                 const void *io)
{
    if (!kv || !kv->k_data || !kv->v_data || (!pages && num_tokens) || (!io && num_tokens))
        return KVP_EINVAL;
    if ((kv->elem_bytes != 1 && kv->elem_bytes != 2 && kv->elem_bytes != 4) || !kv->page_size ||
        !kv->num_heads || !kv->head_dim || !kv->num_pages)
        return KVP_EINVAL;
    uint32_t np = (uint32_t)(((uint64_t)num_tokens + kv->page_size - 1) / kv->page_size);
    for (uint32_t i = 0; i < np; i++)
        if (pages[i] < 0 || (uint32_t)pages[i] >= kv->num_pages)
            return KVP_ERANGE;
    return 0;
}

/* Pool address of (kv, token, head) of the layer. */
static uint8_t *row_at(const kvp_paged_kv_t *kv, const int32_t *pages, int which, uint32_t t,
                       uint32_t h)
{
    uint64_t elems = (uint64_t)pages[t / kv->page_size] * (uint64_t)kv->stride_page +
                     (uint64_t)(t % kv->page_size) * (uint64_t)kv->stride_n +
                     (uint64_t)h * (uint64_t)kv->stride_h;
    return (uint8_t *)(which ? kv->v_data : kv->k_data) + elems * kv->elem_bytes;
}

/* Copies every row between the pages and the packed stream buf: into buf, or out of it. */
static int copy_rows(const kvp_paged_kv_t *kv, const int32_t *pages, uint32_t num_tokens,
                     uint8_t *buf, int unpack)
{
    int rc = check(kv, pages, num_tokens, buf);
    if (rc)
        return rc;
    const uint64_t row = (uint64_t)kv->head_dim * kv->elem_bytes;
    for (int which = 0; which < 2; which++)
        for (uint32_t t = 0; t < num_tokens; t++)
            for (uint32_t h = 0; h < kv->num_heads; h++) {
                uint8_t *packed =
                    buf + kvp_kv_packed_offset(num_tokens, kv->num_heads, row, which, t, h);
                uint8_t *paged = row_at(kv, pages, which, t, h);
                if (unpack)
                    memcpy(paged, packed, row);
                else
                    memcpy(packed, paged, row);
            }
    return 0;
}

int kvp_kv_pack_cpu(const kvp_paged_kv_t *kv, const int32_t *pages, uint32_t num_tokens, void *out)
{
    return copy_rows(kv, pages, num_tokens, out, 0);
}

int kvp_kv_unpack_cpu(const kvp_paged_kv_t *kv, const int32_t *pages, uint32_t num_tokens,
                      const void *in)
{
    /* the stream is only read: the cast lets one loop serve both directions */
    return copy_rows(kv, pages, num_tokens, (uint8_t *)(uintptr_t)in, 1);
}

/* Copies the byte range [begin, end) of the layer's packed part between the pages and buf
 * (which holds just the range): whole rows where the range covers them, the ends of the two
 * rows it cuts. */
static int copy_range(const kvp_paged_kv_t *kv, const int32_t *pages, uint32_t num_tokens,
                      uint64_t begin, uint64_t end, uint8_t *buf, int unpack)
{
    int rc = check(kv, pages, num_tokens, buf);
    if (rc)
        return rc;
    const uint64_t row = (uint64_t)kv->head_dim * kv->elem_bytes;
    if (begin > end ||
        end > kvp_kv_packed_layer_bytes(num_tokens, kv->num_heads, kv->head_dim, kv->elem_bytes))
        return KVP_EINVAL;
    const uint64_t rows_per_kv = (uint64_t)num_tokens * kv->num_heads;
    for (uint64_t off = begin; off < end;) {
        const uint64_t r = off / row, in_row = off % row;
        const uint64_t piece = end - off < row - in_row ? end - off : row - in_row;
        const int which = r >= rows_per_kv;
        const uint64_t rr = r - (which ? rows_per_kv : 0);
        uint8_t *paged = row_at(kv, pages, which, (uint32_t)(rr / kv->num_heads),
                                (uint32_t)(rr % kv->num_heads)) +
                         in_row;
        uint8_t *packed = buf + (off - begin);
        if (unpack)
            memcpy(paged, packed, piece);
        else
            memcpy(packed, paged, piece);
        off += piece;
    }
    return 0;
}

int kvp_kv_pack_range_cpu(const kvp_paged_kv_t *kv, const int32_t *pages, uint32_t num_tokens,
                          uint64_t begin, uint64_t end, void *out)
{
    return copy_range(kv, pages, num_tokens, begin, end, out, 0);
}

int kvp_kv_unpack_range_cpu(const kvp_paged_kv_t *kv, const int32_t *pages, uint32_t num_tokens,
                            uint64_t begin, uint64_t end, const void *in)
{
    return copy_range(kv, pages, num_tokens, begin, end, (uint8_t *)(uintptr_t)in, 1);
}
