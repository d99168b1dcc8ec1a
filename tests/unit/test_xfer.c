/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_xfer.c - the CPU side of transfers between daemons: the packed stream format
 * ([layer][K|V][token][head][D]) and its pack/unpack between pools of every pairing of layout,
 * storage and page size, byte-exact; the pure checks of ExportBegin and Import; the dispatch's
 * refusals, each with its status and nothing changed (a host-backend daemon cannot transfer:
 * UNAVAILABLE after the request itself was validated); NCCL that cannot be loaded.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_kernels.h"
#include "kvp_nccl.h"
#include "kvp_rpc.h"
#include "kvp_test_util.h"
#include "kvp_xfer.h"

START_TEST(packed_format_math)
{
    ck_assert_uint_eq(kvp_kv_packed_layer_bytes(10, 4, 64, 2), 2ull * 10 * 4 * 64 * 2);
    ck_assert_uint_eq(kvp_kv_packed_layer_bytes(0, 4, 64, 2), 0);
    const uint64_t row = 128;
    ck_assert_uint_eq(kvp_kv_packed_offset(10, 4, row, 0, 0, 0), 0);
    ck_assert_uint_eq(kvp_kv_packed_offset(10, 4, row, 0, 0, 3), 3 * row);
    ck_assert_uint_eq(kvp_kv_packed_offset(10, 4, row, 0, 2, 1), (2 * 4 + 1) * row);
    ck_assert_uint_eq(kvp_kv_packed_offset(10, 4, row, 1, 0, 0), 10 * 4 * row);
    ck_assert_uint_eq(kvp_kv_packed_offset(10, 4, row, 1, 9, 3), (10 * 4 + 9 * 4 + 3) * row);
    kvp_geom_t g = {.num_layers = 3,
                    .num_pages = 8,
                    .page_size = 16,
                    .num_kv_heads = 4,
                    .head_dim = 64,
                    .dtype = KVP_DTYPE_BF16,
                    .num_devices = 1};
    ck_assert_uint_eq(kvp_xfer_stream_bytes(&g, 33), 3ull * 2 * 33 * 4 * 64 * 2);
}
END_TEST

/* The largest staging chunk: automatic (a quarter within 4..256 MiB), the setting, the limits;
 * the schedule of chunks around it. */
START_TEST(chunk_sizes)
{
    const uint64_t MiB = 1u << 20, GiB = 1u << 30;
    ck_assert_uint_eq(kvp_xfer_chunk_bytes(0, GiB), 256 * MiB);             /* 1/4 */
    ck_assert_uint_eq(kvp_xfer_chunk_bytes(0, 4 * GiB), 256 * MiB);         /* capped */
    ck_assert_uint_eq(kvp_xfer_chunk_bytes(0, 64 * MiB), 16 * MiB);         /* 1/4 */
    ck_assert_uint_eq(kvp_xfer_chunk_bytes(0, 8 * MiB), 4 * MiB);           /* the floor */
    ck_assert_uint_eq(kvp_xfer_chunk_bytes(0, 1000), 1024);                 /* the whole stream */
    ck_assert_uint_eq(kvp_xfer_chunk_bytes(0, 3 * MiB + 1), 3 * MiB + 256); /* rounded up */
    ck_assert_uint_eq(kvp_xfer_chunk_bytes(4096, GiB), 4096);
    ck_assert_uint_eq(kvp_xfer_chunk_bytes(4000, GiB), 4096); /* to 256 bytes */
    ck_assert_uint_eq(kvp_xfer_chunk_bytes(1, GiB), 256);
    ck_assert_uint_eq(kvp_xfer_chunk_bytes(512 * MiB, 3 * GiB), 512 * MiB);
    ck_assert_uint_eq(kvp_xfer_chunk_bytes(UINT32_MAX, 3 * GiB), GiB); /* the limit */
    ck_assert_uint_eq(kvp_xfer_chunk_bytes(512 * MiB, 100 * MiB), 100 * MiB);

    /* the schedule of 1 GiB in chunks of at most 256 MiB: up from 32, down to 4 */
    const uint64_t want[] = {32, 32, 64, 128, 256, 256, 128, 64, 32, 16, 8, 4, 4};
    uint64_t off = 0, k = 0;
    for (; off < GiB; k++) {
        ck_assert_uint_lt(k, sizeof(want) / sizeof(want[0]));
        const size_t c = kvp_xfer_chunk_at(256 * MiB, off, GiB);
        ck_assert_uint_eq(c, want[k] * MiB);
        off += c;
    }
    ck_assert_uint_eq(k, sizeof(want) / sizeof(want[0]));
    ck_assert_uint_eq(off, GiB);
    /* any stream, any largest chunk: the chunks tile it exactly, none above the largest, all
     * but the last a multiple of 256 */
    const uint64_t totals[] = {1, 255, 256, 257, 4095, 1000000, 3 * MiB + 7, 77 * MiB + 13, GiB};
    const size_t maxes[] = {256, 4096, 1000192, 4 * MiB, 64 * MiB, 256 * MiB};
    for (size_t a = 0; a < sizeof(totals) / sizeof(totals[0]); a++)
        for (size_t m = 0; m < sizeof(maxes) / sizeof(maxes[0]); m++) {
            uint64_t o = 0, n = 0, bad = 0; /* plain checks: a ck_assert per chunk is slow */
            while (o < totals[a] && n <= totals[a] / 256 + 64) {
                const size_t c = kvp_xfer_chunk_at(maxes[m], o, totals[a]);
                bad += c == 0 || c > maxes[m] || (o + c < totals[a] && c % 256 != 0);
                o += c;
                n++;
            }
            ck_assert_uint_eq(bad, 0);
            ck_assert_uint_eq(o, totals[a]);
        }
}
END_TEST

