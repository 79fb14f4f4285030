// The expert-parallel MoE layer. Every rank creates it (collectively) and calls forward() once per
// round, whatever its token count (T may be 0), with no barrier between rounds (docs/design.md §1,
// §3).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "epmoe/comm.hpp"
#include "epmoe/config.hpp"
#include "epmoe/errors.hpp"
#include "epmoe/tensor.hpp"
#include "epmoe/timing.hpp"

namespace epmoe {

// One FC's matrices of this rank's experts already in the layer's precision, as checkpoints ship
// them (docs/formats.md "Pre-quantized expert weights"): the layer decodes them as they are, with
// no re-quantization. [E, N, K] is [E_local, 2I, H] for w13 (gate rows, then up rows; a model's
// own order, such as gpt-oss's interleave, is for the caller to undo) and [E_local, H, I] for w2.
// All uint8 tensors hold raw codes (a torch float8_e4m3fn tensor viewed as uint8); every tensor is
// contiguous, on the host or the rank's GPU like the weights.
//   precision     codes                        scales                                 global
//   mxfp8         u8 E4M3 [E, N, K]            u8 E8M0 [E, N, K/32]                   -
//   nvfp4         u8 E2M1 pairs [E, N, K/2]    u8 E4M3 [E, N, K/16]                   f32 [E]
//   fp8_block128  u8 E4M3 [E, N, K]            f32 [E, ceil(N/128), ceil(K/128)]      -
//   mxfp4         u8 E2M1 pairs [E, N, K/2]    u8 E8M0 [E, N, K/32]                   -
//                 or [E, N, K/32, 16]
// E2M1 pairs: element 2j in the low nibble of byte j (ModelOpt, vLLM, gpt-oss). fp8_block128's
// scales are DeepSeek-V3's weight_scale_inv: value = e4m3 * scale. NVFP4 takes one fp32 scale per
// matrix in either convention (exactly one of the two):
//   global_scale  value = (e2m1 * block_scale) * global_scale   ModelOpt's weight_scale_2
//   s_enc         value = (e2m1 * block_scale) / s_enc          epmoe's quantize_nvfp4
// Scale values are taken as they are (not checked).
struct QuantizedMatrices {
  TensorView codes;
  TensorView scales;
  TensorView global_scale{};
  TensorView s_enc{};
};

// This rank's experts: w13 [E_local, 2I, H] (gate rows, then up rows) and w2 [E_local, H, I],
// bf16 or f32, quantized by the layer to its precision. Expert e lives on rank e / E_local.
// Instead of w13 (or w2), w13_quantized (w2_quantized) may give that FC already in the layer's
// precision (any precision but bf16); w13 (w2) is then left default-constructed.
// Optional biases (gpt-oss), never quantized, held in fp32: b13 [E_local, 2I] (gate biases, then
// up biases, as w13's rows) added to FC1's output before the activation, and b2 [E_local, H] added
// to FC2's output before it is sent home. bf16 or f32, on the host or the rank's GPU like the
// weights; a default-constructed TensorView (no data, no shape) means none.
struct ExpertWeights {
  TensorView w13;
  TensorView w2;
  TensorView b13{};
  TensorView b2{};
  QuantizedMatrices w13_quantized{};
  QuantizedMatrices w2_quantized{};
};

// Whether an optional tensor was given (anything but a default-constructed TensorView).
inline bool given(const TensorView& t) {
  return t.data != nullptr || !t.shape.empty();
}
// Whether pre-quantized matrices were given (any of their tensors).
inline bool given(const QuantizedMatrices& q) {
  return given(q.codes) || given(q.scales) || given(q.global_scale) || given(q.s_enc);
}

class LayerImpl;

class Layer {
 public:
  // Collective: every rank of `comm` creates its layer with the same config (rank aside). A
  // mismatch is reported at creation on every rank, naming the ranks that differ.
  Layer(Communicator& comm, const LayerConfig& config, const ExpertWeights& local_weights);
  ~Layer();
  Layer(Layer&&) noexcept;
  Layer& operator=(Layer&&) noexcept;

  // x [T, H] bf16, topk_ids [T, K] i32|i64 (-1 = no expert), topk_weights [T, K] f32,
  // y [T, H] bf16 (written). Bad arguments throw Error(invalid_argument) before anything runs.
  // Cross-rank failures throw Error(timeout | peer_aborted | protocol_violation) and leave the
  // layer unhealthy until reset().
  void forward(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights,
               const TensorView& y, Stream stream = {});

  Health health() const;
  // Collective: every rank calls it; afterwards rounds restart and are correct again.
  void reset();

  const LayerConfig& config() const;
  // The round the next forward() runs (starts at 1; diagnostics only).
  std::uint32_t next_round() const;
  // Bytes this rank's layer holds for its experts' weights as its expert math reads them (on the
  // GPU for the CUDA executor, scales included; docs/design.md §6 "What the GPU holds").
  std::size_t resident_weight_bytes() const;

  // Per-phase timing (epmoe/timing.hpp, docs/design.md §4.2), off by default. While on, every
  // kernel of a round stamps the GPU clock at its start and end (one thread per CTA; off, a
  // branch); the setting lives in device memory, so a captured CUDA graph follows it too. Not
  // collective: each rank times its own rounds. Waits for this layer's last forward's stream, so
  // call it between rounds, not during capture. The CPU executor has no device clock: true throws
  // Error(unsupported), false does nothing.
  void set_phase_timing(bool on);
  // The phases of the last round this rank finished, read from the device after waiting for the
  // last forward's stream (call it between rounds, not during capture). Empty while timing is off,
  // before the first timed round, and on the CPU executor.
  PhaseTimes last_phase_times() const;

  LayerImpl& impl() { return *impl_; }

 private:
  std::unique_ptr<LayerImpl> impl_;
};

}  // namespace epmoe
