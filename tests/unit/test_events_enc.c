/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_events_enc.c - the KV-event encoder (issue #29, rpc/kvp_events_enc.c) against bytes
 * written out by hand from vLLM 0.33.0's KVEventBatch as msgspec encodes it: the batch array,
 * the tagged maps and their key order, chains merged into one BlockStored and every way a chain
 * breaks, removals merged per medium, AllBlocksCleared, the smallest int and str forms at each
 * boundary, arrays past 15 and 65535 entries, data_parallel_rank, refused batches (out left as
 * it was) and the output buffer's reuse.
 */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_events.h"

/* ---- the expected bytes' pieces (msgpack, written by hand) -------------------------------- */

#define TS_1_5 0xcb, 0x3f, 0xf8, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00 /* float64 1.5 */
#define NIL    0xc0
/* bin8 of the 16 hash bytes h, h+1, ..., h+15 (the builder's hash(h)) */
#define BIN16(h)                                                                                   \
    0xc4, 0x10, (h), (h) + 1, (h) + 2, (h) + 3, (h) + 4, (h) + 5, (h) + 6, (h) + 7, (h) + 8,       \
        (h) + 9, (h) + 10, (h) + 11, (h) + 12, (h) + 13, (h) + 14, (h) + 15
#define K_TYPE    0xa4, 't', 'y', 'p', 'e'
#define S_STORED  0xab, 'B', 'l', 'o', 'c', 'k', 'S', 't', 'o', 'r', 'e', 'd'
#define S_REMOVED 0xac, 'B', 'l', 'o', 'c', 'k', 'R', 'e', 'm', 'o', 'v', 'e', 'd'
#define S_CLEARED                                                                                  \
    0xb0, 'A', 'l', 'l', 'B', 'l', 'o', 'c', 'k', 's', 'C', 'l', 'e', 'a', 'r', 'e', 'd'
#define K_HASHES 0xac, 'b', 'l', 'o', 'c', 'k', '_', 'h', 'a', 's', 'h', 'e', 's'
#define K_PARENT                                                                                   \
    0xb1, 'p', 'a', 'r', 'e', 'n', 't', '_', 'b', 'l', 'o', 'c', 'k', '_', 'h', 'a', 's', 'h'
#define K_TOKENS    0xa9, 't', 'o', 'k', 'e', 'n', '_', 'i', 'd', 's'
#define K_BSIZE     0xaa, 'b', 'l', 'o', 'c', 'k', '_', 's', 'i', 'z', 'e'
#define K_LORA_ID   0xa7, 'l', 'o', 'r', 'a', '_', 'i', 'd'
#define K_MEDIUM    0xa6, 'm', 'e', 'd', 'i', 'u', 'm'
#define K_LORA_NAME 0xa9, 'l', 'o', 'r', 'a', '_', 'n', 'a', 'm', 'e'
#define K_EXTRA     0xaa, 'e', 'x', 't', 'r', 'a', '_', 'k', 'e', 'y', 's'
#define S_GPU       0xa3, 'G', 'P', 'U'
#define S_CPU       0xa3, 'C', 'P', 'U'
#define S_A         0xa1, 'a'
#define S_B         0xa1, 'b'

/* BlockStored up to its block_hashes' array header: 9 keys under a map16 header, as msgspec
 * writes a Struct with omit_defaults that could have 16 keys (the tag and 15 fields) */
#define STORED_HEAD 0xde, 0x00, 0x09, K_TYPE, S_STORED, K_HASHES
/* BlockStored from block_size to extra_keys' key */
#define STORED_MID(bsize, MED)                                                                     \
    K_BSIZE, bsize, K_LORA_ID, NIL, K_MEDIUM, MED, K_LORA_NAME, NIL, K_EXTRA
/* a BlockStored of one block of block_size 1 (token tok) of the scope NAME (a 1-char name);
 * STORED_MID spelled out, as MED is already expanded to several arguments here */
#define STORED1(h, PAR, tok, MED, NAME)                                                            \
    STORED_HEAD, 0x91, BIN16(h), K_PARENT, PAR, K_TOKENS, 0x91, tok, K_BSIZE, 0x01, K_LORA_ID,     \
        NIL, K_MEDIUM, MED, K_LORA_NAME, NIL, K_EXTRA, 0x91, 0x91, NAME
#define REMOVED_HEAD 0x83, K_TYPE, S_REMOVED, K_HASHES
#define CLEARED      0x81, K_TYPE, S_CLEARED

/* ---- building batches --------------------------------------------------------------------- */

static kvp_ev_batch_t *mk(double ts, uint32_t block_size)
{
    kvp_ev_batch_t *b = calloc(1, sizeof(*b));
    ck_assert_ptr_nonnull(b);
    b->ts = ts;
    b->block_size = block_size;
    return b;
}

static void grow(void **p, uint32_t *cap, uint32_t need, size_t elem)
{
    if (need <= *cap)
        return;
    uint32_t c = *cap ? *cap : 4;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, (size_t)c * elem);
    ck_assert_ptr_nonnull(q);
    *p = q;
    *cap = c;
}

