// One token's row as it crosses to an expert owner (docs/design.md §4 dispatch): the token is sent
// once per destination rank and carries every (top-k slot, local expert, weight) it has there.
//
//   WireRowHeader                16 B   source token, number of entries, NVFP4 row scale, round
//   WireEntry[top_k]              8 B each, padded to 16 B
//   payload                       bf16: 2H B | mxfp8: H B elements + H/32 B E8M0 scales
//                                 nvfp4: H/2 B packed E2M1 + H/16 B E4M3 block scales
//                                 fp8_block128: H B E4M3 + ceil(H/128) fp32 scales (1 x 128 runs;
//                                   at offset H, a multiple of 64, so 4-byte aligned)
//                                 mxfp4: the MXFP8 payload (an mxfp4 layer's activations are
//                                   MXFP8: activation_format)
//                                 padded to 16 B
#pragma once

#include <cstddef>
#include <cstdint>

#include "epmoe/config.hpp"
#include "formats/codec.hpp"

namespace epmoe::protocol {

struct WireRowHeader {
  std::int32_t token;        // row index on the home (source) rank
  std::int32_t num_entries;  // how many of the entries below are valid (>= 1)
  float row_scale;           // NVFP4 second-level scale s_enc of this row; 1 otherwise
  std::uint32_t round;       // the round that wrote the row: readers check it is theirs
};
static_assert(sizeof(WireRowHeader) == 16);

struct WireEntry {
  std::int16_t slot;          // top-k slot on the home rank, for the combine
  std::int16_t local_expert;  // expert index on the receiving rank
  float weight;               // router weight (used by in-kernel reduce)
};
static_assert(sizeof(WireEntry) == 8);

EPMOE_HD constexpr std::size_t align16(std::size_t n) {
  return (n + 15) / 16 * 16;
}

// The format of a layer's activations (its wire rows and FC2's input): the layer's precision, but
// for mxfp4, whose weights are MXFP4 and whose activations are MXFP8 (docs/formats.md says why).
EPMOE_HD constexpr Precision activation_format(Precision p) {
  return p == Precision::mxfp4 ? Precision::mxfp8 : p;
}

// Bytes of one activation row of `hidden` values in the layer precision `p` (its
// activation_format).
EPMOE_HD constexpr std::size_t wire_payload_bytes(Precision p, std::int64_t hidden) {
  const auto h = static_cast<std::size_t>(hidden);
  switch (activation_format(p)) {
    case Precision::bf16:
      return 2 * h;
    case Precision::mxfp8:
      return h + h / formats::kMxfp8Block;
    case Precision::nvfp4:
      return h / 2 + h / formats::kNvfp4Block;
    case Precision::fp8_block128:
      return static_cast<std::size_t>(formats::fp8_block128_row_bytes(hidden));
    case Precision::mxfp4:  // activation_format: never an activation format
      break;
  }
  return 0;
}
EPMOE_HD constexpr std::size_t wire_entries_offset() {
  return sizeof(WireRowHeader);
}
EPMOE_HD constexpr std::size_t wire_payload_offset(std::int64_t top_k) {
  return align16(sizeof(WireRowHeader) + sizeof(WireEntry) * static_cast<std::size_t>(top_k));
}
EPMOE_HD constexpr std::size_t wire_row_bytes(Precision p, std::int64_t hidden,
                                              std::int64_t top_k) {
  return wire_payload_offset(top_k) + align16(wire_payload_bytes(p, hidden));
}

// What a receiver checks every row against before it computes on it (docs/design.md §3 I4).
struct RowLimits {
  std::int64_t max_tokens;     // tokens a rank can have: a row's token is below it
  std::int64_t top_k;          // entries a row can carry, and top-k slots a token has
  std::int64_t local_experts;  // experts of the receiving rank
};

// I4: a received row is this round's, names a token its home rank can have, carries 1..top_k
// entries, and each entry names a top-k slot and an expert of the receiving rank. Anything else is
// a protocol violation by the row's writer: reported, never computed on. `entries` is read only
// once the header is found valid. (A count above max_tokens is caught before any row is read:
// RoundSession::await_counts.)
EPMOE_HD bool received_row_valid(const WireRowHeader& header, const WireEntry* entries,
                                 std::uint32_t round, const RowLimits& limits) {
  if (header.round != round || header.token < 0 || header.token >= limits.max_tokens ||
      header.num_entries < 1 || header.num_entries > limits.top_k)
    return false;
  for (std::int32_t i = 0; i < header.num_entries; ++i) {
    const WireEntry entry = entries[i];
    if (entry.slot < 0 || entry.slot >= limits.top_k || entry.local_expert < 0 ||
        entry.local_expert >= limits.local_experts)
      return false;
  }
  return true;
}

}  // namespace epmoe::protocol
