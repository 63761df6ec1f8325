// What the update benchmark needs from a machine, beyond shadowsync's Backend and Transport: two
// "devices" (rank 0: the trainer's GPU; rank 1: the engine's GPU), transports between them, an
// engine stream, stream-ordered timestamps, a decode step and a memory probe. The benchmark's
// scenarios are written once against this; HostPlatform (below) runs them on the CPU for the smoke
// test, CudaPlatform (bench_gpu.cu) on two GPUs.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "shadowsync/backend.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"
#include "shadowsync/transport.h"

namespace shadowsync::bench {

struct TransportPair {
  TransportPair() = default;
  TransportPair(TransportPair&&) = default;
  TransportPair& operator=(TransportPair&&) = default;
  // Both ends at once (see destroy_pair): never one after the other on one thread.
  ~TransportPair() {
    if (rank0 && rank1) destroy_pair(rank0, rank1);
  }

  std::unique_ptr<Transport> rank0;  // the sender's (trainer's) end
  std::unique_ptr<Transport> rank1;  // the receiver's (engine's) end
};

// A point in a stream's work, time-stamped when the stream reaches it (a CUDA event with timing;
// a host task that reads the clock).
class Stamp {
 public:
  virtual ~Stamp() = default;
  virtual void record(Stream& stream) = 0;
  // Waits (hot, bounded) until the stream passed the recorded point; throws on timeout.
  virtual void wait(const std::string& what) = 0;
  // Milliseconds from `earlier` to this stamp; both recorded on the same device and completed.
  virtual double ms_since(Stamp& earlier) = 0;
};

struct PriorityRange {
  int least = 0;     // the lowest priority (numerically greatest); CudaBackend's kLow
  int greatest = 0;  // the highest priority (numerically least)
};

class Platform {
 public:
  virtual ~Platform() = default;

  virtual bool is_gpu() const = 0;
  virtual std::string machine() const = 0;      // "NVIDIA H200" or "host (N cores)"
  virtual Json machine_detail() const = 0;      // what else is worth stamping
  virtual Backend& backend(int rank) = 0;       // 0: sender device, 1: receiver/engine device

  // A fresh communicator of two ranks (rank r on device r). max_ctas: NcclTransportConfig's
  // bound, 0 = NCCL's default (ignored by the loopback transport).
  virtual TransportPair make_transports(int max_ctas) = 0;

  // A stream of the engine's device for the engine's steps: default priority, or raised (the
  // device's greatest priority).
  virtual std::unique_ptr<Stream> make_engine_stream(bool raised_priority) = 0;
  virtual PriorityRange priority_range() const = 0;

  virtual std::unique_ptr<Stamp> make_stamp(int rank) = 0;

  // Keeps `stream` (of rank 1) busy for `duration`, so that work enqueued right after it is all
  // queued before the device reaches it: stamps around it then time the device, not the host.
  virtual void hold(Stream& stream, std::chrono::microseconds duration) = 0;

  // One memory-bound decode step on `stream` (rank 1): reads `bytes` bytes at `data` (16-byte
  // aligned, multiple of 16) and reduces them.
  virtual void decode(Stream& stream, const std::byte* data, std::size_t bytes) = 0;

  // Enqueues a plain device-to-device copy of `bytes` on `stream` (rank 1): the reference the
  // copy_in swap is judged against (cudaMemcpyAsync on a GPU).
  virtual void device_copy(Stream& stream, std::byte* dst, const std::byte* src, std::size_t bytes) = 0;

  // Fills device memory of `rank` with non-zero data (a hash of the index and the seed) and waits.
  virtual void fill(int rank, std::byte* data, std::size_t bytes, std::uint64_t seed) = 0;

  // Free device memory of `rank` (cudaMemGetInfo); nothing where there is no such thing.
  virtual std::optional<std::size_t> free_bytes(int rank) = 0;
};

// ---------------------------------------------------------------------------------------------
// The CPU platform: two HostBackends and a loopback transport. Its figures are CPU smoke figures,
// nothing a GPU would show; it is there so that every scenario runs in CI.
// ---------------------------------------------------------------------------------------------
class HostPlatform final : public Platform {
 public:
  HostPlatform() = default;

