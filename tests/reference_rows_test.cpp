// harness::reference_outputs / first_tokens / tokens_within (what `epmoe run` checks a round
// against): the reference of a batch split over threads, or of its first tokens, is the one-call
// reference's rows bit for bit, in every precision (each row's quantization is its own).
#include <gtest/gtest.h>

#include <vector>

#include "epmoe/epmoe.hpp"
#include "epmoe/models.hpp"
#include "harness/problem.hpp"
#include "harness/reference_rows.hpp"

namespace epmoe {
namespace {

constexpr LayerShape kShape{
    .hidden = 128, .intermediate = 64, .num_experts = 6, .top_k = 3, .max_tokens_per_rank = 32};

class ReferenceRows : public ::testing::TestWithParam<Precision> {};

TEST_P(ReferenceRows, SplitOverThreadsEqualsOneCall) {
  auto weights = harness::make_random_weights(kShape, 3);
  harness::add_random_biases(weights, kShape, 3);
  LayerOptions options;
  options.activation = Activation::swiglu_oai;
  options.swiglu_limit = 7.0f;
  reference::ReferenceModel model(kShape, GetParam(), options, weights);
  const reference::Batch batch =
      harness::make_random_batch(kShape, 2, 13, harness::Routing::uniform, 0, 5);
  const auto emulated = model.forward(batch);
  const auto exact = model.forward_exact(batch);
  for (unsigned threads : {1u, 3u, 13u, 40u}) {
    const auto out = harness::reference_outputs(model, batch, kShape, true, threads);
    EXPECT_EQ(out.emulated, emulated) << threads << " threads";
    EXPECT_EQ(out.exact, exact) << threads << " threads";
  }
  EXPECT_TRUE(harness::reference_outputs(model, batch, kShape, false, 4).exact.empty());
}

TEST_P(ReferenceRows, FirstTokensGiveThePrefixOfTheWholeBatchsReference) {
  const auto weights = harness::make_random_weights(kShape, 4);
  reference::ReferenceModel model(kShape, GetParam(), LayerOptions{}, weights);
  const reference::Batch batch =
      harness::make_random_batch(kShape, 2, 9, harness::Routing::uniform, 0, 6);
  const auto whole = model.forward(batch);
  const auto h = static_cast<std::size_t>(kShape.hidden);
  for (std::int64_t n : {0, 1, 4, 9, 20}) {
    const reference::Batch first = harness::first_tokens(batch, kShape, n);
    const auto t = static_cast<std::size_t>(std::min<std::int64_t>(n, 9));
    ASSERT_EQ(first.tokens, static_cast<std::int64_t>(t));
    EXPECT_EQ(first.topk_ids,
              std::vector<std::int32_t>(batch.topk_ids.begin(), batch.topk_ids.begin() + 3 * t));
    EXPECT_EQ(model.forward(first),
              std::vector<std::uint16_t>(whole.begin(), whole.begin() + t * h))
        << n << " tokens";
  }
}

INSTANTIATE_TEST_SUITE_P(EveryPrecision, ReferenceRows,
                         ::testing::Values(Precision::bf16, Precision::mxfp8, Precision::nvfp4,
                                           Precision::fp8_block128, Precision::mxfp4),
                         [](const auto& param_info) {
                           return std::string(to_string(param_info.param));
                         });

TEST(ReferenceRows, TokensWithinABudget) {
  // deepseek-v3: 8 x 3 x 7168 x 2048 = 352 M multiply-adds per token; qwen3-30b-a3b: 37.7 M.
  const LayerShape deepseek = find_model("deepseek-v3").layer_shape(64);
  const LayerShape qwen3 = find_model("qwen3-30b-a3b").layer_shape(64);
  EXPECT_EQ(harness::tokens_within(deepseek, 64, 4e9), 11);
  EXPECT_EQ(harness::tokens_within(qwen3, 64, 4e9), 64);
  EXPECT_EQ(harness::tokens_within(deepseek, 64, 1.0), 1);  // never none of them
  EXPECT_EQ(harness::tokens_within(deepseek, 0, 4e9), 0);
}

}  // namespace
}  // namespace epmoe
