#include "stress/fault.hpp"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "epmoe/epmoe.hpp"
#include "harness/problem.hpp"
#include "stress/options.hpp"

namespace epmoe::tools::stress {
namespace {

std::vector<std::string> split_at_colons(const std::string& text) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  while (true) {
    const std::size_t colon = text.find(':', start);
    parts.push_back(text.substr(start, colon - start));
    if (colon == std::string::npos) return parts;
    start = colon + 1;
  }
}

// The fault of KIND; kill:RANK is a stall that only the supervisor's SIGKILL ends.
Fault parse_kind(const std::string& kind, const std::string& text, bool kill, bool processes) {
  if (kill && !processes)
    reject("--fault=" + text +
           ": killing a rank process needs ranks as processes; add --processes (the thread "
           "mode runs every rank as a thread of one process)");
  if (!kill && processes)
    reject("--fault=" + text +
           ": with --processes only kill:RANK is supported; run skip_launch_when_idle, stall "
           "and round_jump without --processes");
  if (kill || kind == "stall") return Fault::stall;
  if (kind == "skip_launch_when_idle") return Fault::skip_launch_when_idle;
  if (kind == "round_jump") return Fault::round_jump;
  reject("--fault=" + text +
         ": must be skip_launch_when_idle:RANK, stall:RANK:MS, round_jump:RANK or (with "
         "--processes) kill:RANK");
}

// RANK and, for stall:RANK:MS, MS.
void parse_numbers(const std::vector<std::string>& parts, bool with_ms, FaultPlan& plan) {
  const std::size_t want = with_ms ? 3 : 2;
  if (parts.size() != want)
    reject("--fault=" + plan.text + ": expected " +
           (with_ms ? std::string("stall:RANK:MS") : parts[0] + ":RANK"));
  try {
    std::size_t used = 0;
    plan.rank = std::stoi(parts[1], &used);
    if (used != parts[1].size()) throw std::invalid_argument("rank");
    if (with_ms) {
      const unsigned long ms = std::stoul(parts[2], &used);
      if (used != parts[2].size() || ms > kMaxTimeoutMs) throw std::invalid_argument("ms");
      plan.stall_ms = static_cast<std::uint32_t>(ms);
    }
  } catch (const std::logic_error&) {
    reject("--fault=" + plan.text + ": RANK and MS must be non-negative integers");
  }
}

}  // namespace

FaultPlan parse_fault(const std::string& text, int ranks, std::uint32_t timeout_ms,
                      bool processes) {
  FaultPlan plan;
  plan.text = text;
  if (text.empty() || text == "none") return plan;
  const std::vector<std::string> parts = split_at_colons(text);
  const std::string& kind = parts[0];
  const bool kill = kind == "kill" || kind == "killed" || kind == "kill_rank";
  plan.fault = parse_kind(kind, text, kill, processes);
  parse_numbers(parts, plan.fault == Fault::stall && !kill, plan);
  if (plan.rank < 0 || plan.rank >= ranks)
    reject("--fault=" + text + ": rank " + std::to_string(plan.rank) + " is not in [0, " +
           std::to_string(ranks) + ")");
  if (ranks < 2) reject("--fault needs --ranks >= 2: someone has to notice");
  if (timeout_ms == 0)
    reject("--fault needs a bounded wait: --timeout-ms=0 waits forever, so a fault would hang");
  if (kill) {
    plan.kill = true;
    plan.stall_ms = 60'000;  // far beyond any --timeout-ms: only the SIGKILL ends it
    return plan;
  }
  if (plan.fault == Fault::stall && plan.stall_ms <= timeout_ms)
    reject("--fault=" + text + ": a stall of " + std::to_string(plan.stall_ms) +
           " ms is not longer than --timeout-ms=" + std::to_string(timeout_ms) +
           ", so nobody would give up; stall longer than the timeout");
  return plan;
}

std::int64_t fault_round(const Options& o, int episode) {
  return o.rounds * (episode + 1) / (std::int64_t{o.fault_times} + 1);
}

std::int64_t kill_round(const Options& o, int episode) {
  const std::int64_t span = std::max<std::int64_t>(1, o.rounds / (4 * (o.fault_times + 1)));
  harness::Rng rng(o.seed * 0x2545f4914f6cdd1dull + static_cast<std::uint64_t>(episode) + 11);
  return std::clamp<std::int64_t>(fault_round(o, episode) + rng.below(2 * span + 1) - span, 1,
                                  o.rounds);
}

}  // namespace epmoe::tools::stress
