#include "cuda/nccl_comm.hpp"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "cuda/cuda_check.hpp"
#include "cuda/peers.hpp"
#include "epmoe/config.hpp"

namespace epmoe {

namespace cuda {
namespace {

// What an NCCL failure means to the caller: a peer that went away, or something else.
ErrorCode code_of(ncclResult_t result) {
  return result == ncclRemoteError ? ErrorCode::peer_aborted : ErrorCode::internal;
}

constexpr const char* kRebuild =
    "the communicator was aborted (ncclCommAbort, the only way to end a started NCCL call): "
    "destroy its layers and it (both local now) and rebuild on every rank from a fresh unique id";

}  // namespace

// ---- SymmetricWindow ----

SymmetricWindow::SymmetricWindow(NcclCommunicator& comm, std::size_t bytes) : comm_(&comm) {
  try {
    EPMOE_CUDA_CHECK(cudaSetDevice(comm.cuda_device()));
    EPMOE_NCCL_CHECK(ncclMemAlloc(&base_, bytes));  // local: a cuMem allocation
    EPMOE_CUDA_CHECK(cudaMemsetAsync(base_, 0, bytes, comm.stream()));
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(comm.stream()));  // zero before any peer can write
    comm.await_layer_call(
        ncclCommWindowRegister(comm.nccl(), base_, bytes, &window_, NCCL_WIN_COLL_SYMMETRIC),
        "ncclCommWindowRegister");
    if (window_ == nullptr)
      throw Error(ErrorCode::unsupported,
                  "Layer creation on rank " + std::to_string(comm.rank()) +
                      ": NCCL registered no symmetric window (symmetric memory needs cuMem and "
                      "NVLink peers; is NCCL_CUMEM_ENABLE=0 set?)");
    EPMOE_CUDA_CHECK(cudaMalloc(&peers_, sizeof(std::uint8_t*) * kMaxWorld));
    compute_peer_windows(comm.nccl(), window_, comm.rank(), comm.world(), peers_, comm.stream());
  } catch (...) {
    comm.give_up_layer();
    release();
    throw;
  }
}

SymmetricWindow::SymmetricWindow(SymmetricWindow&& other) noexcept
    : comm_(other.comm_), base_(other.base_), window_(other.window_), peers_(other.peers_) {
  other.comm_ = nullptr;
  other.base_ = nullptr;
  other.window_ = nullptr;
  other.peers_ = nullptr;
}

SymmetricWindow& SymmetricWindow::operator=(SymmetricWindow&& other) noexcept {
  if (this != &other) {
    release();
    comm_ = other.comm_;
    base_ = other.base_;
    window_ = other.window_;
    peers_ = other.peers_;
    other.comm_ = nullptr;
    other.base_ = nullptr;
    other.window_ = nullptr;
    other.peers_ = nullptr;
  }
  return *this;
}

void SymmetricWindow::release() noexcept {
  if (comm_ == nullptr) return;
  cudaSetDevice(comm_->cuda_device());
  // Local in NCCL 2.28 (no peer takes part), so a dead peer cannot make it wait; after an abort
  // NCCL has already released the window.
  if (window_ != nullptr && !comm_->aborted()) ncclCommWindowDeregister(comm_->nccl(), window_);
  if (base_ != nullptr) ncclMemFree(base_);
  cudaFree(peers_);
  comm_ = nullptr;
  base_ = nullptr;
  window_ = nullptr;
  peers_ = nullptr;
}

// ---- NcclCommunicator ----

NcclCommunicator::~NcclCommunicator() {
  if (peer_missing_.load()) abort();
  cudaSetDevice(device_);
  if (!aborted_.load()) {
    if (control_window_ != nullptr) ncclCommWindowDeregister(comm_, control_window_);  // local
    control_window_ = nullptr;
    finalize_or_abort();
  }
  free_control_window();
}

void NcclCommunicator::abort() noexcept {
  if (aborted_.exchange(true)) return;
  cudaSetDevice(device_);
  // Local: ends any NCCL call in progress and frees this rank's resources, windows included,
  // without its peers.
  ncclCommAbort(comm_);
}

void NcclCommunicator::finalize_or_abort() noexcept {
  const HostDeadline deadline = HostDeadline::after_ms(timeout_ms_);
  const NcclWait w = await_nccl(ncclCommFinalize(comm_), {&comm_, 1}, deadline);
  if (w.status == NcclWaitStatus::done) {
    ncclCommDestroy(comm_);  // local once finalized
    aborted_.store(true);    // gone: nothing may use it any more
    return;
  }
  const std::string why = w.status == NcclWaitStatus::expired
                              ? "did not complete within " + std::to_string(timeout_ms_) + " ms"
                              : "failed: " + describe_nccl_error(w.result);
  std::fprintf(stderr,
               "epmoe: rank %d: ncclCommFinalize %s; the communicator was aborted instead "
               "(ncclCommAbort)\n",
               rank_, why.c_str());
  abort();
}

void NcclCommunicator::free_control_window() noexcept {
  if (control_base_ != nullptr) ncclMemFree(control_base_);
  cudaFree(control_peers_);
  cudaFree(line_);
  cudaFreeHost(outcome_host_);
  cudaFreeHost(words_host_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  control_base_ = nullptr;
  control_peers_ = nullptr;
  line_ = nullptr;
  outcome_host_ = nullptr;
  words_host_ = nullptr;
  stream_ = nullptr;
}

void NcclCommunicator::open_control_windows(std::span<NcclCommunicator* const> comms,
                                            const HostDeadline& deadline, const std::string& who) {
  std::vector<ncclComm_t> handles;
  try {
    for (NcclCommunicator* c : comms) {
      handles.push_back(c->comm_);
      const protocol::CreationLayout layout{c->world_};
      EPMOE_CUDA_CHECK(cudaSetDevice(c->device_));
      EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking));
      EPMOE_NCCL_CHECK(ncclMemAlloc(&c->control_base_, layout.total()));
      EPMOE_CUDA_CHECK(cudaMemsetAsync(c->control_base_, 0, layout.total(), c->stream_));
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(c->stream_));  // zero before any peer can write
      EPMOE_CUDA_CHECK(cudaMalloc(&c->control_peers_, sizeof(std::uint8_t*) * kMaxWorld));
      EPMOE_CUDA_CHECK(cudaMalloc(&c->line_, protocol::kConfigLineBytes));
      EPMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&c->outcome_host_),
                                     sizeof(CreationOutcome), cudaHostAllocMapped));
      EPMOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&c->outcome_device_),
                                                c->outcome_host_, 0));
      EPMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&c->words_host_),
                                     sizeof(std::uint64_t) * kMaxWorld, cudaHostAllocDefault));
    }
    // Collective: grouped, so that one thread can register for every rank of its process. Nothing
    // throws between ncclGroupStart and ncclGroupEnd (the group would stay open).
    ncclResult_t issued = ncclGroupStart();
    cudaError_t device_error = cudaSuccess;
    for (NcclCommunicator* c : comms) {
      const cudaError_t e = cudaSetDevice(c->device_);
      if (e != cudaSuccess) {
        device_error = e;
        continue;
      }
      const ncclResult_t r = ncclCommWindowRegister(c->comm_, c->control_base_,
                                                    protocol::CreationLayout{c->world_}.total(),
                                                    &c->control_window_, NCCL_WIN_COLL_SYMMETRIC);
      if (r != ncclSuccess && r != ncclInProgress && issued == ncclSuccess) issued = r;
    }
    const ncclResult_t end = ncclGroupEnd();
    if (issued == ncclSuccess) issued = end;
    EPMOE_CUDA_CHECK(device_error);
    const NcclWait w = await_nccl(issued, handles, deadline);
    if (w.status == NcclWaitStatus::expired)
      throw Error(ErrorCode::timeout,
                  who + ": timed out after " + std::to_string(deadline.timeout_ms()) +
                      " ms in ncclCommWindowRegister of the communicator's control window, "
                      "waiting for every rank (NCCL does not say which one is missing); " +
                      "the communicator was aborted: make a fresh unique id and create the "
                      "communicator on every rank again");
    if (w.status != NcclWaitStatus::done)
      throw Error(code_of(w.result), who +
                                         ": ncclCommWindowRegister of the control window failed: " +
                                         describe_nccl_error(w.result));
    for (NcclCommunicator* c : comms) {
      if (c->control_window_ == nullptr)
        throw Error(ErrorCode::unsupported,
                    who +
                        ": NCCL registered no symmetric window (symmetric memory needs cuMem "
                        "and NVLink peers; is NCCL_CUMEM_ENABLE=0 set?)");
      EPMOE_CUDA_CHECK(cudaSetDevice(c->device_));
      compute_peer_windows(c->comm_, c->control_window_, c->rank_, c->world_, c->control_peers_,
                           c->stream_);
    }
  } catch (...) {
    for (NcclCommunicator* c : comms) c->abort();
    throw;
  }
}

