/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_pagekey.c - content keys of full pages (kvcache/kvp_pagekey.h): the root key of a salt
 * is the seeded XXH3-128 of its length and bytes (known answers), no salt reproduces another
 * chain's page key (issue #26 defect 4), a page's key is XXH3-128 of the
 * previous key's bytes followed by its token ids (checked against xxHash's streaming API over
 * the same bytes), a chain grown page by page equals one hashed at once, a token changes its
 * page's key and every later one but no earlier one, and only full pages get keys.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_pagekey.h"
#include "kvp_test_util.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

/* The reference: XXH3-128 of prev's 16 bytes then the page's tokens, through the stream API. */
static kvp_pagekey_t reference(kvp_pagekey_t prev, const int32_t *tok, uint32_t ps)
{
    XXH3_state_t st;
    XXH3_128bits_reset(&st);
    uint8_t kb[16];
    memcpy(kb, &prev.lo, 8);
    memcpy(kb + 8, &prev.hi, 8);
    XXH3_128bits_update(&st, kb, 16);
    XXH3_128bits_update(&st, tok, (size_t)ps * 4);
    XXH128_hash_t h = XXH3_128bits_digest(&st);
    return (kvp_pagekey_t){h.low64, h.high64};
}

/* Known answers (computed with the Python xxhash package, an implementation independent of
 * the one compiled here): a root key is XXH3-128 with seed "kvpoolrt" (little-endian) of the
 * salt's length as le32 then the salt; the empty salt is not the zero key. */
START_TEST(the_root_key_is_the_seeded_xxh3_128_of_the_salts_length_and_bytes)
{
    kvp_pagekey_t k;
    ck_assert_uint_eq(KVP_PAGEKEY_ROOT_SEED, 0x74726c6f6f70766bull);
    ck_assert_int_eq(kvp_pagekey_root(NULL, 0, &k), 0);
    ck_assert_uint_eq(k.lo, 0x1ecd5023640d7f89ull);
    ck_assert_uint_eq(k.hi, 0xfef0bb7b01427b24ull);
    ck_assert_int_eq(kvp_pagekey_root("abc", 3, &k), 0);
    ck_assert_uint_eq(k.lo, 0x320b7fa5c3e083a0ull);
    ck_assert_uint_eq(k.hi, 0x5ecc84fae842ed32ull);
    ck_assert_int_eq(kvp_pagekey_root("tenantX", 7, &k), 0);
    ck_assert_uint_eq(k.lo, 0x86ddab04da1477f6ull);
    ck_assert_uint_eq(k.hi, 0x318e92b46a52647bull);
    /* and the first page after the empty salt's root, tokens 500..503 */
    ck_assert_int_eq(kvp_pagekey_root(NULL, 0, &k), 0);
    const int32_t tok[4] = {500, 501, 502, 503};
    kvp_pagekey_t p = kvp_pagekey_next(k, tok, 4);
    ck_assert_uint_eq(p.lo, 0x5f3019db7300e4eaull);
    ck_assert_uint_eq(p.hi, 0x451e7cbfb5178351ull);
    static uint8_t big[KVP_PAGEKEY_MAX_SALT + 1];
    ck_assert_int_eq(kvp_pagekey_root(big, KVP_PAGEKEY_MAX_SALT, &k), 0);
    ck_assert_int_eq(kvp_pagekey_root(big, KVP_PAGEKEY_MAX_SALT + 1, &k), KVP_EINVAL);
    ck_assert_int_eq(kvp_pagekey_root(NULL, 4, &k), KVP_EINVAL);
}
END_TEST

/* Issue #26 defect 4: a salt made of (a chain key || one page of token ids) used to hash to the
 * next page key of that chain, so a tenant could continue another's chain. No salt of that
 * shape reproduces it now, for the zero key, a real root and a deeper key, and a salt that is a
 * prefix of another's bytes gives another root. */
START_TEST(no_salt_reproduces_a_page_key_of_another_chain)
{
    static const uint32_t sizes[] = {1, 4, 16, 60};
    for (unsigned s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        const uint32_t ps = sizes[s];
        int32_t tok[2 * 60];
        for (uint32_t i = 0; i < 2 * ps; i++)
            tok[i] = 500 + (int32_t)i;
        kvp_pagekey_t starts[3] = {{0, 0}};
        ck_assert_int_eq(kvp_pagekey_root("tenantX", 7, &starts[1]), 0);
        starts[2] = kvp_pagekey_next(starts[1], tok, ps);
        for (int c = 0; c < 3; c++) {
            uint8_t salt[16 + 60 * 4];
            memcpy(salt, &starts[c], 16);
            memcpy(salt + 16, tok + ps, ps * 4);
            kvp_pagekey_t forged, real = kvp_pagekey_next(starts[c], tok + ps, ps);
            ck_assert_int_eq(kvp_pagekey_root(salt, 16 + ps * 4, &forged), 0);
            ck_assert_msg(!kvp_pagekey_eq(forged, real), "page size %u, start %d", ps, c);
            /* nor does the forged root's chain meet the real one a page later */
            ck_assert(!kvp_pagekey_eq(kvp_pagekey_next(forged, tok, ps),
                                      kvp_pagekey_next(real, tok, ps)));
        }
    }
    kvp_pagekey_t a, b;
    ck_assert_int_eq(kvp_pagekey_root("ab", 2, &a), 0);
    ck_assert_int_eq(kvp_pagekey_root("ab\0", 3, &b), 0);
    ck_assert(!kvp_pagekey_eq(a, b));
}
END_TEST

