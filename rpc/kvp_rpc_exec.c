/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc_exec.c - the rpc layer's worker threads: where a call is suspended and resumed. A
 * handler that returns KVP_RPC_ASYNC leaves a job (an Append's copy, an Import's receive);
 * kvp_rpc_handle submits it here, a worker runs it, and back on the loop thread the job
 * finishes (its outcome recorded, its answer written) and the transport's resume callback
 * sends the answer. Background work a call starts besides its answer (an ExportBegin's send)
 * runs the same way with nothing to answer. Every kind of job comes through its own operations
 * (kvp_rpc_job_ops_t), so nothing here knows what an append or a transfer is, and the
 * transport knows nothing of jobs.
 */
#include <string.h>

#include "kvp_error.h"
#include "kvp_log.h"
#include "kvp_rpc_internal.h"

int kvp_rpc_start(kvp_rpc_t *r, uv_loop_t *loop, unsigned threads, uint32_t busy_poll_us,
                  uint64_t (*clock_ms)(void), kvp_rpc_resume_fn resume, void *arg)
{
    if (!r || !loop || !clock_ms || !resume || r->jobs)
        return KVP_EINVAL;
    int rc = kvp_jobs_create(loop, threads, busy_poll_us, &r->jobs);
    if (rc)
        return rc;
    r->clock_ms = clock_ms;
    r->resume = resume;
    r->resume_arg = arg;
    return 0;
}

void kvp_rpc_touch(kvp_rpc_t *r)
{
    if (r->jobs)
        kvp_jobs_touch(r->jobs);
}

void kvp_rpc_stop(kvp_rpc_t *r, void (*closed)(void *arg), void *arg)
{
    kvp_jobs_t *j = r->jobs;
    if (!j) {
        closed(arg);
        return;
    }
    r->jobs = NULL; /* nothing new is submitted; those in flight still resume */
    kvp_jobs_close(j, closed, arg);
}

void kvp_rpc_job_run(kvp_rpc_job_t *job)
{
    job->ops->run(job);
}

void kvp_rpc_job_finish(kvp_rpc_t *r, kvp_rpc_job_t *job, kvp_rpc_io_t *io, uint64_t now_ms)
{
    io->call = job->call; /* io served other calls while the job ran */
    job->ops->finish(r, job, io, now_ms);
}

void kvp_rpc_job_free(kvp_rpc_job_t *job)
{
    if (job)
        job->ops->free(job);
}

static void item_run(kvp_job_item_t *it)
{
    kvp_rpc_job_t *j = it->data;
    j->ops->run(j);
}

/* Loop thread: the job ran; its call (if any) resumes with the answer. */
static void item_done(kvp_job_item_t *it)
{
    kvp_rpc_job_t *j = it->data;
    kvp_rpc_t *r = j->rpc;
    const uint64_t now_ms = r->clock_ms();
    if (kvp_log_enabled(KVP_LOG_DEBUG)) /* where an off-loop job's time goes */
        kvp_log(KVP_LOG_DEBUG, "job timing job=%s queue_us=%.1f run_us=%.1f back_us=%.1f",
                j->ops->name, (double)(it->begin_ns - it->queued_ns) / 1e3,
                (double)(it->end_ns - it->begin_ns) / 1e3,
                (double)(uv_hrtime() - it->end_ns) / 1e3);
    if (!j->sess) {
        j->ops->finish(r, j, NULL, now_ms);
        j->ops->free(j);
        return;
    }
    kvp_rpc_io_t *io = &r->resume_io; /* reused: nothing of the last job's answer stays */
    io->nfds_out = 0;
    io->replay = NULL;
    io->replay_len = 0;
    memset(&io->out, 0, sizeof(io->out));
    kvp_rpc_job_finish(r, j, io, now_ms);
    kvp_counters_observe_run(&r->counters, it->end_ns - it->begin_ns); /* stamped by kvp_jobs */
    r->resume(r->resume_arg, j->sess, io);
    j->ops->free(j);
}

static void submit(kvp_rpc_t *r, kvp_rpc_job_t *j)
{
    j->item.data = j;
    j->item.run = item_run;
    j->item.done = item_done;
    kvp_jobs_submit(r->jobs, &j->item);
}

int kvp__rpc_submit_call(kvp_rpc_t *r, kvp_session_t *s, kvp_rpc_io_t *io)
{
    if (!r->jobs)
        return 0;
    kvp_rpc_job_t *j = io->job;
    io->job = NULL;
    j->sess = s;
    if (j->waits) { /* restores of pages it links are in flight: submitted when they end */
        j->parked = 1;
        return 1;
    }
    submit(r, j);
    return 1;
}

void kvp__rpc_submit_parked(kvp_rpc_t *r, kvp_rpc_job_t *j)
{
    j->parked = 0;
    if (r->jobs) {
        submit(r, j);
        return;
    }
    /* the worker threads are closing (the daemon stops) while the restore it waited for ended:
     * run and answer it here, as item_done would */
    j->ops->run(j);
    j->item.data = j;
    j->item.begin_ns = j->item.end_ns = j->item.queued_ns = uv_hrtime();
    item_done(&j->item);
}

void kvp__rpc_submit_bg(kvp_rpc_t *r, kvp_rpc_job_t *j, uint64_t now_ms)
{
    j->sess = NULL;
    if (r->jobs) {
        submit(r, j);
        return;
    }
    j->ops->run(j); /* no worker threads (tests): inline */
    j->ops->finish(r, j, NULL, now_ms);
    j->ops->free(j);
}
