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

// Called by every thread of every CTA of the grid; dynamic shared memory: dispatch_smem(p).
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
  for (std::int64_t t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    for (std::int64_t i = threadIdx.x; i < p.hidden; i += blockDim.x)
      x[i] = formats::bf16_to_float(p.x[t * p.hidden + i]);
    __syncthreads();
    const float s_enc =
        encode_row_block(RowGroup::cta(), x, p.hidden, p.precision, p.rounding, payload, scratch);
    for (int dest = 0; dest < p.world; ++dest) {
      if (threadIdx.x == 0) {
        std::int32_t n = 0;
        for (std::int64_t k = 0; k < p.top_k; ++k) {
          const std::int64_t id = expert_id(p, t, k);
          if (id < -1 || id >= p.num_experts) {
            if (dest == 0) report_bad_id(p, t, k, id);
            continue;
          }
          if (id < 0 || id / p.local_experts != dest) continue;
          entries[n++] = protocol::WireEntry{static_cast<std::int16_t>(k),
                                             static_cast<std::int16_t>(id - dest * p.local_experts),
                                             p.topk_weights[t * p.top_k + k]};
        }
        *header = protocol::WireRowHeader{static_cast<std::int32_t>(t), n, s_enc, round};
        destination = nullptr;
        if (n > 0) {
          const std::uint32_t slot = atomicAdd(&p.state->rows_to[dest], 1u);
          destination = p.peer_windows[dest] + p.layout.recv_row(round, p.rank, slot);
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
