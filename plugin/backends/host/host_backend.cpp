// HostBackend: CUDA's stream and event semantics on CPU threads. See host_backend.h and
// host_stream.h.
#include "shadowsync/host_backend.h"

#include <algorithm>
#include <cmath>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <utility>

#include <fmt/format.h>

#include "core/allocation_ledger.h"
#include "core/backend_cast.h"
#include "core/check_integrity_args.h"
#include "core/check_memcpy_args.h"
#include "core/fp8_quantize.h"
#include "core/integrity.h"
#include "core/thread_affinity.h"
#include "core/type_name.h"
#include "backends/host/host_stream.h"
#include "shadowsync/error.h"

namespace shadowsync {

namespace host {

HostStream::HostStream(std::chrono::microseconds max_jitter, std::uint64_t jitter_seed)
    : max_jitter_(max_jitter),
      rng_(jitter_seed),
      thread_(start_library_thread([this] { run(); })) {}

HostStream::~HostStream() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  // A task that owns its own stream would otherwise join itself (std::terminate).
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();
  } else {
    thread_.join();
  }
}

void HostStream::enqueue(std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
  }
  wake_.notify_one();
}

bool HostStream::on_stream_thread() const noexcept {
  return thread_.get_id() == std::this_thread::get_id();
}

std::optional<std::string> HostStream::first_error() const {
  std::lock_guard lock(mutex_);
  return first_error_;
}

void HostStream::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    if (max_jitter_.count() > 0) {
      std::uniform_int_distribution<std::int64_t> jitter(0, max_jitter_.count());
      std::this_thread::sleep_for(std::chrono::microseconds(jitter(rng_)));
    }
    std::string failure;
    try {
      task();
    } catch (const std::exception& e) {
      failure = e.what();
      if (failure.empty()) failure = type_name(typeid(e));
    } catch (...) {
      failure = "unknown exception";
    }
    if (!failure.empty()) {
      std::fprintf(stderr, "shadowsync: host stream task threw: %s\n", failure.c_str());
      std::lock_guard lock(mutex_);
      if (!first_error_) first_error_ = std::move(failure);
    }
  }
}

}  // namespace host

namespace {

using host::HostStream;

// One recorded point in a stream: completed when the stream's thread reaches it.
struct Marker {
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;

  void complete() {
    {
      std::lock_guard lock(mutex);
      done = true;
    }
    done_cv.notify_all();
  }
  bool is_done() {
    std::lock_guard lock(mutex);
    return done;
  }
  void wait() {
    std::unique_lock lock(mutex);
    done_cv.wait(lock, [this] { return done; });
  }
  bool wait_for(std::chrono::nanoseconds timeout) {
    std::unique_lock lock(mutex);
    if (timeout <= std::chrono::nanoseconds::zero()) return done;
    const auto now = std::chrono::steady_clock::now();
    // now + timeout would overflow for "forever" timeouts such as nanoseconds::max().
    if (timeout >= std::chrono::steady_clock::time_point::max() - now) {
      done_cv.wait(lock, [this] { return done; });
      return true;
    }
    return done_cv.wait_until(lock, now + timeout, [this] { return done; });
  }
};

class HostEvent final : public Event {
 public:
  // The marker of the last record, or nullptr when never recorded (counts as complete).
  std::shared_ptr<Marker> marker() const {
    std::lock_guard lock(mutex_);
    return marker_;
  }
  void set_marker(std::shared_ptr<Marker> marker) {
    std::lock_guard lock(mutex_);
    marker_ = std::move(marker);
  }

