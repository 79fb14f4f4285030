// The layer-creation meeting on the GPU (protocol/creation.hpp, docs/design.md §6.1): one thread
// writes this rank's config line and hello into every rank's control window through LSA pointers,
// then waits for everyone's, bounded by the layer's timeout; when it gives up it marks the
// creation as given up in every rank's window, so late ranks fail at once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "protocol/creation.hpp"

namespace epmoe::cuda {

// Every rank's control window as this GPU addresses it.
struct ControlWindows {
  protocol::CreationLayout layout;
  std::uint8_t* const* bases = nullptr;  // device array [world] of LSA pointers
  int rank = 0;
};

// What the meeting found, written by the kernel into mapped pinned host memory; read by the host
// once the stream has drained.
struct CreationOutcome {
  std::int32_t status;     // protocol::WaitStatus
  std::int32_t peer;       // see CreationSession::await_hellos
  std::uint32_t observed;  // the creation number last seen from `peer`
  std::int32_t culprit;    // aborted: whom `peer` waited for in vain (-1: it failed itself)
};

// Says hello to creation `creation` with `line` (device memory, kConfigLineBytes, NUL-padded) and
// waits for every rank's hello (0 = forever); gives up in every window on timeout (naming the rank
// it waited for) or violation.
void launch_creation_meeting(const ControlWindows& w, std::uint32_t creation,
                             const std::uint64_t* line, std::uint32_t timeout_ms,
                             CreationOutcome* outcome, cudaStream_t stream);

// Marks creation `creation` as given up in every rank's control window (a rank that failed after
// its hello).
void launch_give_up(const ControlWindows& w, std::uint32_t creation, cudaStream_t stream);

}  // namespace epmoe::cuda
