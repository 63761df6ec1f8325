// CudaBackend's stream gate: the stream waits (cuStreamWaitValue32) until a word in pinned,
// mapped host memory reaches the gate's number; open() writes the number with a plain store. The
// word's wait holds the stream's hardware queue while the gate is closed, so the gate stays closed
// only as long as the remap it guards (about a millisecond at 16 GB).
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_driver.h"
#include "backends/cuda/scoped_device.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/error.h"

namespace shadowsync {
namespace {

using cuda_detail::ScopedDeviceNoThrow;

class CudaStreamGate final : public StreamGate {
 public:
  explicit CudaStreamGate(int device) : device_(device) {
    const ScopedDeviceNoThrow on_device(device);
    if (cuda_detail::driver_api().stream_wait_value32 == nullptr) {
      throw Error(ErrorCode::kBackend,
                  fmt::format("stream gate on device {}: the driver has no cuStreamWaitValue32 "
                              "({})",
                              device, cuda_detail::driver_api().missing));
    }
    void* word = nullptr;
    SHADOWSYNC_CUDA_CHECK(cudaHostAlloc(&word, sizeof(std::uint32_t),
                                        cudaHostAllocMapped | cudaHostAllocPortable),
                          "stream gate word, device={}", device);
    word_ = static_cast<std::uint32_t*>(word);
    *word_ = 0;
    try {
      SHADOWSYNC_CUDA_CHECK(cudaHostGetDevicePointer(&word_on_device_, word, 0),
                            "stream gate word, device={}", device);
      SHADOWSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&before_, cudaEventDisableTiming),
                            "stream gate event, device={}", device);
      SHADOWSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&passed_, cudaEventDisableTiming),
                            "stream gate event, device={}", device);
    } catch (...) {
      release();
      throw;
    }
  }

  // Opens the gate, then waits until the stream has read the word for the last time: the
  // memory must outlive that read.
  ~CudaStreamGate() override {
    open();
    const ScopedDeviceNoThrow on_device(device_);
    if (closed_.load() > 0) (void)cudaEventSynchronize(passed_);
    release();
  }

  void close(Stream& stream) override {
    if (CudaBackend::device_of(stream) != device_) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("stream gate: the stream belongs to device {}, the gate to {}",
                              CudaBackend::device_of(stream), device_));
    }
    const ScopedDeviceNoThrow on_device(device_);  // the engine thread keeps its current device
    const cudaStream_t native = CudaBackend::native(stream);
    const std::uint32_t number = closed_.load(std::memory_order_relaxed) + 1;
    SHADOWSYNC_CUDA_CHECK(cudaEventRecord(before_, native), "stream gate {}, before it", number);
    cuda_detail::check_driver(
        cuda_detail::driver_api().stream_wait_value32(
            reinterpret_cast<CUstream>(native), reinterpret_cast<CUdeviceptr>(word_on_device_),
            number, CU_STREAM_WAIT_VALUE_GEQ),
        "cuStreamWaitValue32", fmt::format("stream gate number={}", number));
    // From here the stream waits: whatever fails below, open() must find this number.
    closed_.store(number, std::memory_order_release);
    SHADOWSYNC_CUDA_CHECK(cudaEventRecord(passed_, native), "stream gate {}, after it", number);
  }

  bool wait_work_before(std::chrono::nanoseconds timeout) override {
    const ScopedDeviceNoThrow on_device(device_);
    using Clock = std::chrono::steady_clock;
    if (timeout == std::chrono::nanoseconds::max()) {
      const cudaError_t waited = cudaEventSynchronize(before_);
      if (waited != cudaSuccess) {
        cuda_detail::clear_last_error();
        throw Error(ErrorCode::kBackend,
                    fmt::format("stream gate: waiting for the work before it failed: {}",
                                cudaGetErrorName(waited)));
      }
      return true;
    }
    const Clock::time_point deadline = Clock::now() + timeout;
    for (;;) {
      const cudaError_t state = cudaEventQuery(before_);
      if (state == cudaSuccess) return true;
      if (state != cudaErrorNotReady) {
        cuda_detail::clear_last_error();
        throw Error(ErrorCode::kBackend,
                    fmt::format("stream gate: querying the work before it failed: {}",
                                cudaGetErrorName(state)));
      }
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void open() noexcept override {
    // The GPU reads the word from host memory: a release store reaches it.
    std::atomic_ref<std::uint32_t>(*word_).store(closed_.load(std::memory_order_acquire),
                                                 std::memory_order_release);
  }

 private:
  void release() noexcept {
    if (passed_ != nullptr) (void)cudaEventDestroy(passed_);
    if (before_ != nullptr) (void)cudaEventDestroy(before_);
    if (word_ != nullptr) (void)cudaFreeHost(word_);
    passed_ = before_ = nullptr;
    word_ = nullptr;
    cuda_detail::clear_last_error();
  }

  int device_ = 0;
  std::uint32_t* word_ = nullptr;   // pinned, mapped; open() writes it
  void* word_on_device_ = nullptr;  // the same word as the GPU reads it
  cudaEvent_t before_ = nullptr;    // the work before the gate
  cudaEvent_t passed_ = nullptr;    // right after the last gate: the stream read the word
  std::atomic<std::uint32_t> closed_{0};  // the number of the last gate closed
};

}  // namespace

std::unique_ptr<StreamGate> CudaBackend::create_stream_gate() {
  return std::make_unique<CudaStreamGate>(device());
}

}  // namespace shadowsync
