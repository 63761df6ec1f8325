#include "shadowsync/sender.h"

#include <blockingconcurrentqueue.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "core/check_root_rank.h"
#include "core/check_source_tensor.h"
#include "core/route_mover.h"
#include "core/routing_plan.h"
#include "core/shard_packing.h"
#include "core/streamed_publish.h"
#include "core/thread_affinity.h"
#include "core/transport_wait.h"
#include "shadowsync/error.h"

namespace shadowsync {
namespace {

using Clock = std::chrono::steady_clock;

// Where one group's bytes come from: an arena with the layout's byte image, one pointer per
// tensor (packed through the staging buffers; a routed sender's shards, null where the rank
// holds nothing of the tensor), or, with neither, tensors the caller supplies while the update
// runs (StreamedPublish).
struct GroupSource {
  std::size_t group = 0;
  const std::byte* arena = nullptr;
  std::vector<const std::byte*> tensors;
};

struct Job {
  std::shared_ptr<PublishHandle::State> handle;
  std::vector<GroupSource> sources;
  std::shared_ptr<StreamedPublish::State> streamed;  // tensors come through supply()
  std::unique_ptr<Transport> new_transport;  // a transport replacement instead of an update
  bool stop = false;
};

// The staging buffer being filled and how many buckets of the group have been broadcast.
struct BucketCursor {
  bool open = false;
  std::size_t bucket = 0;  // open bucket
  int staging = 0;         // its staging buffer
  std::size_t flushed = 0; // buckets of the group broadcast so far
  // The open bucket's copies, not yet enqueued: one memcpy_batch_async per bucket, one host call
  // where a copy per tensor cost a launch each (Qwen2.5-0.5B: 290 tensors in two buckets).
  std::vector<Backend::CopyRegion> copies;
};

}  // namespace

struct PublishHandle::State {
  UpdateHeader header;
  mutable std::mutex mutex;
  mutable std::condition_variable cv;
  bool done = false;
  std::optional<Error> error;

  void finish(std::optional<Error> failure) {
    {
      std::lock_guard lock(mutex);
      error = std::move(failure);
      done = true;
    }
    cv.notify_all();
  }
};

const UpdateHeader& PublishHandle::header() const { return state_->header; }

bool PublishHandle::done() const {
  std::lock_guard lock(state_->mutex);
  return state_->done;
}

void PublishHandle::wait() const {
  std::unique_lock lock(state_->mutex);
  state_->cv.wait(lock, [&] { return state_->done; });
  if (state_->error) throw *state_->error;
}

bool PublishHandle::wait_for(std::chrono::nanoseconds timeout) const {
  std::unique_lock lock(state_->mutex);
  if (!state_->cv.wait_for(lock, timeout, [&] { return state_->done; })) return false;
  if (state_->error) throw *state_->error;
  return true;
}

// A routed sender's transport must move routes of its plan for its rank. Throws
// Error(kInvalidArgument) naming both values.
void check_route_mover(Transport& transport, const RoutingPlan& routing, int trainer_rank,
                       const char* what) {
  RouteMover* mover = transport.route_mover();
  if (mover == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: transport '{}' moves no routes (route_mover() is null), but this "
                            "sender is trainer rank {} of a routing plan; give it a transport "
                            "made for that rank (loopback routes, same-host pull)",
                            what, transport.name(), trainer_rank));
  }
  if (mover->trainer_rank() != trainer_rank) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: the sender is trainer rank {}, but its transport '{}' is {} {}",
                            what, trainer_rank, transport.name(),
                            mover->trainer_rank() >= 0 ? "trainer rank" : "engine rank",
                            mover->trainer_rank() >= 0 ? mover->trainer_rank()
                                                       : mover->engine_rank()));
  }
  if (mover->routing_plan().fingerprint() != routing.fingerprint()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: the sender's routing plan {:#018x} differs from its transport "
                            "'{}''s {:#018x} ({} and {} trainer ranks, {} and {} engine ranks)",
                            what, routing.fingerprint(), transport.name(),
                            mover->routing_plan().fingerprint(), routing.trainer_count(),
                            mover->routing_plan().trainer_count(), routing.engine_count(),
                            mover->routing_plan().engine_count()));
  }
}

