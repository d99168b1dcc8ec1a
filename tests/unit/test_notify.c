/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_notify.c - the sd_notify protocol against real datagram sockets (a path and an abstract
 * name), the no-op without $NOTIFY_SOCKET, the watchdog variables, and socket activation with
 * sockets placed at fds 3 and 4. The activation cases run in a child process of their own,
 * because fds 3 and 4 may belong to Check's runner: the child reports the line of its first
 * failed check as its exit status.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_notify.h"

static char dir[64];

/* A bound datagram socket at a fresh temporary path; the path goes to NOTIFY_SOCKET. */
static int receiver_at_path(char *path, size_t len)
{
    snprintf(dir, sizeof(dir), "/tmp/kvp-test-notify-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(path, len, "%s/notify.sock", dir);
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    ck_assert_int_ge(fd, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    ck_assert_uint_lt(strlen(path), sizeof(a.sun_path));
    memcpy(a.sun_path, path, strlen(path) + 1);
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    return fd;
}

static void remove_receiver(int fd, const char *path)
{
    close(fd);
    unlink(path);
    rmdir(dir);
}

/* Receives one datagram (waiting at most 5 s) and checks it is exactly `want`. */
static void expect_datagram(int fd, const char *want)
{
    char buf[8192];
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    ck_assert_int_eq(n, (ssize_t)strlen(want));
    ck_assert_int_eq(memcmp(buf, want, (size_t)n), 0);
}

static int cloexec(int fd)
{
    int flags = fcntl(fd, F_GETFD);
    return flags < 0 ? -1 : (flags & FD_CLOEXEC) != 0;
}

START_TEST(ready_and_watchdog_reach_a_path_socket)
{
    char path[128];
    int rx = receiver_at_path(path, sizeof(path));
    setenv("NOTIFY_SOCKET", path, 1);
    kvp_notify_t n;
    ck_assert_int_eq(kvp_notify_open(&n), 0);
    ck_assert_int_ge(n.fd, 0);
    ck_assert_int_eq(cloexec(n.fd), 1);
    ck_assert_str_eq(getenv("NOTIFY_SOCKET"), path); /* left in place */

    ck_assert_int_eq(kvp_notify_send(&n, "READY=1\nSTATUS=serving pages=2048"), 0);
    expect_datagram(rx, "READY=1\nSTATUS=serving pages=2048");
    ck_assert_int_eq(kvp_notify_send(&n, "WATCHDOG=1"), 0);
    expect_datagram(rx, "WATCHDOG=1");

    /* too long or NULL: refused, nothing sent */
    static char big[KVP_NOTIFY_MAX_BYTES + 2];
    memset(big, 'x', sizeof(big) - 1);
    ck_assert_int_eq(kvp_notify_send(&n, big), KVP_EINVAL);
    ck_assert_int_eq(kvp_notify_send(&n, NULL), KVP_EINVAL);
    big[KVP_NOTIFY_MAX_BYTES] = '\0'; /* the longest accepted */
    ck_assert_int_eq(kvp_notify_send(&n, big), 0);
    expect_datagram(rx, big);

    /* nothing listens any more */
    remove_receiver(rx, path);
    ck_assert_int_eq(kvp_notify_send(&n, "STOPPING=1"), -ENOENT);

    kvp_notify_close(&n);
    ck_assert_int_eq(n.fd, -1);
    kvp_notify_close(&n); /* twice: no-op */
    kvp_notify_close(NULL);
}
END_TEST

START_TEST(abstract_socket_name)
{
    char name[64];
    snprintf(name, sizeof(name), "kvp-test-notify-%d", (int)getpid());
    int rx = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    ck_assert_int_ge(rx, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    memcpy(a.sun_path + 1, name, strlen(name)); /* sun_path[0] = '\0': abstract */
    socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + strlen(name));
    ck_assert_int_eq(bind(rx, (struct sockaddr *)&a, len), 0);

    char env[80];
    snprintf(env, sizeof(env), "@%s", name);
    setenv("NOTIFY_SOCKET", env, 1);
    kvp_notify_t n;
    ck_assert_int_eq(kvp_notify_open(&n), 0);
    ck_assert_int_eq(kvp_notify_send(&n, "READY=1"), 0);
    expect_datagram(rx, "READY=1");
    ck_assert_int_eq(kvp_notify_send(&n, "WATCHDOG=1"), 0);
    expect_datagram(rx, "WATCHDOG=1");
    kvp_notify_close(&n);

    /* a name that is a prefix of the bound one is another socket */
    snprintf(env, sizeof(env), "@%.*s", (int)strlen(name) - 1, name);
    setenv("NOTIFY_SOCKET", env, 1);
    ck_assert_int_eq(kvp_notify_open(&n), 0);
    ck_assert_int_eq(kvp_notify_send(&n, "READY=1"), -ECONNREFUSED);
    kvp_notify_close(&n);
    close(rx);
}
END_TEST

START_TEST(without_notify_socket_everything_is_a_noop)
{
    kvp_notify_t n;
    unsetenv("NOTIFY_SOCKET");
    ck_assert_int_eq(kvp_notify_open(&n), 0);
    ck_assert_int_eq(n.fd, -1);
    ck_assert_int_eq(kvp_notify_send(&n, "READY=1"), 0);
    ck_assert_int_eq(kvp_notify_send(&n, "WATCHDOG=1"), 0);
    kvp_notify_close(&n);
    ck_assert_int_eq(n.fd, -1);

    setenv("NOTIFY_SOCKET", "", 1);
    ck_assert_int_eq(kvp_notify_open(&n), 0);
    ck_assert_int_eq(n.fd, -1);
    ck_assert_int_eq(kvp_notify_send(&n, "READY=1"), 0);
    ck_assert_int_eq(kvp_notify_open(NULL), KVP_EINVAL);
}
END_TEST

START_TEST(unusable_notify_socket_values_are_errors)
{
    kvp_notify_t n;
    const char *bad[] = {"relative/notify.sock", "@", "vsock:2:1234"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        setenv("NOTIFY_SOCKET", bad[i], 1);
        ck_assert_int_eq(kvp_notify_open(&n), KVP_EINVAL);
        ck_assert_int_eq(n.fd, -1);
    }
    char path[200];
    memset(path, 'a', sizeof(path) - 1);
    path[0] = '/';
    path[sizeof(path) - 1] = '\0';
    setenv("NOTIFY_SOCKET", path, 1);
    ck_assert_int_eq(kvp_notify_open(&n), -ENAMETOOLONG);
    ck_assert_int_eq(n.fd, -1);
    /* the longest path that fits sun_path with its NUL (107 bytes) is accepted */
    path[sizeof(((struct sockaddr_un *)0)->sun_path) - 1] = '\0';
    setenv("NOTIFY_SOCKET", path, 1);
    ck_assert_int_eq(kvp_notify_open(&n), 0);
    kvp_notify_close(&n);
}
END_TEST

START_TEST(watchdog_interval_from_the_environment)
{
    uint64_t usec = 7;
    char pid[32];
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
    ck_assert_int_eq(kvp_notify_watchdog_usec(&usec), 0);
    ck_assert_uint_eq(usec, 0);

    setenv("WATCHDOG_USEC", "30000000", 1);
    ck_assert_int_eq(kvp_notify_watchdog_usec(&usec), 0);
    ck_assert_uint_eq(usec, 30000000);

    snprintf(pid, sizeof(pid), "%d", (int)getpid());
    setenv("WATCHDOG_PID", pid, 1);
    ck_assert_int_eq(kvp_notify_watchdog_usec(&usec), 0);
    ck_assert_uint_eq(usec, 30000000);

    snprintf(pid, sizeof(pid), "%d", (int)getpid() + 1); /* meant for another process */
    setenv("WATCHDOG_PID", pid, 1);
    usec = 7;
    ck_assert_int_eq(kvp_notify_watchdog_usec(&usec), 0);
    ck_assert_uint_eq(usec, 0);

    unsetenv("WATCHDOG_PID");
    const char *bad_usec[] = {"", "0", "12abc", "-5", " 5", "99999999999999999999999"};
    for (size_t i = 0; i < sizeof(bad_usec) / sizeof(bad_usec[0]); i++) {
        setenv("WATCHDOG_USEC", bad_usec[i], 1);
        usec = 7;
        ck_assert_int_eq(kvp_notify_watchdog_usec(&usec), KVP_EINVAL);
        ck_assert_uint_eq(usec, 0);
    }
    setenv("WATCHDOG_USEC", "1000", 1);
    setenv("WATCHDOG_PID", "self", 1);
    ck_assert_int_eq(kvp_notify_watchdog_usec(&usec), KVP_EINVAL);
    ck_assert_int_eq(kvp_notify_watchdog_usec(NULL), KVP_EINVAL);
}
END_TEST

/* ---- socket activation, in a child process ------------------------------------------- */

#define CHILD_CHECK(cond)                                                                          \
    do {                                                                                           \
        if (!(cond))                                                                               \
            _exit(__LINE__ % 250 + 1);                                                             \
    } while (0)

static void run_in_child(void (*fn)(void))
{
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        fn();
        _exit(0);
    }
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status), "child died");
    ck_assert_msg(WEXITSTATUS(status) == 0, "child check failed at line %% 250 + 1 = %d",
                  WEXITSTATUS(status));
}

