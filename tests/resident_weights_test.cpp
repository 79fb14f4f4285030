// Weights resident in their format (src/cuda/experts/resident.hpp, src/formats/matrix_bytes.hpp),
// on the host: the size formula against the format's definition, the resident layout against
// formats' host quantization, and the tiles' decoders against the host's emulation of the weight
// quantization point (math::emulate_weight_matrix, math::bf16_codes), exhaustively where the
// decoders take a shortcut. The same decoders run on the GPU (GpuWeights.*).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cuda/experts/resident.hpp"
#include "epmoe/config.hpp"
#include "epmoe/models.hpp"
#include "formats/codec.hpp"
#include "formats/matrix_bytes.hpp"
#include "math/quantize.hpp"
#include "support/resident_host.hpp"

namespace epmoe {
namespace {

using cuda::experts::kRun;
using cuda::experts::ResidentMatrices;

TEST(ResidentBytes, FormulaIsTheFormatsBytesPerElementPlusScales) {
  // A [4096, 2048] matrix: 8 Mi elements.
  const std::int64_t n = 4096 * 2048;
  EXPECT_EQ(formats::format_matrix_bytes(Precision::bf16, 4096, 2048), 2 * n);
  EXPECT_EQ(formats::format_matrix_bytes(Precision::mxfp8, 4096, 2048), n + n / 32);
  EXPECT_EQ(formats::format_matrix_bytes(Precision::nvfp4, 4096, 2048), n / 2 + n / 16 + 4);
}

// qwen3-30b-a3b (H 2048, I 768, 128 experts) at world 8: 16 local experts, 3 x 768 x 2048 weights
// each.
TEST(ResidentBytes, Qwen3PerRankIsBf16TwoBytesMxfp8OnePointZeroThreeNvfp4PointFiveSix) {
  const LayerShape shape{.hidden = 2048,
                         .intermediate = 768,
                         .num_experts = 128,
                         .top_k = 8,
                         .max_tokens_per_rank = 256};
  const std::int64_t params = 16 * 3 * 768 * 2048;  // 75,497,472
  EXPECT_EQ(formats::format_expert_weight_bytes(make_config(shape, Precision::bf16, 0, 8)),
            2 * params);
  EXPECT_EQ(formats::format_expert_weight_bytes(make_config(shape, Precision::mxfp8, 0, 8)),
            params + params / 32);
  EXPECT_EQ(formats::format_expert_weight_bytes(make_config(shape, Precision::nvfp4, 0, 8)),
            params / 2 + params / 16 + 16 * 2 * 4);
}

// A resident matrix holds what its own accessors say, and the formula counts exactly that.
TEST(ResidentBytes, LayoutHoldsExactlyTheFormulasBytes) {
  for (const Precision p : {Precision::bf16, Precision::mxfp8, Precision::nvfp4}) {
    const ResidentMatrices m{nullptr, nullptr, nullptr, 3, 192, 128, p};
    EXPECT_EQ(m.element_bytes() + m.scale_bytes() + (p == Precision::nvfp4 ? 3 * 4 : 0),
              3 * formats::format_matrix_bytes(p, 192, 128))
        << to_string(p);
  }
}

// Matrices with every character the formats care about: magnitudes over a wide range, exact ties,
// -0, an all-zero block, NaN and Inf, and a tiny-amax matrix (NVFP4 s_enc clamped to FLT_MAX).
std::vector<float> edge_matrices(std::int64_t experts, std::int64_t n) {
  std::vector<float> w(static_cast<std::size_t>(experts * n));
  std::uint64_t state = 0x2545f4914f6cdd1dull;
  const auto uniform = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<double>(state >> 11) * 0x1.0p-53 * 2.0 - 1.0);
  };
  for (std::int64_t e = 0; e < experts; ++e)
    for (std::int64_t i = 0; i < n; ++i) {
      float& v = w[static_cast<std::size_t>(e * n + i)];
      switch (e % 4) {
        case 0:
          v = uniform() * std::ldexp(1.0f, static_cast<int>(i % 29) - 14);
          break;
        case 1:
          v = uniform() * 1e-39f;
          break;
        case 2:
          v = i % 17 == 0 ? -0.0f : i % 13 == 0 ? 0.25f * static_cast<float>(i % 7) : uniform();
          if (i < 64) v = i == 5 ? -0.0f : 0.0f;
          break;
        default:
          v = i == 3     ? std::numeric_limits<float>::quiet_NaN()
              : i == 70  ? std::numeric_limits<float>::infinity()
              : i == 200 ? -std::numeric_limits<float>::infinity()
                         : uniform();
      }
    }
  return w;
}

