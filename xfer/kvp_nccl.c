/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_nccl.c - see kvp_nccl.h: dlopen of libnccl.so.2 (or [tuning] nccl_lib) into a function
 * table, once per process. Failed calls are checked with cuda/'s KVP_NCCL_TRY.
 */
#include "kvp_nccl.h"

#include <stdio.h>
#include <string.h>

#include "kvp_error.h"
#include "kvp_log.h"

#ifdef KVP_HAVE_NCCL

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>

/* non-blocking communicators and ncclCommGetAsyncError as used here are solid from 2.18 */
#define MIN_VERSION 21800

static pthread_once_t once = PTHREAD_ONCE_INIT;
static kvp_nccl_t table;
static int load_rc;
static char load_why[512]; /* room for lib_path and dlerror() */
static char lib_path[256]; /* kvp_nccl_set_library's; "": libnccl.so.2 */
static int loaded;         /* load() ran: the path can no longer change */

static void *sym(void *lib, const char *name)
{
    void *p = dlsym(lib, name);
    if (!p && !load_why[0])
        snprintf(load_why, sizeof(load_why), "%s not found in the NCCL library", name);
    return p;
}

static void load(void)
{
    __atomic_store_n(&loaded, 1, __ATOMIC_SEQ_CST);
    const char *path = lib_path[0] ? lib_path : "libnccl.so.2";
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(load_why, sizeof(load_why), "cannot load %s: %s", path, dlerror());
        load_rc = KVP_EUNAVAIL;
        return;
    }
    /* casts through void * to function pointers: POSIX guarantees dlsym's results convert */
#define SYM(field, name) *(void **)(&table.field) = sym(lib, name)
    SYM(GetVersion, "ncclGetVersion");
    SYM(GetUniqueId, "ncclGetUniqueId");
    SYM(CommInitRankConfig, "ncclCommInitRankConfig");
    SYM(CommGetAsyncError, "ncclCommGetAsyncError");
    SYM(CommAbort, "ncclCommAbort");
    SYM(CommDestroy, "ncclCommDestroy");
    SYM(Send, "ncclSend");
    SYM(Recv, "ncclRecv");
    SYM(GroupStart, "ncclGroupStart");
    SYM(GroupEnd, "ncclGroupEnd");
    SYM(GetErrorString, "ncclGetErrorString");
    if (!load_why[0]) { /* optional: registration needs all four */
        *(void **)(&table.MemAlloc) = dlsym(lib, "ncclMemAlloc");
        *(void **)(&table.MemFree) = dlsym(lib, "ncclMemFree");
        *(void **)(&table.CommRegister) = dlsym(lib, "ncclCommRegister");
        *(void **)(&table.CommDeregister) = dlsym(lib, "ncclCommDeregister");
        if (!table.MemAlloc || !table.MemFree || !table.CommRegister || !table.CommDeregister)
            table.MemAlloc = NULL, table.MemFree = NULL, table.CommRegister = NULL,
            table.CommDeregister = NULL;
    }
#undef SYM
    if (load_why[0]) {
        dlclose(lib);
        load_rc = KVP_EUNAVAIL;
        return;
    }
    if (table.GetVersion(&table.version) != ncclSuccess || table.version < MIN_VERSION) {
        snprintf(load_why, sizeof(load_why), "NCCL %d at %s is older than %d", table.version, path,
                 MIN_VERSION);
        dlclose(lib);
        load_rc = KVP_EUNAVAIL;
        return;
    }
    kvp_log(KVP_LOG_INFO, "nccl loaded path=%s version=%d", path, table.version);
    /* the library stays loaded for the life of the process */
}

int kvp_nccl_set_library(const char *path)
{
    if (path && strlen(path) >= sizeof(lib_path))
        return KVP_EINVAL;
    if (__atomic_load_n(&loaded, __ATOMIC_SEQ_CST))
        return KVP_EBUSY;
    snprintf(lib_path, sizeof(lib_path), "%s", path ? path : "");
    return 0;
}

int kvp_nccl_get(const kvp_nccl_t **out, char *why, size_t why_len)
{
    static int logged;
    pthread_once(&once, load);
    if (load_rc) {
        if (!__atomic_exchange_n(&logged, 1, __ATOMIC_SEQ_CST))
            kvp_log(KVP_LOG_INFO, "nccl unavailable reason=\"%s\"; transfers are refused",
                    load_why);
        if (why && why_len)
            snprintf(why, why_len, "%s", load_why);
        return load_rc;
    }
    *out = &table;
    return 0;
}

#else /* !KVP_HAVE_NCCL */

int kvp_nccl_set_library(const char *path)
{
    return path && strlen(path) >= 256 ? KVP_EINVAL : 0; /* as the loader would, then unused */
}

int kvp_nccl_get(const kvp_nccl_t **out, char *why, size_t why_len)
{
    (void)out;
    if (why && why_len)
        snprintf(why, why_len, "kvpoold was built without NCCL support (no CUDA or no nccl.h)");
    return KVP_EUNAVAIL;
}

#endif
