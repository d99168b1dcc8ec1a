/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvpoolctl_top.c - `kvpoolctl top` (see kvpoolctl_top.h). Each refresh asks for the Metrics
 * text (kvp_client_metrics), parses it into a snapshot (kvp_prom), and draws the difference with
 * the previous snapshot: counters become rates, histograms become the latency percentiles of the
 * interval. The terminal state is saved before anything changes and restored by one function that
 * every exit path reaches (and atexit, for an exit from a library).
 */
#include "kvpoolctl_top.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "kvp_prom.h"

#define METRICS_BYTES (4u << 20)
#define MAX_DEV       64
#define MAX_NS        256
#define MAX_CALLS     24
#define MAX_BUCKETS   32
#define TOP_NS_SHOWN  10

typedef struct {
    char name[24];
    int nb;
    double le[MAX_BUCKETS], cum[MAX_BUCKETS];
} hist_t;

typedef struct {
    double t; /* monotonic seconds */
    char version[32], backend[16];
    double up, uptime, clients, page_bytes, live_seqs, live_tokens;
    double requests, errors, append_bytes, page_allocs, alloc_fail, evicted;
    int ndev;
    int dev_id[MAX_DEV];
    double dev[MAX_DEV][4]; /* capacity, used, free, shared */
    int nns;
    struct {
        char name[160];
        double seqs, tokens;
    } ns[MAX_NS];
    int ncalls;
    hist_t call[MAX_CALLS];
    int has_cache; /* the daemon writes the kvpool_prefix_cache_* families */
    double cache_cached, cache_pinned, cache_query, cache_hit;
} snap_t;

/* ---- the terminal ------------------------------------------------------------------------- */

static struct {
    int active; /* raw mode and screen changed: restore on exit */
    int have_termios;
    struct termios saved;
} term;

static volatile sig_atomic_t stop_signal, resized;

static void on_stop(int sig)
{
    stop_signal = sig;
}

static void on_winch(int sig)
{
    (void)sig;
    resized = 1;
}

static void term_restore(void)
{
    if (!term.active)
        return;
    term.active = 0;
    /* cursor shown, attributes reset, back from the alternate screen */
    static const char seq[] = "\033[0m\033[?25h\033[?1049l";
    ssize_t w = write(STDOUT_FILENO, seq, sizeof(seq) - 1);
    (void)w;
    if (term.have_termios)
        tcsetattr(STDIN_FILENO, TCSAFLUSH, &term.saved);
}

static void term_enter(void)
{
    if (isatty(STDIN_FILENO) && tcgetattr(STDIN_FILENO, &term.saved) == 0) {
        struct termios raw = term.saved;
        /* keys one at a time, not echoed; ISIG stays on so Ctrl-C still raises SIGINT */
        raw.c_lflag &= ~(tcflag_t)(ICANON | ECHO);
        raw.c_cc[VMIN] = 0;
        raw.c_cc[VTIME] = 0;
        term.have_termios = tcsetattr(STDIN_FILENO, TCSAFLUSH, &raw) == 0;
    }
    term.active = 1;
    atexit(term_restore);
    fputs("\033[?1049h\033[?25l", stdout);
    fflush(stdout);
}

static int term_cols(void)
{
    struct winsize ws;
    if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col >= 40)
        return ws.ws_col;
    return 80;
}

