/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kvp_config_doc.c - the configuration written out: --check-config's dump of the effective
 * settings, and the documentation of every key (the KEYS chapter of kvpoold.conf(5), the
 * example deploy/kvpoold.conf), both from the rows of the settings table (kvp_config.c,
 * rpc/kvp_rpc_limits.h) so that a key is documented where it is defined. The documentation is
 * written at build time by kvp_confdoc (kvp_confdoc.c); nothing here parses.
 */
#include "kvp_config.h"

#include <ctype.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvp_config_internal.h"
#include "kvp_error.h"

#define EXAMPLE_WIDTH 96 /* columns of the example file's comment lines */

static const void *cfield(const kvp_config_t *cfg, const kvp__config_setting_t *s)
{
    return (const char *)cfg + s->offset;
}

void kvp_config_dump(const kvp_config_t *cfg, FILE *out)
{
    char text[1024];
    const char *section = "";
    fprintf(out, "; kvpoold effective configuration%s%s\n", cfg->config_path[0] ? ": " : "",
            cfg->config_path);
    const kvp__config_setting_t *s;
    for (size_t i = 0; (s = kvp__config_setting(i)); i++) {
        if (strcmp(section, s->section) != 0) {
            section = s->section;
            fprintf(out, "%s[%s]\n", i ? "\n" : "", section);
        }
        if (s->type == T_IDLIST) { /* 16 entries a line keep lines within inih's limit */
            const kvp_config_idlist_t *l = cfield(cfg, s);
            for (uint32_t k = 0; k == 0 || k < l->count; k += 16) {
                fprintf(out, "%s = ", s->name);
                for (uint32_t j = k; j < l->count && j < k + 16; j++)
                    fprintf(out, "%s%u", j > k ? "," : "", l->ids[j]);
                fputc('\n', out);
            }
            continue;
        }
        kvp__config_format(cfg, i, text, sizeof(text));
        fprintf(out, "%s = %s\n", s->name, text);
    }
}

/* ---- kvpoold.conf(5) ------------------------------------------------------------------- */

static const char *reload_rule(const kvp__config_setting_t *s)
{
    return s->reloadable ? "Reloadable." : "Restart to apply.";
}

static void keys_man(FILE *out)
{
    kvp_config_t def;
    char text[1024];
    const char *section = "";
    kvp_config_defaults(&def);
    fprintf(out, "# KEYS\n");
    const kvp__config_setting_t *s;
    for (size_t i = 0; (s = kvp__config_setting(i)); i++) {
        if (strcmp(section, s->section) != 0) {
            section = s->section;
            fprintf(out, "\n## [%s]\n\n%s\n", section, kvp__config_section_doc(section));
        }
        if (s->type == T_SOCKET && !s->def_text)
            snprintf(text, sizeof(text), "_PATH_"); /* depends on who runs the daemon */
        else
            kvp__config_format(&def, i, text, sizeof(text));
        fprintf(out, "\n*%s* = %s\n\t%s *%s*\n", s->name, text[0] ? text : "(empty)", s->doc,
                reload_rule(s));
    }
}

/* ---- the example file ------------------------------------------------------------------ */

/* scdoc text as plain text: *bold* and _italic_ marks dropped (an underscore inside a word,
 * as in max_seqs, is a letter), backslash escapes resolved. Returns a malloc'd string. */
static char *plain(const char *doc)
{
    size_t n = strlen(doc);
    char *out = malloc(n + 1), *o = out;
    if (!out)
        return NULL;
    int italic = 0;
    for (size_t i = 0; i < n; i++) {
        char c = doc[i];
        if (c == '\\' && i + 1 < n) {
            *o++ = doc[++i];
            continue;
        }
        if (c == '*')
            continue;
        if (c == '_') {
            unsigned char prev = i ? (unsigned char)doc[i - 1] : ' ';
            unsigned char next = (unsigned char)doc[i + 1];
            if (!italic && !isalnum(prev) && next && !isspace(next)) {
                italic = 1;
                continue;
            }
            if (italic && !isalnum(next) && next != '\\') {
                italic = 0;
                continue;
            }
        }
        *o++ = c;
    }
    *o = '\0';
    return out;
}

/* text as '#' comment lines of at most EXAMPLE_WIDTH columns. */
static void comment(FILE *out, const char *text)
{
    const char *p = text;
    while (*p) {
        while (*p == ' ')
            p++;
        size_t len = strlen(p);
        if (len + 2 > EXAMPLE_WIDTH) {
            len = EXAMPLE_WIDTH - 2;
            while (len > 0 && p[len] != ' ')
                len--;
            if (len == 0) /* one word longer than a line */
                len = strcspn(p, " ");
        }
        fprintf(out, "# %.*s\n", (int)len, p);
        p += len;
    }
}

