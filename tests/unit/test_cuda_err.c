/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_cuda_err.c - cuda/kvp_cuda_err.h without a GPU: the check macros fed with fake calls
 * that return a chosen error, the exact text they record ("FILE:LINE CALL: TEXT (NAME)"), the
 * record being per thread, the log hook, and the one mapping of CUDA / NCCL results onto
 * KVP_E* codes. Built with and without CUDA (the CUDA macros only with).
 */
#include <check.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_cuda_err.h"
#ifdef KVP_HAVE_CUDA
#include "kvp_cuda_drv.h"
#endif

#define THIS_FILE "tests/unit/test_cuda_err.c"

static char expect[KVP_CUDA_ERR_MAX];

/* The text a record of this file's line `line` must hold. */
__attribute__((format(printf, 2, 3))) static const char *at(int line, const char *fmt, ...)
{
    int n = snprintf(expect, sizeof(expect), "%s:%d ", THIS_FILE, line);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(expect + n, sizeof(expect) - (size_t)n, fmt, ap);
    va_end(ap);
    return expect;
}

/* ---- the log hook ------------------------------------------------------------------------ */

static int hook_calls;
static char hook_text[KVP_CUDA_ERR_MAX];

static void hook(const char *text)
{
    hook_calls++;
    snprintf(hook_text, sizeof(hook_text), "%s", text);
}

/* ---- fake calls and the functions that check them (one macro each, its line known) -------- */

/* A "kernels library" call: returns rc; records nothing. */
static int fake_kernel(int rc)
{
    return rc;
}

static int line_kernel;
static int try_kernel(int krc)
{
    int rc = 0;
    line_kernel = __LINE__ + 1;
    KVP_KERNEL_TRY(fake_kernel(krc), rc, fail);
    return 0;
fail:
    return rc;
}

static int line_msg;
static int fail_msg(size_t size)
{
    line_msg = __LINE__ + 1;
    return KVP_CUDA_FAIL(KVP_EINVAL, "kvp_cuda_vmm", "size %zu cannot be mapped", size);
}

#ifdef KVP_HAVE_CUDA

static cudaError_t fake_rt(cudaError_t e)
{
    return e;
}

static CUresult fake_drv(CUresult r)
{
    return r;
}

static int line_rt;
static int try_rt(cudaError_t e, int *jumped)
{
    int rc = 0;
    *jumped = 0;
    line_rt = __LINE__ + 1;
    KVP_CUDA_TRY(fake_rt(e), rc, fail);
    return 0;
fail:
    *jumped = 1;
    return rc;
}

static int line_drv;
static int try_drv(CUresult r)
{
    int rc = 0;
    line_drv = __LINE__ + 1;
    KVP_CU_TRY(fake_drv(r), rc, fail);
    return 0;
fail:
    return rc;
}

static int line_launch;
static int try_launch(void)
{
    int rc = 0;
    line_launch = __LINE__ + 1;
    KVP_LAUNCH_TRY(rc, fail);
    return 0;
fail:
    return rc;
}

/* A kernels-library entry point whose own check failed (as a launch failure would). */
static int line_inner;
static int fake_kernel_with_record(void)
{
    int rc = 0;
    line_inner = __LINE__ + 1;
    KVP_CUDA_TRY(fake_rt(cudaErrorLaunchOutOfResources), rc, fail);
    return 0;
fail:
    return rc;
}

static int try_kernel_with_record(void)
{
    int rc = 0;
    KVP_KERNEL_TRY(fake_kernel_with_record(), rc, fail);
    return 0;
fail:
    return rc;
}

#endif /* KVP_HAVE_CUDA */

/* ---- every build ---------------------------------------------------------------------------- */

START_TEST(a_thread_starts_with_an_empty_record)
{
    ck_assert_str_eq(kvp_cuda_last_error(), "");
    ck_assert_uint_eq(kvp_cuda_error_count(), 0);
}
END_TEST

START_TEST(a_kernel_refusal_is_recorded_where_it_was_checked)
{
    ck_assert_int_eq(try_kernel(KVP_EINVAL), KVP_EINVAL);
    ck_assert_str_eq(kvp_cuda_last_error(),
                     at(line_kernel, "fake_kernel(krc): invalid argument (KVP_EINVAL)"));
    ck_assert_uint_eq(kvp_cuda_error_count(), 1);
    /* a success jumps nowhere and leaves the record as it was */
    ck_assert_int_eq(try_kernel(0), 0);
    ck_assert_str_eq(kvp_cuda_last_error(), expect);
    ck_assert_uint_eq(kvp_cuda_error_count(), 1);
}
END_TEST

