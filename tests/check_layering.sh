#!/bin/sh
# Enforces DESIGN.md §2: kvcache/ (pure core) and kernels/ include no libuv, nanopb, socket or
# upper-layer header; kvcache/ includes no CUDA header; .cu files live only under kernels/.
set -eu
root=${1:-.}
fail=0
if grep -rnE '#\s*include\s*[<"](uv\.h|pb\.h|pb_(encode|decode)\.h|sys/socket\.h|cuda[a-z_]*\.h|nccl\.h|kvp_(server|client|rpc)[a-z_]*\.h)' "$root/kvcache"; then
    echo "layering: kvcache/ must use libc only" >&2; fail=1
fi
if grep -rnE '#\s*include\s*[<"](uv\.h|pb\.h|pb_(encode|decode)\.h|sys/socket\.h|kvp_(geom|alloc|seqtab|plan|server|client|rpc)[a-z_]*\.h)' "$root/kernels"; then
    echo "layering: kernels/ must use CUDA and libc only" >&2; fail=1
fi
stray=$(git -C "$root" ls-files -co --exclude-standard '*.cu' 2>/dev/null | grep -v '^kernels/' | head -5)
if [ -n "$stray" ]; then
    echo "layering: CUDA sources outside kernels/: $stray" >&2; fail=1
fi
[ $fail -eq 0 ] && echo "layering ok"
exit $fail
