// A one-GPU stand-in for NCCL, for tests and benchmarks of what happens around a transfer (the
// swap strategies), not of the transfer: rank 1 of 2; each broadcast copies the next queued
// source (the trainer's bytes of that bucket, device memory) into the receiver's buffer with
// cudaMemcpyAsync on the receiver's stream. The caller queues one source per bucket, in broadcast
// order, before begin_update. CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "shadowsync/cuda_backend.h"
#include "shadowsync/error.h"
#include "shadowsync/transport.h"

namespace shadowsync::testing {

class DeviceCopyTransport final : public Transport {
 public:
  std::string_view name() const override { return "device-copy (one GPU, tests and benchmarks)"; }
  int rank() const override { return 1; }
  int world_size() const override { return 2; }
  void broadcast_async(void* buffer, std::size_t bytes, int /*root*/, Stream& stream) override {
    const void* source = nullptr;
    {
      std::lock_guard lock(mutex_);
      if (sources_.empty()) throw Error(ErrorCode::kTransport, "no source queued for a bucket");
      source = sources_.front();
      sources_.pop_front();
    }
    if (cudaMemcpyAsync(buffer, source, bytes, cudaMemcpyDeviceToDevice,
                        CudaBackend::native(stream)) != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error(ErrorCode::kTransport, "cudaMemcpyAsync of a bucket failed");
    }
  }
  std::optional<std::string> async_error() override { return std::nullopt; }
  void abort() noexcept override {}

  void queue(const void* source) {
    std::lock_guard lock(mutex_);
    sources_.push_back(source);
  }

 private:
  std::mutex mutex_;
  std::deque<const void*> sources_;
};

}  // namespace shadowsync::testing
