#!/usr/bin/env bash
# Per-kernel GPU time of epmoe's rounds, on a GPU machine: `epmoe bench` for one point under
# Nsight Compute (every launch's gpu__time_duration.sum, DRAM bytes and SM throughput, clocks left
# alone), then bench/kernel_times.py's table per round (kernel, launches, µs each, µs, DRAM GB/s
# over its own time, SM % of peak; their sum) beside the bench's own p50 from an unprofiled run of
# the same point. Where a round's time goes, kernel by kernel, with the launch gaps as the
# difference, and how close each weight-streaming GEMM comes to HBM's bandwidth.
#
#   bench/kernel_times.sh [--bin PATH] -- <epmoe bench arguments for one point>
#   e.g.  bench/kernel_times.sh -- --models qwen3-30b-a3b --worlds 1 --precisions mxfp8 \
#           --math wgmma --tokens 1
#
# --bin: an epmoe to profile (default build/gpu/tools/epmoe, the GPU tests' build; built as
# bench/ab.sh builds it when missing). The profiled run sets --rounds 3 --warmup 1 itself (leave
# them out). Writes $OUT (or bench/out)/kernel_times.{csv,log,txt}.
# --stalls REGEX: then why the kernels whose names match REGEX take their time: ncu's speed of
# light, scheduler, warp-state (stall reasons) and occupancy sections for two of their launches
# past the first four (the check's and warmup's), clocks left alone (ncu's default locks them to
# base, 1.41 GHz on H200), into kernel_stalls.txt, its key lines printed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on these machines
bin=build/gpu/tools/epmoe
stalls=""
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  case $1 in
    --bin) bin=$2; shift 2 ;;
    --stalls) stalls=$2; shift 2 ;;
    *) sed -n '2,19p' "$0"; exit 2 ;;
  esac
done
[ "${1:-}" = -- ] && shift
[ $# -gt 0 ] || { sed -n '2,19p' "$0"; exit 2; }
command -v ncu >/dev/null || { echo "no ncu (Nsight Compute) on this machine"; exit 1; }
out=${OUT:-bench/out}
mkdir -p "$out"
source scripts/gpu_env.sh || exit 1
if [ ! -x "$bin" ]; then
  bin=build/kernel-times/tools/epmoe
  cmake -S . -B build/kernel-times "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DEPMOE_BUILD_TESTS=OFF -DNCCL_ROOT="$nccl_root" "${extra[@]}" >"$out/kernel_times.log" 2>&1 &&
    cmake --build build/kernel-times -j "$(nproc)" --target epmoe_cli >>"$out/kernel_times.log" 2>&1 ||
    { tail -20 "$out/kernel_times.log"; echo "BUILD FAILED"; exit 1; }
fi
# The same point unprofiled first: its p50 is the round as it runs (launch gaps included).
"$bin" bench "$@" --no-measure 2>&1 | grep -E '^[a-z0-9][a-z0-9.:-]* +[0-9]+ +[a-z0-9_]+ +' |
  tee "$out/kernel_times.txt"
# Each kernel's time, DRAM bytes and SM throughput (ncu flushes the caches before each kernel, so
# DRAM bytes are what it reads cold: a GEMM's weights as in a round, a small kernel's inputs more
# than a round, where the previous kernel left them in L2).
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed
ncu --clock-control none --metrics "$metrics" --csv \
  "$bin" bench "$@" --no-measure --rounds 3 --warmup 1 >"$out/kernel_times.csv" \
  2>>"$out/kernel_times.log" || { tail -20 "$out/kernel_times.log"; echo "ncu failed"; exit 1; }
python3 bench/kernel_times.py "$out/kernel_times.csv" | tee -a "$out/kernel_times.txt"
if [ -n "$stalls" ]; then
  sections=(--section SpeedOfLight --section SchedulerStats --section WarpStateStats
            --section Occupancy)
  ncu --clock-control none "${sections[@]}" -k "regex:$stalls" --launch-skip 4 --launch-count 2 \
    -o "$out/kernel_stalls" -f "$bin" bench "$@" --no-measure --rounds 6 --warmup 1 \
    >>"$out/kernel_times.log" 2>&1 || { tail -20 "$out/kernel_times.log"; echo "ncu failed"; exit 1; }
  ncu -i "$out/kernel_stalls.ncu-rep" --page details --print-details all >"$out/kernel_stalls.txt" 2>&1
  grep -E '^  [a-zA-Z_].*\(|Duration|DRAM Throughput|SM Active Cycles|Issued Warp Per Scheduler|Eligible Warps|Warp Cycles Per Issued|Achieved Occupancy|^    Stall [A-Z]' \
    "$out/kernel_stalls.txt" | grep -vE ' 0(\.0+)?$' | head -80
fi
