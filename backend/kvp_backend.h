/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend.h - where the pool lives, behind one small operations table (DESIGN.md §2):
 * create the pool, export it to workers, import a worker's buffer, run an append/copy plan,
 * fence. The host backend (kvp_backend_host.c) keeps the pool in a memfd; the cuda backend
 * (kvp_backend_cuda.c) in GPU memory exported by fd. The daemon's dispatch only ever talks to this
 * table, so backends are interchangeable.
 *
 * Threads: create/export/import/release/destroy run on the daemon's loop thread; run() runs
 * on a copy worker thread, several at once for different plans (the plans never write the
 * same slots: the planner hands every token its own slot, and pages in flight are pinned).
 */
#ifndef KVP_BACKEND_H
#define KVP_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvp_geom.h"
#include "kvp_kernels.h"
#include "kvp_kernels_cuda.h"
#include "kvp_layout.h"
#include "kvp_loc.h"
#include "kvp_pool_info.h"

typedef struct kvp_backend kvp_backend_t;

/* The backend's own names for what the wire schema also names (kvpool.proto's BackendKind,
 * BufferKind, SyncMode): the same values, which the rpc layer checks at compile time
 * (kvp_rpc.c), so no backend includes the generated protocol header. */
typedef enum { KVP_BACKEND_HOST = 0, KVP_BACKEND_CUDA = 1 } kvp_backend_kind_t;
typedef enum {
    KVP_BUFFER_MEMFD = 0,       /* host memory: a sealed memfd */
    KVP_BUFFER_CUDA_VMM_FD = 1, /* device memory exported as a POSIX fd */
    KVP_BUFFER_CUDA_IPC = 2     /* a cudaIpcMemHandle_t */
} kvp_buffer_kind_t;
typedef enum {
    KVP_SYNC_NONE = 0, /* done when run() returns */
    KVP_SYNC_EVENT = 1 /* cuda: wait on the worker's event, record the fence after */
} kvp_sync_mode_t;

/* How the cuda backend, its kernels and the transfers over it run: the [tuning] keys of
 * the configuration, which kvpoold hands down (server/kvp_backend_choose.h); all zero: the
 * defaults. The backend keeps a copy in b->tuning, where the transfer engine (kvp_xfer.c, created
 * by the rpc layer from the backend) finds its part. The host backend uses none of it. */
typedef struct {
    uint32_t ready_timeout_ms;     /* tuning.cuda_ready_timeout_ms; 0: 30000 */
    bool plan_upload;              /* tuning.cuda_plan_upload */
    kvp_append_cuda_opts_t append; /* tuning.append_*: the copy kernels of run() */
    uint32_t pack_blocks;          /* tuning.pack_blocks: the transfers' pack grid; 0: 2 per SM */
    uint32_t xfer_stages;          /* tuning.xfer_stages: 2..4; 0: 2 */
    bool xfer_register;            /* tuning.xfer_register */
    bool xfer_priority;            /* tuning.xfer_priority */
} kvp_backend_tuning_t;

/* A buffer a worker registered: opaque to the dispatch except its size. */
typedef struct {
    uint32_t kind; /* kvp_buffer_kind_t */
    uint64_t size_bytes;
    void *host_ptr;        /* host backend: the daemon's mapping of the worker's memfd */
    void *priv;            /* backend state */
    uint32_t device_index; /* index in the pool's device group of the device that reads it
                              (set by import_buffer; host backend: 0) */
    bool writable;         /* the daemon may write it (ops->gather, a Load's destination): host
                              backend, a memfd opened read-write without a write seal (mapped
                              PROT_WRITE); cuda, device memory (a memfd there is not) */
} kvp_buffer_t;

/* One append to run: where each token goes (the planner's destination, passed through to the
 * kernels as it is), the copy-on-write copies (applied to EVERY layer first), and where K/V
 * come from in the source buffer for layers [layer_begin, layer_end). Strides and offsets in
 * bytes (validated against the buffer's size and the element size before run() is called).
 * All arrays are owned by the caller and live until run() returns. */
