/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_internal.h - what the backends' files share and nothing above backend/ sees:
 * the page-mover's split of a packed range into per-layer pieces, and the cuda backend's
 * page-mover (kvp_backend_cuda_move.c) its ops table points at.
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

/* The cuda backend's ops->move (kvp_backend_cuda_move.c). */
int kvp__backend_cuda_move(kvp_backend_t *b, const kvp_move_t *m);

#endif