/* Appends a scope name; returns its offset. */
static uint32_t add_name(kvp_ev_batch_t *b, const char *s)
{
    uint32_t len = (uint32_t)strlen(s) + 1, off = b->nnames;
    grow((void **)&b->names, &b->namescap, off + len, 1);
    memcpy(b->names + off, s, len);
    b->nnames += len;
    return off;
}

static void fill_hash(uint8_t *h, uint8_t seed)
{
    for (unsigned i = 0; i < KVP_EV_HASH_BYTES; i++)
        h[i] = (uint8_t)(seed + i);
}

static kvp_ev_rec_t *add_rec(kvp_ev_batch_t *b, uint8_t kind, uint8_t medium, uint8_t h)
{
    grow((void **)&b->rec, &b->cap, b->n + 1, sizeof(kvp_ev_rec_t));
    kvp_ev_rec_t *r = &b->rec[b->n++];
    memset(r, 0, sizeof(*r));
    r->kind = kind;
    r->medium = medium;
    fill_hash(r->hash, h);
    return r;
}

/* A STORED record of hash(h), child of hash(parent) when parent >= 0, with block_size tokens. */
static void stored(kvp_ev_batch_t *b, uint8_t medium, int parent, uint8_t h, uint32_t scope_off,
                   const int32_t *tok)
{
    kvp_ev_rec_t *r = add_rec(b, KVP_EV_STORED, medium, h);
    if (parent >= 0) {
        r->has_parent = 1;
        fill_hash(r->parent, (uint8_t)parent);
    }
    r->scope_off = scope_off;
    r->tok_off = b->ntok;
    grow((void **)&b->tok, &b->tokcap, b->ntok + b->block_size, sizeof(int32_t));
    memcpy(b->tok + b->ntok, tok, b->block_size * sizeof(int32_t));
    b->ntok += b->block_size;
}

static void removed(kvp_ev_batch_t *b, uint8_t medium, uint8_t h)
{
    add_rec(b, KVP_EV_REMOVED, medium, h);
}

static void cleared(kvp_ev_batch_t *b)
{
    add_rec(b, KVP_EV_CLEARED, 0, 0);
}

/* ---- checking ----------------------------------------------------------------------------- */

static void expect_bytes(const kvp_ev_buf_t *out, const uint8_t *want, size_t n)
{
    size_t i = 0;
    while (i < n && i < out->len && out->data[i] == want[i])
        i++;
    ck_assert_msg(i == n && out->len == n,
                  "payload differs at byte %zu (len %zu, want %zu): 0x%02x", i, out->len, n,
                  i < out->len ? out->data[i] : 0);
}

/* Encodes b with dp_rank and checks the bytes and the number of events; frees b. */
static void expect_encoding(kvp_ev_batch_t *b, uint32_t dp_rank, const uint8_t *want, size_t n,
                            uint32_t want_events)
{
    kvp_ev_buf_t out = {0};
    uint32_t events = 12345;
    ck_assert_int_eq(kvp_ev_encode(b, dp_rank, &out, &events), 0);
    expect_bytes(&out, want, n);
    ck_assert_uint_eq(events, want_events);
    ck_assert_uint_le(out.len, out.cap);
    kvp_ev_buf_free(&out);
    kvp_ev_batch_free(b);
}

