/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_client.c - libkvpool's handle (kvpool.h): one blocking connection to kvpoold. It
 * connects and says Hello (mapping the pool of the host backend), runs the one round trip
 * every call goes through (encode into the send buffer, send with kvp_sock, receive the one
 * Response frame, decode with kvp_client_wire.c) and owns the host staging buffers. A
 * transport failure (timeout, lost connection, broken framing) closes the connection, since a
 * late answer would be taken for the next one; later calls fail with KVP_ECLOSED. The calls
 * themselves live in kvp_client_seq.c, _cache.c, _xfer.c, _admin.c and _cuda.c, which reach
 * the handle only through kvp_client_internal.h. The library never prints: every failure
 * leaves its reason in the handle's last_error.
 */
#include "kvpool.h"
#include "kvp_limits.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "kvp_client_internal.h"
#include "kvp_knob.h"
#include "kvp_sock.h"
#include "kvp_wire.h"

#define CLIENT_MAX_FRAME_BYTES    (64u << 20) /* largest frame sent or accepted */
#define CLIENT_INIT_BUF_BYTES     (16u << 10) /* first size of the send and receive buffers */
#define CLIENT_MAX_HOST_BUFFERS   64          /* staging buffers per handle */
#define CLIENT_DEFAULT_TIMEOUT_MS 10000
#define CLIENT_DEFAULT_NAMESPACE  "default"
#define CLIENT_MAX_BUSY_POLL_US   1000000u /* opts.busy_poll_us, $KVPOOL_BUSY_POLL_US */
#define CLIENT_ERR_BYTES          320

_Static_assert(KVP_MAX_DEVICES <= KVP_MAX_FDS_PER_FRAME, "one pool fd per device on one frame");

/* A staging buffer made by kvp_client_alloc_host_buffer, unmapped on unregister or close. */
typedef struct {
    uint32_t id;
    void *ptr;
    size_t size_bytes;
} host_buffer_t;

struct kvp_client {
    int fd; /* -1 once the connection is lost */
    uint32_t timeout_ms;
    uint64_t busy_poll_ns; /* spin for the answer this long before sleeping */
    uint64_t next_id;
    uint64_t session_id;
    char server_version[sizeof(((kvpool_HelloResponse *)0)->server_version)];
    kvp_pool_info_t info;
    uint32_t num_pool;                      /* pool fds that came with Hello */
    void *pool_map[KVP_CLIENT_MAX_DEVICES]; /* host backend: the mapping, else NULL */
    int pool_fd[KVP_CLIENT_MAX_DEVICES];    /* cuda backend: kept open, else -1 */
    void *pool_dev[KVP_CLIENT_MAX_DEVICES]; /* cuda backend: device mapping (kvp_client_cuda.c) */
    void *cuda;                             /* kvp_client_cuda.c's state, NULL until used */
    size_t pool_map_bytes;
    host_buffer_t bufs[CLIENT_MAX_HOST_BUFFERS];
    uint32_t num_bufs;
    uint8_t *sbuf, *rbuf; /* whole frames out, payloads in; grown up to the max frame */
    size_t scap, rcap;
    kvpool_Request req;   /* scratch, one call at a time */
    kvpool_Response resp; /* scratch (large: the list bodies are fixed arrays) */
    char last_error[CLIENT_ERR_BYTES];
};
/* ---- the handle --------------------------------------------------------------------------- */

static int fail(kvp_client_t *c, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Records the reason of a failed call and returns rc. */
static int fail(kvp_client_t *c, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->last_error, sizeof(c->last_error), fmt, ap);
    va_end(ap);
    return rc;
}

/* A transport failure: the stream is out of step, so the connection goes. */
static int lost(kvp_client_t *c, int rc, const char *what)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    if (rc == KVP_ETIMEDOUT)
        return fail(c, rc, "no answer from the daemon within %u ms (%s); connection closed",
                    c->timeout_ms, what);
    if (rc == KVP_ECLOSED)
        return fail(c, rc, "the daemon closed the connection (%s)", what);
    return fail(c, rc, "connection lost (%s): %s", what, kvp_strerror(rc));
}

static uint64_t next_id(kvp_client_t *c)
{
    uint64_t id = c->next_id++;
    if (id == 0) /* 0 disables deduplication: never use it */
        id = c->next_id++;
    return id;
}

