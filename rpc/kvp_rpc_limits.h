/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_rpc_limits.h - the rpc layer's limits as rows: the [limits], [transfer] and [cache] keys of
 * kvpoold.conf, each with its field, type, default, bounds, reload rule and documentation.
 * One list feeds the fields of kvp_rpc_limits_t (kvp_rpc.h) and of the daemon's configuration,
 * the settings table that parses and checks them (server/kvp_config.c includes this file),
 * kvpoold.conf(5) and the example deploy/kvpoold.conf (generated from that table at build
 * time), the copy from the configuration to the rpc layer and the copy a reload makes
 * (kvp_rpc_set_limits). So a new limit is a row here plus the code that reads r->lim.<field>.
 * Plain macros and no includes beyond stdint: the configuration includes it, and the rpc
 * layer includes nothing of the server's.
 *
 * X(section, key, field, type, default, min, max, reload, doc):
 *   type     U32 (uint32_t) or SIZE (uint64_t, a byte count; the file takes K, M, G, T)
 *   default  the value a key left out takes; also what kvp_rpc_create gives a field left 0
 *            when 0 is below the row's minimum (callers that fill the struct by hand)
 *   reload   RELOAD: a SIGHUP applies it (kvp_rpc_set_limits copies it); RESTART: it sizes
 *            something made once, a reload keeps the running value and says so
 *   doc      the key's paragraph in kvpoold.conf(5), scdoc markup (*bold*, _italic_); the
 *            reload rule and the default are added by the generator
 */
#ifndef KVP_RPC_LIMITS_H
#define KVP_RPC_LIMITS_H

#include <stdint.h>