#define EXPECT(b, dp, nev, ...)                                                                    \
    do {                                                                                           \
        static const uint8_t want_[] = {__VA_ARGS__};                                              \
        expect_encoding((b), (dp), want_, sizeof(want_), (nev));                                   \
    } while (0)

/* ---- the cases ---------------------------------------------------------------------------- */

START_TEST(empty_batch_is_ts_empty_list_rank)
{
    EXPECT(mk(1.5, 16), 0, 0, 0x93, TS_1_5, 0x90, 0x00);
    /* a wall-clock time: all 8 bytes big-endian */
    EXPECT(mk(1700000000.25, 16), 5, 0, 0x93, 0xcb, 0x41, 0xd9, 0x54, 0xfc, 0x40, 0x10, 0x00, 0x00,
           0x90, 0x05);
}
END_TEST

START_TEST(single_stored_without_parent)
{
    kvp_ev_batch_t *b = mk(1.5, 2);
    static const int32_t tok[] = {1, 2};
    stored(b, KVP_EV_GPU, -1, 0x10, add_name(b, "a"), tok);
    EXPECT(b, 0, 1, 0x93, TS_1_5, 0x91, STORED_HEAD, 0x91, BIN16(0x10), K_PARENT, NIL, K_TOKENS,
           0x92, 0x01, 0x02, STORED_MID(0x02, S_GPU), 0x91, 0x91, S_A, 0x00);
}
END_TEST

START_TEST(chain_of_three_is_one_block_stored)
{
    kvp_ev_batch_t *b = mk(1.5, 2);
    uint32_t t = add_name(b, "tenant");
    static const int32_t t0[] = {100, 200}, t1[] = {300, 400}, t2[] = {500, 600};
    stored(b, KVP_EV_CPU, 0x80, 0x10, t, t0); /* its parent was published before */
    stored(b, KVP_EV_CPU, 0x10, 0x20, t, t1);
    stored(b, KVP_EV_CPU, 0x20, 0x30, t, t2);
#define S_TENANT 0xa6, 't', 'e', 'n', 'a', 'n', 't'
    EXPECT(b, 5, 1, 0x93, TS_1_5, 0x91, STORED_HEAD, 0x93, BIN16(0x10), BIN16(0x20), BIN16(0x30),
           K_PARENT, BIN16(0x80), K_TOKENS, 0x96, 0x64, 0xcc, 0xc8, 0xcd, 0x01, 0x2c, 0xcd, 0x01,
           0x90, 0xcd, 0x01, 0xf4, 0xcd, 0x02, 0x58, STORED_MID(0x02, S_CPU), 0x93, 0x91, S_TENANT,
           0x91, S_TENANT, 0x91, S_TENANT, 0x05);
#undef S_TENANT
}
END_TEST

