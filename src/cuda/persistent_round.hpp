// One persistent launch per forward (docs/design.md §4.3; Knobs::megakernel): the whole round —
// dispatch, route, bucket, the backend's FC1 and FC2, combine — as one cooperative kernel whose
// CTAs meet at grid barriers where the chain has kernel boundaries. The round protocol is the
// chain's, step for step (the same device functions run in both), so the two paths are
// interchangeable round by round and a layer may use either per token bucket.
//
// The backend's steps must be device functions the kernel can call: the tensor-core backend's are
// (experts/mma/steps.cuh), and the wgmma backend's E4M3 tile's (mxfp8 and mxfp4 in the buckets
// that run it: persistent_e4m3_round.hpp). The exact backend's float64 tile (one CTA per SM, the
// bit-exact path) and the wgmma backend's other GEMMs (CUTLASS's and the bf16-decoding tiles,
// kernels of their own) run in the chain only.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "cuda/kernels.hpp"
#include "cuda/round_params.hpp"
#include "epmoe/config.hpp"

namespace epmoe::cuda {

namespace experts {
class ExpertBackend;
namespace mma {
class MmaBackend;
}
namespace wgmma {
class WgmmaBackend;
}
}  // namespace experts

class PersistentRound {
 public:
  // Empty, or why `backend` cannot run `bucket`'s rounds in one launch.
  static std::string cannot_run(const experts::ExpertBackend& backend, TokenBucket bucket);

  // The kernel's grid per token bucket: as many CTAs as are resident at once on the bucket's
  // num_sms SMs (I5; a cooperative launch, so the driver refuses rather than under-places them).
  // `backend` must outlive this, and launch() takes only buckets for which cannot_run is empty.
  PersistentRound(const RoundParams& base, const experts::ExpertBackend& backend,
                  const LayerConfig& config, int device);

  // The round `p` (this forward's tensors) in one launch on `stream`, with `bucket`'s grid.
  void launch(const RoundParams& p, TokenBucket bucket, cudaStream_t stream) const;

 private:
  const experts::mma::MmaBackend* mma_ = nullptr;        // one of the two
  const experts::wgmma::WgmmaBackend* wgmma_ = nullptr;  // (the E4M3 tile's buckets)
  PerBucket<KernelShape> shapes_{};
};

}  // namespace epmoe::cuda