/* clang-format off */
#define KVP_RPC_LIMITS_KEYS(X) \
    X(limits, max_seqs, max_seqs, U32, 65536, 1, 1u << 26, RESTART, \
      "Live sequences over all namespaces (1..67108864).") \
    X(limits, max_namespaces, max_namespaces, U32, 256, 1, 1u << 20, RESTART, \
      "Namespaces (engines) at once (1..1048576).") \
    X(limits, max_batch, max_batch, U32, 4096, 1, 1u << 20, RESTART, \
      "Sequences in one Append or Reserve (1..1048576).") \
    X(limits, max_batch_tokens, max_batch_tokens, U32, 1048576, 1, INT32_MAX, RELOAD, \
      "Tokens in one Append or Reserve (1..2147483647).") \
    X(limits, max_seq_tokens, max_seq_tokens, U32, 0, 0, INT32_MAX, RESTART, \
      "Tokens of one sequence; 0: the pool's capacity.") \
    X(limits, max_buffers_per_client, max_buffers_per_client, U32, 64, 1, 65536, RESTART, \
      "Registered buffers of one connection (1..65536).") \
    X(limits, max_buffer_bytes, max_buffer_bytes, SIZE, 64ull << 30, 1, 1ull << 50, RELOAD, \
      "Size of one registered buffer (up to 2^50).") \
    X(limits, dedup_window, dedup_window, U32, 1024, 1, 1u << 20, RESTART, \
      "Request ids remembered per namespace so that a retried call is applied once (1..1048576).") \
    X(limits, dedup_ns_max_bytes, dedup_ns_max_bytes, SIZE, 8ull << 20, 4096, 1ull << 40, RELOAD, \
      "Bytes of answers one namespace's retry window keeps (the oldest gives way; its id is then " \
      "refused as applied but not kept).") \
    X(limits, dedup_max_bytes, dedup_max_bytes, SIZE, 64ull << 20, 4096, 1ull << 40, RELOAD, \
      "The same over all namespaces: bounds the daemon's retry memory.") \
    X(limits, default_lease_ms, default_lease_ms, U32, 30000, 0, UINT32_MAX, RELOAD, \
      "Lease of a namespace whose client names none: how long its sequences outlive its last " \
      "session (ms; 0 releases at once).") \
    X(limits, max_lease_ms, max_lease_ms, U32, 86400000, 0, UINT32_MAX, RELOAD, \
      "Largest lease a client may ask for (>= default_lease_ms).") \
    X(limits, ns_max_seqs, ns_max_seqs, U32, 0, 0, 1u << 26, RELOAD, \
      "Live sequences of one namespace (0..67108864).") \
    X(limits, ns_max_pages, ns_max_pages, U32, 0, 0, UINT32_MAX, RELOAD, \
      "Page references of one namespace: a page shared by k of its sequences counts k times " \
      "(0..2^32-1).") \
    X(limits, ns_max_buffer_bytes, ns_max_buffer_bytes, SIZE, 0, 0, 1ull << 50, RELOAD, \
      "Bytes of the buffers registered by all connections of one namespace together (0..2^50).") \
    X(limits, ns_max_connections, ns_max_connections, U32, 0, 0, 1u << 20, RELOAD, \
      "Connections attached to one namespace at once; a Hello above it is refused (0..1048576).") \
    X(limits, uid_max_namespaces, uid_max_namespaces, U32, 32, 0, 1u << 20, RELOAD, \
      "Namespaces one uid owns (a Hello creating one more is refused; 0..1048576).") \
    X(limits, uid_max_idle_namespaces, uid_max_idle_namespaces, U32, 8, 0, 1u << 20, RELOAD, \
      "Of the namespaces one uid owns, those with no session (a lease pending): beyond it the " \
      "one whose lease ends first is released at once, so lapsed sessions cannot hold the " \
      "namespace table for a day.") \
    X(limits, uid_max_seqs, uid_max_seqs, U32, 16384, 0, 1u << 26, RELOAD, \
      "Live sequences over all the namespaces one uid owns (0..67108864).") \
    X(limits, max_cache_scopes, max_cache_scopes, U32, 256, 1, 1u << 20, RESTART, \
      "Prefix-cache scopes known at once: each namespace's private one and each name a Hello " \
      "gives; one no namespace is in and whose pages nobody holds is reused (1..1048576).") \
    X(limits, max_pins, max_pins, U32, 1024, 1, 65535, RESTART, \
      "Prefix-cache pins alive at once over the daemon (1..65535). A pin holds pages against " \
      "eviction, so pins are shared out: a Pin above any of the limits below is " \
      "RESOURCE_EXHAUSTED naming the one it hit, pinned pages also count against *ns_max_pages*, " \
      "and a namespace kept only for its pins counts as an idle namespace of its uid " \
      "(*uid_max_idle_namespaces*). Root and the daemon's uid are exempt from the uid limits.") \
    X(limits, ns_max_pins, ns_max_pins, U32, 64, 0, 65535, RELOAD, \
      "Pins of one namespace (0..65535; 0: no limit).") \
    X(limits, uid_max_pins, uid_max_pins, U32, 256, 0, 65535, RELOAD, \
      "Pins over all the namespaces one uid owns (0..65535; 0: no limit).") \
    X(limits, ns_max_pinned_pages, ns_max_pinned_pages, U32, 0, 0, UINT32_MAX, RELOAD, \
      "Pages one namespace may keep pinned (a page in two pins counts twice). 0: derived from " \
      "the pool, num_pages / 8 (at least 1); set num_pages or more for no limit.") \
    X(limits, uid_max_pinned_pages, uid_max_pinned_pages, U32, 0, 0, UINT32_MAX, RELOAD, \
      "The same over all the namespaces of one uid; 0: num_pages / 4 (at least 1).") \
    X(limits, ns_max_priority, ns_max_priority, U32, 50, 0, 100, RELOAD, \
      "Highest retention priority (CacheOptions.priority) a client that is not an operator may " \
      "give; above it a Reserve or Append is PERMISSION_DENIED. Eviction is daemon-wide, lowest " \
      "priority first, so a tenant's priority ranks its cached pages against every other " \
      "tenant's: the range above this is the operators' (0..100).") \
    X(limits, pin_max_ttl_ms, pin_max_ttl_ms, U32, 86400000, 1, UINT32_MAX, RELOAD, \
      "Longest pin in ms; a Pin asking more gets this.") \
    X(limits, max_lookup_tokens, max_lookup_tokens, U32, 0, 0, INT32_MAX, RELOAD, \
      "Tokens one Lookup or Pin may carry: the work one call does on the event loop, where every " \
      "other client waits behind it. 0: 16384 pages' worth (16384 x page_size tokens, at most " \
      "1048576): about 1 ms of the loop (0..2^31-1).")