typedef struct {
    /* dest.nnz tokens, KVP_APPEND_DEST_SLOTS (kvp_plan_slots), in host memory: every slot is
     * in the pool and inside its sequence. A backend runs the slots form only (it has no page
     * table to read another through): a slot beyond the pool is a planner bug, KVP_ERANGE
     * from the host backend, KVP_EINTERNAL and poisoned in the cuda backend. */
    kvp_append_dest_t dest;
    const kvp_page_copy_t *copies;
    uint32_t num_copies;
    const kvp_buffer_t *src; /* single-source form: the append runs on src's device only */
    /* tensor-parallel form (num_rank_src = the group's device count, src NULL): rank_src[g] is
     * device g's buffer (device_index g); the same offsets and strides apply to each, and the
     * append runs on every device */
    const kvp_buffer_t *const *rank_src;
    uint32_t num_rank_src;
    KVP_SRC_LAYOUT_MEMBER; /* where the source rows are (common/kvp_layout.h) */
    uint32_t layer_begin, layer_end;
    uint32_t sync; /* kvp_sync_mode_t */
} kvp_exec_t;

#define KVP_MOVE_OUT 0 /* the pool's pages -> buf */
#define KVP_MOVE_IN  1 /* buf -> the pool's pages */

/* One page move (ops->move): the byte range [begin, end) of the packed form (kvp_kernels.h:
 * per layer K then V, [token][head][head_dim], layer l at l * kvp_kv_packed_layer_bytes) of
 * num_tokens tokens held, in order, in pages, between the pool and buf, which holds just that
 * range. The packed form depends on neither the page size nor the layout or storage, so it is
 * what a page is outside the pool: a slot of another tier, a peer daemon's stream (xfer/), a
 * file. With a tensor-parallel pool a move reads or writes one device's heads (device). */
typedef struct {
    int dir;                  /* KVP_MOVE_OUT or KVP_MOVE_IN */
    const int32_t *pages;     /* ceil(num_tokens / page_size) page ids, host memory (checked) */
    const int32_t *pages_dev; /* cuda, optional: the same ids already in device memory (the
                                 caller checked them); NULL: the backend uploads pages */
    uint32_t num_tokens;
    uint32_t device;         /* index in the pool's device group */
    uint64_t begin, end;     /* 0 <= begin <= end <= kvp_backend_move_bytes (cuda: multiples
                                of 16) */
    void *buf;               /* end - begin bytes */
    kvp_medium_t buf_medium; /* kvp_loc.h: KVP_MEDIUM_HOST (process memory, pageable or
                                pinned) or KVP_MEDIUM_GPU (device memory on the pool's device;
                                cuda backend only) */
    void *stream; /* cuda, optional: queue the move on this stream and return (buf DEVICE,
                     pages_dev set; the caller waits); NULL: done when move returns */
} kvp_move_t;

/* A batch of whole pages between the pool and slots of the host tier (ops->move_slots, issue
 * #28). A slot holds one page's packed form (the form of kvp_move_t) for every device of the
 * group, device g's heads at g * kvp_backend_move_bytes(b, page_size): kvp_backend_slot_bytes. */
typedef struct {
    int dir;               /* KVP_MOVE_OUT: pages -> slots (offload); KVP_MOVE_IN: slots ->
                              pages (restore) */
    const uint32_t *pages; /* n page ids (checked < num_pages) */
    void *const *slots;    /* n host addresses, kvp_backend_slot_bytes each: memory of a
                              kvp_tier_mem_t made for this backend (cuda: pinned) */
    uint32_t n;
} kvp_slot_move_t;

/* A Load's copy (ops->gather, issue #28): the mirror of run()'s append, rows of the pool to a
 * registered buffer. Token i of the Load is pool slot slots[i] (page * page_size + offset) and
 * goes where an Append with the same layout would read token i: K of layer l (counted from
 * layer_begin), head h at k_offset + l * layer_stride + i * k_stride_n + h * k_stride_h, V
 * likewise (heads of dst's device: a tensor-parallel pool's device dst->device_index). The
 * caller checked the layout against dst's size like an Append's. */
typedef struct {
    const int32_t *slots; /* nnz slots, host memory (checked < num_pages * page_size) */
    uint32_t nnz;
    const kvp_buffer_t *dst; /* writable */
    KVP_SRC_LAYOUT_MEMBER;   /* where the rows go in dst (common/kvp_layout.h) */
    uint32_t layer_begin, layer_end;
} kvp_gather_t;

/* Bytes of a cudaIpcMemHandle_t / cudaIpcEventHandle_t (the proto's bound too). */
#define KVP_BACKEND_IPC_HANDLE_BYTES 64

