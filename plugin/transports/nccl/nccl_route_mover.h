// NcclRouteMover: the RouteMover of NcclTransport (DESIGN §14): a sharded trainer's routes as
// grouped point-to-point ops on the communicator of M trainer ranks and N engine ranks, one
// group per bucket per rank, as p2p_schedule() lists them. Private to plugin/transports/nccl/.
//
// Per bucket, on the caller's stream:
//   trainer rank: group_begin, one send per route of the bucket from its packing, group_end;
//   engine rank:  group_begin, one receive per route into its landing buffer (landing_layout),
//                 group_end; with engine replicas (p2p_schedule.h), replica r > 0 receives the
//                 whole landing buffer from replica r - 1 instead, and every replica but the
//                 last then forwards it to the next in a second group; then the bucket's
//                 RouteCopy list as memcpy_2d_async from the landing buffer into the slot or
//                 staging memory.
// A rank with no route in a bucket still opens and closes its (empty) group: every rank makes
// one call per bucket, so the calls of all ranks stay paired by order.
//
// Receives are posted only inside receive_routes_async, which the receiver thread calls after
// begin_update (DESIGN §6: a posted NCCL receive spins on its SMs until the sender arrives).
//
// NCCL carries bytes only, no doorbell: the update's version comes with its header through the
// control plane, and NCCL pairs sends with receives by their order. So this class checks what it
// can locally (a trainer's byte count against the plan, the buckets of an update called in
// sequence from 0) and a rank that dies or sends another bucket shows as a receive that never
// completes: the caller's deadline on its stream, then Transport::abort() (ncclCommAbort), ends
// it, as for broadcasts. Deadlines on enqueueing (ncclInProgress) are the communicator's
// (NcclTransportConfig::enqueue_timeout).
//
// Written without NCCL or CUDA headers against P2pCommunicator, so that test_nccl_routes runs it
// on a machine without a GPU with a communicator that records the calls.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/p2p_schedule.h"
#include "core/route_mover.h"
#include "shadowsync/backend.h"
#include "shadowsync/layout.h"

namespace shadowsync::nccl_detail {

// What the mover needs of its communicator: ncclGroupStart/End and ncclSend/ncclRecv of bytes,
// each returning once enqueued on `stream` (inside a group: once queued for group_end).
// NcclTransport implements it with its lock, enqueue deadline and abort. group_end must follow
// group_begin even when a call in between threw (NCCL's group state is per thread). Owner
// thread only.
class P2pCommunicator {
 public:
  virtual ~P2pCommunicator() = default;
  virtual void group_begin() = 0;
  virtual void group_end() = 0;
  virtual void send_async(const void* buffer, std::size_t bytes, int peer, Stream& stream) = 0;
  virtual void recv_async(void* buffer, std::size_t bytes, int peer, Stream& stream) = 0;
};

class NcclRouteMover final : public RouteMover {
 public:
  // Communicator rank `comm_rank` of M + R x N (trainer ranks first, then the engine ranks of
  // each of R = `replicas` replicas) on `comm`, for `plan` built on `wire`. An engine rank
  // allocates its landing buffer here, once, from `backend` (the largest bucket's routes into
  // it: max_landing_bytes); nothing is posted. Throws Error(kInvalidArgument) for a rank outside
  // 0..M+R*N-1 or replicas < 1, Error(kLayoutMismatch) naming both fingerprints for a wire
  // layout other than the plan's, and what Backend::allocate throws.
  // `comm` and `backend` must outlive the mover; the stream work it enqueued must be complete
  // (or the communicator aborted) before it is destroyed, since that frees the landing buffer.
  NcclRouteMover(P2pCommunicator& comm, std::shared_ptr<const RoutingPlan> plan, const Layout& wire,
                 int comm_rank, Backend& backend, int replicas = 1);
  ~NcclRouteMover() override;

  NcclRouteMover(const NcclRouteMover&) = delete;
  NcclRouteMover& operator=(const NcclRouteMover&) = delete;

  const RoutingPlan& routing_plan() const override { return *plan_; }
  int trainer_rank() const override { return comm_rank_ < trainers_ ? comm_rank_ : -1; }
  int engine_rank() const override { return engine_; }
  // The engine replica this rank belongs to (0..R-1); -1 for a trainer rank.
  int replica() const noexcept { return replica_; }

  // RouteMover's contract, and: refused with Error(kInvalidArgument), before anything is
  // enqueued, when called on the other role, for a bucket outside the wire layout, or out of
  // sequence (sequence 0 starts an update, each next call must be the next sequence of that
  // version: NCCL would pair this rank's ops with another bucket's). A failure of the
  // communicator after group_begin closes the group, then throws what it threw. One thread at
  // a time (the communicator's owner).
  void send_routes_async(const RoutedBucket& bucket, const void* packed, std::size_t bytes,
                         Stream& stream) override;
  void receive_routes_async(const RoutedBucket& bucket, std::span<const RouteCopy> copies,
                            const RouteTargets& targets, Stream& stream) override;

  // Bytes the copies of this engine rank read from its landing buffer, counted when enqueued.
  // Thread-safe.
  std::uint64_t routed_bytes() const override {
    return routed_bytes_.load(std::memory_order_relaxed);
  }

  // The landing buffer (engine rank; null when it receives nothing or is a trainer rank).
  const std::byte* landing() const noexcept { return landing_; }

 private:
  void check_call(const RoutedBucket& bucket, bool trainer_call);
  // Runs `ops` between group_begin and group_end; `base` is the packing (send) or landing
  // (recv) buffer.
  void run_group(const std::vector<P2pOp>& ops, std::byte* base, Stream& stream);

  P2pCommunicator& comm_;
  const std::shared_ptr<const RoutingPlan> plan_;
  Backend& backend_;
  const int comm_rank_;
  const int trainers_;
  int engine_ = -1;   // engine rank, or -1
  int replica_ = -1;  // its replica, or -1
  // [group][bucket]: this rank's ops (the receive group's, then the forward group's: engine
  // replicas), and (engine rank) its landing layout.
  std::vector<std::vector<std::vector<P2pOp>>> ops_;
  std::vector<std::vector<std::vector<P2pOp>>> forward_ops_;
  std::vector<std::vector<std::vector<LandingRoute>>> landing_layout_;
  std::byte* landing_ = nullptr;
  std::size_t landing_bytes_ = 0;
  std::vector<RouteCopy> scratch_;  // a bucket's copies from the landing buffer, reused
  // The update in flight: its version and the sequence the next call must have.
  std::uint64_t version_ = 0;
  std::uint64_t next_sequence_ = 0;
  bool in_update_ = false;
  std::atomic<std::uint64_t> routed_bytes_{0};
};

}  // namespace shadowsync::nccl_detail
