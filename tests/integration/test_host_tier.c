/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_host_tier.c - integration, issue #28: the prefix cache's host tier on a real kvpoold
 * (host backend: the tier is a second memfd) with real clients. A prompt appended by the daemon
 * (token ids, a source buffer whose every element encodes its token, layer, head, K|V and
 * column) is released, pushed out of the GPU pool by other sequences until the background
 * demoter moved it to host memory, found there by Lookup, and restored by a Load and by a
 * Reserve with reuse: the bytes a Load writes must be the appended ones exactly. Then pressure
 * on both tiers (host evictions, final), Load's bad input (each refused with its status, nothing
 * changed: counters, pool, the buffer's bytes), a worker killed while its restore runs, and a
 * SIGTERM with demotions in flight. Every case ends with the daemon's Audit (which covers the
 * host tier) and a clean exit.
 */
#include <check.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_harness.h"
#include "kvp_raw.h"
#include "kvpool.h"

/* the geometry of a daemon of this file */
typedef struct {
    unsigned layers, heads, dim, ps, pages;
} geo_t;

static const geo_t SMALL = {.layers = 2, .heads = 2, .dim = 16, .ps = 4, .pages = 64};

static kvp_daemon_t DMN;

static void start(const geo_t *g, const char *host_bytes, const char *free_pct)
{
    char layers[16], heads[16], dim[16], ps[16], pages[16];
    snprintf(layers, sizeof(layers), "%u", g->layers);
    snprintf(heads, sizeof(heads), "%u", g->heads);
    snprintf(dim, sizeof(dim), "%u", g->dim);
    snprintf(ps, sizeof(ps), "%u", g->ps);
    snprintf(pages, sizeof(pages), "%u", g->pages);
    char hb[64], fp[64];
    snprintf(hb, sizeof(hb), "cache.host_bytes=%s", host_bytes);
    snprintf(fp, sizeof(fp), "cache.demote_free_pct=%s", free_pct);
    const char *args[] = {"--backend",
                          "host",
                          "--num-layers",
                          layers,
                          "--num-kv-heads",
                          heads,
                          "--head-dim",
                          dim,
                          "--page-size",
                          ps,
                          "--num-pages",
                          pages,
                          "--dtype",
                          "fp16",
                          "--set",
                          hb,
                          "--set",
                          fp,
                          "--set",
                          "cache.host_chunk_bytes=1MiB",
                          NULL};
    ck_assert_int_eq(kvp_daemon_start(&DMN, args), 0);
}

static void stop(void)
{
    ck_assert_int_eq(kvp_daemon_stop(&DMN, SIGTERM), 0);
}

static kvp_client_t *connect_ns(const char *ns, uint32_t lease_ms)
{
    kvp_client_opts_t o = {
        .socket_path = DMN.sock, .ns = ns, .lease_ms = lease_ms, .cache_scope = "tier"};
    kvp_client_t *c = NULL;
    char err[256];
    ck_assert_msg(kvp_client_connect(&o, &c, err, sizeof(err)) == 0, "connect: %s", err);
    return c;
}

static kvp_client_t *observer(void)
{
    kvp_client_opts_t o = {.socket_path = DMN.sock, .observer = 1};
    kvp_client_t *c = NULL;
    char err[256];
    ck_assert_msg(kvp_client_connect(&o, &c, err, sizeof(err)) == 0, "connect: %s", err);
    return c;
}

static void audit(kvp_client_t *c)
{
    int ok = 0;
    char msg[512];
    ck_assert_int_eq(kvp_client_audit_report(c, &ok, msg, sizeof(msg)), 0);
    ck_assert_msg(ok, "audit: %s", msg);
}

/* ---- sources: every fp16 element says where it belongs ----------------------------------------
 */

/* The layout of a buffer of T tokens: per layer K [T][H][D] then V [T][H][D]. */
static kvp_source_t layout(const geo_t *g, uint32_t buffer_id, uint32_t T)
{
    const uint64_t row = (uint64_t)g->dim * 2, tok = row * g->heads;
    kvp_source_t s = {.buffer_id = buffer_id};
    s.k_offset = 0;
    s.v_offset = tok * T;
    s.k_stride_n = s.v_stride_n = tok;
    s.k_stride_h = s.v_stride_h = row;
    s.layer_stride = 2 * tok * T;
    return s;
}

