// A Backend that counts the calls made to it. Tests only.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string_view>

#include "shadowsync/backend.h"
#include "shadowsync/host_backend.h"

namespace shadowsync::testing {

// Forwards to a HostBackend (and reports its name) and counts every call: for tests that
// require none (the step hook's fast path; a config refused before anything is done).
class CountingBackend final : public Backend {
 public:
  std::atomic<int> calls{0};
  HostBackend inner;

  std::string_view name() const override { return inner.name(); }
  void* allocate(std::size_t bytes) override { return ++calls, inner.allocate(bytes); }
  void deallocate(void* p) noexcept override { ++calls, inner.deallocate(p); }
  std::size_t bytes_allocated() const override { return inner.bytes_allocated(); }
  std::unique_ptr<Stream> create_stream(StreamPriority p) override {
    return ++calls, inner.create_stream(p);
  }
  std::unique_ptr<Event> create_event() override { return ++calls, inner.create_event(); }
  void memcpy_async(void* d, const void* s, std::size_t n, Stream& st) override {
    ++calls, inner.memcpy_async(d, s, n, st);
  }
  void event_record(Event& e, Stream& s) override { ++calls, inner.event_record(e, s); }
  void stream_wait_event(Stream& s, Event& e) override { ++calls, inner.stream_wait_event(s, e); }
  bool event_query(Event& e) override { return ++calls, inner.event_query(e); }
  bool event_wait_for(Event& e, std::chrono::nanoseconds t) override {
    return ++calls, inner.event_wait_for(e, t);
  }
  void stream_synchronize(Stream& s) override { ++calls, inner.stream_synchronize(s); }
};

}  // namespace shadowsync::testing
