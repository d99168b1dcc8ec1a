/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_security.c - integration: access control and quotas on a real kvpoold. Each refusal is
 * checked for its exact status (as libkvpool maps it: PERMISSION_DENIED -> KVP_EPERM,
 * RESOURCE_EXHAUSTED -> KVP_ENOSPC), its message, and that nothing changed (stats, audit).
 *
 * Other users are real: a forked child drops to uid/gid 65534.. (setgroups, setgid, setuid)
 * before it connects, so SO_PEERCRED and SO_PEERGROUPS report them. Those tests need root and
 * are skipped (they pass trivially, with a note) otherwise; the quota tests run as anyone.
 * Geometry: 2 layers, 64 pages of 4 tokens, 2 KV heads, head_dim 16, fp16.
 */
#include <check.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_harness.h"
#include "kvpool.h"

#define PAGES 64

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

static int connect_ns(const char *ns, uint32_t lease_ms, kvp_client_t **out, char *err,
                      size_t err_len)
{
    kvp_client_opts_t o = {.socket_path = DMN.sock,
                           .ns = ns,
                           .client_name = "security",
                           .lease_ms = lease_ms,
                           .timeout_ms = 10000};
    *out = NULL;
    return kvp_client_connect(&o, out, err, err_len);
}

static kvp_client_t *must_connect(const char *ns, uint32_t lease_ms)
{
    char err[256];
    kvp_client_t *c;
    int rc = connect_ns(ns, lease_ms, &c, err, sizeof(err));
    ck_assert_msg(rc == 0, "connect %s: %s", ns, err);
    return c;
}

static void stats(kvp_client_t *c, kvp_stats_summary_t *st)
{
    ck_assert_int_eq(kvp_client_stats(c, st), 0);
}

static void same_state(const kvp_stats_summary_t *a, const kvp_stats_summary_t *b)
{
    ck_assert_uint_eq(a->used_pages, b->used_pages);
    ck_assert_uint_eq(a->free_pages, b->free_pages);
    ck_assert_uint_eq(a->num_seqs, b->num_seqs);
    ck_assert_uint_eq(a->num_tokens, b->num_tokens);
    ck_assert_uint_eq(a->page_refs, b->page_refs);
}

/* ---- other users ------------------------------------------------------------------------- */

/* What a child running as another user reports: the connect status and its message. */
typedef struct {
    int rc;
    char msg[200];
} outcome_t;

/* In a child with uid/gid (and the supplementary groups sup[0..nsup)), connects to ns, and
 * when that works reserves `tokens` tokens for sequence 1 (if tokens > 0) and reads stats. */
static outcome_t as_user(uid_t uid, gid_t gid, const gid_t *sup, int nsup, const char *ns,
                         uint32_t lease_ms, uint32_t tokens)
{
    int p[2];
    ck_assert_int_eq(pipe(p), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(p[0]);
        outcome_t o = {0, ""};
        if (setgroups((size_t)nsup, sup) || setgid(gid) || setuid(uid)) {
            o.rc = -9999;
        } else {
            kvp_client_t *c;
            o.rc = connect_ns(ns, lease_ms, &c, o.msg, sizeof(o.msg));
            if (o.rc == 0 && tokens) {
                uint64_t id = 1;
                o.rc = kvp_client_reserve(c, &id, &tokens, 1, NULL);
                snprintf(o.msg, sizeof(o.msg), "%s", kvp_client_last_error(c));
            }
            kvp_client_close(c);
        }
        ssize_t w = write(p[1], &o, sizeof(o));
        _exit(w == (ssize_t)sizeof(o) ? 0 : 1);
    }
    close(p[1]);
    outcome_t o;
    ck_assert_int_eq(read(p[0], &o, sizeof(o)), (ssize_t)sizeof(o));
    close(p[0]);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(o.rc != -9999, "cannot become uid %d", (int)uid);
    return o;
}

#define NEED_ROOT()                                                                                \
    do {                                                                                           \
        if (geteuid() != 0) {                                                                      \
            fprintf(stderr, "%s: skipped (needs root to act as other users)\n", __func__);         \
            return;                                                                                \
        }                                                                                          \
    } while (0)

START_TEST(default_policy_admits_the_socket_group_and_refuses_other_users)
{
    NEED_ROOT();
    start_with(NULL);
    kvp_client_t *c = must_connect("eng", 0);
    kvp_stats_summary_t before, after;
    stats(c, &before);
    /* uid 65534 in no group of the socket (the daemon's group: 0) */
    gid_t nogroup = 65534, root_group = 0;
    outcome_t o = as_user(65534, 65534, &nogroup, 1, "eng", 0, 4);
    ck_assert_int_eq(o.rc, KVP_EPERM);
    ck_assert_msg(strstr(o.msg, "uid 65534 may not connect"), "message: %s", o.msg);
    stats(c, &after);
    same_state(&before, &after);
    /* the same uid with the socket's group as a supplementary group gets in */
    o = as_user(65534, 65534, &root_group, 1, "guest", 0, 4);
    ck_assert_msg(o.rc == 0, "member of the socket group: %s", o.msg);
    ck_assert_int_eq(kvp_client_audit(c), 0);
    kvp_client_close(c);
    stop_expect_clean();
}
END_TEST

