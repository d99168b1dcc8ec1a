/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_hostile_names.c - integration: what a hostile tenant may name and see (issue #15,
 * defects 2, 3 (per-uid quotas), 6, 7, 8) on a real kvpoold, driven by raw clients
 * (kvp_raw.h) that write any string, any flag, any call.
 *
 * Other users are real: a forked child drops to uid/gid 65534 or 65533 before it connects
 * (SO_PEERCRED reports them) and sends its answers' status codes back through a pipe; the
 * parent (root, the daemon's uid: an operator) checks them. Those tests need root and are
 * skipped (they pass trivially, with a note) otherwise; CI runs as root.
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
#include "kvp_raw.h"
#include "kvpool.h"

static kvp_daemon_t DMN;
static kvpool_Response *RESP; /* heap: the list bodies are large */

static void start_with(const char *const *more)
{
    const char *args[40] = {"--set", "access.allowed_uids=65534,65533"};
    int n = 2;
    for (int i = 0; more && more[i] && n < 39; i++)
        args[n++] = more[i];
    args[n] = NULL;
    ck_assert_msg(kvp_daemon_start_shared(&DMN, args) == 0, "kvpoold did not start");
    RESP = calloc(1, sizeof(*RESP));
    ck_assert_ptr_nonnull(RESP);
}

static void stop_expect_clean(void)
{
    free(RESP);
    RESP = NULL;
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

/* ---- raw requests -------------------------------------------------------------------------- */

static int hello_full(kvp_raw_t *w, const char *ns, const char *client, int observer, int has_lease,
                      uint32_t lease_ms)
{
    kvpool_Request q = {.id = 1, .which_body = kvpool_Request_hello_tag};
    kvpool_HelloRequest *h = &q.body.hello;
    h->protocol_version = KVP_PROTOCOL_VERSION;
    snprintf(h->namespace, sizeof(h->namespace), "%s", ns);
    snprintf(h->client_name, sizeof(h->client_name), "%s", client);
    h->observer = observer != 0;
    h->has_lease_ms = has_lease != 0;
    h->lease_ms = lease_ms;
    return kvp_raw_call(w, &q, NULL, 0, RESP);
}

static int hello_lease(kvp_raw_t *w, const char *ns, uint32_t lease_ms)
{
    return hello_full(w, ns, "hostile", 0, 1, lease_ms);
}

static int reserve_tok(kvp_raw_t *w, uint64_t id, uint64_t first_seq, uint32_t n, uint32_t tok);

/* Reserve of n sequences first_seq.. (1 token each; tokens0: none, empty sequences) */
static int reserve_n(kvp_raw_t *w, uint64_t id, uint64_t first_seq, uint32_t n)
{
    return reserve_tok(w, id, first_seq, n, 1);
}

static int reserve_tok(kvp_raw_t *w, uint64_t id, uint64_t first_seq, uint32_t n, uint32_t tok)
{
    uint64_t seqs[64];
    uint32_t tokens[64];
    ck_assert_uint_le(n, 64);
    for (uint32_t i = 0; i < n; i++) {
        seqs[i] = first_seq + i;
        tokens[i] = tok;
    }
    kvp_batch_arrays_t b = {.seq_ids = kvp_array(seqs, 8, n, n),
                            .num_tokens = kvp_array(tokens, 4, n, n)};
    kvpool_Request q = kvp_raw_batch_req(kvpool_Request_reserve_tag, id, &b);
    return kvp_raw_call(w, &q, NULL, 0, RESP);
}

static int stats(kvp_raw_t *w)
{
    kvpool_Request q = {.id = 0, .which_body = kvpool_Request_stats_tag};
    return kvp_raw_call(w, &q, NULL, 0, RESP);
}

static int list_seqs(kvp_raw_t *w, const char *ns)
{
    kvpool_Request q = {.id = 0, .which_body = kvpool_Request_list_sequences_tag};
    snprintf(q.body.list_sequences.namespace, sizeof(q.body.list_sequences.namespace), "%s", ns);
    return kvp_raw_call(w, &q, NULL, 0, RESP);
}

static int list_clients(kvp_raw_t *w)
{
    kvpool_Request q = {.id = 0, .which_body = kvpool_Request_list_clients_tag};
    return kvp_raw_call(w, &q, NULL, 0, RESP);
}

/* Stats' namespaces entry called name, or NULL. */
static const kvpool_NamespaceStats *find_ns(const char *name)
{
    const kvpool_Stats *st = &RESP->body.stats.stats;
    for (pb_size_t i = 0; i < st->namespaces_count; i++)
        if (strcmp(st->namespaces[i].name, name) == 0)
            return &st->namespaces[i];
    return NULL;
}

/* ---- other users: a child runs fn as uid and reports up to 32 codes --------------------- */

#define MAX_CODES 32
typedef struct {
    int n;
    int code[MAX_CODES];
    char note[200];
} report_t;

typedef void (*as_fn_t)(report_t *rep, void *arg);

static report_t as_user(uid_t uid, as_fn_t fn, void *arg)
{
    int p[2];
    ck_assert_int_eq(pipe(p), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(p[0]);
        report_t rep;
        memset(&rep, 0, sizeof(rep));
        gid_t g = (gid_t)uid;
        if (setgroups(1, &g) || setgid(g) || setuid(uid)) {
            rep.n = -1;
        } else {
            free(RESP); /* the parent's, inherited: valgrind counts it lost otherwise */
            RESP = calloc(1, sizeof(*RESP));
            if (RESP)
                fn(&rep, arg);
            else
                rep.n = -2;
        }
        free(RESP);
        RESP = NULL;
        ssize_t wr = write(p[1], &rep, sizeof(rep));
        _exit(wr == (ssize_t)sizeof(rep) ? 0 : 1);
    }
    close(p[1]);
    report_t rep;
    ck_assert_int_eq(read(p[0], &rep, sizeof(rep)), (ssize_t)sizeof(rep));
    close(p[0]);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(rep.n >= 0, "cannot become uid %d (%d)", (int)uid, rep.n);
    return rep;
}

static void put(report_t *rep, int code)
{
    if (rep->n < MAX_CODES)
        rep->code[rep->n++] = code;
}

/* ---- defect 2: names that are not UTF-8, or could forge log fields ------------------------ */

START_TEST(test_names_must_be_utf8_and_plain)
{
    start_with(NULL);
    static const char *const bad[] = {"\xff\xfe", "a\xc0\x80", "ok\xed\xa0\x80", "two words",
                                      "k=v",      "q\"uote",   "new\nline",      "tab\t"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvp_raw_t w;
        kvp_raw_open(&w, DMN.sock);
        ck_assert_msg(hello_lease(&w, bad[i], 0) == kvpool_Code_INVALID_ARGUMENT,
                      "namespace #%zu accepted", i);
        /* the session is still before Hello: a bad client_name is refused too */
        ck_assert_int_eq(hello_full(&w, "fine", bad[i], 0, 1, 0), kvpool_Code_INVALID_ARGUMENT);
        ck_assert_ptr_nonnull(strstr(RESP->status.message, "client_name"));
        kvp_raw_close(&w);
    }
    /* every character of the documented set passes */
    kvp_raw_t w;
    kvp_raw_open(&w, DMN.sock);
    ck_assert_int_eq(hello_full(&w, "Eng-1.a_b:c@d/e+f", "vllm-0.9", 0, 1, 0), kvpool_Code_OK);
    /* the other string fields the daemon reads */
    ck_assert_int_eq(list_seqs(&w, "\xff\xfe"), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_int_eq(list_seqs(&w, "a b"), kvpool_Code_INVALID_ARGUMENT);
    kvpool_Request q = {.id = 77, .which_body = kvpool_Request_export_begin_tag};
    q.body.export_begin.seq_id = 1;
    snprintf(q.body.export_begin.peer, sizeof(q.body.export_begin.peer), "%s", "\xc3\x28");
    ck_assert_int_eq(kvp_raw_call(&w, &q, NULL, 0, RESP), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(RESP->status.message, "peer"));
    /* every name Stats and ListClients report is valid (a protobuf library decodes them) */
    ck_assert_int_eq(stats(&w), kvpool_Code_OK);
    ck_assert_uint_eq(RESP->body.stats.stats.namespaces_count, 1);
    ck_assert_str_eq(RESP->body.stats.stats.namespaces[0].name, "Eng-1.a_b:c@d/e+f");
    ck_assert_int_eq(list_clients(&w), kvpool_Code_OK);
    ck_assert_uint_eq(RESP->body.list_clients.clients_count, 1);
    ck_assert_str_eq(RESP->body.list_clients.clients[0].client_name, "vllm-0.9");
    kvp_raw_close(&w);
    stop_expect_clean();
}
END_TEST

/* ---- defect 6: reserved names, observers ----------------------------------------------------- */

static void squat(report_t *rep, void *arg)
{
    (void)arg;
    static const char *const names[] = {"kvpoolctl", "default", "", "kvpool.health"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        kvp_raw_t w;
        kvp_raw_open(&w, DMN.sock);
        put(rep, hello_lease(&w, names[i], 86400000));
        kvp_raw_close(&w);
    }
    /* an observer reads without owning anything, and changes nothing */
    kvp_raw_t w;
    kvp_raw_open(&w, DMN.sock);
    put(rep, hello_full(&w, "", "probe", 1, 0, 0));
    put(rep, stats(&w));
    put(rep, reserve_n(&w, 5, 1, 1));
    kvpool_Request q = {.id = 0, .which_body = kvpool_Request_pool_info_tag};
    q.body.pool_info.want_pool_fds = true;
    put(rep, kvp_raw_call(&w, &q, NULL, 0, RESP));
    put(rep, list_seqs(&w, ""));
    kvp_raw_close(&w);
    /* an observer names no namespace */
    kvp_raw_open(&w, DMN.sock);
    put(rep, hello_full(&w, "tenant", "probe", 1, 0, 0));
    kvp_raw_close(&w);
}

START_TEST(test_reserved_names_and_observers)
{
    NEED_ROOT();
    start_with(NULL);
    report_t rep = as_user(65534, squat, NULL);
    ck_assert_int_eq(rep.n, 10);
    for (int i = 0; i < 4; i++)
        ck_assert_msg(rep.code[i] == kvpool_Code_PERMISSION_DENIED, "name #%d: code %d", i,
                      rep.code[i]);
    ck_assert_int_eq(rep.code[4], kvpool_Code_OK);                  /* observer Hello */
    ck_assert_int_eq(rep.code[5], kvpool_Code_OK);                  /* Stats */
    ck_assert_int_eq(rep.code[6], kvpool_Code_FAILED_PRECONDITION); /* Reserve */
    ck_assert_int_eq(rep.code[7], kvpool_Code_FAILED_PRECONDITION); /* pool fds */
    ck_assert_int_eq(rep.code[8], kvpool_Code_INVALID_ARGUMENT);    /* ListSequences, no ns */
    ck_assert_int_eq(rep.code[9], kvpool_Code_INVALID_ARGUMENT);    /* observer + namespace */

    /* nothing was created, and the operator (root) still gets kvpoolctl's view both ways */
    kvp_client_opts_t o = {.socket_path = DMN.sock,
                           .client_name = "kvpoolctl",
                           .lease_ms = KVP_LEASE_DEFAULT,
                           .observer = 1};
    kvp_client_t *c = NULL;
    char err[256];
    ck_assert_msg(kvp_client_connect(&o, &c, err, sizeof(err)) == 0, "observer: %s", err);
    kvp_stats_summary_t st;
    ck_assert_int_eq(kvp_client_stats(c, &st), 0);
    ck_assert_uint_eq(st.num_seqs, 0);
    kvp_client_close(c);
    kvp_raw_t w;
    kvp_raw_open(&w, DMN.sock);
    ck_assert_int_eq(hello_lease(&w, "kvpoolctl", 0), kvpool_Code_OK);
    ck_assert_int_eq(stats(&w), kvpool_Code_OK);
    ck_assert_uint_eq(RESP->body.stats.stats.namespaces_count, 1); /* kvpoolctl's own */
    kvp_raw_close(&w);
    stop_expect_clean();
}
END_TEST

/* ---- defect 7: another tenant's metadata ---------------------------------------------------- */

static void tenant_a(report_t *rep, void *arg)
{
    (void)arg;
    kvp_raw_t w;
    kvp_raw_open(&w, DMN.sock);
    put(rep, hello_lease(&w, "tenantA", 60000));
    put(rep, reserve_n(&w, 9, 7, 1));
    kvp_raw_close(&w); /* the lease keeps seq 7 */
}

static void tenant_b(report_t *rep, void *arg)
{
    (void)arg;
    kvp_raw_t w;
    kvp_raw_open(&w, DMN.sock);
    put(rep, hello_lease(&w, "tenantB", 0));
    put(rep, list_seqs(&w, "tenantA"));
    put(rep, list_clients(&w));
    /* only its own session: not root's "ops" connection */
    int others = 0;
    for (pb_size_t i = 0; i < RESP->body.list_clients.clients_count; i++)
        others += RESP->body.list_clients.clients[i].uid != 65533;
    put(rep, (int)RESP->body.list_clients.clients_count);
    put(rep, others);
    put(rep, stats(&w));
    put(rep, (int)RESP->body.stats.stats.namespaces_count);
    put(rep, find_ns("tenantA") != NULL || find_ns("ops") != NULL);
    put(rep, (int)RESP->body.stats.stats.num_seqs); /* the pool's totals stay global */
    kvp_raw_close(&w);
}

START_TEST(test_tenants_see_only_their_own)
{
    NEED_ROOT();
    start_with(NULL);
    kvp_raw_t ops;
    kvp_raw_open(&ops, DMN.sock);
    ck_assert_int_eq(hello_lease(&ops, "ops", 0), kvpool_Code_OK);
    report_t a = as_user(65534, tenant_a, NULL);
    ck_assert_int_eq(a.code[0], kvpool_Code_OK);
    ck_assert_int_eq(a.code[1], kvpool_Code_OK);
    report_t b = as_user(65533, tenant_b, NULL);
    ck_assert_int_eq(b.n, 9);
    ck_assert_int_eq(b.code[0], kvpool_Code_OK);
    ck_assert_int_eq(b.code[1], kvpool_Code_PERMISSION_DENIED); /* A's sequences */
    ck_assert_int_eq(b.code[2], kvpool_Code_OK);
    ck_assert_int_eq(b.code[3], 1); /* its own session only */
    ck_assert_int_eq(b.code[4], 0);
    ck_assert_int_eq(b.code[5], kvpool_Code_OK);
    ck_assert_int_eq(b.code[6], 1); /* tenantB */
    ck_assert_int_eq(b.code[7], 0);
    ck_assert_int_eq(b.code[8], 1);
    /* the operator sees everything */
    ck_assert_int_eq(list_seqs(&ops, "tenantA"), kvpool_Code_OK);
    ck_assert_uint_eq(RESP->body.list_sequences.seqs_count, 1);
    ck_assert_uint_eq(RESP->body.list_sequences.seqs[0].seq_id, 7);
    ck_assert_int_eq(stats(&ops), kvpool_Code_OK);
    ck_assert_ptr_nonnull(find_ns("tenantA"));
    ck_assert_ptr_nonnull(find_ns("ops"));
    kvp_raw_close(&ops);
    stop_expect_clean();
}
END_TEST

/* ---- defect 8: more namespaces than Stats holds -------------------------------------------- */

START_TEST(test_stats_says_when_truncated)
{
    start_with(NULL);
    enum { NS = 100 };
    for (int i = 0; i < NS; i++) {
        kvp_raw_t w;
        kvp_raw_open(&w, DMN.sock);
        char name[16];
        snprintf(name, sizeof(name), "ns%03d", i);
        ck_assert_int_eq(hello_lease(&w, name, 60000), kvpool_Code_OK);
        ck_assert_int_eq(reserve_tok(&w, 3, 1, 1, 0), kvpool_Code_OK); /* no page */
        kvp_raw_close(&w);
    }
    kvp_raw_t w;
    kvp_raw_open(&w, DMN.sock);
    ck_assert_int_eq(hello_lease(&w, "ns000", 60000), kvpool_Code_OK);
    ck_assert_int_eq(stats(&w), kvpool_Code_OK);
    const kvpool_Stats *st = &RESP->body.stats.stats;
    ck_assert_uint_eq(st->num_seqs, NS);
    ck_assert_uint_eq(st->namespaces_count, 64);
    ck_assert_uint_eq(st->namespaces_total, NS);
    ck_assert(st->namespaces_truncated);
    kvp_raw_close(&w);

    /* kvpoolctl seqs --json never claims a complete answer it does not have */
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "%s --socket %s seqs --json", KVPOOLCTL_PATH, DMN.sock);
    FILE *f = popen(cmd, "r");
    ck_assert_ptr_nonnull(f);
    static char out[1 << 16];
    size_t len = fread(out, 1, sizeof(out) - 1, f);
    out[len] = '\0';
    ck_assert_int_eq(pclose(f), 0);
    ck_assert_msg(strstr(out, "\"truncated\": true") || strstr(out, "\"truncated\":true"),
                  "kvpoolctl seqs --json: %.300s", out);
    stop_expect_clean();
}
END_TEST

/* ---- defect 3: per-uid quotas ---------------------------------------------------------------- */

/* Whether the daemon has seen every session of the caller's uid go: no namespace visible to the
 * observer session arg (the caller's own, an observer attaches to none) has one left. A close
 * is handled asynchronously; until it is, the closed session still counts against the uid's
 * namespace quota. */
static int own_sessions_gone(void *arg)
{
    if (stats(arg) != kvpool_Code_OK)
        return 0;
    const kvpool_Stats *st = &RESP->body.stats.stats;
    for (pb_size_t i = 0; i < st->namespaces_count; i++)
        if (st->namespaces[i].sessions)
            return 0;
    return 1;
}

/* Waits until own_sessions_gone through probe; a timeout is written in rep->note (the parent
 * asserts it empty) so that the codes the test counts stay the tenant's calls only. */
static void wait_own_sessions_gone(report_t *rep, kvp_raw_t *probe)
{
    if (!kvp_wait_until(own_sessions_gone, probe, 10000) && !rep->note[0])
        snprintf(rep->note, sizeof(rep->note), "the daemon did not see the tenant's closes");
}

static void quota_tenant(report_t *rep, void *arg)
{
    (void)arg;
    kvp_raw_t probe; /* an observer of this uid: owns no namespace, counts against no quota */
    kvp_raw_open(&probe, DMN.sock);
    if (hello_full(&probe, "", "probe", 1, 0, 0) != kvpool_Code_OK)
        snprintf(rep->note, sizeof(rep->note), "the observer probe's Hello failed");
    kvp_raw_t w[4];
    static const char *const names[] = {"q1", "q2", "q3", "q4"};
    for (int i = 0; i < 4; i++) {
        kvp_raw_open(&w[i], DMN.sock);
        put(rep, hello_lease(&w[i], names[i], 86400000)); /* q4: above uid_max_namespaces */
    }
    put(rep, reserve_n(&w[0], 11, 1, 6)); /* 6 of its 10 */
    put(rep, reserve_n(&w[1], 12, 1, 5)); /* 11: refused, nothing created */
    put(rep, reserve_n(&w[1], 13, 1, 4)); /* 10 */
    put(rep, reserve_n(&w[2], 14, 1, 1)); /* 11: refused in an empty namespace */
    put(rep, reserve_n(&w[0], 15, 1, 6)); /* growing what it has is not a new sequence */
    for (int i = 0; i < 4; i++)
        kvp_raw_close(&w[i]);
    wait_own_sessions_gone(rep, &probe); /* the daemon sees the closes before the next Hello */
    /* lapsed sessions, one after the other, each with a day's lease: each is idle (its close
     * seen) before the next Hello, so only the idle cap decides what is left */
    for (int i = 0; i < 10; i++) {
        kvp_raw_t x;
        kvp_raw_open(&x, DMN.sock);
        char name[16];
        snprintf(name, sizeof(name), "lapsed%d", i);
        put(rep, hello_lease(&x, name, 86400000));
        kvp_raw_close(&x);
        wait_own_sessions_gone(rep, &probe);
    }
    kvp_raw_close(&probe);
}

static void bystander(report_t *rep, void *arg)
{
    (void)arg;
    kvp_raw_t w;
    kvp_raw_open(&w, DMN.sock);
    put(rep, hello_lease(&w, "bystander", 0));
    put(rep, reserve_n(&w, 21, 1, 8));
    kvp_raw_close(&w);
}

START_TEST(test_uid_quotas)
{
    NEED_ROOT();
    const char *more[] = {
        "--set", "limits.uid_max_namespaces=3",      "--set", "limits.uid_max_seqs=10",
        "--set", "limits.uid_max_idle_namespaces=2", "--set", "limits.max_namespaces=8",
        NULL};
    start_with(more);
    report_t t = as_user(65534, quota_tenant, NULL);
    ck_assert_msg(!t.note[0], "quota tenant: %s", t.note);
    ck_assert_int_eq(t.n, 19);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(t.code[i], kvpool_Code_OK);
    ck_assert_int_eq(t.code[3], kvpool_Code_RESOURCE_EXHAUSTED);
    ck_assert_int_eq(t.code[4], kvpool_Code_OK);
    ck_assert_int_eq(t.code[5], kvpool_Code_RESOURCE_EXHAUSTED);
    ck_assert_int_eq(t.code[6], kvpool_Code_OK);
    ck_assert_int_eq(t.code[7], kvpool_Code_RESOURCE_EXHAUSTED);
    ck_assert_int_eq(t.code[8], kvpool_Code_OK);
    for (int i = 9; i < 19; i++) /* the idle cap releases the oldest: a Hello always fits */
        ck_assert_msg(t.code[i] == kvpool_Code_OK, "lapsed #%d: %d", i - 9, t.code[i]);

    /* at most 2 of the tenant's namespaces are left (the ones whose leases end last), so
     * the 8-slot table still has room, and a bystander notices nothing */
    kvp_raw_t ops;
    kvp_raw_open(&ops, DMN.sock);
    ck_assert_int_eq(hello_lease(&ops, "ops", 0), kvpool_Code_OK);
    /* the tenant saw each of its closes handled before it exited: the count is final */
    ck_assert_int_eq(stats(&ops), kvpool_Code_OK);
    ck_assert_uint_eq(RESP->body.stats.stats.namespaces_count, 3); /* ops + 2 */
    ck_assert_ptr_nonnull(find_ns("lapsed8"));
    ck_assert_ptr_nonnull(find_ns("lapsed9"));
    report_t b = as_user(65533, bystander, NULL);
    ck_assert_int_eq(b.code[0], kvpool_Code_OK);
    ck_assert_int_eq(b.code[1], kvpool_Code_OK);
    /* the operator is exempt */
    ck_assert_int_eq(reserve_n(&ops, 31, 100, 20), kvpool_Code_OK);
    kvp_raw_close(&ops);
    stop_expect_clean();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("hostile_names");
    TCase *tc = tcase_create("hostile_names");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_names_must_be_utf8_and_plain);
    tcase_add_test(tc, test_reserved_names_and_observers);
    tcase_add_test(tc, test_tenants_see_only_their_own);
    tcase_add_test(tc, test_stats_says_when_truncated);
    tcase_add_test(tc, test_uid_quotas);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
