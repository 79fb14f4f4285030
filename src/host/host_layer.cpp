#include "host/host_layer.hpp"

#include <cstring>
#include <thread>

#include "formats/codec.hpp"
#include "host/host_group.hpp"
#include "host/host_platform.hpp"
#include "math/expert_row.hpp"
#include "math/quantize.hpp"
#include "protocol/failure.hpp"
#include "protocol/round.hpp"
#include "protocol/token_back.hpp"
#include "protocol/wire.hpp"
#include "protocol/wire_codec.hpp"

namespace epmoe {
namespace {

using protocol::WaitOutcome;
using protocol::WaitStatus;

// Peers as the protocol sees them: rank -> base of its window.
struct HostPeers {
  std::byte* const* windows;
  std::uint8_t* window(int rank) const {
    return reinterpret_cast<std::uint8_t*>(windows[static_cast<std::size_t>(rank)]);
  }
};
using Session = protocol::RoundSession<HostPeers>;

class HostLayer final : public LayerImpl {
 public:
  HostLayer(HostCommunicator& comm, const LayerConfig& config, const ExpertWeights& weights)
      : LayerImpl(config), rank_(comm.rank()), layout_(protocol::make_workspace_layout(config)) {
    validate_weights(config, weights, Device{});
    experts_ = math::emulate_expert_weights(config, weights);
    biases_ = math::load_expert_biases(weights);
    windows_ = comm.group().join_layer(rank_, layout_.total, config.describe(), timeout());
    // A restarted rank process: its next reset() must meet the survivors' pending one, whose
    // first epoch they already published into this window.
    if (windows_->rejoined)
      reset_epoch_ =
          protocol::ResetSession<HostPeers>(layout_, peers(), rank_).latest_epoch() / 2 * 2;
  }

  void forward(const TensorView& x, const TensorView& topk_ids, const TensorView& topk_weights,
               const TensorView& y, Stream) override {
    const ForwardArgs args =
        validate_forward(config(), x, topk_ids, topk_weights, y, Device{}, true);
    refuse_if_unhealthy();
    if (fault_skips_idle_launch(args.tokens)) return;  // test builds: the hang, on purpose
    if (fault_fires(testing::Fault::round_jump)) round_ += 2;
    run_round(args);
  }

  Health health() const override { return health_; }

  void reset() override {
    const protocol::ResetSession<HostPeers> session(layout_, peers(), rank_);
    HostPlatform platform;
    const std::uint32_t timeout_ms = config().options().timeout_ms;
    const auto meet = [&](const char* when) {
      const WaitOutcome w =
          session.meet(++reset_epoch_, protocol::deadline_after_ms(platform, timeout_ms), platform);
      if (w.status == WaitStatus::ok) return;
      // Retry from the same epochs next time, so a reset() the others join later still meets.
      reset_epoch_ = (reset_epoch_ - 1) / 2 * 2;
      health_ = reset_timeout(rank_, round_, w.peer);
      health_.what = describe_failure(health_, timeout_ms) + " (" + when + ")";
      throw Error(ErrorCode::timeout, health_.what);
    };
    meet("waiting for every rank to stop");  // nobody is inside a round any more
    session.clear_own_inboxes();
    round_ = protocol::kFirstRound;
    health_ = Health::healthy();
    meet("waiting for every rank to clear its inboxes");  // all clear before round 1 is sent
  }

  std::uint32_t next_round() const override { return round_; }

  // The quantize-emulated fp32 values and one s_enc per matrix, as math::emulate_expert_weights
  // holds them.
  std::size_t resident_weight_bytes() const override {
    return (experts_.w13.size() + experts_.w2.size() + experts_.w13_s_enc.size() +
            experts_.w2_s_enc.size() + biases_.b13.size() + biases_.b2.size()) *
           sizeof(float);
  }

  void start_rounds_at(std::uint32_t round) override {
    // As after a completed round - 1: every message this rank has received says round - 1.
    std::uint8_t* base = window(rank_);
    for (int src = 0; src < layout_.world; ++src) {
      const std::uint64_t previous = protocol::pack_inbox(round - 1, 0);
      std::memcpy(base + layout_.count_word(src), &previous, sizeof previous);
      std::memcpy(base + layout_.done_word(src), &previous, sizeof previous);
    }
    round_ = round;
  }

 private:
  std::chrono::milliseconds timeout() const {
    return std::chrono::milliseconds(config().options().timeout_ms);
  }
  std::uint8_t* window(int rank) const { return HostPeers{windows_->windows.data()}.window(rank); }
  const LayerShape& shape() const { return config().shape(); }
  bool staged() const { return config().options().combine == Combine::staged; }
  protocol::CombineBuffer combine_buffer(int rank) const {
    return protocol::combine_buffer(window(rank), layout_, shape().top_k,
                                    config().options().combine);
  }

