/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_pcache.c - the prefix cache (kvp_pcache.h) through the planner and the sequence table:
 * exact results for keying, publishing, reuse, release into the eviction order, eviction under
 * pressure, retention, pins, flush, truncate and fork; then a model-based random run (millions
 * of operations with KVP_PCACHE_OPS) against a reference model of every page's cache state,
 * the eviction order, pins and stats, with the audit after every operation and a shadow pool
 * (the token id in every slot) proving no cached or shared page is ever overwritten and that
 * reused pages hold the right tokens.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_pagekey.h"
#include "kvp_pcache.h"
#include "kvp_plan.h"
#include "kvp_test_util.h"

/* ---- the targeted cases --------------------------------------------------------------- */

typedef struct {
    kvp_alloc_t *a;
    kvp_seqtab_t *t;
    kvp_pcache_t *c;
    kvp_plan_t p;
    uint32_t ps;
    uint64_t now;
} fx_t;

static void fx_init(fx_t *f, uint32_t pages, uint32_t ps, uint32_t max_pins)
{
    kvp_seqtab_config_t cfg = {.max_seqs = 64, .max_namespaces = 4, .max_seq_tokens = 0};
    kvp_pcache_config_t pc = {.max_scopes = 2, .max_pins = max_pins};
    ck_assert_int_eq(kvp_alloc_create(pages, &f->a), 0);
    ck_assert_int_eq(kvp_seqtab_create(f->a, ps, &cfg, &f->t), 0);
    ck_assert_int_eq(kvp_pcache_create(f->t, &pc, &f->c), 0);
    ck_assert_ptr_eq(kvp_seqtab_pcache(f->t), f->c);
    kvp_plan_init(&f->p);
    f->ps = ps;
    f->now = 0;
}

static void fx_audit(const fx_t *f)
{
    char msg[256] = "";
    int rc = kvp_pcache_audit(f->c, msg, sizeof(msg));
    ck_assert_msg(rc == 0, "audit: %s (%s)", msg, kvp_errname(rc));
}

static void fx_fini(fx_t *f)
{
    fx_audit(f);
    kvp_plan_free(&f->p);
    kvp_pcache_destroy(f->c);
    ck_assert_ptr_null(kvp_seqtab_pcache(f->t));
    kvp_seqtab_destroy(f->t);
    ck_assert_uint_eq(kvp_alloc_num_free(f->a), kvp_alloc_num_pages(f->a));
    kvp_alloc_destroy(f->a);
}

/* Cache options of a call: scope, reuse, leave_last, priority, retention. */
static kvp_plan_cache_t co(uint32_t scope, int reuse, int leave_last, uint32_t prio, uint32_t ret)
{
    kvp_plan_cache_t c = {.scope = scope,
                          .reuse = (uint8_t)reuse,
                          .leave_last = (uint8_t)leave_last,
                          .priority = (uint8_t)prio,
                          .retention_ms = ret};
    return c;
}

#define DEF   co(0, 0, 0, KVP_PCACHE_DEFAULT_PRIORITY, 0)
#define REUSE co(0, 1, 0, KVP_PCACHE_DEFAULT_PRIORITY, 0)

/* One item: n tokens toks (NULL: no token ids) with salt (NULL: none) into seq id of ns 0. */
static int app_c(fx_t *f, uint64_t id, const int32_t *toks, uint32_t n, const char *salt,
                 kvp_plan_cache_t c)
{
    kvp_plan_item_t it = {0, id, n};
    kvp_plan_content_t ct = {toks, salt, salt ? (uint32_t)strlen(salt) : 0};
    return kvp_plan_append_cached(f->t, &it, &ct, 1, NULL, &c, f->now, &f->p);
}

static void app(fx_t *f, uint64_t id, const int32_t *toks, uint32_t n)
{
    int rc = app_c(f, id, toks, n, NULL, DEF);
    ck_assert_msg(rc == 0, "append %u tokens to %llu: %s", n, (unsigned long long)id,
                  kvp_errname(rc));
}

static kvp_seq_t *seq(const fx_t *f, uint64_t id)
{
    kvp_seq_t *s = kvp_seqtab_find(f->t, 0, id);
    ck_assert_ptr_nonnull(s);
    return s;
}

static uint32_t pg(const fx_t *f, uint64_t id, uint32_t i)
{
    kvp_seq_t *s = seq(f, id);
    ck_assert_uint_lt(i, s->num_pages);
    return s->pages[i];
}

static uint32_t pub(fx_t *f, uint64_t id)
{
    return kvp_pcache_publish_seq(f->c, seq(f, id));
}

static kvp_pagekey_t root_of(const char *salt)
{
    kvp_pagekey_t r;
    ck_assert_int_eq(kvp_pagekey_root(salt, salt ? strlen(salt) : 0, &r), 0);
    return r;
}

/* The key of page i of a sequence holding toks (with salt). */
static kvp_pagekey_t key_at(const char *salt, const int32_t *toks, uint32_t i, uint32_t ps)
{
    kvp_pagekey_t keys[64];
    ck_assert_uint_lt(i, 64);
    ck_assert_uint_eq(kvp_pagekey_chain(root_of(salt), toks, (uint64_t)(i + 1) * ps, ps, keys, 64),
                      i + 1);
    return keys[i];
}

static uint32_t look(const fx_t *f, uint32_t scope, const char *salt, const int32_t *toks,
                     uint32_t n)
{
    return kvp_pcache_lookup(f->c, scope, root_of(salt), toks, n, 0);
}

static void order_is(const fx_t *f, const uint32_t *want, uint32_t n)
{
    uint32_t got[256];
    uint32_t m = kvp_pcache_eviction_order(f->c, got, 256);
    char buf[512] = "";
    for (uint32_t i = 0; i < m && strlen(buf) < 480; i++)
        snprintf(buf + strlen(buf), sizeof(buf) - strlen(buf), " %u", got[i]);
    ck_assert_msg(m == n, "eviction order has %u pages (%s), want %u", m, buf, n);
    for (uint32_t i = 0; i < n; i++)
        ck_assert_msg(got[i] == want[i], "eviction order[%u] = %u, want %u (order:%s)", i, got[i],
                      want[i], buf);
}

static kvp_pcache_stats_t stats(const fx_t *f)
{
    kvp_pcache_stats_t s;
    kvp_pcache_stats(f->c, &s);
    return s;
}

static int row_has(const kvp_plan_t *p, uint32_t row, uint32_t page)
{
    for (int32_t i = p->kv_indptr[row]; i < p->kv_indptr[row + 1]; i++)
        if ((uint32_t)p->kv_indices[i] == page)
            return 1;
    return 0;
}

/* Prompts: A[i] = 100 + i, B[i] = 500 + i, C, D, E likewise. */
static int32_t A[64], B[64], C[64], D[64], E[64];

static void prompts(void)
{
    for (int i = 0; i < 64; i++) {
        A[i] = 100 + i;
        B[i] = 500 + i;
        C[i] = 900 + i;
        D[i] = 1300 + i;
        E[i] = 1700 + i;
    }
}

START_TEST(create_and_bad_arguments)
{
    fx_t f;
    fx_init(&f, 8, 4, 4);
    kvp_pcache_t *c2 = NULL;
    kvp_pcache_config_t pc = {.max_scopes = 2, .max_pins = 4};
    ck_assert_int_eq(kvp_pcache_create(f.t, &pc, &c2), KVP_EINVAL); /* already has one */
    ck_assert_int_eq(kvp_pcache_create(NULL, &pc, &c2), KVP_EINVAL);
    prompts();
    /* bad scope, salt over its bound: nothing created */
    ck_assert_int_eq(app_c(&f, 1, A, 4, NULL, co(2, 0, 0, 35, 0)), KVP_EINVAL);
    char salt[KVP_PAGEKEY_MAX_SALT + 2];
    memset(salt, 'x', sizeof(salt) - 1);
    salt[sizeof(salt) - 1] = 0;
    ck_assert_int_eq(app_c(&f, 1, A, 4, salt, DEF), KVP_EINVAL);
    ck_assert_ptr_null(kvp_seqtab_find(f.t, 0, 1));
    salt[KVP_PAGEKEY_MAX_SALT] = 0; /* exactly the bound is fine */
    ck_assert_int_eq(app_c(&f, 1, A, 4, salt, DEF), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 1, 0)), KVP_PAGE_KEYED);
    /* retention: above the maximum, a sequence without a chain */
    ck_assert_int_eq(kvp_pcache_set_retention(f.c, seq(&f, 1), KVP_PCACHE_MAX_PRIORITY + 1, 0),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_pcache_set_retention(f.c, seq(&f, 1), KVP_PCACHE_MAX_PRIORITY, 0), 0);
    app(&f, 2, NULL, 4);
    ck_assert_int_eq(kvp_pcache_set_retention(f.c, seq(&f, 2), 50, 0), KVP_EINVAL);
    kvp_pcache_scope_stats_t ss;
    ck_assert_int_eq(kvp_pcache_scope_stats(f.c, 2, &ss), KVP_EINVAL);
    ck_assert_uint_eq(kvp_pcache_lookup(f.c, 2, root_of(NULL), A, 4, 1), 0);
    ck_assert_uint_eq(kvp_pcache_next_expiry(f.c), UINT64_MAX);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 2), 0);
    fx_fini(&f);
}
END_TEST

START_TEST(keys_appear_when_pages_fill_and_publish_makes_them_findable)
{
    fx_t f;
    fx_init(&f, 8, 4, 4);
    prompts();
    kvp_pcache_ref_t refs[8];
    app(&f, 1, A, 3);
    uint32_t p0 = pg(&f, 1, 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, p0), 0);
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 1), refs, 8), 0);
    app(&f, 1, A + 3, 1); /* the page fills: keyed, not findable */
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, p0), KVP_PAGE_KEYED);
    kvp_pagekey_t k;
    uint32_t scope = 9;
    ck_assert_int_eq(kvp_pcache_page_key(f.c, p0, &k, &scope), 0);
    ck_assert(kvp_pagekey_eq(k, key_at(NULL, A, 0, 4)));
    ck_assert_uint_eq(scope, 0);
    ck_assert_uint_eq(kvp_pcache_find(f.c, 0, k), UINT32_MAX);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 4), 0);
    ck_assert_uint_eq(stats(&f).indexed_pages, 0);
    fx_audit(&f);
    /* handed out once */
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 1), refs, 8), 1);
    ck_assert_uint_eq(refs[0].page, p0);
    kvp_pcache_ref_t again;
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 1), &again, 1), 0);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, refs, 1), 1);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, p0), KVP_PAGE_KEYED | KVP_PAGE_INDEXED);
    ck_assert_uint_eq(kvp_pcache_find(f.c, 0, k), p0);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, refs, 1), 0); /* already indexed */
    /* findable: 1 full page of 4, 7 tokens; not of 3; not in another scope or salt */
    ck_assert_uint_eq(kvp_pcache_lookup(f.c, 0, root_of(NULL), A, 4, 1), 1);
    ck_assert_uint_eq(kvp_pcache_lookup(f.c, 0, root_of(NULL), A, 7, 1), 1);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 3), 0);
    ck_assert_uint_eq(look(&f, 1, NULL, A, 8), 0);
    ck_assert_uint_eq(look(&f, 0, "s", A, 8), 0);
    ck_assert_uint_eq(look(&f, 0, NULL, B, 8), 0);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.indexed_pages, 1);
    ck_assert_uint_eq(st.cached_pages, 0);
    ck_assert_uint_eq(st.query_tokens, 11);
    ck_assert_uint_eq(st.hit_tokens, 8);
    kvp_pcache_scope_stats_t ss;
    ck_assert_int_eq(kvp_pcache_scope_stats(f.c, 0, &ss), 0);
    ck_assert_uint_eq(ss.indexed_pages, 1);
    ck_assert_uint_eq(ss.query_tokens, 11);
    ck_assert_uint_eq(ss.hit_tokens, 8);
    ck_assert_int_eq(kvp_pcache_scope_stats(f.c, 1, &ss), 0);
    ck_assert_uint_eq(ss.indexed_pages, 0);
    ck_assert_uint_eq(ss.query_tokens, 0);
    /* the second page fills across two appends: keyed with the chained key */
    app(&f, 1, A + 4, 2);
    app(&f, 1, A + 6, 2);
    uint32_t p1 = pg(&f, 1, 1);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, p1), KVP_PAGE_KEYED);
    ck_assert_int_eq(kvp_pcache_page_key(f.c, p1, &k, &scope), 0);
    ck_assert(kvp_pagekey_eq(k, key_at(NULL, A, 1, 4)));
    ck_assert_uint_eq(pub(&f, 1), 1);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 64), 2);
    fx_audit(&f);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    fx_fini(&f);
}
END_TEST

START_TEST(page_size_one_keys_every_token)
{
    fx_t f;
    fx_init(&f, 8, 1, 4);
    prompts();
    app(&f, 1, A, 3);
    kvp_pcache_ref_t refs[4];
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 1), refs, 2), 2);
    ck_assert_uint_eq(refs[0].page, pg(&f, 1, 0));
    ck_assert_uint_eq(refs[1].page, pg(&f, 1, 1));
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 1), refs + 2, 2), 1);
    ck_assert_uint_eq(refs[2].page, pg(&f, 1, 2));
    ck_assert_uint_eq(kvp_pcache_publish(f.c, refs, 3), 3);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 3), 3);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 2), 2);
    /* reuse leaving the last token: floor((3 - 1) / 1) = 2 pages */
    ck_assert_int_eq(app_c(&f, 2, A, 3, NULL, co(0, 1, 1, 35, 0)), 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 2);
    ck_assert_uint_eq(f.p.nnz, 1);
    ck_assert_int_eq(f.p.kv_indices[0], (int)pg(&f, 1, 0));
    ck_assert_int_eq(f.p.kv_indices[1], (int)pg(&f, 1, 1));
    ck_assert_int_ne(f.p.kv_indices[2], (int)pg(&f, 1, 2));
    /* without leave_last: all 3 */
    ck_assert_int_eq(app_c(&f, 3, A, 3, NULL, REUSE), 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 3);
    ck_assert_uint_eq(f.p.nnz, 0);
    ck_assert_uint_eq(f.p.num_new_pages, 0);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, pg(&f, 1, 2)), 2);
    fx_audit(&f);
    for (uint64_t id = 1; id <= 3; id++)
        ck_assert_int_eq(kvp_seqtab_release(f.t, 0, id), 0);
    ck_assert_uint_eq(stats(&f).cached_pages, 3); /* seq 2's own last page was a twin: freed */
    fx_fini(&f);
}
END_TEST

START_TEST(second_page_with_the_same_key_stays_unindexed)
{
    fx_t f;
    fx_init(&f, 8, 4, 4);
    prompts();
    app(&f, 1, A, 4);
    ck_assert_uint_eq(pub(&f, 1), 1);
    app(&f, 2, A, 4); /* no reuse: its own page with the same content */
    uint32_t p = pg(&f, 1, 0), q = pg(&f, 2, 0);
    ck_assert_uint_ne(p, q);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, q), KVP_PAGE_KEYED);
    ck_assert_uint_eq(pub(&f, 2), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, q), KVP_PAGE_KEYED);
    ck_assert_uint_eq(kvp_pcache_find(f.c, 0, key_at(NULL, A, 0, 4)), p);
    /* another scope is another table */
    ck_assert_int_eq(app_c(&f, 3, A, 4, NULL, co(1, 0, 0, 35, 0)), 0);
    ck_assert_uint_eq(pub(&f, 3), 1);
    ck_assert_uint_eq(kvp_pcache_find(f.c, 1, key_at(NULL, A, 0, 4)), pg(&f, 3, 0));
    ck_assert_uint_eq(stats(&f).indexed_pages, 2);
    fx_audit(&f);
    /* the unindexed twin is freed like any page and loses its key */
    uint32_t free_before = kvp_alloc_num_free(f.a);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 2), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, q), 0);
    ck_assert_uint_eq(kvp_alloc_num_free(f.a), free_before + 1);
    ck_assert_uint_eq(stats(&f).cached_pages, 0);
    /* the indexed one is cached */
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, p),
                      KVP_PAGE_KEYED | KVP_PAGE_INDEXED | KVP_PAGE_CACHED);
    ck_assert_uint_eq(stats(&f).cached_pages, 1);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 4), 1);
    uint32_t want[] = {p};
    order_is(&f, want, 1);
    /* and reused from there */
    ck_assert_int_eq(app_c(&f, 4, A, 4, NULL, REUSE), 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 4);
    ck_assert_int_eq(f.p.kv_indices[0], (int)p);
    ck_assert_uint_eq(f.p.nnz, 0);
    ck_assert_uint_eq(stats(&f).cached_pages, 0);
    order_is(&f, want, 0);
    fx_audit(&f);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 3), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 4), 0);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE), 2);
    fx_fini(&f);
}
END_TEST

