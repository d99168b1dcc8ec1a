/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bench_prefix_events.h - bench_prefix's part 7 (issue #29, KV events), in
 * bench_prefix_events.c: the encoder and the publisher in block events per second, the loop's
 * cost per block event (the batcher), and a Reserve's and a Commit's latency over the socket
 * with events on against off in the same run. Figures are printed, never asserted.
 */
#ifndef BENCH_PREFIX_EVENTS_H
#define BENCH_PREFIX_EVENTS_H

#include <stdint.h>

typedef struct {
    int quick;  /* the smoke run's sizes (a second or two) */
    int daemon; /* 0: skip the part that starts two kvpoold */
} bench_events_opts_t;

typedef struct {
    int enc_ok, pub_ok, obs_ok, daemon_ok;
    /* a) the encoder: block events/s, median of per-batch rates */
    double enc_stored_bps, enc_removed_bps;
    /* b) the publisher: block events/s sent (its counters) and delivered (the SUB's count) */
    double pub_bps, pub_delivered_bps;
    uint64_t pub_dropped, pub_received;
    double pub_idle_submit_ns; /* kvp_evpub_submit to an idle thread, p50 */
    /* b) the batcher: ns per block event on the loop, median */
    double obs_ns;
    /* c) kvpoold with events on and off, microseconds */
    double reserve_p50_on, reserve_p99_on, reserve_p50_off, reserve_p99_off;
    double commit_p50_on, commit_p99_on, commit_p50_off, commit_p99_off;
    double cpu_us_on, cpu_us_off; /* each daemon's CPU time (all its threads) per round */
    uint64_t daemon_received;     /* batches the SUB got from the events daemon */
} bench_events_result_t;

/* Runs part 7 and prints it. Returns 0, or -1 when something it measures did not happen (an
 * encode failed, the subscriber received nothing, a Commit published less than it keyed); the
 * parts that did run keep their figures (their *_ok set). */
int bench_events(const bench_events_opts_t *o, bench_events_result_t *r);

/* Prints the figures that were measured as key=value lines. */
void bench_events_keys(const bench_events_result_t *r);

/* bench_prefix.c's clock (CLOCK_MONOTONIC, ns) and quantile (sorts v[n], returns its q-quantile,
 * q in [0, 1]), shared by its parts. */
uint64_t bench_now_ns(void);
uint64_t bench_quantile(uint64_t *v, uint32_t n, double q);

#endif
