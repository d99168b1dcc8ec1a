/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_hostile_cache.c - integration, issue #26: the prefix cache under a hostile tenant. Each
 * case replays one attack of the issue against a real kvpoold (host backend) and asserts the
 * exact answers the daemon must give: a write into a keyed tail page after fork + truncate +
 * release (D1), a Reserve or a reused sequence id racing a daemon-run Append (D2), private
 * scope names and flushes across uids (D3), salts that continue another chain (D4), pins that
 * fill the pin table (D5), escape the page quota and the idle-namespace cap (D6), a refused
 * Hello that rewrites a lease (D7), a uid refused the pool that publishes (D8), Metrics over the
 * socket (M), retention priority (P), the size of a Lookup (L) and the retry window of the
 * cache's calls (Q). Every case ends with the daemon's Audit and a SIGTERM exit of 0.
 *
 * A peer is one raw connection (kvp_raw.h: the test chooses request ids and may leave an
 * answer in flight), either in this process (root) or in a forked child that drops to uid
 * 65533 or 65534 (setgroups, setgid, setuid) and runs the commands the test sends it over a
 * pipe, so the same cmd_t means the same call whoever makes it. Acting as other users needs
 * root (CI runs as root): the cases that do are skipped with a note otherwise. Geometry: 2
 * layers, 64 pages of 4 tokens, 2 KV heads, head_dim 16, fp16 (kvp_daemon_start_shared)
 * unless a case says otherwise. The daemon-run Appends copy zeros: these cases check what the
 * cache finds and holds, test_prefix_cache.c checks the bytes.
 */
#include <check.h>
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "kvp_harness.h"
#include "kvp_raw.h"
#include "kvp_sock.h"

#define SELF      0 /* a peer in this process (root in CI) */
#define UID_A     65533
#define UID_B     65534
#define PS        4   /* tokens per page of the shared geometry */
#define MAX_SPANS 3   /* runs of token ids one command carries */
#define MAX_PAGES 256 /* page ids of one sequence a command reports */
#define TEXT_CAP  ((1u << 20) + 1)

#define OK             kvpool_Code_OK
#define ALREADY_EXISTS kvpool_Code_ALREADY_EXISTS
#define DENIED         kvpool_Code_PERMISSION_DENIED
#define EXHAUSTED      kvpool_Code_RESOURCE_EXHAUSTED
#define PRECONDITION   kvpool_Code_FAILED_PRECONDITION
#define NOT_FOUND      kvpool_Code_NOT_FOUND

#define NEED_ROOT()                                                                                \
    do {                                                                                           \
        if (geteuid() != 0) {                                                                      \
            fprintf(stderr, "%s: skipped (needs root to act as other users)\n", __func__);         \
            return;                                                                                \
        }                                                                                          \
    } while (0)

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) && errno == EINTR)
        ;
}

/* ---- commands and their results ------------------------------------------------------------- */

enum {
    OP_HELLO = 1, /* ns (empty + observer: an observer), scope, lease */
    OP_APPEND,    /* daemon-run, from a registered memfd (zeros): seq, ids or num_tokens, salt */
    OP_RESERVE,   /* seq, ids or num_tokens, salt, priority, reuse */
    OP_COMMIT,    /* seq */
    OP_LOOKUP,    /* one prompt: ids, salt */
    OP_PIN,       /* ids, salt, ttl_ms */
    OP_UNPIN,     /* pin_id */
    OP_FLUSH,     /* scope, all */
    OP_RELEASE,   /* seq */
    OP_FORK,      /* seq -> seq2 */
    OP_TRUNCATE,  /* seq to num_tokens */
    OP_SEQ_LEN,   /* GetPageTable of seq */
    OP_STATS,
    OP_AUDIT,
    OP_METRICS,   /* counts needle in the text */
    OP_RECV,      /* the answer of a command sent with nowait */
    OP_READY,     /* whether an answer waits on the connection (nothing is read) */
    OP_RECONNECT, /* closes the connection (the daemon sees it go) and opens a new one */
    OP_EXIT,
};

typedef struct {
    int32_t first; /* token ids first, first + 1, ..., first + n - 1 */
    uint32_t n;
} span_t;

typedef struct {
    int op;
    uint64_t id; /* request id; 0: the next of this process */
    uint64_t seq, seq2;
    uint32_t num_tokens;   /* Reserve / Append without ids, Truncate */
    span_t ids[MAX_SPANS]; /* the token ids: the spans one after the other */
    uint8_t salt[288];
    uint32_t salt_len;
    int has_prio, reuse;
    uint32_t prio;
    uint32_t ttl_ms;
    uint64_t pin_id;
    char ns[65], scope[65]; /* as HelloRequest holds them */
    int has_lease, observer, all;
    uint32_t lease_ms;
    int nowait; /* send only: OP_RECV gets the answer */
    char needle[80];
} cmd_t;

typedef struct {
    int code; /* the status, -1: no answer */
    char msg[256];
    uint32_t seq_len, npages, ncopies, cached; /* a table (one sequence); Lookup: cached */
    int32_t pages[MAX_PAGES];
    uint32_t pages_n, published; /* Commit; Pin, Unpin, CacheFlush: pages; Release: released */
    uint64_t pin_id;
    int audit_ok, ready;
    uint32_t hits;               /* Metrics: occurrences of the needle */
    uint32_t pins, pinned_pages; /* Stats */
    char names[64 * 66 + 2];     /* Stats: " ns1 ns2 ... " (those visible) */
} res_t;

/* ---- one raw connection --------------------------------------------------------------------- */

typedef struct {
    kvp_raw_t w;
    kvp_reply_arrays_t arrays; /* kvp_raw_recv binds no cached_tokens or text: ours do */
    uint32_t cached[16];
    char *text;
    char needle[80];                   /* of the Metrics call in flight */
    uint32_t layers, heads, row_bytes; /* from the Hello answer (Append's source layout) */
    uint32_t buf_id;
    uint64_t buf_bytes;
    kvpool_Response resp; /* the last answer */
} cli_t;

static uint64_t NEXT_ID; /* request ids of this process: pid << 32 + a count */

static uint64_t next_id(void)
{
    if (NEXT_ID >> 32 != (uint64_t)getpid())
        NEXT_ID = (uint64_t)getpid() << 32;
    return ++NEXT_ID;
}

static kvp_daemon_t DMN;

static void cli_connect(cli_t *c)
{
    kvp_raw_open(&c->w, DMN.sock);
    kvp_reply_arrays_t *a = &c->arrays;
    kvp_array_t *six[] = {&a->kv_indptr,     &a->kv_indices, &a->kv_last_page_len,
                          &a->append_indptr, &a->seq_lens,   &a->copies};
    for (int i = 0; i < 6; i++)
        *six[i] = kvp_array(c->w.arr[i], 4, 0, KVP_RAW_MAX_ENTRIES);
    a->cached_tokens = kvp_array(c->cached, 4, 0, 16);
    a->text = (kvp_text_t){.s = c->text, .cap = TEXT_CAP};
    c->buf_id = 0;
    c->buf_bytes = 0;
}

static cli_t *cli_open(void)
{
    cli_t *c = calloc(1, sizeof(*c));
    ck_assert_ptr_nonnull(c);
    c->text = malloc(TEXT_CAP);
    ck_assert_ptr_nonnull(c->text);
    cli_connect(c);
    return c;
}

static void cli_close(cli_t *c)
{
    if (!c)
        return;
    kvp_raw_close(&c->w);
    free(c->text);
    free(c);
}