START_TEST(allowed_lists_admit_exactly_the_listed_uids_and_groups)
{
    NEED_ROOT();
    const char *more[] = {"--set", "access.allowed_uids=65534", "--set",
                          "access.allowed_gids=12345", NULL};
    start_with(more);
    kvp_client_t *c = must_connect("eng", 0);
    kvp_stats_summary_t before, after;
    stats(c, &before);
    gid_t none = 65533, root_group = 0, listed = 12345;
    outcome_t o = as_user(65534, 65534, &none, 1, "a", 0, 0);
    ck_assert_msg(o.rc == 0, "listed uid: %s", o.msg);
    o = as_user(65532, 12345, &listed, 1, "b", 0, 0); /* member of a listed group */
    ck_assert_msg(o.rc == 0, "listed gid: %s", o.msg);
    o = as_user(65533, 65533, &none, 1, "c", 0, 4);
    ck_assert_int_eq(o.rc, KVP_EPERM);
    /* the socket's group alone no longer admits once lists are set */
    o = as_user(65533, 65533, &root_group, 1, "c", 0, 4);
    ck_assert_int_eq(o.rc, KVP_EPERM);
    stats(c, &after);
    same_state(&before, &after);
    kvp_client_close(c);
    stop_expect_clean();
}
END_TEST

START_TEST(a_namespace_belongs_to_the_uid_that_created_it)
{
    NEED_ROOT();
    const char *more[] = {"--set", "access.allowed_uids=65534,65533", NULL};
    start_with(more);
    gid_t g = 65534;
    /* 65534 creates "tenant" (lease 60 s keeps it after the child leaves) with 9 tokens */
    outcome_t o = as_user(65534, 65534, &g, 1, "tenant", 60000, 9);
    ck_assert_msg(o.rc == 0, "owner: %s", o.msg);
    kvp_client_t *c = must_connect("observer", 0);
    kvp_stats_summary_t before, after;
    stats(c, &before);
    ck_assert_uint_eq(before.num_tokens, 9);
    /* another uid may not attach to it, nor change it */
    o = as_user(65533, 65533, &g, 1, "tenant", 0, 4);
    ck_assert_int_eq(o.rc, KVP_EPERM);
    ck_assert_msg(strstr(o.msg, "belongs to another user"), "message: %s", o.msg);
    stats(c, &after);
    same_state(&before, &after);
    /* the owner comes back and finds its sequence */
    o = as_user(65534, 65534, &g, 1, "tenant", 60000, 3);
    ck_assert_msg(o.rc == 0, "owner again: %s", o.msg);
    stats(c, &after);
    ck_assert_uint_eq(after.num_tokens, 12);
    /* root is the operator: it may attach to any namespace */
    kvp_client_t *r = must_connect("tenant", 0);
    uint64_t id = 1;
    uint32_t released = 0;
    ck_assert_int_eq(kvp_client_release(r, &id, 1, &released), 0);
    ck_assert_uint_eq(released, 1);
    kvp_client_close(r);
    ck_assert_int_eq(kvp_client_audit(c), 0);
    kvp_client_close(c);
    stop_expect_clean();
}
END_TEST

/* ---- quotas ----------------------------------------------------------------------------- */

