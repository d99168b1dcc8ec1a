/* SPDX-License-Identifier: Apache-2.0 */
/*
 * test_config.c - the daemon configuration: documented defaults, INI files (written to
 * temporary files), every error with a message naming file:line, the key and the value,
 * command-line flags over the file whatever their order, --set, size suffixes, num_pages
 * derived from pool_bytes, geometry errors with the geometry's own message, the dump, and a
 * reload that keeps (and lists) the settings that need a restart.
 */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvp_config.h"
#include "kvp_error.h"
#include "kvp_log.h"

static char err[1024];

/* Writes text to a fresh temporary file; returns its path (static storage, one at a time per
 * slot). */
static const char *write_temp(int slot, const char *text)
{
    static char paths[4][64];
    char *path = paths[slot];
    snprintf(path, sizeof(paths[0]), "/tmp/kvp-test-config-XXXXXX");
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    size_t len = strlen(text);
    ck_assert_int_eq(write(fd, text, len), (ssize_t)len);
    close(fd);
    return path;
}

static void rewrite(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

/* The dump of cfg without its first (comment) line, in static storage. */
static const char *dump_body(const kvp_config_t *cfg, char *buf, size_t len)
{
    char *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    ck_assert_ptr_nonnull(f);
    kvp_config_dump(cfg, f);
    fclose(f);
    const char *body = strchr(text, '\n');
    ck_assert_ptr_nonnull(body);
    snprintf(buf, len, "%s", body + 1);
    free(text);
    return buf;
}

static void expect_unchanged(const kvp_config_t *before, const kvp_config_t *after)
{
    ck_assert_msg(memcmp(before, after, sizeof(*before)) == 0, "config changed on error");
}

static void expect_err_has(const char *fragment)
{
    ck_assert_msg(strstr(err, fragment) != NULL, "message '%s' lacks '%s'", err, fragment);
}

START_TEST(defaults_are_the_documented_ones)
{
    kvp_config_t c;
    kvp_config_defaults(&c);
    if (geteuid() == 0)
        ck_assert_str_eq(c.socket, "/run/kvpool/kvpool.sock");
    ck_assert_uint_eq(c.socket_mode, 0660);
    ck_assert_str_eq(c.socket_group, "");
    ck_assert_uint_eq(c.max_connections, 256);
    ck_assert_uint_eq(c.max_frame_bytes, 16u << 20);
    ck_assert_uint_eq(c.max_queued_bytes, 64u << 20);
    ck_assert_int_eq(c.log_level, KVP_LOG_INFO);
    ck_assert(c.watchdog);
    ck_assert_str_eq(c.metrics_listen, "");
    ck_assert_uint_eq(c.drain_timeout_ms, 10000);
    ck_assert_uint_eq(c.copy_threads, 0);
    ck_assert_int_eq(c.backend, KVP_CONFIG_BACKEND_AUTO);
    ck_assert_uint_eq(c.devices.count, 1);
    ck_assert_uint_eq(c.devices.ids[0], 0);
    ck_assert_uint_eq(c.num_layers, 2);
    ck_assert_uint_eq(c.num_pages, 0);
    ck_assert_uint_eq(c.pool_bytes, 256u << 20);
    ck_assert_uint_eq(c.page_size, 16);
    ck_assert_uint_eq(c.num_kv_heads, 8);
    ck_assert_uint_eq(c.head_dim, 128);
    ck_assert_int_eq(c.dtype, KVP_DTYPE_FP16);
    ck_assert_int_eq(c.layout, KVP_LAYOUT_NHD);
    ck_assert_int_eq(c.storage, KVP_STORAGE_COMBINED);
    ck_assert_uint_eq(c.max_seqs, 65536);
    ck_assert_uint_eq(c.max_namespaces, 256);
    ck_assert_uint_eq(c.max_batch, 4096);
    ck_assert_uint_eq(c.max_batch_tokens, 1048576);
    ck_assert_uint_eq(c.max_seq_tokens, 0);
    ck_assert_uint_eq(c.max_buffers_per_client, 64);
    ck_assert_uint_eq(c.max_buffer_bytes, 64ull << 30);
    ck_assert_uint_eq(c.dedup_window, 1024);
    ck_assert_uint_eq(c.default_lease_ms, 30000);
    ck_assert_uint_eq(c.max_lease_ms, 86400000);
    ck_assert_uint_eq(c.ns_max_seqs, 0);
    ck_assert_uint_eq(c.ns_max_pages, 0);
    ck_assert_uint_eq(c.ns_max_buffer_bytes, 0);
    ck_assert_uint_eq(c.ns_max_connections, 0);
    ck_assert_uint_eq(c.allowed_uids.count, 0);
    ck_assert_uint_eq(c.allowed_gids.count, 0);
    ck_assert_uint_eq(c.cuda_ready_timeout_ms, 30000);
    ck_assert(!c.cuda_plan_upload);
    ck_assert_uint_eq(c.append_kernel, 0);
    ck_assert_uint_eq(c.append_tokens_per_block, 0);
    ck_assert_uint_eq(c.append_blocks_per_sm, 0);
    ck_assert_uint_eq(c.append_warps_per_block, 0);
    ck_assert_uint_eq(c.append_hints, 0);
    ck_assert_uint_eq(c.append_vecs_per_thread, 0);
    ck_assert_uint_eq(c.pack_blocks, 0);
    ck_assert_uint_eq(c.xfer_stages, 2);
    ck_assert(!c.xfer_register);
    ck_assert(!c.xfer_priority);
    ck_assert_str_eq(c.nccl_lib, "libnccl.so.2");
    ck_assert_str_eq(c.config_path, "");
    ck_assert_uint_eq(c.num_overrides, 0);

    /* the defaults validate; 256 MiB of 2 layers x K,V x 16 x 8 x 128 x fp16 = 2048 pages */
    strcpy(err, "x");
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), 0);
    ck_assert_str_eq(err, "");
    ck_assert_uint_eq(c.num_pages, 2048);
    kvp_geom_t g;
    kvp_config_geom(&c, &g);
    ck_assert_uint_eq(g.num_pages, 2048);
    ck_assert_uint_eq(g.num_devices, 1);
    ck_assert_uint_eq(g.head_dim, 128);

    uint32_t threads = kvp_config_copy_threads(&c);
    ck_assert_uint_ge(threads, 1);
    ck_assert_uint_le(threads, 8);
    c.copy_threads = 13;
    ck_assert_uint_eq(kvp_config_copy_threads(&c), 13);
}
END_TEST

START_TEST(default_socket_of_an_unprivileged_user)
{
    /* as root, become nobody for this (forked) test; otherwise test as whoever we are */
    if (geteuid() == 0)
        ck_assert_int_eq(seteuid(65534), 0);
    unsigned uid = (unsigned)geteuid();
    kvp_config_t c;
    char want[128];

    setenv("XDG_RUNTIME_DIR", "/run/user/4242", 1);
    kvp_config_defaults(&c);
    ck_assert_str_eq(c.socket, "/run/user/4242/kvpool/kvpool.sock");

    unsetenv("XDG_RUNTIME_DIR");
    kvp_config_defaults(&c);
    snprintf(want, sizeof(want), "/tmp/kvpool-%u/kvpool.sock", uid);
    ck_assert_str_eq(c.socket, want);

    setenv("XDG_RUNTIME_DIR", "relative/dir", 1); /* not absolute: ignored */
    kvp_config_defaults(&c);
    ck_assert_str_eq(c.socket, want);

    char longdir[128] = "/";
    memset(longdir + 1, 'd', 100); /* the socket path would not fit sun_path */
    setenv("XDG_RUNTIME_DIR", longdir, 1);
    kvp_config_defaults(&c);
    ck_assert_str_eq(c.socket, want);
    seteuid(0);
}
END_TEST

