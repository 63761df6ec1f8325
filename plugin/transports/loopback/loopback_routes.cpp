// Loopback routes: in-process trainer and engine ranks of a routing plan, pull semantics on
// HostBackend streams. See loopback_routes.h.
#include "transports/loopback/loopback_routes.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "backends/host/host_stream.h"
#include "core/route_mover.h"
#include "core/type_name.h"
#include "shadowsync/error.h"

namespace shadowsync {

namespace {

// What a trainer rank posted for one call: where its packing of the bucket lies (null: in place,
// where its shard table says).
struct Post {
  bool posted = false;
  RoutedBucket bucket;
  const std::byte* data = nullptr;
  std::size_t bytes = 0;
};

// One bucket in flight, keyed by its call index (the same on every rank).
struct Exchange {
  explicit Exchange(int trainers) : posts(static_cast<std::size_t>(trainers)) {}
  std::vector<Post> posts;  // [trainer]
  int posted = 0;    // trainer ranks that posted
  int acked = 0;     // engine ranks done copying
  int copying = 0;   // engine ranks reading the trainers' packings now (outside the lock)
  int present = 0;   // ranks inside the exchange now
  int finished = 0;  // ranks that took their part and left
};

struct TrainerFaults {
  std::optional<std::uint64_t> drop_from;
  std::optional<std::string> own_error;  // set when the drop takes effect
  bool claimed = false;
};

struct EngineFaults {
  std::map<std::uint64_t, std::chrono::microseconds> delays;
  bool claimed = false;
};

host::HostStream& host_stream_of(Stream& stream) {
  host::HostStream* host_stream = host::as_host_stream(stream);
  if (host_stream == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("loopback routes need a stream from HostBackend, got a {}",
                            type_name(typeid(stream))));
  }
  return *host_stream;
}

}  // namespace

// Shared by the communicator, every transport and every enqueued task, so that any of them may
// be destroyed first.
struct LoopbackRouteCommunicator::State {
  explicit State(std::shared_ptr<const RoutingPlan> routing)
      : plan(std::move(routing)),
        trainers(static_cast<std::size_t>(plan->trainer_count())),
        engines(static_cast<std::size_t>(plan->engine_count())) {}

  const std::shared_ptr<const RoutingPlan> plan;

  mutable std::mutex mutex;
  std::condition_variable changed;  // any field below changed
  std::vector<TrainerFaults> trainers;
  std::vector<EngineFaults> engines;
  std::map<std::uint64_t, Exchange> exchanges;
  bool aborted = false;
  std::optional<std::string> error;  // communicator-wide: the first failure or abort
  bool in_place = false;             // read_in_place
  // Each trainer rank's shard table of its last accepted offer_in_place, [trainer][group].
  std::vector<std::vector<std::vector<InPlaceSegment>>> tables =
      std::vector<std::vector<std::vector<InPlaceSegment>>>(trainers.size());
  std::uint64_t completed = 0;

  int trainer_count() const { return plan->trainer_count(); }
  int engine_count() const { return plan->engine_count(); }

  // Marks the communicator dead and wakes every waiter. Caller holds `mutex`.
  void abort_locked(std::string reason) {
    if (!aborted) {
      aborted = true;
      if (!error) error = std::move(reason);
    }
    changed.notify_all();
  }

  Exchange& exchange_locked(std::uint64_t call) {
    return exchanges.try_emplace(call, trainer_count()).first->second;
  }

  // The rank leaves exchange `call`. It is erased once every rank took part (a rank that
  // arrives later finds the posts it reads), or after an abort once nobody is inside (ranks that
  // never arrived can only come later, and they check for the abort first). Caller holds `mutex`.
  void leave_locked(std::uint64_t call, Exchange& x) {
    --x.present;
    ++x.finished;
    if (x.finished == trainer_count() + engine_count()) {
      ++completed;
      exchanges.erase(call);
    } else if (aborted && x.present == 0) {
      exchanges.erase(call);
    }
  }

