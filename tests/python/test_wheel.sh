#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_wheel.sh - the Python wheel on its own (issue #19): builds it from client/python
# (scikit-build-core runs the project's CMake, here with KVP_WITH_CUDA=OFF to stay fast),
# installs it in a fresh virtualenv with numpy, and from outside the source tree, with
# KVPOOL_LIB, BUILD_DIR and PYTHONPATH unset, checks that the package loads the libkvpool.so it
# carries and talks to a real kvpoold (host backend, a temporary socket); then that KVPOOL_LIB
# naming a missing file, a library without kvp_client_version, or a libkvpool of another
# version, ABI or struct size gives the clear error. The checks are tests/python/wheel_checks.py.
#
#   tests/python/test_wheel.sh [BUILD_DIR]   the daemon: $KVPOOLD, else BUILD_DIR/server/kvpoold
#                                            (BUILD_DIR: the argument, $BUILD_DIR, or build/)
#   KVP_WHEEL_PYTHON=python3.12 ...          the Python that makes the virtualenv (python3)
#   KVP_WHEEL_KEEP=1 ...                     keep the temporary directory (the wheel, logs)
#
# Exits 77 (skipped) when the virtualenv cannot be made (Debian: python3-venv) or the package
# index cannot be reached (pip fetches scikit-build-core, and cmake/ninja when the system's are
# missing or too old); any other failure exits 1.
set -eu

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD_DIR=${1:-${BUILD_DIR:-$ROOT/build}}
case $BUILD_DIR in /*) ;; *) BUILD_DIR=$ROOT/$BUILD_DIR ;; esac
KVPOOLD=${KVPOOLD:-$BUILD_DIR/server/kvpoold}
PY=${KVP_WHEEL_PYTHON:-python3}
CHECKS=$ROOT/tests/python/wheel_checks.py
[ -x "$KVPOOLD" ] || { echo "test_wheel: FAIL: $KVPOOLD missing: build first" >&2; exit 1; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvpool-wheel.XXXXXX")
daemon=""
cleanup() {
    if [ -n "$daemon" ]; then
        kill "$daemon" 2>/dev/null || true
        wait "$daemon" 2>/dev/null || true
    fi
    if [ "${KVP_WHEEL_KEEP:-0}" = 1 ]; then
        echo "test_wheel: kept $tmp"
    else
        rm -rf "$tmp"
    fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM
skip() { echo "test_wheel: SKIP: $*"; exit 77; }
fail() { echo "test_wheel: FAIL: $*" >&2; exit 1; }
show() { echo "---- $1"; tail -n "${2:-40}" "$1"; }

# The version the wheel must carry: the project() line of CMakeLists.txt, the only place.
version=$(sed -n 's/^project(kvpool VERSION \([0-9]*\.[0-9]*\.[0-9]*\).*/\1/p' "$ROOT/CMakeLists.txt")
abi=$(sed -n 's/^set(KVP_ABI_VERSION \([0-9]*\))$/\1/p' "$ROOT/CMakeLists.txt")
[ -n "$version" ] || fail "no project(kvpool VERSION X.Y.Z ...) line in CMakeLists.txt"

# ---- a fresh virtualenv, and the package index -------------------------------------------
unset KVPOOL_LIB PYTHONPATH PYTHONHOME VIRTUAL_ENV PIP_REQUIRE_VIRTUALENV 2>/dev/null || true
if ! "$PY" -m venv "$tmp/venv" >"$tmp/venv.log" 2>&1 || [ ! -x "$tmp/venv/bin/pip" ]; then
    cat "$tmp/venv.log"
    skip "$PY -m venv does not work (Debian: apt-get install python3-venv)"
fi
VPY=$tmp/venv/bin/python
pip() { "$VPY" -m pip --disable-pip-version-check "$@"; }
if ! pip download -q --no-deps --timeout 20 --retries 1 -d "$tmp/probe" \
        "scikit-build-core>=0.10" >"$tmp/probe.log" 2>&1; then
    cat "$tmp/probe.log"
    skip "the package index cannot be reached (pip download scikit-build-core failed)"
fi

