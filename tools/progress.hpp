// A progress line on stderr for anything that runs more than a few seconds: redrawn in place on a
// terminal, one line every few seconds otherwise (CI logs).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace epmoe::tools {

class Progress {
 public:
  Progress(std::string what, std::int64_t total);
  ~Progress();
  void update(std::int64_t done, const std::string& detail = "");
  void finish(const std::string& detail = "");

 private:
  void print(std::int64_t done, const std::string& detail, bool last);

  std::string what_;
  std::int64_t total_;
  bool tty_;
  bool finished_ = false;
  std::chrono::steady_clock::time_point start_, last_print_;
};

}  // namespace epmoe::tools
