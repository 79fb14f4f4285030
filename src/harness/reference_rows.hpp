// The references of a round's tokens on every core, or of a sample of them: what `epmoe run`
// checks a round against. The reference costs K x 3 x H x I multiply-adds per token in float64
// (deepseek-v3: 352 M), twice with the float64 forward, so a whole round of a large model would
// keep the host busy for minutes on one core.
#pragma once

#include <cstdint>
#include <vector>

#include "epmoe/config.hpp"
#include "reference/reference.hpp"

namespace epmoe::harness {

// The first `tokens` rows of `batch`: x, ids and weights.
reference::Batch first_tokens(const reference::Batch& batch, const LayerShape& shape,
                              std::int64_t tokens);

// ReferenceModel::forward of `batch` (and forward_exact when `with_exact`), its tokens split into
// contiguous runs over up to `threads` threads. Each output row depends only on its own token,
// so the outputs equal one call's bit for bit.
struct ReferenceOutputs {
  std::vector<std::uint16_t> emulated;  // [T, H] bf16
  std::vector<double> exact;            // [T, H]; empty unless with_exact
};
ReferenceOutputs reference_outputs(reference::ReferenceModel& model, const reference::Batch& batch,
                                   const LayerShape& shape, bool with_exact, unsigned threads);

// How many of a round's `tokens` the reference checks within `budget` multiply-adds (K x 3 x H x
// I per token): all of them if they fit, else as many as fit, at least one.
std::int64_t tokens_within(const LayerShape& shape, std::int64_t tokens, double budget);

}  // namespace epmoe::harness