static const char full_file[] = "# every key, none at its default\n"
                                "[server]\n"
                                "socket = /run/test/kv.sock\n"
                                "socket_mode = 0600\n"
                                "socket_group = kvpool\n"
                                "max_connections = 1000\n"
                                "max_frame_bytes = 8MiB\n"
                                "max_queued_bytes = 1G\n"
                                "log_level = debug\n"
                                "watchdog = no\n"
                                "metrics_listen = 127.0.0.1:9464\n"
                                "drain_timeout_ms = 2500\n"
                                "copy_threads = 4\n"
                                "\n"
                                "; pool\n"
                                "[pool]\n"
                                "backend = host\n"
                                "devices = 0, 1\n"
                                "num_layers = 32\n"
                                "num_pages = 1000\n"
                                "pool_bytes = 40 GiB\n"
                                "page_size = 32\n"
                                "num_kv_heads = 16\n"
                                "head_dim = 64\n"
                                "dtype = bf16\n"
                                "layout = hnd\n"
                                "storage = split\n"
                                "[limits]\n"
                                "  max_seqs = 100 ; indented, with an inline comment\n"
                                "max_namespaces = 3\n"
                                "max_batch = 512\n"
                                "max_batch_tokens = 65536\n"
                                "max_seq_tokens = 32768\n"
                                "max_buffers_per_client = 8\n"
                                "max_buffer_bytes = 2T\n"
                                "dedup_window = 64\n"
                                "default_lease_ms = 0\n"
                                "max_lease_ms = 60000\n"
                                "ns_max_seqs = 1000\n"
                                "ns_max_pages = 5000\n"
                                "ns_max_buffer_bytes = 3G\n"
                                "ns_max_connections = 8\n"
                                "[access]\n"
                                "allowed_uids = 1000,1001\r\n"
                                "allowed_gids = 50\n"
                                "[tuning]\n"
                                "cuda_ready_timeout_ms = 3000\n"
                                "cuda_plan_upload = yes\n"
                                "append_kernel = block\n"
                                "append_tokens_per_block = 4\n"
                                "append_blocks_per_sm = 8\n"
                                "append_warps_per_block = 1\n"
                                "append_hints = ldst\n"
                                "append_vecs_per_thread = 8\n"
                                "pack_blocks = 66\n"
                                "xfer_stages = 3\n"
                                "xfer_register = on\n"
                                "xfer_priority = true\n"
                                "nccl_lib = /opt/nccl/lib/libnccl.so.2\n";

static void expect_full_file(const kvp_config_t *c)
{
    ck_assert_str_eq(c->socket, "/run/test/kv.sock");
    ck_assert_uint_eq(c->socket_mode, 0600);
    ck_assert_str_eq(c->socket_group, "kvpool");
    ck_assert_uint_eq(c->max_connections, 1000);
    ck_assert_uint_eq(c->max_frame_bytes, 8u << 20);
    ck_assert_uint_eq(c->max_queued_bytes, 1u << 30);
    ck_assert_int_eq(c->log_level, KVP_LOG_DEBUG);
    ck_assert(!c->watchdog);
    ck_assert_str_eq(c->metrics_listen, "127.0.0.1:9464");
    ck_assert_uint_eq(c->drain_timeout_ms, 2500);
    ck_assert_uint_eq(c->copy_threads, 4);
    ck_assert_int_eq(c->backend, KVP_CONFIG_BACKEND_HOST);
    ck_assert_uint_eq(c->devices.count, 2);
    ck_assert_uint_eq(c->devices.ids[0], 0);
    ck_assert_uint_eq(c->devices.ids[1], 1);
    ck_assert_uint_eq(c->num_layers, 32);
    ck_assert_uint_eq(c->num_pages, 1000);
    ck_assert_uint_eq(c->pool_bytes, 40ull << 30);
    ck_assert_uint_eq(c->page_size, 32);
    ck_assert_uint_eq(c->num_kv_heads, 16);
    ck_assert_uint_eq(c->head_dim, 64);
    ck_assert_int_eq(c->dtype, KVP_DTYPE_BF16);
    ck_assert_int_eq(c->layout, KVP_LAYOUT_HND);
    ck_assert_int_eq(c->storage, KVP_STORAGE_SPLIT);
    ck_assert_uint_eq(c->max_seqs, 100);
    ck_assert_uint_eq(c->max_namespaces, 3);
    ck_assert_uint_eq(c->max_batch, 512);
    ck_assert_uint_eq(c->max_batch_tokens, 65536);
    ck_assert_uint_eq(c->max_seq_tokens, 32768);
    ck_assert_uint_eq(c->max_buffers_per_client, 8);
    ck_assert_uint_eq(c->max_buffer_bytes, 2ull << 40);
    ck_assert_uint_eq(c->dedup_window, 64);
    ck_assert_uint_eq(c->default_lease_ms, 0);
    ck_assert_uint_eq(c->max_lease_ms, 60000);
    ck_assert_uint_eq(c->ns_max_seqs, 1000);
    ck_assert_uint_eq(c->ns_max_pages, 5000);
    ck_assert_uint_eq(c->ns_max_buffer_bytes, 3ull << 30);
    ck_assert_uint_eq(c->ns_max_connections, 8);
    ck_assert_uint_eq(c->allowed_uids.count, 2);
    ck_assert_uint_eq(c->allowed_uids.ids[0], 1000);
    ck_assert_uint_eq(c->allowed_uids.ids[1], 1001);
    ck_assert_uint_eq(c->allowed_gids.count, 1);
    ck_assert_uint_eq(c->allowed_gids.ids[0], 50);
    ck_assert_uint_eq(c->cuda_ready_timeout_ms, 3000);
    ck_assert(c->cuda_plan_upload);
    ck_assert_uint_eq(c->append_kernel, 2);
    ck_assert_uint_eq(c->append_tokens_per_block, 4);
    ck_assert_uint_eq(c->append_blocks_per_sm, 8);
    ck_assert_uint_eq(c->append_warps_per_block, 1);
    ck_assert_uint_eq(c->append_hints, 3);
    ck_assert_uint_eq(c->append_vecs_per_thread, 8);
    ck_assert_uint_eq(c->pack_blocks, 66);
    ck_assert_uint_eq(c->xfer_stages, 3);
    ck_assert(c->xfer_register);
    ck_assert(c->xfer_priority);
    ck_assert_str_eq(c->nccl_lib, "/opt/nccl/lib/libnccl.so.2");
}

START_TEST(file_sets_every_key)
{
    const char *path = write_temp(0, full_file);
    kvp_config_t c;
    kvp_config_defaults(&c);
    strcpy(err, "x");
    ck_assert_int_eq(kvp_config_load_file(&c, path, err, sizeof(err)), 0);
    ck_assert_str_eq(err, "");
    expect_full_file(&c);
    ck_assert_str_eq(c.config_path, path);
    ck_assert_uint_eq(c.num_overrides, 0);
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), 0);
    ck_assert_uint_eq(c.num_pages, 1000); /* given: pool_bytes is not used */
    unlink(path);

    /* a file that sets nothing changes nothing */
    kvp_config_t d, e;
    kvp_config_defaults(&d);
    e = d;
    ck_assert_int_eq(kvp_config_load_string(&d, "# nothing\n\n[pool]\n", "empty", err, sizeof(err)),
                     0);
    expect_unchanged(&e, &d);

    /* a list key may be repeated: each line adds entries (the first replaces the default) */
    ck_assert_int_eq(kvp_config_load_string(&d,
                                            "[pool]\ndevices = 2\ndevices = 3, 4\n"
                                            "[access]\nallowed_gids =\nallowed_gids = 9\n",
                                            "lists", err, sizeof(err)),
                     0);
    ck_assert_uint_eq(d.devices.count, 3);
    ck_assert_uint_eq(d.devices.ids[0], 2);
    ck_assert_uint_eq(d.devices.ids[2], 4);
    ck_assert_uint_eq(d.allowed_gids.count, 1);
    ck_assert_uint_eq(d.allowed_gids.ids[0], 9);
}
END_TEST

/* Loads text into defaults, expects KVP_EINVAL, an unchanged config and each fragment. */
static void expect_load_error(const char *text, const char *f1, const char *f2)
{
    kvp_config_t c, before;
    kvp_config_defaults(&c);
    before = c;
    err[0] = '\0';
    ck_assert_msg(kvp_config_load_string(&c, text, "f.ini", err, sizeof(err)) == KVP_EINVAL,
                  "loaded: %s", text);
    expect_unchanged(&before, &c);
    expect_err_has(f1);
    if (f2)
        expect_err_has(f2);
}

