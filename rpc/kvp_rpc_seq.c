/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc_seq.c - the sequence calls: Reserve, Append and its off-loop job, Fork, Truncate,
 * Release, GetPageTable (see kvp_rpc_internal.h).
 */
#include "kvp_rpc_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_log.h"

/* Plans r->items[0..n) with the request's cache fields when it has token ids (content 1 from
 * kvp__rpc_take_content), else exactly as before. */
static int plan(kvp_rpc_t *r, uint32_t n, int content, const kvp_plan_cache_t *cache,
                uint64_t now_ms)
{
    r->plan_reused = content && cache->reuse;
    if (!content)
        return kvp_plan_append(r->seqs, r->items, n, &r->plan_limits, now_ms, &r->plan);
    return kvp_plan_append_cached(r->seqs, r->items, r->content, n, &r->plan_limits, cache, now_ms,
                                  &r->plan);
}

/* ---- a Reserve that waits for restores (issue #28) ---------------------------------------- */

/* ---- a job's page table -------------------------------------------------------------------- */

/* A job's copy of the plan's page table (the planner's arrays serve the next call), answered
 * when the job finishes: an Append's and a waiting Reserve's. */
typedef struct {
    uint32_t batch_size, nnz, num_indices, num_copies;
    int32_t *kv_indptr, *append_indptr, *kv_last_page_len, *seq_lens, *cached_tokens, *kv_indices;
    int32_t *copies; /* pairs (src, dst) */
    int reused;      /* cached_tokens answers (CacheOptions.reuse); 0s without */
} job_table_t;

/* int32 words the copy of p's table takes. */
static size_t table_words(const kvp_plan_t *p)
{
    const uint32_t B = p->batch_size;
    return (size_t)(B + 1) * 2 + (size_t)B * 3 + (uint32_t)p->kv_indptr[B] +
           (size_t)p->num_copies * 2;
}

/* Lays t's arrays over w (table_words(p) words), copies p's table into them and returns the
 * word after them. */
static int32_t *table_copy(job_table_t *t, const kvp_plan_t *p, int reused, int32_t *w)
{
    const uint32_t B = p->batch_size, I = (uint32_t)p->kv_indptr[B], C = p->num_copies;
    t->batch_size = B, t->nnz = p->nnz, t->num_indices = I, t->num_copies = C;
    t->reused = reused;
    t->kv_indptr = w, w += B + 1;
    t->append_indptr = w, w += B + 1;
    t->kv_last_page_len = w, w += B;
    t->seq_lens = w, w += B;
    t->cached_tokens = w, w += B;
    t->kv_indices = w, w += I;
    t->copies = w, w += 2 * C;
    memcpy(t->kv_indptr, p->kv_indptr, (B + 1) * 4);
    memcpy(t->append_indptr, p->append_indptr, (B + 1) * 4);
    memcpy(t->kv_last_page_len, p->kv_last_page_len, B * 4);
    memcpy(t->seq_lens, p->seq_lens, B * 4);
    if (reused)
        memcpy(t->cached_tokens, p->cached_tokens, B * 4);
    else
        memset(t->cached_tokens, 0, B * 4);
    if (I)
        memcpy(t->kv_indices, p->kv_indices, (size_t)I * 4);
    if (C)
        memcpy(t->copies, p->copies, (size_t)C * 8);
    return w;
}

/* The table as an answer's PageTable, its arrays bound in io->out. */
static void table_answer(kvp_rpc_io_t *io, kvpool_PageTable *out, const job_table_t *t)
{
    const uint32_t B = t->batch_size;
    out->batch_size = B;
    out->nnz = t->nnz;
    io->out.kv_indptr = kvp_array(t->kv_indptr, 4, B + 1, 0);
    io->out.kv_indices = kvp_array(t->kv_indices, 4, t->num_indices, 0);
    io->out.kv_last_page_len = kvp_array(t->kv_last_page_len, 4, B, 0);
    io->out.append_indptr = kvp_array(t->append_indptr, 4, B + 1, 0);
    io->out.seq_lens = kvp_array(t->seq_lens, 4, B, 0);
    io->out.copies = kvp_array(t->copies, 4, 2 * t->num_copies, 0);
    io->out.cached_tokens = kvp_array(t->cached_tokens, 4, t->reused ? B : 0, 0);
    kvp_wire_table_bind_encode(out, &io->out);
}

/* Gives back what a plan added to its sequences (tokens appended and linked): the call failed.
 * seq_ids NULL: the batch still in r->items. */
static void roll_back(kvp_rpc_t *r, uint32_t ns, const uint64_t *seq_ids, const job_table_t *t,
                      uint64_t now_ms)
{
    for (uint32_t b = 0; b < t->batch_size; b++) {
        uint32_t add = (uint32_t)(t->append_indptr[b + 1] - t->append_indptr[b]) +
                       (uint32_t)t->cached_tokens[b];
        kvp_seqtab_truncate(r->seqs, ns, seq_ids ? seq_ids[b] : r->items[b].seq_id,
                            (uint32_t)t->seq_lens[b] - add, now_ms);
    }
}

