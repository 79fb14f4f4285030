// The expert step (docs/design.md §3 steps 4-6) as a chain of kernels on the caller's stream, each
// launched after the previous one with programmatic dependent launch (launch_chained; the CUTLASS
// GEMMs through their adapter, each waiting for the previous kernel first:
// experts/wgmma/grouped_gemm_parts.cuh); the boundaries between them are the grid barriers between
// its phases. Dispatch zeroes the per-expert counters route and bucket count into, so a forward has
// no memset node:
//
//   route    wait for every count; check, decode and count every received row, staged as the
//            backend asked (StagedRows); offsets
//   bucket   the (row, entry) pairs grouped by local expert
//   fc1      the backend: FC1 + SwiGLU + FC2's input quantization point, per chunk of <= 64 rows
//   fc2      the backend: FC2; results home; done to every rank (experts/common.cuh)
//
// The GEMMs are the backend's (docs/design.md §4.1, experts/backend.hpp): float64 sums of exact
// products (exact, bit-exact against the reference with staged combine) or bf16 tensor cores with
// fp32 accumulation (tensor_core). Route, bucket and the done publication are the round's, the
// same for every backend.
#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "cuda/experts.hpp"
#include "cuda/experts/backend.hpp"
#include "cuda/kernels.hpp"

namespace epmoe::cuda {
namespace {

// Slices of the route scratch, in code order; `base` == nullptr only measures.
RouteScratch slice(std::uint8_t* base, const RoundParams& p, std::size_t* bytes) {
  const auto experts = static_cast<std::size_t>(p.local_experts);
  const std::size_t rows = static_cast<std::size_t>(p.world) * p.layout.max_tokens;
  const std::size_t pairs = rows * static_cast<std::size_t>(p.top_k);  // experts::max_pairs
  experts::ScratchCursor cursor{base};
  RouteScratch s{};
  s.expert_rows =
      cursor.take<std::uint32_t>(2 * experts);  // expert_fill follows: zeroed by dispatch
  s.expert_fill = s.expert_rows == nullptr ? nullptr : s.expert_rows + experts;
  s.pair_offset = cursor.take<std::uint32_t>(experts + 1);
  s.chunk_offset = cursor.take<std::uint32_t>(experts + 1);
  s.pairs = cursor.take<std::uint32_t>(pairs);
  if (p.staged == StagedRows::fp32)
    s.x = cursor.take<float>(rows * static_cast<std::size_t>(p.hidden));
  if (p.staged == StagedRows::bf16_codes) {
    s.x16 = cursor.take<std::uint16_t>(rows * static_cast<std::size_t>(p.hidden));
    s.x_scale = cursor.take<float>(rows);
  }
  if (bytes != nullptr) *bytes = cursor.used;
  return s;
}

}  // namespace

std::size_t route_scratch_bytes(const RoundParams& p) {
  std::size_t bytes = 0;
  slice(nullptr, p, &bytes);
  return bytes;
}

RouteScratch route_scratch(std::uint8_t* base, const RoundParams& p) {
  return slice(base, p, nullptr);
}

ExpertShapes experts_shape(const RoundParams& p, int device, int num_sms) {
  return ExpertShapes{route_shape(p, device, num_sms), bucket_shape(p, device, num_sms)};
}

experts::ExpertStep expert_step(const RoundParams& p) {
  experts::ExpertStep step{};
  step.state = p.state;
  step.in = experts::ExpertInputs{
      p.scratch.pair_offset, p.scratch.chunk_offset, p.scratch.pairs,  p.layout.max_tokens,
      p.scratch.x,           p.scratch.x16,          p.scratch.x_scale};
  step.home = experts::TokenBackTarget{p.layout, p.peer_windows, p.rank, p.combine, p.top_k};
  step.sink = experts::PairSink{p.scratch.pairs, p.scratch.expert_fill};
  return step;
}

void launch_experts(const RoundParams& p, const ExpertShapes& s, TokenBucket bucket,
                    const experts::ExpertBackend& backend, cudaStream_t stream) {
  launch_route(p, s.route, stream);
  if (!backend.buckets_pairs()) launch_bucket(p, s.bucket, stream);
  const experts::ExpertStep step = expert_step(p);
  backend.launch_fc1(step, bucket, stream);
  backend.launch_fc2(step, bucket, stream);
}

}  // namespace epmoe::cuda
