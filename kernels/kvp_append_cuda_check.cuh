/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_append_cuda_check.cuh - the validation of the checked append (kvp_kernels_cuda.h,
 * KVP_APPEND_CUDA_CHECKED): what a token of the tokens form must satisfy before any row is
 * written (its request, position and page id), the verdict bits and their KVP_E* code, the
 * per-block validation the checked warp kernel runs, and the two validation kernels that run
 * before a gated copy (validate_block_kernel for decode-sized batches, validate_kernel for the
 * rest). The tokens form's per-row guards reuse check_first/check_rest for a single token.
 * Which of the three ways a checked call takes is the launch shape's choice
 * (kvp_append_cuda_shape.cuh, checked_way).
 */
#ifndef KVP_APPEND_CUDA_CHECK_CUH
#define KVP_APPEND_CUDA_CHECK_CUH

#include "kvp_append_cuda_dev.cuh"

namespace
{

constexpr int kCheckUnroll = 4; /* tokens a thread validates at once (check_tokens) */

/* The checked append's verdict bits (a token can be wrong in two ways). */
enum : uint32_t {
    kBadInval = 1u, /* the table's structure: indptr[0] != 0, a request of negative length */
    kBadRange = 2u, /* a batch index, position, last_page_len or page id out of range */
};

/* The KVP_E* code of a verdict: KVP_EINVAL when the structure is wrong, else KVP_ERANGE. */
__device__ __forceinline__ int32_t verdict_code(uint32_t bad)
{
    return (bad & kBadInval) ? KVP_EINVAL : bad ? KVP_ERANGE : 0;
}

/* Stores code in *err so that KVP_EINVAL wins over KVP_ERANGE whatever the order (validation
 * threads race): a deterministic result. */
__device__ __forceinline__ void set_verdict(int32_t *err, uint32_t bad)
{
    if (!err)
        return;
    if (bad & kBadInval)
        atomicExch(err, KVP_EINVAL);
    else if (bad)
        atomicCAS(err, 0, KVP_ERANGE);
}

/* The checked append's validation of U tokens t0 + u * step (u < U) at once: every load of
 * a stage is independent of the others, so the U tokens' three dependent round trips
 * (batch index and position; the request's indptr and last_page_len; the page id) overlap.
 * What is checked is what the append reads and writes: the token's request (in range, not
 * of negative length, last_page_len in 1..page_size), its position (inside the request),
 * and the page id it writes (< num_pages). Returns the kBad* bits; dst[u] the destination of
 * each valid token (-1: padding or bad). check_first is its first round trip (batch index
 * and position; b -1 past nnz) and check_rest the others, so a caller can put other loads in
 * flight between the two (the warp kernel's unchecked guards). */
template <int U>
__device__ __forceinline__ void
check_first(const int32_t *__restrict__ bi, const int32_t *__restrict__ pos_arr, uint32_t nnz,
            uint32_t t0, uint32_t step, int32_t (&b)[U], int32_t (&pos)[U])
{
#pragma unroll
    for (int u = 0; u < U; u++) {
        uint32_t t = t0 + u * step;
        bool live = t < nnz;
        b[u] = live ? __ldg(bi + t) : -1;
        pos[u] = live ? __ldg(pos_arr + t) : 0;
    }
}

/* check_tokens from its first round trip (check_first). */
template <int U>
__device__ __forceinline__ uint32_t check_rest(const Geo &g, const int32_t (&b)[U],
                                               const int32_t (&pos)[U], int64_t (&dst)[U])
{
    int32_t p0[U], p1[U], lst[U], page[U];
    bool live[U];
    uint32_t bad = 0;
    const int32_t B = (int32_t)g.batch_size;
#pragma unroll
    for (int u = 0; u < U; u++) {
        live[u] = b[u] >= 0; /* padding is skipped, not an error */
        if (live[u] && b[u] >= B) {
            bad |= kBadRange;
            live[u] = false;
        }
        int32_t bc = live[u] ? b[u] : 0;
        p0[u] = live[u] ? __ldg(g.indptr + bc) : 0;
        p1[u] = live[u] ? __ldg(g.indptr + bc + 1) : 0;
        lst[u] = live[u] ? __ldg(g.last + bc) : 0;
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
        int32_t np = p1[u] - p0[u];
        if (live[u] && np < 0) {
            bad |= kBadInval;
            live[u] = false;
        }
        if (live[u] && np > 0 && (lst[u] < 1 || lst[u] > (int32_t)g.page_size)) {
            bad |= kBadRange;
            live[u] = false;
        }
        int32_t len = np > 0 ? (np - 1) * (int32_t)g.page_size + lst[u] : 0;
        if (live[u] && (pos[u] < 0 || pos[u] >= len)) {
            bad |= kBadRange;
            live[u] = false;
        }
        page[u] = live[u] ? __ldg(g.indices + p0[u] + page_of(g, pos[u])) : 0;
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
        if (live[u] && (uint32_t)page[u] >= g.num_pages) {
            bad |= kBadRange;
            live[u] = false;
        }
        dst[u] = live[u] ? slot_bytes(g, page[u], pos[u]) : -1;
    }
    return bad;
}

template <int U>
__device__ __forceinline__ uint32_t check_tokens(const Geo &g, const int32_t *__restrict__ bi,
                                                 const int32_t *__restrict__ pos_arr, uint32_t nnz,
                                                 uint32_t t0, uint32_t step, int64_t (&dst)[U])
{
    int32_t b[U], pos[U];
    check_first<U>(bi, pos_arr, nnz, t0, step, b, pos);
    return check_rest<U>(g, b, pos, dst);
}

/* The checked warp kernel's validation of every token by the nthr threads of a block, U
 * tokens a thread at once (check_tokens); the destinations of the block's own tokens
 * blk0..blk0 + ntok - 1 into s_dst. Returns the kBad* bits this thread saw. */
template <int U>
__device__ __forceinline__ uint32_t check_block(const Geo &g, const int32_t *__restrict__ bi,
                                                const int32_t *__restrict__ pos_arr, uint32_t nnz,
                                                uint32_t tid, uint32_t nthr, uint32_t blk0,
                                                uint32_t ntok, int64_t *s_dst)
{
    uint32_t bad = 0;
    for (uint32_t t0 = tid; t0 < nnz; t0 += nthr * U) {
        int64_t d[U];
        bad |= check_tokens<U>(g, bi, pos_arr, nnz, t0, nthr, d);
#pragma unroll
        for (int u = 0; u < U; u++) {
            uint32_t t = t0 + u * nthr;
            if (t >= blk0 && t < blk0 + ntok && t < nnz)
                s_dst[t - blk0] = d[u];
        }
    }
    return bad;
}

/* Validation for the checked append of many tokens (the gated copy follows): every token as
 * check_tokens says, kCheckUnroll tokens a thread at once; *err was reset before. */
__global__ void validate_kernel(Geo g, const int32_t *__restrict__ batch_indices,
                                const int32_t *__restrict__ positions, uint32_t nnz, int32_t *err)
{
    const uint32_t nthr = gridDim.x * blockDim.x, tid = blockIdx.x * blockDim.x + threadIdx.x;
    uint32_t bad = tid == 0 && __ldg(g.indptr) != 0 ? kBadInval : 0u;
    for (uint32_t t0 = tid; t0 < nnz; t0 += nthr * kCheckUnroll) {
        int64_t d[kCheckUnroll];
        bad |= check_tokens<kCheckUnroll>(g, batch_indices, positions, nnz, t0, nthr, d);
    }
    set_verdict(err, bad);
}

/* The checked append's validation of a decode-sized batch in one block (no reset of *err
 * needed first: the block's verdict is stored, 0 included), before the gated copy: it lets
 * that copy start at once (PDL), so the copy's lookups and loads overlap the validation. */
__global__ void __launch_bounds__(kThreads * 4)
    validate_block_kernel(Geo g, const int32_t *__restrict__ batch_indices,
                          const int32_t *__restrict__ positions, uint32_t nnz, int32_t *err)
{
    __shared__ uint32_t s_bad;
    pdl_launch_dependents();
    if (threadIdx.x == 0)
        s_bad = __ldg(g.indptr) != 0 ? kBadInval : 0u;
    __syncthreads();
    uint32_t bad = 0;
    for (uint32_t t0 = threadIdx.x; t0 < nnz; t0 += blockDim.x * kCheckUnroll) {
        int64_t d[kCheckUnroll];
        bad |= check_tokens<kCheckUnroll>(g, batch_indices, positions, nnz, t0, blockDim.x, d);
    }
    if (bad)
        atomicOr(&s_bad, bad);
    __syncthreads();
    if (threadIdx.x == 0)
        *err = verdict_code(s_bad);
}

} // namespace

#endif
