// The wire rules both executors call (src/protocol/wire.hpp): which received rows may be computed
// on.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <vector>

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

}  // namespace
}  // namespace epmoe::protocol
