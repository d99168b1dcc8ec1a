/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvpoolctl_out.h - kvpoolctl's output helpers (kvpoolctl_out.c): human numbers, the JSON
 * writer, and the record columns from which one description prints both a list's aligned table
 * and its JSON array. Part of the kvpoolctl program, not of libkvpool; it knows nothing of the
 * daemon or of the command line.
 */
#ifndef KVPOOLCTL_OUT_H
#define KVPOOLCTL_OUT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* ---- numbers for people: each writes into buf (len bytes) and returns buf ---------------- */

/* "512 B", "1.5 KiB" ... "2.0 PiB". */
const char *kvp_ctl_fmt_bytes(uint64_t b, char *buf, size_t len);

/* "250ms", "1.5s", "3m05s", "2h10m", "4d03h". */
const char *kvp_ctl_fmt_duration(uint64_t ms, char *buf, size_t len);

/* A ratio as a percentage with one decimal; "-" for NaN (nothing to divide). */
const char *kvp_ctl_fmt_percent(double r, char *buf, size_t len);

/* hit / query, NaN when nothing was asked. */
double kvp_ctl_ratio(uint64_t hit, uint64_t query);

/* ---- JSON: one pretty-printed object on f; zero the struct, set f, open with key NULL ----- */

typedef struct {
    FILE *f;
    int depth;
    unsigned count[16];
} kvp_ctl_json_t;

/* Opens an object ('{') or array ('[') as member key (NULL: an array element, or the top). */
void kvp_ctl_json_open(kvp_ctl_json_t *j, const char *key, char c);
/* Closes it with c ('}' or ']'); the top one ends with a newline. */
void kvp_ctl_json_close(kvp_ctl_json_t *j, char c);
/* Members (key NULL inside an array): a string (escaped, made valid UTF-8), numbers, a bool. */
void kvp_ctl_json_str(kvp_ctl_json_t *j, const char *key, const char *v);
void kvp_ctl_json_u64(kvp_ctl_json_t *j, const char *key, uint64_t v);
void kvp_ctl_json_i64(kvp_ctl_json_t *j, const char *key, int64_t v);
void kvp_ctl_json_bool(kvp_ctl_json_t *j, const char *key, int v);
void kvp_ctl_json_double(kvp_ctl_json_t *j, const char *key, double v); /* three decimals */
/* A ratio in 0..1 with six decimals; null for NaN (JSON has no NaN). */
void kvp_ctl_json_ratio(kvp_ctl_json_t *j, const char *key, double v);

/* ---- records: one column table drives both a record's text table and its JSON ------------
 * A list record (a namespace of stats, a sequence, a client, a transfer) is described once, as
 * an array of columns: the table's title, the JSON key, how the table shows the value and
 * where the value comes from (a field of the record, its type taken from the field itself, or
 * a function for what is not one field). The table shows the columns that have a title (those
 * marked wide with -o wide only: they come last, table-only, so the JSON stays as it was), the
 * JSON the ones that have a key, each in array order; adding a field is one row. */

typedef enum { COL_U32, COL_U64, COL_I32, COL_STR, COL_BOOL, COL_F64 } kvp_ctl_col_type_t;

typedef enum {
    SHOW_PLAIN,    /* a number in decimal; text made safe for a terminal (kvp_ctl_safe) */
    SHOW_RAW,      /* text as it is: words the daemon itself writes ("export", "running") */
    SHOW_OR_DASH,  /* text made safe, "-" when empty */
    SHOW_DURATION, /* milliseconds, as kvp_ctl_fmt_duration */
    SHOW_BYTES,    /* bytes, as kvp_ctl_fmt_bytes */
    SHOW_PERCENT,  /* a ratio (COL_F64) as a percentage, "-" when NaN (JSON: null) */
    SHOW_CUSTOM,   /* the column's cell function writes it */
} kvp_ctl_col_show_t;

typedef struct {
    uint64_t u; /* COL_U32, COL_U64, COL_BOOL */
    int64_t i;  /* COL_I32 */
    double d;   /* COL_F64 (computed only) */
    const char *s;
} kvp_ctl_col_val_t;

typedef struct {
    const char *header; /* table title; NULL: JSON only */
    const char *key;    /* JSON member; NULL: table only */
    char align;         /* table: 'l' or 'r' */
    kvp_ctl_col_show_t show;
    kvp_ctl_col_type_t type;
    size_t offset; /* of the field in the record (unless get) */
    /* computed columns; ctx is the command's (e.g. the own session id) */
    void (*get)(const void *rec, const void *ctx, kvp_ctl_col_val_t *v);
    void (*cell)(const void *rec, const void *ctx, char *buf, size_t len); /* SHOW_CUSTOM */
    int wide; /* the table shows it with -o wide only */
} kvp_ctl_col_t;

/* .offset and .type of field m of record type T; a field of another type does not compile. */
#define FIELD(T, m)                                                                                \
    .offset = offsetof(T, m),                                                                      \
    .type = _Generic(((T *)0)->m, uint32_t: COL_U32, uint64_t: COL_U64, int32_t: COL_I32,         \
                     char *: COL_STR)

typedef struct {
    const kvp_ctl_col_t *cols;
    size_t ncols;
    size_t size; /* of one record: the records are an array */
} kvp_ctl_record_t;

#define RECORD(cols, T)                                                                            \
    {                                                                                              \
        cols, sizeof(cols) / sizeof(cols[0]), sizeof(T)                                            \
    }

/* n records (an array of r->size bytes each) as the JSON array `key`, one object each; ctx is
 * handed to the columns' functions. */
void kvp_ctl_json_records(kvp_ctl_json_t *j, const char *key, const kvp_ctl_record_t *r,
                          const void *recs, size_t n, const void *ctx);

/* The same as an aligned table on f, the title row first unless no_headers; the wide columns
 * only when wide. Exits with status 1 when out of memory. */
void kvp_ctl_table_records(FILE *f, int wide, int no_headers, const kvp_ctl_record_t *r,
                           const void *recs, size_t n, const void *ctx);

#endif