START_TEST(namespace_quotas_refuse_with_resource_exhausted_and_change_nothing)
{
    const char *more[] = {"--set", "limits.ns_max_seqs=3",
                          "--set", "limits.ns_max_pages=8",
                          "--set", "limits.ns_max_buffer_bytes=8192",
                          "--set", "limits.ns_max_connections=2",
                          NULL};
    start_with(more);
    kvp_client_t *c = must_connect("q", 0);
    kvp_client_t *obs = must_connect("observer", 0);
    kvp_stats_summary_t before, after;

    /* sequences: 3 fit, the 4th (or a fork) does not */
    uint64_t ids[4] = {1, 2, 3, 4};
    uint32_t one[4] = {1, 1, 1, 1};
    ck_assert_int_eq(kvp_client_reserve(c, ids, one, 3, NULL), 0);
    stats(obs, &before);
    ck_assert_int_eq(kvp_client_reserve(c, ids + 3, one, 1, NULL), KVP_ENOSPC);
    ck_assert_int_eq(kvp_client_reserve(c, ids + 2, one, 2, NULL), KVP_ENOSPC); /* 3 ok + 4 */
    ck_assert_int_eq(kvp_client_fork(c, 1, 9), KVP_ENOSPC);
    stats(obs, &after);
    same_state(&before, &after);
    /* pages: 3 sequences of 1 token hold 3 references; 5 more pages (20 tokens) fit in one */
    uint32_t twenty = 19; /* seq 1: 1 + 19 = 20 tokens = 5 pages -> 7 references */
    ck_assert_int_eq(kvp_client_reserve(c, ids, &twenty, 1, NULL), 0);
    uint32_t four = 4; /* seq 2: 1 + 4 = 5 tokens = 2 pages -> 8 references */
    ck_assert_int_eq(kvp_client_reserve(c, ids + 1, &four, 1, NULL), 0);
    stats(obs, &before);
    ck_assert_uint_eq(before.page_refs, 8);
    uint32_t more_tok = 4; /* seq 3 would need a second page: the 9th reference */
    ck_assert_int_eq(kvp_client_reserve(c, ids + 2, &more_tok, 1, NULL), KVP_ENOSPC);
    ck_assert_ptr_nonnull(strstr(kvp_client_last_error(c), "quota"));
    stats(obs, &after);
    same_state(&before, &after);
    /* another namespace is not limited by q's use */
    kvp_client_t *other = must_connect("other", 0);
    uint32_t thirty_two = 32;
    ck_assert_int_eq(kvp_client_reserve(other, ids, &thirty_two, 1, NULL), 0);
    kvp_client_close(other); /* lease 0: released */
    /* freeing makes room again */
    ck_assert_int_eq(kvp_client_truncate(c, 1, 1), 0);
    ck_assert_int_eq(kvp_client_reserve(c, ids + 2, &more_tok, 1, NULL), 0);

    /* registered bytes: 8 KiB over the namespace's connections */
    void *p1, *p2, *p3;
    uint32_t b1, b2, b3;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, 4096, &p1, &b1), 0);
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, 4096, &p2, &b2), 0);
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, 1, &p3, &b3), KVP_ENOSPC);
    ck_assert_ptr_nonnull(strstr(kvp_client_last_error(c), "ns_max_buffer_bytes"));
    ck_assert_int_eq(kvp_client_unregister_buffer(c, b2), 0);
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, 4096, &p3, &b3), 0);

    /* connections: q has one; a second fits, a third is refused, and fits once one left */
    kvp_client_t *c2 = must_connect("q", 0);
    kvp_client_t *c3 = NULL;
    char err[256];
    stats(obs, &before);
    ck_assert_int_eq(connect_ns("q", 0, &c3, err, sizeof(err)), KVP_ENOSPC);
    ck_assert_msg(strstr(err, "ns_max_connections"), "message: %s", err);
    ck_assert_ptr_null(c3);
    /* the second connection's buffer counts against the same namespace quota */
    void *p4;
    uint32_t b4;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c2, 4096, &p4, &b4), KVP_ENOSPC);
    stats(obs, &after);
    same_state(&before, &after);
    kvp_client_close(c2);
    c3 = must_connect("q", 0);
    kvp_client_close(c3);

    ck_assert_int_eq(kvp_client_audit(obs), 0);
    kvp_client_close(c);
    /* lease 0 and last session gone: q's sequences go back to the pool once the daemon has
     * seen the connection close */
    for (int i = 0; i < 200; i++) {
        stats(obs, &after);
        if (after.num_seqs == 0)
            break;
        usleep(10000);
    }
    ck_assert_uint_eq(after.num_seqs, 0);
    ck_assert_uint_eq(after.free_pages, PAGES);
    kvp_client_close(obs);
    stop_expect_clean();
}
END_TEST

START_TEST(connection_limit_refuses_with_unavailable_and_serves_the_others)
{
    const char *more[] = {"--set", "server.max_connections=3", NULL};
    start_with(more);
    kvp_client_t *a = must_connect("a", 0), *b = must_connect("b", 0), *c = must_connect("c", 0);
    kvp_client_t *d = NULL;
    char err[256];
    ck_assert_int_eq(connect_ns("d", 0, &d, err, sizeof(err)), KVP_EUNAVAIL);
    ck_assert_msg(strstr(err, "too many connections"), "message: %s", err);
    ck_assert_int_eq(kvp_client_ping(a, NULL), 0);
    ck_assert_int_eq(kvp_client_ping(c, NULL), 0);
    kvp_client_close(b);
    /* the slot is free again once the daemon saw b go */
    int rc = -1;
    for (int i = 0; i < 100 && rc != 0; i++) {
        rc = connect_ns("d", 0, &d, err, sizeof(err));
        if (rc)
            usleep(10000);
    }
    ck_assert_msg(rc == 0, "reconnect: %s", err);
    kvp_client_close(d);
    kvp_client_close(c);
    kvp_client_close(a);
    stop_expect_clean();
}
END_TEST