START_TEST(reuse_links_floor_of_full_pages)
{
    fx_t f;
    fx_init(&f, 32, 4, 4);
    prompts();
    app(&f, 1, A, 10);
    ck_assert_uint_eq(pub(&f, 1), 2);
    uint32_t a0 = pg(&f, 1, 0), a1 = pg(&f, 1, 1), a2 = pg(&f, 1, 2);
    /* 10 tokens: 2 pages linked, 2 tokens appended */
    ck_assert_int_eq(app_c(&f, 2, A, 10, NULL, REUSE), 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 8);
    ck_assert_uint_eq(f.p.num_cached_tokens, 8);
    ck_assert_uint_eq(f.p.nnz, 2);
    ck_assert_int_eq(f.p.append_indptr[0], 0);
    ck_assert_int_eq(f.p.append_indptr[1], 2);
    ck_assert_int_eq(f.p.kv_indptr[1], 3);
    ck_assert_int_eq(f.p.kv_indices[0], (int)a0);
    ck_assert_int_eq(f.p.kv_indices[1], (int)a1);
    ck_assert_int_ne(f.p.kv_indices[2], (int)a2);
    ck_assert_int_eq(f.p.kv_last_page_len[0], 2);
    ck_assert_int_eq(f.p.seq_lens[0], 10);
    ck_assert_uint_eq(f.p.num_new_pages, 1);
    ck_assert_uint_eq(f.p.num_copies, 0);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a0), 2);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a1), 2);
    kvp_pcache_ref_t refs[4];
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 2), refs, 4), 0);
    /* leave_last with 8 tokens: floor(7 / 4) = 1 */
    ck_assert_int_eq(app_c(&f, 3, A, 8, NULL, co(0, 1, 1, 35, 0)), 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 4);
    ck_assert_uint_eq(f.p.nnz, 4);
    ck_assert_int_eq(f.p.kv_indices[0], (int)a0);
    ck_assert_int_ne(f.p.kv_indices[1], (int)a1);
    /* without: both, nothing appended */
    ck_assert_int_eq(app_c(&f, 4, A, 8, NULL, REUSE), 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 8);
    ck_assert_uint_eq(f.p.nnz, 0);
    ck_assert_uint_eq(f.p.num_new_pages, 0);
    ck_assert_int_eq(f.p.kv_indptr[1], 2);
    ck_assert_int_eq(f.p.kv_last_page_len[0], 4);
    ck_assert_int_eq(f.p.seq_lens[0], 8);
    /* diverging in the second page: 1 */
    int32_t U[10];
    memcpy(U, A, sizeof(U));
    U[5] = 9999;
    ck_assert_int_eq(app_c(&f, 5, U, 10, NULL, REUSE), 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 4);
    ck_assert_uint_eq(f.p.nnz, 6);
    /* another scope, another salt: nothing */
    ck_assert_int_eq(app_c(&f, 6, A, 10, NULL, co(1, 1, 0, 35, 0)), 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 0);
    ck_assert_uint_eq(f.p.nnz, 10);
    ck_assert_int_eq(app_c(&f, 7, A, 10, "salt", REUSE), 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 0);
    ck_assert_uint_eq(f.p.nnz, 10);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.query_tokens, 10 + 8 + 8 + 10 + 10 + 10);
    ck_assert_uint_eq(st.hit_tokens, 8 + 4 + 8 + 4);
    kvp_pcache_scope_stats_t ss;
    ck_assert_int_eq(kvp_pcache_scope_stats(f.c, 0, &ss), 0);
    ck_assert_uint_eq(ss.query_tokens, 46);
    ck_assert_uint_eq(ss.hit_tokens, 24);
    ck_assert_int_eq(kvp_pcache_scope_stats(f.c, 1, &ss), 0);
    ck_assert_uint_eq(ss.query_tokens, 10);
    ck_assert_uint_eq(ss.hit_tokens, 0);
    /* a reusing sequence continues the chain from the linked pages */
    app(&f, 2, A + 10, 2);
    uint32_t x = pg(&f, 2, 2);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, x), KVP_PAGE_KEYED);
    kvp_pagekey_t k;
    uint32_t scope;
    ck_assert_int_eq(kvp_pcache_page_key(f.c, x, &k, &scope), 0);
    ck_assert(kvp_pagekey_eq(k, key_at(NULL, A, 2, 4)));
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 2), refs, 4), 1);
    ck_assert_uint_eq(refs[0].page, x);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, refs, 1), 1);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 12), 3);
    /* two items of one batch reuse the same prefix: both link it */
    kvp_plan_item_t it[2] = {{0, 8, 12}, {0, 9, 9}};
    kvp_plan_content_t ct[2] = {{A, NULL, 0}, {A, NULL, 0}};
    kvp_plan_cache_t cc = REUSE;
    ck_assert_int_eq(kvp_plan_append_cached(f.t, it, ct, 2, NULL, &cc, 0, &f.p), 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 12);
    ck_assert_uint_eq(f.p.cached_tokens[1], 8);
    ck_assert_uint_eq(f.p.num_cached_tokens, 20);
    ck_assert_int_eq(f.p.append_indptr[1], 0);
    ck_assert_int_eq(f.p.append_indptr[2], 1);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a0), 7);
    fx_audit(&f);
    for (uint64_t id = 1; id <= 9; id++)
        ck_assert_int_eq(kvp_seqtab_release(f.t, 0, id), 0);
    kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE);
    fx_fini(&f);
}
END_TEST

START_TEST(release_caches_and_pressure_evicts_in_order)
{
    fx_t f;
    fx_init(&f, 6, 4, 4);
    prompts();
    app(&f, 1, A, 8);
    app(&f, 2, B, 8);
    ck_assert_int_eq(app_c(&f, 3, C, 4, NULL, co(0, 0, 0, 50, 0)), 0);
    ck_assert_int_eq(app_c(&f, 4, D, 4, NULL, co(0, 0, 0, 10, 0)), 0);
    for (uint64_t id = 1; id <= 4; id++)
        pub(&f, id);
    uint32_t a0 = pg(&f, 1, 0), a1 = pg(&f, 1, 1), b0 = pg(&f, 2, 0), b1 = pg(&f, 2, 1);
    uint32_t c0 = pg(&f, 3, 0), d0 = pg(&f, 4, 0);
    ck_assert_uint_eq(stats(&f).indexed_pages, 6);
    kvp_pcache_set_now(f.c, 100);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 3), 0);
    kvp_pcache_set_now(f.c, 110);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    kvp_pcache_set_now(f.c, 120);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 2), 0);
    kvp_pcache_set_now(f.c, 130);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 4), 0);
    /* lowest priority first, then release order, deepest page of a chain first */
    uint32_t want[] = {d0, a1, a0, b1, b0, c0};
    order_is(&f, want, 6);
    ck_assert_uint_eq(stats(&f).cached_pages, 6);
    fx_audit(&f);
    /* pressure: no free page; one page evicts d0 */
    f.now = 200;
    app(&f, 5, NULL, 4);
    ck_assert_uint_eq(f.p.num_evicted, 1);
    ck_assert_int_eq(f.p.kv_indices[0], (int)d0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, d0), 0);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_PRESSURE], 1);
    ck_assert_uint_eq(st.residence_sum_ms, 70);
    ck_assert_uint_eq(st.cached_pages, 5);
    ck_assert_uint_eq(st.indexed_pages, 5);
    uint32_t bucket = 0;
    while (bucket < KVP_PCACHE_RESIDENCE_BUCKETS && 70 > kvp_pcache_residence_le_ms[bucket])
        bucket++;
    ck_assert_uint_eq(st.residence[bucket], 1);
    ck_assert_uint_eq(look(&f, 0, NULL, D, 4), 0);
    order_is(&f, want + 1, 5);
    /* two more: a's chain, deepest first */
    f.now = 300;
    app(&f, 6, NULL, 8);
    ck_assert_uint_eq(f.p.num_evicted, 2);
    ck_assert(row_has(&f.p, 0, a0) && row_has(&f.p, 0, a1));
    st = stats(&f);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_PRESSURE], 3);
    ck_assert_uint_eq(st.residence_sum_ms, 70 + 2 * 190);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 8), 0);
    ck_assert_uint_eq(look(&f, 0, NULL, B, 8), 2);
    order_is(&f, want + 3, 3);
    /* a partial eviction of a chain leaves its root findable */
    app(&f, 7, NULL, 1);
    ck_assert_int_eq(f.p.kv_indices[0], (int)b1);
    ck_assert_uint_eq(look(&f, 0, NULL, B, 8), 1);
    fx_audit(&f);
    for (uint64_t id = 5; id <= 7; id++)
        ck_assert_int_eq(kvp_seqtab_release(f.t, 0, id), 0);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, 0), 2);
    fx_fini(&f);
}
END_TEST

START_TEST(retention_duration_demotes_to_the_default_priority)
{
    fx_t f;
    fx_init(&f, 4, 4, 4);
    prompts();
    ck_assert_int_eq(app_c(&f, 1, A, 4, NULL, co(0, 0, 0, 80, 100)), 0);
    ck_assert_int_eq(app_c(&f, 2, B, 4, NULL, co(0, 0, 0, 80, 100)), 0);
    ck_assert_int_eq(app_c(&f, 3, C, 4, NULL, co(0, 0, 0, 50, 0)), 0);
    ck_assert_int_eq(app_c(&f, 4, D, 4, NULL, DEF), 0);
    for (uint64_t id = 1; id <= 4; id++)
        ck_assert_uint_eq(pub(&f, id), 1);
    uint32_t a0 = pg(&f, 1, 0), b0 = pg(&f, 2, 0), c0 = pg(&f, 3, 0), d0 = pg(&f, 4, 0);
    ck_assert_uint_lt(a0, b0);
    kvp_pcache_set_now(f.c, 1000);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 2), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 3), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 4), 0);
    uint32_t w1[] = {d0, c0, b0, a0};
    order_is(&f, w1, 4);
    ck_assert_uint_eq(kvp_pcache_expire(f.c, 1099), 0);
    order_is(&f, w1, 4);
    /* both end at 1100: to the tail of 35, by expiry, then in release order */
    ck_assert_uint_eq(kvp_pcache_expire(f.c, 1100), 0);
    uint32_t w2[] = {d0, b0, a0, c0};
    order_is(&f, w2, 4);
    fx_audit(&f);
    /* retention that ends is applied before an eviction too */
    f.now = 1200;
    ck_assert_int_eq(app_c(&f, 5, E, 4, NULL, co(0, 0, 0, 90, 10)), 0);
    ck_assert_int_eq(f.p.kv_indices[0], (int)d0);
    ck_assert_uint_eq(pub(&f, 5), 1);
    uint32_t e0 = d0;
    kvp_pcache_set_now(f.c, 1200);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 5), 0);
    uint32_t w3[] = {b0, a0, c0, e0};
    order_is(&f, w3, 4);
    f.now = 1210;
    app(&f, 6, NULL, 12); /* e0 goes to 35 first: b0, a0, e0 go; c0 (50) stays */
    ck_assert_uint_eq(f.p.num_evicted, 3);
    ck_assert(row_has(&f.p, 0, a0) && row_has(&f.p, 0, b0) && row_has(&f.p, 0, e0));
    uint32_t w4[] = {c0};
    order_is(&f, w4, 1);
    ck_assert_uint_eq(look(&f, 0, NULL, C, 4), 1);
    ck_assert_uint_eq(look(&f, 0, NULL, E, 4), 0);
    fx_audit(&f);
    /* a page keeps the highest priority of its holders: c0 (50) linked at 20 stays 50 */
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 6), 0);
    ck_assert_int_eq(app_c(&f, 7, C, 4, NULL, co(0, 1, 0, 20, 0)), 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 4);
    ck_assert_int_eq(app_c(&f, 8, D, 4, NULL, co(0, 0, 0, 40, 0)), 0);
    ck_assert_uint_eq(pub(&f, 8), 1);
    uint32_t dd = pg(&f, 8, 0);
    kvp_pcache_set_now(f.c, 1300);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 7), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 8), 0);
    uint32_t w5[] = {dd, c0};
    order_is(&f, w5, 2);
    /* and set_retention raises it: D at 60 through a reusing sequence */
    ck_assert_int_eq(app_c(&f, 9, D, 4, NULL, co(0, 1, 0, 10, 0)), 0);
    ck_assert_int_eq(kvp_pcache_set_retention(f.c, seq(&f, 9), 60, 0), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 9), 0);
    uint32_t w6[] = {c0, dd};
    order_is(&f, w6, 2);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE), 2);
    fx_fini(&f);
}
END_TEST

START_TEST(pins_hold_pages_within_quota)
{
    fx_t f;
    fx_init(&f, 5, 4, 2);
    prompts();
    app(&f, 1, A, 12);
    ck_assert_uint_eq(pub(&f, 1), 3);
    uint32_t a0 = pg(&f, 1, 0), a1 = pg(&f, 1, 1), a2 = pg(&f, 1, 2);
    kvp_pagekey_t r0 = root_of(NULL);
    uint64_t id1 = 0, id2 = 0, id3 = 0;
    uint32_t n = 0;
    ck_assert_int_eq(kvp_pcache_pin(f.c, 0, 0, r0, A, 12, 100, 50, &id1, &n), 0);
    ck_assert_uint_ne(id1, 0);
    ck_assert_uint_eq(n, 3);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.pins, 1);
    ck_assert_uint_eq(st.pinned_pages, 3);
    ck_assert_uint_eq(kvp_pcache_ns_pinned_pages(f.c, 0), 3);
    ck_assert_uint_eq(kvp_pcache_ns_pins(f.c, 0), 1);
    ck_assert_uint_eq(kvp_pcache_next_expiry(f.c), 150);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a0), 2);
    /* release: held by the pin, not cached */
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    ck_assert_uint_eq(stats(&f).cached_pages, 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a2), KVP_PAGE_KEYED | KVP_PAGE_INDEXED);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a2), 1);
    /* pressure cannot take them */
    app(&f, 2, NULL, 8);
    ck_assert_int_eq(app_c(&f, 3, NULL, 1, NULL, DEF), KVP_ENOSPC);
    ck_assert_ptr_null(kvp_seqtab_find(f.t, 0, 3));
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 2), 0);
    fx_audit(&f);
    /* quota: 0 forbids; 1 allows a one-page pin, not a two-page one; nothing changes */
    ck_assert_int_eq(kvp_pcache_set_pin_quota(f.c, 1, 0), 0);
    ck_assert_int_eq(kvp_pcache_pin(f.c, 1, 0, r0, A, 4, 100, 1000, &id2, &n), KVP_ELIMIT);
    ck_assert_int_eq(kvp_pcache_set_pin_quota(f.c, 1, 1), 0);
    ck_assert_int_eq(kvp_pcache_pin(f.c, 1, 0, r0, A, 8, 100, 1000, &id2, &n), KVP_ELIMIT);
    st = stats(&f);
    ck_assert_uint_eq(st.pins, 1);
    ck_assert_uint_eq(st.pinned_pages, 3);
    ck_assert_uint_eq(kvp_pcache_ns_pinned_pages(f.c, 1), 0);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a0), 1);
    ck_assert_int_eq(kvp_pcache_pin(f.c, 1, 0, r0, A, 7, 100, 1000, &id2, &n), 0);
    ck_assert_uint_eq(n, 1);
    ck_assert_uint_ne(id2, id1);
    st = stats(&f);
    ck_assert_uint_eq(st.pins, 2);
    ck_assert_uint_eq(st.pinned_pages, 3); /* distinct pages */
    ck_assert_uint_eq(kvp_pcache_ns_pinned_pages(f.c, 1), 1);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a0), 2);
    /* max_pins 2 */
    ck_assert_int_eq(kvp_pcache_pin(f.c, 0, 0, r0, A, 4, 100, 1000, &id3, &n), KVP_ELIMIT);
    /* nothing findable, bad scope, bad ns */
    ck_assert_int_eq(kvp_pcache_unpin(f.c, 1, id2), 1);
    ck_assert_int_eq(kvp_pcache_pin(f.c, 0, 0, r0, B, 8, 100, 1000, &id3, &n), KVP_ENOENT);
    ck_assert_int_eq(kvp_pcache_pin(f.c, 0, 1, r0, A, 8, 100, 1000, &id3, &n), KVP_ENOENT);
    ck_assert_int_eq(kvp_pcache_pin(f.c, 0, 2, r0, A, 8, 100, 1000, &id3, &n), KVP_EINVAL);
    ck_assert_int_eq(kvp_pcache_pin(f.c, 4, 0, r0, A, 8, 100, 1000, &id3, &n), KVP_EINVAL);
    ck_assert_int_eq(kvp_pcache_unpin(f.c, 1, id2), KVP_ENOENT);
    ck_assert_int_eq(kvp_pcache_unpin(f.c, 1, id1), KVP_ENOENT); /* ns 0's */
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a0), 1);
    fx_audit(&f);
    /* expiry: the pin's last page first */
    ck_assert_uint_eq(kvp_pcache_expire(f.c, 149), 0);
    ck_assert_uint_eq(stats(&f).pins, 1);
    ck_assert_uint_eq(kvp_pcache_expire(f.c, 150), 1);
    st = stats(&f);
    ck_assert_uint_eq(st.pins, 0);
    ck_assert_uint_eq(st.pinned_pages, 0);
    ck_assert_uint_eq(st.cached_pages, 3);
    ck_assert_uint_eq(kvp_pcache_next_expiry(f.c), UINT64_MAX);
    ck_assert_uint_eq(kvp_pcache_ns_pinned_pages(f.c, 0), 0);
    uint32_t w1[] = {a2, a1, a0};
    order_is(&f, w1, 3);
    /* a pin takes cached pages out of the order */
    ck_assert_int_eq(kvp_pcache_pin(f.c, 0, 0, r0, A, 8, 200, 1000, &id3, &n), 0);
    ck_assert_uint_eq(n, 2);
    order_is(&f, w1, 1);
    ck_assert_uint_eq(stats(&f).cached_pages, 1);
    kvp_pcache_pin_info_t pi;
    uint32_t cur = 0;
    ck_assert_int_eq(kvp_pcache_next_pin(f.c, &cur, &pi), 0);
    ck_assert_uint_eq(pi.pin_id, id3);
    ck_assert_uint_eq(pi.pages, 2);
    ck_assert_uint_eq(pi.expires_ms, 1200);
    ck_assert_int_eq(kvp_pcache_next_pin(f.c, &cur, &pi), KVP_ENOENT);
    f.now = 300;
    app(&f, 4, NULL, 12); /* 2 free + a2 */
    ck_assert_uint_eq(f.p.num_evicted, 1);
    ck_assert(row_has(&f.p, 0, a2));
    ck_assert_int_eq(app_c(&f, 5, NULL, 1, NULL, DEF), KVP_ENOSPC);
    ck_assert_int_eq(kvp_pcache_unpin(f.c, 0, id3), 2);
    uint32_t w2[] = {a1, a0};
    order_is(&f, w2, 2);
    fx_audit(&f);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 4), 0);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, 0), 2);
    fx_fini(&f);
}
END_TEST

