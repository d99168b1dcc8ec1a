/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_pcache_tier.c - the prefix cache's seams for a second tier (issue #27): locations
 * (kvp_loc_t), the demoter offered each victim under pressure, the watermark path
 * (kvp_pcache_demote_some), entries of another medium being misses for reuse and pins and
 * replaced by a GPU copy, flush/destroy telling the owner, the audit of the new state, and a
 * random run checking the owner's view of its slots against the cache's after every operation.
 * The host tier itself (copies, promotion) is issue #28's; the demoter here only records.
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

/* ---- a recording demoter ------------------------------------------------------------------ */

enum { ACCEPT = 0, DECLINE = 1, BAD_MEDIUM = 2, BAD_INDEX = 3, USED_SLOT = 4 };
#define MAX_SLOTS  64
#define MAX_OFFERS 256

typedef struct {
    int mode;
    uint32_t nslots;
    uint8_t used[MAX_SLOTS]; /* the owner's view: slots it was given and not told to forget */
    kvp_pagekey_t key[MAX_SLOTS];
    uint32_t scope[MAX_SLOTS];
    uint32_t offers, forgets;
    kvp_pcache_victim_t offered[MAX_OFFERS];
    kvp_loc_t forgot[MAX_OFFERS];
} owner_t;

static int demote_cb(void *arg, const kvp_pcache_victim_t *v, kvp_loc_t *to)
{
    owner_t *o = arg;
    if (o->offers < MAX_OFFERS)
        o->offered[o->offers] = *v;
    o->offers++;
    uint32_t j = 0;
    while (j < o->nslots && o->used[j])
        j++;
    switch (o->mode) {
    case DECLINE:
        return 0;
    case BAD_MEDIUM:
        *to = kvp_loc(KVP_MEDIUM_GPU, 0);
        return 1;
    case BAD_INDEX:
        *to = kvp_loc(KVP_MEDIUM_HOST, o->nslots);
        return 1;
    case USED_SLOT:
        *to = kvp_loc(KVP_MEDIUM_HOST, 0); /* the test made sure slot 0 is in use */
        return 1;
    }
    if (j == o->nslots)
        return 0; /* full */
    o->used[j] = 1;
    o->key[j] = v->key;
    o->scope[j] = v->scope;
    *to = kvp_loc(KVP_MEDIUM_HOST, j);
    return 1;
}

static void forget_cb(void *arg, kvp_loc_t loc)
{
    owner_t *o = arg;
    ck_assert_uint_eq(loc.medium, KVP_MEDIUM_HOST);
    ck_assert_uint_lt(loc.index, o->nslots);
    ck_assert_msg(o->used[loc.index], "forget of host slot %u, not in use", loc.index);
    o->used[loc.index] = 0;
    if (o->forgets < MAX_OFFERS)
        o->forgot[o->forgets] = loc;
    o->forgets++;
}

/* ---- fixture ------------------------------------------------------------------------------ */

typedef struct {
    kvp_alloc_t *a;
    kvp_seqtab_t *t;
    kvp_pcache_t *c;
    kvp_plan_t p;
    uint32_t ps;
    uint64_t now;
    owner_t o;
} fx_t;

static void fx_init(fx_t *f, uint32_t pages, uint32_t ps, uint32_t host_slots, int demoter)
{
    memset(f, 0, sizeof(*f));
    kvp_seqtab_config_t cfg = {.max_seqs = 64, .max_namespaces = 4, .max_seq_tokens = 0};
    kvp_pcache_config_t pc = {.max_scopes = 2, .max_pins = 4, .host_slots = host_slots};
    ck_assert_int_eq(kvp_alloc_create(pages, &f->a), 0);
    ck_assert_int_eq(kvp_seqtab_create(f->a, ps, &cfg, &f->t), 0);
    ck_assert_int_eq(kvp_pcache_create(f->t, &pc, &f->c), 0);
    kvp_plan_init(&f->p);
    f->ps = ps;
    f->o.nslots = host_slots;
    if (demoter)
        ck_assert_int_eq(kvp_pcache_set_demoter(f->c, demote_cb, forget_cb, &f->o), 0);
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
    for (uint32_t j = 0; j < f->o.nslots; j++)
        ck_assert_msg(!f->o.used[j], "host slot %u still in use after destroy", j);
    kvp_seqtab_destroy(f->t);
    ck_assert_uint_eq(kvp_alloc_num_free(f->a), kvp_alloc_num_pages(f->a));
    kvp_alloc_destroy(f->a);
}

