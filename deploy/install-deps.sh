#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# install-deps.sh - installs the Debian packages kvpool needs to build and test, and only the
# missing ones (idempotent: with everything present it runs no apt-get at all).
#
#   deploy/install-deps.sh            build + test dependencies
#   KVP_DEPS_EXTRA="pkg ..." ...      more packages (e.g. for a developer machine)
#
# systemd provides systemd-analyze, systemd-sysusers and systemd-tmpfiles for the deploy
# tests (nothing runs it as PID 1). The CUDA toolkit is not installed here: CMake finds it under /usr/local/cuda when present
# and builds everything else without it.
# scdoc renders the man pages (docs/man); file is what CPack's DEB generator needs for
# CPACK_DEBIAN_PACKAGE_SHLIBDEPS (dpkg-shlibdeps comes with build-essential's dpkg-dev).
set -eu

PKGS="build-essential cmake pkg-config libuv1-dev nanopb libnanopb-dev python3-protobuf libxxhash-dev
libzmq3-dev libmsgpack-dev
check libsubunit-dev libinih-dev clang valgrind procps redis-server
python3-numpy python3-pytest python3-venv systemd scdoc file ${KVP_DEPS_EXTRA:-}"

missing=""
for p in $PKGS; do
    if ! dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed; then
        missing="$missing $p"
    fi
done

if [ -z "$missing" ]; then
    echo "install-deps: all dependencies present"
    exit 0
fi

echo "install-deps: installing:$missing"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing
echo "install-deps: done"