struct Sender::Impl {
  Impl(Sender& owner, Backend& backend, std::unique_ptr<Transport> transport, SenderConfig config,
       std::shared_ptr<const RoutingPlan> routing_plan, int trainer)
      : owner(owner),
        backend(backend),
        config(config),
        routing(std::move(routing_plan)),
        trainer_rank(trainer),
        packing(routing ? std::make_unique<ShardPacking>(owner.layout_, *routing, trainer)
                        : nullptr),
        transport(std::move(transport)),
        pack_stream(backend.create_stream(StreamPriority::kNormal)),
        comm_stream(backend.create_stream(StreamPriority::kNormal)),
        done_event(backend.create_event()),
        copied_event(backend.create_event()) {
    for (int s = 0; s < 2; ++s) {
      packed[s] = backend.create_event();
      sent[s] = backend.create_event();
    }
    if (config.checksums) {
      std::size_t buckets = 0;
      for (const auto& g : owner.layout_.groups()) buckets += g.bucket_count();
      checksums = DeviceBuffer(backend, buckets * sizeof(std::uint64_t));
    }
  }

  // Checks the version against the last one published, then queues the job. Thread-safe.
  PublishHandle enqueue(UpdateHeader header, Job job) {
    std::lock_guard lock(publish_mutex);
    if (header.version <= last_version) {
      throw Error(ErrorCode::kStaleVersion,
                  fmt::format("update {}: version must be greater than the last one, {}",
                              header.version, last_version));
    }
    last_version = header.version;
    job.handle = std::make_shared<PublishHandle::State>();
    job.handle->header = std::move(header);
    PublishHandle handle(job.handle);
    jobs.enqueue(std::move(job));
    return handle;
  }
  void run();
  void send(const Job& job, Clock::time_point start);
  // A routed sender's update: per bucket, this rank's bytes of it packed into a staging slot and
  // handed to the RouteMover (empty buckets ring too: every engine rank hears from every rank).
  void send_routes(const Job& job);
  std::optional<Error> wait_done(std::uint64_t version, Clock::time_point start);

  // Packing, shared by publish() and publish_streamed(): copies one tensor into the staging
  // buffers of the buckets it overlaps, broadcasting each bucket once it is complete.
  void pack_tensor(const GroupLayout& group, const TensorPlacement& tensor, const std::byte* src,
                   BucketCursor& cursor);
  // One broadcast on the comm stream; sent[b % 2] records the b-th.
  void broadcast(void* buffer, std::size_t bytes);
  void flush_bucket(const GroupLayout& group, BucketCursor& cursor);
  // Enqueues the copies pack_tensor collected, on the pack stream.
  void enqueue_copies(BucketCursor& cursor);
  // After a failure mid-update: the receivers are inside collectives; end them.
  void abort_transport() noexcept;

  Sender& owner;
  Backend& backend;
  const SenderConfig config;
  // Routed (DESIGN §14): the plan, this trainer rank and its pack runs; null and -1 otherwise.
  const std::shared_ptr<const RoutingPlan> routing;
  const int trainer_rank;
  const std::unique_ptr<const ShardPacking> packing;
  std::unique_ptr<Transport> transport;  // worker thread only
  std::unique_ptr<Stream> pack_stream;
  std::unique_ptr<Stream> comm_stream;
  // Two staging buffers: packing bucket k+1 into one overlaps broadcasting bucket k from the
  // other. packed[s]: bucket in staging s is complete; sent[s]: staging s may be packed again.
  DeviceBuffer staging[2];
  // Staging buffer s: the transport's own when it has one (Transport::staging_buffer: the
  // same-host transport shares it with the receivers, so packing is the only copy), else ours.
  std::byte* staging_data(int s) {
    const std::size_t bytes = owner.layout_.bucket_bytes();
    if (void* shared = transport->staging_buffer(s, bytes)) return static_cast<std::byte*>(shared);
    if (staging[0].size() == 0) {
      for (auto& buffer : staging) buffer = DeviceBuffer(backend, bytes);
    }
    return staging[s].data();
  }
  // A routed sender's staging slot s: max_packed_bytes of its rank (what every bucket's slice
  // fits in), the transport's own when it has one (same-host pull: the engines read it there).
  std::byte* routed_staging(int s) {
    const std::size_t bytes = routing->max_packed_bytes(trainer_rank);
    if (bytes == 0) return nullptr;  // the rank holds nothing any engine rank needs
    if (void* shared = transport->staging_buffer(s, bytes)) return static_cast<std::byte*>(shared);
    if (staging[0].size() == 0) {
      for (auto& buffer : staging) buffer = DeviceBuffer(backend, bytes);
    }
    return staging[s].data();
  }
  std::unique_ptr<Event> packed[2];
  std::unique_ptr<Event> sent[2];
  std::uint64_t broadcasts = 0;  // on the current transport (the sender thread's)
  std::unique_ptr<Event> done_event;

