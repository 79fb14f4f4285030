// What each rank counts as it goes, and the summary and verdict printed from it (both rank modes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epmoe/epmoe.hpp"
#include "reference/reference.hpp"
#include "stress/load.hpp"
#include "stress/options.hpp"

namespace epmoe::tools::stress {

struct RankStats {
  std::int64_t forwards = 0, tokens = 0, zero = 0, checked = 0, mismatched_rounds = 0,
               mismatches = 0, aborted = 0;
  std::vector<float> wall_us;      // completed forwards only
  std::vector<std::uint8_t> idle;  // per stress round (1-based): 1 = T == 0
  float max_us = 0.0f;
  std::int64_t max_round = 0;
  std::vector<std::string> mismatch_notes;  // the first few

  RankStats() = default;
  explicit RankStats(std::int64_t rounds);  // room for `rounds` rounds
};

// Every forward, failed or not.
void record_forward(RankStats& st, const RoundDraw& draw, std::int64_t round);
// A completed forward's wall time (a failed one's wait is reported with its fault episode).
void record_wall(RankStats& st, float us, std::int64_t round);

// Whether --check-every picks this round.
bool check_due(const Options& o, std::int64_t round);
// --corrupt-check: flips a bit of the first checked output, to prove the checker can fail.
void corrupt_once(std::vector<std::uint16_t>& y, bool& pending);
// Checks one round's output against the reference with reference::check_output (the rule of the
// layer's combine and the expert math it is checked under: Setup::checked_options; `intermediate`:
// the layer's I, which the E4M3 GEMMs' bound and the bf16 GEMMs' floor scale with) and records it
// in `st`.
reference::OutputCheck record_check(RankStats& st, const std::vector<std::uint16_t>& y,
                                    const std::vector<std::uint16_t>& ref, Precision precision,
                                    std::int64_t intermediate, const LayerOptions& options,
                                    int rank, std::int64_t round, const RoundDraw& draw);

double percent(std::int64_t part, std::int64_t whole);

// The load part of the summary; returns the totals and sets rounds_seen (rank 0's forwards).
RankStats print_load_summary(const std::vector<RankStats>& stats, const Options& o,
                             const std::string& rule, double wall_s, std::int64_t& rounds_seen);

// The last line: PASS (with `pass_note`) when `why` is empty, else "FAIL:" and why. Returns the
// exit status.
int print_verdict(const std::string& why, const char* pass_note);

}  // namespace epmoe::tools::stress