/* ---- source ranges --------------------------------------------------------------------- */

START_TEST(append_sources_outside_their_buffer_are_refused_before_anything_runs)
{
    start_with(NULL);
    kvp_client_t *c = must_connect("src", 0);
    kvp_client_t *other = must_connect("src", 0);
    /* a sequence of 5 tokens, then a 4 KiB buffer: 2 layers x K,V x n x 2 heads x 32 bytes
     * = 256 n bytes, so 16 tokens fill it exactly */
    uint64_t id = 1;
    uint32_t five = 5;
    ck_assert_int_eq(kvp_client_reserve(c, &id, &five, 1, NULL), 0);
    void *stage, *ostage;
    uint32_t buf, obuf;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, 4096, &stage, &buf), 0);
    ck_assert_int_eq(kvp_client_alloc_host_buffer(other, 4096, &ostage, &obuf), 0);
    kvp_stats_summary_t before, after;
    stats(c, &before);
    uint32_t n = 16;
    const kvp_source_t ok = {.buffer_id = buf,
                             .k_offset = 0,
                             .v_offset = 16 * 64,
                             .k_stride_n = 64,
                             .k_stride_h = 32,
                             .v_stride_n = 64,
                             .v_stride_h = 32,
                             .layer_stride = 2048};
    struct {
        const char *what;
        kvp_source_t src;
        int code;
        const char *msg;
    } bad[] = {
        {"K past the end", ok, KVP_EINVAL, "K source range exceeds buffer"},
        {"V past the end", ok, KVP_EINVAL, "V source range exceeds buffer"},
        {"layer stride past the end", ok, KVP_EINVAL, "exceeds buffer"},
        {"stride overflowing 64 bits", ok, KVP_EINVAL, "exceeds buffer"},
        {"offset not a whole element", ok, KVP_EINVAL, "multiples of"},
        {"unknown buffer", ok, KVP_ENOENT, "no buffer"},
        {"another connection's buffer", ok, KVP_ENOENT, "no buffer"},
        {"layer range", ok, KVP_EINVAL, "layer range"},
    };
    bad[0].src.k_offset = 1056;          /* layer 1's last K row ends 32 bytes past the buffer */
    bad[1].src.v_offset = 16 * 64 + 64;  /* V moved one token */
    bad[2].src.layer_stride = 2048 + 64; /* layer 1 ends past the buffer */
    bad[3].src.k_stride_n = UINT64_MAX / 8 * 2; /* (n - 1) x stride wraps */
    bad[4].src.v_offset = 16 * 64 + 1;
    bad[5].src.buffer_id = buf + 100;
    bad[6].src.buffer_id = obuf; /* ids are per connection: c has no such buffer */
    if (obuf == buf)
        bad[6].src.buffer_id = buf + 1;
    bad[7].src.layer_begin = 1, bad[7].src.layer_end = 3;
    memset(stage, 0x5a, 4096);
    for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc = kvp_client_append(c, &id, &n, 1, &bad[i].src, NULL);
        ck_assert_msg(rc == bad[i].code, "%s: %s (%s)", bad[i].what, kvp_errname(rc),
                      kvp_client_last_error(c));
        ck_assert_msg(strstr(kvp_client_last_error(c), bad[i].msg), "%s: message '%s'", bad[i].what,
                      kvp_client_last_error(c));
        stats(c, &after);
        same_state(&before, &after);
    }
    /* and the exact fit is accepted */
    ck_assert_int_eq(kvp_client_append(c, &id, &n, 1, &ok, NULL), 0);
    stats(c, &after);
    ck_assert_uint_eq(after.num_tokens, before.num_tokens + 16);
    ck_assert_int_eq(kvp_client_audit(c), 0);
    kvp_client_close(other);
    kvp_client_close(c);
    stop_expect_clean();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("security");
    TCase *tc = tcase_create("security");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, default_policy_admits_the_socket_group_and_refuses_other_users);
    tcase_add_test(tc, allowed_lists_admit_exactly_the_listed_uids_and_groups);
    tcase_add_test(tc, a_namespace_belongs_to_the_uid_that_created_it);
    tcase_add_test(tc, namespace_quotas_refuse_with_resource_exhausted_and_change_nothing);
    tcase_add_test(tc, connection_limit_refuses_with_unavailable_and_serves_the_others);
    tcase_add_test(tc, append_sources_outside_their_buffer_are_refused_before_anything_runs);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
