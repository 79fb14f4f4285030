#!/usr/bin/env bash
# A/B of the working tree against earlier commits on one GPU machine, in one device call: the
# same `epmoe bench` arguments run on every build in alternating turns, so the differences between
# them are measured on the same GPU, not across calls. Two steps:
#
#   bench/ab.sh prepare BASE_REV [REV ...]   # here: each commit's files into .bench_ab/<side>
#                                            # (git archive; sides base, alt1, alt2, ...; ignored
#                                            # by git, so pass it to the device tool as carry,
#                                            # with .gpu_deps)
#   bench/ab.sh run [--turns N] [--tests | --suite] [--guard FILTER [--keep-sides]] \
#     [--kernel-times "ARGS"] \
#     [--new-only "ARGS"] -- <epmoe bench arguments>                    # on the GPU machine
#
# `run` builds `epmoe` from each prepared side (build/ab-<side>) and from the working tree at the
# same time (Release; NCCL from the wheel and CLI11 / CUTLASS from .gpu_deps, as bench/run_all.sh
# does): in build/ab-new, with `--tests` while the GPU tests build and run in build/gpu
# (EPMOE_GPU_TESTS_ONLY=1 tests/gpu/run.sh; `--suite`: the whole tests/gpu/run.sh, epmoe run and
# stress too, under the caller's environment, e.g. EPMOE_GPU_RUN_DEEPSEEK=0), then N turns (2) of
# every side and new with the arguments after `--` (each writes --json <side>_<turn>.json and its
# table, printed as it lands so the call's output tail holds the numbers), and packs everything
# into one $OUT/ab.tgz (the device tool returns only a few files). Several sides measure several
# candidate commits against each other in one call; only the working tree is tested. Each side
# adds ~6 MB to the carry (with .gpu_deps' 31 MB, three sides fit the device tool's 64 MiB).
# --guard FILTER: first build the GPU tests (the sides build meanwhile) and run gpu_layer_test
# --gtest_filter=FILTER on the working tree under a 120 s kill (the tests of the kernels the change
# touches), and stop there if they fail or hang: a broken kernel costs ~2 minutes of device time,
# not the whole call. With --keep-sides, a failed guard drops only the working tree: the prepared
# sides are still measured against each other (one call compares committed candidates and tries a
# new kernel).
# --kernel-times "ARGS" (repeatable, a point each): after the turns, bench/kernel_times.sh ARGS on
# every measured build (new, the alt sides, base; ARGS: its own, "[--stalls REGEX] -- <epmoe
# bench arguments for one point>"), into the same ab.tgz (kernel_times_<side>_<n>/).
# --new-only "ARGS": after the turns, `epmoe bench ARGS` on the new build alone (options the sides
# do not have, e.g. a path they lack), its JSON and table into the same ab.tgz.
#   e.g.  bench/ab.sh run --tests -- --models qwen3-30b-a3b --worlds 1 --math tensor_core \
#           --precisions mxfp8,nvfp4 --tokens 1,16,64 --phases --rounds 30
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on these machines
dir=.bench_ab

if [ "${1:-}" = prepare ]; then
  shift
  [ $# -ge 1 ] || { echo "usage: bench/ab.sh prepare BASE_REV [REV ...]"; exit 2; }
  for rev in "$@"; do
    git rev-parse --verify --quiet "$rev^{commit}" >/dev/null || { echo "no commit $rev"; exit 1; }
  done
  grep -qxF "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >>.git/info/exclude
  rm -rf "$dir" && mkdir -p "$dir"
  n=0
  for rev in "$@"; do
    side=base
    [ "$n" -gt 0 ] && side=alt$n
    mkdir -p "$dir/$side"
    git archive "$rev" | tar -x -C "$dir/$side" || exit 1
    git rev-parse --short "$rev" >"$dir/$side/.ab_rev"
    echo "$side $(cat "$dir/$side/.ab_rev") in $dir/$side"
    n=$((n + 1))
  done
  echo "carry: [\".gpu_deps\", \"$dir\"]"
  exit 0
fi

[ "${1:-}" = run ] || { sed -n '2,35p' "$0"; exit 2; }
shift
turns=2 tests=0 guard="" keep_sides=0 kernel_times=() new_only=""
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  case $1 in
    --turns) turns=$2; shift 2 ;;
    --tests) tests=1; shift ;;
    --suite) tests=2; shift ;;
    --guard) guard=$2; shift 2 ;;
    --keep-sides) keep_sides=1; shift ;;
    --kernel-times) kernel_times+=("$2"); shift 2 ;;
    --new-only) new_only=$2; shift 2 ;;
    *) echo "unknown option $1"; exit 2 ;;
  esac
done
[ "${1:-}" = -- ] && shift
[ -d "$dir/base" ] || { echo "no $dir/base: run 'bench/ab.sh prepare BASE_REV' here and carry $dir"; exit 1; }
sides=(base)
for d in "$dir"/alt*; do [ -d "$d" ] && sides+=("$(basename "$d")"); done
out=${OUT:-bench/out}/ab
mkdir -p "$out"
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }
source scripts/gpu_env.sh || exit 1
jobs=$(( $(nproc) / (${#sides[@]} + 1) > 0 ? $(nproc) / (${#sides[@]} + 1) : 1 ))  # (sides + new)
pack() { (cd "$out/.." && tar czf ab.tgz ab && rm -rf ab); }  # one file comes back, not dozens
build() {  # source dir, build dir
  cmake -S "$1" -B "$2" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DEPMOE_BUILD_TESTS=OFF \
    -DNCCL_ROOT="$nccl_root" "${extra[@]}" && cmake --build "$2" -j "$jobs" --target epmoe_cli
}
# Every measured binary is built the same way (Release, no tests), the working tree's too: the GPU
# tests' build (build/gpu, --tests) compiles the fault switches in (EPMOE_FAULT_INJECTION follows
# EPMOE_BUILD_TESTS), which cost every kernel of the chain a little (session 25 measured mxfp4 at
# T = 1 2-4 us slower from that build than from the same code built as the sides are).
# The sides build from the start, beside the guard's and the tests' build (the CPUs are otherwise
# idle while the GPU waits); each in its own process group (set -m), so a failed guard stops them.
declare -A pids
measured=("${sides[@]}" new)  # the builds measured in the turns (--keep-sides may drop new)
set -m
for side in "${sides[@]}" new; do
  src=$dir/$side
  [ "$side" = new ] && src=.
  build "$src" "build/ab-$side" >"$out/build_$side.log" 2>&1 &
  pids[$side]=$!
done
set +m
if [ -n "$guard" ]; then
  EPMOE_GPU_FILTER=NONE EPMOE_GPU_TESTS_ONLY=1 OUT="$out/guard" tests/gpu/run.sh \
    >"$out/guard_build.log" 2>&1
  timeout -s KILL 120 build/gpu/tests/gpu/gpu_layer_test --gtest_filter="$guard" \
    >"$out/guard.log" 2>&1
  guard_rc=$?
  echo "guard ($guard) rc=$guard_rc at $(elapsed) s: $(grep -hE '^\[ *(PASSED|FAILED) *\]|BUILD FAILED' \
    "$out/guard.log" "$out/guard_build.log" 2>/dev/null | tr '\n' ' ')"
  if [ "$guard_rc" != 0 ]; then
    grep -hE '^\[ *FAILED *\]|Failure' "$out/guard.log" | head -20
    tail -5 "$out/guard_build.log"
    if [ "$keep_sides" = 1 ] && [ "${#sides[@]}" -gt 1 ]; then
      echo "guard failed: the working tree is dropped, the sides measured (--keep-sides)"
      kill -- "-${pids[new]}" 2>/dev/null
      unset 'pids[new]'
      measured=("${sides[@]}")
      tests=0
    else
      for side in "${!pids[@]}"; do kill -- "-${pids[$side]}" 2>/dev/null; done
      pack
      exit 1
    fi
  fi
fi
tests_rc=0
if [ "$tests" != 0 ]; then
  only=1
  [ "$tests" = 2 ] && only=""  # the whole suite
  EPMOE_GPU_TESTS_ONLY=$only OUT="$out/tests" tests/gpu/run.sh >"$out/tests.log" 2>&1
  tests_rc=$?
  # (gtest's summary is in the tests' own log; run.sh's in tests.log)
  logs=("$out/tests.log" "$out/tests/gpu_tests.log")
  echo "GPU tests rc=$tests_rc at $(elapsed) s: $(grep -hE '^\[ *(PASSED|FAILED) *\]|BUILD FAILED' "${logs[@]}" 2>/dev/null | tr '\n' ' ')"
  grep -hE '^\[ *FAILED *\]' "${logs[@]}" 2>/dev/null | head -20
  [ "$tests" = 2 ] && grep -E ': (PASS|FAIL)|^(PASS|FAIL)|rc=' "$out/tests.log" | grep -v ': PASS$' | head -40
fi
failed=""
for side in "${measured[@]}"; do
  wait "${pids[$side]}" || failed="$failed $side"
done
if [ -n "$failed" ]; then
  for side in $failed; do tail -20 "$out/build_$side.log"; done
  echo "BUILD FAILED:$failed"
  pack
  exit 1
fi
revs=""
for side in "${sides[@]}"; do revs="$revs $side $(cat "$dir/$side/.ab_rev" 2>/dev/null || echo '?')"; done
echo "built every side in $(elapsed) s:$revs"
nvidia-smi -L

table() {  # the bench table's lines of one side's turn
  grep -E '^[a-z0-9][a-z0-9.:-]* +[0-9]+ +[a-z0-9_]+ +(staged|in_kernel_reduce) ' "$1" | cut -c1-220
}
# Each turn's table is printed as it lands, so a call cut short by its time limit still shows the
# turns that finished.
for turn in $(seq 1 "$turns"); do
  for side in "${measured[@]}"; do
    bin=build/ab-$side/tools/epmoe
    $bin bench "$@" --json "$out/${side}_$turn.json" >"$out/${side}_$turn.txt" 2>&1 ||
      echo "$side turn $turn: epmoe bench rc=$?"
    echo "== $side, turn $turn (at $(elapsed) s)"
    table "$out/${side}_$turn.txt"
  done
done
has_new=0
[[ " ${measured[*]} " == *" new "* ]] && has_new=1
if [ -n "$new_only" ] && [ "$has_new" = 1 ]; then
  # shellcheck disable=SC2086  # ARGS is a list of epmoe bench arguments
  build/ab-new/tools/epmoe bench $new_only --json "$out/new_only.json" >"$out/new_only.txt" 2>&1 ||
    echo "new only: epmoe bench rc=$?"
  echo "== new only (at $(elapsed) s)"
  table "$out/new_only.txt"
fi
for n in "${!kernel_times[@]}"; do
  for side in "${measured[@]}"; do
    # shellcheck disable=SC2086  # ARGS is a list of kernel_times.sh arguments
    OUT="$out/kernel_times_${side}_$n" bench/kernel_times.sh --bin "build/ab-$side/tools/epmoe" \
      ${kernel_times[$n]} >"$out/kernel_times_${side}_$n.log" 2>&1
    echo "== kernel times $n (${kernel_times[$n]##*-- }), $side (rc=$?):"
    tail -16 "$out/kernel_times_${side}_$n/kernel_times.txt" 2>/dev/null
  done
done
# The sides side by side (p50 per turn, then the phases), into ab.tgz and the call's output.
python3 bench/ab_table.py "$out" >"$out/table.md" 2>&1 && cat "$out/table.md"
pack
echo "== done at $(elapsed) s; every file in ${OUT:-bench/out}/ab.tgz"
exit "$tests_rc"