/* The ids of the spans in one array (caller frees); their count. */
static uint32_t expand(const span_t *s, int32_t **out)
{
    uint32_t n = 0;
    for (int i = 0; i < MAX_SPANS; i++)
        n += s[i].n;
    int32_t *ids = malloc((n ? n : 1) * sizeof(int32_t));
    ck_assert_ptr_nonnull(ids);
    uint32_t k = 0;
    for (int i = 0; i < MAX_SPANS; i++)
        for (uint32_t j = 0; j < s[i].n; j++)
            ids[k++] = s[i].first + (int32_t)j;
    *out = ids;
    return n;
}

static void recv_res(cli_t *c, res_t *r);

/* A buffer of at least bytes registered on the connection (a larger memfd when needed). */
static void ensure_buffer(cli_t *c, uint64_t bytes)
{
    if (c->buf_bytes >= bytes)
        return;
    uint64_t size = (bytes + (1u << 20) - 1) & ~(uint64_t)((1u << 20) - 1);
    int fd = kvp_raw_sealed_memfd(size);
    kvpool_Request q = {.id = next_id(), .which_body = kvpool_Request_register_buffer_tag};
    q.body.register_buffer.size_bytes = size;
    q.body.register_buffer.kind = kvpool_BufferKind_BUFFER_MEMFD;
    kvp_raw_send(&c->w, &q, &fd, 1);
    close(fd);
    res_t r;
    recv_res(c, &r);
    ck_assert_msg(r.code == OK, "RegisterBuffer of %llu bytes: %d %s", (unsigned long long)size,
                  r.code, r.msg);
    c->buf_id = c->resp.body.register_buffer.buffer_id;
    c->buf_bytes = size;
}

/* Encodes m's call and sends it (its answer is read by recv_res). */
static void send_cmd(cli_t *c, const cmd_t *m)
{
    int32_t *ids;
    uint32_t nids = expand(m->ids, &ids);
    uint64_t seq = m->seq;
    uint32_t ntok = nids ? nids : m->num_tokens, salt_len = m->salt_len, lens = nids;
    kvp_batch_arrays_t b = {.seq_ids = kvp_array(&seq, 8, 1, 1),
                            .num_tokens = kvp_array(&ntok, 4, 1, 1),
                            .token_ids = kvp_array(ids, 4, nids, nids),
                            .salts = kvp_array((void *)m->salt, 1, salt_len, salt_len),
                            .salt_lens = kvp_array(&salt_len, 4, salt_len ? 1 : 0, 1)};
    kvp_batch_arrays_t only_seq = {.seq_ids = kvp_array(&seq, 8, 1, 1),
                                   .num_tokens = kvp_array(&ntok, 4, 0, 0)};
    kvp_batch_arrays_t look = {.token_ids = b.token_ids,
                               .num_tokens = kvp_array(&lens, 4, 1, 1),
                               .salts = b.salts,
                               .salt_lens = b.salt_lens};
    if (m->op == OP_APPEND) /* before the request is built: a call of its own */
        ensure_buffer(c, (uint64_t)c->layers * 2 * ntok * c->heads * c->row_bytes);
    kvpool_Request q = {.id = m->id ? m->id : next_id()};
    switch (m->op) {
    case OP_HELLO: {
        kvpool_HelloRequest *h = &q.body.hello;
        q.which_body = kvpool_Request_hello_tag;
        h->protocol_version = KVP_PROTOCOL_VERSION;
        snprintf(h->namespace, sizeof(h->namespace), "%s", m->ns);
        snprintf(h->cache_scope, sizeof(h->cache_scope), "%s", m->scope);
        h->has_lease_ms = m->has_lease != 0;
        h->lease_ms = m->lease_ms;
        h->observer = m->observer != 0;
        break;
    }
    case OP_APPEND: {
        q = kvp_raw_batch_req(kvpool_Request_append_tag, q.id, &b);
        kvpool_AppendRequest *a = &q.body.append;
        const uint64_t row = c->row_bytes, plane = (uint64_t)ntok * c->heads * row;
        a->has_source = true; /* per layer: K [tokens, heads, D], then V */
        a->source = (kvpool_Source){.buffer_id = c->buf_id,
                                    .v_offset = plane,
                                    .k_stride_n = c->heads * row,
                                    .v_stride_n = c->heads * row,
                                    .k_stride_h = row,
                                    .v_stride_h = row,
                                    .layer_stride = 2 * plane};
        a->has_cache = m->has_prio != 0;
        a->cache.has_priority = m->has_prio != 0;
        a->cache.priority = m->prio;
        break;
    }
    case OP_RESERVE:
        q = kvp_raw_batch_req(kvpool_Request_reserve_tag, q.id, &b);
        q.body.reserve.has_cache = m->has_prio || m->reuse;
        q.body.reserve.cache.has_priority = m->has_prio != 0;
        q.body.reserve.cache.priority = m->prio;
        q.body.reserve.cache.reuse = m->reuse != 0;
        break;
    case OP_COMMIT:
        q.which_body = kvpool_Request_commit_tag;
        q.body.commit.has_batch = true;
        kvp_wire_batch_bind_encode(&q.body.commit.batch, &only_seq);
        break;
    case OP_RELEASE:
        q = kvp_raw_batch_req(kvpool_Request_release_tag, q.id, &only_seq);
        break;
    case OP_SEQ_LEN:
        q = kvp_raw_batch_req(kvpool_Request_get_page_table_tag, q.id, &only_seq);
        break;
    case OP_LOOKUP:
        q.which_body = kvpool_Request_lookup_tag;
        kvp_wire_lookup_request_bind_encode(&q.body.lookup, &look);
        break;
    case OP_PIN:
        q.which_body = kvpool_Request_pin_tag;
        kvp_wire_pin_request_bind_encode(&q.body.pin, &b);
        ck_assert_uint_le(salt_len, sizeof(q.body.pin.salt.bytes));
        q.body.pin.salt.size = (pb_size_t)salt_len;
        memcpy(q.body.pin.salt.bytes, m->salt, salt_len);
        q.body.pin.ttl_ms = m->ttl_ms;
        break;
    case OP_UNPIN:
        q.which_body = kvpool_Request_unpin_tag;
        q.body.unpin.pin_id = m->pin_id;
        break;
    case OP_FLUSH:
        q.which_body = kvpool_Request_cache_flush_tag;
        snprintf(q.body.cache_flush.scope, sizeof(q.body.cache_flush.scope), "%s", m->scope);
        q.body.cache_flush.all = m->all != 0;
        break;
    case OP_FORK:
        q.which_body = kvpool_Request_fork_tag;
        q.body.fork.parent = m->seq;
        q.body.fork.child = m->seq2;
        break;
    case OP_TRUNCATE:
        q.which_body = kvpool_Request_truncate_tag;
        q.body.truncate.seq_id = m->seq;
        q.body.truncate.num_tokens = m->num_tokens;
        break;
    case OP_STATS:
        q.which_body = kvpool_Request_stats_tag;
        break;
    case OP_AUDIT:
        q.which_body = kvpool_Request_audit_tag;
        break;
    case OP_METRICS:
        q.which_body = kvpool_Request_metrics_tag;
        snprintf(c->needle, sizeof(c->needle), "%s", m->needle);
        break;
    default:
        ck_abort_msg("send_cmd: op %d", m->op);
    }
    kvp_raw_send(&c->w, &q, NULL, 0);
    free(ids);
}