/* The answer of a Reserve whose plan links pages restored from the host tier (or of an Append
 * with reuse that found every token cached): a copy of the plan's table (the planner's arrays
 * serve the next call), answered once the restores ended. Its run does nothing: it is parked
 * until then (kvp_rpc_tier.c). */
typedef struct {
    kvp_rpc_job_t base;
    job_table_t tab;
    uint32_t ns;
    uint64_t *seq_ids;
} reserve_job_t;

static void reserve_run(kvp_rpc_job_t *base)
{
    base->rc = 0;
}

static void reserve_finish(kvp_rpc_t *r, kvp_rpc_job_t *base, kvp_rpc_io_t *io, uint64_t now_ms)
{
    reserve_job_t *j = (reserve_job_t *)base;
    if (base->wait_failed) {
        roll_back(r, j->ns, j->seq_ids, &j->tab, now_ms);
        kvp_rpc_error(&io->resp, base->req_id, r->unhealthy ? KVP_EINTERNAL : KVP_EUNAVAIL,
                      "reserve not applied: restoring its cached prefix from host memory failed");
        return;
    }
    kvp__rpc_ok(io, base->req_id);
    if (io->call->req_tag == kvpool_Request_append_tag) { /* everything was linked */
        io->resp.body.append.completed = true;
        io->resp.body.append.has_table = true;
        table_answer(io, &io->resp.body.append.table, &j->tab);
    } else {
        io->resp.body.reserve.has_table = true;
        table_answer(io, &io->resp.body.reserve.table, &j->tab);
    }
}

static void reserve_free(kvp_rpc_job_t *base)
{
    free(base);
}

static const kvp_rpc_job_ops_t reserve_ops = {
    .name = "reserve", .run = reserve_run, .finish = reserve_finish, .free = reserve_free};

/* The Reserve just planned (with reuse) waits for the restores of the pages it links: its
 * answer is a parked job. Without any, it answers now. */
static int table_wait(kvp_rpc_t *r, kvp_session_t *s, kvp_rpc_io_t *io, uint64_t id, uint32_t n,
                      uint64_t now_ms)
{
    const kvp_plan_t *p = &r->plan;
    const uint32_t B = p->batch_size;
    int rc = kvp__rpc_tier_restore(r, now_ms);
    reserve_job_t *j = NULL;
    if (!rc) {
        j = calloc(1, sizeof(*j) + (size_t)B * 8 + table_words(p) * 4 + 8);
        rc = j ? 0 : KVP_ENOMEM;
    }
    if (!rc) {
        j->base.ops = &reserve_ops;
        j->base.rpc = r;
        j->base.call = io->call;
        j->base.req_id = id;
        j->seq_ids = (uint64_t *)(j + 1);
        table_copy(&j->tab, p, 1, (int32_t *)(j->seq_ids + B));
        for (uint32_t b = 0; b < B; b++)
            j->seq_ids[b] = r->items[b].seq_id;
        j->ns = s->ns;
        rc = kvp__rpc_tier_wait_plan(r, &j->base);
        if (rc && j->base.waits) /* listed by some restores: answered (refused) when they end */
            j->base.wait_failed = 1, rc = 0;
    }
    if (rc || !j->base.waits) {
        if (rc) {
            const job_table_t plan = {.batch_size = n,
                                      .append_indptr = p->append_indptr,
                                      .seq_lens = p->seq_lens,
                                      .cached_tokens = (int32_t *)p->cached_tokens};
            roll_back(r, s->ns, NULL, &plan, now_ms);
            kvp_rpc_error(&io->resp, id, rc, "out of memory for the reserve's restore");
        } else if (io->call->req_tag == kvpool_Request_append_tag) { /* nothing to wait for */
            kvp__rpc_ok(io, id);
            io->resp.body.append.completed = true;
            io->resp.body.append.has_table = true;
            kvp__rpc_table_from_plan(r, &io->resp.body.append.table, &io->out);
        } else {
            kvp__rpc_ok(io, id);
            io->resp.body.reserve.has_table = true;
            kvp__rpc_table_from_plan(r, &io->resp.body.reserve.table, &io->out);
        }
        free(j);
        return KVP_RPC_DONE;
    }
    io->job = &j->base;
    return KVP_RPC_ASYNC;
}

