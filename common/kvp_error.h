/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_error.h - the one error vocabulary of kvpool.
 *
 * Every fallible function returns 0 or a negative code: either one of the KVP_E* codes below
 * (all <= -1000) or a negated errno value (-ENOENT, ...) for failures that come straight from
 * the operating system. kvp_strerror() names both. The server maps these codes onto the wire
 * status codes (gRPC names); the core never formats output for people beyond these strings.
 */
#ifndef KVP_ERROR_H
#define KVP_ERROR_H

#ifdef __cplusplus
extern "C" {
#endif

enum {
    KVP_OK = 0,
    KVP_EINVAL = -1000,    /* an argument is malformed */
    KVP_ENOMEM = -1001,    /* host memory allocation failed */
    KVP_ENOSPC = -1002,    /* not enough free pages in the pool */
    KVP_ENOENT = -1003,    /* no such sequence */
    KVP_EEXIST = -1004,    /* sequence already exists */
    KVP_ELIMIT = -1005,    /* a configured limit (sequences, batch, tokens) would be exceeded */
    KVP_ERANGE = -1006,    /* a position, page id or index lies outside its range */
    KVP_EAUDIT = -1007,    /* the audit found a broken invariant */
    KVP_EDUPSEQ = -1008,   /* the same sequence appears twice in one batch */
    KVP_EBUSY = -1009,     /* the object is in use */
    KVP_EPERM = -1010,     /* the caller may not do this (credentials, namespace owner) */
    KVP_EUNAVAIL = -1011,  /* the daemon is draining, unhealthy or unreachable */
    KVP_EPRECOND = -1012,  /* the call is valid but the state does not allow it */
    KVP_EINTERNAL = -1013, /* a bug or a backend failure inside the daemon */
    KVP_ETIMEDOUT = -1014, /* no answer within the caller's timeout */
    KVP_EPROTO = -1015,    /* malformed frame or message, protocol version mismatch */
    KVP_ECLOSED = -1016,   /* the connection is closed */

    /* geometry validation: one code per field, so a caller knows exactly what is wrong */
    KVP_EGEOM_NUM_LAYERS = -1100,
    KVP_EGEOM_NUM_PAGES = -1101,
    KVP_EGEOM_PAGE_SIZE = -1102,
    KVP_EGEOM_NUM_KV_HEADS = -1103,
    KVP_EGEOM_HEAD_DIM = -1104,
    KVP_EGEOM_DTYPE = -1105,
    KVP_EGEOM_LAYOUT = -1106,
    KVP_EGEOM_STORAGE = -1107,
    KVP_EGEOM_NUM_DEVICES = -1108, /* zero, too many, or kv heads not divisible by it */
    KVP_EGEOM_TOO_LARGE = -1109,   /* bytes overflow 64 bits or tokens overflow int32 */
    KVP_EGEOM_NULL = -1110,        /* no geometry given */
};

/* A static, human-readable name for any code this project returns (KVP_E* or -errno).
 * Never NULL; unknown codes give "unknown error". Thread-safe. */
const char *kvp_strerror(int code);

/* A short symbolic name ("KVP_ENOSPC", "ENOENT") for logs and tests. Never NULL. */
const char *kvp_errname(int code);

#ifdef __cplusplus
}
#endif
#endif