/* Reads one answer into c->resp and the summary r. */
static void recv_res(cli_t *c, res_t *r)
{
    memset(r, 0, sizeof(*r));
    uint32_t len;
    int fds[KVP_MAX_FDS_PER_FRAME];
    unsigned nfds = 0;
    int rc = kvp_sock_recv_frame(c->w.fd, &c->w.rbuf, &c->w.rcap, &len, 1u << 26, fds,
                                 KVP_MAX_FDS_PER_FRAME, &nfds, kvp_sock_deadline(20000));
    for (unsigned i = 0; i < nfds; i++)
        close(fds[i]);
    if (rc) {
        r->code = -1;
        snprintf(r->msg, sizeof(r->msg), "no answer (connection closed or 20 s passed)");
        return;
    }
    memset(&c->resp, 0, sizeof(c->resp));
    kvp_wire_response_bind_decode(&c->resp, &c->arrays);
    ck_assert_int_eq(kvp_wire_decode(kvpool_Response_fields, &c->resp, c->w.rbuf, len, NULL), 0);
    const kvpool_Response *p = &c->resp;
    r->code = p->status.code;
    snprintf(r->msg, sizeof(r->msg), "%s", p->status.message);
    const kvp_reply_arrays_t *a = &c->arrays;
    switch (p->which_body) {
    case kvpool_Response_hello_tag: {
        const kvpool_PoolInfo *pi = &p->body.hello.pool;
        c->layers = pi->geometry.num_layers;
        c->heads = pi->heads_per_device ? pi->heads_per_device : pi->geometry.num_kv_heads;
        c->row_bytes = pi->geometry.head_dim * pi->elem_bytes;
        break;
    }
    case kvpool_Response_append_tag:
    case kvpool_Response_reserve_tag:
    case kvpool_Response_get_page_table_tag:
        r->seq_len = a->seq_lens.count ? (uint32_t)c->w.arr[4][0] : 0;
        r->npages = a->kv_indices.count;
        memcpy(r->pages, c->w.arr[1],
               (r->npages < MAX_PAGES ? r->npages : MAX_PAGES) * sizeof(int32_t));
        r->ncopies = a->copies.count / 2;
        r->cached = a->cached_tokens.count ? c->cached[0] : 0;
        break;
    case kvpool_Response_commit_tag:
        r->pages_n = p->body.commit.pages;
        r->published = p->body.commit.published;
        break;
    case kvpool_Response_lookup_tag:
        ck_assert_uint_eq(a->cached_tokens.count, 1);
        r->cached = c->cached[0];
        break;
    case kvpool_Response_pin_tag:
        r->pin_id = p->body.pin.pin_id;
        r->pages_n = p->body.pin.pinned_pages;
        break;
    case kvpool_Response_unpin_tag:
        r->pages_n = p->body.unpin.pages;
        break;
    case kvpool_Response_cache_flush_tag:
        r->pages_n = p->body.cache_flush.pages;
        break;
    case kvpool_Response_release_tag:
        r->pages_n = p->body.release.released;
        break;
    case kvpool_Response_audit_tag:
        r->audit_ok = p->body.audit.ok;
        snprintf(r->msg, sizeof(r->msg), "%s", p->body.audit.message);
        break;
    case kvpool_Response_metrics_tag:
        for (const char *t = c->text; c->needle[0] && (t = strstr(t, c->needle)); t++)
            r->hits++;
        break;
    case kvpool_Response_stats_tag: {
        const kvpool_Stats *st = &p->body.stats.stats;
        r->pins = st->cache.pins;
        r->pinned_pages = st->cache.pinned_pages;
        size_t off = (size_t)snprintf(r->names, sizeof(r->names), " ");
        for (pb_size_t i = 0; i < st->namespaces_count; i++)
            off += (size_t)snprintf(r->names + off, sizeof(r->names) - off, "%s ",
                                    st->namespaces[i].name);
        break;
    }
    default:
        break;
    }
}

/* Runs m on the connection (in this process). */
static void cli_run(cli_t *c, const cmd_t *m, res_t *r)
{
    memset(r, 0, sizeof(*r));
    switch (m->op) {
    case OP_RECV:
        recv_res(c, r);
        return;
    case OP_READY: {
        struct pollfd pfd = {.fd = c->w.fd, .events = POLLIN};
        r->ready = poll(&pfd, 1, 0) == 1;
        return;
    }
    case OP_RECONNECT:
        kvp_raw_close(&c->w);
        cli_connect(c);
        return;
    default:
        send_cmd(c, m);
        if (!m->nowait)
            recv_res(c, r);
    }
}

/* ---- peers: a connection here (root) or in a child of another uid --------------------------- */

typedef struct {
    uid_t uid;
    cli_t *c;  /* SELF: the connection, in this process */
    pid_t pid; /* otherwise the child that holds it, and its command pipes */
    int to, from;
} peer_t;

/* Descriptors a new child must not keep: the parent's connections (a session would outlive
 * its close) and the other children's pipes (a child would not see its parent go). */
static int INHERITED[256];
static int NINHERITED;

static void inherited_add(int fd)
{
    ck_assert_int_lt(NINHERITED, 256);
    INHERITED[NINHERITED++] = fd;
}

static void inherited_drop(int fd)
{
    for (int i = 0; i < NINHERITED; i++)
        if (INHERITED[i] == fd) {
            INHERITED[i] = INHERITED[--NINHERITED];
            return;
        }
}

static int io_full(int fd, void *p, size_t n, int writing)
{
    for (size_t done = 0; done < n;) {
        ssize_t k =
            writing ? write(fd, (char *)p + done, n - done) : read(fd, (char *)p + done, n - done);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        done += (size_t)k;
    }
    return 0;
}

/* The child: drops to uid, connects, says it is ready, then runs commands until OP_EXIT or
 * the end of its pipe. */
static void peer_child(uid_t uid, int from_parent, int to_parent)
{
    for (int i = 0; i < NINHERITED; i++)
        close(INHERITED[i]);
    res_t r;
    memset(&r, 0, sizeof(r));
    gid_t g = (gid_t)uid;
    if (setgroups(1, &g) || setgid(g) || setuid(uid)) {
        r.code = -2;
        snprintf(r.msg, sizeof(r.msg), "cannot become uid %u: %s", (unsigned)uid, strerror(errno));
        _exit(io_full(to_parent, &r, sizeof(r), 1) ? 1 : 0);
    }
    cli_t *c = cli_open();
    if (io_full(to_parent, &r, sizeof(r), 1))
        _exit(1);
    cmd_t m;
    while (!io_full(from_parent, &m, sizeof(m), 0) && m.op != OP_EXIT) {
        cli_run(c, &m, &r);
        if (io_full(to_parent, &r, sizeof(r), 1))
            _exit(1);
    }
    cli_close(c);
    _exit(0);
}

/* A peer connected as uid (SELF: in this process). Not yet said Hello. */
static peer_t *peer_open(uid_t uid)
{
    peer_t *p = calloc(1, sizeof(*p));
    ck_assert_ptr_nonnull(p);
    p->uid = uid;
    if (uid == SELF) {
        p->c = cli_open();
        inherited_add(p->c->w.fd);
        return p;
    }
    int down[2], up[2];
    ck_assert_int_eq(pipe(down), 0);
    ck_assert_int_eq(pipe(up), 0);
    p->pid = fork();
    ck_assert_int_ge(p->pid, 0);
    if (p->pid == 0) {
        close(down[1]);
        close(up[0]);
        peer_child(uid, down[0], up[1]);
    }
    close(down[0]);
    close(up[1]);
    p->to = down[1];
    p->from = up[0];
    inherited_add(p->to);
    inherited_add(p->from);
    res_t r;
    ck_assert_msg(io_full(p->from, &r, sizeof(r), 0) == 0, "peer of uid %u died", (unsigned)uid);
    ck_assert_msg(r.code == 0, "peer of uid %u: %s", (unsigned)uid, r.msg);
    return p;
}

