/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_append_cuda.cu - the CUDA forms of kvp_kernels.h (see kvp_kernels_cuda.h): the append
 * (checked, unchecked, fused with the positions), seq lens, batch indices and positions, and
 * whole-page copies. Each operation has three layers, as in NCCL and ggml-cuda: the
 * __global__ kernel, a static launcher on an explicit stream, and the exported C entry point
 * that validates what the host can see.
 *
 * The copy moves 16-byte vectors: a block takes a few consecutive tokens (about 1024 vectors),
 * its threads walk the (token, K|V, head, vector) items with the vector index fastest, so a
 * warp reads and writes whole contiguous rows, with 4 vectors in flight per thread; the source
 * loads are issued before the page-table lookups they do not depend on (see copy_kernel).
 * Rows are specialised for 4, 8, 16 and 32 vectors (D = 32..256 in fp16) so that part of the
 * item decomposition is shifts. (A TMA bulk-copy kernel through shared memory was measured
 * against these on the H200 and lost on the large prefill: tests/bench/README.md.)
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "kvp_cuda_err.h"
#include "kvp_kernels_cuda.h"

namespace
{

constexpr int kThreads = 256;

/* Everything a copy kernel needs, by value (kernel parameter space). Strides in bytes. */
struct Geo {
    uint8_t *k;
    uint8_t *v;
    int64_t page_stride, slot_stride, head_stride;
    const uint8_t *sk;
    const uint8_t *sv;
    int64_t sk_n, sk_h, sv_n, sv_h;
    uint32_t page_size, num_heads, vecs, num_pages, batch_size;
    const int32_t *indptr;
    const int32_t *indices;
    const int32_t *last;
};

__device__ __forceinline__ void set_err(int32_t *err, int32_t code)
{
    if (err)
        atomicCAS(err, 0, code);
}

/* Launch options carried into the copy kernels (uniform branches). */
enum : uint32_t {
    kPdl = 1u,      /* launched with programmatic stream serialization (KVP_CUDA_APPEND_PDL) */
    kStreamLd = 2u, /* source loads with the evict-first hint (ld.global.cs) */
    kStreamSt = 4u, /* pool stores with the evict-first hint (st.global.cs) */
};

/* Programmatic dependent launch (sm_90): let the next kernel of the stream start its
 * prologue now, and wait until the previous one has finished and flushed its writes. Both
 * are no-ops when the kernel was launched without the attribute, and absent before sm_90. */
__device__ __forceinline__ void pdl_launch_dependents(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ uint4 load_src(const uint8_t *p, uint32_t flags)
{
    const uint4 *q = reinterpret_cast<const uint4 *>(p);
    return (flags & kStreamLd) ? __ldcs(q) : __ldg(q);
}

__device__ __forceinline__ void store_dst(uint8_t *p, uint4 v, uint32_t flags)
{
    uint4 *q = reinterpret_cast<uint4 *>(p);
    if (flags & kStreamSt)
        __stcs(q, v);
    else
        *q = v;
}

__device__ __forceinline__ int32_t seq_len_of(const int32_t *indptr, const int32_t *last,
                                              uint32_t page_size, int32_t b)
{
    int32_t n = indptr[b + 1] - indptr[b];
    return n > 0 ? (n - 1) * (int32_t)page_size + last[b] : 0;
}

constexpr int kItems = 8;      /* 16-byte vectors in flight per thread */
constexpr int kMaxTokens = 64; /* tokens per block */

/* Where token i goes, or -1 to skip it (padding, or an invalid entry reported in *err).
 * Fused: its request from append_indptr and its position from the page table; else
 * batch_indices/positions. The fused lookup first guesses b = i * B / nnz, which is exact for
 * decode steps (one token per request) and for equal-length prefills, and loads the guess's
 * page-table entries in the same round trip; only a wrong guess pays the binary search. */
template <bool FUSED>
__device__ __forceinline__ int64_t token_dst(const Geo &g, uint32_t i, uint32_t nnz,
                                             const int32_t *__restrict__ bi,
                                             const int32_t *__restrict__ pos_arr,
                                             const int32_t *__restrict__ aip, int32_t *err)
{
    int32_t b, pos;
    if (FUSED) {
        /* the guess and its page-table entries in one round trip */
        b = (int32_t)((uint64_t)i * g.batch_size / nnz);
        int32_t start = __ldg(aip + b), end = __ldg(aip + b + 1);
        int32_t p0 = __ldg(g.indptr + b), p1 = __ldg(g.indptr + b + 1), lst = __ldg(g.last + b);
        if ((int32_t)i < start || (int32_t)i >= end) {
            int32_t lo = 0, hi = (int32_t)g.batch_size - 1;
            while (lo < hi) {
                int32_t mid = (lo + hi + 1) >> 1;
                if (__ldg(aip + mid) <= (int32_t)i)
                    lo = mid;
                else
                    hi = mid - 1;
            }
            b = lo;
            start = __ldg(aip + b);
            end = __ldg(aip + b + 1);
            p0 = __ldg(g.indptr + b);
            p1 = __ldg(g.indptr + b + 1);
            lst = __ldg(g.last + b);
        }
        int32_t seq_len = p1 > p0 ? (p1 - p0 - 1) * (int32_t)g.page_size + lst : 0;
        pos = seq_len - (end - start) + ((int32_t)i - start);
        if ((int32_t)i >= end || pos < 0) {
            set_err(err, KVP_ERANGE);
            return -1;
        }
        int32_t page = __ldg(g.indices + p0 + pos / (int32_t)g.page_size);
        if ((uint32_t)page >= g.num_pages) {
            set_err(err, KVP_ERANGE);
            return -1;
        }
        return (int64_t)page * g.page_stride +
               (int64_t)(pos % (int32_t)g.page_size) * g.slot_stride;
    } else {
        b = bi[i];
        if (b < 0)
            return -1; /* padding */
        if ((uint32_t)b >= g.batch_size) {
            set_err(err, KVP_ERANGE);
            return -1;
        }
        pos = pos_arr[i];
        if (pos < 0 || pos >= seq_len_of(g.indptr, g.last, g.page_size, b)) {
            set_err(err, KVP_ERANGE);
            return -1;
        }
    }
    int32_t page = g.indices[g.indptr[b] + pos / (int32_t)g.page_size];
    if ((uint32_t)page >= g.num_pages) {
        set_err(err, KVP_ERANGE);
        return -1;
    }
    return (int64_t)page * g.page_stride + (int64_t)(pos % (int32_t)g.page_size) * g.slot_stride;
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
template <int VECS, bool FUSED>
__global__ void __launch_bounds__(kThreads)
    copy_kernel(Geo g, const int32_t *__restrict__ bi, const int32_t *__restrict__ pos_arr,
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
                    token_dst<FUSED>(g, (uint32_t)(tok0 + threadIdx.x), nnz, bi, pos_arr, aip, err);
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
                    s_dst[threadIdx.x] = token_dst<FUSED>(g, (uint32_t)(tok0 + threadIdx.x), nnz,
                                                          bi, pos_arr, aip, err);
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
 * The small-batch copy (decode steps): one warp per token, no shared memory and no barrier.
 * Every lane computes the token's destination itself (the loads are the same for the whole
 * warp, so each is one transaction) while its source vectors are already in flight, then
 * stores. Blocks of kWarpTokens warps keep the tokens spread over every multiprocessor. Under
 * PDL the destination is computed before the wait for the previous kernel and the source is
 * loaded after it, so the page-table round trips overlap the previous kernel's tail.
 */
/* One pass of a warp over one token's rows (the warp kernels): lane takes items base + k*32 +
 * lane of the token's (K|V, head, vector) items, vector index fastest, so the warp reads and
 * writes whole contiguous rows. sk/sv point at the token's source rows, dst is the slot's byte
 * offset in the pool's K (and V) tensor. */
template <int VECS>
__device__ __forceinline__ void warp_load_token(const Geo &g, const uint8_t *sk, const uint8_t *sv,
                                                uint32_t base, uint32_t lane, uint32_t flags,
                                                uint4 (&v)[kItems])
{
    const uint32_t vecs = VECS ? (uint32_t)VECS : g.vecs;
    const uint32_t per_kv = g.num_heads * vecs, per_tok = 2 * per_kv;
#pragma unroll
    for (int k = 0; k < kItems; k++) {
        uint32_t it = base + k * 32 + lane;
        if (it < per_tok) {
            uint32_t kv = it >= per_kv, r = it - kv * per_kv;
            uint32_t h = r / vecs, vec = r - h * vecs;
            v[k] = load_src((kv ? sv + (int64_t)h * g.sv_h : sk + (int64_t)h * g.sk_h) + vec * 16,
                            flags);
        }
    }
}

template <int VECS>
__device__ __forceinline__ void warp_store_token(const Geo &g, int64_t dst, uint32_t base,
                                                 uint32_t lane, uint32_t flags,
                                                 const uint4 (&v)[kItems])
{
    const uint32_t vecs = VECS ? (uint32_t)VECS : g.vecs;
    const uint32_t per_kv = g.num_heads * vecs, per_tok = 2 * per_kv;
#pragma unroll
    for (int k = 0; k < kItems; k++) {
        uint32_t it = base + k * 32 + lane;
        if (it < per_tok) {
            uint32_t kv = it >= per_kv, r = it - kv * per_kv;
            uint32_t h = r / vecs, vec = r - h * vecs;
            store_dst((kv ? g.v : g.k) + dst + (int64_t)h * g.head_stride + vec * 16, v[k], flags);
        }
    }
}

constexpr int kWarpTokens = 2;    /* warps (tokens) per block by default */
constexpr int kMaxWarpTokens = 8; /* opts.warps_per_block at most */

template <int VECS, bool FUSED>
__global__ void __launch_bounds__(32 * kMaxWarpTokens)
    copy_warp_kernel(Geo g, const int32_t *__restrict__ bi, const int32_t *__restrict__ pos_arr,
                     const int32_t *__restrict__ aip, uint32_t nnz, int32_t *err, uint32_t flags)
{
    const bool pdl = flags & kPdl;
    if (pdl)
        pdl_launch_dependents();
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t i = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= nnz) {
        if (pdl)
            pdl_wait();
        return;
    }
    const uint32_t per_tok = 2 * g.num_heads * (VECS ? (uint32_t)VECS : g.vecs);
    /* lane 0 alone reports errors; every lane computes the same destination */
    int64_t dst = 0;
    if (pdl) {
        dst = token_dst<FUSED>(g, i, nnz, bi, pos_arr, aip, lane == 0 ? err : nullptr);
        pdl_wait();
        if (dst < 0)
            return;
    }
    const uint8_t *sk = g.sk + (int64_t)i * g.sk_n, *sv = g.sv + (int64_t)i * g.sv_n;
    for (uint32_t base = 0; base < per_tok; base += 32 * kItems) {
        uint4 v[kItems];
        warp_load_token<VECS>(g, sk, sv, base, lane, flags, v);
        if (!pdl && base == 0) {
            dst = token_dst<FUSED>(g, i, nnz, bi, pos_arr, aip, lane == 0 ? err : nullptr);
            if (dst < 0)
                return;
        }
        warp_store_token<VECS>(g, dst, base, lane, flags, v);
    }
}

/*
 * The daemon's append (kvp_append_slots_cuda): each token's destination slot was computed on
 * the host by the planner, so the kernel does no page-table lookup at all, and the slots
 * travel inside the launch (a __grid_constant__ parameter, read through the constant cache:
 * every lane of a warp reads its token's slot at one address, a broadcast), so a small Append
 * needs no upload before its kernel and no error word after it. One warp per token, one
 * grid row (blockIdx.y) per layer: a whole multi-layer Append is one launch.
 */
constexpr int kSlotWarps = 4; /* tokens (warps) per block */

template <uint32_t CAP> struct InlineSlots {
    int32_t slot[CAP];
};

template <int VECS, uint32_t CAP>
__global__ void __launch_bounds__(32 * kSlotWarps)
    slots_kernel(const __grid_constant__ Geo g, const __grid_constant__ InlineSlots<CAP> s,
                 uint32_t nnz, int64_t layer_stride, int64_t src_layer_stride)
{
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t i = blockIdx.x * kSlotWarps + (threadIdx.x >> 5);
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
        warp_load_token<VECS>(g, sk, sv, base, lane, 0, v);
        warp_store_token<VECS>(g, dst, base, lane, 0, v);
    }
}

/* Validation for the checked append: the page table and every token, before any copy. */
__global__ void validate_kernel(Geo g, const int32_t *__restrict__ batch_indices,
                                const int32_t *__restrict__ positions, uint32_t nnz, int32_t *err)
{
    uint32_t n = nnz > g.batch_size ? nnz : g.batch_size;
    for (uint32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += gridDim.x * blockDim.x) {
        if (t == 0 && g.indptr[0] != 0)
            set_err(err, KVP_EINVAL);
        if (t < g.batch_size) {
            int32_t np = g.indptr[t + 1] - g.indptr[t];
            if (np < 0)
                set_err(err, KVP_EINVAL);
            else if (np > 0 && (g.last[t] < 1 || g.last[t] > (int32_t)g.page_size))
                set_err(err, KVP_ERANGE);
            for (int32_t k = g.indptr[t]; np > 0 && k < g.indptr[t + 1]; k++)
                if ((uint32_t)g.indices[k] >= g.num_pages)
                    set_err(err, KVP_ERANGE);
        }
        if (t < nnz) {
            int32_t b = batch_indices[t];
            if (b >= 0) {
                if ((uint32_t)b >= g.batch_size) {
                    set_err(err, KVP_ERANGE);
                } else {
                    int32_t np = g.indptr[b + 1] - g.indptr[b];
                    int32_t len = np > 0 ? (np - 1) * (int32_t)g.page_size + g.last[b] : 0;
                    if (np < 0 || positions[t] < 0 || positions[t] >= len)
                        set_err(err, KVP_ERANGE);
                }
            }
        }
    }
}

__global__ void seq_lens_kernel(const int32_t *indptr, const int32_t *last, uint32_t batch_size,
                                uint32_t page_size, int32_t *out)
{
    for (uint32_t b = blockIdx.x * blockDim.x + threadIdx.x; b < batch_size;
         b += gridDim.x * blockDim.x)
        out[b] = seq_len_of(indptr, last, page_size, (int32_t)b);
}

__global__ void batch_positions_kernel(const int32_t *append_indptr, const int32_t *seq_lens,
                                       uint32_t batch_size, int32_t *batch_indices,
                                       int32_t *positions)
{
    /* one block per request, threads over its tokens */
    for (uint32_t b = blockIdx.x; b < batch_size; b += gridDim.x) {
        int32_t start = append_indptr[b], len = append_indptr[b + 1] - start;
        int32_t base = seq_lens[b] - len;
        for (int32_t j = threadIdx.x; j < len; j += blockDim.x) {
            batch_indices[start + j] = (int32_t)b;
            positions[start + j] = base + j;
        }
    }
}

/* One block per (copy, K|V): the whole page, addressed through the strides. */
__global__ void page_copy_kernel(Geo g, const kvp_page_copy_t *__restrict__ copies,
                                 uint32_t num_copies, int32_t *err)
{
    for (uint32_t c = blockIdx.x >> 1; c < num_copies; c += gridDim.x >> 1) {
        uint32_t kv = blockIdx.x & 1;
        uint32_t src = copies[c].src, dst = copies[c].dst;
        if (src >= g.num_pages || dst >= g.num_pages || src == dst) {
            if (threadIdx.x == 0 && kv == 0)
                set_err(err, KVP_ERANGE);
            continue;
        }
        uint8_t *base = kv ? g.v : g.k;
        uint32_t per_slot = g.num_heads * g.vecs;
        uint32_t items = g.page_size * per_slot;
        for (uint32_t it = threadIdx.x; it < items; it += blockDim.x) {
            uint32_t slot = it / per_slot, r = it - slot * per_slot;
            uint32_t h = r / g.vecs, vec = r - h * g.vecs;
            int64_t off = (int64_t)slot * g.slot_stride + (int64_t)h * g.head_stride + vec * 16;
            uint4 val = *reinterpret_cast<const uint4 *>(base + (int64_t)src * g.page_stride + off);
            *reinterpret_cast<uint4 *>(base + (int64_t)dst * g.page_stride + off) = val;
        }
    }
}

/* ---- host side ------------------------------------------------------------------------- */

inline bool aligned16(const void *p)
{
    return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

/* Fills g from the public structs; KVP_EINVAL when the host can already see it is wrong. */
int make_geo(const kvp_paged_kv_t *kv, const kvp_append_src_t *src, Geo *g)
{
    if (!kv || !kv->k_data || !kv->v_data)
        return KVP_EINVAL;
    const uint32_t e = kv->elem_bytes;
    if (e != 1 && e != 2 && e != 4)
        return KVP_EINVAL;
    if (!kv->page_size || !kv->num_heads || !kv->head_dim || !kv->num_pages)
        return KVP_EINVAL;
    const uint64_t row = (uint64_t)kv->head_dim * e;
    if (row % 16 || !aligned16(kv->k_data) || !aligned16(kv->v_data))
        return KVP_EINVAL;
    if (kv->stride_page < 0 || kv->stride_n < 0 || kv->stride_h < 0 || (kv->stride_page * e) % 16 ||
        (kv->stride_n * e) % 16 || (kv->stride_h * e) % 16)
        return KVP_EINVAL;
    *g = Geo{};
    g->k = static_cast<uint8_t *>(kv->k_data);
    g->v = static_cast<uint8_t *>(kv->v_data);
    g->page_stride = kv->stride_page * e;
    g->slot_stride = kv->stride_n * e;
    g->head_stride = kv->stride_h * e;
    g->page_size = kv->page_size;
    g->num_heads = kv->num_heads;
    g->vecs = (uint32_t)(row / 16);
    g->num_pages = kv->num_pages;
    g->batch_size = kv->batch_size;
    g->indptr = kv->kv_indptr;
    g->indices = kv->kv_indices;
    g->last = kv->kv_last_page_len;
    if (src) {
        if (!src->key || !src->value || !aligned16(src->key) || !aligned16(src->value))
            return KVP_EINVAL;
        if (src->k_stride_n < 0 || src->k_stride_h < 0 || src->v_stride_n < 0 ||
            src->v_stride_h < 0 || (src->k_stride_n * e) % 16 || (src->k_stride_h * e) % 16 ||
            (src->v_stride_n * e) % 16 || (src->v_stride_h * e) % 16)
            return KVP_EINVAL;
        g->sk = static_cast<const uint8_t *>(src->key);
        g->sv = static_cast<const uint8_t *>(src->value);
        g->sk_n = src->k_stride_n * e;
        g->sk_h = src->k_stride_h * e;
        g->sv_n = src->v_stride_n * e;
        g->sv_h = src->v_stride_h * e;
    }
    return 0;
}

/* Multiprocessors of the current device, read once per process (a host attribute query, not
 * a stream operation: allowed while a graph is being captured). */
uint32_t num_sms(void)
{
    static int sms = 0;
    if (sms == 0) {
        int dev = 0, v = 0;
        if (cudaGetDevice(&dev) == cudaSuccess &&
            cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && v > 0)
            sms = v;
        else
            sms = 132;
    }
    return (uint32_t)sms;
}

/* The copy kernels' shape for one call, resolved from the caller's kvp_append_cuda_opts_t
 * (validated by the entry point; NULL or 0 fields: automatic). */
struct Knobs {
    uint32_t kernel; /* KVP_APPEND_CUDA_KERNEL_* */
    uint32_t tpb, blocks_per_sm, hints, warps;
};

static_assert(KVP_APPEND_CUDA_MAX_TPB == (uint32_t)kMaxTokens, "one bound, in the header");
static_assert(KVP_APPEND_CUDA_MAX_WARPS == (uint32_t)kMaxWarpTokens, "one bound, in the header");

Knobs knobs(const kvp_append_cuda_opts_t *o)
{
    Knobs k = {};
    k.warps = kWarpTokens;
    if (!o)
        return k;
    k.kernel = o->kernel;
    k.tpb = o->tokens_per_block;
    k.blocks_per_sm = o->blocks_per_sm;
    if (o->warps_per_block)
        k.warps = o->warps_per_block;
    k.hints = ((o->hints & KVP_APPEND_CUDA_HINT_LD) ? (uint32_t)kStreamLd : 0u) |
              ((o->hints & KVP_APPEND_CUDA_HINT_ST) ? (uint32_t)kStreamSt : 0u);
    return k;
}

/* 1 when the current device runs griddepcontrol (sm_90 and later), read once per process. */
bool device_has_pdl(void)
{
    static int has = -1;
    if (has < 0) {
        int dev = 0, major = 0;
        has =
            cudaGetDevice(&dev) == cudaSuccess &&
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
            major >= 9;
    }
    return has == 1;
}

/* Tokens per block: up to kThreads * kItems vectors a block, but never so many that fewer
 * than four blocks per multiprocessor remain: one SM moves only its share of the memory
 * bandwidth (~32 GB/s on an H200), so a small decode step must reach every SM. */
uint32_t tokens_per_block(const Geo &g, uint32_t nnz, const Knobs &kn)
{
    if (kn.tpb)
        return kn.tpb;
    uint32_t per_tok = 2 * g.num_heads * g.vecs;
    uint32_t t = (uint32_t)(kThreads * kItems) / per_tok;
    uint32_t spread = nnz / (4 * num_sms());
    if (t > spread)
        t = spread;
    return t < 1 ? 1 : t > (uint32_t)kMaxTokens ? (uint32_t)kMaxTokens : t;
}

/* Launches kern<<<grid, block, 0, s>>>(args...), with programmatic stream serialization when
 * pdl is set (the kernel then waits for its predecessor with griddepcontrol.wait itself). */
template <typename... KArgs, typename... Args>
void launch(void (*kern)(KArgs...), uint32_t grid, uint32_t block, bool pdl, cudaStream_t s,
            Args... args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    if (pdl) {
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
    }
    (void)cudaLaunchKernelEx(&cfg, kern, static_cast<KArgs>(args)...);
}

template <int VECS, bool FUSED>
void launch_copy_t(const Geo &g, const int32_t *bi, const int32_t *pos, const int32_t *aip,
                   uint32_t nnz, const int32_t *gate, int32_t *err, uint32_t flags, const Knobs &kn,
                   cudaStream_t s)
{
    flags |= kn.hints;
    if (!device_has_pdl())
        flags &= ~(uint32_t)kPdl;
    const bool pdl = flags & kPdl;
    /* small batches (decode) with rows a warp covers in one pass: a warp per token */
    bool warp = kn.kernel == KVP_APPEND_CUDA_KERNEL_WARP ||
                (kn.kernel == KVP_APPEND_CUDA_KERNEL_AUTO && nnz <= 16 * num_sms());
    if (!gate && warp && 2 * g.num_heads * g.vecs <= 32u * kItems) {
        uint32_t blocks = (nnz + kn.warps - 1) / kn.warps;
        launch(copy_warp_kernel<VECS, FUSED>, blocks, 32 * kn.warps, pdl, s, g, bi, pos, aip, nnz,
               err, flags);
        return;
    }
    uint32_t tpb = tokens_per_block(g, nnz, kn);
    uint64_t blocks = ((uint64_t)nnz + tpb - 1) / tpb;
    uint64_t cap = kn.blocks_per_sm ? (uint64_t)kn.blocks_per_sm * num_sms() : 65535u * 16u;
    if (blocks > cap)
        blocks = cap; /* the kernel loops over the rest */
    launch(copy_kernel<VECS, FUSED>, (uint32_t)blocks, kThreads, pdl, s, g, bi, pos, aip, nnz, tpb,
           gate, err, flags);
}

/* Calls f(std::integral_constant<int, V>{}) with V the row's vector count when the kernels
 * have a form specialised for it (4, 8, 16, 32), else with V = 0 (the generic form). */
template <typename F> void with_vecs(uint32_t vecs, F f)
{
    switch (vecs) {
    case 4:
        f(std::integral_constant<int, 4>{});
        break;
    case 8:
        f(std::integral_constant<int, 8>{});
        break;
    case 16:
        f(std::integral_constant<int, 16>{});
        break;
    case 32:
        f(std::integral_constant<int, 32>{});
        break;
    default:
        f(std::integral_constant<int, 0>{});
        break;
    }
}

template <bool FUSED>
void launch_copy(const Geo &g, const int32_t *bi, const int32_t *pos, const int32_t *aip,
                 uint32_t nnz, const int32_t *gate, int32_t *err, uint32_t flags,
                 const kvp_append_cuda_opts_t *opts, cudaStream_t s)
{
    const Knobs kn = knobs(opts);
    with_vecs(g.vecs, [&](auto v) {
        launch_copy_t<decltype(v)::value, FUSED>(g, bi, pos, aip, nnz, gate, err, flags, kn, s);
    });
}

/* The two inline capacities: a decode step of up to 256 sequences sends 1 KiB of slots, up
 * to KVP_APPEND_SLOTS_MAX 4 KiB (the launch copies the whole parameter block, so the small
 * one keeps the common case cheap). */
constexpr uint32_t kSlotsSmall = 256;
static_assert(KVP_APPEND_SLOTS_MAX > kSlotsSmall, "two capacities");

template <int VECS, uint32_t CAP>
void launch_slots_t(const Geo &g, const int32_t *slots, uint32_t nnz, uint32_t num_layers,
                    int64_t layer_stride, int64_t src_layer_stride, cudaStream_t s)
{
    InlineSlots<CAP> in;
    memcpy(in.slot, slots, (size_t)nnz * sizeof(int32_t));
    dim3 grid((nnz + kSlotWarps - 1) / kSlotWarps, num_layers);
    slots_kernel<VECS, CAP>
        <<<grid, 32 * kSlotWarps, 0, s>>>(g, in, nnz, layer_stride, src_layer_stride);
}

void launch_slots(const Geo &g, const int32_t *slots, uint32_t nnz, uint32_t num_layers,
                  int64_t layer_stride, int64_t src_layer_stride, cudaStream_t s)
{
    with_vecs(g.vecs, [&](auto v) {
        constexpr int V = decltype(v)::value;
        if (nnz <= kSlotsSmall)
            launch_slots_t<V, kSlotsSmall>(g, slots, nnz, num_layers, layer_stride,
                                           src_layer_stride, s);
        else
            launch_slots_t<V, KVP_APPEND_SLOTS_MAX>(g, slots, nnz, num_layers, layer_stride,
                                                    src_layer_stride, s);
    });
}

} // namespace

extern "C" int kvp_cuda_available(void)
{
    return 1;
}

extern "C" int kvp__cuda_pack_preload(void); /* kvp_pack_cuda.cu */

extern "C" int kvp_cuda_kernels_preload(void)
{
    cudaFuncAttributes a;
    const void *fns[] = {
        reinterpret_cast<const void *>(copy_kernel<0, false>),
        reinterpret_cast<const void *>(copy_kernel<4, false>),
        reinterpret_cast<const void *>(copy_kernel<8, false>),
        reinterpret_cast<const void *>(copy_kernel<16, false>),
        reinterpret_cast<const void *>(copy_kernel<32, false>),
        reinterpret_cast<const void *>(copy_kernel<0, true>),
        reinterpret_cast<const void *>(copy_kernel<4, true>),
        reinterpret_cast<const void *>(copy_kernel<8, true>),
        reinterpret_cast<const void *>(copy_kernel<16, true>),
        reinterpret_cast<const void *>(copy_kernel<32, true>),
        reinterpret_cast<const void *>(copy_warp_kernel<0, false>),
        reinterpret_cast<const void *>(copy_warp_kernel<4, false>),
        reinterpret_cast<const void *>(copy_warp_kernel<8, false>),
        reinterpret_cast<const void *>(copy_warp_kernel<16, false>),
        reinterpret_cast<const void *>(copy_warp_kernel<32, false>),
        reinterpret_cast<const void *>(copy_warp_kernel<0, true>),
        reinterpret_cast<const void *>(copy_warp_kernel<4, true>),
        reinterpret_cast<const void *>(copy_warp_kernel<8, true>),
        reinterpret_cast<const void *>(copy_warp_kernel<16, true>),
        reinterpret_cast<const void *>(copy_warp_kernel<32, true>),
        reinterpret_cast<const void *>(slots_kernel<0, kSlotsSmall>),
        reinterpret_cast<const void *>(slots_kernel<4, kSlotsSmall>),
        reinterpret_cast<const void *>(slots_kernel<8, kSlotsSmall>),
        reinterpret_cast<const void *>(slots_kernel<16, kSlotsSmall>),
        reinterpret_cast<const void *>(slots_kernel<32, kSlotsSmall>),
        reinterpret_cast<const void *>(slots_kernel<0, KVP_APPEND_SLOTS_MAX>),
        reinterpret_cast<const void *>(slots_kernel<4, KVP_APPEND_SLOTS_MAX>),
        reinterpret_cast<const void *>(slots_kernel<8, KVP_APPEND_SLOTS_MAX>),
        reinterpret_cast<const void *>(slots_kernel<16, KVP_APPEND_SLOTS_MAX>),
        reinterpret_cast<const void *>(slots_kernel<32, KVP_APPEND_SLOTS_MAX>),
        reinterpret_cast<const void *>(validate_kernel),
        reinterpret_cast<const void *>(seq_lens_kernel),
        reinterpret_cast<const void *>(batch_positions_kernel),
        reinterpret_cast<const void *>(page_copy_kernel),
    };
    int rc = 0;
    for (const void *f : fns)
        KVP_CUDA_TRY(cudaFuncGetAttributes(&a, f), rc, fail);
    return kvp__cuda_pack_preload();
fail:
    return rc;
}

extern "C" int kvp_append_paged_kv_cache_cuda_opts(const kvp_paged_kv_t *kv,
                                                   const kvp_append_src_t *src,
                                                   const int32_t *batch_indices,
                                                   const int32_t *positions, uint32_t nnz,
                                                   int32_t *err_dev,
                                                   const kvp_append_cuda_opts_t *opts, void *stream)
{
    if (kvp_append_cuda_opts_check(opts))
        return KVP_EINVAL;
    if (nnz == 0)
        return 0;
    Geo g;
    int rc = make_geo(kv, src, &g);
    if (rc)
        return rc;
    if (!batch_indices || !positions || !err_dev || !kv->kv_indptr || !kv->kv_indices ||
        !kv->kv_last_page_len)
        return KVP_EINVAL;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    uint32_t n = nnz > g.batch_size ? nnz : g.batch_size;
    uint32_t blocks = (n + kThreads - 1) / kThreads;
    if (blocks > 4096)
        blocks = 4096;
    KVP_CUDA_TRY(cudaMemsetAsync(err_dev, 0, sizeof(int32_t), s), rc, fail);
    validate_kernel<<<blocks, kThreads, 0, s>>>(g, batch_indices, positions, nnz, err_dev);
    KVP_LAUNCH_TRY(rc, fail);
    launch_copy<false>(g, batch_indices, positions, nullptr, nnz, err_dev, err_dev, 0, opts, s);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_append_paged_kv_cache_cuda(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                              const int32_t *batch_indices,
                                              const int32_t *positions, uint32_t nnz,
                                              int32_t *err_dev, void *stream)
{
    return kvp_append_paged_kv_cache_cuda_opts(kv, src, batch_indices, positions, nnz, err_dev,
                                               nullptr, stream);
}

extern "C" int kvp_append_paged_kv_cache_cuda_unchecked_opts(
    const kvp_paged_kv_t *kv, const kvp_append_src_t *src, const int32_t *batch_indices,
    const int32_t *positions, uint32_t nnz, int32_t *err_dev, const kvp_append_cuda_opts_t *opts,
    void *stream)
{
    if (kvp_append_cuda_opts_check(opts))
        return KVP_EINVAL;
    if (nnz == 0)
        return 0;
    Geo g;
    int rc = make_geo(kv, src, &g);
    if (rc)
        return rc;
    if (!batch_indices || !positions || !kv->kv_indptr || !kv->kv_indices || !kv->kv_last_page_len)
        return KVP_EINVAL;
    launch_copy<false>(g, batch_indices, positions, nullptr, nnz, nullptr, err_dev, 0, opts,
                       static_cast<cudaStream_t>(stream));
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_append_paged_kv_cache_cuda_unchecked(const kvp_paged_kv_t *kv,
                                                        const kvp_append_src_t *src,
                                                        const int32_t *batch_indices,
                                                        const int32_t *positions, uint32_t nnz,
                                                        int32_t *err_dev, void *stream)
{
    return kvp_append_paged_kv_cache_cuda_unchecked_opts(kv, src, batch_indices, positions, nnz,
                                                         err_dev, nullptr, stream);
}

extern "C" int kvp_append_paged_kv_cache_fused_cuda_opts(const kvp_paged_kv_t *kv,
                                                         const kvp_append_src_t *src,
                                                         const int32_t *append_indptr, uint32_t nnz,
                                                         int32_t *err_dev, unsigned flags,
                                                         const kvp_append_cuda_opts_t *opts,
                                                         void *stream)
{
    if ((flags & ~(unsigned)KVP_CUDA_APPEND_PDL) || kvp_append_cuda_opts_check(opts))
        return KVP_EINVAL;
    if (nnz == 0)
        return 0;
    Geo g;
    int rc = make_geo(kv, src, &g);
    if (rc)
        return rc;
    if (!append_indptr || !g.batch_size || !kv->kv_indptr || !kv->kv_indices ||
        !kv->kv_last_page_len)
        return KVP_EINVAL;
    launch_copy<true>(g, nullptr, nullptr, append_indptr, nnz, nullptr, err_dev,
                      (flags & KVP_CUDA_APPEND_PDL) ? (uint32_t)kPdl : 0u, opts,
                      static_cast<cudaStream_t>(stream));
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_append_paged_kv_cache_fused_cuda_ex(const kvp_paged_kv_t *kv,
                                                       const kvp_append_src_t *src,
                                                       const int32_t *append_indptr, uint32_t nnz,
                                                       int32_t *err_dev, unsigned flags,
                                                       void *stream)
{
    return kvp_append_paged_kv_cache_fused_cuda_opts(kv, src, append_indptr, nnz, err_dev, flags,
                                                     nullptr, stream);
}

extern "C" int kvp_append_paged_kv_cache_fused_cuda(const kvp_paged_kv_t *kv,
                                                    const kvp_append_src_t *src,
                                                    const int32_t *append_indptr, uint32_t nnz,
                                                    int32_t *err_dev, void *stream)
{
    return kvp_append_paged_kv_cache_fused_cuda_ex(kv, src, append_indptr, nnz, err_dev, 0, stream);
}

extern "C" int kvp_append_slots_cuda(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                     const int32_t *slots, uint32_t nnz, uint32_t num_layers,
                                     uint64_t layer_stride_bytes, uint64_t src_layer_stride_bytes,
                                     void *stream)
{
    if (nnz == 0)
        return 0;
    Geo g;
    int rc = make_geo(kv, src, &g);
    if (rc)
        return rc;
    if (!slots || nnz > KVP_APPEND_SLOTS_MAX || num_layers == 0 || num_layers > 65535u ||
        layer_stride_bytes % 16 || src_layer_stride_bytes % 16 ||
        layer_stride_bytes > (uint64_t)INT64_MAX || src_layer_stride_bytes > (uint64_t)INT64_MAX)
        return KVP_EINVAL;
    if (num_layers > 1 && !layer_stride_bytes)
        return KVP_EINVAL; /* every layer would write the same slots */
    const int64_t cap = (int64_t)kv->num_pages * kv->page_size;
    for (uint32_t i = 0; i < nnz; i++)
        if (slots[i] >= cap)
            return KVP_ERANGE; /* checked before anything is queued */
    launch_slots(g, slots, nnz, num_layers, (int64_t)layer_stride_bytes,
                 (int64_t)src_layer_stride_bytes, static_cast<cudaStream_t>(stream));
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_get_seq_lens_cuda(const int32_t *kv_indptr, const int32_t *kv_last_page_len,
                                     uint32_t batch_size, uint32_t page_size, int32_t *seq_lens,
                                     void *stream)
{
    if (!kv_indptr || !kv_last_page_len || !seq_lens || !page_size)
        return KVP_EINVAL;
    if (!batch_size)
        return 0;
    int rc = 0;
    uint32_t blocks = (batch_size + kThreads - 1) / kThreads;
    seq_lens_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        kv_indptr, kv_last_page_len, batch_size, page_size, seq_lens);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_get_batch_indices_positions_cuda(const int32_t *append_indptr,
                                                    const int32_t *seq_lens, uint32_t batch_size,
                                                    uint32_t nnz, int32_t *batch_indices,
                                                    int32_t *positions, void *stream)
{
    if (!append_indptr || !seq_lens)
        return KVP_EINVAL;
    if (!batch_size || !nnz)
        return 0;
    if (!batch_indices || !positions)
        return KVP_EINVAL;
    int rc = 0;
    uint32_t blocks = batch_size < 65535u ? batch_size : 65535u;
    batch_positions_kernel<<<blocks, 128, 0, static_cast<cudaStream_t>(stream)>>>(
        append_indptr, seq_lens, batch_size, batch_indices, positions);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_page_copy_cuda(const kvp_paged_kv_t *kv, const kvp_page_copy_t *copies,
                                  uint32_t num_copies, int32_t *err_dev, void *stream)
{
    if (num_copies == 0)
        return 0;
    Geo g;
    int rc = make_geo(kv, nullptr, &g);
    if (rc)
        return rc;
    if (!copies)
        return KVP_EINVAL;
    uint32_t blocks = 2 * (num_copies < 32768u ? num_copies : 32768u);
    page_copy_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        g, copies, num_copies, err_dev);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}