/* ---- the calls -------------------------------------------------------------------------- */
int kvp__rpc_reserve(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                     uint64_t now_ms)
{
    const uint64_t id = req->id;
    const kvpool_ReserveRequest *q = &req->body.reserve;
    uint32_t n;
    if (kvp__rpc_take_batch(r, s, io, 1, &n, &io->resp, id))
        return 0;
    kvp_plan_cache_t cache;
    int content =
        kvp__rpc_take_content(r, s, io, n, q->has_cache, &q->cache, &cache, &io->resp, id);
    if (content < 0)
        return 0;
    int rc = plan(r, n, content, &cache, now_ms);
    if (rc) {
        kvp__rpc_count_alloc_failure(r, rc);
        kvp_rpc_error(&io->resp, id, rc, "%s (batch item %u)", kvp__rpc_plan_error_text(rc),
                      r->plan.fail_index);
        return 0;
    }
    r->counters.pages_allocated_total += r->plan.num_new_pages;
    r->counters.cow_copies_total += r->plan.num_copies;
    kvp__rpc_tier_kick(r, now_ms);     /* the watermark, after what this plan took */
    if (r->tier.mem && r->plan_reused) /* host pages it promoted, or pages others restore */
        return table_wait(r, s, io, id, n, now_ms);
    kvp__rpc_ok(io, id);
    io->resp.body.reserve.has_table = true;
    kvp__rpc_table_from_plan(r, &io->resp.body.reserve.table, &io->out);
    return 0;
}

/* Checks the source ranges of an append against the buffer: every byte any layer, token and
 * head reads lies inside it, offsets and strides are multiples of the element size. All in
 * unsigned 64-bit with overflow checks, before anything runs. A stride larger than the buffer
 * is refused whatever nnz, the layer range or the head count is: (nnz - 1) * stride is 0 for one
 * token, but the copy still turns every stride into a signed byte step (kvp_kernels.h). */
int kvp__rpc_check_layout(const kvp_rpc_t *r, const kvp_src_layout_t *src, const kvp_buffer_t *buf,
                          uint32_t nnz, uint32_t lb, uint32_t le, char *why, size_t why_len)
{
    const kvp_geom_derived_t *d = &r->backend->derived;
    /* offsets and strides: whole elements, and what the backend's copy needs on top */
    uint64_t e =
        d->elem_bytes > r->backend->src_align_bytes ? d->elem_bytes : r->backend->src_align_bytes;
    const uint64_t *vals = kvp_src_layout_words(src);
    for (unsigned i = 0; i < KVP_SRC_LAYOUT_WORDS; i++)
        if (vals[i] % e) {
            snprintf(why, why_len, "source offsets and strides must be multiples of %llu bytes",
                     (unsigned long long)e);
            return KVP_EINVAL;
        }
    static const char *const names[KVP_SRC_LAYOUT_WORDS] = {
        "k_offset",   "v_offset",   "k_stride_n",  "k_stride_h",
        "v_stride_n", "v_stride_h", "layer_stride"};
    _Static_assert(offsetof(kvp_src_layout_t, v_offset) == 1 * sizeof(uint64_t) &&
                       offsetof(kvp_src_layout_t, k_stride_n) == 2 * sizeof(uint64_t) &&
                       offsetof(kvp_src_layout_t, v_stride_n) == 4 * sizeof(uint64_t) &&
                       offsetof(kvp_src_layout_t, layer_stride) == 6 * sizeof(uint64_t),
                   "names[] follows kvp_src_layout_t's field order");
    for (unsigned i = 0; i < KVP_SRC_LAYOUT_WORDS; i++)
        if (vals[i] > buf->size_bytes) {
            snprintf(why, why_len, "source %s %llu exceeds buffer of %llu bytes", names[i],
                     (unsigned long long)vals[i], (unsigned long long)buf->size_bytes);
            return KVP_ERANGE;
        }
    if (nnz == 0)
        return 0;
    uint64_t H = d->heads;
    for (int kv = 0; kv < 2; kv++) {
        uint64_t off = kv ? src->v_offset : src->k_offset;
        uint64_t sn = kv ? src->v_stride_n : src->k_stride_n;
        uint64_t sh = kv ? src->v_stride_h : src->k_stride_h;
        uint64_t a, b, c, end;
        if (__builtin_mul_overflow((uint64_t)(le - lb - 1), src->layer_stride, &a) ||
            __builtin_mul_overflow((uint64_t)(nnz - 1), sn, &b) ||
            __builtin_mul_overflow(H - 1, sh, &c) || __builtin_add_overflow(off, a, &end) ||
            __builtin_add_overflow(end, b, &end) || __builtin_add_overflow(end, c, &end) ||
            __builtin_add_overflow(end, d->row_bytes, &end) || end > buf->size_bytes) {
            snprintf(why, why_len, "%s source range exceeds buffer of %llu bytes", kv ? "V" : "K",
                     (unsigned long long)buf->size_bytes);
            return KVP_ERANGE;
        }
    }
    return 0;
}

/* An Append's job: a copy of the plan (the planner's arrays serve the next call), the pages
 * it reads or writes (pinned until it finished), the buffers it reads (held), and what it
 * publishes to the prefix cache once the copy is done. */