START_TEST(chain_breaks_make_two_events)
{
    static const int32_t t7[] = {7}, t8[] = {8};
    kvp_ev_batch_t *b;

    /* another scope, though the second is the first's child */
    b = mk(1.5, 1);
    stored(b, KVP_EV_GPU, -1, 0x10, add_name(b, "a"), t7);
    stored(b, KVP_EV_GPU, 0x10, 0x20, add_name(b, "b"), t8);
    EXPECT(b, 0, 2, 0x93, TS_1_5, 0x92, STORED1(0x10, NIL, 0x07, S_GPU, S_A),
           STORED1(0x20, BIN16(0x10), 0x08, S_GPU, S_B), 0x00);

    /* a parent that is not the previous record's hash */
    b = mk(1.5, 1);
    uint32_t a = add_name(b, "a");
    stored(b, KVP_EV_GPU, -1, 0x10, a, t7);
    stored(b, KVP_EV_GPU, 0x11, 0x20, a, t8);
    EXPECT(b, 0, 2, 0x93, TS_1_5, 0x92, STORED1(0x10, NIL, 0x07, S_GPU, S_A),
           STORED1(0x20, BIN16(0x11), 0x08, S_GPU, S_A), 0x00);

    /* another medium */
    b = mk(1.5, 1);
    a = add_name(b, "a");
    stored(b, KVP_EV_GPU, -1, 0x10, a, t7);
    stored(b, KVP_EV_CPU, 0x10, 0x20, a, t8);
    EXPECT(b, 0, 2, 0x93, TS_1_5, 0x92, STORED1(0x10, NIL, 0x07, S_GPU, S_A),
           STORED1(0x20, BIN16(0x10), 0x08, S_CPU, S_A), 0x00);

    /* no parent: a new chain starts, even where the parent bytes would match */
    b = mk(1.5, 1);
    a = add_name(b, "a");
    stored(b, KVP_EV_GPU, -1, 0x10, a, t7);
    stored(b, KVP_EV_GPU, 0x10, 0x20, a, t8);
    b->rec[1].has_parent = 0;
    EXPECT(b, 0, 2, 0x93, TS_1_5, 0x92, STORED1(0x10, NIL, 0x07, S_GPU, S_A),
           STORED1(0x20, NIL, 0x08, S_GPU, S_A), 0x00);

    /* a removal between parent and child */
    b = mk(1.5, 1);
    a = add_name(b, "a");
    stored(b, KVP_EV_GPU, -1, 0x10, a, t7);
    removed(b, KVP_EV_GPU, 0x90);
    stored(b, KVP_EV_GPU, 0x10, 0x20, a, t8);
    EXPECT(b, 0, 3, 0x93, TS_1_5, 0x93, STORED1(0x10, NIL, 0x07, S_GPU, S_A), REMOVED_HEAD, 0x91,
           BIN16(0x90), K_MEDIUM, S_GPU, STORED1(0x20, BIN16(0x10), 0x08, S_GPU, S_A), 0x00);
}
END_TEST

START_TEST(equal_names_at_two_offsets_are_one_scope)
{
    static const int32_t t7[] = {7}, t8[] = {8};
    kvp_ev_batch_t *b = mk(1.5, 1);
    stored(b, KVP_EV_GPU, -1, 0x10, add_name(b, "a"), t7);
    stored(b, KVP_EV_GPU, 0x10, 0x20, add_name(b, "a"), t8);
    ck_assert_uint_ne(b->rec[0].scope_off, b->rec[1].scope_off);
    EXPECT(b, 0, 1, 0x93, TS_1_5, 0x91, STORED_HEAD, 0x92, BIN16(0x10), BIN16(0x20), K_PARENT, NIL,
           K_TOKENS, 0x92, 0x07, 0x08, STORED_MID(0x01, S_GPU), 0x92, 0x91, S_A, 0x91, S_A, 0x00);
}
END_TEST

START_TEST(removed_runs_merge_per_medium)
{
    kvp_ev_batch_t *b = mk(1.5, 16);
    removed(b, KVP_EV_GPU, 0x10);
    removed(b, KVP_EV_GPU, 0x20);
    removed(b, KVP_EV_CPU, 0x30);
    removed(b, KVP_EV_CPU, 0x40);
    removed(b, KVP_EV_GPU, 0x50);
    EXPECT(b, 0, 3, 0x93, TS_1_5, 0x93, REMOVED_HEAD, 0x92, BIN16(0x10), BIN16(0x20), K_MEDIUM,
           S_GPU, REMOVED_HEAD, 0x92, BIN16(0x30), BIN16(0x40), K_MEDIUM, S_CPU, REMOVED_HEAD, 0x91,
           BIN16(0x50), K_MEDIUM, S_GPU, 0x00);
}
END_TEST

