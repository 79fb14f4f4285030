// A matrix of finite floats holding every input class of the NVFP4 encoder, shared by the host
// comparison with cuda_fp4.h (tests/formats_test.cpp) and the device one (tests/gpu/): all-zero
// blocks with -0, exact E2M1 ties, negatives that round to zero, fp32 subnormals, FLT_MAX, block
// scales that round to zero next to a huge value, and rows of every magnitude 2^-150 ... 2^127
// (under one per-tensor scale most of their blocks have a zero block scale).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace epmoe::test {

inline constexpr std::int64_t kNvfp4InputCols = 128;

inline std::vector<float> nvfp4_input_matrix(std::int64_t* rows, unsigned seed = 6) {
  constexpr std::int64_t cols = kNvfp4InputCols;
  std::vector<float> m;
  auto row = [&](std::vector<float> values) {  // repeated to fill the row
    for (std::int64_t c = 0; c < cols; ++c)
      m.push_back(values[static_cast<std::size_t>(c) % values.size()]);
  };
  row({0.0f});
  row({0.0f, -0.0f});
  row({1.0f});
  row({FLT_MAX, -FLT_MAX, 1.0f, -1.0f});
  row({std::ldexp(1.0f, -149), -std::ldexp(1.0f, -149), std::ldexp(1.0f, -130), -FLT_MIN, 0.0f});
  // Block amax 6, so with a per-row scale the block scale is 448 and elements are x itself: every
  // tie of E2M1 and negatives that round to zero.
  row({6.0f, 5.0f, -3.5f, 2.5f, -1.75f, 1.25f, -0.75f, 0.25f, -0.25f, -0.1f, -1e-30f, -0.0f, 7.0f,
       -5.5f, 0.5f, -2.75f});
  // One huge value: the other blocks' scales round to zero under the row's scale.
  row({1e30f, -1e-10f, 1e-10f, -3e-12f, 0.0f, -0.0f, 2e-11f, -7e-11f});
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> exponent(-150, 127);
  for (int r = 0; r < 24; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      float v;
      do {
        v = static_cast<float>(normal(rng) * std::ldexp(1.0, exponent(rng)));
      } while (!std::isfinite(v));
      m.push_back(v);
    }
  }
  std::uniform_real_distribution<double> scale(-10.0, 10.0);
  for (int r = 0; r < 8; ++r) {
    const double s = std::exp2(scale(rng));
    for (std::int64_t c = 0; c < cols; ++c) m.push_back(static_cast<float>(normal(rng) * s));
  }
  *rows = static_cast<std::int64_t>(m.size()) / cols;
  return m;
}

}  // namespace epmoe::test
