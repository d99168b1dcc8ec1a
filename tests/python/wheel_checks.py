# SPDX-License-Identifier: Apache-2.0
"""The checks of tests/python/test_wheel.sh, run by the fresh virtualenv's Python on the
installed wheel (never the source tree's copy: the script runs it from a temporary directory
with PYTHONPATH, KVPOOL_LIB and BUILD_DIR unset). Each subcommand exits non-zero with a message
on the first failed check.

  wheel_checks.py contents WHEEL VERSION    the wheel's file list
  wheel_checks.py installed VERSION         where the package and its library are, imports
  wheel_checks.py client SOCKET VERSION     a real kvpoold (host backend, the script's geometry)
  wheel_checks.py mismatch VERSION TEXT...  load() fails with LibraryMismatch naming TEXTs
  wheel_checks.py missing PATH              load() fails (OSError) naming PATH
"""
import os
import sys
import zipfile


def fail(msg):
    sys.exit("wheel_checks: FAIL: " + msg)


def check(cond, msg):
    if not cond:
        fail(msg)


def contents(wheel, version):
    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
    names = sorted(i.filename for i in infos)
    dist = "kvpool-%s.dist-info/" % version
    want = {"kvpool/__init__.py", "kvpool/_lib.py", "kvpool/_version.py", "kvpool/py.typed",
            "kvpool/libkvpool.so", "kvpool/client.py", "kvpool/paged.py", "kvpool/errors.py",
            "kvpool/_types.py", "kvpool/_torch.py", "kvpool/_cuda_pool.py", "kvpool/_host.py",
            "kvpool/_args.py", "kvpool/codes.py", "kvpool/records.py", "kvpool/step.py",
            "kvpool/integrations/__init__.py", "kvpool/integrations/transformers/__init__.py",
            "kvpool/integrations/transformers/_cache.py",
            "kvpool/integrations/transformers/_attention.py",
            "kvpool/integrations/transformers/_forward.py",
            "kvpool/integrations/transformers/_generate.py",
            "kvpool/integrations/transformers/_graphs.py", dist + "METADATA", dist + "WHEEL",
            dist + "RECORD", dist + "licenses/LICENSE"}
    check(want <= set(names), "missing from the wheel: %s" % sorted(want - set(names)))
    libs = [n for n in names if "libkvpool" in n]
    check(libs == ["kvpool/libkvpool.so"], "one libkvpool in the wheel, got %s" % libs)
    stray = [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    check(not stray, "bytecode in the wheel: %s" % stray)
    # a symlink in a zip is a file whose external attributes say S_IFLNK (0o120000)
    links = [i.filename for i in infos if (i.external_attr >> 16) & 0o170000 == 0o120000]
    check(not links, "symlinks in the wheel: %s" % links)
    base = os.path.basename(wheel)
    check(base == "kvpool-%s-py3-none-linux_x86_64.whl" % version,
          "wheel name %s (want kvpool-%s-py3-none-linux_x86_64.whl)" % (base, version))
    with zipfile.ZipFile(wheel) as z:
        gen = z.read("kvpool/_version.py").decode()
        meta = z.read(dist + "METADATA").decode()
    check('__version__ = "%s"' % version in gen, "kvpool/_version.py: %r" % gen)
    check("\nVersion: %s\n" % version in meta, "METADATA lacks Version: %s" % version)
    for extra in ("torch", "transformers"):
        check("Provides-Extra: %s" % extra in meta, "METADATA lacks the extra %s" % extra)
    print("wheel_checks: contents ok (%d files)" % len(names))


class _NoTorch:
    """A meta path finder that refuses torch and transformers: `import kvpool` must not need
    them (whether or not they are installed)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError("wheel_checks: %s imported by `import kvpool`" % name)
        return None


def installed(version):
    for k in ("KVPOOL_LIB", "BUILD_DIR", "PYTHONPATH"):
        check(k not in os.environ, "%s is set" % k)
    sys.meta_path.insert(0, _NoTorch())
    import kvpool
    from kvpool import _lib

    sys.meta_path.pop(0)
    pkg = os.path.dirname(os.path.abspath(kvpool.__file__))
    check(os.sep + "site-packages" + os.sep in pkg + os.sep, "kvpool imported from %s" % pkg)
    check(kvpool.__version__ == version, "__version__ %r, want %r" % (kvpool.__version__, version))
    from importlib import metadata

    check(metadata.version("kvpool") == version, "metadata version %r" % metadata.version("kvpool"))
    check(os.path.isfile(os.path.join(pkg, "py.typed")), "no py.typed in %s" % pkg)
    lib = kvpool.library_path()
    check(lib == os.path.join(pkg, "libkvpool.so"), "library %s, want the bundled one" % lib)
    check(not os.path.islink(lib), "%s is a symlink" % lib)
    L = _lib.load()
    check(L.kvp_client_version().decode() == version, "kvp_client_version %r"
          % L.kvp_client_version())
    check(L.kvp_client_abi_version() == kvpool.ABI_VERSION, "ABI %d"
          % L.kvp_client_abi_version())
    check(not any(m.split(".")[0] in ("torch", "transformers") for m in sys.modules),
          "torch or transformers loaded")
    print("wheel_checks: installed ok (%s, %s)" % (pkg, lib))


def client(sock, version):
    import numpy as np

    import kvpool

    with kvpool.Client(sock, "wheel", lease_ms=0) as c:
        check(c.server_version == version, "server_version %r" % c.server_version)
        i = c.pool_info
        got = (i.num_layers, i.num_pages, i.page_size, i.num_kv_heads, i.head_dim,
               i.dtype_name, i.layout_name, i.storage_name, i.backend_name, i.elem_bytes)
        want = (2, 64, 16, 2, 8, "fp16", "nhd", "combined", "host", 2)
        check(got == want, "pool_info %s, want %s" % (got, want))
        check(i.layer_bytes == 64 * 2 * 16 * 2 * 8 * 2, "layer_bytes %d" % i.layer_bytes)
        s = c.stats()
        check((s.num_pages, s.free_pages, s.used_pages, s.num_seqs, s.num_tokens)
              == (64, 64, 0, 0, 0), "stats before: %s" % (s,))
        t = c.reserve([1, 2], [5, 17])  # 1 page (5 of 16) and 2 pages (16 + 1)
        check(t.kv_indptr.tolist() == [0, 1, 3], "kv_indptr %s" % t.kv_indptr.tolist())
        check(t.kv_last_page_len.tolist() == [5, 1], "kv_last_page_len %s"
              % t.kv_last_page_len.tolist())
        check(t.append_indptr.tolist() == [0, 5, 22], "append_indptr %s"
              % t.append_indptr.tolist())
        check(t.seq_lens.tolist() == [5, 17], "seq_lens %s" % t.seq_lens.tolist())
        check(t.nnz == 22 and t.batch_size == 2, "nnz %d batch %d" % (t.nnz, t.batch_size))
        pages = t.kv_indices.tolist()
        check(len(pages) == 3 and len(set(pages)) == 3 and all(0 <= p < 64 for p in pages),
              "kv_indices %s" % pages)
        check(t.copies.shape == (0, 2), "copies %s" % (t.copies.shape,))
        # the NumPy path over the mapped pool: K of token 4 of sequence 1 lands in its page
        bi, pos = kvpool.get_batch_indices_positions(t.append_indptr, t.seq_lens, t.nnz)
        k = np.arange(22 * 2 * 8, dtype=np.float16).reshape(22, 2, 8)
        v = -k
        kvpool.append_paged_kv_cache(k, v, bi, pos, c.paged_kv_cache(0), t.kv_indices,
                                     t.kv_indptr, t.kv_last_page_len, kv_layout="NHD")
        check(np.array_equal(c.k_view(0)[pages[0], 4], k[4]), "K row of token 4")
        check(np.array_equal(c.v_view(0)[pages[2], 0], v[21]), "V row of token 21")
        s = c.stats()
        check((s.free_pages, s.used_pages, s.num_seqs, s.num_tokens) == (61, 3, 2, 22),
              "stats after reserve: %s" % (s,))
        check(c.release([1, 2, 3]) == 2, "release: 2 of 3 existed")
        s = c.stats()
        check((s.free_pages, s.used_pages, s.num_seqs, s.num_tokens) == (64, 0, 0, 0),
              "stats after release: %s" % (s,))
        try:
            c.fork(1, 4)
            fail("fork of a released sequence succeeded")
        except kvpool.NotFound as e:
            check(e.name == "KVP_ENOENT", "fork: %s" % e.name)
    print("wheel_checks: client ok (pages %s)" % pages)


def mismatch(version, texts):
    import kvpool
    from kvpool import _lib

    try:
        _lib.load()
    except kvpool.LibraryMismatch as e:
        msg = str(e)
        check(isinstance(e, ImportError), "LibraryMismatch is not an ImportError")
        for t in list(texts) + ["the kvpool package %s" % version, "KVPOOL_LIB", "Reinstall"]:
            check(t in msg, "%r not in the message: %s" % (t, msg))
        check(e.path == os.environ["KVPOOL_LIB"], "path %r" % e.path)
        print("wheel_checks: mismatch ok: %s" % msg)
        return
    fail("load() accepted %s" % os.environ.get("KVPOOL_LIB"))


def missing(path):
    from kvpool import _lib

    try:
        _lib.load()
    except OSError as e:
        check("%s (missing)" % path in str(e), "message: %s" % e)
        print("wheel_checks: missing ok: %s" % e)
        return
    fail("load() found a library at %s" % path)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "contents":
        contents(args[0], args[1])
    elif cmd == "installed":
        installed(args[0])
    elif cmd == "client":
        client(args[0], args[1])
    elif cmd == "mismatch":
        mismatch(args[0], args[1:])
    elif cmd == "missing":
        missing(args[0])
    else:
        fail("unknown subcommand %s" % cmd)