  std::unique_ptr<Event> copied_event;  // streamed: a supply's bytes are in staging

  // SenderConfig::checksums: one 8-byte checksum per bucket of the update, in broadcast order,
  // broadcast as one block after the last bucket. next_checksum: worker thread only.
  DeviceBuffer checksums;
  std::size_t next_checksum = 0;
  // Enqueues the checksum of the next bucket on `stream`, before the bucket is broadcast.
  void checksum_bucket(const std::byte* data, std::size_t bytes, Stream& stream) {
    if (checksums.size() == 0) return;
    auto* slot = reinterpret_cast<std::uint64_t*>(checksums.data()) + next_checksum++;
    backend.checksum_async(data, bytes, slot, stream);
  }

  moodycamel::BlockingConcurrentQueue<Job> jobs;
  std::atomic<bool> stopping{false};  // the destructor runs: streamed jobs stop waiting
  std::thread thread;
  std::mutex publish_mutex;
  // What the last routed update's offer_in_place said (Sender::routes_in_place).
  mutable std::mutex in_place_mutex;
  std::optional<Sender::RoutesInPlace> routes_in_place;
  std::uint64_t last_version = 0;
};

namespace {

void check_deadlines(const SenderConfig& config) {
  if (config.update_deadline.count() <= 0 || config.poll_interval.count() <= 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("SenderConfig: update_deadline ({} ms) and poll_interval ({} us) must "
                            "be positive",
                            config.update_deadline.count(), config.poll_interval.count()));
  }
}

}  // namespace

Sender::Sender(Layout layout, Backend& backend, std::unique_ptr<Transport> transport,
               SenderConfig config)
    : layout_(std::move(layout)) {
  check_deadlines(config);
  check_root_rank(config.root_rank, transport.get(), "SenderConfig::root_rank");
  if (transport && transport->rank() != config.root_rank) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("Sender: the sender must be the broadcast root, but its transport is "
                            "rank {} and SenderConfig::root_rank is {}",
                            transport->rank(), config.root_rank));
  }
  if (config.checksums && !backend.supports_integrity()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("SenderConfig::checksums is set, but backend '{}' cannot compute "
                            "checksums (supports_integrity() is false)",
                            backend.name()));
  }
  impl_ = std::make_unique<Impl>(*this, backend, std::move(transport), config, nullptr, -1);
  impl_->thread = start_library_thread([this] { impl_->run(); });
}

Sender::Sender(Layout layout, Backend& backend, std::unique_ptr<Transport> transport,
               std::shared_ptr<const RoutingPlan> routing, int trainer_rank, SenderConfig config)
    : layout_(std::move(layout)) {
  check_deadlines(config);
  if (!routing) {
    throw Error(ErrorCode::kInvalidArgument, "Sender: the routing plan is null");
  }
  if (routing->wire_fingerprint() != layout_.fingerprint()) {
    throw Error(ErrorCode::kLayoutMismatch,
                fmt::format("Sender: the routing plan was built on wire layout {:#018x}, but the "
                            "sender's layout is {:#018x}",
                            routing->wire_fingerprint(), layout_.fingerprint()));
  }
  if (trainer_rank < 0 || trainer_rank >= routing->trainer_count()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("Sender: trainer rank {} is outside 0..{} (the routing plan has {} "
                            "trainer ranks)",
                            trainer_rank, routing->trainer_count() - 1, routing->trainer_count()));
  }
  if (config.checksums) {
    // A follow-up: a checksum per route, computed over its packed slice and checked over where
    // it landed (a bucket's checksum cannot be: no rank holds a whole bucket).
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("SenderConfig::checksums is set, but trainer rank {} of a routing "
                            "plan sends routes, which carry no checksums yet; set it false",
                            trainer_rank));
  }
  if (transport) check_route_mover(*transport, *routing, trainer_rank, "Sender");
  impl_ = std::make_unique<Impl>(*this, backend, std::move(transport), config, std::move(routing),
                                 trainer_rank);
  impl_->thread = start_library_thread([this] { impl_->run(); });
}

