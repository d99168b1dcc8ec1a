/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_cuda_internal.h - what the cuda backend's two files share: the backend, device
 * and worker-buffer state, and the three functions one file calls in the other. The pool, its
 * export, the buffers, events, health and create/destroy are kvp_backend_cuda.c's; running a
 * plan (ops->run: the worker's ready event, the staging, the copies and the append) is
 * kvp_backend_cuda_run.c's. Built with CUDA only; nothing above backend/ includes it.
 */
#ifndef KVP_BACKEND_CUDA_INTERNAL_H
#define KVP_BACKEND_CUDA_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "kvp_backend.h"
#include "kvp_cuda_util.h"

#define STAGE_MIN_BYTES (64u << 10) /* first size of a staging slot and the device copy */
/* Longest wait for a worker's ready event (SYNC_EVENT) by default; tuning.ready_timeout_ms
 * ([tuning] cuda_ready_timeout_ms) overrides it when the backend is created (tests use a short
 * one). */
#define READY_TIMEOUT_MS 30000

/* Pinned host staging for one run's plan arrays. One per device is enough: a run holds the
 * device's lock and waits for its stream before it returns, so the next run finds the upload
 * and the error-word read-back of the previous one done. */
typedef struct {
    int32_t *host;
    size_t cap_bytes;
    size_t err_word; /* index of the run's error word in host[] */
} stage_t;

typedef struct {
    int ordinal;
    kvp_cuda_vmm_t pool;
    int export_fd;
    cudaStream_t stream;
    pthread_mutex_t lock; /* everything below, and the order of work on stream */
    int lock_ready;
    stage_t stage;
    int32_t *dev_words; /* the plan arrays on the device: stream-ordered, so one suffices */
    size_t dev_cap_bytes;
} cuda_dev_t;

typedef struct {
    kvp_backend_t base;
    uint32_t num_devices;
    cuda_dev_t *dev;
    atomic_int poisoned;
    uint64_t ready_timeout_ms;
    int plan_upload; /* tuning.plan_upload: every Append uploads its plan and runs the
                        page-table kernels (the path of batches over KVP_APPEND_SLOTS_MAX or with
                        copies), to compare the two in one build */
    /* the host tier's slot mover's streams and staging (kvp_backend_cuda_slots.c), made on its
     * first use; freed by kvp__backend_cuda_slots_free */
    _Atomic(struct kvp__cuda_slots *) slots;
} cuda_backend_t;

/* A worker buffer as the daemon holds it (kvp_buffer_t.priv). */
typedef struct {
    uint32_t dev; /* index into cuda_backend_t.dev */
    uint32_t kind;
    kvp_cuda_vmm_t vmm;  /* BUFFER_CUDA_VMM_FD */
    void *ipc_ptr;       /* BUFFER_CUDA_IPC: from cudaIpcOpenMemHandle */
    void *host_map;      /* BUFFER_MEMFD: the mapping, registered with CUDA */
    size_t host_bytes;   /* its length */
    const uint8_t *dptr; /* where the kernels read */
    cudaEvent_t ready;   /* the worker's interprocess event, NULL if none */
    cudaEvent_t done;    /* ours, interprocess, NULL if none: handed out, never recorded */
} cuda_buf_t;

/* Marks the backend unusable (health() fails from then on) and logs why, once. Any thread. */
void kvp__backend_cuda_poison(cuda_backend_t *cb, const char *why);

/* Makes dv's device copy of the plan hold at least bytes, in stream order (no
 * synchronisation). 0 or the failing call's code. The caller holds dv->lock or owns dv. */
int kvp__backend_cuda_dev_reserve(cuda_dev_t *dv, size_t bytes);

/* Frees the slot mover's streams and staging (no move_slots may be running). Loop thread. */
void kvp__backend_cuda_slots_free(cuda_backend_t *cb);

/* ops->run of the cuda backend (kvp_backend.h). Copy worker thread. */
int kvp__backend_cuda_run(kvp_backend_t *b, const kvp_exec_t *e);

#endif
