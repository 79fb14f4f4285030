// reference::check_output: the one rule every checker applies to a layer's output against the
// emulating reference, per (combine, expert math), on synthetic bf16 vectors.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "epmoe/config.hpp"
#include "formats/codec.hpp"
#include "reference/reference.hpp"

namespace epmoe {
namespace {

using reference::check_output;
using reference::OutputCheck;

constexpr std::size_t kRows = 64, kCols = 64, kSize = kRows * kCols;
constexpr std::uint16_t kNaN = 0x7fc0, kOtherNaN = 0xffc1, kInf = 0x7f80;

struct Rule {
  Combine combine;
  ExpertMath math;
  Precision precision = Precision::bf16;
};
constexpr Rule kExactStaged{Combine::staged, ExpertMath::exact};
constexpr Rule kExactReduce{Combine::in_kernel_reduce, ExpertMath::exact};
constexpr Rule kTensorStaged{Combine::staged, ExpertMath::tensor_core};
constexpr Rule kTensorReduce{Combine::in_kernel_reduce, ExpertMath::tensor_core};
constexpr Rule kAll[] = {kExactStaged, kExactReduce, kTensorStaged, kTensorReduce};

std::string name(const Rule& r) {
  return std::string(to_string(r.combine)) + "/" + to_string(r.math);
}

OutputCheck check(const std::vector<std::uint16_t>& y, const std::vector<std::uint16_t>& ref,
                  const Rule& r) {
  return check_output(y, ref, r.combine, r.math, r.precision);
}

// [64, 64] bf16 values of magnitude in [0.5, 0.9), random signs: every element's ulp is 2^-8, and
// stays so after a bump of up to 16 ulps.
std::vector<std::uint16_t> reference_output(std::uint32_t seed = 1) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.5f, 0.9f);
  std::vector<std::uint16_t> out(kSize);
  for (auto& v : out) v = formats::float_to_bf16(rng() % 2 ? u(rng) : -u(rng));
  return out;
}

// Moves element i by `ulps` bf16 steps away from zero.
void bump(std::vector<std::uint16_t>& y, std::size_t i, int ulps) {
  y[i] = static_cast<std::uint16_t>(y[i] + ulps);
}

TEST(CheckOutput, IdenticalOutputsPassEveryRule) {
  const auto ref = reference_output();
  for (const Rule& r : kAll) {
    const OutputCheck c = check(ref, ref, r);
    EXPECT_TRUE(c.pass) << name(r);
    EXPECT_EQ(c.stats.mismatches, 0) << name(r);
    EXPECT_EQ(c.stats.max_abs, 0.0) << name(r);
    EXPECT_EQ(c.stats.rel_l2, 0.0) << name(r);
  }
}

TEST(CheckOutput, EmptyOutputsPassEveryRule) {
  for (const Rule& r : kAll) EXPECT_TRUE(check({}, {}, r).pass) << name(r);
}

TEST(CheckOutput, OneElementOffByOneUlpFailsOnlyExactStaged) {
  const auto ref = reference_output();
  auto y = ref;
  bump(y, 777, 1);
  const OutputCheck staged = check(y, ref, kExactStaged);
  EXPECT_FALSE(staged.pass);
  EXPECT_EQ(staged.stats.mismatches, 1);
  for (const Rule& r : {kExactReduce, kTensorStaged, kTensorReduce}) {
    const OutputCheck c = check(y, ref, r);
    EXPECT_TRUE(c.pass) << name(r);
    EXPECT_EQ(c.stats.mismatches, 0) << name(r);
    EXPECT_GT(c.stats.max_abs, 0.0) << name(r);
  }
}

TEST(CheckOutput, ExactInKernelReduceFailsTwoUlps) {
  const auto ref = reference_output();
  auto y = ref;
  bump(y, 5, 2);
  EXPECT_FALSE(check(y, ref, kExactReduce).pass);
  EXPECT_TRUE(check(y, ref, kTensorStaged).pass);  // 2 ulps is inside the tensor-core tolerance
}

