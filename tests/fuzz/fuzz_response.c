/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fuzz_response.c - libFuzzer target for the client side decoder: the input is one frame
 * payload decoded as a kvpool_Response with kvp_wire_response_bind_decode bound to bounded
 * arrays (as the client library does). A decode that succeeds must leave every array within
 * its capacity and the text NUL-terminated within its buffer; the result is then encoded
 * again (the server side encode callbacks) to check that round trip is safe too. The prefix
 * cache's answers (issue #16) take the same path: PageTable.cached_tokens and
 * LookupResponse.cached_tokens land in a bounded array; Pin, Unpin, Commit, CacheFlush and
 * Stats.cache are plain fields.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CAP 64

static int32_t indptr[CAP], indices[CAP], last[CAP], aindptr[CAP], seq_lens[CAP];
static uint32_t copies[2 * CAP];
static uint32_t cached[CAP];
static char text[256];
static uint8_t out[1 << 16];

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static kvpool_Response resp;
    kvp_reply_arrays_t a = {.kv_indptr = kvp_array(indptr, 4, 0, CAP),
                            .kv_indices = kvp_array(indices, 4, 0, CAP),
                            .kv_last_page_len = kvp_array(last, 4, 0, CAP),
                            .append_indptr = kvp_array(aindptr, 4, 0, CAP),
                            .seq_lens = kvp_array(seq_lens, 4, 0, CAP),
                            .copies = kvp_array(copies, 8, 0, CAP),
                            .cached_tokens = kvp_array(cached, 4, 0, CAP),
                            .text = {.s = text, .len = 0, .cap = sizeof(text)}};
    memset(&resp, 0, sizeof(resp));
    kvp_wire_response_bind_decode(&resp, &a);
    if (kvp_wire_decode(kvpool_Response_fields, &resp, data, size, NULL) != 0)
        return 0;
    const kvp_array_t *arr[] = {&a.kv_indptr, &a.kv_indices, &a.kv_last_page_len, &a.append_indptr,
                                &a.seq_lens,  &a.copies,     &a.cached_tokens};
    for (size_t i = 0; i < sizeof(arr) / sizeof(arr[0]); i++)
        if (arr[i]->count > arr[i]->cap)
            abort();
    if (memchr(text, 0, sizeof(text)) == NULL)
        abort();
    /* encode it back: a page table through the server side binding */
    kvpool_PageTable *t = NULL;
    if (resp.which_body == kvpool_Response_reserve_tag)
        t = &resp.body.reserve.table;
    else if (resp.which_body == kvpool_Response_append_tag)
        t = &resp.body.append.table;
    else if (resp.which_body == kvpool_Response_get_page_table_tag)
        t = &resp.body.get_page_table.table;
    if (t)
        kvp_wire_table_bind_encode(t, &a);
    if (resp.which_body == kvpool_Response_lookup_tag)
        kvp_wire_lookup_bind_encode(&resp.body.lookup, &a);
    /* Stats.cache.scopes: a count within its array (nanopb checks max_count on decode) */
    if (resp.which_body == kvpool_Response_stats_tag &&
        resp.body.stats.stats.cache.scopes_count >
            sizeof(resp.body.stats.stats.cache.scopes) /
                sizeof(resp.body.stats.stats.cache.scopes[0]))
        abort();
    kvp_text_t et = {.s = text, .len = strlen(text), .cap = sizeof(text)};
    if (resp.which_body == kvpool_Response_metrics_tag)
        kvp_text_bind_encode(&resp.body.metrics.text, &et);
    (void)kvp_wire_encode_frame(kvpool_Response_fields, &resp, out, sizeof(out));
    return 0;
}
