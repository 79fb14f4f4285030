// The bad-input table of docs/errors.md, the rows tests/faults_test.cpp (BadArguments,
// LayerCreation) does not already cover:
//  * non-finite numbers are not rejected: NaN / Inf in activations, in routing weights or in expert
//    weights come out as NaN / Inf in the rows they touch and nowhere else, for every precision
//    and combine mode, without a crash or a hang;
//  * misaligned and null pointers, a negative or missing token dimension are rejected;
//  * a rejected forward is not a round: the rank calls again and the round completes;
//  * after a failure, forward is refused at once (no wait), naming the original failure;
//  * ranks that create the layer with different shapes fail at creation on every rank.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <future>
#include <limits>

#include "epmoe/epmoe.hpp"
#include "formats/codec.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "support/watchdog.hpp"

namespace epmoe {
namespace {

using harness::Routing;
using reference::Batch;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

const LayerShape kShape{
    .hidden = 64, .intermediate = 64, .num_experts = 8, .top_k = 2, .max_tokens_per_rank = 8};
constexpr int kWorld = 2;
constexpr std::int64_t kTokens = 6;

using test::within_seconds;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool finite_bf16(std::uint16_t v) {
  return std::isfinite(formats::bf16_to_float(v));
}

// ---- non-finite inputs: rows they touch become non-finite, the others stay exact ----

struct NonFiniteCase {
  Precision precision;
  Combine combine;
};

class NonFinite : public ::testing::TestWithParam<NonFiniteCase> {
 protected:
  LayerOptions options() const {
    LayerOptions o;
    o.combine = GetParam().combine;
    o.timeout_ms = 5'000;
    return o;
  }

  // One round of every rank on `batches`; returns each rank's y.
  std::vector<std::vector<std::uint16_t>> run(Cluster& cluster, const std::vector<Batch>& batches) {
    std::vector<std::vector<std::uint16_t>> ys(kWorld);
    within_seconds(30, "a round with non-finite inputs", [&] {
      run_on_rank_threads(kWorld, [&](int rank) {
        ys[static_cast<std::size_t>(rank)] =
            cluster.forward(rank, batches[static_cast<std::size_t>(rank)]);
      });
    });
    for (int rank = 0; rank < kWorld; ++rank)
      EXPECT_TRUE(cluster.layer(rank).health().ok) << cluster.layer(rank).health().what;
    return ys;
  }

  std::vector<Batch> batches(std::uint64_t seed) const {
    std::vector<Batch> b;
    for (int rank = 0; rank < kWorld; ++rank)
      b.push_back(harness::make_random_batch(kShape, kWorld, kTokens, Routing::uniform, 0,
                                             seed + static_cast<std::uint64_t>(rank)));
    // Every token has an expert in slot 0 (uniform routing drops a slot now and then).
    for (Batch& x : b)
      for (std::int64_t t = 0; t < kTokens; ++t) {
        auto* ids = &x.topk_ids[static_cast<std::size_t>(t * kShape.top_k)];
        auto* w = &x.topk_weights[static_cast<std::size_t>(t * kShape.top_k)];
        if (ids[0] < 0) {
          ids[0] = ids[1] == 0 ? 1 : 0;
          w[0] = 0.5f;
        }
      }
    return b;
  }

  // y against the emulating reference with the rule every checker uses (bit-exact staged, 1 bf16
  // ulp in_kernel_reduce; NaN == NaN and equal infinities are equal).
  void expect_matches(const std::vector<std::uint16_t>& y, const std::vector<std::uint16_t>& ref,
                      const std::string& where) {
    const auto check = reference::check_output(y, ref, GetParam().combine, ExpertMath::exact,
                                               GetParam().precision);
    EXPECT_TRUE(check.pass) << where << ": " << check.stats.mismatches
                            << " elements outside tolerance, max_abs=" << check.stats.max_abs
                            << " (" << check.rule << ")";
  }

  // Row t of y: every element non-finite (all) or exactly the columns in `columns`.
  static void expect_row(const std::vector<std::uint16_t>& y, std::int64_t t, bool nonfinite_row,
                         const std::vector<std::int64_t>& only_columns, const std::string& where) {
    for (std::int64_t i = 0; i < kShape.hidden; ++i) {
      const bool finite = finite_bf16(y[static_cast<std::size_t>(t * kShape.hidden + i)]);
      bool expect_nonfinite = nonfinite_row;
      if (nonfinite_row && !only_columns.empty())
        expect_nonfinite =
            std::find(only_columns.begin(), only_columns.end(), i) != only_columns.end();
      ASSERT_EQ(finite, !expect_nonfinite) << where << ": row " << t << " column " << i;
    }
  }