static kvp_plan_cache_t co(uint32_t scope, int reuse, uint32_t prio, uint32_t ret)
{
    kvp_plan_cache_t c = {
        .scope = scope, .reuse = (uint8_t)reuse, .priority = (uint8_t)prio, .retention_ms = ret};
    return c;
}

#define DEF   co(0, 0, KVP_PCACHE_DEFAULT_PRIORITY, 0)
#define REUSE co(0, 1, KVP_PCACHE_DEFAULT_PRIORITY, 0)

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

static uint32_t look(const fx_t *f, const int32_t *toks, uint32_t n)
{
    kvp_pagekey_t root;
    ck_assert_int_eq(kvp_pagekey_root(NULL, 0, &root), 0);
    return kvp_pcache_lookup(f->c, 0, root, toks, n, 0);
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
 * order a1 a0 b1 b0. */
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
    ck_assert_uint_eq(kvp_alloc_num_free(f->a), 0);
}

/* ---- the cases ---------------------------------------------------------------------------- */

START_TEST(locations_name_gpu_pages_and_host_slots)
{
    fx_t f;
    fx_init(&f, 4, 4, 2, 0);
    prompts();
    app(&f, 1, A, 4, DEF);
    const uint32_t p = pg(&f, 1, 0);
    ck_assert_uint_eq(kvp_pcache_publish_seq(f.c, seq(&f, 1)), 1);
    const kvp_pagekey_t k = key_at(A, 0, 4);
    loc_is(kvp_pcache_locate(f.c, 0, k), KVP_MEDIUM_GPU, p);
    ck_assert(kvp_loc_is_none(kvp_pcache_locate(f.c, 1, k))); /* another scope */
    ck_assert(kvp_loc_is_none(kvp_pcache_locate(f.c, 0, key_at(B, 0, 4))));
    ck_assert_uint_eq(kvp_pcache_loc_state(f.c, kvp_loc(KVP_MEDIUM_GPU, p)),
                      KVP_PAGE_KEYED | KVP_PAGE_INDEXED);
    ck_assert_uint_eq(kvp_pcache_loc_state(f.c, kvp_loc(KVP_MEDIUM_GPU, p)),
                      kvp_pcache_page_state(f.c, p));
    kvp_pagekey_t got;
    uint32_t scope = 9;
    ck_assert_int_eq(kvp_pcache_loc_key(f.c, kvp_loc(KVP_MEDIUM_GPU, p), &got, &scope), 0);
    ck_assert(kvp_pagekey_eq(got, k));
    ck_assert_uint_eq(scope, 0);
    /* an empty host slot, slots and pages out of range, no location */
    ck_assert_uint_eq(kvp_pcache_loc_state(f.c, kvp_loc(KVP_MEDIUM_HOST, 0)), 0);
    ck_assert_uint_eq(kvp_pcache_loc_state(f.c, kvp_loc(KVP_MEDIUM_HOST, 2)), 0);
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
    fx_fini(&f);
}
END_TEST

START_TEST(set_demoter_and_create_check_their_arguments)
{
    fx_t f;
    fx_init(&f, 4, 4, 0, 0);
    owner_t o = {0};
    /* no host slots: nowhere to demote to */
    ck_assert_int_eq(kvp_pcache_set_demoter(f.c, demote_cb, forget_cb, &o), KVP_EINVAL);
    ck_assert_int_eq(kvp_pcache_set_demoter(f.c, NULL, NULL, NULL), 0);
    ck_assert_uint_eq(kvp_pcache_demote_some(f.c, 0, 4, 4), 0); /* no demoter: nothing */
    fx_fini(&f);

    fx_init(&f, 4, 4, 2, 0);
    ck_assert_int_eq(kvp_pcache_set_demoter(f.c, demote_cb, NULL, &f.o), KVP_EINVAL);
    ck_assert_int_eq(kvp_pcache_set_demoter(f.c, NULL, forget_cb, &f.o), KVP_EINVAL);
    ck_assert_int_eq(kvp_pcache_set_demoter(NULL, demote_cb, forget_cb, &f.o), KVP_EINVAL);
    ck_assert_int_eq(kvp_pcache_set_demoter(f.c, demote_cb, forget_cb, &f.o), 0);
    /* with an entry in the host medium the demoter may not change */
    uint32_t a0, a1, b0, b1;
    four_cached(&f, &a0, &a1, &b0, &b1);
    ck_assert_uint_eq(kvp_pcache_demote_some(f.c, 200, 1, 1), 1);
    ck_assert_int_eq(kvp_pcache_set_demoter(f.c, NULL, NULL, NULL), KVP_EBUSY);
    ck_assert_int_eq(kvp_pcache_set_demoter(f.c, demote_cb, forget_cb, &o), KVP_EBUSY);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE), 4); /* 3 cached, 1 host */
    ck_assert_int_eq(kvp_pcache_set_demoter(f.c, NULL, NULL, NULL), 0);
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
    pc.host_slots = 3;
    ck_assert_int_eq(kvp_pcache_create(t, &pc, &c), 0);
    kvp_pcache_stats_t st;
    kvp_pcache_stats(c, &st);
    ck_assert_uint_eq(st.host_pages, 0);
    kvp_pcache_destroy(c);
    kvp_seqtab_destroy(t);
    kvp_alloc_destroy(a);
}
END_TEST