/* ---- snapshots -------------------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int state_index(const char *s)
{
    static const char *const names[] = {"capacity", "used", "free", "shared"};
    for (int i = 0; i < 4; i++)
        if (!strcmp(s, names[i]))
            return i;
    return -1;
}

static int dev_slot(snap_t *sn, int id)
{
    for (int i = 0; i < sn->ndev; i++)
        if (sn->dev_id[i] == id)
            return i;
    if (sn->ndev == MAX_DEV)
        return -1;
    sn->dev_id[sn->ndev] = id;
    return sn->ndev++;
}

static int ns_slot(snap_t *sn, const char *name)
{
    for (int i = 0; i < sn->nns; i++)
        if (!strcmp(sn->ns[i].name, name))
            return i;
    if (sn->nns == MAX_NS)
        return -1;
    snprintf(sn->ns[sn->nns].name, sizeof(sn->ns[0].name), "%.*s", (int)sizeof(sn->ns[0].name) - 1,
             name);
    return sn->nns++;
}

static hist_t *call_slot(snap_t *sn, const char *name)
{
    for (int i = 0; i < sn->ncalls; i++)
        if (!strcmp(sn->call[i].name, name))
            return &sn->call[i];
    if (sn->ncalls == MAX_CALLS)
        return NULL;
    hist_t *h = &sn->call[sn->ncalls++];
    snprintf(h->name, sizeof(h->name), "%.*s", (int)sizeof(h->name) - 1, name);
    return h;
}

/* The snapshot of one Metrics text; with ns, of namespace ns only among the namespaces. */
static void parse_snapshot(const char *text, size_t len, const char *ns, snap_t *sn)
{
    memset(sn, 0, sizeof(*sn));
    sn->t = now_s();
    size_t pos = 0;
    kvp_prom_sample_t s;
    char a[160], b[64];
    while (kvp_prom_next(text, len, &pos, &s)) {
        if (kvp_prom_is(&s, "kvpool_build_info")) {
            kvp_prom_label(&s, "version", sn->version, sizeof(sn->version));
            kvp_prom_label(&s, "backend", sn->backend, sizeof(sn->backend));
        } else if (kvp_prom_is(&s, "kvpool_up")) {
            sn->up = s.value;
        } else if (kvp_prom_is(&s, "kvpool_uptime_seconds")) {
            sn->uptime = s.value;
        } else if (kvp_prom_is(&s, "kvpool_connected_clients")) {
            sn->clients = s.value;
        } else if (kvp_prom_is(&s, "kvpool_page_size_bytes")) {
            sn->page_bytes = s.value;
        } else if (kvp_prom_is(&s, "kvpool_live_sequences")) {
            sn->live_seqs = s.value;
        } else if (kvp_prom_is(&s, "kvpool_live_tokens")) {
            sn->live_tokens = s.value;
        } else if (kvp_prom_is(&s, "kvpool_append_bytes_total")) {
            sn->append_bytes = s.value;
        } else if (kvp_prom_is(&s, "kvpool_page_allocations_total")) {
            sn->page_allocs = s.value;
        } else if (kvp_prom_is(&s, "kvpool_allocation_failures_total")) {
            sn->alloc_fail += s.value;
        } else if (kvp_prom_is(&s, "kvpool_evicted_sequences_total")) {
            sn->evicted += s.value;
        } else if (kvp_prom_is(&s, "kvpool_pages")) {
            int st, d;
            if (kvp_prom_label(&s, "device", b, sizeof(b)) == 0 &&
                kvp_prom_label(&s, "state", a, sizeof(a)) == 0 && (st = state_index(a)) >= 0 &&
                (d = dev_slot(sn, atoi(b))) >= 0)
                sn->dev[d][st] = s.value;
        } else if (kvp_prom_is(&s, "kvpool_sequences") || kvp_prom_is(&s, "kvpool_tokens")) {
            int i;
            if (kvp_prom_label(&s, "namespace", a, sizeof(a)) == 0 && (!ns || !strcmp(a, ns)) &&
                (i = ns_slot(sn, a)) >= 0) {
                if (kvp_prom_is(&s, "kvpool_sequences"))
                    sn->ns[i].seqs = s.value;
                else
                    sn->ns[i].tokens = s.value;
            }
        } else if (kvp_prom_is(&s, "kvpool_prefix_cache_pages")) {
            sn->has_cache = 1;
            if (kvp_prom_label(&s, "tier", b, sizeof(b)) == 0 && strcmp(b, "gpu") != 0)
                continue; /* the host tier's pages are not the pool's */
            if (kvp_prom_label(&s, "state", a, sizeof(a)) == 0) {
                if (!strcmp(a, "cached"))
                    sn->cache_cached = s.value;
                else if (!strcmp(a, "pinned"))
                    sn->cache_pinned = s.value;
            }
        } else if (kvp_prom_is(&s, "kvpool_prefix_cache_query_tokens_total")) {
            sn->cache_query = s.value;
        } else if (kvp_prom_is(&s, "kvpool_prefix_cache_hit_tokens_total")) {
            sn->cache_hit += s.value; /* found in either tier (the series of each, issue #28) */
        } else if (kvp_prom_is(&s, "kvpool_rpc_requests_total")) {
            sn->requests += s.value;
            if (kvp_prom_label(&s, "code", b, sizeof(b)) == 0 && strcmp(b, "OK") != 0)
                sn->errors += s.value;
        } else if (kvp_prom_is(&s, "kvpool_rpc_duration_seconds_bucket")) {
            hist_t *h;
            if (kvp_prom_label(&s, "call", a, sizeof(a)) == 0 &&
                kvp_prom_label(&s, "le", b, sizeof(b)) == 0 && (h = call_slot(sn, a)) &&
                h->nb < MAX_BUCKETS) {
                h->le[h->nb] = strcmp(b, "+Inf") ? strtod(b, NULL) : INFINITY;
                h->cum[h->nb++] = s.value;
            }
        }
    }
}

