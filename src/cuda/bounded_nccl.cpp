#include "cuda/bounded_nccl.hpp"

#include <algorithm>
#include <thread>

namespace epmoe::cuda {

HostDeadline HostDeadline::after_ms(std::uint32_t timeout_ms) {
  HostDeadline d;
  d.timeout_ms_ = timeout_ms;
  d.at_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  return d;
}

NcclWait await_nccl(ncclResult_t issued, std::span<const ncclComm_t> comms,
                    const HostDeadline& deadline, const std::function<bool()>& stop) {
  const auto start = std::chrono::steady_clock::now();
  NcclWait out;
  const auto finish = [&](NcclWaitStatus status) {
    out.status = status;
    out.waited_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - start)
                        .count();
    return out;
  };
  if (issued != ncclSuccess && issued != ncclInProgress) {
    out.result = issued;
    return finish(NcclWaitStatus::failed);
  }
  for (std::uint32_t attempt = 0;; ++attempt) {
    bool in_progress = false;
    for (std::size_t i = 0; i < comms.size(); ++i) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t polled = ncclCommGetAsyncError(comms[i], &state);
      if (polled != ncclSuccess) state = polled;
      if (state == ncclInProgress) {
        in_progress = true;
      } else if (state != ncclSuccess) {
        out.result = state;
        out.comm = i;
        return finish(NcclWaitStatus::failed);
      }
    }
    if (!in_progress) return finish(NcclWaitStatus::done);
    if (stop && stop()) return finish(NcclWaitStatus::stopped);
    if (deadline.passed()) return finish(NcclWaitStatus::expired);
    // 20 us doubling every 8 polls, at most 1 ms: NCCL's setup takes milliseconds, not
    // microseconds.
    const std::uint32_t doublings = std::min<std::uint32_t>(attempt / 8, 6);
    std::this_thread::sleep_for(std::chrono::microseconds(std::min(20u << doublings, 1000u)));
  }
}

std::string describe_nccl_error(ncclResult_t result) {
  std::string s = ncclGetErrorString(result);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') s += std::string(" (NCCL: ") + last + ")";
  return s;
}

}  // namespace epmoe::cuda
