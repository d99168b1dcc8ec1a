/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_pcache_events.c - the prefix cache's events (issue #29, kvp_pcache.h "events"): the exact
 * sequence of STORED / REMOVED / CLEARED events, with their medium, scope, key, parent and
 * tokens, for every way an entry enters or leaves the key table (publish, eviction under
 * pressure, a rewrite by truncate, a failed restore, demotion, promotion, a lower host limit, a
 * full host tier, flushes of one scope and of all, publishing over a host twin), keep_tokens 0,
 * kvp_pcache_next_entry, the audit of the token store, and a seeded random run in which an
 * observer's set of (medium, scope, key) built from the events alone must equal what
 * kvp_pcache_next_entry lists after every operation (KVP_MODEL_OPS, default 20000 a run;
 * KVP_SEED=<n> repeats a run).
 */
#include <check.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_pagekey.h"
#include "kvp_pcache.h"
#include "kvp_pcache_internal.h"
#include "kvp_plan.h"
#include "kvp_test_util.h"

/* ---- recording events --------------------------------------------------------------------- */

#define MAXEV 64
#define MAXPS 8

/* What the observer was told, tokens copied (they are valid during the call only). Every event
 * is also checked against the table as the observer sees it: a STORED entry is findable in its
 * medium, a REMOVED one nowhere. */
typedef struct {
    const kvp_pcache_t *c;
    uint32_t ps, n;
    kvp_pcache_event_t ev[MAXEV];
    int32_t tok[MAXEV][MAXPS];
} rec_t;

static void rec_fn(void *ctx, const kvp_pcache_event_t *ev)
{
    rec_t *r = ctx;
    ck_assert_uint_lt(r->n, MAXEV);
    r->ev[r->n] = *ev;
    if (ev->tokens) {
        memcpy(r->tok[r->n], ev->tokens, r->ps * sizeof(int32_t));
        r->ev[r->n].tokens = r->tok[r->n];
    }
    if (ev->kind == KVP_PCEV_STORED) {
        const kvp_loc_t l = kvp_pcache_locate(r->c, ev->scope, ev->key);
        ck_assert_msg(!kvp_loc_is_none(l) && l.medium == ev->medium,
                      "event %u: STORED in medium %u, located in {%u,%u}", r->n, ev->medium,
                      l.medium, l.index);
    } else if (ev->kind == KVP_PCEV_REMOVED) {
        ck_assert_msg(kvp_loc_is_none(kvp_pcache_locate(r->c, ev->scope, ev->key)),
                      "event %u: REMOVED, still findable", r->n);
    }
    r->n++;
}

/* ---- fixture ------------------------------------------------------------------------------ */

typedef struct {
    kvp_alloc_t *a;
    kvp_seqtab_t *t;
    kvp_pcache_t *c;
    kvp_plan_t p;
    uint32_t ps, keep;
    uint64_t now;
    kvp_pcache_move_t mv[64];
    rec_t rec;
} fx_t;