typedef struct {
    kvp_rpc_job_t base;
    kvp_exec_t exec;
    job_table_t tab;        /* cached_tokens: linked from the prefix cache (0s without reuse) */
    kvp_pcache_ref_t *refs; /* the pages it fills, published once the copy completed */
    uint32_t num_refs;
    int32_t *slots; /* [nnz]: each token's pool slot (kvp_plan_slots), the append's destination */
    uint32_t *pinned;
    uint32_t num_pinned;
    uint64_t bytes;
    uint32_t ns;       /* for a rollback when the backend refuses the source */
    uint64_t *seq_ids; /* [batch_size] */
    /* tensor-parallel form: each rank's buffer, copied by value (another session may move or
     * drop its entry while the job runs; the hold keeps the backend state alive) */
    kvp_buffer_t rank_buf[KVP_GEOM_MAX_DEVICES];
    const kvp_buffer_t *rank_ptr[KVP_GEOM_MAX_DEVICES];
    uint32_t num_ranks;
} append_job_t;

static void append_run(kvp_rpc_job_t *base);
static void append_finish(kvp_rpc_t *r, kvp_rpc_job_t *base, kvp_rpc_io_t *io, uint64_t now_ms);

static void append_free(kvp_rpc_job_t *base)
{
    append_job_t *j = (append_job_t *)base;
    free(j->refs);
    free(j->tab.kv_indptr);
    free(j->pinned);
    free(j->seq_ids);
    free(j);
}

static const kvp_rpc_job_ops_t append_ops = {
    .name = "append", .run = append_run, .finish = append_finish, .free = append_free};

/* Copies the plan into a job (the planner's arrays are reused by the next call) and pins
 * every page the job reads or writes. */
static append_job_t *make_job(kvp_rpc_t *r, const kvp_rpc_call_t *call, const kvp_buffer_t *buf,
                              const kvp_buffer_t *const *ranks, uint32_t num_ranks,
                              const kvp_src_layout_t *src, uint32_t lb, uint32_t le, uint64_t id,
                              uint32_t sync)
{
    const kvp_plan_t *p = &r->plan;
    uint32_t B = p->batch_size, I = (uint32_t)p->kv_indptr[B], C = p->num_copies, N = p->nnz;
    append_job_t *j = calloc(1, sizeof(*j));
    if (!j)
        return NULL;
    j->base.ops = &append_ops;
    int32_t *w = malloc((table_words(p) + N) * sizeof(int32_t) + 4);
    j->pinned = malloc(((size_t)I + 2 * C + 1) * sizeof(uint32_t));
    j->seq_ids = malloc(((size_t)B + 1) * sizeof(uint64_t));
    if (!w || !j->pinned || !j->seq_ids) {
        free(w);
        free(j->pinned);
        free(j->seq_ids);
        free(j);
        return NULL;
    }
    for (uint32_t g = 0; g < num_ranks; g++) {
        if (kvp__rpc_buf_hold(r, ranks[g])) {
            while (g-- > 0)
                kvp__rpc_buf_unhold(r, &j->rank_buf[g]);
            free(w);
            free(j->pinned);
            free(j->seq_ids);
            free(j);
            return NULL;
        }
        j->rank_buf[g] = *ranks[g];
        j->rank_ptr[g] = &j->rank_buf[g];
    }
    j->num_ranks = num_ranks;
    for (uint32_t b = 0; b < B; b++)
        j->seq_ids[b] = r->items[b].seq_id;
    j->ns = B ? r->items[0].ns : 0;
    j->slots = table_copy(&j->tab, p, r->plan_reused, w); /* the table first: w is its base */
    if (N) /* where every token goes, once: the kernels read these slots as they are */
        kvp_plan_slots(p, r->backend->geom.page_size, j->slots);
    j->base.rpc = r;
    j->base.call = call;
    j->base.req_id = id;
    /* pin: copy sources and destinations, and the pages that receive tokens */
    const kvp_page_copy_t *copies = (const kvp_page_copy_t *)j->tab.copies;
    for (uint32_t c = 0; c < C; c++) {
        kvp_alloc_pin(r->alloc, copies[c].src);
        j->pinned[j->num_pinned++] = copies[c].src;
        kvp_alloc_pin(r->alloc, copies[c].dst);
        j->pinned[j->num_pinned++] = copies[c].dst;
    }
    const uint32_t ps = r->backend->geom.page_size;
    for (uint32_t b = 0; b < B; b++) {
        uint32_t add = (uint32_t)(j->tab.append_indptr[b + 1] - j->tab.append_indptr[b]);
        if (!add)
            continue;
        uint32_t first = (uint32_t)(j->tab.seq_lens[b] - (int32_t)add) / ps;
        for (int32_t k = j->tab.kv_indptr[b] + (int32_t)first; k < j->tab.kv_indptr[b + 1]; k++) {
            kvp_alloc_pin(r->alloc, (uint32_t)j->tab.kv_indices[k]);
            j->pinned[j->num_pinned++] = (uint32_t)j->tab.kv_indices[k];
        }
    }
    kvp_exec_t *e = &j->exec;
    e->dest = (kvp_append_dest_t){.kind = KVP_APPEND_DEST_SLOTS, .nnz = N, .slots = j->slots};
    e->copies = copies;
    e->num_copies = C;
    e->src = num_ranks ? NULL : buf;
    e->rank_src = num_ranks ? j->rank_ptr : NULL;
    e->num_rank_src = num_ranks;
    e->layout = *src;
    e->layer_begin = lb;
    e->layer_end = le;
    e->sync = sync;
    j->bytes = (uint64_t)N * 2 * r->backend->derived.heads * r->backend->derived.row_bytes *
               (le - lb) * (num_ranks ? num_ranks : 1);
    return j;
}

