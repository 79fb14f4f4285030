// The wgmma backend's grouped GEMMs (src/cuda/experts/wgmma/grouped_gemm.hpp) on their own,
// against a float64 GEMM on the host: groups with no rows, fewer rows than a tile, and several
// tiles; each group's operands at its own offset, as the backend's plan kernel sets them.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "cuda/experts/wgmma/grouped_gemm.hpp"
#include "cuda/experts/wgmma/packed_gemm.hpp"
#include "formats/codec.hpp"
#include "math/activation.hpp"
#include "math/expert_row.hpp"  // math::biased
#include "support/device_vectors.hpp"

namespace epmoe {
namespace {

using cuda::experts::ExpertProblem;
using cuda::experts::wgmma::Bf16GluGroupedGemm;
using cuda::experts::wgmma::Bf16GroupedGemm;
using cuda::experts::wgmma::Bf16Tile;
using cuda::experts::wgmma::Fp8BlockwiseGroupedGemm;
using cuda::experts::wgmma::GemmOutput;
using cuda::experts::wgmma::GemmProblem;
using cuda::experts::wgmma::GluTile;

bool have_gpu() {
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 &&
         cudaSetDevice(0) == cudaSuccess;
}

int sm_count() {
  int sms = 0;
  EXPECT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  return sms;
}

using test::DeviceCopy;
using test::from_device;

// A host array into a device array the GEMM reads.
template <class T>
void upload(T* device, const std::vector<T>& host) {
  ASSERT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
}

// Rows per group; each group's first row in the stacked A and D.
struct Groups {
  std::vector<int> rows;
  std::vector<int> first;
  int total = 0;
  explicit Groups(std::vector<int> r) : rows(std::move(r)) {
    for (int m : rows) {
      first.push_back(total);
      total += m;
    }
  }
  int count() const { return static_cast<int>(rows.size()); }
  std::vector<GemmProblem> problems(int n, int k) const {
    std::vector<GemmProblem> out;
    for (int m : rows) out.push_back({m, n, k});
    return out;
  }
};

// The worst |D - exact| / sum |a w| over every output, with product(row, group, col, i) the
// float64 value of a[row, i] * w_group[col, i]: fp32-class accumulation stays near 2^-24 of that
// magnitude; a wrong row, column, group, scale or a lost k tile is off by O(1).
template <class Product>
double worst_relative_error(const Groups& g, int n, int k, const std::vector<float>& d,
                            Product product) {
  double worst = 0.0;
  for (int group = 0; group < g.count(); ++group)
    for (int r = g.first[group]; r < g.first[group] + g.rows[group]; ++r)
      for (int c = 0; c < n; ++c) {
        double exact = 0.0, magnitude = 0.0;
        for (int i = 0; i < k; ++i) {
          const double p = product(r, group, c, i);
          exact += p;
          magnitude += std::fabs(p);
        }
        const double err = std::fabs(d[static_cast<std::size_t>(r) * n + c] - exact) / magnitude;
        worst = std::max(worst, std::isnan(err) ? 1.0 : err);
      }
  return worst;
}

// GemmOutput::bf16_rows' bias rows for `groups` groups of N: random, but for group 1, which takes
// the GEMM's zero row (a layer without b2); and where each group's row is.
struct BiasRows {
  std::vector<float> values;
  DeviceCopy<float> device;
  BiasRows(int groups, int n, unsigned seed)
      : values(random(static_cast<std::size_t>(groups) * n, seed)), device(values) {}
  static std::vector<float> random(std::size_t count, unsigned seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> v(count);
    for (auto& x : v) x = normal(rng);
    return v;
  }
  // Uploads each group's row pointer into `bias` (group 1: `zero_bias`).
  void upload_to(const float** bias, const float* zero_bias, int groups, int n) const {
    std::vector<const float*> rows;
    for (int group = 0; group < groups; ++group)
      rows.push_back(group == 1 ? zero_bias : device.ptr + static_cast<std::size_t>(group) * n);
    upload(bias, rows);
  }
  float at(int group, int n, int col) const {
    return group == 1 ? 0.0f : values[static_cast<std::size_t>(group) * n + col];
  }
};

// How many of `rows` (GemmOutput::bf16_rows) differ from bf16(sums + the group's bias row), the
// rounding home applies to the fp32 sums.
std::size_t rows_differing(const Groups& g, int n, const std::vector<float>& sums,
                           const std::vector<std::uint16_t>& rows, const BiasRows& bias) {
  EXPECT_EQ(rows.size(), sums.size());
  std::size_t differ = 0;
  for (int group = 0; group < g.count(); ++group)
    for (int r = g.first[group]; r < g.first[group] + g.rows[group]; ++r)
      for (int c = 0; c < n; ++c) {
        const std::size_t i = static_cast<std::size_t>(r) * n + c;
        differ += rows[i] != formats::float_to_bf16(sums[i] + bias.at(group, n, c)) ? 1 : 0;
      }
  return differ;
}

// The bf16 GEMM of `tile` on `sms` persistent CTAs over groups of 0, 5, 300, 128, 0 and 1 rows
// (N = 384: one whole 256-wide tile and a half one); D, and its worst error against float64. With
// `bias`, the GEMM stores bf16 rows (GemmOutput::bf16_rows) with those bias rows instead.
struct Bf16Run {
  std::vector<float> d;
  std::vector<std::uint16_t> rows;  // bf16_rows
  double worst = 0.0;
};
constexpr int kBf16N = 384;
const Groups kBf16Groups({0, 5, 300, 128, 0, 1});
Bf16Run run_bf16_gemm(cuda::experts::wgmma::Bf16Tile tile, int sms,
                      const BiasRows* bias = nullptr) {
  const int n = kBf16N, k = 2048;
  const Groups& g = kBf16Groups;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::uint16_t> a(static_cast<std::size_t>(g.total) * k);
  std::vector<std::uint16_t> b(static_cast<std::size_t>(g.count()) * n * k);
  for (auto& v : a) v = formats::float_to_bf16(normal(rng));
  for (auto& v : b) v = formats::float_to_bf16(normal(rng) * 0.05f);
  const DeviceCopy<std::uint16_t> a_dev(a), b_dev(b);
  const DeviceCopy<float> d_dev(static_cast<std::size_t>(g.total) * n);
  const DeviceCopy<std::uint16_t> rows_dev(static_cast<std::size_t>(g.total) * n);

  const GemmOutput output = bias != nullptr ? GemmOutput::bf16_rows : GemmOutput::fp32_sums;
  Bf16GroupedGemm gemm(g.count(), n, k, sms, 0, tile, output);
  EXPECT_EQ(gemm.tile(), tile);
  EXPECT_EQ(gemm.output(), output);
  EXPECT_EQ(gemm.sm_count(), sms);
  std::vector<const std::uint16_t*> a_ptr, b_ptr;
  std::vector<float*> d_ptr;
  std::vector<std::uint16_t*> rows_ptr;
  for (int group = 0; group < g.count(); ++group) {
    a_ptr.push_back(a_dev.ptr + static_cast<std::size_t>(g.first[group]) * k);
    b_ptr.push_back(b_dev.ptr + static_cast<std::size_t>(group) * n * k);
    d_ptr.push_back(d_dev.ptr + static_cast<std::size_t>(g.first[group]) * n);
    rows_ptr.push_back(rows_dev.ptr + static_cast<std::size_t>(g.first[group]) * n);
  }
  const auto& arrays = gemm.arrays();
  const std::vector<GemmProblem> problems = g.problems(n, k);
  upload(arrays.problems, problems);
  upload(arrays.a, a_ptr);
  upload(arrays.b, b_ptr);
  upload(arrays.d, d_ptr);
  upload(arrays.d16, rows_ptr);
  if (bias != nullptr) bias->upload_to(arrays.bias, arrays.zero_bias, g.count(), n);
  gemm.run(nullptr);
  Bf16Run run;
  if (bias != nullptr) {
    run.rows = from_device(rows_dev.ptr, static_cast<std::size_t>(g.total) * n);
    return run;
  }
  run.d = from_device(d_dev.ptr, static_cast<std::size_t>(g.total) * n);
  run.worst = worst_relative_error(g, n, k, run.d, [&](int r, int group, int c, int i) {
    return static_cast<double>(formats::bf16_to_float(a[static_cast<std::size_t>(r) * k + i])) *
           formats::bf16_to_float(b[(static_cast<std::size_t>(group) * n + c) * k + i]);
  });
  std::printf("grouped GEMM %s on %d SMs: worst |D - exact| / sum|a b| = %.3g (2^-24 = %.3g)\n",
              to_string(tile), sms, run.worst, std::ldexp(1.0, -24));
  return run;
}

TEST(GpuGroupedGemm, MatchesAFloat64GemmWithinFp32AccumulationNoise) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  EXPECT_LT(run_bf16_gemm(Bf16Tile::m128_n128_k64, sm_count()).worst, 1e-5);
}

// The 128 x 256 tile (Knobs block_n = 256) within the same noise, and with the same bits as
// 128 x 128: each output is the same k16 WGMMA steps over the same k tiles in the same order.
TEST(GpuGroupedGemm, Tile128x256MatchesAFloat64GemmAndThe128x128TileBitForBit) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  const Bf16Run narrow = run_bf16_gemm(Bf16Tile::m128_n128_k64, sm_count());
  const Bf16Run wide = run_bf16_gemm(Bf16Tile::m128_n256_k64, sm_count());
  EXPECT_LT(wide.worst, 1e-5);
  ASSERT_EQ(narrow.d.size(), wide.d.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < wide.d.size(); ++i)
    differ += std::memcmp(&wide.d[i], &narrow.d[i], sizeof(float)) != 0 ? 1 : 0;
  EXPECT_EQ(differ, 0u) << "of " << wide.d.size();
}

