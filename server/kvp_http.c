/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_http.c - the Prometheus endpoint (see kvp_http.h): accept -> read the head into a fixed
 * buffer -> kvp__http_classify -> render and write one answer -> half-close and drain until the
 * peer closes (a lingering close: closing with unread bytes would send a RST that can destroy
 * the answer in flight) -> close. One deadline timer per connection bounds all of it: first
 * head_timeout_ms for the head, then timeout_ms from accept for the rest, so a silent client
 * holds a slot for at most head_timeout_ms. When the limits are reached, a newcomer evicts the
 * oldest connection still waiting for its head (the fairness rule of kvp_http.h).
 */
#include "kvp_http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "kvp_error.h"
#include "kvp_log.h"

#define CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

typedef struct http_conn {
    uv_tcp_t tcp;
    uv_timer_t deadline;
    uv_write_t wr;
    uv_shutdown_t sd;
    kvp_http_t *srv;
    struct http_conn *next, *prev;
    char *resp;       /* the answer being written; freed by the write callback */
    int open_handles; /* tcp + deadline; the conn is freed when both are closed */
    int answered;
    int written; /* the answer is out: only the lingering close remains */
    int closing;
    uint64_t accepted_ms;   /* uv_now at accept */
    unsigned char peer[16]; /* the peer's address bytes (4 for IPv4), no port */
    unsigned peer_len;
    size_t len;
    char req[KVP_HTTP_MAX_REQUEST];
} http_conn_t;

struct kvp_http {
    uv_loop_t *loop;
    kvp_http_config_t cfg;
    uv_tcp_t listener;
    http_conn_t *conns;
    uint32_t num_conns;
    uint64_t evicted_total; /* connections closed to admit a newer one */
    /* admission (kvp_http.h): at most one connection waits over the limits, in the lobby;
     * while one does, the listener is paused (libuv holds the next accepted fd: held) and the
     * kernel's backlog queues the rest in arrival order */
    http_conn_t *lobby;
    int held;
    uv_timer_t retry; /* re-runs admission for the lobby */
    int open_handles; /* the listener + every connection's handles */
    int destroying;
    char *body; /* render scratch, max_body_bytes */
    char address[80];
};

/* ---- the request head, pure ---------------------------------------------------------------- */