ControlWindows NcclCommunicator::control() const {
  return ControlWindows{protocol::CreationLayout{world_}, control_peers_, rank_};
}

std::vector<std::string> NcclCommunicator::meet_for_layer(const std::string& describe,
                                                          std::uint32_t timeout_ms) {
  if (aborted_.load())
    throw Error(ErrorCode::invalid_argument,
                "Layer creation on rank " + std::to_string(rank_) +
                    ": the communicator was aborted; rebuild it on every rank from a fresh "
                    "unique id");
  if (describe.size() >= protocol::kConfigLineBytes)
    throw Error(ErrorCode::internal, "Layer: config description too long for the control window");
  EPMOE_CUDA_CHECK(cudaSetDevice(device_));
  ++creation_;
  gave_up_ = false;
  std::vector<char> line(protocol::kConfigLineBytes, '\0');
  std::memcpy(line.data(), describe.data(), describe.size());
  // On the meeting's stream: a plain cudaMemcpy from pageable memory may return before its DMA
  // is done, and the kernel's stream does not wait for the legacy stream.
  EPMOE_CUDA_CHECK(
      cudaMemcpyAsync(line_, line.data(), line.size(), cudaMemcpyHostToDevice, stream_));
  outcome_host_->status = -1;
  launch_creation_meeting(control(), creation_, line_, timeout_ms, outcome_device_, stream_);
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the meeting's wait is bounded
  const CreationOutcome outcome = *outcome_host_;    // the stream has drained: the kernel wrote it
  if (outcome.status != static_cast<std::int32_t>(protocol::WaitStatus::ok))
    fail_meeting(outcome, timeout_ms);

  const protocol::CreationLayout layout{world_};
  std::vector<char> lines(protocol::kConfigLineBytes * static_cast<std::size_t>(world_));
  EPMOE_CUDA_CHECK(cudaMemcpy(
      lines.data(), static_cast<std::uint8_t*>(control_base_) + layout.config_line(0, creation_),
      lines.size(), cudaMemcpyDeviceToHost));
  std::vector<std::string> out;
  for (int r = 0; r < world_; ++r) {
    const char* l = lines.data() + protocol::kConfigLineBytes * static_cast<std::size_t>(r);
    out.emplace_back(l, strnlen(l, protocol::kConfigLineBytes));
  }
  return out;
}