std::optional<Sender::RoutesInPlace> Sender::routes_in_place() const {
  std::lock_guard lock(impl_->in_place_mutex);
  return impl_->routes_in_place;
}

std::size_t Sender::staging_bytes() const {
  if (impl_->routing) return 2 * impl_->routing->max_packed_bytes(impl_->trainer_rank);
  return 2 * layout_.bucket_bytes();
}

namespace {

[[noreturn]] void refuse_routed(const char* call, std::uint64_t version, int trainer_rank) {
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("Sender::{} (update {}): this sender is trainer rank {} of a routing "
                          "plan, which publishes only its shards; call publish_shards",
                          call, version, trainer_rank));
}

}  // namespace

PublishHandle Sender::publish_shards(std::uint64_t version, const std::vector<std::string>& groups,
                                     const std::vector<SourceShard>& shards) {
  if (!impl_->routing) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("Sender::publish_shards (update {}): this sender has no routing plan "
                            "(it publishes whole tensors: call publish, or make the sender with "
                            "the routing plan and its trainer rank)",
                            version));
  }
  UpdateHeader header = make_update_header(layout_, version, groups, /*checksums=*/false);
  // A routed update names the routing plan: routed and unrouted ends refuse each other's.
  header.layout_fingerprint = impl_->routing->fingerprint();
  const auto data = impl_->packing->check(version, header.groups, shards);
  Job job;
  for (std::size_t i = 0; i < header.groups.size(); ++i) {
    GroupSource source;
    source.group = header.groups[i];
    source.tensors = data[i];
    job.sources.push_back(std::move(source));
  }
  return impl_->enqueue(std::move(header), std::move(job));
}

Sender::~Sender() {
  impl_->stopping.store(true);
  Job stop;
  stop.stop = true;
  impl_->jobs.enqueue(std::move(stop));
  impl_->thread.join();
  impl_->backend.stream_synchronize(*impl_->pack_stream);
  impl_->backend.stream_synchronize(*impl_->comm_stream);
}

PublishHandle Sender::publish(std::uint64_t version, const std::vector<std::string>& groups,
                              const std::vector<SourceTensor>& tensors) {
  if (impl_->routing) refuse_routed("publish", version, impl_->trainer_rank);
  UpdateHeader header = make_update_header(layout_, version, groups, impl_->config.checksums);

  std::unordered_map<std::string_view, const SourceTensor*> by_name;
  for (const SourceTensor& tensor : tensors) {
    if (!by_name.emplace(tensor.name, &tensor).second) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("update {}: tensor '{}' given twice", version, tensor.name));
    }
    bool known = false;
    for (const auto& group : layout_.groups()) known = known || group.find_tensor(tensor.name);
    if (!known) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("update {}: tensor '{}' is not in the layout", version, tensor.name));
    }
  }

  Job job;
  for (const std::uint32_t g : header.groups) {
    const GroupLayout& group = layout_.groups()[g];
    GroupSource source;
    source.group = g;
    for (const TensorPlacement& placement : group.tensors()) {
      const TensorSpec& spec = placement.spec;
      const auto it = by_name.find(spec.name);
      if (it == by_name.end()) {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("update {}: tensor '{}' of group '{}' is missing", version,
                                spec.name, group.name()));
      }
      const SourceTensor& given = *it->second;
      check_source_tensor(given, spec);
      source.tensors.push_back(static_cast<const std::byte*>(given.data));
    }
    job.sources.push_back(std::move(source));
  }

  return impl_->enqueue(std::move(header), std::move(job));
}

