#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# ncu_append.sh - Nsight Compute over bench_append_cuda's rows on the GPU machine (Firecracker:
# ncu reads the hardware counters there, device tool's H200.md): per workload, the kernels of
# the single launches of every form (FlashInfer's AppendPagedKVCache, kvpool's fused, checked,
# unchecked and slots kernels), then the bounds (the plain copy of the same bytes and the
# scatter copy to the same slots without lookups), each with
# its own duration on the GPU, DRAM and L2 bytes, launch shape, achieved occupancy and warp
# stall reasons; tests/gpu/ncu_summary.py turns each raw CSV into a table. The clocks are left
# alone (--clock-control none, METHOD.md) and caches are not flushed between kernels
# (--cache-control none), as in the benchmark's back-to-back launches.
#   tests/gpu/ncu_append.sh BENCH OUTDIR [WORKLOAD...]
# WORKLOAD: a bench --only filter (default: the three decode rows and 4x8192 and 64x256). On
# the H200 each workload takes about a minute (up to 120 profiled kernels, each replayed per
# section): budget ~5 minutes of device time for the default set.
set -eu
[ $# -ge 2 ] || { echo "usage: $0 BENCH OUTDIR [WORKLOAD...]" >&2; exit 2; }
bench=$1
out=$2
shift 2
[ $# -gt 0 ] || set -- "decode 256x1 H8" "decode 1024x1" "decode 256x1 H32" "4x8192" "64x256"
NCU=${NCU:-ncu}
command -v "$NCU" >/dev/null 2>&1 || NCU=$(ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found" >&2; exit 77; }
here=$(dirname "$0")
mkdir -p "$out"
i=0
for w in "$@"; do
    i=$((i + 1))
    for pass in forms copy; do
        if [ $pass = forms ]; then
            k='regex:copy_(block|warp|flat|inline)_kernel|AppendPagedKVCache|validate'
            c=240
        else
            k='regex:plain_copy_kernel|scatter_copy_kernel'
            c=24
        fi
        f="$out/ncu-$i-$pass.csv"
        echo "== $w ($pass) -> $f"
        "$NCU" --clock-control none --cache-control none -k "$k" -c $c \
            --section SpeedOfLight --section LaunchStats --section Occupancy \
            --section WarpStateStats --section MemoryWorkloadAnalysis \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum \
            --csv --page raw --log-file "$f" "$bench" --only "$w" --reps 3 >"$out/ncu-$i-$pass.log" 2>&1 ||
            { echo "ncu failed (rc $?): tail of the log"; tail -20 "$out/ncu-$i-$pass.log"; continue; }
        python3 "$here/ncu_summary.py" "$w ($pass)" "$f" || true
    done
done
