// The receiver's integrity checks on the CUDA backend, on one GPU. The checks run on a
// second stream of the receiver, each behind the event of the bucket it reads, so that they
// overlap the later buckets' transfer. What tests/integration/test_faults shows on the host
// backend, here with CUDA streams and events:
//  * 300 updates with new bytes each, checksums and the guard on: every one ready and the live
//    bytes equal the sent ones (a check that read a bucket before it landed would compute another
//    checksum, and the update would be refused);
//  * a sender checksum that does not match bucket k is refused naming bucket k, the live weights
//    unchanged; the next update applies;
//  * a NaN in the last element of a tensor that spans buckets is refused naming the tensor.
// A device-to-device copy per bucket stands in for NCCL (tests/support/device_copy_transport.h).
// Skips (77) without a GPU. A watchdog ends the process if anything hangs.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "device_copy_transport.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/receiver.h"
#include "shadowsync/update_header.h"
#include "watchdog.h"

namespace {

using namespace shadowsync;
using namespace shadowsync::testing;
using namespace std::chrono_literals;

#define REQUIRE_CUDA(call) REQUIRE((call) == cudaSuccess)

constexpr std::size_t kBucketBytes = 4u << 20;

// Tensors that straddle bucket boundaries, every floating dtype the guard checks, an adapter.
Layout check_layout() {
  return Layout::build({{"w0", DType::kBFloat16, {3000, 1024}, "base"},  // 6 MB: 2 buckets
                        {"w1", DType::kFloat32, {1500000}, "base"},
                        {"w2", DType::kInt8, {3333333}, "base"},
                        {"w3", DType::kFloat16, {1000, 2049}, "base"},
                        {"a.A", DType::kBFloat16, {64, 4096}, "lora"},
                        {"a.B", DType::kFloat32, {4096, 64}, "lora"}},
                       {.bucket_bytes = kBucketBytes});
}

// The trainer: one arena per group and the checksum block it would broadcast after them.
class Trainer {
 public:
  Trainer(const Layout& layout, CudaBackend& backend)
      : layout_(layout), backend_(backend), stream_(backend.create_stream(StreamPriority::kNormal)) {
    std::size_t buckets = 0;
    for (const auto& group : layout.groups()) {
      arenas_.emplace_back(backend, group.arena_bytes());
      buckets += group.bucket_count();
      groups_.push_back(group.name());
    }
    checksums_ = DeviceBuffer(backend, buckets * sizeof(std::uint64_t));
  }

  // Every byte `fill` (0x01..0x3f: finite in fp32, fp16 and bf16 alike); then `poison` if given.
  // The memset goes on the trainer's stream, the one the checksums run on: the backend's streams
  // do not wait for the legacy default stream, so a plain cudaMemset could still be writing
  // while a checksum (or a receiver's copy) read the bucket, and the update would be refused as
  // corrupted in transit (seen once in 300 updates on an H100).
  void fill(unsigned char value, const std::function<void()>& poison = {}) {
    for (std::size_t g = 0; g < arenas_.size(); ++g) {
      REQUIRE_CUDA(cudaMemsetAsync(arenas_[g].data(), value, arenas_[g].size(),
                                   CudaBackend::native(*stream_)));
    }
    backend_.stream_synchronize(*stream_);
    if (poison) {
      poison();
      // A cudaMemcpy from pageable memory may return before its DMA lands: wait for it.
      REQUIRE_CUDA(cudaDeviceSynchronize());
    }
    auto* sums = reinterpret_cast<std::uint64_t*>(checksums_.data());
    std::size_t n = 0;
    for (std::size_t g = 0; g < arenas_.size(); ++g) {
      const GroupLayout& group = layout_.groups()[g];
      for (std::size_t k = 0; k < group.bucket_count(); ++k) {
        const Bucket bucket = group.bucket(k);
        backend_.checksum_async(arenas_[g].data() + bucket.offset, bucket.bytes, sums + n++,
                                *stream_);
      }
    }
    backend_.stream_synchronize(*stream_);
  }

  // Queues every bucket and the checksum block on `transport`, in broadcast order.
  void queue(DeviceCopyTransport& transport) const {
    for (std::size_t g = 0; g < arenas_.size(); ++g) {
      const GroupLayout& group = layout_.groups()[g];
      for (std::size_t k = 0; k < group.bucket_count(); ++k) {
        transport.queue(arenas_[g].data() + group.bucket(k).offset);
      }
    }
    transport.queue(checksums_.data());
  }

  std::byte* arena(std::size_t g) { return arenas_[g].data(); }
  std::uint64_t* checksum_block() { return reinterpret_cast<std::uint64_t*>(checksums_.data()); }
  const std::vector<std::string>& groups() const { return groups_; }

 private:
  const Layout& layout_;
  CudaBackend& backend_;
  std::unique_ptr<Stream> stream_;
  std::vector<DeviceBuffer> arenas_;
  DeviceBuffer checksums_;
  std::vector<std::string> groups_;
};

std::vector<unsigned char> to_host(const std::byte* device, std::size_t bytes) {
  std::vector<unsigned char> host(bytes);
  REQUIRE_CUDA(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost));
  return host;
}

// A receiver with checksums and the guard on, its engine stream, and its reports.
struct Rig {
  explicit Rig(const Layout& layout)
      : layout(layout),
        backend(0),
        trainer(layout, backend),
        receiver(layout, backend, make_transport(), make_config()),
        engine(backend.create_stream(StreamPriority::kNormal)) {
    receiver.set_observer([this](const UpdateReport& report) {
      std::lock_guard lock(mutex);
      reports.push_back(report);
      changed.notify_all();
    });
  }

