#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_install.sh BUILD_DIR [VERSION] - the installed C library, used the way a project outside
# the tree uses it (issue #19). Installs BUILD_DIR (built) into a temporary prefix with
# `cmake --install`, checks the files (headers that compile alone, libkvpool.so's soname links,
# the self-contained libkvpool.a, kvpool.pc, the CMake package), then builds
# tests/install/kvp_install_demo.c four ways - pkg-config and find_package(kvpool), each shared
# and static - and runs each against a kvpoold started from the prefix (host backend, socket
# in the temporary folder): the transcript must match exactly. VERSION (default: the build's
# CMAKE_PROJECT_VERSION) is what every version line must say.
# Environment: KVP_INSTALL_TEST_CC (the C compiler, default cc; KVP_INSTALL_TEST_CXX, default
# c++, for a C++ check left out when there is none), KVP_INSTALL_TEST_CFLAGS
# (added to every compile and link: the sanitizer flags of a -DKVP_SANITIZE=ON tree),
# KVP_INSTALL_TEST_KEEP=1 keeps the temporary folder. Exit 0 passed, 1 failed, 77 skipped
# (only when cmake, pkg-config, the C compiler, readelf or nm is missing).
set -eu

if [ $# -lt 1 ] || [ ! -f "$1/CMakeCache.txt" ]; then
    echo "usage: $0 BUILD_DIR [VERSION] (a configured and built kvpool tree)" >&2
    exit 2
fi
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
ver=${2:-$(sed -n 's/^CMAKE_PROJECT_VERSION:STATIC=//p' "$build/CMakeCache.txt")}
CC=${KVP_INSTALL_TEST_CC:-cc}
XFLAGS=${KVP_INSTALL_TEST_CFLAGS:-}

for tool in cmake pkg-config "$CC" readelf nm; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "SKIP: $tool not found" >&2
        exit 77
    fi
done

tmp=$(mktemp -d /tmp/kvp-install.XXXXXX)
daemon_pid=
cleanup() {
    if [ -n "$daemon_pid" ]; then
        kill "$daemon_pid" 2>/dev/null || true
        wait "$daemon_pid" 2>/dev/null || true
    fi
    if [ "${KVP_INSTALL_TEST_KEEP:-0}" = 1 ]; then
        echo "kept $tmp" >&2
    else
        rm -rf "$tmp"
    fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

fail() {
    echo "FAIL: $*" >&2
    exit 1
}
step() { echo "== $*"; }

prefix=$tmp/prefix
step "cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 ||
    { cat "$tmp/install.log" >&2; fail "cmake --install"; }

# ---- the files ----------------------------------------------------------------------------
pc=$(find "$prefix" -name kvpool.pc -path '*/pkgconfig/*')
[ -n "$pc" ] || fail "no kvpool.pc under $prefix"
libdir=$(dirname "$(dirname "$pc")")
inc=$prefix/include
abi=$(sed -n 's/^#define KVP_ABI_VERSION \([0-9][0-9]*\)$/\1/p' "$inc/kvpool_version.h")
[ -n "$abi" ] || fail "no KVP_ABI_VERSION in $inc/kvpool_version.h"
step "files: libdir=${libdir#"$prefix"/} version=$ver abi=$abi"
for f in sbin/kvpoold bin/kvpoolctl; do
    [ -x "$prefix/$f" ] || fail "$prefix/$f missing"
done
[ "$(readlink "$libdir/libkvpool.so")" = "libkvpool.so.$abi" ] ||
    fail "libkvpool.so -> $(readlink "$libdir/libkvpool.so"), want libkvpool.so.$abi"
[ "$(readlink "$libdir/libkvpool.so.$abi")" = "libkvpool.so.$ver" ] ||
    fail "libkvpool.so.$abi -> $(readlink "$libdir/libkvpool.so.$abi"), want libkvpool.so.$ver"
if [ ! -f "$libdir/libkvpool.so.$ver" ] || [ -L "$libdir/libkvpool.so.$ver" ]; then
    fail "libkvpool.so.$ver is not a file"
fi
soname=$(readelf -d "$libdir/libkvpool.so.$ver" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = "libkvpool.so.$abi" ] || fail "SONAME '$soname', want libkvpool.so.$abi"
[ -f "$libdir/libkvpool.a" ] || fail "no libkvpool.a"
for f in kvpoolConfig.cmake kvpoolConfigVersion.cmake kvpoolTargets.cmake; do
    [ -f "$libdir/cmake/kvpool/$f" ] || fail "no $libdir/cmake/kvpool/$f"
done
# kvpool.h and everything it includes is installed, and each header compiles on its own
headers="kvpool.h kvpool_version.h kvp_error.h kvp_kernels.h kvp_layout.h kvp_limits.h kvp_pool_info.h"
for h in $headers; do
    [ -f "$inc/$h" ] || fail "$inc/$h missing"
    printf '#include <%s>\n#include <%s>\nint kvp_include_%s;\n' "$h" "$h" "$(echo "$h" | tr . _)" \
        >"$tmp/h.c"
    # shellcheck disable=SC2086 # XFLAGS is a list of words
    "$CC" -std=c11 -Wall -Wextra -Wpedantic -Werror $XFLAGS -I"$inc" -c "$tmp/h.c" \
        -o "$tmp/h.o" || fail "<$h> does not compile alone from $inc"
done
grep -q "^#define KVP_VERSION_STRING \"$ver\"$" "$inc/kvpool_version.h" ||
    fail "kvpool_version.h does not say $ver"
# the archive is complete: nanopb's runtime and the internal objects are inside it
for sym in kvp_client_connect kvp_client_version kvp_strerror kvp_wire_decode pb_decode \
    pb_encode kvpool_Request_msg; do
    nm -g --defined-only "$libdir/libkvpool.a" 2>/dev/null | grep -q " $sym\$" ||
        fail "libkvpool.a does not define $sym"
done

# ---- the installed binaries say the version -----------------------------------------------
out=$("$prefix/sbin/kvpoold" --version)
[ "$out" = "kvpoold $ver" ] || fail "kvpoold --version: '$out', want 'kvpoold $ver'"
out=$("$prefix/bin/kvpoolctl" --version)
case "$out" in
"kvpoolctl $ver (protocol "*")") ;;
*) fail "kvpoolctl --version: '$out', want 'kvpoolctl $ver (protocol N)'" ;;
esac

