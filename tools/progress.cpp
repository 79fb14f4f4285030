#include "progress.hpp"

#include <unistd.h>

#include <cstdio>

namespace epmoe::tools {

using Clock = std::chrono::steady_clock;

Progress::Progress(std::string what, std::int64_t total)
    : what_(std::move(what)),
      total_(total),
      tty_(isatty(fileno(stderr)) != 0),
      start_(Clock::now()),
      last_print_(Clock::now()) {}

Progress::~Progress() {
  if (!finished_) finish();
}

void Progress::update(std::int64_t done, const std::string& detail) {
  const auto now = Clock::now();
  const auto interval = tty_ ? std::chrono::milliseconds(200) : std::chrono::milliseconds(5000);
  if (now - last_print_ < interval) return;
  last_print_ = now;
  print(done, detail, false);
}

void Progress::finish(const std::string& detail) {
  finished_ = true;
  // Only worth a line if it took long enough for the user to notice.
  if (Clock::now() - start_ > std::chrono::seconds(1) || tty_) print(total_, detail, true);
}

void Progress::print(std::int64_t done, const std::string& detail, bool last) {
  const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
  std::fprintf(stderr, "%s[%s] %lld/%lld  %.1f s%s%s%s", tty_ ? "\r\033[K" : "", what_.c_str(),
               static_cast<long long>(done), static_cast<long long>(total_), seconds,
               detail.empty() ? "" : "  ", detail.c_str(), (last || !tty_) ? "\n" : "");
  std::fflush(stderr);
}

}  // namespace epmoe::tools