// Knobs num_sms: the persistent grid of 8 CTAs walks every tile and gives all SMs' bits (no tile
// is split between CTAs).
TEST(GpuGroupedGemm, EightPersistentCtasGiveTheBitsOfOnePerSm) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  for (Bf16Tile tile : {Bf16Tile::m128_n128_k64, Bf16Tile::m128_n256_k64}) {
    const Bf16Run all = run_bf16_gemm(tile, sm_count());
    const Bf16Run eight = run_bf16_gemm(tile, 8);
    EXPECT_EQ(std::memcmp(all.d.data(), eight.d.data(), all.d.size() * sizeof(float)), 0)
        << to_string(tile);
  }
}

// FC2 of the staged combine (GemmOutput::bf16_rows) stores, on both tiles, the bf16 of the same
// GEMM's fp32 sums plus the group's bias row (a zero row for group 1), bit for bit: the same
// mainloop, and one fp32 add and one rounding in the epilogue, as home's.
TEST(GpuGroupedGemm, Bf16RowsAreTheFp32SumsPlusTheBiasRowRoundedOnce) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  const BiasRows bias(kBf16Groups.count(), kBf16N, 5);
  for (Bf16Tile tile : {Bf16Tile::m128_n128_k64, Bf16Tile::m128_n256_k64}) {
    const Bf16Run sums = run_bf16_gemm(tile, sm_count());
    const Bf16Run rows = run_bf16_gemm(tile, sm_count(), &bias);
    EXPECT_EQ(rows_differing(kBf16Groups, kBf16N, sums.d, rows.rows, bias), 0u)
        << to_string(tile) << ", of " << sums.d.size();
  }
}

