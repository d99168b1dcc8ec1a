#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Metrics of a real kvpoold, read the way Prometheus and an operator read them: the HTTP
endpoint (server.metrics_listen) scraped over TCP, the exposition parsed strictly (every sample
has HELP and TYPE, names follow the conventions, histograms are cumulative), counters that only
grow across scrapes with real traffic in between (libkvpool through the Python package, host
backend), values equal to `kvpoolctl stats --json`, evictions on lease expiry, and the HTTP
server's answers to bad requests, its connection limit and its deadline; and `kvpoolctl top`
driven in a real pseudo-terminal (redraws, 'q' and Ctrl-C restore the terminal) and in its
plain-line mode.

usage: test_metrics.py BUILD_DIR
"""
import fcntl
import json
import math
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import test_lifecycle as lc  # noqa: E402  (takes BUILD_DIR from argv)

ROOT = os.path.dirname(os.path.dirname(HERE))
os.environ.setdefault("KVPOOL_LIB", os.path.join(lc.BUILD, "client", "libkvpool.so"))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
import kvpool  # noqa: E402

# the daemon of these tests: 64 pages of 4 tokens, 2 layers, 8 heads x 128, fp16
PAGES, PAGE_SIZE, LAYERS, HEADS, DIM, ELEM = 64, 4, 2, 8, 128, 2
PAGE_BYTES = LAYERS * 2 * PAGE_SIZE * HEADS * DIM * ELEM
TOKEN_BYTES = LAYERS * 2 * HEADS * DIM * ELEM  # K and V of one token in every layer

NAME_RE = re.compile(r"^kvpool_[a-z][a-z0-9_]*$")
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')
SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^\n]*\})? (\S+)$")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def unescape(v):
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), v)


def parse_exposition(text):
    """Parses Prometheus text format 0.0.4 strictly. Returns (families, samples): families
    maps a name to {"type", "help"}; samples maps (name, frozenset(labels)) to a float.
    Raises AssertionError on anything a scraper would reject or our rules forbid."""
    families, samples = {}, {}
    assert text.endswith("\n"), "exposition must end with a newline"
    for n, line in enumerate(text.split("\n")[:-1], 1):
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            assert name not in families or "help" not in families[name], (n, "second HELP")
            assert help_text.strip(), (n, "empty HELP")
            families.setdefault(name, {})["help"] = help_text
            continue
        if line.startswith("# TYPE "):
            name, _, typ = line[7:].partition(" ")
            assert typ in ("counter", "gauge", "histogram", "summary", "untyped"), (n, typ)
            f = families.setdefault(name, {})
            assert "type" not in f, (n, "second TYPE for " + name)
            assert "help" in f, (n, "TYPE before HELP for " + name)
            f["type"] = typ
            f["seen"] = False
            continue
        if line.startswith("#"):
            continue
        m = SAMPLE_RE.match(line)
        assert m, (n, "not a sample line", line)
        name, labels_text, value = m.groups()
        labels = {}
        if labels_text:
            body = labels_text[1:-1]
            pos = 0
            while pos < len(body):
                lm = LABEL_RE.match(body, pos)
                assert lm, (n, "bad labels", labels_text)
                assert lm.group(1) not in labels, (n, "repeated label")
                labels[lm.group(1)] = unescape(lm.group(2))
                pos = lm.end()
        fam = name
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and families.get(name[: -len(suffix)], {}).get(
                    "type") == "histogram":
                fam = name[: -len(suffix)]
        assert fam in families and "type" in families[fam], (n, "sample without TYPE", name)
        v = float(value)  # raises on a malformed value
        key = (name, frozenset(labels.items()))
        assert key not in samples, (n, "duplicate series", line)
        samples[key] = v
        families[fam]["seen"] = True
    for name, f in families.items():
        assert NAME_RE.match(name), name
        assert "type" in f, (name, "HELP without TYPE")
        if f["type"] == "counter":
            assert name.endswith("_total"), (name, "a counter's name ends in _total")
        else:
            assert not name.endswith("_total"), (name, "_total is for counters")
        # base units only: seconds and bytes, never ms/us/KiB
        assert not re.search(r"_(ms|us|ns|milliseconds|microseconds|kib|mib|kb|mb)(_|$)",
                             name), name
    # histograms: cumulative buckets, +Inf == _count
    for (name, labels), v in samples.items():
        if name.endswith("_bucket"):
            base = name[:-7]
            rest = frozenset((k, x) for k, x in labels if k != "le")
            buckets = sorted(((float(dict(lb)["le"]), val) for (nm, lb), val in samples.items()
                              if nm == name and frozenset((k, x) for k, x in lb if k != "le")
                              == rest))
            counts = [c for _, c in buckets]
            assert counts == sorted(counts), (name, "buckets not cumulative")
            assert math.isinf(buckets[-1][0]), (name, "no +Inf bucket")
            assert samples[(base + "_count", rest)] == buckets[-1][1], name
            assert (base + "_sum", rest) in samples, name
    return families, samples


def http_get(port, path="/metrics", method="GET", raw=None, timeout=10):
    """One request over a fresh connection; returns (status, headers dict, body bytes)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(raw if raw is not None else
                  ("%s %s HTTP/1.1\r\nHost: test\r\n\r\n" % (method, path)).encode())
        data = b""
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return status, headers, body


