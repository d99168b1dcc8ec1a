/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_harness.h - runs a real kvpoold process for integration, stress and benchmark programs:
 * a private directory holds its socket and log; start waits until it accepts connections;
 * stop signals it and returns its exit status (printing its log when that is not 0). The binary is
 * $KVPOOLD or the one built next to the tests (KVPOOLD_PATH).
 *
 * $KVP_TEST_DAEMON_WRAPPER (words separated by spaces) prefixes the daemon's command line, e.g.
 * "valgrind --error-exitcode=99 --leak-check=full" (tests/valgrind.sh): the daemon then keeps
 * its pid (valgrind runs in the process it was started as), so signals and /proc still reach it.
 *
 * kvp_wait_until orders a test's events by the state it needs (the daemon has seen a close, a
 * count came back): a fixed sleep is either too short on a loaded machine or wasted time.
 */
#ifndef KVP_HARNESS_H
#define KVP_HARNESS_H

#include <sys/types.h>

typedef struct {
    pid_t pid;
    char dir[64];
    char sock[100]; /* fits sun_path */
    char log[100];
} kvp_daemon_t;

typedef struct {
    unsigned long nofile; /* RLIMIT_NOFILE of the daemon (soft and hard), 0: inherited */
} kvp_daemon_opts_t;

/* Starts kvpoold with --socket <dir>/kvpool.sock and the extra arguments (NULL-terminated
 * list, may be NULL). Returns 0 once the socket accepts, -1 when the daemon exited or did not
 * come up within 10 s (its log is printed to stderr). */
int kvp_daemon_start(kvp_daemon_t *d, const char *const *extra_args);
/* The same with options (opts may be NULL). With a wrapper set it waits up to 120 s. */
int kvp_daemon_start_opts(kvp_daemon_t *d, const char *const *extra_args,
                          const kvp_daemon_opts_t *opts);

/* Starts kvpoold on the small host geometry the multi-user tests share (2 layers, 64 pages of 4
 * tokens, 2 KV heads, head_dim 16, fp16) with its socket open to other uids (socket mode 0666,
 * the private directory 0755), then the extra arguments (NULL-terminated, at most 32, may be
 * NULL). Returns 0, or -1 as kvp_daemon_start does. */
int kvp_daemon_start_shared(kvp_daemon_t *d, const char *const *extra_args);

/* The daemon's open descriptors (entries of /proc/<pid>/fd), or -1. */
int kvp_daemon_fd_count(const kvp_daemon_t *d);
/* The daemon's resident set (VmRSS of /proc/<pid>/status) in KiB, or -1. */
long kvp_daemon_rss_kib(const kvp_daemon_t *d);
/* 1 when KVP_TEST_DAEMON_WRAPPER is set (a slow daemon: tests may scale their load down). */
int kvp_daemon_wrapped(void);

/* Sends sig (0: none) and waits for the process. Returns its exit code (128 + signal when it
 * died of one), or -1. Removes the directory. */
int kvp_daemon_stop(kvp_daemon_t *d, int sig);

/* Prints the daemon's log to stderr (for failures). */
void kvp_daemon_dump_log(const kvp_daemon_t *d);

/* Waits for a state of the daemon instead of sleeping a guessed time: calls cond(arg) at once,
 * then every 5 ms, until it returns nonzero or timeout_ms have passed (12 times that under
 * KVP_TEST_DAEMON_WRAPPER, whose daemon is slow). cond runs on the calling thread and may call
 * the daemon (Stats, /proc). Returns 1 when cond held, 0 at the deadline; the caller then
 * asserts the state it waited for, so a timeout fails with that assertion's message. */
int kvp_wait_until(int (*cond)(void *arg), void *arg, unsigned timeout_ms);

#endif