START_TEST(structure_errors_name_file_line_and_key)
{
    expect_load_error("[server]\nmax_connections = 5\n[bogus]\nx = 1\n",
                      "f.ini:3: unknown section [bogus]", NULL);
    expect_load_error("[server]\n[empty_unknown]\n", "f.ini:2: unknown section [empty_unknown]",
                      NULL);
    expect_load_error("# c\n[server]\nsockett = /x\n", "f.ini:3: unknown key 'sockett'",
                      "[server]");
    expect_load_error("[pool]\nsocket = /x\n", "f.ini:2: unknown key 'socket' in section [pool]",
                      NULL);
    expect_load_error("socket = /x\n", "f.ini:1: key 'socket' outside of any section", NULL);
    expect_load_error("[limits]\nmax_seqs = 5\nmax_batch = 4\nmax_seqs = 6\n",
                      "f.ini:4: limits.max_seqs set twice (first at line 2)", NULL);
    expect_load_error("[access]\nallowed_uids = 5,6\nallowed_uids = 7,5\n",
                      "f.ini:3: access.allowed_uids: invalid value '5,6,7,5'",
                      "entry 5 is listed twice");
    expect_load_error("[server]\nmax_connections = 5\nthis line has no equals sign\n",
                      "f.ini:3: syntax error", NULL);
    expect_load_error("[server\nmax_connections = 5\n", "f.ini:1: syntax error", NULL);
    /* a syntax error before a key error is the one reported */
    expect_load_error("[server]\nnot a key\nbogus = 1\n", "f.ini:2: syntax error", NULL);

    char longline[400];
    snprintf(longline, sizeof(longline), "[server]\nsocket_group = %0300d\nbogus = 2\n", 7);
    expect_load_error(longline, "f.ini:2: line longer than", NULL);

    /* CRLF line ends and comments do not disturb line numbers */
    expect_load_error("[server]\r\n; comment\r\n# comment\r\n\r\nbogus = 1\r\n",
                      "f.ini:5: unknown key 'bogus'", NULL);

    /* a missing file */
    kvp_config_t c, before;
    kvp_config_defaults(&c);
    before = c;
    ck_assert_int_eq(kvp_config_load_file(&c, "/nonexistent/kvpool.conf", err, sizeof(err)),
                     -ENOENT);
    expect_err_has("cannot open /nonexistent/kvpool.conf");
    expect_unchanged(&before, &c);
    ck_assert_int_eq(kvp_config_load_file(&c, "", err, sizeof(err)), KVP_EINVAL);

    /* the file's own name is in messages */
    const char *path = write_temp(1, "[server]\nmax_connections = 7\nmax_connection = 8\n");
    ck_assert_int_eq(kvp_config_load_file(&c, path, err, sizeof(err)), KVP_EINVAL);
    char want[128];
    snprintf(want, sizeof(want), "%s:3: unknown key 'max_connection' in section [server]", path);
    ck_assert_str_eq(err, want);
    expect_unchanged(&before, &c);
    unlink(path);
}
END_TEST

static const struct {
    const char *key, *value, *fragment;
} bad_values[] = {
    {"server.max_connections", "12abc", "expected an unsigned decimal integer"},
    {"server.max_connections", "-5", "expected an unsigned decimal integer"},
    {"server.max_connections", "+5", "expected an unsigned decimal integer"},
    {"server.max_connections", "", "expected an unsigned decimal integer"},
    {"server.max_connections", "0x10", "expected an unsigned decimal integer"},
    {"server.max_connections", "99999999999999999999999", "out of range 1..1048576"},
    {"server.max_connections", "0", "out of range 1..1048576"},
    {"server.max_connections", "1048577", "out of range 1..1048576"},
    {"pool.num_layers", "4294967296", "out of range 0..4294967295"},
    {"server.socket", "relative/kv.sock", "expected an absolute path"},
    {"server.socket", "", "expected an absolute path"},
    {"server.socket_mode", "0999", "expected an octal mode"},
    {"server.socket_mode", "01000", "above 0777"},
    {"server.socket_mode", "", "expected an octal mode"},
    {"server.socket_group", "bad group", "expected a group name or number"},
    {"server.socket_group", "-x", "expected a group name or number"},
    {"server.watchdog", "maybe", "expected true or false"},
    {"server.log_level", "verbose", "expected emerg, alert"},
    {"server.metrics_listen", "localhost", "expected host:port"},
    {"server.metrics_listen", "127.0.0.1:0", "expected host:port"},
    {"server.metrics_listen", "127.0.0.1:65536", "expected host:port"},
    {"server.metrics_listen", ":9464", "expected host:port"},
    {"server.metrics_listen", "::1:9464", "needs brackets"},
    {"server.max_frame_bytes", "1K", "out of range 4096..1073741824"},
    {"server.max_frame_bytes", "2G", "out of range 4096..1073741824"},
    {"pool.backend", "tpu", "expected auto, host or cuda"},
    {"pool.devices", "", "at least 1 entry needed"},
    {"pool.devices", "0,0", "entry 0 is listed twice"},
    {"pool.devices", "0,,1", "comma-separated list"},
    {"pool.devices", "0,1,", "comma-separated list"},
    {"pool.devices", "a", "comma-separated list"},
    {"pool.devices", "-1", "comma-separated list"},
    {"pool.devices", "1024", "entry out of range 0..1023"},
    {"pool.pool_bytes", "12XB", "expected a byte count"},
    {"pool.pool_bytes", "1.5G", "expected a byte count"},
    {"pool.pool_bytes", "4k", "expected a byte count"},
    {"pool.pool_bytes", "4KB", "expected a byte count"},
    {"pool.pool_bytes", "-1G", "expected a byte count"},
    {"pool.pool_bytes", "", "expected a byte count"},
    {"pool.pool_bytes", "0", "out of range 1..18446744073709551615"},
    {"pool.pool_bytes", "99999999999T", "out of range"},
    {"pool.pool_bytes", "18446744073709551616", "out of range"},
    {"pool.dtype", "int8", "expected fp8_e4m3"},
    {"pool.layout", "xyz", "expected nhd or hnd"},
    {"pool.storage", "both", "expected combined or split"},
    {"limits.max_batch_tokens", "2147483648", "out of range 1..2147483647"},
    {"limits.max_buffer_bytes", "2000T", "out of range"},
    {"limits.ns_max_seqs", "67108865", "out of range 0..67108864"},
    {"limits.ns_max_seqs", "-1", "expected"},
    {"limits.ns_max_pages", "4294967296", "out of range 0..4294967295"},
    {"limits.ns_max_buffer_bytes", "2000T", "out of range"},
    {"limits.ns_max_connections", "1048577", "out of range 0..1048576"},
    {"access.allowed_uids", "4294967295", "entry out of range 0..4294967294"},
    {"access.allowed_uids", "root", "comma-separated list"},
    {"access.allowed_gids", "5 6", "comma-separated list"},
    {"tuning.cuda_ready_timeout_ms", "0", "out of range 1..3600000"},
    {"tuning.cuda_ready_timeout_ms", "3600001", "out of range 1..3600000"},
    {"tuning.cuda_plan_upload", "2", "expected true or false"},
    {"tuning.append_kernel", "bulk", "expected auto|warp|block|flat"},
    {"tuning.append_tokens_per_block", "65", "out of range 0..64"},
    {"tuning.append_blocks_per_sm", "1025", "out of range 0..1024"},
    {"tuning.append_warps_per_block", "9", "out of range 0..8"},
    {"tuning.append_warps_per_block", "two", "expected an unsigned decimal integer"},
    {"tuning.append_hints", "both", "expected none|ld|st|ldst"},
    {"tuning.append_vecs_per_thread", "9", "out of range 0..8"},
    {"tuning.pack_blocks", "65536", "out of range 0..65535"},
    {"tuning.xfer_stages", "1", "out of range 2..4"},
    {"tuning.xfer_stages", "5", "out of range 2..4"},
    {"tuning.xfer_register", "maybe", "expected true or false"},
    {"tuning.nccl_lib", "lib\tnccl", "control characters"},
};

START_TEST(bad_values_name_the_key_and_the_value)
{
    for (size_t i = 0; i < sizeof(bad_values) / sizeof(bad_values[0]); i++) {
        const char *key = bad_values[i].key, *value = bad_values[i].value;
        const char *dot = strchr(key, '.');
        char text[256], want[256];
        snprintf(text, sizeof(text), "[%.*s]\n\n%s = %s\n", (int)(dot - key), key, dot + 1, value);
        snprintf(want, sizeof(want), "f.ini:3: %s: invalid value '%s': ", key, value);
        expect_load_error(text, want, bad_values[i].fragment);

        /* the same through kvp_config_set */
        kvp_config_t c, before;
        kvp_config_defaults(&c);
        before = c;
        ck_assert_int_eq(kvp_config_set(&c, key, value, err, sizeof(err)), KVP_EINVAL);
        expect_unchanged(&before, &c);
        snprintf(want, sizeof(want), "%s: invalid value '%s': ", key, value);
        expect_err_has(want);
        expect_err_has(bad_values[i].fragment);
    }
    kvp_config_t c;
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_set(&c, "pool.bogus", "1", err, sizeof(err)), KVP_EINVAL);
    expect_err_has("unknown key 'pool.bogus'");
    ck_assert_int_eq(kvp_config_set(&c, "nodot", "1", err, sizeof(err)), KVP_EINVAL);
    ck_assert_int_eq(kvp_config_set(&c, "verylongsectionname.x", "1", err, sizeof(err)),
                     KVP_EINVAL);
}
END_TEST

