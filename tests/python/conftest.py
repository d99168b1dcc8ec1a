# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures of tests/python: the kvpool package (installed, or the source tree's copy) and
real kvpoold processes on the host backend (the `start` factory, each daemon stopped at the end
of its test). The daemon is $KVPOOLD, else $BUILD_DIR/server/kvpoold, else build/server/kvpoold.
"""
import os
import signal
import socket as pysocket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import kvpool
except ImportError:  # not installed: the source tree's copy
    sys.path.insert(0, os.path.join(ROOT, "client", "python"))
    import kvpool

BUILD = os.environ.get("BUILD_DIR") or os.path.join(ROOT, "build")
KVPOOLD = os.environ.get("KVPOOLD") or os.path.join(BUILD, "server", "kvpoold")
# the backend of the daemons a test does not name one for: host, or $KVP_TEST_BACKEND (cuda on
# the GPU machine: tests/gpu/run_device.sh events)
BACKEND = os.environ.get("KVP_TEST_BACKEND") or "host"

def wait_for(what, cond, timeout_s=10.0):
    """Polls cond() until it is true (what the daemon does in the background: the demoter, the
    tier's allocation, the publisher's thread); fails naming `what` after timeout_s."""
    end = time.time() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.time() > end:
            pytest.fail("timed out waiting for " + what)
        time.sleep(0.01)


class Daemon:
    def __init__(self, args):
        self.dir = tempfile.mkdtemp(prefix="kvpool-py-")
        self.sock = os.path.join(self.dir, "kvpool.sock")
        self.log = open(os.path.join(self.dir, "kvpoold.log"), "w+")
        env = {k: v for k, v in os.environ.items()
               if k not in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "WATCHDOG_USEC")}
        backend = [] if "--backend" in args else ["--backend", BACKEND]  # unless named
        self.proc = subprocess.Popen([KVPOOLD, "--socket", self.sock] + backend + list(args),
                                     stdout=subprocess.DEVNULL, stderr=self.log, env=env)
        end = time.time() + 10
        while time.time() < end and self.proc.poll() is None:
            s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
            try:
                s.connect(self.sock)
                break
            except OSError:
                time.sleep(0.01)
            finally:
                s.close()
        assert self.proc.poll() is None, "kvpoold did not start:\n" + self.logtext()

    def logtext(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def client(self, ns="default", lease_ms=0, **kw):
        return kvpool.Client(self.sock, ns, lease_ms, **kw)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def start():
    """A factory of daemons, each stopped at the end of the test."""
    live = []

    def make(*args):
        d = Daemon(args)
        live.append(d)
        return d

    yield make
    for d in live:
        d.stop()


