/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_append_cuda_shape.cuh - the launch shape of the CUDA append, host side only: the
 * caller's knobs (kvp_append_cuda_opts_t, from [tuning] append_* or a benchmark's flags), and
 * from them and the batch which copy kernel a call takes and with what grid (copy_shape), which
 * of its three ways a checked append takes (checked_way), the row widths the kernels are
 * specialised for (with_vecs) and the inline kernel's two slot capacities. Pure arithmetic plus
 * two cached device attributes; no launch (kvp_append_cuda.cu launches what this chooses).
 * The automatic shapes are the ones tests/bench/README.md measured on the H200.
 */
#ifndef KVP_APPEND_CUDA_SHAPE_CUH
#define KVP_APPEND_CUDA_SHAPE_CUH

#include <type_traits>

#include "kvp_append_cuda_copy.cuh"

namespace
{

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
    uint32_t warp_tokens, items; /* the warp kernel's tokens per block, vectors per thread
                                   (0: automatic, warp_block) */
    uint32_t checked;            /* KVP_APPEND_CUDA_CHECKED_* */
};

static_assert(KVP_APPEND_CUDA_MAX_TPB == (uint32_t)kMaxTokens, "one bound, in the header");
static_assert(KVP_APPEND_CUDA_MAX_WARPS == (uint32_t)kMaxWarpTokens, "one bound, in the header");
static_assert(KVP_APPEND_CUDA_MAX_ITEMS == (uint32_t)kItems, "one bound, in the header");

