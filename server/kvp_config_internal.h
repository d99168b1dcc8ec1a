/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_config_internal.h - the settings table of kvp_config.c as the other files of the
 * configuration module see it: kvp_config_doc.c prints the effective configuration and writes
 * the documentation (kvpoold.conf(5)'s keys, the example kvpoold.conf) from the same rows the
 * parser reads, so the two cannot drift. Not installed, not included outside server/kvp_config*.
 */
#ifndef KVP_CONFIG_INTERNAL_H
#define KVP_CONFIG_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvp_config.h"

typedef enum {
    T_SOCKET,  /* char[]: absolute path; the default depends on who runs the daemon */
    T_GROUP,   /* char[]: empty or a group name or number */
    T_LISTEN,  /* char[]: empty or host:port */
    T_U32,     /* uint32_t in [min, max] */
    T_SIZE,    /* uint64_t in [min, max], K/M/G/T suffixes */
    T_MODE,    /* uint32_t, octal, <= max */
    T_BOOL,    /* bool */
    T_LEVEL,   /* int, KVP_LOG_* */
    T_BACKEND, /* kvp_config_backend_t */
    T_DTYPE,   /* kvp_dtype_t */
    T_LAYOUT,  /* kvp_layout_t */
    T_STORAGE, /* kvp_storage_t */
    T_IDLIST,  /* kvp_config_idlist_t: >= min entries, each <= max, distinct */
    T_ENUM,    /* uint32_t: the index of one of names[0..max] */
    T_LIB,     /* char[]: a library file name or path, or empty */
    T_SCOPES,  /* char[]: access.cache_scopes, "name=uid,uid;..." (kvp_access.h) */
    T_ZMQ,     /* char[]: empty or a ZMQ endpoint: tcp://, ipc:// or inproc:// */
    T_TEXT,    /* char[]: any text without control characters (may be empty) */
} kvp__config_type_t;

/* One key: where it lives, how it parses and checks, its default and its documentation. */
typedef struct {
    const char *section;
    const char *name;
    kvp__config_type_t type;
    size_t offset; /* of its field in kvp_config_t */
    size_t size;
    uint64_t min, max;
    bool reloadable;
    const char *const *names; /* T_ENUM */
    uint64_t def;             /* the default of a U32 or SIZE row without def_text */
    const char *def_text; /* the default as the file writes it; NULL: def (T_SOCKET: computed) */
    const char *doc;      /* its kvpoold.conf(5) paragraph, scdoc markup, no reload rule */
} kvp__config_setting_t;

/* The rows in file order (the order of --check-config and of the documentation); NULL past
 * the last. */
const kvp__config_setting_t *kvp__config_setting(size_t i);

/* The introduction of a [section] in kvpoold.conf(5) and the example file; NULL for an
 * unknown one. */
const char *kvp__config_section_doc(const char *section);

/* Row i's value in cfg as the file writes it (a list: comma-separated), into buf. */
void kvp__config_format(const kvp_config_t *cfg, size_t i, char *buf, size_t len);

#endif