START_TEST(flush_drops_cached_pages_of_one_scope)
{
    fx_t f;
    fx_init(&f, 8, 4, 4);
    prompts();
    app(&f, 1, A, 8);
    ck_assert_int_eq(app_c(&f, 2, A, 8, NULL, co(1, 0, 0, 35, 0)), 0);
    app(&f, 3, B, 4);
    ck_assert_uint_eq(pub(&f, 1) + pub(&f, 2) + pub(&f, 3), 5);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 2), 0);
    ck_assert_uint_eq(stats(&f).cached_pages, 4);
    uint32_t free_before = kvp_alloc_num_free(f.a);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, 0), 2);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_FLUSH], 2);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_PRESSURE], 0);
    ck_assert_uint_eq(st.cached_pages, 2);
    ck_assert_uint_eq(st.indexed_pages, 3);
    ck_assert_uint_eq(kvp_alloc_num_free(f.a), free_before + 2);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 8), 0);
    ck_assert_uint_eq(look(&f, 1, NULL, A, 8), 2);
    ck_assert_uint_eq(look(&f, 0, NULL, B, 4), 1); /* held: stays */
    kvp_pcache_scope_stats_t ss;
    ck_assert_int_eq(kvp_pcache_scope_stats(f.c, 0, &ss), 0);
    ck_assert_uint_eq(ss.indexed_pages, 1);
    ck_assert_uint_eq(ss.cached_pages, 0);
    ck_assert_int_eq(kvp_pcache_scope_stats(f.c, 1, &ss), 0);
    ck_assert_uint_eq(ss.indexed_pages, 2);
    ck_assert_uint_eq(ss.cached_pages, 2);
    fx_audit(&f);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE), 2);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE), 0);
    ck_assert_uint_eq(stats(&f).evictions[KVP_EVICT_FLUSH], 4);
    ck_assert_uint_eq(look(&f, 1, NULL, A, 8), 0);
    ck_assert_uint_eq(look(&f, 0, NULL, B, 4), 1);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 3), 0);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, 0), 1);
    fx_fini(&f);
}
END_TEST

static kvp_pagekey_t page_key(const fx_t *f, uint32_t page)
{
    kvp_pagekey_t k = {0, 0};
    uint32_t scope;
    ck_assert_int_eq(kvp_pcache_page_key(f->c, page, &k, &scope), 0);
    return k;
}

START_TEST(truncate_rewrites_or_keeps_and_continues_or_ends_the_chain)
{
    fx_t f;
    fx_init(&f, 40, 4, 4);
    prompts();
    int32_t X[8];
    for (int i = 0; i < 8; i++)
        X[i] = A[i] < 104 ? A[i] : 7000 + i;
    /* sole holder: the page loses its key (rewrite), the chain continues (last full page) */
    app(&f, 1, A, 8);
    ck_assert_uint_eq(pub(&f, 1), 2);
    uint32_t a0 = pg(&f, 1, 0), a1 = pg(&f, 1, 1);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 1, 6, 0), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a1), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a0), KVP_PAGE_KEYED | KVP_PAGE_INDEXED);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_REWRITE], 1);
    ck_assert_uint_eq(st.indexed_pages, 1);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 8), 1);
    fx_audit(&f);
    app(&f, 1, A + 6, 2);
    ck_assert_uint_eq(pg(&f, 1, 1), a1);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a1), KVP_PAGE_KEYED);
    ck_assert(kvp_pagekey_eq(page_key(&f, a1), key_at(NULL, A, 1, 4)));
    kvp_pcache_ref_t refs[4];
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 1), refs, 4), 1);
    ck_assert_uint_eq(refs[0].page, a1);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, refs, 1), 1);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 8), 2);

    /* shared: kept as it is; the next append copies it, and the copy is keyed */
    ck_assert_int_eq(kvp_seqtab_fork(f.t, 0, 1, 2, 0), 0);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 2, 6, 0), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a1), KVP_PAGE_KEYED | KVP_PAGE_INDEXED);
    ck_assert_uint_eq(stats(&f).evictions[KVP_EVICT_REWRITE], 1);
    app(&f, 2, X + 6, 2);
    ck_assert_uint_eq(f.p.num_copies, 1);
    ck_assert_uint_eq(f.p.copies[0].src, a1);
    uint32_t n2 = pg(&f, 2, 1);
    ck_assert_uint_eq(f.p.copies[0].dst, n2);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, n2), KVP_PAGE_KEYED);
    int32_t AX[8];
    memcpy(AX, A, 6 * sizeof(int32_t));
    AX[6] = X[6];
    AX[7] = X[7];
    ck_assert(kvp_pagekey_eq(page_key(&f, n2), key_at(NULL, AX, 1, 4)));
    ck_assert_uint_eq(pub(&f, 2), 1);
    /* the same tokens again: a twin of a1, not indexed */
    ck_assert_int_eq(kvp_seqtab_fork(f.t, 0, 1, 3, 0), 0);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 3, 6, 0), 0);
    app(&f, 3, A + 6, 2);
    ck_assert_uint_eq(f.p.num_copies, 1);
    ck_assert(kvp_pagekey_eq(page_key(&f, pg(&f, 3, 1)), key_at(NULL, A, 1, 4)));
    ck_assert_uint_eq(pub(&f, 3), 0);
    fx_audit(&f);

    /* into a page that was not the last full one: the chain ends */
    app(&f, 4, B, 12);
    ck_assert_uint_eq(pub(&f, 4), 3);
    uint32_t b1 = pg(&f, 4, 1), b2 = pg(&f, 4, 2);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 4, 6, 0), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, b1), 0);
    ck_assert_uint_eq(stats(&f).evictions[KVP_EVICT_REWRITE], 2);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, b2),
                      KVP_PAGE_KEYED | KVP_PAGE_INDEXED | KVP_PAGE_CACHED);
    app(&f, 4, B + 6, 6);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 4, 1)), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 4, 2)), 0);
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 4), refs, 4), 0);
    ck_assert_uint_eq(look(&f, 0, NULL, B, 12), 1);

    /* to a page boundary: continues */
    app(&f, 5, C, 12);
    ck_assert_uint_eq(pub(&f, 5), 3);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 5, 4, 0), 0);
    ck_assert_uint_eq(stats(&f).evictions[KVP_EVICT_REWRITE], 2);
    ck_assert_uint_eq(stats(&f).cached_pages, 3); /* b2 and the two dropped pages */
    app(&f, 5, D, 4);
    int32_t CD[8];
    memcpy(CD, C, 16);
    memcpy(CD + 4, D, 16);
    ck_assert(kvp_pagekey_eq(page_key(&f, pg(&f, 5, 1)), key_at(NULL, CD, 1, 4)));
    ck_assert_uint_eq(pub(&f, 5), 1);

    /* within the partial last page: continues */
    app(&f, 6, E, 10);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 6, 9, 0), 0);
    app(&f, 6, E + 9, 3);
    ck_assert(kvp_pagekey_eq(page_key(&f, pg(&f, 6, 2)), key_at(NULL, E, 2, 4)));
    /* within the last full page with a partial page after it: continues */
    app(&f, 7, E, 10);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 7, 6, 0), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 7, 1)), 0);
    app(&f, 7, E + 6, 2);
    ck_assert(kvp_pagekey_eq(page_key(&f, pg(&f, 7, 1)), key_at(NULL, E, 1, 4)));
    /* to 0: the next append with token ids starts a new chain, in its own scope and salt */
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 7, 0, 0), 0);
    ck_assert_int_eq(app_c(&f, 7, A, 4, "s", co(1, 0, 0, 35, 0)), 0);
    uint32_t scope = 0;
    kvp_pagekey_t k;
    ck_assert_int_eq(kvp_pcache_page_key(f.c, pg(&f, 7, 0), &k, &scope), 0);
    ck_assert_uint_eq(scope, 1);
    ck_assert(kvp_pagekey_eq(k, key_at("s", A, 0, 4)));
    fx_audit(&f);
    for (uint64_t id = 1; id <= 7; id++)
        ck_assert_int_eq(kvp_seqtab_release(f.t, 0, id), 0);
    kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE);
    fx_fini(&f);
}
END_TEST

START_TEST(append_without_token_ids_ends_the_chain)
{
    fx_t f;
    fx_init(&f, 16, 4, 4);
    prompts();
    app(&f, 1, A, 4);
    ck_assert_uint_eq(pub(&f, 1), 1);
    app(&f, 1, NULL, 4);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 1, 1)), 0);
    app(&f, 1, A + 8, 4);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 1, 2)), 0);
    ck_assert_uint_eq(pub(&f, 1), 0);
    /* started without: never gets one */
    app(&f, 2, NULL, 4);
    app(&f, 2, B + 4, 4);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 2, 0)), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 2, 1)), 0);
    /* content NULL for the whole call: same */
    kvp_plan_item_t it = {0, 3, 4};
    kvp_plan_cache_t c = DEF;
    ck_assert_int_eq(kvp_plan_append_cached(f.t, &it, NULL, 1, NULL, &c, 0, &f.p), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 3, 0)), 0);
    /* zero tokens without ids: no change */
    app(&f, 4, C, 2);
    app(&f, 4, NULL, 0);
    app(&f, 4, C + 2, 2);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 4, 0)), KVP_PAGE_KEYED);
    /* created empty, then token ids: a chain starts */
    app(&f, 5, NULL, 0);
    app(&f, 5, D, 4);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 5, 0)), KVP_PAGE_KEYED);
    fx_audit(&f);
    for (uint64_t id = 1; id <= 5; id++)
        ck_assert_int_eq(kvp_seqtab_release(f.t, 0, id), 0);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE), 1);
    fx_fini(&f);
}
END_TEST

/* Issue #26 defect 1: a keyed page a truncate left as the partial tail of sequences that shared
 * it. While another holder remains, an append copies it (the indexed page keeps its content and
 * stays findable); its last holder takes its key away and writes in place. The plan used to copy
 * it for the last holder too and drop that holder's reference, so the copy's source was cached
 * (or free) before the copy ran: the daemon's Append then aborted pinning it, and a Reserve
 * handed out a copy whose source another Reserve could be given. */
START_TEST(a_keyed_partial_page_is_copied_while_shared_and_rewritten_by_its_last_holder)
{
    fx_t f;
    fx_init(&f, 16, 4, 4);
    prompts();
    app(&f, 1, A, 8);
    ck_assert_uint_eq(pub(&f, 1), 2);
    uint32_t a1 = pg(&f, 1, 1);
    ck_assert_int_eq(kvp_seqtab_fork(f.t, 0, 1, 2, 0), 0);
    ck_assert_int_eq(kvp_seqtab_fork(f.t, 0, 1, 3, 0), 0);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 2, 6, 0), 0);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 3, 6, 0), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a1), 2);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a1), KVP_PAGE_KEYED | KVP_PAGE_INDEXED);
    /* seq 2 shares a1 with seq 3: it copies, a1 stays indexed with A's content */
    int32_t X[2] = {7006, 7007};
    app(&f, 2, X, 2);
    ck_assert_uint_eq(f.p.num_copies, 1);
    ck_assert_uint_eq(f.p.copies[0].src, a1);
    uint32_t n = pg(&f, 2, 1);
    ck_assert_uint_ne(n, a1);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a1), 1); /* seq 3 holds the source */
    int32_t AX[8];
    memcpy(AX, A, 6 * sizeof(int32_t));
    AX[6] = X[0];
    AX[7] = X[1];
    ck_assert(kvp_pagekey_eq(page_key(&f, n), key_at(NULL, AX, 1, 4)));
    ck_assert(kvp_pagekey_eq(page_key(&f, a1), key_at(NULL, A, 1, 4)));
    ck_assert_uint_eq(look(&f, 0, NULL, A, 8), 2);
    fx_audit(&f);
    /* seq 3 is a1's last holder: no copy, a1 loses its key (a rewrite) and is written in place */
    const uint64_t rewrites = stats(&f).evictions[KVP_EVICT_REWRITE];
    app(&f, 3, X, 1);
    ck_assert_uint_eq(f.p.num_copies, 0);
    ck_assert_uint_eq(pg(&f, 3, 1), a1);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a1), 1);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a1), 0);
    ck_assert_uint_eq(stats(&f).evictions[KVP_EVICT_REWRITE], rewrites + 1);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 8), 1);
    fx_audit(&f);
    /* the page is seq 3's alone: a full page of it keys anew */
    app(&f, 3, X + 1, 1);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a1), KVP_PAGE_KEYED);
    fx_audit(&f);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 2), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 3), 0);
    kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE);
    fx_fini(&f);
}
END_TEST

/* Issue #26 defect 2: a daemon-run Append publishes, when its copy completes, exactly the pages
 * its plan filled (taken right after the plan), not whatever the sequence holds by then: not the
 * pages a Reserve on the same sequence keyed meanwhile, nor those of a new sequence under the id
 * after a release; and not a page whose earlier rows a worker wrote (Reserve). */