START_TEST(values_in_every_accepted_form)
{
    static const struct {
        const char *value;
        uint64_t bytes;
    } sizes[] = {{"1024", 1024},       {"4K", 4096},
                 {"4KiB", 4096},       {"4 KiB", 4096},
                 {"16M", 16ull << 20}, {"16MiB", 16ull << 20},
                 {"2G", 2ull << 30},   {"2 GiB", 2ull << 30},
                 {"1T", 1ull << 40},   {"1TiB", 1ull << 40},
                 {"007", 7},           {"16383T", 16383ull << 40}};
    kvp_config_t c;
    kvp_config_defaults(&c);
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        ck_assert_int_eq(kvp_config_set(&c, "pool.pool_bytes", sizes[i].value, err, sizeof(err)),
                         0);
        ck_assert_uint_eq(c.pool_bytes, sizes[i].bytes);
    }
    const char *yes[] = {"true", "yes", "on", "1", "TRUE", "Yes"};
    const char *no[] = {"false", "no", "off", "0", "Off"};
    for (size_t i = 0; i < sizeof(yes) / sizeof(yes[0]); i++) {
        c.watchdog = false;
        ck_assert_int_eq(kvp_config_set(&c, "server.watchdog", yes[i], err, sizeof(err)), 0);
        ck_assert(c.watchdog);
    }
    for (size_t i = 0; i < sizeof(no) / sizeof(no[0]); i++) {
        c.watchdog = true;
        ck_assert_int_eq(kvp_config_set(&c, "server.watchdog", no[i], err, sizeof(err)), 0);
        ck_assert(!c.watchdog);
    }
    ck_assert_int_eq(kvp_config_set(&c, "server.socket_mode", "660", err, sizeof(err)), 0);
    ck_assert_uint_eq(c.socket_mode, 0660);
    ck_assert_int_eq(kvp_config_set(&c, "server.log_level", "error", err, sizeof(err)), 0);
    ck_assert_int_eq(c.log_level, KVP_LOG_ERR);
    ck_assert_int_eq(kvp_config_set(&c, "pool.dtype", "float16", err, sizeof(err)), 0);
    ck_assert_int_eq(c.dtype, KVP_DTYPE_FP16);
    ck_assert_int_eq(kvp_config_set(&c, "pool.backend", "CUDA", err, sizeof(err)), 0);
    ck_assert_int_eq(c.backend, KVP_CONFIG_BACKEND_CUDA);
    ck_assert_int_eq(kvp_config_set(&c, "server.metrics_listen", "[::1]:9464", err, sizeof(err)),
                     0);
    ck_assert_str_eq(c.metrics_listen, "[::1]:9464");
    ck_assert_int_eq(kvp_config_set(&c, "server.metrics_listen", "", err, sizeof(err)), 0);
    ck_assert_str_eq(c.metrics_listen, "");
    ck_assert_int_eq(kvp_config_set(&c, "server.socket_group", "1234", err, sizeof(err)), 0);
    ck_assert_str_eq(c.socket_group, "1234");
    ck_assert_int_eq(kvp_config_set(&c, "access.allowed_uids", " 7 , 8,9 ", err, sizeof(err)), 0);
    ck_assert_uint_eq(c.allowed_uids.count, 3);
    ck_assert_uint_eq(c.allowed_uids.ids[2], 9);
    ck_assert_int_eq(kvp_config_set(&c, "access.allowed_uids", "", err, sizeof(err)), 0);
    ck_assert_uint_eq(c.allowed_uids.count, 0);

    /* 64 entries fit, 65 do not */
    char list[512] = "";
    for (int i = 0; i < 64; i++)
        snprintf(list + strlen(list), sizeof(list) - strlen(list), "%s%d", i ? "," : "", i);
    ck_assert_int_eq(kvp_config_set(&c, "access.allowed_gids", list, err, sizeof(err)), 0);
    ck_assert_uint_eq(c.allowed_gids.count, 64);
    strcat(list, ",64");
    ck_assert_int_eq(kvp_config_set(&c, "access.allowed_gids", list, err, sizeof(err)), KVP_EINVAL);
    expect_err_has("more than 64 entries");
}
END_TEST

START_TEST(flags_apply_over_the_file_whatever_their_order)
{
    const char *path = write_temp(0, "[pool]\nnum_pages = 100\npage_size = 32\nhead_dim = 64\n"
                                     "[server]\nlog_level = debug\n");
    char *argv[] = {"kvpoold",    "--num-pages",   "50",          "--config",
                    (char *)path, "--page-size=8", "--log-level", "warning",
                    "--socket",   "/run/x.sock",   NULL};
    kvp_config_t c;
    kvp_config_defaults(&c);
    kvp_config_action_t action = KVP_CONFIG_HELP;
    strcpy(err, "x");
    ck_assert_int_eq(kvp_config_parse_args(&c, 10, argv, &action, err, sizeof(err)), 0);
    ck_assert_str_eq(err, "");
    ck_assert_int_eq(action, KVP_CONFIG_RUN);
    ck_assert_uint_eq(c.num_pages, 50); /* flag before --config still wins */
    ck_assert_uint_eq(c.page_size, 8);  /* flag after --config */
    ck_assert_uint_eq(c.head_dim, 64);  /* file only */
    ck_assert_int_eq(c.log_level, KVP_LOG_WARNING);
    ck_assert_str_eq(c.socket, "/run/x.sock");
    ck_assert_str_eq(c.config_path, path);
    ck_assert_uint_eq(c.num_overrides, 4);
    ck_assert_str_eq(c.overrides[0].value, "50");
    ck_assert_str_eq(c.overrides[1].value, "8");

    /* every named flag reaches its key */
    char *all[] = {"kvpoold", "--backend",   "host",  "--devices",      "0,1",  "--num-layers",
                   "4",       "--num-pages", "0",     "--pool-bytes",   "1GiB", "--num-kv-heads",
                   "4",       "--head-dim",  "256",   "--dtype",        "fp32", "--layout",
                   "hnd",     "--storage",   "split", "--check-config", NULL};
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_parse_args(&c, 22, all, &action, err, sizeof(err)), 0);
    ck_assert_int_eq(action, KVP_CONFIG_CHECK);
    ck_assert_int_eq(c.backend, KVP_CONFIG_BACKEND_HOST);
    ck_assert_uint_eq(c.devices.count, 2);
    ck_assert_uint_eq(c.num_layers, 4);
    ck_assert_uint_eq(c.pool_bytes, 1ull << 30);
    ck_assert_uint_eq(c.num_kv_heads, 4);
    ck_assert_uint_eq(c.head_dim, 256);
    ck_assert_int_eq(c.dtype, KVP_DTYPE_FP32);
    ck_assert_int_eq(c.layout, KVP_LAYOUT_HND);
    ck_assert_int_eq(c.storage, KVP_STORAGE_SPLIT);
    ck_assert_str_eq(c.config_path, "");
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), 0);
    /* per device: 4 layers x K,V x 16 slots x 2 heads x 256 x 4 bytes = 256 KiB a page */
    ck_assert_uint_eq(c.num_pages, 4096);

    /* the same key twice: the last wins and one override is kept */
    char *twice[] = {"kvpoold", "--page-size", "8", "--set", "pool.page_size=64", NULL};
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_parse_args(&c, 5, twice, &action, err, sizeof(err)), 0);
    ck_assert_uint_eq(c.page_size, 64);
    ck_assert_uint_eq(c.num_overrides, 1);
    ck_assert_str_eq(c.overrides[0].value, "64");

    /* no arguments: defaults, run */
    char *none[] = {"kvpoold", NULL};
    kvp_config_t d;
    kvp_config_defaults(&c);
    d = c;
    ck_assert_int_eq(kvp_config_parse_args(&c, 1, none, &action, err, sizeof(err)), 0);
    ck_assert_int_eq(action, KVP_CONFIG_RUN);
    expect_unchanged(&d, &c);
    unlink(path);
}
END_TEST

