// A Backend that counts the calls made to it. Tests only.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "shadowsync/backend.h"
#include "shadowsync/host_backend.h"

namespace shadowsync::testing {

// Forwards every call to a HostBackend (and reports its name) and counts them: for tests that
// require none (the step hook's fast path; a config refused before anything is done), and for
// tests that count the copies a swap enqueues (copy_calls, copy_bytes: the non-empty
// memcpy_async calls and their bytes). Either it owns its HostBackend or it wraps one the caller
// keeps alive (and may go on using directly: only calls through the wrapper count). Thread-safe
// as the backend it wraps. Not final: a test double that adds one capability (remap arenas in
// host memory, remap_host_backend.h) overrides only that.
class CountingBackend : public Backend {
 public:
  CountingBackend() : owned_(std::make_unique<HostBackend>()), inner_(*owned_) {}
  explicit CountingBackend(HostBackend& inner) : inner_(inner) {}

  std::atomic<int> calls{0};
  std::atomic<std::uint64_t> copy_calls{0};
  std::atomic<std::uint64_t> copy_bytes{0};

  HostBackend& inner() { return inner_; }

  std::string_view name() const override { return inner_.name(); }
  void* allocate(std::size_t bytes) override { return ++calls, inner_.allocate(bytes); }
  void deallocate(void* p) noexcept override { ++calls, inner_.deallocate(p); }
  std::size_t bytes_allocated() const override { return inner_.bytes_allocated(); }
  std::unique_ptr<Stream> create_stream(StreamPriority p) override {
    return ++calls, inner_.create_stream(p);
  }
  std::unique_ptr<Event> create_event() override { return ++calls, inner_.create_event(); }
  void memcpy_async(void* d, const void* s, std::size_t n, Stream& st) override {
    ++calls;
    inner_.memcpy_async(d, s, n, st);
    if (n == 0) return;  // enqueued nothing (and the inner backend accepted it)
    copy_calls.fetch_add(1);
    copy_bytes.fetch_add(n);
  }
  void memcpy_batch_async(const std::vector<CopyRegion>& copies, Stream& st) override {
    ++calls;
    inner_.memcpy_batch_async(copies, st);
    for (const CopyRegion& c : copies) {
      if (c.bytes == 0) continue;
      copy_calls.fetch_add(1);
      copy_bytes.fetch_add(c.bytes);
    }
  }
  void memcpy_2d_async(void* d, std::size_t dp, const void* s, std::size_t sp, std::size_t w,
                       std::size_t rows, Stream& st) override {
    ++calls;
    inner_.memcpy_2d_async(d, dp, s, sp, w, rows, st);
    if (w == 0 || rows == 0) return;
    copy_calls.fetch_add(1);
    copy_bytes.fetch_add(w * rows);
  }
  void event_record(Event& e, Stream& s) override { ++calls, inner_.event_record(e, s); }
  void stream_wait_event(Stream& s, Event& e) override { ++calls, inner_.stream_wait_event(s, e); }
  bool event_query(Event& e) override { return ++calls, inner_.event_query(e); }
  bool event_wait_for(Event& e, std::chrono::nanoseconds t) override {
    return ++calls, inner_.event_wait_for(e, t);
  }
  void stream_synchronize(Stream& s) override { ++calls, inner_.stream_synchronize(s); }

  bool supports_integrity() const override { return inner_.supports_integrity(); }
  void checksum_async(const void* data, std::size_t bytes, std::uint64_t* result,
                      Stream& s) override {
    ++calls, inner_.checksum_async(data, bytes, result, s);
  }
  void count_nonfinite_async(const void* data, std::size_t elements, DType dtype,
                             std::uint64_t* result, Stream& s) override {
    ++calls, inner_.count_nonfinite_async(data, elements, dtype, result, s);
  }
  std::string remap_unsupported_reason() const override {
    return inner_.remap_unsupported_reason();
  }
  std::unique_ptr<RemappableArena> create_remappable_arena(std::size_t bytes) override {
    return ++calls, inner_.create_remappable_arena(bytes);
  }
  std::unique_ptr<StreamGate> create_stream_gate() override {
    return ++calls, inner_.create_stream_gate();
  }

 private:
  std::unique_ptr<HostBackend> owned_;
  HostBackend& inner_;
};

}  // namespace shadowsync::testing
