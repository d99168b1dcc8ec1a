#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""test_man.py - the man pages (docs/man/*.scd, rendered by docs/CMakeLists.txt) render, and
kvpoold.conf(5) documents every configuration key, in its section, with its reload rule.

    test_man.py MAN_BUILD_DIR SOURCE_DIR [KVPOOLD [KVPOOLCTL]]

MAN_BUILD_DIR holds the generated roff (kvpoold.8, kvpoolctl.1, kvpoold.conf.5) and their .gz.
Each page must carry its .TH line and render: through `man -l` when man(1) is there, else
through groff -man, in both cases with groff's warnings turned on and none allowed; with
neither, the roff must at least be non-empty. The keys come from the settings table (the rows of
server/kvp_config.c and rpc/kvp_rpc_limits.h: section, key, RELOAD or RESTART); each must have
an entry "*key* = default" under "## [section]" in kvpoold.conf.5, ending in "Reloadable."
when the table says reloadable and "Restart to apply." otherwise, and no entry may name a key
the table lacks. So a new key without its documentation, a stale one, or a reload rule that
changed fails here. With KVPOOLD (the built daemon), each documented default must also be
what `kvpoold --check-config` prints with no file (sizes compared in bytes), except a default
written as a placeholder (_PATH_: it depends on who runs the daemon) and pool.num_pages, which
the daemon derives from pool_bytes; and every option of `kvpoold --help` must be described in
kvpoold(8). With KVPOOLCTL too, every command and option of `kvpoolctl --help` must be
described in kvpoolctl(1). With KVP_EXAMPLE_CONF naming the generated example kvpoold.conf,
it must list every key of the table, in its section, with its reload rule at the end of its
comment and, commented out, the default kvpoold.conf(5) gives (or the example's own value).
"""
import gzip
import os
import re
import shutil
import subprocess
import sys

PAGES = [("kvpoold.8", "kvpoold", "8"), ("kvpoolctl.1", "kvpoolctl", "1"),
         ("kvpoold.conf.5", "kvpoold.conf", "5")]
failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL: " + msg)


def render(path):
    """The page as text, or None when neither man nor groff is there. Fails on a warning."""
    env = dict(os.environ, MANWIDTH="100", LC_ALL="C.UTF-8")
    if shutil.which("man"):
        cmd = ["man", "--warnings=w", "-l", path]
    elif shutil.which("groff"):
        cmd = ["groff", "-man", "-Tutf8", "-ww", path]
    else:
        return None
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    if p.returncode != 0:
        fail("%s: %s exited %d: %s" % (path, cmd[0], p.returncode, p.stderr.strip()))
    if p.stderr.strip():
        fail("%s: warnings from %s: %s" % (path, cmd[0], p.stderr.strip()))
    # grotty's bold and underline (SGR escapes, or overstrikes where those are off)
    return re.sub(r".\x08", "", re.sub(r"\x1b\[[0-9;]*m", "", p.stdout))


def config_table(src):
    """{(section, key): reloadable} from the settings table: the rows of server/kvp_config.c
    (ROW, ROWF and ENUM) and of rpc/kvp_rpc_limits.h and server/kvp_server_limits.h (X), each naming
    its section and key first and holding one RELOAD or RESTART before its doc string."""
    keys = {}
    for path, table, row in (
            (("server", "kvp_config.c"), r"static const setting_t settings\[\] = \{(.*?)\n\};",
             r"ROWF?|ENUM"),
            (("rpc", "kvp_rpc_limits.h"), r"(#define KVP_RPC_LIMITS_KEYS.*?)\n\n/\* clang-format on",
             r"X"),
            (("server", "kvp_server_limits.h"),
             r"(#define KVP_SERVER_LIMITS_KEYS.*?)\n/\* clang-format on", r"X")):
        text = open(os.path.join(src, *path), encoding="utf-8").read()
        m = re.search(table, text, re.S)
        if not m:
            sys.exit("no settings table in %s" % os.path.join(*path))
        for e in re.finditer(r"\b(?:%s)\(\s*(\w+),\s*(\w+),[^\n]*?\b(RELOAD|RESTART)\b" % row,
                             m.group(1)):
            if (e.group(1), e.group(2)) in keys:
                sys.exit("%s.%s twice in the settings table" % (e.group(1), e.group(2)))
            keys[(e.group(1), e.group(2))] = e.group(3) == "RELOAD"
    if len(keys) < 50:  # the table has 82 keys today: a parse that finds few is broken
        sys.exit("only %d keys read from the settings table" % len(keys))
    return keys


def example_keys(path):
    """{(section, key): (the comment lines above it, value, commented out)} of the example
    kvpoold.conf."""
    keys = {}
    section = None
    notes = []
    for line in open(path, encoding="utf-8").read().split("\n"):
        m = re.match(r"^\[(\w+)\]$", line)
        if m:
            section, notes = m.group(1), []
            continue
        m = re.match(r"^(#?)(\w+) =(?: (.*))?$", line)
        if m and section:
            key = (section, m.group(2))
            if key in keys:
                fail("%s: %s.%s listed twice" % (path, section, m.group(2)))
            keys[key] = (" ".join(notes), m.group(3) or "", m.group(1) == "#")
            notes = []
        elif line.startswith("# "):
            notes.append(line[2:])
        elif not line.strip():
            notes = []
    return keys


def check_example(path, table, defaults):
    """Every key of the table in the example file, in its section, its comment ending in its
    reload rule, and commented out with the default of kvpoold.conf(5) unless the example sets
    it; no key the table lacks."""
    if not os.path.isfile(path):
        fail("%s: missing (build the example_config target)" % path)
        return
    ex = example_keys(path)
    for (section, key), reloadable in sorted(table.items()):
        entry = ex.get((section, key))
        if entry is None:
            fail("%s does not list %s.%s" % (path, section, key))
            continue
        notes, value, commented = entry
        want = "Reloadable." if reloadable else "Restart to apply."
        if not notes.endswith(want):
            fail("%s: the comment of %s.%s should end in \"%s\"" % (path, section, key, want))
        documented = re.sub(r"\\f[BIR]|\\&", "", defaults.get((section, key), ""))
        if commented and "\\fI" not in defaults.get((section, key), "\\fI") and \
                size_norm(documented) != size_norm(value):
            fail("%s gives %s.%s the default '%s'; kvpoold.conf(5): '%s'"
                 % (path, section, key, value, documented))
    for k in sorted(set(ex) - set(table)):
        fail("%s lists %s.%s, which the settings table does not have" % ((path,) + k))


def documented_keys(roff):
    """{(section, key): entry text} from the roff of kvpoold.conf.5."""
    doc = {}
    defaults = {}
    section = None
    key = None
    for line in roff.split("\n"):
        m = re.match(r"^\.S[SH] (.*)$", line)
        if m:
            t = m.group(1).strip().strip('"')
            s = re.match(r"^\[(\w+)\]$", t)
            section = s.group(1) if s else None
            key = None
            continue
        m = re.match(r"^\\fB(\w+)\\fR = (.*)$", line)
        if m and section:
            key = (section, m.group(1))
            if key in doc:
                fail("kvpoold.conf(5): %s.%s documented twice" % key)
            doc[key] = ""
            defaults[key] = m.group(2).replace("\\&", "").strip()
            continue
        if key:
            if line.startswith(".RE"):
                key = None
            elif not line.startswith("."):
                doc[key] += " " + line
    return doc, defaults


def size_norm(v):
    """A value as kvpoold.conf(5) or --check-config writes it, sizes in bytes."""
    v = v.strip()
    if v == "(empty)":
        return ""
    m = re.match(r"^(\d+)\s*([KMGT])(iB)?$", v)
    if m:
        return str(int(m.group(1)) << (10 * ("KMGT".index(m.group(2)) + 1)))
    return v


def check_help(program, page, title, commands):
    """Every --option (and, when commands, every command) of `program --help` is a term of the
    page: in bold on a line of its roff that starts in bold (a command: at its start)."""
    p = subprocess.run([program, "--help"], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        fail("%s --help exited %d" % (program, p.returncode))
        return
    roff = open(page, encoding="utf-8").read().replace("\\&", "")
    terms = set()
    heads = set()
    for line in roff.split("\n"):
        if not line.startswith("\\fB"):
            continue
        heads.add(re.match(r"\\fB([^\\]+)\\fR", line).group(1).strip())
        for m in re.finditer(r"\\fB([^\\]+)\\fR", line):
            terms.add(m.group(1).strip())
    for opt in sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", p.stdout))):
        if opt not in terms:
            fail("%s does not describe %s (in %s --help)" % (title, opt, program))
    if not commands:
        return
    section = None
    for line in p.stdout.split("\n"):
        if re.match(r"^\w.*:$", line):
            section = line
            continue
        m = re.match(r"^  ([a-z][a-z ]*[a-z])(?=  | \[|$)", line)
        if section == "commands:" and m and m.group(1) not in heads:
            fail("%s does not describe the command '%s' (in %s --help)"
                 % (title, m.group(1), program))


def check_defaults(kvpoold, defaults):
    p = subprocess.run([kvpoold, "--check-config"], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        fail("kvpoold --check-config exited %d: %s" % (p.returncode, p.stderr.strip()))
        return
    env_tuning = [k for k in os.environ if k.startswith("KVPOOL_")]
    section = None
    for line in p.stdout.split("\n"):
        m = re.match(r"^\[(\w+)\]$", line.strip())
        if m:
            section = m.group(1)
            continue
        m = re.match(r"^(\w+) = ?(.*)$", line.strip())
        if not m or not section:
            continue
        key = (section, m.group(1))
        documented = defaults.get(key)
        if documented is None or "\\fI" in documented or key == ("pool", "num_pages"):
            continue
        if section == "tuning" and "KVPOOL_" + m.group(1).upper() in env_tuning:
            continue  # the environment overrides it here
        documented = re.sub(r"\\f[BIR]", "", documented)
        if size_norm(documented) != size_norm(m.group(2)):
            fail("kvpoold.conf(5) gives %s.%s the default '%s'; kvpoold --check-config: '%s'"
                 % (section, m.group(1), documented, m.group(2)))


def main():
    if len(sys.argv) not in (3, 4, 5):
        sys.exit(__doc__)
    mandir, src = sys.argv[1], sys.argv[2]
    rendered_any = False
    for fname, name, sec in PAGES:
        path = os.path.join(mandir, fname)
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            fail("%s: missing or empty (build the man_pages target)" % path)
            continue
        roff = open(path, encoding="utf-8").read()
        if not re.search(r'^\.TH "%s" "%s" ' % (re.escape(name), sec), roff, re.M):
            fail("%s: no .TH line for %s(%s)" % (path, name, sec))
        if re.search(r"@[A-Z_]+@", roff):
            fail("%s: an unconfigured @VARIABLE@ is left" % path)
        with gzip.open(path + ".gz", "rt", encoding="utf-8") as f:
            if f.read() != roff:
                fail("%s.gz: not the same page as %s" % (path, path))
        text = render(path)
        if text is None:
            continue
        rendered_any = True
        for heading in ("NAME", "SYNOPSIS", "DESCRIPTION", "SEE ALSO"):
            if not re.search(r"^%s$" % heading, text, re.M):
                fail("%s: rendered page has no %s section" % (path, heading))
    if not rendered_any:
        print("note: neither man nor groff found: checked the roff only")

    table = config_table(src)
    conf = os.path.join(mandir, "kvpoold.conf.5")
    doc, defaults = ({}, {})
    if os.path.isfile(conf):
        doc, defaults = documented_keys(open(conf, encoding="utf-8").read())
    for (section, key), reloadable in sorted(table.items()):
        entry = doc.get((section, key))
        if entry is None:
            fail("kvpoold.conf(5) does not document %s.%s (docs/man/kvpoold.conf.5.scd)"
                 % (section, key))
            continue
        entry = re.sub(r"\\f[BIR]|\\&", "", entry).strip()
        want = "Reloadable." if reloadable else "Restart to apply."
        if not entry.endswith(want):
            fail("kvpoold.conf(5): %s.%s should end in \"%s\" (server/kvp_config.c says %s)"
                 % (section, key, want, "reloadable" if reloadable else "restart"))
    for k in sorted(set(doc) - set(table)):
        fail("kvpoold.conf(5) documents %s.%s, which server/kvp_config.c does not have" % k)
    example = os.environ.get("KVP_EXAMPLE_CONF")
    if example:
        check_example(example, table, defaults)
    if len(sys.argv) >= 4:
        check_defaults(sys.argv[3], defaults)
        check_help(sys.argv[3], os.path.join(mandir, "kvpoold.8"), "kvpoold(8)", False)
    if len(sys.argv) == 5:
        check_help(sys.argv[4], os.path.join(mandir, "kvpoolctl.1"), "kvpoolctl(1)", True)

    if failures:
        print("%d failure(s)" % len(failures))
        return 1
    print("man pages ok: %d pages, %d keys documented" % (len(PAGES), len(table)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