START_TEST(set_reaches_any_key)
{
    char *argv[] = {"kvpoold",
                    "--set",
                    "limits.max_seqs=10",
                    "--set=access.allowed_uids=1000,1001",
                    "--set",
                    "server.watchdog=off",
                    "--set",
                    "server.socket_group=",
                    NULL};
    kvp_config_t c;
    kvp_config_action_t action;
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_parse_args(&c, 8, argv, &action, err, sizeof(err)), 0);
    ck_assert_uint_eq(c.max_seqs, 10);
    ck_assert_uint_eq(c.allowed_uids.count, 2);
    ck_assert_uint_eq(c.allowed_uids.ids[1], 1001);
    ck_assert(!c.watchdog);
    ck_assert_str_eq(c.socket_group, "");
    ck_assert_uint_eq(c.num_overrides, 4);
}
END_TEST

/* parse_args must fail with code, leave cfg unchanged and name each fragment. */
static void expect_args_error(int argc, char **argv, int code, const char *f1, const char *f2)
{
    kvp_config_t c, before;
    kvp_config_action_t action = KVP_CONFIG_HELP;
    kvp_config_defaults(&c);
    before = c;
    err[0] = '\0';
    ck_assert_int_eq(kvp_config_parse_args(&c, argc, argv, &action, err, sizeof(err)), code);
    expect_unchanged(&before, &c);
    expect_err_has(f1);
    if (f2)
        expect_err_has(f2);
}

START_TEST(command_line_errors)
{
    char *unknown[] = {"kvpoold", "--bogus", "1", NULL};
    expect_args_error(3, unknown, KVP_EINVAL, "unknown option '--bogus'", NULL);
    char *unknown_eq[] = {"kvpoold", "--bogus=1", NULL};
    expect_args_error(2, unknown_eq, KVP_EINVAL, "unknown option '--bogus'", NULL);
    char *short_opt[] = {"kvpoold", "-x", NULL};
    expect_args_error(2, short_opt, KVP_EINVAL, "unexpected argument '-x'", NULL);
    char *positional[] = {"kvpoold", "serve", NULL};
    expect_args_error(2, positional, KVP_EINVAL, "unexpected argument 'serve'", NULL);
    char *missing[] = {"kvpoold", "--socket", NULL};
    expect_args_error(2, missing, KVP_EINVAL, "--socket needs a value", NULL);
    char *twice[] = {"kvpoold", "--config", "a", "--config=b", NULL};
    expect_args_error(4, twice, KVP_EINVAL, "--config given twice", NULL);
    char *novalue[] = {"kvpoold", "--check-config=yes", NULL};
    expect_args_error(2, novalue, KVP_EINVAL, "--check-config takes no value", NULL);
    char *badnum[] = {"kvpoold", "--num-pages", "12abc", NULL};
    expect_args_error(3, badnum, KVP_EINVAL, "--num-pages: pool.num_pages: invalid value '12abc'",
                      NULL);
    char *neg[] = {"kvpoold", "--page-size=-16", NULL};
    expect_args_error(2, neg, KVP_EINVAL, "pool.page_size: invalid value '-16'", NULL);
    char *set_form[] = {"kvpoold", "--set", "limits.max_seqs", NULL};
    expect_args_error(3, set_form, KVP_EINVAL, "--set: expected SECTION.KEY=VALUE", NULL);
    char *set_key[] = {"kvpoold", "--set", "pool.bogus=1", NULL};
    expect_args_error(3, set_key, KVP_EINVAL, "--set: unknown key 'pool.bogus'", NULL);
    char *set_val[] = {"kvpoold", "--set", "limits.max_seqs=abc", NULL};
    expect_args_error(3, set_val, KVP_EINVAL, "limits.max_seqs: invalid value 'abc'", NULL);
    char *nofile[] = {"kvpoold", "--num-pages", "5", "--config", "/nonexistent/k.conf", NULL};
    expect_args_error(5, nofile, -ENOENT, "cannot open /nonexistent/k.conf", NULL);
    char *empty_config[] = {"kvpoold", "--config=", NULL};
    expect_args_error(2, empty_config, KVP_EINVAL, "--config needs a file name", NULL);

    /* an error in the file comes with its line, even when given through --config */
    const char *path = write_temp(0, "[pool]\npage_size = 0x10\n");
    char *badfile[] = {"kvpoold", "--config", (char *)path, NULL};
    expect_args_error(3, badfile, KVP_EINVAL, ":2: pool.page_size: invalid value '0x10'", NULL);
    unlink(path);

    char longval[400];
    memset(longval, '1', sizeof(longval) - 1);
    longval[sizeof(longval) - 1] = '\0';
    char *toolong[] = {"kvpoold", "--set", NULL, NULL};
    char setarg[450];
    snprintf(setarg, sizeof(setarg), "access.allowed_uids=%s", longval);
    toolong[2] = setarg;
    expect_args_error(3, toolong, KVP_EINVAL, "access.allowed_uids: value longer than 255", NULL);
}
END_TEST

START_TEST(help_and_version_load_nothing)
{
    kvp_config_t c, before;
    kvp_config_action_t action;
    char *help[] = {"kvpoold", "--config", "/nonexistent/k.conf", "--num-pages", "7",
                    "--help",  NULL};
    kvp_config_defaults(&c);
    before = c;
    ck_assert_int_eq(kvp_config_parse_args(&c, 6, help, &action, err, sizeof(err)), 0);
    ck_assert_int_eq(action, KVP_CONFIG_HELP);
    expect_unchanged(&before, &c);
    char *h[] = {"kvpoold", "-h", "--version", NULL};
    ck_assert_int_eq(kvp_config_parse_args(&c, 3, h, &action, err, sizeof(err)), 0);
    ck_assert_int_eq(action, KVP_CONFIG_HELP);
    char *version[] = {"kvpoold", "--version", NULL};
    ck_assert_int_eq(kvp_config_parse_args(&c, 2, version, &action, err, sizeof(err)), 0);
    ck_assert_int_eq(action, KVP_CONFIG_VERSION);
    expect_unchanged(&before, &c);

    char *text = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&text, &n);
    kvp_config_usage(f, "kvpoold");
    fclose(f);
    ck_assert_ptr_nonnull(strstr(text, "usage: kvpoold"));
    ck_assert_ptr_nonnull(strstr(text, "--set SECTION.KEY=V"));
    ck_assert_ptr_nonnull(strstr(text, "--check-config"));
    free(text);
}
END_TEST

START_TEST(num_pages_is_derived_from_pool_bytes)
{
    kvp_config_t c, before;
    /* one page over all layers, K and V, one device: 2 x 2 x 16 x 8 x 128 x 2 = 128 KiB */
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_set(&c, "pool.pool_bytes", "1000000", err, sizeof(err)), 0);
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), 0);
    ck_assert_uint_eq(c.num_pages, 1000000 / 131072);

    /* tensor parallelism: pool_bytes is per device, which holds H/G heads */
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_set(&c, "pool.devices", "0,1", err, sizeof(err)), 0);
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), 0);
    ck_assert_uint_eq(c.num_pages, 4096);

    /* an explicit num_pages wins */
    kvp_config_defaults(&c);
    c.num_pages = 10;
    c.pool_bytes = 1;
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), 0);
    ck_assert_uint_eq(c.num_pages, 10);

    /* less than one page */
    kvp_config_defaults(&c);
    c.pool_bytes = 131071;
    before = c;
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), KVP_EINVAL);
    expect_err_has("pool.pool_bytes: 131071 bytes hold no page");
    expect_err_has("131072");
    expect_unchanged(&before, &c);
    c.pool_bytes = 131072;
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), 0);
    ck_assert_uint_eq(c.num_pages, 1);

    /* more pages than page ids */
    kvp_config_defaults(&c);
    c.num_layers = 1, c.page_size = 1, c.num_kv_heads = 1, c.head_dim = 1;
    c.dtype = KVP_DTYPE_FP8_E4M3;
    c.pool_bytes = 1ull << 40;
    before = c;
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), KVP_EINVAL);
    expect_err_has("pool.pool_bytes: 1099511627776 bytes make 549755813888 pages");
    expect_unchanged(&before, &c);
}
END_TEST

