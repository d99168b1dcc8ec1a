/*
 * kvp_backend.h - where the pool lives, behind one small operations table (DESIGN.md §2):
 * create the pool, export it to workers, import a worker's buffer, run an append/copy plan,
 * fence. The host backend (kvp_backend_host.c) keeps the pool in a memfd; the cuda backend
 * (a later issue) in GPU memory exported by fd. The daemon's dispatch only ever talks to this
 * table, so backends are interchangeable.
 *
 * Threads: create/export/import/release/destroy run on the daemon's loop thread; run() runs
 * on a copy worker thread, several at once for different plans (the plans never write the
 * same slots: the planner hands every token its own slot, and pages in flight are pinned).
 */
#ifndef KVP_BACKEND_H
#define KVP_BACKEND_H

#include <stdint.h>

#include "kvp_geom.h"
#include "kvp_kernels.h"

typedef struct kvp_backend kvp_backend_t;

/* A buffer a worker registered: opaque to the dispatch except its size. */
typedef struct {
    uint32_t kind; /* kvpool_BufferKind */
    uint64_t size_bytes;
    void *host_ptr; /* host backend: the daemon's mapping of the worker's memfd */
    void *priv;     /* backend state */
} kvp_buffer_t;

/* One append to run: the page table (CSR), per-token batch index and position, the
 * copy-on-write copies (applied to EVERY layer first), and where K/V come from in the source
 * buffer for layers [layer_begin, layer_end). Strides and offsets in bytes (validated against
 * the buffer's size and the element size before run() is called). All arrays are owned by the
 * caller and live until run() returns. */
typedef struct {
    uint32_t batch_size;
    uint32_t nnz;
    const int32_t *kv_indptr, *kv_indices, *kv_last_page_len;
    const int32_t *batch_indices, *positions;
    const kvp_page_copy_t *copies;
    uint32_t num_copies;
    const kvp_buffer_t *src;
    uint64_t k_offset, v_offset, k_stride_n, k_stride_h, v_stride_n, v_stride_h, layer_stride;
    uint32_t layer_begin, layer_end;
} kvp_exec_t;

typedef struct {
    const char *name;
    /* Exports the pool: writes up to max fds (borrowed: the backend keeps them open) and
     * returns how many, or a negative code. */
    int (*export_fds)(kvp_backend_t *b, int *fds, int max);
    /* Imports a worker buffer arriving as fd (ownership of fd passes to the backend on
     * success; on failure the caller closes it). */
    int (*import_buffer)(kvp_backend_t *b, uint32_t kind, int fd, uint64_t size_bytes,
                         kvp_buffer_t *out);
    void (*release_buffer)(kvp_backend_t *b, kvp_buffer_t *buf);
    /* Runs copies then the append. Worker thread. Returns 0 or a negative code. */
    int (*run)(kvp_backend_t *b, const kvp_exec_t *e);
    /* A health probe: 0 when the backend can serve (cuda: the context is not poisoned). */
    int (*health)(kvp_backend_t *b);
    void (*destroy)(kvp_backend_t *b);
} kvp_backend_ops_t;

struct kvp_backend {
    const kvp_backend_ops_t *ops;
    kvp_geom_t geom;
    kvp_geom_derived_t derived;
    int kind; /* kvpool_BackendKind */
};

/* Creates the host backend: a memfd of pool_bytes, mapped shared, filled with zeros.
 * Returns 0, KVP_EINVAL (bad geometry) or -errno. Destroy through b->ops->destroy. */
int kvp_backend_host_create(const kvp_geom_t *g, kvp_backend_t **out);

/* A layer view of the pool for the kernels API (host pointers), page table left empty. */
void kvp_backend_layer_view(const kvp_backend_t *b, void *pool_base, uint32_t layer,
                            kvp_paged_kv_t *kv);

#endif