/* A random start for request ids, so ids stay unique per namespace across restarts. */
static uint64_t random_id(const void *salt)
{
    uint64_t v = 0;
    if (getrandom(&v, sizeof(v), GRND_NONBLOCK) != (ssize_t)sizeof(v)) {
        /* no entropy yet (early boot) or no syscall: time, pid and an address, mixed */
        v = kvp_sock_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)salt;
        v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
        v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
        v ^= v >> 31;
    }
    return v ? v : 1;
}

/* Encodes req as a frame into the send buffer, growing it. Returns the frame length or a
 * negative code. */
static long encode_request(kvp_client_t *c, const kvpool_Request *req)
{
    long n = kvp_wire_encode_request_frame(req, c->sbuf, c->scap);
    if (n != KVP_ELIMIT)
        return n;
    long need = kvp_wire_encoded_size(kvpool_Request_fields, req);
    if (need < 0)
        return KVP_EINVAL;
    if ((unsigned long)need > CLIENT_MAX_FRAME_BYTES)
        return KVP_ELIMIT;
    size_t want = (size_t)need + KVP_FRAME_HDR_BYTES;
    if (want < 2 * c->scap)
        want = 2 * c->scap;
    if (want > CLIENT_MAX_FRAME_BYTES + KVP_FRAME_HDR_BYTES)
        want = CLIENT_MAX_FRAME_BYTES + KVP_FRAME_HDR_BYTES;
    uint8_t *nb = realloc(c->sbuf, want);
    if (!nb)
        return KVP_ENOMEM;
    c->sbuf = nb;
    c->scap = want;
    return kvp_wire_encode_request_frame(req, c->sbuf, c->scap);
}

static void close_fds(const int *fds, unsigned n)
{
    for (unsigned i = 0; i < n; i++)
        close(fds[i]);
}

/*
 * One round trip: sends req with send_fds attached, receives and decodes the answer into
 * resp (bulk arrays into r), and checks id, status and body (expect: the body tag a success
 * must carry, 0 for any). Descriptors that came with the answer go to recv_fds (up to
 * max_recv, *num_recv of them, owned by the caller) on success and are closed otherwise.
 */
static int call(kvp_client_t *c, kvpool_Request *req, kvpool_Response *resp, kvp_reply_arrays_t *r,
                pb_size_t expect, const int *send_fds, unsigned num_send, int *recv_fds,
                unsigned max_recv, unsigned *num_recv)
{
    unsigned nfds = 0;
    int rc;
    c->last_error[0] = '\0';
    if (num_recv)
        *num_recv = 0;
    if (c->fd < 0)
        return fail(c, KVP_ECLOSED, "not connected: the connection was closed after an error");

    uint64_t id = next_id(c);
    req->id = id;
    long n = encode_request(c, req);
    if (n == KVP_ELIMIT)
        return fail(c, KVP_ELIMIT, "the request does not fit in a frame (at most %u bytes)",
                    CLIENT_MAX_FRAME_BYTES);
    if (n < 0)
        return fail(c, (int)n, "cannot encode the request: %s", kvp_strerror((int)n));
    uint64_t deadline = kvp_sock_deadline(c->timeout_ms);
    rc = kvp_sock_send_frame(c->fd, c->sbuf, (size_t)n, send_fds, num_send, deadline);
    if (rc == KVP_ECLOSED) {
        /* The daemon may have refused this connection (access, connection limit, out of
         * descriptors) and closed it before the request went out: its answer, id 0, can still
         * be waiting to be read. Report that rather than a bare "closed". */
        uint32_t len = 0;
        if (kvp_sock_recv_frame(c->fd, &c->rbuf, &c->rcap, &len, CLIENT_MAX_FRAME_BYTES, NULL, 0,
                                NULL, kvp_sock_deadline(200)) == 0 &&
            kvp__client_decode_response(resp, r, c->rbuf, len, NULL, 0) == 0 && resp->id == 0 &&
            resp->has_status && resp->status.code != kvpool_Code_OK) {
            int err = kvp_wire_err_from_code(resp->status.code);
            lost(c, err, "request rejected");
            return fail(c, err, "%s",
                        resp->status.message[0] ? resp->status.message
                                                : kvp_wire_code_name(resp->status.code));
        }
    }
    if (rc)
        return lost(c, rc, "sending the request");
    uint32_t len = 0;
    if (c->busy_poll_ns)
        kvp_sock_spin_readable(c->fd, c->busy_poll_ns);
    /* one request in flight, one answer to it: the daemon sends nothing after it */
    rc = kvp_sock_recv_answer(c->fd, &c->rbuf, &c->rcap, &len, CLIENT_MAX_FRAME_BYTES, recv_fds,
                              recv_fds ? max_recv : 0, recv_fds ? &nfds : NULL, deadline);
    if (rc)
        return lost(c, rc, "receiving the response");

    rc = kvp__client_decode_response(resp, r, c->rbuf, len, c->last_error, sizeof(c->last_error));
    if (rc)
        goto fail_close_fds; /* framing intact: the connection stays */
    kvpool_Code code = resp->has_status ? resp->status.code : kvpool_Code_OK;
    if (resp->id != id) {
        close_fds(recv_fds, nfds);
        if (resp->id == 0 && code != kvpool_Code_OK) {
            /* the daemon rejected the frame itself and is closing the connection */
            int err = kvp_wire_err_from_code(code);
            lost(c, err, "request rejected");
            return fail(c, err, "%s",
                        resp->status.message[0] ? resp->status.message : kvp_wire_code_name(code));
        }
        lost(c, KVP_EPROTO, "response out of step");
        return fail(c, KVP_EPROTO, "response id %llu does not match request id %llu",
                    (unsigned long long)resp->id, (unsigned long long)id);
    }
    if (code != kvpool_Code_OK) {
        rc = fail(c, kvp_wire_err_from_code(code), "%s",
                  resp->status.message[0] ? resp->status.message : kvp_wire_code_name(code));
        goto fail_close_fds;
    }
    if (expect && resp->which_body != expect) {
        rc = fail(c, KVP_EPROTO, "the daemon answered with body %u, expected %u",
                  (unsigned)resp->which_body, (unsigned)expect);
        goto fail_close_fds;
    }
    if (num_recv)
        *num_recv = nfds;
    return 0;

fail_close_fds:
    close_fds(recv_fds, nfds);
    return rc;
}