static int keys_example(FILE *out, const kvp_config_t *example, const bool *set)
{
    kvp_config_t def;
    char text[1024];
    const char *section = "";
    kvp_config_defaults(&def);
    const kvp__config_setting_t *s;
    for (size_t i = 0; (s = kvp__config_setting(i)); i++) {
        if (strcmp(section, s->section) != 0) {
            section = s->section;
            char *intro = plain(kvp__config_section_doc(section));
            if (!intro)
                return -1;
            fprintf(out, "\n[%s]\n", section);
            comment(out, intro);
            fputc('\n', out);
            free(intro);
        }
        char *doc = plain(s->doc);
        if (!doc)
            return -1;
        size_t len = strlen(doc);
        char *para = malloc(len + 32);
        if (!para) {
            free(doc);
            return -1;
        }
        snprintf(para, len + 32, "%s %s", doc, reload_rule(s));
        comment(out, para);
        free(para);
        free(doc);
        if (set[i]) {
            kvp__config_format(example, i, text, sizeof(text));
            fprintf(out, "%s = %s\n", s->name, text);
            continue;
        }
        if (s->type == T_SOCKET && !s->def_text)
            snprintf(text, sizeof(text), "/run/kvpool/kvpool.sock"); /* as root, the service */
        else
            kvp__config_format(&def, i, text, sizeof(text));
        fprintf(out, "#%s =%s%s\n", s->name, text[0] ? " " : "", text);
    }
    return 0;
}

/* ---- templates ------------------------------------------------------------------------- */

#define MARK_KEYS "@kvp_config_keys"
#define MARK_SET  "@kvp_config_set "

/* The whole of fp as a NUL-terminated malloc'd string, or NULL. */
static char *slurp(FILE *fp)
{
    size_t len = 0, cap = 4096;
    char *buf = malloc(cap);
    size_t n;
    while (buf && (n = fread(buf + len, 1, cap - len - 1, fp)) > 0) {
        len += n;
        if (len + 1 == cap) {
            char *bigger = realloc(buf, cap * 2);
            if (!bigger)
                free(buf);
            buf = bigger;
            cap *= 2;
        }
    }
    if (buf)
        buf[len] = '\0';
    return buf;
}

int kvp_config_doc_render(kvp_config_doc_t kind, FILE *tmpl, FILE *out, char *err, size_t err_len)
{
    size_t num = 0;
    while (kvp__config_setting(num))
        num++;
    char *text = slurp(tmpl);
    bool *set = calloc(num, sizeof(*set));
    kvp_config_t *example = malloc(sizeof(*example));
    int rc = KVP_ENOMEM, keys = 0;
    if (!text || !set || !example)
        goto free_all;
    kvp_config_defaults(example);
    /* pass 1: the example's own settings, checked as a file line would be */
    for (char *line = text; *line;) {
        char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        if (kind == KVP_CONFIG_DOC_EXAMPLE && strncmp(line, MARK_SET, strlen(MARK_SET)) == 0) {
            char key[128], value[KVP_CONFIG_VALUE_MAX];
            const char *p = line + strlen(MARK_SET), *eq = memchr(p, '=', len - strlen(MARK_SET));
            size_t klen = eq ? (size_t)(eq - p) : 0, vlen = eq ? len - (size_t)(eq + 1 - line) : 0;
            while (klen && p[klen - 1] == ' ')
                klen--;
            while (vlen && eq[1] == ' ')
                eq++, vlen--;
            rc = KVP_EINVAL;
            if (!eq || klen >= sizeof(key) || vlen >= sizeof(value)) {
                snprintf(err, err_len, "bad line: %.*s", (int)len, line);
                goto free_all;
            }
            snprintf(key, sizeof(key), "%.*s", (int)klen, p);
            snprintf(value, sizeof(value), "%.*s", (int)vlen, eq + 1);
            if ((rc = kvp_config_set(example, key, value, err, err_len)) < 0)
                goto free_all;
            for (size_t i = 0; i < num; i++) {
                const kvp__config_setting_t *s = kvp__config_setting(i);
                size_t sl = strlen(s->section);
                if (strncmp(key, s->section, sl) == 0 && key[sl] == '.' &&
                    strcmp(key + sl + 1, s->name) == 0)
                    set[i] = true;
            }
        }
        line += len + (end != NULL);
    }
    /* pass 2: the template with the keys in place of the mark and the settings' lines gone */
    for (char *line = text; *line;) {
        char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        if (len == strlen(MARK_KEYS) && strncmp(line, MARK_KEYS, len) == 0) {
            keys++;
            if (kind == KVP_CONFIG_DOC_MAN)
                keys_man(out);
            else if (keys_example(out, example, set) < 0) {
                rc = KVP_ENOMEM;
                goto free_all;
            }
        } else if (!(kind == KVP_CONFIG_DOC_EXAMPLE &&
                     strncmp(line, MARK_SET, strlen(MARK_SET)) == 0)) {
            fprintf(out, "%.*s\n", (int)len, line);
        }
        line += len + (end != NULL);
    }
    rc = 0;
    if (keys != 1) {
        rc = KVP_EINVAL;
        snprintf(err, err_len, "the template has %d lines " MARK_KEYS ", not one", keys);
    }
free_all:
    free(example);
    free(set);
    free(text);
    if (rc == KVP_ENOMEM)
        snprintf(err, err_len, "out of memory");
    return rc;
}
