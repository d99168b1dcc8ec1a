/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fuzz_frame.c - libFuzzer target for the daemon's frame reader (server/kvp_frame.h), the
 * code that cuts a connection's byte stream into frames and hands each frame the fds that
 * arrived with it. The input is a script: byte 0 picks max_frame_bytes (1..256 or 4 KiB),
 * byte 1 the buffer growth step (1..64 bytes, so growth, compaction and the "buffer full"
 * state are all reached); then each op byte either delivers the next chunk of stream bytes
 * (length from the op, taken from the input) with 0-3 made-up fds attached, or cuts frames.
 *
 * The same stream is cut independently by a plain reference parser (everything received,
 * kept in one array). Checked on every frame: same length and payload as the reference; its
 * fds are exactly the fds delivered with a chunk that ended inside the frame and not refused
 * (in order, at most KVP_FRAME_MAX_FDS_PER_FRAME); a chunk whose fds would leave more than
 * KVP_FRAME_MAX_PENDING_FDS pending (those delivered, not yet taken or dropped) is refused
 * (KVP_ELIMIT) and all its fds dropped at once; an oversize header is refused exactly when the
 * reference sees one; the buffer never exceeds max_frame_bytes + 4. At the end, after
 * kvp_frame_reader_free, every fd was handed to exactly one frame or dropped exactly once.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_frame.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_FDS    4096
#define MAX_STREAM (1 << 16)

static uint8_t stream[MAX_STREAM]; /* everything delivered */
static size_t stream_len;
static struct {
    uint64_t at;
    int seen; /* times taken by a frame or dropped */
} fdinfo[MAX_FDS];
static int num_fds;

static void drop(int fd, void *arg)
{
    (void)arg;
    if (fd < 0 || fd >= num_fds)
        abort();
    fdinfo[fd].seen++;
}

/* Cuts every frame the reader has and checks it against the reference. Returns 0, or 1 when
 * the stream hit an oversize header (the connection would be closed). */
static int cut(kvp_frame_reader_t *r, size_t *ref_off)
{
    for (;;) {
        kvp_frame_t f;
        int ready = kvp_frame_reader_ready(r);
        int rc = kvp_frame_reader_next(r, &f);
        if (ready != (rc != 0))
            abort();
        size_t avail = stream_len - *ref_off;
        if (rc == 0) {
            if (avail >= 4) {
                uint32_t len = kvp_frame_get_len(stream + *ref_off);
                if (len > r->max_frame_bytes || avail - 4 >= len)
                    abort(); /* the reference has a frame (or an error) the reader missed */
            }
            return 0;
        }
        if (avail < 4)
            abort();
        uint32_t len = kvp_frame_get_len(stream + *ref_off);
        if (rc == KVP_ELIMIT) {
            if (len <= r->max_frame_bytes || f.len != len)
                abort();
            return 1;
        }
        if (rc != 1 || len > r->max_frame_bytes || avail - 4 < len || f.len != len)
            abort();
        if (len && memcmp(f.payload, stream + *ref_off + 4, len) != 0)
            abort();
        uint64_t start = *ref_off, end = start + 4 + len;
        int k = 0;
        for (int i = 0; i < num_fds; i++) {
            if (fdinfo[i].at >= start && fdinfo[i].at < end && !fdinfo[i].seen) {
                if (k < KVP_FRAME_MAX_FDS_PER_FRAME) {
                    if (k >= f.nfds || f.fds[k] != i)
                        abort();
                    fdinfo[i].seen++;
                    k++;
                }
            }
        }
        if (k != f.nfds)
            abort();
        *ref_off = end;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    uint32_t max = data[0] == 255 ? 4096u : 1u + data[0];
    kvp_frame_reader_t r;
    kvp_frame_reader_init(&r, max, drop, NULL);
    r.grow_bytes = 1u + data[1] % 64;
    stream_len = 0;
    num_fds = 0;
    size_t ref_off = 0, i = 2;
    int broken = 0;
    while (i < size && !broken) {
        uint8_t op = data[i++];
        if (op >= 0xf0) {
            broken = cut(&r, &ref_off);
            continue;
        }
        uint8_t *p;
        size_t room;
        int rc = kvp_frame_reader_space(&r, &p, &room);
        if (rc == KVP_EBUSY) {
            /* full: it must hold a whole frame or an oversize header */
            if (!kvp_frame_reader_ready(&r))
                abort();
            broken = cut(&r, &ref_off);
            continue;
        }
        if (rc != 0 || room == 0)
            abort();
        size_t want = 1 + (op & 0x3f);
        if (want > room)
            want = room;
        if (want > size - i)
            want = size - i;
        if (want == 0 || stream_len + want > MAX_STREAM)
            break;
        memcpy(p, data + i, want);
        memcpy(stream + stream_len, data + i, want);
        i += want;
        int fds[3], nfds = (op >> 6) & 3;
        if (num_fds + nfds > MAX_FDS)
            nfds = 0;
        for (int k = 0; k < nfds; k++) {
            fds[k] = num_fds;
            fdinfo[num_fds].at = stream_len + want - 1; /* want >= 1 here */
            fdinfo[num_fds].seen = 0;
            num_fds++;
        }
        int pending = 0; /* the reference's count of what the reader holds */
        for (int k = 0; k < num_fds - nfds; k++)
            pending += !fdinfo[k].seen;
        if (pending != r.nfds)
            abort();
        int refuse =
            nfds > KVP_FRAME_MAX_FDS_PER_FRAME || pending + nfds > KVP_FRAME_MAX_PENDING_FDS;
        int crc = kvp_frame_reader_commit(&r, want, fds, nfds);
        if (crc != (refuse ? KVP_ELIMIT : 0))
            abort();
        for (int k = num_fds - nfds; k < num_fds; k++)
            if (fdinfo[k].seen != refuse)
                abort(); /* a refused read's fds are dropped at once, the others kept */
        if (r.nfds > KVP_FRAME_MAX_PENDING_FDS)
            abort();
        stream_len += want;
        if (r.cap > (size_t)max + 4 || r.len > r.cap || r.head > r.len)
            abort();
    }
    if (!broken)
        cut(&r, &ref_off);
    kvp_frame_reader_free(&r);
    for (int k = 0; k < num_fds; k++)
        if (fdinfo[k].seen != 1)
            abort();
    return 0;
}