/* A worker buffer to import (RegisterBufferRequest, decoded): kind KVP_BUFFER_MEMFD or
 * KVP_BUFFER_CUDA_VMM_FD arrives as fd, KVP_BUFFER_CUDA_IPC as the ipc_handle bytes with fd -1.
 * device: the request's CUDA ordinal. event_handle (event_len 0: none) is the worker's
 * interprocess "ready" event. The pointers are borrowed for the call. */
typedef struct {
    uint32_t kind; /* kvp_buffer_kind_t */
    int fd;
    uint64_t size_bytes;
    int32_t device;
    const uint8_t *ipc_handle;
    uint32_t ipc_len;
    const uint8_t *event_handle;
    uint32_t event_len;
} kvp_import_req_t;

typedef struct {
    const char *name;
    /* Exports the pool: writes up to max fds (borrowed: the backend keeps them open) and
     * returns how many, or a negative code. */
    int (*export_fds)(kvp_backend_t *b, int *fds, int max);
    /* Imports the worker buffer req describes into *out (see kvp_import_req_t; ownership of
     * req->fd passes to the backend on success, on failure the caller closes it). When the
     * backend uses the worker's ready event it writes its own "done" event handle into
     * done_event_out (room for KVP_BACKEND_IPC_HANDLE_BYTES) and sets *done_event_len, else
     * sets it to 0. Returns 0, KVP_EINVAL (kind, handle or size refused), KVP_EPERM (unsealed
     * memfd), or another code. */
    int (*import_buffer)(kvp_backend_t *b, const kvp_import_req_t *req, kvp_buffer_t *out,
                         uint8_t *done_event_out, uint32_t *done_event_len);
    void (*release_buffer)(kvp_backend_t *b, kvp_buffer_t *buf);
    /* Runs copies then the append. Worker thread. Returns 0 once the copies and the append
     * have completed on the device (the pages they write stay pinned only until run returns,
     * so the data must be in place; the AppendResponse says so with completed = true);
     * KVP_ETIMEDOUT (the worker's ready event never completed: a dead or stuck worker) or
     * KVP_EINVAL (a source the backend cannot read): the copies ran, the append did not, the
     * backend is healthy - the caller rolls the sequences back and fails the request; any
     * other code: the backend failed (the daemon must stop serving). */
    int (*run)(kvp_backend_t *b, const kvp_exec_t *e);
    /* A worker's interprocess event for a prefix-cache Commit (kvpool.proto, Visibility):
     * event_open opens the handle (KVP_BACKEND_IPC_HANDLE_BYTES) into *ev (0, or KVP_EINVAL
     * for a handle the driver refuses); event_query answers 1 once the work recorded before
     * it is complete, 0 while it is not, a negative code when the event reports an error;
     * event_close frees it. Loop thread. NULL in a backend without events (host): a Commit
     * then cannot name one. */
    int (*event_open)(kvp_backend_t *b, const uint8_t *handle, uint32_t len, void **ev);
    int (*event_query)(kvp_backend_t *b, void *ev);
    void (*event_close)(kvp_backend_t *b, void *ev);
    /* The page-mover: runs m (kvp_move_t). Returns 0, KVP_EINVAL (a bad range, device,
     * medium or argument), KVP_ERANGE (a page id), or another code (the copy failed). Any
     * thread (a worker's, for long moves); moves into the same pages must not overlap. */
    int (*move)(kvp_backend_t *b, const kvp_move_t *m);
    /* The host tier's mover: runs m (kvp_slot_move_t), done (bytes in place) when it returns.
     * Any thread; calls from different threads run concurrently, none queues behind another
     * (cuda: a stream per calling thread). Returns 0, KVP_EINVAL (bad argument), KVP_ERANGE
     * (a page id) or another code (the copy failed: the backend is unhealthy). */
    int (*move_slots)(kvp_backend_t *b, const kvp_slot_move_t *m);
    /* A Load's copy: runs g (kvp_gather_t), done when it returns. Worker thread. Returns 0,
     * KVP_EINVAL (dst not writable, bad layer range), KVP_ERANGE (a slot) or another code. */
    int (*gather)(kvp_backend_t *b, const kvp_gather_t *g);
    /* A health probe: 0 when the backend can serve (cuda: the context is not poisoned). */
    int (*health)(kvp_backend_t *b);
    void (*destroy)(kvp_backend_t *b);
} kvp_backend_ops_t;