START_TEST(a_failure_that_is_not_a_cuda_result_keeps_its_reason)
{
    ck_assert_int_eq(fail_msg(0), KVP_EINVAL);
    ck_assert_str_eq(kvp_cuda_last_error(), at(line_msg, "kvp_cuda_vmm: size 0 cannot be mapped"));
}
END_TEST

START_TEST(clear_empties_the_record_but_not_the_count)
{
    ck_assert_int_eq(try_kernel(KVP_ENOMEM), KVP_ENOMEM);
    ck_assert_str_ne(kvp_cuda_last_error(), "");
    kvp_cuda_clear_error();
    ck_assert_str_eq(kvp_cuda_last_error(), "");
    ck_assert_uint_eq(kvp_cuda_error_count(), 1);
}
END_TEST

START_TEST(a_long_record_is_cut_and_terminated)
{
    char reason[2 * KVP_CUDA_ERR_MAX];
    memset(reason, 'x', sizeof(reason) - 1);
    reason[sizeof(reason) - 1] = '\0';
    ck_assert_int_eq(KVP_CUDA_FAIL(KVP_EINTERNAL, "long", "%s", reason), KVP_EINTERNAL);
    const char *t = kvp_cuda_last_error();
    ck_assert_uint_eq(strlen(t), KVP_CUDA_ERR_MAX - 1);
    ck_assert_int_eq(strncmp(t, THIS_FILE ":", strlen(THIS_FILE ":")), 0);
    ck_assert_int_eq(t[KVP_CUDA_ERR_MAX - 2], 'x');
}
END_TEST

/* What the second thread saw and left. */
typedef struct {
    char before[KVP_CUDA_ERR_MAX];
    char after[KVP_CUDA_ERR_MAX];
    unsigned count_before;
    int rc;
} thread_view_t;

static void *second_thread(void *arg)
{
    thread_view_t *v = arg;
    snprintf(v->before, sizeof(v->before), "%s", kvp_cuda_last_error());
    v->count_before = kvp_cuda_error_count();
    v->rc = try_kernel(KVP_ENOSPC);
    snprintf(v->after, sizeof(v->after), "%s", kvp_cuda_last_error());
    return NULL;
}

START_TEST(each_thread_sees_its_own_record)
{
    ck_assert_int_eq(try_kernel(KVP_EINVAL), KVP_EINVAL);
    char mine[KVP_CUDA_ERR_MAX];
    snprintf(mine, sizeof(mine), "%s",
             at(line_kernel, "fake_kernel(krc): invalid argument "
                             "(KVP_EINVAL)"));
    ck_assert_str_eq(kvp_cuda_last_error(), mine);

    thread_view_t v;
    memset(&v, 0, sizeof(v));
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, second_thread, &v), 0);
    ck_assert_int_eq(pthread_join(t, NULL), 0);

    /* the second thread started empty, recorded its own failure, and left ours alone */
    ck_assert_str_eq(v.before, "");
    ck_assert_uint_eq(v.count_before, 0);
    ck_assert_int_eq(v.rc, KVP_ENOSPC);
    ck_assert_str_eq(
        v.after, at(line_kernel, "fake_kernel(krc): %s (KVP_ENOSPC)", kvp_strerror(KVP_ENOSPC)));
    ck_assert_str_eq(kvp_cuda_last_error(), mine);
    ck_assert_uint_eq(kvp_cuda_error_count(), 1);
}
END_TEST

START_TEST(the_hook_gets_each_failure_once_and_notes_bypass_it)
{
    kvp_cuda_set_log_hook(hook);
    ck_assert_int_eq(try_kernel(KVP_EINVAL), KVP_EINVAL);
    ck_assert_int_eq(hook_calls, 1);
    ck_assert_str_eq(hook_text, kvp_cuda_last_error());
    /* a note (no driver: an answer, not a failure) is recorded but not handed on */
    ck_assert_int_eq(kvp__cuda_note(KVP_EUNAVAIL, "probe", "x.c", 7, "no driver"), KVP_EUNAVAIL);
    ck_assert_str_eq(kvp_cuda_last_error(), "x.c:7 probe: no driver");
    ck_assert_int_eq(hook_calls, 1);
    /* without a hook nothing is handed on, and the record still is kept */
    kvp_cuda_set_log_hook(NULL);
    ck_assert_int_eq(try_kernel(KVP_ERANGE), KVP_ERANGE);
    ck_assert_int_eq(hook_calls, 1);
    ck_assert_str_eq(kvp_cuda_last_error(), at(line_kernel, "fake_kernel(krc): %s (KVP_ERANGE)",
                                               kvp_strerror(KVP_ERANGE)));
}
END_TEST

