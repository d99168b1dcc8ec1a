/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_prefix_cache.c - integration: the prefix cache (issue #16, kvpool.proto "the prefix
 * cache") on a real kvpoold (host backend) with real worker processes. Each worker is a forked
 * child that connects with libkvpool (map_pool = 1: it maps the host pool and reads and writes
 * page bytes itself) and runs the commands the test sends it over a pipe, answering each with
 * its results; the test process asserts them (exactly) and reads the daemon's counters and
 * audit through an observer connection. Two requests libkvpool cannot make go out through
 * kvp_client_call_raw: an Append with skip_tokens, and a Reserve whose token_ids count differs
 * from its tokens.
 *
 * What a worker writes: every row (token position, layer, head, K or V) of the tokens it
 * appends holds a pattern of (tag, position, layer, head, K|V), so a reader knows whose bytes
 * a page holds. Prompt p's token at position i is p * 1000 + i (prompts differ from their
 * first token; a command may switch to prompt2 from position `diverge` on).
 *
 * Geometry: 2 layers, page size 4, 2 KV heads, head_dim 16, fp16 (a row is 32 bytes); 64 pages
 * unless a test needs pressure. Statuses as libkvpool maps them (kvpool.h): RESOURCE_EXHAUSTED
 * -> KVP_ENOSPC, PERMISSION_DENIED -> KVP_EPERM, FAILED_PRECONDITION -> KVP_EPRECOND. Tests that
 * act as other users (uid 65533 / 65534) need root; those parts are skipped otherwise.
 */
#include <check.h>
#include <errno.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_harness.h"
#include "kvp_wire.h"
#include "kvpool.h"

#define L    2
#define PS   4
#define H    2
#define D    16
#define ROW  (D * 2) /* fp16 */
#define MAXP 64      /* pages of one sequence a worker reports */
#define MAXT 256     /* tokens of one command */

/* ---- the daemon ----------------------------------------------------------------------------- */

static kvp_daemon_t DMN;
static kvp_client_t *OBS;     /* observer: stats, audit */
static uint64_t EXP_Q, EXP_H; /* the query / hit tokens the daemon must have counted */
static int LIVE;              /* workers connected */

/* Starts kvpoold with the test geometry and num_pages pages, its socket open to other uids,
 * then the extra arguments (NULL-terminated, may be NULL), and connects the observer. */
static void start(unsigned num_pages, const char *const *extra)
{
    char pages[16];
    snprintf(pages, sizeof(pages), "%u", num_pages);
    const char *args[64] = {"--backend", "host", "--num-layers", "2", "--num-pages", pages,
                            "--page-size", "4", "--num-kv-heads", "2", "--head-dim", "16",
                            "--dtype", "fp16", "--set", "server.socket_mode=0666",
                            /* the pools here are tiny (pressure): pin page quotas not derived
                             * from them (num_pages / 8) unless a test sets its own */
                            "--set", "limits.ns_max_pinned_pages=4096", "--set",
                            "limits.uid_max_pinned_pages=4096"};
    int n = 20;
    for (int i = 0; extra && extra[i]; i++) {
        ck_assert_int_lt(n, 62);
        args[n++] = extra[i];
    }
    args[n] = NULL;
    ck_assert_msg(kvp_daemon_start(&DMN, args) == 0, "kvpoold did not start");
    ck_assert_int_eq(chmod(DMN.dir, 0755), 0); /* other uids reach the socket */
    kvp_client_opts_t o = {.socket_path = DMN.sock,
                           .client_name = "observer",
                           .lease_ms = KVP_LEASE_DEFAULT,
                           .timeout_ms = 10000,
                           .observer = 1};
    char err[256] = "";
    int rc = kvp_client_connect(&o, &OBS, err, sizeof(err));
    ck_assert_msg(rc == 0, "observer: %s (%s)", err, kvp_errname(rc));
    EXP_Q = EXP_H = 0;
    LIVE = 0;
}

static void stop_expect_clean(void)
{
    kvp_client_close(OBS);
    OBS = NULL;
    int code = kvp_daemon_stop(&DMN, SIGTERM);
    ck_assert_msg(code == 0, "kvpoold exited with %d", code);
}

static void audit_ok(void)
{
    int rc = kvp_client_audit(OBS);
    ck_assert_msg(rc == 0, "audit: %s", kvp_client_last_error(OBS));
}

static kvp_stats_summary_t summary(void)
{
    kvp_stats_summary_t st;
    ck_assert_int_eq(kvp_client_stats(OBS, &st), 0);
    return st;
}

static kvp_cache_stats_t cstats(void)
{
    kvp_cache_stats_t cs;
    ck_assert_int_eq(kvp_client_cache_stats(OBS, &cs), 0);
    return cs;
}

/* The cache's page counts and the query / hit tokens of every Lookup and reuse so far. */
static void expect_cache(uint32_t indexed, uint32_t cached, uint32_t pinned, uint32_t pins)
{
    kvp_cache_stats_t cs = cstats();
    ck_assert_uint_eq(cs.indexed_pages, indexed);
    ck_assert_uint_eq(cs.cached_pages, cached);
    ck_assert_uint_eq(cs.pinned_pages, pinned);
    ck_assert_uint_eq(cs.pins, pins);
    ck_assert_uint_eq(cs.query_tokens_total, EXP_Q);
    ck_assert_uint_eq(cs.hit_tokens_total, EXP_H);
}

static void expect_pages(uint32_t free_pages, uint32_t used_pages)
{
    kvp_stats_summary_t st = summary();
    ck_assert_uint_eq(st.free_pages, free_pages);
    ck_assert_uint_eq(st.used_pages, used_pages);
}

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

/* Waits until the daemon has seen every exited worker go (the observer and LIVE workers
 * remain): a closed session's sequences are released when its close is handled. */
static void settle(void)
{
    uint64_t end = now_ms() + 5000;
    kvp_stats_summary_t st = summary();
    while (st.num_clients != (uint32_t)LIVE + 1 && now_ms() < end) {
        sleep_ms(5);
        st = summary();
    }
    ck_assert_uint_eq(st.num_clients, (uint32_t)LIVE + 1);
}

/* ---- workers ---------------------------------------------------------------------------- */

enum {
    OP_EXIT = 1,
    OP_RESERVE, /* reserve (cached), write the appended rows, optionally commit */
    OP_COMMIT,  /* seq (and seq2 when not 0) */
    OP_LOOKUP,  /* one prompt, positions [0, len) */
    OP_LOOKUP2, /* two prompts of len tokens each (prompt, prompt2) */
    OP_RELEASE,
    OP_PIN,
    OP_UNPIN,
    OP_FLUSH,
    OP_CHECK,       /* page table of seq; the bytes of [0, len) against the ranges */
    OP_FORK,        /* seq -> seq2 */
    OP_TRUNCATE,    /* seq to len */
    OP_APPEND,      /* daemon-run Append (raw request: skip_tokens), bytes checked */
    OP_BAD_RESERVE, /* Reserve whose token_ids has ntok_ids entries */
    OP_RESERVE_N,   /* one Reserve of n sequences seq.. seq + n - 1, each the prompt (no writes) */
};

typedef struct {
    uint32_t end, tag; /* positions below end (and above the previous range) hold tag */
} range_t;

typedef struct {
    int op;
    uint64_t seq, seq2;
    uint32_t prompt, prompt2, diverge; /* token at position i: prompt (prompt2 from diverge) */
    uint32_t first, len;               /* the call's tokens: positions [first, first + len) */
    uint32_t salt_len;
    uint8_t salt[300];
    int ids, reuse, leave_last, has_prio, commit;
    uint32_t priority;
    uint32_t tag;   /* the pattern of the rows this call writes */
    range_t rng[4]; /* the bytes expected over the sequence (checked when nr > 0) */
    uint32_t nr;
    uint32_t ttl_ms;
    uint64_t pin_id;
    uint32_t skip;      /* OP_APPEND: skip_tokens */
    uint32_t layer_end; /* OP_APPEND: 0 every layer */
    uint32_t ntok_ids;  /* OP_BAD_RESERVE */
    char scope[72];     /* OP_FLUSH */
    int all;            /* OP_FLUSH */
    uint32_t retention_ms;
    uint32_t n; /* OP_RESERVE_N */
} cmd_t;

typedef struct {
    int rc;
    char msg[240];
    uint32_t cached, nnz, seq_len, npages, ncopies;
    int32_t aind[2];
    int32_t pages[MAXP];
    uint32_t copies[2 * MAXP];
    uint32_t commit_pages, commit_published;
    uint64_t pin_id;
    uint32_t pin_pages, pin_tokens;
    uint64_t pin_expires_ms;
    uint32_t n; /* OP_UNPIN pages, OP_FLUSH pages, OP_LOOKUP2 second answer */
    uint32_t bad_rows;
    uint32_t row_cached[9]; /* OP_RESERVE_N */
    char bad_first[120];
} res_t;

typedef struct {
    pid_t pid;
    int to, from;
} worker_t;

/* fds of the pipes of live workers: a new child closes those it inherits */
static int PIPES[64];
static int NPIPES;

static int32_t tok(const cmd_t *c, uint32_t pos)
{
    uint32_t p = c->diverge && pos >= c->diverge ? c->prompt2 : c->prompt;
    return (int32_t)(p * 1000 + pos);
}

static void pattern(uint8_t *row, uint32_t tag, uint32_t pos, uint32_t l, uint32_t h, int kv)
{
    row[0] = (uint8_t)tag;
    row[1] = (uint8_t)pos;
    row[2] = (uint8_t)(pos >> 8);
    row[3] = (uint8_t)(l << 4 | h << 1 | (uint32_t)kv);
    for (uint32_t j = 4; j < ROW; j++)
        row[j] = (uint8_t)(tag * 131 + pos * 17 + j * 7 + l * 3 + h * 5 + (uint32_t)kv);
}

static uint64_t pool_off(const kvp_pool_info_t *pi, uint32_t l, uint32_t page, int kv,
                         uint32_t slot, uint32_t h)
{
    return l * pi->layer_bytes + (kv ? pi->v_offset_bytes : 0) +
           ((uint64_t)page * (uint64_t)pi->stride_page + (uint64_t)slot * (uint64_t)pi->stride_n +
            (uint64_t)h * (uint64_t)pi->stride_h) *
               pi->elem_bytes;
}

typedef struct {
    kvp_client_t *c;
    const kvp_pool_info_t *pi;
    uint8_t *pool;
    void *stage; /* OP_APPEND's staging buffer (allocated on first use) */
    uint32_t buf_id;
} wctx_t;

#define STAGE_BYTES ((size_t)L * 2 * MAXT * H * ROW)

static void write_rows(wctx_t *w, const int32_t *pages, uint32_t from, uint32_t to, uint32_t tag)
{
    for (uint32_t pos = from; pos < to; pos++)
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t h = 0; h < H; h++)
                for (int kv = 0; kv < 2; kv++)
                    pattern(w->pool +
                                pool_off(w->pi, l, (uint32_t)pages[pos / PS], kv, pos % PS, h),
                            tag, pos, l, h, kv);
}

/* Rows of [0, len) that differ from the ranges' patterns (the first one named in r). */
static void check_rows(wctx_t *w, const int32_t *pages, uint32_t len, const cmd_t *c, res_t *r)
{
    r->bad_rows = 0;
    for (uint32_t pos = 0; pos < len; pos++) {
        uint32_t k = 0;
        while (k + 1 < c->nr && pos >= c->rng[k].end)
            k++;
        uint32_t tag = c->rng[k].tag;
        for (uint32_t l = 0; l < L; l++)
            for (uint32_t h = 0; h < H; h++)
                for (int kv = 0; kv < 2; kv++) {
                    uint8_t want[ROW];
                    pattern(want, tag, pos, l, h, kv);
                    const uint8_t *got =
                        w->pool + pool_off(w->pi, l, (uint32_t)pages[pos / PS], kv, pos % PS, h);
                    if (memcmp(got, want, ROW)) {
                        if (!r->bad_rows++)
                            snprintf(r->bad_first, sizeof(r->bad_first),
                                     "pos %u layer %u head %u %s: tag %u pos %u, want tag %u", pos,
                                     l, h, kv ? "V" : "K", got[0], got[1] | got[2] << 8, tag);
                    }
                }
    }
}

static void copy_page(wctx_t *w, uint32_t src, uint32_t dst)
{
    for (uint32_t l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++)
            for (uint32_t s = 0; s < PS; s++)
                for (uint32_t h = 0; h < H; h++)
                    memcpy(w->pool + pool_off(w->pi, l, dst, kv, s, h),
                           w->pool + pool_off(w->pi, l, src, kv, s, h), ROW);
}