static int is_tchar(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

int kvp__http_classify(const char *buf, size_t len, int *is_head)
{
    *is_head = 0;
    /* RFC 9112 §2.2: ignore empty lines before the request line */
    size_t start = 0;
    while (start < len && (buf[start] == '\r' || buf[start] == '\n'))
        start++;
    const char *head = buf + start;
    size_t hlen = len - start;
    const char *e1 = memmem(head, hlen, "\r\n\r\n", 4), *e2 = memmem(head, hlen, "\n\n", 2);
    const char *end = e1 && (!e2 || e1 < e2) ? e1 : e2;
    if (!end)
        return 0;
    hlen = (size_t)(end - head);

    /* request line: METHOD SP TARGET SP HTTP/x.y */
    const char *nl = memchr(head, '\n', hlen);
    size_t llen = nl ? (size_t)(nl - head) : hlen;
    if (llen && head[llen - 1] == '\r')
        llen--;
    const char *sp1 = memchr(head, ' ', llen);
    const char *sp2 = sp1 ? memchr(sp1 + 1, ' ', llen - (size_t)(sp1 + 1 - head)) : NULL;
    if (!sp1 || !sp2 || sp1 == head || sp2 == sp1 + 1)
        return 400;
    size_t mlen = (size_t)(sp1 - head), tlen = (size_t)(sp2 - sp1 - 1);
    const char *target = sp1 + 1, *version = sp2 + 1;
    size_t vlen = llen - (size_t)(version - head);
    for (size_t i = 0; i < mlen; i++)
        if (!is_tchar((unsigned char)head[i]))
            return 400;
    for (size_t i = 0; i < tlen; i++)
        if ((unsigned char)target[i] <= 0x20 || target[i] == 0x7f)
            return 400;
    if (vlen != 8 || memcmp(version, "HTTP/", 5) || version[5] < '0' || version[5] > '9' ||
        version[6] != '.' || version[7] < '0' || version[7] > '9')
        return 400;
    if (version[5] != '1' || (version[7] != '0' && version[7] != '1'))
        return 505;
    if (target[0] != '/')
        return 400; /* origin-form only: no proxy requests, no "*" */

    /* header fields: "name: value", the name a token; no control bytes but tab */
    const char *p = nl ? nl + 1 : head + hlen;
    while (p < head + hlen) {
        const char *q = memchr(p, '\n', (size_t)(head + hlen - p));
        size_t n = q ? (size_t)(q - p) : (size_t)(head + hlen - p);
        if (n && p[n - 1] == '\r')
            n--;
        const char *colon = memchr(p, ':', n);
        if (!colon || colon == p)
            return 400;
        for (const char *c = p; c < colon; c++)
            if (!is_tchar((unsigned char)*c))
                return 400;
        for (const char *c = colon + 1; c < p + n; c++)
            if (((unsigned char)*c < 0x20 && *c != '\t') || *c == 0x7f)
                return 400;
        p = q ? q + 1 : head + hlen;
    }

    int get = mlen == 3 && !memcmp(head, "GET", 3);
    int hd = mlen == 4 && !memcmp(head, "HEAD", 4);
    if (!get && !hd)
        return 405;
    *is_head = hd;
    const char *q = memchr(target, '?', tlen);
    size_t plen = q ? (size_t)(q - target) : tlen;
    if (plen != 8 || memcmp(target, "/metrics", 8))
        return 404;
    return 200;
}

/* ---- connections ---------------------------------------------------------------------------- */

static void on_server_handle_closed(kvp_http_t *h)
{
    if (--h->open_handles == 0 && h->destroying) {
        free(h->body);
        free(h);
    }
}

static void on_conn_handle_closed(uv_handle_t *hd)
{
    http_conn_t *c = hd->data;
    kvp_http_t *h = c->srv;
    if (--c->open_handles == 0)
        free(c);
    on_server_handle_closed(h);
}

static void on_retry(uv_timer_t *t);

static void conn_close(http_conn_t *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    kvp_http_t *h = c->srv;
    if (c->prev)
        c->prev->next = c->next;
    else
        h->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    h->num_conns--;
    if (h->lobby == c)
        h->lobby = NULL;
    if (!h->destroying && (h->lobby || h->held))
        uv_timer_start(&h->retry, on_retry, 0, 0); /* a slot freed: admit who waits */
    uv_close((uv_handle_t *)&c->deadline, on_conn_handle_closed);
    uv_close((uv_handle_t *)&c->tcp, on_conn_handle_closed);
}

static void on_deadline(uv_timer_t *t)
{
    http_conn_t *c = t->data;
    kvp_log(KVP_LOG_DEBUG, "metrics http timeout answered=%d bytes=%zu", c->answered, c->len);
    conn_close(c);
}

static void on_shutdown(uv_shutdown_t *sd, int status)
{
    (void)sd;
    (void)status; /* the read side sees the peer's close; the deadline bounds the wait */
}

static void on_written(uv_write_t *wr, int status)
{
    http_conn_t *c = wr->data;
    free(c->resp);
    c->resp = NULL;
    if (c->closing)
        return;
    c->written = 1;
    if (status < 0 || uv_shutdown(&c->sd, (uv_stream_t *)&c->tcp, on_shutdown) < 0)
        conn_close(c);
}

static const char *reason(int status)
{
    switch (status) {
    case 200:
        return "OK";
    case 400:
        return "Bad Request";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 431:
        return "Request Header Fields Too Large";
    default:
        return "HTTP Version Not Supported";
    }
}

/* Builds and writes the answer for status; the connection then half-closes. */
static void answer(http_conn_t *c, int status, int is_head)
{
    kvp_http_t *h = c->srv;
    const char *body = NULL;
    size_t body_len;
    char err_body[64];
    if (status == 200) {
        body_len = h->cfg.render(h->cfg.render_arg, h->body, h->cfg.max_body_bytes);
        body = h->body;
    } else {
        body_len = (size_t)snprintf(err_body, sizeof(err_body), "%d %s\n", status, reason(status));
        body = err_body;
    }
    char hdr[256];
    int n =
        snprintf(hdr, sizeof(hdr),
                 "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s"
                 "Connection: close\r\n\r\n",
                 status, reason(status), status == 200 ? CONTENT_TYPE : "text/plain; charset=utf-8",
                 body_len, status == 405 ? "Allow: GET, HEAD\r\n" : "");
    size_t send_body = is_head ? 0 : body_len;
    c->answered = 1;
    /* the head deadline is over: the rest of timeout_ms (from accept) bounds answer and close */
    uint64_t age = uv_now(h->loop) - c->accepted_ms;
    uv_timer_start(&c->deadline, on_deadline, age < h->cfg.timeout_ms ? h->cfg.timeout_ms - age : 1,
                   0);
    c->resp = malloc((size_t)n + send_body);
    if (!c->resp) {
        kvp_log(KVP_LOG_WARNING, "metrics http answer dropped reason=\"out of memory\"");
        conn_close(c);
        return;
    }
    memcpy(c->resp, hdr, (size_t)n);
    memcpy(c->resp + n, body, send_body);
    uv_buf_t b = uv_buf_init(c->resp, (unsigned)((size_t)n + send_body));
    c->wr.data = c;
    kvp_log(KVP_LOG_DEBUG, "metrics http status=%d bytes=%zu", status, (size_t)n + send_body);
    if (uv_write(&c->wr, (uv_stream_t *)&c->tcp, &b, 1, on_written) < 0) {
        free(c->resp);
        c->resp = NULL;
        conn_close(c);
    }
}

static void on_alloc(uv_handle_t *hd, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    http_conn_t *c = hd->data;
    if (c->answered) /* draining what the peer still sends: reuse the head buffer */
        *buf = uv_buf_init(c->req, sizeof(c->req));
    else
        *buf = uv_buf_init(c->req + c->len, (unsigned)(sizeof(c->req) - c->len));
}

/* n more bytes of the head are in c->req: answer once it is complete (or too large). */
static void head_bytes(http_conn_t *c, size_t n)
{
    c->len += n;
    int is_head;
    int status = kvp__http_classify(c->req, c->len, &is_head);
    if (status == 0 && c->len == sizeof(c->req))
        status = 431;
    if (status)
        answer(c, status, is_head);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    http_conn_t *c = st->data;
    if (c->closing)
        return;
    if (nread < 0) {
        conn_close(c); /* EOF (after our answer, the normal end) or an error */
        return;
    }
    if (c->answered || nread == 0)
        return;
    head_bytes(c, (size_t)nread);
}

static void peer_of(http_conn_t *c)
{
    struct sockaddr_storage ss;
    int sl = sizeof(ss);
    c->peer_len = 0;
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &sl) < 0)
        return;
    if (ss.ss_family == AF_INET) {
        memcpy(c->peer, &((struct sockaddr_in *)&ss)->sin_addr, 4);
        c->peer_len = 4;
    } else if (ss.ss_family == AF_INET6) {
        memcpy(c->peer, &((struct sockaddr_in6 *)&ss)->sin6_addr, 16);
        c->peer_len = 16;
    }
}

