/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_notify.h - systemd integration without libsystemd: the sd_notify(3) protocol (READY=1,
 * STATUS=..., WATCHDOG=1, STOPPING=1 datagrams to $NOTIFY_SOCKET), the watchdog interval, and
 * socket activation (sd_listen_fds(3) semantics).
 *
 * The protocol is a few environment variables and one datagram per notification, so it is
 * implemented here in full instead of linking libsystemd; the daemon then runs the same with
 * or without systemd (every call is a no-op when the variables are absent). Only AF_UNIX
 * notify sockets are supported (a path or an abstract '@' name), not vsock. Nothing here logs.
 */
#ifndef KVP_NOTIFY_H
#define KVP_NOTIFY_H

#include <stdint.h>
#include <sys/socket.h>
#include <sys/un.h>

#ifdef __cplusplus
extern "C" {
#endif

/* sd_listen_fds' SD_LISTEN_FDS_START: the first passed fd. */
#define KVP_LISTEN_FDS_START 3

/* Longest notification kvp_notify_send accepts, in bytes. */
#define KVP_NOTIFY_MAX_BYTES 4096

typedef struct {
    int fd; /* -1 when $NOTIFY_SOCKET was unset: every send is a no-op */
    struct sockaddr_un addr;
    socklen_t addr_len;
} kvp_notify_t;

/* Reads $NOTIFY_SOCKET and opens an AF_UNIX SOCK_DGRAM socket (close-on-exec) that
 * kvp_notify_send sends to. An absolute path is a filesystem socket; a leading '@' names an
 * abstract socket. When the variable is unset or empty, n->fd is -1 and 0 is returned. Returns
 * 0, KVP_EINVAL (n NULL, or a value that is neither absolute nor '@': e.g. a vsock address),
 * -ENAMETOOLONG (longer than sun_path), or -errno from socket(2). On error n->fd is -1. The
 * environment is left as it is. Caller closes with kvp_notify_close. */
int kvp_notify_open(kvp_notify_t *n);

/* Sends `state` (newline-separated "KEY=VALUE" assignments, e.g. "READY=1\nSTATUS=serving")
 * as one datagram, without its NUL. A no-op returning 0 when n->fd is -1. Returns 0, KVP_EINVAL
 * (NULL or longer than KVP_NOTIFY_MAX_BYTES) or -errno from sendto(2) (e.g. -ECONNREFUSED when
 * nothing listens). Blocking, at most microseconds; may be called from any one thread at a time.
 */
int kvp_notify_send(kvp_notify_t *n, const char *state);

/* Closes the socket; n->fd becomes -1. NULL and an unopened or closed n are no-ops. */
void kvp_notify_close(kvp_notify_t *n);

/* The watchdog interval the service manager expects: $WATCHDOG_USEC, when set and when
 * $WATCHDOG_PID is unset or equals getpid() (as sd_watchdog_enabled(0) reads them). *usec is 0
 * when the watchdog is off. The daemon should send "WATCHDOG=1" about every usec / 2. Returns
 * 0, or KVP_EINVAL (usec NULL, or a malformed or zero WATCHDOG_USEC or WATCHDOG_PID; *usec is
 * then 0). The environment is left as it is. */
int kvp_notify_watchdog_usec(uint64_t *usec);

/* Socket activation, as sd_listen_fds(1): when $LISTEN_PID equals getpid(), $LISTEN_FDS = n
 * sockets were passed as fds 3 .. 3+n-1. Sets FD_CLOEXEC on each, writes them to fds[0..n) and
 * returns n. Returns 0 when nothing was passed to this process (variables unset, another pid,
 * LISTEN_FDS=0); KVP_EINVAL (fds NULL with max > 0, or a malformed variable); KVP_ELIMIT when
 * n > max (the fds are still made close-on-exec, fds[] holds the first max); -EBADF when a
 * passed fd is not open. On every path LISTEN_PID, LISTEN_FDS and LISTEN_FDNAMES are unset
 * afterwards, so they are not inherited by children. Not thread-safe (setenv): call at start.
 * The caller owns the returned fds. */
int kvp_listen_fds(int *fds, int max);

#ifdef __cplusplus
}
#endif
#endif