#ifndef KVP_HAVE_CUDA
START_TEST(without_cuda_every_result_is_unavailable)
{
    ck_assert_int_eq(kvp_cuda_code(KVP_CUDA_API_RUNTIME, 0), 0);
    ck_assert_int_eq(kvp_cuda_code(KVP_CUDA_API_RUNTIME, 2), KVP_EUNAVAIL);
    ck_assert_int_eq(kvp_cuda_code(KVP_CUDA_API_DRIVER, 1), KVP_EUNAVAIL);
    ck_assert_int_eq(kvp_cuda_code(KVP_CUDA_API_NCCL, 4), KVP_EUNAVAIL);
}
END_TEST
#endif

/* ---- CUDA builds ---------------------------------------------------------------------------- */

#ifdef KVP_HAVE_CUDA

START_TEST(a_runtime_failure_records_file_line_call_and_cuda_names)
{
    int jumped = 0;
    ck_assert_int_eq(try_rt(cudaErrorInvalidValue, &jumped), KVP_EINVAL);
    ck_assert_int_eq(jumped, 1);
    ck_assert_str_eq(kvp_cuda_last_error(),
                     at(line_rt, "fake_rt(e): invalid argument (cudaErrorInvalidValue)"));
    ck_assert_int_eq(try_rt(cudaErrorMemoryAllocation, &jumped), KVP_ENOMEM);
    ck_assert_str_eq(kvp_cuda_last_error(),
                     at(line_rt, "fake_rt(e): out of memory (cudaErrorMemoryAllocation)"));
    /* success: no jump, the record stays */
    ck_assert_int_eq(try_rt(cudaSuccess, &jumped), 0);
    ck_assert_int_eq(jumped, 0);
    ck_assert_str_eq(kvp_cuda_last_error(), expect);
    ck_assert_uint_eq(kvp_cuda_error_count(), 2);
}
END_TEST

START_TEST(a_launch_check_reports_the_runtimes_last_error_once)
{
    if (cudaPeekAtLastError() == cudaSuccess) { /* a machine with a driver: nothing pending */
        ck_assert_int_eq(try_launch(), 0);
        ck_assert_str_eq(kvp_cuda_last_error(), "");
    }
    /* an invalid device leaves its error in the runtime's last-error slot, as a failed launch
     * does; without a driver every call leaves the runtime's failed initialisation there */
    cudaError_t e = cudaSetDevice(-1);
    ck_assert_int_ne(e, cudaSuccess);
    cudaError_t pending = cudaPeekAtLastError();
    ck_assert_int_ne(pending, cudaSuccess);
    ck_assert_int_eq(try_launch(), kvp_cuda_code(KVP_CUDA_API_RUNTIME, pending));
    ck_assert_str_eq(kvp_cuda_last_error(),
                     at(line_launch, "kernel launch: %s (%s)", cudaGetErrorString(pending),
                        cudaGetErrorName(pending)));
    /* reported once: the check read the slot (where the runtime is up and only the ordinal was
     * wrong; a failed initialisation stays whatever anyone reads) */
    if (e == cudaErrorInvalidDevice)
        ck_assert_int_eq(try_launch(), 0);
}
END_TEST

START_TEST(a_failed_call_does_not_reappear_as_a_launch_failure)
{
    int rc = 0;
    KVP_CUDA_TRY(cudaSetDevice(-1), rc, failed);
    ck_abort_msg("cudaSetDevice(-1) succeeded");
failed:
    ck_assert_int_ne(rc, 0);
    ck_assert_int_eq(strstr(kvp_cuda_last_error(), " cudaSetDevice(-1): ") != NULL, 1);
    /* the check cleared the runtime's slot (where the runtime is up: see above) */
    if (rc == KVP_EINVAL) /* cudaErrorInvalidDevice */
        ck_assert_int_eq(try_launch(), 0);
}
END_TEST

START_TEST(a_kernel_call_keeps_the_record_its_library_made)
{
    kvp_cuda_set_log_hook(hook);
    ck_assert_int_eq(try_kernel_with_record(), KVP_EINTERNAL);
    /* the inner record (the kernel file's line, CUDA's error), handed on once, not replaced by
     * the caller's check */
    ck_assert_str_eq(kvp_cuda_last_error(), at(line_inner,
                                               "fake_rt(cudaErrorLaunchOutOfResources): %s "
                                               "(cudaErrorLaunchOutOfResources)",
                                               cudaGetErrorString(cudaErrorLaunchOutOfResources)));
    ck_assert_int_eq(hook_calls, 1);
    ck_assert_str_eq(hook_text, expect);
    kvp_cuda_set_log_hook(NULL);
}
END_TEST