 private:
  // The contract is one thread at a time per event; the lock keeps a caller who hands an event
  // between threads without its own synchronization from racing on the pointer.
  mutable std::mutex mutex_;
  std::shared_ptr<Marker> marker_;
};

// Every marker a stream records is completed by a task on that stream.
std::shared_ptr<Marker> record_marker(HostStream& stream) {
  auto marker = std::make_shared<Marker>();
  stream.enqueue([marker] { marker->complete(); });
  return marker;
}

HostStream& host_stream_or_throw(Stream& stream, const char* operation) {
  return backend_cast<HostStream>(stream, "HostBackend", operation, "stream");
}

HostEvent& host_event_or_throw(Event& event, const char* operation) {
  return backend_cast<HostEvent>(event, "HostBackend", operation, "event");
}

// A gate is a task on the stream that blocks the stream's thread until the gate's generation is
// opened; the marker recorded before it is the work before the gate. The state is shared with the
// task, which may still be queued when the gate object goes.
class HostStreamGate final : public StreamGate {
 public:
  void close(Stream& stream) override {
    HostStream& host_stream = host_stream_or_throw(stream, "StreamGate::close");
    std::uint64_t generation = 0;
    {
      std::lock_guard lock(state_->mutex);
      generation = ++state_->closed;
      state_->before = record_marker(host_stream);
    }
    host_stream.enqueue([state = state_, generation] {
      std::unique_lock lock(state->mutex);
      state->opened_cv.wait(lock, [&] { return state->opened >= generation; });
    });
  }
  bool wait_work_before(std::chrono::nanoseconds timeout) override {
    std::shared_ptr<Marker> before;
    {
      std::lock_guard lock(state_->mutex);
      before = state_->before;
    }
    return before == nullptr || before->wait_for(timeout);
  }
  void open() noexcept override {
    {
      std::lock_guard lock(state_->mutex);
      state_->opened = state_->closed;
    }
    state_->opened_cv.notify_all();
  }
  ~HostStreamGate() override { open(); }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable opened_cv;
    std::uint64_t closed = 0;  // gates closed so far
    std::uint64_t opened = 0;  // the stream may pass every gate up to this one
    std::shared_ptr<Marker> before;
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

// Alignment of every allocation: what cudaMalloc guarantees and what layouts assume.
constexpr std::size_t kAllocationAlignment = 256;

}  // namespace

struct HostBackend::State {
  HostBackendOptions options;
  std::atomic<std::uint64_t> streams_created{0};  // distinct jitter seed per stream
  AllocationLedger allocations;
};

HostBackend::HostBackend(HostBackendOptions options) : state_(std::make_unique<State>()) {
  if (options.max_task_jitter.count() < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("HostBackend: max_task_jitter must be >= 0 us, got {} us",
                            options.max_task_jitter.count()));
  }
  state_->options = options;
}

// Frees what callers leaked, as destroying a CUDA context does. Streams created by this backend
// may outlive it: they hold nothing of it.
HostBackend::~HostBackend() {
  state_->allocations.free_all([](void* ptr) { std::free(ptr); });
}

void* HostBackend::allocate(std::size_t bytes) {
  if (bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "HostBackend::allocate: size must be > 0, got 0");
  }
  if (bytes > std::numeric_limits<std::size_t>::max() - (kAllocationAlignment - 1)) {
    throw Error(ErrorCode::kBackend,
                fmt::format("HostBackend::allocate: {} bytes is too large", bytes));
  }
  // aligned_alloc wants a size that is a multiple of the alignment.
  const std::size_t rounded = (bytes + kAllocationAlignment - 1) / kAllocationAlignment *
                              kAllocationAlignment;
  void* ptr = std::aligned_alloc(kAllocationAlignment, rounded);
  if (ptr == nullptr) {
    throw Error(ErrorCode::kBackend,
                fmt::format("HostBackend::allocate: out of host memory allocating {} bytes "
                            "({} with alignment padding, {} bytes live)",
                            bytes, rounded, bytes_allocated()));
  }
  std::memset(ptr, 0, rounded);
  try {
    state_->allocations.record(ptr, bytes);
  } catch (...) {
    std::free(ptr);
    throw Error(ErrorCode::kBackend,
                fmt::format("HostBackend::allocate: out of host memory tracking {} bytes", bytes));
  }
  return ptr;
}

