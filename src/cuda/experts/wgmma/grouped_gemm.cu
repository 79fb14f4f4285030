// The wgmma backend's grouped GEMM (grouped_gemm.hpp) on CUTLASS 4's SM90 collectives: the
// pointer-array TMA + WGMMA cooperative kernel (two consumer warpgroups share a 128 x N tile; a
// producer warp feeds them through a shared-memory pipeline as deep as fits, CUTLASS's automatic
// carveout; the persistent group scheduler walks (expert, m-block, n-block) reading each expert's
// M from device memory). The epilogue stores D with TMA: fp32 sums, whose scales, biases and
// activation run after it, or (FC2 of the staged combine) the bf16 rows with b2 added, which home
// only copies (GemmOutput). Two tiles ship (Bf16Tile): 128 x 128 x 64 and 128 x 256 x 64, each
// with both outputs, the only instantiations in this file (the second tile cost CI about 6 s of
// nvcc: docs/design.md §4.1).
#include "cuda/experts/wgmma/grouped_gemm_parts.cuh"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include <variant>

namespace epmoe::cuda::experts::wgmma {
namespace {

using namespace cute;

using parts::ProblemShape;
using ElementA = cutlass::bfloat16_t;
using ElementB = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // [M, K], K contiguous: the expert's rows
using LayoutB = cutlass::layout::ColumnMajor;  // [N, K], K contiguous: the weights as stored
constexpr int kAlignA = 8, kAlignB = 8;        // 16 bytes: TMA
using ClusterShape = Shape<_1, _1, _1>;

// One shipped (tile, output)'s kernel: the cooperative schedule, stages from what the epilogue
// leaves.
template <class TileShape, GemmOutput kOutput>
struct Bf16Kernel {
  using Epilogue = parts::EpilogueOf<kOutput, TileShape, ClusterShape>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignA, ElementB,
      LayoutB*, kAlignB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = parts::PdlGemm<GemmKernel>;
  static constexpr int kStages = Mainloop::DispatchPolicy::Stages;
};
using Tile128x128 = Bf16Kernel<Shape<_128, _128, _64>, GemmOutput::fp32_sums>;
using Tile128x256 = Bf16Kernel<Shape<_128, _256, _64>, GemmOutput::fp32_sums>;
using Tile128x128Rows = Bf16Kernel<Shape<_128, _128, _64>, GemmOutput::bf16_rows>;
using Tile128x256Rows = Bf16Kernel<Shape<_128, _256, _64>, GemmOutput::bf16_rows>;
// NOTES: a stage holds (128 + N) x 64 bf16 of A and B (32 / 48 KiB); the fp32 epilogue keeps two
// 128 x 32 subtiles (32 KiB). A pipeline shallower than 4 could not cover TMA latency for two
// consumer warpgroups (grouped_gemm.hpp and docs/tuning.md quote these counts). The bf16 rows'
// subtiles are half as large, so their kernels keep at least as many stages.
static_assert(Tile128x128::kStages == 6, "128 x 128 x 64: 6 stages of 32 KiB + the epilogue's");
static_assert(Tile128x256::kStages == 4, "128 x 256 x 64: 4 stages of 48 KiB + the epilogue's");
static_assert(Tile128x128Rows::kStages >= Tile128x128::kStages &&
              Tile128x256Rows::kStages >= Tile128x256::kStages);

constexpr const char* kName = "wgmma bf16 grouped GEMM";

}  // namespace

const char* to_string(Bf16Tile tile) {
  switch (tile) {
    case Bf16Tile::m128_n128_k64:
      return "128x128x64";
    case Bf16Tile::m128_n256_k64:
      return "128x256x64";
  }
  return "unknown";
}

struct Bf16GroupedGemm::Kernel {
  std::variant<Tile128x128::Gemm, Tile128x256::Gemm, Tile128x128Rows::Gemm, Tile128x256Rows::Gemm>
      gemm;
};

const char* Bf16GroupedGemm::cannot_take(int n, int k) {
  if (k % kAlignA != 0) return "K must be a multiple of 8 (16-byte rows for TMA)";
  if (n % parts::kAlignD16 != 0)
    return "N must be a multiple of 8 (16-byte bf16 output rows for TMA)";
  return nullptr;
}

namespace {

// One allocation (problems, pointers, strides, CUTLASS's workspace), the arrays sliced from it,
// and `gemm` initialized over them; returns the allocation's bytes.
template <class Tile>
std::size_t build(typename Tile::Gemm& gemm, int groups, int n, int k, int sm_count, int device,
                  std::uint8_t** memory, GroupedGemmArrays* arrays) {
  using GemmKernel = typename Tile::GemmKernel;
  using Gemm = typename Tile::Gemm;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  const auto g = static_cast<std::size_t>(groups);
  parts::Carve carve;
  const std::size_t problems = carve.take(g * sizeof(GemmProblem));
  const std::size_t a = carve.take(g * sizeof(void*)), b = carve.take(g * sizeof(void*));
  const std::size_t d = carve.take(g * sizeof(void*));
  const std::size_t stride_a = carve.take(g * sizeof(StrideA));
  const std::size_t stride_b = carve.take(g * sizeof(StrideB));
  const std::size_t stride_d = carve.take(g * sizeof(StrideD));
  const parts::OutputSlices output(carve, g, n);
  const cutlass::KernelHardwareInfo hw = parts::hardware(device, sm_count);
  const typename Gemm::Arguments sizing{cutlass::gemm::GemmUniversalMode::kGrouped,
                                        {groups, nullptr, nullptr},
                                        {nullptr, nullptr, nullptr, nullptr},
                                        {{}, nullptr, nullptr, nullptr, nullptr},
                                        hw};
  const std::size_t workspace = carve.take(Gemm::get_workspace_size(sizing));
  EPMOE_CUDA_CHECK(cudaMalloc(memory, carve.end));
  std::uint8_t* m = *memory;

  arrays->problems = reinterpret_cast<GemmProblem*>(m + problems);
  arrays->a = reinterpret_cast<const std::uint16_t**>(m + a);
  arrays->b = reinterpret_cast<const std::uint16_t**>(m + b);
  arrays->d = reinterpret_cast<float**>(m + d);
  output.place(m, n, arrays);
  parts::upload_strides<GemmKernel>(m + stride_a, m + stride_b, m + stride_d, g, n, k);
  EPMOE_CUDA_CHECK(cudaMemset(m + problems, 0, g * sizeof(GemmProblem)));

  const typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, reinterpret_cast<ProblemShape::UnderlyingProblemShape*>(arrays->problems), nullptr},
      {reinterpret_cast<const ElementA**>(arrays->a), reinterpret_cast<StrideA*>(m + stride_a),
       reinterpret_cast<const ElementB**>(arrays->b), reinterpret_cast<StrideB*>(m + stride_b)},
      parts::epilogue_arguments<typename Tile::Epilogue>(*arrays, m + stride_d),
      hw};
  parts::check(gemm.can_implement(args), kName, "can_implement");
  parts::check(gemm.initialize(args, m + workspace), kName, "initialize");
  return carve.end;
}

}  // namespace

