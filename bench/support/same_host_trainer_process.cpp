// The engine's handle on the trainer process (see same_host_trainer_process.h).
#include "same_host_trainer_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

extern char** environ;

namespace shadowsync::bench::same_host {

namespace {

std::atomic<pid_t> g_trainer_pid{-1};

int cloexec_above(int fd, int floor) {
  const int moved = ::fcntl(fd, F_DUPFD_CLOEXEC, floor);
  ::close(fd);
  if (moved < 0) throw BenchError(cat("fcntl(F_DUPFD_CLOEXEC): ", std::strerror(errno)));
  return moved;
}

}  // namespace

pid_t running_trainer_pid() { return g_trainer_pid.load(); }

TrainerProcess::TrainerProcess(const std::vector<std::string>& args) {
  int down[2];
  int up[2];
  if (::pipe2(down, O_CLOEXEC) != 0 || ::pipe2(up, O_CLOEXEC) != 0) {
    throw BenchError(cat("pipe2: ", std::strerror(errno)));
  }
  // Above 4, so that the dup2 onto 3 and 4 below never meets an fd already there.
  for (int* fd : {&down[0], &down[1], &up[0], &up[1]}) *fd = cloexec_above(*fd, 10);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, down[0], 3);
  posix_spawn_file_actions_adddup2(&actions, up[1], 4);
  std::vector<std::string> argv_strings = {
      "/proc/self/exe", "--role", "trainer", "--command-fd", "3", "--reply-fd", "4"};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  const int status =
      ::posix_spawn(&pid_, "/proc/self/exe", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(down[0]);
  ::close(up[1]);
  to_ = down[1];
  from_ = up[0];
  if (status != 0) {
    pid_ = -1;
    throw BenchError(cat("posix_spawn of the trainer: ", std::strerror(status)));
  }
  g_trainer_pid.store(pid_);
  reader_ = std::make_unique<LineReader>(from_);
  try {
    read_reply("start", std::chrono::seconds(60));
  } catch (...) {  // no destructor runs for a constructor that throws
    kill();
    ::close(to_);
    ::close(from_);
    throw;
  }
}

TrainerProcess::~TrainerProcess() {
  if (pid_ > 0) {
    try {
      call("quit", std::chrono::seconds(10));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_same_host_one_gpu: the trainer did not quit: %s\n", e.what());
    }
  }
  kill();
  ::close(to_);
  ::close(from_);
}

void TrainerProcess::send(const std::string& command) { write_line(to_, command); }

Reply TrainerProcess::read_reply(const std::string& command, std::chrono::milliseconds timeout) {
  const std::optional<std::string> line =
      reader_->next(timeout, cat("the trainer's reply to '", command, "'"));
  if (!line) {
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    g_trainer_pid.store(-1);
    throw BenchError(cat("the trainer process ended during '", command, "' (",
                         WIFEXITED(status) ? cat("exit status ", WEXITSTATUS(status))
                                           : cat("signal ", WTERMSIG(status)),
                         ")"));
  }
  return parse_reply(command, *line);
}

Reply TrainerProcess::call(const std::string& command, std::chrono::milliseconds timeout) {
  send(command);
  return read_reply(command, timeout);
}

void TrainerProcess::kill() noexcept {
  if (pid_ <= 0) return;
  // Given a moment to quit by itself, then killed: it may be stuck in the driver.
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (::waitpid(pid_, nullptr, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  pid_ = -1;
  g_trainer_pid.store(-1);
}

}  // namespace shadowsync::bench::same_host