static uint64_t buf_bytes(const geo_t *g, uint32_t T)
{
    return (uint64_t)g->layers * 2 * T * g->heads * g->dim * 2;
}

static uint16_t elem(uint32_t prompt, uint32_t t, uint32_t l, uint32_t h, uint32_t kv, uint32_t d)
{
    uint32_t x = prompt * 2654435761u ^ t * 40503u ^ l * 7919u ^ h * 104729u ^ kv * 1299709u ^ d;
    x ^= x >> 13;
    return (uint16_t)(x * 2246822519u >> 16);
}

static void fill(const geo_t *g, uint16_t *buf, uint32_t prompt, uint32_t T)
{
    size_t i = 0;
    for (uint32_t l = 0; l < g->layers; l++)
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t t = 0; t < T; t++)
                for (uint32_t h = 0; h < g->heads; h++)
                    for (uint32_t d = 0; d < g->dim; d++)
                        buf[i++] = elem(prompt, t, l, h, kv, d);
}

/* The first mismatch of buf (T tokens laid out by layout()) against prompt's first n tokens,
 * or -1. */
static long check(const geo_t *g, const uint16_t *buf, uint32_t prompt, uint32_t T, uint32_t n)
{
    size_t i = 0;
    for (uint32_t l = 0; l < g->layers; l++)
        for (uint32_t kv = 0; kv < 2; kv++)
            for (uint32_t t = 0; t < T; t++)
                for (uint32_t h = 0; h < g->heads; h++)
                    for (uint32_t d = 0; d < g->dim; d++, i++)
                        if (t < n && buf[i] != elem(prompt, t, l, h, kv, d))
                            return (long)i;
    return -1;
}

static void tokens(int32_t *tok, uint32_t prompt, uint32_t T)
{
    for (uint32_t i = 0; i < T; i++)
        tok[i] = (int32_t)(prompt * 100000 + i);
}

/* A daemon-run Append of prompt's T tokens as sequence seq, with token ids (findable at once),
 * or, for prompt 0 (a filler), without: its pages go straight back to the free stack when it is
 * released, so only the prompts a case names are ever cached or demoted. */
static void append_prompt(kvp_client_t *c, const geo_t *g, uint16_t *buf, uint32_t buffer_id,
                          uint64_t seq, uint32_t prompt, uint32_t T)
{
    static int32_t tok[4096];
    ck_assert_uint_le(T, 4096);
    tokens(tok, prompt, T);
    fill(g, buf, prompt, T);
    kvp_source_t src = layout(g, buffer_id, T);
    kvp_cache_opts_t co = {.token_ids = tok, .priority = -1};
    ck_assert_msg(kvp_client_append_cached(c, &seq, &T, 1, &src, prompt ? &co : NULL, NULL) == 0,
                  "append: %s", kvp_client_last_error(c));
}

static void release(kvp_client_t *c, uint64_t seq)
{
    uint32_t n = 0;
    ck_assert_int_eq(kvp_client_release(c, &seq, 1, &n), 0);
    ck_assert_uint_eq(n, 1);
}

static void lookup(kvp_client_t *c, uint32_t prompt, uint32_t T, uint32_t *gpu, uint32_t *host)
{
    int32_t tok[4096];
    tokens(tok, prompt, T);
    ck_assert_int_eq(kvp_client_lookup_tiers(c, tok, &T, 1, NULL, NULL, gpu, host), 0);
}

typedef struct {
    kvp_client_t *obs;
    uint32_t host_pages;
    uint64_t demotions; /* and at least this many demotions done */
} wait_host_t;

static int host_pages_reached(void *arg)
{
    wait_host_t *w = arg;
    kvp_cache_stats_t st;
    if (kvp_client_cache_stats(w->obs, &st))
        return 0;
    return st.host_pages >= w->host_pages && st.demotions_total >= w->demotions && st.demoting == 0;
}

static kvp_cache_stats_t cache_stats(kvp_client_t *c)
{
    kvp_cache_stats_t st;
    ck_assert_int_eq(kvp_client_cache_stats(c, &st), 0);
    return st;
}

