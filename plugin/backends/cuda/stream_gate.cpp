#include "backends/cuda/stream_gate.h"

#include <atomic>
#include <chrono>
#include <exception>

#include <fmt/format.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_driver.h"
#include "backends/cuda/scoped_device.h"
#include "shadowsync/error.h"

namespace shadowsync::cuda_detail {

StreamGate::StreamGate(int device) : device_(device) {
  const ScopedDeviceNoThrow on_device(device);
  const DriverApi& d = driver_api();
  if (d.stream_wait_value32 == nullptr) {
    throw Error(ErrorCode::kBackend,
                fmt::format("stream gate: the driver has no cuStreamWaitValue32 ({})", d.missing));
  }
  void* word = nullptr;
  SHADOWSYNC_CUDA_CHECK(cudaHostAlloc(&word, sizeof(std::uint32_t),
                                      cudaHostAllocMapped | cudaHostAllocPortable),
                        "stream gate word, device={}", device);
  word_ = static_cast<std::uint32_t*>(word);
  *word_ = 0;
  const cudaError_t mapped = cudaHostGetDevicePointer(&word_on_device_, word, 0);
  if (mapped != cudaSuccess) {
    (void)cudaFreeHost(word);
    throw_cuda_error(mapped, "cudaHostGetDevicePointer", fmt::format("device={}", device),
                     __FILE__, __LINE__);
  }
  thread_ = std::thread([this] { run(); });
}

StreamGate::~StreamGate() {
  const ScopedDeviceNoThrow on_device(device_);
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();  // runs what is queued first: every gate is open after this
  // A stream may not have reached its (open) gate yet; the word must outlive that read.
  for (const auto& [stream, event] : passed_) {
    if (event == nullptr) continue;  // its creation failed: enqueue said so
    (void)cudaEventSynchronize(event);
    (void)cudaEventDestroy(event);
  }
  (void)cudaFreeHost(word_);
  clear_last_error();
}

void StreamGate::enqueue(cudaStream_t stream, std::function<void()> task) {
  const ScopedDeviceNoThrow on_device(device_);  // the engine thread keeps its current device
  cudaEvent_t before = nullptr;
  SHADOWSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&before, cudaEventDisableTiming),
                        "stream gate event");
  std::unique_lock lock(mutex_);  // numbers and the streams' waits in the same order
  const std::uint32_t number = enqueued_ + 1;
  const cudaError_t recorded = cudaEventRecord(before, stream);
  const CUresult waiting =
      recorded != cudaSuccess
          ? CUDA_SUCCESS
          : driver_api().stream_wait_value32(reinterpret_cast<CUstream>(stream),
                                             reinterpret_cast<CUdeviceptr>(word_on_device_),
                                             number, CU_STREAM_WAIT_VALUE_GEQ);
  if (recorded != cudaSuccess || waiting != CUDA_SUCCESS) {  // nothing is gated
    lock.unlock();
    (void)cudaEventDestroy(before);
    if (recorded != cudaSuccess) {
      throw_cuda_error(recorded, "cudaEventRecord", "stream gate, before the gate", __FILE__,
                       __LINE__);
    }
    check_driver(waiting, "cuStreamWaitValue32", fmt::format("stream gate number={}", number));
  }
  // The stream waits now: from here on the task is queued whatever fails, so that its gate opens.
  enqueued_ = number;
  queue_.push_back(Task{before, number, std::move(task)});
  cudaEvent_t& passed = passed_[stream];
  cudaError_t marked = passed == nullptr
                           ? cudaEventCreateWithFlags(&passed, cudaEventDisableTiming)
                           : cudaSuccess;
  if (marked == cudaSuccess) marked = cudaEventRecord(passed, stream);
  lock.unlock();
  changed_.notify_all();
  if (marked != cudaSuccess) {
    throw_cuda_error(marked, "cudaEventRecord", "stream gate, after the gate", __FILE__, __LINE__);
  }
}

void StreamGate::drain() {
  std::unique_lock lock(mutex_);
  const std::uint32_t target = enqueued_;
  changed_.wait(lock, [&] { return done_ >= target; });
}

std::string StreamGate::take_error() {
  std::lock_guard lock(mutex_);
  std::string error;
  error.swap(error_);
  return error;
}

std::int64_t StreamGate::last_gate_ns() const {
  std::lock_guard lock(mutex_);
  return last_gate_ns_;
}

void StreamGate::open(std::uint32_t number) {
  // The GPU reads the word from host memory: a plain release store reaches it.
  std::atomic_ref<std::uint32_t>(*word_).store(number, std::memory_order_release);
}

void StreamGate::run() {
  (void)cudaSetDevice(device_);
  for (;;) {
    Task task;
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::string failure;
    std::chrono::steady_clock::time_point reached{};
    if (task.before != nullptr) {
      const cudaError_t waited = cudaEventSynchronize(task.before);
      reached = std::chrono::steady_clock::now();
      if (waited != cudaSuccess) {
        failure = fmt::format("stream gate {}: waiting for the work before it failed: {}",
                              task.number, cudaGetErrorName(waited));
        clear_last_error();
      } else if (task.work) {
        try {
          task.work();
        } catch (const std::exception& e) {
          failure = e.what();
        } catch (...) {
          failure = fmt::format("stream gate {}: the task threw", task.number);
        }
      }
      (void)cudaEventDestroy(task.before);
    }
    open(task.number);
    const auto opened = std::chrono::steady_clock::now();
    {
      std::lock_guard lock(mutex_);
      done_ = task.number;
      if (task.before != nullptr) {
        last_gate_ns_ =
            std::chrono::duration_cast<std::chrono::nanoseconds>(opened - reached).count();
      }
      if (!failure.empty() && error_.empty()) error_ = std::move(failure);
    }
    changed_.notify_all();
  }
}

}  // namespace shadowsync::cuda_detail
