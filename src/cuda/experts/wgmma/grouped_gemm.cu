// The wgmma backend's grouped GEMM (grouped_gemm.hpp) on CUTLASS 4's SM90 collectives: the
// pointer-array TMA + WGMMA cooperative kernel (two consumer warpgroups share a 128 x 128 tile; a
// producer warp feeds them through a shared-memory pipeline; the persistent group scheduler walks
// (expert, m-block, n-block) reading each expert's M from device memory). The epilogue stores fp32
// D with TMA; scales, biases, the activation and the token-back stores run after it
// (wgmma_backend.cu), so one instantiation serves FC1 and FC2.
#include "cuda/experts/wgmma/grouped_gemm_parts.cuh"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace epmoe::cuda::experts::wgmma {
namespace {

using namespace cute;

using parts::ProblemShape;
using ElementA = cutlass::bfloat16_t;
using ElementB = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // [M, K], K contiguous: the expert's rows
using LayoutB = cutlass::layout::ColumnMajor;  // [N, K], K contiguous: the weights as stored
constexpr int kAlignA = 8, kAlignB = 8;        // 16 bytes: TMA
using TileShape = Shape<_128, _128, _64>;
using ClusterShape = Shape<_1, _1, _1>;

using Epilogue = parts::Fp32Epilogue<TileShape, ClusterShape>;

using Mainloop = cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignA, ElementB,
    LayoutB*, kAlignB, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideA = GemmKernel::InternalStrideA;
using StrideB = GemmKernel::InternalStrideB;
using StrideD = GemmKernel::InternalStrideD;

constexpr const char* kName = "wgmma bf16 grouped GEMM";

}  // namespace

struct Bf16GroupedGemm::Kernel {
  Gemm gemm;
};

const char* Bf16GroupedGemm::cannot_take(int n, int k) {
  if (k % kAlignA != 0) return "K must be a multiple of 8 (16-byte rows for TMA)";
  if (n % parts::kAlignD != 0)
    return "N must be a multiple of 4 (16-byte fp32 output rows for TMA)";
  return nullptr;
}

Bf16GroupedGemm::Bf16GroupedGemm(int groups, int n, int k, int sm_count, int device)
    : kernel_(std::make_unique<Kernel>()) {
  const auto g = static_cast<std::size_t>(groups);
  parts::Carve carve;  // one allocation: problems, pointers, strides, CUTLASS's workspace
  const std::size_t problems = carve.take(g * sizeof(GemmProblem));
  const std::size_t a = carve.take(g * sizeof(void*)), b = carve.take(g * sizeof(void*));
  const std::size_t d = carve.take(g * sizeof(void*));
  const std::size_t stride_a = carve.take(g * sizeof(StrideA));
  const std::size_t stride_b = carve.take(g * sizeof(StrideB));
  const std::size_t stride_d = carve.take(g * sizeof(StrideD));
  const cutlass::KernelHardwareInfo hw = parts::hardware(device, sm_count);
  const typename Gemm::Arguments sizing{cutlass::gemm::GemmUniversalMode::kGrouped,
                                        {groups, nullptr, nullptr},
                                        {nullptr, nullptr, nullptr, nullptr},
                                        {{}, nullptr, nullptr, nullptr, nullptr},
                                        hw};
  const std::size_t workspace = carve.take(Gemm::get_workspace_size(sizing));
  device_bytes_ = carve.end;
  EPMOE_CUDA_CHECK(cudaMalloc(&memory_, device_bytes_));

  arrays_.problems = reinterpret_cast<GemmProblem*>(memory_ + problems);
  arrays_.a = reinterpret_cast<const std::uint16_t**>(memory_ + a);
  arrays_.b = reinterpret_cast<const std::uint16_t**>(memory_ + b);
  arrays_.d = reinterpret_cast<float**>(memory_ + d);
  parts::upload_strides<GemmKernel>(memory_ + stride_a, memory_ + stride_b, memory_ + stride_d, g,
                                    n, k);
  EPMOE_CUDA_CHECK(cudaMemset(memory_ + problems, 0, g * sizeof(GemmProblem)));

  typename Epilogue::FusionCallbacks::Arguments fusion{};
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  const typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, reinterpret_cast<ProblemShape::UnderlyingProblemShape*>(arrays_.problems), nullptr},
      {reinterpret_cast<const ElementA**>(arrays_.a),
       reinterpret_cast<StrideA*>(memory_ + stride_a),
       reinterpret_cast<const ElementB**>(arrays_.b),
       reinterpret_cast<StrideB*>(memory_ + stride_b)},
      {fusion, nullptr, reinterpret_cast<StrideD*>(memory_ + stride_d), arrays_.d,
       reinterpret_cast<StrideD*>(memory_ + stride_d)},
      hw};
  parts::check(kernel_->gemm.can_implement(args), kName, "can_implement");
  parts::check(kernel_->gemm.initialize(args, memory_ + workspace), kName, "initialize");
}

Bf16GroupedGemm::~Bf16GroupedGemm() {
  cudaFree(memory_);
}

void Bf16GroupedGemm::run(cudaStream_t stream) const {
  parts::check(kernel_->gemm.run(stream), kName, "run");
}

}  // namespace epmoe::cuda::experts::wgmma
