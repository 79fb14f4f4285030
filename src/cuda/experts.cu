// Experts (DESIGN §3 steps 4-6), the plain correct version: every CTA waits for the counts of this
// round, then takes arrived rows in a grid-stride loop; for each (row, local expert) it runs FC1
// (a warp per output, lanes across K, float64 partial sums: products of two floats are exact in
// float64, so only the summation order differs from the reference), SwiGLU, the FC2 input's
// quantization point, and FC2, and sends the result home. The last CTA publishes done.
// The Hopper GEMMs replace the two matrix loops; the protocol around them stays.
#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "cuda/device_common.cuh"
#include "cuda/kernels.hpp"
#include "cuda/row_codec.cuh"
#include "reference/swiglu.hpp"

namespace epmoe::cuda {
namespace {

// Shared memory: [x: H][out: H][h: 2I][quantization bytes of an I-row][scratch: one per warp]
std::size_t experts_smem(const ForwardParams& p) {
  const auto h = static_cast<std::size_t>(p.hidden);
  const auto i = static_cast<std::size_t>(p.intermediate);
  return 4 * (2 * h + 2 * i) +
         protocol::align16(protocol::wire_payload_bytes(p.precision, p.intermediate)) + 32 * 4;
}

__device__ float dot(const float* x, const float* w, std::int64_t n) {
  double acc = 0.0;
  for (std::int64_t k = threadIdx.x & 31; k < n; k += 32) acc += double{x[k]} * double{w[k]};
  return static_cast<float>(warp_sum(acc));
}

// A receive row that is not this round's, or names a slot or expert that cannot exist: a protocol
// violation by its writer, reported (by one thread) and never computed on. The CTA then returns.
__device__ void reject_row(const ForwardParams& p, std::uint32_t round, int src,
                           std::uint32_t row_round) {
  if (threadIdx.x != 0) return;
  const DeviceSession session(p.layout, DevicePeers{p.peer_windows}, p.rank, round);
  fail_round(p, session, protocol::WaitOutcome{protocol::WaitStatus::violation, src, row_round, 0},
             Phase::dispatch_counts);
}

__global__ void __launch_bounds__(kThreads) experts_kernel(ForwardParams p) {
  extern __shared__ __align__(16) std::uint8_t smem[];
  auto* x = reinterpret_cast<float*>(smem);
  float* out = x + p.hidden;
  float* h = out + p.hidden;
  auto* qbytes = reinterpret_cast<std::uint8_t*>(h + 2 * p.intermediate);
  auto* scratch = reinterpret_cast<float*>(
      qbytes + protocol::align16(protocol::wire_payload_bytes(p.precision, p.intermediate)));
  __shared__ bool skip;
  __shared__ std::uint32_t round;
  __shared__ std::uint32_t rows_from[kMaxWorld];

  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
  // 4. Every CTA needs every count before it can pick rows.
  if (threadIdx.x == 0) {
    skip = round_failed(p);
    round = p.state->round;
    if (!skip) {
      const DeviceSession session(p.layout, DevicePeers{p.peer_windows}, p.rank, round);
      DevicePlatform platform;
      const protocol::WaitOutcome w = session.await_counts(
          protocol::deadline_after_ms(platform, p.timeout_ms), platform, rows_from);
      if (w.status != protocol::WaitStatus::ok) {
        fail_round(p, session, w, Phase::dispatch_counts);
        skip = true;
      }
    }
  }
  __syncthreads();
  if (skip) return;

  std::uint32_t total = 0;
  for (int src = 0; src < p.world; ++src) total += rows_from[src];
  const std::uint8_t* window = p.peer_windows[p.rank];
  const std::size_t h_stride = static_cast<std::size_t>(p.hidden);
  const std::size_t i_stride = static_cast<std::size_t>(p.intermediate);

  // 5. Every arrived (row, expert) pair, results straight home.
  for (std::uint32_t item = blockIdx.x; item < total; item += gridDim.x) {
    int src = 0;
    std::uint32_t r = item;
    while (r >= rows_from[src]) r -= rows_from[src++];
    const std::uint8_t* row = window + p.layout.recv_row(round, src, r);
    const auto header = *reinterpret_cast<const protocol::WireRowHeader*>(row);
    if (header.round != round || header.token < 0 || header.token >= p.layout.max_tokens ||
        header.num_entries < 1 || header.num_entries > p.top_k) {
      reject_row(p, round, src, header.round);
      return;
    }
    decode_row_block(row + protocol::wire_payload_offset(p.top_k), p.hidden, p.precision,
                     header.row_scale, x);
    __syncthreads();
    const auto* entries =
        reinterpret_cast<const protocol::WireEntry*>(row + protocol::wire_entries_offset());
    for (std::int32_t n = 0; n < header.num_entries; ++n) {
      const protocol::WireEntry entry = entries[n];
      if (entry.local_expert < 0 || entry.local_expert >= p.local_experts || entry.slot < 0 ||
          entry.slot >= p.top_k) {
        reject_row(p, round, src, header.round);
        return;
      }
      const auto e = static_cast<std::size_t>(entry.local_expert);
      const float* w13 = p.w13 + e * 2 * i_stride * h_stride;
      const float* w2 = p.w2 + e * h_stride * i_stride;
      for (std::int64_t j = warp; j < 2 * p.intermediate; j += warps) {
        const float v = dot(x, w13 + j * h_stride, p.hidden);
        if (lane == 0) h[j] = v;
      }
      __syncthreads();
      for (std::int64_t j = threadIdx.x; j < p.intermediate; j += blockDim.x)
        h[j] = static_cast<float>(reference::swiglu(h[j], h[p.intermediate + j], p.swiglu_limit));
      __syncthreads();
      quantize_row_block(h, p.intermediate, p.precision, p.rounding, qbytes, scratch);
      for (std::int64_t c = warp; c < p.hidden; c += warps) {
        const float v = dot(h, w2 + c * i_stride, p.intermediate);
        if (lane == 0) out[c] = v;
      }
      __syncthreads();
      std::uint8_t* combine = p.peer_windows[src] + p.layout.combine;
      if (p.combine == Combine::staged) {
        auto* dst = reinterpret_cast<std::uint16_t*>(
            combine + static_cast<std::size_t>(header.token * p.top_k + entry.slot) *
                          p.layout.combine_row_bytes);
        for (std::int64_t c = threadIdx.x; c < p.hidden; c += blockDim.x)
          dst[c] = formats::float_to_bf16(out[c]);
      } else {
        auto* acc = reinterpret_cast<float*>(combine + static_cast<std::size_t>(header.token) *
                                                           p.layout.combine_row_bytes);
        for (std::int64_t c = threadIdx.x; c < p.hidden; c += blockDim.x)
          protocol::add_relaxed(&acc[c], entry.weight * out[c]);
      }
      __syncthreads();
    }
  }

  // 6. The last CTA tells every rank this rank's experts are done.
  if (last_cta_done(&p.state->tickets[1])) {
    const DeviceSession session(p.layout, DevicePeers{p.peer_windows}, p.rank, round);
    for (int dest = 0; dest < p.world; ++dest) session.publish_done(dest);
  }
}

}  // namespace

KernelShape experts_shape(const ForwardParams& p, int device) {
  return occupancy_shape(experts_kernel, experts_smem(p), device);
}

void launch_experts(const ForwardParams& p, const KernelShape& s, cudaStream_t stream) {
  experts_kernel<<<s.grid, kThreads, s.smem, stream>>>(p);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda
