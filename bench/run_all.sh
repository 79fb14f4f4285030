#!/usr/bin/env bash
# One command on a GPU machine: build `epmoe` (if needed), run `epmoe bench --json`, run the PyTorch
# EP baseline (tools/baselines/torch_ep.py) and FlashInfer's SM90 EP layer
# (tools/baselines/flashinfer_ep.py) under torchrun on the same shapes and T, draw the plots, and
# print the combined table last. Everything lands in $OUT (the device tool's folder) or bench/out:
# epmoe.json, torch_ep.json, flashinfer_ep.json, their .log files, latency_*.png, table.md.
#
#   bench/run_all.sh                           # the default sweep; the whole run stays < 10 min
#   bench/run_all.sh --rounds 20 --no-check    # extra arguments go to `epmoe bench`
#   bench/run_all.sh --math tensor_core        # one expert math only (half the layers to prepare)
#   EPMOE_BENCH_MODELS=qwen3-30b-a3b,deepseek-v3:16 bench/run_all.sh   # deepseek cut to 16 experts
#   EPMOE_BENCH_FLASHINFER=0 bench/run_all.sh  # without the FlashInfer baseline
#   EPMOE_BENCH_WHAT=gemm bench/run_all.sh     # the expert GEMMs alone: `epmoe bench gemm`, then
#                                              # tools/baselines/torch_gemm.py on the same sizes
#
# FlashInfer (flashinfer-python 0.6.18 + apache-tvm-ffi 0.1.15.post2, wheels in .gpu_deps/wheels,
# installed into build/flashinfer-site) compiles its kernels with nvcc at first use into
# build/flashinfer-jit, which a warm machine keeps between calls: on a cold cache run
#   python3 tools/baselines/flashinfer_ep.py --install && python3 -m torch.distributed.run \
#     --standalone --nproc-per-node=2 tools/baselines/flashinfer_ep.py --prepare-only
# in a call of its own first (same models and T as here), else the compile eats this script's time.
#
# Environment: EPMOE_BENCH_MODELS, EPMOE_BENCH_TOKENS (both lists shared by the two sides),
# EPMOE_BENCH_TOTAL_S (wall-time target of the whole script, build included; each side skips the
# points that no longer fit and says so), EPMOE_BENCH_TORCH_S (time kept for the baseline),
# TORCH_EP_ARGS (extra arguments of torch_ep.py), NCCL_ROOT, EPMOE_GPU_DEPS (as tests/gpu/run.sh);
# EPMOE_BENCH_FLASHINFER (auto: on when the wheels or an installed copy are there; 1: on, and a
# failure to install fails the script; 0: off), EPMOE_BENCH_FLASHINFER_S (time kept for it, 90),
# FLASHINFER_EP_ARGS (extra arguments of flashinfer_ep.py), FLASHINFER_EP_WHEELS
# ($EPMOE_GPU_DEPS/wheels), FLASHINFER_EP_SITE (build/flashinfer-site), FLASHINFER_EP_JIT
# (build/flashinfer-jit). EPMOE_BENCH_WHAT=gemm: `epmoe bench gemm` (arguments go to it) and the
# torch GEMM baseline instead of the layers, into gemm_epmoe.json, gemm_torch.json, their .log files,
# gemm_*.png and table.md; EPMOE_GEMM_MODELS, EPMOE_GEMM_ROWS set both sides' sweep,
# EPMOE_GEMM_TORCH_S (120) the time kept for torch's, TORCH_GEMM_ARGS its extra arguments.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# Never NVLink multicast on these machines (NCCL, PyTorch, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-bench/out}
mkdir -p "$out"
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }
total=${EPMOE_BENCH_TOTAL_S:-550}
torch_s=${EPMOE_BENCH_TORCH_S:-45}
models=${EPMOE_BENCH_MODELS:-qwen3-30b-a3b,deepseek-v3}
tokens=${EPMOE_BENCH_TOKENS:-0,1,16,64,128,512,2048,8192}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${gpus:-0}" -ge 1 ] || { echo "no GPU visible (nvidia-smi -L)"; exit 1; }
deps=${EPMOE_GPU_DEPS:-.gpu_deps}

