#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Lifecycle of a real kvpoold process, driven from outside as an operator or systemd would:
kvpoolctl (every command, --json, exit codes), --check-config, socket activation through
LISTEN_FDS (our own harness and systemd's systemd-socket-activate), the notify protocol (READY,
WATCHDOG at the configured rate, RELOADING, STOPPING), SIGHUP reload, SIGTERM exit 0, and the
journal's log format when JOURNAL_STREAM names stderr. Standard library only.

usage: test_lifecycle.py BUILD_DIR
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

BUILD = os.path.abspath(sys.argv.pop(1)) if len(sys.argv) > 1 else "build"
KVPOOLD = os.path.join(BUILD, "server", "kvpoold")
CTL = os.path.join(BUILD, "client", "kvpoolctl")
SMALL = ["--backend", "host", "--num-pages", "64", "--page-size", "4", "--num-layers", "2"]


def wait_for(pred, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def can_connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


LIVE = []  # every daemon started, killed at exit whatever happened


def kill_all():
    for p in LIVE:
        if p.poll() is None:
            p.kill()
            p.wait()


class Daemon:
    def __init__(self, args=(), env=None, pass_fds=(), shell_prefix=None, preexec=None):
        self.dir = tempfile.mkdtemp(prefix="kvpool-lc-")
        self.sock = os.path.join(self.dir, "kvpool.sock")
        self.log = open(os.path.join(self.dir, "kvpoold.log"), "w+")
        cmd = [KVPOOLD, "--socket", self.sock, "--log-level", "debug"] + SMALL + list(args)
        e = dict(os.environ)
        for k in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "WATCHDOG_USEC"):
            e.pop(k, None)
        e.update(env or {})
        if shell_prefix:
            cmd = ["sh", "-c", shell_prefix + ' exec "$@"', "sh"] + cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, env=e,
                                     pass_fds=pass_fds, preexec_fn=preexec)
        LIVE.append(self.proc)

    def wait_ready(self):
        assert wait_for(lambda: can_connect(self.sock) or self.proc.poll() is not None), "no start"
        assert self.proc.poll() is None, self.logtext()

    def logtext(self):
        if not self.log.closed:
            self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM):
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=20)
        self.log.close()
        return code


def ctl(sock, *args, timeout=20):
    p = subprocess.run([CTL, "-s", sock] + list(args), capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


class KvpoolctlTest(unittest.TestCase):
    def setUp(self):
        self.d = Daemon()
        self.d.wait_ready()

    def tearDown(self):
        self.assertEqual(self.d.stop(), 0, self.d.logtext())

    def test_every_data_command_has_tables_and_json(self):
        for cmd in ("status", "stats", "pool", "seqs", "clients", "audit", "cache"):
            rc, out, err = ctl(self.d.sock, cmd)
            self.assertEqual(rc, 0, (cmd, err))
            self.assertTrue(out.strip() or (cmd == "seqs" and "no sequences" in err), cmd)
            rc, out, err = ctl(self.d.sock, cmd, "--json")
            self.assertEqual(rc, 0, (cmd, err))
            json.loads(out)  # one valid JSON object
        rc, out, _ = ctl(self.d.sock, "pool", "--json")
        pool = json.loads(out)
        self.assertEqual(pool["geometry"]["num_pages"] if "geometry" in pool
                         else pool["num_pages"], 64)
        rc, out, _ = ctl(self.d.sock, "stats", "--json")
        st = json.loads(out)
        self.assertEqual(st["num_pages"], 64)
        self.assertEqual(st["free_pages"], 64)
        # the prefix cache of an idle daemon, in stats and in cache (lifetime: no interval)
        idle = {"cached_pages": 0, "pinned_pages": 0, "indexed_pages": 0, "pins": 0,
                "query_tokens_total": 0, "hit_tokens_total": 0, "interval_ms": 0,
                "query_tokens": 0, "hit_tokens": 0, "hit_rate": None,
                "evictions": {"pressure": 0, "flush": 0, "rewrite": 0}}
        rc, out, _ = ctl(self.d.sock, "cache", "--json")
        cache = json.loads(out)
        self.assertEqual({k: cache[k] for k in idle}, idle)
        self.assertEqual({k: st["cache"][k] for k in idle}, idle)
        rc, out, err = ctl(self.d.sock, "cache", "--watch", "0.2", "--json")
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["interval_ms"], 200)
        rc, out, err = ctl(self.d.sock, "cache", "--interval", "0.2")
        self.assertEqual(rc, 0, err)
        self.assertIn("\nhit rate     - (no lookups) over 200ms\n", out)
        rc, out, _ = ctl(self.d.sock, "audit", "--json")
        self.assertTrue(json.loads(out)["ok"])

    def test_metrics_and_health(self):
        rc, out, _ = ctl(self.d.sock, "metrics")
        self.assertEqual(rc, 0)
        self.assertIn('kvpool_pages{device="0",state="capacity"} 64', out)
        self.assertIn("# TYPE kvpool_rpc_requests_total counter", out)
        rc, out, _ = ctl(self.d.sock, "health")
        self.assertEqual(rc, 0)
        self.assertEqual(out.strip(), "ok")

    def test_exit_codes(self):
        self.assertEqual(ctl(self.d.sock, "no-such-command")[0], 2)
        self.assertEqual(ctl(self.d.sock, "stats", "--bogus")[0], 2)
        self.assertEqual(ctl(self.d.sock, "seqs", "--limit", "abc")[0], 2)
        self.assertEqual(ctl(self.d.dir + "/absent.sock", "stats")[0], 3)
        self.assertEqual(ctl(self.d.dir + "/absent.sock", "health")[0], 1)
        # a server error: listing a namespace that does not exist
        rc, _, err = ctl(self.d.sock, "seqs", "-n", "nobody")
        self.assertEqual(rc, 1, err)
        # KVPOOL_SOCKET is honoured
        p = subprocess.run([CTL, "stats"], capture_output=True, text=True,
                           env=dict(os.environ, KVPOOL_SOCKET=self.d.sock))
        self.assertEqual(p.returncode, 0, p.stderr)