START_TEST(an_accepting_demoter_moves_the_entry_to_the_host_medium)
{
    fx_t f;
    fx_init(&f, 4, 4, 2, 1);
    uint32_t a0, a1, b0, b1;
    four_cached(&f, &a0, &a1, &b0, &b1);
    /* pressure: one page, the head of the order (a1) is offered and accepted into slot 0 */
    f.now = 200;
    app(&f, 3, NULL, 4, DEF);
    ck_assert_uint_eq(f.p.num_evicted, 1);
    ck_assert_int_eq(f.p.kv_indices[0], (int)a1); /* the GPU page was freed and handed out */
    ck_assert_uint_eq(f.o.offers, 1);
    const kvp_pcache_victim_t *v = &f.o.offered[0];
    ck_assert_uint_eq(v->page, a1);
    ck_assert_uint_eq(v->scope, 0);
    ck_assert(kvp_pagekey_eq(v->key, key_at(A, 1, 4)));
    ck_assert_uint_eq(v->priority, KVP_PCACHE_DEFAULT_PRIORITY);
    ck_assert_uint_eq(v->pressure, 1);
    /* the entry lives in host slot 0: findable as such, not as a page */
    const kvp_pagekey_t k1 = key_at(A, 1, 4);
    loc_is(kvp_pcache_locate(f.c, 0, k1), KVP_MEDIUM_HOST, 0);
    ck_assert_uint_eq(kvp_pcache_find(f.c, 0, k1), UINT32_MAX);
    ck_assert_uint_eq(kvp_pcache_loc_state(f.c, kvp_loc(KVP_MEDIUM_HOST, 0)),
                      KVP_PAGE_KEYED | KVP_PAGE_INDEXED);
    kvp_pagekey_t got;
    uint32_t scope = 9;
    ck_assert_int_eq(kvp_pcache_loc_key(f.c, kvp_loc(KVP_MEDIUM_HOST, 0), &got, &scope), 0);
    ck_assert(kvp_pagekey_eq(got, k1));
    ck_assert_uint_eq(scope, 0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, a1), 0); /* seq 3's now, unkeyed */
    ck_assert_int_eq(kvp_pcache_page_key(f.c, a1, NULL, NULL), KVP_ENOENT);
    ck_assert_uint_eq(kvp_alloc_refcount(f.a, a1), 1);
    ck_assert_uint_eq(look(&f, A, 8), 1); /* a0 still on the GPU; a1 is a miss */
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.demotions, 1);
    ck_assert_uint_eq(st.host_pages, 1);
    ck_assert_uint_eq(st.indexed_pages, 3);
    ck_assert_uint_eq(st.cached_pages, 3);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_PRESSURE], 0);
    ck_assert_uint_eq(st.residence_sum_ms, 0);
    kvp_pcache_scope_stats_t ss;
    ck_assert_int_eq(kvp_pcache_scope_stats(f.c, 0, &ss), 0);
    ck_assert_uint_eq(ss.host_pages, 1);
    ck_assert_uint_eq(ss.indexed_pages, 3);
    uint32_t want[] = {a0, b1, b0};
    gpu_order_is(&f, want, 3);
    uint32_t hw[] = {0};
    host_order_is(&f, hw, 1);
    fx_audit(&f);
    /* two more: a0 into slot 1, then the owner is full and declines b1: destroyed */
    f.now = 300;
    app(&f, 4, NULL, 8, DEF);
    ck_assert_uint_eq(f.o.offers, 3);
    ck_assert_uint_eq(f.o.offered[1].page, a0);
    ck_assert_uint_eq(f.o.offered[2].page, b1);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 0, 4)), KVP_MEDIUM_HOST, 1);
    ck_assert(kvp_loc_is_none(kvp_pcache_locate(f.c, 0, key_at(B, 1, 4))));
    st = stats(&f);
    ck_assert_uint_eq(st.demotions, 2);
    ck_assert_uint_eq(st.host_pages, 2);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_PRESSURE], 1);
    ck_assert_uint_eq(st.residence_sum_ms, 300 - 110);
    ck_assert_uint_eq(look(&f, A, 8), 0);
    ck_assert_uint_eq(look(&f, B, 8), 1);
    fx_audit(&f);
    release(&f, 3, 400);
    release(&f, 4, 400);
    fx_fini(&f); /* destroy: the owner is told to forget both slots */
    ck_assert_uint_eq(f.o.forgets, 2);
}
END_TEST

