// Bounded waits on NCCL's non-blocking calls (docs/design.md §6.1).
//
// Every communicator epmoe makes is non-blocking (ncclConfig_t::blocking = 0): a call that involves
// the peers (ncclCommInitRankConfig, ncclCommWindowRegister, ncclCommFinalize, ...) returns
// ncclInProgress at once and finishes on an NCCL thread, and ncclCommGetAsyncError tells when.
// await_nccl polls it against a deadline, so no NCCL call on the host waits without a bound. When
// the deadline passes, the caller ends the operation with ncclCommAbort, the only way to end a hung
// NCCL operation; the communicator is then broken for good.
#pragma once

#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

namespace epmoe::cuda {

// A host deadline from a timeout in milliseconds; 0 = never (as LayerOptions::timeout_ms).
class HostDeadline {
 public:
  static HostDeadline after_ms(std::uint32_t timeout_ms);
  bool forever() const { return timeout_ms_ == 0; }
  bool passed() const { return !forever() && std::chrono::steady_clock::now() > at_; }
  std::uint32_t timeout_ms() const { return timeout_ms_; }

 private:
  std::chrono::steady_clock::time_point at_{};
  std::uint32_t timeout_ms_ = 0;
};

enum class NcclWaitStatus {
  done,     // every communicator finished the call successfully
  failed,   // NCCL reported an error (result, comm)
  expired,  // the deadline passed while the call was still in progress
  stopped,  // `stop` asked to end the wait early
};

struct NcclWait {
  NcclWaitStatus status = NcclWaitStatus::done;
  ncclResult_t result = ncclSuccess;  // failed: NCCL's error
  std::size_t comm = 0;               // failed: the index of the communicator in `comms`
  std::int64_t waited_ms = 0;
};

// Completes a call made on `comms`: `issued` is what the call (or ncclGroupEnd) returned. Polls
// ncclCommGetAsyncError of every communicator until none is in progress or the deadline passes.
// `stop`, when given, is asked between polls; returning true ends the wait (status stopped).
NcclWait await_nccl(ncclResult_t issued, std::span<const ncclComm_t> comms,
                    const HostDeadline& deadline, const std::function<bool()>& stop = {});

// NCCL's name for `result` and, when there is one, its last error message.
std::string describe_nccl_error(ncclResult_t result);

}  // namespace epmoe::cuda
