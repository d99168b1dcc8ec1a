#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# pack.sh - packs only the binaries a run on the GPU machine needs from a build folder (one
# built with -DKVP_STATIC_DEPS=ON, so they run there without libuv, Check or inih) into a
# tar.xz with the build folder's relative layout, and prints its size. A whole folder is ~90 MB,
# over what a device call carries; these binaries pack to a few MB. Unpack it into a folder
# and point tests/gpu/run_device.sh (or run_mps.sh, run_multigpu.sh) at it with KVP_DEVBUILD.
#
#   tests/gpu/pack.sh BUILD_DIR OUT.tar.xz [PATH...]
#
# PATHs are relative to BUILD_DIR (a glob is expanded there: 'client/libkvpool.so*'); each must
# exist. Without PATHs: the daemon (and kvpoold-test, the build with the transfer test hooks),
# libkvpool.so and its links, the gpu and multigpu tests, the daemon's integration test, and the
# CUDA benchmarks; a default one the build lacks (no CUDA, no NCCL) is skipped and named.
set -eu

usage() {
    echo "usage: $0 BUILD_DIR OUT.tar.xz [PATH...]" >&2
    exit 2
}
[ $# -ge 2 ] || usage
B=$1
out=$2
shift 2
if [ ! -f "$B/CMakeCache.txt" ]; then
    echo "pack.sh: $B is not a CMake build folder" >&2
    exit 1
fi
if ! grep -q '^KVP_STATIC_DEPS:BOOL=ON$' "$B/CMakeCache.txt"; then
    echo "pack.sh: warning: $B was not configured with -DKVP_STATIC_DEPS=ON; its binaries" \
        "need libuv, Check and inih on the GPU machine" >&2
fi

explicit=1
if [ $# -eq 0 ]; then
    explicit=0
    set -- server/kvpoold server/kvpoold-test 'client/libkvpool.so*' \
        tests/test_append_cuda tests/test_cuda_backend tests/test_hot_path tests/test_prefix_gpu \
        tests/test_cuda_err tests/test_client_cuda tests/test_daemon \
        tests/test_multigpu_tp tests/test_multigpu_xfer \
        tests/bench/bench_append_cuda tests/bench/bench_cuda_e2e tests/bench/bench_transfer \
        tests/test_tier_cuda tests/test_tier_gpu tests/test_gather_cuda tests/bench/bench_tier
fi

# Expand each PATH inside B (globs included) into the list of files to pack.
list=$(mktemp)
trap 'rm -f "$list"' EXIT
missing=""
for p in "$@"; do
    found=0
    for f in $(cd "$B" && eval "ls -d -- $p" 2>/dev/null); do
        if [ -f "$B/$f" ] || [ -L "$B/$f" ]; then
            echo "$f" >> "$list"
            found=1
        fi
    done
    if [ $found -eq 0 ]; then
        if [ $explicit -eq 1 ]; then
            echo "pack.sh: $B/$p does not exist" >&2
            exit 1
        fi
        missing="$missing $p"
    fi
done
if [ ! -s "$list" ]; then
    echo "pack.sh: nothing to pack in $B" >&2
    exit 1
fi
[ -z "$missing" ] || echo "pack.sh: not in this build, skipped:$missing"

# libzmq (KV events, issue #29) is the one dependency linked shared even with KVP_STATIC_DEPS
# (its static closure is not packaged): it and the libraries it needs beyond glibc and
# libstdc++ go into devlib/, which run_device.sh puts on LD_LIBRARY_PATH.
zmq=$(ldd "$B/server/kvpoold" 2>/dev/null | awk '/libzmq/ {print $3}')
if [ -n "$zmq" ]; then
    rm -rf "$B/devlib"
    mkdir -p "$B/devlib"
    for l in $zmq $(ldd "$zmq" | awk '/=>/ {print $3}'); do
        case $(basename "$l") in
        libc.so* | libm.so* | libpthread.so* | libdl.so* | librt.so* | ld-linux* | libstdc++* | \
            libgcc_s* | libresolv.so*) ;;
        *) cp -L "$l" "$B/devlib/" && echo "devlib/$(basename "$l")" >> "$list" ;;
        esac
    done
fi

mkdir -p "$(dirname "$out")"
# libkvpool.so's version links are packed as links (tar keeps them), next to their target.
XZ_OPT=${XZ_OPT:--6 -T0} tar -C "$B" -cJf "$out.part" -T "$list"
mv "$out.part" "$out"
n=$(wc -l < "$list")
bytes=$(wc -c < "$out")
raw=$(cd "$B" && tr '\n' '\0' < "$list" | xargs -0 du -ck | tail -1 | cut -f1)
echo "packed $n files ($raw KiB) of $B into $out: $bytes bytes ($((bytes / 1024)) KiB)"
sed 's/^/  /' "$list"
