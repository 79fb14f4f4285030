#include "harness/reference_rows.hpp"

#include <algorithm>

#include "harness/rank_threads.hpp"

namespace epmoe::harness {
namespace {

// Tokens [first, last) of `batch`.
reference::Batch token_range(const reference::Batch& batch, const LayerShape& shape,
                             std::int64_t first, std::int64_t last) {
  const auto h = static_cast<std::ptrdiff_t>(shape.hidden);
  const auto k = static_cast<std::ptrdiff_t>(shape.top_k);
  const auto f = static_cast<std::ptrdiff_t>(first), l = static_cast<std::ptrdiff_t>(last);
  reference::Batch b;
  b.tokens = last - first;
  b.x.assign(batch.x.begin() + f * h, batch.x.begin() + l * h);
  b.topk_ids.assign(batch.topk_ids.begin() + f * k, batch.topk_ids.begin() + l * k);
  b.topk_weights.assign(batch.topk_weights.begin() + f * k, batch.topk_weights.begin() + l * k);
  return b;
}

}  // namespace

reference::Batch first_tokens(const reference::Batch& batch, const LayerShape& shape,
                              std::int64_t tokens) {
  return token_range(batch, shape, 0, std::clamp<std::int64_t>(tokens, 0, batch.tokens));
}

ReferenceOutputs reference_outputs(reference::ReferenceModel& model, const reference::Batch& batch,
                                   const LayerShape& shape, bool with_exact, unsigned threads) {
  const std::int64_t tokens = batch.tokens;
  const auto h = static_cast<std::ptrdiff_t>(shape.hidden);
  const int parts = static_cast<int>(std::clamp<std::int64_t>(static_cast<std::int64_t>(threads), 1,
                                                              std::max<std::int64_t>(tokens, 1)));
  ReferenceOutputs out;
  out.emulated.resize(static_cast<std::size_t>(tokens * shape.hidden));
  if (with_exact) out.exact.resize(out.emulated.size());
  run_on_rank_threads(parts, [&](int part) {
    const std::int64_t first = tokens * part / parts, last = tokens * (part + 1) / parts;
    const reference::Batch run = token_range(batch, shape, first, last);
    const auto at = static_cast<std::ptrdiff_t>(first) * h;
    const auto y = model.forward(run);
    std::copy(y.begin(), y.end(), out.emulated.begin() + at);
    if (with_exact) {
      const auto exact = model.forward_exact(run);
      std::copy(exact.begin(), exact.end(), out.exact.begin() + at);
    }
  });
  return out;
}

std::int64_t tokens_within(const LayerShape& shape, std::int64_t tokens, double budget) {
  const double per_token = 3.0 * static_cast<double>(shape.top_k * shape.hidden) *
                           static_cast<double>(shape.intermediate);
  const auto fit = static_cast<std::int64_t>(budget / per_token);
  return std::min(tokens, std::max<std::int64_t>(fit, 1));
}

}  // namespace epmoe::harness
