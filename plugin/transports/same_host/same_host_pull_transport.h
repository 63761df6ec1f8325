// SameHostPullTransport: routes of a sharded trainer (DESIGN §14) between processes of one host.
// Each of the M trainer ranks exports its own staging; each of the N engine ranks pulls every
// route into it straight from there, in one pass through its memory (no bucket assembled first,
// no byte through a rank that does not need it). Internal, not installed: its interface is the
// RoutingPlan and the RouteMover, which are internal too; the C ABI reaches it through a routing
// plan handle (shadowsync_same_host_pull_serve / _connect in shadowsync.h).
//
// Connection. Trainer rank t listens on a Unix socket at its own path (directory rules, stale
// socket files and the token's HMAC proofs as SameHostTransport: same_host_transport.h) and
// admits the N engine processes, each proving the token for rank e + 1, side by side. Each then
// says hello {trainer count, engine count, its engine rank, routing fingerprint}; the trainer
// refuses, naming both sides' values, a hello of another world size or plan, and an engine rank
// already taken, and otherwise shares its two staging slots of the plan's max_packed_bytes(t)
// (one sealed memory file, SCM_RIGHTS) with its own rank, counts and fingerprint. An engine rank
// connects to the M paths in trainer rank order within one connect_timeout, and checks that the
// path at index t is served by trainer rank t.
//
// Data. The b-th send_routes_async on a trainer rank's transport (counted over its updates, as
// the Sender counts its sends) travels in that rank's slot b % 2. The
// trainer's stream task rings a route doorbell {version, sequence, slot, bytes} on every engine
// process's socket, 0 bytes included (so that a dead trainer rank fails the update everywhere),
// and waits for every engine's ack before it ends: the slot is packed again only once every
// engine read it. An engine's stream task waits (one poll() over the M sockets and the abort
// eventfd) until every trainer rank's doorbell of the bucket came, checks each (version,
// sequence, and bytes == the plan's packed_range; else nothing of the bucket is copied and
// async_error() names the trainer rank, the bucket and both values), runs the bucket's
// RouteCopies from the mapped slots (memcpy row by row), then acks every trainer rank.
//
// Flavours. Host memory (SameHostMemory::kHost, HostBackend streams): the slots are a sealed
// memory file; the calls enqueue stream tasks that block in poll() as the same-host broadcast's
// do. Device memory (SameHostMemory::kDevice, CudaBackend streams): the slots are an exportable
// cuMem allocation on the trainer rank's GPU, mapped by each engine rank for its own GPU (the
// same GPU, or a peer GPU of the host); the calls are host-gated as same_host_device.h says, so
// that no stream ever waits on another process. A trainer rank's send_routes_async copies the
// bytes into the slot (unless packed there), waits on its thread until its stream passed them,
// rings, then reads every engine's ack of the previous bucket (whose slot the caller packs next)
// before it returns; flush() reads the last bucket's. An engine rank's receive_routes_async
// waits on its thread for every doorbell of the bucket, enqueues the copies (cudaMemcpy2DAsync,
// from the mapped slots straight into the targets), waits until they landed, acks, returns. Every
// wait for a peer is bounded by SameHostConfig::doorbell_timeout (the transport fails, naming
// the peer, the bucket and the option). Engines connect to whichever flavour the trainer ranks
// serve; every trainer rank must serve the same.
//
// Failures: a peer that closes its socket (its process died) or breaks the protocol sets
// async_error() and every later call completes at once; abort() wakes every waiting task, shuts
// the sockets down (the peers see EOF) and makes the transport dead. The host flavour never
// times out by itself: callers poll async_error() against their deadlines and call abort(); the
// device flavour's waits are bounded (above). A restarted
// trainer serves the same path again; engines connect anew (a new transport).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/route_mover.h"
#include "core/routing_plan.h"
#include "shadowsync/backend.h"
#include "shadowsync/same_host_transport.h"
#include "shadowsync/transport.h"