  std::unique_ptr<Transport> make_transport() {
    auto owned = std::make_unique<DeviceCopyTransport>();
    transport = owned.get();
    return owned;
  }
  static ReceiverConfig make_config() {
    ReceiverConfig config;
    config.root_rank = 0;
    config.require_checksums = true;
    config.reject_nonfinite = true;
    return config;
  }

  // Sends `version` from the trainer's arenas; returns its report (ready or failed).
  UpdateReport send(std::uint64_t version) {
    trainer.queue(*transport);
    receiver.begin_update(make_update_header(layout, version, trainer.groups(), true));
    std::unique_lock lock(mutex);
    const bool reported = changed.wait_for(lock, 30s, [&] {
      for (const auto& r : reports) {
        if (r.version == version) return true;
      }
      return false;
    });
    INFO("update " << version);
    REQUIRE(reported);
    for (const auto& r : reports) {
      if (r.version == version) return r;
    }
    FAIL("unreachable");
    return {};
  }

  void apply(std::uint64_t version) {
    REQUIRE(receiver.step_hook().before_step(*engine) == version);
    backend.stream_synchronize(*engine);
  }

  const Layout& layout;
  CudaBackend backend;
  Trainer trainer;
  DeviceCopyTransport* transport = nullptr;
  Receiver receiver;
  std::unique_ptr<Stream> engine;
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<UpdateReport> reports;
};

unsigned char fill_of(std::uint64_t version) { return static_cast<unsigned char>(1 + version % 63); }

}  // namespace

TEST_CASE("gpu receiver checks: 300 updates with new bytes each all pass, live equals sent") {
  Watchdog watchdog(240s);
  const Layout layout = check_layout();
  Rig rig(layout);
  for (std::uint64_t v = 1; v <= 300; ++v) {
    rig.trainer.fill(fill_of(v));
    const UpdateReport report = rig.send(v);
    INFO("update " << v << ": " << report.error);
    REQUIRE(report.outcome == UpdateOutcome::kReady);
    rig.apply(v);
    if (v % 50 == 0 || v == 1) {
      for (std::size_t g = 0; g < layout.groups().size(); ++g) {
        const std::size_t bytes = layout.groups()[g].arena_bytes();
        REQUIRE(to_host(rig.receiver.step_hook().live_arena(g), bytes) ==
                to_host(rig.trainer.arena(g), bytes));
      }
    }
  }
  CHECK(rig.receiver.stats().updates_failed == 0);
  watchdog.stop();
}

TEST_CASE("gpu receiver checks: a wrong checksum or a NaN is refused, the live bytes unchanged") {
  Watchdog watchdog(120s);
  const Layout layout = check_layout();
  Rig rig(layout);
  rig.trainer.fill(fill_of(1));
  REQUIRE(rig.send(1).outcome == UpdateOutcome::kReady);
  rig.apply(1);
  const std::size_t base_bytes = layout.groups()[0].arena_bytes();
  const std::vector<unsigned char> live_v1 = to_host(rig.receiver.step_hook().live_arena(0), base_bytes);

  SECTION("the sender's checksum of bucket 1 does not match") {
    rig.trainer.fill(fill_of(2));
    const std::uint64_t wrong = 12345;
    REQUIRE_CUDA(cudaMemcpy(rig.trainer.checksum_block() + 1, &wrong, sizeof wrong,
                            cudaMemcpyHostToDevice));
    REQUIRE_CUDA(cudaDeviceSynchronize());  // a pageable cudaMemcpy may return before it lands
    const UpdateReport report = rig.send(2);
    INFO(report.error);
    REQUIRE(report.outcome == UpdateOutcome::kFailed);
    CHECK(report.failed_group == "base");
    REQUIRE(report.failed_bucket.has_value());
    CHECK(*report.failed_bucket == 1);
  }
  SECTION("w0 (spanning two buckets) holds a NaN in its last element") {
    const TensorPlacement& w0 = layout.groups()[0].tensors()[0];
    REQUIRE(w0.spec.name == "w0");
    REQUIRE(w0.offset / kBucketBytes != (w0.offset + w0.bytes - 1) / kBucketBytes);
    rig.trainer.fill(fill_of(2), [&] {
      const std::uint16_t nan = 0x7fc1;  // bf16 quiet NaN
      REQUIRE_CUDA(cudaMemcpy(rig.trainer.arena(0) + w0.offset + w0.bytes - 2, &nan, 2,
                              cudaMemcpyHostToDevice));
    });
    const UpdateReport report = rig.send(2);
    INFO(report.error);
    REQUIRE(report.outcome == UpdateOutcome::kFailed);
    CHECK(report.failed_tensor == "w0");
  }
  // Still version 1, byte for byte; and the next good update applies.
  CHECK(rig.receiver.step_hook().before_step(*rig.engine) == std::nullopt);
  CHECK(to_host(rig.receiver.step_hook().live_arena(0), base_bytes) == live_v1);
  rig.trainer.fill(fill_of(3));
  REQUIRE(rig.send(3).outcome == UpdateOutcome::kReady);
  rig.apply(3);
  CHECK(to_host(rig.receiver.step_hook().live_arena(0), base_bytes) ==
        to_host(rig.trainer.arena(0), base_bytes));
  watchdog.stop();
}
