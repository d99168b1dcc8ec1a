#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# run_multigpu.sh - the multigpu-labelled tests and the transfer benchmark on a machine with two
# GPUs (build here with -DKVP_STATIC_DEPS=ON -DKVP_CUDA_ARCHS=90 into .devbuild/, carry it);
# logs under $OUT. NCCL is loaded at run time: $KVPOOL_NCCL_LIB (the daemons' [tuning]
# nccl_lib), else the libnccl.so.2 of PyTorch's pip packages (nvidia.nccl), else any
# libnccl.so.2 under a site-packages directory.
#   tests/gpu/run_multigpu.sh [tp|xfer|bench|backend|all]
set -u
B=${KVP_DEVBUILD:-.devbuild}
export KVPOOLD="$PWD/$B/server/kvpoold"
# libzmq and its libraries, carried by tests/gpu/pack.sh (no apt there)
export LD_LIBRARY_PATH="$PWD/$B/devlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# the daemon with the transfer test hooks (KVPOOL_XFER_TEST_*), for test_multigpu_xfer
export KVPOOLD_TEST="$PWD/$B/server/kvpoold-test"
OUT=${OUT:-/tmp/kvpool-out}
mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
nvidia-smi topo -m >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

if [ -z "${KVPOOL_NCCL_LIB:-}" ]; then
    for py in python3 /usr/bin/python3 /usr/local/bin/python3; do
        command -v "$py" >/dev/null 2>&1 || continue
        d=$("$py" -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null) || continue
        if [ -f "$d/lib/libnccl.so.2" ]; then
            KVPOOL_NCCL_LIB="$d/lib/libnccl.so.2"
            break
        fi
    done
fi
if [ -z "${KVPOOL_NCCL_LIB:-}" ]; then
    KVPOOL_NCCL_LIB=$(find / -xdev -name libnccl.so.2 -path '*-packages*' 2>/dev/null | head -1)
fi
if [ -z "${KVPOOL_NCCL_LIB:-}" ]; then
    echo "no libnccl.so.2 found: set KVPOOL_NCCL_LIB" | tee "$OUT/nccl.txt"
    exit 1
fi
export KVPOOL_NCCL_LIB
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
echo "KVPOOL_NCCL_LIB=$KVPOOL_NCCL_LIB" | tee "$OUT/nccl.txt"

rc=0
run() { # name, command...
    name=$1
    shift
    echo "== $name"
    "$@" > "$OUT/$name.log" 2>&1
    r=$?
    grep -v "^ok \|^20..-\|^NCCL version" "$OUT/$name.log" | tail -12
    echo "exit $r"
    [ $r -eq 0 ] || rc=1
}
if [ "$what" = tp ] || [ "$what" = all ]; then
    run test_multigpu_tp "$B/tests/test_multigpu_tp"
fi
if [ "$what" = backend ] || [ "$what" = all ]; then
    # the cuda backend's run() was restructured for the tensor-parallel form: its own tests too
    run test_cuda_backend "$B/tests/test_cuda_backend"
fi
if [ "$what" = xfer ] || [ "$what" = all ]; then
    run test_multigpu_xfer "$B/tests/test_multigpu_xfer"
    run test_multigpu_xfer_net env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \
        "$B/tests/test_multigpu_xfer"
    # chunks of 4 KiB: every transfer moves in many chunks, most spanning two layers (a hook of
    # kvpoold-test, which test_multigpu_xfer runs: $KVPOOLD_TEST)
    run test_multigpu_xfer_chunks env KVPOOL_XFER_TEST_CHUNK_BYTES=4096 \
        "$B/tests/test_multigpu_xfer"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    # one transfer at a time, two in flight, the four as one set (argv: largest chunk, 0
    # automatic; transfers in flight or "set")
    run bench_transfer "$B/tests/bench/bench_transfer" 0 1
    run bench_transfer_2 "$B/tests/bench/bench_transfer" 0 2
    run bench_transfer_set "$B/tests/bench/bench_transfer" 0 set
    run bench_transfer_net env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \
        "$B/tests/bench/bench_transfer" 0 1
    run bench_transfer_net_set env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \
        "$B/tests/bench/bench_transfer" 0 set
fi
exit $rc
