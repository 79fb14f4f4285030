// FC2 with each result sent home from its epilogue (grouped_gemm.hpp, Bf16HomeGroupedGemm): CUTLASS
// 4's SM90 pointer-array TMA + WGMMA cooperative kernel on 128 x 128 x 64 or 128 x 256 x 64 tiles
// (Bf16Tile) with an epilogue of ours (parts::NoSmemEpilogue): each accumulator row is one pair's
// result, whose destination (home rank, token, top-k slot, router weight) gather resolved; the
// epilogue divides by the row's and the expert's scales, adds b2 and sends each of its column
// pairs home (protocol::send_home2, the rule the home kernel and the other backends follow), so
// the values are those of the fp32-storing GEMM followed by the home kernel, bit for bit.
//
// A thread holds column pairs (2c, 2c + 1) of two rows (parts::accumulator_place): one HomeSlot and
// row scale per row half, looked up once per tile.
#include "cuda/experts/wgmma/grouped_gemm_parts.cuh"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "math/expert_row.hpp"  // math::biased, math::unscaled

#include <variant>

namespace epmoe::cuda::experts::wgmma {
namespace {

using namespace cute;

using parts::kGroupCols;
using parts::ProblemShape;
using ElementAB = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // [M, K]: the expert's h rows
using LayoutB = cutlass::layout::ColumnMajor;  // [N, K]: w2
constexpr int kAlignAB = 8;                    // 16 bytes: TMA
using ClusterShape = Shape<_1, _1, _1>;

struct HomeArguments {
  const HomeGroup* groups = nullptr;
  const TokenBackTarget* target = nullptr;
};

class HomeEpilogue : public parts::NoSmemEpilogue<HomeArguments> {
 public:
  using NoSmemEpilogue::NoSmemEpilogue;
  template <class Problems>
  static bool can_implement(Problems const&, Arguments const& args) {
    return args.groups != nullptr && args.target != nullptr;
  }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_mnkl, BlockShapeMNK blk_shape,
                                 BlockCoordMNKL blk_coord, Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    static_assert(is_static<FrgLayout>::value, "the accumulator layout is static");
    constexpr int kValues = decltype(size(acc))::value;
    static_assert(kValues % 4 == 0, "two rows of column pairs");
    const int m_count = get<0>(problem_mnkl);
    const int n_count = get<1>(problem_mnkl);
    const HomeGroup group = params_.groups[get<3>(blk_coord)];
    const TokenBackTarget& t = *params_.target;
    const parts::AccumulatorPlace place = parts::accumulator_place<kValues>(
        problem_mnkl, blk_shape, blk_coord, tiled_mma, thread_idx);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = place.row0 + 8 * half;
      if (row >= m_count) continue;
      const protocol::HomeSlot home = group.homes[row];
      const float h_scale = group.h_scale == nullptr ? 1.0f : group.h_scale[row];
      const protocol::CombineBuffer buffer =
          protocol::combine_buffer(t.peer_windows[home.rank], t.layout, t.top_k, t.combine);
#pragma unroll
      for (int i = 2 * half; i < kValues; i += 4) {
        const int col = place.col0 + kGroupCols * (i / 4);  // even; N is a multiple of 64
        if (col >= n_count) continue;
        const float v0 =
            math::biased(math::unscaled(acc(i), h_scale, group.w_scale), group.b2, col);
        const float v1 =
            math::biased(math::unscaled(acc(i + 1), h_scale, group.w_scale), group.b2, col + 1);
        protocol::send_home2(buffer, home, col / 2, v0, v1);
      }
    }
  }
};

template <class Tile>
struct HomeKernel {
  using Epilogue = parts::NoSmemEpilogueOf<HomeEpilogue>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA*, kAlignAB, ElementAB,
      LayoutB*, kAlignAB, float, Tile, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<0>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};
using Tile128x128 = HomeKernel<Shape<_128, _128, _64>>;
using Tile128x256 = HomeKernel<Shape<_128, _256, _64>>;
// NOTES: with no epilogue shared memory, 7 stages of (128 + 128) x 64 bf16 (32 KiB) fit, and 4 of
// (128 + 256) x 64 (48 KiB).
static_assert(Tile128x128::Mainloop::DispatchPolicy::Stages == 7, "128 x 128: 7 stages");
static_assert(Tile128x256::Mainloop::DispatchPolicy::Stages == 4, "128 x 256: 4 stages");

constexpr const char* kName = "wgmma FC2 grouped GEMM sending results home";

}  // namespace

struct Bf16HomeGroupedGemm::Kernel {
  std::variant<Tile128x128::Gemm, Tile128x256::Gemm> gemm;
};

Bf16HomeGroupedGemm::Bf16HomeGroupedGemm(int groups, int k, int sm_count, int device, Bf16Tile tile)
    : kernel_(std::make_unique<Kernel>()), tile_(tile), sm_count_(sm_count) {
  const auto g = static_cast<std::size_t>(groups);
  const cutlass::KernelHardwareInfo hw = parts::hardware(device, sm_count);
  const auto build = [&](auto kernel) {
    using K = decltype(kernel);
    parts::OwnEpilogueAllocation at;
    at.take_operands<K>(g);
    const std::size_t group_args = at.carve.take(g * sizeof(HomeGroup));
    const std::size_t target = at.carve.take(sizeof(TokenBackTarget));
    memory_ = at.finish<K>(groups, hw, &device_bytes_);
    arrays_ = HomeGemmArrays{reinterpret_cast<GemmProblem*>(memory_ + at.problems),
                             reinterpret_cast<const std::uint16_t**>(memory_ + at.a),
                             reinterpret_cast<const std::uint16_t**>(memory_ + at.b),
                             reinterpret_cast<HomeGroup*>(memory_ + group_args),
                             reinterpret_cast<TokenBackTarget*>(memory_ + target)};
    at.initialize<K>(kernel_->gemm.emplace<typename K::Gemm>(), memory_, groups, k, hw,
                     HomeArguments{arrays_.groups, arrays_.target}, kName);
  };
  if (tile == Bf16Tile::m128_n256_k64)
    build(Tile128x256{});
  else
    build(Tile128x128{});
}

Bf16HomeGroupedGemm::~Bf16HomeGroupedGemm() {
  cudaFree(memory_);
}

void Bf16HomeGroupedGemm::run(cudaStream_t stream) const {
  std::visit([&](auto& gemm) { parts::check(gemm.run(stream), kName, "run"); }, kernel_->gemm);
}

}  // namespace epmoe::cuda::experts::wgmma