START_TEST(a_driver_failure_is_named_by_the_driver_or_said_unnamed)
{
    ck_assert_int_eq(try_drv(CUDA_ERROR_OUT_OF_MEMORY), KVP_ENOMEM);
    const kvp_cuda_drv_t *d = kvp__cuda_drv_table();
    if (!d) {
        ck_assert_str_eq(kvp_cuda_last_error(),
                         at(line_drv, "fake_drv(r): no CUDA driver to describe it (CUresult 2)"));
    } else {
        const char *name = NULL, *text = NULL;
        ck_assert_int_eq(d->cuGetErrorName(CUDA_ERROR_OUT_OF_MEMORY, &name), CUDA_SUCCESS);
        ck_assert_int_eq(d->cuGetErrorString(CUDA_ERROR_OUT_OF_MEMORY, &text), CUDA_SUCCESS);
        ck_assert_str_eq(name, "CUDA_ERROR_OUT_OF_MEMORY");
        ck_assert_str_eq(kvp_cuda_last_error(), at(line_drv, "fake_drv(r): %s (%s)", text, name));
    }
    ck_assert_int_eq(try_drv(CUDA_SUCCESS), 0);
}
END_TEST

typedef struct {
    kvp_cuda_api_t api;
    int result;
    int code;
} mapping_t;

START_TEST(cuda_results_map_onto_kvp_codes)
{
    const mapping_t m[] = {
        {KVP_CUDA_API_RUNTIME, cudaSuccess, 0},
        {KVP_CUDA_API_RUNTIME, cudaErrorNoDevice, KVP_EUNAVAIL},
        {KVP_CUDA_API_RUNTIME, cudaErrorInsufficientDriver, KVP_EUNAVAIL},
        {KVP_CUDA_API_RUNTIME, cudaErrorMemoryAllocation, KVP_ENOMEM},
        {KVP_CUDA_API_RUNTIME, cudaErrorInvalidValue, KVP_EINVAL},
        {KVP_CUDA_API_RUNTIME, cudaErrorInvalidResourceHandle, KVP_EINVAL},
        {KVP_CUDA_API_RUNTIME, cudaErrorLaunchFailure, KVP_EINTERNAL},
        {KVP_CUDA_API_RUNTIME, cudaErrorIllegalAddress, KVP_EINTERNAL},
        {KVP_CUDA_API_DRIVER, CUDA_SUCCESS, 0},
        {KVP_CUDA_API_DRIVER, CUDA_ERROR_NO_DEVICE, KVP_EUNAVAIL},
        {KVP_CUDA_API_DRIVER, CUDA_ERROR_NOT_INITIALIZED, KVP_EUNAVAIL},
        {KVP_CUDA_API_DRIVER, CUDA_ERROR_OUT_OF_MEMORY, KVP_ENOMEM},
        {KVP_CUDA_API_DRIVER, CUDA_ERROR_INVALID_HANDLE, KVP_EINVAL},
        {KVP_CUDA_API_DRIVER, CUDA_ERROR_MAP_FAILED, KVP_EINVAL},
        {KVP_CUDA_API_DRIVER, CUDA_ERROR_ILLEGAL_ADDRESS, KVP_EINTERNAL},
    };
    for (size_t i = 0; i < sizeof(m) / sizeof(m[0]); i++)
        ck_assert_msg(kvp_cuda_code(m[i].api, m[i].result) == m[i].code,
                      "api %d result %d: %s, want %s", (int)m[i].api, m[i].result,
                      kvp_errname(kvp_cuda_code(m[i].api, m[i].result)), kvp_errname(m[i].code));
    /* the macros return that code */
    int jumped;
    ck_assert_int_eq(try_rt(cudaErrorNoDevice, &jumped), KVP_EUNAVAIL);
    ck_assert_int_eq(try_drv(CUDA_ERROR_INVALID_HANDLE), KVP_EINVAL);
}
END_TEST

#endif /* KVP_HAVE_CUDA */

#ifdef KVP_HAVE_NCCL

static ncclResult_t fake_nccl(ncclResult_t r)
{
    return r;
}

static const char *fake_nccl_text(ncclResult_t r)
{
    return r == ncclInvalidArgument ? "invalid argument (run with NCCL_DEBUG=WARN for details)"
                                    : "some NCCL error";
}

/* The one member KVP_NCCL_TRY uses of server/kvp_nccl.h's table. */
typedef struct {
    const char *(*GetErrorString)(ncclResult_t);
} fake_table_t;

