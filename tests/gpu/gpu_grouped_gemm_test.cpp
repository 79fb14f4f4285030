// The wgmma backend's grouped GEMM (src/cuda/experts/wgmma/grouped_gemm.hpp) on its own, against
// a float64 GEMM on the host: groups with no rows, fewer rows than a tile, and several tiles; each
// group's operands at its own offset, as the backend's plan kernel sets them.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cuda/experts/wgmma/grouped_gemm.hpp"
#include "formats/codec.hpp"

namespace epmoe {
namespace {

using cuda::experts::wgmma::Bf16GroupedGemm;
using cuda::experts::wgmma::GemmProblem;

TEST(GpuGroupedGemm, MatchesAFloat64GemmWithinFp32AccumulationNoise) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) GTEST_SKIP() << "needs a GPU";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const int n = 384, k = 2048;
  const std::vector<int> rows{0, 5, 300, 128, 0, 1};  // per group
  const int groups = static_cast<int>(rows.size());
  int total = 0;
  for (int m : rows) total += m;

  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::uint16_t> a(static_cast<std::size_t>(total) * k);
  std::vector<std::uint16_t> b(static_cast<std::size_t>(groups) * n * k);
  for (auto& v : a) v = formats::float_to_bf16(normal(rng));
  for (auto& v : b) v = formats::float_to_bf16(normal(rng) * 0.05f);

