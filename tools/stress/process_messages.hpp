// What rank processes and their supervisor say to each other, over two pipes per rank: up (rank ->
// supervisor) carries Msg, down (supervisor -> rank) carries Resume.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "epmoe/epmoe.hpp"
#include "stress/report.hpp"

namespace epmoe::tools::stress {

// armed: the doomed rank is about to enter the round it will be killed in. arrival: a survivor
// failed a round. stats: a RankStats follows (see send_stats). unique_id: the first NCCL
// communicator's id, made by rank 0 (a survivor's arrival carries the next one after a kill).
enum class MsgKind : std::int32_t { armed, arrival, stats, unique_id };

constexpr std::size_t kTextBytes = 240;  // `what` and each mismatch note, NUL-padded

// Fixed-size, so the supervisor can split the byte stream without a length prefix.
struct Msg {
  MsgKind kind = MsgKind::stats;
  std::int32_t rank = 0;
  std::int64_t round = 0;
  std::int64_t at_ns = 0;  // stress::to_ns (the same clock in every process)
  std::int32_t code = 0;
  std::int32_t peer = -1;
  std::int32_t health_ok = 1;
  std::int32_t notes = 0;
  std::int64_t counts[7] = {};  // forwards tokens zero checked mismatched_rounds mismatches aborted
  std::int64_t max_round = 0;
  std::int64_t wall_n = 0;
  std::int64_t idle_n = 0;
  float max_us = 0.0f;
  char what[kTextBytes] = {};
  std::int32_t has_id = 0;
  UniqueId unique_id;
};

// The round to go on from and, on the CUDA executor, the unique id of the communicator to
// (re)build.
struct Resume {
  std::int64_t round = 0;
  std::int32_t has_id = 0;
  UniqueId unique_id;
};

// A rank process's exit status.
enum RankExit : int { kRankPass = 0, kRankResetFailed = 14, kRankError = 15 };

bool write_all(int fd, const void* data, std::size_t n);
void set_what(Msg& m, const std::string& what);  // truncated to fit
void send_msg(int fd, const Msg& m);
// The header, then idle bytes, wall times, notes (kTextBytes each).
void send_stats(int fd, int rank, const RankStats& st);
// Blocks for the next Resume; false once the supervisor has closed the pipe (it gave up on the
// run).
bool read_resume(int fd, Resume& resume);

// Splits one rank's byte stream into messages as they complete.
class MsgStream {
 public:
  void append(const char* data, std::size_t n) { buffer_.insert(buffer_.end(), data, data + n); }
  // The next whole message and, for stats, its payload; false until more bytes have come.
  bool next(Msg& m, std::vector<char>& payload);

 private:
  std::vector<char> buffer_;
};

// Adds a stats message (and its payload) to what earlier incarnations of the rank reported.
void merge_stats(RankStats& into, const Msg& m, const char* payload);

}  // namespace epmoe::tools::stress