START_TEST(a_page_key_hashes_the_previous_key_then_the_tokens)
{
    kvp_rng_t rng;
    kvp_rng_seed(&rng, kvp_test_seed(16));
    static const uint32_t sizes[] = {1, 4, 16, 64, 256, 257, 1000};
    for (unsigned s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        const uint32_t ps = sizes[s];
        int32_t *tok = malloc(ps * 4);
        for (uint32_t i = 0; i < ps; i++)
            tok[i] = (int32_t)kvp_rng_next(&rng);
        kvp_pagekey_t prev = {kvp_rng_next(&rng), kvp_rng_next(&rng)};
        kvp_pagekey_t a = kvp_pagekey_next(prev, tok, ps), b = reference(prev, tok, ps);
        ck_assert_msg(kvp_pagekey_eq(a, b), "page size %u", ps);
        free(tok);
    }
}
END_TEST

START_TEST(a_chain_grows_without_rehashing_and_a_token_changes_only_what_follows)
{
    enum { PS = 16, PAGES = 9 };
    int32_t tok[PAGES * PS + 7]; /* a partial last page of 7 tokens */
    for (int i = 0; i < (int)(sizeof(tok) / 4); i++)
        tok[i] = 1000 + i * 7;
    kvp_pagekey_t root, all[PAGES + 1], part[PAGES];
    ck_assert_int_eq(kvp_pagekey_root("lora-7", 6, &root), 0);
    /* only full pages: 9 keys for 151 tokens */
    ck_assert_uint_eq(kvp_pagekey_chain(root, tok, sizeof(tok) / 4, PS, all, PAGES + 1), PAGES);
    ck_assert(kvp_pagekey_eq(all[0], reference(root, tok, PS)));
    for (int i = 1; i < PAGES; i++)
        ck_assert(kvp_pagekey_eq(all[i], reference(all[i - 1], tok + i * PS, PS)));
    /* grown in three steps (2, 3, then 4 pages and the partial one): the same keys */
    ck_assert_uint_eq(kvp_pagekey_chain(root, tok, 2 * PS + 5, PS, part, PAGES), 2);
    ck_assert_uint_eq(kvp_pagekey_chain(part[1], tok + 2 * PS, 3 * PS, PS, part + 2, PAGES), 3);
    ck_assert_uint_eq(kvp_pagekey_chain(part[4], tok + 5 * PS, 4 * PS + 7, PS, part + 5, PAGES - 5),
                      4);
    for (int i = 0; i < PAGES; i++)
        ck_assert(kvp_pagekey_eq(part[i], all[i]));
    /* max_keys bounds what is written */
    ck_assert_uint_eq(kvp_pagekey_chain(root, tok, sizeof(tok) / 4, PS, part, 3), 3);
    ck_assert_uint_eq(kvp_pagekey_chain(root, tok, sizeof(tok) / 4, 0, part, 3), 0);
    /* one token of page 4 changed: pages 0..3 keep their keys, 4..8 all change */
    tok[4 * PS + 3] ^= 1;
    ck_assert_uint_eq(kvp_pagekey_chain(root, tok, sizeof(tok) / 4, PS, part, PAGES), PAGES);
    for (int i = 0; i < PAGES; i++)
        ck_assert_int_eq(kvp_pagekey_eq(part[i], all[i]), i < 4);
    tok[4 * PS + 3] ^= 1;
    /* another salt: every key differs */
    kvp_pagekey_t other;
    ck_assert_int_eq(kvp_pagekey_root("lora-8", 6, &other), 0);
    ck_assert_uint_eq(kvp_pagekey_chain(other, tok, sizeof(tok) / 4, PS, part, PAGES), PAGES);
    for (int i = 0; i < PAGES; i++)
        ck_assert(!kvp_pagekey_eq(part[i], all[i]));
}
END_TEST

int main(void)
{
    Suite *s = suite_create("pagekey");
    TCase *tc = tcase_create("pagekey");
    tcase_add_test(tc, the_root_key_is_the_seeded_xxh3_128_of_the_salts_length_and_bytes);
    tcase_add_test(tc, no_salt_reproduces_a_page_key_of_another_chain);
    tcase_add_test(tc, a_page_key_hashes_the_previous_key_then_the_tokens);
    tcase_add_test(tc, a_chain_grows_without_rehashing_and_a_token_changes_only_what_follows);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
