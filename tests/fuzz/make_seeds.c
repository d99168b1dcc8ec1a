/* SPDX-License-Identifier: Apache-2.0 */
/*
 * make_seeds.c - writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/):
 * nanopb-encoded requests cut into frames for fuzz_rpc (a Hello, then every other call),
 * encoded responses for fuzz_response, a few hand-made inputs for fuzz_kernel, and scripts
 * of stream chunks, fds and cuts for fuzz_frame (the format is in fuzz_frame.c), and raw
 * HTTP request heads for fuzz_http.
 * Usage: make_seeds CORPUS_DIR (its subdirectories must exist). Run by hand when the protocol
 * changes; the output is checked in.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_wire.h"

static uint8_t file_buf[1 << 16];
static size_t file_len;
static uint64_t next_id = 1;

static void put_file(const char *dir, const char *name)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(file_buf, 1, file_len, f) != file_len || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
    file_len = 0;
}

static void put_msg(const pb_msgdesc_t *fields, const void *msg)
{
    long n = kvp_wire_encode_frame(fields, msg, file_buf + file_len, sizeof(file_buf) - file_len);
    if (n < 0) {
        fprintf(stderr, "encode failed\n");
        exit(1);
    }
    file_len += (size_t)n;
}

static kvpool_Request req(pb_size_t which)
{
    kvpool_Request q;
    memset(&q, 0, sizeof(q));
    q.id = next_id++;
    q.which_body = which;
    return q;
}

static void hello(const char *ns, uint32_t lease)
{
    kvpool_Request q = req(kvpool_Request_hello_tag);
    q.body.hello.protocol_version = KVP_PROTOCOL_VERSION;
    snprintf(q.body.hello.namespace, sizeof(q.body.hello.namespace), "%s", ns);
    snprintf(q.body.hello.client_name, sizeof(q.body.hello.client_name), "seed");
    q.body.hello.has_lease_ms = lease != 0;
    q.body.hello.lease_ms = lease;
    q.body.hello.want_pool_fds = true;
    put_msg(kvpool_Request_fields, &q);
}

/* A call carrying a Batch (reserve, append, release, get_page_table). */
static void batch_call(pb_size_t which, uint32_t n, const uint64_t *ids, const uint32_t *toks,
                       const kvpool_Source *src)
{
    kvpool_Request q = req(which);
    kvp_batch_arrays_t b = {.seq_ids = kvp_array((void *)ids, 8, n, n),
                            .num_tokens = kvp_array((void *)toks, 4, toks ? n : 0, n)};
    kvpool_Batch *batch = NULL;
    switch (which) {
    case kvpool_Request_reserve_tag:
        q.body.reserve.has_batch = true;
        batch = &q.body.reserve.batch;
        break;
    case kvpool_Request_append_tag:
        q.body.append.has_batch = true;
        batch = &q.body.append.batch;
        if (src) {
            q.body.append.has_source = true;
            q.body.append.source = *src;
        }
        break;
    case kvpool_Request_release_tag:
        q.body.release.has_batch = true;
        batch = &q.body.release.batch;
        break;
    default:
        q.body.get_page_table.has_batch = true;
        batch = &q.body.get_page_table.batch;
        break;
    }
    kvp_wire_batch_bind_encode(batch, &b);
    put_msg(kvpool_Request_fields, &q);
}

/* ---- the prefix cache (issue #16) -------------------------------------------------------- */

/* Content of a cached call: token ids, salts (salt_lens entries, or none), cache options. */
typedef struct {
    const int32_t *tok;
    uint32_t ntok;
    const uint8_t *salts;
    const uint32_t *salt_lens;
    uint32_t nsalt, salt_bytes;
    const kvpool_CacheOptions *cache; /* NULL: none */
    uint32_t skip_tokens;
} content_t;

/* A Reserve, Append or Commit carrying token ids / salts / CacheOptions (Commit: seq_ids and
 * the event handle of ev_len bytes only). */
static void cached_call(pb_size_t which, uint32_t n, const uint64_t *ids, const uint32_t *toks,
                        const content_t *ct, const kvpool_Source *src, uint32_t ev_len)
{
    kvpool_Request q = req(which);
    kvp_batch_arrays_t b = {
        .seq_ids = kvp_array((void *)ids, 8, n, n),
        .num_tokens = kvp_array((void *)toks, 4, toks ? n : 0, n),
        .token_ids = kvp_array((void *)(ct ? ct->tok : NULL), 4, ct ? ct->ntok : 0, 0),
        .salts = kvp_array((void *)(ct ? ct->salts : NULL), 1, ct ? ct->salt_bytes : 0, 0),
        .salt_lens = kvp_array((void *)(ct ? ct->salt_lens : NULL), 4, ct ? ct->nsalt : 0, 0)};
    kvpool_Batch *batch;
    if (which == kvpool_Request_reserve_tag) {
        q.body.reserve.has_batch = true;
        batch = &q.body.reserve.batch;
        if (ct && ct->cache) {
            q.body.reserve.has_cache = true;
            q.body.reserve.cache = *ct->cache;
        }
    } else if (which == kvpool_Request_append_tag) {
        q.body.append.has_batch = true;
        batch = &q.body.append.batch;
        if (src) {
            q.body.append.has_source = true;
            q.body.append.source = *src;
        }
        if (ct && ct->cache) {
            q.body.append.has_cache = true;
            q.body.append.cache = *ct->cache;
        }
        q.body.append.skip_tokens = ct ? ct->skip_tokens : 0;
    } else {
        q.body.commit.has_batch = true;
        batch = &q.body.commit.batch;
        q.body.commit.event_handle.size = (pb_size_t)ev_len;
        memset(q.body.commit.event_handle.bytes, 0x5a, ev_len);
    }
    kvp_wire_batch_bind_encode(batch, &b);
    put_msg(kvpool_Request_fields, &q);
}

