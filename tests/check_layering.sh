#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Enforces DESIGN.md §2: kvcache/ (pure core) and kernels/ include no libuv, nanopb, socket or
# upper-layer header; kvcache/ includes no CUDA header; cuda/ (the CUDA layer the daemon, the
# client library and the kernels share) includes nothing of server/ or client/; server/ and
# client/ include none of each other's headers (the list is read from the folders, so a new
# header is covered at once); .cu files live only under kernels/.
set -eu
root=${1:-.}
fail=0
if grep -rnE '#\s*include\s*[<"](uv\.h|pb\.h|pb_(encode|decode)\.h|sys/socket\.h|cuda[a-z_]*\.h|nccl\.h|kvp_(server|client|rpc)[a-z_]*\.h)' "$root/kvcache"; then
    echo "layering: kvcache/ must use libc only" >&2; fail=1
fi
if grep -rnE '#\s*include\s*[<"](uv\.h|pb\.h|pb_(encode|decode)\.h|sys/socket\.h|kvp_(geom|alloc|seqtab|plan|server|client|rpc)[a-z_]*\.h)' "$root/kernels"; then
    echo "layering: kernels/ must use CUDA and libc only" >&2; fail=1
fi

# The header names of folder $1 as an ERE alternation ("kvp_a\.h|kvp_b\.h"); empty if none.
headers_of() {
    for h in "$root/$1"/*.h; do
        [ -e "$h" ] && basename "$h"
    done | sed 's/\./\\./g' | paste -sd'|' -
}

# forbid SRC HDRDIR WHY: no C, header or CUDA file under SRC/ includes a header of HDRDIR/
# (by name, with or without a path in front).
forbid() {
    names=$(headers_of "$2")
    [ -n "$names" ] || return 0
    if grep -rnE --include='*.c' --include='*.h' --include='*.cu' \
        "#\s*include\s*[<\"]([^\">]*/)?($names)[\">]" "$root/$1"; then
        echo "layering: $3" >&2; fail=1
    fi
}
forbid server client "server/ must not include client/ headers (shared code goes to cuda/ or common/)"
forbid client server "client/ must not include server/ headers (shared code goes to cuda/ or common/)"
forbid cuda server "cuda/ must not include server/ headers"
forbid cuda client "cuda/ must not include client/ headers"
if grep -rnE '#\s*include\s*[<"](uv\.h|pb\.h|pb_(encode|decode)\.h|sys/socket\.h)' "$root/cuda"; then
    echo "layering: cuda/ must use CUDA and libc only" >&2; fail=1
fi

stray=$(git -C "$root" ls-files -co --exclude-standard '*.cu' 2>/dev/null | grep -v '^kernels/' | head -5)
if [ -n "$stray" ]; then
    echo "layering: CUDA sources outside kernels/: $stray" >&2; fail=1
fi
[ $fail -eq 0 ] && echo "layering ok"
exit $fail
