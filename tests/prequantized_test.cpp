// Weights already in the layer's precision (ExpertWeights::w13_quantized / w2_quantized): quantized
// with epmoe's own host codec and handed over as codes and scales, they give a CPU-executor layer
// whose output is bit-identical to the layer built from the bf16 weights, for every precision and
// both combines; NVFP4's ModelOpt convention (decode multiplier) decodes as e2m1 * scale * global;
// and every bad tensor is named before anything runs (docs/errors.md).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "epmoe/epmoe.hpp"
#include "formats/codec.hpp"
#include "formats/quantized_weights.hpp"
#include "harness/cluster.hpp"
#include "harness/prequantized.hpp"
#include "harness/problem.hpp"
#include "harness/rank_threads.hpp"
#include "math/quantize.hpp"

namespace epmoe {
namespace {

using harness::Nvfp4Scale;

// w13 [256, 192] is 2 x 2 fp8_block128 tiles (the second 64 wide), w2 [192, 128] 2 x 1 (the second
// row 64 high).
constexpr LayerShape kShape{192, 128, 8, 3, 16};

reference::LayerWeights weights_with_biases(std::uint64_t seed) {
  auto w = harness::make_random_weights(kShape, seed);
  harness::add_random_biases(w, kShape, seed + 1);
  return w;
}

// Every rank's y of a few rounds (one with T = 0, one all on one expert).
std::vector<std::vector<std::uint16_t>> run_rounds(Cluster& cluster, std::uint64_t seed) {
  constexpr int kRounds = 3;
  const int world = cluster.world();
  std::vector<std::vector<std::uint16_t>> ys(static_cast<std::size_t>(world * kRounds));
  run_on_rank_threads(world, [&](int rank) {
    for (int r = 0; r < kRounds; ++r) {
      const std::int64_t tokens = r == 1 ? 0 : kShape.max_tokens_per_rank - r;
      const auto routing = r == 2 ? harness::Routing::one_expert : harness::Routing::uniform;
      const reference::Batch batch = harness::make_random_batch(
          kShape, world, tokens, routing, r, seed * 31 + static_cast<std::uint64_t>(rank * 7 + r));
      ys[static_cast<std::size_t>(rank * kRounds + r)] = cluster.forward(rank, batch);
    }
  });
  return ys;
}

struct Case {
  Precision precision;
  Combine combine;
  int world;  // in_kernel_reduce: 1, so the accumulation order (and the bits) repeat
  ScaleRounding rounding = ScaleRounding::rceil;
  bool mxfp4_4d = false;
};

class PrequantizedHostLayer : public ::testing::TestWithParam<Case> {};

TEST_P(PrequantizedHostLayer, IsBitIdenticalToTheLayerBuiltFromBf16Weights) {
  const Case c = GetParam();
  LayerOptions o;
  o.combine = c.combine;
  o.mxfp8_scale_rounding = c.rounding;
  o.timeout_ms = 5'000;
  const auto weights = weights_with_biases(5);
  const harness::QuantizedLayerWeights q =
      harness::quantize_layer_weights(weights, kShape, c.precision, c.rounding);
  Cluster from_bf16(kShape, c.precision, o, c.world, weights);
  Cluster from_codes(kShape, c.precision, o, c.world, weights, Backend::cpu_threads, [&](int rank) {
    return harness::local_quantized_views(q, weights, kShape, rank, c.world, Nvfp4Scale::s_enc,
                                          c.mxfp4_4d);
  });
  const auto want = run_rounds(from_bf16, 9);
  EXPECT_EQ(run_rounds(from_codes, 9), want);
  EXPECT_EQ(from_codes.layer(0).resident_weight_bytes(),
            from_bf16.layer(0).resident_weight_bytes());
  // And the check can fail: other weights' codes give other bits.
  const harness::QuantizedLayerWeights other =
      harness::quantize_layer_weights(weights_with_biases(6), kShape, c.precision, c.rounding);
  Cluster from_other(kShape, c.precision, o, c.world, weights, Backend::cpu_threads, [&](int rank) {
    return harness::local_quantized_views(other, weights, kShape, rank, c.world);
  });
  EXPECT_NE(run_rounds(from_other, 9), want);
}

INSTANTIATE_TEST_SUITE_P(
    EveryPrecisionAndCombine, PrequantizedHostLayer,
    ::testing::Values(Case{Precision::mxfp8, Combine::staged, 2},
                      Case{Precision::nvfp4, Combine::staged, 2},
                      Case{Precision::fp8_block128, Combine::staged, 2},
                      Case{Precision::mxfp4, Combine::staged, 2},
                      Case{Precision::mxfp8, Combine::in_kernel_reduce, 1},
                      Case{Precision::nvfp4, Combine::in_kernel_reduce, 1},
                      Case{Precision::fp8_block128, Combine::in_kernel_reduce, 1},
                      Case{Precision::mxfp4, Combine::in_kernel_reduce, 1},
                      Case{Precision::mxfp8, Combine::staged, 2, ScaleRounding::ocp_floor},
                      Case{Precision::mxfp4, Combine::staged, 1, ScaleRounding::ocp_floor, true}),
    [](const auto& param_info) {
      const Case& c = param_info.param;
      return std::string(to_string(c.precision)) + "_" + to_string(c.combine) + "_world" +
             std::to_string(c.world) + "_" + to_string(c.rounding) + (c.mxfp4_4d ? "_4d" : "");
    });

// ModelOpt's NVFP4 (global_scale = weight_scale_2, a decode multiplier): every value is
// (e2m1 * block_scale) * global_scale, one fp32 product, whatever the global scale.
TEST(PrequantizedNvfp4, GlobalScaleDecodesAsCodeTimesBlockScaleTimesGlobal) {
  const auto weights = harness::make_random_weights(kShape, 3);
  const auto q =
      harness::quantize_layer_weights(weights, kShape, Precision::nvfp4, ScaleRounding::rceil);
  const LayerConfig config = make_config(kShape, Precision::nvfp4, 0, 1, LayerOptions{});
  const ExpertWeights w =
      harness::local_quantized_views(q, weights, kShape, 0, 1, Nvfp4Scale::global_scale);
  const math::EmulatedExperts got = math::emulate_expert_weights(config, w);
  for (const auto& [fc, values, s_enc] :
       {std::tuple{&q.w13, &got.w13, &got.w13_s_enc}, std::tuple{&q.w2, &got.w2, &got.w2_s_enc}}) {
    const auto matrix = static_cast<std::size_t>(fc->rows * fc->cols);
    for (std::size_t i = 0; i < values->size(); ++i) {
      const std::size_t e = i / matrix;
      const std::uint8_t nibble = (fc->codes[i / 2] >> (4 * (i % 2))) & 0xf;
      const float want = formats::e2m1_to_float(nibble) *
                         formats::e4m3_to_float(fc->u8_scales[i / 16]) * fc->global_scale[e];
      ASSERT_EQ(formats::float_bits((*values)[i]), formats::float_bits(want)) << "element " << i;
    }
    for (std::size_t e = 0; e < s_enc->size(); ++e)
      EXPECT_EQ((*s_enc)[e], 1.0f / fc->global_scale[e]) << "the tensor-core operand scale";
  }
}

// With a power-of-two s_enc, multiplying by its reciprocal is dividing by it: the two
// conventions give the same layer, bit for bit.
TEST(PrequantizedNvfp4, PowerOfTwoGlobalScaleGivesTheSameBitsAsItsSEnc) {
  const auto weights = weights_with_biases(7);
  const auto q = harness::quantize_layer_weights(weights, kShape, Precision::nvfp4,
                                                 ScaleRounding::rceil, 1024.0f);
  LayerOptions o;
  o.timeout_ms = 5'000;
  const auto layer_with = [&](Nvfp4Scale scale) {
    return std::make_unique<Cluster>(
        kShape, Precision::nvfp4, o, 2, weights, Backend::cpu_threads, [&](int rank) {
          return harness::local_quantized_views(q, weights, kShape, rank, 2, scale);
        });
  };
  const auto by_s_enc = layer_with(Nvfp4Scale::s_enc);
  const auto by_global = layer_with(Nvfp4Scale::global_scale);
  EXPECT_EQ(run_rounds(*by_global, 4), run_rounds(*by_s_enc, 4));
}

// One FC given pre-quantized, the other as values: each FC is prepared on its own.
TEST(PrequantizedHostLayer, OneFcPrequantizedTheOtherAsValues) {
  const auto weights = weights_with_biases(8);
  const auto q =
      harness::quantize_layer_weights(weights, kShape, Precision::mxfp8, ScaleRounding::rceil);
  LayerOptions o;
  o.timeout_ms = 5'000;
  Cluster from_bf16(kShape, Precision::mxfp8, o, 2, weights);
  Cluster mixed(kShape, Precision::mxfp8, o, 2, weights, Backend::cpu_threads, [&](int rank) {
    ExpertWeights w = harness::local_quantized_views(q, weights, kShape, rank, 2);
    w.w2 = local_weight_views(weights, kShape, rank, 2).w2;
    w.w2_quantized = QuantizedMatrices{};
    return w;
  });
  EXPECT_EQ(run_rounds(mixed, 2), run_rounds(from_bf16, 2));
}

// docs/formats.md "Pre-quantized expert weights", worked examples: one expert of a w2 [200, 2880].
TEST(PrequantizedFormats, WorkedExamplesOfFormatsMd) {
  constexpr std::int64_t kN = 200, kK = 2880;
  float v[formats::kWeightBlock];
  const auto decode = [&](Precision p, const std::vector<std::uint8_t>& codes, const void* scales,
                          const float* global, bool is_s_enc, std::int64_t at) {
    const formats::QuantizedMatrixData q{p, codes.data(), scales, global, is_s_enc, kN, kK};
    return formats::decode_weight_block(q, 0, at, v);
  };
  {  // mxfp8: row 3's first block, scale 125 (2^-2)
    std::vector<std::uint8_t> codes(kN * kK), scales(kN * kK / 32);
    codes[3 * kK + 0] = 0x38;
    codes[3 * kK + 1] = 0xb8;
    codes[3 * kK + 2] = 0x7e;
    codes[3 * kK + 3] = 0x01;
    scales[3 * kK / 32] = 125;
    decode(Precision::mxfp8, codes, scales.data(), nullptr, false, 3 * kK);
    EXPECT_EQ(v[0], 0.25f);
    EXPECT_EQ(v[1], -0.25f);
    EXPECT_EQ(v[2], 112.0f);
    EXPECT_EQ(v[3], std::ldexp(1.0f, -11));
  }
  {  // nvfp4: byte f7, block scale 76 (224); s_enc 448 or ModelOpt's global_scale fl(1/448)
    std::vector<std::uint8_t> codes(kN * kK / 2), scales(kN * kK / 16);
    codes[0] = 0xf7;
    scales[0] = 0x76;
    const float s_enc = 448.0f, global = 1.0f / 448.0f;
    EXPECT_EQ(formats::float_bits(global), 0x3b124925u);
    EXPECT_EQ(decode(Precision::nvfp4, codes, scales.data(), &s_enc, true, 0), 448.0f);
    EXPECT_EQ(v[0], 3.0f);
    EXPECT_EQ(v[1], -3.0f);
    EXPECT_EQ(decode(Precision::nvfp4, codes, scales.data(), &global, false, 0), 1.0f / global);
    EXPECT_EQ(v[0], 3.0000002f);
    EXPECT_EQ(v[0], std::nextafter(3.0f, 4.0f));
    EXPECT_EQ(v[1], -3.0000002f);
  }
  {  // fp8_block128: element (150, 2850) in tile (1, 22) of scales [2, 23]
    std::vector<std::uint8_t> codes(kN * kK);
    std::vector<float> scales(2 * 23);
    scales[1 * 23 + 22] = 10.0f / 448.0f;
    EXPECT_EQ(formats::float_bits(scales[1 * 23 + 22]), 0x3cb6db6eu);
    codes[150 * kK + 2848] = 0x7e;
    codes[150 * kK + 2850] = 0x63;
    decode(Precision::fp8_block128, codes, scales.data(), nullptr, false, 150 * kK + 2848);
    EXPECT_EQ(v[0], 10.0f);
    EXPECT_EQ(v[2], 0.98214287f);
  }
  {  // mxfp4: blocks[0, 0, 0, 0] = 96 under scale 128 (2^1); element 32 in blocks[0, 0, 1, 0]
    std::vector<std::uint8_t> codes(kN * kK / 2), scales(kN * kK / 32);
    codes[0] = 0x96;
    scales[0] = 128;
    codes[16] = 0x02;
    scales[1] = 127;
    decode(Precision::mxfp4, codes, scales.data(), nullptr, false, 0);
    EXPECT_EQ(v[0], 8.0f);
    EXPECT_EQ(v[1], -1.0f);
    decode(Precision::mxfp4, codes, scales.data(), nullptr, false, 32);
    EXPECT_EQ(v[0], 1.0f);
  }
}

// ---- bad pre-quantized tensors are named (docs/errors.md) ----

std::string creation_error(Precision precision, const std::function<void(ExpertWeights&)>& edit) {
  const auto weights = harness::make_random_weights(kShape, 1);
  const harness::QuantizedLayerWeights q = harness::quantize_layer_weights(
      weights, kShape, precision == Precision::bf16 ? Precision::mxfp8 : precision,
      ScaleRounding::rceil);
  auto group = make_host_group(1);
  auto comm = make_host_communicator(group, 0);
  ExpertWeights w = harness::local_quantized_views(q, weights, kShape, 0, 1);
  edit(w);
  try {
    LayerOptions o;
    o.timeout_ms = 5'000;
    Layer layer(*comm, make_config(kShape, precision, 0, 1, o), w);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    return e.what();
  }
  return "accepted";
}

TEST(BadPrequantizedWeights, EachBadTensorIsNamed) {
  EXPECT_EQ(creation_error(Precision::mxfp8, [](ExpertWeights&) {}), "accepted");
  EXPECT_EQ(creation_error(Precision::mxfp8,
                           [](ExpertWeights& w) { w.w13_quantized.codes.dtype = DType::bf16; }),
            "Layer: weights.w13_quantized.codes has dtype bf16, expected u8 (mxfp8: E4M3 codes)");
  EXPECT_EQ(creation_error(Precision::mxfp8,
                           [](ExpertWeights& w) {
                             w.w2_quantized.scales.shape = {8, 192, 2};
                           }),
            "Layer: weights.w2_quantized.scales has shape [8, 192, 2], expected [8, 192, 4] "
            "(mxfp8: E8M0 scales, one per 32 along K)");
  EXPECT_EQ(creation_error(Precision::nvfp4,
                           [](ExpertWeights& w) {
                             w.w13_quantized.codes.shape = {8, 256, 192};
                           }),
            "Layer: weights.w13_quantized.codes has shape [8, 256, 192], expected [8, 256, 96] "
            "(nvfp4: E2M1 pairs, element 2j in the low nibble)");
  EXPECT_EQ(creation_error(Precision::nvfp4,
                           [](ExpertWeights& w) {
                             w.w13_quantized.scales.shape = {8, 256, 6};
                           }),
            "Layer: weights.w13_quantized.scales has shape [8, 256, 6], expected [8, 256, 12] "
            "(nvfp4: E4M3 block scales, one per 16 along K)");
  EXPECT_EQ(creation_error(Precision::nvfp4,
                           [](ExpertWeights& w) { w.w2_quantized.s_enc = TensorView{}; }),
            "Layer: weights.w2_quantized needs exactly one of global_scale (ModelOpt's "
            "weight_scale_2: value = e2m1 * scale * global_scale) and s_enc (value = e2m1 * scale "
            "/ s_enc), f32 [8]");
  EXPECT_EQ(
      creation_error(Precision::nvfp4,
                     [](ExpertWeights& w) { w.w2_quantized.global_scale = w.w2_quantized.s_enc; }),
      "Layer: weights.w2_quantized needs exactly one of global_scale (ModelOpt's "
      "weight_scale_2: value = e2m1 * scale * global_scale) and s_enc (value = e2m1 * scale "
      "/ s_enc), f32 [8]");
  EXPECT_EQ(creation_error(Precision::nvfp4,
                           [](ExpertWeights& w) {
                             w.w13_quantized.s_enc.shape = {8, 2};
                           }),
            "Layer: weights.w13_quantized.s_enc has shape [8, 2], expected [8] (nvfp4: one encode "
            "scale per matrix)");
  EXPECT_EQ(creation_error(Precision::fp8_block128,
                           [](ExpertWeights& w) { w.w13_quantized.scales.dtype = DType::u8; }),
            "Layer: weights.w13_quantized.scales has dtype u8, expected f32 (fp8_block128: "
            "weight_scale_inv, one per 128 x 128 tile)");
  EXPECT_EQ(creation_error(Precision::fp8_block128,
                           [](ExpertWeights& w) {
                             w.w2_quantized.scales.shape = {8, 2, 2};
                           }),
            "Layer: weights.w2_quantized.scales has shape [8, 2, 2], expected [8, 2, 1] "
            "(fp8_block128: weight_scale_inv, one per 128 x 128 tile)");
  EXPECT_EQ(creation_error(Precision::mxfp4,
                           [](ExpertWeights& w) {
                             w.w2_quantized.codes.shape = {8, 192, 4, 8};
                           }),
            "Layer: weights.w2_quantized.codes has shape [8, 192, 4, 8], expected [8, 192, 4, 16] "
            "(mxfp4: E2M1 pairs, element 2j in the low nibble: [E, N, K/2] or [E, N, K/32, 16])");
  EXPECT_EQ(creation_error(Precision::mxfp4,
                           [](ExpertWeights& w) { w.w13_quantized.codes.data = nullptr; }),
            "Layer: weights.w13_quantized.codes has a null data pointer");
  EXPECT_EQ(creation_error(Precision::mxfp4,
                           [](ExpertWeights& w) {
                             w.w13_quantized.scales.strides = {256 * 6, 1, 256};
                           }),
            "Layer: weights.w13_quantized.scales is not contiguous (strides [1536, 1, 256]); pass "
            "a contiguous row-major tensor");
  EXPECT_EQ(creation_error(
                Precision::mxfp8,
                [](ExpertWeights& w) { w.w13_quantized.global_scale = view(&w, DType::f32, {8}); }),
            "Layer: weights.w13_quantized.global_scale is given, but precision=mxfp8 has no "
            "per-matrix scale (only nvfp4 does)");
  EXPECT_EQ(
      creation_error(Precision::mxfp8, [](ExpertWeights& w) { w.w13 = w.w13_quantized.codes; }),
      "Layer: weights.w13 and weights.w13_quantized are both given; pass one: values to "
      "quantize, or codes already in precision=mxfp8");
  EXPECT_EQ(creation_error(Precision::bf16, [](ExpertWeights&) {}),
            "Layer: weights.w13_quantized is given, but precision=bf16 has no codes: pass bf16 or "
            "f32 values as weights.w13");
}

}  // namespace
}  // namespace epmoe