# ---- FlashInfer's baseline: on, off, or on where its wheels (or an installed copy) are here
fi_wheels=${FLASHINFER_EP_WHEELS:-$deps/wheels}
fi_site=${FLASHINFER_EP_SITE:-build/flashinfer-site}
fi_jit=${FLASHINFER_EP_JIT:-build/flashinfer-jit}
fi_on=${EPMOE_BENCH_FLASHINFER:-auto}
what=${EPMOE_BENCH_WHAT:-layer}
[ "$what" = gemm ] && fi_on=0
if [ "$fi_on" = auto ]; then
  fi_on=0
  compgen -G "$fi_wheels/flashinfer_python-*.whl" >/dev/null && fi_on=1
  [ -d "$fi_site/flashinfer" ] && fi_on=1
  [ "$fi_on" = 1 ] || echo "FlashInfer baseline off: no wheels in $fi_wheels (EPMOE_BENCH_FLASHINFER)"
fi
fi_s=0
[ "$fi_on" = 1 ] && fi_s=${EPMOE_BENCH_FLASHINFER_S:-90}

# ---- build: as tests/gpu/run.sh does (NCCL from the wheel, CLI11 carried in .gpu_deps), but only
# the `epmoe` tool, without tests or fault switches.
source scripts/gpu_env.sh || exit 1
bin=build/bench-gpu/tools/epmoe
echo "== build (nvcc $(nvcc --version | grep -o 'release [0-9.]*'), NCCL from $nccl_root)"
mkdir -p build
if ! { cmake -S . -B build/bench-gpu "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DEPMOE_BUILD_TESTS=OFF -DNCCL_ROOT="$nccl_root" "${extra[@]}" &&
  cmake --build build/bench-gpu -j "$(nproc)" --target epmoe_cli; } >build/bench-gpu.log 2>&1; then
  tail -40 build/bench-gpu.log
  cp build/bench-gpu.log "$out/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "built in $(elapsed) s"
nvidia-smi -L

# ---- the expert GEMMs alone: `epmoe bench gemm`, then torch's on the same sizes, table last
if [ "$what" = gemm ]; then
  gmodels=${EPMOE_GEMM_MODELS:-qwen3-30b-a3b,deepseek-v3,gpt-oss-120b,mixtral-8x7b}
  grows=${EPMOE_GEMM_ROWS:-1,4,16,64,256,1024,4096}
  gbudget=$((total - $(elapsed) - ${EPMOE_GEMM_TORCH_S:-120}))
  [ "$gbudget" -lt 60 ] && gbudget=60
  echo "== epmoe bench gemm (budget ${gbudget} s): --models $gmodels --rows $grows $*"
  "$bin" bench gemm --models "$gmodels" --rows "$grows" --budget-s "$gbudget" \
    --json "$out/gemm_epmoe.json" "$@" 2>&1 | tee "$out/gemm_epmoe.log"
  gemm_rc=${PIPESTATUS[0]}
  tbudget=$((total - $(elapsed) - 15))
  [ "$tbudget" -lt 30 ] && tbudget=30
  echo "== torch GEMM baseline (budget ${tbudget} s)"
  ceilings=()
  [ -f "$out/gemm_epmoe.json" ] && ceilings=(--ceilings-from "$out/gemm_epmoe.json")
  # shellcheck disable=SC2086  # TORCH_GEMM_ARGS is a list of arguments
  PYTHONUNBUFFERED=1 python3 tools/baselines/torch_gemm.py --models "$gmodels" --rows "$grows" \
    --budget-s "$tbudget" "${ceilings[@]}" --json "$out/gemm_torch.json" ${TORCH_GEMM_ARGS:-} \
    2>&1 | tee "$out/gemm_torch.log"
  torch_rc=${PIPESTATUS[0]}
  jsons=()
  for f in "$out/gemm_epmoe.json" "$out/gemm_torch.json"; do [ -f "$f" ] && jsons+=("$f"); done
  plot_rc=1
  if [ "${#jsons[@]}" -gt 0 ]; then
    python3 bench/plot.py "${jsons[@]}" --out "$out" 2>&1 | tail -4
    echo "== summary: $(elapsed) s; epmoe bench gemm rc=$gemm_rc, torch GEMM baseline rc=$torch_rc"
    echo "== GEMM table (p50 us)"
    python3 bench/plot.py "${jsons[@]}" --out "$out" --table --no-plots
    plot_rc=$?
  fi
  [ "$gemm_rc" -eq 0 ] && [ "$torch_rc" -eq 0 ] && [ "$plot_rc" -eq 0 ]
  exit
