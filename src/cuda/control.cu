// The CUDA executor's small control kernels: LSA peer pointers at layer creation, the collective
// reset(), and the fault switches of test builds.
#include <nccl_device.h>

#include "cuda/cuda_check.hpp"
#include "cuda/device_common.cuh"
#include "cuda/kernels.hpp"
#include "cuda/peers.hpp"

namespace epmoe::cuda {
namespace {

__global__ void peer_windows_kernel(ncclWindow_t window, ncclDevComm dev_comm, std::uint8_t** bases,
                                    int world, int* missing) {
  const ncclTeam world_team = ncclTeamWorld(dev_comm);
  const ncclTeam lsa = ncclTeamLsa(dev_comm);
  for (int peer = threadIdx.x; peer < world; peer += blockDim.x) {
    if (!ncclTeamRankIsMember(lsa, world_team, peer)) {
      *missing = peer + 1;
      bases[peer] = nullptr;
      continue;
    }
    const int lsa_peer = ncclTeamRankToTeam(lsa, world_team, peer);
    bases[peer] = static_cast<std::uint8_t*>(ncclGetLsaPointer(window, 0, lsa_peer));
  }
}

__global__ void reset_kernel(ForwardParams p, std::uint32_t first_epoch, std::int32_t* outcome) {
  const protocol::ResetSession<DevicePeers> session(p.layout, DevicePeers{p.peer_windows}, p.rank);
  DevicePlatform platform;
  protocol::WaitOutcome w =
      session.meet(first_epoch, protocol::deadline_after_ms(platform, p.timeout_ms), platform);
  if (w.status == protocol::WaitStatus::ok) {
    session.clear_own_inboxes();
    p.state->round = protocol::kFirstRound;
    p.state->failed = 0;
    for (auto& t : p.state->tickets) t = 0;
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

void compute_peer_windows(ncclWindow_t window, const ncclDevComm& dev_comm, std::uint8_t** bases,
                          int world, cudaStream_t stream) {
  int* missing = nullptr;
  EPMOE_CUDA_CHECK(cudaMallocAsync(&missing, sizeof(int), stream));
  EPMOE_CUDA_CHECK(cudaMemsetAsync(missing, 0, sizeof(int), stream));
  peer_windows_kernel<<<1, 64, 0, stream>>>(window, dev_comm, bases, world, missing);
  EPMOE_CUDA_CHECK(cudaGetLastError());
  int host_missing = 0;
  EPMOE_CUDA_CHECK(
      cudaMemcpyAsync(&host_missing, missing, sizeof(int), cudaMemcpyDeviceToHost, stream));
  EPMOE_CUDA_CHECK(cudaFreeAsync(missing, stream));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (host_missing != 0)
    throw Error(ErrorCode::unsupported,
                "Layer: rank " + std::to_string(host_missing - 1) +
                    " is outside this GPU's NVLink domain (LSA team); multi-node EP is not "
                    "supported yet");
}

void launch_reset(const ForwardParams& p, std::uint32_t first_epoch, std::int32_t* outcome,
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
