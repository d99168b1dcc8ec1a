/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_events_enc.c - the KV-event encoder (issue #29): a closed batch of block records to the
 * msgpack bytes of vLLM 0.33.0's KVEventBatch, exactly as msgspec writes them, so a router
 * that decodes vLLM's events decodes ours.
 *
 * The layout (vllm/distributed/kv_events.py):
 *   KVEventBatch  array_like, omit_defaults: [ts (float64), [event, ...], data_parallel_rank]
 *   each event    tag=True, omit_defaults: a map whose first key is "type" (the class name),
 *                 then the fields in declaration order; a field without a default is always
 *                 written (None as nil), one with a default only when it differs from it.
 *     BlockStored       type, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
 *                       medium, lora_name, extra_keys (its later fields keep their defaults)
 *     BlockRemoved      type, block_hashes, medium
 *     AllBlocksCleared  type
 * msgpack-c 4 picks the same smallest forms as msgspec for every value written here: ints
 * (fixint, 0xcc..0xce, 0xd0..0xd2), str (fixstr, str8, str16, str32), bin8 for the 16-byte
 * hashes, float64 for ts. One exception: msgspec writes an omit_defaults Struct that could
 * have 16 keys or more (BlockStored: the tag and 15 fields) under a map16 header, reserved
 * before it knows how many fields it omits and patched afterwards, so BlockStored's 9 keys
 * start 0xde 0x00 0x09, not fixmap 0x89 (pack_map16). tests/unit/test_events_enc.c pins the
 * bytes.
 *
 * Two passes over the records, none over the output: the first checks the batch (so bad input
 * changes nothing) and bounds the output's size, which is reserved once; the second writes.
 * The packer's write callback appends to that reservation; its growth path only runs should
 * the bound ever be short. No allocation per record.
 */
#include "kvp_events.h"

#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_utf8.h"

/* The most bytes one event writes besides its blocks (array headers at their widest, 5):
 * BlockStored: map16 3, "type" 5, "BlockStored" 12, "block_hashes" 13 + 5, "parent_block_hash"
 * 18 + bin 18, "token_ids" 10 + 5, "block_size" 11 + 5, "lora_id" 8 + 1, "medium" 7 + 4,
 * "lora_name" 10 + 1, "extra_keys" 11 + 5. */
#define EV_STORED_FIXED 152u
/* map 1, "type" 5, "BlockRemoved" 13, "block_hashes" 13 + 5, "medium" 7 + 4 */
#define EV_REMOVED_FIXED 48u
/* map 1, "type" 5, "AllBlocksCleared" 17 */
#define EV_CLEARED_FIXED 23u
/* array 1, float64 9, events' array 5, data_parallel_rank 5 */
#define EV_BATCH_FIXED 20u
/* a block hash: bin8 header 2 + 16 */
#define EV_HASH_PACKED (2u + KVP_EV_HASH_BYTES)
/* one extra_keys entry besides the name: fixarray 1 + str header 5 */
#define EV_KEY_FIXED 6u
/* a token id at its widest (0xce / 0xd2 + 4) */
#define EV_TOKEN_MAX 5u

void kvp_ev_batch_free(kvp_ev_batch_t *b)
{
    if (!b)
        return;
    free(b->rec);
    free(b->tok);
    free(b->names);
    free(b);
}

void kvp_ev_buf_free(kvp_ev_buf_t *b)
{
    if (!b)
        return;
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

/* ---- writing ------------------------------------------------------------------------------ */

/* The packer's sink: a cursor into out's memory, and a sticky failure so that one check at the
 * end covers every write. out->len is set once, at the end. */
typedef struct {
    kvp_ev_buf_t *out;
    uint8_t *p, *end;
    int failed;
} ev_sink_t;

/* Gives out room for need bytes in all, keeping its first keep bytes. */
static int ev_reserve(kvp_ev_buf_t *out, size_t need, size_t keep)
{
    if (need <= out->cap)
        return 0;
    size_t cap = out->cap + out->cap / 2; /* geometric: repeated small growths stay amortised */
    if (cap < need)
        cap = need;
    uint8_t *d = malloc(cap);
    if (!d)
        return KVP_ENOMEM;
    if (keep)
        memcpy(d, out->data, keep);
    free(out->data);
    out->data = d;
    out->cap = cap;
    return 0;
}

/* Only when ev_check's bound was short (never, as long as it is right): grows out. */
static __attribute__((noinline)) int ev_write_slow(ev_sink_t *s, const char *buf, size_t len)
{
    kvp_ev_buf_t *o = s->out;
    size_t used = (size_t)(s->p - o->data);
    if (s->failed || len > SIZE_MAX - used || ev_reserve(o, used + len, used)) {
        s->failed = 1;
        return -1;
    }
    memcpy(o->data + used, buf, len);
    s->p = o->data + used + len;
    s->end = o->data + o->cap;
    return 0;
}

/* The packer's write callback: a compare and a copy of a few bytes. msgpack-c's pack functions
 * are inline and call it through the packer; with the packer a local of known contents (see
 * EV_PACKER) the compiler makes that a direct call and inlines it, so a token id costs a
 * compare and a store of its 1 to 5 bytes, not two calls. */
static inline int ev_write(void *data, const char *buf, size_t len)
{
    ev_sink_t *s = data;
    if (__builtin_expect(len > (size_t)(s->end - s->p), 0))
        return ev_write_slow(s, buf, len);
    memcpy(s->p, buf, len);
    s->p += len;
    return 0;
}

/* Declares pk, a packer into the sink s, local to the function that packs (not a parameter:
 * its callback must be visible where msgpack-c's inline functions call it). */
#define EV_PACKER(pk, s)                                                                           \
    msgpack_packer pk##_local = {.data = (s), .callback = ev_write};                               \
    msgpack_packer *pk = &pk##_local

/* A string literal (a key, a class name): its length is known at compile time. */
#define PACK_LIT(pk, lit)                                                                          \
    do {                                                                                           \
        msgpack_pack_str((pk), sizeof(lit) - 1);                                                   \
        msgpack_pack_str_body((pk), (lit), sizeof(lit) - 1);                                       \
    } while (0)

/* A map16 header whatever n (msgspec's form for BlockStored, see above); msgpack-c has no call
 * for it, as its msgpack_pack_map picks the smallest form. */
static void pack_map16(msgpack_packer *pk, uint16_t n)
{
    const char hdr[3] = {(char)0xde, (char)(n >> 8), (char)(n & 0xff)};
    pk->callback(pk->data, hdr, sizeof(hdr));
}

static void pack_hash(msgpack_packer *pk, const uint8_t *h)
{
    msgpack_pack_bin(pk, KVP_EV_HASH_BYTES);
    msgpack_pack_bin_body(pk, h, KVP_EV_HASH_BYTES);
}

static void pack_medium(msgpack_packer *pk, uint8_t medium)
{
    PACK_LIT(pk, "medium");
    if (medium == KVP_EV_CPU)
        PACK_LIT(pk, "CPU");
    else
        PACK_LIT(pk, "GPU");
}

/* ---- grouping ----------------------------------------------------------------------------- */

static const char *rec_name(const kvp_ev_batch_t *b, const kvp_ev_rec_t *r)
{
    return b->names + r->scope_off;
}

/* Whether cur continues the event that prev is in (both checked by ev_check). Stored: one
 * chain of one scope and one medium, cur the child of prev, as vLLM's scheduler emits a
 * request's new blocks; removed: the same medium. Anything else opens a new event. */
static int continues(const kvp_ev_batch_t *b, const kvp_ev_rec_t *prev, const kvp_ev_rec_t *cur)
{
    if (prev->kind != cur->kind || prev->medium != cur->medium)
        return 0;
    if (cur->kind == KVP_EV_REMOVED)
        return 1;
    if (cur->kind != KVP_EV_STORED || !cur->has_parent ||
        memcmp(cur->parent, prev->hash, KVP_EV_HASH_BYTES) != 0)
        return 0;
    /* equal names at two offsets are one scope (the batcher need not intern them) */
    return prev->scope_off == cur->scope_off || strcmp(rec_name(b, prev), rec_name(b, cur)) == 0;
}

/* Checks every record against the batch's arrays and bounds the encoded size. Returns 0,
 * KVP_EINVAL (a record that does not fit the batch, an unknown kind or medium, a scope name
 * that is not NUL-terminated UTF-8, an event of more than 2^32 - 1 token ids) or KVP_ENOMEM
 * (a bound past size_t); *bound and *events (the number of maps) on success. */
static int ev_check(const kvp_ev_batch_t *b, size_t *bound, uint32_t *events)
{
    if (b->n && !b->rec)
        return KVP_EINVAL;
    size_t total = EV_BATCH_FIXED;
    uint32_t nev = 0;
    uint64_t run_tokens = 0; /* token ids of the open BlockStored */
    int have_name = 0;       /* the last name checked: its offset and length */
    uint32_t name_off = 0;
    size_t name_len = 0;
    int ovf = 0;
    for (uint32_t i = 0; i < b->n; i++) {
        const kvp_ev_rec_t *r = &b->rec[i];
        size_t add;
        if (r->kind == KVP_EV_STORED) {
            if (r->medium > KVP_EV_CPU)
                return KVP_EINVAL;
            if ((uint64_t)r->tok_off + b->block_size > b->ntok || (b->block_size && !b->tok))
                return KVP_EINVAL;
            if (!have_name || r->scope_off != name_off) {
                if (!b->names || r->scope_off >= b->nnames)
                    return KVP_EINVAL;
                const char *s = rec_name(b, r);
                const char *nul = memchr(s, 0, b->nnames - r->scope_off);
                if (!nul)
                    return KVP_EINVAL;
                size_t len = (size_t)(nul - s);
                /* msgspec refuses a str that is not UTF-8 */
                for (size_t k = 0; k < len;) {
                    size_t l = kvp_utf8_len((const unsigned char *)s + k);
                    if (!l)
                        return KVP_EINVAL;
                    k += l;
                }
                have_name = 1;
                name_off = r->scope_off;
                name_len = len;
            }
            /* per block: its hash, its token ids at their widest, its [name] */
            add = EV_HASH_PACKED + EV_KEY_FIXED + name_len;
            ovf |= __builtin_add_overflow(add, (size_t)EV_TOKEN_MAX * b->block_size, &add);
            if (i && continues(b, &b->rec[i - 1], r)) {
                run_tokens += b->block_size;
            } else {
                nev++;
                run_tokens = b->block_size;
                ovf |= __builtin_add_overflow(add, (size_t)EV_STORED_FIXED, &add);
            }
            if (run_tokens > UINT32_MAX) /* past msgpack's array32 */
                return KVP_EINVAL;
        } else if (r->kind == KVP_EV_REMOVED) {
            if (r->medium > KVP_EV_CPU)
                return KVP_EINVAL;
            add = EV_HASH_PACKED;
            if (!(i && continues(b, &b->rec[i - 1], r))) {
                nev++;
                add += EV_REMOVED_FIXED;
            }
        } else if (r->kind == KVP_EV_CLEARED) {
            nev++;
            add = EV_CLEARED_FIXED;
        } else {
            return KVP_EINVAL;
        }
        ovf |= __builtin_add_overflow(total, add, &total);
    }
    if (ovf)
        return KVP_ENOMEM;
    *bound = total;
    *events = nev;
    return 0;
}

/* Writes the BlockStored of records [i, j). */
static void pack_stored(ev_sink_t *s, const kvp_ev_batch_t *b, uint32_t i, uint32_t j)
{
    EV_PACKER(pk, s);
    const kvp_ev_rec_t *first = &b->rec[i];
    const uint32_t nblk = j - i;
    const char *name = rec_name(b, first);
    const size_t name_len = strlen(name);
    pack_map16(pk, 9);
    PACK_LIT(pk, "type");
    PACK_LIT(pk, "BlockStored");
    PACK_LIT(pk, "block_hashes");
    msgpack_pack_array(pk, nblk);
    for (uint32_t k = i; k < j; k++)
        pack_hash(pk, b->rec[k].hash);
    PACK_LIT(pk, "parent_block_hash");
    if (first->has_parent)
        pack_hash(pk, first->parent);
    else
        msgpack_pack_nil(pk);
    PACK_LIT(pk, "token_ids");
    msgpack_pack_array(pk, (size_t)nblk * b->block_size);
    for (uint32_t k = i; k < j; k++) {
        const int32_t *t = b->tok + b->rec[k].tok_off;
        for (uint32_t m = 0; m < b->block_size; m++)
            msgpack_pack_int32(pk, t[m]);
    }
    PACK_LIT(pk, "block_size");
    msgpack_pack_uint32(pk, b->block_size);
    PACK_LIT(pk, "lora_id");
    msgpack_pack_nil(pk);
    pack_medium(pk, first->medium);
    PACK_LIT(pk, "lora_name");
    msgpack_pack_nil(pk);
    /* one 1-tuple per block: the scope's name in vLLM's cache_salt position */
    PACK_LIT(pk, "extra_keys");
    msgpack_pack_array(pk, nblk);
    for (uint32_t k = 0; k < nblk; k++) {
        msgpack_pack_array(pk, 1);
        msgpack_pack_str(pk, name_len);
        msgpack_pack_str_body(pk, name, name_len);
    }
}

/* Writes the BlockRemoved of records [i, j). */
static void pack_removed(ev_sink_t *s, const kvp_ev_batch_t *b, uint32_t i, uint32_t j)
{
    EV_PACKER(pk, s);
    msgpack_pack_map(pk, 3);
    PACK_LIT(pk, "type");
    PACK_LIT(pk, "BlockRemoved");
    PACK_LIT(pk, "block_hashes");
    msgpack_pack_array(pk, j - i);
    for (uint32_t k = i; k < j; k++)
        pack_hash(pk, b->rec[k].hash);
    pack_medium(pk, b->rec[i].medium);
}

int kvp_ev_encode(const kvp_ev_batch_t *b, uint32_t dp_rank, kvp_ev_buf_t *out, uint32_t *events)
{
    if (!b || !out)
        return KVP_EINVAL;
    size_t bound;
    uint32_t nev;
    int rc = ev_check(b, &bound, &nev);
    if (rc == KVP_EINVAL)
        return rc;
    out->len = 0;
    if (rc || ev_reserve(out, bound, 0))
        return KVP_ENOMEM;

    ev_sink_t sink = {.out = out, .p = out->data, .end = out->data + out->cap, .failed = 0};
    EV_PACKER(pk, &sink);
    msgpack_pack_array(pk, 3);
    msgpack_pack_double(pk, b->ts);
    msgpack_pack_array(pk, nev);
    for (uint32_t i = 0; i < b->n;) {
        uint32_t j = i + 1;
        while (j < b->n && continues(b, &b->rec[j - 1], &b->rec[j]))
            j++;
        switch (b->rec[i].kind) {
        case KVP_EV_STORED:
            pack_stored(&sink, b, i, j);
            break;
        case KVP_EV_REMOVED:
            pack_removed(&sink, b, i, j);
            break;
        default: /* KVP_EV_CLEARED: never continued, j == i + 1 */
            msgpack_pack_map(pk, 1);
            PACK_LIT(pk, "type");
            PACK_LIT(pk, "AllBlocksCleared");
            break;
        }
        i = j;
    }
    msgpack_pack_uint32(pk, dp_rank);
    if (sink.failed)
        return KVP_ENOMEM; /* out->len is still 0 */
    out->len = (size_t)(sink.p - out->data);
    if (events)
        *events = nev;
    return 0;
}
