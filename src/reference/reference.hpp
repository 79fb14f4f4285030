// The oracle: a plain, obviously-correct forward of the whole layer for one rank's tokens.
//
// forward() emulates every quantization point of the precision (input rows on the wire, weights,
// the activation's output) with float64 accumulation, the biases added to each GEMM's float64 sum
// (math::biased), and the combine of the chosen mode in its
// fixed order: staged = each FC2 row rounded to bf16 (the wire), weighted sum in fp32 over slots
// 0..K-1; in_kernel_reduce = fp32 weighted sum of the fp32 FC2 rows over slots 0..K-1.
// forward_exact() is the unquantized float64 forward, for error reports.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "epmoe/config.hpp"

namespace epmoe::reference {

// All experts of the layer in bf16 (the weights as a checkpoint gives them), and their optional
// biases in fp32 (empty = none; a bf16 checkpoint's biases widen exactly).
struct LayerWeights {
  std::vector<std::uint16_t> w13;  // [E, 2I, H]
  std::vector<std::uint16_t> w2;   // [E, H, I]
  std::vector<float> b13;          // [E, 2I] gate biases then up biases, or empty
  std::vector<float> b2;           // [E, H], or empty
};

// One rank's inputs for one round.
struct Batch {
  std::int64_t tokens = 0;
  std::vector<std::uint16_t> x;        // [T, H] bf16
  std::vector<std::int32_t> topk_ids;  // [T, K], -1 = no expert
  std::vector<float> topk_weights;     // [T, K]
};

class ReferenceModel {
 public:
  ReferenceModel(const LayerShape& shape, Precision precision, const LayerOptions& options,
                 const LayerWeights& weights);
  ~ReferenceModel();

  // y: [T, H] bf16. Thread-safe: one model can serve every rank thread.
  std::vector<std::uint16_t> forward(const Batch& batch);
  // y: [T, H] float64, no quantization anywhere.
  std::vector<double> forward_exact(const Batch& batch) const;

 private:
  struct Expert;
  const Expert& expert(std::int64_t e);         // quantize-emulated on first use
  const float* bias_b13(std::int64_t e) const;  // nullptr without biases
  const float* bias_b2(std::int64_t e) const;