// The E4M3 GEMM over groups of 0, 7, 200, 0 and 1 rows, random codes and scales: its fp32 sums,
// or, with `bias`, its bf16 rows (GemmOutput::bf16_rows).
constexpr int kFp8N = 256, kFp8K = 1024, kFp8Kb = kFp8K / 128, kFp8Nb = kFp8N / 128;
const Groups kFp8Groups({0, 7, 200, 0, 1});
struct Fp8Operands {
  std::vector<std::uint8_t> a, b;  // E4M3 codes, [rows, K] and [groups, N, K]
  // [rows + kScalePadRows, K / 128] and [groups, N / 128, K / 128]: the row scales with the
  // padding a partial tile's rows beyond M read (never stored), NaN, so a leak into D fails
  std::vector<float> sa, sb;
  Fp8Operands() {
    const Groups& g = kFp8Groups;
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> scale(0.01f, 2.0f);
    a.resize(static_cast<std::size_t>(g.total) * kFp8K);
    b.resize(static_cast<std::size_t>(g.count()) * kFp8N * kFp8K);
    sa.assign((static_cast<std::size_t>(g.total) + Fp8BlockwiseGroupedGemm::kScalePadRows) * kFp8Kb,
              std::numeric_limits<float>::quiet_NaN());
    sb.resize(static_cast<std::size_t>(g.count()) * kFp8Nb * kFp8Kb);
    for (auto& v : a) v = formats::fp8_block128_encode_value(normal(rng) * 100.0f, 1.0f);
    for (auto& v : b) v = formats::fp8_block128_encode_value(normal(rng) * 100.0f, 1.0f);
    for (std::size_t i = 0; i < static_cast<std::size_t>(g.total) * kFp8Kb; ++i) sa[i] = scale(rng);
    for (auto& v : sb) v = scale(rng);
  }
};
struct Fp8Run {
  std::vector<float> d;
  std::vector<std::uint16_t> rows;
};
Fp8Run run_fp8_gemm(const Fp8Operands& operands, const BiasRows* bias = nullptr) {
  const int n = kFp8N, k = kFp8K, kb = kFp8Kb, nb = kFp8Nb;
  const Groups& g = kFp8Groups;
  const auto& [a, b, sa, sb] = operands;
  const DeviceCopy<std::uint8_t> a_dev(a), b_dev(b);
  const DeviceCopy<float> sa_dev(sa), sb_dev(sb);
  const DeviceCopy<float> d_dev(static_cast<std::size_t>(g.total) * n);
  const DeviceCopy<std::uint16_t> rows_dev(static_cast<std::size_t>(g.total) * n);

  const GemmOutput output = bias != nullptr ? GemmOutput::bf16_rows : GemmOutput::fp32_sums;
  Fp8BlockwiseGroupedGemm gemm(g.count(), n, k, g.total, sm_count(), 0, output);
  EXPECT_EQ(gemm.output(), output);
  std::vector<const std::uint8_t*> a_ptr, b_ptr;
  std::vector<const float*> sa_ptr, sb_ptr;
  std::vector<float*> d_ptr;
  std::vector<std::uint16_t*> rows_ptr;
  for (int group = 0; group < g.count(); ++group) {
    a_ptr.push_back(a_dev.ptr + static_cast<std::size_t>(g.first[group]) * k);
    sa_ptr.push_back(sa_dev.ptr + static_cast<std::size_t>(g.first[group]) * kb);
    b_ptr.push_back(b_dev.ptr + static_cast<std::size_t>(group) * n * k);
    sb_ptr.push_back(sb_dev.ptr + static_cast<std::size_t>(group) * nb * kb);
    d_ptr.push_back(d_dev.ptr + static_cast<std::size_t>(g.first[group]) * n);
    rows_ptr.push_back(rows_dev.ptr + static_cast<std::size_t>(g.first[group]) * n);
  }
  const auto& arrays = gemm.arrays();
  const std::vector<GemmProblem> problems = g.problems(n, k);
  upload(arrays.problems, problems);
  upload(arrays.a, a_ptr);
  upload(arrays.b, b_ptr);
  upload(arrays.sfa, sa_ptr);
  upload(arrays.sfb, sb_ptr);
  upload(arrays.d, d_ptr);
  upload(arrays.d16, rows_ptr);
  if (bias != nullptr) bias->upload_to(arrays.bias, arrays.zero_bias, g.count(), n);
  gemm.run(nullptr);
  Fp8Run run;
  if (bias != nullptr)
    run.rows = from_device(rows_dev.ptr, static_cast<std::size_t>(g.total) * n);
  else
    run.d = from_device(d_dev.ptr, static_cast<std::size_t>(g.total) * n);
  return run;
}

// The E4M3 GEMM with 1 x 128 scales on A and 128 x 128 on B (K-major), against float64 of the
// decoded values: each k128 partial sum goes through WGMMA's FP8 accumulation, then is promoted
// with its two scales into fp32, so the bound is looser than bf16's.
TEST(GpuGroupedGemm, Fp8BlockScaledMatchesAFloat64GemmOfTheDecodedValues) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  const int n = kFp8N, k = kFp8K, kb = kFp8Kb, nb = kFp8Nb;
  const Groups& g = kFp8Groups;
  const Fp8Operands operands;
  const auto& [a, b, sa, sb] = operands;
  const std::vector<float> d = run_fp8_gemm(operands).d;

  const double worst = worst_relative_error(g, n, k, d, [&](int r, int group, int c, int i) {
    const std::size_t row = static_cast<std::size_t>(r),
                      col = static_cast<std::size_t>(group) * n + c;
    return static_cast<double>(
               formats::fp8_block128_decode_value(a[row * k + i], sa[row * kb + i / 128])) *
           formats::fp8_block128_decode_value(
               b[col * k + i], sb[(static_cast<std::size_t>(group) * nb + c / 128) * kb + i / 128]);
  });
  std::printf("E4M3 grouped GEMM worst |D - exact| / sum|a b| = %.3g\n", worst);
  EXPECT_LT(worst, 1e-3);  // measured 7.8e-5 on an H200
}

// The E4M3 GEMM's bf16 rows (FC2 of fp8_block128 with the staged combine): its fp32 sums plus the
// bias row, rounded once, bit for bit.
TEST(GpuGroupedGemm, Fp8Bf16RowsAreTheFp32SumsPlusTheBiasRowRoundedOnce) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  const BiasRows bias(kFp8Groups.count(), kFp8N, 6);
  const Fp8Operands operands;
  const Fp8Run sums = run_fp8_gemm(operands);
  const Fp8Run rows = run_fp8_gemm(operands, &bias);
  EXPECT_EQ(rows_differing(kFp8Groups, kFp8N, sums.d, rows.rows, bias), 0u)
      << "of " << sums.d.size();
}