Knobs knobs(const kvp_append_cuda_opts_t *o)
{
    Knobs k = {};
    if (!o)
        return k;
    k.kernel = o->kernel;
    k.tpb = o->tokens_per_block;
    k.blocks_per_sm = o->blocks_per_sm;
    k.warp_tokens = o->warps_per_block;
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

/* The warp kernel's block for this call: (threads per token, tokens per block), or x == 0
 * when the warp kernel does not take it (a token's row needs more than kItems vectors per
 * thread of a kWarpMaxThreads block). Threads per token: whole warps covering the token's
 * 2 * H * vecs vectors at `items` each (fewer items when one token would need more than
 * kWarpMaxThreads). Automatic shape (tests/bench/README.md, the sweep of issue #18 on the
 * H200): the fewest vectors per thread that keep the grid within kWarpThreads threads (twice
 * that under PDL, whose prologue overlaps the previous kernel: more threads hide more of the
 * latency; for the checked one-launch form, whose blocks each validate every token, within
 * kWarpThreads and kCheckedValidations blocks x tokens, else kWarpThreads / 2), and one token
 * per block (four under PDL; for the checked form as many as make its validation one round of
 * kCheckUnroll tokens a thread). */
constexpr uint32_t kWarpThreads = 65536;
constexpr uint64_t kCheckedValidations = 65536;

dim3 warp_block(const Geo &g, const Knobs &kn, uint32_t nnz, bool pdl, bool checked,
                uint32_t *items)
{
    const uint32_t per_tok = 2 * g.num_heads * g.vecs;
    uint32_t it = kn.items;
    if (!it && checked && !kn.warp_tokens) {
        /* Every block of the checked form validates every token, so its L2 reads grow with
         * blocks x tokens: the fewest vectors a thread whose grid stays within kWarpThreads
         * threads and kCheckedValidations token validations (256 x 1 H8: one vector, 2.75 us
         * against 3.01 at two, same run), else the rule below with half the threads. */
        for (uint32_t c = 1; c <= (uint32_t)kItems && !it; c *= 2) {
            uint32_t t = ((per_tok + c - 1) / c + 31) / 32 * 32;
            if (t > (uint32_t)kWarpMaxThreads || (uint64_t)nnz * t > kWarpThreads)
                continue;
            uint32_t b = (nnz + kCheckUnroll * t - 1) / (kCheckUnroll * t);
            b = b > (uint32_t)kMaxWarpTokens ? (uint32_t)kMaxWarpTokens : b;
            while (b > 1 && t * b > (uint32_t)kWarpMaxThreads)
                b--;
            if ((uint64_t)(nnz + b - 1) / b * nnz <= kCheckedValidations)
                it = c;
        }
    }
    if (!it) {
        const uint64_t budget = checked ? kWarpThreads / 2 : pdl ? 2 * kWarpThreads : kWarpThreads;
        for (it = 1; it < (uint32_t)kItems; it *= 2)
            if ((uint64_t)nnz * (((per_tok + it - 1) / it + 31) / 32 * 32) <= budget)
                break;
    }
    if ((per_tok + it - 1) / it > (uint32_t)kWarpMaxThreads)
        it = (per_tok + kWarpMaxThreads - 1) / kWarpMaxThreads;
    if (it > (uint32_t)kItems)
        return dim3(0, 0);
    uint32_t tpt = ((per_tok + it - 1) / it + 31) / 32 * 32;
    uint32_t tpb = kn.warp_tokens;
    if (!tpb)
        tpb = checked ? (nnz + kCheckUnroll * tpt - 1) / (kCheckUnroll * tpt) : pdl ? 4 : 1;
    if (tpb > (uint32_t)kMaxWarpTokens)
        tpb = kMaxWarpTokens;
    while (tpb > 1 && tpt * tpb > (uint32_t)kWarpMaxThreads)
        tpb--;
    *items = it;
    return dim3(tpt, tpb);
}

/* Decode-sized batches take the warp kernel (kn.kernel auto), larger ones the block kernel,
 * or the flat kernel (launch_copy_t says when; it needs the batch's vectors to fit a 32-bit
 * index). */
bool warp_sized(uint32_t nnz, const Knobs &kn)
{
    return kn.kernel == KVP_APPEND_CUDA_KERNEL_WARP ||
           (kn.kernel == KVP_APPEND_CUDA_KERNEL_AUTO && nnz <= 16 * num_sms());
}

bool flat_fits(const Geo &g, uint32_t nnz)
{
    return (uint64_t)nnz * 2 * g.num_heads * g.vecs + kThreads <= UINT32_MAX;
}

/* The copy kernels a launch can take (kvp_append_cuda_copy.cuh), and the shape of one launch. */
enum CopyKernel { kBlockKernel, kWarpKernel, kFlatKernel };

struct CopyShape {
    CopyKernel kernel;
    uint32_t grid;
    dim3 block;
    uint32_t items;    /* warp kernel: vectors per thread */
    int32_t tok_shift; /* flat kernel: log2(2 * H * vecs), or -1 */
    uint32_t tpb;      /* block kernel: tokens per block */
    uint32_t flags;    /* the kernel's k* flags: the hints added, PDL where the device has it */
};

/* The kernel and grid of one copy of mode `mode` (Mode; gated: *gate decides whether it
 * writes, the checked append's prefill way), from the caller's flags (kPdl) and knobs.
 * Decode-sized batches take the warp kernel (auto), larger ones the block kernel, or the flat
 * kernel for the slots form without PDL (the H200, one run, prefill rows: 0.96-0.97x
 * FlashInfer against the block kernel's 0.97-1.00x; with PDL, or with the fused and unchecked
 * forms' longer per-thread lookups, it was 1-11% slower than the block kernel, whose lookup
 * runs once per token and whose grid is resident at once). The checked and gated modes always
 * take the warp kernel (checked_way sends the others to the gated block kernel). */
CopyShape copy_shape(const Geo &g, int mode, uint32_t nnz, bool gated, uint32_t flags,
                     const Knobs &kn)
{
    CopyShape sh = {};
    flags |= kn.hints;
    if (mode == kGated)
        flags |= kPdl; /* overlapped with validate_block_kernel */
    if (!device_has_pdl() || mode == kChecked)
        flags &= ~(uint32_t)kPdl;
    sh.flags = flags;
    const bool pdl = flags & kPdl;
    const dim3 rb = warp_block(g, kn, nnz, pdl, mode == kChecked, &sh.items);
    if (mode == kChecked || mode == kGated || (!gated && rb.x && warp_sized(nnz, kn))) {
        sh.kernel = kWarpKernel;
        sh.grid = (nnz + rb.y - 1) / rb.y;
        sh.block = rb;
        return sh;
    }
    const int bm = mode == kChecked || mode == kGated ? kUnchecked : mode;
    const bool block_knobs = kn.tpb || kn.blocks_per_sm; /* the block kernel's own */
    if (!gated && flat_fits(g, nnz) &&
        (kn.kernel == KVP_APPEND_CUDA_KERNEL_FLAT ||
         (kn.kernel == KVP_APPEND_CUDA_KERNEL_AUTO && !block_knobs && bm == kSlots && !pdl))) {
        const uint32_t per_tok = 2 * g.num_heads * g.vecs;
        const uint64_t n = (uint64_t)nnz * per_tok;
        sh.kernel = kFlatKernel;
        sh.tok_shift = (per_tok & (per_tok - 1)) ? -1 : __builtin_ctz(per_tok);
        sh.grid = (uint32_t)((n + kThreads - 1) / kThreads);
        sh.block = dim3(kThreads);
        return sh;
    }
    sh.kernel = kBlockKernel;
    sh.tpb = tokens_per_block(g, nnz, kn);
    uint64_t blocks = ((uint64_t)nnz + sh.tpb - 1) / sh.tpb;
    uint64_t cap = kn.blocks_per_sm ? (uint64_t)kn.blocks_per_sm * num_sms() : 65535u * 16u;
    if (blocks > cap)
        blocks = cap; /* the kernel loops over the rest */
    sh.grid = (uint32_t)blocks;
    sh.block = dim3(kThreads);
    return sh;
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

/* The checked append's three ways, for a given call (KVP_APPEND_CUDA_CHECKED_* of opts):
 *   one launch (kChecked): every block of the warp kernel validates every token; for the
 *     smallest batches (up to kCheckedOneLaunchMax tokens);
 *   validation block + gated copy (kGated): validate_block_kernel stores the verdict, the warp
 *     kernel's copy runs right behind it under PDL and writes only on a 0 verdict; decode-
 *     sized batches up to kCheckedBlockMax tokens (one block validates them all);
 *   reset + validation kernel + gated block-kernel copy: the rest (prefills).
 * The first two need the warp kernel to take the batch (warp_sized, warp_block). */
constexpr uint32_t kCheckedOneLaunchMax = KVP_APPEND_CUDA_CHECKED_ONE_MAX;
constexpr uint32_t kCheckedBlockMax = 4 * kThreads * kCheckUnroll; /* 4,096 */

enum CheckedWay { kWayOne, kWayBlock, kWayKernel };

CheckedWay checked_way(const Geo &g, uint32_t nnz, const kvp_append_cuda_opts_t *opts)
{
    const Knobs kn = knobs(opts);
    uint32_t items;
    if (!warp_sized(nnz, kn) || !warp_block(g, kn, nnz, false, true, &items).x)
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
constexpr uint32_t kInlineSmall = 256;
constexpr uint32_t kInlineLarge = KVP_APPEND_SLOTS_MAX;
static_assert(KVP_APPEND_SLOTS_MAX > kInlineSmall, "two capacities");

} // namespace

#endif