static void commit(uint32_t n, const uint64_t *ids, uint32_t ev_len)
{
    cached_call(kvpool_Request_commit_tag, n, ids, NULL, NULL, NULL, ev_len);
}

/* Lookup of n prompts (lengths[n], token ids one after the other; salts as in content_t). */
static void lookup(uint32_t n, const uint32_t *lengths, const content_t *ct)
{
    kvpool_Request q = req(kvpool_Request_lookup_tag);
    kvp_batch_arrays_t b = {.num_tokens = kvp_array((void *)lengths, 4, n, n),
                            .token_ids = kvp_array((void *)ct->tok, 4, ct->ntok, ct->ntok),
                            .salts =
                                kvp_array((void *)ct->salts, 1, ct->salt_bytes, ct->salt_bytes),
                            .salt_lens = kvp_array((void *)ct->salt_lens, 4, ct->nsalt, ct->nsalt)};
    kvp_wire_lookup_request_bind_encode(&q.body.lookup, &b);
    put_msg(kvpool_Request_fields, &q);
}

static void pin(const int32_t *tok, uint32_t ntok, const char *salt, uint32_t ttl_ms)
{
    kvpool_Request q = req(kvpool_Request_pin_tag);
    kvp_batch_arrays_t b = {.token_ids = kvp_array((void *)tok, 4, ntok, ntok)};
    kvp_wire_pin_request_bind_encode(&q.body.pin, &b);
    if (salt) {
        q.body.pin.salt.size = (pb_size_t)strlen(salt);
        memcpy(q.body.pin.salt.bytes, salt, strlen(salt));
    }
    q.body.pin.ttl_ms = ttl_ms;
    put_msg(kvpool_Request_fields, &q);
}

static void unpin(uint64_t pin_id)
{
    kvpool_Request q = req(kvpool_Request_unpin_tag);
    q.body.unpin.pin_id = pin_id;
    put_msg(kvpool_Request_fields, &q);
}

static void cache_flush(const char *scope, bool all)
{
    kvpool_Request q = req(kvpool_Request_cache_flush_tag);
    snprintf(q.body.cache_flush.scope, sizeof(q.body.cache_flush.scope), "%s", scope);
    q.body.cache_flush.all = all;
    put_msg(kvpool_Request_fields, &q);
}

static void hello_scope(const char *ns, const char *scope)
{
    kvpool_Request q = req(kvpool_Request_hello_tag);
    q.body.hello.protocol_version = KVP_PROTOCOL_VERSION;
    snprintf(q.body.hello.namespace, sizeof(q.body.hello.namespace), "%s", ns);
    snprintf(q.body.hello.client_name, sizeof(q.body.hello.client_name), "seed");
    snprintf(q.body.hello.cache_scope, sizeof(q.body.hello.cache_scope), "%s", scope);
    put_msg(kvpool_Request_fields, &q);
}

static void simple(pb_size_t which)
{
    kvpool_Request q = req(which);
    put_msg(kvpool_Request_fields, &q);
}

static void rpc_seeds(const char *dir)
{
    uint64_t ids[3] = {7, 9, 11};
    uint32_t toks[3] = {5, 3, 8};

    hello("ns", 0);
    put_file(dir, "hello");

    simple(kvpool_Request_stats_tag); /* before Hello: refused */
    hello("ns", 0);
    simple(kvpool_Request_stats_tag);
    put_file(dir, "stats_before_hello");

    hello("ns", 0);
    batch_call(kvpool_Request_reserve_tag, 2, ids, toks, NULL);
    kvpool_Request q = req(kvpool_Request_fork_tag);
    q.body.fork.parent = 7;
    q.body.fork.child = 8;
    put_msg(kvpool_Request_fields, &q);
    uint64_t c8 = 8;
    uint32_t one = 1;
    batch_call(kvpool_Request_reserve_tag, 1, &c8, &one, NULL);
    q = req(kvpool_Request_truncate_tag);
    q.body.truncate.seq_id = 7;
    q.body.truncate.num_tokens = 4;
    put_msg(kvpool_Request_fields, &q);
    batch_call(kvpool_Request_get_page_table_tag, 3, ids, NULL, NULL);
    batch_call(kvpool_Request_release_tag, 2, ids, NULL, NULL);
    simple(kvpool_Request_stats_tag);
    put_file(dir, "reserve_fork_truncate_release");

    hello("ns", 0);
    q = req(kvpool_Request_register_buffer_tag);
    q.body.register_buffer.kind = kvpool_BufferKind_BUFFER_MEMFD;
    q.body.register_buffer.size_bytes = 4096;
    put_msg(kvpool_Request_fields, &q);
    /* 6 tokens, 2 heads of 16 fp16 (64 bytes a token), 2 layers: K at 0, V at 384 */
    kvpool_Source src = {.buffer_id = 1,
                         .k_offset = 0,
                         .v_offset = 384,
                         .k_stride_n = 64,
                         .k_stride_h = 32,
                         .v_stride_n = 64,
                         .v_stride_h = 32,
                         .layer_stride = 768};
    uint32_t t2[2] = {4, 2};
    batch_call(kvpool_Request_append_tag, 2, ids, t2, &src);
    batch_call(kvpool_Request_append_tag, 2, ids, t2, &src);
    q = req(kvpool_Request_unregister_buffer_tag);
    q.body.unregister_buffer.buffer_id = 1;
    put_msg(kvpool_Request_fields, &q);
    simple(kvpool_Request_stats_tag);
    put_file(dir, "register_append_unregister");

    hello("other", 5000);
    batch_call(kvpool_Request_reserve_tag, 3, ids, toks, NULL);
    q = req(kvpool_Request_ping_tag);
    q.body.ping.nonce = 77;
    put_msg(kvpool_Request_fields, &q);
    q = req(kvpool_Request_pool_info_tag);
    q.body.pool_info.want_pool_fds = true;
    put_msg(kvpool_Request_fields, &q);
    q = req(kvpool_Request_list_sequences_tag);
    q.body.list_sequences.limit = 2;
    put_msg(kvpool_Request_fields, &q);
    simple(kvpool_Request_list_clients_tag);
    simple(kvpool_Request_audit_tag);
    simple(kvpool_Request_metrics_tag);
    put_file(dir, "introspection");

    /* the same mutating id twice: the second is a replay */
    hello("ns", 0);
    next_id = 42;
    batch_call(kvpool_Request_reserve_tag, 1, ids, toks, NULL);
    next_id = 42;
    batch_call(kvpool_Request_reserve_tag, 1, ids, toks, NULL);
    put_file(dir, "replay");
}

