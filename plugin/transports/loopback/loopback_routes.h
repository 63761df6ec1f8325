// Loopback routes: the M trainer ranks and N engine ranks of a routing plan (DESIGN §14) as
// threads of one process, moving routes on HostBackend streams with the same-host transport's
// pull semantics: a trainer rank's stream posts where its packing of a bucket lies and stays in
// the call until every engine rank acknowledged it; an engine rank's stream waits for every
// trainer rank's post of the bucket, checks it, copies its routes straight out of each packing
// (RouteCopy rows, plain memcpy) and acknowledges. Faults can be injected per rank and per call.
// With read_in_place(true), trainer ranks accept RouteMover::offer_in_place (their shards are
// host memory of this same process): they post nothing but "in place", and engine ranks resolve
// their copies against the rank's shard table (in_place_copies.h), as the same-host pull
// transport does on GPUs.
//
// Internal (tests, the C testing entry): RoutingPlan is not installed. The transports broadcast
// nothing; Transport::route_mover() is what they offer.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "core/routing_plan.h"
#include "shadowsync/transport.h"

namespace shadowsync {

// One communicator of M + N ranks for one routing plan. Transport ranks: trainer rank t is t,
// engine rank e is M + e (world size M + N), as an NCCL communicator of the plan would number
// them. After an abort the communicator is dead; make a new one for the next rendezvous.
class LoopbackRouteCommunicator {
 public:
  explicit LoopbackRouteCommunicator(std::shared_ptr<const RoutingPlan> plan);
  ~LoopbackRouteCommunicator();

  // The transport of trainer rank `trainer` (0..M-1) or engine rank `engine` (0..N-1); each
  // once. Its streams must come from a HostBackend. Throws Error(kInvalidArgument) naming the rank
  // and the range, or a rank already taken. Thread-safe.
  std::unique_ptr<Transport> trainer_transport(int trainer);
  std::unique_ptr<Transport> engine_transport(int engine);

  // Fault injection; `call` counts the route calls of that rank from 0 (one per bucket of every
  // update: the n-th call of every rank is the same bucket). Thread-safe.
  // From call `call` on, trainer rank `trainer` never posts (its process died); the engine ranks
  // wait until the communicator is aborted (the dropped rank's own Sender does, once its stream
  // reports the drop: an error of its own).
  void inject_drop(int trainer, std::uint64_t call);
  // Before taking part in call `call`, engine rank `engine` waits `delay` (a slow reader),
  // cut short by an abort.
  void inject_delay(int engine, std::uint64_t call, std::chrono::microseconds delay);

  // Whether trainer ranks' offer_in_place is accepted (default: no, every bucket is posted
  // packed). Before the first update. Thread-safe.
  void read_in_place(bool on);

  // Buckets every rank finished. Thread-safe.
  std::uint64_t buckets_completed() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace shadowsync
