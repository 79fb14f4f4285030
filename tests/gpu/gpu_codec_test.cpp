// The codecs on the device against the device conversions of cuda_fp4.h / cuda_fp8.h, over the
// input classes tests/formats_test.cpp checks on the host: every fp32 bit pattern for the scalar
// encoders, and support/nvfp4_inputs.hpp's matrix through epmoe's CUDA NVFP4, fp8_block128 and
// MXFP4 codecs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <ios>
#include <vector>

#include "cuda/repeated_divisor.hpp"  // nvfp4_in_reciprocal_range
#include "epmoe/comm.hpp"
#include "epmoe/formats.hpp"
#include "formats/codec.hpp"
#include "gpu/codec_check.hpp"
#include "protocol/wire_codec.hpp"
#include "support/nvfp4_inputs.hpp"

namespace epmoe {
namespace {

TEST(GpuCodec, E2m1EncoderMatchesCudaFp4ConversionOnEveryFloat) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  const test::Disagreements d = test::e2m1_vs_cuda_on_every_float();
  EXPECT_EQ(d.count, 0u) << "first at |x| bits 0x" << std::hex << d.first_bits;
}

TEST(GpuCodec, PackedWeightDecodeInTheGemmsMatchesTheHostCodecOnEveryCode) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  for (const Precision p : {Precision::mxfp8, Precision::mxfp4, Precision::nvfp4}) {
    const test::Disagreements d = test::packed_decode_on_every_code(p);
    EXPECT_EQ(d.count, 0u) << to_string(p) << ": first at code << 8 | scale 0x" << std::hex
                           << d.first_bits;
  }
}

TEST(GpuCodec, PackedGemmE2m1DecodeMatchesTheHostCodecOnEveryCodeAndScale) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  for (const bool nvfp4 : {false, true}) {
    const test::Disagreements d = test::e2m1_bf16_decode_on_every_code(nvfp4);
    EXPECT_EQ(d.count, 0u) << (nvfp4 ? "NVFP4" : "MX") << ": first at code << 8 | scale 0x"
                           << std::hex << d.first_bits;
  }
}

TEST(GpuCodec, E4m3EncoderMatchesCudaFp8SatfiniteOnEveryFloat) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  const test::Disagreements d = test::e4m3_vs_cuda_on_every_float();
  EXPECT_EQ(d.count, 0u) << "first at |x| bits 0x" << std::hex << d.first_bits;
}

// Zero block scales (elements keep their sign: -0 = 0x8), ties, negatives that round to zero,
// rows of every magnitude, both scale groups.
TEST(GpuCodec, Nvfp4CudaCodecMatchesCudaConversionsOnEveryInputClass) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  std::int64_t rows = 0;
  const std::vector<float> x = test::nvfp4_input_matrix(&rows);
  const std::int64_t cols = test::kNvfp4InputCols;
  for (Nvfp4ScaleGroup group : {Nvfp4ScaleGroup::per_tensor, Nvfp4ScaleGroup::per_row}) {
    test::Nvfp4Bytes library, cuda;
    test::nvfp4_on_device(x, rows, cols, group, &library, &cuda);
    for (std::size_t r = 0; r < library.s_enc.size(); ++r) {  // s_enc is no conversion: the host's
      const float* from = x.data() + (group == Nvfp4ScaleGroup::per_row ? r * cols : 0);
      const std::int64_t n = group == Nvfp4ScaleGroup::per_row ? cols : rows * cols;
      ASSERT_EQ(library.s_enc[r], formats::nvfp4_tensor_scale(formats::nvfp4_group_amax(from, n)))
          << "row " << r;
    }
    ASSERT_EQ(library.scales, cuda.scales) << to_string(group);
    int negative_zeros = 0;
    for (std::size_t i = 0; i < library.packed.size(); ++i) {
      ASSERT_EQ(library.packed[i], cuda.packed[i]) << to_string(group) << ": byte " << i << " (x "
                                                   << x[2 * i] << ", " << x[2 * i + 1] << ")";
      negative_zeros += (library.packed[i] & 0xf) == 0x8;
    }
    EXPECT_GT(negative_zeros, 100) << "the signed-zero class is there";
  }
}