/* Resolves a tensor-parallel Append's rank_sources (kvpool.proto, AppendRequest): one buffer
 * per device of the group, in device order, each registered for its device by a session of
 * the caller's namespace. Returns 0 with ranks[0..G) set, or a code with the reason in why. */
static int take_rank_sources(kvp_rpc_t *r, kvp_session_t *s, const kvpool_AppendRequest *q,
                             const kvp_buffer_t **ranks, uint32_t *num_out, char *why,
                             size_t why_len)
{
    const uint32_t G = r->backend->geom.num_devices ? r->backend->geom.num_devices : 1;
    if (q->rank_sources_count != G) {
        snprintf(why, why_len, "rank_sources has %u entries; the pool's group has %u devices",
                 (unsigned)q->rank_sources_count, G);
        return KVP_EINVAL;
    }
    if (q->source.buffer_id != 0) {
        snprintf(why, why_len, "with rank_sources, source.buffer_id must be 0 (got %u)",
                 q->source.buffer_id);
        return KVP_EINVAL;
    }
    for (uint32_t g = 0; g < G; g++) {
        const kvpool_RankSource *rs = &q->rank_sources[g];
        kvp_session_t *owner = NULL;
        if (rs->session_id == 0 || rs->session_id == s->id)
            owner = s;
        for (kvp_session_t *o = r->sessions; o && !owner; o = o->next)
            if (o->id == rs->session_id && o->hello_done && o->ns == s->ns)
                owner = o;
        if (!owner) {
            snprintf(why, why_len, "rank %u: no session %llu in this namespace", g,
                     (unsigned long long)rs->session_id);
            return KVP_ENOENT;
        }
        kvp_session_buffer_t *b = kvp__rpc_find_buffer(owner, rs->buffer_id);
        if (!b) {
            snprintf(why, why_len, "rank %u: session %llu has no buffer %u", g,
                     (unsigned long long)owner->id, rs->buffer_id);
            return KVP_ENOENT;
        }
        if (b->buf.device_index != g) {
            snprintf(why, why_len,
                     "rank %u: buffer %u of session %llu was registered for device index %u, "
                     "not %u",
                     g, rs->buffer_id, (unsigned long long)owner->id, b->buf.device_index, g);
            return KVP_EINVAL;
        }
        ranks[g] = &b->buf;
    }
    *num_out = G;
    return 0;
}

/* The pages the plan's items fill (kvp_pcache_take_written) as refs the caller frees: exactly
 * what this Append writes, so that neither a Reserve on the same sequence nor a new sequence
 * under a released id while the copy runs gets published by it (issue #26 defect 2). Out of
 * memory, none: the pages stay private, which is always safe. */
static kvp_pcache_ref_t *take_written(kvp_rpc_t *r, uint32_t n, uint32_t *num)
{
    const kvp_plan_t *p = &r->plan;
    uint64_t total = 0;
    *num = 0;
    for (uint32_t i = 0; i < n; i++)
        if (p->publish_from[i] < p->seqs[i]->num_pages)
            total += p->seqs[i]->num_pages - p->publish_from[i];
    kvp_pcache_ref_t *refs = total ? malloc(total * sizeof(*refs)) : NULL;
    if (!refs) {
        if (total)
            kvp_log(KVP_LOG_WARNING, "append pages left private pages=%llu reason=\"no memory\"",
                    (unsigned long long)total);
        return NULL;
    }
    for (uint32_t i = 0; i < n; i++)
        *num += kvp_pcache_take_written(r->pc, p->seqs[i], p->publish_from[i], refs + *num,
                                        (uint32_t)(total - *num));
    return refs;
}