static res_t run(peer_t *p, cmd_t m)
{
    res_t r;
    if (p->c) {
        if (m.op == OP_RECONNECT)
            inherited_drop(p->c->w.fd);
        cli_run(p->c, &m, &r);
        if (m.op == OP_RECONNECT)
            inherited_add(p->c->w.fd);
        return r;
    }
    ck_assert_int_eq(io_full(p->to, &m, sizeof(m), 1), 0);
    ck_assert_msg(io_full(p->from, &r, sizeof(r), 0) == 0, "peer of uid %u died (op %d)",
                  (unsigned)p->uid, m.op);
    return r;
}

/* Runs m and asserts it answered OK. */
static res_t ok(peer_t *p, cmd_t m)
{
    res_t r = run(p, m);
    ck_assert_msg(r.code == OK, "uid %u op %d: code %d, %s", (unsigned)p->uid, m.op, r.code, r.msg);
    return r;
}

/* Asserts r is a refusal with code whose message names needle (the limit it hit). */
static void expect_refused(res_t r, int code, const char *needle)
{
    ck_assert_msg(r.code == code && strstr(r.msg, needle),
                  "expected code %d naming %s, got code %d: %s", code, needle, r.code, r.msg);
}

/* Closes the peer's connection (and ends its child). */
static void peer_close(peer_t *p)
{
    if (p->c) {
        inherited_drop(p->c->w.fd);
        cli_close(p->c);
    } else {
        cmd_t m = {.op = OP_EXIT};
        ck_assert_int_eq(io_full(p->to, &m, sizeof(m), 1), 0);
        inherited_drop(p->to);
        inherited_drop(p->from);
        close(p->to);
        close(p->from);
        int st;
        ck_assert_int_eq(waitpid(p->pid, &st, 0), p->pid);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "peer of uid %u failed",
                      (unsigned)p->uid);
    }
    free(p);
}

/* A peer of uid (SELF: this process) that said Hello to ns in scope (NULL: none) with
 * lease_ms (-1: the default). */
static peer_t *hello_as(uid_t uid, const char *ns, const char *scope, long lease_ms)
{
    peer_t *p = peer_open(uid);
    cmd_t m = {.op = OP_HELLO, .has_lease = lease_ms >= 0, .lease_ms = (uint32_t)lease_ms};
    snprintf(m.ns, sizeof(m.ns), "%s", ns);
    snprintf(m.scope, sizeof(m.scope), "%s", scope ? scope : "");
    ok(p, m);
    return p;
}

/* Tokens of ids cached in p's scope (Lookup without salt). */
static uint32_t lookup(peer_t *p, int32_t first, uint32_t n)
{
    return ok(p, (cmd_t){.op = OP_LOOKUP, .ids = {{first, n}}}).cached;
}

static uint32_t lookup_salted(peer_t *p, int32_t first, uint32_t n, const void *salt,
                              uint32_t salt_len)
{
    cmd_t m = {.op = OP_LOOKUP, .ids = {{first, n}}, .salt_len = salt_len};
    memcpy(m.salt, salt, salt_len);
    return ok(p, m).cached;
}

/* ---- the daemon ----------------------------------------------------------------------------- */

static peer_t *OBS; /* observer (root): Stats, Audit, Metrics of every namespace */

/* Starts kvpoold on the shared geometry, uids 65533 and 65534 admitted, then the extra
 * arguments (NULL-terminated, may be NULL), and connects the observer. */
static void start(const char *const *more)
{
    const char *args[34] = {"--set", "access.allowed_uids=65533,65534"};
    int n = 2;
    for (int i = 0; more && more[i]; i++) {
        ck_assert_int_lt(n, 32);
        args[n++] = more[i];
    }
    args[n] = NULL;
    ck_assert_msg(kvp_daemon_start_shared(&DMN, args) == 0, "kvpoold did not start");
    NINHERITED = 0;
    OBS = peer_open(SELF);
    ok(OBS, (cmd_t){.op = OP_HELLO, .observer = 1});
}

static void audit_ok(void)
{
    res_t r = ok(OBS, (cmd_t){.op = OP_AUDIT});
    ck_assert_msg(r.audit_ok, "audit: %s", r.msg);
}

/* The audit, then SIGTERM: the daemon must exit 0. Every peer but the observer is closed. */
static void finish(void)
{
    audit_ok();
    peer_close(OBS);
    OBS = NULL;
    int code = kvp_daemon_stop(&DMN, SIGTERM);
    ck_assert_msg(code == 0, "kvpoold exited with %d", code);
}

static res_t stats(void)
{
    return ok(OBS, (cmd_t){.op = OP_STATS});
}

/* The observer's view of namespace name (NULL when it is gone). */
static const kvpool_NamespaceStats *ns_stats(const char *name)
{
    stats();
    const kvpool_Stats *st = &OBS->c->resp.body.stats.stats;
    for (pb_size_t i = 0; i < st->namespaces_count; i++)
        if (!strcmp(st->namespaces[i].name, name))
            return &st->namespaces[i];
    return NULL;
}

/* Waits until the daemon has seen every session of namespace name go (or the namespace). */
static void wait_detached(const char *name)
{
    const kvpool_NamespaceStats *n;
    uint64_t end = now_ms() + 5000;
    while ((n = ns_stats(name)) && n->sessions && now_ms() < end)
        sleep_ms(5);
    ck_assert_msg(!n || n->sessions == 0, "namespace %s still has %u sessions", name,
                  n ? n->sessions : 0);
}

/* ---- D1: a write into a keyed tail page that one sequence holds ----------------------------- */

/* Append(seq 1, ids 500..507), Fork(1 -> 2), Truncate(1, 6), Release(2): seq 1 alone holds its
 * second page, keyed and truncated into. Returns the Append's answer. */
static res_t fork_truncate_release(peer_t *p)
{
    res_t a = ok(p, (cmd_t){.op = OP_APPEND, .seq = 1, .ids = {{500, 8}}});
    ck_assert_uint_eq(a.npages, 2);
    ok(p, (cmd_t){.op = OP_FORK, .seq = 1, .seq2 = 2});
    ok(p, (cmd_t){.op = OP_TRUNCATE, .seq = 1, .num_tokens = 6});
    ck_assert_uint_eq(ok(p, (cmd_t){.op = OP_RELEASE, .seq = 2}).pages_n, 1);
    return a;
}

START_TEST(an_append_into_a_keyed_tail_page_held_once_writes_it_in_place)
{
    start(NULL);
    peer_t *p = hello_as(SELF, "d1", NULL, -1);
    res_t a = fork_truncate_release(p);
    res_t r = run(p, (cmd_t){.op = OP_APPEND, .seq = 1, .ids = {{506, 1}}});
    ck_assert_msg(r.code == OK, "the last Append: code %d %s", r.code, r.msg);
    ck_assert_uint_eq(r.seq_len, 7);
    ck_assert_uint_eq(r.ncopies, 0);
    ck_assert_uint_eq(r.npages, 2);
    ck_assert_int_eq(r.pages[0], a.pages[0]);
    ck_assert_int_eq(r.pages[1], a.pages[1]);
    audit_ok();
    ck_assert_uint_eq(ok(p, (cmd_t){.op = OP_SEQ_LEN, .seq = 1}).seq_len, 7);
    /* the first page stays cached; the second lost its key when it was written again */
    ck_assert_uint_eq(lookup(p, 500, 8), 4);
    peer_close(p);
    finish();
}
END_TEST

