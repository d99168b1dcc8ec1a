/* SPDX-License-Identifier: Apache-2.0 */
/* kvp_redis.c - a redis-server to measure against and a PING client (see kvp_redis.h). */
#include "kvp_redis.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

int kvp_redis_connect(const char *path)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(a.sun_path))
        return -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    memcpy(a.sun_path, path, strlen(path) + 1);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) < 0) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    return fd;
}

int kvp_redis_ping(int fd)
{
    static const char cmd[] = "*1\r\n$4\r\nPING\r\n";
    if (write(fd, cmd, sizeof(cmd) - 1) != (ssize_t)sizeof(cmd) - 1)
        return -1;
    char buf[16];
    size_t got = 0;
    while (got < 7) {
        ssize_t n = read(fd, buf + got, sizeof(buf) - got);
        if (n <= 0)
            return -1;
        got += (size_t)n;
    }
    return memcmp(buf, "+PONG\r\n", 7) == 0 ? 0 : -1;
}

pid_t kvp_redis_start(const char *dir, char *sock, size_t len)
{
    if (access("/usr/bin/redis-server", X_OK) != 0)
        return -1;
    snprintf(sock, len, "%s/redis.sock", dir);
    pid_t p = fork();
    if (p == 0) {
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 1);
        dup2(null, 2);
        execl("/usr/bin/redis-server", "redis-server", "--port", "0", "--unixsocket", sock,
              "--save", "", "--appendonly", "no", "--dir", dir, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 500; i++) {
        int fd = kvp_redis_connect(sock);
        if (fd >= 0) {
            close(fd);
            return p;
        }
        usleep(10000);
    }
    kill(p, SIGKILL);
    waitpid(p, NULL, 0);
    return -1;
}
