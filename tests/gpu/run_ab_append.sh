#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# run_ab_append.sh A B [N] - bench_append_cuda of two builds alternating in one call on the GPU
# machine (A, B: build folders holding tests/bench/bench_append_cuda), N rounds (default 2), each
# run's table under $OUT/append_<build>_<round>.txt. Compare only runs of one call: the VM's
# run-to-run spread is as large as most changes.
set -u
A=$1
B=$2
N=${3:-2}
OUT=${OUT:-/tmp/kvpool-out}
mkdir -p "$OUT"
rc=0
for r in $(seq "$N"); do
    for b in "$A" "$B"; do
        log="$OUT/append_$(basename "$b")_$r.txt"
        "$b/tests/bench/bench_append_cuda" > "$log" 2>&1
        e=$?
        echo "$(basename "$b") round $r: exit $e"
        [ $e -eq 0 ] || rc=1
    done
done
exit $rc