// FC1 with the activation in its epilogue (Bf16GluGroupedGemm) against the host: w13 drawn in the
// caller's order (gate rows, then up rows) and interleaved as the backend stores it, gate and up
// summed in float64, rounded to fp32 (the accumulator), b13 and the activation, then FC2's input
// quantization point (bf16: the codes FC2 reads).
// The GPU's fp32 sums and __expf differ from that in the last bits, so a few elements may land on
// the other side of a rounding boundary; a gate / up pairing, row, column, block or bias mistake
// moves most of them.
struct GluCase {
  Activation activation;
  float limit;
  bool biases;
};
// Returns the h codes the GPU stored.
std::vector<std::uint16_t> check_glu_gemm(const GluCase& c, GluTile tile) {
  const int h = 512, inter = 192, n = 2 * inter;
  const Groups g({0, 5, 300, 128, 0, 1});
  ExpertProblem problem{
      h, inter, g.count(), Precision::bf16, ScaleRounding::rceil, c.activation, c.limit};
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::uint16_t> a(static_cast<std::size_t>(g.total) * h);
  std::vector<std::uint16_t> w13(static_cast<std::size_t>(g.count()) * n * h);  // caller's order
  std::vector<float> b13(static_cast<std::size_t>(g.count()) * n);
  for (auto& v : a) v = formats::float_to_bf16(normal(rng));
  for (auto& v : w13) v = formats::float_to_bf16(normal(rng) * 0.06f);
  for (auto& v : b13) v = normal(rng) * 0.5f;
  std::vector<std::uint16_t> interleaved(w13.size());
  for (int e = 0; e < g.count(); ++e)
    for (int r = 0; r < n; ++r) {
      const int to = r < inter ? 2 * r : 2 * (r - inter) + 1;
      std::memcpy(&interleaved[(static_cast<std::size_t>(e) * n + to) * h],
                  &w13[(static_cast<std::size_t>(e) * n + r) * h], h * sizeof(std::uint16_t));
    }
  const DeviceCopy<std::uint16_t> a_dev(a), b_dev(interleaved);
  const DeviceCopy<float> b13_dev(b13);
  const DeviceCopy<std::uint16_t> h_dev(static_cast<std::size_t>(g.total) * inter);

  Bf16GluGroupedGemm gemm(problem, sm_count(), 0, tile);
  EXPECT_EQ(gemm.tile(), tile);
  std::vector<const std::uint16_t*> a_ptr, b_ptr;
  std::vector<std::uint16_t*> h_ptr;
  std::vector<const float*> b13_ptr;
  for (int group = 0; group < g.count(); ++group) {
    a_ptr.push_back(a_dev.ptr + static_cast<std::size_t>(g.first[group]) * h);
    b_ptr.push_back(b_dev.ptr + static_cast<std::size_t>(group) * n * h);
    h_ptr.push_back(h_dev.ptr + static_cast<std::size_t>(g.first[group]) * inter);
    b13_ptr.push_back(c.biases ? b13_dev.ptr + static_cast<std::size_t>(group) * n : nullptr);
  }
  const auto& arrays = gemm.arrays();
  upload(arrays.problems, g.problems(n, h));
  upload(arrays.a, a_ptr);
  upload(arrays.b, b_ptr);
  upload(arrays.h, h_ptr);
  upload(arrays.b13, b13_ptr);
  gemm.run(nullptr);
  const std::vector<std::uint16_t> got =
      from_device(h_dev.ptr, static_cast<std::size_t>(g.total) * inter);

  std::size_t differ = 0;
  double err2 = 0.0, ref2 = 0.0;
  for (int group = 0; group < g.count(); ++group)
    for (int r = g.first[group]; r < g.first[group] + g.rows[group]; ++r) {
      std::vector<float> row(inter);
      for (int j = 0; j < inter; ++j) {
        double gate = 0.0, up = 0.0;
        for (int k = 0; k < h; ++k) {
          const double x = formats::bf16_to_float(a[static_cast<std::size_t>(r) * h + k]);
          gate +=
              x * formats::bf16_to_float(w13[(static_cast<std::size_t>(group) * n + j) * h + k]);
          up += x * formats::bf16_to_float(
                        w13[(static_cast<std::size_t>(group) * n + inter + j) * h + k]);
        }
        const float* bias = c.biases ? &b13[static_cast<std::size_t>(group) * n] : nullptr;
        row[j] =
            math::activation_f32(c.activation, math::biased(static_cast<float>(gate), bias, j),
                                 math::biased(static_cast<float>(up), bias, inter + j), c.limit);
      }
      for (int j = 0; j < inter; ++j) {
        const std::uint16_t want = formats::float_to_bf16(row[j]);
        const std::uint16_t have = got[static_cast<std::size_t>(r) * inter + j];
        differ += want != have ? 1 : 0;
        const double d = formats::bf16_to_float(have) - formats::bf16_to_float(want);
        err2 += d * d;
        ref2 += static_cast<double>(row[j]) * row[j];
      }
    }
  const double rel_l2 = std::sqrt(err2 / ref2);
  const std::size_t total = static_cast<std::size_t>(g.total) * inter;
  std::printf("FC1 + %s%s, %s: %zu of %zu h elements differ from the host's, rel_l2 %.3g\n",
              to_string(c.activation), c.biases ? " + b13" : "", to_string(tile), differ, total,
              rel_l2);
  EXPECT_LE(differ, total / 100);
  EXPECT_LT(rel_l2, 2e-3);
  return got;
}

// Both tiles, and the same bits from each: every output is the same k16 WGMMA steps in the same
// order, whichever kernel walks the tiles.
TEST(GpuGroupedGemm, Fc1EpilogueActivatesAsTheHostDoesOnBothTiles) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  for (const GluCase& c :
       {GluCase{Activation::swiglu, 0.0f, false}, GluCase{Activation::swiglu, 7.0f, true},
        GluCase{Activation::swiglu, 0.0f, true},
        GluCase{Activation::swiglu_oai, kSwigluOaiLimit, true}}) {
    const std::vector<std::uint16_t> wide = check_glu_gemm(c, GluTile::m128_n128_k64);
    const std::vector<std::uint16_t> narrow = check_glu_gemm(c, GluTile::m64_n128_k64);
    EXPECT_EQ(wide, narrow) << to_string(c.activation);
  }
}

// Only bf16 layers: the epilogue stores h as bf16, no other precision's FC2 input.
TEST(GpuGroupedGemm, Fc1EpilogueRefusesEveryPrecisionButBf16) {
  for (const Precision p :
       {Precision::mxfp8, Precision::nvfp4, Precision::mxfp4, Precision::fp8_block128}) {
    const ExpertProblem problem{512, 192, 4, p, ScaleRounding::rceil, Activation::swiglu, 0.0f};
    EXPECT_NE(Bf16GluGroupedGemm::cannot_take(problem), nullptr) << to_string(p);
  }
  const ExpertProblem bf16{512, 192, 4, Precision::bf16, ScaleRounding::rceil, Activation::swiglu,
                           0.0f};
  EXPECT_EQ(Bf16GluGroupedGemm::cannot_take(bf16), nullptr);
}

