#!/usr/bin/env bash
# The test command (README): installs what it needs, builds with warnings as errors, runs ctest.
#   scripts/test.sh            # build/ci, all CPU tests; GPU tests reported as skipped
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH=/usr/local/cuda/bin:$PATH
build=${EPMOE_BUILD_DIR:-build/ci}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPMOE_WERROR=ON -DEPMOE_BUILD_TESTS=ON
cmake --build "$build" -j "$(nproc)"
cd "$build"
ctest --output-on-failure -j "$(nproc)" "$@"
