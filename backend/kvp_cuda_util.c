/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_cuda_util.c - see kvp_cuda_util.h: kvp_log as the CUDA layer's log hook, and the driver
 * table with its unavailability logged once.
 */
#include "kvp_cuda_util.h"

#include <pthread.h>
#include <stdatomic.h>

#include "kvp_log.h"

static void log_failure(const char *text)
{
    kvp_log(KVP_LOG_ERR, "cuda call failed error=\"%s\"", text);
}

static pthread_once_t hook_once = PTHREAD_ONCE_INIT;

static void install_once(void)
{
    kvp_cuda_set_log_hook(log_failure);
}

void kvp_cuda_log_install(void)
{
    pthread_once(&hook_once, install_once);
}

/* logged once per process: the answer never changes */
static atomic_int unavailable_logged;

int kvp_cuda_driver(const kvp_cuda_drv_t **out)
{
    kvp_cuda_log_install();
    int rc = kvp_cuda_drv_get(out);
    if (rc && !atomic_exchange(&unavailable_logged, 1))
        kvp_log(KVP_LOG_INFO, "cuda unavailable reason=\"%s\"", kvp_cuda_last_error());
    return rc;
}