START_TEST(geometry_errors_surface_with_the_geometry_message)
{
    static const struct {
        const char *key, *value;
        int code;
        const char *fragment;
    } cases[] = {
        {"pool.page_size", "0", KVP_EGEOM_PAGE_SIZE, "page_size=0: must be 1..65536"},
        {"pool.num_layers", "0", KVP_EGEOM_NUM_LAYERS, "num_layers=0"},
        {"pool.num_layers", "5000", KVP_EGEOM_NUM_LAYERS, "num_layers=5000"},
        {"pool.head_dim", "5000", KVP_EGEOM_HEAD_DIM, "head_dim=5000"},
        {"pool.num_kv_heads", "0", KVP_EGEOM_NUM_KV_HEADS, "num_kv_heads=0"},
        {"pool.devices", "0,1,2", KVP_EGEOM_NUM_DEVICES, "num_devices"},
        {"pool.num_pages", "2147483648", KVP_EGEOM_NUM_PAGES, "num_pages=2147483648"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        kvp_config_t c, before;
        kvp_config_defaults(&c);
        ck_assert_int_eq(kvp_config_set(&c, cases[i].key, cases[i].value, err, sizeof(err)), 0);
        before = c;
        ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), cases[i].code);
        expect_err_has("pool: invalid geometry: ");
        expect_err_has(cases[i].fragment);
        expect_unchanged(&before, &c);
        /* the same with num_pages given, so nothing is derived */
        if (strcmp(cases[i].key, "pool.num_pages") != 0) {
            c.num_pages = 100;
            ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), cases[i].code);
            expect_err_has(cases[i].fragment);
        }
    }
}
END_TEST

START_TEST(validation_checks_fields_and_relations)
{
    kvp_config_t c, before;
    kvp_config_defaults(&c);
    c.max_queued_bytes = 8 << 20; /* below max_frame_bytes (16 MiB) */
    before = c;
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), KVP_EINVAL);
    expect_err_has("server.max_queued_bytes (8388608) must be >= server.max_frame_bytes");
    expect_unchanged(&before, &c);

    kvp_config_defaults(&c);
    c.default_lease_ms = 5000, c.max_lease_ms = 4000;
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), KVP_EINVAL);
    expect_err_has("limits.default_lease_ms (5000) must be <= limits.max_lease_ms (4000)");

    /* fields written directly into the struct are checked like parsed ones */
    kvp_config_defaults(&c);
    c.log_level = 9;
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), KVP_EINVAL);
    expect_err_has("server.log_level: invalid value 'invalid'");
    kvp_config_defaults(&c);
    c.socket_mode = 01777;
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), KVP_EINVAL);
    expect_err_has("server.socket_mode: invalid value '1777'");
    kvp_config_defaults(&c);
    strcpy(c.socket, "kv.sock");
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), KVP_EINVAL);
    expect_err_has("server.socket: invalid value 'kv.sock': expected an absolute path");
    kvp_config_defaults(&c);
    c.devices.count = 2, c.devices.ids[1] = 0;
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), KVP_EINVAL);
    expect_err_has("pool.devices: invalid value '0,0': entry 0 is listed twice");
    kvp_config_defaults(&c);
    c.max_connections = 0;
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), KVP_EINVAL);
    expect_err_has("server.max_connections: invalid value '0': out of range 1..1048576");
    kvp_config_defaults(&c);
    c.dtype = (kvp_dtype_t)9;
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), KVP_EINVAL);
    expect_err_has("pool.dtype");
    ck_assert_int_eq(kvp_config_validate(NULL, err, sizeof(err)), KVP_EINVAL);
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_validate(&c, NULL, 0), 0);
}
END_TEST

START_TEST(dump_is_a_config_file_that_loads_back_the_same)
{
    static char a[8192], b[8192];
    const char *path = write_temp(0, full_file);
    kvp_config_t c, d;
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_load_file(&c, path, err, sizeof(err)), 0);
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), 0);
    dump_body(&c, a, sizeof(a));
    ck_assert_ptr_nonnull(strstr(a, "[server]\nsocket = /run/test/kv.sock\nsocket_mode = 0600\n"));
    ck_assert_ptr_nonnull(strstr(a, "\n[pool]\nbackend = host\ndevices = 0,1\n"));
    ck_assert_ptr_nonnull(strstr(a, "pool_bytes = 40GiB\n"));
    ck_assert_ptr_nonnull(strstr(a, "max_queued_bytes = 1GiB\n"));
    ck_assert_ptr_nonnull(strstr(a, "watchdog = false\n"));
    ck_assert_ptr_nonnull(strstr(a, "log_level = debug\n"));
    ck_assert_ptr_nonnull(strstr(a, "dtype = bf16\nlayout = hnd\nstorage = split\n"));
    ck_assert_ptr_nonnull(strstr(a, "max_buffer_bytes = 2TiB\n"));
    ck_assert_ptr_nonnull(strstr(a, "[access]\nallowed_uids = 1000,1001\nallowed_gids = 50\n"));

    kvp_config_defaults(&d);
    ck_assert_int_eq(kvp_config_load_string(&d, a, "dump", err, sizeof(err)), 0);
    ck_assert_int_eq(kvp_config_validate(&d, err, sizeof(err)), 0);
    ck_assert_str_eq(dump_body(&d, b, sizeof(b)), a);
    expect_full_file(&d);

    /* defaults, with the derived num_pages and empty strings */
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), 0);
    dump_body(&c, a, sizeof(a));
    ck_assert_ptr_nonnull(strstr(a, "num_pages = 2048\npool_bytes = 256MiB\n"));
    ck_assert_ptr_nonnull(strstr(a, "socket_group = \n"));
    ck_assert_ptr_nonnull(strstr(a, "max_frame_bytes = 16MiB\n"));
    ck_assert_ptr_nonnull(strstr(a, "copy_threads = 0\n"));
    kvp_config_defaults(&d);
    ck_assert_int_eq(kvp_config_load_string(&d, a, "dump", err, sizeof(err)), 0);
    ck_assert_str_eq(dump_body(&d, b, sizeof(b)), a);

    /* the longest lists: 64 ten-digit ids take several lines, each within inih's limit */
    kvp_config_defaults(&c);
    c.allowed_uids.count = 64;
    for (uint32_t i = 0; i < 64; i++)
        c.allowed_uids.ids[i] = 4000000000u + i;
    dump_body(&c, a, sizeof(a));
    ck_assert_ptr_nonnull(strstr(a, "allowed_uids = 4000000000,4000000001,"));
    ck_assert_ptr_nonnull(strstr(a, ",4000000015\nallowed_uids = 4000000016,"));
    kvp_config_defaults(&d);
    ck_assert_msg(kvp_config_load_string(&d, a, "dump", err, sizeof(err)) == 0, "%s", err);
    ck_assert_uint_eq(d.allowed_uids.count, 64);
    ck_assert_uint_eq(d.allowed_uids.ids[63], 4000000063u);
    ck_assert_str_eq(dump_body(&d, b, sizeof(b)), a);
    unlink(path);
}
END_TEST

