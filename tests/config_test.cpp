// LayerConfig: every rejection names field, value and rule; with_knobs adjusts conflicts instead of
// failing; buckets are picked per launch; describe() is stable and rank-free (docs/design.md §5).
#include <epmoe/config.hpp>
#include <epmoe/errors.hpp>

#include "core/knob_table.hpp"
#include "epmoe/models.hpp"
#include "support/exact_math.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace epmoe {
namespace {

using test::exact_math;

using ::testing::HasSubstr;
using ::testing::Not;

constexpr LayerShape kQwen{2048, 768, 128, 8, 4096};

// Runs `f`, expects Error(invalid_argument), returns its message ("" and a failure otherwise).
std::string rejection(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected Error(invalid_argument), nothing was thrown";
  return "";
}

std::string shape_rejection(LayerShape shape, int world = 4) {
  return rejection([&] { make_config(shape, Precision::bf16, 0, world); });
}

constexpr Precision kAllPrecisions[] = {Precision::bf16, Precision::mxfp8, Precision::nvfp4,
                                        Precision::fp8_block128, Precision::mxfp4};

std::string options_rejection(const LayerOptions& options) {
  return rejection([&] { make_config(kQwen, Precision::bf16, 0, 4, options); });
}

std::string knobs_rejection(const Knobs& knobs) {
  const LayerConfig config = make_config(kQwen, Precision::bf16, 0, 4);
  return rejection([&] { with_knobs(config, knobs); });
}

// ---- make_config accepts ------------------------------------------------------------------------

TEST(MakeConfig, AcceptsEveryRealModelAtEveryWorldAndPrecision) {
  for (const ModelShape& model : known_models()) {
    for (int world : {1, 2, 4, 8}) {
      for (Precision p : kAllPrecisions) {
        EXPECT_NO_THROW(make_config(model.layer_shape(8192), p, world - 1, world)) << model.name;
      }
    }
  }
}

// fp8_block128 takes partial 128-blocks (1 x 128 activation runs, 128 x 128 weight tiles) at a
// matrix's edge, and mxfp4's blocks of 32 divide every multiple of 64: neither adds a shape rule.
TEST(MakeConfig, CheckpointPrecisionsAddNoShapeRuleBeyondMultiplesOf64) {
  for (Precision p : {Precision::fp8_block128, Precision::mxfp4}) {
    EXPECT_NO_THROW(make_config({64, 64, 1, 1, 1}, p, 0, 1)) << to_string(p);  // one partial block
    EXPECT_NO_THROW(make_config({2880, 2880, 32, 4, 64}, p, 0, 4)) << "gpt-oss: 22 x 128 + 64";
    EXPECT_NO_THROW(make_config({7168, 2048, 256, 8, 64}, p, 0, 8)) << "DeepSeek-V3: whole blocks";
    EXPECT_EQ(rejection([&] {
                make_config({2880 + 32, 2880, 32, 4, 64}, p, 0, 4);
              }),
              "hidden=2912: must be a multiple of 64");
  }
}

TEST(MakeConfig, AcceptsEveryBoundaryValue) {
  EXPECT_NO_THROW(make_config({64, 64, 1, 1, 1}, Precision::nvfp4, 0, 1));
  EXPECT_NO_THROW(
      make_config({kMaxHidden, kMaxIntermediate, kMaxExperts, kMaxTopK, kMaxTokensPerRank},
                  Precision::mxfp8, kMaxWorld - 1, kMaxWorld));
  EXPECT_NO_THROW(make_config({2048, 768, 16, 16, 128}, Precision::bf16, 0, 16));
  LayerOptions o;
  o.timeout_ms = 0;
  EXPECT_NO_THROW(make_config(kQwen, Precision::bf16, 0, 4, o));
  o.timeout_ms = kMaxTimeoutMs;
  o.swiglu_limit = 7.0f;
  o.deterministic = true;
  o.mxfp8_scale_rounding = ScaleRounding::ocp_floor;
  EXPECT_NO_THROW(make_config(kQwen, Precision::bf16, 0, 4, o));
}

TEST(MakeConfig, KeepsEveryCallerFieldAsGiven) {
  LayerOptions o;
  o.combine = Combine::in_kernel_reduce;
  o.timeout_ms = 1234;
  o.swiglu_limit = 7.0f;
  o.mxfp8_scale_rounding = ScaleRounding::ocp_floor;
  o.expert_math = ExpertMath::tensor_core;
  o.activation = Activation::swiglu_oai;
  const LayerConfig c = make_config(kQwen, Precision::mxfp8, 3, 8, o);
  EXPECT_EQ(c.shape().hidden, 2048);
  EXPECT_EQ(c.shape().intermediate, 768);
  EXPECT_EQ(c.shape().num_experts, 128);
  EXPECT_EQ(c.shape().top_k, 8);
  EXPECT_EQ(c.shape().max_tokens_per_rank, 4096);
  EXPECT_EQ(c.precision(), Precision::mxfp8);
  EXPECT_EQ(c.rank(), 3);
  EXPECT_EQ(c.world(), 8);
  EXPECT_EQ(c.options().combine, Combine::in_kernel_reduce);
  EXPECT_FALSE(c.options().deterministic);
  EXPECT_EQ(c.options().timeout_ms, 1234u);
  EXPECT_EQ(c.options().swiglu_limit, 7.0f);
  EXPECT_EQ(c.options().mxfp8_scale_rounding, ScaleRounding::ocp_floor);
  EXPECT_EQ(c.options().expert_math, ExpertMath::tensor_core);
  EXPECT_EQ(c.local_experts(), 16);
  EXPECT_EQ(c.expert_owner(127), 7);
}

// The table's entries are conflict-free under exact math (default_knobs); wgmma, the default,
// moves some (MakeConfig.TokenBackIsTheModeEachBucketRuns).
TEST(MakeConfig, KnobsAreTheDefaultTableEntryOfEachBucketUnderExactMath) {
  for (Precision p : kAllPrecisions) {
    const LayerConfig c = make_config(kQwen, p, 0, 8, exact_math());
    for (int b = 0; b < kNumTokenBuckets; ++b) {
      const auto bucket = static_cast<TokenBucket>(b);
      EXPECT_EQ(c.knobs(bucket), default_knobs(p, 8, kQwen, bucket)) << to_string(bucket);
    }
  }
}

// token_back is the mode each bucket runs (docs/tuning.md#knobs): exact and tensor_core store FC2's
// rows from the epilogue, wgmma's GEMMs leave them to its home kernel, but in the E4M3 tile's
// buckets (mxfp8 and mxfp4 with a few rows per expert: qwen3 at world 4 in decode), where the
// table's epilogue_warps (FC2 sends home) is kept. Neither combine changes it.
TEST(MakeConfig, TokenBackIsTheModeEachBucketRuns) {
  for (Combine combine : {Combine::staged, Combine::in_kernel_reduce})
    for (ExpertMath math : {ExpertMath::exact, ExpertMath::tensor_core, ExpertMath::wgmma})
      for (Precision p : {Precision::bf16, Precision::mxfp8, Precision::mxfp4}) {
        LayerOptions o;
        o.combine = combine;
        o.expert_math = math;
        const LayerConfig c = make_config(kQwen, p, 0, 4, o);
        for (int b = 0; b < kNumTokenBuckets; ++b) {
          const auto bucket = static_cast<TokenBucket>(b);
          const bool e4m3 =
              math == ExpertMath::wgmma && p != Precision::bf16 && bucket == TokenBucket::decode;
          const TokenBack expected = math != ExpertMath::wgmma || e4m3 ? TokenBack::epilogue_warps
                                                                       : TokenBack::dispatch_warps;
          EXPECT_EQ(c.knobs(bucket).token_back, expected) << c.describe();
        }
      }
}

// ---- make_config rejects: field, value and rule in the message
// -----------------------------------

TEST(MakeConfigRejects, HiddenNotAMultipleOf64) {
  EXPECT_EQ(shape_rejection({2050, 768, 128, 8, 4096}), "hidden=2050: must be a multiple of 64");
}

TEST(MakeConfigRejects, HiddenNotPositive) {
  EXPECT_EQ(shape_rejection({0, 768, 128, 8, 4096}), "hidden=0: must be > 0");
  EXPECT_EQ(shape_rejection({-64, 768, 128, 8, 4096}), "hidden=-64: must be > 0");
}

TEST(MakeConfigRejects, HiddenAboveMaximum) {
  EXPECT_EQ(shape_rejection({kMaxHidden + 64, 768, 128, 8, 4096}),
            "hidden=65600: must be at most 65536");
}

TEST(MakeConfigRejects, IntermediateNotAMultipleOf64) {
  EXPECT_EQ(shape_rejection({2048, 770, 128, 8, 4096}),
            "intermediate=770: must be a multiple of 64");
}

TEST(MakeConfigRejects, IntermediateNotPositive) {
  EXPECT_EQ(shape_rejection({2048, 0, 128, 8, 4096}), "intermediate=0: must be > 0");
}

TEST(MakeConfigRejects, IntermediateAboveMaximum) {
  EXPECT_EQ(shape_rejection({2048, kMaxIntermediate + 64, 128, 8, 4096}),
            "intermediate=65600: must be at most 65536");
}

TEST(MakeConfigRejects, NumExpertsBelowOne) {
  EXPECT_EQ(shape_rejection({2048, 768, 0, 1, 4096}), "num_experts=0: must be >= 1");
}

TEST(MakeConfigRejects, NumExpertsNotAMultipleOfWorld) {
  EXPECT_EQ(shape_rejection({2048, 768, 10, 2, 4096}, 4),
            "num_experts=10: must be a multiple of world=4");
  EXPECT_EQ(shape_rejection({2048, 768, 4, 2, 4096}, 8),
            "num_experts=4: must be a multiple of world=8");
}

TEST(MakeConfigRejects, NumExpertsAboveMaximum) {
  EXPECT_EQ(shape_rejection({2048, 768, kMaxExperts + 4, 8, 4096}),
            "num_experts=1028: must be at most 1024");
}

TEST(MakeConfigRejects, TopKBelowOne) {
  const std::string msg = shape_rejection({2048, 768, 128, 0, 4096});
  EXPECT_THAT(msg, HasSubstr("top_k=0: must be in [1, "));
}

TEST(MakeConfigRejects, TopKAboveNumExperts) {
  EXPECT_EQ(shape_rejection({2048, 768, 4, 5, 4096}),
            "top_k=5: must be in [1, min(num_experts=4, 16)=4]");
}

TEST(MakeConfigRejects, TopKAbove16) {
  EXPECT_EQ(shape_rejection({2048, 768, 128, 17, 4096}),
            "top_k=17: must be in [1, min(num_experts=128, 16)=16]");
}

TEST(MakeConfigRejects, MaxTokensPerRankOutsideRange) {
  EXPECT_EQ(shape_rejection({2048, 768, 128, 8, 0}),
            "max_tokens_per_rank=0: must be in [1, 1048576]");
  EXPECT_EQ(shape_rejection({2048, 768, 128, 8, kMaxTokensPerRank + 1}),
            "max_tokens_per_rank=1048577: must be in [1, 1048576]");
}

TEST(MakeConfigRejects, WorldOutsideOneTo64) {
  EXPECT_EQ(rejection([] { make_config(kQwen, Precision::bf16, 0, 0); }),
            "world=0: must be in [1, 64]");
  EXPECT_EQ(rejection([] {
              make_config({2048, 768, 128, 8, 4096}, Precision::bf16, 0, 65);
            }),
            "world=65: must be in [1, 64]");
}

TEST(MakeConfigRejects, RankOutsideWorld) {
  EXPECT_EQ(rejection([] { make_config(kQwen, Precision::bf16, -1, 4); }),
            "rank=-1: must be in [0, world=4)");
  EXPECT_EQ(rejection([] { make_config(kQwen, Precision::bf16, 4, 4); }),
            "rank=4: must be in [0, world=4)");
}

TEST(MakeConfigRejects, DeterministicWithInKernelReduce) {
  LayerOptions o;
  o.deterministic = true;
  o.combine = Combine::in_kernel_reduce;
  EXPECT_EQ(options_rejection(o),
            "deterministic=true: requires combine=staged, got in_kernel_reduce");
}

TEST(MakeConfigRejects, SwigluLimitNegative) {
  LayerOptions o;
  o.swiglu_limit = -1.5f;
  EXPECT_EQ(options_rejection(o), "swiglu_limit=-1.5: must be finite and >= 0 (0 = no clamp)");
}

TEST(MakeConfigRejects, SwigluLimitNotFinite) {
  LayerOptions o;
  o.swiglu_limit = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THAT(options_rejection(o), HasSubstr("swiglu_limit=nan: must be finite"));
  o.swiglu_limit = std::numeric_limits<float>::infinity();
  EXPECT_THAT(options_rejection(o), HasSubstr("swiglu_limit=inf: must be finite"));
}

TEST(MakeConfigRejects, SwigluOaiWithoutAClampNamesTheFix) {
  LayerOptions o;
  o.activation = Activation::swiglu_oai;
  EXPECT_EQ(options_rejection(o),
            "swiglu_limit=0: activation=swiglu_oai requires a clamp > 0 (gpt-oss uses 7)");
  o.swiglu_limit = kSwigluOaiLimit;
  EXPECT_NO_THROW(make_config(kQwen, Precision::bf16, 0, 4, o));
}

TEST(MakeConfigRejects, ActivationOutOfRange) {
  LayerOptions o;
  o.activation = static_cast<Activation>(7);
  EXPECT_EQ(options_rejection(o), "activation=7: must be swiglu or swiglu_oai");
}

TEST(ParseActivation, ReadsEveryNameToStringPrintsAndRejectsOthers) {
  for (Activation a : {Activation::swiglu, Activation::swiglu_oai})
    EXPECT_EQ(parse_activation(to_string(a)), a);
  try {
    parse_activation("gelu");
    ADD_FAILURE() << "gelu was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "activation=gelu: must be one of swiglu, swiglu_oai");
  }
}

TEST(ConfigDescribe, NamesTheActivation) {
  LayerOptions o;
  EXPECT_THAT(make_config(kQwen, Precision::bf16, 0, 4, o).describe(),
              HasSubstr(" activation=swiglu swiglu_limit=0 "));
  o.activation = Activation::swiglu_oai;
  o.swiglu_limit = 7.0f;
  EXPECT_THAT(make_config(kQwen, Precision::bf16, 0, 4, o).describe(),
              HasSubstr(" activation=swiglu_oai swiglu_limit=7 "));
}

TEST(MakeConfigRejects, TimeoutAboveOneHour) {
  LayerOptions o;
  o.timeout_ms = kMaxTimeoutMs + 1;
  EXPECT_EQ(options_rejection(o),
            "timeout_ms=3600001: must be at most 3600000 (1 hour; 0 = wait forever)");
}

TEST(MakeConfigRejects, EnumValuesOutsideTheirNames) {
  EXPECT_EQ(rejection([] { make_config(kQwen, static_cast<Precision>(7), 0, 4); }),
            "precision=7: must be bf16, mxfp8, nvfp4, fp8_block128 or mxfp4");
  LayerOptions o;
  o.combine = static_cast<Combine>(5);
  EXPECT_EQ(options_rejection(o), "combine=5: must be staged or in_kernel_reduce");
  o = {};
  o.mxfp8_scale_rounding = static_cast<ScaleRounding>(9);
  EXPECT_EQ(options_rejection(o), "mxfp8_scale_rounding=9: must be rceil or ocp_floor");
  o = {};
  o.expert_math = static_cast<ExpertMath>(4);
  EXPECT_EQ(options_rejection(o), "expert_math=4: must be exact, tensor_core or wgmma");
}

// ---- with_knobs rejects knobs outside kKnobSpace, naming the knob
// --------------------------------

TEST(WithKnobsRejects, BlockMOutsideKnobSpace) {
  Knobs k;
  k.block_m = 96;
  EXPECT_EQ(knobs_rejection(k), "knobs.block_m=96: must be 64, 128 or 256");
}

TEST(WithKnobsRejects, BlockNOutsideKnobSpace) {
  Knobs k;
  k.block_n = 512;
  EXPECT_EQ(knobs_rejection(k), "knobs.block_n=512: must be 64, 128 or 256");
}

TEST(WithKnobsRejects, DispatchWarpsOutsideOneToSixteen) {
  Knobs k;
  k.dispatch_warps = 0;
  EXPECT_EQ(knobs_rejection(k), "knobs.dispatch_warps=0: must be in [1, 16]");
  k.dispatch_warps = 17;
  EXPECT_EQ(knobs_rejection(k), "knobs.dispatch_warps=17: must be in [1, 16]");
}

TEST(WithKnobsRejects, NegativeNumSms) {
  Knobs k;
  k.num_sms = -1;
  EXPECT_EQ(knobs_rejection(k), "knobs.num_sms=-1: must be >= 0 (0 = all SMs)");
}

TEST(WithKnobsRejects, TokenBackOutsideItsNames) {
  Knobs k;
  k.token_back = static_cast<TokenBack>(3);
  EXPECT_EQ(knobs_rejection(k), "knobs.token_back=3: must be epilogue_warps or dispatch_warps");
}

TEST(WithKnobsRejects, BucketOutsideItsNames) {
  const LayerConfig c = make_config(kQwen, Precision::bf16, 0, 4);
  EXPECT_EQ(rejection([&] { with_knobs(c, Knobs{}, static_cast<TokenBucket>(4)); }),
            "bucket=4: must be decode, small, medium or prefill");
}

// ---- with_knobs adjusts conflicts it did not create ---------------------------------------------

TEST(WithKnobs, TokenBackMovesOntoTheOneModeABucketRuns) {
  for (ExpertMath math : {ExpertMath::exact, ExpertMath::tensor_core, ExpertMath::wgmma}) {
    LayerOptions o;
    o.combine = Combine::in_kernel_reduce;
    o.expert_math = math;
    const LayerConfig c = make_config(kQwen, Precision::bf16, 0, 4, o);
    const TokenBack runs =
        math == ExpertMath::wgmma ? TokenBack::dispatch_warps : TokenBack::epilogue_warps;
    for (TokenBack asked : {TokenBack::epilogue_warps, TokenBack::dispatch_warps}) {
      Knobs k = c.knobs(TokenBucket::medium);
      k.token_back = asked;
      const LayerConfig t = with_knobs(c, k);
      Knobs expected = k;
      expected.token_back = runs;
      for (int b = 0; b < kNumTokenBuckets; ++b)
        EXPECT_EQ(t.knobs(static_cast<TokenBucket>(b)).token_back, runs) << t.describe();
      EXPECT_EQ(t.knobs(TokenBucket::medium), expected);
      EXPECT_EQ(t.options().combine, Combine::in_kernel_reduce);
    }
  }
}

// wgmma's E4M3 tile (mxfp8 and mxfp4, qwen3 at world 4: decode) runs either mode, under either
// combine, in the chain and in its persistent round (megakernel=true).
TEST(WithKnobs, TokenBackIsKeptWhereTheE4m3TileRunsEitherMode) {
  for (Combine combine : {Combine::staged, Combine::in_kernel_reduce})
    for (Precision p : {Precision::mxfp8, Precision::mxfp4}) {
      LayerOptions o;
      o.combine = combine;
      o.expert_math = ExpertMath::wgmma;
      const LayerConfig c = make_config(kQwen, p, 0, 4, o);
      ASSERT_TRUE(has_persistent_round(c, TokenBucket::decode)) << c.describe();
      ASSERT_FALSE(has_persistent_round(c, TokenBucket::small)) << c.describe();
      for (TokenBack asked : {TokenBack::epilogue_warps, TokenBack::dispatch_warps}) {
        Knobs k = c.knobs(TokenBucket::decode);
        k.token_back = asked;
        EXPECT_EQ(with_knobs(c, k, TokenBucket::decode).knobs(TokenBucket::decode), k);
        // applied to every bucket: small, medium and prefill run the home kernel
        const LayerConfig all = with_knobs(c, k);
        EXPECT_EQ(all.knobs(TokenBucket::decode).token_back, asked);
        EXPECT_EQ(all.knobs(TokenBucket::small).token_back, TokenBack::dispatch_warps);
        k.megakernel = true;
        EXPECT_EQ(with_knobs(c, k, TokenBucket::decode).knobs(TokenBucket::decode), k)
            << to_string(asked);
      }
    }
}

TEST(WithKnobs, LeavesAFittingTileUntouched) {
  Knobs k;
  k.block_m = 128;
  k.block_n = 256;
  EXPECT_EQ(with_knobs(make_config(kQwen, Precision::bf16, 0, 4, exact_math()), k)
                .knobs(TokenBucket::prefill),
            k);
}

TEST(WithKnobs, BlockNWiderThanTwiceIntermediateIsHalved) {
  const LayerConfig tiny = make_config({256, 64, 8, 2, 64}, Precision::bf16, 0, 2);
  Knobs k;
  k.block_n = 256;
  EXPECT_EQ(with_knobs(tiny, k).knobs(TokenBucket::decode).block_n, 128);  // 2I = 128
  const LayerConfig wider = make_config({256, 128, 8, 2, 64}, Precision::bf16, 0, 2);
  EXPECT_EQ(with_knobs(wider, k).knobs(TokenBucket::decode).block_n, 256);  // 2I = 256
}

TEST(WithKnobs, KeepsMegakernelWithDeterministicAndNumSmsAboveTheDevice) {
  LayerOptions o = exact_math();
  o.deterministic = true;
  const LayerConfig c = make_config(kQwen, Precision::bf16, 0, 4, o);
  Knobs k;
  k.megakernel = true;
  k.num_sms = 1000;
  k.block_m = 128;  // more rows than a decode expert needs: allowed
  EXPECT_EQ(with_knobs(c, k, TokenBucket::decode).knobs(TokenBucket::decode), k);
}

TEST(WithKnobs, OneBucketChangesOnlyThatBucket) {
  const LayerConfig c = make_config(kQwen, Precision::bf16, 0, 4, exact_math());
  Knobs k;
  k.num_sms = 77;
  const LayerConfig t = with_knobs(c, k, TokenBucket::small);
  EXPECT_EQ(t.knobs(TokenBucket::small), k);
  EXPECT_EQ(t.knobs(TokenBucket::decode), c.knobs(TokenBucket::decode));
  EXPECT_EQ(t.knobs(TokenBucket::medium), c.knobs(TokenBucket::medium));
  EXPECT_EQ(t.knobs(TokenBucket::prefill), c.knobs(TokenBucket::prefill));
}

TEST(WithKnobs, NoBucketAppliesToEveryBucketAndLeavesTheInputUntouched) {
  const LayerConfig c = make_config(kQwen, Precision::bf16, 0, 4, exact_math());
  const std::string before = c.describe();
  Knobs k;
  k.num_sms = 77;
  const LayerConfig t = with_knobs(c, k);
  for (int b = 0; b < kNumTokenBuckets; ++b) EXPECT_EQ(t.knobs(static_cast<TokenBucket>(b)), k);
  EXPECT_EQ(c.describe(), before);
}

// ---- the wgmma backend's tiles (core::wgmma_has_tile): knobs moved onto one it ships
// --------------

// (token_back: wgmma's mode outside the E4M3 tile's buckets, so that only the tile rule acts there)
Knobs tile_knobs(std::int32_t block_m, std::int32_t block_n) {
  Knobs k;
  k.block_m = block_m;
  k.block_n = block_n;
  k.token_back = TokenBack::dispatch_warps;
  return k;
}

std::pair<std::int32_t, std::int32_t> tile_after(Precision p, ExpertMath math, std::int32_t block_m,
                                                 std::int32_t block_n) {
  LayerOptions o;
  o.expert_math = math;
  const Knobs out = with_knobs(make_config(kQwen, p, 0, 4, o), tile_knobs(block_m, block_n))
                        .knobs(TokenBucket::prefill);
  return {out.block_m, out.block_n};
}

TEST(WithKnobsWgmma, Bf16GemmsGet128Or64RowsAnd128Or256Columns) {
  using T = std::pair<std::int32_t, std::int32_t>;
  for (Precision p : {Precision::bf16, Precision::mxfp8, Precision::nvfp4, Precision::mxfp4}) {
    // 64 rows: bf16's ping-pong FC1 and the packed-weight GEMM's 64-token tile.
    const std::int32_t rows = 64;
    EXPECT_EQ(tile_after(p, ExpertMath::wgmma, 64, 64), T(rows, 128)) << to_string(p);
    EXPECT_EQ(tile_after(p, ExpertMath::wgmma, 64, 128), T(rows, 128)) << to_string(p);
    EXPECT_EQ(tile_after(p, ExpertMath::wgmma, 64, 256), T(rows, 256)) << to_string(p);
    EXPECT_EQ(tile_after(p, ExpertMath::wgmma, 128, 64), T(128, 128)) << to_string(p);
    EXPECT_EQ(tile_after(p, ExpertMath::wgmma, 128, 128), T(128, 128)) << to_string(p);
    EXPECT_EQ(tile_after(p, ExpertMath::wgmma, 128, 256), T(128, 256)) << to_string(p);
  }
}

// fp8_block128: block_m 64 (the packed GEMM's E4M3 tile) or 128 (CUTLASS's blockwise GEMM, 128 x
// 128 x 128), block_n always 128.
TEST(WithKnobsWgmma, Fp8Block128GetsBlockM64Or128AndBlockN128) {
  using T = std::pair<std::int32_t, std::int32_t>;
  for (std::int32_t bm : kKnobSpace.block_m)
    for (std::int32_t bn : kKnobSpace.block_n)
      EXPECT_EQ(tile_after(Precision::fp8_block128, ExpertMath::wgmma, bm, bn),
                T(bm == 64 ? 64 : 128, 128))
          << bm << " x " << bn;
}

// (Except a tile that does not fit shared memory even double-buffered: bf16's 256 x 256, whose
// block_n halves.)
TEST(WithKnobsWgmma, OtherMathsKeepTheTileKnobsTheyDoNotRead) {
  using T = std::pair<std::int32_t, std::int32_t>;
  for (ExpertMath m : {ExpertMath::exact, ExpertMath::tensor_core})
    for (Precision p : kAllPrecisions)
      for (std::int32_t bm : kKnobSpace.block_m)
        for (std::int32_t bn : kKnobSpace.block_n) {
          const bool fits = core::shared_memory_bytes(p, bm, bn) <= core::kMaxSharedMemoryBytes;
          EXPECT_EQ(tile_after(p, m, bm, bn), T(bm, fits ? bn : bn / 2))
              << to_string(m) << " " << to_string(p) << " " << bm << " x " << bn;
          if (!fits) {
            EXPECT_EQ(T(bm, bn), T(256, 256)) << to_string(p);
          }
        }
}

TEST(WithKnobsWgmma, NotesNameTheKnobTheMathAndTheTile) {
  LayerOptions o;
  o.expert_math = ExpertMath::wgmma;
  std::vector<std::string> notes;
  const Knobs out = core::adjust_knobs(tile_knobs(256, 256), Precision::fp8_block128, 4, kQwen,
                                       TokenBucket::decode, o, &notes);
  EXPECT_EQ(out, tile_knobs(128, 128));
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_EQ(notes[0],
            "block_m=256 -> 128: expert_math=wgmma runs 128-row tiles (two consumer warpgroups x "
            "64 rows) for fp8_block128 (256 token rows: the packed-weight GEMM of mxfp8, nvfp4, "
            "mxfp4)");
  EXPECT_EQ(notes[1],
            "block_n=256 -> 128: expert_math=wgmma ships 128 x 128 tiles only for fp8_block128 "
            "(E4M3 blockwise)");
  notes.clear();
  EXPECT_EQ(
      core::adjust_knobs(out, Precision::fp8_block128, 4, kQwen, TokenBucket::decode, o, &notes),
      out);
  EXPECT_TRUE(notes.empty());
}

TEST(WithKnobsWgmma, EveryDefaultBucketOfEveryRealShapeIsATileTheBackendShips) {
  LayerOptions o;
  o.expert_math = ExpertMath::wgmma;
  for (const ModelShape& m : known_models())
    for (int world : {1, 2, 4, 8})
      for (Precision p : kAllPrecisions) {
        const LayerConfig c = make_config(m.layer_shape(8192), p, 0, world, o);
        for (int b = 0; b < kNumTokenBuckets; ++b) {
          const Knobs& k = c.knobs(static_cast<TokenBucket>(b));
          EXPECT_TRUE(core::wgmma_has_tile(p, k.block_m, k.block_n))
              << m.name << " " << to_string(p) << " " << k.block_m << " x " << k.block_n;
        }
      }
}

// The persistent round: every bucket of tensor_core, none of exact, and under wgmma exactly the
// buckets whose knobs run mxfp8's or mxfp4's E4M3 tile (block_m 64, at most 16 balanced rows per
// expert): decode of qwen3 at world 4, not small (32 rows) and above; none once block_m is 128;
// none of the precisions without the tile.
TEST(HasPersistentRound, TensorCoreEveryBucketExactNoneWgmmaTheE4m3TilesBuckets) {
  const auto config = [](Precision p, ExpertMath math) {
    LayerOptions o;
    o.expert_math = math;
    return make_config(kQwen, p, 0, 4, o);
  };
  const TokenBucket buckets[] = {TokenBucket::decode, TokenBucket::small, TokenBucket::medium,
                                 TokenBucket::prefill};
  for (const Precision p : kAllPrecisions)
    for (const TokenBucket b : buckets) {
      EXPECT_TRUE(has_persistent_round(config(p, ExpertMath::tensor_core), b)) << to_string(p);
      EXPECT_FALSE(has_persistent_round(config(p, ExpertMath::exact), b)) << to_string(p);
    }
  for (const Precision p : {Precision::mxfp8, Precision::mxfp4}) {
    LayerConfig c = config(p, ExpertMath::wgmma);
    for (const TokenBucket b : buckets) {  // the E4M3 tile where block_m is 64 and rows are few
      Knobs k = c.knobs(b);
      k.block_m = 64;
      c = with_knobs(c, k, b);
    }
    // qwen3 (E = 128, top-8) at world 4: 4 x 16 x 8 / 128 = 4 and 4 x 128 x 8 / 128 = 32 rows
    EXPECT_TRUE(has_persistent_round(c, TokenBucket::decode)) << to_string(p);
    EXPECT_FALSE(has_persistent_round(c, TokenBucket::small)) << to_string(p);
    EXPECT_FALSE(has_persistent_round(c, TokenBucket::medium)) << to_string(p);
    EXPECT_FALSE(has_persistent_round(c, TokenBucket::prefill)) << to_string(p);
    Knobs k = c.knobs(TokenBucket::decode);
    k.block_m = 128;
    EXPECT_FALSE(has_persistent_round(with_knobs(c, k, TokenBucket::decode), TokenBucket::decode))
        << to_string(p);
  }
  for (const Precision p : {Precision::bf16, Precision::nvfp4, Precision::fp8_block128})
    for (const TokenBucket b : buckets)
      EXPECT_FALSE(has_persistent_round(config(p, ExpertMath::wgmma), b)) << to_string(p);
}

TEST(WgmmaHasTile, IsExactlyTheShippedInstantiations) {
  for (Precision p : kAllPrecisions)
    for (std::int32_t bm : kKnobSpace.block_m)
      for (std::int32_t bn : kKnobSpace.block_n) {
        const bool packed = p == Precision::mxfp8 || p == Precision::nvfp4 || p == Precision::mxfp4;
        const bool rows = bm == 128 || bm == 64 || (bm == 256 && packed);
        const bool shipped = rows && (bn == 128 || (bn == 256 && p != Precision::fp8_block128));
        EXPECT_EQ(core::wgmma_has_tile(p, bm, bn), shipped) << to_string(p) << bm << "x" << bn;
      }
}

TEST(AdjustKnobs, ReportsOneNotePerAdjustedKnobAndNoneWhenNothingConflicts) {
  LayerOptions o = exact_math();
  o.combine = Combine::in_kernel_reduce;
  Knobs k{TokenBack::dispatch_warps, 128, 256, 4, 0, false};
  std::vector<std::string> notes;
  const LayerShape shape{256, 64, 8, 2, 64};
  const Knobs out = core::adjust_knobs(k, Precision::bf16, 2, shape, TokenBucket::small, o, &notes);
  EXPECT_EQ(out, (Knobs{TokenBack::epilogue_warps, 128, 128, 4, 0, false}));
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_THAT(notes[0], HasSubstr("block_n=256 -> 128"));
  EXPECT_EQ(notes[1],
            "token_back=dispatch_warps -> epilogue_warps: under expert_math=exact with bf16 in the "
            "small bucket the FC2 tile sends its rows home from its epilogue");
  notes.clear();
  EXPECT_EQ(core::adjust_knobs(out, Precision::bf16, 2, shape, TokenBucket::small, o, &notes), out);
  EXPECT_TRUE(notes.empty());
}

TEST(KnobSharedMemoryEstimate, MatchesTheDocumentedFormula) {
  // 2 stages × ((block_m + block_n) × row bytes of a 64-wide k tile + 16 B of mbarriers)
  //   + block_m × block_n × 2 (bf16 epilogue tile)
  EXPECT_EQ(core::shared_memory_bytes(Precision::bf16, 64, 128),
            2 * (192 * 128 + 16) + 64 * 128 * 2);
  EXPECT_EQ(core::shared_memory_bytes(Precision::mxfp8, 128, 256),
            2 * (384 * 66 + 16) + 128 * 256 * 2);
  EXPECT_EQ(core::shared_memory_bytes(Precision::nvfp4, 128, 64),
            2 * (192 * 36 + 16) + 128 * 64 * 2);
  // bf16's 256 x 256 alone exceeds 227 KiB (262176 B); its 128 x 256 fits (163872 B).
  EXPECT_GT(core::shared_memory_bytes(Precision::bf16, 256, 256), core::kMaxSharedMemoryBytes);
  EXPECT_LE(core::shared_memory_bytes(Precision::bf16, 128, 256), core::kMaxSharedMemoryBytes);
}

// ---- buckets -----------------------------------------------------------------------------------

TEST(ConfigTokenBucket, BoundariesAre16And128And1024WithZeroInDecode) {
  EXPECT_EQ(token_bucket(0), TokenBucket::decode);
  EXPECT_EQ(token_bucket(1), TokenBucket::decode);
  EXPECT_EQ(token_bucket(16), TokenBucket::decode);
  EXPECT_EQ(token_bucket(17), TokenBucket::small);
  EXPECT_EQ(token_bucket(128), TokenBucket::small);
  EXPECT_EQ(token_bucket(129), TokenBucket::medium);
  EXPECT_EQ(token_bucket(1024), TokenBucket::medium);
  EXPECT_EQ(token_bucket(1025), TokenBucket::prefill);
  EXPECT_EQ(token_bucket(kMaxTokensPerRank), TokenBucket::prefill);
}

TEST(ConfigTokenBucket, EachBucketsLargestTIsInItAndTheNextTIsNot) {
  for (int b = 0; b + 1 < kNumTokenBuckets; ++b) {
    const auto bucket = static_cast<TokenBucket>(b);
    EXPECT_EQ(token_bucket(bucket_max_tokens(bucket)), bucket) << to_string(bucket);
    EXPECT_EQ(token_bucket(bucket_max_tokens(bucket) + 1), static_cast<TokenBucket>(b + 1))
        << to_string(bucket);
  }
  EXPECT_EQ(bucket_max_tokens(TokenBucket::prefill), std::numeric_limits<std::int64_t>::max());
}

TEST(ConfigTokenBucket, NegativeTokenCountIsRejected) {
  EXPECT_EQ(rejection([] { token_bucket(-1); }), "tokens=-1: must be >= 0");
}

TEST(KnobsFor, PicksTheBucketOfEachLaunchNotOfMaxTokens) {
  LayerConfig c = make_config({2048, 768, 128, 8, 8192}, Precision::bf16, 0, 4);
  for (int b = 0; b < kNumTokenBuckets; ++b) {
    Knobs k;
    k.num_sms = 10 + b;  // tell the buckets apart
    c = with_knobs(c, k, static_cast<TokenBucket>(b));
  }
  EXPECT_EQ(c.knobs_for(0).num_sms, 10);
  EXPECT_EQ(c.knobs_for(16).num_sms, 10);
  EXPECT_EQ(c.knobs_for(17).num_sms, 11);
  EXPECT_EQ(c.knobs_for(129).num_sms, 12);
  EXPECT_EQ(c.knobs_for(1025).num_sms, 13);
  EXPECT_EQ(c.knobs_for(8192).num_sms, 13);
}

// ---- names -------------------------------------------------------------------------------------

TEST(ConfigNames, ToStringAndParseRoundTrip) {
  for (Precision p : kAllPrecisions) {
    EXPECT_EQ(parse_precision(to_string(p)), p);
  }
  for (Combine c : {Combine::staged, Combine::in_kernel_reduce}) {
    EXPECT_EQ(parse_combine(to_string(c)), c);
  }
  for (ExpertMath m : {ExpertMath::exact, ExpertMath::tensor_core, ExpertMath::wgmma}) {
    EXPECT_EQ(parse_expert_math(to_string(m)), m);
  }
  for (TokenBack t : {TokenBack::epilogue_warps, TokenBack::dispatch_warps}) {
    EXPECT_EQ(parse_token_back(to_string(t)), t);
  }
  EXPECT_STREQ(to_string(ExpertMath::exact), "exact");
  EXPECT_STREQ(to_string(ExpertMath::tensor_core), "tensor_core");
  EXPECT_STREQ(to_string(ExpertMath::wgmma), "wgmma");
  EXPECT_STREQ(to_string(static_cast<ExpertMath>(7)), "unknown");
  EXPECT_STREQ(to_string(TokenBack::dispatch_warps), "dispatch_warps");
  EXPECT_STREQ(to_string(TokenBack::epilogue_warps), "epilogue_warps");
  EXPECT_STREQ(to_string(ScaleRounding::rceil), "rceil");
  EXPECT_STREQ(to_string(ScaleRounding::ocp_floor), "ocp_floor");
  EXPECT_STREQ(to_string(TokenBucket::decode), "decode");
  EXPECT_STREQ(to_string(TokenBucket::prefill), "prefill");
  EXPECT_STREQ(to_string(static_cast<Precision>(9)), "unknown");
  EXPECT_STREQ(to_string(Precision::fp8_block128), "fp8_block128");
  EXPECT_STREQ(to_string(Precision::mxfp4), "mxfp4");
}

TEST(ConfigNames, ParseRejectsUnknownNamesNamingTheArgument) {
  EXPECT_EQ(rejection([] { parse_precision("fp16"); }),
            "precision=fp16: must be one of bf16, mxfp8, nvfp4, fp8_block128, mxfp4");
  EXPECT_EQ(rejection([] { parse_precision("BF16", "--precision"); }),
            "--precision=BF16: must be one of bf16, mxfp8, nvfp4, fp8_block128, mxfp4");
  EXPECT_EQ(rejection([] { parse_combine("reduce"); }),
            "combine=reduce: must be one of staged, in_kernel_reduce");
  EXPECT_EQ(rejection([] { parse_expert_math("tf32"); }),
            "expert_math=tf32: must be one of exact, tensor_core, wgmma");
  EXPECT_EQ(rejection([] { parse_expert_math("Exact", "--math"); }),
            "--math=Exact: must be one of exact, tensor_core, wgmma");
  EXPECT_EQ(rejection([] { parse_token_back("epilogue", "--token-back"); }),
            "--token-back=epilogue: must be one of epilogue_warps, dispatch_warps");
}

// wgmma is the fastest math at most points (docs/tuning.md#expert-math); exact stays selectable.
TEST(ConfigOptions, ExpertMathDefaultsToWgmma) {
  EXPECT_EQ(LayerOptions{}.expert_math, ExpertMath::wgmma);
  EXPECT_EQ(make_config(kQwen, Precision::bf16, 0, 4).options().expert_math, ExpertMath::wgmma);
  EXPECT_EQ(make_config(kQwen, Precision::bf16, 0, 4, exact_math()).options().expert_math,
            ExpertMath::exact);
}

// ---- describe ----------------------------------------------------------------------------------

TEST(ConfigDescribe, IsOneLineNamingEveryField) {
  const std::string d = make_config(kQwen, Precision::mxfp8, 1, 4, exact_math()).describe();
  EXPECT_EQ(d.find('\n'), std::string::npos);
  for (const char* field : {"hidden=2048",
                            "intermediate=768",
                            "num_experts=128",
                            "top_k=8",
                            "max_tokens_per_rank=4096",
                            "precision=mxfp8",
                            "world=4",
                            "combine=staged",
                            "deterministic=false",
                            "timeout_ms=10000",
                            "activation=swiglu",
                            "swiglu_limit=0",
                            "mxfp8_scale_rounding=rceil",
                            "expert_math=exact",
                            "knobs.decode={",
                            "knobs.small={",
                            "knobs.medium={",
                            "knobs.prefill={",
                            "block_m=",
                            "block_n=",
                            "dispatch_warps=",
                            "token_back=",
                            "num_sms=",
                            "megakernel="}) {
    EXPECT_THAT(d, HasSubstr(field));
  }
  EXPECT_THAT(d, Not(HasSubstr(" rank=")));
  EXPECT_THAT(d, Not(HasSubstr("stages=")));  // not a knob since epmoe.config/10
}

// How often `mark` follows a value of `knob` in `d`, and how often `knob` appears.
std::pair<int, int> marked(const std::string& d, const std::string& knob, const std::string& mark) {
  int marks = 0, seen = 0;
  for (std::size_t at = d.find(knob); at != std::string::npos; at = d.find(knob, at + 1)) {
    if (at == 0 || (d[at - 1] != ' ' && d[at - 1] != '{')) continue;  // a knob's name, not a tail
    ++seen;
    const std::size_t value_end = d.find_first_of(" }", at);
    if (d.compare(value_end, mark.size(), mark) == 0) ++marks;
  }
  return {marks, seen};
}

// docs/design.md §5: a knob exists only if the code that runs reads it, so none is marked
// "(not read yet)"; num_sms (every chain kernel's grid), dispatch_warps (the
// dispatch kernel's CTA), token_back (wgmma's E4M3 tile; elsewhere the one mode that runs) and
// megakernel (the persistent round, or a refusal at creation) are read and unmarked; block_m /
// block_n are read by the wgmma backend only, so marked under exact and tensor_core; under wgmma
// bf16 reads both, mxfp8 block_m (the packed GEMM's token rows) but not block_n. No caller-owned
// field is marked.
TEST(ConfigDescribe, MarksExactlyTheKnobsTheBackendDoesNotReadAndNothingElse) {
  for (ExpertMath math : {ExpertMath::exact, ExpertMath::tensor_core, ExpertMath::wgmma})
    for (Precision p : {Precision::bf16, Precision::mxfp8}) {
      LayerOptions o;
      o.expert_math = math;
      const std::string d = make_config(kQwen, p, 1, 4, o).describe();
      const std::string not_yet = " (not read yet)";
      const bool m_read = math == ExpertMath::wgmma;  // bf16's tiles, mxfp8's token rows
      const bool n_read = math == ExpertMath::wgmma && p == Precision::bf16;
      const std::string not_here =
          std::string(" (not read by expert_math=") + to_string(math) +
          (math == ExpertMath::wgmma ? std::string(" with precision=") + to_string(p) : "") + ")";
      EXPECT_THAT(d, Not(HasSubstr(not_yet)));
      for (const char* knob : {"num_sms=", "dispatch_warps=", "token_back=", "megakernel="}) {
        EXPECT_EQ(marked(d, knob, "").second, 4) << knob;
        EXPECT_EQ(marked(d, knob, " (not").first, 0) << knob << " in " << d;
      }
      EXPECT_EQ(marked(d, "block_m=", not_here).first, m_read ? 0 : 4) << d;
      EXPECT_EQ(marked(d, "block_n=", not_here).first, n_read ? 0 : 4) << d;
      int marks = 0;
      for (std::size_t at = d.find(" (not read"); at != std::string::npos;
           at = d.find(" (not read", at + 1))
        ++marks;
      EXPECT_EQ(marks, ((m_read ? 0 : 1) + (n_read ? 0 : 1)) * kNumTokenBuckets) << d;
      EXPECT_EQ(d.substr(0, d.find(" knobs.")).find(" (not read"), std::string::npos)
          << "a caller-owned field is marked: " << d;
    }
}

TEST(ConfigDescribe, IsTheSameOnEveryRank) {
  const std::string d0 = make_config(kQwen, Precision::nvfp4, 0, 8).describe();
  for (int r = 1; r < 8; ++r) EXPECT_EQ(make_config(kQwen, Precision::nvfp4, r, 8).describe(), d0);
}

TEST(ConfigDescribe, DiffersWhenAnyOtherFieldDiffers) {
  const LayerConfig base = make_config(kQwen, Precision::bf16, 0, 4);
  std::vector<LayerConfig> variants;
  auto shape = [&](auto edit) {
    LayerShape s = kQwen;
    edit(s);
    variants.push_back(make_config(s, Precision::bf16, 0, 4));
  };
  shape([](LayerShape& s) { s.hidden = 4096; });
  shape([](LayerShape& s) { s.intermediate = 1024; });
  shape([](LayerShape& s) { s.num_experts = 64; });
  shape([](LayerShape& s) { s.top_k = 4; });
  shape([](LayerShape& s) { s.max_tokens_per_rank = 4097; });
  variants.push_back(make_config(kQwen, Precision::mxfp8, 0, 4));
  variants.push_back(make_config(kQwen, Precision::bf16, 0, 2));
  auto option = [&](auto edit) {
    LayerOptions o;
    edit(o);
    variants.push_back(make_config(kQwen, Precision::bf16, 0, 4, o));
  };
  option([](LayerOptions& o) { o.combine = Combine::in_kernel_reduce; });
  option([](LayerOptions& o) { o.deterministic = true; });
  option([](LayerOptions& o) { o.timeout_ms = 10'001; });
  option([](LayerOptions& o) { o.swiglu_limit = 7.0f; });
  option([](LayerOptions& o) {
    o.activation = Activation::swiglu_oai;
    o.swiglu_limit = 7.0f;
  });
  option([](LayerOptions& o) { o.mxfp8_scale_rounding = ScaleRounding::ocp_floor; });
  option([](LayerOptions& o) { o.expert_math = ExpertMath::tensor_core; });
  auto knob = [&](auto edit) {
    Knobs k = base.knobs(TokenBucket::medium);
    edit(k);
    variants.push_back(with_knobs(base, k, TokenBucket::medium));
  };
  knob([](Knobs& k) { k.block_m = k.block_m == 64 ? 128 : 64; });
  knob([](Knobs& k) { k.block_n = k.block_n == 64 ? 128 : 64; });
  knob([](Knobs& k) { k.dispatch_warps = k.dispatch_warps == 1 ? 2 : 1; });
  knob([](Knobs& k) { k.num_sms = 99; });
  knob([](Knobs& k) { k.megakernel = !k.megakernel; });
  for (std::size_t i = 0; i < variants.size(); ++i) {
    EXPECT_NE(variants[i].describe(), base.describe()) << "variant " << i;
  }
  // token_back where a bucket runs either mode (wgmma's E4M3 tile: mxfp8, qwen3 at world 4, decode)
  LayerOptions wgmma;
  wgmma.expert_math = ExpertMath::wgmma;
  const LayerConfig e4m3 = make_config(kQwen, Precision::mxfp8, 0, 4, wgmma);
  Knobs k = e4m3.knobs(TokenBucket::decode);
  k.token_back = k.token_back == TokenBack::epilogue_warps ? TokenBack::dispatch_warps
                                                           : TokenBack::epilogue_warps;
  EXPECT_NE(with_knobs(e4m3, k, TokenBucket::decode).describe(), e4m3.describe());
}

TEST(ConfigDescribe, HasAStableFormat) {
  LayerOptions o = exact_math();
  o.swiglu_limit = 7.5f;
  Knobs k;  // explicit knobs so the text does not depend on the default table
  k.block_m = 128;
  k.block_n = 64;
  k.dispatch_warps = 6;
  k.num_sms = 100;
  const LayerConfig c =
      with_knobs(make_config({1024, 512, 16, 2, 256}, Precision::nvfp4, 1, 2, o), k);
  const std::string knobs =
      "{token_back=epilogue_warps block_m=128 (not read by expert_math=exact) "
      "block_n=64 (not read by expert_math=exact) dispatch_warps=6 "
      "num_sms=100 megakernel=false}";
  EXPECT_EQ(c.describe(),
            "epmoe.config/10 hidden=1024 intermediate=512 num_experts=16 top_k=2 "
            "max_tokens_per_rank=256 precision=nvfp4 world=2 combine=staged deterministic=false "
            "timeout_ms=10000 activation=swiglu swiglu_limit=7.5 mxfp8_scale_rounding=rceil "
            "expert_math=exact "
            "knobs.decode=" +
                knobs + " knobs.small=" + knobs + " knobs.medium=" + knobs +
                " knobs.prefill=" + knobs);
}

}  // namespace
}  // namespace epmoe
