// Token back (docs/design.md §3 steps 5 and 7): how an expert result reaches its token's home rank,
// and how the home rank turns what arrived into y. Written once for both executors: the CPU
// executor calls these from its rank's thread, the CUDA kernels from fc2's epilogue and from
// combine.
//
//   combine buffer of a rank (the last region of its window, workspace.hpp)
//     staged:           bf16 [max_tokens, top_k, hidden]  row [token, slot] written by the owner
//                                                         of that slot's expert
//     in_kernel_reduce: f32  [max_tokens, hidden]         weight x result added by every owner
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "epmoe/config.hpp"
#include "formats/codec.hpp"
#include "protocol/atomics.hpp"
#include "protocol/wire.hpp"
#include "protocol/workspace.hpp"

namespace epmoe::protocol {

// Where the results computed on one (wire row, entry) pair go: the home rank (the row's source),
// the token and top-k slot there, and the router weight.
struct HomeSlot {
  std::int32_t rank;
  std::int32_t token;
  std::int32_t slot;
  float weight;
};

EPMOE_HD HomeSlot home_slot(int src, const WireRowHeader& header, const WireEntry& entry) {
  return HomeSlot{src, header.token, entry.slot, entry.weight};
}

// One rank's combine buffer, addressed the same way by every rank that writes or reads it.
struct CombineBuffer {
  std::uint8_t* base;     // the rank's window + layout.combine
  std::size_t row_bytes;  // layout.combine_row_bytes
  std::int64_t top_k;
  Combine mode;

  EPMOE_HD std::uint16_t* staged_row(std::int64_t token, std::int64_t slot) const {
    return reinterpret_cast<std::uint16_t*>(base + static_cast<std::size_t>(token * top_k + slot) *
                                                       row_bytes);
  }
  EPMOE_HD float* accumulator_row(std::int64_t token) const {
    return reinterpret_cast<float*>(base + static_cast<std::size_t>(token) * row_bytes);
  }
};

EPMOE_HD CombineBuffer combine_buffer(std::uint8_t* window, const WorkspaceLayout& layout,
                                      std::int64_t top_k, Combine mode) {
  return CombineBuffer{window + layout.combine, layout.combine_row_bytes, top_k, mode};
}

// One IEEE fp32 product / sum, each rounded on its own, never contracted into an FMA: on the GPU
// __fmul_rn / __fadd_rn; host code is built with -ffp-contract=off (CMakeLists.txt).
EPMOE_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
EPMOE_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// Step 5: element `column` of a result for `to`, sent into its home rank's buffer `home`.
// staged: bf16(value) into row [token, slot]. in_kernel_reduce: weight x value added into the
// token's accumulator row by a relaxed system-scope atomic (in arrival order: not deterministic).
EPMOE_HD void send_home(const CombineBuffer& home, const HomeSlot& to, std::int64_t column,
                        float value) {
  if (home.mode == Combine::staged)
    home.staged_row(to.token, to.slot)[column] = formats::float_to_bf16(value);
  else
    add_relaxed(&home.accumulator_row(to.token)[column], mul_rn(to.weight, value));
}

// send_home of N consecutive elements (N = 2 or 4), columns N * group .. N * group + N - 1:
// staged, one 4- or 8-byte store of their bf16 values (a staged row is H bf16, H a multiple of 64,
// from an aligned base, so it is 8-byte aligned); in_kernel_reduce, N atomics, as send_home.
template <int N>
EPMOE_HD void send_home_n(const CombineBuffer& home, const HomeSlot& to, std::int64_t group,
                          const float (&values)[N]) {
  static_assert(N == 2 || N == 4, "one 4- or 8-byte store");
  using Word = std::conditional_t<N == 2, std::uint32_t, std::uint64_t>;
  if (home.mode == Combine::staged) {
    Word packed = 0;
    for (int i = N - 1; i >= 0; --i)  // little-endian: values[0] first
      packed = static_cast<Word>(packed << 16 | formats::float_to_bf16(values[i]));
    reinterpret_cast<Word*>(home.staged_row(to.token, to.slot))[group] = packed;
    return;
  }
  for (int i = 0; i < N; ++i) send_home(home, to, N * group + i, values[i]);
}

// Step 7, on the home rank once every done has arrived: y[token, column] as bf16.
// staged: the fp32 sum of weight[k] x row[token, k][column] over the routed slots k, from 0 to
// top_k - 1 in that order, each product and sum rounded on its own, so y is deterministic and,
// with exact expert math, equals the reference bit for bit. in_kernel_reduce: the accumulator,
// rounded. `routed(k)`: whether slot k of the token has an expert (so its row was sent this round).
// combined_output of n_columns consecutive columns at once (column .. column + n_columns - 1):
// the same sums in the same order, each staged row read as one n_columns-wide load (16 bytes for
// 8: `column` a multiple of n_columns, rows 16-byte aligned, H a multiple of 64).
template <int n_columns, class Routed>
EPMOE_HD void combined_outputs(const CombineBuffer& own, const float* topk_weights,
                               std::int64_t token, std::int64_t column, Routed routed,
                               std::uint16_t (&out)[n_columns]) {
  struct alignas(2 * n_columns) Codes {
    std::uint16_t value[n_columns];
  };
  if (own.mode == Combine::in_kernel_reduce) {
    for (int i = 0; i < n_columns; ++i)
      out[i] = formats::float_to_bf16(own.accumulator_row(token)[column + i]);
    return;
  }
  // The slots' routing, weights and rows read kSlotsAhead at a time, then summed in slot order:
  // on the GPU those loads are in flight together, where summing each slot as it was read waited
  // for its loads one slot after another (kSlotsAhead rows: 16 registers a thread). A slot not
  // routed this round holds a stale row (the buffer has a row per slot), read and never summed.
  constexpr int kSlotsAhead = 4;
  float sum[n_columns] = {};
  for (std::int64_t first = 0; first < own.top_k; first += kSlotsAhead) {
    bool in[kSlotsAhead];
    float weight[kSlotsAhead];
    Codes codes[kSlotsAhead];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int j = 0; j < kSlotsAhead; ++j) {
      const std::int64_t k = first + j;
      in[j] = k < own.top_k && routed(k);
      if (k < own.top_k) {
        weight[j] = topk_weights[token * own.top_k + k];
        codes[j] = *reinterpret_cast<const Codes*>(own.staged_row(token, k) + column);
      }
    }
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int j = 0; j < kSlotsAhead; ++j) {
      if (!in[j]) continue;
      for (int i = 0; i < n_columns; ++i)
        sum[i] = add_rn(sum[i], mul_rn(weight[j], formats::bf16_to_float(codes[j].value[i])));
    }
  }
  for (int i = 0; i < n_columns; ++i) out[i] = formats::float_to_bf16(sum[i]);
}

template <class Routed>
EPMOE_HD std::uint16_t combined_output(const CombineBuffer& own, const float* topk_weights,
                                       std::int64_t token, std::int64_t column, Routed routed) {
  std::uint16_t out[1];
  combined_outputs<1>(own, topk_weights, token, column, routed, out);
  return out[0];
}

}  // namespace epmoe::protocol
