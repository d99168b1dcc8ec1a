/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_log.c - the logger: level filtering, the journal's "<N>" prefix when $JOURNAL_STREAM
 * names the output, the RFC 3339 UTC timestamp of plain lines (checked against gmtime_r),
 * truncation of an over-long message, one line per call even from many threads, level names.
 * Output goes to a pipe or a temporary file through kvp_log_set_fd.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvp_error.h"
#include "kvp_log.h"
#include "kvp_test_util.h"

static int pipe_fds[2];
static char out[64 * 1024];

/* Logs into a fresh non-blocking pipe in plain style at level `level`. */
static void capture(int level)
{
    ck_assert_int_eq(pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK), 0);
    unsetenv("JOURNAL_STREAM");
    kvp_log_set_fd(pipe_fds[1]);
    kvp_log_init();
    kvp_log_set_level(level);
}

/* Everything written so far, NUL-terminated in out. */
static const char *captured(void)
{
    size_t n = 0;
    ssize_t r;
    while (n < sizeof(out) - 1 && (r = read(pipe_fds[0], out + n, sizeof(out) - 1 - n)) > 0)
        n += (size_t)r;
    out[n] = '\0';
    return out;
}

static void release(void)
{
    kvp_log_set_fd(2);
    close(pipe_fds[0]);
    close(pipe_fds[1]);
}

/* Strips the plain-style timestamp ("...Z ") of each line, keeping "level message\n". */
static const char *without_timestamps(const char *s)
{
    static char buf[sizeof(out)];
    size_t n = 0;
    while (*s) {
        const char *eol = strchr(s, '\n');
        ck_assert_ptr_nonnull(eol);
        ck_assert_msg(eol - s > 25 && s[23] == 'Z' && s[24] == ' ', "no timestamp: %.*s",
                      (int)(eol - s), s);
        memcpy(buf + n, s + 25, (size_t)(eol - s - 24));
        n += (size_t)(eol - s - 24);
        s = eol + 1;
    }
    buf[n] = '\0';
    return buf;
}

START_TEST(level_filter_drops_less_severe_messages)
{
    capture(KVP_LOG_WARNING);
    kvp_log(KVP_LOG_DEBUG, "debug_event n=%d", 1);
    kvp_log(KVP_LOG_INFO, "info_event n=%d", 2);
    kvp_log(KVP_LOG_NOTICE, "notice_event n=%d", 3);
    kvp_log(KVP_LOG_WARNING, "pool_exhausted need_pages=%u free_pages=%u", 7u, 3u);
    kvp_log(KVP_LOG_ERR, "err_event n=%d", 5);
    kvp_log(KVP_LOG_EMERG, "emerg_event n=%d", 6);
    ck_assert_str_eq(without_timestamps(captured()),
                     "warning pool_exhausted need_pages=7 free_pages=3\n"
                     "err err_event n=5\n"
                     "emerg emerg_event n=6\n");
    ck_assert_int_eq(kvp_log_enabled(KVP_LOG_WARNING), 1);
    ck_assert_int_eq(kvp_log_enabled(KVP_LOG_NOTICE), 0);

    kvp_log_set_level(KVP_LOG_DEBUG);
    kvp_log(KVP_LOG_DEBUG, "now_visible");
    kvp_log(42, "above_debug_is_debug");
    ck_assert_str_eq(without_timestamps(captured()),
                     "debug now_visible\ndebug above_debug_is_debug\n");

    kvp_log_set_level(-3); /* clamped to emerg */
    ck_assert_int_eq(kvp_log_get_level(), KVP_LOG_EMERG);
    kvp_log(KVP_LOG_ALERT, "dropped");
    kvp_log(-1, "below_emerg_is_emerg");
    ck_assert_str_eq(without_timestamps(captured()), "emerg below_emerg_is_emerg\n");
    kvp_log_set_level(99);
    ck_assert_int_eq(kvp_log_get_level(), KVP_LOG_DEBUG);
    release();
}
END_TEST

