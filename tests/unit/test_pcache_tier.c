/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_pcache_tier.c - the prefix cache's host tier (issue #28) case by case: locations, the
 * usable limit of host slots, asynchronous demotion (kvp_pcache_demote_begin / _end: ok,
 * failed, cancelled by a link, a pin or a flush; host evictions by priority then age; a lower
 * limit with moves in flight), kvp_pcache_lookup_tiers and its counters, promotion through the
 * planner (reuse + promote: the restores list exact, pages pinned and RESTORING, two items of a
 * batch on one key, leave_last, ENOSPC changing nothing), kvp_pcache_restore_end ok, failed and
 * late, retention in the host tier, pressure that never demotes, and the audit catching broken
 * tier states. The random model run is test_pcache_tier_model.c.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_pagekey.h"
#include "kvp_pcache.h"
#include "kvp_pcache_internal.h"
#include "kvp_plan.h"
#include "kvp_test_util.h"

/* ---- fixture ------------------------------------------------------------------------------ */

typedef struct {
    kvp_alloc_t *a;
    kvp_seqtab_t *t;
    kvp_pcache_t *c;
    kvp_plan_t p;
    uint32_t ps;
    uint64_t now;
    kvp_pcache_move_t mv[64];
} fx_t;

static void fx_init(fx_t *f, uint32_t pages, uint32_t ps, uint32_t host_slots, uint32_t limit)
{
    memset(f, 0, sizeof(*f));
    kvp_seqtab_config_t cfg = {.max_seqs = 64, .max_namespaces = 4, .max_seq_tokens = 0};
    kvp_pcache_config_t pc = {.max_scopes = 2, .max_pins = 4, .host_slots = host_slots};
    ck_assert_int_eq(kvp_alloc_create(pages, &f->a), 0);
    ck_assert_int_eq(kvp_seqtab_create(f->a, ps, &cfg, &f->t), 0);
    ck_assert_int_eq(kvp_pcache_create(f->t, &pc, &f->c), 0);
    kvp_pcache_set_host_limit(f->c, limit);
    kvp_plan_init(&f->p);
    f->ps = ps;
}

static void fx_audit(const fx_t *f)
{
    char msg[256] = "";
    int rc = kvp_pcache_audit(f->c, msg, sizeof(msg));
    ck_assert_msg(rc == 0, "audit: %s (%s)", msg, kvp_errname(rc));
}

static void audit_fails_with(const fx_t *f, const char *needle)
{
    char msg[256] = "";
    ck_assert_int_eq(kvp_pcache_audit(f->c, msg, sizeof(msg)), KVP_EAUDIT);
    ck_assert_msg(strstr(msg, needle) != NULL, "audit said '%s', expected '%s'", msg, needle);
}

static void fx_fini(fx_t *f)
{
    fx_audit(f);
    kvp_plan_free(&f->p);
    kvp_pcache_destroy(f->c);
    kvp_seqtab_destroy(f->t);
    ck_assert_uint_eq(kvp_alloc_num_free(f->a), kvp_alloc_num_pages(f->a));
    ck_assert_uint_eq(kvp_alloc_num_pinned_free(f->a), 0);
    kvp_alloc_destroy(f->a);
}

static kvp_plan_cache_t co(uint32_t scope, int reuse, uint32_t prio, uint32_t ret)
{
    kvp_plan_cache_t c = {
        .scope = scope, .reuse = (uint8_t)reuse, .priority = (uint8_t)prio, .retention_ms = ret};
    return c;
}

static kvp_plan_cache_t promo(uint32_t scope)
{
    kvp_plan_cache_t c = co(scope, 1, KVP_PCACHE_DEFAULT_PRIORITY, 0);
    c.promote = 1;
    return c;
}

#define DEF   co(0, 0, KVP_PCACHE_DEFAULT_PRIORITY, 0)
#define REUSE co(0, 1, KVP_PCACHE_DEFAULT_PRIORITY, 0)
#define PROMO promo(0)

static int app_c(fx_t *f, uint64_t id, const int32_t *toks, uint32_t n, kvp_plan_cache_t c)
{
    kvp_plan_item_t it = {0, id, n};
    kvp_plan_content_t ct = {toks, NULL, 0};
    return kvp_plan_append_cached(f->t, &it, &ct, 1, NULL, &c, f->now, &f->p);
}

