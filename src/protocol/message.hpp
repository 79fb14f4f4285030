// The words ranks write into each other's symmetric windows (docs/design.md §3).
//
// An inbox word carries (round, value) in one 64-bit store so that a reader never sees a value
// without the round it belongs to. Rounds count modulo 2^32: comparisons use the distance from
// the expected round, so a layer may run forever.
#pragma once

#include <cstdint>

#include "formats/codec.hpp"  // EPMOE_HD

namespace epmoe::protocol {

// ---- count / done inbox words: round in the high half, value in the low half. ----
EPMOE_HD std::uint64_t pack_inbox(std::uint32_t round, std::uint32_t value) {
  return (std::uint64_t{round} << 32) | value;
}
EPMOE_HD std::uint32_t inbox_round(std::uint64_t word) {
  return static_cast<std::uint32_t>(word >> 32);
}
EPMOE_HD std::uint32_t inbox_value(std::uint64_t word) {
  return static_cast<std::uint32_t>(word & 0xffffffffu);
}

// Rounds start at 1 after creation and after reset(); every inbox starts at 0 == "round 0 done".
inline constexpr std::uint32_t kFirstRound = 1;

// How far `observed` is from the round a waiter needs: 0 = there, 1 = one behind (keep waiting),
// anything else breaks I2 (ranks drift at most one round apart) and is a protocol violation.
EPMOE_HD std::uint32_t rounds_behind(std::uint32_t observed, std::uint32_t expected) {
  return expected - observed;  // modulo 2^32 on purpose
}

// ---- abort word: zero while healthy; otherwise who gave up, on whom, where and when. ----
// bit 63: valid | bits 56..62: phase | bits 44..55: reporter | bits 32..43: culprit | 0..31: round
// The culprit is the peer the reporter waited for (kUnknownRank when none), so every survivor can
// name the rank that broke the round, not just the first rank that noticed.
inline constexpr std::uint32_t kUnknownRank = 0xfffu;

struct AbortRecord {
  std::uint32_t reporter = 0;
  std::uint32_t culprit = kUnknownRank;
  std::uint32_t phase = 0;
  std::uint32_t round = 0;
};

EPMOE_HD std::uint64_t pack_abort(const AbortRecord& a) {
  return (std::uint64_t{1} << 63) | (std::uint64_t{a.phase & 0x7fu} << 56) |
         (std::uint64_t{a.reporter & 0xfffu} << 44) | (std::uint64_t{a.culprit & 0xfffu} << 32) |
         a.round;
}
EPMOE_HD bool abort_raised(std::uint64_t word) {
  return (word >> 63) != 0;
}
EPMOE_HD AbortRecord unpack_abort(std::uint64_t word) {
  AbortRecord a;
  a.phase = static_cast<std::uint32_t>((word >> 56) & 0x7fu);
  a.reporter = static_cast<std::uint32_t>((word >> 44) & 0xfffu);
  a.culprit = static_cast<std::uint32_t>((word >> 32) & 0xfffu);
  a.round = static_cast<std::uint32_t>(word & 0xffffffffu);
  return a;
}

}  // namespace epmoe::protocol
