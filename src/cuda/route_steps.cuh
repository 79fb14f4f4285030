// Expert step, part 1 (docs/design.md §3 steps 4-5): wait for this round's counts, check every
// received row, decode it once, and group the arrived (row, entry) pairs by local expert, so the
// expert backend that follows (docs/design.md §4.1) can take a chunk of one expert's rows and read
// its weights once per chunk. Route stages each row as the backend asked (StagedRows).
//
//   route:  every CTA waits for every count (bounded; a failure fails the round), then takes
//           received rows grid-stride, a warp per row where the rows fill the grid's warps and
//           a CTA per row where they do not: checks the header and entries (a violation is reported
//           and never computed on), decodes the row as the backend asked (StagedRows::fp32: into
//           scratch.x; bf16_codes: its bf16 codes and scale into x16 / x_scale; wire: nothing, the
//           backend reads the payload itself), counts its pairs per expert. The
//           last CTA turns the counts into pair and chunk offsets (a CTA-wide scan).
//   bucket: a warp per 32 / top_k received rows, a lane per entry, writes their pairs into the
//           experts' parts of the pair list (the order inside an expert is arrival order, which
//           changes no result: rows of a GEMM are independent). Its lanes' atomics are in flight
//           together, where a thread per row waited for each entry's in turn.
// The per-expert counters are zeroed by dispatch (dispatch_step.cuh), every round. Both are device
// functions of the whole grid, run by the chain's route and bucket kernels (experts_route.cu) and
// by the persistent round kernel (persistent_round.cu).
#pragma once

#include "cuda/device_common.cuh"
#include "cuda/experts/inputs.hpp"
#include "cuda/experts/pair_list.cuh"
#include "cuda/kernels.hpp"
#include "cuda/row_codec.cuh"
#include "protocol/wire.hpp"