void HostBackend::deallocate(void* ptr) noexcept {
  if (ptr == nullptr) return;
  // Memory not in the book is leaked, not freed: it may be someone else's.
  if (state_->allocations.release(ptr, "HostBackend::deallocate") == 0) return;
  std::free(ptr);
}

std::size_t HostBackend::bytes_allocated() const { return state_->allocations.bytes_allocated(); }

std::unique_ptr<Stream> HostBackend::create_stream(StreamPriority /*priority*/) {
  // Priority only matters against a GPU's scheduler; host threads are not ranked.
  const std::uint64_t index = state_->streams_created.fetch_add(1, std::memory_order_relaxed);
  return std::make_unique<HostStream>(state_->options.max_task_jitter,
                                      state_->options.jitter_seed + index);
}

std::unique_ptr<Event> HostBackend::create_event() { return std::make_unique<HostEvent>(); }

void HostBackend::memcpy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) {
  HostStream& host_stream = host_stream_or_throw(stream, "memcpy_async");
  if (bytes == 0) return;
  check_memcpy_args("HostBackend::memcpy_async", dst, src, bytes);
  host_stream.enqueue([dst, src, bytes] { std::memcpy(dst, src, bytes); });
}

void HostBackend::memcpy_2d_async(void* dst, std::size_t dst_pitch, const void* src,
                                  std::size_t src_pitch, std::size_t row_bytes, std::size_t rows,
                                  Stream& stream) {
  HostStream& host_stream = host_stream_or_throw(stream, "memcpy_2d_async");
  if (row_bytes == 0 || rows == 0) return;
  check_memcpy_2d_args("HostBackend::memcpy_2d_async", dst, dst_pitch, src, src_pitch, row_bytes,
                       rows);
  host_stream.enqueue([=] {
    for (std::size_t r = 0; r < rows; ++r) {
      std::memcpy(static_cast<std::byte*>(dst) + r * dst_pitch,
                  static_cast<const std::byte*>(src) + r * src_pitch, row_bytes);
    }
  });
}

void HostBackend::event_record(Event& event, Stream& stream) {
  HostEvent& host_event = host_event_or_throw(event, "event_record");
  HostStream& host_stream = host_stream_or_throw(stream, "event_record");
  host_event.set_marker(record_marker(host_stream));
}

void HostBackend::stream_wait_event(Stream& stream, Event& event) {
  HostStream& host_stream = host_stream_or_throw(stream, "stream_wait_event");
  HostEvent& host_event = host_event_or_throw(event, "stream_wait_event");
  // The marker captured now: a later re-record installs a new marker and does not affect this.
  std::shared_ptr<Marker> marker = host_event.marker();
  if (marker == nullptr) return;  // never recorded: complete
  host_stream.enqueue([marker = std::move(marker)] { marker->wait(); });
}

bool HostBackend::event_query(Event& event) {
  std::shared_ptr<Marker> marker = host_event_or_throw(event, "event_query").marker();
  return marker == nullptr || marker->is_done();
}

bool HostBackend::event_wait_for(Event& event, std::chrono::nanoseconds timeout) {
  std::shared_ptr<Marker> marker = host_event_or_throw(event, "event_wait_for").marker();
  return marker == nullptr || marker->wait_for(timeout);
}

void HostBackend::stream_synchronize(Stream& stream) {
  HostStream& host_stream = host_stream_or_throw(stream, "stream_synchronize");
  if (host_stream.on_stream_thread()) {
    throw Error(ErrorCode::kInvalidArgument,
                "HostBackend::stream_synchronize: called from a task of the same stream, "
                "which would wait for itself forever");
  }
  record_marker(host_stream)->wait();
}

