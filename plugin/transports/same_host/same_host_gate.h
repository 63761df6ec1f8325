// Internal to the same-host transport: the host-side gate a device-flavour receiver waits on
// before it enqueues a chunk's copy. Not installed; no CUDA (unit-tested on the CPU).
//
// Why the receiver waits on the host. A receiver must never leave GPU work waiting for something
// only the peer process can provide. Work parked on a stream until the sender rings (as a
// cuStreamWaitValue32 on a counter would be) is work the whole CUDA context may end up waiting
// for: lazy loading of a kernel's module, cudaFree in a caching allocator, a
// cudaDeviceSynchronize / torch.cuda.synchronize() - each waits for every stream of the context,
// so the engine's own step would block on the host until the trainer rings. A trainer that paces
// itself on the engine's steps then never rings: a deadlock across the two processes. So the
// receiver's own thread waits here, and only a chunk whose doorbell arrived and passed its checks
// has its copy enqueued; the stream then only ever holds work that can run now.
//
// The progress thread opens the gate chunk by chunk; release() ends every wait, present and
// future (an abort, a protocol violation, a peer that closed its socket: the transport records why
// before it releases).
//
// Latency. A chunk's copy can start only once this thread enqueued it, so the time from open()
// to the return of wait() is time the copy engine may sit idle. wait() therefore first spins on
// the host for up to `spin` (a few hundred microseconds: a doorbell usually comes while the
// previous chunk still copies) before it sleeps on the condition variable, whose wake-up costs
// tens of microseconds.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace shadowsync::same_host {

class ChunkGate {
 public:
  using Clock = std::chrono::steady_clock;
  enum class Outcome {
    kOpen,      // the chunk's doorbell arrived and passed its checks: copy it
    kReleased,  // release() was called, before or during the wait: enqueue nothing
    kDeadline,  // neither happened by the deadline: enqueue nothing
  };

  // Progress thread: every chunk below `chunks` may be copied. Never moves back. Any thread.
  void open(std::uint64_t chunks);
  // Ends every wait at once, and every later one. Any thread; idempotent; never blocks long.
  void release() noexcept;
  bool released() const;

  // The receiver's thread: blocks until chunk `chunk` is open, the gate is released, or
  // `deadline` passes, whichever comes first; released wins over open, so that nothing is
  // enqueued once the transport died. Spins for at most `spin` (never past `deadline`) before
  // it sleeps.
  Outcome wait(std::uint64_t chunk, Clock::time_point deadline,
               std::chrono::microseconds spin = std::chrono::microseconds(0));

 private:
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  // Written under mutex_; atomic so that the spinning phase of wait() may read them without it.
  std::atomic<std::uint64_t> open_{0};  // chunks below this are open
  std::atomic<bool> released_{false};
};

}  // namespace shadowsync::same_host
