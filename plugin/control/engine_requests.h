// What an engine does with its trainer's requests, on a worker thread of its own: a rendezvous
// installs a new transport from the factory, an update header goes to Receiver::begin_update, an
// abort to Receiver::abort_update, and a trainer that left has its transport released
// (Receiver::release_transport). One worker runs them in arrival order, because the transport
// factory may block for minutes (NCCL init waits for every rank) and a header must not overtake
// the rendezvous before it; the I/O thread never calls into the receiver.
//
// The factory itself runs on a thread of its own, which the worker waits for: when the trainer
// that asked leaves first, the worker gives the rendezvous up and serves the next trainer at once
// (a factory waiting for a departed trainer's end may block for a minute). The factory is left to
// return on its own; what it returns then is destroyed, never installed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "control/control_frame.h"
#include "shadowsync/control_channel.h"
#include "shadowsync/receiver.h"
#include "shadowsync/update_header.h"

namespace shadowsync::control {

// The engine channel's counters, which both of its threads update. Thread-safe.
class EngineCounters {
 public:
  template <typename F>
  void update(F&& change) {
    std::lock_guard lock(mutex_);
    change(stats_);
  }
  EngineChannelStats snapshot() const {
    std::lock_guard lock(mutex_);
    return stats_;
  }

 private:
  mutable std::mutex mutex_;
  EngineChannelStats stats_;
};

// Not a frame: the I/O thread's news that trainer connection `generation` is gone. It runs
// although its trainer is no longer the current one (that is the point), in order: after the
// departed trainer's own requests, before a newer trainer's rendezvous.
struct TrainerLeft {
  std::string why;
};

using EngineRequest = std::variant<RendezvousMessage, UpdateHeader, AbortMessage, TrainerLeft>;

class EngineRequests {
 public:
  // Sends `answer` to trainer connection `generation` (if it is still the trainer). Called on the
  // worker thread; must not block.
  using Reply = std::function<void(std::uint64_t generation, ControlMessage answer)>;

  // Everything passed by reference must outlive this. `current` is the generation of the
  // connected trainer (0: none): a request whose trainer is gone by its turn is dropped, except
  // TrainerLeft.
  // Starts the worker thread.
  EngineRequests(Receiver& receiver, const TransportFactory& factory, const ControlConfig& config,
                 const std::atomic<std::uint64_t>& current, EngineCounters& counters, Reply reply);
  ~EngineRequests();  // close(), join()
  EngineRequests(const EngineRequests&) = delete;
  EngineRequests& operator=(const EngineRequests&) = delete;

  // Queues a request of trainer connection `generation`. Never blocks on a running request.
  // Thread-safe (the I/O thread).
  void push(std::uint64_t generation, EngineRequest request);

  // No request starts from now on; those queued are dropped. Never blocks. Thread-safe.
  void close();
  // After close(): waits for the request running, if any (a transport factory may take long).
  // Idempotent. Not from the worker thread.
  void join();

 private:
  struct Work {
    std::uint64_t generation = 0;
    EngineRequest request;
  };

  // One run of the transport factory on its own thread. Fields: mutex_.
  struct FactoryRun {
    bool done = false;
    bool abandoned = false;  // its trainer left first: the result is dropped by the run's thread
    std::unique_ptr<Transport> transport;
    std::exception_ptr error;
  };
  struct FactoryThread {
    std::shared_ptr<FactoryRun> run;
    std::thread thread;
  };

  void worker_loop();
  void run(Work& item);
  // The factory's transport for trainer connection `generation`; null when that trainer left (or
  // close() came) first. Rethrows what the factory threw.
  std::unique_ptr<Transport> run_factory(std::uint64_t generation,
                                         const RendezvousRequest& request);
  void join_finished_factories();  // worker thread

  Receiver& receiver_;
  const TransportFactory& factory_;
  const ControlConfig& config_;
  const std::atomic<std::uint64_t>& current_;
  EngineCounters& counters_;
  Reply reply_;

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Work> queue_;                // mutex_
  bool closed_ = false;                   // mutex_
  std::vector<FactoryThread> factories_;  // worker thread; join() once the worker is joined
  std::thread worker_;
};

}  // namespace shadowsync::control