/* [transfer]: KV transfers between daemons (xfer/kvp_xfer.h); fields transfer_<key>. */
#define KVP_RPC_TRANSFER_KEYS(X) \
    X(transfer, timeout_ms, transfer_timeout_ms, U32, 30000, 1, 3600000, RELOAD, \
      "Longest time one transfer may take, the peer's join included, when the request names none " \
      "(ms, 1..3600000).") \
    X(transfer, comm_idle_ms, transfer_comm_idle_ms, U32, 300000, 1000, UINT32_MAX, RELOAD, \
      "A cached NCCL communicator unused this long is destroyed (ms, >= 1000).") \
    X(transfer, max_in_flight, transfer_max_in_flight, U32, 2, 1, 64, RESTART, \
      "Transfers running at once, exports and imports together (1..64); each holds a worker " \
      "thread while it runs.") \
    X(transfer, chunk_bytes, transfer_chunk_bytes, U32, 0, 0, 1073741824, RELOAD, \
      "The largest staging chunk of an export, in bytes (0..1073741824, rounded up to 256): the " \
      "stream is packed, sent, received and unpacked in chunks, two per side in flight, so pack " \
      "and unpack overlap NCCL's send; chunks ramp up from an eighth of this and down to 4 MiB " \
      "at the end. The importer stages in the exporter's chunks (two chunks of device memory per " \
      "communicator on each side). Larger chunks run closer to NCCL's rate (measured on 2 x " \
      "H200: 0.51 of it with 16 MiB chunks, 0.68 with 256 MiB, one sequence at a time). 0: a " \
      "quarter of the stream, within 4..256 MiB.")

/* [cache]: the prefix cache's host tier (issue #28); fields cache_<key>. */
#define KVP_RPC_CACHE_KEYS(X) \
    X(cache, host_bytes, cache_host_bytes, SIZE, 0, 0, 1ull << 50, RELOAD, \
      "Bytes of host memory for the prefix cache's second tier (0: none). A cached page that " \
      "would leave the GPU pool is copied there (every layer, K and V) by a background demoter " \
      "and restored on a hit: a Lookup reports those tokens as host_tokens, and a Reserve, " \
      "Append or Load with reuse restores them before it answers. The memory is allocated and " \
      "pinned (cuda backend) in chunks of host_chunk_bytes by a thread of its own: the daemon " \
      "serves before the whole tier is ready, and *kvpoolctl status* shows how much is. The host " \
      "backend keeps it in a second memfd. A reload may lower it (the entries beyond go, " \
      "for good) but not raise it above the value the daemon started with.") \
    X(cache, host_chunk_bytes, cache_host_chunk_bytes, SIZE, 128ull << 20, 1 << 20, 1ull << 40, RESTART, \
      "The host tier is allocated and pinned this much at a time (1 MiB..1 TiB). Each " \
      "cudaHostRegister call holds up other threads' CUDA calls, a decode step's included, for " \
      "about 28 us per MiB (measured on an H200 host): 128 MiB chunks cost a step at most about " \
      "3 ms, once per chunk, where 1 GiB chunks cost 30 ms; smaller chunks also pinned faster " \
      "there (7.4 GB/s at 128 MiB, 4.4 GB/s at 1 GiB).") \
    X(cache, demote_free_pct, cache_demote_free_pct, U32, 5, 0, 50, RELOAD, \
      "With a host tier, the demoter keeps this percentage of the pool's pages free by moving " \
      "the least valuable cached pages to host memory ahead of need, so an allocation finds free " \
      "pages and never waits for a copy (0..50). An allocation beyond what is free evicts cached " \
      "pages without demoting them.") \
    X(cache, demote_batch_pages, cache_demote_batch_pages, U32, 64, 1, 65536, RELOAD, \
      "Pages one demotion copies at once (1..65536); several batches may be in flight.")

/* clang-format on */

/* The C type of a row's field. */
#define KVP_RPC_LIMIT_CTYPE_U32  uint32_t
#define KVP_RPC_LIMIT_CTYPE_SIZE uint64_t
#define KVP_RPC_LIMIT_FIELD(sec, key, field, type, def, min, max, reload, doc)                     \
    KVP_RPC_LIMIT_CTYPE_##type field;

/* 1 for a RELOAD row, 0 for a RESTART row. */
#define KVP_RPC_LIMIT_RELOADABLE_RELOAD  1
#define KVP_RPC_LIMIT_RELOADABLE_RESTART 0
#define KVP_RPC_LIMIT_RELOADABLE(reload) KVP_RPC_LIMIT_RELOADABLE_##reload

/* Every row's field from *src to *dst (any two structs holding the rows' fields). */
#define KVP__RPC_LIMIT_COPY(sec, key, field, type, def, min, max, reload, doc)                     \
    dst_->field = src_->field;
#define KVP_RPC_LIMITS_COPY(dst, src)                                                              \
    do {                                                                                           \
        __typeof__(dst) dst_ = (dst);                                                              \
        __typeof__(src) src_ = (src);                                                              \
        KVP_RPC_LIMITS_KEYS(KVP__RPC_LIMIT_COPY)                                                   \
        KVP_RPC_TRANSFER_KEYS(KVP__RPC_LIMIT_COPY)                                                 \
        KVP_RPC_CACHE_KEYS(KVP__RPC_LIMIT_COPY)                                                    \
    } while (0)

#endif