START_TEST(cleared_is_an_event_of_its_own)
{
    static const int32_t t7[] = {7}, t8[] = {8};
    kvp_ev_batch_t *b = mk(1.5, 1);
    uint32_t a = add_name(b, "a");
    stored(b, KVP_EV_GPU, -1, 0x10, a, t7);
    cleared(b);
    cleared(b);
    removed(b, KVP_EV_GPU, 0x10);
    stored(b, KVP_EV_GPU, 0x10, 0x20, a, t8); /* after a clear: not the same event as its parent */
    EXPECT(b, 0, 5, 0x93, TS_1_5, 0x95, STORED1(0x10, NIL, 0x07, S_GPU, S_A), CLEARED, CLEARED,
           REMOVED_HEAD, 0x91, BIN16(0x10), K_MEDIUM, S_GPU,
           STORED1(0x20, BIN16(0x10), 0x08, S_GPU, S_A), 0x00);

    b = mk(1.5, 1);
    cleared(b);
    EXPECT(b, 0, 1, 0x93, TS_1_5, 0x91, CLEARED, 0x00);
}
END_TEST

START_TEST(token_ids_take_the_smallest_int_form)
{
    static const int32_t tok[16] = {0,   127, 128,  255,  256,    65535,  65536,     -1,
                                    -32, -33, -128, -129, -32768, -32769, INT32_MAX, INT32_MIN};
    kvp_ev_batch_t *b = mk(1.5, 16);
    stored(b, KVP_EV_GPU, -1, 0x10, add_name(b, "a"), tok);
    EXPECT(b, 0, 1, 0x93, TS_1_5, 0x91, STORED_HEAD, 0x91, BIN16(0x10), K_PARENT, NIL, K_TOKENS,
           0xdc, 0x00, 0x10,                   /* 16 entries: array16 */
           0x00, 0x7f,                         /* 0, 127: positive fixint */
           0xcc, 0x80, 0xcc, 0xff,             /* 128, 255: uint8 */
           0xcd, 0x01, 0x00, 0xcd, 0xff, 0xff, /* 256, 65535: uint16 */
           0xce, 0x00, 0x01, 0x00, 0x00,       /* 65536: uint32 */
           0xff, 0xe0,                         /* -1, -32: negative fixint */
           0xd0, 0xdf, 0xd0, 0x80,             /* -33, -128: int8 */
           0xd1, 0xff, 0x7f, 0xd1, 0x80, 0x00, /* -129, -32768: int16 */
           0xd2, 0xff, 0xff, 0x7f, 0xff,       /* -32769: int32 */
           0xce, 0x7f, 0xff, 0xff,
           0xff, /* INT32_MAX: uint32, as msgspec (non-negative: unsigned) */
           0xd2, 0x80, 0x00, 0x00, 0x00, /* INT32_MIN */
           STORED_MID(0x10, S_GPU), 0x91, 0x91, S_A, 0x00);
}
END_TEST

#define C10 'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', 'i', 'j'

START_TEST(forty_char_scope_is_str8)
{
    static const int32_t t7[] = {7}, t8[] = {8};
    kvp_ev_batch_t *b = mk(1.5, 1);
    uint32_t s = add_name(b, "abcdefghijabcdefghijabcdefghijabcdefghij");
    ck_assert_uint_eq(strlen(b->names + s), 40);
    stored(b, KVP_EV_GPU, -1, 0x10, s, t7);
    stored(b, KVP_EV_GPU, 0x10, 0x20, s, t8);
    EXPECT(b, 0, 1, 0x93, TS_1_5, 0x91, STORED_HEAD, 0x92, BIN16(0x10), BIN16(0x20), K_PARENT, NIL,
           K_TOKENS, 0x92, 0x07, 0x08, STORED_MID(0x01, S_GPU), 0x92, 0x91, 0xd9, 0x28, C10, C10,
           C10, C10, 0x91, 0xd9, 0x28, C10, C10, C10, C10, 0x00);
}
END_TEST

/* The str header at each length boundary: fixstr up to 31, str8 from 32 (msgpack-c's old raw
 * form would give str16 there), str16 from 256, str32 from 65536. */
