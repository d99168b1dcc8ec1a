#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test.sh - THE test command of the README: on a fresh Debian 12 machine it installs what is
# missing, configures, builds and runs the whole test suite, then builds everything again as
# Release (build only, no test run, to keep CI time down: it is there because -O3 -DNDEBUG
# finds warnings, hence errors, that RelWithDebInfo's -O2 does not), then builds the unit
# tests again under AddressSanitizer + UndefinedBehaviorSanitizer and runs them (with the
# stress tests), then a bounded valgrind memcheck run (tests/valgrind.sh quick: the daemon
# under valgrind too) and the fuzzers. The Python package's pytest suite (tests/python) runs
# against the default build, then the tests that need PyTorch (the transformers integration,
# kvpool._torch's custom operators; on the CPU, host backend) in a venv with torch and
# transformers from PyPI (tests/python/run.sh --torch: build/torch-venv, made on the first run
# and reused); ctest's package tests build a program outside the tree against the
# installed library (tests/install) and install the wheel in a fresh virtualenv
# (tests/python/test_wheel.sh); the .deb is built, installed, removed and purged here
# (tests/deb/test_deb.sh: root only, skipped otherwise).
#
#   deploy/test.sh              everything (what .ci/run calls)
#   KVP_TEST_QUICK=1 deploy/test.sh   skip the Release and sanitizer builds, valgrind and the
#                                     fuzzers
#   KVP_FUZZ_SECONDS=600 deploy/test.sh   a longer fuzz run (default 20 s per target)
#
# Build trees: build/ (default, RelWithDebInfo) and build-release/ (Release, built only), both
# with CUDA when nvcc is found; build-asan/, build-valgrind/ and build-fuzz/ (CUDA off).
# GPU tests exit 77 where there is no GPU and CTest counts them as skipped.
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(nproc 2>/dev/null || echo 2)

"$root/deploy/install-deps.sh"

echo "== build (default) =="
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$root/build" -j "$jobs"
echo "== tests (default) =="
ctest --test-dir "$root/build" --output-on-failure -j "$jobs"
echo "== tests (python package, host backend) =="
BUILD_DIR="$root/build" sh "$root/tests/python/run.sh"
echo "== tests (python package with PyTorch and transformers, CPU, host backend) =="
BUILD_DIR="$root/build" sh "$root/tests/python/run.sh" --torch
# (the installed C library built against outside the tree, test_install, and the Python wheel
# in a fresh virtualenv, test_wheel, ran in ctest above: label package)
echo "== Debian package (tests/deb/test_deb.sh: build-deb/, dpkg -i, -r, -P on this machine) =="
rc=0
sh "$root/tests/deb/test_deb.sh" "$root/build-deb" || rc=$?
[ "$rc" -eq 0 ] || [ "$rc" -eq 77 ] || exit "$rc"

if [ "${KVP_TEST_QUICK:-0}" != "1" ]; then
    echo "== build (release, build only: no tests run) =="
    cmake -S "$root" -B "$root/build-release" -DCMAKE_BUILD_TYPE=Release
    cmake --build "$root/build-release" -j "$jobs"
    echo "== build (asan+ubsan) =="
    cmake -S "$root" -B "$root/build-asan" -DCMAKE_BUILD_TYPE=Debug -DKVP_SANITIZE=ON \
        -DKVP_WITH_CUDA=OFF
    cmake --build "$root/build-asan" -j "$jobs"
    echo "== tests (asan+ubsan) =="
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
        ctest --test-dir "$root/build-asan" --output-on-failure -j "$jobs" -L "unit|integration|stress"
    echo "== tests (valgrind memcheck, daemon included; tests/valgrind.sh quick) =="
    sh "$root/tests/valgrind.sh" quick
fi
if [ "${KVP_TEST_QUICK:-0}" != "1" ]; then
    echo "== fuzz (libFuzzer, clang, ${KVP_FUZZ_SECONDS:-20} s per target) =="
    sh "$root/tests/fuzz/run.sh" "${KVP_FUZZ_SECONDS:-20}"
fi
echo "== all tests passed =="
