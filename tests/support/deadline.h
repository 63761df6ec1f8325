// Waiting on a condition in tests: never a bare sleep, always a deadline that fails loudly.
#pragma once

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

namespace shadowsync::testing {

inline constexpr std::chrono::seconds kTestDeadline{20};

// Polls `condition` until it holds; throws naming `what` if `timeout` passes first.
template <typename Condition>
void wait_until(Condition&& condition, const std::string& what,
                std::chrono::milliseconds timeout = kTestDeadline) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error("timed out after " + std::to_string(timeout.count()) +
                               " ms waiting for: " + what);
    }
    std::this_thread::yield();
  }
}

inline std::chrono::steady_clock::time_point deadline_from_now(
    std::chrono::milliseconds timeout = kTestDeadline) {
  return std::chrono::steady_clock::now() + timeout;
}

}  // namespace shadowsync::testing
