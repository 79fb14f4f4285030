#include "stress/supervisor.hpp"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "stress/process_messages.hpp"
#include "stress/rank_process.hpp"
#include "stress/recovery.hpp"
#include "stress/report.hpp"
#include "stress/watchdog.hpp"

namespace epmoe::tools::stress {
namespace {

// One process of a rank; a killed rank gets a new one.
struct Incarnation {
  pid_t pid = -1;
  int up = -1;    // the supervisor reads Msg
  int down = -1;  // the supervisor writes Resume
  MsgStream stream;
  bool eof = false;
  bool exited = false;
  int status = 0;
  std::string last = "starting";  // what it last said, for the watchdog
};

Arrival arrival_of(const Msg& m) {
  Arrival a;
  a.error = true;
  a.code = static_cast<ErrorCode>(m.code);
  a.health.ok = m.health_ok != 0;
  a.health.peer = m.peer;
  a.what = m.what;
  a.round = m.round;
  a.at = from_ns(m.at_ns);
  return a;
}

class Supervisor {
 public:
  Supervisor(const Options& o, const Setup& s);
  int run();

 private:
  void spawn(int rank, bool restarted, std::int64_t replay_through, int episodes_done);
  [[noreturn]] void run_child(const RankProcessStart& start);
  void drop_fds(Incarnation& in);
  void kill_everyone();
  bool all_done() const;
  int hang();
  void kill_victim();
  void give_up_on_missing();
  void read_ranks();
  void read_rank(int r);
  void handle(int r, const Msg& m, const std::vector<char>& payload);
  void relay_first_id(const Msg& m);
  void open_episode(const Msg& m);
  void on_arrival(int r, const Msg& m);
  bool resume_if_all_reported();
  void reap();
  int report(double wall_s);
  bool report_exits() const;

