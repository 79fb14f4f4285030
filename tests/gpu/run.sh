#!/usr/bin/env bash
# The GPU suite, on a GPU machine: build for sm_90a with every core against the NCCL whose headers
# match its library, run the GPU tests and `epmoe run` on the GPUs, print a short table last.
# Full logs go to $OUT (the device tool's folder) or build/gpu-logs.
#   tests/gpu/run.sh              # everything
#   EPMOE_GPU_FILTER='Gpu.*Graph*' tests/gpu/run.sh
#   EPMOE_GPU_TESTS_ONLY=1 tests/gpu/run.sh   # gpu_layer_test only: no epmoe run / stress
#   EPMOE_GPU_RUN_DEEPSEEK=0 tests/gpu/run.sh # without the deepseek-v3 (256 experts) runs
# A machine without googletest, CLI11 or CUTLASS needs them carried in $EPMOE_GPU_DEPS (default
# .gpu_deps): googletest/ (the source tree of Debian's googletest package), cli11/CLI/ (headers)
# and cutlass/include/ (cutlass/ and cute/ from PyPI nvidia-cutlass's cutlass_library/source/include):
# scripts/gpu_deps.sh assembles it on a machine with network.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on these machines
out=${OUT:-build/gpu-logs}
mkdir -p "$out"
jobs=$(nproc)
start=$(date +%s)

# NCCL from the wheel, CLI11 and CUTLASS from $EPMOE_GPU_DEPS, Ninja (sets deps, nccl_root, extra,
# generator); googletest built from $deps when the machine has none.
source scripts/gpu_env.sh || exit 1
if [ ! -f /usr/include/gtest/gtest.h ] && [ -d "$deps/googletest" ]; then
  cmake -S "$deps/googletest" -B build/gtest -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$PWD/build/gtest-prefix" >"$out/gtest_build.log" 2>&1 &&
    cmake --build build/gtest -j "$jobs" --target install >>"$out/gtest_build.log" 2>&1
  extra+=(-DCMAKE_PREFIX_PATH="$PWD/build/gtest-prefix")
fi

echo "== build (nvcc $(nvcc --version | grep -o 'release [0-9.]*'), NCCL from ${nccl_root:-system})"
if ! { cmake -S . -B build/gpu "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
         -DNCCL_ROOT="$nccl_root" "${extra[@]}" &&
       cmake --build build/gpu -j "$jobs" ${EPMOE_GPU_TESTS_ONLY:+--target gpu_layer_test}; } \
     >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "built in $(( $(date +%s) - start )) s"
nvidia-smi -L

echo "== GPU tests"
build/gpu/tests/gpu/gpu_layer_test --gtest_filter="${EPMOE_GPU_FILTER:-*}" 2>&1 | tee "$out/gpu_tests.log" |
  grep -E '^\[ *(OK|FAILED|PASSED) *\]|Failure|Expected|Which is|HANG|error' | awk 'NR <= 120'
# (awk, not head: head would close the pipe and kill the test binary with SIGPIPE mid-run; the
# SKIPPED lines of multi-GPU cases are in the log, counted in the summary.)
tests_rc=${PIPESTATUS[0]}

if [ -n "${EPMOE_GPU_TESTS_ONLY:-}" ]; then
  echo "== summary ($(( $(date +%s) - start )) s): gpu tests rc=$tests_rc (EPMOE_GPU_TESTS_ONLY)"
  exit "$tests_rc"
fi

echo "== epmoe run on the GPUs"
gpus=$(nvidia-smi -L | wc -l)
run_rc=0
for p in ${EPMOE_GPU_RUN_PRECISIONS:-bf16 mxfp8 nvfp4 fp8_block128 mxfp4}; do
  for c in ${EPMOE_GPU_RUN_COMBINES:-staged in_kernel_reduce}; do
    build/gpu/tools/epmoe run --model qwen3-30b-a3b --ranks "$gpus" --tokens 64 --rounds 3 \
      --precision $p --combine $c --math exact >"$out/run_${p}_${c}.log" 2>&1 || run_rc=1
    echo "qwen3-30b-a3b $p $c exact: $(grep -E '^(PASS|FAIL)' "$out/run_${p}_${c}.log" | cut -c1-4)"
  done
