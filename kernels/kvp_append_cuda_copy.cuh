/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_append_cuda_copy.cuh - the copy kernels of the CUDA append, one per shape, each
 * instantiated per row width (VECS) and destination mode (Mode, kvp_append_cuda_dev.cuh):
 *   copy_block_kernel   a block takes a few consecutive tokens (prefills);
 *   copy_warp_kernel    whole warps per token (decode steps; the checked one-launch form and the
 *                       gated copy too); the config and the API call it "warp" as well
 *                       ([tuning] append_kernel = warp, KVP_APPEND_CUDA_KERNEL_WARP);
 *   copy_flat_kernel    one 16-byte vector a thread (large batches of the slots form);
 *   copy_inline_kernel  the slots carried inside the launch, every layer of an Append at once
 *                       (the host-slots form, KVP_APPEND_CUDA_HOST_DEST).
 * Where a token goes (token_first / token_rest) is at the top. Which kernel and grid a call
 * takes is kvp_append_cuda_shape.cuh's; the instantiations, the eager-load table and the entry
 * point are kvp_append_cuda.cu's.
 */
#ifndef KVP_APPEND_CUDA_COPY_CUH
#define KVP_APPEND_CUDA_COPY_CUH

#include "kvp_append_cuda_check.cuh"
#include "kvp_append_cuda_dev.cuh"

