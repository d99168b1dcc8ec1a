/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_multigpu_tp.c - a tensor-parallel group of two GPUs on one kvpoold (devices = 0,1,
 * DESIGN.md §6), driven by two rank processes as an engine would: each rank maps the pool,
 * registers its own VMM staging buffer with events on its own GPU and records its ready event;
 * the leader (rank 0) sends one Append naming both ranks' buffers (rank_sources). Checked:
 * every GPU's share of the pool is byte-exact against a CPU reference built from that rank's
 * own data (copy-on-write copies included), the page table the leader got equals the one the
 * other rank reads back (GetPageTable), a refused rank source changes nothing, and the audit is
 * clean. Label multigpu: exits 77 with fewer than two GPUs.
 */
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvp_gpu_test.h"
#include "kvp_harness.h"
#include "kvp_kernels.h"
#include "kvp_test_util.h"
#include "kvpool.h"

#define W(cond, ...)                                                                               \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "rank process %d, line %d: ", (int)getpid(), __LINE__);                \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            _exit(1);                                                                              \
        }                                                                                          \
    } while (0)
#define WC(call) W((call) == cudaSuccess, "%s failed", #call)

static kvp_daemon_t DMN;

/* What the leader hands the other rank after each step: its whole Append answer. */
typedef struct {
    uint32_t batch_size, nnz, num_indices, num_copies;
    int32_t indptr[9], indices[64], last[8], aip[9], seq_lens[8];
    uint32_t copies[16];
    uint64_t ids[8];
} step_t;

typedef struct {
    kvp_client_t *c;
    const kvp_pool_info_t *pi;
    uint32_t rank;
    uint8_t *ref, *back, *host;
    void *dbuf;
    uint32_t buf_id;
    size_t buf_bytes;
    cudaStream_t stream;
} rank_t;

static void write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t k = write(fd, b, n);
        W(k > 0, "pipe write");
        b += k, n -= (size_t)k;
    }
}

static void read_all(int fd, void *p, size_t n)
{
    uint8_t *b = p;
    while (n) {
        ssize_t k = read(fd, b, n);
        W(k > 0, "pipe read (peer rank gone)");
        b += k, n -= (size_t)k;
    }
}

static void layer_view(const rank_t *r, uint8_t *pool, uint32_t l, const step_t *st,
                       kvp_paged_kv_t *kv)
{
    const kvp_pool_info_t *pi = r->pi;
    memset(kv, 0, sizeof(*kv));
    kv->k_data = pool + (uint64_t)l * pi->layer_bytes;
    kv->v_data = (uint8_t *)kv->k_data + pi->v_offset_bytes;
    kv->elem_bytes = pi->elem_bytes;
    kv->num_pages = pi->num_pages;
    kv->page_size = pi->page_size;
    kv->num_heads = pi->heads_per_device;
    kv->head_dim = pi->head_dim;
    kv->stride_page = pi->stride_page;
    kv->stride_n = pi->stride_n;
    kv->stride_h = pi->stride_h;
    kv->batch_size = st->batch_size;
    kv->kv_indptr = st->indptr;
    kv->kv_indices = st->indices;
    kv->kv_last_page_len = st->last;
}

/* Source layout of a step in every rank's buffer: per layer K [nnz, H/G, D] then V. */
static kvp_source_t source(const rank_t *r, uint32_t nnz)
{
    uint64_t row = (uint64_t)r->pi->head_dim * r->pi->elem_bytes, H = r->pi->heads_per_device;
    uint64_t kv = nnz * H * row;
    return (kvp_source_t){.k_offset = 0,
                          .v_offset = kv,
                          .k_stride_n = H * row,
                          .k_stride_h = row,
                          .v_stride_n = H * row,
                          .v_stride_h = row,
                          .layer_stride = 2 * kv};
}

/* Applies a step (copies, then this rank's data) to the rank's CPU reference and compares its
 * GPU's share of the pool with it. */
static void check_share(rank_t *r, const step_t *st, const char *what)
{
    const kvp_pool_info_t *pi = r->pi;
    int32_t bidx[512], pos[512];
    W(kvp_get_batch_indices_positions_cpu(st->aip, st->seq_lens, st->batch_size, st->nnz, bidx,
                                          pos) == 0,
      "positions");
    kvp_paged_kv_t kv;
    for (uint32_t l = 0; l < pi->num_layers && st->num_copies; l++) {
        layer_view(r, r->ref, l, st, &kv);
        W(kvp_page_copy_cpu(&kv, (const kvp_page_copy_t *)st->copies, st->num_copies) == 0, "copy");
    }
    kvp_source_t s = source(r, st->nnz);
    uint64_t e = pi->elem_bytes;
    for (uint32_t l = 0; l < pi->num_layers; l++) {
        layer_view(r, r->ref, l, st, &kv);
        const uint8_t *base = r->host + l * s.layer_stride;
        kvp_append_src_t a = {.key = base + s.k_offset,
                              .value = base + s.v_offset,
                              .k_stride_n = (int64_t)(s.k_stride_n / e),
                              .k_stride_h = (int64_t)(s.k_stride_h / e),
                              .v_stride_n = (int64_t)(s.v_stride_n / e),
                              .v_stride_h = (int64_t)(s.v_stride_h / e)};
        W(kvp_append_paged_kv_cache_cpu(&kv, &a, bidx, pos, st->nnz) == 0, "cpu append");
    }
    WC(cudaMemcpy(r->back, kvp_client_pool_base(r->c, r->rank), pi->pool_bytes,
                  cudaMemcpyDeviceToHost));
    size_t i = 0;
    while (i < pi->pool_bytes && r->back[i] == r->ref[i])
        i++;
    W(i == pi->pool_bytes, "%s: GPU %u's share differs from the reference at byte %zu", what,
      r->rank, i);
}