void HostBackend::checksum_async(const void* data, std::size_t bytes, std::uint64_t* result,
                                 Stream& stream) {
  HostStream& host_stream = host_stream_or_throw(stream, "checksum_async");
  check_checksum_args("HostBackend::checksum_async", data, bytes, result, /*alignment=*/1);
  host_stream.enqueue([data = static_cast<const std::byte*>(data), bytes, result] {
    std::uint64_t sum = 0;
    for (std::size_t at = 0, index = 0; at < bytes; at += 8, ++index) {
      std::uint64_t word = 0;  // little-endian, the tail zero-padded (x86 and arm64 hosts)
      std::memcpy(&word, data + at, std::min<std::size_t>(8, bytes - at));
      sum += integrity::checksum_term(word, index);
    }
    *result = sum;
  });
}

void HostBackend::count_nonfinite_async(const void* data, std::size_t elements, DType dtype,
                                        std::uint64_t* result, Stream& stream) {
  HostStream& host_stream = host_stream_or_throw(stream, "count_nonfinite_async");
  check_nonfinite_args("HostBackend::count_nonfinite_async", data, elements, dtype, result,
                       /*element_aligned=*/false);
  host_stream.enqueue([data = static_cast<const std::byte*>(data), elements, dtype, result] {
    std::uint64_t count = 0;
    for (std::size_t i = 0; i < elements; ++i) {
      if (dtype == DType::kFloat32) {
        std::uint32_t bits = 0;
        std::memcpy(&bits, data + 4 * i, 4);
        count += integrity::fp32_nonfinite(bits) ? 1 : 0;
      } else {
        std::uint16_t bits = 0;
        std::memcpy(&bits, data + 2 * i, 2);
        const bool bad = dtype == DType::kFloat16 ? integrity::fp16_nonfinite(bits)
                                                  : integrity::bf16_nonfinite(bits);
        count += bad ? 1 : 0;
      }
    }
    *result = count;
  });
}

void HostBackend::quantize_fp8_async(const void* src, DType dtype, std::size_t elements,
                                     std::size_t parts, void* dst, float* scales,
                                     Stream& stream) {
  HostStream& host_stream = host_stream_or_throw(stream, "quantize_fp8_async");
  check_quantize_fp8_args("HostBackend::quantize_fp8_async", src, dtype, elements, parts, dst,
                          scales);
  host_stream.enqueue([src = static_cast<const std::byte*>(src), dtype, elements, parts,
                       dst = static_cast<std::uint8_t*>(dst), scales] {
    const auto load = [&](std::size_t i) {
      if (dtype == DType::kFloat32) {
        float value;
        std::memcpy(&value, src + 4 * i, 4);
        return value;
      }
      std::uint16_t bits = 0;
      std::memcpy(&bits, src + 2 * i, 2);
      return dtype == DType::kBFloat16 ? fp8::bf16_to_float(bits) : fp8::fp16_to_float(bits);
    };
    const std::size_t per_part = elements / parts;
    for (std::size_t part = 0; part < parts; ++part) {
      const std::size_t begin = part * per_part;
      float amax = 0.0f;
      for (std::size_t i = begin; i < begin + per_part; ++i) {
        amax = std::max(amax, std::fabs(load(i)));
      }
      const float scale = fp8::scale_of(amax);
      const float inverse = 1.0f / scale;
      for (std::size_t i = begin; i < begin + per_part; ++i) {
        dst[i] = fp8::quantize(load(i), inverse);
      }
      scales[part] = scale;
    }
  });
}

std::unique_ptr<StreamGate> HostBackend::create_stream_gate() {
  return std::make_unique<HostStreamGate>();
}

void HostBackend::launch_async(Stream& stream, std::function<void()> task) {
  HostStream& host_stream = host_stream_or_throw(stream, "launch_async");
  if (!task) {
    throw Error(ErrorCode::kInvalidArgument, "HostBackend::launch_async: the task is empty");
  }
  host_stream.enqueue(std::move(task));
}

}  // namespace shadowsync