static void fx_init(fx_t *f, uint32_t pages, uint32_t ps, uint32_t host_slots, uint32_t limit,
                    uint32_t keep)
{
    memset(f, 0, sizeof(*f));
    kvp_seqtab_config_t cfg = {.max_seqs = 64, .max_namespaces = 4, .max_seq_tokens = 0};
    kvp_pcache_config_t pc = {
        .max_scopes = 2, .max_pins = 4, .host_slots = host_slots, .keep_tokens = keep};
    ck_assert_int_eq(kvp_alloc_create(pages, &f->a), 0);
    ck_assert_int_eq(kvp_seqtab_create(f->a, ps, &cfg, &f->t), 0);
    ck_assert_int_eq(kvp_pcache_create(f->t, &pc, &f->c), 0);
    kvp_pcache_set_host_limit(f->c, limit);
    kvp_plan_init(&f->p);
    f->ps = ps;
    f->keep = keep;
    f->rec.c = f->c;
    f->rec.ps = ps;
    kvp_pcache_set_observer(f->c, rec_fn, &f->rec);
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

/* Destroys everything; the observer hears nothing of it (its owner may be gone). */
static void fx_fini(fx_t *f)
{
    fx_audit(f);
    f->rec.n = 0;
    kvp_plan_free(&f->p);
    kvp_pcache_destroy(f->c);
    ck_assert_uint_eq(f->rec.n, 0);
    kvp_seqtab_destroy(f->t);
    ck_assert_uint_eq(kvp_alloc_num_free(f->a), kvp_alloc_num_pages(f->a));
    kvp_alloc_destroy(f->a);
}

static kvp_plan_cache_t co(uint32_t scope, int reuse, int promote)
{
    kvp_plan_cache_t c = {.scope = scope,
                          .reuse = (uint8_t)reuse,
                          .priority = KVP_PCACHE_DEFAULT_PRIORITY,
                          .promote = (uint8_t)promote};
    return c;
}

#define DEF   co(0, 0, 0)
#define REUSE co(0, 1, 0)
#define PROMO co(0, 1, 1)

static void app(fx_t *f, uint64_t id, const int32_t *toks, uint32_t n, kvp_plan_cache_t c)
{
    kvp_plan_item_t it = {0, id, n};
    kvp_plan_content_t ct = {toks, NULL, 0};
    int rc = kvp_plan_append_cached(f->t, &it, &ct, 1, NULL, &c, f->now, &f->p);
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

static void publish(fx_t *f, uint64_t id, uint32_t want)
{
    ck_assert_uint_eq(kvp_pcache_publish_seq(f->c, seq(f, id)), want);
}

static kvp_pagekey_t root0(void)
{
    kvp_pagekey_t root;
    ck_assert_int_eq(kvp_pagekey_root(NULL, 0, &root), 0);
    return root;
}

/* the key of page i of a sequence holding toks (no salt) */
static kvp_pagekey_t key_at(const int32_t *toks, uint32_t i, uint32_t ps)
{
    kvp_pagekey_t keys[64];
    ck_assert_uint_eq(kvp_pagekey_chain(root0(), toks, (uint64_t)(i + 1) * ps, ps, keys, 64),
                      i + 1);
    return keys[i];
}

static const kvp_pagekey_t ZERO = {0, 0};

static void key_is(kvp_pagekey_t got, kvp_pagekey_t want, const char *what, uint32_t i)
{
    ck_assert_msg(kvp_pagekey_eq(got, want),
                  "event %u: %s %016" PRIx64 "%016" PRIx64 ", want %016" PRIx64 "%016" PRIx64, i,
                  what, got.hi, got.lo, want.hi, want.lo);
}

/* e is a STORED event of page k of a sequence holding toks, in medium and scope: its key, and
 * with keep_tokens its parent (page k - 1's key, none for page 0) and its tokens */
static void stored_is(const fx_t *f, const kvp_pcache_event_t *e, uint32_t i, uint32_t medium,
                      uint32_t scope, const int32_t *toks, uint32_t k)
{
    ck_assert_msg(e->kind == KVP_PCEV_STORED, "event %u: kind %u, want STORED", i, e->kind);
    ck_assert_msg(e->medium == medium, "event %u: medium %u, want %u", i, e->medium, medium);
    ck_assert_uint_eq(e->scope, scope);
    key_is(e->key, key_at(toks, k, f->ps), "key", i);
    if (!f->keep) {
        ck_assert_ptr_null(e->tokens);
        ck_assert_uint_eq(e->has_parent, 0);
        key_is(e->parent, ZERO, "parent", i);
        return;
    }
    ck_assert_uint_eq(e->has_parent, k > 0);
    key_is(e->parent, k ? key_at(toks, k - 1, f->ps) : ZERO, "parent", i);
    ck_assert_ptr_nonnull(e->tokens);
    for (uint32_t x = 0; x < f->ps; x++)
        ck_assert_msg(e->tokens[x] == toks[k * f->ps + x], "event %u: token %u is %d, want %d", i,
                      x, e->tokens[x], toks[k * f->ps + x]);
}

static void removed_is(const fx_t *f, const kvp_pcache_event_t *e, uint32_t i, uint32_t medium,
                       uint32_t scope, const int32_t *toks, uint32_t k)
{
    ck_assert_msg(e->kind == KVP_PCEV_REMOVED, "event %u: kind %u, want REMOVED", i, e->kind);
    ck_assert_msg(e->medium == medium, "event %u: medium %u, want %u", i, e->medium, medium);
    ck_assert_uint_eq(e->scope, scope);
    key_is(e->key, key_at(toks, k, f->ps), "key", i);
    ck_assert_uint_eq(e->has_parent, 0);
    key_is(e->parent, ZERO, "parent", i);
    ck_assert_ptr_null(e->tokens);
}

/* recorded event i */
#define EV(f, i) (&(f)->rec.ev[i])

/* exactly n events were recorded since the last call; forgets them */
static void took(fx_t *f, uint32_t n)
{
    ck_assert_msg(f->rec.n == n, "%u events, want %u", f->rec.n, n);
    f->rec.n = 0;
}

/* the entries kvp_pcache_next_entry lists, into out (room for max); returns how many */
static uint32_t entries(const fx_t *f, kvp_pcache_event_t *out, uint32_t max)
{
    uint32_t n = 0, cur = 0;
    kvp_pcache_event_t e;
    while (kvp_pcache_next_entry(f->c, &cur, &e) == 0) {
        ck_assert_uint_lt(n, max);
        out[n++] = e;
    }
    ck_assert_int_eq(kvp_pcache_next_entry(f->c, &cur, &e), KVP_ENOENT); /* stays at the end */
    return n;
}

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

/* 4 pages of 4 tokens, all cached: A (a0 a1) released at 100, B (b0 b1) at 110: GPU eviction
 * order a1 a0 b1 b0. The 4 STORED events of publishing are checked and forgotten. */
static void four_cached(fx_t *f)
{
    prompts();
    app(f, 1, A, 8, DEF);
    app(f, 2, B, 8, DEF);
    took(f, 0); /* keyed is not findable yet */
    publish(f, 1, 2);
    publish(f, 2, 2);
    stored_is(f, EV(f, 0), 0, KVP_MEDIUM_GPU, 0, A, 0);
    stored_is(f, EV(f, 1), 1, KVP_MEDIUM_GPU, 0, A, 1);
    stored_is(f, EV(f, 2), 2, KVP_MEDIUM_GPU, 0, B, 0);
    stored_is(f, EV(f, 3), 3, KVP_MEDIUM_GPU, 0, B, 1);
    took(f, 4);
    release(f, 1, 100);
    release(f, 2, 110);
    took(f, 0); /* cached is still findable */
}

/* four_cached, then A's pages demoted (a1 into host slot 0, a0 into slot 1), events forgotten */
static void a_in_host(fx_t *f)
{
    four_cached(f);
    const uint32_t want = kvp_alloc_num_free(f->a) + 2;
    ck_assert_uint_eq(kvp_pcache_demote_begin(f->c, 200, want, 8, f->mv), 2);
    ck_assert_uint_eq(kvp_pcache_demote_end(f->c, f->mv, 2, 1), 2);
    took(f, 4);
    fx_audit(f);
}

/* ---- publishing and keying ---------------------------------------------------------------- */

START_TEST(publishing_a_chain_stores_its_pages_in_order)
{
    fx_t f;
    fx_init(&f, 8, 4, 0, 0, 1);
    prompts();
    app(&f, 1, A, 14, DEF); /* 3 full pages and 2 tokens */
    took(&f, 0);
    publish(&f, 1, 3);
    for (uint32_t k = 0; k < 3; k++)
        stored_is(&f, EV(&f, k), k, KVP_MEDIUM_GPU, 0, A, k);
    took(&f, 3);
    /* the 4th page fills from the chain's partial tokens */
    app(&f, 1, A + 14, 2, DEF);
    publish(&f, 1, 1);
    stored_is(&f, EV(&f, 0), 0, KVP_MEDIUM_GPU, 0, A, 3);
    took(&f, 1);
    /* a reuse links the 4 pages and keys the 5th from its precomputed key */
    app(&f, 2, A, 20, REUSE);
    ck_assert_uint_eq(f.p.cached_tokens[0], 16);
    took(&f, 0); /* linking is no event */
    publish(&f, 2, 1);
    stored_is(&f, EV(&f, 0), 0, KVP_MEDIUM_GPU, 0, A, 4);
    took(&f, 1);
    /* the snapshot: the same 5 entries, in page order */
    kvp_pcache_event_t e[8];
    ck_assert_uint_eq(entries(&f, e, 8), 5);
    for (uint32_t i = 0; i < 5; i++) {
        uint32_t k = 0;
        while (k < 5 && pg(&f, 2, k) != kvp_pcache_locate(f.c, 0, e[i].key).index)
            k++;
        ck_assert_uint_lt(k, 5);
        stored_is(&f, &e[i], i, KVP_MEDIUM_GPU, 0, A, k);
        if (i)
            ck_assert_uint_lt(kvp_pcache_locate(f.c, 0, e[i - 1].key).index,
                              kvp_pcache_locate(f.c, 0, e[i].key).index);
    }
    /* a twin of a findable page stays private: no event */
    app(&f, 3, A, 4, DEF);
    publish(&f, 3, 0);
    took(&f, 0);
    release(&f, 3, 10);
    release(&f, 2, 10);
    release(&f, 1, 10);
    took(&f, 0);
    fx_fini(&f);
}
END_TEST

/* Without keep_tokens the events carry keys only, and the cache is smaller by exactly the
 * token store; keep_tokens above 1 is refused. */
START_TEST(without_keep_tokens_events_carry_keys_only)
{
    fx_t f;
    fx_init(&f, 8, 4, 2, 2, 0);
    prompts();
    app(&f, 1, A, 12, DEF);
    publish(&f, 1, 3);
    for (uint32_t k = 0; k < 3; k++)
        stored_is(&f, EV(&f, k), k, KVP_MEDIUM_GPU, 0, A, k);
    took(&f, 3);
    kvp_pcache_event_t e[8];
    ck_assert_uint_eq(entries(&f, e, 8), 3);
    for (uint32_t i = 0; i < 3; i++) {
        ck_assert_ptr_null(e[i].tokens);
        ck_assert_uint_eq(e[i].has_parent, 0);
    }
    release(&f, 1, 100); /* order a2 a1 a0 */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, 8, 1, f.mv), 1);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 1), 1);
    removed_is(&f, EV(&f, 0), 0, KVP_MEDIUM_GPU, 0, A, 2);
    stored_is(&f, EV(&f, 1), 1, KVP_MEDIUM_HOST, 0, A, 2);
    took(&f, 2);
    kvp_pcache_stats_t st0, st1;
    kvp_pcache_stats(f.c, &st0);
    fx_fini(&f);

    fx_init(&f, 8, 4, 2, 2, 1);
    kvp_pcache_stats(f.c, &st1);
    ck_assert_uint_eq(st1.bytes - st0.bytes, (8 + 2) * (4 * 4 + 17));
    fx_fini(&f);

    kvp_alloc_t *a;
    kvp_seqtab_t *t;
    kvp_pcache_t *c = NULL;
    kvp_seqtab_config_t cfg = {.max_seqs = 4, .max_namespaces = 1, .max_seq_tokens = 0};
    ck_assert_int_eq(kvp_alloc_create(4, &a), 0);
    ck_assert_int_eq(kvp_seqtab_create(a, 4, &cfg, &t), 0);
    kvp_pcache_config_t pc = {.max_scopes = 1, .max_pins = 1, .keep_tokens = 2};
    ck_assert_int_eq(kvp_pcache_create(t, &pc, &c), KVP_EINVAL);
    ck_assert_ptr_null(c);
    ck_assert_ptr_null(kvp_seqtab_pcache(t)); /* nothing attached */
    kvp_seqtab_destroy(t);
    kvp_alloc_destroy(a);
}
END_TEST

