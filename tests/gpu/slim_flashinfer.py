#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""slim_flashinfer.py - a copy of the flashinfer-python wheel small enough to carry to the GPU
machine (which has no network): only what the paged decode and prefill wrappers and page.cuh
need. FlashInfer is a peer fetched from PyPI, never committed; this script only trims a wheel
that was downloaded, e.g.

    pip download --no-deps flashinfer-python==0.7.2.post1 -d /tmp/wh
    python3 tests/gpu/slim_flashinfer.py /tmp/wh/flashinfer_python-*.whl .gpu/

Dropped: the CUDA sources under flashinfer/data/csrc/<subfolder>/ (MoE, GEMM, sampling and other
kernel families; the attention modules compile only csrc's top-level files), the non-Python files
of flashinfer/experimental/, and the examples, tests, tools (but CUTLASS's tools/util/include,
which FlashInfer's SM90 prefill includes), docs and Python packages of the vendored CUTLASS and
CCCL (their headers stay). The wheel's RECORD is rewritten to the files kept
(hash and size of each), so pip installs it as a normal wheel. Prints the sizes before and after.
"""
import base64
import hashlib
import os
import sys
import zipfile

DROP_DIRS = ("flashinfer/data/cutlass/examples/", "flashinfer/data/cutlass/python/",
             "flashinfer/data/cutlass/test/", "flashinfer/data/cutlass/docs/", "flashinfer/data/cccl/benchmarks/",
             "flashinfer/data/cccl/ci/", "flashinfer/data/cccl/docs/",
             "flashinfer/data/cccl/python/", "flashinfer/data/cccl/examples/")


def keep(name):
    if any(name.startswith(d) for d in DROP_DIRS):
        return False
    if name.startswith("flashinfer/data/cutlass/tools/"):  # its util headers are included
        return name.startswith("flashinfer/data/cutlass/tools/util/include/")
    if name.startswith("flashinfer/data/csrc/"):
        return "/" not in name[len("flashinfer/data/csrc/"):]  # top-level files only
    if name.startswith("flashinfer/experimental/"):
        return name.endswith(".py")
    return True


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (name, digest, len(data))


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: slim_flashinfer.py WHEEL OUTDIR")
    src, outdir = sys.argv[1], sys.argv[2]
    os.makedirs(outdir, exist_ok=True)
    dst = os.path.join(outdir, os.path.basename(src))
    if os.path.abspath(dst) == os.path.abspath(src):
        sys.exit("slim_flashinfer.py: OUTDIR must not hold WHEEL itself")
    lines, record = [], None
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED,
                                                      compresslevel=9) as zout:
        for info in zin.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                record = info.filename
                continue
            if info.is_dir() or not keep(info.filename):
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            lines.append(record_line(info.filename, data))
        if record is None:
            sys.exit("slim_flashinfer.py: %s has no RECORD: not a wheel" % src)
        lines.append(record + ",,")
        zout.writestr(record, "\n".join(lines) + "\n")
    print("%s: %.1f MB -> %s: %.1f MB, %d files" % (src, os.path.getsize(src) / 1e6, dst,
                                                    os.path.getsize(dst) / 1e6, len(lines)))


if __name__ == "__main__":
    main()
