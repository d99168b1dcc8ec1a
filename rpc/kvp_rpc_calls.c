/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc_calls.c - the call table: one row per call of kvpool.proto, naming its handler and
 * the facts dispatch, the Hello and fd rules, the retry window and the metrics labels read
 * (kvp_rpc_internal.h, KVP_CALL_*). Adding a call is a row here, a handler, the message in
 * kvpool.proto and the client's function (docs/ARCHITECTURE.md).
 */
#include "kvp_rpc_internal.h"

/* A row: the call's body member (its tags, name and response size follow from it), its
 * handler, spelled out so a search for the name finds the row, and its flags. */
#define ROW(call, handler, flags)                                                                  \
    {                                                                                              \
        kvpool_Request_##call##_tag, kvpool_Response_##call##_tag, #call, (flags),                 \
            (uint32_t)sizeof(((kvpool_Response *)0)->body.call), (handler)                         \
    }

/* One row per call. MUTATING without PER_CONN: the request id is deduplicated in the
 * namespace (kvpool.proto, Idempotency). OBSERVER: read-only, what an observer may call. */
const kvp_rpc_call_t kvp__rpc_calls[] = {
    {0, 0, "invalid", 0, 0, NULL},
    ROW(hello, kvp__rpc_hello, KVP_CALL_BEFORE_HELLO),
    ROW(ping, kvp__rpc_ping, KVP_CALL_BEFORE_HELLO | KVP_CALL_WHEN_UNHEALTHY | KVP_CALL_OBSERVER),
    ROW(pool_info, kvp__rpc_pool_info, KVP_CALL_OBSERVER),
    ROW(register_buffer, kvp__rpc_register_buffer,
        KVP_CALL_MUTATING | KVP_CALL_PER_CONN | KVP_CALL_TAKES_FDS),
    ROW(unregister_buffer, kvp__rpc_unregister_buffer, KVP_CALL_MUTATING | KVP_CALL_PER_CONN),
    ROW(append, kvp__rpc_append, KVP_CALL_MUTATING | KVP_CALL_OFF_LOOP),
    ROW(reserve, kvp__rpc_reserve, KVP_CALL_MUTATING | KVP_CALL_OFF_LOOP),
    ROW(fork, kvp__rpc_fork, KVP_CALL_MUTATING),
    ROW(truncate, kvp__rpc_truncate, KVP_CALL_MUTATING),
    ROW(release, kvp__rpc_release, KVP_CALL_MUTATING),
    ROW(get_page_table, kvp__rpc_get_page_table, 0),
    ROW(stats, kvp__rpc_stats, KVP_CALL_OBSERVER),
    ROW(list_sequences, kvp__rpc_list_sequences, KVP_CALL_OBSERVER),
    ROW(list_clients, kvp__rpc_list_clients, KVP_CALL_OBSERVER),
    ROW(audit, kvp__rpc_audit, KVP_CALL_OBSERVER),
    ROW(metrics, kvp__rpc_metrics, KVP_CALL_OBSERVER),
    ROW(export_begin, kvp__rpc_export_begin, KVP_CALL_MUTATING),
    ROW(import, kvp__rpc_import, KVP_CALL_MUTATING | KVP_CALL_OFF_LOOP),
    ROW(list_transfers, kvp__rpc_list_transfers, KVP_CALL_OBSERVER),
    ROW(commit, kvp__rpc_commit, KVP_CALL_MUTATING),
    ROW(lookup, kvp__rpc_lookup, 0),
    ROW(pin, kvp__rpc_pin, KVP_CALL_MUTATING),
    ROW(unpin, kvp__rpc_unpin, KVP_CALL_MUTATING),
    ROW(cache_flush, kvp__rpc_cache_flush, KVP_CALL_MUTATING),
    ROW(load, kvp__rpc_load, KVP_CALL_MUTATING | KVP_CALL_OFF_LOOP),
    ROW(cache_dump, kvp__rpc_cache_dump, KVP_CALL_OBSERVER),
};
#define NUM_CALLS (sizeof(kvp__rpc_calls) / sizeof(kvp__rpc_calls[0]))
_Static_assert(NUM_CALLS <= KVP_METRICS_MAX_CALLS, "raise KVP_METRICS_MAX_CALLS");
/* The backends name the wire's enums with their own (kvp_backend.h): the same values. */
_Static_assert((int)KVP_BACKEND_HOST == (int)kvpool_BackendKind_BACKEND_HOST &&
                   (int)KVP_BACKEND_CUDA == (int)kvpool_BackendKind_BACKEND_CUDA,
               "kvp_backend_kind_t != BackendKind");
_Static_assert((int)KVP_BUFFER_MEMFD == (int)kvpool_BufferKind_BUFFER_MEMFD &&
                   (int)KVP_BUFFER_CUDA_VMM_FD == (int)kvpool_BufferKind_BUFFER_CUDA_VMM_FD &&
                   (int)KVP_BUFFER_CUDA_IPC == (int)kvpool_BufferKind_BUFFER_CUDA_IPC,
               "kvp_buffer_kind_t != BufferKind");
_Static_assert((int)KVP_SYNC_NONE == (int)kvpool_SyncMode_SYNC_NONE &&
                   (int)KVP_SYNC_EVENT == (int)kvpool_SyncMode_SYNC_EVENT,
               "kvp_sync_mode_t != SyncMode");
const unsigned kvp__rpc_num_calls = NUM_CALLS;