/* ---- entries leaving the GPU -------------------------------------------------------------- */

START_TEST(pressure_removes_the_evicted_page)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4, 1);
    four_cached(&f);
    f.now = 200;
    app(&f, 3, NULL, 4, DEF); /* takes a1, the GPU order's head */
    ck_assert_uint_eq(f.p.num_evicted, 1);
    removed_is(&f, EV(&f, 0), 0, KVP_MEDIUM_GPU, 0, A, 1);
    took(&f, 1);
    release(&f, 3, 300);
    took(&f, 0);
    fx_fini(&f);
}
END_TEST

START_TEST(a_rewrite_by_truncate_removes_the_page)
{
    fx_t f;
    fx_init(&f, 4, 4, 0, 0, 1);
    prompts();
    app(&f, 1, A, 8, DEF);
    publish(&f, 1, 2);
    took(&f, 2);
    ck_assert_int_eq(kvp_seqtab_truncate(f.t, 0, 1, 6, 10), 0); /* page 1 partial, sole holder */
    removed_is(&f, EV(&f, 0), 0, KVP_MEDIUM_GPU, 0, A, 1);
    took(&f, 1);
    /* filled again with the same tokens: keyed from the chain's kept tokens, stored again */
    app(&f, 1, A + 6, 2, DEF);
    publish(&f, 1, 1);
    stored_is(&f, EV(&f, 0), 0, KVP_MEDIUM_GPU, 0, A, 1);
    took(&f, 1);
    release(&f, 1, 20);
    fx_fini(&f);
}
END_TEST

START_TEST(a_failed_restore_removes_the_gpu_entry)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4, 1);
    a_in_host(&f);
    f.now = 300;
    app(&f, 3, A, 8, PROMO);
    ck_assert_uint_eq(f.p.num_restores, 2);
    took(&f, 4);
    kvp_pcache_move_t m[2] = {f.p.restores[0], f.p.restores[1]};
    kvp_pcache_restore_end(f.c, m, 1, 0); /* A0's failed */
    removed_is(&f, EV(&f, 0), 0, KVP_MEDIUM_GPU, 0, A, 0);
    took(&f, 1);
    kvp_pcache_restore_end(f.c, m + 1, 1, 1); /* A1's ended ok: it stays where it was */
    took(&f, 0);
    release(&f, 3, 310);
    took(&f, 0);
    fx_fini(&f);
}
END_TEST

/* ---- moves between tiers ------------------------------------------------------------------ */

START_TEST(demotion_and_promotion_move_entries_between_media)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4, 1);
    four_cached(&f);
    const uint32_t want = kvp_alloc_num_free(f.a) + 2;
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, want, 8, f.mv), 2);
    took(&f, 0); /* in flight: still the GPU's */
    kvp_pcache_event_t e[8];
    ck_assert_uint_eq(entries(&f, e, 8), 4);
    for (uint32_t i = 0; i < 4; i++)
        ck_assert_uint_eq(e[i].medium, KVP_MEDIUM_GPU);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 2, 1), 2);
    /* a1 into slot 0, then a0 into slot 1: each REMOVED from the GPU, STORED in the host tier
     * with its tokens and parent */
    removed_is(&f, EV(&f, 0), 0, KVP_MEDIUM_GPU, 0, A, 1);
    stored_is(&f, EV(&f, 1), 1, KVP_MEDIUM_HOST, 0, A, 1);
    removed_is(&f, EV(&f, 2), 2, KVP_MEDIUM_GPU, 0, A, 0);
    stored_is(&f, EV(&f, 3), 3, KVP_MEDIUM_HOST, 0, A, 0);
    took(&f, 4);
    fx_audit(&f);
    /* a failed demotion moves nothing */
    const uint32_t b0 = kvp_pcache_find(f.c, 0, key_at(B, 0, 4));
    const uint32_t b1 = kvp_pcache_find(f.c, 0, key_at(B, 1, 4));
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 210, 4, 1, f.mv), 1);
    ck_assert_uint_eq(f.mv[0].page, b1);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 0), 0);
    took(&f, 0);
    /* the snapshot: GPU pages in page order, then host slots in slot order */
    ck_assert_uint_eq(entries(&f, e, 8), 4);
    stored_is(&f, &e[0], 0, KVP_MEDIUM_GPU, 0, B, b0 < b1 ? 0 : 1);
    stored_is(&f, &e[1], 1, KVP_MEDIUM_GPU, 0, B, b0 < b1 ? 1 : 0);
    stored_is(&f, &e[2], 2, KVP_MEDIUM_HOST, 0, A, 1); /* slot 0 */
    stored_is(&f, &e[3], 3, KVP_MEDIUM_HOST, 0, A, 0); /* slot 1 */
    /* the freed pages hold other content first (keyed, never published: no event), so the
     * promoted entries' tokens can only come from their host slots */
    app(&f, 4, C, 8, DEF);
    release(&f, 4, 290);
    took(&f, 0);
    /* promotion: each host entry REMOVED there, STORED on its fresh page */
    f.now = 300;
    app(&f, 3, A, 8, PROMO);
    ck_assert_uint_eq(f.p.num_restores, 2);
    removed_is(&f, EV(&f, 0), 0, KVP_MEDIUM_HOST, 0, A, 0);
    stored_is(&f, EV(&f, 1), 1, KVP_MEDIUM_GPU, 0, A, 0);
    removed_is(&f, EV(&f, 2), 2, KVP_MEDIUM_HOST, 0, A, 1);
    stored_is(&f, EV(&f, 3), 3, KVP_MEDIUM_GPU, 0, A, 1);
    took(&f, 4);
    /* restoring pages are the GPU's entries */
    ck_assert_uint_eq(entries(&f, e, 8), 4);
    for (uint32_t i = 0; i < 4; i++)
        ck_assert_uint_eq(e[i].medium, KVP_MEDIUM_GPU);
    kvp_pcache_restore_end(f.c, f.p.restores, 2, 1);
    took(&f, 0);
    release(&f, 3, 310);
    took(&f, 0);
    fx_fini(&f);
}
END_TEST

