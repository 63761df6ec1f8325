// A one-GPU stand-in for NCCL, for tests and benchmarks of what happens around a transfer (the
// swap strategies), not of the transfer: rank 1 of 2; each broadcast copies the next queued
// source (the trainer's bytes of that bucket, device memory) into the receiver's buffer with
// cudaMemcpyAsync on the receiver's stream (or with the copy function given at construction: a
// benchmark paces it to a link's rate). The caller queues one source per bucket, in broadcast
// order, before begin_update. CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <deque>
#include <functional>
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
  // Enqueues a copy of `bytes` from `source` to `destination` on `stream`; returns its error.
  using Copy = std::function<cudaError_t(void* destination, const void* source, std::size_t bytes,
                                         cudaStream_t stream)>;

  DeviceCopyTransport() = default;
  explicit DeviceCopyTransport(Copy copy) : copy_(std::move(copy)) {}

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
    const cudaStream_t native = CudaBackend::native(stream);
    const cudaError_t status =
        copy_ ? copy_(buffer, source, bytes, native)
              : cudaMemcpyAsync(buffer, source, bytes, cudaMemcpyDeviceToDevice, native);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error(ErrorCode::kTransport, std::string("the copy of a bucket failed: ") +
                                             cudaGetErrorString(status));
    }
  }
  std::optional<std::string> async_error() override { return std::nullopt; }
  void abort() noexcept override {}

  void queue(const void* source) {
    std::lock_guard lock(mutex_);
    sources_.push_back(source);
  }

 private:
  Copy copy_;
  std::mutex mutex_;
  std::deque<const void*> sources_;
};

}  // namespace shadowsync::testing
