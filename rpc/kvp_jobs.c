/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_jobs.c - worker threads with optional busy polling (see kvp_jobs.h for why). One FIFO
 * under a mutex feeds the threads; finished items go on a done list that the loop drains from
 * a uv_async_t (a sleeping loop) or a uv_idle_t (a polling loop: while an idle handle is active
 * libuv polls with a zero timeout). Spinning threads watch an atomic count, never the mutex.
 */
#include "kvp_jobs.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "kvp_error.h"

struct kvp_jobs {
    uv_loop_t *loop;
    uv_async_t async;
    uv_idle_t idle;
    int idle_on;
    uint64_t busy_ns;
    uint64_t last_activity_ns; /* loop thread: last submit, done or touch */
    uint32_t in_flight;        /* loop thread */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    kvp_job_item_t *head, *tail;           /* queued (lock) */
    kvp_job_item_t *done_head, *done_tail; /* finished (lock) */
    atomic_uint queued;
    atomic_uint spinning; /* threads busy polling: a submit need not wake anyone */
    atomic_int stop;
    unsigned nthreads;
    pthread_t *threads;
    int closing, handles_open;
    void (*closed)(void *);
    void *closed_arg;
};

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void *thread_main(void *arg)
{
    kvp_jobs_t *j = arg;
    uint64_t last_end = 0;
    for (;;) {
        if (j->busy_ns && last_end) {
            /* the next item of a steady stream usually comes within the window */
            const uint64_t until = last_end + j->busy_ns;
            atomic_fetch_add(&j->spinning, 1);
            while (!atomic_load_explicit(&j->queued, memory_order_acquire) &&
                   !atomic_load_explicit(&j->stop, memory_order_relaxed) && uv_hrtime() < until)
                cpu_relax();
            atomic_fetch_sub(&j->spinning, 1);
        }
        pthread_mutex_lock(&j->lock);
        while (!j->head && !atomic_load(&j->stop))
            pthread_cond_wait(&j->cond, &j->lock);
        kvp_job_item_t *it = j->head;
        if (!it) { /* stopping, and nothing left */
            pthread_mutex_unlock(&j->lock);
            return NULL;
        }
        j->head = it->next;
        if (!j->head)
            j->tail = NULL;
        atomic_fetch_sub(&j->queued, 1);
        pthread_mutex_unlock(&j->lock);

        it->begin_ns = uv_hrtime();
        it->run(it);
        it->end_ns = last_end = uv_hrtime();

        it->next = NULL;
        pthread_mutex_lock(&j->lock);
        if (j->done_tail)
            j->done_tail->next = it;
        else
            j->done_head = it;
        j->done_tail = it;
        pthread_mutex_unlock(&j->lock);
        uv_async_send(&j->async);
    }
}

static void on_handle_closed(uv_handle_t *h)
{
    kvp_jobs_t *j = h->data;
    if (--j->handles_open > 0)
        return;
    void (*closed)(void *) = j->closed;
    void *arg = j->closed_arg;
    pthread_mutex_destroy(&j->lock);
    pthread_cond_destroy(&j->cond);
    free(j->threads);
    free(j);
    if (closed)
        closed(arg);
}

static void stop_threads(kvp_jobs_t *j, unsigned started)
{
    pthread_mutex_lock(&j->lock);
    atomic_store(&j->stop, 1);
    pthread_cond_broadcast(&j->cond);
    pthread_mutex_unlock(&j->lock);
    for (unsigned i = 0; i < started; i++)
        pthread_join(j->threads[i], NULL);
}

static void maybe_finish_close(kvp_jobs_t *j)
{
    if (!j->closing || j->in_flight || j->handles_open != 2 || atomic_load(&j->stop))
        return;
    stop_threads(j, j->nthreads);
    if (j->idle_on)
        uv_idle_stop(&j->idle);
    uv_close((uv_handle_t *)&j->async, on_handle_closed);
    uv_close((uv_handle_t *)&j->idle, on_handle_closed);
}

