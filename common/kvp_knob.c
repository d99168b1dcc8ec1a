/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_knob.c - checked parsing of knob values and the one environment read of knobs
 * (kvp_knob.h). strtoull alone accepts a sign, leading blanks and garbage after the digits;
 * every function here rejects them first.
 */
#include "kvp_knob.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "kvp_error.h"

/* Leading decimal digits of s -> *v; *end after them. KVP_EINVAL when s does not start with a
 * digit, KVP_ERANGE when they overflow 64 bits. */
static int parse_digits(const char *s, uint64_t *v, const char **end)
{
    if (!s || !isdigit((unsigned char)*s))
        return KVP_EINVAL;
    char *e;
    errno = 0;
    unsigned long long n = strtoull(s, &e, 10);
    if (errno == ERANGE)
        return KVP_ERANGE;
    *v = n;
    *end = e;
    return 0;
}

static int in_range(uint64_t v, uint64_t min, uint64_t max, uint64_t *out)
{
    if (v < min || v > max)
        return KVP_ERANGE;
    *out = v;
    return 0;
}

int kvp_knob_parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
    uint64_t v;
    const char *end;
    int rc = parse_digits(s, &v, &end);
    if (rc)
        return rc;
    if (*end)
        return KVP_EINVAL;
    return in_range(v, min, max, out);
}

int kvp_knob_parse_size(const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
    uint64_t v;
    const char *p;
    int rc = parse_digits(s, &v, &p);
    if (rc)
        return rc;
    if (!*p)
        return in_range(v, min, max, out);
    while (*p == ' ' || *p == '\t')
        p++;
    unsigned shift;
    switch (*p) {
    case 'K':
        shift = 10;
        break;
    case 'M':
        shift = 20;
        break;
    case 'G':
        shift = 30;
        break;
    case 'T':
        shift = 40;
        break;
    default:
        return KVP_EINVAL;
    }
    p++;
    if (*p && strcmp(p, "iB") != 0)
        return KVP_EINVAL;
    if (v > (UINT64_MAX >> shift))
        return KVP_ERANGE;
    return in_range(v << shift, min, max, out);
}

int kvp_knob_parse_bool(const char *s, bool *out)
{
    static const char *const yes[] = {"true", "yes", "on", "1"};
    static const char *const no[] = {"false", "no", "off", "0"};
    if (!s)
        return KVP_EINVAL;
    for (size_t i = 0; i < sizeof(yes) / sizeof(yes[0]); i++) {
        if (strcasecmp(s, yes[i]) == 0) {
            *out = true;
            return 0;
        }
        if (strcasecmp(s, no[i]) == 0) {
            *out = false;
            return 0;
        }
    }
    return KVP_EINVAL;
}

const char *kvp_knob_env(const char *name)
{
    return name ? getenv(name) : NULL;
}

int kvp_knob_env_name(const char *key, char *buf, size_t len)
{
    size_t prefix = strlen(KVP_KNOB_ENV_PREFIX);
    if (!buf || !len)
        return KVP_EINVAL;
    buf[0] = '\0';
    if (!key || prefix + strlen(key) >= len)
        return KVP_EINVAL;
    memcpy(buf, KVP_KNOB_ENV_PREFIX, prefix);
    size_t i = 0;
    for (; key[i]; i++)
        buf[prefix + i] = (char)toupper((unsigned char)key[i]);
    buf[prefix + i] = '\0';
    return 0;
}

int kvp_knob_env_u64(const char *name, uint64_t min, uint64_t max, uint64_t *out, char *err,
                     size_t err_len)
{
    const char *v = kvp_knob_env(name);
    if (!v)
        return 0;
    if (kvp_knob_parse_u64(v, min, max, out) == 0)
        return 1;
    if (err && err_len)
        snprintf(err, err_len,
                 "%s: invalid value '%s': expected an unsigned decimal integer in %llu..%llu", name,
                 v, (unsigned long long)min, (unsigned long long)max);
    return KVP_EINVAL;
}
