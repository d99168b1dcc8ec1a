/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_kernels_cuda.h - the CUDA forms of kvp_kernels.h: the same argument structs (device
 * pointers in them), the same meaning (FlashInfer's append_paged_kv_cache), an explicit stream.
 *
 * Every entry point only enqueues work: no host-device synchronisation, no host reads of
 * device arrays, no allocation, so each is safe inside CUDA-graph capture. Argument checks
 * that need the device arrays run on the device:
 *   - the checked append (kvp_append_paged_kv_cache_cuda) validates every token before it
 *     writes any, so a bad position, batch index or page id writes nothing at all (DESIGN.md
 *     §1); the reason lands in *err_dev (a KVP_E* code, 0 when fine; the caller reads it
 *     whenever it likes, e.g. after its own sync). The smallest appends are one launch whose
 *     every block checks every token, so all blocks reach the same verdict without a
 *     grid-wide barrier; other decode-sized ones run one validation block and the copy right
 *     behind it (overlapped by PDL on sm_90), writing only on a clean verdict; larger ones a
 *     validation kernel, then the copy gated the same way;
 *   - the fused append computes each token's request and position from append_indptr inside
 *     the same launch (one launch per layer on the decode path); positions are right by
 *     construction, and a page id out of range makes that row skipped (never written out of
 *     bounds) and is reported in *err_dev.
 * Host-side checks (NULL pointers, sizes, strides, alignment: every row must be a multiple of
 * 16 bytes and 16-byte aligned, since the copy moves 16-byte vectors) return KVP_EINVAL before
 * anything is enqueued. A CUDA failure (the launch, or a call such as cudaMemsetAsync) returns
 * the code cuda/'s kvp_cuda_code gives it and is recorded as the calling thread's last CUDA
 * error, with this library's file and line and CUDA's error name ("kernels/kvp_append_cuda.cu:
 * 790 kernel launch: invalid argument (cudaErrorInvalidValue)": kvp_cuda_last_error, in
 * libkvpool kvp_last_cuda_error), and handed to the process's CUDA log hook (kvpoold logs it).
 * Host-side refusals are not recorded: the code says it all.
 *
 * Kernels are loaded eagerly by kvp_cuda_kernels_preload(): call it once per process before
 * any cross-stream wait is enqueued (lazy module loading deadlocks such waits, DESIGN.md §4).
 * Streams are cudaStream_t passed as void * so that this header needs no CUDA header.
 */
#ifndef KVP_KERNELS_CUDA_H
#define KVP_KERNELS_CUDA_H

#include "kvp_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when this library was built with CUDA (the functions below exist and work), else 0. */
int kvp_cuda_available(void);

/* Loads every kernel of this library in the current device's context (cudaFuncGetAttributes
 * on each). Returns 0 or the failing call's code (recorded as above: no device, driver
 * error). */
int kvp_cuda_kernels_preload(void);

/* The shape of the copy kernels the appends below launch, chosen by the caller (the daemon
 * from its [tuning] keys, a benchmark from its flags; nothing here reads the environment).
 * NULL, or a field 0: automatic, the shapes tests/bench/README.md measured and chose. A field
 * out of range makes the entry point return KVP_EINVAL before anything is queued. */
typedef struct {
    uint32_t kernel;           /* KVP_APPEND_CUDA_KERNEL_*: force the warp, block or flat
                                  kernel; auto: a warp per token for small batches (decode),
                                  block for larger ones (flat for the slots form's without
                                  PDL) */
    uint32_t tokens_per_block; /* block kernel: tokens per block, 1..KVP_APPEND_CUDA_MAX_TPB */
    uint32_t blocks_per_sm;    /* block kernel: cap the grid at this many blocks per SM (the
                                  blocks then loop over the tokens), 1..KVP_APPEND_CUDA_MAX_BPSM */
    uint32_t warps_per_block;  /* warp (row) kernel: tokens per block, 1..
                                  KVP_APPEND_CUDA_MAX_WARPS; automatic: by the batch */
    uint32_t hints;            /* KVP_APPEND_CUDA_HINT_*: evict-first source loads and/or pool
                                  stores; 0: none */
    uint32_t vecs_per_thread;  /* warp (row) kernel: 16-byte vectors each thread moves, so
                                  whole warps of ceil(2 * H * D * elem / 16 / this) threads
                                  take a token; 1..KVP_APPEND_CUDA_MAX_ITEMS; automatic: the
                                  fewest that keep the grid small (kvp_append_cuda.cu) */
    uint32_t checked;          /* KVP_APPEND_CUDA_CHECKED_*: how the checked append of a
                                  decode-sized batch validates; auto: by its size */
} kvp_append_cuda_opts_t;

enum {
    KVP_APPEND_CUDA_KERNEL_AUTO = 0,
    KVP_APPEND_CUDA_KERNEL_WARP = 1,
    KVP_APPEND_CUDA_KERNEL_BLOCK = 2,
    /* one vector a thread, a grid of all of them (what auto takes for large batches of the
     * slots form without PDL) */
    KVP_APPEND_CUDA_KERNEL_FLAT = 3,
    KVP_APPEND_CUDA_HINT_LD = 1u, /* source loads with ld.global.cs */
    KVP_APPEND_CUDA_HINT_ST = 2u, /* pool stores with st.global.cs */
    KVP_APPEND_CUDA_CHECKED_AUTO = 0,
    /* every block of the copy validates every token: one launch (up to
     * KVP_APPEND_CUDA_CHECKED_ONE_MAX tokens, else as for a prefill) */
    KVP_APPEND_CUDA_CHECKED_ONE = 1,
    /* one validation block, then the copy, overlapped with it by PDL (sm_90+) */
    KVP_APPEND_CUDA_CHECKED_BLOCK = 2,
};
#define KVP_APPEND_CUDA_CHECKED_ONE_MAX 1024u
#define KVP_APPEND_CUDA_MAX_TPB         64u   /* tokens per block of the block kernel */
#define KVP_APPEND_CUDA_MAX_BPSM        1024u /* blocks per SM of the block kernel's grid cap */
#define KVP_APPEND_CUDA_MAX_WARPS       8u    /* tokens per block of the warp (row) kernel */
#define KVP_APPEND_CUDA_MAX_ITEMS       8u    /* vectors per thread of the warp (row) kernel */

/* 0 when o is NULL or every field is in range, else KVP_EINVAL. */
static inline int kvp_append_cuda_opts_check(const kvp_append_cuda_opts_t *o)
{
    if (!o)
        return 0;
    if (o->kernel > KVP_APPEND_CUDA_KERNEL_FLAT || o->tokens_per_block > KVP_APPEND_CUDA_MAX_TPB ||
        o->blocks_per_sm > KVP_APPEND_CUDA_MAX_BPSM ||
        o->warps_per_block > KVP_APPEND_CUDA_MAX_WARPS ||
        o->vecs_per_thread > KVP_APPEND_CUDA_MAX_ITEMS ||
        o->checked > KVP_APPEND_CUDA_CHECKED_BLOCK ||
        (o->hints & ~(uint32_t)(KVP_APPEND_CUDA_HINT_LD | KVP_APPEND_CUDA_HINT_ST)))
        return KVP_EINVAL;
    return 0;
}

/* ---- the append -------------------------------------------------------------------------- */

/* Flags of kvp_append_cuda_args_t. */
enum {
    /* Programmatic dependent launch (sm_90+, ignored before): the kernel may start while the
     * previous kernel of the stream is still running; it reads the destination (kv's page
     * table and append_indptr, or the slots) at once and waits for that kernel only before it
     * reads the sources and writes the pool. So with this flag the destination arrays must
     * already be complete when the previous kernel starts (uploaded by a copy earlier in the
     * stream, as an engine does once per step), while the sources may be produced by the
     * previous kernel. The same contract as FlashInfer's enable_pdl. Not with
     * KVP_APPEND_CUDA_CHECKED or KVP_APPEND_CUDA_HOST_DEST. */
    KVP_CUDA_APPEND_PDL = 1u,
    /* The tokens form only: nothing is written unless every token is valid. What is checked is
     * what the append reads and writes (not the rest of the table): kv_indptr[0] == 0; per
     * token with a batch index >= 0 (< 0 is padding), the index < batch_size, its request's
     * length not negative (KVP_EINVAL) and last_page_len in 1..page_size when it has pages, its
     * position inside the request, and the page id it writes < num_pages (KVP_ERANGE).
     * KVP_EINVAL wins over KVP_ERANGE when both occur. err_dev is required: the append resets
     * and fills it. Without the flag the tokens form has per-row guards instead: a row this
     * check would refuse is skipped and reported in *err_dev (KVP_EINVAL over KVP_ERANGE), the
     * other rows are written (for callers whose positions come from our own planner). */
    KVP_APPEND_CUDA_CHECKED = 2u,
    /* The slots form only: dest->slots is a HOST array, read during this call and carried
     * inside the launch (at most KVP_APPEND_SLOTS_MAX tokens), so nothing is uploaded first:
     * the daemon's Append, whose planner already knows each slot (kvp_plan_slots). Every slot
     * is checked on the host (>= num_pages * page_size: KVP_ERANGE) before anything is queued,
     * so err_dev is not used; num_layers layers in one launch (see kvp_append_cuda_args_t). */
    KVP_APPEND_CUDA_HOST_DEST = 4u,
};

/* Most tokens of one KVP_APPEND_CUDA_HOST_DEST call. */
#define KVP_APPEND_SLOTS_MAX 1024u

/* How one append runs, beside the tensors and the destination. All zero (or a NULL pointer):
 * no flags, no error word, the automatic shape, one layer. */
typedef struct {
    uint32_t flags;   /* KVP_CUDA_APPEND_PDL, KVP_APPEND_CUDA_CHECKED, KVP_APPEND_CUDA_HOST_DEST */
    int32_t *err_dev; /* a device int32 where a bad row is reported (KVP_E*, first one wins but
                         KVP_EINVAL over KVP_ERANGE); NULL: not reported. Never reset, except by
                         the checked form */
    const kvp_append_cuda_opts_t *shape; /* the copy kernels' shape; NULL: automatic */
    /* KVP_APPEND_CUDA_HOST_DEST only: layers [0, num_layers) (0 or 1: one) in one launch,
     * layer l writing kv's pool advanced by l * layer_stride_bytes (non-zero when num_layers >
     * 1) and reading src advanced by l * src_layer_stride_bytes (0: every layer the same rows);
     * both multiples of 16; num_layers <= 65535 */
    uint32_t num_layers;
    uint64_t layer_stride_bytes;
    uint64_t src_layer_stride_bytes;
} kvp_append_cuda_args_t;

/*
 * The append (FlashInfer's append_paged_kv_cache) on the device: dest->nnz tokens of src into
 * the layer kv describes, each where dest says (kvp_kernels.h, kvp_append_dest_t):
 *   KVP_APPEND_DEST_TOKENS  batch_indices/positions (device arrays) through kv's page table,
 *                           unchecked (per-row guards) or KVP_APPEND_CUDA_CHECKED;
 *   KVP_APPEND_DEST_FUSED   append_indptr (device, kv->batch_size + 1 entries): each token's
 *                           request by a binary search, its position from kv's page table;
 *                           positions are right by construction, a page id out of range skips
 *                           the row and is reported in *err_dev. One launch per layer on the
 *                           decode path;
 *   KVP_APPEND_DEST_SLOTS   slots (device array, or host with KVP_APPEND_CUDA_HOST_DEST); < 0
 *                           skips the token, a slot beyond the pool is skipped and reported.
 *                           kv's page-table fields are not used.
 * One launch, except the checked form of larger batches (a validation, then the gated copy).
 * Returns 0; KVP_EINVAL for host-side refusals (NULL dest or args fields the form needs, an
 * unknown kind or flag, a flag the form does not take, args->shape out of range: all before
 * nnz is looked at; then kv/src as in the header comment, the form's arrays, num_pages *
 * page_size above INT32_MAX for the slots form); KVP_ERANGE for a host slot beyond the pool;
 * nnz 0 returns 0 once the flags and shape are checked; or a launch failure's code (recorded).
 */
int kvp_append_cuda(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                    const kvp_append_dest_t *dest, const kvp_append_cuda_args_t *args,
                    void *stream);

/* ---- the page-table helpers and page copies (kvp_table_cuda.cu) ------------------------- */

/* The per-step plan of the slots form: slots_dev[i] (a device array of nnz int32) = the pool
 * slot (page id * page_size + position % page_size) of token i, with requests and positions
 * as the fused append computes them (append_indptr, kv's page table); -1, reported in
 * *err_dev (may be NULL), for a token outside every request or whose page id is out of range.
 * An engine plans once per step and then appends every layer with the slots form: one
 * dependent load per token and layer instead of the page-table walk. KVP_EINVAL when
 * num_pages * page_size exceeds INT32_MAX. One launch. */
int kvp_append_plan_slots_cuda(const kvp_paged_kv_t *kv, const int32_t *append_indptr, uint32_t nnz,
                               int32_t *slots_dev, int32_t *err_dev, void *stream);

int kvp_get_seq_lens_cuda(const int32_t *kv_indptr, const int32_t *kv_last_page_len,
                          uint32_t batch_size, uint32_t page_size, int32_t *seq_lens, void *stream);

int kvp_get_batch_indices_positions_cuda(const int32_t *append_indptr, const int32_t *seq_lens,
                                         uint32_t batch_size, uint32_t nnz, int32_t *batch_indices,
                                         int32_t *positions, void *stream);

/* Whole-page copies (K and V) inside one layer; copies is a device array. Ids are checked on
 * the device: a bad pair is skipped and reported in *err_dev (may be NULL). */
int kvp_page_copy_cuda(const kvp_paged_kv_t *kv, const kvp_page_copy_t *copies, uint32_t num_copies,
                       int32_t *err_dev, void *stream);

/* The packed transfer form (kvp_kernels.h, kvp_kv_pack_cpu) on the device: one layer per
 * call, pages_dev a device array of ceil(num_tokens / page_size) page ids (an id >= num_pages
 * is skipped on the device, never read or written out of bounds: the daemon passes its own
 * checked pages), out_dev / in_dev 16-byte aligned. Rows must be multiples of 16 bytes (as
 * every cuda pool's are). Returns 0, KVP_EINVAL (host-side checks) or a launch failure's code
 * (recorded as above). */
int kvp_kv_pack_cuda(const kvp_paged_kv_t *kv, const int32_t *pages_dev, uint32_t num_tokens,
                     void *out_dev, void *stream);
int kvp_kv_unpack_cuda(const kvp_paged_kv_t *kv, const int32_t *pages_dev, uint32_t num_tokens,
                       const void *in_dev, void *stream);

/* The pack kernels' grid, chosen by the caller (the daemon: [tuning] pack_blocks). NULL or
 * max_blocks 0: two blocks per SM. */
typedef struct {
    uint32_t max_blocks; /* cap of the grid (a grid-stride loop does the rest), 0..
                            KVP_PACK_CUDA_MAX_BLOCKS */
} kvp_pack_cuda_opts_t;
#define KVP_PACK_CUDA_MAX_BLOCKS 65535u

/* The same for the byte range [begin, end) of the layer's packed part (both multiples of 16,
 * end <= kvp_kv_packed_layer_bytes): out_dev / in_dev hold just that range. KVP_EINVAL for a
 * bad range. The transfer engine moves a stream in chunks with these. */
int kvp_kv_pack_range_cuda(const kvp_paged_kv_t *kv, const int32_t *pages_dev, uint32_t num_tokens,
                           uint64_t begin, uint64_t end, void *out_dev, void *stream);
int kvp_kv_unpack_range_cuda(const kvp_paged_kv_t *kv, const int32_t *pages_dev,
                             uint32_t num_tokens, uint64_t begin, uint64_t end, const void *in_dev,
                             void *stream);

/* The two range forms with the grid given (kvp_pack_cuda_opts_t; NULL: automatic). KVP_EINVAL
 * also for max_blocks above KVP_PACK_CUDA_MAX_BLOCKS. */
int kvp_kv_pack_range_cuda_ex(const kvp_paged_kv_t *kv, const int32_t *pages_dev,
                              uint32_t num_tokens, uint64_t begin, uint64_t end, void *out_dev,
                              const kvp_pack_cuda_opts_t *opts, void *stream);
int kvp_kv_unpack_range_cuda_ex(const kvp_paged_kv_t *kv, const int32_t *pages_dev,
                                uint32_t num_tokens, uint64_t begin, uint64_t end,
                                const void *in_dev, const kvp_pack_cuda_opts_t *opts, void *stream);

/* ---- whole pages, every layer, page after page (kvp_slots_cuda.cu) ----------------------- */

/* Most pages of one kvp_kv_pack_pages_cuda call (their ids travel inside the launch). */
#define KVP_PACK_PAGES_MAX 256u

/*
 * The packed form of n whole pages, every layer in one launch: page pages[i]'s packed form
 * (kvp_kv_pack_cpu of that one page, page_size tokens: layers [0, num_layers), each K then V
 * [token][head][D]) at buf_dev + i * buf_stride_bytes, the host tier's slot order. kv describes
 * layer 0 of the pool (device pointers; page-table fields unused); layer l's K and V tensors are
 * l * layer_stride_bytes further. pages is a HOST array of n <= KVP_PACK_PAGES_MAX ids, checked
 * (< num_pages, else KVP_ERANGE) and carried inside the launch, so nothing is uploaded first.
 * buf_dev 16-byte aligned, buf_stride_bytes and layer_stride_bytes multiples of 16, pages not
 * overlapping in buf (a stride of at least one page's packed form), rows multiples of 16 bytes.
 * The grid: a block per (page, layer, K|V), capped at opts->max_blocks (NULL or 0: two per SM);
 * a cap keeps the pack to a few SMs while the copy engines, not the SMs, bound the tier.
 * Unpack is the inverse (buf -> pool). Returns 0 (n 0: nothing queued), KVP_EINVAL (host-side
 * checks, before anything is queued), KVP_ERANGE, or a launch failure's code (recorded).
 */
int kvp_kv_pack_pages_cuda(const kvp_paged_kv_t *kv, uint32_t num_layers,
                           uint64_t layer_stride_bytes, const uint32_t *pages, uint32_t n,
                           void *buf_dev, uint64_t buf_stride_bytes,
                           const kvp_pack_cuda_opts_t *opts, void *stream);
int kvp_kv_unpack_pages_cuda(const kvp_paged_kv_t *kv, uint32_t num_layers,
                             uint64_t layer_stride_bytes, const uint32_t *pages, uint32_t n,
                             const void *buf_dev, uint64_t buf_stride_bytes,
                             const kvp_pack_cuda_opts_t *opts, void *stream);

/* ---- the gather (kvp_gather_cuda.cu) ------------------------------------------------------ */

/*
 * kvp_gather_cpu on the device: rows of nnz pool slots of one layer (slots_dev, a device array
 * of int32 page id * page_size + position; < 0: padding, its rows of dst left as they were)
 * copied to rows 0..nnz-1 of dst (device pointers, or host memory mapped for the device). One
 * launch, a thread per vector over K|V x tokens x heads x the row's vectors; the vector is 16
 * bytes when the row, every byte stride and the four base addresses allow it (every cuda pool
 * with a 16-byte-aligned destination), else the widest of 8, 4, 2, 1 bytes that does, so any
 * element-aligned destination works. A slot >= num_pages * page_size is skipped on the device
 * (never read out of bounds) and reported nowhere: the caller checks its slots on the host
 * first (the cuda backend's ops->gather does). Returns 0; KVP_EINVAL for host-side refusals
 * (NULL kv, dst or slots_dev with nnz > 0, NULL data pointers, an element size not 1, 2 or 4, a
 * zero size, a negative stride or one whose byte step does not fit in int64), nothing queued;
 * nnz 0 returns 0 once kv and dst are checked; or a launch failure's code (recorded).
 */
int kvp_gather_cuda(const kvp_paged_kv_t *kv, const int32_t *slots_dev, uint32_t nnz,
                    const kvp_gather_dst_t *dst, void *stream);

/* ---- libkvpool's exported append entry points (kvp_append_cuda_compat.c) ------------------
 * libkvpool.so exports these (kvp_append_paged_kv_cache_*, client/CMakeLists.txt) and the
 * Python package calls two of them through ctypes, so their names and signatures stay as they
 * were. Each is exactly kvp_append_cuda with one form, listed here; new code calls
 * kvp_append_cuda.
 *   kvp_append_paged_kv_cache_cuda[_opts]           TOKENS, KVP_APPEND_CUDA_CHECKED (err_dev
 *                                                   required)
 *   kvp_append_paged_kv_cache_cuda_unchecked[_opts] TOKENS
 *   kvp_append_paged_kv_cache_fused_cuda[_ex|_opts] FUSED, flags (KVP_CUDA_APPEND_PDL)
 *   kvp_append_paged_kv_cache_slots_cuda            SLOTS (device array), flags
 * (opts: the shape, args->shape.) */
int kvp_append_paged_kv_cache_cuda(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                   const int32_t *batch_indices, const int32_t *positions,
                                   uint32_t nnz, int32_t *err_dev, void *stream);
int kvp_append_paged_kv_cache_cuda_unchecked(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                             const int32_t *batch_indices, const int32_t *positions,
                                             uint32_t nnz, int32_t *err_dev, void *stream);
int kvp_append_paged_kv_cache_fused_cuda(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                         const int32_t *append_indptr, uint32_t nnz,
                                         int32_t *err_dev, void *stream);
int kvp_append_paged_kv_cache_fused_cuda_ex(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                            const int32_t *append_indptr, uint32_t nnz,
                                            int32_t *err_dev, unsigned flags, void *stream);
int kvp_append_paged_kv_cache_cuda_opts(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                        const int32_t *batch_indices, const int32_t *positions,
                                        uint32_t nnz, int32_t *err_dev,
                                        const kvp_append_cuda_opts_t *opts, void *stream);
int kvp_append_paged_kv_cache_cuda_unchecked_opts(const kvp_paged_kv_t *kv,
                                                  const kvp_append_src_t *src,
                                                  const int32_t *batch_indices,
                                                  const int32_t *positions, uint32_t nnz,
                                                  int32_t *err_dev,
                                                  const kvp_append_cuda_opts_t *opts, void *stream);
int kvp_append_paged_kv_cache_fused_cuda_opts(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                              const int32_t *append_indptr, uint32_t nnz,
                                              int32_t *err_dev, unsigned flags,
                                              const kvp_append_cuda_opts_t *opts, void *stream);
int kvp_append_paged_kv_cache_slots_cuda(const kvp_paged_kv_t *kv, const kvp_append_src_t *src,
                                         const int32_t *slots_dev, uint32_t nnz, int32_t *err_dev,
                                         unsigned flags, const kvp_append_cuda_opts_t *opts,
                                         void *stream);

#ifdef __cplusplus
}
#endif
#endif
