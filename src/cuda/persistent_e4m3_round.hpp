// The persistent round of the wgmma backend's E4M3 tile (docs/design.md §4.3): mxfp8's and mxfp4's
// round in one cooperative launch in a bucket whose GEMMs run the E4M3 tile
// (WgmmaBackend::runs_e4m3_tile), its GEMMs the chain's kernels' tiles (packed_gemm.cuh). Used by
// PersistentRound (persistent_round.hpp), which picks it for the wgmma backend.
#pragma once

#include <cuda_runtime.h>

#include "cuda/experts/wgmma/wgmma_backend.hpp"
#include "cuda/kernels.hpp"
#include "cuda/round_params.hpp"

namespace epmoe::cuda {

// The grid of `bucket`'s kernel (its token-back mode's) on `num_sms` SMs: one CTA per SM (as many
// as are resident at once).
KernelShape persistent_e4m3_shape(const RoundParams& base,
                                  const experts::wgmma::WgmmaBackend& backend, TokenBucket bucket,
                                  int device, int num_sms);

// The round `p` in one launch of `shape` on `stream`; `bucket` must run the E4M3 tile.
void launch_persistent_e4m3(const RoundParams& p, const experts::wgmma::WgmmaBackend& backend,
                            TokenBucket bucket, const KernelShape& shape, cudaStream_t stream);

}  // namespace epmoe::cuda