static int same_peer(const http_conn_t *a, const http_conn_t *b)
{
    return a->peer_len == b->peer_len && !memcmp(a->peer, b->peer, a->peer_len);
}

/* Takes what o's peer already sent without waiting (the socket is libuv's, which then just
 * finds it drained): a head that arrived is answered, a peer that left is closed. */
static void pull(http_conn_t *o)
{
    uv_os_fd_t fd;
    if (o->answered || o->closing || uv_fileno((uv_handle_t *)&o->tcp, &fd) < 0)
        return;
    ssize_t n = recv(fd, o->req + o->len, sizeof(o->req) - o->len, MSG_DONTWAIT);
    if (n > 0)
        head_bytes(o, (size_t)n);
    else if (n == 0)
        conn_close(o);
}

static int over_limit(kvp_http_t *h, const http_conn_t *c, int per_peer)
{
    if (!per_peer)
        return h->num_conns > h->cfg.max_connections;
    uint32_t max =
        h->cfg.max_connections_per_peer ? h->cfg.max_connections_per_peer : h->cfg.max_connections;
    uint32_t same = 0;
    for (http_conn_t *o = h->conns; o; o = o->next)
        same += o != c && same_peer(o, c);
    return same >= max;
}

/* The head deadline, and the time a connection has before a newer one may evict it. */
static uint32_t head_ms(const kvp_http_t *h)
{
    return h->cfg.head_timeout_ms && h->cfg.head_timeout_ms < h->cfg.timeout_ms
               ? h->cfg.head_timeout_ms
               : h->cfg.timeout_ms;
}

static uint64_t grace_ms(const kvp_http_t *h)
{
    return head_ms(h) / 10 ? head_ms(h) / 10 : 1;
}

/* The connection to close so that c can be admitted: the oldest one (of c's peer when
 * per_peer) still waiting for its head and older than the grace, else the oldest whose answer
 * is written. NULL when there is none; *wait_ms is then how long until one may be. The
 * candidates' pending bytes are taken first, so a scraper whose request arrived after its
 * accept is answered rather than evicted. The list runs newest first. */