START_TEST(reload_keeps_and_lists_settings_that_need_a_restart)
{
    const char *path = write_temp(2, "[server]\nlog_level = info\n[pool]\nnum_layers = 2\n"
                                     "page_size = 16\n[limits]\nmax_seqs = 100\n");
    char *argv[] = {"kvpoold", "--config", (char *)path, "--page-size", "32", NULL};
    kvp_config_t old, next, before;
    kvp_config_action_t action;
    kvp_config_defaults(&old);
    ck_assert_int_eq(kvp_config_parse_args(&old, 5, argv, &action, err, sizeof(err)), 0);
    ck_assert_int_eq(kvp_config_validate(&old, err, sizeof(err)), 0);
    ck_assert_uint_eq(old.num_pages, 1024); /* 256 MiB / (2 x 2 x 32 x 8 x 128 x 2) */

    /* only reloadable changes; page_size in the file changes, but the flag still rules */
    rewrite(path, "[server]\nlog_level = debug\nmax_connections = 9\n[pool]\nnum_layers = 2\n"
                  "page_size = 64\n[limits]\nmax_seqs = 100\nmax_batch_tokens = 200\n"
                  "ns_max_seqs = 7\nns_max_pages = 70\nns_max_buffer_bytes = 1M\n"
                  "ns_max_connections = 2\n[access]\nallowed_gids = 5\n");
    strcpy(err, "x");
    ck_assert_int_eq(kvp_config_reload_file(&old, path, &next, err, sizeof(err)), 0);
    ck_assert_str_eq(err, "");
    ck_assert_int_eq(next.log_level, KVP_LOG_DEBUG);
    ck_assert_uint_eq(next.max_connections, 9);
    ck_assert_uint_eq(next.max_batch_tokens, 200);
    ck_assert_uint_eq(next.ns_max_seqs, 7); /* the quotas are reloadable */
    ck_assert_uint_eq(next.ns_max_pages, 70);
    ck_assert_uint_eq(next.ns_max_buffer_bytes, 1u << 20);
    ck_assert_uint_eq(next.ns_max_connections, 2);
    ck_assert_uint_eq(next.allowed_gids.count, 1);
    ck_assert_uint_eq(next.page_size, 32);
    ck_assert_uint_eq(next.num_pages, 1024);
    ck_assert_uint_eq(next.num_overrides, 1);
    ck_assert_str_eq(next.config_path, path);

    /* changes that need a restart are listed and keep their running values */
    rewrite(path, "[server]\nlog_level = err\nsocket = /run/other.sock\nwatchdog = off\n"
                  "[pool]\nnum_layers = 4\n[limits]\nmax_seqs = 300\n");
    ck_assert_int_eq(kvp_config_reload_file(&old, path, &next, err, sizeof(err)), 5);
    ck_assert_str_eq(err, "not reloadable, restart to apply: server.socket, server.watchdog, "
                          "pool.num_layers, pool.num_pages, limits.max_seqs");
    ck_assert_int_eq(next.log_level, KVP_LOG_ERR);
    ck_assert_uint_eq(next.max_seqs, 100);
    ck_assert_str_eq(next.socket, old.socket);
    ck_assert(next.watchdog);
    ck_assert_uint_eq(next.num_layers, 2);
    ck_assert_uint_eq(next.num_pages, 1024);
    ck_assert_uint_eq(next.page_size, 32);

    /* a broken file: an error, next untouched */
    rewrite(path, "[limits]\nmax_seqs = lots\n");
    before = next;
    ck_assert_int_eq(kvp_config_reload_file(&old, path, &next, err, sizeof(err)), KVP_EINVAL);
    expect_err_has(":2: limits.max_seqs: invalid value 'lots'");
    expect_unchanged(&before, &next);
    rewrite(path, "[limits]\ndefault_lease_ms = 10\nmax_lease_ms = 5\n");
    ck_assert_int_eq(kvp_config_reload_file(&old, path, &next, err, sizeof(err)), KVP_EINVAL);
    expect_err_has("limits.default_lease_ms (10) must be <= limits.max_lease_ms (5)");
    expect_unchanged(&before, &next);

    /* a reloadable value that only fits the new value of a kept one */
    rewrite(path, "[server]\nmax_frame_bytes = 4KiB\nmax_queued_bytes = 8KiB\n");
    ck_assert_int_eq(kvp_config_reload_file(&old, path, &next, err, sizeof(err)), KVP_EINVAL);
    expect_err_has("server.max_frame_bytes");
    expect_err_has("server.max_queued_bytes (8192) must be >= server.max_frame_bytes (16777216)");
    expect_unchanged(&before, &next);

    ck_assert_int_eq(kvp_config_reload_file(&old, "/nonexistent/k.conf", &next, err, sizeof(err)),
                     -ENOENT);
    ck_assert_int_eq(kvp_config_reload_file(&old, path, (kvp_config_t *)&old, err, sizeof(err)),
                     KVP_EINVAL);
    unlink(path);
}
END_TEST

/* ---- [tuning]: file < environment < --set ------------------------------------------------ */

static const char *const tuning_vars[] = {
    "KVPOOL_CUDA_READY_TIMEOUT_MS", "KVPOOL_CUDA_PLAN_UPLOAD",
    "KVPOOL_APPEND_KERNEL",         "KVPOOL_APPEND_TOKENS_PER_BLOCK",
    "KVPOOL_APPEND_BLOCKS_PER_SM",  "KVPOOL_APPEND_WARPS_PER_BLOCK",
    "KVPOOL_APPEND_HINTS",          "KVPOOL_PACK_BLOCKS",
    "KVPOOL_XFER_STAGES",           "KVPOOL_XFER_REGISTER",
    "KVPOOL_XFER_PRIORITY",         "KVPOOL_NCCL_LIB",
};

/* The tests below own the environment's [tuning] variables: none is set when they start. */
static void clear_tuning_env(void)
{
    for (size_t i = 0; i < sizeof(tuning_vars) / sizeof(tuning_vars[0]); i++)
        unsetenv(tuning_vars[i]);
}

START_TEST(tuning_key_from_the_file)
{
    clear_tuning_env();
    kvp_config_t c;
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_load_string(&c,
                                            "[tuning]\nxfer_stages = 4\nappend_kernel = WARP\n"
                                            "append_hints = st\ncuda_ready_timeout_ms = 1\n"
                                            "nccl_lib =\n",
                                            "t.ini", err, sizeof(err)),
                     0);
    ck_assert_uint_eq(c.xfer_stages, 4);
    ck_assert_uint_eq(c.append_kernel, 1);
    ck_assert_uint_eq(c.append_hints, 2);
    ck_assert_uint_eq(c.cuda_ready_timeout_ms, 1);
    ck_assert_str_eq(c.nccl_lib, "");    /* empty: the loader's libnccl.so.2 */
    ck_assert_uint_eq(c.pack_blocks, 0); /* not in the file: the default */
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), 0);
    /* the newest kernel name, the last of the enum */
    ck_assert_int_eq(
        kvp_config_load_string(&c, "[tuning]\nappend_kernel = flat\n", "t.ini", err, sizeof(err)),
        0);
    ck_assert_uint_eq(c.append_kernel, 3);

    /* a value out of range names the file, the line, the key and the range */
    expect_load_error(
        "[tuning]\n\nappend_warps_per_block = 9\n",
        "f.ini:3: tuning.append_warps_per_block: invalid value '9': out of range 0..8", NULL);
    expect_load_error("[tuning]\nbogus = 1\n", "f.ini:2: unknown key 'bogus' in section [tuning]",
                      NULL);
    /* a file load alone never reads the environment */
    setenv("KVPOOL_XFER_STAGES", "3", 1);
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_load_string(&c, "[tuning]\n", "t.ini", err, sizeof(err)), 0);
    ck_assert_uint_eq(c.xfer_stages, 2);
    unsetenv("KVPOOL_XFER_STAGES");
}
END_TEST

START_TEST(environment_overrides_the_file_and_set_overrides_the_environment)
{
    clear_tuning_env();
    const char *path = write_temp(0, "[tuning]\nxfer_stages = 3\ncuda_ready_timeout_ms = 5000\n"
                                     "pack_blocks = 32\n[limits]\nmax_seqs = 77\n");
    setenv("KVPOOL_XFER_STAGES", "4", 1);
    setenv("KVPOOL_APPEND_KERNEL", "Block", 1);
    setenv("KVPOOL_XFER_REGISTER", "1", 1);
    setenv("KVPOOL_PACK_BLOCKS", "66", 1);
    setenv("KVPOOL_MAX_SEQS", "5", 1); /* not a [tuning] key: never read */
    char *argv[] = {"kvpoold", "--set", "tuning.pack_blocks=264", "--config", (char *)path, NULL};
    kvp_config_t c;
    kvp_config_action_t action;
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_parse_args(&c, 5, argv, &action, err, sizeof(err)), 0);
    ck_assert_int_eq(action, KVP_CONFIG_RUN);
    ck_assert_uint_eq(c.xfer_stages, 4);              /* environment over the file */
    ck_assert_uint_eq(c.cuda_ready_timeout_ms, 5000); /* the file: no variable */
    ck_assert_uint_eq(c.append_kernel, 2);            /* environment over the default */
    ck_assert(c.xfer_register);
    ck_assert_uint_eq(c.pack_blocks, 264); /* --set over the environment over the file */
    ck_assert_uint_eq(c.max_seqs, 77);
    ck_assert_uint_eq(c.num_overrides, 1); /* the environment is not a command-line setting */
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), 0);

    /* a reload reads the environment again: nothing changed, nothing to report */
    kvp_config_t next;
    strcpy(err, "x");
    ck_assert_int_eq(kvp_config_reload_file(&c, path, &next, err, sizeof(err)), 0);
    ck_assert_str_eq(err, "");
    ck_assert_uint_eq(next.xfer_stages, 4);
    ck_assert_uint_eq(next.pack_blocks, 264);
    ck_assert_uint_eq(next.append_kernel, 2);
    /* a changed [tuning] key needs a restart: listed, and the running value kept */
    setenv("KVPOOL_XFER_STAGES", "2", 1);
    ck_assert_int_eq(kvp_config_reload_file(&c, path, &next, err, sizeof(err)), 1);
    ck_assert_str_eq(err, "not reloadable, restart to apply: tuning.xfer_stages");
    ck_assert_uint_eq(next.xfer_stages, 4);

    /* no file at all: the environment over the defaults, the flags over it */
    char *argv2[] = {"kvpoold", "--set=tuning.xfer_stages=3", NULL};
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_parse_args(&c, 2, argv2, &action, err, sizeof(err)), 0);
    ck_assert_uint_eq(c.xfer_stages, 3);
    ck_assert_uint_eq(c.append_kernel, 2);
    ck_assert_uint_eq(c.pack_blocks, 66);
    ck_assert_uint_eq(c.max_seqs, 65536);

    /* kvp_config_apply_env alone */
    kvp_config_defaults(&c);
    strcpy(err, "x");
    ck_assert_int_eq(kvp_config_apply_env(&c, err, sizeof(err)), 0);
    ck_assert_str_eq(err, "");
    ck_assert_uint_eq(c.xfer_stages, 2);
    ck_assert_uint_eq(c.pack_blocks, 66);
    unsetenv("KVPOOL_MAX_SEQS");
    clear_tuning_env();
    unlink(path);
}
END_TEST

