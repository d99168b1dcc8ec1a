#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Static checks of deploy/container (there is no Docker daemon in CI to build the image):
the Dockerfile's stages and their references, every COPY source in the build context, every
file the runtime stage copies out of the build stage's `cmake --install` tree (checked against
a real install of this build with the same prefix, /usr), the non-root user, the health check
through `kvpoolctl health`, and the compose file's settings that cross-process GPU sharing
needs. Standard library only (no YAML parser: the compose checks are textual).

usage: test_container.py SOURCE_DIR BUILD_DIR
"""
import os
import re
import shlex
import subprocess
import sys
import tempfile
import unittest

SRC, BUILD = (os.path.abspath(a) for a in sys.argv[1:3])
del sys.argv[1:3]
CDIR = os.path.join(SRC, "deploy", "container")


def instructions(path):
    """The Dockerfile as (instruction, argument text) pairs, continuations joined."""
    out, cur = [], ""
    with open(path) as f:
        for line in f:
            s = line.rstrip("\n")
            if not cur and (not s.strip() or s.lstrip().startswith("#")):
                continue
            if cur and s.lstrip().startswith("#"):
                continue  # a comment inside a continued instruction
            if s.endswith("\\"):
                cur += s[:-1] + " "
                continue
            cur += s
            word, _, rest = cur.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            cur = ""
    assert not cur, "dangling continuation"
    return out


class DockerfileTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.ins = instructions(os.path.join(CDIR, "Dockerfile"))
        cls.stages, cls.by_stage, stage = [], {}, None
        for word, rest in cls.ins:
            if word == "FROM":
                m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?$", rest, re.I)
                assert m, rest
                stage = m.group(2)
                cls.stages.append((m.group(1), stage))
                cls.by_stage[stage] = []
            elif stage:
                cls.by_stage[stage].append((word, rest))
        # the install tree the build stage produces: prefix /usr, DESTDIR
        cls.tmp = tempfile.mkdtemp(prefix="kvpool-ctr-")
        cls.out = os.path.join(cls.tmp, "out")
        p = subprocess.run(["cmake", "--install", BUILD, "--prefix", "/usr"],
                           env=dict(os.environ, DESTDIR=cls.out), capture_output=True, text=True)
        assert p.returncode == 0, p.stdout + p.stderr

    def test_stages_and_base_images(self):
        names = [n for _, n in self.stages]
        self.assertEqual(names, ["build", "runtime", "worker"])
        self.assertRegex(self.stages[0][0], r"^nvidia/cuda:\$\{CUDA_VERSION\}-devel-")
        self.assertRegex(self.stages[1][0], r"^nvidia/cuda:\$\{CUDA_VERSION\}-base-")
        self.assertEqual(self.stages[2][0], "runtime")
        args = {rest.split("=")[0] for w, rest in self.ins if w == "ARG"}
        self.assertTrue({"CUDA_VERSION", "UBUNTU_VERSION"} <= args)

    def test_copy_sources_exist(self):
        seen_from = set()
        for stage, body in self.by_stage.items():
            for word, rest in body:
                if word != "COPY":
                    continue
                parts = shlex.split(rest)
                opts = [p for p in parts if p.startswith("--")]
                paths = [p for p in parts if not p.startswith("--")]
                srcs = paths[:-1]
                frm = [o.split("=", 1)[1] for o in opts if o.startswith("--from=")]
                if frm:
                    seen_from.add((stage, frm[0]))
                    self.assertIn(frm[0], self.by_stage, "COPY --from an unknown stage")
                    for s in srcs:
                        if s.startswith("/out/"):
                            self.assertTrue(os.path.exists(os.path.join(self.out, s[5:])),
                                            "%s: the install tree has no %s" % (stage, s))
                        elif s.startswith("/src/build/"):
                            self.assertTrue(os.path.exists(os.path.join(BUILD, s[11:])), s)
                        elif s.startswith("/src/"):
                            self.assertTrue(os.path.exists(os.path.join(SRC, s[5:])), s)
                        else:
                            self.fail("COPY --from=%s of %s: neither /out nor /src" % (frm, s))
                else:
                    for s in srcs:
                        self.assertTrue(os.path.exists(os.path.join(SRC, s)),
                                        "COPY source %s is not in the build context" % s)
        self.assertIn(("runtime", "build"), seen_from)

    def test_build_stage_installs_to_out_with_prefix_usr(self):
        runs = " ".join(r for w, r in self.by_stage["build"] if w == "RUN")
        self.assertIn("-DCMAKE_INSTALL_PREFIX=/usr", runs)
        self.assertIn("DESTDIR=/out cmake --install build", runs)
        self.assertIn("ctest --test-dir build -L unit", runs)
        # every directory the build needs is copied in
        copied = {shlex.split(r)[0].rstrip("/") for w, r in self.by_stage["build"]
                  if w == "COPY" and "--from" not in r}
        with open(os.path.join(SRC, "CMakeLists.txt")) as f:
            subdirs = re.findall(r"^add_subdirectory\((\w+)\)", f.read(), re.M)
        for d in subdirs:
            self.assertIn(d, copied, "the build stage does not copy %s/" % d)

    def test_runtime_is_non_root_with_health_check(self):
        body = dict()
        for w, r in self.by_stage["runtime"]:
            body.setdefault(w, []).append(r)
        self.assertEqual(body["USER"], ["kvpool:kvpool"])
        hc = body["HEALTHCHECK"][0]
        self.assertRegex(hc, r'CMD \["/usr/bin/kvpoolctl", .*"health"\]')
        self.assertIn('"/run/kvpool/kvpool.sock"', hc)
        ep = body["ENTRYPOINT"][0]
        self.assertEqual(ep, '["/usr/sbin/kvpoold", "--config", "/etc/kvpool/kvpoold.conf"]')
        # what the entrypoint and health check name is copied in
        dests = [shlex.split(r)[-1] for r in body["COPY"]]
        for p in ("/usr/sbin/kvpoold", "/usr/bin/kvpoolctl", "/etc/kvpool/kvpoold.conf"):
            self.assertIn(p, dests)
        self.assertIn('["/run/kvpool"]', body["VOLUME"])
        self.assertEqual(body["STOPSIGNAL"], ["SIGTERM"])
        # the socket path of the example config (set in its template) is the one the image serves
        with open(os.path.join(SRC, "deploy", "kvpoold.conf.in")) as f:
            self.assertIn("server.socket = /run/kvpool/kvpool.sock\n", f.read())
        self.assertEqual(dict(self.by_stage["worker"])["USER"], "kvpool:kvpool")


class ComposeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(os.path.join(CDIR, "compose.yaml")) as f:
            cls.text = f.read()
        # top-level services, split by their 2-space-indented names
        cls.services = dict(re.findall(r"^  (\w+):\n((?:    .*\n|\s*\n)*)",
                                       cls.text.split("\nservices:\n", 1)[1].split(
                                           "\nvolumes:\n")[0] + "\n", re.M))

    def test_daemon_and_worker(self):
        self.assertEqual(set(self.services), {"kvpoold", "worker"})
        targets = re.findall(r"target: (\w+)", self.text)
        self.assertEqual(targets, ["runtime", "worker"])
        self.assertEqual(set(re.findall(r"dockerfile: (\S+)", self.text)),
                         {"deploy/container/Dockerfile"})
        self.assertTrue(os.path.isfile(os.path.join(CDIR, "../..", "deploy/container/Dockerfile")))

    def test_gpu_sharing_settings(self):
        d, w = self.services["kvpoold"], self.services["worker"]
        for svc in (d, w):
            self.assertIn("- kvpool-run:/run/kvpool", svc)
            self.assertIn("memlock: -1", svc)
            self.assertIn("driver: nvidia", svc)
            self.assertIn("capabilities: [gpu]", svc)
        ids = [re.findall(r"device_ids: (\[.*\])", s) for s in (d, w)]
        self.assertEqual(ids[0], ids[1], "both containers must get the same GPUs in order")
        self.assertIn('pid: "service:kvpoold"', w)
        self.assertIn('- "10001"', w)  # the image's kvpool gid
        self.assertIn("condition: service_healthy", w)
        self.assertNotIn("CUDA_VISIBLE_DEVICES", self.text)
        self.assertIn("\nvolumes:\n  kvpool-run:\n", self.text)


if __name__ == "__main__":
    unittest.main(verbosity=2)