namespace
{

/* The first round trip of token i's destination lookup (token_first), kept in registers
 * while the kernel puts its source loads in flight, then finished by token_rest: so the
 * lookup's first load latency overlaps the source loads' instead of following them. */
struct TokFirst {
    FusedFirst f;       /* fused */
    int32_t b[1], p[1]; /* batch index and position (unchecked, gated) */
    int32_t slot;       /* slots */
};

template <int MODE_>
__device__ __forceinline__ TokFirst token_first(const Geo &g, uint32_t i, uint32_t nnz,
                                                const int32_t *__restrict__ bi,
                                                const int32_t *__restrict__ pos_arr,
                                                const int32_t *__restrict__ aip)
{
    constexpr int MODE = MODE_ == kGated ? kUnchecked : MODE_;
    TokFirst t;
    if (MODE == kSlots)
        t.slot = __ldg(aip + i);
    else if (MODE == kFused)
        t.f = fused_first(g, i, nnz, aip);
    else
        check_first<1>(bi, pos_arr, nnz, i, 0, t.b, t.p);
    return t;
}

/* Where token i goes, or -1 to skip it (padding, or an invalid entry reported in *err).
 * Fused: fused_page_pos; slots: from slots[i] (passed as aip); else batch_indices/positions
 * with the checked form's validation of this one token as per-row guards (batch index and
 * position in one round trip, the request's entries in the next, the page id in the third,
 * each load issued without waiting on a branch). */
template <int MODE_>
__device__ __forceinline__ int64_t token_rest(const Geo &g, uint32_t i,
                                              const int32_t *__restrict__ aip, int32_t *err,
                                              const TokFirst &t)
{
    constexpr int MODE = MODE_ == kGated ? kUnchecked : MODE_;
    if (MODE == kSlots) {
        return slot_dst(g, t.slot, err);
    } else if (MODE == kFused) {
        int32_t page, pos;
        if (!fused_rest(g, i, aip, err, t.f, &page, &pos))
            return -1;
        return slot_bytes(g, page, pos);
    } else {
        int64_t d[1];
        set_verdict(err, check_rest<1>(g, t.b, t.p, d));
        return d[0];
    }
}

template <int MODE>
__device__ __forceinline__ int64_t token_dst(const Geo &g, uint32_t i, uint32_t nnz,
                                             const int32_t *__restrict__ bi,
                                             const int32_t *__restrict__ pos_arr,
                                             const int32_t *__restrict__ aip, int32_t *err)
{
    return token_rest<MODE>(g, i, aip, err, token_first<MODE>(g, i, nnz, bi, pos_arr, aip));
}

/*
 * The copy. A block takes `ntok` consecutive tokens; its threads first issue the loads of
 * their source vectors (which do not depend on the page table), while threads 0..ntok-1 look
 * up where each token goes (the dependent chain: request, sequence length, page id), so the
 * two latencies overlap; after one barrier every thread stores. kItems vectors per thread are
 * in flight at once. gate (may be NULL): skip everything when *gate != 0 (the validation
 * kernel found an error). Under PDL (flags & kPdl) the lookups run first, before the wait for
 * the previous kernel (they read only the page table, which the caller guarantees is ready),
 * and the source loads after it.
 */
template <int VECS, int MODE>
__global__ void __launch_bounds__(kThreads)
    copy_block_kernel(Geo g, const int32_t *__restrict__ bi, const int32_t *__restrict__ pos_arr,
                      const int32_t *__restrict__ aip, uint32_t nnz, uint32_t tokens_per_block,
                      const int32_t *gate, int32_t *err, uint32_t flags)
{
    __shared__ int64_t s_dst[kMaxTokens];
    const bool pdl = flags & kPdl;
    if (pdl)
        pdl_launch_dependents();
    if (gate && *gate) {
        if (pdl)
            pdl_wait();
        return;
    }
    const uint32_t vecs = VECS ? (uint32_t)VECS : g.vecs;
    const uint32_t per_kv = g.num_heads * vecs, per_tok = 2 * per_kv;
    bool waited = !pdl;
    for (uint64_t tok0 = (uint64_t)blockIdx.x * tokens_per_block; tok0 < nnz;
         tok0 += (uint64_t)gridDim.x * tokens_per_block) {
        const uint32_t ntok =
            (uint32_t)(nnz - tok0 < tokens_per_block ? nnz - tok0 : tokens_per_block);
        const uint32_t nitems = ntok * per_tok;
        if (!waited) {
            if (threadIdx.x < ntok)
                s_dst[threadIdx.x] =
                    token_dst<MODE>(g, (uint32_t)(tok0 + threadIdx.x), nnz, bi, pos_arr, aip, err);
            pdl_wait();
        }
        for (uint32_t base = 0; base < nitems; base += blockDim.x * kItems) {
            uint4 v[kItems];
#pragma unroll
            for (int k = 0; k < kItems; k++) {
                uint32_t it = base + k * blockDim.x + threadIdx.x;
                if (it < nitems) {
                    uint32_t t = it / per_tok, r = it - t * per_tok;
                    uint32_t kv = r >= per_kv;
                    r -= kv * per_kv;
                    uint32_t h = r / vecs, vec = r - h * vecs;
                    uint64_t i = tok0 + t;
                    const uint8_t *src = (kv ? g.sv + (int64_t)i * g.sv_n + (int64_t)h * g.sv_h
                                             : g.sk + (int64_t)i * g.sk_n + (int64_t)h * g.sk_h) +
                                         vec * 16;
                    v[k] = load_src(src, flags);
                }
            }
            if (base == 0) {
                if (waited && threadIdx.x < ntok)
                    s_dst[threadIdx.x] = token_dst<MODE>(g, (uint32_t)(tok0 + threadIdx.x), nnz, bi,
                                                         pos_arr, aip, err);
                __syncthreads();
            }
#pragma unroll
            for (int k = 0; k < kItems; k++) {
                uint32_t it = base + k * blockDim.x + threadIdx.x;
                if (it < nitems) {
                    uint32_t t = it / per_tok, r = it - t * per_tok;
                    int64_t dst = s_dst[t];
                    if (dst < 0)
                        continue;
                    uint32_t kv = r >= per_kv;
                    r -= kv * per_kv;
                    uint32_t h = r / vecs, vec = r - h * vecs;
                    store_dst((kv ? g.v : g.k) + dst + (int64_t)h * g.head_stride + vec * 16, v[k],
                              flags);
                }
            }
        }
        waited = true;
        __syncthreads(); /* s_dst is reused by the next tokens */
    }
    if (!waited)
        pdl_wait(); /* a block with no tokens still finishes after its predecessor */
}

/*
 * The small-batch copy (decode steps), the warp kernel: a group of blockDim.x threads (whole
 * warps) per token, blockDim.y tokens per block, no shared memory and no barrier (except in
 * the checked form). Each thread moves `items` 16-byte vectors of its token's (K|V, head,
 * vector) items, vector index fastest, so a warp reads and writes whole contiguous rows.
 * Every thread computes its token's destination itself (the loads are the same for the
 * whole warp, so each is one transaction) while its source vectors are already in flight,
 * then stores. Under PDL the destination is computed before the wait for the previous kernel
 * and the source is loaded after it, so the page-table round trips overlap the previous
 * kernel's tail.
 */
/* Loads items first + k * step (k < n <= kItems, item < the token's 2 * H * vecs) of the
 * token whose source rows start at sk / sv: N of them (0: n of them, each predicated). */
template <int VECS, int N>
__device__ __forceinline__ void warp_load_n(const Geo &g, const uint8_t *sk, const uint8_t *sv,
                                            uint32_t first, uint32_t step, uint32_t n,
                                            uint32_t flags, uint4 (&v)[kItems])
{
    const uint32_t per_tok = 2 * g.num_heads * (VECS ? (uint32_t)VECS : g.vecs);
#pragma unroll
    for (int k = 0; k < (N ? N : kItems); k++) {
        uint32_t it = first + k * step;
        if ((N || (uint32_t)k < n) && it < per_tok)
            v[k] = load_src(item_src<VECS>(g, sk, sv, it), flags);
    }
}

/* Stores what warp_load_n loaded, at the slot dst (byte offset in the pool's K and V). */
template <int VECS, int N>
__device__ __forceinline__ void warp_store_n(const Geo &g, int64_t dst, uint32_t first,
                                             uint32_t step, uint32_t n, uint32_t flags,
                                             const uint4 (&v)[kItems])
{
    const uint32_t per_tok = 2 * g.num_heads * (VECS ? (uint32_t)VECS : g.vecs);
#pragma unroll
    for (int k = 0; k < (N ? N : kItems); k++) {
        uint32_t it = first + k * step;
        if ((N || (uint32_t)k < n) && it < per_tok)
            store_dst(item_dst<VECS>(g, dst, it), v[k], flags);
    }
}

/* warp_load_n with n vectors a thread: 1, 2 and 4 (the shapes warp_block picks for decode
 * steps) each take a path of their own, without the unrolled tail's predicates. */
template <int VECS>
__device__ __forceinline__ void warp_load(const Geo &g, const uint8_t *sk, const uint8_t *sv,
                                          uint32_t first, uint32_t step, uint32_t n, uint32_t flags,
                                          uint4 (&v)[kItems])
{
    if (n == 1)
        warp_load_n<VECS, 1>(g, sk, sv, first, step, n, flags, v);
    else if (n == 2)
        warp_load_n<VECS, 2>(g, sk, sv, first, step, n, flags, v);
    else if (n == 4)
        warp_load_n<VECS, 4>(g, sk, sv, first, step, n, flags, v);
    else
        warp_load_n<VECS, 0>(g, sk, sv, first, step, n, flags, v);
}

template <int VECS>
__device__ __forceinline__ void warp_store(const Geo &g, int64_t dst, uint32_t first, uint32_t step,
                                           uint32_t n, uint32_t flags, const uint4 (&v)[kItems])
{
    if (n == 1)
        warp_store_n<VECS, 1>(g, dst, first, step, n, flags, v);
    else if (n == 2)
        warp_store_n<VECS, 2>(g, dst, first, step, n, flags, v);
    else if (n == 4)
        warp_store_n<VECS, 4>(g, dst, first, step, n, flags, v);
    else
        warp_store_n<VECS, 0>(g, dst, first, step, n, flags, v);
}

constexpr int kMaxWarpTokens = 8;    /* opts.warps_per_block at most */
constexpr int kWarpMaxThreads = 512; /* a block of the warp kernel (128 registers a thread) */

template <int VECS, int MODE>
__global__ void __launch_bounds__(kWarpMaxThreads)
    copy_warp_kernel(Geo g, const int32_t *__restrict__ bi, const int32_t *__restrict__ pos_arr,
                     const int32_t *__restrict__ aip, uint32_t nnz, uint32_t items,
                     const int32_t *gate, int32_t *err, uint32_t flags)
{
    const bool pdl = MODE != kChecked && (flags & kPdl);
    if (pdl)
        pdl_launch_dependents();
    const uint32_t tl = threadIdx.x, tpt = blockDim.x;
    const uint32_t i = blockIdx.x * blockDim.y + threadIdx.y;
    int64_t dst = -1;
    if (MODE == kChecked) {
        /* Every block validates every token (a decode step's few hundred: cheap next to the
         * copy), so each reaches the same verdict without a grid-wide barrier, and none
         * writes anything when one token is bad. Source loads first: they overlap the
         * validation's round trips. */
        __shared__ int64_t s_dst[kMaxWarpTokens];
        __shared__ uint32_t s_bad;
        const uint32_t tid = threadIdx.y * tpt + tl, nthr = tpt * blockDim.y;
        const uint32_t blk0 = blockIdx.x * blockDim.y;
        if (tid == 0)
            s_bad = __ldg(g.indptr) != 0 ? kBadInval : 0u;
        if (tid < blockDim.y)
            s_dst[tid] = -1;
        uint4 v[kItems];
        const bool live = i < nnz;
        const uint8_t *sk = g.sk + (int64_t)i * g.sk_n, *sv = g.sv + (int64_t)i * g.sv_n;
        if (live)
            warp_load<VECS>(g, sk, sv, tl, tpt, items, flags, v);
        __syncthreads(); /* s_bad, s_dst initialised */
        /* as many tokens a thread as one round needs (at most kCheckUnroll a round) */
        uint32_t bad;
        if (nnz <= nthr)
            bad = check_block<1>(g, bi, pos_arr, nnz, tid, nthr, blk0, blockDim.y, s_dst);
        else if (nnz <= 2 * nthr)
            bad = check_block<2>(g, bi, pos_arr, nnz, tid, nthr, blk0, blockDim.y, s_dst);
        else
            bad =
                check_block<kCheckUnroll>(g, bi, pos_arr, nnz, tid, nthr, blk0, blockDim.y, s_dst);
        if (bad)
            atomicOr(&s_bad, bad);
        __syncthreads();
        bad = s_bad;
        if (blockIdx.x == 0 && tid == 0)
            *err = verdict_code(bad); /* every block has the same verdict: block 0 says it */
        if (bad || !live)
            return;
        dst = s_dst[threadIdx.y];
        if (dst >= 0)
            warp_store<VECS>(g, dst, tl, tpt, items, flags, v);
        return;
    } else if (MODE == kGated) {
        /* Launched right behind validate_block_kernel (under PDL when the device has it): the
         * destination and the source loads first, while the validation runs (both read only
         * what was complete before the validation started), then the wait for its verdict. */
        if (i < nnz)
            dst = token_dst<MODE>(g, i, nnz, bi, pos_arr, aip, nullptr);
        uint4 v[kItems];
        const uint8_t *sk = g.sk + (int64_t)i * g.sk_n, *sv = g.sv + (int64_t)i * g.sv_n;
        if (dst >= 0)
            warp_load<VECS>(g, sk, sv, tl, tpt, items, flags, v);
        pdl_wait();
        if (dst >= 0 && *(volatile const int32_t *)gate == 0)
            warp_store<VECS>(g, dst, tl, tpt, items, flags, v);
        return;
    } else {
        if (i >= nnz) {
            if (pdl)
                pdl_wait();
            return;
        }
        /* thread 0 of the token alone reports errors; every thread computes the same
         * destination */
        int32_t *e = tl == 0 ? err : nullptr;
        /* The lookup's first loads on both paths, before anything else (their uses on the
         * two paths keep the compiler from sinking them). Under PDL the whole lookup, then
         * the wait, then the source loads; without, the source loads go out while the first
         * loads are in flight, and the rest of the lookup follows. */
        const TokFirst first = token_first<MODE>(g, i, nnz, bi, pos_arr, aip);
        if (pdl) {
            dst = token_rest<MODE>(g, i, aip, e, first);
            pdl_wait();
            if (dst < 0)
                return;
        }
        const uint8_t *sk = g.sk + (int64_t)i * g.sk_n, *sv = g.sv + (int64_t)i * g.sv_n;
        uint4 v[kItems];
        warp_load<VECS>(g, sk, sv, tl, tpt, items, flags, v);
        if (!pdl) {
            dst = token_rest<MODE>(g, i, aip, e, first);
            if (dst < 0)
                return;
        }
        warp_store<VECS>(g, dst, tl, tpt, items, flags, v);
    }
}

/*
 * The flat copy (large batches of the unchecked, fused and slots forms): one 16-byte vector a
 * thread and a grid of all of them, no loop, no shared memory and no barrier, so the
 * occupancy alone hides the latencies. Each thread looks its token's destination up itself:
 * the lookup's loads are the same for the whole warp (one transaction each) and for the
 * token's other warps (L1 hits). Items are ordered as the warp kernel's (vector index fastest,
 * then head, then K | V), token after token, so consecutive threads read and write contiguous
 * rows. tok_shift: log2(2 * H * vecs) when that is a power of two, else -1. Under PDL the
 * lookup runs before the wait for the previous kernel, the source load after it.
 */
template <int VECS, int MODE>
__global__ void __launch_bounds__(kThreads)
    copy_flat_kernel(Geo g, const int32_t *__restrict__ bi, const int32_t *__restrict__ pos_arr,
                     const int32_t *__restrict__ aip, uint32_t nnz, int32_t tok_shift, int32_t *err,
                     uint32_t flags)
{
    const bool pdl = flags & kPdl;
    if (pdl)
        pdl_launch_dependents();
    const uint32_t per_tok = 2 * g.num_heads * (VECS ? (uint32_t)VECS : g.vecs);
    const uint32_t x = blockIdx.x * kThreads + threadIdx.x;
    const uint32_t i = tok_shift >= 0 ? x >> tok_shift : x / per_tok;
    if (i >= nnz) {
        if (pdl)
            pdl_wait();
        return;
    }
    const uint32_t it = x - i * per_tok;
    int32_t *e = it == 0 ? err : nullptr; /* the token's first thread alone reports */
    const TokFirst first = token_first<MODE>(g, i, nnz, bi, pos_arr, aip);
    int64_t dst = -1;
    if (pdl) {
        dst = token_rest<MODE>(g, i, aip, e, first);
        pdl_wait();
        if (dst < 0)
            return;
    }
    const uint4 v = load_src(
        item_src<VECS>(g, g.sk + (int64_t)i * g.sk_n, g.sv + (int64_t)i * g.sv_n, it), flags);
    if (!pdl) {
        dst = token_rest<MODE>(g, i, aip, e, first);
        if (dst < 0)
            return;
    }
    store_dst(item_dst<VECS>(g, dst, it), v, flags);
}

/*
 * The inline copy (the slots form with KVP_APPEND_CUDA_HOST_DEST: the daemon's Append): each
 * token's destination slot was computed on the host by the planner, so the kernel does no
 * page-table lookup at all, and the slots travel inside the launch (a __grid_constant__ parameter,
 * read through the constant cache: every lane of a warp reads its token's slot at one address, a
 * broadcast), so a small Append needs no upload before its kernel and no error word after it. One
 * warp per token, one grid row (blockIdx.y) per layer: a whole multi-layer Append is one launch.
 */
constexpr int kInlineWarps = 4; /* tokens (warps) per block */

template <uint32_t CAP> struct InlineSlots {
    int32_t slot[CAP];
};

template <int VECS, uint32_t CAP>
__global__ void __launch_bounds__(32 * kInlineWarps)
    copy_inline_kernel(const __grid_constant__ Geo g, const __grid_constant__ InlineSlots<CAP> s,
                       uint32_t nnz, int64_t layer_stride, int64_t src_layer_stride)
{
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t i = blockIdx.x * kInlineWarps + (threadIdx.x >> 5);
    if (i >= nnz)
        return;
    const int32_t slot = s.slot[i];
    if (slot < 0)
        return; /* padding */
    const uint32_t per_tok = 2 * g.num_heads * (VECS ? (uint32_t)VECS : g.vecs);
    const int64_t layer = blockIdx.y;
    const int64_t dst = layer * layer_stride + (int64_t)(slot / g.page_size) * g.page_stride +
                        (int64_t)(slot % g.page_size) * g.slot_stride;
    const uint8_t *sk = g.sk + layer * src_layer_stride + (int64_t)i * g.sk_n;
    const uint8_t *sv = g.sv + layer * src_layer_stride + (int64_t)i * g.sv_n;
    for (uint32_t base = 0; base < per_tok; base += 32 * kItems) {
        uint4 v[kItems];
        warp_load_n<VECS, kItems>(g, sk, sv, base + lane, 32, kItems, 0, v);
        warp_store_n<VECS, kItems>(g, dst, base + lane, 32, kItems, 0, v);
    }
}

} // namespace

#endif
