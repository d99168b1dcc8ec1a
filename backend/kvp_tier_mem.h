/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_tier_mem.h - the host tier's memory (issue #28): nslots slots of one page's packed form
 * (kvp_backend_slot_bytes) in host memory the backend's slot mover (ops->move_slots) reads and
 * writes. The host backend's is a second memfd, mapped shared; the cuda backend's is anonymous
 * memory pinned with cudaHostRegister. The address space is reserved at create; populating and
 * pinning run chunk by chunk on a thread of this object, so create returns at once and the
 * slots become usable as a growing prefix [0, ready). Not here: which slot holds what (the
 * prefix cache's host slots), the copies (ops->move_slots), shrinking (the cache stops using
 * slots beyond a lowered limit; the memory stays until destroy).
 */
#ifndef KVP_TIER_MEM_H
#define KVP_TIER_MEM_H

#include <stdint.h>

#include "kvp_backend.h"

typedef struct kvp_tier_mem kvp_tier_mem_t;

/* Memory for nslots slots of slot_bytes (at least kvp_backend_slot_bytes(b)) for backend b: the
 * host backend, a second memfd (memfd_create "kvpool-host-tier", mapped shared); the cuda
 * backend, anonymous memory pinned with cudaHostRegister (portable, mapped) chunk by chunk.
 * Address space for all of it is reserved here; the memory is populated (fallocate on the memfd,
 * MADV_POPULATE_WRITE or a touch of every page) and, on cuda, pinned in chunks of chunk_bytes
 * (0: 1 GiB; rounded down to whole slots, at least one, then up so a chunk ends on a page
 * boundary) by a thread of its own, so create returns at once (the daemon is ready before the
 * tier is). numa_node >= 0: the memory is bound to that node with mbind(2) (MPOL_BIND, via
 * syscall: no libnuma) before any of it is populated; -1: the default policy. Returns 0 and
 * *out (the caller destroys it with kvp_tier_mem_destroy), KVP_EINVAL (NULL b or out, nslots or
 * slot_bytes 0 or too small, numa_node < -1 or a node mbind refuses, total bytes overflow),
 * KVP_ENOMEM (no address space, no thread), KVP_EUNAVAIL (a cuda backend in a build without
 * CUDA) or -errno (memfd_create, ftruncate, mbind). Loop thread; *out untouched on failure. */
int kvp_tier_mem_create(kvp_backend_t *b, uint64_t nslots, uint64_t slot_bytes,
                        uint64_t chunk_bytes, int numa_node, kvp_tier_mem_t **out);

/* Slots ready to use now (populated, and pinned on cuda): a prefix [0, ready) that grows chunk by
 * chunk and never shrinks. Any thread (an atomic, acquire: the memory below it is ready). */
uint64_t kvp_tier_mem_ready_slots(const kvp_tier_mem_t *m);

/* The nslots of create. Any thread. */
uint64_t kvp_tier_mem_nslots(const kvp_tier_mem_t *m);

/* Bytes populated (and pinned) so far: ready_slots * slot_bytes. Any thread. */
uint64_t kvp_tier_mem_ready_bytes(const kvp_tier_mem_t *m);

/* 1 once the thread finished (all slots ready, or it stopped on an error: kvp_tier_mem_error,
 * or destroy stopped it), else 0. Any thread. */
int kvp_tier_mem_done(const kvp_tier_mem_t *m);

/* 0, or the code the thread stopped on (KVP_ENOMEM: the kernel could not give the memory;
 * another code from cudaHostRegister); the slots ready before it stay usable. Any thread. */
int kvp_tier_mem_error(const kvp_tier_mem_t *m);

/* Address of slot i (< nslots, asserted; its bytes are meaningful only below ready):
 * base + i * slot_bytes. Any thread. */
void *kvp_tier_mem_slot(const kvp_tier_mem_t *m, uint64_t i);

/* Stops the thread (after the chunk it is on) and joins it, unpins what it pinned, unmaps,
 * closes the memfd. No move may be using the memory. NULL: no-op. Loop thread. */
void kvp_tier_mem_destroy(kvp_tier_mem_t *m);

#endif
