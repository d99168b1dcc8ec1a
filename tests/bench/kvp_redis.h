/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_redis.h - the benchmarks' yardstick: a redis-server on a Unix socket in a private
 * directory, and a minimal RESP client that times PING (-> +PONG) the way the benchmarks time
 * their own calls. Used by bench_rpc and bench_prefix; Redis runs only when
 * /usr/bin/redis-server is installed.
 */
#ifndef KVP_REDIS_H
#define KVP_REDIS_H

#include <stddef.h>
#include <sys/types.h>

/* Starts redis-server with its socket at <dir>/redis.sock (written to sock[len]) and waits up
 * to 5 s for it to accept. Returns its pid, or -1 (not installed, or it did not come up). */
pid_t kvp_redis_start(const char *dir, char *sock, size_t len);

/* A connection to the socket at path, or -1. */
int kvp_redis_connect(const char *path);

/* One PING round trip on fd: 0 when +PONG came back, -1 otherwise. */
int kvp_redis_ping(int fd);

#endif