// The packed-weight GEMM (packed_gemm.hpp) against float64 over the decoded weights: random codes
// and block scales in each packed format (no NaN codes; scales where every decoded weight is a
// normal bf16), N not a multiple of its 128-row weight tile (rows past N clamped, never stored),
// K = 192 (fewer k tiles than pipeline stages) and 1024, groups of 0, 1, 65 (a token tile and
// one row) and 300 rows (two tiles of 128 or one of 256, then 44 rows), on every SM and on 3
// persistent CTAs (each walks several tiles). The products are exact in fp32 (bf16 x bf16), so fp32
// accumulation noise bounds the error; a wrong swizzle, scale, row, k tile or group is off by O(1).
struct PackedCase {
  Precision precision;
  int n, k;
};
const char* tile_name(cuda::experts::wgmma::PackedTokenTile tile) {
  using cuda::experts::wgmma::PackedTokenTile;
  return tile == PackedTokenTile::t64        ? "64"
         : tile == PackedTokenTile::t16_e4m3 ? "16 (E4M3)"
         : tile == PackedTokenTile::t16      ? "16"
         : tile == PackedTokenTile::t128     ? "128"
                                             : "256";
}
// The E4M3 tile (t16_e4m3: mxfp8, mxfp4) multiplies E4M3 codes: its token rows are MXFP8 (random
// rows encoded by the host codec), and WGMMA's FP8 sums within each k32 block keep fewer bits than
// fp32, so its bound is looser (a wrong block scale is still off by a factor of 2 or more).
// With `epilogue` (an activating FC1, PackedFc1Epilogue, and its biases b13: [groups, N] on the
// device, or nullptr), returns nothing and fills *h instead: the values of h's elements (the
// E4M3 tile: each E4M3 code times its block's scale value; else the bf16 codes' values).
// FC2's bf16 rows (GemmOutput::bf16_rows) asked of run_packed_gemm: each row's scale, the groups'
// weight factors and bias rows (host arrays it puts on the device); the rows come back in `out`.
struct PackedRows {
  std::vector<float> row_scale;            // [rows]
  std::vector<float> divisor, multiplier;  // [groups]
  std::vector<float> bias;                 // [groups, N]
  std::vector<std::uint16_t> out;          // [rows, N]
};
const Groups kPackedGroups({0, 1, 65, 300, 0});
std::vector<float> run_packed_gemm(
    const PackedCase& c, int sms, cuda::experts::wgmma::PackedTokenTile tile,
    const cuda::experts::wgmma::PackedFc1Epilogue* epilogue = nullptr,
    std::vector<float>* h = nullptr, const float* b13 = nullptr, PackedRows* rows = nullptr) {
  using cuda::experts::PackedMatrices;
  using cuda::experts::wgmma::PackedGroupedGemm;
  const int n = c.n, k = c.k;
  const Groups& g = kPackedGroups;
  // fp8_block128 (the E4M3 tile only): E4M3 codes with an fp32 scale per 128 x 128 weights and
  // per 1 x 128 of a token row
  const bool fp8 = c.precision == Precision::fp8_block128;
  const int bits = c.precision == Precision::mxfp8 || fp8 ? 8 : 4;
  const int block = c.precision == Precision::nvfp4 ? formats::kNvfp4Block
                    : fp8                           ? formats::kFp8Block128
                                                    : formats::kMxfp8Block;
  const std::size_t weights = static_cast<std::size_t>(g.count()) * n * k;
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> byte(0, 255);
  const bool e4m3 = tile == cuda::experts::wgmma::PackedTokenTile::t16_e4m3;
  std::vector<std::uint16_t> a(static_cast<std::size_t>(g.total) * k);
  std::vector<std::uint8_t> a8(e4m3 ? a.size() : 0), a8_codes(e4m3 && !fp8 ? a.size() / 32 : 0);
  std::vector<float> a8_scale(e4m3 ? a.size() / (fp8 ? formats::kFp8Block128 : 32) : 0);
  if (e4m3) {  // MXFP8 (or FP8 block-128) rows, whose values are the tokens
    std::vector<float> row(static_cast<std::size_t>(k));
    for (int r = 0; r < g.total; ++r) {
      for (auto& v : row) v = normal(rng);
      const std::size_t at = static_cast<std::size_t>(r) * k;
      if (fp8)
        formats::fp8_block128_encode_row(row.data(), k, a8.data() + at,
                                         a8_scale.data() + at / formats::kFp8Block128);
      else
        formats::mxfp8_encode_row(row.data(), k, ScaleRounding::rceil, a8.data() + at,
                                  a8_codes.data() + at / 32);
    }
    for (std::size_t i = 0; i < a8_codes.size(); ++i)
      a8_scale[i] = formats::e8m0_to_float(a8_codes[i]);
  } else {
    for (auto& v : a) v = formats::float_to_bf16(normal(rng));
  }
  const auto token = [&](std::size_t at) {  // element `at` of [rows, K]
    if (fp8)
      return static_cast<double>(
          formats::fp8_block128_decode_value(a8[at], a8_scale[at / formats::kFp8Block128]));
    return e4m3 ? static_cast<double>(formats::mxfp8_decode_value(a8[at], a8_codes[at / 32]))
                : static_cast<double>(formats::bf16_to_float(a[at]));
  };
  // fp8_block128's weight scales: fp32 values, one per 128 x 128 ([groups, ceil(N / 128), K /
  // 128]), not powers of two; the other formats' block scale codes
  const int row_tiles = (n + formats::kFp8Block128 - 1) / formats::kFp8Block128;
  std::vector<float> tile_scales(fp8 ? static_cast<std::size_t>(g.count()) * row_tiles * k / 128
                                     : 0);
  for (auto& v : tile_scales)
    v = std::ldexp(1.0f + static_cast<float>(byte(rng)) / 256.0f, byte(rng) % 9 - 4);
  std::vector<std::uint8_t> codes(weights * bits / 8), scales(fp8 ? 0 : weights / block);
  for (auto& v : codes) {
    v = static_cast<std::uint8_t>(byte(rng));
    if (bits == 8 && formats::e4m3_is_nan(v)) v = 0x7e;
  }
  for (auto& v : scales)  // MX: 2^-8 .. 2^7; NVFP4: E4M3 scales 2^-3 .. 2^4 (codes 32..94)
    v = static_cast<std::uint8_t>(c.precision == Precision::nvfp4 ? 32 + byte(rng) % 63
                                                                  : 119 + byte(rng) % 16);
  const auto decoded = [&](std::size_t at) {  // weight `at` of [groups, N, K]
    if (fp8) {
      const std::size_t group = at / (static_cast<std::size_t>(n) * k), row = at / k % n;
      const std::size_t scale_at = (group * row_tiles + row / 128) * (k / 128) + at % k / 128;
      return static_cast<double>(
          formats::fp8_block128_decode_value(codes[at], tile_scales[scale_at]));
    }
    const std::uint8_t s = scales[at / block];
    if (c.precision == Precision::mxfp8)
      return static_cast<double>(formats::e4m3_to_float(codes[at])) * formats::e8m0_to_float(s);
    const std::uint8_t nibble = (codes[at / 2] >> (4 * (at % 2))) & 0xF;
    return static_cast<double>(formats::e2m1_to_float(nibble)) * (c.precision == Precision::nvfp4
                                                                      ? formats::e4m3_to_float(s)
                                                                      : formats::e8m0_to_float(s));
  };
  const DeviceCopy<std::uint16_t> a_dev(a);
  const DeviceCopy<std::uint8_t> a8_dev(a8);
  const DeviceCopy<float> a8_scale_dev(a8_scale);
  const DeviceCopy<std::uint8_t> codes_dev(codes), scales_dev(scales);
  const DeviceCopy<float> tile_scales_dev(tile_scales);
  const DeviceCopy<float> d_dev(static_cast<std::size_t>(g.total) * n);
  const std::size_t h_size = static_cast<std::size_t>(g.total) * n / 2;
  const DeviceCopy<std::uint16_t> h_dev(h_size);
  const DeviceCopy<std::uint8_t> h8_dev(h_size);
  const DeviceCopy<float> h8_scale_dev(h_size / 32);
  const DeviceCopy<std::uint16_t> rows_dev(static_cast<std::size_t>(g.total) * n);
  const PackedRows no_rows;
  const PackedRows& asked = rows != nullptr ? *rows : no_rows;
  const DeviceCopy<float> row_scale_dev(asked.row_scale), divisor_dev(asked.divisor),
      multiplier_dev(asked.multiplier), bias_dev(asked.bias);
  // (fp8_block128's fp32 scales through `scales`, as the wgmma backend hands them over)
  PackedMatrices w{codes_dev.ptr,
                   fp8 ? reinterpret_cast<std::uint8_t*>(tile_scales_dev.ptr) : scales_dev.ptr,
                   divisor_dev.ptr,
                   multiplier_dev.ptr,
                   n,
                   k};

  const GemmOutput output = rows != nullptr ? GemmOutput::bf16_rows : GemmOutput::fp32_sums;
  PackedGroupedGemm gemm(c.precision, g.count(), n, k, sms, 0, tile, epilogue, output);
  EXPECT_EQ(gemm.tile(), tile);
  EXPECT_EQ(gemm.output(), output);
  std::vector<const std::uint16_t*> a_ptr;
  std::vector<const std::uint8_t*> a8_ptr;
  std::vector<const float*> a8_scale_ptr, b13_ptr;
  std::vector<float*> d_ptr, h8_scale_ptr;
  std::vector<std::uint16_t*> h_ptr, rows_ptr;
  std::vector<std::uint8_t*> h8_ptr;
  std::vector<const float*> row_scale_ptr, bias_ptr;
  for (int group = 0; group < g.count(); ++group) {
    const auto first = static_cast<std::size_t>(g.first[group]);
    rows_ptr.push_back(rows_dev.ptr + first * n);
    row_scale_ptr.push_back(rows != nullptr ? row_scale_dev.ptr + first : nullptr);
    bias_ptr.push_back(rows != nullptr ? bias_dev.ptr + static_cast<std::size_t>(group) * n
                                       : nullptr);
    a_ptr.push_back(a_dev.ptr + first * k);
    a8_ptr.push_back(e4m3 ? a8_dev.ptr + first * k : nullptr);
    a8_scale_ptr.push_back(e4m3 ? a8_scale_dev.ptr + first * k / (fp8 ? 128 : 32) : nullptr);
    d_ptr.push_back(d_dev.ptr + first * n);
    h_ptr.push_back(h_dev.ptr + first * n / 2);
    h8_ptr.push_back(h8_dev.ptr + first * n / 2);
    h8_scale_ptr.push_back(h8_scale_dev.ptr + first * n / 64);
    b13_ptr.push_back(b13 == nullptr ? nullptr : b13 + static_cast<std::size_t>(group) * n);
  }
  const auto& arrays = gemm.arrays();
  upload(arrays.problems, g.problems(n, k));
  upload(arrays.a, a_ptr);
  upload(arrays.a8, a8_ptr);
  upload(arrays.a8_scale, a8_scale_ptr);
  upload(arrays.d, d_ptr);
  upload(arrays.h, h_ptr);
  upload(arrays.h8, h8_ptr);
  upload(arrays.h8_scale, h8_scale_ptr);
  upload(arrays.b13, b13_ptr);
  upload(arrays.d16, rows_ptr);
  upload(arrays.row_scale, row_scale_ptr);
  upload(arrays.bias, bias_ptr);
  gemm.run(w, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (rows != nullptr) {
    rows->out = from_device(rows_dev.ptr, static_cast<std::size_t>(g.total) * n);
    return {};
  }
  if (epilogue != nullptr) {
    h->resize(h_size);
    if (e4m3) {
      const std::vector<std::uint8_t> q = from_device(h8_dev.ptr, h_size);
      const std::vector<float> q_scale = from_device(h8_scale_dev.ptr, h_size / 32);
      for (std::size_t i = 0; i < h_size; ++i)
        (*h)[i] = formats::e4m3_to_float(q[i]) * q_scale[i / 32];  // exact: both from E4M3, E8M0
    } else {
      const std::vector<std::uint16_t> h16 = from_device(h_dev.ptr, h_size);
      for (std::size_t i = 0; i < h_size; ++i) (*h)[i] = formats::bf16_to_float(h16[i]);
    }
    return {};
  }
  std::vector<float> d = from_device(d_dev.ptr, static_cast<std::size_t>(g.total) * n);
  const double worst = worst_relative_error(g, n, k, d, [&](int r, int group, int col, int i) {
    return token(static_cast<std::size_t>(r) * k + i) *
           decoded((static_cast<std::size_t>(group) * n + col) * k + i);
  });
  std::printf(
      "packed GEMM %s N=%d K=%d, %s token rows, on %d CTAs: worst |D - exact| / sum|a w| = "
      "%.3g\n",
      to_string(c.precision), n, k, tile_name(tile), sms, worst);
  EXPECT_LT(worst, e4m3 ? 1e-3 : 1e-5) << to_string(c.precision) << " N=" << n << " K=" << k;
  return d;
}

// Every token tile (64, 128 and 256 rows) gives the same bits: each output is the same k16 WGMMA
// steps over the same k tiles in the same order. The E4M3 tile (t16_e4m3, other inputs and sums;
// mxfp8, and mxfp4 whose E2M1 codes its converter warpgroup turns into E4M3 codes) gives the same
// bits on 3 CTAs as on all; nvfp4 cannot make it.
TEST(GpuGroupedGemm, PackedWeightsMatchAFloat64GemmOfTheDecodedValues) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  using cuda::experts::wgmma::PackedTokenTile;
  for (const PackedCase& c :
       {PackedCase{Precision::mxfp8, 320, 192}, PackedCase{Precision::mxfp8, 256, 1024},
        PackedCase{Precision::mxfp4, 320, 1024}, PackedCase{Precision::nvfp4, 320, 1024},
        // one k tile: the k loop's first tile is its last (and the split K's second pair idle)
        PackedCase{Precision::mxfp8, 192, 64}, PackedCase{Precision::mxfp4, 192, 64},
        PackedCase{Precision::nvfp4, 128, 64}}) {
    const std::vector<float> all = run_packed_gemm(c, sm_count(), PackedTokenTile::t64);
    const std::vector<float> three = run_packed_gemm(c, 3, PackedTokenTile::t64);
    const std::vector<float> wide = run_packed_gemm(c, sm_count(), PackedTokenTile::t128);
    const std::vector<float> widest = run_packed_gemm(c, sm_count(), PackedTokenTile::t256);
    EXPECT_EQ(std::memcmp(all.data(), three.data(), all.size() * sizeof(float)), 0)
        << "3 persistent CTAs give other bits than one per SM: " << to_string(c.precision);
    EXPECT_EQ(std::memcmp(all.data(), wide.data(), all.size() * sizeof(float)), 0)
        << "128 token rows give other bits than 64: " << to_string(c.precision);
    if (c.precision == Precision::mxfp8 || c.precision == Precision::mxfp4) {
      const std::vector<float> e4m3 = run_packed_gemm(c, sm_count(), PackedTokenTile::t16_e4m3);
      const std::vector<float> e4m3_three = run_packed_gemm(c, 3, PackedTokenTile::t16_e4m3);
      EXPECT_EQ(std::memcmp(e4m3.data(), e4m3_three.data(), e4m3.size() * sizeof(float)), 0)
          << "the E4M3 tile on 3 persistent CTAs gives other bits than one per SM: "
          << to_string(c.precision);
    } else {
      EXPECT_THROW(cuda::experts::wgmma::PackedGroupedGemm(c.precision, 1, c.n, c.k, 1, 0,
                                                           PackedTokenTile::t16_e4m3),
                   Error)
          << to_string(c.precision);
      // nvfp4's 16-row decoding tile (split K: its sums in another order than the wider tiles',
      // each against float64 in run_packed_gemm) gives the same bits on 3 CTAs as on all
      const std::vector<float> rows16 = run_packed_gemm(c, sm_count(), PackedTokenTile::t16);
      const std::vector<float> rows16_three = run_packed_gemm(c, 3, PackedTokenTile::t16);
      EXPECT_EQ(std::memcmp(rows16.data(), rows16_three.data(), rows16.size() * sizeof(float)), 0)
          << "the 16-row tile on 3 persistent CTAs gives other bits than one per SM";
    }
    if (c.precision != Precision::nvfp4) {
      EXPECT_THROW(cuda::experts::wgmma::PackedGroupedGemm(c.precision, 1, c.n, c.k, 1, 0,
                                                           PackedTokenTile::t16),
                   Error)
          << to_string(c.precision);
    }
    EXPECT_EQ(std::memcmp(wide.data(), widest.data(), all.size() * sizeof(float)), 0)
        << "256 token rows give other bits than 128: " << to_string(c.precision);
  }
}

