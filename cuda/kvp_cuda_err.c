/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_cuda_err.c - see kvp_cuda_err.h: the per-thread record of the last CUDA / NCCL failure,
 * the process's log hook, the formatting of a record and the one mapping of CUDA and NCCL
 * results onto KVP_E* codes. Logs nothing itself: whatever logging happens is the hook's.
 */
#include "kvp_cuda_err.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#ifdef KVP_HAVE_CUDA
#include "kvp_cuda_drv.h"
#endif

/* The build passes the source root ("/path/to/kvpool/") so that records name files the way
 * a reader of the tree does, whatever directory the build ran in. */
#ifndef KVP_SOURCE_ROOT
#define KVP_SOURCE_ROOT ""
#endif

static _Thread_local char last_error[KVP_CUDA_ERR_MAX];
static _Thread_local unsigned error_count;
static _Atomic(kvp_cuda_log_hook_t) log_hook;

const char *kvp_cuda_last_error(void)
{
    return last_error;
}

void kvp_cuda_clear_error(void)
{
    last_error[0] = '\0';
}

unsigned kvp_cuda_error_count(void)
{
    return error_count;
}

void kvp_cuda_set_log_hook(kvp_cuda_log_hook_t hook)
{
    atomic_store(&log_hook, hook);
}

static const char *relative(const char *file)
{
    const size_t n = sizeof(KVP_SOURCE_ROOT) - 1;
    if (!file)
        return "?";
    return n && strncmp(file, KVP_SOURCE_ROOT, n) == 0 ? file + n : file;
}

/* Writes "FILE:LINE WHAT: " and then the formatted reason into the thread's record; hands it
 * to the hook when `log`. */
static void record(int log, const char *what, const char *file, int line, const char *fmt,
                   va_list ap)
{
    int n = snprintf(last_error, sizeof(last_error), "%s:%d %s: ", relative(file), line,
                     what ? what : "?");
    if (n >= 0 && (size_t)n < sizeof(last_error))
        vsnprintf(last_error + n, sizeof(last_error) - (size_t)n, fmt, ap);
    error_count++;
    kvp_cuda_log_hook_t hook = atomic_load(&log_hook);
    if (log && hook)
        hook(last_error);
}

static void recordf(int log, const char *what, const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    record(log, what, file, line, fmt, ap);
    va_end(ap);
}

int kvp__cuda_fail_msg(int rc, const char *what, const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    record(1, what, file, line, fmt, ap);
    va_end(ap);
    return rc;
}

int kvp__cuda_note(int rc, const char *what, const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    record(0, what, file, line, fmt, ap);
    va_end(ap);
    return rc;
}

int kvp__cuda_fail_kernel(int rc, unsigned count_before, const char *call, const char *file,
                          int line)
{
    if (error_count != count_before)
        return rc; /* the kernels library recorded (and handed on) the launch failure */
    recordf(1, call, file, line, "%s (%s)", kvp_strerror(rc), kvp_errname(rc));
    return rc;
}

#ifdef KVP_HAVE_CUDA

int kvp__cuda_fail_rt(cudaError_t res, const char *call, const char *file, int line)
{
    /* clear the runtime's last-error slot of this thread, or the next launch check would
     * report this failure again (a sticky error stays whatever we do) */
    (void)cudaGetLastError();
    recordf(1, call, file, line, "%s (%s)", cudaGetErrorString(res), cudaGetErrorName(res));
    return kvp_cuda_code(KVP_CUDA_API_RUNTIME, (int)res);
}

int kvp__cuda_fail_drv(CUresult res, const char *call, const char *file, int line)
{
    /* the driver names its own results; without a driver there is no failing driver call
     * either, but a caller may still feed one (a test): say so rather than guess */
    const char *name = NULL, *text = NULL;
    const kvp_cuda_drv_t *d = kvp__cuda_drv_table();
    if (d) {
        if (d->cuGetErrorName(res, &name) != CUDA_SUCCESS)
            name = NULL;
        if (d->cuGetErrorString(res, &text) != CUDA_SUCCESS)
            text = NULL;
    }
    if (name && text)
        recordf(1, call, file, line, "%s (%s)", text, name);
    else
        recordf(1, call, file, line, "no CUDA driver to describe it (CUresult %d)", (int)res);
    return kvp_cuda_code(KVP_CUDA_API_DRIVER, (int)res);
}

