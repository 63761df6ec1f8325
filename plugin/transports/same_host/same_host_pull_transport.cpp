// SameHostPullTransport's data path: per bucket, every trainer rank rings every engine process
// and waits for all their acks; every engine rank waits for all trainer ranks' doorbells, copies
// its routes straight out of their mapped slots and acks. The handshake is in
// same_host_pull_handshake.cpp; see same_host_pull_transport.h for the protocol.
#include "transports/same_host/same_host_pull_transport.h"

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <iterator>
#include <string>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "backends/host/host_stream.h"
#include "core/type_name.h"
#include "shadowsync/error.h"
#include "transports/same_host/same_host_frame.h"
#include "transports/same_host/same_host_pull_state.h"

namespace shadowsync {

using same_host::Io;
using same_host::RecordType;
using same_host::RouteRecord;

namespace {

std::string bucket_name(const RoutedBucket& b) {
  return fmt::format("bucket {} of update {} (group {}, bucket {})", b.sequence, b.version, b.group,
                     b.bucket);
}

// The slot of the b-th send on a trainer rank's transport (`call`: sends are its only calls).
std::uint32_t slot_of(std::uint64_t call) {
  return static_cast<std::uint32_t>(call % same_host::kSlotCount);
}

// Fails `state` for an exchange with its peer `peer` that ended in `io` (neither kOk nor kWoken)
// before `what` of `bucket`: "same-host pull trainer rank 0: engine rank 1 closed its socket (its
// process died?) before acking bucket 3 of update 2 (group 0, bucket 1)", then `after`.
void fail_exchange(SameHostPullTransport::State& state, std::size_t peer, Io io, int saved_errno,
                   std::string_view what, const RoutedBucket& bucket, std::string_view after = {}) {
  std::string happened;
  if (io == Io::kClosed) {
    happened = "closed its socket (its process died?)";
  } else if (io == Io::kTimeout) {
    happened = fmt::format("sent nothing for {} ms (SameHostConfig::doorbell_timeout)",
                           state.peer_timeout.count());
  } else {
    happened = same_host::describe(io, saved_errno);
  }
  state.fail(fmt::format("same-host pull {}: {} {} before {} {}{}", state.self_name(),
                         state.peer_name(peer), happened, what, bucket_name(bucket), after));
}

// Reads one data record from every peer of `state` side by side (a peer that died is seen at
// once, whatever the others do): record i at i * kDataRecordBytes of `records`. False when the
// transport was aborted, or when a peer failed before `what` of `bucket` (`state` then failed as
// fail_exchange says).
bool read_each_peer(SameHostPullTransport::State& state, std::vector<std::byte>& records,
                    std::string_view what, const RoutedBucket& bucket,
                    std::optional<same_host::Clock::time_point> deadline,
                    std::string_view after = {}) {
  std::size_t failed = 0;
  {
    std::lock_guard lock(state.mutex);
    state.peer_wait = SameHostPullTransport::State::PeerWait{
        bucket, std::vector<bool>(state.peers.size(), false), same_host::Clock::now()};
  }
  const Io io = same_host::read_each(state.peers, same_host::kDataRecordBytes, records,
                                     state.wake.get(), failed, deadline, [&state](std::size_t i) {
                                       std::lock_guard lock(state.mutex);
                                       state.peer_wait->arrived[i] = true;
                                     });
  {
    std::lock_guard lock(state.mutex);
    state.peer_wait.reset();
  }
  if (io != Io::kOk && io != Io::kWoken)
    fail_exchange(state, failed, io, errno, what, bucket, after);
  return io == Io::kOk;
}

// Record i of what read_each_peer read.
std::span<const std::byte> record_at(const std::vector<std::byte>& records, std::size_t i) {
  return {records.data() + i * same_host::kDataRecordBytes, same_host::kDataRecordBytes};
}

}  // namespace

std::string pull_engine_name(std::uint32_t engine_rank, std::uint32_t replica) {
  return replica == 0 ? fmt::format("engine rank {}", engine_rank)
                      : fmt::format("engine rank {}, replica {}", engine_rank, replica);
}

std::string SameHostPullTransport::State::self_name() const {
  if (trainer_rank >= 0) return fmt::format("trainer rank {}", trainer_rank);
  return pull_engine_name(static_cast<std::uint32_t>(engine_rank),
                          static_cast<std::uint32_t>(replica));
}

std::string SameHostPullTransport::State::peer_name(std::size_t p) const {
  if (trainer_rank < 0) return fmt::format("trainer rank {}", p);
  const auto engines = static_cast<std::size_t>(plan->engine_count());
  const auto replica = static_cast<std::uint32_t>(p / engines);
  // Mid-sentence: "engine rank 0, replica 1, closed its socket".
  return pull_engine_name(static_cast<std::uint32_t>(p % engines), replica) +
         (replica == 0 ? "" : ",");
}

std::optional<std::string> SameHostPullTransport::State::describe_wait() {
  std::lock_guard lock(mutex);
  if (!peer_wait) return std::nullopt;
  const bool trainer = trainer_rank >= 0;
  const std::size_t engines = static_cast<std::size_t>(plan->engine_count());
  const bool replicated = trainer && replicas() > 1;
  std::vector<std::string> missing;
  std::vector<std::string> came;
  for (std::size_t p = 0; p < peer_wait->arrived.size(); ++p) {
    (peer_wait->arrived[p] ? came : missing)
        .push_back(replicated ? fmt::format("{} (replica {})", p % engines, p / engines)
                              : std::to_string(p));
  }
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
      same_host::Clock::now() - peer_wait->since);
  const char* peer = trainer ? "engine" : "trainer";
  std::string text =
      fmt::format("{} {} from {} rank{} {}, for {} ms", trainer ? "the ack of" : "the doorbell of",
                  bucket_name(peer_wait->bucket), peer, missing.size() == 1 ? "" : "s",
                  fmt::join(missing, ", "), waited.count());
  if (!came.empty()) {
    text += fmt::format(" ({} rank{} {} sent {})", peer, came.size() == 1 ? "" : "s",
                        fmt::join(came, ", "), came.size() == 1 ? "its" : "theirs");
  }
  return text;
}

