/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvpoolctl_out.c - kvpoolctl's output: numbers for people (bytes, durations, percentages),
 * one pretty-printed JSON object with its strings escaped and made valid UTF-8, aligned
 * tables, and the record columns that drive a list's table and its JSON from one description.
 * It writes to the FILE it is given and knows neither the daemon nor the command line.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_utf8.h"
#include "kvpoolctl_out.h"
#include "kvpoolctl_top.h"

const char *kvp_ctl_fmt_bytes(uint64_t b, char *buf, size_t len)
{
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double v = (double)b;
    unsigned u = 0;
    while (v >= 1024.0 && u + 1 < sizeof(units) / sizeof(units[0])) {
        v /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%llu B", (unsigned long long)b);
    else
        snprintf(buf, len, "%.1f %s", v, units[u]);
    return buf;
}

const char *kvp_ctl_fmt_duration(uint64_t ms, char *buf, size_t len)
{
    uint64_t s = ms / 1000;
    if (ms < 1000)
        snprintf(buf, len, "%llums", (unsigned long long)ms);
    else if (s < 60)
        snprintf(buf, len, "%.1fs", (double)ms / 1000.0);
    else if (s < 3600)
        snprintf(buf, len, "%llum%02llus", (unsigned long long)(s / 60),
                 (unsigned long long)(s % 60));
    else if (s < 86400)
        snprintf(buf, len, "%lluh%02llum", (unsigned long long)(s / 3600),
                 (unsigned long long)(s / 60 % 60));
    else
        snprintf(buf, len, "%llud%02lluh", (unsigned long long)(s / 86400),
                 (unsigned long long)(s / 3600 % 24));
    return buf;
}

const char *kvp_ctl_fmt_percent(double r, char *buf, size_t len)
{
    if (isnan(r))
        snprintf(buf, len, "-");
    else
        snprintf(buf, len, "%.1f%%", 100.0 * r);
    return buf;
}

double kvp_ctl_ratio(uint64_t hit, uint64_t query)
{
    return query ? (double)hit / (double)query : NAN;
}

/* ---- JSON: one pretty-printed object, strings escaped and made valid UTF-8 --------------- */

static void json_string(FILE *f, const char *str)
{
    const unsigned char *s = (const unsigned char *)str;
    fputc('"', f);
    while (*s) {
        if (*s == '"' || *s == '\\') {
            fputc('\\', f);
            fputc(*s++, f);
        } else if (*s == '\n') {
            fputs("\\n", f);
            s++;
        } else if (*s == '\t') {
            fputs("\\t", f);
            s++;
        } else if (*s < 0x20 || *s == 0x7f) {
            fprintf(f, "\\u%04x", *s++);
        } else {
            size_t n = kvp_utf8_len(s);
            if (n == 0) {
                fputs("\\ufffd", f); /* not UTF-8: JSON cannot carry the byte */
                s++;
            } else {
                fwrite(s, 1, n, f);
                s += n;
            }
        }
    }
    fputc('"', f);
}

static void j_member(kvp_ctl_json_t *j, const char *key)
{
    if (j->depth > 0) {
        if (j->count[j->depth]++)
            fputc(',', j->f);
        fprintf(j->f, "\n%*s", 2 * j->depth, "");
    }
    if (key) {
        json_string(j->f, key);
        fputs(": ", j->f);
    }
}

void kvp_ctl_json_open(kvp_ctl_json_t *j, const char *key, char c)
{
    j_member(j, key);
    fputc(c, j->f);
    j->depth++;
    j->count[j->depth] = 0;
}

void kvp_ctl_json_close(kvp_ctl_json_t *j, char c)
{
    unsigned had = j->count[j->depth];
    j->depth--;
    if (had)
        fprintf(j->f, "\n%*s", 2 * j->depth, "");
    fputc(c, j->f);
    if (j->depth == 0)
        fputc('\n', j->f);
}

void kvp_ctl_json_str(kvp_ctl_json_t *j, const char *key, const char *v)
{
    j_member(j, key);
    json_string(j->f, v);
}

void kvp_ctl_json_u64(kvp_ctl_json_t *j, const char *key, uint64_t v)
{
    j_member(j, key);
    fprintf(j->f, "%llu", (unsigned long long)v);
}

void kvp_ctl_json_i64(kvp_ctl_json_t *j, const char *key, int64_t v)
{
    j_member(j, key);
    fprintf(j->f, "%lld", (long long)v);
}

void kvp_ctl_json_bool(kvp_ctl_json_t *j, const char *key, int v)
{
    j_member(j, key);
    fputs(v ? "true" : "false", j->f);
}

void kvp_ctl_json_double(kvp_ctl_json_t *j, const char *key, double v)
{
    j_member(j, key);
    fprintf(j->f, "%.3f", v);
}

void kvp_ctl_json_ratio(kvp_ctl_json_t *j, const char *key, double v)
{
    j_member(j, key);
    if (isnan(v))
        fputs("null", j->f);
    else
        fprintf(j->f, "%.6f", v);
}

/* ---- tables: columns sized to their widest cell, separated by three spaces --------------- */

typedef struct {
    unsigned ncols;
    const char *const *header;
    const char *align; /* per column: 'l' or 'r' */
    char **cells;      /* rows * ncols strings */
    size_t rows, cap;
} table_t;

/* Adds a row of t->ncols cells (copied). */
static void table_add(table_t *t, char *const *cells)
{
    if (t->rows == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 64;
        char **grown = realloc(t->cells, cap * t->ncols * sizeof(char *));
        if (!grown) {
            fputs("kvpoolctl: out of memory\n", stderr);
            exit(1); /* kvpoolctl's EXIT_SERVER */
        }
        t->cells = grown;
        t->cap = cap;
    }
    for (unsigned i = 0; i < t->ncols; i++) {
        char *cell = strdup(cells[i]);
        if (!cell) {
            fputs("kvpoolctl: out of memory\n", stderr);
            exit(1); /* kvpoolctl's EXIT_SERVER */
        }
        t->cells[t->rows * t->ncols + i] = cell;
    }
    t->rows++;
}

/* The table on f, its title row first unless no_headers. */
static void table_print(const table_t *t, FILE *f, int no_headers)
{
    size_t width[32] = {0};
    for (unsigned i = 0; i < t->ncols; i++)
        width[i] = strlen(t->header[i]);
    for (size_t r = 0; r < t->rows; r++)
        for (unsigned i = 0; i < t->ncols; i++) {
            size_t n = strlen(t->cells[r * t->ncols + i]);
            if (n > width[i])
                width[i] = n;
        }
    for (size_t r = no_headers ? 1 : 0; r <= t->rows; r++) {
        for (unsigned i = 0; i < t->ncols; i++) {
            const char *cell = r == 0 ? t->header[i] : t->cells[(r - 1) * t->ncols + i];
            int w = (int)width[i];
            int last = i + 1 == t->ncols;
            if (i)
                fputs("   ", f);
            if (t->align[i] == 'r')
                fprintf(f, "%*s", w, cell);
            else if (last)
                fputs(cell, f);
            else
                fprintf(f, "%-*s", w, cell);
        }
        fputc('\n', f);
    }
}

static void table_free(table_t *t)
{
    for (size_t i = 0; i < t->rows * t->ncols; i++)
        free(t->cells[i]);
    free(t->cells);
}

/* ---- records (kvpoolctl_out.h) ----------------------------------------------------------- */

/* Bytes of one table cell: the longest text field (127 bytes) with room to spare. */
#define CELL_BYTES 260
#define MAX_COLS   16

static void col_value(const kvp_ctl_col_t *c, const void *rec, const void *ctx,
                      kvp_ctl_col_val_t *v)
{
    memset(v, 0, sizeof(*v));
    if (c->get) {
        c->get(rec, ctx, v);
        return;
    }
    const void *p = (const char *)rec + c->offset;
    switch (c->type) {
    case COL_U32:
        v->u = *(const uint32_t *)p;
        break;
    case COL_U64:
        v->u = *(const uint64_t *)p;
        break;
    case COL_I32:
        v->i = *(const int32_t *)p;
        break;
    case COL_STR:
        v->s = p;
        break;
    case COL_BOOL: /* computed only */
    case COL_F64:
        break;
    }
}

static void col_cell(const kvp_ctl_col_t *c, const void *rec, const void *ctx, char *buf,
                     size_t len)
{
    kvp_ctl_col_val_t v;
    if (c->show == SHOW_CUSTOM) {
        c->cell(rec, ctx, buf, len);
        return;
    }
    col_value(c, rec, ctx, &v);
    switch (c->show) {
    case SHOW_DURATION:
        kvp_ctl_fmt_duration(v.u, buf, len);
        return;
    case SHOW_BYTES:
        kvp_ctl_fmt_bytes(v.u, buf, len);
        return;
    case SHOW_PERCENT:
        kvp_ctl_fmt_percent(v.d, buf, len);
        return;
    default:
        break;
    }
    switch (c->type) {
    case COL_U32:
    case COL_U64:
        snprintf(buf, len, "%llu", (unsigned long long)v.u);
        break;
    case COL_I32:
        snprintf(buf, len, "%lld", (long long)v.i);
        break;
    case COL_BOOL:
        snprintf(buf, len, "%s", v.u ? "true" : "false");
        break;
    case COL_F64:
        snprintf(buf, len, "%.3f", v.d);
        break;
    case COL_STR:
        if (c->show == SHOW_OR_DASH && !v.s[0])
            snprintf(buf, len, "-");
        else if (c->show == SHOW_RAW)
            snprintf(buf, len, "%s", v.s);
        else
            kvp_ctl_safe(v.s, buf, len);
        break;
    }
}

void kvp_ctl_json_records(kvp_ctl_json_t *j, const char *key, const kvp_ctl_record_t *r,
                          const void *recs, size_t n, const void *ctx)
{
    kvp_ctl_json_open(j, key, '[');
    for (size_t k = 0; k < n; k++) {
        const void *rec = (const char *)recs + k * r->size;
        kvp_ctl_json_open(j, NULL, '{');
        for (size_t i = 0; i < r->ncols; i++) {
            const kvp_ctl_col_t *c = &r->cols[i];
            kvp_ctl_col_val_t v;
            if (!c->key)
                continue;
            col_value(c, rec, ctx, &v);
            switch (c->type) {
            case COL_U32:
            case COL_U64:
                kvp_ctl_json_u64(j, c->key, v.u);
                break;
            case COL_I32:
                kvp_ctl_json_i64(j, c->key, v.i);
                break;
            case COL_STR:
                kvp_ctl_json_str(j, c->key, v.s);
                break;
            case COL_BOOL:
                kvp_ctl_json_bool(j, c->key, v.u != 0);
                break;
            case COL_F64:
                kvp_ctl_json_ratio(j, c->key, v.d);
                break;
            }
        }
        kvp_ctl_json_close(j, '}');
    }
    kvp_ctl_json_close(j, ']');
}

void kvp_ctl_table_records(FILE *f, int wide, int no_headers, const kvp_ctl_record_t *r,
                           const void *recs, size_t n, const void *ctx)
{
    const char *hdr[MAX_COLS];
    char align[MAX_COLS + 1];
    const kvp_ctl_col_t *cols[MAX_COLS];
    unsigned nc = 0;
    for (size_t i = 0; i < r->ncols; i++)
        if (r->cols[i].header && (!r->cols[i].wide || wide)) {
            if (nc == MAX_COLS) {
                fputs("kvpoolctl: too many columns\n", stderr); /* our bug */
                abort();
            }
            hdr[nc] = r->cols[i].header;
            align[nc] = r->cols[i].align;
            cols[nc++] = &r->cols[i];
        }
    align[nc] = '\0';
    table_t t = {.ncols = nc, .header = hdr, .align = align};
    char text[MAX_COLS][CELL_BYTES];
    char *cells[MAX_COLS];
    for (size_t k = 0; k < n; k++) {
        const void *rec = (const char *)recs + k * r->size;
        for (unsigned i = 0; i < nc; i++) {
            col_cell(cols[i], rec, ctx, text[i], sizeof(text[i]));
            cells[i] = text[i];
        }
        table_add(&t, cells);
    }
    table_print(&t, f, no_headers);
    table_free(&t);
}