// fp8_block128 on the E4M3 tile (its buckets of a few rows per expert): E4M3 weights with fp32
// scales per 128 x 128 (not powers of two) times FP8 token rows with one per 1 x 128, against
// float64 over the decoded values (run_packed_gemm's E4M3 bound: a wrong tile scale, token scale or
// k128 block is off by far more), N past its last 128-row tile, one k128 block (each split-K pair
// one k tile) and three; the same bits on 3 persistent CTAs as on all. The tile is its only one,
// and it needs K a multiple of 128 (the tokens' scales).
TEST(GpuGroupedGemm, Fp8BlockWeightsOnTheE4m3TileMatchAFloat64GemmOfTheDecodedValues) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  using cuda::experts::wgmma::PackedGroupedGemm;
  using cuda::experts::wgmma::PackedTokenTile;
  const Precision fp8 = Precision::fp8_block128;
  for (const PackedCase& c :
       {PackedCase{fp8, 320, 1024}, PackedCase{fp8, 256, 128}, PackedCase{fp8, 128, 384}}) {
    const std::vector<float> all = run_packed_gemm(c, sm_count(), PackedTokenTile::t16_e4m3);
    const std::vector<float> three = run_packed_gemm(c, 3, PackedTokenTile::t16_e4m3);
    EXPECT_EQ(std::memcmp(all.data(), three.data(), all.size() * sizeof(float)), 0)
        << "3 persistent CTAs give other bits than one per SM: N=" << c.n << " K=" << c.k;
  }
  for (const PackedTokenTile tile :
       {PackedTokenTile::t16, PackedTokenTile::t64, PackedTokenTile::t128, PackedTokenTile::t256})
    EXPECT_THROW(PackedGroupedGemm(fp8, 1, 256, 1024, 1, 0, tile), Error) << tile_name(tile);
  EXPECT_THROW(PackedGroupedGemm(fp8, 1, 256, 192, 1, 0, PackedTokenTile::t16_e4m3), Error);
}