static void rank_open(rank_t *r, uint32_t rank)
{
    memset(r, 0, sizeof(*r));
    r->rank = rank;
    kvp_client_opts_t o = {.socket_path = DMN.sock,
                           .ns = "tp-engine",
                           .client_name = rank ? "rank1" : "rank0",
                           .lease_ms = 0,
                           .timeout_ms = 30000,
                           .map_pool = 1};
    char err[256];
    W(kvp_client_connect(&o, &r->c, err, sizeof(err)) == 0, "connect: %s", err);
    r->pi = kvp_client_pool_info(r->c);
    W(r->pi->backend == 1 && r->pi->num_devices == 2 &&
          r->pi->heads_per_device * 2 == r->pi->num_kv_heads,
      "pool info");
    W(kvp_client_cuda_map_pool(r->c) == 0, "map: %s", kvp_client_last_error(r->c));
    const int device = r->pi->device_ids[rank];
    WC(cudaSetDevice(device));
    WC(cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking));
    r->ref = calloc(1, r->pi->pool_bytes);
    r->back = malloc(r->pi->pool_bytes);
    r->buf_bytes = (size_t)2 * 128 * r->pi->heads_per_device * r->pi->head_dim * r->pi->elem_bytes *
                   r->pi->num_layers;
    r->host = malloc(r->buf_bytes);
    W(r->ref && r->back && r->host, "out of memory");
    WC(cudaMemcpy(r->ref, kvp_client_pool_base(r->c, rank), r->pi->pool_bytes,
                  cudaMemcpyDeviceToHost));
    W(kvp_client_cuda_alloc_buffer(r->c, r->buf_bytes, device, &r->dbuf, &r->buf_id, 1) == 0,
      "alloc: %s", kvp_client_last_error(r->c));
}

/* Fills the rank's buffer on its stream and records its ready event there. */
static void stage(rank_t *r, kvp_rng_t *rng)
{
    kvp_rng_fill(rng, r->host, r->buf_bytes);
    WC(cudaMemcpyAsync(r->dbuf, r->host, r->buf_bytes, cudaMemcpyHostToDevice, r->stream));
    W(kvp_client_cuda_record_ready(r->c, r->buf_id, r->stream) == 0, "record_ready: %s",
      kvp_client_last_error(r->c));
}

static void table_bind(kvp_page_table_t *t, step_t *st)
{
    memset(t, 0, sizeof(*t));
    t->kv_indptr = st->indptr;
    t->kv_indices = st->indices;
    t->kv_last_page_len = st->last;
    t->append_indptr = st->aip;
    t->seq_lens = st->seq_lens;
    t->copies = st->copies;
    t->cap_batch = 9;
    t->cap_indices = 64;
    t->cap_copies = 8;
}

/* Rank 1 and rank 0 read the same page table back; equal to the leader's answer. */
static void same_table(rank_t *r, const step_t *st)
{
    step_t mine;
    memset(&mine, 0, sizeof(mine));
    kvp_page_table_t t;
    table_bind(&t, &mine);
    W(kvp_client_page_table(r->c, st->ids, st->batch_size, &t) == 0, "page_table: %s",
      kvp_client_last_error(r->c));
    W(t.batch_size == st->batch_size && t.num_indices == st->num_indices, "table sizes differ");
    W(memcmp(mine.indptr, st->indptr, 4 * (st->batch_size + 1)) == 0, "kv_indptr differs");
    W(memcmp(mine.indices, st->indices, 4 * st->num_indices) == 0, "kv_indices differ");
    W(memcmp(mine.last, st->last, 4 * st->batch_size) == 0, "kv_last_page_len differs");
}

static int rank1_main(int to_leader, int from_leader)
{
    rank_t r;
    rank_open(&r, 1);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(0x7a1));
    for (int step = 0; step < 2; step++) {
        stage(&r, &rng);
        uint64_t ids[2] = {kvp_client_session_id(r.c), r.buf_id};
        write_all(to_leader, ids, sizeof(ids));
        step_t st;
        read_all(from_leader, &st, sizeof(st));
        W(kvp_client_cuda_wait_done(r.c, r.buf_id, r.stream) == 0, "wait_done");
        WC(cudaStreamSynchronize(r.stream));
        check_share(&r, &st, step ? "step 2 (copy-on-write)" : "step 1 (seed example)");
        same_table(&r, &st);
        write_all(to_leader, &st.nnz, sizeof(st.nnz)); /* checked */
    }
    kvp_client_close(r.c);
    return 0;
}