/* Puts two fresh sockets, without FD_CLOEXEC, at fds 3 and 4; returns their inode numbers. */
static void place_sockets(ino_t ino[2])
{
    for (int i = 0; i < 2; i++) {
        int s = socket(AF_UNIX, SOCK_STREAM, 0);
        CHILD_CHECK(s >= 0);
        CHILD_CHECK(dup2(s, 3 + i) == 3 + i); /* dup2 clears FD_CLOEXEC on the copy */
        if (s != 3 + i && s != 4)
            close(s);
        struct stat st;
        CHILD_CHECK(fstat(3 + i, &st) == 0 && S_ISSOCK(st.st_mode));
        ino[i] = st.st_ino;
    }
}

static void set_listen_env(pid_t pid, const char *n)
{
    char buf[32];
    snprintf(buf, sizeof(buf), "%d", (int)pid);
    setenv("LISTEN_PID", buf, 1);
    setenv("LISTEN_FDS", n, 1);
    setenv("LISTEN_FDNAMES", "kvpool:kvpool2", 1);
}

static int env_cleared(void)
{
    return !getenv("LISTEN_PID") && !getenv("LISTEN_FDS") && !getenv("LISTEN_FDNAMES");
}

static void activation_for_another_pid(void)
{
    ino_t ino[2];
    place_sockets(ino);
    int fds[4] = {-7, -7, -7, -7};
    set_listen_env(getpid() + 1, "2");
    CHILD_CHECK(kvp_listen_fds(fds, 4) == 0);
    CHILD_CHECK(fds[0] == -7 && fds[1] == -7); /* untouched */
    CHILD_CHECK(cloexec(3) == 0 && cloexec(4) == 0);
    CHILD_CHECK(env_cleared()); /* as sd_listen_fds(1) */
}

