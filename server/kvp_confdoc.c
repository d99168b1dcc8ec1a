/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_confdoc.c - a build-time tool, never installed: writes the generated parts of the
 * configuration's documentation from the settings table (kvp_config_doc_render), so the man page
 * kvpoold.conf(5) and the example deploy/kvpoold.conf cannot miss a key or drift from its
 * default or reload rule. docs/CMakeLists.txt and deploy/CMakeLists.txt run it.
 *
 *   kvp_confdoc man|example TEMPLATE OUTPUT
 */
#include <stdio.h>
#include <string.h>

#include "kvp_config.h"

int main(int argc, char **argv)
{
    if (argc != 4 || (strcmp(argv[1], "man") != 0 && strcmp(argv[1], "example") != 0)) {
        fprintf(stderr, "usage: %s man|example TEMPLATE OUTPUT\n", argv[0]);
        return 2;
    }
    kvp_config_doc_t kind =
        strcmp(argv[1], "man") == 0 ? KVP_CONFIG_DOC_MAN : KVP_CONFIG_DOC_EXAMPLE;
    FILE *in = fopen(argv[2], "re");
    if (!in) {
        perror(argv[2]);
        return 1;
    }
    FILE *out = fopen(argv[3], "we");
    if (!out) {
        perror(argv[3]);
        fclose(in);
        return 1;
    }
    char err[512] = "";
    int rc = kvp_config_doc_render(kind, in, out, err, sizeof(err));
    fclose(in);
    if (fclose(out) != 0 && rc == 0) {
        perror(argv[3]);
        rc = -1;
    }
    if (rc) {
        fprintf(stderr, "%s: %s: %s\n", argv[0], argv[2], err[0] ? err : "write error");
        remove(argv[3]);
        return 1;
    }
    return 0;
}
