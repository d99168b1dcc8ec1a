/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_jobs.c - the daemon's worker threads (server/kvp_jobs.c): every item runs once on a
 * pool thread and completes once on the loop thread, with and without busy polling, under
 * many threads; close waits for the items in flight; bad arguments are refused.
 */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <uv.h>

#include "kvp_error.h"
#include "kvp_jobs.h"

typedef struct {
    kvp_job_item_t item;
    atomic_int runs;
    int dones;
    pthread_t ran_on;
    int sleep_ms;
} item_t;

typedef struct {
    pthread_t loop_thread;
    int done_total, done_off_loop, closed;
    int resubmit; /* submit each item again from done() this many times in all */
    kvp_jobs_t *jobs;
} world_t;

static world_t W;

static void run_cb(kvp_job_item_t *it)
{
    item_t *x = (item_t *)it;
    atomic_fetch_add(&x->runs, 1);
    x->ran_on = pthread_self();
    if (x->sleep_ms) {
        struct timespec ts = {0, (long)x->sleep_ms * 1000000L};
        nanosleep(&ts, NULL);
    }
}

static void done_cb(kvp_job_item_t *it)
{
    item_t *x = (item_t *)it;
    x->dones++;
    W.done_total++;
    if (!pthread_equal(pthread_self(), W.loop_thread))
        W.done_off_loop++;
    if (W.resubmit > 0) {
        W.resubmit--;
        kvp_jobs_submit(W.jobs, it); /* done() may submit again */
    }
}

static void on_closed(void *arg)
{
    (void)arg;
    W.closed++;
}

static void run_items(unsigned threads, uint32_t busy_us, int n, int resubmit)
{
    uv_loop_t loop;
    ck_assert_int_eq(uv_loop_init(&loop), 0);
    memset(&W, 0, sizeof(W));
    W.loop_thread = pthread_self();
    W.resubmit = resubmit;
    ck_assert_int_eq(kvp_jobs_create(&loop, threads, busy_us, &W.jobs), 0);
    item_t *items = calloc((size_t)n, sizeof(item_t));
    for (int i = 0; i < n; i++) {
        items[i].item.run = run_cb;
        items[i].item.done = done_cb;
        kvp_jobs_submit(W.jobs, &items[i].item);
    }
    ck_assert_uint_eq(kvp_jobs_in_flight(W.jobs), (unsigned)n);
    while (W.done_total < n + resubmit)
        uv_run(&loop, UV_RUN_ONCE);
    ck_assert_uint_eq(kvp_jobs_in_flight(W.jobs), 0);
    kvp_jobs_close(W.jobs, on_closed, NULL);
    ck_assert_int_eq(uv_run(&loop, UV_RUN_DEFAULT), 0);
    ck_assert_int_eq(W.closed, 1);
    ck_assert_int_eq(W.done_off_loop, 0);
    int runs = 0, dones = 0;
    for (int i = 0; i < n; i++) {
        runs += atomic_load(&items[i].runs);
        dones += items[i].dones;
        ck_assert_int_eq(atomic_load(&items[i].runs), items[i].dones);
        ck_assert(!pthread_equal(items[i].ran_on, W.loop_thread));
    }
    ck_assert_int_eq(runs, n + resubmit);
    ck_assert_int_eq(dones, n + resubmit);
    free(items);
    ck_assert_int_eq(uv_loop_close(&loop), 0);
}

START_TEST(every_item_runs_once_and_completes_on_the_loop)
{
    run_items(4, 0, 2000, 0);
}
END_TEST

START_TEST(busy_polling_runs_every_item_too)
{
    run_items(4, 200, 2000, 0);
    run_items(1, 1000, 500, 0);
}
END_TEST

START_TEST(done_may_submit_again)
{
    run_items(2, 0, 10, 300);
    run_items(2, 100, 10, 300);
}
END_TEST

START_TEST(close_waits_for_items_in_flight)
{
    uv_loop_t loop;
    ck_assert_int_eq(uv_loop_init(&loop), 0);
    memset(&W, 0, sizeof(W));
    W.loop_thread = pthread_self();
    ck_assert_int_eq(kvp_jobs_create(&loop, 2, 50, &W.jobs), 0);
    item_t items[3];
    memset(items, 0, sizeof(items));
    for (int i = 0; i < 3; i++) {
        items[i].item.run = run_cb;
        items[i].item.done = done_cb;
        items[i].sleep_ms = 30;
        kvp_jobs_submit(W.jobs, &items[i].item);
    }
    kvp_jobs_close(W.jobs, on_closed, NULL);
    kvp_jobs_close(W.jobs, on_closed, NULL); /* a second close is a no-op */
    ck_assert_int_eq(W.closed, 0);
    ck_assert_int_eq(uv_run(&loop, UV_RUN_DEFAULT), 0);
    ck_assert_int_eq(W.done_total, 3);
    ck_assert_int_eq(W.closed, 1);
    ck_assert_int_eq(uv_loop_close(&loop), 0);
}
END_TEST

START_TEST(bad_arguments_are_refused)
{
    uv_loop_t loop;
    kvp_jobs_t *j = (kvp_jobs_t *)&loop; /* must stay untouched */
    ck_assert_int_eq(uv_loop_init(&loop), 0);
    ck_assert_int_eq(kvp_jobs_create(NULL, 1, 0, &j), KVP_EINVAL);
    ck_assert_int_eq(kvp_jobs_create(&loop, 0, 0, &j), KVP_EINVAL);
    ck_assert_int_eq(kvp_jobs_create(&loop, 257, 0, &j), KVP_EINVAL);
    ck_assert_int_eq(kvp_jobs_create(&loop, 1, 1000001, &j), KVP_EINVAL);
    ck_assert_int_eq(kvp_jobs_create(&loop, 1, 0, NULL), KVP_EINVAL);
    ck_assert_ptr_eq(j, (kvp_jobs_t *)&loop);
    kvp_jobs_close(NULL, on_closed, NULL);
    ck_assert_int_eq(uv_loop_close(&loop), 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("jobs");
    TCase *tc = tcase_create("jobs");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, every_item_runs_once_and_completes_on_the_loop);
    tcase_add_test(tc, busy_polling_runs_every_item_too);
    tcase_add_test(tc, done_may_submit_again);
    tcase_add_test(tc, close_waits_for_items_in_flight);
    tcase_add_test(tc, bad_arguments_are_refused);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
