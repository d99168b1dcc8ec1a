/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_prom.h - reading Prometheus text exposition (format 0.0.4) back, for `kvpoolctl top`:
 * a sample iterator over the text (no allocation, pointers into the caller's buffer), label
 * lookup with unescaping, and histogram_quantile over cumulative buckets. It parses what
 * kvpoold writes and rejects what it cannot read (the line is skipped), nothing more: it is
 * not a general Prometheus client.
 */
#ifndef KVP_PROM_H
#define KVP_PROM_H

#include <stddef.h>

typedef struct {
    const char *name; /* not NUL-terminated: name_len bytes */
    size_t name_len;
    const char *labels; /* between the braces, without them; labels_len 0 when none */
    size_t labels_len;
    double value;
} kvp_prom_sample_t;

/* Reads the next sample line of text[0..len) from *pos, skipping comments, blank and
 * malformed lines. Returns 1 with *s filled and *pos after the line, 0 at the end. */
int kvp_prom_next(const char *text, size_t len, size_t *pos, kvp_prom_sample_t *s);

/* 1 when the sample's name is exactly `name`. */
int kvp_prom_is(const kvp_prom_sample_t *s, const char *name);

/* Copies the unescaped value of label `key` (\\, \" and \n undone) into out (NUL-terminated,
 * truncated to cap - 1). Returns 0, or -1 when the sample has no such label. */
int kvp_prom_label(const kvp_prom_sample_t *s, const char *key, char *out, size_t cap);

/* Prometheus' histogram_quantile: q in [0, 1] over n buckets with ascending upper bounds le[]
 * (the last one +Inf) and cumulative counts cum[]; linear interpolation inside a bucket, the
 * first bucket starting at 0. A rank that falls in the +Inf bucket gives the largest finite
 * bound. Returns NAN when there is no observation (cum[n - 1] == 0) or n < 2. */
double kvp_prom_quantile(double q, const double *le, const double *cum, int n);

#endif