/* parse_args with the variable name=value set must fail naming it, cfg unchanged. */
static void expect_env_error(const char *name, const char *value, const char *want)
{
    char *argv[] = {"kvpoold", "--check-config", NULL};
    clear_tuning_env();
    setenv(name, value, 1);
    expect_args_error(2, argv, KVP_EINVAL, want, NULL);
    ck_assert_str_eq(err, want);
    kvp_config_t c, before;
    kvp_config_defaults(&c);
    before = c;
    ck_assert_int_eq(kvp_config_apply_env(&c, err, sizeof(err)), KVP_EINVAL);
    ck_assert_str_eq(err, want);
    expect_unchanged(&before, &c);
    unsetenv(name);
}

START_TEST(a_bad_environment_value_is_refused_naming_the_variable_and_the_range)
{
    expect_env_error("KVPOOL_XFER_STAGES", "9",
                     "environment KVPOOL_XFER_STAGES: tuning.xfer_stages: invalid value '9': "
                     "out of range 2..4");
    expect_env_error("KVPOOL_CUDA_READY_TIMEOUT_MS", "",
                     "environment KVPOOL_CUDA_READY_TIMEOUT_MS: tuning.cuda_ready_timeout_ms: "
                     "invalid value '': expected an unsigned decimal integer");
    expect_env_error("KVPOOL_PACK_BLOCKS", "66 ",
                     "environment KVPOOL_PACK_BLOCKS: tuning.pack_blocks: invalid value '66 ': "
                     "expected an unsigned decimal integer");
    expect_env_error("KVPOOL_APPEND_HINTS", "both",
                     "environment KVPOOL_APPEND_HINTS: tuning.append_hints: invalid value 'both': "
                     "expected none|ld|st|ldst");
    expect_env_error("KVPOOL_CUDA_PLAN_UPLOAD", "2",
                     "environment KVPOOL_CUDA_PLAN_UPLOAD: tuning.cuda_plan_upload: invalid value "
                     "'2': expected true or false (yes/no, on/off, 1/0)");

    /* a bad variable stops the start even when --set would override the key afterwards: the
     * environment is checked as a whole, like a file */
    setenv("KVPOOL_XFER_STAGES", "0", 1);
    char *argv[] = {"kvpoold", "--set", "tuning.xfer_stages=2", NULL};
    expect_args_error(3, argv, KVP_EINVAL,
                      "environment KVPOOL_XFER_STAGES: tuning.xfer_stages: "
                      "invalid value '0': out of range 2..4",
                      NULL);
    unsetenv("KVPOOL_XFER_STAGES");
    /* and a bad --set value names the flag and the range */
    char *argv2[] = {"kvpoold", "--set", "tuning.append_blocks_per_sm=4096", NULL};
    expect_args_error(3, argv2, KVP_EINVAL,
                      "--set: tuning.append_blocks_per_sm: invalid value '4096': out of range "
                      "0..1024",
                      NULL);
}
END_TEST

START_TEST(check_config_dump_shows_the_tuning_keys)
{
    static char a[8192], b[8192];
    clear_tuning_env();
    kvp_config_t c, d;
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), 0);
    dump_body(&c, a, sizeof(a));
    const char *tuning = strstr(a, "\n[tuning]\n");
    ck_assert_ptr_nonnull(tuning);
    ck_assert_str_eq(tuning, "\n[tuning]\n"
                             "cuda_ready_timeout_ms = 30000\n"
                             "cuda_plan_upload = false\n"
                             "append_kernel = auto\n"
                             "append_tokens_per_block = 0\n"
                             "append_blocks_per_sm = 0\n"
                             "append_warps_per_block = 0\n"
                             "append_hints = none\n"
                             "append_vecs_per_thread = 0\n"
                             "pack_blocks = 0\n"
                             "xfer_stages = 2\n"
                             "xfer_register = false\n"
                             "xfer_priority = false\n"
                             "nccl_lib = libnccl.so.2\n");

    /* what --check-config prints: the effective values, the environment's included */
    setenv("KVPOOL_APPEND_HINTS", "ld", 1);
    setenv("KVPOOL_NCCL_LIB", "/x/libnccl.so.2", 1);
    char *argv[] = {"kvpoold", "--check-config", "--set", "tuning.append_warps_per_block=4", NULL};
    kvp_config_action_t action;
    kvp_config_defaults(&c);
    ck_assert_int_eq(kvp_config_parse_args(&c, 4, argv, &action, err, sizeof(err)), 0);
    ck_assert_int_eq(action, KVP_CONFIG_CHECK);
    ck_assert_int_eq(kvp_config_validate(&c, err, sizeof(err)), 0);
    dump_body(&c, a, sizeof(a));
    ck_assert_ptr_nonnull(strstr(a, "\nappend_warps_per_block = 4\nappend_hints = ld\n"));
    ck_assert_ptr_nonnull(strstr(a, "\nnccl_lib = /x/libnccl.so.2\n"));
    clear_tuning_env();
    /* and it loads back the same */
    kvp_config_defaults(&d);
    ck_assert_int_eq(kvp_config_load_string(&d, a, "dump", err, sizeof(err)), 0);
    ck_assert_int_eq(kvp_config_validate(&d, err, sizeof(err)), 0);
    ck_assert_str_eq(dump_body(&d, b, sizeof(b)), a);
    ck_assert_uint_eq(d.append_hints, 1);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("config");
    TCase *tc = tcase_create("config");
    tcase_add_test(tc, defaults_are_the_documented_ones);
    tcase_add_test(tc, default_socket_of_an_unprivileged_user);
    tcase_add_test(tc, file_sets_every_key);
    tcase_add_test(tc, structure_errors_name_file_line_and_key);
    tcase_add_test(tc, bad_values_name_the_key_and_the_value);
    tcase_add_test(tc, values_in_every_accepted_form);
    tcase_add_test(tc, flags_apply_over_the_file_whatever_their_order);
    tcase_add_test(tc, set_reaches_any_key);
    tcase_add_test(tc, command_line_errors);
    tcase_add_test(tc, help_and_version_load_nothing);
    tcase_add_test(tc, num_pages_is_derived_from_pool_bytes);
    tcase_add_test(tc, geometry_errors_surface_with_the_geometry_message);
    tcase_add_test(tc, validation_checks_fields_and_relations);
    tcase_add_test(tc, dump_is_a_config_file_that_loads_back_the_same);
    tcase_add_test(tc, reload_keeps_and_lists_settings_that_need_a_restart);
    tcase_add_test(tc, tuning_key_from_the_file);
    tcase_add_test(tc, environment_overrides_the_file_and_set_overrides_the_environment);
    tcase_add_test(tc, a_bad_environment_value_is_refused_naming_the_variable_and_the_range);
    tcase_add_test(tc, check_config_dump_shows_the_tuning_keys);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
