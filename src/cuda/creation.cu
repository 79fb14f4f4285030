#include "cuda/creation.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/device_common.cuh"

namespace epmoe::cuda {
namespace {

struct ControlPeers {
  std::uint8_t* const* bases;
  __host__ __device__ std::uint8_t* window(int rank) const { return bases[rank]; }
};
using Session = protocol::CreationSession<ControlPeers>;

// The round's clock (DevicePlatform, device_common.cuh) with a longer backoff: creation is not
// latency-bound, so the pause goes up to 8 us.
struct MeetingClock : DevicePlatform {
  __host__ __device__ void pause(std::uint32_t attempt) const {
#if defined(__CUDA_ARCH__)
    __nanosleep(128u << (attempt < 24 ? attempt / 4 : 6));
#else
    (void)attempt;
#endif
  }
};

__global__ void creation_meeting_kernel(ControlWindows w, std::uint32_t creation,
                                        const std::uint64_t* line, std::uint32_t timeout_ms,
                                        CreationOutcome* outcome) {
  const Session session(w.layout, ControlPeers{w.bases}, w.rank, creation);
  MeetingClock clock;
  session.say_hello(line);
  const protocol::WaitOutcome r =
      session.await_hellos(protocol::deadline_after_ms(clock, timeout_ms), clock);
  if (r.status == protocol::WaitStatus::timeout) session.give_up(r.peer);
  if (r.status == protocol::WaitStatus::violation) session.give_up(-1);
  outcome->status = static_cast<std::int32_t>(r.status);
  outcome->peer = r.peer;
  outcome->observed = r.observed;
  outcome->culprit =
      r.status == protocol::WaitStatus::aborted ? Session::culprit_of(r.abort_word) : r.peer;
  __threadfence_system();
}

__global__ void give_up_kernel(ControlWindows w, std::uint32_t creation) {
  Session(w.layout, ControlPeers{w.bases}, w.rank, creation).give_up(-1);
  __threadfence_system();
}

}  // namespace

void launch_creation_meeting(const ControlWindows& w, std::uint32_t creation,
                             const std::uint64_t* line, std::uint32_t timeout_ms,
                             CreationOutcome* outcome, cudaStream_t stream) {
  creation_meeting_kernel<<<1, 1, 0, stream>>>(w, creation, line, timeout_ms, outcome);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_give_up(const ControlWindows& w, std::uint32_t creation, cudaStream_t stream) {
  give_up_kernel<<<1, 1, 0, stream>>>(w, creation);
  EPMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace epmoe::cuda