void NcclCommunicator::fail_meeting(const CreationOutcome& outcome, std::uint32_t timeout_ms) {
  const std::string on = "Layer creation on rank " + std::to_string(rank_) + ": ";
  const std::string again =
      ". No NCCL call was started, so the communicator is still usable: "
      "every rank can create the layer again";
  const auto status = static_cast<protocol::WaitStatus>(outcome.status);
  const std::string quitter = "rank " + std::to_string(outcome.peer);
  if (status == protocol::WaitStatus::aborted && outcome.culprit < 0)
    throw Error(ErrorCode::peer_aborted, on + quitter + " gave up creating " + layer_name() +
                                             " (its creation failed)" + again);
  if (status == protocol::WaitStatus::aborted && outcome.culprit == rank_)
    throw Error(ErrorCode::peer_aborted, on + quitter + " gave up creating " + layer_name() +
                                             " waiting for this rank (it waited " +
                                             std::to_string(timeout_ms) + " ms)" + again);
  if (status != protocol::WaitStatus::aborted) gave_up_ = true;  // the meeting kernel did
  if (status == protocol::WaitStatus::violation)
    throw Error(ErrorCode::protocol_violation,
                on + quitter + " is already at layer #" + std::to_string(outcome.observed - 1) +
                    " while this rank creates " + layer_name() +
                    ": the ranks' layer counts on this communicator are out of step; destroy it "
                    "and rebuild on every rank from a fresh unique id");
  // A timeout, here or on a rank that gave up first: name every rank still missing.
  std::string missing;
  const protocol::CreationLayout layout{world_};
  if (cudaMemcpy(words_host_, static_cast<std::uint8_t*>(control_base_) + layout.hello_word(0),
                 sizeof(std::uint64_t) * static_cast<std::size_t>(world_),
                 cudaMemcpyDeviceToHost) == cudaSuccess) {
    for (int r = 0; r < world_; ++r)
      if (protocol::inbox_round(words_host_[r]) - creation_ > 1u)  // not there, nor one ahead
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  }
  if (missing.empty())
    missing =
        std::to_string(status == protocol::WaitStatus::aborted ? outcome.culprit : outcome.peer);
  throw Error(
      ErrorCode::timeout,
      on + "rank(s) " + missing + " did not create " + layer_name() + " within " +
          std::to_string(timeout_ms) + " ms" +
          (status == protocol::WaitStatus::aborted ? " (" + quitter + " gave up first)" : "") +
          again +
          "; if a rank's process died, destroy the communicator and rebuild on "
          "every rank from a fresh unique id");
}

