/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvpoolctl_dump.c - `kvpoolctl cache dump`: the prefix cache's snapshot (issue #29), every
 * findable block with its hash, parent, scope, medium and token ids, read a page at a time
 * (kvp_client_cache_dump) and printed as a table or, with -o json, as one JSON object a KV-event
 * consumer loads before it applies the stream from next_seq on. The JSON is written compactly,
 * a block per line: a snapshot may hold millions of blocks.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"
#include "kvpoolctl.h"
#include "kvpoolctl_out.h"
#include "kvpoolctl_top.h"

static void hex(const uint8_t *b, char out[33])
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 15];
    }
    out[32] = '\0';
}

static const char *medium_name(int m)
{
    return m == 1 ? "CPU" : "GPU";
}

static void json_block(const kvp_cache_block_t *b, uint32_t block_size, int first)
{
    char h[33], p[33];
    hex(b->hash, h);
    printf("%s\n{\"hash\":\"%s\",\"parent\":", first ? "" : ",", h);
    if (b->has_parent) {
        hex(b->parent, p);
        printf("\"%s\"", p);
    } else {
        fputs("null", stdout);
    }
    /* scope names are [A-Za-z0-9._:@/+-] (kvpool.proto, Names): nothing to escape */
    printf(",\"scope\":\"%s\",\"medium\":\"%s\",\"token_ids\":[", b->scope, medium_name(b->medium));
    for (uint32_t t = 0; t < block_size; t++) {
        int32_t v;
        memcpy(&v, b->token_ids + t, sizeof(v));
        printf(t ? ",%d" : "%d", v);
    }
    fputs("]}", stdout);
}

static void text_block(const kvp_cache_block_t *b, char *buf, size_t len)
{
    char h[33], p[33] = "-";
    hex(b->hash, h);
    if (b->has_parent)
        hex(b->parent, p);
    printf("%-32s  %-6s  %-32s  %s\n", h, medium_name(b->medium), p,
           kvp_ctl_safe(b->scope, buf, len));
}

int kvp_ctl_cmd_cache_dump(ctl_t *x)
{
    int rc = kvp_ctl_connect(x, NULL, 0);
    if (rc)
        return rc;
    kvp_cache_dump_t d = {.records = malloc(KVP_CACHE_DUMP_MAX_BYTES),
                          .records_cap = KVP_CACHE_DUMP_MAX_BYTES,
                          .names = malloc(KVP_CACHE_DUMP_MAX_BYTES),
                          .names_cap = KVP_CACHE_DUMP_MAX_BYTES};
    if (!d.records || !d.names) {
        free(d.records);
        free(d.names);
        return kvp_ctl_report(x, KVP_ENOMEM, "cache dump");
    }
    uint32_t cursor = 0, pages = 0;
    uint64_t blocks = 0;
    int64_t next_seq = -1;
    char buf[160];
    do {
        rc = kvp_client_cache_dump(x->c, cursor, 0, &d);
        if (rc)
            break;
        if (pages++ == 0) { /* the first page's next_seq is the snapshot's (kvpool.proto) */
            next_seq = d.next_seq;
            if (x->o->json)
                printf("{\"next_seq\":%lld,\"events\":%s,\"block_size\":%u,\"blocks\":[",
                       (long long)d.next_seq, d.events ? "true" : "false", d.block_size);
            else if (!x->o->no_headers)
                printf("%-32s  %-6s  %-32s  %s\n", "HASH", "MEDIUM", "PARENT", "SCOPE");
        }
        for (uint32_t i = 0; i < d.num_blocks; i++) {
            kvp_cache_block_t b;
            if (kvp_cache_dump_block(&d, i, &b)) {
                rc = KVP_EPROTO;
                break;
            }
            if (x->o->json)
                json_block(&b, d.block_size, blocks == 0);
            else
                text_block(&b, buf, sizeof(buf));
            blocks++;
        }
        cursor = d.next_cursor;
    } while (rc == 0 && cursor != 0);
    free(d.records);
    free(d.names);
    if (rc) {
        if (x->o->json && pages)
            fputs("\n]}\n", stdout); /* what was printed stays valid JSON; the exit code says */
        return kvp_ctl_report(x, rc, "cache dump");
    }
    if (x->o->json)
        fputs("\n]}\n", stdout);
    else if (!x->o->no_headers)
        fprintf(stderr, "%llu block%s, events %s, next_seq %lld\n", (unsigned long long)blocks,
                blocks == 1 ? "" : "s", d.events ? "on" : "off", (long long)next_seq);
    return EXIT_OK;
}