typedef struct {
    kvp_geom_t g;
    kvp_geom_derived_t d;
    uint8_t *pool;
} pool_t;

static void pool_make(pool_t *p, uint32_t page_size, kvp_layout_t lay, kvp_storage_t sto)
{
    p->g = (kvp_geom_t){.num_layers = 2,
                        .num_pages = 24,
                        .page_size = page_size,
                        .num_kv_heads = 3,
                        .head_dim = 8,
                        .dtype = KVP_DTYPE_FP16,
                        .layout = lay,
                        .storage = sto,
                        .num_devices = 1};
    ck_assert_int_eq(kvp_geom_derive(&p->g, &p->d), 0);
    p->pool = calloc(1, p->d.pool_bytes);
    ck_assert_ptr_nonnull(p->pool);
}

static void layer_view(const pool_t *p, uint32_t l, kvp_paged_kv_t *kv)
{
    memset(kv, 0, sizeof(*kv));
    kv->k_data = p->pool + kvp_geom_layer_offset(&p->d, l);
    kv->v_data = (uint8_t *)kv->k_data + p->d.v_offset_bytes;
    kv->elem_bytes = p->d.elem_bytes;
    kv->num_pages = p->g.num_pages;
    kv->page_size = p->g.page_size;
    kv->num_heads = p->d.heads;
    kv->head_dim = p->g.head_dim;
    kv->stride_page = p->d.stride_page;
    kv->stride_n = p->d.stride_n;
    kv->stride_h = p->d.stride_h;
}

/* Every pairing of page size {4, 16, 64}, layout and storage: a sequence of 70 tokens on
 * scattered pages of pool A, packed, unpacked into pool B: every row equal, the stream in
 * canonical order, and nothing outside the sequence's slots of B written. */