int kvp__rpc_append(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                    uint64_t now_ms)
{
    const uint64_t id = req->id;
    const kvpool_AppendRequest *q = &req->body.append;
    kvpool_Response *resp = &io->resp;
    if (!q->has_source) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "append needs a source");
        return KVP_RPC_DONE;
    }
    const kvpool_Source *src = &q->source;
    kvp_src_layout_t layout;
    kvp_wire_source_layout(src, &layout);
    kvp_session_buffer_t *sb = NULL;
    if (!q->rank_sources_count && !(sb = kvp__rpc_find_buffer(s, src->buffer_id))) {
        kvp_rpc_error(resp, id, KVP_ENOENT, "no buffer %u registered on this connection",
                      src->buffer_id);
        return KVP_RPC_DONE;
    }
    if (q->sync != kvpool_SyncMode_SYNC_NONE &&
        r->backend->kind == kvpool_BackendKind_BACKEND_HOST) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "sync mode %d needs the cuda backend", (int)q->sync);
        return KVP_RPC_DONE;
    }
    uint32_t L = r->backend->geom.num_layers;
    uint32_t lb = src->layer_begin, le = src->layer_end ? src->layer_end : L;
    if (lb >= le || le > L) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "layer range [%u, %u) outside [0, %u)", lb, le, L);
        return KVP_RPC_DONE;
    }
    uint32_t n;
    if (kvp__rpc_take_batch(r, s, io, 1, &n, resp, id))
        return KVP_RPC_DONE;
    uint64_t nnz = 0;
    for (uint32_t i = 0; i < n; i++)
        nnz += r->items[i].num_tokens;
    if (nnz == 0) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "nothing to append: every num_tokens is 0");
        return KVP_RPC_DONE;
    }
    kvp_plan_cache_t cache;
    int content, reuse;
    content = kvp__rpc_take_content(r, s, io, n, q->has_cache, &q->cache, &cache, resp, id);
    if (content < 0)
        return KVP_RPC_DONE;
    cache.daemon_writes = 1;
    reuse = content && cache.reuse;
    if ((reuse && n != 1) || (!reuse && q->skip_tokens)) {
        kvp_rpc_error(resp, id, KVP_EINVAL,
                      reuse ? "an Append with cache.reuse takes one sequence (Reserve takes "
                              "batches)"
                            : "skip_tokens needs cache.reuse");
        return KVP_RPC_DONE;
    }
    const uint32_t ps = r->backend->geom.page_size;
    int seq_was_new = 0;
    if (reuse) {
        /* the prefix the source does not hold must be found whole, or nothing changes */
        const kvp_seq_t *cur = kvp_seqtab_find(r->seqs, s->ns, r->items[0].seq_id);
        seq_was_new = cur == NULL;
        kvp_pagekey_t root;
        kvp_pagekey_root(r->content[0].salt, r->content[0].salt_len, &root);
        uint32_t gpu_pages; /* with a host tier, what it holds is restored: found too */
        uint32_t found =
            cur && cur->num_tokens
                ? 0
                : kvp_pcache_lookup_tiers(r->pc, cache.scope, root, r->content[0].token_ids,
                                          r->items[0].num_tokens - (cache.leave_last ? 1 : 0), 0,
                                          &gpu_pages) *
                      ps;
        if (!cache.promote)
            found = gpu_pages * ps;
        if (q->skip_tokens % ps || q->skip_tokens > r->items[0].num_tokens) {
            kvp_rpc_error(resp, id, KVP_EINVAL,
                          "skip_tokens %u: a multiple of page_size %u, at most num_tokens",
                          q->skip_tokens, ps);
            return KVP_RPC_DONE;
        }
        if (found < q->skip_tokens) {
            kvp_rpc_error(resp, id, KVP_EPRECOND,
                          "only %u of the %u tokens skip_tokens names are cached now (evicted "
                          "since the Lookup?): send their rows",
                          found, q->skip_tokens);
            return KVP_RPC_DONE;
        }
    }
    /* with reuse the source holds the rows of tokens [skip_tokens, num_tokens) only */
    const uint64_t rows = nnz - (reuse ? q->skip_tokens : 0);
    char why[160];
    const kvp_buffer_t *ranks[KVP_GEOM_MAX_DEVICES];
    uint32_t num_ranks = 0;
    int rc = nnz > 0x7fffffffu ? KVP_ELIMIT : 0;
    if (!rc && q->rank_sources_count)
        rc = take_rank_sources(r, s, q, ranks, &num_ranks, why, sizeof(why));
    for (uint32_t g = 0; g < num_ranks && !rc; g++)
        rc = kvp__rpc_check_layout(r, &layout, ranks[g], (uint32_t)rows, lb, le, why, sizeof(why));
    if (!rc && !num_ranks)
        rc = kvp__rpc_check_layout(r, &layout, &sb->buf, (uint32_t)rows, lb, le, why, sizeof(why));
    if (rc) {
        kvp_rpc_error(resp, id, rc, "%s", rc == KVP_ELIMIT ? "too many tokens" : why);
        return KVP_RPC_DONE;
    }
    rc = plan(r, n, content, &cache, now_ms);
    if (rc) {
        kvp__rpc_count_alloc_failure(r, rc);
        kvp_rpc_error(resp, id, rc, "%s (batch item %u)", kvp__rpc_plan_error_text(rc),
                      r->plan.fail_index);
        return KVP_RPC_DONE;
    }
    if (reuse && r->plan.cached_tokens[0] < q->skip_tokens) {
        /* the planner linked less than the lookup above found (a found page it could not link):
         * the source lacks rows the append needs, and its offsets would start before the
         * buffer (fuzz_rpc found it). Undo the plan: the sequence as it was. */
        const uint32_t linked = (uint32_t)r->plan.cached_tokens[0];
        kvp__rpc_tier_drop_restores(r);
        if (seq_was_new)
            kvp_seqtab_release(r->seqs, s->ns, r->items[0].seq_id);
        else
            kvp_seqtab_truncate(r->seqs, s->ns, r->items[0].seq_id, 0, now_ms);
        kvp_rpc_error(resp, id, KVP_EPRECOND,
                      "only %u of the %u tokens skip_tokens names could be linked now: send "
                      "their rows",
                      linked, q->skip_tokens);
        return KVP_RPC_DONE;
    }
    r->counters.pages_allocated_total += r->plan.num_new_pages;
    kvp__rpc_tier_kick(r, now_ms);
    if (reuse && r->plan.nnz == 0 && r->tier.mem) /* all linked; some may still be restoring */
        return table_wait(r, s, io, id, n, now_ms);
    /* all of it was cached and linked: nothing to copy or publish (linked pages are findable) */
    if (reuse && r->plan.nnz == 0) {
        kvp__rpc_ok(io, id);
        io->resp.body.append.completed = true;
        io->resp.body.append.has_table = true;
        kvp__rpc_table_from_plan(r, &io->resp.body.append.table, &io->out);
        return KVP_RPC_DONE;
    }
    if (reuse) { /* the source's rows start at skip_tokens: skip those of the rest it linked */
        uint64_t skip = (uint64_t)r->plan.cached_tokens[0] - q->skip_tokens;
        layout.k_offset += skip * layout.k_stride_n;
        layout.v_offset += skip * layout.v_stride_n;
    }
    r->counters.cow_copies_total += r->plan.num_copies;
    append_job_t *j = make_job(r, io->call, sb ? &sb->buf : NULL, ranks, num_ranks, &layout, lb, le,
                               id, (uint32_t)q->sync);
    if (j && content && lb == 0 && le == L) /* every layer written: findable once done */
        j->refs = take_written(r, n, &j->num_refs);
    if (!j) {
        /* the plan is committed but cannot be executed: give the pages back by rolling the
         * sequences back to their previous lengths */
        kvp__rpc_tier_drop_restores(r);
        for (uint32_t i = 0; i < n; i++)
            kvp_seqtab_truncate(r->seqs, s->ns, r->items[i].seq_id,
                                (uint32_t)r->plan.seq_lens[i] - r->items[i].num_tokens, now_ms);
        kvp_rpc_error(resp, id, KVP_ENOMEM, "out of memory for the append job");
        return KVP_RPC_DONE;
    }
    if (reuse && r->tier.mem) { /* the promoted prefix: restored before the answer */
        rc = kvp__rpc_tier_restore(r, now_ms);
        if (!rc)
            rc = kvp__rpc_tier_wait_plan(r, &j->base);
        if (rc) /* out of memory: refused once the restores it waits for (if any) end */
            j->base.wait_failed = 1;
    }
    io->job = &j->base;
    return KVP_RPC_ASYNC;
}

