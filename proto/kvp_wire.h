/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_wire.h - what both ends of the socket share besides the generated messages: the frame
 * header, nanopb callbacks that move bulk arrays (little-endian fixed-width integers in a
 * `bytes` field, see kvpool.proto) straight between the wire and caller-owned arrays, the
 * status-code mapping, and encode/decode helpers. No sockets here (server/ and client/ own
 * those); pure functions over buffers. Little-endian hosts only (checked at compile time).
 */
#ifndef KVP_WIRE_H
#define KVP_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "kvp_layout.h"
#include "kvp_pool_info.h"
#include "kvpool.pb.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVP_PROTOCOL_VERSION  1
#define KVP_FRAME_HDR_BYTES   4
#define KVP_MAX_FDS_PER_FRAME 16

static inline void kvp_frame_put_len(uint8_t hdr[4], uint32_t len)
{
    hdr[0] = (uint8_t)len;
    hdr[1] = (uint8_t)(len >> 8);
    hdr[2] = (uint8_t)(len >> 16);
    hdr[3] = (uint8_t)(len >> 24);
}

static inline uint32_t kvp_frame_get_len(const uint8_t hdr[4])
{
    return (uint32_t)hdr[0] | (uint32_t)hdr[1] << 8 | (uint32_t)hdr[2] << 16 |
           (uint32_t)hdr[3] << 24;
}

/*
 * A bulk array bound to a `bytes` field. Encoding writes count * elem_size bytes from data.
 * Decoding accepts a field whose length is a multiple of elem_size and at most cap elements,
 * copies it to data and sets count; otherwise it sets `bad` (KVP_EINVAL: not a multiple,
 * KVP_ELIMIT: above cap) and the decode fails. The struct is borrowed by the message until the
 * encode/decode call returns.
 */
typedef struct {
    void *data;
    uint32_t elem_size;
    uint32_t count;
    uint32_t cap;
    int bad;
} kvp_array_t;

static inline kvp_array_t kvp_array(void *data, uint32_t elem_size, uint32_t count, uint32_t cap)
{
    kvp_array_t a = {data, elem_size, count, cap, 0};
    return a;
}

/* Binds a to cb for encoding / for decoding. */
void kvp_array_bind_encode(pb_callback_t *cb, kvp_array_t *a);
void kvp_array_bind_decode(pb_callback_t *cb, kvp_array_t *a);

/* A text field (Metrics): encode writes len bytes of s; decode copies at most cap - 1 bytes
 * and NUL-terminates (bad = KVP_ELIMIT when longer). */
typedef struct {
    char *s;
    size_t len;
    size_t cap;
    int bad;
} kvp_text_t;
void kvp_text_bind_encode(pb_callback_t *cb, kvp_text_t *t);
void kvp_text_bind_decode(pb_callback_t *cb, kvp_text_t *t);

/* The arrays a decoded Request's bulk fields land in (server side), and those a client
 * request encodes. A kvp_array_t left zeroed (elem_size 0) takes no element: a field that
 * arrives for it fails the decode with bad = KVP_ELIMIT (an empty one decodes as count 0). */
typedef struct {
    kvp_array_t seq_ids;    /* uint64 */
    kvp_array_t num_tokens; /* uint32 (LookupRequest: its lengths) */
    kvp_array_t token_ids;  /* int32 */
    kvp_array_t salts;      /* uint8 */
    kvp_array_t salt_lens;  /* uint32 */
} kvp_batch_arrays_t;

/* The arrays a decoded Response's page table, Lookup answer and metrics text land in (client
 * side), and those a daemon answer encodes. */
typedef struct {
    kvp_array_t kv_indptr, kv_indices, kv_last_page_len, append_indptr, seq_lens, copies;
    kvp_array_t cached_tokens; /* uint32: PageTable.cached_tokens, LookupResponse.cached_tokens */
    kvp_array_t host_tokens;   /* uint32: LookupResponse.host_tokens (issue #28) */
    kvp_array_t dump_blocks;   /* uint8: CacheDumpResponse.blocks (issue #29) */
    kvp_array_t dump_names;    /* uint8: CacheDumpResponse.names */
    kvp_text_t text;
} kvp_reply_arrays_t;

/* Prepares req for pb_decode (the daemon sets each array's data and cap first; counts and
 * `bad` are reset here). Whichever body arrives, its bulk fields land in b:
 *   Batch of Reserve, Append, Release, GetPageTable, Commit: seq_ids, num_tokens, token_ids,
 *     salts, salt_lens -> the arrays of the same names;
 *   LookupRequest: token_ids -> token_ids, lengths -> num_tokens, salts -> salts,
 *     salt_lens -> salt_lens;
 *   PinRequest.token_ids, LoadRequest.token_ids -> token_ids.
 * A field longer than its array's cap fails the decode with that array's bad = KVP_ELIMIT (a
 * length that is not a multiple of the element: KVP_EINVAL). b is borrowed until the decode
 * returns. */
void kvp_wire_request_bind_decode(kvpool_Request *req, kvp_batch_arrays_t *b);

