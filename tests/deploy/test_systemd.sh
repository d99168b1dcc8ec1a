#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# test_systemd.sh - the systemd integration files as installed, checked with systemd's own
# tools, without a running systemd (CI has none as PID 1):
#   - `cmake --install` into a temporary DESTDIR puts every file where Debian expects it and
#     the units' ExecStart= names the daemon it installed;
#   - `systemd-analyze verify` accepts the installed units (ExecStart= pointed into the
#     DESTDIR, since nothing is installed under / here) and prints nothing at all (an unknown
#     key is only a warning there, so any output fails the test);
#   - `systemd-analyze security --offline=true` rates the service exactly as its header says;
#   - systemd-sysusers and systemd-tmpfiles (in --root mode) create the kvpool user and group
#     and /run/kvpool with mode 0750 owned by them;
#   - the example kvpoold.conf (generated in BUILD_DIR/deploy from deploy/kvpoold.conf.in)
#     passes --check-config and documents every key the daemon has.
#
# usage: test_systemd.sh SOURCE_DIR BUILD_DIR
set -eu

src=$1
build=$2
tmp=$(mktemp -d /tmp/kvpool-sd-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() {
    echo "FAIL: $*" >&2
    exit 1
}

for tool in systemd-analyze systemd-sysusers systemd-tmpfiles; do
    command -v "$tool" >/dev/null || fail "$tool is missing (Debian package systemd; deploy/install-deps.sh installs it)"
done

# ---- install ----
DESTDIR="$tmp/root" cmake --install "$build" >"$tmp/install.log" 2>&1 ||
    { cat "$tmp/install.log"; fail "cmake --install"; }
prefix=$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$build/CMakeCache.txt")
root="$tmp/root"
unitdir="$root$prefix/lib/systemd/system"
for f in "$unitdir/kvpoold.service" "$unitdir/kvpoold.socket" \
    "$root$prefix/lib/sysusers.d/kvpool.conf" "$root$prefix/lib/tmpfiles.d/kvpool.conf" \
    "$root$prefix/sbin/kvpoold" "$root$prefix/bin/kvpoolctl" \
    "$root$prefix/share/doc/kvpool/README.md" "$root$prefix/share/doc/kvpool/container/Dockerfile"; do
    [ -e "$f" ] || fail "not installed: ${f#"$root"}"
done
case $prefix in
/usr) conf="$root/etc/kvpool/kvpoold.conf" ;;
*) conf="$root$prefix/etc/kvpool/kvpoold.conf" ;;
esac
[ -f "$conf" ] || fail "not installed: ${conf#"$root"}"
ls "$root$prefix"/lib/*/libkvpool.so.1 "$root$prefix"/lib/libkvpool.so.1 2>/dev/null | grep -q . ||
    fail "libkvpool.so.1 not installed under $prefix/lib"

exec_start=$(sed -n 's/^ExecStart=\([^ ]*\).*/\1/p' "$unitdir/kvpoold.service")
[ "$exec_start" = "$prefix/sbin/kvpoold" ] || fail "ExecStart=$exec_start, installed $prefix/sbin/kvpoold"
grep -q -- "--config ${conf#"$root"}\$" "$unitdir/kvpoold.service" ||
    fail "ExecStart= does not read the installed config ${conf#"$root"}"
echo "ok: install tree (prefix $prefix)"

# ---- systemd-analyze verify ----
mkdir "$tmp/verify"
sed "s|^ExecStart=$exec_start|ExecStart=$root$exec_start|" "$unitdir/kvpoold.service" \
    >"$tmp/verify/kvpoold.service"
cp "$unitdir/kvpoold.socket" "$tmp/verify/"
if ! systemd-analyze verify --man=no "$tmp/verify/kvpoold.service" "$tmp/verify/kvpoold.socket" \
    >"$tmp/verify.log" 2>&1; then
    cat "$tmp/verify.log"
    fail "systemd-analyze verify"
fi
if [ -s "$tmp/verify.log" ]; then
    cat "$tmp/verify.log"
    fail "systemd-analyze verify printed warnings"
fi
echo "ok: systemd-analyze verify"

# ---- exposure score, as recorded in the unit ----
systemd-analyze security --offline=true --no-pager "$tmp/verify/kvpoold.service" \
    >"$tmp/security.log" 2>&1 || true
measured=$(sed -n 's/.*Overall exposure level for kvpoold.service: \([0-9.]*\).*/\1/p' "$tmp/security.log")
[ -n "$measured" ] || { cat "$tmp/security.log"; fail "no exposure level"; }
recorded=$(sed -n 's/^# rates this unit \([0-9.]*\) .*/\1/p' "$src/deploy/systemd/kvpoold.service.in")
[ "$measured" = "$recorded" ] ||
    fail "systemd-analyze security says $measured, kvpoold.service.in records $recorded: update the comment"
echo "ok: exposure $measured"

# ---- sysusers + tmpfiles in a scratch root ----
mkdir -p "$tmp/sys/etc"
systemd-sysusers --root="$tmp/sys" "$root$prefix/lib/sysusers.d/kvpool.conf" >/dev/null 2>&1 ||
    fail "systemd-sysusers"
grep -q '^kvpool:x:[0-9]*:[0-9]*:.*:/usr/sbin/nologin$' "$tmp/sys/etc/passwd" ||
    fail "no kvpool user: $(cat "$tmp/sys/etc/passwd")"
grep -q '^kvpool:x:' "$tmp/sys/etc/group" || fail "no kvpool group"
systemd-tmpfiles --root="$tmp/sys" --create "$root$prefix/lib/tmpfiles.d/kvpool.conf" ||
    fail "systemd-tmpfiles"
uid=$(sed -n 's/^kvpool:x:\([0-9]*\):.*/\1/p' "$tmp/sys/etc/passwd")
gid=$(sed -n 's/^kvpool:x:\([0-9]*\):.*/\1/p' "$tmp/sys/etc/group")
[ "$(stat -c '%a %u %g' "$tmp/sys/run/kvpool")" = "750 $uid $gid" ] ||
    fail "/run/kvpool is $(stat -c '%a %u %g' "$tmp/sys/run/kvpool"), want 750 $uid $gid"
echo "ok: sysusers, tmpfiles"

# ---- the example configuration ----
"$build/server/kvpoold" --config "$build/deploy/kvpoold.conf" --check-config >"$tmp/dump" 2>"$tmp/err" ||
    { cat "$tmp/err"; fail "the example config does not pass --check-config"; }
grep -q '^socket_group = kvpool$' "$tmp/dump" || fail "socket_group is not kvpool"
keys=$(sed -n 's/^\([a-z_]*\) = .*/\1/p' "$tmp/dump")
[ "$(echo "$keys" | wc -l)" -gt 30 ] || fail "too few keys in --check-config output"
for k in $keys; do
    grep -Eq "^#?$k =" "$build/deploy/kvpoold.conf" || fail "deploy/kvpoold.conf does not document $k"
done
echo "ok: example config ($(echo "$keys" | wc -l) keys documented)"
