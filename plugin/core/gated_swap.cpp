#include "core/gated_swap.h"

#include <cstdio>
#include <exception>

namespace shadowsync {

GatedSwap::GatedSwap(std::unique_ptr<StreamGate> gate, std::chrono::milliseconds deadline)
    : gate_(std::move(gate)), deadline_(deadline), watchdog_([this] { watch(); }) {}

GatedSwap::~GatedSwap() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  watchdog_.join();
  gate_->open();
}

void GatedSwap::close(Stream& engine_stream) {
  try {
    gate_->close(engine_stream);
  } catch (...) {
    gate_->open();  // the wait may have been enqueued before what failed
    throw;
  }
  gates_.fetch_add(1, std::memory_order_release);
  {
    std::lock_guard lock(mutex_);
    state_ = State::kClosed;
    ++generation_;
  }
  changed_.notify_all();
}

bool GatedSwap::claim() {
  try {
    gate_->wait_work_before(std::chrono::nanoseconds::max());
  } catch (...) {
    open();
    throw;
  }
  bool claimed = false;
  {
    std::lock_guard lock(mutex_);
    claimed = state_ == State::kClosed;
    state_ = claimed ? State::kClaimed : State::kOpen;
  }
  changed_.notify_all();
  return claimed;
}

void GatedSwap::open() {
  gate_->open();
  {
    std::lock_guard lock(mutex_);
    state_ = State::kOpen;
  }
  changed_.notify_all();
}

void GatedSwap::watch() {
  std::unique_lock lock(mutex_);
  std::uint64_t watched = 0;
  for (;;) {
    changed_.wait(lock, [&] {
      return stopping_ || (state_ == State::kClosed && generation_ != watched);
    });
    if (stopping_) return;
    const std::uint64_t generation = generation_;
    watched = generation;
    const auto still_closed = [&] {
      return !stopping_ && state_ == State::kClosed && generation_ == generation;
    };
    // The engine's step before the gate may take long (a prefill): the deadline counts from its
    // end, when only the engine thread's host work stands between the gate and its opening.
    bool before_done = false;
    while (!before_done && still_closed()) {
      lock.unlock();
      try {
        before_done = gate_->wait_work_before(std::chrono::milliseconds(1));
      } catch (const std::exception&) {
        lock.lock();
        break;  // the engine thread's own wait reports the failure
      }
      lock.lock();
    }
    if (!before_done) continue;
    changed_.wait_for(lock, deadline_, [&] { return !still_closed(); });
    if (!still_closed()) continue;
    state_ = State::kAbandoned;
    // Counted before the gate opens: whoever sees the stream pass it sees the count.
    enabled_.store(false, std::memory_order_release);
    abandoned_.fetch_add(1, std::memory_order_release);
    gate_->open();
    std::fprintf(stderr,
                 "shadowsync: gated swap abandoned: the engine thread did not call after_launch "
                 "within %lld ms of the step before the gate ending (did it wait for its own "
                 "stream between before_step and after_launch?); the gate is open, the update "
                 "goes live at the next step's before_step, and this receiver swaps without a "
                 "gate from now on\n",
                 static_cast<long long>(deadline_.count()));
  }
}

}  // namespace shadowsync
