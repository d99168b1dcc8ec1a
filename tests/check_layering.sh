#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Enforces the layers (DESIGN.md §2, docs/ARCHITECTURE.md), each a folder, each including only
# what is below it:
#   common <- kvcache (libc only), cuda (CUDA + libc) <- kernels <- backend <- xfer <- rpc <- server
#   client (libkvpool, kvpoolctl) over kernels/cuda/common, beside the daemon's layers.
# kvcache/ includes no libuv, nanopb, socket or CUDA header; kernels/ no libuv, nanopb, socket or
# upper-layer header; backend/ neither the wire schema (nanopb, kvpool.pb.h) nor libuv nor an
# upper layer's header (it knows neither the config file nor the protocol); xfer/ nothing of rpc/
# or server/, and reaches the pool only through the backend's ops (no kvp_backend_cuda_* call);
# rpc/ nothing of the transport (server/); cuda/, common/ nothing above them; the daemon's layers
# and client/ none of each other's headers. The lists are read from the folders, so a new header
# is covered at once; .cu files live only under kernels/ (and tests/bench/ for benchmark-only
# kernels).
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
for upper in client server rpc xfer backend; do
    forbid cuda $upper "cuda/ must not include $upper/ headers"
    forbid common $upper "common/ must not include $upper/ headers"
    forbid kernels $upper "kernels/ must not include $upper/ headers"
done
for daemon in server rpc xfer backend; do
    forbid $daemon client "$daemon/ must not include client/ headers (shared code goes to cuda/ or common/)"
    forbid client $daemon "client/ must not include $daemon/ headers (shared code goes to cuda/ or common/)"
done
forbid rpc server "rpc/ must not include the transport's headers (server/)"
forbid xfer server "xfer/ must not include server/ headers"
forbid xfer rpc "xfer/ must not include rpc/ headers"
forbid backend server "backend/ must not include server/ headers (it knows nothing of the config file)"
forbid backend rpc "backend/ must not include rpc/ headers"
forbid backend xfer "backend/ must not include xfer/ headers"
if grep -rnE '#\s*include\s*[<"](uv\.h|pb\.h|pb_(encode|decode)\.h|kvpool\.pb\.h|kvp_wire\.h)' "$root/backend"; then
    echo "layering: backend/ must not include libuv or the wire schema" >&2; fail=1
fi
if grep -rnE '#\s*include\s*[<"](kvpool\.pb\.h|pb\.h|pb_(encode|decode)\.h|kvp_wire\.h)' "$root/xfer"; then
    echo "layering: xfer/ must not include the wire schema" >&2; fail=1
fi
if grep -rnE 'kvp_backend_cuda_[a-z_]+[[:space:]]*\(' "$root/xfer"; then
    echo "layering: xfer/ reaches the pool through the backend's ops, not the cuda backend's functions" >&2; fail=1
fi
if grep -rnE '#\s*include\s*[<"](uv\.h|pb\.h|pb_(encode|decode)\.h|sys/socket\.h)' "$root/cuda"; then
    echo "layering: cuda/ must use CUDA and libc only" >&2; fail=1
fi

# the tree's files, from git or (a release tarball) from disk: source_files.sh
stray=$(sh "$(dirname "$0")/source_files.sh" "$root" | grep -e '\.cu$' | grep -v -e '^kernels/' -e '^tests/bench/' | head -5)
if [ -n "$stray" ]; then
    echo "layering: CUDA sources outside kernels/: $stray" >&2; fail=1
fi
[ $fail -eq 0 ] && echo "layering ok"
exit $fail