PublishHandle Sender::publish_arenas(std::uint64_t version, const std::vector<std::string>& groups,
                                     const std::vector<const void*>& arenas) {
  if (arenas.size() != groups.size()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("update {}: {} arenas given for {} groups", version, arenas.size(),
                            groups.size()));
  }
  if (impl_->routing) refuse_routed("publish_arenas", version, impl_->trainer_rank);
  UpdateHeader header = make_update_header(layout_, version, groups, impl_->config.checksums);
  Job job;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    if (arenas[i] == nullptr) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("update {}: arena of group '{}' is null", version, groups[i]));
    }
    GroupSource source;
    source.group = layout_.group_index(groups[i]);
    source.arena = static_cast<const std::byte*>(arenas[i]);
    job.sources.push_back(std::move(source));
  }
  // The header lists groups in layout order; the broadcasts must follow it.
  std::sort(job.sources.begin(), job.sources.end(),
            [](const GroupSource& a, const GroupSource& b) { return a.group < b.group; });

  return impl_->enqueue(std::move(header), std::move(job));
}

StreamedPublish Sender::publish_streamed(std::uint64_t version,
                                         const std::vector<std::string>& groups) {
  if (impl_->routing) refuse_routed("publish_streamed", version, impl_->trainer_rank);
  UpdateHeader header = make_update_header(layout_, version, groups, impl_->config.checksums);
  auto state = std::make_shared<StreamedPublish::State>();
  state->version = version;
  state->layout = &layout_;
  Job job;
  for (const std::uint32_t g : header.groups) {
    GroupSource source;
    source.group = g;
    job.sources.push_back(std::move(source));
    for (std::size_t t = 0; t < layout_.groups()[g].tensors().size(); ++t) {
      state->order.emplace_back(g, t);
    }
  }
  job.streamed = state;
  PublishHandle handle = impl_->enqueue(std::move(header), std::move(job));
  return StreamedPublish(std::move(handle), std::move(state));
}

void Sender::replace_transport(std::unique_ptr<Transport> transport) {
  if (!transport) throw Error(ErrorCode::kInvalidArgument, "replace_transport: transport is null");
  if (impl_->routing) {
    check_route_mover(*transport, *impl_->routing, impl_->trainer_rank,
                      "Sender::replace_transport");
  } else {
    check_root_rank(impl_->config.root_rank, transport.get(), "SenderConfig::root_rank");
  }
  Job job;
  job.new_transport = std::move(transport);
  impl_->jobs.enqueue(std::move(job));
}

void Sender::Impl::run() {
  for (;;) {
    Job job;
    jobs.wait_dequeue(job);
    if (job.stop) return;
    if (job.new_transport) {
      transport = std::move(job.new_transport);
      broadcasts = 0;
      continue;
    }
    const std::uint64_t version = job.handle->header.version;
    if (!transport) {
      Error error(ErrorCode::kTransport,
                  fmt::format("update {}: no transport (the last one was aborted after a failure; "
                              "call replace_transport with a new communicator)",
                              version));
      if (job.streamed) job.streamed->finish(error);
      job.handle->finish(error);
      continue;
    }
    std::optional<Error> failure;
    try {
      const auto start = Clock::now();
      send(job, start);
      failure = wait_done(version, start);
    } catch (const Error& error) {
      failure = error;
    } catch (const std::exception& error) {
      failure = Error(ErrorCode::kInternal, error.what());
    }
    // Any update can fail between buckets (a streamed supply that throws, a check of a bucket's
    // arguments), with the receivers inside collectives: the transport is out of step and must
    // go, and the caller's memory must not be read once the handle says failed.
    if (failure) abort_transport();
    if (job.streamed) job.streamed->finish(failure);
    job.handle->finish(failure);
  }
}

void Sender::Impl::abort_transport() noexcept {
  if (!transport) return;
  transport->abort();
  try {
    backend.stream_synchronize(*comm_stream);
    backend.stream_synchronize(*pack_stream);
  } catch (...) {  // a dead device: nothing left to wait for
  }
  // After the streams: the pack stream may still be writing the transport's staging memory.
  transport.reset();
}

