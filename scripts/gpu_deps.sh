#!/usr/bin/env bash
# Assembles $EPMOE_GPU_DEPS (default .gpu_deps, git-ignored) on a machine with network, for the GPU
# machines, which reach nothing: what tests/gpu/run.sh, bench/run_all.sh and bench/ab.sh build
# against there (scripts/gpu_env.sh reads it). Carry it with the device tool: carry [".gpu_deps"].
#   googletest/       the source tree of Debian's googletest package (built there when missing)
#   cli11/CLI/        CLI11's headers (Debian)
#   cutlass/include/  cutlass/ and cute/ from PyPI nvidia-cutlass (cutlass_library/source/include)
#   wheels/           with EPMOE_GPU_DEPS_WHEELS=1: FlashInfer's SM90 layer for the same-run
#                     baseline (docs/bench.md): flashinfer-python 0.6.18 and apache-tvm-ffi
#                     0.1.15.post2 for the GPU machine's Python 3.12 and for this one
#   scripts/gpu_deps.sh                          # about 31 MB
#   EPMOE_GPU_DEPS_WHEELS=1 scripts/gpu_deps.sh  # and the FlashInfer wheels (24 MB more: for
#                                                # bench/run_all.sh; bench/ab.sh's three sides and
#                                                # .gpu_deps fit the device tool's 64 MiB without)
set -euo pipefail
cd "$(dirname "$0")/.."
deps=${EPMOE_GPU_DEPS:-.gpu_deps}
scripts/setup.sh  # Debian's googletest and CLI11, PyPI's nvidia-cutlass
cutlass=$(python3 -c 'import cutlass_library, os
print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))')
for need in /usr/src/googletest/CMakeLists.txt /usr/include/CLI/CLI.hpp "$cutlass/cute"; do
  [ -e "$need" ] || { echo "gpu_deps: $need is missing (scripts/setup.sh installs it)"; exit 1; }
done
mkdir -p "$deps"
rm -rf "$deps/googletest" "$deps/cli11" "$deps/cutlass"
cp -r /usr/src/googletest "$deps/googletest"
mkdir -p "$deps/cli11" "$deps/cutlass/include"
cp -r /usr/include/CLI "$deps/cli11/CLI"
cp -r "$cutlass/cutlass" "$cutlass/cute" "$deps/cutlass/include/"
if [ "${EPMOE_GPU_DEPS_WHEELS:-0}" = 1 ]; then
  wheel() { python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$deps/wheels" "$@"; }
  wheel flashinfer-python==0.6.18
  wheel --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    apache-tvm-ffi==0.1.15.post2
  wheel --only-binary=:all: apache-tvm-ffi==0.1.15.post2
fi
echo "gpu_deps: $(du -sh "$deps" | cut -f1) in $deps (carry it: [\"$deps\"])"