/* fuzz_rpc inputs of issue #16 (fuzz_rpc's core: pages of 4 tokens, 64 pages, sequences of at
 * most 128 tokens, 4 scopes, 4 pins, 8 pinned pages a namespace, 512 lookup tokens, the shared
 * scope "fuzzshared"). */
static void cache_rpc_seeds(const char *dir)
{
    const uint64_t saved_id = next_id; /* the later targets' seeds stay as they were */
    static int32_t tok[1024];
    for (int i = 0; i < 1024; i++)
        tok[i] = 1000 + (i % 13) * 7 + i / 13;
    const uint8_t salt[] = "lora-a";
    const uint32_t salt_len = 6;
    uint64_t ids[3] = {7, 9, 11};
    uint32_t ten[3] = {10, 10, 10};
    kvpool_CacheOptions keep = {.has_priority = true, .priority = 50, .retention_ms = 1000};
    kvpool_CacheOptions reuse = {.reuse = true};
    kvpool_CacheOptions reuse_last = {.reuse = true, .leave_last = true};

    /* the Reserve path: a prompt reserved with its token ids and a salt, committed, found by a
     * Lookup, reused by a second sequence (leave_last) and by a third without the salt (no
     * hit), released (cached), found again, flushed, not found */
    hello("ns", 0);
    content_t c = {.tok = tok,
                   .ntok = 10,
                   .salts = salt,
                   .salt_lens = &salt_len,
                   .nsalt = 1,
                   .salt_bytes = salt_len,
                   .cache = &keep};
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], ten, &c, NULL, 0);
    commit(1, &ids[0], 0);
    lookup(1, ten, &c);
    c.cache = &reuse_last;
    cached_call(kvpool_Request_reserve_tag, 1, &ids[1], ten, &c, NULL, 0);
    content_t nosalt = {.tok = tok, .ntok = 10, .cache = &reuse};
    cached_call(kvpool_Request_reserve_tag, 1, &ids[2], ten, &nosalt, NULL, 0);
    batch_call(kvpool_Request_get_page_table_tag, 3, ids, NULL, NULL);
    commit(3, ids, 0);
    batch_call(kvpool_Request_release_tag, 3, ids, NULL, NULL);
    lookup(1, ten, &c);
    lookup(1, ten, &nosalt);
    cache_flush("", false);
    lookup(1, ten, &c);
    simple(kvpool_Request_stats_tag);
    put_file(dir, "cache_reserve_commit_reuse");

    /* the daemon-run Append path: a keyed Append over every layer (findable when it answers),
     * then a reuse Append that skips the 8 cached tokens (its source holds the last 2), a
     * batch of two reusing at once, and Stats */
    hello("ns", 0);
    kvpool_Request q = req(kvpool_Request_register_buffer_tag);
    q.body.register_buffer.kind = kvpool_BufferKind_BUFFER_MEMFD;
    q.body.register_buffer.size_bytes = 4096;
    put_msg(kvpool_Request_fields, &q);
    /* 10 tokens, 2 heads of 16 fp16 (64 bytes a token), 2 layers: K at 0, V at 640 */
    kvpool_Source src = {.buffer_id = 1,
                         .k_offset = 0,
                         .v_offset = 640,
                         .k_stride_n = 64,
                         .k_stride_h = 32,
                         .v_stride_n = 64,
                         .v_stride_h = 32,
                         .layer_stride = 1280};
    content_t a = {.tok = tok, .ntok = 10};
    cached_call(kvpool_Request_append_tag, 1, &ids[0], ten, &a, &src, 0);
    lookup(1, ten, &a);
    a.cache = &reuse;
    a.skip_tokens = 8;
    cached_call(kvpool_Request_append_tag, 1, &ids[1], ten, &a, &src, 0);
    a.skip_tokens = 0;
    uint32_t two_tens[2] = {10, 10};
    static int32_t tok20[20];
    memcpy(tok20, tok, 10 * sizeof(int32_t));
    memcpy(tok20 + 10, tok, 10 * sizeof(int32_t));
    content_t a2 = {.tok = tok20, .ntok = 20, .cache = &reuse};
    uint64_t ids2[2] = {21, 23};
    cached_call(kvpool_Request_reserve_tag, 2, ids2, two_tens, &a2, NULL, 0);
    src.layer_end = 1; /* one layer: keyed, left to a Commit */
    content_t a3 = {.tok = tok + 100, .ntok = 10};
    cached_call(kvpool_Request_append_tag, 1, &ids[2], ten, &a3, &src, 0);
    commit(1, &ids[2], 0);
    q = req(kvpool_Request_unregister_buffer_tag);
    q.body.unregister_buffer.buffer_id = 1;
    put_msg(kvpool_Request_fields, &q);
    simple(kvpool_Request_stats_tag);
    put_file(dir, "cache_append_skip");

    /* pins in the shared scope: a cached prompt of 12 tokens (3 pages) pinned twice (6 of the
     * 8 pages of the quota), a third pin over the quota, a pin of what is not cached, an unpin
     * of the first pin's id (1 << 16 in a fresh process) and of an unknown id, Stats with the
     * cache's counters */
    hello_scope("ns", "fuzzshared");
    uint32_t twelve = 12;
    content_t p = {.tok = tok, .ntok = 12};
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], &twelve, &p, NULL, 0);
    commit(1, &ids[0], 0);
    batch_call(kvpool_Request_release_tag, 1, &ids[0], NULL, NULL);
    pin(tok, 12, NULL, 5000);
    pin(tok, 12, NULL, 0);
    pin(tok, 12, NULL, 5000);
    pin(tok + 500, 12, NULL, 5000);
    pin(tok, 12, "other salt", 5000);
    lookup(1, &twelve, &p);
    simple(kvpool_Request_stats_tag);
    unpin(UINT64_C(1) << 16);
    unpin(12345);
    cache_flush("fuzzshared", false);
    cache_flush("", true);
    simple(kvpool_Request_stats_tag);
    put_file(dir, "cache_pin_unpin");

    /* a forked and truncated chain: 10 keyed tokens committed, forked, the parent truncated
     * into its second page (the page is rewritten), the child grown by 6 more token ids (its
     * chain continues), committed, both released */
    hello("ns", 0);
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], ten, &a3, NULL, 0);
    commit(1, &ids[0], 0);
    q = req(kvpool_Request_fork_tag);
    q.body.fork.parent = 7;
    q.body.fork.child = 8;
    put_msg(kvpool_Request_fields, &q);
    q = req(kvpool_Request_truncate_tag);
    q.body.truncate.seq_id = 7;
    q.body.truncate.num_tokens = 5;
    put_msg(kvpool_Request_fields, &q);
    uint64_t c8 = 8;
    uint32_t six = 6;
    content_t grow = {.tok = tok + 110, .ntok = 6};
    cached_call(kvpool_Request_reserve_tag, 1, &c8, &six, &grow, NULL, 0);
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], &six, &grow, NULL, 0);
    uint64_t both[2] = {7, 8};
    commit(2, both, 0);
    lookup(1, ten, &a3);
    batch_call(kvpool_Request_release_tag, 2, both, NULL, NULL);
    simple(kvpool_Request_audit_tag);
    put_file(dir, "cache_fork_truncate");

    /* bad input, each refused with nothing changed: token ids of another count, a salt above
     * 256 bytes, salt_lens of another count, salts that do not add up, salts without token ids,
     * reuse without token ids, priority 101, a Lookup above 512 tokens, of no prompt and of 17
     * prompts (max_batch 16), a Commit with an event on the host backend, with a 3-byte event,
     * of an unknown sequence, a scope the namespace is not in, a second Hello naming another
     * scope; then a valid call */
    hello("ns", 0);
    content_t bad = {.tok = tok, .ntok = 9};
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], ten, &bad, NULL, 0);
    static uint8_t big_salt[300];
    memset(big_salt, 's', sizeof(big_salt));
    uint32_t big_len = 300;
    content_t bs = {.tok = tok,
                    .ntok = 10,
                    .salts = big_salt,
                    .salt_lens = &big_len,
                    .nsalt = 1,
                    .salt_bytes = 300};
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], ten, &bs, NULL, 0);
    uint32_t two_lens[2] = {3, 3};
    content_t bl = {.tok = tok,
                    .ntok = 10,
                    .salts = big_salt,
                    .salt_lens = two_lens,
                    .nsalt = 2,
                    .salt_bytes = 6};
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], ten, &bl, NULL, 0);
    content_t sum = {.tok = tok,
                     .ntok = 10,
                     .salts = big_salt,
                     .salt_lens = &salt_len,
                     .nsalt = 1,
                     .salt_bytes = 5};
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], ten, &sum, NULL, 0);
    content_t notok = {.salts = big_salt, .salt_lens = &salt_len, .nsalt = 1, .salt_bytes = 6};
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], ten, &notok, NULL, 0);
    content_t reuse_only = {.cache = &reuse};
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], ten, &reuse_only, NULL, 0);
    kvpool_CacheOptions p101 = {.has_priority = true, .priority = 101};
    content_t hi = {.tok = tok, .ntok = 10, .cache = &p101};
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], ten, &hi, NULL, 0);
    uint32_t many = 600;
    content_t lk = {.tok = tok, .ntok = 600};
    lookup(1, &many, &lk);
    content_t none = {.tok = tok, .ntok = 0};
    lookup(0, ten, &none);
    uint32_t seventeen[17];
    for (int i = 0; i < 17; i++)
        seventeen[i] = 2;
    content_t lk17 = {.tok = tok, .ntok = 34};
    lookup(17, seventeen, &lk17);
    content_t ok = {.tok = tok, .ntok = 10};
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], ten, &ok, NULL, 0);
    commit(1, &ids[0], 64);
    commit(1, &ids[0], 3);
    commit(1, &ids[2], 0);
    cache_flush("not-mine", false);
    hello_scope("ns", "elsewhere");
    commit(1, &ids[0], 0);
    batch_call(kvpool_Request_release_tag, 1, &ids[0], NULL, NULL);
    simple(kvpool_Request_stats_tag);
    put_file(dir, "cache_bad_input");

    /* pressure: a keyed prompt of 128 tokens (32 pages) committed and released, then plain
     * Reserves of 128 tokens that must evict cached pages, then a Lookup (what is left) */
    hello("ns", 0);
    uint32_t full = 128;
    content_t big = {.tok = tok + 200, .ntok = 128};
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], &full, &big, NULL, 0);
    commit(1, &ids[0], 0);
    batch_call(kvpool_Request_release_tag, 1, &ids[0], NULL, NULL);
    uint32_t fulls[2] = {128, 128};
    batch_call(kvpool_Request_reserve_tag, 2, &ids[1], fulls, NULL);
    lookup(1, &full, &big);
    batch_call(kvpool_Request_release_tag, 2, &ids[1], NULL, NULL);
    simple(kvpool_Request_stats_tag);
    put_file(dir, "cache_pressure");

    /* a keyed chain forked and the child truncated into its last keyed page while both hold
     * it (the page keeps its key), then the child appends token ids into it: copy-on-write;
     * the parent released last */
    hello("ns", 0);
    uint32_t eight = 8, two = 2;
    content_t k8 = {.tok = tok + 300, .ntok = 8};
    cached_call(kvpool_Request_reserve_tag, 1, &ids[0], &eight, &k8, NULL, 0);
    commit(1, &ids[0], 0);
    q = req(kvpool_Request_fork_tag);
    q.body.fork.parent = 7;
    q.body.fork.child = 8;
    put_msg(kvpool_Request_fields, &q);
    q = req(kvpool_Request_truncate_tag);
    q.body.truncate.seq_id = 8;
    q.body.truncate.num_tokens = 6;
    put_msg(kvpool_Request_fields, &q);
    content_t k2 = {.tok = tok + 320, .ntok = 2};
    cached_call(kvpool_Request_reserve_tag, 1, &c8, &two, &k2, NULL, 0);
    commit(1, &c8, 0);
    lookup(1, &eight, &k8);
    batch_call(kvpool_Request_release_tag, 2, both, NULL, NULL);
    put_file(dir, "cache_fork_truncate_shared");
    next_id = saved_id;
}