START_TEST(plain_lines_start_with_an_rfc3339_utc_timestamp)
{
    capture(KVP_LOG_INFO);
    struct timespec before, after; /* time(2) reads a coarser clock than the logger */
    clock_gettime(CLOCK_REALTIME, &before);
    kvp_log(KVP_LOG_NOTICE, "started socket=%s", "/run/kvpool/kvpool.sock");
    clock_gettime(CLOCK_REALTIME, &after);
    const char *line = captured();

    regex_t re;
    ck_assert_int_eq(regcomp(&re,
                             "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z "
                             "notice started socket=/run/kvpool/kvpool\\.sock\n$",
                             REG_EXTENDED | REG_NOSUB),
                     0);
    ck_assert_msg(regexec(&re, line, 0, NULL, 0) == 0, "line '%s'", line);
    regfree(&re);

    /* the timestamp is now, in UTC */
    struct tm tm = {0};
    int ms = -1;
    ck_assert_int_eq(sscanf(line, "%4d-%2d-%2dT%2d:%2d:%2d.%3d", &tm.tm_year, &tm.tm_mon,
                            &tm.tm_mday, &tm.tm_hour, &tm.tm_min, &tm.tm_sec, &ms),
                     7);
    tm.tm_year -= 1900;
    tm.tm_mon -= 1;
    time_t t = timegm(&tm);
    ck_assert_msg(t >= before.tv_sec && t <= after.tv_sec, "timestamp %lld not in [%lld, %lld]",
                  (long long)t, (long long)before.tv_sec, (long long)after.tv_sec);
    ck_assert_int_ge(ms, 0);
    ck_assert_int_le(ms, 999);
    release();
}
END_TEST

START_TEST(timestamp_arithmetic_matches_gmtime)
{
    char ts[25];
    ck_assert_uint_eq(kvp__log_timestamp(ts, 0), 24);
    ck_assert_str_eq(ts, "1970-01-01T00:00:00.000Z");
    struct tm tm = {.tm_year = 2026 - 1900,
                    .tm_mon = 10,
                    .tm_mday = 30,
                    .tm_hour = 1,
                    .tm_min = 2,
                    .tm_sec = 3};
    kvp__log_timestamp(ts, (int64_t)timegm(&tm) * 1000 + 456);
    ck_assert_str_eq(ts, "2026-11-30T01:02:03.456Z");
    kvp__log_timestamp(ts, 951782400000ll + 86399999); /* leap day of a year % 400 == 0 */
    ck_assert_str_eq(ts, "2000-02-29T23:59:59.999Z");
    kvp__log_timestamp(ts, 4107542400000ll); /* 2100 is not a leap year */
    ck_assert_str_eq(ts, "2100-03-01T00:00:00.000Z");

    kvp_rng_t rng;
    uint64_t seed = kvp_test_seed(20261130);
    kvp_rng_seed(&rng, seed);
    for (int i = 0; i < 20000; i++) {
        int64_t ms = (int64_t)(kvp_rng_next(&rng) % (253402300799999ull + 1)); /* to 9999 */
        time_t secs = (time_t)(ms / 1000);
        char want[40];
        struct tm g;
        gmtime_r(&secs, &g);
        size_t n = strftime(want, sizeof(want), "%Y-%m-%dT%H:%M:%S", &g);
        snprintf(want + n, sizeof(want) - n, ".%03dZ", (int)(ms % 1000));
        kvp__log_timestamp(ts, ms);
        KVP_CHECK(strcmp(ts, want) == 0, "ms=%lld: got %s, want %s (seed %llu)", (long long)ms, ts,
                  want, (unsigned long long)seed);
    }
}
END_TEST

