// Device pieces every expert backend shares (docs/design.md §4.1), written once so no backend
// carries its own copy: which chunk a work item is, where a pair's result goes and the store that
// sends it there, the done publication that closes the expert step, and cp.async.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/device_common.cuh"
#include "cuda/experts/inputs.hpp"
#include "protocol/token_back.hpp"
#include "protocol/wire.hpp"

namespace epmoe::cuda::experts {

// The expert whose part of a per-expert numbering holds `index`: offsets[e] is expert e's first
// index (pair_offset, chunk_offset, written by the route kernel), so it is the last expert whose
// offset is <= index (an expert with none shares its offset with the next one, which then wins).
__device__ inline int expert_holding(const std::uint32_t* offsets, std::int64_t local_experts,
                                     std::uint32_t index) {
  int lo = 0, hi = static_cast<int>(local_experts) - 1;  // offsets[lo] <= index
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= index)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The chunk an item belongs to: chunks are numbered expert by expert (chunk_offset).
struct Chunk {
  int expert;
  std::uint32_t first_pair;  // index into the pair list (and into a backend's per-pair scratch)
  int rows;                  // 1..kChunkRows
};

// Found by the whole CTA (every thread calls it with the same `chunk`): thread t tests experts
// t, t + blockDim.x, ... at once, and the one whose chunks hold it (an expert with none holds no
// chunk) writes the answer to shared memory. So the lookup costs two rounds of loads, not the
// log2(E) dependent ones of a binary search over chunk_offset (7 for 128 local experts), which
// sat in front of every decode item's first slab (docs/design.md §4.1).
__device__ inline Chunk find_chunk(const ExpertInputs& in, std::int64_t local_experts,
                                   std::uint32_t chunk) {
  __shared__ Chunk found;
  __syncthreads();  // every thread has read the previous item's answer
  for (auto e = static_cast<std::int64_t>(threadIdx.x); e < local_experts; e += blockDim.x) {
    const std::uint32_t begin = in.chunk_offset[e];
    if (begin <= chunk && chunk < in.chunk_offset[e + 1]) {
      const std::uint32_t first = in.pair_offset[e] + (chunk - begin) * kChunkRows;
      found =
          Chunk{static_cast<int>(e), first,
                static_cast<int>(min(in.pair_offset[e + 1] - first, std::uint32_t{kChunkRows}))};
    }
  }
  __syncthreads();
  return found;
}

// This CTA's work items, grid-stride over (chunk, tile) with the tile fastest: item(chunk, tile)
// for each. Every thread of the CTA walks the same items (find_chunk needs them all), so the body
// may use CTA barriers; it returns to go on to the next item.
template <class Item>
__device__ __forceinline__ void for_each_chunk_tile(const ExpertInputs& in,
                                                    std::int64_t local_experts, std::uint32_t tiles,
                                                    Item item) {
  const std::uint32_t items = in.chunk_offset[local_experts] * tiles;
  for (std::uint32_t i = blockIdx.x; i < items; i += gridDim.x)
    item(find_chunk(in, local_experts, i / tiles), i % tiles);
}

// An item's per-row lookup into shared memory: out[r] = lookup(pair r of the chunk), written by
// the chunk's first `rows` threads between two CTA barriers (the previous item is done with `out`;
// every row is there before the item reads it). Called by every thread of the CTA.
template <class T, class Lookup>
__device__ __forceinline__ void stage_chunk_rows(const ExpertInputs& in, const Chunk& chunk, T* out,
                                                 Lookup lookup) {
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < chunk.rows)
    out[threadIdx.x] = lookup(in.pairs[chunk.first_pair + threadIdx.x]);
  __syncthreads();
}

// f(std::integral_constant<Activation, a>{}) for the layer's activation `a`: an FC1 kernel is a
// template on the activation, so each instance holds one activation's code (registers).
template <class F>
decltype(auto) with_activation(Activation a, F f) {
  if (a == Activation::swiglu_oai)
    return f(std::integral_constant<Activation, Activation::swiglu_oai>{});
  return f(std::integral_constant<Activation, Activation::swiglu>{});
}

// The local expert whose part of the pair list holds `pair`.
__device__ inline int expert_of_pair(const ExpertInputs& in, std::int64_t local_experts,
                                     std::uint32_t pair) {
  return expert_holding(in.pair_offset, local_experts, pair);
}

// A pair's row in the staged x (ExpertInputs::x, x16, x_scale).
__device__ inline std::uint32_t x_row_of_pair(const ExpertInputs& in, std::uint32_t pair) {
  return static_cast<std::uint32_t>(pair_src(pair) * in.max_tokens) + pair_row(pair);
}

// Where a pair's result goes (protocol/token_back.hpp): the home rank, its token and top-k slot,
// and the router weight.
using protocol::HomeSlot;

