// A rank of the CUDA executor: one NCCL communicator bound to one GPU. The communicator is
// non-blocking and every NCCL call on it is awaited against a deadline (bounded_nccl.hpp), so
// creating it, creating a layer on it and tearing it down all end, with an error naming what was
// missing, when a peer does not come (docs/design.md §6.1).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cuda/bounded_nccl.hpp"
#include "cuda/creation.hpp"
#include "epmoe/comm.hpp"

namespace epmoe::cuda {

class NcclCommunicator;

// One layer's symmetric window: one ncclMemAlloc'd region, zeroed, registered with the
// communicator (NCCL_WIN_COLL_SYMMETRIC, bounded by NcclCommunicator::await_layer_call), with every
// rank's LSA base in a device array. Its destructor deregisters it (local in NCCL 2.28; skipped
// after an abort, which has released it) and frees it.
class SymmetricWindow {
 public:
  SymmetricWindow() = default;
  // Collective, after NcclCommunicator::meet_for_layer on every rank.
  SymmetricWindow(NcclCommunicator& comm, std::size_t bytes);
  ~SymmetricWindow() { release(); }
  SymmetricWindow(SymmetricWindow&& other) noexcept;
  SymmetricWindow& operator=(SymmetricWindow&& other) noexcept;
  SymmetricWindow(const SymmetricWindow&) = delete;
  SymmetricWindow& operator=(const SymmetricWindow&) = delete;

  void* base() const { return base_; }
  std::uint8_t** peers() const { return peers_; }  // device array [world]: every rank's base

 private:
  void release() noexcept;

  NcclCommunicator* comm_ = nullptr;
  void* base_ = nullptr;
  ncclWindow_t window_ = nullptr;
  std::uint8_t** peers_ = nullptr;
};

class NcclCommunicator final : public Communicator {
 public:
  // Takes over `comm`, whose (non-blocking) creation has completed. `timeout_ms` bounds every
  // later NCCL call on it (0 = no bound).
  NcclCommunicator(ncclComm_t comm, int rank, int world, int device, std::uint32_t timeout_ms)
      : comm_(comm), rank_(rank), world_(world), device_(device), timeout_ms_(timeout_ms) {}
  // Local or bounded: ncclCommFinalize awaited up to the timeout, else ncclCommAbort. Never
  // throws; a finalize that did not complete is reported on stderr.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  Backend backend() const override { return Backend::cuda_nccl; }
  Device device() const override { return Device{DeviceKind::cuda, device_}; }
  void abort() noexcept override;
  ncclComm_t nccl() const { return comm_; }
  int cuda_device() const { return device_; }
  cudaStream_t stream() const { return stream_; }  // the communicator's own (creation) stream
  // A layer's reset() found a peer missing (it may be dead): destruction aborts instead of
  // finalizing, which would wait on that peer. A later successful reset() clears it.
  void set_peer_missing(bool missing) { peer_missing_.store(missing); }
  bool aborted() const { return aborted_.load(); }

  // Collective over every rank of `comms` (one process driving them all, or this rank alone):
  // each rank's control window (protocol/creation.hpp), registered within `deadline`. On failure
  // every communicator of `comms` is aborted and Error is thrown, `who` naming the caller.
  static void open_control_windows(std::span<NcclCommunicator* const> comms,
                                   const HostDeadline& deadline, const std::string& who);

  // Layer creation, first step (collective): meets every rank's next layer creation on this
  // communicator through the control windows, waiting at most `timeout_ms` (the layer's; 0 =
  // forever), and returns every rank's config line. No NCCL call is involved, so when a rank does
  // not come the error names it (timeout) and the communicator stays usable: a late rank finds
  // the creation given up (peer_aborted) and every rank can create the layer again.
  std::vector<std::string> meet_for_layer(const std::string& describe, std::uint32_t timeout_ms);

  // Completes an NCCL call of the current layer creation (made after meet_for_layer; `issued` is
  // what it returned), bounded by this communicator's timeout. If it fails, expires, or another
  // rank gives up on this creation meanwhile, this rank gives up too, aborts the communicator (the
  // only way to end a started NCCL call) and throws, naming the rank when it can be known.
  void await_layer_call(ncclResult_t issued, const char* call);

  // This rank's creation failed after meet_for_layer: tells every rank, so none waits for it in an
  // NCCL call. Best effort; nothing after an abort (the control windows are gone).
  void give_up_layer() noexcept;

 private:
  // 0-based, as the CPU executor numbers layers: "layer #k".
  std::string layer_name() const { return "layer #" + std::to_string(creation_ - 1); }
  ControlWindows control() const;
  // The lowest other rank that gave up on the current creation; -1 when none (or unknown).
  int peer_gave_up() noexcept;
  [[noreturn]] void fail_meeting(const CreationOutcome& outcome, std::uint32_t timeout_ms);
  void finalize_or_abort() noexcept;
  void free_control_window() noexcept;

  ncclComm_t comm_;
  int rank_, world_, device_;
  std::uint32_t timeout_ms_;
  std::atomic<bool> peer_missing_{false};
  std::atomic<bool> aborted_{false};

  // The control window and what the creation meeting needs.
  cudaStream_t stream_ = nullptr;
  void* control_base_ = nullptr;
  ncclWindow_t control_window_ = nullptr;
  std::uint8_t** control_peers_ = nullptr;   // device [world]
  std::uint64_t* line_ = nullptr;            // device: this rank's config line
  CreationOutcome* outcome_host_ = nullptr;  // mapped pinned
  CreationOutcome* outcome_device_ = nullptr;
  std::uint64_t* words_host_ = nullptr;  // pinned: a copy of this rank's hello or gave-up words
  std::uint32_t creation_ = 0;           // the current (last started) layer creation, from 1
  bool gave_up_ = false;                 // this rank gave up on creation_
};

}  // namespace epmoe::cuda
