// The expert step (DESIGN §3 steps 4-6) as a chain of kernels on the caller's stream; the
// boundaries between them are the grid barriers between its phases:
//
//   memset   per-expert counters to 0 (a graph node: captured forwards stay correct)
//   route    wait for every count; check, decode and count every received row; offsets
//   bucket   the (row, entry) pairs grouped by local expert
//   fc1      FC1 + SwiGLU per (expert, chunk of <= 64 rows, tile of 64 intermediate columns)
//   quantize FC2's input quantization point, per h row
//   fc2      FC2 per (expert, chunk, tile of 128 hidden columns); results home; done to every rank
//
// Numerics are the plain kernel's: float64 sums of exact float products, rounded to float once per
// output, the same codec and SwiGLU functions (experts_gemm.cuh says how the tiles are cut).
#include <algorithm>

#include "cuda/cuda_check.hpp"
#include "cuda/experts.hpp"
#include "cuda/kernels.hpp"

namespace epmoe::cuda {
namespace {

// Slices of the scratch, in code order; `base` == nullptr only measures.
struct ScratchCursor {
  std::uint8_t* base;
  std::size_t used = 0;
  template <class T>
  T* take(std::size_t count) {
    used = (used + 255) / 256 * 256;
    T* at = base == nullptr ? nullptr : reinterpret_cast<T*>(base + used);
    used += count * sizeof(T);
    return at;
  }
};

// Every pair a rank can receive in one round: each source rank's max_tokens rows, each with at
// most top_k entries here. (top_k, not min(top_k, E_local): duplicate ids in a token's top-k are
// legal input and each is a pair of its own.)
ExpertScratch slice(std::uint8_t* base, const ForwardParams& p, std::size_t* bytes) {
  const auto experts = static_cast<std::size_t>(p.local_experts);
  const std::size_t rows = static_cast<std::size_t>(p.world) * p.layout.max_tokens;
  const std::size_t pairs = rows * static_cast<std::size_t>(p.top_k);
  ScratchCursor cursor{base};
  ExpertScratch s{};
  s.expert_rows = cursor.take<std::uint32_t>(2 * experts);  // expert_fill follows: one memset
  s.expert_fill = s.expert_rows == nullptr ? nullptr : s.expert_rows + experts;
  s.pair_offset = cursor.take<std::uint32_t>(experts + 1);
  s.chunk_offset = cursor.take<std::uint32_t>(experts + 1);
  s.pairs = cursor.take<std::uint32_t>(pairs);
  s.x = cursor.take<float>(rows * static_cast<std::size_t>(p.hidden));
  s.h = cursor.take<float>(pairs * static_cast<std::size_t>(p.intermediate));
  if (p.tensor_cores) {
    s.x16 = cursor.take<std::uint16_t>(rows * static_cast<std::size_t>(p.hidden));
    s.x_scale = cursor.take<float>(rows);
    s.h16 = cursor.take<std::uint16_t>(pairs * static_cast<std::size_t>(p.intermediate));
    s.h_scale = cursor.take<float>(pairs);
  }
  if (bytes != nullptr) *bytes = cursor.used;
  return s;
}

}  // namespace

std::size_t expert_scratch_bytes(const ForwardParams& p) {
  std::size_t bytes = 0;
  slice(nullptr, p, &bytes);
  return bytes;
}

ExpertScratch expert_scratch(std::uint8_t* base, const ForwardParams& p) {
  return slice(base, p, nullptr);
}

ExpertShapes experts_shape(const ForwardParams& p, int device) {
  return ExpertShapes{route_shape(p, device), bucket_shape(p, device), fc1_shape(p, device),
                      quantize_h_shape(p, device), fc2_shape(p, device)};
}

void launch_experts(const ForwardParams& p, const ExpertShapes& s, cudaStream_t stream) {
  EPMOE_CUDA_CHECK(cudaMemsetAsync(
      p.scratch.expert_rows, 0,
      2 * static_cast<std::size_t>(p.local_experts) * sizeof(std::uint32_t), stream));
  launch_route(p, s.route, stream);
  launch_bucket(p, s.bucket, stream);
  launch_fc1(p, s.fc1, stream);
  launch_quantize_h(p, s.quantize_h, stream);
  launch_fc2(p, s.fc2, stream);
}

}  // namespace epmoe::cuda