START_TEST(a_reserve_into_a_keyed_tail_page_held_once_copies_nothing_and_frees_nothing)
{
    start(NULL);
    peer_t *p = hello_as(SELF, "d1", NULL, -1);
    res_t a = fork_truncate_release(p);
    res_t r = run(p, (cmd_t){.op = OP_RESERVE, .seq = 1, .ids = {{506, 1}}});
    ck_assert_msg(r.code == OK, "the Reserve: code %d %s", r.code, r.msg);
    ck_assert_msg(r.ncopies == 0, "the Reserve hands the worker %u copies", r.ncopies);
    ck_assert_uint_eq(r.seq_len, 7);
    ck_assert_uint_eq(r.npages, 2);
    ck_assert_int_eq(r.pages[0], a.pages[0]);
    ck_assert_int_eq(r.pages[1], a.pages[1]);
    audit_ok();
    ck_assert_uint_eq(lookup(p, 500, 8), 4);
    /* every other page of the pool goes to another namespace, never one seq 1 holds */
    peer_t *q = hello_as(SELF, "d1-other", NULL, -1);
    res_t big = ok(q, (cmd_t){.op = OP_RESERVE, .seq = 1, .num_tokens = 62 * PS});
    ck_assert_uint_eq(big.npages, 62);
    for (uint32_t i = 0; i < big.npages; i++)
        ck_assert_msg(big.pages[i] != a.pages[0] && big.pages[i] != a.pages[1],
                      "another namespace got page %d, held by seq 1", big.pages[i]);
    audit_ok();
    peer_close(q);
    peer_close(p);
    finish();
}
END_TEST

/* ---- D2: an Append publishes what it wrote, whatever its sequence became -------------------- */

/* 16 layers x 8 heads x 128, page 16: an Append of 4,096 tokens copies 256 MiB, on one copy
 * thread (hundreds of ms on a 2-core VM: the race is wide; the test fails, never passes, when
 * it is not won). */
static const char *const BIG_POOL[] = {
    "--set", "pool.num_layers=16", "--set", "pool.num_kv_heads=8", "--set", "pool.head_dim=128",
    "--set", "pool.page_size=16",  "--set", "pool.num_pages=512",  "--set", "server.copy_threads=1",
    NULL};
#define BIG_PS     16
#define BIG_APPEND 4096
#define P_FIRST    100000
#define RACE_WAIT  5 /* ms between sending the Append and the racing calls */

/* Sends the Append of P to seq on c1 and leaves it in flight. */
static void append_in_flight(peer_t *c1, uint64_t seq)
{
    run(c1, (cmd_t){.op = OP_APPEND, .seq = seq, .ids = {{P_FIRST, BIG_APPEND}}, .nowait = 1});
    sleep_ms(RACE_WAIT);
}

/* Asserts c1's Append is still running (its answer not there), then that it answers OK. */
static void append_answers_last(peer_t *c1)
{
    ck_assert_msg(!run(c1, (cmd_t){.op = OP_READY}).ready,
                  "the Append was answered before the racing calls: no race (make it bigger)");
    res_t a = run(c1, (cmd_t){.op = OP_RECV});
    ck_assert_msg(a.code == OK, "the Append: code %d %s", a.code, a.msg);
}

START_TEST(an_append_does_not_publish_a_reserve_that_raced_it)
{
    start(BIG_POOL);
    peer_t *c1 = hello_as(SELF, "race", NULL, -1), *c2 = hello_as(SELF, "race", NULL, -1);
    append_in_flight(c1, 5);
    res_t r = ok(c2, (cmd_t){.op = OP_RESERVE, .seq = 5, .ids = {{900000, BIG_PS}}});
    ck_assert_uint_eq(r.seq_len, BIG_APPEND + BIG_PS); /* the Append was planned first */
    append_answers_last(c1);
    /* the Append's pages are findable, the Reserve's (never committed) are not */
    cmd_t both = {.op = OP_LOOKUP, .ids = {{P_FIRST, BIG_APPEND}, {900000, BIG_PS}}};
    ck_assert_uint_eq(ok(c1, both).cached, BIG_APPEND);
    ck_assert_uint_eq(lookup(c1, P_FIRST, BIG_APPEND), BIG_APPEND);
    audit_ok();
    peer_close(c2);
    peer_close(c1);
    finish();
}
END_TEST

START_TEST(an_append_to_a_sequence_released_and_reserved_again_publishes_nothing)
{
    start(BIG_POOL);
    peer_t *c1 = hello_as(SELF, "race", NULL, -1), *c2 = hello_as(SELF, "race", NULL, -1);
    append_in_flight(c1, 6);
    ck_assert_uint_eq(ok(c2, (cmd_t){.op = OP_RELEASE, .seq = 6}).pages_n, 1);
    res_t r = ok(c2, (cmd_t){.op = OP_RESERVE, .seq = 6, .ids = {{700000, 2 * BIG_PS}}});
    ck_assert_uint_eq(r.seq_len, 2 * BIG_PS);
    append_answers_last(c1);
    ck_assert_uint_eq(lookup(c1, 700000, 2 * BIG_PS), 0);  /* nobody wrote Y */
    ck_assert_uint_eq(lookup(c1, P_FIRST, BIG_APPEND), 0); /* released before it was written */
    audit_ok();
    peer_close(c2);
    peer_close(c1);
    finish();
}
END_TEST

/* ---- D3: scopes across uids ----------------------------------------------------------------- */

START_TEST(a_private_scope_name_cannot_be_claimed_by_another_uid)
{
    NEED_ROOT();
    start(NULL);
    peer_t *b = hello_as(UID_B, "b-victim", NULL, -1);
    ok(b, (cmd_t){.op = OP_APPEND, .seq = 1, .ids = {{3000, 16}}});
    ck_assert_uint_eq(lookup(b, 3000, 16), 16);
    peer_t *c = peer_open(UID_A);
    res_t r = run(c, (cmd_t){.op = OP_HELLO, .ns = "c-ns", .scope = "ns:b-victim"});
    ck_assert_msg(r.code == DENIED, "Hello(cache_scope ns:b-victim) as uid %u: code %d %s", UID_A,
                  r.code, r.msg);
    peer_close(c);
    /* and root's own namespace cannot name it either: "ns:" scopes are the namespaces' */
    peer_t *op = peer_open(SELF);
    r = run(op, (cmd_t){.op = OP_HELLO, .ns = "root-ns", .scope = "ns:b-victim"});
    ck_assert_msg(r.code != OK, "root's Hello(cache_scope ns:b-victim) accepted");
    peer_close(op);
    ck_assert_uint_eq(lookup(b, 3000, 16), 16);
    audit_ok();
    peer_close(b);
    finish();
}
END_TEST

START_TEST(a_flush_acts_on_the_callers_own_scope_only)
{
    NEED_ROOT();
    start(NULL);
    peer_t *b = hello_as(UID_B, "b-victim", NULL, -1);
    ok(b, (cmd_t){.op = OP_APPEND, .seq = 1, .ids = {{3000, 16}}});
    /* "common" is listed nowhere: each uid gets a scope of its own by that name */
    peer_t *b2 = hello_as(UID_B, "b-common", "common", -1);
    peer_t *c2 = hello_as(UID_A, "c-common", "common", -1);
    ok(b2, (cmd_t){.op = OP_APPEND, .seq = 1, .ids = {{4000, 16}}});
    ck_assert_uint_eq(lookup(b2, 4000, 16), 16);
    ck_assert_uint_eq(lookup(c2, 4000, 16), 0);
    /* B's pages are held by its sequence: release them, so a flush of B's scope would drop them */
    ok(b2, (cmd_t){.op = OP_RELEASE, .seq = 1});
    ok(b, (cmd_t){.op = OP_RELEASE, .seq = 1});
    res_t r = ok(c2, (cmd_t){.op = OP_FLUSH, .scope = "common"});
    ck_assert_msg(r.pages_n == 0, "uid %u's flush of its 'common' dropped %u pages", UID_A,
                  r.pages_n);
    ck_assert_uint_eq(lookup(b2, 4000, 16), 16);
    r = run(c2, (cmd_t){.op = OP_FLUSH, .scope = "ns:b-victim"});
    ck_assert_msg(r.code == DENIED, "flush of ns:b-victim by uid %u: code %d %s", UID_A, r.code,
                  r.msg);
    ck_assert_uint_eq(lookup(b, 3000, 16), 16);
    /* B's own flush of its scope still works */
    ck_assert_uint_eq(ok(b2, (cmd_t){.op = OP_FLUSH, .scope = "common"}).pages_n, 4);
    ck_assert_uint_eq(lookup(b2, 4000, 16), 0);
    audit_ok();
    peer_close(c2);
    peer_close(b2);
    peer_close(b);
    finish();
}
END_TEST