static void app(fx_t *f, uint64_t id, const int32_t *toks, uint32_t n, kvp_plan_cache_t c)
{
    int rc = app_c(f, id, toks, n, c);
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

static void release(fx_t *f, uint64_t id, uint64_t now)
{
    kvp_pcache_set_now(f->c, now);
    ck_assert_int_eq(kvp_seqtab_release(f->t, 0, id), 0);
}

static kvp_pagekey_t key_at(const int32_t *toks, uint32_t i, uint32_t ps)
{
    kvp_pagekey_t root, keys[64];
    ck_assert_int_eq(kvp_pagekey_root(NULL, 0, &root), 0);
    ck_assert_uint_eq(kvp_pagekey_chain(root, toks, (uint64_t)(i + 1) * ps, ps, keys, 64), i + 1);
    return keys[i];
}

static kvp_pagekey_t root0(void)
{
    kvp_pagekey_t root;
    ck_assert_int_eq(kvp_pagekey_root(NULL, 0, &root), 0);
    return root;
}

static uint32_t look(const fx_t *f, const int32_t *toks, uint32_t n)
{
    return kvp_pcache_lookup(f->c, 0, root0(), toks, n, 0);
}

/* lookup_tiers without counting: returns both tiers' pages, *gpu the GPU's leading ones */
static uint32_t look2(const fx_t *f, const int32_t *toks, uint32_t n, uint32_t *gpu)
{
    return kvp_pcache_lookup_tiers(f->c, 0, root0(), toks, n, 0, gpu);
}

static kvp_pcache_stats_t stats(const fx_t *f)
{
    kvp_pcache_stats_t s;
    kvp_pcache_stats(f->c, &s);
    return s;
}

static void gpu_order_is(const fx_t *f, const uint32_t *want, uint32_t n)
{
    uint32_t got[64];
    uint32_t m = kvp_pcache_eviction_order(f->c, got, 64);
    ck_assert_uint_eq(m, n);
    for (uint32_t i = 0; i < n; i++)
        ck_assert_msg(got[i] == want[i], "GPU order[%u] = %u, want %u", i, got[i], want[i]);
}

/* The host medium's order holds exactly slots want[0..n). */
static void host_order_is(const fx_t *f, const uint32_t *want, uint32_t n)
{
    kvp_loc_t got[64];
    uint32_t m = kvp_pcache_eviction_order_in(f->c, KVP_MEDIUM_HOST, got, 64);
    ck_assert_uint_eq(m, n);
    for (uint32_t i = 0; i < n; i++)
        ck_assert_msg(kvp_loc_eq(got[i], kvp_loc(KVP_MEDIUM_HOST, want[i])),
                      "host order[%u] = {%u,%u}, want host slot %u", i, got[i].medium, got[i].index,
                      want[i]);
}

static void loc_is(kvp_loc_t got, uint32_t medium, uint32_t index)
{
    ck_assert_msg(got.medium == medium && got.index == index, "location {%u,%u}, want {%u,%u}",
                  got.medium, got.index, medium, index);
}

static void move_is(const kvp_pcache_move_t *m, const fx_t *f, uint32_t page, uint32_t slot)
{
    ck_assert_uint_eq(m->page, page);
    ck_assert_uint_eq(m->slot, slot);
    ck_assert_uint_eq(m->gen, f->c->gen[page]);
}

static unsigned host_state(const fx_t *f, uint32_t j)
{
    return kvp_pcache_loc_state(f->c, kvp_loc(KVP_MEDIUM_HOST, j));
}

#define ENTRY (KVP_PAGE_KEYED | KVP_PAGE_INDEXED)

static int32_t A[64], B[64], C[64], D[64];

static void prompts(void)
{
    for (int i = 0; i < 64; i++) {
        A[i] = 100 + i;
        B[i] = 500 + i;
        C[i] = 900 + i;
        D[i] = 1300 + i;
    }
}

/* 4 pages of 4 tokens, all cached: A (a0 a1) released at 100, B (b0 b1) at 110. GPU eviction
 * order a1 a0 b1 b0; nothing else free. */
static void four_cached(fx_t *f, uint32_t *a0, uint32_t *a1, uint32_t *b0, uint32_t *b1)
{
    prompts();
    app(f, 1, A, 8, DEF);
    app(f, 2, B, 8, DEF);
    ck_assert_uint_eq(kvp_pcache_publish_seq(f->c, seq(f, 1)), 2);
    ck_assert_uint_eq(kvp_pcache_publish_seq(f->c, seq(f, 2)), 2);
    *a0 = pg(f, 1, 0), *a1 = pg(f, 1, 1), *b0 = pg(f, 2, 0), *b1 = pg(f, 2, 1);
    release(f, 1, 100);
    release(f, 2, 110);
    uint32_t want[] = {*a1, *a0, *b1, *b0};
    gpu_order_is(f, want, 4);
    ck_assert_uint_eq(kvp_alloc_num_free(f->a), kvp_alloc_num_pages(f->a) - 4);
}

/* four_cached, then A's two pages demoted (a1 into slot 0, a0 into slot 1) and ended ok. */
static void a_in_host(fx_t *f, uint32_t *a0, uint32_t *a1, uint32_t *b0, uint32_t *b1)
{
    four_cached(f, a0, a1, b0, b1);
    const uint32_t want = kvp_alloc_num_free(f->a) + 2;
    ck_assert_uint_eq(kvp_pcache_demote_begin(f->c, 200, want, 8, f->mv), 2);
    ck_assert_uint_eq(kvp_pcache_demote_end(f->c, f->mv, 2, 1), 2);
    loc_is(kvp_pcache_locate(f->c, 0, key_at(A, 1, 4)), KVP_MEDIUM_HOST, 0);
    loc_is(kvp_pcache_locate(f->c, 0, key_at(A, 0, 4)), KVP_MEDIUM_HOST, 1);
    fx_audit(f);
}

/* ---- locations and the limit -------------------------------------------------------------- */

START_TEST(locations_name_gpu_pages_and_host_slots)
{
    fx_t f;
    fx_init(&f, 4, 4, 2, 2);
    prompts();
    app(&f, 1, A, 4, DEF);
    const uint32_t p = pg(&f, 1, 0);
    ck_assert_uint_eq(kvp_pcache_publish_seq(f.c, seq(&f, 1)), 1);
    const kvp_pagekey_t k = key_at(A, 0, 4);
    loc_is(kvp_pcache_locate(f.c, 0, k), KVP_MEDIUM_GPU, p);
    ck_assert(kvp_loc_is_none(kvp_pcache_locate(f.c, 1, k))); /* another scope */
    ck_assert(kvp_loc_is_none(kvp_pcache_locate(f.c, 0, key_at(B, 0, 4))));
    ck_assert_uint_eq(kvp_pcache_loc_state(f.c, kvp_loc(KVP_MEDIUM_GPU, p)), ENTRY);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, p), ENTRY);
    kvp_pagekey_t got;
    uint32_t scope = 9;
    ck_assert_int_eq(kvp_pcache_loc_key(f.c, kvp_loc(KVP_MEDIUM_GPU, p), &got, &scope), 0);
    ck_assert(kvp_pagekey_eq(got, k));
    ck_assert_uint_eq(scope, 0);
    /* free host slots, slots and pages out of range, no location */
    ck_assert_uint_eq(host_state(&f, 0), 0);
    ck_assert_uint_eq(host_state(&f, 2), 0);
    ck_assert_uint_eq(kvp_pcache_loc_state(f.c, kvp_loc(KVP_MEDIUM_GPU, 4)), 0);
    ck_assert_uint_eq(kvp_pcache_loc_state(f.c, kvp_loc_none()), 0);
    ck_assert_int_eq(kvp_pcache_loc_key(f.c, kvp_loc(KVP_MEDIUM_HOST, 1), NULL, NULL), KVP_ENOENT);
    ck_assert_int_eq(kvp_pcache_loc_key(f.c, kvp_loc_none(), NULL, NULL), KVP_ENOENT);
    kvp_loc_t out[4];
    ck_assert_uint_eq(kvp_pcache_eviction_order_in(f.c, KVP_MEDIUM_HOST, out, 4), 0);
    ck_assert_uint_eq(kvp_pcache_eviction_order_in(f.c, KVP_MEDIUMS, out, 4), 0);
    release(&f, 1, 10);
    ck_assert_uint_eq(kvp_pcache_eviction_order_in(f.c, KVP_MEDIUM_GPU, out, 4), 1);
    loc_is(out[0], KVP_MEDIUM_GPU, p);
    ck_assert_int_eq(kvp_pcache_restoring(f.c, p), 0);
    ck_assert_int_eq(kvp_pcache_restoring(f.c, 4), 0);
    fx_fini(&f);
}
END_TEST

START_TEST(the_limit_starts_at_zero_and_is_clamped)
{
    fx_t f;
    fx_init(&f, 4, 4, 3, 0);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.host_slots_usable, 0);
    ck_assert_uint_eq(st.host_free, 0);
    uint32_t a0, a1, b0, b1;
    four_cached(&f, &a0, &a1, &b0, &b1);
    /* no usable slot: nothing is demoted, the pages stay cached */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 4, 4, f.mv), 0);
    ck_assert_uint_eq(stats(&f).cached_pages, 4);
    kvp_pcache_set_host_limit(f.c, 100); /* clamped to host_slots */
    st = stats(&f);
    ck_assert_uint_eq(st.host_slots_usable, 3);
    ck_assert_uint_eq(st.host_free, 3);
    for (uint32_t j = 0; j < 3; j++)
        ck_assert_uint_eq(host_state(&f, j), 0);
    fx_audit(&f);
    kvp_pcache_set_host_limit(f.c, 1);
    st = stats(&f);
    ck_assert_uint_eq(st.host_slots_usable, 1);
    ck_assert_uint_eq(st.host_free, 1);
    ck_assert_uint_eq(st.host_evictions, 0);
    fx_audit(&f);
    /* one slot: one demotion, whatever the watermark asks */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 4, 4, f.mv), 1);
    move_is(&f.mv[0], &f, a1, 0);
    ck_assert_uint_eq(stats(&f).host_free, 0);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 1), 1);
    fx_audit(&f);
    fx_fini(&f);

    /* pages + host slots must leave room for the no-slot value */
    kvp_alloc_t *a;
    kvp_seqtab_t *t;
    kvp_pcache_t *c = NULL;
    kvp_seqtab_config_t cfg = {.max_seqs = 4, .max_namespaces = 1, .max_seq_tokens = 0};
    ck_assert_int_eq(kvp_alloc_create(4, &a), 0);
    ck_assert_int_eq(kvp_seqtab_create(a, 4, &cfg, &t), 0);
    kvp_pcache_config_t pc = {.max_scopes = 1, .max_pins = 1, .host_slots = UINT32_MAX - 4};
    ck_assert_int_eq(kvp_pcache_create(t, &pc, &c), KVP_EINVAL);
    ck_assert_ptr_null(c);
    pc.host_slots = 0; /* no tier: a limit changes nothing */
    ck_assert_int_eq(kvp_pcache_create(t, &pc, &c), 0);
    kvp_pcache_set_host_limit(c, 8);
    kvp_pcache_stats_t s0;
    kvp_pcache_stats(c, &s0);
    ck_assert_uint_eq(s0.host_slots_usable, 0);
    ck_assert_uint_eq(s0.host_free, 0);
    char msg[128];
    ck_assert_int_eq(kvp_pcache_audit(c, msg, sizeof(msg)), 0);
    kvp_pcache_destroy(c);
    kvp_seqtab_destroy(t);
    kvp_alloc_destroy(a);
}
END_TEST

