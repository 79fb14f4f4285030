// The wgmma backend's E4M3 grouped GEMM with block scales (grouped_gemm.hpp) on CUTLASS 4's SM90
// blockwise-scaled pointer-array kernel: TMA loads of the E4M3 operands, cp.async of their fp32
// scales, two WGMMA consumer warpgroups on a 128 x 128 x 128 tile whose k128 partial sums are
// multiplied by their row's and block's scales and added into fp32 accumulators (one promotion
// per k128, as DeepSeek-V3's recipe does), and the persistent group scheduler reading each
// expert's M from device memory. Two epilogues ship (GemmOutput): fp32 sums (FC1, and FC2 of the
// in_kernel_reduce combine) and bf16 rows with b2 added (FC2 of the staged one).
//
// The scale layouts are fixed at creation, so no kernel derives them per round. Both are K-major:
// their strides depend on K only, and M enters the activation scales' layout only as its extent,
// which predicates the mainloop's cp.async of a tile's row scales. That extent is the operand's
// row capacity, not the group's M: the rows of a partial tile beyond M read the scales of the rows
// that follow (or the scratch's kScalePadRows rows after the last), into accumulator rows the
// epilogue never stores (it clips at the problem's M).
#include "cuda/experts/wgmma/grouped_gemm_parts.cuh"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include <type_traits>
#include <variant>
#include <vector>

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

// One shipped output's kernel.
template <GemmOutput kOutput>
struct Fp8Kernel {
  using Epilogue = parts::EpilogueOf<kOutput, TileShape, ClusterShape>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignAB, ElementB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = parts::PdlGemm<GemmKernel>;
};
using Sums = Fp8Kernel<GemmOutput::fp32_sums>;
using Rows = Fp8Kernel<GemmOutput::bf16_rows>;
using StrideA = Sums::GemmKernel::InternalStrideA;
using StrideB = Sums::GemmKernel::InternalStrideB;
using StrideD = Sums::GemmKernel::InternalStrideD;
static_assert(std::is_same_v<StrideA, Rows::GemmKernel::InternalStrideA> &&
                  std::is_same_v<StrideB, Rows::GemmKernel::InternalStrideB> &&
                  std::is_same_v<StrideD, Rows::GemmKernel::InternalStrideD>,
              "one set of strides serves both outputs");

constexpr const char* kName = "wgmma E4M3 grouped GEMM";

// Every group's scale layouts, on the device: fixed for the layer (the file's opening comment).
void upload_scale_layouts(std::uint8_t* sfa, std::uint8_t* sfb, std::size_t groups,
                          std::int64_t rows, int n, int k) {
  const auto shape = make_shape(static_cast<int>(rows), n, k, 1);
  const std::vector<LayoutSFA> a(groups, ScaleConfig::tile_atom_to_shape_SFA(shape));
  const std::vector<LayoutSFB> b(groups, ScaleConfig::tile_atom_to_shape_SFB(shape));
  EPMOE_CUDA_CHECK(cudaMemcpy(sfa, a.data(), groups * sizeof(LayoutSFA), cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemcpy(sfb, b.data(), groups * sizeof(LayoutSFB), cudaMemcpyHostToDevice));
}

}  // namespace

struct Fp8BlockwiseGroupedGemm::Kernel {
  std::variant<Sums::Gemm, Rows::Gemm> gemm;
  LayoutSFA* sfa_layouts = nullptr;
  LayoutSFB* sfb_layouts = nullptr;
};

const char* Fp8BlockwiseGroupedGemm::cannot_take(int n, int k) {
  if (k % kScaleBlock != 0) return "K must be a multiple of 128 (whole scale blocks)";
  if (n % parts::kAlignD16 != 0)
    return "N must be a multiple of 8 (16-byte bf16 output rows for TMA)";
  return nullptr;
}

Fp8BlockwiseGroupedGemm::Fp8BlockwiseGroupedGemm(int groups, int n, int k, std::int64_t rows,
                                                 int sm_count, int device, GemmOutput output)
    : kernel_(std::make_unique<Kernel>()), sm_count_(sm_count), output_(output) {
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
  const parts::OutputSlices output_slices(carve, g, n);
  const cutlass::KernelHardwareInfo hw = parts::hardware(device, sm_count);
  std::size_t workspace_bytes = 0;
  const auto size_workspace = [&](auto kernel) {
    using Gemm = typename decltype(kernel)::Gemm;
    workspace_bytes = Gemm::get_workspace_size(
        typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                 {groups, nullptr, nullptr},
                                 {},
                                 {{}, nullptr, nullptr, nullptr, nullptr},
                                 hw});
  };
  output == GemmOutput::bf16_rows ? size_workspace(Rows{}) : size_workspace(Sums{});
  const std::size_t workspace = carve.take(workspace_bytes);
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
  output_slices.place(memory_, n, &arrays_);
  parts::upload_strides<Sums::GemmKernel>(memory_ + stride_a, memory_ + stride_b,
                                          memory_ + stride_d, g, n, k);
  upload_scale_layouts(memory_ + sfa_layouts, memory_ + sfb_layouts, g, rows, n, k);
  EPMOE_CUDA_CHECK(cudaMemset(memory_ + problems, 0, g * sizeof(GemmProblem)));

  const auto initialize = [&](auto kernel) {
    using K = decltype(kernel);
    auto& gemm = kernel_->gemm.emplace<typename K::Gemm>();
    const typename K::Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {groups, reinterpret_cast<ProblemShape::UnderlyingProblemShape*>(arrays_.problems),
         nullptr},
        {reinterpret_cast<const ElementA**>(arrays_.a),
         reinterpret_cast<StrideA*>(memory_ + stride_a),
         reinterpret_cast<const ElementB**>(arrays_.b),
         reinterpret_cast<StrideB*>(memory_ + stride_b), arrays_.sfa, kernel_->sfa_layouts,
         arrays_.sfb, kernel_->sfb_layouts},
        parts::epilogue_arguments<typename K::Epilogue>(arrays_, memory_ + stride_d),
        hw};
    parts::check(gemm.can_implement(args), kName, "can_implement");
    parts::check(gemm.initialize(args, memory_ + workspace), kName, "initialize");
  };
  output == GemmOutput::bf16_rows ? initialize(Rows{}) : initialize(Sums{});
}

Fp8BlockwiseGroupedGemm::~Fp8BlockwiseGroupedGemm() {
  cudaFree(memory_);
}

void Fp8BlockwiseGroupedGemm::run(cudaStream_t stream) const {
  std::visit(
      [&](auto& gemm) {
        parts::check(gemm.run(stream, nullptr, programmatic_launch()), kName, "run");
      },
      kernel_->gemm);
}

}  // namespace epmoe::cuda::experts::wgmma
