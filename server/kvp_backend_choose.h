/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_backend_choose.h - kvpoold's choice of backend from its configuration ([pool] backend):
 * the one place the configuration meets the backends, which know nothing of the config file.
 */
#ifndef KVP_BACKEND_CHOOSE_H
#define KVP_BACKEND_CHOOSE_H

#include <stddef.h>

#include "kvp_backend.h"
#include "kvp_config.h"

/* Creates the backend cfg asks for (cfg validated): pool.backend = cuda -> the cuda backend on
 * pool.devices with tuning (NULL: the defaults; an error when unavailable); host -> the host
 * backend (one device only); auto -> cuda when kvp_backend_cuda_probe() says a GPU is usable,
 * else host. Returns 0 or a code with a one-line reason in err (err_len bytes). Loop thread, at
 * start. */
int kvp_backend_choose(const kvp_config_t *cfg, const kvp_backend_tuning_t *tuning,
                       kvp_backend_t **out, char *err, size_t err_len);

#endif