fi

# ---- epmoe bench
budget=$((total - $(elapsed) - torch_s - fi_s))
[ "$budget" -lt 60 ] && budget=60
echo "== epmoe bench (budget ${budget} s): --models $models --tokens $tokens $*"
"$bin" bench --models "$models" --tokens "$tokens" --budget-s "$budget" \
  --json "$out/epmoe.json" "$@" 2>&1 | tee "$out/epmoe_bench.log"
bench_rc=${PIPESTATUS[0]}

# ---- the PyTorch baseline, one process per GPU
tbudget=$((total - $(elapsed) - fi_s - 25))
[ "$tbudget" -lt 30 ] && tbudget=30
echo "== torch EP baseline (torchrun, $gpus processes, budget ${tbudget} s)"
ceilings=()
[ -f "$out/epmoe.json" ] && ceilings=(--ceilings-from "$out/epmoe.json")
# shellcheck disable=SC2086  # TORCH_EP_ARGS is a list of arguments
PYTHONUNBUFFERED=1 python3 -m torch.distributed.run --standalone --nproc-per-node="$gpus" \
  tools/baselines/torch_ep.py --models "$models" --tokens "$tokens" --budget-s "$tbudget" \
  "${ceilings[@]}" --json "$out/torch_ep.json" ${TORCH_EP_ARGS:-} 2>&1 | tee "$out/torch_ep.log"
torch_rc=${PIPESTATUS[0]}

# ---- FlashInfer's SM90 EP layer, one process per GPU (eager and CUDA graph)
fi_rc=0
if [ "$fi_on" = 1 ]; then
  python3 tools/baselines/flashinfer_ep.py --install --wheels "$fi_wheels" --site "$fi_site" \
    2>&1 | tee "$out/flashinfer_ep.log"
  fi_rc=${PIPESTATUS[0]}
  if [ "$fi_rc" -eq 0 ]; then
    fbudget=$((total - $(elapsed) - 20))
    [ "$fbudget" -lt 30 ] && fbudget=30
    cold=""
    compgen -G "$fi_jit/.cache/flashinfer/*/*/cached_ops/sm90_push_fp8_moe_gemm_*/*.so" \
      >/dev/null || cold="; JIT cache $fi_jit cold: nvcc compiles for minutes first (--prepare-only)"
    echo "== FlashInfer SM90 EP baseline (torchrun, $gpus processes, budget ${fbudget} s$cold)"
    # shellcheck disable=SC2086  # FLASHINFER_EP_ARGS is a list of arguments
    PYTHONUNBUFFERED=1 python3 -m torch.distributed.run --standalone --nproc-per-node="$gpus" \
      tools/baselines/flashinfer_ep.py --models "$models" --tokens "$tokens" --budget-s "$fbudget" \
      --hard-limit-s $((fbudget + 30)) --site "$fi_site" --jit-cache "$fi_jit" "${ceilings[@]}" \
      --json "$out/flashinfer_ep.json" ${FLASHINFER_EP_ARGS:-} 2>&1 | tee -a "$out/flashinfer_ep.log"
    fi_rc=${PIPESTATUS[0]}
  elif [ "${EPMOE_BENCH_FLASHINFER:-auto}" = auto ]; then
    echo "FlashInfer baseline skipped: its wheels did not install (rc $fi_rc)"
    fi_rc=0
  fi
fi

# ---- plots, then the combined table last
jsons=()
for f in "$out/epmoe.json" "$out/torch_ep.json" "$out/flashinfer_ep.json"; do
  [ -f "$f" ] && jsons+=("$f")
done
plot_rc=1
if [ "${#jsons[@]}" -gt 0 ]; then
  python3 bench/plot.py "${jsons[@]}" --out "$out" 2>&1 | tail -4
  echo "== summary: $(elapsed) s; epmoe bench rc=$bench_rc, torch baseline rc=$torch_rc," \
    "FlashInfer baseline rc=$fi_rc"
  echo "== combined table (p50 ms)"
  python3 bench/plot.py "${jsons[@]}" --out "$out" --table --no-plots
  plot_rc=$?
fi
[ "$bench_rc" -eq 0 ] && [ "$torch_rc" -eq 0 ] && [ "$fi_rc" -eq 0 ] && [ "$plot_rc" -eq 0 ]
