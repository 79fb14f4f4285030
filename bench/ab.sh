#!/usr/bin/env bash
# A/B of the working tree against an earlier commit on one GPU machine, in one device call: the
# same `epmoe bench` arguments run on both builds in alternating turns, so the difference between
# them is measured on the same GPU, not across calls. Two steps:
#
#   bench/ab.sh prepare BASE_REV     # here: the base commit's files into .bench_ab/base
#                                    # (git archive; ignored by git, so pass it to the device tool
#                                    # as carry, with .gpu_deps)
#   bench/ab.sh run [--turns N] [--tests] -- <epmoe bench arguments>   # on the GPU machine
#
# `run` builds `epmoe` from .bench_ab/base (build/ab-base) and from the working tree at the same
# time (Release; NCCL from the wheel and CLI11 / CUTLASS from .gpu_deps, as bench/run_all.sh does):
# in build/ab-new, or with `--tests` in the GPU tests' build/gpu after running them
# (EPMOE_GPU_TESTS_ONLY=1 tests/gpu/run.sh), then N turns (2) of base and new with the arguments
# after `--` (each writes --json <side>_<turn>.json and its table, printed as it lands so the
# call's output tail holds the numbers), and packs everything into one $OUT/ab.tgz (the device
# tool returns only a few files).
#   e.g.  bench/ab.sh run --tests -- --models qwen3-30b-a3b --worlds 1 --math tensor_core \
#           --precisions mxfp8,nvfp4 --tokens 1,16,64 --phases --rounds 30
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on these machines
dir=.bench_ab

if [ "${1:-}" = prepare ]; then
  rev=${2:?usage: bench/ab.sh prepare BASE_REV}
  git rev-parse --verify --quiet "$rev^{commit}" >/dev/null || { echo "no commit $rev"; exit 1; }
  grep -qxF "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >>.git/info/exclude
  rm -rf "$dir/base" && mkdir -p "$dir/base"
  git archive "$rev" | tar -x -C "$dir/base" || exit 1
  git rev-parse --short "$rev" >"$dir/base/.ab_rev"
  echo "base $(cat "$dir/base/.ab_rev") in $dir/base; carry: [\".gpu_deps\", \"$dir\"]"
  exit 0
fi

[ "${1:-}" = run ] || { sed -n '2,21p' "$0"; exit 2; }
shift
turns=2 tests=0
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  case $1 in
    --turns) turns=$2; shift 2 ;;
    --tests) tests=1; shift ;;
    *) echo "unknown option $1"; exit 2 ;;
  esac
done
[ "${1:-}" = -- ] && shift
[ -d "$dir/base" ] || { echo "no $dir/base: run 'bench/ab.sh prepare BASE_REV' here and carry $dir"; exit 1; }
out=${OUT:-bench/out}/ab
mkdir -p "$out"
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }
source scripts/gpu_env.sh || exit 1
jobs=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
pack() { (cd "$out/.." && tar czf ab.tgz ab && rm -rf ab); }  # one file comes back, not dozens
build() {  # source dir, build dir
  cmake -S "$1" -B "$2" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DEPMOE_BUILD_TESTS=OFF \
    -DNCCL_ROOT="$nccl_root" "${extra[@]}" && cmake --build "$2" -j "$jobs" --target epmoe_cli
}
# With --tests the working tree's epmoe comes from the GPU tests' own build (build/gpu, built by
# tests/gpu/run.sh): one library compile less, and the binary measured is the one tested.
new_dir=build/ab-new
[ "$tests" = 1 ] && new_dir=build/gpu
build "$dir/base" build/ab-base >"$out/build_base.log" 2>&1 &
base_pid=$!
tests_rc=0
if [ "$tests" = 1 ]; then
  EPMOE_GPU_TESTS_ONLY=1 OUT="$out/tests" tests/gpu/run.sh >"$out/tests.log" 2>&1
  tests_rc=$?
  echo "GPU tests rc=$tests_rc at $(elapsed) s: $(grep -E '^\[ *(PASSED|FAILED) *\]|BUILD FAILED' "$out/tests.log" | tr '\n' ' ')"
  grep -E '^\[ *FAILED *\]' "$out/tests.log" | head -20
  cmake --build build/gpu -j "$(nproc)" --target epmoe_cli >"$out/build_new.log" 2>&1
else
  build . build/ab-new >"$out/build_new.log" 2>&1
fi
new_rc=$?
wait "$base_pid"
base_rc=$?
if [ "$base_rc" -ne 0 ] || [ "$new_rc" -ne 0 ]; then
  tail -20 "$out/build_base.log" "$out/build_new.log"
  echo "BUILD FAILED (base rc=$base_rc, new rc=$new_rc)"
  pack
  exit 1
fi
echo "built both in $(elapsed) s (base $(cat "$dir/base/.ab_rev" 2>/dev/null || echo '?'))"
nvidia-smi -L

table() {  # the bench table's lines of one side's turn
  grep -E '^[a-z0-9][a-z0-9.:-]* +[0-9]+ +[a-z0-9_]+ +(staged|in_kernel_reduce) ' "$1" | cut -c1-220
}
# Each turn's table is printed as it lands, so a call cut short by its time limit still shows the
# turns that finished.
for turn in $(seq 1 "$turns"); do
  for side in base new; do
    bin=build/ab-base/tools/epmoe
    [ "$side" = new ] && bin=$new_dir/tools/epmoe
    $bin bench "$@" --json "$out/${side}_$turn.json" >"$out/${side}_$turn.txt" 2>&1 ||
      echo "$side turn $turn: epmoe bench rc=$?"
    echo "== $side, turn $turn (at $(elapsed) s)"
    table "$out/${side}_$turn.txt"
  done
done
pack
echo "== done at $(elapsed) s; every file in ${OUT:-bench/out}/ab.tgz"
exit "$tests_rc"
