// What the wgmma backend's CUTLASS translation units (grouped_gemm.cu, grouped_gemm_glu.cu,
// grouped_gemm_fp8.cu) share around their kernels: one device allocation carved in order, the
// per-group strides of K-major operands, the hardware info and CUTLASS status checks. Includes
// CUTLASS: only those files include it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/cuda_check.hpp"
#include "cuda/experts/wgmma/grouped_gemm.hpp"
#include "cuda/kernels.hpp"  // programmatic_launch
#include "cuda/pdl.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"  // Sm90EVT and its nodes
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/kernel_hardware_info.h"

namespace epmoe::cuda::experts::wgmma::parts {

// Programmatic dependent launch for CUTLASS's kernels (docs/design.md §4). The SM90 pointer-array
// GEMMs issue no griddepcontrol.wait, so launched with the PDL attribute as they are they could
// read the per-expert row counts before the previous kernel wrote them. This kernel is CUTLASS's
// with that wait first: every thread waits until the previous kernel has completed and its memory
// is visible, before any global access; what PDL buys is the launch and CTA rasterization
// overlapping the previous kernel's tail. The adapter launches it with the PDL attribute
// (run(stream, nullptr, programmatic_launch()): kernels.hpp).
template <class Kernel>
struct WaitsForPreviousKernel : Kernel {
  CUTLASS_DEVICE void operator()(typename Kernel::Params const& params, char* smem) {
    wait_for_previous_kernel();
    Kernel::operator()(params, smem);
  }
};
template <class Kernel>
using PdlGemm = cutlass::gemm::device::GemmUniversalAdapter<WaitsForPreviousKernel<Kernel>>;

// (M, N, K) per group, M read on the device each round.
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
static_assert(sizeof(ProblemShape::UnderlyingProblemShape) == sizeof(GemmProblem),
              "GemmProblem mirrors CUTLASS's Shape<int, int, int>");

// GemmOutput::fp32_sums, both kernels' epilogue: D = the fp32 accumulators, row-major [M, N],
// stored with TMA (16-byte rows); no C operand. The scales, biases and activation run after it
// (steps.cu).
using LayoutD = cutlass::layout::RowMajor;
inline constexpr int kAlignD = 4;
template <class TileShape, class ClusterShape>
using Fp32Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, float,
    LayoutD*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<float, float, void>>::CollectiveOp;

// GemmOutput::bf16_rows: D = bf16(acc + bias[n]) with TMA (16-byte rows of bf16), a visitor tree
// of CUTLASS's nodes: the accumulator plus the group's bias row (Sm90RowBroadcast over an array
// of per-group pointers reads bias[l], l the group), summed in fp32 and rounded to nearest even
// once, as steps.cuh's send_rows_home rounds math::biased(sum, b2). No C operand.
inline constexpr int kAlignD16 = 8;
template <class TileShape>
using PlusBiasRow = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, cutlass::bfloat16_t, float,
                                           cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90AccFetch,
    cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float*, float,
                                                cute::Stride<cute::_0, cute::_1, std::int64_t>>>;
template <class TileShape, class ClusterShape>
using Bf16RowsEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD16,
    cutlass::bfloat16_t, LayoutD*, kAlignD16,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, PlusBiasRow<TileShape>>::CollectiveOp;

template <GemmOutput kOutput, class TileShape, class ClusterShape>
using EpilogueOf =
    std::conditional_t<kOutput == GemmOutput::bf16_rows, Bf16RowsEpilogue<TileShape, ClusterShape>,
                       Fp32Epilogue<TileShape, ClusterShape>>;

// The epilogue's arguments over a GEMM's arrays (GroupedGemmArrays, Fp8GroupedGemmArrays): D is
// `d` (fp32_sums), or `d16` with each group's `bias` row (bf16_rows); D's per-group strides at
// `stride_d`.
template <class Epilogue, class Arrays>
typename Epilogue::Arguments epilogue_arguments(const Arrays& arrays, void* stride_d) {
  using StrideD = typename Epilogue::StrideD;  // a pointer: one stride per group
  auto* strides = reinterpret_cast<StrideD>(stride_d);
  typename Epilogue::FusionCallbacks::Arguments fusion{};
  if constexpr (std::is_same_v<typename Epilogue::ElementD, float>) {
    fusion.alpha = 1.0f;
    fusion.beta = 0.0f;
    return {fusion, nullptr, strides, arrays.d, strides};
  } else {
    fusion = {{}, {arrays.bias, 0.0f, {}}, {}};  // the accumulator, the bias row, their sum
    return {fusion, nullptr, strides, reinterpret_cast<typename Epilogue::ElementD**>(arrays.d16),
            strides};
  }
}

// An epilogue of ours in CUTLASS's SM90 pointer-array kernels (cooperative or ping-pong), where
// CUTLASS's own map one accumulator to one output element (its visitor trees too): the interface
// of CUTLASS's DefaultEpilogueArray (no shared memory, stores from registers, no workspace;
// Arguments = Params = `Args`), wrapped by CUTLASS's adapter for warp-specialized kernels
// (NoSmemEpilogueOf). `Derived` adds operator() and, where it checks its arguments, can_implement.
template <class Args>
class NoSmemEpilogue {
 public:
  using StrideUnused = cute::Stride<std::int64_t, cute::_1, cute::_0>;  // the kernel's typedefs
  using DispatchPolicy = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using EpilogueSchedule = DispatchPolicy;
  using ThreadEpilogueOp =
      cutlass::epilogue::thread::LinearCombination<cutlass::bfloat16_t, 1, float, float>;
  using ElementOutput = cutlass::bfloat16_t;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using ElementC = cutlass::bfloat16_t;
  using StrideC = StrideUnused*;
  using InternalStrideC = StrideUnused;
  using ElementD = cutlass::bfloat16_t;
  using StrideD = StrideUnused*;
  using InternalStrideD = StrideUnused;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;
  using Arguments = Args;
  using Params = Args;