// FC2 of the staged combine (GemmOutput::bf16_rows) on nvfp4's 16-row tile: the same GEMM's fp32
// sums over their row's scale and the group's weight factors, plus its bias row, rounded to bf16
// once (the home kernel's arithmetic, math::unscaled), bit for bit. NVFP4 rows have a scale and
// weights a divisor and a multiplier, as the backend sets them. Only nvfp4's 16-row decoding tile
// stores bf16 rows; the E4M3 tile and the 64- to 256-row tiles refuse them (they store sums).
TEST(GpuGroupedGemm, PackedBf16RowsAreTheSumsUnscaledPlusTheBiasRowRoundedOnce) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  using cuda::experts::wgmma::PackedTokenTile;
  const Groups& g = kPackedGroups;
  const PackedCase c{Precision::nvfp4, 320, 1024};
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> uniform(0.25f, 4.0f);
  PackedRows rows;
  rows.row_scale.resize(static_cast<std::size_t>(g.total));
  rows.divisor.resize(static_cast<std::size_t>(g.count()));
  rows.multiplier.resize(rows.divisor.size());
  for (auto& v : rows.row_scale) v = uniform(rng);
  for (auto& v : rows.divisor) v = uniform(rng);
  for (auto& v : rows.multiplier) v = uniform(rng);
  rows.bias = BiasRows::random(static_cast<std::size_t>(g.count()) * c.n, 29);
  const std::vector<float> sums = run_packed_gemm(c, sm_count(), PackedTokenTile::t16);
  run_packed_gemm(c, sm_count(), PackedTokenTile::t16, nullptr, nullptr, nullptr, &rows);
  ASSERT_EQ(rows.out.size(), sums.size());
  std::size_t differ = 0;
  for (int group = 0; group < g.count(); ++group)
    for (int r = g.first[group]; r < g.first[group] + g.rows[group]; ++r)
      for (int col = 0; col < c.n; ++col) {
        const std::size_t i = static_cast<std::size_t>(r) * c.n + col;
        float v = math::unscaled(sums[i], rows.row_scale[r], rows.divisor[group]);
        if (rows.multiplier[group] != 1.0f) v *= rows.multiplier[group];
        v += rows.bias[static_cast<std::size_t>(group) * c.n + col];
        differ += rows.out[i] != formats::float_to_bf16(v) ? 1 : 0;
      }
  EXPECT_EQ(differ, 0u) << "of " << sums.size();
  for (const auto& [precision, tile] : {std::pair{Precision::mxfp8, PackedTokenTile::t16_e4m3},
                                        std::pair{Precision::mxfp8, PackedTokenTile::t64},
                                        std::pair{Precision::mxfp4, PackedTokenTile::t256},
                                        std::pair{Precision::nvfp4, PackedTokenTile::t128}})
    EXPECT_THROW(cuda::experts::wgmma::PackedGroupedGemm(precision, 1, 320, 1024, 1, 0, tile,
                                                         nullptr, GemmOutput::bf16_rows),
                 Error)
        << to_string(precision) << ", " << tile_name(tile) << " token rows";
}

