// What the update benchmark needs from a machine, beyond shadowsync's Backend and Transport: two
// "devices" (rank 0: the trainer's GPU; rank 1: the engine's GPU), transports between them, an
// engine stream, stream-ordered timestamps, a decode step and a memory probe. The benchmark's
// scenarios are written once against this; the host platform (bench_host_platform.h) runs them on
// the CPU for the smoke test, CudaPlatform (bench_gpu.cu) on two GPUs.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench_common.h"
#include "shadowsync/backend.h"
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

}  // namespace shadowsync::bench
