#!/bin/sh
# run_device.sh - what one call on the GPU machine runs (build here with KVP_STATIC_DEPS=ON into
# .devbuild/, carry it): the gpu-labelled tests and the CUDA benchmarks, logs under $OUT.
#   tests/gpu/run_device.sh [kernels|e2e|backend|prefix|python|all]
set -u
B=${KVP_DEVBUILD:-.devbuild}
export KVPOOLD="$PWD/$B/server/kvpoold"
OUT=${OUT:-/tmp/kvpool-out}
mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
rc=0
if [ "$what" = kernels ] || [ "$what" = all ]; then
    echo "== test_append_cuda"
    "$B/tests/test_append_cuda" > "$OUT/test_append_cuda.log" 2>&1; r=$?
    tail -5 "$OUT/test_append_cuda.log"; echo "exit $r"; [ $r -eq 0 ] || rc=1
    if command -v compute-sanitizer >/dev/null 2>&1; then
        echo "== compute-sanitizer (memcheck, racecheck) on the guard and graph tests"
        KVP_GPU_QUICK=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
            "$B/tests/test_append_cuda" > "$OUT/memcheck.log" 2>&1; echo "memcheck exit $?"
        tail -3 "$OUT/memcheck.log"
        KVP_GPU_QUICK=1 compute-sanitizer --tool racecheck --error-exitcode 9 \
            "$B/tests/test_append_cuda" > "$OUT/racecheck.log" 2>&1; echo "racecheck exit $?"
        tail -3 "$OUT/racecheck.log"
    fi
    echo "== bench_append_cuda"
    "$B/tests/bench/bench_append_cuda" 2>&1 | tee "$OUT/bench_append_cuda.txt"
fi
if [ "$what" = e2e ] || [ "$what" = all ]; then
    echo "== bench_cuda_e2e"
    "$B/tests/bench/bench_cuda_e2e" 2>&1 | tee "$OUT/bench_cuda_e2e.txt"
fi
if [ "$what" = prefix ]; then
    echo "== test_prefix_gpu"
    "$B/tests/test_prefix_gpu" > "$OUT/test_prefix_gpu.log" 2>&1; r=$?
    tail -8 "$OUT/test_prefix_gpu.log"; echo "exit $r"; [ $r -eq 0 ] || rc=1
fi
if [ "$what" = backend ] || [ "$what" = all ]; then
    for t in "$B"/tests/test_cuda_backend "$B"/tests/test_hot_path "$B"/tests/test_daemon \
        "$B"/tests/test_prefix_gpu; do
        [ -x "$t" ] || continue
        echo "== $(basename "$t")"
        "$t" > "$OUT/$(basename "$t").log" 2>&1; r=$?
        tail -8 "$OUT/$(basename "$t").log"; echo "exit $r"; [ $r -eq 0 ] || rc=1
    done
    # the plan-upload path, which small Appends no longer take, over the same tests
    t="$B"/tests/test_cuda_backend
    echo "== test_cuda_backend, KVPOOL_CUDA_PLAN_UPLOAD=1"
    KVPOOL_CUDA_PLAN_UPLOAD=1 "$t" > "$OUT/test_cuda_backend_upload.log" 2>&1; r=$?
    tail -4 "$OUT/test_cuda_backend_upload.log"; echo "exit $r"; [ $r -eq 0 ] || rc=1
fi
if [ "$what" = python ] || [ "$what" = all ]; then
    # the PyTorch side of the Python package (tests/python/test_torch.py) with the machine's
    # python3 (PyTorch, NumPy and pytest there); libkvpool and kvpoold from the carried build
    echo "== pytest tests/python/test_torch.py"
    PYTHONPATH="$PWD/client/python" KVPOOL_LIB="$PWD/$B/client/libkvpool.so" \
        PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -q -s -p no:cacheprovider \
        tests/python/test_torch.py > "$OUT/test_torch.log" 2>&1; r=$?
    tail -15 "$OUT/test_torch.log"; echo "exit $r"; [ $r -eq 0 ] || rc=1
    # the transformers integration (issue #17): the machine's transformers and PyTorch; the
    # FlashInfer path when flashinfer-python is on PYTHONPATH (a slimmed wheel carried along)
    echo "== pytest tests/python/test_hf_integration.py"
    BUILD_DIR="$B" PYTHONPATH="$PWD/client/python${KVP_EXTRA_PYTHONPATH:+:$KVP_EXTRA_PYTHONPATH}" \
        KVPOOL_LIB="$PWD/$B/client/libkvpool.so" PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -q \
        -s -p no:cacheprovider tests/python/test_hf_integration.py > "$OUT/test_hf.log" 2>&1; r=$?
    tail -15 "$OUT/test_hf.log"; echo "exit $r"; [ $r -eq 0 ] || rc=1
fi
exit $rc
