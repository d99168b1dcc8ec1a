/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_plan.c - the batch planner: exact page tables, copy-on-write, all-or-nothing failure,
 * and a long random run (append / fork / truncate / release / exhaustion) executed on a real
 * (tiny) pool through the CPU kernels and checked against an independent model of every
 * sequence's token contents, with the audit after every step.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_kernels.h"
#include "kvp_plan.h"
#include "kvp_test_util.h"

typedef struct {
    kvp_alloc_t *a;
    kvp_seqtab_t *t;
    kvp_plan_t plan;
} fixture_t;

static void fx_init(fixture_t *f, uint32_t num_pages, uint32_t page_size, uint32_t max_seqs)
{
    kvp_seqtab_config_t cfg = {.max_seqs = max_seqs, .max_namespaces = 4, .max_seq_tokens = 0};
    ck_assert_int_eq(kvp_alloc_create(num_pages, &f->a), 0);
    ck_assert_int_eq(kvp_seqtab_create(f->a, page_size, &cfg, &f->t), 0);
    kvp_plan_init(&f->plan);
}

static void fx_fini(fixture_t *f)
{
    kvp_plan_free(&f->plan);
    kvp_seqtab_destroy(f->t);
    kvp_alloc_destroy(f->a);
}

static void audit_ok(const kvp_seqtab_t *t)
{
    char msg[256] = "";
    int rc = kvp_seqtab_audit(t, msg, sizeof(msg));
    ck_assert_msg(rc == 0, "audit: %s (%s)", msg, kvp_errname(rc));
}

static void assert_i32(const int32_t *got, const int32_t *want, uint32_t n, const char *what)
{
    for (uint32_t i = 0; i < n; i++)
        ck_assert_msg(got[i] == want[i], "%s[%u] = %d, want %d", what, i, got[i], want[i]);
}

START_TEST(seed_batch_gives_flashinfer_page_table)
{
    fixture_t f;
    fx_init(&f, 64, 16, 16);
    kvp_plan_item_t items[4] = {{0, 100, 45}, {0, 101, 8}, {0, 102, 25}, {0, 103, 22}};
    ck_assert_int_eq(kvp_plan_append(f.t, items, 4, NULL, 7, &f.plan), 0);
    int32_t indptr[] = {0, 3, 4, 6, 8}, indices[] = {0, 1, 2, 3, 4, 5, 6, 7};
    int32_t last[] = {13, 8, 9, 6}, aind[] = {0, 45, 53, 78, 100}, lens[] = {45, 8, 25, 22};
    ck_assert_uint_eq(f.plan.batch_size, 4);
    ck_assert_uint_eq(f.plan.nnz, 100);
    ck_assert_uint_eq(f.plan.num_copies, 0);
    ck_assert_uint_eq(f.plan.num_new_pages, 8);
    assert_i32(f.plan.kv_indptr, indptr, 5, "kv_indptr");
    assert_i32(f.plan.kv_indices, indices, 8, "kv_indices");
    assert_i32(f.plan.kv_last_page_len, last, 4, "kv_last_page_len");
    assert_i32(f.plan.append_indptr, aind, 5, "append_indptr");
    assert_i32(f.plan.seq_lens, lens, 4, "seq_lens");
    kvp_stats_t st;
    kvp_seqtab_stats(f.t, &st);
    ck_assert_uint_eq(st.num_seqs, 4);
    ck_assert_uint_eq(st.num_tokens, 100);
    ck_assert_uint_eq(st.used_pages, 8);
    ck_assert_uint_eq(st.free_pages, 56);
    ck_assert_uint_eq(kvp_seqtab_find(f.t, 0, 102)->last_touch_ms, 7);
    audit_ok(f.t);

    /* a decode step: one token each; 45 % 16 = 13 -> fits; 8 -> fits; ... no new pages */
    kvp_plan_item_t step[4] = {{0, 100, 1}, {0, 101, 1}, {0, 102, 1}, {0, 103, 1}};
    ck_assert_int_eq(kvp_plan_append(f.t, step, 4, NULL, 8, &f.plan), 0);
    int32_t last2[] = {14, 9, 10, 7}, aind2[] = {0, 1, 2, 3, 4};
    assert_i32(f.plan.kv_indptr, indptr, 5, "kv_indptr");
    assert_i32(f.plan.kv_last_page_len, last2, 4, "kv_last_page_len");
    assert_i32(f.plan.append_indptr, aind2, 5, "append_indptr");
    ck_assert_uint_eq(f.plan.num_new_pages, 0);

    /* GetPageTable of two of them, in the asked order */
    kvp_plan_item_t q[2] = {{0, 103, 0}, {0, 100, 0}};
    ck_assert_int_eq(kvp_plan_page_table(f.t, q, 2, NULL, &f.plan), 0);
    int32_t qind[] = {0, 2, 5}, qidx[] = {6, 7, 0, 1, 2}, qlast[] = {7, 14};
    assert_i32(f.plan.kv_indptr, qind, 3, "kv_indptr");
    assert_i32(f.plan.kv_indices, qidx, 5, "kv_indices");
    assert_i32(f.plan.kv_last_page_len, qlast, 2, "kv_last_page_len");
    q[1].seq_id = 999;
    ck_assert_int_eq(kvp_plan_page_table(f.t, q, 2, NULL, &f.plan), KVP_ENOENT);
    ck_assert_uint_eq(f.plan.fail_index, 1);
    fx_fini(&f);
}
END_TEST