/* Prompt 1 (8 pages) cached, then moved to the host tier by the demoter: fillers hold all but
 * 8 pages of the pool, under the 25% watermark, so the only cached pages (prompt 1's) go. */
static void demote_prompt1(kvp_client_t *c, kvp_client_t *obs, uint16_t *buf, uint32_t bid)
{
    const geo_t *g = &SMALL;
    append_prompt(c, g, buf, bid, 1, 1, 32);
    release(c, 1);
    for (uint32_t i = 0; i < 6; i++) /* 48 pages held by sequences 100.. */
        append_prompt(c, g, buf, bid, 100 + i, 0, 32);
    wait_host_t w = {obs, 8, 8};
    kvp_wait_until(host_pages_reached, &w, 5000);
    kvp_cache_stats_t st = cache_stats(obs);
    ck_assert_uint_eq(st.host_pages, 8);
    ck_assert_uint_ge(st.demotions_total, 8);
    for (uint32_t i = 0; i < 6; i++)
        release(c, 100 + i); /* no pressure from here on: nothing demotes again */
}

START_TEST(test_demote_lookup_load_exact)
{
    const geo_t *g = &SMALL;
    start(g, "64KiB", "25"); /* 64 slots of 1 KiB */
    kvp_client_t *c = connect_ns("w1", KVP_LEASE_DEFAULT), *obs = observer();
    uint16_t *buf;
    uint32_t bid, out_id;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, buf_bytes(g, 32), (void **)&buf, &bid), 0);
    uint16_t *out;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, buf_bytes(g, 32), (void **)&out, &out_id), 0);
    kvp_cache_stats_t st0 = cache_stats(obs);
    ck_assert_uint_eq(st0.host_slot_bytes, 2 * 2 * 4 * 2 * 16 * 2);
    ck_assert_uint_eq(st0.host_bytes_total, 64 * 1024);
    demote_prompt1(c, obs, buf, bid);
    uint32_t gpu = 99, host = 99;
    lookup(c, 1, 32, &gpu, &host);
    ck_assert_uint_eq(gpu, 0);
    ck_assert_uint_eq(host, 32);
    lookup(c, 1, 30, &gpu, &host); /* whole pages only */
    ck_assert_uint_eq(gpu, 0);
    ck_assert_uint_eq(host, 28);
    audit(obs);

    /* Load: restored, then copied where an Append would read; the bytes of prompt 1 exactly */
    memset(out, 0xA5, buf_bytes(g, 32));
    int32_t tok[32];
    tokens(tok, 1, 32);
    kvp_source_t dst = layout(g, out_id, 32);
    kvp_load_t ld = {0};
    ck_assert_msg(kvp_client_load(c, tok, 32, NULL, 0, &dst, 0, &ld) == 0, "load: %s",
                  kvp_client_last_error(c));
    ck_assert_uint_eq(ld.loaded_tokens, 32);
    ck_assert_uint_eq(ld.host_tokens, 32);
    ck_assert_int_eq(ld.completed, 1);
    ck_assert_int_eq(check(g, out, 1, 32, 32), -1);
    kvp_cache_stats_t st = cache_stats(obs);
    ck_assert_uint_eq(st.host_pages, 0);
    ck_assert_uint_eq(st.promotions_total, 8);
    ck_assert_uint_eq(st.restore_bytes_total, 8ull * st.host_slot_bytes);
    lookup(c, 1, 32, &gpu, &host); /* back on the GPU */
    ck_assert_uint_eq(gpu, 32);
    ck_assert_uint_eq(host, 0);
    audit(obs);

    /* out again, then a Reserve with reuse restores it: its table links all 8 pages; a Load
     * (a GPU hit now) reads them back exactly */
    uint64_t seq = 7;
    for (uint32_t i = 0; i < 6; i++)
        append_prompt(c, g, buf, bid, 100 + i, 0, 32);
    wait_host_t w = {obs, 8, 16};
    kvp_wait_until(host_pages_reached, &w, 5000);
    ck_assert_uint_eq(cache_stats(obs).host_pages, 8);
    for (uint32_t i = 0; i < 6; i++)
        release(c, 100 + i);
    uint32_t T = 32;
    kvp_cache_opts_t co = {.token_ids = tok, .reuse = 1, .priority = -1};
    kvp_page_table_t pt = {0};
    uint32_t cached[1] = {0};
    pt.cached_tokens = cached;
    pt.cap_batch = 2;
    ck_assert_msg(kvp_client_reserve_cached(c, &seq, &T, 1, &co, &pt) == 0, "reserve: %s",
                  kvp_client_last_error(c));
    ck_assert_uint_eq(cached[0], 32);
    ck_assert_uint_eq(pt.nnz, 0);
    memset(out, 0x5A, buf_bytes(g, 32));
    ck_assert_int_eq(kvp_client_load(c, tok, 32, NULL, 0, &dst, 16, &ld), 0);
    ck_assert_uint_eq(ld.loaded_tokens, 16); /* max_tokens */
    ck_assert_uint_eq(ld.host_tokens, 0);
    ck_assert_int_eq(check(g, out, 1, 32, 16), -1);
    ck_assert_uint_eq(out[buf_bytes(g, 32) / 2 - 1], 0x5A5A); /* token 31 not written */
    release(c, seq);
    audit(obs);
    kvp_client_close(c);
    kvp_client_close(obs);
    stop();
}
END_TEST

