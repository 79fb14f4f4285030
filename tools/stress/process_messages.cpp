#include "stress/process_messages.hpp"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace epmoe::tools::stress {
namespace {

std::size_t stats_bytes(const Msg& m) {
  return sizeof m + static_cast<std::size_t>(m.idle_n) +
         static_cast<std::size_t>(m.wall_n) * sizeof(float) +
         static_cast<std::size_t>(m.notes) * kTextBytes;
}

Msg stats_header(int rank, const RankStats& st) {
  Msg m;
  m.kind = MsgKind::stats;
  m.rank = rank;
  m.counts[0] = st.forwards;
  m.counts[1] = st.tokens;
  m.counts[2] = st.zero;
  m.counts[3] = st.checked;
  m.counts[4] = st.mismatched_rounds;
  m.counts[5] = st.mismatches;
  m.counts[6] = st.aborted;
  m.max_round = st.max_round;
  m.max_us = st.max_us;
  m.wall_n = static_cast<std::int64_t>(st.wall_us.size());
  m.idle_n = static_cast<std::int64_t>(st.idle.size());
  m.notes = static_cast<std::int32_t>(st.mismatch_notes.size());
  return m;
}

}  // namespace

bool write_all(int fd, const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

void set_what(Msg& m, const std::string& what) {
  std::snprintf(m.what, sizeof m.what, "%s", what.c_str());
}

void send_msg(int fd, const Msg& m) {
  (void)write_all(fd, &m, sizeof m);
}

void send_stats(int fd, int rank, const RankStats& st) {
  const Msg m = stats_header(rank, st);
  std::vector<char> out(sizeof m);
  std::memcpy(out.data(), &m, sizeof m);
  out.insert(out.end(), st.idle.begin(), st.idle.end());
  const auto* w = reinterpret_cast<const char*>(st.wall_us.data());
  out.insert(out.end(), w, w + st.wall_us.size() * sizeof(float));
  for (const std::string& note : st.mismatch_notes) {
    char buf[kTextBytes] = {};
    std::snprintf(buf, sizeof buf, "%s", note.c_str());
    out.insert(out.end(), buf, buf + sizeof buf);
  }
  (void)write_all(fd, out.data(), out.size());
}

bool read_resume(int fd, Resume& resume) {
  char* p = reinterpret_cast<char*>(&resume);
  std::size_t n = sizeof resume;
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return resume.round > 0;
}

bool MsgStream::next(Msg& m, std::vector<char>& payload) {
  if (buffer_.size() < sizeof m) return false;
  std::memcpy(&m, buffer_.data(), sizeof m);
  const std::size_t used = m.kind == MsgKind::stats ? stats_bytes(m) : sizeof m;
  if (buffer_.size() < used) return false;
  payload.assign(buffer_.begin() + static_cast<std::ptrdiff_t>(sizeof m),
                 buffer_.begin() + static_cast<std::ptrdiff_t>(used));
  buffer_.erase(buffer_.begin(), buffer_.begin() + static_cast<std::ptrdiff_t>(used));
  return true;
}

void merge_stats(RankStats& into, const Msg& m, const char* payload) {
  into.forwards += m.counts[0];
  into.tokens += m.counts[1];
  into.zero += m.counts[2];
  into.checked += m.counts[3];
  into.mismatched_rounds += m.counts[4];
  into.mismatches += m.counts[5];
  into.aborted += m.counts[6];
  if (m.max_us > into.max_us) {
    into.max_us = m.max_us;
    into.max_round = m.max_round;
  }
  for (std::int64_t i = 0; i < m.idle_n && static_cast<std::size_t>(i) < into.idle.size(); ++i)
    into.idle[static_cast<std::size_t>(i)] |= static_cast<std::uint8_t>(payload[i]);
  payload += m.idle_n;
  if (m.wall_n > 0) {
    const std::size_t at = into.wall_us.size();
    into.wall_us.resize(at + static_cast<std::size_t>(m.wall_n));
    std::memcpy(into.wall_us.data() + at, payload,
                static_cast<std::size_t>(m.wall_n) * sizeof(float));
  }
  payload += m.wall_n * static_cast<std::int64_t>(sizeof(float));
  for (int i = 0; i < m.notes; ++i, payload += kTextBytes)
    into.mismatch_notes.emplace_back(payload, strnlen(payload, kTextBytes));
}

}  // namespace epmoe::tools::stress