START_TEST(append_crossing_page_boundary_allocates_exactly)
{
    fixture_t f;
    fx_init(&f, 16, 4, 8);
    kvp_plan_item_t it = {1, 5, 4};
    ck_assert_int_eq(kvp_plan_append(f.t, &it, 1, NULL, 0, &f.plan), 0);
    ck_assert_uint_eq(f.plan.num_new_pages, 1);
    ck_assert_int_eq(f.plan.kv_last_page_len[0], 4);
    it.num_tokens = 1; /* 4 -> 5 tokens: second page */
    ck_assert_int_eq(kvp_plan_append(f.t, &it, 1, NULL, 0, &f.plan), 0);
    ck_assert_uint_eq(f.plan.num_new_pages, 1);
    ck_assert_int_eq(f.plan.kv_indptr[1], 2);
    ck_assert_int_eq(f.plan.kv_last_page_len[0], 1);
    it.num_tokens = 0; /* zero tokens: row only */
    ck_assert_int_eq(kvp_plan_append(f.t, &it, 1, NULL, 0, &f.plan), 0);
    ck_assert_uint_eq(f.plan.num_new_pages, 0);
    ck_assert_uint_eq(f.plan.nnz, 0);
    ck_assert_int_eq(f.plan.seq_lens[0], 5);
    /* a new sequence with zero tokens exists afterwards, empty, with an empty row */
    kvp_plan_item_t e = {1, 6, 0};
    ck_assert_int_eq(kvp_plan_append(f.t, &e, 1, NULL, 0, &f.plan), 0);
    ck_assert_int_eq(f.plan.kv_indptr[1], 0);
    ck_assert_int_eq(f.plan.kv_last_page_len[0], 0);
    ck_assert_ptr_nonnull(kvp_seqtab_find(f.t, 1, 6));
    audit_ok(f.t);
    fx_fini(&f);
}
END_TEST

