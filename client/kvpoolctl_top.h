/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvpoolctl_top.h - `kvpoolctl top`: a live view of one daemon built from its Metrics text
 * (usage bars per device, the prefix cache's cached and pinned pages and hit rate, rates
 * between refreshes, latency percentiles from the histograms, the busiest namespaces). On a
 * terminal it redraws in the alternate screen with the cursor hidden and the terminal in
 * non-canonical, no-echo mode, and restores all of it on exit ('q', Ctrl-C, SIGTERM, the daemon
 * going away); otherwise it prints one key=value line per refresh.
 */
#ifndef KVPOOLCTL_TOP_H
#define KVPOOLCTL_TOP_H

#include <stdint.h>

#include "kvpool.h"

typedef struct {
    const char *socket_path; /* shown in the header */
    uint32_t interval_ms;    /* between refreshes, >= 100 */
    uint32_t count;          /* refreshes before exiting; 0: until 'q' or a signal */
    const char *ns;          /* -n: namespace ns only among the namespaces; NULL: all */
} kvp_top_opts_t;

/* A copy of s safe for a terminal, in buf (len bytes): control characters become '?'. */
const char *kvp_ctl_safe(const char *s, char *buf, size_t len);

/* Runs the view on the connected client c (borrowed). Returns the process exit status:
 * 0 (quit or count reached), 3 (the daemon stopped answering), 1 (another failure). */
int kvp_ctl_top(kvp_client_t *c, const kvp_top_opts_t *o);

#endif
