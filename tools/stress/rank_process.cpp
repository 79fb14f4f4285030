#include "stress/rank_process.hpp"

#include <signal.h>
#include <sys/prctl.h>

#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "executor.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"
#include "stress/clock.hpp"
#include "stress/load.hpp"
#include "stress/process_messages.hpp"
#include "stress/report.hpp"

#if defined(EPMOE_HAS_CUDA)
#include "harness/device_batch.hpp"
#endif

namespace epmoe::tools::stress {
namespace {

// A rank process's communicator and layer. CPU executor: made once over the shared-memory group;
// a restarted rank finds its old window and joins the survivors' reset(). CUDA executor: rank r on
// GPU r, built from a unique id the supervisor relays; a dead peer breaks the NCCL communicator,
// so after a kill the survivors' reset() fails naming it, and everyone rebuilds from a fresh id.
class RankLayer {
 public:
  RankLayer(const Options& o, const Setup& s, const std::string& group, int rank,
            const reference::LayerWeights& weights);
  ~RankLayer() { teardown(); }
  RankLayer(const RankLayer&) = delete;
  RankLayer& operator=(const RankLayer&) = delete;

  // (Re)makes the communicator and the layer; `id` is the CUDA executor's unique id.
  void build(const UniqueId& id);
  Layer& layer() { return *layer_; }
  // One round; throws Error on a failed round on either executor (on the GPU a failed round is
  // seen in health() once the stream has finished it).
  std::vector<std::uint16_t> forward(const reference::Batch& batch);

 private:
  void teardown();

  const Options& o_;
  const Setup& s_;
  bool cuda_;
  int rank_;
  const reference::LayerWeights& weights_;
  std::shared_ptr<HostGroup> group_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Layer> layer_;
#if defined(EPMOE_HAS_CUDA)
  std::unique_ptr<harness::DeviceBatch> device_;
#endif
};

RankLayer::RankLayer(const Options& o, const Setup& s, const std::string& group, int rank,
                     const reference::LayerWeights& weights)
    : o_(o), s_(s), cuda_(s.backend == Backend::cuda_nccl), rank_(rank), weights_(weights) {
  if (!cuda_) {
    group_ = attach_shared_memory_group(group, o.ranks);
    return;
  }
  const int gpus = cuda_device_count();
  if (rank >= gpus)
    throw Error(ErrorCode::invalid_argument,
                "--processes --executor=cuda: rank " + std::to_string(rank) + " runs on GPU " +
                    std::to_string(rank) + " and this machine has " + std::to_string(gpus) +
                    " GPU(s); pass --ranks <= " + std::to_string(gpus));
}

void RankLayer::build(const UniqueId& id) {
  teardown();
  comm_ = cuda_ ? make_nccl_communicator(id, rank_, o_.ranks, rank_)
                : make_host_communicator(group_, rank_);
  const LayerConfig config = make_config(s_.shape, s_.precision, rank_, o_.ranks, s_.layer_options);
  layer_ = std::make_unique<Layer>(*comm_, with_tool_knobs(config, s_.token_back, s_.megakernel),
                                   local_weight_views(weights_, s_.shape, rank_, o_.ranks));
#if defined(EPMOE_HAS_CUDA)
  if (cuda_) device_ = std::make_unique<harness::DeviceBatch>(rank_, s_.shape);
#endif
}

std::vector<std::uint16_t> RankLayer::forward(const reference::Batch& batch) {
#if defined(EPMOE_HAS_CUDA)
  if (cuda_) {
    std::vector<std::uint16_t> y = device_->forward(*layer_, batch);
    const Health h = layer_->health();
    if (!h.ok) throw Error(h.code, h.what);
    return y;
  }
#endif
  return host_forward(*layer_, batch);
}

// The layer goes first: it uses the communicator (whose destruction aborts, without waiting on
// anybody, once a reset() found a peer missing).
void RankLayer::teardown() {
  layer_.reset();
#if defined(EPMOE_HAS_CUDA)
  device_.reset();
#endif
  comm_.reset();
}

// The rounds of one rank process.
class RankProcess {
 public:
  RankProcess(const Options& o, const Setup& s, const RankProcessStart& start);
  int run();

