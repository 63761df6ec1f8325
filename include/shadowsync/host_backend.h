// HostBackend: the Backend semantics on the CPU. A stream is an in-order executor thread; an
// event marks a point in a stream's work and can be queried, waited on by the host and waited on
// by another stream. Nothing runs synchronously at enqueue time, so a missing event wait shows up
// as a real race in tests.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "shadowsync/backend.h"

namespace shadowsync {

struct HostBackendOptions {
  // Each stream task first sleeps a random time in [0, max_task_jitter]: a stress knob that
  // shuffles interleavings between streams. Zero (the default) adds nothing.
  std::chrono::microseconds max_task_jitter{0};
  std::uint64_t jitter_seed = 1;
};

class HostBackend final : public Backend {
 public:
  explicit HostBackend(HostBackendOptions options = {});
  ~HostBackend() override;

  std::string_view name() const override { return "host"; }
  void* allocate(std::size_t bytes) override;
  void deallocate(void* ptr) noexcept override;
  std::size_t bytes_allocated() const override;

  std::unique_ptr<Stream> create_stream(StreamPriority priority) override;
  std::unique_ptr<Event> create_event() override;

  void memcpy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) override;
  void memcpy_2d_async(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                       std::size_t row_bytes, std::size_t rows, Stream& stream) override;
  void event_record(Event& event, Stream& stream) override;
  void stream_wait_event(Stream& stream, Event& event) override;
  bool event_query(Event& event) override;
  bool event_wait_for(Event& event, std::chrono::nanoseconds timeout) override;
  void stream_synchronize(Stream& stream) override;

  // Integrity checks as stream tasks, computed word by word on the stream's thread.
  bool supports_integrity() const override { return true; }
  void checksum_async(const void* data, std::size_t bytes, std::uint64_t* result,
                      Stream& stream) override;
  void count_nonfinite_async(const void* data, std::size_t elements, DType dtype,
                             std::uint64_t* result, Stream& stream) override;
  // Per-tensor FP8 quantization (Backend::quantize_fp8_async), element by element on the stream's thread.
  void quantize_fp8_async(const void* src, DType dtype, std::size_t elements, std::size_t parts,
                          void* dst, float* scales, Stream& stream) override;

  // A gate is a task that holds the stream's thread until open().
  std::unique_ptr<StreamGate> create_stream_gate() override;

  // Enqueues arbitrary host work on a stream (the CPU counterpart of a kernel launch). The task
  // runs on the stream's thread, in order with the stream's other work. Thread-safe per stream.
  void launch_async(Stream& stream, std::function<void()> task);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shadowsync