  const reference::LayerWeights weights_ = harness::make_random_weights(kShape, 31);
};

TEST_P(NonFinite, NanAndInfInActivationsAndRoutingWeightsStayInTheirRow) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  Cluster cluster(kShape, GetParam().precision, options(), kWorld, weights_);
  std::vector<Batch> clean = batches(100);
  // rank 1, token 2 has no expert at all: its row is never sent, so NaN there cannot matter.
  for (std::int64_t k = 0; k < kShape.top_k; ++k) {
    clean[1].topk_ids[static_cast<std::size_t>(2 * kShape.top_k + k)] = -1;
    clean[1].topk_weights[static_cast<std::size_t>(2 * kShape.top_k + k)] = 0.0f;
  }
  std::vector<Batch> dirty = clean;
  // rank 0: NaN in one element of token 1, +Inf in token 3; rank 1: -Inf in token 0, a NaN
  // routing weight for token 4.
  dirty[0].x[1 * kShape.hidden + 5] = formats::float_to_bf16(nan);
  dirty[0].x[3 * kShape.hidden + 40] = formats::float_to_bf16(inf);
  dirty[1].x[0 * kShape.hidden + 63] = formats::float_to_bf16(-inf);
  dirty[1].topk_weights[4 * kShape.top_k + 0] = nan;
  dirty[1].x[2 * kShape.hidden + 7] = formats::float_to_bf16(nan);
  const std::vector<std::vector<std::int64_t>> poisoned{{1, 3}, {0, 4}};

  const auto ys = run(cluster, dirty);
  for (int rank = 0; rank < kWorld; ++rank) {
    const auto r = static_cast<std::size_t>(rank);
    const std::string where = "rank " + std::to_string(rank);
    // The emulating reference agrees everywhere, NaN included...
    expect_matches(ys[r], cluster.reference(rank).forward(dirty[r]), where + " vs reference");
    // ...the poisoned rows are NaN in every column...
    for (std::int64_t t : poisoned[r]) {
      expect_row(ys[r], t, true, {}, where);
      for (std::int64_t i = 0; i < kShape.hidden; ++i)
        EXPECT_TRUE(std::isnan(
            formats::bf16_to_float(ys[r][static_cast<std::size_t>(t * kShape.hidden + i)])))
            << where << " row " << t << " column " << i << ": expected NaN";
    }
    // ...a row without experts is zero whatever its x holds...
    if (rank == 1) {
      for (std::int64_t i = 0; i < kShape.hidden; ++i)
        EXPECT_EQ(ys[r][static_cast<std::size_t>(2 * kShape.hidden + i)], 0u) << "column " << i;
    }
    // ...and every other row is what the clean inputs give.
    const auto ref_clean = cluster.reference(rank).forward(clean[r]);
    for (std::int64_t t = 0; t < kTokens; ++t) {
      if (std::find(poisoned[r].begin(), poisoned[r].end(), t) != poisoned[r].end()) continue;
      const auto row = [&](const std::vector<std::uint16_t>& v) {
        return std::vector<std::uint16_t>(v.begin() + t * kShape.hidden,
                                          v.begin() + (t + 1) * kShape.hidden);
      };
      expect_matches(row(ys[r]), row(ref_clean), where + " clean row " + std::to_string(t));
    }
  }
  // Nothing is left behind: the next round with clean inputs is exact on every rank.
  const auto again = run(cluster, clean);
  for (int rank = 0; rank < kWorld; ++rank)
    expect_matches(again[static_cast<std::size_t>(rank)],
                   cluster.reference(rank).forward(clean[static_cast<std::size_t>(rank)]),
                   "the round after");
}

TEST_P(NonFinite, NanAndInfInExpertWeightsReachOnlyTheTokensRoutedThere) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const auto h = static_cast<std::size_t>(kShape.hidden);
  const auto inter = static_cast<std::size_t>(kShape.intermediate);
  // Expert 2 (rank 0): NaN in its w13 (gate row 7) -> the whole FC2 row is NaN.
  // Expert 5 (rank 1): +Inf in its w2 (output row 11) -> only column 11 is non-finite.
  reference::LayerWeights w = weights_;
  w.w13[2 * 2 * inter * h + 7 * h + 9] = formats::float_to_bf16(nan);
  w.w2[5 * h * inter + 11 * inter + 3] = formats::float_to_bf16(inf);
  Cluster cluster(kShape, GetParam().precision, options(), kWorld, w);

