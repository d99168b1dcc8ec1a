/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_notify.c - sd_notify(3), sd_watchdog_enabled(3) and sd_listen_fds(3) re-implemented on
 * plain sockets and environment variables (see kvp_notify.h). Values from the environment are
 * parsed strictly: a malformed variable is an error, never a guess.
 */
#include "kvp_notify.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvp_error.h"

/* Parses a decimal unsigned integer that is the whole string (no sign, no space). */
static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    if (!s || *s < '0' || *s > '9')
        return KVP_EINVAL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end)
        return KVP_EINVAL;
    *out = v;
    return 0;
}

int kvp_notify_open(kvp_notify_t *n)
{
    if (!n)
        return KVP_EINVAL;
    memset(n, 0, sizeof(*n));
    n->fd = -1;
    const char *e = getenv("NOTIFY_SOCKET");
    if (!e || !*e)
        return 0;
    size_t len = strlen(e);
    if ((e[0] != '/' && e[0] != '@') || (e[0] == '@' && len < 2))
        return KVP_EINVAL;
    if (len > sizeof(n->addr.sun_path) - (e[0] == '/')) /* a path needs its NUL */
        return -ENAMETOOLONG;

    n->addr.sun_family = AF_UNIX;
    memcpy(n->addr.sun_path, e, len);
    if (e[0] == '@')
        n->addr.sun_path[0] = '\0'; /* abstract: the name is exactly the following bytes */
    n->addr_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len + (e[0] == '/'));

    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    n->fd = fd;
    return 0;
}

int kvp_notify_send(kvp_notify_t *n, const char *state)
{
    if (!n || !state)
        return KVP_EINVAL;
    size_t len = strlen(state);
    if (len > KVP_NOTIFY_MAX_BYTES)
        return KVP_EINVAL;
    if (n->fd < 0)
        return 0;
    for (;;) {
        ssize_t w =
            sendto(n->fd, state, len, MSG_NOSIGNAL, (const struct sockaddr *)&n->addr, n->addr_len);
        if (w >= 0)
            return (size_t)w == len ? 0 : -EMSGSIZE;
        if (errno != EINTR)
            return -errno;
    }
}

void kvp_notify_close(kvp_notify_t *n)
{
    if (!n || n->fd < 0)
        return;
    close(n->fd);
    n->fd = -1;
}

int kvp_notify_watchdog_usec(uint64_t *usec)
{
    if (!usec)
        return KVP_EINVAL;
    *usec = 0;
    const char *e = getenv("WATCHDOG_USEC");
    if (!e)
        return 0;
    uint64_t v;
    if (parse_u64(e, &v) < 0 || v == 0)
        return KVP_EINVAL;
    const char *p = getenv("WATCHDOG_PID");
    if (p) {
        uint64_t pid;
        if (parse_u64(p, &pid) < 0 || pid == 0)
            return KVP_EINVAL;
        if (pid != (uint64_t)getpid())
            return 0; /* meant for another process (e.g. our parent) */
    }
    *usec = v;
    return 0;
}

static void unset_listen_env(void)
{
    unsetenv("LISTEN_PID");
    unsetenv("LISTEN_FDS");
    unsetenv("LISTEN_FDNAMES");
}

int kvp_listen_fds(int *fds, int max)
{
    int r;
    uint64_t pid, n;
    const char *e;
    if (max < 0 || (max > 0 && !fds)) {
        r = KVP_EINVAL;
        goto unset_env;
    }
    e = getenv("LISTEN_PID");
    if (!e) {
        r = 0;
        goto unset_env;
    }
    if (parse_u64(e, &pid) < 0 || pid == 0) {
        r = KVP_EINVAL;
        goto unset_env;
    }
    if (pid != (uint64_t)getpid()) {
        r = 0;
        goto unset_env;
    }
    e = getenv("LISTEN_FDS");
    if (!e) {
        r = 0;
        goto unset_env;
    }
    if (parse_u64(e, &n) < 0 || n > (uint64_t)(INT_MAX - KVP_LISTEN_FDS_START)) {
        r = KVP_EINVAL;
        goto unset_env;
    }
    for (int i = 0; i < (int)n; i++) {
        int fd = KVP_LISTEN_FDS_START + i;
        int flags = fcntl(fd, F_GETFD);
        if (flags < 0 || fcntl(fd, F_SETFD, flags | FD_CLOEXEC) < 0) {
            r = -errno;
            goto unset_env;
        }
        if (i < max)
            fds[i] = fd;
    }
    r = (int)n > max ? KVP_ELIMIT : (int)n;
unset_env:
    unset_listen_env();
    return r;
}