START_TEST(scope_name_str_forms_at_the_boundaries)
{
    static const struct {
        size_t len;
        uint8_t hdr[5];
        size_t hlen;
    } cases[] = {
        {1, {0xa1}, 1},
        {31, {0xbf}, 1},
        {32, {0xd9, 0x20}, 2},
        {255, {0xd9, 0xff}, 2},
        {256, {0xda, 0x01, 0x00}, 3},
        {65535, {0xda, 0xff, 0xff}, 3},
        {65536, {0xdb, 0x00, 0x01, 0x00, 0x00}, 5},
    };
    static const uint8_t head[] = {0x93,     TS_1_5,      0x91,     STORED_HEAD,
                                   0x91,     BIN16(0x10), K_PARENT, NIL,
                                   K_TOKENS, 0x91,        0x07,     STORED_MID(0x01, S_GPU),
                                   0x91,     0x91};
    static const int32_t t7[] = {7};
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        size_t len = cases[c].len;
        char *name = malloc(len + 1);
        ck_assert_ptr_nonnull(name);
        for (size_t i = 0; i < len; i++)
            name[i] = (char)('a' + i % 26);
        name[len] = 0;
        kvp_ev_batch_t *b = mk(1.5, 1);
        stored(b, KVP_EV_GPU, -1, 0x10, add_name(b, name), t7);
        size_t n = sizeof(head) + cases[c].hlen + len + 1;
        uint8_t *want = malloc(n);
        ck_assert_ptr_nonnull(want);
        memcpy(want, head, sizeof(head));
        memcpy(want + sizeof(head), cases[c].hdr, cases[c].hlen);
        memcpy(want + sizeof(head) + cases[c].hlen, name, len);
        want[n - 1] = 0x00;
        expect_encoding(b, 0, want, n, 1);
        free(want);
        free(name);
    }
}
END_TEST

START_TEST(data_parallel_rank_forms)
{
    EXPECT(mk(1.5, 16), 0, 0, 0x93, TS_1_5, 0x90, 0x00);
    EXPECT(mk(1.5, 16), 5, 0, 0x93, TS_1_5, 0x90, 0x05);
    EXPECT(mk(1.5, 16), 127, 0, 0x93, TS_1_5, 0x90, 0x7f);
    EXPECT(mk(1.5, 16), 128, 0, 0x93, TS_1_5, 0x90, 0xcc, 0x80);
    EXPECT(mk(1.5, 16), 65536, 0, 0x93, TS_1_5, 0x90, 0xce, 0x00, 0x01, 0x00, 0x00);
    EXPECT(mk(1.5, 16), UINT32_MAX, 0, 0x93, TS_1_5, 0x90, 0xce, 0xff, 0xff, 0xff, 0xff);
}
END_TEST

/* 20 blocks of 3300 tokens: block_hashes and extra_keys past 15 entries (array16), token_ids
 * past 65535 (array32: 66000 = 0x000101d0). */
START_TEST(long_chain_takes_wide_array_headers)
{
    enum { NB = 20, BS = 3300 };
    int32_t *tok = malloc(BS * sizeof(int32_t));
    ck_assert_ptr_nonnull(tok);
    for (int i = 0; i < BS; i++)
        tok[i] = 7;
    kvp_ev_batch_t *b = mk(1.5, BS);
    uint32_t z = add_name(b, "z");
    for (int k = 0; k < NB; k++)
        stored(b, KVP_EV_GPU, k ? 0x10 + k - 1 : -1, (uint8_t)(0x10 + k), z, tok);

    static const uint8_t head[] = {0x93, TS_1_5, 0x91, STORED_HEAD, 0xdc, 0x00, 0x14};
    static const uint8_t parent[] = {K_PARENT, NIL, K_TOKENS, 0xdd, 0x00, 0x01, 0x01, 0xd0};
#define U16_3300 0xcd, 0x0c, 0xe4
    static const uint8_t mid[] = {STORED_MID(U16_3300, S_GPU), 0xdc, 0x00, 0x14};
#undef U16_3300
    static const uint8_t key[] = {0x91, 0xa1, 'z'};
    size_t n = sizeof(head) + NB * 18 + sizeof(parent) + (size_t)NB * BS + sizeof(mid) +
               NB * sizeof(key) + 1;
    uint8_t *want = malloc(n), *p = want;
    ck_assert_ptr_nonnull(want);
    memcpy(p, head, sizeof(head));
    p += sizeof(head);
    for (int k = 0; k < NB; k++) {
        uint8_t h[] = {BIN16(0)};
        for (int i = 2; i < 18; i++)
            h[i] = (uint8_t)(h[i] + 0x10 + k);
        memcpy(p, h, sizeof(h));
        p += sizeof(h);
    }
    memcpy(p, parent, sizeof(parent));
    p += sizeof(parent);
    memset(p, 0x07, (size_t)NB * BS);
    p += (size_t)NB * BS;
    memcpy(p, mid, sizeof(mid));
    p += sizeof(mid);
    for (int k = 0; k < NB; k++, p += sizeof(key))
        memcpy(p, key, sizeof(key));
    *p++ = 0x00;
    ck_assert_uint_eq((size_t)(p - want), n);
    expect_encoding(b, 0, want, n, 1);
    free(want);
    free(tok);
}
END_TEST

