/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_tier_cuda.c - the cuda backend's host-tier mover (ops->move_slots, issue #28) and the host
 * tier's pinned memory (backend/kvp_tier_mem.h) on a real GPU. The pool is filled with random
 * bytes through a second mapping of its exported fd, a host copy of it kept as the reference;
 * pages go out to scattered slots of the tier, each slot checked byte-exact against the CPU
 * pack of that page of the reference (kvp_kv_pack_range_cpu, the host backend's packed form),
 * then come back into other pages, the whole pool read back against the CPU unpack applied to
 * the reference. Batch sizes 1, odd ones, one page past a staging chunk and enough to go round
 * the staging ring, and adjacent slots across the tier's pinned chunks; four geometries
 * (Llama-3.1-8B's, and every layout, storage and element size); four threads at once on disjoint
 * pages; a tensor-parallel pool of two devices (skipped with one GPU); refused moves change nothing
 * and leave the backend healthy; the tier's memory is pinned, and destroyed while it is still being
 * pinned.
 *
 * Each test runs in its own forked process (Check's fork mode), and the probe for a GPU in a
 * child too. Exits 77 where no GPU is usable (CI).
 */
#include <check.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvp_backend.h"
#include "kvp_cuda_vmm.h"
#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_gpu_test.h"
#include "kvp_kernels.h"
#include "kvp_kernels_cuda.h"
#include "kvp_test_util.h"
#include "kvp_tier_mem.h"

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        ck_assert_msg(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                 \
    } while (0)

#define MAX_DEV 2

static const kvp_geom_t GEOMS[] = {
    /* Llama-3.1-8B: a page is 2 MiB packed, 8 of them a staging chunk */
    {32, 96, 16, 8, 128, KVP_DTYPE_BF16, KVP_LAYOUT_NHD, KVP_STORAGE_COMBINED, 1},
    /* 32 KiB pages: a chunk is the most pages one launch takes (256) */
    {4, 600, 8, 4, 64, KVP_DTYPE_FP16, KVP_LAYOUT_HND, KVP_STORAGE_SPLIT, 1},
    {3, 64, 4, 2, 32, KVP_DTYPE_FP8_E4M3, KVP_LAYOUT_NHD, KVP_STORAGE_SPLIT, 1},
    {2, 80, 16, 1, 64, KVP_DTYPE_FP32, KVP_LAYOUT_HND, KVP_STORAGE_COMBINED, 1},
};
#define NUM_GEOMS (sizeof(GEOMS) / sizeof(GEOMS[0]))

/* The backend, its pools mapped a second time and their host references, and a tier. */
typedef struct {
    kvp_backend_t *b;
    uint32_t ndev;
    kvp_cuda_vmm_t view[MAX_DEV];
    uint8_t *ref[MAX_DEV], *back;
    kvp_tier_mem_t *tier;
    uint64_t nslots, sb, pb; /* slot bytes, one device's part of a slot */
} world_t;

static void wait_tier(const kvp_tier_mem_t *m)
{
    const struct timespec nap = {0, 1000000};
    for (int i = 0; i < 120000 && !kvp_tier_mem_done(m); i++)
        nanosleep(&nap, NULL);
    ck_assert_int_eq(kvp_tier_mem_done(m), 1);
    ck_assert_int_eq(kvp_tier_mem_error(m), 0);
    ck_assert_uint_eq(kvp_tier_mem_ready_slots(m), kvp_tier_mem_nslots(m));
}

static void world_open(world_t *w, const kvp_geom_t *g, uint32_t ndev, uint64_t nslots,
                       uint64_t seed)
{
    memset(w, 0, sizeof(*w));
    int devs[MAX_DEV] = {0, 1};
    kvp_geom_t gg = *g;
    gg.num_devices = ndev;
    w->ndev = ndev;
    ck_assert_int_eq(kvp_backend_cuda_create(&gg, devs, (int)ndev, NULL, &w->b), 0);
    kvp_backend_t *b = w->b;
    int fds[MAX_DEV];
    ck_assert_int_eq(b->ops->export_fds(b, fds, MAX_DEV), (int)ndev);
    const size_t n = b->derived.pool_bytes;
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(seed));
    for (uint32_t d = 0; d < ndev; d++) {
        CK(cudaSetDevice((int)d));
        int rc = kvp_cuda_vmm_import(fds[d], (int)d, b->map_bytes, &w->view[d], NULL);
        ck_assert_msg(rc == 0, "import of the pool fd: %s", kvp_cuda_last_error());
        w->ref[d] = malloc(n);
        ck_assert_ptr_nonnull(w->ref[d]);
        kvp_rng_fill(&r, w->ref[d], n);
        CK(cudaMemcpy((void *)(uintptr_t)w->view[d].ptr, w->ref[d], n, cudaMemcpyHostToDevice));
    }
    w->back = malloc(n);
    ck_assert_ptr_nonnull(w->back);
    w->pb = kvp_backend_move_bytes(b, g->page_size);
    w->sb = kvp_backend_slot_bytes(b);
    ck_assert_uint_eq(w->sb, ndev * w->pb);
    w->nslots = nslots;
    /* small chunks, so the pinning is several steps */
    ck_assert_int_eq(kvp_tier_mem_create(b, nslots, w->sb, 8 * w->sb, -1, &w->tier), 0);
    wait_tier(w->tier);
    /* pinned: the driver knows the memory as host memory it registered */
    struct cudaPointerAttributes pa;
    CK(cudaPointerGetAttributes(&pa, kvp_tier_mem_slot(w->tier, nslots - 1)));
    ck_assert_int_eq(pa.type, cudaMemoryTypeHost);
    memset(kvp_tier_mem_slot(w->tier, 0), 0, nslots * w->sb);
}

static void world_compare(world_t *w, const char *what)
{
    const size_t n = w->b->derived.pool_bytes;
    for (uint32_t d = 0; d < w->ndev; d++) {
        CK(cudaSetDevice((int)d));
        CK(cudaMemcpy(w->back, (void *)(uintptr_t)w->view[d].ptr, n, cudaMemcpyDeviceToHost));
        size_t i = 0;
        while (i < n && w->back[i] == w->ref[d][i])
            i++;
        ck_assert_msg(i == n, "%s: device %u's pool differs from the reference at byte %zu of %zu",
                      what, d, i, n);
    }
}

static void world_close(world_t *w)
{
    kvp_tier_mem_destroy(w->tier);
    for (uint32_t d = 0; d < w->ndev; d++) {
        kvp_cuda_vmm_free(&w->view[d]);
        free(w->ref[d]);
    }
    free(w->back);
    w->b->ops->destroy(w->b);
}

/* The CPU's packed form of page of the reference (every device's part), or its unpack into
 * the reference. */
static void ref_page(world_t *w, int dir, uint32_t page, uint8_t *slot)
{
    const kvp_backend_t *b = w->b;
    const int32_t pg = (int32_t)page;
    const uint32_t ps = b->geom.page_size, L = b->geom.num_layers;
    const uint64_t lb = w->pb / L;
    for (uint32_t d = 0; d < w->ndev; d++)
        for (uint32_t l = 0; l < L; l++) {
            kvp_paged_kv_t kv;
            kvp_backend_layer_view(b, w->ref[d], l, &kv);
            uint8_t *part = slot + d * w->pb + l * lb;
            if (dir == KVP_MOVE_OUT)
                ck_assert_int_eq(kvp_kv_pack_range_cpu(&kv, &pg, ps, 0, lb, part), 0);
            else
                ck_assert_int_eq(kvp_kv_unpack_range_cpu(&kv, &pg, ps, 0, lb, part), 0);
        }
}

/* n distinct random values below limit (n <= limit). */
static void pick(kvp_rng_t *r, uint32_t *out, uint32_t n, uint32_t limit)
{
    uint32_t *all = malloc(limit * sizeof(uint32_t));
    ck_assert_ptr_nonnull(all);
    for (uint32_t i = 0; i < limit; i++)
        all[i] = i;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t j = i + kvp_rng_below(r, limit - i);
        uint32_t t = all[i];
        all[i] = all[j];
        all[j] = t;
        out[i] = all[i];
    }
    free(all);
}

/* n pages out to n scattered slots (adjacent: slots 0..n-1 in order), checked; then those slots
 * into n other pages, checked. */
static void out_and_back(world_t *w, kvp_rng_t *r, uint32_t n, int adjacent, const char *what)
{
    const uint32_t np = w->b->geom.num_pages;
    uint32_t *from = malloc(n * sizeof(uint32_t)), *into = malloc(n * sizeof(uint32_t)),
             *slot = malloc(n * sizeof(uint32_t));
    void **addr = malloc(n * sizeof(void *));
    uint8_t *expect = malloc(w->sb), *tier_before = malloc(w->nslots * w->sb);
    ck_assert(from && into && slot && addr && expect && tier_before);
    pick(r, from, n, np);
    pick(r, into, n, np);
    pick(r, slot, n, (uint32_t)w->nslots);
    for (uint32_t i = 0; adjacent && i < n; i++)
        slot[i] = i;
    for (uint32_t i = 0; i < n; i++)
        addr[i] = kvp_tier_mem_slot(w->tier, slot[i]);
    uint8_t *tier0 = kvp_tier_mem_slot(w->tier, 0);

    kvp_slot_move_t m = {.dir = KVP_MOVE_OUT, .pages = from, .slots = addr, .n = n};
    ck_assert_int_eq(w->b->ops->move_slots(w->b, &m), 0);
    for (uint32_t i = 0; i < n; i++) {
        ref_page(w, KVP_MOVE_OUT, from[i], expect);
        ck_assert_msg(memcmp(addr[i], expect, w->sb) == 0,
                      "%s: n=%u, page %u's slot %u differs from the CPU pack", what, n, from[i],
                      slot[i]);
    }
    world_compare(w, what); /* moving out changes no page */

    memcpy(tier_before, tier0, w->nslots * w->sb);
    m = (kvp_slot_move_t){.dir = KVP_MOVE_IN, .pages = into, .slots = addr, .n = n};
    ck_assert_int_eq(w->b->ops->move_slots(w->b, &m), 0);
    for (uint32_t i = 0; i < n; i++)
        ref_page(w, KVP_MOVE_IN, into[i], addr[i]);
    world_compare(w, what);
    ck_assert_msg(memcmp(tier0, tier_before, w->nslots * w->sb) == 0,
                  "%s: n=%u, moving in changed a slot", what, n);
    ck_assert_int_eq(w->b->ops->health(w->b), 0);
    free(tier_before);
    free(expect);
    free(addr);
    free(slot);
    free(into);
    free(from);
}

START_TEST(pages_go_out_to_slots_and_back_into_other_pages_byte_exact)
{
    const kvp_geom_t *g = &GEOMS[_i];
    world_t w;
    world_open(&w, g, 1, g->num_pages, 0x28c0 + (uint64_t)_i);
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(0x28d0 + (uint64_t)_i));
    /* the mover's staging chunk: up to 16 MiB of pages, at most KVP_PACK_PAGES_MAX */
    uint64_t chunk = (16u << 20) / w.pb;
    chunk = chunk < 1 ? 1 : chunk > KVP_PACK_PAGES_MAX ? KVP_PACK_PAGES_MAX : chunk;
    const uint32_t np = g->num_pages;
    uint32_t sizes[] = {1, 7, (uint32_t)chunk + 1, (uint32_t)(4 * chunk + 5), np};
    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
        uint32_t n = sizes[k] < np ? sizes[k] : np;
        char what[64];
        snprintf(what, sizeof(what), "geometry %d batch %u", _i, n);
        out_and_back(&w, &r, n, 0, what);
    }
    /* slots 0..19 in order: across the boundary of the tier's 8-slot pinned chunks (a copy
     * that spanned two registrations would be refused) */
    out_and_back(&w, &r, 20, 1, "adjacent slots across pinned chunks");
    world_close(&w);
}
END_TEST