/* ---- demotion ----------------------------------------------------------------------------- */

START_TEST(a_demotion_moves_the_entry_when_its_copy_ends)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    four_cached(&f, &a0, &a1, &b0, &b1);
    /* 2 short of 2 free: the head of the order, a1 then a0, the lowest slots first */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 2, 8, f.mv), 2);
    move_is(&f.mv[0], &f, a1, 0);
    move_is(&f.mv[1], &f, a0, 1);
    const unsigned demoting = ENTRY | KVP_PAGE_DEMOTING;
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a1), demoting);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a0), demoting);
    ck_assert_uint_eq(host_state(&f, 0), KVP_SLOT_BUSY);
    ck_assert_uint_eq(host_state(&f, 1), KVP_SLOT_BUSY);
    /* in flight: still the GPU entry, neither free nor available */
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 1, 4)), KVP_MEDIUM_GPU, a1);
    ck_assert_uint_eq(kvp_pcache_find(f.c, 0, key_at(A, 0, 4)), a0);
    ck_assert_uint_eq(look(&f, A, 8), 2);
    ck_assert_uint_eq(kvp_alloc_num_free(f.a), 0);
    ck_assert_uint_eq(kvp_alloc_num_cached(f.a), 2);
    ck_assert_uint_eq(kvp_alloc_num_available(f.a), 2);
    ck_assert_uint_eq(kvp_alloc_num_demoting(f.a), 2);
    kvp_stats_t ts;
    kvp_seqtab_stats(f.t, &ts);
    ck_assert_uint_eq(ts.demoting, 2);
    ck_assert_uint_eq(ts.used_pages, 0);
    ck_assert_uint_eq(ts.cached_pages, 2);
    uint32_t gw[] = {b1, b0};
    gpu_order_is(&f, gw, 2);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.demoting, 2);
    ck_assert_uint_eq(st.host_busy, 2);
    ck_assert_uint_eq(st.host_free, 2);
    ck_assert_uint_eq(st.cached_pages, 2);
    ck_assert_uint_eq(st.indexed_pages, 4);
    ck_assert_uint_eq(st.demotions, 0);
    fx_audit(&f);
    /* the pages already demoting count toward the watermark: nothing more to start */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 2, 8, f.mv + 2), 0);
    /* the copies end: the entries live in the slots, the pages are free (a0 on top) */
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 2, 1), 2);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 1, 4)), KVP_MEDIUM_HOST, 0);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 0, 4)), KVP_MEDIUM_HOST, 1);
    ck_assert_uint_eq(kvp_pcache_find(f.c, 0, key_at(A, 0, 4)), UINT32_MAX);
    ck_assert_uint_eq(host_state(&f, 0), ENTRY);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a0), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a1), 0);
    uint32_t n;
    const uint32_t *stack = kvp_alloc_free_stack(f.a, &n);
    ck_assert_uint_eq(n, 2);
    ck_assert_uint_eq(stack[0], a1);
    ck_assert_uint_eq(stack[1], a0);
    st = stats(&f);
    ck_assert_uint_eq(st.demoting, 0);
    ck_assert_uint_eq(st.host_busy, 0);
    ck_assert_uint_eq(st.host_pages, 2);
    ck_assert_uint_eq(st.host_free, 2);
    ck_assert_uint_eq(st.indexed_pages, 2);
    ck_assert_uint_eq(st.demotions, 2);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_PRESSURE], 0);
    kvp_pcache_scope_stats_t ss;
    ck_assert_int_eq(kvp_pcache_scope_stats(f.c, 0, &ss), 0);
    ck_assert_uint_eq(ss.host_pages, 2);
    ck_assert_uint_eq(ss.indexed_pages, 2);
    uint32_t hw[] = {0, 1}; /* demotion order within one priority */
    host_order_is(&f, hw, 2);
    ck_assert_uint_eq(look(&f, A, 8), 0);
    uint32_t gpu = 9;
    ck_assert_uint_eq(look2(&f, A, 8, &gpu), 2);
    ck_assert_uint_eq(gpu, 0);
    fx_audit(&f);
    /* the same end again is not a move in flight any more: ignored */
    kvp_pcache_stats_t before = stats(&f);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 2, 1), 0);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 2, 0), 0);
    kvp_pcache_move_t bogus = {a0, 0, 7}; /* a slot out of range */
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, &bogus, 1, 1), 0);
    kvp_pcache_restore_end(f.c, f.mv, 2, 1); /* not restores either */
    kvp_pcache_stats_t after = stats(&f);
    ck_assert_int_eq(memcmp(&before, &after, sizeof(before)), 0);
    fx_audit(&f);
    fx_fini(&f);
}
END_TEST

START_TEST(a_failed_demotion_caches_the_page_again)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    four_cached(&f, &a0, &a1, &b0, &b1);
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 1, 8, f.mv), 1);
    move_is(&f.mv[0], &f, a1, 0);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 0), 0);
    /* back at its list's tail, cached; the slot is free again */
    uint32_t want[] = {a0, b1, b0, a1};
    gpu_order_is(&f, want, 4);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a1), ENTRY | KVP_PAGE_CACHED);
    ck_assert_uint_eq(host_state(&f, 0), 0);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.cached_pages, 4);
    ck_assert_uint_eq(st.demoting, 0);
    ck_assert_uint_eq(st.host_busy, 0);
    ck_assert_uint_eq(st.host_free, 4);
    ck_assert_uint_eq(st.host_pages, 0);
    ck_assert_uint_eq(st.demotions, 0);
    ck_assert_uint_eq(kvp_alloc_num_demoting(f.a), 0);
    fx_audit(&f);
    /* the next demotion takes the new head, into the lowest slot */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 210, 1, 8, f.mv), 1);
    move_is(&f.mv[0], &f, a0, 0);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 1), 1);
    fx_audit(&f);
    fx_fini(&f);
}
END_TEST

START_TEST(a_link_or_a_pin_cancels_a_demotion)
{
    fx_t f;
    fx_init(&f, 6, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    four_cached(&f, &a0, &a1, &b0, &b1);
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 4, 2, f.mv), 2); /* max 2: a1, a0 */
    move_is(&f.mv[0], &f, a1, 0);
    move_is(&f.mv[1], &f, a0, 1);
    /* reuse of A links both demoting pages: cancelled, held again */
    f.now = 210;
    app(&f, 3, A, 9, REUSE);
    ck_assert_uint_eq(f.p.cached_tokens[0], 8);
    ck_assert_uint_eq(f.p.num_evicted, 0); /* its third page came from the free stack */
    ck_assert_uint_eq(pg(&f, 3, 0), a0);
    ck_assert_uint_eq(pg(&f, 3, 1), a1);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a0), 1);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a0), ENTRY);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.demoting, 0);
    ck_assert_uint_eq(st.host_busy, 2); /* until the ends */
    ck_assert_uint_eq(st.hit_tokens, 8);
    ck_assert_uint_eq(kvp_alloc_num_demoting(f.a), 0);
    fx_audit(&f);
    /* the copies end: nothing moves, the slots are free, the pages stay the sequence's */
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 2, 1), 0);
    ck_assert_uint_eq(host_state(&f, 0), 0);
    ck_assert_uint_eq(host_state(&f, 1), 0);
    st = stats(&f);
    ck_assert_uint_eq(st.host_busy, 0);
    ck_assert_uint_eq(st.host_free, 4);
    ck_assert_uint_eq(st.host_pages, 0);
    ck_assert_uint_eq(st.demotions, 0);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a1), 1);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 1, 4)), KVP_MEDIUM_GPU, a1);
    fx_audit(&f);
    release(&f, 3, 300);

    /* a pin: B's pages demoting (the order is b1 b0 ... now), pinned, the demotion cancelled */
    uint32_t want[] = {b1, b0};
    uint32_t got[8];
    ck_assert_uint_eq(kvp_pcache_eviction_order(f.c, got, 8), 4);
    ck_assert_uint_eq(got[0], want[0]);
    ck_assert_uint_eq(got[1], want[1]);
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 310, 3, 1, f.mv), 1);
    move_is(&f.mv[0], &f, b1, 0);
    uint64_t pin;
    uint32_t pages = 0;
    ck_assert_int_eq(kvp_pcache_pin(f.c, 0, 0, root0(), B, 8, 310, 1000, &pin, &pages), 0);
    ck_assert_uint_eq(pages, 2);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, b1), 1);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, b1), ENTRY);
    ck_assert_uint_eq(stats(&f).demoting, 0);
    fx_audit(&f);
    /* a failed end of a cancelled demotion only frees the slot too */
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 0), 0);
    ck_assert_uint_eq(stats(&f).host_busy, 0);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, b1), 1);
    fx_audit(&f);
    ck_assert_int_eq(kvp_pcache_unpin(f.c, 0, pin), 2);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, b1), ENTRY | KVP_PAGE_CACHED);
    fx_audit(&f);
    fx_fini(&f);
}
END_TEST

