// CudaBackend: the Backend interface on CUDA streams, events and device memory. See
// cuda_backend.h for the contract of each call.
#include "shadowsync/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <typeinfo>

#include <fmt/format.h>

#include "core/allocation_ledger.h"
#include "core/backend_cast.h"
#include "core/check_integrity_args.h"
#include "core/check_memcpy_args.h"
#include "backends/cuda/cuda_check.h"
#include "backends/cuda/fp8_kernels.h"
#include "backends/cuda/integrity_kernels.h"
#include "backends/cuda/scoped_device.h"
#include "shadowsync/error.h"

namespace shadowsync {

namespace {

class CudaStream final : public Stream {
 public:
  CudaStream(cudaStream_t handle, int device, bool owned) noexcept
      : handle_(handle), device_(device), owned_(owned) {}
  ~CudaStream() override {
    if (!owned_) return;
    cuda_detail::ScopedDeviceNoThrow device(device_);
    // Returns at once; CUDA releases the stream once its queued work completes.
    (void)cudaStreamDestroy(handle_);
    cuda_detail::clear_last_error();
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t handle() const noexcept { return handle_; }
  int device() const noexcept { return device_; }

 private:
  cudaStream_t handle_;
  int device_;
  bool owned_;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(cudaEvent_t handle, int device) noexcept : handle_(handle), device_(device) {}
  ~CudaEvent() override {
    cuda_detail::ScopedDeviceNoThrow device(device_);
    (void)cudaEventDestroy(handle_);
    cuda_detail::clear_last_error();
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  cudaEvent_t handle() const noexcept { return handle_; }
  int device() const noexcept { return device_; }

 private:
  cudaEvent_t handle_;
  int device_;
};

CudaStream& cuda_stream_or_throw(Stream& stream, const char* operation) {
  return backend_cast<CudaStream>(stream, "CudaBackend", operation, "stream");
}

CudaEvent& cuda_event_or_throw(Event& event, const char* operation) {
  return backend_cast<CudaEvent>(event, "CudaBackend", operation, "event");
}

// The special stream handles that name no stream object of their own.
bool is_special_stream(cudaStream_t stream) noexcept {
  return stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread;
}

// event_wait_for's back-off. The receiver waits for transfers of milliseconds and the engine for
// an update to land, so a few hundred microseconds of added latency is noise, while a hot spin
// would take a CPU core from the engine's own host threads for the whole transfer.
constexpr std::chrono::microseconds kSpinPhase{50};  // yield only, for short waits
constexpr std::chrono::microseconds kFirstSleep{20};
constexpr std::chrono::microseconds kLongestSleep{500};

}  // namespace

struct CudaBackend::State {
  int least_priority = 0;              // the lowest priority: numerically greatest
  int greatest_priority = 0;           // the highest priority: numerically least
  cudaStream_t zero_stream = nullptr;  // private, non-blocking: zero-fills new allocations
  AllocationLedger allocations;
};

CudaBackend::CudaBackend(int device) : device_(device), state_(std::make_unique<State>()) {
  int count = 0;
  SHADOWSYNC_CUDA_CHECK(cudaGetDeviceCount(&count), "CudaBackend(device={})", device);
  if (device < 0 || device >= count) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("CudaBackend: device {} does not exist; this process sees {} CUDA "
                            "device(s)",
                            device, count));
  }
  make_current();
  SHADOWSYNC_CUDA_CHECK(
      cudaDeviceGetStreamPriorityRange(&state_->least_priority, &state_->greatest_priority),
      "device={}", device_);
  SHADOWSYNC_CUDA_CHECK(cudaStreamCreateWithFlags(&state_->zero_stream, cudaStreamNonBlocking),
                        "device={}", device_);
}

CudaBackend::~CudaBackend() {
  cuda_detail::ScopedDeviceNoThrow device(device_);
  state_->allocations.free_all([](void* ptr) { (void)cudaFree(ptr); });
  if (state_->zero_stream != nullptr) (void)cudaStreamDestroy(state_->zero_stream);
  cuda_detail::clear_last_error();
}

void CudaBackend::make_current() const {
  SHADOWSYNC_CUDA_CHECK(cudaSetDevice(device_), "device={}", device_);
}

void* CudaBackend::allocate(std::size_t bytes) {
  if (bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "CudaBackend::allocate: size must be > 0, got 0");
  }
  make_current();
  void* ptr = nullptr;
  SHADOWSYNC_CUDA_CHECK(cudaMalloc(&ptr, bytes), "bytes={} device={} live_bytes={}", bytes, device_,
                        bytes_allocated());
  try {
    // Waiting on the private stream only: a device-wide sync would also wait for a posted NCCL
    // receive, which may spin until its sender arrives.
    SHADOWSYNC_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, state_->zero_stream),
                          "ptr={} bytes={} device={}", ptr, bytes, device_);
    SHADOWSYNC_CUDA_CHECK(cudaStreamSynchronize(state_->zero_stream), "device={}", device_);
    state_->allocations.record(ptr, bytes);
  } catch (...) {
    (void)cudaFree(ptr);
    cuda_detail::clear_last_error();
    throw;
  }
  return ptr;
}

