// The wire rules both executors call (src/protocol/wire.hpp, token_back.hpp): which received rows
// may be computed on, how a result is sent home, and the staged sum on the home rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "formats/codec.hpp"
#include "protocol/token_back.hpp"
#include "protocol/wire.hpp"

namespace epmoe::protocol {
namespace {

constexpr RowLimits kLimits{.max_tokens = 8, .top_k = 4, .local_experts = 3};
constexpr std::uint32_t kRound = 7;

TEST(ReceivedRowValid, AcceptsARowOfThisRoundWithinEveryLimit) {
  const WireRowHeader header{7, 2, 1.0f, kRound};
  const WireEntry entries[] = {{0, 0, 0.5f}, {3, 2, 0.5f}};
  EXPECT_TRUE(received_row_valid(header, entries, kRound, kLimits));
}

TEST(ReceivedRowValid, RejectsEachImpossibleHeaderFieldWithoutReadingTheEntries) {
  const WireRowHeader good{0, 1, 1.0f, kRound};
  const std::vector<std::function<void(WireRowHeader&)>> breaks = {
      [](WireRowHeader& h) { h.round = kRound - 1; },  // last round's row (I2)
      [](WireRowHeader& h) { h.round = kRound + 1; },
      [](WireRowHeader& h) { h.token = -1; },
      [](WireRowHeader& h) { h.token = kLimits.max_tokens; },
      [](WireRowHeader& h) { h.num_entries = 0; },
      [](WireRowHeader& h) { h.num_entries = kLimits.top_k + 1; },
  };
  for (std::size_t i = 0; i < breaks.size(); ++i) {
    WireRowHeader header = good;
    breaks[i](header);
    EXPECT_FALSE(received_row_valid(header, nullptr, kRound, kLimits)) << "break " << i;
  }
}

TEST(ReceivedRowValid, RejectsAnEntryNamingASlotOrExpertThatCannotExist) {
  const WireRowHeader header{1, 2, 1.0f, kRound};
  for (const WireEntry bad : {WireEntry{-1, 0, 1.0f}, WireEntry{4, 0, 1.0f}, WireEntry{0, -1, 1.0f},
                              WireEntry{0, 3, 1.0f}}) {
    const WireEntry entries[] = {{0, 0, 1.0f}, bad};  // the second entry is the bad one
    EXPECT_FALSE(received_row_valid(header, entries, kRound, kLimits))
        << "slot " << bad.slot << " expert " << bad.local_expert;
  }
}

// The payload of one row of each precision (wire.hpp), and the row stays a multiple of 16 bytes
// (dispatch copies it with 16-byte stores) with its payload 16-byte aligned.
TEST(WireRowBytes, PayloadOfEachPrecisionIsItsDocumentedSize) {
  EXPECT_EQ(wire_payload_bytes(Precision::bf16, 7168), 2u * 7168);
  EXPECT_EQ(wire_payload_bytes(Precision::mxfp8, 7168), 7168u + 224);
  EXPECT_EQ(wire_payload_bytes(Precision::nvfp4, 7168), 3584u + 448);
  // fp8_block128: E4M3 elements, then one fp32 scale per 1 x 128 run (the last one may be 64).
  EXPECT_EQ(wire_payload_bytes(Precision::fp8_block128, 7168), 7168u + 4 * 56);
  EXPECT_EQ(wire_payload_bytes(Precision::fp8_block128, 2880), 2880u + 4 * 23);
  EXPECT_EQ(wire_payload_bytes(Precision::fp8_block128, 64), 64u + 4);
  // mxfp4: the activations are MXFP8.
  EXPECT_EQ(activation_format(Precision::mxfp4), Precision::mxfp8);
  for (std::int64_t h : {64, 2880, 7168})
    EXPECT_EQ(wire_payload_bytes(Precision::mxfp4, h), wire_payload_bytes(Precision::mxfp8, h));
  for (Precision p : {Precision::bf16, Precision::mxfp8, Precision::nvfp4, Precision::fp8_block128})
    EXPECT_EQ(activation_format(p), p);
  for (Precision p : {Precision::bf16, Precision::mxfp8, Precision::nvfp4, Precision::fp8_block128,
                      Precision::mxfp4})
    for (std::int64_t h : {64, 192, 2880, 7168})
      for (std::int64_t k : {1, 8, 16}) {
        EXPECT_EQ(wire_row_bytes(p, h, k) % 16, 0u) << to_string(p) << " H=" << h;
        EXPECT_EQ(wire_payload_offset(k) % 16, 0u);
        EXPECT_GE(wire_row_bytes(p, h, k), wire_payload_offset(k) + wire_payload_bytes(p, h));
      }
}

// A combine buffer of 2 tokens x 3 slots x 4 columns (staged) or 2 tokens x 4 columns.
struct Buffer {
  explicit Buffer(Combine mode)
      : bytes(2 * 3 * 4 * 4), combine{bytes.data(), mode == Combine::staged ? 8u : 16u, 3, mode} {}
  std::vector<std::uint8_t> bytes;
  CombineBuffer combine;
};

TEST(SendHome, StagedStoresTheBf16ResultIntoTheTokensSlotRow) {
  Buffer b(Combine::staged);
  const HomeSlot to = home_slot(0, WireRowHeader{1, 1, 1.0f, kRound}, WireEntry{2, 0, 0.25f});
  send_home(b.combine, to, 3, 1.00390625f);  // 1 + 2^-8: a tie, rounds to even (1.0)
  EXPECT_EQ(b.combine.staged_row(1, 2)[3], formats::float_to_bf16(1.0f));
  EXPECT_EQ(b.combine.staged_row(1, 2)[2], 0u);
  EXPECT_EQ(b.combine.staged_row(1, 1)[3], 0u);
}

TEST(SendHome, InKernelReduceAddsWeightTimesResultIntoTheTokensAccumulator) {
  Buffer b(Combine::in_kernel_reduce);
  const HomeSlot to{0, 1, 2, 0.5f};
  send_home(b.combine, to, 3, 6.0f);
  send_home(b.combine, HomeSlot{0, 1, 0, 2.0f}, 3, 1.0f);
  EXPECT_EQ(b.combine.accumulator_row(1)[3], 5.0f);
  EXPECT_EQ(b.combine.accumulator_row(0)[3], 0.0f);
}

TEST(SendHome, TwoOrFourColumnsAtOnceStoreWhatSingleSendsStore) {
  const float values[4] = {1.00390625f, -3.5f, 0.1f, 65504.0f};
  for (const Combine mode : {Combine::staged, Combine::in_kernel_reduce}) {
    const char* name = mode == Combine::staged ? "staged" : "in_kernel_reduce";
    Buffer one(mode), four(mode), two(mode);
    const HomeSlot to{0, 1, 2, 0.75f};
    for (int i = 0; i < 4; ++i) send_home(one.combine, to, i, values[i]);
    send_home_n<4>(four.combine, to, 0, values);
    EXPECT_EQ(one.bytes, four.bytes) << name;
    const float low[2] = {values[0], values[1]}, high[2] = {values[2], values[3]};
    send_home_n<2>(two.combine, to, 1, high);  // columns 2, 3
    send_home_n<2>(two.combine, to, 0, low);
    EXPECT_EQ(one.bytes, two.bytes) << name;
  }
}

TEST(CombinedOutput, StagedSumsRoutedSlotsInSlotOrderRoundingEveryStep) {
  Buffer b(Combine::staged);
  // Every slot's row holds 1.0; in slot order 2^25 + 1 rounds back to 2^25 and -2^25 then gives
  // exactly 0, where any other order (or a wider sum) gives 1.
  for (std::int64_t k = 0; k < 3; ++k) b.combine.staged_row(1, k)[0] = formats::float_to_bf16(1.0f);
  const float weights[] = {0, 0, 0, 33554432.0f, 1.0f, -33554432.0f};
  const auto all = [](std::int64_t) { return true; };
  EXPECT_EQ(combined_output(b.combine, weights, 1, 0, all), formats::float_to_bf16(0.0f));
  // Slot 2 unrouted (its id is -1): 2^25 + 1 rounds to 2^25, and nothing takes it back.
  const auto not_slot_2 = [](std::int64_t k) { return k != 2; };
  EXPECT_EQ(combined_output(b.combine, weights, 1, 0, not_slot_2),
            formats::float_to_bf16(33554432.0f));
}

// combined_outputs reads a token's slots a few at a time (four) before summing them: with top_k 6
// the sum still runs in slot order across that grouping, eight columns at once as single columns,
// and an unrouted slot's stale row (NaN here) is read and never summed.
TEST(CombinedOutput, SlotsBeyondTheFirstFewAreSummedInSlotOrderAndAStaleRowNever) {
  constexpr std::int64_t kTopK = 6;
  constexpr std::size_t kRowBytes = 8 * 2;  // 8 bf16 columns
  std::vector<std::uint8_t> bytes(2 * kTopK * kRowBytes);
  const CombineBuffer c{bytes.data(), kRowBytes, kTopK, Combine::staged};
  for (std::int64_t k = 0; k < kTopK; ++k)
    for (int col = 0; col < 8; ++col) c.staged_row(1, k)[col] = formats::float_to_bf16(1.0f);
  for (int col = 0; col < 8; ++col) c.staged_row(1, 4)[col] = 0x7FC0u;  // NaN
  // slots 3 and 5 straddle the first group of four: 2^25, then - 2^25 (slot 4 unrouted between)
  const float weights[2 * kTopK] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 33554432.0f, 1.0f, -33554432.0f};
  const auto routed_but_4 = [](std::int64_t k) { return k != 4; };
  std::uint16_t out[8];
  combined_outputs<8>(c, weights, 1, 0, routed_but_4, out);
  for (int col = 0; col < 8; ++col) {
    EXPECT_EQ(out[col], formats::float_to_bf16(0.0f)) << col;
    EXPECT_EQ(combined_output(c, weights, 1, col, routed_but_4), out[col]) << col;
  }
  // with slot 4 routed its row is summed: NaN
  EXPECT_TRUE(std::isnan(formats::bf16_to_float(
      combined_output(c, weights, 1, 0, [](std::int64_t) { return true; }))));
  // the first group alone: 2^25, which slot 5 in the second group took back above
  EXPECT_EQ(combined_output(c, weights, 1, 0, [](std::int64_t k) { return k < 4; }),
            formats::float_to_bf16(33554432.0f));
}

TEST(CombinedOutput, InKernelReduceRoundsTheAccumulatorToBf16) {
  Buffer b(Combine::in_kernel_reduce);
  b.combine.accumulator_row(1)[2] = 1.00390625f;
  const float weights[6] = {};
  EXPECT_EQ(combined_output(b.combine, weights, 1, 2, [](std::int64_t) { return true; }),
            formats::float_to_bf16(1.0f));
}

}  // namespace
}  // namespace epmoe::protocol