/* The same pressure with no demoter and with one that declines (or names a location the cache
 * cannot keep): the same pages, the same stats. */
START_TEST(a_declining_demoter_gives_todays_eviction)
{
    static const int modes[] = {-1, DECLINE, BAD_MEDIUM, BAD_INDEX, USED_SLOT};
    uint32_t ref_pages[8] = {0};
    kvp_pcache_stats_t ref;
    memset(&ref, 0, sizeof(ref));
    for (unsigned m = 0; m < sizeof(modes) / sizeof(modes[0]); m++) {
        fx_t f;
        fx_init(&f, 4, 4, 2, modes[m] >= 0);
        uint32_t a0, a1, b0, b1;
        four_cached(&f, &a0, &a1, &b0, &b1);
        if (modes[m] == USED_SLOT) { /* put an entry in slot 0 first, through the watermark */
            ck_assert_uint_eq(kvp_pcache_demote_some(f.c, 150, 1, 1), 1);
            loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 1, 4)), KVP_MEDIUM_HOST, 0);
            app(&f, 9, NULL, 4, DEF); /* takes the freed page back */
            ck_assert_int_eq(f.p.kv_indices[0], (int)a1);
            f.o.offers = 0;
        }
        f.o.mode = modes[m] < 0 ? ACCEPT : modes[m];
        f.now = 200;
        app(&f, 3, NULL, 8, DEF);
        ck_assert_uint_eq(f.p.num_evicted, 2);
        kvp_pcache_stats_t st = stats(&f);
        uint32_t host_before = modes[m] == USED_SLOT;
        ck_assert_uint_eq(st.host_pages, host_before);
        ck_assert_uint_eq(st.demotions, host_before);
        ck_assert_uint_eq(f.o.offers, modes[m] < 0 ? 0 : 2);
        if (modes[m] == USED_SLOT) {
            /* the order was a0 b1 b0: a0 and b1 destroyed */
            ck_assert_int_eq(f.p.kv_indices[0], (int)a0);
            ck_assert_int_eq(f.p.kv_indices[1], (int)b1);
            ck_assert_uint_eq(st.evictions[KVP_EVICT_PRESSURE], 2);
            ck_assert_uint_eq(st.residence_sum_ms, 2 * 200 - 100 - 110);
            release(&f, 9, 300);
        } else if (modes[m] < 0) {
            ref = st;
            ref_pages[0] = (uint32_t)f.p.kv_indices[0];
            ref_pages[1] = (uint32_t)f.p.kv_indices[1];
            ck_assert_uint_eq(ref_pages[0], a1);
            ck_assert_uint_eq(ref_pages[1], a0);
            ck_assert_uint_eq(st.evictions[KVP_EVICT_PRESSURE], 2);
        } else {
            ck_assert_uint_eq(f.o.offered[0].page, a1);
            ck_assert_uint_eq(f.o.offered[1].page, a0);
            ck_assert_uint_eq((uint32_t)f.p.kv_indices[0], ref_pages[0]);
            ck_assert_uint_eq((uint32_t)f.p.kv_indices[1], ref_pages[1]);
            ck_assert_mem_eq(&st, &ref, sizeof(st));
            for (uint32_t j = 0; j < 2; j++)
                ck_assert_uint_eq(kvp_pcache_loc_state(f.c, kvp_loc(KVP_MEDIUM_HOST, j)), 0);
        }
        ck_assert(kvp_loc_is_none(kvp_pcache_locate(f.c, 0, key_at(A, 0, 4))));
        ck_assert_uint_eq(look(&f, A, 8), 0);
        ck_assert_uint_eq(look(&f, B, 8), (modes[m] == USED_SLOT ? 1u : 2u));
        fx_audit(&f);
        release(&f, 3, 300);
        fx_fini(&f);
    }
}
END_TEST

