# Sourced by the GPU scripts that build epmoe themselves (tests/gpu/run.sh, bench/run_all.sh,
# bench/ab.sh): NCCL from the wheel torch uses (its headers and library must match: the system's
# is another version), CLI11 and CUTLASS headers from $EPMOE_GPU_DEPS (.gpu_deps, carried to the
# GPU machine), Ninja when present. Sets deps, nccl_root, LD_LIBRARY_PATH, extra (cmake arguments)
# and generator; returns 1, saying why, when the NCCL wheel is missing.
deps=${EPMOE_GPU_DEPS:-.gpu_deps}
nccl_root=${NCCL_ROOT:-$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)}
if [ -z "$nccl_root" ] || [ ! -f "$nccl_root/include/nccl.h" ]; then
  echo "NCCL wheel not found (python3 -c 'import nvidia.nccl'); set NCCL_ROOT"
  return 1
fi
export LD_LIBRARY_PATH=$nccl_root/lib:${LD_LIBRARY_PATH:-}
extra=()
[ -d "$deps/cli11" ] && extra+=(-DCLI11_ROOT="$PWD/$deps/cli11")
[ -d "$deps/cutlass/include" ] && extra+=(-DEPMOE_CUTLASS_INCLUDE="$PWD/$deps/cutlass/include")
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
return 0
