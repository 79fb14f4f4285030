#include "cuda/cuda_layer.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstddef>
#include <cstring>
#include <utility>
#include <vector>

#include "cuda/cuda_check.hpp"
#include "cuda/experts/backend.hpp"
#include "cuda/kernels.hpp"
#include "cuda/nccl_comm.hpp"
#include "cuda/persistent_round.hpp"
#include "cuda/round_params.hpp"
#include "protocol/failure.hpp"
#include "protocol/message.hpp"

namespace epmoe::cuda {
namespace {
class CudaLayer final : public LayerImpl {
 public:
  CudaLayer(NcclCommunicator& comm, const LayerConfig& config, const ExpertWeights& weights)
      : LayerImpl(config), comm_(comm), device_(comm.cuda_device()) {
    EPMOE_CUDA_CHECK(cudaSetDevice(device_));
    // A throw part-way (a peer that never joins, a bad weight tensor) frees what was made so far:
    // a serving engine retries creation, and each try must not leak a stream or buffers.
    try {
      const Device d = comm.device();
      // Weights: on this GPU or on the host, bf16 or f32 values or codes already in the precision;
      // the expert backend prepares them on this GPU (docs/design.md §4.1). So are the optional
      // biases, each checked under its own name.
      for (const TensorView* t : {&weights.w13, &weights.w2})
        if (given(*t) && !(t->device == d) && t->device.kind != DeviceKind::cpu)
          throw Error(ErrorCode::invalid_argument, std::string("Layer: weights are on ") +
                                                       to_string(t->device) + ", expected cpu or " +
                                                       to_string(d));
      validate_weights(config, weights, d, /*host_allowed=*/true);
      (void)programmatic_launch();  // a bad $EPMOE_PDL fails here, not part-way through a round

      EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      check_same_config_on_every_rank();
      // The same config on every rank, so every rank gets the same answer here.
      backend_ = experts::make_expert_backend(config, device_);

      // The window: one ncclMemAlloc'd region, registered once, symmetric on every rank; the
      // registration is bounded and names who gave up (SymmetricWindow, nccl_comm.hpp).
      const protocol::WorkspaceLayout layout = protocol::make_workspace_layout(config);
      window_ = SymmetricWindow(comm, layout.total);
      peer_windows_ = window_.peers();

      // Round state (device), health record and reset outcome (mapped pinned host memory).
      RoundState state{};
      state.round = protocol::kFirstRound;
      for (PhaseRecord& r : state.phases) clear_phase_record(r);
      EPMOE_CUDA_CHECK(cudaMalloc(&state_, sizeof(RoundState)));
      EPMOE_CUDA_CHECK(cudaMemcpy(state_, &state, sizeof state, cudaMemcpyHostToDevice));
      EPMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&health_host_), sizeof(HealthRecord),
                                     cudaHostAllocMapped));
      std::memset(health_host_, 0, sizeof(HealthRecord));
      EPMOE_CUDA_CHECK(
          cudaHostGetDevicePointer(reinterpret_cast<void**>(&health_device_), health_host_, 0));
      EPMOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&reset_outcome_host_),
                                     sizeof(std::int32_t), cudaHostAllocMapped));
      EPMOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&reset_outcome_device_),
                                                reset_outcome_host_, 0));

      const LayerShape& s = config.shape();
      base_ = RoundParams{};
      base_.layout = layout;
      base_.peer_windows = peer_windows_;
      base_.rank = config.rank();
      base_.world = config.world();
      base_.hidden = s.hidden;
      base_.top_k = s.top_k;
      base_.local_experts = config.local_experts();
      base_.num_experts = s.num_experts;
      base_.precision = config.precision();
      base_.combine = config.options().combine;
      base_.rounding = config.options().mxfp8_scale_rounding;
      base_.timeout_ms = config.options().timeout_ms;
      base_.state = state_;
      base_.health = health_device_;
      base_.staged = backend_->staged_rows();
      EPMOE_CUDA_CHECK(cudaMalloc(&route_scratch_, route_scratch_bytes(base_)));
      base_.scratch = route_scratch(route_scratch_, base_);
      // Every grid of the chain, once per token bucket from its num_sms knob and its largest T
      // (I5); forward picks the bucket of its T.
      for (int b = 0; b < kNumTokenBuckets; ++b) {
        const auto bucket = static_cast<TokenBucket>(b);
        chain_[b] = round_shapes(base_, device_, config.knobs(bucket).num_sms,
                                 config.knobs(bucket).dispatch_warps, bucket_max_tokens(bucket));
      }
      // The persistent round for the buckets whose knobs ask for it (Knobs::megakernel).
      for (int b = 0; b < kNumTokenBuckets; ++b) {
        const auto bucket = static_cast<TokenBucket>(b);
        if (!config.knobs(bucket).megakernel) continue;
        if (const std::string why = PersistentRound::cannot_run(*backend_, bucket); !why.empty())
          throw Error(ErrorCode::unsupported, std::string("Layer: knobs.") + to_string(bucket) +
                                                  ".megakernel=true: " + why);
        if (persistent_ == nullptr)
          persistent_ = std::make_unique<PersistentRound>(base_, *backend_, config, device_);
      }

      // The legacy default stream, as the host copy of the weights used before: ordered after
      // pending work on blocking streams that may still be writing the caller's device tensors.
      backend_->prepare(weights, cudaStreamLegacy);
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));

    } catch (...) {
      release();
      throw;
    }
  }

  ~CudaLayer() override {
    cudaSetDevice(device_);
    cudaDeviceSynchronize();  // every kernel's waits are bounded: this returns
    release();
    // window_ deregisters (local in NCCL 2.28, skipped after an abort) and frees itself last.
  }

  void forward(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights,
               const TensorView& y, Stream stream) override {
    const ForwardArgs a =
        validate_forward(config(), x, topk_ids, topk_weights, y, comm_.device(), false);
    refuse_if_aborted("forward");
    refuse_if_unhealthy();
    if (fault_skips_idle_launch(a.tokens)) return;  // test builds: the hang, on purpose
    EPMOE_CUDA_CHECK(cudaSetDevice(device_));
    auto* s = static_cast<cudaStream_t>(stream.handle);
    if (fault_fires(testing::Fault::round_jump)) launch_round_jump(state_, 2, s);
    // The knobs of T's bucket (docs/tuning.md#token-buckets): T is known here, from x's shape, so
    // the pick costs nothing on the device; a graph captured now keeps this bucket's launches.
    const TokenBucket bucket = token_bucket(a.tokens);
    const RoundShapes& shapes = chain_[bucket_index(bucket)];
    RoundParams p = base_;
    p.tokens = a.tokens;
    p.x = a.x;
    p.topk_ids = a.topk_ids;
    p.ids_are_i64 = a.id_dtype == DType::i64;
    p.topk_weights = a.topk_weights;
    p.y = a.y;
    const auto stall_if_faulted = [&] {  // test builds: this rank late, on purpose
      if (fault_fires(testing::Fault::stall))
        launch_stall(std::uint64_t{fault().stall_ms} * 1'000'000u, s);
    };
    if (config().knobs(bucket).megakernel) {
      // One launch (docs/design.md §4.3): a stall fault holds the whole round back instead.
      stall_if_faulted();
      persistent_->launch(p, bucket, s);
    } else {
      launch_dispatch(p, shapes.dispatch, s);
      stall_if_faulted();
      launch_experts(p, shapes.experts, bucket, *backend_, s);
      launch_combine(p, shapes.combine, s);
    }
    last_stream_ = s;
  }

  std::size_t resident_weight_bytes() const override { return backend_->weight_bytes(); }

  Health health() const override {
    read_health_record();
    return health_;
  }

  void reset() override {
    refuse_if_aborted("reset");
    EPMOE_CUDA_CHECK(cudaSetDevice(device_));
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(last_stream_));  // every wait is bounded: this returns
    *reset_outcome_host_ = -1;
    launch_reset(base_, reset_epoch_ + 1, reset_outcome_device_, stream_);
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    const std::int32_t outcome = *reset_outcome_host_;
    if (outcome != 0) {
      comm_.set_peer_missing(true);
      health_ = reset_timeout(config().rank(), 0, outcome - 1);
      health_.what = describe_failure(health_, config().options().timeout_ms) +
                     " (if that rank's process died, this communicator is broken: destroy the "
                     "layers and the communicator, which then aborts, and rebuild both from a "
                     "fresh unique id with the restarted rank)";
      throw Error(ErrorCode::timeout, health_.what);
    }
    comm_.set_peer_missing(false);
    reset_epoch_ += 2;
    write_phase_timing(phase_timing_);  // rounds restart at 1: no stale stamps under them
    std::memset(health_host_, 0, sizeof(HealthRecord));
    health_ = Health::healthy();
  }

  void set_phase_timing(bool on) override {
    EPMOE_CUDA_CHECK(cudaSetDevice(device_));
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(last_stream_));  // every wait is bounded: this returns
    write_phase_timing(on);
    phase_timing_ = on;
  }

  PhaseTimes last_phase_times() const override {
    if (!phase_timing_) return {};
    EPMOE_CUDA_CHECK(cudaSetDevice(device_));
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(last_stream_));
    RoundState s;
    EPMOE_CUDA_CHECK(cudaMemcpy(&s, state_, sizeof s, cudaMemcpyDeviceToHost));
    if (s.round == protocol::kFirstRound) return {};  // no round since creation or reset()
    const std::uint32_t last = s.round - 1;  // a failed round does not advance: the one before
    return phase_times(s.phases[last & 1u], last);
  }

  void start_rounds_at(std::uint32_t) override {
    throw Error(ErrorCode::unsupported, "start_rounds_at: CPU executor only");
  }

  std::uint32_t next_round() const override {
    RoundState s;
    EPMOE_CUDA_CHECK(cudaSetDevice(device_));
    EPMOE_CUDA_CHECK(cudaMemcpy(&s, state_, sizeof s, cudaMemcpyDeviceToHost));
    return s.round;
  }

 private:
  // Layer creation meets every rank's, bounded by timeout_ms and naming a rank that does not come
  // (NcclCommunicator::meet_for_layer), and fails on every rank, naming the ranks, if they were
  // given different configs.
  void check_same_config_on_every_rank() {
    const std::vector<std::string> all =
        comm_.meet_for_layer(config().describe(), config().options().timeout_ms);
    const std::string& first = all[0];
    for (std::size_t r = 1; r < all.size(); ++r) {
      const std::string& other = all[r];
      if (other != first)
        throw Error(ErrorCode::invalid_argument,
                    "Layer creation: rank " + std::to_string(r) +
                        " was given a different config than rank 0:\n  rank 0: " + first +
                        "\n  rank " + std::to_string(r) + ": " + other);
    }
  }

  void read_health_record() const {
    const auto* h = static_cast<const volatile HealthRecord*>(health_host_);
    if (h->published == 0 || !health_.ok) return;
    std::atomic_thread_fence(std::memory_order_acquire);
    Health out;
    out.ok = false;
    out.code = static_cast<ErrorCode>(h->code);
    out.rank = h->rank;
    out.peer = h->peer;
    out.phase = static_cast<Phase>(h->phase);
    out.round = h->round;
    out.observed = h->observed;
    out.expected = h->expected;
    out.reporter = h->reporter;
    if (out.code == ErrorCode::invalid_argument)
      out.what = "forward: topk_ids[" + std::to_string(h->bad_token) + ", " +
                 std::to_string(h->bad_slot) + "]=" + std::to_string(h->bad_value) +
                 ": must be -1 (no expert) or in [0, num_experts=" +
                 std::to_string(config().shape().num_experts) +
                 ") (device-resident ids are checked in the kernel; that slot was dropped)";
    else
      out.what = describe_failure(out, config().options().timeout_ms);
    health_ = out;
  }

  // After Communicator::abort() NCCL has unmapped the peers' windows: a kernel would fault.
  void refuse_if_aborted(const char* fn) const {
    if (comm_.aborted())
      throw Error(ErrorCode::layer_unhealthy,
                  std::string(fn) + " on rank " + std::to_string(config().rank()) +
                      ": the communicator was aborted (Communicator::abort); destroy this layer "
                      "and rebuild from a fresh unique id");
  }

  void refuse_if_unhealthy() {
    read_health_record();
    if (health_.ok) return;
    if (health_.code == ErrorCode::invalid_argument) {
      // A bad id is the caller's error for one round; the protocol ran, the layer stays usable.
      const std::string what = health_.what;
      std::memset(health_host_, 0, sizeof(HealthRecord));
      health_ = Health::healthy();
      throw Error(ErrorCode::invalid_argument, what);
    }
    throw Error(health_.code, "forward on rank " + std::to_string(config().rank()) +
                                  " refused until a collective reset(): " + health_.what);
  }

  // Phase timing's part of the round state (docs/design.md §4.2): the flag and both records,
  // cleared. Only between rounds, once the last forward's stream has drained.
  void write_phase_timing(bool on) {
    static_assert(
        offsetof(RoundState, timing) < offsetof(RoundState, phases) &&
            offsetof(RoundState, phases) + sizeof(RoundState::phases) == sizeof(RoundState),
        "timing and phases close RoundState: one copy writes both");
    RoundState s{};
    s.timing = on ? 1u : 0u;
    for (PhaseRecord& r : s.phases) clear_phase_record(r);
    constexpr std::size_t from = offsetof(RoundState, timing);
    EPMOE_CUDA_CHECK(cudaMemcpy(reinterpret_cast<std::uint8_t*>(state_) + from,
                                reinterpret_cast<const std::uint8_t*>(&s) + from,
                                sizeof(RoundState) - from, cudaMemcpyHostToDevice));
  }

  // Frees what the constructor made (whatever of it exists), on the layer's device.
  void release() noexcept {
    cudaSetDevice(device_);
    cudaFree(state_);
    state_ = nullptr;
    persistent_.reset();
    backend_.reset();
    cudaFree(route_scratch_);
    route_scratch_ = nullptr;
    cudaFreeHost(health_host_);
    health_host_ = nullptr;
    cudaFreeHost(reset_outcome_host_);
    reset_outcome_host_ = nullptr;
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

  NcclCommunicator& comm_;

  int device_;
  cudaStream_t stream_ = nullptr;       // creation and reset
  cudaStream_t last_stream_ = nullptr;  // the caller's stream of the last forward
  SymmetricWindow window_;
  std::uint8_t** peer_windows_ = nullptr;  // window_'s: every rank's window base (device)
  RoundState* state_ = nullptr;
  HealthRecord* health_host_ = nullptr;
  HealthRecord* health_device_ = nullptr;
  std::int32_t* reset_outcome_host_ = nullptr;
  std::int32_t* reset_outcome_device_ = nullptr;
  std::unique_ptr<experts::ExpertBackend> backend_;  // its weights, scratch and GEMM kernels
  std::unique_ptr<PersistentRound> persistent_;      // when a bucket's knobs ask for megakernel
  std::uint8_t* route_scratch_ = nullptr;            // route's and bucket's (kernels.hpp)
  RoundParams base_{};
  PerBucket<RoundShapes> chain_{};  // the round's grids per token bucket (the backend has its own)
  std::uint32_t reset_epoch_ = 0;
  bool phase_timing_ = false;  // Layer::set_phase_timing (RoundState::timing on the device)
  mutable Health health_{};
};

}  // namespace

std::unique_ptr<LayerImpl> make_cuda_layer(Communicator& comm, const LayerConfig& config,
                                           const ExpertWeights& local_weights) {
  auto* nccl = dynamic_cast<NcclCommunicator*>(&comm);
  if (nccl == nullptr)
    throw Error(ErrorCode::invalid_argument,
                "Layer: a cuda_nccl communicator must come from make_nccl_communicator(s)");
  return std::make_unique<CudaLayer>(*nccl, config, local_weights);
}

}  // namespace epmoe::cuda