  LayerShape shape_;
  Precision precision_;
  LayerOptions options_;
  const LayerWeights& weights_;
  std::vector<std::unique_ptr<Expert>> experts_;
  std::unique_ptr<std::once_flag[]> prepared_;
};

// Error of `y` against a reference, for reports: max |y - ref| and ||y - ref|| / ||ref||.
struct ErrorStats {
  double max_abs = 0.0;
  double rel_l2 = 0.0;
  std::int64_t mismatches = 0;  // elements outside the tolerance given to compare()
};
ErrorStats compare_bf16(const std::vector<std::uint16_t>& y, const std::vector<std::uint16_t>& ref);
ErrorStats compare_exact(const std::vector<std::uint16_t>& y, const std::vector<double>& ref);
// Mismatch = differs by more than `ulps` bf16 ulps of the larger magnitude plus `abs_floor`.
ErrorStats compare_bf16_tolerant(const std::vector<std::uint16_t>& y,
                                 const std::vector<std::uint16_t>& ref, int ulps, double abs_floor);

// The one rule every checker (tests, `epmoe run|stress|bench`) applies to a layer's output `y`
// against ReferenceModel::forward() of the same options (docs/tuning.md, "Expert math"):
//   exact + staged:           bit-exact (compare_bf16);
//   exact + in_kernel_reduce: every element within 1 bf16 ulp + 1e-6 (fp32 adds in any order);
//   tensor_core, wgmma:       rel_l2 <= kTensorCoreMaxRelL2, and at most
//                             max(1, outlier_fraction(math) of the elements) differ by more
//                             than kTensorCoreUlps bf16 ulps + max(kAbsFloor,
//                             bf16_gemm_rms_floor(I) x rms(ref)) (accumulation-order noise may
//                             flip the quantization step
//                             of an intermediate value, and an output that nearly cancels has ulps
//                             far below that noise; a wrong tile fails). wgmma allows more
//                             outliers: Hopper's WGMMA adds each k16 product group into its fp32
//                             accumulator truncated (GpuGroupedGemm measures it), so its sums move
//                             about 10x further from the float64 ones than mma.sync's, and flip
//                             more quantization steps (docs/tuning.md, "Expert math").
// NaN against NaN in the same place is equal; NaN against a number is a mismatch (and makes
// rel_l2 NaN, so it fails every rule). Outputs of different sizes always fail.
inline constexpr double kAbsFloor = 1e-6;
inline constexpr int kInKernelReduceUlps = 1;
inline constexpr int kTensorCoreUlps = 2;
inline constexpr double kTensorCoreMaxRelL2 = 4e-3;
inline constexpr double kTensorCoreOutlierFraction = 1e-3;
inline constexpr double kWgmmaOutlierFraction = 1e-2;
inline constexpr double outlier_fraction(ExpertMath math) {
  return math == ExpertMath::wgmma ? kWgmmaOutlierFraction : kTensorCoreOutlierFraction;
}
// The per-element floor of the bf16-operand GEMMs (tensor_core, and wgmma but for its E4M3 GEMMs):
// bf16_gemm_rms_floor(I) x rms(ref), never below kTensorCoreRmsFloor. One bf16 step of an
// intermediate value h that flips against the reference's (2^-7 of it) moves its token's output row
// by about 2^-7 |h| / sqrt(I) of rms(ref) per element; the tail of the row's H elements and an |h|
// of a few rms make that up to 4x: 2^-5 / sqrt(I). At the tiny shape's I = 64 (3.9e-3) the flat
// 1e-3 failed one forward of 1000 in the GPU stress, tensor_core and wgmma alike (bench/RESULTS.md,
// session 30); from I = 977 on the flat floor holds. I = 0: the flat floor.
inline constexpr double kTensorCoreRmsFloor = 1e-3;
double bf16_gemm_rms_floor(std::int64_t intermediate);
// wgmma with fp8_block128, mxfp8 or mxfp4 multiplies E4M3 codes (mxfp4's E2M1 weights as E4M3):
// WGMMA's FP8 accumulation keeps fewer bits than fp32 inside each k128 (k32) block
// (GpuGroupedGemm.Fp8BlockScaled... measures 7.8e-5 of sum|a b|, the packed mxfp8 GEMM up to 4.4e-4
// on codes of every magnitude), and each E4M3 step of the intermediate h that flips against the
// reference's moves a whole output row a little, so only rel_l2 is bounded: rel_l2 <=
// fp8_gemm_max_rel_l2(I). One such step (an E4M3 code of h across a rounding boundary, 2^-3 of
// its value) moves rel_l2 by about 2^-3 / sqrt(I): 0.5 % at qwen3's I = 768, 1.6 % at the tiny
// shape's I = 64, where the flat kFp8GemmMaxRelL2 failed 3-6 of 1000 forwards in the GPU stress
// (bench/RESULTS.md, session 29). The bound allows two such steps; I = 0: the flat bound.
inline constexpr double kFp8GemmMaxRelL2 = 1e-2;
double fp8_gemm_max_rel_l2(std::int64_t intermediate);
inline constexpr bool fp8_gemm(ExpertMath math, Precision precision) {
  return math == ExpertMath::wgmma &&
         (precision == Precision::fp8_block128 || precision == Precision::mxfp8 ||
          precision == Precision::mxfp4);
}

struct OutputCheck {
  ErrorStats stats;  // mismatches: elements outside the rule's per-element tolerance
  bool pass = false;
  double ref_rms = 0.0;  // rms of ref's finite elements: the scale of the bf16 GEMMs' floor
  std::string rule;      // output_rule(combine, math, precision)
};
// `intermediate`: the layer's I, which the E4M3 GEMMs' bound and the bf16 GEMMs' per-element floor
// scale with (0: the flat ones).
OutputCheck check_output(const std::vector<std::uint16_t>& y, const std::vector<std::uint16_t>& ref,
                         Combine combine, ExpertMath math, Precision precision,
                         std::int64_t intermediate = 0);
// The rule as a short human string, for reports ("staged: bit-exact", ...).
std::string output_rule(Combine combine, ExpertMath math, Precision precision,
                        std::int64_t intermediate = 0);

}  // namespace epmoe::reference