/* Encodes b into out (already holding a payload) and expects KVP_EINVAL with out untouched. */
static void expect_refused(const kvp_ev_batch_t *b, kvp_ev_buf_t *out, const char *what)
{
    uint8_t *data = out->data;
    size_t len = out->len, cap = out->cap;
    uint8_t first = data[0];
    uint32_t events = 77;
    ck_assert_msg(kvp_ev_encode(b, 0, out, &events) == KVP_EINVAL, "%s: not refused", what);
    ck_assert_msg(out->data == data && out->len == len && out->cap == cap && out->data[0] == first,
                  "%s: out changed", what);
    ck_assert_msg(events == 77, "%s: events written", what);
}

START_TEST(malformed_batches_are_refused_and_change_nothing)
{
    static const int32_t t[] = {1, 2};
    kvp_ev_buf_t out = {0};
    kvp_ev_batch_t *b = mk(1.5, 2);
    uint32_t a = add_name(b, "a");
    stored(b, KVP_EV_GPU, -1, 0x10, a, t);
    removed(b, KVP_EV_CPU, 0x20);
    ck_assert_int_eq(kvp_ev_encode(b, 0, &out, NULL), 0); /* NULL events: fine */
    ck_assert_uint_gt(out.len, 0);

    ck_assert_int_eq(kvp_ev_encode(NULL, 0, &out, NULL), KVP_EINVAL);
    ck_assert_int_eq(kvp_ev_encode(b, 0, NULL, NULL), KVP_EINVAL);

    b->rec[0].kind = 3;
    expect_refused(b, &out, "unknown kind");
    b->rec[0].kind = KVP_EV_STORED;
    b->rec[0].medium = 2;
    expect_refused(b, &out, "stored: unknown medium");
    b->rec[0].medium = KVP_EV_GPU;
    b->rec[1].medium = 2;
    expect_refused(b, &out, "removed: unknown medium");
    b->rec[1].medium = KVP_EV_CPU;
    b->rec[0].tok_off = 1; /* 1 + 2 > ntok 2 */
    expect_refused(b, &out, "tokens past ntok");
    b->rec[0].tok_off = UINT32_MAX;
    expect_refused(b, &out, "tok_off wrapping");
    b->rec[0].tok_off = 0;
    b->rec[0].scope_off = b->nnames;
    expect_refused(b, &out, "scope_off past nnames");
    b->rec[0].scope_off = UINT32_MAX;
    expect_refused(b, &out, "scope_off UINT32_MAX");
    b->rec[0].scope_off = a;
    b->names[a + 1] = 'x'; /* the name's NUL gone: runs to the end of names */
    expect_refused(b, &out, "name not terminated");
    b->names[a + 1] = 0;
    b->names[a] = (char)0xff;
    expect_refused(b, &out, "name not UTF-8");
    b->names[a] = (char)0xc3; /* the first byte of a 2-byte sequence, cut by the NUL */
    expect_refused(b, &out, "name cut UTF-8");
    b->names[a] = 'a';
    kvp_ev_rec_t *rec = b->rec;
    b->rec = NULL;
    expect_refused(b, &out, "no records");
    b->rec = rec;
    int32_t *tok = b->tok;
    b->tok = NULL;
    expect_refused(b, &out, "no token ids");
    b->tok = tok;
    char *names = b->names;
    b->names = NULL;
    expect_refused(b, &out, "no names");
    b->names = names;

    /* restored: encodes again, to the same bytes */
    kvp_ev_buf_t again = {0};
    ck_assert_int_eq(kvp_ev_encode(b, 0, &again, NULL), 0);
    expect_bytes(&again, out.data, out.len);
    kvp_ev_buf_free(&again);
    kvp_ev_buf_free(&out);
    kvp_ev_batch_free(b);
}
END_TEST