// The preparation's encoder (encode_run) writes, run by run, the bytes of formats' host
// quantization, with the scales in resident record order; decode_values and decode_codes give
// math::emulate_weight_matrix and math::bf16_codes bit for bit.
TEST(ResidentLayout, EncodedRunsAreTheHostQuantizationAndDecodeToTheEmulatedWeights) {
  const std::int64_t experts = 4, rows = 128, cols = 192;
  const std::int64_t n = rows * cols;
  const std::vector<float> w = edge_matrices(experts, n);
  struct Case {
    Precision precision;
    ScaleRounding rounding;
  };
  for (const Case c :
       {Case{Precision::bf16, ScaleRounding::rceil}, Case{Precision::mxfp8, ScaleRounding::rceil},
        Case{Precision::mxfp8, ScaleRounding::ocp_floor},
        Case{Precision::nvfp4, ScaleRounding::rceil}}) {
    SCOPED_TRACE(std::string(to_string(c.precision)) + "/" + to_string(c.rounding));
    test::HostResident want;
    test::host_resident(w.data(), experts, rows, cols, c.precision, c.rounding, want);

    test::HostResident got;  // the same layout, filled by encode_run
    test::host_resident(w.data(), experts, rows, cols, c.precision, c.rounding, got);
    std::fill(got.elements.begin(), got.elements.end(), std::uint8_t{0xAB});
    std::fill(got.scales.begin(), got.scales.end(), std::uint8_t{0xAB});
    const ResidentMatrices& m = got.view;
    for (std::int64_t e = 0; e < experts; ++e) {
      const float s_enc = c.precision == Precision::nvfp4
                              ? formats::nvfp4_tensor_scale(formats::nvfp4_group_amax(&w[e * n], n))
                              : 1.0f;
      if (c.precision == Precision::nvfp4) {
        EXPECT_EQ(s_enc, want.s_enc[static_cast<std::size_t>(e)]);
      }
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t k = 0; k < cols; k += kRun) {
          float v[kRun];
          std::memcpy(v, &w[static_cast<std::size_t>(e * n + r * cols + k)], sizeof v);
          std::uint8_t* scales = c.precision == Precision::bf16 ? nullptr : m.run_scale(e, r, k);
          switch (c.precision) {
            case Precision::bf16:
              cuda::experts::encode_run<Precision::bf16>(v, c.rounding, s_enc, m.run(e, r, k),
                                                         scales);
              break;
            case Precision::mxfp8:
              cuda::experts::encode_run<Precision::mxfp8>(v, c.rounding, s_enc, m.run(e, r, k),
                                                          scales);
              break;
            case Precision::nvfp4:
              cuda::experts::encode_run<Precision::nvfp4>(v, c.rounding, s_enc, m.run(e, r, k),
                                                          scales);
              break;
          }
        }
    }
    EXPECT_TRUE(got.elements == want.elements) << "element bytes";
    EXPECT_TRUE(got.scales == want.scales) << "scale bytes";

    // Decoders against the host's emulation.
    for (std::int64_t e = 0; e < experts; ++e) {
      float s_enc = 1.0f;
      const std::vector<float> values = math::emulate_weight_matrix(
          &w[static_cast<std::size_t>(e * n)], rows, cols, c.precision, c.rounding, &s_enc);
      const std::vector<std::uint16_t> codes = math::bf16_codes(values, {s_enc});
      const ResidentMatrices& h = want.view;
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t k = 0; k < cols; k += kRun) {
          float dv[kRun];
          std::uint16_t dc[kRun];
          const std::uint8_t* scales =
              c.precision == Precision::bf16 ? nullptr : h.run_scale(e, r, k);
          switch (c.precision) {
            case Precision::bf16:
              cuda::experts::decode_values<Precision::bf16>(h.run(e, r, k), scales, s_enc, dv);
              cuda::experts::decode_codes<Precision::bf16>(h.run(e, r, k), scales, s_enc, dc);
              break;
            case Precision::mxfp8:
              cuda::experts::decode_values<Precision::mxfp8>(h.run(e, r, k), scales, s_enc, dv);
              cuda::experts::decode_codes<Precision::mxfp8>(h.run(e, r, k), scales, s_enc, dc);
              break;
            case Precision::nvfp4:
              cuda::experts::decode_values<Precision::nvfp4>(h.run(e, r, k), scales, s_enc, dv);
              cuda::experts::decode_codes<Precision::nvfp4>(h.run(e, r, k), scales, s_enc, dc);
              break;
          }
          for (int i = 0; i < kRun; ++i) {
            const auto at = static_cast<std::size_t>(r * cols + k + i);
            ASSERT_EQ(formats::float_bits(dv[i]), formats::float_bits(values[at]))
                << "value, expert " << e << " row " << r << " col " << k + i;
            ASSERT_EQ(dc[i], codes[at]) << "code, expert " << e << " row " << r << " col " << k + i;
          }
        }
    }
  }
}