int NcclCommunicator::peer_gave_up() noexcept {
  const protocol::CreationLayout layout{world_};
  if (cudaMemcpyAsync(words_host_,
                      static_cast<std::uint8_t*>(control_base_) + layout.gave_up_word(0),
                      sizeof(std::uint64_t) * static_cast<std::size_t>(world_),
                      cudaMemcpyDeviceToHost, stream_) != cudaSuccess ||
      cudaStreamSynchronize(stream_) != cudaSuccess)
    return -1;
  for (int r = 0; r < world_; ++r)
    if (r != rank_ && protocol::inbox_round(words_host_[r]) == creation_) return r;
  return -1;
}

void NcclCommunicator::await_layer_call(ncclResult_t issued, const char* call) {
  const HostDeadline deadline = HostDeadline::after_ms(timeout_ms_);
  int quitter = -1;
  const NcclWait w = await_nccl(issued, {&comm_, 1}, deadline, [&] {
    quitter = peer_gave_up();
    return quitter >= 0;
  });
  if (w.status == NcclWaitStatus::done) return;
  give_up_layer();  // before the abort, which unmaps the control windows
  abort();
  const std::string on = "Layer creation on rank " + std::to_string(rank_) + ": ";
  switch (w.status) {
    case NcclWaitStatus::stopped:
      throw Error(ErrorCode::peer_aborted,
                  on + "rank " + std::to_string(quitter) + " gave up creating " + layer_name() +
                      " while this rank waited in " + call + "; " + kRebuild);
    case NcclWaitStatus::expired:
      throw Error(ErrorCode::timeout,
                  on + "every rank met for " + layer_name() + ", but " + call +
                      " did not complete within " + std::to_string(timeout_ms_) +
                      " ms (NCCL does not say which rank stopped); " + kRebuild);
    default:
      throw Error(code_of(w.result), on + call + " failed for " + layer_name() + ": " +
                                         describe_nccl_error(w.result) + "; " + kRebuild);
  }
}

void NcclCommunicator::give_up_layer() noexcept {
  if (gave_up_ || creation_ == 0 || aborted_.load() || control_peers_ == nullptr) return;
  gave_up_ = true;
  try {
    cudaSetDevice(device_);
    launch_give_up(control(), creation_, stream_);
    cudaStreamSynchronize(stream_);
  } catch (...) {
  }
}

}  // namespace cuda

namespace {

void check_timeout(const char* fn, std::uint32_t timeout_ms) {
  if (timeout_ms > kMaxTimeoutMs)
    throw Error(ErrorCode::invalid_argument,
                std::string(fn) + ": timeout_ms=" + std::to_string(timeout_ms) +
                    ": must be at most " + std::to_string(kMaxTimeoutMs) +
                    " (1 hour; 0 = wait forever)");
}

// Completes the non-blocking creation of `comms` within `deadline`; on failure aborts every one
// of them and throws.
void await_creation(ncclResult_t issued, const std::vector<ncclComm_t>& comms,
                    const cuda::HostDeadline& deadline, const std::string& who) {
  const cuda::NcclWait w = cuda::await_nccl(issued, comms, deadline);
  if (w.status == cuda::NcclWaitStatus::done) return;
  for (ncclComm_t c : comms)
    if (c != nullptr) ncclCommAbort(c);
  if (w.status == cuda::NcclWaitStatus::expired)
    throw Error(ErrorCode::timeout,
                who + ": timed out after " + std::to_string(deadline.timeout_ms()) +
                    " ms in ncclCommInitRankConfig, waiting for every rank of the unique id to "
                    "join (NCCL does not say which one is missing: check that every rank calls it "
                    "with the same unique id and world); the communicator was aborted: make a "
                    "fresh unique id and create the communicator on every rank again");
  throw Error(cuda::code_of(w.result),
              who + ": ncclCommInitRankConfig failed: " + cuda::describe_nccl_error(w.result));
}

ncclConfig_t non_blocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; epmoe awaits it against a deadline
  return config;
}

}  // namespace

UniqueId get_unique_id() {
  ncclUniqueId id;
  EPMOE_NCCL_CHECK(ncclGetUniqueId(&id));
  UniqueId out;
  static_assert(sizeof(id) == sizeof(out.bytes));
  std::memcpy(out.bytes.data(), &id, sizeof id);
  return out;
}

