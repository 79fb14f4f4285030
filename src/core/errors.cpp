#include "epmoe/errors.hpp"

namespace epmoe {

const char* to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::invalid_argument:
      return "invalid argument";
    case ErrorCode::timeout:
      return "timeout";
    case ErrorCode::peer_aborted:
      return "peer aborted";
    case ErrorCode::protocol_violation:
      return "protocol violation";
    case ErrorCode::layer_unhealthy:
      return "layer unhealthy";
    case ErrorCode::unsupported:
      return "unsupported";
    case ErrorCode::internal:
      return "internal error";
  }
  return "unknown error";
}

const char* to_string(Phase phase) {
  switch (phase) {
    case Phase::none:
      return "none";
    case Phase::dispatch_counts:
      return "dispatch_counts";
    case Phase::expert_done:
      return "expert_done";
    case Phase::reset:
      return "reset";
    case Phase::grid_barrier:
      return "grid_barrier";
  }
  return "unknown";
}

}  // namespace epmoe