// decode_codes' MXFP8 shortcut (the top half of e4m3 x 2^e) against the general rule
// (bf16(decode_values)) for every element code under every scale code, NaN scale included.
TEST(ResidentDecode, Mxfp8CodesEqualTheGeneralRuleForEveryElementAndScaleCode) {
  for (int scale = 0; scale < 256; ++scale)
    for (int first = 0; first < 256; first += kRun) {
      std::uint8_t elements[kRun];
      for (int i = 0; i < kRun; ++i) elements[i] = static_cast<std::uint8_t>(first + i);
      const auto s = static_cast<std::uint8_t>(scale);
      std::uint16_t fast[kRun], general[kRun];
      cuda::experts::decode_codes<Precision::mxfp8>(elements, &s, 1.0f, fast);
      cuda::experts::decode_codes_general<Precision::mxfp8>(elements, &s, 1.0f, general);
      for (int i = 0; i < kRun; ++i)
        ASSERT_EQ(fast[i], general[i]) << "scale " << scale << " element " << first + i;
    }
}

// decode_codes' NVFP4 shortcut (the top half of e2m1 x block scale) against the general rule for
// every nibble under every block-scale code, for s_enc across its whole shortcut range (every
// power of two with several significands, the ends exactly) and beyond it, where the general rule
// must take over.
TEST(ResidentDecode, Nvfp4CodesEqualTheGeneralRuleForEveryNibbleScaleAndSEnc) {
  std::vector<float> s_encs{formats::kFloatMax, 1.0f,           0x1.0p-115f,
                            0x1.0p116f,         2688.0f / 6.0f, 2688.0f / 1e-30f,
                            2688.0f / 3e38f};
  for (int e = -130; e <= 127; ++e)
    for (const float m : {1.0f, 1.0000001f, 1.2345678f, 1.5f, 1.75f, 1.9999999f})
      s_encs.push_back(std::ldexp(m, e));
  std::uint8_t packed[kRun / 2];
  for (int i = 0; i < kRun / 2; ++i)  // nibbles 0..15 twice: every code in both halves
    packed[i] = static_cast<std::uint8_t>((2 * i % 16) | ((2 * i + 1) % 16) << 4);
  for (const float s_enc : s_encs)
    for (int bs = 0; bs < 256; ++bs) {
      const std::uint8_t scales[2] = {static_cast<std::uint8_t>(bs),
                                      static_cast<std::uint8_t>(255 - bs)};
      std::uint16_t fast[kRun], general[kRun];
      cuda::experts::decode_codes<Precision::nvfp4>(packed, scales, s_enc, fast);
      cuda::experts::decode_codes_general<Precision::nvfp4>(packed, scales, s_enc, general);
      for (int i = 0; i < kRun; ++i)
        ASSERT_EQ(fast[i], general[i]) << "s_enc " << s_enc << " block scale " << bs << " i " << i;
    }
}

// The guard matters: outside its range the shortcut alone can be wrong (so the test above can
// fail). With a small s_enc (a matrix whose amax is near FLT_MAX) the largest products overflow:
// (6 x 448) / s_enc is Inf, and so is its bf16 code, where the shortcut would give 2688.
TEST(ResidentDecode, Nvfp4ShortcutAloneWouldBeWrongOutsideItsRange) {
  const float s_enc = 0x1.0p-120f;
  EXPECT_FALSE(cuda::experts::nvfp4_codes_are_exact(s_enc));
  EXPECT_FALSE(cuda::experts::nvfp4_codes_are_exact(0x1.0p117f));
  int wrong = 0;
  for (int bs = 1; bs < 0x7f; ++bs)
    for (std::uint8_t q = 1; q < 8; ++q) {
      const float p =
          formats::e2m1_to_float(q) * formats::e4m3_to_float(static_cast<std::uint8_t>(bs));
      wrong += cuda::experts::operand_code(p / s_enc, s_enc) !=
               static_cast<std::uint16_t>(formats::float_bits(p) >> 16);
    }
  EXPECT_GT(wrong, 0);
  // ... and decode_codes takes the general rule there.
  const std::uint8_t packed[kRun / 2] = {0x77, 0x77};  // 6, 6, ...
  const std::uint8_t scales[2] = {0x7e, 0x7e};         // 448
  std::uint16_t codes[kRun];
  cuda::experts::decode_codes<Precision::nvfp4>(packed, scales, s_enc, codes);
  EXPECT_EQ(codes[0], 0x7f80) << "bf16 +Inf";
}

}  // namespace
}  // namespace epmoe
