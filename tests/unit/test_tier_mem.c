/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_tier_mem.c - the host tier's memory (backend/kvp_tier_mem.h) and the host backend's slot
 * mover (ops->move_slots, issue #28), without the cache or the daemon: the memory becomes ready
 * as a growing prefix of whole chunks, is zeroed, spaced slot_bytes apart and bound to a NUMA
 * node when asked; destroy stops the thread mid-way; create refuses what it cannot make;
 * pages go out to scattered slots and back into other pages byte-exact against the page-mover
 * (ops->move) of a second backend holding the same pool, for every layout, storage and element
 * size; a move it refuses changes neither the pool nor the slots.
 */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kvp_backend.h"
#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_test_util.h"
#include "kvp_tier_mem.h"

static const kvp_geom_t GEOMS[] = {
    {.num_layers = 2,
     .num_pages = 12,
     .page_size = 4,
     .num_kv_heads = 2,
     .head_dim = 8,
     .dtype = KVP_DTYPE_FP16,
     .layout = KVP_LAYOUT_NHD,
     .storage = KVP_STORAGE_COMBINED,
     .num_devices = 1},
    {.num_layers = 2,
     .num_pages = 12,
     .page_size = 4,
     .num_kv_heads = 3,
     .head_dim = 16,
     .dtype = KVP_DTYPE_FP8_E4M3,
     .layout = KVP_LAYOUT_HND,
     .storage = KVP_STORAGE_COMBINED,
     .num_devices = 1},
    {.num_layers = 3,
     .num_pages = 12,
     .page_size = 2,
     .num_kv_heads = 2,
     .head_dim = 4,
     .dtype = KVP_DTYPE_FP32,
     .layout = KVP_LAYOUT_NHD,
     .storage = KVP_STORAGE_SPLIT,
     .num_devices = 1},
    {.num_layers = 2,
     .num_pages = 12,
     .page_size = 4,
     .num_kv_heads = 4,
     .head_dim = 8,
     .dtype = KVP_DTYPE_BF16,
     .layout = KVP_LAYOUT_HND,
     .storage = KVP_STORAGE_SPLIT,
     .num_devices = 1},
};
#define NUM_GEOMS (sizeof(GEOMS) / sizeof(GEOMS[0]))

/* A host backend and its pool mapped writable through the exported fd (as a worker maps it). */
typedef struct {
    kvp_backend_t *b;
    uint8_t *pool;
    uint64_t bytes;
} pool_t;

static void pool_open(pool_t *p, const kvp_geom_t *g)
{
    ck_assert_int_eq(kvp_backend_host_create(g, &p->b), 0);
    p->bytes = p->b->derived.pool_bytes;
    int fd;
    ck_assert_int_eq(p->b->ops->export_fds(p->b, &fd, 1), 1);
    p->pool = mmap(NULL, p->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ck_assert_ptr_ne(p->pool, MAP_FAILED);
}

static void pool_close(pool_t *p)
{
    munmap(p->pool, p->bytes);
    p->b->ops->destroy(p->b);
}

/* Waits (bounded: 20 s) until the thread is done; checks every ready count it sees on the way
 * is a whole number of chunks (or all of them) and never goes down. */
static void wait_ready(const kvp_tier_mem_t *m, uint64_t chunk_slots)
{
    uint64_t last = 0;
    const struct timespec nap = {0, 200000};
    for (int i = 0; i < 100000 && !kvp_tier_mem_done(m); i++) {
        uint64_t r = kvp_tier_mem_ready_slots(m);
        KVP_CHECK(r >= last, "ready went down from %llu to %llu", (unsigned long long)last,
                  (unsigned long long)r);
        KVP_CHECK(r % chunk_slots == 0 || r == kvp_tier_mem_nslots(m),
                  "ready %llu is not a whole number of %llu-slot chunks", (unsigned long long)r,
                  (unsigned long long)chunk_slots);
        last = r;
        nanosleep(&nap, NULL);
    }
    ck_assert_int_eq(kvp_tier_mem_done(m), 1);
}

START_TEST(the_memory_becomes_ready_chunk_by_chunk_zeroed_and_slot_spaced)
{
    pool_t p;
    pool_open(&p, &GEOMS[0]);
    /* 2 layers x (K + V) x 4 tokens x 2 heads x 8 x fp16 */
    const uint64_t sb = kvp_backend_slot_bytes(p.b);
    ck_assert_uint_eq(sb, 2ull * 2 * 4 * 2 * 8 * 2);
    ck_assert_uint_eq(sb, kvp_backend_move_bytes(p.b, GEOMS[0].page_size));
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    /* a chunk of 1,000 bytes is one 512-byte slot, rounded up to a page's worth of slots so no
     * two chunks share a page (8 slots with 4 KiB pages) */
    const uint64_t chunk = page / sb;
    kvp_tier_mem_t *m = NULL;
    ck_assert_int_eq(kvp_tier_mem_create(p.b, 203, sb, 1000, -1, &m), 0);
    ck_assert_ptr_nonnull(m);
    ck_assert_uint_eq(kvp_tier_mem_nslots(m), 203);
    wait_ready(m, chunk);
    ck_assert_int_eq(kvp_tier_mem_error(m), 0);
    ck_assert_uint_eq(kvp_tier_mem_ready_slots(m), 203);
    ck_assert_uint_eq(kvp_tier_mem_ready_bytes(m), 203 * sb);
    uint8_t *s0 = kvp_tier_mem_slot(m, 0);
    for (uint64_t i = 0; i < 203; i++) {
        uint8_t *s = kvp_tier_mem_slot(m, i);
        ck_assert_ptr_eq(s, s0 + i * sb);
        for (uint64_t j = 0; j < sb; j++)
            KVP_CHECK(s[j] == 0, "slot %llu byte %llu is %u", (unsigned long long)i,
                      (unsigned long long)j, s[j]);
        memset(s, (int)(i & 0xff), sb); /* writable, every byte */
    }
    ck_assert_uint_eq(s0[202 * sb + sb - 1], 202);
    kvp_tier_mem_destroy(m);
    kvp_tier_mem_destroy(NULL); /* a no-op */

    /* chunk 0 is 1 GiB: one chunk, the whole tier at once; a slot larger than the backend's */
    ck_assert_int_eq(kvp_tier_mem_create(p.b, 5, 3 * sb, 0, -1, &m), 0);
    wait_ready(m, 5);
    ck_assert_uint_eq(kvp_tier_mem_ready_slots(m), 5);
    ck_assert_uint_eq(kvp_tier_mem_ready_bytes(m), 15 * sb);
    ck_assert_ptr_eq(kvp_tier_mem_slot(m, 4), (uint8_t *)kvp_tier_mem_slot(m, 0) + 12 * sb);
    kvp_tier_mem_destroy(m);
    pool_close(&p);
}
END_TEST

START_TEST(destroy_stops_the_thread_while_it_populates)
{
    pool_t p;
    pool_open(&p, &GEOMS[0]);
    const uint64_t sb = kvp_backend_slot_bytes(p.b);
    const uint64_t chunk = (uint64_t)sysconf(_SC_PAGESIZE) / sb;
    for (int round = 0; round < 3; round++) {
        /* 128 MiB in page-sized chunks: tens of thousands of steps, so destroy comes mid-way */
        kvp_tier_mem_t *m = NULL;
        ck_assert_int_eq(kvp_tier_mem_create(p.b, (128ull << 20) / sb, sb, 1, -1, &m), 0);
        if (round) { /* once at once, then after some progress */
            const struct timespec nap = {0, 2000000 * round};
            nanosleep(&nap, NULL);
        }
        const uint64_t r = kvp_tier_mem_ready_slots(m);
        ck_assert(r % chunk == 0 || r == kvp_tier_mem_nslots(m));
        kvp_tier_mem_destroy(m); /* joins: returns once the thread is gone */
    }
    pool_close(&p);
}
END_TEST

START_TEST(create_refuses_what_it_cannot_make)
{
    pool_t p;
    pool_open(&p, &GEOMS[0]);
    const uint64_t sb = kvp_backend_slot_bytes(p.b);
    kvp_tier_mem_t *sentinel = (kvp_tier_mem_t *)&p, *m = sentinel;
    ck_assert_int_eq(kvp_tier_mem_create(NULL, 4, sb, 0, -1, &m), KVP_EINVAL);
    ck_assert_int_eq(kvp_tier_mem_create(p.b, 4, sb, 0, -1, NULL), KVP_EINVAL);
    ck_assert_int_eq(kvp_tier_mem_create(p.b, 0, sb, 0, -1, &m), KVP_EINVAL);
    ck_assert_int_eq(kvp_tier_mem_create(p.b, 4, 0, 0, -1, &m), KVP_EINVAL);
    ck_assert_int_eq(kvp_tier_mem_create(p.b, 4, sb - 16, 0, -1, &m), KVP_EINVAL);
    ck_assert_int_eq(kvp_tier_mem_create(p.b, UINT64_MAX / sb + 1, sb, 0, -1, &m), KVP_EINVAL);
    ck_assert_int_eq(kvp_tier_mem_create(p.b, UINT64_MAX / sb, sb, 0, -1, &m), KVP_EINVAL);
    ck_assert_int_eq(kvp_tier_mem_create(p.b, 4, sb, 0, -2, &m), KVP_EINVAL);
    ck_assert_int_eq(kvp_tier_mem_create(p.b, 4, sb, 0, 1024, &m), KVP_EINVAL);
    /* a node that does not exist: mbind refuses it */
    ck_assert_int_eq(kvp_tier_mem_create(p.b, 4, sb, 0, 1000, &m), KVP_EINVAL);
    ck_assert_ptr_eq(m, sentinel);
    pool_close(&p);
}
END_TEST

START_TEST(numa_node_binds_the_whole_range)
{
    pool_t p;
    pool_open(&p, &GEOMS[0]);
    const uint64_t sb = kvp_backend_slot_bytes(p.b);
    kvp_tier_mem_t *m = NULL;
    ck_assert_int_eq(kvp_tier_mem_create(p.b, 64, sb, 0, 0, &m), 0);
    wait_ready(m, 64);
    ck_assert_int_eq(kvp_tier_mem_error(m), 0);
    for (uint64_t i = 0; i < 64; i += 21) {
        int mode = -1;
        unsigned long mask[16] = {0};
        ck_assert_int_eq(syscall(SYS_get_mempolicy, &mode, mask, 1024ul + 1,
                                 kvp_tier_mem_slot(m, i), 2ul /* MPOL_F_ADDR */),
                         0);
        ck_assert_int_eq(mode, 2); /* MPOL_BIND */
        ck_assert_uint_eq(mask[0], 1);
    }
    kvp_tier_mem_destroy(m);
    pool_close(&p);
}
END_TEST

/* Two backends with the same random pool: a is moved with move_slots, ref with the page-mover. */
typedef struct {
    pool_t a, ref;
    kvp_tier_mem_t *tier;
    uint64_t sb;
} pair_t;

static void pair_open(pair_t *t, const kvp_geom_t *g, uint64_t seed, uint64_t nslots)
{
    pool_open(&t->a, g);
    pool_open(&t->ref, g);
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(seed));
    kvp_rng_fill(&r, t->a.pool, t->a.bytes);
    memcpy(t->ref.pool, t->a.pool, t->a.bytes);
    t->sb = kvp_backend_slot_bytes(t->a.b);
    ck_assert_int_eq(kvp_tier_mem_create(t->a.b, nslots, t->sb, 0, -1, &t->tier), 0);
    wait_ready(t->tier, nslots);
}

static void pair_close(pair_t *t)
{
    kvp_tier_mem_destroy(t->tier);
    pool_close(&t->ref);
    pool_close(&t->a);
}

/* The page-mover's packed form of one whole page of ref, or its inverse. */
static void ref_move(pair_t *t, int dir, uint32_t page, void *buf)
{
    const int32_t pg = (int32_t)page;
    const uint32_t ps = t->ref.b->geom.page_size;
    const kvp_move_t m = {.dir = dir,
                          .pages = &pg,
                          .num_tokens = ps,
                          .begin = 0,
                          .end = kvp_backend_move_bytes(t->ref.b, ps),
                          .buf = buf,
                          .buf_medium = KVP_MEDIUM_HOST};
    ck_assert_int_eq(t->ref.b->ops->move(t->ref.b, &m), 0);
}

START_TEST(pages_go_out_to_scattered_slots_and_back_into_other_pages)
{
    const kvp_geom_t *g = &GEOMS[_i];
    pair_t t;
    pair_open(&t, g, 0x28a0 + (uint64_t)_i, 16);
    uint8_t *tier0 = kvp_tier_mem_slot(t.tier, 0);
    uint8_t *expect = malloc(16 * t.sb), *one = malloc(t.sb);
    ck_assert(expect && one);
    memset(expect, 0, 16 * t.sb);

    /* out: 5 scattered pages into 5 scattered slots; every other slot stays zero */
    const uint32_t pages[] = {5, 2, 11, 0, 7};
    const uint32_t slot_of[] = {9, 0, 15, 4, 3};
    void *slots[5];
    for (int i = 0; i < 5; i++) {
        slots[i] = kvp_tier_mem_slot(t.tier, slot_of[i]);
        ref_move(&t, KVP_MOVE_OUT, pages[i], expect + slot_of[i] * t.sb);
    }
    kvp_slot_move_t sm = {.dir = KVP_MOVE_OUT, .pages = pages, .slots = slots, .n = 5};
    ck_assert_int_eq(t.a.b->ops->move_slots(t.a.b, &sm), 0);
    ck_assert_mem_eq(tier0, expect, 16 * t.sb);
    ck_assert_mem_eq(t.a.pool, t.ref.pool, t.a.bytes); /* moving out changes no page */

    /* in: the same slots into 5 other pages (one of them a page that went out); the reference
     * moves the same bytes in with the page-mover, and the two pools must agree whole */
    const uint32_t into[] = {1, 10, 5, 8, 6};
    for (int i = 0; i < 5; i++)
        ref_move(&t, KVP_MOVE_IN, into[i], expect + slot_of[i] * t.sb);
    sm = (kvp_slot_move_t){.dir = KVP_MOVE_IN, .pages = into, .slots = slots, .n = 5};
    ck_assert_int_eq(t.a.b->ops->move_slots(t.a.b, &sm), 0);
    ck_assert_mem_eq(t.a.pool, t.ref.pool, t.a.bytes);
    ck_assert_mem_eq(tier0, expect, 16 * t.sb); /* moving in changes no slot */
    /* and page 1 now holds what page 5 held: its packed form is slot 9's */
    ref_move(&t, KVP_MOVE_OUT, 1, one);
    ck_assert_mem_eq(one, expect + 9 * t.sb, t.sb);

    /* one page, adjacent slots, a page moved out twice in one batch */
    const uint32_t twice[] = {3, 3, 4};
    void *adj[3] = {kvp_tier_mem_slot(t.tier, 10), kvp_tier_mem_slot(t.tier, 11),
                    kvp_tier_mem_slot(t.tier, 12)};
    sm = (kvp_slot_move_t){.dir = KVP_MOVE_OUT, .pages = twice, .slots = adj, .n = 3};
    ck_assert_int_eq(t.a.b->ops->move_slots(t.a.b, &sm), 0);
    ref_move(&t, KVP_MOVE_OUT, 3, expect + 10 * t.sb);
    ref_move(&t, KVP_MOVE_OUT, 3, expect + 11 * t.sb);
    ref_move(&t, KVP_MOVE_OUT, 4, expect + 12 * t.sb);
    ck_assert_mem_eq(tier0, expect, 16 * t.sb);
    ck_assert_int_eq(t.a.b->ops->health(t.a.b), 0);
    free(one);
    free(expect);
    pair_close(&t);
}
END_TEST

START_TEST(a_move_it_refuses_changes_nothing)
{
    pair_t t;
    pair_open(&t, &GEOMS[0], 0x28b0, 4);
    uint8_t *tier0 = kvp_tier_mem_slot(t.tier, 0);
    kvp_rng_t r;
    kvp_rng_seed(&r, 7);
    kvp_rng_fill(&r, tier0, 4 * t.sb);
    uint8_t *tier_before = malloc(4 * t.sb);
    ck_assert_ptr_nonnull(tier_before);
    memcpy(tier_before, tier0, 4 * t.sb);
    void *slots[3] = {kvp_tier_mem_slot(t.tier, 0), kvp_tier_mem_slot(t.tier, 2),
                      kvp_tier_mem_slot(t.tier, 3)};
    /* the bad page id last: nothing before it may have moved either */
    const uint32_t bad_last[] = {1, 2, GEOMS[0].num_pages};
    const uint32_t huge[] = {UINT32_MAX, 1, 2};
    const uint32_t good[] = {1, 2, 3};
    void *null_slot[3] = {slots[0], NULL, slots[2]};
    for (int dir = KVP_MOVE_OUT; dir <= KVP_MOVE_IN; dir++) {
        kvp_slot_move_t sm = {.dir = dir, .pages = bad_last, .slots = slots, .n = 3};
        ck_assert_int_eq(t.a.b->ops->move_slots(t.a.b, &sm), KVP_ERANGE);
        sm.pages = huge;
        ck_assert_int_eq(t.a.b->ops->move_slots(t.a.b, &sm), KVP_ERANGE);
        sm.pages = good;
        sm.n = 0;
        ck_assert_int_eq(t.a.b->ops->move_slots(t.a.b, &sm), KVP_EINVAL);
        sm.n = 3;
        sm.slots = NULL;
        ck_assert_int_eq(t.a.b->ops->move_slots(t.a.b, &sm), KVP_EINVAL);
        sm.slots = null_slot;
        ck_assert_int_eq(t.a.b->ops->move_slots(t.a.b, &sm), KVP_EINVAL);
        sm.slots = slots;
        sm.pages = NULL;
        ck_assert_int_eq(t.a.b->ops->move_slots(t.a.b, &sm), KVP_EINVAL);
        sm.pages = good;
        sm.dir = 2;
        ck_assert_int_eq(t.a.b->ops->move_slots(t.a.b, &sm), KVP_EINVAL);
        /* a NULL slot and a bad page: the argument is refused first */
        sm = (kvp_slot_move_t){.dir = dir, .pages = bad_last, .slots = null_slot, .n = 3};
        ck_assert_int_eq(t.a.b->ops->move_slots(t.a.b, &sm), KVP_EINVAL);
    }
    ck_assert_int_eq(t.a.b->ops->move_slots(t.a.b, NULL), KVP_EINVAL);
    ck_assert_mem_eq(t.a.pool, t.ref.pool, t.a.bytes);
    ck_assert_mem_eq(tier0, tier_before, 4 * t.sb);
    /* and the good one does move: the slots' random bytes land in pages 1..3 */
    kvp_slot_move_t sm = {.dir = KVP_MOVE_IN, .pages = good, .slots = slots, .n = 3};
    ck_assert_int_eq(t.a.b->ops->move_slots(t.a.b, &sm), 0);
    ck_assert_int_ne(memcmp(t.a.pool, t.ref.pool, t.a.bytes), 0);
    ck_assert_int_eq(t.a.b->ops->health(t.a.b), 0);
    free(tier_before);
    pair_close(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("tier_mem");
    TCase *tc = tcase_create("tier_mem");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, the_memory_becomes_ready_chunk_by_chunk_zeroed_and_slot_spaced);
    tcase_add_test(tc, destroy_stops_the_thread_while_it_populates);
    tcase_add_test(tc, create_refuses_what_it_cannot_make);
    tcase_add_test(tc, numa_node_binds_the_whole_range);
    tcase_add_loop_test(tc, pages_go_out_to_scattered_slots_and_back_into_other_pages, 0,
                        (int)NUM_GEOMS);
    tcase_add_test(tc, a_move_it_refuses_changes_nothing);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
