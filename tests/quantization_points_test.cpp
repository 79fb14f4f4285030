// The host quantization points of the checkpoint precisions (math/quantize.*, docs/design.md §6)
// equal the public codec API (epmoe/formats.hpp) bit for bit: fp8_block128 weights tiled
// 128 x 128 along (rows, K), its activations 1 x 128 along K, mxfp4 weights MXFP4 and an mxfp4
// layer's activations MXFP8. The reference, the CPU executor and the GPU weight preparation all
// take these functions as their oracle.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "epmoe/formats.hpp"
#include "math/quantize.hpp"

namespace epmoe {
namespace {

// Values whose magnitude changes from row to row and column to column, so that a 128 x 128 tile's
// amax differs from each of its rows' amax (a row-wise encoder would give other bytes), with an
// all-zero region and signed zeros.
std::vector<float> uneven_matrix(std::int64_t rows, std::int64_t cols, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      x[static_cast<std::size_t>(r * cols + c)] =
          u(rng) * std::ldexp(1.0f, static_cast<int>((r * 7 + c / 32) % 13) - 6);
  for (std::int64_t r = 0; r < std::min<std::int64_t>(rows, 3); ++r)
    for (std::int64_t c = 0; c < cols; ++c) x[static_cast<std::size_t>(r * cols + c)] = 0.0f;
  if (rows * cols > 4) x[static_cast<std::size_t>(cols + 1)] = -0.0f;
  return x;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> fp8_block128_round_trip(const std::vector<float>& x, std::int64_t rows,
                                           std::int64_t cols, Fp8Blocks blocks) {
  const std::int64_t scale_cols = (cols + 127) / 128;
  const std::int64_t scale_rows = blocks == Fp8Blocks::tile_128x128 ? (rows + 127) / 128 : rows;
  std::vector<std::uint8_t> elements(x.size());
  std::vector<float> scales(static_cast<std::size_t>(scale_rows * scale_cols)), out(x.size());
  quantize_fp8_block128(x.data(), rows, cols, blocks, elements.data(), scales.data());
  dequantize_fp8_block128(elements.data(), scales.data(), rows, cols, blocks, out.data());
  return out;
}

TEST(QuantizationPoints, Fp8Block128WeightsTakeOneScalePer128x128TileWithPartialEdgeTiles) {
  // 200 rows = a tile row 128 high and one 72 high; 192 cols = a 128-wide and a 64-wide tile.
  for (const auto& [rows, cols] :
       {std::pair<std::int64_t, std::int64_t>{200, 192}, {128, 64}, {384, 320}, {64, 64}}) {
    const auto w = uneven_matrix(rows, cols, 11);
    const auto got = math::emulate_weight_matrix(w.data(), rows, cols, Precision::fp8_block128,
                                                 ScaleRounding::rceil);
    EXPECT_TRUE(same_bits(got, fp8_block128_round_trip(w, rows, cols, Fp8Blocks::tile_128x128)))
        << rows << " x " << cols;
    if (rows > 4) {
      EXPECT_FALSE(same_bits(got, fp8_block128_round_trip(w, rows, cols, Fp8Blocks::row_1x128)))
          << "the tile's amax spans its rows";
    }
  }
}

TEST(QuantizationPoints, Fp8Block128ActivationsTakeOneScalePer1x128RunAlongK) {
  for (const std::int64_t n : {64, 192, 2880, 7168}) {
    auto x = uneven_matrix(4, n, 5);
    std::vector<float> row(x.end() - n, x.end());
    const std::vector<float> want = fp8_block128_round_trip(row, 1, n, Fp8Blocks::row_1x128);
    math::emulate_activation_row(row.data(), n, Precision::fp8_block128, ScaleRounding::rceil);
    EXPECT_TRUE(same_bits(row, want)) << "n=" << n;
  }
}

TEST(QuantizationPoints, Mxfp4WeightsAreMxfp4WithTheLayersScaleRounding) {
  const std::int64_t rows = 96, cols = 192;
  const auto w = uneven_matrix(rows, cols, 3);
  for (ScaleRounding rounding : {ScaleRounding::rceil, ScaleRounding::ocp_floor}) {
    std::vector<std::uint8_t> packed(w.size() / 2), scales(w.size() / 32);
    std::vector<float> want(w.size());
    quantize_mxfp4(w.data(), rows, cols, packed.data(), scales.data(), rounding);
    dequantize_mxfp4(packed.data(), scales.data(), rows, cols, want.data());
    float s_enc = 0.0f;
    EXPECT_TRUE(same_bits(
        math::emulate_weight_matrix(w.data(), rows, cols, Precision::mxfp4, rounding, &s_enc),
        want))
        << to_string(rounding);
    EXPECT_EQ(s_enc, 1.0f) << "the tensor-core operand is the value itself";
  }
}

TEST(QuantizationPoints, Mxfp4LayersActivationsAreMxfp8) {
  for (ScaleRounding rounding : {ScaleRounding::rceil, ScaleRounding::ocp_floor}) {
    const std::int64_t n = 2880;
    auto x = uneven_matrix(4, n, 9);
    std::vector<float> row(x.end() - n, x.end()), want(static_cast<std::size_t>(n));
    std::vector<std::uint8_t> elements(static_cast<std::size_t>(n)), scales(n / 32);
    quantize_mxfp8(row.data(), 1, n, elements.data(), scales.data(), rounding);
    dequantize_mxfp8(elements.data(), scales.data(), 1, n, want.data());
    math::emulate_activation_row(row.data(), n, Precision::mxfp4, rounding);
    EXPECT_TRUE(same_bits(row, want)) << to_string(rounding);
  }
}

}  // namespace
}  // namespace epmoe
