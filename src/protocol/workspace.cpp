#include "protocol/workspace.hpp"

#include "epmoe/config.hpp"
#include "protocol/wire.hpp"

namespace epmoe::protocol {
namespace {

// Moves a cursor through the window so the layout follows code order.
struct Cursor {
  std::size_t offset = 0;
  std::size_t take(std::size_t bytes, std::size_t alignment = 16) {
    offset = (offset + alignment - 1) / alignment * alignment;
    const std::size_t at = offset;
    offset += bytes;
    return at;
  }
};

}  // namespace

WorkspaceLayout make_workspace_layout(const LayerConfig& config) {
  const LayerShape& s = config.shape();
  const auto world = static_cast<std::size_t>(config.world());
  const auto tokens = static_cast<std::size_t>(s.max_tokens_per_rank);
  WorkspaceLayout l;
  l.world = config.world();
  l.max_tokens = s.max_tokens_per_rank;
  Cursor c;
  l.count_inbox = c.take(8 * world);
  l.done_inbox = c.take(8 * world);
  l.abort_word = c.take(8);
  l.reset_inbox = c.take(8 * world);
  l.row_bytes = wire_row_bytes(config.precision(), s.hidden, s.top_k);
  l.recv_rows = c.take(2 * world * tokens * l.row_bytes, kWindowAlignment);
  const bool staged = config.options().combine == Combine::staged;
  const auto h = static_cast<std::size_t>(s.hidden);
  l.combine_row_bytes = staged ? 2 * h : 4 * h;
  const std::size_t combine_rows = staged ? tokens * static_cast<std::size_t>(s.top_k) : tokens;
  l.combine = c.take(combine_rows * l.combine_row_bytes, kWindowAlignment);
  l.total = (c.offset + kWindowAlignment - 1) / kWindowAlignment * kWindowAlignment;
  return l;
}

}  // namespace epmoe::protocol

namespace epmoe {
std::size_t LayerConfig::workspace_bytes() const {
  return protocol::make_workspace_layout(*this).total;
}
}  // namespace epmoe