/* Worker thread: the copies and the append on the backend. */
static void append_run(kvp_rpc_job_t *base)
{
    append_job_t *j = (append_job_t *)base;
    kvp_backend_t *b = base->rpc->backend;
    base->rc = b->ops->run(b, &j->exec);
}

static void append_finish(kvp_rpc_t *r, kvp_rpc_job_t *base, kvp_rpc_io_t *io, uint64_t now_ms)
{
    append_job_t *j = (append_job_t *)base;
    for (uint32_t i = 0; i < j->num_pinned; i++)
        kvp_alloc_unpin(r->alloc, j->pinned[i]);
    j->num_pinned = 0;
    for (uint32_t g = 0; g < j->num_ranks; g++)
        kvp__rpc_buf_unhold(r, &j->rank_buf[g]);
    j->num_ranks = 0;
    if (base->wait_failed && !base->rc) /* its copy ran, the restore of its prefix did not */
        base->rc = KVP_EUNAVAIL;
    if (base->rc == KVP_ETIMEDOUT || base->rc == KVP_EINVAL || base->rc == KVP_EUNAVAIL) {
        /* the backend refused or could not wait for the source (a dead worker's event, an
         * unreadable buffer) and appended nothing: give the tokens back, stay healthy */
        roll_back(r, j->ns, j->seq_ids, &j->tab, now_ms);
        kvp_rpc_error(&io->resp, base->req_id, base->rc == KVP_EINVAL ? KVP_EINVAL : KVP_EUNAVAIL,
                      "append not applied: %s",
                      base->rc == KVP_ETIMEDOUT  ? "the worker's ready event never completed"
                      : base->rc == KVP_EUNAVAIL ? "restoring its cached prefix from host memory "
                                                   "failed"
                                                 : "the backend cannot read the source");
        return;
    }
    if (base->rc) {
        /* a validated plan failed in the backend: the pool can no longer be trusted */
        r->unhealthy = 1;
        kvp_log(KVP_LOG_CRIT, "append failed in backend rc=%s", kvp_errname(base->rc));
        kvp_rpc_error(&io->resp, base->req_id, KVP_EINTERNAL, "append failed in the backend: %s",
                      kvp_strerror(base->rc));
        return;
    }
    r->counters.append_bytes_total += j->bytes;
    kvp_pcache_publish(r->pc, j->refs, j->num_refs); /* exactly the pages it wrote */
    kvp__rpc_ok(io, base->req_id);
    kvpool_AppendResponse *ar = &io->resp.body.append;
    ar->completed = true; /* run() returns once the copy is done (kvp_backend.h) */
    ar->has_table = true;
    table_answer(io, &ar->table, &j->tab);
}