static int line_nccl;
static int try_nccl(const fake_table_t *n, ncclResult_t r)
{
    int rc = 0;
    line_nccl = __LINE__ + 1;
    KVP_NCCL_TRY(n, fake_nccl(r), rc, fail);
    return 0;
fail:
    return rc;
}

START_TEST(an_nccl_failure_records_the_tables_text_and_the_results_name)
{
    const fake_table_t t = {fake_nccl_text};
    ck_assert_int_eq(try_nccl(&t, ncclInvalidArgument), KVP_EINVAL);
    ck_assert_str_eq(kvp_cuda_last_error(),
                     at(line_nccl, "fake_nccl(r): invalid argument (run with NCCL_DEBUG=WARN for "
                                   "details) (ncclInvalidArgument)"));
    ck_assert_int_eq(try_nccl(&t, ncclRemoteError), KVP_EUNAVAIL);
    ck_assert_str_eq(kvp_cuda_last_error(),
                     at(line_nccl, "fake_nccl(r): some NCCL error (ncclRemoteError)"));
    /* without a table: the number and the name */
    ck_assert_int_eq(try_nccl(NULL, ncclSystemError), KVP_EUNAVAIL);
    ck_assert_str_eq(kvp_cuda_last_error(),
                     at(line_nccl, "fake_nccl(r): ncclResult 2 (ncclSystemError)"));
    /* in progress is not a failure (non-blocking communicators) */
    const unsigned n = kvp_cuda_error_count();
    ck_assert_int_eq(try_nccl(&t, ncclInProgress), 0);
    ck_assert_int_eq(try_nccl(&t, ncclSuccess), 0);
    ck_assert_uint_eq(kvp_cuda_error_count(), n);
}
END_TEST

START_TEST(nccl_results_map_onto_kvp_codes)
{
    ck_assert_int_eq(kvp_cuda_code(KVP_CUDA_API_NCCL, ncclSuccess), 0);
    ck_assert_int_eq(kvp_cuda_code(KVP_CUDA_API_NCCL, ncclInProgress), 0);
    ck_assert_int_eq(kvp_cuda_code(KVP_CUDA_API_NCCL, ncclRemoteError), KVP_EUNAVAIL);
    ck_assert_int_eq(kvp_cuda_code(KVP_CUDA_API_NCCL, ncclSystemError), KVP_EUNAVAIL);
    ck_assert_int_eq(kvp_cuda_code(KVP_CUDA_API_NCCL, ncclInvalidArgument), KVP_EINVAL);
    ck_assert_int_eq(kvp_cuda_code(KVP_CUDA_API_NCCL, ncclInvalidUsage), KVP_EINVAL);
    ck_assert_int_eq(kvp_cuda_code(KVP_CUDA_API_NCCL, ncclInternalError), KVP_EINTERNAL);
    ck_assert_int_eq(kvp_cuda_code(KVP_CUDA_API_NCCL, ncclUnhandledCudaError), KVP_EINTERNAL);
}
END_TEST

#endif /* KVP_HAVE_NCCL */

int main(void)
{
    Suite *s = suite_create("cuda_err");
    TCase *tc = tcase_create("cuda_err");
    tcase_add_test(tc, a_thread_starts_with_an_empty_record);
    tcase_add_test(tc, a_kernel_refusal_is_recorded_where_it_was_checked);
    tcase_add_test(tc, a_failure_that_is_not_a_cuda_result_keeps_its_reason);
    tcase_add_test(tc, clear_empties_the_record_but_not_the_count);
    tcase_add_test(tc, a_long_record_is_cut_and_terminated);
    tcase_add_test(tc, each_thread_sees_its_own_record);
    tcase_add_test(tc, the_hook_gets_each_failure_once_and_notes_bypass_it);
#ifndef KVP_HAVE_CUDA
    tcase_add_test(tc, without_cuda_every_result_is_unavailable);
#else
    tcase_add_test(tc, a_runtime_failure_records_file_line_call_and_cuda_names);
    tcase_add_test(tc, a_launch_check_reports_the_runtimes_last_error_once);
    tcase_add_test(tc, a_failed_call_does_not_reappear_as_a_launch_failure);
    tcase_add_test(tc, a_kernel_call_keeps_the_record_its_library_made);
    tcase_add_test(tc, a_driver_failure_is_named_by_the_driver_or_said_unnamed);
    tcase_add_test(tc, cuda_results_map_onto_kvp_codes);
#endif
#ifdef KVP_HAVE_NCCL
    tcase_add_test(tc, an_nccl_failure_records_the_tables_text_and_the_results_name);
    tcase_add_test(tc, nccl_results_map_onto_kvp_codes);
#endif
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