char *kvp_client_default_socket(char *buf, size_t len)
{
    if (!buf || !len)
        return NULL;
    const char *env = kvp_knob_env("KVPOOL_SOCKET");
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    int n;
    if (env && *env)
        n = snprintf(buf, len, "%s", env);
    else if (geteuid() == 0)
        n = snprintf(buf, len, "/run/kvpool/kvpool.sock");
    else if (xdg && *xdg)
        n = snprintf(buf, len, "%s/kvpool/kvpool.sock", xdg);
    else
        n = snprintf(buf, len, "/tmp/kvpool-%u/kvpool.sock", (unsigned)geteuid());
    if (n < 0 || (size_t)n >= len)
        return NULL;
    return buf;
}

const char *kvp_client_version(void)
{
    return KVP_VERSION_STRING;
}

unsigned kvp_client_abi_version(void)
{
    return KVP_ABI_VERSION;
}

unsigned kvp_client_protocol_version(void)
{
    return KVP_PROTOCOL_VERSION;
}

size_t kvp_client_sizeof(const char *type_name)
{
#define T(t)                                                                                       \
    {                                                                                              \
#t, sizeof(t)                                                                              \
    }
    static const struct {
        const char *name;
        size_t size;
    } types[] = {T(kvp_client_opts_t),
                 T(kvp_pool_info_t),
                 T(kvp_page_table_t),
                 T(kvp_source_t),
                 T(kvp_rank_source_t),
                 T(kvp_stats_summary_t),
                 T(kvp_transfer_ticket_t),
                 T(kvp_transfer_info_t),
                 T(kvp_cache_opts_t),
                 T(kvp_pin_t),
                 T(kvp_cache_stats_t),
                 T(kvp_namespace_stats_t),
                 T(kvp_scope_stats_t),
                 T(kvp_daemon_stats_t),
                 T(kvp_seq_info_t),
                 T(kvp_session_info_t),
                 T(kvp_load_t),
                 T(kvp_cache_dump_t)};
#undef T
    for (size_t i = 0; type_name && i < sizeof(types) / sizeof(types[0]); i++)
        if (strcmp(types[i].name, type_name) == 0)
            return types[i].size;
    return 0;
}

/* Takes the Hello answer: pool description, and the pool fds (owned by the handle from here
 * on, closed by kvp_client_close whatever happens). */