START_TEST(an_append_publishes_exactly_the_pages_it_wrote)
{
    fx_t f;
    fx_init(&f, 32, 4, 4);
    prompts();
    kvp_plan_cache_t daemon = DEF;
    daemon.daemon_writes = 1;
    /* seq 5: the job's 8 tokens, then a Reserve of 4 more while the copy runs */
    ck_assert_int_eq(app_c(&f, 5, A, 8, NULL, daemon), 0);
    ck_assert_uint_eq(f.p.publish_from[0], 0);
    kvp_pcache_ref_t job[8], more[8];
    ck_assert_uint_eq(kvp_pcache_take_written(f.c, seq(&f, 5), 0, job, 8), 2);
    app(&f, 5, A + 8, 4);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, job, 2), 2);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 12), 2); /* not the Reserve's third page */
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 5), more, 8), 1); /* its Commit */
    ck_assert_uint_eq(more[0].page, pg(&f, 5, 2));
    /* seq 6: released and reserved again under the same id while the copy runs */
    ck_assert_int_eq(app_c(&f, 6, B, 8, NULL, daemon), 0);
    ck_assert_uint_eq(kvp_pcache_take_written(f.c, seq(&f, 6), 0, job, 8), 2);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 6), 0);
    app(&f, 6, C, 8);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, job, 2), 0);
    ck_assert_uint_eq(look(&f, 0, NULL, C, 8), 0);
    ck_assert_uint_eq(look(&f, 0, NULL, B, 8), 0);
    /* seq 7: a Reserve wrote 2 rows of page 1; the Append that fills it did not write it all */
    app(&f, 7, D, 6);
    ck_assert_int_eq(app_c(&f, 7, D + 6, 6, NULL, daemon), 0);
    ck_assert_uint_eq(f.p.publish_from[0], 2);
    ck_assert_uint_eq(kvp_pcache_take_written(f.c, seq(&f, 7), 2, job, 8), 1);
    ck_assert_uint_eq(job[0].page, pg(&f, 7, 2));
    /* the page before waits for the worker's Commit: it takes both, the job publishes its own */
    ck_assert_uint_eq(kvp_pcache_publish(f.c, job, 1), 1);
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 7), more, 8), 3);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, more, 3), 2);
    ck_assert_uint_eq(look(&f, 0, NULL, D, 12), 3);
    /* a daemon copy still pinning a page holds its publication back */
    app(&f, 8, E, 4);
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 8), more, 8), 1);
    kvp_alloc_pin(f.a, more[0].page);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, more, 1), 0);
    kvp_alloc_unpin(f.a, more[0].page);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, more, 1), 1);
    fx_audit(&f);
    for (uint64_t id = 5; id <= 8; id++)
        ck_assert_int_eq(kvp_seqtab_release(f.t, 0, id), 0);
    kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE);
    fx_fini(&f);
}
END_TEST

START_TEST(the_chain_remembers_the_tokens_of_one_full_page)
{
    fx_t f;
    fx_init(&f, 24, 4, 4);
    prompts();
    /* 12, truncated to 9 (within the last full page: continues), then to 6 (within the page
     * before, whose token ids the chain no longer holds: the chain ends) */
    app(&f, 1, E, 12);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 1, 9, 0), 0);
    app(&f, 1, E + 9, 3);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 1, 2)), KVP_PAGE_KEYED);
    ck_assert(kvp_pagekey_eq(page_key(&f, pg(&f, 1, 2)), key_at(NULL, E, 2, 4)));
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 1, 9, 0), 0);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 1, 6, 0), 0);
    app(&f, 1, E + 6, 2);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 1, 1)), 0);
    /* 12, truncated to 8 (a page boundary: the tokens held are those of page 2, gone), then
     * to 6: ends */
    app(&f, 2, E, 12);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 2, 8, 0), 0);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 2, 6, 0), 0);
    app(&f, 2, E + 6, 2);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 2, 1)), 0);
    /* the last full page was linked by reuse: its tokens are the request's, so a truncate
     * into it continues (and it is shared, so it is copied) */
    app(&f, 3, C, 8);
    ck_assert_uint_eq(pub(&f, 3), 2);
    ck_assert_int_eq(app_c(&f, 4, C, 10, NULL, REUSE), 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 8);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 4, 6, 0), 0);
    app(&f, 4, C + 6, 2);
    ck_assert_uint_eq(f.p.num_copies, 1);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 4, 1)), KVP_PAGE_KEYED);
    ck_assert(kvp_pagekey_eq(page_key(&f, pg(&f, 4, 1)), key_at(NULL, C, 1, 4)));
    fx_audit(&f);
    for (uint64_t id = 1; id <= 4; id++)
        ck_assert_int_eq(kvp_seqtab_release(f.t, 0, id), 0);
    kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE);
    fx_fini(&f);
}
END_TEST

/* A scope id is reset (before another scope gets it) only when nothing of the scope can be
 * published later: no indexed page, no keyed page waiting for its commit, no live chain. */
START_TEST(a_scope_is_reset_only_when_nothing_of_it_lives_on)
{
    fx_t f;
    fx_init(&f, 8, 4, 4);
    prompts();
    ck_assert_int_eq(app_c(&f, 1, A, 4, NULL, co(1, 0, 0, 35, 0)), 0);
    kvp_pcache_ref_t ref;
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 1), &ref, 1), 1);
    ck_assert_int_eq(kvp_pcache_scope_reset(f.c, 1), KVP_EBUSY); /* a keyed page waits */
    ck_assert_uint_eq(kvp_pcache_publish(f.c, &ref, 1), 1);
    ck_assert_int_eq(kvp_pcache_scope_reset(f.c, 1), KVP_EBUSY); /* indexed */
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 1, 2, 0), 0);   /* sole holder: unindexed */
    ck_assert_int_eq(kvp_pcache_scope_reset(f.c, 1), KVP_EBUSY); /* the chain keys on */
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    ck_assert_uint_eq(look(&f, 1, NULL, A, 4), 0);
    ck_assert_int_eq(kvp_pcache_scope_reset(f.c, 1), 0);
    ck_assert_int_eq(kvp_pcache_scope_reset(f.c, 2), KVP_EINVAL);
    fx_fini(&f);
}
END_TEST

START_TEST(flushed_pages_stay_out_of_the_residence_histogram)
{
    /* the histogram is of pages memory pressure took (semantics 6); flush is the operator's */
    fx_t f;
    fx_init(&f, 8, 4, 4);
    prompts();
    app(&f, 1, A, 8);
    ck_assert_uint_eq(pub(&f, 1), 2);
    kvp_pcache_set_now(f.c, 100);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    kvp_pcache_set_now(f.c, 150);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, 0), 2);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_FLUSH], 2);
    ck_assert_uint_eq(st.residence_sum_ms, 0);
    for (int i = 0; i <= KVP_PCACHE_RESIDENCE_BUCKETS; i++)
        ck_assert_uint_eq(st.residence[i], 0);
    fx_fini(&f);
}
END_TEST

START_TEST(destroy_forgets_keys_and_returns_cached_pages)
{
    fx_t f;
    fx_init(&f, 8, 4, 4);
    prompts();
    app(&f, 1, A, 8);
    ck_assert_uint_eq(pub(&f, 1), 2);
    app(&f, 2, B, 4);
    ck_assert_uint_eq(pub(&f, 2), 1);
    app(&f, 4, C, 6); /* a chain with a partial page, unpublished */
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 2), 0);
    uint64_t pid;
    uint32_t n;
    ck_assert_int_eq(kvp_pcache_pin(f.c, 0, 0, root_of(NULL), A, 4, 0, 1000, &pid, &n), 0);
    uint32_t a0 = pg(&f, 1, 0);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a0), 2);
    kvp_pcache_destroy(f.c);
    f.c = NULL;
    ck_assert_ptr_null(kvp_seqtab_pcache(f.t));
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a0), 1);     /* the pin's reference went */
    ck_assert_uint_eq(kvp_alloc_num_free(f.a), 8 - 2 - 2); /* the cached page came back */
    ck_assert_uint_eq(kvp_alloc_num_cached(f.a), 0);
    char msg[256] = "";
    ck_assert_msg(kvp_seqtab_audit(f.t, msg, sizeof(msg)) == 0, "audit: %s", msg);
    /* the sequences go on without a cache: token ids are ignored */
    ck_assert_int_eq(app_c(&f, 1, A + 8, 4, NULL, DEF), 0);
    app(&f, 4, C + 6, 2);
    ck_assert_int_eq(kvp_seqtab_fork(f.t, 0, 1, 3, 0), 0);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 3, 5, 0), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 3), 0);
    ck_assert_msg(kvp_seqtab_audit(f.t, msg, sizeof(msg)) == 0, "audit: %s", msg);
    /* a new cache: the old sequences have no chain and never get one; new ones do */
    kvp_pcache_config_t pc = {.max_scopes = 2, .max_pins = 4};
    ck_assert_int_eq(kvp_pcache_create(f.t, &pc, &f.c), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a0), 0);
    app(&f, 1, A + 12, 4);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 1, 3)), 0);
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 1), (kvp_pcache_ref_t[1]){{0}}, 1),
                      0);
    ck_assert_int_eq(kvp_pcache_set_retention(f.c, seq(&f, 1), 50, 0), KVP_EINVAL);
    app(&f, 5, A, 4);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, pg(&f, 5, 0)), KVP_PAGE_KEYED);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 8), 0);
    fx_audit(&f);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 4), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 5), 0);
    fx_fini(&f);
}
END_TEST

START_TEST(scope_reset_needs_an_empty_scope)
{
    fx_t f;
    fx_init(&f, 8, 4, 4);
    prompts();
    ck_assert_int_eq(app_c(&f, 1, A, 4, NULL, co(1, 1, 0, 35, 0)), 0);
    ck_assert_uint_eq(pub(&f, 1), 1);
    ck_assert_uint_eq(kvp_pcache_lookup(f.c, 1, root_of(NULL), A, 8, 1), 1);
    app(&f, 2, B, 4);
    ck_assert_uint_eq(pub(&f, 2), 1);
    ck_assert_uint_eq(kvp_pcache_lookup(f.c, 0, root_of(NULL), B, 4, 1), 1);
    ck_assert_int_eq(kvp_pcache_scope_reset(f.c, 2), KVP_EINVAL);
    ck_assert_int_eq(kvp_pcache_scope_reset(f.c, 1), KVP_EBUSY); /* held */
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    ck_assert_int_eq(kvp_pcache_scope_reset(f.c, 1), KVP_EBUSY); /* cached */
    ck_assert_uint_eq(kvp_pcache_flush(f.c, 1), 1);
    ck_assert_int_eq(kvp_pcache_scope_reset(f.c, 1), 0);
    kvp_pcache_scope_stats_t ss;
    ck_assert_int_eq(kvp_pcache_scope_stats(f.c, 1, &ss), 0);
    ck_assert_uint_eq(ss.indexed_pages + ss.cached_pages, 0);
    ck_assert_uint_eq(ss.query_tokens + ss.hit_tokens, 0);
    ck_assert_int_eq(kvp_pcache_scope_stats(f.c, 0, &ss), 0); /* the others keep theirs */
    ck_assert_uint_eq(ss.indexed_pages, 1);
    ck_assert_uint_eq(ss.query_tokens, 4);
    ck_assert_uint_eq(ss.hit_tokens, 4);
    kvp_pcache_stats_t st = stats(&f); /* the totals too */
    ck_assert_uint_eq(st.query_tokens, 4 + 4 + 8);
    fx_audit(&f);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 2), 0);
    kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE);
    fx_fini(&f);
}
END_TEST

typedef struct {
    kvp_pcache_stats_t pc;
    kvp_stats_t st;
    uint32_t order[64], norder;
    unsigned state[64];
    uint32_t ref[64];
} csnap_t;

static void csnap(const fx_t *f, csnap_t *s)
{
    memset(s, 0, sizeof(*s));
    kvp_pcache_stats(f->c, &s->pc);
    kvp_seqtab_stats(f->t, &s->st);
    s->norder = kvp_pcache_eviction_order(f->c, s->order, 64);
    for (uint32_t p = 0; p < kvp_alloc_num_pages(f->a) && p < 64; p++) {
        s->state[p] = kvp_pcache_page_state(f->c, p);
        s->ref[p] = kvp_alloc_refcount(f->a, p);
    }
}

START_TEST(reserve_over_free_plus_cached_changes_nothing)
{
    fx_t f;
    fx_init(&f, 6, 4, 4);
    prompts();
    app(&f, 9, NULL, 4); /* holds one page */
    app(&f, 1, A, 8);
    pub(&f, 1);
    app(&f, 2, B, 8);
    pub(&f, 2);
    uint32_t a0 = pg(&f, 1, 0), a1 = pg(&f, 1, 1), b0 = pg(&f, 2, 0), b1 = pg(&f, 2, 1);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 2), 0);
    uint32_t w[] = {a1, a0, b1, b0};
    order_is(&f, w, 4);
    csnap_t s0, s1;
    csnap(&f, &s0);
    /* 6 pages, 2 linked: 4 needed, 1 free + 2 evictable (the linked ones do not count) */
    f.now = 10;
    ck_assert_int_eq(app_c(&f, 3, A, 24, NULL, REUSE), KVP_ENOSPC);
    ck_assert_ptr_null(kvp_seqtab_find(f.t, 0, 3));
    fx_audit(&f);
    csnap(&f, &s1);
    ck_assert_int_eq(memcmp(&s0, &s1, sizeof(s0)), 0);
    /* 4 pages: 2 needed, 1 free + b1 (a1 heads the order but this batch links it) */
    ck_assert_int_eq(app_c(&f, 3, A, 16, NULL, REUSE), 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 8);
    ck_assert_uint_eq(f.p.num_evicted, 1);
    ck_assert(row_has(&f.p, 0, b1));
    ck_assert_int_eq(f.p.kv_indices[0], (int)a0);
    ck_assert_int_eq(f.p.kv_indices[1], (int)a1);
    uint32_t w2[] = {b0};
    order_is(&f, w2, 1);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_PRESSURE], 1);
    ck_assert_uint_eq(st.hit_tokens, 8);
    ck_assert_uint_eq(st.query_tokens, 16);
    fx_audit(&f);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 3), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 9), 0);
    kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE);
    fx_fini(&f);
}
END_TEST

START_TEST(fork_shares_the_chain)
{
    fx_t f;
    fx_init(&f, 16, 4, 4);
    prompts();
    app(&f, 1, A, 6);
    uint32_t a0 = pg(&f, 1, 0), a1 = pg(&f, 1, 1);
    ck_assert_int_eq(kvp_seqtab_fork(f.t, 0, 1, 2, 0), 0);
    app(&f, 2, A + 6, 2); /* copies the shared partial page, keys the copy */
    ck_assert_uint_eq(f.p.num_copies, 1);
    uint32_t n = pg(&f, 2, 1);
    ck_assert_uint_ne(n, a1);
    ck_assert(kvp_pagekey_eq(page_key(&f, n), key_at(NULL, A, 1, 4)));
    app(&f, 1, A + 6, 2);
    ck_assert_uint_eq(f.p.num_copies, 0);
    ck_assert(kvp_pagekey_eq(page_key(&f, a1), key_at(NULL, A, 1, 4)));
    ck_assert_uint_eq(pub(&f, 2), 2); /* a0 and n */
    ck_assert_uint_eq(pub(&f, 1), 0); /* a0 indexed, a1 a twin */
    ck_assert_uint_eq(kvp_pcache_find(f.c, 0, key_at(NULL, A, 1, 4)), n);
    ck_assert_uint_eq(kvp_pcache_find(f.c, 0, key_at(NULL, A, 0, 4)), a0);
    /* the handed-out mark travels with the fork */
    app(&f, 3, B, 8);
    kvp_pcache_ref_t refs[4], r2;
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 3), refs, 4), 2);
    ck_assert_int_eq(kvp_seqtab_fork(f.t, 0, 3, 4, 0), 0);
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 4), &r2, 1), 0);
    app(&f, 4, B + 8, 4);
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 4), &r2, 1), 1);
    ck_assert_uint_eq(r2.page, pg(&f, 4, 2));
    ck_assert_uint_eq(kvp_pcache_publish(f.c, refs, 2), 2);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, &r2, 1), 1);
    ck_assert_uint_eq(look(&f, 0, NULL, B, 12), 3);
    /* the priority travels too: 6 is a fork of 5 (priority 70), its new page keyed at 70 */
    ck_assert_int_eq(app_c(&f, 5, C, 4, NULL, co(0, 0, 0, 70, 0)), 0);
    ck_assert_int_eq(kvp_seqtab_fork(f.t, 0, 5, 6, 0), 0);
    app(&f, 6, C + 4, 4);
    ck_assert_uint_eq(pub(&f, 6), 2);
    app(&f, 7, D, 4);
    ck_assert_uint_eq(pub(&f, 7), 1);
    uint32_t c1 = pg(&f, 6, 1), d0 = pg(&f, 7, 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 6), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 7), 0);
    uint32_t w[] = {d0, c1};
    order_is(&f, w, 2);
    fx_audit(&f);
    for (uint64_t id = 1; id <= 5; id++)
        ck_assert_int_eq(kvp_seqtab_release(f.t, 0, id), 0);
    kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE);
    fx_fini(&f);
}
END_TEST