/* Both tiers under pressure: a host tier of 16 slots behind a pool of 64 pages. Prompts of 8
 * pages are appended and released one after the other while 6 held fillers keep the pool
 * under its watermark: each released prompt is demoted, the host tier holds the last two and
 * drops older ones for good (oldest first at one priority), and what is dropped is a miss in
 * both tiers. Audited after every step. */
START_TEST(test_pressure_both_tiers)
{
    const geo_t *g = &SMALL;
    start(g, "16KiB", "25");
    kvp_client_t *c = connect_ns("w1", KVP_LEASE_DEFAULT), *obs = observer();
    uint16_t *buf;
    uint32_t bid;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, buf_bytes(g, 32), (void **)&buf, &bid), 0);
    for (uint32_t i = 0; i < 6; i++)
        append_prompt(c, g, buf, bid, 100 + i, 0, 32);
    for (uint32_t p = 1; p <= 5; p++) {
        append_prompt(c, g, buf, bid, p, p, 32);
        release(c, p);
        wait_host_t w = {obs, p < 2 ? 8 * p : 16, 8ull * p};
        kvp_wait_until(host_pages_reached, &w, 5000);
        kvp_cache_stats_t st = cache_stats(obs);
        ck_assert_uint_eq(st.host_pages, p < 2 ? 8 * p : 16);
        ck_assert_uint_eq(st.demotions_total, 8ull * p);
        ck_assert_uint_eq(st.host_evictions_total, p <= 2 ? 0 : 8ull * (p - 2));
        audit(obs);
    }
    uint32_t gpu, host;
    for (uint32_t p = 1; p <= 5; p++) {
        lookup(c, p, 32, &gpu, &host);
        ck_assert_uint_eq(gpu, 0);
        ck_assert_uint_eq(host, p >= 4 ? 32 : 0); /* 1..3 dropped for good, 4 and 5 kept */
    }
    char text[1 << 16];
    size_t len = 0;
    ck_assert_int_eq(kvp_client_metrics(obs, text, sizeof(text), &len), 0);
    ck_assert_ptr_nonnull(
        strstr(text, "kvpool_prefix_cache_pages{tier=\"host\",state=\"indexed\"} 16\n"));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_tier_pages_total{direction=\"offload\"} 40\n"));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_tier_host_evictions_total 24\n"));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_tier_bytes_total{direction=\"offload\"} 40960\n"));
    ck_assert_ptr_nonnull(strstr(text, "kvpool_tier_host_bytes{state=\"used\"} 16384\n"));
    audit(obs);
    kvp_client_close(c);
    kvp_client_close(obs);
    stop();
}
END_TEST

/* Load's bad input: each refused with its status, and nothing changes: the cache's counters,
 * the host tier, the destination's bytes. */
