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
 *
 * Decode-sized batches take the row kernel instead: whole warps per token, each thread a few
 * vectors, the shape chosen by the batch (row_block; issue #18's sweep on the H200), the
 * lookup's first load issued before the source loads. Large batches of the slots form without
 * PDL take the flat kernel (a thread per vector, copy_flat_kernel), measured faster than the
 * block kernel there and slower everywhere else (tests/bench/README.md). The
 * same kernels serve four ways of knowing a token's destination (Mode): batch indices and
 * positions (unchecked, or checked: every token validated before any write), the fused
 * lookup from append_indptr and the page table, and slots planned once per step.
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
    int32_t page_shift; /* log2(page_size) when it is a power of two, else -1 */
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

/* Where a copy kernel's token i goes: the four ways its destination is known. */
enum Mode : int {
    kUnchecked = 0, /* batch_indices/positions given; per-row guards */
    kFused = 1,     /* request and position from append_indptr and the page table */
    kChecked = 2,   /* batch_indices/positions, every token validated before any write */
    kSlots = 3,     /* the pool slot given (a device array planned once per step) */
    kGated = 4,     /* batch_indices/positions, written only when *gate == 0 (the checked
                       append's copy after validate_block_kernel, overlapped with it by PDL) */
};

/* pos / page_size and pos % page_size: a shift and a mask for the usual power-of-two pages. */
__device__ __forceinline__ int64_t slot_bytes(const Geo &g, int32_t page, int32_t pos)
{
    int32_t r = g.page_shift >= 0 ? pos & (int32_t)(g.page_size - 1) : pos % (int32_t)g.page_size;
    return (int64_t)page * g.page_stride + (int64_t)r * g.slot_stride;
}

__device__ __forceinline__ int32_t page_of(const Geo &g, int32_t pos)
{
    return g.page_shift >= 0 ? pos >> g.page_shift : pos / (int32_t)g.page_size;
}

/* A pool slot (page id * page_size + offset) as a byte offset in the layer, or -1 to skip it:
 * negative (padding), or beyond the pool (reported in *err). */
__device__ __forceinline__ int64_t slot_dst(const Geo &g, int32_t slot, int32_t *err)
{
    if (slot < 0)
        return -1;
    int32_t page = page_of(g, slot);
    if ((uint32_t)page >= g.num_pages) {
        set_err(err, KVP_ERANGE);
        return -1;
    }
    return slot_bytes(g, page, slot);
}

/* The fused lookup's first round trip (the guess's append_indptr and page-table entries),
 * issued apart from the rest so that a kernel can put its source loads in flight before it
 * waits for these. */
struct FusedFirst {
    int32_t b, start, end, p0, p1, lst;
};

__device__ __forceinline__ FusedFirst fused_first(const Geo &g, uint32_t i, uint32_t nnz,
                                                  const int32_t *__restrict__ aip)
{
    FusedFirst f;
    f.b = nnz == g.batch_size ? (int32_t)i : (int32_t)((uint64_t)i * g.batch_size / nnz);
    f.start = __ldg(aip + f.b);
    f.end = __ldg(aip + f.b + 1);
    f.p0 = __ldg(g.indptr + f.b);
    f.p1 = __ldg(g.indptr + f.b + 1);
    f.lst = __ldg(g.last + f.b);
    return f;
}

/* The rest of the fused lookup from its first round trip f (fused_page_pos). */
__device__ __forceinline__ bool fused_rest(const Geo &g, uint32_t i,
                                           const int32_t *__restrict__ aip, int32_t *err,
                                           FusedFirst f, int32_t *page_out, int32_t *pos_out)
{
    if ((int32_t)i < f.start || (int32_t)i >= f.end) {
        int32_t lo = 0, hi = (int32_t)g.batch_size - 1;
        while (lo < hi) {
            int32_t mid = (lo + hi + 1) >> 1;
            if (__ldg(aip + mid) <= (int32_t)i)
                lo = mid;
            else
                hi = mid - 1;
        }
        f.b = lo;
        f.start = __ldg(aip + f.b);
        f.end = __ldg(aip + f.b + 1);
        f.p0 = __ldg(g.indptr + f.b);
        f.p1 = __ldg(g.indptr + f.b + 1);
        f.lst = __ldg(g.last + f.b);
    }
    int32_t seq_len = f.p1 > f.p0 ? (f.p1 - f.p0 - 1) * (int32_t)g.page_size + f.lst : 0;
    int32_t pos = seq_len - (f.end - f.start) + ((int32_t)i - f.start);
    if ((int32_t)i >= f.end || pos < 0) {
        set_err(err, KVP_ERANGE);
        return false;
    }
    int32_t page = __ldg(g.indices + f.p0 + page_of(g, pos));
    if ((uint32_t)page >= g.num_pages) {
        set_err(err, KVP_ERANGE);
        return false;
    }
    *page_out = page;
    *pos_out = pos;
    return true;
}

/* The fused append's lookup of token i: its request b from append_indptr, its position from
 * the page table, and the page id it goes to. False (reported in *err) when the token is
 * outside every request, its position negative, or its page id out of range. The lookup
 * first guesses b = i * B / nnz (b = i when every request appends one token: a decode
 * step), which is exact for decode steps and for equal-length prefills, and loads the
 * guess's page-table entries in the same round trip; only a wrong guess pays the binary
 * search. */
__device__ __forceinline__ bool fused_page_pos(const Geo &g, uint32_t i, uint32_t nnz,
                                               const int32_t *__restrict__ aip, int32_t *err,
                                               int32_t *page_out, int32_t *pos_out)
{
    return fused_rest(g, i, aip, err, fused_first(g, i, nnz, aip), page_out, pos_out);
}

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
 * flight between the two (the row kernel's unchecked guards). */
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

/* Item it (< a token's 2 * H * vecs; vector index fastest, then head, then K | V) of a
 * token: whether it is V (kv), its head and its vector. */
struct Item {
    uint32_t kv, h, vec;
};

template <int VECS> __device__ __forceinline__ Item item_of(const Geo &g, uint32_t it)
{
    const uint32_t vecs = VECS ? (uint32_t)VECS : g.vecs, per_kv = g.num_heads * vecs;
    Item m;
    m.kv = it >= per_kv;
    uint32_t r = it - m.kv * per_kv;
    m.h = r / vecs;
    m.vec = r - m.h * vecs;
    return m;
}

/* Item it's source vector (the token's rows at sk / sv). */
template <int VECS>
__device__ __forceinline__ const uint8_t *item_src(const Geo &g, const uint8_t *sk,
                                                   const uint8_t *sv, uint32_t it)
{
    const Item m = item_of<VECS>(g, it);
    return (m.kv ? sv + (int64_t)m.h * g.sv_h : sk + (int64_t)m.h * g.sk_h) + m.vec * 16;
}

/* Item it's place in the pool, for the token whose slot is dst (byte offset in K and V). */
template <int VECS>
__device__ __forceinline__ uint8_t *item_dst(const Geo &g, int64_t dst, uint32_t it)
{
    const Item m = item_of<VECS>(g, it);
    return (m.kv ? g.v : g.k) + dst + (int64_t)m.h * g.head_stride + m.vec * 16;
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
 * The small-batch copy (decode steps), the row kernel: a group of blockDim.x threads (whole
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
__device__ __forceinline__ void row_load_n(const Geo &g, const uint8_t *sk, const uint8_t *sv,
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

/* Stores what row_load_n loaded, at the slot dst (byte offset in the pool's K and V). */
template <int VECS, int N>
__device__ __forceinline__ void row_store_n(const Geo &g, int64_t dst, uint32_t first,
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

/* row_load_n with n vectors a thread: 1, 2 and 4 (the shapes row_block picks for decode
 * steps) each take a path of their own, without the unrolled tail's predicates. */
template <int VECS>
__device__ __forceinline__ void row_load(const Geo &g, const uint8_t *sk, const uint8_t *sv,
                                         uint32_t first, uint32_t step, uint32_t n, uint32_t flags,
                                         uint4 (&v)[kItems])
{
    if (n == 1)
        row_load_n<VECS, 1>(g, sk, sv, first, step, n, flags, v);
    else if (n == 2)
        row_load_n<VECS, 2>(g, sk, sv, first, step, n, flags, v);
    else if (n == 4)
        row_load_n<VECS, 4>(g, sk, sv, first, step, n, flags, v);
    else
        row_load_n<VECS, 0>(g, sk, sv, first, step, n, flags, v);
}

template <int VECS>
__device__ __forceinline__ void row_store(const Geo &g, int64_t dst, uint32_t first, uint32_t step,
                                          uint32_t n, uint32_t flags, const uint4 (&v)[kItems])
{
    if (n == 1)
        row_store_n<VECS, 1>(g, dst, first, step, n, flags, v);
    else if (n == 2)
        row_store_n<VECS, 2>(g, dst, first, step, n, flags, v);
    else if (n == 4)
        row_store_n<VECS, 4>(g, dst, first, step, n, flags, v);
    else
        row_store_n<VECS, 0>(g, dst, first, step, n, flags, v);
}

constexpr int kMaxRowTokens = 8;    /* opts.warps_per_block at most */
constexpr int kRowMaxThreads = 512; /* a block of the row kernel (128 registers a thread) */
constexpr int kCheckUnroll = 4;     /* tokens a thread validates at once (check_tokens) */

/* The checked row kernel's validation of every token by the nthr threads of a block, U
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

template <int VECS, int MODE>
__global__ void __launch_bounds__(kRowMaxThreads)
    copy_row_kernel(Geo g, const int32_t *__restrict__ bi, const int32_t *__restrict__ pos_arr,
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
        __shared__ int64_t s_dst[kMaxRowTokens];
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
            row_load<VECS>(g, sk, sv, tl, tpt, items, flags, v);
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
            row_store<VECS>(g, dst, tl, tpt, items, flags, v);
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
            row_load<VECS>(g, sk, sv, tl, tpt, items, flags, v);
        pdl_wait();
        if (dst >= 0 && *(volatile const int32_t *)gate == 0)
            row_store<VECS>(g, dst, tl, tpt, items, flags, v);
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
        row_load<VECS>(g, sk, sv, tl, tpt, items, flags, v);
        if (!pdl) {
            dst = token_rest<MODE>(g, i, aip, e, first);
            if (dst < 0)
                return;
        }
        row_store<VECS>(g, dst, tl, tpt, items, flags, v);
    }
}

/*
 * The flat copy (large batches of the unchecked, fused and slots forms): one 16-byte vector a
 * thread and a grid of all of them, no loop, no shared memory and no barrier, so the
 * occupancy alone hides the latencies. Each thread looks its token's destination up itself:
 * the lookup's loads are the same for the whole warp (one transaction each) and for the
 * token's other warps (L1 hits). Items are ordered as the row kernel's (vector index fastest,
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
        row_load_n<VECS, kItems>(g, sk, sv, base + lane, 32, kItems, 0, v);
        row_store_n<VECS, kItems>(g, dst, base + lane, 32, kItems, 0, v);
    }
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

/* The slots of a step (kvp_append_plan_slots_cuda): token i's pool slot (page id *
 * page_size + offset) by the fused lookup, or -1 (reported in *err) when it has none. */
__global__ void plan_slots_kernel(Geo g, const int32_t *__restrict__ aip, uint32_t nnz,
                                  int32_t *__restrict__ slots, int32_t *err)
{
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < nnz; i += gridDim.x * blockDim.x) {
        int32_t page, pos;
        slots[i] =
            fused_page_pos(g, i, nnz, aip, err, &page, &pos)
                ? page * (int32_t)g.page_size + (pos - page_of(g, pos) * (int32_t)g.page_size)
                : -1;
    }
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
    g->page_shift = (kv->page_size & (kv->page_size - 1)) ? -1 : __builtin_ctz(kv->page_size);
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
    uint32_t tpb, blocks_per_sm, hints;
    uint32_t row_tokens, items; /* the row kernel's tokens per block, vectors per thread
                                   (0: automatic, row_block) */
    uint32_t checked;           /* KVP_APPEND_CUDA_CHECKED_* */
};

static_assert(KVP_APPEND_CUDA_MAX_TPB == (uint32_t)kMaxTokens, "one bound, in the header");
static_assert(KVP_APPEND_CUDA_MAX_WARPS == (uint32_t)kMaxRowTokens, "one bound, in the header");
static_assert(KVP_APPEND_CUDA_MAX_ITEMS == (uint32_t)kItems, "one bound, in the header");

Knobs knobs(const kvp_append_cuda_opts_t *o)
{
    Knobs k = {};
    if (!o)
        return k;
    k.kernel = o->kernel;
    k.tpb = o->tokens_per_block;
    k.blocks_per_sm = o->blocks_per_sm;
    k.row_tokens = o->warps_per_block;
    k.items = o->vecs_per_thread;
    k.checked = o->checked;
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
void launch(void (*kern)(KArgs...), uint32_t grid, dim3 block, bool pdl, cudaStream_t s,
            Args... args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = block;
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

/* The row kernel's block for this call: (threads per token, tokens per block), or x == 0
 * when the row kernel does not take it (a token's row needs more than kItems vectors per
 * thread of a kRowMaxThreads block). Threads per token: whole warps covering the token's
 * 2 * H * vecs vectors at `items` each (fewer items when one token would need more than
 * kRowMaxThreads). Automatic shape (tests/bench/README.md, the sweep of issue #18 on the
 * H200): the fewest vectors per thread that keep the grid within kRowThreads threads (twice
 * that under PDL, whose prologue overlaps the previous kernel: more threads hide more of the
 * latency; for the checked one-launch form, whose blocks each validate every token, within
 * kRowThreads and kCheckedValidations blocks x tokens, else kRowThreads / 2), and one token
 * per block (four under PDL; for the checked form as many as make its validation one round of
 * kCheckUnroll tokens a thread). */
constexpr uint32_t kRowThreads = 65536;
constexpr uint64_t kCheckedValidations = 65536;

dim3 row_block(const Geo &g, const Knobs &kn, uint32_t nnz, bool pdl, bool checked, uint32_t *items)
{
    const uint32_t per_tok = 2 * g.num_heads * g.vecs;
    uint32_t it = kn.items;
    if (!it && checked && !kn.row_tokens) {
        /* Every block of the checked form validates every token, so its L2 reads grow with
         * blocks x tokens: the fewest vectors a thread whose grid stays within kRowThreads
         * threads and kCheckedValidations token validations (256 x 1 H8: one vector, 2.75 us
         * against 3.01 at two, same run), else the rule below with half the threads. */
        for (uint32_t c = 1; c <= (uint32_t)kItems && !it; c *= 2) {
            uint32_t t = ((per_tok + c - 1) / c + 31) / 32 * 32;
            if (t > (uint32_t)kRowMaxThreads || (uint64_t)nnz * t > kRowThreads)
                continue;
            uint32_t b = (nnz + kCheckUnroll * t - 1) / (kCheckUnroll * t);
            b = b > (uint32_t)kMaxRowTokens ? (uint32_t)kMaxRowTokens : b;
            while (b > 1 && t * b > (uint32_t)kRowMaxThreads)
                b--;
            if ((uint64_t)(nnz + b - 1) / b * nnz <= kCheckedValidations)
                it = c;
        }
    }
    if (!it) {
        const uint64_t budget = checked ? kRowThreads / 2 : pdl ? 2 * kRowThreads : kRowThreads;
        for (it = 1; it < (uint32_t)kItems; it *= 2)
            if ((uint64_t)nnz * (((per_tok + it - 1) / it + 31) / 32 * 32) <= budget)
                break;
    }
    if ((per_tok + it - 1) / it > (uint32_t)kRowMaxThreads)
        it = (per_tok + kRowMaxThreads - 1) / kRowMaxThreads;
    if (it > (uint32_t)kItems)
        return dim3(0, 0);
    uint32_t tpt = ((per_tok + it - 1) / it + 31) / 32 * 32;
    uint32_t tpb = kn.row_tokens;
    if (!tpb)
        tpb = checked ? (nnz + kCheckUnroll * tpt - 1) / (kCheckUnroll * tpt) : pdl ? 4 : 1;
    if (tpb > (uint32_t)kMaxRowTokens)
        tpb = kMaxRowTokens;
    while (tpb > 1 && tpt * tpb > (uint32_t)kRowMaxThreads)
        tpb--;
    *items = it;
    return dim3(tpt, tpb);
}

/* Decode-sized batches take the row kernel (kn.kernel auto), larger ones the block kernel,
 * or the flat kernel (launch_copy_t says when; it needs the batch's vectors to fit a 32-bit
 * index). */
bool row_sized(uint32_t nnz, const Knobs &kn)
{
    return kn.kernel == KVP_APPEND_CUDA_KERNEL_WARP ||
           (kn.kernel == KVP_APPEND_CUDA_KERNEL_AUTO && nnz <= 16 * num_sms());
}

bool flat_fits(const Geo &g, uint32_t nnz)
{
    return (uint64_t)nnz * 2 * g.num_heads * g.vecs + kThreads <= UINT32_MAX;
}

template <int VECS, int MODE>
void launch_copy_t(const Geo &g, const int32_t *bi, const int32_t *pos, const int32_t *aip,
                   uint32_t nnz, const int32_t *gate, int32_t *err, uint32_t flags, const Knobs &kn,
                   cudaStream_t s)
{
    flags |= kn.hints;
    if (MODE == kGated)
        flags |= kPdl; /* overlapped with validate_block_kernel */
    if (!device_has_pdl() || MODE == kChecked)
        flags &= ~(uint32_t)kPdl;
    const bool pdl = flags & kPdl;
    uint32_t items = 0;
    const dim3 rb = row_block(g, kn, nnz, pdl, MODE == kChecked, &items);
    if (MODE == kChecked || MODE == kGated || (!gate && rb.x && row_sized(nnz, kn))) {
        uint32_t blocks = (nnz + rb.y - 1) / rb.y;
        launch(copy_row_kernel<VECS, MODE>, blocks, rb, pdl, s, g, bi, pos, aip, nnz, items, gate,
               err, flags);
        return;
    }
    /* not reached for the row-only modes */
    constexpr int BM = MODE == kChecked || MODE == kGated ? kUnchecked : MODE;
    /* auto: the flat kernel for the slots form without PDL only (the H200, one run, prefill
     * rows: 0.96-0.97x FlashInfer against the block kernel's 0.97-1.00x; with PDL, or with
     * the fused and unchecked forms' longer per-thread lookups, it was 1-11% slower than the
     * block kernel, whose lookup runs once per token and whose grid is resident at once) */
    const bool block_knobs = kn.tpb || kn.blocks_per_sm; /* the block kernel's own */
    if (!gate && flat_fits(g, nnz) &&
        (kn.kernel == KVP_APPEND_CUDA_KERNEL_FLAT ||
         (kn.kernel == KVP_APPEND_CUDA_KERNEL_AUTO && !block_knobs && BM == kSlots && !pdl))) {
        const uint32_t per_tok = 2 * g.num_heads * g.vecs;
        const int32_t shift = (per_tok & (per_tok - 1)) ? -1 : __builtin_ctz(per_tok);
        const uint64_t n = (uint64_t)nnz * per_tok;
        launch(copy_flat_kernel<VECS, BM>, (uint32_t)((n + kThreads - 1) / kThreads),
               dim3(kThreads), pdl, s, g, bi, pos, aip, nnz, shift, err, flags);
        return;
    }
    uint32_t tpb = tokens_per_block(g, nnz, kn);
    uint64_t blocks = ((uint64_t)nnz + tpb - 1) / tpb;
    uint64_t cap = kn.blocks_per_sm ? (uint64_t)kn.blocks_per_sm * num_sms() : 65535u * 16u;
    if (blocks > cap)
        blocks = cap; /* the kernel loops over the rest */
    launch(copy_kernel<VECS, BM>, (uint32_t)blocks, dim3(kThreads), pdl, s, g, bi, pos, aip, nnz,
           tpb, gate, err, flags);
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

template <int MODE>
void launch_copy(const Geo &g, const int32_t *bi, const int32_t *pos, const int32_t *aip,
                 uint32_t nnz, const int32_t *gate, int32_t *err, uint32_t flags,
                 const kvp_append_cuda_opts_t *opts, cudaStream_t s)
{
    const Knobs kn = knobs(opts);
    with_vecs(g.vecs, [&](auto v) {
        launch_copy_t<decltype(v)::value, MODE>(g, bi, pos, aip, nnz, gate, err, flags, kn, s);
    });
}

/* The checked append's three ways, for a given call (KVP_APPEND_CUDA_CHECKED_* of opts):
 *   one launch (kChecked): every block of the row kernel validates every token; for the
 *     smallest batches (up to kCheckedOneLaunchMax tokens);
 *   validation block + gated copy (kGated): validate_block_kernel stores the verdict, the row
 *     kernel's copy runs right behind it under PDL and writes only on a 0 verdict; decode-
 *     sized batches up to kCheckedBlockMax tokens (one block validates them all);
 *   reset + validation kernel + gated block-kernel copy: the rest (prefills).
 * The first two need the row kernel to take the batch (row_sized, row_block). */
constexpr uint32_t kCheckedOneLaunchMax = KVP_APPEND_CUDA_CHECKED_ONE_MAX;
constexpr uint32_t kCheckedBlockMax = 4 * kThreads * kCheckUnroll; /* 4,096 */

enum CheckedWay { kWayOne, kWayBlock, kWayKernel };

CheckedWay checked_way(const Geo &g, uint32_t nnz, const kvp_append_cuda_opts_t *opts)
{
    const Knobs kn = knobs(opts);
    uint32_t items;
    if (!row_sized(nnz, kn) || !row_block(g, kn, nnz, false, true, &items).x)
        return kWayKernel;
    if (kn.checked == KVP_APPEND_CUDA_CHECKED_ONE)
        return nnz <= KVP_APPEND_CUDA_CHECKED_ONE_MAX ? kWayOne : kWayKernel;
    if (kn.checked == KVP_APPEND_CUDA_CHECKED_BLOCK)
        return nnz <= kCheckedBlockMax ? kWayBlock : kWayKernel;
    return nnz <= kCheckedOneLaunchMax ? kWayOne : nnz <= kCheckedBlockMax ? kWayBlock : kWayKernel;
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

/* Every instantiation a launcher can pick, for kvp_cuda_kernels_preload. */
template <int V> void add_copy_kernels(const void **f, unsigned *n)
{
    f[(*n)++] = reinterpret_cast<const void *>(copy_kernel<V, kUnchecked>);
    f[(*n)++] = reinterpret_cast<const void *>(copy_kernel<V, kFused>);
    f[(*n)++] = reinterpret_cast<const void *>(copy_kernel<V, kSlots>);
    f[(*n)++] = reinterpret_cast<const void *>(copy_flat_kernel<V, kUnchecked>);
    f[(*n)++] = reinterpret_cast<const void *>(copy_flat_kernel<V, kFused>);
    f[(*n)++] = reinterpret_cast<const void *>(copy_flat_kernel<V, kSlots>);
    f[(*n)++] = reinterpret_cast<const void *>(copy_row_kernel<V, kUnchecked>);
    f[(*n)++] = reinterpret_cast<const void *>(copy_row_kernel<V, kFused>);
    f[(*n)++] = reinterpret_cast<const void *>(copy_row_kernel<V, kChecked>);
    f[(*n)++] = reinterpret_cast<const void *>(copy_row_kernel<V, kSlots>);
    f[(*n)++] = reinterpret_cast<const void *>(copy_row_kernel<V, kGated>);
    f[(*n)++] = reinterpret_cast<const void *>(slots_kernel<V, kSlotsSmall>);
    f[(*n)++] = reinterpret_cast<const void *>(slots_kernel<V, KVP_APPEND_SLOTS_MAX>);
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
    const void *fns[96];
    unsigned n = 0;
    add_copy_kernels<0>(fns, &n);
    add_copy_kernels<4>(fns, &n);
    add_copy_kernels<8>(fns, &n);
    add_copy_kernels<16>(fns, &n);
    add_copy_kernels<32>(fns, &n);
    fns[n++] = reinterpret_cast<const void *>(validate_kernel);
    fns[n++] = reinterpret_cast<const void *>(validate_block_kernel);
    fns[n++] = reinterpret_cast<const void *>(plan_slots_kernel);
    fns[n++] = reinterpret_cast<const void *>(seq_lens_kernel);
    fns[n++] = reinterpret_cast<const void *>(batch_positions_kernel);
    fns[n++] = reinterpret_cast<const void *>(page_copy_kernel);
    int rc = 0;
    for (unsigned i = 0; i < n; i++)
        KVP_CUDA_TRY(cudaFuncGetAttributes(&a, fns[i]), rc, fail);
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
    const CheckedWay way = checked_way(g, nnz, opts);
    if (way == kWayOne) {
        /* validation and copy in one launch, which also writes *err_dev */
        launch_copy<kChecked>(g, batch_indices, positions, nullptr, nnz, nullptr, err_dev, 0, opts,
                              s);
        KVP_LAUNCH_TRY(rc, fail);
        return 0;
    }
    if (way == kWayBlock) {
        /* one validation block storing the verdict, the copy behind it under PDL */
        uint32_t threads = (nnz + kCheckUnroll - 1) / kCheckUnroll;
        threads = (threads + 31) / 32 * 32;
        validate_block_kernel<<<1, threads, 0, s>>>(g, batch_indices, positions, nnz, err_dev);
        KVP_LAUNCH_TRY(rc, fail);
        launch_copy<kGated>(g, batch_indices, positions, nullptr, nnz, err_dev, nullptr, 0, opts,
                            s);
        KVP_LAUNCH_TRY(rc, fail);
        return 0;
    }
    {
        uint32_t blocks = (nnz + kThreads * kCheckUnroll - 1) / (kThreads * kCheckUnroll);
        if (blocks > 4096)
            blocks = 4096;
        KVP_CUDA_TRY(cudaMemsetAsync(err_dev, 0, sizeof(int32_t), s), rc, fail);
        validate_kernel<<<blocks, kThreads, 0, s>>>(g, batch_indices, positions, nnz, err_dev);
        KVP_LAUNCH_TRY(rc, fail);
    }
    launch_copy<kUnchecked>(g, batch_indices, positions, nullptr, nnz, err_dev, err_dev, 0, opts,
                            s);
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
    launch_copy<kUnchecked>(g, batch_indices, positions, nullptr, nnz, nullptr, err_dev, 0, opts,
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

namespace
{
/* The fused and slots appends' one body: flags and opts checked, the geometry made, the
 * form's own arrays checked (idx: append_indptr or the slots), then the one launch. */
template <int MODE>
int pdl_form(const kvp_paged_kv_t *kv, const kvp_append_src_t *src, const int32_t *idx,
             uint32_t nnz, int32_t *err_dev, unsigned flags, const kvp_append_cuda_opts_t *opts,
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
    const bool ok = MODE == kFused
                        ? g.batch_size && kv->kv_indptr && kv->kv_indices && kv->kv_last_page_len
                        : (uint64_t)kv->num_pages * kv->page_size <= (uint64_t)INT32_MAX;
    if (!idx || !ok)
        return KVP_EINVAL;
    launch_copy<MODE>(g, nullptr, nullptr, idx, nnz, nullptr, err_dev,
                      (flags & KVP_CUDA_APPEND_PDL) ? (uint32_t)kPdl : 0u, opts,
                      static_cast<cudaStream_t>(stream));
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}
} // namespace

extern "C" int kvp_append_paged_kv_cache_fused_cuda_opts(const kvp_paged_kv_t *kv,
                                                         const kvp_append_src_t *src,
                                                         const int32_t *append_indptr, uint32_t nnz,
                                                         int32_t *err_dev, unsigned flags,
                                                         const kvp_append_cuda_opts_t *opts,
                                                         void *stream)
{
    return pdl_form<kFused>(kv, src, append_indptr, nnz, err_dev, flags, opts, stream);
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

extern "C" int kvp_append_plan_slots_cuda(const kvp_paged_kv_t *kv, const int32_t *append_indptr,
                                          uint32_t nnz, int32_t *slots_dev, int32_t *err_dev,
                                          void *stream)
{
    if (nnz == 0)
        return 0;
    Geo g;
    int rc = make_geo(kv, nullptr, &g);
    if (rc)
        return rc;
    if (!append_indptr || !slots_dev || !g.batch_size || !kv->kv_indptr || !kv->kv_indices ||
        !kv->kv_last_page_len || (uint64_t)kv->num_pages * kv->page_size > (uint64_t)INT32_MAX)
        return KVP_EINVAL;
    uint32_t blocks = (nnz + kThreads - 1) / kThreads;
    if (blocks > 4096)
        blocks = 4096;
    plan_slots_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        g, append_indptr, nnz, slots_dev, err_dev);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

extern "C" int kvp_append_paged_kv_cache_slots_cuda(
    const kvp_paged_kv_t *kv, const kvp_append_src_t *src, const int32_t *slots_dev, uint32_t nnz,
    int32_t *err_dev, unsigned flags, const kvp_append_cuda_opts_t *opts, void *stream)
{
    return pdl_form<kSlots>(kv, src, slots_dev, nnz, err_dev, flags, opts, stream);
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
