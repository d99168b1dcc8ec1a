/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc_buf.c - the buffer calls (RegisterBuffer, UnregisterBuffer: per connection, never
 * deduplicated) and the holds that keep a buffer alive while a job in flight reads it (see
 * kvp_rpc_internal.h).
 */
#include "kvp_rpc_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_log.h"

/* ---- buffers held by jobs ------------------------------------------------------------- */

static const void *buf_key(const kvp_buffer_t *b)
{
    return b->priv ? b->priv : b->host_ptr;
}

static held_buf_t *held_find(kvp_rpc_t *r, const void *key)
{
    for (held_buf_t *h = r->held; h; h = h->next)
        if (h->key == key)
            return h;
    return NULL;
}

/* A job will read b. 0 or KVP_ENOMEM. Loop thread. */
int kvp__rpc_buf_hold(kvp_rpc_t *r, const kvp_buffer_t *b)
{
    held_buf_t *h = held_find(r, buf_key(b));
    if (!h) {
        if (!(h = calloc(1, sizeof(*h))))
            return KVP_ENOMEM;
        h->key = buf_key(b);
        h->next = r->held;
        r->held = h;
    }
    h->refs++;
    return 0;
}

/* The job that held b finished: a buffer whose owner let go meanwhile is released now. */
void kvp__rpc_buf_unhold(kvp_rpc_t *r, const kvp_buffer_t *b)
{
    const void *key = buf_key(b);
    for (held_buf_t **pp = &r->held; *pp; pp = &(*pp)->next) {
        held_buf_t *h = *pp;
        if (h->key != key)
            continue;
        if (--h->refs == 0) {
            if (h->released)
                r->backend->ops->release_buffer(r->backend, &h->buf);
            *pp = h->next;
            free(h);
        }
        return;
    }
}

/* Its owner unregisters b (or closes): released now, or by the last job that reads it. */
void kvp__rpc_buf_release(kvp_rpc_t *r, kvp_buffer_t *b)
{
    held_buf_t *h = held_find(r, buf_key(b));
    if (h && !h->released) {
        h->buf = *b;
        h->released = 1;
        return;
    }
    r->backend->ops->release_buffer(r->backend, b);
}