// fp8_block128 on the device: bit for bit the host codec, and every byte CUDA's conversion of the
// documented steps, for 1 x 128 runs and 128 x 128 tiles (support/nvfp4_inputs.hpp's rows, which
// include all-zero blocks with -0, ties, fp32 subnormals and FLT_MAX), plus a gpt-oss-like
// matrix whose last tile row and column are partial.
TEST(GpuCodec, Fp8Block128CudaCodecMatchesHostAndCudaConversions) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  std::int64_t rows = 0;
  const std::vector<float> classes = test::nvfp4_input_matrix(&rows);
  std::vector<float> partial(200 * 2880);
  for (std::size_t i = 0; i < partial.size(); ++i)
    partial[i] = classes[i % classes.size()] * (i % 7 == 0 ? -1.0f : 1.0f);
  const struct {
    const std::vector<float>* x;
    std::int64_t rows, cols;
  } inputs[] = {{&classes, rows, test::kNvfp4InputCols}, {&partial, 200, 2880}};
  for (const auto& in : inputs) {
    for (Fp8Blocks blocks : {Fp8Blocks::row_1x128, Fp8Blocks::tile_128x128}) {
      test::Fp8Block128Bytes library, cuda;
      test::fp8_block128_on_device(*in.x, in.rows, in.cols, blocks, &library, &cuda);
      std::vector<std::uint8_t> host_elements(library.elements.size());
      std::vector<float> host_scales(library.scales.size());
      quantize_fp8_block128(in.x->data(), in.rows, in.cols, blocks, host_elements.data(),
                            host_scales.data());
      ASSERT_EQ(library.elements, host_elements) << to_string(blocks) << " cols " << in.cols;
      ASSERT_EQ(library.elements, cuda.elements) << to_string(blocks) << " cols " << in.cols;
      for (std::size_t i = 0; i < host_scales.size(); ++i) {
        ASSERT_EQ(formats::float_bits(library.scales[i]), formats::float_bits(host_scales[i]))
            << to_string(blocks) << " scale " << i;
        ASSERT_EQ(formats::float_bits(library.scales[i]), formats::float_bits(cuda.scales[i]))
            << to_string(blocks) << " scale " << i;
      }
    }
  }
}

// MXFP4 on the device: bit for bit the host codec, and CUDA's E8M0 / E2M1 conversions, both
// roundings, on the same input classes (signed zeros, ties, every magnitude).
TEST(GpuCodec, Mxfp4CudaCodecMatchesHostAndCudaConversions) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  std::int64_t rows = 0;
  const std::vector<float> x = test::nvfp4_input_matrix(&rows);
  const std::int64_t cols = test::kNvfp4InputCols;
  for (ScaleRounding rounding : {ScaleRounding::rceil, ScaleRounding::ocp_floor}) {
    test::Mxfp4Bytes library, cuda;
    test::mxfp4_on_device(x, rows, cols, rounding, &library, &cuda);
    std::vector<std::uint8_t> host_packed(library.packed.size()),
        host_scales(library.scales.size());
    quantize_mxfp4(x.data(), rows, cols, host_packed.data(), host_scales.data(), rounding);
    ASSERT_EQ(library.scales, host_scales) << to_string(rounding);
    ASSERT_EQ(library.packed, host_packed) << to_string(rounding);
    ASSERT_EQ(library.scales, cuda.scales) << to_string(rounding);
    int negative_zeros = 0;
    for (std::size_t i = 0; i < library.packed.size(); ++i) {
      ASSERT_EQ(library.packed[i], cuda.packed[i])
          << to_string(rounding) << ": byte " << i << " (x " << x[2 * i] << ", " << x[2 * i + 1]
          << ")";
      negative_zeros += (library.packed[i] & 0xf) == 0x8;
    }
    EXPECT_GT(negative_zeros, 100) << "the signed-zero class is there";
  }
}

}  // namespace
// Dispatch's wire rows straight from x's bf16 codes (encode_bf16_row: registers, no fp32 row) are
// the wire codec's bytes and s_enc (protocol::encode_payload of the same values), bit for bit, for
// fp8_block128, MXFP8 under both roundings and NVFP4, on CTAs of 1, 4 and 8 warps: rows of the
// input classes (support/nvfp4_inputs.hpp's, rounded to bf16), a row with an Inf and one with a
// negative NaN, at n = 128 and n = 192 (a 64-wide last step of 128).
TEST(GpuCodec, Bf16RowEncodersMatchTheWireCodec) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  std::int64_t class_rows = 0;
  const std::vector<float> classes = test::nvfp4_input_matrix(&class_rows);
  for (const std::int64_t n : {std::int64_t{128}, std::int64_t{192}}) {
    const std::int64_t rows = class_rows + 2;
    std::vector<std::uint16_t> x(static_cast<std::size_t>(rows * n));
    for (std::size_t i = 0; i < x.size(); ++i)
      x[i] = formats::float_to_bf16(classes[i % classes.size()]);
    x[static_cast<std::size_t>(class_rows * n + 3)] = 0x7f80;         // +Inf
    x[static_cast<std::size_t>((class_rows + 1) * n + 70)] = 0xffc1;  // a negative NaN
    for (const auto& [precision, rounding] :
         {std::pair{Precision::fp8_block128, ScaleRounding::rceil},
          std::pair{Precision::mxfp8, ScaleRounding::rceil},
          std::pair{Precision::mxfp8, ScaleRounding::ocp_floor},
          std::pair{Precision::nvfp4, ScaleRounding::rceil}})
      for (const int warps : {1, 4, 8}) {
        const test::WireRows device =
            test::encode_bf16_rows_on_device(x, rows, n, precision, rounding, warps);
        const std::size_t bytes = protocol::wire_payload_bytes(precision, n);
        for (std::int64_t r = 0; r < rows; ++r) {
          std::vector<float> values(static_cast<std::size_t>(n));
          for (std::int64_t i = 0; i < n; ++i)
            values[static_cast<std::size_t>(i)] =
                formats::bf16_to_float(x[static_cast<std::size_t>(r * n + i)]);
          std::vector<std::uint8_t> host(bytes, 0);
          const float s_enc =
              protocol::encode_payload(values.data(), n, precision, rounding, host.data());
          const std::uint8_t* got = device.payload.data() + r * device.stride;
          ASSERT_EQ(std::vector<std::uint8_t>(got, got + bytes), host)
              << to_string(precision) << " " << to_string(rounding) << ", n " << n << ", " << warps
              << " warps, row " << r;
          ASSERT_EQ(formats::float_bits(device.s_enc[static_cast<std::size_t>(r)]),
                    formats::float_bits(s_enc))
              << to_string(precision) << ", n " << n << ", row " << r;
        }
      }
  }
}

