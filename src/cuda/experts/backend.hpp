// The expert-GEMM backend seam (docs/design.md §4.1): one face every backend implements, in the
// spirit of CUTLASS's collectives (can_implement, then Arguments -> Params) and FlashInfer's one
// folder per backend. The round (route, bucket before; combine after) knows a backend only
// through this class; a backend knows the round only through ExpertStep (inputs.hpp).
//
// A backend owns its weights in its own layout on the device, its scratch, and its kernels:
//   FC1   FC1 (gate, up) + SwiGLU + FC2's input quantization point, per chunk of one expert's rows
//   FC2   FC2 + every result sent home (send_home, experts/common.cuh); its last CTA publishes done
//         to every rank (finish_expert_step, experts/common.cuh), exactly once per round, T = 0
//         included
// Both launches read the per-expert row counts and offsets from device memory: no host sync, and
// grids sized once at creation for each token bucket's knobs (I5), so forward() stays
// graph-capturable: it names the launch's bucket (picked from T on the host), and a captured graph
// keeps the launches of its captured T's bucket.
//
// Adding a backend: a folder experts/<name>/ with its class (deriving from ExpertBackend), its
// kernels and its weight preparation, and one line in make_expert_backend (backend.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <string>

#include "cuda/experts/inputs.hpp"
#include "epmoe/config.hpp"
#include "epmoe/layer.hpp"

namespace epmoe::cuda::experts {

class ExpertBackend {
 public:
  virtual ~ExpertBackend() = default;
  ExpertBackend(const ExpertBackend&) = delete;
  ExpertBackend& operator=(const ExpertBackend&) = delete;

  // A short name for messages ("exact_f64", "bf16_mma").
  virtual const char* name() const = 0;

  // What route stages per received row for this backend's FC1.
  virtual StagedRows staged_rows() const = 0;

  // This rank's experts (w13 [E_local, 2I, H], gate rows then up rows; w2 [E_local, H, I]; bf16
  // or f32 values, or either FC pre-quantized in the layer's precision; on this GPU or on the host,
  // already validated) into the backend's own layout on the device, with kernels queued on
  // `stream` (prepare_fc_weights, weights.cuh, feeds the backend's Store either way); a host tensor
  // is copied up raw first. The caller's tensors must stay alive and unchanged until `stream` has
  // drained. Called once, at creation.
  virtual void prepare(const ExpertWeights& local, cudaStream_t stream) = 0;

  // Resident bytes of the prepared weights (scales included), and of the backend's scratch.
  virtual std::size_t weight_bytes() const = 0;
  virtual std::size_t scratch_bytes() const = 0;

  // Whether the backend's first FC1 kernel groups the round's pairs by expert itself
  // (ExpertStep::sink, as bucket does, while it copies each received row into its operand): the
  // round then launches no bucket kernel (one kernel boundary less per round).
  virtual bool buckets_pairs() const { return false; }

  // Steps 5-6 of a round (docs/design.md §3), on the caller's stream, after route and bucket (or
  // route alone: buckets_pairs), with the kernels (grids, tiles) the backend built at creation for
  // `bucket`'s knobs.
  virtual void launch_fc1(const ExpertStep& step, TokenBucket bucket,
                          cudaStream_t stream) const = 0;
  virtual void launch_fc2(const ExpertStep& step, TokenBucket bucket,
                          cudaStream_t stream) const = 0;

 protected:
  ExpertBackend() = default;
};

// The backend of config.options().expert_math, built for `device` (its kernels' shapes computed
// once per token bucket from config.knobs(bucket), its scratch allocated; weights come with
// prepare()). Throws Error(unsupported) naming the
// field when that backend cannot implement the config (its static can_implement says why).
std::unique_ptr<ExpertBackend> make_expert_backend(const LayerConfig& config, int device);

// Slices of one device allocation in code order, 256-byte aligned; `base` == nullptr only
// measures (the same cursor sizes and slices, so the two never disagree).
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

}  // namespace epmoe::cuda::experts