START_TEST(journal_stream_gets_priority_prefix_and_no_timestamp)
{
    capture(KVP_LOG_DEBUG);
    struct stat st;
    ck_assert_int_eq(fstat(pipe_fds[1], &st), 0);
    char env[64];
    snprintf(env, sizeof(env), "%ju:%ju", (uintmax_t)st.st_dev, (uintmax_t)st.st_ino);
    setenv("JOURNAL_STREAM", env, 1);
    kvp_log_init();
    kvp_log(KVP_LOG_WARNING, "pool_exhausted need_pages=%u", 9u);
    kvp_log(KVP_LOG_DEBUG, "detail x=1");
    kvp_log(KVP_LOG_EMERG, "gone");
    ck_assert_str_eq(captured(), "<4>pool_exhausted need_pages=9\n<7>detail x=1\n<0>gone\n");

    /* another file's dev:ino, a malformed value, or none: plain style */
    const char *others[] = {"1:2", "", "12", ":5", "5:", "5:6x", "x5:6"};
    for (size_t i = 0; i < sizeof(others) / sizeof(others[0]); i++) {
        setenv("JOURNAL_STREAM", others[i], 1);
        kvp_log_init();
        kvp_log(KVP_LOG_INFO, "plain");
        ck_assert_str_eq(without_timestamps(captured()), "info plain\n");
    }
    snprintf(env, sizeof(env), "%ju:%ju", (uintmax_t)st.st_dev, (uintmax_t)st.st_ino + 1);
    setenv("JOURNAL_STREAM", env, 1);
    kvp_log_init();
    kvp_log(KVP_LOG_INFO, "plain");
    ck_assert_str_eq(without_timestamps(captured()), "info plain\n");
    unsetenv("JOURNAL_STREAM");
    kvp_log_init();
    kvp_log(KVP_LOG_INFO, "plain");
    ck_assert_str_eq(without_timestamps(captured()), "info plain\n");
    release();
}
END_TEST

