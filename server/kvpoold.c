/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvpoold.c - the daemon's main: configuration (file, flags, --check-config), logging, the
 * backend, the RPC state and the socket server on one libuv loop, signals (SIGTERM/SIGINT
 * drain and exit 0, SIGHUP reloads what can be reloaded), systemd notify (READY, STATUS,
 * WATCHDOG, STOPPING), socket activation (LISTEN_FDS), lease expiry and the health check
 * that makes an unhealthy daemon exit non-zero so its service manager restarts it.
 *
 * With no configuration and no GPU it serves the embedded default: a host-backend pool of
 * 256 MiB (2 layers, 8 KV heads, head_dim 128, fp16, page 16) on the default socket.
 */
#include <errno.h>
#include <grp.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "kvp_backend_choose.h"
#include "kvp_config.h"
#include "kvp_error.h"
#include "kvp_evpub.h"
#include "kvp_http.h"
#include "kvp_kernels_cuda.h"
#include "kvp_log.h"
#include "kvp_nccl.h"
#include "kvp_notify.h"
#include "kvp_rpc.h"
#include "kvp_server.h"
#include "kvpool_version.h"

#define EXIT_UNHEALTHY 70 /* EX_SOFTWARE: restart me */

typedef struct {
    uv_loop_t *loop;
    kvp_config_t cfg;
    kvp_rpc_t *rpc;
    kvp_server_t *server;
    kvp_http_t *http;        /* the Prometheus endpoint, NULL when metrics_listen is empty */
    kvp_evpub_t *evpub;      /* KV events (issue #29), NULL when events.endpoint is empty */
    kvp_ev_stats_t ev_stats; /* its counters */
    uv_check_t ev_flush;     /* closes the batch of events when it is due */
    uv_timer_t ev_timer;     /* ... or when it comes due later (events.batch_ms) */
    kvp_notify_t notify;
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t tick;     /* leases, health, status */
    uv_timer_t commits;  /* polls the events of pending prefix-cache Commits */
    uv_timer_t watchdog; /* WATCHDOG=1 */
    uint64_t watchdog_usec;
    int exit_code;
    int stopping;
} daemon_t;

static void close_handles(daemon_t *d)
{
    uv_handle_t *hs[] = {(uv_handle_t *)&d->sig_term, (uv_handle_t *)&d->sig_int,
                         (uv_handle_t *)&d->sig_hup,  (uv_handle_t *)&d->tick,
                         (uv_handle_t *)&d->watchdog, (uv_handle_t *)&d->commits,
                         (uv_handle_t *)&d->ev_flush, (uv_handle_t *)&d->ev_timer};
    for (unsigned i = 0; i < sizeof(hs) / sizeof(hs[0]); i++)
        if (!uv_is_closing(hs[i]))
            uv_close(hs[i], NULL);
    kvp_http_destroy(d->http);
    d->http = NULL;
    kvp_server_destroy(d->server);
}

static void on_drained(void *arg)
{
    daemon_t *d = arg;
    kvp_log(KVP_LOG_NOTICE, "drained; exiting");
    close_handles(d);
}

static void begin_stop(daemon_t *d, const char *why)
{
    if (d->stopping)
        return;
    d->stopping = 1;
    kvp_log(KVP_LOG_NOTICE, "stopping reason=%s", why);
    kvp_notify_send(&d->notify, "STOPPING=1\nSTATUS=draining");
    kvp_server_drain(d->server, on_drained, d);
}

/* [access] pool_uids / pool_gids -> who may receive the pool fds (kvp_access.h) */
static kvp_pool_access_t pool_access(const kvp_config_t *c)
{
    kvp_pool_access_t a = {.self_uid = (uint32_t)geteuid()};
    a.num_uids = c->pool_uids.count < KVP_ACCESS_MAX_IDS ? c->pool_uids.count : KVP_ACCESS_MAX_IDS;
    a.num_gids = c->pool_gids.count < KVP_ACCESS_MAX_IDS ? c->pool_gids.count : KVP_ACCESS_MAX_IDS;
    memcpy(a.uids, c->pool_uids.ids, a.num_uids * sizeof(a.uids[0]));
    memcpy(a.gids, c->pool_gids.ids, a.num_gids * sizeof(a.gids[0]));
    if (a.num_uids || a.num_gids)
        kvp_log(KVP_LOG_INFO, "pool access policy pool_uids=%u pool_gids=%u", a.num_uids,
                a.num_gids);
    return a;
}

/* [access] cache_scopes -> who may join which shared prefix-cache scope (kvp_access.h);
 * the config check already parsed it */
