/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_cuda_err.h - the one family of CUDA and NCCL check macros (STYLE.md rule 7, NCCL's
 * CUDACHECKGOTO), the per-thread record of the last failure, and the one mapping of CUDA and
 * NCCL results onto KVP_E* codes. Used by kvpoold (server/), libkvpool (client/) and the
 * kernels (kernels/), so a failure reads the same wherever it happens.
 *
 * Every *_TRY macro takes (call, rc, label) - KVP_NCCL_TRY puts the NCCL table first - and
 * when the call fails it: records "FILE:LINE CALL: TEXT (NAME)" as the calling thread's last
 * error (FILE relative to the source tree, e.g. "kernels/kvp_append_cuda.cu:790 kernel launch:
 * invalid argument (cudaErrorInvalidValue)"), hands the same text to the process's log hook,
 * sets rc to the KVP_E* code of kvp_cuda_code() and jumps to label. A success leaves the record
 * alone: it tells what the LAST failure of the thread was, whenever that was. kvpoold installs
 * a hook that logs through kvp_log; libkvpool installs none (a library does not log), and its
 * caller reads the record (kvp_last_cuda_error() in kvpool.h).
 *
 * The record, the hook and KVP_CUDA_FAIL exist in every build; the CUDA macros only with
 * KVP_HAVE_CUDA, KVP_NCCL_TRY / KVP_NCCL_FAILED only with KVP_HAVE_NCCL (nccl.h, types only).
 * Usable from C and from CUDA C++ (.cu). Not exported from libkvpool.so (kvpool.h re-exports
 * the record).
 */
#ifndef KVP_CUDA_ERR_H
#define KVP_CUDA_ERR_H

#include "kvp_error.h"

#ifdef KVP_HAVE_CUDA
#include <cuda.h> /* CUresult: types only, driver calls go through kvp_cuda_drv.h's table */
#include <cuda_runtime_api.h>
#endif
#ifdef KVP_HAVE_NCCL
#include <nccl.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Most bytes of a record, its terminating NUL included (longer texts are cut). */
#define KVP_CUDA_ERR_MAX 512

/* The calling thread's last recorded failure, "" when it has none (never NULL). The text
 * belongs to the thread and stays valid until its next failure or kvp_cuda_clear_error(). */
const char *kvp_cuda_last_error(void);

/* Empties the calling thread's record. */
void kvp_cuda_clear_error(void);

/* Failures recorded on the calling thread so far (kvp_cuda_clear_error does not reset it):
 * KVP_KERNEL_TRY compares it around a call to tell whether the call recorded its own. */
unsigned kvp_cuda_error_count(void);

/* Receives each recorded failure's text (the record's), on the failing thread. */
typedef void (*kvp_cuda_log_hook_t)(const char *text);

/* Installs the process's log hook (NULL: none, the default). Process-wide and atomic; the
 * daemon installs its logger once at start (server/kvp_cuda_util.h). */
void kvp_cuda_set_log_hook(kvp_cuda_log_hook_t hook);

/* Which API a result comes from (kvp_cuda_code). */
typedef enum {
    KVP_CUDA_API_RUNTIME = 0, /* cudaError_t */
    KVP_CUDA_API_DRIVER = 1,  /* CUresult */
    KVP_CUDA_API_NCCL = 2,    /* ncclResult_t */
} kvp_cuda_api_t;

/*
 * The KVP_E* code of a result of `api` - the one mapping of kvpool: 0 for success (and for
 * ncclInProgress); no driver, no device or a driver too old -> KVP_EUNAVAIL (NCCL: a remote or
 * system error, a peer gone); out of memory -> KVP_ENOMEM; an invalid value, handle, device or
 * usage -> KVP_EINVAL; anything else -> KVP_EINTERNAL. In a build without CUDA every non-zero
 * result is KVP_EUNAVAIL. Pure, any thread.
 */
int kvp_cuda_code(kvp_cuda_api_t api, int result);

/* Records (and hands to the hook) "FILE:LINE WHAT: REASON" for a failure that is not a CUDA
 * result - a size the VMM cannot map, say - and returns rc. An expression. */
#define KVP_CUDA_FAIL(rc, what, ...)                                                               \
    kvp__cuda_fail_msg((rc), (what), __FILE__, __LINE__, __VA_ARGS__)

/* A call of the kernels library (kvp_kernels_cuda.h), which returns a KVP_E* code. A launch
 * failure inside it was recorded there, with the kernel file's line and CUDA's error, and is
 * kept; any other refusal (a host-side argument check) is recorded here as
 * "FILE:LINE CALL: <kvp_strerror> (<kvp_errname>)". */
#define KVP_KERNEL_TRY(call, rc, label)                                                            \
    do {                                                                                           \
        unsigned kvp_seq_ = kvp_cuda_error_count();                                                \
        int kvp_krc_ = (call);                                                                     \
        if (kvp_krc_ != 0) {                                                                       \
            (rc) = kvp__cuda_fail_kernel(kvp_krc_, kvp_seq_, #call, __FILE__, __LINE__);           \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

#ifdef KVP_HAVE_CUDA

/* A runtime API call (cudaError_t). Also clears the runtime's own last-error slot, so a later
 * KVP_LAUNCH_TRY does not report this failure again (a sticky error stays whatever we do). */
#define KVP_CUDA_TRY(call, rc, label)                                                              \
    do {                                                                                           \
        cudaError_t kvp_res_ = (call);                                                             \
        if (kvp_res_ != cudaSuccess) {                                                             \
            (rc) = kvp__cuda_fail_rt(kvp_res_, #call, __FILE__, __LINE__);                         \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

/* A driver API call (CUresult), through the table of kvp_cuda_drv.h. */
#define KVP_CU_TRY(call, rc, label)                                                                \
    do {                                                                                           \
        CUresult kvp_res_ = (call);                                                                \
        if (kvp_res_ != CUDA_SUCCESS) {                                                            \
            (rc) = kvp__cuda_fail_drv(kvp_res_, #call, __FILE__, __LINE__);                        \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

/* Right after a kernel launch (<<<...>>> or cudaLaunchKernelEx): cudaGetLastError, recorded
 * as "FILE:LINE kernel launch: TEXT (NAME)". */
#define KVP_LAUNCH_TRY(rc, label)                                                                  \
    do {                                                                                           \
        cudaError_t kvp_res_ = cudaGetLastError();                                                 \
        if (kvp_res_ != cudaSuccess) {                                                             \
            (rc) = kvp__cuda_fail_rt(kvp_res_, "kernel launch", __FILE__, __LINE__);               \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

/* A runtime result already in hand that is a failure (a query loop's cudaErrorNotReady is not
 * one: the caller decides): recorded with `what` as the call; returns the code. */
#define KVP_CUDA_FAILED(res, what) kvp__cuda_fail_rt((res), (what), __FILE__, __LINE__)

int kvp__cuda_fail_rt(cudaError_t res, const char *call, const char *file, int line);
int kvp__cuda_fail_drv(CUresult res, const char *call, const char *file, int line);

#endif /* KVP_HAVE_CUDA */

#ifdef KVP_HAVE_NCCL

/* An NCCL call through a table whose GetErrorString describes the result (server/kvp_nccl.h's
 * kvp_nccl_t). ncclInProgress is not a failure: non-blocking communicators answer it while
 * they work. */
#define KVP_NCCL_TRY(n, call, rc, label)                                                           \
    do {                                                                                           \
        ncclResult_t kvp_nres_ = (call);                                                           \
        if (kvp_nres_ != ncclSuccess && kvp_nres_ != ncclInProgress) {                             \
            (rc) = KVP_NCCL_FAILED((n), kvp_nres_, #call);                                         \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

/* An NCCL result already in hand that is a failure (ncclCommGetAsyncError's): recorded with
 * `what` as the call; returns the code. */
#define KVP_NCCL_FAILED(n, res, what)                                                              \
    kvp__cuda_fail_nccl((res), (n) && (n)->GetErrorString ? (n)->GetErrorString(res) : NULL,       \
                        (what), __FILE__, __LINE__)

int kvp__cuda_fail_nccl(ncclResult_t res, const char *text, const char *call, const char *file,
                        int line);

#endif /* KVP_HAVE_NCCL */

/* The halves of the macros above: record, hand to the hook, return the code. */
int kvp__cuda_fail_kernel(int rc, unsigned count_before, const char *call, const char *file,
                          int line);
#if defined(__GNUC__)
__attribute__((format(printf, 5, 6)))
#endif
int kvp__cuda_fail_msg(int rc, const char *what, const char *file, int line, const char *fmt, ...);

/* Records without handing to the hook: for an answer rather than a failure (no CUDA driver on
 * this machine), which the caller reports as it sees fit. Returns rc. */
#if defined(__GNUC__)
__attribute__((format(printf, 5, 6)))
#endif
int kvp__cuda_note(int rc, const char *what, const char *file, int line, const char *fmt, ...);

#ifdef __cplusplus
}
#endif
#endif