static void response_seeds(const char *dir)
{
    kvpool_Response r;
    memset(&r, 0, sizeof(r));
    r.id = 3;
    r.which_body = kvpool_Response_reserve_tag;
    r.body.reserve.has_table = true;
    int32_t indptr[3] = {0, 2, 3}, idx[3] = {0, 1, 2}, last[2] = {1, 3}, aind[3] = {0, 5, 8},
            lens[2] = {5, 3};
    uint32_t copies[2] = {1, 3};
    kvp_reply_arrays_t a = {.kv_indptr = kvp_array(indptr, 4, 3, 3),
                            .kv_indices = kvp_array(idx, 4, 3, 3),
                            .kv_last_page_len = kvp_array(last, 4, 2, 2),
                            .append_indptr = kvp_array(aind, 4, 3, 3),
                            .seq_lens = kvp_array(lens, 4, 2, 2),
                            .copies = kvp_array(copies, 8, 1, 1)};
    r.body.reserve.table.batch_size = 2;
    r.body.reserve.table.nnz = 8;
    kvp_wire_table_bind_encode(&r.body.reserve.table, &a);
    put_msg(kvpool_Response_fields, &r);
    memmove(file_buf, file_buf + 4, file_len - 4); /* a payload, no header */
    file_len -= 4;
    put_file(dir, "reserve");

    memset(&r, 0, sizeof(r));
    r.id = 4;
    r.which_body = kvpool_Response_metrics_tag;
    kvp_text_t t = {.s = "kvpool_up 1\n", .len = 12, .cap = 13};
    kvp_text_bind_encode(&r.body.metrics.text, &t);
    put_msg(kvpool_Response_fields, &r);
    memmove(file_buf, file_buf + 4, file_len - 4);
    file_len -= 4;
    put_file(dir, "metrics");

    memset(&r, 0, sizeof(r));
    r.id = 5;
    r.status.code = kvpool_Code_NOT_FOUND;
    snprintf(r.status.message, sizeof(r.status.message), "no such sequence");
    r.which_body = kvpool_Response_stats_tag;
    r.body.stats.has_stats = true;
    r.body.stats.stats.namespaces_count = 1;
    snprintf(r.body.stats.stats.namespaces[0].name, 8, "ns");
    put_msg(kvpool_Response_fields, &r);
    memmove(file_buf, file_buf + 4, file_len - 4);
    file_len -= 4;
    put_file(dir, "stats_error");

    /* issue #16: a reuse page table with cached_tokens, a Lookup answer, Pin, Unpin, Commit,
     * CacheFlush, and Stats with the cache's counters and two scopes */
    memset(&r, 0, sizeof(r));
    r.id = 6;
    r.which_body = kvpool_Response_reserve_tag;
    r.body.reserve.has_table = true;
    uint32_t cached[2] = {4, 0};
    a.cached_tokens = kvp_array(cached, 4, 2, 2);
    r.body.reserve.table.batch_size = 2;
    r.body.reserve.table.nnz = 4;
    kvp_wire_table_bind_encode(&r.body.reserve.table, &a);
    put_msg(kvpool_Response_fields, &r);
    memmove(file_buf, file_buf + 4, file_len - 4);
    file_len -= 4;
    put_file(dir, "reserve_cached");

    memset(&r, 0, sizeof(r));
    r.id = 7;
    r.which_body = kvpool_Response_lookup_tag;
    uint32_t found[3] = {16, 0, 4096};
    kvp_reply_arrays_t l = {.cached_tokens = kvp_array(found, 4, 3, 3)};
    kvp_wire_lookup_bind_encode(&r.body.lookup, &l);
    put_msg(kvpool_Response_fields, &r);
    memmove(file_buf, file_buf + 4, file_len - 4);
    file_len -= 4;
    put_file(dir, "lookup");

    memset(&r, 0, sizeof(r));
    r.id = 8;
    r.which_body = kvpool_Response_pin_tag;
    r.body.pin.pin_id = UINT64_C(1) << 16;
    r.body.pin.pinned_tokens = 48;
    r.body.pin.pinned_pages = 3;
    r.body.pin.expires_in_ms = 86400000;
    put_msg(kvpool_Response_fields, &r);
    memmove(file_buf, file_buf + 4, file_len - 4);
    file_len -= 4;
    put_file(dir, "pin");
    memset(&r, 0, sizeof(r));
    r.id = 9;
    r.which_body = kvpool_Response_unpin_tag;
    r.body.unpin.pages = 3;
    put_msg(kvpool_Response_fields, &r);
    memmove(file_buf, file_buf + 4, file_len - 4);
    file_len -= 4;
    put_file(dir, "unpin");

    memset(&r, 0, sizeof(r));
    r.id = 10;
    r.which_body = kvpool_Response_commit_tag;
    r.body.commit.pages = 5;
    r.body.commit.published = 4;
    put_msg(kvpool_Response_fields, &r);
    memmove(file_buf, file_buf + 4, file_len - 4);
    file_len -= 4;
    put_file(dir, "commit");

    memset(&r, 0, sizeof(r));
    r.id = 11;
    r.which_body = kvpool_Response_cache_flush_tag;
    r.body.cache_flush.pages = 17;
    put_msg(kvpool_Response_fields, &r);
    memmove(file_buf, file_buf + 4, file_len - 4);
    file_len -= 4;
    put_file(dir, "cache_flush");

    memset(&r, 0, sizeof(r));
    r.id = 12;
    r.which_body = kvpool_Response_stats_tag;
    r.body.stats.has_stats = true;
    kvpool_Stats *st = &r.body.stats.stats;
    st->num_pages = 64;
    st->has_cache = true;
    st->cache.cached_pages = 10;
    st->cache.pinned_pages = 3;
    st->cache.indexed_pages = 12;
    st->cache.pins = 1;
    st->cache.query_tokens_total = 1000;
    st->cache.hit_tokens_total = 640;
    st->cache.evictions_pressure_total = 7;
    st->cache.evictions_flush_total = 2;
    st->cache.evictions_rewrite_total = 1;
    st->cache.bytes = 4096;
    st->cache.scopes_count = 2;
    snprintf(st->cache.scopes[0].name, sizeof(st->cache.scopes[0].name), "ns:ns");
    st->cache.scopes[0].uid = 1000;
    st->cache.scopes[0].namespaces = 1;
    st->cache.scopes[0].cached_pages = 4;
    snprintf(st->cache.scopes[1].name, sizeof(st->cache.scopes[1].name), "fuzzshared");
    st->cache.scopes[1].namespaces = 2;
    st->cache.scopes[1].indexed_pages = 8;
    st->cache.scopes[1].query_tokens = 100;
    st->cache.scopes[1].hit_tokens = 64;
    put_msg(kvpool_Response_fields, &r);
    memmove(file_buf, file_buf + 4, file_len - 4);
    file_len -= 4;
    put_file(dir, "stats_cache");
}