static int take_hello(kvp_client_t *c, const kvpool_HelloResponse *h, const int *fds, unsigned nfds,
                      int map_pool)
{
    if (!map_pool) {
        close_fds(fds, nfds); /* not asked for */
        nfds = 0;
    }
    for (unsigned i = 0; i < nfds; i++)
        c->pool_fd[i] = fds[i];
    c->num_pool = nfds;

    if (h->protocol_version != KVP_PROTOCOL_VERSION)
        return fail(c, KVP_EPROTO, "the daemon speaks protocol %u, this library %u",
                    h->protocol_version, KVP_PROTOCOL_VERSION);
    c->session_id = h->session_id;
    snprintf(c->server_version, sizeof(c->server_version), "%s", h->server_version);
    if (h->has_pool)
        kvp_wire_pool_info_get(&c->info, &h->pool);
    if (!map_pool)
        return 0;
    if (!h->has_pool)
        return fail(c, KVP_EPROTO, "the Hello answer carries no pool description");
    if (nfds == 0 || nfds != h->pool.num_fds)
        return fail(c, KVP_EPROTO, "the daemon announced %u pool fds and %u arrived",
                    h->pool.num_fds, nfds);

    if (h->pool.backend == kvpool_BackendKind_BACKEND_CUDA)
        return 0; /* kept open for the CUDA VMM import */
    if (h->pool.backend != kvpool_BackendKind_BACKEND_HOST)
        return fail(c, KVP_EPROTO, "unknown backend %d", (int)h->pool.backend);
    if (h->pool.pool_bytes == 0 || h->pool.pool_bytes > SIZE_MAX)
        return fail(c, KVP_EPROTO, "pool size %llu cannot be mapped",
                    (unsigned long long)h->pool.pool_bytes);
    c->pool_map_bytes = (size_t)h->pool.pool_bytes;
    for (unsigned i = 0; i < nfds; i++) {
        struct stat st;
        if (fstat(c->pool_fd[i], &st) < 0)
            return fail(c, -errno, "pool fd %u: fstat: %s", i, strerror(errno));
        if (st.st_size < 0 || (uint64_t)st.st_size < h->pool.pool_bytes)
            return fail(c, KVP_EPROTO, "pool fd %u holds %lld bytes, the pool is %llu", i,
                        (long long)st.st_size, (unsigned long long)h->pool.pool_bytes);
        void *p =
            mmap(NULL, c->pool_map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->pool_fd[i], 0);
        if (p == MAP_FAILED)
            return fail(c, -errno, "cannot map the pool of device %u: %s", i, strerror(errno));
        c->pool_map[i] = p;
        close(c->pool_fd[i]); /* the mapping keeps the memory */
        c->pool_fd[i] = -1;
    }
    return 0;
}