START_TEST(copy_on_write_copies_shared_partial_page_once_per_writer)
{
    fixture_t f;
    fx_init(&f, 16, 4, 8);
    kvp_plan_item_t it = {0, 1, 5}; /* pages [0, 1], last page holds 1 token */
    ck_assert_int_eq(kvp_plan_append(f.t, &it, 1, NULL, 0, &f.plan), 0);
    ck_assert_int_eq(kvp_seqtab_fork(f.t, 0, 1, 2, 0), 0);
    ck_assert_int_eq(kvp_seqtab_fork(f.t, 0, 1, 3, 0), 0);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, 0), 3);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, 1), 3);
    /* all three append one token in one batch: the first two copy page 1, the last holder
     * (seq 1, processed last) writes in place */
    kvp_plan_item_t b[3] = {{0, 3, 1}, {0, 2, 1}, {0, 1, 1}};
    ck_assert_int_eq(kvp_plan_append(f.t, b, 3, NULL, 0, &f.plan), 0);
    ck_assert_uint_eq(f.plan.num_copies, 2);
    ck_assert_uint_eq(f.plan.copies[0].src, 1);
    ck_assert_uint_eq(f.plan.copies[0].dst, 2);
    ck_assert_uint_eq(f.plan.copies[1].src, 1);
    ck_assert_uint_eq(f.plan.copies[1].dst, 3);
    int32_t idx[] = {0, 2, 0, 3, 0, 1};
    assert_i32(f.plan.kv_indices, idx, 6, "kv_indices");
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, 0), 3);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, 1), 1);
    ck_assert_uint_eq(kvp_alloc_num_shared(f.a), 1);
    audit_ok(f.t);
    /* a full shared page is never copied: truncate to 4 tokens, fork, append */
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 1, 4, 0), 0);
    ck_assert_int_eq(kvp_seqtab_fork(f.t, 0, 1, 4, 0), 0);
    kvp_plan_item_t c = {0, 4, 1};
    ck_assert_int_eq(kvp_plan_append(f.t, &c, 1, NULL, 0, &f.plan), 0);
    ck_assert_uint_eq(f.plan.num_copies, 0);
    ck_assert_uint_eq(f.plan.num_new_pages, 1);
    /* a truncated-into shared page is copied on the next append */
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 4, 2, 0), 0);
    kvp_plan_item_t d = {0, 4, 1};
    ck_assert_int_eq(kvp_plan_append(f.t, &d, 1, NULL, 0, &f.plan), 0);
    ck_assert_uint_eq(f.plan.num_copies, 1);
    ck_assert_uint_eq(f.plan.copies[0].src, 0);
    audit_ok(f.t);
    fx_fini(&f);
}
END_TEST

/* Snapshot of everything observable, to prove a failed plan changed nothing. */
typedef struct {
    kvp_stats_t st;
    uint32_t n;
    uint64_t ids[64];
    uint32_t toks[64];
    uint32_t pages[64][32];
} snap_t;

static void snap(const kvp_seqtab_t *t, snap_t *s)
{
    memset(s, 0, sizeof(*s));
    kvp_seqtab_stats(t, &s->st);
    uint32_t cur = 0;
    const kvp_seq_t *q;
    while ((q = kvp_seqtab_next(t, &cur)) && s->n < 64) {
        s->ids[s->n] = q->id;
        s->toks[s->n] = q->num_tokens;
        if (q->num_pages)
            memcpy(s->pages[s->n], q->pages, (q->num_pages < 32 ? q->num_pages : 32) * 4);
        s->n++;
    }
}

static void assert_same(const kvp_seqtab_t *t, const snap_t *before)
{
    snap_t now;
    snap(t, &now);
    ck_assert_int_eq(memcmp(&now, before, sizeof(now)), 0);
    audit_ok(t);
}

