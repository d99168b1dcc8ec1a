/*
 * kvp_cuda_util.c - see kvp_cuda_util.h: the logging half of the daemon's CUDA check macros.
 */
#include "kvp_cuda_util.h"

#include <stdatomic.h>

#include "kvp_log.h"

int kvp_cuda_fail_rt(cudaError_t res, const char *call, const char *file, int line)
{
    /* clear this thread's last-error slot, or the next launch check would report this one
     * again (a sticky error stays whatever we do) */
    (void)cudaGetLastError();
    kvp_log(KVP_LOG_ERR, "cuda call failed call=\"%s\" error=%s reason=\"%s\" file=%s line=%d",
            call, cudaGetErrorName(res), cudaGetErrorString(res), file, line);
    return kvp_cuda_rt_code(res);
}

int kvp_cuda_fail_drv(CUresult res, const char *call, const char *file, int line)
{
    kvp_cuda_err_t err;
    int rc = kvp_cuda_err_drv(&err, res, call, file, line);
    kvp_log(KVP_LOG_ERR, "cuda call failed reason=\"%s\"", err.msg);
    return rc;
}

int kvp_cuda_fail_err(int rc, const kvp_cuda_err_t *err, const char *doing)
{
    kvp_log(KVP_LOG_ERR, "cuda %s failed rc=%s reason=\"%s\"", doing, kvp_errname(rc), err->msg);
    return rc;
}

int kvp_cuda_fail_kernel(int rc, const char *call, const char *file, int line)
{
    /* the kernels library turns a launch error into KVP_EINTERNAL and leaves its name here */
    cudaError_t last = cudaGetLastError();
    kvp_log(KVP_LOG_ERR,
            "cuda kernel call failed call=\"%s\" rc=%s launch_error=%s file=%s line=%d", call,
            kvp_errname(rc), cudaGetErrorName(last), file, line);
    return rc;
}

/* logged once per process: the answer never changes */
static atomic_int unavailable_logged;

int kvp_cuda_driver(const kvp_cuda_drv_t **out)
{
    kvp_cuda_err_t err;
    int rc = kvp_cuda_drv_get(out, &err);
    if (rc && !atomic_exchange(&unavailable_logged, 1))
        kvp_log(KVP_LOG_INFO, "cuda unavailable reason=\"%s\"", err.msg);
    return rc;
}