// nvfp4's held activate encodes h a lane per four elements (nvfp4_encode_lane, its divisions by
// the block scale as a reciprocal and a correction) and gives FC2 the decoded values times s_enc
// as bf16 (nvfp4_lane_bf16, its division by s_enc the same way): the host codec's s_enc, codes and
// block scales bit for bit on every input class (support/nvfp4_inputs.hpp's rows, which include
// ties, signed zeros, fp32 subnormals and FLT_MAX, plus a row with an Inf and one with a NaN), and
// its bf16 codes bit for bit wherever s_enc is in [2^-100, 2^100] (NaN as NaN: the device's
// arithmetic gives its own NaN), at most one bf16 step away beyond.
TEST(GpuCodec, Nvfp4LaneEncoderMatchesTheHostCodecOnEveryInputClass) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  using namespace formats;
  std::int64_t class_rows = 0;
  std::vector<float> x = test::nvfp4_input_matrix(&class_rows);
  ASSERT_EQ(test::kNvfp4InputCols, 128);
  const std::int64_t rows = class_rows + 2;
  x.resize(static_cast<std::size_t>(rows * 128), 1.5f);
  x[static_cast<std::size_t>(class_rows * 128 + 37)] = bits_float(kF32InfBits);
  x[static_cast<std::size_t>((class_rows + 1) * 128 + 90)] = quiet_nan();
  const test::Nvfp4LaneRows device = test::nvfp4_lane_rows_on_device(x, rows);
  int exact_rows = 0, zero_codes = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* row = x.data() + r * 128;
    const float s_enc = nvfp4_tensor_scale(nvfp4_group_amax(row, 128));
    ASSERT_EQ(float_bits(device.s_enc[static_cast<std::size_t>(r)]), float_bits(s_enc))
        << "row " << r;
    const bool exact = cuda::nvfp4_in_reciprocal_range(s_enc);
    exact_rows += exact;
    for (int b = 0; b < 8; ++b) {
      std::uint8_t packed[8], scale = 0;
      nvfp4_encode_block(row + 16 * b, 16, s_enc, packed, &scale);
      ASSERT_EQ(device.scales[static_cast<std::size_t>(r * 8 + b)], scale)
          << "row " << r << ", block " << b;
      for (int i = 0; i < 8; ++i)
        ASSERT_EQ(device.packed[static_cast<std::size_t>(r * 64 + 8 * b + i)], packed[i])
            << "row " << r << ", block " << b << ", byte " << i << " (x " << row[16 * b + 2 * i]
            << ", " << row[16 * b + 2 * i + 1] << ")";
      for (int i = 0; i < 16; ++i) {
        const std::uint8_t code = e2m1_code_at(packed, i);
        zero_codes += (code & 0x7) == 0;
        const std::uint16_t want = float_to_bf16(nvfp4_decode_value(code, scale, s_enc) * s_enc);
        const std::uint16_t got = device.h16[static_cast<std::size_t>(r * 128 + 16 * b + i)];
        if (std::isnan(bf16_to_float(want))) {
          ASSERT_TRUE(std::isnan(bf16_to_float(got))) << "row " << r << ", element " << 16 * b + i;
          continue;
        }
        const int steps_apart = std::abs(static_cast<int>(got) - static_cast<int>(want));
        ASSERT_LE(steps_apart, exact ? 0 : 1)
            << "row " << r << ", element " << 16 * b + i << ": s_enc " << s_enc << ", bf16 0x"
            << std::hex << got << " against 0x" << want;
      }
    }
  }
  // the fixed classes but FLT_MAX's and the fp32 subnormals', the moderate rows, the Inf and NaN
  // rows: 15 (the random rows' amax mostly exceeds 2^111)
  EXPECT_GE(exact_rows, 15) << "the rows of moderate magnitude are in the exact range";
  EXPECT_LT(exact_rows, rows) << "a row beyond it is there too";
  EXPECT_GT(zero_codes, 100) << "the zero classes are there";
}

}  // namespace epmoe
