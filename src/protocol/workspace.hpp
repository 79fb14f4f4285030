// The byte layout of one rank's symmetric window, written in one place (docs/design.md §3).
//
// Every rank registers a window of the same size; peers address each other's windows with the
// offsets below (LSA pointers on the GPU, shared host allocations on the CPU executor).
//
//   control page (4 KiB aligned)
//     count_inbox[world]   u64 (round, rows src sent here)      written by src, read here
//     done_inbox[world]    u64 (round, 0)                        written by src, read here
//     abort                u64 (who gave up, phase, round)       written by anyone, read here
//     reset_inbox[world]   u64 (reset epoch, 0)                  written by src, read here
//   receive rows [2 parity][world src][max_tokens_per_rank]      written by src, read here
//     one WireRow per token that has >= 1 expert on this rank (see wire.hpp)
//   combine buffer
//     staged:           bf16 [max_tokens_per_rank, top_k, hidden]  FC2 rows sent home
//     in_kernel_reduce: f32  [max_tokens_per_rank, hidden]         weighted sum, added remotely
//
// The receive rows are double-buffered by round parity (docs/design.md §3 I2). The combine buffer
// needs no second copy: a peer writes round r+1 results only after this rank published its round
// r+1 count, which it does only after it finished reading round r's results (docs/protocol.md).
#pragma once

#include <cstddef>
#include <cstdint>

#include "formats/codec.hpp"  // EPMOE_HD

namespace epmoe {
class LayerConfig;
}

namespace epmoe::protocol {

inline constexpr std::size_t kWindowAlignment = 4096;  // NCCL_WIN_REQUIRED_ALIGNMENT

struct WorkspaceLayout {
  std::int32_t world = 0;
  std::int64_t max_tokens = 0;
  std::size_t count_inbox = 0;  // offsets in bytes from the window base
  std::size_t done_inbox = 0;
  std::size_t abort_word = 0;
  std::size_t reset_inbox = 0;
  std::size_t recv_rows = 0;
  std::size_t row_bytes = 0;  // one WireRow, 16-byte aligned
  std::size_t combine = 0;
  std::size_t combine_row_bytes = 0;  // staged: one bf16 FC2 row; in-kernel: one f32 row
  std::size_t total = 0;

  EPMOE_HD std::size_t recv_row(std::uint32_t round, int src, std::int64_t row) const {
    const std::size_t parity = round & 1u;
    return recv_rows + ((parity * static_cast<std::size_t>(world) + static_cast<std::size_t>(src)) *
                            static_cast<std::size_t>(max_tokens) +
                        static_cast<std::size_t>(row)) *
                           row_bytes;
  }
  EPMOE_HD std::size_t count_word(int src) const { return count_inbox + 8 * std::size_t(src); }
  EPMOE_HD std::size_t done_word(int src) const { return done_inbox + 8 * std::size_t(src); }
  EPMOE_HD std::size_t reset_word(int src) const { return reset_inbox + 8 * std::size_t(src); }
};

// Slices the window in code order; LayerConfig::workspace_bytes() reports `total`.
WorkspaceLayout make_workspace_layout(const LayerConfig& config);

}  // namespace epmoe::protocol
