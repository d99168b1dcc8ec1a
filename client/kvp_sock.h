/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_sock.h - blocking framed I/O on a connected Unix stream socket: connect to a path, send
 * one frame (4-byte little-endian length + payload) with file descriptors attached, receive
 * one frame with the descriptors that came with it, all bounded by an absolute deadline. This
 * is what libkvpool and the tests use; the daemon frames on its libuv loop instead. It knows
 * nothing of protobuf: a frame is bytes.
 */
#ifndef KVP_SOCK_H
#define KVP_SOCK_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* No deadline: wait for as long as it takes. */
#define KVP_SOCK_NO_DEADLINE UINT64_MAX

/* Now on CLOCK_MONOTONIC, in nanoseconds. */
uint64_t kvp_sock_now_ns(void);

/* The absolute deadline timeout_ms from now (CLOCK_MONOTONIC ns); 0 gives KVP_SOCK_NO_DEADLINE. */
uint64_t kvp_sock_deadline(uint32_t timeout_ms);

/*
 * Connects a new AF_UNIX SOCK_STREAM socket (close-on-exec) to `path` and stores it in *fd.
 * timeout_ms bounds the wait when the listener's backlog is full (0: no bound). Returns 0,
 * KVP_EINVAL (NULL arguments, empty path or one too long for sun_path), KVP_ETIMEDOUT, or
 * -errno of socket/connect (-ENOENT: no socket there, -ECONNREFUSED: nobody listening,
 * -EACCES). *fd is untouched on failure. The caller owns and closes the fd.
 */
int kvp_sock_connect(const char *path, uint32_t timeout_ms, int *fd);

/*
 * Sends one whole frame: `frame` holds len bytes, a 4-byte header whose value is len - 4,
 * then the payload. The num_fds descriptors in fds (at most KVP_MAX_FDS_PER_FRAME) go as
 * SCM_RIGHTS with the frame's first byte; they stay owned by the caller (the kernel passes
 * duplicates). Partial writes and EINTR are resumed, SIGPIPE is never raised. Returns 0,
 * KVP_EINVAL (bad arguments, header disagrees with len, too many fds), KVP_ECLOSED (peer
 * gone), KVP_ETIMEDOUT (deadline passed with the frame not fully written: the stream is then
 * out of step and must be closed), or -errno.
 */
int kvp_sock_send_frame(int fd, const void *frame, size_t len, const int *fds, unsigned num_fds,
                        uint64_t deadline_ns);

/*
 * Receives one frame. The payload (header stripped) lands in *buf, a malloc'd buffer of *cap
 * bytes owned by the caller, grown with realloc when the frame is larger (*buf may start NULL
 * with *cap 0; the caller frees it, also after an error). *len receives the payload length.
 * Reads exactly one frame and nothing of the next, so descriptors attached to a later frame
 * never arrive early.
 *
 * Descriptors that arrive with the frame are stored in fds[0 .. *num_fds) (close-on-exec;
 * the caller owns and closes them), up to max_fds of them; any beyond max_fds (all of them
 * when fds is NULL) are closed here. num_fds may be NULL when fds is.
 *
 * Returns 0; KVP_EINVAL (bad arguments); KVP_EPROTO when the header announces more than
 * max_frame_bytes or the sender attached more descriptors than a frame may carry; KVP_ECLOSED
 * on end of stream or reset (also in the middle of a frame); KVP_ETIMEDOUT when the deadline
 * passes first; KVP_ENOMEM; or -errno. On any error no descriptor is handed out (those
 * received are closed) and the caller should close the connection: a frame may be half read,
 * or its answer may still arrive and be taken for the next one.
 */
int kvp_sock_recv_frame(int fd, uint8_t **buf, size_t *cap, uint32_t *len, uint32_t max_frame_bytes,
                        int *fds, unsigned max_fds, unsigned *num_fds, uint64_t deadline_ns);

/*
 * kvp_sock_recv_frame for a peer that answers requests: it sends one frame per request and
 * nothing more until it is asked again (kvpoold to a libkvpool connection, which waits for
 * each answer before it sends the next request). Same arguments, results and ownership; the
 * header and the payload that arrived with it are read together, in one recvmsg (a frame read
 * in two costs a system call more per request). Bytes past the frame's end in that read mean
 * the peer broke the promise: KVP_EPROTO, the stream is out of step.
 */
int kvp_sock_recv_answer(int fd, uint8_t **buf, size_t *cap, uint32_t *len,
                         uint32_t max_frame_bytes, int *fds, unsigned max_fds, unsigned *num_fds,
                         uint64_t deadline_ns);

/* Polls fd without sleeping (zero-timeout ppoll in a loop) for up to spin_ns or until it is
 * readable, whichever comes first; returns 1 when readable, else 0. A caller that expects an
 * answer within microseconds calls it before kvp_sock_recv_frame, so that it never pays the
 * wake-up of a sleeping thread (tens of microseconds on a virtual machine). */
int kvp_sock_spin_readable(int fd, uint64_t spin_ns);

#ifdef __cplusplus
}
#endif
#endif
