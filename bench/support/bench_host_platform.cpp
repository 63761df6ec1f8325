// The CPU platform: two HostBackends and a loopback transport (see bench_host_platform.h).
#include "bench_host_platform.h"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "bench_common.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"

namespace shadowsync::bench {
namespace {

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

}  // namespace

std::unique_ptr<Platform> make_host_platform() { return std::make_unique<HostPlatform>(); }

}  // namespace shadowsync::bench
