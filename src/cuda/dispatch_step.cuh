// Dispatch (docs/design.md §3 steps 1-3) as a device function of the whole grid: every CTA takes
// tokens in a grid-stride loop, stages the token's wire row in shared memory once (quantized on the
// fly), and copies it with 16-byte stores into each owner rank's receive rows, carrying all the
// token's (slot, expert, weight) entries there. The last CTA to finish publishes (round, rows) to
// every rank, zero rows included. Run by the chain's dispatch kernel (dispatch.cu) and by the
// persistent round kernel (persistent_round.cu).
#pragma once

#include <algorithm>

#include "cuda/device_common.cuh"
#include "cuda/kernels.hpp"
#include "cuda/row_codec.cuh"

namespace epmoe::cuda {

// Shared memory: [wire row: header + entries + payload][x: H floats][scratch: one float per warp]
inline std::size_t dispatch_smem(const RoundParams& p) {
  return p.layout.row_bytes + static_cast<std::size_t>(p.hidden) * 4 + 32 * 4;
}

__device__ inline std::int64_t expert_id(const RoundParams& p, std::int64_t t, std::int64_t k) {
  const std::int64_t i = t * p.top_k + k;
  return p.ids_are_i64 ? static_cast<const std::int64_t*>(p.topk_ids)[i]
                       : static_cast<const std::int32_t*>(p.topk_ids)[i];
}

// Device-resident ids cannot be checked before the launch: an id outside [-1, E) is dropped
// (treated as -1) and reported once; the next forward() throws invalid_argument naming it.
__device__ inline void report_bad_id(const RoundParams& p, std::int64_t t, std::int64_t k,
                                     std::int64_t id) {
  std::uint32_t expected = 0;
  if (!protocol::system_ref<std::uint32_t>(p.health->claimed)
           .compare_exchange_strong(expected, 1u, ::cuda::std::memory_order_acq_rel))
    return;
  p.health->code = static_cast<std::uint32_t>(ErrorCode::invalid_argument);
  p.health->rank = p.rank;
  p.health->bad_token = t;
  p.health->bad_slot = k;
  p.health->bad_value = id;
  publish_health(p.health);
}

// A token's top-k slots, one per lane of warp 0 (kMaxTopK <= 32), loaded together at the top of
// the token's turn so that their latency overlaps x's loads. (Thread 0 once walked them in a
// loop: one dependent global load per slot, two for a kept one, every token.)
struct TokenSlots {
  std::int64_t id = -1;  // the lane's expert id as given; -1 past top_k
  float weight = 0.0f;
  bool bad = false;  // id outside [-1, E): dropped, and reported
};
static_assert(kMaxTopK <= 32, "a token's slots are one warp's lanes");

// Called by the lanes of warp 0.
__device__ inline TokenSlots load_slots(const RoundParams& p, std::int64_t t) {
  const int k = static_cast<int>(threadIdx.x);
  TokenSlots s;
  if (k < p.top_k) {
    s.id = expert_id(p, t, k);
    s.weight = p.topk_weights[t * p.top_k + k];
    s.bad = s.id < -1 || s.id >= p.num_experts;
  }
  return s;
}

// The slots of `t` that rank `dest` owns, in slot order, into the wire row's entries (called by
// the lanes of warp 0); returns how many.
__device__ inline std::int32_t write_entries(const RoundParams& p, const TokenSlots& s, int dest,
                                             protocol::WireEntry* entries) {
  const int lane = static_cast<int>(threadIdx.x);
  const unsigned owned =
      __ballot_sync(0xffffffffu, !s.bad && s.id >= 0 && s.id / p.local_experts == dest);
  if (owned >> lane & 1u)
    entries[__popc(owned & ((1u << lane) - 1u))] =
        protocol::WireEntry{static_cast<std::int16_t>(lane),
                            static_cast<std::int16_t>(s.id - dest * p.local_experts), s.weight};
  return __popc(owned);
}

// Token t's x row into shared memory as floats, by the whole CTA. From a 16-byte aligned x (a row
// is then aligned too: H is a multiple of 64), 16-byte loads, 4 per thread issued before any is
// used (strided_vectors): one load's latency per token where a 2-byte load per element and step,
// each waited for before the next was issued, cost H / blockDim of them.
__device__ inline void stage_x_row(const RoundParams& p, std::int64_t t, float* x) {
  const std::uint16_t* row = p.x + t * p.hidden;
  if (reinterpret_cast<std::uintptr_t>(p.x) % 16 != 0) {
    for (std::int64_t i = threadIdx.x; i < p.hidden; i += blockDim.x)
      x[i] = formats::bf16_to_float(row[i]);
    return;
  }
  strided_vectors<4>(reinterpret_cast<const uint4*>(row), p.hidden / 8, threadIdx.x, blockDim.x,
                     [&](std::int64_t at, const uint4& codes) {
                       float out[8];
                       bf16x8_to_float(codes, out);
                       auto* dst = reinterpret_cast<float4*>(x + 8 * at);
                       dst[0] = make_float4(out[0], out[1], out[2], out[3]);
                       dst[1] = make_float4(out[4], out[5], out[6], out[7]);
                     });
}

// Called by every thread of every CTA of the grid; dynamic shared memory: dispatch_smem(p).
// kFromCodes: whether rows with block scales (fp8_block128, MXFP8, NVFP4: encodes_bf16_rows) are
// encoded from x's bf16 codes in registers (encode_bf16_row) instead of from the fp32 row in
// shared memory that stage_x_row writes. The chain's dispatch kernel does; the persistent rounds,
// whose registers are capped by their other roles, keep the shared row (the register path added
// spills there).
template <bool kFromCodes = false>
__device__ inline void dispatch_step(const RoundParams& p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  std::uint8_t* row = smem;
  auto* x = reinterpret_cast<float*>(smem + p.layout.row_bytes);
  float* scratch = x + p.hidden;
  __shared__ std::uint8_t* destination;
  const RoundStart start = start_round(p, RoundPhase::dispatch);
  const PhaseEnd phase_end{start};
  // The expert step's per-expert counters (route's counts, bucket's fills) start the round at zero:
  // dispatch runs before route on the stream, and the previous round's bucket is done with them.
  for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < 2 * p.local_experts;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    p.scratch.expert_rows[i] = 0;
  if (start.skip) return;
  const std::uint32_t round = start.round;

  // 1. This round's accumulator rows start at zero (in-kernel reduce adds into them remotely).
  if (p.combine == Combine::in_kernel_reduce) {
    auto* acc = reinterpret_cast<float*>(p.peer_windows[p.rank] + p.layout.combine);
    for (std::int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.tokens * p.hidden;
         i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
      acc[i] = 0.0f;
  }

  // 2. Rows to their owners.
  auto* header = reinterpret_cast<protocol::WireRowHeader*>(row);
  auto* entries = reinterpret_cast<protocol::WireEntry*>(row + protocol::wire_entries_offset());
  std::uint8_t* payload = row + protocol::wire_payload_offset(p.top_k);
  const bool slot_lane = threadIdx.x < 32;  // warp 0: a lane per top-k slot
  const bool from_codes = kFromCodes && encodes_bf16_rows(p.precision) &&
                          reinterpret_cast<std::uintptr_t>(p.x) % 8 == 0;
  for (std::int64_t t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    TokenSlots slots;
    if (slot_lane) slots = load_slots(p, t);
    float s_enc = 1.0f;
    if (from_codes) {
      s_enc =
          encode_bf16_row(p.x + t * p.hidden, p.hidden, p.precision, p.rounding, payload, scratch);
    } else {
      stage_x_row(p, t, x);
      __syncthreads();
      s_enc =
          encode_row_block(RowGroup::cta(), x, p.hidden, p.precision, p.rounding, payload, scratch);
    }
    if (slot_lane) {  // the first bad slot of the token is the one reported (report_bad_id: once)
      const unsigned bad = __ballot_sync(0xffffffffu, slots.bad);
      if (bad != 0 && static_cast<int>(threadIdx.x) == __ffs(static_cast<int>(bad)) - 1)
        report_bad_id(p, t, threadIdx.x, slots.id);
    }
    for (int dest = 0; dest < p.world; ++dest) {
      if (slot_lane) {
        const std::int32_t n = write_entries(p, slots, dest, entries);
        if (threadIdx.x == 0) {
          *header = protocol::WireRowHeader{static_cast<std::int32_t>(t), n, s_enc, round};
          destination = nullptr;
          if (n > 0) {
            const std::uint32_t slot = atomicAdd(&p.state->rows_to[dest], 1u);
            destination = p.peer_windows[dest] + p.layout.recv_row(round, p.rank, slot);
          }
        }
      }
      __syncthreads();
      if (destination != nullptr) copy_16B(RowGroup::cta(), destination, row, p.layout.row_bytes);
      __syncthreads();
    }
  }

  // 3. The last CTA publishes (round, rows) to every rank, then re-arms the row counters.
  if (last_cta_done(&p.state->tickets[kDispatchTicket])) {
    const DeviceSession session(p.layout, DevicePeers{p.peer_windows}, p.rank, round);
    for (int dest = 0; dest < p.world; ++dest)
      session.publish_count(dest, atomicExch(&p.state->rows_to[dest], 0u));
  }
}

}  // namespace epmoe::cuda
