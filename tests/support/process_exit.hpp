// Waiting for a rank process of a test, bounded: a hung child is killed, never waited on forever.
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <chrono>
#include <thread>

namespace epmoe::test {

// Waits for `pid` until `deadline`: its exit code; -1 when it had to be killed (a hang); -2 when
// a signal ended it.
inline int wait_exit(pid_t pid, std::chrono::steady_clock::time_point deadline) {
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -2;
}

}  // namespace epmoe::test
