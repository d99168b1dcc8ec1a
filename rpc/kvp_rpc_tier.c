/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc_tier.c - the host tier's part of the rpc layer (issue #28): its memory, the
 * background demoter and the restores, and the calls that wait for a restore.
 *
 * The prefix cache (kvcache/kvp_pcache) decides what moves: kvp_pcache_demote_begin names
 * cached GPU pages and the host slots they go to, the planner names host entries it promoted
 * (kvp_plan_t.restores); this file copies the bytes on the worker threads (the backend's
 * ops->move_slots) and tells the cache when each batch ended. Nothing here waits on the loop:
 *
 *   demoter  kvp__rpc_tier_kick (after every plan, each tick, each finished batch) keeps
 *            cache.demote_free_pct of the pool free: it starts a batch of at most
 *            cache.demote_batch_pages when free pages fall under the watermark, at most
 *            MAX_DEMOTIONS batches at once. An allocation beyond the free pages evicts
 *            without demoting (the cache's pressure path), so a Reserve never waits for a copy.
 *   restore  a plan that promoted host entries gets one restore task (a job of its own on the
 *            worker threads: restores of different calls run concurrently). Every call whose
 *            plan links a page being restored, its own or another call's (a join), waits for
 *            that task before it answers: its job is parked (kvp_rpc_job_t.waits) and handed
 *            to the worker threads when the last task it waits for finishes.
 *
 * The tier's memory is allocated and pinned by kvp_tier_mem's own thread; the cache's usable
 * host slots follow what is ready (kvp_pcache_set_host_limit) and cache.host_bytes (a reload
 * may lower it, never raise it above the start's). Loop thread, but the jobs' run().
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_log.h"
#include "kvp_rpc_internal.h"
#include "kvp_tier_mem.h"

/* Demotion batches in flight at once: two keep the copy engine busy while one batch ends. */
#define MAX_DEMOTIONS 2u

/* ---- a batch of page moves on a worker thread -------------------------------------------- */

typedef struct restore_task restore_task_t;

typedef struct {
    kvp_rpc_job_t base;
    int dir; /* KVP_MOVE_OUT: a demotion; KVP_MOVE_IN: a restore */
    uint32_t n;
    uint64_t ns; /* time the copy took */
    kvp_pcache_move_t *moves;
    void **slots;
    /* a restore: the calls waiting for it */
    kvp_rpc_job_t **waiters;
    uint32_t num_waiters, cap_waiters;
    uint64_t mark; /* a call counting its tasks once (kvp__rpc_tier_wait) */
} move_job_t;

static void move_run(kvp_rpc_job_t *base)
{
    move_job_t *j = (move_job_t *)base;
    kvp_backend_t *b = base->rpc->backend;
    uint32_t pages[256];
    uint64_t t0 = uv_hrtime();
    base->rc = 0;
    for (uint32_t i = 0; i < j->n && !base->rc; i += 256) { /* pages in chunks of the stack */
        uint32_t k = j->n - i < 256 ? j->n - i : 256;
        for (uint32_t x = 0; x < k; x++)
            pages[x] = j->moves[i + x].page;
        kvp_slot_move_t m = {.dir = j->dir, .pages = pages, .slots = j->slots + i, .n = k};
        base->rc = b->ops->move_slots(b, &m);
    }
    j->ns = uv_hrtime() - t0;
}

static void move_free(kvp_rpc_job_t *base)
{
    move_job_t *j = (move_job_t *)base;
    free(j->waiters);
    free(j);
}

static void demote_finish(kvp_rpc_t *r, kvp_rpc_job_t *base, kvp_rpc_io_t *io, uint64_t now_ms);
static void restore_finish(kvp_rpc_t *r, kvp_rpc_job_t *base, kvp_rpc_io_t *io, uint64_t now_ms);

static const kvp_rpc_job_ops_t demote_ops = {
    .name = "demote", .run = move_run, .finish = demote_finish, .free = move_free};
static const kvp_rpc_job_ops_t restore_ops = {
    .name = "restore", .run = move_run, .finish = restore_finish, .free = move_free};

/* A job for n moves (one allocation: the job, its moves, its slot addresses). */
static move_job_t *move_job(kvp_rpc_t *r, int dir, const kvp_pcache_move_t *moves, uint32_t n)
{
    size_t sz = sizeof(move_job_t) + (size_t)n * (sizeof(kvp_pcache_move_t) + sizeof(void *));
    move_job_t *j = calloc(1, sz);
    if (!j)
        return NULL;
    j->base.ops = dir == KVP_MOVE_OUT ? &demote_ops : &restore_ops;
    j->base.rpc = r;
    j->dir = dir;
    j->n = n;
    j->slots = (void **)(j + 1);
    j->moves = (kvp_pcache_move_t *)(j->slots + n);
    memcpy(j->moves, moves, (size_t)n * sizeof(*moves));
    for (uint32_t i = 0; i < n; i++)
        j->slots[i] = kvp_tier_mem_slot(r->tier.mem, moves[i].slot);
    return j;
}

/* A copy that failed for another reason than its arguments: the pool cannot be trusted. */
static void move_failed(kvp_rpc_t *r, const char *what, int rc)
{
    if (rc == KVP_EINVAL || rc == KVP_ERANGE) {
        kvp_log(KVP_LOG_ERR, "host tier %s refused rc=%s", what, kvp_errname(rc));
        return;
    }
    r->unhealthy = 1;
    kvp_log(KVP_LOG_CRIT, "host tier %s failed in backend rc=%s", what, kvp_errname(rc));
}

/* ---- create / limits ----------------------------------------------------------------------- */

uint32_t kvp__rpc_tier_slots(const kvp_rpc_t *r, uint64_t host_bytes)
{
    const kvp_backend_t *b = r->backend;
    if (!host_bytes || !b->ops->move_slots)
        return 0;
    uint64_t n = host_bytes / kvp_backend_slot_bytes(b);
    return n > UINT32_MAX - b->geom.num_pages ? UINT32_MAX - b->geom.num_pages : (uint32_t)n;
}

int kvp__rpc_tier_create(kvp_rpc_t *r)
{
    kvp_tier_t *t = &r->tier;
    t->nslots = kvp__rpc_tier_slots(r, r->lim.cache_host_bytes);
    t->start_bytes = r->lim.cache_host_bytes;
    if (!t->nslots)
        return 0;
    t->slot_bytes = kvp_backend_slot_bytes(r->backend);
    int rc = kvp_tier_mem_create(r->backend, t->nslots, t->slot_bytes,
                                 r->lim.cache_host_chunk_bytes, -1, &t->mem);
    if (rc) {
        kvp_log(KVP_LOG_ERR, "host tier not created bytes=%llu rc=%s",
                (unsigned long long)r->lim.cache_host_bytes, kvp_errname(rc));
        return rc;
    }
    t->restore_of = calloc(r->backend->geom.num_pages, sizeof(*t->restore_of));
    if (!t->restore_of)
        return KVP_ENOMEM;
    kvp_log(KVP_LOG_INFO, "host tier slots=%u slot_bytes=%llu bytes=%llu chunk_bytes=%llu",
            t->nslots, (unsigned long long)t->slot_bytes,
            (unsigned long long)(t->slot_bytes * t->nslots),
            (unsigned long long)r->lim.cache_host_chunk_bytes);
    return 0;
}

void kvp__rpc_tier_destroy(kvp_rpc_t *r)
{
    kvp_tier_mem_destroy(r->tier.mem); /* no job runs any more */
    r->tier.mem = NULL;
    free(r->tier.restore_of);
    r->tier.restore_of = NULL;
    free(r->tier.scratch);
    r->tier.scratch = NULL;
    r->tier.cap_scratch = 0;
}

/* The host slots the cache may use now: what is pinned, within cache.host_bytes (a reload
 * lowers it; raising it above the start's is kept at the start's). */
static void update_limit(kvp_rpc_t *r)
{
    kvp_tier_t *t = &r->tier;
    uint64_t want =
        r->lim.cache_host_bytes < t->start_bytes ? r->lim.cache_host_bytes : t->start_bytes;
    uint64_t n = kvp__rpc_tier_slots(r, want);
    uint64_t ready = kvp_tier_mem_ready_slots(t->mem);
    if (n > ready)
        n = ready;
    if (n > t->nslots)
        n = t->nslots;
    if ((uint32_t)n != t->limit) {
        t->limit = (uint32_t)n;
        kvp_pcache_set_host_limit(r->pc, t->limit);
    }
    if (!t->ready_logged && kvp_tier_mem_done(t->mem)) {
        t->ready_logged = 1;
        int err = kvp_tier_mem_error(t->mem);
        kvp_log(err ? KVP_LOG_ERR : KVP_LOG_INFO, "host tier ready slots=%llu bytes=%llu%s%s",
                (unsigned long long)kvp_tier_mem_ready_slots(t->mem),
                (unsigned long long)kvp_tier_mem_ready_bytes(t->mem), err ? " error=" : "",
                err ? kvp_errname(err) : "");
    }
}

/* ---- the demoter --------------------------------------------------------------------------- */

void kvp__rpc_tier_kick(kvp_rpc_t *r, uint64_t now_ms)
{
    kvp_tier_t *t = &r->tier;
    if (!t->mem || r->unhealthy)
        return;
    update_limit(r);
    if (r->draining || (r->clock_ms && !r->jobs))
        return; /* stopping: no new demotion (without worker threads it would copy on the loop) */
    const uint32_t np = r->backend->geom.num_pages;
    const uint32_t want = (uint32_t)((uint64_t)np * r->lim.cache_demote_free_pct / 100);
    const uint32_t batch = r->lim.cache_demote_batch_pages;
    while (t->limit && t->demotions < MAX_DEMOTIONS && kvp_alloc_num_free(r->alloc) < want) {
        if (!t->scratch || t->cap_scratch < batch) {
            free(t->scratch);
            t->cap_scratch = 0;
            if (!(t->scratch = malloc((size_t)batch * sizeof(*t->scratch))))
                return;
            t->cap_scratch = batch;
        }
        uint32_t n = kvp_pcache_demote_begin(r->pc, now_ms, want, batch, t->scratch);
        if (!n)
            return; /* nothing cached, or no host slot */
        move_job_t *j = move_job(r, KVP_MOVE_OUT, t->scratch, n);
        if (!j) {
            kvp_pcache_demote_end(r->pc, t->scratch, n, 0);
            return;
        }
        t->demotions++;
        kvp__rpc_submit_bg(r, &j->base, now_ms);
    }
}

static void demote_finish(kvp_rpc_t *r, kvp_rpc_job_t *base, kvp_rpc_io_t *io, uint64_t now_ms)
{
    (void)io;
    move_job_t *j = (move_job_t *)base;
    kvp_tier_t *t = &r->tier;
    t->demotions--;
    if (base->rc)
        move_failed(r, "offload", base->rc);
    uint32_t moved = kvp_pcache_demote_end(r->pc, j->moves, j->n, base->rc == 0);
    if (!base->rc) {
        t->offload_bytes += (uint64_t)j->n * t->slot_bytes;
        t->offload_ns += j->ns;
    }
    kvp_log(KVP_LOG_DEBUG, "demoted pages=%u kept=%u us=%.1f", j->n, moved, (double)j->ns / 1e3);
    kvp__rpc_tier_kick(r, now_ms); /* more to do under the watermark */
}

/* ---- restores and the calls that wait for them --------------------------------------------- */

/* Hands the parked call j to the worker threads once it waits for nothing. */
static void unwait(kvp_rpc_t *r, kvp_rpc_job_t *j, int failed)
{
    if (failed)
        j->wait_failed = 1;
    if (--j->waits == 0 && j->parked)
        kvp__rpc_submit_parked(r, j);
}

static void restore_finish(kvp_rpc_t *r, kvp_rpc_job_t *base, kvp_rpc_io_t *io, uint64_t now_ms)
{
    (void)io, (void)now_ms;
    move_job_t *j = (move_job_t *)base;
    kvp_tier_t *t = &r->tier;
    t->restores--;
    if (base->rc)
        move_failed(r, "restore", base->rc);
    for (uint32_t i = 0; i < j->n; i++)
        if (t->restore_of[j->moves[i].page] == base)
            t->restore_of[j->moves[i].page] = NULL;
    kvp_pcache_restore_end(r->pc, j->moves, j->n, base->rc == 0);
    if (!base->rc) {
        t->restore_bytes += (uint64_t)j->n * t->slot_bytes;
        t->restore_ns += j->ns;
    }
    for (uint32_t i = 0; i < j->num_waiters; i++)
        unwait(r, j->waiters[i], base->rc != 0);
    j->num_waiters = 0;
}

/* Adds call job w to restore task task's waiters. 0 or KVP_ENOMEM. */
static int add_waiter(move_job_t *task, kvp_rpc_job_t *w)
{
    if (task->num_waiters == task->cap_waiters) {
        uint32_t cap = task->cap_waiters ? 2 * task->cap_waiters : 4;
        void *p = realloc(task->waiters, cap * sizeof(*task->waiters));
        if (!p)
            return KVP_ENOMEM;
        task->waiters = p;
        task->cap_waiters = cap;
    }
    task->waiters[task->num_waiters++] = w;
    w->waits++;
    return 0;
}

void kvp__rpc_tier_drop_restores(kvp_rpc_t *r)
{
    const kvp_plan_t *p = &r->plan;
    if (p->num_restores) /* never started: the pages lose their keys and their pins */
        kvp_pcache_restore_end(r->pc, p->restores, p->num_restores, 0);
}

int kvp__rpc_tier_restore(kvp_rpc_t *r, uint64_t now_ms)
{
    const kvp_plan_t *p = &r->plan;
    kvp_tier_t *t = &r->tier;
    if (!p->num_restores)
        return 0;
    move_job_t *j = move_job(r, KVP_MOVE_IN, p->restores, p->num_restores);
    if (!j) { /* the pages cannot be filled: they lose their keys, their holders' calls fail */
        kvp_pcache_restore_end(r->pc, p->restores, p->num_restores, 0);
        return KVP_ENOMEM;
    }
    for (uint32_t i = 0; i < j->n; i++)
        t->restore_of[j->moves[i].page] = &j->base;
    t->restores++;
    /* submitted first, so it is in flight before any call waits for it: without worker
     * threads (tests) it runs inline here and nobody waits */
    kvp__rpc_submit_bg(r, &j->base, now_ms);
    return 0;
}

int kvp__rpc_tier_wait_plan(kvp_rpc_t *r, kvp_rpc_job_t *w)
{
    const kvp_plan_t *p = &r->plan;
    kvp_tier_t *t = &r->tier;
    if (!t->mem || !r->plan_reused)
        return 0;
    const uint32_t ps = r->backend->geom.page_size;
    int rc = 0;
    t->mark++; /* one mark over the whole batch: a task is waited for once */
    const uint64_t mark = t->mark;
    for (uint32_t b = 0; b < p->batch_size && !rc; b++) {
        const uint32_t linked = p->cached_tokens[b] / ps;
        const int32_t *pg = p->kv_indices + p->kv_indptr[b];
        for (uint32_t k = 0; k < linked && !rc; k++) {
            move_job_t *task = (move_job_t *)t->restore_of[pg[k]];
            if (!task || task->mark == mark)
                continue;
            task->mark = mark;
            rc = add_waiter(task, w);
        }
    }
    return rc;
}

/* ---- what Lookup and Stats read ------------------------------------------------------------ */

void kvp__rpc_tier_stats(kvp_rpc_t *r, kvpool_CacheStats *out)
{
    const kvp_tier_t *t = &r->tier;
    if (!t->mem)
        return;
    update_limit(r); /* what is pinned now, not at the last tick */
    kvp_pcache_stats_t st;
    kvp_pcache_stats(r->pc, &st);
    out->host_pages = st.host_pages;
    out->host_slots = t->limit;
    out->host_bytes_total = t->slot_bytes * t->nslots;
    out->host_bytes_ready = kvp_tier_mem_ready_bytes(t->mem);
    out->host_hit_tokens_total = st.host_hit_tokens;
    out->demotions_total = st.demotions;
    out->promotions_total = st.promotions;
    out->host_evictions_total = st.host_evictions;
    out->offload_bytes_total = t->offload_bytes;
    out->restore_bytes_total = t->restore_bytes;
    out->offload_us_total = t->offload_ns / 1000;
    out->restore_us_total = t->restore_ns / 1000;
    out->demoting = st.demoting;
    out->restoring = st.restoring;
    out->host_slot_bytes = (uint32_t)t->slot_bytes;
}

int kvp__rpc_tier_audit(const kvp_rpc_t *r, char *msg, size_t len)
{
    const kvp_tier_t *t = &r->tier;
    if (!t->mem)
        return 0;
    uint32_t restoring = 0;
    for (uint32_t p = 0; p < r->backend->geom.num_pages; p++) {
        const int in_task = t->restore_of[p] != NULL;
        if (in_task != kvp_pcache_restoring(r->pc, p)) {
            snprintf(msg, len, "host tier: page %u is %srestoring in the cache but %sin a restore",
                     p, in_task ? "not " : "", in_task ? "" : "not ");
            return KVP_EAUDIT;
        }
        restoring += (uint32_t)in_task;
    }
    kvp_pcache_stats_t st;
    kvp_pcache_stats(r->pc, &st);
    if (st.restoring != restoring || (t->demotions == 0 && st.demoting != 0) ||
        (t->restores == 0 && restoring != 0)) {
        snprintf(msg, len,
                 "host tier: %u pages restoring in the cache, %u in restores (%u tasks); %u "
                 "demoting in the cache, %u batches in flight",
                 st.restoring, restoring, t->restores, st.demoting, t->demotions);
        return KVP_EAUDIT;
    }
    if (st.host_slots_usable != t->limit) {
        snprintf(msg, len, "host tier: the cache uses %u slots, the tier gives %u",
                 st.host_slots_usable, t->limit);
        return KVP_EAUDIT;
    }
    return 0;
}