class KvpoolctlUsageTest(unittest.TestCase):
    """What kvpoolctl refuses before it connects (no daemon: a refused line exits 2, one that
    got through would try the absent socket and exit 3)."""

    def test_cache_options(self):
        absent = "/nonexistent/kvpool.sock"
        rc, out, _ = ctl(absent, "cache", "--help")
        self.assertEqual(rc, 0)
        self.assertIn("  cache [--interval SEC | -w, --watch SEC]\n", out)
        self.assertIn("  cache flush [--scope S | --all]\n", out)
        for args in (["cache", "--scope", "s"], ["cache", "--all"], ["stats", "--all"],
                     ["cache", "flush"],  # no scope, no namespace
                     ["cache", "flush", "--scope", "s", "--all"],
                     ["cache", "flush", "--interval", "1", "--all"],
                     ["cache", "flush", "--all", "again"], ["cache", "bogus"],
                     ["cache", "--watch", "0"], ["cache", "--interval", "x"],
                     ["top", "--watch", "1"], ["cache", "--cache-scope", "s"],
                     ["cache", "flush", "--scope", "x" * 65]):
            rc, _, err = ctl(absent, *args)
            self.assertEqual(rc, 2, (args, err))
        self.assertIn("cache flush: name --scope S or --all", ctl(absent, "cache", "flush")[2])
        for args in (["cache"], ["cache", "-w", "0.1"], ["cache", "flush", "--all"],
                     ["cache", "flush", "--scope", "x" * 64], ["-n", "me", "cache", "flush"],
                     ["-n", "me", "--cache-scope", "s", "cache", "flush", "--json"]):
            rc, _, err = ctl(absent, *args)
            self.assertEqual(rc, 3, (args, err))