  std::vector<Batch> b = batches(200);
  // Route some tokens of each rank to expert 2 or 5, keep the rest away from both.
  for (int rank = 0; rank < kWorld; ++rank)
    for (std::int64_t t = 0; t < kTokens; ++t) {
      auto* ids =
          &b[static_cast<std::size_t>(rank)].topk_ids[static_cast<std::size_t>(t * kShape.top_k)];
      for (std::int64_t k = 0; k < kShape.top_k; ++k)
        if (ids[k] == 2 || ids[k] == 5) ids[k] = k == 0 ? 0 : 7;
      if (t == 1) ids[1] = 2;
      if (t == 4) ids[0] = 5;
      if (t == 5) {
        ids[0] = 2;
        ids[1] = 5;
      }
    }
  const auto ys = run(cluster, b);
  for (int rank = 0; rank < kWorld; ++rank) {
    const auto r = static_cast<std::size_t>(rank);
    const std::string where = "rank " + std::to_string(rank);
    expect_matches(ys[r], cluster.reference(rank).forward(b[r]), where + " vs reference");
    for (std::int64_t t = 0; t < kTokens; ++t) {
      if (t == 1 || t == 5)
        expect_row(ys[r], t, true, {}, where + " (expert 2, NaN in w13)");
      else if (t == 4)
        expect_row(ys[r], t, true, {11}, where + " (expert 5, Inf in w2)");
      else
        expect_row(ys[r], t, false, {}, where + " (not routed to 2 or 5)");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    BadInput, NonFinite,
    ::testing::Values(NonFiniteCase{Precision::bf16, Combine::staged},
                      NonFiniteCase{Precision::mxfp8, Combine::staged},
                      NonFiniteCase{Precision::nvfp4, Combine::staged},
                      NonFiniteCase{Precision::bf16, Combine::in_kernel_reduce},
                      NonFiniteCase{Precision::mxfp8, Combine::in_kernel_reduce},
                      NonFiniteCase{Precision::nvfp4, Combine::in_kernel_reduce}),
    [](const auto& param_info) {
      return std::string(to_string(param_info.param.precision)) + "_" +
             to_string(param_info.param.combine);
    });

// ---- bad tensors: rejected before anything runs, naming the argument; layer stays usable ----

class BadArguments : public ::testing::Test {
 protected:
  void SetUp() override {
    LayerOptions o;
    o.timeout_ms = 2'000;
    cluster_ = std::make_unique<Cluster>(kShape, Precision::bf16, o, 1, weights_);
    b_ = harness::make_random_batch(kShape, 1, 4, Routing::uniform, 0, 3);
    y_.resize(static_cast<std::size_t>(4 * kShape.hidden));
    raw_.resize(4096);
  }
  void TearDown() override {
    // Every rejection left the layer usable and in round 1.
    EXPECT_EQ(cluster_->layer(0).next_round(), 1u);
    const auto out = cluster_->forward(0, b_);
    EXPECT_EQ(reference::compare_bf16(out, cluster_->reference(0).forward(b_)).mismatches, 0);
  }
  std::string rejection(const TensorView& x, const TensorView& ids, const TensorView& w,
                        const TensorView& y) {
    try {
      cluster_->layer(0).forward(x, ids, w, y);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
      return e.what();
    }
    ADD_FAILURE() << "forward accepted a bad argument";
    return "";
  }
  TensorView x() { return view(b_.x.data(), DType::bf16, {4, kShape.hidden}); }
  TensorView ids() { return view(b_.topk_ids.data(), DType::i32, {4, kShape.top_k}); }
  TensorView w() { return view(b_.topk_weights.data(), DType::f32, {4, kShape.top_k}); }
  TensorView y() { return view(y_.data(), DType::bf16, {4, kShape.hidden}); }
  // A view `offset` bytes into an aligned scratch buffer.
  TensorView misaligned(TensorView t, std::size_t offset) {
    t.data = reinterpret_cast<std::byte*>(raw_.data()) + offset;
    return t;
  }

  const reference::LayerWeights weights_ = harness::make_random_weights(kShape, 4);
  std::unique_ptr<Cluster> cluster_;
  Batch b_;
  std::vector<std::uint16_t> y_;
  std::vector<std::uint64_t> raw_;
};

TEST_F(BadArguments, WrongDtypeNamesTheArgument) {
  TensorView bad = x();
  bad.dtype = DType::f32;
  EXPECT_THAT(rejection(bad, ids(), w(), y()), HasSubstr("x has dtype f32, expected bf16"));
  TensorView bad_ids = ids();
  bad_ids.dtype = DType::f32;
  EXPECT_THAT(rejection(x(), bad_ids, w(), y()), HasSubstr("topk_ids has dtype f32"));
  TensorView bad_w = w();
  bad_w.dtype = DType::bf16;
  EXPECT_THAT(rejection(x(), ids(), bad_w, y()), HasSubstr("topk_weights has dtype bf16"));
}

TEST_F(BadArguments, WrongShapeNamesTheArgument) {
  TensorView bad = x();
  bad.shape = {4, kShape.hidden + 64};
  EXPECT_THAT(rejection(bad, ids(), w(), y()), HasSubstr("x has shape [4, 128], expected [4, 64]"));
  TensorView bad_y = y();
  bad_y.shape = {3, kShape.hidden};
  EXPECT_THAT(rejection(x(), ids(), w(), bad_y), HasSubstr("y has shape [3, 64]"));
  TensorView bad_ids = ids();
  bad_ids.shape = {4, 1};
  EXPECT_THAT(rejection(x(), bad_ids, w(), y()), HasSubstr("topk_ids has shape [4, 1]"));
}

TEST_F(BadArguments, TooManyTokensNamesTheLimit) {
  std::vector<std::uint16_t> big(static_cast<std::size_t>(9 * kShape.hidden));
  EXPECT_THAT(rejection(view(big.data(), DType::bf16, {9, kShape.hidden}), ids(), w(), y()),
              HasSubstr("T=9 tokens: must be <= max_tokens_per_rank=8"));
}

TEST_F(BadArguments, ExpertIdsOutOfRangeNameTheSlot) {
  b_.topk_ids[5] = static_cast<std::int32_t>(kShape.num_experts);
  EXPECT_THAT(rejection(x(), ids(), w(), y()),
              HasSubstr("topk_ids[2, 1]=" + std::to_string(kShape.num_experts)));
  b_.topk_ids[5] = -2;
  EXPECT_THAT(rejection(x(), ids(), w(), y()), HasSubstr("topk_ids[2, 1]=-2"));
  b_.topk_ids[5] = -1;  // legal: no expert
}

TEST_F(BadArguments, WrongDeviceAndStridesNameTheArgument) {
  TensorView bad = y();
  bad.device = Device{DeviceKind::cuda, 0};
  EXPECT_THAT(rejection(x(), ids(), w(), bad), HasSubstr("y is on cuda:0, expected cpu"));
  TensorView strided = x();
  strided.strides = {1, 4};
  EXPECT_THAT(rejection(strided, ids(), w(), y()), HasSubstr("x is not contiguous"));
}

TEST_F(BadArguments, MisalignedPointersAreRejectedNamingTheArgument) {
  EXPECT_EQ(rejection(misaligned(x(), 1), ids(), w(), y()),
            "forward: x data pointer is not aligned to its element size (2 bytes)");
  EXPECT_EQ(rejection(x(), misaligned(ids(), 2), w(), y()),
            "forward: topk_ids data pointer is not aligned to its element size (4 bytes)");
  TensorView ids64 = ids();
  ids64.dtype = DType::i64;
  EXPECT_EQ(rejection(x(), misaligned(ids64, 4), w(), y()),
            "forward: topk_ids data pointer is not aligned to its element size (8 bytes)");
  EXPECT_EQ(rejection(x(), ids(), misaligned(w(), 1), y()),
            "forward: topk_weights data pointer is not aligned to its element size (4 bytes)");
  EXPECT_EQ(rejection(x(), ids(), w(), misaligned(y(), 3)),
            "forward: y data pointer is not aligned to its element size (2 bytes)");
}

TEST_F(BadArguments, NullPointerAndBadTokenDimensionAreRejected) {
  TensorView null_x = x();
  null_x.data = nullptr;
  EXPECT_EQ(rejection(null_x, ids(), w(), y()), "forward: x has a null data pointer");
  TensorView flat = x();
  flat.shape = {4 * kShape.hidden};
  EXPECT_EQ(rejection(flat, ids(), w(), y()), "forward: x has shape [256], expected [T, 64]");
  TensorView negative = x();
  negative.shape = {-1, kShape.hidden};
  EXPECT_EQ(rejection(negative, ids(), w(), y()), "forward: x has a negative token count T=-1");
  // T == 0 with null pointers is legal: there is nothing to point at.
  cluster_->layer(0).forward(view(static_cast<void*>(nullptr), DType::bf16, {0, kShape.hidden}),
                             view(static_cast<void*>(nullptr), DType::i32, {0, kShape.top_k}),
                             view(static_cast<void*>(nullptr), DType::f32, {0, kShape.top_k}),
                             view(static_cast<void*>(nullptr), DType::bf16, {0, kShape.hidden}));
  EXPECT_EQ(cluster_->layer(0).next_round(), 2u);
  within_seconds(10, "reset", [&] { cluster_->reset_all(); });  // TearDown expects round 1
}

// ---- a rejected forward is not a round ----

TEST(RejectedForward, IsNotARoundTheRankCallsAgainAndTheRoundCompletes) {
  const auto weights = harness::make_random_weights(kShape, 8);
  LayerOptions o;
  o.timeout_ms = 5'000;
  Cluster cluster(kShape, Precision::bf16, o, kWorld, weights);
  within_seconds(30, "the round", [&] {
    run_on_rank_threads(kWorld, [&](int rank) {
      const Batch b = harness::make_random_batch(kShape, kWorld, 3 + rank, Routing::uniform, 0,
                                                 50 + static_cast<std::uint64_t>(rank));
      if (rank == 0) {
        std::vector<std::uint16_t> y(static_cast<std::size_t>(b.tokens * kShape.hidden));
        try {
          cluster.layer(0).forward(view(b.x.data(), DType::bf16, {b.tokens, kShape.hidden}),
                                   view(b.topk_ids.data(), DType::f32, {b.tokens, kShape.top_k}),
                                   view(b.topk_weights.data(), DType::f32, {b.tokens, 2}),
                                   view(y.data(), DType::bf16, {b.tokens, kShape.hidden}));
          ADD_FAILURE() << "accepted f32 topk_ids";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
        }
        EXPECT_EQ(cluster.layer(0).next_round(), 1u) << "a rejected call must not use a round";
      }
      const auto y = cluster.forward(rank, b);
      EXPECT_EQ(reference::compare_bf16(y, cluster.reference(rank).forward(b)).mismatches, 0);
    });
  });
  for (int rank = 0; rank < kWorld; ++rank) EXPECT_EQ(cluster.layer(rank).next_round(), 2u);
}

// ---- forward after an error, without reset() ----

TEST(AfterAnError, ForwardIsRefusedAtOnceNamingTheOriginalFailure) {
  const auto weights = harness::make_random_weights(kShape, 9);
  LayerOptions o;
  o.timeout_ms = 200;
  Cluster cluster(kShape, Precision::bf16, o, kWorld, weights);
  const Batch b = harness::make_random_batch(kShape, kWorld, 3, Routing::uniform, 0, 61);
  const auto code_of = [&](int rank, const Batch& batch, double* seconds) -> std::string {
    const auto start = Clock::now();
    try {
      cluster.forward(rank, batch);
    } catch (const Error& e) {
      *seconds = seconds_since(start);
      return std::string(to_string(e.code())) + ": " + e.what();
    }
    *seconds = seconds_since(start);
    return "ok";
  };
  double s = 0.0;
  std::string first;
  // Rank 0 runs round 1 alone: rank 1 never shows up.
  within_seconds(10, "the lonely round", [&] { first = code_of(0, b, &s); });
  EXPECT_EQ(first,
            "timeout: rank 0 timed out after 200 ms in phase dispatch_counts of round 1 waiting "
            "for rank 1 (last saw its round 0, expected 1)");

  // Rank 0 again, many times: refused without waiting, naming the original failure.
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(code_of(0, b, &s),
              "layer unhealthy: forward on rank 0 refused until a collective reset(): " +
                  first.substr(std::string("timeout: ").size()));
    EXPECT_LT(s, 0.2) << "refusal must not wait";
  }
  // Argument checks still come first: a bad argument is reported as such.
  Batch too_many = harness::make_random_batch(kShape, kWorld, 9, Routing::uniform, 0, 1);
  EXPECT_THAT(code_of(0, too_many, &s), HasSubstr("invalid argument: forward: x has T=9"));

  // Rank 1 never failed, but finds the abort: peer_aborted at once, then refused like rank 0.
  EXPECT_EQ(code_of(1, b, &s),
            "peer aborted: rank 1: round 1 aborted: rank 0 gave up waiting for rank 1 in phase "
            "dispatch_counts of round 1");
  EXPECT_LT(s, 0.2);
  const Health h = cluster.layer(1).health();
  EXPECT_FALSE(h.ok);
  EXPECT_EQ(h.code, ErrorCode::peer_aborted);
  EXPECT_EQ(h.peer, 1);
  EXPECT_EQ(h.phase, Phase::dispatch_counts);
  EXPECT_THAT(code_of(1, b, &s), HasSubstr("layer unhealthy: forward on rank 1 refused"));
  EXPECT_LT(s, 0.2);

  within_seconds(10, "reset", [&] { cluster.reset_all(); });
  within_seconds(10, "the round after reset", [&] {
    run_on_rank_threads(kWorld, [&](int rank) {
      const auto y = cluster.forward(rank, b);
      EXPECT_EQ(reference::compare_bf16(y, cluster.reference(rank).forward(b)).mismatches, 0);
    });
  });
}

// ---- layers created with different shapes on different ranks ----

// Every rank creates its layer with make_config(shape_of(rank), bf16, ..., options_of(rank)); the
// error each rank's creation threw (every one must throw invalid_argument).
template <class ShapeOf, class OptionsOf>
std::vector<std::string> creation_errors(ShapeOf shape_of, OptionsOf options_of) {
  const auto weights = harness::make_random_weights(kShape, 1);
  auto group = make_host_group(kWorld);
  std::vector<std::string> errors(kWorld);
  within_seconds(20, "layer creation", [&] {
    run_on_rank_threads(kWorld, [&](int rank) {
      auto comm = make_host_communicator(group, rank);
      const LayerShape s = shape_of(rank);
      LayerOptions o = options_of(rank);
      o.timeout_ms = 2'000;
      try {
        Layer layer(*comm, make_config(s, Precision::bf16, rank, kWorld, o),
                    local_weight_views(weights, s, rank, kWorld));
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
        errors[static_cast<std::size_t>(rank)] = e.what();
      }
    });
  });
  return errors;
}

TEST(LayerCreationShapes, DifferentShapesOnDifferentRanksFailOnEveryRank) {
  // Different max_tokens_per_rank also means windows of different sizes.
  const auto errors = creation_errors(
      [](int rank) {
        LayerShape s = kShape;
        if (rank == 1) s.max_tokens_per_rank = 16;
        return s;
      },
      [](int) { return LayerOptions{}; });
  for (const auto& e : errors) {
    EXPECT_THAT(e, HasSubstr("Layer creation: rank 1 was given a different config than rank 0"));
    EXPECT_THAT(e, HasSubstr("rank 1: epmoe.config/10 hidden=64 intermediate=64 num_experts=8 "
                             "top_k=2 max_tokens_per_rank=16"));
  }
}

TEST(LayerCreationShapes, DifferentExpertMathOnDifferentRanksFailsOnEveryRank) {
  const auto errors = creation_errors([](int) { return kShape; },
                                      [](int rank) {
                                        LayerOptions o;
                                        if (rank == 1) o.expert_math = ExpertMath::tensor_core;
                                        return o;
                                      });
  for (const auto& e : errors) {
    EXPECT_THAT(e, HasSubstr("Layer creation: rank 1 was given a different config than rank 0"));
    EXPECT_THAT(e, HasSubstr("expert_math=tensor_core"));
  }
}

}  // namespace
}  // namespace epmoe
