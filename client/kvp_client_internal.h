/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_client_internal.h - what libkvpool's files share and the public API does not show: the
 * message-building and reply-decoding steps apart from the socket (kvp_client_wire.c, checked
 * against the daemon's decoder by tests/unit/test_client_wire.c), and the handle's scratch
 * request, round trip and error slot (kvp_client.c), through which the files of the calls
 * (kvp_client_seq.c, _cache.c, _xfer.c, _admin.c, _cuda.c) talk to the daemon. Not installed
 * and not exported from the shared library (kvp__ names); the public API is kvpool.h.
 */
#ifndef KVP_CLIENT_INTERNAL_H
#define KVP_CLIENT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kvp_wire.h"
#include "kvpool.h"

/* Points b at the caller's n sequence ids and token counts (num_tokens may be NULL: the field
 * is then left out); token_ids, salts and salt_lens empty (left out). The arrays are borrowed
 * until the request is encoded. */
void kvp__client_batch_arrays(kvp_batch_arrays_t *b, const uint64_t *seq_ids,
                              const uint32_t *num_tokens, uint32_t n);

/* Adds the prefix-cache arrays of cache (may be NULL: nothing) to a b made by
 * kvp__client_batch_arrays for n sequences: token_ids (sum(num_tokens) entries), salt_lens (n)
 * and salts (sum(salt_lens) bytes). Returns 0 or KVP_EINVAL with *why set (salts without
 * salt_lens, salt bytes without salts, sums above UINT32_MAX). */
int kvp__client_batch_cache(kvp_batch_arrays_t *b, const uint32_t *num_tokens, uint32_t n,
                            const kvp_cache_opts_t *cache, const char **why);

/* The CacheOptions of cache: *has is set when any option differs from the defaults (reuse,
 * leave_last, a priority, a retention), and o filled. Returns 0, or KVP_EINVAL for a priority
 * below -1. */
int kvp__client_cache_options(kvpool_CacheOptions *o, bool *has, const kvp_cache_opts_t *cache);

/* Zeroes req and makes it a request of body `which_body` (kvpool_Request_append_tag,
 * _reserve_tag, _release_tag or _get_page_table_tag) whose Batch encodes b; the caller then
 * sets the other fields of the body. Returns 0, or KVP_EINVAL for a body without a batch. */
int kvp__client_request_batch(kvpool_Request *req, pb_size_t which_body, kvp_batch_arrays_t *b);

/* sum(v[0..n)) into *out; 0, or KVP_EINVAL when it does not fit in uint32. */
int kvp__client_sum_u32(const uint32_t *v, uint32_t n, uint32_t *out);

/* The salts of n sequences or prompts (salt_lens NULL: none) as the salts and salt_lens arrays
 * of b, borrowed until the request is encoded. Returns 0 or KVP_EINVAL with *why set (salts
 * without salt_lens, salt bytes without salts, more than 4 GiB of them). */
int kvp__client_salt_arrays(kvp_batch_arrays_t *b, const uint8_t *salts, const uint32_t *salt_lens,
                            uint32_t n, const char **why);

/* Points r at the arrays of t with their capacities (t may be NULL), cached_tokens with cap
 * cap_batch; host_tokens (a Lookup's, set by the caller) is left a sink. An array whose pointer
 * is NULL is a sink: its bytes are skipped and counted. copies are counted in (src, dst) pairs. */
void kvp__client_table_arrays(kvp_reply_arrays_t *r, const kvp_page_table_t *t);

/* Decodes one response payload into resp, the bulk arrays into r (NULL-data arrays skipped).
 * Returns 0; KVP_ELIMIT when an array or text of r is smaller than the reply; KVP_EPROTO when
 * the bytes are not a valid Response. err (err_len bytes, may be NULL) receives the reason. */
int kvp__client_decode_response(kvpool_Response *resp, kvp_reply_arrays_t *r, const uint8_t *buf,
                                size_t len, char *err, size_t err_len);

/* After a decode: fills t's batch_size, nnz, num_indices, num_copies from the page table in
 * resp (all 0 when it carries none), zeroes t->cached_tokens[batch_size] when the answer has
 * none, and checks the arrays agree with batch_size. Returns 0, KVP_EPROTO, or KVP_ELIMIT
 * (cached_tokens to zero beyond cap_batch). t may be NULL (then only the check runs). */
int kvp__client_table_fill(kvp_page_table_t *t, const kvpool_Response *resp,
                           const kvp_reply_arrays_t *r);

/* batch_size of the page table a decoded resp carries (0 when it carries none). */
uint32_t kvp__client_response_batch_size(const kvpool_Response *resp);

/* ---- the handle's internals for the files of the calls (kvp_client.c holds the handle) ---- */

/* kvp_client_append with a synchronisation mode (SYNC_EVENT for the cuda backend). */
int kvp__client_append(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                       uint32_t n, const kvp_source_t *src, kvpool_SyncMode sync,
                       kvp_page_table_t *table);

/* The same with tensor-parallel rank sources (num_ranks 0: the single-source form) and the
 * prefix cache (cache NULL: none). */
int kvp__client_append_ranks(kvp_client_t *c, const uint64_t *seq_ids, const uint32_t *num_tokens,
                             uint32_t n, const kvp_source_t *src, const kvp_rank_source_t *ranks,
                             uint32_t num_ranks, kvpool_SyncMode sync,
                             const kvp_cache_opts_t *cache, kvp_page_table_t *table);

/* 1 when the last answer was an AppendResponse whose copy had completed on the device. */
int kvp__client_append_completed(const kvp_client_t *c);

/* Zeroes the handle's scratch request, sets its body and returns it (valid until the next
 * call on the handle). */
kvpool_Request *kvp__client_request(kvp_client_t *c, pb_size_t which_body);

/* The scratch request as it is (not zeroed): for kvp__client_request_batch, which zeroes it
 * itself. Valid until the next call on the handle. */
kvpool_Request *kvp__client_scratch_request(kvp_client_t *c);

/* Sends the scratch request with nfds fds attached (borrowed, not closed), decodes the answer
 * into the scratch response (bulk arrays into r; NULL skips them) and checks its id, status and
 * body (expect; 0 accepts any). Fds attached to the answer are closed. Returns 0 or the code,
 * with last_error set. */
int kvp__client_call(kvp_client_t *c, pb_size_t expect, kvp_reply_arrays_t *r, const int *fds,
                     unsigned nfds);

/* The scratch response of the last call (valid until the next call). */
const kvpool_Response *kvp__client_response(const kvp_client_t *c);

/* Leaves a printf-formatted reason in last_error and returns rc. */
int kvp__client_fail(kvp_client_t *c, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The handle's per-call timeout, and a new one (Import waits for the whole transfer). */
uint32_t kvp__client_timeout_ms(const kvp_client_t *c);
void kvp__client_set_timeout_ms(kvp_client_t *c, uint32_t timeout_ms);

/* The handle's slot for kvp_client_cuda.c's state (NULL until that file makes one). */
void **kvp__client_cuda_state(kvp_client_t *c);

/* What kvp_client_pool_base returns for device when the pool is not host-mapped (the device
 * pointer of the cuda backend's mapping); devices beyond the pool fds are ignored. */
void kvp__client_set_pool_base(kvp_client_t *c, uint32_t device, void *base);

/* Number of pool fds that came with Hello (one per device; 0 without map_pool). */
uint32_t kvp__client_num_pool(const kvp_client_t *c);

/* Frees kvp_client_cuda.c's state (device mappings, buffers, events); a no-op when there is
 * none or without CUDA. Called first by kvp_client_close. */
void kvp__client_cuda_close(kvp_client_t *c);

#endif