TEST(CheckOutput, TensorCoreAllowsAFewFlippedStepsButNotMore) {
  // 0.1% of 4096 elements = 4 may differ by more than 2 ulps.
  const auto ref = reference_output();
  auto y = ref;
  for (std::size_t i : {3u, 900u, 2000u, 4000u}) bump(y, i, 8);
  for (const Rule& r : {kTensorStaged, kTensorReduce}) {
    const OutputCheck c = check(y, ref, r);
    EXPECT_TRUE(c.pass) << name(r) << " rel_l2=" << c.stats.rel_l2;
    EXPECT_EQ(c.stats.mismatches, 4) << name(r);
  }
  EXPECT_FALSE(check(y, ref, kExactStaged).pass);
  EXPECT_FALSE(check(y, ref, kExactReduce).pass);
  bump(y, 4001, 8);
  for (const Rule& r : {kTensorStaged, kTensorReduce}) {
    const OutputCheck c = check(y, ref, r);
    EXPECT_FALSE(c.pass) << name(r);
    EXPECT_EQ(c.stats.mismatches, 5) << name(r);
  }
}

TEST(CheckOutput, WgmmaAllowsOnePercentOfFlippedStepsButNotMore) {
  // 1% of 4096 elements = 40 may differ by more than 2 ulps (tensor_core: 4).
  const auto ref = reference_output();
  auto y = ref;
  for (std::size_t i = 0; i < 40; ++i) bump(y, i * 100 + 7, 4);
  const Rule wgmma{Combine::staged, ExpertMath::wgmma};
  OutputCheck c = check(y, ref, wgmma);
  EXPECT_TRUE(c.pass) << " rel_l2=" << c.stats.rel_l2;
  EXPECT_EQ(c.stats.mismatches, 40);
  EXPECT_FALSE(check(y, ref, kTensorStaged).pass);
  bump(y, 4001, 4);
  c = check(y, ref, wgmma);
  EXPECT_FALSE(c.pass);
  EXPECT_EQ(c.stats.mismatches, 41);
  EXPECT_NE(c.rule.find("wgmma: rel_l2 <= 4e-3 and at most max(1, 1%)"), std::string::npos);
}

TEST(CheckOutput, WgmmaOnE4m3BoundsOnlyRelL2) {
  // Every element off by 1 ulp (rel_l2 ~ 5.5e-3 for values in [0.5, 0.9)): the E4M3 rule passes
  // what the tensor-core rules fail (rel_l2 > 4e-3), and fails 3 ulps everywhere (~1.6e-2).
  const auto ref = reference_output();
  auto y = ref;
  for (std::size_t i = 0; i < y.size(); ++i) bump(y, i, 1);
  const Rule fp8{Combine::staged, ExpertMath::wgmma, Precision::fp8_block128};
  OutputCheck c = check(y, ref, fp8);
  EXPECT_TRUE(c.pass) << " rel_l2=" << c.stats.rel_l2;
  EXPECT_FALSE(check(y, ref, Rule{Combine::staged, ExpertMath::wgmma}).pass);
  EXPECT_EQ(c.rule, "wgmma on E4M3 (fp8_block128): rel_l2 <= 1e-2");
  for (std::size_t i = 0; i < y.size(); ++i) bump(y, i, 2);
  c = check(y, ref, fp8);
  EXPECT_FALSE(c.pass) << " rel_l2=" << c.stats.rel_l2;
  EXPECT_GT(c.stats.rel_l2, reference::kFp8GemmMaxRelL2);
}

