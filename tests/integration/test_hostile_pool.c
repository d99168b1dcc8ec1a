/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_hostile_pool.c - integration, issue #15 defect 11: the pool is one trust domain. Whoever
 * receives the pool fds (Hello or PoolInfo with want_pool_fds) can map all of the pool
 * read-write, so access.pool_uids / pool_gids name who may receive them: any other uid gets
 * PERMISSION_DENIED, no fds, and keeps a usable session for daemon-run calls (RegisterBuffer,
 * Reserve, Append). With the default (everyone), fds handed to two different uids make the
 * daemon warn once and Stats.pool_shared_across_uids say so.
 *
 * Other users are real: a forked child drops to uid/gid 65533 or 65534 (setgroups, setgid,
 * setuid) before it connects, as test_security.c does; it needs root (CI runs as root) and is
 * skipped with a note otherwise. Raw client (kvp_raw.h) against a real kvpoold, host backend,
 * 2 layers, 64 pages of 4 tokens, 2 KV heads, head_dim 16, fp16.
 */
#include <check.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvp_harness.h"
#include "kvp_raw.h"

#define H   2
#define ROW 32 /* head_dim 16, fp16 */

static kvp_daemon_t DMN;

static void start_with(const char *const *more)
{
    ck_assert_msg(kvp_daemon_start_shared(&DMN, more) == 0, "kvpoold did not start");
}

static void stop_expect_clean(void)
{
    int code = kvp_daemon_stop(&DMN, SIGTERM);
    ck_assert_msg(code == 0, "kvpoold exited with %d", code);
}

#define NEED_ROOT()                                                                                \
    do {                                                                                           \
        if (geteuid() != 0) {                                                                      \
            fprintf(stderr, "%s: skipped (needs root to act as other users)\n", __func__);         \
            return;                                                                                \
        }                                                                                          \
    } while (0)

/* Hello in ns, asking for the pool fds when want_fds; returns the status code. */
static int hello(kvp_raw_t *w, const char *ns, int want_fds, kvpool_Response *resp)
{
    kvpool_Request q = {.id = 1, .which_body = kvpool_Request_hello_tag};
    q.body.hello.protocol_version = KVP_PROTOCOL_VERSION;
    snprintf(q.body.hello.namespace, sizeof(q.body.hello.namespace), "%s", ns);
    q.body.hello.want_pool_fds = want_fds != 0;
    return kvp_raw_call(w, &q, NULL, 0, resp);
}

static int pool_info_fds(kvp_raw_t *w, kvpool_Response *resp)
{
    kvpool_Request q = {.id = 2, .which_body = kvpool_Request_pool_info_tag};
    q.body.pool_info.want_pool_fds = true;
    return kvp_raw_call(w, &q, NULL, 0, resp);
}

static int shared_across_uids(void)
{
    kvp_raw_t w;
    kvpool_Response resp;
    kvp_raw_open(&w, DMN.sock);
    ck_assert_int_eq(hello(&w, "ops", 0, &resp), kvpool_Code_OK); /* asks for no fds */
    kvpool_Request q = {.id = 3, .which_body = kvpool_Request_stats_tag};
    ck_assert_int_eq(kvp_raw_call(&w, &q, NULL, 0, &resp), kvpool_Code_OK);
    kvp_raw_close(&w);
    return resp.body.stats.stats.pool_shared_across_uids;
}

/* What a child running as another uid saw. */
typedef struct {
    int hello_fds, hello_fds_nfds; /* Hello with want_pool_fds: code, fds attached */
    char hello_fds_msg[260];
    int hello, pool_info_fds, pool_info_nfds; /* then a plain Hello; PoolInfo with fds */
    int reg, reserve, append;                 /* daemon-run calls on that session */
    int fail;                                 /* -1: could not drop privileges */
} seen_t;

/* In a child with uid/gid: Hello(ns, want_pool_fds); when that is refused, a plain Hello and
 * PoolInfo(want_pool_fds); then RegisterBuffer of a sealed memfd, Reserve and Append of 2
 * tokens from it. */
