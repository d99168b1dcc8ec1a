#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# run.sh - the Python package's tests (tests/python) against the built tree.
#
#   tests/python/run.sh [PYTEST ARGS]           every test of tests/python; $BUILD_DIR (default:
#                                               build/) of this source tree
#   tests/python/run.sh --torch [PYTEST ARGS]   the tests that need PyTorch (the files that
#                                               importorskip torch: the transformers
#                                               integration, kvpool._torch and its custom
#                                               operators), in the PyTorch venv, on the CPU when
#                                               there is no GPU
#
# Python: /usr/bin/python3 when it has numpy, pytest, pyzmq and msgspec, with client/python on
# PYTHONPATH (Debian's Python is externally managed: no pip install into it). Otherwise a
# virtual environment in $BUILD_DIR/pyvenv (python3 -m venv: python3-venv) that sees Debian's
# packages (python3-numpy python3-pytest), with what is missing from PyPI: msgspec is not in
# Debian 12, and the KV-event consumer (test_events.py, issue #29) needs it and pyzmq.
# --torch: the virtual environment $KVP_TORCH_VENV (default $BUILD_DIR/torch-venv) with
# tests/python/requirements-torch.txt from PyPI, made once and reused while that file is
# unchanged (its copy in the venv says what was installed). It lives under the build tree, not
# in ~/.cache: test_kvpool.py runs its interpreter as another uid, which cannot enter /root.
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

has_deps() { "$1" -c 'import numpy, pytest, zmq, msgspec' >/dev/null 2>&1; }

TORCH=0
if [ "${1:-}" = "--torch" ]; then
    TORCH=1
    shift
fi
TESTS=tests/python

if [ "$TORCH" = 1 ]; then
    VENV=${KVP_TORCH_VENV:-$BUILD_DIR/torch-venv}
    REQ=$ROOT/tests/python/requirements-torch.txt
    if [ ! -x "$VENV/bin/python" ]; then
        # Debian's Python (python3-venv) when there is one: a venv's interpreter is a link to
        # its base, which test_kvpool.py's second uid must be able to run (not one under /root)
        BASE=python3
        [ -x /usr/bin/python3 ] && BASE=/usr/bin/python3
        echo "run.sh: creating $VENV ($BASE)"
        "$BASE" -m venv "$VENV"
    fi
    PY=$VENV/bin/python
    if ! cmp -s "$REQ" "$VENV/requirements-torch.txt"; then
        echo "run.sh: installing $(grep -v '^#' "$REQ" | tr '\n' ' ')into $VENV (PyPI)"
        "$PY" -m pip install -q --disable-pip-version-check -r "$REQ"
        cp "$REQ" "$VENV/requirements-torch.txt"
    fi
    export PYTHONPATH="$ROOT/client/python${PYTHONPATH:+:$PYTHONPATH}"
    TESTS=$(cd "$ROOT" && grep -l 'importorskip("torch")' tests/python/test_*.py)
    echo "run.sh: $VENV with client/python on PYTHONPATH:" $TESTS
elif [ -x /usr/bin/python3 ] && has_deps /usr/bin/python3; then
    PY=/usr/bin/python3
    export PYTHONPATH="$ROOT/client/python${PYTHONPATH:+:$PYTHONPATH}"
    echo "run.sh: /usr/bin/python3 with client/python on PYTHONPATH"
else
    VENV=$BUILD_DIR/pyvenv
    if [ ! -x "$VENV/bin/python" ]; then
        BASE=python3
        [ -x /usr/bin/python3 ] && BASE=/usr/bin/python3
        echo "run.sh: creating $VENV ($BASE, with its site packages)"
        "$BASE" -m venv --system-site-packages "$VENV"
    fi
    PY=$VENV/bin/python
    if ! has_deps "$PY"; then
        "$PY" -m pip install -q --disable-pip-version-check numpy pytest pyzmq msgspec
    fi
    # the source tree's package on the build's library ($KVPOOL_LIB): `pip install` builds a
    # wheel with its own libkvpool (CMake), which tests/python/test_wheel.sh tests
    export PYTHONPATH="$ROOT/client/python${PYTHONPATH:+:$PYTHONPATH}"
    echo "run.sh: $VENV with client/python on PYTHONPATH"
fi

set +e
# $TESTS unquoted: a list of files (--torch)
(cd "$ROOT" && "$PY" -m pytest -q -p no:cacheprovider $TESTS "$@")
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "run.sh: pytest collected no tests" >&2
fi
exit "$rc"
