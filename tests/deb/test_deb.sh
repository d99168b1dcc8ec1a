#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_deb.sh - builds kvpool's Debian package (cmake/kvp_cpack.cmake) and installs it on THIS
# machine with dpkg: checks the files are where Debian expects them, the control fields, the
# conffile, the user and runtime directory postinst makes, that nothing was enabled or
# started, `kvpoold --check-config` on the installed config and a short daemon start from the
# installed paths; then edits /etc/kvpool/kvpoold.conf, removes the package (the edit must
# stay), purges it (the config and every file of the package must go). It installs
# system-wide, so it is not a ctest test: deploy/test.sh runs it on the CI machine.
#
#   tests/deb/test_deb.sh [BUILD_DIR]     default BUILD_DIR: build-deb/ of the source tree
#
# BUILD_DIR is configured here (Release, CUDA off, prefix /usr), built, and packed with
# `cpack -G DEB`. Needs root and dpkg: exits 77 (skipped) without them. Refuses to run when a
# kvpool package is already installed (it would replace and then purge it). Whatever happens,
# the package is purged on exit, the daemon it started is stopped, and the kvpool user is
# deleted when this run created it.
set -eu

root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-deb}
jobs=$(nproc 2>/dev/null || echo 2)

if [ "$(id -u)" -ne 0 ]; then
    echo "test_deb: skipped: needs root (dpkg -i)"
    exit 77
fi
for tool in dpkg dpkg-deb dpkg-query cpack; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "test_deb: skipped: $tool not found"
        exit 77
    fi
done

pkg_status() { dpkg-query -W -f='${db:Status-Status}' kvpool 2>/dev/null || true; }
if [ -n "$(pkg_status)" ] && [ "$(pkg_status)" != not-installed ]; then
    echo "test_deb: a kvpool package is already on this machine ($(pkg_status)):" \
        "remove it first" >&2
    exit 1
fi

tmp=$(mktemp -d /tmp/kvp-deb.XXXXXX)
daemon_pid=""
user_existed=0
if getent passwd kvpool >/dev/null 2>&1; then user_existed=1; fi
group_existed=0
if getent group kvpool >/dev/null 2>&1; then group_existed=1; fi