done
# The tensor-core expert maths (wgmma is the default; mma.sync has no fp8_block128: its block
# scales need per-128 promotion, which the wgmma backend's E4M3 GEMM does).
for m in tensor_core wgmma; do
  for p in ${EPMOE_GPU_RUN_PRECISIONS:-bf16 mxfp8 nvfp4 fp8_block128 mxfp4}; do
    [ "$m/$p" = tensor_core/fp8_block128 ] && continue
    build/gpu/tools/epmoe run --model qwen3-30b-a3b --ranks "$gpus" --tokens 64 --rounds 3 \
      --precision $p --math $m >"$out/run_${p}_$m.log" 2>&1 || run_rc=1
    echo "qwen3-30b-a3b $p staged $m: $(grep -E '^(PASS|FAIL)' "$out/run_${p}_$m.log" | cut -c1-4)"
  done
done
# The persistent round (--megakernel: one launch per forward): tensor_core's in every bucket, and
# wgmma's E4M3 tile (mxfp8, mxfp4) in the decode bucket (T = 8).
for p in ${EPMOE_GPU_RUN_PRECISIONS:-bf16 mxfp8 nvfp4 mxfp4}; do
  [ "$p" = fp8_block128 ] && continue
  for c in staged in_kernel_reduce; do
    build/gpu/tools/epmoe run --model qwen3-30b-a3b --ranks "$gpus" --tokens 64 --rounds 3 \
      --precision $p --combine $c --math tensor_core --megakernel \
      >"$out/run_${p}_${c}_persistent.log" 2>&1 || run_rc=1
    echo "qwen3-30b-a3b $p $c tensor_core persistent: $(grep -E '^(PASS|FAIL)' "$out/run_${p}_${c}_persistent.log" | cut -c1-4)"
  done
done
for p in mxfp8 mxfp4; do
  for c in staged in_kernel_reduce; do
    log="$out/run_${p}_${c}_wgmma_persistent.log"
    build/gpu/tools/epmoe run --model qwen3-30b-a3b --ranks "$gpus" --tokens 8 --rounds 3 \
      --precision $p --combine $c --math wgmma --megakernel >"$log" 2>&1 || run_rc=1
    echo "qwen3-30b-a3b $p $c wgmma persistent (T = 8): $(grep -E '^(PASS|FAIL)' "$log" | cut -c1-4)"
  done
done
# The chain in plain stream order (EPMOE_PDL=0: no programmatic dependent launch), wgmma mxfp8.
log="$out/run_mxfp8_wgmma_no_pdl.log"
EPMOE_PDL=0 build/gpu/tools/epmoe run --model qwen3-30b-a3b --ranks "$gpus" --tokens 64 --rounds 3 \
  --precision mxfp8 --math wgmma >"$log" 2>&1 || run_rc=1
