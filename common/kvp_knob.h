/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_knob.h - the one parser of tuning values ("knobs"), shared by kvpoold's configuration
 * (server/kvp_config.c: its integer, size and boolean keys and the KVPOOL_* environment
 * overrides of its [tuning] section) and libkvpool (client/kvp_client.c: KVPOOL_BUSY_POLL_US,
 * KVPOOL_SOCKET). Every value is checked whole: no sign, no blanks, nothing after the number,
 * and a range, so a typo is an error rather than a silent 0 or a truncated value.
 *
 * kvp_knob_env is the only place where a knob is read from the environment: a module takes
 * its knobs as explicit options, and whoever creates it reads them here (kvpoold through its
 * configuration, a benchmark through its flags). The protocol variables of systemd and XDG
 * (NOTIFY_SOCKET, LISTEN_FDS, XDG_RUNTIME_DIR, ...) are not knobs and are read where they are
 * used. Pure C, no state: every function is thread-safe except that kvp_knob_env reads the
 * environment, which setenv in another thread may change.
 */
#ifndef KVP_KNOB_H
#define KVP_KNOB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Every knob's environment name starts with this. */
#define KVP_KNOB_ENV_PREFIX "KVPOOL_"

/* Parses s, the whole string, as a decimal unsigned integer in [min, max]. Returns 0 and sets
 * *out; KVP_EINVAL when s is not one (NULL, empty, a sign, a blank, anything after the
 * digits); KVP_ERANGE when it lies outside [min, max], or above 2^64 - 1. On error *out is
 * unchanged. */
int kvp_knob_parse_u64(const char *s, uint64_t min, uint64_t max, uint64_t *out);

/* The same for a byte count: digits, then optionally blanks and a K, M, G or T suffix (powers
 * of 1024) alone or followed by "iB": "4096", "16M", "16MiB", "4 KiB". KVP_ERANGE also when
 * the suffix makes it overflow 64 bits. */
int kvp_knob_parse_size(const char *s, uint64_t min, uint64_t max, uint64_t *out);

/* true|yes|on|1 or false|no|off|0, in any case. Returns 0 or KVP_EINVAL (*out unchanged). */
int kvp_knob_parse_bool(const char *s, bool *out);

/* The value of the environment variable name, or NULL when it is not set ("" when it is set
 * but empty: an empty number is then refused by the parsers above, not taken as unset). */
const char *kvp_knob_env(const char *name);

/* KVPOOL_ and key in upper case into buf ("cuda_plan_upload" -> "KVPOOL_CUDA_PLAN_UPLOAD").
 * Returns 0, or KVP_EINVAL when it does not fit in len bytes (buf then holds ""). */
int kvp_knob_env_name(const char *key, char *buf, size_t len);

/* An integer knob from the environment variable name. Returns 1 and sets *out when it is set
 * and valid; 0 when it is not set (*out unchanged); KVP_EINVAL when its value is not a decimal
 * integer in [min, max], with "NAME: invalid value 'VALUE': expected an unsigned decimal
 * integer in MIN..MAX" in err (err_len bytes, may be NULL). */
int kvp_knob_env_u64(const char *name, uint64_t min, uint64_t max, uint64_t *out, char *err,
                     size_t err_len);

#ifdef __cplusplus
}
#endif
#endif
