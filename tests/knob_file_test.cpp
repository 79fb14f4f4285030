// Knob files (epmoe/config.hpp, docs/tuning.md#knob-files): what knob_file_text writes,
// with_knob_text / with_knob_file read back, the errors that name the file, line and field, and a
// Layer loading $EPMOE_KNOB_FILE.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "epmoe/config.hpp"
#include "epmoe/errors.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"

namespace epmoe {
namespace {

constexpr LayerShape kQwen{2048, 768, 128, 8, 4096};

LayerConfig wgmma_config(Precision p = Precision::bf16, int world = 2) {
  LayerOptions o;
  o.expert_math = ExpertMath::wgmma;
  return make_config(kQwen, p, 0, world, o);
}

// A config whose buckets differ from the defaults.
LayerConfig tuned_config() {
  Knobs decode = wgmma_config().knobs(TokenBucket::decode);
  decode.num_sms = 66;
  Knobs prefill = wgmma_config().knobs(TokenBucket::prefill);
  prefill.block_n = 256;
  prefill.dispatch_warps = 12;
  return with_knobs(with_knobs(wgmma_config(), decode, TokenBucket::decode), prefill,
                    TokenBucket::prefill);
}

// The message of the invalid_argument `f` throws ("" if none).
template <class F>
std::string rejection(F f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    return e.what();
  }
  return "";
}

TEST(KnobFile, ReadsBackEveryBucketItWrote) {
  const LayerConfig tuned = tuned_config();
  const std::string text = knob_file_text(tuned);
  std::printf("%s", text.c_str());
  const LayerConfig loaded = with_knob_text(wgmma_config(), text);
  for (int b = 0; b < kNumTokenBuckets; ++b) {
    const auto bucket = static_cast<TokenBucket>(b);
    EXPECT_EQ(loaded.knobs(bucket), tuned.knobs(bucket)) << to_string(bucket);
  }
  EXPECT_EQ(loaded.describe(), tuned.describe());
  EXPECT_NE(loaded.describe(), wgmma_config().describe());  // the file changed something
}

TEST(KnobFile, WritesTheKeyAndABucketPerLine) {
  const std::string text = knob_file_text(tuned_config());
  EXPECT_NE(text.find("\nkey precision=bf16 world=2 hidden=2048 intermediate=768 num_experts=128 "
                      "top_k=8 expert_math=wgmma\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("\ndecode token_back="), std::string::npos) << text;
  EXPECT_NE(text.find(" num_sms=66 "), std::string::npos) << text;
  EXPECT_NE(text.find("\nprefill token_back=dispatch_warps block_m=128 block_n=256 "),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("stages"), std::string::npos) << text;  // not a knob
}

TEST(KnobFile, ALineMayNameSomeKnobsAndAFileSomeBuckets) {
  const LayerConfig base = wgmma_config();
  const std::string key =
      "key precision=bf16 world=2 hidden=2048 intermediate=768 num_experts=128 top_k=8 "
      "expert_math=wgmma\n";
  const LayerConfig loaded = with_knob_text(base, "# tuned by hand\n" + key + "small num_sms=8\n");
  Knobs want = base.knobs(TokenBucket::small);
  want.num_sms = 8;
  EXPECT_EQ(loaded.knobs(TokenBucket::small), want);
  for (TokenBucket b : {TokenBucket::decode, TokenBucket::medium, TokenBucket::prefill})
    EXPECT_EQ(loaded.knobs(b), base.knobs(b)) << to_string(b);
}

// Files written before epmoe.config/10 hold stages=N, a knob no code ever read: accepted and
// ignored, so such a line loads the knobs it loaded before.
TEST(KnobFile, StagesFromAnOlderFileIsAcceptedAndIgnored) {
  const LayerConfig base = wgmma_config();
  const std::string key =
      "key precision=bf16 world=2 hidden=2048 intermediate=768 num_experts=128 top_k=8 "
      "expert_math=wgmma\n";
  const std::string head = "prefill token_back=dispatch_warps block_m=128 block_n=256 ";
  const std::string tail = "dispatch_warps=12 num_sms=66 megakernel=false\n";
  const LayerConfig without = with_knob_text(base, key + head + tail);
  const LayerConfig old = with_knob_text(base, key + head + "stages=5 " + tail);
  EXPECT_NE(without.knobs(TokenBucket::prefill), base.knobs(TokenBucket::prefill));
  for (int b = 0; b < kNumTokenBuckets; ++b) {
    const auto bucket = static_cast<TokenBucket>(b);
    EXPECT_EQ(old.knobs(bucket), without.knobs(bucket)) << to_string(bucket);
  }
  EXPECT_EQ(old.describe(), without.describe());
}

TEST(KnobFile, KnobsAreAdjustedAsWithKnobsAdjustsThem) {
  // fp8_block128's E4M3 GEMM ships 128 x 128 only: a 256 in a file is moved, not rejected.
  const LayerConfig base = wgmma_config(Precision::fp8_block128);
  const std::string text =
      "key precision=fp8_block128 world=2 hidden=2048 intermediate=768 num_experts=128 top_k=8 "
      "expert_math=wgmma\nprefill block_n=256\n";
  EXPECT_EQ(with_knob_text(base, text).knobs(TokenBucket::prefill).block_n, 128);
}

TEST(KnobFile, AKeyForAnotherLayerIsRejectedNamingTheField) {
  const std::string bf16 = knob_file_text(wgmma_config());
  EXPECT_EQ(rejection([&] { with_knob_text(wgmma_config(Precision::mxfp8), bf16, "t.knobs"); }),
            "t.knobs:2: tuned for precision=bf16, this layer has precision=mxfp8");
  EXPECT_EQ(rejection([&] { with_knob_text(wgmma_config(Precision::bf16, 4), bf16, "t.knobs"); }),
            "t.knobs:2: tuned for world=2, this layer has world=4");
  LayerOptions exact;
  exact.expert_math = ExpertMath::exact;
  EXPECT_EQ(rejection([&] {
              with_knob_text(make_config(kQwen, Precision::bf16, 0, 2, exact), bf16, "t.knobs");
            }),
            "t.knobs:2: tuned for expert_math=wgmma, this layer has expert_math=exact");
}

TEST(KnobFile, MalformedLinesAreRejectedNamingTheLineAndTheField) {
  const std::string key =
      "key precision=bf16 world=2 hidden=2048 intermediate=768 num_experts=128 top_k=8 "
      "expert_math=wgmma\n";
  const LayerConfig c = wgmma_config();
  const auto reject = [&](const std::string& text) {
    return rejection([&] { with_knob_text(c, text, "f"); });
  };
  EXPECT_EQ(reject(key + "decode stage=3\n"),
            "f:2: unknown knob 'stage' (token_back, block_m, block_n, dispatch_warps, num_sms, "
            "megakernel)");
  EXPECT_EQ(reject(key + "decode dispatch_warps=17\n"),
            "f:2: knobs.dispatch_warps=17: must be in [1, 16]");
  EXPECT_EQ(reject(key + "decode block_m\n"), "f:2: 'block_m' is not name=value");
  EXPECT_EQ(reject(key + "decode block_m=6x4\n"), "f:2: block_m=6x4: not an integer");
  EXPECT_EQ(reject(key + "decode megakernel=yes\n"), "f:2: megakernel=yes: must be true or false");
  EXPECT_EQ(reject(key + "decode token_back=warps\n"),
            "f:2: token_back=warps: must be one of epilogue_warps, dispatch_warps");
  EXPECT_EQ(reject(key + "huge num_sms=8\n"),
            "f:2: unknown bucket 'huge' (decode, small, medium, prefill)");
  EXPECT_EQ(reject("decode num_sms=8\n" + key), "f:1: a bucket line before the key line");
  EXPECT_EQ(reject("# nothing\n"),
            "f:0: no key line (a knob file starts with 'key precision=... ')");
  EXPECT_EQ(reject("key precision=bf16 world=2\n"),
            "f:1: the key names 2 fields, a key has 7 (precision world hidden intermediate "
            "num_experts top_k expert_math)");
  EXPECT_EQ(reject("key precision=bf16 colour=2\n"), "f:1: unknown key field 'colour'");
  EXPECT_EQ(rejection([&] { with_knob_file(c, "/nonexistent/tuned.knobs"); }),
            "knob file '/nonexistent/tuned.knobs': cannot be read");
}

// Every Layer loads $EPMOE_KNOB_FILE (here on the CPU executor, which reads no knob but keeps and
// compares them like any config field).
TEST(KnobFile, ALayerLoadsTheFileTheEnvironmentNames) {
  const LayerShape shape{64, 128, 8, 3, 12};
  const LayerConfig base = make_config(shape, Precision::bf16, 0, 2);
  Knobs decode = base.knobs(TokenBucket::decode);
  decode.num_sms = 7;
  const std::string path = ::testing::TempDir() + "epmoe_knob_file_test.knobs";
  {
    std::ofstream file(path);
    file << knob_file_text(with_knobs(base, decode, TokenBucket::decode));
  }
  const auto weights = harness::make_random_weights(shape, 3);
  ASSERT_EQ(setenv(kKnobFileEnv, path.c_str(), 1), 0);
  {
    Cluster cluster(shape, Precision::bf16, LayerOptions{}, 2, weights);
    for (int r = 0; r < 2; ++r)
      EXPECT_EQ(cluster.layer(r).config().knobs(TokenBucket::decode).num_sms, 7) << r;
  }
  ASSERT_EQ(setenv(kKnobFileEnv, "", 1), 0);  // empty: not loaded
  {
    Cluster cluster(shape, Precision::bf16, LayerOptions{}, 2, weights);
    EXPECT_EQ(cluster.layer(0).config().knobs(TokenBucket::decode),
              base.knobs(TokenBucket::decode));
  }
  unsetenv(kKnobFileEnv);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace epmoe
