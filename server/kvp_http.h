/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_http.h - the optional Prometheus endpoint of kvpoold (server.metrics_listen): a minimal
 * HTTP/1.0 and HTTP/1.1 server on the daemon's own libuv loop that answers GET (and HEAD)
 * /metrics with the same text as the Metrics RPC, one request per connection.
 *
 * It is deliberately small and bounded rather than general: a request head (request line and
 * headers) of at most KVP_HTTP_MAX_REQUEST bytes, no request body, no keep-alive
 * (Connection: close), a fixed number of connections at once, and one deadline per connection
 * covering the request, the answer and the lingering close, with a shorter one for the head.
 * Anything else gets a status and the connection is closed: 400 (malformed), 404 (another
 * path), 405 (another method), 431 (head too large), 505 (not HTTP/1.x). Only a scraper and an
 * operator's curl are expected here; it is not meant to face the internet (bind it to loopback or a
 * management network). Loop thread only.
 *
 * Fairness (issue #15): idle sockets must not lock a scraper out. A new connection that would
 * exceed max_connections_per_peer (same peer address) or max_connections evicts the oldest
 * connection - of that peer, resp. of anyone - that is still waiting for its request head and
 * is older than a tenth of the head deadline (the grace: a newcomer cannot be pushed out
 * before it had time to send its head), or failing that one whose answer is already written.
 * When none may go yet, the newcomer waits in a one-place lobby and accepting pauses, so the
 * kernel's backlog (511) keeps the rest in arrival order: one peer's flood delays a scraper by
 * about its excess sockets x grace / per-peer limit, it cannot starve it (a flood beyond the
 * backlog makes the kernel drop SYNs, which TCP retries: that is the network's limit, not ours).
 * Before choosing, the candidates' pending bytes are read, so a request that already arrived is
 * answered rather than evicted. On loopback, where every peer is 127.0.0.1, the eviction (not the
 * per-peer cap) is what lets a scraper through; from another address the per-peer cap keeps a flood
 * to its own slots. head_timeout_ms bounds how long an idle socket holds a slot.
 */
#ifndef KVP_HTTP_H
#define KVP_HTTP_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

/* Bytes of one request head, the blank line included. */
#define KVP_HTTP_MAX_REQUEST 8192

typedef struct kvp_http kvp_http_t;

/* Writes the exposition text into buf (at most cap - 1 bytes and a NUL) and returns its length.
 * Called on the loop thread for each GET or HEAD of /metrics. */
typedef size_t (*kvp_http_render_fn)(void *arg, char *buf, size_t cap);

typedef struct {
    const char *listen;       /* "host:port" or "[v6-address]:port" (kvp_config checked it) */
    uint32_t max_connections; /* at once; over it the fairness rule above applies */
    uint32_t max_connections_per_peer; /* from one peer address; 0: max_connections */
    uint32_t head_timeout_ms;  /* to receive the request head; 0 or > timeout_ms: timeout_ms */
    uint32_t timeout_ms;       /* one connection's whole life: request, answer, close */
    size_t max_body_bytes;     /* the render buffer (the text is truncated to fit) */
    kvp_http_render_fn render; /* required */
    void *render_arg;          /* borrowed; must outlive the server */
} kvp_http_config_t;

/* Resolves cfg->listen (numeric or a name, getaddrinfo at start only), binds, listens and
 * starts accepting on loop. Returns 0 and *out, or KVP_EINVAL (bad arguments or an address
 * that does not resolve), KVP_ENOMEM, or a negative errno (EADDRINUSE, EACCES, ...). On error
 * nothing is left open. */
int kvp_http_create(uv_loop_t *loop, const kvp_http_config_t *cfg, kvp_http_t **out);

/* The address actually bound (useful with port 0), "host:port" form; "" before create. */
const char *kvp_http_address(const kvp_http_t *h);

/* Stops listening, closes every connection (answers in flight are dropped) and frees the
 * server once its handles are closed: run the loop until it returns after calling this.
 * NULL: no-op. */
void kvp_http_destroy(kvp_http_t *h);

/* Internal, exposed for the unit test: classifies the request head in buf[0..len). Returns 0
 * while the head is incomplete (no blank line yet), else the status to answer: 200 for GET or
 * HEAD of /metrics (a query string is ignored), 400, 404, 405 or 505. *is_head is set to 1
 * for HEAD. Pure: no allocation, no state. */
int kvp__http_classify(const char *buf, size_t len, int *is_head);

#endif
