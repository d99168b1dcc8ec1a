#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# run.sh - the Python package's tests (tests/python) against the built tree.
#
#   tests/python/run.sh            uses $BUILD_DIR (default: build/) of this source tree
#
# Python: /usr/bin/python3 when it has numpy and pytest (Debian: python3-numpy python3-pytest),
# with client/python on PYTHONPATH (Debian's Python is externally managed: no pip install into
# it). Otherwise a virtual environment in $BUILD_DIR/pyvenv (python3 -m venv: python3-venv),
# with numpy and pytest from PyPI, client/python on PYTHONPATH too.
# Exits with pytest's status; "no tests collected" (5) is a failure too.
set -eu

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
case $BUILD_DIR in /*) ;; *) BUILD_DIR=$ROOT/$BUILD_DIR ;; esac
export BUILD_DIR
export KVPOOL_LIB="${KVPOOL_LIB:-$BUILD_DIR/client/libkvpool.so}"
export KVPOOLD="${KVPOOLD:-$BUILD_DIR/server/kvpoold}"
for f in "$KVPOOL_LIB" "$KVPOOLD"; do
    if [ ! -e "$f" ]; then
        echo "run.sh: $f is missing: build first (cmake -S . -B build && cmake --build build)" >&2
        exit 1
    fi
done
export PYTHONDONTWRITEBYTECODE=1

has_deps() { "$1" -c 'import numpy, pytest' >/dev/null 2>&1; }

if [ -x /usr/bin/python3 ] && has_deps /usr/bin/python3; then
    PY=/usr/bin/python3
    export PYTHONPATH="$ROOT/client/python${PYTHONPATH:+:$PYTHONPATH}"
    echo "run.sh: /usr/bin/python3 with client/python on PYTHONPATH"
else
    VENV=$BUILD_DIR/pyvenv
    if [ ! -x "$VENV/bin/python" ]; then
        echo "run.sh: creating $VENV"
        python3 -m venv "$VENV"
    fi
    PY=$VENV/bin/python
    if ! has_deps "$PY"; then
        "$PY" -m pip install -q --disable-pip-version-check numpy pytest
    fi
    # the source tree's package on the build's library ($KVPOOL_LIB): `pip install` builds a
    # wheel with its own libkvpool (CMake), which tests/python/test_wheel.sh tests
    export PYTHONPATH="$ROOT/client/python${PYTHONPATH:+:$PYTHONPATH}"
    echo "run.sh: $VENV with client/python on PYTHONPATH"
fi

set +e
(cd "$ROOT" && "$PY" -m pytest -q -p no:cacheprovider tests/python "$@")
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "run.sh: pytest collected no tests" >&2
fi
exit "$rc"
