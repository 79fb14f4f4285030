#include "stress/report.hpp"

#include <algorithm>
#include <cstdio>

namespace epmoe::tools::stress {
namespace {

double percentile(std::vector<float>& v, double q) {
  if (v.empty()) return 0.0;
  const auto i = static_cast<std::size_t>(q * static_cast<double>(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(i), v.end());
  return v[i];
}

// Every rank's counts summed; `max_rank` is the rank of the slowest forward.
RankStats sum(const std::vector<RankStats>& stats, int& max_rank) {
  RankStats all;
  max_rank = 0;
  for (std::size_t r = 0; r < stats.size(); ++r) {
    const RankStats& s = stats[r];
    all.forwards += s.forwards;
    all.tokens += s.tokens;
    all.zero += s.zero;
    all.checked += s.checked;
    all.mismatched_rounds += s.mismatched_rounds;
    all.mismatches += s.mismatches;
    all.aborted += s.aborted;
    all.wall_us.insert(all.wall_us.end(), s.wall_us.begin(), s.wall_us.end());
    if (s.max_us > all.max_us) {
      all.max_us = s.max_us;
      all.max_round = s.max_round;
      max_rank = static_cast<int>(r);
    }
  }
  return all;
}

std::int64_t rounds_every_rank_idle(const std::vector<RankStats>& stats, std::int64_t rounds) {
  std::int64_t n = 0;
  for (std::int64_t round = 1; round <= rounds; ++round) {
    bool every = true;
    for (const RankStats& s : stats) every &= s.idle[static_cast<std::size_t>(round)] != 0;
    n += every;
  }
  return n;
}

}  // namespace

RankStats::RankStats(std::int64_t rounds) {
  wall_us.reserve(static_cast<std::size_t>(rounds));
  idle.assign(static_cast<std::size_t>(rounds) + 1, 0);
}

void record_forward(RankStats& st, const RoundDraw& draw, std::int64_t round) {
  ++st.forwards;
  st.tokens += draw.tokens;
  if (draw.tokens == 0) {
    ++st.zero;
    st.idle[static_cast<std::size_t>(round)] = 1;
  }
}

void record_wall(RankStats& st, float us, std::int64_t round) {
  st.wall_us.push_back(us);
  if (us > st.max_us) {
    st.max_us = us;
    st.max_round = round;
  }
}

bool check_due(const Options& o, std::int64_t round) {
  return o.check_every > 0 && round % o.check_every == 0;
}

void corrupt_once(std::vector<std::uint16_t>& y, bool& pending) {
  if (!pending || y.empty()) return;
  y[0] ^= 0x4000;
  pending = false;
}

reference::OutputCheck record_check(RankStats& st, const std::vector<std::uint16_t>& y,
                                    const std::vector<std::uint16_t>& ref, Precision precision,
                                    std::int64_t intermediate, const LayerOptions& options,
                                    int rank, std::int64_t round, const RoundDraw& draw) {
  reference::OutputCheck check = reference::check_output(
      y, ref, options.combine, options.expert_math, precision, intermediate);
  ++st.checked;
  st.mismatches += check.stats.mismatches;
  if (check.pass) return check;
  ++st.mismatched_rounds;
  if (st.mismatch_notes.size() < 5) {
    char note[240];
    std::snprintf(note, sizeof note,
                  "rank %d round %lld T=%lld routing=%s: %lld elements outside tolerance, "
                  "max_abs=%.4g rel_l2=%.3g rms(ref)=%.4g",
                  rank, static_cast<long long>(round), static_cast<long long>(draw.tokens),
                  harness::to_string(draw.routing), static_cast<long long>(check.stats.mismatches),
                  check.stats.max_abs, check.stats.rel_l2, check.ref_rms);
    st.mismatch_notes.emplace_back(note);
  }
  return check;
}

double percent(std::int64_t part, std::int64_t whole) {
  return whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

RankStats print_load_summary(const std::vector<RankStats>& stats, const Options& o,
                             const std::string& rule, double wall_s, std::int64_t& rounds_seen) {
  int max_rank = 0;
  RankStats all = sum(stats, max_rank);
  const std::int64_t all_idle_rounds = rounds_every_rank_idle(stats, o.rounds);
  rounds_seen = stats[0].forwards;
  const double p50 = percentile(all.wall_us, 0.50), p99 = percentile(all.wall_us, 0.99);

  std::printf("\nrounds            %lld per rank, %lld forwards on %d ranks\n",
              static_cast<long long>(rounds_seen), static_cast<long long>(all.forwards), o.ranks);
  std::printf("tokens            %lld (%.2f per forward)\n", static_cast<long long>(all.tokens),
              static_cast<double>(all.tokens) / std::max<double>(1.0, double(all.forwards)));
  std::printf("zero-token        %lld forwards (%.1f%%); every rank idle in %lld rounds (%.1f%%)\n",
              static_cast<long long>(all.zero), percent(all.zero, all.forwards),
              static_cast<long long>(all_idle_rounds), percent(all_idle_rounds, o.rounds));
  std::printf("checked           %lld forwards against the emulating reference (%s)\n",
              static_cast<long long>(all.checked), rule.c_str());
  std::printf(
      "mismatches        %lld elements outside the per-element tolerance; %lld forwards "
      "broke the rule\n",
      static_cast<long long>(all.mismatches), static_cast<long long>(all.mismatched_rounds));
  for (const RankStats& s : stats)
    for (const std::string& note : s.mismatch_notes) std::printf("  %s\n", note.c_str());
  std::printf(
      "forward wall time p50 %.3f ms  p99 %.3f ms  max %.3f ms (rank %d, round %lld; completed "
      "forwards)\n",
      p50 * 1e-3, p99 * 1e-3, static_cast<double>(all.max_us) * 1e-3, max_rank,
      static_cast<long long>(all.max_round));
  std::printf("throughput        %.0f rounds/s (%.2f s wall)\n",
              static_cast<double>(rounds_seen) / wall_s, wall_s);
  return all;
}

int print_verdict(const std::string& why, const char* pass_note) {
  const bool ok = why.empty();
  std::printf("\n%s%s%s\n", ok ? "PASS" : "FAIL:", why.c_str(), ok ? pass_note : "");
  return ok ? kExitPass : kExitFail;
}

}  // namespace epmoe::tools::stress