START_TEST(the_host_limit_and_a_full_tier_remove_host_entries)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4, 1);
    a_in_host(&f); /* A1 in slot 0, A0 in slot 1 */
    kvp_pcache_set_host_limit(f.c, 1);
    removed_is(&f, EV(&f, 0), 0, KVP_MEDIUM_HOST, 0, A, 0);
    took(&f, 1);
    /* one usable slot, holding A1: a demotion drops it for good, then b1 moves there */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 300, 4, 1, f.mv), 1);
    removed_is(&f, EV(&f, 0), 0, KVP_MEDIUM_HOST, 0, A, 1);
    took(&f, 1);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 1), 1);
    removed_is(&f, EV(&f, 0), 0, KVP_MEDIUM_GPU, 0, B, 1);
    stored_is(&f, EV(&f, 1), 1, KVP_MEDIUM_HOST, 0, B, 1);
    took(&f, 2);
    kvp_pcache_set_host_limit(f.c, 4); /* raising drops nothing */
    took(&f, 0);
    fx_fini(&f);
}
END_TEST

START_TEST(publishing_over_a_host_twin_replaces_it)
{
    fx_t f;
    fx_init(&f, 4, 4, 4, 4, 1);
    a_in_host(&f);
    app(&f, 3, A, 8, DEF);
    took(&f, 0);
    publish(&f, 3, 2);
    removed_is(&f, EV(&f, 0), 0, KVP_MEDIUM_HOST, 0, A, 0);
    stored_is(&f, EV(&f, 1), 1, KVP_MEDIUM_GPU, 0, A, 0);
    removed_is(&f, EV(&f, 2), 2, KVP_MEDIUM_HOST, 0, A, 1);
    stored_is(&f, EV(&f, 3), 3, KVP_MEDIUM_GPU, 0, A, 1);
    took(&f, 4);
    release(&f, 3, 300);
    fx_fini(&f);
}
END_TEST

/* ---- flush -------------------------------------------------------------------------------- */

START_TEST(a_flush_of_one_scope_removes_each_entry)
{
    fx_t f;
    fx_init(&f, 8, 4, 4, 4, 1);
    prompts();
    app(&f, 1, A, 8, DEF); /* scope 0, cached below */
    app(&f, 2, B, 8, co(1, 0, 0));
    app(&f, 3, C, 4, DEF); /* scope 0, held */
    publish(&f, 1, 2);
    publish(&f, 2, 2);
    publish(&f, 3, 1);
    took(&f, 5);
    release(&f, 1, 100);
    release(&f, 2, 110); /* order a1 a0 b1 b0 */
    /* a1 to host slot 0; a0 demoting, in flight */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, kvp_alloc_num_free(f.a) + 2, 2, f.mv), 2);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 1), 1);
    took(&f, 2);
    /* scope 0: the demoting page, then the host entry; scope 1 and the held page stay */
    ck_assert_uint_eq(kvp_pcache_flush(f.c, 0), 2);
    removed_is(&f, EV(&f, 0), 0, KVP_MEDIUM_GPU, 0, A, 0);
    removed_is(&f, EV(&f, 1), 1, KVP_MEDIUM_HOST, 0, A, 1);
    took(&f, 2);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv + 1, 1, 1), 0); /* cancelled */
    took(&f, 0);
    /* scope 1: its two cached pages, b1 first (the GPU order) */
    ck_assert_uint_eq(kvp_pcache_flush(f.c, 1), 2);
    removed_is(&f, EV(&f, 0), 0, KVP_MEDIUM_GPU, 1, B, 1);
    removed_is(&f, EV(&f, 1), 1, KVP_MEDIUM_GPU, 1, B, 0);
    took(&f, 2);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, 1), 0);
    took(&f, 0);
    release(&f, 3, 300);
    fx_fini(&f);
}
END_TEST

/* Everything at once: one CLEARED, then STORED of what is still findable (held, pinned,
 * restoring), never a REMOVED. */
