// FC1 with the activation in its epilogue (grouped_gemm.hpp, Bf16GluGroupedGemm): CUTLASS 4's SM90
// pointer-array TMA + WGMMA kernels, cooperative on 128 x 128 x 64 tiles and ping-pong on 64 x 128
// x 64 (GluTile), with an epilogue of ours (parts::NoSmemEpilogue): CUTLASS's map one accumulator
// to one output element, where a gated activation maps two, gate j and up j, to one h element, and
// FC2's MXFP8 quantization point reduces 32 of those.
//
// A thread holds column pairs (2c, 2c + 1) of two rows (parts::accumulator_place). With w13's rows
// interleaved, that pair is (gate j, up j) of h column j = 4k + t % 4, so an h element is one
// thread's, and an MXFP8 block (32 h columns = 8 column groups) of a row is held by the 4 threads
// of a quad: 16 accumulators each, then two shuffles.
#include "cuda/experts/wgmma/grouped_gemm_parts.cuh"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "math/activation.hpp"
#include "math/expert_row.hpp"  // math::biased
#include "protocol/wire.hpp"    // activation_format

#include <type_traits>
#include <variant>

namespace epmoe::cuda::experts::wgmma {
namespace {

using namespace cute;

using parts::ProblemShape;
using ElementAB = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // [M, K]: the expert's rows
using LayoutB = cutlass::layout::ColumnMajor;  // [N, K]: w13, gate and up rows interleaved
constexpr int kAlignAB = 8;                    // 16 bytes: TMA
using ClusterShape = Shape<_1, _1, _1>;
using parts::kGroupCols;

// What the epilogue needs beyond the accumulators, fixed for the layer.
struct GluArguments {
  std::uint16_t** h = nullptr;  // per group: bf16 codes [M, I]
  const float** b13 = nullptr;  // per group: [2I] or nullptr
  ExpertProblem problem{};      // I, the activation, its clamp
};

class GluEpilogue : public parts::NoSmemEpilogue<GluArguments> {
 public:
  using NoSmemEpilogue::NoSmemEpilogue;
  template <class Problems>
  static bool can_implement(Problems const&, Arguments const& args) {
    return args.h != nullptr && args.b13 != nullptr && args.problem.intermediate % 64 == 0;
  }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_mnkl, BlockShapeMNK blk_shape,
                                 BlockCoordMNKL blk_coord, Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    static_assert(is_static<FrgLayout>::value, "the accumulator layout is static");
    constexpr int kValues = decltype(size(acc))::value;
    constexpr int kGroups = kValues / 4;  // column groups k per thread
    const int m_count = get<0>(problem_mnkl);
    const int l_coord = static_cast<int>(get<3>(blk_coord));
    const ExpertProblem& problem = params_.problem;
    const std::int64_t inter = problem.intermediate;
    const float* b13 = params_.b13[l_coord];
    const float* b13_up = b13 == nullptr ? nullptr : b13 + inter;
    std::uint16_t* h = params_.h[l_coord];

    const parts::AccumulatorPlace place = parts::accumulator_place<kValues>(
        problem_mnkl, blk_shape, blk_coord, tiled_mma, thread_idx);
    const int q = place.quad_rank, row0 = place.row0, col0 = place.col0;