bool SameHostPullTransport::State::ring(const RoutedBucket& bucket, const RouteRecord& doorbell) {
  const auto frame = same_host::encode(doorbell);
  for (std::size_t e = 0; e < peers.size(); ++e) {
    Io io = same_host::write_all(peers[e].get(), frame, wake.get(), std::nullopt);
    // A changed shard table follows the doorbell that first reads it.
    if (io == Io::kOk && doorbell.table_records > 0) {
      io = same_host::write_all(peers[e].get(), table_frames, wake.get(), std::nullopt);
    }
    if (io == Io::kWoken) return false;
    if (io != Io::kOk) {
      fail_exchange(*this, e, io, errno, "the doorbell of", bucket);
      return false;
    }
  }
  return true;
}

bool SameHostPullTransport::State::read_table(std::size_t t, std::uint32_t records,
                                              const RoutedBucket& bucket,
                                              same_host::Clock::time_point deadline) {
  std::vector<std::vector<InPlaceSegment>> table(plan->group_count());
  if (mapped.size() <= t) mapped.resize(peers.size());
  Mappings maps;  // this table's: reused from the last table where it names them again
  std::array<std::byte, same_host::kShardRecordBytes> frame{};
  for (std::uint32_t i = 0; i < records; ++i) {
    const Io io = same_host::read_exact(peers[t].get(), frame, wake.get(), deadline);
    if (io != Io::kOk) {
      if (io != Io::kWoken) {
        fail_exchange(*this, t, io, errno, "its shard table for", bucket,
                      "; nothing of the bucket was copied");
      }
      return false;
    }
    same_host::ShardRecord record;
    std::string problem;
    const bool ok = same_host::decode(frame, record, problem);
    std::vector<InPlaceSegment>* group = ok && record.group < table.size() ? &table[record.group]
                                                                           : nullptr;
    if (ok && group == nullptr) {
      problem = fmt::format("shard record {} names group {}, outside the plan's {} groups", i,
                            record.group, table.size());
    } else if (ok && !group->empty() &&
               group->back().packing_offset + group->back().bytes > record.packing_offset) {
      problem = fmt::format("shard record {} of group {} (packing bytes from {}) overlaps or "
                            "precedes the one before it",
                            i, record.group, record.packing_offset);
    }
    if (!problem.empty()) {
      fail(fmt::format("same-host pull {}: trainer rank {} broke the protocol: {}; nothing of {} "
                       "was copied",
                       self_name(), t, problem, bucket_name(bucket)));
      return false;
    }
    auto it = maps.find(record.handle);
    if (it == maps.end()) {
      try {
        const auto old = mapped[t].find(record.handle);
        it = maps.emplace(record.handle,
                          old != mapped[t].end()
                              ? old->second
                              : same_host::open_shared_allocation(
                                    *backend, record.handle, record.allocation_bytes,
                                    fmt::format("trainer rank {}", t)))
                 .first;
      } catch (const Error& e) {
        fail(fmt::format("same-host pull {}: {}; nothing of {} was copied", self_name(), e.what(),
                         bucket_name(bucket)));
        return false;
      }
    }
    group->push_back({record.group, record.packing_offset, record.bytes,
                      it->second.base + record.allocation_offset});
  }
  if (tables.size() <= t) tables.resize(peers.size());
  tables[t] = std::move(table);
  // The last table's mappings it does not name go: no copy reads them (every bucket before this
  // doorbell was copied and acked).
  mapped[t] = std::move(maps);
  return true;
}