int kvp_client_connect(const kvp_client_opts_t *opts, kvp_client_t **out, char *err, size_t err_len)
{
    static const kvp_client_opts_t defaults;
    const kvp_client_opts_t *o = opts ? opts : &defaults;
    if (err && err_len)
        err[0] = '\0';
    if (!out) {
        if (err)
            snprintf(err, err_len, "kvp_client_connect: out is NULL");
        return KVP_EINVAL;
    }
    const char *ns = o->ns && *o->ns ? o->ns : CLIENT_DEFAULT_NAMESPACE;
    if (strlen(ns) >= sizeof(((kvpool_HelloRequest *)0)->namespace)) {
        if (err)
            snprintf(err, err_len, "namespace longer than %zu bytes",
                     sizeof(((kvpool_HelloRequest *)0)->namespace) - 1);
        return KVP_EINVAL;
    }
    const char *scope = o->cache_scope ? o->cache_scope : "";
    if (strlen(scope) >= sizeof(((kvpool_HelloRequest *)0)->cache_scope)) {
        if (err)
            snprintf(err, err_len, "cache scope longer than %zu bytes",
                     sizeof(((kvpool_HelloRequest *)0)->cache_scope) - 1);
        return KVP_EINVAL;
    }
    char path_buf[sizeof(((struct sockaddr_un *)0)->sun_path)];
    const char *path = o->socket_path && *o->socket_path
                           ? o->socket_path
                           : kvp_client_default_socket(path_buf, sizeof(path_buf));
    if (!path) {
        if (err)
            snprintf(err, err_len, "the default socket path is too long");
        return KVP_EINVAL;
    }
    uint64_t spin_us = o->busy_poll_us;
    if (!spin_us && kvp_knob_env_u64("KVPOOL_BUSY_POLL_US", 0, CLIENT_MAX_BUSY_POLL_US, &spin_us,
                                     err, err_len) < 0)
        return KVP_EINVAL;

    int rc;
    kvp_client_t *c = calloc(1, sizeof(*c));
    if (!c) {
        if (err)
            snprintf(err, err_len, "out of memory");
        return KVP_ENOMEM;
    }
    c->fd = -1;
    for (unsigned i = 0; i < KVP_CLIENT_MAX_DEVICES; i++)
        c->pool_fd[i] = -1;
    c->timeout_ms = o->timeout_ms ? o->timeout_ms : CLIENT_DEFAULT_TIMEOUT_MS;
    c->busy_poll_ns =
        (spin_us > CLIENT_MAX_BUSY_POLL_US ? CLIENT_MAX_BUSY_POLL_US : spin_us) * 1000u;
    c->next_id = random_id(c);
    c->sbuf = malloc(CLIENT_INIT_BUF_BYTES);
    c->rbuf = malloc(CLIENT_INIT_BUF_BYTES);
    if (!c->sbuf || !c->rbuf) {
        rc = fail(c, KVP_ENOMEM, "out of memory");
        goto fail_close;
    }
    c->scap = c->rcap = CLIENT_INIT_BUF_BYTES;

    rc = kvp_sock_connect(path, c->timeout_ms, &c->fd);
    if (rc) {
        fail(c, rc, "cannot connect to %s: %s", path, kvp_strerror(rc));
        goto fail_close;
    }

    kvpool_Request *req = &c->req;
    memset(req, 0, sizeof(*req));
    req->which_body = kvpool_Request_hello_tag;
    kvpool_HelloRequest *h = &req->body.hello;
    h->protocol_version = KVP_PROTOCOL_VERSION;
    h->observer = o->observer != 0;
    if (!h->observer) /* an observer names none */
        snprintf(h->namespace, sizeof(h->namespace), "%s", ns);
    snprintf(h->client_name, sizeof(h->client_name), "%s",
             o->client_name ? o->client_name : program_invocation_short_name);
    h->has_lease_ms = o->lease_ms != KVP_LEASE_DEFAULT && !h->observer;
    h->lease_ms = h->has_lease_ms ? o->lease_ms : 0;
    h->want_pool_fds = o->map_pool != 0;
    snprintf(h->cache_scope, sizeof(h->cache_scope), "%s", scope);

    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, NULL);
    int fds[KVP_MAX_FDS_PER_FRAME];
    unsigned nfds = 0;
    rc = call(c, req, &c->resp, &r, kvpool_Response_hello_tag, NULL, 0, fds, KVP_MAX_FDS_PER_FRAME,
              &nfds);
    if (rc)
        goto fail_close;
    rc = take_hello(c, &c->resp.body.hello, fds, nfds, o->map_pool);
    if (rc)
        goto fail_close;
    *out = c;
    return 0;

fail_close:
    if (err && err_len)
        snprintf(err, err_len, "%s", c->last_error);
    kvp_client_close(c);
    return rc;
}

void kvp_client_close(kvp_client_t *c)
{
    if (!c)
        return;
    kvp__client_cuda_close(c); /* device mappings, buffers and events first */
    if (c->fd >= 0)
        close(c->fd);
    for (uint32_t i = 0; i < c->num_bufs; i++)
        munmap(c->bufs[i].ptr, c->bufs[i].size_bytes);
    for (uint32_t i = 0; i < c->num_pool; i++) {
        if (c->pool_map[i])
            munmap(c->pool_map[i], c->pool_map_bytes);
        if (c->pool_fd[i] >= 0)
            close(c->pool_fd[i]);
    }
    free(c->sbuf);
    free(c->rbuf);
    free(c);
}

const char *kvp_client_last_error(const kvp_client_t *c)
{
    return c ? c->last_error : "";
}

uint64_t kvp_client_session_id(const kvp_client_t *c)
{
    return c ? c->session_id : 0;
}

const char *kvp_client_server_version(const kvp_client_t *c)
{
    return c ? c->server_version : "";
}

