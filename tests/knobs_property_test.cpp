// Properties of with_knobs over the whole knob space × every caller choice, and of the built-in
// default table (docs/design.md §5): tuning never fails because of a conflict the caller did not
// create, never touches caller-owned fields, and always yields knobs the kernels can run.
#include <epmoe/config.hpp>
#include <epmoe/errors.hpp>

#include "core/knob_table.hpp"
#include "epmoe/models.hpp"
#include "support/exact_math.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace epmoe {
namespace {

using test::exact_math;

constexpr Precision kPrecisions[] = {Precision::bf16, Precision::mxfp8, Precision::nvfp4,
                                     Precision::fp8_block128, Precision::mxfp4};
constexpr int kWorlds[] = {1, 2, 4, 8};

constexpr TokenBucket kBuckets[] = {TokenBucket::decode, TokenBucket::small, TokenBucket::medium,
                                    TokenBucket::prefill};

// The four real shapes and a small one (I = 64, so block_n 256 > 2I must be adjusted).
std::vector<LayerShape> test_shapes() {
  std::vector<LayerShape> shapes;
  for (const ModelShape& m : known_models()) shapes.push_back(m.layer_shape(8192));
  shapes.push_back({128, 64, 8, 2, 32});
  return shapes;
}

// Every knob value of kKnobSpace, and num_sms 0 (all), small, typical and above any device.
std::vector<Knobs> whole_knob_space() {
  std::vector<Knobs> all;
  for (std::int32_t bm : kKnobSpace.block_m) {
    for (std::int32_t bn : kKnobSpace.block_n) {
      for (std::int32_t dw = kKnobSpace.min_dispatch_warps; dw <= kKnobSpace.max_dispatch_warps;
           ++dw) {
        for (TokenBack tb : {TokenBack::epilogue_warps, TokenBack::dispatch_warps}) {
          for (bool mk : {false, true}) {
            for (std::int32_t sms : {0, 1, 66, 132, 1000}) {
              all.push_back(Knobs{tb, bm, bn, dw, sms, mk});
            }
          }
        }
      }
    }
  }
  return all;
}

// Every caller choice except the one make_config rejects (deterministic with in_kernel_reduce).
std::vector<LayerOptions> every_caller_choice() {
  std::vector<LayerOptions> all;
  for (Combine c : {Combine::staged, Combine::in_kernel_reduce}) {
    for (bool det : {false, true}) {
      if (det && c == Combine::in_kernel_reduce) continue;
      for (ScaleRounding r : {ScaleRounding::rceil, ScaleRounding::ocp_floor}) {
        for (int limits = 0; limits < 2; ++limits) {
          LayerOptions o;
          o.combine = c;
          o.deterministic = det;
          o.mxfp8_scale_rounding = r;
          o.timeout_ms = limits == 0 ? 0u : kMaxTimeoutMs;
          o.swiglu_limit = limits == 0 ? 0.0f : 7.0f;
          // Expert math varies with the limits and the rounding so the walk does not grow.
          o.expert_math = limits == 0                     ? ExpertMath::exact
                          : r == ScaleRounding::ocp_floor ? ExpertMath::wgmma
                                                          : ExpertMath::tensor_core;
          o.activation = limits == 0 ? Activation::swiglu : Activation::swiglu_oai;
          all.push_back(o);
        }
      }
    }
  }
  return all;
}

std::string show(const Knobs& k) {
  std::ostringstream s;
  s << "{token_back=" << to_string(k.token_back) << " block_m=" << k.block_m
    << " block_n=" << k.block_n << " dispatch_warps=" << k.dispatch_warps
    << " num_sms=" << k.num_sms << " megakernel=" << k.megakernel << "}";
  return s.str();
}

bool same_caller_fields(const LayerConfig& a, const LayerConfig& b) {
  const LayerShape &sa = a.shape(), &sb = b.shape();
  const LayerOptions &oa = a.options(), &ob = b.options();
  return sa.hidden == sb.hidden && sa.intermediate == sb.intermediate &&
         sa.num_experts == sb.num_experts && sa.top_k == sb.top_k &&
         sa.max_tokens_per_rank == sb.max_tokens_per_rank && a.precision() == b.precision() &&
         a.rank() == b.rank() && a.world() == b.world() && oa.combine == ob.combine &&
         oa.deterministic == ob.deterministic && oa.timeout_ms == ob.timeout_ms &&
         oa.activation == ob.activation && oa.swiglu_limit == ob.swiglu_limit &&
         oa.mxfp8_scale_rounding == ob.mxfp8_scale_rounding && oa.expert_math == ob.expert_math;
}

// token_back names a mode the bucket does not run: exact and tensor_core ship FC2's rows from the
// epilogue, wgmma from its home kernel but where the bucket runs the E4M3 tile (either mode, in
// the chain and in its persistent round).
bool token_back_conflicts(const Knobs& k, Precision p, int world, const LayerShape& shape,
                          TokenBucket b, const LayerOptions& o) {
  if (o.expert_math != ExpertMath::wgmma) return k.token_back != TokenBack::epilogue_warps;
  return !core::wgmma_e4m3_tokens(p, world, shape, b, k) &&
         k.token_back != TokenBack::dispatch_warps;
}

// The conflict rules every knob set a launch may see must satisfy; empty when all hold.
std::string conflict(const Knobs& k, Precision p, int world, const LayerShape& shape, TokenBucket b,
                     const LayerOptions& o) {
  if (!core::in_knob_space(k)) return "outside kKnobSpace";
  if (token_back_conflicts(k, p, world, shape, b, o)) {
    return std::string("token_back=") + to_string(k.token_back) + " is not the bucket's mode";
  }
  if (core::shared_memory_bytes(p, k) > core::kMaxSharedMemoryBytes) {
    return "shared memory overflows";
  }
  if (k.block_n > std::max<std::int64_t>(kKnobSpace.block_n.front(), 2 * shape.intermediate)) {
    return "block_n wider than 2 * intermediate";
  }
  if (o.expert_math == ExpertMath::wgmma && !core::wgmma_has_tile(p, k.block_m, k.block_n)) {
    return "a tile expert_math=wgmma does not ship";
  }
  return "";
}

// Which bucket one application targets: each of the four, or all of them (empty).
std::optional<TokenBucket> application(std::size_t i) {
  if (i % 5 == 4) return std::nullopt;
  return kBuckets[i % 5];
}

class WithKnobsProperty : public ::testing::TestWithParam<Precision> {};

// For one precision: every knob set of the whole knob space × every caller choice × 5 shapes ×
// worlds {1, 2, 4, 8}. The bucket application (each bucket, or all) rotates with an offset per
// configuration, so every knob set is applied in all five ways across the configurations.
TEST_P(WithKnobsProperty,
       NeverThrowsNeverChangesCallerFieldsAndAlwaysYieldsConflictFreeKnobsAdjustedMinimally) {
  const Precision precision = GetParam();
  const std::vector<Knobs> space = whole_knob_space();
  const std::vector<LayerOptions> choices = every_caller_choice();
  ASSERT_EQ(space.size(), 2u * 3 * 3 * 16 * 2 * 5);
  ASSERT_EQ(choices.size(), 12u);
  std::size_t config_index = 0, checked = 0;
  int failures = 0;
  for (const LayerShape& shape : test_shapes()) {
    for (int world : kWorlds) {
      for (const LayerOptions& options : choices) {
        const LayerConfig base = make_config(shape, precision, world - 1, world, options);
        for (std::size_t i = 0; i < space.size() && failures < 10; ++i) {
          const Knobs& in = space[i];
          const std::optional<TokenBucket> target = application(i + config_index);
          auto fail = [&](const std::string& what, const Knobs& out) {
            ++failures;
            ADD_FAILURE() << what << "\n  in  " << show(in) << "\n  out " << show(out)
                          << "\n  config " << base.describe() << "\n  bucket "
                          << (target ? to_string(*target) : "all");
          };
          std::optional<LayerConfig> result;
          try {
            result = with_knobs(base, in, target);
          } catch (const std::exception& e) {
            fail(std::string("threw: ") + e.what(), in);
            continue;
          }
          if (!same_caller_fields(base, *result)) fail("changed a caller-owned field", in);
          for (TokenBucket b : kBuckets) {
            const Knobs& out = result->knobs(b);
            if (target && *target != b) {
              if (!(out == base.knobs(b))) fail("changed a bucket it was not applied to", out);
              continue;
            }
            if (const std::string c = conflict(out, precision, world, shape, b, options);
                !c.empty()) {
              fail("result breaks a rule: " + c, out);
            }
            // Minimal adjustment: only conflicting knobs move, and only downwards, except onto
            // the wgmma tiles: block_m 256 down to 128 where no 256-row tile exists (64 and 128
            // exist in every precision), a 64-wide block_n up to 128.
            const bool wgmma = options.expert_math == ExpertMath::wgmma;
            const std::int32_t wgmma_block_m =
                in.block_m != 256 || core::wgmma_has_256_row_tile(precision) ? in.block_m : 128;
            const bool block_m_ok =
                wgmma ? out.block_m == wgmma_block_m : out.block_m == in.block_m;
            const bool block_n_ok =
                out.block_n <= in.block_n || (wgmma && in.block_n == 64 && out.block_n == 128);
            // token_back moves only where the input's names a mode the bucket (on the result's
            // tile) does not run
            Knobs in_token_back = out;
            in_token_back.token_back = in.token_back;
            const bool token_back_ok =
                out.token_back == in.token_back ||
                token_back_conflicts(in_token_back, precision, world, shape, b, options);
            if (!block_m_ok || !block_n_ok || out.dispatch_warps != in.dispatch_warps ||
                out.num_sms != in.num_sms || out.megakernel != in.megakernel || !token_back_ok) {
              fail("adjusted a knob that did not conflict", out);
            }
            if (conflict(in, precision, world, shape, b, options).empty() && !(out == in)) {
              fail("changed conflict-free knobs", out);
            }
          }
          // Applying the result again changes nothing (sampled: it doubles the cost).
          if (i % 13 == 0) {
            const TokenBucket b = target.value_or(TokenBucket::prefill);
            const Knobs& out = result->knobs(b);
            if (!(with_knobs(*result, out, b).knobs(b) == out)) fail("not idempotent", out);
          }
          ++checked;
        }
        ++config_index;
      }
    }
  }
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(checked, space.size() * choices.size() * 5 * 4);
}

INSTANTIATE_TEST_SUITE_P(EveryPrecision, WithKnobsProperty, ::testing::ValuesIn(kPrecisions),
                         [](const auto& param_info) {
                           return std::string(to_string(param_info.param));
                         });

// ---- the default table -------------------------------------------------------------------------

TEST(DefaultKnobTable, RealShapesAtEveryWorldBucketAndPrecisionAreInsideKnobSpaceAndConflictFree) {
  for (const ModelShape& m : known_models()) {
    for (int world : kWorlds) {
      for (Precision p : kPrecisions) {
        for (TokenBucket b : kBuckets) {
          const Knobs k = default_knobs(p, world, m.layer_shape(8192), b);
          EXPECT_EQ(conflict(k, p, world, m.layer_shape(8192), b, exact_math()), "")
              << m.name << " world " << world << " " << to_string(p) << " " << to_string(b) << " "
              << show(k);
        }
      }
    }
  }
}

TEST(DefaultKnobTable, EntriesAreFixedPointsOfWithKnobsUnderExactMath) {
  for (const ModelShape& m : known_models()) {
    for (int world : kWorlds) {
      for (Precision p : kPrecisions) {
        const LayerConfig c = make_config(m.layer_shape(8192), p, 0, world, exact_math());
        for (TokenBucket b : kBuckets) {
          const Knobs k = default_knobs(p, world, m.layer_shape(8192), b);
          EXPECT_EQ(with_knobs(c, k, b).knobs(b), k)
              << m.name << " world " << world << " " << to_string(p) << " " << to_string(b);
          EXPECT_EQ(c.knobs(b), k);
        }
      }
    }
  }
}

TEST(DefaultKnobTable, MakeConfigKnobsAreConflictFreeForEveryCallerChoice) {
  for (const LayerShape& shape : test_shapes()) {
    for (int world : kWorlds) {
      for (Precision p : kPrecisions) {
        for (const LayerOptions& o : every_caller_choice()) {
          const LayerConfig c = make_config(shape, p, 0, world, o);
          for (TokenBucket b : kBuckets) {
            EXPECT_EQ(conflict(c.knobs(b), p, world, shape, b, o), "") << c.describe();
          }
        }
      }
    }
  }
}

// Prefill: 128, or 256 token rows for the packed-weight GEMM's precisions (mxfp8, nvfp4, mxfp4)
// where an expert gets at least 256 rows (qwen3 at world 1: 4096 tokens x 8 / 128 experts).
TEST(DefaultKnobTable, DecodeUsesBlockM64AndPrefillBlockM128Or256ForRealShapes) {
  for (const ModelShape& m : known_models()) {
    for (int world : kWorlds) {
      for (Precision p : kPrecisions) {
        // (fp8_block128's 64 is its 16-row E4M3 tile: only where an expert gets at most 16 rows,
        // world x 16 x top_k / experts; mixtral at world 8 gets 32)
        const LayerShape shape = m.layer_shape(8192);
        const bool few_rows = world * 16 * shape.top_k / shape.num_experts <= 16;
        EXPECT_EQ(default_knobs(p, world, shape, TokenBucket::decode).block_m,
                  p == Precision::fp8_block128 && !few_rows ? 128 : 64)
            << m.name << " " << to_string(p) << " world " << world;
        const std::int32_t prefill =
            default_knobs(p, world, m.layer_shape(8192), TokenBucket::prefill).block_m;
        EXPECT_TRUE(prefill == 128 || (prefill == 256 && core::wgmma_has_256_row_tile(p)))
            << m.name << " " << to_string(p) << " world " << world << ": " << prefill;
      }
    }
  }
  for (Precision p : {Precision::mxfp8, Precision::nvfp4, Precision::mxfp4})
    EXPECT_EQ(
        default_knobs(p, 1, known_models()[0].layer_shape(8192), TokenBucket::prefill).block_m, 256)
        << to_string(p);
}

// mxfp8's and mxfp4's block_m 64 runs the wgmma E4M3 tile (16 token rows) where an expert gets at
// most 16 rows with balanced routing (world x T x top_k / experts, T: 16 decode, 128 small, 1024
// medium): qwen3 (128 experts, top 8) in decode and small at world 1 and 2 (1, 8; 2, 16 rows), not
// in medium (64 at world 1) nor in small at world 4 (32); mixtral (8 experts, top 2) in decode up
// to world 4 (4 x 16 x 2 / 8 = 16), not at world 8 (32). mxfp4 as mxfp8; never another precision or
// another block_m (fp8_block128 runs the E4M3 tile at block_m 64 whatever its rows, with the
// token_back choice but no persistent round).
TEST(DefaultKnobTable, MxPrecisionsRunTheE4m3TileOnlyWithBlockM64AndAFewRowsPerExpert) {
  const LayerShape qwen3 = known_models()[0].layer_shape(8192);
  ASSERT_EQ(qwen3.num_experts, 128);
  ASSERT_EQ(qwen3.top_k, 8);
  Knobs k64;
  k64.block_m = 64;
  const auto e4m3 = [&](Precision p, int world, const LayerShape& shape, TokenBucket b,
                        const Knobs& k) { return core::wgmma_e4m3_tokens(p, world, shape, b, k); };
  EXPECT_TRUE(e4m3(Precision::mxfp8, 1, qwen3, TokenBucket::decode, k64));
  EXPECT_TRUE(e4m3(Precision::mxfp8, 1, qwen3, TokenBucket::small, k64));
  EXPECT_FALSE(e4m3(Precision::mxfp8, 1, qwen3, TokenBucket::medium, k64));
  EXPECT_TRUE(e4m3(Precision::mxfp8, 2, qwen3, TokenBucket::small, k64));
  EXPECT_FALSE(e4m3(Precision::mxfp8, 4, qwen3, TokenBucket::small, k64));
  // mxfp4's weights run it as the E4M3 codes of their E2M1 values (MXFP8 rows, both E8M0-scaled)
  EXPECT_TRUE(e4m3(Precision::mxfp4, 1, qwen3, TokenBucket::decode, k64));
  EXPECT_FALSE(e4m3(Precision::mxfp4, 1, qwen3, TokenBucket::medium, k64));
  // the same buckets give nvfp4 its 16-row decoding tile, and no precision without packed weights
  const auto rows16 = [&](Precision p, TokenBucket b, const Knobs& k) {
    return core::wgmma_16_row_tile(p, 1, qwen3, b, k);
  };
  for (const Precision p : {Precision::mxfp8, Precision::mxfp4, Precision::nvfp4}) {
    EXPECT_TRUE(rows16(p, TokenBucket::decode, k64)) << to_string(p);
    EXPECT_FALSE(rows16(p, TokenBucket::medium, k64)) << to_string(p);
  }
  EXPECT_FALSE(rows16(Precision::bf16, TokenBucket::decode, k64));
  // fp8_block128's block_m 64 is its E4M3 tile wherever it is set (it has no 64-row tile), and the
  // table sets it only where an expert gets at most 16 rows; the tile has no persistent round
  EXPECT_TRUE(rows16(Precision::fp8_block128, TokenBucket::decode, k64));
  EXPECT_TRUE(rows16(Precision::fp8_block128, TokenBucket::medium, k64));
  EXPECT_EQ(default_knobs(Precision::fp8_block128, 1, qwen3, TokenBucket::decode).block_m, 64);
  EXPECT_EQ(default_knobs(Precision::fp8_block128, 1, qwen3, TokenBucket::small).block_m, 64);
  EXPECT_EQ(default_knobs(Precision::fp8_block128, 1, qwen3, TokenBucket::medium).block_m, 128);
  EXPECT_EQ(default_knobs(Precision::fp8_block128, 4, qwen3, TokenBucket::small).block_m, 128);
  Knobs k128 = k64;
  k128.block_m = 128;
  EXPECT_FALSE(rows16(Precision::fp8_block128, TokenBucket::decode, k128));
  for (Precision p : kPrecisions) {
    if (p != Precision::mxfp8 && p != Precision::mxfp4 && p != Precision::fp8_block128) {
      EXPECT_FALSE(e4m3(p, 1, qwen3, TokenBucket::decode, k64)) << to_string(p);
    }
  }
  // (fp8_block128's own E4M3 tile, either token_back, wherever block_m is 64)
  EXPECT_TRUE(e4m3(Precision::fp8_block128, 1, qwen3, TokenBucket::medium, k64));
  for (const std::int32_t rows : {128, 256}) {
    Knobs k = k64;
    k.block_m = rows;
    EXPECT_FALSE(e4m3(Precision::mxfp8, 1, qwen3, TokenBucket::decode, k)) << rows;
  }
  const LayerShape mixtral = known_models()[3].layer_shape(8192);
  ASSERT_EQ(mixtral.num_experts, 8);
  ASSERT_EQ(mixtral.top_k, 2);
  EXPECT_TRUE(e4m3(Precision::mxfp8, 4, mixtral, TokenBucket::decode, k64));
  EXPECT_FALSE(e4m3(Precision::mxfp8, 8, mixtral, TokenBucket::decode, k64));
  // The default table's decode knobs name the 64-row tile for every real shape, so its decode
  // bucket runs E4M3 wherever the rows allow.
  EXPECT_TRUE(e4m3(Precision::mxfp8, 1, qwen3, TokenBucket::decode,
                   default_knobs(Precision::mxfp8, 1, qwen3, TokenBucket::decode)));
}

TEST(DefaultKnobTable, GptOssNvfp4UsesBlockN128BecauseTwoITilesExactly) {
  const LayerShape gpt_oss = known_models()[2].layer_shape(8192);
  ASSERT_EQ(gpt_oss.hidden, 2880);
  for (TokenBucket b : {TokenBucket::small, TokenBucket::medium, TokenBucket::prefill}) {
    EXPECT_EQ(default_knobs(Precision::nvfp4, 8, gpt_oss, b).block_n, 128) << to_string(b);
    // The override is specific: the other precisions (FC1 activating on 128-wide tiles) and
    // nvfp4 of other shapes get the rule's 256.
    EXPECT_EQ(default_knobs(Precision::bf16, 8, gpt_oss, b).block_n, 256) << to_string(b);
    // (256 token rows come with block_n 128: a 256 x 256 tile fits no stage count.)
    const Knobs qwen3 = default_knobs(Precision::nvfp4, 8, known_models()[0].layer_shape(8192), b);
    EXPECT_EQ(qwen3.block_n, qwen3.block_m == 256 ? 128 : 256) << to_string(b);
  }
}

// The measured block_n rule (bench/RESULTS.md, session 14): 256 outside decode, bf16 prefill
// included; 128 in decode's 64-row tiles; 64 where few local experts leave SMs without a tile.
TEST(DefaultKnobTable, BlockNIs256OutsideDecodeAnd128InDecode) {
  const LayerShape qwen = known_models()[0].layer_shape(8192);
  ASSERT_EQ(qwen.hidden, 2048);
  for (int world : {1, 2, 8}) {
    EXPECT_EQ(default_knobs(Precision::bf16, world, qwen, TokenBucket::decode).block_n, 128);
    for (TokenBucket b : {TokenBucket::small, TokenBucket::medium, TokenBucket::prefill})
      EXPECT_EQ(default_knobs(Precision::bf16, world, qwen, b).block_n, 256)
          << world << " " << to_string(b);
  }
  const LayerShape mixtral = known_models()[3].layer_shape(8192);
  ASSERT_EQ(mixtral.num_experts, 8);
  EXPECT_EQ(default_knobs(Precision::bf16, 2, mixtral, TokenBucket::small).block_n, 64);
  EXPECT_EQ(default_knobs(Precision::bf16, 2, mixtral, TokenBucket::prefill).block_n, 256);
}

TEST(DefaultKnobTable, DoesNotDependOnMaxTokensPerRank) {
  for (const ModelShape& m : known_models()) {
    LayerShape other = m.layer_shape(8192);
    other.max_tokens_per_rank = 1;
    for (TokenBucket b : kBuckets) {
      EXPECT_EQ(default_knobs(Precision::bf16, 4, m.layer_shape(8192), b),
                default_knobs(Precision::bf16, 4, other, b));
    }
  }
}

TEST(DefaultKnobTable, FallbackForAnyShapeIsInsideKnobSpaceAndFitsSharedMemory) {
  constexpr std::int64_t kBig = std::numeric_limits<std::int64_t>::max();
  const std::vector<LayerShape> odd = {
      {64, 64, 1, 1, 1},         {65536, 65536, 1024, 16, 1 << 20}, {128, 64, 64, 16, 8},
      {5120, 8192, 16, 1, 4096}, {7168, 64, 512, 16, 64},           {0, 0, 0, 0, 0},
      {-64, -64, -1, -1, -1},    {4096, 14336, 8, 2, 1024},         {kBig, kBig, kBig, kBig, kBig},
  };
  for (const LayerShape& s : odd) {
    for (int world : {1, 3, 8, 64, 0, 1000}) {
      for (Precision p : kPrecisions) {
        for (TokenBucket b : kBuckets) {
          const Knobs k = default_knobs(p, world, s, b);
          EXPECT_TRUE(core::in_knob_space(k)) << show(k);
          EXPECT_LE(core::shared_memory_bytes(p, k), core::kMaxSharedMemoryBytes) << show(k);
        }
      }
    }
  }
}

}  // namespace
}  // namespace epmoe