bool SameHostPullTransport::State::await_acks(
    const RoutedBucket& bucket, const RouteRecord& doorbell,
    std::optional<same_host::Clock::time_point> deadline) {
  std::vector<std::byte> records;
  if (!read_each_peer(*this, records, "acking", bucket, deadline)) return false;
  const same_host::SlotGeometry geometry{same_host::kSlotCount, staging[0].slot_bytes};
  for (std::size_t e = 0; e < peers.size(); ++e) {
    RouteRecord ack;
    std::string problem;
    if (!same_host::decode(record_at(records, e), RecordType::kRouteAck, geometry, ack, problem)) {
      fail(fmt::format("same-host pull {}: {} broke the protocol: {}", self_name(), peer_name(e),
                       problem));
      return false;
    }
    ack.type = RecordType::kRouteDoorbell;
    if (ack != doorbell) {
      fail(
          fmt::format("same-host pull {}: {} acked bucket {} of update {} (slot {}, {} bytes) "
                      "where {} (slot {}, {} bytes) was due",
                      self_name(), peer_name(e), ack.sequence, ack.version, ack.slot, ack.bytes,
                      bucket_name(bucket), doorbell.slot, doorbell.bytes));
      return false;
    }
  }
  return true;
}

bool SameHostPullTransport::State::await_doorbells(
    const RoutedBucket& bucket, std::vector<RouteRecord>& doorbells,
    std::optional<same_host::Clock::time_point> deadline) {
  // Every trainer rank's doorbell first: a trainer rank that died fails the bucket at once, and
  // nothing is copied until every doorbell passed its checks.
  std::vector<std::byte> records;
  if (!read_each_peer(*this, records, "the doorbell of", bucket, deadline,
                      "; nothing of the bucket was copied")) {
    return false;
  }
  doorbells.assign(peers.size(), RouteRecord{});
  for (std::size_t t = 0; t < peers.size(); ++t) {
    const same_host::SlotGeometry geometry{same_host::kSlotCount, staging[t].slot_bytes};
    const ByteRange range = plan->packed_range(static_cast<int>(t), bucket.group, bucket.bucket);
    RouteRecord doorbell;
    std::string problem;
    if (!same_host::decode(record_at(records, t), RecordType::kRouteDoorbell, geometry, doorbell,
                           problem)) {
      fail(
          fmt::format("same-host pull {}: trainer rank {} broke the protocol: {}; nothing of {} "
                      "was copied",
                      self_name(), t, problem, bucket_name(bucket)));
      return false;
    }
    if (doorbell.version != bucket.version || doorbell.sequence != bucket.sequence ||
        doorbell.bytes != range.end - range.begin) {
      fail(
          fmt::format("same-host pull {}: trainer rank {} broke the protocol: its doorbell says "
                      "bucket {} of update {}, {} bytes, where {} was due with {} bytes (the "
                      "plan's packed range [{}, {}) of the rank); nothing of the bucket was "
                      "copied",
                      self_name(), t, doorbell.sequence, doorbell.version, doorbell.bytes,
                      bucket_name(bucket), range.end - range.begin, range.begin, range.end));
      return false;
    }
    if (doorbell.slot == same_host::kInPlaceSlot && !device) {
      fail(fmt::format("same-host pull {}: trainer rank {} broke the protocol: its doorbell of {} "
                       "says the bytes are read in place, which host memory never is; nothing "
                       "of the bucket was copied",
                       self_name(), t, bucket_name(bucket)));
      return false;
    }
    if (doorbell.table_records > 0 &&
        !read_table(t, doorbell.table_records, bucket,
                    deadline.value_or(same_host::Clock::now() + peer_timeout))) {
      return false;
    }
    doorbells[t] = doorbell;
  }
  return true;
}