typedef struct {
    int32_t indptr[2], indices[MAXP], last[1], aind[2], lens[1];
    uint32_t copies[2 * MAXP], cached[1];
    kvp_page_table_t t;
} wtable_t;

static kvp_page_table_t *wtable(wtable_t *tb)
{
    memset(tb, 0, sizeof(*tb));
    tb->t = (kvp_page_table_t){.kv_indptr = tb->indptr,
                               .kv_indices = tb->indices,
                               .kv_last_page_len = tb->last,
                               .append_indptr = tb->aind,
                               .seq_lens = tb->lens,
                               .copies = tb->copies,
                               .cap_batch = 2,
                               .cap_indices = MAXP,
                               .cap_copies = MAXP,
                               .cached_tokens = tb->cached};
    return &tb->t;
}

static void take_table(res_t *r, const wtable_t *tb)
{
    r->npages = (uint32_t)(tb->indptr[1] - tb->indptr[0]);
    memcpy(r->pages, tb->indices, r->npages * sizeof(int32_t));
    r->aind[0] = tb->aind[0];
    r->aind[1] = tb->aind[1];
    r->seq_len = (uint32_t)tb->lens[0];
    r->nnz = tb->t.nnz;
    r->cached = tb->cached[0];
    r->ncopies = tb->t.num_copies;
    memcpy(r->copies, tb->copies, 2 * r->ncopies * sizeof(uint32_t));
}

static void w_reserve(wctx_t *w, const cmd_t *c, res_t *r)
{
    int32_t tokens[MAXT];
    for (uint32_t i = 0; i < c->len; i++)
        tokens[i] = tok(c, c->first + i);
    kvp_cache_opts_t co = {.token_ids = c->ids ? tokens : NULL,
                           .salts = c->salt_len ? c->salt : NULL,
                           .salt_lens = c->salt_len ? &c->salt_len : NULL,
                           .reuse = c->reuse,
                           .leave_last = c->leave_last,
                           .priority = c->has_prio ? (int)c->priority : -1,
                           .retention_ms = c->retention_ms};
    int plain = !c->ids && !c->reuse && !c->has_prio;
    wtable_t tb;
    r->rc = plain ? kvp_client_reserve(w->c, &c->seq, &c->len, 1, wtable(&tb))
                  : kvp_client_reserve_cached(w->c, &c->seq, &c->len, 1, &co, wtable(&tb));
    if (r->rc)
        return;
    take_table(r, &tb);
    for (uint32_t k = 0; k < r->ncopies; k++) /* copy-on-write first (kvpool.proto PageTable) */
        copy_page(w, r->copies[2 * k], r->copies[2 * k + 1]);
    uint32_t add = (uint32_t)(tb.aind[1] - tb.aind[0]);
    write_rows(w, tb.indices, r->seq_len - add, r->seq_len, c->tag);
    if (c->nr)
        check_rows(w, tb.indices, r->seq_len, c, r);
    if (c->commit)
        r->rc = kvp_client_commit(w->c, &c->seq, 1, NULL, &r->commit_pages, &r->commit_published);
}

/* The daemon-run Append as a raw request (libkvpool has no skip_tokens): the staging buffer
 * holds the rows of positions [skip, len), per layer K [rows, H, D] then V. */
static void w_append(wctx_t *w, const cmd_t *c, res_t *r)
{
    if (!w->stage &&
        (r->rc = kvp_client_alloc_host_buffer(w->c, STAGE_BYTES, &w->stage, &w->buf_id)))
        return;
    const uint32_t rows = c->len - (c->skip < c->len ? c->skip : c->len);
    const uint32_t lrows = rows ? rows : 1;
    uint8_t *st = w->stage;
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t t = 0; t < rows; t++)
            for (uint32_t h = 0; h < H; h++)
                for (int kv = 0; kv < 2; kv++)
                    pattern(st + (size_t)l * 2 * lrows * H * ROW + (size_t)kv * lrows * H * ROW +
                                (size_t)t * H * ROW + (size_t)h * ROW,
                            c->tag, c->skip + t, l, h, kv);
    int32_t tokens[MAXT];
    for (uint32_t i = 0; i < c->len; i++)
        tokens[i] = tok(c, i);
    uint64_t seq = c->seq;
    uint32_t len = c->len, slen = c->salt_len;
    kvp_batch_arrays_t b = {.seq_ids = kvp_array(&seq, 8, 1, 1),
                            .num_tokens = kvp_array(&len, 4, 1, 1),
                            .token_ids = kvp_array(tokens, 4, c->ids ? len : 0, len),
                            .salts = kvp_array((void *)c->salt, 1, slen, slen),
                            .salt_lens = kvp_array(&slen, 4, slen ? 1 : 0, 1)};
    kvpool_Request *q = calloc(1, sizeof(*q));
    kvpool_Response *resp = calloc(1, sizeof(*resp));
    if (!q || !resp) {
        free(q);
        free(resp);
        r->rc = KVP_ENOMEM;
        return;
    }
    q->which_body = kvpool_Request_append_tag;
    kvpool_AppendRequest *a = &q->body.append;
    a->has_batch = true;
    kvp_wire_batch_bind_encode(&a->batch, &b);
    a->has_source = true;
    a->source.buffer_id = w->buf_id;
    a->source.k_offset = 0;
    a->source.v_offset = (uint64_t)lrows * H * ROW;
    a->source.k_stride_n = a->source.v_stride_n = H * ROW;
    a->source.k_stride_h = a->source.v_stride_h = ROW;
    a->source.layer_stride = 2ull * lrows * H * ROW;
    a->source.layer_begin = 0;
    a->source.layer_end = c->layer_end;
    a->has_cache = c->reuse || c->leave_last;
    a->cache.reuse = c->reuse;
    a->cache.leave_last = c->leave_last;
    a->skip_tokens = c->skip;
    wtable_t tb;
    wtable(&tb);
    kvp_reply_arrays_t ra = {
        .kv_indptr = kvp_array(tb.indptr, 4, 0, 2),
        .kv_indices = kvp_array(tb.indices, 4, 0, MAXP),
        .kv_last_page_len = kvp_array(tb.last, 4, 0, 1),
        .append_indptr = kvp_array(tb.aind, 4, 0, 2),
        .seq_lens = kvp_array(tb.lens, 4, 0, 1),
        .copies = kvp_array(tb.copies, 8, 0, MAXP),
        .cached_tokens = kvp_array(tb.cached, 4, 0, 1),
    };
    r->rc = kvp_client_call_raw(w->c, q, resp, &ra);
    if (!r->rc) {
        tb.t.nnz = resp->body.append.table.nnz;
        tb.t.num_copies = ra.copies.count;
        if (!ra.cached_tokens.count)
            tb.cached[0] = 0;
        take_table(r, &tb);
        if (c->nr)
            check_rows(w, tb.indices, r->seq_len, c, r);
    }
    free(q);
    free(resp);
}

static void w_bad_reserve(wctx_t *w, const cmd_t *c, res_t *r)
{
    int32_t tokens[MAXT];
    for (uint32_t i = 0; i < c->ntok_ids; i++)
        tokens[i] = tok(c, i);
    uint64_t seq = c->seq;
    uint32_t len = c->len;
    kvp_batch_arrays_t b = {.seq_ids = kvp_array(&seq, 8, 1, 1),
                            .num_tokens = kvp_array(&len, 4, 1, 1),
                            .token_ids = kvp_array(tokens, 4, c->ntok_ids, c->ntok_ids)};
    kvpool_Request *q = calloc(1, sizeof(*q));
    kvpool_Response *resp = calloc(1, sizeof(*resp));
    if (!q || !resp) {
        free(q);
        free(resp);
        r->rc = KVP_ENOMEM;
        return;
    }
    q->which_body = kvpool_Request_reserve_tag;
    q->body.reserve.has_batch = true;
    kvp_wire_batch_bind_encode(&q->body.reserve.batch, &b);
    q->body.reserve.has_cache = true;
    q->body.reserve.cache.reuse = true;
    r->rc = kvp_client_call_raw(w->c, q, resp, NULL);
    free(q);
    free(resp);
}

static void w_reserve_n(wctx_t *w, const cmd_t *c, res_t *r)
{
    int32_t tokens[8 * 32];
    uint64_t ids[8];
    uint32_t lens[8];
    if (c->n > 8 || c->len > 32) {
        r->rc = KVP_EINVAL;
        return;
    }
    for (uint32_t k = 0; k < c->n; k++) {
        ids[k] = c->seq + k;
        lens[k] = c->len;
        for (uint32_t i = 0; i < c->len; i++)
            tokens[k * c->len + i] = tok(c, i);
    }
    kvp_cache_opts_t co = {.token_ids = tokens, .reuse = c->reuse, .priority = -1};
    int32_t indptr[9], indices[MAXP], last[8], aind[9], sl[8];
    uint32_t copies[2 * MAXP];
    kvp_page_table_t t = {.kv_indptr = indptr,
                          .kv_indices = indices,
                          .kv_last_page_len = last,
                          .append_indptr = aind,
                          .seq_lens = sl,
                          .copies = copies,
                          .cap_batch = 9,
                          .cap_indices = MAXP,
                          .cap_copies = MAXP,
                          .cached_tokens = r->row_cached};
    r->rc = kvp_client_reserve_cached(w->c, ids, lens, c->n, &co, &t);
    if (!r->rc) {
        r->nnz = t.nnz;
        r->npages = t.num_indices;
    }
}

static void w_run(wctx_t *w, const cmd_t *c, res_t *r)
{
    memset(r, 0, sizeof(*r));
    int32_t tokens[2 * MAXT];
    switch (c->op) {
    case OP_RESERVE:
        w_reserve(w, c, r);
        break;
    case OP_COMMIT: {
        uint64_t ids[2] = {c->seq, c->seq2};
        r->rc = kvp_client_commit(w->c, ids, c->seq2 ? 2 : 1, NULL, &r->commit_pages,
                                  &r->commit_published);
        break;
    }
    case OP_LOOKUP:
    case OP_LOOKUP2: {
        cmd_t second = *c;
        second.prompt = c->prompt2;
        second.diverge = 0;
        for (uint32_t i = 0; i < c->len; i++) {
            tokens[i] = tok(c, i);
            tokens[c->len + i] = tok(&second, i);
        }
        uint32_t lens[2] = {c->len, c->len}, out[2] = {0, 0};
        uint32_t slens[2] = {c->salt_len, c->salt_len};
        uint8_t salts[600];
        memcpy(salts, c->salt, c->salt_len);
        memcpy(salts + c->salt_len, c->salt, c->salt_len);
        r->rc = kvp_client_lookup(w->c, tokens, lens, c->op == OP_LOOKUP2 ? 2 : 1,
                                  c->salt_len ? salts : NULL, c->salt_len ? slens : NULL, out);
        r->cached = out[0];
        r->n = out[1];
        break;
    }
    case OP_RELEASE: {
        uint32_t rel = 0;
        r->rc = kvp_client_release(w->c, &c->seq, 1, &rel);
        r->n = rel;
        break;
    }
    case OP_PIN: {
        for (uint32_t i = 0; i < c->len; i++)
            tokens[i] = tok(c, i);
        kvp_pin_t p = {0};
        r->rc = kvp_client_pin(w->c, tokens, c->len, c->salt_len ? c->salt : NULL, c->salt_len,
                               c->ttl_ms, &p);
        r->pin_id = p.pin_id;
        r->pin_pages = p.pinned_pages;
        r->pin_tokens = p.pinned_tokens;
        r->pin_expires_ms = p.expires_in_ms;
        break;
    }
    case OP_UNPIN:
        r->rc = kvp_client_unpin(w->c, c->pin_id, &r->n);
        break;
    case OP_FLUSH:
        r->rc = kvp_client_cache_flush(w->c, c->scope[0] ? c->scope : NULL, c->all, &r->n);
        break;
    case OP_CHECK: {
        wtable_t tb;
        r->rc = kvp_client_page_table(w->c, &c->seq, 1, wtable(&tb));
        if (r->rc)
            break;
        take_table(r, &tb);
        if (c->nr)
            check_rows(w, tb.indices, c->len, c, r);
        break;
    }
    case OP_FORK:
        r->rc = kvp_client_fork(w->c, c->seq, c->seq2);
        break;
    case OP_TRUNCATE:
        r->rc = kvp_client_truncate(w->c, c->seq, c->len);
        break;
    case OP_APPEND:
        w_append(w, c, r);
        break;
    case OP_RESERVE_N:
        w_reserve_n(w, c, r);
        break;
    case OP_BAD_RESERVE:
        w_bad_reserve(w, c, r);
        break;
    default:
        r->rc = KVP_EINVAL;
    }
    if (r->rc)
        snprintf(r->msg, sizeof(r->msg), "%s", kvp_client_last_error(w->c));
}