/* A demoting page is not available, so linking it takes nothing from what allocation may use:
 * a full pool still has room for the rest. */
START_TEST(linking_demoting_pages_at_a_full_pool)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    four_cached(&f, &a0, &a1, &b0, &b1);
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 2, 8, f.mv), 2); /* a1, a0 */
    ck_assert_uint_eq(kvp_alloc_num_available(f.a), 2);
    f.now = 210;
    app(&f, 3, A, 14, REUSE); /* links a0 a1, needs 2 pages: b1, b0 evicted */
    ck_assert_uint_eq(f.p.cached_tokens[0], 8);
    ck_assert_uint_eq(f.p.num_evicted, 2);
    ck_assert_int_eq(f.p.kv_indices[2], (int)b1);
    ck_assert_int_eq(f.p.kv_indices[3], (int)b0);
    ck_assert_uint_eq(stats(&f).demoting, 0);
    fx_audit(&f);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 2, 1), 0);
    release(&f, 3, 300);
    fx_fini(&f);
}
END_TEST

/* Cancelled, cached again, demoted again into another slot: the first move's end must not
 * touch the second demotion. */
START_TEST(a_stale_end_leaves_a_newer_demotion_alone)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    four_cached(&f, &a0, &a1, &b0, &b1);
    kvp_pcache_move_t first;
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 1, 1, &first), 1);
    move_is(&first, &f, a1, 0);
    f.now = 210;
    app(&f, 3, A, 8, REUSE); /* cancels */
    release(&f, 3, 220);     /* cached again, at the tail: b1 b0 a1 a0 */
    uint32_t want[] = {b1, b0, a1, a0};
    gpu_order_is(&f, want, 4);
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 230, 3, 3, f.mv), 3);
    move_is(&f.mv[0], &f, b1, 1);
    move_is(&f.mv[1], &f, b0, 2);
    move_is(&f.mv[2], &f, a1, 3); /* a1 again, same generation, another slot */
    ck_assert_uint_eq(first.gen, f.mv[2].gen);
    /* the first move ends: only its slot is freed, a1 still demotes into slot 3 */
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, &first, 1, 1), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a1), ENTRY | KVP_PAGE_DEMOTING);
    ck_assert_uint_eq(host_state(&f, 0), 0);
    ck_assert_uint_eq(stats(&f).demoting, 3);
    fx_audit(&f);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 3, 1), 3);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 1, 4)), KVP_MEDIUM_HOST, 3);
    fx_audit(&f);
    fx_fini(&f);
}
END_TEST

START_TEST(a_flush_frees_demoting_pages_at_once)
{
    fx_t f;
    fx_init(&f, 6, 4, 4, 4);
    prompts();
    app(&f, 1, A, 4, co(0, 0, 35, 0));
    app(&f, 2, B, 4, co(1, 0, 35, 0));
    app(&f, 3, C, 4, co(1, 0, 35, 0));
    for (uint64_t id = 1; id <= 3; id++)
        kvp_pcache_publish_seq(f.c, seq(&f, id));
    const uint32_t a0 = pg(&f, 1, 0), b0 = pg(&f, 2, 0), c0 = pg(&f, 3, 0);
    release(&f, 1, 100);
    release(&f, 2, 110);
    release(&f, 3, 120);
    /* a0 into slot 0, ended; b0, c0 in flight into slots 1, 2 */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 4, 1, f.mv), 1);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 1), 1);
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 6, 8, f.mv), 2);
    move_is(&f.mv[0], &f, b0, 1);
    move_is(&f.mv[1], &f, c0, 2);
    /* a scope with a demoting page is not empty */
    ck_assert_int_eq(kvp_pcache_scope_reset(f.c, 1), KVP_EBUSY);
    const uint32_t free_before = kvp_alloc_num_free(f.a);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, 1), 2);
    ck_assert_uint_eq(kvp_alloc_num_free(f.a), free_before + 2);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, b0), 0);
    ck_assert(kvp_loc_is_none(kvp_pcache_locate(f.c, 1, key_at(B, 0, 4))));
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.demoting, 0);
    ck_assert_uint_eq(st.host_busy, 2); /* busy until the ends */
    ck_assert_uint_eq(st.evictions[KVP_EVICT_FLUSH], 2);
    ck_assert_uint_eq(st.host_pages, 1);
    ck_assert_uint_eq(host_state(&f, 1), KVP_SLOT_BUSY);
    fx_audit(&f);
    ck_assert_int_eq(kvp_pcache_scope_reset(f.c, 1), 0);
    /* the freed page is handed out and keyed anew before the copy that read it ends */
    app(&f, 4, B, 4, co(1, 0, 35, 0));
    kvp_pcache_publish_seq(f.c, seq(&f, 4));
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 2, 1), 0); /* both discarded */
    ck_assert_uint_eq(stats(&f).host_pages, 1);
    ck_assert_uint_eq(stats(&f).host_free, 3);
    fx_audit(&f);
    /* the host entry goes with a flush of its scope */
    ck_assert_uint_eq(kvp_pcache_flush(f.c, 0), 1);
    st = stats(&f);
    ck_assert_uint_eq(st.host_pages, 0);
    ck_assert_uint_eq(st.host_free, 4);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_FLUSH], 3);
    (void)a0;
    fx_audit(&f);
    fx_fini(&f);
}
END_TEST

/* A demotion with no free slot drops the host order's head: lowest priority, then the oldest
 * demotion; never a busy slot. */
START_TEST(a_full_tier_drops_its_head_by_priority_then_age)
{
    fx_t f;
    fx_init(&f, 8, 4, 2, 2);
    prompts();
    app(&f, 1, A, 4, co(0, 0, 50, 0));
    app(&f, 2, B, 4, co(0, 0, 10, 0));
    app(&f, 3, C, 4, co(0, 0, 35, 0));
    app(&f, 4, D, 4, co(0, 0, 35, 0));
    for (uint64_t id = 1; id <= 4; id++)
        kvp_pcache_publish_seq(f.c, seq(&f, id));
    const uint32_t a0 = pg(&f, 1, 0), b0 = pg(&f, 2, 0), c0 = pg(&f, 3, 0), d0 = pg(&f, 4, 0);
    for (uint64_t id = 1; id <= 4; id++)
        release(&f, id, 100 + id);
    uint32_t want[] = {b0, c0, d0, a0};
    gpu_order_is(&f, want, 4);
    /* b0 -> slot 0, c0 -> slot 1 */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 6, 2, f.mv), 2);
    move_is(&f.mv[0], &f, b0, 0);
    move_is(&f.mv[1], &f, c0, 1);
    /* both slots busy, no entry to drop: nothing starts */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 8, 4, f.mv + 2), 0);
    ck_assert_uint_eq(stats(&f).host_evictions, 0);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 2, 1), 2);
    uint32_t hw[] = {0, 1}; /* B (10) before C (35) */
    host_order_is(&f, hw, 2);
    /* d0 needs a slot: B's entry (priority 10) goes for good, its slot takes d0 */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 210, 8, 1, f.mv), 1);
    move_is(&f.mv[0], &f, d0, 0);
    ck_assert(kvp_loc_is_none(kvp_pcache_locate(f.c, 0, key_at(B, 0, 4))));
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.host_evictions, 1);
    ck_assert_uint_eq(st.host_pages, 1);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_PRESSURE], 0);
    fx_audit(&f);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 1), 1);
    uint32_t hw2[] = {1, 0}; /* C then D: same priority, demotion order */
    host_order_is(&f, hw2, 2);
    /* a0 (50): C, the older of the two, goes */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 220, 8, 1, f.mv), 1);
    move_is(&f.mv[0], &f, a0, 1);
    ck_assert(kvp_loc_is_none(kvp_pcache_locate(f.c, 0, key_at(C, 0, 4))));
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 1), 1);
    uint32_t hw3[] = {0, 1}; /* D (35) then A (50) */
    host_order_is(&f, hw3, 2);
    st = stats(&f);
    ck_assert_uint_eq(st.host_evictions, 2);
    ck_assert_uint_eq(st.demotions, 4);
    ck_assert_uint_eq(st.host_pages, 2);
    fx_audit(&f);
    fx_fini(&f);
}
END_TEST