// The home slot of `pair`, read from this rank's receive row of this round (checked by route).
__device__ inline HomeSlot home_slot(const TokenBackTarget& p, std::uint32_t round,
                                     std::uint32_t pair) {
  const std::uint8_t* row =
      p.peer_windows[p.rank] + p.layout.recv_row(round, pair_src(pair), pair_row(pair));
  const auto* header = reinterpret_cast<const protocol::WireRowHeader*>(row);
  const auto* entries =
      reinterpret_cast<const protocol::WireEntry*>(row + protocol::wire_entries_offset());
  return protocol::home_slot(pair_src(pair), *header, entries[pair_entry(pair)]);
}

// One result element home (protocol::send_home): staged, bf16 into the home rank's [token, slot]
// combine row; in-kernel reduce, weight x out added into the home rank's fp32 accumulator.
__device__ inline void send_home(const TokenBackTarget& p, const HomeSlot& home, std::int64_t c,
                                 float out) {
  protocol::send_home(
      protocol::combine_buffer(p.peer_windows[home.rank], p.layout, p.top_k, p.combine), home, c,
      out);
}

// N (2 or 4) consecutive elements home at once (protocol::send_home_n): columns N * group .. + N-1.
template <int N>
__device__ inline void send_home_n(const TokenBackTarget& p, const HomeSlot& home,
                                   std::int64_t group, const float (&out)[N]) {
  protocol::send_home_n<N>(
      protocol::combine_buffer(p.peer_windows[home.rank], p.layout, p.top_k, p.combine), home,
      group, out);
}

// 8 results home at once as their bf16 codes, staged combine only (a result already rounded as
// send_home rounds it): columns 8 group .. + 7 of the home rank's [token, slot] row, one 16-byte
// store (a staged row is H bf16, H a multiple of 64, from an aligned base).
__device__ inline void send_home_bf16x8(const TokenBackTarget& p, const HomeSlot& home,
                                        std::int64_t group, uint4 codes) {
  const protocol::CombineBuffer buffer =
      protocol::combine_buffer(p.peer_windows[home.rank], p.layout, p.top_k, p.combine);
  reinterpret_cast<uint4*>(buffer.staged_row(home.token, home.slot))[group] = codes;
}

// 6. The last CTA of a backend's FC2 tells every rank this rank's experts are done: exactly one
// done message per peer per round, whatever T (a CTA with no item still takes the ticket, I5).
// Every CTA that joined the round calls it once, after its last send_home.
__device__ inline void finish_expert_step(const ExpertStep& step, std::uint32_t round) {
  if (last_cta_done(&step.state->tickets[kExpertsDoneTicket])) {
    const DeviceSession session(step.home.layout, DevicePeers{step.home.peer_windows},
                                step.home.rank, round);
    for (int dest = 0; dest < step.home.layout.world; ++dest) session.publish_done(dest);
  }
}

// The frame of every backend's FC2 kernel, called by every thread: join the round, run
// `every_cta(start)` (work every CTA does, also one whose round already failed: a grid barrier
// all must meet), then, unless the round failed, `items(round)` (the kernel's work items, each
// result sent home) and finish_expert_step. A backend's FC2 body goes inside, so it cannot forget
// the done publication nor return before it. `kStamps`: end_only when the kernel follows FC2 work
// that cannot stamp the phase's begin (wgmma's home after CUTLASS's GEMM).
template <Stamps kStamps = Stamps::begin_and_end, class EveryCta, class Items>
__device__ __forceinline__ void fc2_round(const ExpertStep& step, EveryCta every_cta, Items items) {
  const RoundStart start = join_round(step.state, RoundPhase::fc2, kStamps);
  const PhaseEnd phase_end{start};
  every_cta(start);
  if (start.skip) return;
  items(start.round);
  finish_expert_step(step, start.round);
}
// The same with nothing before the items (nothing at all when this rank's round already failed).
template <Stamps kStamps = Stamps::begin_and_end, class Items>
__device__ __forceinline__ void fc2_round(const ExpertStep& step, Items items) {
  fc2_round<kStamps>(
      step, [](const RoundStart&) {}, items);
}

__device__ inline void cp_async_16(void* smem, const void* global) {
  const auto s = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(global) : "memory");
}
// 4 bytes (both addresses 4-byte aligned), through L1 (.ca: cp.async's .cg takes only 16).
__device__ inline void cp_async_4(void* smem, const void* global) {
  const auto s = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(global) : "memory");
}
// 8 bytes (both addresses 8-byte aligned), through L1 as cp_async_4.
__device__ inline void cp_async_8(void* smem, const void* global) {
  const auto s = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(global) : "memory");
}
__device__ inline void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int Pending>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

}  // namespace epmoe::cuda::experts
