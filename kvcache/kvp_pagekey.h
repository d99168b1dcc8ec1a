/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_pagekey.h - content keys of full pages (DESIGN.md §9, issue #16): a 128-bit chained hash
 * that names the KV a page holds, so that it can be found again and shared. The key of page i
 * of a sequence is XXH3-128 (seed 0) over (the key of page i-1, the page's page_size token ids
 * as little-endian int32); page 0 chains from the sequence's root key, XXH3-128 with seed
 * KVP_PAGEKEY_ROOT_SEED over (the salt's length as a little-endian uint32, the salt): bytes
 * that separate what must never mix (LoRA adapter, multimodal inputs, tenant); no salt is the
 * empty salt. The two domains differ (seed, length prefix), so no salt reproduces a page key of
 * another chain. Only full pages have keys; a partial last page stays private.
 *
 * A sequence that grows keeps its chain: kvp_pagekey_chain continues from the last key it
 * returned, so a token is hashed once. Pure C (libc and xxHash's header, inlined: nothing to
 * link). Any thread; no state.
 */
#ifndef KVP_PAGEKEY_H
#define KVP_PAGEKEY_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t lo, hi;
} kvp_pagekey_t;

/* Bytes of salt a sequence may carry (what kvp_pagekey_root accepts). */
#define KVP_PAGEKEY_MAX_SALT 256u
/* The seed of root keys ("kvpoolrt" as a little-endian word); page keys use seed 0. */
#define KVP_PAGEKEY_ROOT_SEED 0x74726c6f6f70766bull

/* The root key of a sequence: XXH3-128, seed KVP_PAGEKEY_ROOT_SEED, of le32(salt_len) || salt.
 * Returns 0, or KVP_EINVAL (salt_len above KVP_PAGEKEY_MAX_SALT, or salt NULL with a length). */
int kvp_pagekey_root(const void *salt, size_t salt_len, kvp_pagekey_t *out);

/* The key of the page after prev holding tokens[0..page_size). */
kvp_pagekey_t kvp_pagekey_next(kvp_pagekey_t prev, const int32_t *tokens, uint32_t page_size);

/* Keys of the full pages in tokens[0..num_tokens): keys[i] for page i, chained from prev (the
 * root key, or the key of the page before tokens[0] when a sequence grows). Writes at most
 * max_keys keys and returns how many it wrote: min(num_tokens / page_size, max_keys). The
 * tokens of a partial last page are not hashed. page_size 0 returns 0. */
uint32_t kvp_pagekey_chain(kvp_pagekey_t prev, const int32_t *tokens, uint64_t num_tokens,
                           uint32_t page_size, kvp_pagekey_t *keys, uint32_t max_keys);

static inline int kvp_pagekey_eq(kvp_pagekey_t a, kvp_pagekey_t b)
{
    return a.lo == b.lo && a.hi == b.hi;
}

#endif
