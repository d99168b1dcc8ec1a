/* SPDX-License-Identifier: Apache-2.0 */
/* kvp_harness.c - see kvp_harness.h. */
#include "kvp_harness.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef KVPOOLD_PATH
#define KVPOOLD_PATH "kvpoold"
#endif

static int try_connect(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
    int ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
    if (fd >= 0)
        close(fd);
    return ok;
}

void kvp_daemon_dump_log(const kvp_daemon_t *d)
{
    FILE *f = fopen(d->log, "r");
    if (!f)
        return;
    char line[1024];
    fprintf(stderr, "---- kvpoold log (%s) ----\n", d->log);
    while (fgets(line, sizeof(line), f))
        fputs(line, stderr);
    fprintf(stderr, "---- end of log ----\n");
    fclose(f);
}

int kvp_daemon_wrapped(void)
{
    const char *w = getenv("KVP_TEST_DAEMON_WRAPPER");
    return w && *w;
}

int kvp_daemon_start(kvp_daemon_t *d, const char *const *extra)
{
    return kvp_daemon_start_opts(d, extra, NULL);
}

int kvp_daemon_start_shared(kvp_daemon_t *d, const char *const *extra)
{
    const char *args[48] = {"--backend",      "host",
                            "--num-layers",   "2",
                            "--num-pages",    "64",
                            "--page-size",    "4",
                            "--num-kv-heads", "2",
                            "--head-dim",     "16",
                            "--set",          "server.socket_mode=0666"};
    int n = 14;
    for (int i = 0; extra && extra[i]; i++) {
        if (n == 46)
            return -1;
        args[n++] = extra[i];
    }
    args[n] = NULL;
    if (kvp_daemon_start(d, args))
        return -1;
    /* let other users reach the socket: the directory is mkdtemp's 0700 */
    return chmod(d->dir, 0755) ? -1 : 0;
}

int kvp_daemon_start_opts(kvp_daemon_t *d, const char *const *extra, const kvp_daemon_opts_t *opts)
{
    memset(d, 0, sizeof(*d));
    snprintf(d->dir, sizeof(d->dir), "/tmp/kvpool-test-XXXXXX");
    if (!mkdtemp(d->dir))
        return -1;
    snprintf(d->sock, sizeof(d->sock), "%s/kvpool.sock", d->dir);
    snprintf(d->log, sizeof(d->log), "%s/kvpoold.log", d->dir);
    const char *bin = getenv("KVPOOLD") ? getenv("KVPOOLD") : KVPOOLD_PATH;
    const char *argv[96];
    int n = 0;
    /* the wrapper's words first (a private copy, split on spaces) */
    static char wrap[1024];
    snprintf(wrap, sizeof(wrap), "%s",
             getenv("KVP_TEST_DAEMON_WRAPPER") ? getenv("KVP_TEST_DAEMON_WRAPPER") : "");
    for (char *save = NULL, *w = strtok_r(wrap, " ", &save); w && n < 24;
         w = strtok_r(NULL, " ", &save))
        argv[n++] = w;
    const char *exe = n ? argv[0] : bin;
    argv[n++] = bin;
    argv[n++] = "--socket";
    argv[n++] = d->sock;
    argv[n++] = "--log-level";
    argv[n++] = getenv("KVP_TEST_LOG_LEVEL") ? getenv("KVP_TEST_LOG_LEVEL") : "info";
    for (int i = 0; extra && extra[i] && n < 94; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    d->pid = fork();
    if (d->pid < 0)
        return -1;
    if (d->pid == 0) {
        int fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1); /* not the test's stdout: a pipe held open by the daemon */
            dup2(fd, 2);
            close(fd);
        }
        unsetenv("NOTIFY_SOCKET");
        unsetenv("LISTEN_FDS");
        unsetenv("LISTEN_PID");
        if (opts && opts->nofile) {
            struct rlimit rl = {opts->nofile, opts->nofile};
            if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
                _exit(126);
        }
        execvp(exe, (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", exe, strerror(errno));
        _exit(127);
    }
    int tries = kvp_daemon_wrapped() ? 12000 : 1000;
    for (int i = 0; i < tries; i++) {
        if (try_connect(d->sock))
            return 0;
        int st;
        if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
            d->pid = 0;
            kvp_daemon_dump_log(d);
            return -1;
        }
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    kvp_daemon_dump_log(d);
    kvp_daemon_stop(d, SIGKILL);
    return -1;
}

int kvp_daemon_stop(kvp_daemon_t *d, int sig)
{
    int code = -1;
    if (d->pid > 0) {
        if (sig)
            kill(d->pid, sig);
        int st;
        while (waitpid(d->pid, &st, 0) < 0 && errno == EINTR)
            ;
        code = WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : -1;
        d->pid = 0;
        if (code != 0 && sig != SIGKILL)
            kvp_daemon_dump_log(d);
    }
    unlink(d->sock);
    unlink(d->log);
    rmdir(d->dir);
    return code;
}

int kvp_daemon_fd_count(const kvp_daemon_t *d)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)d->pid);
    DIR *dir = opendir(path);
    if (!dir)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dir)))
        if (e->d_name[0] != '.')
            n++;
    closedir(dir);
    return n;
}

long kvp_daemon_rss_kib(const kvp_daemon_t *d)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)d->pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    long kib = -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
            break;
    fclose(f);
    return kib;
}

static uint64_t monotonic_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

int kvp_wait_until(int (*cond)(void *arg), void *arg, unsigned timeout_ms)
{
    const uint64_t end = monotonic_ms() + (uint64_t)timeout_ms * (kvp_daemon_wrapped() ? 12 : 1);
    for (;;) {
        if (cond(arg))
            return 1;
        if (monotonic_ms() >= end)
            return 0;
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL); /* EINTR: one poll early, harmless */
    }
}
