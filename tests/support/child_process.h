// A test binary running one of its own hidden test cases as a child process (a trainer the test
// can SIGKILL or SIGSTOP), its stdout on a pipe. Used by the process tests of the same-host
// transport, on the CPU and on a GPU.
//
//   auto child = spawn_self("[.same_host_trainer]", {"SS_SH_PATH=/run/x.sock"});
//   wait_for_output(*child, "mid\n");   // fails the test at the deadline, or if the child exits
//   ::kill(child->pid, SIGKILL);
//   child->reap();
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace shadowsync::testing {

struct ChildProcess {
  pid_t pid = -1;
  int out = -1;        // the read end of its stdout
  std::string output;  // what it printed so far (Catch's report of a failure in it lands here)

  ChildProcess() = default;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  // SIGKILLs and reaps a child still running: no test leaves one behind.
  ~ChildProcess();

  // Waits for it to exit (SIGKILL after `timeout`), collecting its output; returns its status.
  int reap(std::chrono::seconds timeout = std::chrono::seconds(60));
  // Appends what it has written so far, without blocking.
  void drain_available();
};

// Runs /proc/self/exe with the Catch test spec `test_spec`, `environment` ("NAME=value") added to
// this process's. Fails the test (REQUIRE) when it cannot start.
std::unique_ptr<ChildProcess> spawn_self(const std::string& test_spec,
                                         const std::vector<std::string>& environment);

// Waits until the child has printed `text`; fails the test at the deadline or if it exited first.
void wait_for_output(ChildProcess& child, std::string_view text,
                     std::chrono::seconds timeout = std::chrono::seconds(60));

// Reaps the child and checks it exited with status 0, showing its output otherwise.
void require_exited_zero(ChildProcess& child);

}  // namespace shadowsync::testing