int kvp__rpc_fork(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                  uint64_t now_ms)
{
    const uint64_t id = req->id;
    const kvpool_ForkRequest *q = &req->body.fork;
    int rc = kvp_seqtab_fork(r->seqs, s->ns, q->parent, q->child, now_ms);
    if (rc) {
        kvp_rpc_error(&io->resp, id, rc,
                      rc == KVP_ENOENT   ? "no sequence %llu"
                      : rc == KVP_EEXIST ? "sequence %llu already exists"
                                         : "cannot fork %llu: limit or quota",
                      (unsigned long long)(rc == KVP_EEXIST ? q->child : q->parent));
        return 0;
    }
    kvp__rpc_ok(io, id);
    io->resp.body.fork.num_tokens = kvp_seqtab_find(r->seqs, s->ns, q->child)->num_tokens;
    return 0;
}

int kvp__rpc_truncate(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                      uint64_t now_ms)
{
    const uint64_t id = req->id;
    const kvpool_TruncateRequest *q = &req->body.truncate;
    const kvp_seq_t *seq = kvp_seqtab_find(r->seqs, s->ns, q->seq_id);
    uint32_t before = seq ? seq->num_pages : 0;
    const uint32_t ps = r->backend->geom.page_size;
    if (seq && r->tier.mem && q->num_tokens < seq->num_tokens && q->num_tokens % ps &&
        kvp_pcache_restoring(r->pc, seq->pages[q->num_tokens / ps])) {
        /* the kept partial page is still being restored from host memory: the next append
         * into it would race the restore's copy (issue #28) */
        kvp_rpc_error(&io->resp, id, KVP_EUNAVAIL,
                      "page %u of sequence %llu is being restored from host memory; retry",
                      q->num_tokens / ps, (unsigned long long)q->seq_id);
        return 0;
    }
    int rc = kvp_seqtab_truncate(r->seqs, s->ns, q->seq_id, q->num_tokens, now_ms);
    if (rc) {
        if (rc == KVP_ENOENT)
            kvp_rpc_error(&io->resp, id, rc, "no sequence %llu", (unsigned long long)q->seq_id);
        else
            kvp_rpc_error(&io->resp, id, KVP_EINVAL, "cannot truncate %u-token sequence to %u",
                          seq ? seq->num_tokens : 0, q->num_tokens);
        return 0;
    }
    kvp__rpc_ok(io, id);
    io->resp.body.truncate.pages_freed = before - seq->num_pages;
    return 0;
}

int kvp__rpc_release(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req, kvp_rpc_io_t *io,
                     uint64_t now_ms)
{
    const uint64_t id = req->id;
    (void)now_ms;
    uint32_t n, released = 0;
    if (kvp__rpc_take_batch(r, s, io, 0, &n, &io->resp, id))
        return 0;
    for (uint32_t i = 0; i < n; i++)
        released += kvp_seqtab_release(r->seqs, s->ns, r->items[i].seq_id) == 0;
    kvp__rpc_ok(io, id);
    io->resp.body.release.released = released;
    return 0;
}

int kvp__rpc_get_page_table(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                            kvp_rpc_io_t *io, uint64_t now_ms)
{
    const uint64_t id = req->id;
    (void)now_ms;
    uint32_t n;
    if (kvp__rpc_take_batch(r, s, io, 0, &n, &io->resp, id))
        return 0;
    int rc = kvp_plan_page_table(r->seqs, r->items, n, &r->plan_limits, &r->plan);
    if (rc) {
        kvp_rpc_error(&io->resp, id, rc, "%s (batch item %u)",
                      rc == KVP_ENOENT ? "no such sequence" : kvp_strerror(rc), r->plan.fail_index);
        return 0;
    }
    kvp__rpc_ok(io, id);
    io->resp.body.get_page_table.has_table = true;
    kvp__rpc_table_from_plan(r, &io->resp.body.get_page_table.table, &io->out);
    return 0;
}