// An activating FC1 (mxfp8 / mxfp4 layers: FC2's input is MXFP8) against the plain GEMM's sums
// (the same fp32 sums: each output is the same WGMMA steps in the same k order): per row and output
// j of I, the activation of gate j and up I + j, each plus its bias, then MXFP8 per 32 outputs and
// the decoded value's bf16 code, computed on the host. The host's activation takes IEEE exp and
// division where the device takes the fast ones (a few fp32 ulps), so a code may differ by one
// E4M3 step, rarely; a wrong row mapping, bias, block or token row is off by far more, everywhere.
TEST(GpuGroupedGemm, PackedFc1EpilogueActivatesAndQuantizesLikeTheActivateKernel) {
  if (!have_gpu()) GTEST_SKIP() << "needs a GPU";
  using cuda::experts::wgmma::PackedFc1Epilogue;
  using cuda::experts::wgmma::PackedTokenTile;
  const int inter = 128, n = 2 * inter, groups = 5, total = 0 + 1 + 65 + 300 + 0;
  std::vector<float> b13(static_cast<std::size_t>(groups) * n);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> bias(-2.0f, 2.0f);
  for (auto& v : b13) v = bias(rng);
  const DeviceCopy<float> b13_dev(b13);
  for (const Precision p : {Precision::mxfp8, Precision::mxfp4}) {
    const PackedCase c{p, n, 192};
    for (const bool oai : {false, true}) {
      const PackedFc1Epilogue epilogue{oai ? Activation::swiglu_oai : Activation::swiglu,
                                       oai ? kSwigluOaiLimit : 0.0f, ScaleRounding::rceil};
      // The group of each row (groups {0, 1, 65, 300, 0}, as run_packed_gemm's).
      const auto group_of_row = [](int r) { return r < 1 ? 1 : r < 66 ? 2 : 3; };
      for (const PackedTokenTile tile :
           {PackedTokenTile::t64, PackedTokenTile::t16_e4m3, PackedTokenTile::t256}) {
        // the plain GEMM's sums of the same inputs (the E4M3 tile takes MXFP8 rows)
        const std::vector<float> d = run_packed_gemm(c, sm_count(), tile);
        std::vector<float> h;
        run_packed_gemm(c, sm_count(), tile, &epilogue, &h, oai ? b13_dev.ptr : nullptr);
        ASSERT_EQ(h.size(), static_cast<std::size_t>(total) * inter);
        std::size_t differ = 0;
        double worst = 0.0;
        for (int r = 0; r < total; ++r) {
          const float* bg =
              oai ? b13.data() + static_cast<std::size_t>(group_of_row(r)) * n : nullptr;
          const float* bu = bg == nullptr ? nullptr : bg + inter;
          for (int b = 0; b < inter / 32; ++b) {
            float v[32];
            std::uint32_t amax = 0;
            for (int j = 0; j < 32; ++j) {
              const int out = 32 * b + j;
              const float* row = d.data() + static_cast<std::size_t>(r) * n;
              v[j] = math::activation_f32(epilogue.activation, math::biased(row[out], bg, out),
                                          math::biased(row[inter + out], bu, out),
                                          epilogue.swiglu_limit);
              amax = std::max(amax, formats::float_bits(v[j]) & formats::kF32AbsMask);
            }
            const std::uint8_t code =
                formats::mxfp8_scale_code(formats::bits_float(amax), ScaleRounding::rceil);
            for (int j = 0; j < 32; ++j) {
              const std::uint8_t q =
                  formats::mxfp8_encode_value(v[j], code, formats::mxfp8_inverse_scale(code));
              // (mxfp8 stores the codes, mxfp4 the value's bf16 code: the same value, exact)
              const float want = formats::bf16_to_float(
                  formats::float_to_bf16(formats::mxfp8_decode_value(q, code)));
              const float got = h[static_cast<std::size_t>(r) * inter + 32 * b + j];
              if (got == want || (std::isnan(got) && std::isnan(want))) continue;
              ++differ;
              // In E4M3 steps at this magnitude: 1/8 of the value, or the subnormal step 2^-9 of
              // the block scale 2^(code - 127).
              const double step = std::max(std::abs(static_cast<double>(want)) / 8.0,
                                           std::ldexp(1.0, static_cast<int>(code) - 127 - 9));
              worst = std::max(worst, std::abs(static_cast<double>(got) - want) / step);
            }
          }
        }
        std::printf(
            "activating FC1 %s %s, %s token rows: %zu of %d codes differ, worst %.3g E4M3 steps\n",
            to_string(p), to_string(epilogue.activation), tile_name(tile), differ, total * inter,
            worst);
        EXPECT_LE(differ, static_cast<std::size_t>(total) * inter / 200) << to_string(p);
        EXPECT_LE(worst, 1.0) << to_string(p);  // one E4M3 step at most
      }
    }
  }
  // Where it cannot: NVFP4's FC2 input (a per-row s_enc over all of I), or N not 2I with I a
  // multiple of 64.
  EXPECT_NE(cuda::experts::wgmma::PackedGroupedGemm::cannot_activate(Precision::nvfp4, 256),
            nullptr);
  EXPECT_NE(cuda::experts::wgmma::PackedGroupedGemm::cannot_activate(Precision::mxfp8, 192),
            nullptr);
  EXPECT_EQ(cuda::experts::wgmma::PackedGroupedGemm::cannot_activate(Precision::mxfp4, 256),
            nullptr);
}

// What the constructor refuses, naming the argument.
TEST(GpuGroupedGemm, PackedGemmRefusesWhatItCannotTake) {
  using cuda::experts::wgmma::PackedGroupedGemm;
  EXPECT_NE(PackedGroupedGemm::cannot_take(Precision::bf16, 4, 256, 256), nullptr);
  EXPECT_NE(PackedGroupedGemm::cannot_take(Precision::mxfp8, 4, 256, 96), nullptr);
  EXPECT_NE(PackedGroupedGemm::cannot_take(Precision::mxfp8, 0, 256, 256), nullptr);
  EXPECT_NE(PackedGroupedGemm::cannot_take(Precision::mxfp4, 4, 256, (1 << 22) + 64), nullptr);
  EXPECT_EQ(PackedGroupedGemm::cannot_take(Precision::mxfp4, 4, 256, 1 << 22), nullptr);
  EXPECT_EQ(PackedGroupedGemm::cannot_take(Precision::nvfp4, 4, 320, 192), nullptr);
}

}  // namespace
}  // namespace epmoe