/* Prepares resp for pb_decode: a page table (cached_tokens included), a Lookup answer's
 * cached_tokens and host_tokens, a CacheDump answer's blocks and names, or metrics text lands
 * in r. */
void kvp_wire_response_bind_decode(kvpool_Response *resp, kvp_reply_arrays_t *r);

/* Binds a Batch for encoding (client side): seq_ids and num_tokens always, token_ids, salts
 * and salt_lens only when their count is > 0 (left out otherwise). */
void kvp_wire_batch_bind_encode(kvpool_Batch *batch, kvp_batch_arrays_t *b);

/* Binds a LookupRequest for encoding (client side): b->token_ids -> token_ids, b->num_tokens
 * -> lengths (both always), b->salts and b->salt_lens when their count is > 0. */
void kvp_wire_lookup_request_bind_encode(kvpool_LookupRequest *q, kvp_batch_arrays_t *b);

/* Binds a PinRequest's token ids for encoding (client side): b->token_ids. */
void kvp_wire_pin_request_bind_encode(kvpool_PinRequest *q, kvp_batch_arrays_t *b);

/* Binds a page table for encoding (server side): arrays as int32 / uint32-pair counts;
 * cached_tokens only when its count is > 0 (absent otherwise). */
void kvp_wire_table_bind_encode(kvpool_PageTable *t, kvp_reply_arrays_t *r);

/* Binds a LookupResponse for encoding (server side): r->cached_tokens, one uint32 per prompt,
 * and r->host_tokens when its count is > 0 (absent otherwise: no host tier). */
void kvp_wire_lookup_bind_encode(kvpool_LookupResponse *l, kvp_reply_arrays_t *r);
/* Binds a CacheDumpResponse for encoding (server side): r->dump_blocks, r->dump_names. */
void kvp_wire_dump_bind_encode(kvpool_CacheDumpResponse *d, kvp_reply_arrays_t *r);

/* Encodes msg into buf[KVP_FRAME_HDR_BYTES ..] and writes the frame header in front.
 * Returns the total frame length, or a negative code (KVP_ELIMIT: does not fit in cap). */
long kvp_wire_encode_frame(const pb_msgdesc_t *fields, const void *msg, uint8_t *buf, size_t cap);

/* kvp_wire_encode_frame(kvpool_Response_fields, resp, buf, cap), byte for byte and code for
 * code, for the daemon's hot answers: an OK Ping, Append, Reserve or GetPageTable answer
 * (arrays bound with kvp_array_bind_encode, cached_tokens included) is written directly, the
 * rest through nanopb.
 * Walking nanopb's field descriptors, once to size each submessage and once to write it, cost
 * more than the bytes of a 256-sequence page table. */
long kvp_wire_encode_response_frame(const kvpool_Response *resp, uint8_t *buf, size_t cap);

/* The same for the client's hot requests: a Ping, Reserve (with or without token ids, salts
 * and CacheOptions), Release or GetPageTable request (arrays bound with
 * kvp_wire_batch_bind_encode) is written directly, byte for byte as
 * kvp_wire_encode_frame(kvpool_Request_fields, ...) would, the rest through nanopb. */
long kvp_wire_encode_request_frame(const kvpool_Request *req, uint8_t *buf, size_t cap);

/* 1 when the two direct encoders above know every field of the messages they write (the
 * field counts of kvpool.proto they were written for), else 0: they then leave every message
 * to nanopb. For tests. */
int kvp__wire_direct_shapes_known(void);

/* Size of the encoding of msg (no header), or -1. */
long kvp_wire_encoded_size(const pb_msgdesc_t *fields, const void *msg);

/* Decodes len bytes (one frame payload, no header). Returns 0 or KVP_EINVAL (malformed, or a
 * bound array refused its field: its `bad` field then says why, KVP_EINVAL or KVP_ELIMIT).
 * err, when not NULL, receives nanopb's reason. */
int kvp_wire_decode(const pb_msgdesc_t *fields, void *msg, const uint8_t *buf, size_t len,
                    const char **err);

/* Our error code -> wire status code, and back (for clients). */
kvpool_Code kvp_wire_code_from_err(int err);
int kvp_wire_err_from_code(kvpool_Code code);
const char *kvp_wire_code_name(kvpool_Code code);

#ifdef __cplusplus
}
#endif
/* The one place the proto's Source fields meet common/kvp_layout.h: the client fills a request's
 * source from its layout, the daemon reads the layout out of a decoded one. */
void kvp_wire_source_put(kvpool_Source *o, uint32_t buffer_id, const kvp_src_layout_t *l,
                         uint32_t layer_begin, uint32_t layer_end);
void kvp_wire_source_layout(const kvpool_Source *s, kvp_src_layout_t *out);

/* The one place the proto's PoolInfo fields meet common/kvp_pool_info.h: the daemon puts its
 * description into an answer, the client gets it out of one. */
void kvp_wire_pool_info_put(kvpool_PoolInfo *o, const kvp_pool_info_t *i);
void kvp_wire_pool_info_get(kvp_pool_info_t *o, const kvpool_PoolInfo *p);

#endif
