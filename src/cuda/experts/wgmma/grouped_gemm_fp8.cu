// The wgmma backend's E4M3 grouped GEMM with block scales (grouped_gemm.hpp) on CUTLASS 4's SM90
// blockwise-scaled pointer-array kernel: TMA loads of the E4M3 operands, cp.async of their fp32
// scales, two WGMMA consumer warpgroups on a 128 x 128 x 128 tile whose k128 partial sums are
// multiplied by their row's and block's scales and added into fp32 accumulators (one promotion
// per k128, as DeepSeek-V3's recipe does), and the persistent group scheduler reading each
// expert's M from device memory. The scale layouts depend on M, so a small kernel derives them
// from the round's problems before the GEMM.
#include "cuda/experts/wgmma/grouped_gemm_parts.cuh"
#include "cuda/kernels.hpp"  // launch_chained, KernelShape, kThreads
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace epmoe::cuda::experts::wgmma {
namespace {

using namespace cute;

using parts::ProblemShape;
using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using LayoutA = cutlass::layout::RowMajor;     // [M, K], K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // [N, K], K contiguous
constexpr int kAlignAB = 16;                   // 16 bytes: TMA
constexpr int kScaleBlock = 128;
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _1, _1>;
using ScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock, cute::GMMA::Major::K,
                                              cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using Epilogue = parts::Fp32Epilogue<TileShape, ClusterShape>;

using Mainloop = cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
    cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElementB, cute::tuple<LayoutB*, LayoutSFB*>,
    kAlignAB, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
using Gemm = parts::PdlGemm<GemmKernel>;
using StrideA = GemmKernel::InternalStrideA;
using StrideB = GemmKernel::InternalStrideB;
using StrideD = GemmKernel::InternalStrideD;

constexpr const char* kName = "wgmma E4M3 grouped GEMM";

// Each group's scale layouts from its problem (they fold M, N and K in). A kernel of the chain
// (launch_chained, PDL): it reads the problems the previous kernel (plan_and_gather, activate)
// wrote only after that kernel has completed.
__global__ void __launch_bounds__(kThreads)
    scale_layouts_kernel(const GemmProblem* problems, int groups, LayoutSFA* sfa, LayoutSFB* sfb) {
  wait_for_previous_kernel();
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
  if (n % parts::kAlignD != 0)
    return "N must be a multiple of 4 (16-byte fp32 output rows for TMA)";
  return nullptr;
}

Fp8BlockwiseGroupedGemm::Fp8BlockwiseGroupedGemm(int groups, int n, int k, int sm_count, int device)
    : kernel_(std::make_unique<Kernel>()), groups_(groups), sm_count_(sm_count) {
  const auto g = static_cast<std::size_t>(groups);
  parts::Carve carve;  // one allocation: problems, pointers, strides, layouts, CUTLASS's workspace
  const std::size_t problems = carve.take(g * sizeof(GemmProblem));
  const std::size_t a = carve.take(g * sizeof(void*)), b = carve.take(g * sizeof(void*));
  const std::size_t d = carve.take(g * sizeof(void*));
  const std::size_t sfa = carve.take(g * sizeof(void*)), sfb = carve.take(g * sizeof(void*));
  const std::size_t stride_a = carve.take(g * sizeof(StrideA));
  const std::size_t stride_b = carve.take(g * sizeof(StrideB));
  const std::size_t stride_d = carve.take(g * sizeof(StrideD));
  const std::size_t sfa_layouts = carve.take(g * sizeof(LayoutSFA));
  const std::size_t sfb_layouts = carve.take(g * sizeof(LayoutSFB));
  const cutlass::KernelHardwareInfo hw = parts::hardware(device, sm_count);
  const typename Gemm::Arguments sizing{cutlass::gemm::GemmUniversalMode::kGrouped,
                                        {groups, nullptr, nullptr},
                                        {},
                                        {{}, nullptr, nullptr, nullptr, nullptr},
                                        hw};
  const std::size_t workspace = carve.take(Gemm::get_workspace_size(sizing));
  device_bytes_ = carve.end;
  EPMOE_CUDA_CHECK(cudaMalloc(&memory_, device_bytes_));

  arrays_.problems = reinterpret_cast<GemmProblem*>(memory_ + problems);
  arrays_.a = reinterpret_cast<const std::uint8_t**>(memory_ + a);
  arrays_.b = reinterpret_cast<const std::uint8_t**>(memory_ + b);
  arrays_.d = reinterpret_cast<float**>(memory_ + d);
  arrays_.sfa = reinterpret_cast<const float**>(memory_ + sfa);
  arrays_.sfb = reinterpret_cast<const float**>(memory_ + sfb);
  kernel_->sfa_layouts = reinterpret_cast<LayoutSFA*>(memory_ + sfa_layouts);
  kernel_->sfb_layouts = reinterpret_cast<LayoutSFB*>(memory_ + sfb_layouts);
  parts::upload_strides<GemmKernel>(memory_ + stride_a, memory_ + stride_b, memory_ + stride_d, g,
                                    n, k);
  EPMOE_CUDA_CHECK(cudaMemset(memory_ + problems, 0, g * sizeof(GemmProblem)));
  // The scale layouts are written by run(), before each GEMM, from that round's problems.

  typename Epilogue::FusionCallbacks::Arguments fusion{};
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  const typename Gemm::Arguments args{
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
  parts::check(kernel_->gemm.can_implement(args), kName, "can_implement");
  parts::check(kernel_->gemm.initialize(args, memory_ + workspace), kName, "initialize");
}

Fp8BlockwiseGroupedGemm::~Fp8BlockwiseGroupedGemm() {
  cudaFree(memory_);
}

void Fp8BlockwiseGroupedGemm::run(cudaStream_t stream) const {
  launch_chained(scale_layouts_kernel, KernelShape{1}, stream, arrays_.problems, groups_,
                 kernel_->sfa_layouts, kernel_->sfb_layouts);
  parts::check(kernel_->gemm.run(stream, nullptr, programmatic_launch()), kName, "run");
}

}  // namespace epmoe::cuda::experts::wgmma