  void refuse_if_unhealthy() {
    if (!health_.ok)
      throw Error(ErrorCode::layer_unhealthy,
                  "forward on rank " + std::to_string(rank_) +
                      " refused until a collective reset(): " + health_.what);
    const std::uint64_t abort = Session(layout_, peers(), rank_, round_).local_abort();
    if (protocol::abort_raised(abort))
      fail(WaitOutcome{WaitStatus::aborted, -1, 0, abort}, Phase::none,
           Session(layout_, peers(), rank_, round_));
  }

  HostPeers peers() const { return HostPeers{windows_->windows.data()}; }

  // One round, docs/design.md §3 steps 1-7. No step is skipped for T == 0.
  void run_round(const ForwardArgs& args) {
    const Session session(layout_, peers(), rank_, round_);
    HostPlatform platform;
    const std::uint32_t timeout_ms = config().options().timeout_ms;

    prepare_accumulator(args.tokens);                           // 1
    const std::vector<std::uint32_t> rows_to = dispatch(args);  // 2
    for (int dest = 0; dest < layout_.world; ++dest)            // 3
      session.publish_count(dest, rows_to[static_cast<std::size_t>(dest)]);
    if (fault_fires(testing::Fault::stall))
      std::this_thread::sleep_for(std::chrono::milliseconds(fault().stall_ms));

    std::vector<std::uint32_t> rows_from(static_cast<std::size_t>(layout_.world), 0);
    WaitOutcome w = session.await_counts(protocol::deadline_after_ms(platform, timeout_ms),
                                         platform, rows_from.data());  // 4
    if (w.status != WaitStatus::ok) fail(w, Phase::dispatch_counts, session);

    run_experts(rows_from, session);                                                      // 5
    for (int dest = 0; dest < layout_.world; ++dest) session.publish_done(dest);          // 6
    w = session.await_done(protocol::deadline_after_ms(platform, timeout_ms), platform);  // 7
    if (w.status != WaitStatus::ok) fail(w, Phase::expert_done, session);
    finish(args);
    ++round_;
  }

  void prepare_accumulator(std::int64_t tokens) {
    if (staged()) return;
    std::memset(window(rank_) + layout_.combine, 0,
                static_cast<std::size_t>(tokens) * layout_.combine_row_bytes);
  }

  // Step 2: each token goes once to every rank that owns one of its experts, carrying all its
  // (slot, local expert, weight) entries there. Returns the rows sent to each rank.
  std::vector<std::uint32_t> dispatch(const ForwardArgs& args) {
    const LayerShape& s = shape();
    const auto h = static_cast<std::size_t>(s.hidden);
    const Precision precision = config().precision();
    std::vector<std::uint32_t> rows_to(static_cast<std::size_t>(layout_.world), 0);
    std::vector<float> x(h);
    std::vector<std::uint8_t> payload(protocol::wire_payload_bytes(precision, s.hidden));
    for (std::int64_t t = 0; t < args.tokens; ++t) {
      for (std::size_t i = 0; i < h; ++i)
        x[i] = formats::bf16_to_float(args.x[static_cast<std::size_t>(t) * h + i]);
      const float row_scale = protocol::encode_payload(
          x.data(), s.hidden, precision, config().options().mxfp8_scale_rounding, payload.data());
      for (int dest = 0; dest < layout_.world; ++dest) {
        protocol::WireRowHeader header{static_cast<std::int32_t>(t), 0, row_scale, round_};
        std::uint8_t* row =
            window(dest) + layout_.recv_row(round_, rank_, rows_to[static_cast<std::size_t>(dest)]);
        auto* entries =
            reinterpret_cast<protocol::WireEntry*>(row + protocol::wire_entries_offset());
        for (std::int64_t k = 0; k < s.top_k; ++k) {
          const std::int32_t e = args.expert_id(t, k, s.top_k);
          if (e < 0 || config().expert_owner(e) != dest) continue;
          entries[header.num_entries++] =
              protocol::WireEntry{static_cast<std::int16_t>(k),
                                  static_cast<std::int16_t>(e - dest * config().local_experts()),
                                  args.topk_weights[static_cast<std::size_t>(t * s.top_k + k)]};
        }
        if (header.num_entries == 0) continue;
        std::memcpy(row, &header, sizeof header);
        std::memcpy(row + protocol::wire_payload_offset(s.top_k), payload.data(), payload.size());
        ++rows_to[static_cast<std::size_t>(dest)];
      }
    }
    return rows_to;
  }