def value(samples, name, **labels):
    return samples[(name, frozenset(labels.items()))]


def series(samples, name):
    return {dict(lb).get("namespace"): v for (nm, lb), v in samples.items() if nm == name}


# In a sanitizer build the Python process runs with leak checks off (see tests/CMakeLists.txt);
# the daemons get the strict options back.
DAEMON_ENV = ({"ASAN_OPTIONS": os.environ["KVP_DAEMON_ASAN_OPTIONS"]}
              if "KVP_DAEMON_ASAN_OPTIONS" in os.environ else {})


class MetricsDaemon(lc.Daemon):
    def __init__(self, args=()):
        for _ in range(5):  # the free port may be taken between free_port() and bind
            self.port = free_port()
            super().__init__(args=["--set", "server.metrics_listen=127.0.0.1:%d" % self.port]
                             + list(args), env=DAEMON_ENV)
            lc.wait_for(lambda: lc.can_connect(self.sock) or self.proc.poll() is not None)
            if self.proc.poll() is None:
                return
        raise AssertionError("no free port: " + self.logtext())

    def scrape(self):
        status, headers, body = http_get(self.port)
        assert status == 200, status
        assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8", headers
        assert int(headers["content-length"]) == len(body)
        return parse_exposition(body.decode("utf-8"))


def stats_json(sock):
    rc, out, err = lc.ctl(sock, "stats", "--json")
    assert rc == 0, err
    return json.loads(out)


