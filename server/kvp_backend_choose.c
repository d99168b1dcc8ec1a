/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_choose.c - which backend kvpoold serves from ([pool] backend in kvp_config.h):
 * cuda on the configured devices, host, or auto (cuda when a GPU is usable, host otherwise).
 * Only the choice and its error messages live here; the backends build themselves. An explicit
 * cuda that cannot be had is an error, never a silent fall-back to host memory.
 */
#include <stdio.h>

#include "kvp_backend_choose.h"
#include "kvp_error.h"
#include "kvp_log.h"

static int choose_host(const kvp_geom_t *g, kvp_backend_t **out, char *err, size_t err_len)
{
    if (g->num_devices > 1) {
        snprintf(err, err_len, "pool.devices: the host backend serves one device, got %u",
                 g->num_devices);
        return KVP_EINVAL;
    }
    int rc = kvp_backend_host_create(g, out);
    if (rc)
        snprintf(err, err_len, "cannot create the host pool: %s", kvp_strerror(rc));
    return rc;
}

static int choose_cuda(const kvp_config_t *cfg, const kvp_geom_t *g,
                       const kvp_backend_tuning_t *tuning, const char *why, kvp_backend_t **out,
                       char *err, size_t err_len)
{
    int devices[KVP_CONFIG_MAX_IDS];
    char list[KVP_CONFIG_MAX_IDS * 6] = "";
    size_t len = 0;
    for (uint32_t i = 0; i < cfg->devices.count && i < KVP_CONFIG_MAX_IDS; i++) {
        devices[i] = (int)cfg->devices.ids[i];
        int n = snprintf(list + len, sizeof(list) - len, "%s%u", i ? "," : "", cfg->devices.ids[i]);
        if (n > 0 && (size_t)n < sizeof(list) - len)
            len += (size_t)n;
    }
    int rc = kvp_backend_cuda_create(g, devices, (int)cfg->devices.count, tuning, out);
    if (rc) {
        snprintf(err, err_len, "pool.backend=%s: cannot create the cuda pool on devices %s: %s",
                 why, list,
                 rc == KVP_EUNAVAIL ? "no usable CUDA driver or GPU, or a build without CUDA (the "
                                      "log line before says which)"
                                    : kvp_strerror(rc));
        return rc;
    }
    return 0;
}

int kvp_backend_choose(const kvp_config_t *cfg, const kvp_backend_tuning_t *tuning,
                       kvp_backend_t **out, char *err, size_t err_len)
{
    char scratch[8];
    if (!err || !err_len) {
        err = scratch;
        err_len = sizeof(scratch);
    }
    err[0] = '\0';
    if (!cfg || !out) {
        snprintf(err, err_len, "kvp_backend_choose: NULL argument");
        return KVP_EINVAL;
    }
    kvp_geom_t g;
    kvp_config_geom(cfg, &g);
    switch (cfg->backend) {
    case KVP_CONFIG_BACKEND_CUDA:
        return choose_cuda(cfg, &g, tuning, "cuda", out, err, err_len);
    case KVP_CONFIG_BACKEND_HOST:
        return choose_host(&g, out, err, err_len);
    case KVP_CONFIG_BACKEND_AUTO:
        if (kvp_backend_cuda_probe()) {
            kvp_log(KVP_LOG_INFO, "backend chosen backend=cuda reason=\"auto: a GPU is usable\"");
            return choose_cuda(cfg, &g, tuning, "auto", out, err, err_len);
        }
        kvp_log(KVP_LOG_INFO, "backend chosen backend=host reason=\"auto: no usable GPU\"");
        return choose_host(&g, out, err, err_len);
    default:
        snprintf(err, err_len, "pool.backend: unknown value %d", (int)cfg->backend);
        return KVP_EINVAL;
    }
}
