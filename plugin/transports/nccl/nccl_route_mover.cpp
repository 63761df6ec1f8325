// NcclRouteMover: a routing plan's sends and receives, one NCCL group per bucket. See
// nccl_route_mover.h.
#include "transports/nccl/nccl_route_mover.h"

#include <fmt/format.h>

#include <exception>
#include <utility>

#include "shadowsync/error.h"

namespace shadowsync::nccl_detail {

NcclRouteMover::NcclRouteMover(P2pCommunicator& comm, std::shared_ptr<const RoutingPlan> plan,
                               const Layout& wire, int comm_rank, Backend& backend,
                               int replicas)
    : comm_(comm),
      plan_(std::move(plan)),
      backend_(backend),
      comm_rank_(comm_rank),
      trainers_(plan_->trainer_count()) {
  if (wire.fingerprint() != plan_->wire_fingerprint()) {
    throw Error(ErrorCode::kLayoutMismatch,
                fmt::format("NCCL routes: wire layout {:#018x} is not the one the routing plan was "
                            "built on ({:#018x})",
                            wire.fingerprint(), plan_->wire_fingerprint()));
  }
  // Computed once at set-up (p2p_schedule refuses a rank outside 0..M+R*N-1): a bucket's calls
  // then only walk these lists.
  const CommPlace place = comm_place(*plan_, comm_rank_, replicas);
  engine_ = place.engine;
  replica_ = place.replica;
  const auto& groups = wire.groups();
  ops_.resize(groups.size());
  forward_ops_.resize(groups.size());
  landing_layout_.resize(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (std::size_t k = 0; k < groups[g].bucket_count(); ++k) {
      ops_[g].push_back(p2p_schedule(*plan_, comm_rank_, g, k, replicas));
      forward_ops_[g].push_back(p2p_forward(*plan_, comm_rank_, g, k, replicas));
      landing_layout_[g].push_back(engine_rank() >= 0 ? landing_layout(*plan_, engine_rank(), g, k)
                                                      : std::vector<LandingRoute>{});
    }
  }
  if (engine_rank() >= 0) {
    landing_bytes_ = max_landing_bytes(*plan_, wire, engine_rank());
    if (landing_bytes_ > 0) landing_ = static_cast<std::byte*>(backend_.allocate(landing_bytes_));
  }
}

NcclRouteMover::~NcclRouteMover() {
  if (landing_ != nullptr) backend_.deallocate(landing_);
}

void NcclRouteMover::check_call(const RoutedBucket& bucket, bool trainer_call) {
  const char* call = trainer_call ? "send_routes_async" : "receive_routes_async";
  if (trainer_call != (engine_rank() < 0)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("NCCL routes: {} on communicator rank {}, {} (trainer ranks send, "
                            "engine ranks receive)",
                            call, comm_rank_, trainer_call ? "an engine rank" : "a trainer rank"));
  }
  if (bucket.group >= ops_.size() || bucket.bucket >= ops_[bucket.group].size()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("NCCL routes: {} for bucket {} of group {}, which the wire layout "
                            "does not have ({} groups)",
                            call, bucket.bucket, bucket.group, ops_.size()));
  }
  if (bucket.sequence != 0 &&
      (!in_update_ || bucket.version != version_ || bucket.sequence != next_sequence_)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("NCCL routes: {} for bucket {} of update {}, but {}: every rank calls "
                            "once per bucket, in order from sequence 0 (NCCL pairs sends and "
                            "receives by their order alone)",
                            call, bucket.sequence, bucket.version,
                            in_update_ ? fmt::format("bucket {} of update {} is next",
                                                     next_sequence_, version_)
                                       : std::string("no update is in progress")));
  }
}

void NcclRouteMover::run_group(const std::vector<P2pOp>& ops, std::byte* base, Stream& stream) {
  comm_.group_begin();
  try {
    for (const P2pOp& op : ops) {
      if (op.kind == P2pOp::kSend) {
        comm_.send_async(base + op.offset, op.bytes, op.peer, stream);
      } else {
        comm_.recv_async(base + op.offset, op.bytes, op.peer, stream);
      }
    }
  } catch (...) {
    // NCCL's group is per thread: it must be closed whatever failed inside it. The first error
    // is the one to report.
    try {
      comm_.group_end();
    } catch (...) {
    }
    throw;
  }
  comm_.group_end();
}

void NcclRouteMover::send_routes_async(const RoutedBucket& bucket, const void* packed,
                                       std::size_t bytes, Stream& stream) {
  check_call(bucket, /*trainer_call=*/true);
  const ByteRange slice = plan_->packed_range(comm_rank_, bucket.group, bucket.bucket);
  if (bytes != slice.end - slice.begin) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("NCCL routes: trainer rank {} sends {} bytes of bucket {} of group {} "
                            "(update {}); the routing plan's packed range is {} bytes ({}..{})",
                            comm_rank_, bytes, bucket.bucket, bucket.group, bucket.version,
                            slice.end - slice.begin, slice.begin, slice.end));
  }
  if (packed == nullptr && bytes > 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("NCCL routes: trainer rank {} sends {} bytes from a null packing",
                            comm_rank_, bytes));
  }
  // NCCL only reads a send buffer; the cast serves run_group's one signature.
  run_group(ops_[bucket.group][bucket.bucket], static_cast<std::byte*>(const_cast<void*>(packed)),
            stream);
  in_update_ = true;
  version_ = bucket.version;
  next_sequence_ = bucket.sequence + 1;
}

void NcclRouteMover::receive_routes_async(const RoutedBucket& bucket,
                                          std::span<const RouteCopy> copies,
                                          const RouteTargets& targets, Stream& stream) {
  check_call(bucket, /*trainer_call=*/false);
  // Every copy is checked and rewritten before a receive is posted: a bad list posts nothing.
  const std::vector<LandingRoute>& layout = landing_layout_[bucket.group][bucket.bucket];
  scratch_.clear();
  std::uint64_t bytes = 0;
  for (const RouteCopy& c : copies) {
    if ((c.to_staging ? targets.staging : targets.slot) == nullptr) {
      throw Error(
          ErrorCode::kInvalidArgument,
          fmt::format("NCCL routes: engine rank {} has a copy of bucket {} of group {} "
                      "into its {} but no {} memory was given",
                      engine_rank(), bucket.bucket, bucket.group, c.to_staging ? "staging" : "slot",
                      c.to_staging ? "staging" : "slot"));
    }
    scratch_.push_back(landing_copy(layout, c));
    bytes += c.rows * c.row_bytes;
  }
  run_group(ops_[bucket.group][bucket.bucket], landing_, stream);
  // Same stream: the next replica's forward starts once every receive landed, and before the
  // copies, so that the chain moves on while this rank copies.
  const std::vector<P2pOp>& forward = forward_ops_[bucket.group][bucket.bucket];
  if (!forward.empty()) run_group(forward, landing_, stream);
  for (const RouteCopy& c : scratch_) {
    std::byte* base = c.to_staging ? targets.staging : targets.slot;
    backend_.memcpy_2d_async(base + c.dst_offset, c.dst_pitch, landing_ + c.packed_offset,
                             c.src_pitch, c.row_bytes, c.rows, stream);
  }
  routed_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  in_update_ = true;
  version_ = bucket.version;
  next_sequence_ = bucket.sequence + 1;
}

}  // namespace shadowsync::nccl_detail
