/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_client_xfer.c - libkvpool's calls for moving sequences between daemons (kvpool.h,
 * "transfers between daemons"): ExportBegin of one sequence or a set, Import of its ticket,
 * ListTransfers. It turns tickets into requests and answers back into tickets; the daemons move
 * the data over NCCL, and nothing here touches a GPU. The round trip is kvp_client.c's.
 */
#include <stdio.h>
#include <string.h>

#include "kvp_client_internal.h"
#include "kvp_wire.h"
#include "kvpool.h"

static int export_begin(kvp_client_t *c, uint64_t seq_id, const uint64_t *seq_ids, uint32_t n,
                        const char *peer, uint32_t timeout_ms, kvp_transfer_ticket_t *ticket)
{
    if (!c)
        return KVP_EINVAL;
    if (!peer || !ticket || strlen(peer) >= sizeof(((kvpool_ExportBeginRequest *)0)->peer))
        return kvp__client_fail(c, KVP_EINVAL,
                                "export_begin: NULL ticket, or peer NULL or over %zu bytes",
                                sizeof(((kvpool_ExportBeginRequest *)0)->peer) - 1);
    if (seq_ids && (n == 0 || n > KVP_TRANSFER_MAX_SEQS))
        return kvp__client_fail(c, KVP_EINVAL, "export_begin: a set of %u sequences (1..%d)", n,
                                KVP_TRANSFER_MAX_SEQS);
    kvpool_ExportBeginRequest *q =
        &kvp__client_request(c, kvpool_Request_export_begin_tag)->body.export_begin;
    q->seq_id = seq_id;
    if (seq_ids) {
        q->seq_ids_count = n;
        memcpy(q->seq_ids, seq_ids, (size_t)n * sizeof(uint64_t));
    }
    snprintf(q->peer, sizeof(q->peer), "%s", peer);
    q->timeout_ms = timeout_ms;
    int rc = kvp__client_call(c, kvpool_Response_export_begin_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    const kvpool_ExportBeginResponse *r = &kvp__client_response(c)->body.export_begin;
    if (r->nccl_id.size != KVP_TRANSFER_ID_BYTES)
        return kvp__client_fail(c, KVP_EPROTO, "export_begin: nccl_id of %u bytes",
                                (unsigned)r->nccl_id.size);
    if (r->seq_tokens_count != (seq_ids ? n : 1))
        return kvp__client_fail(c, KVP_EPROTO, "export_begin: %u token counts for %u sequences",
                                (unsigned)r->seq_tokens_count, seq_ids ? n : 1);
    memcpy(ticket->nccl_id, r->nccl_id.bytes, KVP_TRANSFER_ID_BYTES);
    ticket->transfer_id = r->transfer_id;
    ticket->num_tokens = r->num_tokens;
    ticket->num_layers = r->num_layers;
    ticket->bytes = r->bytes;
    ticket->num_seqs = r->seq_tokens_count;
    ticket->chunk_bytes = r->chunk_bytes;
    ticket->flags = r->flags;
    memcpy(ticket->seq_tokens, r->seq_tokens, r->seq_tokens_count * sizeof(uint32_t));
    return 0;
}

int kvp_client_export_begin(kvp_client_t *c, uint64_t seq_id, const char *peer, uint32_t timeout_ms,
                            kvp_transfer_ticket_t *ticket)
{
    return export_begin(c, seq_id, NULL, 0, peer, timeout_ms, ticket);
}

int kvp_client_export_begin_set(kvp_client_t *c, const uint64_t *seq_ids, uint32_t n,
                                const char *peer, uint32_t timeout_ms,
                                kvp_transfer_ticket_t *ticket)
{
    if (c && !seq_ids)
        return kvp__client_fail(c, KVP_EINVAL, "export_begin_set: NULL seq_ids");
    return export_begin(c, 0, seq_ids, n, peer, timeout_ms, ticket);
}

static int import(kvp_client_t *c, const kvp_transfer_ticket_t *ticket, uint64_t seq_id,
                  const uint64_t *seq_ids, uint32_t timeout_ms, uint32_t *num_pages)
{
    if (!c)
        return KVP_EINVAL;
    if (!ticket)
        return kvp__client_fail(c, KVP_EINVAL, "import: NULL ticket");
    if (ticket->num_seqs == 0 || ticket->num_seqs > KVP_TRANSFER_MAX_SEQS ||
        (!seq_ids && ticket->num_seqs != 1))
        return kvp__client_fail(c, KVP_EINVAL, "import: the ticket names %u sequences%s",
                                ticket->num_seqs, seq_ids ? "" : " (a set: kvp_client_import_set)");
    kvpool_ImportRequest *q = &kvp__client_request(c, kvpool_Request_import_tag)->body.import;
    memcpy(q->nccl_id.bytes, ticket->nccl_id, KVP_TRANSFER_ID_BYTES);
    q->nccl_id.size = KVP_TRANSFER_ID_BYTES;
    q->transfer_id = ticket->transfer_id;
    q->seq_id = seq_id;
    if (seq_ids) {
        q->seq_ids_count = ticket->num_seqs;
        memcpy(q->seq_ids, seq_ids, ticket->num_seqs * sizeof(uint64_t));
        q->seq_tokens_count = ticket->num_seqs;
        memcpy(q->seq_tokens, ticket->seq_tokens, ticket->num_seqs * sizeof(uint32_t));
    }
    q->num_tokens = ticket->num_tokens;
    q->num_layers = ticket->num_layers;
    q->bytes = ticket->bytes;
    q->chunk_bytes = ticket->chunk_bytes;
    q->flags = ticket->flags;
    q->timeout_ms = timeout_ms;
    /* the daemon answers when the transfer ends: wait for its deadline, then ours */
    const uint32_t saved = kvp__client_timeout_ms(c);
    uint64_t wait = (uint64_t)saved + (timeout_ms ? timeout_ms : 3600000u);
    kvp__client_set_timeout_ms(c, wait > UINT32_MAX ? UINT32_MAX : (uint32_t)wait);
    int rc = kvp__client_call(c, kvpool_Response_import_tag, NULL, NULL, 0);
    kvp__client_set_timeout_ms(c, saved);
    if (rc)
        return rc;
    if (num_pages)
        *num_pages = kvp__client_response(c)->body.import.num_pages;
    return 0;
}

int kvp_client_import(kvp_client_t *c, const kvp_transfer_ticket_t *ticket, uint64_t seq_id,
                      uint32_t timeout_ms, uint32_t *num_pages)
{
    return import(c, ticket, seq_id, NULL, timeout_ms, num_pages);
}

int kvp_client_import_set(kvp_client_t *c, const kvp_transfer_ticket_t *ticket,
                          const uint64_t *seq_ids, uint32_t timeout_ms, uint32_t *num_pages)
{
    if (c && !seq_ids)
        return kvp__client_fail(c, KVP_EINVAL, "import_set: NULL seq_ids");
    return import(c, ticket, 0, seq_ids, timeout_ms, num_pages);
}

int kvp_client_list_transfers(kvp_client_t *c, kvp_transfer_info_t *out, uint32_t max, uint32_t *n)
{
    if (!c)
        return KVP_EINVAL;
    if ((!out && max) || !n)
        return kvp__client_fail(c, KVP_EINVAL, "list_transfers: NULL out or n");
    kvp__client_request(c, kvpool_Request_list_transfers_tag);
    int rc = kvp__client_call(c, kvpool_Response_list_transfers_tag, NULL, NULL, 0);
    if (rc)
        return rc;
    const kvpool_ListTransfersResponse *r = &kvp__client_response(c)->body.list_transfers;
    uint32_t k = 0;
    for (; k < r->transfers_count && k < max; k++) {
        const kvpool_TransferInfo *t = &r->transfers[k];
        kvp_transfer_info_t *o = &out[k];
        memset(o, 0, sizeof(*o));
        o->transfer_id = t->transfer_id;
        o->num_seqs = t->num_seqs;
        o->seq_id = t->seq_id;
        o->bytes = t->bytes;
        o->elapsed_ms = t->elapsed_ms;
        o->num_tokens = t->num_tokens;
        snprintf(o->direction, sizeof(o->direction), "%s", t->direction);
        snprintf(o->state, sizeof(o->state), "%s", t->state);
        snprintf(o->peer, sizeof(o->peer), "%s", t->peer);
        snprintf(o->ns, sizeof(o->ns), "%s", t->namespace);
        snprintf(o->message, sizeof(o->message), "%s", t->message);
    }
    *n = k;
    return 0;
}
