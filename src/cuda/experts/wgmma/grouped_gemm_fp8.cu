// The wgmma backend's E4M3 grouped GEMM with block scales (grouped_gemm.hpp) on CUTLASS 4's SM90
// blockwise-scaled pointer-array kernel: TMA loads of the E4M3 operands, cp.async of their fp32
// scales, two WGMMA consumer warpgroups on a 128 x 128 x 128 tile whose k128 partial sums are
// multiplied by their row's and block's scales and added into fp32 accumulators (one promotion
// per k128, as DeepSeek-V3's recipe does), and the persistent group scheduler reading each
// expert's M from device memory. The scale layouts depend on M, so a small kernel derives them
// from the round's problems before the GEMM.
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/cuda_check.hpp"
#include "cuda/experts/wgmma/grouped_gemm.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace epmoe::cuda::experts::wgmma {
namespace {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementD = float;
using LayoutA = cutlass::layout::RowMajor;     // [M, K], K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // [N, K], K contiguous
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignAB = 16, kAlignD = 4;  // 16 bytes: TMA
constexpr int kScaleBlock = 128;
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _1, _1>;
using ScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock, cute::GMMA::Major::K,
                                              cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using Epilogue = cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD,
    ElementD, LayoutD*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float, void>>::CollectiveOp;

using Mainloop = cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
    cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElementB, cute::tuple<LayoutB*, LayoutSFB*>,
    kAlignAB, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideA = GemmKernel::InternalStrideA;
using StrideB = GemmKernel::InternalStrideB;
using StrideD = GemmKernel::InternalStrideD;

static_assert(sizeof(ProblemShape::UnderlyingProblemShape) == sizeof(GemmProblem),
              "GemmProblem mirrors CUTLASS's Shape<int, int, int>");

void check(cutlass::Status status, const char* what) {
  if (status != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("wgmma E4M3 grouped GEMM: ") + what + ": " +
                             cutlassGetStatusString(status));
}

// Each group's scale layouts from its problem (they fold M, N and K in).
__global__ void scale_layouts_kernel(const GemmProblem* problems, int groups, LayoutSFA* sfa,
                                     LayoutSFB* sfb) {
  for (int g = static_cast<int>(threadIdx.x); g < groups; g += blockDim.x) {
    const GemmProblem p = problems[g];
    sfa[g] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(p.m, p.n, p.k, 1));
    sfb[g] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(p.m, p.n, p.k, 1));
  }
}

}  // namespace

struct Fp8BlockwiseGroupedGemm::Kernel {
  Gemm gemm;
  LayoutSFA* sfa_layouts = nullptr;
  LayoutSFB* sfb_layouts = nullptr;
};

const char* Fp8BlockwiseGroupedGemm::cannot_take(int n, int k) {
  if (k % kScaleBlock != 0) return "K must be a multiple of 128 (whole scale blocks)";
  if (n % kAlignD != 0) return "N must be a multiple of 4 (16-byte fp32 output rows for TMA)";
  return nullptr;
}

Fp8BlockwiseGroupedGemm::Fp8BlockwiseGroupedGemm(int groups, int n, int k, int sm_count, int device)
    : kernel_(std::make_unique<Kernel>()), groups_(groups) {
  const auto g = static_cast<std::size_t>(groups);
  std::size_t at = 0;
  const auto take = [&](std::size_t bytes) {
    const std::size_t offset = (at + 255) / 256 * 256;
    at = offset + bytes;
    return offset;
  };
  const std::size_t problems = take(g * sizeof(GemmProblem));
  const std::size_t a = take(g * sizeof(void*)), b = take(g * sizeof(void*));
  const std::size_t d = take(g * sizeof(void*));
  const std::size_t sfa = take(g * sizeof(void*)), sfb = take(g * sizeof(void*));
  const std::size_t stride_a = take(g * sizeof(StrideA)), stride_b = take(g * sizeof(StrideB));
  const std::size_t stride_d = take(g * sizeof(StrideD));
  const std::size_t sfa_layouts = take(g * sizeof(LayoutSFA));
  const std::size_t sfb_layouts = take(g * sizeof(LayoutSFB));

  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  typename Gemm::Arguments sizing{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {groups, nullptr, nullptr},
                                  {},
                                  {{}, nullptr, nullptr, nullptr, nullptr},
                                  hw};
  const std::size_t workspace = take(Gemm::get_workspace_size(sizing));
  device_bytes_ = at;
  EPMOE_CUDA_CHECK(cudaMalloc(&memory_, device_bytes_));

  arrays_.problems = reinterpret_cast<GemmProblem*>(memory_ + problems);
  arrays_.a = reinterpret_cast<const std::uint8_t**>(memory_ + a);
  arrays_.b = reinterpret_cast<const std::uint8_t**>(memory_ + b);
  arrays_.d = reinterpret_cast<float**>(memory_ + d);
  arrays_.sfa = reinterpret_cast<const float**>(memory_ + sfa);
  arrays_.sfb = reinterpret_cast<const float**>(memory_ + sfb);
  kernel_->sfa_layouts = reinterpret_cast<LayoutSFA*>(memory_ + sfa_layouts);
  kernel_->sfb_layouts = reinterpret_cast<LayoutSFB*>(memory_ + sfb_layouts);
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
  scale_layouts_kernel<<<1, 256>>>(arrays_.problems, groups, kernel_->sfa_layouts,
                                   kernel_->sfb_layouts);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());

  typename Epilogue::FusionCallbacks::Arguments fusion{};
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, reinterpret_cast<ProblemShape::UnderlyingProblemShape*>(arrays_.problems), nullptr},
      {reinterpret_cast<const ElementA**>(arrays_.a),
       reinterpret_cast<StrideA*>(memory_ + stride_a),
       reinterpret_cast<const ElementB**>(arrays_.b),
       reinterpret_cast<StrideB*>(memory_ + stride_b), arrays_.sfa, kernel_->sfa_layouts,
       arrays_.sfb, kernel_->sfb_layouts},
      {fusion, nullptr, reinterpret_cast<StrideD*>(memory_ + stride_d), arrays_.d,
       reinterpret_cast<StrideD*>(memory_ + stride_d)},
      hw};
  check(kernel_->gemm.can_implement(args), "can_implement");
  check(kernel_->gemm.initialize(args, memory_ + workspace), "initialize");
}

Fp8BlockwiseGroupedGemm::~Fp8BlockwiseGroupedGemm() {
  cudaFree(memory_);
}

void Fp8BlockwiseGroupedGemm::run(cudaStream_t stream) const {
  scale_layouts_kernel<<<1, 256, 0, stream>>>(arrays_.problems, groups_, kernel_->sfa_layouts,
                                              kernel_->sfb_layouts);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  check(kernel_->gemm.run(stream), "run");
}

}  // namespace epmoe::cuda::experts::wgmma