static void activation_for_this_pid(void)
{
    ino_t ino[2];
    place_sockets(ino);
    int fds[4] = {-7, -7, -7, -7};
    set_listen_env(getpid(), "2");
    CHILD_CHECK(kvp_listen_fds(fds, 4) == 2);
    CHILD_CHECK(fds[0] == 3 && fds[1] == 4 && fds[2] == -7);
    CHILD_CHECK(cloexec(3) == 1 && cloexec(4) == 1);
    struct stat st;
    CHILD_CHECK(fstat(3, &st) == 0 && st.st_ino == ino[0]);
    CHILD_CHECK(fstat(4, &st) == 0 && st.st_ino == ino[1]);
    CHILD_CHECK(env_cleared());
    /* a second call finds nothing: the variables are gone */
    CHILD_CHECK(kvp_listen_fds(fds, 4) == 0);
}

static void activation_errors(void)
{
    ino_t ino[2];
    int fds[4] = {-7, -7, -7, -7};
    place_sockets(ino);

    /* more fds than room: an error, but all are made close-on-exec */
    set_listen_env(getpid(), "2");
    CHILD_CHECK(kvp_listen_fds(fds, 1) == KVP_ELIMIT);
    CHILD_CHECK(fds[0] == 3 && fds[1] == -7);
    CHILD_CHECK(cloexec(3) == 1 && cloexec(4) == 1);
    CHILD_CHECK(env_cleared());

    /* a passed fd that is not open */
    close(5);
    set_listen_env(getpid(), "3");
    CHILD_CHECK(kvp_listen_fds(fds, 4) == -EBADF);
    CHILD_CHECK(env_cleared());

    const char *bad_n[] = {"", "two", "-1", "2x", "99999999999999999999"};
    for (size_t i = 0; i < sizeof(bad_n) / sizeof(bad_n[0]); i++) {
        set_listen_env(getpid(), bad_n[i]);
        CHILD_CHECK(kvp_listen_fds(fds, 4) == KVP_EINVAL);
        CHILD_CHECK(env_cleared());
    }
    setenv("LISTEN_PID", "me", 1);
    setenv("LISTEN_FDS", "1", 1);
    CHILD_CHECK(kvp_listen_fds(fds, 4) == KVP_EINVAL);
    CHILD_CHECK(env_cleared());

    set_listen_env(getpid(), "0");
    CHILD_CHECK(kvp_listen_fds(fds, 4) == 0);
    CHILD_CHECK(kvp_listen_fds(fds, 4) == 0); /* unset */
    CHILD_CHECK(kvp_listen_fds(NULL, 4) == KVP_EINVAL);
    CHILD_CHECK(kvp_listen_fds(fds, -1) == KVP_EINVAL);
}

START_TEST(listen_fds_for_another_pid_are_left_alone)
{
    run_in_child(activation_for_another_pid);
}
END_TEST

START_TEST(listen_fds_for_this_pid_become_cloexec_and_env_is_cleared)
{
    run_in_child(activation_for_this_pid);
}
END_TEST

START_TEST(listen_fds_errors)
{
    run_in_child(activation_errors);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("notify");
    TCase *tc = tcase_create("notify");
    tcase_add_test(tc, ready_and_watchdog_reach_a_path_socket);
    tcase_add_test(tc, abstract_socket_name);
    tcase_add_test(tc, without_notify_socket_everything_is_a_noop);
    tcase_add_test(tc, unusable_notify_socket_values_are_errors);
    tcase_add_test(tc, watchdog_interval_from_the_environment);
    tcase_add_test(tc, listen_fds_for_another_pid_are_left_alone);
    tcase_add_test(tc, listen_fds_for_this_pid_become_cloexec_and_env_is_cleared);
    tcase_add_test(tc, listen_fds_errors);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
