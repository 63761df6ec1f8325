// GPU smoke test of CudaBackend and NcclTransport: two ranks as two threads of this process,
// rank r on device r. Rank 0 fills 64 MiB with a pattern and broadcasts it in 4 buckets of 16 MiB
// (one NCCL group); rank 1 receives in place and checks every byte on the host. Also checks
// stream priorities, zero-filled allocation and the foreign-handle errors.
//
// A standalone program, not Catch2: exit 0 passes, 1 fails (with a message), 77 skips (fewer than
// two GPUs; ctest's SKIP_RETURN_CODE). Every wait has a deadline, and a watchdog ends the process
// if anything (NCCL included) hangs past the overall one.
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "watchdog.h"
#include "shadowsync/backend.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/error.h"
#include "shadowsync/nccl_transport.h"

namespace {

using namespace std::chrono_literals;
using shadowsync::CudaBackend;
using shadowsync::DeviceBuffer;
using shadowsync::Error;
using shadowsync::ErrorCode;
using shadowsync::NcclTransport;
using shadowsync::NcclTransportConfig;
using shadowsync::NcclUniqueId;
using shadowsync::StreamPriority;

constexpr int kWorldSize = 2;
constexpr std::size_t kTotalBytes = std::size_t{64} << 20;
constexpr int kBuckets = 4;
constexpr std::size_t kBucketBytes = kTotalBytes / kBuckets;  // 16 MiB
constexpr auto kWaitTimeout = 60s;                            // any single device wait
constexpr auto kWatchdogTimeout = 240s;  // the whole test, NCCL init and teardown included

// A pure function of the byte index, different in every bucket, so that a bucket landing at the
// wrong offset or a partial transfer shows up.
std::uint8_t pattern(std::size_t index) {
  const std::uint64_t x = (index + 1) * 0x9E3779B97F4A7C15ull;
  return static_cast<std::uint8_t>((x >> 56) ^ (x >> 17));
}

class TestFailure : public std::exception {
 public:
  explicit TestFailure(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

void check(bool condition, const std::string& message) {
  if (!condition) throw TestFailure(message);
}

// Concatenates its arguments as ostream prints them. (No fmt here: a test needs only what the
// library's public interface brings.)
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

std::string hex(std::uint8_t byte) {
  char text[8];
  std::snprintf(text, sizeof text, "0x%02x", static_cast<unsigned>(byte));
  return text;
}

void wait_or_fail(CudaBackend& backend, shadowsync::Event& event, const char* what) {
  if (!backend.event_wait_for(event, kWaitTimeout)) {
    throw TestFailure(cat("device ", backend.device(), ": ", what, " did not complete within ",
                          std::chrono::seconds(kWaitTimeout).count(), " s"));
  }
}

// Copies `bytes` from device memory to a host vector, bounded by kWaitTimeout.
std::vector<std::uint8_t> read_back(CudaBackend& backend, shadowsync::Stream& stream,
                                    const std::byte* device_ptr, std::size_t bytes) {
  std::vector<std::uint8_t> host(bytes);
  auto done = backend.create_event();
  backend.memcpy_async(host.data(), device_ptr, bytes, stream);
  backend.event_record(*done, stream);
  wait_or_fail(backend, *done, "device-to-host copy");
  return host;
}

void check_stream_priorities(CudaBackend& backend) {
  int least = 0;
  int greatest = 0;
  check(cudaDeviceGetStreamPriorityRange(&least, &greatest) == cudaSuccess,
        "cudaDeviceGetStreamPriorityRange failed");
  auto low = backend.create_stream(StreamPriority::kLow);
  auto normal = backend.create_stream(StreamPriority::kNormal);
  int low_priority = 12345;
  int normal_priority = 12345;
  check(cudaStreamGetPriority(CudaBackend::native(*low), &low_priority) == cudaSuccess,
        "cudaStreamGetPriority(low) failed");
  check(cudaStreamGetPriority(CudaBackend::native(*normal), &normal_priority) == cudaSuccess,
        "cudaStreamGetPriority(normal) failed");
  check(low_priority == least,
        cat("device ", backend.device(), ": the kLow stream has priority ", low_priority,
            ", want the lowest, ", least, " (range: ", least, " lowest, ", greatest, " highest)"));
  check(normal_priority == 0, cat("device ", backend.device(), ": the kNormal stream has priority ",
                                  normal_priority, ", want the default 0"));
  unsigned int flags = 0;
  check(cudaStreamGetFlags(CudaBackend::native(*low), &flags) == cudaSuccess &&
            (flags & cudaStreamNonBlocking) != 0,
        cat("device ", backend.device(), ": the kLow stream is not non-blocking (flags ", flags,
            ")"));
}

// Checks that handles not made by a CudaBackend are refused with kInvalidArgument.
void check_foreign_handles() {
  struct ForeignStream final : shadowsync::Stream {};
  struct ForeignEvent final : shadowsync::Event {};
  ForeignStream stream;
  ForeignEvent event;
  try {
    (void)CudaBackend::native(stream);
    throw TestFailure("CudaBackend::native accepted a foreign Stream");
  } catch (const Error& e) {
    check(e.code() == ErrorCode::kInvalidArgument,
          cat("foreign Stream: want kInvalidArgument, got '", e.what(), "'"));
  }
  try {
    (void)CudaBackend::native(event);
    throw TestFailure("CudaBackend::native accepted a foreign Event");
  } catch (const Error& e) {
    check(e.code() == ErrorCode::kInvalidArgument,
          cat("foreign Event: want kInvalidArgument, got '", e.what(), "'"));
  }
}

void run_rank(int rank, const NcclUniqueId& id) {
  const int device = rank;
  CudaBackend backend(device);
  check_stream_priorities(backend);

  auto stream = backend.create_stream(StreamPriority::kLow);  // as the receiver's stream
  auto done = backend.create_event();
  check(backend.event_query(*done), "an event never recorded must count as complete");

  DeviceBuffer buffer(backend, kTotalBytes);
  check(backend.bytes_allocated() == kTotalBytes,
        cat("device ", device, ": bytes_allocated ", backend.bytes_allocated(),
            " after allocating ", kTotalBytes));

  // allocate() zero-fills: look at the first and the last 4 KiB.
  constexpr std::size_t kProbe = 4096;
  for (std::size_t offset : {std::size_t{0}, kTotalBytes - kProbe}) {
    const std::vector<std::uint8_t> probe =
        read_back(backend, *stream, buffer.data() + offset, kProbe);
    for (std::size_t i = 0; i < kProbe; ++i) {
      if (probe[i] != 0) {
        throw TestFailure(cat("device ", device, ": fresh allocation byte ", offset + i, " is ",
                              hex(probe[i]), ", want 0"));
      }
    }
  }

  std::vector<std::uint8_t> source;
  if (rank == 0) {
    source.resize(kTotalBytes);
    for (std::size_t i = 0; i < kTotalBytes; ++i) source[i] = pattern(i);
    // Same stream as the broadcast, so stream order puts the fill before the send.
    backend.memcpy_async(buffer.data(), source.data(), kTotalBytes, *stream);
  }

  NcclTransportConfig config;
  config.init_timeout = 60s;
  config.enqueue_timeout = 60s;
  config.finalize_timeout = 30s;
  std::unique_ptr<NcclTransport> transport =
      NcclTransport::create(id, rank, kWorldSize, device, config);
  check(transport->rank() == rank && transport->world_size() == kWorldSize,
        "transport reports the wrong rank or world size");

  try {
    transport->group_begin();
    try {
      for (int k = 0; k < kBuckets; ++k) {
        transport->broadcast_async(buffer.data() + static_cast<std::size_t>(k) * kBucketBytes,
                                   kBucketBytes, /*root=*/0, *stream);
      }
    } catch (...) {
      try {
        transport->group_end();  // owed to NCCL even after a failed broadcast
      } catch (...) {
      }
      throw;
    }
    transport->group_end();
    backend.event_record(*done, *stream);
    wait_or_fail(backend, *done, "the bucketed broadcast");
  } catch (...) {
    transport->abort();  // let the other rank's kernels exit instead of waiting on us
    throw;
  }
  if (std::optional<std::string> error = transport->async_error()) {
    throw TestFailure(cat("rank ", rank, ": NCCL reports an error after the broadcast: ", *error));
  }

  if (rank == 1) {
    const std::vector<std::uint8_t> received =
        read_back(backend, *stream, buffer.data(), kTotalBytes);
    std::size_t mismatches = 0;
    std::size_t first = 0;
    for (std::size_t i = 0; i < kTotalBytes; ++i) {
      if (received[i] != pattern(i)) {
        if (mismatches++ == 0) first = i;
      }
    }
    check(mismatches == 0, cat("rank 1: ", mismatches, " of ", kTotalBytes,
                               " received bytes differ; first at "
                               "offset ",
                               first, " (bucket ", first / kBucketBytes, "): got ",
                               hex(received[first]), ", want ", hex(pattern(first))));
  } else {
    // The root's buffer is only read by an in-place broadcast: it must still hold the pattern.
    const std::vector<std::uint8_t> sent = read_back(backend, *stream, buffer.data(), kTotalBytes);
    for (std::size_t i = 0; i < kTotalBytes; i += 4093) {
      if (sent[i] != pattern(i)) {
        throw TestFailure(cat("rank 0: the root's buffer changed at offset ", i));
      }
    }
  }
  transport.reset();  // ncclCommFinalize + ncclCommDestroy, bounded by finalize_timeout
}

}  // namespace

int main() {
  int device_count = 0;
  const cudaError_t status = cudaGetDeviceCount(&device_count);
  if (status != cudaSuccess || device_count < kWorldSize) {
    const std::string reason = status == cudaSuccess
                                   ? std::string()
                                   : cat(" (cudaGetDeviceCount: ", cudaGetErrorString(status), ")");
    std::printf("SKIP: needs 2 GPUs, found %d%s\n", status == cudaSuccess ? device_count : 0,
                reason.c_str());
    return 77;
  }

  // Ends the process if anything hangs past the overall deadline, NCCL calls included.
  shadowsync::testing::Watchdog watchdog(kWatchdogTimeout);

  std::array<std::string, kWorldSize> failures;
  try {
    check_foreign_handles();
    const NcclUniqueId id = NcclTransport::generate_unique_id();
    std::vector<std::thread> ranks;
    for (int rank = 0; rank < kWorldSize; ++rank) {
      ranks.emplace_back([rank, &id, &failures] {
        try {
          run_rank(rank, id);
        } catch (const std::exception& e) {
          failures[static_cast<std::size_t>(rank)] = e.what();
        } catch (...) {
          failures[static_cast<std::size_t>(rank)] = "unknown exception";
        }
      });
    }
    for (std::thread& t : ranks) t.join();
  } catch (const std::exception& e) {
    watchdog.stop();
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
  watchdog.stop();

  bool ok = true;
  for (int rank = 0; rank < kWorldSize; ++rank) {
    if (!failures[static_cast<std::size_t>(rank)].empty()) {
      std::fprintf(stderr, "FAIL: rank %d: %s\n", rank,
                   failures[static_cast<std::size_t>(rank)].c_str());
      ok = false;
    }
  }
  if (!ok) return 1;
  std::printf("PASS: %zu MiB broadcast from device 0 to device 1 in %d buckets of %zu MiB\n",
              kTotalBytes >> 20, kBuckets, kBucketBytes >> 20);
  return 0;
}