START_TEST(lowering_and_raising_the_limit_with_moves_in_flight)
{
    fx_t f;
    fx_init(&f, 8, 4, 4, 4);
    prompts();
    app(&f, 1, A, 24, DEF);
    kvp_pcache_publish_seq(f.c, seq(&f, 1));
    uint32_t a[6];
    for (uint32_t i = 0; i < 6; i++)
        a[i] = pg(&f, 1, i);
    release(&f, 1, 100); /* order a5 a4 a3 a2 a1 a0 */
    /* a5, a4 into slots 0, 1 (ended); a3, a2 in flight into 2, 3 */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 8, 2, f.mv), 2);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 2, 1), 2);
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 8, 2, f.mv), 2);
    move_is(&f.mv[0], &f, a[3], 2);
    move_is(&f.mv[1], &f, a[2], 3);
    /* lower to 1: slot 1's entry goes for good, the busy slots stay busy */
    kvp_pcache_set_host_limit(f.c, 1);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.host_slots_usable, 1);
    ck_assert_uint_eq(st.host_evictions, 1);
    ck_assert_uint_eq(st.host_pages, 1);
    ck_assert_uint_eq(st.host_free, 0);
    ck_assert_uint_eq(st.host_busy, 2);
    ck_assert(kvp_loc_is_none(kvp_pcache_locate(f.c, 0, key_at(A, 4, 4))));
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 5, 4)), KVP_MEDIUM_HOST, 0);
    ck_assert_uint_eq(host_state(&f, 1), 0);
    ck_assert_uint_eq(host_state(&f, 2), KVP_SLOT_BUSY);
    fx_audit(&f);
    /* a3's copy ends: its slot is retired, so the page is cached again */
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 1), 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a[3]), ENTRY | KVP_PAGE_CACHED);
    ck_assert_uint_eq(host_state(&f, 2), 0);
    st = stats(&f);
    ck_assert_uint_eq(st.host_free, 0);
    ck_assert_uint_eq(st.host_busy, 1);
    fx_audit(&f);
    /* raise to 4 with slot 3 still busy: slots 1 and 2 are free, 3 when its move ends */
    kvp_pcache_set_host_limit(f.c, 4);
    st = stats(&f);
    ck_assert_uint_eq(st.host_free, 2);
    ck_assert_uint_eq(st.host_busy, 1);
    fx_audit(&f);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv + 1, 1, 1), 1);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 2, 4)), KVP_MEDIUM_HOST, 3);
    st = stats(&f);
    ck_assert_uint_eq(st.host_free, 2);
    ck_assert_uint_eq(st.host_pages, 2);
    /* lower to 0: every entry goes */
    kvp_pcache_set_host_limit(f.c, 0);
    st = stats(&f);
    ck_assert_uint_eq(st.host_pages, 0);
    ck_assert_uint_eq(st.host_free, 0);
    ck_assert_uint_eq(st.host_evictions, 3);
    fx_audit(&f);
    fx_fini(&f);
}
END_TEST

/* A retention duration keeps counting in the host tier: the entry falls to the default
 * priority there when it ends. Ended durations count when the victim is chosen. */
START_TEST(retention_counts_in_both_tiers)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4);
    prompts();
    app(&f, 1, A, 4, co(0, 0, 80, 50));
    app(&f, 2, B, 4, co(0, 0, 60, 0));
    kvp_pcache_publish_seq(f.c, seq(&f, 1));
    kvp_pcache_publish_seq(f.c, seq(&f, 2));
    const uint32_t a0 = pg(&f, 1, 0), b0 = pg(&f, 2, 0);
    release(&f, 1, 100);
    release(&f, 2, 110);
    /* at 120 a0 still has 80: b0 (60) goes first */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 120, 3, 1, f.mv), 1);
    move_is(&f.mv[0], &f, b0, 0);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 1), 1);
    /* a0 demoted at 130 with its 80 until 150 */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 130, 4, 1, f.mv), 1);
    move_is(&f.mv[0], &f, a0, 1);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 1), 1);
    uint32_t hw[] = {0, 1}; /* 60 before 80 */
    host_order_is(&f, hw, 2);
    ck_assert_uint_eq(f.c->prio[f.c->np + 1], 80);
    fx_audit(&f);
    /* at 150 its duration ended: default priority (35), ahead of B's 60 */
    ck_assert_uint_eq(kvp_pcache_expire(f.c, 150), 0);
    ck_assert_uint_eq(f.c->prio[f.c->np + 1], KVP_PCACHE_DEFAULT_PRIORITY);
    uint32_t hw2[] = {1, 0};
    host_order_is(&f, hw2, 2);
    fx_audit(&f);
    fx_fini(&f);
}
END_TEST

/* Allocation under pressure destroys the GPU head, with free host slots or not. */
START_TEST(pressure_destroys_without_demoting)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    four_cached(&f, &a0, &a1, &b0, &b1);
    f.now = 200;
    app(&f, 3, NULL, 4, DEF);
    ck_assert_uint_eq(f.p.num_evicted, 1);
    ck_assert_int_eq(f.p.kv_indices[0], (int)a1);
    ck_assert(kvp_loc_is_none(kvp_pcache_locate(f.c, 0, key_at(A, 1, 4))));
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_PRESSURE], 1);
    ck_assert_uint_eq(st.host_pages, 0);
    ck_assert_uint_eq(st.demotions, 0);
    ck_assert_uint_eq(st.residence_sum_ms, 100);
    /* demoting pages are not available: a batch needing them is refused */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 3, 8, f.mv), 3);
    ck_assert_uint_eq(kvp_alloc_num_available(f.a), 0);
    ck_assert_int_eq(app_c(&f, 4, NULL, 4, DEF), KVP_ENOSPC);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 3, 1), 3);
    app(&f, 4, NULL, 12, DEF);
    ck_assert_uint_eq(f.p.num_evicted, 0);
    fx_audit(&f);
    release(&f, 3, 300);
    release(&f, 4, 300);
    fx_fini(&f);
}
END_TEST

/* ---- lookup ------------------------------------------------------------------------------- */