namespace epmoe::cuda {

using experts::kChunkRows;
using experts::locate_row;

// A receive row that is not this round's or names a token, slot or expert that cannot exist
// (protocol::received_row_valid): a protocol violation by its writer, reported by one thread of
// the row's group and never computed on. The CTA then returns. (A count above max_tokens already
// failed the wait.)
__device__ inline void reject_row(const RoundParams& p, std::uint32_t round, int src,
                                  std::uint32_t row_round) {
  const DeviceSession session(p.layout, DevicePeers{p.peer_windows}, p.rank, round);
  fail_round(p, session, protocol::WaitOutcome{protocol::WaitStatus::violation, src, row_round, 0},
             Phase::dispatch_counts);
}

// The last route CTA: pairs and chunks per expert -> exclusive offsets (an inclusive scan of the
// per-thread sums over the CTA's first kThreads threads; a wider CTA's other threads, as the wgmma
// persistent round's, only meet its barriers and shuffles). [E_local] holds the totals.
__device__ inline void write_offsets(const RoundParams& p) {
  constexpr int kMaxPerThread = static_cast<int>(kMaxExperts / kThreads);
  static_assert(kMaxExperts % kThreads == 0);
  const int tid = static_cast<int>(threadIdx.x);
  const bool scans = tid < kThreads;
  const int experts = static_cast<int>(p.local_experts);
  const int per_thread = (experts + kThreads - 1) / kThreads;
  const int first = scans ? tid * per_thread : experts;
  std::uint32_t count[kMaxPerThread];
  std::uint32_t pairs = 0, chunks = 0;
  for (int i = 0; i < kMaxPerThread; ++i) {
    const int e = first + i;
    count[i] = i < per_thread && e < experts ? __ldcg(&p.scratch.expert_rows[e]) : 0u;
    pairs += count[i];
    chunks += (count[i] + kChunkRows - 1) / kChunkRows;
  }
  // The per-thread sums' inclusive scan: within each warp by shuffles, then over the warps'
  // totals by warp 0; two CTA barriers where a Hillis-Steele scan over shared memory took sixteen
  // (this runs on every round's critical path).
  constexpr int kWarps = kThreads / 32;
  static_assert(kWarps <= 32, "warp 0 scans the warps' totals");
  __shared__ std::uint32_t warp_pairs[kWarps], warp_chunks[kWarps];
  const int lane = tid % 32, warp = tid / 32;
  std::uint32_t scan_pairs = pairs, scan_chunks = chunks;
  for (int offset = 1; offset < 32; offset *= 2) {
    const std::uint32_t up_pairs = __shfl_up_sync(0xffffffffu, scan_pairs, offset);
    const std::uint32_t up_chunks = __shfl_up_sync(0xffffffffu, scan_chunks, offset);
    if (lane >= offset) {
      scan_pairs += up_pairs;
      scan_chunks += up_chunks;
    }
  }
  if (scans && lane == 31) {
    warp_pairs[warp] = scan_pairs;
    warp_chunks[warp] = scan_chunks;
  }
  __syncthreads();
  if (warp == 0) {
    std::uint32_t total_pairs = lane < kWarps ? warp_pairs[lane] : 0u;
    std::uint32_t total_chunks = lane < kWarps ? warp_chunks[lane] : 0u;
    for (int offset = 1; offset < kWarps; offset *= 2) {
      const std::uint32_t up_pairs = __shfl_up_sync(0xffffffffu, total_pairs, offset);
      const std::uint32_t up_chunks = __shfl_up_sync(0xffffffffu, total_chunks, offset);
      if (lane >= offset) {
        total_pairs += up_pairs;
        total_chunks += up_chunks;
      }
    }
    if (lane < kWarps) {
      warp_pairs[lane] = total_pairs;  // inclusive over the warps
      warp_chunks[lane] = total_chunks;
    }
  }
  __syncthreads();
  if (!scans) return;
  std::uint32_t pair_at = (warp > 0 ? warp_pairs[warp - 1] : 0u) + scan_pairs - pairs;
  std::uint32_t chunk_at = (warp > 0 ? warp_chunks[warp - 1] : 0u) + scan_chunks - chunks;
  for (int i = 0; i < per_thread && first + i < experts; ++i) {
    p.scratch.pair_offset[first + i] = pair_at;
    p.scratch.chunk_offset[first + i] = chunk_at;
    pair_at += count[i];
    chunk_at += (count[i] + kChunkRows - 1) / kChunkRows;
  }
  if (threadIdx.x == kThreads - 1) {
    p.scratch.pair_offset[experts] = warp_pairs[kWarps - 1];
    p.scratch.chunk_offset[experts] = warp_chunks[kWarps - 1];
  }
}

// Called by every thread of every CTA of the grid (no dynamic shared memory).
__device__ inline void route_step(const RoundParams& p) {
  __shared__ std::uint32_t rows_from[kMaxWorld];
  __shared__ bool last;
  // 4. Every CTA needs every count before it can pick rows.
  const RoundStart start = start_round(
      p, RoundPhase::route, Phase::dispatch_counts,
      [&](const DeviceSession& session, protocol::Deadline deadline, DevicePlatform& platform) {
        return session.await_counts(deadline, platform, rows_from);
      });
  const PhaseEnd phase_end{start};
  if (start.skip) return;
  const std::uint32_t round = start.round;
  if (blockIdx.x == 0 && threadIdx.x < p.world)
    p.state->rows_from[threadIdx.x] = rows_from[threadIdx.x];

  std::uint32_t total = 0;
  for (int src = 0; src < p.world; ++src) total += rows_from[src];
  const std::uint8_t* window = p.peer_windows[p.rank];
  const protocol::RowLimits limits{p.layout.max_tokens, p.top_k, p.local_experts};
  // A warp per row where the rows fill every warp of the grid (qwen3 at T = 8192: a CTA per row
  // had one row's loads in flight per CTA, its warps waiting on the same header), else the CTA
  // per row (a few rows: its threads share each row's decode).
  const RowGroup g = total >= gridDim.x * (blockDim.x / 32) ? RowGroup::slice(32) : RowGroup::cta();
  const std::uint32_t groups = blockDim.x / static_cast<std::uint32_t>(g.size);
  bool rejected = false;
  for (std::uint32_t item = blockIdx.x * groups + static_cast<std::uint32_t>(g.index); item < total;
       item += gridDim.x * groups) {
    int src;
    std::uint32_t r;
    locate_row(rows_from, item, src, r);
    const std::uint8_t* row = window + p.layout.recv_row(round, src, r);
    const auto header = *reinterpret_cast<const protocol::WireRowHeader*>(row);
    const auto* entries =
        reinterpret_cast<const protocol::WireEntry*>(row + protocol::wire_entries_offset());
    if (!protocol::received_row_valid(header, entries, round, limits)) {
      if (g.rank == 0) reject_row(p, round, src, header.round);
      rejected = true;
      break;
    }
    const std::size_t x_row = static_cast<std::size_t>(src) * p.layout.max_tokens + r;
    const std::uint8_t* payload = row + protocol::wire_payload_offset(p.top_k);
    if (p.staged == StagedRows::fp32) {
      decode_row_block(g, payload, p.hidden, p.precision, header.row_scale,
                       p.scratch.x + x_row * static_cast<std::size_t>(p.hidden));
    } else if (p.staged == StagedRows::bf16_codes) {  // the backend's bf16 operand, its row scale
      const float scale = p.precision == Precision::nvfp4 ? header.row_scale : 1.0f;
      decode_row_to_bf16_codes(g, payload, p.hidden, p.precision, header.row_scale, scale,
                               p.scratch.x16 + x_row * static_cast<std::size_t>(p.hidden));
      if (g.rank == 0) p.scratch.x_scale[x_row] = scale;
    }
    if (g.rank == 0)
      for (std::int32_t n = 0; n < header.num_entries; ++n)
        atomicAdd(&p.scratch.expert_rows[entries[n].local_expert], 1u);
  }
  // A rejected row ends its CTA's route (the round has failed): no ticket, so no CTA writes the
  // offsets.
  if (__syncthreads_or(rejected)) return;

  // Pairs per expert -> offsets, by the last CTA once every CTA's counts are in (only this GPU
  // reads them: GPU scope).
  const bool mine = last_cta_done<false>(&p.state->tickets[kRouteTicket]);
  if (threadIdx.x == 0) last = mine;
  __syncthreads();
  if (last) write_offsets(p);
}

// Called by every thread of every CTA of the grid, after every CTA of route_step is done.
__device__ inline void bucket_step(const RoundParams& p) {
  const RoundStart start = start_round(p, RoundPhase::route);
  const PhaseEnd phase_end{start};
  if (start.skip) return;
  const std::uint32_t* rows_from = p.state->rows_from;
  const std::uint32_t total = experts::received_rows(p.state, p.world);
  const std::uint8_t* window = p.peer_windows[p.rank];
  const experts::PairSink sink{p.scratch.pairs, p.scratch.expert_fill};
  // A warp takes 32 / top_k rows at once, top_k lanes each (a lane per entry: a row has at most
  // top_k <= 32), so qwen3's top-8 rows keep every lane's atomic in flight, not a quarter of them.
  const int lane = static_cast<int>(threadIdx.x % 32), top_k = static_cast<int>(p.top_k);
  const int rows_per_warp = 32 / top_k, slot = lane % top_k;
  const std::uint32_t warps = gridDim.x * (blockDim.x / 32);
  for (std::uint32_t first = (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * rows_per_warp;
       first < total; first += warps * rows_per_warp) {
    const std::uint32_t item = first + static_cast<std::uint32_t>(lane / top_k);
    if (lane / top_k >= rows_per_warp || item >= total) continue;  // (no warp-wide step here)
    int src;
    std::uint32_t r;
    locate_row(rows_from, item, src, r);
    const std::uint8_t* row = window + p.layout.recv_row(start.round, src, r);
    const std::int32_t entries_in_row =
        reinterpret_cast<const protocol::WireRowHeader*>(row)->num_entries;  // checked by route
    if (slot < entries_in_row) {
      const auto* entries =
          reinterpret_cast<const protocol::WireEntry*>(row + protocol::wire_entries_offset());
      experts::append_pair(sink, p.scratch.pair_offset, entries[slot].local_expert, src, slot, r);
    }
  }
}

}  // namespace epmoe::cuda
