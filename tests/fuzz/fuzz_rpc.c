/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fuzz_rpc.c - libFuzzer target: the input is a sequence of frames (4-byte little-endian
 * length, then the payload; stops at the first incomplete frame, at most 64 frames), each
 * decoded as a kvpool_Request exactly as the server does (bulk arrays bound to bounded
 * arrays) and answered by kvp_rpc_handle (retry window included) on one real core (host backend,
 * small geometry) that lives for the whole process. One session per input: opened first, closed
 * last, and its namespace's sequences expired (far-future time) so state stays bounded. Mutating
 * calls go through the idempotency window as in the server; an Append runs inline. Every answer is
 * encoded (pb_encode through the wire callbacks). After each input the sequence table's audit
 * must pass: any input that breaks an invariant aborts.
 *
 * The prefix cache (issue #16): the Batch's token_ids / salts / salt_lens (and Lookup's and
 * Pin's arrays) land in bounded arrays as in the server; the cache has small limits (4 scopes,
 * 4 pins, 8 pinned pages a namespace, 512 lookup tokens) and one shared scope, "fuzzshared",
 * open to this uid. After each input (pins expired with the leases) kvp_pcache_audit must pass,
 * no pin and no pending Commit may be left, and every cached page is flushed, so that each
 * input starts from an empty pool and a crash reproduces from its input alone.
 */
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_geom.h"
#include "kvp_log.h"
#include "kvp_pcache.h"
#include "kvp_rpc.h"
#include "kvp_wire.h"

#define MAX_FRAMES     64
#define MAX_BATCH_ELEM 256
#define MAX_TOKEN_IDS  4096
#define MAX_SALT_BYTES 4096
#define OUT_CAP        (1u << 20)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static kvp_rpc_t *R;
static uint64_t seq_ids[MAX_BATCH_ELEM];
static uint32_t num_tokens[MAX_BATCH_ELEM];
static int32_t token_ids[MAX_TOKEN_IDS];
static uint8_t salts[MAX_SALT_BYTES];
static uint32_t salt_lens[MAX_BATCH_ELEM];
static uint8_t out_buf[OUT_CAP];

static const kvp_geom_t G = {.num_layers = 2,
                             .num_pages = 64,
                             .page_size = 4,
                             .num_kv_heads = 2,
                             .head_dim = 16,
                             .dtype = KVP_DTYPE_FP16,
                             .layout = KVP_LAYOUT_NHD,
                             .storage = KVP_STORAGE_COMBINED,
                             .num_devices = 1};

static void init_once(void)
{
    if (R)
        return;
    /* every log line is still formatted (debug level), but written to /dev/null unless
     * KVP_FUZZ_VERBOSE is set */
    kvp_log_set_level(KVP_LOG_DEBUG);
    if (!getenv("KVP_FUZZ_VERBOSE")) {
        int null_fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
        if (null_fd >= 0)
            kvp_log_set_fd(null_fd);
    }
    kvp_backend_t *b;
    if (kvp_backend_host_create(&G, &b))
        abort();
    kvp_rpc_limits_t lim = {.max_seqs = 32,
                            .max_namespaces = 4,
                            .max_seq_tokens = 128,
                            .max_batch = 16,
                            .max_batch_tokens = 256,
                            .max_buffers_per_client = 2,
                            .max_buffer_bytes = 1 << 16,
                            .dedup_window = 8,
                            .default_lease_ms = 0,
                            .max_lease_ms = 100000,
                            .max_cache_scopes = 4,
                            .max_pins = 4,
                            .ns_max_pinned_pages = 8,
                            .pin_max_ttl_ms = 100000,
                            .max_lookup_tokens = 512};
    char scopes[64], why[128];
    snprintf(scopes, sizeof(scopes), "fuzzshared=%u", (unsigned)getuid());
    if (kvp_access_scopes_parse(scopes, &lim.scope_access, why, sizeof(why)))
        abort();
    if (kvp_rpc_create(b, &lim, 1000, &R))
        abort();
}

/* A sealed (unless the request id says otherwise) memfd whose size comes from the request. */
static int make_memfd(const kvpool_Request *req)
{
    uint64_t want = req->body.register_buffer.size_bytes;
    size_t sz = want <= (1u << 17) ? (size_t)want : (size_t)(want & 0xffff);
    int fd = memfd_create("fuzz-buffer", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -1;
    if (ftruncate(fd, (off_t)sz) != 0) {
        close(fd);
        return -1;
    }
    if (!(req->id & (1ull << 63)))
        (void)fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
    return fd;
}

/* How many fds of this process are buffers made by make_memfd (the session's close must
 * have closed them all; the sanitizers' own fds, e.g. a symbolizer pipe, are not counted). */
static int buffers_open(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char link[300], what[64];
        snprintf(link, sizeof(link), "/proc/self/fd/%s", e->d_name);
        ssize_t k = readlink(link, what, sizeof(what) - 1);
        if (k > 0) {
            what[k] = 0;
            n += strncmp(what, "/memfd:fuzz-buffer", 18) == 0;
        }
    }
    closedir(d);
    return n;
}