START_TEST(a_stale_ref_does_not_publish)
{
    fx_t f;
    fx_init(&f, 16, 4, 4);
    prompts();
    kvp_pcache_ref_t refs[4], r2[4];
    app(&f, 1, A, 8);
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 1), refs, 4), 2);
    uint32_t a0 = refs[0].page;
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a0), 0);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, refs, 2), 0);
    ck_assert_uint_eq(stats(&f).indexed_pages, 0);
    /* truncated below the second page before the commit */
    app(&f, 2, A, 8);
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 2), refs, 4), 2);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 2, 6, 0), 0);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, refs, 2), 1);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 8), 1);
    /* re-keyed with the same content: the old ref stays stale, a new one is handed out */
    app(&f, 2, A + 6, 2);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, refs, 2), 0);
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 2), r2, 4), 1);
    ck_assert_uint_eq(r2[0].page, refs[1].page);
    ck_assert_uint_ne(r2[0].gen, refs[1].gen);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, r2, 1), 1);
    ck_assert_uint_eq(look(&f, 0, NULL, A, 8), 2);
    /* a ref of a page freed and keyed again by another sequence is stale too */
    app(&f, 3, B, 4);
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 3), refs, 4), 1);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 3), 0);
    app(&f, 4, B, 4);
    ck_assert_uint_eq(pg(&f, 4, 0), refs[0].page); /* the free stack's top */
    ck_assert_uint_eq(kvp_pcache_publish(f.c, refs, 1), 0);
    ck_assert_uint_eq(pub(&f, 4), 1);
    fx_audit(&f);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 2), 0);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 4), 0);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE), 3);
    fx_fini(&f);
}
END_TEST

/* ---- the model-based random run ------------------------------------------------------- */

#define RM_PAGES   48 /* pool pages at most */
#define RM_PS      4  /* page size at most */
#define RM_SEQS    10 /* live sequences at most */
#define RM_LEN     40 /* tokens per sequence at most */
#define RM_PINS    4  /* max_pins */
#define RM_NS      3  /* pin namespaces: 0 unlimited, 1 quota 6, 2 quota 0 */
#define RM_PROMPTS 4
#define RM_REFS    24 /* refs taken and not yet published */

/* The semantics (kvpool.proto Batch.token_ids): a chain holds the token ids of one page that
 * was full (the last one it filled or linked), so a truncate into it continues the chain and a
 * second truncate into the page before it ends it. 0 models a chain that knew them all. */
#ifndef RM_ONE_PAGE_TOKENS
#define RM_ONE_PAGE_TOKENS 1
#endif

static const uint64_t rm_quota[RM_NS] = {UINT64_MAX, 6, 0};
static const uint32_t rm_prios[] = {0, 20, 35, 35, 35, 60, 90};
static const uint32_t rm_rets[] = {0, 0, 0, 10, 50};

typedef struct {
    uint32_t ref, pinrefs; /* references: sequences + pins; of them, pins */
    uint8_t keyed, indexed, cached;
    uint32_t gen; /* +1 whenever keyed anew or losing its key */
    kvp_pagekey_t key;
    uint32_t scope, prio, ret_ms;
    uint64_t rel_ms, ord;   /* cached: release time, position in its list */
    int32_t content[RM_PS]; /* the tokens it was keyed with */
} mpage_t;

typedef struct {
    uint8_t live;
    uint64_t id;
    uint32_t len, npages;
    int32_t tok[RM_LEN];
    uint32_t pages[RM_LEN];
    uint8_t chain; /* 0 none, 1 active, 2 ended */
    uint8_t base, onbase;
    uint32_t scope, prio, ret_ms;
    kvp_pagekey_t root;
    uint32_t nkeyed, handed;
    uint8_t knows_last; /* RM_ONE_PAGE_TOKENS: the chain holds the tokens of its last full page */
    uint8_t foreign;    /* its partial last page holds rows a worker wrote, or a truncate kept */
    kvp_pagekey_t keys[RM_LEN];
} mseq_t;

typedef struct {
    uint8_t live;
    uint64_t id, exp;
    uint32_t ns, scope, n;
    uint32_t pages[RM_LEN];
} mpin_t;

typedef struct {
    mpage_t pg[RM_PAGES];
    mseq_t sq[RM_SEQS];
    mpin_t pin[RM_PINS];
    uint64_t ord_next;
    uint64_t query, hit, sq_query[2], sq_hit[2];
    uint64_t evictions[KVP_EVICT_REASONS];
    uint64_t residence[KVP_PCACHE_RESIDENCE_BUCKETS + 1], residence_sum;
} model_t;

typedef struct {
    uint32_t ps, np;
    kvp_alloc_t *a;
    kvp_seqtab_t *t;
    kvp_pcache_t *c;
    kvp_plan_t plan;
    kvp_rng_t r;
    uint64_t now, next_id;
    model_t m, save;
    int32_t shadow[RM_PAGES][RM_PS];
    int32_t base[RM_PROMPTS][RM_LEN];
    kvp_pagekey_t roots[2];
    kvp_pcache_ref_t refs[RM_REFS];
    uint32_t rgen[RM_REFS], nrefs;
    uint64_t quota[RM_NS];
    uint64_t op;
    /* what the run exercised */
    uint64_t n_tail_rewrite; /* appends into a keyed partial page by its last holder */
    uint64_t n_job_refs;     /* pages a daemon-run Append took to publish when its copy is done */
    uint64_t n_ok, n_enospc, n_evict, n_hit, n_rewrite, n_cow, n_pin, n_pin_limit, n_demote,
        n_flush, n_stale, n_twin, n_pub, n_expire;
} world_t;

static const char *rm_salt[2] = {NULL, "tenant-b"};

static uint32_t rnd(world_t *w, uint32_t n)
{
    return kvp_rng_below(&w->r, n);
}

static uint32_t pages_for(uint32_t ps, uint32_t n)
{
    return (n + ps - 1) / ps;
}

/* KVP_PCACHE_TRACE=1 prints every operation (to replay a failure by hand). */
static int rm_trace;
#define TRACE(w, ...)                                                                              \
    do {                                                                                           \
        if (rm_trace) {                                                                            \
            fprintf(stderr, "%llu t=%llu: ", (unsigned long long)(w)->op,                          \
                    (unsigned long long)(w)->now);                                                 \
            fprintf(stderr, __VA_ARGS__);                                                          \
        }                                                                                          \
    } while (0)

#define WCHECK(w, cond, ...)                                                                       \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            char wmsg_[512];                                                                       \
            snprintf(wmsg_, sizeof(wmsg_), __VA_ARGS__);                                           \
            ck_abort_msg("op %llu (ps %u, KVP_PCACHE_TRACE=1 replays it): %s",                     \
                         (unsigned long long)(w)->op, (w)->ps, wmsg_);                             \
        }                                                                                          \
    } while (0)

/* The indexed page of (scope, key) in the model, or -1. */
static int m_find(const world_t *w, uint32_t scope, kvp_pagekey_t k)
{
    for (uint32_t p = 0; p < w->np; p++) {
        const mpage_t *g = &w->m.pg[p];
        if (g->indexed && g->scope == scope && kvp_pagekey_eq(g->key, k))
            return (int)p;
    }
    return -1;
}

/* Leading findable pages of toks[0..n) (at most cap), their ids in out (may be NULL). */
static uint32_t m_lookup(const world_t *w, uint32_t scope, kvp_pagekey_t root, const int32_t *toks,
                         uint32_t n, uint32_t cap, uint32_t *out)
{
    uint32_t f = 0;
    kvp_pagekey_t k = root;
    while (f < cap && (f + 1) * w->ps <= n) {
        k = kvp_pagekey_next(k, toks + f * w->ps, w->ps);
        int p = m_find(w, scope, k);
        if (p < 0)
            break;
        if (out)
            out[f] = (uint32_t)p;
        f++;
    }
    return f;
}

static void m_lose_key(world_t *w, uint32_t p)
{
    mpage_t *g = &w->m.pg[p];
    g->keyed = g->indexed = g->cached = 0;
    g->gen++;
}

static void m_cache(world_t *w, uint32_t p)
{
    mpage_t *g = &w->m.pg[p];
    g->cached = 1;
    g->rel_ms = w->now;
    g->ord = ++w->m.ord_next;
}

/* Drops one reference (a sequence's, or a pin's when pin). */
static void m_unref(world_t *w, uint32_t p, int pin)
{
    mpage_t *g = &w->m.pg[p];
    WCHECK(w, g->ref > 0, "model: unref of free page %u", p);
    g->ref--;
    if (pin)
        g->pinrefs--;
    if (g->ref)
        return;
    if (g->indexed)
        m_cache(w, p);
    else if (g->keyed)
        m_lose_key(w, p);
}

static void m_addref(world_t *w, uint32_t p, int pin)
{
    mpage_t *g = &w->m.pg[p];
    g->ref++;
    if (pin)
        g->pinrefs++;
    g->cached = 0;
}

/* A chain of priority prio / retention ret holds page p: it keeps the max. */
static void m_raise(mpage_t *g, uint32_t prio, uint32_t ret)
{
    if (prio > g->prio) {
        g->prio = prio;
        g->ret_ms = ret;
    } else if (prio == g->prio && g->ret_ms && (ret == 0 || ret > g->ret_ms)) {
        g->ret_ms = ret; /* retention 0 has no end: the longest */
    }
}

/* Moves cached pages whose retention ended by now to the default list, by expiry, then in
 * the order they were released (a chain's deepest page stays first). */
static uint32_t m_demote(world_t *w, uint64_t now)
{
    uint32_t n = 0;
    for (;;) {
        int best = -1;
        uint64_t bexp = 0;
        for (uint32_t p = 0; p < w->np; p++) {
            const mpage_t *g = &w->m.pg[p];
            if (!g->cached || !g->ret_ms || g->rel_ms + g->ret_ms > now)
                continue;
            if (best < 0 || g->rel_ms + g->ret_ms < bexp ||
                (g->rel_ms + g->ret_ms == bexp && g->ord < w->m.pg[best].ord)) {
                best = (int)p;
                bexp = g->rel_ms + g->ret_ms;
            }
        }
        if (best < 0)
            return n;
        mpage_t *g = &w->m.pg[best];
        g->prio = KVP_PCACHE_DEFAULT_PRIORITY;
        g->ret_ms = 0;
        g->ord = ++w->m.ord_next;
        n++;
    }
}

static int m_before(const mpage_t *x, const mpage_t *y)
{
    return x->prio < y->prio || (x->prio == y->prio && x->ord < y->ord);
}

static uint32_t m_order(const world_t *w, uint32_t *out)
{
    uint32_t n = 0;
    for (uint32_t p = 0; p < w->np; p++) {
        if (!w->m.pg[p].cached)
            continue;
        uint32_t i = n++;
        while (i > 0 && m_before(&w->m.pg[p], &w->m.pg[out[i - 1]])) {
            out[i] = out[i - 1];
            i--;
        }
        out[i] = p;
    }
    return n;
}

static void m_evict(world_t *w, uint32_t p, kvp_evict_reason_t why)
{
    mpage_t *g = &w->m.pg[p];
    if (why == KVP_EVICT_PRESSURE) { /* a flush is not counted */
        uint64_t res = w->now - g->rel_ms;
        uint32_t b = 0;
        while (b < KVP_PCACHE_RESIDENCE_BUCKETS && res > kvp_pcache_residence_le_ms[b])
            b++;
        w->m.residence[b]++;
        w->m.residence_sum += res;
    }
    w->m.evictions[why]++;
    m_lose_key(w, p);
}

static uint32_t m_free_count(const world_t *w)
{
    uint32_t n = 0;
    for (uint32_t p = 0; p < w->np; p++)
        n += w->m.pg[p].ref == 0 && !w->m.pg[p].cached;
    return n;
}

/* ---- comparing the model with the cache ------------------------------------------------ */

static void rm_lookups(world_t *w)
{
    for (int i = 0; i < 2; i++) {
        int32_t toks[RM_LEN];
        uint32_t b = rnd(w, RM_PROMPTS), n = rnd(w, RM_LEN + 1), salt = rnd(w, 2),
                 scope = rnd(w, 2), count = rnd(w, 2);
        memcpy(toks, w->base[b], sizeof(toks));
        if (n && rnd(w, 4) == 0)
            toks[rnd(w, n)] = 1000 + (int32_t)rnd(w, 4);
        uint32_t want = m_lookup(w, scope, w->roots[salt], toks, n, UINT32_MAX, NULL);
        uint32_t got = kvp_pcache_lookup(w->c, scope, w->roots[salt], toks, n, count);
        WCHECK(w, got == want,
               "lookup of %u tokens of prompt %u (salt %u scope %u): %u pages, "
               "model %u",
               n, b, salt, scope, got, want);
        if (count) {
            w->m.query += n;
            w->m.hit += (uint64_t)want * w->ps;
            w->m.sq_query[scope] += n;
            w->m.sq_hit[scope] += (uint64_t)want * w->ps;
        }
    }
}

#ifdef RM_DEBUG_PRIO
uint32_t kvp__dbg_prio(const kvp_pcache_t *c, uint32_t p);
uint32_t kvp__dbg_ret(const kvp_pcache_t *c, uint32_t p);
#endif