static kvp_scope_access_t scope_access(const kvp_config_t *c)
{
    kvp_scope_access_t a = {.self_uid = (uint32_t)geteuid()};
    char why[160];
    if (kvp_access_scopes_parse(c->cache_scopes, &a, why, sizeof(why)))
        kvp_log(KVP_LOG_ERR, "access.cache_scopes ignored reason=\"%s\"", why);
    else if (a.count)
        kvp_log(KVP_LOG_INFO, "cache scopes shared across uids scopes=%u", a.count);
    return a;
}

/* [limits] and [transfer] are the rows of rpc/kvp_rpc_limits.h in both structs: copied
 * whole; then what the rpc layer takes from the rest of the configuration. */
static kvp_rpc_limits_t rpc_limits(const kvp_config_t *c)
{
    kvp_rpc_limits_t l = {.operator_uid = (uint32_t)geteuid()};
    KVP_RPC_LIMITS_COPY(&l, c);
    l.pool_access = pool_access(c);
    l.scope_access = scope_access(c);
    return l;
}

/* [tuning] -> the cuda backend and the transfers over it. The config's table holds the kernel
 * keys' bounds and names as numbers: they must be the kernels' own. */
_Static_assert(KVP_APPEND_CUDA_KERNEL_AUTO == 0 && KVP_APPEND_CUDA_KERNEL_WARP == 1 &&
                   KVP_APPEND_CUDA_KERNEL_BLOCK == 2 && KVP_APPEND_CUDA_KERNEL_FLAT == 3,
               "tuning.append_kernel: auto, warp, block, flat");
_Static_assert(KVP_APPEND_CUDA_HINT_LD == 1 && KVP_APPEND_CUDA_HINT_ST == 2,
               "tuning.append_hints: none, ld, st, ldst");
_Static_assert(KVP_APPEND_CUDA_MAX_TPB == 64 && KVP_APPEND_CUDA_MAX_BPSM == 1024 &&
                   KVP_APPEND_CUDA_MAX_WARPS == 8 && KVP_APPEND_CUDA_MAX_ITEMS == 8 &&
                   KVP_PACK_CUDA_MAX_BLOCKS == 65535,
               "the bounds of kvp_config.c's [tuning] keys");

static kvp_backend_tuning_t backend_tuning(const kvp_config_t *c)
{
    return (kvp_backend_tuning_t){
        .ready_timeout_ms = c->cuda_ready_timeout_ms,
        .plan_upload = c->cuda_plan_upload,
        .append = {.kernel = c->append_kernel,
                   .tokens_per_block = c->append_tokens_per_block,
                   .blocks_per_sm = c->append_blocks_per_sm,
                   .warps_per_block = c->append_warps_per_block,
                   .hints = c->append_hints,
                   .vecs_per_thread = c->append_vecs_per_thread},
        .pack_blocks = c->pack_blocks,
        .xfer_stages = c->xfer_stages,
        .xfer_register = c->xfer_register,
        .xfer_priority = c->xfer_priority,
    };
}

static void set_access(daemon_t *d)
{
    kvp_server_set_access(d->server, d->cfg.allowed_uids.ids, d->cfg.allowed_uids.count,
                          d->cfg.allowed_gids.ids, d->cfg.allowed_gids.count);
}