START_TEST(pack_unpack_between_any_two_pools)
{
    const uint32_t sizes[3] = {4, 16, 64};
    const uint32_t T = 70;
    int i = _i; /* 0 .. 3*4*3*4-1 */
    uint32_t ps_a = sizes[i % 3], ps_b = sizes[(i / 3) % 3];
    int va = (i / 9) % 4, vb = (i / 36) % 4;
    pool_t a, b;
    pool_make(&a, ps_a, (kvp_layout_t)(va & 1), (kvp_storage_t)(va >> 1));
    pool_make(&b, ps_b, (kvp_layout_t)(vb & 1), (kvp_storage_t)(vb >> 1));
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(900 + (uint64_t)i));
    kvp_rng_fill(&rng, a.pool, a.d.pool_bytes);
    kvp_rng_fill(&rng, b.pool, b.d.pool_bytes);
    uint8_t *b_before = malloc(b.d.pool_bytes);
    memcpy(b_before, b.pool, b.d.pool_bytes);
    /* pages in a scrambled order */
    int32_t pa[24], pb[24];
    uint32_t na = kvp_geom_pages_for(ps_a, T), nb = kvp_geom_pages_for(ps_b, T);
    ck_assert_uint_le(na, 24);
    ck_assert_uint_le(nb, 24);
    for (uint32_t k = 0; k < 24; k++)
        pa[k] = (int32_t)((k * 7 + 3) % 24), pb[k] = (int32_t)((k * 5 + 11) % 24);
    const uint64_t row = a.d.row_bytes, lb = kvp_kv_packed_layer_bytes(T, 3, 8, 2);
    uint8_t *stream = malloc(2 * lb);
    for (uint32_t l = 0; l < 2; l++) {
        kvp_paged_kv_t kv;
        layer_view(&a, l, &kv);
        ck_assert_int_eq(kvp_kv_pack_cpu(&kv, pa, T, stream + l * lb), 0);
        layer_view(&b, l, &kv);
        ck_assert_int_eq(kvp_kv_unpack_cpu(&kv, pb, T, stream + l * lb), 0);
    }
    for (uint32_t l = 0; l < 2; l++)
        for (int w = 0; w < 2; w++)
            for (uint32_t t = 0; t < T; t++)
                for (uint32_t h = 0; h < 3; h++) {
                    uint64_t oa =
                        kvp_geom_offset(&a.d, &a.g, l, (uint32_t)pa[t / ps_a], w, t % ps_a, h);
                    uint64_t ob =
                        kvp_geom_offset(&b.d, &b.g, l, (uint32_t)pb[t / ps_b], w, t % ps_b, h);
                    uint64_t os = l * lb + kvp_kv_packed_offset(T, 3, row, w, t, h);
                    ck_assert_int_eq(memcmp(a.pool + oa, stream + os, row), 0);
                    ck_assert_int_eq(memcmp(b.pool + ob, a.pool + oa, row), 0);
                    memcpy(b_before + ob, b.pool + ob, row); /* the slots it may write */
                }
    ck_assert_int_eq(memcmp(b_before, b.pool, b.d.pool_bytes), 0); /* and no other byte */
    /* a page id out of range is refused before anything is written */
    kvp_paged_kv_t kv;
    layer_view(&b, 0, &kv);
    int32_t bad[24];
    memcpy(bad, pb, sizeof(bad));
    bad[nb - 1] = 24;
    memcpy(b_before, b.pool, b.d.pool_bytes);
    ck_assert_int_eq(kvp_kv_unpack_cpu(&kv, bad, T, stream), KVP_ERANGE);
    ck_assert_int_eq(memcmp(b_before, b.pool, b.d.pool_bytes), 0);
    ck_assert_int_eq(kvp_kv_pack_cpu(NULL, pb, T, stream), KVP_EINVAL);
    free(stream);
    free(b_before);
    free(a.pool);
    free(b.pool);
}
END_TEST