START_TEST(test_load_bad_input)
{
    const geo_t *g = &SMALL;
    start(g, "64KiB", "25");
    kvp_client_t *c = connect_ns("w1", KVP_LEASE_DEFAULT), *obs = observer();
    uint16_t *buf, *out;
    uint32_t bid, out_id;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, buf_bytes(g, 32), (void **)&buf, &bid), 0);
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, buf_bytes(g, 32), (void **)&out, &out_id), 0);
    demote_prompt1(c, obs, buf, bid);
    memset(out, 0xC3, buf_bytes(g, 32));
    kvp_cache_stats_t before = cache_stats(obs);
    kvp_stats_summary_t sb;
    ck_assert_int_eq(kvp_client_stats(obs, &sb), 0);
    int32_t tok[32], other[32];
    tokens(tok, 1, 32);
    tokens(other, 77, 32);
    kvp_source_t dst = layout(g, out_id, 32);
    kvp_load_t ld = {.loaded_tokens = 1234};
    /* a prompt nothing of which is cached */
    ck_assert_int_eq(kvp_client_load(c, other, 32, NULL, 0, &dst, 0, &ld), KVP_ENOENT);
    /* prompt 1 under another salt: another chain */
    ck_assert_int_eq(kvp_client_load(c, tok, 32, "s", 1, &dst, 0, &ld), KVP_ENOENT);
    /* a buffer of this connection that does not exist */
    kvp_source_t bad = dst;
    bad.buffer_id = 999;
    ck_assert_int_eq(kvp_client_load(c, tok, 32, NULL, 0, &bad, 0, &ld), KVP_ENOENT);
    /* too small for 32 tokens: a layout for 64 reaches past its end */
    bad = layout(g, out_id, 64);
    ck_assert_int_eq(kvp_client_load(c, tok, 32, NULL, 0, &bad, 0, &ld), KVP_EINVAL);
    /* an offset out of range, a stride not a whole element, layers beyond the pool's */
    bad = dst;
    bad.k_offset = buf_bytes(g, 32);
    ck_assert_int_eq(kvp_client_load(c, tok, 32, NULL, 0, &bad, 0, &ld), KVP_EINVAL);
    bad = dst;
    bad.k_stride_n += 1;
    ck_assert_int_eq(kvp_client_load(c, tok, 32, NULL, 0, &bad, 0, &ld), KVP_EINVAL);
    bad = dst;
    bad.layer_begin = 1, bad.layer_end = 3;
    ck_assert_int_eq(kvp_client_load(c, tok, 32, NULL, 0, &bad, 0, &ld), KVP_EINVAL);
    /* a buffer the daemon may only read: a memfd sealed against writes */
    int fd = kvp_raw_sealed_memfd(buf_bytes(g, 32));
    ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), 0);
    uint32_t ro_id;
    ck_assert_int_eq(kvp_client_register_fd(c, fd, 0, buf_bytes(g, 32), &ro_id), 0);
    bad = layout(g, ro_id, 32);
    ck_assert_int_eq(kvp_client_load(c, tok, 32, NULL, 0, &bad, 0, &ld), KVP_EPRECOND);
    close(fd);
    ck_assert_uint_eq(ld.loaded_tokens, 1234); /* never written by a refusal */
    for (size_t i = 0; i < buf_bytes(g, 32) / 2; i++)
        ck_assert_uint_eq(out[i], 0xC3C3);
    kvp_cache_stats_t after = cache_stats(obs);
    ck_assert_uint_eq(after.host_pages, before.host_pages);
    ck_assert_uint_eq(after.promotions_total, before.promotions_total);
    ck_assert_uint_eq(after.query_tokens_total, before.query_tokens_total);
    ck_assert_uint_eq(after.host_hit_tokens_total, before.host_hit_tokens_total);
    kvp_stats_summary_t sa;
    ck_assert_int_eq(kvp_client_stats(obs, &sa), 0);
    ck_assert_uint_eq(sa.free_pages, sb.free_pages);
    ck_assert_uint_eq(sa.num_seqs, sb.num_seqs);
    audit(obs);
    kvp_client_close(c);
    kvp_client_close(obs);
    stop();
}
END_TEST

/* cache.host_bytes on a reload (SIGHUP): lowered, the entries beyond the new slots go for good
 * and the tier uses only those slots; raised above the start's, it stays at the start's. */
