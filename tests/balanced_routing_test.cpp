// The routing `epmoe bench gemm` times the expert GEMMs with (harness::make_balanced_routing):
// every expert gets exactly R (token, slot) pairs, each token K distinct experts, no dropped slot,
// and the shapes it cannot balance are refused naming the rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

#include "epmoe/epmoe.hpp"
#include "epmoe/models.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"

namespace epmoe {
namespace {

LayerShape shape(std::int64_t experts, std::int64_t top_k) {
  return LayerShape{64, 64, experts, top_k, 0};
}

// Rows per expert, and whether every token's experts are distinct and every weight is 1 / K.
void expect_balanced(const LayerShape& s, std::int64_t rows) {
  const harness::RoutingTable r = harness::make_balanced_routing(s, rows);
  const auto k = static_cast<std::size_t>(s.top_k);
  const std::int64_t tokens = harness::balanced_tokens(s, rows);
  ASSERT_EQ(tokens * s.top_k, s.num_experts * rows);
  ASSERT_EQ(r.topk_ids.size(), static_cast<std::size_t>(tokens) * k);
  ASSERT_EQ(r.topk_weights.size(), r.topk_ids.size());
  std::vector<std::int64_t> per_expert(static_cast<std::size_t>(s.num_experts), 0);
  for (std::size_t t = 0; t < static_cast<std::size_t>(tokens); ++t) {
    std::set<std::int32_t> distinct;
    float sum = 0.0f;
    for (std::size_t j = 0; j < k; ++j) {
      const std::int32_t e = r.topk_ids[t * k + j];
      ASSERT_GE(e, 0) << "token " << t << " slot " << j << ": no slot is dropped";
      ASSERT_LT(e, s.num_experts);
      ++per_expert[static_cast<std::size_t>(e)];
      distinct.insert(e);
      sum += r.topk_weights[t * k + j];
    }
    EXPECT_EQ(distinct.size(), k) << "token " << t << ": its K experts are distinct";
    EXPECT_NEAR(sum, 1.0f, 1e-5f) << "token " << t;
  }
  for (std::size_t e = 0; e < per_expert.size(); ++e)
    EXPECT_EQ(per_expert[e], rows)
        << "expert " << e << " of E=" << s.num_experts << ", K=" << s.top_k;
}

TEST(BalancedRouting, EveryExpertGetsExactlyRRowsAndEachTokenKDistinctExperts) {
  for (std::int64_t rows : {1, 4, 16, 64, 256})
    for (const auto& [e, k] : std::vector<std::pair<std::int64_t, std::int64_t>>{
             {16, 4}, {32, 8}, {8, 2}, {32, 4}, {8, 8}, {12, 8}})
      if ((e * rows) % k == 0) expect_balanced(shape(e, k), rows);
}

TEST(BalancedRouting, TheBenchModelsAtTheirDefaultExpertCapBalanceAtEveryDefaultR) {
  for (const char* name : {"qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "mixtral-8x7b"}) {
    LayerShape s = find_model(name).layer_shape(0);
    s.num_experts = std::min<std::int64_t>(s.num_experts, 32);  // `bench gemm --experts 32`
    for (std::int64_t rows : {1, 4, 16, 64}) expect_balanced(s, rows);
    for (std::int64_t rows : {256, 1024, 4096})  // the counts alone (the tables get large)
      EXPECT_EQ(harness::balanced_tokens(s, rows) * s.top_k, s.num_experts * rows) << name;
  }
}

TEST(BalancedRouting, RefusesFewerExpertsThanTopKAndRowsThatKCannotSplitNamingTheRule) {
  auto message = [](const LayerShape& s, std::int64_t rows) -> std::string {
    try {
      harness::make_balanced_routing(s, rows);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(message(shape(3, 8), 8).find("at least K experts"), std::string::npos);
  EXPECT_NE(message(shape(6, 4), 1).find("K must divide E x R"), std::string::npos);
  EXPECT_NE(message(shape(16, 4), 0).find("R must be >= 1"), std::string::npos);
}

TEST(BalancedRouting, ACpuLayerGivesEveryExpertItsRowsAndMatchesTheReference) {
  // The layer (CPU executor, world 1) computes exactly: the balanced round equals the reference,
  // so the routing is one the layer accepts as it is.
  LayerShape s = shape(16, 4);
  s.max_tokens_per_rank = harness::balanced_tokens(s, 4);
  const auto weights = harness::make_random_weights(s, 3);
  Cluster cluster(s, Precision::bf16, LayerOptions{}, 1, weights);
  reference::Batch batch =
      harness::make_random_batch(s, 1, s.max_tokens_per_rank, harness::Routing::uniform, 0, 5);
  harness::RoutingTable r = harness::make_balanced_routing(s, 4);
  batch.topk_ids = r.topk_ids;
  batch.topk_weights = r.topk_weights;
  EXPECT_EQ(cluster.forward(0, batch), cluster.reference(0).forward(batch));
}

}  // namespace
}  // namespace epmoe