// The E4M3 bound scales with I: two steps of an E4M3 code of h (2^-3 of its value each) over
// sqrt(I), never below the flat 1e-2, which models' shapes keep (qwen3's I = 768).
TEST(CheckOutput, WgmmaOnE4m3BoundScalesWithTheIntermediateWidth) {
  EXPECT_EQ(reference::fp8_gemm_max_rel_l2(0), reference::kFp8GemmMaxRelL2);
  EXPECT_EQ(reference::fp8_gemm_max_rel_l2(768), reference::kFp8GemmMaxRelL2);
  EXPECT_DOUBLE_EQ(reference::fp8_gemm_max_rel_l2(64), 0.03125);
  // Every element off by 2 ulps (rel_l2 ~ 1.1e-2): over the flat bound, inside I = 64's.
  const auto ref = reference_output();
  auto y = ref;
  for (std::size_t i = 0; i < y.size(); ++i) bump(y, i, 2);
  const OutputCheck flat =
      reference::check_output(y, ref, Combine::staged, ExpertMath::wgmma, Precision::mxfp8, 768);
  const OutputCheck tiny =
      reference::check_output(y, ref, Combine::staged, ExpertMath::wgmma, Precision::mxfp8, 64);
  EXPECT_FALSE(flat.pass) << " rel_l2=" << flat.stats.rel_l2;
  EXPECT_TRUE(tiny.pass) << " rel_l2=" << tiny.stats.rel_l2;
  EXPECT_EQ(tiny.rule, "wgmma on E4M3 (mxfp8): rel_l2 <= 0.0312");
  EXPECT_EQ(flat.rule, "wgmma on E4M3 (mxfp8): rel_l2 <= 1e-2");
}

// mxfp8's and mxfp4's wgmma GEMMs multiply E4M3 codes too (mxfp4's E2M1 weights as E4M3 codes):
// the same rule, naming the precision; their tensor_core and exact paths, and nvfp4's wgmma, keep
// theirs.
TEST(CheckOutput, WgmmaOnMxPrecisionsBoundsOnlyRelL2LikeFp8Block128) {
  const auto ref = reference_output();
  auto y = ref;
  for (std::size_t i = 0; i < y.size(); ++i) bump(y, i, 1);
  const OutputCheck c = check(y, ref, Rule{Combine::staged, ExpertMath::wgmma, Precision::mxfp8});
  EXPECT_TRUE(c.pass) << " rel_l2=" << c.stats.rel_l2;
  EXPECT_EQ(c.rule, "wgmma on E4M3 (mxfp8): rel_l2 <= 1e-2");
  EXPECT_FALSE(
      check(y, ref, Rule{Combine::staged, ExpertMath::tensor_core, Precision::mxfp8}).pass);
  const OutputCheck mxfp4 =
      check(y, ref, Rule{Combine::staged, ExpertMath::wgmma, Precision::mxfp4});
  EXPECT_TRUE(mxfp4.pass) << " rel_l2=" << mxfp4.stats.rel_l2;
  EXPECT_EQ(mxfp4.rule, "wgmma on E4M3 (mxfp4): rel_l2 <= 1e-2");
  EXPECT_FALSE(
      check(y, ref, Rule{Combine::staged, ExpertMath::tensor_core, Precision::mxfp4}).pass);
  EXPECT_FALSE(check(y, ref, Rule{Combine::staged, ExpertMath::wgmma, Precision::nvfp4}).pass);
}

TEST(CheckOutput, TensorCoreJudgesNearlyCancellingOutputsAgainstTheRms) {
  // Outputs near zero have ulps far below accumulation noise: up to 1e-3 x rms(ref) (here ~7e-4)
  // beyond 2 ulps is noise on any element; more is a mismatch. Exact maths still count them all.
  auto ref = reference_output();
  for (std::size_t i = 0; i < 40; ++i) ref[i] = formats::float_to_bf16(1e-4f);
  auto y = ref;
  for (std::size_t i = 0; i < 40; ++i) y[i] = formats::float_to_bf16(4e-4f);  // ~80 ulps of 1e-4
  for (const Rule& r : {kTensorStaged, kTensorReduce}) {
    const OutputCheck c = check(y, ref, r);
    EXPECT_TRUE(c.pass) << name(r);
    EXPECT_EQ(c.stats.mismatches, 0) << name(r);
  }
  EXPECT_EQ(check(y, ref, kExactReduce).stats.mismatches, 40);
  for (std::size_t i = 0; i < 40; ++i) y[i] = formats::float_to_bf16(5e-3f);  // beyond the floor
  EXPECT_EQ(check(y, ref, kTensorStaged).stats.mismatches, 40);
  EXPECT_FALSE(check(y, ref, kTensorStaged).pass);
}

