#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# valgrind.sh [quick] - the unit and integration suites under valgrind memcheck, the daemon
# process included: the harness prefixes every kvpoold it starts with the same valgrind
# command (KVP_TEST_DAEMON_WRAPPER, tests/integration/kvp_harness.h), and a daemon with an
# error or a definite/indirect leak exits 99, which the tests see as a failed stop. Check runs
# each suite in one process (CK_FORK=no) so valgrind sees every test. Then the stress and fault
# programs run against a daemon under valgrind (their clients natively), scaled down.
#
#   tests/valgrind.sh          everything (about 12 min on 2 cores)
#   tests/valgrind.sh quick    what deploy/test.sh runs (about 2 min): the unit suites but the
#                              two long randomized ones, test_daemon, test_security, the retry
#                              window and hostile-client tests, and a short stress_load against
#                              a daemon under valgrind
#
# Build tree: build-valgrind/ (Debug, CUDA off, no sanitizers). Logs: build-valgrind/vg/*.log.
# Not covered: test_lifecycle.py (starts its own daemons), the Python suite, and the "fds"
# fault scenario: valgrind keeps the top of the fd table for itself and closes accepted
# connections that land there before the daemon sees them, so the RLIMIT_NOFILE test measures
# valgrind rather than the daemon (it runs natively and under ASan).
set -eu
mode=${1:-full}
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build-valgrind
jobs=$(nproc 2>/dev/null || echo 2)
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Debug -DKVP_WITH_CUDA=OFF >/dev/null
cmake --build "$build" -j "$jobs" >/dev/null
mkdir -p "$build/vg"
vg="valgrind --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite,indirect"
vg="$vg --show-leak-kinds=definite,indirect --track-fds=no -q"
export KVP_TEST_DAEMON_WRAPPER="$vg --log-file=$build/vg/kvpoold.%p.log"
export CK_FORK=no CK_DEFAULT_TIMEOUT=600
status=0
run() { # name command...
    name=$1
    shift
    t0=$(date +%s)
    if $vg --log-file="$build/vg/$name.%p.log" "$@" >"$build/vg/$name.out" 2>&1; then
        r=ok
    else
        r="FAILED (exit $?; see $build/vg/$name.*)"
        status=1
    fi
    echo "valgrind $name: $r ($(($(date +%s) - t0)) s)"
}
rm -f "$build"/vg/*.log
units="test_error test_geom test_alloc test_seqtab test_log test_config test_notify test_sock
       test_client_wire test_rpc test_frame test_access"
# the planner's and the CPU kernel's randomized suites are pure loops that take 2-5 min each
# under valgrind: the full run only (deploy/test.sh runs them under ASan + UBSan anyway)
[ "$mode" = quick ] || units="$units test_plan test_append_cpu"
for t in $units; do
    run "$t" "$build/tests/$t"
done
run test_daemon "$build/tests/test_daemon"
run test_security "$build/tests/test_security"
# the retry window and the hostile-client tests of #14 and #15 (test_hostile_conns is left
# out: its descriptor case sets RLIMIT_NOFILE 64, and valgrind keeps the top of the fd table)
for t in test_dedup test_idempotency test_hostile_input test_hostile_names test_hostile_pool; do
    run "$t" "$build/tests/$t"
done
# the stress programs natively, their daemon under valgrind
KVP_TEST_DAEMON_WRAPPER="$vg --log-file=$build/vg/kvpoold.%p.log"
if [ "$mode" = quick ]; then
    set -- "KVP_STRESS_SECONDS=8 KVP_STRESS_CLIENTS=8 KVP_STRESS_PAGES=128" ""
else
    set -- "KVP_STRESS_SECONDS=30 KVP_STRESS_CLIENTS=16 KVP_STRESS_PAGES=256" "kill noread slow"
fi
t0=$(date +%s)
if env $1 "$build/tests/stress/stress_load" >"$build/vg/stress_load.out" 2>&1; then
    echo "valgrind stress_load (daemon under valgrind, $1): ok ($(($(date +%s) - t0)) s)"
else
    echo "valgrind stress_load: FAILED (see $build/vg/stress_load.out)"
    status=1
fi
if [ -n "$2" ]; then
    t0=$(date +%s)
    if KVP_STRESS_SECONDS=10 "$build/tests/stress/stress_faults" $2 >"$build/vg/stress_faults.out" 2>&1; then
        echo "valgrind stress_faults (daemon under valgrind): ok ($(($(date +%s) - t0)) s)"
    else
        echo "valgrind stress_faults: FAILED (see $build/vg/stress_faults.out)"
        status=1
    fi
fi
# any report in any log (a daemon killed by a test leaves no exit code to look at)
reports=$(cat "$build"/vg/*.log 2>/dev/null | grep -c '^==[0-9]*== [A-Z]' || true)
echo "valgrind: $reports report lines in $(ls "$build"/vg/*.log 2>/dev/null | wc -l) logs"
[ "$reports" = 0 ] || { grep -l '^==[0-9]*== [A-Z]' "$build"/vg/*.log; status=1; }
exit $status
