/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_kernels.h - the append operation of FlashInfer's `append_paged_kv_cache` and its helpers,
 * as a C API. Public: model workers link it (through libkvpool) to run the append in their own
 * process on the mapped pool, and the daemon's backends run it on their own.
 *
 * Every operation exists in a CPU form (suffix _cpu, host pointers, runs on the calling thread)
 * and, where CUDA is built, a CUDA form (suffix _cuda, device pointers, an explicit stream,
 * declared in kvp_kernels_cuda.h). Both take the same argument structs and have the same
 * meaning, which is exactly FlashInfer's (DESIGN.md §1):
 *
 *   token i (0 <= i < nnz) with b = batch_indices[i], pos = positions[i] and head h is copied to
 *   page kv_indices[kv_indptr[b] + pos / page_size], slot pos % page_size, head h, for K and V.
 *
 * Guards FlashInfer does not have: nnz = 0 is a no-op; a token with batch_indices[i] < 0 is a
 * padding entry and is skipped; every other argument (batch index, position against the
 * request's sequence length, page ids against num_pages, the CSR page table itself) is
 * checked before a single byte is written, and a bad one is KVP_ERANGE / KVP_EINVAL with the
 * cache untouched.
 *
 * Strides are in ELEMENTS, as FlashInfer's paged_kv_t and torch strides are. The pool's strides
 * come from the geometry (kvcache/kvp_geom.h: kvp_geom_derive) through PoolInfo; this layer
 * never derives a stride itself. It depends on libc only.
 */
#ifndef KVP_KERNELS_H
#define KVP_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "kvp_error.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One layer of a paged KV cache and the batch's page table, FlashInfer's paged_kv_t.
 * Combined storage: k_data points at [:, 0] of the layer tensor and v_data at [:, 1]
 * (k_data + page_size*H*D elements); split storage: the two tensors. All borrowed. */
typedef struct {
    void *k_data;
    void *v_data;
    uint32_t elem_bytes; /* 1, 2 or 4 */
    uint32_t num_pages;  /* page ids in kv_indices must be < num_pages */
    uint32_t page_size;
    uint32_t num_heads;
    uint32_t head_dim;
    int64_t stride_page; /* elements */
    int64_t stride_n;    /* elements between slots */
    int64_t stride_h;    /* elements between heads */
    /* page table (CSR, int32), batch_size requests */
    uint32_t batch_size;
    const int32_t *kv_indptr;        /* [batch_size + 1], kv_indptr[0] == 0, non-decreasing */
    const int32_t *kv_indices;       /* [kv_indptr[batch_size]] */
    const int32_t *kv_last_page_len; /* [batch_size], 1..page_size for a non-empty request */
} kvp_paged_kv_t;

/* The appended keys and values: [nnz, num_heads, head_dim] with any row and head stride
 * (elements); the last dimension is contiguous. Borrowed. */
typedef struct {
    const void *key;
    const void *value;
    int64_t k_stride_n, k_stride_h;
    int64_t v_stride_n, v_stride_h;
} kvp_append_src_t;

/* A page copy inside one layer: K and V of page src are copied to page dst (copy-on-write and
 * fork). */
typedef struct {
    uint32_t src;
    uint32_t dst;
} kvp_page_copy_t;

/* Where each appended token goes: one struct for the CPU and the CUDA append (kvp_append_cpu,
 * kvp_append_cuda), three forms. The arrays are borrowed, in the memory the operation reads
 * (host for the CPU; device for CUDA unless it says otherwise). */
typedef enum {
    /* FlashInfer's append_paged_kv_cache: token i goes to request batch_indices[i] (< 0:
     * padding, skipped), position positions[i], through kv's page table (the file comment) */
    KVP_APPEND_DEST_TOKENS = 0,
    /* the fused form: token i belongs to the request b with append_indptr[b] <= i <
     * append_indptr[b+1] and goes to position seq_len[b] - append_len[b] + (i -
     * append_indptr[b]), seq_len from kv's page table */
    KVP_APPEND_DEST_FUSED = 1,
    /* every token's pool slot, slots[i] = page id * page_size + position % page_size (< 0:
     * padding, skipped); kv's page table is not used. vLLM's slot_mapping; the daemon's
     * planner emits it (kvcache/kvp_plan.h, kvp_plan_slots) */
    KVP_APPEND_DEST_SLOTS = 2,
} kvp_append_dest_kind_t;

typedef struct {
    uint32_t kind;                /* kvp_append_dest_kind_t */
    uint32_t nnz;                 /* tokens appended: rows 0..nnz-1 of the source */
    const int32_t *batch_indices; /* TOKENS: [nnz] */
    const int32_t *positions;     /* TOKENS: [nnz] */
    const int32_t *append_indptr; /* FUSED: [kv->batch_size + 1], [0] == 0, [batch_size] == nnz */
    const int32_t *slots;         /* SLOTS: [nnz] */
} kvp_append_dest_t;

/*
 * Checks a paged-KV description and its page table on the host: elem_bytes in {1,2,4},
 * non-zero sizes, non-NULL pointers, kv_indptr[0] == 0 and non-decreasing, every page id in
 * [0, num_pages), every kv_last_page_len in 1..page_size for a non-empty request (0 allowed
 * for an empty one). Returns 0, KVP_EINVAL or KVP_ERANGE. Pure; any thread.
 */
int kvp_paged_kv_check(const kvp_paged_kv_t *kv);

/*
 * append_paged_kv_cache on the CPU. Validates everything first (kvp_paged_kv_check, source
 * pointers and strides, and for each non-padding token: batch index < batch_size and
 * 0 <= position < seq_len of its request), then copies. Returns 0; KVP_EINVAL or KVP_ERANGE
 * with the cache untouched. nnz = 0 returns 0 without reading anything else. A stride (pool or
 * source) is KVP_EINVAL when it is negative or its byte step (stride * elem_bytes) does not fit
 * in ptrdiff_t, even when it is never used (one token, one head), and so is a tensor whose byte
 * extent overflows or wraps the address space: all computed in unsigned 64-bit first.
 */
int kvp_append_paged_kv_cache_cpu(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                  const int32_t *batch_indices, const int32_t *positions,
                                  uint32_t nnz);

/*
 * The append on the CPU, with the destination in any of its forms (kvp_append_dest_t, host
 * arrays). kvp_append_paged_kv_cache_cpu is its TOKENS form. Validates everything first, then
 * copies; a rejected call leaves the cache untouched. nnz 0 returns 0 (dest must not be NULL).
 * TOKENS: as kvp_append_paged_kv_cache_cpu. FUSED: kv's page table checked as
 * kvp_paged_kv_check, then append_indptr (NULL, [0] != 0, decreasing, or [batch_size] != nnz:
 * KVP_EINVAL) and every request's append_len <= its seq_len (else KVP_ERANGE). SLOTS: kv's
 * pool shape checked (not its page table, which may be NULL), and every slot < num_pages *
 * page_size (else KVP_ERANGE). The source as kvp_append_paged_kv_cache_cpu says. Any thread.
 */
int kvp_append_cpu(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                   const kvp_append_dest_t *dest);

/* Where a gather (kvp_gather_cpu, kvp_gather_cuda) writes: [nnz, num_heads, head_dim] with
 * any row and head stride (elements), the last dimension contiguous. The mirror of
 * kvp_append_src_t, writable. Borrowed. */
typedef struct {
    void *key;
    void *value;
    int64_t k_stride_n, k_stride_h;
    int64_t v_stride_n, v_stride_h;
} kvp_gather_dst_t;

/*
 * The inverse of the append's slots form (kvp_append_cpu with KVP_APPEND_DEST_SLOTS): for each
 * i < nnz, the K and V rows of every head of pool slot slots[i] (page slots[i] / page_size,
 * position slots[i] % page_size) of the layer kv describes are copied to row i of dst. A slot
 * < 0 is padding: its rows of dst are left as they were. So after an append of src to slots
 * (distinct slots) and a gather of the same slots into a dst laid out like src, dst holds src's
 * rows byte for byte. Validates everything first, then copies: kv's pool shape (its page table
 * is not used and may be NULL), dst as the append's source (non-NULL pointers, strides >= 0,
 * byte steps and extent that fit in ptrdiff_t and do not wrap), slots not NULL (KVP_EINVAL),
 * every slot < num_pages * page_size (KVP_ERANGE); a rejected call writes nothing. nnz 0
 * returns 0 without reading anything. dst must not overlap the pool. Reads the pool only; any
 * thread.
 */
int kvp_gather_cpu(const kvp_paged_kv_t *kv, const int32_t *slots, uint32_t nnz,
                   const kvp_gather_dst_t *dst);

/*
 * seq_lens[b] = (kv_indptr[b+1] - kv_indptr[b] - 1) * page_size + kv_last_page_len[b], or 0
 * for a request with no pages (FlashInfer's get_seq_lens). Returns 0 or KVP_EINVAL (NULL
 * pointer, page_size 0, decreasing indptr).
 */
int kvp_get_seq_lens_cpu(const int32_t *kv_indptr, const int32_t *kv_last_page_len,
                         uint32_t batch_size, uint32_t page_size, int32_t *seq_lens);

/*
 * FlashInfer's get_batch_indices_positions: for request b and its j-th appended token
 * (append_indptr[b] + j), batch_indices = b and positions = seq_lens[b] - append_len[b] + j,
 * where seq_lens already counts the appended tokens. Outputs have nnz = append_indptr[B]
 * entries; nnz is the capacity of both outputs. Returns 0, or KVP_EINVAL (decreasing indptr,
 * append_indptr[B] != nnz, append_len > seq_len) with the outputs untouched.
 */
int kvp_get_batch_indices_positions_cpu(const int32_t *append_indptr, const int32_t *seq_lens,
                                        uint32_t batch_size, uint32_t nnz, int32_t *batch_indices,
                                        int32_t *positions);

/*
 * Copies K and V of whole pages inside one layer: for each c, page copies[c].src to page
 * copies[c].dst. Only kv's data pointers, sizes and strides are used (not its page table).
 * Returns 0, or KVP_EINVAL / KVP_ERANGE (page id >= num_pages, src == dst) with nothing
 * copied. The destinations must be distinct from every source (as copy-on-write guarantees).
 */
int kvp_page_copy_cpu(const kvp_paged_kv_t *kv, const kvp_page_copy_t *copies, uint32_t num_copies);

/*
 * The packed form of a sequence's KV, the wire format of transfers between pools (DESIGN.md
 * §6): per layer, K then V, each [num_tokens, num_heads, head_dim] elements, contiguous
 * ([layer][K|V][token][head][D]). It does not depend on the page size, layout (NHD/HND) or
 * storage (combined/split) of either pool, so two pools that differ in those exchange it as is.
 * One call packs or unpacks ONE layer: 2 * num_tokens * num_heads * head_dim * elem_bytes
 * bytes (kvp_kv_packed_layer_bytes); layer l of a stream starts l times that far in.
 */

/* Bytes of one layer's packed K and V. 0 when any argument is 0. */
uint64_t kvp_kv_packed_layer_bytes(uint32_t num_tokens, uint32_t num_heads, uint32_t head_dim,
                                   uint32_t elem_bytes);

/* Byte offset, inside one layer's packed part, of the row (K: kv = 0, V: kv = 1) of token
 * `token`, head `head`; row_bytes = head_dim * elem_bytes. */
static inline uint64_t kvp_kv_packed_offset(uint32_t num_tokens, uint32_t num_heads,
                                            uint64_t row_bytes, int kv, uint32_t token,
                                            uint32_t head)
{
    return (((uint64_t)(kv ? 1 : 0) * num_tokens + token) * num_heads + head) * row_bytes;
}

/*
 * Packs tokens [0, num_tokens) of one layer of a sequence: token t lives in page
 * pages[t / page_size], slot t % page_size, of the layer kv describes (its page table fields
 * are not used). out receives kvp_kv_packed_layer_bytes(...) bytes. Every page id of the
 * ceil(num_tokens / page_size) pages is checked (< num_pages) before anything is written.
 * Returns 0, KVP_EINVAL (NULL pointer, bad sizes) or KVP_ERANGE (page id). Unpack is the
 * inverse: it writes those slots of the pool from in. Any thread.
 */
int kvp_kv_pack_cpu(const kvp_paged_kv_t *kv, const int32_t *pages, uint32_t num_tokens, void *out);
int kvp_kv_unpack_cpu(const kvp_paged_kv_t *kv, const int32_t *pages, uint32_t num_tokens,
                      const void *in);

/* The byte range [begin, end) of the layer's packed part (end <= kvp_kv_packed_layer_bytes;
 * any bytes, rows may be cut): out / in hold just that range. The CPU twin of
 * kvp_kv_pack_range_cuda; the host backend's page-mover. Returns 0, KVP_EINVAL (as above, or a
 * bad range) or KVP_ERANGE. Any thread. */
int kvp_kv_pack_range_cpu(const kvp_paged_kv_t *kv, const int32_t *pages, uint32_t num_tokens,
                          uint64_t begin, uint64_t end, void *out);
int kvp_kv_unpack_range_cpu(const kvp_paged_kv_t *kv, const int32_t *pages, uint32_t num_tokens,
                            uint64_t begin, uint64_t end, const void *in);

#ifdef __cplusplus
}
#endif
#endif
