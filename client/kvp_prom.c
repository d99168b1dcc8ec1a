/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_prom.c - see kvp_prom.h. Lines are "name{labels} value" or "name value"; label values
 * may hold escaped quotes, so the closing brace is found by walking the quoted strings.
 */
#include "kvp_prom.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int name_char(char c, int first)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
           (!first && c >= '0' && c <= '9');
}

/* Parses one line [p, end). Returns 1 on a sample. */
static int parse_line(const char *p, const char *end, kvp_prom_sample_t *s)
{
    if (p == end || *p == '#' || !name_char(*p, 1))
        return 0;
    s->name = p;
    while (p < end && name_char(*p, 0))
        p++;
    s->name_len = (size_t)(p - s->name);
    s->labels = NULL;
    s->labels_len = 0;
    if (p < end && *p == '{') {
        const char *lb = ++p;
        int in_str = 0;
        for (; p < end; p++) {
            if (in_str && *p == '\\' && p + 1 < end)
                p++;
            else if (*p == '"')
                in_str = !in_str;
            else if (!in_str && *p == '}')
                break;
        }
        if (p == end)
            return 0;
        s->labels = lb;
        s->labels_len = (size_t)(p - lb);
        p++;
    }
    if (p == end || *p != ' ')
        return 0;
    p++;
    char num[64];
    size_t n = (size_t)(end - p);
    const char *sp = memchr(p, ' ', n); /* an optional timestamp follows */
    if (sp)
        n = (size_t)(sp - p);
    if (n == 0 || n >= sizeof(num))
        return 0;
    memcpy(num, p, n);
    num[n] = '\0';
    char *e;
    s->value = strtod(num, &e);
    return *e == '\0';
}

int kvp_prom_next(const char *text, size_t len, size_t *pos, kvp_prom_sample_t *s)
{
    while (*pos < len) {
        const char *p = text + *pos;
        const char *nl = memchr(p, '\n', len - *pos);
        const char *end = nl ? nl : text + len;
        *pos = (size_t)(end - text) + (nl ? 1 : 0);
        if (parse_line(p, end, s))
            return 1;
    }
    return 0;
}

int kvp_prom_is(const kvp_prom_sample_t *s, const char *name)
{
    size_t n = strlen(name);
    return s->name_len == n && memcmp(s->name, name, n) == 0;
}

int kvp_prom_label(const kvp_prom_sample_t *s, const char *key, char *out, size_t cap)
{
    size_t klen = strlen(key);
    const char *p = s->labels, *end = s->labels + s->labels_len;
    while (p && p < end) {
        const char *eq = memchr(p, '=', (size_t)(end - p));
        if (!eq || eq + 1 >= end || eq[1] != '"')
            return -1;
        int match = (size_t)(eq - p) == klen && memcmp(p, key, klen) == 0;
        size_t o = 0;
        const char *v = eq + 2;
        for (; v < end && *v != '"'; v++) {
            char c = *v;
            if (c == '\\' && v + 1 < end) {
                v++;
                c = *v == 'n' ? '\n' : *v;
            }
            if (match && o + 1 < cap)
                out[o++] = c;
        }
        if (match) {
            if (cap)
                out[o] = '\0';
            return 0;
        }
        p = v + 1; /* past the closing quote */
        if (p < end && *p == ',')
            p++;
    }
    return -1;
}

double kvp_prom_quantile(double q, const double *le, const double *cum, int n)
{
    if (n < 2 || !(cum[n - 1] > 0))
        return NAN;
    double rank = q * cum[n - 1];
    int i = 0;
    while (i < n - 1 && cum[i] < rank)
        i++;
    if (i == n - 1) /* in the +Inf bucket */
        return le[n - 2];
    double lo = i ? le[i - 1] : 0, below = i ? cum[i - 1] : 0;
    double in = cum[i] - below;
    return in > 0 ? lo + (le[i] - lo) * (rank - below) / in : le[i];
}
