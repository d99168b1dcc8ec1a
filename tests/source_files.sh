#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Prints the files of the source tree at SOURCE_DIR (default: this script's tree), one path a
# line relative to it, for the checks that read every source (check_spdx.sh, check_layering.sh).
# In a git checkout they are git's: tracked, or new and not ignored. Without git (a release
# tarball, or git not installed), or when the tree is not the top of its own checkout (a tarball
# unpacked inside another repository), they are found on disk, less what is not ours: .git,
# top-level build*/ trees, virtual environments (.venv/, venv/, or any folder holding a
# pyvenv.cfg), Python caches and egg-info, and every folder .gitignore names.
#   tests/source_files.sh [SOURCE_DIR]
set -eu
cd "${1:-$(dirname "$0")/..}"
top=$(git rev-parse --show-toplevel 2>/dev/null || true)
if [ -n "$top" ] && [ "$(cd "$top" && pwd -P)" = "$(pwd -P)" ]; then
    exec git ls-files --cached --others --exclude-standard
fi
# find's prune list: folders by name at any depth, then .gitignore's folder patterns, read as git
# reads them ("/build*/" or "a/b/": from the top; "__pycache__/": at any depth). Its file patterns
# (*.o) name no source a check reads.
set -- -name .git -o -name .venv -o -name venv -o -name __pycache__ -o -name '*.egg-info' \
    -o -path './build*'
if [ -f .gitignore ]; then
    while IFS= read -r pat || [ -n "$pat" ]; do
        case "$pat" in
            '' | '#'* | '!'*) continue ;;
            */) pat=${pat%/} ;;
            *) continue ;;
        esac
        case "$pat" in
            /*) set -- "$@" -o -path ".$pat" ;;
            */*) set -- "$@" -o -path "./$pat" ;;
            *) set -- "$@" -o -name "$pat" ;;
        esac
    done <.gitignore
fi
venvs=$(find . -type d \( "$@" \) -prune -o -name pyvenv.cfg -print | sed 's|/pyvenv\.cfg$||')
find . -type d \( "$@" \) -prune -o -type f -print |
    awk -v venvs="$venvs" 'BEGIN { n = split(venvs, v, "\n") }
        { for (i = 1; i <= n; i++) if (index($0, v[i] "/") == 1) next; print }' |
    sed 's|^\./||'