START_TEST(request_checks)
{
    kvp_geom_t g = {.num_layers = 4,
                    .num_pages = 8,
                    .page_size = 16,
                    .num_kv_heads = 4,
                    .head_dim = 64,
                    .dtype = KVP_DTYPE_FP16,
                    .num_devices = 1};
    char why[200];
    ck_assert_int_eq(kvp_xfer_check_export(&g, 0, 0, why, sizeof(why)), KVP_EPRECOND);
    ck_assert_int_eq(kvp_xfer_check_export(&g, 5, 3600001, why, sizeof(why)), KVP_EINVAL);
    ck_assert_int_eq(kvp_xfer_check_export(&g, 5, 0, why, sizeof(why)), 0);
    ck_assert_int_eq(kvp_xfer_check_import(&g, 127, 1, 5, 128, 4, 0, why, sizeof(why)), KVP_EINVAL);
    ck_assert_ptr_nonnull(strstr(why, "nccl_id has 127 bytes"));
    ck_assert_int_eq(kvp_xfer_check_import(&g, 128, 0, 5, 128, 4, 0, why, sizeof(why)), KVP_EINVAL);
    ck_assert_int_eq(kvp_xfer_check_import(&g, 128, 1, 0, 128, 4, 0, why, sizeof(why)), KVP_EINVAL);
    ck_assert_int_eq(kvp_xfer_check_import(&g, 128, 1, 129, 128, 4, 0, why, sizeof(why)),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_xfer_check_import(&g, 128, 1, 5, 128, 3, 0, why, sizeof(why)), KVP_EINVAL);
    ck_assert_ptr_nonnull(strstr(why, "this pool has 4 layers"));
    ck_assert_int_eq(kvp_xfer_check_import(&g, 128, 1, 5, 128, 4, 3600001, why, sizeof(why)),
                     KVP_EINVAL);
    ck_assert_int_eq(kvp_xfer_check_import(&g, 128, 1, 128, 128, 4, 0, why, sizeof(why)), 0);
}
END_TEST

START_TEST(nccl_that_cannot_load_is_unavailable)
{
    char longer[300];
    memset(longer, 'x', sizeof(longer) - 1);
    longer[sizeof(longer) - 1] = '\0';
    ck_assert_int_eq(kvp_nccl_set_library(longer), KVP_EINVAL); /* [tuning] nccl_lib's bound */
    ck_assert_int_eq(kvp_nccl_set_library("/nonexistent/libnccl.so.2"), 0);
    const kvp_nccl_t *n = NULL;
    char why[256] = "";
    ck_assert_int_eq(kvp_nccl_get(&n, why, sizeof(why)), KVP_EUNAVAIL);
    ck_assert_int_ne(why[0], '\0');
    ck_assert_ptr_null(n);
}
END_TEST

/* ---- the dispatch on a host backend ---------------------------------------------------- */

static kvp_rpc_t *R;
static kvp_session_t *S;
static kvp_rpc_io_t IO;
static kvpool_Request Q;
static uint64_t seq_ids[8];
static uint32_t num_tokens[8];
static kvp_batch_arrays_t B;

static kvpool_Code call(pb_size_t which)
{
    static uint64_t next_id =
        1; /* fresh ids: the retry window refuses one reused for another call */
    Q.which_body = which;
    Q.id = next_id++;
    memset(&IO, 0, sizeof(IO));
    IO.batch = &B;
    int rc = kvp_rpc_handle(R, S, &Q, NULL, 0, &IO, 2000, 0);
    ck_assert_int_eq(rc, KVP_RPC_DONE); /* a host backend never starts a transfer */
    kvp_rpc_answered(R, S, &IO.resp, NULL, 0, 0);
    ck_assert_ptr_null(IO.job);
    /* and no transfer began in the background (it would be listed, running or failed) */
    kvpool_Request lq;
    memset(&lq, 0, sizeof(lq));
    lq.id = next_id++;
    lq.which_body = kvpool_Request_list_transfers_tag;
    static kvp_rpc_io_t lio;
    memset(&lio, 0, sizeof(lio));
    lio.batch = &B;
    ck_assert_int_eq(kvp_rpc_handle(R, S, &lq, NULL, 0, &lio, 2000, 0), KVP_RPC_DONE);
    ck_assert_int_eq(lio.resp.status.code, kvpool_Code_OK);
    ck_assert_uint_eq(lio.resp.body.list_transfers.transfers_count, 0);
    kvp_rpc_answered(R, S, &lio.resp, NULL, 0, 0);
    return IO.resp.status.code;
}

static void stats(uint32_t *used, uint32_t *seqs)
{
    memset(&Q, 0, sizeof(Q));
    ck_assert_int_eq(call(kvpool_Request_stats_tag), kvpool_Code_OK);
    *used = IO.resp.body.stats.stats.used_pages;
    *seqs = IO.resp.body.stats.stats.num_seqs;
}

