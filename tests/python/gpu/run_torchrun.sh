#!/usr/bin/env bash
# The Python package on the GPUs: builds the module in place with CMake (no pip: the GPU machines
# have no network, and pip's build isolation would download) against torch's NCCL wheel, then runs
# tests/python/gpu twice (one process driving both GPUs, then torchrun with one process per GPU)
# and the examples under torchrun. test_gpu_hf_models.py (transformers' MoE blocks) runs at
# world 1 in the first run and at world 2 in the second; it needs transformers. Needs python3 with torch, nanobind, pytest and numpy; nvcc,
# cmake (ninja if present).
#   tests/python/gpu/run_torchrun.sh
# Logs go to $OUT (the device tool's folder) or build/pygpu-logs.
set -uo pipefail
cd "$(dirname "$0")/../../.."
export NCCL_NVLS_ENABLE=0  # never NVLink multicast on these machines
[ -d /usr/local/cuda/bin ] && export PATH=/usr/local/cuda/bin:$PATH
python=$(command -v "${PYTHON:-python3}")
build=${EPMOE_PY_BUILD_DIR:-build/pygpu}
out=${OUT:-build/pygpu-logs}
mkdir -p "$out"
export EPMOE_GPU_TEST_LOGS=$PWD/$out
start=$(date +%s)

nccl_root=${NCCL_ROOT:-$("$python" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)}
if [ -z "$nccl_root" ] || [ ! -f "$nccl_root/include/nccl.h" ]; then
  echo "torch's NCCL wheel not found ($python -c 'import nvidia.nccl'); set NCCL_ROOT"; exit 1
fi
generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
echo "== build (nvcc $(nvcc --version | grep -o 'release [0-9.]*'), NCCL $nccl_root, $python)"
if ! { cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
         -DEPMOE_BUILD_PYTHON=ON -DEPMOE_BUILD_TESTS=OFF -DEPMOE_BUILD_TOOLS=OFF \
         -DEPMOE_FAULT_INJECTION=ON -DPython_EXECUTABLE="$python" -DNCCL_ROOT="$nccl_root" \
         -DCMAKE_PROJECT_epmoe_INCLUDE=python/nccl_from_wheel.cmake &&
       cmake --build "$build" -j "$(nproc)"; } >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "built in $(( $(date +%s) - start )) s"
export PYTHONPATH=$PWD/$build/python${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L
ngpu=$(nvidia-smi -L | grep -c '^GPU'); [ "$ngpu" -gt 2 ] && ngpu=2

rc=0
echo "== pytest tests/python/gpu (one process, a thread per GPU)"
timeout 300 "$python" -m pytest -q -rs -p no:cacheprovider tests/python/gpu 2>&1 |
  tee "$out/pytest_threads.log" | tail -30
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

echo "== torchrun --nproc-per-node=${ngpu} -m pytest tests/python/gpu (a process per GPU)"
timeout 300 "$python" -m torch.distributed.run --standalone --nproc-per-node="$ngpu" \
  -m pytest -q -rs -p no:cacheprovider tests/python/gpu >"$out/pytest_torchrun.log" 2>&1
[ $? -eq 0 ] || rc=1
grep -E "passed|failed|error|FAILED|ERROR|SKIPPED|Error" "$out/pytest_torchrun.log" | head -60

echo "== torchrun examples/torch_ep_layer.py"
timeout 180 "$python" -m torch.distributed.run --standalone --nproc-per-node="$ngpu" \
  examples/torch_ep_layer.py --experts 16 --layers 2 --precision mxfp8 --max-tokens 32 --graph \
  >"$out/example.log" 2>&1
[ $? -eq 0 ] || rc=1
grep -E "step|Error|error" "$out/example.log" | head -30

echo "== torchrun examples/qwen3_moe_layer.py (a transformers Qwen3-MoE layer, ${ngpu} GPU(s))"
timeout 180 "$python" -m torch.distributed.run --standalone --nproc-per-node="$ngpu" \
  examples/qwen3_moe_layer.py --precision mxfp8 --graph >"$out/example_qwen3.log" 2>&1
[ $? -eq 0 ] || rc=1
grep -E "step|Error|error" "$out/example_qwen3.log" | head -30

for f in "$out"/watchdog_rank*.txt; do
  [ -s "$f" ] && { echo "== hang: $f"; head -60 "$f"; rc=1; }
done
echo "== done in $(( $(date +%s) - start )) s, rc=$rc"
exit $rc
