// Ranks as processes (CPU executor over POSIX shared memory): a rank process killed in the middle
// of a round is named by every survivor within the timeout, and after a restarted rank process
// rejoins, a collective reset() brings back correct rounds. No barrier anywhere but reset().
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "epmoe/epmoe.hpp"
#include "epmoe/testing.hpp"
#include "harness/cluster.hpp"
#include "harness/problem.hpp"

namespace epmoe {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kWorld = 3;
constexpr int kVictim = 1;
constexpr std::uint32_t kTimeoutMs = 500;
const LayerShape kShape{
    .hidden = 64, .intermediate = 64, .num_experts = 6, .top_k = 2, .max_tokens_per_rank = 8};

// Exit codes of a rank process, so the parent can say what went wrong.
enum Exit : int {
  kPass = 0,
  kMismatch = 10,
  kNotDetected = 11,
  kWrongCulprit = 12,
  kTooSlow = 13,
  kResetFailed = 14,
  kUnexpectedError = 15,
};

class RankProcess {
 public:
  RankProcess(const std::string& group_name, int rank)
      : rank_(rank),
        group_(attach_shared_memory_group(group_name, kWorld)),
        comm_(make_host_communicator(group_, rank)),
        weights_(harness::make_random_weights(kShape, 7)),
        reference_(kShape, Precision::bf16, options(), weights_),
        layer_(*comm_, make_config(kShape, Precision::bf16, rank, kWorld, options()),
               local_weight_views(weights_, kShape, rank, kWorld)) {}

  static LayerOptions options() {
    LayerOptions o;
    o.timeout_ms = kTimeoutMs;
    return o;
  }

  // One round with this rank's batch of `step`; returns kPass or kMismatch; throws Error.
  int round(std::uint64_t step) {
    const reference::Batch b = harness::make_random_batch(
        kShape, kWorld, (step + static_cast<std::uint64_t>(rank_)) % 4 == 0 ? 0 : 5,
        harness::Routing::uniform, 0, step * 10 + static_cast<std::uint64_t>(rank_));
    std::vector<std::uint16_t> y(static_cast<std::size_t>(b.tokens * kShape.hidden));
    layer_.forward(view(b.x.data(), DType::bf16, {b.tokens, kShape.hidden}),
                   view(b.topk_ids.data(), DType::i32, {b.tokens, kShape.top_k}),
                   view(b.topk_weights.data(), DType::f32, {b.tokens, kShape.top_k}),
                   view(y.data(), DType::bf16, {b.tokens, kShape.hidden}));
    return reference::compare_bf16(y, reference_.forward(b)).mismatches == 0 ? kPass : kMismatch;
  }

  int rounds(std::uint64_t first, std::uint64_t count) {
    for (std::uint64_t s = first; s < first + count; ++s)
      if (const int r = round(s); r != kPass) return r;
    return kPass;
  }

  // Survivors retry reset() until the restarted rank joins; each attempt is bounded.
  bool reset_until_everyone_joins() {
    for (int attempt = 0; attempt < 60; ++attempt) {
      try {
        layer_.reset();
        return true;
      } catch (const Error&) {
      }
    }
    return false;
  }

  Layer& layer() { return layer_; }

 private:
  int rank_;
  std::shared_ptr<HostGroup> group_;
  std::unique_ptr<Communicator> comm_;
  reference::LayerWeights weights_;
  reference::ReferenceModel reference_;
  Layer layer_;
};

// A survivor: 5 good rounds, the round in which the victim dies, reset, 5 good rounds.
int survivor(const std::string& name, int rank) {
  RankProcess p(name, rank);
  if (const int r = p.rounds(1, 5); r != kPass) return r;
  const auto start = Clock::now();
  try {
    p.round(6);
    return kNotDetected;
  } catch (const Error&) {
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const Health h = p.layer().health();
  std::fprintf(stderr, "rank %d: %.3f s: %s\n", rank, seconds, h.what.c_str());
  if (h.peer != kVictim) return kWrongCulprit;
  if (seconds > kTimeoutMs / 1000.0 + 1.0) return kTooSlow;
  if (!p.reset_until_everyone_joins()) return kResetFailed;
  return p.rounds(100, 5);
}

// The victim: 5 good rounds, then stalls inside round 6 (after dispatch) and tells the parent,
// which kills it there.
int victim(const std::string& name, int ready_fd) {
  RankProcess p(name, kVictim);
  if (const int r = p.rounds(1, 5); r != kPass) return r;
  testing::inject_fault(p.layer(), {testing::Fault::stall, 60'000, 1});
  const char c = 'S';
  if (write(ready_fd, &c, 1) != 1) return kUnexpectedError;
  p.round(6);
  return kUnexpectedError;  // killed before this
}

// The restarted victim: finds its old window, joins the survivors' reset, 5 good rounds.
int restarted(const std::string& name) {
  RankProcess p(name, kVictim);
  if (!p.reset_until_everyone_joins()) return kResetFailed;
  return p.rounds(100, 5);
}

template <class Fn>
pid_t spawn(Fn&& fn) {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    int code = kUnexpectedError;
    try {
      code = fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank process: %s\n", e.what());
    }
    std::fflush(nullptr);
    _exit(code);
  }
  return pid;
}

// Waits for `pid` until `deadline`; -1 when it had to be killed (a hang).
int wait_exit(pid_t pid, Clock::time_point deadline) {
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -2;
}

TEST(MultiProcess, KilledRankProcessIsNamedAndARestartedOneRejoinsAfterReset) {
  if (!testing::fault_injection_available()) GTEST_SKIP() << "built without fault switches";
  const std::string name = "test" + std::to_string(getpid());
  remove_shared_memory_group(name, kWorld);
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);

  const pid_t rank0 = spawn([&] { return survivor(name, 0); });
  const pid_t rank2 = spawn([&] { return survivor(name, 2); });
  const pid_t rank1 = spawn([&] { return victim(name, pipe_fds[1]); });
  close(pipe_fds[1]);
  const auto deadline = Clock::now() + std::chrono::seconds(60);

  char c = 0;
  ASSERT_EQ(read(pipe_fds[0], &c, 1), 1) << "the victim never reached round 6";
  close(pipe_fds[0]);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // inside its round 6 by now
  ASSERT_EQ(kill(rank1, SIGKILL), 0);
  int status = 0;
  waitpid(rank1, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status)) << "the victim must die mid-round, not finish it";

  const pid_t rank1_again = spawn([&] { return restarted(name); });
  EXPECT_EQ(wait_exit(rank0, deadline), kPass) << "rank 0 (see exit codes in the test)";
  EXPECT_EQ(wait_exit(rank2, deadline), kPass) << "rank 2";
  EXPECT_EQ(wait_exit(rank1_again, deadline), kPass) << "restarted rank 1";
  remove_shared_memory_group(name, kWorld);
}

TEST(MultiProcess, AttachRejectsABadName) {
  EXPECT_THROW(attach_shared_memory_group("a/b", 2), Error);
  EXPECT_THROW(attach_shared_memory_group("ok", 0), Error);
}

}  // namespace
}  // namespace epmoe
