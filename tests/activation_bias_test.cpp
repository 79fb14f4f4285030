// The expert activations (LayerOptions::activation) and the optional per-expert biases (b13, b2):
// the gpt-oss expression at known points, swiglu_oai differing from swiglu, the CPU executor
// agreeing with the reference bit for bit (staged) for every precision and combine, the reference
// agreeing with the unquantized float64 forward, and bad biases named in the error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "epmoe/epmoe.hpp"
#include "formats/codec.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "math/activation.hpp"

namespace epmoe {
namespace {

using ::testing::HasSubstr;

double sigmoid(double z) {
  return 1.0 / (1.0 + std::exp(-z));
}

TEST(SwigluOai, IsGptOssExpressionAtKnownPoints) {
  // transformers GptOssExperts._apply_gate: gate.clamp(max=limit), up.clamp(-limit, limit),
  // (up + 1) * (gate * sigmoid(gate * 1.702)).
  EXPECT_DOUBLE_EQ(math::swiglu_oai(1.0, 2.0, 7.0f), 3.0 * sigmoid(1.702));
  EXPECT_DOUBLE_EQ(math::swiglu_oai(-0.5, 0.25, 7.0f), 1.25 * -0.5 * sigmoid(-0.851));
  // Clamped: gate 10 -> 7, up -9 -> -7; gate below -limit is not clamped.
  EXPECT_DOUBLE_EQ(math::swiglu_oai(10.0, -9.0, 7.0f), -6.0 * 7.0 * sigmoid(7.0 * 1.702));
  EXPECT_DOUBLE_EQ(math::swiglu_oai(-9.0, 9.0, 7.0f), 8.0 * -9.0 * sigmoid(-9.0 * 1.702));
  // up = -1 cancels the output; NaN propagates through the clamps, as torch.clamp does.
  EXPECT_EQ(math::swiglu_oai(3.0, -1.0, 7.0f), 0.0);
  EXPECT_TRUE(std::isnan(math::swiglu_oai(std::nan(""), 1.0, 7.0f)));
  EXPECT_TRUE(std::isnan(math::swiglu_oai(1.0, std::nan(""), 7.0f)));
}

TEST(SwigluOai, DiffersFromSwigluOnTheSameInputs) {
  for (const double gate : {-2.0, -0.3, 0.4, 1.5, 6.0})
    for (const double up : {-1.5, 0.2, 2.0}) {
      EXPECT_NE(math::activation(Activation::swiglu_oai, gate, up, 7.0f),
                math::activation(Activation::swiglu, gate, up, 7.0f))
          << "gate=" << gate << " up=" << up;
      EXPECT_EQ(math::activation(Activation::swiglu, gate, up, 7.0f), math::swiglu(gate, up, 7.0f));
    }
}

constexpr LayerShape kShape{64, 128, 8, 3, 12};

reference::LayerWeights biased_weights(std::uint64_t seed) {
  auto w = harness::make_random_weights(kShape, seed);
  harness::add_random_biases(w, kShape, seed + 1);
  return w;
}

LayerOptions oai_options(Combine combine, float limit = kSwigluOaiLimit) {
  LayerOptions o;
  o.combine = combine;
  o.activation = Activation::swiglu_oai;
  o.swiglu_limit = limit;
  o.timeout_ms = 5'000;
  return o;
}

// Every rank's y of a few rounds (some T = 0, all routings) on the CPU executor.
std::vector<std::vector<std::uint16_t>> run_rounds(Cluster& cluster, int world, int rounds,
                                                   std::uint64_t seed, bool check, Combine combine,
                                                   Precision precision) {
  std::vector<std::vector<std::uint16_t>> ys(static_cast<std::size_t>(world * rounds));
  run_on_rank_threads(world, [&](int rank) {
    for (int r = 0; r < rounds; ++r) {
      const std::int64_t tokens = r == 1 ? 0 : kShape.max_tokens_per_rank - r;
      const auto routing = r == 2 ? harness::Routing::one_expert : harness::Routing::uniform;
      const reference::Batch batch = harness::make_random_batch(
          kShape, world, tokens, routing, r, seed * 97 + static_cast<std::uint64_t>(rank * 13 + r));
      auto y = cluster.forward(rank, batch);
      if (check) {
        const auto c = reference::check_output(y, cluster.reference(rank).forward(batch), combine,
                                               ExpertMath::exact, precision);
        EXPECT_TRUE(c.pass) << "rank " << rank << " round " << r << " mismatches "
                            << c.stats.mismatches << " (" << c.rule << ")";
      }
      ys[static_cast<std::size_t>(rank * rounds + r)] = std::move(y);
    }
  });
  return ys;
}

struct Case {
  Precision precision;
  Combine combine;
  Activation activation;
};

class HostMatchesReferenceWithBiases : public ::testing::TestWithParam<Case> {};

TEST_P(HostMatchesReferenceWithBiases, EveryRankEveryRound) {
  const Case c = GetParam();
  LayerOptions o = oai_options(c.combine, 0.75f);  // a small clamp, so some values are clamped
  o.activation = c.activation;
  const auto weights = biased_weights(3);
  Cluster cluster(kShape, c.precision, o, 2, weights);
  run_rounds(cluster, 2, 4, 5, true, c.combine, c.precision);
}

INSTANTIATE_TEST_SUITE_P(
    EveryPrecisionAndCombine, HostMatchesReferenceWithBiases,
    ::testing::Values(Case{Precision::bf16, Combine::staged, Activation::swiglu_oai},
                      Case{Precision::mxfp8, Combine::staged, Activation::swiglu_oai},
                      Case{Precision::nvfp4, Combine::staged, Activation::swiglu_oai},
                      Case{Precision::bf16, Combine::in_kernel_reduce, Activation::swiglu_oai},
                      Case{Precision::mxfp8, Combine::in_kernel_reduce, Activation::swiglu_oai},
                      Case{Precision::nvfp4, Combine::in_kernel_reduce, Activation::swiglu_oai},
                      Case{Precision::bf16, Combine::staged, Activation::swiglu},
                      Case{Precision::nvfp4, Combine::in_kernel_reduce, Activation::swiglu}),
    [](const auto& param_info) {
      return std::string(to_string(param_info.param.precision)) + "_" +
             to_string(param_info.param.combine) + "_" + to_string(param_info.param.activation);
    });

TEST(HostExecutor, SwigluOaiAndBiasesEachChangeTheOutput) {
  const auto plain = harness::make_random_weights(kShape, 3);
  const auto biased = biased_weights(3);
  LayerOptions swiglu;
  swiglu.timeout_ms = 5'000;
  swiglu.swiglu_limit = kSwigluOaiLimit;
  const auto y_of = [&](const LayerOptions& o, const reference::LayerWeights& w) {
    Cluster cluster(kShape, Precision::bf16, o, 2, w);
    return run_rounds(cluster, 2, 3, 5, true, o.combine, Precision::bf16);
  };
  const auto base = y_of(oai_options(Combine::staged), biased);
  EXPECT_NE(y_of(swiglu, biased), base) << "swiglu_oai computed swiglu";
  EXPECT_NE(y_of(oai_options(Combine::staged), plain), base) << "the biases changed nothing";
  auto only_b13 = biased;
  only_b13.b2.clear();
  EXPECT_NE(y_of(oai_options(Combine::staged), only_b13), base) << "b2 changed nothing";
}

TEST(HostExecutor, Bf16BiasesGiveTheSameBitsAsTheirF32Values) {
  const auto weights = biased_weights(11);
  std::vector<std::uint16_t> b13(weights.b13.size()), b2(weights.b2.size());
  for (std::size_t i = 0; i < b13.size(); ++i) b13[i] = formats::float_to_bf16(weights.b13[i]);
  for (std::size_t i = 0; i < b2.size(); ++i) b2[i] = formats::float_to_bf16(weights.b2[i]);
  const LayerOptions o = oai_options(Combine::staged);
  auto group = make_host_group(1);
  auto comm = make_host_communicator(group, 0);
  const LayerConfig config = make_config(kShape, Precision::mxfp8, 0, 1, o);
  ExpertWeights f32 = local_weight_views(weights, kShape, 0, 1);
  ExpertWeights bf16 = f32;
  bf16.b13 = view(b13.data(), DType::bf16, {kShape.num_experts, 2 * kShape.intermediate});
  bf16.b2 = view(b2.data(), DType::bf16, {kShape.num_experts, kShape.hidden});
  Layer a(*comm, config, f32);
  Layer b(*comm, config, bf16);
  const reference::Batch batch =
      harness::make_random_batch(kShape, 1, 12, harness::Routing::uniform, 0, 4);
  const auto ya = host_forward(a, batch), yb = host_forward(b, batch);
  EXPECT_EQ(ya, yb);
  reference::ReferenceModel ref(kShape, Precision::mxfp8, o, weights);
  EXPECT_TRUE(
      reference::check_output(ya, ref.forward(batch), o.combine, o.expert_math, Precision::mxfp8)
          .pass);
  // The fp32 values and scales of the weights, plus the fp32 biases.
  const auto matrices = static_cast<std::size_t>(kShape.num_experts) * 3 *
                        static_cast<std::size_t>(kShape.hidden * kShape.intermediate);
  EXPECT_EQ(a.resident_weight_bytes(),
            (matrices + 2 * static_cast<std::size_t>(kShape.num_experts) + b13.size() + b2.size()) *
                sizeof(float));
}

TEST(Reference, SwigluOaiWithBiasesAgreesWithTheUnquantizedForward) {
  const auto weights = biased_weights(21);
  const reference::Batch batch =
      harness::make_random_batch(kShape, 1, 12, harness::Routing::uniform, 0, 8);
  reference::ReferenceModel ref(kShape, Precision::bf16, oai_options(Combine::staged), weights);
  const auto exact = ref.forward_exact(batch);
  EXPECT_LT(reference::compare_exact(ref.forward(batch), exact).rel_l2, 0.02);
  // The same forward without the biases is far from it: the rule can fail.
  auto plain = weights;
  plain.b13.clear();
  plain.b2.clear();
  reference::ReferenceModel unbiased(kShape, Precision::bf16, oai_options(Combine::staged), plain);
  EXPECT_GT(reference::compare_exact(unbiased.forward(batch), exact).rel_l2, 0.1);
}

// A bad bias is named before anything runs (docs/errors.md).
std::string creation_error(const std::function<void(ExpertWeights&)>& edit) {
  const auto weights = biased_weights(1);
  auto group = make_host_group(1);
  auto comm = make_host_communicator(group, 0);
  ExpertWeights w = local_weight_views(weights, kShape, 0, 1);
  edit(w);
  try {
    Layer layer(*comm, make_config(kShape, Precision::bf16, 0, 1, oai_options(Combine::staged)), w);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    return e.what();
  }
  return "accepted";
}

TEST(BadBias, WrongShapeOrDtypeIsNamedInTheError) {
  EXPECT_EQ(creation_error([](ExpertWeights& w) {
              w.b13.shape = {8, 64};
            }),
            "Layer: weights.b13 has shape [8, 64], expected [8, 256]");
  EXPECT_EQ(creation_error([](ExpertWeights& w) {
              w.b2.shape = {8, 64, 1};
            }),
            "Layer: weights.b2 has shape [8, 64, 1], expected [8, 64]");
  EXPECT_EQ(creation_error([](ExpertWeights& w) { w.b2.dtype = DType::i32; }),
            "Layer: weights.b2 has dtype i32, expected bf16 or f32");
  EXPECT_EQ(creation_error([](ExpertWeights& w) { w.b13.dtype = DType::f64; }),
            "Layer: weights.b13 has dtype f64, expected bf16 or f32");
  EXPECT_EQ(creation_error([](ExpertWeights& w) { w.b13.data = nullptr; }),
            "Layer: weights.b13 has a null data pointer");
  // Absent biases are fine: a default TensorView.
  EXPECT_EQ(creation_error([](ExpertWeights& w) { w.b13 = w.b2 = TensorView{}; }), "accepted");
}

}  // namespace
}  // namespace epmoe