/* ---- sessions ------------------------------------------------------------------------- */
int kvp__rpc_register_buffer(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                             kvp_rpc_io_t *io, uint64_t now_ms)
{
    const uint64_t id = req->id;
    const kvpool_RegisterBufferRequest *q = &req->body.register_buffer;
    (void)now_ms;
    kvpool_Response *resp = &io->resp;
    if (q->kind != kvpool_BufferKind_BUFFER_MEMFD &&
        r->backend->kind == kvpool_BackendKind_BACKEND_HOST) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "buffer kind %d not supported by the host backend",
                      (int)q->kind);
        return 0;
    }
    if (q->size_bytes == 0 || q->size_bytes > r->lim.max_buffer_bytes) {
        kvp_rpc_error(resp, id, KVP_EINVAL, "size_bytes %llu outside 1..%llu",
                      (unsigned long long)q->size_bytes,
                      (unsigned long long)r->lim.max_buffer_bytes);
        return 0;
    }
    const int wants_fd = q->kind != kvpool_BufferKind_BUFFER_CUDA_IPC;
    if (wants_fd && (io->nfds_in != 1 || io->fds_in[0] < 0)) {
        kvp_rpc_error(resp, id, KVP_EINVAL,
                      "RegisterBuffer of kind %d needs exactly one fd, got %d", (int)q->kind,
                      io->nfds_in);
        return 0;
    }
    if (!wants_fd && (io->nfds_in != 0 || q->ipc_handle.size != 64)) {
        kvp_rpc_error(
            resp, id, KVP_EINVAL,
            "a CUDA IPC buffer needs a 64-byte ipc_handle and no fd (got %u bytes, %d fds)",
            (unsigned)q->ipc_handle.size, io->nfds_in);
        return 0;
    }
    if (s->num_buffers >= r->lim.max_buffers_per_client) {
        kvp_rpc_error(resp, id, KVP_ELIMIT, "buffer limit %u reached",
                      r->lim.max_buffers_per_client);
        return 0;
    }
    kvp_ns_t *nsp = &r->ns.ns[s->ns];
    if (r->lim.ns_max_buffer_bytes &&
        (nsp->buffer_bytes > r->lim.ns_max_buffer_bytes ||
         q->size_bytes > r->lim.ns_max_buffer_bytes - nsp->buffer_bytes)) {
        kvp_rpc_error(resp, id, KVP_ELIMIT,
                      "namespace '%s' has %llu bytes registered; %llu more would pass its quota "
                      "%llu (limits.ns_max_buffer_bytes)",
                      nsp->name, (unsigned long long)nsp->buffer_bytes,
                      (unsigned long long)q->size_bytes,
                      (unsigned long long)r->lim.ns_max_buffer_bytes);
        return 0;
    }
    kvp_session_buffer_t *sb = &s->buffers[s->num_buffers];
    uint8_t done_event[KVP_BACKEND_IPC_HANDLE_BYTES];
    uint32_t done_len = 0;
    int rc =
        r->backend->ops->import_buffer(r->backend,
                                       &(kvp_import_req_t){.kind = (uint32_t)q->kind,
                                                           .fd = wants_fd ? io->fds_in[0] : -1,
                                                           .size_bytes = q->size_bytes,
                                                           .device = q->device,
                                                           .ipc_handle = q->ipc_handle.bytes,
                                                           .ipc_len = q->ipc_handle.size,
                                                           .event_handle = q->event_handle.bytes,
                                                           .event_len = q->event_handle.size},
                                       &sb->buf, done_event, &done_len);
    if (rc) {
        /* the backend's refusals of the client's descriptor are INVALID_ARGUMENT, each with what
         * is wrong; only the daemon's own failures keep their code */
        const int host_fd = wants_fd && r->backend->kind == kvpool_BackendKind_BACKEND_HOST;
        const char *what =
            rc == KVP_EPERM ? "a memfd must carry F_SEAL_SHRINK (so it cannot be shrunk under "
                              "the daemon)"
            : rc == -EACCES ? "the daemon may not map the fd: it must be open for reading, "
                              "not O_WRONLY or O_PATH (send the memfd itself or a descriptor "
                              "opened O_RDWR)"
            : rc == KVP_EINVAL && host_fd
                ? "the fd must be a memfd (a regular file that can be mapped) of at least "
                  "size_bytes bytes"
                : kvp_strerror(rc);
        kvp_rpc_error(resp, id, rc == KVP_EPERM || rc == -EACCES ? KVP_EINVAL : rc,
                      "cannot import the buffer: %s", what);
        return 0;
    }
    if (wants_fd)
        io->fds_in[0] = -1; /* the backend owns it now */
    sb->id = s->next_buffer_id++;
    s->num_buffers++;
    nsp->buffer_bytes += sb->buf.size_bytes;
    kvp__rpc_ok(io, id);
    resp->body.register_buffer.buffer_id = sb->id;
    if (done_len && done_len <= sizeof(resp->body.register_buffer.done_event_handle.bytes)) {
        memcpy(resp->body.register_buffer.done_event_handle.bytes, done_event, done_len);
        resp->body.register_buffer.done_event_handle.size = (pb_size_t)done_len;
    }
    return 0;
}

kvp_session_buffer_t *kvp__rpc_find_buffer(kvp_session_t *s, uint32_t buffer_id)
{
    for (uint32_t i = 0; i < s->num_buffers; i++)
        if (s->buffers[i].id == buffer_id)
            return &s->buffers[i];
    return NULL;
}

int kvp__rpc_unregister_buffer(kvp_rpc_t *r, kvp_session_t *s, const kvpool_Request *req,
                               kvp_rpc_io_t *io, uint64_t now_ms)
{
    const uint64_t id = req->id;
    const kvpool_UnregisterBufferRequest *q = &req->body.unregister_buffer;
    (void)now_ms;
    kvp_session_buffer_t *sb = kvp__rpc_find_buffer(s, q->buffer_id);
    if (!sb) {
        kvp_rpc_error(&io->resp, id, KVP_ENOENT, "no buffer %u", q->buffer_id);
        return 0;
    }
    r->ns.ns[s->ns].buffer_bytes -= sb->buf.size_bytes;
    kvp__rpc_buf_release(r, &sb->buf);
    *sb = s->buffers[--s->num_buffers];
    kvp__rpc_ok(io, id);
    return 0;
}