static int rank0_main(int from_rank1, int to_rank1)
{
    rank_t r;
    rank_open(&r, 0);
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(0x7a0));
    uint64_t ids1[4] = {1, 2, 3, 4};
    uint32_t toks1[4] = {45, 8, 25, 22};
    uint64_t ids2[2] = {1, 5};
    uint32_t toks2[2] = {1, 1};
    for (int step = 0; step < 2; step++) {
        const uint64_t *ids = step ? ids2 : ids1;
        const uint32_t *toks = step ? toks2 : toks1;
        uint32_t n = step ? 2 : 4, nnz = step ? 2 : 100;
        if (step == 1)
            W(kvp_client_fork(r.c, 1, 5) == 0, "fork: %s", kvp_client_last_error(r.c));
        stage(&r, &rng);
        uint64_t peer[2];
        read_all(from_rank1, peer, sizeof(peer));
        kvp_rank_source_t ranks[2] = {{0, r.buf_id}, {peer[0], (uint32_t)peer[1]}};
        kvp_source_t src = source(&r, nnz);
        step_t st;
        memset(&st, 0, sizeof(st));
        memcpy(st.ids, ids, n * 8);
        kvp_page_table_t t;
        table_bind(&t, &st);
        if (step == 0) {
            /* refusals first: they change nothing */
            kvp_rank_source_t bad[2] = {{peer[0], (uint32_t)peer[1]}, {0, r.buf_id}};
            W(kvp_client_append_ranks(r.c, ids, toks, n, &src, bad, 2, 1, &t) == KVP_EINVAL,
              "ranks swapped must be refused (device mismatch)");
            W(kvp_client_append_ranks(r.c, ids, toks, n, &src, ranks, 1, 1, &t) == KVP_EINVAL,
              "one rank for a group of two must be refused");
            kvp_rank_source_t gone[2] = {{0, r.buf_id}, {peer[0] + 1000, (uint32_t)peer[1]}};
            W(kvp_client_append_ranks(r.c, ids, toks, n, &src, gone, 2, 1, &t) == KVP_ENOENT,
              "an unknown session must be refused");
            kvp_stats_summary_t sm;
            W(kvp_client_stats(r.c, &sm) == 0 && sm.used_pages == 0, "refusals allocated pages");
        }
        W(kvp_client_append_ranks(r.c, ids, toks, n, &src, ranks, 2, 1, &t) == 0,
          "append_ranks: %s", kvp_client_last_error(r.c));
        W(t.nnz == nnz && t.batch_size == n, "table");
        W(step == 0 || t.num_copies == 1, "step 2 must copy the shared page, copies=%u",
          t.num_copies);
        st.batch_size = t.batch_size, st.nnz = t.nnz, st.num_indices = t.num_indices;
        st.num_copies = t.num_copies;
        write_all(to_rank1, &st, sizeof(st));
        W(kvp_client_cuda_wait_done(r.c, r.buf_id, r.stream) == 0, "wait_done");
        WC(cudaStreamSynchronize(r.stream));
        check_share(&r, &st, step ? "step 2 (copy-on-write)" : "step 1 (seed example)");
        same_table(&r, &st);
        uint32_t ack;
        read_all(from_rank1, &ack, sizeof(ack));
        W(ack == nnz, "rank 1 ack");
    }
    W(kvp_client_audit(r.c) == 0, "audit: %s", kvp_client_last_error(r.c));
    kvp_client_close(r.c);
    return 0;
}

static int wait_child(pid_t pid)
{
    int st;
    while (waitpid(pid, &st, 0) < 0)
        ;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

int main(void)
{
    if (kvp_gpu_count() < 2) {
        printf("fewer than two usable GPUs: skipped\n");
        return 77;
    }
    const char *args[] = {
        "--backend",   "cuda", "--devices",      "0,1", "--num-layers", "2",  "--num-pages", "64",
        "--page-size", "16",   "--num-kv-heads", "4",   "--head-dim",   "64", "--dtype",     "fp16",
        NULL};
    if (kvp_daemon_start(&DMN, args) != 0)
        return 1;
    int a[2], b[2];
    if (pipe(a) || pipe(b))
        return 1;
    pid_t p1 = fork();
    if (p1 == 0) {
        close(a[0]), close(b[1]);
        _exit(rank1_main(a[1], b[0]));
    }
    pid_t p0 = fork();
    if (p0 == 0) {
        close(a[1]), close(b[0]);
        _exit(rank0_main(a[0], b[1]));
    }
    close(a[0]), close(a[1]), close(b[0]), close(b[1]);
    int c0 = wait_child(p0), c1 = wait_child(p1);
    int dc = kvp_daemon_stop(&DMN, SIGTERM);
    printf("rank0 exit %d, rank1 exit %d, daemon exit %d\n", c0, c1, dc);
    if (c0 || c1 || dc)
        return 1;
    printf("tensor-parallel group of 2: OK\n");
    return 0;
}