/* Four threads, each moving its own pages through its own slots, several rounds at once. */
typedef struct {
    world_t *w;
    uint32_t from[12], into[12];
    void *slots[12];
    uint32_t n;
    int rc;
} mover_t;

static void *mover(void *arg)
{
    mover_t *mv = arg;
    kvp_backend_t *b = mv->w->b;
    for (int round = 0; round < 6 && !mv->rc; round++) {
        kvp_slot_move_t m = {
            .dir = KVP_MOVE_OUT, .pages = mv->from, .slots = mv->slots, .n = mv->n};
        if ((mv->rc = b->ops->move_slots(b, &m)))
            break;
        m = (kvp_slot_move_t){
            .dir = KVP_MOVE_IN, .pages = mv->into, .slots = mv->slots, .n = mv->n};
        mv->rc = b->ops->move_slots(b, &m);
    }
    return NULL;
}

START_TEST(threads_move_at_once_without_disturbing_each_other)
{
    world_t w;
    world_open(&w, &GEOMS[0], 1, 96, 0x28e0);
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(0x28e1));
    uint32_t perm[96], sperm[96];
    pick(&r, perm, 96, 96);
    pick(&r, sperm, 96, 96);
    mover_t mv[4];
    pthread_t th[4];
    /* thread t owns pages perm[24t, 24t + 24) and slots sperm[24t, ...): 9 + t of its first
     * twelve pages go out and come back into 9 + t of its other twelve */
    for (uint32_t t = 0; t < 4; t++) {
        mv[t] = (mover_t){.w = &w, .n = 9 + t};
        for (uint32_t i = 0; i < mv[t].n; i++) {
            mv[t].from[i] = perm[t * 24 + i];
            mv[t].into[i] = perm[t * 24 + 12 + i];
            mv[t].slots[i] = kvp_tier_mem_slot(w.tier, sperm[t * 24 + i]);
        }
    }
    for (uint32_t t = 0; t < 4; t++)
        ck_assert_int_eq(pthread_create(&th[t], NULL, mover, &mv[t]), 0);
    for (uint32_t t = 0; t < 4; t++) {
        pthread_join(th[t], NULL);
        ck_assert_msg(mv[t].rc == 0, "thread %u: %s", t, kvp_strerror(mv[t].rc));
    }
    /* every round moves the same bytes: from -> slots -> into; "from" pages never change */
    uint8_t *slot = malloc(w.sb);
    ck_assert_ptr_nonnull(slot);
    for (uint32_t t = 0; t < 4; t++)
        for (uint32_t i = 0; i < mv[t].n; i++) {
            ref_page(&w, KVP_MOVE_OUT, mv[t].from[i], slot);
            ck_assert_msg(memcmp(slot, mv[t].slots[i], w.sb) == 0, "thread %u slot %u", t, i);
            ref_page(&w, KVP_MOVE_IN, mv[t].into[i], slot);
        }
    world_compare(&w, "four threads");
    free(slot);
    world_close(&w);
}
END_TEST

