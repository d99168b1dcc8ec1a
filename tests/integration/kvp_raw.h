/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_raw.h - a raw client for integration tests: it writes its own Request frames (any id,
 * any call, any fds) to a real kvpoold and decodes the answers, so a test controls exactly
 * what libkvpool would hide (request ids, retries on other connections, calls libkvpool never
 * sends). Check assertions inside: for tests only.
 */
#ifndef KVP_RAW_H
#define KVP_RAW_H

#include <stddef.h>
#include <stdint.h>

#include "kvp_wire.h"

typedef struct {
    int fd;
    uint8_t *rbuf; /* the last answer's frame payload (len bytes) */
    size_t rcap;
    uint32_t len;
    /* the bulk arrays of the last answer (kv_indptr, kv_indices, kv_last_page_len,
     * append_indptr, seq_lens, copies), each up to KVP_RAW_MAX_ENTRIES entries */
    int32_t *arr[6];
    kvp_reply_arrays_t last;
} kvp_raw_t;

#define KVP_RAW_MAX_ENTRIES (1u << 18)

/* Connects to the socket at path (asserts). */
void kvp_raw_open(kvp_raw_t *w, const char *path);
void kvp_raw_close(kvp_raw_t *w);
/* Encodes q and sends it with fds (asserts it was sent). */
void kvp_raw_send(kvp_raw_t *w, const kvpool_Request *q, const int *fds, unsigned nfds);
/* Receives one answer into resp (its arrays bound to w->arr); returns its status code, or -1
 * when the connection closed or nothing came within 10 s. */
int kvp_raw_recv(kvp_raw_t *w, kvpool_Response *resp);
/* Sends q and returns the status of its answer. */
int kvp_raw_call(kvp_raw_t *w, const kvpool_Request *q, const int *fds, unsigned nfds,
                 kvpool_Response *resp);
/* Hello in namespace ns (protocol KVP_PROTOCOL_VERSION); returns the status. */
int kvp_raw_hello(kvp_raw_t *w, const char *ns, kvpool_Response *resp);

/* A memfd of size bytes sealed against shrinking (what RegisterBuffer needs; asserts). */
int kvp_raw_sealed_memfd(size_t size);
/* RegisterBuffer of fd (kind memfd, size_bytes size) with request id id: the status. */
int kvp_raw_register_fd(kvp_raw_t *w, uint64_t id, int fd, uint64_t size, kvpool_Response *resp);
/* RegisterBuffer of a fresh sealed memfd of size bytes (asserts OK): the buffer id. */
uint32_t kvp_raw_register_memfd(kvp_raw_t *w, uint64_t id, size_t size);
/* Tokens of sequence seq in the session's namespace (GetPageTable), or -1 when there is none. */
int kvp_raw_seq_len(kvp_raw_t *w, uint64_t seq);

/* Request builders: a batch call (Reserve, Append, Release, GetPageTable) over the given
 * arrays (they must outlive the send). */
kvpool_Request kvp_raw_batch_req(pb_size_t tag, uint64_t id, kvp_batch_arrays_t *b);

#endif
