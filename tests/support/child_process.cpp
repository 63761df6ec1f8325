#include "child_process.h"

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace shadowsync::testing {

using Clock = std::chrono::steady_clock;

ChildProcess::~ChildProcess() {
  if (pid > 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  if (out >= 0) ::close(out);
}

int ChildProcess::reap(std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    pollfd pfd{out, POLLIN, 0};
    (void)::poll(&pfd, 1, 50);  // its output, or a moment
    if (pfd.revents != 0) drain_available();
  }
  pid = -1;
  drain_available();
  return status;
}

void ChildProcess::drain_available() {
  for (;;) {
    pollfd pfd{out, POLLIN, 0};
    if (::poll(&pfd, 1, 0) <= 0 || (pfd.revents & (POLLIN | POLLHUP)) == 0) return;
    char buffer[4096];
    const ssize_t n = ::read(out, buffer, sizeof(buffer));
    if (n <= 0) return;
    output.append(buffer, static_cast<std::size_t>(n));
  }
}

std::unique_ptr<ChildProcess> spawn_self(const std::string& test_spec,
                                         const std::vector<std::string>& environment) {
  int pipe_fds[2];
  REQUIRE(::pipe2(pipe_fds, O_CLOEXEC) == 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  std::vector<std::string> env_strings = environment;
  std::vector<char*> env;
  for (auto& s : env_strings) env.push_back(s.data());
  for (char** e = environ; *e != nullptr; ++e) env.push_back(*e);
  env.push_back(nullptr);
  std::string self = "/proc/self/exe";
  std::string spec = test_spec;
  char* argv[] = {self.data(), spec.data(), nullptr};
  auto child = std::make_unique<ChildProcess>();
  const int spawned = posix_spawn(&child->pid, self.c_str(), &actions, nullptr, argv, env.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipe_fds[1]);
  child->out = pipe_fds[0];
  REQUIRE(spawned == 0);
  return child;
}

void wait_for_output(ChildProcess& child, std::string_view text, std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (child.output.find(text) == std::string::npos) {
    INFO("the child's stdout so far: " << child.output);
    REQUIRE(Clock::now() < deadline);
    int status = 0;
    REQUIRE(::waitpid(child.pid, &status, WNOHANG) == 0);  // it must not have exited
    pollfd pfd{child.out, POLLIN, 0};
    REQUIRE(::poll(&pfd, 1, 1000) >= 0);
    if (pfd.revents != 0) child.drain_available();
  }
}

void require_exited_zero(ChildProcess& child) {
  const int status = child.reap();
  INFO("the child's output:\n" << child.output);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

}  // namespace shadowsync::testing
