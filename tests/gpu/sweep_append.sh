#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# sweep_append.sh - runs bench_append_cuda once per shape of the row (decode) kernel and
# prints each run's graph-replay summary lines under a header naming the shape, so one device
# call compares them all (the defaults in kernels/kvp_append_cuda.cu come from such a sweep:
# tests/bench/README.md).
#   tests/gpu/sweep_append.sh BENCH [ONLY] [VECS...] -- [WARPS...]
# BENCH: the bench_append_cuda binary; ONLY: its --only filter (default "decode"); VECS: the
# --vecs-per-thread values (default 1 2 4 8); WARPS: the --warps-per-block values (tokens per
# block; default 1 2 4 8).
set -eu
[ $# -ge 1 ] || { echo "usage: $0 BENCH [ONLY] [VECS...] -- [WARPS...]" >&2; exit 2; }
bench=$1
only=${2:-decode}
[ $# -ge 2 ] && shift 2 || shift 1
vecs=""
while [ $# -gt 0 ] && [ "$1" != "--" ]; do vecs="$vecs $1"; shift; done
[ $# -gt 0 ] && shift
warps="$*"
[ -n "$vecs" ] || vecs="1 2 4 8"
[ -n "$warps" ] || warps="1 2 4 8"
for v in $vecs; do
    for w in $warps; do
        echo "== --vecs-per-thread $v --warps-per-block $w"
        "$bench" --only "$only" --reps 30 --kernel warp --vecs-per-thread "$v" \
            --warps-per-block "$w" | grep -E '^summary| graph |DIFFER' || true
    done
done
