/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_append_cuda_dev.cuh - the device helpers of the CUDA append (kvp_kernels_cuda.h): the
 * geometry a kernel gets by value (Geo, and make_geo that fills it from the public structs),
 * PDL and cache-hinted loads and stores, slot and page arithmetic, the fused lookup of a token's
 * request and position from append_indptr, and the (K|V, head, vector) decomposition of a
 * token's items. No kernel and no launch here: the copy kernels are in kvp_append_cuda_copy.cuh,
 * the validation in kvp_append_cuda_check.cuh, the launch shape in kvp_append_cuda_shape.cuh and
 * the entry points in kvp_append_cuda.cu. Everything is in an anonymous namespace: each .cu
 * that includes it has its own copy, and only kvp_append_cuda.cu instantiates copy kernels.
 */
#ifndef KVP_APPEND_CUDA_DEV_CUH
#define KVP_APPEND_CUDA_DEV_CUH

#include <cuda_runtime.h>
#include <stdint.h>

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

/* Where a copy kernel's token i goes (the public kvp_append_dest_t, and how the tokens form is
 * checked): the modes a copy kernel is instantiated for (kvp_append_cuda.cu's table). */
enum Mode : int {
    kUnchecked = 0, /* batch_indices/positions given; per-row guards */
    kFused = 1,     /* request and position from append_indptr and the page table */
    kChecked = 2,   /* batch_indices/positions, every token validated before any write */
    kSlots = 3,     /* the pool slot given (kvp_append_dest_t's slots, a device array) */
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

/* ---- host side: the geometry from the public structs ---------------------------------- */

inline bool aligned16(const void *p)
{
    return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

/* Fills g from the public structs; KVP_EINVAL when the host can already see it is wrong. */
inline int make_geo(const kvp_paged_kv_t *kv, const kvp_append_src_t *src, Geo *g)
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

} // namespace

#endif