static void on_signal(uv_signal_t *h, int signum)
{
    daemon_t *d = h->data;
    if (signum == SIGHUP) {
        if (!d->cfg.config_path[0]) {
            kvp_log(KVP_LOG_NOTICE, "reload skipped reason=\"no config file\"");
            return;
        }
        kvp_notify_send(&d->notify, "RELOADING=1");
        kvp_config_t next;
        char err[512];
        int rc = kvp_config_reload_file(&d->cfg, d->cfg.config_path, &next, err, sizeof(err));
        if (rc < 0) {
            kvp_log(KVP_LOG_ERR, "reload failed; keeping the running config reason=\"%s\"", err);
        } else {
            if (rc > 0)
                kvp_log(KVP_LOG_WARNING, "reload: %s", err);
            d->cfg = next;
            kvp_log_set_level(d->cfg.log_level);
            kvp_server_config_t sl = {0};
            KVP_SERVER_LIMITS_COPY(&sl, &d->cfg);
            kvp_server_set_limits(d->server, &sl);
            kvp_rpc_limits_t lim = rpc_limits(&d->cfg);
            kvp_rpc_set_limits(d->rpc, &lim);
            set_access(d);
            kvp_log(KVP_LOG_NOTICE, "reloaded config=%s", d->cfg.config_path);
        }
        kvp_notify_send(&d->notify, "READY=1");
        return;
    }
    begin_stop(d, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

static void on_tick(uv_timer_t *t)
{
    daemon_t *d = t->data;
    kvp_rpc_expire_leases(d->rpc, kvp_server_now_ms());
    if (!d->stopping && !kvp_rpc_healthy(d->rpc)) {
        kvp_log(KVP_LOG_CRIT, "unhealthy; exiting so the service manager restarts the daemon");
        kvp_notify_send(&d->notify, "STATUS=unhealthy\nSTOPPING=1");
        d->exit_code = EXIT_UNHEALTHY;
        d->stopping = 1;
        close_handles(d);
    }
}

/* While Commits wait for their workers' events, poll them every server.commit_poll_ms. */
static void on_commits(uv_timer_t *t)
{
    daemon_t *d = t->data;
    if (kvp_rpc_poll_commits(d->rpc, kvp_server_now_ms()) == 0)
        uv_timer_stop(t);
}

static void commit_wake(void *arg)
{
    daemon_t *d = arg;
    if (!uv_is_closing((uv_handle_t *)&d->commits))
        uv_timer_start(&d->commits, on_commits, d->cfg.commit_poll_ms, d->cfg.commit_poll_ms);
}

static void on_watchdog(uv_timer_t *t)
{
    daemon_t *d = t->data;
    if (kvp_rpc_healthy(d->rpc))
        kvp_notify_send(&d->notify, "WATCHDOG=1");
}

/* The HTTP endpoint's text is the Metrics RPC's text: one source for both. */
static size_t render_metrics(void *arg, char *buf, size_t cap)
{
    daemon_t *d = arg;
    return kvp_rpc_metrics_text(d->rpc, buf, cap, kvp_server_now_ms());
}

static int resolve_group(const char *name, int64_t *gid, char *err, size_t err_len)
{
    *gid = -1;
    if (!name[0])
        return 0;
    char *end;
    unsigned long v = strtoul(name, &end, 10);
    if (!*end) {
        *gid = (int64_t)v;
        return 0;
    }
    struct group *g = getgrnam(name);
    if (!g) {
        snprintf(err, err_len, "server.socket_group: no group '%s'", name);
        return KVP_EINVAL;
    }
    *gid = g->gr_gid;
    return 0;
}

/* After the callbacks of a loop iteration, and when the open batch comes due: the batch goes
 * out once it is events.batch_ms old (kvp_rpc_events_tick); until then a timer waits for it. */
static void on_ev_timer(uv_timer_t *h);

static void ev_tick(daemon_t *d)
{
    uint32_t in = kvp_rpc_events_tick(d->rpc, d->cfg.events_batch_ms);
    /* a timer only while a batch waits: one the loop already closed must not wake it again */
    if (in == UINT32_MAX)
        uv_timer_stop(&d->ev_timer);
    else if (!uv_is_active((uv_handle_t *)&d->ev_timer))
        uv_timer_start(&d->ev_timer, on_ev_timer, in, 0);
}

static void on_ev_timer(uv_timer_t *h)
{
    ev_tick(h->data);
}

static void on_ev_flush(uv_check_t *h)
{
    ev_tick(h->data);
}

/* [events] -> the publisher (before the rpc layer, whose first batch it takes). A bind that
 * fails stops the start, as the metrics endpoint's does. */
static int start_events(daemon_t *d, kvp_rpc_limits_t *lim, char *err, size_t err_len)
{
    if (!d->cfg.events_endpoint[0])
        return 0;
    kvp_evpub_config_t ec = {.endpoint = d->cfg.events_endpoint,
                             .replay_endpoint = d->cfg.events_replay_endpoint,
                             .topic = d->cfg.events_topic,
                             .buffer_steps = d->cfg.events_buffer_steps,
                             .hwm = d->cfg.events_hwm};
    char why[384];
    int rc = kvp_evpub_start(&ec, &d->ev_stats, &d->evpub, why, sizeof(why));
    if (rc) {
        snprintf(err, err_len, "events: %s", why);
        return rc;
    }
    const char *rep = kvp_evpub_replay_endpoint(d->evpub);
    kvp_log(KVP_LOG_INFO, "events endpoint=%s replay_endpoint=%s topic=\"%s\"",
            kvp_evpub_endpoint(d->evpub), rep && rep[0] ? rep : "-", d->cfg.events_topic);
    lim->ev_sink = kvp_evpub_submit;
    lim->ev_ctx = d->evpub;
    lim->ev_stats = &d->ev_stats;
    return 0;
}

static int run(daemon_t *d)
{
    char err[512] = "";
    int rc;
    int64_t gid;
    if ((rc = resolve_group(d->cfg.socket_group, &gid, err, sizeof(err))))
        goto fail;
    int listen_fd = -1, fds[4];
    int n = kvp_listen_fds(fds, 4);
    if (n < 0) {
        snprintf(err, sizeof(err), "LISTEN_FDS: %s", kvp_strerror(n));
        rc = n;
        goto fail;
    }
    if (n >= 1)
        listen_fd = fds[0];
    for (int i = 1; i < n; i++)
        close(fds[i]);

    if ((rc = kvp_nccl_set_library(d->cfg.nccl_lib))) {
        snprintf(err, sizeof(err), "tuning.nccl_lib: %s", kvp_strerror(rc));
        goto fail;
    }
    kvp_backend_t *backend;
    kvp_backend_tuning_t tuning = backend_tuning(&d->cfg);
    if ((rc = kvp_backend_choose(&d->cfg, &tuning, &backend, err, sizeof(err))))
        goto fail;
    kvp_rpc_limits_t lim = rpc_limits(&d->cfg);
    if ((rc = start_events(d, &lim, err, sizeof(err)))) {
        backend->ops->destroy(backend);
        goto fail;
    }
    if ((rc = kvp_rpc_create(backend, &lim, kvp_server_now_ms(), &d->rpc))) {
        backend->ops->destroy(backend);
        snprintf(err, sizeof(err), "cannot create the daemon state: %s", kvp_strerror(rc));
        goto fail;
    }
    /* Signals before the socket exists: a SIGHUP or SIGTERM that arrives as soon as a client
     * can connect must find our handlers, not the default action (terminate). They are
     * delivered through the loop, which runs only after the server is created. */
    signal(SIGPIPE, SIG_IGN);
    uv_signal_t *sigs[] = {&d->sig_term, &d->sig_int, &d->sig_hup};
    int nums[] = {SIGTERM, SIGINT, SIGHUP};
    for (int i = 0; i < 3; i++) {
        uv_signal_init(d->loop, sigs[i]);
        sigs[i]->data = d;
        uv_signal_start(sigs[i], on_signal, nums[i]);
    }
    kvp_server_config_t sc = {
        .socket_path = listen_fd >= 0 ? NULL : d->cfg.socket, /* inherited: not ours */
        .socket_mode = d->cfg.socket_mode,
        .socket_gid = gid,
        .listen_fd = listen_fd,
        .max_frame_bytes = (uint32_t)d->cfg.max_frame_bytes,
        .threads = kvp_config_copy_threads(&d->cfg),
        .busy_poll_us = d->cfg.busy_poll_us,
    };
    KVP_SERVER_LIMITS_COPY(&sc, &d->cfg);
    uv_timer_init(d->loop, &d->tick);
    d->tick.data = d;
    uv_timer_start(&d->tick, on_tick, 100, 100);
    uv_timer_init(d->loop, &d->commits);
    d->commits.data = d;
    kvp_rpc_set_commit_wake(d->rpc, commit_wake, d);
    uv_timer_init(d->loop, &d->watchdog);
    d->watchdog.data = d;
    uv_check_init(d->loop, &d->ev_flush);
    d->ev_flush.data = d;
    uv_timer_init(d->loop, &d->ev_timer);
    d->ev_timer.data = d;
    uv_unref((uv_handle_t *)&d->ev_timer); /* neither keeps a draining daemon up */
    if (d->evpub) {
        uv_check_start(&d->ev_flush, on_ev_flush);
        uv_unref((uv_handle_t *)&d->ev_flush);
    }
    /* the metrics listener before the socket: once a client can connect, everything the
     * daemon serves is up (a test, or an operator, that waits for the socket can scrape) */
    if (d->cfg.metrics_listen[0]) {
        /* asked for explicitly, so a port in use or a typo stops the start-up loudly */
        kvp_http_config_t hc = {
            .listen = d->cfg.metrics_listen,
            .max_connections = d->cfg.metrics_max_connections,
            .max_connections_per_peer = d->cfg.metrics_max_connections_per_peer,
            .head_timeout_ms = d->cfg.metrics_head_timeout_ms,
            .timeout_ms = d->cfg.metrics_timeout_ms,
            .max_body_bytes = 4u << 20,
            .render = render_metrics,
            .render_arg = d,
        };
        if ((rc = kvp_http_create(d->loop, &hc, &d->http))) {
            snprintf(err, sizeof(err), "cannot serve metrics on %s: %s", d->cfg.metrics_listen,
                     kvp_strerror(rc));
            goto fail_server;
        }
    }
    if ((rc = kvp_server_create(d->loop, &sc, d->rpc, &d->server))) {
        snprintf(err, sizeof(err), "cannot listen on %s: %s", d->cfg.socket, kvp_strerror(rc));
        goto fail_server;
    }
    set_access(d);
    kvp_notify_open(&d->notify);
    if (d->cfg.watchdog && kvp_notify_watchdog_usec(&d->watchdog_usec) == 0 && d->watchdog_usec) {
        uint64_t every_ms = d->watchdog_usec / 2000 ? d->watchdog_usec / 2000 : 1;
        uv_timer_start(&d->watchdog, on_watchdog, every_ms, every_ms);
        kvp_log(KVP_LOG_INFO, "watchdog interval_ms=%llu", (unsigned long long)every_ms);
    }
    kvp_geom_t g;
    kvp_config_geom(&d->cfg, &g);
    kvp_log(KVP_LOG_NOTICE,
            "ready version=%s backend=%s pages=%u page_size=%u layers=%u heads=%u head_dim=%u "
            "dtype=%s layout=%s storage=%s",
            KVP_VERSION_STRING, kvp_rpc_backend(d->rpc)->ops->name, g.num_pages, g.page_size,
            g.num_layers, g.num_kv_heads, g.head_dim, kvp_dtype_name(g.dtype),
            kvp_layout_name(g.layout), kvp_storage_name(g.storage));
    char status[256];
    snprintf(status, sizeof(status), "READY=1\nSTATUS=serving %u pages on %s\nMAINPID=%d",
             g.num_pages, kvp_rpc_backend(d->rpc)->ops->name, (int)getpid());
    kvp_notify_send(&d->notify, status);

    uv_run(d->loop, UV_RUN_DEFAULT);

    kvp_stats_t st;
    kvp_seqtab_stats(kvp_rpc_seqtab(d->rpc), &st);
    kvp_log(KVP_LOG_NOTICE, "final seqs=%u tokens=%llu used_pages=%u exit_code=%d", st.num_seqs,
            (unsigned long long)st.num_tokens, st.used_pages, d->exit_code);
    kvp_notify_close(&d->notify);
    kvp_rpc_destroy(d->rpc); /* its last event batch: AllBlocksCleared */
    kvp_evpub_stop(d->evpub, 1000);
    return d->exit_code;

fail_server:
    /* the server's and the signals' handles must close through the loop before the state
     * they point at goes away */
    close_handles(d);
    uv_run(d->loop, UV_RUN_DEFAULT);
    kvp_rpc_destroy(d->rpc);
fail:
    kvp_evpub_stop(d->evpub, 0);
    d->evpub = NULL;
    kvp_log(KVP_LOG_ERR, "startup failed reason=\"%s\"", err);
    return 1;
}

int main(int argc, char **argv)
{
    static daemon_t d;
    char err[1024] = "";
    /* Large blocks (big answers, kept retry answers) come from mmap and go back to the system
     * when freed: a fixed threshold turns off glibc's sliding one, which otherwise moves up
     * after the first large free and leaves later large blocks in the heap, resident after
     * their release. */
    mallopt(M_MMAP_THRESHOLD, 128 * 1024);
    kvp_log_init();
    kvp_config_defaults(&d.cfg);
    kvp_config_action_t action;
    if (kvp_config_parse_args(&d.cfg, argc, argv, &action, err, sizeof(err))) {
        fprintf(stderr, "kvpoold: %s\n(kvpoold --help for usage)\n", err);
        /* --check-config reports a bad configuration as 1, like a failed validation */
        for (int i = 1; i < argc; i++)
            if (!strcmp(argv[i], "--check-config"))
                return 1;
        return 2;
    }
    if (action == KVP_CONFIG_HELP) {
        kvp_config_usage(stdout, "kvpoold");
        return 0;
    }
    if (action == KVP_CONFIG_VERSION) {
        printf("kvpoold %s\n", KVP_VERSION_STRING);
        return 0;
    }
    if (kvp_config_validate(&d.cfg, err, sizeof(err))) {
        fprintf(stderr, "kvpoold: invalid configuration: %s\n", err);
        return action == KVP_CONFIG_CHECK ? 1 : 2;
    }
    if (action == KVP_CONFIG_CHECK) {
        kvp_config_dump(&d.cfg, stdout);
        fprintf(stderr, "kvpoold: configuration ok\n");
        return 0;
    }
    kvp_log_set_level(d.cfg.log_level);
    d.loop = uv_default_loop();
    int rc = run(&d);
    uv_loop_close(d.loop);
    return rc;
}