const kvp_pool_info_t *kvp_client_pool_info(const kvp_client_t *c)
{
    return c ? &c->info : NULL;
}

void *kvp_client_pool_base(const kvp_client_t *c, uint32_t device)
{
    if (!c || device >= c->num_pool)
        return NULL;
    return c->pool_map[device] ? c->pool_map[device] : c->pool_dev[device];
}

int kvp_client_pool_fd(const kvp_client_t *c, uint32_t device)
{
    if (!c || device >= c->num_pool)
        return -1;
    return c->pool_fd[device];
}

/* A request with no bulk arrays, answered with no bulk arrays. */
static int simple_call(kvp_client_t *c, pb_size_t expect)
{
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, NULL);
    return call(c, &c->req, &c->resp, &r, expect, NULL, 0, NULL, 0, NULL);
}

/* Zeroes the scratch request and sets its body. */
static kvpool_Request *new_request(kvp_client_t *c, pb_size_t which_body)
{
    memset(&c->req, 0, sizeof(c->req));
    c->req.which_body = which_body;
    return &c->req;
}

int kvp_client_ping(kvp_client_t *c, uint64_t *rtt_ns)
{
    if (!c)
        return KVP_EINVAL;
    kvpool_Request *req = new_request(c, kvpool_Request_ping_tag);
    uint64_t nonce = c->next_id ^ 0x9e3779b97f4a7c15ull;
    req->body.ping.nonce = nonce;
    uint64_t t0 = kvp_sock_now_ns();
    int rc = simple_call(c, kvpool_Response_ping_tag);
    uint64_t t1 = kvp_sock_now_ns();
    if (rc)
        return rc;
    if (c->resp.body.ping.nonce != nonce)
        return fail(c, KVP_EPROTO, "ping answered with another nonce");
    if (rtt_ns)
        *rtt_ns = t1 - t0;
    return 0;
}

static int register_fd(kvp_client_t *c, int fd, kvpool_BufferKind kind, uint64_t size_bytes,
                       uint32_t *buffer_id)
{
    kvpool_Request *req = new_request(c, kvpool_Request_register_buffer_tag);
    req->body.register_buffer.kind = kind;
    req->body.register_buffer.size_bytes = size_bytes;
    kvp_reply_arrays_t r;
    kvp__client_table_arrays(&r, NULL);
    int rc = call(c, req, &c->resp, &r, kvpool_Response_register_buffer_tag, &fd, 1, NULL, 0, NULL);
    if (rc)
        return rc;
    *buffer_id = c->resp.body.register_buffer.buffer_id;
    return 0;
}

int kvp_client_register_fd(kvp_client_t *c, int fd, uint32_t kind, uint64_t size_bytes,
                           uint32_t *buffer_id)
{
    if (!c)
        return KVP_EINVAL;
    if (fd < 0 || !buffer_id || size_bytes == 0)
        return fail(c, KVP_EINVAL, "register_fd: bad fd, size or buffer_id");
    if (kind != kvpool_BufferKind_BUFFER_MEMFD && kind != kvpool_BufferKind_BUFFER_CUDA_VMM_FD)
        return fail(c, KVP_EINVAL, "register_fd: kind %u is not 0 (memfd) or 1 (cuda vmm fd)",
                    kind);
    /* a closed fd would fail the send, and a failed send costs the connection */
    if (fcntl(fd, F_GETFD) < 0)
        return fail(c, KVP_EINVAL, "register_fd: fd %d is not open", fd);
    return register_fd(c, fd, (kvpool_BufferKind)kind, size_bytes, buffer_id);
}