void CudaBackend::deallocate(void* ptr) noexcept {
  if (ptr == nullptr) return;
  // Memory not in the book is leaked, not freed: it may be someone else's tensor.
  if (state_->allocations.release(ptr, "CudaBackend::deallocate") == 0) return;
  cuda_detail::ScopedDeviceNoThrow device(device_);
  const cudaError_t status = cudaFree(ptr);
  if (status != cudaSuccess) {
    std::fprintf(stderr, "shadowsync: CudaBackend::deallocate: cudaFree(%p) on device %d: %s\n",
                 ptr, device_, cudaGetErrorString(status));
  }
}

std::size_t CudaBackend::bytes_allocated() const {
  return state_->allocations.bytes_allocated();
}

std::unique_ptr<Stream> CudaBackend::create_stream(StreamPriority priority) {
  make_current();
  // cudaDeviceGetStreamPriorityRange's "least" priority is the numerically greatest value.
  const int value = priority == StreamPriority::kLow ? state_->least_priority : 0;
  cudaStream_t handle = nullptr;
  SHADOWSYNC_CUDA_CHECK(cudaStreamCreateWithPriority(&handle, cudaStreamNonBlocking, value),
                        "priority={} device={}", value, device_);
  try {
    return std::make_unique<CudaStream>(handle, device_, /*owned=*/true);
  } catch (...) {
    (void)cudaStreamDestroy(handle);
    throw;
  }
}

std::unique_ptr<Event> CudaBackend::create_event() {
  make_current();
  cudaEvent_t handle = nullptr;
  SHADOWSYNC_CUDA_CHECK(cudaEventCreateWithFlags(&handle, cudaEventDisableTiming), "device={}",
                        device_);
  try {
    return std::make_unique<CudaEvent>(handle, device_);
  } catch (...) {
    (void)cudaEventDestroy(handle);
    throw;
  }
}

std::unique_ptr<Stream> CudaBackend::wrap_stream(CudaStreamHandle stream) {
  make_current();
#if CUDART_VERSION >= 12080
  if (!is_special_stream(stream)) {
    int stream_device = -1;
    SHADOWSYNC_CUDA_CHECK(cudaStreamGetDevice(stream, &stream_device), "stream={} device={}",
                          static_cast<void*>(stream), device_);
    if (stream_device != device_) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("CudaBackend::wrap_stream: stream {} belongs to device {}, this "
                              "backend to device {}",
                              static_cast<void*>(stream), stream_device, device_));
    }
  }
#else
  (void)is_special_stream;
#endif
  return std::make_unique<CudaStream>(stream, device_, /*owned=*/false);
}

void CudaBackend::memcpy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) {
  CudaStream& cuda_stream = cuda_stream_or_throw(stream, "memcpy_async");
  if (bytes == 0) return;
  check_memcpy_args("CudaBackend::memcpy_async", dst, src, bytes);
  make_current();
  SHADOWSYNC_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cuda_stream.handle()),
                        "dst={} src={} bytes={} stream={} device={}", dst, src, bytes,
                        static_cast<void*>(cuda_stream.handle()), device_);
}

