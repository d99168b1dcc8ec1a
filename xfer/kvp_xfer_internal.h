/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_xfer_internal.h - what the two files of the transfer engine share: the engine's state
 * (communicators, jobs) and the stream's header. kvp_xfer.c is the loop thread's half (checks,
 * the communicator cache, jobs begun and finished, the list and counters); kvp_xfer_run.c the
 * worker thread's (the NCCL stream: staging, the chunk pipeline over the backend's
 * page-mover, waits and aborts). Nothing outside xfer/ includes it.
 */
#ifndef KVP_XFER_INTERNAL_H
#define KVP_XFER_INTERNAL_H

#include <stdint.h>

#include "kvp_nccl.h"
#include "kvp_xfer.h"

#ifdef KVP_HAVE_NCCL
#include "kvp_cuda_util.h"
#endif

#define MAX_TIMEOUT_MS 3600000u
#define HDR_MAGIC      0x5850564bu /* "KVPX" little-endian */
#define HDR_VERSION    2u
#define DRAIN_MS       10000u       /* longest wait for an aborted transfer's stream */
#define CHUNK_AUTO_MAX (256u << 20) /* automatic largest chunk (staging: 2 per side per comm) */
#define CHUNK_AUTO_MIN (4u << 20)
#define CHUNK_TAIL     (4u << 20) /* the schedule's smallest chunk (kvp_xfer_chunk_at) */
#define CHUNK_LIMIT    (1u << 30) /* transfer.chunk_bytes's maximum; an importer refuses more */
#define NSTAGE         4u         /* most staging chunks per side ([tuning] xfer_stages: 2..4) */
#define SPIN_US        20000u     /* a wait spins this long, then naps (see poll_pause) */

typedef struct comm {
    struct comm *next;
    uint8_t id[KVP_XFER_ID_BYTES];
    char peer[65];
    int rank; /* 0 exporter, 1 importer */
    int busy; /* a job holds it */
    int broken;
    uint64_t last_used_ms;
#ifdef KVP_HAVE_NCCL
    ncclComm_t comm; /* NULL until the first transfer joins */
    cudaStream_t stream;
    cudaStream_t side;                           /* pack / unpack of the chunks */
    cudaEvent_t filled[NSTAGE], drained[NSTAGE]; /* staging buffer b: packed or received; sent or
                                                    unpacked */
    uint8_t *stage[NSTAGE]; /* the staging chunks (device memory), stage_cap each */
    int nstage;             /* how many of them exist */
    size_t stage_cap;
    int stage_reg;            /* the chunks come from ncclMemAlloc, registered with the comm */
    void *reg_handle[NSTAGE]; /* their ncclCommRegister handles */
#endif
} comm_t;

struct kvp_xfer_job {
    kvp_xfer_t *x;
    struct kvp_xfer_job *next; /* running list */
    comm_t *comm;
    int direction;
    uint64_t transfer_id;
    uint32_t num_tokens, num_pages; /* of the whole set */
    uint32_t nseq;                  /* sequences in the set */
    uint32_t *tokens;               /* [nseq] */
    uint32_t *page_off;             /* [nseq + 1]: sequence i's pages start at pages[page_off[i]] */
    uint64_t *stream_off;           /* [nseq + 1]: its stream bytes start at stream_off[i] */
    uint32_t seq_hash;              /* kvp_xfer_set_hash of tokens */
    int32_t *pages;
    uint64_t bytes;
    uint32_t timeout_ms;
#ifdef KVP_TEST_HOOKS
    uint32_t stall_ms; /* test hook, exporter only */
#endif
    size_t chunk;           /* staging chunk bytes: the exporter's choice, the header's on import */
    int reg;                /* staging registered with NCCL: the exporter's choice, the ticket's */
    kvp_xfer_stream_t wire; /* import: the stream's shape as the ticket gives it */
    void *trace;            /* gpu_trace_t at debug level */
    uint64_t start_us;      /* when the worker thread took it (timing log) */
    int clean;              /* the failure was a refusal both sides agreed on: the communicator is
                               still in step and stays cached */
    int rc;
    char msg[128];
    kvp_xfer_info_t info;
};

struct kvp_xfer {
    kvp_backend_t *b;
    kvp_xfer_config_t cfg;
    comm_t *comms;
    kvp_xfer_job_t *running;
    uint32_t in_flight;
    kvp_xfer_info_t hist[KVP_XFER_HISTORY];
    uint32_t hist_next, hist_count;
    uint64_t totals[2][2], bytes[2];
    uint64_t next_id;
#ifdef KVP_TEST_HOOKS
    uint32_t stall_ms;   /* test hook: the exporter pauses after the header */
    uint32_t chunk_test; /* test hook: overrides transfer.chunk_bytes (else 0) */
#endif
    int reg;    /* b->tuning.xfer_register: register the staging chunks with NCCL */
    int prio;   /* b->tuning.xfer_priority: NCCL's stream high, pack's low */
    int nstage; /* staging chunks per side: b->tuning.xfer_stages, default 2 */
};

/* The first message of every transfer. */
typedef struct {
    uint32_t magic, version;
    uint64_t transfer_id;
    uint32_t num_tokens, num_layers, num_heads, head_dim, elem_bytes, chunk_bytes;
    uint64_t stream_bytes;
    uint32_t flags;    /* KVP_XFER_REGISTERED: the importer registers its staging chunks too */
    uint32_t num_seqs; /* a set: its sequences, one stream after the other */
    uint32_t seq_hash; /* of their token counts (kvp_xfer_set_hash) */
    uint8_t reserved[4];
} wire_hdr_t;
_Static_assert(sizeof(wire_hdr_t) == 64, "the header is 64 bytes on the wire");

/* Monotonic milliseconds (the engine's deadlines). */
uint64_t kvp__xfer_mono_ms(void);

#ifdef KVP_HAVE_NCCL
/* Frees the staging chunks of c (kvp_xfer_run.c; their streams have drained). */
void kvp__xfer_stage_free(const kvp_nccl_t *n, comm_t *c);
#endif

#endif
