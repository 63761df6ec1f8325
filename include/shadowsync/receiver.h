// The receiver: owns both slots of every group, a background thread on its own low-priority
// stream that receives updates into the shadow slots, and the engine's step hook.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shadowsync/backend.h"
#include "shadowsync/layout.h"
#include "shadowsync/step_hook.h"
#include "shadowsync/transport.h"
#include "shadowsync/update_header.h"

namespace shadowsync {

struct ReceiverConfig {
  int root_rank = 0;  // the sender's rank in the transport
  // A whole update must land within this (a 14 GiB update takes ~40 ms at NVLink speed; a
  // minute leaves room for a sender that gathers ZeRO-3 shards between buckets).
  std::chrono::milliseconds update_deadline{60'000};
  // No bucket may take longer than this from the previous bucket's completion.
  std::chrono::milliseconds bucket_deadline{10'000};
  // How often the receiver thread checks progress, errors and aborts while a receive is in
  // flight. 200 us keeps the reaction to a fault well under a millisecond at negligible CPU.
  std::chrono::microseconds poll_interval{200};
};

enum class UpdateOutcome {
  kReady,       // received completely and offered to the engine
  kFailed,      // discarded; the live weights are untouched
  kSuperseded,  // a newer update took it back before the engine applied it
};

// One line per update, delivered on the receiver thread.
struct UpdateReport {
  std::uint64_t version = 0;
  UpdateOutcome outcome = UpdateOutcome::kReady;
  std::vector<std::size_t> groups;      // groups the update carried
  std::size_t bytes = 0;                // bytes received
  std::chrono::nanoseconds transfer{0}; // first receive posted -> completion observed
  std::string error;                    // kFailed: why
};

struct ReceiverStats {
  std::uint64_t updates_ready = 0;
  std::uint64_t updates_failed = 0;
  std::uint64_t updates_superseded = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t last_accepted_version = 0;
  bool needs_transport = false;  // a failure aborted the transport; call replace_transport
  std::string last_error;
};

class Receiver {
 public:
  // Allocates two zero-filled slots per group and starts the receiver thread. The engine reads
  // the live slots through step_hook(). `transport` may be null until the rendezvous is done.
  Receiver(Layout layout, Backend& backend, std::unique_ptr<Transport> transport,
           ReceiverConfig config = {});
  ~Receiver();  // shutdown()
  Receiver(const Receiver&) = delete;
  Receiver& operator=(const Receiver&) = delete;

  // Announces an update: validates the header against the layout and the last accepted version
  // (throws Error naming the field and both values; nothing changes), then queues it and returns.
  // The receives are posted only now, when the sender is known to be sending. Thread-safe.
  void begin_update(const UpdateHeader& header);

  // Aborts the update in flight, if any (the transport is aborted with it). Thread-safe.
  void abort_update();

  // Installs a new transport after a failure aborted the old one (or the first one). Queued
  // behind earlier commands. Thread-safe.
  void replace_transport(std::unique_ptr<Transport> transport);

  // Called on the receiver thread once per update outcome. Set before the first update.
  void set_observer(std::function<void(const UpdateReport&)> observer);

  StepHook& step_hook() { return *hook_; }
  const Layout& layout() const { return layout_; }
  ReceiverStats stats() const;  // Thread-safe.

  // Blocks until every queued command has been processed (tests, orderly shutdown).
  void drain();

  // Stops the thread; aborts an update in flight. Idempotent. Thread-safe.
  void shutdown();

 private:
  struct Impl;
  Layout layout_;
  std::unique_ptr<SlotTable> slots_;
  std::unique_ptr<StepHook> hook_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shadowsync