class ScrapeTest(unittest.TestCase):
    def setUp(self):
        self.d = MetricsDaemon()

    def tearDown(self):
        self.assertEqual(self.d.stop(), 0, self.d.logtext())

    def traffic(self, c, seqs, tokens):
        """Daemon-run Appends of `tokens` tokens to each of `seqs`, then a Reserve of 1 more."""
        n = len(seqs) * tokens
        stage, buf = c.alloc_staging(2 * n * HEADS * DIM * ELEM)
        stage[:] = 7
        c.append(seqs, [tokens] * len(seqs),
                 source=dict(buffer_id=buf, k_offset=0, v_offset=n * HEADS * DIM * ELEM))
        c.reserve(seqs, 1)

    def test_exposition_parses_and_matches_stats(self):
        # the start-up probe's connection may still be closing on a loaded machine
        for _ in range(100):
            fam0, s0 = self.d.scrape()
            if value(s0, "kvpool_connected_clients") == 0:
                break
            time.sleep(0.02)
        for name, typ in [("kvpool_build_info", "gauge"), ("kvpool_pages", "gauge"),
                          ("kvpool_pool_bytes", "gauge"), ("kvpool_sequences", "gauge"),
                          ("kvpool_tokens", "gauge"), ("kvpool_connected_clients", "gauge"),
                          ("kvpool_page_allocations_total", "counter"),
                          ("kvpool_allocation_failures_total", "counter"),
                          ("kvpool_rpc_requests_total", "counter"),
                          ("kvpool_rpc_duration_seconds", "histogram"),
                          ("kvpool_append_bytes_total", "counter"),
                          ("kvpool_append_run_seconds", "histogram"),
                          ("kvpool_evicted_sequences_total", "counter"),
                          ("kvpool_lease_expiries_total", "counter")]:
            self.assertEqual(fam0[name]["type"], typ, name)
        self.assertEqual(value(s0, "kvpool_pages", device="0", state="capacity"), PAGES)
        self.assertEqual(value(s0, "kvpool_pages", device="0", state="free"), PAGES)
        self.assertEqual(value(s0, "kvpool_connected_clients"), 0)

        # traffic: two namespaces (one using every punctuation mark a name may hold: quotes
        # and backslashes are refused since issue #15), appends, a fork, a refused Reserve
        # (pool exhausted)
        weird = 'we.ird/ns:1+b@x_-'
        with kvpool.Client(self.d.sock, namespace="engine-a", lease_ms=60000) as a, \
                kvpool.Client(self.d.sock, namespace=weird, lease_ms=60000) as b:
            self.traffic(a, [1, 2, 3], 5)   # 6 tokens each: 2 pages each
            self.traffic(b, [9], 10)        # 11 tokens: 3 pages
            a.fork(1, 4)
            with self.assertRaises(kvpool.ResourceExhausted):
                a.reserve([100], PAGES * PAGE_SIZE)
            fam1, s1 = self.d.scrape()
            self.assertEqual(value(s1, "kvpool_connected_clients"), 2)

        # counters only grow, and the ones this traffic drives grew
        for (name, labels), v in s0.items():
            fam = name
            for suffix in ("_bucket", "_sum", "_count"):
                if name.endswith(suffix) and name[: -len(suffix)] in fam0:
                    fam = name[: -len(suffix)]
            if fam0[fam]["type"] in ("counter", "histogram"):
                self.assertGreaterEqual(s1[(name, labels)], v, name)
        self.assertEqual(value(s1, "kvpool_append_bytes_total"), (15 + 10) * TOKEN_BYTES)
        self.assertEqual(value(s1, "kvpool_append_run_seconds_count"), 2)
        self.assertEqual(value(s1, "kvpool_rpc_requests_total", call="append", code="OK"), 2)
        self.assertEqual(value(s1, "kvpool_rpc_requests_total", call="reserve", code="OK"), 2)
        self.assertEqual(value(s1, "kvpool_rpc_requests_total", call="reserve",
                               code="RESOURCE_EXHAUSTED"), 1)
        self.assertEqual(value(s1, "kvpool_rpc_duration_seconds_count", call="append"), 2)
        self.assertEqual(value(s1, "kvpool_allocation_failures_total", reason="exhausted"), 1)
        # 3 x 2 pages + 3 pages, then the Reserves of 1 token: seqs 1..3 end at 6 tokens
        # (7th token: pos 6 in page 1), seq 9 at 11 (pos 11 in page 2): no new page
        self.assertEqual(value(s1, "kvpool_page_allocations_total"), 9)
        self.assertEqual(series(s1, "kvpool_sequences"), {"engine-a": 4, weird: 1})
        self.assertEqual(series(s1, "kvpool_tokens"), {"engine-a": 4 * 6, weird: 11})

        # values equal kvpoolctl stats --json (the sessions are gone, the lease keeps the data)
        self.assertTrue(lc.wait_for(lambda: value(self.d.scrape()[1],
                                                  "kvpool_connected_clients") == 0))
        st = stats_json(self.d.sock)
        _, s2 = self.d.scrape()
        self.assertEqual(st["num_clients"], 1)  # kvpoolctl itself
        self.assertEqual(value(s2, "kvpool_connected_clients"), 0)
        for state, key in [("capacity", "num_pages"), ("used", "used_pages"),
                           ("free", "free_pages"), ("shared", "shared_pages")]:
            self.assertEqual(value(s2, "kvpool_pages", device="0", state=state), st[key], state)
            self.assertEqual(value(s2, "kvpool_pool_bytes", device="0", state=state),
                             st[key] * st["page_bytes"], state)
        self.assertEqual(st["page_bytes"], PAGE_BYTES)
        self.assertEqual(value(s2, "kvpool_page_size_bytes"), PAGE_BYTES)
        self.assertEqual(st["used_pages"], 9)
        self.assertEqual(st["shared_pages"], 2)  # seq 4 shares seq 1's two pages
        self.assertEqual(value(s2, "kvpool_live_sequences"), st["num_seqs"])
        self.assertEqual(value(s2, "kvpool_live_tokens"), st["num_tokens"])
        self.assertEqual(value(s2, "kvpool_append_bytes_total"), st["append_bytes_total"])
        self.assertEqual(value(s2, "kvpool_namespaces"), len(st["namespaces"]))
        by_ns = {n["name"]: n for n in st["namespaces"]}
        self.assertEqual(set(by_ns), {"engine-a", weird})  # kvpoolctl: an observer, no namespace
        self.assertEqual(series(s2, "kvpool_sequences"),
                         {k: n["num_seqs"] for k, n in by_ns.items()})
        self.assertEqual(series(s2, "kvpool_tokens"),
                         {k: n["num_tokens"] for k, n in by_ns.items()})
        self.assertEqual(series(s2, "kvpool_page_refs"),
                         {k: n["page_refs"] for k, n in by_ns.items()})
        # every dispatched request is counted once by call and status
        answered = sum(v for (nm, lb), v in s2.items()
                       if nm == "kvpool_rpc_requests_total" and dict(lb)["call"] != "invalid")
        self.assertEqual(answered, st["requests_total"])

        # the RPC gives the same families as HTTP
        rc, out, err = lc.ctl(self.d.sock, "metrics")
        self.assertEqual(rc, 0, err)
        fam3, _ = parse_exposition(out)
        self.assertEqual({k: v["type"] for k, v in fam3.items()},
                         {k: v["type"] for k, v in fam1.items()})

    def test_lease_expiry_is_counted_as_eviction(self):
        with kvpool.Client(self.d.sock, namespace="short", lease_ms=200) as c:
            c.reserve([1, 2], [5, 9])  # 2 + 3 pages
        self.assertTrue(lc.wait_for(
            lambda: value(self.d.scrape()[1], "kvpool_lease_expiries_total") == 1))
        _, s = self.d.scrape()
        self.assertEqual(value(s, "kvpool_evicted_sequences_total", reason="lease_expired"), 2)
        self.assertEqual(value(s, "kvpool_evicted_pages_total", reason="lease_expired"), 5)
        self.assertEqual(value(s, "kvpool_pages", device="0", state="used"), 0)
        self.assertEqual(series(s, "kvpool_sequences"), {})

    def test_http_answers_and_limits(self):
        st, h, body = http_get(self.d.port, method="HEAD")
        self.assertEqual((st, body), (200, b""))
        self.assertGreater(int(h["content-length"]), 1000)
        self.assertEqual(h["connection"], "close")
        self.assertEqual(http_get(self.d.port, "/")[0], 404)
        self.assertEqual(http_get(self.d.port, "/metrics?debug=1")[0], 200)
        st, h, _ = http_get(self.d.port, method="POST")
        self.assertEqual((st, h["allow"]), (405, "GET, HEAD"))
        self.assertEqual(http_get(self.d.port, raw=b"NONSENSE\r\n\r\n")[0], 400)
        self.assertEqual(http_get(self.d.port, raw=b"GET /metrics HTTP/2.0\r\n\r\n")[0], 505)
        st, _, body = http_get(self.d.port, raw=b"GET /metrics HTTP/1.0\r\nX: "
                               + b"a" * 9000 + b"\r\n\r\n")
        self.assertEqual(st, 431)
        # HTTP/1.0, headers split over many writes
        s = socket.create_connection(("127.0.0.1", self.d.port), timeout=10)
        for piece in (b"GET /met", b"rics HTTP/1.0\r\n", b"Accept: text/plain\r\n", b"\r\n"):
            s.sendall(piece)
            time.sleep(0.02)
        data = b""
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            data += chunk
        s.close()
        self.assertTrue(data.startswith(b"HTTP/1.1 200 OK\r\n"), data[:100])

        # 8 idle connections from one peer (metrics_max_connections_per_peer); a 9th evicts
        # the oldest of them, which has not sent its head (test_metrics_flood.py: the flood)
        idle = [socket.create_connection(("127.0.0.1", self.d.port), timeout=10)
                for _ in range(8)]
        time.sleep(0.2)
        extra = socket.create_connection(("127.0.0.1", self.d.port), timeout=10)
        self.assertEqual(idle[0].recv(100), b"")
        self.assertEqual(lc.ctl(self.d.sock, "health")[0], 0)  # the RPC socket is unaffected
        # a silent client is dropped at the 1 s head deadline
        t0 = time.time()
        self.assertEqual(extra.recv(100), b"")
        self.assertLess(time.time() - t0, 30)
        extra.close()
        for s in idle:
            s.close()
        self.assertTrue(lc.wait_for(lambda: self.try_scrape(), timeout=10))

    def try_scrape(self):
        try:
            return http_get(self.d.port)[0] == 200
        except OSError:
            return False


