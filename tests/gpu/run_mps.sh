#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# run_mps.sh CMD... - runs CMD with an MPS control daemon of its own (private pipe and log
# directories), then quits MPS. Two processes on one GPU then share it without time-slicing
# (DESIGN.md §4).
set -u
d=$(mktemp -d /tmp/kvpool-mps-XXXXXX)
export CUDA_MPS_PIPE_DIRECTORY="$d/pipe" CUDA_MPS_LOG_DIRECTORY="$d/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "MPS did not start"; exit 1; }
"$@"; rc=$?
echo quit | nvidia-cuda-mps-control
exit $rc