/* ---- D4: salts ------------------------------------------------------------------------------ */

/* salt = key (16 bytes: low 64 bits then high, little-endian) followed by int32le(ids). */
static uint32_t forged_salt(uint8_t *salt, XXH128_hash_t key, int32_t first_id)
{
    for (int i = 0; i < 8; i++) {
        salt[i] = (uint8_t)(key.low64 >> (8 * i));
        salt[8 + i] = (uint8_t)(key.high64 >> (8 * i));
    }
    for (int t = 0; t < PS; t++)
        for (int i = 0; i < 4; i++)
            salt[16 + 4 * t + i] = (uint8_t)((uint32_t)(first_id + t) >> (8 * i));
    return 16 + 4 * PS;
}

START_TEST(no_salt_continues_another_chain)
{
    start(NULL);
    peer_t *p = hello_as(SELF, "salty", NULL, -1);
    uint8_t salt[64];
    /* the unsalted chain starts from the zero key */
    ok(p, (cmd_t){.op = OP_APPEND, .seq = 1, .ids = {{7000, 12}}});
    uint32_t n = forged_salt(salt, (XXH128_hash_t){0, 0}, 7000);
    ck_assert_uint_eq(lookup_salted(p, 7004, 8, salt, n), 0);
    /* a victim salted "tenantX": its chain starts from XXH3-128 of the salt */
    cmd_t victim = {.op = OP_APPEND, .seq = 2, .ids = {{7000, 12}}, .salt_len = 7};
    memcpy(victim.salt, "tenantX", 7);
    ok(p, victim);
    n = forged_salt(salt, XXH3_128bits("tenantX", 7), 7000);
    ck_assert_uint_eq(lookup_salted(p, 7004, 8, salt, n), 0);
    /* nor can a reuse link it */
    cmd_t link = {.op = OP_RESERVE, .seq = 3, .ids = {{7004, 8}}, .reuse = 1, .salt_len = n};
    memcpy(link.salt, salt, n);
    res_t r = ok(p, link);
    ck_assert_uint_eq(r.cached, 0);
    ck_assert_uint_eq(r.seq_len, 8);
    /* the legitimate lookups still find both chains */
    ck_assert_uint_eq(lookup_salted(p, 7000, 12, "tenantX", 7), 12);
    ck_assert_uint_eq(lookup(p, 7000, 12), 12);
    audit_ok();
    peer_close(p);
    finish();
}
END_TEST

/* ---- D5: pins per namespace and per uid ----------------------------------------------------- */

/* A peer of uid in ns that cached the one-page prompt 8000..8003. */
static peer_t *with_prompt(uid_t uid, const char *ns)
{
    peer_t *p = hello_as(uid, ns, NULL, -1);
    ok(p, (cmd_t){.op = OP_APPEND, .seq = 1, .ids = {{8000, PS}}});
    return p;
}

static res_t pin(peer_t *p)
{
    return run(p, (cmd_t){.op = OP_PIN, .ids = {{8000, PS}}});
}

START_TEST(pins_are_counted_per_namespace_and_per_uid)
{
    NEED_ROOT();
    const char *more[] = {"--set", "limits.ns_max_pins=4", "--set", "limits.uid_max_pins=6",
                          "--set", "limits.max_pins=8",    NULL};
    start(more);
    peer_t *b1 = with_prompt(UID_B, "b-pins1");
    for (int i = 0; i < 4; i++)
        ck_assert_uint_eq(ok(b1, (cmd_t){.op = OP_PIN, .ids = {{8000, PS}}}).pages_n, 1);
    expect_refused(pin(b1), EXHAUSTED, "limits.ns_max_pins");
    peer_t *b2 = with_prompt(UID_B, "b-pins2");
    for (int i = 0; i < 2; i++)
        ck_assert_uint_eq(ok(b2, (cmd_t){.op = OP_PIN, .ids = {{8000, PS}}}).pages_n, 1);
    expect_refused(pin(b2), EXHAUSTED, "limits.uid_max_pins");
    peer_t *a = with_prompt(UID_A, "a-pins");
    ck_assert_uint_eq(ok(a, (cmd_t){.op = OP_PIN, .ids = {{8000, PS}}}).pages_n, 1);
    res_t st = stats();
    ck_assert_uint_eq(st.pins, 7);
    ck_assert_uint_eq(st.pinned_pages, 3);
    audit_ok();
    peer_close(a);
    peer_close(b2);
    peer_close(b1);
    finish();
}
END_TEST

START_TEST(a_namespace_keeps_64_pins_by_default)
{
    NEED_ROOT();
    /* a page in two pins counts twice against the pinned-page quota (num_pages / 8 by
     * default): 1,024 pages let 128, so the count of pins is what refuses the 65th */
    const char *more[] = {"--set", "pool.num_pages=1024", NULL};
    start(more);
    peer_t *b = with_prompt(UID_B, "b-pins");
    for (int i = 0; i < 64; i++)
        ck_assert_uint_eq(ok(b, (cmd_t){.op = OP_PIN, .ids = {{8000, PS}}}).pages_n, 1);
    expect_refused(pin(b), EXHAUSTED, "limits.ns_max_pins");
    ck_assert_uint_eq(stats().pins, 64);
    audit_ok();
    peer_close(b);
    finish();
}
END_TEST

/* ---- D6: pinned pages against the page quota, the pin quota and the idle cap ---------------- */

START_TEST(pinned_pages_count_against_the_namespace_page_quota)
{
    NEED_ROOT();
    const char *more[] = {"--set", "pool.num_pages=256", "--set", "limits.ns_max_pages=16", NULL};
    start(more);
    peer_t *c = hello_as(UID_A, "c-hog", NULL, 0);
    int refused_at = -1;
    for (int k = 0; k < 15 && refused_at < 0; k++) {
        const int32_t first = 10000 + 64 * k;
        res_t r = run(c, (cmd_t){.op = OP_RESERVE, .seq = (uint64_t)k + 1, .ids = {{first, 64}}});
        if (r.code != OK) {
            ck_assert_msg(r.code == EXHAUSTED, "Reserve %d: code %d %s", k, r.code, r.msg);
            refused_at = k;
            break;
        }
        res_t cm = ok(c, (cmd_t){.op = OP_COMMIT, .seq = (uint64_t)k + 1});
        ck_assert_uint_eq(cm.published, 16);
        ok(c, (cmd_t){.op = OP_RELEASE, .seq = (uint64_t)k + 1});
        ck_assert_uint_eq(ok(c, (cmd_t){.op = OP_PIN, .ids = {{first, 64}}}).pages_n, 16);
    }
    ck_assert_msg(refused_at == 1, "the Reserve refused was number %d (expected 1: 16 pinned)",
                  refused_at);
    res_t st = stats();
    ck_assert_uint_eq(st.pinned_pages, 16);
    ck_assert_uint_eq(st.pins, 1);
    peer_close(c); /* lease 0: the namespace stays for its pin alone */
    wait_detached("c-hog");
    /* the rest of the pool is everyone else's: 15 namespaces x 16 pages */
    peer_t *fill[16];
    for (int i = 0; i < 15; i++) {
        char ns[16];
        snprintf(ns, sizeof(ns), "fill%d", i);
        fill[i] = hello_as(SELF, ns, NULL, -1);
        ck_assert_uint_eq(ok(fill[i], (cmd_t){.op = OP_RESERVE, .seq = 1, .num_tokens = 64}).npages,
                          16);
    }
    fill[15] = hello_as(SELF, "fill15", NULL, -1);
    res_t r = run(fill[15], (cmd_t){.op = OP_RESERVE, .seq = 1, .num_tokens = PS});
    ck_assert_msg(r.code == EXHAUSTED, "a Reserve with the pool full: code %d %s", r.code, r.msg);
    audit_ok();
    for (int i = 0; i < 16; i++)
        peer_close(fill[i]);
    finish();
}
END_TEST