 private:
  bool build_first_layer();
  bool rejoin(std::int64_t& round);
  bool recover();
  bool kill_due(std::int64_t round) const;
  void arm_kill(std::int64_t round);
  std::optional<Msg> forward(const reference::Batch& batch, std::int64_t round,
                             std::vector<std::uint16_t>& y);
  Msg failure(const std::exception& e, std::int64_t round);
  void check(std::vector<std::uint16_t>& y, const reference::Batch& batch, const RoundDraw& draw,
             std::int64_t round);

  const Options& o_;
  const Setup& s_;
  const RankProcessStart start_;
  const int rank_;
  const bool cuda_;
  const reference::LayerWeights weights_;
  reference::ReferenceModel reference_;
  RankLayer rank_layer_;
  Resume resume_;
  Load load_;
  RankStats st_;
  const bool faulty_;  // the rank --fault kill:RANK kills
  int episode_;        // the next kill episode, on the faulty rank
  bool corrupt_pending_;
  bool rejoining_;  // a restarted process that has not yet met the survivors
};

RankProcess::RankProcess(const Options& o, const Setup& s, const RankProcessStart& start)
    : o_(o),
      s_(s),
      start_(start),
      rank_(start.rank),
      cuda_(s.backend == Backend::cuda_nccl),
      weights_(harness::make_random_weights(s.shape, o.seed)),
      reference_(s.shape, s.precision, s.layer_options, weights_),
      rank_layer_(o, s, start.group, start.rank, weights_),
      load_(o, s, start.rank),
      st_(o.rounds),
      faulty_(s.fault.kill && start.rank == s.fault.rank),
      episode_(faulty_ ? start.episodes_done : o.fault_times),
      corrupt_pending_(o.corrupt_check && start.rank == 0 && !start.restarted),
      rejoining_(start.restarted) {}

int RankProcess::run() {
  std::int64_t round = 1;
  if (start_.restarted) {
    if (!rejoin(round)) return kRankError;
    if (!recover()) return kRankResetFailed;
    rejoining_ = false;
  } else if (!build_first_layer()) {
    return kRankError;
  }
  while (round <= o_.rounds) {
    const RoundDraw draw = load_.draw(round);
    const reference::Batch batch = round_batch(o_, s_.shape, draw, round, rank_);
    if (kill_due(round)) {
      arm_kill(round);  // no pacing sleep: straight into the round the supervisor kills us in
    } else if (draw.sleep_us > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(draw.sleep_us));
    }
    std::vector<std::uint16_t> y;
    const auto t0 = Clock::now();
    const std::optional<Msg> failed = forward(batch, round, y);
    const auto us = static_cast<float>(seconds_between(t0, Clock::now()) * 1e6);
    record_forward(st_, draw, round);
    if (failed) {
      ++st_.aborted;
      send_msg(start_.up, *failed);
      if (!read_resume(start_.down, resume_)) break;  // the supervisor gave up on the run
      round = resume_.round;
      if (recover()) continue;
      send_stats(start_.up, rank_, st_);
      return kRankResetFailed;
    }
    record_wall(st_, us, round);
    check(y, batch, draw, round);
    ++round;
  }
  send_stats(start_.up, rank_, st_);
  return rank_layer_.layer().health().ok ? kRankPass : kRankError;
}

// The CUDA executor's first communicator needs one id for everyone: rank 0 makes it and the
// supervisor relays it. The CPU executor's shared-memory group needs none.
bool RankProcess::build_first_layer() {
  if (cuda_ && rank_ == 0) {
    Msg m;
    m.kind = MsgKind::unique_id;
    m.rank = rank_;
    m.has_id = 1;
    m.unique_id = get_unique_id();
    send_msg(start_.up, m);
  }
  if (cuda_ && !read_resume(start_.down, resume_)) return false;
  rank_layer_.build(resume_.unique_id);
  return true;
}

// A restarted process makes the killed one's draws again, so that its load goes on where the
// killed one left off, then waits for the round everyone resumes at.
bool RankProcess::rejoin(std::int64_t& round) {
  for (std::int64_t r = 1; r <= start_.replay_through; ++r) (void)load_.draw(r);
  if (!read_resume(start_.down, resume_)) return false;
  round = resume_.round;
  return true;
}

// CPU executor: survivors and the restarted rank retry reset() until everybody has met there.
// CUDA executor: the survivors' reset() must fail (the killed process cannot meet them; this
// also marks the communicator so that its destruction aborts), then everyone rebuilds from the
// id in `resume_`.
bool RankProcess::recover() {
  if (cuda_) {
    if (!rejoining_) {
      try {
        rank_layer_.layer().reset();
      } catch (const Error&) {
      }
    }
    if (resume_.has_id == 0) return false;
    rank_layer_.build(resume_.unique_id);
    return true;
  }
  if (rejoining_) rank_layer_.build(resume_.unique_id);
  const auto give_up = Clock::now() + std::chrono::seconds(30);
  while (Clock::now() < give_up) {
    try {
      rank_layer_.layer().reset();
      return true;
    } catch (const Error&) {
    }
  }
  return false;
}

bool RankProcess::kill_due(std::int64_t round) const {
  return faulty_ && episode_ < o_.fault_times && round >= kill_round(o_, episode_);
}

// The doomed rank reports what it did so far (it will not live to report), stalls inside its
// next round, and tells the supervisor to kill it there.
void RankProcess::arm_kill(std::int64_t round) {
  send_stats(start_.up, rank_, st_);
  st_ = RankStats(o_.rounds);
  testing::inject_fault(rank_layer_.layer(), {Fault::stall, s_.fault.stall_ms, 1});
  Msg m;
  m.kind = MsgKind::armed;
  m.rank = rank_;
  m.round = round;
  m.at_ns = to_ns(Clock::now());
  send_msg(start_.up, m);
  ++episode_;
}

std::optional<Msg> RankProcess::forward(const reference::Batch& batch, std::int64_t round,
                                        std::vector<std::uint16_t>& y) {
  try {
    y = rank_layer_.forward(batch);
    return std::nullopt;
  } catch (const std::exception& e) {
    return failure(e, round);
  }
}

// The arrival a failed round sends to the supervisor.
Msg RankProcess::failure(const std::exception& e, std::int64_t round) {
  Msg m;
  m.kind = MsgKind::arrival;
  m.rank = rank_;
  m.round = round;
  m.at_ns = to_ns(Clock::now());
  const auto* err = dynamic_cast<const Error*>(&e);
  m.code = static_cast<std::int32_t>(err ? err->code() : ErrorCode::internal);
  const Health h = rank_layer_.layer().health();
  m.peer = h.peer;
  m.health_ok = h.ok ? 1 : 0;
  // CUDA: the lowest survivor makes the next communicator's id (rank 0 unless it is the rank
  // named as the culprit).
  if (cuda_ && rank_ == (h.peer == 0 ? 1 : 0)) {
    m.has_id = 1;
    m.unique_id = get_unique_id();
  }
  set_what(m, e.what());
  return m;
}

void RankProcess::check(std::vector<std::uint16_t>& y, const reference::Batch& batch,
                        const RoundDraw& draw, std::int64_t round) {
  if (!check_due(o_, round)) return;
  corrupt_once(y, corrupt_pending_);
  record_check(st_, y, reference_.forward(batch), s_.precision, s_.shape.intermediate,
               s_.checked_options(), rank_, round, draw);
}

}  // namespace

int rank_process(const Options& o, const Setup& s, const RankProcessStart& start) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the supervisor
  return RankProcess(o, s, start).run();
}

}  // namespace epmoe::tools::stress
