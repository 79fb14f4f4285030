// One persistent launch per forward (docs/design.md §4.3; Knobs::megakernel): the whole round —
// dispatch, route, bucket, the backend's FC1 and FC2, combine — as one cooperative kernel whose
// CTAs meet at grid barriers where the chain has kernel boundaries. The round protocol is the
// chain's, step for step (the same device functions run in both), so the two paths are
// interchangeable round by round and a layer may use either per token bucket.
//
// The backend's steps must be device functions the kernel can call: the tensor-core backend's are
// (experts/mma/steps.cuh). The exact backend's float64 tile (one CTA per SM, the bit-exact path)
// and the wgmma backend's CUTLASS GEMMs (kernels of their own) run in the chain only.
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
}  // namespace experts

class PersistentRound {
 public:
  // Empty, or why `backend` cannot run a round in one launch.
  static std::string cannot_run(const experts::ExpertBackend& backend);

  // The kernel's grid per token bucket: as many CTAs as are resident at once on the bucket's
  // num_sms SMs (I5; a cooperative launch, so the driver refuses rather than under-places them).
  // `backend` must outlive this, and cannot_run(backend) must be empty.
  PersistentRound(const RoundParams& base, const experts::ExpertBackend& backend,
                  const LayerConfig& config, int device);

  // The round `p` (this forward's tensors) in one launch on `stream`, with `bucket`'s grid.
  void launch(const RoundParams& p, TokenBucket bucket, cudaStream_t stream) const;

 private:
  const experts::mma::MmaBackend& backend_;
  PerBucket<KernelShape> shapes_{};
};

}  // namespace epmoe::cuda