/* The watermark path demotes ahead of allocation, lowest priority first, then release order,
 * deepest page first; a decline stops it and leaves the page cached. */
START_TEST(the_watermark_demotes_in_eviction_order)
{
    fx_t f;
    fx_init(&f, 8, 4, 8, 1);
    prompts();
    app(&f, 1, A, 8, DEF);
    app(&f, 2, B, 4, co(0, 0, 50, 0));
    app(&f, 3, C, 4, co(0, 0, 10, 0));
    app(&f, 4, D, 8, DEF);
    for (uint64_t id = 1; id <= 4; id++)
        kvp_pcache_publish_seq(f.c, seq(&f, id));
    const uint32_t a0 = pg(&f, 1, 0), a1 = pg(&f, 1, 1), b0 = pg(&f, 2, 0), c0 = pg(&f, 3, 0);
    const uint32_t d0 = pg(&f, 4, 0), d1 = pg(&f, 4, 1);
    release(&f, 2, 100);
    release(&f, 1, 110);
    release(&f, 3, 120);
    release(&f, 4, 130);
    uint32_t want[] = {c0, a1, a0, d1, d0, b0};
    gpu_order_is(&f, want, 6);
    ck_assert_uint_eq(kvp_alloc_num_free(f.a), 2);
    /* already at the watermark: nothing to do */
    ck_assert_uint_eq(kvp_pcache_demote_some(f.c, 200, 2, 100), 0);
    ck_assert_uint_eq(f.o.offers, 0);
    /* three short of 5 free */
    ck_assert_uint_eq(kvp_pcache_demote_some(f.c, 200, 5, 100), 3);
    ck_assert_uint_eq(kvp_alloc_num_free(f.a), 5);
    ck_assert_uint_eq(f.o.offers, 3);
    ck_assert_uint_eq(f.o.offered[0].page, c0);
    ck_assert_uint_eq(f.o.offered[0].priority, 10);
    ck_assert_uint_eq(f.o.offered[1].page, a1);
    ck_assert_uint_eq(f.o.offered[2].page, a0);
    for (uint32_t i = 0; i < 3; i++)
        ck_assert_uint_eq(f.o.offered[i].pressure, 0);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(C, 0, 4)), KVP_MEDIUM_HOST, 0);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 1, 4)), KVP_MEDIUM_HOST, 1);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 0, 4)), KVP_MEDIUM_HOST, 2);
    for (uint32_t i = 0; i < 3; i++) /* the pages are free, unkeyed */
        ck_assert_uint_eq(kvp_pcache_page_state(f.c, want[i]), 0);
    gpu_order_is(&f, want + 3, 3);
    uint32_t hw[] = {0, 1, 2}; /* priority 10 first, then the two of 35 in demotion order */
    host_order_is(&f, hw, 3);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.demotions, 3);
    ck_assert_uint_eq(st.host_pages, 3);
    ck_assert_uint_eq(st.cached_pages, 3);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_PRESSURE], 0);
    fx_audit(&f);
    /* max_pages bounds it */
    ck_assert_uint_eq(kvp_pcache_demote_some(f.c, 210, 8, 1), 1);
    ck_assert_uint_eq(f.o.offered[3].page, d1);
    gpu_order_is(&f, want + 4, 2);
    /* a decline stops it, the page stays cached where it was */
    f.o.mode = DECLINE;
    ck_assert_uint_eq(kvp_pcache_demote_some(f.c, 220, 8, 100), 0);
    ck_assert_uint_eq(f.o.offers, 5);
    ck_assert_uint_eq(f.o.offered[4].page, d0);
    gpu_order_is(&f, want + 4, 2);
    ck_assert_uint_eq(kvp_alloc_num_free(f.a), 6);
    /* a fresh allocation takes free pages first: no offer */
    f.o.mode = ACCEPT;
    app(&f, 5, NULL, 24, DEF);
    ck_assert_uint_eq(f.p.num_evicted, 0);
    ck_assert_uint_eq(f.o.offers, 5);
    fx_audit(&f);
    release(&f, 5, 300);
    fx_fini(&f);
    ck_assert_uint_eq(f.o.forgets, 4);
}
END_TEST

