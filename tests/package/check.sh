#!/usr/bin/env bash
# The installable package: install the build into a temporary prefix, then configure, build and
# run a downstream project that uses find_package(epmoe) and epmoe::epmoe.
#   check.sh <build dir> <source dir of this consumer>
set -euo pipefail
build=$1 consumer=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$consumer" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/c"