START_TEST(a_flush_of_every_scope_is_cleared_then_what_is_left)
{
    fx_t f;
    fx_init(&f, 8, 4, 4, 4, 1);
    prompts();
    app(&f, 1, A, 8, DEF);         /* held, scope 0 */
    app(&f, 2, B, 4, co(1, 0, 0)); /* cached, scope 1 */
    app(&f, 3, C, 4, DEF);         /* demoted, then promoted: restoring */
    app(&f, 4, D, 4, co(1, 0, 0)); /* demoted: a host entry */
    app(&f, 5, E, 4, DEF);         /* demoting */
    app(&f, 6, B + 4, 4, DEF);     /* pinned, its sequence gone */
    for (uint32_t id = 1; id <= 6; id++)
        publish(&f, id, id == 1 ? 2 : 1);
    took(&f, 7);
    release(&f, 3, 100);
    release(&f, 4, 101); /* GPU order C0 D0 */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 150, kvp_alloc_num_free(f.a) + 2, 2, f.mv), 2);
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 2, 1), 2); /* C0 slot 0, D0 slot 1 */
    took(&f, 4);
    f.now = 160;
    app(&f, 7, C, 4, PROMO);
    ck_assert_uint_eq(f.p.num_restores, 1);
    took(&f, 2);
    const kvp_pcache_move_t restore = f.p.restores[0];
    release(&f, 7, 170); /* restoring at refcount 0, pinned by its restore */
    release(&f, 2, 180);
    release(&f, 5, 190); /* GPU order B0 E0 */
    uint64_t pin;
    ck_assert_int_eq(kvp_pcache_pin(f.c, 0, 0, root0(), B + 4, 4, 190, 1000, &pin, NULL), 0);
    release(&f, 6, 195);
    /* B0 and E0 start demoting (slots 2, 3); B0's copy fails, so it is cached again */
    ck_assert_uint_eq(kvp_pcache_demote_begin(f.c, 200, kvp_alloc_num_free(f.a) + 2, 2, f.mv), 2);
    ck_assert_uint_eq(f.mv[0].page, kvp_pcache_find(f.c, 1, key_at(B, 0, 4)));
    ck_assert_uint_eq(f.mv[1].page, kvp_pcache_find(f.c, 0, key_at(E, 0, 4)));
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv, 1, 0), 0);
    took(&f, 0);
    fx_audit(&f);
    /* now: A0 A1 held, C0 restoring, B4 pinned, B0 cached, E0 demoting, D0 in the host tier */
    kvp_pcache_stats_t st;
    kvp_pcache_stats(f.c, &st);
    ck_assert_uint_eq(st.indexed_pages, 6);
    ck_assert_uint_eq(st.host_pages, 1);
    ck_assert_uint_eq(st.demoting, 1);
    ck_assert_uint_eq(st.restoring, 1);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE), 3);
    /* CLEARED, its fields zero */
    const kvp_pcache_event_t *cl = EV(&f, 0);
    ck_assert_uint_eq(cl->kind, KVP_PCEV_CLEARED);
    ck_assert_uint_eq(cl->medium, 0);
    ck_assert_uint_eq(cl->scope, 0);
    ck_assert_uint_eq(cl->has_parent, 0);
    key_is(cl->key, ZERO, "key", 0);
    key_is(cl->parent, ZERO, "parent", 0);
    ck_assert_ptr_null(cl->tokens);
    /* then the 4 survivors, in page order, as the snapshot lists them */
    ck_assert_uint_eq(f.rec.n, 5);
    kvp_pcache_event_t e[8];
    ck_assert_uint_eq(entries(&f, e, 8), 4);
    const uint32_t pa0 = kvp_pcache_find(f.c, 0, key_at(A, 0, 4));
    const uint32_t pa1 = kvp_pcache_find(f.c, 0, key_at(A, 1, 4));
    const uint32_t pc0 = kvp_pcache_find(f.c, 0, key_at(C, 0, 4));
    const uint32_t pb4 = kvp_pcache_find(f.c, 0, key_at(B + 4, 0, 4));
    ck_assert_uint_eq(pc0, restore.page);
    uint32_t last = 0;
    for (uint32_t i = 0; i < 4; i++) {
        const kvp_pcache_event_t *s = EV(&f, 1 + i);
        const uint32_t p = kvp_pcache_find(f.c, s->scope, s->key);
        ck_assert(i == 0 || p > last);
        last = p;
        if (p == pa0)
            stored_is(&f, s, 1 + i, KVP_MEDIUM_GPU, 0, A, 0);
        else if (p == pa1)
            stored_is(&f, s, 1 + i, KVP_MEDIUM_GPU, 0, A, 1);
        else if (p == pc0)
            stored_is(&f, s, 1 + i, KVP_MEDIUM_GPU, 0, C, 0);
        else {
            ck_assert_uint_eq(p, pb4);
            stored_is(&f, s, 1 + i, KVP_MEDIUM_GPU, 0, B + 4, 0);
        }
        ck_assert(kvp_pagekey_eq(e[i].key, s->key) && e[i].scope == s->scope);
    }
    took(&f, 5);
    kvp_pcache_stats(f.c, &st);
    ck_assert_uint_eq(st.indexed_pages, 4);
    ck_assert_uint_eq(st.host_pages, 0);
    ck_assert_uint_eq(st.demoting, 0);
    /* the observer is told again afterwards; an empty flush is a CLEARED alone */
    ck_assert_uint_eq(kvp_pcache_demote_end(f.c, f.mv + 1, 1, 1), 0); /* E0's: cancelled */
    kvp_pcache_restore_end(f.c, &restore, 1, 1);
    ck_assert_int_eq(kvp_pcache_unpin(f.c, 0, pin), 1);
    ck_assert_int_eq(kvp_seqtab_release(f.t, 0, 1), 0);
    took(&f, 0);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE), 4);
    ck_assert_uint_eq(EV(&f, 0)->kind, KVP_PCEV_CLEARED);
    took(&f, 1);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, 0), 0);
    took(&f, 0);
    fx_fini(&f);
}
END_TEST

/* ---- the observer, the iterator, the audit ------------------------------------------------ */

START_TEST(no_observer_no_events_and_the_iterator_at_its_ends)
{
    fx_t f;
    fx_init(&f, 4, 4, 2, 2, 1);
    prompts();
    kvp_pcache_event_t e;
    uint32_t cur = 0;
    ck_assert_int_eq(kvp_pcache_next_entry(f.c, &cur, &e), KVP_ENOENT); /* empty */
    kvp_pcache_set_observer(f.c, NULL, &f.rec);
    app(&f, 1, A, 8, DEF);
    publish(&f, 1, 2);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE), 0);
    release(&f, 1, 10);
    ck_assert_uint_eq(kvp_pcache_flush(f.c, KVP_PCACHE_NO_SCOPE), 2);
    took(&f, 0);
    app(&f, 2, A, 4, DEF);
    publish(&f, 2, 1);
    kvp_pcache_set_observer(f.c, rec_fn, &f.rec);
    cur = 0;
    ck_assert_int_eq(kvp_pcache_next_entry(f.c, &cur, &e), 0);
    stored_is(&f, &e, 0, KVP_MEDIUM_GPU, 0, A, 0);
    ck_assert_uint_eq(cur, pg(&f, 2, 0) + 1);
    ck_assert_int_eq(kvp_pcache_next_entry(f.c, &cur, &e), KVP_ENOENT);
    cur = 1000; /* past every slot */
    ck_assert_int_eq(kvp_pcache_next_entry(f.c, &cur, &e), KVP_ENOENT);
    release(&f, 2, 20);
    took(&f, 0);
    fx_fini(&f);
}
END_TEST

