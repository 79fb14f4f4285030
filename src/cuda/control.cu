// The CUDA executor's small control kernels: LSA peer pointers at layer creation, the collective
// reset(), and the fault switches of test builds.
#include <nccl_device.h>

#include "cuda/cuda_check.hpp"
#include "cuda/device_common.cuh"
#include "cuda/kernels.hpp"
#include "cuda/peers.hpp"

namespace epmoe::cuda {
namespace {

// LSA peer i of this rank is world rank first_lsa_rank + i (one NVLink domain: consecutive ranks).
__global__ void peer_windows_kernel(ncclWindow_t window, int first_lsa_rank, std::uint8_t** bases,
                                    int world) {
  for (int peer = threadIdx.x; peer < world; peer += blockDim.x)
    bases[peer] = static_cast<std::uint8_t*>(ncclGetLsaPointer(window, 0, peer - first_lsa_rank));
}

__global__ void reset_kernel(RoundParams p, std::uint32_t first_epoch, std::int32_t* outcome) {
  const protocol::ResetSession<DevicePeers> session(p.layout, DevicePeers{p.peer_windows}, p.rank);
  DevicePlatform platform;
  protocol::WaitOutcome w =
      session.meet(first_epoch, protocol::deadline_after_ms(platform, p.timeout_ms), platform);
  if (w.status == protocol::WaitStatus::ok) {
    session.clear_own_inboxes();
    p.state->round = protocol::kFirstRound;
    p.state->failed = 0;
    for (auto& t : p.state->tickets) t = 0;
    p.state->barrier_arrived = 0;
    for (int r = 0; r < kMaxWorld; ++r) p.state->rows_to[r] = 0;
    __threadfence_system();
    w = session.meet(first_epoch + 1, protocol::deadline_after_ms(platform, p.timeout_ms),
                     platform);
  }
  *outcome = w.status == protocol::WaitStatus::ok ? 0 : 1 + w.peer;
  __threadfence_system();
}

__global__ void stall_kernel(std::uint64_t ns) {
  DevicePlatform platform;
  const std::uint64_t until = platform.now_ns() + ns;
  for (std::uint32_t i = 0; platform.now_ns() < until; ++i) platform.pause(i);
}

__global__ void round_jump_kernel(RoundState* state, std::uint32_t by) {
  state->round += by;
}

}  // namespace

void compute_peer_windows(ncclComm_t comm, ncclWindow_t window, int rank, int world,
                          std::uint8_t** bases, cudaStream_t stream) {
  // Every peer must be a load/store peer (same NVLink domain); the LSA team is consecutive ranks.
  const ncclTeam_t lsa = ncclTeamLsa(comm);
  if (lsa.nRanks != world || lsa.stride != 1)
    throw Error(ErrorCode::unsupported,
                "Layer: only " + std::to_string(lsa.nRanks) + " of the " + std::to_string(world) +
                    " ranks share rank " + std::to_string(rank) +
                    "'s NVLink domain (LSA team); multi-node EP is not supported yet");
  peer_windows_kernel<<<1, 64, 0, stream>>>(window, rank - lsa.rank, bases, world);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void launch_reset(const RoundParams& p, std::uint32_t first_epoch, std::int32_t* outcome,
                  cudaStream_t stream) {
  reset_kernel<<<1, 1, 0, stream>>>(p, first_epoch, outcome);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_stall(std::uint64_t ns, cudaStream_t stream) {
  stall_kernel<<<1, 1, 0, stream>>>(ns);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_round_jump(RoundState* state, std::uint32_t by, cudaStream_t stream) {
  round_jump_kernel<<<1, 1, 0, stream>>>(state, by);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda
