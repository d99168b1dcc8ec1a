/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_client_admin.c - libkvpool's operator reads (issue #27: what kvpoolctl now calls instead
 * of building protocol messages) against a real kvpoold, host backend: kvp_client_daemon_stats
 * with its caps and NULL-array rules, kvp_client_list_seqs page by page, kvp_client_list_clients,
 * kvp_client_audit_report, kvp_client_metrics with a buffer too small, kvp_client_get_pool_info
 * against Hello's copy. Every figure is the exact one the sequences reserved here imply.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_harness.h"
#include "kvpool.h"

static kvp_daemon_t D;
static kvp_client_t *A, *B, *OBS; /* namespaces "alpha" (3 sequences), "beta" (1), an observer */

static kvp_client_t *connect_to(const char *ns, int observer)
{
    kvp_client_opts_t o;
    memset(&o, 0, sizeof(o));
    o.socket_path = D.sock;
    o.ns = ns;
    o.client_name = observer ? "admin-observer" : ns;
    o.lease_ms = KVP_LEASE_DEFAULT;
    o.observer = observer;
    kvp_client_t *c = NULL;
    char err[256];
    int rc = kvp_client_connect(&o, &c, err, sizeof(err));
    ck_assert_msg(rc == 0, "connect %s: %s", ns ? ns : "(observer)", err);
    return c;
}

/* Reserves num_tokens for each of n sequences. */
static void reserve(kvp_client_t *c, const uint64_t *ids, const uint32_t *num_tokens, uint32_t n)
{
    int32_t indptr[8], indices[64], last[8], aip[8], lens[8];
    uint32_t copies[16];
    kvp_page_table_t t = {.kv_indptr = indptr,
                          .kv_indices = indices,
                          .kv_last_page_len = last,
                          .append_indptr = aip,
                          .seq_lens = lens,
                          .copies = copies,
                          .cap_batch = 8,
                          .cap_indices = 64,
                          .cap_copies = 8};
    int rc = kvp_client_reserve(c, ids, num_tokens, n, &t);
    ck_assert_msg(rc == 0, "reserve: %s", kvp_client_last_error(c));
}

static void setup(void)
{
    /* 64 pages of 4 tokens, 2 layers, 2 KV heads, head_dim 16 */
    const char *args[] = {"--backend",   "host", "--num-layers",   "2", "--num-pages", "64",
                          "--page-size", "4",    "--num-kv-heads", "2", "--head-dim",  "16",
                          NULL};
    ck_assert_int_eq(kvp_daemon_start(&D, args), 0);
    A = connect_to("alpha", 0);
    B = connect_to("beta", 0);
    OBS = connect_to(NULL, 1);
    const uint64_t a_ids[] = {11, 12, 13};
    const uint32_t a_toks[] = {5, 8, 1}; /* 2 + 2 + 1 pages */
    reserve(A, a_ids, a_toks, 3);
    const uint64_t b_ids[] = {21};
    const uint32_t b_toks[] = {9}; /* 3 pages */
    reserve(B, b_ids, b_toks, 1);
}

static void teardown(void)
{
    kvp_client_close(OBS);
    kvp_client_close(B);
    kvp_client_close(A);
    ck_assert_int_eq(kvp_daemon_stop(&D, 15), 0);
}

static const kvp_namespace_stats_t *find_ns(const kvp_daemon_stats_t *d, const char *name)
{
    for (uint32_t i = 0; i < d->num_namespaces; i++)
        if (strcmp(d->namespaces[i].name, name) == 0)
            return &d->namespaces[i];
    return NULL;
}

START_TEST(daemon_stats_counts_every_namespace_within_its_caps)
{
    kvp_namespace_stats_t ns[KVP_CLIENT_MAX_NAMESPACES];
    kvp_scope_stats_t sc[KVP_CLIENT_MAX_SCOPES];
    kvp_daemon_stats_t d;
    memset(&d, 0, sizeof(d));
    d.namespaces = ns;
    d.cap_namespaces = KVP_CLIENT_MAX_NAMESPACES;
    d.scopes = sc;
    d.cap_scopes = KVP_CLIENT_MAX_SCOPES;
    ck_assert_int_eq(kvp_client_daemon_stats(OBS, &d), 0);
    ck_assert_uint_eq(d.summary.num_pages, 64);
    ck_assert_uint_eq(d.summary.used_pages, 8);
    ck_assert_uint_eq(d.summary.free_pages, 56);
    ck_assert_uint_eq(d.summary.num_seqs, 4);
    ck_assert_uint_eq(d.summary.num_tokens, 23);
    ck_assert_uint_eq(d.summary.num_clients, 3);
    ck_assert_uint_eq(d.num_namespaces, 2);
    const kvp_namespace_stats_t *a = find_ns(&d, "alpha"), *b = find_ns(&d, "beta");
    ck_assert_ptr_nonnull(a);
    ck_assert_ptr_nonnull(b);
    ck_assert_uint_eq(a->num_seqs, 3);
    ck_assert_uint_eq(a->num_tokens, 14);
    ck_assert_uint_eq(a->page_refs, 5);
    ck_assert_uint_eq(a->sessions, 1);
    ck_assert_uint_eq(b->num_seqs, 1);
    ck_assert_uint_eq(b->num_tokens, 9);
    ck_assert_uint_eq(b->page_refs, 3);
    ck_assert_uint_eq(d.num_scopes, 2); /* each namespace's private scope */

    /* a cap of 1: one namespace written, the summary whole */
    kvp_daemon_stats_t one;
    memset(&one, 0, sizeof(one));
    one.namespaces = ns;
    one.cap_namespaces = 1;
    ck_assert_int_eq(kvp_client_daemon_stats(OBS, &one), 0);
    ck_assert_uint_eq(one.num_namespaces, 1);
    ck_assert_uint_eq(one.num_scopes, 0); /* no array: not wanted */
    ck_assert_uint_eq(one.summary.num_seqs, 4);

    /* an array NULL with a cap, or no struct at all: refused */
    kvp_daemon_stats_t bad;
    memset(&bad, 0, sizeof(bad));
    bad.cap_namespaces = 4;
    ck_assert_int_eq(kvp_client_daemon_stats(OBS, &bad), KVP_EINVAL);
    ck_assert_int_eq(kvp_client_daemon_stats(OBS, NULL), KVP_EINVAL);
}
END_TEST