static void one_frame(kvp_session_t *s, const uint8_t *payload, uint32_t len, uint64_t now)
{
    static kvpool_Request req;
    static kvp_batch_arrays_t batch;
    static kvp_rpc_io_t io;
    memset(&req, 0, sizeof(req));
    batch.seq_ids = kvp_array(seq_ids, 8, 0, MAX_BATCH_ELEM);
    batch.num_tokens = kvp_array(num_tokens, 4, 0, MAX_BATCH_ELEM);
    batch.token_ids = kvp_array(token_ids, 4, 0, MAX_TOKEN_IDS);
    batch.salts = kvp_array(salts, 1, 0, MAX_SALT_BYTES);
    batch.salt_lens = kvp_array(salt_lens, 4, 0, MAX_BATCH_ELEM);
    kvp_wire_request_bind_decode(&req, &batch);
    if (kvp_wire_decode(kvpool_Request_fields, &req, payload, len, NULL))
        return;

    int fds[1] = {-1};
    int nfds = 0;
    if (req.which_body == kvpool_Request_register_buffer_tag) {
        fds[0] = make_memfd(&req);
        nfds = fds[0] >= 0;
    }
    memset(&io, 0, sizeof(io));
    io.batch = &batch;
    io.fds_in = fds;
    io.nfds_in = nfds;
    int rc = kvp_rpc_handle(R, s, &req, payload, len, &io, now, 0);
    if (fds[0] >= 0)
        close(fds[0]);
    kvp_rpc_job_t *job = NULL;
    if (rc == KVP_RPC_ASYNC) {
        job = io.job;
        kvp_rpc_job_run(job);
        kvp_rpc_job_finish(R, job, &io, now);
    } else if (rc == KVP_RPC_REPLAY) {
        kvp_rpc_answered(R, s, NULL, io.replay, io.replay_len, 1000);
        return;
    } else if (rc != KVP_RPC_DONE) {
        abort();
    }
    if (getenv("KVP_FUZZ_VERBOSE")) /* to check what a seed reaches */
        fprintf(stderr, "call %u -> %s %s\n", (unsigned)req.which_body,
                kvp_wire_code_name(io.resp.status.code), io.resp.status.message);
    long n = kvp_wire_encode_frame(kvpool_Response_fields, &io.resp, out_buf, sizeof(out_buf));
    kvp_rpc_answered(R, s, &io.resp, n > 0 ? out_buf : NULL, n > 0 ? (uint32_t)n : 0, 1000);
    if (job)
        kvp_rpc_job_free(job);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    init_once();
    static uint64_t now = 2000;
    now += 10;
    kvp_session_t *s = kvp_rpc_session_open(R, 4321, (uint32_t)getuid(), (uint32_t)getgid(), now);
    if (!s)
        abort();
    size_t off = 0;
    for (int f = 0; f < MAX_FRAMES && size - off >= KVP_FRAME_HDR_BYTES; f++) {
        uint32_t len = kvp_frame_get_len(data + off);
        off += KVP_FRAME_HDR_BYTES;
        if (len > size - off)
            break;
        one_frame(s, data + off, len, now);
        off += len;
    }
    kvp_rpc_session_close(R, s, now);
    kvp_rpc_expire_leases(R, now + 1000000000ull);
    now += 1000000000ull; /* the clock never goes back (the cache's follows the latest time) */
    char msg[256];
    if (kvp_seqtab_audit(kvp_rpc_seqtab(R), msg, sizeof(msg)) != 0) {
        fprintf(stderr, "fuzz_rpc: audit failed: %s\n", msg);
        abort();
    }
    kvp_pcache_t *pc = kvp_seqtab_pcache(kvp_rpc_seqtab(R));
    if (!pc || kvp_pcache_audit(pc, msg, sizeof(msg)) != 0) {
        fprintf(stderr, "fuzz_rpc: cache audit failed: %s\n", pc ? msg : "no cache");
        abort();
    }
    kvp_pcache_stats_t cs;
    kvp_pcache_stats(pc, &cs);
    if (cs.pins != 0 || cs.pinned_pages != 0 || kvp_rpc_commits_pending(R) != 0) {
        fprintf(stderr, "fuzz_rpc: %u pins / %u pinned pages / %u commits left after expiry\n",
                (unsigned)cs.pins, (unsigned)cs.pinned_pages, (unsigned)kvp_rpc_commits_pending(R));
        abort();
    }
    kvp_pcache_flush(pc, KVP_PCACHE_NO_SCOPE);
    kvp_pcache_stats(pc, &cs);
    if (cs.cached_pages != 0 || cs.indexed_pages != 0 ||
        kvp_pcache_audit(pc, msg, sizeof(msg)) != 0) {
        fprintf(stderr, "fuzz_rpc: after a flush: %u cached / %u indexed pages: %s\n",
                (unsigned)cs.cached_pages, (unsigned)cs.indexed_pages, msg);
        abort();
    }
    kvp_stats_t st;
    kvp_seqtab_stats(kvp_rpc_seqtab(R), &st);
    if (st.num_seqs != 0 || st.used_pages != 0 || st.free_pages != st.num_pages) {
        fprintf(stderr, "fuzz_rpc: %u sequences / %u pages left after close + expiry\n",
                (unsigned)st.num_seqs, (unsigned)st.used_pages);
        abort();
    }
    if (buffers_open() != 0) {
        fprintf(stderr, "fuzz_rpc: a registered buffer's fd is still open after close\n");
        abort();
    }
    return 0;
}