bool SameHostPullTransport::State::send_acks(const RoutedBucket& bucket,
                                             const std::vector<RouteRecord>& doorbells) {
  for (std::size_t t = 0; t < peers.size(); ++t) {
    RouteRecord ack = doorbells[t];
    ack.type = RecordType::kRouteAck;
    const Io sent =
        same_host::write_all(peers[t].get(), same_host::encode(ack), wake.get(), std::nullopt);
    if (sent == Io::kWoken) return false;
    if (sent != Io::kOk) {
      fail_exchange(*this, t, sent, errno, "the ack of", bucket);
      return false;
    }
  }
  return true;
}

void SameHostPullTransport::State::run_send(const RoutedBucket& bucket, const std::byte* packed,
                                            std::size_t bytes, std::uint64_t call) {
  if (!wait_turn(call)) return;
  const Staging& own = staging[0];
  const std::uint32_t s = slot_of(call);
  // The previous bucket in this slot was acked by every engine (its task ended only then): the
  // slot is free to fill. Packed straight into it by the caller (staging_buffer()): no copy.
  if (bytes > 0 && packed != own.slot(s)) std::memcpy(own.slot(s), packed, bytes);
  const RouteRecord doorbell{RecordType::kRouteDoorbell, bucket.version, bucket.sequence, s, bytes};
  // Every engine must have read the slot before it is packed again: wait for all their acks.
  if (!ring(bucket, doorbell) || !await_acks(bucket, doorbell, std::nullopt)) return;
  end_turn();
}

void SameHostPullTransport::State::run_receive(const RoutedBucket& bucket,
                                               const std::vector<RouteCopy>& copies,
                                               const RouteTargets& targets, std::uint64_t call) {
  if (!wait_turn(call)) return;
  std::vector<RouteRecord> doorbells;
  if (!await_doorbells(bucket, doorbells, std::nullopt)) return;
  std::uint64_t moved = 0;
  for (const RouteCopy& c : copies) {
    const std::size_t t = static_cast<std::size_t>(c.trainer);
    const std::byte* src = staging[t].slot(doorbells[t].slot) + c.packed_offset;
    std::byte* dst = (c.to_staging ? targets.staging : targets.slot) + c.dst_offset;
    for (std::size_t r = 0; r < c.rows; ++r) {
      std::memcpy(dst + r * c.dst_pitch, src + r * c.src_pitch, c.row_bytes);
    }
    moved += c.rows * c.row_bytes;
  }
  routed_bytes.fetch_add(moved, std::memory_order_relaxed);
  if (!send_acks(bucket, doorbells)) return;
  end_turn();
}

bool SameHostPullTransport::State::await_stream(Stream& stream, const RoutedBucket& bucket,
                                                const char* what) {
  backend->event_record(*passed, stream);
  // Work of this process only (packing, or copies out of a slot whose doorbell came): it ends
  // by itself. Bounded all the same, so that a wedged GPU is named rather than waited on forever.
  if (backend->event_wait_for(*passed, peer_timeout)) return true;
  fail(fmt::format("same-host pull {}: {} of {} did not complete within {} ms "
                   "(SameHostConfig::doorbell_timeout)",
                   self_name(), what, bucket_name(bucket), peer_timeout.count()));
  return false;
}

