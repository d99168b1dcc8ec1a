/* SPDX-License-Identifier: Apache-2.0 */
/* stress_common.c - see stress_common.h. */
#include "stress_common.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvp_sock.h"

static kvp_daemon_t *OWNED; /* the daemon s_start started, in the process that started it */
static pid_t OWNER;

void s_fail(void)
{
    if (OWNED && OWNED->pid > 0 && getpid() == OWNER) {
        kvp_daemon_dump_log(OWNED);
        kvp_daemon_stop(OWNED, SIGKILL);
    }
    exit(1);
}

kvp_page_table_t *s_table(s_table_t *tb)
{
    memset(&tb->t, 0, sizeof(tb->t));
    tb->t = (kvp_page_table_t){.kv_indptr = tb->indptr,
                               .kv_indices = tb->indices,
                               .kv_last_page_len = tb->last,
                               .append_indptr = tb->aindptr,
                               .seq_lens = tb->lens,
                               .copies = tb->copies,
                               .cap_batch = S_MAXB + 1,
                               .cap_indices = S_MAXIDX,
                               .cap_copies = S_MAXIDX};
    return &tb->t;
}

void s_start(kvp_daemon_t *d, uint32_t num_pages, const char *const *extra,
             const kvp_daemon_opts_t *opts)
{
    char pages[16];
    snprintf(pages, sizeof(pages), "%u", num_pages);
    const char *args[64] = {"--backend",      "host",
                            "--num-layers",   "2",
                            "--num-pages",    pages,
                            "--page-size",    "4",
                            "--num-kv-heads", "2",
                            "--head-dim",     "16",
                            "--set",          "limits.max_seq_tokens=256",
                            "--set",          "limits.dedup_window=64",
                            "--set",          "server.max_connections=1024"};
    int n = 18;
    for (int i = 0; extra && extra[i] && n < 62; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    S_CHECK(kvp_daemon_start_opts(d, args, opts) == 0, "kvpoold did not start");
    OWNED = d;
    OWNER = getpid();
}

kvp_client_t *s_connect(const kvp_daemon_t *d, const char *ns, uint32_t lease_ms, int map_pool)
{
    kvp_client_opts_t o = {.socket_path = d->sock,
                           .ns = ns,
                           .client_name = "stress",
                           .lease_ms = lease_ms,
                           .timeout_ms = kvp_daemon_wrapped() ? 120000 : 30000,
                           .map_pool = map_pool};
    kvp_client_t *c = NULL;
    char err[256] = "";
    int rc = kvp_client_connect(&o, &c, err, sizeof(err));
    S_CHECK(rc == 0, "connect %s: %s (%s)", ns, err, kvp_errname(rc));
    return c;
}

int s_raw_send(int fd, kvpool_Request *q)
{
    uint8_t buf[4096];
    long n = kvp_wire_encode_frame(kvpool_Request_fields, q, buf, sizeof(buf));
    if (n < 0)
        return (int)n;
    return kvp_sock_send_frame(fd, buf, (size_t)n, NULL, 0, kvp_sock_deadline(5000));
}

int s_raw_hello(const kvp_daemon_t *d, const char *ns)
{
    int fd;
    S_CHECK(kvp_sock_connect(d->sock, 5000, &fd) == 0, "raw connect");
    kvpool_Request q = {.id = 1, .which_body = kvpool_Request_hello_tag};
    q.body.hello.protocol_version = KVP_PROTOCOL_VERSION;
    q.body.hello.has_lease_ms = false;
    snprintf(q.body.hello.namespace, sizeof(q.body.hello.namespace), "%s", ns);
    snprintf(q.body.hello.client_name, sizeof(q.body.hello.client_name), "raw");
    S_CHECK(s_raw_send(fd, &q) == 0, "raw hello");
    return fd;
}

int s_ns_stats(kvp_client_t *c, const char *ns, uint32_t *num_seqs, uint64_t *num_tokens,
               uint64_t *page_refs)
{
    static kvpool_Request q;
    static kvpool_Response r;
    memset(&q, 0, sizeof(q));
    memset(&r, 0, sizeof(r));
    q.which_body = kvpool_Request_stats_tag;
    int rc = kvp_client_call_raw(c, &q, &r, NULL);
    S_CHECK(rc == 0, "stats: %s", kvp_client_last_error(c));
    for (pb_size_t i = 0; i < r.body.stats.stats.namespaces_count; i++) {
        const kvpool_NamespaceStats *n = &r.body.stats.stats.namespaces[i];
        if (strcmp(n->name, ns) == 0) {
            *num_seqs = n->num_seqs;
            *num_tokens = n->num_tokens;
            *page_refs = n->page_refs;
            return 0;
        }
    }
    return -1;
}

uint32_t s_wait_clients(kvp_client_t *obs, uint32_t want)
{
    kvp_stats_summary_t st = {0};
    for (int i = 0; i < 1000; i++) {
        S_CHECK(kvp_client_stats(obs, &st) == 0, "stats");
        if (st.num_clients == want)
            break;
        usleep(10000);
    }
    return st.num_clients;
}

unsigned s_env(const char *name, unsigned dflt)
{
    const char *v = getenv(name);
    return v && *v ? (unsigned)strtoul(v, NULL, 10) : dflt;
}

int s_wait_fds(const kvp_daemon_t *d, int want)
{
    int n = kvp_daemon_fd_count(d);
    for (int i = 0; i < 200 && n != want; i++) {
        usleep(10000); /* a closed connection's fd goes in the loop's close phase */
        n = kvp_daemon_fd_count(d);
    }
    return n;
}