echo "qwen3-30b-a3b mxfp8 wgmma, EPMOE_PDL=0: $(grep -E '^(PASS|FAIL)' "$log" | cut -c1-4)"
cat "$out/run_bf16_staged.log"
grep -A4 '^rank' "$out/run_nvfp4_tensor_core.log"
# deepseek-v3 with all 256 experts (issue 11), every precision in exact, tensor_core and wgmma math:
# 22.5 GB of weights drawn on every host core, each rank's copied up and prepared on its GPU; the
# host checks the first tokens of each round (--check-tokens auto: 11 of 16).
# EPMOE_GPU_RUN_DEEPSEEK=0 skips it.
if [ "${EPMOE_GPU_RUN_DEEPSEEK:-1}" = 1 ]; then
  for p in ${EPMOE_GPU_RUN_PRECISIONS:-bf16 mxfp8 nvfp4 fp8_block128 mxfp4}; do
    for m in exact tensor_core wgmma; do
      [ "$p/$m" = fp8_block128/tensor_core ] && continue
      log="$out/run_deepseek_${p}_${m}.log"
      build/gpu/tools/epmoe run --model deepseek-v3 --ranks "$gpus" --tokens 16 --rounds 2 \
        --precision "$p" --math "$m" --timeout-ms 60000 >"$log" 2>&1 || run_rc=1
      echo "deepseek-v3 (256 experts) $p staged $m: $(grep -E '^(PASS|FAIL)' "$log" | cut -c1-4)" \
        "($(grep -o 'drawn in [0-9.]* s' "$log"), $(grep -o 'layers created in [0-9.]* s' "$log"))"
    done
  done
  grep -E '^check:|resident|^rank|^[01] ' "$out/run_deepseek_bf16_exact.log"
fi

echo "== epmoe stress on the GPUs (no barrier, idle runs, mixed routing)"
stress_rc=0
build/gpu/tools/epmoe stress --executor cuda --ranks "$gpus" --shape tiny --rounds 3000 \
  --check-every 3 --min-zero-fraction 0.3 --seed 5 --math exact >"$out/stress_tiny.log" 2>&1 ||
  stress_rc=1
tail -14 "$out/stress_tiny.log"
# The reference check of a qwen3 round takes seconds on the host while the peer waits in its
# kernel, so this run gets a longer bounded-wait timeout than the default 10 s. The default math
# (wgmma).
build/gpu/tools/epmoe stress --executor cuda --ranks "$gpus" --model qwen3-30b-a3b \
  --max-tokens 64 --rounds 2000 --check-every 250 --min-zero-fraction 0.3 --seed 6 \
  --precision mxfp8 --timeout-ms 60000 >"$out/stress_qwen3.log" 2>&1 || stress_rc=1
tail -14 "$out/stress_qwen3.log"
build/gpu/tools/epmoe stress --executor cuda --ranks "$gpus" --shape tiny --rounds 3000 \
  --check-every 3 --min-zero-fraction 0.3 --seed 8 --math tensor_core --megakernel \
  >"$out/stress_tiny_persistent.log" 2>&1 || stress_rc=1
echo "persistent round: $(grep -E '^(PASS|FAIL)' "$out/stress_tiny_persistent.log" | head -1)"
# wgmma's E4M3 tile on the tiny shape (16 experts, top 4): in decode up to 4 ranks (4 W rows per
# expert at T = 16; more ranks give no bucket the tile, and --megakernel is refused)
e4m3_ranks=$((gpus < 4 ? gpus : 4))
build/gpu/tools/epmoe stress --executor cuda --ranks "$e4m3_ranks" --shape tiny --rounds 3000 \
  --check-every 3 --min-zero-fraction 0.3 --seed 9 --math wgmma --precision mxfp8 --megakernel \
  >"$out/stress_tiny_wgmma_persistent.log" 2>&1 || stress_rc=1
echo "wgmma persistent round (mxfp8): $(grep -E '^(PASS|FAIL)' "$out/stress_tiny_wgmma_persistent.log" | head -1)"
build/gpu/tools/epmoe stress --executor cuda --ranks "$e4m3_ranks" --shape tiny --rounds 3000 \
  --check-every 3 --min-zero-fraction 0.3 --seed 10 --math wgmma --precision mxfp4 --megakernel \
  --token-back dispatch_warps >"$out/stress_tiny_wgmma_persistent_staged_home.log" 2>&1 ||
  stress_rc=1
