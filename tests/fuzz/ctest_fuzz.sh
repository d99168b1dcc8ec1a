#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# ctest_fuzz.sh TARGET SECONDS WORKDIR CORPUS REGRESSIONS - CTest's fuzz run of one target:
# first every crash reproducer in REGRESSIONS runs once (each must pass), then TARGET fuzzes
# for SECONDS on a scratch copy (WORKDIR) of the checked-in CORPUS.
set -eu
target=$1 seconds=$2 work=$3 corpus=$4 regress=$5
if [ -d "$regress" ] && [ -n "$(ls -A "$regress" 2>/dev/null)" ]; then
    "$target" "$regress"/*
fi
rm -rf "$work"
mkdir -p "$work"
cp "$corpus"/* "$work"/
exec "$target" -max_total_time="$seconds" -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$work/../$(basename "$target")-" "$work" "$corpus"