START_TEST(a_tensor_parallel_slot_holds_every_devices_heads)
{
    if (kvp_gpu_count() < 2) {
        printf("one GPU: the tensor-parallel case is skipped\n");
        return;
    }
    kvp_geom_t g = GEOMS[0];
    g.num_pages = 64; /* 4 heads a device */
    world_t w;
    world_open(&w, &g, 2, 64, 0x28f0);
    ck_assert_uint_eq(w.b->derived.heads, 4);
    kvp_rng_t r;
    kvp_rng_seed(&r, kvp_test_seed(0x28f1));
    out_and_back(&w, &r, 1, 0, "tp batch 1");
    out_and_back(&w, &r, 21, 1, "tp batch 21, adjacent slots");
    out_and_back(&w, &r, 64, 0, "tp batch 64");
    world_close(&w);
}
END_TEST

START_TEST(a_move_it_refuses_changes_nothing)
{
    world_t w;
    world_open(&w, &GEOMS[2], 1, 8, 0x2900);
    kvp_rng_t r;
    kvp_rng_seed(&r, 0x2901);
    uint8_t *tier0 = kvp_tier_mem_slot(w.tier, 0);
    kvp_rng_fill(&r, tier0, 8 * w.sb);
    uint8_t *before = malloc(8 * w.sb);
    ck_assert_ptr_nonnull(before);
    memcpy(before, tier0, 8 * w.sb);
    void *slots[3] = {kvp_tier_mem_slot(w.tier, 1), kvp_tier_mem_slot(w.tier, 4),
                      kvp_tier_mem_slot(w.tier, 6)};
    void *null_slot[3] = {slots[0], NULL, slots[2]};
    const uint32_t bad[] = {3, 9, GEOMS[2].num_pages}, good[] = {3, 9, 12};
    for (int dir = KVP_MOVE_OUT; dir <= KVP_MOVE_IN; dir++) {
        kvp_slot_move_t m = {.dir = dir, .pages = bad, .slots = slots, .n = 3};
        ck_assert_int_eq(w.b->ops->move_slots(w.b, &m), KVP_ERANGE);
        m.pages = good, m.n = 0;
        ck_assert_int_eq(w.b->ops->move_slots(w.b, &m), KVP_EINVAL);
        m.n = 3, m.slots = NULL;
        ck_assert_int_eq(w.b->ops->move_slots(w.b, &m), KVP_EINVAL);
        m.slots = null_slot;
        ck_assert_int_eq(w.b->ops->move_slots(w.b, &m), KVP_EINVAL);
        m.slots = slots, m.pages = NULL;
        ck_assert_int_eq(w.b->ops->move_slots(w.b, &m), KVP_EINVAL);
        m.pages = good, m.dir = 5;
        ck_assert_int_eq(w.b->ops->move_slots(w.b, &m), KVP_EINVAL);
    }
    ck_assert_int_eq(memcmp(tier0, before, 8 * w.sb), 0);
    world_compare(&w, "after the refused moves");
    ck_assert_int_eq(w.b->ops->health(w.b), 0);
    /* the good one moves: the slots' random bytes land in pages 3, 9, 12 */
    kvp_slot_move_t m = {.dir = KVP_MOVE_IN, .pages = good, .slots = slots, .n = 3};
    ck_assert_int_eq(w.b->ops->move_slots(w.b, &m), 0);
    for (int i = 0; i < 3; i++)
        ref_page(&w, KVP_MOVE_IN, good[i], slots[i]);
    world_compare(&w, "after the good move");
    free(before);
    world_close(&w);
}
END_TEST