/* A retention duration that ended counts as the default priority when the victim is chosen. */
START_TEST(the_watermark_sees_ended_retention)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 1);
    prompts();
    app(&f, 1, A, 4, co(0, 0, 80, 50));
    app(&f, 2, B, 4, co(0, 0, 60, 0));
    kvp_pcache_publish_seq(f.c, seq(&f, 1));
    kvp_pcache_publish_seq(f.c, seq(&f, 2));
    const uint32_t a0 = pg(&f, 1, 0), b0 = pg(&f, 2, 0);
    release(&f, 1, 100);
    release(&f, 2, 110);
    /* at 120 a0 still has 80: b0 (60) goes first */
    ck_assert_uint_eq(kvp_pcache_demote_some(f.c, 120, 3, 1), 1);
    ck_assert_uint_eq(f.o.offered[0].page, b0);
    ck_assert_uint_eq(f.o.offered[0].priority, 60);
    /* at 150 its duration ended: offered at the default priority */
    ck_assert_uint_eq(kvp_pcache_demote_some(f.c, 150, 4, 1), 1);
    ck_assert_uint_eq(f.o.offered[1].page, a0);
    ck_assert_uint_eq(f.o.offered[1].priority, KVP_PCACHE_DEFAULT_PRIORITY);
    uint32_t hw[] = {1, 0}; /* host order: by priority, 35 before 60 */
    host_order_is(&f, hw, 2);
    fx_audit(&f);
    fx_fini(&f);
}
END_TEST

/* Entries of another medium are misses for reuse and pins; the same content published on the
 * GPU again replaces them and the owner forgets the slot. */
START_TEST(host_entries_are_misses_and_a_gpu_copy_replaces_them)
{
    fx_t f;
    fx_init(&f, 4, 4, 2, 1);
    uint32_t a0, a1, b0, b1;
    four_cached(&f, &a0, &a1, &b0, &b1);
    ck_assert_uint_eq(kvp_pcache_demote_some(f.c, 200, 1, 1), 1); /* a1 -> host slot 0 */
    /* reuse of A links a0 only and keys a new page for A[4..8) */
    f.now = 300;
    app(&f, 3, A, 8, REUSE);
    ck_assert_uint_eq(f.p.cached_tokens[0], 4);
    ck_assert_uint_eq(pg(&f, 3, 0), a0);
    const uint32_t n1 = pg(&f, 3, 1);
    ck_assert_uint_ne(n1, a0);
    ck_assert_uint_eq(kvp_pcache_page_state(f.c, n1), KVP_PAGE_KEYED);
    /* a pin of A holds the GPU page only */
    kvp_pagekey_t root;
    kvp_pagekey_root(NULL, 0, &root);
    uint64_t pin;
    uint32_t pages = 0;
    ck_assert_int_eq(kvp_pcache_pin(f.c, 0, 0, root, A, 8, 300, 1000, &pin, &pages), 0);
    ck_assert_uint_eq(pages, 1);
    fx_audit(&f);
    /* the writer publishes: the GPU copy is findable, the host entry gone, its slot forgotten */
    ck_assert_uint_eq(f.o.forgets, 0);
    ck_assert_uint_eq(kvp_pcache_publish_seq(f.c, seq(&f, 3)), 1);
    ck_assert_uint_eq(f.o.forgets, 1);
    loc_is(f.o.forgot[0], KVP_MEDIUM_HOST, 0);
    ck_assert(!f.o.used[0]);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 1, 4)), KVP_MEDIUM_GPU, n1);
    ck_assert_uint_eq(kvp_pcache_loc_state(f.c, kvp_loc(KVP_MEDIUM_HOST, 0)), 0);
    ck_assert_uint_eq(look(&f, A, 8), 2);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.host_pages, 0);
    ck_assert_uint_eq(st.indexed_pages, 4);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_FLUSH] + st.evictions[KVP_EVICT_REWRITE], 0);
    fx_audit(&f);
    ck_assert_int_eq(kvp_pcache_unpin(f.c, 0, pin), 1);
    release(&f, 3, 400);
    fx_fini(&f);
}
END_TEST