cleanup() {
    rc=$?
    if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
        kill -KILL "$daemon_pid" 2>/dev/null || true
    fi
    if [ -n "$(pkg_status)" ] && [ "$(pkg_status)" != not-installed ]; then
        echo "test_deb: cleanup: purging kvpool"
        dpkg -P kvpool >/dev/null 2>&1 || true
    fi
    if [ $user_existed -eq 0 ] && getent passwd kvpool >/dev/null 2>&1; then
        userdel kvpool 2>/dev/null || true
    fi
    if [ $group_existed -eq 0 ] && getent group kvpool >/dev/null 2>&1; then
        groupdel kvpool 2>/dev/null || true
    fi
    rm -rf "$tmp"
    if [ $rc -ne 0 ]; then echo "test_deb: FAILED"; fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

fail() {
    echo "test_deb: FAIL: $*" >&2
    exit 1
}

echo "== test_deb: configure, build and pack $build (Release, CUDA off, prefix /usr) =="
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVP_WITH_CUDA=OFF \
    -DCMAKE_INSTALL_PREFIX=/usr >"$tmp/configure.log" 2>&1 || {
    cat "$tmp/configure.log"
    fail "cmake configure"
}
cmake --build "$build" -j "$jobs" >"$tmp/build.log" 2>&1 || {
    tail -50 "$tmp/build.log"
    fail "build"
}
rm -f "$build"/kvpool_*.deb
(cd "$build" && cpack -G DEB) >"$tmp/cpack.log" 2>&1 || {
    cat "$tmp/cpack.log"
    fail "cpack -G DEB"
}
version=$("$build/server/kvpoold" --version | awk '{print $2}')
arch=$(dpkg --print-architecture)
deb="$build/kvpool_${version}-1_${arch}.deb"
[ -f "$deb" ] || fail "no $deb (cpack made: $(ls "$build"/*.deb 2>/dev/null))"
echo "package: $deb ($(stat -c %s "$deb") bytes)"

echo "== control fields =="
field() { dpkg-deb -f "$deb" "$1"; }
[ "$(field Package)" = kvpool ] || fail "Package: $(field Package)"
[ "$(field Version)" = "${version}-1" ] ||
    fail "Version $(field Version), kvpoold --version $version"
[ "$(field Architecture)" = "$arch" ] || fail "Architecture: $(field Architecture)"
for f in Section Priority Maintainer Description Homepage; do
    [ -n "$(field $f)" ] || fail "no $f field"
done
# dpkg-shlibdeps computed it: the daemon's libraries are there
depends=$(field Depends)
for lib in libc6 libuv1 libinih1; do
    echo "$depends" | grep -q "\\b$lib\\b" || fail "Depends ($depends) lacks $lib"
done
dpkg-deb --ctrl-tarfile "$deb" | tar -t >"$tmp/ctrl"
for f in conffiles postinst prerm postrm triggers shlibs md5sums; do
    grep -qx "\\./$f" "$tmp/ctrl" || fail "control archive lacks $f"
done
[ "$(dpkg-deb -I "$deb" conffiles)" = /etc/kvpool/kvpoold.conf ] ||
    fail "conffiles: $(dpkg-deb -I "$deb" conffiles)"

echo "== dpkg -i =="
dpkg -i "$deb" || fail "dpkg -i"
[ "$(pkg_status)" = installed ] || fail "status after dpkg -i: $(pkg_status)"

echo "== files =="
# A minimal image's dpkg may leave out man pages and docs (path-exclude in
# /etc/dpkg/dpkg.cfg.d, path-include for exceptions): such paths may be absent.
excluded() {
    ex=1
    rules=$(sed -n 's/^[[:space:]]*\(path-exclude\|path-include\)[[:space:]=]*\(.*\)/\1:\2/p' \
        /etc/dpkg/dpkg.cfg.d/* 2>/dev/null || true)
    while read -r rule; do
        [ -n "$rule" ] || continue
        # shellcheck disable=SC2254
        case "$1" in ${rule#*:}) [ "${rule%%:*}" = path-exclude ] && ex=0 || ex=1 ;; esac
    done <<EOF
$rules
EOF
    return $ex
}
dpkg -L kvpool >"$tmp/files"
ma=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
libdir=/usr/lib/$ma
# the exact paths a Debian system expects (each listed by dpkg -L and present)
for p in /usr/sbin/kvpoold /usr/bin/kvpoolctl \
    "$libdir/libkvpool.so.$version" "$libdir/libkvpool.so" "$libdir/libkvpool.a" \
    "$libdir/pkgconfig/kvpool.pc" "$libdir/cmake/kvpool/kvpoolConfig.cmake" \
    /usr/include/kvpool.h /usr/include/kvp_error.h \
    /usr/lib/systemd/system/kvpoold.service /usr/lib/systemd/system/kvpoold.socket \
    /usr/lib/sysusers.d/kvpool.conf /usr/lib/tmpfiles.d/kvpool.conf \
    /etc/kvpool/kvpoold.conf \
    /usr/share/man/man8/kvpoold.8.gz /usr/share/man/man1/kvpoolctl.1.gz \
    /usr/share/man/man5/kvpoold.conf.5.gz \
    /usr/share/doc/kvpool/copyright /usr/share/doc/kvpool/changelog.Debian.gz \
    /usr/share/doc/kvpool/README.md \
    /usr/share/doc/kvpool/kvpoold.conf \
    $([ -f "$root/deploy/completion/kvpoolctl.bash" ] &&
        echo /usr/share/bash-completion/completions/kvpoolctl); do
    excluded "$p" && continue
    grep -qxF "$p" "$tmp/files" || fail "dpkg -L kvpool does not list $p"
    [ -e "$p" ] || fail "$p listed but missing"
done
soname=$(readlink "$libdir/libkvpool.so")
case "$soname" in libkvpool.so.[0-9]*) ;; *) fail "libkvpool.so -> '$soname', not a soname" ;; esac
[ -f "$libdir/$soname" ] || [ -L "$libdir/$soname" ] || fail "$libdir/$soname missing"
grep -qxF "$libdir/$soname" "$tmp/files" || fail "dpkg -L does not list $libdir/$soname"
# nothing outside /usr and /etc/kvpool; not the Python wheel's copy of the library
while read -r p; do
    [ -d "$p" ] && [ ! -L "$p" ] && continue
    case "$p" in
        /usr/bin/* | /usr/sbin/* | /usr/include/* | /usr/lib/* | /usr/share/* | /etc/kvpool/*) ;;
        *) fail "unexpected path in the package: $p" ;;
    esac
    case "$p" in */kvpool/libkvpool.so) fail "the wheel's library in the package: $p" ;; esac
done <"$tmp/files"
cmp -s "$build/deploy/kvpoold.conf" /etc/kvpool/kvpoold.conf ||
    fail "/etc/kvpool/kvpoold.conf differs from the example deploy/kvpoold.conf (as built)"
grep -qx "ExecStart=/usr/sbin/kvpoold --config /etc/kvpool/kvpoold.conf" \
    /usr/lib/systemd/system/kvpoold.service || fail "the unit's ExecStart= names other paths"
[ "$(dpkg-query -W -f='${Conffiles}' kvpool | awk 'NF {print $1}')" = /etc/kvpool/kvpoold.conf ] ||
    fail "dpkg does not hold /etc/kvpool/kvpoold.conf as the conffile"
if command -v man >/dev/null 2>&1 && ! excluded /usr/share/man/man8/kvpoold.8.gz; then
    for page in 8:kvpoold 1:kvpoolctl 5:kvpoold.conf; do
        s=${page%%:*} n=${page#*:}
        [ "$(man -w "$s" "$n")" = "/usr/share/man/man$s/$n.$s.gz" ] ||
            fail "man -w $s $n: $(man -w "$s" "$n")"
        MANWIDTH=80 man "$s" "$n" 2>&1 >/dev/null | grep . && fail "man $s $n warns"
        MANWIDTH=80 man "$s" "$n" 2>/dev/null | grep -q "^NAME" || fail "man $s $n renders no NAME"
    done
fi

echo "== postinst: user, runtime directory, nothing enabled or started =="
getent passwd kvpool >/dev/null || fail "postinst made no kvpool user"
getent group kvpool >/dev/null || fail "postinst made no kvpool group"
[ -d /run/kvpool ] || fail "postinst made no /run/kvpool"
[ "$(stat -c '%U:%G %a' /run/kvpool)" = "kvpool:kvpool 750" ] ||
    fail "/run/kvpool is $(stat -c '%U:%G %a' /run/kvpool)"
if ls /etc/systemd/system/*.wants/kvpoold.* >/dev/null 2>&1; then
    fail "the package enabled a unit: $(ls /etc/systemd/system/*.wants/kvpoold.*)"
fi
if pgrep -x kvpoold >/dev/null 2>&1; then
    # only a failure when it runs from the package's binary
    for pid in $(pgrep -x kvpoold); do
        [ "$(readlink "/proc/$pid/exe")" = /usr/sbin/kvpoold ] &&
            fail "a kvpoold from the package runs (pid $pid)"
    done
fi
[ "$(/usr/bin/kvpoolctl --version | awk '{print $2}')" = "$version" ] ||
    fail "kvpoolctl --version: $(/usr/bin/kvpoolctl --version)"

echo "== kvpoold --check-config with the installed config =="
/usr/sbin/kvpoold --config /etc/kvpool/kvpoold.conf --check-config >"$tmp/effective" ||
    fail "kvpoold --check-config rejects the installed config"
grep -qx "socket_group = kvpool" "$tmp/effective" ||
    fail "effective config: $(cat "$tmp/effective")"

echo "== a short daemon start from the installed paths =="
/usr/sbin/kvpoold --config /etc/kvpool/kvpoold.conf --backend host --pool-bytes 16MiB \
    --socket "$tmp/s" >"$tmp/daemon.log" 2>&1 &
daemon_pid=$!
i=0
until [ -S "$tmp/s" ]; do
    i=$((i + 1))
    if [ $i -gt 100 ] || ! kill -0 "$daemon_pid" 2>/dev/null; then
        cat "$tmp/daemon.log"
        fail "the daemon did not create $tmp/s"
    fi
    sleep 0.1
done
# the installed config's socket_group and socket_mode applied
[ "$(stat -c '%G %a' "$tmp/s")" = "kvpool 660" ] || fail "socket is $(stat -c '%G %a' "$tmp/s")"
/usr/bin/kvpoolctl -s "$tmp/s" status >"$tmp/status" || {
    cat "$tmp/status" "$tmp/daemon.log"
    fail "kvpoolctl status"
}
grep -Eq '^backend +host, 1 device$' "$tmp/status" ||
    fail "status does not name the host backend: $(cat "$tmp/status")"
grep -Eq "^daemon +kvpoold $version," "$tmp/status" || fail "status: not kvpoold $version"
grep -Eq '^pool +16.0 MiB per device' "$tmp/status" || fail "status: not the 16 MiB pool"
/usr/bin/kvpoolctl -s "$tmp/s" health || fail "kvpoolctl health"
kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=""
[ $rc -eq 0 ] || {
    cat "$tmp/daemon.log"
    fail "kvpoold exited $rc on SIGTERM"
}

echo "== dpkg -r keeps the edited config =="
sed -i 's/^#log_level = info$/log_level = notice/' /etc/kvpool/kvpoold.conf
grep -qx "log_level = notice" /etc/kvpool/kvpoold.conf || fail "could not edit the config"
cp /etc/kvpool/kvpoold.conf "$tmp/edited.conf"
dpkg -r kvpool || fail "dpkg -r"
[ "$(pkg_status)" = config-files ] || fail "status after dpkg -r: $(pkg_status)"
cmp -s "$tmp/edited.conf" /etc/kvpool/kvpoold.conf || fail "dpkg -r did not keep the edited config"
grep -v '^/etc/kvpool' "$tmp/files" | while read -r p; do
    if [ -e "$p" ] && [ ! -d "$p" ]; then fail "dpkg -r left $p"; fi
done

echo "== dpkg -P removes it all =="
dpkg -P kvpool || fail "dpkg -P"
st=$(pkg_status)
[ -z "$st" ] || [ "$st" = not-installed ] || fail "status after dpkg -P: $st"
[ ! -e /etc/kvpool ] || fail "dpkg -P left /etc/kvpool: $(ls -la /etc/kvpool)"
[ ! -e /run/kvpool ] || fail "dpkg -P left /run/kvpool"
while read -r p; do
    if [ -e "$p" ] && [ ! -d "$p" ]; then fail "dpkg -P left $p"; fi
    case "$p" in
        */kvpool | */kvpool/*) [ ! -e "$p" ] || fail "dpkg -P left $p" ;;
    esac
done <"$tmp/files"
echo "== test_deb: ok =="
