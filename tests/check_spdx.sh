#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Every source file of the tree names its licence (LICENSE: Apache-2.0) in an SPDX line within
# its first three lines (after a shebang or a Dockerfile syntax line): C, CUDA and headers,
# Python, shell, CMake, the protocol and its nanopb options, and the deploy files (config,
# systemd units and entries, container files, pyproject). Data files (fuzz corpora and
# regressions) and Markdown are not sources. Exits 1 naming each file that lacks it.
#   tests/check_spdx.sh [SOURCE_DIR]
# The files are source_files.sh's: git's in a checkout, found on disk without git (a release
# tarball), less build trees and virtual environments.
set -eu
root=${1:-$(dirname "$0")/..}
files=$(sh "$(dirname "$0")/source_files.sh" "$root")
cd "$root"
bad=0
n=0
for f in $files; do
    case "$f" in
        tests/fuzz/corpus/* | tests/fuzz/regressions/* | build*/* | .devbuild/* | .gpu/*) continue ;;
        *.c | *.h | *.cu | *.cuh | *.py | *.sh | *.cmake | */CMakeLists.txt | CMakeLists.txt) ;;
        *.proto | *.options | *.in | *.toml | *.yaml | *.conf | *.sysusers | *.tmpfiles) ;;
        *.scd | *.bash | */Dockerfile | */completion/*) ;;
        *) continue ;;
    esac
    [ -f "$f" ] || continue
    n=$((n + 1))
    if ! head -n 3 "$f" | grep -q 'SPDX-License-Identifier: Apache-2\.0'; then
        echo "no SPDX-License-Identifier: Apache-2.0 line in the first three lines: $f"
        bad=1
    fi
done
[ $bad -eq 0 ] && echo "spdx ok ($n files)"
exit $bad