#endif /* KVP_HAVE_CUDA */

#ifdef KVP_HAVE_NCCL

/* NCCL has no name function: the names of nccl.h's results. */
static const char *nccl_name(ncclResult_t res)
{
    switch (res) {
    case ncclSuccess:
        return "ncclSuccess";
    case ncclUnhandledCudaError:
        return "ncclUnhandledCudaError";
    case ncclSystemError:
        return "ncclSystemError";
    case ncclInternalError:
        return "ncclInternalError";
    case ncclInvalidArgument:
        return "ncclInvalidArgument";
    case ncclInvalidUsage:
        return "ncclInvalidUsage";
    case ncclRemoteError:
        return "ncclRemoteError";
    case ncclInProgress:
        return "ncclInProgress";
    default:
        return "ncclResult?";
    }
}

int kvp__cuda_fail_nccl(ncclResult_t res, const char *text, const char *call, const char *file,
                        int line)
{
    if (text)
        recordf(1, call, file, line, "%s (%s)", text, nccl_name(res));
    else
        recordf(1, call, file, line, "ncclResult %d (%s)", (int)res, nccl_name(res));
    return kvp_cuda_code(KVP_CUDA_API_NCCL, (int)res);
}

#endif /* KVP_HAVE_NCCL */

int kvp_cuda_code(kvp_cuda_api_t api, int result)
{
    if (result == 0)
        return 0;
#ifndef KVP_HAVE_CUDA
    (void)api;
    return KVP_EUNAVAIL;
#else
    switch (api) {
    case KVP_CUDA_API_RUNTIME:
        switch ((cudaError_t)result) {
        case cudaErrorNoDevice:
        case cudaErrorInsufficientDriver:
        case cudaErrorInitializationError:
        case cudaErrorStubLibrary:
        case cudaErrorCallRequiresNewerDriver:
        case cudaErrorDevicesUnavailable:
        case cudaErrorSystemDriverMismatch:
        case cudaErrorSystemNotReady:
        case cudaErrorCompatNotSupportedOnDevice:
            return KVP_EUNAVAIL;
        case cudaErrorMemoryAllocation:
            return KVP_ENOMEM;
        case cudaErrorInvalidValue:
        case cudaErrorInvalidDevice:
        case cudaErrorInvalidDevicePointer:
        case cudaErrorInvalidResourceHandle:
        case cudaErrorMapBufferObjectFailed:
        case cudaErrorAlreadyMapped:
        case cudaErrorNotSupported:
            return KVP_EINVAL;
        default:
            return KVP_EINTERNAL;
        }
    case KVP_CUDA_API_DRIVER:
        switch ((CUresult)result) {
        case CUDA_ERROR_NO_DEVICE:
        case CUDA_ERROR_NOT_INITIALIZED:
        case CUDA_ERROR_DEINITIALIZED:
        case CUDA_ERROR_STUB_LIBRARY:
        case CUDA_ERROR_DEVICE_UNAVAILABLE:
        case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
        case CUDA_ERROR_SYSTEM_NOT_READY:
            return KVP_EUNAVAIL;
        case CUDA_ERROR_OUT_OF_MEMORY:
            return KVP_ENOMEM;
        case CUDA_ERROR_INVALID_VALUE:
        case CUDA_ERROR_INVALID_HANDLE:
        case CUDA_ERROR_INVALID_DEVICE:
        case CUDA_ERROR_NOT_SUPPORTED:
        case CUDA_ERROR_NOT_PERMITTED:
        case CUDA_ERROR_ALREADY_MAPPED:
        case CUDA_ERROR_MAP_FAILED:
            return KVP_EINVAL;
        default:
            return KVP_EINTERNAL;
        }
    case KVP_CUDA_API_NCCL:
#ifdef KVP_HAVE_NCCL
        switch ((ncclResult_t)result) {
        case ncclInProgress:
            return 0;
        case ncclRemoteError:
        case ncclSystemError:
            return KVP_EUNAVAIL;
        case ncclInvalidArgument:
        case ncclInvalidUsage:
            return KVP_EINVAL;
        default:
            return KVP_EINTERNAL;
        }
#else
        return KVP_EINTERNAL;
#endif
    }
    return KVP_EINTERNAL;
#endif
}
