/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_version.c - one version everywhere (issue #19): CMake's project(kvpool VERSION ...) is
 * the only place it is written, and every place that shows it must show exactly that string
 * (KVP_TEST_PROJECT_VERSION, passed by tests/CMakeLists.txt): the generated kvpool_version.h,
 * kvp_client_version() of the static and of the shared library (dlopen'ed, with its soname),
 * `kvpoold --version`, `kvpoolctl --version`, the Hello answer of a real daemon and the
 * kvpool_build_info metric. The ABI number is KVP_TEST_ABI_VERSION (CMake's KVP_ABI_VERSION).
 */
#include <check.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvp_backend.h"
#include "kvp_harness.h"
#include "kvp_rpc.h"
#include "kvp_wire.h"
#include "kvpool.h"
#include "kvpool_version.h"

/* The first line of `path --version` (stdout) into buf; returns the exit status. */
static int run_version(const char *path, char *buf, size_t cap)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "'%s' --version", path);
    FILE *p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    size_t n = fread(buf, 1, cap - 1, p);
    buf[n] = '\0';
    return pclose(p);
}

START_TEST(header_macros_spell_the_project_version)
{
    char v[64];
    snprintf(v, sizeof(v), "%d.%d.%d", KVP_VERSION_MAJOR, KVP_VERSION_MINOR, KVP_VERSION_PATCH);
    ck_assert_str_eq(v, KVP_TEST_PROJECT_VERSION);
    ck_assert_str_eq(KVP_VERSION_STRING, KVP_TEST_PROJECT_VERSION);
    ck_assert_int_eq(KVP_VERSION_HEX,
                     (KVP_VERSION_MAJOR << 16) | (KVP_VERSION_MINOR << 8) | KVP_VERSION_PATCH);
    ck_assert_int_eq(KVP_ABI_VERSION, KVP_TEST_ABI_VERSION);
}
END_TEST

START_TEST(the_static_library_reports_its_version_and_abi)
{
    ck_assert_str_eq(kvp_client_version(), KVP_VERSION_STRING);
    ck_assert_str_eq(kvp_client_version(), KVP_TEST_PROJECT_VERSION);
    ck_assert_uint_eq(kvp_client_abi_version(), KVP_TEST_ABI_VERSION);
}
END_TEST

START_TEST(the_shared_library_has_the_abi_soname_and_reports_the_same)
{
    char soname[64];
    snprintf(soname, sizeof(soname), "libkvpool.so.%d", KVP_TEST_ABI_VERSION);
    ck_assert_str_eq(KVP_TEST_SONAME, soname);
    void *h = dlopen(KVP_TEST_SHARED_LIB, RTLD_NOW | RTLD_LOCAL);
    ck_assert_msg(h != NULL, "dlopen %s: %s", KVP_TEST_SHARED_LIB, dlerror());
    const char *(*version)(void) = (const char *(*)(void))dlsym(h, "kvp_client_version");
    unsigned (*abi)(void) = (unsigned (*)(void))dlsym(h, "kvp_client_abi_version");
    ck_assert_ptr_nonnull(version);
    ck_assert_ptr_nonnull(abi);
    ck_assert_str_eq(version(), KVP_TEST_PROJECT_VERSION);
    ck_assert_uint_eq(abi(), KVP_TEST_ABI_VERSION);
    dlclose(h);
}
END_TEST

START_TEST(kvpoold_and_kvpoolctl_print_the_project_version)
{
    char out[256], want[256];
    ck_assert_int_eq(run_version(KVPOOLD_PATH, out, sizeof(out)), 0);
    ck_assert_str_eq(out, "kvpoold " KVP_TEST_PROJECT_VERSION "\n");
    ck_assert_int_eq(run_version(KVPOOLCTL_PATH, out, sizeof(out)), 0);
    snprintf(want, sizeof(want), "kvpoolctl %s (protocol %u)\n", KVP_TEST_PROJECT_VERSION,
             (unsigned)KVP_PROTOCOL_VERSION);
    ck_assert_str_eq(out, want);
}
END_TEST

START_TEST(hello_answers_the_project_version)
{
    kvp_daemon_t d;
    ck_assert_int_eq(kvp_daemon_start_shared(&d, NULL), 0);
    kvp_client_opts_t o = {.socket_path = d.sock, .ns = "version", .lease_ms = 0};
    kvp_client_t *c = NULL;
    char err[256] = "";
    ck_assert_msg(kvp_client_connect(&o, &c, err, sizeof(err)) == 0, "connect: %s", err);
    ck_assert_str_eq(kvp_client_server_version(c), KVP_TEST_PROJECT_VERSION);
    kvp_client_close(c);
    ck_assert_int_eq(kvp_daemon_stop(&d, 15), 0);
}
END_TEST

START_TEST(the_build_info_metric_carries_the_project_version)
{
    const kvp_geom_t g = {.num_layers = 1,
                          .num_pages = 4,
                          .page_size = 4,
                          .num_kv_heads = 1,
                          .head_dim = 8,
                          .dtype = KVP_DTYPE_FP16,
                          .layout = KVP_LAYOUT_NHD,
                          .storage = KVP_STORAGE_COMBINED,
                          .num_devices = 1};
    kvp_backend_t *b;
    ck_assert_int_eq(kvp_backend_host_create(&g, &b), 0);
    kvp_rpc_limits_t lim = {.max_seqs = 4,
                            .max_namespaces = 2,
                            .max_batch = 2,
                            .max_batch_tokens = 100,
                            .max_buffers_per_client = 1,
                            .max_buffer_bytes = 1 << 20,
                            .dedup_window = 2,
                            .max_lease_ms = 1000};
    kvp_rpc_t *r;
    ck_assert_int_eq(kvp_rpc_create(b, &lim, 1000, &r), 0);
    static char text[1 << 16];
    size_t len = kvp_rpc_metrics_text(r, text, sizeof(text), 2000);
    ck_assert_uint_eq(len, strlen(text));
    const char *want =
        "\nkvpool_build_info{version=\"" KVP_TEST_PROJECT_VERSION "\",backend=\"host\"} 1\n";
    ck_assert_msg(strstr(text, want) != NULL, "no %s in\n%s", want + 1, text);
    kvp_rpc_destroy(r);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("version");
    TCase *tc = tcase_create("version");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, header_macros_spell_the_project_version);
    tcase_add_test(tc, the_static_library_reports_its_version_and_abi);
    tcase_add_test(tc, the_shared_library_has_the_abi_soname_and_reports_the_same);
    tcase_add_test(tc, kvpoold_and_kvpoolctl_print_the_project_version);
    tcase_add_test(tc, hello_answers_the_project_version);
    tcase_add_test(tc, the_build_info_metric_carries_the_project_version);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