START_TEST(the_default_pin_quota_is_an_eighth_of_the_pool)
{
    NEED_ROOT();
    start(NULL); /* 64 pages: 8 may be pinned per namespace */
    peer_t *p = hello_as(UID_B, "pin-quota", NULL, -1);
    ok(p, (cmd_t){.op = OP_APPEND, .seq = 1, .ids = {{20000, 12 * PS}}});
    expect_refused(run(p, (cmd_t){.op = OP_PIN, .ids = {{20000, 12 * PS}}}), EXHAUSTED,
                   "limits.ns_max_pinned_pages");
    ck_assert_uint_eq(stats().pins, 0);
    ck_assert_uint_eq(ok(p, (cmd_t){.op = OP_PIN, .ids = {{20000, 8 * PS}}}).pages_n, 8);
    expect_refused(run(p, (cmd_t){.op = OP_PIN, .ids = {{20000, PS}}}), EXHAUSTED,
                   "limits.ns_max_pinned_pages");
    res_t st = stats();
    ck_assert_uint_eq(st.pins, 1);
    ck_assert_uint_eq(st.pinned_pages, 8);
    audit_ok();
    peer_close(p);
    finish();
}
END_TEST

START_TEST(a_namespace_kept_for_its_pins_counts_as_idle)
{
    NEED_ROOT();
    const char *more[] = {"--set", "limits.uid_max_idle_namespaces=2", NULL};
    start(more);
    peer_t *c = peer_open(UID_A);
    for (int i = 0; i < 4; i++) {
        cmd_t h = {.op = OP_HELLO, .has_lease = 1, .lease_ms = 0};
        snprintf(h.ns, sizeof(h.ns), "idle%d", i);
        ok(c, h);
        ok(c, (cmd_t){.op = OP_APPEND, .seq = 1, .ids = {{30000, PS}}});
        ck_assert_uint_eq(ok(c, (cmd_t){.op = OP_PIN, .ids = {{30000, PS}}}).pages_n, 1);
        run(c, (cmd_t){.op = OP_RECONNECT});
        wait_detached(h.ns);
    }
    res_t st = stats();
    int left = 0;
    for (int i = 0; i < 4; i++) {
        char name[16];
        snprintf(name, sizeof(name), " idle%d ", i);
        left += strstr(st.names, name) != NULL;
    }
    ck_assert_msg(left == 2, "%d of uid %u's pins-only namespaces left (expected 2):%s", left,
                  UID_A, st.names);
    ck_assert_msg(strstr(st.names, " idle3 "), "the last one went:%s", st.names);
    ck_assert_uint_eq(st.pins, 2);
    ck_assert_uint_eq(st.pinned_pages, 2);
    audit_ok();
    peer_close(c);
    finish();
}
END_TEST

/* ---- D7: a refused Hello changes nothing ---------------------------------------------------- */

START_TEST(a_refused_hello_leaves_the_namespace_and_its_lease_as_they_were)
{
    start(NULL);
    /* leased0 is refused a Hello with lease_ms 0, leased1 one with no lease_ms */
    const char *names[2] = {"leased0", "leased1"};
    for (int i = 0; i < 2; i++) {
        peer_t *p = hello_as(SELF, names[i], NULL, 1500);
        ok(p, (cmd_t){.op = OP_RESERVE, .seq = 1, .num_tokens = PS});
        peer_close(p);
    }
    const uint64_t closed = now_ms();
    for (int i = 0; i < 2; i++) {
        wait_detached(names[i]);
        peer_t *q = peer_open(SELF);
        cmd_t h = {.op = OP_HELLO, .scope = "other", .has_lease = i == 0, .lease_ms = 0};
        snprintf(h.ns, sizeof(h.ns), "%s", names[i]);
        res_t r = run(q, h);
        ck_assert_msg(r.code == PRECONDITION, "Hello(%s, scope other): code %d %s", names[i],
                      r.code, r.msg);
        peer_close(q);
    }
    sleep_ms(400);
    ck_assert_msg(now_ms() - closed < 1200, "too slow to test a lease of 1.5 s");
    for (int i = 0; i < 2; i++) {
        const kvpool_NamespaceStats *n = ns_stats(names[i]);
        ck_assert_msg(n, "namespace %s released early", names[i]);
        ck_assert_uint_eq(n->num_seqs, 1);
        ck_assert_uint_eq(n->sessions, 0);
        ck_assert_uint_eq(n->lease_ms, 1500);
        ck_assert_msg(n->lease_expires_in_ms > 0 && n->lease_expires_in_ms <= 1500,
                      "%s: lease expires in %llu ms", names[i],
                      (unsigned long long)n->lease_expires_in_ms);
    }
    /* the lease runs out when it would have without the refused Hellos */
    for (int i = 0; i < 2; i++) {
        while (ns_stats(names[i]) && now_ms() - closed < 3500)
            sleep_ms(20);
        ck_assert_msg(!ns_stats(names[i]), "namespace %s still there %llu ms after its close",
                      names[i], (unsigned long long)(now_ms() - closed));
    }
    finish();
}
END_TEST

/* ---- D8: publishing needs the right to write the pool --------------------------------------- */

START_TEST(a_uid_refused_the_pool_cannot_publish)
{
    NEED_ROOT();
    const char *more[] = {"--set", "access.pool_uids=65534", "--set",
                          "access.cache_scopes=team=65533,65534", NULL};
    start(more);
    peer_t *a = hello_as(UID_A, "a-team", "team", -1);
    ck_assert_uint_eq(ok(a, (cmd_t){.op = OP_RESERVE, .seq = 1, .ids = {{40000, 64}}}).npages, 16);
    res_t r = run(a, (cmd_t){.op = OP_COMMIT, .seq = 1});
    ck_assert_msg(r.code == DENIED, "uid %u's Commit: code %d %s (published %u)", UID_A, r.code,
                  r.msg, r.published);
    peer_t *b = hello_as(UID_B, "b-team", "team", -1);
    ck_assert_uint_eq(lookup(b, 40000, 64), 0);
    ck_assert_uint_eq(lookup(a, 40000, 64), 0);
    audit_ok();
    peer_close(b);
    peer_close(a);
    finish();
}
END_TEST

/* ---- M: Metrics over the socket ------------------------------------------------------------- */

static uint32_t metrics_hits(peer_t *p, const char *needle)
{
    cmd_t m = {.op = OP_METRICS};
    snprintf(m.needle, sizeof(m.needle), "%s", needle);
    return ok(p, m).hits;
}