// The bf16 GEMMs' per-element floor scales with I: a flipped bf16 step of h moves its token's row
// by about 2^-7 |h| / sqrt(I) of rms(ref), so max(1e-3, 2^-5 / sqrt(I)); 1e-3 from I = 977 on.
TEST(CheckOutput, TensorCoreFloorScalesWithTheIntermediateWidth) {
  EXPECT_EQ(reference::bf16_gemm_rms_floor(0), reference::kTensorCoreRmsFloor);
  EXPECT_EQ(reference::bf16_gemm_rms_floor(2048), reference::kTensorCoreRmsFloor);
  EXPECT_DOUBLE_EQ(reference::bf16_gemm_rms_floor(64), 0.00390625);
  // 50 outputs (more than wgmma's 1 % of 4096) near zero off by ~2.6e-3 x rms(ref): beyond the flat
  // floor, inside I = 64's.
  auto ref = reference_output();
  for (std::size_t i = 0; i < 50; ++i) ref[i] = formats::float_to_bf16(1e-4f);
  auto y = ref;
  for (std::size_t i = 0; i < 50; ++i) y[i] = formats::float_to_bf16(2e-3f);
  for (const ExpertMath math : {ExpertMath::tensor_core, ExpertMath::wgmma}) {
    const OutputCheck tiny =
        reference::check_output(y, ref, Combine::staged, math, Precision::bf16, 64);
    const OutputCheck wide =
        reference::check_output(y, ref, Combine::staged, math, Precision::bf16, 2048);
    EXPECT_TRUE(tiny.pass) << to_string(math) << " mismatches=" << tiny.stats.mismatches;
    EXPECT_EQ(tiny.stats.mismatches, 0) << to_string(math);
    EXPECT_EQ(wide.stats.mismatches, 50) << to_string(math);
    EXPECT_FALSE(wide.pass) << to_string(math);
  }
  EXPECT_EQ(reference::output_rule(Combine::staged, ExpertMath::tensor_core, Precision::bf16, 64),
            "tensor_core: rel_l2 <= 4e-3 and at most max(1, 0.1%) of the elements beyond 2 bf16 "
            "ulps + max(1e-6, 0.00391 x rms(ref))");
  EXPECT_EQ(reference::output_rule(Combine::staged, ExpertMath::wgmma, Precision::nvfp4, 2048),
            "wgmma: rel_l2 <= 4e-3 and at most max(1, 1%) of the elements beyond 2 bf16 ulps + "
            "max(1e-6, 1e-3 x rms(ref))");
}

TEST(CheckOutput, TensorCoreAllowsOneOutlierInASmallOutput) {
  // Fewer than 1000 elements: max(1, 0.1%) = 1.
  auto ref = reference_output();
  ref.resize(640);
  auto y = ref;
  bump(y, 10, 8);
  EXPECT_TRUE(check(y, ref, kTensorStaged).pass);
  bump(y, 11, 8);
  EXPECT_FALSE(check(y, ref, kTensorStaged).pass);
}

TEST(CheckOutput, TensorCoreFailsSmallErrorsEverywhereAboveTheRelL2Bound) {
  // Every element 1 ulp off (2^-8 on values in [0.5, 0.9)): each is within tolerance, but the
  // relative L2 error is ~0.5%, above 4e-3.
  const auto ref = reference_output();
  auto y = ref;
  for (std::size_t i = 0; i < kSize; ++i) bump(y, i, 1);
  const OutputCheck c = check(y, ref, kTensorStaged);
  EXPECT_EQ(c.stats.mismatches, 0);
  EXPECT_GT(c.stats.rel_l2, reference::kTensorCoreMaxRelL2);
  EXPECT_FALSE(c.pass);
  EXPECT_TRUE(check(y, ref, kExactReduce).pass);  // the per-element rule alone
}

