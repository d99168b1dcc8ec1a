/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_frame.h - the daemon's frame reader: what one connection has received (bytes, and the
 * descriptors that came with them as SCM_RIGHTS), cut into frames (4-byte little-endian length
 * + payload, DESIGN.md §5), each with exactly the fds that arrived with its own bytes.
 *
 * Pure bookkeeping: it reads no socket and closes no descriptor itself (the fds it drops go
 * to a callback), so unit tests and the fuzzer (tests/fuzz/fuzz_frame.c) drive it with made-up
 * streams and made-up fd numbers. The server does the recvmsg into kvp_frame_reader_space and
 * reports what arrived with kvp_frame_reader_commit. One reader per connection; not
 * thread-safe.
 *
 * Which frame gets a read's fds: the one that holds the read's last byte. Linux's Unix
 * stream recvmsg copies from every queued message until the buffer is full or it has copied
 * one that carries descriptors, and stops right after that one; so when a client pipelines a
 * frame without fds and then one with fds (sent, as the protocol says, by a sendmsg that
 * starts that frame), one read can hold the end of the first and the start of the second, and
 * only its end belongs to the frame the fds were sent with. (Attributing them to the read's
 * first byte, as this reader first did, gave them to the wrong frame; test_frame pins the
 * kernel behaviour on a real socket pair.)
 */
#ifndef KVP_FRAME_H
#define KVP_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "kvp_wire.h"

/* Descriptors: no request takes more than one (RegisterBuffer), so a read, and a frame, may
 * carry at most KVP_FRAME_MAX_FDS_PER_FRAME, and a connection holds at most
 * KVP_FRAME_MAX_PENDING_FDS for frames not yet complete. A read past either bound is the
 * client abusing the protocol: its fds are dropped at once and the server answers with an
 * error and closes (issue #15: fds parked on partial frames exhausted the daemon's table). */
#define KVP_FRAME_MAX_FDS_PER_FRAME 4
#define KVP_FRAME_MAX_PENDING_FDS   4     /* fds received and not yet taken by a frame */
#define KVP_FRAME_GROW_BYTES        65536 /* read buffer growth step (and first size) */

typedef struct {
    int fd;
    uint64_t at; /* stream offset of the last byte read together with it */
} kvp_frame_fd_t;

/* Called for every descriptor the reader gives up (the server closes it). */
typedef void (*kvp_frame_drop_fn)(int fd, void *arg);

typedef struct {
    uint8_t *buf;
    size_t cap;        /* bytes allocated, at most max_frame_bytes + header */
    size_t head;       /* bytes of buf already handed out as frames */
    size_t len;        /* bytes of buf received */
    uint64_t rx_total; /* bytes received in all: stream offset of buf[len] */
    uint32_t max_frame_bytes;
    uint32_t grow_bytes; /* KVP_FRAME_GROW_BYTES unless a test sets it smaller */
    kvp_frame_fd_t fds[KVP_FRAME_MAX_PENDING_FDS];
    int nfds;
    kvp_frame_drop_fn drop;
    void *drop_arg;
} kvp_frame_reader_t;

/* One frame cut by kvp_frame_reader_next. */
typedef struct {
    const uint8_t *payload; /* borrowed from the reader: valid until the next call of
                               kvp_frame_reader_space, _compact or _free */
    uint32_t len;           /* payload bytes (the announced length for an oversize frame) */
    int fds[KVP_FRAME_MAX_FDS_PER_FRAME]; /* owned by the caller from now on */
    int nfds;
} kvp_frame_t;

/* Sets up an empty reader (no memory is taken until the first kvp_frame_reader_space).
 * max_frame_bytes >= 1. drop (not NULL) receives each fd the reader gives up. */
void kvp_frame_reader_init(kvp_frame_reader_t *r, uint32_t max_frame_bytes, kvp_frame_drop_fn drop,
                           void *drop_arg);

/* Drops the pending fds and frees the buffer; the reader may be initialised again. */
void kvp_frame_reader_free(kvp_frame_reader_t *r);

/* Where the next read may write: *p and *n (> 0). Moves unconsumed bytes to the front when
 * that makes room and grows the buffer by grow_bytes steps up to one largest frame, so a
 * connection holds at most max_frame_bytes + 4 bytes however much its client sends. Returns
 * 0; KVP_EBUSY when the buffer is full (it then holds a whole frame: take it first, or the
 * header announced an oversize one); KVP_ENOMEM. */
int kvp_frame_reader_space(kvp_frame_reader_t *r, uint8_t **p, size_t *n);

/* Bytes the next kvp_frame_reader_space would add to the buffer (0: it fits in what is
 * allocated), so the server can check its memory budget before it lets the reader grow. */
size_t kvp_frame_reader_growth(const kvp_frame_reader_t *r);

/* Gives back memory after a large frame: when fewer than grow_bytes bytes are pending and
 * more than grow_bytes are allocated, moves them to the front and shrinks the buffer to
 * grow_bytes (a failed shrink keeps the buffer). Pointers from _next become invalid. */
void kvp_frame_reader_trim(kvp_frame_reader_t *r);

/* Records that n bytes were written at the place kvp_frame_reader_space gave and that the fds
 * (nfds >= 0) came with them. Returns 0, or KVP_ELIMIT when the read carried more than
 * KVP_FRAME_MAX_FDS_PER_FRAME fds or more would be pending than KVP_FRAME_MAX_PENDING_FDS:
 * then ALL of this read's fds were dropped (the bytes are kept) and the client is abusing the
 * protocol (answer with an error and close it). */
int kvp_frame_reader_commit(kvp_frame_reader_t *r, size_t n, const int *fds, int nfds);

/* Cuts the next frame. Returns 1 with *f filled; 0 when no complete frame is buffered;
 * KVP_ELIMIT when the next header announces more than max_frame_bytes (f->len holds the
 * announced length; the stream cannot be resynchronised: close the connection). The frame's
 * fds are those whose read ended within its bytes (at most KVP_FRAME_MAX_FDS_PER_FRAME; more
 * are dropped); fds that arrived with earlier frames and were not taken are dropped. */
int kvp_frame_reader_next(kvp_frame_reader_t *r, kvp_frame_t *f);

/* 1 when a whole frame (or an oversize header) waits to be cut, else 0. */
int kvp_frame_reader_ready(const kvp_frame_reader_t *r);

/* Bytes received and not yet cut into frames. */
size_t kvp_frame_reader_pending(const kvp_frame_reader_t *r);

#endif