# ---- build the wheel (pip's isolated build: scikit-build-core from the index) ---------------
echo "test_wheel: building the wheel of $ROOT/client/python (KVP_WITH_CUDA=OFF)"
start=$(date +%s)
if ! pip wheel --no-deps -w "$tmp/dist" "$ROOT/client/python" \
        --config-settings=cmake.define.KVP_WITH_CUDA=OFF >"$tmp/wheel.log" 2>&1; then
    show "$tmp/wheel.log" 80
    fail "pip wheel failed"
fi
whl=$(ls "$tmp"/dist/kvpool-*.whl)
echo "test_wheel: built $(basename "$whl") ($(wc -c <"$whl") bytes) in $(($(date +%s) - start)) s"
"$VPY" "$CHECKS" contents "$whl" "$version"

# ---- install it, use it from outside the source tree ---------------------------------------
if ! pip install -q "$whl" >"$tmp/install.log" 2>&1; then
    show "$tmp/install.log"
    fail "pip install of the wheel (with numpy) failed"
fi
cd "$tmp"
env -u BUILD_DIR "$VPY" "$CHECKS" installed "$version"

sock=$tmp/kvpool.sock
"$KVPOOLD" --backend host --socket "$sock" --num-layers 2 --num-pages 64 --page-size 16 \
    --num-kv-heads 2 --head-dim 8 --dtype fp16 --layout nhd --storage combined \
    >"$tmp/kvpoold.log" 2>&1 &
daemon=$!
i=0
while [ ! -S "$sock" ]; do
    i=$((i + 1))
    if [ $i -gt 100 ] || ! kill -0 "$daemon" 2>/dev/null; then
        show "$tmp/kvpoold.log"
        fail "kvpoold did not start"
    fi
    sleep 0.1
done
env -u BUILD_DIR "$VPY" "$CHECKS" client "$sock" "$version" || { show "$tmp/kvpoold.log"; exit 1; }

# ---- the ABI check: what KVPOOL_LIB may point at -------------------------------------------
env -u BUILD_DIR KVPOOL_LIB="$tmp/no/libkvpool.so" "$VPY" "$CHECKS" missing "$tmp/no/libkvpool.so"
# fakes: no kvp_client_version (an older build); another version; another ABI; a struct size
cc=${CC:-cc}
cat >"$tmp/fake.c" <<'EOF'
#include <stddef.h>
#ifndef NO_VERSION
const char *kvp_client_version(void) { return FAKE_VERSION; }
unsigned kvp_client_abi_version(void) { return FAKE_ABI; }
#endif
size_t kvp_client_sizeof(const char *name) { (void)name; return 1; }
EOF
"$cc" -shared -fPIC -o "$tmp/libold.so" -DNO_VERSION "$tmp/fake.c"
"$cc" -shared -fPIC -o "$tmp/libver.so" -DFAKE_VERSION='"9.8.7"' -DFAKE_ABI="$abi" "$tmp/fake.c"
"$cc" -shared -fPIC -o "$tmp/libabi.so" -DFAKE_VERSION="\"$version\"" -DFAKE_ABI=7 "$tmp/fake.c"
"$cc" -shared -fPIC -o "$tmp/libsize.so" -DFAKE_VERSION="\"$version\"" -DFAKE_ABI="$abi" "$tmp/fake.c"
mm() { lib=$1; shift; env -u BUILD_DIR KVPOOL_LIB="$lib" "$VPY" "$CHECKS" mismatch "$version" "$lib" "$@"; }
mm "$tmp/libold.so" "version unknown" "no kvp_client_version()"
mm "$tmp/libver.so" "version 9.8.7" "needs (libkvpool $version, ABI $abi)" "the versions differ"
mm "$tmp/libabi.so" "version $version" "its ABI is 7"
mm "$tmp/libsize.so" "its kvp_client_opts_t is 1 bytes"
# and the bundled library again once KVPOOL_LIB is gone
env -u BUILD_DIR "$VPY" -c 'import kvpool, os; p = kvpool.library_path(); assert p == os.path.join(os.path.dirname(kvpool.__file__), "libkvpool.so"), p'
echo "test_wheel: PASS ($(basename "$whl"))"