/* fuzz_rpc inputs of issue #15 defect 1: Appends whose source offsets and strides overflow
 * 64-bit products or zero them (one token, one layer), each after a RegisterBuffer of 4 KiB;
 * then the valid Append, so the buffer and the session are still in use afterwards. */
static void hostile_rpc_seeds(const char *dir)
{
    uint64_t seq = 7;
    uint32_t one = 1;
    hello("ns", 0);
    kvpool_Request q = req(kvpool_Request_register_buffer_tag);
    q.body.register_buffer.kind = kvpool_BufferKind_BUFFER_MEMFD;
    q.body.register_buffer.size_bytes = 4096;
    put_msg(kvpool_Request_fields, &q);
    /* one token, 2 heads of 16 fp16, 2 layers: K at 0, V at 64 */
    const kvpool_Source ok = {.buffer_id = 1,
                              .v_offset = 64,
                              .k_stride_n = 64,
                              .k_stride_h = 32,
                              .v_stride_n = 64,
                              .v_stride_h = 32,
                              .layer_stride = 128};
    kvpool_Source src = ok;
    src.k_stride_n = UINT64_MAX - 1; /* the Append: (nnz - 1) * stride == 0 */
    batch_call(kvpool_Request_append_tag, 1, &seq, &one, &src);
    src = ok;
    src.layer_end = 1;
    src.layer_stride = UINT64_C(1) << 63; /* one layer: (layers - 1) * stride == 0 */
    batch_call(kvpool_Request_append_tag, 1, &seq, &one, &src);
    src = ok;
    src.v_offset = UINT64_MAX - 31; /* the end wraps past 2^64 */
    batch_call(kvpool_Request_append_tag, 1, &seq, &one, &src);
    src = ok;
    src.k_stride_h = UINT64_C(1) << 63; /* (heads - 1) * stride == 2^63 */
    batch_call(kvpool_Request_append_tag, 1, &seq, &one, &src);
    src = ok;
    src.v_stride_n = UINT64_MAX - 1;
    batch_call(kvpool_Request_append_tag, 1, &seq, &one, &src);
    batch_call(kvpool_Request_append_tag, 1, &seq, &one, &ok);
    simple(kvpool_Request_stats_tag);
    put_file(dir, "hostile_strides");
}