START_TEST(lookup_tiers_counts_each_tier)
{
    fx_t f;
    fx_init(&f, 8, 4, 4, 4);
    prompts();
    app(&f, 1, A, 12, DEF);
    kvp_pcache_publish_seq(f.c, seq(&f, 1));
    release(&f, 1, 100); /* order a2 a1 a0 */
    uint32_t gpu = 9;
    ck_assert_uint_eq(look2(&f, A, 12, &gpu), 3);
    ck_assert_uint_eq(gpu, 3);
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 8, 1, f.mv), 1); /* a2 */
    ck_assert_uint_eq(look2(&f, A, 12, &gpu), 3);                        /* in flight: GPU */
    ck_assert_uint_eq(gpu, 3);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 1), 1);
    ck_assert_uint_eq(look2(&f, A, 14, &gpu), 3);
    ck_assert_uint_eq(gpu, 2);
    ck_assert_uint_eq(look(&f, A, 12), 2);
    /* counted: 14 tokens asked, 8 on the GPU, 4 in the host tier */
    ck_assert_uint_eq(kvp_pcache_lookup_tiers(f.c, 0, root0(), A, 14, 1, &gpu), 3);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.query_tokens, 14);
    ck_assert_uint_eq(st.hit_tokens, 8);
    ck_assert_uint_eq(st.host_hit_tokens, 4);
    kvp_pcache_scope_stats_t ss;
    ck_assert_int_eq(kvp_pcache_scope_stats(f.c, 0, &ss), 0);
    ck_assert_uint_eq(ss.query_tokens, 14);
    ck_assert_uint_eq(ss.hit_tokens, 8);
    ck_assert_uint_eq(ss.host_hit_tokens, 4);
    /* a1 and a0 too; then a0's content published on the GPU again, alone: host, GPU, host */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 210, 8, 2, f.mv), 2);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 2, 1), 2);
    ck_assert_uint_eq(look2(&f, A, 12, &gpu), 3);
    ck_assert_uint_eq(gpu, 0);
    app(&f, 2, A, 8, DEF);
    kvp_pcache_ref_t refs[2];
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 2), refs, 2), 2);
    ck_assert_uint_eq(kvp_pcache_publish(f.c, refs + 1, 1), 1); /* a1's content only */
    ck_assert_uint_eq(look2(&f, A, 12, &gpu), 3);
    ck_assert_uint_eq(gpu, 0);
    ck_assert_uint_eq(kvp_pcache_lookup_tiers(f.c, 0, root0(), A, 12, 1, &gpu), 3);
    st = stats(&f);
    ck_assert_uint_eq(st.query_tokens, 26);
    ck_assert_uint_eq(st.hit_tokens, 8);
    ck_assert_uint_eq(st.host_hit_tokens, 16); /* the GPU page after a host entry counts there */
    /* bad input: a bad scope, no tokens */
    ck_assert_uint_eq(kvp_pcache_lookup_tiers(f.c, 2, root0(), A, 12, 1, &gpu), 0);
    ck_assert_uint_eq(gpu, 0);
    ck_assert_uint_eq(kvp_pcache_lookup_tiers(f.c, 0, root0(), NULL, 12, 1, NULL), 0);
    ck_assert_uint_eq(stats(&f).query_tokens, 26);
    fx_audit(&f);
    release(&f, 2, 300);
    fx_fini(&f);
}
END_TEST

/* ---- promotion ---------------------------------------------------------------------------- */

START_TEST(promotion_restores_host_entries_into_fresh_pages)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    a_in_host(&f, &a0, &a1, &b0, &b1); /* free stack a1, a0 (top) */
    /* without promote a host entry is a miss: a0, a1 and b1 (evicted) are seq 3's */
    f.now = 300;
    app(&f, 3, A, 10, REUSE);
    ck_assert_uint_eq(f.p.cached_tokens[0], 0);
    ck_assert_uint_eq(f.p.num_restores, 0);
    ck_assert_uint_eq(f.p.num_restored_tokens, 0);
    ck_assert_uint_eq(f.p.num_evicted, 1);
    release(&f, 3, 300); /* its pages were never published: free again */
    ck_assert_uint_eq(stats(&f).host_pages, 2);
    /* with promote: both entries come back, a fresh page each, then the tail page */
    app(&f, 4, A, 10, PROMO);
    ck_assert_uint_eq(f.p.num_restores, 2);
    uint32_t n;
    const uint32_t *stack = kvp_alloc_free_stack(f.a, &n);
    ck_assert_uint_eq(n, 0);
    (void)stack;
    const uint32_t r0 = f.p.restores[0].page, r1 = f.p.restores[1].page;
    move_is(&f.p.restores[0], &f, r0, 1); /* A0 was in slot 1 */
    move_is(&f.p.restores[1], &f, r1, 0);
    ck_assert_uint_eq(pg(&f, 4, 0), r0);
    ck_assert_uint_eq(pg(&f, 4, 1), r1);
    ck_assert_uint_eq(f.p.cached_tokens[0], 8);
    ck_assert_uint_eq(f.p.restored_tokens[0], 8);
    ck_assert_uint_eq(f.p.num_cached_tokens, 8);
    ck_assert_uint_eq(f.p.num_restored_tokens, 8);
    ck_assert_uint_eq(f.p.nnz, 2);
    ck_assert_int_eq(f.p.kv_indptr[1], 3);
    ck_assert_uint_eq(f.p.num_evicted, 0);
    for (uint32_t i = 0; i < 2; i++) {
        const uint32_t p = f.p.restores[i].page;
        ck_assert_uint_eq(kvp_pcache_page_state(f.c, p), ENTRY | KVP_PAGE_RESTORING);
        ck_assert_int_eq(kvp_pcache_restoring(f.c, p), 1);
        ck_assert_uint_eq(kvp_alloc_pins(f.a, p), 1);
        ck_assert_uint_eq(kvp_alloc_refcount(f.a, p), 1);
        ck_assert_uint_eq(host_state(&f, f.p.restores[i].slot), KVP_SLOT_BUSY);
    }
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 0, 4)), KVP_MEDIUM_GPU, r0);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 1, 4)), KVP_MEDIUM_GPU, r1);
    ck_assert_uint_eq(look(&f, A, 8), 2); /* restoring pages are GPU entries */
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.promotions, 2);
    ck_assert_uint_eq(st.restoring, 2);
    ck_assert_uint_eq(st.host_busy, 2);
    ck_assert_uint_eq(st.host_pages, 0);
    ck_assert_uint_eq(st.host_free, 2);
    ck_assert_uint_eq(st.indexed_pages, 3); /* and b0: b1 went to seq 3's third page */
    ck_assert_uint_eq(st.host_hit_tokens, 8);
    ck_assert_uint_eq(st.hit_tokens, 0);
    ck_assert_uint_eq(st.query_tokens, 20);
    /* a pin of A holds the restoring pages */
    uint64_t pin;
    uint32_t pages = 0;
    ck_assert_int_eq(kvp_pcache_pin(f.c, 0, 0, root0(), A, 8, 300, 1000, &pin, &pages), 0);
    ck_assert_uint_eq(pages, 2);
    fx_audit(&f);
    /* the restores end in the other order: pages unpinned, slots free */
    kvp_pcache_move_t m[2] = {f.p.restores[1], f.p.restores[0]};
    kvp_pcache_restore_end(f.c, m, 2, 1);
    for (uint32_t i = 0; i < 2; i++) {
        ck_assert_uint_eq(kvp_pcache_page_state(f.c, m[i].page), ENTRY);
        ck_assert_uint_eq(kvp_alloc_pins(f.a, m[i].page), 0);
        ck_assert_int_eq(kvp_pcache_restoring(f.c, m[i].page), 0);
    }
    st = stats(&f);
    ck_assert_uint_eq(st.restoring, 0);
    ck_assert_uint_eq(st.host_busy, 0);
    ck_assert_uint_eq(st.host_free, 4);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_REWRITE], 0);
    fx_audit(&f);
    kvp_pcache_restore_end(f.c, m, 2, 0); /* ended already: ignored */
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, r0), ENTRY);
    ck_assert_int_eq(kvp_pcache_unpin(f.c, 0, pin), 2);
    release(&f, 4, 400); /* cached now, in the GPU order */
    ck_assert_uint_eq(stats(&f).cached_pages, 3);
    fx_audit(&f);
    fx_fini(&f);
}
END_TEST

