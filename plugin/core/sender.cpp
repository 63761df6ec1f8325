#include "shadowsync/sender.h"

#include <blockingconcurrentqueue.h>
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "core/check_root_rank.h"
#include "shadowsync/error.h"

namespace shadowsync {
namespace {

using Clock = std::chrono::steady_clock;

// Where one group's bytes come from: an arena with the layout's byte image, or one pointer per
// tensor (packed through the staging buffers).
struct GroupSource {
  std::size_t group = 0;
  const std::byte* arena = nullptr;
  std::vector<const std::byte*> tensors;
};

struct Job {
  std::shared_ptr<PublishHandle::State> handle;
  std::vector<GroupSource> sources;
  std::unique_ptr<Transport> new_transport;  // a transport replacement instead of an update
  bool stop = false;
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

struct Sender::Impl {
  Impl(Sender& owner, Backend& backend, std::unique_ptr<Transport> transport, SenderConfig config)
      : owner(owner),
        backend(backend),
        config(config),
        transport(std::move(transport)),
        pack_stream(backend.create_stream(StreamPriority::kNormal)),
        comm_stream(backend.create_stream(StreamPriority::kNormal)),
        done_event(backend.create_event()) {
    for (int s = 0; s < 2; ++s) {
      packed[s] = backend.create_event();
      sent[s] = backend.create_event();
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
  void send(const Job& job);
  std::optional<Error> wait_done(std::uint64_t version);

  Sender& owner;
  Backend& backend;
  const SenderConfig config;
  std::unique_ptr<Transport> transport;  // worker thread only
  std::unique_ptr<Stream> pack_stream;
  std::unique_ptr<Stream> comm_stream;
  // Two staging buffers: packing bucket k+1 into one overlaps broadcasting bucket k from the
  // other. packed[s]: bucket in staging s is complete; sent[s]: staging s may be packed again.
  DeviceBuffer staging[2];
  std::unique_ptr<Event> packed[2];
  std::unique_ptr<Event> sent[2];
  std::unique_ptr<Event> done_event;

  moodycamel::BlockingConcurrentQueue<Job> jobs;
  std::thread thread;
  std::mutex publish_mutex;
  std::uint64_t last_version = 0;
};

Sender::Sender(Layout layout, Backend& backend, std::unique_ptr<Transport> transport,
               SenderConfig config)
    : layout_(std::move(layout)) {
  if (config.update_deadline.count() <= 0 || config.poll_interval.count() <= 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("SenderConfig: update_deadline ({} ms) and poll_interval ({} us) must "
                            "be positive",
                            config.update_deadline.count(), config.poll_interval.count()));
  }
  check_root_rank(config.root_rank, transport.get(), "SenderConfig::root_rank");
  if (transport && transport->rank() != config.root_rank) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("Sender: the sender must be the broadcast root, but its transport is "
                            "rank {} and SenderConfig::root_rank is {}",
                            transport->rank(), config.root_rank));
  }
  impl_ = std::make_unique<Impl>(*this, backend, std::move(transport), config);
  impl_->thread = std::thread([this] { impl_->run(); });
}

Sender::~Sender() {
  Job stop;
  stop.stop = true;
  impl_->jobs.enqueue(std::move(stop));
  impl_->thread.join();
  impl_->backend.stream_synchronize(*impl_->pack_stream);
  impl_->backend.stream_synchronize(*impl_->comm_stream);
}

PublishHandle Sender::publish(std::uint64_t version, const std::vector<std::string>& groups,
                              const std::vector<SourceTensor>& tensors) {
  UpdateHeader header = make_update_header(layout_, version, groups);

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
      if (given.dtype != spec.dtype) {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("tensor '{}': dtype {} does not match layout {}", spec.name,
                                dtype_name(given.dtype), dtype_name(spec.dtype)));
      }
      if (given.shape != spec.shape) {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("tensor '{}': shape {} does not match layout {}", spec.name,
                                format_shape(given.shape), format_shape(spec.shape)));
      }
      if (given.data == nullptr) {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("tensor '{}': data pointer is null", spec.name));
      }
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
  UpdateHeader header = make_update_header(layout_, version, groups);
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