START_TEST(the_audit_checks_the_token_store)
{
    fx_t f;
    fx_init(&f, 4, 4, 2, 2, 1);
    prompts();
    app(&f, 1, A, 8, DEF);
    publish(&f, 1, 2);
    fx_audit(&f);
    kvp_pcache_t *c = f.c;
    const uint32_t p0 = pg(&f, 1, 0), p1 = pg(&f, 1, 1);
    c->has_parent[p0] = 2;
    audit_fails_with(&f, "has_parent 2");
    c->has_parent[p0] = 0;
    c->tok[(size_t)p1 * 4 + 3]++;
    audit_fails_with(&f, "its parent and tokens do not make its key");
    c->tok[(size_t)p1 * 4 + 3]--;
    c->parent[p1].lo ^= 1;
    audit_fails_with(&f, "its parent and tokens do not make its key");
    c->parent[p1].lo ^= 1;
    fx_audit(&f);
    release(&f, 1, 10);
    fx_fini(&f);
}
END_TEST

/* ---- a random run ------------------------------------------------------------------------- */

#define M_NP      40 /* GPU pages */
#define M_PS      2
#define M_NH      12 /* host slots */
#define M_NSEQ    8
#define M_NPROMPT 3
#define M_PLEN    20
#define M_MAXPG   (M_PLEN / M_PS)
#define M_NSCOPE  2
#define M_NKEYS   (M_NPROMPT * M_MAXPG)
#define M_MAXMOVE 256
#define M_NONE    UINT32_MAX

typedef struct {
    int live, ids; /* ids: started with token ids (grows with them, from prompt q) */
    uint32_t q, len, scope;
} rseq_t;

typedef struct {
    kvp_alloc_t *a;
    kvp_seqtab_t *t;
    kvp_pcache_t *c;
    kvp_plan_t p;
    uint32_t keep;
    uint64_t now;
    /* the prompts, their page keys, each key's tokens and place in its chain */
    int32_t prompt[M_NPROMPT][M_PLEN];
    kvp_pagekey_t key[M_NKEYS];
    const int32_t *ktok[M_NKEYS];
    uint32_t kpos[M_NKEYS], nkeys;
    /* what the events said: findable (medium, scope, key id) */
    uint8_t seen[KVP_MEDIUMS][M_NSCOPE][M_NKEYS];
    uint64_t counts[3][KVP_MEDIUMS], replayed;
    int in_clear; /* between a CLEARED and the flush's return */
    rseq_t sq[M_NSEQ];
    uint64_t pins[4];
    kvp_pcache_move_t dem[M_MAXMOVE], res[M_MAXMOVE];
    uint32_t ndem, nres;
    kvp_rng_t r;
} rm_t;

static uint32_t rnd(rm_t *m, uint32_t n)
{
    return kvp_rng_below(&m->r, n);
}

static uint32_t rm_kid(const rm_t *m, kvp_pagekey_t k)
{
    for (uint32_t i = 0; i < m->nkeys; i++)
        if (kvp_pagekey_eq(m->key[i], k))
            return i;
    return M_NONE;
}

/* a STORED event or snapshot entry tells the content the test gave that page */
static uint32_t rm_check_stored(const rm_t *m, const kvp_pcache_event_t *e, const char *what)
{
    const uint32_t kid = rm_kid(m, e->key);
    KVP_CHECK(kid != M_NONE, "%s: a key no prompt has", what);
    KVP_CHECK(e->kind == KVP_PCEV_STORED && e->medium < KVP_MEDIUMS && e->scope < M_NSCOPE,
              "%s: kind %u medium %u scope %u", what, e->kind, e->medium, e->scope);
    if (!m->keep) {
        KVP_CHECK(e->tokens == NULL && e->has_parent == 0 && kvp_pagekey_eq(e->parent, ZERO),
                  "%s: tokens or a parent without keep_tokens", what);
        return kid;
    }
    const uint32_t k = m->kpos[kid];
    KVP_CHECK(e->tokens && memcmp(e->tokens, m->ktok[kid], M_PS * sizeof(int32_t)) == 0,
              "%s: key %u's tokens differ", what, kid);
    KVP_CHECK(e->has_parent == (k > 0), "%s: key %u has_parent %u at page %u", what, kid,
              e->has_parent, k);
    if (k) {
        const uint32_t pk = rm_kid(m, e->parent);
        KVP_CHECK(pk != M_NONE && m->kpos[pk] == k - 1 &&
                      kvp_pagekey_eq(kvp_pagekey_next(e->parent, e->tokens, M_PS), e->key),
                  "%s: key %u's parent is not its previous page", what, kid);
    } else {
        KVP_CHECK(kvp_pagekey_eq(e->parent, ZERO), "%s: a first page with a parent", what);
    }
    return kid;
}

static void rm_observe(void *ctx, const kvp_pcache_event_t *e)
{
    rm_t *m = ctx;
    if (e->kind == KVP_PCEV_CLEARED) {
        KVP_CHECK(!m->in_clear, "a CLEARED inside a clear");
        memset(m->seen, 0, sizeof(m->seen));
        m->counts[KVP_PCEV_CLEARED][0]++;
        m->in_clear = 1;
        return;
    }
    KVP_CHECK(e->kind <= KVP_PCEV_REMOVED && e->medium < KVP_MEDIUMS && e->scope < M_NSCOPE,
              "event kind %u medium %u scope %u", e->kind, e->medium, e->scope);
    const kvp_loc_t l = kvp_pcache_locate(m->c, e->scope, e->key);
    if (e->kind == KVP_PCEV_STORED) {
        const uint32_t kid = rm_check_stored(m, e, "STORED");
        for (uint32_t md = 0; md < KVP_MEDIUMS; md++)
            KVP_CHECK(!m->seen[md][e->scope][kid], "STORED key %u scope %u, already in medium %u",
                      kid, e->scope, md);
        KVP_CHECK(!kvp_loc_is_none(l) && l.medium == e->medium, "STORED, not findable there");
        m->seen[e->medium][e->scope][kid] = 1;
        m->replayed += m->in_clear;
    } else {
        KVP_CHECK(!m->in_clear, "a REMOVED during a flush of every scope");
        const uint32_t kid = rm_kid(m, e->key);
        KVP_CHECK(kid != M_NONE && m->seen[e->medium][e->scope][kid],
                  "REMOVED of key %u scope %u medium %u, never stored", kid, e->scope, e->medium);
        KVP_CHECK(e->tokens == NULL && e->has_parent == 0, "REMOVED with tokens");
        KVP_CHECK(kvp_loc_is_none(l), "REMOVED, still findable");
        m->seen[e->medium][e->scope][kid] = 0;
    }
    m->counts[e->kind][e->medium]++;
}