START_TEST(a_failed_restore_leaves_a_private_page)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    a_in_host(&f, &a0, &a1, &b0, &b1);
    f.now = 300;
    app(&f, 3, A, 8, PROMO);
    ck_assert_uint_eq(f.p.num_restores, 2);
    kvp_pcache_move_t m[2] = {f.p.restores[0], f.p.restores[1]};
    const uint32_t gen0 = m[0].gen;
    kvp_pcache_restore_end(f.c, m, 1, 0); /* A0's restore failed */
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, m[0].page), KVP_PAGE_KEYED);
    ck_assert_uint_ne(f.c->gen[m[0].page], gen0);
    ck_assert_uint_eq(kvp_alloc_pins(f.a, m[0].page), 0);
    ck_assert_uint_eq(pg(&f, 3, 0), m[0].page); /* the sequence keeps it */
    ck_assert(kvp_loc_is_none(kvp_pcache_locate(f.c, 0, key_at(A, 0, 4))));
    ck_assert_uint_eq(look(&f, A, 8), 0);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_REWRITE], 1);
    ck_assert_uint_eq(st.restoring, 1);
    ck_assert_uint_eq(st.host_busy, 1);
    fx_audit(&f);
    /* the page is never published by its holder */
    kvp_pcache_ref_t refs[4];
    ck_assert_uint_eq(kvp_pcache_take_unpublished(f.c, seq(&f, 3), refs, 4), 0);
    /* released before the other restore ends: that page waits pinned at refcount 0 ... */
    release(&f, 3, 310);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, m[1].page), 0);
    ck_assert_uint_eq(kvp_alloc_num_pinned_free(f.a), 1);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, m[0].page), 0); /* free */
    fx_audit(&f);
    /* ... A0's key is gone, so a reuse finds nothing and a pin neither ... */
    app(&f, 4, A, 9, REUSE);
    ck_assert_uint_eq(f.p.cached_tokens[0], 0);
    release(&f, 4, 320);
    uint64_t pin;
    ck_assert_int_eq(kvp_pcache_pin(f.c, 0, 0, root0(), A, 8, 320, 100, &pin, NULL), KVP_ENOENT);
    fx_audit(&f);
    /* ... and becomes cached when it ends */
    kvp_pcache_restore_end(f.c, m + 1, 1, 1);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, m[1].page), ENTRY | KVP_PAGE_CACHED);
    ck_assert_uint_eq(kvp_alloc_num_pinned_free(f.a), 0);
    st = stats(&f);
    ck_assert_uint_eq(st.restoring, 0);
    ck_assert_uint_eq(st.host_busy, 0);
    fx_audit(&f);
    fx_fini(&f);
}
END_TEST

/* A call that links a page another call is restoring joins that restore. */
START_TEST(a_late_link_joins_a_restore)
{
    fx_t f;
    fx_init(&f, 6, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    a_in_host(&f, &a0, &a1, &b0, &b1);
    f.now = 300;
    app(&f, 3, A, 8, PROMO);
    kvp_pcache_move_t m[2] = {f.p.restores[0], f.p.restores[1]};
    release(&f, 3, 310); /* both at refcount 0, pinned */
    ck_assert_uint_eq(kvp_alloc_num_pinned_free(f.a), 2);
    app(&f, 4, A, 9, PROMO); /* both on the GPU now: linked, nothing restored by this plan */
    ck_assert_uint_eq(f.p.num_restores, 0);
    ck_assert_uint_eq(f.p.cached_tokens[0], 8);
    ck_assert_uint_eq(f.p.restored_tokens[0], 0);
    ck_assert_uint_eq(pg(&f, 4, 0), m[0].page);
    ck_assert_int_eq(kvp_pcache_restoring(f.c, pg(&f, 4, 0)), 1);
    ck_assert_int_eq(kvp_pcache_restoring(f.c, pg(&f, 4, 1)), 1);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, m[0].page), 1);
    ck_assert_uint_eq(kvp_alloc_num_pinned_free(f.a), 0);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.hit_tokens, 8);
    fx_audit(&f);
    kvp_pcache_restore_end(f.c, m, 2, 1);
    ck_assert_int_eq(kvp_pcache_restoring(f.c, m[0].page), 0);
    ck_assert_uint_eq(kvp_alloc_pins(f.a, m[0].page), 0);
    fx_audit(&f);
    release(&f, 4, 400);
    fx_fini(&f);
}
END_TEST

START_TEST(two_items_promoting_one_key_share_its_page)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    a_in_host(&f, &a0, &a1, &b0, &b1); /* free a1, a0; cached b1, b0 */
    f.now = 300;
    kvp_plan_item_t it[2] = {{0, 3, 10}, {0, 4, 10}};
    kvp_plan_content_t ct[2] = {{A, NULL, 0}, {A, NULL, 0}};
    kvp_plan_cache_t cc = PROMO;
    /* 2 restores + 2 tail pages = 4 = free 2 + cached 2: exactly enough */
    ck_assert_int_eq(kvp_plan_append_cached(f.t, it, ct, 2, NULL, &cc, f.now, &f.p), 0);
    ck_assert_uint_eq(f.p.num_restores, 2);
    const uint32_t r0 = f.p.restores[0].page, r1 = f.p.restores[1].page;
    ck_assert_uint_eq(f.p.restores[0].slot, 1);
    ck_assert_uint_eq(f.p.restores[1].slot, 0);
    const int32_t want[] = {(int32_t)r0, (int32_t)r1, (int32_t)b1,
                            (int32_t)r0, (int32_t)r1, (int32_t)b0};
    ck_assert_int_eq(f.p.kv_indptr[2], 6);
    for (uint32_t i = 0; i < 6; i++)
        ck_assert_int_eq(f.p.kv_indices[i], want[i]);
    ck_assert_uint_eq(f.p.num_evicted, 2);
    ck_assert_uint_eq(f.p.restored_tokens[0], 8);
    ck_assert_uint_eq(f.p.restored_tokens[1], 8);
    ck_assert_uint_eq(f.p.num_restored_tokens, 16);
    ck_assert_uint_eq(f.p.num_cached_tokens, 16);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, r0), 2);
    ck_assert_uint_eq(kvp_alloc_pins(f.a, r0), 1);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.promotions, 2);
    ck_assert_uint_eq(st.host_hit_tokens, 16);
    ck_assert_uint_eq(st.query_tokens, 20);
    fx_audit(&f);
    /* one more than there is: refused, and nothing changed */
    kvp_plan_item_t it3[1] = {{0, 5, 4}};
    kvp_plan_content_t ct3[1] = {{C, NULL, 0}};
    ck_assert_int_eq(kvp_plan_append_cached(f.t, it3, ct3, 1, NULL, &cc, f.now, &f.p), KVP_ENOSPC);
    kvp_pcache_restore_end(f.c, f.p.restores, 0, 1); /* n 0: nothing */
    kvp_pcache_move_t m[2] = {{r0, f.c->gen[r0], 1}, {r1, f.c->gen[r1], 0}};
    kvp_pcache_restore_end(f.c, m, 2, 1);
    release(&f, 3, 400);
    release(&f, 4, 400);
    fx_audit(&f);
    fx_fini(&f);
}
END_TEST

START_TEST(leave_last_bounds_a_promotion)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    a_in_host(&f, &a0, &a1, &b0, &b1);
    f.now = 300;
    kvp_plan_cache_t cc = PROMO;
    cc.leave_last = 1;
    app(&f, 3, A, 8, cc); /* 8 tokens: the last is left to append, so one page is found */
    ck_assert_uint_eq(f.p.num_restores, 1);
    move_is(&f.p.restores[0], &f, pg(&f, 3, 0), 1);
    ck_assert_uint_eq(f.p.cached_tokens[0], 4);
    ck_assert_uint_eq(f.p.restored_tokens[0], 4);
    ck_assert_uint_eq(f.p.nnz, 4);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 1, 4)), KVP_MEDIUM_HOST, 0);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.host_hit_tokens, 4);
    ck_assert_uint_eq(st.host_pages, 1);
    fx_audit(&f);
    kvp_pcache_restore_end(f.c, f.p.restores, 1, 1);
    /* A1's key: written by this sequence, its publish replaces the host entry */
    ck_assert_uint_eq(kvp_pcache_publish_seq(f.c, seq(&f, 3)), 1);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 1, 4)), KVP_MEDIUM_GPU, pg(&f, 3, 1));
    st = stats(&f);
    ck_assert_uint_eq(st.host_pages, 0);
    ck_assert_uint_eq(st.host_free, 4);
    fx_audit(&f);
    release(&f, 3, 400);
    fx_fini(&f);
}
END_TEST