START_TEST(list_seqs_pages_through_a_namespace)
{
    kvp_seq_info_t s[KVP_CLIENT_MAX_SEQS_LISTED];
    uint32_t n = 99, next = 99, seen = 0;
    uint64_t ids[4] = {0};
    uint32_t toks[4] = {0};
    uint32_t cursor = 0, pages = 0;
    do {
        ck_assert_int_eq(kvp_client_list_seqs(OBS, "alpha", cursor, s, 2, &n, &next), 0);
        ck_assert_uint_le(n, 2);
        for (uint32_t i = 0; i < n && seen < 4; i++, seen++) {
            ids[seen] = s[i].seq_id;
            toks[seen] = s[i].num_tokens;
            pages += s[i].num_pages;
        }
        cursor = next;
    } while (next != 0);
    ck_assert_uint_eq(seen, 3);
    ck_assert_uint_eq(pages, 5);
    for (uint32_t i = 0; i < 3; i++) { /* in any order: each id once, with its tokens */
        const uint32_t want = ids[i] == 11 ? 5 : ids[i] == 12 ? 8 : ids[i] == 13 ? 1 : 0;
        ck_assert_msg(want && toks[i] == want, "seq %llu: %u tokens", (unsigned long long)ids[i],
                      toks[i]);
    }
    ck_assert(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2]);
    /* the caller's own namespace with ns NULL; an observer has none */
    ck_assert_int_eq(kvp_client_list_seqs(B, NULL, 0, s, 8, &n, NULL), 0);
    ck_assert_uint_eq(n, 1);
    ck_assert_uint_eq(s[0].seq_id, 21);
    ck_assert_uint_eq(s[0].num_pages, 3);
    ck_assert_int_eq(kvp_client_list_seqs(OBS, NULL, 0, s, 8, &n, NULL), KVP_EINVAL);
    ck_assert_int_eq(kvp_client_list_seqs(OBS, "gamma", 0, s, 8, &n, NULL), KVP_ENOENT);
}
END_TEST

START_TEST(list_clients_audit_metrics_and_pool_info)
{
    kvp_session_info_t s[KVP_CLIENT_MAX_SESSIONS];
    uint32_t n = 0;
    ck_assert_int_eq(kvp_client_list_clients(OBS, s, KVP_CLIENT_MAX_SESSIONS, &n), 0);
    ck_assert_uint_eq(n, 3);
    int alpha = 0, beta = 0, observer = 0;
    for (uint32_t i = 0; i < n; i++) {
        alpha += strcmp(s[i].ns, "alpha") == 0 && strcmp(s[i].client_name, "alpha") == 0;
        beta += strcmp(s[i].ns, "beta") == 0;
        observer += s[i].ns[0] == '\0' && strcmp(s[i].client_name, "admin-observer") == 0;
    }
    ck_assert_int_eq(alpha + beta + observer, 3);
    ck_assert_int_eq(alpha * beta * observer, 1);
    ck_assert_int_eq(kvp_client_list_clients(OBS, s, 1, &n), 0); /* the first max of them */
    ck_assert_uint_eq(n, 1);

    int ok = -1;
    char msg[KVP_CLIENT_AUDIT_MESSAGE_BYTES];
    ck_assert_int_eq(kvp_client_audit_report(OBS, &ok, msg, sizeof(msg)), 0);
    ck_assert_int_eq(ok, 1);
    ck_assert_str_eq(msg, "ok");

    static char text[1 << 20];
    size_t len = 0;
    ck_assert_int_eq(kvp_client_metrics(OBS, text, sizeof(text), &len), 0);
    ck_assert_uint_eq(len, strlen(text));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_build_info{"));
    ck_assert_ptr_nonnull(strstr(text, "\nkvpool_sequences{namespace=\"alpha\"} 3\n"));
    ck_assert_ptr_nonnull(strstr(text, "\nkvpool_sequences{namespace=\"beta\"} 1\n"));
    char tiny[16];
    ck_assert_int_eq(kvp_client_metrics(OBS, tiny, sizeof(tiny), &len), KVP_ELIMIT);

    kvp_pool_info_t p;
    ck_assert_int_eq(kvp_client_get_pool_info(A, &p), 0);
    const kvp_pool_info_t *h = kvp_client_pool_info(A);
    ck_assert_uint_eq(p.num_pages, 64);
    ck_assert_uint_eq(p.page_size, 4);
    ck_assert_uint_eq(p.num_layers, 2);
    ck_assert_uint_eq(p.num_kv_heads, 2);
    ck_assert_uint_eq(p.head_dim, 16);
    ck_assert_uint_eq(p.pool_bytes, h->pool_bytes);
    ck_assert_uint_eq(p.stride_page, h->stride_page);
    ck_assert_uint_eq(p.backend, h->backend);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("client_admin");
    TCase *tc = tcase_create("admin");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, daemon_stats_counts_every_namespace_within_its_caps);
    tcase_add_test(tc, list_seqs_pages_through_a_namespace);
    tcase_add_test(tc, list_clients_audit_metrics_and_pool_info);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