START_TEST(flush_and_scope_reset_cover_host_entries)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 1);
    prompts();
    app(&f, 1, A, 4, co(0, 0, 35, 0));
    app(&f, 2, B, 4, co(1, 0, 35, 0));
    app(&f, 3, C, 4, co(1, 0, 35, 0));
    for (uint64_t id = 1; id <= 3; id++)
        kvp_pcache_publish_seq(f.c, seq(&f, id));
    release(&f, 1, 100);
    release(&f, 2, 110);
    release(&f, 3, 120);
    ck_assert_uint_eq(kvp_pcache_demote_some(f.c, 200, 4, 100), 3);
    kvp_pcache_scope_stats_t s0, s1;
    kvp_pcache_scope_stats(f.c, 0, &s0);
    kvp_pcache_scope_stats(f.c, 1, &s1);
    ck_assert_uint_eq(s0.host_pages, 1);
    ck_assert_uint_eq(s1.host_pages, 2);
    ck_assert_uint_eq(s1.indexed_pages, 0);
    /* a scope with entries in another medium is not empty */
    ck_assert_int_eq(kvp_pcache_scope_reset(f.c, 1), KVP_EBUSY);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, 1), 2);
    ck_assert_uint_eq(f.o.forgets, 2);
    loc_is(f.o.forgot[0], KVP_MEDIUM_HOST, 1);
    loc_is(f.o.forgot[1], KVP_MEDIUM_HOST, 2);
    ck_assert_int_eq(kvp_pcache_scope_reset(f.c, 1), 0);
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_uint_eq(st.host_pages, 1);
    ck_assert_uint_eq(st.evictions[KVP_EVICT_FLUSH], 2);
    loc_is(kvp_pcache_locate(f.c, 0, key_at(A, 0, 4)), KVP_MEDIUM_HOST, 0);
    ck_assert(kvp_loc_is_none(kvp_pcache_locate(f.c, 1, key_at(B, 0, 4))));
    fx_audit(&f);
    fx_fini(&f);
    ck_assert_uint_eq(f.o.forgets, 3);
}
END_TEST

START_TEST(the_audit_checks_host_entries)
{
    fx_t f;
    fx_init(&f, 4, 4, 2, 1);
    uint32_t a0, a1, b0, b1;
    four_cached(&f, &a0, &a1, &b0, &b1);
    ck_assert_uint_eq(kvp_pcache_demote_some(f.c, 200, 1, 1), 1);
    fx_audit(&f);
    kvp_pcache_t *c = f.c;
    const uint32_t s = c->np; /* host slot 0 */
    /* a counter off */
    c->st.host_pages++;
    audit_fails_with(&f, "host 1/2 (counted/kept)");
    c->st.host_pages--;
    c->sc[0].host_pages--;
    audit_fails_with(&f, "scope 0: indexed 3/3 cached 3/3 host 1/0");
    c->sc[0].host_pages++;
    /* flags that say cached (only GPU pages are) */
    c->flags[s] |= KVP_PAGE_CACHED;
    audit_fails_with(&f, "host slot 0: flags 7 in the index");
    c->flags[s] &= (uint8_t)~KVP_PAGE_CACHED;
    /* an entry in the wrong list of its medium */
    c->prio[s] = 36;
    audit_fails_with(&f, "of priority 36 is in list 35");
    c->prio[s] = KVP_PCACHE_DEFAULT_PRIORITY;
    /* a free host slot that claims an entry */
    c->flags[s + 1] = KVP_PAGE_KEYED | KVP_PAGE_INDEXED;
    audit_fails_with(&f, "host slot 1: flags 3, in the index 0, in a list 0");
    c->flags[s + 1] = 0;
    /* the same key on the GPU and in the host medium */
    kvp__pcache_index_remove(c, s);
    c->key[s] = c->key[a0];
    kvp__pcache_index_insert(c, s); /* in the right bucket, ahead of a0 */
    audit_fails_with(&f, "finds another entry");
    kvp__pcache_index_remove(c, s);
    c->key[s] = key_at(A, 1, 4);
    kvp__pcache_index_insert(c, s);
    /* an entry of another medium with no demoter to forget it */
    kvp_pcache_forget_fn fg = c->forget;
    c->forget = NULL;
    audit_fails_with(&f, "no demoter is installed");
    c->forget = fg;
    fx_audit(&f);
    fx_fini(&f);
}
END_TEST

/* ---- random run --------------------------------------------------------------------------- */

/* Random appends (a few prompts sharing prefixes), reuse, publishes, releases, pressure, the
 * watermark, flushes and demoter moods; after every operation the audit, and the owner's slots
 * equal the cache's host entries (same key and scope), and no key has two places. */
static void owner_matches_cache(const fx_t *f)
{
    uint32_t used = 0;
    for (uint32_t j = 0; j < f->o.nslots; j++) {
        kvp_pagekey_t k;
        uint32_t scope;
        int rc = kvp_pcache_loc_key(f->c, kvp_loc(KVP_MEDIUM_HOST, j), &k, &scope);
        ck_assert_int_eq(rc == 0, f->o.used[j]);
        if (!f->o.used[j])
            continue;
        used++;
        ck_assert(kvp_pagekey_eq(k, f->o.key[j]));
        ck_assert_uint_eq(scope, f->o.scope[j]);
        loc_is(kvp_pcache_locate(f->c, scope, k), KVP_MEDIUM_HOST, j);
        ck_assert_uint_eq(kvp_pcache_find(f->c, scope, k), UINT32_MAX);
    }
    ck_assert_uint_eq(stats(f).host_pages, used);
}