Bf16GroupedGemm::Bf16GroupedGemm(int groups, int n, int k, int sm_count, int device, Bf16Tile tile,
                                 GemmOutput output)
    : kernel_(std::make_unique<Kernel>()),
      tile_(tile),
      output_(output),
      sm_count_(sm_count),
      n_(n),
      k_(k) {
  const auto make = [&](auto kernel) {
    using Tile = decltype(kernel);
    auto& gemm = kernel_->gemm.emplace<typename Tile::Gemm>();
    device_bytes_ = build<Tile>(gemm, groups, n, k, sm_count, device, &memory_, &arrays_);
  };
  const bool wide = tile == Bf16Tile::m128_n256_k64;
  if (output == GemmOutput::bf16_rows)
    wide ? make(Tile128x256Rows{}) : make(Tile128x128Rows{});
  else
    wide ? make(Tile128x256{}) : make(Tile128x128{});
}

Bf16GroupedGemm::~Bf16GroupedGemm() {
  cudaFree(memory_);
}

void Bf16GroupedGemm::run(cudaStream_t stream) const {
  std::visit(
      [&](auto& gemm) {
        parts::check(gemm.run(stream, nullptr, programmatic_launch()), kName, "run");
      },
      kernel_->gemm);
}

}  // namespace epmoe::cuda::experts::wgmma