static void rm_check(world_t *w)
{
    char msg[256] = "";
    int rc = kvp_pcache_audit(w->c, msg, sizeof(msg));
    WCHECK(w, rc == 0, "audit: %s (%s)", msg, kvp_errname(rc));
    const model_t *m = &w->m;
    uint32_t indexed = 0, cached = 0, pinned = 0, sidx[2] = {0, 0}, scached[2] = {0, 0};
    for (uint32_t p = 0; p < w->np; p++) {
        const mpage_t *g = &m->pg[p];
        unsigned want = (g->keyed ? KVP_PAGE_KEYED : 0) | (g->indexed ? KVP_PAGE_INDEXED : 0) |
                        (g->cached ? KVP_PAGE_CACHED : 0);
        unsigned got = kvp_pcache_page_state(w->c, p);
        WCHECK(w, got == want, "page %u state %u, model %u", p, got, want);
        uint32_t ref = kvp_alloc_refcount(w->a, p);
        WCHECK(w, ref == g->ref, "page %u refcount %u, model %u", p, ref, g->ref);
#ifdef RM_DEBUG_PRIO
        if (g->keyed)
            WCHECK(w, kvp__dbg_prio(w->c, p) == g->prio && kvp__dbg_ret(w->c, p) == g->ret_ms,
                   "page %u prio %u ret %u, model %u %u", p, kvp__dbg_prio(w->c, p),
                   kvp__dbg_ret(w->c, p), g->prio, g->ret_ms);
#endif
        if (g->keyed) {
            kvp_pagekey_t k;
            uint32_t scope;
            WCHECK(w, kvp_pcache_page_key(w->c, p, &k, &scope) == 0, "page %u: no key", p);
            WCHECK(w, kvp_pagekey_eq(k, g->key) && scope == g->scope,
                   "page %u key or scope (%u, model %u) differs", p, scope, g->scope);
        }
        if (g->indexed) {
            indexed++;
            sidx[g->scope]++;
            for (uint32_t s = 0; s < w->ps; s++)
                WCHECK(w, w->shadow[p][s] == g->content[s],
                       "indexed page %u slot %u holds token %d, keyed with %d", p, s,
                       w->shadow[p][s], g->content[s]);
        }
        if (g->cached) {
            cached++;
            scached[g->scope]++;
        }
        pinned += g->pinrefs > 0;
    }
    kvp_pcache_stats_t st;
    kvp_pcache_stats(w->c, &st);
    uint32_t pins = 0;
    for (int i = 0; i < RM_PINS; i++)
        pins += m->pin[i].live;
    WCHECK(w,
           st.indexed_pages == indexed && st.cached_pages == cached && st.pinned_pages == pinned &&
               st.pins == pins,
           "stats indexed %u cached %u pinned %u pins %u, model %u %u %u %u", st.indexed_pages,
           st.cached_pages, st.pinned_pages, st.pins, indexed, cached, pinned, pins);
    WCHECK(w, st.query_tokens == m->query && st.hit_tokens == m->hit,
           "stats query %llu hit %llu, model %llu %llu", (unsigned long long)st.query_tokens,
           (unsigned long long)st.hit_tokens, (unsigned long long)m->query,
           (unsigned long long)m->hit);
    for (int i = 0; i < KVP_EVICT_REASONS; i++)
        WCHECK(w, st.evictions[i] == m->evictions[i], "evictions[%d] %llu, model %llu", i,
               (unsigned long long)st.evictions[i], (unsigned long long)m->evictions[i]);
    for (int i = 0; i <= KVP_PCACHE_RESIDENCE_BUCKETS; i++)
        WCHECK(w, st.residence[i] == m->residence[i], "residence[%d] %llu, model %llu", i,
               (unsigned long long)st.residence[i], (unsigned long long)m->residence[i]);
    WCHECK(w, st.residence_sum_ms == m->residence_sum, "residence_sum %llu, model %llu",
           (unsigned long long)st.residence_sum_ms, (unsigned long long)m->residence_sum);
    for (uint32_t s = 0; s < 2; s++) {
        kvp_pcache_scope_stats_t ss;
        WCHECK(w, kvp_pcache_scope_stats(w->c, s, &ss) == 0, "scope stats");
        WCHECK(w,
               ss.indexed_pages == sidx[s] && ss.cached_pages == scached[s] &&
                   ss.query_tokens == m->sq_query[s] && ss.hit_tokens == m->sq_hit[s],
               "scope %u stats %u %u %llu %llu, model %u %u %llu %llu", s, ss.indexed_pages,
               ss.cached_pages, (unsigned long long)ss.query_tokens,
               (unsigned long long)ss.hit_tokens, sidx[s], scached[s],
               (unsigned long long)m->sq_query[s], (unsigned long long)m->sq_hit[s]);
    }
    /* the eviction order */
    uint32_t want[RM_PAGES], got[RM_PAGES + 1];
    uint32_t nw = m_order(w, want), ng = kvp_pcache_eviction_order(w->c, got, RM_PAGES + 1);
    WCHECK(w, ng == nw, "eviction order: %u pages, model %u", ng, nw);
    for (uint32_t i = 0; i < nw; i++)
        WCHECK(w, got[i] == want[i], "eviction order[%u] = %u, model %u", i, got[i], want[i]);
    /* pins */
    uint64_t next = UINT64_MAX, nsp[RM_NS] = {0, 0, 0};
    uint32_t nsn[RM_NS] = {0, 0, 0};
    for (int i = 0; i < RM_PINS; i++)
        if (m->pin[i].live) {
            next = m->pin[i].exp < next ? m->pin[i].exp : next;
            nsp[m->pin[i].ns] += m->pin[i].n;
            nsn[m->pin[i].ns]++;
        }
    WCHECK(w, kvp_pcache_next_expiry(w->c) == next, "next expiry");
    kvp_pcache_pin_info_t pi;
    uint32_t cur = 0, seen = 0;
    while (kvp_pcache_next_pin(w->c, &cur, &pi) == 0) {
        const mpin_t *pn = NULL;
        for (int i = 0; i < RM_PINS; i++)
            if (m->pin[i].live && m->pin[i].id == pi.pin_id)
                pn = &m->pin[i];
        WCHECK(w,
               pn && pn->ns == pi.ns && pn->n == pi.pages && pn->exp == pi.expires_ms &&
                   pn->scope == pi.scope,
               "pin %llu: not the model's", (unsigned long long)pi.pin_id);
        WCHECK(w, ++seen <= RM_PINS, "pin iteration does not end");
    }
    WCHECK(w, seen == pins, "pin iteration: %u pins, model %u", seen, pins);
    for (uint32_t ns = 0; ns < RM_NS; ns++)
        WCHECK(w,
               kvp_pcache_ns_pinned_pages(w->c, ns) == nsp[ns] &&
                   kvp_pcache_ns_pins(w->c, ns) == nsn[ns],
               "ns %u pins %u pages %llu, model %u %llu", ns, kvp_pcache_ns_pins(w->c, ns),
               (unsigned long long)kvp_pcache_ns_pinned_pages(w->c, ns), nsn[ns],
               (unsigned long long)nsp[ns]);
    /* every live sequence: its pages, and its tokens in them */
    uint32_t nseq = 0;
    for (int i = 0; i < RM_SEQS; i++) {
        const mseq_t *q = &m->sq[i];
        if (!q->live)
            continue;
        nseq++;
        const kvp_seq_t *s = kvp_seqtab_find(w->t, 0, q->id);
        WCHECK(w, s && s->num_tokens == q->len && s->num_pages == q->npages,
               "sequence %llu: length or pages differ", (unsigned long long)q->id);
        for (uint32_t j = 0; j < q->npages; j++)
            WCHECK(w, s->pages[j] == q->pages[j], "sequence %llu page %u: %u, model %u",
                   (unsigned long long)q->id, j, s->pages[j], q->pages[j]);
        for (uint32_t pos = 0; pos < q->len; pos++)
            WCHECK(w, w->shadow[q->pages[pos / w->ps]][pos % w->ps] == q->tok[pos],
                   "sequence %llu token %u: page %u holds %d, want %d", (unsigned long long)q->id,
                   pos, q->pages[pos / w->ps], w->shadow[q->pages[pos / w->ps]][pos % w->ps],
                   q->tok[pos]);
    }
    kvp_stats_t ts;
    kvp_seqtab_stats(w->t, &ts);
    WCHECK(w, ts.num_seqs == nseq, "sequences %u, model %u", ts.num_seqs, nseq);
    uint32_t nfree = m_free_count(w);
    WCHECK(w,
           ts.cached_pages == cached && ts.free_pages == nfree &&
               ts.used_pages == w->np - nfree - cached,
           "table stats: free %u cached %u used %u, model %u %u %u", ts.free_pages, ts.cached_pages,
           ts.used_pages, nfree, cached, w->np - nfree - cached);
    WCHECK(w,
           kvp_alloc_num_cached(w->a) == cached && kvp_alloc_num_free(w->a) == nfree &&
               kvp_alloc_num_available(w->a) == nfree + cached,
           "allocator: free %u cached %u, model %u %u", kvp_alloc_num_free(w->a),
           kvp_alloc_num_cached(w->a), nfree, cached);
    rm_lookups(w);
}

/* ---- operations ---------------------------------------------------------------------- */

static int pick_live(world_t *w)
{
    int live[RM_SEQS], n = 0;
    for (int i = 0; i < RM_SEQS; i++)
        if (w->m.sq[i].live)
            live[n++] = i;
    return n ? live[rnd(w, (uint32_t)n)] : -1;
}

static int pick_free(world_t *w)
{
    int fr[RM_SEQS], n = 0;
    for (int i = 0; i < RM_SEQS; i++)
        if (!w->m.sq[i].live)
            fr[n++] = i;
    return n ? fr[rnd(w, (uint32_t)n)] : -1;
}

/* The next token of a sequence: mostly its prompt's, sometimes off it for good. */
static int32_t next_token(world_t *w, uint8_t base, uint8_t *onbase, uint32_t pos)
{
    if (*onbase && rnd(w, 24) != 0)
        return w->base[base][pos];
    *onbase = 0;
    return 1000 + (int32_t)rnd(w, 3);
}

/* Keys the full pages of an active chain up to its length (the plan just filled them). */
static void m_key_pages(world_t *w, mseq_t *q)
{
    uint32_t full = q->len / w->ps;
    while (q->nkeyed < full) {
        uint32_t i = q->nkeyed;
        kvp_pagekey_t prev = i ? q->keys[i - 1] : q->root;
        q->keys[i] = kvp_pagekey_next(prev, q->tok + i * w->ps, w->ps);
        mpage_t *g = &w->m.pg[q->pages[i]];
        g->keyed = 1;
        g->indexed = 0;
        g->gen++;
        g->key = q->keys[i];
        g->scope = q->scope;
        g->prio = q->prio;
        g->ret_ms = q->ret_ms;
        memcpy(g->content, q->tok + i * w->ps, w->ps * sizeof(int32_t));
        q->nkeyed++;
    }
}

static void rm_pend(world_t *w, const kvp_pcache_ref_t *refs, const uint32_t *rgen, uint32_t n);

/* A daemon-run Append's job takes the pages its plan filled (kvp_pcache_take_written) and
 * publishes them when its copy completes: here, a later op_publish_pending, after the sequence
 * may have grown through a Reserve, been truncated, released, or its slot reused (issue #26
 * defect 2). Checks the refs against the model. */
static void rm_take_written(world_t *w, mseq_t *q, uint32_t from)
{
    kvp_pcache_ref_t refs[RM_LEN];
    uint32_t rgen[RM_LEN], want = 0;
    kvp_seq_t *s = kvp_seqtab_find(w->t, 0, q->id);
    uint32_t n = kvp_pcache_take_written(w->c, s, from, refs, RM_LEN);
    for (uint32_t i = from; i < q->nkeyed; i++) {
        const mpage_t *g = &w->m.pg[q->pages[i]];
        if (!g->keyed || g->indexed)
            continue;
        WCHECK(w, want < n && refs[want].page == q->pages[i] && refs[want].gen == g->gen,
               "take_written ref %u: page %u, model page %u", want,
               want < n ? refs[want].page : UINT32_MAX, q->pages[i]);
        rgen[want++] = g->gen;
    }
    WCHECK(w, n == want, "take_written: %u refs, model %u", n, want);
    if (q->handed >= from)
        q->handed = q->nkeyed;
    w->n_job_refs += n;
    rm_pend(w, refs, rgen, n);
}

static void op_append(world_t *w)
{
    uint32_t ps = w->ps, k = 0, n = 1 + rnd(w, 3);
    kvp_plan_item_t it[3];
    kvp_plan_content_t ct[3];
    int idx[3];
    static int32_t toks[3][RM_LEN];
    uint8_t ids[3], onbase[3], base[3], start[3], cow[3];
    uint32_t salt[3], f[3], linked[3][RM_LEN], len0[3];
    uint64_t id[3];
    kvp_plan_cache_t cc = {.scope = rnd(w, 2),
                           .reuse = rnd(w, 10) < 7,
                           .leave_last = rnd(w, 10) < 3,
                           .priority = (uint8_t)rm_prios[rnd(w, 7)],
                           .daemon_writes = rnd(w, 2), /* a daemon-run Append: its job */
                           .retention_ms = rm_rets[rnd(w, 5)]};
    for (uint32_t j = 0; j < n; j++) {
        int si = rnd(w, 3) == 0 ? pick_free(w) : pick_live(w);
        if (si < 0)
            continue;
        int dup = 0;
        for (uint32_t q = 0; q < k; q++)
            dup |= idx[q] == si;
        if (dup)
            continue;
        mseq_t *q = &w->m.sq[si];
        uint32_t len = q->live ? q->len : 0, add;
        if (!q->live || len == 0)
            add = rnd(w, 4) == 0 ? 0 : 1 + rnd(w, RM_LEN);
        else
            add = rnd(w, 3) == 0 ? rnd(w, 2 * ps + 2) : 1;
        if (len + add > RM_LEN)
            add = RM_LEN - len;
        idx[k] = si;
        id[k] = q->live ? q->id : w->next_id + 1 + k;
        len0[k] = len;
        base[k] = q->live && len ? q->base : (uint8_t)rnd(w, RM_PROMPTS);
        onbase[k] = q->live && len ? q->onbase : 1;
        for (uint32_t t = 0; t < add; t++)
            toks[k][t] = next_token(w, base[k], &onbase[k], len + t);
        ids[k] = add > 0 && rnd(w, 100) < 85;
        salt[k] = rnd(w, 2);
        start[k] = ids[k] && len == 0;
        it[k] = (kvp_plan_item_t){0, id[k], add};
        ct[k] = (kvp_plan_content_t){ids[k] ? toks[k] : NULL, rm_salt[salt[k]],
                                     rm_salt[salt[k]] ? (uint32_t)strlen(rm_salt[salt[k]]) : 0};
        k++;
    }
    if (!k)
        return;
    /* predict: linked pages, copies, pages needed */
    uint32_t need = 0, dec[RM_PAGES] = {0};
    uint8_t linkmark[RM_PAGES] = {0};
    for (uint32_t j = 0; j < k; j++) {
        const mseq_t *q = &w->m.sq[idx[j]];
        uint32_t add = it[j].num_tokens;
        f[j] = 0;
        if (start[j] && cc.reuse) {
            uint32_t cap = cc.leave_last ? (add - 1) / ps : add / ps;
            f[j] = m_lookup(w, cc.scope, w->roots[salt[j]], toks[j], add, cap, linked[j]);
            for (uint32_t i = 0; i < f[j]; i++)
                linkmark[linked[j][i]] = 1;
        }
        need += pages_for(ps, len0[j] + add) - pages_for(ps, len0[j]) - f[j];
        cow[j] = 0;
        if (add && len0[j] % ps) {
            uint32_t last = q->pages[q->npages - 1];
            if (w->m.pg[last].ref - dec[last] > 1) {
                cow[j] = 1;
                need++;
                dec[last]++;
            }
        }
    }
    uint32_t nfree = m_free_count(w), ncached_free = 0;
    for (uint32_t p = 0; p < w->np; p++)
        ncached_free += w->m.pg[p].cached && !linkmark[p];
    for (uint32_t j = 0; j < k; j++)
        TRACE(w,
              "append seq %llu +%u ids %u salt %u (len %u) scope %u reuse %u leave %u prio %u "
              "ret %u: f %u cow %u\n",
              (unsigned long long)id[j], it[j].num_tokens, ids[j], salt[j], len0[j], cc.scope,
              cc.reuse, cc.leave_last, cc.priority, cc.retention_ms, f[j], cow[j]);
    int rc = kvp_plan_append_cached(w->t, it, ct, k, NULL, &cc, w->now, &w->plan);
    TRACE(w, "  -> %s need %u free %u cached %u\n", kvp_errname(rc), need, nfree, ncached_free);
    if (need > nfree + ncached_free) {
        WCHECK(w, rc == KVP_ENOSPC, "batch of %u needing %u pages (%u free, %u cached): %s", k,
               need, nfree, ncached_free, kvp_errname(rc));
        for (uint32_t j = 0; j < k; j++)
            WCHECK(w, w->m.sq[idx[j]].live || !kvp_seqtab_find(w->t, 0, id[j]),
                   "a failed batch created a sequence");
        w->n_enospc++;
        return;
    }
    WCHECK(w, rc == 0, "batch of %u needing %u pages (%u free, %u cached): %s", k, need, nfree,
           ncached_free, kvp_errname(rc));
    w->n_ok++;
    const kvp_plan_t *p = &w->plan;
    /* links, then the evictions (retention first) */
    for (uint32_t j = 0; j < k; j++)
        for (uint32_t i = 0; i < f[j]; i++) {
            mpage_t *g = &w->m.pg[linked[j][i]];
            m_addref(w, linked[j][i], 0);
            m_raise(g, cc.priority, cc.retention_ms);
        }
    uint32_t nev = need > nfree ? need - nfree : 0;
    uint8_t evmark[RM_PAGES] = {0};
    if (nev) {
        w->n_demote += m_demote(w, w->now);
        uint32_t order[RM_PAGES];
        uint32_t no = m_order(w, order);
        WCHECK(w, no >= nev, "model: %u to evict of %u", nev, no);
        for (uint32_t i = 0; i < no; i++)
            TRACE(w, "  order[%u] = page %u prio %u ret %u rel %llu\n", i, order[i],
                  w->m.pg[order[i]].prio, w->m.pg[order[i]].ret_ms,
                  (unsigned long long)w->m.pg[order[i]].rel_ms);
        for (uint32_t i = 0; i < nev; i++) {
            evmark[order[i]] = 1;
            m_evict(w, order[i], KVP_EVICT_PRESSURE);
        }
        w->n_evict += nev;
    }
    WCHECK(w, p->num_evicted == nev, "num_evicted %u, model %u", p->num_evicted, nev);
    WCHECK(w, p->num_new_pages == need || p->num_new_pages == need - nev,
           "num_new_pages %u, model %u (%u evicted)", p->num_new_pages, need, nev);
    /* the page table: linked pages, kept pages, new pages (free or just evicted) */
    uint8_t used[RM_PAGES] = {0};
    uint32_t nnew = 0, nevused = 0, ci = 0, nnz = 0;
    uint64_t ncached = 0;
    WCHECK(w, p->batch_size == k && p->append_indptr[0] == 0, "batch size");
    for (uint32_t j = 0; j < k; j++) {
        mseq_t *q = &w->m.sq[idx[j]];
        uint32_t add = it[j].num_tokens, len = len0[j] + add, np = pages_for(ps, len);
        uint32_t onp = pages_for(ps, len0[j]);
        WCHECK(w, p->kv_indptr[j + 1] - p->kv_indptr[j] == (int32_t)np,
               "row %u: %d pages, "
               "model %u",
               j, p->kv_indptr[j + 1] - p->kv_indptr[j], np);
        WCHECK(w, p->seq_lens[j] == (int32_t)len, "seq_lens[%u]", j);
        WCHECK(w, p->kv_last_page_len[j] == (int32_t)(len ? (len - 1) % ps + 1 : 0),
               "kv_last_page_len[%u]", j);
        WCHECK(w, p->cached_tokens[j] == f[j] * ps, "cached_tokens[%u] %u, model %u", j,
               p->cached_tokens[j], f[j] * ps);
        WCHECK(w, p->append_indptr[j + 1] - p->append_indptr[j] == (int32_t)(add - f[j] * ps),
               "item %u appends %d tokens, model %u", j,
               p->append_indptr[j + 1] - p->append_indptr[j], add - f[j] * ps);
        ncached += f[j] * ps;
        nnz += add - f[j] * ps;
        const int32_t *row = p->kv_indices + p->kv_indptr[j];
        for (uint32_t i = 0; i < np; i++) {
            uint32_t pg_ = (uint32_t)row[i];
            WCHECK(w, pg_ < w->np, "page id %u", pg_);
            if (i < f[j]) {
                WCHECK(w, pg_ == linked[j][i], "item %u page %u: %u, model links %u", j, i, pg_,
                       linked[j][i]);
                continue;
            }
            if (i < onp && !(cow[j] && i == onp - 1)) {
                WCHECK(w, pg_ == q->pages[i], "item %u kept page %u: %u, model %u", j, i, pg_,
                       q->pages[i]);
                continue;
            }
            WCHECK(w, w->m.pg[pg_].ref == 0 && !w->m.pg[pg_].cached && !used[pg_],
                   "item %u page %u: %u was not free (ref %u cached %u used %u)", j, i, pg_,
                   w->m.pg[pg_].ref, w->m.pg[pg_].cached, used[pg_]);
            used[pg_] = 1;
            nnew++;
            nevused += evmark[pg_];
            if (cow[j] && i == onp - 1) {
                WCHECK(w,
                       ci < p->num_copies && p->copies[ci].src == q->pages[i] &&
                           p->copies[ci].dst == pg_,
                       "copy %u of item %u: model %u -> %u", ci, j, q->pages[i], pg_);
                ci++;
            }
        }
    }
    WCHECK(w, nnew == need && nevused == nev, "new pages %u (%u evicted), model %u (%u)", nnew,
           nevused, need, nev);
    WCHECK(w, p->num_copies == ci, "num_copies %u, model %u", p->num_copies, ci);
    WCHECK(w, p->nnz == nnz && p->append_indptr[k] == (int32_t)nnz, "nnz %u, model %u", p->nnz,
           nnz);
    WCHECK(w, p->num_cached_tokens == ncached, "num_cached_tokens");
    /* execute on the shadow pool: copies first, then the tokens where the table says */
    for (uint32_t i = 0; i < p->num_copies; i++) {
        /* a copy runs after the plan (a job, or a worker after its Reserve): its source must
         * still be held by someone, never cached or free (issue #26 defect 1) */
        WCHECK(w,
               kvp_alloc_refcount(w->a, p->copies[i].src) >= 1 &&
                   !(kvp_pcache_page_state(w->c, p->copies[i].src) & KVP_PAGE_CACHED),
               "copy %u reads page %u, which nobody holds", i, p->copies[i].src);
        memcpy(w->shadow[p->copies[i].dst], w->shadow[p->copies[i].src], sizeof(w->shadow[0]));
    }
    for (uint32_t j = 0; j < k; j++) {
        uint32_t cnt = (uint32_t)(p->append_indptr[j + 1] - p->append_indptr[j]);
        uint32_t len = (uint32_t)p->seq_lens[j];
        const int32_t *row = p->kv_indices + p->kv_indptr[j];
        for (uint32_t t = 0; t < cnt; t++) {
            uint32_t pos = len - cnt + t;
            w->shadow[row[pos / ps]][pos % ps] = toks[j][it[j].num_tokens - cnt + t];
        }
    }
    /* the model follows */
    for (uint32_t j = 0; j < k; j++) {
        mseq_t *q = &w->m.sq[idx[j]];
        uint32_t add = it[j].num_tokens, len = len0[j] + add, np = pages_for(ps, len);
        const int32_t *row = p->kv_indices + p->kv_indptr[j];
        uint32_t onp = pages_for(ps, len0[j]), oldlast = onp ? q->pages[onp - 1] : 0;
        if (!q->live) {
            memset(q, 0, sizeof(*q));
            q->live = 1;
            q->id = id[j];
            w->next_id = id[j] > w->next_id ? id[j] : w->next_id;
        }
        for (uint32_t i = f[j]; i < np; i++)
            if (i >= onp || (cow[j] && i == onp - 1))
                m_addref(w, (uint32_t)row[i], 0);
        if (cow[j]) {
            w->n_cow++;
            m_unref(w, oldlast, 0);
        } else if (add && len0[j] % ps && w->m.pg[oldlast].keyed) {
            /* a keyed partial page whose last holder writes into it: it loses its key first
             * (issue #26 defect 1) */
            if (w->m.pg[oldlast].indexed) {
                w->m.evictions[KVP_EVICT_REWRITE]++;
                w->n_rewrite++;
            }
            m_lose_key(w, oldlast);
            w->n_tail_rewrite++;
        }
        for (uint32_t i = 0; i < np; i++)
            q->pages[i] = (uint32_t)row[i];
        q->npages = np;
        memcpy(q->tok + len0[j], toks[j], add * sizeof(int32_t));
        q->len = len;
        if (len0[j] == 0 && add)
            q->base = base[j];
        q->onbase = onbase[j];
        if (start[j]) {
            q->chain = 1;
            q->scope = cc.scope;
            q->prio = cc.priority;
            q->ret_ms = cc.retention_ms;
            q->root = w->roots[salt[j]];
            q->nkeyed = 0;
            for (uint32_t i = 0; i < f[j]; i++)
                q->keys[i] = w->m.pg[linked[j][i]].key;
            q->nkeyed = q->handed = f[j];
            if (cc.reuse) {
                w->m.query += add;
                w->m.hit += (uint64_t)f[j] * ps;
                w->m.sq_query[cc.scope] += add;
                w->m.sq_hit[cc.scope] += (uint64_t)f[j] * ps;
                w->n_hit += f[j];
            }
        } else if (add && !ids[j] && q->chain == 1) {
            q->chain = 2;
        }
        if (start[j])
            q->knows_last = f[j] > 0; /* a linked page's tokens are the request's */
        if (start[j])
            q->foreign = 0;
        if (q->chain == 1 && ids[j]) {
            /* what this plan's writer may publish, and what its copy leaves in the tail */
            const uint32_t blen = start[j] ? f[j] * ps : len0[j], radd = len - blen;
            const uint32_t from = blen / ps + (blen % ps && q->foreign && cc.daemon_writes);
            WCHECK(w, p->publish_from[j] == from, "publish_from[%u] %u, model %u", j,
                   p->publish_from[j], from);
            if (radd && !cc.daemon_writes)
                q->foreign = 1;
            else if (radd && (blen % ps == 0 || blen % ps + radd >= ps))
                q->foreign = 0;
            uint32_t nk0 = q->nkeyed;
            m_key_pages(w, q);
            if (q->nkeyed > nk0)
                q->knows_last = 1;
            if (cc.daemon_writes)
                rm_take_written(w, q, from);
        }
    }
}

