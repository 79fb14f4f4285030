// The wgmma backend's grouped GEMM (grouped_gemm.hpp) on CUTLASS 4's SM90 collectives: the
// pointer-array TMA + WGMMA cooperative kernel (two consumer warpgroups share a 128 x 128 tile; a
// producer warp feeds them through a shared-memory pipeline; the persistent group scheduler walks
// (expert, m-block, n-block) reading each expert's M from device memory). The epilogue stores fp32
// D with TMA; scales, biases, the activation and the token-back stores run after it
// (wgmma_backend.cu), so one instantiation serves FC1 and FC2.
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/cuda_check.hpp"
#include "cuda/experts/wgmma/grouped_gemm.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace epmoe::cuda::experts::wgmma {
namespace {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using ElementA = cutlass::bfloat16_t;
using ElementB = cutlass::bfloat16_t;
using ElementD = float;
using LayoutA = cutlass::layout::RowMajor;            // [M, K], K contiguous: the expert's rows
using LayoutB = cutlass::layout::ColumnMajor;         // [N, K], K contiguous: the weights as stored
using LayoutD = cutlass::layout::RowMajor;            // [M, N]
constexpr int kAlignA = 8, kAlignB = 8, kAlignD = 4;  // 16 bytes: TMA
using TileShape = Shape<_128, _128, _64>;
using ClusterShape = Shape<_1, _1, _1>;

using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
    ElementD, LayoutD*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float, void>>::CollectiveOp;

using Mainloop = cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignA, ElementB,
    LayoutB*, kAlignB, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
// Per-group strides (the arguments take device arrays of them): rows of K, of K, of N elements.
using StrideA = GemmKernel::InternalStrideA;
using StrideB = GemmKernel::InternalStrideB;
using StrideD = GemmKernel::InternalStrideD;

static_assert(sizeof(ProblemShape::UnderlyingProblemShape) == sizeof(GemmProblem),
              "GemmProblem mirrors CUTLASS's Shape<int, int, int>");

void check(cutlass::Status status, const char* what) {
  if (status != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("wgmma grouped GEMM: ") + what + ": " +
                             cutlassGetStatusString(status));
}

}  // namespace

struct Bf16GroupedGemm::Kernel {
  Gemm gemm;
  std::uint8_t* workspace = nullptr;
};

const char* Bf16GroupedGemm::cannot_take(int n, int k) {
  if (k % kAlignA != 0) return "K must be a multiple of 8 (16-byte rows for TMA)";
  if (n % kAlignD != 0) return "N must be a multiple of 4 (16-byte fp32 output rows for TMA)";
  return nullptr;
}

Bf16GroupedGemm::Bf16GroupedGemm(int groups, int n, int k, int sm_count, int device)
    : kernel_(std::make_unique<Kernel>()) {
  const auto g = static_cast<std::size_t>(groups);
  // One allocation: problems, pointers, strides (aligned slices).
  std::size_t at = 0;
  const auto take = [&](std::size_t bytes) {
    const std::size_t offset = (at + 255) / 256 * 256;
    at = offset + bytes;
    return offset;
  };
  const std::size_t problems = take(g * sizeof(GemmProblem));
  const std::size_t a = take(g * sizeof(void*)), b = take(g * sizeof(void*));
  const std::size_t d = take(g * sizeof(void*));
  const std::size_t stride_a = take(g * sizeof(StrideA)), stride_b = take(g * sizeof(StrideB));
  const std::size_t stride_d = take(g * sizeof(StrideD));
  const std::size_t arrays_bytes = at;

  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  typename Gemm::Arguments args;
  // Placeholder pointers for sizing; the real ones are set below once memory exists.
  args = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {groups, nullptr, nullptr},
                                  {nullptr, nullptr, nullptr, nullptr},
                                  {{}, nullptr, nullptr, nullptr, nullptr},
                                  hw};
  const std::size_t workspace = take(Gemm::get_workspace_size(args));
  device_bytes_ = at;
  EPMOE_CUDA_CHECK(cudaMalloc(&memory_, device_bytes_));
  kernel_->workspace = memory_ + workspace;
  (void)arrays_bytes;

  arrays_.problems = reinterpret_cast<GemmProblem*>(memory_ + problems);
  arrays_.a = reinterpret_cast<const std::uint16_t**>(memory_ + a);
  arrays_.b = reinterpret_cast<const std::uint16_t**>(memory_ + b);
  arrays_.d = reinterpret_cast<float**>(memory_ + d);
  // Every group has the same N and K: strides once, here.
  const std::vector<StrideA> sa(g, StrideA(std::int64_t{k}, _1{}, _0{}));
  const std::vector<StrideB> sb(g, StrideB(std::int64_t{k}, _1{}, _0{}));
  const std::vector<StrideD> sd(g, StrideD(std::int64_t{n}, _1{}, _0{}));
  EPMOE_CUDA_CHECK(
      cudaMemcpy(memory_ + stride_a, sa.data(), g * sizeof(StrideA), cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(
      cudaMemcpy(memory_ + stride_b, sb.data(), g * sizeof(StrideB), cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(
      cudaMemcpy(memory_ + stride_d, sd.data(), g * sizeof(StrideD), cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemset(memory_ + problems, 0, g * sizeof(GemmProblem)));

  typename Epilogue::FusionCallbacks::Arguments fusion{};
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  args = typename Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, reinterpret_cast<ProblemShape::UnderlyingProblemShape*>(arrays_.problems), nullptr},
      {reinterpret_cast<const ElementA**>(arrays_.a),
       reinterpret_cast<StrideA*>(memory_ + stride_a),
       reinterpret_cast<const ElementB**>(arrays_.b),
       reinterpret_cast<StrideB*>(memory_ + stride_b)},
      {fusion, nullptr, reinterpret_cast<StrideD*>(memory_ + stride_d), arrays_.d,
       reinterpret_cast<StrideD*>(memory_ + stride_d)},
      hw};
  check(kernel_->gemm.can_implement(args), "can_implement");
  check(kernel_->gemm.initialize(args, kernel_->workspace), "initialize");
}

Bf16GroupedGemm::~Bf16GroupedGemm() {
  cudaFree(memory_);
}

void Bf16GroupedGemm::run(cudaStream_t stream) const {
  check(kernel_->gemm.run(stream), "run");
}

}  // namespace epmoe::cuda::experts::wgmma
