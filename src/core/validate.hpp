// Argument checks shared by every executor: each rejection names the argument, what it got and
// the rule, and happens before anything is launched.
#pragma once

#include <cstdint>

#include "epmoe/config.hpp"
#include "epmoe/layer.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe {

// The arguments of one forward(), checked.
struct ForwardArgs {
  std::int64_t tokens = 0;
  const std::uint16_t* x = nullptr;  // [T, H] bf16
  const void* topk_ids = nullptr;    // [T, K] i32 or i64
  DType id_dtype = DType::i32;
  const float* topk_weights = nullptr;  // [T, K]
  std::uint16_t* y = nullptr;           // [T, H] bf16

  std::int32_t expert_id(std::int64_t token, std::int64_t slot, std::int64_t top_k) const {
    const auto i = static_cast<std::size_t>(token * top_k + slot);
    return id_dtype == DType::i32
               ? static_cast<const std::int32_t*>(topk_ids)[i]
               : static_cast<std::int32_t>(static_cast<const std::int64_t*>(topk_ids)[i]);
  }
};

// `check_ids_on_host`: the ids live in host memory, so their range (-1 <= id < E) is checked here;
// the CUDA executor checks device-resident ids in the kernel instead.
ForwardArgs validate_forward(const LayerConfig& config, const TensorView& x,
                             const TensorView& topk_ids, const TensorView& topk_weights,
                             const TensorView& y, Device device, bool check_ids_on_host);

// Local expert weights: w13 [E_local, 2I, H], w2 [E_local, H, I] (bf16 or f32), or either FC as
// pre-quantized matrices in the layer's precision (epmoe/layer.hpp), and when given b13
// [E_local, 2I], b2 [E_local, H]; all contiguous, on `device` (or, `host_allowed`, on the host).
void validate_weights(const LayerConfig& config, const ExpertWeights& weights, Device device,
                      bool host_allowed = false);

}  // namespace epmoe