  // Step 5: run every arrived (row, expert) pair and send the result home.
  void run_experts(const std::vector<std::uint32_t>& rows_from, const Session& session) {
    const LayerShape& s = shape();
    const auto h = static_cast<std::size_t>(s.hidden);
    const protocol::RowLimits limits{s.max_tokens_per_rank, s.top_k, config().local_experts()};
    std::vector<float> x(h), out(h), scratch;
    for (int src = 0; src < layout_.world; ++src) {
      for (std::uint32_t r = 0; r < rows_from[static_cast<std::size_t>(src)]; ++r) {
        const std::uint8_t* row = window(rank_) + layout_.recv_row(round_, src, r);
        protocol::WireRowHeader header;
        std::memcpy(&header, row, sizeof header);
        const auto* entries =
            reinterpret_cast<const protocol::WireEntry*>(row + protocol::wire_entries_offset());
        if (!protocol::received_row_valid(header, entries, round_, limits))
          fail_payload(src, header, session);
        protocol::decode_payload(row + protocol::wire_payload_offset(s.top_k), s.hidden,
                                 config().precision(), header.row_scale, x.data());
        for (std::int32_t i = 0; i < header.num_entries; ++i) {
          const protocol::WireEntry entry = entries[i];
          const auto e = static_cast<std::size_t>(entry.local_expert);
          const math::ExpertMatrices expert{
              experts_.w13.data() + e * static_cast<std::size_t>(2 * s.intermediate * s.hidden),
              experts_.w2.data() + e * static_cast<std::size_t>(s.hidden * s.intermediate),
              biases_.b13.empty()
                  ? nullptr
                  : biases_.b13.data() + e * static_cast<std::size_t>(2 * s.intermediate),
              biases_.b2.empty() ? nullptr
                                 : biases_.b2.data() + e * static_cast<std::size_t>(s.hidden)};
          math::expert_forward_row(x.data(), expert, s, config().precision(), config().options(),
                                   out.data(), scratch);
          send_home(protocol::home_slot(src, header, entry), out);
        }
      }
    }
  }

  void send_home(const protocol::HomeSlot& to, const std::vector<float>& out) {
    const protocol::CombineBuffer home = combine_buffer(to.rank);
    for (std::size_t i = 0; i < out.size(); ++i)
      protocol::send_home(home, to, static_cast<std::int64_t>(i), out[i]);
  }

  // Step 7 (after every done): y from the combine buffer (protocol/token_back.hpp).
  void finish(const ForwardArgs& args) {
    const protocol::CombineBuffer own = combine_buffer(rank_);
    const std::int64_t h = shape().hidden, top_k = shape().top_k;
    for (std::int64_t t = 0; t < args.tokens; ++t) {
      const auto routed = [&](std::int64_t k) { return args.expert_id(t, k, top_k) >= 0; };
      for (std::int64_t i = 0; i < h; ++i)
        args.y[static_cast<std::size_t>(t * h + i)] =
            protocol::combined_output(own, args.topk_weights, t, i, routed);
    }
  }

  // I3 / I4: record what happened, tell every peer, and throw.
  [[noreturn]] void fail(const WaitOutcome& w, Phase phase, const Session& session) {
    WaitOutcome blamed = w;
    if (w.status == WaitStatus::violation) blamed.peer = session.violation_culprit(w.peer);
    if (w.status != WaitStatus::aborted) session.raise_abort(phase, blamed.peer);
    health_ = failure_from_wait(rank_, round_, phase, blamed);
    health_.what = describe_failure(health_, config().options().timeout_ms);
    throw Error(health_.code, health_.what);
  }

  [[noreturn]] void fail_payload(int src, const protocol::WireRowHeader& header,
                                 const Session& session) {
    WaitOutcome w{WaitStatus::violation, src, header.round, 0};
    fail(w, Phase::dispatch_counts, session);
  }

  int rank_;
  protocol::WorkspaceLayout layout_;
  std::shared_ptr<HostLayerWindows> windows_;
  math::EmulatedExperts experts_;  // quantization emulated
  math::ExpertBiases biases_;      // fp32, empty when none
  std::uint32_t round_ = protocol::kFirstRound;
  std::uint32_t reset_epoch_ = 0;
  Health health_{};
};

}  // namespace

std::unique_ptr<LayerImpl> make_host_layer(Communicator& comm, const LayerConfig& config,
                                           const ExpertWeights& local_weights) {
  auto* host = dynamic_cast<HostCommunicator*>(&comm);
  if (host == nullptr)
    throw Error(ErrorCode::invalid_argument,
                "Layer: a cpu_threads communicator must come from make_host_communicator");
  return std::make_unique<HostLayer>(*host, config, local_weights);
}

}  // namespace epmoe
