/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_append_cuda.cu - the CUDA append's entry point (kvp_append_cuda, kvp_kernels_cuda.h) and
 * the one list of its kernel instantiations, from which both the launches and the eager-load
 * table (kvp_cuda_kernels_preload) take their kernels. The three layers of NCCL and ggml-cuda:
 * the __global__ kernels (kvp_append_cuda_copy.cuh, kvp_append_cuda_check.cuh), the launchers
 * here on an explicit stream with the shape kvp_append_cuda_shape.cuh chooses, and the
 * exported C entry point that validates what the host can see. libkvpool's older append entry
 * points are one-line wrappers over kvp_append_cuda (kvp_append_cuda_compat.c); the page-table
 * helpers and page copies are kvp_table_cuda.cu's.
 *
 * A new kernel variant (a kernel, a destination mode or a row width) touches three places:
 *   1. the kernel or the mode's device code: kvp_append_cuda_copy.cuh (a mode's lookup in
 *      token_first/token_rest there, its Mode value in kvp_append_cuda_dev.cuh);
 *   2. its row in KVP_APPEND_KERNELS below: the launchers can only name a kernel through that
 *      list (KVP_KERNEL), so an instantiation missing from it does not compile, and the same
 *      list fills the eager-load table, so nothing launched can be missing there (lazy loading
 *      would bring back the cross-stream deadlock of DESIGN.md §4);
 *   3. when to take it: copy_shape / checked_way in kvp_append_cuda_shape.cuh (a new
 *      destination form also gets its case in kvp_append_cuda below, and a new row width its
 *      case in with_vecs and in KVP_APPEND_KERNELS' widths).
 * Names: the kernels are copy_block_kernel, copy_warp_kernel, copy_flat_kernel (the "block",
 * "warp" and "flat" of [tuning] append_kernel and KVP_APPEND_CUDA_KERNEL_*; the config's
 * append_warps_per_block and append_vecs_per_thread are the warp kernel's tokens per block and
 * vectors per thread) and copy_inline_kernel (the slots carried in the launch,
 * KVP_APPEND_CUDA_HOST_DEST); "slots" is always a pool slot, page id * page_size + offset.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "kvp_append_cuda_shape.cuh"
#include "kvp_cuda_err.h"
#include "kvp_kernels_cuda.h"

namespace
{

/* ---- the kernels' one list --------------------------------------------------------------- */

enum : int {
    kKind_copy_block_kernel,
    kKind_copy_warp_kernel,
    kKind_copy_flat_kernel,
    kKind_copy_inline_kernel
};

/* Every copy-kernel instantiation a launcher can pick, per row width V: X(kernel, V, mode or
 * slot capacity). The block and flat kernels serve the unchecked, fused and slots modes (the
 * checked append's prefill way runs the unchecked block kernel gated); the warp kernel every
 * mode; the inline kernel its two capacities. */
#define KVP_APPEND_COPY_KERNELS(X, V)                                                              \
    X(copy_block_kernel, V, kUnchecked)                                                            \
    X(copy_block_kernel, V, kFused)                                                                \
    X(copy_block_kernel, V, kSlots)                                                                \
    X(copy_flat_kernel, V, kUnchecked)                                                             \
    X(copy_flat_kernel, V, kFused)                                                                 \
    X(copy_flat_kernel, V, kSlots)                                                                 \
    X(copy_warp_kernel, V, kUnchecked)                                                             \
    X(copy_warp_kernel, V, kFused)                                                                 \
    X(copy_warp_kernel, V, kChecked)                                                               \
    X(copy_warp_kernel, V, kSlots)                                                                 \
    X(copy_warp_kernel, V, kGated)                                                                 \
    X(copy_inline_kernel, V, kInlineSmall)                                                         \
    X(copy_inline_kernel, V, kInlineLarge)

/* ... for every row width the kernels are specialised for (with_vecs: 4, 8, 16, 32 vectors,
 * 0 the generic form). */
#define KVP_APPEND_KERNELS(X)                                                                      \
    KVP_APPEND_COPY_KERNELS(X, 0)                                                                  \
    KVP_APPEND_COPY_KERNELS(X, 4)                                                                  \
    KVP_APPEND_COPY_KERNELS(X, 8)                                                                  \
    KVP_APPEND_COPY_KERNELS(X, 16)                                                                 \
    KVP_APPEND_COPY_KERNELS(X, 32)

/* The kernels that are not templates (the checked append's validation). */
#define KVP_APPEND_PLAIN_KERNELS(Y) Y(validate_kernel) Y(validate_block_kernel)

/* Listed<kind, V, M>::fn() is the listed instantiation; an unlisted one is an incomplete type,
 * a compile error at the launch that names it. */
template <int KIND, int V, uint32_t M> struct Listed;
#define KVP_LISTED(k, v, m)                                                                        \
    template <> struct Listed<kKind_##k, v, (uint32_t)(m)> {                                       \
        static decltype(&k<v, m>) fn()                                                             \
        {                                                                                          \
            return &k<v, m>;                                                                       \
        }                                                                                          \
    };
KVP_APPEND_KERNELS(KVP_LISTED)
#undef KVP_LISTED

#define KVP_KERNEL(k, v, m) (Listed<kKind_##k, v, (uint32_t)(m)>::fn())

#define KVP_COUNT(...) +1
constexpr unsigned kNumKernels =
    0 KVP_APPEND_KERNELS(KVP_COUNT) KVP_APPEND_PLAIN_KERNELS(KVP_COUNT);
#undef KVP_COUNT
static_assert(kNumKernels == 5 * 13 + 2, "five row widths of 13 copy kernels, two validations");

/* ---- launchers --------------------------------------------------------------------------- */

/* Launches kern<<<grid, block, 0, s>>>(args...), with programmatic stream serialization when
 * pdl is set (the kernel then waits for its predecessor with griddepcontrol.wait itself). */
template <typename... KArgs, typename... Args>
void launch(void (*kern)(KArgs...), dim3 grid, dim3 block, bool pdl, cudaStream_t s, Args... args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
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

template <int VECS, int MODE>
void launch_copy_t(const Geo &g, const int32_t *bi, const int32_t *pos, const int32_t *aip,
                   uint32_t nnz, const int32_t *gate, int32_t *err, uint32_t flags, const Knobs &kn,
                   cudaStream_t s)
{
    const CopyShape sh = copy_shape(g, MODE, nnz, gate != nullptr, flags, kn);
    const bool pdl = sh.flags & kPdl;
    /* the block and flat kernels never take the checked or gated modes (copy_shape) */
    constexpr int BM = MODE == kChecked || MODE == kGated ? kUnchecked : MODE;
    switch (sh.kernel) {
    case kWarpKernel:
        launch(KVP_KERNEL(copy_warp_kernel, VECS, MODE), sh.grid, sh.block, pdl, s, g, bi, pos, aip,
               nnz, sh.items, gate, err, sh.flags);
        break;
    case kFlatKernel:
        launch(KVP_KERNEL(copy_flat_kernel, VECS, BM), sh.grid, sh.block, pdl, s, g, bi, pos, aip,
               nnz, sh.tok_shift, err, sh.flags);
        break;
    case kBlockKernel:
        launch(KVP_KERNEL(copy_block_kernel, VECS, BM), sh.grid, sh.block, pdl, s, g, bi, pos, aip,
               nnz, sh.tpb, gate, err, sh.flags);
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

template <int VECS, uint32_t CAP>
void launch_inline_t(const Geo &g, const int32_t *slots, uint32_t nnz, uint32_t num_layers,
                     int64_t layer_stride, int64_t src_layer_stride, cudaStream_t s)
{
    InlineSlots<CAP> in;
    memcpy(in.slot, slots, (size_t)nnz * sizeof(int32_t));
    const dim3 grid((nnz + kInlineWarps - 1) / kInlineWarps, num_layers);
    launch(KVP_KERNEL(copy_inline_kernel, VECS, CAP), grid, dim3(32 * kInlineWarps), false, s, g,
           in, nnz, layer_stride, src_layer_stride);
}

void launch_inline(const Geo &g, const int32_t *slots, uint32_t nnz, uint32_t num_layers,
                   int64_t layer_stride, int64_t src_layer_stride, cudaStream_t s)
{
    with_vecs(g.vecs, [&](auto v) {
        constexpr int V = decltype(v)::value;
        if (nnz <= kInlineSmall)
            launch_inline_t<V, kInlineSmall>(g, slots, nnz, num_layers, layer_stride,
                                             src_layer_stride, s);
        else
            launch_inline_t<V, kInlineLarge>(g, slots, nnz, num_layers, layer_stride,
                                             src_layer_stride, s);
    });
}

/* ---- the forms ---------------------------------------------------------------------------- */

/* The checked tokens form: one launch, a validation block and the gated copy, or a reset, the
 * validation kernel and the gated copy (checked_way). */
int append_checked(const Geo &g, const int32_t *bi, const int32_t *pos, uint32_t nnz,
                   int32_t *err_dev, const kvp_append_cuda_opts_t *opts, cudaStream_t s)
{
    int rc = 0;
    const CheckedWay way = checked_way(g, nnz, opts);
    if (way == kWayOne) {
        /* validation and copy in one launch, which also writes *err_dev */
        launch_copy<kChecked>(g, bi, pos, nullptr, nnz, nullptr, err_dev, 0, opts, s);
        KVP_LAUNCH_TRY(rc, fail);
        return 0;
    }
    if (way == kWayBlock) {
        /* one validation block storing the verdict, the copy behind it under PDL */
        uint32_t threads = (nnz + kCheckUnroll - 1) / kCheckUnroll;
        threads = (threads + 31) / 32 * 32;
        validate_block_kernel<<<1, threads, 0, s>>>(g, bi, pos, nnz, err_dev);
        KVP_LAUNCH_TRY(rc, fail);
        launch_copy<kGated>(g, bi, pos, nullptr, nnz, err_dev, nullptr, 0, opts, s);
        KVP_LAUNCH_TRY(rc, fail);
        return 0;
    }
    {
        uint32_t blocks = (nnz + kThreads * kCheckUnroll - 1) / (kThreads * kCheckUnroll);
        if (blocks > 4096)
            blocks = 4096;
        KVP_CUDA_TRY(cudaMemsetAsync(err_dev, 0, sizeof(int32_t), s), rc, fail);
        validate_kernel<<<blocks, kThreads, 0, s>>>(g, bi, pos, nnz, err_dev);
        KVP_LAUNCH_TRY(rc, fail);
    }
    launch_copy<kUnchecked>(g, bi, pos, nullptr, nnz, err_dev, err_dev, 0, opts, s);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

/* The host-slots form: every slot checked here, then one launch over all the layers. */
int append_inline(const kvp_paged_kv_t *kv, const Geo &g, const int32_t *slots, uint32_t nnz,
                  const kvp_append_cuda_args_t *a, cudaStream_t s)
{
    const uint32_t num_layers = a->num_layers ? a->num_layers : 1;
    if (nnz > KVP_APPEND_SLOTS_MAX || num_layers > 65535u || a->layer_stride_bytes % 16 ||
        a->src_layer_stride_bytes % 16 || a->layer_stride_bytes > (uint64_t)INT64_MAX ||
        a->src_layer_stride_bytes > (uint64_t)INT64_MAX)
        return KVP_EINVAL;
    if (num_layers > 1 && !a->layer_stride_bytes)
        return KVP_EINVAL; /* every layer would write the same slots */
    const int64_t cap = (int64_t)kv->num_pages * kv->page_size;
    for (uint32_t i = 0; i < nnz; i++)
        if (slots[i] >= cap)
            return KVP_ERANGE; /* checked before anything is queued */
    int rc = 0;
    launch_inline(g, slots, nnz, num_layers, (int64_t)a->layer_stride_bytes,
                  (int64_t)a->src_layer_stride_bytes, s);
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

} // namespace

/* libkvpool exports the older entry points (kvp_append_cuda_compat.c) but calls only
 * kvp_append_cuda: this reference pulls their object out of the archive into every link that
 * takes this one, as when they lived here (kvp_cuda_stub.c does the same without CUDA). */
__attribute__((used)) static const void *const kvp_compat_anchor =
    reinterpret_cast<const void *>(&kvp_append_paged_kv_cache_cuda);

extern "C" int kvp__cuda_pack_preload(void);   /* kvp_pack_cuda.cu */
extern "C" int kvp__cuda_table_preload(void);  /* kvp_table_cuda.cu */
extern "C" int kvp__cuda_gather_preload(void); /* kvp_gather_cuda.cu */
extern "C" int kvp__cuda_slots_preload(void);  /* kvp_slots_cuda.cu */

extern "C" int kvp_cuda_available(void)
{
    return 1;
}

extern "C" int kvp_cuda_kernels_preload(void)
{
#define KVP_EAGER(k, v, m) reinterpret_cast<const void *>(KVP_KERNEL(k, v, m)),
#define KVP_EAGER_PLAIN(k) reinterpret_cast<const void *>(&k),
    const void *const fns[] = {KVP_APPEND_KERNELS(KVP_EAGER)
                                   KVP_APPEND_PLAIN_KERNELS(KVP_EAGER_PLAIN)};
#undef KVP_EAGER
#undef KVP_EAGER_PLAIN
    static_assert(sizeof(fns) / sizeof(fns[0]) == kNumKernels, "one entry per listed kernel");
    cudaFuncAttributes a;
    int rc = 0;
    for (const void *f : fns)
        KVP_CUDA_TRY(cudaFuncGetAttributes(&a, f), rc, fail);
    if ((rc = kvp__cuda_table_preload()) || (rc = kvp__cuda_gather_preload()) ||
        (rc = kvp__cuda_slots_preload()))
        return rc;
    return kvp__cuda_pack_preload();
fail:
    return rc;
}

extern "C" int kvp_append_cuda(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                               const kvp_append_dest_t *dest, const kvp_append_cuda_args_t *args,
                               void *stream)
{
    static const kvp_append_cuda_args_t none = {};
    const kvp_append_cuda_args_t *a = args ? args : &none;
    const uint32_t flags = a->flags;
    if (!dest || dest->kind > KVP_APPEND_DEST_SLOTS || kvp_append_cuda_opts_check(a->shape) ||
        (flags &
         ~(uint32_t)(KVP_CUDA_APPEND_PDL | KVP_APPEND_CUDA_CHECKED | KVP_APPEND_CUDA_HOST_DEST)))
        return KVP_EINVAL;
    const bool checked = flags & KVP_APPEND_CUDA_CHECKED, host = flags & KVP_APPEND_CUDA_HOST_DEST;
    if ((checked && dest->kind != KVP_APPEND_DEST_TOKENS) ||
        (host && dest->kind != KVP_APPEND_DEST_SLOTS) ||
        ((flags & KVP_CUDA_APPEND_PDL) && (checked || host)))
        return KVP_EINVAL;
    const uint32_t nnz = dest->nnz;
    if (nnz == 0)
        return 0;
    Geo g;
    int rc = make_geo(kv, src, &g);
    if (rc)
        return rc;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const uint32_t kflags = (flags & KVP_CUDA_APPEND_PDL) ? (uint32_t)kPdl : 0u;
    const bool table = kv->kv_indptr && kv->kv_indices && kv->kv_last_page_len;
    switch (dest->kind) {
    case KVP_APPEND_DEST_TOKENS:
        if (!dest->batch_indices || !dest->positions || !table || (checked && !a->err_dev))
            return KVP_EINVAL;
        if (checked)
            return append_checked(g, dest->batch_indices, dest->positions, nnz, a->err_dev,
                                  a->shape, s);
        launch_copy<kUnchecked>(g, dest->batch_indices, dest->positions, nullptr, nnz, nullptr,
                                a->err_dev, kflags, a->shape, s);
        break;
    case KVP_APPEND_DEST_FUSED:
        if (!dest->append_indptr || !g.batch_size || !table)
            return KVP_EINVAL;
        launch_copy<kFused>(g, nullptr, nullptr, dest->append_indptr, nnz, nullptr, a->err_dev,
                            kflags, a->shape, s);
        break;
    default: /* KVP_APPEND_DEST_SLOTS */
        if (!dest->slots || (uint64_t)kv->num_pages * kv->page_size > (uint64_t)INT32_MAX)
            return KVP_EINVAL;
        if (host)
            return append_inline(kv, g, dest->slots, nnz, a, s);
        launch_copy<kSlots>(g, nullptr, nullptr, dest->slots, nnz, nullptr, a->err_dev, kflags,
                            a->shape, s);
        break;
    }
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}