class CheckConfigTest(unittest.TestCase):
    def test_check_config_good_and_bad(self):
        with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
            f.write("[pool]\nnum_pages = 100\npage_size = 8\n[server]\nlog_level = debug\n")
        p = subprocess.run([KVPOOLD, "--config", f.name, "--check-config"],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("num_pages = 100", p.stdout)
        self.assertIn("page_size = 8", p.stdout)
        with open(f.name, "w") as g:
            g.write("[pool]\nnum_pages = lots\n")
        p = subprocess.run([KVPOOLD, "--config", f.name, "--check-config"],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 1)
        self.assertIn("num_pages", p.stderr)
        p = subprocess.run([KVPOOLD, "--check-config", "--num-kv-heads", "3", "--devices", "0,1"],
                           capture_output=True, text=True)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("num_devices", p.stderr)
        os.unlink(f.name)


class SystemdTest(unittest.TestCase):
    def notify_socket(self, d):
        path = os.path.join(d, "notify.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.bind(path)
        s.settimeout(10)
        return s, path

    def test_socket_activation_and_notify(self):
        tmp = tempfile.mkdtemp(prefix="kvpool-sd-")
        lsock_path = os.path.join(tmp, "activated.sock")
        ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ls.bind(lsock_path)
        ls.listen(16)
        ns, npath = self.notify_socket(tmp)
        # fd 3 must be the listening socket, LISTEN_PID the daemon's own pid
        lfd = ls.fileno()
        move = "" if lfd == 3 else "exec 3<&%d %d<&-;" % (lfd, lfd)
        d = Daemon(env={"NOTIFY_SOCKET": npath, "LISTEN_FDS": "1", "WATCHDOG_USEC": "200000"},
                   pass_fds=(lfd,), shell_prefix=move + " LISTEN_PID=$$; export LISTEN_PID;")
        msgs = []
        t0 = time.time()
        while not any(m.startswith("READY=1") for m in msgs):
            msgs.append(ns.recv(4096).decode())
        self.assertIn("MAINPID=%d" % d.proc.pid, "\n".join(msgs))
        # served on the inherited socket, not on --socket
        rc, out, err = ctl(lsock_path, "stats", "--json")
        self.assertEqual(rc, 0, err + d.logtext())
        self.assertFalse(os.path.exists(d.sock))
        # WATCHDOG=1 every ~100 ms (WATCHDOG_USEC / 2)
        pings = []
        while len(pings) < 5:
            m = ns.recv(4096).decode()
            if "WATCHDOG=1" in m:
                pings.append(time.time())
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        # ~0.1 s apart; the upper bound leaves room for a loaded CI machine (ASan builds)
        self.assertTrue(all(0.03 < g < 2.0 for g in gaps), gaps)
        d.proc.send_signal(signal.SIGTERM)
        seen_stopping = False
        while not seen_stopping:
            seen_stopping = "STOPPING=1" in ns.recv(4096).decode()
        self.assertEqual(d.proc.wait(timeout=20), 0, d.logtext())
        ls.close()
        ns.close()

    def test_sighup_reloads_what_can_be_reloaded(self):
        tmp = tempfile.mkdtemp(prefix="kvpool-hup-")
        conf = os.path.join(tmp, "kvpoold.conf")
        with open(conf, "w") as f:
            f.write("[server]\nlog_level = info\n[limits]\ndefault_lease_ms = 500\n"
                    "max_lease_ms = 1000\n")
        d = Daemon(args=["--config", conf])
        d.wait_ready()
        with open(conf, "w") as f:
            f.write("[server]\nlog_level = debug\n[limits]\ndefault_lease_ms = 500\n"
                    "max_lease_ms = 5000\n[pool]\ndtype = bf16\n")
        d.proc.send_signal(signal.SIGHUP)
        self.assertTrue(wait_for(lambda: "reloaded" in d.logtext()), d.logtext())
        self.assertIn("restart to apply: pool.dtype", d.logtext())
        rc, out, _ = ctl(d.sock, "pool", "--json")
        self.assertEqual(rc, 0)
        self.assertIn('"fp16"', out)
        # a broken file keeps the running configuration
        with open(conf, "w") as f:
            f.write("[server]\nlog_level = loud\n")
        d.proc.send_signal(signal.SIGHUP)
        self.assertTrue(wait_for(lambda: "reload failed" in d.logtext()), d.logtext())
        self.assertEqual(ctl(d.sock, "health")[0], 0)
        self.assertEqual(d.stop(), 0, d.logtext())

    def test_systemd_socket_activate_notify_watchdog_reload_stop(self):
        """systemd's own activation tool: it listens, execs kvpoold on the first connection
        with LISTEN_FDS/LISTEN_PID set; notify READY (with MAINPID), WATCHDOG every
        WATCHDOG_USEC / 2, RELOADING then READY on SIGHUP, STOPPING on SIGTERM, exit 0."""
        tool = shutil.which("systemd-socket-activate")
        if not tool:
            self.skipTest("systemd-socket-activate missing (Debian package systemd)")
        tmp = tempfile.mkdtemp(prefix="kvpool-ssa-")
        act = os.path.join(tmp, "act.sock")
        ns, npath = self.notify_socket(tmp)
        conf = os.path.join(tmp, "kvpoold.conf")
        with open(conf, "w") as f:
            f.write("[server]\nlog_level = info\n")
        d = Daemon(args=["--config", conf],
                   shell_prefix='exec %s -l %s -E NOTIFY_SOCKET=%s -E WATCHDOG_USEC=300000 "$@"; #'
                   % (tool, act, npath))
        self.assertTrue(wait_for(lambda: os.path.exists(act)), d.logtext())
        self.assertEqual(ctl(act, "health")[0], 0, d.logtext())  # the first connection starts it
        msgs = []
        while not any("READY=1" in m for m in msgs):
            msgs.append(ns.recv(4096).decode())
        # the activation tool exec()s the daemon: the pid systemd would watch is the same
        self.assertIn("MAINPID=%d" % d.proc.pid, "\n".join(msgs))
        self.assertIn("inherited=1", d.logtext())
        self.assertIn("listening socket=(inherited)", d.logtext())
        self.assertFalse(os.path.exists(d.sock))
        pings = []
        while len(pings) < 6:
            if "WATCHDOG=1" in ns.recv(4096).decode():
                pings.append(time.time())
        gaps = sorted(b - a for a, b in zip(pings, pings[1:]))
        # every 150 ms: the median gap, with room for a loaded CI machine, never a burst
        self.assertTrue(0.1 < gaps[len(gaps) // 2] < 1.0, gaps)
        d.proc.send_signal(signal.SIGHUP)
        got = []
        while "READY=1" not in "".join(got[1:]):
            m = ns.recv(4096).decode()
            if "WATCHDOG=1" not in m:
                got.append(m)
        self.assertEqual(got[0], "RELOADING=1")
        d.proc.send_signal(signal.SIGTERM)
        while "STOPPING=1" not in ns.recv(4096).decode():
            pass
        self.assertEqual(d.proc.wait(timeout=20), 0, d.logtext())
        d.log.close()
        ns.close()

    def test_watchdog_off_sends_no_pings(self):
        tmp = tempfile.mkdtemp(prefix="kvpool-wd-")
        ns, npath = self.notify_socket(tmp)
        d = Daemon(args=["--set", "server.watchdog=false"],
                   env={"NOTIFY_SOCKET": npath, "WATCHDOG_USEC": "100000"})
        d.wait_ready()
        msgs = [ns.recv(4096).decode()]
        self.assertIn("READY=1", msgs[0])
        ns.settimeout(0.6)  # six intervals
        with self.assertRaises(socket.timeout):
            msgs.append(ns.recv(4096).decode())
        self.assertEqual(d.stop(), 0, d.logtext())
        ns.close()


class JournalLogTest(unittest.TestCase):
    """kvp_log's two styles on a real daemon: syslog priority prefixes and no timestamps when
    JOURNAL_STREAM names its stderr (as systemd sets it), RFC 3339 UTC timestamps otherwise."""

    def test_priority_prefix_when_stderr_is_the_journal(self):
        d = Daemon()
        d.wait_ready()
        self.assertEqual(d.stop(), 0)
        plain = d.logtext().splitlines()
        self.assertTrue(plain)
        ts = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (emerg|alert|crit|err|warning|"
                        r"notice|info|debug) \S")
        for line in plain:
            self.assertRegex(line, ts)

        # a second daemon whose stderr file is named by JOURNAL_STREAM
        tmp = tempfile.mkdtemp(prefix="kvpool-js-")
        path = os.path.join(tmp, "journal.log")
        f = open(path, "w+")
        st = os.fstat(f.fileno())
        e = dict(os.environ, JOURNAL_STREAM="%d:%d" % (st.st_dev, st.st_ino))
        sock = os.path.join(tmp, "k.sock")
        p = subprocess.Popen([KVPOOLD, "--socket", sock] + SMALL, stdout=subprocess.DEVNULL,
                             stderr=f, env=e)
        LIVE.append(p)
        self.assertTrue(wait_for(lambda: can_connect(sock)))
        p.send_signal(signal.SIGTERM)
        self.assertEqual(p.wait(timeout=20), 0)
        f.close()
        with open(path) as g:
            lines = g.read().splitlines()
        self.assertIn("<5>listening socket=%s mode=0660 inherited=0" % sock, lines)
        self.assertTrue(any(x.startswith("<5>ready version=") for x in lines), lines)
        self.assertTrue(any(x.startswith("<6>pool created backend=host") for x in lines), lines)
        for line in lines:
            self.assertRegex(line, r"^<[0-7]>[a-z]")  # priority, then the event; no timestamp
        # a JOURNAL_STREAM naming another file leaves the plain style on
        other = os.stat(tmp)
        f = open(path, "w+")
        e["JOURNAL_STREAM"] = "%d:%d" % (other.st_dev, other.st_ino)
        p = subprocess.Popen([KVPOOLD, "--socket", sock] + SMALL, stdout=subprocess.DEVNULL,
                             stderr=f, env=e)
        LIVE.append(p)
        self.assertTrue(wait_for(lambda: can_connect(sock)))
        p.send_signal(signal.SIGTERM)
        self.assertEqual(p.wait(timeout=20), 0)
        f.close()
        with open(path) as g:
            for line in g.read().splitlines():
                self.assertRegex(line, ts)


if __name__ == "__main__":
    try:
        unittest.main(verbosity=2)
    finally:
        kill_all()