int kvp_client_alloc_host_buffer(kvp_client_t *c, uint64_t size_bytes, void **ptr,
                                 uint32_t *buffer_id)
{
    if (!c)
        return KVP_EINVAL;
    if (!ptr || !buffer_id || size_bytes == 0 || size_bytes > (uint64_t)INT64_MAX ||
        size_bytes > SIZE_MAX)
        return fail(c, KVP_EINVAL, "alloc_host_buffer: bad size or NULL output");
    if (c->num_bufs == CLIENT_MAX_HOST_BUFFERS)
        return fail(c, KVP_ELIMIT, "alloc_host_buffer: at most %u host buffers per handle",
                    CLIENT_MAX_HOST_BUFFERS);

    int rc;
    int fd = memfd_create("kvpool-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return fail(c, -errno, "memfd_create: %s", strerror(errno));
    if (ftruncate(fd, (off_t)size_bytes) < 0) {
        rc = fail(c, -errno, "ftruncate %llu bytes: %s", (unsigned long long)size_bytes,
                  strerror(errno));
        goto fail_close;
    }
    /* The daemon maps this memory: a fixed size means it can never fault on a shrunk file. */
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
        rc = fail(c, -errno, "sealing the staging memfd: %s", strerror(errno));
        goto fail_close;
    }
    void *p = mmap(NULL, (size_t)size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        rc =
            fail(c, -errno, "mmap %llu bytes: %s", (unsigned long long)size_bytes, strerror(errno));
        goto fail_close;
    }
    uint32_t id;
    rc = register_fd(c, fd, kvpool_BufferKind_BUFFER_MEMFD, size_bytes, &id);
    if (rc)
        goto fail_unmap;
    close(fd); /* the daemon holds its own reference now */
    c->bufs[c->num_bufs].id = id;
    c->bufs[c->num_bufs].ptr = p;
    c->bufs[c->num_bufs].size_bytes = (size_t)size_bytes;
    c->num_bufs++;
    *ptr = p;
    *buffer_id = id;
    return 0;

fail_unmap:
    munmap(p, (size_t)size_bytes);
fail_close:
    close(fd);
    return rc;
}

int kvp_client_unregister_buffer(kvp_client_t *c, uint32_t buffer_id)
{
    if (!c)
        return KVP_EINVAL;
    kvpool_Request *req = new_request(c, kvpool_Request_unregister_buffer_tag);
    req->body.unregister_buffer.buffer_id = buffer_id;
    /* an empty body may arrive as no body at all: accept any */
    int rc = simple_call(c, 0);
    if (rc && rc != KVP_ENOENT)
        return rc; /* keep the mapping: the daemon may still read it */
    for (uint32_t i = 0; i < c->num_bufs; i++) {
        if (c->bufs[i].id != buffer_id)
            continue;
        munmap(c->bufs[i].ptr, c->bufs[i].size_bytes);
        c->bufs[i] = c->bufs[--c->num_bufs];
        break;
    }
    return rc;
}

int kvp_client_call_raw(kvp_client_t *c, void *request, void *response, void *arrays)
{
    if (!c)
        return KVP_EINVAL;
    if (!request || !response)
        return fail(c, KVP_EINVAL, "call_raw: NULL request or response");
    kvp_reply_arrays_t sink;
    kvp_reply_arrays_t *r = arrays;
    if (!r) {
        kvp__client_table_arrays(&sink, NULL);
        r = &sink;
    }
    return call(c, request, response, r, 0, NULL, 0, NULL, 0, NULL);
}

/* ---- the handle's internals for the files of the calls (kvp_client_internal.h) ------------ */

kvpool_Request *kvp__client_request(kvp_client_t *c, pb_size_t which_body)
{
    return new_request(c, which_body);
}

int kvp__client_call(kvp_client_t *c, pb_size_t expect, kvp_reply_arrays_t *r, const int *fds,
                     unsigned nfds)
{
    kvp_reply_arrays_t sink;
    if (!r) {
        kvp__client_table_arrays(&sink, NULL);
        r = &sink;
    }
    return call(c, &c->req, &c->resp, r, expect, fds, nfds, NULL, 0, NULL);
}

kvpool_Request *kvp__client_scratch_request(kvp_client_t *c)
{
    return &c->req;
}

const kvpool_Response *kvp__client_response(const kvp_client_t *c)
{
    return &c->resp;
}

int kvp__client_fail(kvp_client_t *c, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->last_error, sizeof(c->last_error), fmt, ap);
    va_end(ap);
    return rc;
}

uint32_t kvp__client_timeout_ms(const kvp_client_t *c)
{
    return c->timeout_ms;
}

void kvp__client_set_timeout_ms(kvp_client_t *c, uint32_t timeout_ms)
{
    c->timeout_ms = timeout_ms;
}

void **kvp__client_cuda_state(kvp_client_t *c)
{
    return &c->cuda;
}

void kvp__client_set_pool_base(kvp_client_t *c, uint32_t device, void *base)
{
    if (device < c->num_pool)
        c->pool_dev[device] = base;
}

uint32_t kvp__client_num_pool(const kvp_client_t *c)
{
    return c->num_pool;
}