void SameHostPullTransport::State::gated_send(const RoutedBucket& bucket, const std::byte* packed,
                                              std::size_t bytes, Stream& stream,
                                              std::uint64_t call) {
  if (!alive()) return;
  const Staging& own = staging[0];
  // In place (packed null, after offer_in_place): the engines read the shards themselves.
  const std::uint32_t s = packed == nullptr ? same_host::kInPlaceSlot : slot_of(call);
  // Slot s is free: the send before this one returned only once the bucket it held before was
  // acked by every engine rank.
  if (bytes > 0 && packed != nullptr && packed != own.slot(s)) {
    backend->memcpy_async(own.slot(s), packed, bytes, stream);
  }
  // The bytes are in the slot (the caller's packing on `stream` too) before the doorbell rings.
  if (!await_stream(stream, bucket, "packing the slot")) return;
  RouteRecord doorbell{RecordType::kRouteDoorbell, bucket.version, bucket.sequence, s, bytes};
  if (packed == nullptr && table_unsent) doorbell.table_records = table_records;
  if (!ring(bucket, doorbell)) return;
  if (doorbell.table_records > 0) table_unsent = false;
  // The previous bucket's slot is the one the caller packs next: free once its acks came. This
  // bucket's own are read by the next send, or by flush_acks(), so that engines copy this bucket
  // while the caller packs the next.
  if (unacked && !await_acks(unacked->bucket, unacked->doorbell,
                             same_host::Clock::now() + peer_timeout)) {
    return;
  }
  unacked = Unacked{bucket, doorbell};
}

void SameHostPullTransport::State::flush_acks() {
  if (!unacked || !alive()) return;
  if (await_acks(unacked->bucket, unacked->doorbell, same_host::Clock::now() + peer_timeout)) {
    unacked.reset();
  }
}

void SameHostPullTransport::State::gated_receive(const RoutedBucket& bucket,
                                                 std::span<const RouteCopy> copies,
                                                 const RouteTargets& targets, Stream& stream) {
  if (!alive()) return;
  // Host-gated (same_host_device.h): nothing is enqueued until every doorbell came and passed,
  // so the stream never waits on a trainer.
  std::vector<RouteRecord> doorbells;
  if (!await_doorbells(bucket, doorbells, same_host::Clock::now() + peer_timeout)) return;
  // Every copy's source first (a staging slot, or where the trainer's shards lie), so that a
  // table that does not cover a copy fails the bucket before anything is enqueued.
  std::vector<AddressedCopy> addressed;
  addressed.reserve(copies.size());
  std::uint64_t moved = 0;
  std::uint64_t in_place_moved = 0;
  for (const RouteCopy& c : copies) {
    if (c.rows == 0) continue;
    const std::size_t t = static_cast<std::size_t>(c.trainer);
    const bool in_place = doorbells[t].slot == same_host::kInPlaceSlot;
    moved += c.rows * c.row_bytes;
    in_place_moved += in_place ? c.rows * c.row_bytes : 0;
    const ByteRange range = plan->packed_range(c.trainer, bucket.group, bucket.bucket);
    // No table yet from that rank (it rang in place before sending one): no segments, refused.
    const std::span<const InPlaceSegment> segments =
        t < tables.size() && bucket.group < tables[t].size()
            ? std::span<const InPlaceSegment>(tables[t][bucket.group])
            : std::span<const InPlaceSegment>();
    if (!address_route_copy(c, in_place ? nullptr : staging[t].slot(doorbells[t].slot),
                            range.begin, segments, c.to_staging ? targets.staging : targets.slot,
                            addressed)) {
      fail(fmt::format("same-host pull {}: trainer rank {} rang {} to be read in place, but its "
                       "shard table does not hold bytes {}..{} of its packing of group {}; "
                       "nothing of the bucket was copied",
                       self_name(), t, bucket_name(bucket), range.begin + c.packed_offset,
                       range.begin + c.packed_offset + (c.rows - 1) * c.src_pitch + c.row_bytes,
                       bucket.group));
      return;
    }
  }
  for (const AddressedCopy& a : addressed) {
    backend->memcpy_2d_async(a.dst, a.dst_pitch, a.src, a.src_pitch, a.row_bytes, a.rows, stream);
  }
  // Acked only once the copies landed: the trainer packs the slot again (or changes its shards)
  // after the ack.
  if (!await_stream(stream, bucket, "the copies")) return;
  routed_bytes.fetch_add(moved, std::memory_order_relaxed);
  routed_in_place_bytes.fetch_add(in_place_moved, std::memory_order_relaxed);
  send_acks(bucket, doorbells);
}