  // Runs on trainer rank `trainer`'s stream: posts its packing for call `call` and stays until
  // every engine rank acknowledged it (the memory may be reused once the stream moves on).
  void run_send(int trainer, std::uint64_t call, const RoutedBucket& bucket,
                const std::byte* data, std::size_t bytes) {
    std::unique_lock lock(mutex);
    TrainerFaults& faults = trainers[trainer];
    if (faults.drop_from && call >= *faults.drop_from) {
      if (!faults.own_error) {
        faults.own_error = fmt::format(
            "trainer rank {} dropped at route call {} (bucket {} of update {}; fault injection)",
            trainer, call, bucket.sequence, bucket.version);
      }
      return;  // a dead process posts nothing
    }
    if (aborted) return;
    Exchange& x = exchange_locked(call);
    x.posts[trainer] = Post{true, bucket, data, bytes};
    ++x.posted;
    ++x.present;
    changed.notify_all();
    // Even after an abort an engine rank may still be reading this packing: wait for it.
    changed.wait(lock, [&] {
      return x.acked == engine_count() || (aborted && x.copying == 0);
    });
    leave_locked(call, x);
  }

  // Runs on engine rank `engine`'s stream: waits for every trainer rank's post of call `call`,
  // checks them, runs the copies from their packings and acknowledges.
  void run_receive(int engine, std::uint64_t call, const RoutedBucket& bucket,
                   const std::vector<RouteCopy>& copies, const RouteTargets& targets,
                   std::atomic<std::uint64_t>& routed_bytes,
                   std::atomic<std::uint64_t>& in_place_bytes) {
    std::unique_lock lock(mutex);
    if (aborted) return;
    Exchange& x = exchange_locked(call);
    ++x.present;
    if (auto it = engines[engine].delays.find(call); it != engines[engine].delays.end()) {
      // A slow reader, inside the exchange (the posts it will read stay listed), cut short by an
      // abort (which also keeps teardown from waiting it out).
      changed.wait_for(lock, it->second, [this] { return aborted; });
    }
    changed.wait(lock, [&] { return aborted || x.posted == trainer_count(); });
    if (!aborted) {
      if (std::optional<std::string> wrong = check_posts(engine, bucket, x)) {
        abort_locked(std::move(*wrong));  // nothing copied
      }
    }
    // Every copy's source, under the lock (the shard tables): a packing, or where the shards lie.
    std::vector<AddressedCopy> addressed;
    std::uint64_t moved = 0;
    std::uint64_t in_place_moved = 0;
    for (const RouteCopy& c : copies) {
      if (aborted) break;
      const std::byte* packed = x.posts[c.trainer].data;  // null: in place
      moved += c.rows * c.row_bytes;
      in_place_moved += packed == nullptr ? c.rows * c.row_bytes : 0;
      const ByteRange range = plan->packed_range(c.trainer, bucket.group, bucket.bucket);
      const auto& table = tables[c.trainer];
      const std::span<const InPlaceSegment> segments =
          bucket.group < table.size() ? std::span<const InPlaceSegment>(table[bucket.group])
                                      : std::span<const InPlaceSegment>();
      if (!address_route_copy(c, packed, range.begin, segments,
                              c.to_staging ? targets.staging : targets.slot, addressed)) {
        abort_locked(fmt::format("loopback routes: trainer rank {} posted bucket {} of group {} "
                                 "(update {}) in place, but its shard table does not hold bytes "
                                 "{}.. of its packing; nothing copied",
                                 c.trainer, bucket.bucket, bucket.group, bucket.version,
                                 range.begin + c.packed_offset));
        break;
      }
    }
    if (!aborted) {
      ++x.copying;
      lock.unlock();
      for (const AddressedCopy& a : addressed) {
        for (std::size_t r = 0; r < a.rows; ++r) {
          std::memcpy(a.dst + r * a.dst_pitch, a.src + r * a.src_pitch, a.row_bytes);
        }
      }
      routed_bytes.fetch_add(moved, std::memory_order_relaxed);
      in_place_bytes.fetch_add(in_place_moved, std::memory_order_relaxed);
      lock.lock();
      --x.copying;
      ++x.acked;
      changed.notify_all();
    }
    leave_locked(call, x);
  }

  // Every trainer rank's post against what engine rank `engine` receives: the same update,
  // bucket and sequence, and the byte count the plan says. The first difference, named.
  std::optional<std::string> check_posts(int engine, const RoutedBucket& want,
                                         const Exchange& x) const {
    for (int t = 0; t < trainer_count(); ++t) {
      const Post& post = x.posts[t];
      const RoutedBucket& got = post.bucket;
      if (got.version != want.version || got.sequence != want.sequence ||
          got.group != want.group || got.bucket != want.bucket) {
        return fmt::format(
            "loopback routes: trainer rank {} posted bucket {} (group {}, sequence {}) of update "
            "{}, but engine rank {} receives bucket {} (group {}, sequence {}) of update {}; "
            "every rank must publish the same update",
            t, got.bucket, got.group, got.sequence, got.version, engine, want.bucket, want.group,
            want.sequence, want.version);
      }
      const ByteRange range = plan->packed_range(t, want.group, want.bucket);
      if (post.bytes != range.end - range.begin) {
        return fmt::format(
            "loopback routes: trainer rank {} posted {} bytes for bucket {} of group {} (update "
            "{}), but the routing plan packs {} there",
            t, post.bytes, want.bucket, want.group, want.version, range.end - range.begin);
      }
    }
    return std::nullopt;
  }
};