  std::uint16_t *a_dev = nullptr, *b_dev = nullptr;
  float* d_dev = nullptr;
  ASSERT_EQ(cudaMalloc(&a_dev, a.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b_dev, b.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_dev, static_cast<std::size_t>(total) * n * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a_dev, a.data(), a.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(b_dev, b.data(), b.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_dev, 0xFF, static_cast<std::size_t>(total) * n * 4), cudaSuccess);

  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  Bf16GroupedGemm gemm(groups, n, k, sms, 0);
  std::vector<GemmProblem> problems;
  std::vector<const std::uint16_t*> a_ptr, b_ptr;
  std::vector<float*> d_ptr;
  int first = 0;
  for (int g = 0; g < groups; ++g) {
    problems.push_back({rows[g], n, k});
    a_ptr.push_back(a_dev + static_cast<std::size_t>(first) * k);
    b_ptr.push_back(b_dev + static_cast<std::size_t>(g) * n * k);
    d_ptr.push_back(d_dev + static_cast<std::size_t>(first) * n);
    first += rows[g];
  }
  const auto& arrays = gemm.arrays();
  ASSERT_EQ(cudaMemcpy(arrays.problems, problems.data(), groups * sizeof(GemmProblem),
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(arrays.a, a_ptr.data(), groups * sizeof(void*), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(arrays.b, b_ptr.data(), groups * sizeof(void*), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(arrays.d, d_ptr.data(), groups * sizeof(void*), cudaMemcpyHostToDevice),
            cudaSuccess);
  gemm.run(nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> d(static_cast<std::size_t>(total) * n);
  ASSERT_EQ(cudaMemcpy(d.data(), d_dev, d.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);

  // |D - exact| against sum |a||b| of the row and column: fp32 accumulation of 2048 products
  // stays within a few 2^-24 of that; a wrong row, column, group or a lost k tile does not.
  double worst = 0.0;
  first = 0;
  for (int g = 0; g < groups; ++g) {
    for (int r = 0; r < rows[g]; ++r)
      for (int c = 0; c < n; ++c) {
        double exact = 0.0, magnitude = 0.0;
        for (int i = 0; i < k; ++i) {
          const double x = formats::bf16_to_float(a[static_cast<std::size_t>(first + r) * k + i]);
          const double w = formats::bf16_to_float(b[(static_cast<std::size_t>(g) * n + c) * k + i]);
          exact += x * w;
          magnitude += std::fabs(x * w);
        }
        const double err =
            std::fabs(d[static_cast<std::size_t>(first + r) * n + c] - exact) / magnitude;
        worst = std::max(worst, std::isnan(err) ? 1.0 : err);
      }
    first += rows[g];
  }
  RecordProperty("worst_relative_error", std::to_string(worst));
  std::printf("grouped GEMM worst |D - exact| / sum|a b| = %.3g (2^-24 = %.3g)\n", worst,
              std::ldexp(1.0, -24));
  EXPECT_LT(worst, 1e-5);
  cudaFree(a_dev);
  cudaFree(b_dev);
  cudaFree(d_dev);
}

}  // namespace
}  // namespace epmoe

namespace epmoe {
namespace {

using cuda::experts::wgmma::Fp8BlockwiseGroupedGemm;

// The E4M3 GEMM with 1 x 128 scales on A and 128 x 128 on B (K-major), against float64 of the
// decoded values: each k128 partial sum goes through WGMMA's FP8 accumulation, then is promoted
// with its two scales into fp32, so the bound is looser than bf16's.
TEST(GpuGroupedGemm, Fp8BlockScaledMatchesAFloat64GemmOfTheDecodedValues) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) GTEST_SKIP() << "needs a GPU";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const int n = 256, k = 1024, kb = k / 128, nb = n / 128;
  const std::vector<int> rows{0, 7, 200, 0, 1};
  const int groups = static_cast<int>(rows.size());
  int total = 0;
  for (int m : rows) total += m;

  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale(0.01f, 2.0f);
  std::vector<std::uint8_t> a(static_cast<std::size_t>(total) * k);
  std::vector<std::uint8_t> b(static_cast<std::size_t>(groups) * n * k);
  std::vector<float> sa(static_cast<std::size_t>(total) * kb),
      sb(static_cast<std::size_t>(groups) * nb * kb);
  for (auto& v : a) v = formats::fp8_block128_encode_value(normal(rng) * 100.0f, 1.0f);
  for (auto& v : b) v = formats::fp8_block128_encode_value(normal(rng) * 100.0f, 1.0f);
  for (auto& v : sa) v = scale(rng);
  for (auto& v : sb) v = scale(rng);

  std::uint8_t *a_dev = nullptr, *b_dev = nullptr;
  float *sa_dev = nullptr, *sb_dev = nullptr, *d_dev = nullptr;
  ASSERT_EQ(cudaMalloc(&a_dev, a.size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b_dev, b.size()), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&sa_dev, sa.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&sb_dev, sb.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_dev, static_cast<std::size_t>(total) * n * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a_dev, a.data(), a.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(b_dev, b.data(), b.size(), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(sa_dev, sa.data(), sa.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(sb_dev, sb.data(), sb.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_dev, 0xFF, static_cast<std::size_t>(total) * n * 4), cudaSuccess);

  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  Fp8BlockwiseGroupedGemm gemm(groups, n, k, sms, 0);
  std::vector<GemmProblem> problems;
  std::vector<const std::uint8_t*> a_ptr, b_ptr;
  std::vector<const float*> sa_ptr, sb_ptr;
  std::vector<float*> d_ptr;
  int first = 0;
  for (int g = 0; g < groups; ++g) {
    problems.push_back({rows[g], n, k});
    a_ptr.push_back(a_dev + static_cast<std::size_t>(first) * k);
    sa_ptr.push_back(sa_dev + static_cast<std::size_t>(first) * kb);
    b_ptr.push_back(b_dev + static_cast<std::size_t>(g) * n * k);
    sb_ptr.push_back(sb_dev + static_cast<std::size_t>(g) * nb * kb);
    d_ptr.push_back(d_dev + static_cast<std::size_t>(first) * n);
    first += rows[g];
  }
  const auto& arrays = gemm.arrays();
  const auto up = [&](void* dst, const void* src, std::size_t bytes) {
    ASSERT_EQ(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  };
  up(arrays.problems, problems.data(), groups * sizeof(GemmProblem));
  up(arrays.a, a_ptr.data(), groups * sizeof(void*));
  up(arrays.b, b_ptr.data(), groups * sizeof(void*));
  up(arrays.sfa, sa_ptr.data(), groups * sizeof(void*));
  up(arrays.sfb, sb_ptr.data(), groups * sizeof(void*));
  up(arrays.d, d_ptr.data(), groups * sizeof(void*));
  gemm.run(nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> d(static_cast<std::size_t>(total) * n);
  ASSERT_EQ(cudaMemcpy(d.data(), d_dev, d.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);

  double worst = 0.0;
  first = 0;
  for (int g = 0; g < groups; ++g) {
    for (int r = 0; r < rows[g]; ++r)
      for (int c = 0; c < n; ++c) {
        double exact = 0.0, magnitude = 0.0;
        for (int i = 0; i < k; ++i) {
          const double x = formats::fp8_block128_decode_value(
              a[static_cast<std::size_t>(first + r) * k + i],
              sa[static_cast<std::size_t>(first + r) * kb + i / 128]);
          const double w = formats::fp8_block128_decode_value(
              b[(static_cast<std::size_t>(g) * n + c) * k + i],
              sb[(static_cast<std::size_t>(g) * nb + c / 128) * kb + i / 128]);
          exact += x * w;
          magnitude += std::fabs(x * w);
        }
        const double err =
            std::fabs(d[static_cast<std::size_t>(first + r) * n + c] - exact) / magnitude;
        worst = std::max(worst, std::isnan(err) ? 1.0 : err);
      }
    first += rows[g];
  }
  std::printf("E4M3 grouped GEMM worst |D - exact| / sum|a b| = %.3g\n", worst);
  EXPECT_LT(worst, 1e-3);  // a wrong scale, block, row or group is off by O(1)
  cudaFree(a_dev);
  cudaFree(b_dev);
  cudaFree(sa_dev);
  cudaFree(sb_dev);
  cudaFree(d_dev);
}

}  // namespace
}  // namespace epmoe
