/* SPDX-License-Identifier: Apache-2.0 */
/* kvp_raw.c - see kvp_raw.h. */
#include "kvp_raw.h"

#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvp_sock.h"

void kvp_raw_open(kvp_raw_t *w, const char *path)
{
    memset(w, 0, sizeof(*w));
    ck_assert_int_eq(kvp_sock_connect(path, 2000, &w->fd), 0);
    for (int i = 0; i < 6; i++) {
        w->arr[i] = malloc(KVP_RAW_MAX_ENTRIES * sizeof(int32_t));
        ck_assert_ptr_nonnull(w->arr[i]);
    }
}

void kvp_raw_close(kvp_raw_t *w)
{
    if (w->fd >= 0)
        close(w->fd);
    w->fd = -1;
    free(w->rbuf);
    w->rbuf = NULL;
    for (int i = 0; i < 6; i++) {
        free(w->arr[i]);
        w->arr[i] = NULL;
    }
}

void kvp_raw_send(kvp_raw_t *w, const kvpool_Request *q, const int *fds, unsigned nfds)
{
    long size = kvp_wire_encoded_size(kvpool_Request_fields, q);
    ck_assert_int_gt(size, 0);
    uint8_t *buf = malloc((size_t)size + KVP_FRAME_HDR_BYTES);
    ck_assert_ptr_nonnull(buf);
    long n =
        kvp_wire_encode_frame(kvpool_Request_fields, q, buf, (size_t)size + KVP_FRAME_HDR_BYTES);
    ck_assert_int_gt(n, 0);
    ck_assert_int_eq(kvp_sock_send_frame(w->fd, buf, (size_t)n, fds, nfds, kvp_sock_deadline(5000)),
                     0);
    free(buf);
}

int kvp_raw_recv(kvp_raw_t *w, kvpool_Response *resp)
{
    uint32_t len;
    int fds[8];
    unsigned nfds = 0;
    int rc = kvp_sock_recv_frame(w->fd, &w->rbuf, &w->rcap, &len, 1u << 26, fds, 8, &nfds,
                                 kvp_sock_deadline(10000));
    for (unsigned i = 0; i < nfds; i++)
        close(fds[i]);
    if (rc)
        return -1;
    w->len = len;
    memset(resp, 0, sizeof(*resp));
    memset(&w->last, 0, sizeof(w->last));
    kvp_array_t *all[] = {&w->last.kv_indptr,     &w->last.kv_indices, &w->last.kv_last_page_len,
                          &w->last.append_indptr, &w->last.seq_lens,   &w->last.copies};
    for (int i = 0; i < 6; i++)
        *all[i] = kvp_array(w->arr[i], 4, 0, KVP_RAW_MAX_ENTRIES);
    kvp_wire_response_bind_decode(resp, &w->last);
    ck_assert_int_eq(kvp_wire_decode(kvpool_Response_fields, resp, w->rbuf, len, NULL), 0);
    return resp->status.code;
}

int kvp_raw_call(kvp_raw_t *w, const kvpool_Request *q, const int *fds, unsigned nfds,
                 kvpool_Response *resp)
{
    kvp_raw_send(w, q, fds, nfds);
    return kvp_raw_recv(w, resp);
}

int kvp_raw_hello(kvp_raw_t *w, const char *ns, kvpool_Response *resp)
{
    kvpool_Request q = {.id = 1, .which_body = kvpool_Request_hello_tag};
    q.body.hello.protocol_version = KVP_PROTOCOL_VERSION;
    snprintf(q.body.hello.namespace, sizeof(q.body.hello.namespace), "%s", ns);
    return kvp_raw_call(w, &q, NULL, 0, resp);
}

kvpool_Request kvp_raw_batch_req(pb_size_t tag, uint64_t id, kvp_batch_arrays_t *b)
{
    kvpool_Request q = {.id = id, .which_body = tag};
    kvpool_Batch *batch = NULL;
    switch (tag) {
    case kvpool_Request_reserve_tag:
        q.body.reserve.has_batch = true;
        batch = &q.body.reserve.batch;
        break;
    case kvpool_Request_append_tag:
        q.body.append.has_batch = true;
        batch = &q.body.append.batch;
        break;
    case kvpool_Request_release_tag:
        q.body.release.has_batch = true;
        batch = &q.body.release.batch;
        break;
    case kvpool_Request_get_page_table_tag:
        q.body.get_page_table.has_batch = true;
        batch = &q.body.get_page_table.batch;
        break;
    default:
        ck_abort_msg("kvp_raw_batch_req: tag %u has no batch", (unsigned)tag);
    }
    kvp_wire_batch_bind_encode(batch, b);
    return q;
}

int kvp_raw_sealed_memfd(size_t size)
{
    int fd = memfd_create("stage", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
    ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    return fd;
}

int kvp_raw_register_fd(kvp_raw_t *w, uint64_t id, int fd, uint64_t size, kvpool_Response *resp)
{
    kvpool_Request q = {.id = id, .which_body = kvpool_Request_register_buffer_tag};
    q.body.register_buffer.size_bytes = size;
    q.body.register_buffer.kind = kvpool_BufferKind_BUFFER_MEMFD;
    return kvp_raw_call(w, &q, &fd, 1, resp);
}

uint32_t kvp_raw_register_memfd(kvp_raw_t *w, uint64_t id, size_t size)
{
    int fd = kvp_raw_sealed_memfd(size);
    kvpool_Response resp;
    ck_assert_int_eq(kvp_raw_register_fd(w, id, fd, size, &resp), kvpool_Code_OK);
    close(fd);
    return resp.body.register_buffer.buffer_id;
}

int kvp_raw_seq_len(kvp_raw_t *w, uint64_t seq)
{
    uint32_t zero = 0;
    kvp_batch_arrays_t b = {.seq_ids = kvp_array(&seq, 8, 1, 1),
                            .num_tokens = kvp_array(&zero, 4, 0, 0)};
    kvpool_Request q = kvp_raw_batch_req(kvpool_Request_get_page_table_tag, 0, &b);
    kvpool_Response resp;
    if (kvp_raw_call(w, &q, NULL, 0, &resp) != kvpool_Code_OK)
        return -1;
    ck_assert_uint_eq(w->last.seq_lens.count, 1);
    return w->arr[4][0];
}