/* the events' set is exactly the snapshot, and the snapshot exactly the table */
static void rm_check(rm_t *m, uint64_t op)
{
    char msg[256] = "";
    int rc = kvp_pcache_audit(m->c, msg, sizeof(msg));
    KVP_CHECK(rc == 0, "op %" PRIu64 ": audit: %s", op, msg);
    uint8_t got[KVP_MEDIUMS][M_NSCOPE][M_NKEYS];
    memset(got, 0, sizeof(got));
    uint32_t n = 0, cur = 0;
    kvp_pcache_event_t e;
    while (kvp_pcache_next_entry(m->c, &cur, &e) == 0) {
        const uint32_t kid = rm_check_stored(m, &e, "snapshot");
        KVP_CHECK(!got[e.medium][e.scope][kid]++, "op %" PRIu64 ": the snapshot lists key %u twice",
                  op, kid);
        const kvp_loc_t l = kvp_pcache_locate(m->c, e.scope, e.key);
        KVP_CHECK(l.medium == e.medium &&
                      l.index == (e.medium == KVP_MEDIUM_GPU ? cur - 1 : cur - 1 - M_NP),
                  "op %" PRIu64 ": snapshot entry at slot %u is located elsewhere", op, cur - 1);
        n++;
    }
    KVP_CHECK(memcmp(got, m->seen, sizeof(got)) == 0,
              "op %" PRIu64 ": the events' set differs from the snapshot", op);
    kvp_pcache_stats_t st;
    kvp_pcache_stats(m->c, &st);
    KVP_CHECK(n == st.indexed_pages + st.host_pages, "op %" PRIu64 ": %u entries, %u + %u counted",
              op, n, st.indexed_pages, st.host_pages);
}

static void rm_publish(rm_t *m, uint32_t id)
{
    kvp_seq_t *s = kvp_seqtab_find(m->t, 0, id);
    if (s)
        kvp_pcache_publish_seq(m->c, s);
}

/* appends n tokens to id: a new chain of prompt q (ids), or more of its prompt */
static void rm_plan(rm_t *m, uint32_t id, uint32_t n, int ids, uint32_t q, kvp_plan_cache_t cc)
{
    rseq_t *s = &m->sq[id];
    if (m->nres + 2 * M_MAXPG > M_MAXMOVE)
        return;
    const uint32_t from = s->live ? s->len : 0;
    const uint32_t pq = s->live ? s->q : q;
    const int with = s->live ? s->ids && ids : ids;
    kvp_plan_item_t it = {0, id, n};
    kvp_plan_content_t ct = {with ? m->prompt[pq] + from : NULL, NULL, 0};
    const int rc = kvp_plan_append_cached(m->t, &it, &ct, 1, NULL, &cc, m->now, &m->p);
    KVP_CHECK(rc == 0 || rc == KVP_ENOSPC, "plan: %s", kvp_errname(rc));
    if (rc)
        return;
    if (!s->live) {
        *s = (rseq_t){.live = 1, .ids = ids, .q = q, .scope = cc.scope};
    } else if (!ids) {
        s->ids = 0;
    }
    s->len = from + n;
    for (uint32_t i = 0; i < m->p.num_restores; i++)
        m->res[m->nres++] = m->p.restores[i];
    if (rnd(m, 3))
        rm_publish(m, id);
}

static void rm_op(rm_t *m)
{
    const uint32_t w = rnd(m, 24), id = rnd(m, M_NSEQ);
    rseq_t *s = &m->sq[id];
    if (w < 5) { /* a new sequence */
        if (s->live)
            return;
        kvp_plan_cache_t cc = {.scope = rnd(m, M_NSCOPE),
                               .reuse = (uint8_t)(rnd(m, 4) != 0),
                               .leave_last = (uint8_t)(rnd(m, 3) == 0),
                               .priority = (uint8_t)(rnd(m, 2) ? 35 : 70),
                               .daemon_writes = 1};
        cc.promote = (uint8_t)(cc.reuse && rnd(m, 3) != 0);
        rm_plan(m, id, 1 + rnd(m, M_PLEN), rnd(m, 6) != 0, rnd(m, M_NPROMPT), cc);
    } else if (w < 8) { /* grows */
        if (!s->live || s->len >= M_PLEN)
            return;
        const uint32_t room = M_PLEN - s->len;
        kvp_plan_cache_t cc = {.scope = s->scope, .daemon_writes = 1};
        rm_plan(m, id, 1 + rnd(m, room < 5 ? room : 5), rnd(m, 10) != 0, s->q, cc);
    } else if (w < 10) {
        if (!s->live)
            return;
        KVP_CHECK(kvp_seqtab_release(m->t, 0, id) == 0, "release");
        memset(s, 0, sizeof(*s));
    } else if (w < 11) {
        const uint32_t b = rnd(m, M_NSEQ);
        if (!s->live || m->sq[b].live)
            return;
        KVP_CHECK(kvp_seqtab_fork(m->t, 0, id, b, m->now) == 0, "fork");
        m->sq[b] = *s;
    } else if (w < 13) {
        if (!s->live)
            return;
        const uint32_t len = rnd(m, s->len + 1);
        KVP_CHECK(kvp_seqtab_truncate(m->t, 0, id, len, m->now) == 0, "truncate");
        s->len = len;
    } else if (w < 15) {
        rm_publish(m, id);
    } else if (w < 17) {
        const uint32_t max = rnd(m, 6);
        if (m->ndem + max > M_MAXMOVE)
            return;
        m->now += rnd(m, 3);
        m->ndem += kvp_pcache_demote_begin(m->c, m->now, rnd(m, M_NP + 1), max, m->dem + m->ndem);
    } else if (w < 19) { /* some demotions end, in random order, all ok or all failed */
        if (!m->ndem)
            return;
        kvp_pcache_move_t mv[M_MAXMOVE];
        uint32_t n = 0;
        for (const uint32_t k = 1 + rnd(m, m->ndem); n < k;) {
            const uint32_t i = rnd(m, m->ndem);
            mv[n++] = m->dem[i];
            m->dem[i] = m->dem[--m->ndem];
        }
        kvp_pcache_demote_end(m->c, mv, n, rnd(m, 5) != 0);
    } else if (w < 20) { /* some restores end */
        if (!m->nres)
            return;
        kvp_pcache_move_t mv[M_MAXMOVE];
        uint32_t n = 0;
        for (const uint32_t k = 1 + rnd(m, m->nres); n < k;) {
            const uint32_t i = rnd(m, m->nres);
            mv[n++] = m->res[i];
            m->res[i] = m->res[--m->nres];
        }
        kvp_pcache_restore_end(m->c, mv, n, rnd(m, 6) != 0);
    } else if (w < 21) {
        const uint32_t scope = rnd(m, 3) ? rnd(m, M_NSCOPE) : KVP_PCACHE_NO_SCOPE;
        kvp_pcache_flush(m->c, scope);
        m->in_clear = 0; /* the flush's STOREDs are in */
    } else if (w < 22) {
        kvp_pcache_set_host_limit(m->c, rnd(m, 4) ? M_NH - rnd(m, 3) : rnd(m, M_NH / 2));
    } else if (w < 23) {
        uint64_t *pin = &m->pins[rnd(m, 4)];
        if (*pin) {
            KVP_CHECK(kvp_pcache_unpin(m->c, 0, *pin) > 0, "unpin");
            *pin = 0;
            return;
        }
        const uint32_t q = rnd(m, M_NPROMPT);
        const int rc = kvp_pcache_pin(m->c, 0, rnd(m, M_NSCOPE), root0(), m->prompt[q],
                                      1 + rnd(m, M_PLEN), m->now, UINT32_MAX, pin, NULL);
        KVP_CHECK(rc == 0 || rc == KVP_ENOENT || rc == KVP_ELIMIT, "pin: %s", kvp_errname(rc));
        if (rc)
            *pin = 0;
    } else {
        m->now += 1 + rnd(m, 5);
        kvp_pcache_set_now(m->c, m->now);
    }
}