static int write_all(int fd, const void *p, size_t n)
{
    const char *b = p;
    while (n) {
        ssize_t k = write(fd, b, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

static int read_all(int fd, void *p, size_t n)
{
    char *b = p;
    while (n) {
        ssize_t k = read(fd, b, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

/* The child: become uid (when not 0), connect, report, then serve commands until OP_EXIT or
 * the test's end of the pipe. */
static void worker_main(int in, int out, uid_t uid, const char *ns, const char *scope,
                        uint32_t lease_ms)
{
    res_t r;
    memset(&r, 0, sizeof(r));
    if (uid) {
        gid_t g = (gid_t)uid;
        if (setgroups(1, &g) || setgid(g) || setuid(uid)) {
            r.rc = -9999;
            snprintf(r.msg, sizeof(r.msg), "cannot become uid %u", (unsigned)uid);
            _exit(write_all(out, &r, sizeof(r)) ? 3 : 2);
        }
    }
    kvp_client_opts_t o = {.socket_path = DMN.sock,
                           .ns = ns,
                           .client_name = "pcache-worker",
                           .lease_ms = lease_ms,
                           .timeout_ms = 10000,
                           .map_pool = 1,
                           .cache_scope = scope};
    wctx_t w = {0};
    r.rc = kvp_client_connect(&o, &w.c, r.msg, sizeof(r.msg));
    if (write_all(out, &r, sizeof(r)) || r.rc)
        _exit(r.rc ? 0 : 3);
    w.pi = kvp_client_pool_info(w.c);
    w.pool = kvp_client_pool_base(w.c, 0);
    if (!w.pool)
        _exit(4);
    cmd_t c;
    while (read_all(in, &c, sizeof(c)) == 0 && c.op != OP_EXIT) {
        w_run(&w, &c, &r);
        if (write_all(out, &r, sizeof(r)))
            _exit(5);
    }
    kvp_client_close(w.c);
    _exit(0);
}

/* Forks a worker as uid (0: this one) in ns / scope; *rc and msg (240 bytes) receive its
 * connect status. A worker whose connect failed has exited. */
static worker_t spawn_as(uid_t uid, const char *ns, const char *scope, uint32_t lease_ms, int *rc,
                         char *msg)
{
    int down[2], up[2];
    ck_assert_int_eq(pipe(down), 0);
    ck_assert_int_eq(pipe(up), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        for (int i = 0; i < NPIPES; i++)
            close(PIPES[i]);
        close(down[1]);
        close(up[0]);
        worker_main(down[0], up[1], uid, ns, scope, lease_ms);
    }
    close(down[0]);
    close(up[1]);
    worker_t w = {pid, down[1], up[0]};
    res_t r;
    ck_assert_msg(read_all(w.from, &r, sizeof(r)) == 0, "worker %s died before connecting", ns);
    ck_assert_msg(r.rc != -9999, "%s", r.msg);
    *rc = r.rc;
    snprintf(msg, 240, "%s", r.msg);
    if (r.rc) {
        int st;
        close(w.to);
        close(w.from);
        ck_assert_int_eq(waitpid(pid, &st, 0), pid);
        w.pid = -1;
        return w;
    }
    ck_assert_int_lt(NPIPES, 62);
    PIPES[NPIPES++] = w.to;
    PIPES[NPIPES++] = w.from;
    LIVE++;
    return w;
}

static worker_t spawn(const char *ns, const char *scope, uint32_t lease_ms)
{
    int rc;
    char msg[240];
    worker_t w = spawn_as(0, ns, scope, lease_ms, &rc, msg);
    ck_assert_msg(rc == 0, "worker %s: %s (%s)", ns, msg, kvp_errname(rc));
    return w;
}

static void forget_pipes(const worker_t *w)
{
    for (int i = 0; i < NPIPES; i++)
        if (PIPES[i] == w->to || PIPES[i] == w->from)
            PIPES[i--] = PIPES[--NPIPES];
    close(w->to);
    close(w->from);
}

static res_t call(const worker_t *w, cmd_t c)
{
    res_t r;
    ck_assert_int_eq(write_all(w->to, &c, sizeof(c)), 0);
    ck_assert_msg(read_all(w->from, &r, sizeof(r)) == 0, "worker %d died (op %d)", (int)w->pid,
                  c.op);
    return r;
}

/* A command that must succeed; its Lookup or reuse is added to the expected counters. */
static res_t ok(const worker_t *w, cmd_t c)
{
    res_t r = call(w, c);
    ck_assert_msg(r.rc == 0, "op %d seq %llu: %s (%s)", c.op, (unsigned long long)c.seq, r.msg,
                  kvp_errname(r.rc));
    ck_assert_msg(r.bad_rows == 0, "op %d seq %llu: %u rows differ, first %s", c.op,
                  (unsigned long long)c.seq, r.bad_rows, r.bad_first);
    if (c.op == OP_LOOKUP || c.op == OP_LOOKUP2) {
        EXP_Q += c.len * (c.op == OP_LOOKUP2 ? 2u : 1u);
        EXP_H += r.cached + (c.op == OP_LOOKUP2 ? r.n : 0u);
    } else if ((c.op == OP_RESERVE || c.op == OP_APPEND) && c.reuse && c.ids) {
        EXP_Q += c.len;
        EXP_H += r.cached;
    } else if (c.op == OP_RESERVE_N && c.reuse) {
        for (uint32_t k = 0; k < c.n; k++) {
            EXP_Q += c.len;
            EXP_H += r.row_cached[k];
        }
    }
    return r;
}

/* A command that must fail with code, its message containing what. */
static res_t fails(const worker_t *w, cmd_t c, int code, const char *what)
{
    res_t r = call(w, c);
    ck_assert_msg(r.rc == code, "op %d seq %llu: %s (%s), expected %s", c.op,
                  (unsigned long long)c.seq, r.msg, kvp_errname(r.rc), kvp_errname(code));
    ck_assert_msg(!what || strstr(r.msg, what), "op %d: message '%s' lacks '%s'", c.op, r.msg,
                  what);
    return r;
}

static uint32_t lookup(const worker_t *w, uint32_t prompt, uint32_t len)
{
    return ok(w, (cmd_t){.op = OP_LOOKUP, .prompt = prompt, .len = len}).cached;
}

static uint32_t lookup_salt(const worker_t *w, uint32_t prompt, uint32_t len, const char *salt)
{
    cmd_t c = {.op = OP_LOOKUP, .prompt = prompt, .len = len};
    c.salt_len = (uint32_t)strlen(salt);
    memcpy(c.salt, salt, c.salt_len);
    return ok(w, c).cached;
}

/* Reserve seq for prompt[0..len) with token ids, write its rows (tag), commit. */
static res_t put(const worker_t *w, uint64_t seq, uint32_t prompt, uint32_t len, uint32_t tag)
{
    res_t r = ok(w, (cmd_t){.op = OP_RESERVE,
                            .seq = seq,
                            .prompt = prompt,
                            .len = len,
                            .ids = 1,
                            .tag = tag,
                            .commit = 1});
    ck_assert_uint_eq(r.commit_pages, len / PS);
    return r;
}

/* Reserve of len tokens without token ids (pressure). */
static res_t plain(const worker_t *w, uint64_t seq, uint32_t len)
{
    return call(w, (cmd_t){.op = OP_RESERVE, .seq = seq, .len = len, .tag = 99});
}

static void release(const worker_t *w, uint64_t seq)
{
    res_t r = ok(w, (cmd_t){.op = OP_RELEASE, .seq = seq});
    ck_assert_uint_eq(r.n, 1);
}

static void finish(worker_t *w)
{
    cmd_t c = {.op = OP_EXIT};
    ck_assert_int_eq(write_all(w->to, &c, sizeof(c)), 0);
    int st;
    ck_assert_int_eq(waitpid(w->pid, &st, 0), w->pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "worker %d exited with %d", (int)w->pid,
                  st);
    forget_pipes(w);
    LIVE--;
    w->pid = -1;
}

static void kill_worker(worker_t *w)
{
    ck_assert_int_eq(kill(w->pid, SIGKILL), 0);
    int st;
    ck_assert_int_eq(waitpid(w->pid, &st, 0), w->pid);
    forget_pipes(w);
    LIVE--;
    w->pid = -1;
}

#define HAVE_ROOT() (geteuid() == 0)

/* ---- 1. reuse across processes ------------------------------------------------------------ */

START_TEST(a_second_worker_reuses_the_first_workers_pages_and_reads_its_bytes)
{
    start(64, NULL);
    expect_cache(0, 0, 0, 0);
    worker_t a = spawn("eng", NULL, 0);
    /* A: a prompt of 10 tokens, reuse on an empty cache: nothing found, 2 full pages keyed */
    res_t ra = ok(&a, (cmd_t){.op = OP_RESERVE,
                              .seq = 1,
                              .prompt = 1,
                              .len = 10,
                              .ids = 1,
                              .reuse = 1,
                              .tag = 1,
                              .commit = 1});
    ck_assert_uint_eq(ra.cached, 0);
    ck_assert_uint_eq(ra.nnz, 10);
    ck_assert_int_eq(ra.aind[1] - ra.aind[0], 10);
    ck_assert_uint_eq(ra.npages, 3);
    ck_assert_uint_eq(ra.commit_pages, 2);
    ck_assert_uint_eq(ra.commit_published, 2);
    expect_cache(2, 0, 0, 0);
    finish(&a); /* lease 0: its sequence is released, the 2 full pages stay cached */
    settle();
    expect_cache(2, 2, 0, 0);
    kvp_stats_summary_t st = summary();
    ck_assert_uint_eq(st.num_seqs, 0);
    ck_assert_uint_eq(st.free_pages, 62);
    ck_assert_uint_eq(st.used_pages, 0);
    audit_ok();

    worker_t b = spawn("eng", NULL, 0);
    ck_assert_uint_eq(lookup(&b, 1, 10), 8);
    ck_assert_uint_eq(lookup(&b, 1, 7), 4);
    ck_assert_uint_eq(lookup(&b, 1, 3), 0);
    /* the same first page, then another prompt */
    res_t lk = ok(&b, (cmd_t){.op = OP_LOOKUP, .prompt = 1, .prompt2 = 9, .diverge = 4, .len = 10});
    ck_assert_uint_eq(lk.cached, 4);
    expect_cache(2, 2, 0, 0); /* a Lookup changes no page */
    /* B: the same prompt with reuse links A's two pages and appends only the last 2 tokens */
    res_t rb = ok(&b, (cmd_t){.op = OP_RESERVE,
                              .seq = 7,
                              .prompt = 1,
                              .len = 10,
                              .ids = 1,
                              .reuse = 1,
                              .tag = 2,
                              .rng = {{8, 1}, {10, 2}},
                              .nr = 2,
                              .commit = 1});
    ck_assert_uint_eq(rb.cached, 8);
    ck_assert_uint_eq(rb.nnz, 2);
    ck_assert_int_eq(rb.aind[0], 0);
    ck_assert_int_eq(rb.aind[1], 2);
    ck_assert_uint_eq(rb.seq_len, 10);
    ck_assert_uint_eq(rb.npages, 3);
    ck_assert_int_eq(rb.pages[0], ra.pages[0]);
    ck_assert_int_eq(rb.pages[1], ra.pages[1]);
    ck_assert_int_ne(rb.pages[2], ra.pages[0]);
    ck_assert_int_ne(rb.pages[2], ra.pages[1]);
    ck_assert_uint_eq(rb.ncopies, 0);
    ck_assert_uint_eq(rb.commit_pages, 0); /* no new full page */
    expect_cache(2, 0, 0, 0);              /* B holds them now */
    expect_pages(61, 3);
    /* a 12-token prompt: the third page (tokens 8..11) is new, written by B and committed */
    res_t r8 = ok(&b, (cmd_t){.op = OP_RESERVE,
                              .seq = 8,
                              .prompt = 1,
                              .len = 12,
                              .ids = 1,
                              .reuse = 1,
                              .tag = 3,
                              .rng = {{8, 1}, {12, 3}},
                              .nr = 2,
                              .commit = 1});
    ck_assert_uint_eq(r8.cached, 8);
    ck_assert_uint_eq(r8.nnz, 4);
    ck_assert_uint_eq(r8.commit_pages, 1);
    ck_assert_uint_eq(r8.commit_published, 1);
    ck_assert_uint_eq(lookup(&b, 1, 12), 12);
    ck_assert_uint_eq(lookup(&b, 1, 13), 12);
    expect_cache(3, 0, 0, 0);

    /* C, a third process: a fully cached prompt with leave_last links 2 of its 3 pages, without
     * it all 3 (nothing to append) */
    worker_t c = spawn("eng", NULL, 0);
    res_t rc1 = ok(&c, (cmd_t){.op = OP_RESERVE,
                               .seq = 20,
                               .prompt = 1,
                               .len = 12,
                               .ids = 1,
                               .reuse = 1,
                               .leave_last = 1,
                               .tag = 4,
                               .rng = {{8, 1}, {12, 4}},
                               .nr = 2});
    ck_assert_uint_eq(rc1.cached, 8);
    ck_assert_uint_eq(rc1.nnz, 4);
    ck_assert_int_ne(rc1.pages[2], r8.pages[2]);
    res_t rc2 = ok(&c, (cmd_t){.op = OP_RESERVE,
                               .seq = 21,
                               .prompt = 1,
                               .len = 12,
                               .ids = 1,
                               .reuse = 1,
                               .tag = 5,
                               .rng = {{8, 1}, {12, 3}},
                               .nr = 2});
    ck_assert_uint_eq(rc2.cached, 12);
    ck_assert_uint_eq(rc2.nnz, 0);
    ck_assert_int_eq(rc2.aind[1], 0);
    ck_assert_uint_eq(rc2.npages, 3);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(rc2.pages[i], r8.pages[i]);
    expect_cache(3, 0, 0, 0);
    audit_ok();
    finish(&c);
    finish(&b);
    settle();
    /* every indexed page is cached now; partial and duplicate pages went back to the free stack */
    expect_cache(3, 3, 0, 0);
    expect_pages(61, 0);
    audit_ok();
    stop_expect_clean();
}
END_TEST

/* ---- 2. visibility, salts, scopes --------------------------------------------------------- */

START_TEST(pages_are_findable_only_after_commit_and_only_in_their_scope_and_salt)
{
    const char *more[] = {"--set", "access.allowed_uids=65534", NULL};
    start(64, more);
    worker_t a = spawn("vis", NULL, 0);
    worker_t b = spawn("vis", NULL, 0); /* a second session of the same namespace */
    res_t ra =
        ok(&a, (cmd_t){.op = OP_RESERVE, .seq = 1, .prompt = 1, .len = 8, .ids = 1, .tag = 1});
    ck_assert_uint_eq(ra.nnz, 8);
    /* written, not committed: nobody finds it */
    ck_assert_uint_eq(lookup(&b, 1, 8), 0);
    res_t rb = ok(
        &b,
        (cmd_t){.op = OP_RESERVE, .seq = 2, .prompt = 1, .len = 8, .ids = 1, .reuse = 1, .tag = 2});
    ck_assert_uint_eq(rb.cached, 0);
    ck_assert_uint_eq(rb.nnz, 8);
    expect_cache(0, 0, 0, 0);
    res_t cm = ok(&a, (cmd_t){.op = OP_COMMIT, .seq = 1});
    ck_assert_uint_eq(cm.commit_pages, 2);
    ck_assert_uint_eq(cm.commit_published, 2);
    ck_assert_uint_eq(lookup(&b, 1, 8), 8);
    /* B's copy of the same content stays private; a second Commit covers nothing */
    cm = ok(&b, (cmd_t){.op = OP_COMMIT, .seq = 2});
    ck_assert_uint_eq(cm.commit_pages, 2);
    ck_assert_uint_eq(cm.commit_published, 0);
    cm = ok(&a, (cmd_t){.op = OP_COMMIT, .seq = 1});
    ck_assert_uint_eq(cm.commit_pages, 0);
    ck_assert_uint_eq(cm.commit_published, 0);
    expect_cache(2, 0, 0, 0);

    /* salts: pages of different salts never match */
    ck_assert_uint_eq(lookup_salt(&b, 1, 8, "adapter-1"), 0);
    cmd_t salted = {
        .op = OP_RESERVE, .seq = 3, .prompt = 2, .len = 8, .ids = 1, .tag = 3, .commit = 1};
    salted.salt_len = 9;
    memcpy(salted.salt, "adapter-1", 9);
    res_t rs = ok(&a, salted);
    ck_assert_uint_eq(rs.commit_published, 2);
    ck_assert_uint_eq(lookup_salt(&b, 2, 8, "adapter-1"), 8);
    ck_assert_uint_eq(lookup_salt(&b, 2, 8, "adapter-2"), 0);
    ck_assert_uint_eq(lookup(&b, 2, 8), 0);
    salted.seq = 4;
    salted.reuse = 1;
    salted.tag = 4;
    salted.commit = 0;
    salted.rng[0] = (range_t){8, 3};
    salted.nr = 1;
    rs = ok(&b, salted);
    ck_assert_uint_eq(rs.cached, 8);
    ck_assert_int_eq(rs.pages[0], ok(&a, (cmd_t){.op = OP_CHECK, .seq = 3}).pages[0]);

    /* another namespace of the same uid without a scope: private */
    worker_t c = spawn("vis-2", NULL, 0);
    ck_assert_uint_eq(lookup(&c, 1, 8), 0);
    res_t rc = ok(
        &c,
        (cmd_t){.op = OP_RESERVE, .seq = 1, .prompt = 1, .len = 8, .ids = 1, .reuse = 1, .tag = 5});
    ck_assert_uint_eq(rc.cached, 0);

    /* two namespaces naming the same scope share; other scopes and private ones do not */
    worker_t d = spawn("ns-d", "team", 0);
    res_t rd = put(&d, 1, 3, 8, 6);
    ck_assert_uint_eq(rd.commit_published, 2);
    worker_t e = spawn("ns-e", "team", 0);
    worker_t f = spawn("ns-f", "team-2", 0);
    worker_t g = spawn("ns-g", NULL, 0);
    ck_assert_uint_eq(lookup(&e, 3, 8), 8);
    ck_assert_uint_eq(lookup(&f, 3, 8), 0);
    ck_assert_uint_eq(lookup(&g, 3, 8), 0);
    ck_assert_uint_eq(lookup(&a, 3, 8), 0);
    ck_assert_uint_eq(lookup(&e, 1, 8), 0);
    res_t re = ok(&e, (cmd_t){.op = OP_RESERVE,
                              .seq = 1,
                              .prompt = 3,
                              .len = 8,
                              .ids = 1,
                              .reuse = 1,
                              .tag = 7,
                              .rng = {{8, 6}},
                              .nr = 1});
    ck_assert_uint_eq(re.cached, 8);
    ck_assert_uint_eq(re.nnz, 0);
    ck_assert_int_eq(re.pages[0], rd.pages[0]);
    ck_assert_int_eq(re.pages[1], rd.pages[1]);
    /* a pin belongs to its namespace: another namespace of the scope cannot drop it */
    res_t pd = ok(&d, (cmd_t){.op = OP_PIN, .prompt = 3, .len = 8});
    ck_assert_uint_eq(pd.pin_pages, 2);
    fails(&e, (cmd_t){.op = OP_UNPIN, .pin_id = pd.pin_id}, KVP_ENOENT, "no pin");
    ck_assert_uint_eq(cstats().pins, 1);
    ck_assert_uint_eq(ok(&d, (cmd_t){.op = OP_UNPIN, .pin_id = pd.pin_id}).n, 2);
    /* every session of a namespace is in one scope */
    int code;
    char msg[240];
    spawn_as(0, "ns-d", "team-2", 0, &code, msg);
    ck_assert_msg(code == KVP_EPRECOND, "%s (%s)", msg, kvp_errname(code));
    if (HAVE_ROOT()) {
        /* an unlisted scope name is its uid's own: another uid naming "team" shares nothing */
        worker_t u = spawn_as(65534, "ns-u", "team", 0, &code, msg);
        ck_assert_msg(code == 0, "uid 65534: %s", msg);
        ck_assert_uint_eq(lookup(&u, 3, 8), 0);
        finish(&u);
    }
    audit_ok();
    finish(&g);
    finish(&f);
    finish(&e);
    finish(&d);
    finish(&c);
    finish(&b);
    finish(&a);
    settle();
    audit_ok();
    stop_expect_clean();
}
END_TEST

/* ---- 3. flush ------------------------------------------------------------------------------ */

START_TEST(flush_drops_the_cached_pages_of_its_scope_and_keeps_held_ones)
{
    const char *more[] = {"--set", "access.allowed_uids=65534", NULL};
    start(64, more);
    worker_t w = spawn("fl", NULL, 0);
    worker_t x = spawn("fl-other", NULL, 0);
    put(&w, 1, 1, 8, 1);
    put(&w, 2, 2, 8, 2);
    put(&x, 1, 3, 8, 3);
    release(&w, 1);
    release(&x, 1);
    expect_cache(6, 4, 0, 0);
    res_t r = ok(&w, (cmd_t){.op = OP_FLUSH});
    ck_assert_uint_eq(r.n, 2); /* its own scope's cached pages, not x's, not the held ones */
    ck_assert_uint_eq(lookup(&w, 1, 8), 0);
    ck_assert_uint_eq(lookup(&w, 2, 8), 8);
    ck_assert_uint_eq(lookup(&x, 3, 8), 8);
    expect_cache(4, 2, 0, 0);
    ck_assert_uint_eq(cstats().evictions_flush_total, 2);
    expect_pages(60, 2);
    audit_ok();
    release(&w, 2);
    expect_cache(4, 4, 0, 0);
    r = ok(&w, (cmd_t){.op = OP_FLUSH});
    ck_assert_uint_eq(r.n, 2);
    ck_assert_uint_eq(lookup(&w, 2, 8), 0);
    r = ok(&w, (cmd_t){.op = OP_FLUSH});
    ck_assert_uint_eq(r.n, 0);
    ck_assert_uint_eq(cstats().evictions_flush_total, 4);
    /* the pages went back to the free stack: a new prompt of the same tokens starts cold */
    res_t rr = ok(
        &w,
        (cmd_t){.op = OP_RESERVE, .seq = 3, .prompt = 1, .len = 8, .ids = 1, .reuse = 1, .tag = 4});
    ck_assert_uint_eq(rr.cached, 0);
    ck_assert_uint_eq(rr.nnz, 8);
    expect_cache(2, 2, 0, 0);
    expect_pages(60, 2);
    if (HAVE_ROOT()) {
        /* another uid may flush only its own scope */
        int code;
        char msg[240];
        worker_t u = spawn_as(65534, "fl-u", NULL, 0, &code, msg);
        ck_assert_msg(code == 0, "uid 65534: %s", msg);
        cmd_t fc = {.op = OP_FLUSH};
        snprintf(fc.scope, sizeof(fc.scope), "ns:fl-other");
        fails(&u, fc, KVP_EPERM, "operators");
        fc.scope[0] = 0;
        fc.all = 1;
        fails(&u, fc, KVP_EPERM, "operators");
        finish(&u);
        expect_cache(2, 2, 0, 0);
    }
    /* an operator flushes everything */
    cmd_t all = {.op = OP_FLUSH, .all = 1};
    r = ok(&w, all);
    ck_assert_uint_eq(r.n, 2);
    ck_assert_uint_eq(lookup(&x, 3, 8), 0);
    expect_cache(0, 0, 0, 0);
    audit_ok();
    finish(&x);
    finish(&w);
    settle();
    audit_ok();
    stop_expect_clean();
}
END_TEST

/* ---- 4. pressure, pins, quotas, leases ----------------------------------------------------- */

START_TEST(pressure_evicts_the_least_recently_released_first_and_never_a_pinned_page)
{
    start(12, NULL);
    worker_t w = spawn("pr", NULL, 0);
    for (uint32_t p = 1; p <= 4; p++)
        put(&w, p, p, 8, p);
    for (uint32_t p = 1; p <= 4; p++)
        release(&w, p);
    /* reusing P1 and releasing it again makes it the most recently released */
    res_t r = ok(&w, (cmd_t){.op = OP_RESERVE,
                             .seq = 5,
                             .prompt = 1,
                             .len = 8,
                             .ids = 1,
                             .reuse = 1,
                             .tag = 9,
                             .rng = {{8, 1}},
                             .nr = 1});
    ck_assert_uint_eq(r.cached, 8);
    release(&w, 5);
    expect_cache(8, 8, 0, 0);
    expect_pages(4, 0);
    /* 5 pages: the 4 free ones, then P2's deepest page */
    ck_assert_int_eq(plain(&w, 10, 20).rc, 0);
    ck_assert_uint_eq(lookup(&w, 2, 8), 4);
    ck_assert_uint_eq(lookup(&w, 3, 8), 8);
    ck_assert_uint_eq(lookup(&w, 4, 8), 8);
    ck_assert_uint_eq(lookup(&w, 1, 8), 8);
    ck_assert_uint_eq(cstats().evictions_pressure_total, 1);
    /* 2 more: P2's first page, then P3's deepest */
    ck_assert_int_eq(plain(&w, 11, 8).rc, 0);
    ck_assert_uint_eq(lookup(&w, 2, 8), 0);
    ck_assert_uint_eq(lookup(&w, 3, 8), 4);
    ck_assert_uint_eq(lookup(&w, 4, 8), 8);
    ck_assert_uint_eq(lookup(&w, 1, 8), 8);
    ck_assert_uint_eq(cstats().evictions_pressure_total, 3);
    expect_cache(5, 5, 0, 0);
    audit_ok();
    release(&w, 10);
    release(&w, 11);
    expect_pages(7, 0);
    /* a pinned prefix is held: pressure takes everything else */
    r = ok(&w, (cmd_t){.op = OP_PIN, .prompt = 4, .len = 8});
    ck_assert_uint_eq(r.pin_pages, 2);
    ck_assert_uint_eq(r.pin_tokens, 8);
    const uint64_t pin = r.pin_id;
    ck_assert_uint_ne(pin, 0);
    expect_cache(5, 3, 2, 1);
    ck_assert_int_eq(plain(&w, 12, 40).rc, 0); /* 7 free + 3 cached */
    ck_assert_uint_eq(lookup(&w, 4, 8), 8);
    ck_assert_uint_eq(lookup(&w, 1, 8), 0);
    ck_assert_uint_eq(lookup(&w, 3, 8), 0);
    ck_assert_uint_eq(cstats().evictions_pressure_total, 6);
    expect_cache(2, 0, 2, 1);
    kvp_stats_summary_t before = summary();
    r = plain(&w, 13, 4);
    ck_assert_msg(r.rc == KVP_ENOSPC, "%s (%s)", r.msg, kvp_errname(r.rc));
    kvp_stats_summary_t after = summary();
    ck_assert_uint_eq(after.num_seqs, before.num_seqs);
    ck_assert_uint_eq(after.used_pages, 12);
    expect_cache(2, 0, 2, 1);
    audit_ok();
    /* unpinned and released, the prefix is evictable */
    release(&w, 12);
    r = ok(&w, (cmd_t){.op = OP_UNPIN, .pin_id = pin});
    ck_assert_uint_eq(r.n, 2);
    fails(&w, (cmd_t){.op = OP_UNPIN, .pin_id = pin}, KVP_ENOENT, NULL);
    expect_cache(2, 2, 0, 0);
    ck_assert_uint_eq(lookup(&w, 4, 8), 8);
    ck_assert_int_eq(plain(&w, 14, 48).rc, 0);
    ck_assert_uint_eq(lookup(&w, 4, 8), 0);
    expect_cache(0, 0, 0, 0);
    audit_ok();
    finish(&w);
    settle();
    expect_pages(12, 0);
    audit_ok();
    stop_expect_clean();
}
END_TEST

START_TEST(a_pin_over_the_namespace_quota_is_refused_and_changes_nothing)
{
    const char *more[] = {"--set", "limits.ns_max_pinned_pages=3", "--set",
                          "limits.pin_max_ttl_ms=60000", NULL};
    start(64, more);
    worker_t w = spawn("quota", NULL, 0);
    put(&w, 1, 1, 8, 1);
    put(&w, 2, 2, 12, 2);
    fails(&w, (cmd_t){.op = OP_PIN, .prompt = 5, .len = 8}, KVP_ENOENT, "nothing of this prompt");
    fails(&w, (cmd_t){.op = OP_PIN, .prompt = 1, .len = 3}, KVP_ENOENT, NULL);
    res_t p1 = ok(&w, (cmd_t){.op = OP_PIN, .prompt = 1, .len = 8, .ttl_ms = 100000});
    ck_assert_uint_eq(p1.pin_pages, 2);
    ck_assert_uint_eq(p1.pin_expires_ms, 60000); /* cut to limits.pin_max_ttl_ms */
    expect_cache(5, 0, 2, 1);
    kvp_stats_summary_t before = summary();
    fails(&w, (cmd_t){.op = OP_PIN, .prompt = 2, .len = 12}, KVP_ENOSPC,
          "limits.ns_max_pinned_pages");
    expect_cache(5, 0, 2, 1);
    kvp_stats_summary_t after = summary();
    ck_assert_uint_eq(after.used_pages, before.used_pages);
    ck_assert_uint_eq(after.page_refs, before.page_refs);
    audit_ok();
    res_t p2 = ok(&w, (cmd_t){.op = OP_PIN, .prompt = 2, .len = 5}); /* 1 page: 3 in all */
    ck_assert_uint_eq(p2.pin_pages, 1);
    ck_assert_uint_eq(p2.pin_tokens, 4);
    fails(&w, (cmd_t){.op = OP_PIN, .prompt = 1, .len = 4}, KVP_ENOSPC,
          "limits.ns_max_pinned_pages");
    expect_cache(5, 0, 3, 2);
    ck_assert_uint_eq(ok(&w, (cmd_t){.op = OP_UNPIN, .pin_id = p1.pin_id}).n, 2);
    res_t p3 = ok(&w, (cmd_t){.op = OP_PIN, .prompt = 2, .len = 8}); /* 1 + 2 */
    ck_assert_uint_eq(p3.pin_pages, 2);
    /* the second pin of P2's first page counts twice in the quota, once in pinned_pages */
    expect_cache(5, 0, 2, 2);
    audit_ok();
    finish(&w); /* the pins outlive the session: P1's pages and P2's third are cached */
    settle();
    expect_cache(5, 3, 2, 2);
    audit_ok();
    /* a flush drops the cached pages and keeps the pinned ones */
    worker_t w2 = spawn("quota", NULL, 0);
    ck_assert_uint_eq(ok(&w2, (cmd_t){.op = OP_FLUSH}).n, 3);
    expect_cache(2, 0, 2, 2);
    ck_assert_uint_eq(lookup(&w2, 2, 12), 8);
    ck_assert_uint_eq(lookup(&w2, 1, 8), 0);
    finish(&w2);
    settle();
    audit_ok();
    stop_expect_clean();
}
END_TEST

START_TEST(a_pinned_prefix_survives_its_workers_death_and_lease_until_unpinned_or_expired)
{
    start(12, NULL);
    worker_t x = spawn("lease", NULL, 100);
    res_t rx = put(&x, 1, 1, 10, 1);
    res_t px = ok(&x, (cmd_t){.op = OP_PIN, .prompt = 1, .len = 10});
    ck_assert_uint_eq(px.pin_pages, 2);
    ck_assert_uint_eq(px.pin_tokens, 8);
    kill_worker(&x);
    /* the lease (100 ms) runs out: the sequence goes, the pinned pages stay held */
    uint64_t end = now_ms() + 5000;
    while (summary().num_seqs != 0 && now_ms() < end)
        sleep_ms(10);
    ck_assert_uint_eq(summary().num_seqs, 0);
    expect_cache(2, 0, 2, 1);
    expect_pages(10, 2);
    audit_ok();
    /* pressure from another namespace cannot take them */
    worker_t y = spawn("other", NULL, 0);
    ck_assert_int_eq(plain(&y, 1, 40).rc, 0);
    res_t r = plain(&y, 2, 4);
    ck_assert_msg(r.rc == KVP_ENOSPC, "%s (%s)", r.msg, kvp_errname(r.rc));
    /* a new worker of the namespace finds the prefix and reads the dead worker's bytes */
    worker_t z = spawn("lease", NULL, 0);
    ck_assert_uint_eq(lookup(&z, 1, 10), 8);
    release(&y, 1);
    res_t rz = ok(&z, (cmd_t){.op = OP_RESERVE,
                              .seq = 5,
                              .prompt = 1,
                              .len = 10,
                              .ids = 1,
                              .reuse = 1,
                              .tag = 2,
                              .rng = {{8, 1}, {10, 2}},
                              .nr = 2});
    ck_assert_uint_eq(rz.cached, 8);
    ck_assert_int_eq(rz.pages[0], rx.pages[0]);
    ck_assert_int_eq(rz.pages[1], rx.pages[1]);
    /* the pin is the namespace's: the new session drops it */
    ck_assert_uint_eq(ok(&z, (cmd_t){.op = OP_UNPIN, .pin_id = px.pin_id}).n, 2);
    release(&z, 5);
    expect_cache(2, 2, 0, 0);
    /* a pin with a TTL holds until its time is up, then its pages are cached */
    put(&z, 6, 2, 8, 3);
    uint64_t t0 = now_ms();
    res_t pt = ok(&z, (cmd_t){.op = OP_PIN, .prompt = 2, .len = 8, .ttl_ms = 300});
    ck_assert_uint_eq(pt.pin_expires_ms, 300);
    release(&z, 6);
    expect_cache(4, 2, 2, 1);
    end = now_ms() + 5000;
    while (cstats().pins != 0 && now_ms() < end)
        sleep_ms(10);
    ck_assert_uint_ge(now_ms() - t0, 290);
    expect_cache(4, 4, 0, 0);
    /* now both prefixes are evictable */
    ck_assert_int_eq(plain(&y, 3, 48).rc, 0);
    ck_assert_uint_eq(lookup(&z, 1, 10), 0);
    ck_assert_uint_eq(lookup(&z, 2, 8), 0);
    expect_cache(0, 0, 0, 0);
    audit_ok();
    finish(&z);
    finish(&y);
    settle();
    audit_ok();
    stop_expect_clean();
}
END_TEST

/* ---- 5. the eviction order ---------------------------------------------------------------- */

/* Takes one more page (a 4-token sequence without token ids) and checks what is still
 * cached of the prompts (len tokens each) afterwards. */
static void take_one_and_expect(const worker_t *w, uint64_t seq, int n, const uint32_t *prompts,
                                const uint32_t *lens, const uint32_t *want)
{
    res_t r = plain(w, seq, 4);
    ck_assert_msg(r.rc == 0, "seq %llu: %s", (unsigned long long)seq, r.msg);
    for (int i = 0; i < n; i++) {
        uint32_t got = lookup(w, prompts[i], lens[i]);
        ck_assert_msg(got == want[i], "after seq %llu: prompt %u has %u cached, expected %u",
                      (unsigned long long)seq, prompts[i], got, want[i]);
    }
}

START_TEST(eviction_goes_by_priority_then_release_order_deepest_page_first)
{
    start(8, NULL);
    worker_t w = spawn("ord", NULL, 0);
    put(&w, 1, 1, 12, 1);
    res_t r = ok(&w, (cmd_t){.op = OP_RESERVE,
                             .seq = 2,
                             .prompt = 2,
                             .len = 8,
                             .ids = 1,
                             .has_prio = 1,
                             .priority = 80,
                             .tag = 2,
                             .commit = 1});
    ck_assert_uint_eq(r.commit_published, 2);
    r = ok(&w, (cmd_t){.op = OP_RESERVE,
                       .seq = 3,
                       .prompt = 3,
                       .len = 8,
                       .ids = 1,
                       .has_prio = 1,
                       .priority = 10,
                       .tag = 3,
                       .commit = 1});
    ck_assert_uint_eq(r.commit_published, 2);
    release(&w, 1);
    release(&w, 2);
    release(&w, 3);
    expect_cache(7, 7, 0, 0);
    expect_pages(1, 0);
    const uint32_t prompts[3] = {1, 2, 3}, lens[3] = {12, 8, 8};
    /* the free page first, then P3 (priority 10), P1 (35), P2 (80), each deepest first */
    static const uint32_t want[8][3] = {{12, 8, 8}, {12, 8, 4}, {12, 8, 0}, {8, 8, 0},
                                        {4, 8, 0},  {0, 8, 0},  {0, 4, 0},  {0, 0, 0}};
    for (int k = 0; k < 8; k++)
        take_one_and_expect(&w, 100 + (uint64_t)k, 3, prompts, lens, want[k]);
    ck_assert_uint_eq(cstats().evictions_pressure_total, 7);
    r = plain(&w, 200, 4);
    ck_assert_msg(r.rc == KVP_ENOSPC, "%s", r.msg);
    expect_cache(0, 0, 0, 0);
    audit_ok();
    finish(&w);
    settle();
    audit_ok();
    stop_expect_clean();
}
END_TEST

START_TEST(eviction_order_after_forks_and_truncates_is_the_documented_one)
{
    start(12, NULL);
    worker_t w = spawn("fork", NULL, 0);
    put(&w, 1, 1, 12, 1); /* a0 a1 a2 */
    ok(&w, (cmd_t){.op = OP_FORK, .seq = 1, .seq2 = 2});
    ok(&w, (cmd_t){.op = OP_FORK, .seq = 1, .seq2 = 3});
    ok(&w, (cmd_t){.op = OP_TRUNCATE, .seq = 3, .len = 4}); /* holds a0 */
    put(&w, 4, 2, 8, 2);                                    /* q0 q1 */
    expect_cache(5, 0, 0, 0);
    expect_pages(7, 5);
    release(&w, 1); /* seq 2 still holds a0..a2 */
    expect_cache(5, 0, 0, 0);
    release(&w, 2); /* a2, a1 */
    release(&w, 4); /* q1, q0 */
    release(&w, 3); /* a0: held longest */
    expect_cache(5, 5, 0, 0);
    ck_assert_uint_eq(cstats().evictions_rewrite_total, 0);
    /* the 7 free pages go first */
    ck_assert_int_eq(plain(&w, 50, 28).rc, 0);
    ck_assert_uint_eq(cstats().evictions_pressure_total, 0);
    const uint32_t prompts[2] = {1, 2}, lens[2] = {12, 8};
    static const uint32_t want[5][2] = {{8, 8}, {4, 8}, {4, 4}, {4, 0}, {0, 0}};
    for (int k = 0; k < 5; k++)
        take_one_and_expect(&w, 100 + (uint64_t)k, 2, prompts, lens, want[k]);
    ck_assert_uint_eq(cstats().evictions_pressure_total, 5);
    audit_ok();
    release(&w, 50);
    for (int k = 0; k < 5; k++)
        release(&w, 100 + (uint64_t)k);
    expect_pages(12, 0);

    /* a truncate into a sole-held indexed page makes it partial again: it leaves the cache */
    res_t r1 = put(&w, 1, 3, 8, 3); /* b0 b1 */
    ok(&w, (cmd_t){.op = OP_TRUNCATE, .seq = 1, .len = 6});
    ck_assert_uint_eq(cstats().evictions_rewrite_total, 1);
    expect_cache(1, 0, 0, 0);
    ck_assert_uint_eq(lookup(&w, 3, 8), 4);
    /* the chain goes on: the same 2 tokens key the page again */
    res_t r = ok(&w, (cmd_t){.op = OP_RESERVE,
                             .seq = 1,
                             .prompt = 3,
                             .first = 6,
                             .len = 2,
                             .ids = 1,
                             .tag = 4,
                             .rng = {{6, 3}, {8, 4}},
                             .nr = 2,
                             .commit = 1});
    ck_assert_uint_eq(r.nnz, 2);
    ck_assert_uint_eq(r.ncopies, 0);
    ck_assert_int_eq(r.pages[1], r1.pages[1]);
    ck_assert_uint_eq(r.commit_pages, 1);
    ck_assert_uint_eq(r.commit_published, 1);
    ck_assert_uint_eq(lookup(&w, 3, 8), 8);
    /* a truncate into a shared indexed page keeps it; the writer copies it first */
    ok(&w, (cmd_t){.op = OP_FORK, .seq = 1, .seq2 = 2});
    ok(&w, (cmd_t){.op = OP_TRUNCATE, .seq = 2, .len = 6});
    ck_assert_uint_eq(cstats().evictions_rewrite_total, 1);
    ck_assert_uint_eq(lookup(&w, 3, 8), 8);
    r = plain(&w, 2, 2);
    ck_assert_int_eq(r.rc, 0);
    ck_assert_uint_eq(r.ncopies, 1);
    ck_assert_uint_eq(r.copies[0], (uint32_t)r1.pages[1]);
    ck_assert_uint_eq(r.copies[1], (uint32_t)r.pages[1]);
    ck_assert_int_eq(r.pages[0], r1.pages[0]);
    ck_assert_uint_eq(lookup(&w, 3, 8), 8);
    expect_cache(2, 0, 0, 0);
    release(&w, 1); /* b1 cached; b0 still held by seq 2 */
    expect_cache(2, 1, 0, 0);
    release(&w, 2); /* b0 cached, seq 2's own page freed */
    expect_cache(2, 2, 0, 0);
    expect_pages(10, 0);
    /* 10 free pages, then b1 before b0 */
    ck_assert_int_eq(plain(&w, 60, 40).rc, 0);
    ck_assert_int_eq(plain(&w, 61, 4).rc, 0);
    ck_assert_uint_eq(lookup(&w, 3, 8), 4);
    ck_assert_uint_eq(cstats().evictions_rewrite_total, 1);
    audit_ok();
    finish(&w);
    settle();
    audit_ok();
    stop_expect_clean();
}
END_TEST

/* ---- 6. bad input ------------------------------------------------------------------------- */

typedef struct {
    kvp_stats_summary_t s;
    kvp_cache_stats_t c;
} snap_t;

static snap_t snap(void)
{
    snap_t x = {summary(), cstats()};
    return x;
}

static void unchanged(const snap_t *a, const char *what)
{
    snap_t b = snap();
    ck_assert_msg(a->s.used_pages == b.s.used_pages && a->s.free_pages == b.s.free_pages &&
                      a->s.num_seqs == b.s.num_seqs && a->s.num_tokens == b.s.num_tokens &&
                      a->s.page_refs == b.s.page_refs,
                  "%s changed the pool", what);
    ck_assert_msg(a->c.indexed_pages == b.c.indexed_pages &&
                      a->c.cached_pages == b.c.cached_pages &&
                      a->c.pinned_pages == b.c.pinned_pages && a->c.pins == b.c.pins &&
                      a->c.query_tokens_total == b.c.query_tokens_total &&
                      a->c.hit_tokens_total == b.c.hit_tokens_total &&
                      a->c.evictions_pressure_total == b.c.evictions_pressure_total &&
                      a->c.evictions_flush_total == b.c.evictions_flush_total &&
                      a->c.evictions_rewrite_total == b.c.evictions_rewrite_total,
                  "%s changed the cache", what);
    audit_ok();
}

/* Stats.namespaces_total through a raw Stats call of the observer. */
static uint32_t namespaces_total(void)
{
    kvpool_Request *q = calloc(1, sizeof(*q));
    kvpool_Response *resp = calloc(1, sizeof(*resp));
    ck_assert_ptr_nonnull(q);
    ck_assert_ptr_nonnull(resp);
    q->which_body = kvpool_Request_stats_tag;
    ck_assert_int_eq(kvp_client_call_raw(OBS, q, resp, NULL), 0);
    uint32_t n = resp->body.stats.stats.namespaces_total;
    free(q);
    free(resp);
    return n;
}

START_TEST(bad_input_gets_a_clear_status_and_changes_nothing)
{
    const char *more[] = {
        "--set", "limits.max_lookup_tokens=64",      "--set", "limits.ns_max_pinned_pages=2",
        "--set", "access.cache_scopes=shared=65533", "--set", "access.allowed_uids=65534,65533",
        NULL};
    start(64, more);
    worker_t w = spawn("bad", NULL, 0);
    put(&w, 1, 1, 8, 1);
    put(&w, 2, 2, 8, 2);
    ok(&w, (cmd_t){.op = OP_RESERVE, .seq = 3, .prompt = 4, .len = 8, .ids = 1, .tag = 4});
    snap_t s0 = snap();

    /* token ids: another count than sum(num_tokens) */
    fails(&w, (cmd_t){.op = OP_BAD_RESERVE, .seq = 9, .prompt = 1, .len = 8, .ntok_ids = 7},
          KVP_EINVAL, "token_ids has 7 entries");
    fails(&w, (cmd_t){.op = OP_BAD_RESERVE, .seq = 9, .prompt = 1, .len = 8, .ntok_ids = 9},
          KVP_EINVAL, "token_ids has 9 entries");
    unchanged(&s0, "a token id count mismatch");
    fails(&w, (cmd_t){.op = OP_CHECK, .seq = 9}, KVP_ENOENT, NULL);

    /* a salt over 256 bytes (Reserve, Lookup); 256 is accepted */
    cmd_t salted = {
        .op = OP_RESERVE, .seq = 9, .prompt = 3, .len = 8, .ids = 1, .tag = 5, .commit = 1};
    salted.salt_len = 257;
    memset(salted.salt, 's', sizeof(salted.salt));
    fails(&w, salted, KVP_EINVAL, "above 256");
    cmd_t lk = {.op = OP_LOOKUP, .prompt = 3, .len = 8, .salt_len = 300};
    memset(lk.salt, 's', sizeof(lk.salt));
    fails(&w, lk, KVP_EINVAL, "above 256");
    unchanged(&s0, "a salt over 256 bytes");
    fails(&w, (cmd_t){.op = OP_CHECK, .seq = 9}, KVP_ENOENT, NULL);
    salted.salt_len = 256;
    ck_assert_uint_eq(ok(&w, salted).commit_published, 2);
    lk.salt_len = 256;
    ck_assert_uint_eq(ok(&w, lk).cached, 8);
    ck_assert_uint_eq(lookup(&w, 3, 8), 0);
    s0 = snap();

    /* a priority above 100; reuse without token ids */
    fails(&w,
          (cmd_t){.op = OP_RESERVE,
                  .seq = 10,
                  .prompt = 1,
                  .len = 8,
                  .ids = 1,
                  .reuse = 1,
                  .has_prio = 1,
                  .priority = 101},
          KVP_EINVAL, "priority");
    fails(&w, (cmd_t){.op = OP_RESERVE, .seq = 10, .len = 8, .reuse = 1}, KVP_EINVAL,
          "reuse needs token_ids");
    unchanged(&s0, "a bad CacheOptions");

    /* a Lookup over limits.max_lookup_tokens (64), in one prompt or two */
    fails(&w, (cmd_t){.op = OP_LOOKUP, .prompt = 1, .len = 65}, KVP_ENOSPC, "max_lookup_tokens");
    fails(&w, (cmd_t){.op = OP_LOOKUP2, .prompt = 1, .prompt2 = 2, .len = 33}, KVP_ENOSPC,
          "max_lookup_tokens");
    fails(&w, (cmd_t){.op = OP_PIN, .prompt = 1, .len = 65}, KVP_ENOSPC, "max_lookup_tokens");
    unchanged(&s0, "a Lookup over max_lookup_tokens");
    res_t two = ok(&w, (cmd_t){.op = OP_LOOKUP2, .prompt = 1, .prompt2 = 2, .len = 32});
    ck_assert_uint_eq(two.cached, 8);
    ck_assert_uint_eq(two.n, 8);
    ck_assert_uint_eq(lookup(&w, 1, 64), 8);
    s0 = snap();

    /* a pin over the quota (2 pages) */
    ck_assert_uint_eq(ok(&w, (cmd_t){.op = OP_PIN, .prompt = 1, .len = 8}).pin_pages, 2);
    s0 = snap();
    fails(&w, (cmd_t){.op = OP_PIN, .prompt = 2, .len = 8}, KVP_ENOSPC,
          "limits.ns_max_pinned_pages");
    unchanged(&s0, "a pin over quota");

    /* Commit of an unknown sequence: all exist or nothing is published */
    fails(&w, (cmd_t){.op = OP_COMMIT, .seq = 77}, KVP_ENOENT, "no sequence 77");
    fails(&w, (cmd_t){.op = OP_COMMIT, .seq = 3, .seq2 = 77}, KVP_ENOENT, "no sequence 77");
    unchanged(&s0, "a Commit of an unknown sequence");
    ck_assert_uint_eq(lookup(&w, 4, 8), 0);
    s0 = snap();

    /* Append with reuse and skip_tokens beyond the cached prefix (8 of P1's 12 tokens) */
    fails(&w,
          (cmd_t){.op = OP_APPEND,
                  .seq = 20,
                  .prompt = 1,
                  .len = 12,
                  .ids = 1,
                  .reuse = 1,
                  .skip = 12,
                  .tag = 6},
          KVP_EPRECOND, "only 8 of the 12 tokens");
    fails(&w,
          (cmd_t){.op = OP_APPEND,
                  .seq = 20,
                  .prompt = 1,
                  .len = 12,
                  .ids = 1,
                  .reuse = 1,
                  .skip = 6,
                  .tag = 6},
          KVP_EINVAL, "multiple of page_size");
    fails(
        &w,
        (cmd_t){.op = OP_APPEND, .seq = 20, .prompt = 1, .len = 12, .ids = 1, .skip = 4, .tag = 6},
        KVP_EINVAL, "skip_tokens needs cache.reuse");
    unchanged(&s0, "an Append with a bad skip_tokens");
    fails(&w, (cmd_t){.op = OP_CHECK, .seq = 20}, KVP_ENOENT, NULL);

    /* a cache scope the uid may not join */
    if (HAVE_ROOT()) {
        uint32_t ns_before = namespaces_total();
        int code;
        char msg[240];
        spawn_as(65534, "bad-u", "shared", 0, &code, msg);
        ck_assert_msg(code == KVP_EPERM, "%s (%s)", msg, kvp_errname(code));
        ck_assert_msg(strstr(msg, "may not join cache scope 'shared'"), "message: %s", msg);
        ck_assert_uint_eq(namespaces_total(), ns_before);
        unchanged(&s0, "a Hello naming a forbidden scope");
        worker_t u = spawn_as(65533, "ok-u", "shared", 0, &code, msg);
        ck_assert_msg(code == 0, "uid 65533: %s", msg);
        ck_assert_uint_eq(lookup(&u, 1, 8), 0); /* "bad" is private */
        /* a listed scope is shared across the uids it lists (and root) */
        worker_t rs = spawn("root-s", "shared", 0);
        put(&rs, 1, 6, 8, 7);
        ck_assert_uint_eq(lookup(&u, 6, 8), 8);
        ck_assert_uint_eq(lookup(&w, 6, 8), 0);
        res_t ru = ok(&u, (cmd_t){.op = OP_RESERVE,
                                  .seq = 1,
                                  .prompt = 6,
                                  .len = 8,
                                  .ids = 1,
                                  .reuse = 1,
                                  .tag = 8,
                                  .rng = {{8, 7}},
                                  .nr = 1});
        ck_assert_uint_eq(ru.cached, 8);
        finish(&rs);
        finish(&u);
        settle();
        s0 = snap();
    }
    ck_assert_uint_eq(lookup(&w, 1, 8), 8);
    ck_assert_uint_eq(lookup(&w, 2, 8), 8);
    finish(&w);
    settle();
    audit_ok();
    stop_expect_clean();
}
END_TEST

/* ---- 7. the daemon-run Append ------------------------------------------------------------- */

START_TEST(a_daemon_run_append_is_findable_at_once_and_reuse_copies_only_the_rest)
{
    start(64, NULL);
    worker_t w = spawn("app", NULL, 0);
    res_t r1 = ok(&w, (cmd_t){.op = OP_APPEND,
                              .seq = 1,
                              .prompt = 1,
                              .len = 10,
                              .ids = 1,
                              .tag = 1,
                              .rng = {{10, 1}},
                              .nr = 1});
    ck_assert_uint_eq(r1.nnz, 10);
    ck_assert_uint_eq(r1.cached, 0);
    expect_cache(2, 0, 0, 0); /* no Commit needed */
    worker_t v = spawn("app", NULL, 0);
    ck_assert_uint_eq(lookup(&v, 1, 14), 8);
    /* skip_tokens = the Lookup's answer: the source holds rows 8..13 only */
    res_t r2 = ok(&v, (cmd_t){.op = OP_APPEND,
                              .seq = 2,
                              .prompt = 1,
                              .len = 14,
                              .ids = 1,
                              .reuse = 1,
                              .skip = 8,
                              .tag = 2,
                              .rng = {{8, 1}, {14, 2}},
                              .nr = 2});
    ck_assert_uint_eq(r2.cached, 8);
    ck_assert_uint_eq(r2.nnz, 6);
    ck_assert_int_eq(r2.aind[1], 6);
    ck_assert_uint_eq(r2.seq_len, 14);
    ck_assert_int_eq(r2.pages[0], r1.pages[0]);
    ck_assert_int_eq(r2.pages[1], r1.pages[1]);
    ck_assert_uint_eq(lookup(&v, 1, 14), 12);
    expect_cache(3, 0, 0, 0);
    /* skip_tokens 0: the source holds every row and the daemon skips the 12 cached ones */
    res_t r3 = ok(&v, (cmd_t){.op = OP_APPEND,
                              .seq = 3,
                              .prompt = 1,
                              .len = 14,
                              .ids = 1,
                              .reuse = 1,
                              .tag = 3,
                              .rng = {{8, 1}, {12, 2}, {14, 3}},
                              .nr = 3});
    ck_assert_uint_eq(r3.cached, 12);
    ck_assert_uint_eq(r3.nnz, 2);
    ck_assert_int_eq(r3.pages[2], r2.pages[2]);
    /* leave_last on a fully cached 12-token prompt: 2 pages linked, 4 rows copied */
    res_t r4 = ok(&v, (cmd_t){.op = OP_APPEND,
                              .seq = 4,
                              .prompt = 1,
                              .len = 12,
                              .ids = 1,
                              .reuse = 1,
                              .leave_last = 1,
                              .skip = 8,
                              .tag = 4,
                              .rng = {{8, 1}, {12, 4}},
                              .nr = 2});
    ck_assert_uint_eq(r4.cached, 8);
    ck_assert_uint_eq(r4.nnz, 4);
    /* fully cached without leave_last: nothing to copy */
    res_t r5 = ok(&v, (cmd_t){.op = OP_APPEND,
                              .seq = 5,
                              .prompt = 1,
                              .len = 12,
                              .ids = 1,
                              .reuse = 1,
                              .skip = 12,
                              .tag = 5,
                              .rng = {{8, 1}, {12, 2}},
                              .nr = 2});
    ck_assert_uint_eq(r5.cached, 12);
    ck_assert_uint_eq(r5.nnz, 0);
    ck_assert_int_eq(r5.aind[1], 0);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(r5.pages[i], r2.pages[i]);
    /* an Append over fewer layers waits for a Commit */
    res_t r6 = ok(
        &v,
        (cmd_t){
            .op = OP_APPEND, .seq = 6, .prompt = 5, .len = 8, .ids = 1, .layer_end = 1, .tag = 6});
    ck_assert_uint_eq(r6.nnz, 8);
    ck_assert_uint_eq(lookup(&w, 5, 8), 0);
    res_t cm = ok(&v, (cmd_t){.op = OP_COMMIT, .seq = 6});
    ck_assert_uint_eq(cm.commit_pages, 2);
    ck_assert_uint_eq(cm.commit_published, 2);
    ck_assert_uint_eq(lookup(&w, 5, 8), 8);
    expect_cache(5, 0, 0, 0);
    audit_ok();
    finish(&v);
    finish(&w);
    settle();
    expect_cache(5, 5, 0, 0);
    audit_ok();
    stop_expect_clean();
}
END_TEST

/* ---- more: batches, retention, scope slots, leases, truncates ------------------------------ */

START_TEST(a_batch_links_a_shared_cached_prefix_once_and_a_reserve_is_all_or_nothing)
{
    start(6, NULL);
    worker_t w = spawn("batch", NULL, 0);
    put(&w, 1, 1, 8, 1);
    release(&w, 1);
    expect_cache(2, 2, 0, 0);
    expect_pages(4, 0);
    /* 3 rows of 16 tokens, each linking P1's 2 cached pages: 6 fresh + 2 linked > 6 pages */
    kvp_stats_summary_t before = summary();
    fails(&w, (cmd_t){.op = OP_RESERVE_N, .seq = 10, .n = 3, .prompt = 1, .len = 16, .reuse = 1},
          KVP_ENOSPC, "pool exhausted");
    ck_assert_uint_eq(summary().num_seqs, before.num_seqs);
    expect_cache(2, 2, 0, 0);
    expect_pages(4, 0);
    ck_assert_uint_eq(cstats().evictions_pressure_total, 0);
    /* 2 rows: 4 fresh pages + the 2 linked ones, counted once, fit exactly */
    res_t r =
        ok(&w, (cmd_t){.op = OP_RESERVE_N, .seq = 10, .n = 2, .prompt = 1, .len = 16, .reuse = 1});
    ck_assert_uint_eq(r.row_cached[0], 8);
    ck_assert_uint_eq(r.row_cached[1], 8);
    ck_assert_uint_eq(r.nnz, 16);
    ck_assert_uint_eq(r.npages, 8);
    expect_pages(0, 6);
    expect_cache(2, 0, 0, 0);
    ck_assert_uint_eq(cstats().evictions_pressure_total, 0);
    audit_ok();
    release(&w, 10);
    release(&w, 11);
    expect_cache(2, 2, 0, 0);
    expect_pages(4, 0);
    /* a Reserve that would have to evict more than there is evicts nothing */
    r = plain(&w, 20, 28);
    ck_assert_msg(r.rc == KVP_ENOSPC, "%s", r.msg);
    ck_assert_uint_eq(lookup(&w, 1, 8), 8);
    ck_assert_uint_eq(cstats().evictions_pressure_total, 0);
    ck_assert_int_eq(plain(&w, 20, 24).rc, 0);
    ck_assert_uint_eq(cstats().evictions_pressure_total, 2);
    ck_assert_uint_eq(lookup(&w, 1, 8), 0);
    release(&w, 20);
    /* reuse applies to empty sequences only: a row that has tokens links nothing */
    put(&w, 30, 2, 8, 2);
    release(&w, 30);
    ck_assert_int_eq(plain(&w, 31, 4).rc, 0);
    r = ok(&w,
           (cmd_t){
               .op = OP_RESERVE, .seq = 31, .prompt = 2, .len = 8, .ids = 1, .reuse = 1, .tag = 3});
    EXP_Q -= 8; /* not a query: the row was not empty */
    ck_assert_uint_eq(r.cached, 0);
    ck_assert_uint_eq(r.nnz, 8);
    ck_assert_uint_eq(r.seq_len, 12);
    expect_cache(2, 2, 0, 0);
    audit_ok();
    /* the prefix a reuse links is out of the eviction order before the allocation evicts */
    release(&w, 31);
    put(&w, 40, 1, 8, 7);
    release(&w, 40); /* cached: P2 (older), P1; 2 free */
    expect_pages(2, 0);
    r = ok(&w, (cmd_t){.op = OP_RESERVE,
                       .seq = 41,
                       .prompt = 1,
                       .len = 20,
                       .ids = 1,
                       .reuse = 1,
                       .tag = 8,
                       .rng = {{8, 7}, {20, 8}},
                       .nr = 2});
    ck_assert_uint_eq(r.cached, 8);
    ck_assert_uint_eq(r.nnz, 12);
    ck_assert_uint_eq(cstats().evictions_pressure_total, 3);
    ck_assert_uint_eq(lookup(&w, 2, 8), 4);
    expect_cache(3, 1, 0, 0);
    expect_pages(0, 5);
    audit_ok();
    finish(&w);
    settle();
    audit_ok();
    stop_expect_clean();
}
END_TEST

START_TEST(a_retention_duration_holds_a_priority_then_the_page_counts_as_the_default)
{
    start(6, NULL);
    worker_t w = spawn("ret", NULL, 0);
    res_t a = ok(&w, (cmd_t){.op = OP_RESERVE,
                             .seq = 1,
                             .prompt = 1,
                             .len = 8,
                             .ids = 1,
                             .has_prio = 1,
                             .priority = 80,
                             .retention_ms = 1000,
                             .tag = 1,
                             .commit = 1});
    ck_assert_uint_eq(a.commit_published, 2);
    for (uint64_t s = 2; s <= 3; s++)
        ck_assert_uint_eq(ok(&w, (cmd_t){.op = OP_RESERVE,
                                         .seq = s,
                                         .prompt = (uint32_t)s,
                                         .len = 8,
                                         .ids = 1,
                                         .has_prio = 1,
                                         .priority = 50,
                                         .tag = (uint32_t)s,
                                         .commit = 1})
                              .commit_published,
                          2);
    uint64_t t0 = now_ms();
    release(&w, 1);
    release(&w, 2);
    release(&w, 3);
    expect_pages(0, 0);
    /* within its duration P1 (80) outlives P2 and P3 (50) */
    ck_assert_int_eq(plain(&w, 10, 4).rc, 0);
    ck_assert_msg(now_ms() - t0 < 500, "too slow to test the duration");
    ck_assert_uint_eq(lookup(&w, 1, 8), 8);
    ck_assert_uint_eq(lookup(&w, 2, 8), 4);
    ck_assert_uint_eq(lookup(&w, 3, 8), 8);
    /* after it P1 counts as 35 and goes before the 50s, its deepest page first */
    sleep_ms(1300);
    ck_assert_int_eq(plain(&w, 11, 4).rc, 0);
    ck_assert_msg(lookup(&w, 1, 8) == 4,
                  "P1 (pages %d, %d) after its retention: %u cached, expected 4 (deepest first)",
                  a.pages[0], a.pages[1], lookup(&w, 1, 8));
    ck_assert_uint_eq(lookup(&w, 2, 8), 4);
    ck_assert_uint_eq(lookup(&w, 3, 8), 8);
    ck_assert_int_eq(plain(&w, 12, 4).rc, 0);
    ck_assert_uint_eq(lookup(&w, 1, 8), 0);
    ck_assert_uint_eq(lookup(&w, 3, 8), 8);
    audit_ok();
    finish(&w);
    settle();
    audit_ok();
    stop_expect_clean();
}
END_TEST

/* The observer's view of one scope (Stats.cache.scopes); 0 when it is not listed. */
static int scope_stats(const char *name, kvpool_CacheScopeStats *out)
{
    kvpool_Request *q = calloc(1, sizeof(*q));
    kvpool_Response *resp = calloc(1, sizeof(*resp));
    ck_assert_ptr_nonnull(q);
    ck_assert_ptr_nonnull(resp);
    q->which_body = kvpool_Request_stats_tag;
    ck_assert_int_eq(kvp_client_call_raw(OBS, q, resp, NULL), 0);
    int found = 0;
    const kvpool_CacheStats *cs = &resp->body.stats.stats.cache;
    for (pb_size_t i = 0; i < cs->scopes_count && !found; i++)
        if (!strcmp(cs->scopes[i].name, name)) {
            *out = cs->scopes[i];
            found = 1;
        }
    free(q);
    free(resp);
    return found;
}

START_TEST(a_scope_slot_is_reused_only_when_nothing_of_it_is_held_and_starts_clean)
{
    const char *more[] = {"--set", "limits.max_cache_scopes=2", NULL};
    start(64, more);
    worker_t w1 = spawn("s1", NULL, 0);
    put(&w1, 1, 1, 8, 1);
    ck_assert_uint_eq(lookup(&w1, 1, 8), 8);
    kvpool_CacheScopeStats ss;
    ck_assert(scope_stats("ns:s1", &ss));
    ck_assert_uint_eq(ss.namespaces, 1);
    ck_assert_uint_eq(ss.indexed_pages, 2);
    ck_assert_uint_eq(ss.query_tokens, 8);
    ck_assert_uint_eq(ss.hit_tokens, 8);
    finish(&w1);
    settle();
    ck_assert(scope_stats("ns:s1", &ss));
    ck_assert_uint_eq(ss.namespaces, 0);
    ck_assert_uint_eq(ss.cached_pages, 2);
    worker_t w2 = spawn("s2", NULL, 0);
    /* both slots taken; the third scope takes s1's, whose cached pages are flushed */
    worker_t w3 = spawn("s3", NULL, 0);
    ck_assert(!scope_stats("ns:s1", &ss));
    ck_assert(scope_stats("ns:s3", &ss));
    ck_assert_uint_eq(ss.namespaces, 1);
    ck_assert_uint_eq(ss.indexed_pages, 0);
    ck_assert_uint_eq(ss.cached_pages, 0);
    ck_assert_msg(ss.query_tokens == 0 && ss.hit_tokens == 0,
                  "scope ns:s3 starts with s1's counters: query %llu hit %llu",
                  (unsigned long long)ss.query_tokens, (unsigned long long)ss.hit_tokens);
    kvp_cache_stats_t cs = cstats();
    ck_assert_uint_eq(cs.evictions_flush_total, 2);
    ck_assert_uint_eq(cs.cached_pages, 0);
    ck_assert_uint_eq(cs.indexed_pages, 0);
    expect_pages(64, 0);
    ck_assert_uint_eq(lookup(&w3, 1, 8), 0);
    /* none free: a fourth scope is refused */
    int code;
    char msg[240];
    spawn_as(0, "s4", NULL, 0, &code, msg);
    ck_assert_msg(code == KVP_ENOSPC, "%s (%s)", msg, kvp_errname(code));
    ck_assert_msg(strstr(msg, "max_cache_scopes"), "message: %s", msg);
    audit_ok();
    finish(&w3);
    finish(&w2);
    settle();
    audit_ok();
    stop_expect_clean();
}
END_TEST

START_TEST(a_dead_workers_pages_stay_cached_once_its_namespace_goes)
{
    start(64, NULL);
    /* lease 0: the pages are cached as soon as the daemon sees the death */
    worker_t x = spawn("dead0", NULL, 0);
    res_t rx = put(&x, 1, 1, 10, 1);
    kill_worker(&x);
    settle();
    expect_cache(2, 2, 0, 0);
    expect_pages(62, 0);
    /* lease 100 ms: held until the lease runs out, then cached */
    worker_t y = spawn("dead1", NULL, 100);
    res_t ry = put(&y, 1, 2, 8, 2);
    kill_worker(&y);
    settle();
    expect_cache(4, 2, 0, 0);
    uint64_t end = now_ms() + 5000;
    while (summary().num_seqs != 0 && now_ms() < end)
        sleep_ms(10);
    expect_cache(4, 4, 0, 0);
    expect_pages(60, 0);
    /* new workers of those namespaces read the dead workers' bytes */
    worker_t a = spawn("dead0", NULL, 0);
    worker_t b = spawn("dead1", NULL, 0);
    res_t ra = ok(&a, (cmd_t){.op = OP_RESERVE,
                              .seq = 1,
                              .prompt = 1,
                              .len = 10,
                              .ids = 1,
                              .reuse = 1,
                              .tag = 3,
                              .rng = {{8, 1}, {10, 3}},
                              .nr = 2});
    ck_assert_uint_eq(ra.cached, 8);
    ck_assert_int_eq(ra.pages[0], rx.pages[0]);
    ck_assert_int_eq(ra.pages[1], rx.pages[1]);
    res_t rb = ok(&b, (cmd_t){.op = OP_RESERVE,
                              .seq = 1,
                              .prompt = 2,
                              .len = 8,
                              .ids = 1,
                              .reuse = 1,
                              .tag = 4,
                              .rng = {{8, 2}},
                              .nr = 1});
    ck_assert_uint_eq(rb.cached, 8);
    ck_assert_int_eq(rb.pages[0], ry.pages[0]);
    ck_assert_uint_eq(lookup(&a, 2, 8), 0); /* private scopes */
    /* a namespace kept only for a pin goes when the pin's time is up; its pages stay cached
     * and its scope is found again by name */
    worker_t z = spawn("dead2", NULL, 100);
    res_t rz = put(&z, 1, 3, 8, 5);
    ck_assert_uint_eq(ok(&z, (cmd_t){.op = OP_PIN, .prompt = 3, .len = 8, .ttl_ms = 600}).pin_pages,
                      2);
    kill_worker(&z);
    settle();
    end = now_ms() + 5000;
    while (summary().num_seqs != 2 && now_ms() < end)
        sleep_ms(10);
    ck_assert_uint_eq(summary().num_seqs, 2); /* a's and b's */
    ck_assert_uint_eq(cstats().pins, 1);
    ck_assert_uint_eq(cstats().cached_pages, 0);
    end = now_ms() + 5000;
    while (cstats().pins != 0 && now_ms() < end)
        sleep_ms(10);
    expect_cache(6, 2, 0, 0);
    worker_t z2 = spawn("dead2", NULL, 0);
    res_t r2 = ok(&z2, (cmd_t){.op = OP_RESERVE,
                               .seq = 1,
                               .prompt = 3,
                               .len = 8,
                               .ids = 1,
                               .reuse = 1,
                               .tag = 6,
                               .rng = {{8, 5}},
                               .nr = 1});
    ck_assert_uint_eq(r2.cached, 8);
    ck_assert_int_eq(r2.pages[0], rz.pages[0]);
    finish(&z2);
    audit_ok();
    finish(&b);
    finish(&a);
    settle();
    audit_ok();
    stop_expect_clean();
}
END_TEST

START_TEST(a_truncate_below_indexed_pages_keeps_them_cached_and_a_rewrite_finds_them_again)
{
    start(64, NULL);
    worker_t w = spawn("trunc", NULL, 0);
    res_t r1 = put(&w, 1, 1, 12, 1); /* a0 a1 a2 */
    ok(&w, (cmd_t){.op = OP_TRUNCATE, .seq = 1, .len = 8});
    /* a2 left the sequence whole: cached, still findable */
    ck_assert_uint_eq(cstats().evictions_rewrite_total, 0);
    expect_cache(3, 1, 0, 0);
    ck_assert_uint_eq(lookup(&w, 1, 12), 12);
    /* the same 4 tokens again: the chain goes on, the new copy of a2's content stays private */
    res_t r = ok(&w, (cmd_t){.op = OP_RESERVE,
                             .seq = 1,
                             .prompt = 1,
                             .first = 8,
                             .len = 4,
                             .ids = 1,
                             .tag = 2,
                             .commit = 1});
    ck_assert_uint_eq(r.commit_pages, 1);
    ck_assert_uint_eq(r.commit_published, 0);
    ck_assert_int_ne(r.pages[2], r1.pages[2]);
    ck_assert_uint_eq(lookup(&w, 1, 12), 12);
    expect_cache(3, 1, 0, 0);
    worker_t v = spawn("trunc", NULL, 0);
    res_t rv = ok(&v, (cmd_t){.op = OP_RESERVE,
                              .seq = 5,
                              .prompt = 1,
                              .len = 12,
                              .ids = 1,
                              .reuse = 1,
                              .tag = 3,
                              .rng = {{12, 1}},
                              .nr = 1});
    ck_assert_uint_eq(rv.cached, 12);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(rv.pages[i], r1.pages[i]);
    expect_cache(3, 0, 0, 0);
    release(&v, 5);
    /* a truncate into a1, held by seq 1 alone: a1 leaves the cache, a2 stays cached (orphaned) */
    ok(&w, (cmd_t){.op = OP_TRUNCATE, .seq = 1, .len = 6});
    ck_assert_uint_eq(cstats().evictions_rewrite_total, 1);
    expect_cache(2, 1, 0, 0);
    ck_assert_uint_eq(lookup(&w, 1, 12), 4);
    /* another sequence writes a1's content again: a2 is found behind it */
    res_t r6 = ok(&v, (cmd_t){.op = OP_RESERVE,
                              .seq = 6,
                              .prompt = 1,
                              .len = 12,
                              .ids = 1,
                              .reuse = 1,
                              .tag = 4,
                              .rng = {{4, 1}, {12, 4}},
                              .nr = 2,
                              .commit = 1});
    ck_assert_uint_eq(r6.cached, 4);
    ck_assert_uint_eq(r6.nnz, 8);
    ck_assert_uint_eq(r6.commit_pages, 2);
    ck_assert_uint_eq(r6.commit_published, 1);
    ck_assert_uint_eq(lookup(&w, 1, 12), 12);
    res_t r7 = ok(&v, (cmd_t){.op = OP_RESERVE,
                              .seq = 7,
                              .prompt = 1,
                              .len = 12,
                              .ids = 1,
                              .reuse = 1,
                              .tag = 5,
                              .rng = {{4, 1}, {8, 4}, {12, 1}},
                              .nr = 3});
    ck_assert_uint_eq(r7.cached, 12);
    ck_assert_int_eq(r7.pages[0], r1.pages[0]);
    ck_assert_int_eq(r7.pages[1], r6.pages[1]);
    ck_assert_int_eq(r7.pages[2], r1.pages[2]);
    expect_cache(3, 0, 0, 0);
    audit_ok();
    finish(&v);
    finish(&w);
    settle();
    expect_cache(3, 3, 0, 0);
    expect_pages(61, 0);
    audit_ok();
    stop_expect_clean();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("prefix_cache");
    TCase *tc = tcase_create("prefix_cache");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, a_second_worker_reuses_the_first_workers_pages_and_reads_its_bytes);
    tcase_add_test(tc, pages_are_findable_only_after_commit_and_only_in_their_scope_and_salt);
    tcase_add_test(tc, flush_drops_the_cached_pages_of_its_scope_and_keeps_held_ones);
    tcase_add_test(tc, pressure_evicts_the_least_recently_released_first_and_never_a_pinned_page);
    tcase_add_test(tc, a_pin_over_the_namespace_quota_is_refused_and_changes_nothing);
    tcase_add_test(tc,
                   a_pinned_prefix_survives_its_workers_death_and_lease_until_unpinned_or_expired);
    tcase_add_test(tc, eviction_goes_by_priority_then_release_order_deepest_page_first);
    tcase_add_test(tc, eviction_order_after_forks_and_truncates_is_the_documented_one);
    tcase_add_test(tc, bad_input_gets_a_clear_status_and_changes_nothing);
    tcase_add_test(tc, a_daemon_run_append_is_findable_at_once_and_reuse_copies_only_the_rest);
    tcase_add_test(tc, a_batch_links_a_shared_cached_prefix_once_and_a_reserve_is_all_or_nothing);
    tcase_add_test(tc, a_retention_duration_holds_a_priority_then_the_page_counts_as_the_default);
    tcase_add_test(tc, a_scope_slot_is_reused_only_when_nothing_of_it_is_held_and_starts_clean);
    tcase_add_test(tc, a_dead_workers_pages_stay_cached_once_its_namespace_goes);
    tcase_add_test(tc,
                   a_truncate_below_indexed_pages_keeps_them_cached_and_a_rewrite_finds_them_again);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