  template <class Problems>
  static constexpr Params to_underlying_arguments(Problems const&, Arguments const& args, void*) {
    return args;
  }
  template <class Problems>
  static std::size_t get_workspace_size(Problems const&, Arguments const&, int) {
    return 0;
  }
  template <class Problems>
  static cutlass::Status initialize_workspace(Problems const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class Problems>
  static bool can_implement(Problems const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE explicit NoSmemEpilogue(Params const& params) : params_(params) {}

 protected:
  Params params_;
};
template <class Epilogue>
using NoSmemEpilogueOf =
    cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Epilogue>;

// Where a thread's accumulators sit (SM90 GMMA, a 64 x N atom per consumer warpgroup): thread t of
// a warpgroup holds rows r = 16 (t / 32 % 4) + t % 32 / 4 and r + 8, and of each 8-column group k
// the columns 8k + 2 (t % 4) and 8k + 2 (t % 4) + 1; fragment index i = col parity + 2 row half +
// 4 k. So a row's columns are spread over the 4 threads of a quad (kQuad).
inline constexpr int kQuad = 4;
inline constexpr int kGroupCols = 8;
struct AccumulatorPlace {
  int quad_rank;  // t % 4
  int row0;       // of the tile's problem (row half 0; half 1 is row0 + 8)
  int col0;       // of the tile's problem, column group 0, even column
};
// The place from CuTe's partition of the tile, checked against the layout above at the fragment's
// two ends: a trap if CUTLASS ever lays its accumulators out otherwise.
template <int kValues, class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL,
          class TiledMma>
CUTLASS_DEVICE AccumulatorPlace accumulator_place(ProblemShapeMNKL problem_mnkl,
                                                  BlockShapeMNK blk_shape, BlockCoordMNKL blk_coord,
                                                  TiledMma tiled_mma, int thread_idx) {
  using namespace cute;
  constexpr int kGroups = kValues / 4;
  const auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
  const Tensor coords = thr_mma.partition_C(
      local_tile(make_identity_tensor(make_shape(get<0>(problem_mnkl), get<1>(problem_mnkl))),
                 take<0, 2>(blk_shape), make_coord(get<0>(blk_coord), get<1>(blk_coord))));
  const int q = thread_idx % kQuad;
  const int row0 = get<0>(coords(0));
  const int col0 = static_cast<int>(get<1>(blk_coord)) * size<1>(blk_shape) + 2 * q;
  if (get<1>(coords(0)) != col0 || get<1>(coords(1)) != col0 + 1 ||
      get<0>(coords(kValues - 1)) != row0 + 8 ||
      get<1>(coords(kValues - 1)) != col0 + kGroupCols * (kGroups - 1) + 1)
    __trap();  // CUTLASS's accumulator layout is not the one these epilogues were written for
  return AccumulatorPlace{q, row0, col0};
}

// Offsets of 256-byte aligned slices of one allocation, taken in order.
struct Carve {
  std::size_t end = 0;
  std::size_t take(std::size_t bytes) {
    const std::size_t offset = (end + 255) / 256 * 256;
    end = offset + bytes;
    return offset;
  }
};

// GemmOutput's arrays in a GEMM's allocation, taken after its other slices: d16 and bias
// ([groups] pointers each, written by each round's plan) and the zero bias row ([n] floats).
struct OutputSlices {
  std::size_t d16 = 0, bias = 0, zero_bias = 0;
  OutputSlices(Carve& carve, std::size_t groups, int n)
      : d16(carve.take(groups * sizeof(void*))),
        bias(carve.take(groups * sizeof(void*))),
        zero_bias(carve.take(static_cast<std::size_t>(n) * sizeof(float))) {}
  // Points `arrays` at the slices of `memory` and zeroes the zero bias row.
  template <class Arrays>
  void place(std::uint8_t* memory, int n, Arrays* arrays) const {
    arrays->d16 = reinterpret_cast<std::uint16_t**>(memory + d16);
    arrays->bias = reinterpret_cast<const float**>(memory + bias);
    arrays->zero_bias = reinterpret_cast<const float*>(memory + zero_bias);
    EPMOE_CUDA_CHECK(
        cudaMemset(memory + zero_bias, 0, static_cast<std::size_t>(n) * sizeof(float)));
  }
};

inline void check(cutlass::Status status, const char* gemm, const char* what) {
  if (status != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string(gemm) + ": " + what + ": " +
                             cutlassGetStatusString(status));
}

inline cutlass::KernelHardwareInfo hardware(int device, int sm_count) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  return hw;
}

// The offsets, in one allocation, of what a pointer-array kernel with an epilogue of ours reads
// beside its epilogue's own arrays: the problems, A and B pointers, their strides and CUTLASS's
// workspace (OwnEpilogueAllocation::take, then the epilogue's, then finish).
struct OwnEpilogueAllocation {
  Carve carve;
  std::size_t problems = 0, a = 0, b = 0, stride_a = 0, stride_b = 0, workspace = 0;
  template <class K>
  void take_operands(std::size_t groups) {
    problems = carve.take(groups * sizeof(GemmProblem));
    a = carve.take(groups * sizeof(void*));
    b = carve.take(groups * sizeof(void*));
    stride_a = carve.take(groups * sizeof(typename K::GemmKernel::InternalStrideA));
    stride_b = carve.take(groups * sizeof(typename K::GemmKernel::InternalStrideB));
  }
  // CUTLASS's workspace for kernel K (its size does not depend on the pointers), then the memory.
  template <class K>
  std::uint8_t* finish(int groups, const cutlass::KernelHardwareInfo& hw, std::size_t* bytes) {
    workspace = carve.take(K::Gemm::get_workspace_size(
        typename K::Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                    {groups, nullptr, nullptr},
                                    {nullptr, nullptr, nullptr, nullptr},
                                    {},
                                    hw}));
    std::uint8_t* memory = nullptr;
    EPMOE_CUDA_CHECK(cudaMalloc(&memory, carve.end));
    EPMOE_CUDA_CHECK(cudaMemset(memory + problems, 0, groups * sizeof(GemmProblem)));
    *bytes = carve.end;
    return memory;
  }
  // Kernel K's `gemm` initialized over the allocation `m` with its epilogue's arguments (the
  // strides of K-long rows uploaded first).
  template <class K, class Gemm, class EpilogueArguments>
  void initialize(Gemm& gemm, std::uint8_t* m, int groups, int k,
                  const cutlass::KernelHardwareInfo& hw, const EpilogueArguments& epilogue,
                  const char* name) const;
};

// Every group has the same K, so A's and B's strides go up once: A [M, K] and B [N, K] rows of K
// elements (each stride type is CUTLASS's (row stride, 1, 0)).
template <class GemmKernel>
void upload_ab_strides(std::uint8_t* a, std::uint8_t* b, std::size_t groups, int k) {
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  const std::vector<StrideA> sa(groups, StrideA(std::int64_t{k}, cute::_1{}, cute::_0{}));
  const std::vector<StrideB> sb(groups, StrideB(std::int64_t{k}, cute::_1{}, cute::_0{}));
  EPMOE_CUDA_CHECK(cudaMemcpy(a, sa.data(), groups * sizeof(StrideA), cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemcpy(b, sb.data(), groups * sizeof(StrideB), cudaMemcpyHostToDevice));
}

template <class K, class Gemm, class EpilogueArguments>
void OwnEpilogueAllocation::initialize(Gemm& gemm, std::uint8_t* m, int groups, int k,
                                       const cutlass::KernelHardwareInfo& hw,
                                       const EpilogueArguments& epilogue, const char* name) const {
  using GemmKernel = typename K::GemmKernel;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  upload_ab_strides<GemmKernel>(m + stride_a, m + stride_b, static_cast<std::size_t>(groups), k);
  const typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(m + problems),
       nullptr},
      {reinterpret_cast<const typename GemmKernel::ElementA**>(m + a),
       reinterpret_cast<StrideA*>(m + stride_a),
       reinterpret_cast<const typename GemmKernel::ElementB**>(m + b),
       reinterpret_cast<StrideB*>(m + stride_b)},
      epilogue,
      hw};
  check(gemm.can_implement(args), name, "can_implement");
  check(gemm.initialize(args, m + workspace), name, "initialize");
}

// The same, and D [M, N] rows of N.
template <class GemmKernel>
void upload_strides(std::uint8_t* a, std::uint8_t* b, std::uint8_t* d, std::size_t groups, int n,
                    int k) {
  using StrideD = typename GemmKernel::InternalStrideD;
  upload_ab_strides<GemmKernel>(a, b, groups, k);
  const std::vector<StrideD> sd(groups, StrideD(std::int64_t{n}, cute::_1{}, cute::_0{}));
  EPMOE_CUDA_CHECK(cudaMemcpy(d, sd.data(), groups * sizeof(StrideD), cudaMemcpyHostToDevice));
}

}  // namespace epmoe::cuda::experts::wgmma::parts
