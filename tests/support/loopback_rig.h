// A sender and N receivers wired through one LoopbackCommunicator on one HostBackend: the
// standard test set-up. Publishes pattern tensors, announces each update to every receiver, and
// keeps the update history (failures included) for the oracle.
#pragma once

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "counting_backend.h"
#include "fake_engine.h"
#include "pattern.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"
#include "shadowsync/receiver.h"
#include "shadowsync/sender.h"

namespace shadowsync::testing {

struct RigOptions {
  HostBackendOptions backend;
  ReceiverConfig receiver;
  SenderConfig sender;
  int receivers = 1;
  // Build the sender and the receivers on a CountingBackend wrapping backend() (counting()), so
  // that a test can count what they ask of the backend (the copies a swap enqueues). The engine
  // keeps using backend() directly: its own calls are not counted.
  bool count_backend_calls = false;
  // Build them on a RemapHostBackend wrapping backend() instead (remap_host_backend.h; counting()
  // is then that backend): swap_strategy remap runs on the CPU.
  bool remap_on_host = false;
  // The engine's own remap arenas, by group (ReceiverConfig remap; one receiver).
  EngineArenas engine_arenas;
};

class LoopbackRig {
 public:
  explicit LoopbackRig(const Layout& layout, RigOptions options = {});
  ~LoopbackRig();

  HostBackend& backend() { return backend_; }
  // The wrapper the sender and receivers use; only with RigOptions::count_backend_calls or
  // remap_on_host.
  CountingBackend& counting() { return *counting_; }
  LoopbackCommunicator& communicator() { return *communicator_; }
  Sender& sender() { return *sender_; }
  Receiver& receiver(int i = 0) { return *receivers_[i]; }

  // Publishes pattern tensors of `groups` at `version` and begins the update on every receiver.
  PublishHandle publish(std::uint64_t version, const std::vector<std::string>& groups);
  // A fresh communicator for every rank (after a failure aborted the old one).
  void reconnect();
  // How many broadcasts one update of `groups` makes on every rank: its buckets, plus the
  // checksum block when the sender sends checksums (the default). Fault injection counts calls.
  std::uint64_t broadcasts_per_update(const std::vector<std::string>& groups) const;
  // Shuts down and destroys the receivers, then the sender, as the destructor does, but keeps the
  // backend: a test can then check what they left allocated. Engines must be gone first.
  void destroy_endpoints();

  // Waits until `version` is received and offered to the engine of `receiver` (the stats count an
  // update just before it is offered, so both conditions are needed). Throws at the deadline.
  void wait_offered(std::uint64_t version, int receiver = 0);

  UpdateHistory history() const;
  std::vector<UpdateReport> reports(int receiver = 0) const;

 private:
  struct Published {
    PublishHandle handle;
    std::unique_ptr<HostTensors> tensors;
  };
  const Layout& layout_;
  RigOptions options_;
  HostBackend backend_;
  std::unique_ptr<CountingBackend> counting_;  // count_backend_calls only
  std::unique_ptr<LoopbackCommunicator> communicator_;
  std::unique_ptr<Sender> sender_;
  std::vector<std::unique_ptr<Receiver>> receivers_;
  mutable std::mutex mutex_;
  UpdateHistory history_;
  std::vector<std::vector<UpdateReport>> reports_;
  std::deque<Published> in_flight_;  // tensors must outlive their publish
};

}  // namespace shadowsync::testing
