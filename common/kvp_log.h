/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_log.h - the one logger of kvpoold (STYLE.md rule 11): syslog levels, one line per event,
 * messages written as "event key=value key=value".
 *
 * There is one stderr per process, so the logger is process-wide by necessity: its state (level,
 * output fd, output style) lives in one static struct inside kvp_log.c, changed only through
 * the setters below. Each line is formatted in a fixed 2 KiB buffer on the caller's stack and
 * written with one write(2), so lines from different threads never interleave and logging never
 * allocates. It is not a metrics or audit channel: a line that cannot be written is dropped.
 */
#ifndef KVP_LOG_H
#define KVP_LOG_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* syslog(3) priorities; a message is written when its level <= the configured level. */
enum {
    KVP_LOG_EMERG = 0,
    KVP_LOG_ALERT = 1,
    KVP_LOG_CRIT = 2,
    KVP_LOG_ERR = 3,
    KVP_LOG_WARNING = 4,
    KVP_LOG_NOTICE = 5,
    KVP_LOG_INFO = 6,
    KVP_LOG_DEBUG = 7,
};

/* Bytes of one output line, prefix and '\n' included; longer messages end in "...\n". */
#define KVP_LOG_LINE_MAX 2048

/* Writes one line at `level` (clamped to 0..7) if the level passes the filter. The message is
 * printf-formatted; control characters in it (a '\n' from a client-supplied name, say) are
 * replaced by '?' so that one call is always exactly one line. Journal style: "<N>message\n";
 * plain style: "2026-11-30T01:02:03.456Z warning message\n" (UTC, milliseconds). errno is
 * preserved. Thread-safe; no allocation; any thread. */
void kvp_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Chooses the output style for the current output fd (2 unless kvp_log_set_fd changed it): the
 * journal style when $JOURNAL_STREAM ("<st_dev>:<st_ino>", decimal) names that fd's file, as
 * systemd sets it for a service whose stderr is the journal; the plain style otherwise. Call
 * once at start, before threads log (it may be called again; the style switch is atomic). */
void kvp_log_init(void);

/* Sets the filter: messages with level > `level` are dropped. Clamped to 0..7. Default
 * KVP_LOG_INFO. Thread-safe (e.g. a config reload on the loop thread). */
void kvp_log_set_level(int level);

/* The current filter level. Thread-safe. */
int kvp_log_get_level(void);

/* Whether a message at `level` would be written: lets a caller skip costly argument
 * preparation. Thread-safe. */
int kvp_log_enabled(int level);

/* Parses "emerg", "alert", "crit", "err" or "error", "warning", "notice", "info", "debug"
 * (case-insensitive) into *out. Returns 0, or KVP_EINVAL (NULL or unknown name; *out
 * unchanged). */
int kvp_log_level_parse(const char *s, int *out);

/* The canonical name of a level ("err", "warning", ...); "invalid" outside 0..7. Static. */
const char *kvp_log_level_name(int level);

/* Test hook and daemon option: write lines to `fd` instead of 2. The fd stays owned by the
 * caller and must stay open while anything may log. Does not change the output style: call
 * kvp_log_init afterwards to re-detect it for the new fd. */
void kvp_log_set_fd(int fd);

/* Lines dropped because write(2) failed (a full non-blocking pipe, a closed stderr). */
uint64_t kvp_log_dropped(void);

/* Internal, exposed for the unit test: writes the RFC 3339 UTC timestamp of `unix_ms`
 * (milliseconds since the epoch, >= 0) as "YYYY-MM-DDTHH:MM:SS.mmmZ" plus a NUL into out[25].
 * Returns 24, the length. Pure arithmetic: no locale, no time zone, no lock. */
size_t kvp__log_timestamp(char out[25], int64_t unix_ms);

#ifdef __cplusplus
}
#endif
#endif