/* Runs done() of every finished item, on the loop thread. */
static void drain(kvp_jobs_t *j)
{
    pthread_mutex_lock(&j->lock);
    kvp_job_item_t *it = j->done_head;
    j->done_head = j->done_tail = NULL;
    pthread_mutex_unlock(&j->lock);
    if (it)
        j->last_activity_ns = uv_hrtime();
    while (it) {
        kvp_job_item_t *next = it->next;
        j->in_flight--;
        it->done(it); /* may submit again */
        it = next;
    }
    maybe_finish_close(j);
}

static void on_async(uv_async_t *a)
{
    drain(a->data);
}

static void on_idle(uv_idle_t *h)
{
    kvp_jobs_t *j = h->data;
    drain(j);
    if (j->idle_on && !j->in_flight && uv_hrtime() - j->last_activity_ns > j->busy_ns) {
        uv_idle_stop(&j->idle);
        j->idle_on = 0;
    }
}

static void keep_polling(kvp_jobs_t *j)
{
    j->last_activity_ns = uv_hrtime();
    if (j->busy_ns && !j->idle_on && !j->closing) {
        uv_idle_start(&j->idle, on_idle);
        j->idle_on = 1;
    }
}

int kvp_jobs_create(uv_loop_t *loop, unsigned threads, uint32_t busy_poll_us, kvp_jobs_t **out)
{
    if (!loop || !out || threads < 1 || threads > 256 || busy_poll_us > 1000000)
        return KVP_EINVAL;
    kvp_jobs_t *j = calloc(1, sizeof(*j));
    if (!j)
        return KVP_ENOMEM;
    j->threads = calloc(threads, sizeof(pthread_t));
    if (!j->threads) {
        free(j);
        return KVP_ENOMEM;
    }
    j->loop = loop;
    j->busy_ns = (uint64_t)busy_poll_us * 1000u;
    j->nthreads = threads;
    pthread_mutex_init(&j->lock, NULL);
    pthread_cond_init(&j->cond, NULL);
    atomic_init(&j->queued, 0);
    atomic_init(&j->spinning, 0);
    atomic_init(&j->stop, 0);
    int rc = 0;
    unsigned started = 0;
    for (; started < threads; started++) {
        int e = pthread_create(&j->threads[started], NULL, thread_main, j);
        if (e) {
            rc = -e;
            goto fail_threads;
        }
    }
    uv_async_init(loop, &j->async, on_async);
    j->async.data = j;
    uv_idle_init(loop, &j->idle);
    j->idle.data = j;
    j->handles_open = 2;
    *out = j;
    return 0;

fail_threads:
    stop_threads(j, started);
    pthread_mutex_destroy(&j->lock);
    pthread_cond_destroy(&j->cond);
    free(j->threads);
    free(j);
    return rc;
}

void kvp_jobs_submit(kvp_jobs_t *j, kvp_job_item_t *it)
{
    it->next = NULL;
    it->queued_ns = uv_hrtime();
    it->begin_ns = it->end_ns = 0;
    j->in_flight++;
    pthread_mutex_lock(&j->lock);
    if (j->tail)
        j->tail->next = it;
    else
        j->head = it;
    j->tail = it;
    atomic_fetch_add_explicit(&j->queued, 1, memory_order_release);
    pthread_mutex_unlock(&j->lock);
    /* A spinning thread takes the item without a wake-up (and the futex call it would cost
     * here); wake a sleeper only when the spinners cannot take every queued item. A thread
     * that stops spinning meanwhile checks the queue under the lock before it sleeps, so no
     * item is missed; at worst it waits for a busy thread to come back. */
    if (atomic_load(&j->queued) > atomic_load(&j->spinning))
        pthread_cond_signal(&j->cond);
    keep_polling(j);
}

void kvp_jobs_touch(kvp_jobs_t *j)
{
    keep_polling(j);
}

uint32_t kvp_jobs_in_flight(const kvp_jobs_t *j)
{
    return j->in_flight;
}

void kvp_jobs_close(kvp_jobs_t *j, void (*closed)(void *arg), void *arg)
{
    if (!j || j->closing)
        return;
    j->closing = 1;
    j->closed = closed;
    j->closed_arg = arg;
    maybe_finish_close(j);
}
