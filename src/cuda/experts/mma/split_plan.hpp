// How a decode round's tiles split along K (docs/design.md §4.1, split tiles): how many parts an
// item takes and which slabs each part sums. Plain arithmetic for the host and the device, so the
// CPU tests check its invariants (tests/split_plan_test.cpp); the kernels' side is steps.cuh
// (for_each_item_part) and bf16_mma_tile.cuh (SplitPart, SplitSums).
#pragma once

#include <cstdint>

#include "formats/codec.hpp"  // EPMOE_HD

namespace epmoe::cuda::experts::mma {

inline constexpr std::uint32_t kMaxParts = 4, kMinPartSlabs = 2;

// Parts per work item for a round of `items` items whose K is `slabs` slabs, on a device of `slots`
// CTA slots: as many as keep items x parts within the slots, at most kMaxParts, each part at least
// kMinPartSlabs slabs; 1 (no split) once the items fill more than half of the slots. A function of
// the round and the device only, never of a kernel's grid.
EPMOE_HD std::uint32_t split_parts(std::uint32_t items, std::uint32_t slabs, std::uint32_t slots) {
  std::uint32_t parts = items == 0 ? 1u : slots / items;
  if (parts > kMaxParts) parts = kMaxParts;
  if (parts > slabs / kMinPartSlabs) parts = slabs / kMinPartSlabs;
  return parts < 1u ? 1u : parts;
}

// Slabs [first, first + count) of a K of `slabs` slabs.
struct SlabRange {
  int first, count;
};

// Part `index` of `parts`: contiguous runs in part order that cover every slab once, their
// lengths within one of each other.
EPMOE_HD SlabRange part_slabs(int index, int parts, int slabs) {
  const int first = index * slabs / parts;
  return SlabRange{first, (index + 1) * slabs / parts - first};
}

}  // namespace epmoe::cuda::experts::mma