START_TEST(failed_batches_change_nothing)
{
    fixture_t f;
    fx_init(&f, 8, 4, 4);
    kvp_plan_item_t a = {0, 1, 10}; /* 3 pages */
    ck_assert_int_eq(kvp_plan_append(f.t, &a, 1, NULL, 0, &f.plan), 0);
    ck_assert_int_eq(kvp_seqtab_fork(f.t, 0, 1, 2, 0), 0);
    snap_t s;
    snap(f.t, &s);

    /* exhaustion: 5 free; new seq 9 (4 pages) + seq 2 (cow 1 + 1 new) = 6 > 5 */
    kvp_plan_item_t ex[2] = {{0, 9, 16}, {0, 2, 3}};
    ck_assert_int_eq(kvp_plan_append(f.t, ex, 2, NULL, 0, &f.plan), KVP_ENOSPC);
    ck_assert_uint_eq(f.plan.fail_index, 2);
    ck_assert_ptr_null(kvp_seqtab_find(f.t, 0, 9));
    assert_same(f.t, &s);
    /* exactly enough succeeds: 4 + 1 (cow) = 5 */
    ex[1].num_tokens = 2;
    snap_t s2;
    ck_assert_int_eq(kvp_plan_append(f.t, ex, 2, NULL, 0, &f.plan), 0);
    ck_assert_uint_eq(kvp_alloc_num_free(f.a), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 9), 0);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 2, 10, 0), 0);
    snap(f.t, &s2);

    /* duplicates, new and existing */
    kvp_plan_item_t dup[3] = {{0, 7, 1}, {0, 1, 1}, {0, 7, 2}};
    ck_assert_int_eq(kvp_plan_append(f.t, dup, 3, NULL, 0, &f.plan), KVP_EDUPSEQ);
    ck_assert_uint_eq(f.plan.fail_index, 2);
    assert_same(f.t, &s2);
    kvp_plan_item_t dup2[2] = {{0, 1, 1}, {0, 1, 1}};
    ck_assert_int_eq(kvp_plan_append(f.t, dup2, 2, NULL, 0, &f.plan), KVP_EDUPSEQ);
    assert_same(f.t, &s2);

    /* batch and token limits */
    kvp_plan_limits_t lim = {.max_batch = 1, .max_tokens = 0};
    kvp_plan_item_t two[2] = {{0, 20, 1}, {0, 21, 1}};
    ck_assert_int_eq(kvp_plan_append(f.t, two, 2, &lim, 0, &f.plan), KVP_ELIMIT);
    lim = (kvp_plan_limits_t){.max_batch = 0, .max_tokens = 1};
    ck_assert_int_eq(kvp_plan_append(f.t, two, 2, &lim, 0, &f.plan), KVP_ELIMIT);
    ck_assert_uint_eq(f.plan.fail_index, 1);
    assert_same(f.t, &s2);

    /* sequence table full: max_seqs 4, holding 2; three new ones */
    kvp_plan_item_t many[3] = {{0, 30, 1}, {0, 31, 1}, {0, 32, 1}};
    ck_assert_int_eq(kvp_plan_append(f.t, many, 3, NULL, 0, &f.plan), KVP_ELIMIT);
    ck_assert_uint_eq(f.plan.fail_index, 2);
    assert_same(f.t, &s2);

    /* namespace quota: ns 1 may hold 2 page references */
    ck_assert_int_eq(kvp_seqtab_set_ns_limits(f.t, 1, 0, 2), 0);
    kvp_plan_item_t q[2] = {{1, 1, 4}, {1, 2, 5}};
    ck_assert_int_eq(kvp_plan_append(f.t, q, 2, NULL, 0, &f.plan), KVP_ELIMIT);
    ck_assert_uint_eq(f.plan.fail_index, 1);
    assert_same(f.t, &s2);
    /* namespace sequence limit */
    ck_assert_int_eq(kvp_seqtab_set_ns_limits(f.t, 1, 1, 0), 0);
    ck_assert_int_eq(kvp_plan_append(f.t, q, 2, NULL, 0, &f.plan), KVP_ELIMIT);
    assert_same(f.t, &s2);
    /* bad namespace, empty batch */
    kvp_plan_item_t bad = {4, 1, 1};
    ck_assert_int_eq(kvp_plan_append(f.t, &bad, 1, NULL, 0, &f.plan), KVP_EINVAL);
    ck_assert_int_eq(kvp_plan_append(f.t, &bad, 0, NULL, 0, &f.plan), KVP_EINVAL);
    assert_same(f.t, &s2);
    fx_fini(&f);
}
END_TEST