static seen_t as_user(uid_t uid, const char *ns)
{
    int p[2];
    ck_assert_int_eq(pipe(p), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(p[0]);
        seen_t o;
        memset(&o, 0, sizeof(o));
        gid_t g = (gid_t)uid;
        if (setgroups(1, &g) || setgid(g) || setuid(uid)) {
            o.fail = -1;
        } else {
            kvp_raw_t w;
            kvpool_Response resp;
            kvp_raw_open(&w, DMN.sock);
            o.hello_fds = hello(&w, ns, 1, &resp);
            o.hello_fds_nfds = (int)resp.body.hello.pool.num_fds;
            snprintf(o.hello_fds_msg, sizeof(o.hello_fds_msg), "%s", resp.status.message);
            o.hello = o.hello_fds == kvpool_Code_OK ? kvpool_Code_OK : hello(&w, ns, 0, &resp);
            o.pool_info_fds = pool_info_fds(&w, &resp);
            o.pool_info_nfds = (int)resp.body.pool_info.num_fds;
            /* daemon-run calls: the daemon copies from our memfd into the pool */
            uint32_t tokens = 2;
            size_t bytes = 2ull * 2 * tokens * H * ROW; /* layers x K,V x tokens x heads */
            int fd = memfd_create("stage", MFD_CLOEXEC | MFD_ALLOW_SEALING);
            if (fd < 0 || ftruncate(fd, 4096) || fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)) {
                o.fail = -2;
            } else {
                kvpool_Request q = {.id = 10, .which_body = kvpool_Request_register_buffer_tag};
                q.body.register_buffer.size_bytes = 4096;
                q.body.register_buffer.kind = kvpool_BufferKind_BUFFER_MEMFD;
                o.reg = kvp_raw_call(&w, &q, &fd, 1, &resp);
                uint32_t buf = resp.body.register_buffer.buffer_id;
                close(fd);
                uint64_t seq = 7;
                kvp_batch_arrays_t b = {.seq_ids = kvp_array(&seq, 8, 1, 1),
                                        .num_tokens = kvp_array(&tokens, 4, 1, 1)};
                kvpool_Request r = kvp_raw_batch_req(kvpool_Request_reserve_tag, 11, &b);
                o.reserve = kvp_raw_call(&w, &r, NULL, 0, &resp);
                kvpool_Request a = kvp_raw_batch_req(kvpool_Request_append_tag, 12, &b);
                a.body.append.has_source = true;
                kvpool_Source *s = &a.body.append.source;
                s->buffer_id = buf;
                s->v_offset = (uint64_t)tokens * H * ROW;
                s->k_stride_n = s->v_stride_n = H * ROW;
                s->k_stride_h = s->v_stride_h = ROW;
                s->layer_stride = 2ull * tokens * H * ROW;
                o.append = bytes <= 4096 ? kvp_raw_call(&w, &a, NULL, 0, &resp) : -1;
            }
            kvp_raw_close(&w);
        }
        ssize_t n = write(p[1], &o, sizeof(o));
        _exit(n == (ssize_t)sizeof(o) ? 0 : 1);
    }
    close(p[1]);
    seen_t o;
    ck_assert_int_eq(read(p[0], &o, sizeof(o)), (ssize_t)sizeof(o));
    close(p[0]);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child of uid %d failed", (int)uid);
    ck_assert_msg(o.fail == 0, "child of uid %d: setup failed (%d)", (int)uid, o.fail);
    return o;
}

/* 1 when `kvpoolctl status` prints the shared-memory warning, 0 when not (asserts it ran). */
static int status_warns(void)
{
    char cmd[256], line[512];
    snprintf(cmd, sizeof(cmd), "%s -s %s status", KVPOOLCTL_PATH, DMN.sock);
    FILE *p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    int warns = 0;
    while (fgets(line, sizeof(line), p))
        warns |= strstr(line, "pool memory shared across uids") != NULL;
    ck_assert_int_eq(pclose(p), 0);
    return warns;
}

/* Occurrences of needle in the daemon's log. */
static int log_count(const char *needle)
{
    FILE *f = fopen(DMN.log, "r");
    ck_assert_ptr_nonnull(f);
    char line[2048];
    int n = 0;
    while (fgets(line, sizeof(line), f))
        n += strstr(line, needle) != NULL;
    fclose(f);
    return n;
}

