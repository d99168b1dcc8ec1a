/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_server_limits.h - the transport's reloadable [server] keys as rows, as
 * rpc/kvp_rpc_limits.h does for the rpc layer's: each row gives the field of kvp_server_config_t
 * and of the daemon's configuration, the settings row that parses, checks and documents it
 * (server/kvp_config.c includes this list), and the copies kvpoold makes at start and on a
 * reload (KVP_SERVER_LIMITS_COPY; kvp_server_set_limits copies every row). So a new reloadable
 * transport knob is a row here plus the code in kvp_server.c that reads s->cfg.<field>.
 *
 * X(section, key, field, type, default, min, max, reload, doc): as in kvp_rpc_limits.h; every
 * row here is RELOAD (a key that needs a restart stays a plain row of the settings table).
 */
#ifndef KVP_SERVER_LIMITS_H
#define KVP_SERVER_LIMITS_H

#include <stdint.h>

#include "kvp_rpc_limits.h" /* the row types and the field macro */

/* clang-format off */
#define KVP_SERVER_LIMITS_KEYS(X) \
    X(server, max_connections, max_connections, U32, 256, 1, 1u << 20, RELOAD, \
      "Connections served at once; more are refused (1..1048576).") \
    X(server, max_queued_bytes, max_queued_bytes, SIZE, 64ull << 20, 4096, 16ull << 30, RELOAD, \
      "Unsent answers queued for one client before it is dropped (>= max_frame_bytes, up to 16 " \
      "GiB).") \
    X(server, max_buffered_bytes, max_buffered_bytes, SIZE, 256ull << 20, 0, 64ull << 30, RELOAD, \
      "Memory all connections together may hold: read buffers and unsent answers (0: no budget, " \
      "else >= max_frame_bytes, up to 64 GiB). Each connection always gets 64 KiB to read into; " \
      "beyond that a connection is not read (it waits, losing nothing) while the budget is " \
      "spent, and one with unsent answers is not processed. Besides it, a connection with 1 MiB " \
      "of answers unsent is not read until its client reads them.") \
    X(server, uid_max_connections, uid_max_connections, U32, 128, 0, 1u << 20, RELOAD, \
      "Connections one uid may hold (0: no limit); the daemon's own uid and root are exempt. A " \
      "uid at its limit gets RESOURCE_EXHAUSTED and that connection is closed.") \
    X(server, hello_timeout_ms, hello_timeout_ms, U32, 10000, 0, 3600000, RELOAD, \
      "A connection that has not completed Hello this long after it connected is answered " \
      "DEADLINE_EXCEEDED and closed (0: off).") \
    X(server, frame_timeout_ms, frame_timeout_ms, U32, 10000, 0, 3600000, RELOAD, \
      "A frame begun and not completed within this long (counted while the daemon reads the " \
      "connection) closes the connection, with an answer; fds sent with it go too (0: off).") \
    X(server, drain_timeout_ms, drain_timeout_ms, U32, 10000, 0, 3600000, RELOAD, \
      "On SIGTERM, how long in-flight requests may take before the daemon exits (0..3600000 " \
      "ms). Keep it below the unit's TimeoutStopSec.")
/* clang-format on */

#define KVP__SERVER_LIMIT_COPY(sec, key, field, type, def, min, max, reload, doc)                  \
    dst_->field = src_->field;
/* Every row's field from *src to *dst (any two structs holding the rows' fields). */
#define KVP_SERVER_LIMITS_COPY(dst, src)                                                           \
    do {                                                                                           \
        __typeof__(dst) dst_ = (dst);                                                              \
        __typeof__(src) src_ = (src);                                                              \
        KVP_SERVER_LIMITS_KEYS(KVP__SERVER_LIMIT_COPY)                                             \
    } while (0)

#endif