static http_conn_t *victim(kvp_http_t *h, const http_conn_t *c, int per_peer, uint64_t *wait_ms)
{
    for (http_conn_t *o = h->conns, *next; o; o = next) {
        next = o->next; /* pull may close o (unlinking only o) */
        if (o != c && (!per_peer || same_peer(o, c)))
            pull(o);
    }
    uint64_t now = uv_now(h->loop), grace = grace_ms(h);
    http_conn_t *idle = NULL, *done = NULL;
    *wait_ms = grace;
    for (http_conn_t *o = h->conns; o; o = o->next) {
        if (o == c || (per_peer && !same_peer(o, c)))
            continue;
        uint64_t age = now - o->accepted_ms;
        if (!o->answered && age >= grace)
            idle = o;
        else if (!o->answered && grace - age < *wait_ms)
            *wait_ms = grace - age;
        else if (o->answered && o->written)
            done = o;
    }
    return idle ? idle : done;
}

/* Admits c under both limits, evicting as kvp_http.h says. Returns 0 (admitted), or the ms
 * after which to try again (c waits in the lobby). */
static uint64_t admit(kvp_http_t *h, http_conn_t *c)
{
    for (int per_peer = 1; per_peer >= 0; per_peer--) {
        if (!over_limit(h, c, per_peer))
            continue;
        uint64_t wait_ms;
        http_conn_t *v = victim(h, c, per_peer, &wait_ms);
        if (!over_limit(h, c, per_peer))
            continue; /* pulling freed a slot (a peer had left) */
        if (!v)
            return wait_ms ? wait_ms : 1;
        h->evicted_total++;
        /* an attack evicts hundreds a second: notice at powers of two, debug otherwise */
        kvp_log((h->evicted_total & (h->evicted_total - 1)) ? KVP_LOG_DEBUG : KVP_LOG_NOTICE,
                "metrics http connection evicted reason=%s age_ms=%llu head_bytes=%zu "
                "evicted_total=%llu",
                per_peer ? "peer_limit" : "limit",
                (unsigned long long)(uv_now(h->loop) - v->accepted_ms), v->len,
                (unsigned long long)h->evicted_total);
        conn_close(v);
    }
    return 0;
}

/* Accepts the connection libuv has ready (0), or leaves it there (-1: out of memory). */
static int accept_one(kvp_http_t *h)
{
    http_conn_t *c = calloc(1, sizeof(*c));
    if (!c) {
        kvp_log(KVP_LOG_WARNING, "metrics http accept deferred reason=\"out of memory\"");
        return -1;
    }
    c->srv = h;
    uv_tcp_init(h->loop, &c->tcp);
    uv_timer_init(h->loop, &c->deadline);
    c->tcp.data = c->deadline.data = c;
    c->open_handles = 2;
    h->open_handles += 2;
    c->next = h->conns;
    if (h->conns)
        h->conns->prev = c;
    h->conns = c;
    h->num_conns++;
    if (uv_accept((uv_stream_t *)&h->listener, (uv_stream_t *)&c->tcp) < 0) {
        conn_close(c);
        return 0;
    }
    c->accepted_ms = uv_now(h->loop);
    peer_of(c);
    uv_timer_start(&c->deadline, on_deadline, head_ms(h), 0);
    if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) < 0) {
        conn_close(c);
        return 0;
    }
    /* a scraper's request usually came with the connection: take it now */
    pull(c);
    if (c->closing)
        return 0;
    uint64_t wait_ms = admit(h, c);
    if (wait_ms) {
        /* over a limit with nobody to evict yet: c waits (reading; its deadline runs) and
         * the listener pauses until it is admitted or gone */
        h->lobby = c;
        uv_timer_start(&h->retry, on_retry, wait_ms, 0);
    }
    return 0;
}

static void on_retry(uv_timer_t *t)
{
    kvp_http_t *h = t->data;
    if (h->destroying)
        return;
    if (h->lobby) {
        uint64_t wait_ms = admit(h, h->lobby);
        if (wait_ms) {
            uv_timer_start(&h->retry, on_retry, wait_ms, 0);
            return;
        }
        h->lobby = NULL;
    }
    if (h->held && accept_one(h) == 0)
        h->held = 0; /* libuv polls the listener again */
    else if (h->held)
        uv_timer_start(&h->retry, on_retry, 100, 0); /* out of memory: try again later */
}

static void on_accept(uv_stream_t *ls, int status)
{
    kvp_http_t *h = ls->data;
    if (status < 0 || h->destroying)
        return;
    if (h->lobby || accept_one(h) < 0) {
        /* not accepted: libuv stops polling the listener until on_retry accepts it */
        h->held = 1;
        if (!h->lobby)
            uv_timer_start(&h->retry, on_retry, 100, 0);
    }
}

