// The codecs on the device against the device conversions of cuda_fp4.h / cuda_fp8.h, over the
// input classes tests/formats_test.cpp checks on the host: every fp32 bit pattern for the scalar
// encoders, and support/nvfp4_inputs.hpp's matrix through epmoe's CUDA NVFP4 codec.
#include <gtest/gtest.h>

#include <cstdint>
#include <ios>
#include <vector>

#include "epmoe/comm.hpp"
#include "epmoe/formats.hpp"
#include "formats/codec.hpp"
#include "gpu/codec_check.hpp"
#include "support/nvfp4_inputs.hpp"

namespace epmoe {
namespace {

TEST(GpuCodec, E2m1EncoderMatchesCudaFp4ConversionOnEveryFloat) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  const test::Disagreements d = test::e2m1_vs_cuda_on_every_float();
  EXPECT_EQ(d.count, 0u) << "first at |x| bits 0x" << std::hex << d.first_bits;
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

}  // namespace
}  // namespace epmoe