static void write_conf(const char *path, const char *host_bytes)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f, "[cache]\nhost_bytes = %s\ndemote_free_pct = 25\nhost_chunk_bytes = 1MiB\n",
            host_bytes);
    ck_assert_int_eq(fclose(f), 0);
}

typedef struct {
    kvp_client_t *obs;
    uint32_t slots;
} wait_slots_t;

static int slots_are(void *arg)
{
    wait_slots_t *w = arg;
    kvp_cache_stats_t st;
    return kvp_client_cache_stats(w->obs, &st) == 0 && st.host_slots == w->slots;
}

START_TEST(test_reload_lowers_host_bytes)
{
    const geo_t *g = &SMALL;
    char conf[] = "/tmp/kvpool-tier-conf-XXXXXX";
    int cfd = mkstemp(conf);
    ck_assert_int_ge(cfd, 0);
    close(cfd);
    write_conf(conf, "64KiB");
    const char *args[] = {
        "--backend",   "host", "--num-layers", "2",  "--num-kv-heads", "2",    "--head-dim", "16",
        "--page-size", "4",    "--num-pages",  "64", "--dtype",        "fp16", "--config",   conf,
        NULL};
    ck_assert_int_eq(kvp_daemon_start(&DMN, args), 0);
    kvp_client_t *c = connect_ns("w1", KVP_LEASE_DEFAULT), *obs = observer();
    uint16_t *buf;
    uint32_t bid;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, buf_bytes(g, 32), (void **)&buf, &bid), 0);
    demote_prompt1(c, obs, buf, bid); /* 8 pages in host memory, no pressure after */
    wait_slots_t w = {obs, 64};
    kvp_wait_until(slots_are, &w, 5000);
    ck_assert_uint_eq(cache_stats(obs).host_slots, 64);

    write_conf(conf, "4KiB"); /* 4 slots of 1 KiB */
    ck_assert_int_eq(kill(DMN.pid, SIGHUP), 0);
    w.slots = 4;
    kvp_wait_until(slots_are, &w, 5000);
    kvp_cache_stats_t st = cache_stats(obs);
    ck_assert_uint_eq(st.host_slots, 4);
    ck_assert_uint_le(st.host_pages, 4);
    ck_assert_uint_eq(st.host_evictions_total, 8 - st.host_pages);
    ck_assert_uint_eq(st.host_bytes_total, 64 * 1024); /* the memory stays; the tier uses less */
    uint32_t gpu, host;
    lookup(c, 1, 32, &gpu, &host);
    ck_assert_uint_eq(gpu, 0);
    ck_assert_uint_le(host, 4 * 4); /* at most the pages still kept, whole from the start */
    audit(obs);

    write_conf(conf, "1MiB"); /* above the start's 64 KiB: kept at the start's */
    ck_assert_int_eq(kill(DMN.pid, SIGHUP), 0);
    w.slots = 64;
    kvp_wait_until(slots_are, &w, 5000);
    ck_assert_uint_eq(cache_stats(obs).host_slots, 64);
    audit(obs);
    kvp_client_close(c);
    kvp_client_close(obs);
    stop();
    unlink(conf);
}
END_TEST

/* A bigger geometry, so copies take milliseconds: 16 layers, 8 heads, head_dim 128, pages of
 * 16 tokens (1 MiB a slot), 96 pages. */
static const geo_t BIG = {.layers = 16, .heads = 8, .dim = 128, .ps = 16, .pages = 96};

/* A worker that sends a Reserve with reuse of a prompt in the host tier and dies before the
 * answer (its restore of 48 MiB in flight): the daemon finishes the restore, answers nobody,
 * and stays consistent; the prompt is then a GPU hit whose bytes are the appended ones. Then a
 * SIGTERM while demotions are in flight exits cleanly. */
