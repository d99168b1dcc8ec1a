#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# run_ab_e2e.sh A B [N] - bench_cuda_e2e of two builds alternating in one call on the GPU
# machine (A, B: build folders holding server/kvpoold and tests/bench/bench_cuda_e2e, each
# bench run against its own daemon), N rounds (default 3), under MPS with busy polling (200 us)
# and time-sliced without; the Append RPC p50 of every run, then the median per build and mode.
# Logs under $OUT. The VM's run-to-run spread is as large as most changes: compare only runs
# of one call.
set -u
A=$1
B=$2
N=${3:-3}
OUT=${OUT:-/tmp/kvpool-out}
mkdir -p "$OUT"
here=$(cd "$(dirname "$0")" && pwd)
one() { # build mode round
    log="$OUT/e2e_$(basename "$1")_$2_$3.txt"
    if [ "$2" = mps ]; then
        KVPOOLD="$1/server/kvpoold" sh "$here/run_mps.sh" "$1/tests/bench/bench_cuda_e2e" \
            --busy-poll-us 200 > "$log" 2>&1
    else
        KVPOOLD="$1/server/kvpoold" "$1/tests/bench/bench_cuda_e2e" > "$log" 2>&1
    fi
    p50=$(sed -n 's/^Append RPC.*p50 \([0-9.]*\) us.*/\1/p' "$log")
    step=$(sed -n 's/^  hot path.*= \([0-9.]*\) x private.*/\1/p' "$log")
    echo "$(basename "$1") $2 round $3: Append RPC p50 ${p50:-?} us, hot path ${step:-?} x private"
    echo "$(basename "$1") $2 ${p50:-nan}" >> "$OUT/e2e_ab.tsv"
}
: > "$OUT/e2e_ab.tsv"
for mode in mps sliced; do
    for r in $(seq "$N"); do
        one "$A" "$mode" "$r"
        one "$B" "$mode" "$r"
    done
done
echo "== median Append RPC p50 (us) per build and mode"
for b in "$A" "$B"; do
    for mode in mps sliced; do
        m=$(awk -v b="$(basename "$b")" -v m="$mode" '$1 == b && $2 == m {print $3}' \
            "$OUT/e2e_ab.tsv" | sort -n | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}')
        echo "$(basename "$b") $mode $m"
    done
done