SameHostPullTransport::SameHostPullTransport(std::shared_ptr<State> state)
    : state_(std::move(state)) {}

SameHostPullTransport::~SameHostPullTransport() {
  // A transport that goes away is, to its peers, a peer that died: they see EOF.
  state_->do_abort("same-host pull transport destroyed");
}

int SameHostPullTransport::rank() const {
  return state_->trainer_rank >= 0 ? state_->trainer_rank
                                   : state_->plan->trainer_count() + state_->engine_rank;
}
int SameHostPullTransport::world_size() const {
  return state_->plan->trainer_count() + state_->plan->engine_count();
}
const RoutingPlan& SameHostPullTransport::routing_plan() const { return *state_->plan; }
int SameHostPullTransport::trainer_rank() const { return state_->trainer_rank; }
int SameHostPullTransport::engine_rank() const { return state_->engine_rank; }
std::uint64_t SameHostPullTransport::routed_bytes() const {
  return state_->routed_bytes.load(std::memory_order_relaxed);
}
std::uint64_t SameHostPullTransport::routed_in_place_bytes() const {
  return state_->routed_in_place_bytes.load(std::memory_order_relaxed);
}

bool SameHostPullTransport::offer_in_place(std::span<const InPlaceSegment> segments,
                                           std::string& why_not) {
  State& s = *state_;
  s.in_place = false;
  if (!s.device || s.trainer_rank < 0) {
    why_not = s.trainer_rank < 0 ? "an engine rank sends nothing"
                                 : "host memory (memory=\"host\") is read from the staging slots";
    return false;
  }
  if (!s.alive()) {
    why_not = "the transport failed";
    return false;
  }
  if (segments.empty() || segments.size() > same_host::kMaxShardRecords) {
    why_not = fmt::format("{} shard segments (1..{} can be read in place)", segments.size(),
                          same_host::kMaxShardRecords);
    return false;
  }
  // The table the engines have, if its allocations are still the ones shared (one freed and
  // another made at the same address would leave the engines reading the old one).
  if (std::equal(segments.begin(), segments.end(), s.offered.begin(), s.offered.end()) &&
      std::all_of(s.shared.begin(), s.shared.end(), [&s](const auto& a) {
        return same_host::still_allocated(*s.backend, a);
      })) {
    s.in_place = true;
    return true;
  }
  std::vector<same_host::SharedAllocation> shared;  // sorted by base
  std::vector<std::byte> frames;
  frames.reserve(segments.size() * same_host::kShardRecordBytes);
  std::uint32_t records = 0;
  for (const InPlaceSegment& segment : segments) {
    // A segment may span allocations (the trainer's allocator can place tensors back to back in
    // address space): one record per allocation it lies in.
    for (std::size_t done = 0; done < segment.bytes;) {
      const std::byte* at = segment.address + done;
      auto it = std::upper_bound(shared.begin(), shared.end(), at,
                                 [](const std::byte* p, const same_host::SharedAllocation& a) {
                                   return p < a.base;
                                 });
      if (it == shared.begin() || std::prev(it)->base + std::prev(it)->bytes <= at) {
        const auto found = same_host::share_allocation(*s.backend, at, why_not);
        if (!found) return false;
        it = std::next(shared.insert(it, *found));
      }
      const same_host::SharedAllocation& allocation = *std::prev(it);
      const std::size_t n = std::min<std::size_t>(
          segment.bytes - done, static_cast<std::size_t>(allocation.base + allocation.bytes - at));
      same_host::ShardRecord record;
      record.group = static_cast<std::uint32_t>(segment.group);
      record.packing_offset = segment.packing_offset + done;
      record.bytes = n;
      record.allocation_offset = static_cast<std::uint64_t>(at - allocation.base);
      record.allocation_bytes = allocation.bytes;
      record.handle = allocation.handle;
      const auto frame = same_host::encode(record);
      frames.insert(frames.end(), frame.begin(), frame.end());
      done += n;
      if (++records > same_host::kMaxShardRecords) {
        why_not = fmt::format("the shards lie in more than {} pieces of allocations",
                              same_host::kMaxShardRecords);
        return false;
      }
    }
  }
  s.offered.assign(segments.begin(), segments.end());
  s.shared = std::move(shared);
  s.table_frames = std::move(frames);
  s.table_records = records;
  s.table_unsent = true;
  s.in_place = true;
  return true;
}
std::size_t SameHostPullTransport::slot_bytes() const {
  return state_->trainer_rank >= 0 ? state_->staging[0].slot_bytes : 0;
}