namespace {

using State = LoopbackRouteCommunicator::State;

// A route-moving transport of one rank; its RouteMover is itself.
class LoopbackRouteTransport final : public Transport, public RouteMover {
 public:
  LoopbackRouteTransport(std::shared_ptr<State> state, int trainer, int engine)
      : state_(std::move(state)), trainer_(trainer), engine_(engine) {}

  std::string_view name() const override { return "loopback"; }
  int rank() const override { return trainer_ >= 0 ? trainer_ : state_->trainer_count() + engine_; }
  int world_size() const override { return state_->trainer_count() + state_->engine_count(); }

  void broadcast_async(void*, std::size_t, int, Stream&) override {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("loopback routes ({} of a routing plan): this transport moves routes "
                            "only, it does not broadcast; give the Sender the routing plan and "
                            "the Receiver use_routing_plan",
                            describe()));
  }
  RouteMover* route_mover() override { return this; }

  std::optional<std::string> async_error() override {
    std::lock_guard lock(state_->mutex);
    if (trainer_ >= 0 && state_->trainers[trainer_].own_error) {
      return state_->trainers[trainer_].own_error;
    }
    return state_->error;
  }

  void abort() noexcept override {
    std::lock_guard lock(state_->mutex);
    std::string reason;  // formatting may throw (allocation); an abort must still happen
    try {
      reason = fmt::format("loopback routes aborted by {}", describe());
    } catch (...) {
    }
    state_->abort_locked(std::move(reason));
  }

  // RouteMover
  const RoutingPlan& routing_plan() const override { return *state_->plan; }
  int trainer_rank() const override { return trainer_; }
  int engine_rank() const override { return engine_; }

  void send_routes_async(const RoutedBucket& bucket, const void* packed, std::size_t bytes,
                         Stream& stream) override {
    if (trainer_ < 0) refuse("send_routes_async", "an engine rank receives routes");
    host::HostStream& host_stream = host_stream_of(stream);
    check_bucket(bucket, "send_routes_async");
    const ByteRange range = state_->plan->packed_range(trainer_, bucket.group, bucket.bucket);
    if (bytes != range.end - range.begin || (packed == nullptr && bytes > 0 && !offered_)) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("loopback send_routes_async on trainer rank {}: {} bytes at {} for "
                              "bucket {} of group {}, but the routing plan packs {} bytes there",
                              trainer_, bytes, packed, bucket.bucket, bucket.group,
                              range.end - range.begin));
    }
    const std::uint64_t call = next_call_++;
    host_stream.enqueue([state = state_, trainer = trainer_, call, bucket,
                         data = static_cast<const std::byte*>(packed), bytes] {
      state->run_send(trainer, call, bucket, data, bytes);
    });
  }

  void receive_routes_async(const RoutedBucket& bucket, std::span<const RouteCopy> copies,
                            const RouteTargets& targets, Stream& stream) override {
    if (engine_ < 0) refuse("receive_routes_async", "a trainer rank sends routes");
    host::HostStream& host_stream = host_stream_of(stream);
    check_bucket(bucket, "receive_routes_async");
    const std::uint64_t call = next_call_++;
    // The copies are the receiver's, composed once; copied here all the same, since the stream
    // may run them after the caller's span is gone.
    host_stream.enqueue([state = state_, engine = engine_, call, bucket,
                         list = std::vector<RouteCopy>(copies.begin(), copies.end()), targets,
                         counter = routed_, in_place = in_place_] {
      state->run_receive(engine, call, bucket, list, targets, *counter, *in_place);
    });
  }

  std::uint64_t routed_bytes() const override { return routed_->load(); }
  std::uint64_t routed_in_place_bytes() const override { return in_place_->load(); }

  // Host memory of this process is read where it lies, once read_in_place(true) said so. The
  // sender offers between updates: no engine rank reads the table it replaces.
  bool offer_in_place(std::span<const InPlaceSegment> segments, std::string& why_not) override {
    std::lock_guard lock(state_->mutex);
    offered_ = trainer_ >= 0 && state_->in_place;
    if (!offered_) {
      why_not = trainer_ < 0 ? "an engine rank sends nothing"
                             : "this loopback communicator reads no routes in place "
                               "(read_in_place(false))";
      return false;
    }
    auto& table = state_->tables[trainer_];
    table.assign(state_->plan->group_count(), {});
    for (const InPlaceSegment& s : segments) table[s.group].push_back(s);
    return true;
  }

 private:
  std::string describe() const {
    return trainer_ >= 0 ? fmt::format("trainer rank {}", trainer_)
                         : fmt::format("engine rank {}", engine_);
  }
  [[noreturn]] void refuse(const char* call, const char* why) const {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("loopback {} on {}: {}", call, describe(), why));
  }
  // The plan's indices are unchecked; a bucket outside it is the caller's bug, named.
  void check_bucket(const RoutedBucket& bucket, const char* call) const {
    const RoutingPlan& plan = *state_->plan;
    if (bucket.group >= plan.group_count() || bucket.bucket >= plan.bucket_count(bucket.group)) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("loopback {} on {}: bucket {} of group {} is not in the routing "
                              "plan ({} groups)",
                              call, describe(), bucket.bucket, bucket.group, plan.group_count()));
    }
  }

  std::shared_ptr<State> state_;
  const int trainer_;
  const int engine_;
  std::uint64_t next_call_ = 0;  // the caller's thread only ("one thread at a time")
  bool offered_ = false;         // trainer: this update is sent in place (the caller's thread)
  // Shared with the enqueued tasks, which may outlive the transport.
  std::shared_ptr<std::atomic<std::uint64_t>> routed_ =
      std::make_shared<std::atomic<std::uint64_t>>(0);
  std::shared_ptr<std::atomic<std::uint64_t>> in_place_ =
      std::make_shared<std::atomic<std::uint64_t>>(0);
};

}  // namespace

