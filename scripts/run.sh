#!/usr/bin/env bash
# The main job (README): builds epmoe if needed, then `epmoe run` on a real model's MoE layer.
#   scripts/run.sh                          # qwen3-30b-a3b, 2 ranks, 8 tokens/rank, bf16
#   scripts/run.sh --precision nvfp4 --combine in_kernel_reduce --ranks 4
# Any `epmoe run` option can be passed; `scripts/run.sh --help` lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH=/usr/local/cuda/bin:$PATH
build=${EPMOE_BUILD_DIR:-build/release}
if [ ! -x "$build/tools/epmoe" ] || [ -n "$(find src include tools CMakeLists.txt -newer "$build/tools/epmoe" -print -quit)" ]; then
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DEPMOE_BUILD_TESTS=OFF >/dev/null
  cmake --build "$build" -j "$(nproc)" --target epmoe_cli
fi
if [ $# -eq 0 ]; then set -- --model qwen3-30b-a3b --ranks 2 --tokens 8; fi
exec "$build/tools/epmoe" run "$@"
