/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_internal.h - what the backends' files share and nothing above backend/ sees:
 * the page-mover's split of a packed range into per-layer pieces, the slot mover's shared
 * check, and the cuda backend's page-mover (kvp_backend_cuda_move.c) and slot mover
 * (kvp_backend_cuda_slots.c) its ops table points at.
 */
#ifndef KVP_BACKEND_INTERNAL_H
#define KVP_BACKEND_INTERNAL_H

#include "kvp_backend.h"

/* Calls each(arg, layer, lo, hi, buf_off) for every per-layer piece of m's range, in order:
 * bytes [lo, hi) of that layer's packed part are bytes [buf_off, buf_off + hi - lo) of m->buf.
 * Stops at and returns the first nonzero code; 0 when all ran. m checked by the caller. */
int kvp__backend_move_pieces(const kvp_backend_t *b, const kvp_move_t *m,
                             int (*each)(void *arg, uint32_t layer, uint64_t lo, uint64_t hi,
                                         uint64_t buf_off),
                             void *arg);

/* Checks m against b, the part of ops->move_slots every backend shares: direction, n > 0,
 * pages, slots and every slot address not NULL (KVP_EINVAL), then every page id < num_pages
 * (KVP_ERANGE). 0 when it may run. */
int kvp__backend_slot_move_check(const kvp_backend_t *b, const kvp_slot_move_t *m);

/* The cuda backend's ops->move_slots (kvp_backend_cuda_slots.c). */
int kvp__backend_cuda_move_slots(kvp_backend_t *b, const kvp_slot_move_t *m);

/* The cuda backend's ops->move (kvp_backend_cuda_move.c). */
int kvp__backend_cuda_move(kvp_backend_t *b, const kvp_move_t *m);

/* The cuda backend's ops->gather (kvp_backend_cuda_gather.c). */
int kvp__backend_cuda_gather(kvp_backend_t *b, const kvp_gather_t *g);

#endif