void SameHostPullTransport::broadcast_async(void* buffer, std::size_t bytes, int root,
                                            Stream& stream) {
  (void)buffer;
  (void)stream;
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("the same_host_pull transport moves routes only: broadcast_async of {} "
                          "bytes from root {} refused; use its route_mover() (send_routes_async "
                          "on trainer ranks, receive_routes_async on engine ranks)",
                          bytes, root));
}

void* SameHostPullTransport::staging_buffer(int index, std::size_t bytes) {
  if (state_->trainer_rank < 0 || index < 0 || index >= static_cast<int>(same_host::kSlotCount) ||
      bytes > state_->staging[0].slot_bytes) {
    return nullptr;
  }
  return state_->staging[0].slot(static_cast<std::uint32_t>(index));
}

std::optional<std::string> SameHostPullTransport::async_error() {
  std::lock_guard lock(state_->mutex);
  return state_->error;
}

std::optional<std::string> SameHostPullTransport::waiting_for() {
  return state_->describe_wait();
}

void SameHostPullTransport::abort() noexcept {
  std::string reason;
  try {
    reason = fmt::format("same-host pull transport aborted by {}", state_->self_name());
  } catch (...) {
  }
  state_->do_abort(std::move(reason));
}

namespace {

host::HostStream& host_stream_of(Stream& stream, const char* call) {
  host::HostStream* host_stream = host::as_host_stream(stream);
  if (host_stream == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same_host_pull {}: host memory (SameHostMemory::kHost) needs a "
                            "stream from HostBackend, got a {}",
                            call, type_name(typeid(stream))));
  }
  return *host_stream;
}

void check_bucket(const RoutingPlan& plan, const RoutedBucket& b, const char* call) {
  if (b.group >= plan.group_count() || b.bucket >= plan.bucket_count(b.group)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same_host_pull {}: group {}, bucket {} is outside the routing plan "
                            "({} groups; the group has {} buckets)",
                            call, b.group, b.bucket, plan.group_count(),
                            b.group < plan.group_count() ? plan.bucket_count(b.group) : 0));
  }
}

}  // namespace