class TopTest(unittest.TestCase):
    """kvpoolctl top against a daemon holding 9 of its 64 pages in namespace engine-a."""

    def setUp(self):
        self.d = MetricsDaemon()
        self.c = kvpool.Client(self.d.sock, namespace="engine-a", lease_ms=60000)
        self.c.reserve([1, 2, 3], [8, 8, 20])  # 2 + 2 + 5 pages

    def tearDown(self):
        self.c.close()
        self.assertEqual(self.d.stop(), 0, self.d.logtext())

    def run_in_pty(self, quit_with):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        before = termios.tcgetattr(slave)
        p = subprocess.Popen([lc.CTL, "-s", self.d.sock, "top", "--interval", "0.2"],
                             stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        out = b""

        def read_some(timeout):
            nonlocal out
            r, _, _ = select.select([master], [], [], timeout)
            if r:
                try:
                    out += os.read(master, 1 << 16)
                except OSError:  # EIO: the child closed the terminal
                    return False
            return True

        end = time.time() + 30
        while out.count(b"\033[H\033[2J") < 4 and time.time() < end:
            read_some(0.5)
        self.assertGreaterEqual(out.count(b"\033[H\033[2J"), 4, out[-2000:])
        # while it runs: non-canonical, no echo
        during = termios.tcgetattr(slave)
        self.assertEqual(during[3] & (termios.ICANON | termios.ECHO), 0)
        if quit_with == "q":
            os.write(master, b"q")
        else:
            p.send_signal(signal.SIGINT)
        self.assertEqual(p.wait(timeout=10), 0)
        while read_some(0.2) and select.select([master], [], [], 0)[0]:
            pass
        after = termios.tcgetattr(slave)
        os.close(master)
        os.close(slave)
        return out, before, after

    def check_screen(self, out, before, after):
        # alternate screen and hidden cursor on entry; shown and back on exit; termios as before
        self.assertTrue(out.startswith(b"\033[?1049h\033[?25l"), out[:40])
        self.assertTrue(out.endswith(b"\033[0m\033[?25h\033[?1049l"), out[-60:])
        self.assertEqual(after, before)
        last = out.split(b"\033[H\033[2J")[-2].decode(errors="replace").replace("\r\n", "\n")
        self.assertIn("kvpool top", last)
        # 120 columns: a 60-character bar, 9/64 used -> 8 '#'
        self.assertRegex(last, r"\n0 +\[" + "#" * 8 + r"\.{52}\] +14\.1% +9/64 +288\.0 KiB / 2\.0 MiB")
        self.assertRegex(last, r"requests \d+\.\d/s")
        self.assertRegex(last, r"\nmetrics +\d+\.\d +[\d.]+ [um]s +[\d.]+ [um]s +[\d.]+ [um]s\n")
        self.assertRegex(last, r"\nengine-a +3 +36\n")

    def test_terminal_view_quits_on_q(self):
        self.check_screen(*self.run_in_pty("q"))

    def test_terminal_view_quits_on_ctrl_c(self):
        self.check_screen(*self.run_in_pty("sigint"))

    def test_plain_lines_when_not_a_terminal(self):
        p = subprocess.run([lc.CTL, "-s", self.d.sock, "top", "--count", "3", "--interval",
                            "0.2"], capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertNotIn("\033", p.stdout)
        lines = p.stdout.splitlines()
        self.assertEqual(len(lines), 3)
        rows = [dict(kv.split("=", 1) for kv in line.split(" ")) for line in lines]
        for r in rows:
            self.assertEqual((r["pages_used"], r["pages_capacity"], r["sequences"], r["tokens"]),
                             ("9", "64", "3", "36"))
            self.assertEqual(r["up"], "1")
        self.assertEqual(rows[0]["requests_per_s"], "-")
        self.assertRegex(rows[1]["requests_per_s"], r"^\d+\.\d$")
        self.assertGreater(float(rows[2]["requests_per_s"]), 0)  # its own Metrics calls
        self.assertRegex(rows[2]["p99_us"], r"^\d+\.\d$")
        # the prefix cache: nothing looked up here (no token ids), so no hit rate; "-" pages
        # from a daemon without the kvpool_prefix_cache_* families
        for r in rows:
            self.assertEqual(r["cache_hit_rate"], "-")
            self.assertIn(r["cache_cached_pages"], ("-", "0"))
            self.assertIn(r["cache_pinned_pages"], ("-", "0"))

    def test_daemon_going_away_exits_3(self):
        p = subprocess.Popen([lc.CTL, "-s", self.d.sock, "top", "--interval", "0.2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertTrue(p.stdout.readline().startswith("time="))
        self.c.close()
        self.assertEqual(self.d.stop(), 0, self.d.logtext())
        self.assertEqual(p.wait(timeout=30), 3)
        p.stdout.close()
        p.stderr.close()
        self.d = MetricsDaemon()  # for tearDown
        self.c = kvpool.Client(self.d.sock, namespace="x")


class CacheCtlTest(unittest.TestCase):
    """kvpoolctl cache, cache flush, stats and top, and the kvpool_prefix_cache_* families,
    over a prompt of 18 tokens (4 full pages of 4) cached by namespace engine-a."""

    PROMPT = list(range(100, 118))

    def setUp(self):
        self.d = MetricsDaemon()
        self.c = kvpool.Client(self.d.sock, namespace="engine-a", lease_ms=60000)
        self.c.reserve([1], [18], token_ids=self.PROMPT)
        self.assertEqual(self.c.commit([1]).published, 4)
        self.assertEqual(self.c.lookup([self.PROMPT]), [16])  # 18 tokens asked, 16 found
        self.c.release([1])  # its 4 full pages stay cached, the partial one is freed

    def tearDown(self):
        self.c.close()
        self.assertEqual(self.d.stop(), 0, self.d.logtext())

    def cache_json(self, *args):
        rc, out, err = lc.ctl(self.d.sock, "cache", "--json", *args)
        self.assertEqual(rc, 0, err)
        return json.loads(out)

    def test_cache_stats_flush_top_and_metrics_agree(self):
        scope = {"name": "ns:engine-a", "uid": os.getuid(), "namespaces": 1,
                 "cached_pages": 4, "indexed_pages": 4, "query_tokens_total": 18,
                 "hit_tokens_total": 16, "query_tokens": 18, "hit_tokens": 16,
                 "hit_rate": 16 / 18}
        want = {"cached_pages": 4, "pinned_pages": 0, "indexed_pages": 4, "pins": 0,
                "query_tokens_total": 18, "hit_tokens_total": 16, "interval_ms": 0,
                "query_tokens": 18, "hit_tokens": 16, "hit_rate": 16 / 18,
                "evictions": {"pressure": 0, "flush": 0, "rewrite": 0}}
        got = self.cache_json()
        self.assertGreater(got.pop("bytes"), 0)
        self.assertEqual(len(got["scopes"]), 1)
        self.assertEqual(got.pop("host")["enabled"], False)
        scope.update(host_pages=0, host_hit_tokens_total=0, host_hit_tokens=0)
        self.assertAlmostEqual(got["scopes"][0].pop("hit_rate"), scope.pop("hit_rate"), 6)
        self.assertEqual(got.pop("scopes"), [scope])
        self.assertAlmostEqual(got.pop("hit_rate"), want.pop("hit_rate"), 6)
        self.assertEqual(got, want)

        # a pin holds 2 pages: no longer cached, still indexed
        self.assertEqual(self.c.pin(self.PROMPT[:8]).pinned_pages, 2)
        st = stats_json(self.d.sock)["cache"]
        self.assertEqual((st["cached_pages"], st["pinned_pages"], st["indexed_pages"],
                          st["pins"], st["interval_ms"]), (2, 2, 4, 1, 0))
        rc, out, err = lc.ctl(self.d.sock, "stats")
        self.assertEqual(rc, 0, err)
        self.assertIn("\ncache        2 cached, 2 pinned, 4 indexed pages; hit rate 88.9% "
                      "(16 of 18 tokens)\n", out)
        rc, out, err = lc.ctl(self.d.sock, "cache")
        self.assertEqual(rc, 0, err)
        self.assertTrue(out.startswith(
            "pages        2 cached, 2 pinned, 4 indexed\n"
            "pins         1\n"
            "hit rate     88.9% (16 of 18 tokens) since start\n"
            "evictions    0 pressure, 0 flush, 0 rewrite\n"), out)
        self.assertRegex(out, r"\nSCOPE +UID +NAMESPACES +CACHED +INDEXED +QUERY +HIT +HIT%%\n"
                              r"ns:engine-a +%d +1 +2 +4 +18 +16 +88\.9%%\n$" % os.getuid())
        # over an interval with no lookup: nothing to divide
        rc, out, err = lc.ctl(self.d.sock, "cache", "-w", "0.3")
        self.assertEqual(rc, 0, err)
        self.assertIn("\nhit rate     - (no lookups) over 300ms\n", out)
        self.assertRegex(out, r"\nns:engine-a +%d +1 +2 +4 +0 +0 +-\n$" % os.getuid())
        got = self.cache_json("--interval", "0.3")
        self.assertEqual((got["interval_ms"], got["query_tokens"], got["hit_tokens"],
                          got["hit_rate"], got["query_tokens_total"]), (300, 0, 0, None, 18))

        _, s = self.d.scrape()
        self.assertEqual(value(s, "kvpool_prefix_cache_query_tokens_total"), 18)
        self.assertEqual(value(s, "kvpool_prefix_cache_hit_tokens_total", tier="gpu"), 16)
        self.assertEqual([value(s, "kvpool_prefix_cache_pages", tier="gpu", state=k)
                          for k in ("cached", "pinned", "indexed")], [2, 2, 4])
        self.assertEqual(value(s, "kvpool_prefix_cache_pins"), 1)
        rc, out, err = lc.ctl(self.d.sock, "top", "--count", "1")
        self.assertEqual(rc, 0, err)
        row = dict(kv.split("=", 1) for kv in out.split())
        self.assertEqual((row["cache_cached_pages"], row["cache_pinned_pages"],
                          row["cache_hit_rate"]), ("2", "2", "0.8889"))

        # flush: the namespace's own scope (joined with -n), then every scope (the daemon's
        # uid may: this test runs the daemon as itself); pinned pages stay
        rc, out, err = lc.ctl(self.d.sock, "cache", "flush")
        self.assertEqual(rc, 2, err)  # neither --scope, --all nor -n
        rc, out, err = lc.ctl(self.d.sock, "-n", "engine-b", "cache", "flush", "--json")
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out), {"pages": 0, "scope": "", "all": False,
                                           "namespace": "engine-b"})
        rc, out, err = lc.ctl(self.d.sock, "cache", "flush", "--all")
        self.assertEqual(rc, 0, err)
        self.assertEqual(out, "flushed 2 pages (every scope)\n")
        rc, out, err = lc.ctl(self.d.sock, "cache", "flush", "--scope", "ns:engine-a", "--json")
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["pages"], 0)  # nothing cached is left
        got = self.cache_json()
        self.assertEqual((got["cached_pages"], got["pinned_pages"], got["indexed_pages"],
                          got["evictions"]), (0, 2, 2, {"pressure": 0, "flush": 2, "rewrite": 0}))
        self.assertEqual(self.c.lookup([self.PROMPT]), [8])  # the pinned prefix
        _, s = self.d.scrape()
        self.assertEqual(value(s, "kvpool_prefix_cache_evictions_total", reason="flush"), 2)
        self.assertEqual(value(s, "kvpool_prefix_cache_evictions_total", reason="pressure"), 0)


class StartupTest(unittest.TestCase):
    def test_port_in_use_fails_the_start(self):
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        d = lc.Daemon(args=["--set", "server.metrics_listen=127.0.0.1:%d" % port], env=DAEMON_ENV)
        self.assertEqual(d.proc.wait(timeout=20), 1)
        self.assertIn("cannot serve metrics on 127.0.0.1:%d" % port, d.logtext())
        self.assertFalse(os.path.exists(d.sock))  # nothing left behind
        d.log.close()
        holder.close()

    def test_off_by_default(self):
        d = lc.Daemon(env=DAEMON_ENV)
        d.wait_ready()
        self.assertNotIn("metrics http", d.logtext())
        self.assertEqual(d.stop(), 0)


if __name__ == "__main__":
    try:
        unittest.main(verbosity=2)
    finally:
        lc.kill_all()