TEST(CheckOutput, AGarbageRowFailsEveryRule) {
  const auto ref = reference_output();
  auto y = ref;
  const auto garbage = reference_output(99);
  for (std::size_t j = 0; j < kCols; ++j) y[7 * kCols + j] = garbage[j];
  for (const Rule& r : kAll) {
    const OutputCheck c = check(y, ref, r);
    EXPECT_FALSE(c.pass) << name(r);
    EXPECT_GT(c.stats.mismatches, 8) << name(r);
  }
  EXPECT_GT(check(y, ref, kTensorStaged).stats.rel_l2, reference::kTensorCoreMaxRelL2);
}

TEST(CheckOutput, NaNAgainstNaNInTheSamePlaceIsEqual) {
  auto ref = reference_output();
  auto y = ref;
  ref[42] = kNaN;
  y[42] = kOtherNaN;  // any NaN equals any NaN
  ref[43] = y[43] = kInf;
  for (const Rule& r : kAll) {
    const OutputCheck c = check(y, ref, r);
    EXPECT_TRUE(c.pass) << name(r);
    EXPECT_EQ(c.stats.mismatches, 0) << name(r);
    EXPECT_EQ(c.stats.rel_l2, 0.0) << name(r);
    EXPECT_EQ(c.stats.max_abs, 0.0) << name(r);
  }
}

TEST(CheckOutput, NaNAgainstANumberIsAMismatchUnderEveryRule) {
  const auto ref = reference_output();
  for (bool nan_in_y : {true, false}) {
    auto y = ref;
    auto r2 = ref;
    (nan_in_y ? y : r2)[100] = kNaN;
    for (const Rule& r : kAll) {
      const OutputCheck c = check(y, r2, r);
      EXPECT_FALSE(c.pass) << name(r) << " nan_in_y=" << nan_in_y;
      EXPECT_EQ(c.stats.mismatches, 1) << name(r);
    }
  }
}

TEST(CheckOutput, InfinityAgainstANumberOrTheOtherInfinityIsAMismatchUnderEveryRule) {
  const auto ref = reference_output();
  for (std::uint16_t bad : {kInf, static_cast<std::uint16_t>(kInf | 0x8000)}) {
    auto y = ref;
    auto r2 = ref;
    y[200] = bad;
    r2[300] = kInf;
    y[300] = static_cast<std::uint16_t>(kInf | 0x8000);
    for (const Rule& r : kAll) {
      const OutputCheck c = check(y, r2, r);
      EXPECT_FALSE(c.pass) << name(r);
      EXPECT_EQ(c.stats.mismatches, 2) << name(r);
    }
  }
}

TEST(CheckOutput, OutputsOfDifferentSizesFailEveryRule) {
  const auto ref = reference_output();
  const std::vector<std::uint16_t> y(ref.begin(), ref.end() - 1);
  for (const Rule& r : kAll) EXPECT_FALSE(check(y, ref, r).pass) << name(r);
}

TEST(CheckOutput, NamesItsRule) {
  EXPECT_EQ(check({}, {}, kExactStaged).rule, "staged: bit-exact");
  EXPECT_EQ(check({}, {}, kExactReduce).rule, "in_kernel_reduce: within 1 bf16 ulp + 1e-6");
  EXPECT_EQ(check({}, {}, kTensorStaged).rule, check({}, {}, kTensorReduce).rule);
  EXPECT_NE(check({}, {}, kTensorStaged).rule.find("tensor_core"), std::string::npos);
  EXPECT_EQ(reference::output_rule(Combine::staged, ExpertMath::exact, Precision::bf16),
            "staged: bit-exact");
}

}  // namespace
}  // namespace epmoe