std::unique_ptr<Communicator> make_nccl_communicator(const UniqueId& id, int rank, int world,
                                                     int device, std::uint32_t timeout_ms) {
  if (world < 1 || rank < 0 || rank >= world)
    throw Error(ErrorCode::invalid_argument,
                "make_nccl_communicator: rank=" + std::to_string(rank) +
                    " world=" + std::to_string(world) + ": need 0 <= rank < world");
  const int devices = cuda_device_count();
  if (device < 0 || device >= devices)
    throw Error(ErrorCode::invalid_argument,
                "make_nccl_communicator: device=" + std::to_string(device) +
                    ": this process sees " + std::to_string(devices) + " GPU(s)");
  check_timeout("make_nccl_communicator", timeout_ms);
  const std::string who = "make_nccl_communicator on rank " + std::to_string(rank) + " of " +
                          std::to_string(world) + " (GPU " + std::to_string(device) + ")";
  EPMOE_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId nccl_id;
  std::memcpy(&nccl_id, id.bytes.data(), sizeof nccl_id);
  const cuda::HostDeadline deadline = cuda::HostDeadline::after_ms(timeout_ms);
  ncclConfig_t config = non_blocking_config();
  ncclComm_t comm = nullptr;
  const ncclResult_t issued = ncclCommInitRankConfig(&comm, world, nccl_id, rank, &config);
  if (comm == nullptr)
    throw Error(cuda::code_of(issued),
                who + ": ncclCommInitRankConfig failed: " + cuda::describe_nccl_error(issued));
  await_creation(issued, {comm}, deadline, who);
  auto out = std::make_unique<cuda::NcclCommunicator>(comm, rank, world, device, timeout_ms);
  cuda::NcclCommunicator* const self = out.get();
  cuda::NcclCommunicator::open_control_windows({&self, 1}, deadline, who);
  return out;
}

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(std::span<const int> devices,
                                                                   std::uint32_t timeout_ms) {
  const int visible = cuda_device_count();
  for (int d : devices)
    if (d < 0 || d >= visible)
      throw Error(ErrorCode::invalid_argument,
                  "make_nccl_communicators: device " + std::to_string(d) +
                      " does not exist (this process sees " + std::to_string(visible) + " GPU(s))");
  check_timeout("make_nccl_communicators", timeout_ms);
  const int n = static_cast<int>(devices.size());
  const std::string who = "make_nccl_communicators (" + std::to_string(n) + " GPUs)";
  ncclUniqueId id;
  EPMOE_NCCL_CHECK(ncclGetUniqueId(&id));
  int saved = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&saved));
  const cuda::HostDeadline deadline = cuda::HostDeadline::after_ms(timeout_ms);
  ncclConfig_t config = non_blocking_config();
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  // Every rank of this process in one group, as ncclCommInitAll does.
  ncclResult_t issued = ncclGroupStart();
  for (int r = 0; r < n; ++r) {
    const auto i = static_cast<std::size_t>(r);
    if (cudaSetDevice(devices[i]) != cudaSuccess) continue;
    const ncclResult_t res = ncclCommInitRankConfig(&comms[i], n, id, r, &config);
    if (res != ncclSuccess && res != ncclInProgress && issued == ncclSuccess) issued = res;
  }
  const ncclResult_t end = ncclGroupEnd();
  if (issued == ncclSuccess) issued = end;
  cudaSetDevice(saved);
  std::vector<ncclComm_t> created;
  for (ncclComm_t c : comms)
    if (c != nullptr) created.push_back(c);
  if (created.size() != comms.size()) {
    for (ncclComm_t c : created) ncclCommAbort(c);
    throw Error(cuda::code_of(issued),
                who + ": ncclCommInitRankConfig failed: " + cuda::describe_nccl_error(issued));
  }
  await_creation(issued, comms, deadline, who);
  std::vector<std::unique_ptr<Communicator>> out;
  std::vector<cuda::NcclCommunicator*> raw;
  for (int r = 0; r < n; ++r) {
    const auto i = static_cast<std::size_t>(r);
    auto c = std::make_unique<cuda::NcclCommunicator>(comms[i], r, n, devices[i], timeout_ms);
    raw.push_back(c.get());
    out.push_back(std::move(c));
  }
  cuda::NcclCommunicator::open_control_windows(raw, deadline, who);
  return out;
}

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

}  // namespace epmoe