void CudaBackend::memcpy_batch_async(const std::vector<CopyRegion>& copies, Stream& stream) {
  CudaStream& cuda_stream = cuda_stream_or_throw(stream, "memcpy_batch_async");
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<std::size_t> sizes;
  for (const CopyRegion& c : copies) {
    if (c.bytes == 0) continue;
    check_memcpy_args("CudaBackend::memcpy_batch_async", c.dst, c.src, c.bytes);
    dsts.push_back(c.dst);
    srcs.push_back(c.src);
    sizes.push_back(c.bytes);
  }
  if (dsts.empty()) return;
  make_current();
  cudaStream_t handle = cuda_stream.handle();
  if (is_special_stream(handle)) {
    // cudaMemcpyBatchAsync refuses the default streams (cudaErrorInvalidValue), which is
    // where an engine that never made a stream of its own (torch's default) runs: one copy each.
    Backend::memcpy_batch_async(copies, stream);
    return;
  }
  // One attribute for every copy: sources are read in stream order (they are the shadow, which
  // the receive wrote on another stream the engine stream already waited for).
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attributes.srcLocHint.type = cudaMemLocationTypeDevice;
  attributes.srcLocHint.id = device_;
  attributes.dstLocHint.type = cudaMemLocationTypeDevice;
  attributes.dstLocHint.id = device_;
  std::size_t first_index = 0;
  SHADOWSYNC_CUDA_CHECK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(),
                                             &attributes, &first_index, 1, handle),
                        "{} copies, first dst={} src={} bytes={}, device={}", dsts.size(),
                        dsts.front(), srcs.front(), sizes.front(), device_);
}

void CudaBackend::memcpy_2d_async(void* dst, std::size_t dst_pitch, const void* src,
                                  std::size_t src_pitch, std::size_t row_bytes, std::size_t rows,
                                  Stream& stream) {
  CudaStream& cuda_stream = cuda_stream_or_throw(stream, "memcpy_2d_async");
  if (row_bytes == 0 || rows == 0) return;
  check_memcpy_2d_args("CudaBackend::memcpy_2d_async", dst, dst_pitch, src, src_pitch, row_bytes,
                       rows);
  make_current();
  // One row: the pitches do not matter, and CUDA wants them at least the width.
  if (rows == 1) dst_pitch = src_pitch = row_bytes;
  SHADOWSYNC_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows,
                                          cudaMemcpyDefault, cuda_stream.handle()),
                        "dst={} dst_pitch={} src={} src_pitch={} row_bytes={} rows={} device={}",
                        dst, dst_pitch, src, src_pitch, row_bytes, rows, device_);
}

void CudaBackend::event_record(Event& event, Stream& stream) {
  CudaEvent& cuda_event = cuda_event_or_throw(event, "event_record");
  CudaStream& cuda_stream = cuda_stream_or_throw(stream, "event_record");
  if (cuda_event.device() != cuda_stream.device()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("CudaBackend::event_record: the event belongs to device {} and the "
                            "stream to device {}; CUDA records an event only on its own device",
                            cuda_event.device(), cuda_stream.device()));
  }
  make_current();
  SHADOWSYNC_CUDA_CHECK(cudaEventRecord(cuda_event.handle(), cuda_stream.handle()),
                        "event={} stream={} device={}", static_cast<void*>(cuda_event.handle()),
                        static_cast<void*>(cuda_stream.handle()), device_);
}

void CudaBackend::stream_wait_event(Stream& stream, Event& event) {
  CudaStream& cuda_stream = cuda_stream_or_throw(stream, "stream_wait_event");
  CudaEvent& cuda_event = cuda_event_or_throw(event, "stream_wait_event");
  make_current();
  // Waiting on another device's event is allowed; the wait captures the event as recorded now.
  SHADOWSYNC_CUDA_CHECK(cudaStreamWaitEvent(cuda_stream.handle(), cuda_event.handle(), 0),
                        "stream={} event={} device={}", static_cast<void*>(cuda_stream.handle()),
                        static_cast<void*>(cuda_event.handle()), device_);
}

bool CudaBackend::event_query(Event& event) {
  CudaEvent& cuda_event = cuda_event_or_throw(event, "event_query");
  make_current();
  const cudaError_t status = cudaEventQuery(cuda_event.handle());
  if (status == cudaSuccess) return true;
  if (status == cudaErrorNotReady) {
    // Not an error, but the runtime may still have recorded it as the thread's last error.
    cuda_detail::clear_last_error();
    return false;
  }
  cuda_detail::throw_cuda_error(
      status, "cudaEventQuery(event)",
      fmt::format("event={} device={}", static_cast<void*>(cuda_event.handle()), device_), __FILE__,
      __LINE__);
}