START_TEST(test_worker_killed_mid_restore)
{
    const geo_t *g = &BIG;
    start(g, "64MiB", "50");
    kvp_client_t *c = connect_ns("w1", KVP_LEASE_DEFAULT), *obs = observer();
    const uint32_t T = 48 * 16;
    uint16_t *buf;
    uint32_t bid;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, buf_bytes(g, T), (void **)&buf, &bid), 0);
    append_prompt(c, g, buf, bid, 1, 1, T);
    release(c, 1);
    append_prompt(c, g, buf, bid, 2, 0, T); /* held: free pages 0, prompt 1 must go */
    wait_host_t w = {obs, 48, 48};
    kvp_wait_until(host_pages_reached, &w, 20000);
    ck_assert_uint_eq(cache_stats(obs).host_pages, 48);
    release(c, 2); /* free again: the restore below takes 48 of 96, the watermark holds */
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        /* a raw connection: the Reserve is sent and the worker dies before the answer */
        static int32_t tok[48 * 16];
        tokens(tok, 1, 48 * 16);
        kvp_raw_t raw;
        kvp_raw_open(&raw, DMN.sock);
        kvpool_Response resp;
        kvpool_Request h = {.id = 1, .which_body = kvpool_Request_hello_tag};
        h.body.hello.protocol_version = KVP_PROTOCOL_VERSION;
        snprintf(h.body.hello.namespace, sizeof(h.body.hello.namespace), "w2");
        snprintf(h.body.hello.cache_scope, sizeof(h.body.hello.cache_scope), "tier");
        h.body.hello.has_lease_ms = true;
        h.body.hello.lease_ms = 0;
        if (kvp_raw_call(&raw, &h, NULL, 0, &resp) != kvpool_Code_OK)
            _exit(3);
        uint64_t seq = 5;
        uint32_t nt = 48 * 16;
        kvp_batch_arrays_t b = {0};
        b.seq_ids = kvp_array(&seq, 8, 1, 1);
        b.num_tokens = kvp_array(&nt, 4, 1, 1);
        b.token_ids = kvp_array(tok, 4, nt, nt);
        kvpool_Request q = kvp_raw_batch_req(kvpool_Request_reserve_tag, 42, &b);
        q.body.reserve.has_cache = true;
        q.body.reserve.cache.reuse = true;
        kvp_raw_send(&raw, &q, NULL, 0);
        _exit(0); /* before the answer */
    }
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %d", status);
    /* the restore ends whatever happened to its caller: nothing restoring, nothing in host */
    kvp_cache_stats_t st;
    for (int i = 0; i < 2000; i++) {
        st = cache_stats(obs);
        if (st.restoring == 0 && st.host_pages == 0)
            break;
        usleep(5000);
    }
    ck_assert_uint_eq(st.restoring, 0);
    ck_assert_uint_eq(st.host_pages, 0);
    ck_assert_uint_eq(st.promotions_total, 48);
    audit(obs);
    uint32_t gpu, host;
    lookup(c, 1, T, &gpu, &host);
    ck_assert_uint_eq(gpu, T);
    ck_assert_uint_eq(host, 0);
    /* the restored bytes */
    uint16_t *out;
    uint32_t out_id;
    ck_assert_int_eq(kvp_client_alloc_host_buffer(c, buf_bytes(g, T), (void **)&out, &out_id), 0);
    int32_t tok[48 * 16];
    tokens(tok, 1, T);
    kvp_source_t dst = layout(g, out_id, T);
    kvp_load_t ld;
    ck_assert_int_eq(kvp_client_load(c, tok, T, NULL, 0, &dst, 0, &ld), 0);
    ck_assert_uint_eq(ld.loaded_tokens, T);
    ck_assert_int_eq(check(g, out, 1, T, T), -1);
    audit(obs);
    /* SIGTERM with demotions in flight: prompt 3 held, prompt 1 (cached) goes out now */
    append_prompt(c, g, buf, bid, 3, 3, T);
    kvp_client_close(c);
    kvp_client_close(obs);
    ck_assert_int_eq(kvp_daemon_stop(&DMN, SIGTERM), 0);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("host_tier");
    TCase *tc = tcase_create("daemon");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_demote_lookup_load_exact);
    tcase_add_test(tc, test_pressure_both_tiers);
    tcase_add_test(tc, test_load_bad_input);
    tcase_add_test(tc, test_reload_lowers_host_bytes);
    tcase_add_test(tc, test_worker_killed_mid_restore);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
