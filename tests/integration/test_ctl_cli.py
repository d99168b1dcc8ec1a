#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvpoolctl's command-line habits (issue #19, items 6 and 7) against a real kvpoold holding
sequences in two namespaces (libkvpool through the Python package, host backend): -n NS filters
or acts the same way in every command that takes it, before or after the command, and
daemon-wide commands refuse it; -o json is --json byte for byte, -o table the default, -o wide
the table with the command's extra columns; --no-headers drops exactly the title row; bad
values exit 2 with a clear message; `help CMD` is `CMD --help`; and the bash completion
(deploy/completion/kvpoolctl.bash) run in a real bash with COMP_WORDS/COMP_CWORD set.

usage: test_ctl_cli.py BUILD_DIR
"""
import json
import os
import re
import subprocess
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_lifecycle as lc  # noqa: E402  (takes BUILD_DIR from argv)

ROOT = os.path.dirname(os.path.dirname(HERE))
COMPLETION = os.path.join(ROOT, "deploy", "completion", "kvpoolctl.bash")
os.environ.setdefault("KVPOOL_LIB", os.path.join(lc.BUILD, "client", "libkvpool.so"))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
import kvpool  # noqa: E402

ctl = lc.ctl
# every command, as `kvpoolctl __complete commands` lists them
COMMANDS = ["status", "stats", "pool", "seqs", "clients", "transfers", "audit", "metrics",
            "health", "top", "cache", "help"]
# those that print a table or a record (-o, --json, --no-headers)
OUTPUT_CMDS = ["status", "stats", "pool", "seqs", "clients", "transfers", "audit", "metrics",
               "health", "cache"]
DAEMON_WIDE = ["status", "pool", "audit", "metrics", "health"]

# figures that change from one run to the next (times, request counters, kvpoolctl's own
# session): masked before two runs are compared
VOLATILE = re.compile(r'("(?:rtt_us|uptime_ms|session_id|requests_total|idle_ms|connected_ms|'
                      r'requests|lease_expires_in_ms|pid|num_clients)": )[^,\n]+')


def mask_json(text):
    return VOLATILE.sub(r"\1X", text)


def mask_text(text):
    """Durations, numbers and the runs of blanks they align, for tables of live figures."""
    text = re.sub(r"\b(\d+ms|\d+\.\ds|\d+m\d\ds|\d+h\d\dm|\d+d\d\dh)\b", "D", text)
    return re.sub(r" +", " ", re.sub(r"\d+(\.\d+)?", "N", text))


def complete(*words):
    """COMPREPLY of the completion function for the command line `words` (the last one is
    the word being completed), run in bash with the script sourced."""
    script = ('source "$1"; shift; COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); _kvpoolctl; '
              'printf "%s\\n" "${COMPREPLY[@]}"')
    p = subprocess.run(["bash", "-c", script, "bash", COMPLETION] + list(words),
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return [w for w in p.stdout.split("\n") if w]


class CliTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = lc.Daemon()
        cls.d.wait_ready()
        # team-a: seqs 1 (5 tokens) and 2 (3 tokens); team-b: seq 7 (9 tokens); both stay
        # attached (one session each) for the whole class
        cls.a = kvpool.Client(cls.d.sock, namespace="team-a", lease_ms=60000)
        cls.b = kvpool.Client(cls.d.sock, namespace="team-b", lease_ms=60000)
        cls.a.reserve([1, 2], [5, 3])
        cls.b.reserve([7], [9])

    @classmethod
    def tearDownClass(cls):
        cls.a.close()
        cls.b.close()
        assert cls.d.stop() == 0, cls.d.logtext()

    def ok(self, *args):
        rc, out, err = ctl(self.d.sock, *args)
        self.assertEqual(rc, 0, (args, err))
        return out

    def js(self, *args):
        return json.loads(self.ok(*args, "--json"))

    # ---- -n: the namespace a command acts on or filters by ----------------------------------

    def test_namespace_filters_every_command_the_same_way(self):
        st = self.js("stats")
        self.assertEqual(sorted(n["name"] for n in st["namespaces"]), ["team-a", "team-b"])
        for before in (False, True):
            def run(cmd, *rest):
                args = (["-n", "team-a", cmd] if before else [cmd, "-n", "team-a"]) + list(rest)
                return self.ok(*args)

            st = json.loads(run("stats", "--json"))
            self.assertEqual([(n["name"], n["num_seqs"], n["num_tokens"], n["sessions"])
                              for n in st["namespaces"]], [("team-a", 2, 8, 1)])
            self.assertEqual(st["num_seqs"], 3)  # the pool's own figures stay whole
            self.assertFalse(st["namespaces_truncated"])
            rows = run("stats").split("\n\n")[1].splitlines()
            self.assertEqual(rows[0].split()[0], "NAMESPACE")
            self.assertEqual([r.split()[:3] for r in rows[1:]], [["team-a", "2", "8"]])

            seqs = json.loads(run("seqs", "--json"))
            self.assertEqual([(s["namespace"], s["seq_id"], s["num_tokens"])
                              for s in seqs["sequences"]], [("team-a", 1, 5), ("team-a", 2, 3)])
            self.assertEqual(seqs["count"], 2)
            self.assertEqual([r.split()[:3] for r in run("seqs").splitlines()[1:]],
                             [["team-a", "1", "5"], ["team-a", "2", "3"]])

            cl = json.loads(run("clients", "--json"))["clients"]
            self.assertEqual([(c["namespace"], c["self"]) for c in cl], [("team-a", False)])
            self.assertEqual([r.split()[1] for r in run("clients").splitlines()[1:]],
                             ["team-a"])

            self.assertEqual(json.loads(run("transfers", "--json")), {"transfers": []})

            scopes = json.loads(run("cache", "--json"))["scopes"]
            self.assertEqual([(s["name"], s["namespaces"]) for s in scopes], [("ns:team-a", 1)])
            self.assertEqual([r.split()[0] for r in run("cache").split("\n\n")[1].splitlines()],
                             ["SCOPE", "ns:team-a"])

            line = run("top", "--count", "1").strip()  # not a terminal: one key=value line
            self.assertIn(" namespaces=1 ", line)
            self.assertTrue(line.endswith(" namespace=team-a namespace_sequences=2 "
                                          "namespace_tokens=8"), line)
        # without -n: every namespace
        self.assertEqual(len(self.js("seqs")["sequences"]), 3)
        self.assertEqual(sorted(c["namespace"] for c in self.js("clients")["clients"]),
                         ["", "team-a", "team-b"])  # "": kvpoolctl itself, an observer
        self.assertEqual(sorted(s["name"] for s in self.js("cache")["scopes"]),
                         ["ns:team-a", "ns:team-b"])
        self.assertIn(" namespaces=2 ", self.ok("top", "--count", "1"))
        self.assertNotIn("namespace=", self.ok("top", "--count", "1"))

    def test_namespace_unknown_or_not_applicable(self):
        for cmd in ("stats", "seqs"):
            rc, out, err = ctl(self.d.sock, cmd, "-n", "nobody")
            self.assertEqual((rc, out), (1, ""), (cmd, err))
            self.assertIn("no namespace 'nobody'", err)
        # filters with nothing to show are empty, not errors
        self.assertEqual(self.js("clients", "-n", "nobody"), {"clients": []})
        self.assertEqual(self.js("transfers", "-n", "nobody"), {"transfers": []})
        self.assertEqual(self.js("cache", "-n", "nobody")["scopes"], [])
        for cmd in DAEMON_WIDE:
            for args in ([cmd, "-n", "team-a"], ["-n", "team-a", cmd],
                         [cmd, "--namespace=team-a"]):
                rc, out, err = ctl(self.d.sock, *args)
                self.assertEqual((rc, out), (2, ""), args)
                self.assertIn("-n/--namespace does not apply to %s, which is daemon-wide" % cmd,
                              err)
        # --join is the old global -n: join (and so see) the namespace, any command
        st = self.js("--join", "team-b", "stats")
        self.assertEqual(st["num_clients"], 3)
        self.assertEqual(self.ok("--join", "team-b", "health"), "ok\n")
        rc, _, err = ctl(self.d.sock, "-n", "team-a", "--join", "team-b", "cache", "flush")
        self.assertEqual(rc, 2, err)
        self.assertIn("cache flush: -n and --join name two namespaces", err)
        # cache flush -n NS acts on NS: it joins NS and flushes its scope (nothing cached)
        self.assertEqual(self.js("cache", "flush", "-n", "team-a"),
                         {"pages": 0, "scope": "", "all": False, "namespace": "team-a"})
        self.assertEqual(self.ok("-n", "team-a", "cache", "flush"),
                         "flushed 0 pages (the scope of namespace team-a)\n")

    # ---- -o, --json, --no-headers -------------------------------------------------------------

    def test_output_json_is_json_byte_for_byte(self):
        for cmd in OUTPUT_CMDS:
            for extra in ([], ["-n", "team-a"]) if cmd in ("stats", "seqs", "clients",
                                                          "transfers", "cache") else ([],):
                a = self.ok(cmd, "--json", *extra)
                for spelling in (["-o", "json"], ["-ojson"], ["--output=json"],
                                 ["--output", "json"]):
                    b = self.ok(cmd, *spelling, *extra)
                    if cmd == "metrics":  # counters move between the two reads
                        self.assertEqual(mask_text(a), mask_text(b), spelling)
                    else:
                        self.assertEqual(mask_json(a), mask_json(b), (cmd, spelling))
                    json.loads(b)
        # what does not move is equal as it is
        for cmd in ("pool", "audit", "transfers", "cache"):
            self.assertEqual(self.ok(cmd, "--json"), self.ok(cmd, "-o", "json"), cmd)
        # and -o table is the default output; the last of -o/--json wins
        for cmd in ("pool", "audit", "cache", "transfers"):
            self.assertEqual(self.ok(cmd), self.ok(cmd, "-o", "table"), cmd)
            self.assertEqual(self.ok(cmd), self.ok(cmd, "--json", "-o", "table"), cmd)
            self.assertEqual(self.ok(cmd, "--json"), self.ok(cmd, "-o", "wide", "--json"), cmd)
        for cmd in ("status", "stats", "seqs", "clients", "metrics", "health"):
            self.assertEqual(mask_text(self.ok(cmd)), mask_text(self.ok(cmd, "-o", "table")))

    def test_wide_has_the_extra_columns(self):
        def header(out, first):
            return next(ln.split() for ln in out.splitlines() if ln.startswith(first))

        cases = {  # command: (title row's first word, the wide columns)
            "seqs": ("NAMESPACE", ["IDLE_MS"]),
            "clients": ("SESSION", ["CONNECTED_MS"]),
            "transfers": ("TRANSFER", ["NUM_SEQS", "ELAPSED_MS"]),
            "cache": ("SCOPE", ["QUERY_TOTAL", "HIT_TOTAL"]),
            "stats": ("NAMESPACE", ["DEDUP_BYTES", "DEDUP_ENTRIES"]),
        }
        for cmd, (first, extra) in cases.items():
            table, wide = self.ok(cmd), self.ok(cmd, "-o", "wide")
            self.assertEqual(header(wide, first), header(table, first) + extra, cmd)
        # the rows carry them too: seq 7's exact idle time, team-a's dedup figures
        rows = self.ok("seqs", "-n", "team-b", "-o", "wide").splitlines()
        self.assertEqual(len(rows), 2)
        self.assertEqual(len(rows[1].split()), len(rows[0].split()))
        self.assertRegex(rows[1], r"^team-b +7 +9 +3 +0 +\S+ +\d+$")
        ns = self.ok("stats", "-n", "team-a", "-o", "wide").split("\n\n")
        self.assertRegex(ns[1].splitlines()[1], r"^team-a +2 +8 +\d+ +1 +1m00s +- +\d+ +\d+$")
        # stats -o wide: the dedup line and the cache's per-scope rows
        self.assertRegex(ns[0], r"\ndedup        \d+(\.\d)? \S+ kept for retries, \d+ evicted")
        self.assertEqual([r.split()[0] for r in ns[2].splitlines()], ["SCOPE", "ns:team-a",
                                                                      "ns:team-b"])
        self.assertNotIn("SCOPE", self.ok("stats"))
        # status -o wide: every device, also the only one
        self.assertIn("\n  device 0 heads 0..7: ", self.ok("status", "-o", "wide"))
        self.assertNotIn("  device 0", self.ok("status"))
        # a column of wide never reaches the JSON
        self.assertEqual(self.ok("cache", "-o", "wide", "--json"), self.ok("cache", "--json"))

    def test_no_headers_drops_exactly_the_title_row(self):
        for cmd, args, first in [("cache", [], "SCOPE"), ("transfers", [], "TRANSFER"),
                                 ("seqs", [], "NAMESPACE"), ("clients", [], "SESSION"),
                                 ("stats", [], "NAMESPACE"), ("seqs", ["-o", "wide"], "NAMESPACE"),
                                 ("cache", ["-o", "wide"], "SCOPE")]:
            with_h = self.ok(cmd, *args).splitlines(keepends=True)
            titles = [i for i, ln in enumerate(with_h) if ln.startswith(first)]
            self.assertEqual(len(titles), 1, (cmd, with_h))
            want = with_h[:titles[0]] + with_h[titles[0] + 1:]
            got = self.ok(cmd, *args, "--no-headers").splitlines(keepends=True)
            if cmd in ("cache", "transfers"):  # nothing moves: as it is
                self.assertEqual(got, want, cmd)
            else:
                self.assertEqual([mask_text(x) for x in got], [mask_text(x) for x in want], cmd)
        self.assertEqual(self.ok("transfers", "--no-headers"), "")  # no transfer, no title
        # a record has no title row; JSON none either
        self.assertEqual(self.ok("pool", "--no-headers"), self.ok("pool"))
        self.assertEqual(self.ok("cache", "--json", "--no-headers"), self.ok("cache", "--json"))

    # ---- bad values -----------------------------------------------------------------------------

    def test_bad_values_exit_2(self):
        cases = [
            (["stats", "-o", "xml"], "-o/--output: 'xml' is not one of json, wide, table"),
            (["stats", "--output=JSON"], "-o/--output: 'JSON' is not one of json, wide, table"),
            (["-o", "", "pool"], "-o/--output: '' is not one of json, wide, table"),
            (["stats", "-o"], "option '-o' needs a value"),
            (["seqs", "-n"], "option '-n' needs a value"),
            (["seqs", "-n", ""], "-n/--namespace: a name of 1..64 bytes"),
            (["seqs", "-n", "x" * 65], "-n/--namespace: a name of 1..64 bytes"),
            (["--join", "", "status"], "--join: a name of 1..64 bytes"),
            (["top", "--json"], "-o, --json and --no-headers do not apply to top"),
            (["top", "-o", "wide"], "-o, --json and --no-headers do not apply to top"),
            (["top", "--no-headers"], "-o, --json and --no-headers do not apply to top"),
            (["help", "-o", "json"], "help takes a command name and no other option"),
            (["help", "nosuch"], "help: unknown command 'nosuch'"),
            (["help", "stats", "seqs"], "unexpected argument 'seqs'"),
            (["nosuch"], "unknown command 'nosuch'"),
            (["stats", "--no-headerz"], "unknown option '--no-headerz'"),
        ]
        for args, msg in cases:
            rc, out, err = ctl(self.d.sock, *args)
            self.assertEqual((rc, out), (2, ""), args)
            self.assertTrue(err.startswith("kvpoolctl: " + msg), (args, err))

    # ---- help -----------------------------------------------------------------------------------

    def test_help_cmd_is_cmd_help(self):
        self.assertEqual(self.ok("__complete", "commands").split(), COMMANDS)
        for cmd in COMMANDS:
            text = self.ok("help", cmd)
            self.assertEqual(text, self.ok(cmd, "--help"), cmd)
            self.assertEqual(text, self.ok(cmd, "-h"), cmd)
            self.assertTrue(text.startswith("usage: kvpoolctl [options] %s " % cmd), text)
            self.assertIn("\n  %s" % cmd, text)
            self.assertEqual("-n, --namespace NS" in text, cmd in ("stats", "seqs", "clients",
                                                                  "transfers", "top", "cache"),
                             cmd)
            self.assertEqual("-o, --output FORMAT" in text, cmd in OUTPUT_CMDS, cmd)
            # every option the help names is one the command takes
            for opt in re.findall(r"^  (?:-\w, )?(--[a-z-]+)", text, re.M):
                self.assertIn(opt, self.ok("__complete", "options", cmd).split(), (cmd, opt))
        full = self.ok("help")
        self.assertEqual(full, self.ok("--help"))
        for cmd in COMMANDS:
            self.assertIn("\n  %s " % cmd, full)
        self.assertIn("  cache flush [--scope S | --all]\n", self.ok("help", "cache"))
        self.assertIn("      --limit N          seqs: at most N rows\n", self.ok("help", "seqs"))
        self.assertNotIn("--limit", self.ok("help", "stats"))

    # ---- bash completion --------------------------------------------------------------------------

    def test_completion(self):
        c = lc.CTL
        self.assertEqual(complete(c, "st"), ["status", "stats"])
        self.assertEqual(complete(c, "stats", "-o", ""), ["json", "wide", "table"])
        self.assertEqual(complete(c, "stats", "-o", "w"), ["wide"])
        self.assertEqual(complete(c, "stats", "--output", "=", ""), ["json", "wide", "table"])
        self.assertEqual(complete(c, ""), COMMANDS)
        self.assertEqual(complete(c, "-s", self.d.sock, "-t", "500", "c"), ["clients", "cache"])
        self.assertEqual(complete(c, "help", "he"), ["health", "help"])
        self.assertEqual(complete(c, "cache", ""), ["flush", "dump"])
        self.assertEqual(complete(c, "cache", "flush", "--"),
                         [w for w in self.ok("__complete", "options", "cache").split()
                          if w.startswith("--")])
        self.assertEqual(complete(c, "stats", "--no"), ["--no-headers"])
        self.assertEqual(complete(c, "seqs", "--l"), ["--limit"])
        self.assertEqual(complete(c, "stats", "--l"), [])  # seqs' option only
        self.assertEqual(complete(c, "top", "--o"), [])  # top prints no table
        self.assertEqual(complete(c, "--j"), ["--json", "--join"])
        self.assertEqual(complete(c, "seqs", "--limit", ""), [])  # a number: nothing to offer
        # namespaces from the daemon -s names, after -n, --namespace and --join
        self.assertEqual(complete(c, "-s", self.d.sock, "seqs", "-n", ""), ["team-a", "team-b"])
        self.assertEqual(complete(c, "--socket", self.d.sock, "-n", "team-b"), ["team-b"])
        self.assertEqual(complete(c, "-s", self.d.sock, "--join", "t"), ["team-a", "team-b"])
        # no daemon: nothing, at once
        t0 = time.time()
        self.assertEqual(complete(c, "-s", self.d.dir + "/absent.sock", "seqs", "-n", ""), [])
        self.assertLess(time.time() - t0, 5)
        # every command kvpoolctl has completes, with the options its help names
        for cmd in COMMANDS:
            self.assertEqual(complete(c, cmd), [w for w in COMMANDS if w.startswith(cmd)])
            opts = complete(c, cmd, "-")
            self.assertEqual(opts, self.ok("__complete", "options", cmd).split(), cmd)
            self.assertIn("--help", opts)


if __name__ == "__main__":
    try:
        unittest.main(verbosity=2)
    finally:
        lc.kill_all()
