/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pagekey.c - content keys of full pages (see kvp_pagekey.h). One XXH3-128 call per page
 * over a stack buffer holding the previous key and the page's token ids: a streaming state per
 * page would cost more than the hash itself at page 16 (64 bytes of tokens). Pages of more
 * than STACK_TOKENS tokens go through the streaming API instead.
 *
 * Domain separation (issue #26 defect 4): a root key and a page key are different functions.
 * Root keys hash (salt length, salt) under the seed KVP_PAGEKEY_ROOT_SEED; page keys hash
 * (previous key, token ids) under seed 0. Before, both were plain XXH3-128, so a salt equal to
 * (a chain key || one page of ids) made a root equal to that chain's next page key and a
 * tenant could continue another chain. Page keys keep seed 0 because a seeded XXH3 call on
 * more than 240 bytes (pages above 56 tokens) derives a secret per call; the root, hashed once
 * per sequence, pays that instead.
 */
#include "kvp_pagekey.h"

#include <string.h>

#include "kvp_error.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

#define STACK_TOKENS 256u

_Static_assert(sizeof(kvp_pagekey_t) == 16, "two 64-bit words, hashed as they lie");

static kvp_pagekey_t from_xxh(XXH128_hash_t h)
{
    return (kvp_pagekey_t){.lo = h.low64, .hi = h.high64};
}

int kvp_pagekey_root(const void *salt, size_t salt_len, kvp_pagekey_t *out)
{
    if (!out || salt_len > KVP_PAGEKEY_MAX_SALT || (salt_len && !salt))
        return KVP_EINVAL;
    /* the salt's length goes first, little-endian, so no salt is a prefix of another's input */
    uint8_t buf[4 + KVP_PAGEKEY_MAX_SALT];
    const uint32_t len = (uint32_t)salt_len;
    buf[0] = (uint8_t)len;
    buf[1] = (uint8_t)(len >> 8);
    buf[2] = (uint8_t)(len >> 16);
    buf[3] = (uint8_t)(len >> 24);
    if (salt_len)
        memcpy(buf + 4, salt, salt_len);
    *out = from_xxh(XXH3_128bits_withSeed(buf, 4 + salt_len, KVP_PAGEKEY_ROOT_SEED));
    return 0;
}

/* The key bytes are little-endian words and the tokens little-endian int32, on every host: the
 * keys are the same on any machine (x86-64 and aarch64 both are little-endian; a big-endian
 * host would need byte swaps here). */
kvp_pagekey_t kvp_pagekey_next(kvp_pagekey_t prev, const int32_t *tokens, uint32_t page_size)
{
    const size_t tok_bytes = (size_t)page_size * sizeof(int32_t);
    if (page_size <= STACK_TOKENS) {
        uint8_t buf[sizeof(kvp_pagekey_t) + STACK_TOKENS * sizeof(int32_t)];
        memcpy(buf, &prev, sizeof(prev));
        memcpy(buf + sizeof(prev), tokens, tok_bytes);
        return from_xxh(XXH3_128bits(buf, sizeof(prev) + tok_bytes));
    }
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    XXH3_128bits_update(&st, &prev, sizeof(prev));
    XXH3_128bits_update(&st, tokens, tok_bytes);
    return from_xxh(XXH3_128bits_digest(&st));
}

uint32_t kvp_pagekey_chain(kvp_pagekey_t prev, const int32_t *tokens, uint64_t num_tokens,
                           uint32_t page_size, kvp_pagekey_t *keys, uint32_t max_keys)
{
    if (page_size == 0 || !keys)
        return 0;
    uint64_t pages = num_tokens / page_size;
    uint32_t n = pages < max_keys ? (uint32_t)pages : max_keys;
    for (uint32_t i = 0; i < n; i++) {
        prev = kvp_pagekey_next(prev, tokens + (uint64_t)i * page_size, page_size);
        keys[i] = prev;
    }
    return n;
}
