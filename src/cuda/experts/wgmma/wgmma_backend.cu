#include "cuda/experts/wgmma/wgmma_backend.hpp"

#include <algorithm>

#include "core/knob_table.hpp"
#include "cuda/cuda_check.hpp"

namespace epmoe::cuda::experts::wgmma {
namespace {

Scratch slice_scratch(std::uint8_t* base, const ExpertProblem& e, std::size_t pairs,
                      std::size_t* bytes) {
  const auto h = static_cast<std::size_t>(e.hidden), i = static_cast<std::size_t>(e.intermediate);
  ScratchCursor cursor{base};
  Scratch s{};
  s.d = cursor.take<float>(pairs * std::max(2 * i, h));
  const auto block = static_cast<std::size_t>(e4m3_scale_block(e));
  if (runs_e4m3(e)) {
    s.a8 = cursor.take<std::uint8_t>(pairs * h);
    // The scales with the rows the E4M3 GEMM's partial tiles read beyond them.
    const std::size_t pad = Fp8BlockwiseGroupedGemm::kScalePadRows;
    s.a8_scale = cursor.take<float>((pairs + pad) * (h / block));
    s.h8 = cursor.take<std::uint8_t>(pairs * i);
    s.h8_scale = cursor.take<float>((pairs + pad) * (i / block));
  } else {
    s.a1 = cursor.take<std::uint16_t>(pairs * h);
    s.h16 = cursor.take<std::uint16_t>(pairs * i);
    s.h_scale = cursor.take<float>(pairs);
  }
  if (block != 0) s.homes = cursor.take<protocol::HomeSlot>(pairs);  // mxfp8, mxfp4, fp8_block128
  if (block != 0 && !runs_e4m3(e) && base != nullptr) {
    // mxfp8, mxfp4: the E4M3 operands inside the bf16 ones (n codes and n / 32 floats: 1.125 n of 2
    // n bytes; the rows' scales 16-byte aligned, as the kernels read them)
    const auto inside = [&](std::uint16_t* bf16, std::size_t n, std::uint8_t** codes,
                            float** scales) {
      *codes = reinterpret_cast<std::uint8_t*>(bf16);
      *scales = reinterpret_cast<float*>(*codes + protocol::align16(n));
    };
    inside(s.a1, pairs * h, &s.a8, &s.a8_scale);
    inside(s.h16, pairs * i, &s.h8, &s.h8_scale);
  }
  *bytes = cursor.used;
  return s;
}

// What the packed FC2 on `tile` stores: bf16 rows (the staged combine's `output`) only on nvfp4's
// 16-row decoding tile. Measured on one H100 (bench/RESULTS.md, session 32), the larger tiles'
// bf16 rows made qwen3's FC2 at T = 8192 slower by 0.38 ms (mxfp8) and 0.66 ms (nvfp4) where
// the 16-row tile's saved 8 us at T = 1; the E4M3 tile stores sums (its few rows make D's bytes
// negligible, and the rows' registers made the persistent E4M3 round spill).
GemmOutput packed_fc2_output(PackedTokenTile tile, GemmOutput output) {
  return tile == PackedTokenTile::t16 ? output : GemmOutput::fp32_sums;
}

// fp8_block128's weights as the E4M3 tile reads them (packed_gemm.hpp): its codes, and its fp32
// block scales through PackedMatrices' `scales`.
PackedWeights e4m3_tile_weights(const Fp8BlockWeights& w) {
  const auto view = [](const Fp8BlockMatrices& m) {
    return PackedMatrices{
        m.codes, reinterpret_cast<std::uint8_t*>(m.scales), nullptr, nullptr, m.rows, m.cols};
  };
  return PackedWeights{Precision::fp8_block128, view(w.w13), view(w.w2)};
}

// The bf16 tile a bucket's knobs name (with_knobs left only tiles that ship: core::wgmma_has_tile).
Bf16Tile bf16_tile(const Knobs& k) {
  return k.block_n == 256 ? Bf16Tile::m128_n256_k64 : Bf16Tile::m128_n128_k64;
}

// The GEMM (or pair) in `owned` for which `same` holds, made by `make` (and kept) if none is.
template <class Owned, class Same, class Make>
const Owned& find_or_make(std::vector<Owned>& owned, Same same, Make make) {
  for (const Owned& o : owned)
    if (same(o)) return o;
  owned.push_back(make());
  return owned.back();
}

}  // namespace

std::string WgmmaBackend::can_implement(const LayerConfig& config) {
  const LayerShape& s = config.shape();
  const int h = static_cast<int>(s.hidden), i = static_cast<int>(s.intermediate);
  const ExpertProblem problem = expert_problem(config);
  const int experts = static_cast<int>(problem.local_experts);
  // Why the GEMM that runs an FC of N x K in this precision cannot take it (nullptr: it can).
  const auto cannot_take = [&](int n, int k) -> const char* {
    if (runs_packed(problem))
      return PackedGroupedGemm::cannot_take(problem.precision, experts, n, k);
    if (runs_e4m3(problem)) return Fp8BlockwiseGroupedGemm::cannot_take(n, k);
    return Bf16GroupedGemm::cannot_take(n, k);
  };
  const char* fc1 = fc1_epilogue_activates(problem) ? Bf16GluGroupedGemm::cannot_take(problem)
                                                    : cannot_take(2 * i, h);
  if (fc1 == nullptr && packed_fc1_activates(problem))
    fc1 = PackedGroupedGemm::cannot_activate(problem.precision, 2 * i);
  const char* fc2 = cannot_take(h, i);
  if (fc1 != nullptr || fc2 != nullptr)
    return "hidden=" + std::to_string(h) + ", intermediate=" + std::to_string(i) +
           (fc1 != nullptr ? std::string(": FC1: ") + fc1 : std::string(": FC2: ") + fc2);
  // with_knobs moves every bucket's tile onto one this backend ships; a config that bypassed it
  // would be named here.
  for (int b = 0; b < kNumTokenBuckets; ++b) {
    const Knobs& k = config.knobs(static_cast<TokenBucket>(b));
    if (!core::wgmma_has_tile(config.precision(), k.block_m, k.block_n))
      return std::string("knobs.") + to_string(static_cast<TokenBucket>(b)) +
             ".block_m=" + std::to_string(k.block_m) + ", block_n=" + std::to_string(k.block_n) +
             ": no such tile (128 x 128, and 128 x 256 for the bf16 GEMMs)";
  }
  return {};
}

WgmmaBackend::WgmmaBackend(const LayerConfig& config, int device)
    : problem_(expert_problem(config)),
      fc2_output_(config.options().combine == Combine::staged ? GemmOutput::bf16_rows
                                                              : GemmOutput::fp32_sums) {
  if (fp8())
    fp8_weights_ = std::make_unique<DeviceFp8BlockWeights>(problem_);
  else if (packed())
    packed_weights_ = std::make_unique<DevicePackedWeights>(problem_);
  else
    weights_ = std::make_unique<DeviceBf16CodeWeights>(
        problem_, fc1_epilogue_activates(problem_) ? GateUp::interleaved : GateUp::stacked);
  const std::size_t scratch_rows = max_pairs(config);  // every bucket's GEMMs read this scratch
  runs_ = per_bucket(config, [&](const Knobs& k, TokenBucket bucket) {
    const std::int64_t max_tokens =
        std::min(bucket_max_tokens(bucket), config.shape().max_tokens_per_rank);
    const bool rows16 =
        core::wgmma_16_row_tile(config.precision(), config.world(), config.shape(), bucket, k);
    return make_bucket_run(k, device,
                           bucket_pairs(max_tokens, config.world(), config.shape().top_k),
                           static_cast<std::int64_t>(scratch_rows), rows16);
  });
  slice_scratch(nullptr, problem_, scratch_rows, &scratch_bytes_);
  EPMOE_CUDA_CHECK(cudaMalloc(&scratch_memory_, scratch_bytes_));
  scratch_ = slice_scratch(scratch_memory_, problem_, scratch_rows, &scratch_bytes_);
}

// A bucket's GEMMs, made once per (tile, SM count) and shared by the buckets that name the same,
// and its step grids: all of it at creation (nothing is made or sized in forward).
GemmOutput WgmmaBackend::BucketRun::fc2_output() const {
  if (fp8_fc2 != nullptr) return fp8_fc2->output();
  return packed_fc2 != nullptr ? packed_fc2->output() : fc2->output();
}

WgmmaBackend::BucketRun WgmmaBackend::make_bucket_run(const Knobs& k, int device,
                                                      std::int64_t max_pairs,
                                                      std::int64_t scratch_rows, bool rows16) {
  const int experts = static_cast<int>(problem_.local_experts);
  const int h = static_cast<int>(problem_.hidden), i = static_cast<int>(problem_.intermediate);
  const int sms = grid_sms(device, k.num_sms);
  BucketRun run;
  if (fp8() && !rows16) {  // (fp8_block128's few rows per expert run the packed GEMM's E4M3 tile)
    const Fp8Gemms& g = find_or_make(
        fp8_gemms_, [&](const Fp8Gemms& p) { return p.fc1->sm_count() == sms; },
        [&] {
          return Fp8Gemms{std::make_unique<Fp8BlockwiseGroupedGemm>(experts, 2 * i, h, scratch_rows,
                                                                    sms, device),
                          std::make_unique<Fp8BlockwiseGroupedGemm>(experts, h, i, scratch_rows,
                                                                    sms, device, fc2_output_)};
        });
    run.fp8_fc1 = g.fc1.get();
    run.fp8_fc2 = g.fc2.get();
  } else if (packed() || fp8()) {
    const PackedTokenTile rows16_tile =
        problem_.precision == Precision::nvfp4 ? PackedTokenTile::t16 : PackedTokenTile::t16_e4m3;
    const PackedTokenTile tile = rows16             ? rows16_tile
                                 : k.block_m == 64  ? PackedTokenTile::t64
                                 : k.block_m == 256 ? PackedTokenTile::t256
                                                    : PackedTokenTile::t128;
    const PackedGemms& g = find_or_make(
        packed_gemms_,
        [&](const PackedGemms& p) { return p.fc1->sm_count() == sms && p.fc1->tile() == tile; },
        [&] {
          const PackedFc1Epilogue epilogue{problem_.activation, problem_.swiglu_limit,
                                           problem_.rounding};
          return PackedGemms{std::make_unique<PackedGroupedGemm>(
                                 problem_.precision, experts, 2 * i, h, sms, device, tile,
                                 packed_fc1_activates(problem_) ? &epilogue : nullptr),
                             std::make_unique<PackedGroupedGemm>(
                                 problem_.precision, experts, h, i, sms, device, tile, nullptr,
                                 packed_fc2_output(tile, fc2_output_))};
        });
    run.packed_fc1 = g.fc1.get();
    run.packed_fc2 = g.fc2.get();
    run.fc2_sends_home = g.fc2->sends_home_kernel() && k.token_back == TokenBack::epilogue_warps;
  } else {
    // bf16: FC1 activates in its epilogue (fc1_epilogue_activates; can_implement refused any layer
    // Bf16GluGroupedGemm cannot take), FC2 on the bucket's tile
    const GluTile glu_tile = k.block_m == 64 ? GluTile::m64_n128_k64 : GluTile::m128_n128_k64;
    run.glu_fc1 =
        find_or_make(
            glu_gemms_,
            [&](const std::unique_ptr<Bf16GluGroupedGemm>& g) {
              return g->sm_count() == sms && g->tile() == glu_tile;
            },
            [&] { return std::make_unique<Bf16GluGroupedGemm>(problem_, sms, device, glu_tile); })
            .get();
    const Bf16Tile tile = bf16_tile(k);
    run.fc2 = find_or_make(
                  gemms_,
                  [&](const std::unique_ptr<Bf16GroupedGemm>& g) {
                    return g->sm_count() == sms && g->tile() == tile;
                  },
                  [&] {
                    return std::make_unique<Bf16GroupedGemm>(experts, h, i, sms, device, tile,
                                                             fc2_output_);
                  })
                  .get();
  }
  run.shapes = step_shapes(problem_, device, k.num_sms, max_pairs, run.fc2_output());
  return run;
}

Bf16Tile WgmmaBackend::tile(TokenBucket bucket) const {
  const BucketRun& run = runs_[bucket_index(bucket)];
  return run.fc2 != nullptr ? run.fc2->tile() : Bf16Tile::m128_n128_k64;
}

int WgmmaBackend::gemm_sms(TokenBucket bucket) const {
  const BucketRun& run = runs_[bucket_index(bucket)];
  if (run.fc2 != nullptr) return run.fc2->sm_count();
  return run.packed_fc2 != nullptr ? run.packed_fc2->sm_count() : run.fp8_fc1->sm_count();
}

bool WgmmaBackend::runs_e4m3_tile(TokenBucket bucket) const {
  const BucketRun& run = runs_[bucket_index(bucket)];
  return run.packed_fc1 != nullptr && run.packed_fc1->e4m3_tokens() &&
         packed_fc1_activates(problem_);
}

WgmmaBackend::E4m3Round WgmmaBackend::e4m3_round(const ExpertStep& step, TokenBucket bucket) const {
  const BucketRun& run = runs_[bucket_index(bucket)];
  if (!runs_e4m3_tile(bucket))
    throw Error(ErrorCode::internal, std::string("wgmma backend: bucket ") + to_string(bucket) +
                                         " does not run the E4M3 tile");
  const Params p = params(step, run);
  const PackedFc2Home home{step, p.biases.b2, p.scratch.homes};
  return E4m3Round{p,
                   run.packed_fc1->args(p.packed_weights.w13),
                   run.packed_fc2->args(p.packed_weights.w2, run.fc2_sends_home ? &home : nullptr),
                   run.packed_fc1->codes_map(p.packed_weights.w13),
                   run.packed_fc2->codes_map(p.packed_weights.w2),
                   run.fc2_sends_home};
}

WgmmaBackend::~WgmmaBackend() {
  cudaFree(scratch_memory_);
}

std::size_t WgmmaBackend::weight_bytes() const {
  const std::size_t bytes = fp8()      ? fp8_weights_->bytes()
                            : packed() ? packed_weights_->bytes()
                                       : weights_->bytes();
  return bytes + biases_.bytes();
}

std::size_t WgmmaBackend::scratch_bytes() const {
  std::size_t bytes = scratch_bytes_;
  for (const auto& g : glu_gemms_) bytes += g->device_bytes();
  for (const auto& g : gemms_) bytes += g->device_bytes();
  for (const Fp8Gemms& g : fp8_gemms_) bytes += g.fc1->device_bytes() + g.fc2->device_bytes();
  for (const PackedGemms& g : packed_gemms_) bytes += g.fc1->device_bytes() + g.fc2->device_bytes();
  return bytes;
}

void WgmmaBackend::prepare(const ExpertWeights& local, cudaStream_t stream) {
  if (fp8())
    fp8_weights_->prepare(local, stream);
  else if (packed())
    packed_weights_->prepare(local, stream);
  else
    weights_->prepare(local, stream);
  biases_.prepare(local, stream);
}

Params WgmmaBackend::params(const ExpertStep& step, const BucketRun& run) const {
  Params p{};
  p.step = step;
  p.problem = problem_;
  p.biases = biases_.biases();
  p.scratch = scratch_;
  if (p.fp8() && run.fp8_fc1 != nullptr) {
    p.fp8_weights = fp8_weights_->weights();
    p.fp8_fc1 = run.fp8_fc1->arrays();
    p.fp8_fc2 = run.fp8_fc2->arrays();
  } else if (p.packed() || p.fp8()) {
    p.packed_weights =
        p.fp8() ? e4m3_tile_weights(fp8_weights_->weights()) : packed_weights_->weights();
    p.packed_fc1 = run.packed_fc1->arrays();
    p.packed_fc2 = run.packed_fc2->arrays();
    p.packed_e4m3 = run.packed_fc1->e4m3_tokens();
    p.fc2_sends_home = run.fc2_sends_home;
  } else {
    p.weights = weights_->weights();
    p.glu_fc1 = run.glu_fc1->arrays();
    p.fc2 = run.fc2->arrays();
  }
  p.fc2_output = run.fc2_output();
  return p;
}

// plan_and_gather writes this bucket's GEMMs' arrays, which its GEMMs then read (a graph captured
// now keeps these GEMMs and grids).
void WgmmaBackend::launch_fc1(const ExpertStep& step, TokenBucket bucket,
                              cudaStream_t stream) const {
  const BucketRun& run = runs_[bucket_index(bucket)];
  const Params p = params(step, run);
  launch_plan_and_gather(p, run.shapes, stream);
  if (run.glu_fc1 != nullptr) {
    run.glu_fc1->run(stream);  // its epilogue activates: no activate kernel
    return;
  }
  if (run.fp8_fc1 != nullptr)
    run.fp8_fc1->run(stream);
  else
    run.packed_fc1->run(p.packed_weights.w13, stream);
  if (!p.fc1_made_h()) launch_activate(p, run.shapes, stream);
}

void WgmmaBackend::launch_fc2(const ExpertStep& step, TokenBucket bucket,
                              cudaStream_t stream) const {
  const BucketRun& run = runs_[bucket_index(bucket)];
  const Params p = params(step, run);
  if (run.fc2_sends_home) {  // the E4M3 tile's FC2 sends the results home itself
    const PackedFc2Home home{step, p.biases.b2, p.scratch.homes};
    run.packed_fc2->run(p.packed_weights.w2, stream, &home);
    return;
  }
  if (run.fp8_fc2 != nullptr)
    run.fp8_fc2->run(stream);
  else if (run.packed_fc2 != nullptr)
    run.packed_fc2->run(p.packed_weights.w2, stream);
  else
    run.fc2->run(stream);
  launch_home(p, run.shapes, stream);
}

}  // namespace epmoe::cuda::experts::wgmma
