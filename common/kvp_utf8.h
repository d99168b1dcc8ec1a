/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_utf8.h - UTF-8 validation shared by the daemon's metrics text (Prometheus exposition is
 * UTF-8) and kvpoolctl's JSON output: names that clients choose (namespaces, client names)
 * pass through both, and an invalid byte must be escaped, never copied.
 */
#ifndef KVP_UTF8_H
#define KVP_UTF8_H

#include <stddef.h>

/* Length (1..4) of the valid UTF-8 sequence starting at s, or 0 when s does not start one
 * (overlong forms, surrogates and code points above U+10FFFF are invalid). Reads at most the
 * bytes of the sequence its first byte announces, stopping at the first bad continuation
 * byte, so a NUL-terminated string is never read past its end. */
size_t kvp_utf8_len(const unsigned char *s);

#endif
