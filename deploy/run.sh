#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# run.sh - a newcomer's first command on a fresh Debian 12 machine: installs what is missing
# (deploy/install-deps.sh), builds kvpoold and kvpoolctl into build/ (no test run), and starts
# kvpoold in the foreground on its embedded default: a host pool of 256 MiB (2 layers, 8 KV
# heads, head_dim 128, fp16, page 16), the socket at /run/kvpool/kvpool.sock for root, else
# $XDG_RUNTIME_DIR/kvpool/kvpool.sock. Ctrl-C (SIGINT) or SIGTERM stops it. Arguments go to
# kvpoold (kvpoold --help), e.g. deploy/run.sh --backend cuda.
#
#   deploy/run.sh [KVPOOLD-ARGS...]
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
jobs=$(nproc 2>/dev/null || echo 2)

"$root/deploy/install-deps.sh"
mkdir -p "$root/build"
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$root/build/run-build.log" 2>&1 ||
    { cat "$root/build/run-build.log"; exit 1; }
cmake --build "$root/build" -j "$jobs" --target kvpoold kvpoolctl >> "$root/build/run-build.log" 2>&1 ||
    { tail -40 "$root/build/run-build.log"; exit 1; }
echo "run.sh: built (log: build/run-build.log). kvpoold runs in the foreground; in another terminal:"
echo "    $root/build/client/kvpoolctl status"
exec "$root/build/server/kvpoold" "$@"