START_TEST(metrics_over_the_socket_name_only_the_callers_namespaces)
{
    NEED_ROOT();
    start(NULL);
    peer_t *a = hello_as(UID_A, "m-33", NULL, -1), *b = hello_as(UID_B, "m-34", NULL, -1);
    ok(a, (cmd_t){.op = OP_RESERVE, .seq = 1, .num_tokens = PS});
    ok(b, (cmd_t){.op = OP_RESERVE, .seq = 1, .num_tokens = PS});
    const uint32_t root33 = metrics_hits(OBS, "m-33"), root34 = metrics_hits(OBS, "m-34");
    ck_assert_uint_gt(root33, 0);
    ck_assert_uint_gt(root34, 0);
    ck_assert_msg(metrics_hits(b, "m-33") == 0, "uid %u's Metrics names m-33 (uid %u's)", UID_B,
                  UID_A);
    ck_assert_uint_eq(metrics_hits(b, "m-34"), root34); /* its own, every sample */
    ck_assert_uint_eq(metrics_hits(a, "m-34"), 0);
    ck_assert_uint_eq(metrics_hits(a, "m-33"), root33);
    audit_ok();
    peer_close(b);
    peer_close(a);
    finish();
}
END_TEST

/* ---- P: retention priority ------------------------------------------------------------------ */

START_TEST(a_tenants_priority_is_capped_by_ns_max_priority)
{
    NEED_ROOT();
    start(NULL);
    peer_t *b = hello_as(UID_B, "prio", NULL, -1);
    expect_refused(
        run(b,
            (cmd_t){.op = OP_RESERVE, .seq = 1, .ids = {{50000, PS}}, .has_prio = 1, .prio = 51}),
        DENIED, "limits.ns_max_priority");
    expect_refused(
        run(b, (cmd_t){.op = OP_APPEND, .seq = 1, .ids = {{50000, PS}}, .has_prio = 1, .prio = 51}),
        DENIED, "limits.ns_max_priority");
    ck_assert_int_eq(run(b, (cmd_t){.op = OP_SEQ_LEN, .seq = 1}).code, NOT_FOUND); /* unchanged */
    ok(b, (cmd_t){.op = OP_RESERVE, .seq = 2, .ids = {{50100, PS}}, .has_prio = 1, .prio = 50});
    peer_t *root = hello_as(SELF, "prio-root", NULL, -1);
    ok(root, (cmd_t){.op = OP_RESERVE, .seq = 1, .ids = {{50000, PS}}, .has_prio = 1, .prio = 100});
    audit_ok();
    peer_close(root);
    peer_close(b);
    finish();
}
END_TEST

/* ---- L: the work of one Lookup -------------------------------------------------------------- */

START_TEST(a_lookup_carries_at_most_16384_pages_of_tokens_by_default)
{
    start(NULL); /* page 4: 65,536 tokens */
    peer_t *p = hello_as(SELF, "big-lookup", NULL, -1);
    ok(p, (cmd_t){.op = OP_APPEND, .seq = 1, .ids = {{1, 8}}});
    expect_refused(run(p, (cmd_t){.op = OP_LOOKUP, .ids = {{1, 65537}}}), EXHAUSTED,
                   "limits.max_lookup_tokens");
    ck_assert_uint_eq(lookup(p, 1, 65536), 8);
    expect_refused(run(p, (cmd_t){.op = OP_PIN, .ids = {{1, 65537}}}), EXHAUSTED,
                   "limits.max_lookup_tokens");
    ck_assert_uint_eq(ok(p, (cmd_t){.op = OP_PIN, .ids = {{1, 65536}}}).pages_n, 2);
    audit_ok();
    peer_close(p);
    finish();
}
END_TEST

/* ---- Q: the retry window of the cache's calls ----------------------------------------------- */

START_TEST(commit_pin_unpin_and_flush_are_deduplicated_by_request_id)
{
    start(NULL);
    peer_t *p1 = hello_as(SELF, "retry", NULL, -1), *p2 = hello_as(SELF, "retry", NULL, -1);
    ok(p1, (cmd_t){.op = OP_RESERVE, .seq = 1, .ids = {{60000, 8}}});
    /* each retry goes to the second connection and gets the first answer */
    res_t c1 = ok(p1, (cmd_t){.op = OP_COMMIT, .id = 7001, .seq = 1});
    res_t c2 = ok(p2, (cmd_t){.op = OP_COMMIT, .id = 7001, .seq = 1});
    ck_assert_uint_eq(c1.pages_n, 2);
    ck_assert_uint_eq(c2.pages_n, 2); /* a second Commit would cover 0 pages */
    ck_assert_uint_eq(c2.published, 2);
    ok(p1, (cmd_t){.op = OP_RELEASE, .seq = 1});
    res_t a = ok(p1, (cmd_t){.op = OP_PIN, .id = 7002, .ids = {{60000, 8}}});
    res_t b = ok(p2, (cmd_t){.op = OP_PIN, .id = 7002, .ids = {{60000, 8}}});
    ck_assert_uint_eq(a.pages_n, 2);
    ck_assert_uint_eq(b.pin_id, a.pin_id);
    ck_assert_uint_eq(stats().pins, 1);
    ck_assert_int_eq(run(p2, (cmd_t){.op = OP_PIN, .id = 7002, .ids = {{60000, 4}}}).code,
                     ALREADY_EXISTS);
    ck_assert_uint_eq(ok(p1, (cmd_t){.op = OP_UNPIN, .id = 7003, .pin_id = a.pin_id}).pages_n, 2);
    ck_assert_uint_eq(ok(p2, (cmd_t){.op = OP_UNPIN, .id = 7003, .pin_id = a.pin_id}).pages_n, 2);
    ck_assert_int_eq(run(p2, (cmd_t){.op = OP_UNPIN, .pin_id = a.pin_id}).code, NOT_FOUND);
    ck_assert_uint_eq(stats().pins, 0);
    ck_assert_uint_eq(ok(p1, (cmd_t){.op = OP_FLUSH, .id = 7004}).pages_n, 2);
    ck_assert_uint_eq(ok(p2, (cmd_t){.op = OP_FLUSH, .id = 7004}).pages_n, 2);
    ck_assert_uint_eq(ok(p2, (cmd_t){.op = OP_FLUSH}).pages_n, 0);
    ck_assert_uint_eq(lookup(p1, 60000, 8), 0);
    audit_ok();
    peer_close(p2);
    peer_close(p1);
    finish();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("hostile_cache");
    TCase *tc = tcase_create("hostile_cache");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, an_append_into_a_keyed_tail_page_held_once_writes_it_in_place);
    tcase_add_test(tc, a_reserve_into_a_keyed_tail_page_held_once_copies_nothing_and_frees_nothing);
    tcase_add_test(tc, an_append_does_not_publish_a_reserve_that_raced_it);
    tcase_add_test(tc, an_append_to_a_sequence_released_and_reserved_again_publishes_nothing);
    tcase_add_test(tc, a_private_scope_name_cannot_be_claimed_by_another_uid);
    tcase_add_test(tc, a_flush_acts_on_the_callers_own_scope_only);
    tcase_add_test(tc, no_salt_continues_another_chain);
    tcase_add_test(tc, pins_are_counted_per_namespace_and_per_uid);
    tcase_add_test(tc, a_namespace_keeps_64_pins_by_default);
    tcase_add_test(tc, pinned_pages_count_against_the_namespace_page_quota);
    tcase_add_test(tc, the_default_pin_quota_is_an_eighth_of_the_pool);
    tcase_add_test(tc, a_namespace_kept_for_its_pins_counts_as_idle);
    tcase_add_test(tc, a_refused_hello_leaves_the_namespace_and_its_lease_as_they_were);
    tcase_add_test(tc, a_uid_refused_the_pool_cannot_publish);
    tcase_add_test(tc, metrics_over_the_socket_name_only_the_callers_namespaces);
    tcase_add_test(tc, a_tenants_priority_is_capped_by_ns_max_priority);
    tcase_add_test(tc, a_lookup_carries_at_most_16384_pages_of_tokens_by_default);
    tcase_add_test(tc, commit_pin_unpin_and_flush_are_deduplicated_by_request_id);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