echo "wgmma persistent round (mxfp4, token_back=dispatch_warps): $(grep -E '^(PASS|FAIL)' "$out/stress_tiny_wgmma_persistent_staged_home.log" | head -1)"
build/gpu/tools/epmoe stress --executor cuda --ranks "$e4m3_ranks" --shape tiny --rounds 3000 \
  --check-every 3 --min-zero-fraction 0.3 --seed 11 --math wgmma --precision mxfp8 \
  --token-back dispatch_warps >"$out/stress_tiny_wgmma_home_kernel.log" 2>&1 || stress_rc=1
echo "wgmma chain (mxfp8, token_back=dispatch_warps): $(grep -E '^(PASS|FAIL)' "$out/stress_tiny_wgmma_home_kernel.log" | head -1)"

echo "== epmoe stress --fault on the GPUs (every survivor names the faulty rank, then reset())"
fault_rc=0
if [ "$gpus" -ge 2 ]; then
  for f in skip_launch_when_idle:1 stall:1:1500 round_jump:1; do
    build/gpu/tools/epmoe stress --executor cuda --ranks 2 --shape tiny --rounds 400 --seed 3 \
      --fault "$f" --fault-times 3 --timeout-ms 500 --watchdog-s 120 --math exact \
      >"$out/stress_fault_${f%%:*}.log" 2>&1 || fault_rc=1
    echo "$f: $(grep -E '^(PASS|FAIL)' "$out/stress_fault_${f%%:*}.log" | head -1)"
    build/gpu/tools/epmoe stress --executor cuda --ranks 2 --shape tiny --rounds 400 --seed 3 \
      --fault "$f" --fault-times 3 --timeout-ms 500 --watchdog-s 120 --math tensor_core \
      --megakernel >"$out/stress_fault_${f%%:*}_persistent.log" 2>&1 || fault_rc=1
    echo "$f, persistent round: $(grep -E '^(PASS|FAIL)' "$out/stress_fault_${f%%:*}_persistent.log" | head -1)"
    build/gpu/tools/epmoe stress --executor cuda --ranks 2 --shape tiny --rounds 400 --seed 3 \
      --fault "$f" --fault-times 3 --timeout-ms 500 --watchdog-s 120 --math wgmma \
      --precision mxfp8 --megakernel >"$out/stress_fault_${f%%:*}_wgmma_persistent.log" 2>&1 ||
      fault_rc=1
    echo "$f, wgmma persistent round: $(grep -E '^(PASS|FAIL)' "$out/stress_fault_${f%%:*}_wgmma_persistent.log" | head -1)"
  done
else
  echo "skipped: needs 2 GPUs"
fi

echo "== a killed rank process on the GPUs (issue 4: detection, then a rebuild from a fresh id)"
kill_rc=0
if [ "$gpus" -ge 2 ]; then
  build/gpu/tools/epmoe stress --processes --executor cuda --ranks 2 --shape tiny --rounds 600 \
    --check-every 1 --seed 9 --fault kill:1 --fault-times 2 --timeout-ms 500 --watchdog-s 240 --math exact \
    >"$out/stress_processes_kill.log" 2>&1 || kill_rc=1
  grep -E 'fault episode|rank [0-9]:|detected|survivors|PROBLEM|PASS|FAIL' \
    "$out/stress_processes_kill.log" | head -24
else
  echo "skipped: needs 2 GPUs"
fi

echo "== summary ($(( $(date +%s) - start )) s)"
grep -E '^\[ *(PASSED|FAILED|SKIPPED) *\] [0-9]+ tests?|tests? from .* ran' "$out/gpu_tests.log" | tail -4
echo "gpu tests rc=$tests_rc  epmoe run rc=$run_rc  epmoe stress rc=$stress_rc  faults rc=$fault_rc  killed rank rc=$kill_rc"
[ "$tests_rc" -eq 0 ] && [ "$run_rc" -eq 0 ] && [ "$stress_rc" -eq 0 ] && [ "$fault_rc" -eq 0 ] &&
  [ "$kill_rc" -eq 0 ]