  const Options& o_;
  const Setup& s_;
  const std::string group_;  // the shared-memory group (CPU executor)
  const int world_;
  const int victim_;  // the rank --fault kill:RANK kills (-1: none)
  const bool cuda_;
  std::vector<int> fds_;  // every pipe end the supervisor holds, closed in each child
  std::vector<Incarnation> live_;
  std::vector<RankStats> stats_;  // summed over each rank's incarnations
  std::vector<KillEpisode> episodes_;
  std::optional<Clock::time_point> kill_at_;       // the doomed rank is inside its round
  std::optional<Clock::time_point> arrivals_due_;  // the survivors must report by then
  std::vector<std::string> problems_;
  int kills_ = 0;
  bool stop_ = false;
};

Supervisor::Supervisor(const Options& o, const Setup& s)
    : o_(o),
      s_(s),
      group_("epmoe-stress-" + std::to_string(getpid())),
      world_(o.ranks),
      victim_(s.fault.rank),
      cuda_(s.backend == Backend::cuda_nccl),
      live_(static_cast<std::size_t>(o.ranks)),
      stats_(static_cast<std::size_t>(o.ranks), RankStats(o.rounds)) {}

int Supervisor::run() {
  remove_shared_memory_group(group_, world_);
  const auto start = Clock::now();
  for (int r = 0; r < world_; ++r) spawn(r, false, 0, 0);
  const auto watchdog_at = start + std::chrono::seconds(o_.watchdog_s);
  while (!all_done() && !stop_) {
    if (o_.watchdog_s > 0 && Clock::now() >= watchdog_at) return hang();
    // The doomed rank has been inside its round long enough: kill it, start its successor.
    if (kill_at_ && Clock::now() >= *kill_at_) kill_victim();
    if (arrivals_due_ && Clock::now() > *arrivals_due_) {
      give_up_on_missing();
      break;
    }
    read_ranks();
    if (!resume_if_all_reported()) break;
    reap();
  }
  if (stop_) kill_everyone();
  const double wall_s = seconds_between(start, Clock::now());
  for (Incarnation& in : live_) drop_fds(in);
  remove_shared_memory_group(group_, world_);
  return report(wall_s);
}

void Supervisor::spawn(int rank, bool restarted, std::int64_t replay_through, int episodes_done) {
  int up[2], down[2];
  if (pipe(up) != 0 || pipe(down) != 0)
    throw Error(ErrorCode::internal, std::string("pipe: ") + std::strerror(errno));
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) throw Error(ErrorCode::internal, std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    for (int fd : fds_) ::close(fd);
    ::close(up[0]);
    ::close(down[1]);
    run_child({group_, rank, up[1], down[0], restarted, replay_through, episodes_done});
  }
  ::close(up[1]);
  ::close(down[0]);
  fds_.push_back(up[0]);
  fds_.push_back(down[1]);
  Incarnation& in = live_[static_cast<std::size_t>(rank)];
  in = Incarnation{};
  in.pid = pid;
  in.up = up[0];
  in.down = down[1];
  in.last = restarted ? "restarted, joining reset()" : "starting";
}

void Supervisor::run_child(const RankProcessStart& start) {
  int code = kRankError;
  try {
    code = rank_process(o_, s_, start);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epmoe stress: rank %d process: %s\n", start.rank, e.what());
  }
  std::fflush(nullptr);
  _exit(code);
}

void Supervisor::drop_fds(Incarnation& in) {
  for (int* fd : {&in.up, &in.down})
    if (*fd >= 0) {
      ::close(*fd);
      fds_.erase(std::remove(fds_.begin(), fds_.end(), *fd), fds_.end());
      *fd = -1;
    }
}

void Supervisor::kill_everyone() {
  for (Incarnation& in : live_)
    if (in.pid > 0 && !in.exited) {
      ::kill(in.pid, SIGKILL);
      ::waitpid(in.pid, &in.status, 0);
      in.exited = true;
    }
}

bool Supervisor::all_done() const {
  bool done = true;
  for (const Incarnation& in : live_) done &= in.eof && in.exited;
  return done;
}

int Supervisor::hang() {
  print_hang_banner(o_.watchdog_s);
  for (int r = 0; r < world_; ++r)
    std::fprintf(stderr, "  rank %d (pid %d): last heard: %s\n", r,
                 static_cast<int>(live_[static_cast<std::size_t>(r)].pid),
                 live_[static_cast<std::size_t>(r)].last.c_str());
  kill_everyone();
  remove_shared_memory_group(group_, world_);
  print_hang_verdict();
  std::fflush(nullptr);
  return kExitHang;
}

void Supervisor::kill_victim() {
  kill_at_.reset();
  Incarnation& in = live_[static_cast<std::size_t>(victim_)];
  KillEpisode& e = episodes_.back();
  ::kill(in.pid, SIGKILL);
  e.killed_at = Clock::now();
  e.killed = true;
  ::waitpid(in.pid, &in.status, 0);
  e.died_by_signal = WIFSIGNALED(in.status) && WTERMSIG(in.status) == SIGKILL;
  if (!e.died_by_signal) e.problems.push_back("the doomed rank exited before it was killed");
  drop_fds(in);
  ++kills_;
  spawn(victim_, true, e.round, kills_);
  arrivals_due_ = Clock::now() + std::chrono::milliseconds(2 * std::int64_t{o_.timeout_ms} + 5'000);
}

void Supervisor::give_up_on_missing() {
  KillEpisode& e = episodes_.back();
  std::vector<int> missing;
  for (int r = 0; r < world_; ++r)
    if (r != victim_ && !e.arrivals[static_cast<std::size_t>(r)]) missing.push_back(r);
  e.problems.push_back(never_reported(missing));
  stop_ = true;
}

void Supervisor::read_ranks() {
  std::vector<pollfd> fds;
  std::vector<int> who;
  for (int r = 0; r < world_; ++r) {
    const Incarnation& in = live_[static_cast<std::size_t>(r)];
    if (in.up >= 0 && !in.eof) {
      fds.push_back({in.up, POLLIN, 0});
      who.push_back(r);
    }
  }
  const int n = ::poll(fds.data(), static_cast<nfds_t>(fds.size()), 5);
  for (std::size_t i = 0; n > 0 && i < fds.size(); ++i)
    if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) read_rank(who[i]);
}

void Supervisor::read_rank(int r) {
  Incarnation& in = live_[static_cast<std::size_t>(r)];
  char buf[65536];
  const ssize_t got = ::read(in.up, buf, sizeof buf);
  if (got <= 0) {
    in.eof = true;
    return;
  }
  in.stream.append(buf, static_cast<std::size_t>(got));
  Msg m;
  std::vector<char> payload;
  while (in.stream.next(m, payload)) handle(r, m, payload);
}

void Supervisor::handle(int r, const Msg& m, const std::vector<char>& payload) {
  Incarnation& in = live_[static_cast<std::size_t>(r)];
  switch (m.kind) {
    case MsgKind::stats:
      merge_stats(stats_[static_cast<std::size_t>(r)], m, payload.data());
      in.last = "reported its results";
      return;
    case MsgKind::unique_id:
      relay_first_id(m);
      in.last = "made the communicator id";
      return;
    case MsgKind::armed:
      open_episode(m);
      in.last = "doomed, inside round " + std::to_string(m.round);
      return;
    case MsgKind::arrival:
      in.last = "failed round " + std::to_string(m.round) + ", waiting to reset";
      on_arrival(r, m);
      return;
  }
}

// CUDA: the first communicator's id, from rank 0 to everyone.
void Supervisor::relay_first_id(const Msg& m) {
  Resume first;
  first.round = 1;
  first.has_id = 1;
  first.unique_id = m.unique_id;
  for (Incarnation& each : live_)
    if (each.down >= 0) (void)write_all(each.down, &first, sizeof first);
}

// The doomed rank is entering its round; it is killed 50 ms in, well inside its (60 s) stall.
void Supervisor::open_episode(const Msg& m) {
  KillEpisode e;
  e.index = static_cast<int>(episodes_.size()) + 1;
  e.victim = victim_;
  e.round = m.round;
  e.armed_at = from_ns(m.at_ns);
  e.arrivals.assign(static_cast<std::size_t>(world_), std::nullopt);
  e.next_ids.assign(static_cast<std::size_t>(world_), std::nullopt);
  episodes_.push_back(std::move(e));
  kill_at_ = from_ns(m.at_ns) + std::chrono::milliseconds(50);
}

// A survivor's failed round belongs to the open kill episode; any other failure ends the run.
void Supervisor::on_arrival(int r, const Msg& m) {
  if (episodes_.empty() || episodes_.back().resume > 0 || r == victim_) {
    problems_.push_back("rank " + std::to_string(r) + ": unexpected error in round " +
                        std::to_string(m.round) + " (" + to_string(static_cast<ErrorCode>(m.code)) +
                        "): " + m.what);
    stop_ = true;
    return;
  }
  KillEpisode& e = episodes_.back();
  e.arrivals[static_cast<std::size_t>(r)] = arrival_of(m);
  if (m.has_id != 0) e.next_ids[static_cast<std::size_t>(r)] = m.unique_id;
}

// Every survivor reported and the successor is running: tells everyone where to resume (and, on
// the CUDA executor, the lowest sender's id of the next communicator). False: stop the run now.
bool Supervisor::resume_if_all_reported() {
  if (episodes_.empty()) return true;
  KillEpisode& e = episodes_.back();
  if (e.resume != 0 || !e.killed) return true;
  std::int64_t last = e.round;
  for (int r = 0; r < world_; ++r) {
    if (r == victim_) continue;
    const std::optional<Arrival>& a = e.arrivals[static_cast<std::size_t>(r)];
    if (!a) return true;
    last = std::max(last, a->round);
  }
  e.resume = last + 1;
  arrivals_due_.reset();
  Resume resume;
  resume.round = e.resume;
  for (const std::optional<UniqueId>& id : e.next_ids)
    if (id) {
      resume.has_id = 1;
      resume.unique_id = *id;
      break;
    }
  if (cuda_ && resume.has_id == 0) {
    e.problems.push_back("no survivor sent the id of the next communicator");
    stop_ = true;
    return false;
  }
  for (Incarnation& in : live_)
    if (in.down >= 0) (void)write_all(in.down, &resume, sizeof resume);
  return true;
}

// A process that exited is drained to EOF on later turns.
void Supervisor::reap() {
  for (Incarnation& in : live_)
    if (in.pid > 0 && !in.exited && ::waitpid(in.pid, &in.status, WNOHANG) == in.pid)
      in.exited = true;
}

int Supervisor::report(double wall_s) {
  std::int64_t rounds_seen = 0;
  const RankStats all = print_load_summary(
      stats_, o_,
      reference::output_rule(s_.layer_options.combine, s_.checked_options().expert_math,
                             s_.precision, s_.shape.intermediate),
      wall_s, rounds_seen);
  bool fault_ok = problems_.empty();
  for (KillEpisode& e : episodes_) fault_ok &= print_kill_episode(e, o_.timeout_ms, cuda_);
  for (const std::string& p : problems_) std::printf("PROBLEM: %s\n", p.c_str());
  if (s_.fault.kill && static_cast<int>(episodes_.size()) != o_.fault_times) {
    fault_ok = false;
    std::printf("\nPROBLEM: %d kill episode(s) expected, %zu seen\n", o_.fault_times,
                episodes_.size());
  }
  const bool exits_ok = report_exits();
  const bool complete = !stop_ && rounds_seen > 0;
  const bool idle_enough =
      static_cast<double>(all.zero) >= o_.min_zero_fraction * static_cast<double>(all.forwards);
  if (!idle_enough) std::printf("PROBLEM: fewer zero-token forwards than --min-zero-fraction\n");
  std::string why;
  if (all.mismatched_rounds > 0) why += " mismatch";
  if (!fault_ok) why += s_.fault.kill ? " fault-detection/recovery" : " errors";
  if (!exits_ok) why += " rank-process-failed";
  if (!complete) why += " stopped-early";
  if (!idle_enough) why += " too-few-idle-rounds";
  return print_verdict(why, s_.fault.kill ? " (every kill detected by every survivor; the "
                                            "restarted rank rejoined)"
                                          : "");
}

bool Supervisor::report_exits() const {
  bool ok = true;
  for (int r = 0; r < world_; ++r) {
    const Incarnation& in = live_[static_cast<std::size_t>(r)];
    if (WIFEXITED(in.status) && WEXITSTATUS(in.status) == kRankPass) continue;
    ok = false;
    std::printf("PROBLEM: rank %d process %s %d%s\n", r,
                WIFEXITED(in.status) ? "exited with" : "died of signal",
                WIFEXITED(in.status) ? WEXITSTATUS(in.status) : WTERMSIG(in.status),
                WIFEXITED(in.status) && WEXITSTATUS(in.status) == kRankResetFailed
                    ? " (reset() never met)"
                    : "");
  }
  return ok;
}

}  // namespace

int run_processes(const Options& o, const Setup& s) {
  return Supervisor(o, s).run();
}

}  // namespace epmoe::tools::stress