/* The interval's histogram of call c: cur minus prev (or cur alone without prev). */
static int interval_hist(const hist_t *cur, const snap_t *prev, double *cum)
{
    const hist_t *p = NULL;
    for (int i = 0; prev && i < prev->ncalls; i++)
        if (!strcmp(prev->call[i].name, cur->name) && prev->call[i].nb == cur->nb)
            p = &prev->call[i];
    for (int k = 0; k < cur->nb; k++)
        cum[k] = cur->cum[k] - (p ? p->cum[k] : 0);
    return cur->nb;
}

/* ---- drawing ------------------------------------------------------------------------------ */

static const char *fmt_bytes(double b, char *buf, size_t len)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    int u = 0;
    while (b >= 1024 && u < 5) {
        b /= 1024;
        u++;
    }
    snprintf(buf, len, u ? "%.1f %s" : "%.0f %s", b, units[u]);
    return buf;
}

static const char *fmt_lat(double s, char *buf, size_t len)
{
    if (isnan(s))
        snprintf(buf, len, "-");
    else if (s < 1e-3)
        snprintf(buf, len, "%.1f us", s * 1e6);
    else if (s < 1)
        snprintf(buf, len, "%.2f ms", s * 1e3);
    else
        snprintf(buf, len, "%.2f s", s);
    return buf;
}

/* A copy of s safe for a terminal: control characters become '?' (kvpoolctl_top.h). */
const char *kvp_ctl_safe(const char *s, char *buf, size_t len)
{
    size_t i = 0;
    for (; s[i] && i + 1 < len; i++)
        buf[i] = ((unsigned char)s[i] < 0x20 || s[i] == 0x7f) ? '?' : s[i];
    buf[i] = '\0';
    return buf;
}

static double rate(double cur, double prev, double dt, int have_prev)
{
    return have_prev && dt > 0 && cur >= prev ? (cur - prev) / dt : NAN;
}

/* The prefix cache's hit rate: hit / query tokens of the interval (since start without prev);
 * NaN when nothing was looked up. *interval says which. */
static double cache_hit_rate(const snap_t *cur, const snap_t *prev, int *interval)
{
    double q = cur->cache_query, h = cur->cache_hit;
    *interval = prev && prev->has_cache && q >= prev->cache_query && h >= prev->cache_hit;
    if (*interval) {
        q -= prev->cache_query;
        h -= prev->cache_hit;
    }
    return q > 0 ? h / q : NAN;
}