void Sender::Impl::send(const Job& job, Clock::time_point start) {
  const Layout& layout = owner.layout_;
  if (routing) {
    send_routes(job);
    transport->flush();
    backend.event_record(*done_event, *comm_stream);
    return;
  }
  next_checksum = 0;
  // What a streamed job's worker side uses; the other jobs ignore it.
  const StreamedWorkerContext streamed{.backend = backend,
                                       .pack_stream = *pack_stream,
                                       .copied = *copied_event,
                                       .transport = *transport,
                                       .stopping = stopping,
                                       .poll_interval = config.poll_interval,
                                       .update_deadline = config.update_deadline,
                                       .start = start};
  for (const GroupSource& source : job.sources) {
    const GroupLayout& group = layout.groups()[source.group];
    if (source.arena != nullptr) {
      for (std::size_t k = 0; k < group.bucket_count(); ++k) {
        const Bucket bucket = group.bucket(k);
        if (checksums.size() > 0) {
          // On the pack stream, one bucket ahead of the broadcasts, as for staged buckets: the
          // checksums overlap the transfer instead of delaying every broadcast.
          const int s = static_cast<int>(k % 2);
          checksum_bucket(source.arena + bucket.offset, bucket.bytes, *pack_stream);
          backend.event_record(*packed[s], *pack_stream);
          backend.stream_wait_event(*comm_stream, *packed[s]);
        }
        broadcast(const_cast<std::byte*>(source.arena) + bucket.offset, bucket.bytes);
      }
      continue;
    }
    BucketCursor cursor;
    const auto& tensors = group.tensors();
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      // A streamed batch counts as copied once its copies are enqueued (next_tensor records
      // that): the caller may free its tensors then, so theirs cannot wait for the bucket.
      if (job.streamed) enqueue_copies(cursor);
      const std::byte* src =
          job.streamed ? job.streamed->next_tensor(streamed) : source.tensors[t];
      pack_tensor(group, tensors[t], src, cursor);
    }
    if (cursor.open) flush_bucket(group, cursor);
    if (cursor.flushed != group.bucket_count()) {
      throw Error(ErrorCode::kInternal,
                  fmt::format("group '{}': {} of {} buckets broadcast", group.name(),
                              cursor.flushed, group.bucket_count()));
    }
  }
  if (job.streamed) job.streamed->complete_batch(streamed);
  if (checksums.size() > 0) {
    // After every bucket's checksum: the comm stream waited for each bucket's packed event.
    broadcast(checksums.data(), next_checksum * sizeof(std::uint64_t));
  }
  // "done": for the same-host transport every receiver has every byte (flush waits for the acks);
  // for NCCL the root's broadcasts completed (NCCL may report that before every receiver has
  // consumed the bytes). Whether the update went live is the engine's to say.
  transport->flush();
  backend.event_record(*done_event, *comm_stream);
}

void Sender::Impl::send_routes(const Job& job) {
  RouteMover* mover = transport->route_mover();
  if (mover == nullptr) {  // replace_transport checked it; a transport that changed its mind
    throw Error(ErrorCode::kInternal,
                fmt::format("transport '{}' no longer moves routes", transport->name()));
  }
  const std::uint64_t version = job.handle->header.version;
  // Where the transport can read the shards where they lie, nothing is packed: the engines'
  // copies are the update's only pass through memory.
  std::vector<InPlaceSegment> segments;
  for (const GroupSource& source : job.sources) {
    packing->append_in_place_segments(source.group, source.tensors, segments);
  }
  std::string why_not;
  const bool in_place = mover->offer_in_place(segments, why_not);
  {
    std::lock_guard lock(in_place_mutex);
    routes_in_place = Sender::RoutesInPlace{in_place, in_place ? std::string() : why_not};
  }
  std::uint64_t sequence = 0;
  std::vector<Backend::CopyRegion> copies;
  for (const GroupSource& source : job.sources) {
    const GroupLayout& group = owner.layout_.groups()[source.group];
    for (std::size_t k = 0; k < group.bucket_count(); ++k) {
      // Slot b % 2 for the b-th bucket on this transport, as for broadcasts: a transport that
      // hands its engines its own two slots in turn finds each bucket in the slot it expects.
      const int s = static_cast<int>(broadcasts % 2);
      std::byte* slot = nullptr;  // in place: nothing packed, the send reads the shards
      if (!in_place) {
        slot = routed_staging(s);
        // The last send from this slot (bucket b-2) completed: every engine rank acknowledged it.
        backend.stream_wait_event(*pack_stream, *sent[s]);
        copies.clear();
        for (const PackRun& run : packing->runs(source.group, k)) {
          copies.push_back({.dst = slot + run.packed_offset,
                            .src = source.tensors[run.tensor] + run.local_offset,
                            .bytes = run.bytes});
        }
        if (!copies.empty()) backend.memcpy_batch_async(copies, *pack_stream);
        backend.event_record(*packed[s], *pack_stream);
        backend.stream_wait_event(*comm_stream, *packed[s]);
      }
      mover->send_routes_async({.version = version,
                                .sequence = sequence++,
                                .group = source.group,
                                .bucket = k},
                               slot, packing->packed_bytes(source.group, k), *comm_stream);
      backend.event_record(*sent[s], *comm_stream);
      ++broadcasts;
    }
  }
}