static void op_fork(world_t *w)
{
    int pi = pick_live(w), ci = pick_free(w);
    if (pi < 0 || ci < 0)
        return;
    uint64_t cid = ++w->next_id;
    TRACE(w, "fork %llu -> %llu\n", (unsigned long long)w->m.sq[pi].id, (unsigned long long)cid);
    int rc = kvp_seqtab_fork(w->t, 0, w->m.sq[pi].id, cid, w->now);
    WCHECK(w, rc == 0, "fork: %s", kvp_errname(rc));
    w->m.sq[ci] = w->m.sq[pi];
    w->m.sq[ci].id = cid;
    for (uint32_t i = 0; i < w->m.sq[ci].npages; i++)
        m_addref(w, w->m.sq[ci].pages[i], 0);
}

static void op_truncate(world_t *w)
{
    int si = pick_live(w);
    if (si < 0)
        return;
    mseq_t *q = &w->m.sq[si];
    uint32_t ps = w->ps, old = q->len, L;
    switch (rnd(w, 5)) {
    case 0:
        L = old ? old - 1 : 0;
        break;
    case 1:
        L = (old / ps) * ps;
        break;
    case 2:
        L = old / ps ? (old / ps - 1) * ps + 1 + rnd(w, ps) : 0;
        break;
    case 3:
        L = 0;
        break;
    default:
        L = rnd(w, old + 1);
        break;
    }
    if (L > old)
        L = old;
    TRACE(w, "truncate %llu %u -> %u\n", (unsigned long long)q->id, old, L);
    int rc = kvp_seqtab_truncate(w->t, 0, q->id, L, w->now);
    WCHECK(w, rc == 0, "truncate: %s", kvp_errname(rc));
    uint32_t np = pages_for(ps, L), full = L / ps, rem = L % ps;
    for (uint32_t i = q->npages; i-- > np;)
        m_unref(w, q->pages[i], 0);
    q->npages = np;
    q->len = L;
    q->foreign = rem != 0;
    if (rem) {
        mpage_t *g = &w->m.pg[q->pages[full]];
        if (g->keyed && g->ref == 1) {
            if (g->indexed) {
                w->m.evictions[KVP_EVICT_REWRITE]++;
                w->n_rewrite++;
            }
            m_lose_key(w, q->pages[full]);
        }
    }
    if (q->chain == 1) {
        int cont;
        if (rem == 0) {
            cont = 1;
            if (full != old / ps)
                q->knows_last = 0;
        } else if (full == old / ps) { /* within the partial last page */
            cont = 1;
        } else if (full + 1 == old / ps) { /* within the last full page */
            cont = RM_ONE_PAGE_TOKENS ? q->knows_last : 1;
            q->knows_last = 0;
        } else {
            cont = 0;
        }
        if (!cont)
            q->chain = 2;
    }
    if (q->nkeyed > full)
        q->nkeyed = full;
    if (q->handed > q->nkeyed)
        q->handed = q->nkeyed;
}

static void op_release(world_t *w)
{
    int si = pick_live(w);
    if (si < 0)
        return;
    mseq_t *q = &w->m.sq[si];
    TRACE(w, "release %llu\n", (unsigned long long)q->id);
    WCHECK(w, kvp_seqtab_release(w->t, 0, q->id) == 0, "release");
    for (uint32_t i = q->npages; i-- > 0;)
        m_unref(w, q->pages[i], 0);
    q->live = 0;
}

/* Publishes refs[0..n) (model gens rgen) and checks the count against the model. */
static void rm_publish(world_t *w, const kvp_pcache_ref_t *refs, const uint32_t *rgen, uint32_t n)
{
    uint32_t want = 0;
    for (uint32_t i = 0; i < n; i++) {
        mpage_t *g = &w->m.pg[refs[i].page];
        if (g->gen != rgen[i] || !g->keyed || g->ref == 0 || g->indexed) {
            w->n_stale += g->gen != rgen[i];
            continue;
        }
        if (m_find(w, g->scope, g->key) >= 0) {
            w->n_twin++;
            continue;
        }
        g->indexed = 1;
        want++;
    }
    TRACE(w, "publish %u refs (first page %u): model %u\n", n, n ? refs[0].page : 0, want);
    uint32_t got = kvp_pcache_publish(w->c, refs, n);
    WCHECK(w, got == want, "publish of %u refs: %u, model %u", n, got, want);
    w->n_pub += got;
}

static void op_take(world_t *w)
{
    int si = pick_live(w);
    if (si < 0)
        return;
    mseq_t *q = &w->m.sq[si];
    kvp_pcache_ref_t refs[RM_LEN];
    uint32_t rgen[RM_LEN], max = 1 + rnd(w, 4), n = 0, got;
    TRACE(w, "take %llu\n", (unsigned long long)q->id);
    kvp_seq_t *s = kvp_seqtab_find(w->t, 0, q->id);
    do {
        uint32_t m = max < RM_LEN - n ? max : RM_LEN - n;
        got = kvp_pcache_take_unpublished(w->c, s, refs + n, m);
        WCHECK(w, got <= m, "take_unpublished returned %u of at most %u", got, m);
        n += got;
        if (got < m)
            break;
    } while (n < RM_LEN);
    uint32_t want = q->chain ? q->nkeyed - q->handed : 0;
    /* an ended chain may keep handing out what it keyed before it ended, or nothing */
    WCHECK(w, n == want || (q->chain == 2 && n == 0),
           "take_unpublished: %u refs, model %u "
           "(chain %u)",
           n, want, q->chain);
    for (uint32_t i = 0; i < n; i++) {
        WCHECK(w, refs[i].page == q->pages[q->handed + i], "ref %u: page %u, model %u", i,
               refs[i].page, q->pages[q->handed + i]);
        rgen[i] = w->m.pg[refs[i].page].gen;
    }
    q->handed = q->nkeyed;
    if (rnd(w, 2)) {
        rm_publish(w, refs, rgen, n);
        return;
    }
    rm_pend(w, refs, rgen, n);
}

/* Refs published later (a commit whose event is pending, a job whose copy runs): the oldest
 * goes when the list is full. */
static void rm_pend(world_t *w, const kvp_pcache_ref_t *refs, const uint32_t *rgen, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        if (w->nrefs == RM_REFS) {
            memmove(w->refs, w->refs + 1, (RM_REFS - 1) * sizeof(w->refs[0]));
            memmove(w->rgen, w->rgen + 1, (RM_REFS - 1) * sizeof(w->rgen[0]));
            w->nrefs--;
        }
        w->refs[w->nrefs] = refs[i];
        w->rgen[w->nrefs++] = rgen[i];
    }
}

static void op_publish_pending(world_t *w)
{
    if (!w->nrefs)
        return;
    uint32_t from = rnd(w, w->nrefs), n = 1 + rnd(w, w->nrefs - from);
    rm_publish(w, w->refs + from, w->rgen + from, n);
    memmove(w->refs + from, w->refs + from + n, (w->nrefs - from - n) * sizeof(w->refs[0]));
    memmove(w->rgen + from, w->rgen + from + n, (w->nrefs - from - n) * sizeof(w->rgen[0]));
    w->nrefs -= n;
}

static void op_publish_seq(world_t *w)
{
    int si = pick_live(w);
    if (si < 0)
        return;
    mseq_t *q = &w->m.sq[si];
    kvp_pcache_ref_t refs[RM_LEN];
    uint32_t n = 0;
    uint8_t set[RM_LEN] = {0};
    if (q->chain)
        for (uint32_t i = q->handed; i < q->nkeyed; i++)
            refs[n++].page = q->pages[i];
    /* the model's publish on its own, then the call */
    uint32_t want = 0;
    for (uint32_t i = 0; i < n; i++) {
        mpage_t *g = &w->m.pg[refs[i].page];
        if (g->keyed && g->ref && !g->indexed && m_find(w, g->scope, g->key) < 0) {
            g->indexed = 1;
            set[i] = 1;
            want++;
        }
    }
    TRACE(w, "publish_seq %llu: model %u\n", (unsigned long long)q->id, want);
    uint32_t got = kvp_pcache_publish_seq(w->c, kvp_seqtab_find(w->t, 0, q->id));
    WCHECK(w, got == want || (q->chain == 2 && got == 0), "publish_seq: %u, model %u", got, want);
    if (got != want) /* an ended chain that hands out nothing: undo the model's publish */
        for (uint32_t i = 0; i < n; i++)
            if (set[i])
                w->m.pg[refs[i].page].indexed = 0;
    q->handed = q->nkeyed;
    w->n_pub += got;
}

static void op_retention(world_t *w)
{
    int si = pick_live(w);
    if (si < 0)
        return;
    mseq_t *q = &w->m.sq[si];
    uint32_t prio = rm_prios[rnd(w, 7)], ret = rm_rets[rnd(w, 5)];
    if (q->chain == 2)
        return;
    TRACE(w, "retention %llu %u %u\n", (unsigned long long)q->id, prio, ret);
    int rc = kvp_pcache_set_retention(w->c, kvp_seqtab_find(w->t, 0, q->id), prio, ret);
    if (q->chain == 0) {
        WCHECK(w, rc == KVP_EINVAL, "set_retention without a chain: %s", kvp_errname(rc));
        return;
    }
    WCHECK(w, rc == 0, "set_retention: %s", kvp_errname(rc));
    q->prio = prio;
    q->ret_ms = ret;
    for (uint32_t i = 0; i < q->nkeyed; i++)
        m_raise(&w->m.pg[q->pages[i]], prio, ret);
}