struct kvp_backend {
    const kvp_backend_ops_t *ops;
    kvp_geom_t geom;
    kvp_geom_derived_t derived;
    int kind;                 /* kvp_backend_kind_t */
    uint64_t map_granularity; /* cuda: VMM granularity of the exported pool fds; host: 0 */
    uint64_t map_bytes;       /* cuda: bytes of each exported allocation (pool_bytes rounded
                                 up to map_granularity); host: 0 */
    uint32_t num_device_ids;  /* cuda: one per exported fd; host: 0 */
    int32_t device_ids[KVP_GEOM_MAX_DEVICES]; /* cuda: CUDA ordinal of each fd, in order */
    uint32_t src_align_bytes;    /* alignment an Append's source offsets and strides need beyond
                                    the element size (cuda: 16, its kernels move 16-byte vectors;
                                    host: 0) */
    kvp_backend_tuning_t tuning; /* cuda: as created; host: zero */
};

/* Creates the host backend: a memfd of pool_bytes, mapped shared, filled with zeros.
 * Returns 0, KVP_EINVAL (bad geometry) or -errno. Destroy through b->ops->destroy. */
int kvp_backend_host_create(const kvp_geom_t *g, kvp_backend_t **out);

/* The pool as workers are told of it (PoolInfo, Hello): geometry, strides, devices. */
void kvp_backend_pool_info(const kvp_backend_t *b, kvp_pool_info_t *out);

/* The kernels' description of e's source for the layer whose rows start at base (the
 * buffer's address plus (layer - layer_begin) * layer_stride): offsets applied, byte strides
 * turned into elements. */
void kvp_backend_exec_src(const kvp_backend_t *b, const kvp_exec_t *e, const uint8_t *base,
                          kvp_append_src_t *src);

/* The kernels' description of g's destination rows of pool layer `layer` in the buffer whose
 * address is dst_base (the mirror of kvp_backend_exec_src). */
void kvp_backend_gather_dst(const kvp_backend_t *b, const kvp_gather_t *g, uint32_t layer,
                            uint8_t *dst_base, kvp_gather_dst_t *dst);

/* Bytes of the packed form of num_tokens tokens of one device's heads (ops->move's whole
 * range): num_layers * kvp_kv_packed_layer_bytes. */
uint64_t kvp_backend_move_bytes(const kvp_backend_t *b, uint32_t num_tokens);

/* Bytes of one host-tier slot (kvp_slot_move_t): one page's packed form for every device of
 * the group, num_devices * kvp_backend_move_bytes(b, page_size). */
uint64_t kvp_backend_slot_bytes(const kvp_backend_t *b);

/* Checks m against b (direction, device, range, buffer, every page id < num_pages), the part
 * of ops->move every backend shares. Returns 0, KVP_EINVAL or KVP_ERANGE. */
int kvp_backend_move_check(const kvp_backend_t *b, const kvp_move_t *m);

/* A layer view of the pool for the kernels API (host pointers), page table left empty. */
void kvp_backend_layer_view(const kvp_backend_t *b, void *pool_base, uint32_t layer,
                            kvp_paged_kv_t *kv);

/* ---- cuda backend (kvp_backend_cuda.c) ---- */

/* Creates the cuda backend: one pool of derived.pool_bytes (rounded up to the VMM
 * granularity) on each of the num_devices CUDA ordinals in devices (num_devices must equal the
 * geometry's num_devices), allocated with cuMemCreate, exported as a POSIX fd, zeroed; one
 * non-blocking stream per device, kernels loaded eagerly. tuning (NULL: the defaults) is copied
 * into b->tuning. Returns 0, KVP_EUNAVAIL (built without CUDA, no driver, no device),
 * KVP_EINVAL (bad geometry, devices, tuning out of range or a row not a multiple of 16 bytes),
 * KVP_ENOMEM, or another code (logged). Loop thread. Destroy through b->ops->destroy. */
int kvp_backend_cuda_create(const kvp_geom_t *g, const int *devices, int num_devices,
                            const kvp_backend_tuning_t *tuning, kvp_backend_t **out);

/* For transfers (kvp_xfer.c): the CUDA ordinal of device index g of a cuda backend and the
 * daemon's device pointer to its pool. Returns 0, or KVP_EUNAVAIL (not a cuda backend, or g
 * out of range). */
int kvp_backend_cuda_device(const kvp_backend_t *b, uint32_t g, int *ordinal, void **pool_base);

/* 1 when this build has CUDA and at least one GPU is usable (driver present,
 * cudaGetDeviceCount > 0), else 0. */
int kvp_backend_cuda_probe(void);

#endif
