/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_install_demo.c - a program outside the tree that uses only the INSTALLED libkvpool:
 * <kvpool.h> from the prefix, linked through pkg-config or find_package(kvpool), shared or
 * static (tests/install/test_install.sh builds it the four ways). It connects to the daemon at
 * argv[1], says Hello, pings, reserves one sequence of 5 tokens, reads the page table back,
 * releases it, and prints a fixed transcript (no addresses, times or page ids) that the script
 * compares line for line. It is also the example a newcomer copies: every call is checked.
 * Exit 0 on success, 1 on any failure (the message on stderr).
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include <kvpool.h>

#define CHECK(call)                                                                                \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ != 0) {                                                                            \
            fprintf(stderr, "%s: %s (%s)\n", #call, kvp_strerror(rc_), kvp_client_last_error(c));  \
            goto out_close;                                                                        \
        }                                                                                          \
    } while (0)

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
        return 2;
    }
    /* the library that runs must be the one the program was compiled against */
    if (strcmp(kvp_client_version(), KVP_VERSION_STRING) != 0 ||
        kvp_client_abi_version() != KVP_ABI_VERSION) {
        fprintf(stderr, "libkvpool %s (abi %u) but compiled against %s (abi %u)\n",
                kvp_client_version(), kvp_client_abi_version(), KVP_VERSION_STRING,
                (unsigned)KVP_ABI_VERSION);
        return 1;
    }
    printf("libkvpool %s abi %u\n", kvp_client_version(), kvp_client_abi_version());

    kvp_client_opts_t o = {.socket_path = argv[1],
                           .ns = "install-demo",
                           .client_name = "kvp_install_demo",
                           .lease_ms = 0};
    kvp_client_t *c = NULL;
    char err[256];
    int rc = kvp_client_connect(&o, &c, err, sizeof(err));
    if (rc != 0) {
        fprintf(stderr, "connect %s: %s (%s)\n", argv[1], kvp_strerror(rc), err);
        return 1;
    }
    int status = 1;
    const kvp_pool_info_t *pi = kvp_client_pool_info(c);
    printf("hello server %s pages %u page_size %u layers %u\n", kvp_client_server_version(c),
           pi->num_pages, pi->page_size, pi->num_layers);

    uint64_t rtt_ns = 0;
    CHECK(kvp_client_ping(c, &rtt_ns));
    printf("ping ok\n");

    uint64_t seq = 7;
    uint32_t tokens = 5;
    int32_t indptr[2], indices[8], last[1], append_indptr[2], seq_lens[1];
    kvp_page_table_t t = {.kv_indptr = indptr,
                          .kv_indices = indices,
                          .kv_last_page_len = last,
                          .append_indptr = append_indptr,
                          .seq_lens = seq_lens,
                          .cap_batch = 2,
                          .cap_indices = 8};
    CHECK(kvp_client_reserve(c, &seq, &tokens, 1, &t));
    printf("reserve batch %u pages %" PRId32 " last_page_len %" PRId32 " seq_len %" PRId32
           " append %" PRId32 "\n",
           t.batch_size, indptr[1] - indptr[0], last[0], seq_lens[0],
           append_indptr[1] - append_indptr[0]);

    kvp_stats_summary_t st;
    CHECK(kvp_client_stats(c, &st));
    printf("stats seqs %u used_pages %u\n", st.num_seqs, st.used_pages);

    uint32_t released = 0;
    CHECK(kvp_client_release(c, &seq, 1, &released));
    CHECK(kvp_client_stats(c, &st));
    printf("release released %u seqs %u used_pages %u\n", released, st.num_seqs, st.used_pages);
    status = 0;
out_close:
    kvp_client_close(c);
    return status;
}