START_TEST(overlong_message_is_truncated_with_an_ellipsis)
{
    static char big[5000];
    memset(big, 'a', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';

    capture(KVP_LOG_INFO);
    kvp_log(KVP_LOG_ERR, "long v=%s", big);
    const char *line = captured();
    ck_assert_uint_eq(strlen(line), KVP_LOG_LINE_MAX);
    ck_assert_str_eq(line + KVP_LOG_LINE_MAX - 6, "aa...\n");
    ck_assert_int_eq(strncmp(without_timestamps(line), "err long v=aaa", 14), 0);
    ck_assert_ptr_eq(strchr(line, '\n'), line + KVP_LOG_LINE_MAX - 1);

    /* journal style: "<3>" + message, exactly 2048 bytes */
    struct stat st;
    char env[64];
    fstat(pipe_fds[1], &st);
    snprintf(env, sizeof(env), "%ju:%ju", (uintmax_t)st.st_dev, (uintmax_t)st.st_ino);
    setenv("JOURNAL_STREAM", env, 1);
    kvp_log_init();
    kvp_log(KVP_LOG_ERR, "%s", big);
    line = captured();
    ck_assert_uint_eq(strlen(line), KVP_LOG_LINE_MAX);
    ck_assert_int_eq(strncmp(line, "<3>aaaa", 7), 0);
    ck_assert_uint_eq(strspn(line + 3, "a"), KVP_LOG_LINE_MAX - 3 - 4);
    ck_assert_str_eq(line + KVP_LOG_LINE_MAX - 4, "...\n");

    /* the longest message that fits is not truncated */
    big[KVP_LOG_LINE_MAX - 3 - 1] = '\0';
    kvp_log(KVP_LOG_ERR, "%s", big);
    line = captured();
    ck_assert_uint_eq(strlen(line), KVP_LOG_LINE_MAX);
    ck_assert_str_eq(line + KVP_LOG_LINE_MAX - 3, "aa\n");
    release();
}
END_TEST

START_TEST(control_characters_cannot_forge_lines)
{
    capture(KVP_LOG_INFO);
    kvp_log(KVP_LOG_INFO, "hello client=%s", "evil\n<0>forged\r\tx\x7f");
    ck_assert_str_eq(without_timestamps(captured()), "info hello client=evil?<0>forged??x?\n");
    release();
}
END_TEST

START_TEST(errno_is_preserved_and_failed_writes_are_counted)
{
    kvp_log_set_fd(-1); /* write fails with EBADF */
    kvp_log_set_level(KVP_LOG_INFO);
    uint64_t before = kvp_log_dropped();
    errno = ENOSPC;
    kvp_log(KVP_LOG_ERR, "lost");
    ck_assert_int_eq(errno, ENOSPC);
    ck_assert_uint_eq(kvp_log_dropped(), before + 1);
    kvp_log(KVP_LOG_DEBUG, "filtered: not a drop");
    ck_assert_uint_eq(kvp_log_dropped(), before + 1);
    kvp_log_set_fd(2);
}
END_TEST

#define THREADS 8
#define LINES   2000

static void *log_lines(void *arg)
{
    int t = (int)(intptr_t)arg;
    char pad[600];
    memset(pad, 'a' + t, sizeof(pad) - 1);
    pad[sizeof(pad) - 1] = '\0';
    for (int i = 0; i < LINES; i++)
        kvp_log(KVP_LOG_INFO, "tick thread=%d i=%d pad=%s end", t, i, pad);
    return NULL;
}

START_TEST(lines_from_threads_never_interleave)
{
    char path[] = "/tmp/kvp-test-log-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    unlink(path);
    unsetenv("JOURNAL_STREAM");
    kvp_log_set_fd(fd);
    kvp_log_init();
    kvp_log_set_level(KVP_LOG_INFO);
    pthread_t th[THREADS];
    for (int t = 0; t < THREADS; t++)
        ck_assert_int_eq(pthread_create(&th[t], NULL, log_lines, (void *)(intptr_t)t), 0);
    for (int t = 0; t < THREADS; t++)
        pthread_join(th[t], NULL);
    kvp_log_set_fd(2);

    FILE *f = fdopen(fd, "r");
    ck_assert_ptr_nonnull(f);
    rewind(f);
    int next[THREADS] = {0}, lines = 0;
    static char line[4096];
    while (fgets(line, sizeof(line), f)) {
        int t = -1, i = -1, n = 0;
        KVP_CHECK(sscanf(line + 25, "info tick thread=%d i=%d pad=%n", &t, &i, &n) == 2 && n > 0,
                  "mangled line %d: %s", lines, line);
        KVP_CHECK(t >= 0 && t < THREADS && i == next[t], "line %d out of order: %s", lines, line);
        next[t]++;
        KVP_CHECK(strspn(line + 25 + n, (char[]){(char)('a' + t), 0}) == 599 &&
                      strcmp(line + 25 + n + 599, " end\n") == 0,
                  "torn line %d: %s", lines, line);
        lines++;
    }
    fclose(f);
    ck_assert_int_eq(lines, THREADS * LINES);
}
END_TEST

START_TEST(level_names_parse_and_print)
{
    static const struct {
        const char *name;
        int level;
    } cases[] = {{"emerg", 0}, {"alert", 1},   {"crit", 2},   {"err", 3},
                 {"error", 3}, {"warning", 4}, {"notice", 5}, {"info", 6},
                 {"debug", 7}, {"DEBUG", 7},   {"Warning", 4}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int level = -1;
        ck_assert_int_eq(kvp_log_level_parse(cases[i].name, &level), 0);
        ck_assert_int_eq(level, cases[i].level);
    }
    const char *bad[] = {"", "verbose", "warn", "info ", "7", "emergency"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int level = 42;
        ck_assert_int_eq(kvp_log_level_parse(bad[i], &level), KVP_EINVAL);
        ck_assert_int_eq(level, 42);
    }
    int level = 42;
    ck_assert_int_eq(kvp_log_level_parse(NULL, &level), KVP_EINVAL);
    ck_assert_int_eq(kvp_log_level_parse("info", NULL), KVP_EINVAL);
    for (int l = KVP_LOG_EMERG; l <= KVP_LOG_DEBUG; l++) {
        ck_assert_int_eq(kvp_log_level_parse(kvp_log_level_name(l), &level), 0);
        ck_assert_int_eq(level, l);
    }
    ck_assert_str_eq(kvp_log_level_name(KVP_LOG_ERR), "err");
    ck_assert_str_eq(kvp_log_level_name(8), "invalid");
    ck_assert_str_eq(kvp_log_level_name(-1), "invalid");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("log");
    TCase *tc = tcase_create("log");
    tcase_add_test(tc, level_filter_drops_less_severe_messages);
    tcase_add_test(tc, plain_lines_start_with_an_rfc3339_utc_timestamp);
    tcase_add_test(tc, timestamp_arithmetic_matches_gmtime);
    tcase_add_test(tc, journal_stream_gets_priority_prefix_and_no_timestamp);
    tcase_add_test(tc, overlong_message_is_truncated_with_an_ellipsis);
    tcase_add_test(tc, control_characters_cannot_forge_lines);
    tcase_add_test(tc, errno_is_preserved_and_failed_writes_are_counted);
    tcase_add_test(tc, lines_from_threads_never_interleave);
    tcase_add_test(tc, level_names_parse_and_print);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
