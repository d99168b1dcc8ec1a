/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_limits.h - the limits that several layers must agree on, defined once. Headers that are
 * installed on their own (client/kvpool.h) restate a value and the code behind them asserts at
 * compile time that it is this one.
 */
#ifndef KVP_LIMITS_H
#define KVP_LIMITS_H

/* Devices of one pool (the tensor-parallel group size G). The pool is handed to a worker as
 * one fd per device on one frame, and a frame carries at most KVP_MAX_FDS_PER_FRAME (16)
 * descriptors, so that is the bound: the geometry, the configuration, the wire's device list
 * and the client's tables all use it. */
#define KVP_MAX_DEVICES 16u

#endif