START_TEST(sequence_length_limit_is_enforced)
{
    kvp_alloc_t *a;
    kvp_seqtab_t *t;
    kvp_plan_t p;
    kvp_seqtab_config_t cfg = {.max_seqs = 4, .max_namespaces = 1, .max_seq_tokens = 10};
    ck_assert_int_eq(kvp_alloc_create(100, &a), 0);
    ck_assert_int_eq(kvp_seqtab_create(a, 4, &cfg, &t), 0);
    kvp_plan_init(&p);
    kvp_plan_item_t it = {0, 1, 10};
    ck_assert_int_eq(kvp_plan_append(t, &it, 1, NULL, 0, &p), 0);
    it.num_tokens = 1;
    ck_assert_int_eq(kvp_plan_append(t, &it, 1, NULL, 0, &p), KVP_ELIMIT);
    kvp_plan_item_t fresh = {0, 2, 11};
    ck_assert_int_eq(kvp_plan_append(t, &fresh, 1, NULL, 0, &p), KVP_ELIMIT);
    ck_assert_ptr_null(kvp_seqtab_find(t, 0, 2));
    audit_ok(t);
    kvp_plan_free(&p);
    kvp_seqtab_destroy(t);
    ck_assert_uint_eq(kvp_alloc_num_free(a), 100); /* destroy returned every page */
    kvp_alloc_destroy(a);
}
END_TEST

/* ---- the long random run, on a real pool through the CPU kernels ---------------------- */

#define MAXSEQ 48
#define MAXTOK 4096

typedef struct {
    int live;
    uint64_t id;
    uint32_t len;
    uint64_t tok[MAXTOK]; /* the model: the token value at each position */
} mseq_t;

typedef struct {
    kvp_geom_t g;
    kvp_geom_derived_t d;
    uint8_t *pool;
    kvp_paged_kv_t kv; /* layer 0 view */
    mseq_t seqs[MAXSEQ];
    uint64_t next_id;
    uint64_t next_val;
} world_t;

static void world_view(world_t *w, const kvp_plan_t *p)
{
    memset(&w->kv, 0, sizeof(w->kv));
    w->kv.k_data = w->pool + kvp_geom_layer_offset(&w->d, 0);
    w->kv.v_data = (uint8_t *)w->kv.k_data + w->d.v_offset_bytes;
    w->kv.elem_bytes = w->d.elem_bytes;
    w->kv.num_pages = w->g.num_pages;
    w->kv.page_size = w->g.page_size;
    w->kv.num_heads = w->d.heads;
    w->kv.head_dim = w->g.head_dim;
    w->kv.stride_page = w->d.stride_page;
    w->kv.stride_n = w->d.stride_n;
    w->kv.stride_h = w->d.stride_h;
    if (p) {
        w->kv.batch_size = p->batch_size;
        w->kv.kv_indptr = p->kv_indptr;
        w->kv.kv_indices = p->kv_indices;
        w->kv.kv_last_page_len = p->kv_last_page_len;
    }
}

/* Reads token `pos` of s back from the pool (K row) and checks V is its complement. */
static uint64_t read_tok(world_t *w, const kvp_seq_t *s, uint32_t pos)
{
    uint32_t page = s->pages[pos / w->g.page_size];
    uint64_t k, v;
    memcpy(&k, w->pool + kvp_geom_offset(&w->d, &w->g, 0, page, 0, pos % w->g.page_size, 0), 8);
    memcpy(&v, w->pool + kvp_geom_offset(&w->d, &w->g, 0, page, 1, pos % w->g.page_size, 0), 8);
    KVP_CHECK(v == ~k, "V of token %u is not the complement of K", pos);
    return k;
}

static void check_world(world_t *w, const kvp_seqtab_t *t)
{
    audit_ok(t);
    uint32_t nseq = 0;
    uint64_t ntok = 0;
    for (int i = 0; i < MAXSEQ; i++) {
        mseq_t *m = &w->seqs[i];
        if (!m->live)
            continue;
        nseq++;
        ntok += m->len;
        const kvp_seq_t *s = kvp_seqtab_find(t, 0, m->id);
        ck_assert_ptr_nonnull(s);
        ck_assert_uint_eq(s->num_tokens, m->len);
        for (uint32_t pos = 0; pos < m->len; pos++)
            KVP_CHECK(read_tok(w, s, pos) == m->tok[pos],
                      "seq %llu token %u differs from the model", (unsigned long long)m->id, pos);
    }
    kvp_stats_t st;
    kvp_seqtab_stats(t, &st);
    ck_assert_uint_eq(st.num_seqs, nseq);
    ck_assert_uint_eq(st.num_tokens, ntok);
}

