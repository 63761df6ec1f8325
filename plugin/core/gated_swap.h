// Internal to the step hook: the gated remap swap (ReceiverConfig::gated_swaps). Not installed.
//
// A remap may change the live range's pages only while no kernel reads them. Synchronizing the
// engine stream at the step boundary does that, but holds the engine thread until the step in
// flight ends: the host work of the next step (launching it, sampling, handing the previous
// step's tokens back) then waits for the remap too. Gated, the step hook closes a gate on the
// engine stream where it would swap and returns; the engine enqueues its step behind the gate and
// calls StepHook::after_launch, which waits for the work before the gate, remaps, and opens it.
// The GPU stands still for the remap only; the engine thread's host work overlaps the step before.
//
//   hook.before_step(stream);   // pending: closes the gate, swaps nothing yet
//   launch(stream);             // waits at the gate
//   hook.after_launch(stream);  // the work before is done: remap, open
//
// The danger is an engine thread that waits for its own stream between the two calls (a .cpu(),
// a synchronize): it would wait for a gate only it can open. The watchdog thread here opens the
// gate when the engine has not claimed the swap `deadline` after the work before the gate
// completed, and marks the swap abandoned: the gated step runs on the old weights, the update
// stays pending and is made live synchronously at the next before_step, and gated swaps stay off
// for this hook from then on (an engine that blocked once will again). open() touches only host
// memory, so the watchdog can open the gate whatever the engine thread is blocked in.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>

#include "shadowsync/backend.h"

namespace shadowsync {

class GatedSwap {
 public:
  GatedSwap(std::unique_ptr<StreamGate> gate, std::chrono::milliseconds deadline);
  // Opens the gate (a stream must not wait forever) and stops the watchdog.
  ~GatedSwap();
  GatedSwap(const GatedSwap&) = delete;
  GatedSwap& operator=(const GatedSwap&) = delete;

  // False once the watchdog had to open a gate: the hook swaps synchronously from then on.
  // Thread-safe.
  bool enabled() const { return enabled_.load(std::memory_order_acquire); }

  // Engine thread. Closes the gate on `engine_stream`; the watchdog starts watching it. Throws
  // Error(kBackend) if the backend's gate fails (the gate is open again then).
  void close(Stream& engine_stream);
  // Engine thread, after close(). Waits until the work before the gate has completed; true: the
  // swap is the engine's to make, and open() must follow; false: the watchdog opened the gate
  // first (abandoned: the work behind it has started on the old live bytes).
  bool claim();
  // Engine thread, after a claim() that returned true.
  void open();

  // Thread-safe counters: gates closed, gates the watchdog had to open.
  std::uint64_t gates() const { return gates_.load(std::memory_order_acquire); }
  std::uint64_t abandoned() const { return abandoned_.load(std::memory_order_acquire); }
  std::chrono::milliseconds deadline() const { return deadline_; }

 private:
  enum class State { kOpen, kClosed, kClaimed, kAbandoned };
  void watch();

  const std::unique_ptr<StreamGate> gate_;
  const std::chrono::milliseconds deadline_;
  std::atomic<bool> enabled_{true};
  std::atomic<std::uint64_t> gates_{0};
  std::atomic<std::uint64_t> abandoned_{0};
  std::mutex mutex_;
  std::condition_variable changed_;
  State state_ = State::kOpen;   // under mutex_
  std::uint64_t generation_ = 0;  // under mutex_: the gate the watchdog watches
  bool stopping_ = false;         // under mutex_
  std::thread watchdog_;
};

}  // namespace shadowsync