START_TEST(random_operations_keep_owner_and_cache_in_step)
{
    fx_t f;
    fx_init(&f, 24, 2, 12, 1);
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(0x7e11) + (uint64_t)_i);
    int32_t prompt[4][32];
    for (uint32_t q = 0; q < 4; q++)
        for (uint32_t i = 0; i < 32; i++)
            prompt[q][i] = (int32_t)(i < 8 ? i : 1000 * (q + 1) + i); /* a shared 8-token head */
    uint8_t live[16] = {0};
    uint32_t replaced = 0; /* host entries a publish replaced */
    for (uint32_t op = 0; op < 20000; op++) {
        f.now += kvp_rng_below(&r, 3);
        uint64_t id = kvp_rng_below(&r, 16);
        switch (kvp_rng_below(&r, 8)) {
        case 0:
        case 1:
            if (!live[id]) {
                uint32_t q = kvp_rng_below(&r, 4), n = 1 + kvp_rng_below(&r, 16);
                kvp_plan_cache_t c = co(kvp_rng_below(&r, 2), kvp_rng_below(&r, 2),
                                        kvp_rng_below(&r, 3) * 30, kvp_rng_below(&r, 2) * 5);
                int rc = app_c(&f, id, prompt[q], n, c);
                ck_assert(rc == 0 || rc == KVP_ENOSPC);
                if (rc == 0) {
                    live[id] = 1;
                    uint32_t before = f.o.forgets;
                    if (kvp_rng_below(&r, 4))
                        kvp_pcache_publish_seq(f.c, seq(&f, id));
                    replaced += f.o.forgets - before;
                }
            }
            break;
        case 2:
            if (live[id]) {
                release(&f, id, f.now);
                live[id] = 0;
            }
            break;
        case 3: /* pressure from a sequence without token ids */
            if (!live[id]) {
                int rc = app_c(&f, id, NULL, 1 + kvp_rng_below(&r, 12), DEF);
                ck_assert(rc == 0 || rc == KVP_ENOSPC);
                live[id] = rc == 0;
            }
            break;
        case 4:
            kvp_pcache_demote_some(f.c, f.now, kvp_rng_below(&r, 24), kvp_rng_below(&r, 8));
            break;
        case 5:
            f.o.mode = kvp_rng_below(&r, 3) ? ACCEPT : DECLINE;
            break;
        case 6:
            if (kvp_rng_below(&r, 8) == 0)
                kvp_pcache_flush(f.c,
                                 kvp_rng_below(&r, 3) ? kvp_rng_below(&r, 2) : KVP_PCACHE_NO_SCOPE);
            break;
        case 7:
            if (live[id]) {
                uint32_t before = f.o.forgets;
                kvp_pcache_publish_seq(f.c, seq(&f, id));
                replaced += f.o.forgets - before;
            }
            break;
        }
        fx_audit(&f);
        owner_matches_cache(&f);
    }
    kvp_pcache_stats_t st = stats(&f);
    ck_assert_msg(st.demotions > 0 && f.o.forgets > 0 && replaced > 0,
                  "the run demoted %llu, forgot %u, replaced %u", (unsigned long long)st.demotions,
                  f.o.forgets, replaced);
    for (uint64_t id = 0; id < 16; id++)
        if (live[id])
            release(&f, id, f.now);
    fx_fini(&f);
}
END_TEST

static Suite *tier_suite(void)
{
    Suite *s = suite_create("pcache_tier");
    TCase *tc = tcase_create("tier");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, locations_name_gpu_pages_and_host_slots);
    tcase_add_test(tc, set_demoter_and_create_check_their_arguments);
    tcase_add_test(tc, an_accepting_demoter_moves_the_entry_to_the_host_medium);
    tcase_add_test(tc, a_declining_demoter_gives_todays_eviction);
    tcase_add_test(tc, the_watermark_demotes_in_eviction_order);
    tcase_add_test(tc, the_watermark_sees_ended_retention);
    tcase_add_test(tc, host_entries_are_misses_and_a_gpu_copy_replaces_them);
    tcase_add_test(tc, flush_and_scope_reset_cover_host_entries);
    tcase_add_test(tc, the_audit_checks_host_entries);
    tcase_add_loop_test(tc, random_operations_keep_owner_and_cache_in_step, 0, 2);
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
