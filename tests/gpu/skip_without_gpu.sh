#!/usr/bin/env bash
# CI has no GPU: say so and exit 77, which ctest reports as "Skipped".
# On a GPU machine run tests/gpu/run.sh instead.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "GPU present: run tests/gpu/run.sh for the GPU suite"
fi
echo "SKIPPED: the GPU suite (tests/gpu/) needs an H200; run tests/gpu/run.sh on a GPU machine"
exit 77