    // h per accumulator pair (index half + 2 k).
    float hv[kValues / 2];
#pragma unroll
    for (int i = 0; i < kValues; i += 2) {
      const std::int64_t j = (col0 + kGroupCols * (i / 4)) / 2;
      hv[i / 2] = math::activation_f32(problem.activation, math::biased(acc(i), b13, j),
                                       math::biased(acc(i + 1), b13_up, j), problem.swiglu_limit);
    }
    // FC2's input quantization point (bf16), then 4-byte stores: of each column group, an even
    // thread stores row half 0's columns (4k + q, + 1) with its odd neighbour's code, the odd
    // thread row half 1's (4k + q - 1, 4k + q) with its even neighbour's.
    const auto code_of = [&](int half, int k) {
      return static_cast<std::uint32_t>(formats::float_to_bf16(hv[half + 2 * k]));
    };
    const bool even = q % 2 == 0;
    const int row = row0 + (even ? 0 : 8);
    std::uint16_t* h_row =
        h + static_cast<std::int64_t>(row) * inter + (col0 - 2 * q) / 2 + q - (even ? 0 : 1);
#pragma unroll
    for (int k = 0; k < kGroups; ++k) {
      const std::uint32_t mine0 = code_of(0, k), mine1 = code_of(1, k);
      const std::uint32_t other = __shfl_xor_sync(0xffffffffu, even ? mine1 : mine0, 1);
      const std::uint32_t packed = even ? (mine0 | other << 16) : (other | mine1 << 16);
      if (row < m_count) *reinterpret_cast<std::uint32_t*>(h_row + 4 * k) = packed;
    }
  }
};

using Epilogue = parts::NoSmemEpilogueOf<GluEpilogue>;
template <class Tile, class Schedule>
struct GluKernel {
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA*, kAlignAB, ElementAB,
      LayoutB*, kAlignAB, float, Tile, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<0>, Schedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = parts::PdlGemm<GemmKernel>;
};
using Cooperative =
    GluKernel<Shape<_128, _128, _64>, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
using Pingpong =
    GluKernel<Shape<_64, _128, _64>, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>;
// NOTES: with no epilogue shared memory, 7 stages of (128 + 128) x 64 bf16 (32 KiB) fit, and 9 of
// (64 + 128) x 64 (24 KiB).
static_assert(Cooperative::Mainloop::DispatchPolicy::Stages == 7, "128 x 128: 7 stages");
static_assert(Pingpong::Mainloop::DispatchPolicy::Stages == 9, "64 x 128: 9 stages");

constexpr const char* kName = "wgmma FC1 grouped GEMM with the activation";

}  // namespace

const char* to_string(GluTile tile) {
  return tile == GluTile::m64_n128_k64 ? "64x128x64 ping-pong" : "128x128x64 cooperative";
}

struct Bf16GluGroupedGemm::Kernel {
  std::variant<Pingpong::Gemm, Cooperative::Gemm> gemm;
};

const char* Bf16GluGroupedGemm::cannot_take(const ExpertProblem& problem) {
  if (problem.precision != Precision::bf16)
    return "precision must be bf16 (the epilogue stores h as bf16, FC2's input of a bf16 layer)";
  if (problem.hidden % kAlignAB != 0) return "H must be a multiple of 8 (16-byte rows for TMA)";
  if (problem.intermediate % 64 != 0)
    return "I must be a multiple of 64 (whole 128-column FC1 tiles)";
  return nullptr;
}

Bf16GluGroupedGemm::Bf16GluGroupedGemm(const ExpertProblem& problem, int sm_count, int device,
                                       GluTile tile)
    : kernel_(std::make_unique<Kernel>()), sm_count_(sm_count), tile_(tile) {
  const int groups = static_cast<int>(problem.local_experts);
  const auto g = static_cast<std::size_t>(groups);
  const cutlass::KernelHardwareInfo hw = parts::hardware(device, sm_count);
  const auto build = [&](auto kernel) {
    using K = decltype(kernel);
    parts::OwnEpilogueAllocation at;
    at.take_operands<K>(g);
    const std::size_t h = at.carve.take(g * sizeof(void*)), b13 = at.carve.take(g * sizeof(void*));
    memory_ = at.finish<K>(groups, hw, &device_bytes_);
    arrays_ = GluGemmArrays{reinterpret_cast<GemmProblem*>(memory_ + at.problems),
                            reinterpret_cast<const std::uint16_t**>(memory_ + at.a),
                            reinterpret_cast<const std::uint16_t**>(memory_ + at.b),
                            reinterpret_cast<std::uint16_t**>(memory_ + h),
                            reinterpret_cast<const float**>(memory_ + b13)};
    at.initialize<K>(kernel_->gemm.emplace<typename K::Gemm>(), memory_, groups,
                     static_cast<int>(problem.hidden), hw,
                     GluArguments{arrays_.h, arrays_.b13, problem}, kName);
  };
  if (tile == GluTile::m64_n128_k64)
    build(Pingpong{});
  else
    build(Cooperative{});
}

Bf16GluGroupedGemm::~Bf16GluGroupedGemm() {
  cudaFree(memory_);
}

void Bf16GluGroupedGemm::run(cudaStream_t stream) const {
  std::visit(
      [&](auto& gemm) {
        parts::check(gemm.run(stream, nullptr, programmatic_launch()), kName, "run");
      },
      kernel_->gemm);
}

}  // namespace epmoe::cuda::experts::wgmma
