/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_log.c - the process-wide logger: a level filter, an output fd and an output style, kept in
 * one static struct of atomics (STYLE.md rule 9 allows this one: there is one stderr).
 *
 * A line is built on the stack (prefix, message, '\n') and handed to one write(2). For a pipe
 * a write of at most PIPE_BUF (4096) bytes is atomic, and the journal's stream socket takes a
 * 2 KiB write whole, so concurrent lines never interleave without a lock. The timestamp is
 * computed from CLOCK_REALTIME with integer arithmetic instead of gmtime_r, which may take a
 * lock and allocate on its first call (time zone initialisation).
 */
#include "kvp_log.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvp_error.h"

static struct {
    atomic_int level;
    atomic_int fd;
    atomic_int journal; /* 1: "<N>" prefix, no timestamp */
    atomic_uint_fast64_t dropped;
} state = {KVP_LOG_INFO, 2, 0, 0};

static const char *const level_names[] = {"emerg",   "alert",  "crit", "err",
                                          "warning", "notice", "info", "debug"};

static int clamp_level(int level)
{
    return level < KVP_LOG_EMERG ? KVP_LOG_EMERG : level > KVP_LOG_DEBUG ? KVP_LOG_DEBUG : level;
}

const char *kvp_log_level_name(int level)
{
    return level >= KVP_LOG_EMERG && level <= KVP_LOG_DEBUG ? level_names[level] : "invalid";
}

int kvp_log_level_parse(const char *s, int *out)
{
    if (!s || !out)
        return KVP_EINVAL;
    if (strcasecmp(s, "error") == 0) {
        *out = KVP_LOG_ERR;
        return 0;
    }
    for (int i = KVP_LOG_EMERG; i <= KVP_LOG_DEBUG; i++)
        if (strcasecmp(s, level_names[i]) == 0) {
            *out = i;
            return 0;
        }
    return KVP_EINVAL;
}

void kvp_log_set_level(int level)
{
    atomic_store_explicit(&state.level, clamp_level(level), memory_order_relaxed);
}

int kvp_log_get_level(void)
{
    return atomic_load_explicit(&state.level, memory_order_relaxed);
}

int kvp_log_enabled(int level)
{
    return clamp_level(level) <= atomic_load_explicit(&state.level, memory_order_relaxed);
}

void kvp_log_set_fd(int fd)
{
    atomic_store_explicit(&state.fd, fd, memory_order_relaxed);
}

uint64_t kvp_log_dropped(void)
{
    return atomic_load_explicit(&state.dropped, memory_order_relaxed);
}

/* Parses "<dev>:<ino>" (decimal, as systemd writes it) strictly. */
static int parse_journal_stream(const char *s, uintmax_t *dev, uintmax_t *ino)
{
    char *end;
    if (!s || *s < '0' || *s > '9')
        return -1;
    errno = 0;
    *dev = strtoumax(s, &end, 10);
    if (errno || *end != ':' || end[1] < '0' || end[1] > '9')
        return -1;
    *ino = strtoumax(end + 1, &end, 10);
    if (errno || *end)
        return -1;
    return 0;
}

void kvp_log_init(void)
{
    int journal = 0;
    uintmax_t dev, ino;
    struct stat st;
    if (parse_journal_stream(getenv("JOURNAL_STREAM"), &dev, &ino) == 0 &&
        fstat(atomic_load_explicit(&state.fd, memory_order_relaxed), &st) == 0 &&
        (uintmax_t)st.st_dev == dev && (uintmax_t)st.st_ino == ino)
        journal = 1;
    atomic_store_explicit(&state.journal, journal, memory_order_relaxed);
}

static void put_digits(char *p, unsigned v, int width)
{
    for (int i = width - 1; i >= 0; i--, v /= 10)
        p[i] = (char)('0' + v % 10);
}

size_t kvp__log_timestamp(char out[25], int64_t unix_ms)
{
    if (unix_ms < 0)
        unix_ms = 0;
    int64_t secs = unix_ms / 1000, days = secs / 86400;
    unsigned ms = (unsigned)(unix_ms % 1000), sod = (unsigned)(secs % 86400);
    /* days since 1970-01-01 to a proleptic Gregorian date (H. Hinnant, "civil_from_days") */
    int64_t z = days + 719468;
    int64_t era = z / 146097; /* z >= 0 */
    unsigned doe = (unsigned)(z - era * 146097);
    unsigned yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    unsigned doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    unsigned mp = (5 * doy + 2) / 153;
    unsigned day = doy - (153 * mp + 2) / 5 + 1;
    unsigned month = mp < 10 ? mp + 3 : mp - 9;
    unsigned year = (unsigned)(yoe + era * 400) + (month <= 2);

    put_digits(out, year % 10000, 4);
    out[4] = '-';
    put_digits(out + 5, month, 2);
    out[7] = '-';
    put_digits(out + 8, day, 2);
    out[10] = 'T';
    put_digits(out + 11, sod / 3600, 2);
    out[13] = ':';
    put_digits(out + 14, sod / 60 % 60, 2);
    out[16] = ':';
    put_digits(out + 17, sod % 60, 2);
    out[19] = '.';
    put_digits(out + 20, ms, 3);
    out[23] = 'Z';
    out[24] = '\0';
    return 24;
}

/* Writes the line prefix into line and returns its length (< 40). */
static size_t format_prefix(char *line, int level)
{
    if (atomic_load_explicit(&state.journal, memory_order_relaxed)) {
        line[0] = '<';
        line[1] = (char)('0' + level);
        line[2] = '>';
        return 3;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    size_t n = kvp__log_timestamp(line, (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000);
    line[n++] = ' ';
    size_t name_len = strlen(level_names[level]);
    memcpy(line + n, level_names[level], name_len);
    n += name_len;
    line[n++] = ' ';
    return n;
}

void kvp_log(int level, const char *fmt, ...)
{
    level = clamp_level(level);
    if (level > atomic_load_explicit(&state.level, memory_order_relaxed))
        return;
    int saved_errno = errno;
    char line[KVP_LOG_LINE_MAX];
    size_t n = format_prefix(line, level);

    /* vsnprintf may use line[n .. KVP_LOG_LINE_MAX - 1]; its NUL slot becomes the '\n'. */
    size_t room = sizeof(line) - n;
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, room, fmt, ap);
    va_end(ap);
    size_t len;
    if (m < 0) {
        static const char bad[] = "log_format_error";
        memcpy(line + n, bad, sizeof(bad) - 1);
        len = n + sizeof(bad) - 1;
    } else if ((size_t)m >= room) {
        len = sizeof(line) - 1;
        memcpy(line + len - 3, "...", 3);
    } else {
        len = n + (size_t)m;
    }
    for (size_t i = n; i < len; i++)
        if ((unsigned char)line[i] < 0x20 || line[i] == 0x7f)
            line[i] = '?';
    line[len++] = '\n';

    int fd = atomic_load_explicit(&state.fd, memory_order_relaxed);
    const char *p = line;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            atomic_fetch_add_explicit(&state.dropped, 1, memory_order_relaxed);
            break;
        }
        p += w;
        len -= (size_t)w;
    }
    errno = saved_errno;
}