static uint64_t env_u64(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    return v && *v ? strtoull(v, NULL, 0) : dflt;
}

/* run 0 with keep_tokens, run 1 without */
START_TEST(the_events_follow_the_table)
{
    static rm_t mm;
    rm_t *m = &mm;
    memset(m, 0, sizeof(*m));
    m->keep = _i == 0;
    const uint64_t seed = env_u64("KVP_SEED", 0x29e0 + (uint64_t)_i);
    const uint64_t ops = env_u64("KVP_MODEL_OPS", 20000);
    printf("test_pcache_events: keep_tokens %u KVP_SEED=%" PRIu64 " KVP_MODEL_OPS=%" PRIu64 "\n",
           m->keep, seed, ops);
    fflush(stdout);
    kvp_rng_seed(&m->r, seed);
    for (uint32_t q = 0; q < M_NPROMPT; q++)
        for (uint32_t i = 0; i < M_PLEN; i++) /* a shared 6-token head, then the prompt's own */
            m->prompt[q][i] = (int32_t)(i < 6 ? i : 1000 * (q + 1) + i);
    for (uint32_t q = 0; q < M_NPROMPT; q++) {
        kvp_pagekey_t keys[M_MAXPG];
        kvp_pagekey_chain(root0(), m->prompt[q], M_PLEN, M_PS, keys, M_MAXPG);
        for (uint32_t k = 0; k < M_MAXPG; k++) {
            if (rm_kid(m, keys[k]) != M_NONE)
                continue; /* the shared head: same tokens, same place */
            m->key[m->nkeys] = keys[k];
            m->ktok[m->nkeys] = m->prompt[q] + k * M_PS;
            m->kpos[m->nkeys++] = k;
        }
    }
    kvp_seqtab_config_t cfg = {.max_seqs = 64, .max_namespaces = 2, .max_seq_tokens = 0};
    kvp_pcache_config_t pc = {
        .max_scopes = M_NSCOPE, .max_pins = 4, .host_slots = M_NH, .keep_tokens = m->keep};
    ck_assert_int_eq(kvp_alloc_create(M_NP, &m->a), 0);
    ck_assert_int_eq(kvp_seqtab_create(m->a, M_PS, &cfg, &m->t), 0);
    ck_assert_int_eq(kvp_pcache_create(m->t, &pc, &m->c), 0);
    kvp_pcache_set_host_limit(m->c, M_NH);
    kvp_plan_init(&m->p);
    kvp_pcache_set_observer(m->c, rm_observe, m);
    for (uint64_t op = 1; op <= ops; op++) {
        rm_op(m);
        KVP_CHECK(!m->in_clear, "op %" PRIu64 ": a CLEARED outside a flush", op);
        rm_check(m, op);
    }
    printf("test_pcache_events: stored gpu %" PRIu64 " host %" PRIu64 ", removed gpu %" PRIu64
           " host %" PRIu64 ", cleared %" PRIu64 " (%" PRIu64 " entries told again)\n",
           m->counts[KVP_PCEV_STORED][KVP_MEDIUM_GPU], m->counts[KVP_PCEV_STORED][KVP_MEDIUM_HOST],
           m->counts[KVP_PCEV_REMOVED][KVP_MEDIUM_GPU],
           m->counts[KVP_PCEV_REMOVED][KVP_MEDIUM_HOST], m->counts[KVP_PCEV_CLEARED][0],
           m->replayed);
    fflush(stdout);
    if (ops >= 20000) /* a run this long reaches every kind of event */
        ck_assert_msg(m->counts[KVP_PCEV_STORED][KVP_MEDIUM_GPU] &&
                          m->counts[KVP_PCEV_STORED][KVP_MEDIUM_HOST] &&
                          m->counts[KVP_PCEV_REMOVED][KVP_MEDIUM_GPU] &&
                          m->counts[KVP_PCEV_REMOVED][KVP_MEDIUM_HOST] &&
                          m->counts[KVP_PCEV_CLEARED][0] && m->replayed,
                      "an event kind never happened (see the counts above)");
    /* the daemon drains its moves, then everything goes, silently */
    kvp_pcache_demote_end(m->c, m->dem, m->ndem, 1);
    kvp_pcache_restore_end(m->c, m->res, m->nres, 1);
    rm_check(m, ops + 1);
    for (uint32_t id = 0; id < M_NSEQ; id++)
        if (m->sq[id].live)
            ck_assert_int_eq(kvp_seqtab_release(m->t, 0, id), 0);
    kvp_plan_free(&m->p);
    kvp_pcache_destroy(m->c);
    kvp_seqtab_destroy(m->t);
    ck_assert_uint_eq(kvp_alloc_num_free(m->a), M_NP);
    kvp_alloc_destroy(m->a);
}
END_TEST

static Suite *events_suite(void)
{
    Suite *s = suite_create("pcache_events");
    TCase *tc = tcase_create("events");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, publishing_a_chain_stores_its_pages_in_order);
    tcase_add_test(tc, without_keep_tokens_events_carry_keys_only);
    tcase_add_test(tc, pressure_removes_the_evicted_page);
    tcase_add_test(tc, a_rewrite_by_truncate_removes_the_page);
    tcase_add_test(tc, a_failed_restore_removes_the_gpu_entry);
    tcase_add_test(tc, demotion_and_promotion_move_entries_between_media);
    tcase_add_test(tc, the_host_limit_and_a_full_tier_remove_host_entries);
    tcase_add_test(tc, publishing_over_a_host_twin_replaces_it);
    tcase_add_test(tc, a_flush_of_one_scope_removes_each_entry);
    tcase_add_test(tc, a_flush_of_every_scope_is_cleared_then_what_is_left);
    tcase_add_test(tc, no_observer_no_events_and_the_iterator_at_its_ends);
    tcase_add_test(tc, the_audit_checks_the_token_store);
    tcase_add_loop_test(tc, the_events_follow_the_table, 0, 2);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(events_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
