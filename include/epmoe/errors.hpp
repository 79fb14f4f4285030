// Errors and health reports of epmoe.
//
// Every rejected argument throws epmoe::Error with ErrorCode::invalid_argument and a message that
// names the argument, its value and the rule. Cross-rank failures (a bounded wait that expired, a
// peer that aborted, a protocol violation) are reported as a Health record; the layer then refuses
// work until a collective reset().
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace epmoe {

enum class ErrorCode : std::uint32_t {
  invalid_argument = 1,    // a caller-supplied value broke a documented rule
  timeout = 2,             // a bounded wait expired on this rank
  peer_aborted = 3,        // another rank gave up and raised `abort` here
  protocol_violation = 4,  // a peer was observed more than one round away (docs/design.md §3 I4)
  layer_unhealthy = 5,     // forward() after an error without reset()
  unsupported = 6,         // a valid request this build or backend cannot serve
  internal = 7,
};

const char* to_string(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// Where in the round (docs/design.md §3) a rank was when it gave up.
enum class Phase : std::uint32_t {
  none = 0,
  dispatch_counts = 1,  // step 4: waiting for every peer's (round, n) count message
  expert_done = 2,      // step 7: waiting for every peer's done message
  reset = 3,            // the collective reset() itself
  grid_barrier = 4,     // the persistent round kernel: its own CTAs meeting between two steps
};

const char* to_string(Phase phase);

// The diagnostic record of docs/design.md §3 I3: who gave up waiting for whom, where and when.
struct Health {
  bool ok = true;
  ErrorCode code = ErrorCode::internal;  // meaningful when !ok
  int rank = -1;                         // the rank that detected the failure
  int peer = -1;                         // the rank it was waiting for (-1: unknown)
  int reporter = -1;                     // the rank that gave up first (peer_aborted: another)
  Phase phase = Phase::none;
  std::uint32_t round = 0;     // the round the detecting rank was in
  std::uint32_t observed = 0;  // the round number it last saw from `peer`
  std::uint32_t expected = 0;  // the round number it needed
  std::string what;            // a one-line human-readable description

  static Health healthy() { return Health{}; }
};

}  // namespace epmoe
