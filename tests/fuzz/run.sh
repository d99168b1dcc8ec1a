#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# run.sh [SECONDS] - configures build-fuzz/ (clang, KVP_FUZZ=ON, KVP_SANITIZE=ON, CUDA off),
# builds the fuzz targets, runs each for SECONDS (default 20) on a scratch copy of its seed
# corpus (after its regression inputs) and prints each target's exec count. Exit status: 0
# when every target ran clean; a crash leaves its reproducer as build-fuzz/fuzz-work/<target>-*.
set -eu
seconds=${1:-20}
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$root/build-fuzz
targets="fuzz_rpc fuzz_kernel fuzz_response fuzz_frame fuzz_http"
cmake -S "$root" -B "$build" -DCMAKE_C_COMPILER=clang -DKVP_FUZZ=ON -DKVP_WITH_CUDA=OFF \
    -DKVP_SANITIZE=ON >/dev/null
cmake --build "$build" -j"$(nproc)" --target $targets >/dev/null
status=0
for t in $targets; do
    work=$build/fuzz-work/$t
    log=$build/fuzz-work/$t.log
    mkdir -p "$build/fuzz-work"
    if "$root/tests/fuzz/ctest_fuzz.sh" "$build/tests/fuzz/$t" "$seconds" "$work" \
        "$root/tests/fuzz/corpus/$t" "$root/tests/fuzz/regressions/$t" >"$log" 2>&1; then
        result=ok
    else
        result="FAILED (see $log)"
        status=1
    fi
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    echo "$t: ${seconds}s, ${execs:-?} execs, $result"
done
exit $status