START_TEST(pool_fds_only_for_the_listed_uids)
{
    NEED_ROOT();
    const char *more[] = {"--set", "access.allowed_uids=65533,65534", "--set",
                          "access.pool_uids=65534", NULL};
    start_with(more);

    /* 65533 is admitted but not in pool_uids: no fds, PERMISSION_DENIED, session usable */
    seen_t o = as_user(65533, "tenant33");
    ck_assert_int_eq(o.hello_fds, kvpool_Code_PERMISSION_DENIED);
    ck_assert_int_eq(o.hello_fds_nfds, 0);
    ck_assert_msg(strstr(o.hello_fds_msg, "may not receive the pool's memory") &&
                      strstr(o.hello_fds_msg, "pool_uids"),
                  "message: %s", o.hello_fds_msg);
    ck_assert_int_eq(o.hello, kvpool_Code_OK);
    ck_assert_int_eq(o.pool_info_fds, kvpool_Code_PERMISSION_DENIED);
    ck_assert_int_eq(o.pool_info_nfds, 0);
    ck_assert_int_eq(o.reg, kvpool_Code_OK);
    ck_assert_int_eq(o.reserve, kvpool_Code_OK);
    ck_assert_int_eq(o.append, kvpool_Code_OK);

    /* 65534 is listed: it gets the fds from Hello and from PoolInfo */
    o = as_user(65534, "tenant34");
    ck_assert_int_eq(o.hello_fds, kvpool_Code_OK);
    ck_assert_int_ge(o.hello_fds_nfds, 1);
    ck_assert_int_eq(o.pool_info_fds, kvpool_Code_OK);
    ck_assert_int_eq(o.pool_info_nfds, o.hello_fds_nfds);
    ck_assert_int_eq(o.append, kvpool_Code_OK);

    /* root (the operator) always may; only one uid other than root holds the memory */
    kvp_raw_t w;
    kvpool_Response resp;
    kvp_raw_open(&w, DMN.sock);
    ck_assert_int_eq(hello(&w, "ops", 1, &resp), kvpool_Code_OK);
    ck_assert_int_ge(resp.body.hello.pool.num_fds, 1);
    kvp_raw_close(&w);
    stop_expect_clean();
}
END_TEST

START_TEST(pool_shared_across_uids_is_reported_once)
{
    NEED_ROOT();
    const char *more[] = {"--set", "access.allowed_uids=65533,65534", NULL};
    start_with(more); /* pool_uids empty: everyone may have the fds (one trust domain) */
    kvp_raw_t w1, w2;
    kvpool_Response resp;
    /* one uid twice, and a uid that asks for no fds: nothing shared */
    kvp_raw_open(&w1, DMN.sock);
    ck_assert_int_eq(hello(&w1, "a", 1, &resp), kvpool_Code_OK);
    ck_assert_int_ge(resp.body.hello.pool.num_fds, 1);
    kvp_raw_open(&w2, DMN.sock);
    ck_assert_int_eq(hello(&w2, "b", 1, &resp), kvpool_Code_OK);
    ck_assert_int_eq(shared_across_uids(), 0);
    ck_assert_int_eq(log_count("pool memory shared across uids"), 0);
    ck_assert_int_eq(status_warns(), 0);

    /* 65534 receives them too: one warning, and Stats says so */
    seen_t o = as_user(65534, "tenant34");
    ck_assert_int_eq(o.hello_fds, kvpool_Code_OK);
    ck_assert_int_ge(o.hello_fds_nfds, 1);
    ck_assert_int_eq(shared_across_uids(), 1);
    /* a third uid: still one warning; the flag stays after the sessions are gone */
    o = as_user(65533, "tenant33");
    ck_assert_int_eq(o.hello_fds, kvpool_Code_OK);
    kvp_raw_close(&w1);
    kvp_raw_close(&w2);
    ck_assert_int_eq(shared_across_uids(), 1);
    ck_assert_int_eq(log_count("pool memory shared across uids"), 1);
    ck_assert_int_eq(status_warns(), 1);
    stop_expect_clean();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("hostile_pool");
    TCase *tc = tcase_create("trust");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, pool_fds_only_for_the_listed_uids);
    tcase_add_test(tc, pool_shared_across_uids_is_reported_once);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