void Sender::Impl::broadcast(void* buffer, std::size_t bytes) {
  transport->broadcast_async(buffer, bytes, config.root_rank, *comm_stream);
  backend.event_record(*sent[broadcasts % 2], *comm_stream);
  ++broadcasts;
}

void Sender::Impl::pack_tensor(const GroupLayout& group, const TensorPlacement& tensor,
                               const std::byte* src, BucketCursor& cursor) {
  const std::size_t end = tensor.offset + tensor.bytes;
  for (std::size_t begin = tensor.offset; begin < end;) {
    const std::size_t k = begin / group.bucket_bytes();
    if (cursor.open && cursor.bucket != k) flush_bucket(group, cursor);  // ended in padding
    const Bucket bucket = group.bucket(k);
    if (!cursor.open) {
      if (k != cursor.flushed) {
        throw Error(ErrorCode::kInternal,
                    fmt::format("group '{}': bucket {} packed after {} buckets", group.name(), k,
                                cursor.flushed));
      }
      cursor.open = true;
      cursor.bucket = k;
      // Staging buffer b % 2 for the b-th broadcast on this transport, whatever it carried:
      // a transport that moves every broadcast through its own two slots in turn (the
      // same-host device flavour) then finds each bucket already in the slot it uses.
      cursor.staging = static_cast<int>(broadcasts % 2);
      // The last broadcast that went through this staging buffer (b-2) is done.
      backend.stream_wait_event(*pack_stream, *sent[cursor.staging]);
    }
    const std::size_t bucket_end = bucket.offset + bucket.bytes;
    const std::size_t slice_end = std::min(end, bucket_end);
    cursor.copies.push_back({.dst = staging_data(cursor.staging) + (begin - bucket.offset),
                             .src = src + (begin - tensor.offset),
                             .bytes = slice_end - begin});
    if (slice_end == bucket_end) flush_bucket(group, cursor);
    begin = slice_end;
  }
}

void Sender::Impl::enqueue_copies(BucketCursor& cursor) {
  if (cursor.copies.empty()) return;
  backend.memcpy_batch_async(cursor.copies, *pack_stream);
  cursor.copies.clear();
}

void Sender::Impl::flush_bucket(const GroupLayout& group, BucketCursor& cursor) {
  enqueue_copies(cursor);
  const int s = cursor.staging;
  checksum_bucket(staging_data(s), group.bucket(cursor.bucket).bytes, *pack_stream);
  backend.event_record(*packed[s], *pack_stream);
  backend.stream_wait_event(*comm_stream, *packed[s]);
  broadcast(staging_data(s), group.bucket(cursor.bucket).bytes);
  cursor.open = false;
  ++cursor.flushed;
}

std::optional<Error> Sender::Impl::wait_done(std::uint64_t version, Clock::time_point start) {
  while (!backend.event_wait_for(*done_event, config.poll_interval)) {
    std::optional<std::string> failure = transport->async_error();
    if (!failure && Clock::now() - start > config.update_deadline) {
      failure = fmt::format("deadline of {} ms passed{}", config.update_deadline.count(),
                            transport_wait_clause(*transport));
    }
    if (failure) {
      return Error(ErrorCode::kTransport,
                   fmt::format("update {}: send failed: {}", version, *failure));
    }
  }
  // A rank that dropped out completes its own broadcasts without sending: report it.
  if (auto failure = transport->async_error()) {
    return Error(ErrorCode::kTransport, fmt::format("update {}: send failed: {}", version, *failure));
  }
  return std::nullopt;
}

}  // namespace shadowsync