LoopbackRouteCommunicator::LoopbackRouteCommunicator(std::shared_ptr<const RoutingPlan> plan) {
  if (!plan) {
    throw Error(ErrorCode::kInvalidArgument, "LoopbackRouteCommunicator: the routing plan is null");
  }
  state_ = std::make_shared<State>(std::move(plan));
}

// Transports and enqueued tasks keep the state alive; nothing to wait for here.
LoopbackRouteCommunicator::~LoopbackRouteCommunicator() = default;

namespace {

void check_rank(const char* what, int rank, int count) {
  if (rank < 0 || rank >= count) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("LoopbackRouteCommunicator: {} rank {} is outside 0..{} (the routing "
                            "plan has {} {} ranks)",
                            what, rank, count - 1, count, what));
  }
}

}  // namespace

std::unique_ptr<Transport> LoopbackRouteCommunicator::trainer_transport(int trainer) {
  std::lock_guard lock(state_->mutex);
  check_rank("trainer", trainer, state_->trainer_count());
  if (state_->trainers[trainer].claimed) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("LoopbackRouteCommunicator: trainer rank {} was already taken",
                            trainer));
  }
  state_->trainers[trainer].claimed = true;
  return std::make_unique<LoopbackRouteTransport>(state_, trainer, -1);
}

std::unique_ptr<Transport> LoopbackRouteCommunicator::engine_transport(int engine) {
  std::lock_guard lock(state_->mutex);
  check_rank("engine", engine, state_->engine_count());
  if (state_->engines[engine].claimed) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("LoopbackRouteCommunicator: engine rank {} was already taken",
                            engine));
  }
  state_->engines[engine].claimed = true;
  return std::make_unique<LoopbackRouteTransport>(state_, -1, engine);
}

void LoopbackRouteCommunicator::inject_drop(int trainer, std::uint64_t call) {
  std::lock_guard lock(state_->mutex);
  check_rank("trainer", trainer, state_->trainer_count());
  auto& drop_from = state_->trainers[trainer].drop_from;
  if (!drop_from || call < *drop_from) drop_from = call;
}

void LoopbackRouteCommunicator::inject_delay(int engine, std::uint64_t call,
                                             std::chrono::microseconds delay) {
  std::lock_guard lock(state_->mutex);
  check_rank("engine", engine, state_->engine_count());
  state_->engines[engine].delays[call] = delay;
}

void LoopbackRouteCommunicator::read_in_place(bool on) {
  std::lock_guard lock(state_->mutex);
  state_->in_place = on;
}

std::uint64_t LoopbackRouteCommunicator::buckets_completed() const {
  std::lock_guard lock(state_->mutex);
  return state_->completed;
}

}  // namespace shadowsync
