#include "core/phase_record.hpp"

namespace epmoe {

const char* to_string(RoundPhase phase) {
  switch (phase) {
    case RoundPhase::dispatch:
      return "dispatch";
    case RoundPhase::route:
      return "route";
    case RoundPhase::wait_counts:
      return "wait_counts";
    case RoundPhase::fc1:
      return "fc1";
    case RoundPhase::fc2:
      return "fc2";
    case RoundPhase::combine:
      return "combine";
    case RoundPhase::wait_done:
      return "wait_done";
  }
  return "unknown";
}

namespace {
bool is_wait(int p) {
  return p == static_cast<int>(RoundPhase::wait_counts) ||
         p == static_cast<int>(RoundPhase::wait_done);
}
}  // namespace

PhaseTimes phase_times(const PhaseRecord& r, std::uint32_t round) {
  constexpr int kDispatch = static_cast<int>(RoundPhase::dispatch);
  if (round == 0 || r.begin[kDispatch] == kUnstampedBegin || r.end[kDispatch] == 0) return {};
  const std::uint64_t origin = r.begin[kDispatch];
  const auto us = [&](std::uint64_t ns) {
    return static_cast<double>(static_cast<std::int64_t>(ns - origin)) * 1e-3;
  };
  PhaseTimes t;
  t.round = round;
  int previous = -1;  // the last chain phase (not a wait) seen, stamped or not
  for (int p = 0; p < kRoundPhases; ++p) {
    PhaseSpan& s = t.spans[static_cast<std::size_t>(p)];
    if (r.end[p] != 0) {
      std::uint64_t begin = r.begin[p];
      if (begin == kUnstampedBegin && !is_wait(p) && previous >= 0 && r.end[previous] != 0)
        begin = r.end[previous];
      if (begin != kUnstampedBegin && begin <= r.end[p])
        s = PhaseSpan{true, us(begin), us(r.end[p])};
    }
    if (!is_wait(p)) previous = p;
  }
  return t;
}

}  // namespace epmoe
