/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_frame.c - the frame reader (see kvp_frame.h). The buffer holds [head, len) unconsumed
 * bytes; frames are handed out in place (no copy) and the bytes before head are reclaimed only
 * when the next read needs room, so a batch of pipelined frames costs one memmove.
 */
#include "kvp_frame.h"

#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"

void kvp_frame_reader_init(kvp_frame_reader_t *r, uint32_t max_frame_bytes, kvp_frame_drop_fn drop,
                           void *drop_arg)
{
    memset(r, 0, sizeof(*r));
    r->max_frame_bytes = max_frame_bytes ? max_frame_bytes : 1;
    r->grow_bytes = KVP_FRAME_GROW_BYTES;
    r->drop = drop;
    r->drop_arg = drop_arg;
}

void kvp_frame_reader_free(kvp_frame_reader_t *r)
{
    for (int i = 0; i < r->nfds; i++)
        r->drop(r->fds[i].fd, r->drop_arg);
    r->nfds = 0;
    free(r->buf);
    r->buf = NULL;
    r->cap = r->len = r->head = 0;
}

static size_t max_cap(const kvp_frame_reader_t *r)
{
    return (size_t)r->max_frame_bytes + KVP_FRAME_HDR_BYTES;
}

/* What kvp_frame_reader_space does before it hands out room: reclaim the bytes earlier frames
 * used (when nothing is pending or the free tail is under a step) and grow to *ncap. */
static void plan(const kvp_frame_reader_t *r, int *compact, size_t *ncap)
{
    size_t want = max_cap(r);
    size_t step = r->grow_bytes ? r->grow_bytes : KVP_FRAME_GROW_BYTES;
    *compact = r->head && (r->head == r->len || r->cap - r->len < step);
    size_t len = *compact ? r->len - r->head : r->len;
    *ncap = r->cap;
    if (r->cap - len < step && r->cap < want) {
        size_t n = r->cap + step;
        if (n > want || n < r->cap)
            n = want;
        *ncap = n;
    }
}

size_t kvp_frame_reader_growth(const kvp_frame_reader_t *r)
{
    int compact;
    size_t ncap;
    plan(r, &compact, &ncap);
    return ncap - r->cap;
}

int kvp_frame_reader_space(kvp_frame_reader_t *r, uint8_t **p, size_t *n)
{
    int compact;
    size_t ncap;
    plan(r, &compact, &ncap);
    if (compact) {
        memmove(r->buf, r->buf + r->head, r->len - r->head);
        r->len -= r->head;
        r->head = 0;
    }
    if (ncap != r->cap) {
        uint8_t *nb = realloc(r->buf, ncap);
        if (!nb)
            return KVP_ENOMEM;
        r->buf = nb;
        r->cap = ncap;
    }
    if (r->len == r->cap)
        return KVP_EBUSY;
    *p = r->buf + r->len;
    *n = r->cap - r->len;
    return 0;
}

void kvp_frame_reader_trim(kvp_frame_reader_t *r)
{
    size_t step = r->grow_bytes ? r->grow_bytes : KVP_FRAME_GROW_BYTES;
    size_t pending = r->len - r->head;
    if (r->cap <= step || pending >= step)
        return;
    memmove(r->buf, r->buf + r->head, pending);
    r->len = pending;
    r->head = 0;
    uint8_t *nb = realloc(r->buf, step);
    if (nb) {
        r->buf = nb;
        r->cap = step;
    }
}

int kvp_frame_reader_commit(kvp_frame_reader_t *r, size_t n, const int *fds, int nfds)
{
    int rc = 0;
    if (n > r->cap - r->len)
        n = r->cap - r->len; /* a caller bug; never trust it past the buffer */
    /* the fds belong to the frame holding the LAST byte of this read: a Unix stream recvmsg
     * glues queued messages together but ends with the first one that carries descriptors, so
     * a read may start in an earlier frame (one without fds) and only its end lies in the
     * frame whose sendmsg carried them (kvp_frame.h) */
    const uint64_t at = r->rx_total + (n ? n - 1 : 0);
    if (nfds > KVP_FRAME_MAX_FDS_PER_FRAME || r->nfds + nfds > KVP_FRAME_MAX_PENDING_FDS) {
        for (int i = 0; i < nfds; i++)
            r->drop(fds[i], r->drop_arg);
        rc = KVP_ELIMIT;
    } else {
        for (int i = 0; i < nfds; i++) {
            r->fds[r->nfds].fd = fds[i];
            r->fds[r->nfds].at = at;
            r->nfds++;
        }
    }
    r->len += n;
    r->rx_total += n;
    return rc;
}

int kvp_frame_reader_ready(const kvp_frame_reader_t *r)
{
    size_t avail = r->len - r->head;
    if (avail < KVP_FRAME_HDR_BYTES)
        return 0;
    uint32_t len = kvp_frame_get_len(r->buf + r->head);
    return len > r->max_frame_bytes || avail - KVP_FRAME_HDR_BYTES >= len;
}

size_t kvp_frame_reader_pending(const kvp_frame_reader_t *r)
{
    return r->len - r->head;
}

int kvp_frame_reader_next(kvp_frame_reader_t *r, kvp_frame_t *f)
{
    f->nfds = 0;
    f->len = 0;
    f->payload = NULL;
    size_t avail = r->len - r->head;
    if (avail < KVP_FRAME_HDR_BYTES)
        return 0;
    uint32_t len = kvp_frame_get_len(r->buf + r->head);
    if (len > r->max_frame_bytes) {
        f->len = len;
        return KVP_ELIMIT;
    }
    if (avail - KVP_FRAME_HDR_BYTES < len)
        return 0;
    /* stream offsets of this frame: [start, end) */
    uint64_t start = r->rx_total - (r->len - r->head);
    uint64_t end = start + KVP_FRAME_HDR_BYTES + len;
    int k = 0;
    for (int i = 0; i < r->nfds; i++) {
        const kvp_frame_fd_t *e = &r->fds[i];
        if (e->at < start)
            r->drop(e->fd, r->drop_arg); /* came with an earlier frame that did not take it */
        else if (e->at >= end)
            r->fds[k++] = *e;
        else if (f->nfds < KVP_FRAME_MAX_FDS_PER_FRAME)
            f->fds[f->nfds++] = e->fd;
        else
            r->drop(e->fd, r->drop_arg);
    }
    r->nfds = k;
    f->payload = r->buf + r->head + KVP_FRAME_HDR_BYTES;
    f->len = len;
    r->head += KVP_FRAME_HDR_BYTES + (size_t)len;
    return 1;
}