void Sender::replace_transport(std::unique_ptr<Transport> transport) {
  if (!transport) throw Error(ErrorCode::kInvalidArgument, "replace_transport: transport is null");
  check_root_rank(impl_->config.root_rank, transport.get(), "SenderConfig::root_rank");
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
      continue;
    }
    const std::uint64_t version = job.handle->header.version;
    if (!transport) {
      job.handle->finish(Error(
          ErrorCode::kTransport,
          fmt::format("update {}: no transport (the last one was aborted after a failure; call "
                      "replace_transport with a new communicator)",
                      version)));
      continue;
    }
    try {
      send(job);
      job.handle->finish(wait_done(version));
    } catch (const Error& error) {
      job.handle->finish(error);
    } catch (const std::exception& error) {
      job.handle->finish(Error(ErrorCode::kInternal, error.what()));
    }
  }
}

void Sender::Impl::send(const Job& job) {
  const Layout& layout = owner.layout_;
  std::size_t staged = 0;  // buckets packed so far: picks the staging buffer
  for (const GroupSource& source : job.sources) {
    const GroupLayout& group = layout.groups()[source.group];
    if (source.arena != nullptr) {
      for (std::size_t k = 0; k < group.bucket_count(); ++k) {
        const Bucket bucket = group.bucket(k);
        transport->broadcast_async(const_cast<std::byte*>(source.arena) + bucket.offset,
                                   bucket.bytes, config.root_rank, *comm_stream);
      }
      continue;
    }
    if (staging[0].size() == 0) {
      for (auto& buffer : staging) buffer = DeviceBuffer(backend, layout.bucket_bytes());
    }
    const auto& tensors = group.tensors();
    std::size_t first_tensor = 0;  // first tensor that may reach into the current bucket
    for (std::size_t k = 0; k < group.bucket_count(); ++k) {
      const Bucket bucket = group.bucket(k);
      const std::size_t bucket_end = bucket.offset + bucket.bytes;
      const int s = static_cast<int>(staged++ % 2);
      backend.stream_wait_event(*pack_stream, *sent[s]);  // the broadcast of bucket k-2 is done
      while (first_tensor < tensors.size() &&
             tensors[first_tensor].offset + tensors[first_tensor].bytes <= bucket.offset) {
        ++first_tensor;
      }
      for (std::size_t t = first_tensor; t < tensors.size() && tensors[t].offset < bucket_end;
           ++t) {
        const std::size_t begin = std::max(tensors[t].offset, bucket.offset);
        const std::size_t end = std::min(tensors[t].offset + tensors[t].bytes, bucket_end);
        backend.memcpy_async(staging[s].data() + (begin - bucket.offset),
                             source.tensors[t] + (begin - tensors[t].offset), end - begin,
                             *pack_stream);
      }
      backend.event_record(*packed[s], *pack_stream);
      backend.stream_wait_event(*comm_stream, *packed[s]);
      transport->broadcast_async(staging[s].data(), bucket.bytes, config.root_rank, *comm_stream);
      backend.event_record(*sent[s], *comm_stream);
    }
  }
  backend.event_record(*done_event, *comm_stream);
}

std::optional<Error> Sender::Impl::wait_done(std::uint64_t version) {
  const auto start = Clock::now();
  while (!backend.event_wait_for(*done_event, config.poll_interval)) {
    std::optional<std::string> failure = transport->async_error();
    if (!failure && Clock::now() - start > config.update_deadline) {
      failure = fmt::format("deadline of {} ms passed", config.update_deadline.count());
    }
    if (failure) {
      transport->abort();
      transport.reset();
      backend.stream_synchronize(*comm_stream);
      backend.stream_synchronize(*pack_stream);
      return Error(ErrorCode::kTransport,
                   fmt::format("update {}: send failed: {}", version, *failure));
    }
  }
  // A rank that dropped out completes its own broadcasts without sending: report it.
  if (auto failure = transport->async_error()) {
    transport->abort();
    transport.reset();
    return Error(ErrorCode::kTransport, fmt::format("update {}: send failed: {}", version, *failure));
  }
  return std::nullopt;
}

}  // namespace shadowsync
