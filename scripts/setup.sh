#!/usr/bin/env bash
# Installs the Debian packages the build and tests need, where they are missing.
set -euo pipefail
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
command -v spin >/dev/null || need+=(spin)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
[ -f /usr/include/gmock/gmock.h ] || need+=(libgmock-dev)
[ -f /usr/include/CLI/CLI.hpp ] || need+=(libcli11-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || \
  echo "setup: nvcc not found; CUDA sources will be skipped"
# CUTLASS 4 headers (PyPI nvidia-cutlass) for the CUDA build's wgmma backend.
if { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   ! python3 -c "import cutlass_library" 2>/dev/null; then
  echo "setup: pip installing nvidia-cutlass (CUTLASS headers)"
  python3 -m pip install --quiet --disable-pip-version-check nvidia-cutlass
fi