# ---- build the demo four ways (from a copy: outside the source tree) -----------------------
src=$tmp/src
mkdir -p "$src"
cp "$here/kvp_install_demo.c" "$here/CMakeLists.txt" "$src/"
export PKG_CONFIG_PATH="$libdir/pkgconfig"
got=$(pkg-config --modversion kvpool)
[ "$got" = "$ver" ] || fail "pkg-config --modversion kvpool: '$got', want $ver"
cflags=$(pkg-config --cflags kvpool)
libs=$(pkg-config --libs kvpool)
# static: the archive by name (-l:libkvpool.a, else -lkvpool picks the .so) and Libs.private
slibs=$(pkg-config --static --libs kvpool | sed 's/-lkvpool\b/-l:libkvpool.a/')
step "pkg-config: cflags='$cflags' libs='$libs' static='$slibs'"
cw="-std=c11 -Wall -Wextra -Wpedantic -Werror"
# shellcheck disable=SC2086 # flag lists are lists of words
"$CC" $cw $XFLAGS $cflags "$src/kvp_install_demo.c" -o "$tmp/demo-pc-shared" $libs ||
    fail "pkg-config shared build"
# shellcheck disable=SC2086
"$CC" $cw $XFLAGS $cflags "$src/kvp_install_demo.c" -o "$tmp/demo-pc-static" $slibs ||
    fail "pkg-config static build"
# C++ programs include the same header (extern "C", no C-only construct; -Wpedantic would
# flag the anonymous struct of KVP_SRC_LAYOUT_MEMBER, a GNU extension in C++)
CXX=${KVP_INSTALL_TEST_CXX:-c++}
if command -v "$CXX" >/dev/null 2>&1; then
    printf '%s\n' '#include <kvpool.h>' '#include <cstring>' \
        'int main() { return std::strcmp(kvp_client_version(), KVP_VERSION_STRING) != 0; }' \
        >"$tmp/cxx.cc"
    # shellcheck disable=SC2086
    "$CXX" -std=c++17 -Wall -Wextra -Werror $XFLAGS $cflags "$tmp/cxx.cc" -o "$tmp/demo-cxx" \
        $libs || fail "a C++ program with <kvpool.h>"
    LD_LIBRARY_PATH="$libdir" "$tmp/demo-cxx" || fail "the C++ program's version check"
    step "C++ ($CXX): ok"
else
    echo "note: no C++ compiler ($CXX), the C++ check is left out"
