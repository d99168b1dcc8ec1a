/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_jobs.h - the daemon's worker threads: the work a request cannot do on the event loop
 * (a backend's copy, which may wait on the GPU) runs here, and its completion is handed back
 * to the loop thread.
 *
 * Why not libuv's thread pool: its threads and the loop sleep between items, and on the
 * virtual machines GPUs are rented as, waking a sleeping thread costs tens of microseconds
 * (measured on the H200 machine: ~50 us from uv_queue_work to the work starting, ~10 us back
 * to the loop), several times the copy of a decode step. With busy_poll_us > 0 a thread that
 * finished an item spins that long for the next one before it sleeps, and the loop polls
 * without sleeping while items are in flight and for busy_poll_us after the last one, so a
 * worker's steady stream of requests never waits for a wake-up; the price is up to one CPU per
 * busy thread while traffic flows. With busy_poll_us = 0 everything sleeps, as libuv's pool.
 *
 * Threading: create, submit, close on the loop thread; an item's run() on a pool thread; its
 * done() on the loop thread. Items are caller-owned and must stay valid until done() ran.
 */
#ifndef KVP_JOBS_H
#define KVP_JOBS_H

#include <stdint.h>
#include <uv.h>

typedef struct kvp_jobs kvp_jobs_t;

typedef struct kvp_job_item {
    void (*run)(struct kvp_job_item *it);  /* pool thread */
    void (*done)(struct kvp_job_item *it); /* loop thread, after run() returned */
    void *data;
    uint64_t queued_ns, begin_ns, end_ns; /* uv_hrtime() stamps: for timing logs */
    struct kvp_job_item *next;            /* internal */
} kvp_job_item_t;

/* threads: 1..256. busy_poll_us: 0..1000000 (see above). Returns 0, KVP_EINVAL, KVP_ENOMEM or
 * a negative errno (pthread_create). */
int kvp_jobs_create(uv_loop_t *loop, unsigned threads, uint32_t busy_poll_us, kvp_jobs_t **out);

/* Queues it (run and done set); never fails. Not after kvp_jobs_close. */
void kvp_jobs_submit(kvp_jobs_t *j, kvp_job_item_t *it);

/* Notes activity on the loop (a request arrived): with busy polling the loop then polls
 * without sleeping for busy_poll_us. */
void kvp_jobs_touch(kvp_jobs_t *j);

/* Items submitted and not yet done. */
uint32_t kvp_jobs_in_flight(const kvp_jobs_t *j);

/* Stops the pool once every item in flight is done (their done() still runs), joins the
 * threads, closes the loop handles and frees j; then calls closed(arg) on the loop thread. */
void kvp_jobs_close(kvp_jobs_t *j, void (*closed)(void *arg), void *arg);

#endif