START_TEST(enospc_with_promotions_changes_nothing)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    a_in_host(&f, &a0, &a1, &b0, &b1);
    f.now = 300;
    app(&f, 5, NULL, 12, DEF); /* a0, a1 and b1 (evicted): left: b0 cached */
    ck_assert_uint_eq(kvp_alloc_num_available(f.a), 1);
    kvp_pcache_stats_t before = stats(&f);
    kvp_stats_t tb;
    kvp_seqtab_stats(f.t, &tb);
    /* 2 restores + 1 page > 1 */
    ck_assert_int_eq(app_c(&f, 3, A, 10, PROMO), KVP_ENOSPC);
    ck_assert_uint_eq(f.p.num_restores, 0);
    ck_assert_ptr_null(kvp_seqtab_find(f.t, 0, 3));
    kvp_pcache_stats_t after = stats(&f);
    ck_assert_int_eq(memcmp(&before, &after, sizeof(before)), 0);
    kvp_stats_t ta;
    kvp_seqtab_stats(f.t, &ta);
    ck_assert_int_eq(memcmp(&tb, &ta, sizeof(tb)), 0);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 0, 4)), KVP_MEDIUM_HOST, 1);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 1, 4)), KVP_MEDIUM_HOST, 0);
    fx_audit(&f); /* no planner mark left on a host slot */
    /* a batch whose second item fails changes nothing either */
    kvp_plan_item_t it[2] = {{0, 6, 4}, {0, 6, 4}};
    kvp_plan_content_t ct[2] = {{A, NULL, 0}, {A, NULL, 0}};
    kvp_plan_cache_t cc = PROMO;
    ck_assert_int_eq(kvp_plan_append_cached(f.t, it, ct, 2, NULL, &cc, f.now, &f.p), KVP_EDUPSEQ);
    after = stats(&f);
    ck_assert_int_eq(memcmp(&before, &after, sizeof(before)), 0);
    fx_audit(&f);
    /* with room it goes through */
    release(&f, 5, 310);
    app(&f, 3, A, 10, PROMO);
    ck_assert_uint_eq(f.p.num_restores, 2);
    kvp_pcache_restore_end(f.c, f.p.restores, 2, 1);
    release(&f, 3, 320);
    fx_fini(&f);
}
END_TEST

/* Destroying the cache with moves in flight gives every page back. */
START_TEST(destroy_with_moves_in_flight)
{
    fx_t f;
    fx_init(&f, 6, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    a_in_host(&f, &a0, &a1, &b0, &b1);
    f.now = 300;
    app(&f, 3, A, 8, PROMO);                                             /* 2 restores */
    release(&f, 3, 310);                                                 /* pinned free */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 320, 6, 2, f.mv), 2); /* b1, b0 */
    ck_assert_uint_eq(stats(&f).host_busy, 4);
    fx_audit(&f);
    fx_fini(&f); /* destroy: every page free, none pinned */
}
END_TEST

/* ---- the audit ---------------------------------------------------------------------------- */

START_TEST(the_audit_checks_the_tier)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4);
    uint32_t a0, a1, b0, b1;
    a_in_host(&f, &a0, &a1, &b0, &b1); /* entries in slots 0, 1; slots 2, 3 free */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 300, 4, 1, f.mv), 1); /* b1 -> slot 2 */
    fx_audit(&f);
    kvp_pcache_t *c = f.c;
    const uint32_t s0 = c->np;
    /* counters off */
    c->st.host_pages++;
    audit_fails_with(&f, "host 2/3 (counted/kept)");
    c->st.host_pages--;
    c->st.host_free++;
    audit_fails_with(&f, "host counters: free 1/2");
    c->st.host_free--;
    c->st.host_busy--;
    audit_fails_with(&f, "busy 1/0");
    c->st.host_busy++;
    c->sc[0].host_pages--;
    audit_fails_with(&f, "scope 0: indexed 2/2 cached 1/1 host 2/1");
    c->sc[0].host_pages++;
    /* an entry that is also free */
    c->hfree[0] |= 1;
    audit_fails_with(&f, "host slot 0: free with flags 3");
    c->hfree[0] &= ~1ull;
    /* a usable slot in no state */
    c->hfree[0] &= ~(1ull << 3);
    audit_fails_with(&f, "host slot 3: usable, neither free, an entry nor busy");
    c->hfree[0] |= 1ull << 3;
    /* a planner mark left behind */
    c->flags[s0] |= KVP__PC_MARK;
    audit_fails_with(&f, "host slot 0: flags 131 in the index");
    c->flags[s0] &= (uint8_t)~KVP__PC_MARK;
    /* an entry in the wrong list of its medium */
    c->prio[s0] = 36;
    audit_fails_with(&f, "of priority 36 is in list 35");
    c->prio[s0] = KVP_PCACHE_DEFAULT_PRIORITY;
    /* a demoting page that names another slot */
    c->prev[b1] = 3;
    audit_fails_with(&f, "demoting page 3 names host slot 3");
    c->prev[b1] = 2;
    /* a demoting page that claims to be cached (the allocator's audit, run first, sees it) */
    c->flags[b1] |= KVP_PAGE_CACHED;
    audit_fails_with(&f, "page 3 is both cached and demoting");
    c->flags[b1] &= (uint8_t)~KVP_PAGE_CACHED;
    /* an entry above the limit */
    c->hlimit = 1;
    audit_fails_with(&f, "host slot 1: indexed at or above the limit 1");
    c->hlimit = 4;
    /* the same key on the GPU and in the host tier */
    kvp__pcache_index_remove(c, s0);
    c->key[s0] = c->key[b0];
    kvp__pcache_index_insert(c, s0); /* in the right bucket, ahead of b0 */
    audit_fails_with(&f, "finds another entry");
    kvp__pcache_index_remove(c, s0);
    c->key[s0] = key_at(A, 1, 4);
    kvp__pcache_index_insert(c, s0);
    fx_audit(&f);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 1), 1);
    fx_fini(&f);
}
END_TEST

static Suite *tier_suite(void)
{
    Suite *s = suite_create("pcache_tier");
    TCase *tc = tcase_create("tier");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, locations_name_gpu_pages_and_host_slots);
    tcase_add_test(tc, the_limit_starts_at_zero_and_is_clamped);
    tcase_add_test(tc, a_demotion_moves_the_entry_when_its_copy_ends);
    tcase_add_test(tc, a_failed_demotion_caches_the_page_again);
    tcase_add_test(tc, a_link_or_a_pin_cancels_a_demotion);
    tcase_add_test(tc, linking_demoting_pages_at_a_full_pool);
    tcase_add_test(tc, a_stale_end_leaves_a_newer_demotion_alone);
    tcase_add_test(tc, a_flush_frees_demoting_pages_at_once);
    tcase_add_test(tc, a_full_tier_drops_its_head_by_priority_then_age);
    tcase_add_test(tc, lowering_and_raising_the_limit_with_moves_in_flight);
    tcase_add_test(tc, retention_counts_in_both_tiers);
    tcase_add_test(tc, pressure_destroys_without_demoting);
    tcase_add_test(tc, lookup_tiers_counts_each_tier);
    tcase_add_test(tc, promotion_restores_host_entries_into_fresh_pages);
    tcase_add_test(tc, a_failed_restore_leaves_a_private_page);
    tcase_add_test(tc, a_late_link_joins_a_restore);
    tcase_add_test(tc, two_items_promoting_one_key_share_its_page);
    tcase_add_test(tc, leave_last_bounds_a_promotion);
    tcase_add_test(tc, enospc_with_promotions_changes_nothing);
    tcase_add_test(tc, destroy_with_moves_in_flight);
    tcase_add_test(tc, the_audit_checks_the_tier);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(tier_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
