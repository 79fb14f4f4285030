// Combine (docs/design.md §3 step 7): every CTA waits until every rank's experts are done, then
// finishes its tokens of y (protocol::combined_output). Staged: the fp32 weighted sum of the bf16
// FC2 rows over slots 0..K-1, in that order, with no FMA contraction, so y is deterministic and
// equals the reference bit for bit. In-kernel reduce: y is the accumulator the experts added into,
// rounded to bf16. The last CTA advances the round (and, with phase timing on, clears the next
// round's record).
// A device function of the whole grid, run by the chain's combine kernel (combine.cu) and by the
// persistent round kernel (persistent_round.cu).
#pragma once

#include "cuda/device_common.cuh"
#include "cuda/kernels.hpp"
#include "protocol/token_back.hpp"

namespace epmoe::cuda {

// Called by every thread of every CTA of the grid (no dynamic shared memory).
__device__ inline void combine_step(const RoundParams& p) {
  const RoundStart start =
      start_round(p, RoundPhase::combine, Phase::expert_done,
                  [](const DeviceSession& session, protocol::Deadline deadline,
                     DevicePlatform& platform) { return session.await_done(deadline, platform); });
  const PhaseEnd phase_end{start};
  if (start.skip) return;

  const protocol::CombineBuffer own =
      protocol::combine_buffer(p.peer_windows[p.rank], p.layout, p.top_k, p.combine);
  for (std::int64_t t = blockIdx.x; t < p.tokens; t += gridDim.x) {
    // A slot has a row only if dispatch sent it: ids outside [0, E) were dropped there.
    const auto routed = [&](std::int64_t k) {
      const std::int64_t slot = t * p.top_k + k;
      const std::int64_t id = p.ids_are_i64 ? static_cast<const std::int64_t*>(p.topk_ids)[slot]
                                            : static_cast<const std::int32_t*>(p.topk_ids)[slot];
      return id >= 0 && id < p.num_experts;
    };
    // Eight columns per thread per step: 16-byte loads of each staged row (H is a multiple of
    // 64), and one 16-byte store of y where the caller's y is 16-byte aligned.
    std::uint16_t* y = p.y + t * p.hidden;
    const bool y_aligned = reinterpret_cast<std::uintptr_t>(p.y) % 16 == 0;
    for (std::int64_t c8 = threadIdx.x; c8 < p.hidden / 8; c8 += blockDim.x) {
      alignas(16) std::uint16_t out[8];
      protocol::combined_outputs<8>(own, p.topk_weights, t, 8 * c8, routed, out);
      if (y_aligned) {
        reinterpret_cast<uint4*>(y)[c8] = *reinterpret_cast<const uint4*>(out);
      } else {
        for (int i = 0; i < 8; ++i) y[8 * c8 + i] = out[i];
      }
    }
  }

  if (last_cta_done(&p.state->tickets[kCombineTicket])) {
    p.state->round = start.round + 1;
    // The next round stamps the other record; this round's stays for Layer::last_phase_times.
    if (start.clock.record != nullptr) clear_phase_record(p.state->phases[(start.round + 1) & 1u]);
  }
}

}  // namespace epmoe::cuda