fi
for kind in shared static; do
    [ $kind = static ] && on=ON || on=OFF
    cmake -S "$src" -B "$tmp/cmake-$kind" -DCMAKE_PREFIX_PATH="$prefix" \
        -DCMAKE_C_COMPILER="$CC" -DCMAKE_C_FLAGS="$XFLAGS" -DKVP_DEMO_STATIC="$on" \
        -DKVP_EXPECT_VERSION="$ver" >"$tmp/cmake-$kind.log" 2>&1 ||
        { cat "$tmp/cmake-$kind.log" >&2; fail "find_package(kvpool) $kind: configure"; }
    cmake --build "$tmp/cmake-$kind" >>"$tmp/cmake-$kind.log" 2>&1 ||
        { cat "$tmp/cmake-$kind.log" >&2; fail "find_package(kvpool) $kind: build"; }
    cp "$tmp/cmake-$kind/kvp_install_demo" "$tmp/demo-cmake-$kind"
done
# shared builds need libkvpool.so.N (the installed one), static builds must not
for d in demo-pc-shared demo-cmake-shared demo-pc-static demo-cmake-static; do
    needed=$(readelf -d "$tmp/$d" | sed -n 's/.*(NEEDED).*\[\(libkvpool[^]]*\)\]/\1/p')
    case $d in
    *-shared) [ "$needed" = "libkvpool.so.$abi" ] || fail "$d NEEDs '$needed'" ;;
    *) [ -z "$needed" ] || fail "$d (static) NEEDs $needed" ;;
    esac
done

# ---- run them against a daemon from the prefix --------------------------------------------
sock=$tmp/kvpool.sock
"$prefix/sbin/kvpoold" --backend host --socket "$sock" --num-layers 2 --num-pages 64 \
    --page-size 4 --num-kv-heads 2 --head-dim 16 --log-level info >"$tmp/kvpoold.log" 2>&1 &
daemon_pid=$!
i=0
until grep -q " ready version=$ver " "$tmp/kvpoold.log" 2>/dev/null; do
    i=$((i + 1))
    if [ $i -gt 200 ] || ! kill -0 "$daemon_pid" 2>/dev/null; then
        cat "$tmp/kvpoold.log" >&2
        fail "kvpoold from $prefix did not get ready"
    fi
    sleep 0.05
done
step "kvpoold $ver ready on $sock (pid $daemon_pid)"

cat >"$tmp/want" <<EOF
libkvpool $ver abi $abi
hello server $ver pages 64 page_size 4 layers 2
ping ok
reserve batch 1 pages 2 last_page_len 1 seq_len 5 append 5
stats seqs 1 used_pages 2
release released 1 seqs 0 used_pages 0
EOF
for d in demo-pc-shared demo-pc-static demo-cmake-shared demo-cmake-static; do
    case $d in
    demo-pc-shared)
        # no rpath from pkg-config: the loader finds the installed library by the path
        LD_LIBRARY_PATH="$libdir" ldd "$tmp/$d" | grep -q "=> $libdir/libkvpool.so.$abi " ||
            fail "$d does not load $libdir/libkvpool.so.$abi"
        LD_LIBRARY_PATH="$libdir" "$tmp/$d" "$sock" >"$tmp/$d.out" || fail "$d exited $?"
        ;;
    demo-cmake-shared)
        # CMake's build rpath names the prefix's library folder
        env -u LD_LIBRARY_PATH ldd "$tmp/$d" | grep -q "=> $libdir/libkvpool.so.$abi " ||
            fail "$d does not load $libdir/libkvpool.so.$abi"
        env -u LD_LIBRARY_PATH "$tmp/$d" "$sock" >"$tmp/$d.out" || fail "$d exited $?"
        ;;
    *) env -u LD_LIBRARY_PATH "$tmp/$d" "$sock" >"$tmp/$d.out" || fail "$d exited $?" ;;
    esac
    diff -u "$tmp/want" "$tmp/$d.out" || fail "$d: transcript differs"
    step "$d: ok"
done

kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=
[ $rc -eq 0 ] || { cat "$tmp/kvpoold.log" >&2; fail "kvpoold exited $rc"; }
grep -q "final seqs=0 tokens=0 used_pages=0 exit_code=0" "$tmp/kvpoold.log" ||
    { cat "$tmp/kvpoold.log" >&2; fail "kvpoold's final line"; }
echo "test_install: ok (pkg-config and find_package, shared and static, version $ver)"