static int pick_live(world_t *w, kvp_rng_t *r)
{
    int live[MAXSEQ], n = 0;
    for (int i = 0; i < MAXSEQ; i++)
        if (w->seqs[i].live)
            live[n++] = i;
    return n ? live[kvp_rng_below(r, (uint32_t)n)] : -1;
}

static int pick_free(world_t *w)
{
    for (int i = 0; i < MAXSEQ; i++)
        if (!w->seqs[i].live)
            return i;
    return -1;
}

/* Pages the model predicts a batch needs (fresh + copy-on-write), from refcounts. */
static uint32_t predicted_need(world_t *w, kvp_seqtab_t *t, const kvp_plan_item_t *it, uint32_t n)
{
    uint32_t ps = w->g.page_size, need = 0;
    uint32_t *dec = calloc(w->g.num_pages, 4);
    for (uint32_t i = 0; i < n; i++) {
        const kvp_seq_t *s = kvp_seqtab_find(t, 0, it[i].seq_id);
        uint32_t len = s ? s->num_tokens : 0;
        need += kvp_geom_pages_for(ps, len + it[i].num_tokens) - kvp_geom_pages_for(ps, len);
        if (s && it[i].num_tokens && len % ps) {
            uint32_t last = s->pages[s->num_pages - 1];
            if (kvp_alloc_refcount(kvp_seqtab_alloc(t), last) - dec[last] > 1) {
                need++;
                dec[last]++;
            }
        }
    }
    free(dec);
    return need;
}