START_TEST(the_tier_is_destroyed_while_it_is_being_pinned)
{
    kvp_backend_t *b;
    int dev = 0;
    ck_assert_int_eq(kvp_backend_cuda_create(&GEOMS[0], &dev, 1, NULL, &b), 0);
    const uint64_t sb = kvp_backend_slot_bytes(b);
    for (int round = 0; round < 3; round++) {
        /* 4 GiB in 64 MiB chunks: destroyed at once, after some chunks, and when ready */
        kvp_tier_mem_t *m = NULL;
        ck_assert_int_eq(kvp_tier_mem_create(b, 2048, sb, 64ull << 20, -1, &m), 0);
        if (round == 1) {
            const struct timespec nap = {0, 50000000};
            nanosleep(&nap, NULL);
        } else if (round == 2) {
            wait_tier(m);
        }
        kvp_tier_mem_destroy(m);
    }
    /* and the memory a new tier pins works */
    kvp_tier_mem_t *m = NULL;
    ck_assert_int_eq(kvp_tier_mem_create(b, 4, sb, 0, -1, &m), 0);
    wait_tier(m);
    const uint32_t pages[] = {1, 2, 3, 4};
    void *slots[4];
    for (int i = 0; i < 4; i++)
        slots[i] = kvp_tier_mem_slot(m, (uint64_t)i);
    kvp_slot_move_t mv = {.dir = KVP_MOVE_OUT, .pages = pages, .slots = slots, .n = 4};
    ck_assert_int_eq(b->ops->move_slots(b, &mv), 0);
    kvp_tier_mem_destroy(m);
    ck_assert_int_eq(b->ops->health(b), 0);
    b->ops->destroy(b);
}
END_TEST

int main(void)
{
    if (kvp_gpu_count() < 1) {
        printf("no usable GPU: skipped\n");
        return 77;
    }
    Suite *s = suite_create("tier_cuda");
    TCase *tc = tcase_create("tier_cuda");
    tcase_set_timeout(tc, 300);
    tcase_add_loop_test(tc, pages_go_out_to_slots_and_back_into_other_pages_byte_exact, 0,
                        (int)NUM_GEOMS);
    tcase_add_test(tc, threads_move_at_once_without_disturbing_each_other);
    tcase_add_test(tc, a_tensor_parallel_slot_holds_every_devices_heads);
    tcase_add_test(tc, a_move_it_refuses_changes_nothing);
    tcase_add_test(tc, the_tier_is_destroyed_while_it_is_being_pinned);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_set_fork_status(sr, CK_FORK); /* a fresh process, and CUDA context, per test */
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
