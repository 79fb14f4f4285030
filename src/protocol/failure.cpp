#include "protocol/failure.hpp"

#include "protocol/message.hpp"

namespace epmoe {

Health failure_from_wait(int rank, std::uint32_t round, Phase phase,
                         const protocol::WaitOutcome& w) {
  using protocol::WaitStatus;
  Health h;
  h.ok = false;
  h.rank = rank;
  h.round = round;
  h.expected = round;
  h.observed = w.observed;
  h.peer = w.peer;
  h.phase = phase;
  h.reporter = rank;
  switch (w.status) {
    case WaitStatus::timeout:
      h.code = ErrorCode::timeout;
      break;
    case WaitStatus::violation:
      h.code = ErrorCode::protocol_violation;
      break;
    case WaitStatus::aborted: {
      const protocol::AbortRecord a = protocol::unpack_abort(w.abort_word);
      h.code = ErrorCode::peer_aborted;
      h.peer = a.culprit == protocol::kUnknownRank ? -1 : static_cast<int>(a.culprit);
      h.reporter = static_cast<int>(a.reporter);
      h.phase = static_cast<Phase>(a.phase);
      h.round = a.round;
      break;
    }
    case WaitStatus::ok:
      h.code = ErrorCode::internal;
      break;
  }
  return h;
}

Health reset_timeout(int rank, std::uint32_t round, int peer) {
  Health h;
  h.ok = false;
  h.code = ErrorCode::timeout;
  h.rank = rank;
  h.reporter = rank;
  h.peer = peer;
  h.phase = Phase::reset;
  h.round = round;
  return h;
}

std::string describe_failure(const Health& h, std::uint32_t timeout_ms) {
  const std::string me = "rank " + std::to_string(h.rank);
  const std::string peer = h.peer < 0 ? std::string("?") : std::to_string(h.peer);
  const std::string where =
      std::string(" in phase ") + to_string(h.phase) + " of round " + std::to_string(h.round);
  if (h.phase == Phase::reset)
    return me + ": reset() timed out: rank " + peer + " did not call reset() within " +
           std::to_string(timeout_ms) + " ms";
  if (h.phase == Phase::grid_barrier)
    return me + where +
           ": the persistent round kernel's CTAs did not all reach a grid barrier within " +
           std::to_string(timeout_ms) +
           " ms (a CTA was not resident or did not return from a step: "
           "an epmoe bug; please report it with this message)";
  switch (h.code) {
    case ErrorCode::timeout:
      return me + " timed out after " + std::to_string(timeout_ms) + " ms" + where +
             " waiting for rank " + peer + " (last saw its round " + std::to_string(h.observed) +
             ", expected " + std::to_string(h.expected) + ")";
    case ErrorCode::peer_aborted:
      return me + ": round " + std::to_string(h.round) + " aborted: rank " +
             std::to_string(h.reporter) + " gave up waiting for rank " + peer + where;
    case ErrorCode::protocol_violation:
      // A peer in this very round broke a wire rule (a count above max_tokens_per_rank, or a row
      // whose header or entries fail the checks of protocol::received_row_valid); otherwise it
      // is more than one round away (I4).
      if (h.observed == h.expected)
        return me + where + ": rank " + peer +
               " sent a count or a row that breaks the wire rules (a count above "
               "max_tokens_per_rank, or a row naming a token, slot or expert that cannot exist) "
               "(protocol violation)";
      return me + where + ": rank " + peer + " is at round " + std::to_string(h.observed) +
             ", more than one round away from " + std::to_string(h.expected) +
             " (protocol violation)";
    default:
      return me + ": " + to_string(h.code);
  }
}

}  // namespace epmoe