static int by_tokens(const void *a, const void *b)
{
    const double x = ((const double *)a)[0], y = ((const double *)b)[0];
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Indices of the namespaces sorted by tokens, largest first; returns how many. */
static int top_namespaces(const snap_t *sn, int *idx, int max)
{
    double keyed[MAX_NS][2];
    for (int i = 0; i < sn->nns; i++) {
        keyed[i][0] = sn->ns[i].tokens;
        keyed[i][1] = i;
    }
    qsort(keyed, (size_t)sn->nns, sizeof(keyed[0]), by_tokens);
    int n = sn->nns < max ? sn->nns : max;
    for (int i = 0; i < n; i++)
        idx[i] = (int)keyed[i][1];
    return n;
}

static void draw_screen(const kvp_top_opts_t *o, const snap_t *cur, const snap_t *prev)
{
    int cols = term_cols(), have = prev != NULL;
    double dt = have ? cur->t - prev->t : 0;
    char b1[64], b2[64], b3[64], b4[160];
    printf("\033[H\033[2J");
    printf("\033[1mkvpool top\033[0m  %s  v%s %s  up %.0fs  clients %.0f  %s   (q to quit)\n",
           o->socket_path, cur->version, cur->backend, cur->uptime, cur->clients,
           cur->up > 0 ? "healthy" : "\033[31mUNHEALTHY\033[0m");
    if (cur->has_cache) {
        int iv;
        double hr = cache_hit_rate(cur, prev, &iv);
        if (isnan(hr))
            snprintf(b1, sizeof(b1), "-");
        else
            snprintf(b1, sizeof(b1), "%.1f%%", 100 * hr);
        printf("prefix cache  cached %.0f pages   pinned %.0f   hit rate %s (%s)\n",
               cur->cache_cached, cur->cache_pinned, b1, iv ? "this interval" : "since start");
    }
    putchar('\n');
    int bar = cols - 60;
    if (bar < 10)
        bar = 10;
    printf("%-6s %-*s %7s %15s %23s\n", "DEVICE", bar + 2, "USED", "%", "PAGES", "BYTES");
    for (int d = 0; d < cur->ndev; d++) {
        double cap = cur->dev[d][0], used = cur->dev[d][1];
        double frac = cap > 0 ? used / cap : 0;
        int fill = (int)(frac * bar + 0.5);
        printf("%-6d [", cur->dev_id[d]);
        for (int i = 0; i < bar; i++)
            putchar(i < fill ? '#' : '.');
        char pages[40];
        snprintf(pages, sizeof(pages), "%.0f/%.0f", used, cap);
        printf("] %6.1f%% %15s %11s / %-11s\n", frac * 100, pages,
               fmt_bytes(used * cur->page_bytes, b1, sizeof(b1)),
               fmt_bytes(cap * cur->page_bytes, b2, sizeof(b2)));
    }
    printf("       shared pages %.0f   sequences %.0f   tokens %.0f\n\n",
           cur->ndev ? cur->dev[0][3] : 0, cur->live_seqs, cur->live_tokens);
    double rq = rate(cur->requests, have ? prev->requests : 0, dt, have);
    double er = rate(cur->errors, have ? prev->errors : 0, dt, have);
    double ab = rate(cur->append_bytes, have ? prev->append_bytes : 0, dt, have);
    double pa = rate(cur->page_allocs, have ? prev->page_allocs : 0, dt, have);
    printf("requests %s/s   errors %s/s   appended %s/s   page allocations %s/s\n",
           isnan(rq) ? "-" : (snprintf(b1, sizeof(b1), "%.1f", rq), b1),
           isnan(er) ? "-" : (snprintf(b2, sizeof(b2), "%.1f", er), b2),
           isnan(ab) ? "-" : fmt_bytes(ab, b3, sizeof(b3)),
           isnan(pa) ? "-" : (snprintf(b4, sizeof(b4), "%.1f", pa), b4));
    printf("allocation failures %.0f   evicted sequences %.0f\n\n", cur->alloc_fail, cur->evicted);
    printf("%-18s %10s %10s %10s %10s   (%s)\n", "CALL", "REQ/S", "P50", "P90", "P99",
           have ? "this interval" : "since start");
    for (int i = 0; i < cur->ncalls; i++) {
        double cum[MAX_BUCKETS];
        int nb = interval_hist(&cur->call[i], prev, cum);
        if (nb < 2 || cum[nb - 1] <= 0)
            continue;
        char r[32], p50[32], p90[32], p99[32];
        if (have)
            snprintf(r, sizeof(r), "%.1f", cum[nb - 1] / dt);
        else
            snprintf(r, sizeof(r), "-");
        printf("%-18s %10s %10s %10s %10s\n", cur->call[i].name, r,
               fmt_lat(kvp_prom_quantile(0.5, cur->call[i].le, cum, nb), p50, sizeof(p50)),
               fmt_lat(kvp_prom_quantile(0.9, cur->call[i].le, cum, nb), p90, sizeof(p90)),
               fmt_lat(kvp_prom_quantile(0.99, cur->call[i].le, cum, nb), p99, sizeof(p99)));
    }
    int idx[TOP_NS_SHOWN];
    int n = top_namespaces(cur, idx, TOP_NS_SHOWN);
    printf("\n%-32s %10s %12s\n", "NAMESPACE", "SEQS", "TOKENS");
    for (int i = 0; i < n; i++)
        printf("%-32.32s %10.0f %12.0f\n", kvp_ctl_safe(cur->ns[idx[i]].name, b4, sizeof(b4)),
               cur->ns[idx[i]].seqs, cur->ns[idx[i]].tokens);
    if (cur->nns > n)
        printf("(%d more)\n", cur->nns - n);
    fflush(stdout);
}

/* One line per refresh for pipes and logs: key=value, rates "-" on the first line. */
static void draw_line(const kvp_top_opts_t *o, const snap_t *cur, const snap_t *prev)
{
    int have = prev != NULL;
    double dt = have ? cur->t - prev->t : 0;
    double used = 0, cap = 0;
    for (int d = 0; d < cur->ndev; d++) {
        used += cur->dev[d][1];
        cap += cur->dev[d][0];
    }
    /* latency over every call of the interval: the histograms summed bucket by bucket */
    double le[MAX_BUCKETS], all[MAX_BUCKETS] = {0};
    int nb = 0;
    for (int i = 0; i < cur->ncalls; i++) {
        double cum[MAX_BUCKETS];
        int n = interval_hist(&cur->call[i], prev, cum);
        if (nb == 0) {
            nb = n;
            memcpy(le, cur->call[i].le, sizeof(double) * (size_t)n);
        }
        for (int k = 0; k < n && n == nb; k++)
            all[k] += cum[k];
    }
    char ts[32];
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(ts, sizeof(ts), "%Y-%m-%dT%H:%M:%SZ", &tm);
    printf("time=%s up=%.0f clients=%.0f devices=%d pages_used=%.0f pages_capacity=%.0f "
           "sequences=%.0f tokens=%.0f namespaces=%d",
           ts, cur->up, cur->clients, cur->ndev, used, cap, cur->live_seqs, cur->live_tokens,
           cur->nns);
    double r[4] = {rate(cur->requests, have ? prev->requests : 0, dt, have),
                   rate(cur->errors, have ? prev->errors : 0, dt, have),
                   rate(cur->append_bytes, have ? prev->append_bytes : 0, dt, have),
                   rate(cur->page_allocs, have ? prev->page_allocs : 0, dt, have)};
    const char *rn[4] = {"requests_per_s", "errors_per_s", "append_bytes_per_s",
                         "page_allocations_per_s"};
    for (int i = 0; i < 4; i++) {
        if (isnan(r[i]))
            printf(" %s=-", rn[i]);
        else
            printf(" %s=%.1f", rn[i], r[i]);
    }
    const double qs[3] = {0.5, 0.9, 0.99};
    const char *qn[3] = {"p50_us", "p90_us", "p99_us"};
    for (int i = 0; i < 3; i++) {
        double v = nb ? kvp_prom_quantile(qs[i], le, all, nb) : NAN;
        if (isnan(v))
            printf(" %s=-", qn[i]);
        else
            printf(" %s=%.1f", qn[i], v * 1e6);
    }
    printf(" allocation_failures=%.0f evicted_sequences=%.0f", cur->alloc_fail, cur->evicted);
    /* the prefix cache: "-" from a daemon without one; the hit rate over the interval (since
     * start on the first line), "-" when nothing was looked up */
    if (cur->has_cache) {
        int iv;
        double hr = cache_hit_rate(cur, prev, &iv);
        printf(" cache_cached_pages=%.0f cache_pinned_pages=%.0f", cur->cache_cached,
               cur->cache_pinned);
        if (isnan(hr))
            printf(" cache_hit_rate=-");
        else
            printf(" cache_hit_rate=%.4f", hr);
    } else {
        printf(" cache_cached_pages=- cache_pinned_pages=- cache_hit_rate=-");
    }
    if (o->ns) { /* -n NS: its figures last (0 while it holds no sequence) */
        char b[160];
        printf(" namespace=%s namespace_sequences=%.0f namespace_tokens=%.0f",
               kvp_ctl_safe(o->ns, b, sizeof(b)), cur->nns ? cur->ns[0].seqs : 0,
               cur->nns ? cur->ns[0].tokens : 0);
    }
    putchar('\n');
    fflush(stdout);
}

/* ---- the loop ------------------------------------------------------------------------------ */

/* Waits up to ms for a key or a signal. Returns 1 to quit. */
static int wait_key(int ms, int interactive)
{
    double end = now_s() + ms / 1000.0;
    for (;;) {
        if (stop_signal)
            return 1;
        if (resized)
            return 0;
        double left = end - now_s();
        if (left <= 0)
            return 0;
        struct pollfd p = {.fd = STDIN_FILENO, .events = POLLIN};
        int n = poll(&p, interactive ? 1 : 0, (int)(left * 1000) + 1);
        if (n < 0 && errno != EINTR)
            return 0;
        if (n > 0) {
            if (p.revents & (POLLHUP | POLLERR | POLLNVAL))
                return 1;
            char ch;
            ssize_t r = read(STDIN_FILENO, &ch, 1);
            if (r == 0)
                return 1; /* end of input */
            if (r == 1 && (ch == 'q' || ch == 'Q' || ch == 3))
                return 1;
        }
    }
}

int kvp_ctl_top(kvp_client_t *c, const kvp_top_opts_t *o)
{
    int tty = isatty(STDOUT_FILENO);
    int interactive = tty && isatty(STDIN_FILENO);
    char *text = malloc(METRICS_BYTES);
    snap_t *snaps = calloc(2, sizeof(snap_t));
    int code = 0;
    if (!text || !snaps) {
        fputs("kvpoolctl: top: out of memory\n", stderr);
        code = 1;
        goto out;
    }
    struct sigaction sa = {.sa_handler = on_stop};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    struct sigaction sw = {.sa_handler = on_winch};
    sigemptyset(&sw.sa_mask);
    sigaction(SIGWINCH, &sw, NULL);
    if (tty)
        term_enter();

    snap_t *cur = &snaps[0], *prev = NULL;
    for (uint32_t n = 0; !stop_signal && (o->count == 0 || n < o->count); n++) {
        size_t len = 0;
        int rc = kvp_client_metrics(c, text, METRICS_BYTES, &len);
        if (rc) {
            term_restore();
            fprintf(stderr, "kvpoolctl: top: %s\n",
                    kvp_client_last_error(c)[0] ? kvp_client_last_error(c) : kvp_strerror(rc));
            code = (rc == KVP_ECLOSED || rc == KVP_ETIMEDOUT || (rc < 0 && rc > -1000)) ? 3 : 1;
            goto out;
        }
        parse_snapshot(text, len, o->ns, cur);
        if (tty)
            draw_screen(o, cur, prev);
        else
            draw_line(o, cur, prev);
        prev = cur;
        cur = cur == &snaps[0] ? &snaps[1] : &snaps[0];
        if (o->count && n + 1 == o->count)
            break;
        resized = 0;
        int quit;
        for (;;) {
            quit = wait_key((int)o->interval_ms, interactive);
            if (quit || !resized)
                break;
            resized = 0;
            draw_screen(o, prev, NULL); /* redraw at the new size; rates come next time */
        }
        if (quit)
            break;
    }
out:
    term_restore();
    free(text);
    free(snaps);
    return code;
}