/* ---- the server ----------------------------------------------------------------------------- */

/* Splits "host:port" / "[v6]:port" into host and port strings. */
static int split_listen(const char *s, char *host, size_t host_len, char *port, size_t port_len)
{
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s || !colon[1] || strlen(colon + 1) >= port_len)
        return KVP_EINVAL;
    const char *h = s;
    size_t n = (size_t)(colon - s);
    if (s[0] == '[') {
        if (n < 3 || colon[-1] != ']')
            return KVP_EINVAL;
        h++;
        n -= 2;
    }
    if (n >= host_len)
        return KVP_EINVAL;
    memcpy(host, h, n);
    host[n] = '\0';
    strcpy(port, colon + 1);
    return 0;
}

static void on_listener_closed(uv_handle_t *hd)
{
    on_server_handle_closed(hd->data);
}

int kvp_http_create(uv_loop_t *loop, const kvp_http_config_t *cfg, kvp_http_t **out)
{
    if (!loop || !cfg || !cfg->listen || !cfg->render || !out || !cfg->max_connections ||
        !cfg->timeout_ms || cfg->max_body_bytes < 1024)
        return KVP_EINVAL;
    char host[64], port[8];
    if (split_listen(cfg->listen, host, sizeof(host), port, sizeof(port)))
        return KVP_EINVAL;
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | AI_PASSIVE};
    struct addrinfo *ai;
    if (getaddrinfo(host, port, &hints, &ai)) {
        kvp_log(KVP_LOG_ERR, "metrics_listen does not resolve address=%s", cfg->listen);
        return KVP_EINVAL;
    }
    int rc;
    kvp_http_t *h = calloc(1, sizeof(*h));
    if (!h) {
        rc = KVP_ENOMEM;
        goto fail_ai;
    }
    h->body = malloc(cfg->max_body_bytes);
    if (!h->body) {
        rc = KVP_ENOMEM;
        goto fail_alloc;
    }
    h->loop = loop;
    h->cfg = *cfg;
    h->cfg.listen = NULL; /* borrowed only for the call */
    uv_tcp_init(loop, &h->listener);
    h->listener.data = h;
    uv_timer_init(loop, &h->retry);
    h->retry.data = h;
    h->open_handles = 2;
    if ((rc = uv_tcp_bind(&h->listener, ai->ai_addr, 0)) < 0 ||
        (rc = uv_listen((uv_stream_t *)&h->listener, 511, on_accept)) < 0)
        goto fail_listener;
    struct sockaddr_storage ss;
    int sl = sizeof(ss);
    char ip[64] = "?";
    int bound_port = 0;
    if (uv_tcp_getsockname(&h->listener, (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET6) {
            uv_ip6_name((struct sockaddr_in6 *)&ss, ip, sizeof(ip));
            bound_port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
            snprintf(h->address, sizeof(h->address), "[%s]:%d", ip, bound_port);
        } else {
            uv_ip4_name((struct sockaddr_in *)&ss, ip, sizeof(ip));
            bound_port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
            snprintf(h->address, sizeof(h->address), "%s:%d", ip, bound_port);
        }
    }
    freeaddrinfo(ai);
    kvp_log(KVP_LOG_NOTICE, "metrics http listening address=%s path=/metrics", h->address);
    *out = h;
    return 0;

fail_listener:
    /* the listener handle exists: it must be closed through the loop; destroying frees h */
    kvp_log(KVP_LOG_ERR, "metrics_listen cannot listen address=%s reason=\"%s\"", cfg->listen,
            uv_strerror(rc));
    h->destroying = 1;
    uv_close((uv_handle_t *)&h->listener, on_listener_closed);
    uv_close((uv_handle_t *)&h->retry, on_listener_closed);
    freeaddrinfo(ai);
    return rc; /* libuv errors are negative errno values */
fail_alloc:
    free(h);
fail_ai:
    freeaddrinfo(ai);
    return rc;
}

const char *kvp_http_address(const kvp_http_t *h)
{
    return h ? h->address : "";
}

void kvp_http_destroy(kvp_http_t *h)
{
    if (!h || h->destroying)
        return;
    h->destroying = 1;
    while (h->conns)
        conn_close(h->conns);
    uv_close((uv_handle_t *)&h->listener, on_listener_closed);
    uv_close((uv_handle_t *)&h->retry, on_listener_closed);
}