START_TEST(dispatch_validates_then_refuses_without_a_transfer_backend)
{
    kvp_geom_t g = {.num_layers = 2,
                    .num_pages = 16,
                    .page_size = 4,
                    .num_kv_heads = 2,
                    .head_dim = 8,
                    .dtype = KVP_DTYPE_FP16,
                    .num_devices = 1};
    kvp_backend_t *b;
    ck_assert_int_eq(kvp_backend_host_create(&g, &b), 0);
    kvp_rpc_limits_t lim = {.max_seqs = 16,
                            .max_namespaces = 4,
                            .max_batch = 8,
                            .max_batch_tokens = 1000,
                            .max_buffers_per_client = 2,
                            .max_buffer_bytes = 1 << 20,
                            .dedup_window = 8,
                            .max_lease_ms = 100000};
    ck_assert_int_eq(kvp_rpc_create(b, &lim, 1000, &R), 0);
    S = kvp_rpc_session_open(R, 1, (uint32_t)getuid(), (uint32_t)getgid(), 1000);
    memset(&Q, 0, sizeof(Q));
    Q.body.hello.protocol_version = KVP_PROTOCOL_VERSION;
    snprintf(Q.body.hello.namespace, sizeof(Q.body.hello.namespace), "eng");
    ck_assert_int_eq(call(kvpool_Request_hello_tag), kvpool_Code_OK);
    /* one sequence of 5 tokens */
    memset(&Q, 0, sizeof(Q));
    seq_ids[0] = 7;
    num_tokens[0] = 5;
    B.seq_ids = kvp_array(seq_ids, 8, 1, 8);
    B.num_tokens = kvp_array(num_tokens, 4, 1, 8);
    Q.body.reserve.has_batch = true;
    ck_assert_int_eq(call(kvpool_Request_reserve_tag), kvpool_Code_OK);
    uint32_t used0, seqs0, used, seqs;
    stats(&used0, &seqs0);
    ck_assert_uint_eq(used0, 2);

    memset(&Q, 0, sizeof(Q));
    Q.body.export_begin.seq_id = 8;
    ck_assert_int_eq(call(kvpool_Request_export_begin_tag), kvpool_Code_NOT_FOUND);
    Q.body.export_begin.seq_id = 7;
    Q.body.export_begin.timeout_ms = 4000000;
    ck_assert_int_eq(call(kvpool_Request_export_begin_tag), kvpool_Code_INVALID_ARGUMENT);
    Q.body.export_begin.timeout_ms = 0;
    snprintf(Q.body.export_begin.peer, sizeof(Q.body.export_begin.peer), "decode-0");
    ck_assert_int_eq(call(kvpool_Request_export_begin_tag), kvpool_Code_UNAVAILABLE);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "cuda backend"));

    memset(&Q, 0, sizeof(Q));
    kvpool_ImportRequest *im = &Q.body.import;
    im->nccl_id.size = 128;
    im->transfer_id = 99;
    im->seq_id = 7;
    im->num_tokens = 5;
    im->num_layers = 2;
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_ALREADY_EXISTS);
    im->seq_id = 9;
    im->nccl_id.size = 64;
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_INVALID_ARGUMENT);
    im->nccl_id.size = 128;
    im->num_layers = 3;
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_INVALID_ARGUMENT);
    im->num_layers = 2;
    im->num_tokens = 65; /* the pool holds 64 tokens */
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_INVALID_ARGUMENT);
    im->num_tokens = 5;
    /* the stream's shape, as ExportBegin answered */
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "bytes 0"));
    im->bytes = 2 * 2 * 5 * 2 * 8 * 2;
    im->chunk_bytes = 100;
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "chunk_bytes 100"));
    im->chunk_bytes = (1u << 30) + 256;
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_INVALID_ARGUMENT);
    im->chunk_bytes = 768;
    im->flags = 2;
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "flags"));
    im->flags = 1;
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_UNAVAILABLE);

    /* sets: each refusal with its status and reason, the valid set UNAVAILABLE here */
    memset(&Q, 0, sizeof(Q));
    seq_ids[0] = 10, num_tokens[0] = 3;
    Q.body.reserve.has_batch = true;
    ck_assert_int_eq(call(kvpool_Request_reserve_tag), kvpool_Code_OK);
    stats(&used0, &seqs0); /* sequences 7 (5 tokens) and 10 (3) */
    memset(&Q, 0, sizeof(Q));
    kvpool_ExportBeginRequest *ex = &Q.body.export_begin;
    snprintf(ex->peer, sizeof(ex->peer), "decode-0");
    ex->seq_ids_count = 2;
    ex->seq_ids[0] = 7, ex->seq_ids[1] = 10;
    ex->seq_id = 7;
    ck_assert_int_eq(call(kvpool_Request_export_begin_tag), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "beside seq_ids"));
    ex->seq_id = 0;
    ex->seq_ids[1] = 7;
    ck_assert_int_eq(call(kvpool_Request_export_begin_tag), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "named twice"));
    ex->seq_ids[1] = 11;
    ck_assert_int_eq(call(kvpool_Request_export_begin_tag), kvpool_Code_NOT_FOUND);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "11"));
    ex->seq_ids[1] = 10;
    ck_assert_int_eq(call(kvpool_Request_export_begin_tag), kvpool_Code_UNAVAILABLE);
    memset(&Q, 0, sizeof(Q));
    im->nccl_id.size = 128;
    im->transfer_id = 99;
    im->num_layers = 2;
    im->num_tokens = 8;
    im->bytes = 2 * 2 * 8 * 2 * 8 * 2;
    im->chunk_bytes = 1024;
    im->seq_ids_count = 2;
    im->seq_ids[0] = 20, im->seq_ids[1] = 21;
    im->seq_tokens_count = 1;
    im->seq_tokens[0] = 5;
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_INVALID_ARGUMENT);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "seq_tokens"));
    im->seq_tokens_count = 2;
    im->seq_tokens[1] = 4; /* 9, not 8 */
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_INVALID_ARGUMENT);
    im->seq_tokens[1] = 3;
    im->seq_ids[1] = 20;
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_INVALID_ARGUMENT);
    im->seq_ids[1] = 10; /* exists */
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_ALREADY_EXISTS);
    ck_assert_ptr_nonnull(strstr(IO.resp.status.message, "10"));
    im->seq_ids[1] = 21;
    im->seq_tokens[0] = 0, im->seq_tokens[1] = 8; /* an empty member */
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_INVALID_ARGUMENT);
    im->seq_tokens[0] = 5, im->seq_tokens[1] = 3;
    ck_assert_int_eq(call(kvpool_Request_import_tag), kvpool_Code_UNAVAILABLE);
    stats(&used, &seqs);
    ck_assert_uint_eq(used, used0);
    ck_assert_uint_eq(seqs, seqs0);
    char msg[256];
    ck_assert_int_eq(kvp_seqtab_audit(kvp_rpc_seqtab(R), msg, sizeof(msg)), 0);

    memset(&Q, 0, sizeof(Q));
    ck_assert_int_eq(call(kvpool_Request_list_transfers_tag), kvpool_Code_OK);
    ck_assert_uint_eq(IO.resp.body.list_transfers.transfers_count, 0);
    char *text = malloc(1 << 20);
    kvp_rpc_metrics_text(R, text, 1 << 20, 3000);
    ck_assert_ptr_nonnull(
        strstr(text, "kvpool_transfers_total{direction=\"import\",result=\"failed\"} 0\n"));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_transfer_bytes_total{direction=\"export\"} 0\n"));
    ck_assert_ptr_nonnull(strstr(text, "# TYPE kvpool_transfers_total counter\n"));
    free(text);
    kvp_rpc_session_close(R, S, 3000);
    kvp_rpc_destroy(R);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("xfer");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, packed_format_math);
    tcase_add_test(tc, chunk_sizes);
    tcase_add_loop_test(tc, pack_unpack_between_any_two_pools, 0, 3 * 3 * 4 * 4);
    tcase_add_test(tc, request_checks);
    tcase_add_test(tc, nccl_that_cannot_load_is_unavailable);
    tcase_add_test(tc, dispatch_validates_then_refuses_without_a_transfer_backend);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
