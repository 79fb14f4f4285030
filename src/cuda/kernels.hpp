// Launchers of the CUDA executor's round kernels, one per phase of the round (docs/design.md §3),
// each a plain function of the round's params struct and a stream; the expert GEMMs are a backend's
// (experts/backend.hpp). Grids come from occupancy on the token bucket's SMs, the round's own
// kernels capped by the bucket's largest T (I5, round_shapes), never from T.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda/cuda_check.hpp"
#include "cuda/round_grid_caps.hpp"
#include "cuda/round_params.hpp"
#include "epmoe/config.hpp"
#include "epmoe/errors.hpp"

namespace epmoe::cuda {

namespace experts {
class ExpertBackend;
struct ExpertStep;
}  // namespace experts

inline constexpr int kThreads = 256;  // every kernel: 8 warps

struct KernelShape {
  int grid = 0;
  std::size_t smem = 0;
  int threads = kThreads;  // per CTA: kThreads, or a warp-specialized kernel's own count
};

// The SMs a chain's grids are sized for: every SM of `device` (num_sms = 0, Knobs::num_sms'
// default), else at most num_sms of them.
inline int grid_sms(int device, int num_sms) {
  int sms = 0;
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return num_sms > 0 ? std::min(num_sms, sms) : sms;
}

// I5: as many CTAs as fit at once on grid_sms(device, num_sms) SMs with `smem` bytes of dynamic
// shared memory. Never a function of T: num_sms is the knob of a token bucket, and every shape is
// computed once per bucket at creation (per_bucket); forward only picks the bucket's. Raises the
// kernel's dynamic shared memory limit first when it needs more than the default.
// NOTES: this caps the CTAs, not where they run: the block scheduler may spread num_sms SMs' worth
// of CTAs over more SMs than num_sms; only the wgmma backend's persistent GEMMs, one CTA per SM,
// occupy exactly that many.
// `threads`: per CTA (a warp-specialized kernel's own count).
template <class Kernel>
KernelShape occupancy_shape(Kernel kernel, std::size_t smem, int device, int num_sms,
                            int threads = kThreads) {
  if (smem > 0)
    EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
  int per_sm = 0;
  EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return KernelShape{(per_sm > 0 ? per_sm : 1) * grid_sms(device, num_sms), smem, threads};
}

// One value per token bucket, made from that bucket's knobs (make(knobs), or make(knobs, bucket)
// where it takes the bucket too): the shapes (and a backend's GEMMs) are built once at creation,
// and each forward picks its bucket's from T on the host.
template <class T>
using PerBucket = std::array<T, kNumTokenBuckets>;
template <class Make>
auto per_bucket(const LayerConfig& config, Make make) {
  const auto one = [&](TokenBucket bucket) {
    if constexpr (std::is_invocable_v<Make, const Knobs&, TokenBucket>)
      return make(config.knobs(bucket), bucket);
    else
      return make(config.knobs(bucket));
  };
  PerBucket<decltype(one(TokenBucket::decode))> out{};
  for (int b = 0; b < kNumTokenBuckets; ++b) out[b] = one(static_cast<TokenBucket>(b));
  return out;
}
// `s` with at most `ctas` CTAs (and at least one).
inline KernelShape at_most(KernelShape s, std::int64_t ctas) {
  s.grid = static_cast<int>(std::clamp<std::int64_t>(ctas, 1, s.grid));
  return s;
}
inline int bucket_index(TokenBucket b) {
  return static_cast<int>(b);
}

// Launches `kernel` with shape.threads per CTA and one launch attribute.
template <class... Params, class... Args>
void launch_with(const cudaLaunchAttribute& attribute, void (*kernel)(Params...),
                 const KernelShape& shape, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(shape.grid));
  config.blockDim = dim3(static_cast<unsigned>(shape.threads));
  config.dynamicSmemBytes = shape.smem;
  config.stream = stream;
  cudaLaunchAttribute attributes[1] = {attribute};
  config.attrs = attributes;
  config.numAttrs = 1;
  EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Whether the chain's kernels are launched with programmatic dependent launch (launch_chained and
// the wgmma backend's CUTLASS GEMMs): yes, unless $EPMOE_PDL is 0, which launches them in plain
// stream order (their griddepcontrol waits then do nothing) — to tell a PDL fault from another,
// and to time what PDL buys within one build. Read once per process; CudaLayer's creation reads
// it first, so a bad value fails there.
inline bool programmatic_launch() {
  static const bool on = [] {
    const char* v = std::getenv("EPMOE_PDL");
    if (v == nullptr || std::string(v) == "1") return true;
    if (std::string(v) == "0") return false;
    throw Error(
        ErrorCode::invalid_argument,
        std::string("EPMOE_PDL=") + v + ": must be 0 (plain stream order) or 1 (the default)");
  }();
  return on;
}

// Launches a kernel of the round chain after its predecessor on `stream` with programmatic
// dependent launch (docs/design.md §4): the launch is queued before the predecessor completes,
// and every chain kernel's prologue (join_round / start_round: griddepcontrol.wait) holds its
// CTAs until the predecessor has completed and its memory is visible, before any global access.
// Not for dispatch, the first kernel of a forward. (The wgmma backend's CUTLASS GEMMs get the same
// wait and attribute through parts::WaitsForPreviousKernel.)
template <class... Params, class... Args>
void launch_chained(void (*kernel)(Params...), const KernelShape& shape, cudaStream_t stream,
                    Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = programmatic_launch() ? 1 : 0;
  launch_with(attribute, kernel, shape, stream, std::forward<Args>(args)...);
}

// Steps 1-3: prepare the accumulator, push rows (quantized on the fly) to their owners, publish
// counts to every rank. `warps` per CTA: Knobs::dispatch_warps (kKnobSpace's range).
KernelShape dispatch_shape(const RoundParams& p, int device, int num_sms, int warps);
void launch_dispatch(const RoundParams& p, const KernelShape& s, cudaStream_t stream);

// Steps 4-6: wait for every count, run the expert backend's FC1 -> SwiGLU -> FC2 on every arrived
// (row, expert), send results home, publish done to every rank. Route and bucket are the round's
// kernels (src/cuda/experts.cu) over a route scratch of route_scratch_bytes(), allocated once per
// layer and sliced by route_scratch(); the GEMMs are the backend's.
struct ExpertShapes {
  KernelShape route, bucket;
};
std::size_t route_scratch_bytes(const RoundParams& p);
RouteScratch route_scratch(std::uint8_t* base, const RoundParams& p);
ExpertShapes experts_shape(const RoundParams& p, int device, int num_sms);
experts::ExpertStep expert_step(const RoundParams& p);  // what the backend's launches receive
// `bucket`: the launch's token bucket; the backend runs what it built for that bucket's knobs.
void launch_experts(const RoundParams& p, const ExpertShapes& s, TokenBucket bucket,
                    const experts::ExpertBackend& backend, cudaStream_t stream);

// Step 7: wait for every done, finish y, advance the round.
KernelShape combine_shape(const RoundParams& p, int device, int num_sms);
void launch_combine(const RoundParams& p, const KernelShape& s, cudaStream_t stream);

// The chain's own grids for one token bucket (I5): each from occupancy on the bucket's num_sms SMs
// (the shapes above), then capped by the work the bucket's largest T can bring (round_grid_caps).
// Past those, CTAs would only take the kernel's ticket (and, in route and combine, each wait for
// the peers' messages): on one H200 the decode bucket's full grids cost 6-7 us of a 40 us idle
// round (bench/RESULTS.md, session 18).
struct RoundShapes {
  KernelShape dispatch;
  ExpertShapes experts;
  KernelShape combine;
};
inline RoundShapes round_shapes(const RoundParams& p, int device, int num_sms, int dispatch_warps,
                                std::int64_t max_tokens) {
  const RoundGridCaps caps = round_grid_caps(max_tokens, p.world, kThreads);
  const ExpertShapes experts = experts_shape(p, device, num_sms);
  return RoundShapes{at_most(dispatch_shape(p, device, num_sms, dispatch_warps), caps.per_token),
                     ExpertShapes{at_most(experts.route, caps.per_row),
                                  at_most(experts.bucket, caps.per_row_warp)},
                     at_most(combine_shape(p, device, num_sms), caps.per_token)};
}

// The collective reset(): two bounded meetings, own inboxes and the round state cleared between.
// `outcome` (mapped host memory): 0 = ok, else 1 + the peer that did not arrive.
void launch_reset(const RoundParams& p, std::uint32_t first_epoch, std::int32_t* outcome,
                  cudaStream_t stream);

// Fault switches (test builds): sleep on the GPU; move the device round counter.
void launch_stall(std::uint64_t ns, cudaStream_t stream);
void launch_round_jump(RoundState* state, std::uint32_t by, cudaStream_t stream);

}  // namespace epmoe::cuda