START_TEST(multibyte_utf8_scope_is_accepted)
{
    static const int32_t t7[] = {7};
    kvp_ev_batch_t *b = mk(1.5, 1);
    stored(b, KVP_EV_GPU, -1, 0x10, add_name(b, "\xc3\xa9"), t7); /* U+00E9 */
    EXPECT(b, 0, 1, 0x93, TS_1_5, 0x91, STORED_HEAD, 0x91, BIN16(0x10), K_PARENT, NIL, K_TOKENS,
           0x91, 0x07, STORED_MID(0x01, S_GPU), 0x91, 0x91, 0xa2, 0xc3, 0xa9, 0x00);
}
END_TEST

START_TEST(output_buffer_is_reused)
{
    static const int32_t t[] = {1, 2};
    kvp_ev_buf_t out = {0};
    kvp_ev_batch_t *big = mk(1.5, 2), *empty = mk(1.5, 2);
    uint32_t a = add_name(big, "a");
    for (int k = 0; k < 40; k++)
        stored(big, KVP_EV_GPU, k ? 0x10 + k - 1 : -1, (uint8_t)(0x10 + k), a, t);
    ck_assert_int_eq(kvp_ev_encode(big, 0, &out, NULL), 0);
    uint8_t *data = out.data;
    size_t cap = out.cap;
    ck_assert_uint_gt(out.len, 40 * 18);

    /* the smaller payload replaces the contents in the same memory */
    static const uint8_t want[] = {0x93, TS_1_5, 0x90, 0x03};
    uint32_t events = 9;
    ck_assert_int_eq(kvp_ev_encode(empty, 3, &out, &events), 0);
    expect_bytes(&out, want, sizeof(want));
    ck_assert_uint_eq(events, 0);
    ck_assert_ptr_eq(out.data, data);
    ck_assert_uint_eq(out.cap, cap);
    /* and the larger one again fits what it reserved the first time */
    ck_assert_int_eq(kvp_ev_encode(big, 0, &out, NULL), 0);
    ck_assert_ptr_eq(out.data, data);
    ck_assert_uint_eq(out.cap, cap);

    kvp_ev_buf_free(&out);
    ck_assert_ptr_null(out.data);
    ck_assert_uint_eq(out.len, 0);
    ck_assert_uint_eq(out.cap, 0);
    kvp_ev_buf_free(&out); /* twice: fine */
    kvp_ev_buf_free(NULL);
    kvp_ev_batch_free(NULL);
    kvp_ev_batch_free(big);
    kvp_ev_batch_free(empty);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("events_enc");
    TCase *tc = tcase_create("events_enc");
    tcase_add_test(tc, empty_batch_is_ts_empty_list_rank);
    tcase_add_test(tc, single_stored_without_parent);
    tcase_add_test(tc, chain_of_three_is_one_block_stored);
    tcase_add_test(tc, chain_breaks_make_two_events);
    tcase_add_test(tc, equal_names_at_two_offsets_are_one_scope);
    tcase_add_test(tc, removed_runs_merge_per_medium);
    tcase_add_test(tc, cleared_is_an_event_of_its_own);
    tcase_add_test(tc, token_ids_take_the_smallest_int_form);
    tcase_add_test(tc, forty_char_scope_is_str8);
    tcase_add_test(tc, scope_name_str_forms_at_the_boundaries);
    tcase_add_test(tc, data_parallel_rank_forms);
    tcase_add_test(tc, long_chain_takes_wide_array_headers);
    tcase_add_test(tc, malformed_batches_are_refused_and_change_nothing);
    tcase_add_test(tc, multibyte_utf8_scope_is_accepted);
    tcase_add_test(tc, output_buffer_is_reused);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