bool CudaBackend::event_wait_for(Event& event, std::chrono::nanoseconds timeout) {
  using Clock = std::chrono::steady_clock;
  if (event_query(event)) return true;
  if (timeout <= std::chrono::nanoseconds::zero()) return false;
  const Clock::time_point start = Clock::now();
  // start + timeout would overflow for "forever" timeouts such as nanoseconds::max().
  const Clock::time_point deadline =
      timeout >= Clock::time_point::max() - start ? Clock::time_point::max() : start + timeout;
  std::chrono::microseconds sleep = kFirstSleep;
  for (;;) {
    if (event_query(event)) return true;
    const Clock::time_point now = Clock::now();
    if (now >= deadline) return false;
    if (now - start < kSpinPhase) {
      std::this_thread::yield();
      continue;
    }
    const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now);
    std::this_thread::sleep_for(std::min(sleep, std::max(left, std::chrono::microseconds(1))));
    sleep = std::min(sleep * 2, kLongestSleep);
  }
}

void CudaBackend::stream_synchronize(Stream& stream) {
  CudaStream& cuda_stream = cuda_stream_or_throw(stream, "stream_synchronize");
  make_current();
  SHADOWSYNC_CUDA_CHECK(cudaStreamSynchronize(cuda_stream.handle()), "stream={} device={}",
                        static_cast<void*>(cuda_stream.handle()), device_);
}

void CudaBackend::checksum_async(const void* data, std::size_t bytes, std::uint64_t* result,
                                 Stream& stream) {
  CudaStream& cuda_stream = cuda_stream_or_throw(stream, "checksum_async");
  // The kernel reads whole 8-byte words.
  check_checksum_args("CudaBackend::checksum_async", data, bytes, result, /*alignment=*/8);
  make_current();
  SHADOWSYNC_CUDA_CHECK(cuda_detail::launch_checksum(data, bytes, result, cuda_stream.handle()),
                        "data={} bytes={} stream={} device={}", data, bytes,
                        static_cast<void*>(cuda_stream.handle()), device_);
}

void CudaBackend::count_nonfinite_async(const void* data, std::size_t elements, DType dtype,
                                        std::uint64_t* result, Stream& stream) {
  CudaStream& cuda_stream = cuda_stream_or_throw(stream, "count_nonfinite_async");
  check_nonfinite_args("CudaBackend::count_nonfinite_async", data, elements, dtype, result,
                       /*element_aligned=*/true);
  const std::size_t element_bytes = dtype_size(dtype);
  make_current();
  SHADOWSYNC_CUDA_CHECK(
      cuda_detail::launch_count_nonfinite(data, elements, element_bytes, dtype == DType::kBFloat16,
                                          result, cuda_stream.handle()),
      "data={} elements={} dtype={} stream={} device={}", data, elements, dtype_name(dtype),
      static_cast<void*>(cuda_stream.handle()), device_);
}

void CudaBackend::quantize_fp8_async(const void* src, DType dtype, std::size_t elements,
                                     std::size_t parts, void* dst, float* scales,
                                     Stream& stream) {
  CudaStream& cuda_stream = cuda_stream_or_throw(stream, "quantize_fp8_async");
  check_quantize_fp8_args("CudaBackend::quantize_fp8_async", src, dtype, elements, parts, dst,
                          scales);
  make_current();
  SHADOWSYNC_CUDA_CHECK(
      cuda_detail::launch_quantize_fp8(src, dtype_size(dtype), dtype == DType::kBFloat16,
                                       elements, parts, dst, scales, cuda_stream.handle()),
      "src={} dtype={} elements={} parts={} dst={} stream={} device={}", src, dtype_name(dtype),
      elements, parts, dst, static_cast<void*>(cuda_stream.handle()), device_);
}

CudaStreamHandle CudaBackend::native(Stream& stream) {
  return cuda_stream_or_throw(stream, "native").handle();
}

CudaEventHandle CudaBackend::native(Event& event) {
  return cuda_event_or_throw(event, "native").handle();
}

int CudaBackend::device_of(Stream& stream) {
  return cuda_stream_or_throw(stream, "device_of").device();
}

}  // namespace shadowsync