void SameHostPullTransport::send_routes_async(const RoutedBucket& bucket, const void* packed,
                                              std::size_t bytes, Stream& stream) {
  host::HostStream* host_stream =
      state_->device ? nullptr : &host_stream_of(stream, "send_routes_async");
  if (state_->trainer_rank < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same_host_pull send_routes_async on engine rank {}: only trainer "
                            "ranks send routes",
                            state_->engine_rank));
  }
  check_bucket(*state_->plan, bucket, "send_routes_async");
  const ByteRange range =
      state_->plan->packed_range(state_->trainer_rank, bucket.group, bucket.bucket);
  if (bytes != range.end - range.begin) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same_host_pull send_routes_async on trainer rank {}: {} bytes for {}, "
                            "but the routing plan's packed range of this rank there is {} bytes "
                            "([{}, {}))",
                            state_->trainer_rank, bytes, bucket_name(bucket),
                            range.end - range.begin, range.begin, range.end));
  }
  if (packed == nullptr && !state_->in_place) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same_host_pull send_routes_async: null packed memory for {} bytes, "
                            "but this update's shards were not offered in place (offer_in_place "
                            "returned false or was not called)",
                            bytes));
  }
  const State::Staging& own = state_->staging[0];
  const std::byte* bytes_at = static_cast<const std::byte*>(packed);
  const std::uint32_t other = 1 - slot_of(state_->calls_enqueued);
  if (bytes > 0 && bytes_at == own.slot(other)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same_host_pull send_routes_async on trainer rank {}: {} was packed "
                            "in staging slot {}, but goes in slot {} (the send's count on this "
                            "transport % 2): the other "
                            "slot may still be read by the engines",
                            state_->trainer_rank, bucket_name(bucket), other, 1 - other));
  }
  const std::uint64_t call = state_->calls_enqueued++;
  if (state_->device) {
    state_->gated_send(bucket, bytes_at, bytes, stream, call);
    return;
  }
  host_stream->enqueue([state = state_, bucket, bytes_at, bytes, call] {
    state->run_send(bucket, bytes_at, bytes, call);
  });
}

void SameHostPullTransport::flush() {
  if (state_->device && state_->trainer_rank >= 0) state_->flush_acks();
}

void SameHostPullTransport::receive_routes_async(const RoutedBucket& bucket,
                                                 std::span<const RouteCopy> copies,
                                                 const RouteTargets& targets, Stream& stream) {
  host::HostStream* host_stream =
      state_->device ? nullptr : &host_stream_of(stream, "receive_routes_async");
  if (state_->engine_rank < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same_host_pull receive_routes_async on trainer rank {}: only engine "
                            "ranks receive routes",
                            state_->trainer_rank));
  }
  const RoutingPlan& plan = *state_->plan;
  check_bucket(plan, bucket, "receive_routes_async");
  // A copy reads only its trainer rank's packed slice of the bucket, whatever the doorbell says:
  // checked here, so that the stream task copies without checks of its own.
  for (std::size_t i = 0; i < copies.size(); ++i) {
    const RouteCopy& c = copies[i];
    if (c.trainer < 0 || c.trainer >= plan.trainer_count()) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("same_host_pull receive_routes_async: copy {} of {} reads trainer "
                              "rank {}, outside 0..{}",
                              i, bucket_name(bucket), c.trainer, plan.trainer_count() - 1));
    }
    const ByteRange range = plan.packed_range(c.trainer, bucket.group, bucket.bucket);
    const std::size_t extent = c.rows == 0 ? 0 : (c.rows - 1) * c.src_pitch + c.row_bytes;
    if (c.packed_offset > range.end - range.begin ||
        extent > range.end - range.begin - c.packed_offset) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("same_host_pull receive_routes_async: copy {} of {} reads bytes "
                              "[{}, {}) of trainer rank {}'s packing, which holds {} bytes of the "
                              "bucket: copies must come from compose_route_copies for this plan",
                              i, bucket_name(bucket), c.packed_offset, c.packed_offset + extent,
                              c.trainer, range.end - range.begin));
    }
    if ((c.to_staging ? targets.staging : targets.slot) == nullptr && c.rows > 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("same_host_pull receive_routes_async: copy {} of {} goes to {}, "
                              "but targets.{} is null",
                              i, bucket_name(bucket), c.to_staging ? "staging" : "the slot",
                              c.to_staging ? "staging" : "slot"));
    }
  }
  if (state_->device) {
    state_->gated_receive(bucket, copies, targets, stream);
    return;
  }
  const std::uint64_t call = state_->calls_enqueued++;
  host_stream->enqueue([state = state_, bucket,
                       copies = std::vector<RouteCopy>(copies.begin(), copies.end()), targets,
                       call] { state->run_receive(bucket, copies, targets, call); });
}

}  // namespace shadowsync