namespace shadowsync {

class SameHostPullTransport final : public Transport, public RouteMover {
 public:
  // Trainer rank `trainer_rank` of `plan`: checks (or creates, mode 0700) the socket's
  // directory, listens on `path`, and blocks until `engine_processes` engine processes (R x the
  // plan's engine count N: one per engine rank of each of R data-parallel replicas) proved
  // `token` and said a matching hello; a refused or stalled one is dropped and the wait goes on.
  // Replicas cost the trainer rank one doorbell and one ack each per bucket, no bytes: it packs
  // each bucket once into its staging and every replica's process pulls it from there. Throws
  // Error(kTimeout) after config.connect_timeout naming the engine ranks missing and each peer
  // refused (with the reason and both values) or stalled. Bad arguments and paths:
  // Error(kInvalidArgument), as is SameHostMemory::kDevice with a backend other than a
  // CudaBackend or in a build without CUDA. `backend` outlives the transport. Blocks the calling
  // thread.
  static std::unique_ptr<SameHostPullTransport> serve(const std::string& path,
                                                      std::string_view token,
                                                      std::shared_ptr<const RoutingPlan> plan,
                                                      int trainer_rank, int engine_processes,
                                                      Backend& backend, SameHostMemory memory,
                                                      SameHostConfig config = {});

  // Engine rank `engine_rank` of `plan`, in data-parallel replica `replica` (0 without
  // replicas): connects to `trainer_paths` (one per trainer rank, in rank order) within
  // config.connect_timeout in all (Error(kTimeout): "trainer rank 2 (<path>) never served within
  // 60000 ms"), proves `token`, says hello, and maps each trainer's staging. A trainer's refusal
  // (Error(kTransport) for a wrong token; kInvalidArgument for another world size, an engine rank
  // and replica taken, or a replica the trainer does not serve; kLayoutMismatch for another plan;
  // each naming both values) and
  // a path served by another trainer rank (kInvalidArgument) end it. Blocks the calling thread.
  static std::unique_ptr<SameHostPullTransport> connect_engine_rank(
      const std::vector<std::string>& trainer_paths, std::string_view token,
      std::shared_ptr<const RoutingPlan> plan, int engine_rank, Backend& backend,
      SameHostConfig config = {}, int replica = 0);

  ~SameHostPullTransport() override;
  SameHostPullTransport(const SameHostPullTransport&) = delete;
  SameHostPullTransport& operator=(const SameHostPullTransport&) = delete;

  // Transport. Ranks: trainers 0..M-1, then engines M..M+N-1 (as one communicator would number
  // them). broadcast_async is refused (Error(kInvalidArgument)): this transport moves routes
  // only, through route_mover().
  std::string_view name() const override { return "same_host_pull"; }
  int rank() const override;
  int world_size() const override;
  void broadcast_async(void* buffer, std::size_t bytes, int root, Stream& stream) override;
  // Trainer rank: staging slot `index` (0 or 1) when `bytes` fits in it, else nullptr; an engine
  // rank has none. The b-th send on this transport is doorbelled from slot b % 2: pack it there
  // (or pass other memory to send_routes_async, which copies it in). Thread-safe.
  void* staging_buffer(int index, std::size_t bytes) override;
  RouteMover* route_mover() override { return this; }
  // Device flavour, trainer rank: blocks until every engine rank acked the last bucket sent (or
  // the transport failed: async_error()). Otherwise nothing to do.
  void flush() override;
  std::optional<std::string> async_error() override;
  std::optional<std::string> waiting_for() override;
  void abort() noexcept override;

  // RouteMover (route_mover.h). Streams come from the flavour's backend (see above).
  const RoutingPlan& routing_plan() const override;
  int trainer_rank() const override;
  int engine_rank() const override;
  // Packed memory other than the slot the bucket goes in is copied into it by the stream task.
  void send_routes_async(const RoutedBucket& bucket, const void* packed, std::size_t bytes,
                         Stream& stream) override;
  // Copies are checked against the plan's packed_range of their trainer rank before anything is
  // enqueued (Error(kInvalidArgument) naming the copy and the range); `copies` is copied.
  void receive_routes_async(const RoutedBucket& bucket, std::span<const RouteCopy> copies,
                            const RouteTargets& targets, Stream& stream) override;
  std::uint64_t routed_bytes() const override;
  // Device flavour, trainer rank: shares the allocations `segments` lie in over CUDA IPC (once
  // each) and sends the table with the next doorbell when it changed; false, and the caller
  // packs, when the flavour is host memory or CUDA IPC cannot share one of them (memory of
  // cuMemCreate, such as PyTorch's expandable segments, or of a cudaMallocAsync pool).
  bool offer_in_place(std::span<const InPlaceSegment> segments, std::string& why_not) override;
  std::uint64_t routed_in_place_bytes() const override;

  // Trainer rank: the bytes of each staging slot (at least the plan's max_packed_bytes).
  std::size_t slot_bytes() const;

  struct State;

 private:
  explicit SameHostPullTransport(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace shadowsync
