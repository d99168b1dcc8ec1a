/* SPDX-License-Identifier: Apache-2.0 */
/*
 * stress_common.h - what the stress and fault programs share: the geometry they start kvpoold
 * with, page-table arrays, a raw connection (Hello + one request, for clients that vanish
 * with a request in flight or never read), and the end-of-run checks (audit, exact stats,
 * every page free, the daemon's fds back to the baseline).
 */
#ifndef STRESS_COMMON_H
#define STRESS_COMMON_H

#include <stdint.h>

#include "kvp_harness.h"
#include "kvp_wire.h"
#include "kvpool.h"

#define S_LAYERS 2
#define S_PS     4 /* tokens per page */
#define S_HEADS  2
#define S_DIM    16
#define S_ROW    (S_DIM * 2) /* fp16 */
#define S_MAXB   8           /* sequences in one batch */
#define S_MAXSEQ 256         /* limits.max_seq_tokens */
#define S_MAXIDX (S_MAXB * S_MAXSEQ / S_PS)

/* Fails the program: prints where and why, exits 1. */
#define S_CHECK(cond, ...)                                                                         \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
            s_fail();                                                                              \
        }                                                                                          \
    } while (0)

typedef struct {
    int32_t indptr[S_MAXB + 1], indices[S_MAXIDX], last[S_MAXB], aindptr[S_MAXB + 1], lens[S_MAXB];
    uint32_t copies[2 * S_MAXIDX];
    kvp_page_table_t t;
} s_table_t;

kvp_page_table_t *s_table(s_table_t *tb);

/* Exits 1; in the process that started the daemon it first kills it (SIGKILL) and prints the
 * end of its log, so a failed run leaves no daemon behind. */
void s_fail(void) __attribute__((noreturn));

/* Starts kvpoold (host backend, the geometry above, num_pages pages) with extra args. */
void s_start(kvp_daemon_t *d, uint32_t num_pages, const char *const *extra,
             const kvp_daemon_opts_t *opts);

kvp_client_t *s_connect(const kvp_daemon_t *d, const char *ns, uint32_t lease_ms, int map_pool);

/* A raw connection that said Hello in ns (no pool fds). Returns the fd. */
int s_raw_hello(const kvp_daemon_t *d, const char *ns);
/* Sends one encoded request on a raw connection. Returns 0 or a negative code. */
int s_raw_send(int fd, kvpool_Request *q);

/* Stats of namespace ns (through a raw Stats call on c): 0 when found, else -1. */
int s_ns_stats(kvp_client_t *c, const char *ns, uint32_t *num_seqs, uint64_t *num_tokens,
               uint64_t *page_refs);

/* Waits until the daemon reports want clients (up to 10 s); returns the last count. */
uint32_t s_wait_clients(kvp_client_t *obs, uint32_t want);

/* Waits until the daemon has want open fds (up to 2 s); returns the last count. */
int s_wait_fds(const kvp_daemon_t *d, int want);

/* The environment knob name as an unsigned, or dflt. */
unsigned s_env(const char *name, unsigned dflt);

#endif