static void random_run(uint32_t page_size, uint32_t num_pages, uint64_t seed, uint32_t steps)
{
    world_t *w = calloc(1, sizeof(*w));
    w->g = (kvp_geom_t){.num_layers = 1,
                        .num_pages = num_pages,
                        .page_size = page_size,
                        .num_kv_heads = 1,
                        .head_dim = 2,
                        .dtype = KVP_DTYPE_FP32,
                        .layout = (seed & 1) ? KVP_LAYOUT_HND : KVP_LAYOUT_NHD,
                        .storage = (seed & 2) ? KVP_STORAGE_SPLIT : KVP_STORAGE_COMBINED,
                        .num_devices = 1};
    ck_assert_int_eq(kvp_geom_derive(&w->g, &w->d), 0);
    w->pool = malloc(w->d.pool_bytes);
    memset(w->pool, 0xA5, w->d.pool_bytes);
    kvp_alloc_t *a;
    kvp_seqtab_t *t;
    kvp_seqtab_config_t cfg = {.max_seqs = MAXSEQ, .max_namespaces = 1, .max_seq_tokens = MAXTOK};
    ck_assert_int_eq(kvp_alloc_create(num_pages, &a), 0);
    ck_assert_int_eq(kvp_seqtab_create(a, page_size, &cfg, &t), 0);
    kvp_plan_t plan;
    kvp_plan_init(&plan);
    kvp_rng_t r;
    kvp_rng_seed(&r, seed);
    uint32_t n_exhausted = 0, n_cow = 0, n_ok = 0;
    int32_t *bi = malloc(sizeof(int32_t) * 8 * MAXTOK), *pos = malloc(sizeof(int32_t) * 8 * MAXTOK);
    int32_t *slots = malloc(sizeof(int32_t) * 8 * MAXTOK);
    uint64_t *kbuf = malloc(16 * 8 * (size_t)MAXTOK);

    for (uint32_t step = 0; step < steps; step++) {
        uint32_t op = kvp_rng_below(&r, 100);
        if (op < 55) { /* append batch */
            kvp_plan_item_t it[8];
            int idx[8];
            uint32_t n = 1 + kvp_rng_below(&r, 6);
            uint32_t k = 0;
            for (uint32_t j = 0; j < n; j++) {
                int m = kvp_rng_below(&r, 4) == 0 ? pick_free(w) : pick_live(w, &r);
                if (m < 0)
                    continue;
                int dup = 0;
                for (uint32_t q = 0; q < k; q++)
                    dup |= idx[q] == m;
                if (dup)
                    continue;
                if (!w->seqs[m].live)
                    w->seqs[m].id = ++w->next_id, w->seqs[m].len = 0;
                uint32_t big = kvp_rng_below(&r, 10) == 0;
                uint32_t add = big                    ? kvp_rng_below(&r, page_size * 6 + 1)
                               : kvp_rng_below(&r, 3) ? 1
                                                      : kvp_rng_below(&r, page_size + 2);
                if (w->seqs[m].len + add > MAXTOK)
                    add = 0;
                it[k] = (kvp_plan_item_t){0, w->seqs[m].id, add};
                idx[k++] = m;
                /* pretend the sequence is live only if the plan succeeds */
            }
            if (!k)
                continue;
            uint32_t need = predicted_need(w, t, it, k);
            uint32_t free_before = kvp_alloc_num_free(a);
            snap_t before;
            snap(t, &before);
            int rc = kvp_plan_append(t, it, k, NULL, step, &plan);
            if (need > free_before) {
                ck_assert_int_eq(rc, KVP_ENOSPC);
                assert_same(t, &before);
                n_exhausted++;
                continue;
            }
            ck_assert_msg(rc == 0, "plan failed: %s", kvp_errname(rc));
            ck_assert_uint_eq(plan.num_new_pages, need);
            n_ok++;
            n_cow += plan.num_copies;
            /* the page table rows name exactly the sequences' pages */
            for (uint32_t j = 0; j < k; j++) {
                const kvp_seq_t *s = kvp_seqtab_find(t, 0, it[j].seq_id);
                ck_assert_int_eq(plan.kv_indptr[j + 1] - plan.kv_indptr[j], (int)s->num_pages);
                for (uint32_t q = 0; q < s->num_pages; q++)
                    KVP_CHECK(plan.kv_indices[plan.kv_indptr[j] + q] == (int)s->pages[q],
                              "row %u entry %u", j, q);
                ck_assert_int_eq(plan.seq_lens[j], (int)(w->seqs[idx[j]].len + it[j].num_tokens));
            }
            /* execute: copies first, then the append, through the kernels */
            world_view(w, &plan);
            ck_assert_int_eq(
                kvp_page_copy_cpu(&w->kv, (const kvp_page_copy_t *)plan.copies, plan.num_copies),
                0);
            ck_assert_int_eq(kvp_get_batch_indices_positions_cpu(plan.append_indptr, plan.seq_lens,
                                                                 plan.batch_size, plan.nnz, bi,
                                                                 pos),
                             0);
            for (uint32_t i = 0; i < plan.nnz; i++) {
                uint64_t v = ++w->next_val * 0x9e3779b97f4a7c15ull;
                kbuf[2 * i] = v;
                kbuf[2 * (size_t)plan.nnz + 2 * i] = ~v;
                kbuf[2 * i + 1] = 0;
                kbuf[2 * (size_t)plan.nnz + 2 * i + 1] = 0;
                mseq_t *m = &w->seqs[idx[bi[i]]];
                KVP_CHECK(pos[i] == (int)(m->len + (i - (uint32_t)plan.append_indptr[bi[i]])),
                          "position of token %u", i);
                m->tok[pos[i]] = v;
            }
            kvp_append_src_t src = {.key = kbuf,
                                    .value = kbuf + 2 * (size_t)plan.nnz,
                                    .k_stride_n = 4,
                                    .k_stride_h = 4,
                                    .v_stride_n = 4,
                                    .v_stride_h = 4};
            /* the planner's slots (what the daemon's backends run) name the same slot as the
             * token's batch index and position through the table; the slots form and the
             * tokens form take turns writing the pool */
            kvp_plan_slots(&plan, w->kv.page_size, slots);
            const int32_t ps = (int32_t)w->kv.page_size;
            for (uint32_t i = 0; i < plan.nnz; i++)
                KVP_CHECK(slots[i] == plan.kv_indices[plan.kv_indptr[bi[i]] + pos[i] / ps] * ps +
                                          pos[i] % ps,
                          "slot of token %u", i);
            const kvp_append_dest_t dest = {
                .kind = KVP_APPEND_DEST_SLOTS, .nnz = plan.nnz, .slots = slots};
            if (n_ok & 1)
                ck_assert_int_eq(kvp_append_cpu(&w->kv, &src, &dest), 0);
            else
                ck_assert_int_eq(kvp_append_paged_kv_cache_cpu(&w->kv, &src, bi, pos, plan.nnz), 0);
            for (uint32_t j = 0; j < k; j++) {
                w->seqs[idx[j]].live = 1;
                w->seqs[idx[j]].len += it[j].num_tokens;
            }
        } else if (op < 70) { /* fork */
            int p = pick_live(w, &r), c = pick_free(w);
            if (p < 0 || c < 0)
                continue;
            uint64_t cid = ++w->next_id;
            ck_assert_int_eq(kvp_seqtab_fork(t, 0, w->seqs[p].id, cid, step), 0);
            w->seqs[c] = w->seqs[p];
            w->seqs[c].id = cid;
            ck_assert_int_eq(kvp_seqtab_fork(t, 0, w->seqs[p].id, cid, step), KVP_EEXIST);
        } else if (op < 85) { /* truncate */
            int m = pick_live(w, &r);
            if (m < 0)
                continue;
            uint32_t nl = w->seqs[m].len ? kvp_rng_below(&r, w->seqs[m].len + 1) : 0;
            ck_assert_int_eq(kvp_seqtab_truncate(t, 0, w->seqs[m].id, w->seqs[m].len + 1, step),
                             KVP_ERANGE);
            ck_assert_int_eq(kvp_seqtab_truncate(t, 0, w->seqs[m].id, nl, step), 0);
            w->seqs[m].len = nl;
        } else { /* release */
            int m = pick_live(w, &r);
            if (m < 0)
                continue;
            ck_assert_int_eq(kvp_seqtab_release(t, 0, w->seqs[m].id), 0);
            ck_assert_int_eq(kvp_seqtab_release(t, 0, w->seqs[m].id), KVP_ENOENT);
            w->seqs[m].live = 0;
        }
        check_world(w, t);
    }
    /* the run must have exercised exhaustion, copy-on-write (impossible with one-token pages:
     * a page is never partially filled) and success */
    ck_assert_msg(n_exhausted > 0 && (n_cow > 0 || page_size == 1) && n_ok > 0,
                  "seed %llu: exhausted %u cow %u ok %u", (unsigned long long)seed, n_exhausted,
                  n_cow, n_ok);
    /* release everything: every page comes back */
    for (int i = 0; i < MAXSEQ; i++)
        if (w->seqs[i].live)
            ck_assert_int_eq(kvp_seqtab_release(t, 0, w->seqs[i].id), 0);
    ck_assert_uint_eq(kvp_alloc_num_free(a), num_pages);
    audit_ok(t);
    free(kbuf);
    free(pos);
    free(bi);
    free(slots);
    kvp_plan_free(&plan);
    kvp_seqtab_destroy(t);
    kvp_alloc_destroy(a);
    free(w->pool);
    free(w);
}

START_TEST(random_operations_match_the_model)
{
    static const uint32_t page_sizes[] = {1, 3, 4, 16};
    uint64_t seed = kvp_test_seed(0x5eed) + (uint64_t)_i * 7919;
    uint32_t ps = page_sizes[_i % 4];
    random_run(ps, ps == 1 ? 160 : 96, seed, 3000);
}
END_TEST

static Suite *plan_suite(void)
{
    Suite *s = suite_create("plan");
    TCase *tc = tcase_create("plan");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, seed_batch_gives_flashinfer_page_table);
    tcase_add_test(tc, append_crossing_page_boundary_allocates_exactly);
    tcase_add_test(tc, copy_on_write_copies_shared_partial_page_once_per_writer);
    tcase_add_test(tc, failed_batches_change_nothing);
    tcase_add_test(tc, sequence_length_limit_is_enforced);
    tcase_add_loop_test(tc, random_operations_match_the_model, 0, 8);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(plan_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