/* fuzz_rpc inputs of issue #15 defect 2: Hellos whose names are not UTF-8 or leave the
 * documented character set (each refused), then a valid Hello and Stats and ListClients,
 * whose answers must stay valid UTF-8. */
static void hostile_names_seed(const char *dir)
{
    static const char *const bad[] = {"\xff\xfe", "a b", "k=v", "\xc0\x80", "quo\"te"};
    for (unsigned i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        hello(bad[i], 0);
    kvpool_Request q = req(kvpool_Request_hello_tag);
    q.body.hello.protocol_version = KVP_PROTOCOL_VERSION;
    snprintf(q.body.hello.namespace, sizeof(q.body.hello.namespace), "ns");
    snprintf(q.body.hello.client_name, sizeof(q.body.hello.client_name), "\xed\xa0\x80");
    put_msg(kvpool_Request_fields, &q);
    hello("ns", 0);
    simple(kvpool_Request_stats_tag);
    simple(kvpool_Request_list_clients_tag);
    put_file(dir, "hostile_names");
}

/* fuzz_kernel inputs: geometry bytes, flags, then the tables (see fuzz_kernel.c). */
static void kernel_seeds(const char *dir)
{
    /* eb 2, 4 pages, page 4, 2 heads, dim 8, NHD; flags: indptr[0] = 0, small indices */
    const uint8_t valid[] = {0x0d, 0x0b, 0x07, 0x05, 2,
                             /* indptr: 0, 2, 3 (mode 3 = small) */
                             3, 0, 3, 2, 3, 3,
                             /* last page lens */
                             3, 1};
    memcpy(file_buf, valid, sizeof(valid));
    file_len = sizeof(valid);
    for (int i = 0; i < 128; i++)
        file_buf[file_len++] = (uint8_t)(i % 4);
    const uint8_t tail[] = {/* nnz 4: (b, pos) */ 4,
                            1,
                            0,
                            1,
                            1,
                            1,
                            2,
                            2,
                            0,
                            /* cap 4, append indptr 0 2 4, seq lens 3 1 */ 4,
                            0,
                            2,
                            4,
                            3,
                            1,
                            /* 2 copies: 0->3, 1->2 */ 2,
                            0,
                            3,
                            1,
                            2};
    memcpy(file_buf + file_len, tail, sizeof(tail));
    file_len += sizeof(tail);
    put_file(dir, "valid_append");

    const uint8_t extreme[] = {0x3e, 0xff, 0xff, 0xff, 16,   0, 1, 1, 1, 2, 0, 0xff, 0xff, 0xff,
                               0x7f, 0,    0,    0,    0x80, 1, 2, 3, 4, 5, 6, 7,    8};
    memcpy(file_buf, extreme, sizeof(extreme));
    file_len = sizeof(extreme);
    put_file(dir, "extreme");
}

/* fuzz_kernel inputs with a hostile stride (bit 6 of the first byte, see fuzz_kernel.c): the
 * valid append's layer (with `heads` heads) and table, then [which stride][8 bytes x]
 * (stride = 2^62 + x mod 2^62 elements of fp16: a byte step of 2^63 or more), then nnz tokens.
 * One token or one head is the case the old checks missed: the stride's count is 1. */
static void hostile_kernel_seed(const char *dir, const char *name, uint8_t which, uint64_t x,
                                uint8_t nnz, uint8_t heads)
{
    const uint8_t g1 = (uint8_t)(0x03 | (heads - 1) << 3); /* page size 4 */
    const uint8_t head[] = {0x0d | 0x40, g1, 0x07, 0x05, 2, 3, 0, 3, 2, 3, 3, 3, 1};
    memcpy(file_buf, head, sizeof(head));
    file_len = sizeof(head);
    for (int i = 0; i < 128; i++)
        file_buf[file_len++] = (uint8_t)(i % 4);
    file_buf[file_len++] = which;
    for (int i = 0; i < 8; i++)
        file_buf[file_len++] = (uint8_t)(x >> (8 * i));
    /* nnz tokens, (b + 1, pos): (0, 0), (0, 1), (0, 2), (1, 0) as in valid_append */
    const uint8_t tokens[] = {1, 0, 1, 1, 1, 2, 2, 0};
    file_buf[file_len++] = nnz;
    memcpy(file_buf + file_len, tokens, 2u * nnz);
    file_len += 2u * nnz;
    /* cap 4, append indptr 0 2 4, seq lens 3 1; 1 copy: 0->3 */
    const uint8_t tail[] = {4, 0, 2, 4, 3, 1, 1, 0, 3};
    memcpy(file_buf + file_len, tail, sizeof(tail));
    file_len += sizeof(tail);
    put_file(dir, name);
}

static void hostile_kernel_seeds(const char *dir)
{
    const uint64_t top = (UINT64_C(1) << 62) - 1; /* stride INT64_MAX: 2^64 - 2 bytes */
    hostile_kernel_seed(dir, "hostile_k_stride_n_one_token", 0, top, 1, 2);
    hostile_kernel_seed(dir, "hostile_v_stride_h_one_head", 3, 0, 4, 1);
    hostile_kernel_seed(dir, "hostile_pool_stride_h_one_head", 6, 0, 1, 1);
    hostile_kernel_seed(dir, "hostile_pool_stride_page", 4, top, 4, 2);
}

/* fuzz_frame scripts: [max byte][grow byte] then ops: a chunk (op & 0x3f) + 1 bytes long with
 * op >> 6 fds attached, followed by its bytes; 0xf0 cuts the frames received so far. */
static uint8_t script[1 << 16];
static size_t script_len;

static void script_begin(uint8_t max_byte, uint8_t grow_byte)
{
    script_len = 0;
    script[script_len++] = max_byte;
    script[script_len++] = grow_byte;
}

/* Delivers n bytes in chunks of `piece` bytes (<= 64), nfds fds on the first chunk. */
static void script_bytes(const uint8_t *b, size_t n, size_t piece, int nfds)
{
    for (size_t off = 0; off < n; off += piece) {
        size_t k = n - off < piece ? n - off : piece;
        script[script_len++] = (uint8_t)(((off == 0 ? nfds : 0) << 6) | (k - 1));
        memcpy(script + script_len, b + off, k);
        script_len += k;
    }
}

static void script_cut(void)
{
    script[script_len++] = 0xf0;
}

static void script_put(const char *dir, const char *name)
{
    memcpy(file_buf, script, script_len);
    file_len = script_len;
    put_file(dir, name);
}

static void frame_seeds(const char *dir)
{
    /* a real session's first frames: Hello, then a RegisterBuffer that carries one fd */
    file_len = 0;
    hello("seed", 0);
    size_t hello_len = file_len;
    uint8_t hello_frame[512];
    memcpy(hello_frame, file_buf, hello_len);
    file_len = 0;
    kvpool_Request q = req(kvpool_Request_register_buffer_tag);
    q.body.register_buffer.size_bytes = 4096;
    put_msg(kvpool_Request_fields, &q);
    uint8_t reg_frame[512];
    size_t reg_len = file_len;
    memcpy(reg_frame, file_buf, reg_len);
    file_len = 0;

    script_begin(254, 63); /* max 255 bytes, grow 64 */
    script_bytes(hello_frame, hello_len, 64, 0);
    script_cut();
    script_bytes(reg_frame, reg_len, 64, 1);
    script_cut();
    script_put(dir, "hello_register");

    script_begin(254, 0); /* grow 1: byte by byte, cutting after each */
    for (size_t i = 0; i < hello_len; i++) {
        script_bytes(hello_frame + i, 1, 1, i == 0);
        script_cut();
    }
    script_put(dir, "byte_by_byte");

    /* pipelined: three frames in one chunk, fds on the first, then one cut */
    uint8_t three[192];
    size_t n3 = 0;
    for (int k = 0; k < 3; k++) {
        memcpy(three + n3, reg_frame, reg_len);
        n3 += reg_len;
    }
    script_begin(254, 15);
    script_bytes(three, n3, 64, 3);
    script_cut();
    script_put(dir, "pipelined");

    /* empty frames, then an oversize header */
    uint8_t empty[8] = {0};
    uint8_t big[4];
    kvp_frame_put_len(big, 300);
    script_begin(254, 3);
    script_bytes(empty, 8, 8, 0);
    script_cut();
    script_bytes(big, 4, 4, 2);
    script_cut();
    script_put(dir, "empty_then_oversize");

    /* the largest frame (4 KiB mode) with a full buffer in between */
    static uint8_t large[4100];
    kvp_frame_put_len(large, 4096);
    for (int i = 4; i < 4100; i++)
        large[i] = (uint8_t)i;
    script_begin(255, 63);
    script_bytes(large, sizeof(large), 64, 1);
    script_bytes(hello_frame, hello_len, 32, 1);
    script_cut();
    script_put(dir, "largest_frame");
}

/* fuzz_http: request heads as a connection reads them (raw bytes, no framing). */
static void put_head(const char *dir, const char *name, const char *head, size_t len)
{
    memcpy(file_buf, head, len);
    file_len = len;
    put_file(dir, name);
}

#define PUT_HEAD(dir, name, lit) put_head(dir, name, lit, sizeof(lit) - 1)

static void http_seeds(const char *dir)
{
    PUT_HEAD(dir, "get_metrics",
             "GET /metrics HTTP/1.1\r\nHost: localhost:9464\r\nUser-Agent: Prometheus/2.45.0\r\n"
             "Accept: text/plain;version=0.0.4;q=1,*/*;q=0.1\r\nAccept-Encoding: gzip\r\n"
             "X-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n");
    PUT_HEAD(dir, "head_query_lf", "\r\nHEAD /metrics?name[]=kvpool_up HTTP/1.0\nAccept: */*\n\n");
    PUT_HEAD(dir, "curl",
             "GET /metrics HTTP/1.1\r\nHost: [::1]:9464\r\nUser-Agent: curl/7.88.1\r\n"
             "Accept: */*\r\n\r\n");
    PUT_HEAD(dir, "not_found", "GET /metricsx HTTP/1.1\r\nHost: x\r\n\r\n");
    PUT_HEAD(dir, "post", "POST /metrics HTTP/1.1\r\nContent-Length: 4\r\n\r\nbody");
    PUT_HEAD(dir, "bad_header", "GET /metrics HTTP/1.1\r\nBad Name: x\r\nX: a\tb\x01\r\n\r\n");
    PUT_HEAD(dir, "version_2", "GET /metrics HTTP/2.0\r\n\r\n");
    PUT_HEAD(dir, "incomplete", "GET /metrics HTTP/1.1\r\nHost: x\r\n\r");
    PUT_HEAD(dir, "absolute_form", "GET http://h/metrics HTTP/1.1\r\n\r\n");
    static const char nul[] = "GET /metrics HTTP/1.1\r\nX: a\0b\r\n\r\n";
    put_head(dir, "nul_in_header", nul, sizeof(nul) - 1);
    PUT_HEAD(dir, "pipelined", "GET /metrics HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n");
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: make_seeds CORPUS_DIR\n");
        return 2;
    }
    char d[512];
    snprintf(d, sizeof(d), "%s/fuzz_rpc", argv[1]);
    rpc_seeds(d);
    hostile_rpc_seeds(d);
    hostile_names_seed(d);
    cache_rpc_seeds(d);
    snprintf(d, sizeof(d), "%s/fuzz_response", argv[1]);
    response_seeds(d);
    snprintf(d, sizeof(d), "%s/fuzz_kernel", argv[1]);
    kernel_seeds(d);
    hostile_kernel_seeds(d);
    snprintf(d, sizeof(d), "%s/fuzz_frame", argv[1]);
    frame_seeds(d);
    snprintf(d, sizeof(d), "%s/fuzz_http", argv[1]);
    http_seeds(d);
    return 0;
}