  bool is_gpu() const override { return false; }
  std::string machine() const override {
    return cat("host CPU (", std::thread::hardware_concurrency(), " hardware threads)");
  }
  Json machine_detail() const override {
    return Json::object()
        .set("backend", "host")
        .set("transport", "loopback")
        .set("hardware_threads", std::thread::hardware_concurrency());
  }
  Backend& backend(int rank) override { return rank == 0 ? backend0_ : backend1_; }

  TransportPair make_transports(int /*max_ctas*/) override {
    LoopbackCommunicator communicator(2);  // the transports keep its state alive
    TransportPair pair;
    pair.rank0 = communicator.transport(0);
    pair.rank1 = communicator.transport(1);
    return pair;
  }

  std::unique_ptr<Stream> make_engine_stream(bool /*raised_priority*/) override {
    return backend1_.create_stream(StreamPriority::kNormal);  // host streams have no priority
  }
  PriorityRange priority_range() const override { return {}; }

  std::unique_ptr<Stamp> make_stamp(int rank) override {
    return std::make_unique<HostStamp>(rank == 0 ? backend0_ : backend1_);
  }

  void hold(Stream& stream, std::chrono::microseconds duration) override {
    backend1_.launch_async(stream, [duration] { std::this_thread::sleep_for(duration); });
  }

  void decode(Stream& stream, const std::byte* data, std::size_t bytes) override {
    std::atomic<std::uint64_t>* sink = &sink_;
    backend1_.launch_async(stream, [data, bytes, sink] {
      std::uint64_t sum = 0;
      for (std::size_t i = 0; i + 8 <= bytes; i += 8) {
        std::uint64_t word;
        std::memcpy(&word, data + i, 8);
        sum += word;
      }
      sink->fetch_add(sum, std::memory_order_relaxed);
    });
  }

  void device_copy(Stream& stream, std::byte* dst, const std::byte* src, std::size_t bytes) override {
    backend1_.memcpy_async(dst, src, bytes, stream);
  }

  void fill(int /*rank*/, std::byte* data, std::size_t bytes, std::uint64_t seed) override {
    // Host memory: written directly. Bytes of finite bf16 values, as the GPU fill writes.
    for (std::size_t i = 0; i + 2 <= bytes; i += 2) {
      std::uint64_t x = (i / 2 + 1) * 0x9E3779B97F4A7C15ull ^ seed;
      x ^= x >> 29;
      const std::uint16_t value = static_cast<std::uint16_t>(0x3C00u | (x & 0x03FFu));
      std::memcpy(data + i, &value, 2);
    }
  }

  std::optional<std::size_t> free_bytes(int /*rank*/) override { return std::nullopt; }

 private:
  class HostStamp final : public Stamp {
   public:
    explicit HostStamp(HostBackend& backend)
        : backend_(backend), done_(backend.create_event()),
          time_(std::make_shared<std::atomic<std::int64_t>>(0)) {}
    void record(Stream& stream) override {
      auto time = time_;
      backend_.launch_async(stream, [time] {
        time->store(Clock::now().time_since_epoch().count(), std::memory_order_release);
      });
      backend_.event_record(*done_, stream);
    }
    void wait(const std::string& what) override { hot_wait(backend_, *done_, what); }
    double ms_since(Stamp& earlier) override {
      auto& other = dynamic_cast<HostStamp&>(earlier);
      const auto ticks = time_->load(std::memory_order_acquire) -
                         other.time_->load(std::memory_order_acquire);
      return to_ms(Clock::duration(ticks));
    }

   private:
    HostBackend& backend_;
    std::unique_ptr<Event> done_;
    std::shared_ptr<std::atomic<std::int64_t>> time_;
  };

  HostBackend backend0_;
  HostBackend backend1_;
  std::atomic<std::uint64_t> sink_{0};
};

}  // namespace shadowsync::bench
