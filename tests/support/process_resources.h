// What a process holds that a leak would grow: its threads (/proc/self/task), open file
// descriptors (/proc/self/fd) and same-host memory files mapped (/proc/self/maps). Linux only, as
// the tests that use it.
#pragma once

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <string>

#include "deadline.h"

namespace shadowsync::testing {

struct ProcessResources {
  std::size_t threads = 0;
  std::size_t fds = 0;

  static ProcessResources now() {
    const auto count = [](const char* dir) {
      std::size_t n = 0;
      for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++n;
      return n;
    };
    ProcessResources r;
    r.threads = count("/proc/self/task");
    r.fds = count("/proc/self/fd");  // the iterator's own descriptor is counted every time alike
    return r;
  }
  std::string describe() const {
    return std::to_string(threads) + " threads, " + std::to_string(fds) + " fds";
  }
  bool operator==(const ProcessResources&) const = default;
};

// How many mappings of same-host staging memory files (memfds named shadowsync-same-host-...) this
// process holds: a transport that went away must leave none.
inline std::size_t same_host_memory_files() {
  std::ifstream maps("/proc/self/maps");
  std::size_t n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("shadowsync-same-host") != std::string::npos) ++n;
  }
  return n;
}

// Waits until the process is back at `baseline`; throws naming both counts at the deadline. A
// joined thread leaves /proc/self/task a moment after pthread_join returns (the kernel reaps it
// after waking the joiner), hence a wait and not a single look.
inline void wait_back_to(const ProcessResources& baseline, const std::string& after,
                         std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  ProcessResources last;
  try {
    wait_until([&] { return (last = ProcessResources::now()) == baseline; },
               "back to " + baseline.describe() + " after " + after, timeout);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string(e.what()) + "; still " + last.describe());
  }
}

}  // namespace shadowsync::testing