static void op_pin(world_t *w)
{
    int32_t toks[RM_LEN];
    uint32_t b = rnd(w, RM_PROMPTS), n = 1 + rnd(w, RM_LEN), salt = rnd(w, 2), scope = rnd(w, 2);
    uint32_t ns = rnd(w, RM_NS);
    if (ns == 1 && rnd(w, 8) == 0) { /* ns 1's quota moves, below its use too */
        w->quota[1] = rnd(w, 9);
        TRACE(w, "quota ns 1 = %llu\n", (unsigned long long)w->quota[1]);
        WCHECK(w, kvp_pcache_set_pin_quota(w->c, 1, w->quota[1]) == 0, "set_pin_quota");
    }
    memcpy(toks, w->base[b], sizeof(toks));
    uint64_t ttl = 1 + rnd(w, 300), used = 0;
    uint32_t live = 0, pages[RM_LEN];
    for (int i = 0; i < RM_PINS; i++)
        if (w->m.pin[i].live) {
            live++;
            if (w->m.pin[i].ns == ns)
                used += w->m.pin[i].n;
        }
    for (int again = 1; again;) { /* unique expiries (next_expiry is then exact) */
        again = 0;
        for (int i = 0; i < RM_PINS; i++)
            if (w->m.pin[i].live && w->m.pin[i].exp == w->now + ttl)
                again = 1, ttl++;
    }
    uint32_t f = m_lookup(w, scope, w->roots[salt], toks, n, UINT32_MAX, pages);
    int over = used + f > w->quota[ns] || live == RM_PINS;
    uint64_t pid = 0;
    uint32_t got = 0;
    TRACE(w, "pin ns %u prompt %u n %u salt %u scope %u ttl %llu: model f %u over %d\n", ns, b, n,
          salt, scope, (unsigned long long)ttl, f, over);
    int rc = kvp_pcache_pin(w->c, ns, scope, w->roots[salt], toks, n, w->now, ttl, &pid, &got);
    if (f == 0) {
        WCHECK(w, rc == KVP_ENOENT || (over && rc == KVP_ELIMIT), "pin of nothing: %s",
               kvp_errname(rc));
        return;
    }
    if (over) {
        WCHECK(w, rc == KVP_ELIMIT, "pin over quota: %s", kvp_errname(rc));
        w->n_pin_limit++;
        return;
    }
    WCHECK(w, rc == 0 && got == f && pid != 0, "pin: %s, %u pages, model %u", kvp_errname(rc), got,
           f);
    for (int i = 0; i < RM_PINS; i++)
        if (!w->m.pin[i].live) {
            mpin_t *pn = &w->m.pin[i];
            pn->live = 1;
            pn->id = pid;
            pn->ns = ns;
            pn->scope = scope;
            pn->n = f;
            pn->exp = w->now + ttl;
            memcpy(pn->pages, pages, f * sizeof(uint32_t));
            break;
        }
    for (uint32_t i = 0; i < f; i++)
        m_addref(w, pages[i], 1);
    w->n_pin++;
}

static void m_drop_pin(world_t *w, mpin_t *pn)
{
    for (uint32_t i = pn->n; i-- > 0;)
        m_unref(w, pn->pages[i], 1);
    pn->live = 0;
}

static void op_unpin(world_t *w)
{
    int live[RM_PINS], n = 0;
    for (int i = 0; i < RM_PINS; i++)
        if (w->m.pin[i].live)
            live[n++] = i;
    if (!n)
        return;
    mpin_t *pn = &w->m.pin[live[rnd(w, (uint32_t)n)]];
    if (rnd(w, 4) == 0) {
        int rc = kvp_pcache_unpin(w->c, (pn->ns + 1) % RM_NS, pn->id);
        WCHECK(w, rc == KVP_ENOENT, "unpin by another namespace: %s", kvp_errname(rc));
        return;
    }
    TRACE(w, "unpin %llu\n", (unsigned long long)pn->id);
    int rc = kvp_pcache_unpin(w->c, pn->ns, pn->id);
    WCHECK(w, rc == (int)pn->n, "unpin: %d, model %u", rc, pn->n);
    m_drop_pin(w, pn);
}

static void rm_trace_order(world_t *w)
{
    uint32_t want[RM_PAGES], got[RM_PAGES + 1];
    uint32_t nw = m_order(w, want), ng = kvp_pcache_eviction_order(w->c, got, RM_PAGES + 1);
    for (uint32_t i = 0; i < nw || i < ng; i++) {
        const mpage_t *g = i < nw ? &w->m.pg[want[i]] : NULL;
        TRACE(w, "  order[%u]: cache %d, model %d (prio %u ret %u rel %llu)\n", i,
              i < ng ? (int)got[i] : -1, g ? (int)want[i] : -1, g ? g->prio : 0, g ? g->ret_ms : 0,
              g ? (unsigned long long)g->rel_ms : 0);
    }
}

static int rm_order_matches(world_t *w)
{
    uint32_t want[RM_PAGES], got[RM_PAGES + 1];
    uint32_t nw = m_order(w, want), ng = kvp_pcache_eviction_order(w->c, got, RM_PAGES + 1);
    return nw == ng && memcmp(want, got, nw * sizeof(uint32_t)) == 0;
}

/* Drops the pins whose time is up, in the order of ids[0..nids) (the cache's own pin order:
 * the semantics leave the order of pins expiring in one call open, and it decides where their
 * pages go in the eviction order). */
static uint32_t m_expire_pins(world_t *w, uint64_t now, const uint64_t *ids, uint32_t nids)
{
    uint32_t n = 0;
    for (uint32_t k = 0; k < nids; k++)
        for (int i = 0; i < RM_PINS; i++)
            if (w->m.pin[i].live && w->m.pin[i].id == ids[k] && w->m.pin[i].exp <= now) {
                m_drop_pin(w, &w->m.pin[i]);
                n++;
            }
    return n;
}

static void op_expire(world_t *w)
{
    w->now += rnd(w, 60);
    TRACE(w, "expire\n");
    uint64_t ids[RM_PINS];
    uint32_t nids = 0, cur = 0;
    kvp_pcache_pin_info_t pi;
    while (nids < RM_PINS && kvp_pcache_next_pin(w->c, &cur, &pi) == 0)
        ids[nids++] = pi.pin_id;
    uint32_t got = kvp_pcache_expire(w->c, w->now);
    /* pins first, then retention; the other way round is as good (both "at now") */
    w->save = w->m;
    uint32_t want = m_expire_pins(w, w->now, ids, nids);
    w->n_demote += m_demote(w, w->now);
    if (!rm_order_matches(w)) {
        w->m = w->save;
        m_demote(w, w->now);
        m_expire_pins(w, w->now, ids, nids);
        rm_trace_order(w);
    }
    WCHECK(w, got == want, "expire: %u pins, model %u", got, want);
    w->n_expire += got;
}

static void op_flush(world_t *w)
{
    uint32_t which = rnd(w, 3), scope = which == 2 ? KVP_PCACHE_NO_SCOPE : which, want = 0;
    for (uint32_t p = 0; p < w->np; p++) {
        mpage_t *g = &w->m.pg[p];
        if (g->cached && (scope == KVP_PCACHE_NO_SCOPE || g->scope == scope)) {
            m_evict(w, p, KVP_EVICT_FLUSH);
            want++;
        }
    }
    TRACE(w, "flush %u: model %u\n", scope, want);
    uint32_t got = kvp_pcache_flush(w->c, scope);
    WCHECK(w, got == want, "flush of scope %u: %u, model %u", scope, got, want);
    w->n_flush += got;
}

static uint64_t rm_ops(uint64_t dflt)
{
    const char *e = getenv("KVP_PCACHE_OPS");
    return e && *e ? strtoull(e, NULL, 10) : dflt;
}

static void random_run(uint32_t ps, uint32_t np, uint64_t seed, uint64_t ops)
{
    world_t *w = calloc(1, sizeof(*w));
    ck_assert_ptr_nonnull(w);
    rm_trace = getenv("KVP_PCACHE_TRACE") && atoi(getenv("KVP_PCACHE_TRACE"));
    w->ps = ps;
    w->np = np;
    kvp_seqtab_config_t cfg = {.max_seqs = 64, .max_namespaces = RM_NS, .max_seq_tokens = RM_LEN};
    kvp_pcache_config_t pc = {.max_scopes = 2, .max_pins = RM_PINS};
    ck_assert_int_eq(kvp_alloc_create(np, &w->a), 0);
    ck_assert_int_eq(kvp_seqtab_create(w->a, ps, &cfg, &w->t), 0);
    ck_assert_int_eq(kvp_pcache_create(w->t, &pc, &w->c), 0);
    for (uint32_t ns = 0; ns < RM_NS; ns++) {
        w->quota[ns] = rm_quota[ns];
        ck_assert_int_eq(kvp_pcache_set_pin_quota(w->c, ns, rm_quota[ns]), 0);
    }
    ck_assert_int_eq(kvp_pcache_set_pin_quota(w->c, RM_NS, 1), KVP_EINVAL);
    kvp_plan_init(&w->plan);
    kvp_rng_seed(&w->r, seed);
    /* prompts 0 and 1 share their first 6 tokens, 2 and 3 their first 3 */
    for (uint32_t i = 0; i < RM_LEN; i++) {
        w->base[0][i] = (int32_t)i;
        w->base[1][i] = i < 6 ? (int32_t)i : 100 + (int32_t)i;
        w->base[2][i] = 200 + (int32_t)i;
        w->base[3][i] = i < 3 ? 200 + (int32_t)i : 300 + (int32_t)i;
    }
    for (int i = 0; i < 2; i++)
        ck_assert_int_eq(
            kvp_pagekey_root(rm_salt[i], rm_salt[i] ? strlen(rm_salt[i]) : 0, &w->roots[i]), 0);
    memset(w->shadow, 0xff, sizeof(w->shadow));
    for (w->op = 0; w->op < ops; w->op++) {
        w->now += rnd(w, 3);
        kvp_pcache_set_now(w->c, w->now);
        uint32_t r = rnd(w, 100);
        if (r < 36)
            op_append(w);
        else if (r < 43)
            op_fork(w);
        else if (r < 53)
            op_truncate(w);
        else if (r < 63)
            op_release(w);
        else if (r < 73)
            op_take(w);
        else if (r < 78)
            op_publish_pending(w);
        else if (r < 83)
            op_publish_seq(w);
        else if (r < 86)
            op_retention(w);
        else if (r < 91)
            op_pin(w);
        else if (r < 94)
            op_unpin(w);
        else if (r < 98)
            op_expire(w);
        else
            op_flush(w);
        rm_check(w);
    }
    printf("test_pcache random ps=%u pages=%u seed=%llu ops=%llu: ok=%llu enospc=%llu "
           "evicted=%llu hit_pages=%llu rewrites=%llu cow=%llu published=%llu twins=%llu "
           "stale=%llu pins=%llu pin_limits=%llu pin_expiries=%llu demoted=%llu flushed=%llu "
           "tail_rewrites=%llu job_refs=%llu\n",
           ps, np, (unsigned long long)seed, (unsigned long long)ops, (unsigned long long)w->n_ok,
           (unsigned long long)w->n_enospc, (unsigned long long)w->n_evict,
           (unsigned long long)w->n_hit, (unsigned long long)w->n_rewrite,
           (unsigned long long)w->n_cow, (unsigned long long)w->n_pub,
           (unsigned long long)w->n_twin, (unsigned long long)w->n_stale,
           (unsigned long long)w->n_pin, (unsigned long long)w->n_pin_limit,
           (unsigned long long)w->n_expire, (unsigned long long)w->n_demote,
           (unsigned long long)w->n_flush, (unsigned long long)w->n_tail_rewrite,
           (unsigned long long)w->n_job_refs);
    fflush(stdout);
    /* the run must have exercised every path */
    if (ops >= 20000)
        ck_assert_msg(w->n_ok && w->n_enospc && w->n_evict && w->n_hit &&
                          ((w->n_rewrite && w->n_cow && w->n_tail_rewrite) || ps == 1) &&
                          w->n_job_refs && w->n_pub && w->n_twin && w->n_stale && w->n_pin &&
                          w->n_pin_limit && w->n_expire && w->n_demote && w->n_flush,
                      "seed %llu: a path was never taken (see the counts above)",
                      (unsigned long long)seed);
    /* everything back: sequences, pins, then the cached pages */
    for (int i = 0; i < RM_SEQS; i++)
        if (w->m.sq[i].live)
            ck_assert_int_eq(kvp_seqtab_release(w->t, 0, w->m.sq[i].id), 0);
    for (int i = 0; i < RM_PINS; i++)
        if (w->m.pin[i].live)
            ck_assert_int_eq(kvp_pcache_unpin(w->c, w->m.pin[i].ns, w->m.pin[i].id),
                             (int)w->m.pin[i].n);
    kvp_pcache_flush(w->c, KVP_PCACHE_NO_SCOPE);
    ck_assert_uint_eq(kvp_alloc_num_free(w->a), np);
    char msg[256] = "";
    ck_assert_msg(kvp_pcache_audit(w->c, msg, sizeof(msg)) == 0, "audit: %s", msg);
    kvp_plan_free(&w->plan);
    kvp_pcache_destroy(w->c);
    kvp_seqtab_destroy(w->t);
    kvp_alloc_destroy(w->a);
    free(w);
}

/* Default: sized for CI (about 20 s in the ASan build, a few in release); KVP_PCACHE_OPS sets
 * the operations of each of the three page sizes (tests/README.md: the long run). */
#define RM_DEFAULT_OPS 150000

START_TEST(random_operations_match_the_model)
{
    static const uint32_t ps[] = {4, 1, 3}, np[] = {24, 48, 28};
    const char *only = getenv("KVP_PCACHE_CASE"); /* replay one page size: 0, 1 or 2 */
    if (only && *only && atoi(only) != _i)
        return;
    uint64_t seed = kvp_test_seed(0x9cac4e) + (uint64_t)_i * 104729;
    random_run(ps[_i], np[_i], seed, rm_ops(RM_DEFAULT_OPS));
}
END_TEST

static Suite *pcache_suite(void)
{
    Suite *s = suite_create("pcache");
    TCase *tc = tcase_create("pcache");
    tcase_set_timeout(tc, 3600);
    tcase_add_test(tc, create_and_bad_arguments);
    tcase_add_test(tc, keys_appear_when_pages_fill_and_publish_makes_them_findable);
    tcase_add_test(tc, page_size_one_keys_every_token);
    tcase_add_test(tc, second_page_with_the_same_key_stays_unindexed);
    tcase_add_test(tc, reuse_links_floor_of_full_pages);
    tcase_add_test(tc, release_caches_and_pressure_evicts_in_order);
    tcase_add_test(tc, retention_duration_demotes_to_the_default_priority);
    tcase_add_test(tc, pins_hold_pages_within_quota);
    tcase_add_test(tc, flush_drops_cached_pages_of_one_scope);
    tcase_add_test(tc, truncate_rewrites_or_keeps_and_continues_or_ends_the_chain);
    tcase_add_test(tc, append_without_token_ids_ends_the_chain);
    tcase_add_test(tc, reserve_over_free_plus_cached_changes_nothing);
    tcase_add_test(tc, fork_shares_the_chain);
    tcase_add_test(tc, a_stale_ref_does_not_publish);
    tcase_add_test(tc,
                   a_keyed_partial_page_is_copied_while_shared_and_rewritten_by_its_last_holder);
    tcase_add_test(tc, an_append_publishes_exactly_the_pages_it_wrote);
    tcase_add_test(tc, the_chain_remembers_the_tokens_of_one_full_page);
    tcase_add_test(tc, a_scope_is_reset_only_when_nothing_of_it_lives_on);
    tcase_add_test(tc, flushed_pages_stay_out_of_the_residence_histogram);
    tcase_add_test(tc, destroy_forgets_keys_and_returns_cached_pages);
    tcase_add_test(tc, scope_reset_needs_an_empty_scope);
    suite_add_tcase(s, tc);
    TCase *tr = tcase_create("random"); /* CK_RUN_CASE=random runs only it */
    tcase_set_timeout(tr, 3600);
    tcase_add_loop_test(tr, random_operations_match_the_model, 0, 3);
    suite_add_tcase(s, tr);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(pcache_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
