#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# run_device.sh - what one call on the GPU machine runs (build here with KVP_STATIC_DEPS=ON into
# .devbuild/, carry it): the gpu-labelled tests and the CUDA benchmarks, logs under $OUT.
#   tests/gpu/run_device.sh [kernels|e2e|backend|prefix|tier|events|python|torch|hf|hf-bench|all]
# events (issue #29): tests/python/test_events.py against kvpoold on the cuda backend (pyzmq and
# msgspec carried as wheels in .whl/), and bench_prefix's events part (--events).
# tier (issue #28): the host tier's tests and benchmark (${TIER_BENCH_ARGS} adds bench_tier flags).
# hf-bench also runs bench_multiturn.py (issue #28's host tier; ${MULTITURN_ARGS} adds flags).
# hf / hf-bench (issue #17): FlashInfer from wheels carried along ($KVP_WHEELS: the slimmed
# flashinfer-python wheel of tests/gpu/slim_flashinfer.py and apache-tvm-ffi's), installed into
# .gpu/py on first use; its JIT cache in .gpu/fi-ws (kept while the machine stays warm).
set -u
B=${KVP_DEVBUILD:-.devbuild}
export KVPOOLD="$PWD/$B/server/kvpoold"
# libzmq and its libraries, carried by tests/gpu/pack.sh (no apt there)
export LD_LIBRARY_PATH="$PWD/$B/devlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
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
    # its exit status counts: 1 when FlashInfer's bytes and kvpool's differ
    "$B/tests/bench/bench_append_cuda" > "$OUT/bench_append_cuda.txt" 2>&1; r=$?
    tail -60 "$OUT/bench_append_cuda.txt"; echo "exit $r"; [ $r -eq 0 ] || rc=1
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
if [ "$what" = tier ]; then
    echo "== test_tier_cuda"
    "$B/tests/test_tier_cuda" > "$OUT/test_tier_cuda.log" 2>&1; r=$?
    tail -8 "$OUT/test_tier_cuda.log"; echo "exit $r"; [ $r -eq 0 ] || rc=1
    echo "== test_tier_gpu"
    "$B/tests/test_tier_gpu" > "$OUT/test_tier_gpu.log" 2>&1; r=$?
    tail -12 "$OUT/test_tier_gpu.log"; echo "exit $r"; [ $r -eq 0 ] || rc=1
    echo "== bench_tier"
    # its exit status counts: 1 when a batch moved out and back differs; the daemon's log
    # lines (stderr) stay in the file
    # shellcheck disable=SC2086 # extra flags
    "$B/tests/bench/bench_tier" ${TIER_BENCH_ARGS:-} > "$OUT/bench_tier.txt" 2>&1; r=$?
    grep -v -E '^[0-9-]+T[0-9:.]+Z ' "$OUT/bench_tier.txt" | tail -80; echo "exit $r"
    [ $r -eq 0 ] || rc=1
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
if [ "$what" = events ]; then
    echo "== pytest tests/python/test_events.py (cuda backend)"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target \
        /tmp/kvp-evsite .whl/*.whl > "$OUT/pip.log" 2>&1 || { echo "no wheels (.whl)"; rc=1; }
    KVP_TEST_BACKEND=cuda BUILD_DIR="$B" KVPOOL_LIB="$PWD/$B/client/libkvpool.so" \
        PYTHONPATH="$PWD/client/python:/tmp/kvp-evsite" PYTHONDONTWRITEBYTECODE=1 python3 -m \
        pytest -q -p no:cacheprovider tests/python/test_events.py > "$OUT/test_events.log" 2>&1
    r=$?
    tail -15 "$OUT/test_events.log"; echo "exit $r"; [ $r -eq 0 ] || rc=1
    echo "== bench_prefix --events"
    "$B/tests/bench/bench_prefix" --events > "$OUT/bench_prefix_events.txt" 2>&1; r=$?
    grep -v -E '^[0-9-]+T[0-9:.]+Z ' "$OUT/bench_prefix_events.txt" | tail -60; echo "exit $r"
    [ $r -eq 0 ] || rc=1
fi
if [ "$what" = python ] || [ "$what" = torch ] || [ "$what" = all ]; then
    # the PyTorch side of the Python package (tests/python/test_torch.py) with the machine's
    # python3 (PyTorch, NumPy and pytest there); libkvpool and kvpoold from the carried build
    echo "== pytest tests/python/test_torch.py"
    PYTHONPATH="$PWD/client/python" KVPOOL_LIB="$PWD/$B/client/libkvpool.so" \
        PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -q -s -p no:cacheprovider \
        tests/python/test_torch.py > "$OUT/test_torch.log" 2>&1; r=$?
    tail -15 "$OUT/test_torch.log"; echo "exit $r"; [ $r -eq 0 ] || rc=1
fi
if [ "$what" = python ] || [ "$what" = all ]; then
    # the transformers integration (issue #17): the machine's transformers and PyTorch; the
    # FlashInfer path when flashinfer-python is on PYTHONPATH (a slimmed wheel carried along)
    echo "== pytest tests/python/test_hf_integration.py"
    BUILD_DIR="$B" PYTHONPATH="$PWD/client/python${KVP_EXTRA_PYTHONPATH:+:$KVP_EXTRA_PYTHONPATH}" \
        KVPOOL_LIB="$PWD/$B/client/libkvpool.so" PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -q \
        -s -p no:cacheprovider tests/python/test_hf_integration.py > "$OUT/test_hf.log" 2>&1; r=$?
    tail -15 "$OUT/test_hf.log"; echo "exit $r"; [ $r -eq 0 ] || rc=1
fi
PY="$PWD/.gpu/py"
export FLASHINFER_WORKSPACE_BASE="$PWD/.gpu/fi-ws"
if [ "$what" = hf ] || [ "$what" = hf-bench ]; then
    # installed unless an import of the wrappers works (a folder kept from an earlier call of a
    # warm machine may be incomplete)
    if [ -n "${KVP_WHEELS:-}" ] && ! PYTHONPATH="$PY" python3 -c \
        "import flashinfer; flashinfer.BatchPrefillWithPagedKVCacheWrapper" >/dev/null 2>&1; then
        rm -rf "$PY"
        # shellcheck disable=SC2086 # a list of wheel paths
        python3 -m pip install -q --no-deps --no-index --target "$PY" $KVP_WHEELS \
            > "$OUT/pip.log" 2>&1 || { echo "pip install of the wheels failed"; cat "$OUT/pip.log"; }
    fi
    PYP="$PWD/client/python:$PY"
    # FlashInfer's FA2 prefill unless told otherwise: its FA3 (sm_90) module takes minutes a
    # dtype to JIT-build on a fresh machine, FA2's about 20 s; decode is the same either way
    export KVPOOL_FLASHINFER_BACKEND="${KVPOOL_FLASHINFER_BACKEND:-fa2}"
    # FlashInfer compiles its modules on first use: both dtypes at once, before the tests
    for dt in fp16 bf16; do
        PYTHONPATH="$PYP" python3 tests/gpu/flashinfer_warmup.py "$dt" > "$OUT/fi_warmup_$dt.log" 2>&1 &
    done
    wait
    warm_ok=1
    for dt in fp16 bf16; do
        tail -1 "$OUT/fi_warmup_$dt.log" | cut -c1-300
        tail -1 "$OUT/fi_warmup_$dt.log" | grep -q "warm:" || warm_ok=0
    done
fi
if [ "$what" = hf ] && [ "$warm_ok" = 0 ]; then
    echo "FlashInfer's modules did not build (fi_warmup_*.log): the hf tests are not run"; rc=1
elif [ "$what" = hf ]; then
    echo "== pytest tests/python/test_hf_gpu.py"
    KVPOOL_HF_NEED_FLASHINFER=1 BUILD_DIR="$B" PYTHONPATH="$PYP" \
        KVPOOL_LIB="$PWD/$B/client/libkvpool.so" PYTHONDONTWRITEBYTECODE=1 \
        timeout "${HF_TEST_TIMEOUT:-900}" python3 -m pytest -q -s -p no:cacheprovider \
        --maxfail=4 tests/python/test_hf_gpu.py > "$OUT/test_hf_gpu.log" 2>&1; r=$?
    grep -E "largest logit|parts from|cross-process|passed|failed|Error" "$OUT/test_hf_gpu.log" | tail -30
    echo "exit $r"; [ $r -eq 0 ] || rc=1
fi
if [ "$what" = hf-bench ]; then
    # Llama-3.1-8B's geometry, bf16, random weights (tests/bench/bench_hf.py); ${HF_BENCH_ARGS}
    # adds or overrides flags
    echo "== bench_hf.py (Llama-3.1-8B geometry)"
    sock="$OUT/hf.sock"
    "$KVPOOLD" --socket "$sock" --backend cuda --num-layers 32 --num-kv-heads 8 --head-dim 128 \
        --dtype bf16 --page-size 16 --num-pages 14000 > "$OUT/kvpoold_hf.log" 2>&1 &
    dpid=$!
    sleep 3
    # shellcheck disable=SC2086 # extra flags
    PYTHONPATH="$PYP" KVPOOL_LIB="$PWD/$B/client/libkvpool.so" PYTHONDONTWRITEBYTECODE=1 \
        python3 tests/bench/bench_hf.py --socket "$sock" --device cuda --dtype bfloat16 \
        --vocab 128256 ${HF_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_hf.txt"
    [ "$(tail -1 "$OUT/bench_hf.txt" | cut -c1-6)" = decode ] || rc=1
    kill "$dpid"; wait "$dpid"
    # issue #28: conversations of ~4x the pool's KV revisited at random, three ways (a host
    # tier, none, an unbounded pool), each against a kvpoold of its own ($KVPOOLD); < 3 min with
    # the defaults; ${MULTITURN_ARGS} adds or overrides flags (sizes: --conversations, --turns...)
    echo "== bench_multiturn.py (Llama-3.1-8B geometry)"
    # shellcheck disable=SC2086 # extra flags
    PYTHONPATH="$PYP" KVPOOL_LIB="$PWD/$B/client/libkvpool.so" PYTHONDONTWRITEBYTECODE=1 \
        timeout "${MULTITURN_TIMEOUT:-420}" python3 tests/bench/bench_multiturn.py --device cuda \
        --dtype bfloat16 --vocab 128256 ${MULTITURN_ARGS:-} 2>&1 | tee "$OUT/bench_multiturn.txt"
    [ "$(tail -1 "$OUT/bench_multiturn.txt" | cut -c1-10)" = multiturn_ ] || rc=1
fi
exit $rc
